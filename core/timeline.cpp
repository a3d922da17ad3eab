#include "core/timeline.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace dssim {

namespace {

// Which bucket of the breakdown a communication instruction's exposed time belongs to.
double* comm_bucket(TimeBreakdown& t, const Instruction& in) {
  switch (in.purpose) {
    case Purpose::TensorParallel: return &t.exposed_tp;
    case Purpose::PipelineActivation:
    case Purpose::PipelineGradient: return &t.exposed_pp;
    case Purpose::MoEDispatch:
    case Purpose::MoECombine: return &t.exposed_ep;
    case Purpose::OffloadGradient:
    case Purpose::OffloadParam:
    case Purpose::OffloadActivation: return &t.exposed_offload;
    default: return &t.exposed_dp;  // gradient reduce, param gather, embedding sync, 1-bit phases
  }
}

}  // namespace

double* busy_bucket(TimeBreakdown& t, const Instruction& in) {
  switch (in.op) {
    case Op::Forward: return &t.forward;
    case Op::Backward: return &t.backward;
    case Op::Recompute: return &t.recompute;
    case Op::OptimizerStep:
    case Op::HostOptimizerStep: return &t.optimizer;
    case Op::CopyH2D:
    case Op::CopyD2H: return &t.exposed_offload;
    default: return comm_bucket(t, in);
  }
}

TimeBreakdown attribute_time(const Program& program, const Timeline& timeline, int rank_index) {
  TimeBreakdown t;
  const RankProgram& rp = program.ranks.at(rank_index);
  const auto& spans = timeline.spans.at(rank_index);
  double cursor = 0;     // end of the compute stream's last instruction
  double rank_end = 0;
  int last_ending = -1;
  for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
    if (spans[i].end >= rank_end) { rank_end = spans[i].end; last_ending = static_cast<int>(i); }
    const Instruction& in = rp.instructions[i];
    if (in.stream != Stream::Compute) continue;
    const Span& sp = spans[i];
    const double gap = sp.start - cursor;
    if (gap > 0) {
      // The binding dependency: the one that finished last.
      int binding = -1;
      double binding_end = -1;
      for (uint32_t d = 0; d < in.deps_count; ++d) {
        const uint32_t dep = rp.deps[in.deps_begin + d];
        if (spans[dep].end > binding_end) { binding_end = spans[dep].end; binding = static_cast<int>(dep); }
      }
      if (binding >= 0 && binding_end >= sp.start - 1e-15) {
        const Instruction& b = rp.instructions[binding];
        const double comm_from = std::max(cursor, spans[binding].start);
        const double exposed = std::max(0.0, sp.start - comm_from);
        if (is_compute(b.op) && b.op != Op::HostOptimizerStep) {
          t.bubble += gap;
        } else {
          double* bucket = b.op == Op::HostOptimizerStep ? &t.optimizer : busy_bucket(t, b);
          *bucket += exposed;
          t.bubble += gap - exposed;
        }
      } else {
        t.bubble += gap;  // waiting at a rendezvous for slower peers, or for a pipeline neighbour
      }
    }
    if (in.chain < 0) {
      *busy_bucket(t, in) += sp.end - sp.start;
    } else {  // a collapsed chain: each member's seconds to its own part
      if (timeline.chain_member_seconds.size() != program.chain_members.size())
        throw std::logic_error("attribute_time: a collapsed chain without its members' seconds (Timeline::chain_member_seconds)");
      const Chain& c = program.chains[in.chain];
      for (uint32_t k = c.begin; k < c.begin + c.count; ++k)
        *busy_bucket(t, program.chain_members[k]) += timeline.chain_member_seconds[k];
    }
    cursor = sp.end;
  }
  // Work that runs past the compute stream's end (a trailing gradient reduction or parameter
  // all-gather; with offload the last gradient copies, the host step and the parameters' copy
  // back) is exposed, each stretch under the instruction that ends it, in the order they end:
  // the host step's seconds count as optimizer, the copies' as offload. The rest of the
  // iteration this rank waits for the slowest one.
  if (rank_end > cursor && last_ending >= 0) {
    std::vector<uint32_t> tail;
    for (uint32_t i = 0; i < rp.instructions.size(); ++i)
      if (rp.instructions[i].stream != Stream::Compute && spans[i].end > cursor) tail.push_back(i);
    std::sort(tail.begin(), tail.end(), [&](uint32_t a, uint32_t b) { return spans[a].end < spans[b].end; });
    double covered = cursor;
    for (uint32_t i : tail) {
      const double from = std::max(covered, spans[i].start);
      if (spans[i].end <= from) continue;
      const Instruction& in = rp.instructions[i];
      *(is_compute(in.op) && in.op != Op::HostOptimizerStep ? &t.bubble : busy_bucket(t, in)) += spans[i].end - from;
      t.bubble += from - covered;  // a gap with nothing running between two of them
      covered = spans[i].end;
    }
  }
  t.idle = std::max(0.0, timeline.makespan - std::max(rank_end, cursor));
  return t;
}

}  // namespace dssim
