#include "backends/torch/gpt.hpp"

#include <array>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "backends/torch/fused_cross_entropy.hpp"
#include "backends/torch/gemm_epilogues.hpp"
#include "backends/torch/layer_norm_residual.hpp"
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {

GptConfig GptConfig::from(const ModelSpec& m, int tp, int tp_rank, bool sequence_parallel,
                          const FinetuneSpec* finetune) {
  GptConfig c;
  if (finetune) c.ft = FinetuneConfig::from(m, *finetune);
  c.layers = m.layers;
  c.hidden = m.hidden;
  c.heads = m.heads;
  c.ffn = m.ffn_hidden > 0 ? m.ffn_hidden : 4 * m.hidden;
  c.vocab = m.vocab;
  c.seq_len = m.seq_len;
  if (c.layers < 1 || c.hidden < 1 || c.heads < 1 || c.vocab < 1 || c.seq_len < 1)
    throw std::invalid_argument("model: layers, hidden, heads, vocab and seq_len must be positive");
  if (c.hidden % c.heads != 0)
    throw std::invalid_argument("model: hidden (" + std::to_string(c.hidden) +
                                ") must be divisible by heads (" + std::to_string(c.heads) + ")");
  if (m.is_moe()) {
    if (tp > 1 && sequence_parallel)
      throw std::invalid_argument("torch backend: MoE with parallel.sequence_parallel is not implemented (DeepSpeed's "
                                  "MoE layer drops and gathers tokens duplicated on the TP ranks); set "
                                  "parallel.sequence_parallel: false");
    if (m.top_k != 1 && m.top_k != 2)
      throw std::invalid_argument("model.top_k = " + std::to_string(m.top_k) +
                                  ": the torch backend gates top-1 and top-2 (DeepSpeed's TopKGate); set model.top_k: 1 or 2");
    c.experts = m.experts;
    c.moe_every = std::max(1, m.moe_every);
  }
  if (m.has_dropout())
    throw std::invalid_argument("torch backend: model.dropout = " + std::to_string(m.dropout) +
                                " is not implemented (dssim's GPT trains without dropout); set model.dropout: 0");
  auto not_implemented = [](const std::string& what) {
    return std::invalid_argument("torch backend: " + what + " is not implemented (dssim's GPT is " +
                                 "GELU, LayerNorm, learned positions, biased linears); the simulator covers it");
  };
  if (m.swiglu) throw not_implemented("model.mlp = swiglu");
  if (m.kv_heads > 0 && m.kv_heads != m.heads)
    throw not_implemented("model.kv_heads = " + std::to_string(m.kv_heads) + " (grouped-query attention)");
  if (m.rmsnorm) throw not_implemented("model.norm = rmsnorm");
  if (m.rotary) throw not_implemented("model.position = rotary");
  if (!m.bias) throw not_implemented("model.bias = false");
  if (!m.tied_embeddings) throw std::invalid_argument("torch backend: only tied embeddings are supported");
  c.tp = tp;
  c.tp_rank = tp_rank;
  c.sequence_parallel = sequence_parallel && tp > 1;
  if (m.cross_entropy == ModelSpec::CrossEntropy::fused)
    throw std::invalid_argument("torch backend: model.cross_entropy = fused (flash-attn's / apex's 16-bit cross-entropy "
                                "kernel) is not implemented; set model.cross_entropy: fused_linear or unfused");
  c.fused_cross_entropy = m.fused_cross_entropy();
  if (c.fused_cross_entropy && tp > 1)
    throw std::invalid_argument("torch backend: model.cross_entropy = fused_linear with parallel.tp = " + std::to_string(tp) +
                                " is not implemented (the vocabulary-parallel cross-entropy is not fused); set "
                                "model.cross_entropy: unfused or parallel.tp: 1");
  if (c.fused_cross_entropy && c.ft.lora && c.ft.head)
    throw std::invalid_argument("torch backend: model.cross_entropy = fused_linear with a LoRA adapter on the LM head "
                                "(finetune.targets: lm_head) is not implemented; set model.cross_entropy: unfused or "
                                "drop lm_head from finetune.targets");
  auto need = [&](const char* key, int64_t value, const char* what) {
    if (value % tp != 0)
      throw std::invalid_argument(std::string(key) + " = " + std::to_string(value) + " is not divisible by parallel.tp = " +
                                  std::to_string(tp) + " (" + what + "); choose a tp that divides it");
  };
  if (tp > 1) {
    need("model.heads", c.heads, "each tensor-parallel rank computes whole attention heads");
    need("model.ffn_hidden", c.ffn, "the MLP is split by columns");
    need("model.vocab", c.vocab, "the word embedding and LM head are split by vocabulary rows; pad the vocabulary");
    if (c.sequence_parallel) need("model.seq_len", c.seq_len, "sequence parallelism shards the sequence");
  }
  return c;
}

GptConfig GptConfig::whole() const {
  GptConfig c = *this;
  c.tp = 1;
  c.tp_rank = 0;
  c.sequence_parallel = false;
  return c;
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

namespace {
std::vector<ParamSpec> base_unit_params(const GptConfig& c, int unit) {
  const int64_t h = c.hidden, f = c.ffn / c.tp, ht = c.hidden / c.tp, v = c.vocab_local();
  if (unit == 0)
    return {{"wte", {v, h}, ParamSpec::Normal}, {"wpe", {c.seq_len, h}, ParamSpec::Normal}};
  if (unit == c.final_unit())
    return {{"lnf.w", {h}, ParamSpec::Ones}, {"lnf.b", {h}, ParamSpec::Zeros}};
  if (unit == c.head_copy_unit()) return {{"wte", {v, h}, ParamSpec::Normal}};
  if (c.moe_layer(unit - 1))
    return {{"ln1.w", {h}, ParamSpec::Ones},        {"ln1.b", {h}, ParamSpec::Zeros},
            {"qkv.w", {3 * ht, h}, ParamSpec::Normal}, {"qkv.b", {3 * ht}, ParamSpec::Zeros},
            {"proj.w", {h, ht}, ParamSpec::ScaledNormal}, {"proj.b", {h}, ParamSpec::Zeros},
            {"ln2.w", {h}, ParamSpec::Ones},        {"ln2.b", {h}, ParamSpec::Zeros},
            {"gate.w", {c.experts, h}, ParamSpec::Normal}};
  return {{"ln1.w", {h}, ParamSpec::Ones},        {"ln1.b", {h}, ParamSpec::Zeros},
          {"qkv.w", {3 * ht, h}, ParamSpec::Normal}, {"qkv.b", {3 * ht}, ParamSpec::Zeros},
          {"proj.w", {h, ht}, ParamSpec::ScaledNormal}, {"proj.b", {h}, ParamSpec::Zeros},
          {"ln2.w", {h}, ParamSpec::Ones},        {"ln2.b", {h}, ParamSpec::Zeros},
          {"fc.w", {f, h}, ParamSpec::Normal},    {"fc.b", {f}, ParamSpec::Zeros},
          {"fc2.w", {h, f}, ParamSpec::ScaledNormal}, {"fc2.b", {h}, ParamSpec::Zeros}};
}
}  // namespace

std::vector<ParamSpec> unit_params(const GptConfig& c, int unit) {
  std::vector<ParamSpec> ps = base_unit_params(c, unit);
  for (auto& a : lora_params(c, unit)) ps.push_back(std::move(a));
  return ps;
}

bool replicated_over_tp(const GptConfig& c, int unit, int index) {
  if (unit == 0) return index == 1;  // wpe
  if (unit == c.final_unit()) return true;
  if (unit == c.head_copy_unit()) return false;
  // MoE layer: ln1 w,b (0,1), proj.b (5), ln2 w,b (6,7) and the gate (8): the experts' input is
  // whole on every TP rank
  if (c.moe_layer(unit - 1)) return index == 0 || index == 1 || index >= 5;
  // ln1 w,b (0,1), proj.b (5), ln2 w,b (6,7), fc2.b (11)
  return index == 0 || index == 1 || index == 5 || index == 6 || index == 7 || index == 11;
}

int64_t unit_numel(const GptConfig& c, int unit) {
  int64_t n = 0;
  for (const auto& p : unit_params(c, unit)) n += p.numel();
  return n;
}

std::vector<at::Tensor> unit_views(const GptConfig& c, int unit, const at::Tensor& flat) {
  std::vector<at::Tensor> out;
  int64_t off = 0;
  for (const auto& p : unit_params(c, unit)) {
    out.push_back(flat.narrow(0, off, p.numel()).view(p.shape));
    off += p.numel();
  }
  return out;
}

namespace {
// This TP rank's slice of a whole parameter (Megatron's partitioning of the master weight).
at::Tensor tp_slice(const GptConfig& c, int unit, int index, const at::Tensor& whole) {
  const int64_t t = c.tp, r = c.tp_rank;
  if (t == 1 || replicated_over_tp(c, unit, index)) return whole;
  const std::string name = unit_params(c, unit)[index].name;
  if (name == "wte") return whole.narrow(0, c.vocab_begin(), c.vocab_local());
  if (name == "qkv.w" || name == "qkv.b") {  // [3, heads, d, ...]: this rank's heads of q, k and v
    auto parts = whole.view({3, c.hidden, -1});
    const int64_t ht = c.hidden / t;
    auto mine = parts.narrow(1, r * ht, ht);
    return name == "qkv.b" ? mine.reshape({3 * ht}) : mine.reshape({3 * ht, c.hidden});
  }
  if (name == "fc.w" || name == "fc.b") return whole.narrow(0, r * (c.ffn / t), c.ffn / t);
  if (name == "proj.w") return whole.narrow(1, r * (c.hidden / t), c.hidden / t);
  if (name == "fc2.w") return whole.narrow(1, r * (c.ffn / t), c.ffn / t);
  throw std::logic_error("tp_slice: no rule for " + name);
}
}  // namespace

at::Tensor tp_unslice(const GptConfig& c, int unit, int index, const std::vector<at::Tensor>& pieces) {
  if (c.tp == 1 || replicated_over_tp(c, unit, index)) return pieces.at(0);
  const std::string name = unit_params(c, unit)[index].name;
  if (name == "wte" || name == "fc.w" || name == "fc.b") return at::cat(pieces, 0);
  if (name == "proj.w" || name == "fc2.w") return at::cat(pieces, 1);
  if (name == "qkv.w" || name == "qkv.b") {
    std::vector<at::Tensor> parts;
    for (const auto& p : pieces) parts.push_back(p.reshape({3, c.hidden / c.tp, -1}));
    return at::cat(parts, 1).reshape(name == "qkv.b" ? std::vector<int64_t>{3 * c.hidden}
                                                     : std::vector<int64_t>{3 * c.hidden, c.hidden});
  }
  throw std::logic_error("tp_unslice: no rule for " + name);
}

void init_unit(const GptConfig& c, int unit, at::Tensor flat, uint64_t seed) {
  at::NoGradGuard ng;
  if (unit == c.head_copy_unit()) {  // starts equal to the word embedding it is tied to
    auto emb = at::empty({unit_numel(c, 0)}, flat.options());
    init_unit(c, 0, emb, seed);
    flat.copy_(unit_views(c, 0, emb)[0].reshape({-1}));
    return;
  }
  if (c.tp > 1) {
    const GptConfig w = c.whole();
    auto whole = at::empty({unit_numel(w, unit)}, flat.options());
    init_unit(w, unit, whole, seed);
    auto wv = unit_views(w, unit, whole);
    auto mine = unit_views(c, unit, flat);
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(tp_slice(c, unit, int(i), wv[i]));
    return;
  }
  auto gen = seeded_generator(flat.device(), seed * 1000003ull + uint64_t(unit) * 7919ull + 17);
  const double std = 0.02, scaled = 0.02 / std::sqrt(2.0 * c.layers);
  auto views = unit_views(c, unit, flat);
  auto specs = unit_params(c, unit);
  for (size_t i = 0; i < specs.size(); ++i) {
    switch (specs[i].init) {
      case ParamSpec::Normal: views[i].normal_(0.0, std, gen); break;
      case ParamSpec::ScaledNormal: views[i].normal_(0.0, scaled, gen); break;
      case ParamSpec::Zeros: views[i].zero_(); break;
      case ParamSpec::Ones: views[i].fill_(1.0); break;
      case ParamSpec::LoraA: break;  // init_lora, from a generator of its own
    }
  }
  init_lora(c, unit, views, seed);
}

namespace {
// CPU kernels of libtorch 1.13 lack fp16 LayerNorm: normalise in fp32 there (GPUs use their own).
at::Tensor layer_norm(const at::Tensor& x, int64_t h, const at::Tensor& w, const at::Tensor& b) {
  if (x.scalar_type() == at::kHalf && x.device().is_cpu())
    return at::layer_norm(x.to(at::kFloat), {h}, w.to(at::kFloat), b.to(at::kFloat), 1e-5).to(at::kHalf);
  return at::layer_norm(x, {h}, w, b, 1e-5);
}
// ...and fp16 GEMMs: on CPUs fp16 parameters are used in fp32 (storage, gradients and
// communication stay fp16, so loss scaling behaves as on GPUs).
std::vector<at::Tensor> compute_view(const std::vector<at::Tensor>& ps) {
  if (ps.empty() || !(ps[0].scalar_type() == at::kHalf && ps[0].device().is_cpu())) return ps;
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.to(at::kFloat));
  return out;
}
}  // namespace

at::Tensor embed_forward(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& embed,
                         const at::Tensor& tokens) {
  auto v = compute_view(embed);
  const int64_t s = tokens.size(1);
  if (!tp.active()) {
    auto pos = at::arange(s, tokens.options());
    return at::embedding(v[0], tokens) + at::embedding(v[1], pos).unsqueeze(0);
  }
  // Vocabulary-parallel: partial lookups summed over the group (reduce-scattered into sequence
  // shards with sequence parallelism), then this rank's positions.
  auto x = leave_tp_region(tp, vocab_parallel_lookup(v[0], tokens, c.vocab_begin()));
  const int64_t s_local = x.size(1), first = tp.sequence_parallel ? s_local * tp.rank : 0;
  auto pos = at::arange(first, first + s_local, tokens.options());
  return x + at::embedding(v[1], pos).unsqueeze(0);
}

namespace {
// The attention core's own autograd graph, kept across a Function's forward and backward: q, k, v
// (leaves with grad) and the core's output go into the context; core_grads takes them out again
// (the graph goes with them) and returns dq, dk, dv.
void save_core(torch::autograd::AutogradContext* ctx, const std::array<at::Tensor, 3>& q, const at::Tensor& out) {
  ctx->saved_data["q"] = q[0];
  ctx->saved_data["k"] = q[1];
  ctx->saved_data["v"] = q[2];
  ctx->saved_data["out"] = out;
}
std::vector<at::Tensor> core_grads(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_out) {
  const std::array<at::Tensor, 3> q{ctx->saved_data["q"].toTensor(), ctx->saved_data["k"].toTensor(),
                                    ctx->saved_data["v"].toTensor()};
  const at::Tensor out = ctx->saved_data["out"].toTensor();
  ctx->saved_data.clear();
  return torch::autograd::grad({out}, {q[0], q[1], q[2]}, {grad_out});
}

// Causal attention over q, k, v read from the QKV projection's output [B, S, 3 x a x d]. Autograd's
// own path (view, permute, unbind) assembles the QKV gradient with two full copies: unbind's
// backward stacks dq, dk, dv into [3, B, a, S, d], and the permute / view backward makes that
// contiguous again as [B, S, 3, a, d]. Here the backward writes dq, dk, dv straight into one
// [B, S, 3, a, d] gradient (one strided copy of each); the gradients are the same to the bit
// (tests/torch: QkvAttention). With `recompute` (selective activation checkpointing, Korthikanti et
// al. 2022, where no fused kernel keeps the scores out of memory) it keeps only its input and
// recomputes the core in backward.
struct QkvAttention : torch::autograd::Function<QkvAttention> {
  // q, k, v as [B, a, S, d] views of qkv (leaves of their own graph with `grad`).
  static std::array<at::Tensor, 3> split(const at::Tensor& qkv, int64_t heads, bool grad) {
    const int64_t B = qkv.size(0), S = qkv.size(1), d = qkv.size(2) / 3 / heads;
    auto base = qkv.detach().view({B, S, 3, heads, d});
    std::array<at::Tensor, 3> out;
    for (int i = 0; i < 3; ++i) out[i] = base.select(2, i).transpose(1, 2).requires_grad_(grad);
    return out;
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, int64_t heads, bool recompute) {
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["recompute"] = recompute;
    if (recompute || !qkv.requires_grad()) {
      if (recompute) ctx->save_for_backward({qkv});
      auto q = split(qkv, heads, false);
      return causal_attention(q[0], q[1], q[2]);
    }
    at::AutoGradMode enable(true);  // the core's own graph, kept for backward (its saved tensors)
    auto q = split(qkv, heads, true);
    auto out = causal_attention(q[0], q[1], q[2]);
    save_core(ctx, q, out);
    return out.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const int64_t heads = ctx->saved_data["heads"].toInt();
    if (ctx->saved_data["recompute"].toBool()) {
      at::AutoGradMode enable(true);
      auto q = split(ctx->get_saved_variables()[0], heads, true);
      save_core(ctx, q, causal_attention(q[0], q[1], q[2]));
    }
    auto g = core_grads(ctx, grad_out[0]);
    const int64_t B = g[0].size(0), S = g[0].size(2), d = g[0].size(3);
    auto dqkv = at::empty({B, S, 3, heads, d}, g[0].options());
    for (int i = 0; i < 3; ++i) dqkv.select(2, i).copy_(g[i].transpose(1, 2));
    return {dqkv.view({B, S, 3 * heads * d}), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

namespace {
// The QKV projection and causal attention in one, on GPUs where the block's GEMMs run fused
// (gemm_epilogues.hpp): q, k and v come from three GEMMs into one [3, B, S, a, d] tensor, so each
// is dense and the attention kernels' dq, dk and dv come back dense in [B, S, a, d] as well (they
// take their inputs' strides). The backward then multiplies them as they are: dy = dq Wq + dk Wk +
// dv Wv accumulated by the GEMMs, and each third of the weight and bias gradient by one GEMM,
// instead of first copying dq, dk and dv into one [B, S, 3, a, d] gradient (QkvAttention).
struct QkvProjectionAttention : torch::autograd::Function<QkvProjectionAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& w,
                            const at::Tensor& b, int64_t heads) {
    const int64_t B = y.size(0), S = y.size(1), hl = w.size(0) / 3, d = hl / heads;
    const auto y2 = y.reshape({B * S, y.size(2)});
    auto qkv = at::empty({3, B * S, hl}, y.options());
    for (int i = 0; i < 3; ++i) {
      at::Tensor qkv_i = qkv[i];
      at::addmm_out(qkv_i, b.narrow(0, i * hl, hl), y2, w.narrow(0, i * hl, hl).t());
    }
    at::AutoGradMode enable(true);  // the core's own graph, kept for backward (its saved tensors)
    std::array<at::Tensor, 3> q;
    for (int i = 0; i < 3; ++i) q[i] = qkv[i].view({B, S, heads, d}).transpose(1, 2).requires_grad_(true);
    auto out = causal_attention(q[0], q[1], q[2]);
    ctx->save_for_backward({y2, w, b});
    save_core(ctx, q, out);
    return out.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &y2 = saved[0], &w = saved[1], &b = saved[2];
    auto g = core_grads(ctx, grad_out[0]);
    const int64_t hl = w.size(0) / 3;
    at::Tensor dy;
    // The weight and bias gradients: into their buffers in place, or new tensors for AccumulateGrad
    // (gemm_epilogues.hpp weight_grad_target), a third of each by each GEMM.
    WeightGradTarget t;
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) t = weight_grad_target(w, b);
    for (int i = 0; i < 3; ++i) {
      const auto dqi = g[i].transpose(1, 2).reshape({y2.size(0), hl});  // a view when dense
      const auto wi = w.narrow(0, i * hl, hl);
      if (ctx->needs_input_grad(0)) dy = i == 0 ? at::mm(dqi, wi) : dy.addmm_(dqi, wi);
      if (t.dw.defined())
        linear_weight_grads(dqi, y2, t.dw.narrow(0, i * hl, hl), t.db.narrow(0, i * hl, hl), t.in_place);
    }
    const auto [dw, db] = t.returned();
    // y was [B, S, h]; the core's gradients are [B, a, S, d].
    return {dy.defined() ? dy.view({g[0].size(0), g[0].size(2), w.size(1)}) : dy, dw, db, at::Tensor()};
  }
};
}  // namespace

at::Tensor qkv_attention(const at::Tensor& qkv, int64_t heads, bool recompute) {
  return QkvAttention::apply(qkv, heads, recompute);
}

at::Tensor qkv_projection_attention(const at::Tensor& y, const at::Tensor& w, const at::Tensor& b, int64_t heads,
                                    bool recompute) {
  if (!recompute && y.requires_grad() && gemm_epilogues_apply(y, w, b))
    return QkvProjectionAttention::apply(y, w, b, heads);
  return qkv_attention(biased_linear(y, w, b), heads, recompute);
}

at::Tensor block_forward(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& block,
                         const at::Tensor& x_in, bool recompute_attention, MoeLayer* moe) {
  const at::Tensor x = block[0].scalar_type() == at::kHalf && block[0].device().is_cpu() ? x_in.to(at::kFloat) : x_in;
  auto v = compute_view(block);
  const int64_t h = c.hidden, a = c.heads / c.tp, d = c.hidden / c.heads, hl = a * d;
  if (!tp.active()) {
    const int64_t B = x.size(0), S = x.size(1);
    // LoRA adapters (lora.hpp) follow the block's 12 tensors.
    // Without an adapter the linears and the MLP run with their bias, GELU and bias gradients in
    // the GEMMs where they can (gemm_epilogues.hpp), and each norm's backward adds the gradient of
    // the residual that forks with it (layer_norm_residual.hpp).
    const auto adapted = [&](LoraTarget t) { return c.ft.lora && c.ft.adapter_index(t) >= 0; };
    const auto norm = [&](const at::Tensor& in, int w) {
      return c.ft.lora ? NormResidual{layer_norm(in, h, v[w], v[w + 1]), in} : layer_norm_residual(in, v[w], v[w + 1]);
    };
    const auto [y, xr] = norm(x, 0);
    const auto lin = [&](LoraTarget t, const at::Tensor& in, int w) {
      if (!adapted(t)) return biased_linear(in, v[w], v[w + 1]);
      return lora_add(c, v, 12, t, in, at::linear(in, v[w], v[w + 1]));
    };
    auto core = adapted(LoraTarget::qkv) ? qkv_attention(lin(LoraTarget::qkv, y, 2), a, recompute_attention)
                                         : qkv_projection_attention(y, v[2], v[3], a, recompute_attention);
    auto att = core.transpose(1, 2).reshape({B, S, h});
    auto x1 = adapted(LoraTarget::o) ? xr + lin(LoraTarget::o, att, 4) : biased_linear(att, v[4], v[5], xr);
    const auto [y2, x1r] = norm(x1, 6);
    if (moe) {
      for (auto& e : moe->experts) e = compute_view(e);
      return x1r + moe_mlp_forward(*moe, v[8], y2);
    }
    if (!adapted(LoraTarget::mlp_up) && !adapted(LoraTarget::mlp_down)) return mlp(y2, v[8], v[9], v[10], v[11], x1r);
    auto m = at::gelu(lin(LoraTarget::mlp_up, y2, 8), "tanh");
    return x1r + lin(LoraTarget::mlp_down, m, 10);
  }
  // Megatron: column-parallel QKV and MLP-up after f (or the sequence all-gather), row-parallel
  // projection and MLP-down before g (or the sequence reduce-scatter), biases of the row-parallel
  // layers added after the reduction.
  auto y = enter_tp_region(tp, layer_norm(x, h, v[0], v[1]));
  const int64_t B = y.size(0), S = y.size(1);
  auto core = qkv_projection_attention(y, v[2], v[3], a, recompute_attention);
  auto att = core.transpose(1, 2).reshape({B, S, hl});
  auto x1 = x + (leave_tp_region(tp, at::linear(att, v[4])) + v[5]);
  if (moe) {  // whole tokens into the MoE layer (no f: it drops and gathers them itself, moe.hpp)
    for (auto& e : moe->experts) e = compute_view(e);
    moe->tp = &tp;
    return x1 + moe_mlp_forward(*moe, v[8], layer_norm(x1, h, v[6], v[7]));
  }
  auto y2 = enter_tp_region(tp, layer_norm(x1, h, v[6], v[7]));
  return x1 + (leave_tp_region(tp, mlp(y2, v[8], v[9], v[10], at::Tensor())) + v[11]);
}

at::Tensor head_loss(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& final_norm,
                     const at::Tensor& wte, const at::Tensor& x, const at::Tensor& targets) {
  auto f = compute_view(final_norm);
  auto e = compute_view({wte});
  auto y = layer_norm(x, c.hidden, f[0], f[1]);
  if (c.fused_cross_entropy && !tp.active())
    return fused_linear_cross_entropy(y.reshape({-1, c.hidden}), e[0], targets.reshape({-1}));
  if (!tp.active()) {
    auto logits = lora_add(c, f, 2, LoraTarget::lm_head, y, at::matmul(y, e[0].t()));
    return at::cross_entropy_loss(logits.view({-1, c.vocab}).to(at::kFloat), targets.reshape({-1}));
  }
  // Column-parallel LM head over this rank's vocabulary rows, vocabulary-parallel cross-entropy.
  auto logits = at::matmul(enter_tp_region(tp, y), e[0].t());
  return vocab_parallel_cross_entropy(tp, logits.reshape({-1, c.vocab_local()}).to(at::kFloat), targets.reshape({-1}),
                                      c.vocab_begin());
}

namespace {
uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t mix(uint64_t a, uint64_t b) { return splitmix(a ^ splitmix(b)); }
}  // namespace

DataSource::DataSource(std::string path, int vocab, int seq_len, uint64_t seed)
    : vocab_(vocab), seq_len_(seq_len), seed_(seed) {
  if (path.empty()) return;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--data: cannot read " + path);
  bytes_.assign(std::istreambuf_iterator<char>(in), {});
  if (vocab < 256)
    throw std::invalid_argument("--data trains byte-level: model.vocab must be >= 256 (it is " +
                                std::to_string(vocab) + ")");
  if (int64_t(bytes_.size()) < seq_len + 2)
    throw std::invalid_argument("--data: " + path + " is shorter than seq_len + 2 bytes");
}

at::Tensor DataSource::batch(int64_t step, int mb, int dp_rank, int micro_batch, int64_t samples_per_rank) const {
  auto out = at::empty({micro_batch, seq_len_ + 1}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (int b = 0; b < micro_batch; ++b) {
    // Keyed by the sample's index in the step's global batch, so 4 micro-batches of 2 see the
    // same sequences as 1 of 8, on one rank or over data-parallel ranks.
    const uint64_t sample = uint64_t(dp_rank) * uint64_t(samples_per_rank) + uint64_t(mb) * uint64_t(micro_batch) + uint64_t(b);
    uint64_t h = mix(mix(seed_, uint64_t(step)), sample);
    int64_t* row = p + int64_t(b) * (seq_len_ + 1);
    if (!bytes_.empty()) {
      const uint64_t start = h % uint64_t(bytes_.size() - seq_len_ - 1);
      for (int t = 0; t <= seq_len_; ++t) row[t] = bytes_[start + t];
    } else {
      // t_{i+1} = (a t_i + c) mod V with a, c from a small family, 1 token in 16 random: a model
      // can learn it, so the loss falls.
      const uint64_t a = 1 + 2 * (h % 4), c = 1 + (h >> 8) % 7;
      uint64_t tok = (h >> 16) % uint64_t(vocab_);
      for (int t = 0; t <= seq_len_; ++t) {
        row[t] = int64_t(tok);
        uint64_t r = mix(h, uint64_t(t));
        tok = (r % 16 == 0) ? (r >> 8) % uint64_t(vocab_) : (a * tok + c) % uint64_t(vocab_);
      }
    }
  }
  return out;
}

}  // namespace dssim::tb
