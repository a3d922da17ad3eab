// Failures and goodput (core/reliability.hpp). Core-only, kept with the simulator's tests to keep
// the core test binary's build small: Daly's closed form against the Monte-Carlo replay of the
// job's timeline (fixed seed; sample sizes below), Young / Daly optima, checkpoint size.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include "core/finetune.hpp"
#include "core/plan.hpp"
#include "core/reliability.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

TEST_CASE("goodput: Monte-Carlo of exponential failures matches Daly's closed form within 2%", "[reliability]") {
  struct Case { double tau, delta, restart, mtbf; int64_t segments; int jobs; };
  // Heavy failures (goodput ~ 0.5), moderate, and the Llama 3 rate on 1,024 GPUs.
  const Case cases[] = {{3600, 300, 1200, 4 * 3600.0, 200, 200},
                        {1800, 60, 600, 24 * 3600.0, 400, 200},
                        {660, 1.2, 600, 1.0 / (1024 * 419.0 / (54 * 24 * 16384.0)) * 3600, 4000, 100}};
  for (const Case& c : cases) {
    const double closed = goodput_closed_form(c.tau, c.delta, c.restart, c.mtbf);
    const MonteCarloGoodput mc = goodput_monte_carlo(c.tau, c.delta, c.restart, c.mtbf, c.segments, c.jobs, 42);
    INFO("tau " << c.tau << " delta " << c.delta << " R " << c.restart << " M " << c.mtbf << ": closed " << closed
                << ", Monte-Carlo " << mc.goodput << " (" << mc.failures_per_job << " failures per job)");
    CHECK(closed > 0.3);
    CHECK(closed < 1);
    CHECK(mc.goodput == Approx(closed).epsilon(0.02));
    CHECK(mc.failures_per_job > 1);
    // Same seed, same timeline.
    CHECK(goodput_monte_carlo(c.tau, c.delta, c.restart, c.mtbf, c.segments, c.jobs, 42).goodput == mc.goodput);
  }
  // No failures: only the checkpoints cost.
  CHECK(goodput_closed_form(100, 10, 5, INFINITY) == Approx(100.0 / 110));
  CHECK(goodput_monte_carlo(100, 10, 5, INFINITY, 10, 2, 1).goodput == Approx(100.0 / 110));
}

TEST_CASE("goodput: Daly's interval is the optimum, Young's its first order", "[reliability]") {
  const double delta = 120, M = 8 * 3600.0, R = 600;
  const double young = young_interval(delta, M), daly = daly_interval(delta, M);
  CHECK(young == Approx(std::sqrt(2 * delta * M)));
  CHECK(std::abs(daly - young) < 0.1 * young);
  const double g = goodput_closed_form(daly, delta, R, M);
  for (double k : {0.5, 0.8, 1.25, 2.0}) CHECK(goodput_closed_form(k * daly, delta, R, M) < g);
  CHECK(daly_interval(3 * M, M) == M);  // checkpoints longer than 2M: Daly's rule gives M
}

TEST_CASE("reliability report: checkpoint from the model, Llama 3's failure rate, time to train", "[reliability]") {
  const Scenario sc = load_scenario(std::string(DSSIM_SCENARIOS_DIR) + "/gpt175b.yaml");
  const GoodputReport g = goodput_report(sc, 26.6);
  // 16-bit parameters + fp32 master and two moments: 14 bytes per parameter, each once.
  const double params = total_parameter_count(sc.model, sc.finetune);
  CHECK(g.checkpoint.total_bytes == Approx(14 * params).epsilon(0.01));
  CHECK(g.failures_per_gpu_hour == Approx(419.0 / (54 * 24 * 16384.0)));
  CHECK(g.mtbf_seconds == Approx(3600 / (g.failures_per_gpu_hour * 1024)));
  CHECK(g.checkpoint_seconds == Approx(g.checkpoint.total_bytes / 2e12));
  CHECK(g.interval_seconds == Approx(g.interval_iterations * 26.6));
  CHECK(std::abs(g.interval_seconds - g.daly_seconds) <= 26.6 / 2 + 1e-9);
  CHECK(g.monte_carlo.goodput == Approx(g.goodput).epsilon(0.02));
  CHECK(g.goodput > 0.95);
  CHECK(g.goodput < 1);
  if (sc.training.tokens_to_train > 0) {
    CHECK(g.time_to_train_seconds == Approx(g.useful_seconds / g.goodput));
    CHECK(g.expected_failures == Approx(g.time_to_train_seconds / g.mtbf_seconds));
  }
  // Per node-day, and an explicit interval.
  Scenario s2 = sc;
  s2.reliability.failures_per_node_day = 0.24;  // per node of 8 GPUs: 0.00125 per GPU-hour
  s2.reliability.checkpoint_interval = 3600;
  const GoodputReport g2 = goodput_report(s2, 26.6);
  CHECK(g2.failures_per_gpu_hour == Approx(0.24 / 24 / 8));
  CHECK(g2.interval_iterations == std::llround(3600 / 26.6));
  CHECK(!g2.interval_auto);
  CHECK(g2.monte_carlo.goodput == Approx(g2.goodput).epsilon(0.02));
}

// Kept here with the goodput tests (core/plan uses them when the scenario has a reliability section).
TEST_CASE("plan: with a reliability section, time to train and GPU-hours include failures", "[reliability]") {
  Scenario sc = load_scenario(std::string(DSSIM_SCENARIOS_DIR) + "/gpt13b_zero2.yaml");
  PlanOptions o;
  o.vary = {PlanDim::micro_batch};
  o.objective = PlanObjective::time_to_train;
  const PlanResult clean = plan(sc, o);
  sc.reliability.declared = true;
  sc.reliability.failures_per_gpu_hour = 5e-3;  // a failure every ~3 h on 64 GPUs
  const PlanResult failing = plan(sc, o);
  REQUIRE(!clean.ranked.empty());
  REQUIRE(failing.ranked.size() == clean.ranked.size());
  for (const PlanEntry& c : clean.ranked) {
    CHECK(c.goodput == 1.0);
    const auto it = std::find_if(failing.ranked.begin(), failing.ranked.end(),
                                 [&](const PlanEntry& f) { return f.point.key() == c.point.key(); });
    REQUIRE(it != failing.ranked.end());
    INFO(c.point.key());
    CHECK(it->goodput > 0.5);
    CHECK(it->goodput < 0.99);
    CHECK(it->iteration_seconds == c.iteration_seconds);
    CHECK(it->time_to_train_seconds == Approx(c.time_to_train_seconds / it->goodput).epsilon(1e-12));
    CHECK(it->gpu_hours == Approx(c.gpu_hours / it->goodput).epsilon(1e-12));
    CHECK(it->goodput == Approx(goodput_report(sc, it->iteration_seconds, false).goodput).epsilon(1e-12));
  }
}
