#include "core/collective_model.hpp"

#include <algorithm>
#include <cmath>
#include <map>

namespace dssim {

namespace {
int node_of(const ClusterSpec& c, int rank) { return rank / std::max(1, c.gpus_per_node); }

LinkClass intra_node_link(const ClusterSpec& c) {
  if (c.intra_node == "pcie") return {c.gpu.pcie_bandwidth, c.gpu.pcie_latency};
  return {c.gpu.nvlink_achieved(), c.gpu.nvlink_latency};
}

// One GPU's share of its node's NICs when every GPU of the node runs a group of the same shape at
// the same time (DP / PP traffic in a Megatron grid does): a group with g members per node crosses
// the node boundary once per ring channel, and gpus_per_node / g such groups share the NICs.
LinkClass inter_node_link(const ClusterSpec& c, int members_per_node) {
  const double node_bw = c.nics_per_node * c.nic_bandwidth / std::max(1.0, c.oversubscription);
  const double share = node_bw * members_per_node / std::max(1, c.gpus_per_node);
  const int hops = c.fat_tree_levels * 2 - 1;  // leaf -> (spine ->) ... -> leaf switches
  LinkClass intra = intra_node_link(c);
  return {std::min(intra.bandwidth, share), c.nic_latency + hops * c.switch_latency};
}
}  // namespace

LinkClass group_link(const ClusterSpec& c, const std::vector<int>& ranks) {
  std::map<int, int> per_node;
  for (int r : ranks) ++per_node[node_of(c, r)];
  if (per_node.size() <= 1) return intra_node_link(c);
  int max_members = 0;
  for (auto& [node, k] : per_node) max_members = std::max(max_members, k);
  return inter_node_link(c, max_members);
}

double ring_allreduce_seconds(double size_bytes, int n, const LinkClass& link) {
  if (n <= 1) return 0;
  return wire_bytes_per_rank(Op::AllReduce, size_bytes, n) / link.bandwidth + 2.0 * (n - 1) * link.latency;
}

double tree_allreduce_seconds(double size_bytes, int n, const LinkClass& link) {
  if (n <= 1) return 0;
  const double depth = std::ceil(std::log2(double(n)));
  return 2 * size_bytes / link.bandwidth + 2 * depth * link.latency;
}

bool tree_allreduce_wins(const ClusterSpec& c, double size_bytes, const std::vector<int>& ranks) {
  std::map<int, int> per_node;
  for (int r : ranks) ++per_node[node_of(c, r)];
  if (per_node.size() <= 1) return false;  // inside a node NCCL rings over NVLink
  const LinkClass link = group_link(c, ranks);
  const int n = static_cast<int>(ranks.size());
  return tree_allreduce_seconds(size_bytes, n, link) < ring_allreduce_seconds(size_bytes, n, link);
}

double collective_seconds(const ClusterSpec& c, Op op, double size_bytes, const std::vector<int>& ranks) {
  const int n = static_cast<int>(ranks.size());
  if (n <= 1) return 0.0;
  if (op == Op::AllToAll) {
    // Pairwise exchange: the intra-node part over NVLink and the inter-node part over the NICs
    // proceed concurrently; the slower one bounds the time.
    std::map<int, int> per_node;
    for (int r : ranks) ++per_node[node_of(c, r)];
    const int here = per_node[node_of(c, ranks[0])];
    const double chunk = size_bytes / n;
    const double intra_bytes = chunk * (here - 1);
    const double inter_bytes = chunk * (n - here);
    const LinkClass nv = intra_node_link(c);
    double t = intra_bytes / nv.bandwidth + (here > 1 ? nv.latency : 0);
    if (inter_bytes > 0) {
      const LinkClass ib = inter_node_link(c, here);
      t = std::max(t, inter_bytes / ib.bandwidth + ib.latency);
    }
    return t;
  }
  const LinkClass link = group_link(c, ranks);
  if (op == Op::AllReduce && tree_allreduce_wins(c, size_bytes, ranks))
    return tree_allreduce_seconds(size_bytes, n, link);
  const double steps = (op == Op::AllReduce) ? 2.0 * (n - 1) : double(n - 1);
  return wire_bytes_per_rank(op, size_bytes, n) / link.bandwidth + steps * link.latency;
}

double p2p_seconds(const ClusterSpec& c, double bytes, int from_rank, int to_rank) {
  const LinkClass link = node_of(c, from_rank) == node_of(c, to_rank) ? intra_node_link(c)
                                                                         : inter_node_link(c, 1);
  return link.latency + bytes / link.bandwidth;
}

}  // namespace dssim
