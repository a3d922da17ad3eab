// What the scaling work (issue 20) changed must give the same answers as before:
//  - the backend's per-rank bookkeeping (bubble, communication overlap) after the simulation,
//    computed once per simulated rank: the same folded and unfolded, and what attribute_time gives
//    for each rank's own timeline;
//  - the two-level fabric as one zone computing its routes (simulator/rail_fabric.hpp): the same
//    times, bit for bit, as the star-zone hierarchy that three-level trees still use, on a
//    three-level tree with a single pod (whose routes are the two-level ones).
#include <algorithm>
#include <catch2/catch.hpp>
#include "backends/sim/sim_backend.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"
#include "core/timeline.hpp"

using namespace dssim;

namespace {
Scenario small_cluster(int levels = 2) {
  // TP 2 inside 4-GPU nodes, PP 2, DP 4 over 4 nodes with a NIC per GPU, oversubscribed leaves.
  const std::string yaml =
      "name: bookkeeping\n"
      "model: {preset: gpt-350m, layers: 8}\n"
      "training: {global_batch: 32, micro_batch: 1}\n"
      "parallel: {tp: 2, pp: 2, dp: 4}\n"
      "zero: {stage: 1}\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: 4, nics_per_node: 4, nodes: 4, oversubscription: 2, "
      "fat_tree_levels: " + std::to_string(levels) + "}\n";
  return load_scenario_from_string(yaml, {}, "bookkeeping");
}
}  // namespace

TEST_CASE("bookkeeping: per-rank bubble and communication are the same folded and unfolded, and each rank's own") {
  const Scenario sc = small_cluster();
  const Program full = build_program(sc, {});
  SimOptions fold, nofold;
  nofold.symmetry = false;
  const SimRun a = simulate_program_run(sc, full, fold);
  const SimRun b = simulate_program_run(sc, full, nofold);
  REQUIRE(a.report.extras["sim"]["simulation"]["folded_tensor_parallel"] == true);
  REQUIRE(a.ranks.size() * 2 == b.ranks.size());
  const auto& sa = a.report.extras["sim"];
  const auto& sb = b.report.extras["sim"];
  for (const char* k : {"mean_seconds", "max_seconds", "critical_rank_seconds"})
    CHECK(sa["bubble"][k].get<double>() == Approx(sb["bubble"][k].get<double>()).epsilon(1e-9));
  for (auto& [kind, v] : sb["communication"].items()) {
    INFO("kind " << kind);
    REQUIRE(sa["communication"].contains(kind));
    for (const char* k : {"seconds", "overlapped_seconds", "exposed_seconds"})
      CHECK(sa["communication"][kind]["mean_per_rank"][k].get<double>() ==
            Approx(v["mean_per_rank"][k].get<double>()).epsilon(1e-9));
  }
  // Each simulated rank's bubble is attribute_time over a timeline holding that rank alone.
  double bmax = 0, bmean = 0;
  for (size_t k = 0; k < b.ranks.size(); ++k) {
    Timeline one;
    one.makespan = b.timeline.makespan;
    one.spans.resize(full.ranks.size());
    one.spans[b.templates[k]] = b.timeline.spans[k];
    const double bubble = attribute_time(full, one, b.templates[k]).bubble;
    bmax = std::max(bmax, bubble);
    bmean += bubble / double(b.ranks.size());
  }
  CHECK(sb["bubble"]["max_seconds"].get<double>() == bmax);
  CHECK(sb["bubble"]["mean_seconds"].get<double>() == bmean);
}

TEST_CASE("rail fabric zone: the same times and link bytes as the star-zone hierarchy", "[links]") {
  // Two nodes per leaf: 2 leaf groups x 4 rails, oversubscribed uplinks that the DP rings cross.
  SimOptions o;
  o.symmetry = false;
  o.nodes_per_leaf = 2;
  o.leaves_per_pod = 16;  // three levels, one pod: the same routes as two levels
  const SimRun two = simulate_run(small_cluster(2), o);
  const SimRun three = simulate_run(small_cluster(3), o);
  CHECK(two.report.iteration_seconds == three.report.iteration_seconds);
  REQUIRE(two.timeline.spans.size() == three.timeline.spans.size());
  size_t differ = 0;
  for (size_t k = 0; k < two.timeline.spans.size(); ++k) {
    REQUIRE(two.timeline.spans[k].size() == three.timeline.spans[k].size());
    for (size_t i = 0; i < two.timeline.spans[k].size(); ++i)
      differ += two.timeline.spans[k][i].start != three.timeline.spans[k][i].start ||
                two.timeline.spans[k][i].end != three.timeline.spans[k][i].end;
  }
  CHECK(differ == 0);
  const auto& a = two.report.extras["sim"]["links"]["busiest"];
  const auto& b = three.report.extras["sim"]["links"]["busiest"];
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  for (size_t k = 0; k < a.size(); ++k) {
    CHECK(a[k]["name"] == b[k]["name"]);
    CHECK(a[k]["bytes"].get<double>() == b[k]["bytes"].get<double>());
  }
  bool leafup = false;
  for (const auto& l : a) leafup = leafup || l["name"].get<std::string>().rfind("leafup", 0) == 0;
  CHECK(leafup);  // the uplinks carry traffic: the cross-leaf routes are exercised
}
