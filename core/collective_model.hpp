// Closed-form time of a collective or point-to-point transfer when nothing else contends
// (alpha-beta model of NCCL's ring algorithms). The analytic estimator uses it for every
// collective; the simulator uses it only where it is exact (a group confined to one
// non-blocking NVSwitch) and models the rest as flows.
#pragma once
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct LinkClass {
  double bandwidth = 0;  // bytes/s per GPU per direction on the ring's bottleneck
  double latency = 0;    // seconds per ring step
};

// The bottleneck a group's ring sees: NVLink inside one node; with members on several nodes,
// each GPU's share of its node's NICs (rail-optimized), with the fat tree's oversubscription.
LinkClass group_link(const ClusterSpec& c, const std::vector<int>& ranks);

double collective_seconds(const ClusterSpec& c, Op op, double size_bytes, const std::vector<int>& ranks);
double p2p_seconds(const ClusterSpec& c, double bytes, int from_rank, int to_rank);

}  // namespace dssim
