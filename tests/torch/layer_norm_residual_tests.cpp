// backends/torch/layer_norm_residual.cpp: the block's LayerNorm whose backward adds the residual's
// gradient. On the host, ATen's expressions, the same bits as the engine before (autograd's add at
// the fork); on a GPU built with dssim's kernels, the kernel pair against a reference in double.
#include <torch/torch.h>

#include <tuple>
#include <vector>
#include "backends/torch/layer_norm_residual.hpp"
#include "tests/torch/kernel_test.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;
using dssim::tb::test::gpu_or_skip;
using dssim::tb::test::max_rel;

namespace {
struct Grads {
  at::Tensor y, dx, dw, db;
};

// out = y * u + r * v (r: the residual the norm returns, used as the block's residual add would),
// or without the residual term (`use_residual` false) or without the norm's (`use_norm` false);
// backward of out's sum. `fused` picks the mode.
Grads run(const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0, const at::Tensor& u, const at::Tensor& v,
          bool fused, bool use_norm = true, bool use_residual = true) {
  const bool was = norm_residual_fused();
  set_norm_residual_fused(fused);
  auto x = x0.detach().clone().requires_grad_(true), w = w0.detach().clone().requires_grad_(true),
       b = b0.detach().clone().requires_grad_(true);
  const auto nr = layer_norm_residual(x, w, b);
  at::Tensor out;
  if (use_norm) out = nr.y * u;
  if (use_residual) out = out.defined() ? out + nr.residual * v : nr.residual * v;
  out.sum().backward();
  set_norm_residual_fused(was);
  return {nr.y.detach(), x.grad(), w.grad(), b.grad()};
}
}  // namespace

TEST_CASE("LayerNorm with the residual's gradient: ATen's expressions on the host, the same bits", "[norm]") {
  torch::manual_seed(3);
  const int64_t h = 40;
  const auto x = at::randn({3, 7, h}), w = 1 + 0.1 * at::randn({h}), b = 0.1 * at::randn({h});
  const auto u = at::randn({3, 7, h}), v = at::randn({3, 7, h});
  for (auto [norm, residual] : {std::pair<bool, bool>{true, true}, {true, false}, {false, true}}) {
    INFO("norm output used " << norm << ", residual used " << residual);
    const Grads f = run(x, w, b, u, v, true, norm, residual), s = run(x, w, b, u, v, false, norm, residual);
    REQUIRE(at::equal(f.y, s.y));
    REQUIRE(at::equal(f.dx, s.dx));
    if (norm) {
      REQUIRE(at::equal(f.dw, s.dw));
      REQUIRE(at::equal(f.db, s.db));
    }
    REQUIRE_FALSE(norm_residual_ran_kernel());
  }
  // Without a gradient wanted the function is not used: x itself comes back.
  const bool was = norm_residual_fused();
  set_norm_residual_fused(true);
  {
    at::NoGradGuard no_grad;
    const auto nr = layer_norm_residual(x, w, b);
    REQUIRE(nr.residual.data_ptr() == x.data_ptr());
    REQUIRE(at::equal(nr.y, at::layer_norm(x, {h}, w, b, 1e-5)));
  }
  set_norm_residual_fused(was);
}

TEST_CASE("LayerNorm with the residual's gradient: the gain and bias added into preset buffers", "[norm]") {
  torch::manual_seed(4);
  const int64_t h = 24;
  const auto x0 = at::randn({5, h}), w0 = 1 + 0.1 * at::randn({h}), b0 = 0.1 * at::randn({h});
  const auto u = at::randn({5, h}), v = at::randn({5, h});
  const Grads ref = run(x0, w0, b0, u, v, false);
  const bool was = norm_residual_fused();
  set_norm_residual_fused(true);
  auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
  const auto start_w = at::randn({h}), start_b = at::randn({h});
  w.mutable_grad() = start_w.clone();
  b.mutable_grad() = start_b.clone();
  void* wbuf = w.grad().data_ptr();
  void* bbuf = b.grad().data_ptr();
  const auto nr = layer_norm_residual(x, w, b);
  (nr.y * u + nr.residual * v).sum().backward();
  set_norm_residual_fused(was);
  REQUIRE(w.grad().data_ptr() == wbuf);  // the same buffers, added into
  REQUIRE(b.grad().data_ptr() == bbuf);
  CHECK(max_rel(w.grad(), ref.dw + start_w) < 1e-6);
  CHECK(max_rel(b.grad(), ref.db + start_b) < 1e-6);
  REQUIRE(at::equal(x.grad(), ref.dx));
}

// The kernel pair on a GPU: dx (with and without dres), dgamma and dbeta against the same backward
// in double from the same saved statistics, for each register tile the launcher picks, and the
// shapes it hands to ATen.
TEST_CASE("LayerNorm backward kernels on a GPU against double", "[norm]") {
  if (!gpu_or_skip("the LayerNorm kernels")) return;
  torch::manual_seed(5);
  const at::Device gpu(at::kCUDA, 0);
  const auto f32 = at::TensorOptions().device(gpu);
  bool any_kernel = false;
  for (auto type : {at::kBFloat16, at::kHalf, at::kFloat})
    // (rows, cols, whether the kernels take it): one warp a row at 1, 2 (520 columns: a partial
    // vector row) and 4 vectors a lane, 2 and 4 warps a row, 8 vectors a thread, and past the
    // largest tile or not a whole vector (ATen).
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 64}, {77, 520}, {3001, 1024}, {1027, 2048}, {64, 4096},
                              {33, 8192}, {9, 16384}, {40, 12}}) {
      const int64_t vec = type == at::kFloat ? 4 : 8;
      const bool takes = cols % vec == 0 && (cols + 32 * vec - 1) / (32 * vec) <= 32;
      INFO(c10::toString(type) << " rows " << rows << " cols " << cols);
      const auto x = (at::randn({rows, cols}, f32) * 2 + 0.5).to(type);
      const auto w = (1 + 0.2 * at::randn({cols}, f32)).to(type), b = (0.1 * at::randn({cols}, f32)).to(type);
      const auto dy = at::randn({rows, cols}, f32).to(type), dres = at::randn({rows, cols}, f32).to(type);
      const auto stats = at::native_layer_norm(x, {cols}, w, b, 1e-5);
      const at::Tensor mean = std::get<1>(stats), rstd = std::get<2>(stats);
      const auto d = [](const at::Tensor& t) { return t.to(at::kDouble); };
      const auto ref = at::native_layer_norm_backward(d(dy), d(x), {cols}, d(mean), d(rstd), d(w), d(b),
                                                      std::array<bool, 3>{{true, true, true}});
      const double tol = type == at::kFloat ? 1e-5 : 1e-2;
      for (bool with_res : {true, false}) {
        INFO("dres " << with_res);
        auto [dx, dw, db] = layer_norm_residual_backward(dy, x, mean, rstd, w, b, with_res ? dres : at::Tensor());
        REQUIRE(norm_residual_ran_kernel() == takes);
        any_kernel = any_kernel || takes;
        CHECK(max_rel(dx, with_res ? std::get<0>(ref) + d(dres) : std::get<0>(ref)) < tol);
        CHECK(max_rel(dw, std::get<1>(ref)) < tol);
        CHECK(max_rel(db, std::get<2>(ref)) < tol);
        // Fixed summation orders: the same bits again.
        auto [dx2, dw2, db2] = layer_norm_residual_backward(dy, x, mean, rstd, w, b, with_res ? dres : at::Tensor());
        REQUIRE(at::equal(dx2, dx));
        REQUIRE(at::equal(dw2, dw));
        REQUIRE(at::equal(db2, db));
      }
      // Added into the parameters' buffers.
      const auto sw = at::randn({cols}, f32).to(type), sb = at::randn({cols}, f32).to(type);
      auto iw = sw.clone(), ib = sb.clone();
      auto [dx3, none_w, none_b] = layer_norm_residual_backward(dy, x, mean, rstd, w, b, dres, iw, ib);
      REQUIRE_FALSE(none_w.defined());
      REQUIRE_FALSE(none_b.defined());
      CHECK(max_rel(iw, std::get<1>(ref) + d(sw)) < tol);
      CHECK(max_rel(ib, std::get<2>(ref) + d(sb)) < tol);
    }
  REQUIRE(any_kernel == true);
}

// The function in a graph on a GPU: fused against the engine before, through a residual that a
// second norm forks from, as the block does (x -> norm_1, x1 = x + f(y1) -> norm_2, out).
TEST_CASE("LayerNorm with the residual's gradient on a GPU: two norms against autograd's fork", "[norm]") {
  if (!gpu_or_skip("the LayerNorm function")) return;
  torch::manual_seed(6);
  const at::Device gpu(at::kCUDA, 0);
  const auto o = at::TensorOptions().device(gpu);
  const int64_t h = 2048;
  const auto type = at::kBFloat16;
  const auto x0 = at::randn({2, 64, h}, o).to(type), w1 = (1 + 0.1 * at::randn({h}, o)).to(type),
             w2 = (1 + 0.1 * at::randn({h}, o)).to(type), b1 = (0.1 * at::randn({h}, o)).to(type),
             b2 = (0.1 * at::randn({h}, o)).to(type), up = at::randn({2, 64, h}, o).to(type);
  std::vector<at::Tensor> grads[2];
  const bool was = norm_residual_fused();
  for (bool fused : {true, false}) {
    set_norm_residual_fused(fused);
    std::vector<at::Tensor> p{x0.clone(), w1.clone(), b1.clone(), w2.clone(), b2.clone()};
    for (auto& t : p) t.requires_grad_(true);
    const auto n1 = layer_norm_residual(p[0], p[1], p[2]);
    const auto x1 = n1.residual + at::gelu(n1.y);
    const auto n2 = layer_norm_residual(x1, p[3], p[4]);
    torch::autograd::backward({n2.residual + n2.y * n2.y}, {up});
    if (fused) REQUIRE(norm_residual_ran_kernel());
    for (auto& t : p) grads[fused].push_back(t.grad());
  }
  set_norm_residual_fused(was);
  for (size_t i = 0; i < grads[0].size(); ++i) {
    INFO("input " << i);
    CHECK(max_rel(grads[1][i], grads[0][i]) < 2e-2);
  }
}
