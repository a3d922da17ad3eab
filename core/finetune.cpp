#include "core/finetune.hpp"

#include <algorithm>
#include <map>
#include <string>

namespace dssim {

const char* to_string(LoraTarget t) {
  switch (t) {
    case LoraTarget::q: return "q";
    case LoraTarget::k: return "k";
    case LoraTarget::v: return "v";
    case LoraTarget::qkv: return "qkv";
    case LoraTarget::o: return "o";
    case LoraTarget::mlp_gate: return "mlp_gate";
    case LoraTarget::mlp_up: return "mlp_up";
    case LoraTarget::mlp_down: return "mlp_down";
    case LoraTarget::lm_head: return "lm_head";
  }
  return "?";
}

namespace {

// dssim's names first, then the Hugging Face module names of Llama (q_proj ...), GPT-2 (c_attn,
// c_fc; its c_proj names both the attention output and the MLP down projection, so it is not
// accepted), GPT-NeoX / Megatron (query_key_value, dense, dense_h_to_4h, dense_4h_to_h).
const std::map<std::string, std::vector<LoraTarget>>& aliases() {
  using T = LoraTarget;
  static const std::map<std::string, std::vector<T>> a = {
      {"q", {T::q}},           {"k", {T::k}},           {"v", {T::v}},
      {"qkv", {T::qkv}},       {"o", {T::o}},           {"proj", {T::o}},
      {"mlp_gate", {T::mlp_gate}}, {"mlp_up", {T::mlp_up}}, {"mlp_down", {T::mlp_down}},
      {"lm_head", {T::lm_head}},
      {"q_proj", {T::q}},      {"k_proj", {T::k}},      {"v_proj", {T::v}},
      {"o_proj", {T::o}},      {"gate_proj", {T::mlp_gate}}, {"up_proj", {T::mlp_up}},
      {"down_proj", {T::mlp_down}}, {"c_attn", {T::qkv}},  {"query_key_value", {T::qkv}},
      {"dense", {T::o}},       {"c_fc", {T::mlp_up}},   {"dense_h_to_4h", {T::mlp_up}},
      {"dense_4h_to_h", {T::mlp_down}}, {"output", {T::lm_head}},
      // PEFT's "all-linear": every linear of the layers, not the output layer.
      {"all-linear", {T::q, T::k, T::v, T::o, T::mlp_gate, T::mlp_up, T::mlp_down}},
  };
  return a;
}

}  // namespace

bool parse_lora_target(const std::string& name, std::vector<LoraTarget>& out) {
  auto it = aliases().find(name);
  if (it == aliases().end()) return false;
  for (LoraTarget t : it->second)
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  return true;
}

std::vector<std::string> lora_target_names() {
  std::vector<std::string> n;
  for (const auto& [k, _] : aliases()) n.push_back(k);
  return n;
}

std::vector<LoraTarget> lora_targets(const ModelSpec& m, const FinetuneSpec& f) {
  if (!f.lora()) return {};
  std::vector<LoraTarget> t = f.targets;
  if (t.empty()) {
    // Llama-shaped models (separate q / k / v projections in Hugging Face): q_proj, v_proj;
    // GPT-shaped (fused c_attn / query_key_value): the fused QKV.
    const bool llama = m.swiglu || m.rmsnorm || m.rotary || m.kv_heads > 0;
    t = llama ? std::vector<LoraTarget>{LoraTarget::q, LoraTarget::v} : std::vector<LoraTarget>{LoraTarget::qkv};
  }
  // all-linear on a GELU MLP: there is no gate projection.
  if (!m.swiglu) t.erase(std::remove(t.begin(), t.end(), LoraTarget::mlp_gate), t.end());
  return t;
}

std::vector<LoraAdapter> layer_adapters(const ModelSpec& m, const FinetuneSpec& f) {
  const double h = m.hidden, kv = kv_width(m), ff = ffn_hidden_of(m);
  std::vector<LoraAdapter> out;
  for (LoraTarget t : lora_targets(m, f)) {
    switch (t) {
      case LoraTarget::q: out.push_back({t, h, h}); break;
      case LoraTarget::k: out.push_back({t, h, kv}); break;
      case LoraTarget::v: out.push_back({t, h, kv}); break;
      case LoraTarget::qkv: out.push_back({t, h, h + 2 * kv}); break;
      case LoraTarget::o: out.push_back({t, h, h}); break;
      case LoraTarget::mlp_gate: out.push_back({t, h, ff}); break;
      case LoraTarget::mlp_up: out.push_back({t, h, ff}); break;
      case LoraTarget::mlp_down: out.push_back({t, ff, h}); break;
      case LoraTarget::lm_head: break;  // not a layer's
    }
  }
  return out;
}

double layer_adapter_params(const ModelSpec& m, const FinetuneSpec& f) {
  double n = 0;
  for (const LoraAdapter& a : layer_adapters(m, f)) n += a.params(f.rank);
  return n;
}

double head_adapter_params(const ModelSpec& m, const FinetuneSpec& f) {
  const auto t = lora_targets(m, f);
  if (std::find(t.begin(), t.end(), LoraTarget::lm_head) == t.end()) return 0;
  return double(f.rank) * (double(m.hidden) + double(m.vocab));
}

double adapter_parameter_count(const ModelSpec& m, const FinetuneSpec& f) {
  return m.layers * layer_adapter_params(m, f) + head_adapter_params(m, f);
}

bool base_trains(const ModelSpec& m, const FinetuneSpec& f, BasePart part) {
  if (f.lora()) return false;
  switch (part) {
    case BasePart::embedding: return !f.freeze_embeddings && !(m.tied_embeddings && f.freeze_head);
    case BasePart::norm: return !f.freeze_norms;
    case BasePart::attention: return !f.freeze_attention;
    case BasePart::mlp: return !f.freeze_mlp;
    case BasePart::head: return m.tied_embeddings ? base_trains(m, f, BasePart::embedding) : !f.freeze_head;
  }
  return true;
}

double layer_trainable_params(const ModelSpec& m, const FinetuneSpec& f, double t) {
  double n = layer_adapter_params(m, f);
  if (base_trains(m, f, BasePart::attention)) n += attention_params(m) / t;
  if (base_trains(m, f, BasePart::mlp)) n += expert_mlp_params(m) / t;
  if (base_trains(m, f, BasePart::norm)) n += 2 * norm_params(m);
  return n;
}

double embedding_trainable_params(const ModelSpec& m, const FinetuneSpec& f, double t) {
  if (!base_trains(m, f, BasePart::embedding)) return 0;
  return double(m.vocab) / t * m.hidden + (m.rotary ? 0.0 : double(m.seq_len) * m.hidden);
}

double head_trainable_params(const ModelSpec& m, const FinetuneSpec& f, bool has_output_layer, double t) {
  double n = head_adapter_params(m, f);
  if (base_trains(m, f, BasePart::norm)) n += norm_params(m);  // final norm
  if (has_output_layer && base_trains(m, f, BasePart::head)) n += double(m.vocab) / t * m.hidden;
  return n;
}

double trainable_parameter_count(const ModelSpec& m, const FinetuneSpec& f) {
  if (!f.freezes_anything()) return parameter_count(m);
  return m.layers * layer_trainable_params(m, f) + embedding_trainable_params(m, f) +
         head_trainable_params(m, f, !m.tied_embeddings);
}

double total_parameter_count(const ModelSpec& m, const FinetuneSpec& f) {
  return parameter_count(m) + adapter_parameter_count(m, f);
}

double finetune_flops_delta(const ModelSpec& m, const FinetuneSpec& f, double global_batch, Recompute r,
                            bool hardware) {
  if (!f.freezes_anything()) return 0;
  const double s = m.seq_len, h = m.hidden, ff = ffn_hidden_of(m), kv = kv_width(m);
  double per_sequence = 0;
  // Frozen weights: no weight gradient (forward GEMM FLOPs each, as model.cpp's layer_flops).
  if (!base_trains(m, f, BasePart::attention)) per_sequence -= m.layers * 2 * s * (2 * h * h + 2 * h * kv);
  if (!base_trains(m, f, BasePart::mlp)) {
    const double factor = hardware ? m.top_k * m.capacity_factor : m.top_k;
    for (int i = 0; i < m.layers; ++i)
      per_sequence -= 2 * s * mlp_matrices(m) * h * ff * (is_moe_layer(m, i) ? factor : 1.0);
  }
  if (!base_trains(m, f, BasePart::head)) per_sequence -= head_forward_flops_per_sequence(m);
  // Adapters: forward, then dgrad and wgrad of both A and B.
  double adapters = 0;
  for (const LoraAdapter& a : layer_adapters(m, f)) adapters += 2 * s * a.params(f.rank);
  adapters = m.layers * adapters + 2 * s * head_adapter_params(m, f);
  per_sequence += 3 * adapters;
  if (hardware && r == Recompute::full) per_sequence += adapters - 2 * s * head_adapter_params(m, f);
  return global_batch * per_sequence;
}

std::vector<LayerOp> lora_forward_ops(const LoraAdapter& a, const FinetuneSpec& f, double tokens, double e) {
  const double r = f.rank;
  std::vector<LayerOp> ops;
  const auto gemm = [&](const std::string& name, double m, double n, double k) {
    LayerOp op;
    op.name = name;
    op.gemm = true;
    op.m = m, op.n = n, op.k = k;
    op.flops = 2 * m * n * k;
    op.memory_bytes = (m * k + k * n + m * n) * e;
    return op;
  };
  const std::string suffix = std::string("_") + to_string(a.target);
  if (f.dropout > 0) {  // nn.Dropout on x: a dropped copy written (and a mask), read back by A
    LayerOp d;
    d.name = "lora_dropout" + suffix;
    d.flops = tokens * a.in;
    d.memory_bytes = tokens * a.in * (2 * e + 1);
    ops.push_back(d);
  }
  ops.push_back(gemm("lora_a" + suffix, tokens, r, a.in));
  ops.push_back(gemm("lora_b" + suffix, tokens, a.out, r));
  // (alpha / r) scaling and the add into the base output: read both, write the sum.
  LayerOp add;
  add.name = "lora_add" + suffix;
  add.kernel = "add";
  add.flops = 2 * tokens * a.out;
  add.memory_bytes = 3 * e * tokens * a.out;
  ops.push_back(add);
  for (LayerOp& op : ops) op.in_layer = true;
  return ops;
}

namespace {

const char* anchor(LoraTarget t) {  // the base GEMM an adapter follows in the op list
  switch (t) {
    case LoraTarget::q: case LoraTarget::k: case LoraTarget::v: case LoraTarget::qkv: return "qkv";
    case LoraTarget::o: return "attention_proj";
    case LoraTarget::mlp_gate: return "mlp_gate";
    case LoraTarget::mlp_up: return "mlp_up";
    case LoraTarget::mlp_down: return "mlp_down";
    case LoraTarget::lm_head: return "logits";
  }
  return "";
}

void set_accumulate(LayerOp& op, double params, double e) {  // as model.cpp's grad_accumulate_op
  op.flops = params;
  op.memory_bytes = 3 * e * params;
}

bool active(const LayerShape& shape) { return shape.finetune && shape.finetune->freezes_anything(); }

}  // namespace

void finetune_layer_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape) {
  if (!active(shape)) return;
  const FinetuneSpec& f = *shape.finetune;
  const double t = std::max(1, shape.tp), e = bytes_of(shape.dtype);
  const double tokens = double(shape.micro_batch) * m.seq_len;
  const double h = m.hidden, ff = ffn_hidden_of(m), qkv_width = h + 2 * kv_width(m);
  const bool attention = base_trains(m, f, BasePart::attention), mlp = base_trains(m, f, BasePart::mlp);
  const std::vector<LoraAdapter> adapters = layer_adapters(m, f);
  std::vector<LayerOp> out;
  for (LayerOp& op : ops) {
    if (op.name == "qkv" || op.name == "attention_proj") op.frozen = !attention;
    if (op.name == "mlp_gate" || op.name == "mlp_up" || op.name == "mlp_down") op.frozen = !mlp;
    if (op.name == "bias_grads") {
      const double width = (attention ? qkv_width / t + h : 0) + (mlp ? (mlp_matrices(m) - 1) * ff / t + h : 0);
      if (width <= 0) continue;
      op.flops = tokens * width;
      op.memory_bytes = tokens * width * e;
    }
    if (op.name == "grad_accumulate") set_accumulate(op, layer_trainable_params(m, f, t), e);
    out.push_back(op);
    for (const LoraAdapter& a : adapters)
      if (op.name == anchor(a.target)) {
        auto lo = lora_forward_ops(a, f, tokens, e);
        out.insert(out.end(), lo.begin(), lo.end());
      }
  }
  ops = std::move(out);
}

void finetune_embedding_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape) {
  if (!active(shape) || base_trains(m, *shape.finetune, BasePart::embedding)) return;
  // Token ids need no gradient: with the tables frozen nothing before the first layer runs backward.
  std::vector<LayerOp> out;
  for (LayerOp& op : ops) {
    if (op.name == "grad_accumulate") continue;
    op.backward_bytes = 0;
    out.push_back(op);
  }
  ops = std::move(out);
}

void finetune_head_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape) {
  if (!active(shape)) return;
  const FinetuneSpec& f = *shape.finetune;
  const double t = std::max(1, shape.tp), e = bytes_of(shape.dtype);
  const double tokens = double(shape.micro_batch) * m.seq_len;
  const bool head = base_trains(m, f, BasePart::head);
  const double trainable = (head ? double(m.vocab) / t * m.hidden : 0) +
                           (base_trains(m, f, BasePart::norm) ? norm_params(m) : 0) + head_adapter_params(m, f);
  std::vector<LayerOp> out;
  for (LayerOp& op : ops) {
    if (op.name == "logits") op.frozen = !head;
    if (op.name == "grad_accumulate") {
      if (trainable <= 0) continue;
      set_accumulate(op, trainable, e);
    }
    out.push_back(op);
    if (op.name == "logits" && head_adapter_params(m, f) > 0) {
      auto lo = lora_forward_ops({LoraTarget::lm_head, double(m.hidden), double(m.vocab)}, f, tokens, e);
      for (LayerOp& l : lo) l.in_layer = false;  // the head is not recomputed
      out.insert(out.end(), lo.begin(), lo.end());
    }
  }
  ops = std::move(out);
}

double lora_activation_bytes_per_layer(const ModelSpec& m, const FinetuneSpec& f, int micro_batch, Dtype dtype) {
  const double tokens = double(micro_batch) * m.seq_len, e = bytes_of(dtype);
  double bytes = 0;
  for (const LoraAdapter& a : layer_adapters(m, f)) {
    bytes += tokens * f.rank * e;                           // A's output, B's input
    if (f.dropout > 0) bytes += tokens * a.in * (e + 1);    // the dropped copy of x and its mask
  }
  return bytes;
}

}  // namespace dssim
