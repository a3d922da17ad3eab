// NCCL's tuner as core/collective_model.hpp models it: closed forms of its latency (base + every
// ring step's hop cost) and protocol bandwidths (src/graph/tuning.cc), the choice between them,
// and the published nccl-tests plateaus it must reproduce (../shared/references/
// zero3-fsdp-pipeline-nccl-sources.md section 3).
#include <catch2/catch.hpp>

#include <numeric>

#include "core/collective_model.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;
using Catch::Detail::Approx;

namespace {
std::vector<int> iota(int n) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}
ClusterSpec cluster(const std::string& preset, int nodes) {
  return load_scenario_from_string("model: gpt-1.3b\ntraining: {global_batch: " + std::to_string(nodes * 8) +
                                   ", micro_batch: 1}\ncluster: {preset: " + preset + ", nodes: " +
                                   std::to_string(nodes) + "}\n")
      .cluster;
}
// nccl-tests' bus bandwidth of an all-reduce / all-gather that took `seconds`.
double busbw(Op op, double bytes, int n, double seconds) { return wire_bytes_per_rank(op, bytes, n) / seconds; }
}  // namespace

TEST_CASE("ring latency: base plus every step's hop, network proxy overhead on AMD hosts", "[collective][nccl]") {
  const ClusterSpec c = cluster("dgx-a100-hdr", 128);  // 1024 A100, AMD EPYC hosts
  REQUIRE(c.host_cpu == "amd");
  const auto ranks = iota(1024);
  // Simple ring all-gather: 8.4 us base, 1023 steps of which 127 cross the network (14 us) and
  // the rest NVLink hops priced at max(3.4, 3 x 2 us) = 6 us.
  const NcclChoice s = nccl_candidate(c, Op::AllGather, 1e9, ranks, NcclAlgo::Ring, NcclProto::Simple);
  CHECK(s.latency == Approx((8.4 + (1023 - 127) * 6.0 + 127 * 14.0) * 1e-6));
  CHECK(s.bus_bandwidth == Approx(8 * 25e9));  // 8 HDR NICs per node, one ring per rail
  CHECK(s.seconds == Approx(s.latency + 1023.0 / 1024 * 1e9 / (8 * 25e9)));
  // LL: 6.6 us base, NVLink hops max(0.6, 2) us, network hops 2.7 us; half the bandwidth, at most
  // 19 GB/s (llMaxBw, AMD host, more than 2 nodes).
  const NcclChoice ll = nccl_candidate(c, Op::AllGather, 1e9, ranks, NcclAlgo::Ring, NcclProto::LL);
  CHECK(ll.latency == Approx((6.6 + 896 * 2.0 + 127 * 2.7) * 1e-6));
  CHECK(ll.bus_bandwidth == Approx(19e9));
  CHECK(ll.wire_factor == Approx(200.0 / 19));
  // The same ring on 16 nodes: 8x fewer steps.
  const NcclChoice s16 = nccl_candidate(c, Op::AllGather, 1e9, iota(128), NcclAlgo::Ring, NcclProto::Simple);
  CHECK(s16.latency == Approx((8.4 + 112 * 6.0 + 15 * 14.0) * 1e-6));
  // Trees only all-reduce.
  CHECK(nccl_candidate(c, Op::AllGather, 1e9, ranks, NcclAlgo::Tree, NcclProto::Simple).bus_bandwidth == 0);
  // Tree all-reduce: 2 ((ppn - 1) NVLink hops + log2(nodes) network hops), 8.4 us base.
  const NcclChoice t = nccl_candidate(c, Op::AllReduce, 1e9, ranks, NcclAlgo::Tree, NcclProto::Simple);
  CHECK(t.latency == Approx((8.4 + 2 * (7 * 4.0 + 7 * 14.0)) * 1e-6));
}

TEST_CASE("NCCL's choice: the fastest protocol for the size", "[collective][nccl]") {
  const ClusterSpec c = cluster("dgx-a100-hdr", 16);
  const auto ranks = iota(128);
  // Tiny messages: latency decides, LL wins; 100 MB: LL128 (92% of the bandwidth, a third of
  // Simple's latency on 16 nodes); 8 GB: Simple's bandwidth wins.
  CHECK(nccl_choice(c, Op::AllGather, 64e3, ranks).proto == NcclProto::LL);
  CHECK(nccl_choice(c, Op::AllGather, 1e8, ranks).proto == NcclProto::LL128);
  const NcclChoice big = nccl_choice(c, Op::AllGather, 8e9, ranks);
  CHECK(big.proto == NcclProto::Simple);
  CHECK(big.algo == NcclAlgo::Ring);
  for (double bytes : {1e3, 1e5, 1e7, 1e9}) {
    const NcclChoice ch = nccl_choice(c, Op::AllReduce, bytes, ranks);
    for (NcclAlgo a : {NcclAlgo::Ring, NcclAlgo::Tree})
      for (NcclProto p : {NcclProto::LL, NcclProto::LL128, NcclProto::Simple}) {
        const NcclChoice o = nccl_candidate(c, Op::AllReduce, bytes, ranks, a, p);
        if (o.bus_bandwidth > 0) CHECK(ch.seconds <= o.seconds);
      }
    CHECK(collective_seconds(c, Op::AllReduce, bytes, ranks) == Approx(ch.seconds));
  }
  // PCIe-only nodes never run LL128.
  ClusterSpec p = c;
  p.intra_node = "pcie";
  for (double bytes : {1e3, 1e5, 1e7, 1e9}) CHECK(nccl_choice(p, Op::AllReduce, bytes, iota(8)).proto != NcclProto::LL128);
}

TEST_CASE("bus bandwidth falls with the rank count for a fixed message", "[collective][nccl]") {
  // A ZeRO-3 all-gather of one GPT-3 175B attention projection (12288^2 fp16 = 302 MB): the
  // per-rank chunk shrinks as the ranks grow while the ring's steps grow with them.
  const ClusterSpec c = cluster("dgx-a100-hdr", 128);
  const double bytes = 2.0 * 12288 * 12288;
  double last = 1e30;
  for (int n : {16, 64, 256, 1024}) {
    const double bw = busbw(Op::AllGather, bytes, n, collective_seconds(c, Op::AllGather, bytes, iota(n)));
    CHECK(bw < last);
    last = bw;
  }
  CHECK(last < 0.6 * 200e9);
}

TEST_CASE("large-message plateaus match nccl-tests on DGX A100 and DGX H100", "[collective][nccl]") {
  // GTC24 S62129 (Jeaugey), all-reduce bus bandwidth: DGX A100 with 8x200 Gb RDMA 192 GB/s,
  // DGX H100 with 8x400 Gb RDMA 380 GB/s; NVIDIA/nccl#1576: "we measure 192GB/s AllReduce BusBW"
  // on DGX A100. 8 GB on 8 nodes, as the plateau is measured.
  const double bytes = 8e9;
  const ClusterSpec a = cluster("dgx-a100-hdr", 8);
  const double bw_a = busbw(Op::AllReduce, bytes, 64, collective_seconds(a, Op::AllReduce, bytes, iota(64)));
  CHECK(bw_a == Approx(192e9).epsilon(0.05));
  const ClusterSpec h = cluster("dgx-h100-ndr", 8);
  const double bw_h = busbw(Op::AllReduce, bytes, 64, collective_seconds(h, Op::AllReduce, bytes, iota(64)));
  CHECK(bw_h == Approx(380e9).epsilon(0.05));
}
