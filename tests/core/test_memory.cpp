// Memory model against the ZeRO paper's Table 1 and Korthikanti et al.'s activation forms.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/memory.hpp"
#include "core/model.hpp"
#include "core/optimizer_step.hpp"
#include "tests/core/gpt_spec.hpp"

using namespace dssim;
using Catch::Detail::Approx;

namespace {

ModelSpec gpt(int layers, int hidden, int heads) {
  ModelSpec m = test::gpt_spec(layers, hidden, heads);
  m.flash_attention = false;  // Korthikanti's forms describe the unfused attention core
  return m;
}

Scenario scenario(const ModelSpec& m, int dp, int tp = 1, int pp = 1, int zero_stage = 0) {
  Scenario sc;
  sc.name = "test";
  sc.model = m;
  sc.parallel.dp = dp;
  sc.parallel.tp = tp;
  sc.parallel.pp = pp;
  sc.zero.stage = zero_stage;
  sc.training.micro_batch = 1;
  sc.training.grad_accum = 16;
  sc.training.global_batch = 16LL * dp;
  sc.precision.dtype = Dtype::fp16;
  return sc;
}

}  // namespace

TEST_CASE("ZeRO Table 1: model-state memory per GPU", "[memory]") {
  // Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  // SC'20, arXiv:1910.02054, Table 1: per-device memory (GB) of model states for K = 12,
  // columns P_os, P_os+g, P_os+g+p; the baseline DP column is 16 psi for every N.
  struct Cell { double psi; int n; double os, os_g, os_g_p; };
  const Cell table[] = {
      {7.5e9, 1, 120, 120, 120},       {7.5e9, 4, 52.5, 41.3, 30},
      {7.5e9, 16, 35.6, 21.6, 7.5},    {7.5e9, 64, 31.4, 16.6, 1.88},
      {7.5e9, 256, 30.4, 15.4, 0.47},  {7.5e9, 1024, 30.1, 15.1, 0.12},
      {128e9, 1, 2048, 2048, 2048},    {128e9, 4, 896, 704, 512},
      {128e9, 16, 608, 368, 128},      {128e9, 64, 536, 284, 32},
      {128e9, 256, 518, 263, 8},       {128e9, 1024, 513, 257, 2},
      {1e12, 1, 16000, 16000, 16000},  {1e12, 4, 7000, 5500, 4000},
      {1e12, 16, 4750, 2875, 1000},    {1e12, 64, 4187, 2218, 250},
      {1e12, 256, 4046, 2054, 62.5},   {1e12, 1024, 4011, 2013, 15.6},
  };
  for (const Cell& c : table) {
    INFO("psi=" << c.psi << " N=" << c.n);
    CHECK(zero_model_state_bytes(c.psi, 0, c.n) / 1e9 == Approx(16 * c.psi / 1e9).epsilon(1e-12));
    // Within 1%, or within the table's rounding (2 decimals: 0.12 for 0.117 at 7.5B, N = 1024).
    CHECK(zero_model_state_bytes(c.psi, 1, c.n) / 1e9 == Approx(c.os).epsilon(0.01));
    CHECK(zero_model_state_bytes(c.psi, 2, c.n) / 1e9 == Approx(c.os_g).epsilon(0.01));
    CHECK(zero_model_state_bytes(c.psi, 3, c.n) / 1e9 ==
          Approx(c.os_g_p).epsilon(0.01).margin(0.005));
  }
  // K is honoured (fp32 Adam without mixed precision would be k = 8 with 4+4 bytes; here only K).
  CHECK(zero_model_state_bytes(1e9, 0, 8, 8) == Approx(12e9));
}

TEST_CASE("Korthikanti activation forms per layer", "[memory]") {
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8;
  const double sbh = s * b * h;
  CHECK(activation_bytes_per_layer(s, b, h, a, 1, false, Recompute::none) ==
        Approx(sbh * (34 + 5 * a * s / h)));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, false, Recompute::none) ==
        Approx(sbh * (10 + 24 / t + 5 * a * s / (h * t))));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, true, Recompute::none) ==
        Approx(sbh * (34 / t + 5 * a * s / (h * t))));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, true, Recompute::selective) == Approx(sbh * 34 / t));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, false, Recompute::selective) ==
        Approx(sbh * (10 + 24 / t)));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, false, Recompute::full) == Approx(2 * sbh));
  CHECK(activation_bytes_per_layer(s, b, h, a, 8, true, Recompute::full) == Approx(2 * sbh / t));

  // Korthikanti section 5: selective recompute saves 70% of GPT-3 175B's activations
  // (t = 8, SP: 5as/h = 80 of 34 + 80 = 114).
  const double none = activation_bytes_per_layer(s, b, h, a, 8, true, Recompute::none);
  const double sel = activation_bytes_per_layer(s, b, h, a, 8, true, Recompute::selective);
  CHECK(5 * a * s / h == Approx(80));
  CHECK(1 - sel / none == Approx(80.0 / 114).epsilon(1e-9));
  CHECK(1 - sel / none == Approx(0.70).margin(0.005));

  // The model-based overload reduces to the same forms for a dense ffn = 4h layer in 16-bit with
  // dropout, plus the LayerNorms' fp32 mean and 1/std (16 bytes per token, split by SP) that
  // Korthikanti leaves out; without dropout the two 1-byte masks per element go.
  ModelSpec m = gpt(96, 12288, 96);
  m.flash_attention = false;
  for (int tp : {1, 2, 8})
    for (bool seqp : {false, true})
      for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
        if (seqp && tp == 1) continue;
        INFO("tp=" << tp << " sp=" << seqp << " r=" << static_cast<int>(r));
        const double sp_div = seqp ? tp : 1;
        const double ln_stats = r == Recompute::full ? 0 : 16 * s * 2 / sp_div;
        CHECK(activation_bytes_per_layer(m, 2, tp, seqp, r, false) ==
              Approx(activation_bytes_per_layer(s, 2, h, a, tp, seqp, r) + ln_stats));
        ModelSpec no_dropout = m;
        no_dropout.dropout = 0;
        // masks: 2 s b h (/t with SP); unfused attention core 5 a s^2 b / t -> 2 a s^2 b / t
        const double masks = r == Recompute::full ? 0 : 2 * s * 2 * h / sp_div;
        const double core = r == Recompute::none ? 3 * a * s * s * 2 / tp : 0;
        CHECK(activation_bytes_per_layer(no_dropout, 2, tp, seqp, r, false) ==
              Approx(activation_bytes_per_layer(m, 2, tp, seqp, r, false) - masks - core));
      }
}

TEST_CASE("in-flight micro-batches: 1F1B and interleaved", "[memory]") {
  CHECK(in_flight_micro_batches(1, 0, 1, 8) == 1);
  CHECK(in_flight_micro_batches(8, 0, 1, 64) == 8);
  CHECK(in_flight_micro_batches(8, 3, 1, 64) == 5);
  CHECK(in_flight_micro_batches(8, 7, 1, 64) == 1);
  CHECK(in_flight_micro_batches(8, 0, 1, 4) == 4);  // fewer micro-batches than stages
  // Korthikanti 4.2.3: interleaving with v chunks multiplies stage 0's memory by 1 + (p-1)/(p v).
  for (int p : {2, 4, 8})
    for (int v : {2, 3, 4}) {
      INFO("p=" << p << " v=" << v);
      CHECK(in_flight_micro_batches(p, 0, v, 1000) == Approx(p * (1 + (p - 1.0) / (p * v))));
    }
}

// ZeRO's accounting keeps 16-bit gradients (2 bytes per element, sharded from stage 2), as
// DeepSpeed's stage 3 does by default (its gradient partition in the training dtype) and dssim's
// engine; with zero.grad_accum_dtype: fp32 that partition is fp32 (4 bytes). At stages 0-2 the
// engine's step reads the 16-bit gradients in place (no fp32 buffer, no fp32 copy).
double engine_model_states(double psi, int stage, int n, bool fp32_partition = false) {
  const double zero = zero_model_state_bytes(psi, stage, n);
  return stage == 3 && fp32_partition ? zero - 2 * psi / n + 4 * psi / n : zero;
}

TEST_CASE("ZeRO-3 7.5B on 64 GPUs: model states 1.88 GB", "[memory]") {
  Scenario sc = scenario(gpt(36, 4096, 32), 64, 1, 1, 3);  // Megatron's 7.5B configuration
  const MemoryBreakdown mb = peak_memory(sc);
  const double psi = parameter_count(sc.model);
  CHECK(zero_model_state_bytes(psi, 3, 64) / 1e9 == Approx(1.88).epsilon(0.01));
  CHECK(mb.model_states() == Approx(engine_model_states(psi, 3, 64)));
  CHECK(mb.model_states() / 1e9 == Approx(1.88).epsilon(0.01));  // the paper's figure itself
  CHECK(mb.grads == Approx(2 * psi / 64));  // the shard's 16-bit gradient partition
  Scenario fp32 = sc;
  fp32.zero.grad_accum_fp32 = true;  // data_types.grad_accum_dtype: fp32
  CHECK(peak_memory(fp32).grads == Approx(4 * psi / 64));
  CHECK(peak_memory(fp32).model_states() == Approx(engine_model_states(psi, 3, 64, true)));
  CHECK(mb.params_gathered > 0);
  // the working set: the largest module (the vocab embedding) plus the prefetch bucket, 16-bit
  CHECK(mb.params_gathered >= 2.0 * (51200.0 * 4096 + sc.zero.prefetch_bucket_size));
  CHECK(mb.params_gathered < 2.0 * (51200.0 * 4096 + sc.zero.prefetch_bucket_size) * 1.05);
}

TEST_CASE("ZeRO stages: model states per stage and monotone totals", "[memory]") {
  const ModelSpec m = gpt(24, 2048, 16);
  const double psi = parameter_count(m);
  double prev_states = 1e300, prev_total = 1e300;
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    const MemoryBreakdown mb = peak_memory(scenario(m, 16, 1, 1, stage));
    CHECK(mb.model_states() == Approx(engine_model_states(psi, stage, 16)));
    CHECK(mb.model_states() < prev_states);
    if (stage > 0) CHECK(mb.optimizer == Approx(12 * psi / 16));
    CHECK(mb.total() < prev_total);
    CHECK(mb.host == 0);
    prev_states = mb.model_states();
    prev_total = mb.total();
  }
}

TEST_CASE("offload moves the optimizer to the host", "[memory]") {
  const ModelSpec m = gpt(24, 2048, 16);
  const double psi = parameter_count(m);
  for (int stage : {1, 2, 3}) {
    INFO("stage " << stage);
    Scenario sc = scenario(m, 8, 1, 1, stage);
    const MemoryBreakdown on_gpu = peak_memory(sc);
    sc.zero.offload_optimizer = true;
    const MemoryBreakdown off = peak_memory(sc);
    CHECK(off.optimizer == 0);
    CHECK(off.host == Approx(16 * psi / 8));  // fp32 params + m + v + fp32 grads of the shard
    CHECK(off.total() < on_gpu.total());
    CHECK(off.params == Approx(on_gpu.params));
    if (stage == 3) {
      sc.zero.offload_param = true;
      const MemoryBreakdown both = peak_memory(sc);
      CHECK(both.host == Approx(18 * psi / 8));
      CHECK(both.params == Approx(both.params_gathered));
    }
  }
}

TEST_CASE("flash attention keeps no s x s scores: only the row log-sum-exp", "[memory]") {
  ModelSpec m = gpt(96, 12288, 96);
  const double s = 2048, b = 2, h = 12288, a = 96;
  for (int tp : {1, 8}) {
    const double unfused = activation_bytes_per_layer(m, 2, tp, false, Recompute::none, false);
    m.flash_attention = true;
    const double flash = activation_bytes_per_layer(m, 2, tp, false, Recompute::none, false);
    m.flash_attention = false;
    // flash = selective-recompute form (no 5as/h term) + fp32 log-sum-exp per (row, head), and the
    // LayerNorm statistics (16 bytes per token)
    CHECK(flash == Approx(activation_bytes_per_layer(s, b, h, a, tp, false, Recompute::selective) + 4 * a * s * b / tp +
                          16 * s * b));
    CHECK(unfused - flash == Approx(5 * a * s / (h * tp) * s * b * h - 4 * a * s * b / tp));
  }
}

TEST_CASE("activations: per layer x layers of the stage x in-flight micro-batches", "[memory]") {
  const ModelSpec m = gpt(32, 4096, 32);
  Scenario sc = scenario(m, 2, 4, 4, 1);
  sc.parallel.sequence_parallel = true;
  const double s = 2048, b = 1, h = 4096, a = 32;
  const double ln_stats = 16 * s * b / 4;  // LayerNorm mean and 1/std in fp32, split by SP
  const double per_layer = activation_bytes_per_layer(s, b, h, a, 4, true, Recompute::none) + ln_stats;
  // Middle stages carry no embedding / head extras: exactly 8 layers x (4 - stage) micro-batches.
  CHECK(stage_memory(sc, 1).activations == Approx(per_layer * 8 * 3));
  CHECK(stage_memory(sc, 2).activations == Approx(per_layer * 8 * 2));
  // Stage 0 adds the embedding dropout mask (s b h / t bytes) per in-flight micro-batch.
  CHECK(stage_memory(sc, 0).activations == Approx((per_layer * 8 + s * b * h / 4) * 4));
  // Last stage: one micro-batch, plus the final LayerNorm and output-layer inputs (4 s b h / t).
  CHECK(stage_memory(sc, 3).activations == Approx(per_layer * 8 + 4 * s * b * h / 4));
  // ... and the fp32 logits for the loss as its temporary.
  CHECK(stage_memory(sc, 3).temporaries >= 4 * b * s * 51200 / 4);
  CHECK(peak_memory(sc).total() == Approx(stage_memory(sc, 0).total()));

  sc.recompute = Recompute::selective;
  const double sel = activation_bytes_per_layer(s, b, h, a, 4, true, Recompute::selective) + ln_stats;
  CHECK(stage_memory(sc, 1).activations == Approx(sel * 8 * 3));
  sc.recompute = Recompute::full;
  CHECK(stage_memory(sc, 1).activations == Approx(2 * s * b * h / 4 * 8 * 3));
  // the layer being recomputed materialises its full activations once
  CHECK(stage_memory(sc, 1).temporaries >= per_layer - 2 * s * b * h / 4);

  sc.recompute = Recompute::none;
  sc.parallel.interleave = 2;  // 4 stages x 2 chunks, 4 layers each
  CHECK(stage_memory(sc, 1).activations == Approx(per_layer * 8 * (2.0 * 2 + 4 + 1) / 2));
}

TEST_CASE("tensor and pipeline parallel split the parameters", "[memory]") {
  const ModelSpec m = gpt(32, 4096, 32);
  const double psi = parameter_count(m);
  Scenario sc = scenario(m, 1, 4, 4, 0);
  double sum = 0;
  for (int st = 0; st < 4; ++st) sum += stage_memory(sc, st).params / 2;
  // Every stage holds ~1/(tp pp) of the model; the tied embedding copy on the last stage adds V h / t.
  CHECK(sum == Approx((psi + 51200.0 * 4096) / 4).epsilon(0.01));
  CHECK(stage_memory(sc, 1).params == Approx(2 * 8 * dense_layer_params(m) / 4));
  CHECK(stage_memory(sc, 1).comm_buffers > 0);  // p2p buffers

  StageLayers l0 = stage_layers(sc, 0), l3 = stage_layers(sc, 3);
  CHECK(l0.first == 0);
  CHECK(l0.count() == 8);
  CHECK(l3.last == 32);
  sc.parallel.partition = {6, 10, 10, 6};
  CHECK(stage_layers(sc, 1).first == 6);
  CHECK(stage_layers(sc, 1).count() == 10);
  CHECK(stage_memory(sc, 1).params == Approx(2 * 10 * dense_layer_params(m) / 4));
}

TEST_CASE("MoE: expert params over ep, expert states over dp / ep", "[memory]") {
  ModelSpec m = gpt(12, 1024, 16);
  m.experts = 16;
  m.moe_every = 2;
  Scenario sc = scenario(m, 16, 1, 1, 1);
  sc.parallel.ep = 8;
  const double h = 1024;
  const double expert = expert_mlp_params(m);
  const double dense_part = parameter_count(m) - 6 * 16 * expert;  // all but the experts
  const double local = dense_part + 6 * 2 * expert;               // 16 / 8 experts per MoE layer
  const MemoryBreakdown mb = peak_memory(sc);
  CHECK(mb.params == Approx(2 * local));
  // stage 1: optimizer states of dense params over dp = 16, of experts over dp / ep = 2
  CHECK(mb.optimizer == Approx(12 * (dense_part / 16 + 6 * 2 * expert / 2)));
  CHECK(h > 0);
  // tp 2: the experts are not TP-split and the TP peers join the expert-data-parallel group
  // (core/grid.hpp): expert states over tp dp / ep = 4 ranks, dense ones over dp.
  Scenario t = scenario(m, 16, 2, 1, 1);
  t.parallel.ep = 8;
  REQUIRE(t.parallel.tp == 2);
  const double dense_tp = stage_parameters(t, 0).dense;
  CHECK(stage_parameters(t, 0).expert == Approx(6 * 2 * expert));
  CHECK(peak_memory(t).optimizer == Approx(12 * (dense_tp / 16 + 6 * 2 * expert / 4)));
}

// What an MoE layer keeps beyond a dense one (the torch engine's moe.cpp, index-based dispatch and
// combine): the experts' inputs on the routed slots (2h + 4 ffn each) for the dense MLP's 4 ffn per
// token; the fp32 gate probabilities (4 E per token); the gate's fp32 input (4h per token) for the
// 16-bit MLP input (2h, which the dispatch does not keep: it keeps only indices); the combine's top_k
// gathered expert rows (2h each).
TEST_CASE("MoE layer activations: routed expert inputs, the gate's fp32 input and probabilities, the combine's rows", "[memory]") {
  ModelSpec m = gpt(12, 1024, 16);
  m.experts = 8;
  m.top_k = 2;
  m.capacity_factor = 1.25;
  const double s = m.seq_len, b = 4, h = 1024, f = 4 * h, E = 8, k = 2;
  const double sbh = s * b * h;
  for (Dtype d : {Dtype::bf16, Dtype::fp32}) {
    const double sc = d == Dtype::fp32 ? 2 : 1;
    const double routed = moe_routed_slots(m, s * b);
    REQUIRE(routed > 0);
    const double moe = activation_bytes_per_layer(m, 4, 1, false, Recompute::none, true, d);
    const double dense = activation_bytes_per_layer(m, 4, 1, false, Recompute::none, false, d);
    INFO("dtype " << to_string(d));
    CHECK(moe - dense == Approx(routed * (2 * h + 4 * f) * sc - 4 * sc * s * b * f + 4 * s * b * E +
                                (4 - 2 * sc) * sbh + 2 * sc * k * sbh));
  }
  // bf16 at the measured record's shape (GPT 350M, s 2048, b 8, 8 experts, top-2, capacity 1.25):
  // 100.7 MB more a layer than the experts alone, 6 bytes x s b h (10 while the dispatch kept its
  // gathered rows).
  ModelSpec r = gpt(24, 1024, 16);
  r.seq_len = 2048;
  r.experts = 8;
  r.top_k = 2;
  r.capacity_factor = 1.25;
  const double with = activation_bytes_per_layer(r, 8, 1, false, Recompute::none, true);
  const double experts_only = moe_routed_slots(r, 2048 * 8) * (2 * 1024 + 4 * 4096) + 4.0 * 2048 * 8 * 8;
  const double dense = activation_bytes_per_layer(r, 8, 1, false, Recompute::none, false);
  CHECK(with - (dense - 4.0 * 2048 * 8 * 4096) - experts_only == Approx(6.0 * 2048 * 8 * 1024));
}

TEST_CASE("fp32 training: 4-byte params and grads, 8-byte Adam moments", "[memory]") {
  const ModelSpec m = gpt(12, 1024, 16);
  const double psi = parameter_count(m);
  Scenario sc = scenario(m, 4, 1, 1, 0);
  sc.precision.dtype = Dtype::fp32;
  const MemoryBreakdown mb = peak_memory(sc);
  CHECK(mb.params == Approx(4 * psi));
  CHECK(mb.grads == Approx(4 * psi));
  CHECK(mb.optimizer == Approx(8 * psi));
  CHECK(mb.model_states() == Approx(zero_model_state_bytes(psi, 0, 4, 8) + 4 * psi));
  sc.zero.stage = 2;
  CHECK(peak_memory(sc).optimizer == Approx(8 * psi / 4));
  // mixed precision activations are half the fp32 ones (masks aside)
  Scenario half = scenario(m, 4, 1, 1, 0);
  CHECK(peak_memory(half).activations < peak_memory(sc).activations);
}

TEST_CASE("comm buffers: reduce bucket double-buffered with overlap_comm", "[memory]") {
  const ModelSpec m = gpt(24, 2048, 16);
  Scenario sc = scenario(m, 8, 1, 1, 2);
  sc.zero.reduce_bucket_size = 50000000;
  sc.zero.allgather_bucket_size = 20000000;
  sc.zero.overlap_comm = true;
  CHECK(peak_memory(sc).comm_buffers == Approx(2 * 2 * 50e6 + 2 * 20e6));
  sc.zero.overlap_comm = false;
  CHECK(peak_memory(sc).comm_buffers == Approx(2 * 50e6 + 2 * 20e6));
}

TEST_CASE("stage_parameters add up to the model", "[memory]") {
  ModelSpec m = gpt(12, 1024, 16);
  Scenario sc = scenario(m, 4, 1, 1, 0);
  CHECK(stage_parameters(sc, 0).total() == Approx(parameter_count(m)));
  m.experts = 8;
  m.moe_every = 2;
  sc = scenario(m, 4, 1, 1, 0);
  CHECK(stage_parameters(sc, 0).total() == Approx(parameter_count(m)));
  sc.parallel.ep = 4;
  const StageParameters p = stage_parameters(sc, 0);
  CHECK(p.expert == Approx(6 * 2 * expert_mlp_params(m)));
  CHECK(p.dense + 4 * p.expert == Approx(parameter_count(m)));
  CHECK(p.largest_module == Approx(51200.0 * 1024));  // the word embedding
  // untied embeddings: the output layer is a second V x h matrix
  m.tied_embeddings = false;
  sc.model = m;
  CHECK(stage_parameters(sc, 0).dense == Approx(p.dense + 51200.0 * 1024));
}

TEST_CASE("1-bit Adam keeps fp32 error-feedback buffers", "[memory]") {
  const ModelSpec m = gpt(12, 1024, 16);
  const double psi = parameter_count(m);
  Scenario sc = scenario(m, 8, 1, 1, 0);
  const double adam = peak_memory(sc).optimizer;
  sc.optimizer.kind = OptimizerKind::onebit_adam;
  CHECK(peak_memory(sc).optimizer - adam == Approx(4 * psi + 4 * psi / 8));
}

TEST_CASE("1-bit Adam's compressed step holds two fp32 temporaries one piece long", "[memory]") {
  // Activations and logits small enough (2 layers, s 128, V 8192) that the step's 8 bytes an
  // element of a piece (kOnebitStepChunkElements, the engine's onebit_adam.cpp) set the transient;
  // the model's 20 M parameters span several pieces.
  ModelSpec m = gpt(2, 768, 8);
  m.seq_len = 128;
  m.vocab = 8192;
  REQUIRE(parameter_count(m) > 4.0 * kOnebitStepChunkElements);
  Scenario sc = scenario(m, 1);
  sc.precision.dtype = Dtype::bf16;
  const MemoryBreakdown adam = peak_memory(sc);
  sc.optimizer.kind = OptimizerKind::onebit_adam;
  const MemoryBreakdown ob = peak_memory(sc);
  const double step = 8.0 * kOnebitStepChunkElements;
  REQUIRE(step - ob.activations > adam.temporaries);  // the step's transient is the larger here
  CHECK(ob.temporaries == Approx(step - ob.activations));
  CHECK(ob.activations + ob.temporaries == Approx(step));
  // Before compression (freeze_step not reached) dssim runs AdamW: the model prices the compressed phase.
  sc.optimizer.kind = OptimizerKind::adamw;
  CHECK(peak_memory(sc).temporaries == Approx(adam.temporaries));
}

TEST_CASE("fp32 training with optimizer offload: 16 bytes per shard element on the host", "[memory]") {
  const ModelSpec m = gpt(12, 1024, 16);
  const double psi = parameter_count(m);
  Scenario sc = scenario(m, 4, 1, 1, 2);
  sc.precision.dtype = Dtype::fp32;
  sc.zero.offload_optimizer = true;
  const MemoryBreakdown mb = peak_memory(sc);
  CHECK(mb.host == Approx(16 * psi / 4));
  CHECK(mb.optimizer == 0);
  CHECK(mb.grads == 0);
  CHECK(mb.params == Approx(4 * psi));
}

TEST_CASE("one rank: no ZeRO buffers, ZeRO-3 in place - the loss's fp32 transient", "[memory]") {
  ModelSpec m = gpt(24, 2048, 16);
  m.dropout = 0;
  const double psi = parameter_count(m);
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    Scenario one = scenario(m, 1, 1, 1, stage), two = scenario(m, 2, 1, 1, stage);
    one.training.micro_batch = two.training.micro_batch = 8;
    const MemoryBreakdown a = peak_memory(one), b = peak_memory(two);
    CHECK(a.comm_buffers == 0);    // nothing to reduce or gather on one rank
    CHECK(b.comm_buffers > 0);     // DeepSpeed's buckets
    if (stage == 3) {
      CHECK(a.params == Approx(2 * psi));  // the whole model is the shard, used in place
      CHECK(a.params_gathered == 0);
      CHECK(b.params_gathered > 0);
    }
    // PyTorch's cross-entropy on fp32 logits holds log-softmax, its gradient and the input
    // gradient at once: 3 x 4 b s V. On one rank ZeRO-3's backward writes into the partition
    // (core/memory.hpp zero3_backward_into_partition), so nothing more; on two ranks it adds the
    // 16-bit gradients of the groups in backward.
    const double ce = 12.0 * 8 * 2048 * 51200;
    CHECK(a.temporaries == Approx(ce));
    if (stage == 3) CHECK(b.temporaries > ce);
  }
}

TEST_CASE("fused linear cross-entropy: one chunk's logits and the head's gradients instead of 3 x 4 b s V", "[memory]") {
  ModelSpec m = gpt(24, 2048, 16);
  m.dropout = 0;
  m.cross_entropy = ModelSpec::CrossEntropy::fused_linear;
  Scenario one = scenario(m, 1, 1, 1, 1);
  one.training.micro_batch = 8;
  const double T = 8 * 2048.0, V = 51200, h = 2048;
  const double chunk = 4096;  // 16384 tokens x 51200 x 4 B = 3.1 GiB of fp32 -> 4 chunks
  // fp16: the chunk's 16-bit logits, fp32 probabilities and 16-bit gradient, and the head input's
  // and weight's 16-bit gradients kept from the forward.
  CHECK(peak_memory(one).temporaries == Approx((4 + 2 * 2) * chunk * V + 2 * (T * h + V * h)));
  m.cross_entropy = ModelSpec::CrossEntropy::unfused;
  Scenario plain = scenario(m, 1, 1, 1, 1);
  plain.training.micro_batch = 8;
  CHECK(peak_memory(plain).temporaries == Approx(12.0 * T * V));
  CHECK(peak_memory(one).total() < peak_memory(plain).total() - 8.0 * T * V);
}

TEST_CASE("model.cross_entropy_kernel: the fused linear chunk holds its 16-bit logits and gradient only", "[memory]") {
  ModelSpec m = gpt(24, 2048, 16);
  m.dropout = 0;
  m.cross_entropy = ModelSpec::CrossEntropy::fused_linear;
  m.cross_entropy_kernel = true;
  Scenario one = scenario(m, 1, 1, 1, 1);
  one.training.micro_batch = 8;
  const double T = 8 * 2048.0, V = 51200, h = 2048, chunk = 4096;
  // 2 bytes of logits and 2 of gradient per logit (fp16 here), a float loss per row, and the
  // head's gradients kept from the forward, as without the kernel.
  CHECK(peak_memory(one).temporaries == Approx(2 * 2 * chunk * V + 4 * chunk + 2 * (T * h + V * h)));
  Scenario bf = one;
  bf.precision.dtype = Dtype::bf16;
  CHECK(peak_memory(bf).temporaries == Approx(2 * 2 * chunk * V + 4 * chunk + 2 * (T * h + V * h)));
  bf.model.cross_entropy_kernel = false;  // ATen's ops: bf16 cast to fp32, fp32 probabilities, 16-bit gradient
  CHECK(peak_memory(bf).temporaries == Approx((8 + 2) * chunk * V + 2 * (T * h + V * h)));
}

TEST_CASE("fused cross-entropy on 16-bit logits: the logits and their gradient, 2 x e b s V, on the last stage", "[memory]") {
  ModelSpec m = gpt(24, 2048, 16);
  m.dropout = 0;
  m.cross_entropy = ModelSpec::CrossEntropy::fused;
  Scenario one = scenario(m, 1, 1, 1, 1);
  one.training.micro_batch = 8;
  const double T = 8 * 2048.0, V = 51200;
  // fp16 (this helper's dtype): 2 bytes per logit saved, 2 per logit of gradient.
  CHECK(peak_memory(one).temporaries == Approx(2 * 2 * T * V));
  m.cross_entropy = ModelSpec::CrossEntropy::unfused;
  Scenario plain = scenario(m, 1, 1, 1, 1);
  plain.training.micro_batch = 8;
  CHECK(peak_memory(plain).total() - peak_memory(one).total() == Approx((12.0 - 4.0) * T * V));
  // TP splits the vocabulary: the last stage's rank holds V / t of each row.
  m.cross_entropy = ModelSpec::CrossEntropy::fused;
  Scenario tp = scenario(m, 1, 2, 1, 1);  // dp 1, tp 2
  tp.training.micro_batch = 8;
  CHECK(peak_memory(tp).temporaries == Approx(2 * 2 * T * V / 2));
}

TEST_CASE("ZeRO++ hpZ: each rank also keeps a 1/hpz secondary shard of the 16-bit parameters", "[memory][zeropp]") {
  Scenario sc = scenario(gpt(36, 4096, 32), 64, 1, 1, 3);
  const MemoryBreakdown base = peak_memory(sc);
  const double dense = stage_parameters(sc, 0).dense;
  sc.zero.hpz_partition_size = 8;  // one DGX node
  const MemoryBreakdown h = peak_memory(sc);
  CHECK(h.params - base.params == Approx(2.0 * dense / 8));  // fp16 secondary shard
  CHECK(h.model_states() - base.model_states() == Approx(2.0 * dense / 8));
  CHECK(h.params_gathered == Approx(base.params_gathered));
  // qwZ / qgZ change traffic only
  sc.zero.quantized_weights = sc.zero.quantized_gradients = true;
  CHECK(peak_memory(sc).total() == Approx(h.total()));
  // hpZ over the whole DP group (or below stage 3) keeps nothing more
  sc.zero.hpz_partition_size = 64;
  CHECK(peak_memory(sc).params == Approx(base.params));
  sc.zero.hpz_partition_size = 8;
  sc.zero.stage = 2;
  Scenario z2 = scenario(gpt(36, 4096, 32), 64, 1, 1, 2);
  CHECK(peak_memory(sc).params == Approx(peak_memory(z2).params));
}

// Issue 15: the engine's step reads the reduced 16-bit gradient buckets in place at stages 0/1
// (core/memory.hpp steps_gradient_buckets_in_place); an fp32 gradient buffer stays where the
// engine still keeps one: stage 3 with zero.grad_accum_dtype: fp32, 1-bit Adam, MoE, DeepSpeed's
// BF16_Optimizer.
TEST_CASE("gradients: no fp32 accumulator at stages 0-2 where the step reads the 16-bit buckets in place", "[memory]") {
  const ModelSpec m = gpt(24, 2048, 16);
  const double psi = parameter_count(m);
  for (int ga : {1, 4}) {
    for (int stage = 0; stage <= 3; ++stage) {
      INFO("grad_accum " << ga << " stage " << stage);
      Scenario sc = scenario(m, 1, 1, 1, stage);
      sc.precision.dtype = Dtype::bf16;
      sc.training.micro_batch = 8;
      sc.training.grad_accum = ga;
      sc.training.global_batch = 8LL * ga;
      const MemoryBreakdown mb = peak_memory(sc);
      CHECK(steps_gradient_buckets_in_place(sc) == (stage <= 1));
      // One rank: 2 bytes of 16-bit gradients per parameter (stage 2's and stage 3's partition is
      // the whole model); stage 3 with an fp32 partition 4 bytes, that buffer alone.
      CHECK(mb.grads == Approx(2 * psi));
      CHECK(mb.optimizer == Approx(12 * psi));
      sc.zero.grad_accum_fp32 = true;
      CHECK(peak_memory(sc).grads == Approx(stage < 3 ? 2 * psi : 4 * psi));
    }
  }
  // 16 ranks, ZeRO-1 bf16: the 16-bit gradients whole, nothing else.
  Scenario z1 = scenario(m, 16, 1, 1, 1);
  z1.precision.dtype = Dtype::bf16;
  CHECK(peak_memory(z1).grads == Approx(2 * psi));
  // Where the engine keeps the fp32 buffer at stage 1: 1-bit Adam (ZeRO-0 only, here) and MoE.
  Scenario ob = scenario(m, 4, 1, 1, 0);
  ob.precision.dtype = Dtype::bf16;
  ob.optimizer.kind = OptimizerKind::onebit_adam;
  CHECK_FALSE(steps_gradient_buckets_in_place(ob));
  CHECK(peak_memory(ob).grads == Approx(2 * psi + 4 * psi));  // 16-bit + BF16_Optimizer-style fp32, whole
  Scenario moe = z1;
  moe.model.experts = 8;
  moe.model.moe_every = 2;
  CHECK_FALSE(steps_gradient_buckets_in_place(moe));
  const double moe_psi = parameter_count(moe.model);
  CHECK(peak_memory(moe).grads == Approx(2 * moe_psi + 4 * moe_psi).epsilon(1e-9));
  // Offloaded: the host keeps the fp32 gradients; on the device, the 16-bit ones only.
  Scenario off = z1;
  off.zero.offload_optimizer = true;
  CHECK_FALSE(steps_gradient_buckets_in_place(off));
  CHECK(peak_memory(off).grads == Approx(2 * psi));
}
