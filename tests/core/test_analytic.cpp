// The analytic estimator on real Programs: closed forms it must reproduce, and the report it feeds.
#include <catch2/catch.hpp>

#include "core/estimator.hpp"
#include "core/fit_advisor.hpp"
#include "core/memory.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;

namespace {

Scenario pipeline_scenario(int pp, int micro_batches) { return test::tiny_pipeline(pp, micro_batches); }

// Unit costs: forward 1, backward 2 on every stage, communication free.
std::vector<std::vector<double>> unit_costs(const Program& p) {
  std::vector<std::vector<double>> s(p.ranks.size());
  for (size_t r = 0; r < p.ranks.size(); ++r)
    for (const Instruction& in : p.ranks[r].instructions)
      s[r].push_back(in.op == Op::Forward ? 1.0 : in.op == Op::Backward ? 2.0 : 0.0);
  return s;
}

}  // namespace

TEST_CASE("1F1B bubble is (p-1)/(m+p-1) of the iteration when communication is free", "[analytic]") {
  for (auto [pp, m] : std::vector<std::pair<int, int>>{{2, 4}, {3, 4}, {4, 8}, {8, 96}, {4, 4}}) {
    const Scenario sc = pipeline_scenario(pp, m);
    const Program p = build_program(sc, {});
    const Timeline tl = evaluate_program(p, unit_costs(p));
    INFO("pp " << pp << " m " << m);
    CHECK(tl.makespan == Approx(3.0 * (m + pp - 1)));
    const TimeBreakdown t0 = attribute_time(p, tl, 0);
    CHECK(t0.bubble / tl.makespan == Approx(double(pp - 1) / (m + pp - 1)));
    CHECK(t0.total() == Approx(tl.makespan));
    // the representative-rank Program gives the same critical path
    BuildOptions rep;
    rep.representative_only = true;
    const Program pr = build_program(sc, rep);
    CHECK(evaluate_program(pr, unit_costs(pr)).makespan == Approx(tl.makespan));
  }
}

TEST_CASE("representative ranks give the same estimate as the full Program", "[analytic]") {
  for (const char* name : {"tiny/tiny_dp2", "tiny/tiny_tp2", "tiny/tiny_pp3", "tiny/tiny_zero3_dp2", "tiny/tiny_moe"}) {
    const Scenario sc = load_scenario(name);
    BuildOptions rep;
    rep.representative_only = true;
    const Program full = build_program(sc, {});
    const Program one = build_program(sc, rep);
    INFO(name);
    CHECK(one.ranks.size() == size_t(sc.parallel.pp));
    CHECK(estimate(sc, one).makespan == Approx(estimate(sc, full).makespan).epsilon(1e-12));
  }
}

TEST_CASE("analytic report of GPT-3 175B: consistent figures", "[analytic]") {
  const Scenario sc = load_scenario("gpt175b");
  const Report r = analytic_report(sc);
  CHECK(r.parameters == Approx(174.6e9).epsilon(0.001));
  CHECK(r.iteration_seconds > 0);
  CHECK(r.time.total() == Approx(r.iteration_seconds));
  // tokens/s and FLOP/s follow from the iteration time
  CHECK(r.tokens_per_second == Approx(1536.0 * 2048 / r.iteration_seconds));
  CHECK(r.model_tflops_per_gpu * 1e12 * 1024 * r.iteration_seconds == Approx(r.model_flops_per_iteration));
  CHECK(r.mfu == Approx(r.model_tflops_per_gpu / 312.0));
  // full recompute: one more forward, so hardware FLOPs are 4/3 of model FLOPs (to first order)
  CHECK(r.hardware_flops_per_iteration / r.model_flops_per_iteration == Approx(4.0 / 3).epsilon(0.02));
  // the bubble of 8 stages over 96 micro-batches is at least the 1F1B closed form
  CHECK(r.time.bubble / r.iteration_seconds >= 7.0 / 103 * 0.95);
  CHECK(r.fits);
  CHECK(r.time_to_train_seconds == Approx(300e9 / r.tokens_per_second));
  const nlohmann::json j = report_json(sc, r);
  CHECK(j["throughput"]["iteration_seconds"].get<double>() == r.iteration_seconds);
  CHECK(j["config"]["pp"].get<int>() == 8);
}

TEST_CASE("a scenario that does not fit gets changes that make it fit", "[analytic][fit]") {
  Scenario sc = load_scenario("gpt175b");
  sc.zero.stage = 0;
  sc.recompute = Recompute::none;
  sc.training.micro_batch = 4;
  sc.training.grad_accum = 24;
  const Report r = analytic_report(sc);
  REQUIRE_FALSE(r.fits);
  REQUIRE_FALSE(r.suggestions.empty());
  CHECK(r.suggestions.front().fits);
  bool saw_recompute = false, saw_microbatch = false, saw_zero3 = false;
  for (const auto& s : r.suggestions) {
    CHECK(s.iteration_seconds > 0);
    CHECK(s.peak_bytes > 0);
    if (s.change.find("activation_checkpointing") != std::string::npos) saw_recompute = true;
    if (s.change.find("micro_batch") != std::string::npos) saw_microbatch = true;
    if (s.change.find("zero.stage=3") != std::string::npos) saw_zero3 = true;
    // every suggestion is re-estimated, not guessed: its peak is the memory model's
  }
  CHECK(saw_recompute);
  CHECK(saw_microbatch);
  CHECK_FALSE(saw_zero3);  // DeepSpeed refuses ZeRO-3 with pp > 1: never suggested
  // the suggestions' peaks are the memory model's for the changed scenario
  for (const auto& c : fit_candidates(sc)) {
    if (c.change == "activation_checkpointing=full") {
      CHECK(peak_memory(c.scenario).total() < peak_memory(sc).total());
    }
  }
}

TEST_CASE("offload: the work after the compute stream's end is split by instruction (host step = optimizer)",
          "[analytic]") {
  Scenario sc = load_scenario("tiny/tiny_pp3");
  sc.parallel.pp = 1;
  sc.cluster.gpus_per_node = 1;
  sc.cluster.nodes = 1;
  sc.zero.stage = 3;
  sc.zero.offload_optimizer = true;
  const Program p = build_program(sc, {});
  // Forward 1, backward 2, each gradient copy 0.5, the host step 10, the copy back 3.
  std::vector<std::vector<double>> cost(1);
  for (const Instruction& in : p.ranks[0].instructions)
    cost[0].push_back(in.op == Op::Forward ? 1.0 : in.op == Op::Backward ? 2.0 : in.op == Op::CopyD2H ? 0.5
                      : in.op == Op::HostOptimizerStep ? 10.0 : in.op == Op::CopyH2D ? 3.0 : 0.0);
  const Timeline tl = evaluate_program(p, cost);
  const TimeBreakdown t = attribute_time(p, tl, 0);
  CHECK(t.optimizer == Approx(10.0));  // not charged to the copy that ends the iteration
  // The copy back, and the last gradient copy, which the host step waits for after the backward.
  CHECK(t.exposed_offload == Approx(3.0 + 0.5));
  CHECK(t.total() == Approx(tl.makespan));
}
