// Runs a Program on the simulated platform: one SimGrid controller actor plays every rank's streams
// (compute and closed-form work are timers on its own event queue, so their times are exactly the
// DeviceModel's), and a pool of waiter actors runs the flows of collectives, send/recv and copies.
// Nothing here calls wait_any (SimGrid 3.32's is linear in its vector): a waiter sleeps on one
// semaphore per slice of flows, released by the network model's completion signal. Each
// simulation runs in a forked child: a SimGrid Engine lives once per process.
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
  // What-ifs (core/what_if.hpp). compute_scale[v]: the GPU's kernel times x this (1 / its speed
  // factor); empty = 1 everywhere. Noise: each compute instruction's time x a lognormal draw of
  // mean 1 and this coefficient of variation, from a hash of (seed, rank, instruction): the same
  // draws whatever order the simulation runs them in; 0 = none (the time is not touched).
  std::vector<double> compute_scale;
  double noise_cv = 0;
  uint64_t noise_seed = 0;
};

// The lognormal factor of mean 1 and coefficient of variation `cv` drawn for (seed, rank,
// instruction); exactly 1 when cv is 0.
double noise_factor(double cv, uint64_t seed, int rank, uint32_t instruction);

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
  // Collective arrivals: per virtual rank, the collectives it joined, those it arrived at last
  // (strictly after every other member), and the seconds the others waited for it there, by
  // group kind: {"rank", "joined", "last", "waited_for_seconds", "last_by_kind": {kind: n}}.
  nlohmann::json late = nlohmann::json::array();
};

// `seconds`: per template instruction durations (core's instruction_seconds), used for compute,
// closed-form collectives and unmaterialized peers. Throws std::runtime_error on deadlock.
ExecResult execute(const Scenario& sc, const Program& program, const std::vector<VirtualRank>& vranks,
                   const std::vector<std::vector<double>>& seconds, const ExecOptions& opts);

}  // namespace dssim::sim
