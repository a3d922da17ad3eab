#include "simulator/platform.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <simgrid/s4u.hpp>
#include "simulator/rail_fabric.hpp"

namespace sg4 = simgrid::s4u;

namespace dssim::sim {

namespace {
using Dir = sg4::LinkInRoute::Direction;

void star_route(sg4::NetZone* zone, simgrid::kernel::routing::NetPoint* np,
                std::vector<sg4::LinkInRoute> links) {
  zone->add_route(np, nullptr, nullptr, nullptr, links, true);
}
}  // namespace

Platform::Platform(const ClusterSpec& c, const std::vector<int>& used, const PlatformOptions& opts,
                   const std::vector<std::vector<int>>& represented)
    : gpus_per_node_(std::max(1, c.gpus_per_node)) {
  if (used.empty()) throw std::invalid_argument("simulator: no ranks to place on the platform");
  rails_ = std::clamp(c.nics_per_node, 1, gpus_per_node_);
  gpus_per_rail_ = (gpus_per_node_ + rails_ - 1) / rails_;
  // More NICs than rails (e.g. 2 per GPU) aggregate into one endpoint per rail.
  const double nic_bw = c.nic_bandwidth * std::max(1, c.nics_per_node) / rails_;
  const int max_rank = used.back();
  slot_of_rank_.assign(max_rank + 1, -1);
  for (size_t i = 0; i < used.size(); ++i) slot_of_rank_[used[i]] = static_cast<int>(i);
  gpu_.assign(used.size(), nullptr);
  nic_.assign(used.size(), nullptr);
  pcie_.assign(used.size(), nullptr);
  cpu_.assign(used.size(), nullptr);
  nvl_up_.assign(used.size(), nullptr);
  nvl_down_.assign(used.size(), nullptr);

  // Folding: how many used ranks and how many represented GPUs sit on each NIC / node.
  std::map<std::pair<int, int>, std::pair<int, int>> nic_load;  // (node, rail) -> (used, represented)
  std::map<int, std::pair<int, int>> node_load;
  for (size_t i = 0; i < used.size(); ++i) {
    const int r = used[i];
    nic_load[{node_of(r), rail_of(r)}].first++;
    node_load[node_of(r)].first++;
    if (represented.empty() || represented[i].empty()) {
      nic_load[{node_of(r), rail_of(r)}].second++;
      node_load[node_of(r)].second++;
    } else {
      for (int q : represented[i]) {
        nic_load[{node_of(q), rail_of(q)}].second++;
        node_load[node_of(q)].second++;
      }
    }
  }
  auto scale_of = [](std::pair<int, int> load) {
    return load.second > 0 ? double(load.first) / load.second : 1.0;
  };

  auto* root = sg4::create_star_zone("cluster");
  auto* drv_zone = sg4::create_star_zone("driver-zone");
  drv_zone->set_parent(root);
  driver_ = drv_zone->create_host("driver", 1e9);
  drv_zone->seal();

  // What-ifs: a named link's factor, and background traffic on the inter-node links.
  auto what_if = [&](const std::string& name) {
    double f = 1.0;
    if (auto it = opts.link_factor.find(name); it != opts.link_factor.end()) f *= it->second;
    if (name.rfind("nic-", 0) == 0 || name.rfind("leafup-", 0) == 0 || name.rfind("podup-", 0) == 0) f *= opts.fabric_factor;
    return f;
  };
  auto add_link = [&](sg4::NetZone* z, const std::string& name, double bw, double lat, double scale) {
    auto* l = z->create_split_duplex_link(name, bw * scale * what_if(name));
    l->set_latency(lat);
    l->seal();
    links_.push_back({l->get_link_up(), scale});
    links_.push_back({l->get_link_down(), scale});
    return l;
  };

  // Nodes: NVSwitch star and PCIe star.
  std::map<int, std::vector<int>> slots_by_node;
  for (size_t i = 0; i < used.size(); ++i) slots_by_node[node_of(used[i])].push_back(static_cast<int>(i));
  const bool pcie_intra = c.intra_node == "pcie";
  const double intra_bw = pcie_intra ? c.gpu.pcie_bandwidth : c.gpu.nvlink_achieved();
  const double intra_lat = pcie_intra ? c.gpu.pcie_latency : c.gpu.nvlink_latency;
  const double peak = c.gpu.peak_flops_16 > 0 ? c.gpu.peak_flops_16 : 1e12;
  // One star holds every GPU's NVLink port and one every PCIe endpoint: routes in a star are
  // "source up, destination down", and the executor only routes GPU endpoints of one node to each
  // other, so this is the per-node NVSwitch; per-node zones would cost O(zones) per created name
  // (S4U checks names against every zone), quadratic at 8192 GPUs.
  auto* nz = sg4::create_star_zone("nvswitch");
  nz->set_parent(root);
  sg4::NetZone* pz = nullptr;
  if (opts.with_pcie) {
    pz = sg4::create_star_zone("pcie");
    pz->set_parent(root);
  }
  for (auto& [node, slots] : slots_by_node) {
    for (int s : slots) {
      const int r = used[s];
      auto* h = nz->create_host("gpu-" + std::to_string(r), peak);
      auto* l = add_link(nz, "nvlink-" + std::to_string(r), intra_bw, intra_lat / 2, 1.0);
      star_route(nz, h->get_netpoint(), {{l, Dir::UP}});
      gpu_[s] = h;
      nvl_up_[s] = l->get_link_up();
      nvl_down_[s] = l->get_link_down();
    }
    if (pz) {
      auto* cpu = pz->create_host("cpu-" + std::to_string(node), 1e11);
      const double sc = scale_of(node_load[node]);
      auto* mem = pz->create_link("hostmem-" + std::to_string(node),
                                  c.host_memory_bandwidth * sc * what_if("hostmem-" + std::to_string(node)))
                      ->set_sharing_policy(sg4::Link::SharingPolicy::SHARED)->seal();
      links_.push_back({mem, sc});
      star_route(pz, cpu->get_netpoint(), {{mem, Dir::NONE}});
      for (int s : slots) {
        const int r = used[s];
        auto* h = pz->create_host("pcie-" + std::to_string(r), 1e9);
        auto* l = add_link(pz, "pcie-" + std::to_string(r), c.gpu.pcie_bandwidth, c.gpu.pcie_latency, 1.0);
        star_route(pz, h->get_netpoint(), {{l, Dir::UP}});
        pcie_[s] = h;
        cpu_[s] = cpu;
      }
    }
  }
  nz->seal();
  if (pz) pz->seal();

  // Fabric between nodes.
  std::map<std::pair<int, int>, sg4::Host*> nic_host;  // (node, rail) -> NIC endpoint
  if (c.nodes > 1 || slots_by_node.size() > 1) {
    const int per_leaf = std::max(1, opts.nodes_per_leaf);
    const bool three = c.fat_tree_levels >= 3;
    // Two levels: one zone computing the leaf routes (simulator/rail_fabric.hpp, same routes as the
    // zones per leaf it replaces, whose construction was quadratic in SimGrid 3.32); three: a star
    // zone per leaf and per pod.
    std::unique_ptr<RailFabric> rail_fabric;
    sg4::NetZone* fabric;
    if (three) {
      fabric = sg4::create_star_zone("fabric");
      fabric->set_parent(root);
    } else {
      rail_fabric = std::make_unique<RailFabric>("fabric", root);
      fabric = rail_fabric->zone();
    }
    // Leaf zones per (leaf group, rail) holding the NICs of used ranks.
    std::map<std::pair<int, int>, std::vector<int>> slots_by_leaf;  // (group, rail) -> slots
    for (size_t i = 0; i < used.size(); ++i)
      slots_by_leaf[{node_of(used[i]) / per_leaf, rail_of(used[i])}].push_back(static_cast<int>(i));
    std::map<int, sg4::NetZone*> pods;
    std::map<int, double> pod_bw;
    const int total_groups = (c.nodes + per_leaf - 1) / per_leaf;
    for (auto& [key, slots] : slots_by_leaf) {
      const auto [group, rail] = key;
      sg4::NetZone* parent = fabric;
      const int pod = group / std::max(1, opts.leaves_per_pod);
      if (three) {
        auto it = pods.find(pod);
        if (it == pods.end()) {
          auto* pz = sg4::create_star_zone("pod-" + std::to_string(pod));
          pz->set_parent(fabric);
          it = pods.emplace(pod, pz).first;
        }
        parent = it->second;
      }
      const std::string lname = std::to_string(group) + "-" + std::to_string(rail);
      sg4::NetZone* lz = fabric;
      simgrid::kernel::routing::NetPoint* gw = nullptr;
      const int leaf = rail_fabric ? rail_fabric->add_leaf() : -1;
      if (!rail_fabric) {
        lz = sg4::create_star_zone("leaf-" + lname);
        lz->set_parent(parent);
        gw = lz->create_router("leafsw-" + lname);
        star_route(lz, gw, {});
      }
      std::map<int, sg4::Host*> nic_of_node;
      std::pair<int, int> leaf_load{0, 0};
      for (int s : slots) {
        const int r = used[s];
        const int node = node_of(r);
        auto it = nic_of_node.find(node);
        if (it == nic_of_node.end()) {
          const std::string nname = std::to_string(node) + "-" + std::to_string(rail);
          auto* h = lz->create_host("nic-" + nname, 1e9);
          auto load = nic_load[{node, rail}];
          leaf_load.first += load.first;
          leaf_load.second += load.second;
          auto* l = add_link(lz, "nic-" + nname, nic_bw, c.nic_latency / 2, scale_of(load));
          if (rail_fabric) rail_fabric->add_nic(h, l, leaf);
          else star_route(lz, h->get_netpoint(), {{l, Dir::UP}});
          it = nic_of_node.emplace(node, h).first;
          nic_host[{node, rail}] = h;
        }
        nic_[s] = it->second;
      }
      if (!rail_fabric) lz->seal();
      if (total_groups > 1 || rails_ > 1) {
        const int nodes_in_group = std::min(per_leaf, c.nodes - group * per_leaf);
        const double up_bw = std::max(1, nodes_in_group) * nic_bw / std::max(1.0, c.oversubscription);
        auto* up = add_link(parent, "leafup-" + lname, up_bw, c.switch_latency, scale_of(leaf_load));
        if (rail_fabric) rail_fabric->set_leaf_uplink(leaf, up);
        else parent->add_route(lz->get_netpoint(), nullptr, gw, nullptr, {{up, Dir::UP}}, true);
        pod_bw[pod] += up_bw;
      } else if (!rail_fabric) {
        parent->add_route(lz->get_netpoint(), nullptr, gw, nullptr, {}, true);
      }
      ++leaves_;
    }
    for (auto& [pod, pz] : pods) {
      auto* gw = pz->create_router("podsw-" + std::to_string(pod));
      star_route(pz, gw, {});
      pz->seal();
      // The core above the pods is non-blocking: pod uplinks carry what the pod's leaves carry
      // (scaled like the leaves they aggregate, which the folded rails fill evenly).
      auto* up = add_link(fabric, "podup-" + std::to_string(pod), pod_bw[pod], c.switch_latency, 1.0);
      fabric->add_route(pz->get_netpoint(), nullptr, gw, nullptr, {{up, Dir::UP}}, true);
    }
    fabric->seal();
  }
  root->seal();
  // A NIC that is down: its GPUs use the node's next working NIC.
  for (size_t i = 0; i < used.size() && !opts.nic_down.empty(); ++i) {
    const int node = node_of(used[i]), rail = rail_of(used[i]);
    if (!opts.nic_down.count({node, rail})) continue;
    sg4::Host* alt = nullptr;
    for (int k = 1; k < rails_ && !alt; ++k) {
      const int r2 = (rail + k) % rails_;
      if (opts.nic_down.count({node, r2})) continue;
      if (auto it = nic_host.find({node, r2}); it != nic_host.end()) alt = it->second;
    }
    if (!alt)
      throw std::invalid_argument("simulator: node " + std::to_string(node) + " has no working NIC to reroute rank " +
                                  std::to_string(used[i]) + "'s traffic through");
    nic_[i] = alt;
  }
}

int rails_of(const ClusterSpec& c) {
  return std::clamp(c.nics_per_node, 1, std::max(1, c.gpus_per_node));
}

std::pair<std::string, double> nic_link(const ClusterSpec& c, int node, int nic) {
  const int rails = rails_of(c);
  const int nics = std::max(1, c.nics_per_node);
  // nics <= gpus per node: one link per NIC; more: nics / rails NICs aggregate into rail nic % rails.
  const int per_rail = std::max(1, nics / rails);
  return {"nic-" + std::to_string(node) + "-" + std::to_string(nic % rails), 1.0 / per_rail};
}

std::string link_name_problem(const ClusterSpec& c, const PlatformOptions& opts, const std::string& name) {
  const int world = c.world(), rails = rails_of(c);
  const int per_leaf = std::max(1, opts.nodes_per_leaf);
  const int groups = (c.nodes + per_leaf - 1) / per_leaf;
  const int pods = (groups + std::max(1, opts.leaves_per_pod) - 1) / std::max(1, opts.leaves_per_pod);
  auto range = [](int n) { return n <= 1 ? std::string("0") : "0-" + std::to_string(n - 1); };
  std::string known = "nvlink-R and pcie-R (R " + range(world) + "), hostmem-N (N " + range(c.nodes) + ")";
  const bool fabric = c.nodes > 1;
  const bool leafups = fabric && (groups > 1 || rails > 1);
  if (fabric) known += ", nic-N-J (J " + range(rails) + ")";
  if (leafups) known += ", leafup-G-J (G " + range(groups) + ")";
  if (fabric && c.fat_tree_levels >= 3) known += ", podup-P (P " + range(pods) + ")";
  const std::string problem = "no link named '" + name + "' in this cluster; links are " + known;
  // prefix-number[-number]
  const auto dash = name.find('-');
  if (dash == std::string::npos) return problem;
  const std::string prefix = name.substr(0, dash);
  std::vector<int> nums;
  size_t pos = dash + 1;
  while (pos <= name.size()) {
    const size_t next = name.find('-', pos);
    const std::string part = name.substr(pos, next == std::string::npos ? std::string::npos : next - pos);
    if (part.empty() || part.size() > 9 || part.find_first_not_of("0123456789") != std::string::npos) return problem;
    nums.push_back(std::stoi(part));
    if (next == std::string::npos) break;
    pos = next + 1;
  }
  const auto ok = [&](bool b) { return b ? std::string() : problem; };
  if ((prefix == "nvlink" || prefix == "pcie") && nums.size() == 1) return ok(nums[0] < world);
  if (prefix == "hostmem" && nums.size() == 1) return ok(nums[0] < c.nodes);
  if (prefix == "nic" && nums.size() == 2) return ok(fabric && nums[0] < c.nodes && nums[1] < rails);
  if (prefix == "leafup" && nums.size() == 2) return ok(leafups && nums[0] < groups && nums[1] < rails);
  if (prefix == "podup" && nums.size() == 1) return ok(fabric && c.fat_tree_levels >= 3 && nums[0] < pods);
  return problem;
}

int Platform::slot(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(slot_of_rank_.size()) || slot_of_rank_[rank] < 0)
    throw std::out_of_range("simulator: rank " + std::to_string(rank) + " has no endpoint");
  return slot_of_rank_[rank];
}

sg4::Host* Platform::gpu(int rank) const { return gpu_[slot(rank)]; }
sg4::Host* Platform::nic(int rank) const { return nic_[slot(rank)]; }
sg4::Host* Platform::pcie(int rank) const { return pcie_[slot(rank)]; }
sg4::Host* Platform::cpu(int rank) const { return cpu_[slot(rank)]; }

std::pair<sg4::Host*, sg4::Host*> Platform::endpoints(int a, int b) const {
  if (same_node(a, b)) return {gpu(a), gpu(b)};
  return {nic(a), nic(b)};
}

}  // namespace dssim::sim
