#include "core/schedule.hpp"

#include <algorithm>
#include <stdexcept>

namespace dssim {

const char* to_string(PipeCmd c) {
  switch (c) {
    case PipeCmd::LoadMicroBatch: return "LoadMicroBatch";
    case PipeCmd::ForwardPass: return "ForwardPass";
    case PipeCmd::BackwardPass: return "BackwardPass";
    case PipeCmd::SendActivation: return "SendActivation";
    case PipeCmd::RecvActivation: return "RecvActivation";
    case PipeCmd::SendGrad: return "SendGrad";
    case PipeCmd::RecvGrad: return "RecvGrad";
    case PipeCmd::ReduceTiedGrads: return "ReduceTiedGrads";
    case PipeCmd::ReduceGrads: return "ReduceGrads";
    case PipeCmd::OptimizerStep: return "OptimizerStep";
  }
  return "?";
}

std::string to_string(const PipeInstruction& i) {
  std::string s = to_string(i.cmd);
  if (i.buffer_id >= 0) s += " b" + std::to_string(i.buffer_id) + " m" + std::to_string(i.micro_batch);
  return s;
}

std::string to_string(const PipeStep& s) {
  return std::string(s.forward ? "F" : "B") + " c" + std::to_string(s.chunk) + " m" +
         std::to_string(s.micro_batch);
}

TrainSchedule::TrainSchedule(int micro_batches, int stages, int stage_id)
    : micro_batches_(micro_batches), stages_(stages), stage_id_(stage_id) {
  if (micro_batches < 1 || stages < 1 || stage_id < 0 || stage_id >= stages)
    throw std::invalid_argument("TrainSchedule: need micro_batches >= 1 and 0 <= stage_id < stages");
}

int TrainSchedule::num_pipe_buffers() const {
  return std::max(2, std::min(stages_ - stage_id_, micro_batches_));
}

// Even stages run forwards on even steps, odd stages on odd steps; a stage's forward of micro-batch
// m happens at step 2m + stage, its backward at step 2m + 2S - stage - 1 (integer halving below).
std::pair<int, bool> TrainSchedule::step_to_micro_batch(int step) const {
  const bool even_step = step % 2 == 0, even_stage = stage_id_ % 2 == 0;
  if (even_step && even_stage) return {step / 2 - stage_id_ / 2, true};
  if (!even_step && !even_stage) return {(step - 1) / 2 - stage_id_ / 2, true};
  if (even_step && !even_stage) return {step / 2 - stages_ + (stage_id_ + 1) / 2, false};
  return {(step - 1) / 2 - stages_ + 1 + stage_id_ / 2, false};
}

std::vector<PipeInstruction> TrainSchedule::step(int step_id) const {
  const auto [mb, forward] = step_to_micro_batch(step_id);
  // The previous step's micro-batch: its buffer is what this step sends.
  const int prev = step_id > 0 ? step_to_micro_batch(step_id - 1).first : -1;
  const int nbuf = num_pipe_buffers();
  const auto buf = [&](int m) { return m % nbuf; };
  const int prev_stage = stage_id_ - 1, next_stage = stage_id_ + 1;
  std::vector<PipeInstruction> cmds;
  if (forward) {
    if (valid_micro_batch(prev) && valid_stage(prev_stage))
      cmds.push_back({PipeCmd::SendGrad, buf(prev), prev});
    if (valid_micro_batch(mb) && valid_stage(prev_stage))
      cmds.push_back({PipeCmd::RecvActivation, buf(mb), mb});
  } else {
    if (valid_micro_batch(mb) && valid_stage(next_stage))
      cmds.push_back({PipeCmd::RecvGrad, buf(mb), mb});
    if (valid_micro_batch(prev) && valid_stage(next_stage))
      cmds.push_back({PipeCmd::SendActivation, buf(prev), prev});
  }
  if ((stage_id_ == 0 || stage_id_ == stages_ - 1) && forward && valid_micro_batch(mb))
    cmds.push_back({PipeCmd::LoadMicroBatch, buf(mb), mb});
  if (valid_micro_batch(mb))
    cmds.push_back({forward ? PipeCmd::ForwardPass : PipeCmd::BackwardPass, buf(mb), mb});
  if (step_id == total_steps() - 1) {
    cmds.push_back({PipeCmd::ReduceTiedGrads});
    cmds.push_back({PipeCmd::ReduceGrads});
    cmds.push_back({PipeCmd::OptimizerStep});
  }
  return cmds;
}

std::vector<std::vector<PipeInstruction>> TrainSchedule::steps() const {
  std::vector<std::vector<PipeInstruction>> all;
  all.reserve(total_steps());
  for (int i = 0; i < total_steps(); ++i) all.push_back(step(i));
  return all;
}

std::vector<PipeStep> compute_order(const TrainSchedule& s) {
  std::vector<PipeStep> order;
  for (int i = 0; i < s.total_steps(); ++i) {
    const auto [mb, forward] = s.step_to_micro_batch(i);
    if (mb >= 0 && mb < s.micro_batches()) order.push_back({forward, 0, mb});
  }
  return order;
}

int interleaved_warmup(int micro_batches, int stages, int stage_id, int chunks) {
  const int total = micro_batches * chunks;
  const int warmup = (stages - stage_id - 1) * 2 + (chunks - 1) * stages;
  return std::min(warmup, total);
}

std::vector<PipeStep> interleaved_1f1b(int micro_batches, int stages, int stage_id, int chunks) {
  if (micro_batches < 1 || stages < 1 || chunks < 1 || stage_id < 0 || stage_id >= stages)
    throw std::invalid_argument("interleaved_1f1b: bad sizes");
  if (chunks > 1 && micro_batches % stages != 0)
    throw std::invalid_argument("interleaved pipeline schedule: micro-batches (" +
                                std::to_string(micro_batches) +
                                ") must be a multiple of the pipeline size (" +
                                std::to_string(stages) + ")");
  const int group = stages * chunks;
  // Virtual micro-step k -> (chunk, micro-batch): micro-batches go through the chunks in groups of
  // p, so micro-batch = (k / pv) p + k mod p (the count of earlier steps on the same chunk).
  const auto at = [&](int k, bool forward) {
    const int in_group = k % group;
    int chunk = in_group / stages;
    if (!forward) chunk = chunks - 1 - chunk;
    return PipeStep{forward, chunk, (k / group) * stages + k % stages};
  };
  const int total = micro_batches * chunks;
  const int warmup = chunks == 1 ? std::min(stages - stage_id - 1, total)
                                 : interleaved_warmup(micro_batches, stages, stage_id, chunks);
  std::vector<PipeStep> order;
  order.reserve(2 * total);
  for (int k = 0; k < warmup; ++k) order.push_back(at(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(at(warmup + k, true));
    order.push_back(at(k, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(at(k, false));
  return order;
}

}  // namespace dssim
