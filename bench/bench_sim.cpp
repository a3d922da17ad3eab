// Simulator speed: one iteration of scenarios/gpt175b.yaml (TP 8, PP 8, DP 16, 96 micro-batches,
// 1024 A100-80GB) on 1024 GPUs, then 4096 and 8192 (dp resized). Prints wall seconds, peak RSS and
// simulated events per second. Not a timed test: the figures go in docs/simulator.md.
//   bench_sim [gpus...] [--step] [--no-symmetry]
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <sys/resource.h>
#include "backends/sim/sim_backend.hpp"
#include "core/estimator.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

int main(int argc, char** argv) {
  std::vector<int> sizes;
  SimOptions opts;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--step")) opts.detail = SimOptions::CollectiveDetail::Step;
    else if (!std::strcmp(argv[i], "--no-symmetry")) opts.symmetry = false;
    else sizes.push_back(std::atoi(argv[i]));
  }
  if (sizes.empty()) sizes = {1024, 4096, 8192};
  std::printf("%6s %9s %9s %9s %10s %10s %12s %12s %10s %9s\n", "gpus", "sim_ranks", "iter_s", "analytic",
              "wall_s", "engine_s", "flows", "instr", "events/s", "rss_MB");
  for (int gpus : sizes) {
    LoadOptions lo;
    lo.gpus = gpus;
    const Scenario sc = load_scenario("gpt175b", lo);
    const SimRun run = simulate_run(sc, opts);
    const double analytic = analytic_report(sc, false).iteration_seconds;
    struct rusage self{};
    getrusage(RUSAGE_SELF, &self);
    const long rss_kb = std::max<long>(self.ru_maxrss, run.peak_rss_kb);
    const double events = double(run.flows + run.instructions);
    std::printf("%6d %9zu %9.3f %9.3f %10.2f %10.2f %12llu %12llu %10.0f %9.0f\n", gpus, run.ranks.size(),
                run.report.iteration_seconds, analytic, run.wall_seconds, run.engine_seconds,
                (unsigned long long)run.flows, (unsigned long long)run.instructions, events / run.engine_seconds,
                rss_kb / 1024.0);
    std::fflush(stdout);
  }
  return 0;
}
