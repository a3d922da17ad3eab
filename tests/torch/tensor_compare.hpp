// Comparing the torch backend's kernels with their references (the kernel tests: gemm_epilogues,
// layer_norm_residual, fused_cross_entropy).
#pragma once
#include <torch/torch.h>

namespace dssim::tb::test {

// The largest difference from `ref`, relative to ref's largest magnitude, computed in double.
inline double max_rel(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>() /
         ref.to(at::kDouble).abs().max().item<double>();
}

}  // namespace dssim::tb::test
