// backends/torch/optimizer_kernels.cpp against torch.optim.AdamW written out in tensor ops (the
// formula of the engine's step before the fused loop), on the host.
#include <cmath>
#include <torch/torch.h>
#include <memory>
#include "backends/torch/onebit_adam.hpp"
#include "backends/torch/optimizer_kernels.hpp"
#include "core/optimizer_step.hpp"
#include "tests/torch/allocation_peak.hpp"
#include "tests/torch/kernel_test.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;
using dssim::tb::test::gpu_or_skip;

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

namespace {
// The engine's step before issue 15, pass by pass: the gradient widened into an fp32 buffer (g *
// pre, then * coef), torch.optim.AdamW written out in tensor ops, the copy written from the master.
void reference_step(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t step,
                    const AdamWHyper& h, double pre, double coef) {
  at::Tensor g32 = g.to(at::kFloat, false, true);
  if (pre != 1.0) g32.mul_(pre);
  if (coef != 1.0) g32.mul_(coef);
  p.mul_(1.0 - h.lr * h.weight_decay);
  m.lerp_(g32, 1.0 - h.beta1);
  v.mul_(h.beta2).addcmul_(g32, g32, 1.0 - h.beta2);
  const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(step));
  p.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(h.eps), -h.lr / bc1);
}

// fused_adamw_step on `dev` against the ops path (StepPath::Ops) and the written-out reference, over
// three steps: gradients of each dtype, scaled (pre, coef) or not, the copy of each dtype or none,
// an offset of one element (unaligned vectors) and a ragged length. Returns the largest relative
// difference of the fused master against the ops path's.
double check_fused_step(const at::Device& dev, at::ScalarType gtype, at::ScalarType otype, bool with_out, double pre,
                        double coef, int64_t offset) {
  torch::manual_seed(17);
  const int64_t n = 100003;
  const AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1};
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor pbuf = at::randn({n + offset}, f32), mbuf = at::zeros({n + offset}, f32), vbuf = at::zeros({n + offset}, f32);
  at::Tensor p = pbuf.narrow(0, offset, n), m = mbuf.narrow(0, offset, n), v = vbuf.narrow(0, offset, n);
  const at::Tensor before = pbuf.narrow(0, 0, offset).clone();  // outside the view: untouched
  at::Tensor op = p.clone(), om = m.clone(), ov = v.clone();            // the ops path
  at::Tensor rp = p.cpu().clone(), rm = m.cpu().clone(), rv = v.cpu().clone();  // written out, on the host
  at::Tensor obuf = at::empty({n + offset}, f32.dtype(otype));
  at::Tensor out = with_out ? obuf.narrow(0, offset, n) : at::Tensor(), oout = with_out ? at::empty({n}, f32.dtype(otype)) : at::Tensor();
  at::Tensor st, ost;
  for (int64_t step = 1; step <= 3; ++step) {
    at::Tensor gsrc = (at::randn({n + offset}, f32) * 0.01).to(gtype);
    at::Tensor g = gsrc.narrow(0, offset, n), og = g.clone(), rg = g.cpu().clone();
    fused_adamw_step(p, g, m, v, step, h, pre, coef, out, /*clear_grad=*/true, &st, StepPath::Fused);
    fused_adamw_step(op, og, om, ov, step, h, pre, coef, oout, true, &ost, StepPath::Ops);
    reference_step(rp, rg, rm, rv, step, h, pre, coef);
    REQUIRE(g.abs().max().item<float>() == 0.0f);  // cleared for the next step
    REQUIRE(og.abs().max().item<float>() == 0.0f);
    if (with_out) REQUIRE(at::equal(out.cpu(), p.cpu().to(otype)));  // the copy is the rounded master
  }
  REQUIRE(max_rel(p.cpu(), rp) < 1e-5);
  REQUIRE(max_rel(m.cpu(), rm) < 1e-5);
  REQUIRE(max_rel(v.cpu(), rv) < 1e-5);
  if (with_out) REQUIRE(at::equal(oout.cpu(), op.cpu().to(otype)));
  REQUIRE(at::equal(pbuf.narrow(0, 0, offset), before));
  return std::max({max_rel(p.cpu(), op.cpu()), max_rel(m.cpu(), om.cpu()), max_rel(v.cpu(), ov.cpu())});
}
}  // namespace

TEST_CASE("fused step on the host: 16-bit or fp32 gradients read in place, the copy written, the gradient "
          "cleared, equal to the ops path bit for bit", "[optimizer]") {
  const at::Device cpu(at::kCPU);
  for (auto gt : {at::kBFloat16, at::kHalf, at::kFloat})
    for (double pre : {1.0, 0.5})
      for (double coef : {1.0, 0.37}) {
        INFO("gradient " << c10::toString(gt) << " pre " << pre << " coef " << coef);
        REQUIRE(check_fused_step(cpu, gt, at::kBFloat16, true, pre, coef, 1) == 0.0);
      }
  REQUIRE(check_fused_step(cpu, at::kBFloat16, at::kFloat, true, 0.25, 1.0, 0) == 0.0);  // fp32 training's copy
  REQUIRE(check_fused_step(cpu, at::kHalf, at::kHalf, true, 1.0, 0.5, 0) == 0.0);
  REQUIRE(check_fused_step(cpu, at::kFloat, at::kBFloat16, false, 1.0, 1.0, 0) == 0.0);  // no copy (publish later)
  // Mismatched sizes are refused.
  at::Tensor p = at::zeros({10}), m = at::zeros({10}), v = at::zeros({10});
  REQUIRE_THROWS(fused_adamw_step(p, at::zeros({9}, at::kBFloat16), m, v, 1, AdamWHyper{}, 1, 1, at::Tensor(), true, nullptr));
}

// The CUDA kernel (fused_adamw_cuda.cu) against libtorch's ops on the GPU (_fused_adamw_ on an fp32
// copy of the gradient): skipped, with a warning, without a GPU or without the kernel in the build.
TEST_CASE("fused step on a GPU: the CUDA kernel against libtorch's ops", "[optimizer]") {
  if (!gpu_or_skip("the fused step", "CUDA kernel", fused_step_kernel_available)) return;
  const at::Device gpu(at::kCUDA, 0);
  double worst = 0;
  for (auto gt : {at::kBFloat16, at::kHalf, at::kFloat})
    for (int64_t offset : {0, 1})
      for (double coef : {1.0, 0.37}) {
        INFO("gradient " << c10::toString(gt) << " offset " << offset << " coef " << coef);
        worst = std::max(worst, check_fused_step(gpu, gt, at::kBFloat16, true, 0.5, coef, offset));
      }
  worst = std::max(worst, check_fused_step(gpu, at::kFloat, at::kFloat, true, 1.0, 1.0, 0));
  worst = std::max(worst, check_fused_step(gpu, at::kFloat, at::kBFloat16, false, 1.0, 1.0, 0));
  WARN("fused CUDA step against libtorch's ops: largest relative difference " << worst);
  REQUIRE(worst < 1e-6);
}

// 1-bit Adam's compressed-phase update runs piece by piece (core/optimizer_step.hpp
// kOnebitStepChunkElements): bit for bit the whole-buffer expression, holding the denominator's
// two fp32 temporaries one piece long (8 bytes an element of a piece), as core/memory.cpp counts.
TEST_CASE("1-bit Adam's step piece by piece: the whole-buffer update bit for bit, temporaries one piece long",
          "[optimizer][onebit]") {
  at::set_num_threads(1);
  const int64_t chunk = dssim::kOnebitStepChunkElements, n = 2 * chunk + 1001;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor p = at::randn({n}, f32), m = at::randn({n}, f32), v = at::rand({n}, f32);
  const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.1};
  const int64_t step = 7, freeze = 3;
  // The update over the whole buffer, as the step was written before it ran in pieces.
  at::Tensor expected = p.clone();
  expected.mul_(1.0 - h.lr * h.weight_decay);
  const double bc1 = 1.0 - std::pow(h.beta1, double(step)), bc2 = 1.0 - std::pow(h.beta2, double(freeze));
  expected.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(h.eps), -h.lr / bc1);

  OnebitAdam ob(n, nullptr, freeze, f32);
  auto peak = std::make_shared<dssim::test::AllocationPeak>();
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, peak);
    ob.step(p, m, v, step, h);
  }
  REQUIRE(at::equal(p, expected));
  REQUIRE(peak->now == 0);
  // The square root and its quotient, one piece each (and a few bytes of scalars: 12 with libtorch 1.13).
  REQUIRE(peak->peak >= 8 * chunk);
  REQUIRE(peak->peak <= 8 * chunk + 1024);
}
