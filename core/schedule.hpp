// Pipeline schedules as generators of small value-type instructions.
//
// TrainSchedule follows DeepSpeed's deepspeed/runtime/pipe/schedule.py (class TrainSchedule):
// 2 (M + S - 1) steps, each a list of commands that can be separated by barriers without deadlock;
// a stage alternates forward and backward steps with the parity of its stage id, which is what
// makes DeepSpeed's blocking send/recv pairs line up between neighbours.
//
// interleaved_1f1b follows Megatron-LM's forward_backward_pipelining_with_interleaving
// (megatron/core/pipeline_parallel/schedules.py): v model chunks per stage, virtual micro-steps
// k = 0 .. v M - 1, chunk of a forward k = (k mod p v) / p (backward: v - 1 - that), warm-up
// (p - rank - 1) 2 + (v - 1) p forwards, then 1F1B pairs, then the cool-down backwards.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dssim {

enum class PipeCmd : uint8_t {
  LoadMicroBatch, ForwardPass, BackwardPass, SendActivation, RecvActivation, SendGrad, RecvGrad,
  ReduceTiedGrads, ReduceGrads, OptimizerStep,
};
const char* to_string(PipeCmd);

struct PipeInstruction {
  PipeCmd cmd;
  int buffer_id = -1;    // DeepSpeed's pipe buffer (-1 for the batch-end commands)
  int micro_batch = -1;  // the micro-batch whose buffer the command uses
  bool operator==(const PipeInstruction&) const = default;
};
// "ForwardPass b1 m3"; batch-end commands print their name only.
std::string to_string(const PipeInstruction&);

class TrainSchedule {
 public:
  TrainSchedule(int micro_batches, int stages, int stage_id);
  int micro_batches() const { return micro_batches_; }
  int stages() const { return stages_; }
  int stage_id() const { return stage_id_; }
  int total_steps() const { return 2 * (micro_batches_ + stages_ - 1); }
  // max(2, min(S - stage, M)): the in-flight forwards of synchronous 1F1B.
  int num_pipe_buffers() const;
  // (micro-batch, is_forward) of a step; the micro-batch may be out of [0, M) (idle step).
  std::pair<int, bool> step_to_micro_batch(int step_id) const;
  std::vector<PipeInstruction> step(int step_id) const;
  std::vector<std::vector<PipeInstruction>> steps() const;

 private:
  bool valid_micro_batch(int m) const { return m >= 0 && m < micro_batches_; }
  bool valid_stage(int s) const { return s >= 0 && s < stages_; }
  int micro_batches_, stages_, stage_id_;
};

// One compute step of a stage: forward or backward of (model chunk, micro-batch).
struct PipeStep {
  bool forward = true;
  int chunk = 0;
  int micro_batch = 0;
  bool operator==(const PipeStep&) const = default;
};
std::string to_string(const PipeStep&);  // "F c0 m2" / "B c1 m0"

// The forward/backward order of a DeepSpeed TrainSchedule stage (one chunk).
std::vector<PipeStep> compute_order(const TrainSchedule& s);

// Megatron's interleaved 1F1B order for one stage. Requires micro_batches % stages == 0 when
// chunks > 1 (Megatron's assertion); throws std::invalid_argument otherwise.
std::vector<PipeStep> interleaved_1f1b(int micro_batches, int stages, int stage_id, int chunks);
// Megatron's warm-up forward count for the interleaved schedule (clamped to v M).
int interleaved_warmup(int micro_batches, int stages, int stage_id, int chunks);

// What a pipeline stage does, in order, as the Program builder emits it: its compute steps and
// the sends and receives between them.
enum class PipeAct : uint8_t { RecvAct, SendAct, RecvGrad, SendGrad, Fwd, Bwd };
struct PipeAction {
  PipeAct act;
  int chunk, mb;
  bool operator==(const PipeAction&) const = default;
};
std::string to_string(const PipeAction&);  // "RecvAct c0 m2", "Fwd c1 m0", ...

// Every stage's action list for `stages` stages of `chunks` model chunks and `micro_batches`
// micro-batches. One chunk: DeepSpeed's TrainSchedule, its loads and batch-end commands left out.
// Several: Megatron's interleaved 1F1B order (interleaved_1f1b), each send and receive placed by a
// unit-cost run (forward 1, backward 2) at the time its sender's step ends. Shared and kept (up to
// 8 M actions in all, then forgotten; thread-safe): they depend on these three numbers only, and a
// planner builds thousands of Programs from a few hundred of them.
std::shared_ptr<const std::vector<std::vector<PipeAction>>> stage_actions(int stages, int chunks, int micro_batches);

}  // namespace dssim
