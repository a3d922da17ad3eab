// Collective and link-sharing laws of the simulated network, on hand-built Programs.
#include "tests/sim/hand_built.hpp"
#include <catch2/catch.hpp>
#include "backends/sim/sim_backend.hpp"
#include "simulator/collectives.hpp"
#include "core/collective_model.hpp"

using namespace dssim;

namespace {

using simtest::cluster_scenario;

// Every group runs one collective of `bytes` on the DP stream.
Program collective_program(int world, const std::vector<std::vector<int>>& groups, Op op, double bytes) {
  Program p;
  p.world = world;
  p.ranks.resize(world);
  for (int r = 0; r < world; ++r) p.ranks[r].rank = r;
  for (size_t g = 0; g < groups.size(); ++g) {
    p.groups.push_back({GroupKind::DP, groups[g]});
    for (int r : groups[g]) {
      Instruction in;
      in.op = op;
      in.stream = Stream::DpComm;
      in.purpose = Purpose::GradientReduce;
      in.group = static_cast<int>(g);
      in.bytes = bytes;
      p.ranks[r].add(in);
    }
  }
  return p;
}

std::vector<int> iota(int n, int from = 0, int step = 1) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(from + i * step);
  return v;
}

}  // namespace

TEST_CASE("ring all-reduce over N GPUs takes 2(N-1)/N S/B plus NCCL's ring latency") {
  const double B = 25e9, S = 1e9;
  for (int n : {2, 4, 8}) {
    Scenario sc = cluster_scenario(n, 1, 1, B);
    const Program p = collective_program(n, {iota(n)}, Op::AllReduce, S);
    const Report r = simulate_program(sc, p);
    const NcclChoice ch = nccl_choice(sc.cluster, Op::AllReduce, S, iota(n));
    REQUIRE(ch.algo == NcclAlgo::Ring);
    // The flows carry the bytes (times the protocol's wire factor) and one route's latency.
    const double expect = 2.0 * (n - 1) / n * S / B * ch.wire_factor + ch.latency;
    INFO("n = " << n);
    CHECK(r.iteration_seconds == Approx(expect).epsilon(1e-3));
    CHECK(r.iteration_seconds == Approx(ch.seconds).epsilon(1e-3));
  }
}

TEST_CASE("reduce-scatter and all-gather move (N-1)/N S per rank") {
  const double B = 25e9, S = 4e9;
  const int n = 4;
  Scenario sc = cluster_scenario(n, 1, 1, B);
  for (Op op : {Op::ReduceScatter, Op::AllGather}) {
    const Report r = simulate_program(sc, collective_program(n, {iota(n)}, op, S));
    const NcclChoice ch = nccl_choice(sc.cluster, op, S, iota(n));
    CHECK(r.iteration_seconds == Approx(0.75 * S / B * ch.wire_factor + ch.latency).epsilon(1e-3));
  }
}

TEST_CASE("two all-reduces sharing one NIC per node each take twice as long as one alone") {
  // 4 nodes x 2 GPUs, one NIC per node: the two DP rings (local GPU 0s and local GPU 1s) share it.
  const double B = 25e9, S = 2e9;
  Scenario sc = cluster_scenario(4, 2, 1, B);
  const auto g0 = iota(4, 0, 2), g1 = iota(4, 1, 2);
  const Report alone = simulate_program(sc, collective_program(8, {g0}, Op::AllReduce, S));
  const Report both = simulate_program(sc, collective_program(8, {g0, g1}, Op::AllReduce, S));
  const double lat = nccl_choice(sc.cluster, Op::AllReduce, S, g0).latency;
  const double bw_alone = alone.iteration_seconds - lat;
  const double bw_both = both.iteration_seconds - lat;
  CHECK(bw_both == Approx(2 * bw_alone).epsilon(1e-3));
  CHECK(both.iteration_seconds > 1.99 * alone.iteration_seconds);
  // With a NIC per GPU they do not interfere.
  Scenario rails = cluster_scenario(4, 2, 2, B);
  const Report sep = simulate_program(rails, collective_program(8, {g0, g1}, Op::AllReduce, S));
  CHECK(sep.iteration_seconds == Approx(alone.iteration_seconds).epsilon(1e-9));
}

TEST_CASE("phase and step collective detail agree within 2% on bandwidth-bound sizes") {
  const double B = 25e9;
  for (Op op : {Op::AllReduce, Op::ReduceScatter, Op::AllGather}) {
    for (int n : {4, 16}) {
      // Flat rings (one GPU per node) and hierarchical ones (4 GPUs per node).
      for (int gpn : {1, 4}) {
        Scenario sc = cluster_scenario(n / gpn > 1 ? n / gpn : 2, gpn, gpn, B);
        const int world = sc.cluster.nodes * gpn;
        const Program p = collective_program(world, {iota(world)}, op, 512e6);
        SimOptions phase, step;
        step.detail = SimOptions::CollectiveDetail::Step;
        const double tp = simulate_program(sc, p, phase).iteration_seconds;
        const double ts = simulate_program(sc, p, step).iteration_seconds;
        INFO(to_string(op) << " over " << world << " GPUs, " << gpn << " per node");
        CHECK(tp == Approx(ts).epsilon(0.02));
      }
    }
  }
}

TEST_CASE("all-gather over more ranks than a NIC can serve is bounded by the oversubscribed uplink") {
  // 64 nodes (two leaf groups of 32), oversubscription 4: a ring that crosses leaves twice runs at
  // the uplink's per-flow share only on its 2 crossing hops; the ring time is set by the slowest hop.
  const double B = 25e9, S = 8e9;
  Scenario sc = cluster_scenario(64, 1, 1, B);
  sc.cluster.oversubscription = 4;
  const Program p = collective_program(64, {iota(64)}, Op::AllGather, S);
  const Report r = simulate_program(sc, p);
  const Report flat = simulate_program(cluster_scenario(64, 1, 1, B), p);
  // One flow per crossing direction: uplink capacity 32 B / 4 = 8 B > B, so no slowdown...
  CHECK(r.iteration_seconds == Approx(flat.iteration_seconds).epsilon(1e-3));
  // ...but all 64 ranks sending across leaves at once (shift by 32) are limited to 8B/32 = B/4.
  Program cross;
  cross.world = 64;
  cross.ranks.resize(64);
  for (int i = 0; i < 64; ++i) {
    cross.ranks[i].rank = i;
    Instruction in;
    in.op = i < 32 ? Op::Send : Op::Recv;
    in.stream = Stream::PpComm;
    in.peer = i < 32 ? i + 32 : i - 32;
    in.tag = 1;
    in.bytes = 1e9;
    cross.ranks[i].add(in);
  }
  const Report rc = simulate_program(sc, cross);
  CHECK(rc.iteration_seconds == Approx(1e9 / (B / 4)).epsilon(0.01));
}

TEST_CASE("all-reduce across nodes: NCCL's double binary tree for latency-bound sizes, ring for large") {
  Scenario sc = cluster_scenario(16, 1, 1, 25e9);
  const std::vector<int> group = iota(16);
  const LinkClass link = group_link(sc.cluster, group);
  // small: the tree's 2 log2(16) network hops beat the ring's 2 x 15
  CHECK(tree_allreduce_wins(sc.cluster, 64e3, group));
  const NcclChoice small = nccl_choice(sc.cluster, Op::AllReduce, 64e3, group);
  CHECK(small.algo == NcclAlgo::Tree);
  CHECK(collective_seconds(sc.cluster, Op::AllReduce, 64e3, group) == Approx(small.latency + 2 * 64e3 / small.bus_bandwidth));
  // large: bandwidth-bound, the ring moves 2 (N-1)/N S instead of 2 S
  CHECK_FALSE(tree_allreduce_wins(sc.cluster, 8e9, group));
  CHECK(collective_seconds(sc.cluster, Op::AllReduce, 8e9, group) == Approx(ring_allreduce_seconds(8e9, 16, link)).epsilon(0.01));
  // inside one node NCCL rings over NVLink
  CHECK_FALSE(tree_allreduce_wins(cluster_scenario(1, 8, 8, 25e9).cluster, 64e3, iota(8)));

  // The simulator runs the tree as flows and agrees with the closed form.
  for (double bytes : {64e3, 1e6}) {
    INFO("bytes " << bytes);
    REQUIRE(tree_allreduce_wins(sc.cluster, bytes, group));
    const Program p = collective_program(16, {group}, Op::AllReduce, bytes);
    const double sim = simulate_program(sc, p).iteration_seconds;
    CHECK(sim == Approx(collective_seconds(sc.cluster, Op::AllReduce, bytes, group)).epsilon(0.15));
    CHECK(sim < nccl_candidate(sc.cluster, Op::AllReduce, bytes, group, NcclAlgo::Ring, NcclProto::Simple).seconds);
  }
}

TEST_CASE("rail-optimised rings: m GPUs per node on n nodes, each rail's NIC carries (n-1)/n S/m per pass", "[links]") {
  // 4 nodes x 2 GPUs, a NIC per GPU: NCCL's two rings (one per rail) each move S/2 over 4 nodes.
  // If the rails' flows shared one NIC the all-reduce would take twice as long.
  const double B = 25e9, S = 2e9;
  const int n = 4, m = 2;
  Scenario sc = cluster_scenario(n, m, m, B);
  SimOptions o;
  o.busiest_links = 1000;
  const Report r = simulate_program(sc, collective_program(n * m, {iota(n * m)}, Op::AllReduce, S), o);
  const NcclChoice ch = nccl_choice(sc.cluster, Op::AllReduce, S, iota(n * m));
  REQUIRE(ch.algo == NcclAlgo::Ring);
  const double per_nic = 2.0 * (n - 1) / n * S / m * ch.wire_factor;
  CHECK(r.iteration_seconds == Approx(per_nic / B + ch.latency).epsilon(1e-3));
  int nics = 0;
  for (const auto& l : r.extras.at("sim").at("links").at("busiest")) {
    const std::string name = l.at("name");
    INFO(name);
    CHECK(l.at("utilization").get<double>() <= 1.0 + 1e-9);
    if (name.rfind("nic-", 0) != 0) continue;
    ++nics;
    CHECK(l.at("bytes").get<double>() == Approx(per_nic).epsilon(1e-9));
  }
  CHECK(nics == 2 * n * m);  // every NIC, both directions
}
