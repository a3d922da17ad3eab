// MoE expert parallelism in the torch backend, trained for real on CPU ranks over Gloo by
// `dssim run --nproc N`: every expert-parallel layout of tiny_moe against one rank training the
// same model at ep = 1 on the same global batch (the gate's noise and token selection are drawn
// per micro-batch of the global batch, so the routing and the drop pattern are the same; the
// parameter dump holds the dense model then every layer's experts in order), the bytes of every
// all-to-all and expert reduction equal to the Program's, a checkpoint resumed bit for bit, tensor
// parallelism (DeepSpeed's token drop / gather over the TP group), the refusals.
#include <string>
#include <vector>
#include "tests/torch/harness.hpp"

using namespace dssim::test;

namespace {

constexpr int kSteps = 20;
constexpr double kTolerance = 1e-5;
const std::string kScenario = "scenarios/tiny/tiny_moe.yaml";
// Global batch 8 in micro-batches of 2: one rank accumulates 4, dp 2 two each, dp 4 one each.
const std::string kBatch = " --set training.global_batch=8";
const std::string kOneRank =
    " --nproc 1 --set parallel.dp=1 --set parallel.ep=1 --set cluster.gpus_per_node=1" + kBatch;

std::string layout(int dp, int ep) {
  const std::string d = std::to_string(dp);
  return " --nproc " + d + " --set parallel.dp=" + d + " --set parallel.ep=" + std::to_string(ep) +
         " --set cluster.gpus_per_node=" + d + kBatch;
}

Trained train(const std::string& args, int steps = kSteps) {
  Trained t = train_and_dump("--json --steps " + std::to_string(steps) + args, kScenario);
  REQUIRE(losses(t.r).size() == size_t(steps));
  return t;
}

// `args` (a layout and options) against one rank with the same options.
Trained matches_one_rank(const std::string& layout_args, const std::string& options) {
  const Trained ref = train(kOneRank + options);
  Trained t = train(layout_args + options);
  INFO(layout_args << options);
  if (options.find("drop_tokens=false") != std::string::npos)  // the capacity is the busiest expert's load
    require_bytes_match(t.r, {"all_to_all/moe_dispatch", "all_to_all/moe_combine", "all_gather/tensor_parallel"});
  else
    require_bytes_match(t.r);
  CHECK(max_rel_diff(losses(ref.r), losses(t.r)) <= kTolerance);
  CHECK(norm_rel_diff(ref.params, t.params) <= kTolerance);
  // The same tokens were dropped: the routing statistics (summed over the ranks) agree.
  CHECK(measured(t.r).at("moe").at("dropped_fraction").get<double>() ==
        Approx(measured(ref.r).at("moe").at("dropped_fraction").get<double>()).margin(1e-12));
  return t;
}

}  // namespace

TEST_CASE("MoE top-2: ep 2 and ep 4 over 2 and 4 ranks match one rank at ep 1 over 20 steps", "[moe][gloo]") {
  const Trained ep2 = matches_one_rank(layout(2, 2), "");
  const auto& moe = measured(ep2.r).at("moe");
  CHECK(moe.at("capacity").get<double>() == 20);  // ceil(64 tokens / 8 experts x 1.25 x 2)
  CHECK(moe.at("dropped_fraction").get<double>() > 0);  // capacity 1.25 drops some
  // Every MoE layer's dispatch and combine in forward and backward: 4 all-to-alls of
  // 8 experts x 20 slots x 64 x 4 bytes per layer and micro-batch (2 layers, 2 micro-batches).
  CHECK(measured(ep2.r).at("bytes_per_iteration").at("all_to_all/moe_dispatch").get<double>() == 2.0 * 2 * 2 * 8 * 20 * 64 * 4);
  matches_one_rank(layout(4, 4), "");
}

TEST_CASE("MoE: expert gradients reduced over the expert-data-parallel group (dp 4, ep 2) with ZeRO 0, 1, 2", "[moe][zero][gloo]") {
  for (int stage : {0, 1, 2}) {
    const Trained t = matches_one_rank(layout(4, 2), " --set zero.stage=" + std::to_string(stage));
    CHECK(measured(t.r).at("bytes_per_iteration").contains("all_reduce/gradient_reduce") == (stage == 0));
  }
}

TEST_CASE("MoE top-1: random token selection, Jitter, every other layer, no dropping: ep 2 matches one rank", "[moe][gloo]") {
  const std::string top1 = " --set model.top_k=1 --set model.moe_every=2 --set model.capacity_factor=1.0";
  matches_one_rank(layout(2, 2), top1 + " --set model.noisy_gate_policy=jitter");
  matches_one_rank(layout(2, 2), top1 + " --set model.noisy_gate_policy=rsample --set model.use_rts=false");
  const Trained nodrop = matches_one_rank(layout(2, 2), top1 + " --set model.drop_tokens=false");
  CHECK(measured(nodrop.r).at("moe").at("dropped_fraction").get<double>() == 0.0);
}

TEST_CASE("MoE with pipeline parallelism: pp 2 x dp 2 x ep 2, and a stage without MoE layers, match one rank", "[moe][pipeline][gloo]") {
  matches_one_rank(" --nproc 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.ep=2 --set cluster.gpus_per_node=4" + kBatch,
                   "");
  matches_one_rank(" --nproc 2 --set parallel.pp=2 --set parallel.dp=1 --set parallel.ep=1 --set cluster.gpus_per_node=2" + kBatch,
                   " --set model.moe_every=2");
}

TEST_CASE("MoE with full recompute: the same routing and the same parameters bit for bit", "[moe][gloo]") {
  const Trained plain = train(layout(2, 2));
  const Trained rec = train(layout(2, 2) + " --set activation_checkpointing=full");
  require_bytes_match(rec.r);  // the recomputed forward repeats its all-to-alls, as the Program says
  CHECK(losses(rec.r) == losses(plain.r));
  const bool same = rec.params == plain.params;
  CHECK(same);
}

TEST_CASE("MoE: checkpoint, kill, resume continues bit for bit (the expert partition saved)", "[moe][checkpoint][gloo]") {
  const std::string base = "--json --steps 8" + layout(2, 2);
  const fs::path dir = scratch() / "ckpt_moe";
  const fs::path pa = scratch() / "moe_full.bin", pb = scratch() / "moe_resumed.bin";
  fs::remove_all(dir);
  Result full = run(base + " --dump-params " + pa.string(), kScenario);
  INFO(full.err);
  REQUIRE(full.code == 0);
  Result killed = run(base + " --checkpoint-dir " + dir.string() + " --save-every 4 --kill-rank 1 --kill-at-step 6 --timeout 20",
                      kScenario);
  CHECK(killed.code == 1);
  Result resumed = run(base + " --checkpoint-dir " + dir.string() + " --resume --dump-params " + pb.string(), kScenario);
  INFO(resumed.err);
  REQUIRE(resumed.code == 0);
  const auto a = losses(full), b = losses(resumed);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < b.size(); ++i) CHECK(b[i] == a[4 + i]);
  CHECK(read_floats(pa) == read_floats(pb));
}

TEST_CASE("MoE trains on tiny_corpus.txt: the loss falls", "[moe][data][gloo]") {
  const std::string data = std::string(DSSIM_TEST_SOURCE_DIR) + "/tests/data/tiny_corpus.txt";
  Result r = run("--json --steps 30 --data " + data + layout(2, 2), kScenario);
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto l = losses(r);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += l[i] / 5, last += l[25 + i] / 5;
  CHECK(last < 0.8 * first);
  CHECK(measured(r).at("moe").at("aux_loss_mean").get<double>() > 0);
}

// DeepSpeed's MoE layer under tensor parallelism (deepspeed/moe/sharded_moe.py MOELayer.forward):
// each TP rank dispatches 1/tp of the capacity slots and all-gathers the combined slots; the TP
// peers sit in the same EP group (other experts) or the same expert-data-parallel group (the same
// experts, their gradients summed there): core/grid.hpp.
std::string tp_layout(int tp, int pp, int dp, int ep) {
  const std::string n = std::to_string(tp * pp * dp);
  return " --nproc " + n + " --set parallel.tp=" + std::to_string(tp) + " --set parallel.pp=" + std::to_string(pp) +
         " --set parallel.dp=" + std::to_string(dp) + " --set parallel.ep=" + std::to_string(ep) +
         " --set cluster.gpus_per_node=" + n + kBatch;
}

TEST_CASE("MoE with tensor parallelism: tp 2 x dp 2 at ep 2 and ep 1 match one rank over 20 steps", "[moe][tp][gloo]") {
  // ep 2: the EP groups are the TP pairs {0, 1}, {2, 3}; the experts' copies are on ranks 0 and 2
  // (and 1 and 3), reduced over the data-parallel replicas.
  const Trained ep2 = matches_one_rank(tp_layout(2, 1, 2, 2), "");
  const auto& bytes = measured(ep2.r).at("bytes_per_iteration");
  // Per rank and iteration: 2 micro-batches x 2 MoE layers x (forward + backward). The dispatch
  // sends this TP rank's half of the [8 experts, 20 slots, 64] fp32 buffer; one all-gather of the
  // whole buffer after the combine (forward) and for the drop's gradient (backward).
  CHECK(bytes.at("all_to_all/moe_dispatch").get<double>() == 2.0 * 2 * 2 * 8 * 10 * 64 * 4);
  CHECK(bytes.at("all_to_all/moe_combine").get<double>() == 2.0 * 2 * 2 * 8 * 10 * 64 * 4);
  CHECK(bytes.at("all_gather/tensor_parallel").get<double>() == 2.0 * 2 * 2 * 8 * 20 * 64 * 4);
  CHECK(measured(ep2.r).at("moe").at("capacity").get<double>() == 20);
  // ep 1: every rank holds all 8 experts and computes them on its half of the slots; the
  // expert-data-parallel group is the whole world (TP peers included), ZeRO-1 over it.
  const Trained ep1 = matches_one_rank(tp_layout(2, 1, 2, 1), " --set zero.stage=1");
  CHECK(!measured(ep1.r).at("bytes_per_iteration").contains("all_to_all/moe_dispatch"));
}

TEST_CASE("MoE with tensor and pipeline parallelism: tp 2 x pp 2 x dp 2 x ep 2 matches one rank", "[moe][tp][pipeline][gloo]") {
  matches_one_rank(tp_layout(2, 2, 2, 2), "");
}

TEST_CASE("MoE with tensor parallelism, top-1 without token dropping: the capacity rounded up to tp", "[moe][tp][gloo]") {
  const std::string top1 = " --set model.top_k=1 --set model.capacity_factor=1.0 --set model.drop_tokens=false";
  const Trained t = matches_one_rank(tp_layout(2, 1, 2, 2), top1);
  CHECK(int64_t(measured(t.r).at("moe").at("capacity").get<double>()) % 2 == 0);
}

TEST_CASE("dssim run refuses MoE with sequence parallelism, a capacity tp does not divide, and ZeRO-3, naming the key (exit 2)", "[moe]") {
  Result sp = run("--nproc 2 --set parallel.tp=2 --set parallel.dp=1 --set parallel.ep=1 --set parallel.sequence_parallel=true",
                  kScenario);
  CHECK(sp.code == 2);
  CHECK_THAT(sp.err, Catch::Contains("parallel.sequence_parallel"));
  // ceil(64 tokens / 8 experts x 1.3 x 2) = 21 slots: not divisible by tp 2
  Result odd = run("--nproc 2 --set parallel.tp=2 --set parallel.dp=1 --set parallel.ep=1 --set model.capacity_factor=1.3",
                   kScenario);
  CHECK(odd.code == 2);
  CHECK_THAT(odd.err, Catch::Contains("model.capacity_factor"));
  Result z3 = run("--nproc 2 --set zero.stage=3", kScenario);
  CHECK(z3.code == 2);
  CHECK_THAT(z3.err, Catch::Contains("zero.stage 3"));
}
