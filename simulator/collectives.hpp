// Collectives as NCCL runs them, turned into phases of concurrent flows on the platform.
//
// NCCL's tuner (core/collective_model.hpp) picks the algorithm and protocol and gives the latency
// (base + every ring step's hop cost, proportional to the rank count); the flows carry the bytes,
// scaled by the protocol's wire factor (LL, LL128 keep the links busy longer per byte), so that
// collectives sharing links slow each other down.
//
// Phase detail (default): each phase of an algorithm is one set of concurrent flows, each carrying
// the phase's whole per-rank volume (a ring all-reduce is one flow per rank of 2(N-1)/N * S to its
// successor), followed by NCCL's latency. Cost: O(N) flows per collective, independent of the
// number of ring steps.
// Step detail: every ring step is a set of N flows of S/N, one after the other (O(N^2) flows);
// kept to check the phase model (tests/sim: both agree within 2% on bandwidth-bound sizes).
//
// Algorithms:
//  - group inside one node with a non-blocking NVSwitch: closed form (core/collective_model.hpp);
//  - group with one member per node: flat ring over the NICs, or NCCL's double binary tree for an
//    all-reduce when NCCL's tuner picks it (latency-bound sizes on many nodes);
//  - group with m > 1 members on each of n > 1 nodes: NCCL's rail-optimized rings (one per
//    channel, each through a different NIC): on the network, an n-node ring on each of the m rails
//    over S/m; the NVLink hops of the same rings run concurrently with them (the phase lasts at
//    least their closed-form time);
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
  double before_seconds = 0;  // closed-form part run before the flows
  std::vector<Flow> flows;    // run concurrently; the phase ends when the last one ends
  double min_seconds = 0;     // ... but not before this long after they start (concurrent NVLink part)
  double after_seconds = 0;   // NCCL's latency (base + ring steps)
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
  void tree_allreduce(std::vector<Phase>& out, const std::vector<int>& members, double bytes, double latency) const;
  void ring(std::vector<Phase>& out, const std::vector<int>& members, double volume_per_rank, int steps,
            double min_seconds, double after) const;
};

}  // namespace dssim::sim
