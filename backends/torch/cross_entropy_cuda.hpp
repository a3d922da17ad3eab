// The cross-entropy of a chunk of logits as one CUDA kernel (cross_entropy_cuda.cu, compiled by nvcc
// when DSSIM_WITH_CUDA=ON finds the toolkit; DSSIM_HAVE_CUDA_KERNELS is then defined). No torch or
// CUDA headers here: fused_cross_entropy.cpp fills the launch from its tensors and libtorch's stream.
#pragma once
#include <cstdint>
#include "backends/torch/fused_adamw_cuda.hpp"  // DType

namespace dssim::tb::cuda {

// Per row r of `logits` [rows, vocab] (row-major, dense): loss[r] = logsumexp(x_r) - x_r[t_r] in
// fp32 and, when grad is set, grad[r] = (softmax(x_r) - onehot(t_r)) * scale in the logits' type.
// One block per row reads the row twice (max and sum, then the gradient); nothing in fp32 is
// materialised.
struct CrossEntropyLaunch {
  const void* logits = nullptr;
  void* grad = nullptr;  // may be null: the loss alone
  const int64_t* targets = nullptr;
  float* loss = nullptr;  // [rows]
  int64_t rows = 0, vocab = 0;
  DType type = DType::BF16;
  float scale = 1;
};

// Queues the kernel on `stream` (a cudaStream_t); throws on a launch error.
void launch_cross_entropy(const CrossEntropyLaunch& a, void* stream);

}  // namespace dssim::tb::cuda
