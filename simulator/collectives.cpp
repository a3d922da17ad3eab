#include "simulator/collectives.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <simgrid/s4u.hpp>
#include "core/collective_model.hpp"

namespace sg4 = simgrid::s4u;

namespace dssim::sim {

double CollectivePlanner::route_latency(sg4::Host* a, sg4::Host* b) {
  std::vector<sg4::Link*> links;
  double lat = 0;
  a->route_to(b, links, &lat);
  return lat;
}

bool CollectivePlanner::is_closed_form(Op op, const std::vector<int>& ranks) const {
  if (ranks.size() <= 1) return true;
  if (!nvswitch_closed_form || cluster.intra_node != "nvswitch") return false;
  const int node = platform.node_of(ranks[0]);
  for (int r : ranks)
    if (platform.node_of(r) != node) return false;
  return true;
}

// A ring over `members` (in ring order): each member sends `volume_per_rank` bytes to its successor
// over `steps` ring steps, then `after` (NCCL's latency) elapses.
void CollectivePlanner::ring(std::vector<Phase>& out, const std::vector<int>& members, double volume,
                             int steps, double min_seconds, double after) const {
  const size_t n = members.size();
  if (n <= 1 || steps <= 0) {
    Phase p;
    p.min_seconds = min_seconds;
    p.after_seconds = after;
    out.push_back(p);
    return;
  }
  std::vector<Flow> hop(n);
  double alpha = 0;  // the flows pay the slowest hop's route latency themselves
  for (size_t i = 0; i < n; ++i) {
    auto [s, d] = platform.endpoints(members[i], members[(i + 1) % n]);
    hop[i] = {s, d, 0};
    alpha = std::max(alpha, route_latency(s, d));
  }
  after = std::max(0.0, after - alpha);
  if (detail == CollectiveDetail::Phase) {
    Phase p;
    p.flows = hop;
    for (auto& f : p.flows) f.bytes = volume;
    p.min_seconds = min_seconds;
    p.after_seconds = after;
    out.push_back(std::move(p));
    return;
  }
  for (int s = 0; s < steps; ++s) {
    Phase p;
    p.flows = hop;
    for (auto& f : p.flows) f.bytes = volume / steps;
    p.min_seconds = min_seconds / steps;
    if (s == steps - 1) p.after_seconds = after;
    out.push_back(std::move(p));
  }
}

CommPlan CollectivePlanner::collective(Op op, double bytes, const std::vector<int>& ranks) const {
  CommPlan plan;
  const int n = static_cast<int>(ranks.size());
  if (n <= 1 || bytes <= 0) { plan.closed_form = true; return plan; }
  if (is_closed_form(op, ranks)) {
    plan.closed_form = true;
    plan.seconds = collective_seconds(cluster, op, bytes, ranks);
    return plan;
  }
  if (op == Op::AllToAll) {
    Phase p;
    const double chunk = bytes / n;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        if (i == j) continue;
        auto [s, d] = platform.endpoints(ranks[i], ranks[j]);
        p.flows.push_back({s, d, chunk});
      }
    plan.phases.push_back(std::move(p));
    return plan;
  }
  const NcclChoice ch = nccl_choice(cluster, op, bytes, ranks);
  const double wire = ch.wire_factor;
  // Layout: members per node, in ring order.
  std::map<int, std::vector<int>> by_node;
  for (int r : ranks) by_node[platform.node_of(r)].push_back(r);
  const int nodes = static_cast<int>(by_node.size());
  size_t m = by_node.begin()->second.size();
  bool uniform = true;
  for (auto& [node, v] : by_node) uniform = uniform && v.size() == m;
  const double frac = double(n - 1) / n;
  const double passes = op == Op::AllReduce ? 2 : 1;
  if (nodes > 1 && m > 1 && uniform) {
    // Rail-optimized rings: the network part is an n-node ring on each of the m rails over S/m;
    // the NVLink hops carry every rank's whole ring volume concurrently.
    const int nn = nodes;
    const double nfrac = double(nn - 1) / nn;
    const double volume = passes * nfrac * bytes / m * wire;
    const int steps = int(passes) * (nn - 1);
    const double nvlink = cluster.intra_node == "pcie" ? cluster.gpu.pcie_bandwidth : cluster.gpu.nvlink_achieved();
    const double intra = nvlink > 0 ? passes * frac * bytes * wire / nvlink : 0.0;
    // One ring per local position j; they run concurrently, so merge them phase by phase.
    std::vector<std::vector<Phase>> rings(m);
    for (size_t j = 0; j < m; ++j) {
      std::vector<int> members;
      for (auto& [node, v] : by_node) members.push_back(v[j]);
      ring(rings[j], members, volume, steps, intra, ch.latency);
    }
    for (size_t k = 0; k < rings[0].size(); ++k) {
      Phase p = rings[0][k];
      for (size_t j = 1; j < m; ++j) p.flows.insert(p.flows.end(), rings[j][k].flows.begin(), rings[j][k].flows.end());
      plan.phases.push_back(std::move(p));
    }
    return plan;
  }
  if (ch.algo == NcclAlgo::Tree) {
    tree_allreduce(plan.phases, ranks, bytes * wire, ch.latency);
    return plan;
  }
  const int steps = op == Op::AllReduce ? 2 * (n - 1) : n - 1;
  ring(plan.phases, ranks, passes * frac * bytes * wire, steps, 0, ch.latency);
  return plan;
}

// NCCL's double binary tree: two complementary binary trees over the members, each carrying half
// the data, so that every rank sends and receives about S in the reduce phase (children to
// parents) and again in the broadcast (parents to children). Both phases are pipelined: the flows
// of a phase run concurrently, and each adds half of NCCL's latency.
void CollectivePlanner::tree_allreduce(std::vector<Phase>& out, const std::vector<int>& members,
                                       double bytes, double latency) const {
  const int n = static_cast<int>(members.size());
  auto parent_a = [](int i) { return (i - 1) / 2; };                      // tree over 0..n-1
  auto parent_b = [n](int i) { return n - 1 - (n - 1 - i - 1) / 2; };     // the mirrored tree
  for (int dir = 0; dir < 2; ++dir) {  // 0: reduce (up), 1: broadcast (down)
    Phase p;
    for (int i = 0; i < n; ++i) {
      for (int tree = 0; tree < 2; ++tree) {
        const bool is_root = tree == 0 ? i == 0 : i == n - 1;
        if (is_root) continue;
        const int parent = tree == 0 ? parent_a(i) : parent_b(i);
        const int from = dir == 0 ? members[i] : members[parent];
        const int to = dir == 0 ? members[parent] : members[i];
        auto [s, d] = platform.endpoints(from, to);
        p.flows.push_back({s, d, bytes / 2});
      }
    }
    p.after_seconds = latency / 2;
    out.push_back(std::move(p));
  }
}

CommPlan CollectivePlanner::p2p(double bytes, int from, int to) const {
  CommPlan plan;
  if (from == to || bytes <= 0) { plan.closed_form = true; return plan; }
  auto [s, d] = platform.endpoints(from, to);
  Phase p;
  p.flows.push_back({s, d, bytes});
  plan.phases.push_back(std::move(p));
  return plan;
}

CommPlan CollectivePlanner::copy(Op op, double bytes, int rank, double after) const {
  CommPlan plan;
  if (bytes <= 0) { plan.closed_form = true; return plan; }
  Phase p;
  p.after_seconds = after;
  if (op == Op::CopyD2H) p.flows.push_back({platform.pcie(rank), platform.cpu(rank), bytes});
  else p.flows.push_back({platform.cpu(rank), platform.pcie(rank), bytes});
  plan.phases.push_back(std::move(p));
  return plan;
}

}  // namespace dssim::sim
