// The Report: what every backend prints for one training iteration, as text or JSON.
// JSON key names are stable and documented in docs/report-json.md.
#pragma once
#include <map>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/memory.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"

namespace dssim {

struct FitSuggestion {
  std::string change;        // "zero.stage=3", "training.micro_batch=1 (grad_accum=8)", ...
  double peak_bytes = 0;     // predicted peak per GPU with the change
  double iteration_seconds = 0;
  bool fits = false;
};

// 1-bit Adam: the data-parallel bytes one rank sends per iteration before freeze_step (the
// gradient all-reduce of plain Adam) and after it (the compressed all-reduce of the momentum),
// from the two Programs the scenario builds. {0, 0} for other optimizers.
struct OneBitTraffic {
  double uncompressed = 0, compressed = 0;
};
OneBitTraffic onebit_traffic(const Scenario& sc);

struct Report {
  std::string backend;       // "analytic", "sim", "cpu", "cuda"
  double parameters = 0;
  double trainable_parameters = 0;  // fine-tuning: what trains (= parameters unless something is frozen)
  double iteration_seconds = 0;
  double tokens_per_second = 0, samples_per_second = 0;
  double model_flops_per_iteration = 0, hardware_flops_per_iteration = 0;
  double model_tflops_per_gpu = 0, hardware_tflops_per_gpu = 0;
  double mfu = 0, hfu = 0;
  double time_to_train_seconds = 0;  // 0 when the scenario names no token count
  TimeBreakdown time;                // of the critical (slowest / first-stage) rank
  int critical_rank = 0;
  MemoryBreakdown memory;            // peak per GPU, worst stage
  double gpu_memory_bytes = 0;
  bool fits = true;
  std::vector<FitSuggestion> suggestions;
  // Bytes each rank puts on the wire per iteration, by collective purpose (the Program's
  // expectation; backends that measure add "measured_bytes" in extras).
  std::map<std::string, double> wire_bytes_per_rank;
  OneBitTraffic onebit;              // 1-bit Adam's before / after freeze_step (make_report)
  std::vector<double> losses;        // measured backends
  nlohmann::json extras = nlohmann::json::object();  // backend-specific sections
};

// The report of one interpreted Program (analytic estimate or simulation): iteration time from the
// timeline, breakdown of the rank that ends last (first stage on ties), memory plan, wire bytes.
Report make_report(const Scenario& sc, const Program& program, const Timeline& timeline,
                   const std::string& backend);

// The materialized rank whose last instruction ends last (the first on ties): the one the report's
// breakdown describes.
int critical_rank_index(const Timeline& timeline);

// Fills throughput, FLOP/s, MFU/HFU, time-to-train from iteration_seconds and the scenario.
void fill_throughput(const Scenario& sc, Report& r);
// Wire bytes per rank by purpose for the materialized rank `rank_index`.
std::map<std::string, double> wire_bytes_by_purpose(const Program& program, int rank_index);

std::string report_text(const Scenario& sc, const Report& r, bool verbose = false);
nlohmann::json report_json(const Scenario& sc, const Report& r);

}  // namespace dssim
