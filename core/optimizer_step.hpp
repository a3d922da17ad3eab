// The optimizer step's cost per parameter of the shard, as dssim's torch engine runs it
// (backends/torch/optimizer_kernels.hpp): its FLOPs, and the bytes it moves through HBM (the
// device's step) or host memory (ZeRO-Offload's). The Program builder multiplies them by the
// shard; DeepSpeed's BF16_Optimizer, which the pipeline engine runs, is core/pipeline_engine.hpp's.
#pragma once

namespace dssim {

// Mixed-precision Adam on one parameter: ~16 FLOPs.
constexpr double kAdamFlopsPerParam = 16;

// 1-bit Adam's compressed-phase update runs over the flat buffers in pieces of this many elements
// (backends/torch/onebit_adam.cpp), so its fp32 temporaries (the denominator: two at once, 8 bytes
// an element) hold 8 x min(this, shard) bytes, not 8 bytes a parameter of the shard.
constexpr long long kOnebitStepChunkElements = 1LL << 22;

// Folding g-byte gradients into an fp32 accumulator and zeroing them: 2g + 8 (stage 3 in its
// backward; stages 0/1 where the step does not read the buckets in place, at the step).
double fold_bytes_per_param(int g);

struct DeviceStep {
  int g = 2;              // bytes of a gradient / compute-copy element (2 in bf16 / fp16, 4 in fp32)
  int zero_stage = 0;
  bool fused = true;      // optimizer.fused_step: one pass (fused_adamw_step), else the step before
  bool in_place = false;  // the step reads the g-byte gradients where they lie (no fp32 accumulator)
  bool onebit = false;    // 1-bit Adam's compressed phase
  bool norm = false;      // a global norm is taken (fp16's overflow check, gradient clipping)
};
// The device step's bytes, everything the step instruction does (stage 3's fold is its backward's).
double device_step_bytes_per_param(const DeviceStep& s);

// ZeRO-Offload's host step (DeepSpeed's CPUAdam step-plus-copy) on fp32 gradients.
double host_step_bytes_per_param(int g, bool norm);

}  // namespace dssim
