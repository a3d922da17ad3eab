// The simulator backend: runs a scenario's Program on a SimGrid model of its cluster and returns
// the same Report as the analytic estimator (core/estimator.hpp), through the same
// Timeline -> attribute_time -> fill_throughput path, plus what only a simulation can tell, in
// Report::extras["sim"]: exposed vs overlapped communication per group kind, the simulated
// bubble, the busiest links and their utilization, per-rank slack and the straggler.
#pragma once
#include <string>
#include <vector>
#include "core/program.hpp"
#include "core/report.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"

namespace dssim {

struct SimOptions {
  std::string trace_path;           // Chrome trace / Perfetto JSON; empty = none
  std::vector<int> trace_ranks;     // ranks to trace (empty = every simulated rank)
  enum class CollectiveDetail { Phase, Step } detail = CollectiveDetail::Phase;
  // Shortcuts, each tested against the full model (tests/sim/test_shortcuts.cpp):
  bool symmetry = true;             // simulate one rank per TP group when TP is closed form and the
                                    // group's members are provably identical; build the Program
                                    // with one representative per stage and expand it
  bool nvswitch_closed_form = true; // collectives inside one NVSwitch node: exact closed form
  int nodes_per_leaf = 32;          // fat tree: nodes under one (rail) leaf switch
  int leaves_per_pod = 16;          // three-level trees: leaves per pod
  int busiest_links = 10;           // links listed in extras.sim.links.busiest (those with traffic)
};

// What a simulation produced, for callers that want more than the Report (tests, bench).
struct SimRun {
  Report report;
  Timeline timeline;                // spans per simulated rank ([k] is ranks[k])
  std::vector<int> ranks;           // global rank of each simulated rank
  std::vector<int> templates;       // Program::ranks index whose instructions rank k runs
  int ranks_represented = 0;        // ranks the simulated ones stand for
  uint64_t flows = 0, instructions = 0;
  double wall_seconds = 0;          // whole simulate() call: Program build + simulation + report
  double engine_seconds = 0;        // the SimGrid part
  long peak_rss_kb = 0;             // the simulation process's peak RSS
};

Report simulate(const Scenario& sc, const SimOptions& opts = {});
// A given Program (hand-built in tests, or built by the caller).
Report simulate_program(const Scenario& sc, const Program& program, const SimOptions& opts = {});
SimRun simulate_run(const Scenario& sc, const SimOptions& opts = {});
SimRun simulate_program_run(const Scenario& sc, const Program& program, const SimOptions& opts = {});

// Parses "phase" | "step" (the CLI's --collective-detail); throws std::invalid_argument.
SimOptions::CollectiveDetail parse_collective_detail(const std::string& s);

}  // namespace dssim
