// The optimizer step's kernels, shared by the engine (engine.cpp) and `dssim calibrate`
// (calibrate_memory.cpp), so that the rate the calibration measures is the rate of the code that trains.
//
// One step of the engine, per parameter of this rank's shard (fused_adamw_step, one pass; issue
// 15): the gradient read where it lies (stages 0/1: the reduced 16-bit buckets, stage 2: the
// 16-bit partition, stage 3: the fp32 accumulator), the fp32 master and the moments read and
// written, the 16-bit copy of the parameter written, the gradient cleared:
//   16-bit gradients   read 2 + 12, write 12 + 2 + 2   = 30 bytes  (kStepBytesPerParam16)
//   fp32 accumulator   read 4 + 12, write 12 + 2 + 4   = 34 bytes
// The step before it (optimizer.fused_step: false, libtorch's ops) folded the 16-bit gradients
// into an fp32 buffer (12), ran AdamW over it (28), cleared it (4) and published (6): 50 bytes.
// core/program_builder.cpp counts the same bytes for the OptimizerStep instruction, and the
// profile's `optimizer_step` row is bytes/s over kStepBytesPerParam16.
#pragma once
#include <cstdint>
#include <ATen/ATen.h>

namespace dssim::tb {

struct AdamWHyper {
  double lr = 1e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

constexpr double kFoldBytesPerParam16 = 12, kAdamWBytesPerParam = 28, kClearBytesPerParam = 4,
                 kPublishBytesPerParam16 = 6;
constexpr double kStepBytesPerParam16 = 2 + 12 + 12 + 2 + 2;
// 1-bit Adam's step in its compressed phase (backends/torch/onebit_adam.cpp, frozen variance), as
// the engine runs it on one rank: fold (12), momentum m = b1 m + (1 - b1) g (mul_ and add_: read
// 4 + 4 + 4, write 4 + 4 = 20), clear g32 (4), the update p = p (1 - lr wd) - lr / bc1 m /
// (sqrt(v) / sqrt(bc2) + eps) in five passes (p.mul_ 8, sqrt 8, scale 8, add eps 8, addcdiv_ 16:
// 48), publish (6): the profile's `onebit_step` rows (core/program_builder.cpp counts the same).
constexpr double kOnebitMomentumBytesPerParam = 20, kOnebitUpdateBytesPerParam = 48;
constexpr double kOnebitStepBytesPerParam16 = kFoldBytesPerParam16 + kOnebitMomentumBytesPerParam +
                                              kClearBytesPerParam + kOnebitUpdateBytesPerParam + kPublishBytesPerParam16;
// The offloaded step on the host (host_step_and_publish), per parameter: the AdamW pass, the
// gradient buffer's clear in the same pass, and the 16-bit copy written for the device
// (core/program_builder.cpp's host_step_bytes_per_param; the profile's `host_adamw` rows).
constexpr double kHostStepBytesPerParam16 = kAdamWBytesPerParam + kClearBytesPerParam + 2;

// torch.optim.AdamW on one flat fp32 shard, `step` 1-based. On CUDA (libtorch >= 2.4) the fused
// multi-tensor kernel of AdamW(fused=True); elsewhere a fused loop (one pass over p, g, m, v,
// parallel over chunks, as DeepSpeed's CPUAdam does), with no full-size temporaries. When `out16`
// is defined (a host tensor of 16-bit dtype, same numel) the loop also writes the updated
// parameters converted to it (DeepSpeed's step-plus-copy).
// `clear_grad`: g is zeroed afterwards (on the host in the same pass: 4 more bytes written per
// parameter instead of a separate fill's 8 of write and read-for-ownership).
void adamw_step(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step,
                const AdamWHyper& h, at::Tensor* step_tensor = nullptr, at::Tensor* out16 = nullptr,
                bool clear_grad = false);

// The engine's step on one flat shard in one pass (issue 15): the gradient g (fp32, bf16 or fp16,
// on p's device; the value used is g * pre * coef, each a float multiply, as the fp32 accumulator
// would hold it), AdamW on p, m, v (torch.optim.AdamW's formula), the updated parameters written
// converted into `out` (bf16, fp16 or fp32; undefined: none) and g zeroed when clear_grad.
// Fused: on CUDA the kernel of fused_adamw_cuda.cu where nvcc built it (DSSIM_HAVE_CUDA_KERNELS),
// on the host the fused loop; elsewhere, or with path Ops, libtorch's ops pass by pass (the
// gradient copied to fp32 if 16-bit, scaled, adamw_step, the clear, the copy), the reference.
enum class StepPath { Fused, Ops };
void fused_adamw_step(at::Tensor& p, at::Tensor g, at::Tensor& m, at::Tensor& v, int64_t step, const AdamWHyper& h,
                      double pre, double coef, at::Tensor out, bool clear_grad, at::Tensor* step_tensor,
                      StepPath path = StepPath::Fused);
// Whether this build has the CUDA kernel (nvcc and a CUDA libtorch).
bool fused_step_kernel_available();

// ZeRO-Offload's host step (DeepSpeed's CPUAdam step-plus-copy): AdamW over host fp32 p, g, m, v
// in chunks of 2^26 elements, each chunk's updated parameters written into `dst` (16-bit or fp32,
// host or device) in the same pass; chunks bound for a device go through one pinned buffer
// (`staging`, allocated on first use), copied synchronously. g is zeroed in the same pass (the
// gradient buffer's clear for the next step). Returns the seconds spent copying.
// The engine's HostOptimizerStep and `dssim calibrate`'s host_adamw rows both run this.
double host_step_and_publish(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step,
                             const AdamWHyper& h, at::Tensor dst, at::Tensor& staging);

// acc += scale * src on the host, src fp32 or 16-bit (ZeRO-Offload's gradient accumulation into
// the host fp32 buffer): one parallel pass, no temporary.
// `threads` 0: at::get_num_threads().
void host_accumulate(at::Tensor acc, const at::Tensor& src, double scale, int threads = 0);

// The threads of the engine's host gradient sums during the backward (and of calibrate's
// host_accumulate rows): all of libtorch's but two, which the thread driving the GPU and the
// sums' worker keep.
int host_accumulate_threads();

}  // namespace dssim::tb
