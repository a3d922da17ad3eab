// Transformer model math: parameter counts, FLOPs, and per-op cost of one layer.
// Formulas: Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473) eq. 2 and 3; Korthikanti et al.
// 2022 (arXiv:2205.05198) for activations (see memory.hpp).
#pragma once
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// Megatron eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)); MoE layers add (experts-1) MLPs
// plus the gate. Llama-shaped layers (ModelSpec kv_heads, swiglu, rmsnorm, rotary, bias) generalise
// each term; docs/scenario-format.md "Llama-shaped models" gives the formulas.
double parameter_count(const ModelSpec& m);
double active_parameter_count(const ModelSpec& m);    // MoE: top_k experts per MoE layer (= total for dense)
double dense_layer_params(const ModelSpec& m);        // 12h^2 + 13h (attention + MLP + 2 norms)
double attention_params(const ModelSpec& m);          // q, k, v, o: 2h^2 + 2 h kv_width (+ 2h + 2 kv_width biases)
double norm_params(const ModelSpec& m);               // one norm: 2h (LayerNorm), h (RMSNorm)
double expert_mlp_params(const ModelSpec& m);         // one expert's MLP: 2 h ffn + ffn + h (SwiGLU: 3 h ffn + 2 ffn + h; no biases: weights only)
double embedding_params(const ModelSpec& m);          // (V + s) h; rotary: V h
int ffn_hidden_of(const ModelSpec& m);                // ffn_hidden, or 4h when 0
int kv_heads_of(const ModelSpec& m);                  // kv_heads, or heads when 0
double kv_width(const ModelSpec& m);                  // kv_heads * head_dim (= h without GQA)
int mlp_matrices(const ModelSpec& m);                 // 2 (GELU: up, down), 3 (SwiGLU: gate, up, down)
bool is_moe_layer(const ModelSpec& m, int layer);
// Expert slots a MoE layer's dispatch buffer holds for `tokens` gated tokens: experts x
// expert_capacity (drop_tokens), or top_k x capacity_factor per token (the run-time capacity of
// drop_tokens false, estimated).
double moe_routed_slots(const ModelSpec& m, double tokens);     // 0-based; every moe_every-th layer (last of each group)
// Per-sequence forward FLOPs (2 per multiply-add) of one layer / of the LM head.
double layer_forward_flops_per_sequence(const ModelSpec& m, bool moe_layer);
double head_forward_flops_per_sequence(const ModelSpec& m);

// FLOPs of one iteration of `global_batch` sequences (all GPUs together).
// Model FLOPs: 72 B s l h^2 (1 + s/(6h) + V/(12 h l)) (fwd + bwd = 3 x forward); in general
// 3 B (l (2 s (2h^2 + 2 h kv_width) + 4 s^2 h + 2 s mlp_matrices h ffn) + 2 s h V) (GEMMs only).
double model_flops_per_iteration(const ModelSpec& m, double global_batch);
// Hardware FLOPs: what the GPUs execute, recompute included (full recompute: one more forward,
// Megatron's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); selective: the attention core again).
// MoE layers: model FLOPs count top_k experts per token; hardware FLOPs the capacity-padded
// top_k * capacity_factor expert slots DeepSpeed computes.
double hardware_flops_per_iteration(const ModelSpec& m, double global_batch, Recompute r);

// One kernel-level op of a layer's forward pass on one GPU.
struct LayerOp {
  std::string name;     // "qkv", "attention_scores", "softmax", "attention_over_v", "attention_proj",
                        // "mlp_up", "gelu", "mlp_down", "layernorm_1", "layernorm_2", "dropout", "residual", ...
  double flops = 0;
  double memory_bytes = 0;  // HBM bytes read + written
  bool gemm = false;        // runs on tensor cores as a GEMM
  bool attention_core = false;  // part of softmax(QK^T)V: what selective recompute recomputes
  // GEMM shape (per GPU, after the TP split) when gemm: C[m x n] = A[m x k] B[k x n], repeated
  // `batch` times (batched GEMMs: attention per sequence x local head, MoE per local expert).
  // flops == 2 * batch * m * n * k for every GEMM op.
  double m = 0, n = 0, k = 0;
  double batch = 1;
  // Memory-bound ops: the measured kernel (device profile `elementwise` row) that prices the
  // forward, when it is not the name's family (add / gelu / layer_norm); its backward's HBM bytes
  // (< 0: twice the forward's) and the row that prices them (empty: the forward's).
  std::string kernel;
  double backward_bytes = -1;
  std::string backward_kernel;
  // Runs in backward only (bias gradients, accumulation into the gradient buffer): no forward,
  // no recompute; its memory_bytes are its backward bytes.
  bool backward_only = false;
  bool in_layer = false;  // a transformer layer's (full recompute re-runs these, not embedding / head)
  bool frozen = false;    // GEMM of a frozen weight: backward computes the input gradient only (no wgrad)
  // Its backward runs in the forward (the fused linear cross-entropy computes the logits' gradient,
  // and from it the head's input and weight gradients, chunk by chunk in the forward): priced and
  // counted in the forward, nothing in the backward.
  bool grads_in_forward = false;
  // Host (CPU) seconds on the thread that launches the kernels, priced in series with them where
  // the op runs (DeepSpeed ZeRO-3's Python gradient-reduce path: core/zero3_placement.hpp
  // zero3_reduce_host_seconds). No FLOPs, no HBM bytes, no kernel.
  double host_seconds = 0;
  // Share of the op re-run by op-level selective checkpointing (Recompute::selective_op,
  // torchtitan's policy): 0 for the saved matmuls and SDPA, kv / (h + 2 kv) for the fused QKV
  // GEMM (its k part), 1 for everything else in the layer.
  double op_sac_recompute = 1;
  // GEMM epilogues (ModelSpec::gemm_epilogues, the torch engine's cuBLASLt GEMMs): what the
  // forward GEMM, its dgrad and its wgrad do besides the product ("" = nothing): forward
  // gelu_aux_bias | bias_residual, dgrad dgelu, wgrad bgradb. The HBM bytes an epilogue adds to
  // its GEMM (gelu_aux_bias writes GELU's input and bias_residual reads the residual, e m n each;
  // dgelu reads GELU's input, e m k) are in memory_bytes (forward) and dgrad_epilogue_bytes;
  // epilogue_bytes says how much of memory_bytes that is. epilogue_replaced_op() names the
  // separate kernel each replaces.
  std::string epilogue, dgrad_epilogue, wgrad_epilogue;
  double epilogue_bytes = 0, dgrad_epilogue_bytes = 0;
  bool has_epilogue() const { return !epilogue.empty() || !dgrad_epilogue.empty() || !wgrad_epilogue.empty(); }
  double backward_memory_bytes() const {
    return backward_only ? memory_bytes : backward_bytes >= 0 ? backward_bytes : 2 * memory_bytes;
  }
};

struct LayerShape {
  int micro_batch = 1;
  int tp = 1;
  bool sequence_parallel = false;
  Dtype dtype = Dtype::bf16;
  bool moe = false;        // this layer's MLP is a MoE (tokens routed to top_k experts)
  int ep = 1;
  // Fine-tuning (core/finetune.hpp): frozen GEMMs, LoRA adapters' ops, only trainable gradients
  // accumulated. nullptr: everything trains.
  const FinetuneSpec* finetune = nullptr;
};

// Forward ops of one transformer layer on one GPU (the layer's TP shard), in execution order:
// layernorm_1, qkv, attention_scores*, softmax*, attention_dropout*, attention_over_v*,
// attention_proj, dropout_residual_1, layernorm_2, mlp_up, gelu, mlp_down, dropout_residual_2
// (* = attention_core). Llama-shaped: rmsnorm_1 / rmsnorm_2 for the norms, qkv (h + 2 kv_width)/t
// wide, rotary after qkv (on q and k), mlp_gate + mlp_up + swiglu in place of mlp_up + gelu, no
// bias_grads without biases. A MoE layer (shape.moe) replaces the MLP by moe_gate, moe_gate_softmax,
// moe_dispatch, mlp_up and mlp_down batched over the ep-local experts (the GPU's b s / t tokens x
// top_k x capacity_factor, DeepSpeed drops TP-duplicate tokens), gelu, moe_combine. The all-to-alls
// and TP collectives are not ops: the schedule places them. Backward: backward_cost().
// Fine-tuning (shape.finetune): frozen weights' GEMMs marked `frozen`, each adapter's ops
// (lora_forward_ops) after its base GEMM, bias gradients and grad_accumulate for trainable
// parameters only. model.gemm_epilogues (GELU MLP with biases, no LoRA): the torch engine's fused
// block, epilogues on the GEMMs and no gelu / bias_grads ops, residuals backward-only without TP
// (model.cpp apply_gemm_epilogues, docs/simulator.md "The torch engine's fused block").
std::vector<LayerOp> layer_forward_ops(const ModelSpec& m, const LayerShape& shape);
// Forward ops of the embedding (first stage) and of the LM head + loss (last stage).
std::vector<LayerOp> embedding_forward_ops(const ModelSpec& m, const LayerShape& shape);
std::vector<LayerOp> head_forward_ops(const ModelSpec& m, const LayerShape& shape);
// Tokens per chunk of the fused linear cross-entropy (ModelSpec::fused_cross_entropy): the fewest
// equal chunks of the micro-batch's tokens whose fp32 [chunk x vocab_local] probabilities fit in
// 1 GiB (the engine's working set: 16-bit logits, fp32 probabilities, 16-bit gradient).
int64_t fused_cross_entropy_chunk_tokens(int64_t tokens, int64_t vocab_local);

// The separate kernel a GEMM epilogue replaces, as the op the layer has without
// model.gemm_epilogues, at `e` bytes per element, for the GEMM op (its forward shape [m x k] x
// [k x n], repeated batch times):
//   gelu_aux_bias (forward, on [m x n]) and dgelu (dgrad, on its output [m x k]): the "gelu" op
//     (its forward 2 e, its backward gelu_backward 3 e per element);
//   bias_residual (forward, [m x n]): the residual add (3 e per element; its backward, the
//     gradient sum at the fork, stays an op of the layer);
//   bgradb (wgrad, the bias of width n over m rows): a backward-only "bias_grads" op (kernel
//     bias_grad, e per element of [m x n]).
// The device model prices an epilogue the profile has no rows for as the plain GEMM plus this op
// (its forward for a forward epilogue, its backward otherwise). Throws on an unknown epilogue.
LayerOp epilogue_replaced_op(const std::string& epilogue, const LayerOp& gemm, double e);
// The GEMM without its epilogues (their bytes taken out of memory_bytes).
LayerOp plain_gemm(const LayerOp& gemm);


struct OpsCost {
  double flops = 0, gemm_flops = 0, memory_bytes = 0;
  int kernels = 0;
  OpsCost& operator+=(const OpsCost& o);
};
OpsCost sum_cost(const std::vector<LayerOp>& ops);
OpsCost backward_cost(const std::vector<LayerOp>& forward_ops);     // 2x GEMM FLOPs (frozen: 1x), backward bytes
OpsCost recompute_cost(const std::vector<LayerOp>& forward_ops, Recompute r);  // selective: attention core only

}  // namespace dssim
