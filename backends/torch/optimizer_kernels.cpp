#include "backends/torch/optimizer_kernels.hpp"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>
#include <ATen/Parallel.h>
#include "backends/torch/torch_compat.hpp"

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

template <class T16, bool ClearGrad>
void fused_loop_impl(float* p, float* g, float* m, float* v, T16* out, int64_t n, const AdamWHyper& h,
                     int64_t step) {
  const float b1 = float(h.beta1), b2 = float(h.beta2), eps = float(h.eps);
  const float decay = float(1.0 - h.lr * h.weight_decay);
  const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(step));
  const float step_size = float(h.lr / bc1), inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  parallel_range(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float gi = g[i];
      const float mi = m[i] + (gi - m[i]) * (1.0f - b1);
      const float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
      const float pi = p[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
      if constexpr (ClearGrad) g[i] = 0.0f;  // the next step's buffer, cleared while its line is in cache
      if constexpr (!std::is_same_v<T16, void>) out[i] = T16(pi);
    }
  });
}

template <class T16>
void fused_loop(float* p, float* g, float* m, float* v, T16* out, int64_t n, const AdamWHyper& h, int64_t step,
                bool clear_grad) {
  if (clear_grad) fused_loop_impl<T16, true>(p, g, m, v, out, n, h, step);
  else fused_loop_impl<T16, false>(p, g, m, v, out, n, h, step);
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
  if (out16 && out16->defined()) {
    if (!out16->is_cpu() || !out16->is_contiguous() || out16->numel() != n)
      throw std::invalid_argument("adamw_step: out16 must be a contiguous host tensor of p's size");
    if (out16->scalar_type() == at::kBFloat16)
      return fused_loop(pp, gp, mp, vp, out16->data_ptr<at::BFloat16>(), n, h, step, clear_grad);
    if (out16->scalar_type() == at::kHalf)
      return fused_loop(pp, gp, mp, vp, out16->data_ptr<at::Half>(), n, h, step, clear_grad);
    throw std::invalid_argument("adamw_step: out16 must be bf16 or fp16");
  }
  fused_loop<void>(pp, gp, mp, vp, nullptr, n, h, step, clear_grad);
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
