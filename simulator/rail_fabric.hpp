// The inter-node fabric of a two-level (leaf + spine) rail-optimized fat tree as one SimGrid zone
// whose routes are computed, not stored: NIC -> [leaf uplink -> leaf downlink] -> NIC.
//
// It gives every route exactly the links, in the same order, and the latency, summed in the same
// order, that the zone hierarchy it replaces gave (a star zone per (leaf group, rail) holding its
// NICs, under a star zone of leaf uplinks; SimGrid's get_global_route: the common ancestor's
// links and latency first, then the source side, then the destination side), so the network
// model sees the same flows. Why: SimGrid 3.32 checks each new host's and link's name by walking
// every zone of the platform and seals each zone by walking every host of the platform, so
// building Z leaf zones cost O(Z x (hosts + links)): quadratic in the GPU count (docs/simulator.md).
#pragma once
#include <memory>
#include <string>

namespace simgrid::s4u { class Host; class SplitDuplexLink; class NetZone; }

namespace dssim::sim {

class RailFabric {
 public:
  // Creates the zone under `parent` (not sealed).
  RailFabric(const std::string& name, simgrid::s4u::NetZone* parent);
  ~RailFabric();
  simgrid::s4u::NetZone* zone() const;
  int add_leaf();                                                        // a (leaf group, rail) switch
  void set_leaf_uplink(int leaf, simgrid::s4u::SplitDuplexLink* split_duplex);      // none: NICs of one leaf only
  void add_nic(simgrid::s4u::Host* nic, simgrid::s4u::SplitDuplexLink* split_duplex, int leaf);

 private:
  struct Impl;
  Impl* impl_;  // owned by SimGrid's zone tree (destroyed with the engine)
};

}  // namespace dssim::sim
