// Cross-field rules a Scenario must satisfy (DeepSpeed's and Megatron's own invariants), with
// messages that name the keys and the fix. docs/scenario-format.md lists every rule.
#pragma once
#include <functional>
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// Where a key was set, for messages: e.g. " at line 7" or " (from --set)"; "" when unknown.
using KeyLocator = std::function<std::string(const std::string& key_path)>;

// Throws ConfigError (core/scenario_loader.hpp) on the first rule broken.
void validate(const Scenario&);
void validate(const Scenario&, const KeyLocator& where);

// Allowed but worth saying (e.g. tensor parallelism across nodes); the loader appends these to
// Scenario::warnings.
std::vector<std::string> validation_warnings(const Scenario&);

// DeepSpeed's _set_batch_related_parameters: given any two of (global_batch, micro_batch,
// grad_accum) (0 = not given) derives the third over `dp` data-parallel ranks; one alone is
// completed as DeepSpeed does (grad_accum = 1). Throws ConfigError with DeepSpeed's wording.
void resolve_batch(TrainingSpec& t, int dp);

}  // namespace dssim
