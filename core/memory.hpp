// Memory model: model states per ZeRO stage (Rajbhandari et al. 2020, arXiv:1910.02054),
// activations per layer (Korthikanti et al. 2022, arXiv:2205.05198), buffers and temporaries.
#pragma once
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// ZeRO paper section 3 / Table 1: bytes of model states per GPU for psi parameters over n data-
// parallel ranks, K bytes of optimizer state per parameter (12 for mixed-precision Adam).
// stage 0: (2+2+K) psi; 1: 4 psi + K psi/n; 2: 2 psi + (2+K) psi/n; 3: (2+2+K) psi/n.
double zero_model_state_bytes(double psi, int stage, int n, double k = 12);

// Korthikanti et al. activation bytes per layer per micro-batch of b sequences, 16-bit:
// none: s b h (34 + 5 a s / h); TP t: s b h (10 + 24/t + 5 a s/(h t));
// TP + SP: s b h (34/t + 5 a s/(h t)); selective recompute drops the 5as/h term; full recompute
// keeps only the layer input, 2 s b h (divided by t with SP).
double activation_bytes_per_layer(double s, double b, double h, double a, int t,
                                  bool sequence_parallel, Recompute r);
// The same for a model layer, generalised to ffn_hidden != 4h (34 = 18 + 4 ffn/h; the TP-split
// part 24 = 8 + 4 ffn/h) and to MoE layers (expert MLP activations for top_k * capacity_factor
// routed tokens, split over TP by DeepSpeed's token dropping); 16-bit activations are assumed by
// Korthikanti, bytes_of(dtype)/2 scales the 2-byte terms for fp32.
double activation_bytes_per_layer(const ModelSpec& m, int micro_batch, int tp,
                                  bool sequence_parallel, Recompute r, bool moe_layer,
                                  Dtype dtype = Dtype::bf16);

// Micro-batches (in units of one stage's full set of layers) whose activations pipeline stage
// `stage` holds at its peak: 1F1B keeps min(pp - stage, micro_batches); the interleaved schedule
// with v chunks keeps (2 (pp - stage - 1) + (v - 1) pp + 1) chunks of layers/(pp v) layers, which is
// Korthikanti's (1 + (p - 1)/(p v)) x p on stage 0.
double in_flight_micro_batches(int pp, int stage, int interleave, int micro_batches);

// Layers [first, last) of pipeline stage `stage`: ParallelSpec::partition if it sums to the layer
// count, else uniform layers / pp with the first (layers % pp) stages taking one more.
struct StageLayers { int first = 0, last = 0; int count() const { return last - first; } };
StageLayers stage_layers(const Scenario& sc, int stage);

// Parameter elements resident on one GPU of pipeline stage `stage` before ZeRO sharding (after the
// TP split): the dense part is replicated over dp, the expert part (MoE) over dp / ep.
struct StageParameters {
  double dense = 0, expert = 0;
  double largest_module = 0;  // largest single module's elements (what ZeRO-3 gathers at once)
  double largest_block = 0;   // largest transformer layer's (FSDP unit's) elements, embedding / head included
  double persistent = 0;      // ZeRO-3: elements of tensors under param_persistence_threshold
  // Fine-tuning (core/finetune.hpp): the elements that train (gradients, optimizer states); LoRA
  // adapters are in dense too. Equal to dense / expert when nothing is frozen.
  double trainable_dense = 0, trainable_expert = 0;
  double total() const { return dense + expert; }
  double trainable() const { return trainable_dense + trainable_expert; }
};
StageParameters stage_parameters(const Scenario& sc, int stage);

struct MemoryBreakdown {
  double params = 0;        // 16-bit (or fp32) compute copy of parameters resident on the GPU
                            // (ZeRO-3: the shard plus the gathered working set, params_gathered)
  double grads = 0;         // gradients resident on the GPU
  double optimizer = 0;     // fp32 master params + Adam moments resident on the GPU
  double activations = 0;   // activations kept for backward at the peak (1F1B in-flight micro-batches)
  double comm_buffers = 0;  // ZeRO reduce / all-gather buckets, pipeline p2p buffers
  double temporaries = 0;   // largest transient: logits + loss, recompute working set, workspace
  double host = 0;          // host (CPU) memory when offloading, per GPU
  double nvme = 0;          // ZeRO-Infinity: bytes on the node's NVMe, per GPU (not in total())
  // Informational parts of the categories above (not added again by total()):
  double params_gathered = 0;  // ZeRO-3: gathered working set + persistent small params, in params
  double model_states() const { return params - params_gathered + grads + optimizer; }
  double total() const { return params + grads + optimizer + activations + comm_buffers + temporaries; }
};

// dssim's torch engine at ZeRO stages 0/1 steps from the reduced 16-bit gradient buckets in place
// (backends/torch/optimizer_kernels.hpp fused_adamw_step) and keeps no fp32 gradient accumulator:
// each bucket is reduced once per step, after its last backward, so such a buffer would only hold
// the same values widened. Not with optimizer offload (the host sums), 1-bit Adam (its momentum
// update reads the fp32 gradient before the step) or MoE (the expert store's own fp32 buffer), and
// not with optimizer.fused_step false (the step before issue 15).
bool steps_gradient_buckets_in_place(const Scenario& sc);

// dssim's torch engine at ZeRO-3 on one data-parallel rank with the gradient partition in the
// training dtype: the partition is then the whole model, laid out as the parameters, so backward
// accumulates into it (AccumulateGrad into its views) and no layer group's 16-bit gradients are
// zero-filled and folded into it per micro-batch, as at stage 2 on one rank. (DeepSpeed
// reduce-scatters over its group of one and copies the result in.) Not with frozen tensors (the
// partition holds the trainable ones only), offload, or sequence parallelism (its replicated
// gradients are summed over the TP group before the fold).
bool zero3_backward_into_partition(const Scenario& sc);

// Peak per-GPU memory of the most loaded GPU of the scenario (pipeline stage 0 unless the
// partition says otherwise), by category.
MemoryBreakdown peak_memory(const Scenario& sc);
// Same for a given pipeline stage.
MemoryBreakdown stage_memory(const Scenario& sc, int stage);

}  // namespace dssim
