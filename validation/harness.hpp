// The validation harness: published tables as data (validation/published/*.yaml, each with its
// citation), every row predicted by dssim, and the errors scored against committed thresholds
// (validation/thresholds.yaml). `dssim validate` prints it; CI fails when errors grow.
#pragma once
#include <functional>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/report.hpp"
#include "core/scenario.hpp"

namespace dssim::validation {

struct Row {
  std::string label;
  double published = 0;
  double predicted = 0;
  double error = 0;            // (predicted - published) / published
  nlohmann::json detail = nlohmann::json::object();  // scenario summary, iteration time, ...
};

struct Table {
  std::string name, citation, kind, metric, unit, file;
  std::vector<Row> rows;
  double mean_abs_error = 0, max_abs_error = 0;
  double allowed_mean = -1, allowed_max = -1;  // from thresholds.yaml; < 0 = none committed
  bool pass() const {
    return (allowed_max < 0 || max_abs_error <= allowed_max) && (allowed_mean < 0 || mean_abs_error <= allowed_mean);
  }
};

// Predicts one scenario's Report (the analytic estimator or the simulator).
using Predictor = std::function<Report(const Scenario&)>;

// Every table under `dir`/published, scored with `dir`/thresholds.yaml. Throws ConfigError on a
// malformed data file (naming the file and the key).
std::vector<Table> run_validation(const std::string& dir, const Predictor& predict);
Table run_table(const std::string& path, const Predictor& predict);

std::string to_text(const std::vector<Table>& tables, bool verbose = false);
nlohmann::json to_json(const std::vector<Table>& tables);

}  // namespace dssim::validation
