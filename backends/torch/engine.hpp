// The ZeRO data-parallel engine: executes one rank's Program, instruction by instruction, on real
// tensors. Memory is laid out explicitly (core/zero_partition.hpp, applied in zero_state.hpp): flat
// fp32 master parameters (whole, or this rank's shard), 16-bit compute copies, flat gradient
// buffers reduced bucket by bucket where the Program reduces them.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/engine_options.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/zero_partition.hpp"

namespace dssim::tb {

struct EngineResult {
  std::vector<double> losses;        // per step, mean over micro-batches and data-parallel ranks
  std::vector<double> loss_scales;   // scale used at each step
  std::vector<bool> skipped;         // step skipped for overflow
  std::vector<double> step_seconds;
  std::map<std::string, double> seconds_by_op;  // time per instruction kind, summed over measured steps
  bool event_timing = false;  // seconds_by_op from CUDA events, not host syncs (one GPU, one rank; DSSIM_TIMING)
  int measured_steps = 0;
  int warmup_steps = 0;  // steps run before measuring (--warmup, or past 1-bit Adam's first compressed step)
  // Of seconds_by_op, over the measured steps: the tensor-parallel collectives (run inside the
  // compute, reported under their op names) and the waits for pipeline receives (under "recv":
  // the bubble plus the exposed transfer).
  double tp_comm_seconds = 0;
  double ep_comm_seconds = 0;        // the MoE all-to-alls (inside the compute, under "moe_all_to_all")
  CommCounters comm;                 // over the measured steps
  std::map<std::string, double> expected_bytes;  // Program's size bytes, same keys, same steps
  std::map<std::string, double> memory_bytes;    // peak by category
  // Optimizer offload, over the measured steps: the host gradient sums' busy seconds and bytes
  // (the worker thread), and the seconds the GPU-driving thread waited for room in their queue.
  std::map<std::string, double> host_offload;
  // MoE, over the measured steps: mean l_aux per layer, share of token-expert assignments dropped
  // for capacity, tokens gated per layer and micro-batch, expert capacity (slots per source rank).
  std::map<std::string, double> moe;
  int64_t first_step = 1;            // 1 unless resumed
  // ZeRO-3 only: whether backward accumulated into the gradient partition (no per-layer buffers,
  // no fold). Unset for other stages.
  std::optional<bool> zero3_backward_into_partition;
  // CUDA: the first measured step, instruction by instruction: bytes allocated after it and the
  // allocator's peak while it ran (what the memory model's categories are checked against).
  struct MemoryPoint {
    std::string op;
    int micro_batch = -1, layer_begin = -1;
    double allocated = 0, peak = 0;
  };
  std::vector<MemoryPoint> memory_timeline;
};

std::string counter_key(Op op, Purpose p);  // "reduce_scatter/gradient_reduce"

// The ZeRO layout the engine applies to the model's tensors (model order, one layer per unit).
ZeroPartition engine_partition(const Scenario& sc);

EngineResult train(const Scenario& sc, const Program& program, Communicator& comm,
                   const EngineOptions& opts, const torch::Device& device);

}  // namespace dssim::tb
