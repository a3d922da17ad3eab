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

// ---- NCCL's tuner constants (src/graph/tuning.cc, ncclTunerConstantsDefaults), microseconds ----
constexpr int kLL = 0, kLL128 = 1, kSimple = 2;
int proto_index(NcclProto p) { return p == NcclProto::LL ? kLL : p == NcclProto::LL128 ? kLL128 : kSimple; }
// baseLatencies[algo][proto]
constexpr double kBaseTree[3] = {6.8, 14.0, 8.4};
constexpr double kBaseRing[3] = {6.6, 14.0, 8.4};
// hwLatencies[hw][algo][proto]: one hop's cost per step
constexpr double kNvlinkTree[3] = {0.6, 1.25, 4.0}, kNvlinkRing[3] = {0.6, 1.9, 3.4};
constexpr double kPciTree[3] = {1.0, 1.9, 4.0}, kPciRing[3] = {1.0, 2.5, 5.7};
constexpr double kNetTree[3] = {5.0, 8.5, 14.0}, kNetRing[3] = {2.7, 4.0, 14.0};
// llMaxBws (GB/s): one node by GPU generation; several nodes by host CPU (Intel row 0, AMD row 1)
// and node count (2 nodes, more).
enum Gen { Volta, Ampere, Hopper, Blackwell };
constexpr double kLLMaxBw[4][3] = {{39.0, 39.0, 20.4}, {87.7, 22.5, 19.0}, {141.0, 45.0, 35.0}, {282.0, 90.0, 70.0}};
// perChMaxTreeBws (GB/s per channel) and the channel count NCCL opens on an 8-NIC DGX-class node
// for trees; only the tree's all-reduce bandwidth is capped by it.
constexpr double kPerChMaxTreeBw[4][3] = {{26.5, 18.5, 10.0}, {24.0, 23.6, 17.8}, {38.7, 41.4, 36.0}, {70.0, 42.8, 24.0}};
// treeCorrectionFactor[proto][log2(bytes / 64)]: NCCL's measured tree bandwidth at medium sizes.
constexpr double kTreeCorrection[3][24] = {
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9}};
constexpr int kChannels = 16;  // rings / trees NCCL builds on a DGX A100 / H100 (2 per NIC)

Gen generation(const GpuSpec& g) {
  const char c = g.name.empty() ? 'A' : g.name[0];
  if (c == 'V' || c == 'v') return Volta;
  if (c == 'H' || c == 'h') return Hopper;
  if (c == 'B' || c == 'b' || c == 'G' || c == 'g') return Blackwell;
  return Ampere;
}
int log2i(long long v) { int r = -1; while (v > 0) { v >>= 1; ++r; } return r; }
}  // namespace

const char* to_string(NcclAlgo a) { return a == NcclAlgo::Ring ? "ring" : "tree"; }
const char* to_string(NcclProto p) { return p == NcclProto::LL ? "LL" : p == NcclProto::LL128 ? "LL128" : "Simple"; }

LinkClass group_link(const ClusterSpec& c, const std::vector<int>& ranks) {
  std::map<int, int> per_node;
  for (int r : ranks) ++per_node[node_of(c, r)];
  if (per_node.size() <= 1) return intra_node_link(c);
  int max_members = 0;
  for (auto& [node, k] : per_node) max_members = std::max(max_members, k);
  return inter_node_link(c, max_members);
}

NcclGroup nccl_group(const ClusterSpec& c, const std::vector<int>& ranks) {
  std::map<int, int> per_node;
  for (int r : ranks) ++per_node[node_of(c, r)];
  NcclGroup g;
  g.ranks = static_cast<int>(ranks.size());
  g.nodes = std::max<int>(1, static_cast<int>(per_node.size()));
  for (auto& [node, k] : per_node) g.per_node = std::max(g.per_node, k);
  return g;
}

namespace {
// One candidate on a group whose shape and link bandwidth are already known.
NcclChoice candidate(const ClusterSpec& c, Op op, double bytes, const NcclGroup& g, double link_bw,
                     NcclAlgo algo, NcclProto proto) {
  NcclChoice ch;
  ch.algo = algo;
  ch.proto = proto;
  const int n = g.ranks;
  if (n <= 1) return ch;
  const bool allreduce = op == Op::AllReduce;
  if (algo == NcclAlgo::Tree && !allreduce) return ch;  // NCCL's trees only all-reduce
  const int p = proto_index(proto);
  const Gen gen = generation(c.gpu);
  const int nodes_idx = g.nodes <= 2 ? g.nodes - 1 : 2;
  const bool pcie = c.intra_node == "pcie";

  // Bus bandwidth: the links' (Simple), then NCCL's per-protocol refinements.
  double bus = link_bw;
  const double ll_max = 1e9 * (g.nodes == 1 ? kLLMaxBw[gen][0] : kLLMaxBw[c.host_cpu == "amd" ? 1 : 0][nodes_idx]);
  if (algo == NcclAlgo::Ring) {
    if (proto == NcclProto::LL) bus = std::min(ll_max, bus * 0.5);
    if (proto == NcclProto::LL128) bus = bus * 0.92;  // 120 of every 128 bytes are data
  } else {
    bus = std::min(bus * 0.92, kChannels * 1e9 * kPerChMaxTreeBw[gen][nodes_idx]);
    if (proto == NcclProto::LL) bus = std::min(bus / 3.8, ll_max);
    if (proto == NcclProto::LL128) bus *= g.nodes == 1 ? 7.0 / 9.0 : 120.0 / 128.0;
    const int log_size = log2i(static_cast<long long>(bytes) >> 6);
    if (log_size >= 0 && log_size < 23) bus *= kTreeCorrection[p][log_size];
  }
  ch.bus_bandwidth = bus;
  ch.wire_factor = bus > 0 ? link_bw / bus : 1;

  // Latency.
  const double* hw_ring = pcie ? kPciRing : kNvlinkRing;
  const double* hw_tree = pcie ? kPciTree : kNvlinkTree;
  double lat_us;
  if (algo == NcclAlgo::Ring) {
    const int steps = allreduce ? 2 * (n - 1) : n - 1;
    lat_us = kBaseRing[p];
    double intra = hw_ring[p];
    // With one member per node every hop is a network hop, priced as the tree's (tuning.cc).
    const double inter = g.per_node == 1 ? kNetTree[p] : kNetRing[p];
    int inter_steps = 0;
    if (g.nodes > 1) {
      // Inter-node rings launch every step through the network proxy (getNetOverhead: 2 us on
      // AMD hosts, 1 us otherwise; three times that with Simple).
      double overhead = c.host_cpu == "amd" ? 2.0 : 1.0;
      if (proto == NcclProto::Simple) overhead *= 3;
      intra = std::max(intra, overhead);
      inter_steps = allreduce ? 2 * (g.nodes - 1) : g.nodes - 1;
    }
    lat_us += (steps - inter_steps) * intra + inter_steps * inter;
    // "Plateau effect of ring" (ncclTopoGetAlgoTime): multi-node Simple all-reduce.
    if (allreduce && proto == NcclProto::Simple && g.nodes > 1 && bytes / (double(kChannels) * n) >= 64)
      lat_us *= gen == Volta ? 1.9 : 1.4;
  } else {
    const double intra = hw_tree[p];
    const double inter = g.nodes > 1 ? kNetTree[p] : 0.0;
    lat_us = kBaseTree[p] + 2 * ((g.per_node - 1) * intra + log2i(g.nodes) * inter);
  }
  ch.latency = lat_us * 1e-6;

  // Algorithm bandwidth: ring moves 2(N-1)/N (all-reduce) or (N-1)/N of the bytes per rank; the
  // tree moves 2 S per rank.
  const double moved = algo == NcclAlgo::Ring ? wire_bytes_per_rank(op, bytes, n) : 2 * bytes;
  ch.seconds = ch.latency + (bus > 0 ? moved / bus : 0.0);
  return ch;
}

}  // namespace

NcclChoice nccl_candidate(const ClusterSpec& c, Op op, double bytes, const std::vector<int>& ranks,
                          NcclAlgo algo, NcclProto proto) {
  return candidate(c, op, bytes, nccl_group(c, ranks), group_link(c, ranks).bandwidth, algo, proto);
}

NcclChoice nccl_choice(const ClusterSpec& c, Op op, double bytes, const std::vector<int>& ranks) {
  const NcclGroup g = nccl_group(c, ranks);
  const double link_bw = group_link(c, ranks).bandwidth;
  NcclChoice best;
  bool have = false;
  for (NcclAlgo a : {NcclAlgo::Ring, NcclAlgo::Tree})
    for (NcclProto p : {NcclProto::LL, NcclProto::LL128, NcclProto::Simple}) {
      // NCCL leaves LL128 off on PCIe-only nodes (it needs NVLink's 128-byte store atomicity).
      if (p == NcclProto::LL128 && c.intra_node == "pcie") continue;
      NcclChoice ch = candidate(c, op, bytes, g, link_bw, a, p);
      if (ch.bus_bandwidth <= 0) continue;
      if (!have || ch.seconds < best.seconds) { best = ch; have = true; }
    }
  return best;
}

double ring_allreduce_seconds(double size_bytes, int n, const LinkClass& link) {
  if (n <= 1) return 0;
  return wire_bytes_per_rank(Op::AllReduce, size_bytes, n) / link.bandwidth;
}

double tree_allreduce_seconds(double size_bytes, int n, const LinkClass& link) {
  if (n <= 1) return 0;
  return 2 * size_bytes / link.bandwidth;
}

bool tree_allreduce_wins(const ClusterSpec& c, double size_bytes, const std::vector<int>& ranks) {
  if (nccl_group(c, ranks).nodes <= 1) return false;  // inside a node NCCL rings over NVLink
  return nccl_choice(c, Op::AllReduce, size_bytes, ranks).algo == NcclAlgo::Tree;
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
  return nccl_choice(c, op, size_bytes, ranks).seconds;
}

double p2p_seconds(const ClusterSpec& c, double bytes, int from_rank, int to_rank) {
  const LinkClass link = node_of(c, from_rank) == node_of(c, to_rank) ? intra_node_link(c)
                                                                         : inter_node_link(c, 1);
  return link.latency + bytes / link.bandwidth;
}

}  // namespace dssim
