// Fine-tuning in the torch backend (core/finetune.hpp is the model of it): which of the GPT's
// parameters train, and the LoRA adapters, as Hugging Face PEFT's lora.Linear runs them.
//
// Adapters are parameters of the unit whose linear they adapt, appended after the unit's base
// tensors in the order core/stage_plan.cpp lays them out (layer_adapters: A [r, in] then
// B [out, r] per target, in the targets' order; the lm_head's after the final norm), so the ZeRO
// partition the engine builds from unit_params is the Program's. Initialisation as PEFT's
// reset_lora_parameters: A kaiming_uniform_(a = sqrt(5)) (U(-1/sqrt(in), 1/sqrt(in))), B zero,
// drawn from a generator of the run's seed and the unit (every rank, every ZeRO stage the same
// adapters; the base weights' draws are not disturbed). Forward: W x + b + (alpha / r) B A
// dropout(x), dropout as nn.Dropout (training mode) when lora_dropout > 0.
#pragma once
#include <cstdint>
#include <vector>
#include <torch/torch.h>
#include "core/scenario.hpp"

namespace dssim::tb {

struct GptConfig;
struct ParamSpec;

struct LoraAdapterShape {
  LoraTarget target = LoraTarget::qkv;
  int64_t in = 0, out = 0;
};

// What trains, resolved from the scenario's finetune section for the GPT the backend runs.
struct FinetuneConfig {
  bool active = false;  // something is frozen (LoRA, or method full with freeze)
  bool lora = false;
  int rank = 0;
  double scale = 0;     // alpha / rank
  double dropout = 0;
  std::vector<LoraAdapterShape> layer;  // every block's adapters, in the Program's order
  bool head = false;                    // an adapter on the (tied) LM head
  bool train_embedding = true, train_norm = true, train_attention = true, train_mlp = true;
  // Throws std::invalid_argument naming the key for what the backend does not run (the targets
  // q / k / v / mlp_gate on the fused GPT).
  static FinetuneConfig from(const ModelSpec& m, const FinetuneSpec& f);
  int adapter_index(LoraTarget t) const;  // position in `layer`, -1 when not adapted
};

// The adapter tensors of a unit (block: every target's A, B; final norm: the lm_head's), empty
// without LoRA or for other units.
std::vector<ParamSpec> lora_params(const GptConfig& c, int unit);
// Whether parameter `index` of `unit` (unit_params order) trains.
bool param_trainable(const GptConfig& c, int unit, int index);
// Number of unit_params of a unit that are its base model's (the adapters follow).
int base_param_count(const GptConfig& c, int unit);
// Initialises the adapters of a unit inside its flat fp32 tensor (`views`: unit_views of it).
void init_lora(const GptConfig& c, int unit, const std::vector<at::Tensor>& views, uint64_t seed);
// base_out + scale * B A dropout(x) for adapter `k` of `params` (a unit's tensors), or base_out
// unchanged when the target has no adapter.
at::Tensor lora_add(const GptConfig& c, const std::vector<at::Tensor>& params, int first_adapter, LoraTarget t,
                    const at::Tensor& x, const at::Tensor& base_out);

}  // namespace dssim::tb
