// backends/torch/gemm_epilogues.cpp: the block's MLP and biased linears. On a GPU built with
// cuBLASLt, the fused GEMMs against an fp32 reference, next to ATen's own 16-bit ops; elsewhere,
// ATen's expressions themselves.
#include <torch/torch.h>

#include <algorithm>
#include <tuple>
#include <vector>
#include "backends/torch/gemm_epilogues.hpp"
#include "backends/torch/gpt.hpp"
#include "tests/torch/kernel_test.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;
using dssim::tb::test::gpu_or_skip;
using dssim::tb::test::max_rel;

namespace {
// Whether this build's cuBLASLt path takes a bf16 GEMM on the GPU (asked with a device only).
bool cublaslt_built() {
  const auto o = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16);
  return gemm_epilogues_apply(at::zeros({8, 8}, o), at::zeros({8, 8}, o));
}
}  // namespace

namespace {
struct Run {
  std::vector<at::Tensor> values;  // output, then the gradient of every input that has one
};

// Three blocks' worth of the block's GEMMs, forward and backward with upstream gradient `up`, in
// the inputs' type (inputs(): x, w1, b1, w2, b2, a residual of x's shape, one of the linear's output):
//   mlp && bias2:   residual + MLP with b2 (the block without TP)
//   mlp && !bias2:  the MLP without b2 (TP: the bias follows the reduction)
//   !mlp && bias2:  residual + x w1^T + b1 (the attention projection)
//   !mlp && !bias2: the QKV projection and attention of x w1^T + b1, 4 heads (w1 [3h, h])
// `fused`: through gemm_epilogues / gpt.hpp; otherwise ATen's expressions written out here. Returns
// the output, then the gradients of the inputs the case uses.
Run run(const std::vector<at::Tensor>& in, const at::Tensor& up, bool is_mlp, bool bias2, bool fused) {
  std::vector<at::Tensor> p;
  for (const auto& t : in) p.push_back(t.detach().clone().requires_grad_(true));
  at::Tensor out;
  std::vector<int> used;
  if (is_mlp && bias2) {
    out = fused ? mlp(p[0], p[1], p[2], p[3], p[4], p[5])
                : p[5] + at::linear(at::gelu(at::linear(p[0], p[1], p[2]), "tanh"), p[3], p[4]);
    used = {0, 1, 2, 3, 4, 5};
  } else if (is_mlp) {
    out = fused ? mlp(p[0], p[1], p[2], p[3], at::Tensor()) : at::linear(at::gelu(at::linear(p[0], p[1], p[2]), "tanh"), p[3]);
    used = {0, 1, 2, 3};
  } else if (bias2) {
    out = fused ? biased_linear(p[0], p[1], p[2], p[6]) : p[6] + at::linear(p[0], p[1], p[2]);
    used = {0, 1, 2, 6};
  } else {
    out = fused ? qkv_projection_attention(p[0], p[1], p[2], 4, false) : qkv_attention(at::linear(p[0], p[1], p[2]), 4);
    used = {0, 1, 2};
  }
  torch::autograd::backward({out}, {up});
  Run r{{out.detach()}};
  for (int i : used) r.values.push_back(p[i].grad());
  return r;
}

// Inputs of a block-shaped MLP / linear: x [2, 48, h], w1 [f, h], b1 [f], w2 [h, f], b2 [h], and
// residuals [2, 48, h], [2, 48, f].
std::vector<at::Tensor> inputs(const at::Device& dev, at::ScalarType t, int64_t h, int64_t f) {
  auto o = at::TensorOptions().device(dev);
  return {at::randn({2, 48, h}, o).to(t),         (at::randn({f, h}, o) * 0.08).to(t), (at::randn({f}, o) * 0.3).to(t),
          (at::randn({h, f}, o) * 0.05).to(t),  (at::randn({h}, o) * 0.3).to(t),     at::randn({2, 48, h}, o).to(t),
          at::randn({2, 48, f}, o).to(t)};
}
}  // namespace

TEST_CASE("block MLP and biased linear: ATen's expressions where not fused", "[epilogues]") {
  torch::manual_seed(11);
  const auto in = inputs(at::kCPU, at::kFloat, 16, 48);  // f = 3h: also the QKV projection's shape
  REQUIRE_FALSE(gemm_epilogues_apply(in[0], in[1]));  // fp32 on the host never runs fused
  for (bool is_mlp : {true, false})
    for (bool bias2 : {true, false}) {
      const int64_t o = is_mlp ? 16 : 48;
      const auto up = !is_mlp && !bias2 ? at::randn({2, 4, 48, 4}) : at::randn({2, 48, o});
      const Run a = run(in, up, is_mlp, bias2, true), b = run(in, up, is_mlp, bias2, false);
      REQUIRE(a.values.size() == b.values.size());
      for (size_t i = 0; i < a.values.size(); ++i) REQUIRE(at::equal(a.values[i], b.values[i]));
    }
}

TEST_CASE("block MLP and biased linear on a GPU: cuBLASLt epilogues against fp32", "[epilogues]") {
  if (!gpu_or_skip("the fused epilogues", "cuBLASLt", cublaslt_built)) return;
  const at::Device gpu(at::kCUDA, 0);
  torch::manual_seed(12);
  double worst_fused = 0, worst_aten = 0;
  for (auto type : {at::kBFloat16, at::kHalf})
    for (bool is_mlp : {true, false})
      for (bool bias2 : {true, false}) {
        const bool qkv = !is_mlp && !bias2;
        INFO(c10::toString(type) << (qkv ? " qkv + attention" : is_mlp ? " mlp" : " linear") << (bias2 ? " with b2" : ""));
        const int64_t h = 64, f = qkv ? 3 * h : 256, o = is_mlp ? h : f;
        const auto in = inputs(gpu, type, h, f);
        const auto up = (qkv ? at::randn({2, 4, 48, 16}, at::TensorOptions().device(gpu))
                             : at::randn({2, 48, o}, at::TensorOptions().device(gpu))).to(type);
        std::vector<at::Tensor> in32;
        for (const auto& t : in) in32.push_back(t.to(at::kFloat));
        const Run ref = run(in32, up.to(at::kFloat), is_mlp, bias2, false);
        const Run fused = run(in, up, is_mlp, bias2, true), aten = run(in, up, is_mlp, bias2, false);
        REQUIRE(fused.values.size() == ref.values.size());
        for (size_t i = 0; i < ref.values.size(); ++i) {
          INFO("value " << i << " (0: output, then the inputs' gradients)");
          const double ef = max_rel(fused.values[i], ref.values[i]), ea = max_rel(aten.values[i], ref.values[i]);
          worst_fused = std::max(worst_fused, ef);
          worst_aten = std::max(worst_aten, ea);
          // 16-bit rounding: the fused GEMMs round once where ATen rounds between its kernels, so
          // they are no further from fp32 than ATen's ops (a wrong layout or GELU is off by O(1)).
          CHECK(ef <= std::max(2 * ea, 1e-2));
        }
      }
  WARN("largest relative difference from fp32: fused " << worst_fused << ", ATen's 16-bit ops " << worst_aten);
  REQUIRE(gemm_epilogue_fallbacks() == 0);
}

// The single GEMMs dssim calibrate times (gemm_epilogues.hpp): each refuses where it would not run
// fused, leaving its outputs alone; on a GPU each matches its ATen expression computed in fp32.
TEST_CASE("single epilogue GEMMs: refused on the host, exact to 16-bit rounding on a GPU", "[epilogues]") {
  torch::manual_seed(13);
  const int64_t T = 48, n = 32, k = 64;
  for (auto dev : {at::Device(at::kCPU), at::Device(at::kCUDA, 0)}) {
    const bool gpu = dev.is_cuda();
    if (gpu && !torch::cuda::is_available()) continue;
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    const auto x = at::randn({T, k}, o), w = (at::randn({n, k}, o) * 0.1), b = at::randn({n}, o), r = at::randn({T, n}, o);
    const auto dy = at::randn({T, n}, o), pre = at::randn({T, k}, o);
    auto m = at::full({T, n}, 7.0, o), aux = at::full({T, n}, 7.0, o), out = at::full({T, n}, 7.0, o);
    auto dpre = at::full({T, k}, 7.0, o), dw = at::full({n, k}, 7.0, o), db = at::full({n}, 7.0, o);
    const bool fused = gemm_epilogues_apply(x, w, b);
    REQUIRE(gemm_gelu_aux_bias(x, w, b, m, aux) == fused);
    REQUIRE(gemm_bias_residual(x, w, b, r, out) == fused);
    REQUIRE(gemm_dgelu(dy, w, pre, dpre) == fused);  // dy [T x n] W [n x k]
    REQUIRE(gemm_bgradb(dy, x, dw, db) == fused);
    if (!fused) {
      if (gpu) WARN("no cuBLASLt in this build: the single epilogue GEMMs' GPU check is skipped");
      for (const auto& t : {m, aux, out, dpre, dw, db}) REQUIRE(at::equal(t, at::full_like(t, 7.0)));  // untouched
      continue;
    }
    const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const auto pre_ref = at::addmm(f(b), f(x), f(w).t());
    CHECK(max_rel(aux, pre_ref) < 1e-2);
    CHECK(max_rel(m, at::gelu(pre_ref, "tanh")) < 1e-2);
    CHECK(max_rel(out, f(r) + pre_ref) < 1e-2);
    CHECK(max_rel(dpre, at::gelu_backward(at::mm(f(dy), f(w)), f(pre), "tanh")) < 1e-2);
    CHECK(max_rel(dw, at::mm(f(dy).t(), f(x))) < 1e-2);
    CHECK(max_rel(db, f(dy).sum(0)) < 1e-2);
  }
}

// gemm_epilogues.hpp bias_grad: the column sum behind every bias gradient, written or added; on a
// GPU dssim's kernel (bias_grad_cuda.cu) where the layout allows, ATen's sum elsewhere.
TEST_CASE("bias gradient: the sum of dy's rows, written or added, on the host and a GPU", "[epilogues]") {
  torch::manual_seed(14);
  set_wgrad_in_place(true);  // the kernel's mode
  for (auto dev : {at::Device(at::kCPU), at::Device(at::kCUDA, 0)}) {
    if (dev.is_cuda() && !torch::cuda::is_available()) continue;
    for (auto type : {at::kBFloat16, at::kHalf, at::kFloat}) {
      if (type == at::kHalf && !dev.is_cuda()) continue;  // libtorch 1.13 has no fp16 sum on the host
      // (rows, cols, ld): the kernel's layout with a row stride past the columns, rows that split
      // unevenly, a column count it refuses (not a multiple of 16 bytes: ATen's sum), one row.
      for (auto [rows, cols, ld] : {std::tuple<int64_t, int64_t, int64_t>{3001, 520, 528}, {16384, 256, 256},
                                    {77, 12, 12}, {1, 64, 64}}) {
        INFO(dev << " " << c10::toString(type) << " rows " << rows << " cols " << cols << " ld " << ld);
        const auto o = at::TensorOptions().device(dev).dtype(type);
        const auto f32 = at::TensorOptions().device(dev);
        const auto dy = at::randn({rows, ld}, f32).to(type).narrow(1, 0, cols);
        const auto ref = dy.to(at::kDouble).sum(0);
        auto db = at::full({cols}, 7.0, o);
        bias_grad(dy, db, false);
        const double tol = type == at::kFloat ? 1e-5 : 1e-2;
        CHECK(max_rel(db, ref) < tol);
        const auto before = at::randn({cols}, f32).to(type);
        auto acc = before.clone();
        bias_grad(dy, acc, true);
        CHECK(max_rel(acc, ref + before.to(at::kDouble)) < tol);
        // The kernel sums in a fixed order: the same bits again.
        auto again = at::full({cols}, 7.0, o);
        bias_grad(dy, again, false);
        REQUIRE(at::equal(again, db));
      }
    }
  }
}

// The block's backward adds its weight and bias gradients into the parameters' preset gradient
// buffers (the engine's views into its flat buffers) where they take them (grad_in_place), over two
// micro-batches, as AccumulateGrad would: against the same block with no preset buffers.
TEST_CASE("block weight gradients added into preset gradient buffers in place", "[epilogues]") {
  if (!gpu_or_skip("the in-place weight gradients", "cuBLASLt", cublaslt_built)) return;
  const at::Device gpu(at::kCUDA, 0);
  torch::manual_seed(15);
  const auto type = at::kBFloat16;
  // In place, and DSSIM_WGRAD=bgradb's temporaries added by AccumulateGrad: the same values.
  for (bool in_place : {true, false})
  for (bool is_mlp : {true, false})
    for (bool bias2 : {true, false}) {
      set_wgrad_in_place(in_place);
      const bool qkv = !is_mlp && !bias2;
      INFO((in_place ? "in place, " : "bgradb, ") << (qkv ? "qkv + attention" : is_mlp ? "mlp" : "linear")
           << (bias2 ? " with b2" : ""));
      const int64_t h = 64, f = qkv ? 3 * h : 256, o = is_mlp ? h : f;
      const auto in = inputs(gpu, type, h, f);
      const auto opts = at::TensorOptions().device(gpu);
      std::vector<at::Tensor> ups;
      for (int mb = 0; mb < 2; ++mb)
        ups.push_back((qkv ? at::randn({2, 4, 48, 16}, opts) : at::randn({2, 48, o}, opts)).to(type));
      // Two micro-batches each way: `preset` starts every parameter's gradient at a buffer of its own
      // (random values, as a step's earlier micro-batches would leave), the reference at none.
      std::vector<at::Tensor> preset, plain, start;
      for (size_t i = 0; i < in.size(); ++i) {
        preset.push_back(in[i].detach().clone().requires_grad_(true));
        plain.push_back(in[i].detach().clone().requires_grad_(true));
        start.push_back(at::randn(in[i].sizes(), opts).to(type) * 0.01);
        if (i >= 1 && i <= 4) preset[i].mutable_grad() = start[i].clone();  // the weights and biases
      }
      std::vector<void*> buffers;
      for (size_t i = 1; i <= 4; ++i) buffers.push_back(preset[i].grad().data_ptr());
      const auto forward = [&](std::vector<at::Tensor>& p) {
        if (is_mlp) return mlp(p[0], p[1], p[2], p[3], bias2 ? p[4] : at::Tensor(), bias2 ? p[5] : at::Tensor());
        if (bias2) return biased_linear(p[0], p[1], p[2], p[6]);
        return qkv_projection_attention(p[0], p[1], p[2], 4, false);
      };
      for (const auto& up : ups) {
        torch::autograd::backward({forward(preset)}, {up});
        torch::autograd::backward({forward(plain)}, {up});
      }
      const std::vector<int> params = is_mlp ? (bias2 ? std::vector<int>{1, 2, 3, 4} : std::vector<int>{1, 2, 3})
                                             : std::vector<int>{1, 2};
      for (int i : params) {
        INFO("parameter " << i);
        REQUIRE(preset[i].grad().data_ptr() == buffers[i - 1]);  // the same buffer, added into
        CHECK(max_rel(preset[i].grad(), plain[i].grad().to(at::kDouble) + start[i].to(at::kDouble)) < 2e-2);
      }
      // The input's gradient does not depend on where the weights' went.
      REQUIRE(at::equal(preset[0].grad(), plain[0].grad()));
    }
}
