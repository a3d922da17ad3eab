// The result of interpreting a Program: when each instruction ran, on every materialized rank.
// Both the analytic estimator and the simulator produce one; attribution of time (compute,
// exposed communication per group, bubble) and the report are computed from it the same way.
#pragma once
#include <vector>
#include "core/program.hpp"

namespace dssim {

struct Span {
  double start = 0;  // seconds from iteration start
  double end = 0;    // includes all `repeat` repetitions
};

struct Timeline {
  std::vector<std::vector<Span>> spans;  // [index into Program::ranks][instruction index]
  double makespan = 0;                   // iteration time: the last instruction's end on any rank
  // A Program with collapsed chains (BuildOptions::collapse_chains): the seconds of each member
  // [index into Program::chain_members], which attribute_time splits a chain's span by.
  std::vector<double> chain_member_seconds;
};

// Where one rank's iteration time goes, in seconds; sums to the makespan.
struct TimeBreakdown {
  double forward = 0, backward = 0, recompute = 0, optimizer = 0;
  double exposed_tp = 0, exposed_pp = 0, exposed_dp = 0, exposed_ep = 0, exposed_offload = 0;
  double bubble = 0;   // compute stream idle waiting on other pipeline stages
  double idle = 0;     // idle at the end of the iteration (waiting for the slowest rank)
  double total() const {
    return forward + backward + recompute + optimizer + exposed_tp + exposed_pp + exposed_dp +
           exposed_ep + exposed_offload + bubble + idle;
  }
};

// Attributes the compute-stream timeline of Program::ranks[rank_index]: busy time by compute op
// (TP and EP collectives, which block the compute stream, count as exposed TP / EP), and every gap
// to the instruction that ended it: the part of the gap during which the binding dependency (a
// communication instruction) was running is exposed communication of its group kind; the part
// before it (a Recv waiting for the previous stage) is pipeline bubble.
TimeBreakdown attribute_time(const Program& program, const Timeline& timeline, int rank_index);

// The part of the breakdown an instruction's busy time counts as.
double* busy_bucket(TimeBreakdown& t, const Instruction& in);

}  // namespace dssim
