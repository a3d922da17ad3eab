// dssim: distributed-training testbed. `dssim VERB ...`; `dssim help` lists the verbs.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/verbs.hpp"

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: dssim VERB [options]\n\n"
               "verbs:\n"
               "  scenario FILE.yaml   predict one training iteration: memory, time, where it goes\n"
               "  run FILE.yaml        train the scenario's model for real (libtorch; --backend cpu|cuda)\n"
               "  plan FILE.yaml       search TP/PP/DP/ZeRO/micro-batch/recompute/... for the fastest that fits\n"
               "  validate             predictions vs published tables and committed measurements\n"
               "  compare FILE.yaml    predicted vs measured (--backend cuda|cpu), per instruction kind\n"
               "  calibrate            measure this GPU (or CPU) into a device profile (--backend cuda|cpu)\n"
               "  help                 this text\n\n"
               "`dssim VERB --help` shows the verb's options. Scenario format: docs/scenario-format.md\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string verb = argv[1];
  if (verb == "help" || verb == "--help" || verb == "-h") {
    usage(stdout);
    return 0;
  }
  if (verb == "scenario") return dssim::cli::verb_scenario(argc - 1, argv + 1);
  if (verb == "run") return dssim::cli::verb_run(argc - 1, argv + 1);
  if (verb == "plan") return dssim::cli::verb_plan(argc - 1, argv + 1);
  if (verb == "validate") return dssim::cli::verb_validate(argc - 1, argv + 1);
  if (verb == "calibrate") return dssim::cli::verb_calibrate(argc - 1, argv + 1);
  if (verb == "compare") return dssim::cli::verb_compare(argc - 1, argv + 1);
  std::fprintf(stderr, "dssim: unknown verb '%s'\n\n", verb.c_str());
  usage(stderr);
  return 2;
}
