// Transformer model math. Sources:
//  [M]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
//       Megatron-LM", arXiv:2104.04473: eq. 2 (parameters), eq. 3 (FLOPs with full recompute),
//       appendix (FLOPs per layer: 24 B s h^2 + 4 B s^2 h forward).
//  [K]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
//       arXiv:2205.05198: op list of a layer, selective recompute = the attention core.
//  [DS] DeepSpeed-MoE (Rajbhandari et al. 2022, arXiv:2201.05596) and deepspeed/moe/sharded_moe.py:
//       top-k gating, capacity = capacity_factor * tokens * k / experts, tokens dropped across TP.
//  [L]  Llama-shaped layers: Touvron et al. 2023 (arXiv:2302.13971, section 2.2: RMSNorm pre-
//       normalisation, SwiGLU, rotary embeddings, no biases), Shazeer 2020 (arXiv:2002.05202:
//       FFN_SwiGLU = (Swish(x W) * x V) W2, three matrices), Ainslie et al. 2023 (arXiv:2305.13245:
//       grouped-query attention, kv_heads key/value heads shared by heads / kv_heads queries), Su
//       et al. 2021 (arXiv:2104.09864: rotary positions, no position table), Llama Team 2024
//       (arXiv:2407.21783, Table 3: the Llama 3 shapes).
#include "core/model.hpp"

#include "core/finetune.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace dssim {

int ffn_hidden_of(const ModelSpec& m) { return m.ffn_hidden > 0 ? m.ffn_hidden : 4 * m.hidden; }
int kv_heads_of(const ModelSpec& m) { return m.kv_heads_or_heads(); }
// [L] GQA: k and v each project to kv_heads heads of head_dim = h / heads.
double kv_width(const ModelSpec& m) {
  if (m.heads <= 0) return m.hidden;
  return static_cast<double>(kv_heads_of(m)) * (m.hidden / m.heads);
}
int mlp_matrices(const ModelSpec& m) { return m.swiglu ? 3 : 2; }

int64_t ModelSpec::expert_capacity(int64_t tokens) const {
  // deepspeed/moe/sharded_moe.py _capacity: ceil(tokens / experts * capacity_factor * k), at
  // least min_capacity (top2gating passes capacity_factor * 2).
  if (!is_moe()) return 0;
  const double c = std::ceil(double(tokens) / double(experts) * capacity_factor * double(top_k));
  return std::max<int64_t>(int64_t(c), min_capacity);
}

double moe_routed_slots(const ModelSpec& m, double tokens) {
  if (!m.is_moe()) return 0;
  if (m.drop_tokens) return double(m.experts) * double(m.expert_capacity(int64_t(std::llround(tokens))));
  return tokens * m.top_k * m.capacity_factor;
}

const char* to_string(ModelSpec::NoisyGate g) {
  switch (g) {
    case ModelSpec::NoisyGate::none: return "none";
    case ModelSpec::NoisyGate::jitter: return "jitter";
    case ModelSpec::NoisyGate::rsample: return "rsample";
  }
  return "none";
}

const char* to_string(ModelSpec::CrossEntropy c) {
  switch (c) {
    case ModelSpec::CrossEntropy::unfused: return "unfused";
    case ModelSpec::CrossEntropy::fused: return "fused";
    case ModelSpec::CrossEntropy::fused_linear: return "fused_linear";
  }
  return "unfused";
}

bool is_moe_layer(const ModelSpec& m, int layer) {
  if (!m.is_moe()) return false;
  const int every = std::max(1, m.moe_every);
  return layer % every == every - 1;  // moe_every = 2: layers 1, 3, 5, ... (count = layers / 2)
}

// Generalised Megatron eq. 2 per layer: attention QKV (3h^2 + 3h) + projection (h^2 + h) = 4h^2 + 4h;
// MLP up (h ffn + ffn) + down (ffn h + h) = 2 h ffn + ffn + h; two LayerNorms (gain + bias) = 4h.
// ffn = 4h gives 12h^2 + 13h. [L] With kv = kv_width: q, o h^2 each, k, v h kv each (+ biases
// h + 2 kv + h when model.bias); SwiGLU 3 h ffn (+ 2 ffn + h); RMSNorm h per norm.
double dense_layer_params(const ModelSpec& m) {
  return attention_params(m) + expert_mlp_params(m) + 2 * norm_params(m);
}

double attention_params(const ModelSpec& m) {
  const double h = m.hidden, kv = kv_width(m);
  return 2 * h * h + 2 * h * kv + (m.bias ? 2 * h + 2 * kv : 0.0);
}

double norm_params(const ModelSpec& m) { return m.rmsnorm ? m.hidden : 2.0 * m.hidden; }

double expert_mlp_params(const ModelSpec& m) {
  const double h = m.hidden, f = ffn_hidden_of(m);
  const int mats = mlp_matrices(m);
  return mats * h * f + (m.bias ? (mats - 1) * f + h : 0.0);
}

// Word embedding V x h plus learned positions s x h [M eq. 2 term (V+s)/(12lh)]; rotary positions
// have no table [L].
double embedding_params(const ModelSpec& m) {
  return (static_cast<double>(m.vocab) + (m.rotary ? 0 : m.seq_len)) * m.hidden;
}

// [M] eq. 2 = 12 l h^2 + 13 l h + (V + s) h; plus the final LayerNorm (2h, which eq. 2 omits),
// an untied output layer (V h) when embeddings are not tied, and for each MoE layer the extra
// experts' MLPs and the gate (h x experts, no bias) [DS].
double parameter_count(const ModelSpec& m) {
  const double h = m.hidden;
  double p = m.layers * dense_layer_params(m) + embedding_params(m) + norm_params(m);
  if (!m.tied_embeddings) p += static_cast<double>(m.vocab) * h;
  if (m.is_moe())
    p += m.moe_layers() * ((m.experts - 1) * expert_mlp_params(m) + h * m.experts);
  return p;
}

// Parameters one token passes through: each MoE layer's top_k experts instead of all of them
// (Mixtral's "active parameters", Jiang et al. 2024 section 2).
double active_parameter_count(const ModelSpec& m) {
  if (!m.is_moe()) return parameter_count(m);
  return parameter_count(m) - m.moe_layers() * (m.experts - m.top_k) * expert_mlp_params(m);
}

namespace {

// Forward GEMM FLOPs of one layer for one sequence; `expert_token_factor` multiplies the MLP work of
// a MoE layer (top_k for model FLOPs, top_k * capacity_factor for what the GPUs execute).
double layer_flops(const ModelSpec& m, bool moe_layer, double expert_token_factor) {
  const double s = m.seq_len, h = m.hidden, f = ffn_hidden_of(m), kv = kv_width(m);
  // QKV + projection: q and o h x h, k and v h x kv [L] (3h^2 + h^2 without GQA).
  const double attention_linear = 2 * s * (2 * h * h + 2 * h * kv);
  // QK^T and attention over V: every query head against its group's k / v, so GQA leaves them
  // at 2 s^2 h each.
  const double attention_core = 2 * 2 * s * s * h;
  double mlp = 2 * s * mlp_matrices(m) * h * f;  // up, down (+ gate with SwiGLU)
  if (moe_layer) mlp = expert_token_factor * mlp + 2 * s * h * m.experts;  // experts + gate
  return attention_linear + attention_core + mlp;
}

double attention_core_flops_per_sequence(const ModelSpec& m) {
  const double s = m.seq_len, h = m.hidden;
  return 4 * s * s * h;
}

double layers_forward_flops(const ModelSpec& m, bool hardware) {
  double total = 0;
  for (int i = 0; i < m.layers; ++i) {
    const bool moe = is_moe_layer(m, i);
    total += layer_flops(m, moe, hardware ? m.top_k * m.capacity_factor : m.top_k);
  }
  return total;
}

}  // namespace

double layer_forward_flops_per_sequence(const ModelSpec& m, bool moe_layer) {
  return layer_flops(m, moe_layer, m.top_k);
}

// Logits GEMM 2 s h V per sequence [M appendix].
double head_forward_flops_per_sequence(const ModelSpec& m) {
  return 2.0 * m.seq_len * m.hidden * m.vocab;
}

// Forward + backward = 3 x forward [M]: 72 B s l h^2 (1 + s/(6h) + V/(12 h l)) for dense, ffn = 4h.
double model_flops_per_iteration(const ModelSpec& m, double global_batch) {
  return 3 * global_batch * (layers_forward_flops(m, false) + head_forward_flops_per_sequence(m));
}

// Full recompute re-runs every layer's forward once (not the head): 4 x layers + 3 x head, which is
// [M] eq. 3, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). Selective recompute re-runs the attention core
// [K section 5]. MoE layers execute capacity-padded expert batches (top_k * capacity_factor) [DS].
double hardware_flops_per_iteration(const ModelSpec& m, double global_batch, Recompute r) {
  const double layers = layers_forward_flops(m, true);
  const double head = head_forward_flops_per_sequence(m);
  double per_sequence = 3 * (layers + head);
  if (r == Recompute::full) per_sequence += layers;
  if (r == Recompute::selective) per_sequence += m.layers * attention_core_flops_per_sequence(m);
  if (r == Recompute::selective_op) {
    // The recomputed matmuls of op-level SAC (k, the attention output projection, SwiGLU's up or
    // GeLU's down; an unfused attention core too), per sequence; dense layers' shapes.
    const double s = m.seq_len, h = m.hidden, f = ffn_hidden_of(m);
    double gemm = 2 * s * h * kv_width(m) + 2 * s * h * h + 2 * s * h * f;
    if (!m.flash_attention) gemm += attention_core_flops_per_sequence(m);
    per_sequence += m.layers * gemm;
  }
  return global_batch * per_sequence;
}

namespace {

// Approximate FLOPs per element of the memory-bound kernels (they never bound the time; the bytes do).
constexpr double kLayerNormFlopsPerElement = 8;  // mean, variance, normalise, gain, bias
constexpr double kSoftmaxFlopsPerElement = 5;    // max, subtract, exp, sum, divide
constexpr double kGeluFlopsPerElement = 8;       // tanh approximation
constexpr double kSwigluFlopsPerElement = 6;     // silu(g) = g / (1 + exp(-g)), times u
constexpr double kRmsNormFlopsPerElement = 5;    // square, sum, scale by 1/rms, gain
constexpr double kRotaryFlopsPerElement = 3;     // x cos + rotate_half(x) sin
constexpr double kMaskBytesPerElement = 1;       // dropout masks are kept as bytes [K section 4.1]

LayerOp gemm_op(const std::string& name, double batch, double m, double n, double k, double e,
                bool attention_core = false) {
  LayerOp op;
  op.name = name;
  op.gemm = true;
  op.attention_core = attention_core;
  op.m = m, op.n = n, op.k = k, op.batch = batch;
  op.flops = 2 * batch * m * n * k;
  op.memory_bytes = batch * (m * k + k * n + m * n) * e;  // A, B read once, C written once
  return op;
}

LayerOp elementwise_op(const std::string& name, double elements, double flops_per_element,
                       double bytes_per_element, bool attention_core = false) {
  LayerOp op;
  op.name = name;
  op.attention_core = attention_core;
  op.flops = elements * flops_per_element;
  op.memory_bytes = elements * bytes_per_element;
  return op;
}

LayerOp layernorm_op(const std::string& name, double tokens, double h, double e) {
  LayerOp op = elementwise_op(name, tokens * h, kLayerNormFlopsPerElement, 2 * e);  // read x, write y
  op.memory_bytes += 2 * h * e;                                                      // gain, bias
  // PyTorch's backward: dx from (dy, x) in one kernel, then dgain / dbias re-reading dy and x.
  op.backward_bytes = 5 * e * tokens * h;
  op.backward_kernel = "layer_norm_backward";
  return op;
}

// Eager PyTorch (model.elementwise: eager, ModelSpec::eager_elementwise): the composite ops of a
// hand-written Llama block, HBM bytes per element summed over their kernels, each kernel reading
// its inputs and writing its output once. Read in torchtitan at 9dec370 (models/norms.py RMSNorm,
// models/llama/model.py apply_rotary_emb, repeat_kv, FeedForward); backward kernels as autograd
// runs them (PyTorch tools/autograd/derivatives.yaml: mul, pow, mean, _to_copy, view_as_complex).
// e is the activations' width; the fp32 casts (x.float(), type_as) are no-ops in fp32 training.
double eager_cast_bytes(double e) { return e == 4 ? 0 : e + 4; }  // read e, write fp32 (or back)
// RMSNorm forward: x.float(), pow(2) 8, mean(-1) 4, x * rsqrt(...) 8, type_as(x), * weight 2e.
double eager_rmsnorm_forward_bytes(double e) { return 2 * eager_cast_bytes(e) + 20 + 2 * e; }
// RMSNorm backward: * weight (dy w 2e; dw = sum(dy y) 3e + e), type_as's cast, x * r (dy r 8;
// dr = sum(dy x) 12 + 4), mean's expand / h 4, pow's 2 x^1 dy (x.pow(1) 8, * 2 8, * dy 12), the two
// gradients of x.float() summed 12, x.float()'s cast: 6e + 2 casts + 68 (92 in bf16).
double eager_rmsnorm_backward_bytes(double e) { return 6 * e + 2 * eager_cast_bytes(e) + 68; }
// Rotary on q and k: float(), the complex multiply by freqs_cis (read and write complex64: 4 + 4
// per real element), type_as; backward the same three kernels in reverse.
double eager_rotary_bytes(double e) { return 2 * eager_cast_bytes(e) + 8; }

// The model's norm: LayerNorm ("layernorm_<suffix>"), or RMSNorm ("rmsnorm_<suffix>": the gain
// only, no mean; the same bytes per element forward and backward, priced by the layer_norm rows).
// Eager RMSNorm: its kernels' bytes, priced by the HBM roofline (no fused-kernel profile row).
LayerOp norm_op(const ModelSpec& m, const std::string& prefix, const std::string& suffix, double tokens,
                double h, double e) {
  if (!m.rmsnorm) return layernorm_op(prefix + "layernorm" + suffix, tokens, h, e);
  LayerOp op = elementwise_op(prefix + "rmsnorm" + suffix, tokens * h, kRmsNormFlopsPerElement, 2 * e);
  op.memory_bytes += h * e;  // gain
  if (m.eager_elementwise) {
    op.memory_bytes = eager_rmsnorm_forward_bytes(e) * tokens * h + h * e;
    op.backward_bytes = eager_rmsnorm_backward_bytes(e) * tokens * h;
    return op;
  }
  op.kernel = "layer_norm";
  op.backward_bytes = 5 * e * tokens * h;
  op.backward_kernel = "layer_norm_backward";
  return op;
}

// SwiGLU's elementwise silu(gate) * up over `elements` outputs [L]: reads both GEMM outputs, writes
// one; backward reads dy, gate, up and writes dgate, dup. Priced by the gelu rows (an activation
// kernel of the same kind).
// Eager (F.silu(w1(x)) * w3(x)): silu 2e and mul 3e forward; backward the mul's two products
// (dy up, dy silu(gate): 3e each) and silu's backward (dy, gate -> dgate: 3e).
LayerOp swiglu_op(double elements, double e, bool eager = false) {
  LayerOp op = elementwise_op("swiglu", elements, kSwigluFlopsPerElement, 3 * e);
  if (eager) {
    op.memory_bytes = 5 * e * elements;
    op.backward_bytes = 9 * e * elements;
    return op;
  }
  op.kernel = "gelu";
  op.backward_bytes = 5 * e * elements;
  op.backward_kernel = "gelu_backward";
  return op;
}

// GELU (tanh) over `elements` outputs of the up-projection: read x, write y; backward reads dy and
// x, writes dx (kernel gelu_backward).
LayerOp gelu_op(double elements, double e) {
  LayerOp op = elementwise_op("gelu", elements, kGeluFlopsPerElement, 2 * e);
  op.backward_bytes = 3 * e * elements;
  op.backward_kernel = "gelu_backward";
  return op;
}

// The residual add: read the branch and the residual, write the sum. Backward: the residual's
// gradient summed with the branch's at the fork (3 bytes per element).
LayerOp residual_add_op(const std::string& name, double elements, double e) {
  LayerOp op = elementwise_op(name, elements, 1, 3 * e);
  op.backward_bytes = 3 * e * elements;
  return op;
}

// Backward-only work of a layer: the bias gradients (dy summed over the tokens, one reduction per
// biased linear; `bias_width` = the widths' sum), and adding the layer's weight gradients into the
// gradient buffer (read it and the new gradient, write it: 3 g bytes per parameter), as PyTorch's
// AccumulateGrad does into the flat buffer's views (DeepSpeed copies into its bucket instead).
LayerOp bias_grads_op(double tokens, double bias_width, double e) {
  LayerOp op = elementwise_op("bias_grads", tokens * bias_width, 1, e);
  op.kernel = "bias_grad";
  op.backward_only = true;
  return op;
}
LayerOp grad_accumulate_op(double params, double e) {
  LayerOp op = elementwise_op("grad_accumulate", params, 1, 3 * e);
  op.backward_only = true;
  return op;
}

// dropout(x) + residual: read x and the residual, write the sum and the mask; without dropout
// the residual add alone (no mask).
// Backward: the residual's gradient is summed with the branch's at the fork (3 bytes per element),
// and dropout's backward rescales by the mask (read the gradient and mask, write one).
LayerOp dropout_residual_op(const std::string& name, double tokens, double h, double e, bool dropout) {
  if (!dropout) return residual_add_op("residual" + name.substr(name.size() - 2), tokens * h, e);
  LayerOp op = elementwise_op(name, tokens * h, 2, 3 * e + kMaskBytesPerElement);
  op.backward_bytes = (5 * e + kMaskBytesPerElement) * tokens * h;
  return op;
}

// model.gemm_epilogues as dssim's torch engine runs the block on GPUs (backends/torch/
// gemm_epilogues.hpp, gpt.cpp block_forward): the epilogues set on the block's GEMMs, the ops they
// replace taken out of the list. Without tensor parallelism mlp_up's GEMM writes GELU's input and
// output (gelu_aux_bias), mlp_down's and attention_proj's add the bias and the residual
// (bias_residual: the residual ops keep their backward only), mlp_down's dgrad applies GELU's
// derivative (dgelu), and every trained biased linear's wgrad sums its bias gradient (bgradb). With
// tensor parallelism the row-parallel layers' biases are added after the reduction and the
// residuals stay separate adds: only mlp_up's gelu_aux_bias, the dgelu and qkv's and mlp_up's
// bgradb apply. A MoE layer's experts run ATen's ops (their gelu and bias sums stay); with dropout
// the residual keeps its kernel. Runs after finetune_layer_ops (frozen linears have no wgrad).
// Dense q, k, v (three GEMMs into one [3, b, s, a, d] tensor): the flash kernels' dq, dk, dv come
// back dense and feed the QKV backward as they are, so of the layout copies only the attention
// output's gradient copy (h/t wide, the projection's input) is left.
void apply_gemm_epilogues(std::vector<LayerOp>& ops, double h, double e, bool tp, bool dropout, bool flash) {
  const auto find = [&](const std::string& name) -> LayerOp* {
    for (LayerOp& op : ops)
      if (op.name == name && (!op.gemm || op.batch == 1)) return &op;
    return nullptr;
  };
  double fused_bias_elements = 0;  // the bias gradients the wgrad epilogues sum
  // Parameters whose gradients the wgrad GEMMs (beta 1) and the bias kernel add into the gradient
  // buffer themselves (the engine's grad_in_place): no AccumulateGrad for them.
  double in_place_params = 0;
  // `weight_in_place`: the linear runs as the engine's autograd function (under TP the projection is
  // ATen's linear, and the row-parallel biases are added after the reduction).
  const auto set = [&](LayerOp* op, const char* forward, const char* dgrad, const char* wgrad, bool weight_in_place) {
    if (!op) return;
    if (!op->frozen && weight_in_place) in_place_params += op->n * op->k + (*wgrad ? op->n : 0);
    // The forward's output [m x n] (GELU's input written, the residual read), the dgrad's output
    // [m x k] (GELU's input read by dgelu).
    const double out = op->m * op->n;
    if (*forward) op->epilogue = forward, op->epilogue_bytes = e * out, op->memory_bytes += e * out;
    if (*dgrad) op->dgrad_epilogue = dgrad, op->dgrad_epilogue_bytes = e * op->m * op->k;
    if (*wgrad && !op->frozen) op->wgrad_epilogue = wgrad, fused_bias_elements += out;
  };
  LayerOp* up = find("mlp_up");
  const bool dense_mlp = up && find("gelu") && !find("moe_combine");
  const bool residual = !tp && !dropout;
  set(find("qkv"), "", "", "bgradb", true);
  set(find("attention_proj"), residual ? "bias_residual" : "", "", tp ? "" : "bgradb", !tp);
  if (dense_mlp) {
    set(up, "gelu_aux_bias", "", "bgradb", true);
    set(find("mlp_down"), residual ? "bias_residual" : "", "dgelu", tp ? "" : "bgradb", true);
  }
  // Each norm's backward adds the gradient of the residual that forks with it (the engine's
  // layer_norm_residual, without TP): the fork's sum is gone, the norm's backward reads the
  // residual's gradient as well (6 e an element where ATen's backward moved 5 e, its own profile
  // row), and its gain and bias are added into the gradient buffer in place.
  if (residual)
    for (LayerOp& op : ops)
      if ((op.name == "layernorm_1" || op.name == "layernorm_2") && op.backward_bytes > 0) {
        const double elements = op.flops / kLayerNormFlopsPerElement;  // layernorm_op's T h
        op.backward_bytes = 6 * e * elements;
        op.backward_kernel = "layer_norm_residual_backward";
        in_place_params += 2 * h;  // gain and bias
      }
  const LayerOp* proj = find("attention_proj");
  std::vector<LayerOp> out;
  for (LayerOp& op : ops) {
    if (dense_mlp && op.name == "gelu") continue;
    if (residual && (op.name == "residual_1" || (dense_mlp && op.name == "residual_2"))) continue;  // in the norms
    if (residual && op.name == "residual_2") op.backward_bytes = 0;  // MoE's add: its fork's sum is in the norm
    if (flash && proj && op.name == "attention_layout_copies") op.memory_bytes = 2 * e * proj->m * proj->k;
    if (op.name == "grad_accumulate") {  // what is left for AccumulateGrad: norms, TP's late biases
      const double params = op.flops - in_place_params;
      if (params <= 1e-9 * op.flops) continue;
      op.flops = params;
      op.memory_bytes = 3 * e * params;
    }
    if (op.name == "bias_grads") {  // the biases no wgrad epilogue sums (1 FLOP and e bytes per element)
      const double elements = op.flops - fused_bias_elements;
      if (elements <= 1e-9 * op.flops) continue;
      op.flops = elements;
      op.memory_bytes = e * elements;
    }
    out.push_back(op);
  }
  ops = std::move(out);
}

}  // namespace

// Per-GPU forward ops of one layer [K figure 2 / section 4]. Tokens T = b s. The GEMMs and the
// attention core run on T tokens with a/t heads; LayerNorm, dropout and residual run on T tokens
// (replicated across the TP group) or on T/t tokens with sequence parallelism [K section 4.2.2].
std::vector<LayerOp> layer_forward_ops(const ModelSpec& m, const LayerShape& shape) {
  const double b = shape.micro_batch, s = m.seq_len, h = m.hidden, f = ffn_hidden_of(m);
  const double t = std::max(1, shape.tp);
  const double e = bytes_of(shape.dtype);
  const double tokens = b * s;
  const double norm_tokens = shape.sequence_parallel ? tokens / t : tokens;
  const double heads = m.heads > 0 ? m.heads : 1;
  const double head_dim = h / heads;
  const double local_heads = heads / t;
  const double score_elements = b * local_heads * s * s;
  const double kv = kv_width(m);
  const double qkv_width = h + 2 * kv;  // 3h without GQA

  std::vector<LayerOp> ops;
  ops.push_back(norm_op(m, "", "_1", norm_tokens, h, e));
  ops.push_back(gemm_op("qkv", 1, tokens, qkv_width / t, h, e));
  ops.back().op_sac_recompute = kv / qkv_width;  // op-level SAC: q, v saved, k recomputed
  if (m.rotary) {
    // [L] rotary embedding applied to q and k (h + kv wide per token, TP-split) with the s x
    // head_dim cos / sin tables; backward rotates the gradients back (the same bytes).
    const double elements = tokens * (h + kv) / t;
    LayerOp rope = elementwise_op("rotary", elements, kRotaryFlopsPerElement,
                                  m.eager_elementwise ? eager_rotary_bytes(e) : 2 * e);
    rope.memory_bytes += 2 * s * head_dim * e;
    rope.backward_bytes = rope.memory_bytes;
    ops.push_back(rope);
  }
  if (m.eager_elementwise && kv < h) {
    // Eager GQA (torchtitan repeat_kv): k and v expanded to every query head and reshaped, a copy
    // (read kv wide, write h wide, each); backward sums each group's gradients (read h, write kv).
    LayerOp repeat = elementwise_op("repeat_kv", 2 * tokens * (kv + h) / t, 0, e);
    repeat.backward_bytes = repeat.memory_bytes;
    ops.push_back(repeat);
  }
  ops.push_back(gemm_op("attention_scores", b * local_heads, s, s, head_dim, e, true));
  ops.push_back(elementwise_op("softmax", score_elements, kSoftmaxFlopsPerElement, 2 * e, true));
  if (m.has_dropout())
    ops.push_back(elementwise_op("attention_dropout", score_elements, 1, 2 * e + kMaskBytesPerElement, true));
  ops.push_back(gemm_op("attention_over_v", b * local_heads, s, head_dim, s, e, true));
  // Op-level SAC saves SDPA's output (flash); an unfused core's batched GEMMs are recomputed.
  if (m.flash_attention)
    for (LayerOp& op : ops)
      if (op.attention_core) op.op_sac_recompute = 0;
  ops.push_back(gemm_op("attention_proj", 1, tokens, h, h / t, e));
  // Backward-only layout copies around the attention core, read + write. Fused attention as
  // dssim's engine runs it (PyTorch SDPA): the output's gradient made contiguous for the attention
  // backward (h/t wide), dq, dk, dv stacked into the QKV gradient and that permuted gradient made
  // contiguous for the QKV linear (3h/t wide each). Megatron's unfused attention: dq, dk, dv
  // concatenated into the QKV gradient (3h/t) and the context gradient permuted back (h/t).
  const double layout_width = m.flash_attention ? h + 2 * qkv_width : qkv_width + h;
  LayerOp layout = elementwise_op("attention_layout_copies", tokens * layout_width / t, 0, 2 * e);
  layout.kernel = "attention_layout_copies";  // strided copies: their own profile row
  layout.backward_only = true;
  ops.push_back(layout);
  ops.push_back(dropout_residual_op("dropout_residual_1", norm_tokens, h, e, m.has_dropout()));
  ops.push_back(norm_op(m, "", "_2", norm_tokens, h, e));

  if (!shape.moe || !m.is_moe()) {
    if (m.swiglu) {
      // [L] gate and up projections (two column-parallel GEMMs, as Llama's w1 / w3), silu(gate) * up.
      ops.push_back(gemm_op("mlp_gate", 1, tokens, f / t, h, e));
      ops.back().op_sac_recompute = 0;  // op-level SAC: the 5th matmul (w1), saved
      ops.push_back(gemm_op("mlp_up", 1, tokens, f / t, h, e));
      ops.push_back(swiglu_op(tokens * f / t, e, m.eager_elementwise));
    } else {
      ops.push_back(gemm_op("mlp_up", 1, tokens, f / t, h, e));
      ops.back().op_sac_recompute = 0;  // op-level SAC: the 5th matmul, saved
      ops.push_back(gelu_op(tokens * f / t, e));
    }
    ops.push_back(gemm_op("mlp_down", 1, tokens, h, f / t, e));
    if (m.swiglu) ops.back().op_sac_recompute = 0;  // the 7th matmul (w2), saved; GeLU's 6th is recomputed
  } else {
    // [DS] The gate is replicated in the TP group; DeepSpeed drops the TP-duplicated tokens before
    // the all-to-all, so this GPU's share is T/t tokens, each sent to top_k experts, padded to the
    // capacity factor. After the all-to-all the E/ep local experts hold those T k c / t tokens in
    // aggregate (ep * capacity each); experts are not TP-split (enable_expert_tensor_parallelism off).
    const double experts = m.experts;
    const double ep = std::max(1, shape.ep);
    const double local_experts = std::max(1.0, experts / ep);
    const double routed_tokens = moe_routed_slots(m, tokens) / t;
    const double tokens_per_expert = routed_tokens / local_experts;
    ops.push_back(gemm_op("moe_gate", 1, norm_tokens, experts, h, e));
    // The routing (DeepSpeed's TopKGate after its GEMM: the tokens cast to fp32, softmax, top-k,
    // capacity positions by cumsum, combine weights, l_aux) and the dispatch / combine copies,
    // each priced by the device profile's row of that name where measured (dssim calibrate's moe
    // family, the engine's own functions); byte conventions: routing T h (e + 4) + 32 T E (fp32
    // [T, E] arrays), dispatch and combine 2 e x slots x h, their backwards likewise.
    LayerOp routing = elementwise_op("moe_routing", norm_tokens * experts, kSoftmaxFlopsPerElement, 0);
    routing.memory_bytes = norm_tokens * h * (e + 4) + 32 * norm_tokens * experts;
    routing.kernel = "moe_routing";
    routing.backward_kernel = "moe_routing_backward";
    routing.backward_bytes = routing.memory_bytes;
    ops.push_back(routing);
    LayerOp dispatch = elementwise_op("moe_dispatch", routed_tokens * h, 0, 2 * e);  // scatter to capacity slots
    dispatch.kernel = "moe_dispatch";
    dispatch.backward_kernel = "moe_dispatch_backward";
    dispatch.backward_bytes = dispatch.memory_bytes;
    ops.push_back(dispatch);
    if (m.swiglu) {
      ops.push_back(gemm_op("mlp_gate", local_experts, tokens_per_expert, f, h, e));
      ops.push_back(gemm_op("mlp_up", local_experts, tokens_per_expert, f, h, e));
      ops.push_back(swiglu_op(routed_tokens * f, e, m.eager_elementwise));
    } else {
      ops.push_back(gemm_op("mlp_up", local_experts, tokens_per_expert, f, h, e));
      ops.push_back(gelu_op(routed_tokens * f, e));
    }
    ops.push_back(gemm_op("mlp_down", local_experts, tokens_per_expert, h, f, e));
    LayerOp combine = elementwise_op("moe_combine", routed_tokens * h, 2, 2 * e);  // weighted gather back
    combine.kernel = "moe_combine";
    combine.backward_kernel = "moe_combine_backward";
    combine.backward_bytes = combine.memory_bytes;
    ops.push_back(combine);
  }
  ops.push_back(dropout_residual_op("dropout_residual_2", norm_tokens, h, e, m.has_dropout()));
  // Bias gradients of qkv (3h/t), the projection (h), mlp_up (f/t; + mlp_gate f/t), mlp_down (h),
  // when the linears have biases; the layer's weight gradients into the buffer.
  if (m.bias) ops.push_back(bias_grads_op(tokens, qkv_width / t + h + (mlp_matrices(m) - 1) * f / t + h, e));
  ops.push_back(grad_accumulate_op(dense_layer_params(m) / t, e));
  for (auto& op : ops) op.in_layer = true;
  finetune_layer_ops(ops, m, shape);
  // LoRA-adapted linears run ATen's ops in the engine: the model keeps the block unfused then.
  if (m.block_epilogues() && !(shape.finetune && shape.finetune->lora()))
    apply_gemm_epilogues(ops, h, e, shape.tp > 1, m.has_dropout(), m.flash_attention);
  return ops;
}

// Vocab-parallel embedding [M]: each TP rank gathers the rows of its vocab shard (memory-bound),
// adds positions, and the embedding dropout runs on T (or T/t with SP) tokens.
std::vector<LayerOp> embedding_forward_ops(const ModelSpec& m, const LayerShape& shape) {
  const double b = shape.micro_batch, s = m.seq_len, h = m.hidden;
  const double t = std::max(1, shape.tp);
  const double e = bytes_of(shape.dtype);
  const double tokens = b * s;
  const double norm_tokens = shape.sequence_parallel ? tokens / t : tokens;
  std::vector<LayerOp> ops;
  // read token ids (8 B), the gathered word rows and position rows, write the sum (rotary: no
  // position rows, the word rows copied out)
  const double tables = m.rotary ? 1 : 2;
  LayerOp lookup = elementwise_op("embedding_lookup", tokens * h, 1, (tables + 1) * e);
  lookup.memory_bytes += tokens * 8;
  // Backward: the incoming gradient read for the word and position tables, the word table's
  // dense gradient zeroed and scattered into (PyTorch's embedding_dense_backward).
  lookup.backward_bytes = tables * e * tokens * h + 2 * e * m.vocab / t * h;
  lookup.backward_kernel = "embedding_backward";
  ops.push_back(lookup);
  if (m.has_dropout())
    ops.push_back(elementwise_op("embedding_dropout", norm_tokens * h, 1, 2 * e + kMaskBytesPerElement));
  ops.push_back(grad_accumulate_op(m.vocab / t * h + (m.rotary ? 0 : s * h), e));  // word and position tables
  finetune_embedding_ops(ops, m, shape);
  return ops;
}

// Final LayerNorm, logits GEMM 2 b s h V / t, vocab-parallel softmax cross-entropy in fp32
// (Megatron casts the logits to float: read 16-bit logits, write and re-read fp32 softmax).
std::vector<LayerOp> head_forward_ops(const ModelSpec& m, const LayerShape& shape) {
  const double b = shape.micro_batch, s = m.seq_len, h = m.hidden, v = m.vocab;
  const double t = std::max(1, shape.tp);
  const double e = bytes_of(shape.dtype);
  const double tokens = b * s;
  const double norm_tokens = shape.sequence_parallel ? tokens / t : tokens;
  std::vector<LayerOp> ops;
  ops.push_back(norm_op(m, "final_", "", norm_tokens, h, e));
  if (m.fused_cross_entropy()) {
    // Fused linear cross-entropy (ModelSpec::fused_cross_entropy), chunk by chunk in the forward:
    // the logits GEMM, one kernel from the 16-bit logits to fp32 probabilities (read e, write 4),
    // the gradient (softmax - one-hot) / tokens cast to 16 bits (read 4, write e), and the head's
    // input and weight gradient GEMMs. Backward only scales the two gradients by the incoming one.
    LayerOp logits = gemm_op("logits", 1, tokens, v / t, h, e);
    logits.grads_in_forward = true;
    ops.push_back(logits);
    LayerOp ce = elementwise_op("fused_cross_entropy", tokens * v / t, kSoftmaxFlopsPerElement + 2, 8 + 2 * e);
    ce.kernel = "fused_cross_entropy";
    ce.grads_in_forward = true;
    ops.push_back(ce);
    LayerOp scale = elementwise_op("fused_cross_entropy_scale", tokens * h + v / t * h, 1, 2 * e);
    scale.backward_only = true;
    ops.push_back(scale);
    ops.push_back(grad_accumulate_op(v / t * h + norm_params(m), e));
    finetune_head_ops(ops, m, shape);
    return ops;
  }
  ops.push_back(gemm_op("logits", 1, tokens, v / t, h, e));
  if (m.cross_entropy == ModelSpec::CrossEntropy::fused) {
    // One kernel a pass on the 16-bit logits (flash-attn's CrossEntropyLoss, apex's xentropy):
    // forward reads each logit once (max and log-sum-exp of a row, the loss), backward reads it
    // again and writes its 16-bit gradient, softmax - one-hot.
    LayerOp ce = elementwise_op("softmax_cross_entropy", tokens * v / t, kSoftmaxFlopsPerElement + 2, e);
    ce.backward_bytes = 2 * e * tokens * v / t;
    ops.push_back(ce);
    ops.push_back(grad_accumulate_op(v / t * h + norm_params(m), e));
    finetune_head_ops(ops, m, shape);
    return ops;
  }
  // PyTorch's cross-entropy on fp32 logits (dssim's engine): the cast (read 16-bit, write fp32),
  // log-softmax (two reads for max and sum, one write); backward: the nll gradient zero-filled,
  // log-softmax's backward (two reads of the gradient, one of its output, one write), cast back.
  LayerOp ce = elementwise_op("softmax_cross_entropy", tokens * v / t, kSoftmaxFlopsPerElement + 2, e + 16);
  ce.kernel = "cross_entropy";
  ce.backward_bytes = (24 + e) * tokens * v / t;
  ce.backward_kernel = "cross_entropy_backward";
  ops.push_back(ce);
  // The tied / untied output embedding's and final LayerNorm's weight gradients into the buffer.
  ops.push_back(grad_accumulate_op(v / t * h + norm_params(m), e));
  finetune_head_ops(ops, m, shape);
  return ops;
}

LayerOp epilogue_replaced_op(const std::string& epilogue, const LayerOp& gemm, double e) {
  const double out = gemm.batch * gemm.m * gemm.n;
  if (epilogue == "gelu_aux_bias") return gelu_op(out, e);
  if (epilogue == "dgelu") return gelu_op(gemm.batch * gemm.m * gemm.k, e);  // on the dgrad's output [m x k]
  if (epilogue == "bias_residual") return residual_add_op("residual", out, e);
  if (epilogue == "bgradb") return bias_grads_op(gemm.batch * gemm.m, gemm.n, e);
  throw std::invalid_argument("unknown GEMM epilogue '" + epilogue + "'");
}

LayerOp plain_gemm(const LayerOp& gemm) {
  LayerOp op = gemm;
  op.memory_bytes -= gemm.epilogue_bytes;
  op.epilogue.clear();
  op.dgrad_epilogue.clear();
  op.wgrad_epilogue.clear();
  op.epilogue_bytes = op.dgrad_epilogue_bytes = 0;
  return op;
}

OpsCost& OpsCost::operator+=(const OpsCost& o) {
  flops += o.flops;
  gemm_flops += o.gemm_flops;
  memory_bytes += o.memory_bytes;
  kernels += o.kernels;
  return *this;
}

OpsCost sum_cost(const std::vector<LayerOp>& ops) {
  OpsCost c;
  for (const auto& op : ops) {
    if (op.backward_only) continue;
    c.flops += op.flops;
    if (op.gemm) c.gemm_flops += op.flops;
    c.memory_bytes += op.memory_bytes;
    c.kernels += 1;
    if (op.grads_in_forward && op.gemm) {  // its dgrad (and wgrad) GEMMs run here too
      const double f = op.frozen ? 1 : 2;
      c.flops += f * op.flops;
      c.gemm_flops += f * op.flops;
      c.memory_bytes += f * op.memory_bytes;
      c.kernels += int(f);
    }
  }
  return c;
}

int64_t fused_cross_entropy_chunk_tokens(int64_t tokens, int64_t vocab_local) {
  constexpr double kChunkProbabilityBytes = 1024.0 * 1024.0 * 1024.0;
  if (tokens <= 0 || vocab_local <= 0) return std::max<int64_t>(tokens, 1);
  const int64_t chunks = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(4.0 * double(tokens) * double(vocab_local) / kChunkProbabilityBytes)));
  return (tokens + chunks - 1) / chunks;
}

// Backward: each GEMM becomes two (dgrad: dA = dC B^T, wgrad: dB = A^T dC), each reading two operands
// and writing one, so 2x FLOPs and 2x bytes; each memory-bound op moves its backward_bytes (the
// kernels PyTorch runs, see the op constructors; 2x the forward's where not given) and we count
// 2x its (small) FLOPs; backward-only ops (bias gradients, gradient accumulation) once.
OpsCost backward_cost(const std::vector<LayerOp>& forward_ops) {
  OpsCost c;
  for (const auto& op : forward_ops) {
    if (op.grads_in_forward) continue;  // computed in the forward (fused linear cross-entropy)
    if (op.host_seconds > 0) continue;  // host work, no kernel (DeviceModel prices its seconds)
    const double f = op.backward_only || op.frozen ? 1 : 2;  // a frozen weight: dgrad only
    c.flops += f * op.flops;
    if (op.gemm) c.gemm_flops += f * op.flops;
    c.memory_bytes += op.gemm ? f * (op.memory_bytes - op.epilogue_bytes) + op.dgrad_epilogue_bytes
                              : op.backward_memory_bytes();
    c.kernels += op.gemm ? int(f) : 1;
  }
  return c;
}

// Full recompute re-runs the whole forward; selective re-runs the attention core [K section 5].
OpsCost recompute_cost(const std::vector<LayerOp>& forward_ops, Recompute r) {
  if (r == Recompute::none) return {};
  if (r == Recompute::selective_op) {  // the layer's ops that op-level SAC does not save, in part
    std::vector<LayerOp> again;
    for (const auto& op : forward_ops)
      if (op.in_layer && !op.backward_only && op.op_sac_recompute > 0) {
        LayerOp part = op;
        part.flops *= op.op_sac_recompute;
        part.memory_bytes *= op.op_sac_recompute;
        again.push_back(part);
      }
    return sum_cost(again);
  }
  std::vector<LayerOp> again;  // full: the layers' forward (not the embedding's or the head's)
  for (const auto& op : forward_ops)
    if ((r == Recompute::full ? op.in_layer : op.attention_core) && !op.backward_only) again.push_back(op);
  return sum_cost(again);
}

}  // namespace dssim
