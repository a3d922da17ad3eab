// Simulated vs measured, like with like: the same scenario's Program predicted (simulator or
// analytic estimator) and run for real (`dssim run --json`), instruction kind by instruction kind,
// then iteration time, throughput and peak memory. Also the measurement records committed under
// validation/measured/ that CI re-predicts.
#pragma once
#include <map>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/program.hpp"
#include "core/report.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"

namespace dssim::validation {

struct Prediction {
  std::string predictor;                         // "sim" or "analytic"
  Report report;
  std::map<std::string, double> seconds_by_kind; // rank 0, one iteration: "forward", "all_reduce", ...
};

// Seconds per instruction kind (Op name) of one rank: its instructions and their spans.
std::map<std::string, double> seconds_by_kind(const RankProgram& rank, const std::vector<Span>& spans);

struct Pair {
  std::string name;
  double simulated = 0, measured = 0;
  double error() const { return measured != 0 ? (simulated - measured) / measured : 0; }
};

struct Comparison {
  std::string scenario, predictor, measured_backend;
  // The fused kernels the measured run took and the prediction priced (apply_measured_kernels);
  // empty for reports that do not say.
  std::string kernels;
  // What the measured run did that the prediction does not price (unpriced_departure); empty
  // when like for like.
  std::string unpriced;
  std::vector<Pair> kinds;     // per instruction kind, seconds per iteration
  std::vector<Pair> totals;    // iteration_seconds, tokens_per_second, model_tflops_per_gpu
  std::vector<Pair> memory;    // peak per category and total, bytes
  nlohmann::json to_json() const;
  std::string to_text() const;
};

// The fused GPU kernels a `dssim run --json` report says its run took, set on the scenario so
// that the prediction prices what ran (the measured run's kernels win over the scenario's keys):
// model.gemm_epilogues = extras.measured.gemm_epilogues present and not "none" (built without
// cuBLASLt) or "off" (turned off; any letters, "fgb" or a part of it, count as on), and
// model.cross_entropy_kernel = extras.measured.cross_entropy_kernel where model.cross_entropy is
// fused_linear. Reports without these fields (runs before them, CPU runs) leave the scenario as it
// is. Returns the line that says what was priced ("" when the report does not say).
std::string apply_measured_kernels(Scenario& sc, const nlohmann::json& run_report);

// What a `dssim run --json` report says its run did that no scenario key prices, so that the
// prediction of `sc` is not like for like; "" when there is none. Today: a ZeRO-3 run that folded
// its layer gradients (DSSIM_ZERO3_FOLD=1, extras.measured.zero3_backward_into_partition false)
// where the model prices backward into the partition (core/memory.hpp zero3_backward_into_partition).
// `dssim compare` shows it, and refuses to --record such a run.
std::string unpriced_departure(const Scenario& sc, const nlohmann::json& run_report);

// `measured` is a `dssim run --json` report (its extras.measured section); `sc` as predicted
// (after apply_measured_kernels).
Comparison compare(const Scenario& sc, const Prediction& predicted, const nlohmann::json& measured);

// A measurement record: what `dssim compare --record` writes and validation/measured/ holds.
//   {"schema": "dssim.measurement/1", "date": ..., "gpu": ..., "command": ...,
//    "scenario_yaml": <the resolved scenario>, "report": <dssim run --json>}
nlohmann::json make_record(const Scenario& sc, const nlohmann::json& measured, const std::string& gpu,
                           const std::string& command);
// The record's scenario, with apply_measured_kernels of its report (a no-op for records whose
// scenario was written with them, and for reports that predate the fields).
Scenario record_scenario(const nlohmann::json& record, const std::string& source);

}  // namespace dssim::validation
