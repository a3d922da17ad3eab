// Entry points of the torch backend for `dssim run` (no torch headers: the CLI stays light).
#pragma once
#include <string>
#include <vector>
#include "backends/torch/engine_options.hpp"
#include "core/scenario.hpp"

namespace dssim::tb {

struct RunOptions {
  std::string backend = "cpu";   // cpu | cuda
  bool json = false;
  bool verbose = false;
  double timeout_seconds = 300;  // a collective (or the rendezvous) waiting longer fails the run
  EngineOptions engine;          // steps, data, checkpoints, test hooks
};

// Runs this process's rank: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the
// environment (a single rank when unset). Rank 0 prints the measured report. Returns the exit
// code: 0, 1 runtime failure (a dead peer, a timeout, loss scale at minimum), 2 bad input.
int run_rank(const Scenario& sc, const RunOptions& o);

// `--nproc N`: re-executes this program N times (its command line without --nproc) with the
// rendezvous environment set, and waits; when a rank fails, the others get `timeout_seconds` to
// exit before they are killed. Returns the worst exit code.
int spawn_local_ranks(int nproc, double timeout_seconds);

// The world size this process runs in: WORLD_SIZE if set, else 1.
int env_world_size();
bool env_has_rank();

}  // namespace dssim::tb
