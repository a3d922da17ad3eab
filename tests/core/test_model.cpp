// Model math against published numbers: Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473)
// eq. 2 / eq. 3 and Table 1; Korthikanti et al. 2022 (arXiv:2205.05198) for the op list.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "core/model.hpp"
#include "tests/core/gpt_spec.hpp"

using namespace dssim;
using Catch::Detail::Approx;

namespace {

using test::gpt_spec;
ModelSpec gpt(int layers, int hidden, int heads) { return gpt_spec(layers, hidden, heads); }

ModelSpec gpt3_175b() { return gpt(96, 12288, 96); }

const LayerOp& find_op(const std::vector<LayerOp>& ops, const std::string& name) {
  for (const auto& op : ops)
    if (op.name == name) return op;
  FAIL("no op named " << name);
  return ops.front();
}
bool has_op(const std::vector<LayerOp>& ops, const std::string& name) {
  for (const auto& op : ops)
    if (op.name == name) return true;
  return false;
}

}  // namespace

TEST_CASE("GPT-3 175B parameter count is 174.6B (Megatron eq. 2)", "[model]") {
  const ModelSpec m = gpt3_175b();
  const double p = parameter_count(m);
  // 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 174.597e9; we add the final LayerNorm (2h).
  CHECK(p == Approx(174.6e9).epsilon(0.0005));
  const double l = 96, h = 12288, V = 51200, s = 2048;
  const double eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
  CHECK(p - eq2 == Approx(2 * h));
  CHECK(dense_layer_params(m) == Approx(12 * h * h + 13 * h));
  CHECK(embedding_params(m) == Approx((V + s) * h));
}

TEST_CASE("Megatron Table 1 parameter counts", "[model]") {
  // Narayanan et al. 2021, Table 1 (V = 51200, s = 2048): published billions, layers, hidden.
  struct Row { double billions; int layers, hidden, heads; };
  const Row rows[] = {{1.7, 24, 2304, 24},     {3.6, 30, 3072, 32},    {7.5, 36, 4096, 32},
                      {18.4, 40, 6144, 48},    {39.1, 48, 8192, 64},   {76.1, 60, 10240, 80},
                      {145.6, 80, 12288, 96},  {310.1, 96, 16384, 128}, {529.6, 105, 20480, 128},
                      {1008, 128, 25600, 160}};
  for (const Row& r : rows) {
    INFO("published " << r.billions << "B, l=" << r.layers << " h=" << r.hidden);
    const double p = parameter_count(gpt(r.layers, r.hidden, r.heads)) / 1e9;
    // The table rounds to 0.1B (1B for the last row): eq. 2 must round to the published digit.
    const double half_digit = r.billions >= 1000 ? 0.5 : 0.05;
    CHECK(std::abs(p - r.billions) <= half_digit);
    // Within 0.5% wherever that rounding is finer than 0.5% (every row from 7.5B up; 1.7B and
    // 3.6B are published to 0.1B, i.e. 3% and 1.4%, and eq. 2 gives 1.652B and 3.562B).
    if (r.billions >= 7.5) CHECK(p == Approx(r.billions).epsilon(0.005));
  }
}

TEST_CASE("ffn_hidden != 4h generalises eq. 2", "[model]") {
  ModelSpec m = gpt(2, 1024, 16);
  m.ffn_hidden = 2816;
  const double h = 1024, f = 2816;
  CHECK(expert_mlp_params(m) == Approx(2 * h * f + f + h));
  CHECK(dense_layer_params(m) == Approx(4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h));
  CHECK(parameter_count(m) == Approx(2 * dense_layer_params(m) + (51200 + 2048) * h + 2 * h));
  ModelSpec d = gpt(2, 1024, 16);
  CHECK(ffn_hidden_of(d) == 4096);
  CHECK(dense_layer_params(d) == Approx(12 * h * h + 13 * h));
}

TEST_CASE("MoE parameters: extra experts and the gate per MoE layer", "[model]") {
  ModelSpec m = gpt(24, 2048, 16);
  const double dense = parameter_count(m);
  m.experts = 128;
  m.moe_every = 2;
  REQUIRE(m.moe_layers() == 12);
  const double h = 2048;
  const double expert = 2 * h * 4 * h + 4 * h + h;
  CHECK(parameter_count(m) - dense == Approx(12 * (127 * expert + h * 128)));
  int moe = 0;
  for (int i = 0; i < m.layers; ++i) moe += is_moe_layer(m, i);
  CHECK(moe == 12);
  CHECK_FALSE(is_moe_layer(m, 0));
  CHECK(is_moe_layer(m, 1));
}

TEST_CASE("FLOPs per iteration: Megatron model FLOPs and eq. 3", "[model]") {
  const ModelSpec m = gpt3_175b();
  const double B = 1536;
  // Hand-computed (python) from 72 B s l h^2 (1 + s/(6h) + V/(12 h l)) and
  // 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
  CHECK(model_flops_per_iteration(m, B) == Approx(3.3861967e18).epsilon(1e-6));
  CHECK(hardware_flops_per_iteration(m, B, Recompute::none) == Approx(3.3861967e18).epsilon(1e-6));
  CHECK(hardware_flops_per_iteration(m, B, Recompute::full) == Approx(4.5109708e18).epsilon(1e-6));
  // Selective adds one forward of the attention core: 4 s^2 h per layer per sequence.
  const double s = 2048, h = 12288, l = 96;
  CHECK(hardware_flops_per_iteration(m, B, Recompute::selective) -
            model_flops_per_iteration(m, B) ==
        Approx(B * l * 4 * s * s * h));
  // Megatron Table 1, 145.6B row (l=80, h=12288, a=96, B=2304): 72 B s l h^2 (...) by hand.
  const ModelSpec m145 = gpt(80, 12288, 96);
  CHECK(model_flops_per_iteration(m145, 2304) ==
        Approx(72.0 * 2304 * 2048 * 80 * h * h * (1 + 2048 / (6 * h) + 51200 / (12 * h * 80))));
}

TEST_CASE("layer forward ops: shapes, FLOPs and bytes after the TP split", "[model]") {
  const ModelSpec m = gpt3_175b();
  LayerShape shape;
  shape.micro_batch = 1;
  shape.tp = 8;
  const double b = 1, s = 2048, h = 12288, t = 8, f = 4 * h, e = 2;
  const auto ops = layer_forward_ops(m, shape);

  const LayerOp& qkv = find_op(ops, "qkv");
  CHECK(qkv.gemm);
  CHECK_FALSE(qkv.attention_core);
  CHECK(qkv.flops == Approx(2 * b * s * h * 3 * h / t));
  CHECK(qkv.m == Approx(b * s));
  CHECK(qkv.n == Approx(3 * h / t));
  CHECK(qkv.k == Approx(h));
  CHECK(qkv.memory_bytes == Approx(e * (b * s * h + h * 3 * h / t + b * s * 3 * h / t)));

  const LayerOp& scores = find_op(ops, "attention_scores");
  CHECK(scores.attention_core);
  CHECK(scores.flops == Approx(2 * b * s * s * h / t));
  CHECK(scores.flops == Approx(2 * scores.batch * scores.m * scores.n * scores.k));
  CHECK(find_op(ops, "attention_over_v").flops == Approx(2 * b * s * s * h / t));
  CHECK(find_op(ops, "attention_proj").flops == Approx(2 * b * s * h * h / t));
  CHECK(find_op(ops, "mlp_up").flops == Approx(2 * b * s * h * f / t));
  CHECK(find_op(ops, "mlp_down").flops == Approx(2 * b * s * h * f / t));
  CHECK(find_op(ops, "softmax").attention_core);
  CHECK(find_op(ops, "attention_dropout").attention_core);
  CHECK_FALSE(find_op(ops, "gelu").gemm);
  for (const char* name : {"layernorm_1", "dropout_residual_1", "layernorm_2", "gelu",
                           "dropout_residual_2"})
    CHECK_FALSE(find_op(ops, name).attention_core);

  // GEMM flops = 2 batch m n k everywhere.
  for (const auto& op : ops)
    if (op.gemm) CHECK(op.flops == Approx(2 * op.batch * op.m * op.n * op.k));

  // All GEMMs of t GPUs x layers + the head = forward model FLOPs of one sequence.
  const OpsCost layer = sum_cost(ops);
  const OpsCost head = sum_cost(head_forward_ops(m, shape));
  const double fwd = model_flops_per_iteration(m, 1) / 3;
  CHECK((layer.gemm_flops * m.layers + head.gemm_flops) * t == Approx(fwd));
  // Forward kernels: every op but the three backward-only ones (layout copies, bias gradients,
  // gradient accumulation).
  int backward_only = 0;
  for (const auto& op : ops) backward_only += op.backward_only;
  CHECK(backward_only == 3);
  CHECK(layer.kernels == static_cast<int>(ops.size()) - 3);

  // Sequence parallelism moves LayerNorm / dropout to s/t tokens, GEMMs unchanged.
  LayerShape sp = shape;
  sp.sequence_parallel = true;
  const auto sp_ops = layer_forward_ops(m, sp);
  CHECK(find_op(sp_ops, "layernorm_1").flops == Approx(find_op(ops, "layernorm_1").flops / t));
  CHECK(find_op(sp_ops, "dropout_residual_2").memory_bytes ==
        Approx(find_op(ops, "dropout_residual_2").memory_bytes / t));
  CHECK(sum_cost(sp_ops).gemm_flops == Approx(layer.gemm_flops));
}

TEST_CASE("backward and recompute costs", "[model]") {
  const ModelSpec m = gpt(4, 1024, 16);
  LayerShape shape;
  shape.micro_batch = 4;
  const auto ops = layer_forward_ops(m, shape);
  const OpsCost fwd = sum_cost(ops);
  const OpsCost bwd = backward_cost(ops);
  CHECK(bwd.gemm_flops == Approx(2 * fwd.gemm_flops));
  CHECK(bwd.kernels > fwd.kernels);
  // Backward bytes: GEMMs 2x; LayerNorm 5 e N (dx, then dgain / dbias re-reading dy and x), GELU
  // 3 e N, dropout + residual (5 e + 1) N, the rest 2x the forward; plus the backward-only ops:
  // layout copies 2 e x 7 T h, bias gradients e T (3h + h + f + h), gradient accumulation 3 e per
  // parameter.
  {
    const double T = 4 * 2048.0, h = 1024, f = 4 * h, e = 2;
    double expect = 0;
    for (const auto& op : ops) {
      if (op.gemm) expect += 2 * op.memory_bytes;
      else if (op.name.rfind("layernorm", 0) == 0) expect += 5 * e * T * h;
      else if (op.name == "gelu") expect += 3 * e * T * f;
      else if (op.name.rfind("dropout_residual", 0) == 0) expect += (5 * e + 1) * T * h;
      else if (!op.backward_only) expect += 2 * op.memory_bytes;
    }
    expect += 2 * e * 7 * T * h + e * T * (5 * h + f) + 3 * e * dense_layer_params(m);
    CHECK(bwd.memory_bytes == Approx(expect));
  }
  // Without dropout the residual's backward is the gradient sum at the fork: 3 e N.
  ModelSpec plain = m;
  plain.dropout = 0;
  const auto plain_ops = layer_forward_ops(plain, shape);
  CHECK(find_op(plain_ops, "residual_1").backward_memory_bytes() == Approx(3 * 2 * 4 * 2048.0 * 1024));
  CHECK_FALSE(has_op(plain_ops, "attention_dropout"));

  CHECK(recompute_cost(ops, Recompute::none).flops == 0);
  CHECK(recompute_cost(ops, Recompute::full).flops == Approx(fwd.flops));
  const OpsCost sel = recompute_cost(ops, Recompute::selective);
  const double b = 4, s = 2048, h = 1024;
  CHECK(sel.gemm_flops == Approx(2 * 2 * b * s * s * h));  // QK^T and attention over V
  CHECK(sel.kernels == 4);                                 // + softmax and attention dropout
  CHECK(sel.flops < fwd.flops);
}

TEST_CASE("embedding and head op lists", "[model]") {
  const ModelSpec m = gpt3_175b();
  LayerShape shape;
  shape.micro_batch = 2;
  shape.tp = 8;
  const double b = 2, s = 2048, h = 12288, V = 51200, t = 8;
  const auto emb = embedding_forward_ops(m, shape);
  REQUIRE_FALSE(emb.empty());
  for (const auto& op : emb) CHECK_FALSE(op.gemm);
  CHECK(find_op(emb, "embedding_lookup").memory_bytes >= 2 * b * s * h * 2);
  const auto head = head_forward_ops(m, shape);
  const LayerOp& logits = find_op(head, "logits");
  CHECK(logits.gemm);
  CHECK(logits.flops == Approx(2 * b * s * h * V / t));
  CHECK(logits.n == Approx(V / t));
  CHECK(find_op(head, "softmax_cross_entropy").memory_bytes >= b * s * V / t * 4);
}

TEST_CASE("fused linear cross-entropy: the head's gradients priced in the forward, none in the backward", "[model]") {
  ModelSpec m = gpt(24, 2048, 16);
  LayerShape shape;
  shape.micro_batch = 8;
  const double T = 8 * 2048.0, h = 2048, V = 51200;
  const auto plain = head_forward_ops(m, shape);
  m.cross_entropy = ModelSpec::CrossEntropy::fused_linear;
  const auto fused = head_forward_ops(m, shape);
  CHECK_FALSE(has_op(fused, "softmax_cross_entropy"));
  const LayerOp& logits = find_op(fused, "logits");
  CHECK(logits.grads_in_forward);
  // Forward: the logits GEMM and its dgrad and wgrad (3 x 2 T h V), the same GEMM FLOPs as the
  // unfused forward plus backward; backward: no GEMM at all, only the scale of the two gradients.
  const OpsCost f = sum_cost(fused), b = backward_cost(fused);
  CHECK(f.gemm_flops == Approx(3 * 2 * T * h * V));
  CHECK(b.gemm_flops == 0);
  CHECK(f.gemm_flops + b.gemm_flops == Approx(sum_cost(plain).gemm_flops + backward_cost(plain).gemm_flops));
  CHECK(find_op(fused, "fused_cross_entropy").memory_bytes == Approx((8 + 2 * 2) * T * V));  // bf16 logits
  CHECK(find_op(fused, "fused_cross_entropy_scale").memory_bytes == Approx(2 * 2 * (T * h + V * h)));
  CHECK(b.memory_bytes < backward_cost(plain).memory_bytes);
}

TEST_CASE("fused cross-entropy on 16-bit logits: one read forward, one read and one write backward", "[model]") {
  ModelSpec m = gpt(24, 2048, 16);
  LayerShape shape;
  shape.micro_batch = 8;
  shape.dtype = Dtype::bf16;
  const double T = 8 * 2048.0, V = 51200;
  const auto plain = head_forward_ops(m, shape);
  m.cross_entropy = ModelSpec::CrossEntropy::fused;
  const auto fused = head_forward_ops(m, shape);
  const LayerOp& ce = find_op(fused, "softmax_cross_entropy");
  CHECK(ce.memory_bytes == Approx(2 * T * V));            // the bf16 logits read once
  CHECK(ce.backward_memory_bytes() == Approx(2 * 2 * T * V));  // read again, the bf16 gradient written
  CHECK(ce.flops == Approx(find_op(plain, "softmax_cross_entropy").flops));
  // Same GEMMs as the unfused loss (the logits GEMM forward, its dgrad and wgrad backward).
  CHECK(sum_cost(fused).gemm_flops == Approx(sum_cost(plain).gemm_flops));
  CHECK(backward_cost(fused).gemm_flops == Approx(backward_cost(plain).gemm_flops));
  CHECK(sum_cost(fused).memory_bytes < sum_cost(plain).memory_bytes);
}

TEST_CASE("fused linear cross-entropy chunks: the fewest equal chunks whose fp32 probabilities fit in 1 GiB", "[model]") {
  CHECK(fused_cross_entropy_chunk_tokens(16384, 51200) == 4096);     // 3.1 GiB of fp32 -> 4 chunks
  CHECK(fused_cross_entropy_chunk_tokens(4096, 51200) == 4096);      // 0.78 GiB: one chunk
  CHECK(fused_cross_entropy_chunk_tokens(16385, 51200) == 4097);     // 4 chunks, the last one shorter
  CHECK(fused_cross_entropy_chunk_tokens(1000, 1000) == 1000);       // 4 MB: one chunk
  CHECK(fused_cross_entropy_chunk_tokens(5, 1LL << 30) == 1);        // a row over 1 GiB: one token a chunk
  CHECK(fused_cross_entropy_chunk_tokens(0, 51200) == 1);
}

TEST_CASE("MoE layer ops: gate plus local experts on routed tokens", "[model]") {
  ModelSpec m = gpt(24, 2048, 16);
  m.experts = 64;
  m.top_k = 2;
  m.capacity_factor = 1.25;
  LayerShape shape;
  shape.micro_batch = 4;
  shape.moe = true;
  shape.ep = 8;
  const double b = 4, s = 2048, h = 2048, f = 4 * h;
  const auto ops = layer_forward_ops(m, shape);
  const LayerOp& gate = find_op(ops, "moe_gate");
  CHECK(gate.flops == Approx(2 * b * s * h * 64));
  const LayerOp& up = find_op(ops, "mlp_up");
  CHECK(up.batch == Approx(64 / 8));  // local experts
  // This GPU's experts process its b s tokens x top_k x capacity factor (ep ranks exchange equal shares).
  CHECK(up.flops == Approx(2 * b * s * 2 * 1.25 * h * f));
  CHECK(find_op(ops, "mlp_down").flops == Approx(up.flops));

  LayerShape dense = shape;
  dense.moe = false;
  CHECK(find_op(layer_forward_ops(m, dense), "mlp_up").flops == Approx(2 * b * s * h * f));
}
