#include "backends/torch/optimizer_kernels.hpp"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>
#include <ATen/Parallel.h>
#include "backends/torch/torch_compat.hpp"
#if defined(DSSIM_HAVE_CUDA_KERNELS)
#include "backends/torch/fused_adamw_cuda.hpp"
#include "backends/torch/kernel_dtype.hpp"
#endif

namespace dssim::tb {

namespace {

// body(begin, end) over [0, n) on at::get_num_threads() threads. (at::parallel_for's OpenMP
// path is a pragma in a header: compiled here without -fopenmp it would run on one thread, and
// linking a second OpenMP runtime next to libtorch's is worse.)
template <class F>
void parallel_range(int64_t n, const F& body, int max_threads = 0) {
  const int64_t grain = int64_t(1) << 16;
  const int64_t want = max_threads > 0 ? max_threads : at::get_num_threads();
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(want, (n + grain - 1) / grain)));
  if (threads == 1) return body(int64_t(0), n);
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t b = t * per, e = std::min(n, b + per);
    if (b < e) pool.emplace_back([&body, b, e] { body(b, e); });
  }
  for (auto& th : pool) th.join();
}

// One pass over p, g, m, v (G: the gradient's type; its value used is g * pre * coef, each a float
// multiply as the engine's fp32 accumulator would have it), the updated p written converted into
// `out` (T16 void: none).
template <class G, class T16, bool ClearGrad>
void fused_loop_impl(float* p, G* g, float* m, float* v, T16* out, int64_t n, const AdamWHyper& h, int64_t step,
                     float pre, float coef) {
  const float b1 = float(h.beta1), b2 = float(h.beta2), eps = float(h.eps);
  const float decay = float(1.0 - h.lr * h.weight_decay);
  const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(step));
  const float step_size = float(h.lr / bc1), inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  const bool apply_pre = pre != 1.0f, apply_coef = coef != 1.0f;
  parallel_range(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float gi = float(g[i]);
      if (apply_pre) gi *= pre;
      if (apply_coef) gi *= coef;
      const float mi = m[i] + (gi - m[i]) * (1.0f - b1);
      const float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
      const float pi = p[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
      if constexpr (ClearGrad) g[i] = G(0.0f);  // the next step's buffer, cleared while its line is in cache
      if constexpr (!std::is_same_v<T16, void>) out[i] = T16(pi);
    }
  });
}

template <class G, class T16>
void fused_loop(float* p, G* g, float* m, float* v, T16* out, int64_t n, const AdamWHyper& h, int64_t step,
                bool clear_grad, float pre = 1.0f, float coef = 1.0f) {
  if (clear_grad) fused_loop_impl<G, T16, true>(p, g, m, v, out, n, h, step, pre, coef);
  else fused_loop_impl<G, T16, false>(p, g, m, v, out, n, h, step, pre, coef);
}

// The host loop for a gradient of type G: dispatched on the output's type.
template <class G>
void fused_loop_out(float* p, G* g, float* m, float* v, at::Tensor* out, int64_t n, const AdamWHyper& h,
                    int64_t step, bool clear_grad, float pre, float coef) {
  if (!out || !out->defined()) return fused_loop<G, void>(p, g, m, v, nullptr, n, h, step, clear_grad, pre, coef);
  if (!out->is_cpu() || !out->is_contiguous() || out->numel() != n)
    throw std::invalid_argument("adamw_step: out16 must be a contiguous host tensor of p's size");
  switch (out->scalar_type()) {
    case at::kBFloat16: return fused_loop(p, g, m, v, out->data_ptr<at::BFloat16>(), n, h, step, clear_grad, pre, coef);
    case at::kHalf: return fused_loop(p, g, m, v, out->data_ptr<at::Half>(), n, h, step, clear_grad, pre, coef);
    case at::kFloat: return fused_loop(p, g, m, v, out->data_ptr<float>(), n, h, step, clear_grad, pre, coef);
    default: throw std::invalid_argument("adamw_step: out16 must be bf16, fp16 or fp32");
  }
}

}  // namespace

void adamw_step(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step,
                const AdamWHyper& h, at::Tensor* step_tensor, at::Tensor* out16, bool clear_grad) {
#if DSSIM_TORCH_AT_LEAST(2, 4)
  if (p.is_cuda()) {
    // torch.optim.AdamW(fused=True)'s kernel on the flat shard: one pass over p, g, m, v.
    if (!step_tensor) throw std::invalid_argument("adamw_step: the fused CUDA kernel needs a step tensor");
    if (!step_tensor->defined()) *step_tensor = at::zeros({}, p.options());
    step_tensor->fill_(double(step));
    std::vector<at::Tensor> ps{p}, gs{g}, ms{m}, vs{v}, none, steps{*step_tensor};
    at::_fused_adamw_(ps, gs, ms, vs, none, steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, false, false);
    if (clear_grad) g.zero_();
    return;
  }
#endif
  (void)step_tensor;
  if (!p.is_cpu()) {
    // An accelerator without the fused kernel (libtorch < 2.4): torch.optim.AdamW written out.
    p.mul_(1.0 - h.lr * h.weight_decay);
    m.lerp_(g, 1.0 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
    const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(step));
    auto denom = (v.sqrt() / std::sqrt(bc2)).add_(h.eps);
    p.addcdiv_(m, denom, -h.lr / bc1);
    if (clear_grad) g.zero_();
    return;
  }
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&p), &g, static_cast<const at::Tensor*>(&m), static_cast<const at::Tensor*>(&v)})
    if (t->scalar_type() != at::kFloat || !t->is_contiguous() || t->numel() != p.numel())
      throw std::invalid_argument("adamw_step: p, g, m, v must be contiguous fp32 tensors of one size");
  const int64_t n = p.numel();
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* gp = g.data_ptr<float>();  // written only when clear_grad
  fused_loop_out(pp, gp, mp, vp, out16, n, h, step, clear_grad, 1.0f, 1.0f);
}

namespace {

// The reference: libtorch's ops, pass by pass (the gradient to an fp32 tensor, scaled, AdamW, the
// gradient cleared, the copy written).
void fused_step_by_ops(at::Tensor& p, at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step, const AdamWHyper& h,
                       double pre, double coef, at::Tensor& out, bool clear_grad, at::Tensor* step_tensor) {
  const bool in_place = g.scalar_type() == at::kFloat && (clear_grad || (pre == 1.0 && coef == 1.0));
  at::Tensor g32 = in_place ? g : g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (pre != 1.0) g32.mul_(pre);
  if (coef != 1.0) g32.mul_(coef);
  adamw_step(p, g32, m, v, step, h, step_tensor, nullptr, clear_grad && in_place);
  if (clear_grad && !in_place) g.zero_();
  if (out.defined()) out.copy_(p);
}

#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
// kernel_dtype.hpp's tag; a defined tensor of another type is an error.
cuda::DType step_dtype(const at::Tensor& t) {
  const cuda::DType d = kernel_dtype(t);
  if (t.defined() && d == cuda::DType::None)
    throw std::invalid_argument("fused_adamw_step: tensors must be fp32, bf16 or fp16");
  return d;
}
#endif

}  // namespace

bool fused_step_kernel_available() {
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

void fused_adamw_step(at::Tensor& p, at::Tensor g, at::Tensor& m, at::Tensor& v, int64_t step, const AdamWHyper& h,
                      double pre, double coef, at::Tensor out, bool clear_grad, at::Tensor* step_tensor,
                      StepPath path) {
  const int64_t n = p.numel();
  for (const at::Tensor* t : {&p, &m, &v})
    if (t->scalar_type() != at::kFloat || !t->is_contiguous() || t->numel() != n)
      throw std::invalid_argument("fused_adamw_step: p, m, v must be contiguous fp32 tensors of one size");
  if (!g.is_contiguous() || g.numel() != n || g.device() != p.device() ||
      (out.defined() && (!out.is_contiguous() || out.numel() != n || out.device() != p.device())))
    throw std::invalid_argument("fused_adamw_step: g (and out) must be contiguous, of p's size, on p's device");
  if (path == StepPath::Ops) return fused_step_by_ops(p, g, m, v, step, h, pre, coef, out, clear_grad, step_tensor);
  if (p.is_cpu()) {
    float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
    at::Tensor* o = out.defined() ? &out : nullptr;
    switch (g.scalar_type()) {
      case at::kFloat: return fused_loop_out(pp, g.data_ptr<float>(), mp, vp, o, n, h, step, clear_grad, float(pre), float(coef));
      case at::kBFloat16:
        return fused_loop_out(pp, g.data_ptr<at::BFloat16>(), mp, vp, o, n, h, step, clear_grad, float(pre), float(coef));
      case at::kHalf: return fused_loop_out(pp, g.data_ptr<at::Half>(), mp, vp, o, n, h, step, clear_grad, float(pre), float(coef));
      default: throw std::invalid_argument("fused_adamw_step: g must be fp32, bf16 or fp16");
    }
  }
#if defined(DSSIM_HAVE_CUDA_KERNELS) && defined(DSSIM_TORCH_CUDA)
  if (p.is_cuda()) {
    cuda::FusedAdamWLaunch a;
    a.p = p.data_ptr<float>(), a.m = m.data_ptr<float>(), a.v = v.data_ptr<float>();
    a.g = g.data_ptr(), a.grad_type = step_dtype(g);
    if (out.defined()) a.out = out.data_ptr(), a.out_type = step_dtype(out);
    a.n = n, a.step = step;
    a.lr = h.lr, a.beta1 = h.beta1, a.beta2 = h.beta2, a.eps = h.eps, a.weight_decay = h.weight_decay;
    a.pre = float(pre), a.coef = float(coef), a.clear_grad = clear_grad;
    c10::cuda::CUDAGuard guard(p.device());
    cuda::launch_fused_adamw(a, c10::cuda::getCurrentCUDAStream(p.device().index()).stream());
    return;
  }
#endif
  fused_step_by_ops(p, g, m, v, step, h, pre, coef, out, clear_grad, step_tensor);
}

double host_step_and_publish(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step,
                             const AdamWHyper& h, at::Tensor dst, at::Tensor& staging) {
  const int64_t n = p.numel(), chunk = std::min<int64_t>(n, int64_t(1) << 26);
  const bool direct = dst.is_cpu();
  const bool convert = dst.scalar_type() != at::kFloat;
  if (!direct && !staging.defined())
    staging = at::empty({chunk}, dst.options().device(at::kCPU).pinned_memory(dst.is_cuda()));
  double copy_seconds = 0;
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t c = std::min(chunk, n - off);
    at::Tensor pc = p.narrow(0, off, c), mc = m.narrow(0, off, c), vc = v.narrow(0, off, c);
    at::Tensor out = direct ? dst.narrow(0, off, c) : staging.narrow(0, 0, c);
    adamw_step(pc, g.narrow(0, off, c), mc, vc, step, h, nullptr, convert ? &out : nullptr, /*clear_grad=*/true);
    if (!convert) out.copy_(pc);
    if (direct) continue;
    const auto t0 = std::chrono::steady_clock::now();
    dst.narrow(0, off, c).copy_(out);  // synchronous: the staging buffer is refilled next
    copy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return copy_seconds;
}

namespace {
template <class T>
void accumulate_loop(float* acc, const T* src, int64_t n, float scale, int threads) {
  parallel_range(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) acc[i] += scale * float(src[i]);
  }, threads);
}
}  // namespace

int host_accumulate_threads() { return std::max(1, at::get_num_threads() - 2); }

void host_accumulate(at::Tensor acc, const at::Tensor& src, double scale, int threads) {
  if (!acc.is_cpu() || !src.is_cpu() || acc.scalar_type() != at::kFloat || !acc.is_contiguous() ||
      !src.is_contiguous() || acc.numel() != src.numel()) {
    acc.add_(src, scale);
    return;
  }
  float* a = acc.data_ptr<float>();
  const int64_t n = acc.numel();
  switch (src.scalar_type()) {
    case at::kBFloat16: return accumulate_loop(a, src.data_ptr<at::BFloat16>(), n, float(scale), threads);
    case at::kHalf: return accumulate_loop(a, src.data_ptr<at::Half>(), n, float(scale), threads);
    case at::kFloat: return accumulate_loop(a, src.data_ptr<float>(), n, float(scale), threads);
    default: acc.add_(src, scale);
  }
}

}  // namespace dssim::tb
