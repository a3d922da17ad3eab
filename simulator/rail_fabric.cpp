#include "simulator/rail_fabric.hpp"

#include <stdexcept>
#include <vector>
#include <simgrid/kernel/routing/NetPoint.hpp>
#include <simgrid/kernel/routing/NetZoneImpl.hpp>
#include <simgrid/s4u.hpp>

namespace dssim::sim {

namespace sgr = simgrid::kernel::routing;
using LinkImpl = simgrid::kernel::resource::StandardLinkImpl;

struct RailFabric::Impl : public sgr::NetZoneImpl {
  struct Dir { LinkImpl* up = nullptr; LinkImpl* down = nullptr; double latency = 0; };
  struct Nic { Dir link; int leaf = -1; };
  std::vector<Dir> leaves;          // uplink of each leaf (up == nullptr: none)
  std::vector<Nic> nics;
  std::vector<int> nic_of_vertex;   // NetPoint id in this zone -> index in nics, or -1

  explicit Impl(const std::string& name) : sgr::NetZoneImpl(name) {}

  static Dir dir_of(simgrid::s4u::SplitDuplexLink* split_duplex) {
    Dir d;
    d.up = split_duplex->get_link_up()->get_impl();
    d.down = split_duplex->get_link_down()->get_impl();
    d.latency = split_duplex->get_link_up()->get_latency();
    return d;
  }

  const Nic& nic(const sgr::NetPoint* p) const {
    const auto id = p->id();
    if (id >= nic_of_vertex.size() || nic_of_vertex[id] < 0)
      throw std::logic_error("rail fabric: route from or to '" + p->get_name() + "', which is no NIC of it");
    return nics[nic_of_vertex[id]];
  }

  static void add(sgr::Route* r, double* latency, LinkImpl* l, double lat) {
    r->link_list_.push_back(l);
    if (latency) *latency += lat;
  }

  void get_local_route(const sgr::NetPoint* src, const sgr::NetPoint* dst, sgr::Route* r, double* latency) override {
    const Nic& a = nic(src);
    const Nic& b = nic(dst);
    r->link_list_.reserve(r->link_list_.size() + 4);
    if (a.leaf == b.leaf || leaves[a.leaf].up == nullptr) {
      // Inside one leaf zone: its star's route, source up then destination down.
      add(r, latency, a.link.up, a.link.latency);
      add(r, latency, b.link.down, b.link.latency);
      return;
    }
    // Across leaves, as get_global_route composed it: the parent's latency (uplink, downlink)
    // first, then the source side, then the destination side; links in path order.
    const Dir& la = leaves[a.leaf];
    const Dir& lb = leaves[b.leaf];
    if (latency) { *latency += la.latency; *latency += lb.latency; }
    add(r, latency, a.link.up, a.link.latency);
    r->link_list_.push_back(la.up);
    r->link_list_.push_back(lb.down);
    add(r, latency, b.link.down, b.link.latency);
  }
};

RailFabric::RailFabric(const std::string& name, simgrid::s4u::NetZone* parent) : impl_(new Impl(name)) {
  impl_->get_iface()->set_parent(parent);
}
RailFabric::~RailFabric() = default;

simgrid::s4u::NetZone* RailFabric::zone() const { return impl_->get_iface(); }

int RailFabric::add_leaf() {
  impl_->leaves.emplace_back();
  return static_cast<int>(impl_->leaves.size()) - 1;
}

void RailFabric::set_leaf_uplink(int leaf, simgrid::s4u::SplitDuplexLink* split_duplex) {
  impl_->leaves.at(leaf) = Impl::dir_of(split_duplex);
}

void RailFabric::add_nic(simgrid::s4u::Host* nic, simgrid::s4u::SplitDuplexLink* split_duplex, int leaf) {
  const auto id = nic->get_netpoint()->id();
  if (id >= impl_->nic_of_vertex.size()) impl_->nic_of_vertex.resize(id + 1, -1);
  impl_->nic_of_vertex[id] = static_cast<int>(impl_->nics.size());
  impl_->nics.push_back({Impl::dir_of(split_duplex), leaf});
}

}  // namespace dssim::sim
