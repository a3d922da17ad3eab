// The type tag dssim's CUDA kernels take (fused_adamw_cuda.hpp cuda::DType) for a tensor's dtype,
// for the .cpp files that fill a kernel's launch from tensors (optimizer_kernels.cpp,
// fused_cross_entropy.cpp, gemm_epilogues.cpp). No CUDA headers: it compiles on CPU-only builds.
#pragma once
#include <torch/torch.h>

#include "backends/torch/fused_adamw_cuda.hpp"

namespace dssim::tb {

// F32, BF16 or F16; None for an undefined tensor or a type the kernels do not take.
inline cuda::DType kernel_dtype(const at::Tensor& t) {
  if (!t.defined()) return cuda::DType::None;
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::F32;
    case at::kBFloat16: return cuda::DType::BF16;
    case at::kHalf: return cuda::DType::F16;
    default: return cuda::DType::None;
  }
}

}  // namespace dssim::tb
