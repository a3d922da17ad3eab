#include "core/schedule.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

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


std::string to_string(const PipeAction& a) {
  static const char* const names[] = {"RecvAct", "SendAct", "RecvGrad", "SendGrad", "Fwd", "Bwd"};
  return std::string(names[static_cast<int>(a.act)]) + " c" + std::to_string(a.chunk) + " m" + std::to_string(a.mb);
}

namespace {

// One chunk: DeepSpeed's TrainSchedule commands that move data or compute, in order.
std::vector<PipeAction> deepspeed_actions(int stages, int micro_batches, int s) {
  std::vector<PipeAction> acts;
  const TrainSchedule sched(micro_batches, stages, s);
  for (int i = 0; i < sched.total_steps(); ++i) {
    for (const PipeInstruction& pi : sched.step(i)) {
      switch (pi.cmd) {
        case PipeCmd::RecvActivation: acts.push_back({PipeAct::RecvAct, 0, pi.micro_batch}); break;
        case PipeCmd::SendActivation: acts.push_back({PipeAct::SendAct, 0, pi.micro_batch}); break;
        case PipeCmd::RecvGrad: acts.push_back({PipeAct::RecvGrad, 0, pi.micro_batch}); break;
        case PipeCmd::SendGrad: acts.push_back({PipeAct::SendGrad, 0, pi.micro_batch}); break;
        case PipeCmd::ForwardPass: acts.push_back({PipeAct::Fwd, 0, pi.micro_batch}); break;
        case PipeCmd::BackwardPass: acts.push_back({PipeAct::Bwd, 0, pi.micro_batch}); break;
        default: break;  // loads are implicit; the batch end is emitted after the actions
      }
    }
  }
  return acts;
}

// Several chunks: Megatron's interleaved order per stage, run at unit cost to place the p2p.
std::vector<std::vector<PipeAction>> interleaved_actions(int p, int v, int M) {
  const int V = p * v;
  std::vector<std::vector<PipeStep>> order(p);
  for (int s = 0; s < p; ++s) order[s] = interleaved_1f1b(M, p, s, v);
  // start/end of F and B per (virtual stage, micro-batch)
  std::vector<int64_t> f_end(V * M, -1), b_end(V * M, -1), f_start(V * M, -1), b_start(V * M, -1);
  std::vector<size_t> next(p, 0);
  std::vector<int64_t> free_at(p, 0);
  size_t remaining = 0;
  for (auto& o : order) remaining += o.size();
  while (remaining > 0) {
    bool progress = false;
    for (int s = 0; s < p; ++s) {
      while (next[s] < order[s].size()) {
        const PipeStep& st = order[s][next[s]];
        const int vs = st.chunk * p + s;
        int64_t dep = 0;
        if (st.forward) {
          if (vs > 0) dep = f_end[(vs - 1) * M + st.micro_batch];
        } else {
          dep = vs == V - 1 ? f_end[vs * M + st.micro_batch] : b_end[(vs + 1) * M + st.micro_batch];
        }
        if (dep < 0) break;
        const int64_t start = std::max(free_at[s], dep);
        const int64_t end = start + (st.forward ? 1 : 2);
        (st.forward ? f_start : b_start)[vs * M + st.micro_batch] = start;
        (st.forward ? f_end : b_end)[vs * M + st.micro_batch] = end;
        free_at[s] = end;
        ++next[s];
        --remaining;
        progress = true;
      }
    }
    if (!progress) throw std::logic_error("interleaved schedule: dependency cycle");
  }
  // Events per stage: (time, class, key...) -> action. Class 0 = p2p (keyed by the sender's
  // finish time and identity, identical on both sides), class 1 = compute. The key (time, class,
  // virtual stage, micro-batch, direction), all of them non-negative (checked), packed into one
  // integer of the same order as the tuple's: time in the high 32 bits, then class (1 bit),
  // virtual stage and micro-batch (31 bits each), direction (1 bit), and the event's insertion
  // index in the low 32 (unique keys: std::sort gives a stable sort's order).
  using Key = unsigned __int128;
  std::vector<std::vector<PipeAction>> out(p);
  std::vector<std::pair<Key, PipeAction>> ev;
  auto pack = [&ev](int64_t time, int cls, int vs, int mb, int dir) -> Key {
    if (time < 0 || time >= (int64_t(1) << 32) || vs < 0 || mb < 0 || ev.size() >= (size_t(1) << 32))
      throw std::logic_error("interleaved schedule: key out of range");
    return (Key(uint64_t(time)) << 96) | (Key(uint64_t(cls)) << 95) | (Key(uint64_t(uint32_t(vs))) << 64) |
           (Key(uint64_t(uint32_t(mb))) << 33) | (Key(uint64_t(dir)) << 32) | Key(ev.size());
  };

  for (int s = 0; s < p; ++s) {
    ev.clear();
    ev.reserve(3 * order[s].size());
    for (const PipeStep& st : order[s]) {
      const int vs = st.chunk * p + s;
      const int mb = st.micro_batch;
      if (st.forward) {
        ev.push_back({pack(f_start[vs * M + mb], 1, 0, 0, 0), {PipeAct::Fwd, st.chunk, mb}});
        if (p > 1 && vs > 0)
          ev.push_back({pack(f_end[(vs - 1) * M + mb], 0, vs - 1, mb, 0), {PipeAct::RecvAct, st.chunk, mb}});
        if (p > 1 && vs < V - 1)
          ev.push_back({pack(f_end[vs * M + mb], 0, vs, mb, 0), {PipeAct::SendAct, st.chunk, mb}});
      } else {
        ev.push_back({pack(b_start[vs * M + mb], 1, 0, 0, 0), {PipeAct::Bwd, st.chunk, mb}});
        if (p > 1 && vs < V - 1)
          ev.push_back({pack(b_end[(vs + 1) * M + mb], 0, vs + 1, mb, 1), {PipeAct::RecvGrad, st.chunk, mb}});
        if (p > 1 && vs > 0)
          ev.push_back({pack(b_end[vs * M + mb], 0, vs, mb, 1), {PipeAct::SendGrad, st.chunk, mb}});
      }
    }
    std::sort(ev.begin(), ev.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    out[s].reserve(ev.size());
    for (const auto& e : ev) out[s].push_back(e.second);
  }
  return out;
}

}  // namespace

std::shared_ptr<const std::vector<std::vector<PipeAction>>> stage_actions(int stages, int chunks, int micro_batches) {
  // Kept up to kCachedActions actions in all (GPT-3 175B's search on 1,024 GPUs meets 257 keys,
  // 1.1 M actions; a cache of the last 64 keys recomputed 469 schedules).
  constexpr size_t kCachedActions = size_t(1) << 23;  // 8 M actions, 96 MB
  using Stages = std::vector<std::vector<PipeAction>>;
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, std::shared_ptr<const Stages>> cache;
  static size_t cached_actions = 0;
  const auto key = std::make_tuple(stages, chunks, micro_batches);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  Stages all(stages);
  if (chunks == 1) {
    for (int s = 0; s < stages; ++s) all[s] = deepspeed_actions(stages, micro_batches, s);
  } else {
    all = interleaved_actions(stages, chunks, micro_batches);
  }
  auto shared = std::make_shared<const Stages>(std::move(all));
  size_t actions = 0;
  for (const auto& stage : *shared) actions += stage.size();
  std::lock_guard<std::mutex> lock(mutex);
  if (cached_actions + actions > kCachedActions) cache.clear(), cached_actions = 0;
  if (cache.emplace(key, shared).second) cached_actions += actions;
  return shared;
}

}  // namespace dssim
