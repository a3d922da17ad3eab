// Planner speed: `dssim plan` over scenarios/gpt175b.yaml (GPT-3 175B, global batch 1536) on 1024
// A100-80GB, one thread. Prints the points enumerated, refused by validate, over memory, scored
// (and of those, extrapolated by the fast path), the wall time and the rates, for the fast path (extrapolated micro-batches) and, with --exact,
// the whole-Program estimator. Not a timed test: the figures go in docs/plan.md.
//   bench_plan [SCENARIO] [--gpus N] [--exact] [--vary tp,pp,...]
#include <cstdio>
#include <cstring>
#include <string>
#include "core/plan.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

int main(int argc, char** argv) {
  std::string name = "gpt175b";
  PlanOptions opts;
  bool both = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--exact")) { opts.exact = true; both = false; }
    else if (!std::strcmp(argv[i], "--fast")) { both = false; }
    else if (!std::strcmp(argv[i], "--gpus") && i + 1 < argc) opts.gpus = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--vary") && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t a = 0; a <= list.size();) {
        size_t b = list.find(',', a);
        if (b == std::string::npos) b = list.size();
        if (auto d = parse_plan_dim(list.substr(a, b - a))) opts.vary.push_back(*d);
        a = b + 1;
      }
    } else name = argv[i];
  }
  const Scenario sc = load_scenario(name);
  std::printf("%-8s %10s %9s %9s %8s %8s %8s %8s %8s %12s %12s  %s\n", "path", "enumerated", "invalid", "too_big", "scored",
              "extrap", "wall_s", "enum_s", "score_s", "points/s", "scored/s", "best");
  for (int pass = 0; pass < (both ? 2 : 1); ++pass) {
    if (both) opts.exact = pass == 1;
    const PlanResult r = plan(sc, opts);
    std::printf("%-8s %10zu %9zu %9zu %8zu %8zu %8.2f %8.2f %8.2f %12.0f %12.0f  %s %.4f s\n", opts.exact ? "exact" : "fast",
                r.enumerated, r.invalid, r.too_big, r.ranked.size(), r.extrapolated, r.seconds, r.enumerate_seconds, r.score_seconds,
                r.enumerated / r.enumerate_seconds, r.ranked.size() / r.score_seconds, r.ranked.empty() ? "-" : r.ranked[0].point.label().c_str(),
                r.ranked.empty() ? 0.0 : r.ranked[0].iteration_seconds);
    std::fflush(stdout);
  }
  return 0;
}
