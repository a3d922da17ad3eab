// The ZeRO data-parallel engine: executes one rank's Program, instruction by instruction, on real
// tensors. Memory is laid out explicitly (core/zero_partition.hpp): flat fp32 master parameters
// (whole, or this rank's shard), 16-bit compute copies, flat gradient buffers reduced bucket by
// bucket where the Program reduces them.
#pragma once
#include <map>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/zero_partition.hpp"

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

struct EngineResult {
  std::vector<double> losses;        // per step, mean over micro-batches and data-parallel ranks
  std::vector<double> loss_scales;   // scale used at each step
  std::vector<bool> skipped;         // step skipped for overflow
  std::vector<double> step_seconds;
  std::map<std::string, double> seconds_by_op;  // time per instruction kind, summed over measured steps
  int measured_steps = 0;
  CommCounters comm;                 // over the measured steps
  std::map<std::string, double> expected_bytes;  // Program's size bytes, same keys, same steps
  std::map<std::string, double> memory_bytes;    // peak by category
  int64_t first_step = 1;            // 1 unless resumed
};

std::string counter_key(Op op, Purpose p);  // "reduce_scatter/gradient_reduce"

// The ZeRO layout the engine applies to the model's tensors (model order, one layer per unit).
ZeroPartition engine_partition(const Scenario& sc);

EngineResult train(const Scenario& sc, const Program& program, Communicator& comm,
                   const EngineOptions& opts, const torch::Device& device);

}  // namespace dssim::tb
