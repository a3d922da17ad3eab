// Analytic estimator: closed form per instruction (DeviceModel, collective_model), and the
// critical path through the Program's dependencies (stream order, cross-stream waits, collective
// rendezvous, send/recv matching). No contention: every collective runs as if alone.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"

namespace dssim {

// Durations of every instruction of every materialized rank (one repetition times `repeat`).
std::vector<std::vector<double>> instruction_seconds(const Scenario& sc, const Program& program);
// The same; a collapsed chain's (BuildOptions::collapse_chains) is the sum of its members', each
// written to `chain_member_seconds` [index into Program::chain_members] (needed when there are any).
// Collective prices kept across the Programs of one cluster (a planner's search): a collective's
// seconds depend on the cluster, its op, its bytes and its group's ranks only. Use one per cluster.
struct CollectivePrices {
  struct Entry { Op op; double bytes; std::vector<int> ranks; double seconds; };
  std::unordered_map<uint64_t, std::vector<Entry>> by_hash;
};
std::vector<std::vector<double>> instruction_seconds(const Scenario& sc, const Program& program,
                                                     std::vector<double>* chain_member_seconds,
                                                     CollectivePrices* shared = nullptr);

// Earliest-start schedule of the Program given per-instruction durations. Members of a group that
// are not materialized (representative_only) are assumed to reach a collective at the same time
// as the materialized member.
Timeline evaluate_program(const Program& program, const std::vector<std::vector<double>>& seconds);

Timeline estimate(const Scenario& sc, const Program& program, CollectivePrices* shared = nullptr);

// The whole analytic report: representative Program, estimate, memory plan, and (when it does not
// fit, or `always_suggest`) the fit advisor's alternatives.
struct Report;
Report analytic_report(const Scenario& sc, bool suggest = true);

}  // namespace dssim
