// Pipeline, tensor and 3D parallelism in the torch backend, trained for real on CPU ranks over Gloo
// by `dssim run --nproc N` (the dssim_torch_run driver): every layout of a tiny scenario against one
// rank training the same model on the same global batch (--dump-params assembles the whole model in
// the one-rank layout, so the dumps compare directly); a pipeline stage dying; the refusals.
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>
#include "tests/torch/harness.hpp"

using namespace dssim::test;

namespace {

constexpr int kSteps = 20;
constexpr double kTolerance = 1e-5;  // relative: max over the steps' losses, ||dp|| / ||p|| of the parameters

// The same scenario with no parallelism at all, on one rank.
const char* kOneRank =
    " --nproc 1 --set parallel.pp=1 --set parallel.tp=1 --set parallel.dp=1 --set parallel.interleave=1"
    " --set parallel.sequence_parallel=false --set cluster.gpus_per_node=1";
const char* kFullRecompute = " --set activation_checkpointing=full";

Trained train(const std::string& scenario, const std::string& args) {
  Trained t = train_and_dump("--json --steps " + std::to_string(kSteps) + args, scenario);
  REQUIRE(losses(t.r).size() == size_t(kSteps));
  return t;
}

// The one-rank run of a scenario, trained once per test process.
const Trained& one_rank(const std::string& scenario) {
  static std::map<std::string, Trained> cache;
  auto it = cache.find(scenario);
  if (it == cache.end()) it = cache.emplace(scenario, train(scenario, kOneRank)).first;
  return it->second;
}

struct Layout {
  std::string args;                 // e.g. " --nproc 3 --set parallel.partition=[1,3,2]"
  int tp = 1, pp = 1, dp = 1, interleave = 1;
  bool sequence_parallel = false;
};

// Both loss curves, step by step, for the failure message.
std::string loss_table(const std::vector<double>& want, const std::vector<double>& got) {
  std::ostringstream s;
  s.precision(9);
  for (size_t i = 0; i < want.size() && i < got.size(); ++i)
    s << "step " << i + 1 << ": one rank " << want[i] << ", layout " << got[i] << ", rel "
      << std::abs(got[i] - want[i]) / std::abs(want[i]) << "\n";
  return s.str();
}

// Trains `layout` and holds it to the one-rank run: the report says it ran that layout, the bytes per
// (op, purpose) are the Program's, losses and final parameters agree within kTolerance.
Trained matches_one_rank(const std::string& scenario, const Layout& layout) {
  const Trained& ref = one_rank(scenario);
  Trained t = train(scenario, layout.args);
  INFO(scenario << layout.args);
  const auto& c = t.r.json.at("config");
  CHECK(c.at("tp").get<int>() == layout.tp);
  CHECK(c.at("pp").get<int>() == layout.pp);
  CHECK(c.at("dp").get<int>() == layout.dp);
  CHECK(c.at("interleave").get<int>() == layout.interleave);
  CHECK(c.at("sequence_parallel").get<bool>() == layout.sequence_parallel);
  CHECK(c.at("global_batch") == ref.r.json.at("config").at("global_batch"));
  require_bytes_match(t.r);
  INFO(loss_table(losses(ref.r), losses(t.r)));
  CHECK(max_rel_diff(losses(ref.r), losses(t.r)) <= kTolerance);
  CHECK(norm_rel_diff(ref.params, t.params) <= kTolerance);
  return t;
}

// The layout, then the layout with full activation checkpointing: recomputing changes nothing, bit
// for bit. Returns the plain run.
Trained with_and_without_recompute(const std::string& scenario, Layout layout) {
  Trained plain = matches_one_rank(scenario, layout);
  layout.args += kFullRecompute;
  Trained rec = matches_one_rank(scenario, layout);
  INFO(scenario << layout.args);
  CHECK(rec.r.json.at("config").at("recompute") == "full");
  CHECK(measured(rec.r).at("seconds_per_iteration_by_instruction").contains("recompute"));
  CHECK(losses(rec.r) == losses(plain.r));
  const bool same_params = rec.params == plain.params;  // (not the vectors themselves in the message)
  CHECK(same_params);
  return plain;
}

double params_bytes(const Trained& t) { return measured(t.r).at("memory_bytes").at("params").get<double>(); }

// tiny_pp3 (6 layers, 4 micro-batches) on `pp` stages, uniform and `uneven`, with and without recompute.
void pipeline_matches_one_rank(int pp, const std::string& uneven) {
  const std::string scenario = "scenarios/tiny/tiny_pp3.yaml";
  const std::string n = std::to_string(pp);
  Layout layout{" --nproc " + n + " --set parallel.pp=" + n + " --set cluster.gpus_per_node=" + n, 1, pp};
  const Trained uniform = with_and_without_recompute(scenario, layout);
  layout.args += " --set parallel.partition=" + uneven;
  const Trained skewed = with_and_without_recompute(scenario, layout);
  // The partition took effect: the first stage holds fewer layers than uniformly (the report is rank 0's).
  CHECK(params_bytes(skewed) < params_bytes(uniform));
}

}  // namespace

TEST_CASE("pipeline: 3 stages, uniform and [1,3,2], with and without recompute, match one rank over 20 steps",
          "[pipeline][gloo]") {
  pipeline_matches_one_rank(3, "[1,3,2]");
}

TEST_CASE("pipeline: 2 stages, uniform and [2,4], with and without recompute, match one rank over 20 steps",
          "[pipeline][gloo]") {
  pipeline_matches_one_rank(2, "[2,4]");
}

// Layer counts pp does not divide (parallel.partition_method, core/pipeline_partition.hpp): the
// loader resolves the method into parallel.partition, which the Program and the engine follow.
TEST_CASE("pipeline: 6 layers on 4 stages, uniform [2,2,1,1] and DeepSpeed's parameters [1,2,2,1], match one rank",
          "[pipeline][gloo]") {
  const std::string scenario = "scenarios/tiny/tiny_pp3.yaml";
  const std::string four = " --nproc 4 --set parallel.pp=4 --set cluster.gpus_per_node=4";
  for (const auto& [method, want] : std::vector<std::pair<std::string, std::vector<int>>>{
           {"uniform", {2, 2, 1, 1}}, {"parameters", {1, 2, 2, 1}}}) {
    const Trained t = matches_one_rank(scenario, Layout{four + " --set parallel.partition_method=" + method, 1, 4});
    CHECK(t.r.json.at("config").at("layers_per_stage").get<std::vector<int>>() == want);
  }
}

TEST_CASE("pipeline: 6 layers on 2 stages x 2 chunks (Megatron's split, 2 and 4 layers) matches one rank",
          "[pipeline][gloo]") {
  const Trained t = matches_one_rank(
      "scenarios/tiny/tiny_pp3.yaml",
      Layout{" --nproc 2 --set parallel.pp=2 --set parallel.interleave=2 --set cluster.gpus_per_node=2", 1, 2, 1, 2});
  CHECK(t.r.json.at("config").at("layers_per_stage").get<std::vector<int>>() == std::vector<int>{2, 4});
}

TEST_CASE("pipeline: interleaved, 2 chunks per stage, with and without recompute, matches one rank over 20 steps",
          "[pipeline][gloo]") {
  with_and_without_recompute("scenarios/tiny/tiny_interleave.yaml", Layout{" --nproc 2", 1, 2, 1, 2});
}

TEST_CASE("tensor parallel: tp 2 and 4, with and without sequence parallelism, match one rank over 20 steps",
          "[tensor][gloo]") {
  const std::string scenario = "scenarios/tiny/tiny_tp2.yaml";
  const std::string sp = " --set parallel.sequence_parallel=true";
  const std::string tp4 = " --nproc 4 --set parallel.tp=4 --set cluster.gpus_per_node=4";
  matches_one_rank(scenario, Layout{" --nproc 2", 2});
  matches_one_rank(scenario, Layout{" --nproc 2" + sp, 2, 1, 1, 1, true});
  matches_one_rank(scenario, Layout{tp4, 4});
  matches_one_rank(scenario, Layout{tp4 + sp, 4, 1, 1, 1, true});
  // Recompute re-issues the f / g and sequence-parallel collectives (checked against the Program).
  matches_one_rank(scenario, Layout{" --nproc 2" + sp + kFullRecompute, 2, 1, 1, 1, true});
  matches_one_rank(scenario, Layout{" --nproc 2 --set activation_checkpointing=selective", 2});
}

TEST_CASE("3D: tp 2 x pp 2 x dp 2 with ZeRO-1 on 8 ranks matches one rank over 20 steps", "[3d][gloo]") {
  const Trained t = matches_one_rank("scenarios/tiny/tiny_3d.yaml", Layout{" --nproc 8", 2, 2, 2});
  CHECK(t.r.json.at("config").at("zero_stage").get<int>() == 1);
  CHECK(t.r.json.at("config").at("grad_accum").get<int>() == 4);  // micro-batches per replica
}

TEST_CASE("a pipeline stage killed mid-run makes every rank exit with an error within the timeout",
          "[pipeline][timeout][gloo]") {
  // The middle stage of 3 dies at step 3; its neighbours are blocked on messages to or from it.
  Result r = run("--steps 50 --nproc 3 --timeout 10 --kill-rank 1 --kill-at-step 3", "scenarios/tiny/tiny_pp3.yaml",
                 120);
  INFO(r.err);
  CHECK(r.code == 1);  // not 124: the harness's 120 s limit was not reached (no wall-clock check)
  CHECK(r.err.find("rank 1 was killed by signal 9") != std::string::npos);
  CHECK(r.err.find("dssim run: rank 0: ") != std::string::npos);  // both survivors report their failure
  CHECK(r.err.find("dssim run: rank 2: ") != std::string::npos);
  CHECK(r.err.find("did not exit within the timeout") == std::string::npos);  // neither had to be killed
}

TEST_CASE("dssim run refuses ZeRO-2 with a pipeline and a world size tp * pp does not divide (exit 2)",
          "[pipeline][cli]") {
  Result zero2 = run("--steps 2 --nproc 3 --set zero.stage=2", "scenarios/tiny/tiny_pp3.yaml", 120);
  CHECK(zero2.code == 2);
  CHECK(zero2.err.find("zero.stage") != std::string::npos);
  CHECK(zero2.err.find("pipeline parallelism (pp=3)") != std::string::npos);
  for (const auto& [scenario, nproc, message] :
       {std::tuple{"scenarios/tiny/tiny_pp3.yaml", 2, "--gpus 2 is not a multiple of parallel.tp * parallel.pp = 1 * 3"},
        std::tuple{"scenarios/tiny/tiny_3d.yaml", 6, "--gpus 6 is not a multiple of parallel.tp * parallel.pp = 2 * 2"}}) {
    Result r = run("--steps 2 --nproc " + std::to_string(nproc), scenario, 120);
    INFO(scenario << " on " << nproc << " ranks\n" << r.err);
    CHECK(r.code == 2);
    CHECK(r.err.find(message) != std::string::npos);
  }
}
