// Analytic estimator: closed form per instruction (DeviceModel, collective_model), and the
// critical path through the Program's dependencies (stream order, cross-stream waits, collective
// rendezvous, send/recv matching). No contention: every collective runs as if alone.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>
#include "core/device_model.hpp"
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

// A Program with its durations and timeline, kept to evaluate another Program that shares most of
// it (a planner's configurations that differ only at the batch end: ZeRO 0 / 1 and the optimizer
// offload with pp > 1 emit the same pipeline).
struct EvaluatedProgram {
  Program program;
  std::vector<std::vector<double>> seconds;
  Timeline timeline;  // (its chain_member_seconds: the collapsed chains' members')
  // What `seconds` were priced from (PricingInputs(scenario)); null: not known, nothing taken from them.
  std::shared_ptr<const PricingInputs> pricing;
};
// Per rank, the length of the common prefix (byte for byte) of a Program's instruction array and
// its reference's: computed once by instruction_seconds_reusing, read by evaluate_program_reusing
// (for the same Program and reference only; otherwise it compares them itself).
struct CommonPrefix {
  const Program* program = nullptr;
  const EvaluatedProgram* ref = nullptr;
  std::vector<size_t> instructions;
};
// instruction_seconds(sc, program, chain_member_seconds, shared), taking from `ref` the seconds of
// an instruction in a rank's common prefix (byte for byte) with ref's when ref was priced from
// inputs equal to sc's (ref.pricing) and what its price reads is the same: its rank, the kernel
// lists (the same shared ones), its group's ranks (collapsed chains are priced afresh). The same
// seconds, bit for bit, as instruction_seconds (tested).
std::vector<std::vector<double>> instruction_seconds_reusing(const Scenario& sc, const Program& program,
                                                             std::vector<double>* chain_member_seconds,
                                                             CollectivePrices* shared, const EvaluatedProgram& ref,
                                                             CommonPrefix* common = nullptr);
// evaluate_program(program, seconds), taking from `ref` the span of every instruction whose span
// it provably shares: per rank, the longest common prefix of the two instruction lists (byte for
// byte, with the same dependencies and seconds, no collective that waits for other materialized
// ranks), and past it, on each stream, the run of instructions that match `ref`'s at the same place
// of the stream (op, group, peer, tag, seconds, and what they wait for) and wait only for taken
// ones. Every send / receive must be taken (their partners then are too), else it returns false
// and leaves `out` alone. The rest is evaluated as evaluate_program does: the same timeline, bit
// for bit (tested).
bool evaluate_program_reusing(const Program& program, const std::vector<std::vector<double>>& seconds,
                              const EvaluatedProgram& ref, Timeline& out, const CommonPrefix* common = nullptr);

// The whole analytic report: representative Program, estimate, memory plan, and (when it does not
// fit, or `always_suggest`) the fit advisor's alternatives.
struct Report;
Report analytic_report(const Scenario& sc, bool suggest = true);

}  // namespace dssim
