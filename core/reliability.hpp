// Failures and goodput over the whole run (the scenario's `reliability:` section, docs/simulator.md
// "Failures and goodput").
//
// Model: failures of the job arrive as a Poisson process of rate N x (failures per GPU-hour), so
// the job's mean time between failures is M = 1 / (N x rate). Training runs in segments of tau
// seconds of useful work, each followed by a blocking checkpoint of delta seconds (the whole
// checkpoint over the aggregate write bandwidth). A failure loses everything since the last
// completed checkpoint and costs a restart of R = restart overhead + restore (failures can strike
// during the restart and the checkpoint too). Daly (2006), exact for this model:
//   E[wall time of one segment] = M e^(R/M) (e^((tau + delta)/M) - 1),   goodput = tau / that.
// Optimal interval: Young (1974) sqrt(2 delta M); Daly's higher-order
//   sqrt(2 delta M) (1 + sqrt(delta / (2M)) / 3 + delta / (18 M)) - delta   (delta < 2M; else M).
// The Monte-Carlo replays the same timeline event by event (seeded) and must agree.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include "core/scenario.hpp"

namespace dssim {

struct CheckpointSize {
  double total_bytes = 0;     // the whole checkpoint: 16-bit parameters + optimizer states, each once
  double per_rank_bytes = 0;  // what the busiest writer writes (ZeRO >= 1: every rank its shard)
};
// From the model and the parallel layout (the memory model's parameter counts).
CheckpointSize checkpoint_size(const Scenario& sc);

double young_interval(double delta, double mtbf);
double daly_interval(double delta, double mtbf);
// Useful time over wall time with checkpoints every `tau` seconds of work.
double goodput_closed_form(double tau, double delta, double restart, double mtbf);

struct MonteCarloGoodput {
  double goodput = 0;          // total useful / total wall over all jobs
  double stddev = 0;           // of the per-job goodput
  double failures_per_job = 0;
  int jobs = 0;
  int64_t segments_per_job = 0;
};
// `jobs` jobs of `segments` segments each; deterministic for a seed.
MonteCarloGoodput goodput_monte_carlo(double tau, double delta, double restart, double mtbf, int64_t segments,
                                      int jobs, uint64_t seed);

struct GoodputReport {
  int gpus = 0;
  double failures_per_gpu_hour = 0;
  double mtbf_seconds = 0;                // the job's
  CheckpointSize checkpoint;
  double checkpoint_seconds = 0;          // delta
  double restore_seconds = 0, restart_seconds = 0;
  double iteration_seconds = 0;
  double interval_seconds = 0;            // tau, a whole number of iterations
  int64_t interval_iterations = 0;
  bool interval_auto = true;
  double young_seconds = 0, daly_seconds = 0;
  double goodput = 0;                     // closed form
  MonteCarloGoodput monte_carlo;
  double lost_per_failure_seconds = 0;    // wall time one failure costs: lost progress + restart
  double lost_progress_per_failure_seconds = 0;  // work since the last checkpoint, on average
  double useful_seconds = 0;              // the run's training time without failures (0: no tokens_to_train)
  double time_to_train_seconds = 0;       // including failures, checkpoints and restarts
  double expected_failures = 0;           // over the run
};

// `iteration_seconds`: one clean iteration, from whichever backend predicted it. Throws
// ConfigError for settings that cannot work (zero failure rate with interval auto is allowed: no
// checkpoints are needed, goodput 1).
GoodputReport goodput_report(const Scenario& sc, double iteration_seconds, bool monte_carlo = true);
nlohmann::json goodput_json(const GoodputReport& g);

}  // namespace dssim
