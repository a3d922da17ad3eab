// The modeled cluster as a SimGrid platform, built with S4U from a ClusterSpec.
//
//   nvswitch (star)    : one host per GPU (speed = dense 16-bit peak), each with an NVLink
//                        split-duplex link to its node's NVSwitch; one star serves every node
//                        because only GPUs of one node are ever routed to each other through it.
//   pcie (star)        : per GPU a PCIe endpoint (link = PCIe bandwidth), and per node a CPU host
//                        whose link is the node's host-memory bandwidth (offload traffic shares it).
//   fabric (star of leaf / pod stars): per GPU the endpoint of the NIC it uses (rail-optimized:
//                        NIC j of every node hangs off rail j's leaf switch); leaf up/down links
//                        carry (nodes per leaf x NIC bandwidth) / oversubscription; a 3-level tree
//                        adds pods of leaves under a non-blocking core.
// A GPU therefore has up to three network endpoints (NVLink, NIC, PCIe): SimGrid's zones are a tree
// and a host belongs to one zone, so traffic picks its endpoint by where it goes.
//
// Only the ranks the simulation runs get endpoints. When ranks are folded (symmetry), a link used
// by k simulated ranks out of n identical ones gets k/n of its bandwidth: under max-min sharing the
// simulated flows then get exactly the rate the full set would.
#pragma once
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace simgrid::s4u { class Host; class Link; class NetZone; }

namespace dssim::sim {

struct PlatformOptions {
  int nodes_per_leaf = 32;   // leaf switch down-ports per rail (HDR/NDR 40/64-port switches, half down)
  int leaves_per_pod = 16;   // three-level trees: leaves under one pod (aggregation) layer
  bool with_pcie = true;     // build PCIe/host zones (only needed when the Program copies)
  // What-ifs (core/what_if.hpp): bandwidth factors by link name (both directions), and the share
  // of every inter-node link (nic-, leafup-, podup-) left to this job by background traffic.
  std::map<std::string, double> link_factor;
  double fabric_factor = 1.0;
  // NICs that are down, as (node, rail): their GPUs' inter-node traffic goes through the node's
  // next working NIC (NCCL's PXN: over NVLink to a GPU of that rail, then its NIC), crossing rails
  // through the spine.
  std::set<std::pair<int, int>> nic_down;
};

// Empty when `name` (without _UP / _DOWN) is a link of the cluster's platform as built unfolded;
// else why not, with the names that exist.
std::string link_name_problem(const ClusterSpec& cluster, const PlatformOptions& opts, const std::string& name);
// The link (base) name of NIC `nic` of `node`, and the share of that link the NIC is (more NICs
// than rails aggregate into one link per rail).
std::pair<std::string, double> nic_link(const ClusterSpec& cluster, int node, int nic);
// The rails (NIC links) per node.
int rails_of(const ClusterSpec& cluster);

class Platform {
 public:
  // Must be called inside a live simgrid::s4u::Engine, before it runs. `used_ranks`: the ranks
  // whose endpoints exist (sorted, unique).
  // `represented[i]`: the ranks used_ranks[i] stands for when folded (empty: itself).
  Platform(const ClusterSpec& cluster, const std::vector<int>& used_ranks, const PlatformOptions& opts,
           const std::vector<std::vector<int>>& represented = {});

  int node_of(int rank) const { return rank / gpus_per_node_; }
  int local_of(int rank) const { return rank % gpus_per_node_; }
  int rail_of(int rank) const { return local_of(rank) / gpus_per_rail_; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }

  simgrid::s4u::Host* gpu(int rank) const;   // compute + NVLink endpoint
  simgrid::s4u::Host* nic(int rank) const;   // NIC endpoint (nullptr on a one-node cluster)
  simgrid::s4u::Host* pcie(int rank) const;  // PCIe endpoint
  simgrid::s4u::Host* cpu(int rank) const;   // the node's CPU host
  simgrid::s4u::Host* driver() const { return driver_; }
  // The GPU's NVLink (NVSwitch port) links, for accounting closed-form intra-node traffic.
  simgrid::s4u::Link* nvlink_up(int rank) const { return nvl_up_[slot(rank)]; }
  simgrid::s4u::Link* nvlink_down(int rank) const { return nvl_down_[slot(rank)]; }
  // The endpoints a transfer between two GPUs uses: NVLink inside a node, NICs across nodes.
  std::pair<simgrid::s4u::Host*, simgrid::s4u::Host*> endpoints(int from_rank, int to_rank) const;

  // Link bandwidths as built, before folding scale (for reports).
  struct LinkInfo { simgrid::s4u::Link* link; double scale; };
  const std::vector<LinkInfo>& links() const { return links_; }
  int leaves() const { return leaves_; }

 private:
  int slot(int rank) const;
  int gpus_per_node_, gpus_per_rail_, rails_;
  int leaves_ = 0;
  std::vector<int> slot_of_rank_;  // rank -> index into the per-used-rank vectors, or -1
  std::vector<simgrid::s4u::Host*> gpu_, nic_, pcie_, cpu_;
  std::vector<simgrid::s4u::Link*> nvl_up_, nvl_down_;
  simgrid::s4u::Host* driver_ = nullptr;
  std::vector<LinkInfo> links_;
};

}  // namespace dssim::sim
