// The simulator on scenarios built by the core: agreement with the analytic estimate when nothing
// contends, the 1F1B bubble, determinism, and the Chrome trace.
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include "backends/sim/sim_backend.hpp"
#include "core/estimator.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

namespace {

// GPT-350M-like layers on a few DGX A100 nodes: tp 2 (NVSwitch), pp 4, dp 2, 8 micro-batches.
Scenario small_scenario(int tp = 2, int pp = 4, int dp = 2, int gpn = 4, int micro_batches = 8, int zero = 1) {
  const std::string yaml =
      "name: sim-small\n"
      "model: {preset: gpt-350m, layers: 8, dropout: 0.1}\n"
      "training: {global_batch: " + std::to_string(micro_batches * dp) + ", micro_batch: 1}\n"
      "parallel: {tp: " + std::to_string(tp) + ", pp: " + std::to_string(pp) + ", dp: " + std::to_string(dp) + "}\n"
      "zero: {stage: " + std::to_string(zero) + "}\n"
      "precision: {dtype: bf16}\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: " + std::to_string(gpn) +
      ", nics_per_node: " + std::to_string(gpn) + ", nodes: " + std::to_string(tp * pp * dp / gpn) + "}\n";
  return load_scenario_from_string(yaml, {}, "sim-small");
}

void huge_bandwidth(Scenario& sc, bool zero_latency) {
  sc.cluster.nic_bandwidth = 1e16;
  sc.cluster.gpu.nvlink_bandwidth = 1e16;
  sc.cluster.gpu.pcie_bandwidth = 1e16;
  sc.cluster.host_memory_bandwidth = 1e17;
  if (zero_latency) {
    sc.cluster.nic_latency = 0;
    sc.cluster.switch_latency = 0;
    sc.cluster.gpu.nvlink_latency = 0;
    sc.cluster.gpu.pcie_latency = 0;
  }
}

}  // namespace

TEST_CASE("contention-free scenario: simulated iteration time equals the analytic estimate") {
  Scenario sc = small_scenario();
  huge_bandwidth(sc, false);
  const Report analytic = analytic_report(sc, false);
  const Report sim = simulate(sc);
  INFO("analytic " << analytic.iteration_seconds << " s, sim " << sim.iteration_seconds << " s");
  CHECK(sim.iteration_seconds == Approx(analytic.iteration_seconds).epsilon(0.02));
  CHECK(sim.backend == "sim");
  CHECK(sim.tokens_per_second == Approx(analytic.tokens_per_second).epsilon(0.02));
  CHECK(sim.time.total() == Approx(sim.iteration_seconds).epsilon(1e-6));
  // The same Program, fully materialized and unfolded, gives the same answer.
  SimOptions full;
  full.symmetry = false;
  CHECK(simulate(sc, full).iteration_seconds == Approx(analytic.iteration_seconds).epsilon(0.02));
}

TEST_CASE("zero-cost communication: the 1F1B bubble is (p-1)/(m+p-1) of the pipeline time") {
  for (int m : {4, 8, 16}) {
    const int p = 4;
    Scenario sc = small_scenario(1, p, 1, 4, m, 0);
    sc.model.vocab = 64;  // embedding and head negligible next to the layers: stages are uniform
    // (to 3 %: stage 0's embedding lookup is 4-6 % of its two layers; the layers' dropout kernels,
    // on in small_scenario, keep that share at the low end)
    huge_bandwidth(sc, true);
    const SimRun run = simulate_run(sc);
    const Report& r = run.report;
    // The pipeline part of the iteration: everything but the optimizer step at the end.
    const double pipe = r.iteration_seconds - r.time.optimizer;
    const double expect = double(p - 1) / (m + p - 1);
    INFO("m = " << m << ": bubble " << r.time.bubble << " s of " << pipe << " s");
    CHECK(r.time.bubble / pipe == Approx(expect).epsilon(0.03));
  }
}

TEST_CASE("deterministic: the same scenario gives the same numbers bit for bit") {
  Scenario sc = small_scenario();
  sc.cluster.oversubscription = 2;
  const SimRun a = simulate_run(sc);
  const SimRun b = simulate_run(sc);
  CHECK(a.report.iteration_seconds == b.report.iteration_seconds);
  CHECK(a.report.extras.dump() != "");
  REQUIRE(a.timeline.spans.size() == b.timeline.spans.size());
  bool same = true;
  for (size_t k = 0; k < a.timeline.spans.size(); ++k)
    for (size_t i = 0; i < a.timeline.spans[k].size(); ++i)
      same = same && a.timeline.spans[k][i].start == b.timeline.spans[k][i].start &&
             a.timeline.spans[k][i].end == b.timeline.spans[k][i].end;
  CHECK(same);
  nlohmann::json ja = report_json(sc, a.report), jb = report_json(sc, b.report);
  ja["extras"]["sim"].erase("run_stats");  // wall-clock seconds and RSS of the run
  jb["extras"]["sim"].erase("run_stats");
  CHECK(ja.dump() == jb.dump());
}

TEST_CASE("Chrome trace: valid JSON, one process per rank, slices on a stream never overlap") {
  Scenario sc = small_scenario();
  SimOptions opts;
  opts.trace_path = "dssim_sim_test_trace.json";
  const SimRun run = simulate_run(sc, opts);
  std::ifstream in(opts.trace_path);
  REQUIRE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);  // throws on invalid JSON
  REQUIRE(j.contains("traceEvents"));
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> slices;
  std::set<int> pids;
  size_t named = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M") { if (e["name"] == "process_name") pids.insert(e["pid"].get<int>()); continue; }
    REQUIRE(e["ph"] == "X");
    const double ts = e["ts"], dur = e["dur"];
    CHECK(dur >= 0);
    slices[{e["pid"].get<int>(), e["tid"].get<int>()}].emplace_back(ts, ts + dur);
    named += e["name"].get<std::string>().rfind("forward", 0) == 0;
  }
  CHECK(pids.size() == run.ranks.size());
  CHECK(named > 0);
  size_t overlaps = 0;
  for (auto& [key, v] : slices) {
    // Slices are written in stream order; they must not overlap (1 ns tolerance for rounding).
    std::vector<std::pair<double, double>> s = v;
    std::sort(s.begin(), s.end());
    for (size_t i = 1; i < s.size(); ++i) overlaps += s[i].first < s[i - 1].second - 1e-3;
  }
  CHECK(overlaps == 0);
  // A chosen subset of ranks.
  opts.trace_ranks = {0, run.ranks.back()};
  simulate(sc, opts);
  std::ifstream in2(opts.trace_path);
  const nlohmann::json j2 = nlohmann::json::parse(in2);
  std::set<int> pids2;
  for (const auto& e : j2["traceEvents"]) pids2.insert(e["pid"].get<int>());
  CHECK(pids2 == std::set<int>{0, run.ranks.back()});
  std::remove(opts.trace_path.c_str());
}

TEST_CASE("sim extras: overlap per group kind, bubble, busiest links, stragglers") {
  Scenario sc = small_scenario();
  const Report r = simulate(sc);
  const auto& s = r.extras.at("sim");
  CHECK(s.at("communication").contains("dp"));
  CHECK(s.at("communication").contains("pp"));
  CHECK(s.at("links").at("busiest").size() > 0);
  CHECK(s.at("links").at("busiest")[0].at("utilization").get<double>() > 0);
  CHECK(s.at("links").at("busiest")[0].at("utilization").get<double>() <= 1.0 + 1e-9);
  CHECK(s.at("critical_path").at("ranks_by_slack").size() > 0);
  CHECK(s.at("bubble").at("critical_rank_seconds").get<double>() >= 0);
}

TEST_CASE("ZeRO++ on a slow-NIC cluster: less exposed DP communication than plain ZeRO-3, same answer as the estimator's trend", "[zeropp]") {
  // gpt-350M-like, pure DP over 4 nodes of 4 GPUs, one NIC per node: the stage-3 gathers and
  // reduce-scatters cross the slow network.
  const std::string yaml =
      "name: sim-zeropp\n"
      "model: {preset: gpt-350m, layers: 8}\n"
      "training: {global_batch: 32, micro_batch: 1}\n"
      "parallel: {tp: 1, pp: 1, dp: 16}\n"
      "zero: {stage: 3}\n"
      "precision: {dtype: bf16}\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: 4, nics_per_node: 1, nodes: 4}\n";
  const Scenario plain = load_scenario_from_string(yaml, {}, "sim-zeropp");
  Scenario zpp = plain;
  zpp.zero.quantized_weights = zpp.zero.quantized_gradients = true;
  zpp.zero.hpz_partition_size = 4;
  const Report a = simulate(plain), b = simulate(zpp);
  INFO("exposed DP " << a.time.exposed_dp << " s -> " << b.time.exposed_dp << " s; iteration " << a.iteration_seconds
                     << " -> " << b.iteration_seconds);
  CHECK(b.time.exposed_dp < 0.5 * a.time.exposed_dp);
  CHECK(b.iteration_seconds < a.iteration_seconds);
  const auto& comm = b.extras.at("sim").at("communication");
  CHECK(comm.contains("dp_intra"));  // hpZ gathers and qgZ's first all-to-all
  CHECK(comm.contains("dp_inter"));  // qgZ's second all-to-all
  // the estimator sees the same Program
  CHECK(analytic_report(zpp, false).time.exposed_dp < 0.5 * analytic_report(plain, false).time.exposed_dp);
  // stage representatives expand onto every rank's own dp_intra / dp_inter groups: the fully
  // materialized Program gives the same time
  SimOptions full;
  full.symmetry = false;
  CHECK(simulate(zpp, full).iteration_seconds == Approx(b.iteration_seconds).epsilon(0.02));
}

TEST_CASE("70 layers on pp 12 (DeepSpeed's parameters balance): the simulator runs it and agrees with the estimator", "[partition]") {
  // No partition_method: pp does not divide 70, so DeepSpeed's default balances the parameters
  // (GPT-350M layers, vocabulary 51200 + 2048 positions = 3.2 layers on each end).
  Scenario sc = load_scenario_from_string(
      "model: {preset: gpt-350m, layers: 70}\n"
      "training: {global_batch: 24, micro_batch: 1}\n"
      "parallel: {pp: 12}\n"
      "precision: {dtype: bf16}\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 3, gpus_per_node: 4, nics_per_node: 4}\n",
      {}, "pp12");
  REQUIRE(sc.parallel.partition.size() == 12);
  CHECK(sc.parallel.partition_method == "parameters");
  // The ends hold the embedding / tied head (3.2 layers' parameters each) and 2 layers; checked
  // against a Python port of DeepSpeed's partition_balanced.
  CHECK(sc.parallel.partition == std::vector<int>{2, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 2});
  huge_bandwidth(sc, false);
  const Report analytic = analytic_report(sc, false);
  const Report sim = simulate(sc);
  INFO("analytic " << analytic.iteration_seconds << " s, sim " << sim.iteration_seconds << " s");
  CHECK(sim.iteration_seconds > 0);
  CHECK(sim.iteration_seconds == Approx(analytic.iteration_seconds).epsilon(0.02));
  CHECK(sim.time.total() == Approx(sim.iteration_seconds).epsilon(1e-6));
}
