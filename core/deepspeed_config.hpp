// Reading a DeepSpeed ds_config.json as a layer of scenario settings (docs/scenario-format.md,
// "--deepspeed_config mapping", has the table and the layering rule).
//
// The layering rule: the ds_config describes the DeepSpeed run as DeepSpeed sees it. A section it
// leaves out takes DeepSpeed's default (no zero_optimization block = ZeRO stage 0, neither fp16 nor
// bf16 enabled = fp32, no gradient_clipping = 0, a zero_optimization block without
// reduce_bucket_size = 5e8, ...). What DeepSpeed leaves to the model code or the launcher comes
// from the scenario: the model, the cluster, tp / pp (Megatron's mpu), activation recompute, the
// client optimizer when there is no optimizer block, and the batch when the config names none of
// its keys (the Hugging Face Trainer fills those). "auto" (the Hugging Face placeholder) keeps the
// scenario's value. The loader warns for every scenario value the ds_config replaces.
#pragma once
#include <map>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/scenario_layer.hpp"

namespace dssim {

struct DeepSpeedLayer {
  Layer settings;                     // keyed by dssim key path; Entry::written_as is the ds key
  std::vector<std::string> warnings;  // one per key or block dssim does not use
  // True when the config gives a number for any of train_batch_size,
  // train_micro_batch_size_per_gpu, gradient_accumulation_steps and none of them is "auto": it
  // then replaces the scenario's whole batch triple, as DeepSpeed sees only its own config.
  bool sets_batch = false;
  // True when a batch key is "auto": the auto keys keep the scenario's values and the numeric ones
  // are put over the scenario's triple as a --set of them would be.
  bool batch_auto = false;
  // dssim keys set from DeepSpeed's defaults because the ds_config leaves them out, with the reason
  // ("no zero_optimization block: DeepSpeed runs ZeRO stage 0").
  std::map<std::string, std::string> defaulted;
  // True when the config has a "pipeline" section (DeepSpeed's pipeline engine): the pipeline
  // partition then defaults to PipelineModule's partition_method, `parameters`.
  bool pipeline_section = false;
};

// `origin` names the file in messages. Throws ConfigError for what DeepSpeed itself refuses
// (fp16 and bf16 both enabled, an unknown optimizer, a malformed value) and for what dssim does
// not model yet (Ulysses sequence parallelism, OneBitLamb / ZeroOneAdam).
DeepSpeedLayer map_deepspeed_config(const nlohmann::json& config, const std::string& origin);
// Reads the file as DeepSpeed does (hjson): # and // comments and trailing commas are accepted,
// duplicate keys are refused, unexpanded launch-script placeholders ($GLOBAL_BATCH,
// CONFIG_BATCH_SIZE) are named.
nlohmann::json parse_deepspeed_json(const std::string& text, const std::string& origin);
DeepSpeedLayer load_deepspeed_config(const std::string& path);

// The inverse: the ds_config.json a DeepSpeed user launches a Scenario with (batch triple,
// zero_optimization with its offload blocks and buckets, fp16 / bf16, communication_data_type,
// gradient_clipping, optimizer, and dssim's moe block for MoE models). What a ds_config cannot say
// (tp, pp, interleave, sequence parallelism, recompute) stays with the scenario / launcher.
// Loading the scenario with it (--deepspeed_config) gives back the same training setup.
struct Scenario;
nlohmann::json to_deepspeed_config(const Scenario& sc);

}  // namespace dssim
