#include "core/reliability.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include "core/memory.hpp"
#include "core/scenario_loader.hpp"

namespace dssim {

CheckpointSize checkpoint_size(const Scenario& sc) {
  const auto& p = sc.parallel;
  const double param_bytes = bytes_of(sc.precision.dtype);
  // Optimizer state per trainable parameter: fp32 master (16-bit training only) + moments.
  const double moments = sc.optimizer.kind == OptimizerKind::lion ? 4 : 8;
  const double state_bytes = moments + (sc.precision.dtype == Dtype::fp32 ? 0 : 4);
  CheckpointSize c;
  double params_total = 0, states_total = 0;
  for (int s = 0; s < p.pp; ++s) {
    const StageParameters sp = stage_parameters(sc, s);
    // Per GPU after the TP split; experts differ across the ep ranks of a stage.
    const double unique = sp.dense + sp.expert * std::max(1, p.ep);
    const double unique_trainable = sp.trainable_dense + sp.trainable_expert * std::max(1, p.ep);
    params_total += p.tp * unique * param_bytes;
    states_total += p.tp * unique_trainable * state_bytes;
  }
  c.total_bytes = params_total + states_total;
  const double writers_replica = double(p.tp) * p.pp;          // data-parallel rank 0 of each (tp, pp)
  const double writers_all = writers_replica * std::max(1, p.dp);
  if (sc.zero.stage == 0) c.per_rank_bytes = c.total_bytes / writers_replica;
  else c.per_rank_bytes = states_total / writers_all + params_total / (sc.zero.stage == 3 ? writers_all : writers_replica);
  return c;
}

double young_interval(double delta, double mtbf) { return std::sqrt(2 * delta * mtbf); }

double daly_interval(double delta, double mtbf) {
  if (delta >= 2 * mtbf) return mtbf;
  const double x = delta / (2 * mtbf);
  return std::sqrt(2 * delta * mtbf) * (1 + std::sqrt(x) / 3 + x / 9) - delta;
}

double goodput_closed_form(double tau, double delta, double restart, double mtbf) {
  if (!(mtbf > 0) || std::isinf(mtbf)) return tau / (tau + delta);
  return tau / (mtbf * std::exp(restart / mtbf) * std::expm1((tau + delta) / mtbf));
}

MonteCarloGoodput goodput_monte_carlo(double tau, double delta, double restart, double mtbf, int64_t segments,
                                      int jobs, uint64_t seed) {
  MonteCarloGoodput mc;
  mc.jobs = jobs;
  mc.segments_per_job = segments;
  std::mt19937_64 rng(seed);
  // Exponential draws from 53 random bits (the same on every standard library).
  auto next_failure = [&] {
    const double u = double(rng() >> 11) * 0x1.0p-53;
    return -mtbf * std::log1p(-u);
  };
  const bool fails = mtbf > 0 && !std::isinf(mtbf);
  double useful_sum = 0, wall_sum = 0, g_sum = 0, g2_sum = 0, failures = 0;
  for (int j = 0; j < jobs; ++j) {
    double wall = 0;
    for (int64_t s = 0; s < segments; ++s) {
      bool restarting = false;
      for (;;) {
        if (restarting) {  // restart + restore; a failure during it starts it over
          const double f = fails ? next_failure() : INFINITY;
          if (f < restart) { wall += f; failures += 1; continue; }
          wall += restart;
          restarting = false;
        }
        const double f = fails ? next_failure() : INFINITY;
        if (f < tau + delta) { wall += f; failures += 1; restarting = true; continue; }
        wall += tau + delta;
        break;
      }
    }
    const double useful = tau * double(segments);
    useful_sum += useful;
    wall_sum += wall;
    g_sum += useful / wall;
    g2_sum += (useful / wall) * (useful / wall);
  }
  mc.goodput = useful_sum / wall_sum;
  const double mean = g_sum / jobs;
  mc.stddev = jobs > 1 ? std::sqrt(std::max(0.0, (g2_sum - jobs * mean * mean) / (jobs - 1))) : 0.0;
  mc.failures_per_job = failures / jobs;
  return mc;
}

GoodputReport goodput_report(const Scenario& sc, double iteration_seconds, bool monte_carlo) {
  const ReliabilitySpec& rs = sc.reliability;
  GoodputReport g;
  g.gpus = sc.cluster.world();
  g.failures_per_gpu_hour = rs.failures_per_node_day > 0
                                ? rs.failures_per_node_day / 24.0 / std::max(1, sc.cluster.gpus_per_node)
                                : rs.failures_per_gpu_hour;
  const double rate = g.failures_per_gpu_hour * g.gpus / 3600.0;  // job failures per second
  g.mtbf_seconds = rate > 0 ? 1.0 / rate : INFINITY;
  g.checkpoint = checkpoint_size(sc);
  if (rs.checkpoint_bytes > 0) g.checkpoint.per_rank_bytes *= rs.checkpoint_bytes / g.checkpoint.total_bytes;
  if (rs.checkpoint_bytes > 0) g.checkpoint.total_bytes = rs.checkpoint_bytes;
  g.checkpoint_seconds = g.checkpoint.total_bytes / rs.write_bandwidth;
  const double read_bw = rs.read_bandwidth > 0 ? rs.read_bandwidth : rs.write_bandwidth;
  g.restore_seconds = rs.restore_seconds > 0 ? rs.restore_seconds : g.checkpoint.total_bytes / read_bw;
  g.restart_seconds = rs.restart_seconds;
  g.iteration_seconds = iteration_seconds;
  const double R = g.restart_seconds + g.restore_seconds, delta = g.checkpoint_seconds, M = g.mtbf_seconds;
  g.young_seconds = young_interval(delta, M);
  g.daly_seconds = daly_interval(delta, M);
  g.interval_auto = rs.checkpoint_interval <= 0;
  double tau = g.interval_auto ? g.daly_seconds : rs.checkpoint_interval;
  if (std::isinf(tau)) tau = 30 * 86400.0;  // no failures: checkpoint monthly, for the record
  // Checkpoints happen between iterations.
  g.interval_iterations = std::max<int64_t>(1, std::llround(tau / iteration_seconds));
  g.interval_seconds = g.interval_iterations * iteration_seconds;
  tau = g.interval_seconds;
  g.goodput = goodput_closed_form(tau, delta, R, M);
  const double tokens_per_second = double(sc.training.global_batch) * sc.model.seq_len / iteration_seconds;
  g.useful_seconds = sc.training.tokens_to_train > 0 ? sc.training.tokens_to_train / tokens_per_second : 0;
  const double segment_wall = tau / g.goodput;
  if (std::isfinite(M)) {
    const double L = tau + delta;
    g.lost_per_failure_seconds = M * (1 - L / segment_wall);
    g.lost_progress_per_failure_seconds = M - L / std::expm1(L / M);
  }
  g.time_to_train_seconds = g.useful_seconds / g.goodput;
  g.expected_failures = std::isfinite(M) ? g.time_to_train_seconds / M : 0;
  if (!monte_carlo) return g;
  // The Monte-Carlo: jobs as long as the run (30 days of work when the scenario names no tokens).
  const double work = g.useful_seconds > 0 ? g.useful_seconds : 30 * 86400.0;
  const int64_t segments = std::max<int64_t>(1, std::llround(work / tau));
  g.monte_carlo = goodput_monte_carlo(tau, delta, R, M, segments, std::max(1, rs.samples), rs.seed);
  return g;
}

nlohmann::json goodput_json(const GoodputReport& g) {
  const auto fin = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
  return {{"gpus", g.gpus},
          {"failures_per_gpu_hour", g.failures_per_gpu_hour},
          {"mtbf_seconds", fin(g.mtbf_seconds)},
          {"checkpoint_bytes", g.checkpoint.total_bytes},
          {"checkpoint_bytes_per_rank", g.checkpoint.per_rank_bytes},
          {"checkpoint_seconds", g.checkpoint_seconds},
          {"restore_seconds", g.restore_seconds},
          {"restart_seconds", g.restart_seconds},
          {"iteration_seconds", g.iteration_seconds},
          {"checkpoint_interval_seconds", g.interval_seconds},
          {"checkpoint_interval_iterations", g.interval_iterations},
          {"checkpoint_interval_auto", g.interval_auto},
          {"young_interval_seconds", fin(g.young_seconds)},
          {"daly_interval_seconds", fin(g.daly_seconds)},
          {"goodput", g.goodput},
          {"monte_carlo", {{"goodput", g.monte_carlo.goodput}, {"stddev_per_job", g.monte_carlo.stddev},
                           {"jobs", g.monte_carlo.jobs}, {"segments_per_job", g.monte_carlo.segments_per_job},
                           {"failures_per_job", g.monte_carlo.failures_per_job}}},
          {"lost_per_failure_seconds", g.lost_per_failure_seconds},
          {"lost_progress_per_failure_seconds", g.lost_progress_per_failure_seconds},
          {"useful_seconds", g.useful_seconds},
          {"time_to_train_seconds", g.time_to_train_seconds},
          {"expected_failures", g.expected_failures}};
}

}  // namespace dssim
