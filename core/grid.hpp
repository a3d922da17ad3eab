// Process grid: global rank <-> (dp, pp, tp) coordinates and the communicator groups of a rank.
//
// Rank order is Megatron-LM's (megatron/core/parallel_state.py, initialize_model_parallel, without
// context parallelism): tensor-parallel fastest, then data-parallel, then pipeline,
//     rank = tp + T * (dp + D * pp),
// so a TP group is T consecutive ranks (inside one node when T <= gpus_per_node), a DP group is the
// ranks of one pipeline stage with the same tp index (stride T), and a PP group strides by T*D
// (= world / P). The embedding group of a pipeline is its first and last stage.
//
// Expert parallelism is carved out of data parallelism as DeepSpeed
// (deepspeed/utils/groups.py, _create_expert_and_data_parallel) and Megatron-core do it: inside a DP
// group (dp indices 0..D-1), EP groups are E consecutive dp indices, ep = dp % E; the ranks holding
// the same experts (same ep, different dp / E) form the expert-data-parallel group.
#pragma once
#include <vector>
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct RankCoord {
  int dp = 0, pp = 0, tp = 0;
  int ep = 0;    // position inside the expert-parallel group: dp % E
  int edp = 0;   // position inside the expert-data-parallel group: dp / E
  bool operator==(const RankCoord&) const = default;
};

class ProcessGrid {
 public:
  // Throws std::invalid_argument when a size is < 1 or ep does not divide dp.
  explicit ProcessGrid(const ParallelSpec& p);

  int world() const { return tp_ * dp_ * pp_; }
  int tp() const { return tp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }

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
