// What the engine (engine.cpp) measures while it interprets the Program, kept apart from the
// interpretation: seconds per instruction kind, the bytes each kind should have moved, and the
// memory timeline and peak. The engine opens a span before each instruction and closes it once
// the device has finished it (engine.cpp execute(): a sync after collectives, a stream sync before
// an instruction of another kind); work that one instruction runs on behalf of another kind
// (recompute inside Backward, a pipeline receive inside Forward, the parameter copy inside the host
// step, TP and MoE collectives inside the compute) is added to `inner_seconds` and reported under
// its own kind, not the instruction's.
//
// Event timing (the default on one GPU and one rank; DSSIM_TIMING=sync turns it off: two H100 A/Bs,
// +0.50 % and +0.56 % tokens/s at 1.3B 8 x 1): the
// instructions' boundaries are CUDA events recorded on the compute stream instead of host syncs, so
// the host queues the next instruction while the GPU runs the last one (a sync at each change of
// kind leaves the GPU idle for the few hundred microseconds the host takes to queue the next
// kernels). An instruction's seconds are the GPU's time from the previous boundary to its own,
// resolved once the step's final sync has completed the events (resolve_step). With one rank nothing
// the host waits on (a peer's message, a data-parallel collective) falls inside an instruction; the
// inner work kept apart (recompute, ZeRO-3's gathers, MoE routing) is still timed between syncs.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>
#include "backends/torch/engine.hpp"
#include "backends/torch/stopwatch.hpp"
#include "core/program.hpp"

namespace dssim::tb {

class InstructionMeter {
 public:
  explicit InstructionMeter(const torch::Device& dev) : dev_(dev) {}

  // One instruction's timing: its start, and what had been counted before it.
  struct Span {
    Clock::time_point t0;
    std::map<std::string, double> inner0;
    double comm_wait0 = 0;
    bool timed = false;
    int start_mark = -1;  // event timing: the boundary event it starts at
  };
  // Opens the span of an instruction (`timed`: the engine is measuring); comm_wait_seconds is the
  // ZeRO state's running data-parallel wait.
  Span begin(bool timed, double comm_wait_seconds) const;
  // Closes it once the device has finished the instruction: its seconds, less the inner work and
  // the data-parallel wait (reported as `dp_comm_wait`), under its kind; the bytes the Program says
  // its copies and collectives move. Nothing when the span was not timed.
  void end(const Span& span, const Instruction& in, double comm_wait_seconds);

  // TP and MoE collectives issued inside the compute: their kinds' inner seconds, and the totals
  // the report shows as communication inside the compute.
  void add_compute_collectives(std::map<Op, double>& tp_seconds, double& ep_seconds);
  // Event timing (above) as DSSIM_TIMING says ("events", the default, or "sync"; anything else
  // throws, naming the variable), on where the device is a GPU and `world_size` is 1; whether it is on.
  void use_events_from_env(int world_size);
  bool events() const { return events_; }
  // Event timing: the step's first boundary (after its opening sync), and, after its final sync,
  // each instruction's seconds from its events.
  void step_start();
  void resolve_step();
  // A data-parallel wait outside every instruction (the step's final flush).
  void add_comm_wait(double seconds) { if (seconds > 0) seconds_by_op["dp_comm_wait"] += seconds; }

  // The memory timeline (CUDA): before an instruction, the allocator's peak so far is kept and
  // restarted; after it, the bytes allocated and the peak while it ran.
  void memory_before();
  void memory_after(const Instruction& in, std::vector<EngineResult::MemoryPoint>& timeline);
  // The run's peak: the allocator's (with what the timeline restarted), or the host's high-water mark.
  double peak_memory_bytes() const;
  static double host_peak_bytes();

  // Every rank's bytes per "op/purpose" over the measured steps (`moved`) are its Program's
  // (`expected`; the report shows rank 0's): a difference on any rank throws, so a run that passes
  // moved exactly what the Program says. Control traffic (purpose none) is not the Program's and is
  // left out of `moved`; `unchecked` keys are sized at run time (MoE without token dropping).
  void verify_bytes(const std::map<std::string, double>& moved, const std::set<std::string>& unchecked,
                    int rank) const;

  std::map<std::string, double> inner_seconds;            // by instruction kind, running totals
  std::map<std::string, double> seconds_by_op, expected;  // over the measured steps
  double tp_comm_seconds = 0, ep_comm_seconds = 0;        // over the measured steps

 private:
  // Records a boundary event on the current stream; its index.
  int record_mark();
  void use_events(bool on);

  torch::Device dev_;
  double peak_seen_ = 0;  // the allocator's peak before the timeline restarted it
  // Event timing: the boundary events (reused from step to step), how many this step recorded, the
  // last one, and the instructions to resolve (kind, start and end event, the inner seconds and
  // data-parallel wait already reported under their own kinds).
  struct Marks;
  std::shared_ptr<Marks> marks_;
  struct Pending {
    std::string kind;
    int start = 0, end = 0;
    double less = 0;
  };
  std::vector<Pending> pending_;
  bool events_ = false;
  int last_mark_ = -1;
};

}  // namespace dssim::tb
