// Runs a Program on the simulated platform: one SimGrid controller actor plays every rank's streams
// (compute and closed-form work are timers on its own event queue, so their times are exactly the
// DeviceModel's), and a pool of waiter actors runs the flows of collectives, send/recv and copies.
// Nothing here waits on more than one activity at a time (SimGrid 3.32's wait_any is linear in its
// vector), and each simulation runs in a forked child: a SimGrid Engine lives once per process.
#pragma once
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"
#include "simulator/collectives.hpp"
#include "simulator/platform.hpp"

namespace dssim::sim {

// A rank the simulation runs. Its instruction stream is Program::ranks[program_index]'s (the
// template), with groups and peers renamed through the maps (empty = identity).
struct VirtualRank {
  int rank = 0;
  int program_index = 0;
  std::vector<std::pair<int32_t, int32_t>> group_map;  // template group -> this rank's group, sorted
  std::vector<std::pair<int32_t, int32_t>> peer_map;   // template peer -> this rank's peer, sorted
  std::vector<int> represented;                         // ranks it stands for (folding); empty = itself
};

struct ExecOptions {
  CollectiveDetail detail = CollectiveDetail::Phase;
  bool nvswitch_closed_form = true;
  PlatformOptions platform;
  int busiest_links = 10;
};

struct ExecResult {
  std::vector<std::vector<Span>> spans;  // per virtual rank, per template instruction
  double makespan = 0;
  // Counters: instructions executed, flows (SimGrid comms), timers, comm jobs.
  uint64_t instructions = 0, flows = 0, timers = 0, jobs = 0;
  double engine_wall_seconds = 0;  // the child's simulation wall time (platform + run)
  double platform_seconds = 0;
  long child_peak_rss_kb = 0;
  nlohmann::json links = nlohmann::json::array();  // busiest links: name, bandwidth, bytes, utilization
  nlohmann::json link_classes = nlohmann::json::object();
};

// `seconds`: per template instruction durations (core's instruction_seconds), used for compute,
// closed-form collectives and unmaterialized peers. Throws std::runtime_error on deadlock.
ExecResult execute(const Scenario& sc, const Program& program, const std::vector<VirtualRank>& vranks,
                   const std::vector<std::vector<double>>& seconds, const ExecOptions& opts);

}  // namespace dssim::sim
