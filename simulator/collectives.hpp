// Collectives as NCCL runs them, turned into phases of concurrent flows on the platform.
//
// Phase detail (default): each phase of an algorithm is one set of concurrent flows, each carrying
// the phase's whole per-rank volume (a ring all-reduce is one flow per rank of 2(N-1)/N * S to its
// successor), followed by the latency of the phase's remaining ring steps. Cost: O(N) flows per
// collective, independent of the number of ring steps.
// Step detail: every ring step is a set of N flows of S/N, one after the other (O(N^2) flows);
// kept to check the phase model (tests/sim: both agree within 2% on bandwidth-bound sizes).
//
// Algorithms:
//  - group inside one node with a non-blocking NVSwitch: closed form (core/collective_model.hpp);
//  - group with one member per node: flat ring over the NICs, or NCCL's double binary tree for an
//    all-reduce when its closed form is faster (latency-bound sizes on many nodes);
//  - group with m > 1 members on each of n > 1 nodes: hierarchical, as NCCL with one channel per
//    rail: intra-node reduce-scatter (closed form), n-node ring on each of the m rails over S/m,
//    intra-node all-gather (closed form);
//  - any other layout: flat ring, each hop over NVLink or the NICs;
//  - all-to-all: one flow per ordered pair (S/N each); send/recv: one flow; copies: one flow
//    between the GPU's PCIe endpoint and its node's CPU host.
#pragma once
#include <vector>
#include "core/program.hpp"
#include "core/scenario.hpp"
#include "simulator/platform.hpp"

namespace dssim::sim {

enum class CollectiveDetail { Phase, Step };

struct Flow {
  simgrid::s4u::Host* src = nullptr;
  simgrid::s4u::Host* dst = nullptr;
  double bytes = 0;
};

struct Phase {
  double before_seconds = 0;  // closed-form part run before the flows (intra-node reduce-scatter)
  std::vector<Flow> flows;    // run concurrently; the phase ends when the last one ends
  double after_seconds = 0;   // remaining ring-step latencies, closed-form all-gather
};

// One repetition of an instruction's communication. closed_form: no flows, `seconds` is exact.
struct CommPlan {
  bool closed_form = false;
  double seconds = 0;
  std::vector<Phase> phases;
};

struct CollectivePlanner {
  const ClusterSpec& cluster;
  const Platform& platform;
  CollectiveDetail detail = CollectiveDetail::Phase;
  bool nvswitch_closed_form = true;  // false: model NVSwitch collectives as flows too (tests)

  bool is_closed_form(Op op, const std::vector<int>& ranks) const;
  CommPlan collective(Op op, double bytes, const std::vector<int>& ranks) const;
  CommPlan p2p(double bytes, int from, int to) const;
  // A PCIe copy; `after`: host work that follows it on the same stream (the host's sum of
  // offloaded gradients, beyond what the copy's own time covers).
  CommPlan copy(Op op, double bytes, int rank, double after = 0) const;

  // Route latency between two endpoints (cached by the caller if hot).
  static double route_latency(simgrid::s4u::Host* a, simgrid::s4u::Host* b);

 private:
  void tree_allreduce(std::vector<Phase>& out, const std::vector<int>& members, double bytes) const;
  void ring(std::vector<Phase>& out, const std::vector<int>& members, double volume_per_rank, int steps,
            double before, double after) const;
};

}  // namespace dssim::sim
