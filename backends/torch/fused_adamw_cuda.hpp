// The fused optimizer step's CUDA kernel (fused_adamw_cuda.cu, compiled by nvcc when
// DSSIM_WITH_CUDA=ON finds the toolkit; DSSIM_HAVE_CUDA_KERNELS is then defined). No torch or CUDA
// headers here: optimizer_kernels.cpp fills the launch from its tensors and libtorch's stream.
#pragma once
#include <cstdint>

namespace dssim::tb::cuda {

enum class DType { None, F32, BF16, F16 };

// AdamW over n elements: p, m, v fp32; g of grad_type (its value used is g * pre * coef, each a
// float multiply, skipped when 1); `out` (out_type, may be null) receives the updated p converted;
// g is zeroed when clear_grad. `step` is 1-based.
struct FusedAdamWLaunch {
  float *p = nullptr, *m = nullptr, *v = nullptr;
  void* g = nullptr;
  void* out = nullptr;
  DType grad_type = DType::None, out_type = DType::None;
  int64_t n = 0, step = 1;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float pre = 1, coef = 1;
  bool clear_grad = false;
};

// Queues the kernel on `stream` (a cudaStream_t); throws on a launch error.
void launch_fused_adamw(const FusedAdamWLaunch& a, void* stream);

}  // namespace dssim::tb::cuda
