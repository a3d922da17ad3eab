#include "backends/torch/fused_cross_entropy.hpp"

#include <algorithm>
#include <limits>

#include "core/model.hpp"
#include "backends/torch/env.hpp"
#include "backends/torch/torch_compat.hpp"
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
#include "backends/torch/cross_entropy_cuda.hpp"
#include "backends/torch/kernel_dtype.hpp"
#endif

namespace dssim::tb {

bool cross_entropy_kernel_enabled() {
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
  static const bool on = env_str("DSSIM_CE_KERNEL", "1") != "0";  // 0: ATen's ops (A/B measurements)
  return on;
#else
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> cross_entropy_chunk(const at::Tensor& logits, const at::Tensor& targets, double scale) {
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
  // On GPUs, one kernel (cross_entropy_cuda.cu): loss = logsumexp - the target's logit, the gradient
  // written in the logits' type without an fp32 copy of the chunk.
  if (cross_entropy_kernel_enabled() && logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() && targets.scalar_type() == at::kLong) {
    cuda::CrossEntropyLaunch a;
    a.type = kernel_dtype(logits);
    const auto t = targets.reshape({-1}).contiguous();
    auto rows = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
    at::Tensor grad = scale != 0 ? at::empty_like(logits) : at::Tensor();
    a.logits = logits.data_ptr();
    a.grad = grad.defined() ? grad.data_ptr() : nullptr;
    a.targets = t.data_ptr<int64_t>();
    a.loss = rows.data_ptr<float>();
    a.rows = logits.size(0);
    a.vocab = logits.size(1);
    a.scale = float(scale);
    cuda::launch_cross_entropy(a, c10::cuda::getCurrentCUDAStream(logits.device().index()).stream());
    return {rows.sum(), grad};
  }
#endif
  // softmax of the logits into fp32: fp16 straight (half_to_float: one kernel, one read, one
  // write); bf16 through a cast first (PyTorch's softmax kernels convert from fp16 only).
  const auto dt = logits.scalar_type();
  auto p = dt == at::kHalf    ? at::_softmax(logits, 1, true)
           : dt == at::kFloat ? at::_softmax(logits, 1, false)
                              : at::_softmax(logits.to(at::kFloat), 1, false);
  auto idx = targets.reshape({-1, 1});
  // -log p_target: exact unless the target's probability underflows fp32 (a loss above 87.3 nats),
  // where it is clamped; the gradient is exact either way.
  auto loss = p.gather(1, idx).clamp_min(std::numeric_limits<float>::min()).log_().neg_().sum();
  if (scale == 0) return {loss, at::Tensor()};  // the loss alone (no gradient wanted)
  p.scatter_add_(1, idx, at::full_like(idx, -1.0, p.options()));
  // (softmax - one-hot) * scale in fp32, then cast to the logits' dtype (CUDA's mul_out does not
  // cast into a narrower out tensor, so the scale is applied in place first).
  auto grad = p.mul_(scale).to(dt);
  return {loss, grad};
}

namespace {
struct FusedLinearCrossEntropy : torch::autograd::Function<FusedLinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& w,
                            const at::Tensor& targets, int64_t chunk) {
    const int64_t T = y.size(0);
    const bool dy = ctx->needs_input_grad(0), dw = ctx->needs_input_grad(1);
    auto loss = at::zeros({}, y.options().dtype(at::kFloat));
    at::Tensor gy = dy ? at::empty_like(y) : at::Tensor();
    at::Tensor gw = dw ? at::zeros_like(w) : at::Tensor();
    for (int64_t b = 0; b < T; b += chunk) {
      const int64_t n = std::min(chunk, T - b);
      auto yc = y.narrow(0, b, n);
      auto logits = at::matmul(yc, w.t());
      auto [l, g] = cross_entropy_chunk(logits, targets.narrow(0, b, n), 1.0 / double(T));
      loss.add_(l);
      logits.reset();
      if (dy) {
        auto gy_chunk = gy.narrow(0, b, n);
        at::mm_out(gy_chunk, g, w);  // dL/dy = G W
      }
      if (dw) gw.addmm_(g.t(), yc);                  // dL/dW += G^T y
    }
    ctx->saved_data["has_gy"] = dy;
    ctx->saved_data["has_gw"] = dw;
    ctx->save_for_backward({dy ? gy : at::Tensor(), dw ? gw : at::Tensor()});
    return loss.div_(double(T));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const auto& g = grad_out[0];
    at::Tensor gy, gw;
    if (ctx->saved_data["has_gy"].toBool()) gy = saved[0].mul_(g.to(saved[0].scalar_type()));
    if (ctx->saved_data["has_gw"].toBool()) gw = saved[1].mul_(g.to(saved[1].scalar_type()));
    return {gy, gw, at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor fused_linear_cross_entropy(const at::Tensor& y, const at::Tensor& w, const at::Tensor& targets,
                                      int64_t chunk_tokens) {
  const int64_t T = y.size(0);
  const int64_t chunk = chunk_tokens > 0 ? chunk_tokens : fused_cross_entropy_chunk_tokens(T, w.size(0));
  const bool grads = at::GradMode::is_enabled() && (y.requires_grad() || w.requires_grad());
  if (!grads) {  // no gradient wanted: the loss alone, chunk by chunk
    at::NoGradGuard ng;
    auto loss = at::zeros({}, y.options().dtype(at::kFloat));
    for (int64_t b = 0; b < T; b += chunk) {
      const int64_t n = std::min(chunk, T - b);
      loss.add_(cross_entropy_chunk(at::matmul(y.narrow(0, b, n), w.t()), targets.narrow(0, b, n), 0.0).first);
    }
    return loss.div_(double(T));
  }
  return FusedLinearCrossEntropy::apply(y, w, targets, chunk);
}

}  // namespace dssim::tb
