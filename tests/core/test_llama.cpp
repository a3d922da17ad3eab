// Llama-shaped models (issue 11): GQA (model.kv_heads), SwiGLU (model.mlp), RMSNorm (model.norm),
// rotary positions (model.position), no biases (model.bias), untied LM head; the Llama 3, Mixtral
// and GPT-3 presets against their published parameter counts; FLOPs, op list, memory and the
// Program's ZeRO partition against hand-derived closed forms.
#include <catch2/catch.hpp>

#include <cmath>
#include <set>
#include <stdexcept>

#include "core/memory.hpp"
#include "core/model.hpp"
#include "core/program_builder.hpp"
#include "core/estimator.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "core/validate.hpp"
#include "tests/core/program_test_util.hpp"
#include "tests/core/scenario_test_util.hpp"

using namespace dssim;
using Catch::Detail::Approx;
using Catch::Matchers::Contains;

namespace {

// A model preset's ModelSpec, through the loader (so the YAML keys are what is tested).
ModelSpec preset(const std::string& name) {
  return load_scenario_from_string("model: " + name + "\ntraining: {micro_batch: 1}\ncluster: {preset: dgx-h100-ndr}\n")
      .model;
}

const LayerOp* find_op(const std::vector<LayerOp>& ops, const std::string& name) {
  for (const auto& op : ops)
    if (op.name == name) return &op;
  return nullptr;
}

// The Llama 3 8B shape by hand.
ModelSpec llama8b() {
  ModelSpec m;
  m.name = "llama";
  m.layers = 32;
  m.hidden = 4096;
  m.heads = 32;
  m.kv_heads = 8;
  m.ffn_hidden = 14336;
  m.vocab = 128256;
  m.seq_len = 8192;
  m.swiglu = m.rmsnorm = m.rotary = true;
  m.bias = false;
  m.tied_embeddings = false;
  return m;
}

}  // namespace

TEST_CASE("Llama 3 presets: parameter counts against the published totals", "[model][llama]") {
  // Llama Team 2024 (arXiv:2407.21783) Table 3 shapes; totals from the released weights (model
  // cards): 8.03B, 70.6B, 405.9B. Each must round to the published digit.
  struct Row { const char* preset; double billions; };
  for (const Row& r : {Row{"llama3-8b", 8.03}, Row{"llama3-70b", 70.6}, Row{"llama3-405b", 405.9}}) {
    INFO(r.preset);
    const ModelSpec m = preset(r.preset);
    CHECK(m.swiglu);
    CHECK(m.rmsnorm);
    CHECK(m.rotary);
    CHECK_FALSE(m.bias);
    CHECK_FALSE(m.tied_embeddings);
    CHECK(m.kv_heads == 8);
    CHECK(m.vocab == 128256);
    CHECK(m.seq_len == 8192);
    const double p = parameter_count(m) / 1e9;
    const double half_digit = r.billions < 10 ? 0.005 : 0.05;
    CHECK(std::abs(p - r.billions) <= half_digit);
  }
  // Closed form, 8B: per layer q, o h^2, k, v h kv (kv = 8 x 128), SwiGLU 3 h f, two RMSNorms h;
  // word embedding and LM head V h each; final RMSNorm h. = 8,030,261,248.
  const double h = 4096, kv = 1024, f = 14336, V = 128256, l = 32;
  const double closed = l * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * V * h + h;
  CHECK(parameter_count(preset("llama3-8b")) == closed);
  CHECK(closed == 8030261248.0);
  CHECK(parameter_count(preset("llama3-70b")) == 70553706496.0);
  CHECK(parameter_count(preset("llama3-405b")) == 405853388800.0);
}

TEST_CASE("Mixtral 8x7B preset: 46.7B total, 12.9B active", "[model][llama][moe]") {
  const ModelSpec m = preset("mixtral-8x7b");
  CHECK(m.experts == 8);
  CHECK(m.top_k == 2);
  CHECK(m.moe_layers() == 32);
  // Per layer: attention 2h^2 + 2 h kv, 8 SwiGLU experts of 3 h f, the router h x 8, 2 RMSNorms.
  const double h = 4096, kv = 1024, f = 14336, V = 32000, l = 32;
  const double total = l * (2 * h * h + 2 * h * kv + 8 * 3 * h * f + 8 * h + 2 * h) + 2 * V * h + h;
  CHECK(parameter_count(m) == total);
  CHECK(active_parameter_count(m) == total - l * 6 * 3 * h * f);
  CHECK(std::abs(parameter_count(m) / 1e9 - 46.7) <= 0.05);
  CHECK(std::abs(active_parameter_count(m) / 1e9 - 12.9) <= 0.05);
  CHECK(active_parameter_count(preset("llama3-8b")) == parameter_count(preset("llama3-8b")));
}

TEST_CASE("GPT-3 family presets against Table 2.1", "[model][llama]") {
  // Brown et al. 2020 Table 2.1 names the sizes to two significant digits (Medium is 355.8M, 2.7B
  // is 2.65B by its own shapes, with the 50257-token vocabulary); the presets pad the vocabulary to
  // 51200 as Megatron does, so count with the paper's 50257 and allow 2%.
  struct Row { const char* preset; double millions; };
  for (const Row& r : {Row{"gpt3-125m", 125}, Row{"gpt-350m", 350}, Row{"gpt3-760m", 760}, Row{"gpt-1.3b", 1300},
                       Row{"gpt3-2.7b", 2700}, Row{"gpt-7b", 6700}, Row{"gpt-13b", 13000}, Row{"gpt3-175b", 175000}}) {
    INFO(r.preset);
    ModelSpec m = preset(r.preset);
    CHECK_FALSE(m.swiglu);
    CHECK(m.kv_heads_or_heads() == m.heads);
    CHECK(m.seq_len == 2048);
    CHECK(m.vocab == 51200);
    m.vocab = 50257;
    CHECK(parameter_count(m) / 1e6 == Approx(r.millions).epsilon(0.02));
  }
  // Table 2.1 shapes of the added presets.
  CHECK(preset("gpt3-125m").hidden == 768);
  CHECK(preset("gpt3-760m").hidden == 1536);
  CHECK(preset("gpt3-760m").heads == 16);
  CHECK(preset("gpt3-2.7b").hidden == 2560);
  CHECK(preset("gpt3-2.7b").layers == 32);
}

TEST_CASE("GPT defaults: the Llama keys leave Megatron eq. 2 unchanged", "[model][llama]") {
  ModelSpec m = preset("gpt3-175b");
  CHECK(m.bias);
  CHECK_FALSE(m.rmsnorm);
  CHECK_FALSE(m.rotary);
  const double h = 12288;
  CHECK(dense_layer_params(m) == 12 * h * h + 13 * h);
  CHECK(attention_params(m) == 4 * h * h + 4 * h);
  CHECK(embedding_params(m) == (51200.0 + 2048) * h);
  // kv_heads = heads is the same model
  ModelSpec k = m;
  k.kv_heads = 96;
  CHECK(parameter_count(k) == parameter_count(m));
  // Each key alone, by its term.
  ModelSpec r = m;
  r.rmsnorm = true;
  CHECK(parameter_count(m) - parameter_count(r) == (2 * 96 + 1) * h);  // one bias vector per norm
  ModelSpec p = m;
  p.rotary = true;
  CHECK(parameter_count(m) - parameter_count(p) == 2048 * h);  // no position table
  ModelSpec b = m;
  b.bias = false;
  CHECK(parameter_count(m) - parameter_count(b) == 96 * (3 * h + h + 4 * h + h));  // qkv, o, up, down
  ModelSpec g = m;
  g.kv_heads = 8;  // 8 groups of 12 heads: k, v 8 x 128 = 1024 wide
  CHECK(parameter_count(m) - parameter_count(g) == 96 * 2 * (h * h + h - (h * 1024 + 1024)));
}

TEST_CASE("SwiGLU / GQA layer FLOPs: hand-derived closed form", "[model][llama]") {
  const ModelSpec m = llama8b();
  const double s = 8192, h = 4096, kv = 1024, f = 14336, V = 128256, l = 32;
  // Forward per sequence: q and o 2 s h^2 each, k and v 2 s h kv each, q k^T and attention over v
  // 2 s^2 h each (every query head, whatever kv_heads), gate, up, down 2 s h f each.
  const double layer = 2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * h + 3 * 2 * s * h * f;
  CHECK(layer_forward_flops_per_sequence(m, false) == Approx(layer).epsilon(1e-12));
  CHECK(head_forward_flops_per_sequence(m) == 2 * s * h * V);
  const double B = 512;
  CHECK(model_flops_per_iteration(m, B) == Approx(3 * B * (l * layer + 2 * s * h * V)).epsilon(1e-12));
  CHECK(hardware_flops_per_iteration(m, B, Recompute::full) ==
        Approx(B * (4 * l * layer + 3 * 2 * s * h * V)).epsilon(1e-12));
  CHECK(hardware_flops_per_iteration(m, B, Recompute::selective) - model_flops_per_iteration(m, B) ==
        Approx(B * l * 4 * s * s * h).epsilon(1e-9));
  // The op list's GEMMs add up to the same FLOPs, per GPU after a tp = 8 split, for b = 2.
  LayerShape shape;
  shape.micro_batch = 2;
  shape.tp = 8;
  const auto ops = layer_forward_ops(m, shape);
  const OpsCost c = sum_cost(ops);
  CHECK(c.gemm_flops == Approx(2 * layer / 8).epsilon(1e-12));
  const double t = 8, T = 2 * s;
  const LayerOp* qkv = find_op(ops, "qkv");
  REQUIRE(qkv);
  CHECK(qkv->n == (h + 2 * kv) / t);  // 768: 4 query heads, 1 key and 1 value head per rank
  CHECK(qkv->flops == 2 * T * h * (h + 2 * kv) / t);
  const LayerOp* scores = find_op(ops, "attention_scores");
  REQUIRE(scores);
  CHECK(scores->batch == 2 * 32 / t);  // local query heads
  CHECK(scores->flops == Approx(2 * 2 * s * s * h / t));
  const LayerOp* gate = find_op(ops, "mlp_gate");
  const LayerOp* up = find_op(ops, "mlp_up");
  const LayerOp* down = find_op(ops, "mlp_down");
  REQUIRE(gate);
  REQUIRE(up);
  REQUIRE(down);
  CHECK(gate->n == f / t);
  CHECK(up->n == f / t);
  CHECK(down->k == f / t);
  // Elementwise: silu(gate) * up reads two, writes one; RMSNorm reads x and the gain, writes y;
  // rotary on q and k (h + kv wide) with the cos / sin tables.
  const LayerOp* swiglu = find_op(ops, "swiglu");
  REQUIRE(swiglu);
  CHECK(swiglu->memory_bytes == 3 * 2 * T * f / t);
  CHECK(swiglu->backward_memory_bytes() == 5 * 2 * T * f / t);
  CHECK_FALSE(find_op(ops, "gelu"));
  const LayerOp* norm = find_op(ops, "rmsnorm_1");
  REQUIRE(norm);
  CHECK(norm->memory_bytes == 2 * 2 * T * h + 2 * h);
  CHECK_FALSE(find_op(ops, "layernorm_1"));
  const LayerOp* rope = find_op(ops, "rotary");
  REQUIRE(rope);
  CHECK(rope->memory_bytes == 2 * 2 * T * (h + kv) / t + 2 * 2 * s * (h / 32));
  CHECK_FALSE(find_op(ops, "bias_grads"));  // no biases
  const LayerOp* acc = find_op(ops, "grad_accumulate");
  REQUIRE(acc);
  CHECK(acc->memory_bytes == 3 * 2 * dense_layer_params(m) / t);
  // Embedding without a position table; untied head with the RMSNorm gain.
  const auto emb = embedding_forward_ops(m, shape);
  CHECK(find_op(emb, "embedding_lookup")->memory_bytes == T * h * 2 * 2 + T * 8);
  CHECK(find_op(emb, "grad_accumulate")->memory_bytes == 3 * 2 * V / t * h);
  const auto head = head_forward_ops(m, shape);
  REQUIRE(find_op(head, "final_rmsnorm"));
  CHECK(find_op(head, "grad_accumulate")->memory_bytes == 3 * 2 * (V / t * h + h));
}

TEST_CASE("eager elementwise ops: torchtitan's RMSNorm, rotary, repeat_kv, SwiGLU kernel by kernel", "[model][llama]") {
  // model.elementwise: eager (core/model.cpp): bytes per element summed over the eager kernels,
  // bf16 activations (e = 2, casts to fp32 6 bytes each).
  ModelSpec m = llama8b();
  LayerShape shape;
  shape.micro_batch = 2;
  const double s = 8192, h = 4096, kv = 1024, f = 14336, T = 2 * s;
  const auto fused = layer_forward_ops(m, shape);
  m.eager_elementwise = true;
  const auto ops = layer_forward_ops(m, shape);
  // RMSNorm forward: float 6, pow 8, mean 4, mul 8, type_as 6, * weight 4 = 36, plus the gain;
  // backward 6e + 2 casts + 68 = 92.
  const LayerOp* norm = find_op(ops, "rmsnorm_1");
  REQUIRE(norm);
  CHECK(norm->memory_bytes == 36 * T * h + 2 * h);
  CHECK(norm->backward_memory_bytes() == 92 * T * h);
  CHECK(norm->kernel.empty());  // no fused layer_norm profile row for a chain of kernels
  // Rotary on q and k: float 6, complex multiply 8, type_as 6 = 20, the tables as before; backward alike.
  const LayerOp* rope = find_op(ops, "rotary");
  REQUIRE(rope);
  CHECK(rope->memory_bytes == 20 * T * (h + kv) + 2 * 2 * s * (h / 32));
  CHECK(rope->backward_memory_bytes() == rope->memory_bytes);
  // repeat_kv: k and v each read kv wide and written h wide; backward the group sums.
  const LayerOp* repeat = find_op(ops, "repeat_kv");
  REQUIRE(repeat);
  CHECK(repeat->memory_bytes == 2 * 2 * T * (kv + h));
  CHECK(repeat->backward_memory_bytes() == repeat->memory_bytes);
  CHECK_FALSE(find_op(fused, "repeat_kv"));
  // SwiGLU: silu 4 + mul 6 forward, backward two products and silu's backward, 18, per element.
  const LayerOp* swiglu = find_op(ops, "swiglu");
  REQUIRE(swiglu);
  CHECK(swiglu->memory_bytes == 10 * T * f);
  CHECK(swiglu->backward_memory_bytes() == 18 * T * f);
  // Nothing else changes: the GEMMs and the other ops are the fused list's.
  CHECK(ops.size() == fused.size() + 1);
  CHECK(sum_cost(ops).gemm_flops == sum_cost(fused).gemm_flops);
  // Multi-head attention has nothing to repeat; fp32 training has no casts (RMSNorm 20 + 8 forward).
  m.kv_heads = 0;
  shape.dtype = Dtype::fp32;
  const auto mha = layer_forward_ops(m, shape);
  CHECK_FALSE(find_op(mha, "repeat_kv"));
  CHECK(find_op(mha, "rmsnorm_1")->memory_bytes == 28 * T * h + 4 * h);
  CHECK(find_op(mha, "rmsnorm_1")->backward_memory_bytes() == 92 * T * h);  // 6 x 4 + 68
  CHECK(find_op(mha, "rotary")->memory_bytes == 8 * T * 2 * h + 2 * 4 * s * (h / 32));
  // The key, and its round trip.
  const Scenario sc = load_scenario_from_string(
      "model: {preset: llama3-8b, elementwise: eager}\ntraining: {micro_batch: 1}\ncluster: {preset: dgx-h100-ndr}\n");
  CHECK(sc.model.eager_elementwise);
  CHECK(load_scenario_from_string(to_yaml(sc), {}, "<roundtrip>").model.eager_elementwise);
  CHECK_THAT(test::config_error([] {
               load_scenario_from_string("model: {preset: tiny, elementwise: compiled}\ntraining: {micro_batch: 1}\n"
                                         "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n");
             }),
             Contains("model.elementwise") && Contains("eager"));
}

TEST_CASE("Mixtral MoE layer: SwiGLU experts batched over the local experts", "[model][llama][moe]") {
  const ModelSpec m = preset("mixtral-8x7b");
  LayerShape shape;
  shape.micro_batch = 1;
  shape.moe = true;
  shape.ep = 8;
  const auto ops = layer_forward_ops(m, shape);
  const double s = 32768, h = 4096, f = 14336;
  const double routed = s * 2 * 1.0;  // top-2, capacity factor 1, one local expert
  const LayerOp* gate = find_op(ops, "mlp_gate");
  REQUIRE(gate);
  CHECK(gate->batch == 1);
  CHECK(gate->m == routed);
  CHECK(find_op(ops, "swiglu")->memory_bytes == 3 * 2 * routed * f);
  // Model FLOPs count top_k experts; with capacity factor 1 hardware equals model.
  const double kv = 1024;
  const double layer = 2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * h + 2 * 3 * 2 * s * h * f + 2 * s * h * 8;
  CHECK(layer_forward_flops_per_sequence(m, true) == Approx(layer).epsilon(1e-12));
}

TEST_CASE("Llama 8B activations: Korthikanti adapted to GQA, SwiGLU, RMSNorm", "[memory][llama]") {
  const ModelSpec m = llama8b();
  const double s = 8192, b = 1, h = 4096, kv = 1024, f = 14336, a = 32;
  // replicated: both norm inputs, QKV and MLP inputs (8 s b h), fp32 1/rms per token per norm (8 s b);
  // TP-split: Q, projection input 2h each, K, V 2 kv each; gate, up, down inputs 2f each;
  // flash attention's fp32 log-sum-exp 4 a s b.
  const auto per_layer = [&](double t, bool sp) {
    const double d = sp ? t : 1;
    return 8 * s * b * h / d + 8 * s * b / d + (4 * s * b * (h + kv) + 6 * s * b * f) / t + 4 * a * s * b / t;
  };
  CHECK(activation_bytes_per_layer(m, 1, 1, false, Recompute::none, false) == per_layer(1, false));
  CHECK(activation_bytes_per_layer(m, 1, 8, true, Recompute::none, false) == Approx(per_layer(8, true)));
  CHECK(activation_bytes_per_layer(m, 1, 1, false, Recompute::full, false) == 2 * s * b * h);
  CHECK(per_layer(1, false) == Approx(1.142e9).epsilon(1e-3));  // 1.14 GB per layer at s = 8192

  // The shipped scenario: ZeRO-3 over 16 H100s, micro-batch 1, no recompute.
  const Scenario sc = load_scenario(test::shipped("llama3_8b_zero3.yaml"));
  REQUIRE(sc.parallel.dp == 16);
  const double psi = parameter_count(sc.model);
  CHECK(stage_parameters(sc, 0).total() == psi);
  const MemoryBreakdown mb = peak_memory(sc);
  // 32 layers of one in-flight micro-batch, plus the final norm and head inputs (4 s b h).
  CHECK(mb.activations == Approx(32 * per_layer(1, false) + 4 * s * b * h));
  // ZeRO-3: 2-byte parameter shard, 16-bit gradient partition (DeepSpeed's default) and 12-byte
  // Adam shards (16 psi / 16) besides the gathered working set.
  CHECK(mb.model_states() == Approx(16 * psi / 16));
  // The fp32 logits of the 128256-word vocabulary: 12 b s V in the loss's backward.
  CHECK(mb.temporaries >= 12.0 * s * 128256);
  CHECK(mb.total() > 50e9);
  CHECK(mb.total() < 80e9);  // fits an H100-80GB
}

TEST_CASE("stage_parameters of Llama shapes add up to the model", "[memory][llama]") {
  Scenario sc = load_scenario(test::shipped("llama3_8b_zero3.yaml"));
  sc.parallel.tp = 8;
  sc.parallel.pp = 4;
  sc.parallel.dp = 1;
  double sum = 0;
  for (int st = 0; st < 4; ++st) sum += stage_parameters(sc, st).total();
  // The TP split divides the whole layer by t (memory.cpp): x 8 recovers the model.
  CHECK(sum * 8 == Approx(parameter_count(sc.model)));
  CHECK(stage_parameters(sc, 0).largest_module == 128256.0 * 4096 / 8);
}

TEST_CASE("program: Llama-shaped ZeRO partitions hold exactly the parameter count", "[program][llama]") {
  // The Program tests' tiny GPT on 4 data-parallel ranks, Llama-shaped: GQA (2 kv heads), SwiGLU
  // (ffn 192), RMSNorm, rotary, no biases, untied embeddings.
  Scenario sc = program_test::tiny(1, 1, 4, 1);
  sc.name = sc.model.name = "tiny_llama";
  sc.model.kv_heads = 2;
  sc.model.ffn_hidden = 192;
  sc.model.swiglu = sc.model.rmsnorm = sc.model.rotary = true;
  sc.model.bias = false;
  sc.model.tied_embeddings = false;
  // 4 (2 h^2 + 2 h kv + 3 h f + 2 h) + 2 V h + h, kv = 2 x 16
  const double psi = parameter_count(sc.model);
  CHECK(psi == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 2 * 512 * 64 + 64);
  REQUIRE(std::fmod(psi, 8) == 0);  // no padding over 4 ranks
  // Wire bytes per rank of one purpose: ZeRO-1 / 2 reduce and gather (N-1)/N of the 16-bit buffer.
  auto wire = [](const Program& p, const RankProgram& rp, Purpose pu) {
    double total = 0;
    for (const Instruction& in : rp.instructions)
      if (in.purpose == pu && is_collective(in.op))
        total += in.repeat * wire_bytes_per_rank(in.op, in.bytes, int(p.groups[in.group].ranks.size()));
    return total;
  };
  for (int stage : {1, 2, 3}) {
    INFO("zero stage " << stage);
    sc.zero.stage = stage;
    const Program p = build_program(sc);
    for (const RankProgram& rp : p.ranks) {
      if (stage < 3) {
        const int steps = stage == 2 ? 4 : 1;  // ZeRO-2 reduce-scatters every micro-step
        CHECK(wire(p, rp, Purpose::GradientReduce) == Approx(steps * psi * 2 * 3 / 4));
        CHECK(wire(p, rp, Purpose::ParamGather) == Approx(psi * 2 * 3 / 4));
        for (const Instruction& in : rp.instructions)
          if (in.op == Op::OptimizerStep) CHECK(in.flops == Approx(psi / 4 * 16));
      } else {
        // ZeRO-3: 2 all-gathers and 1 reduce-scatter of the whole 16-bit model per micro-batch.
        double volume = 0;
        for (const Instruction& in : rp.instructions)
          if (in.op == Op::AllGather || in.op == Op::ReduceScatter) volume += in.bytes * in.repeat;
        CHECK(volume == Approx(3 * 4 * psi * 2));
      }
    }
  }
}

TEST_CASE("scenario keys: mlp, kv_heads, norm, position, bias", "[scenario][llama]") {
  using test::config_error;
  using test::tiny_yaml;
  const std::string llama_keys = "  mlp: swiglu\n  kv_heads: 2\n  norm: rmsnorm\n  position: rotary\n  bias: false\n";
  const Scenario s = load_scenario_from_string("model:\n  preset: tiny\n" + llama_keys +
                                               "training: {micro_batch: 1}\ncluster: {preset: single-node-pcie, gpus_per_node: 2}\n");
  CHECK(s.model.swiglu);
  CHECK(s.model.kv_heads == 2);
  CHECK(s.model.rmsnorm);
  CHECK(s.model.rotary);
  CHECK_FALSE(s.model.bias);
  const Scenario r = load_scenario_from_string(to_yaml(s), {}, "<roundtrip>");
  CHECK(to_yaml(r) == to_yaml(s));
  CHECK(parameter_count(r.model) == parameter_count(s.model));

  auto load = [](const std::string& model_extra, const std::string& parallel = "  tp: 1\n") {
    return config_error([&] {
      load_scenario_from_string("model:\n  preset: tiny\n" + model_extra +
                                "training: {micro_batch: 1}\nparallel:\n" + parallel +
                                "cluster: {preset: single-node-pcie, gpus_per_node: 4}\n");
    });
  };
  CHECK_THAT(load("  mlp: relu\n"), Contains("model.mlp") && Contains("swiglu"));
  CHECK_THAT(load("  norm: batchnorm\n"), Contains("model.norm") && Contains("rmsnorm"));
  CHECK_THAT(load("  position: alibi\n"), Contains("model.position") && Contains("rotary"));
  CHECK_THAT(load("  bias: maybe\n"), Contains("model.bias"));
  // tiny has 4 heads: kv_heads must divide them
  CHECK_THAT(load("  kv_heads: 3\n"), Contains("model.kv_heads (3)") && Contains("model.heads (4)") &&
                                          Contains("1, 2, 4"));
  CHECK_THAT(load("  kv_heads: 8\n"), Contains("model.kv_heads (8)"));
  CHECK_THAT(load("  kv_heads: 0\n"), Contains("model.kv_heads"));
  // Megatron splits kv heads over tp: 1 kv head (MQA) on tp 2 is refused, with the tps that work
  CHECK_THAT(load("  kv_heads: 1\n", "  tp: 2\n"),
             Contains("model.kv_heads (1)") && Contains("parallel.tp (2)") && Contains("use a tp that divides 1"));
  CHECK(load("  kv_heads: 2\n", "  tp: 2\n") == "<no error>");
}

TEST_CASE("the JSON report's config says the model's shape and the engines", "[llama][report]") {
  const Scenario s = load_scenario_from_string(
      "model: llama3-8b\ntraining: {global_batch: 16, micro_batch: 1}\nzero: {stage: 3, engine: fsdp}\n"
      "cluster: {preset: dgx-h100-ndr, nodes: 2}\n");
  const auto j = report_json(s, analytic_report(s, false));
  const auto& c = j["config"];
  CHECK(c["kv_heads"] == 8);
  CHECK(c["ffn_hidden"] == 14336);
  CHECK(c["mlp"] == "swiglu");
  CHECK(c["norm"] == "rmsnorm");
  CHECK(c["position"] == "rotary");
  CHECK(c["bias"] == false);
  CHECK(c["tied_embeddings"] == false);
  CHECK(c["zero_engine"] == "fsdp");
  CHECK(c["pipeline_engine"] == "megatron");
}
