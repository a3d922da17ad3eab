// Fine-tuning: which parameters train, and what LoRA adds.
//
// A frozen parameter (requires_grad False) keeps its compute-dtype copy and nothing else: no
// gradient, no fp32 master, no optimizer state, no gradient reduction; its GEMM's backward still
// computes the input gradient (dgrad) but not the weight gradient (wgrad). ZeRO treats frozen
// parameters as DeepSpeed does: stages 1-2 partition only what the optimizer holds (the trainable
// parameters; frozen ones stay whole on every rank), stage 3 partitions and gathers every
// parameter (zero.Init shards the whole module) and reduce-scatters only trainable gradients.
//
// LoRA (Hu et al. 2021, arXiv:2106.09685, as Hugging Face PEFT's LoraConfig / lora.Linear runs
// it): each targeted linear W [out, in] becomes W x + (alpha / r) B A dropout(x) with A [r, in]
// (Kaiming-uniform) and B [out, r] (zero), the base model frozen. Forward: two small GEMMs
// (tokens x r x in, tokens x out x r) and the scaled add; backward: both adapters' dgrad and wgrad,
// the base linear's dgrad only. Activations: A's input (x, already kept for the base linear's
// backward unless lora_dropout makes a dropped copy) and A's output [tokens, r].
#pragma once
#include <vector>
#include "core/model.hpp"
#include "core/scenario.hpp"

namespace dssim {

// The targets a LoRA run adapts: spec.targets, or PEFT's default for the architecture
// (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: Llama ["q_proj", "v_proj"], GPT-2
// ["c_attn"], the fused QKV).
std::vector<LoraTarget> lora_targets(const ModelSpec& m, const FinetuneSpec& f);
// The PEFT / Hugging Face module names accepted for each target (q_proj, query_key_value, ...).
bool parse_lora_target(const std::string& name, std::vector<LoraTarget>& out);
std::vector<std::string> lora_target_names();

// One adapter of one layer: A [rank, in], B [out, rank] (TP 1: dssim refuses LoRA with tp > 1).
struct LoraAdapter {
  LoraTarget target = LoraTarget::q;
  double in = 0, out = 0;
  double params(int rank) const { return rank * (in + out); }
};
std::vector<LoraAdapter> layer_adapters(const ModelSpec& m, const FinetuneSpec& f);  // a transformer layer's
double layer_adapter_params(const ModelSpec& m, const FinetuneSpec& f);
double head_adapter_params(const ModelSpec& m, const FinetuneSpec& f);     // lm_head targeted: r (h + V)
double adapter_parameter_count(const ModelSpec& m, const FinetuneSpec& f);  // whole model

// Base parts and whether they train.
enum class BasePart { embedding, norm, attention, mlp, head };
bool base_trains(const ModelSpec& m, const FinetuneSpec& f, BasePart part);
// Trainable elements of one transformer layer (adapters + trained base parts; TP-split by t).
double layer_trainable_params(const ModelSpec& m, const FinetuneSpec& f, double t = 1);
// Trainable elements of the embedding (word table / t, learned positions) and of the head (final
// norm, the lm_head adapter, and the output layer / t when the stage holds one: untied, or the tied
// copy on a pipeline's last stage). Used by the memory model, the Program and the counts alike.
double embedding_trainable_params(const ModelSpec& m, const FinetuneSpec& f, double t = 1);
double head_trainable_params(const ModelSpec& m, const FinetuneSpec& f, bool has_output_layer, double t = 1);
// The whole model's trainable parameters (adapters included) and all parameters (base + adapters).
double trainable_parameter_count(const ModelSpec& m, const FinetuneSpec& f);
double total_parameter_count(const ModelSpec& m, const FinetuneSpec& f);

// What fine-tuning changes in an iteration's FLOPs (model.cpp's model_flops_per_iteration /
// hardware_flops_per_iteration assume everything trains): minus the frozen weights' wgrad (one
// forward's GEMM FLOPs each), plus the adapters' forward and backward (3x their forward; a full
// recompute runs their forward again in hardware FLOPs). 0 when nothing is frozen.
double finetune_flops_delta(const ModelSpec& m, const FinetuneSpec& f, double global_batch, Recompute r,
                            bool hardware);

// Forward ops of one adapter on `tokens` tokens (dtype bytes e): [lora_dropout], lora_a, lora_b,
// lora_add. They train (not frozen) and are part of the layer (full recompute re-runs them).
std::vector<LayerOp> lora_forward_ops(const LoraAdapter& a, const FinetuneSpec& f, double tokens, double e);

// Applies the fine-tuning to the forward op lists model.cpp builds (LayerShape::finetune): marks
// frozen GEMMs, inserts each adapter's ops after its base GEMM, keeps bias gradients and
// grad_accumulate for trainable parameters only; a frozen embedding has no backward work.
void finetune_layer_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape);
void finetune_embedding_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape);
void finetune_head_ops(std::vector<LayerOp>& ops, const ModelSpec& m, const LayerShape& shape);

// Activation bytes one micro-batch of b sequences keeps per layer for its adapters: A's output
// (b s r, compute dtype) per adapter, and with lora_dropout the dropped copy of x (b s in) and
// its 1-byte mask. 0 when nothing is adapted.
double lora_activation_bytes_per_layer(const ModelSpec& m, const FinetuneSpec& f, int micro_batch, Dtype dtype);

}  // namespace dssim
