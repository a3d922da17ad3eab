// Process grid: global rank <-> (dp, pp, tp) coordinates and the communicator groups of a rank.
//
// Rank order is Megatron-LM's (megatron/core/parallel_state.py, initialize_model_parallel, without
// context parallelism): tensor-parallel fastest, then data-parallel, then pipeline,
//     rank = tp + T * (dp + D * pp),
// so a TP group is T consecutive ranks (inside one node when T <= gpus_per_node), a DP group is the
// ranks of one pipeline stage with the same tp index (stride T), and a PP group strides by T*D
// (= world / P). The embedding group of a pipeline is its first and last stage.
//
// Expert parallelism is carved out of data parallelism as DeepSpeed's MoE layer does it with
// non-tensor-parallel experts (deepspeed/moe/layer.py MoE._create_process_groups: without
// enable_expert_tensor_parallelism it calls deepspeed/utils/groups.py
// _create_expert_and_data_parallel(ep_size) without mp_size, the "legacy" path): over the T*D ranks
// of one pipeline stage in rank order (q = tp + T dp), EP groups are E consecutive ranks
// (ep = q % E) and the ranks holding the same experts (same ep, q / E differs) form the
// expert-data-parallel group. With tp = 1 these are E consecutive dp indices inside a DP group.
// With tp > 1 the EP and expert-data-parallel groups cross TP groups: the TP peers of a rank either
// hold other experts (same EP group) or the same ones (same expert-data-parallel group, whose
// gradient all-reduce then sums the peers' shares of the capacity; sharded_moe.py MOELayer.forward
// drops each TP rank to 1/T of the capacity). DeepSpeed's other grouping
// (_create_expert_data_and_model_parallel, EP inside the DP group of one TP index) is for experts
// split by tensor parallelism, which dssim does not model.
#pragma once
#include <vector>
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct RankCoord {
  int dp = 0, pp = 0, tp = 0;
  int ep = 0;    // position inside the expert-parallel group: (tp + T dp) % E
  int edp = 0;   // position inside the expert-data-parallel group: (tp + T dp) / E
  bool operator==(const RankCoord&) const = default;
};

// Size of the expert-data-parallel group: the ranks of a pipeline stage holding the same experts,
// tp * dp / ep (>= 1; the model's ZeRO partition of the experts spans it).
int expert_data_parallel_size(const ParallelSpec& p);

class ProcessGrid {
 public:
  // Throws std::invalid_argument when a size is < 1 or ep does not divide dp.
  explicit ProcessGrid(const ParallelSpec& p);

  int world() const { return tp_ * dp_ * pp_; }
  int tp() const { return tp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }
  int expert_dp() const { return tp_ * dp_ / ep_; }

  int rank_of(int dp, int pp, int tp) const { return tp + tp_ * (dp + dp_ * pp); }
  RankCoord coord(int rank) const;

  // Members (ascending global rank = ring order) of the group of `kind` that `rank` belongs to.
  // Embedding: {first stage, last stage} of the rank's pipeline ({rank} when pp == 1); ranks of
  // middle stages belong to no embedding group (empty vector). World: every rank.
  std::vector<int> group_of(GroupKind kind, int rank) const;
  // Index of that group among groups(kind); -1 for a middle stage's Embedding group.
  int group_index(GroupKind kind, int rank) const;
  int group_count(GroupKind kind) const;
  // Every group of a kind, in group_index order.
  std::vector<std::vector<int>> groups(GroupKind kind) const;

 private:
  int tp_, dp_, pp_, ep_;
};

}  // namespace dssim
