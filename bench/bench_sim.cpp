// Simulator speed: one iteration of scenarios/gpt175b.yaml (TP 8, PP 8, DP 16, 96 micro-batches,
// 1024 A100-80GB) on 1024 GPUs, then 4096 and 8192 (dp resized). Prints wall seconds, CPU seconds
// (this process and the simulation child: the machine is shared, wall time is noisy), peak RSS,
// simulated events per CPU second and a hash of the whole simulated timeline (every span's start
// and end, bit for bit), so that a change to the engine can be checked to give the same results.
// Not a timed test: the figures go in docs/simulator.md.
// Beyond 32,768 GPUs (dp > 512) the 1536 sequences do not divide over the pipelines: the global
// batch becomes 4 micro-batches per pipeline (printed: m), or --micro-batches M for every size.
//   bench_sim [gpus...] [--step] [--no-symmetry] [--micro-batches M]
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <sys/resource.h>
#include "backends/sim/sim_backend.hpp"
#include "core/estimator.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

namespace {

double cpu_seconds(int who) {
  struct rusage ru{};
  getrusage(who, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// FNV-1a over the simulated ranks, their span counts and every span's bits.
uint64_t timeline_hash(const SimRun& run) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t k = 0; k < n; ++k) { h ^= b[k]; h *= 1099511628211ull; }
  };
  mix(&run.timeline.makespan, sizeof(double));
  for (size_t k = 0; k < run.timeline.spans.size(); ++k) {
    const int rank = k < run.ranks.size() ? run.ranks[k] : -1;
    const uint64_t n = run.timeline.spans[k].size();
    mix(&rank, sizeof rank);
    mix(&n, sizeof n);
    mix(run.timeline.spans[k].data(), n * sizeof(Span));
  }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes;
  SimOptions opts;
  int micro_batches = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--step")) opts.detail = SimOptions::CollectiveDetail::Step;
    else if (!std::strcmp(argv[i], "--no-symmetry")) opts.symmetry = false;
    else if (!std::strcmp(argv[i], "--micro-batches") && i + 1 < argc) micro_batches = std::atoi(argv[++i]);
    else sizes.push_back(std::atoi(argv[i]));
  }
  if (sizes.empty()) sizes = {1024, 4096, 8192};
  std::printf("%6s %4s %9s %12s %9s %8s %8s %8s %7s %10s %11s %10s %9s %s\n", "gpus", "m", "sim_ranks", "iter_s",
              "analytic", "wall_s", "cpu_s", "engine_s", "plat_s", "flows", "instr", "events/s", "rss_MB",
              "timeline_hash");
  for (int gpus : sizes) {
    LoadOptions lo;
    lo.gpus = gpus;
    const int dp = gpus / 64;  // gpt175b: tp 8, pp 8
    int m = micro_batches;
    if (m == 0 && dp > 0 && (dp > 1536 || 1536 % dp != 0)) m = 4;
    if (m > 0) lo.overrides.push_back("training.global_batch=" + std::to_string(m * dp));
    const Scenario sc = load_scenario("gpt175b", lo);
    const double cpu0 = cpu_seconds(RUSAGE_SELF) + cpu_seconds(RUSAGE_CHILDREN);
    const SimRun run = simulate_run(sc, opts);
    const double cpu = cpu_seconds(RUSAGE_SELF) + cpu_seconds(RUSAGE_CHILDREN) - cpu0;
    const double analytic = analytic_report(sc, false).iteration_seconds;
    struct rusage self{};
    getrusage(RUSAGE_SELF, &self);
    const long rss_kb = std::max<long>(self.ru_maxrss, run.peak_rss_kb);
    const double events = double(run.flows + run.instructions);
    // events/s per CPU second of the whole call (Program build + simulation + report).
    const double plat = run.report.extras["sim"]["run_stats"].value("platform_seconds", 0.0);
    std::printf("%6d %4d %9zu %12.9f %9.3f %8.2f %8.2f %8.2f %7.2f %10llu %11llu %10.0f %9.0f %016llx\n", gpus,
                sc.training.grad_accum, run.ranks.size(), run.report.iteration_seconds, analytic, run.wall_seconds,
                cpu, run.engine_seconds, plat, (unsigned long long)run.flows, (unsigned long long)run.instructions,
                events / cpu, rss_kb / 1024.0, (unsigned long long)timeline_hash(run));
    std::fflush(stdout);
  }
  return 0;
}
