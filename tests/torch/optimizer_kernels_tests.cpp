// backends/torch/optimizer_kernels.cpp against torch.optim.AdamW written out in tensor ops (the
// formula of the engine's step before the fused loop), on the host.
#include <cmath>
#include <torch/torch.h>
#include "backends/torch/optimizer_kernels.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;

namespace {
// Largest difference relative to the reference's largest magnitude.
double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}
}  // namespace

TEST_CASE("host AdamW: the fused loop is torch.optim.AdamW", "[optimizer]") {
  torch::manual_seed(7);
  const int64_t n = 300001;  // several threads' chunks and a ragged tail
  const AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1};
  at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor rp = p.clone(), rm = m.clone(), rv = v.clone();
  at::Tensor out16 = at::empty({n}, at::kBFloat16);
  for (int64_t step = 1; step <= 3; ++step) {
    at::Tensor g = at::randn({n}) * 0.01;
    adamw_step(p, g, m, v, step, h, nullptr, &out16);
    rp.mul_(1.0 - h.lr * h.weight_decay);
    rm.lerp_(g, 1.0 - h.beta1);
    rv.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
    const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(step));
    rp.addcdiv_(rm, (rv.sqrt() / std::sqrt(bc2)).add_(h.eps), -h.lr / bc1);
  }
  REQUIRE(max_rel(p, rp) < 1e-5);
  REQUIRE(max_rel(m, rm) < 1e-5);
  REQUIRE(max_rel(v, rv) < 1e-5);
  REQUIRE(at::equal(out16, p.to(at::kBFloat16)));  // the step-plus-copy writes the rounded parameters
}

TEST_CASE("host step-plus-copy: AdamW chunk by chunk, the 16-bit copy written, the gradients cleared",
          "[optimizer]") {
  torch::manual_seed(11);
  const int64_t n = (int64_t(1) << 26) + 4099;  // two chunks of host_step_and_publish, the second ragged
  const AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1};
  at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n}), g = at::randn({n}) * 0.01;
  at::Tensor rp = p.clone(), rm = m.clone(), rv = v.clone(), rg = g.clone();
  at::Tensor dst = at::empty({n}, at::kBFloat16), staging;
  const double copy_seconds = host_step_and_publish(p, g, m, v, 1, h, dst, staging);
  REQUIRE(copy_seconds == 0);  // a host destination is written in the pass itself
  adamw_step(rp, rg, rm, rv, 1, h, nullptr, nullptr, /*clear_grad=*/true);
  REQUIRE(at::equal(p, rp));
  REQUIRE(at::equal(m, rm));
  REQUIRE(at::equal(dst, p.to(at::kBFloat16)));
  REQUIRE(g.abs().max().item<float>() == 0.0f);  // the next step's gradient buffer starts at zero
  REQUIRE(rg.abs().max().item<float>() == 0.0f);
  at::Tensor kept = at::randn({1000});
  at::Tensor pk = at::randn({1000}), mk = at::zeros({1000}), vk = at::zeros({1000}), g_before = kept.clone();
  adamw_step(pk, kept, mk, vk, 1, h);  // without clear_grad the gradients are only read
  REQUIRE(at::equal(kept, g_before));
}

TEST_CASE("host gradient accumulation adds scale * src in one pass", "[optimizer]") {
  torch::manual_seed(3);
  const int64_t n = 200003;
  at::Tensor acc = at::randn({n}), ref = acc.clone();
  at::Tensor src = at::randn({n}).to(at::kBFloat16);
  host_accumulate(acc, src, 0.5);
  ref.add_(src.to(at::kFloat), 0.5);
  REQUIRE(max_rel(acc, ref) < 1e-6);
  REQUIRE_THROWS(adamw_step(acc, src, acc, acc, 1, AdamWHyper{}));  // bf16 gradients are refused
}
