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
#include "core/what_if.hpp"

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
  // What-ifs (core/what_if.hpp; docs/simulator.md "What-ifs"). Any what-if turns TP folding off
  // (the slow GPU or degraded link makes the folded ranks differ); stage representatives are
  // still expanded (exact). A what-if on an NVLink also turns the NVSwitch closed form off.
  std::vector<WhatIf> what_ifs;
  uint64_t noise_seed = 1;          // the noise what-if's draws
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

// The what-if run compared with the clean run, in one call: runs the scenario clean (the what-ifs
// of `opts` removed) and with the what-ifs (`samples` times with seeds noise_seed, noise_seed + 1,
// ... when one of them is noise), and returns the what-if run's report (the first sample's) with
// Report::extras["what_if"]: the clean and what-if iteration times, the change, the rank that
// kept the others waiting at collectives, and with noise the mean, spread and range over samples.
Report simulate_what_if(const Scenario& sc, const SimOptions& opts, int samples = 1);

// Parses "phase" | "step" (the CLI's --collective-detail); throws std::invalid_argument.
SimOptions::CollectiveDetail parse_collective_detail(const std::string& s);

}  // namespace dssim
