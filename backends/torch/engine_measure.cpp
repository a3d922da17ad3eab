#include "backends/torch/engine_measure.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <fstream>
#include "backends/torch/env.hpp"
#include "backends/torch/torch_compat.hpp"
#if defined(DSSIM_TORCH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace dssim::tb {

#if defined(DSSIM_TORCH_CUDA)
struct InstructionMeter::Marks {
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> events;
  int used = 0;
};

void InstructionMeter::use_events(bool on) {
  events_ = on && dev_.is_cuda();
  if (events_ && !marks_) marks_ = std::make_shared<Marks>();
}

int InstructionMeter::record_mark() {
  auto& m = *marks_;
  if (m.used == int(m.events.size()))
    m.events.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));  // with timing
  m.events[m.used]->record(c10::cuda::getCurrentCUDAStream(dev_.index()));
  return m.used++;
}

void InstructionMeter::resolve_step() {
  if (!events_) return;
  for (const Pending& p : pending_) {
    const double seconds = marks_->events[p.start]->elapsed_time(*marks_->events[p.end]) / 1e3;
    seconds_by_op[p.kind] += seconds - p.less;
  }
  pending_.clear();
}

void InstructionMeter::step_start() {
  if (!events_) return;
  pending_.clear();
  marks_->used = 0;
  last_mark_ = record_mark();
}
#else  // no CUDA: host timing only
struct InstructionMeter::Marks {};
void InstructionMeter::use_events(bool) { events_ = false; }
int InstructionMeter::record_mark() { return -1; }
void InstructionMeter::step_start() {}
void InstructionMeter::resolve_step() {}
#endif

void InstructionMeter::use_events_from_env(int world_size) {
  const std::string timing = env_str("DSSIM_TIMING", "events");
  if (timing != "sync" && timing != "events")
    throw std::invalid_argument("DSSIM_TIMING is '" + timing + "'; set it to events (the default) or sync");
  use_events(timing == "events" && world_size == 1);
}

InstructionMeter::Span InstructionMeter::begin(bool timed, double comm_wait_seconds) const {
  Span s;
  s.t0 = Clock::now();
  s.timed = timed;
  if (timed) s.inner0 = inner_seconds;
  s.comm_wait0 = comm_wait_seconds;
  if (timed && events_) s.start_mark = last_mark_;
  return s;
}

void InstructionMeter::end(const Span& span, const Instruction& in, double comm_wait_seconds) {
  if (!span.timed) return;
  const double dt = seconds_since(span.t0);
  double inner = 0;
  for (const auto& [kind, sec] : inner_seconds) {
    const auto it = span.inner0.find(kind);
    const double d = sec - (it == span.inner0.end() ? 0.0 : it->second);
    if (d > 0) seconds_by_op[kind] += d, inner += d;
  }
  const double cw = comm_wait_seconds - span.comm_wait0;
  if (span.start_mark >= 0) {  // event timing: resolved after the step's final sync
    last_mark_ = record_mark();
    pending_.push_back({to_string(in.op), span.start_mark, last_mark_, inner + cw});
  } else {
    seconds_by_op[to_string(in.op)] += dt - inner - cw;
  }
  add_comm_wait(cw);
  if (is_collective(in.op) || in.op == Op::CopyD2H || in.op == Op::CopyH2D || in.op == Op::Send || in.op == Op::Recv)
    expected[counter_key(in.op, in.purpose)] += in.bytes * std::max(1, in.repeat);
}

void InstructionMeter::add_compute_collectives(std::map<Op, double>& tp_seconds, double& ep_seconds) {
  for (auto& [op, sec] : tp_seconds) {
    inner_seconds[to_string(op)] += sec;
    tp_comm_seconds += sec;
  }
  tp_seconds.clear();
  if (ep_seconds > 0) {
    inner_seconds["moe_all_to_all"] += ep_seconds;
    ep_comm_seconds += ep_seconds;
    ep_seconds = 0;
  }
}

void InstructionMeter::memory_before() {
  peak_seen_ = std::max(peak_seen_, cuda_peak_allocated_bytes(dev_));
  cuda_reset_peak(dev_);
}

void InstructionMeter::memory_after(const Instruction& in, std::vector<EngineResult::MemoryPoint>& timeline) {
  const double peak = cuda_peak_allocated_bytes(dev_);
  peak_seen_ = std::max(peak_seen_, peak);
  timeline.push_back({to_string(in.op), in.micro_batch, in.layer_begin, cuda_allocated_bytes(dev_), peak});
}

double InstructionMeter::host_peak_bytes() {
  std::ifstream st("/proc/self/status");
  std::string line;
  while (std::getline(st, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  return 0;
}

double InstructionMeter::peak_memory_bytes() const {
  const double cuda = cuda_peak_allocated_bytes(dev_);
  if (cuda >= 0) return std::max(cuda, peak_seen_);  // the timeline restarts the allocator's peak
  return host_peak_bytes();
}

void InstructionMeter::verify_bytes(const std::map<std::string, double>& moved,
                                    const std::set<std::string>& unchecked, int rank) const {
  std::map<std::string, double> all = expected;
  for (const auto& [k, v] : moved) all.emplace(k, 0.0);
  for (const auto& [k, want] : all) {
    if (unchecked.count(k)) continue;
    const auto it = moved.find(k);
    const double have = it == moved.end() ? 0.0 : it->second;
    if (std::abs(have - want) > 0.5)
      throw std::runtime_error("Program/engine mismatch on rank " + std::to_string(rank) + ": " + k + " moved " +
                               std::to_string(have) + " bytes over the measured steps, the Program says " +
                               std::to_string(want));
  }
}

}  // namespace dssim::tb
