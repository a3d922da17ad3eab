// Loading a Scenario: scenario YAML (+ presets under scenarios/) < ds_config.json < --set overrides,
// then --gpus resizing, DeepSpeed's batch rules, and validation. The format is documented in
// docs/scenario-format.md.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// A mistake in what the user wrote. The message is user-facing: it names the key path, the file
// and line where known, and how to fix it.
struct ConfigError : std::runtime_error {
  using runtime_error::runtime_error;
};

struct LoadOptions {
  std::string deepspeed_config;        // path of a ds_config.json; empty = none
  std::vector<std::string> overrides;  // "key.path=value" (from --set), applied last, in order
  // --gpus N: resizes cluster.nodes (N a multiple of gpus_per_node; N < gpus_per_node makes one
  // node of N GPUs, as does any N on a single host without NICs) and parallel.dp so that
  // tp * pp * dp = N. 0 = keep the scenario's size.
  int gpus = 0;
};

// `path` is a file; if it does not exist and is relative, scenarios/<path>(.yaml) under
// data_root() is tried, so `load_scenario("gpt175b")` finds the shipped preset.
Scenario load_scenario(const std::string& path, const LoadOptions& = {});
// `source` names the text in messages; relative preset paths resolve against its directory.
Scenario load_scenario_from_string(const std::string& yaml, const LoadOptions& = {},
                                   const std::string& source = "<string>");

// --gpus N applied to a cluster: N < gpus_per_node, or any N on a single host without NICs, gives
// one node of N GPUs; otherwise N must be a multiple of gpus_per_node (nodes = N / gpus_per_node).
// Throws ConfigError naming --gpus. (Data parallelism is the caller's: dp = N / (tp * pp).)
void resize_cluster(ClusterSpec& cluster, int gpus);

// Directory holding scenarios/: $DSSIM_HOME if set, else the source tree (DSSIM_SOURCE_ROOT).
std::string data_root();

// Names of the presets of one kind ("models", "clusters", "gpus"), sorted: the YAML files under
// data_root()/scenarios/<kind>/, without extension.
std::vector<std::string> list_presets(const std::string& kind);

// The resolved scenario as YAML in dssim's format (every field explicit, SI units). Loading the
// result gives back an equal Scenario.
std::string to_yaml(const Scenario&);

}  // namespace dssim
