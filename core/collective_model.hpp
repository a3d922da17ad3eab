// Time of a collective or point-to-point transfer when nothing else contends, as NCCL's own tuner
// predicts it (src/graph/tuning.cc: ncclTopoTuneModel, ncclTopoGetAlgoTime; NCCL 2.12 - 2.27 use
// the same constants): for each algorithm (ring; double binary tree for all-reduce) and protocol
// (LL, LL128, Simple) a latency and a bus bandwidth, time = latency + bytes / algorithm bandwidth,
// and NCCL runs the fastest. The latency of a ring grows with the rank count (a chunk walks every
// hop: nNodes - 1 network hops and the rest NVLink / PCIe hops, each with its per-step cost), so
// a collective whose per-rank chunk is small on many ranks runs far below the bus bandwidth.
//
// The analytic estimator uses it for every collective; the simulator uses it whole where it is
// exact (a group confined to one non-blocking NVSwitch) and, elsewhere, takes the latency and the
// protocol's bandwidth factor from it and models the bytes as flows (simulator/collectives.hpp).
// docs/simulator.md, "Collectives as NCCL runs them", says where each constant comes from.
#pragma once
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct LinkClass {
  double bandwidth = 0;  // bytes/s per GPU per direction on the ring's bottleneck (bus bandwidth)
  double latency = 0;    // seconds per hop (point-to-point transfers)
};

// The bottleneck a group's ring sees: NVLink inside one node; with members on several nodes,
// each GPU's share of its node's NICs (rail-optimized), with the fat tree's oversubscription.
LinkClass group_link(const ClusterSpec& c, const std::vector<int>& ranks);

enum class NcclAlgo { Ring, Tree };
enum class NcclProto { LL, LL128, Simple };
const char* to_string(NcclAlgo);
const char* to_string(NcclProto);

// What NCCL's tuner picks for one collective, and its prediction.
struct NcclChoice {
  NcclAlgo algo = NcclAlgo::Ring;
  NcclProto proto = NcclProto::Simple;
  double latency = 0;         // seconds (base + per-step latencies)
  double bus_bandwidth = 0;   // bytes/s, the protocol's and algorithm's bus bandwidth
  double seconds = 0;         // latency + bytes / algorithm bandwidth
  // Bus bandwidth of the Simple protocol on the same links over the chosen one's: how many times
  // longer the protocol keeps the links busy per byte (LL: >= 2, LL128: 128/120, Simple: 1).
  double wire_factor = 1;
};

// The group's shape as NCCL's tuner sees it.
struct NcclGroup {
  int ranks = 1;
  int nodes = 1;
  int per_node = 1;           // the most members on one node (ppn)
};
NcclGroup nccl_group(const ClusterSpec& c, const std::vector<int>& ranks);

// One (algorithm, protocol) pair's latency and bus bandwidth for `op` on `ranks`; bus_bandwidth
// 0 when NCCL does not run that pair for the op (tree for anything but all-reduce).
NcclChoice nccl_candidate(const ClusterSpec& c, Op op, double bytes, const std::vector<int>& ranks,
                          NcclAlgo algo, NcclProto proto);
// The fastest candidate (NCCL's choice with no NCCL_ALGO / NCCL_PROTO set).
NcclChoice nccl_choice(const ClusterSpec& c, Op op, double bytes, const std::vector<int>& ranks);

double collective_seconds(const ClusterSpec& c, Op op, double size_bytes, const std::vector<int>& ranks);

// The two all-reduce algorithms with the Simple protocol on a link (bus bandwidth B): ring
// 2(N-1)/N S/B, double binary tree 2 S/B (every rank sends and receives about S in the reduce and
// again in the broadcast). Latencies are NCCL's (nccl_candidate); these are the bandwidth terms.
double ring_allreduce_seconds(double size_bytes, int n, const LinkClass& link);
double tree_allreduce_seconds(double size_bytes, int n, const LinkClass& link);
bool tree_allreduce_wins(const ClusterSpec& c, double size_bytes, const std::vector<int>& ranks);
double p2p_seconds(const ClusterSpec& c, double bytes, int from_rank, int to_rank);

}  // namespace dssim
