// The predictors this build of dssim has: "sim" (SimGrid, when built with it; the default then)
// and "analytic" (the closed-form estimator). One place for the verbs that predict (scenario,
// validate, compare) to name, check and run them.
#pragma once
#include <string>
#include "core/report.hpp"
#include "core/scenario.hpp"
#include "validation/compare.hpp"

namespace dssim::cli {

const char* default_predictor();
bool has_predictor(const std::string& name);
std::string available_predictors();  // for messages: "analytic, sim"

// The predictor's report of one iteration (without fit suggestions).
Report predict_report(const Scenario& sc, const std::string& name);
// The same, plus rank 0's seconds per instruction kind (what `dssim compare` sets side by side).
validation::Prediction predict_with_kinds(const Scenario& sc, const std::string& name);

}  // namespace dssim::cli
