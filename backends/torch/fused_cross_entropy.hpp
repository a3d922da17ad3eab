#pragma once
// The LM head's GEMM and the cross-entropy fused over token chunks (ModelSpec::fused_cross_entropy,
// scenario key model.cross_entropy: fused_linear), as Liger-Kernel's FusedLinearCrossEntropy
// computes it: for each chunk of tokens the 16-bit logits, their softmax in fp32 (one kernel), the
// mean loss's gradient (softmax - one-hot) / tokens in 16 bits, and from it the head input's and
// weight's gradients, all in the forward. No [tokens x V] fp32 tensor lives beyond one chunk, and
// nothing of the logits is kept for the backward, which only scales the two gradients by the
// incoming one (the loss scale over the accumulation steps). The loss and every gradient equal
// PyTorch's cross_entropy_loss(logits.float()) ones to rounding (tests/torch/torch_backend_tests.cpp).
#include <torch/torch.h>

#include <utility>

namespace dssim::tb {

// Mean cross-entropy of `targets` [T] under logits y [T, h] @ w[V, h]^T. Gradients flow to y and w
// (whichever require them) when grad mode is on. chunk_tokens 0: core's fused_cross_entropy_chunk_tokens.
at::Tensor fused_linear_cross_entropy(const at::Tensor& y, const at::Tensor& w, const at::Tensor& targets,
                                      int64_t chunk_tokens = 0);

// One chunk's elementwise core (what `dssim calibrate` times as `fused_cross_entropy`): from 16-bit
// logits [c, V] and targets [c], the summed loss of the chunk (fp32 scalar) and the logits' gradient
// (softmax - one-hot) * scale in the logits' dtype (undefined when scale is 0: the loss alone).
std::pair<at::Tensor, at::Tensor> cross_entropy_chunk(const at::Tensor& logits, const at::Tensor& targets, double scale);
// Whether cross_entropy_chunk runs dssim's CUDA kernel on GPUs (built with it, DSSIM_CE_KERNEL not 0).
bool cross_entropy_kernel_enabled();

}  // namespace dssim::tb
