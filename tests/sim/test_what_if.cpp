// What-ifs (core/what_if.hpp, docs/simulator.md "What-ifs"): closed forms they must reproduce.
//  - one GPU at speed F in a compute-bound data-parallel job: the compute part takes 1/F as long;
//  - no what-if (or factors of exactly 1, noise 0 %) changes nothing;
//  - halving one NIC of a bandwidth-bound ring all-reduce doubles the collective;
//  - a what-if on a link no flow crosses changes nothing;
//  - noise draws are seeded: the same seed gives the same iteration, bit for bit.
#include "tests/sim/hand_built.hpp"
#include <catch2/catch.hpp>
#include "backends/sim/sim_backend.hpp"
#include "core/collective_model.hpp"
#include "core/scenario_loader.hpp"
#include "core/what_if.hpp"
#include "simulator/executor.hpp"

using namespace dssim;

namespace {

// Data parallelism on one DGX A100 (NVSwitch): compute-bound, 4 micro-batches of 4 x 1024.
Scenario dp_scenario() {
  const std::string yaml =
      "name: what-if-dp\n"
      "model: {preset: gpt-350m, layers: 8, seq_len: 1024}\n"
      "training: {global_batch: 128, micro_batch: 4}\n"
      "parallel: {tp: 1, pp: 1, dp: 8}\n"
      "zero: {stage: 1}\n"
      "precision: bf16\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 1}\n";
  return load_scenario_from_string(yaml, {}, "what-if-dp");
}

using simtest::cluster_scenario;

// One all-reduce of `bytes` over `members` (the other ranks exist and do nothing).
Program allreduce_program(int world, const std::vector<int>& members, double bytes) {
  Program p;
  p.world = world;
  p.ranks.resize(world);
  for (int r = 0; r < world; ++r) p.ranks[r].rank = r;
  p.groups.push_back({GroupKind::DP, members});
  for (int r : members) {
    Instruction in;
    in.op = Op::AllReduce;
    in.stream = Stream::DpComm;
    in.purpose = Purpose::GradientReduce;
    in.group = 0;
    in.bytes = bytes;
    p.ranks[r].add(in);
  }
  return p;
}

SimOptions with(std::initializer_list<const char*> specs) {
  SimOptions o;
  for (const char* s : specs) o.what_ifs.push_back(parse_what_if(s));
  return o;
}

double compute_of(const Report& r) { return r.time.forward + r.time.backward + r.time.recompute + r.time.optimizer; }

}  // namespace

TEST_CASE("what-if specs: grammar and clear errors", "[what-if]") {
  const WhatIf a = parse_what_if("slow-gpu 0,16-18 x0.8");
  CHECK(a.kind == WhatIf::Kind::SlowGpu);
  CHECK(a.ranks == std::vector<int>{0, 16, 17, 18});
  CHECK(a.factor == 0.8);
  CHECK(parse_what_if("nic 2.1 x0.5").node == 2);
  CHECK(parse_what_if("nic 2.1 x0.5").nic == 1);
  CHECK(parse_what_if("noise 5%").factor == Approx(0.05));
  CHECK(parse_what_if("background-traffic 0.3").factor == 0.3);
  CHECK(parse_what_if("node 3 down-links x0.25").node == 3);
  CHECK(parse_what_if("link leafup-0-1 x0.5").link == "leafup-0-1");
  CHECK_THROWS_WITH(parse_what_if("slow-gpu 17 0.8"), Catch::Contains("what-if 'slow-gpu 17 0.8'") && Catch::Contains("xF"));
  CHECK_THROWS_WITH(parse_what_if("slow-gpu 17 x0"), Catch::Contains("greater than 0"));
  CHECK_THROWS_WITH(parse_what_if("fast-gpu 1 x2"), Catch::Contains("unknown what-if 'fast-gpu'"));
  CHECK_THROWS_WITH(parse_what_if("noise 5"), Catch::Contains("noise 5%"));
  CHECK_THROWS_WITH(parse_what_if("link nic-0-1_UP x0.5"), Catch::Contains("link nic-0-1 x0.5"));
  CHECK_THROWS_WITH(parse_what_if("background-traffic 1"), Catch::Contains("below 1"));
  const Scenario sc = dp_scenario();
  CHECK_THROWS_WITH(check_what_ifs(sc, {parse_what_if("slow-gpu 8 x0.5")}), Catch::Contains("ranks 0-7"));
  CHECK_THROWS_WITH(simulate(sc, with({"link nic-0-0 x0.5"})), Catch::Contains("no link named 'nic-0-0'"));
}

TEST_CASE("one slow GPU in compute-bound data parallelism: the compute part takes 1/F as long", "[what-if]") {
  const Scenario sc = dp_scenario();
  const Report clean = simulate(sc);
  const double C = compute_of(clean);
  REQUIRE(C > 0.8 * clean.iteration_seconds);  // compute-bound
  for (double F : {0.8, 0.5}) {
    SimOptions o;
    o.what_ifs = {parse_what_if("slow-gpu 3 x" + std::to_string(F))};
    const Report r = simulate_what_if(sc, o);
    // Everything but the compute is unchanged: the others wait for rank 3 at the all-reduce.
    const double expected = clean.iteration_seconds + C * (1 / F - 1);
    INFO("F " << F << ": clean " << clean.iteration_seconds << " s, compute " << C << " s, what-if "
              << r.iteration_seconds << " s, expected " << expected << " s");
    CHECK(std::abs(r.iteration_seconds - expected) <= 0.01 * C / F);
    const auto& w = r.extras.at("what_if");
    CHECK(w.at("clean_iteration_seconds").get<double>() == clean.iteration_seconds);
    CHECK(w.at("straggler").at("rank").get<int>() == 3);
    CHECK(w.at("straggler").at("last_by_kind").at("dp").get<int>() > 0);
    CHECK(w.at("straggler").at("last").get<uint64_t>() == w.at("straggler").at("joined").get<uint64_t>());
  }
}

TEST_CASE("no what-if, or what-ifs of factor 1, change nothing", "[what-if]") {
  const Scenario sc = dp_scenario();
  const Report clean = simulate(sc);
  // No what-if at all: the same run.
  const Report none = simulate_what_if(sc, SimOptions{});
  CHECK(none.iteration_seconds == clean.iteration_seconds);
  CHECK(none.extras.at("what_if").at("change").get<double>() == 0.0);
  // Factors of exactly 1 run unfolded (every rank simulated): the same iteration.
  const Report ones = simulate(sc, with({"slow-gpu 0-7 x1", "background-traffic 0", "noise 0%"}));
  CHECK(ones.iteration_seconds == Approx(clean.iteration_seconds).epsilon(1e-12));
  CHECK(ones.extras.at("sim").at("simulation").at("folded_tensor_parallel") == false);
}

TEST_CASE("noise 0 % is the deterministic run exactly - noise is seeded and costs at synchronizations", "[what-if]") {
  const Scenario sc = dp_scenario();
  const Report det = simulate(sc, with({"slow-gpu 0 x1"}));  // unfolded, no noise
  const Report zero = simulate(sc, with({"noise 0%"}));
  CHECK(zero.iteration_seconds == det.iteration_seconds);
  CHECK(report_json(sc, zero)["time_seconds"] == report_json(sc, det)["time_seconds"]);
  SimOptions o = with({"noise 5%"});
  o.noise_seed = 7;
  const Report a = simulate(sc, o), b = simulate(sc, o);
  CHECK(a.iteration_seconds == b.iteration_seconds);  // same seed, same draws
  o.noise_seed = 8;
  const Report c = simulate(sc, o);
  CHECK(c.iteration_seconds != a.iteration_seconds);
  // Each draw has mean 1; the iteration waits for the slowest of 8 GPUs at every all-reduce.
  const Report s = simulate_what_if(sc, with({"noise 5%"}), 6);
  const auto& n = s.extras.at("what_if").at("noise");
  CHECK(n.at("samples").get<int>() == 6);
  CHECK(n.at("iteration_seconds").size() == 6);
  CHECK(n.at("mean_seconds").get<double>() > det.iteration_seconds);
  CHECK(n.at("stddev_seconds").get<double>() > 0);
  // The factor itself: mean 1 and the asked CV over many draws.
  double m = 0, m2 = 0;
  const int N = 200000;
  for (int i = 0; i < N; ++i) {
    const double f = sim::noise_factor(0.05, 3, i % 97, uint32_t(i));
    m += f / N;
    m2 += f * f / N;
  }
  CHECK(m == Approx(1.0).epsilon(1e-3));
  CHECK(std::sqrt(m2 - m * m) == Approx(0.05).epsilon(0.02));
  CHECK(sim::noise_factor(0.0, 3, 1, 2) == 1.0);
}

TEST_CASE("halving one NIC of a bandwidth-bound ring all-reduce doubles the collective", "[what-if]") {
  const double B = 25e9, S = 2e9;
  const int n = 4;
  const Scenario sc = cluster_scenario(n, 1, 1, B);
  const Program p = allreduce_program(n, {0, 1, 2, 3}, S);
  const Report clean = simulate_program(sc, p);
  const NcclChoice ch = nccl_choice(sc.cluster, Op::AllReduce, S, {0, 1, 2, 3});
  REQUIRE(ch.algo == NcclAlgo::Ring);
  REQUIRE(ch.latency < 0.01 * clean.iteration_seconds);  // bandwidth-bound
  for (const char* spec : {"nic 2.0 x0.5", "link nic-2-0 x0.5", "node 2 down-links x0.5"}) {
    INFO(spec);
    const Report half = simulate_program(sc, p, with({spec}));
    CHECK(half.iteration_seconds == Approx(2 * clean.iteration_seconds).epsilon(0.02));
  }
  // A quarter of every inter-node link taken by another job: 4/3 as long.
  const Report bg = simulate_program(sc, p, with({"background-traffic 0.25"}));
  CHECK(bg.iteration_seconds == Approx(clean.iteration_seconds / 0.75).epsilon(0.02));
}

TEST_CASE("a what-if on a link no flow crosses changes nothing", "[what-if]") {
  // 2 nodes x 2 GPUs, 2 NICs each; only ranks 0 and 2 (rail 0) communicate.
  const Scenario sc = cluster_scenario(2, 2, 2, 25e9);
  const Program p = allreduce_program(4, {0, 2}, 1e9);
  const Report clean = simulate_program(sc, p);
  const Report unused = simulate_program(sc, p, with({"link nic-0-1 x0.1", "nic 1.1 x0.01"}));
  CHECK(unused.iteration_seconds == Approx(clean.iteration_seconds).epsilon(1e-12));
  const Report used = simulate_program(sc, p, with({"link nic-0-0 x0.5"}));
  CHECK(used.iteration_seconds > 1.9 * clean.iteration_seconds);
}

TEST_CASE("a NIC that is down: its GPUs' traffic goes through the node's next NIC, or a clear error", "[what-if]") {
  // 2 nodes x 2 GPUs, 2 NICs each; ranks 0-2 (rail 0) and 1-3 (rail 1) all-reduce at once.
  const Scenario sc = cluster_scenario(2, 2, 2, 25e9);
  Program p = allreduce_program(4, {0, 2}, 1e9);
  p.groups.push_back({GroupKind::DP, {1, 3}});
  for (int r : {1, 3}) {
    Instruction in = p.ranks[0].instructions[0];
    in.group = 1;
    p.ranks[r].add(in);
  }
  const Report clean = simulate_program(sc, p);
  // nic-0-0 down: rank 0 sends and receives through nic-0-1, which rank 1's ring uses too.
  for (const char* spec : {"nic 0.0 down", "link nic-0-0 down"}) {
    INFO(spec);
    const Report down = simulate_program(sc, p, with({spec}));
    CHECK(down.iteration_seconds == Approx(2 * clean.iteration_seconds).epsilon(0.02));
    bool seen_rerouted = false;
    for (const auto& l : down.extras.at("sim").at("links").at("busiest"))
      if (l.at("name") == "nic-0-0_UP") CHECK(l.at("bytes").get<double>() == 0);
      else if (l.at("name") == "nic-0-1_UP") seen_rerouted = true;
    CHECK(seen_rerouted);
  }
  CHECK_THROWS_WITH(simulate_program(sc, p, with({"link leafup-0-0 down"})), Catch::Contains("cannot be rerouted"));
  CHECK_THROWS_WITH(simulate_program(sc, p, with({"nic 0.0 down", "nic 0.1 down"})),
                    Catch::Contains("every NIC of node 0 is down"));
  const Scenario one_nic = cluster_scenario(2, 2, 1, 25e9);
  CHECK_THROWS_WITH(simulate_program(one_nic, p, with({"nic 1.0 down"})), Catch::Contains("every NIC of node 1 is down"));
}
