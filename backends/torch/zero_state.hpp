// The ZeRO state of the torch engine (engine.cpp): the memory layout of one rank (core/
// zero_partition.hpp applied to real tensors: flat fp32 masters, whole or this rank's shard, 16-bit
// compute copies, flat gradient buffers), the stage-1/2 gradient buckets and parameter all-gathers,
// the stage-3 layer groups with their gathers, releases and reduce-scatters, the overlap of those
// collectives with the compute, ZeRO-Offload's host gradient sums and step, and the optimizer's
// sharded fp32 state. The engine interprets the Program and calls in here for the ZeRO
// instructions and for the parameters and gradient buffers its compute uses.
// Implemented in zero_state.cpp (layout, buffers, reductions, optimizer), zero3_groups.cpp (stage 3's
// layer groups) and zero_offload.cpp (ZeRO-Offload's host side).
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/gpt.hpp"
#include "backends/torch/host_accumulator.hpp"
#include "backends/torch/optimizer_kernels.hpp"
#include "backends/torch/pipeline.hpp"
#include "backends/torch/stopwatch.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/zero_partition.hpp"

namespace dssim::tb {

// The parameter tensors in model order with their layer (module) for ZeRO-3 fetching: the
// partition the Program's byte counts come from, applied here to real tensors.
ZeroPartitionSpec partition_spec(const GptConfig& c, const ZeroSpec& z, int dp, const std::vector<int>& units);

// A collective's bytes as the engine lays them out against the instruction's (mismatch = error).
void check_bytes(const Instruction& in, double engine_bytes);

class ZeroState {
 public:
  // What the engine decided and owns: the run's settings, the data-parallel communicator, and the
  // engine's flags and timers that the ZeRO work reads or adds to.
  struct Context {
    int stage = 0, dp = 1, dpr = 0, tp_rank = 0;  // ZeRO stage, data-parallel size and rank, TP rank
    at::ScalarType dtype = at::kFloat;
    torch::Device device = torch::Device(torch::kCPU), state_device = torch::Device(torch::kCPU);
    bool offload = false, offload_param = false, overlap = true, grads_in_place = false;
    Communicator* dp_comm = nullptr;
    const bool* measuring = nullptr;    // the engine measures this step
    const bool* local_grads = nullptr;  // 1-bit Adam's compressed phase: gradients stay on their rank
    std::map<std::string, double>* inner_seconds = nullptr;  // by instruction kind (engine.cpp execute())
    std::function<void()> timing_sync;  // waits for the compute stream when measuring
  };
  ZeroState(const Scenario& sc, const GptConfig& cfg, const StageLayout& layout, const Context& ctx);

  // ---- memory -------------------------------------------------------------------------------
  int64_t unit_offset(int u) const;
  int64_t train_numel(int u) const { return unit_train_numel_[u]; }
  // Stage 3: a group's full flat tensor -> rank r's partition (per tensor ceil(n / dp), zero
  // padded); trainable_only: of its trainable tensors (what is reduce-scattered and stepped).
  at::Tensor full_to_shard(int gi, const at::Tensor& full, int r, bool trainable_only = false) const;
  void trainable_pieces(const at::Tensor& train, const at::Tensor& shard, bool to_shard) const;
  void gathered_to_full(int gi, const at::Tensor& gathered, at::Tensor full) const;
  int64_t tensor_numel(int ti) const;
  void release_group(int g);
  int group_of(int u) const;
  // Unit u's parameter leaves, for a use named `why` (stage 3: once its group is gathered).
  const std::vector<at::Tensor>& param(int u, const char* why);
  void prepare_grad(int u);
  void fold_group_now(int g);
  void mark_dirty(int u);
  // Stage 3: after instruction pc used `groups`.
  void after_use(size_t pc, const std::vector<int>& groups);
  // Stage 3: which groups stay resident after each instruction (groups_of: an instruction's).
  void plan_residency(const RankProgram& rp, const std::function<std::vector<int>(const Instruction&)>& groups_of);
  // The groups the Program never gathers, gathered once (run start).
  void gather_persistent();

  // ---- communication ------------------------------------------------------------------------
  // 1-bit Adam's compressed phase keeps each rank's own gradient (its momentum is averaged).
  double scale_for_average() const { return local_grads_ ? 1.0 : 1.0 / double(dp_); }
  void reduce_gradients(const Instruction& in);  // the dense buckets / layer groups
  void gather_params(const Instruction& in);     // stages 1-3
  void gather_group(int gi, const Instruction* in);
  void fold_local_bucket(int k);
  void complete_buckets(int u);
  at::Tensor& bucket_grad(int k);
  void copy_d2h(const Instruction& in);
  void copy_h2d(const Instruction& in);

  // ---- overlap ------------------------------------------------------------------------------
  // A collective's result is consumed later than it is issued, as on a comm stream: gradient
  // reductions complete when the next micro-batch (or the optimizer) needs the buckets, ZeRO-3
  // gathers when their layer is first used, so communication overlaps the compute in between
  // (gloo works on its own threads; nccl on its own stream). overlap_comm = false completes each
  // at once.
  struct Deferred {
    enum Kind { Reduce, Gather12, Gather3 } kind;
    int key;          // bucket or layer group
    int micro_batch;  // of a reduction
    std::shared_ptr<Work> work;
    std::function<void()> post;
  };
  template <class Pred>
  void flush(Pred pred) {
    std::vector<Deferred> keep;
    std::vector<Deferred> todo;
    for (auto& d : deferred_) (pred(d) ? todo : keep).push_back(std::move(d));
    deferred_.swap(keep);
    for (auto& d : todo) finish(d);  // in issue order
  }
  void flush_all() { flush([](const Deferred&) { return true; }); }
  double comm_wait_seconds() const { return comm_wait_seconds_; }

  double elt16() const { return double(at::elementSize(dtype_)); }
  static double bytes(const at::Tensor& t) { return t.defined() ? double(t.numel() * t.element_size()) : 0; }

  // ---- optimizer ----------------------------------------------------------------------------
  // The step's gradient where it lies once every reduction is folded (and, offloaded, summed on
  // the host); pre: the data-parallel average not yet applied (the 16-bit buckets stepped in place).
  at::Tensor step_gradient_buffer(double& pre);
  // The squared norm of acc's counted ranges (each parameter once over TP and pipeline stages).
  at::Tensor counted_sum_of_squares(const at::Tensor& acc) const;
  void clear_held_for_step() { std::fill(held_for_step_.begin(), held_for_step_.end(), false); }
  at::Tensor publish_target();
  void publish_master();
  void host_step_and_publish(const at::Tensor& g, const AdamWHyper& hyper, int64_t adam_step);
  // Every rank's 16-bit copy whole again after a checkpoint's load.
  void regather_params();
  at::Tensor full_master();
  std::vector<std::vector<at::Tensor>> unit_params_fp32();

  // ---- measurements -------------------------------------------------------------------------
  void start_measuring();
  void host_offload_stats(std::map<std::string, double>& out);
  const std::map<std::pair<Op, Purpose>, double>& copy_bytes() const { return copy_bytes_; }
  const std::map<std::pair<Op, Purpose>, int64_t>& copy_calls() const { return copy_calls_; }
  struct MemoryBytes {
    double params = 0, grads = 0, optim = 0;
    double layer_grads_peak = 0;  // stage 3: the layer groups' 16-bit gradients alive at once, at most
  };
  MemoryBytes memory_bytes() const;
  // Stage 3: backward accumulated into the gradient partition (no per-layer buffers, no fold):
  // core/memory.hpp zero3_backward_into_partition, unless DSSIM_ZERO3_FOLD=1 turned it off.
  bool zero3_backward_into_partition() const { return stage_ == 3 && direct_partition_; }

  // ---- what the engine reads and steps ------------------------------------------------------
  // The layout; the sharded optimizer state (stepped by the engine's AdamW or 1-bit Adam,
  // checkpointed): the fp32 master (whole, or this rank's shard) and both moments.
  const ZeroPartition& partition() const { return part_; }
  at::Tensor& master() { return master_; }
  at::Tensor& exp_avg() { return exp_avg_; }
  at::Tensor& exp_avg_sq() { return exp_avg_sq_; }
  // Stages 0-2: the flat 16-bit gradient buffer (summed over the TP group under sequence
  // parallelism), whether bucket k holds gradients of this step, and the TP-replicated tensors'
  // ranges in the flat layout.
  const at::Tensor& grad16() const { return grad16_; }
  bool grad_dirty(size_t bucket) const { return grad_dirty_[bucket]; }
  const std::vector<std::pair<int64_t, int64_t>>& replicated_ranges() const { return replicated_ranges_; }

 private:
  ZeroPartition part_;
  at::Tensor flat16_, grad16_, shard16_, master_, exp_avg_, exp_avg_sq_, grad_acc_;
  std::vector<bool> grad_dirty_;
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges_;  // TP-replicated tensors in the flat layout

  void allocate();
  std::vector<at::Tensor> leaves(const at::Tensor& flat, const at::Tensor& grad_flat, int u);
  std::vector<at::Tensor> partition_leaves(int u, const at::Tensor& grad_flat);
  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf, const Instruction& in);
  void accumulate(int bucket, int64_t acc_offset, const at::Tensor& reduced);
  void copy_gradients_to_host(int bucket);
  void count_copy(Op op, Purpose p, double bytes);
  void fold_full(const Range& r, const at::Tensor& buf, int bucket);
  void keep_for_step(int k);
  void drop_group_grad(int g);
  void bind_group_grads(int g, const at::Tensor& flat);
  at::Tensor take_bucket(int k);
  void free_bucket(at::Tensor& buf);
  void recycle(at::Tensor& buf);
  at::Tensor& leaf_of_tensor(int t) { return p16_[tensor_leaf_[t].first][tensor_leaf_[t].second]; }
  void make_room_for_bucket();
  bool has_sp_sum(int k) const;
  void fold_unreduced();
  void defer(Deferred d);
  void finish(Deferred& d);
  void plan_gradient_norm();
  void drain_host_accumulation();

  const Scenario& sc_;
  const GptConfig& cfg_;
  const StageLayout& layout_;
  int stage_, dp_, dpr_, tp_rank_;  // ZeRO stage, data-parallel size, data-parallel rank, TP rank
  at::ScalarType dtype_;
  torch::Device dev_, state_device_;
  bool offload_, offload_param_, overlap_;
  Communicator* dp_comm_;
  const bool& measuring_;
  const bool& local_grads_;
  std::map<std::string, double>& inner_seconds_;
  std::function<void()> timing_sync;
  // tp / pp > 1: the ranges of the accumulator this rank counts in the global norm.
  std::vector<std::pair<int64_t, int64_t>> norm_ranges_;
  bool norm_by_ranges_ = false;
  std::map<int, std::vector<std::pair<int64_t, at::Tensor>>> d2h_pending_;
  std::map<int, at::Tensor> staged_;
  std::map<std::pair<Op, Purpose>, double> copy_bytes_;
  std::map<std::pair<Op, Purpose>, int64_t> copy_calls_;
  std::vector<int> first_tensor_;  // per unit: its first tensor in the partition
  // Fine-tuning: per unit its trainable elements and partition tensors, per (unit, parameter) the
  // offset in frozen16_ (-1: in the partition); per partition tensor whether it trains; stage 3:
  // each group's trainable shard in master_.
  std::vector<int64_t> unit_train_numel_;
  std::vector<int> unit_train_count_;
  std::vector<std::vector<int64_t>> frozen_offset_;
  std::vector<bool> part_trainable_;
  std::vector<int64_t> group_train_offset_;
  at::Tensor frozen16_;  // stages 0-2: the frozen tensors, whole, in the compute dtype
  std::vector<std::pair<int, int>> tensor_leaf_;  // per tensor of the partition: (unit, index in p16_[unit])
  std::vector<std::vector<at::Tensor>> p16_;  // per unit: the parameter leaves
  std::vector<bool> gathered_;
  at::Tensor staging16_;
  HostAccumulator host_acc_;  // its jobs hold the tensors they write
  double host_acc_bytes_ = 0;  // the host sums' memory traffic over the measured steps
  double host_copy_wait_seconds_ = 0;  // of the worker's busy time, waiting for the copies to land
  // Stages 0/1: the step reads the reduced 16-bit buckets in place (no grad_acc_); held_for_step_:
  // buckets reduced in this step, which no backward may write into before the step.
  bool grads_in_place_ = false;
  std::vector<bool> held_for_step_;
  std::vector<at::Tensor> full16_, gradg_;         // stage 3, per layer group
  double gradg_bytes_ = 0, gradg_peak_ = 0;        // of gradg_: now, and at most
  std::vector<std::vector<int>> group_units_;
  std::vector<int64_t> unit_group_offset_;
  std::vector<int64_t> group_shard_offset_;
  // Stage 2: the bucket buffers being filled (undefined when none), the bytes of those and of the
  // ones in flight, and their peak; direct_partition_: one rank accumulating into the partition
  // (stage 2; stage 3 where core/memory.hpp zero3_backward_into_partition says so).
  std::vector<at::Tensor> bucket16_;
  double bucket_bytes_ = 0, bucket_peak_ = 0;
  bool direct_partition_ = false;
  std::vector<std::vector<bool>> keep_after_use_;
  std::vector<int> persistent_;
  double comm_wait_seconds_ = 0;
  bool aliased_ = false;  // ZeRO-3 on one rank: the gathered parameters are views of the shard
  std::vector<Deferred> deferred_;
};

}  // namespace dssim::tb
