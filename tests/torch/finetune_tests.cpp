// Fine-tuning in the torch backend (backends/torch/lora.hpp): LoRA adapters on the tiny GPT and
// method full with frozen parts, trained for real on CPU ranks over Gloo (fp32), against the
// Program's layout of the tensors (ZeRO 0-3, offload).
#include <string>
#include <vector>
#include "tests/torch/harness.hpp"

using namespace dssim::test;

namespace {

const char* kLora = "scenarios/tiny/tiny_lora_dp2.yaml";
const char* kBuckets = " --set zero.reduce_bucket_size=3000 --set zero.allgather_bucket_size=3000";

// The tiny model's elements: the base model (embedding 256 x 64 + 32 x 64, 2 blocks of
// 12 h^2 + 13 h, final norm) and the rank-4 adapters of tiny_lora_dp2 (per block qkv 4 (64 + 192),
// o 4 (64 + 64), mlp_up 4 (64 + 256), mlp_down 4 (256 + 64); lm_head 4 (64 + 256)).
constexpr size_t kBase = 256 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64;
constexpr size_t kAdapters = 2 * (4 * 256 + 4 * 128 + 4 * 320 + 4 * 320) + 4 * 320;
constexpr size_t kEmbedding = 256 * 64 + 32 * 64;

// The initial weights, from one step at learning rate 1e-30 (dssim refuses 0): AdamW moves every
// weight by at most 1e-30, which leaves the nonzero ones bit for bit; the zero-initialised ones
// (biases, LoRA's B) come back at most 1e-30 and are set to zero again here.
std::vector<float> initial_weights(const std::string& args);

std::vector<float> slice(const std::vector<float>& v, size_t from, size_t n) {
  REQUIRE(v.size() >= from + n);
  return {v.begin() + from, v.begin() + from + n};
}

// 2 ranks unless the arguments say otherwise.
Result run_ok(std::string args, const std::string& scenario = kLora) {
  if (args.find("--nproc") == std::string::npos) args += " --nproc 2";
  Result r = run(args, scenario);
  INFO(args << "\n" << r.err);
  REQUIRE(r.code == 0);
  return r;
}

std::vector<float> initial_weights(const std::string& args) {
  static int n = 0;
  const fs::path dump = scratch() / ("init" + std::to_string(n++) + ".bin");
  run_ok("--json --steps 1 --set optimizer.lr=1e-30 --dump-params " + dump.string() + " " + args);
  std::vector<float> p = read_floats(dump);
  for (float& x : p)
    if (std::abs(x) < 1e-20f) x = 0;
  return p;
}

double reduced_bytes(const Result& r) {
  double b = 0;
  for (const char* k : {"all_reduce/gradient_reduce", "reduce_scatter/gradient_reduce"}) {
    const auto& got = measured(r).at("bytes_per_iteration");
    if (got.contains(k)) b += got.at(k).get<double>();
  }
  return b;
}

}  // namespace

TEST_CASE("LoRA: the base weights stay bit-identical over 10 steps while the adapters train", "[finetune][lora][gloo]") {
  const std::vector<float> p0 = initial_weights("");
  REQUIRE(p0.size() == kBase + kAdapters);
  for (int stage : {0, 2, 3}) {
    INFO("stage " << stage);
    const fs::path dump = scratch() / ("lora10_" + std::to_string(stage) + ".bin");
    Result r = run_ok("--json --steps 10 --set zero.stage=" + std::to_string(stage) + kBuckets + " --dump-params " +
                      dump.string());
    const std::vector<float> p = read_floats(dump);
    REQUIRE(p.size() == p0.size());
    CHECK(slice(p, 0, kBase) == slice(p0, 0, kBase));  // bit for bit
    const double moved = norm_rel_diff(slice(p0, kBase, kAdapters), slice(p, kBase, kAdapters));
    INFO("adapters moved by " << moved);
    CHECK(moved > 1e-3);
  }
}

TEST_CASE("LoRA: with B zero the first loss is the base model's, exactly", "[finetune][lora][gloo]") {
  Result full = run_ok("--json --steps 2 --set finetune.method=full");
  Result lora = run_ok("--json --steps 2");
  INFO("first losses " << losses(full)[0] << " " << losses(lora)[0]);
  CHECK(losses(full)[0] == losses(lora)[0]);
  CHECK(losses(full)[1] != losses(lora)[1]);  // then they train different things
  // The adapters start as PEFT's: A in U(-1/sqrt(in), 1/sqrt(in)) (block 0's qkv: in = 64), B zero.
  const auto a = initial_weights("");
  REQUIRE(a.size() == kBase + kAdapters);
  double amax = 0, bmax = 0;
  for (float x : slice(a, kBase, 4 * 64)) amax = std::max(amax, double(std::abs(x)));
  for (float x : slice(a, kBase + 4 * 64, 192 * 4)) bmax = std::max(bmax, double(std::abs(x)));
  CHECK(amax > 0.9 / 8);
  CHECK(amax <= 1.0 / 8);
  CHECK(bmax == 0);
}

TEST_CASE("LoRA: ZeRO stages 0-3 agree on 2 ranks, bytes per collective are the Program's", "[finetune][lora][zero][gloo]") {
  for (int gb : {4, 12}) {  // grad_accum 1 and 3
    INFO("global batch " << gb);
    std::vector<std::vector<double>> l(4);
    std::vector<std::vector<float>> p(4);
    for (int st = 0; st <= 3; ++st) {
      const fs::path dump = scratch() / ("lora_stage" + std::to_string(st) + "_" + std::to_string(gb) + ".bin");
      Result r = run_ok("--json --steps 10 --set training.global_batch=" + std::to_string(gb) +
                        " --set zero.stage=" + std::to_string(st) + kBuckets + " --dump-params " + dump.string());
      require_bytes_match(r);
      l[st] = losses(r);
      p[st] = read_floats(dump);
      // Only the adapters' gradients are reduced (fp32: 4 bytes each; no padding: every adapter
      // tensor is even and their sum a multiple of 2 dp), once per iteration or once per
      // micro-batch.
      const double bytes = reduced_bytes(r), accum = gb / 4.0;
      INFO("stage " << st << ": " << bytes << " bytes reduced per iteration");
      CHECK((bytes == 4.0 * kAdapters || bytes == 4.0 * kAdapters * accum));
    }
    for (int st = 1; st <= 3; ++st) {
      INFO("stage " << st << ": losses " << max_rel_diff(l[0], l[st]) << ", parameters " << norm_rel_diff(p[0], p[st]));
      CHECK(max_rel_diff(l[0], l[st]) <= 1e-6);
      CHECK(norm_rel_diff(p[0], p[st]) <= 1e-6);
    }
    CHECK(l[0] == l[1]);
    CHECK(p[0] == p[1]);
  }
}

TEST_CASE("LoRA: optimizer offload at stages 2 and 3 keeps the losses", "[finetune][lora][offload][gloo]") {
  const std::string base = "--json --steps 6 --set training.global_batch=8" + std::string(kBuckets);
  Result s2 = run_ok(base + " --set zero.stage=2");
  Result s2o = run_ok(base + " --set zero.stage=2 --set zero.offload_optimizer=true");
  Result s3 = run_ok(base + " --set zero.stage=3");
  Result s3o = run_ok(base + " --set zero.stage=3 --set zero.offload_optimizer=true --set zero.offload_param=true");
  for (const Result* r : {&s2, &s2o, &s3, &s3o}) require_bytes_match(*r);
  CHECK(losses(s2) == losses(s2o));
  CHECK(max_rel_diff(losses(s3), losses(s3o)) <= 1e-6);
  CHECK(max_rel_diff(losses(s2), losses(s3)) <= 1e-6);
}

TEST_CASE("LoRA: 2 data-parallel ranks equal 1 rank with the same global batch", "[finetune][lora][gloo]") {
  for (int stage : {0, 2}) {
    INFO("stage " << stage);
    const std::string base = "--json --steps 10 --set training.global_batch=8 --set zero.stage=" + std::to_string(stage);
    const fs::path d1 = scratch() / "lora_dp1.bin", d2 = scratch() / "lora_dp2.bin";
    Result one = run_ok(base + " --nproc 1 --set parallel.dp=1 --set cluster.gpus_per_node=1 --dump-params " + d1.string());
    Result two = run_ok(base + " --nproc 2 --dump-params " + d2.string());
    CHECK(one.json.at("config").at("grad_accum").get<int>() == 4);
    CHECK(two.json.at("config").at("grad_accum").get<int>() == 2);
    const double dl = max_rel_diff(losses(one), losses(two)), dp = norm_rel_diff(read_floats(d1), read_floats(d2));
    INFO("losses " << dl << ", parameters " << dp);
    CHECK(dl <= 1e-6);
    CHECK(dp <= 1e-5);
  }
}

TEST_CASE("full fine-tuning with freeze [embeddings]: the embedding stays, the rest trains", "[finetune][freeze][gloo]") {
  const std::string ft = " --set finetune.method=full --set finetune.freeze=[embeddings]";
  const auto p0 = initial_weights("--set finetune.method=full");
  REQUIRE(p0.size() == kBase);
  std::vector<std::vector<float>> p;
  for (int stage : {0, 2, 3}) {
    INFO("stage " << stage);
    const fs::path dump = scratch() / ("freeze_" + std::to_string(stage) + ".bin");
    Result r = run_ok("--json --steps 5" + ft + " --set zero.stage=" + std::to_string(stage) + kBuckets +
                      " --dump-params " + dump.string());
    require_bytes_match(r);
    p.push_back(read_floats(dump));
    REQUIRE(p.back().size() == kBase);
    CHECK(slice(p.back(), 0, kEmbedding) == slice(p0, 0, kEmbedding));
    CHECK(norm_rel_diff(slice(p0, kEmbedding, kBase - kEmbedding), slice(p.back(), kEmbedding, kBase - kEmbedding)) > 1e-3);
    // The embedding's gradient is not reduced: the rest of the model's is (4 bytes each).
    INFO(reduced_bytes(r) << " bytes reduced");
    CHECK(reduced_bytes(r) == 4.0 * (kBase - kEmbedding));
  }
  CHECK(norm_rel_diff(p[0], p[1]) <= 1e-6);
  CHECK(norm_rel_diff(p[0], p[2]) <= 1e-6);
}

TEST_CASE("LoRA: checkpoint, resume continues the adapters and their optimizer state bit for bit", "[finetune][lora][checkpoint][gloo]") {
  for (int stage : {2, 3}) {
    INFO("stage " << stage);
    const std::string base = "--json --steps 8 --set training.global_batch=8 --set zero.stage=" +
                             std::to_string(stage) + kBuckets;
    const fs::path dir = scratch() / ("lora_ckpt" + std::to_string(stage));
    fs::remove_all(dir);
    const fs::path da = scratch() / "lora_ckpt_a.bin", db = scratch() / "lora_ckpt_b.bin";
    Result full = run_ok(base + " --dump-params " + da.string());
    // Checkpoint every 4 steps; rank 1 dies at the start of step 6.
    Result killed = run(base + " --nproc 2 --checkpoint-dir " + dir.string() +
                        " --save-every 4 --kill-rank 1 --kill-at-step 6 --timeout 20", kLora);
    CHECK(killed.code == 1);
    REQUIRE(fs::exists(dir / "manifest.json"));
    Result resumed = run_ok(base + " --checkpoint-dir " + dir.string() + " --resume --dump-params " + db.string());
    const auto a = losses(full), b = losses(resumed);
    REQUIRE(b.size() == 4);
    for (size_t i = 0; i < b.size(); ++i) CHECK(b[i] == a[4 + i]);  // exact
    CHECK(read_floats(da) == read_floats(db));
  }
}
