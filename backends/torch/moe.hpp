// Mixture of experts as DeepSpeed-MoE runs it (deepspeed/moe/sharded_moe.py: TopKGate, MOELayer;
// GShard's algorithm 2): every model.moe_every-th layer's MLP is model.experts expert MLPs, sharded
// over the expert-parallel group (parallel.ep data-parallel ranks, core/grid.hpp), each rank
// holding experts / ep of them.
//
//   gate       fp32 logits = x W_g^T (W_g [experts, h], no bias; Jitter multiplies x by U(1-e, 1+e)
//              first), softmax, top-1 (argmax; RSample: of the logits plus Gumbel noise) or top-2
//              (argmax, then the argmax of the noisy logits over the other experts);
//   capacity   max(ceil(k tokens / experts x capacity_factor), min_capacity) slots per expert per
//              source rank; assignments over it are dropped: top-1 keeps a random subset
//              (use_rts, Random Token Selection) or the first ones, top-2 the first (first choices
//              ahead of second choices). drop_tokens false: the capacity is the largest load,
//              maximised over the expert-parallel group;
//   l_aux      top-1: E sum_e mean(gates_e) mean(first choice == e); top-2: the same with E^2 mean;
//   dispatch   tokens copied to [experts, capacity, h] slots, all-to-all over the EP group (each
//              rank receives its experts' slots from every rank), the local experts' MLPs, all-to-
//              all back, combine: sum of the expert outputs weighted by the gate (top-2: the two
//              gates renormalised to sum to 1);
//   tp > 1     the experts are not TP-split and the tokens are the same on every TP rank: each keeps
//              its 1/t of the capacity slots before the dispatch all-to-all and all-gathers the
//              combined slots over the TP group after the combine all-to-all (sharded_moe.py
//              MOELayer.forward: drop_tokens / gather_tokens, dim=1; tensor_parallel.hpp). The
//              capacity must be divisible by t (DeepSpeed's assert in _drop_tokens); without token
//              dropping it is rounded up to a multiple of t (top1gating / top2gating).
//
// Expert parameters live outside the dense ZeRO partition (ExpertStore): their own flat buffers
// and ZeRO stage 0/1/2 partition over the expert-data-parallel group (the ranks holding the same
// experts), reduced there and averaged over the whole data-parallel size (DeepSpeed's
// _reduce_expert_gradients), as the Program's expert buckets say. With tp > 1 that group also
// holds TP peers (core/grid.hpp, DeepSpeed's groups for non-TP experts), which saw other capacity
// slots: its sum is the gradient of every slot of every data-parallel replica, so the copies of
// an expert stay equal.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/tensor_parallel.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/zero_partition.hpp"

namespace dssim::tb {

// One layer's routing of T tokens, k assignments each.
struct Routing {
  int64_t capacity = 0;
  at::Tensor expert;      // [T, k] int64
  at::Tensor slot;        // [T, k] int64: place in the expert's capacity buffer, -1 when dropped
  at::Tensor weight;      // [T, k] fp32 combine weight (differentiable), 0 when dropped
  at::Tensor l_aux;       // fp32 scalar (differentiable)
  at::Tensor exp_counts;  // [E] int64: assignments per expert before dropping
  at::Tensor dropped;     // int64 scalar: assignments dropped (on the device: no host synchronisation)
};

// The gate's decision on fp32 logits [T, E] (DeepSpeed's top1gating / top2gating). `gen` draws
// the random token selection and the Gumbel noise; `max_over_group` (drop_tokens false) turns
// this rank's largest load into the expert-parallel group's.
Routing top_k_gating(const at::Tensor& logits, const ModelSpec& m, at::Generator& gen,
                     const std::function<int64_t(int64_t)>& max_over_group = {});

// The expert-parallel group of a rank and the ledger of its all-to-alls: the engine expects the
// Program's MoEDispatch / MoECombine instructions that follow a compute instruction and checks at
// the next one that the engine issued the same (purpose, bytes) multiset.
struct ExpertParallel {
  Communicator* comm = nullptr;  // nullptr: ep = 1 (the all-to-all is the identity, not counted)
  int size = 1, rank = 0;
  bool check_bytes = true;       // drop_tokens false: the capacity is known at run time only
  // Dtype on the wire: the run's 16-bit or fp32 dtype (CPUs compute fp16 runs in fp32).
  at::ScalarType wire_dtype = at::kFloat;
  std::vector<std::pair<Purpose, double>> ledger, expected;
  bool timing = false;
  std::function<void()> sync;
  double seconds = 0;
  void expect(Purpose p, double bytes, int repeat);
  void check(const std::string& where);
  at::Tensor all_to_all(const at::Tensor& x, Purpose p);
};

// What a MoE layer's MLP needs besides the gate weight and its input.
struct MoeLayer {
  const ModelSpec* model = nullptr;
  ExpertParallel* ep = nullptr;
  TensorParallel* tp = nullptr;                  // the layer's TP group (nullptr or size 1: no drop / gather)
  // Local experts: fc.w [f, h], fc.b [f], fc2.w [h, f], fc2.b [h], in the compute dtype.
  std::vector<std::vector<at::Tensor>> experts;
  uint64_t seed = 0;                             // this layer's and micro-batch's noise and token selection
  // Out: the load-balancing loss (differentiable) and the routing statistics.
  at::Tensor l_aux, dropped;
  int64_t tokens = 0, assignments = 0, capacity = 0;
};

// The gate of tokens [T, h] with W_g [experts, h]: fp32 logits of the (jittered) tokens, routed.
Routing moe_gate(const at::Tensor& tokens, const at::Tensor& gate_w, const ModelSpec& m, at::Generator& gen,
                 const std::function<int64_t(int64_t)>& max_over_group = {});

// The dispatch buffer [experts x capacity, h] of tokens [T, h] (each kept assignment's token in
// its expert's slot, the rest zero), and the combine of the experts' outputs [experts x capacity,
// h] back to [T, h] (each token's kept outputs weighted by its gates). Both differentiable, no
// data-dependent shapes (no host synchronisation).
at::Tensor moe_dispatch(const at::Tensor& tokens, const Routing& r, int64_t experts);
at::Tensor moe_combine(const at::Tensor& expert_out, const Routing& r);

// The seed of a MoE layer's gate noise and token selection for one micro-batch: a pure function
// of (run seed, step, the micro-batch's index in the global batch, layer), so that a layout that
// splits the batch differently routes every token the same way.
uint64_t moe_layer_seed(uint64_t seed, int64_t step, uint64_t global_micro_batch, int layer);

// Routing statistics over the measured steps (MoeLayer's outputs, summed on the device without a
// host synchronisation), and their totals over every rank (control traffic): mean l_aux per
// layer run, share of assignments dropped, tokens gated per layer run, the largest capacity.
struct MoeStats {
  void add(const MoeLayer& m);
  std::map<std::string, double> over_world(Communicator& world, const torch::Device& dev) const;

 private:
  at::Tensor aux_, dropped_;
  double tokens_ = 0, assignments_ = 0, capacity_ = 0, runs_ = 0;
};

// The MoE MLP of normalised activations x [B, S, h] -> [B, S, h].
at::Tensor moe_mlp_forward(MoeLayer& layer, const at::Tensor& gate_w, const at::Tensor& x);

// The expert parameters of one pipeline stage, their gradients and optimizer states, partitioned
// like the Program's expert partition (core/stage_plan.cpp: per MoE layer, per local
// expert, fc.w fc.b fc2.w fc2.b; ZeRO over the expert-data-parallel group).
class ExpertStore {
 public:
  struct Options {
    int stage = 0;            // ZeRO 0..2
    int dp = 1;               // whole data-parallel size (the average's divisor)
    int ep = 1, ep_rank = 0;  // expert-parallel size and this rank's place in it
    int edp_rank = 0;         // place in the expert-data-parallel group (size dp / ep)
    int64_t reduce_bucket_size = 500000000, allgather_bucket_size = 500000000;
    at::ScalarType dtype = at::kFloat;
    torch::Device device = torch::Device(torch::kCPU);
    uint64_t seed = 0;
  };
  // `moe_layers`: the stage's MoE layers in the Program's order; `edp`: the expert-data-parallel
  // communicator (size 1: no reductions, the local gradients are the group's).
  ExpertStore(const ModelSpec& m, const std::vector<int>& moe_layers, Communicator* edp, const Options& o);

  int local_experts() const { return local_; }
  bool holds(int layer) const;
  // The local experts' parameter leaves of a layer (gradients accumulate into the flat buffer).
  const std::vector<std::vector<at::Tensor>>& leaves(int layer) const;

  // The Program's expert-bucket instructions (group kind ExpertDP).
  void reduce(const Instruction& in);  // AllReduce / ReduceScatter of a gradient bucket
  void gather(const Instruction& in);  // AllGather of updated parameters (stages 1, 2)

  // At the step: the reduced gradients of this rank's part, scaled by 1/dp (folded from the local
  // buffer where the Program has no reduction), as fp32; its squared norm, counted once over the
  // world (stage 0: edp rank 0 only); then the AdamW step and the new 16-bit copy.
  at::Tensor step_gradient();
  double counted_sum_of_squares(const at::Tensor& g) const;
  void zero_gradient();
  template <class Step>
  void step(Step&& adamw) {
    adamw(master_, grad_acc_, exp_avg_, exp_avg_sq_);
    publish();
  }
  void publish();
  void after_load();  // checkpoint states read: the 16-bit copy rebuilt (stages 1/2: all-gathered)

  std::vector<at::Tensor> state() { return {master_, exp_avg_, exp_avg_sq_}; }
  // Every local expert's fp32 parameters, whole (stages 1/2 all-gather the shards), layer-major.
  at::Tensor full_master();
  double parameter_bytes() const;
  double gradient_bytes() const;
  double optimizer_bytes() const;
  const ZeroPartition& partition() const { return part_; }

 private:
  void check_bucket_bytes(const Instruction& in, double bytes) const;
  void fold(const Range& r, const at::Tensor& summed);

  const ModelSpec& m_;
  Options o_;
  Communicator* edp_;
  int local_ = 1;
  std::vector<int> layers_;
  ZeroPartition part_;
  at::Tensor flat16_, grad16_, master_, exp_avg_, exp_avg_sq_, grad_acc_;
  std::vector<std::vector<std::vector<at::Tensor>>> leaves_;  // [layer index][local expert][4]
  std::vector<bool> reduced_;  // per gradient bucket, this step
};

// Expert parameter count of one expert (fc.w, fc.b, fc2.w, fc2.b).
int64_t expert_numel(const ModelSpec& m);

}  // namespace dssim::tb
