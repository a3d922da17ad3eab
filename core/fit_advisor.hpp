// When a scenario does not fit in GPU memory, which changes would make it fit, and what each
// costs in iteration time: a higher ZeRO stage, optimizer / parameter offload, a smaller
// micro-batch with more accumulation, selective or full recompute, more pipeline stages.
#pragma once
#include <vector>
#include "core/report.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct FitCandidate {
  std::string change;  // space-separated key=value assignments, each valid for --set
  Scenario scenario;
};

// Every single change that yields a valid scenario (validate() passes), in the order above.
std::vector<FitCandidate> fit_candidates(const Scenario& sc);

// The candidates evaluated: peak memory and analytic iteration time; fitting ones first, then by time.
std::vector<FitSuggestion> fit_suggestions(const Scenario& sc);

}  // namespace dssim
