// backends/torch/gpt.cpp's qkv_attention against autograd's own path through the same attention
// (view, permute, unbind), on the host: the same output and QKV gradient, to the bit.
#include <torch/torch.h>

#include "backends/torch/gpt.hpp"
#include "backends/torch/torch_compat.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim::tb;

namespace {
struct Case {
  at::Tensor out, grad;
};

// The output and d(sum(out * upstream))/d(qkv), through qkv_attention or through autograd's path.
Case run(const at::Tensor& qkv0, const at::Tensor& upstream, int64_t heads, int path) {
  auto qkv = qkv0.clone().requires_grad_(true);
  at::Tensor out;
  if (path == 0) {
    const int64_t B = qkv.size(0), S = qkv.size(1), d = qkv.size(2) / 3 / heads;
    auto p = qkv.view({B, S, 3, heads, d}).permute({2, 0, 3, 1, 4}).unbind(0);
    out = causal_attention(p[0], p[1], p[2]);
  } else {
    out = qkv_attention(qkv, heads, /*recompute=*/path == 2);
  }
  torch::autograd::backward({(out * upstream).sum()});
  return {out.detach(), qkv.grad()};
}
}  // namespace

TEST_CASE("qkv_attention: the output and QKV gradient of autograd's unbind path, kept or recomputed", "[attention]") {
  torch::manual_seed(11);
  const int64_t B = 2, S = 7, heads = 3, d = 4;
  auto qkv = at::randn({B, S, 3 * heads * d}, at::kDouble);
  auto up = at::randn({B, heads, S, d}, at::kDouble);
  const Case ref = run(qkv, up, heads, 0);
  for (int path : {1, 2}) {
    INFO("path " << (path == 1 ? "kept" : "recomputed"));
    const Case c = run(qkv, up, heads, path);
    CHECK(at::equal(c.out, ref.out));
    CHECK(at::equal(c.grad, ref.grad));
  }
  // Every part of the gradient is written (q's, k's and v's: none left uninitialised or zero).
  for (int i = 0; i < 3; ++i)
    CHECK(ref.grad.view({B, S, 3, heads, d}).select(2, i).abs().sum().item<double>() > 0);
  // The test can fail: k and v swapped in the input give another gradient.
  auto swapped = qkv.view({B, S, 3, heads * d}).index_select(2, at::tensor({0, 2, 1}, at::kLong)).reshape_as(qkv);
  CHECK_FALSE(at::equal(run(swapped, up, heads, 1).grad, ref.grad));
}

TEST_CASE("qkv_attention without gradients builds no graph", "[attention]") {
  auto qkv = at::randn({1, 4, 3 * 2 * 4});
  at::NoGradGuard ng;
  auto out = qkv_attention(qkv, 2);
  CHECK_FALSE(out.requires_grad());
  CHECK(out.sizes() == at::IntArrayRef({1, 2, 4, 4}));
}
