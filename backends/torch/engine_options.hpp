// What one training run does (steps, data, checkpoints, test hooks): the engine's options, kept
// free of torch headers so that the CLI can fill them (backends/torch/run.hpp).
#pragma once
#include <string>
#include <vector>

namespace dssim::tb {

struct EngineOptions {
  int steps = 10;
  std::string data_path;        // empty: synthetic tokens
  std::string checkpoint_dir;   // empty: no checkpoints
  int save_every = 0;           // steps; 0 = only at the end (when checkpoint_dir is set)
  bool resume = false;
  int warmup_steps = -1;        // excluded from the median; -1 = min(2, steps / 4)
  bool progress = true;         // a line per step on stderr (rank 0)
  // Test hooks.
  int kill_rank = -1, kill_at_step = -1;  // SIGKILL this rank when it starts that step (1-based)
  int hang_rank = -1, hang_at_step = -1;  // SIGSTOP it instead: its peers' collectives hang
  std::vector<int> overflow_steps;        // steps (1-based) whose gradients are made inf (fp16)
  std::string dump_params;                // rank 0 writes the final fp32 parameters (raw floats)
};

}  // namespace dssim::tb
