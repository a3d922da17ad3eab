// LayerNorm's backward with the residual's gradient added, as two CUDA kernels (layer_norm_cuda.cu,
// compiled by nvcc when DSSIM_WITH_CUDA=ON finds the toolkit), for layer_norm_residual.hpp.
//
// In a pre-norm block x feeds both the norm and the residual add, so autograd sums two gradients
// at x: LayerNorm's dx (ATen's kernel reads dy and x, writes dx) and the residual's (an add kernel
// reads both, writes the sum), then ATen's gamma / beta kernel reads dy and x again. Here
//   rows     dx = rstd / h * (h * gamma * dy - sum(gamma * dy) - xhat * sum(gamma * dy * xhat)) + dres
//            one to four warps a row (at most 4 16-byte vectors a thread up to 4,096 bf16 columns),
//            the row held in registers between its two sums and the output
//   columns  dgamma = sum over rows of dy * xhat, dbeta = sum of dy: each thread owns 16 bytes of
//            columns, the block's warps take every 8th row of a split, fp32 partials per split
//            (as bias_grad_cuda.cu), then a thread per column sums its splits in order
// with xhat = (x - mean) * rstd from the forward's saved fp32 mean and rstd. The arithmetic is
// ATen's (layer_norm_kernel.cu: the row sums in fp32, dx's expression in that order); dres is
// added in fp32 before dx is rounded once. Bytes per element: read dy, x, dres, write dx, read dy
// and x again (6 e), where the unfused path moves 8 e (dx 3 e, the add 3 e, gamma / beta 2 e).
// No torch or CUDA headers: layer_norm_residual.cpp fills the launch from its tensors.
#pragma once
#include <cstdint>
#include "backends/torch/fused_adamw_cuda.hpp"  // DType

namespace dssim::tb::cuda {

struct LayerNormBackwardLaunch {
  const void* dy = nullptr;    // [rows x cols], of `type`
  const void* x = nullptr;     // [rows x cols], the forward's input
  const float* mean = nullptr;  // [rows], the forward's
  const float* rstd = nullptr;  // [rows]
  const void* gamma = nullptr;  // [cols], of `type`
  const void* dres = nullptr;   // [rows x cols] or null: the residual's gradient, added to dx
  void* dx = nullptr;           // [rows x cols]
  void* dgamma = nullptr;       // [cols], written (or added into: accumulate)
  void* dbeta = nullptr;        // [cols], likewise (null: no bias)
  float* partial = nullptr;     // [2 x splits x cols] fp32 workspace (the launch's; not checked by _supported)
  int64_t rows = 0, cols = 0;
  int splits = 1;
  DType type = DType::BF16;
  bool accumulate = false;  // dgamma, dbeta += the sums (the parameters' gradient buffers)
};

// Whether the kernels take this shape and these pointers: contiguous rows of cols elements, cols a
// multiple of 16 bytes' worth and at most 1,024 16-byte vectors a row (bf16 / fp16: h <= 8192,
// fp32: h <= 4096), every tensor 16-byte aligned. Outputs may still be null here (the caller allocates
// them once the kernels take the inputs; the caching allocator aligns to 512 bytes); the launch
// requires them. Otherwise the caller runs ATen's backward and an add.
bool layer_norm_backward_supported(const LayerNormBackwardLaunch& a);
// Queues both kernels (and the column sums' finish) on `stream` (a cudaStream_t); throws on a launch
// error.
void launch_layer_norm_backward(const LayerNormBackwardLaunch& a, void* stream);

}  // namespace dssim::tb::cuda
