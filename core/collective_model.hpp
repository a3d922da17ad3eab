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

// All-reduce algorithms NCCL chooses between for groups that span nodes. Ring: 2(N-1)/N S/B +
// 2(N-1) alpha. Double binary tree (NCCL >= 2.4): every rank sends and receives about S in the
// reduce and again in the broadcast, pipelined: 2 S/B + 2 ceil(log2 N) alpha. NCCL's tuner picks
// the faster one, which is the tree for latency-bound sizes on many nodes.
double ring_allreduce_seconds(double size_bytes, int n, const LinkClass& link);
double tree_allreduce_seconds(double size_bytes, int n, const LinkClass& link);
bool tree_allreduce_wins(const ClusterSpec& c, double size_bytes, const std::vector<int>& ranks);
double p2p_seconds(const ClusterSpec& c, double bytes, int from_rank, int to_rank);

}  // namespace dssim
