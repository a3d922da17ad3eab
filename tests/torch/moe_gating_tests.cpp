// backends/torch/moe.cpp's gate against references written out here token by token: DeepSpeed's
// capacity formula, which assignments are kept and where they land, the dropped counts, the
// renormalised top-2 weights and the load-balancing loss (deepspeed/moe/sharded_moe.py).
#include <malloc.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include <torch/torch.h>
#include <memory>
#include "backends/torch/comm.hpp"
#include "backends/torch/moe.hpp"
#include "core/memory.hpp"
#include "core/model.hpp"
#include "backends/torch/torch_compat.hpp"
#include "tests/torch/allocation_peak.hpp"
// After libtorch: its glog defines a CHECK of its own; Catch's REQUIRE is used throughout.
#include <catch2/catch.hpp>

using namespace dssim;
using namespace dssim::tb;

namespace {

ModelSpec moe_model(int experts, int k, double cf, int min_capacity = 4) {
  ModelSpec m;
  m.layers = 2;
  m.hidden = 16;
  m.heads = 2;
  m.vocab = 64;
  m.seq_len = 8;
  m.experts = experts;
  m.top_k = k;
  m.capacity_factor = cf;
  m.min_capacity = min_capacity;
  return m;
}

// A fixed batch of logits with a deliberately unbalanced router: expert 0 and 1 favoured.
at::Tensor fixed_logits(int64_t T, int64_t E) {
  auto gen = seeded_generator(at::Device(at::kCPU), 42);
  auto l = at::empty({T, E});
  l.normal_(0.0, 1.0, gen);
  l.select(1, 0).add_(1.0);
  l.select(1, 1).add_(0.5);
  return l;
}

std::vector<double> row(const at::Tensor& t, int64_t i) {
  std::vector<double> v;
  for (int64_t j = 0; j < t.size(1); ++j) v.push_back(t[i][j].item<double>());
  return v;
}

std::vector<double> softmax_row(std::vector<double> v) {
  const double mx = *std::max_element(v.begin(), v.end());
  double s = 0;
  for (auto& x : v) s += (x = std::exp(x - mx));
  for (auto& x : v) x /= s;
  return v;
}

int argmax(const std::vector<double>& v) { return int(std::max_element(v.begin(), v.end()) - v.begin()); }

// The load-balancing loss by its definition: E * sum_e (mean gate prob of e) * (share of tokens
// whose first choice is e).
double aux_reference(const at::Tensor& logits) {
  const int64_t T = logits.size(0), E = logits.size(1);
  std::vector<double> me(E, 0), ce(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_row(row(logits, t));
    for (int64_t e = 0; e < E; ++e) me[e] += p[e] / T;
    ce[argmax(p)] += 1.0 / T;
  }
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += me[e] * ce[e];
  return double(E) * s;
}

}  // namespace

TEST_CASE("gate capacity: ceil(k T / E x capacity_factor), at least min_capacity", "[moe]") {
  CHECK(moe_model(8, 1, 1.0).expert_capacity(64) == 8);
  CHECK(moe_model(8, 2, 1.25).expert_capacity(64) == 20);   // ceil(64 / 8 * 1.25 * 2)
  CHECK(moe_model(8, 1, 1.1).expert_capacity(60) == 9);     // ceil(8.25)
  CHECK(moe_model(8, 1, 1.0, 4).expert_capacity(16) == 4);  // 2 -> min_capacity 4
  CHECK(moe_model(8, 1, 1.0, 0).expert_capacity(16) == 2);
}

TEST_CASE("top-1 gate without random token selection: first come, first kept, as a brute force", "[moe]") {
  ModelSpec m = moe_model(4, 1, 1.0, 0);
  m.use_rts = false;
  const int64_t T = 40, E = 4;
  const auto logits = fixed_logits(T, E);
  auto gen = seeded_generator(at::Device(at::kCPU), 1);
  const Routing r = top_k_gating(logits, m, gen);
  const int64_t C = m.expert_capacity(T);
  REQUIRE(r.capacity == C);
  std::vector<int64_t> load(E, 0);
  int64_t dropped = 0;
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_row(row(logits, t));
    const int e = argmax(p);
    REQUIRE(r.expert[t][0].item<int64_t>() == e);
    if (load[e] < C) {
      REQUIRE(r.slot[t][0].item<int64_t>() == load[e]);
      REQUIRE(r.weight[t][0].item<double>() == Approx(p[e]).epsilon(1e-6));
    } else {
      REQUIRE(r.slot[t][0].item<int64_t>() == -1);
      REQUIRE(r.weight[t][0].item<double>() == 0.0);
      ++dropped;
    }
    ++load[e];
  }
  CHECK(dropped > 0);  // the unbalanced router overflows expert 0
  CHECK(r.dropped.item<int64_t>() == dropped);
  for (int64_t e = 0; e < E; ++e) CHECK(r.exp_counts[e].item<int64_t>() == load[e]);
  CHECK(r.l_aux.item<double>() == Approx(aux_reference(logits)).epsilon(1e-6));
}

TEST_CASE("top-1 gate with random token selection keeps min(load, capacity) per expert, slots in token order", "[moe]") {
  ModelSpec m = moe_model(4, 1, 1.0, 0);
  const int64_t T = 40, E = 4;
  const auto logits = fixed_logits(T, E);
  auto gen = seeded_generator(at::Device(at::kCPU), 3);
  const Routing r = top_k_gating(logits, m, gen);
  const int64_t C = r.capacity;
  std::vector<int64_t> load(E, 0), kept(E, 0);
  int64_t dropped = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int e = argmax(softmax_row(row(logits, t)));
    ++load[e];
    const int64_t s = r.slot[t][0].item<int64_t>();
    if (s < 0) {
      ++dropped;
      continue;
    }
    REQUIRE(s == kept[e]);  // kept tokens fill the buffer in token order
    ++kept[e];
  }
  int64_t want_dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    CHECK(kept[e] == std::min(load[e], C));
    want_dropped += std::max<int64_t>(0, load[e] - C);
  }
  CHECK(dropped == want_dropped);
  CHECK(r.dropped.item<int64_t>() == want_dropped);
  // Which tokens survive is random: another draw keeps another subset of the overflowing expert.
  auto gen2 = seeded_generator(at::Device(at::kCPU), 4);
  const Routing r2 = top_k_gating(logits, m, gen2);
  CHECK(r2.dropped.item<int64_t>() == want_dropped);
  CHECK(!at::equal(r.slot, r2.slot));
}

TEST_CASE("top-2 gate: second choice never the first, first choices fill before second ones, weights renormalised", "[moe]") {
  ModelSpec m = moe_model(4, 2, 1.0, 0);
  const int64_t T = 32, E = 4;
  const auto logits = fixed_logits(T, E);
  auto gen = seeded_generator(at::Device(at::kCPU), 5);
  const Routing r = top_k_gating(logits, m, gen);
  const int64_t C = m.expert_capacity(T);  // ceil(32 / 4 * 2) = 16
  REQUIRE(r.capacity == C);
  std::vector<int64_t> first_load(E, 0), second_seen(E, 0);
  for (int64_t t = 0; t < T; ++t) first_load[argmax(softmax_row(row(logits, t)))]++;
  int64_t dropped = 0;
  std::vector<int64_t> first_seen(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_row(row(logits, t));
    const int e1 = argmax(p);
    const int e2 = int(r.expert[t][1].item<int64_t>());
    REQUIRE(r.expert[t][0].item<int64_t>() == e1);
    REQUIRE(e2 != e1);
    const int64_t loc1 = first_seen[e1]++;
    const int64_t loc2 = first_load[e2] + second_seen[e2]++;  // after every first choice of e2
    const bool k1 = loc1 < C, k2 = loc2 < C;
    REQUIRE(r.slot[t][0].item<int64_t>() == (k1 ? loc1 : -1));
    REQUIRE(r.slot[t][1].item<int64_t>() == (k2 ? loc2 : -1));
    dropped += !k1 + !k2;
    const double g1 = k1 ? p[e1] : 0, g2 = k2 ? p[e2] : 0;
    const double d = std::max(g1 + g2, double(std::numeric_limits<float>::epsilon()));
    REQUIRE(r.weight[t][0].item<double>() == Approx(g1 / d).epsilon(1e-5));
    REQUIRE(r.weight[t][1].item<double>() == Approx(g2 / d).epsilon(1e-5));
  }
  CHECK(dropped > 0);
  CHECK(r.dropped.item<int64_t>() == dropped);
  // top-2's l_aux: E^2 mean_e(me * ce) = the same E sum_e(me * ce) of the first choices.
  CHECK(r.l_aux.item<double>() == Approx(aux_reference(logits)).epsilon(1e-6));
}

TEST_CASE("drop_tokens false: the capacity is the busiest expert's load (the group's maximum), nothing dropped", "[moe]") {
  ModelSpec m = moe_model(4, 1, 1.0, 0);
  m.drop_tokens = false;
  const int64_t T = 40, E = 4;
  const auto logits = fixed_logits(T, E);
  std::vector<int64_t> load(E, 0);
  for (int64_t t = 0; t < T; ++t) load[argmax(softmax_row(row(logits, t)))]++;
  const int64_t busiest = *std::max_element(load.begin(), load.end());
  auto gen = seeded_generator(at::Device(at::kCPU), 6);
  const Routing r = top_k_gating(logits, m, gen);
  CHECK(r.capacity == busiest);
  CHECK(r.dropped.item<int64_t>() == 0);
  auto gen2 = seeded_generator(at::Device(at::kCPU), 6);
  const Routing g = top_k_gating(logits, m, gen2, [](int64_t v) { return v + 7; });  // another rank's busier
  CHECK(g.capacity == busiest + 7);
  CHECK(g.dropped.item<int64_t>() == 0);
}

TEST_CASE("the gate's gradient reaches the logits through the combine weights and l_aux", "[moe]") {
  ModelSpec m = moe_model(4, 2, 1.25, 0);
  auto logits = fixed_logits(24, 4).requires_grad_(true);
  auto gen = seeded_generator(at::Device(at::kCPU), 8);
  const Routing r = top_k_gating(logits, m, gen);
  (r.weight.sum() + r.l_aux).backward();
  REQUIRE(logits.grad().defined());
  CHECK(logits.grad().abs().sum().item<double>() > 0);
}

// What an MoE layer keeps for its backward, counted on the host heap (glibc's mallinfo2: the main
// arena's bytes in use plus the mmapped ones; every tensor here is allocated on this thread), against
// core/memory.cpp's count. fp32, where libtorch's CPU linears keep only their inputs (its bf16 CPU
// GEMMs hold tens of kB more; the bf16 count was measured on a GPU, docs/torch-backend.md). The
// layer's input stands for the LayerNorm output a block feeds it: the model counts that in the
// block's replicated part (2 sc h a token) and takes it back in the MoE term, where the gate's fp32
// input (4h) replaces it; in fp32 the gate's input is the input itself, so nothing new. New here:
// slots (2h + 4 ffn) sc + 4 E + 4 sc top_k h per token (the experts' inputs, GeLU's input and
// output; the gate probabilities; the dispatch's and the combine's gathered rows).
namespace {
double heap_bytes() {
  const struct mallinfo2 mi = ::mallinfo2();
  return double(mi.uordblks) + double(mi.hblkhd);
}
}  // namespace

TEST_CASE("an MoE layer keeps what core/memory counts for it (fp32, top-2, on the host heap)", "[moe][memory]") {
  at::set_num_threads(1);
  ModelSpec m = moe_model(4, 2, 1.25);
  m.hidden = 512;
  m.ffn_hidden = 2048;
  m.seq_len = 64;
  const int64_t B = 2, S = m.seq_len, h = m.hidden, f = m.ffn_hidden, E = m.experts, T = B * S;
  auto gen = seeded_generator(at::Device(at::kCPU), 7);
  const auto param = [&](std::vector<int64_t> shape, double std) {
    auto t = at::empty(shape);
    t.normal_(0.0, std, gen);
    return t.requires_grad_(true);
  };
  ExpertParallel ep;
  MoeLayer L;
  L.model = &m;
  L.ep = &ep;
  L.seed = 11;
  for (int64_t e = 0; e < E; ++e)
    L.experts.push_back({param({f, h}, 0.02), param({f}, 0.02), param({h, f}, 0.02), param({h}, 0.02)});
  const at::Tensor gate_w = param({E, h}, 0.02);
  const at::Tensor x = param({B, S, h}, 1.0);

  const double before = heap_bytes();
  at::Tensor out = moe_mlp_forward(L, gate_w, x);
  const double kept = heap_bytes() - before - double(out.numel()) * double(out.element_size());
  const double slots = moe_routed_slots(m, double(T));
  REQUIRE(slots == double(E * L.capacity));
  const double sc = 2;  // fp32: twice the 2-byte terms
  const double moe = activation_bytes_per_layer(m, int(B), 1, false, Recompute::none, true, Dtype::fp32);
  const double dense = activation_bytes_per_layer(m, int(B), 1, false, Recompute::none, false, Dtype::fp32);
  // The MoE term (moe - dense), plus the dense MLP's 4 sc ffn it replaces and the MLP input's 2 sc h
  // it takes back, less the gate's input (the layer's input itself in fp32).
  const double modelled = moe - dense + 4 * sc * T * f + 2 * sc * T * h - 4.0 * T * h;
  REQUIRE(modelled == Approx(slots * (2 * h + 4 * f) * sc + 4.0 * T * E + 2 * sc * m.top_k * T * h));
  INFO("kept " << kept << " bytes, modelled " << modelled);
  // The rest, about 110 kB (1.6 %) here: [T, E] masks, the routing's indices, the allocator's headers.
  REQUIRE(kept == Approx(modelled).epsilon(0.03));
  // Without the combine's gathered rows the model would be 0.52 MB (8 %) short here; with the
  // dispatch's gathered rows too (what autograd's index_copy kept) 0.52 MB (8 %) over.
  REQUIRE(kept - (modelled - 2 * sc * m.top_k * T * h) > 0.05 * modelled);
  REQUIRE((modelled + 2 * sc * m.top_k * T * h) - kept > 0.05 * modelled);
  // The graph holds all of it: gone with the output and the load-balancing loss.
  out = at::Tensor();
  L.l_aux = at::Tensor();
  L.dropped = at::Tensor();
  REQUIRE(std::abs(heap_bytes() - before) < 0.01 * modelled);
}

// ExpertStore's set-up holds no more than its steady state and one fp32 tensor: every byte the CPU
// allocator hands out while it builds is seen (tests/torch/allocation_peak.hpp), so the peak is
// exact. Drawing the whole fp32 buffer first and sharding it after held 4 bytes an expert parameter
// more while the moments allocated.
TEST_CASE("ExpertStore's set-up peaks at its steady state plus one fp32 tensor", "[moe][memory]") {
  at::set_num_threads(1);
  ModelSpec m = moe_model(4, 2, 1.25);
  m.hidden = 256;
  m.ffn_hidden = 1024;
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    ExpertStore::Options o;
    o.stage = stage;
    o.dtype = at::kBFloat16;
    auto edp = make_local_communicator();
    auto reporter = std::make_shared<dssim::test::AllocationPeak>();
    int64_t held = 0;
    std::unique_ptr<ExpertStore> store;
    {
      c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, reporter);
      store = std::make_unique<ExpertStore>(m, std::vector<int>{0, 2}, edp.get(), o);
      held = reporter->now;
    }
    const int64_t padded = store->partition().padded_numel, shard = stage == 0 ? padded : store->partition().shard_numel;
    // Held: the 16-bit parameters and gradients (2 + 2 bytes), the fp32 master, moments and accumulator.
    CHECK(held == 4 * padded + 16 * shard);
    const int64_t largest = 4 * int64_t(m.hidden) * m.ffn_hidden;  // one expert weight drawn in fp32
    CHECK(reporter->peak <= held + largest);
    CHECK(reporter->peak > held);  // the draw is seen
  }
}
