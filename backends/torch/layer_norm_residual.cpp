// The block's LayerNorm with the residual's gradient summed in its backward
// (layer_norm_residual.hpp says why and what runs where).
#include "backends/torch/layer_norm_residual.hpp"

#include <array>
#include <atomic>
#include <optional>
#include <vector>
#include "backends/torch/env.hpp"
#include "backends/torch/gemm_epilogues.hpp"

#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include "backends/torch/bias_grad_cuda.hpp"
#include "backends/torch/kernel_dtype.hpp"
#include "backends/torch/layer_norm_cuda.hpp"
#endif

namespace dssim::tb {
namespace {

constexpr double kEps = 1e-5;

std::atomic<bool>& fused_mode() {  // read from DSSIM_NORM_RESIDUAL once; set_norm_residual_fused overrides it
  static std::atomic<bool> fused{env_str("DSSIM_NORM_RESIDUAL", "fused") != "separate"};
  return fused;
}
std::atomic<bool> ran_kernel{false};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LayerNormResidualFunction : public torch::autograd::Function<LayerNormResidualFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    const std::vector<int64_t> shape{x.size(-1)};
    auto out = at::native_layer_norm(x, shape, w, b, kEps);
    ctx->save_for_backward({x, w, b, std::get<1>(out), std::get<2>(out)});
    // x returned as it is: autograd makes it a view carrying this function's second output edge.
    return {std::get<0>(out), x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1], &b = s[2], &mean = s[3], &rstd = s[4];
    if (!grads[0].defined()) return {grads[1], at::Tensor(), at::Tensor()};  // the norm's output unused
    const at::Tensor dw_into = grad_in_place(w), db_into = grad_in_place(b);
    const bool in_place = dw_into.defined() && db_into.defined();
    auto [dx, dw, db] = layer_norm_residual_backward(grads[0], x, mean, rstd, w, b, grads[1],
                                                     in_place ? dw_into : at::Tensor(), in_place ? db_into : at::Tensor());
    return {dx, dw, db};
  }
};

#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
// dssim's kernel pair where the layout allows: every tensor on the GPU, contiguous, one type. The
// launch's shape and inputs, or nothing when the kernels do not take these tensors (asked before any
// output is allocated, so a refusal costs no allocation).
std::optional<cuda::LayerNormBackwardLaunch> kernel_launch(const at::Tensor& dy, const at::Tensor& x,
                                                           const at::Tensor& mean, const at::Tensor& rstd,
                                                           const at::Tensor& w, const at::Tensor& b,
                                                           const at::Tensor& dres, const at::Tensor& dw_into,
                                                           const at::Tensor& db_into, bool accumulate) {
  const auto type = kernel_dtype(x);
  if (!x.is_cuda() || type == cuda::DType::None || !b.defined() || !x.is_contiguous()) return std::nullopt;
  for (const at::Tensor* t : {&dy, &w, &b})
    if (t->scalar_type() != x.scalar_type() || !t->is_contiguous()) return std::nullopt;
  if (accumulate)
    for (const at::Tensor* t : {&dw_into, &db_into})
      if (t->scalar_type() != x.scalar_type() || !t->is_contiguous()) return std::nullopt;
  if (dres.defined() && (dres.scalar_type() != x.scalar_type() || !dres.is_contiguous() || dres.sizes() != x.sizes()))
    return std::nullopt;
  if (dy.sizes() != x.sizes() || mean.scalar_type() != at::kFloat || rstd.scalar_type() != at::kFloat ||
      !mean.is_contiguous() || !rstd.is_contiguous())
    return std::nullopt;
  cuda::LayerNormBackwardLaunch a;
  a.cols = x.size(-1);
  a.rows = a.cols > 0 ? x.numel() / a.cols : 0;
  if (mean.numel() != a.rows || rstd.numel() != a.rows || w.numel() != a.cols || b.numel() != a.cols)
    return std::nullopt;
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.gamma = w.data_ptr();
  a.dres = dres.defined() ? dres.data_ptr() : nullptr;
  if (accumulate) {  // the parameters' gradient buffers, whose alignment is the flat buffer's
    a.dgamma = dw_into.data_ptr();
    a.dbeta = db_into.data_ptr();
  }
  a.type = type;
  a.accumulate = accumulate;
  a.splits = cuda::column_sum_splits(a.rows, a.cols, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  if (!cuda::layer_norm_backward_supported(a)) return std::nullopt;
  return a;
}
#endif

}  // namespace

bool norm_residual_fused() { return fused_mode().load(); }
void set_norm_residual_fused(bool on) { fused_mode().store(on); }
bool norm_residual_ran_kernel() { return ran_kernel.load(); }

NormResidual layer_norm_residual(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || b.requires_grad());
  // libtorch 1.13's CPU kernels lack fp16 LayerNorm (gpt.cpp's layer_norm normalises in fp32 there).
  const bool cpu_half = x.scalar_type() == at::kHalf && x.device().is_cpu();
  if (!norm_residual_fused() || !grad || !b.defined() || cpu_half) {
    if (cpu_half)
      return {at::layer_norm(x.to(at::kFloat), {x.size(-1)}, w.to(at::kFloat), b.to(at::kFloat), kEps).to(at::kHalf), x};
    return {at::layer_norm(x, {x.size(-1)}, w, b, kEps), x};
  }
  auto out = LayerNormResidualFunction::apply(x, w, b);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& w,
    const at::Tensor& b, const at::Tensor& dres, const at::Tensor& dw_into, const at::Tensor& db_into) {
  const bool accumulate = dw_into.defined() && (!b.defined() || db_into.defined());
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
  if (auto a = kernel_launch(dy, x, mean, rstd, w, b, dres, dw_into, db_into, accumulate)) {
    const at::Tensor dx = at::empty_like(x);
    const at::Tensor dw = accumulate ? dw_into : at::empty_like(w);
    const at::Tensor db = accumulate ? db_into : at::empty_like(b);
    const auto partial = at::empty({2 * int64_t(a->splits) * a->cols}, x.options().dtype(at::kFloat));
    a->dx = dx.data_ptr();
    a->dgamma = dw.data_ptr();
    a->dbeta = db.data_ptr();
    a->partial = partial.data_ptr<float>();
    cuda::launch_layer_norm_backward(*a, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    ran_kernel = true;
    if (accumulate) return {dx, at::Tensor(), at::Tensor()};
    return {dx, dw, db};
  }
#endif
  ran_kernel = false;
  const std::vector<int64_t> shape{x.size(-1)};
  auto [dx, dw, db] = at::native_layer_norm_backward(dy, x, shape, mean, rstd, w, b,
                                                     std::array<bool, 3>{{true, true, b.defined()}});
  if (dres.defined()) dx.add_(dres);
  if (!accumulate) return {dx, dw, db};
  at::NoGradGuard no_grad;
  dw_into.add_(dw);
  if (b.defined()) db_into.add_(db);
  return {dx, at::Tensor(), at::Tensor()};
}

}  // namespace dssim::tb
