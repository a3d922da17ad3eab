// Reading a DeepSpeed ds_config.json as a layer of scenario settings. Every key DeepSpeed defines
// that dssim models is mapped onto its scenario key; every other key becomes a warning that names
// it (docs/scenario-format.md has the table).
#pragma once
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/scenario_layer.hpp"

namespace dssim {

struct DeepSpeedLayer {
  Layer settings;                     // keyed by dssim key path; Entry::written_as is the ds key
  std::vector<std::string> warnings;  // one per key dssim does not use
  // True when the config names any of train_batch_size, train_micro_batch_size_per_gpu,
  // gradient_accumulation_steps: it then replaces the scenario's whole batch triple, as DeepSpeed
  // sees only its own config.
  bool sets_batch = false;
};

// `origin` names the file in messages. Throws ConfigError for what DeepSpeed itself refuses
// (fp16 and bf16 both enabled, an unknown optimizer, a malformed value).
DeepSpeedLayer map_deepspeed_config(const nlohmann::json& config, const std::string& origin);
DeepSpeedLayer load_deepspeed_config(const std::string& path);

}  // namespace dssim
