// backends/torch/fused_cross_entropy.cpp against PyTorch's cross_entropy_loss on fp32 logits (what
// the engine runs with model.cross_entropy: unfused), on the host.
#include <torch/torch.h>

#include "backends/torch/fused_cross_entropy.hpp"
#include "core/model.hpp"
#include "tests/torch/kernel_test.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;
using dssim::tb::test::gpu_or_skip;
using dssim::tb::test::max_rel;

namespace {
struct Case {
  at::Tensor loss, gy, gw;
};

// Loss and gradients of mean CE(y w^T) times `upstream` (the engine scales the loss by the loss scale
// over the accumulation steps), fused with `chunk` tokens per chunk (0: none, PyTorch's own).
Case run(const at::Tensor& y0, const at::Tensor& w0, const at::Tensor& t, int64_t chunk, double upstream) {
  auto y = y0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  at::Tensor loss = chunk == 0 ? at::cross_entropy_loss(at::matmul(y, w.t()).to(at::kFloat), t)
                               : fused_linear_cross_entropy(y, w, t, chunk);
  torch::autograd::backward({loss * upstream});
  return {loss.detach(), y.grad(), w.grad()};
}
}  // namespace

TEST_CASE("fused linear cross-entropy equals PyTorch's cross-entropy on fp32 logits", "[fused_ce]") {
  torch::manual_seed(3);
  const int64_t T = 37, h = 16, V = 101;  // ragged chunks: 37 tokens by 5, 16 and 37
  auto y = at::randn({T, h}), w = at::randn({V, h}) * 0.5;
  auto t = at::randint(V, {T}, at::kLong);
  const Case ref = run(y, w, t, 0, 0.37);
  for (int64_t chunk : {5, 16, 37}) {
    INFO("chunk " << chunk);
    const Case f = run(y, w, t, chunk, 0.37);
    CHECK(std::abs(f.loss.item<double>() - ref.loss.item<double>()) <= 1e-6 * ref.loss.item<double>());
    CHECK(max_rel(f.gy, ref.gy) <= 1e-5);
    CHECK(max_rel(f.gw, ref.gw) <= 1e-5);
  }
  // A wrong target (the one-hot off by one) is seen: the test can fail.
  const Case off = run(y, w, (t + 1) % V, 5, 0.37);
  CHECK(max_rel(off.gy, ref.gy) > 1e-2);
}

TEST_CASE("fused linear cross-entropy in bf16: the unfused path's rounding, only y or only w trained", "[fused_ce]") {
  torch::manual_seed(5);
  const int64_t T = 64, h = 32, V = 300;
  auto y = at::randn({T, h}).to(at::kBFloat16), w = (at::randn({V, h}) * 0.3).to(at::kBFloat16);
  auto t = at::randint(V, {T}, at::kLong);
  const Case ref = run(y, w, t, 0, 1.0);
  const Case f = run(y, w, t, 24, 1.0);
  CHECK(std::abs(f.loss.item<double>() - ref.loss.item<double>()) <= 1e-3 * ref.loss.item<double>());
  CHECK(max_rel(f.gy, ref.gy) <= 2e-2);
  CHECK(max_rel(f.gw, ref.gw) <= 2e-2);
  // A frozen head (LoRA's default): only the input's gradient.
  auto yy = y.clone().requires_grad_(true);
  torch::autograd::backward({fused_linear_cross_entropy(yy, w, t, 24)});
  CHECK(max_rel(yy.grad(), ref.gy) <= 2e-2);
  // Without grad mode: the loss alone.
  at::NoGradGuard ng;
  CHECK(std::abs(fused_linear_cross_entropy(y, w, t).item<double>() - ref.loss.item<double>()) <= 1e-3 * ref.loss.item<double>());
}

TEST_CASE("fused cross-entropy chunks: fp32 probabilities of one chunk within 1 GiB", "[fused_ce]") {
  // GPT 1.3B's micro-batch 8 x 2048 on V 51200: 4 chunks of 4096 tokens (0.78 GiB of fp32 each).
  CHECK(dssim::fused_cross_entropy_chunk_tokens(16384, 51200) == 4096);
  CHECK(dssim::fused_cross_entropy_chunk_tokens(100, 51200) == 100);  // small: one chunk
  const int64_t T = 16384 * 3 + 1, V = 128256;  // Llama 3's vocabulary, a ragged token count
  const int64_t c = dssim::fused_cross_entropy_chunk_tokens(T, V), chunks = (T + c - 1) / c;
  CHECK(4.0 * double(c - 1) * V <= 1024.0 * 1024 * 1024);
  CHECK(4.0 * double(T) * V / double(chunks - 1) > 1024.0 * 1024 * 1024);  // one chunk fewer would not fit
}

// On a GPU built with dssim's CUDA kernels, cross_entropy_chunk is one kernel (cross_entropy_cuda.cu):
// against log_softmax in double on the same logits, for each logits type, rows of a length that
// takes the 16-byte loads (1024) and one that does not (1000). Skipped, with a warning, without a GPU.
TEST_CASE("cross-entropy chunk on a GPU: the CUDA kernel against log_softmax in double", "[fused_ce]") {
  if (!gpu_or_skip("the cross-entropy kernel")) return;
  torch::manual_seed(9);
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  double worst_loss = 0, worst_grad = 0;
  for (auto type : {at::kBFloat16, at::kHalf, at::kFloat})
    for (int64_t V : {1024, 1000}) {
      INFO(c10::toString(type) << " vocab " << V);
      const int64_t n = 37;
      const double scale = 1.0 / 91;
      auto logits = (at::randn({n, V}, gpu) * 3).to(type);
      auto t = at::randint(V, {n}, gpu.dtype(at::kLong));
      auto [loss, grad] = cross_entropy_chunk(logits, t, scale);
      auto ls = at::log_softmax(logits.to(at::kDouble), 1);
      auto ref_loss = -ls.gather(1, t.reshape({-1, 1})).sum();
      auto ref_grad = (ls.exp() - at::one_hot(t, V).to(at::kDouble)) * scale;
      const double el = std::abs(loss.item<double>() - ref_loss.item<double>()) / ref_loss.item<double>();
      const double eg = (grad.to(at::kDouble) - ref_grad).abs().max().item<double>() / ref_grad.abs().max().item<double>();
      worst_loss = std::max(worst_loss, el);
      worst_grad = std::max(worst_grad, eg);
      CHECK(grad.scalar_type() == type);
      CHECK(el <= 1e-5);
      CHECK(eg <= (type == at::kFloat ? 1e-5 : type == at::kHalf ? 1e-3 : 8e-3));  // one rounding of the type
      auto [loss_only, none] = cross_entropy_chunk(logits, t, 0.0);
      CHECK_FALSE(none.defined());
      CHECK(loss_only.item<double>() == loss.item<double>());
    }
  WARN("cross-entropy kernel against double: loss " << worst_loss << ", gradient " << worst_grad);
}
