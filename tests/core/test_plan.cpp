// The planner (core/plan.hpp): the fast path against the whole-iteration Program, pruning,
// determinism, the infeasible case, Megatron-LM's Table 1 (SC'21), and the emitted ds_config.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include "core/deepspeed_config.hpp"
#include "core/memory.hpp"
#include "core/model.hpp"
#include "core/plan.hpp"
#include "core/scenario_loader.hpp"
#include "core/validate.hpp"

using namespace dssim;

namespace {

// One search shared by the cases that only read it: GPT-3 175B, batch 1536, 1024 GPUs, all dimensions.
const PlanResult& gpt175b_plan() {
  static const PlanResult r = plan(load_scenario("gpt175b"), PlanOptions{});
  return r;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

// Compares the fast path with the whole-iteration Program on up to `want` ranked configurations
// the fast path extrapolates, spread over the ranking: the candidates (grad_accum past the three
// points) are visited with stride k = candidates / want, then from offsets 1, 2, ... (a
// configuration whose points are not steady is scored whole and skipped).
void check_fast_against_exact(const Scenario& base, const PlanResult& r, size_t want, size_t& sampled) {
  std::vector<size_t> candidates;
  for (size_t i = 0; i < r.ranked.size(); ++i)
    if (extrapolation_points(apply_point(base, r.ranked[i].point))[0] != 0) candidates.push_back(i);
  const size_t stride = std::max<size_t>(1, candidates.size() / std::max<size_t>(1, want));
  const size_t before = sampled;
  for (size_t offset = 0; offset < stride && sampled - before < want; ++offset)
    for (size_t c = offset; c < candidates.size() && sampled - before < want; c += stride) {
      const PlanEntry& e = r.ranked[candidates[c]];
      const Scenario s = apply_point(base, e.point);
      const PlanScore fast = score_scenario(s, false);
      if (!fast.extrapolated) continue;  // not steady at its three points: scored whole
      const PlanScore exact = score_scenario(s, true);
      INFO(e.point.label() << " grad_accum " << s.training.grad_accum);
      CHECK(fast.iteration_seconds == e.iteration_seconds);
      CHECK(rel(fast.iteration_seconds, exact.iteration_seconds) <= 0.005);
      // every part of the breakdown within 0.5 % of the iteration
      const TimeBreakdown &f = fast.time, &x = exact.time;
      const double T = exact.iteration_seconds;
      for (auto [a, b] : std::vector<std::pair<double, double>>{
               {f.forward, x.forward}, {f.backward, x.backward}, {f.recompute, x.recompute}, {f.optimizer, x.optimizer},
               {f.exposed_tp, x.exposed_tp}, {f.exposed_pp, x.exposed_pp}, {f.exposed_dp, x.exposed_dp},
               {f.exposed_ep, x.exposed_ep}, {f.exposed_offload, x.exposed_offload}, {f.bubble + f.idle, x.bubble + x.idle}})
        CHECK(std::abs(a - b) <= 0.005 * T);
      // memory is the closed form of the real scenario: identical
      CHECK(peak_memory(s).total() == e.memory.total());
      ++sampled;
    }
}

Scenario megatron_row(const YAML::Node& doc, const YAML::Node& row) {
  YAML::Emitter base;
  base << doc["scenario"];
  LoadOptions lo;
  lo.overrides = row["set"].as<std::vector<std::string>>();
  return load_scenario_from_string(base.c_str(), lo, "megatron_sc21_table1 row " + row["label"].as<std::string>());
}

}  // namespace

TEST_CASE("plan: the fast path matches the whole-iteration Program within 0.5% (>= 200 sampled configurations)",
          "[plan]") {
  // The sample: of the ranked configurations the fast path extrapolates, spread over the ranking,
  // 250 of GPT-3 175B on 1024 GPUs (all dimensions: TP, PP, micro-batch, ZeRO 0-3, recompute, SP,
  // offload; interleaved ones are always scored whole), 100 of GPT 13B on its 64 GPUs (40 layers:
  // uneven pipelines, whose transients are the hard case) and 30 of the MoE scenario (EP) on its
  // 64 GPUs.
  const PlanResult& r = gpt175b_plan();
  size_t sampled = 0;
  check_fast_against_exact(load_scenario("gpt175b"), r, 250, sampled);
  const size_t dense = sampled;
  const Scenario gpt13b = load_scenario("gpt13b_zero2");
  check_fast_against_exact(gpt13b, plan(gpt13b, PlanOptions{}), 100, sampled);
  const size_t uneven = sampled - dense;
  const Scenario moe = load_scenario("moe");
  PlanOptions o;
  o.vary = {PlanDim::tp, PlanDim::pp, PlanDim::micro_batch, PlanDim::zero, PlanDim::ep, PlanDim::interleave};
  const PlanResult rm = plan(moe, o);
  REQUIRE(!rm.ranked.empty());
  check_fast_against_exact(moe, rm, 30, sampled);
  INFO("GPT-3 175B " << dense << ", GPT 13B " << uneven << ", MoE " << sampled - dense - uneven);
  CHECK(dense >= 200);
  CHECK(uneven >= 100);
  CHECK(sampled - dense - uneven >= 20);
}

namespace {

// The collapsed Programs (BuildOptions::collapse_chains, what plan scores with) against the
// uncollapsed whole iteration on every `stride`-th ranked configuration: iteration time within
// 1e-9 relative, every part of the breakdown within 1e-9 of the iteration, memory the same.
// Returns the configurations compared and the largest relative difference seen.
std::pair<size_t, double> check_collapsed_against_whole(const Scenario& base, const PlanResult& r, size_t stride,
                                                        std::set<std::string>* covered = nullptr) {
  size_t n = 0;
  double worst = 0;
  for (size_t i = 0; i < r.ranked.size(); i += stride) {
    const PlanEntry& e = r.ranked[i];
    const Scenario s = apply_point(base, e.point);
    const PlanScore whole = score_scenario(s, /*exact=*/true, /*collapse=*/false);
    const PlanScore collapsed = score_scenario(s, /*exact=*/true, /*collapse=*/true);
    const PlanScore fast = score_scenario(s, /*exact=*/false, /*collapse=*/true);
    INFO(e.point.label() << " grad_accum " << s.training.grad_accum);
    const double T = whole.iteration_seconds;
    REQUIRE(T > 0);
    worst = std::max({worst, rel(collapsed.iteration_seconds, T), fast.extrapolated ? 0.0 : rel(fast.iteration_seconds, T)});
    CHECK(rel(collapsed.iteration_seconds, T) <= 1e-9);
    CHECK(fast.iteration_seconds == e.iteration_seconds);  // what the plan ranked by
    if (!fast.extrapolated) CHECK(rel(fast.iteration_seconds, T) <= 1e-9);
    const TimeBreakdown &c = collapsed.time, &w = whole.time;
    for (auto [a, b] : std::vector<std::pair<double, double>>{
             {c.forward, w.forward}, {c.backward, w.backward}, {c.recompute, w.recompute}, {c.optimizer, w.optimizer},
             {c.exposed_tp, w.exposed_tp}, {c.exposed_pp, w.exposed_pp}, {c.exposed_dp, w.exposed_dp},
             {c.exposed_ep, w.exposed_ep}, {c.exposed_offload, w.exposed_offload}, {c.bubble, w.bubble}, {c.idle, w.idle}})
      CHECK(std::abs(a - b) <= 1e-9 * T);
    CHECK(peak_memory(s).total() == e.memory.total());
    if (covered) {
      const PlanPoint& p = e.point;
      covered->insert("pp" + std::to_string(p.pp));
      covered->insert("z" + std::to_string(p.zero));
      covered->insert("rc" + std::to_string(static_cast<int>(p.recompute)));
      covered->insert("off" + std::to_string(static_cast<int>(p.offload)));
      if (p.sequence_parallel) covered->insert("sp");
      if (p.interleave >= 3) covered->insert("v>=3");
    }
    ++n;
  }
  return {n, worst};
}

}  // namespace

TEST_CASE("plan: collapsed chains give the uncollapsed Program's iteration time, breakdown and memory", "[plan]") {
  // Every 12th ranked GPT-3 175B configuration (241 of 2891: pp 1 to 64, interleaving, ZeRO 0-3,
  // every recompute mode, SP, both offloads), every 40th of GPT 13B's (uneven pipelines) and every
  // 20th of the MoE scenario's (EP).
  const PlanResult& r = gpt175b_plan();
  std::set<std::string> covered;
  const auto [n175, worst175] = check_collapsed_against_whole(load_scenario("gpt175b"), r, 12, &covered);
  INFO("covered: " << [&] { std::string c; for (auto& k : covered) c += k + " "; return c; }());
  CHECK(n175 >= 200);
  for (const char* k : {"pp1", "pp2", "pp4", "pp8", "pp16", "pp32", "pp64", "z0", "z1", "z2", "z3", "rc0", "rc1", "rc2",
                        "off0", "off1", "off2", "sp", "v>=3"})
    CHECK(covered.count(k) == 1);
  const Scenario gpt13b = load_scenario("gpt13b_zero2");
  const auto [n13, worst13] = check_collapsed_against_whole(gpt13b, plan(gpt13b, PlanOptions{}), 40);
  CHECK(n13 >= 50);
  const Scenario moe = load_scenario("moe");
  PlanOptions o;
  o.vary = {PlanDim::tp, PlanDim::pp, PlanDim::micro_batch, PlanDim::zero, PlanDim::ep, PlanDim::interleave};
  const auto [nmoe, worstmoe] = check_collapsed_against_whole(moe, plan(moe, o), 20);
  CHECK(nmoe >= 20);
  WARN("collapsed vs whole: GPT-3 175B " << n175 << " (max rel " << worst175 << "), GPT 13B " << n13 << " (" << worst13
                                         << "), MoE " << nmoe << " (" << worstmoe << ")");
}

TEST_CASE("plan: a pipeline whose slowest stage takes over late is not extrapolated early", "[plan]") {
  // GPT 13B (40 layers) on 32 stages, the first 8 with two layers: T(m) grows by 38.6 ms per
  // micro-batch until m ~ 100, then by 41.7 ms (the two-layer stages' line takes over). Three points
  // at 32, 64, 96 lay on the first line and extended it about 4 % short of the whole iteration; the
  // two-layer stages' compute stream, busier per micro-batch than the line grows, now says so.
  const Scenario base = load_scenario("gpt13b_zero2");
  PlanPoint p = point_of(base);
  p.tp = 1, p.pp = 32, p.dp = 2, p.micro_batch = 1, p.zero = 1, p.interleave = 1, p.recompute = Recompute::none;
  p.sequence_parallel = false, p.offload = Offload::none;
  const Scenario s = apply_point(base, p);
  REQUIRE(s.training.grad_accum > 100);
  REQUIRE(extrapolation_points(s)[0] != 0);
  const PlanScore fast = score_scenario(s, false), exact = score_scenario(s, true);
  CHECK(!fast.extrapolated);
  CHECK(fast.iteration_seconds == exact.iteration_seconds);
}

TEST_CASE("plan: every ranked configuration passes validate and fits and the counts add up", "[plan]") {
  const PlanResult& r = gpt175b_plan();
  const Scenario base = load_scenario("gpt175b");
  REQUIRE(r.ranked.size() > 100);
  CHECK(r.enumerated == r.invalid + r.too_big + r.ranked.size());
  std::set<std::string> keys;
  for (const PlanEntry& e : r.ranked) {
    const Scenario s = apply_point(base, e.point);
    INFO(e.point.label());
    CHECK_NOTHROW(validate(s));
    CHECK(e.memory.total() <= s.cluster.gpu.memory_bytes);
    CHECK(e.point.tp * e.point.pp * e.point.dp == 1024);
    CHECK(s.training.global_batch == 1536);
    keys.insert(e.point.key());
  }
  CHECK(keys.size() == r.ranked.size());  // no configuration twice
  // ranked best first, ties broken on the key
  for (size_t i = 1; i < r.ranked.size(); ++i) {
    const PlanEntry &a = r.ranked[i - 1], &b = r.ranked[i];
    CHECK((a.objective < b.objective || (a.objective == b.objective && a.point.key() < b.point.key())));
  }
  // the scenario's own configuration is in the space and ranked
  REQUIRE(r.base_rank);
  CHECK(r.ranked[*r.base_rank].point.key() == point_of(base).key());
  CHECK(r.ranked[0].tokens_per_second >= r.ranked[*r.base_rank].tokens_per_second);
}

TEST_CASE("plan: deterministic", "[plan]") {
  const Scenario sc = load_scenario("gpt13b_zero2");
  PlanOptions o;
  const PlanResult a = plan(sc, o), b = plan(sc, o);
  REQUIRE(!a.ranked.empty());
  REQUIRE(a.ranked.size() == b.ranked.size());
  CHECK(a.enumerated == b.enumerated);
  for (size_t i = 0; i < a.ranked.size(); ++i) {
    CHECK(a.ranked[i].point.key() == b.ranked[i].point.key());
    CHECK(a.ranked[i].iteration_seconds == b.ranked[i].iteration_seconds);
  }
}

TEST_CASE("plan: --fix and --vary restrict the space", "[plan]") {
  const Scenario sc = load_scenario("gpt13b_zero2");
  PlanOptions o;
  o.fixes = {parse_plan_fix("parallel.tp", "2"), parse_plan_fix("activation_checkpointing", "full")};
  const PlanResult r = plan(sc, o);
  REQUIRE(!r.ranked.empty());
  for (const PlanEntry& e : r.ranked) {
    CHECK(e.point.tp == 2);
    CHECK(e.point.recompute == Recompute::full);
  }
  PlanOptions v;
  v.vary = {PlanDim::micro_batch};
  const PlanResult rv = plan(sc, v);
  REQUIRE(!rv.ranked.empty());
  for (const PlanEntry& e : rv.ranked) {
    CHECK(e.point.tp == sc.parallel.tp);
    CHECK(e.point.pp == sc.parallel.pp);
    CHECK(e.point.zero == sc.zero.stage);
  }
  CHECK(rv.enumerated == rv.ranked.size() + rv.invalid + rv.too_big);
  CHECK_THROWS_WITH(parse_plan_fix("parallel.tp", "eight"), Catch::Contains("--fix parallel.tp=eight") && Catch::Contains("integer"));
  CHECK_THROWS_WITH(parse_plan_fix("zero.stage", "4"), Catch::Contains("0, 1, 2 or 3"));
  CHECK_THROWS_WITH(parse_plan_fix("activation_checkpointing", "some"), Catch::Contains("none, selective or full"));
  CHECK(!is_plan_key("precision.dtype"));
}

TEST_CASE("plan: nothing fits GPT-3 175B on 8 GPUs and the smallest GPU count that fits is named", "[plan]") {
  const Scenario sc = load_scenario("gpt175b");
  PlanOptions o;
  o.gpus = 8;
  const PlanResult r = plan(sc, o);
  CHECK(r.ranked.empty());
  CHECK(r.enumerated > 0);
  REQUIRE(r.smallest_point);
  CHECK(r.smallest_memory.total() > 0);
  const auto hint = smallest_fitting_gpus(sc, o);
  REQUIRE(hint);
  CHECK(hint->gpus > 8);
  CHECK(hint->gpus % 8 == 0);
  // it does fit there, and nothing fits at half of it
  PlanOptions at = o;
  at.gpus = hint->gpus;
  CHECK(!plan(sc, at).ranked.empty());
  if (hint->gpus / 2 > 8) {
    at.gpus = hint->gpus / 2;
    CHECK(plan(sc, at).ranked.empty());
  }
}

TEST_CASE("plan: Megatron-LM SC'21 Table 1 — the plan at the paper's GPUs and batch is at least as fast as the published configuration",
          "[plan][megatron]") {
  // Megatron-LM's own knobs (TP, PP, micro-batch, interleave, and its 2022 recompute / sequence
  // parallelism) are searched with the paper's batch, GPU count, fp16 and no ZeRO. The published layout must be found and ranked, and
  // the best must reach at least the paper's measured throughput (hardware TFLOP/s per GPU with
  // eq. 3's FLOPs) and at least the published layout's predicted one.
  const YAML::Node doc = YAML::LoadFile(data_root() + "/validation/published/megatron_sc21_table1.yaml");
  PlanOptions o;
  o.vary = {PlanDim::tp, PlanDim::pp, PlanDim::micro_batch, PlanDim::interleave, PlanDim::recompute,
            PlanDim::sequence_parallel};
  int rows = 0;
  for (const YAML::Node& row : doc["rows"]) {
    const Scenario sc = megatron_row(doc, row);
    const PlanResult r = plan(sc, o);
    const std::string label = row["label"].as<std::string>();
    INFO(label << ": " << r.ranked.size() << " ranked");
    REQUIRE(!r.ranked.empty());
    REQUIRE(r.base_rank);
    const PlanEntry& published = r.ranked[*r.base_rank];
    const double gpus = sc.cluster.world();
    const double published_tokens = row["published"].as<double>() * 1e12 * gpus /
                                    hardware_flops_per_iteration(sc.model, sc.training.global_batch, sc.recompute) *
                                    sc.training.global_batch * sc.model.seq_len;
    INFO("best " << r.ranked[0].point.label() << " " << r.ranked[0].tokens_per_second << " tokens/s; published layout "
                 << published.point.label() << " ranks " << *r.base_rank + 1 << " at " << published.tokens_per_second
                 << " tokens/s predicted, " << published_tokens << " measured");
    CHECK(r.ranked[0].tokens_per_second >= published.tokens_per_second);
    CHECK(r.ranked[0].tokens_per_second >= published_tokens);
    ++rows;
  }
  CHECK(rows == 10);
}

TEST_CASE("plan: the emitted ds_config loads back to the same training setup", "[plan]") {
  const PlanResult& r = gpt175b_plan();
  const Scenario base = load_scenario("gpt175b");
  for (size_t i : {size_t(0), size_t(3), r.ranked.size() / 2}) {
    const Scenario best = apply_point(base, r.ranked[i].point);
    const std::string yaml_path = "/tmp/dssim_plan_test_" + std::to_string(::getpid()) + "_" + std::to_string(i) + ".yaml";
    const std::string ds_path = "/tmp/dssim_plan_test_" + std::to_string(::getpid()) + "_" + std::to_string(i) + ".json";
    std::ofstream(yaml_path) << to_yaml(best);
    std::ofstream(ds_path) << to_deepspeed_config(best).dump(2);
    LoadOptions lo;
    lo.deepspeed_config = ds_path;
    const Scenario back = load_scenario(yaml_path, lo);
    INFO(r.ranked[i].point.label());
    CHECK(point_of(back).key() == r.ranked[i].point.key());
    CHECK(back.precision.dtype == best.precision.dtype);
    CHECK(back.training.gradient_clipping == best.training.gradient_clipping);
    CHECK(back.optimizer.kind == best.optimizer.kind);
    CHECK(back.parallel.pipeline_engine == best.parallel.pipeline_engine);
    std::remove(yaml_path.c_str());
    std::remove(ds_path.c_str());
  }
}

TEST_CASE("plan: the why sentence names each side and leads with the largest difference", "[plan]") {
  PlanEntry w, o;
  w.point.tp = 4, w.point.pp = 1, w.point.dp = 256, w.point.zero = 3;
  o.point.tp = 8, o.point.pp = 8, o.point.dp = 16, o.point.zero = 1;
  REQUIRE(w.point.family() == "TP+DP ZeRO-3");
  REQUIRE(o.point.family() == "TP+PP+DP");
  w.time.forward = 4.506, w.time.backward = 10.0, w.time.bubble = 0.002, w.time.exposed_dp = 0.3;
  o.time.forward = 5.131, o.time.backward = 10.0, o.time.bubble = 0.515, o.time.exposed_dp = 0.1;
  w.iteration_seconds = 14.808;
  o.iteration_seconds = 15.746;
  const std::string why = explain(w, o);
  INFO(why);
  CHECK(why.rfind("TP+DP ZeRO-3 (14.808 s per iteration) beats the best TP+PP+DP (15.746 s, 0.938 s or 6.3% slower): ", 0) == 0);
  const size_t compute = why.find("TP+PP+DP's compute (forward, backward, recompute, optimizer) takes 15.131 s (96%) against "
                                  "TP+DP ZeRO-3's 14.506 s (98%), 0.625 s of the difference");
  const size_t bubble = why.find("TP+PP+DP's pipeline bubble takes 0.515 s (3%) against TP+DP ZeRO-3's 0.002 s (0%), 0.513 s");
  CHECK(compute != std::string::npos);
  CHECK(bubble != std::string::npos);
  CHECK(compute < bubble);  // the larger difference first
  CHECK(why.find("TP+DP ZeRO-3 gives back 0.200 s in exposed DP communication (0.300 s against TP+PP+DP's 0.100 s).") !=
        std::string::npos);
  CHECK(why.find(" its ") == std::string::npos);
  // the other order of parts: the bubble leads when it is the larger difference
  o.time.forward = 4.606;
  o.iteration_seconds = 15.221;
  const std::string why2 = explain(w, o);
  INFO(why2);
  CHECK(why2.find("TP+PP+DP's pipeline bubble") < why2.find("TP+PP+DP's compute"));
}

TEST_CASE("plan: progress reports the enumeration, then the scoring with the best so far", "[plan]") {
  const Scenario sc = load_scenario("gpt13b_zero2");
  PlanOptions o;
  o.vary = {PlanDim::tp, PlanDim::pp, PlanDim::micro_batch, PlanDim::zero};
  struct Event { PlanProgress::Phase phase; size_t done, total, fitting; std::string best; };
  std::vector<Event> events;
  o.progress = [&](const PlanProgress& p) {
    CHECK(p.gpus == 64);
    events.push_back({p.phase, p.done, p.total, p.fitting, p.best ? p.best->point.key() : ""});
  };
  const PlanResult r = plan(sc, o);
  REQUIRE(!r.ranked.empty());
  REQUIRE(events.size() > 10);
  size_t last_enumerating = 0;
  for (size_t i = 0; i < events.size(); ++i)
    if (events[i].phase == PlanProgress::enumerating) last_enumerating = i;
  // all enumeration events come first, counting up to every point of the space
  for (size_t i = 0; i <= last_enumerating; ++i) {
    CHECK(events[i].phase == PlanProgress::enumerating);
    CHECK(events[i].total == r.enumerated);
    CHECK(events[i].fitting <= events[i].done);
    if (i > 0) CHECK(events[i].done > events[i - 1].done);
  }
  CHECK(events[last_enumerating].done == r.enumerated);
  CHECK(events[last_enumerating].fitting <= r.ranked.size());
  // then scoring, up to every configuration that fits, ending on the winner
  REQUIRE(last_enumerating + 1 < events.size());
  for (size_t i = last_enumerating + 1; i < events.size(); ++i) {
    CHECK(events[i].phase == PlanProgress::scoring);
    CHECK(events[i].total == r.ranked.size());
    CHECK(!events[i].best.empty());
  }
  CHECK(events.back().done == r.ranked.size());
  CHECK(events.back().best == r.ranked[0].point.key());
}

TEST_CASE("plan: LoRA rank and the checkpointing options are searched when named", "[plan][finetune]") {
  // The shipped LoRA scenario, rank and micro-batch varied: every rank is scored, each point's
  // scenario trains adapters of that rank, and a higher rank moves more adapter gradients.
  const Scenario lora = load_scenario("llama-7b-lora");
  PlanOptions o;
  o.vary = {PlanDim::lora_rank};
  const PlanResult r = plan(lora, o);
  std::set<int> ranks;
  for (const PlanEntry& e : r.ranked) ranks.insert(e.point.lora_rank);
  CHECK(ranks == std::set<int>{4, 8, 16, 32, 64});
  CHECK(apply_point(lora, r.ranked.front().point).finetune.rank == r.ranked.front().point.lora_rank);
  // Not varied by default; a fix holds it.
  PlanOptions d;
  d.vary = {PlanDim::micro_batch};
  for (const PlanEntry& e : plan(lora, d).ranked) CHECK(e.point.lora_rank == 16);
  PlanOptions f;
  f.vary = {PlanDim::lora_rank};
  f.fixes = {parse_plan_fix("finetune.rank", "8")};
  for (const PlanEntry& e : plan(lora, f).ranked) CHECK(e.point.lora_rank == 8);
  // Checkpointing options: only with full recompute, three values each.
  const Scenario sc = load_scenario("gpt13b_zero2");
  PlanOptions c;
  c.vary = {PlanDim::checkpointing, PlanDim::tp};
  c.fixes = {parse_plan_fix("activation_checkpointing", "full")};
  std::set<int> cks;
  for (const PlanEntry& e : plan(sc, c).ranked) {
    cks.insert(e.point.checkpointing);
    const Scenario s = apply_point(sc, e.point);
    CHECK(s.checkpointing.partitions(s.recompute) == (e.point.checkpointing >= 1));
    CHECK(s.checkpointing.offloads(s.recompute) == (e.point.checkpointing == 2));
  }
  CHECK(cks == std::set<int>{0, 1, 2});
}

TEST_CASE("plan: a point refused early is one validate refuses", "[plan]") {
  // The search counts refused_early points as refused without building them; each must be one
  // that apply_point + validate refuses. Every combination of these values on GPT-3 175B (1024
  // GPUs, batch 1536) and on the MoE scenario (64 GPUs):
  for (const char* name : {"gpt175b", "moe"}) {
    const Scenario base = load_scenario(name);
    const int n = base.cluster.world();
    size_t early = 0, checked = 0, refused = 0;
    for (int tp : {1, 2, 4, 8})
      for (int pp : {1, 2, 3, 4, 8, 16})
        for (int mb : {1, 2, 3, 4})
          for (int z = 0; z <= 3; ++z)
            for (int v : {1, 2, 3, 4, 6})
              for (int sp = 0; sp <= 1; ++sp)
                for (int off = 0; off <= 2; ++off) {
                  if (n % (tp * pp) != 0) continue;
                  PlanPoint p = point_of(base);
                  p.tp = tp, p.pp = pp, p.dp = n / (tp * pp), p.micro_batch = mb, p.zero = z, p.interleave = v;
                  p.sequence_parallel = sp != 0, p.offload = static_cast<Offload>(off);
                  ++checked;
                  bool throws = false;
                  try {
                    validate(apply_point(base, p));
                  } catch (const ConfigError&) {
                    throws = true;
                  }
                  refused += throws;
                  if (!refused_early(base, p)) continue;
                  ++early;
                  INFO(name << " " << p.label());
                  CHECK(throws);
                }
    INFO(name << ": " << early << " refused early, " << refused << " refused, of " << checked);
    CHECK(early * 2 > refused);  // most refusals are caught early
    CHECK(early < refused);      // and not all: the others still go through validate
  }
}

TEST_CASE("plan: a search's shared work (stage plans, the pipeline of ZeRO 0 / 1 and offload variants) changes no score",
          "[plan]") {
  // plan() keeps the builder's stage plans across its Programs (StagePlanCache) and scores the
  // configurations that differ only in ZeRO 0 / 1 and the optimizer offload one after the other,
  // each taking its pipeline's timeline from the one before (evaluate_program_reusing). Every
  // third ranked configuration of such a family, and every tenth of the others, scored alone with
  // neither, must give the same iteration time and breakdown, bit for bit.
  const PlanResult& r = gpt175b_plan();
  const Scenario base = load_scenario("gpt175b");
  size_t n = 0, families = 0;
  for (size_t i = 0; i < r.ranked.size(); ++i) {
    const PlanEntry& e = r.ranked[i];
    const bool family = e.point.zero <= 1 && e.point.offload != Offload::optimizer_and_params;
    if (i % (family ? 3 : 10) != 0) continue;
    const PlanScore alone = score_scenario(apply_point(base, e.point), false);
    INFO(e.point.label());
    CHECK(alone.iteration_seconds == e.iteration_seconds);
    const TimeBreakdown &a = alone.time, &t = e.time;
    CHECK(a.forward == t.forward);
    CHECK(a.backward == t.backward);
    CHECK(a.recompute == t.recompute);
    CHECK(a.optimizer == t.optimizer);
    CHECK(a.exposed_tp == t.exposed_tp);
    CHECK(a.exposed_pp == t.exposed_pp);
    CHECK(a.exposed_dp == t.exposed_dp);
    CHECK(a.exposed_ep == t.exposed_ep);
    CHECK(a.exposed_offload == t.exposed_offload);
    CHECK(a.bubble == t.bubble);
    CHECK(a.idle == t.idle);
    ++n;
    families += family && e.point.pp > 1;
  }
  CHECK(n >= 900);
  CHECK(families >= 800);
}
