// What the torch backend's kernel tests share (gemm_epilogues, layer_norm_residual,
// fused_cross_entropy, optimizer_kernels): the GPU cases' skip without a GPU, and comparing a kernel's
// result with its reference.
#pragma once
#include <torch/torch.h>

#include <string>

#include <catch2/catch.hpp>

namespace dssim::tb::test {

// Whether a GPU case can run: a CUDA device and, where the case needs one of this build's kernels
// (`kernel`, e.g. "cuBLASLt"), that kernel built (`built()`, asked only with a device). Otherwise it
// warns "...: the GPU test of <what> is skipped" (scripts/gpu_tests.sh lists those lines), and the case
// returns.
template <class Built>
bool gpu_or_skip(const std::string& what, const std::string& kernel, Built built) {
  if (torch::cuda::is_available() && built()) return true;
  WARN("no CUDA device or no " << kernel << " in this build: " << "the GPU test of " << what << " is skipped");
  return false;
}
inline bool gpu_or_skip(const std::string& what) {
  if (torch::cuda::is_available()) return true;
  WARN("no CUDA device: " << "the GPU test of " << what << " is skipped");
  return false;
}

// The largest difference from `ref`, relative to ref's largest magnitude, computed in double.
inline double max_rel(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>() /
         ref.to(at::kDouble).abs().max().item<double>();
}

}  // namespace dssim::tb::test
