// Every shortcut the simulator takes, against the full model on scenarios small enough for both.
#include <catch2/catch.hpp>
#include "backends/sim/sim_backend.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

namespace {
Scenario scenario(int tp, int pp, int dp, int gpn, int nics, double oversub, int zero = 1) {
  const std::string yaml =
      "name: shortcut\n"
      "model: {preset: gpt-350m, layers: 8}\n"
      "training: {global_batch: " + std::to_string(8 * dp) + ", micro_batch: 1}\n"
      "parallel: {tp: " + std::to_string(tp) + ", pp: " + std::to_string(pp) + ", dp: " + std::to_string(dp) + "}\n"
      "zero: {stage: " + std::to_string(zero) + "}\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: " + std::to_string(gpn) + ", nics_per_node: " +
      std::to_string(nics) + ", nodes: " + std::to_string(tp * pp * dp / gpn) + ", oversubscription: " +
      std::to_string(oversub) + "}\n";
  Scenario sc = load_scenario_from_string(yaml, {}, "shortcut");
  return sc;
}

double full_model(const Scenario& sc, SimOptions o = {}) {
  o.symmetry = false;
  o.nvswitch_closed_form = false;
  const Program full = build_program(sc, {});
  return simulate_program(sc, full, o).iteration_seconds;
}
}  // namespace

TEST_CASE("shortcut: NVSwitch collectives in closed form equal flows over the NVSwitch") {
  // One node, TP 8: every TP all-reduce alone on the switch.
  Scenario sc = scenario(8, 1, 1, 8, 8, 1);
  const Program p = build_program(sc, {});
  SimOptions closed, flows;
  closed.symmetry = flows.symmetry = false;
  flows.nvswitch_closed_form = false;
  const Report a = simulate_program(sc, p, closed);
  const Report b = simulate_program(sc, p, flows);
  CHECK(a.iteration_seconds == Approx(b.iteration_seconds).epsilon(1e-6));
  CHECK(a.extras["sim"]["simulation"]["flows"].get<uint64_t>() < b.extras["sim"]["simulation"]["flows"].get<uint64_t>());
}

TEST_CASE("shortcut: folding TP peers equals simulating every rank") {
  // TP 2 inside 4-GPU nodes; with 2 NICs per node the two TP peers share a NIC (scaled link), with
  // 4 they have their own; oversubscribed and not.
  for (int nics : {2, 4})
    for (double over : {1.0, 4.0}) {
      Scenario sc = scenario(2, 2, 4, 4, nics, over);
      sc.cluster.nodes = 4;
      const Program full = build_program(sc, {});
      SimOptions fold, nofold;
      nofold.symmetry = false;
      const SimRun a = simulate_program_run(sc, full, fold);
      const SimRun b = simulate_program_run(sc, full, nofold);
      INFO("nics " << nics << ", oversubscription " << over);
      CHECK(a.report.extras["sim"]["simulation"]["folded_tensor_parallel"] == true);
      CHECK(a.ranks.size() * 2 == b.ranks.size());
      CHECK(a.report.iteration_seconds == Approx(b.report.iteration_seconds).epsilon(1e-9));
    }
}

TEST_CASE("shortcut: stage representatives expanded equal the fully built Program") {
  for (int zero : {0, 1}) {
    Scenario sc = scenario(2, 2, 4, 4, 4, 2.0, zero);
    SimOptions o;  // symmetry: representative Program, expanded, TP folded
    const SimRun rep = simulate_run(sc, o);
    CHECK(rep.report.extras["sim"]["simulation"]["expanded_stage_representatives"] == true);
    INFO("zero " << zero);
    CHECK(rep.report.iteration_seconds == Approx(full_model(sc)).epsilon(1e-6));
  }
}

TEST_CASE("shortcut: phase-level collectives equal step-level ones on a whole scenario") {
  Scenario sc = scenario(2, 2, 4, 2, 2, 1.0);
  SimOptions step;
  step.detail = SimOptions::CollectiveDetail::Step;
  const double a = simulate(sc).iteration_seconds;
  const double b = simulate(sc, step).iteration_seconds;
  CHECK(a == Approx(b).epsilon(0.02));
}

TEST_CASE("shortcut: stage representatives expand to MoE replicas of other experts") {
  // dp 8, ep 2: expert-data-parallel groups {0,2,4,6} and {1,3,5,7}; the representative (rank 0)
  // must be replicated onto rank 1, which holds the other experts and sits at position 0 of a
  // different expert-dp group.
  const std::string yaml =
      "name: moe_shortcut\n"
      "model: {preset: gpt-350m, layers: 4, experts: 8, top_k: 2, moe_every: 2}\n"
      "training: {global_batch: 16, micro_batch: 1}\n"
      "parallel: {tp: 1, pp: 2, dp: 8, ep: 2}\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 2}\n";
  const Scenario sc = load_scenario_from_string(yaml, {}, "moe_shortcut");
  const SimRun rep = simulate_run(sc, {});
  CHECK(rep.report.extras["sim"]["simulation"]["expanded_stage_representatives"] == true);
  CHECK(rep.report.iteration_seconds == Approx(full_model(sc)).epsilon(1e-6));
}
