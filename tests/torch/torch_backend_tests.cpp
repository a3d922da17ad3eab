// The torch backend trained for real: tiny GPTs on 2 and 4 CPU ranks over Gloo, spawned by
// `dssim run --nproc N` (the dssim_torch_run driver).
#include <cstdlib>
#include <string>
#include <vector>
#include "backends/torch/loss_scaler.hpp"
#include "core/memory.hpp"
#include "core/scenario_loader.hpp"
#include "tests/torch/harness.hpp"

using namespace dssim::test;
using dssim::tb::DynamicLossScaler;

namespace {

const char* kBuckets = " --set zero.reduce_bucket_size=20000 --set zero.allgather_bucket_size=20000";

void stages_match_stage0(int nproc, int global_batch, int steps) {
  const std::string base = "--json --steps " + std::to_string(steps) + " --nproc " + std::to_string(nproc) +
                           " --set training.global_batch=" + std::to_string(global_batch) +
                           " --set training.micro_batch=2" + kBuckets;
  std::vector<std::vector<double>> l(4);
  std::vector<std::vector<float>> p(4);
  for (int st = 0; st <= 3; ++st) {
    const fs::path dump = scratch() / ("params_" + std::to_string(nproc) + "_" + std::to_string(global_batch) +
                                       "_" + std::to_string(st) + ".bin");
    Result r = run(base + " --set zero.stage=" + std::to_string(st) + " --dump-params " + dump.string());
    INFO("stage " << st << "\n" << r.err);
    REQUIRE(r.code == 0);
    l[st] = losses(r);
    p[st] = read_floats(dump);
    REQUIRE(int(l[st].size()) == steps);
    require_bytes_match(r);
  }
  // Every stage follows stage 0 (that the loss falls is checked on real text below).
  for (int st = 1; st <= 3; ++st) {
    INFO("stage " << st);
    CHECK(max_rel_diff(l[0], l[st]) <= 1e-6);
    CHECK(norm_rel_diff(p[0], p[st]) <= 1e-6);
  }
  // Stage 1 reduces and steps exactly as stage 0 does: bit for bit.
  CHECK(l[0] == l[1]);
  CHECK(p[0] == p[1]);
}

}  // namespace

TEST_CASE("loss scaler follows DeepSpeed's DynamicLossScaler rules", "[scaler]") {
  dssim::LossScaleSpec spec;
  spec.initial_scale_power = 4;  // 16
  spec.loss_scale_window = 3;
  spec.hysteresis = 2;
  spec.min_loss_scale = 2;
  DynamicLossScaler s(spec);
  REQUIRE(s.scale() == 16);
  // (overflow?, scale after the update), hand-computed from deepspeed/runtime/fp16/loss_scaler.py.
  const std::vector<std::pair<bool, double>> seq = {
      {false, 16},  // iter 0: (0 - -1) % 3 != 0
      {false, 16},  // iter 1
      {false, 32},  // iter 2: (2 - -1) % 3 == 0 -> double
      {true, 32},   // iter 3: hysteresis 2 -> 1, no shift yet
      {true, 16},   // iter 4: hysteresis exhausted -> halve
      {false, 16},  // iter 5: (5 - 4) % 3
      {false, 16},  // iter 6
      {false, 32},  // iter 7: (7 - 4) % 3 == 0 -> double, hysteresis back to 2
      {true, 32},   // iter 8: hysteresis 2 -> 1
      {false, 32},  // iter 9 (non-consecutive hysteresis stays at 1)
      {true, 16},   // iter 10: halve
      {true, 8},    // iter 11
      {true, 4},    // iter 12
      {true, 2},    // iter 13: reaches min_loss_scale
  };
  for (size_t i = 0; i < seq.size(); ++i) {
    INFO("iteration " << i);
    s.update(seq[i].first);
    CHECK(s.scale() == seq[i].second);
  }
  // At the minimum, another overflow is DeepSpeed's error.
  try {
    s.update(true);
    FAIL("no error at the minimum loss scale");
  } catch (const dssim::tb::LossScaleAtMinimum& e) {
    CHECK(std::string(e.what()) ==
          "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.");
  }
  // A static scale never moves.
  spec.loss_scale = 128;
  DynamicLossScaler fixed(spec);
  fixed.update(true);
  CHECK(fixed.scale() == 128);
}

TEST_CASE("ZeRO-1/2/3 match stage 0 over 20 steps, 2 ranks, no accumulation", "[zero][gloo]") {
  stages_match_stage0(2, 4, 20);  // micro 2 x dp 2: grad_accum 1
}

TEST_CASE("ZeRO-1/2/3 match stage 0 over 20 steps, 2 ranks, with accumulation", "[zero][gloo]") {
  stages_match_stage0(2, 12, 20);  // micro 2 x dp 2 x grad_accum 3
}

// Issue 15: the one-pass step (fused_adamw_step; stages 0/1 read the reduced 16-bit buckets in
// place, no fp32 accumulator) against the step before it, pass by pass through libtorch's ops with
// the fp32 accumulator (optimizer.fused_step false): the same floats in the same order, so the
// same losses and parameters bit for bit, with fp16's loss scale and clipping applied by the step.
TEST_CASE("the fused optimizer step equals the pass-by-pass one bit for bit, without the fp32 accumulator at stages 0/1",
          "[zero][optimizer][gloo]") {
  const std::string base = std::string("--json --steps 6 --nproc 2 --set training.global_batch=8 --set training.micro_batch=2") +
                           " --set precision.dtype=fp16 --set training.gradient_clipping=0.5" + kBuckets;
  for (int st = 0; st <= 3; ++st) {
    INFO("stage " << st);
    const std::string z = " --set zero.stage=" + std::to_string(st);
    const Trained fused = train_and_dump(base + z), unfused = train_and_dump(base + z + " --set optimizer.fused_step=false");
    const Result &a = fused.r, &b = unfused.r;
    require_bytes_match(a);
    require_bytes_match(b);
    CHECK(losses(a) == losses(b));
    CHECK(fused.params == unfused.params);
    // The fp32 accumulator of the optimizer's shard (4 bytes per element) is gone at stages 0/1:
    // the fused run keeps the 16-bit buffer only (2 bytes x the padded buffer P).
    const double ga = measured(a).at("memory_bytes").at("grads"), gb = measured(b).at("memory_bytes").at("grads");
    const double padded = ga / 2;
    if (st == 0) CHECK(gb - ga == 4 * padded);
    else if (st == 1) CHECK(gb - ga == 4 * padded / 2);
    else CHECK(gb == ga);
  }
}

TEST_CASE("ZeRO-1/2/3 match stage 0 over 20 steps, 4 ranks, with accumulation", "[zero][gloo]") {
  stages_match_stage0(4, 16, 20);  // micro 2 x dp 4 x grad_accum 2
}

TEST_CASE("ZeRO-3 that frees and refills layers between forward and backward matches stage 0", "[zero][gloo]") {
  // tiny_zero3_dp2.yaml: prefetch window and persistence threshold small, so every layer is
  // gathered, freed after its forward, and gathered again for its backward.
  const std::string scenario = "scenarios/tiny/tiny_zero3_dp2.yaml";
  Result s3 = run("--json --steps 10 --nproc 2", scenario);
  Result s0 = run("--json --steps 10 --nproc 2 --set zero.stage=0", scenario);
  INFO(s3.err << s0.err);
  REQUIRE(s3.code == 0);
  REQUIRE(s0.code == 0);
  require_bytes_match(s3);
  CHECK(max_rel_diff(losses(s0), losses(s3)) <= 1e-6);
  // More parameter bytes gathered than one pass over the model: layers were fetched twice.
  const double gathered = measured(s3).at("bytes_per_iteration").at("all_gather/param_gather").get<double>();
  CHECK(gathered > 1.5 * 2 * 4 * s3.json.at("config").at("parameters").get<double>());
}

TEST_CASE("ZeRO-3 with FSDP's granularity (one reduce-scatter per block) matches stage 0", "[zero][fsdp][gloo]") {
  // zero.engine fsdp: one all-gather per layer (repeat 1) and the layer's reduce-scatter; bytes
  // checked per rank against the Program.
  const std::string scenario = "scenarios/tiny/tiny_zero3_dp2.yaml";
  Result f = run("--json --steps 10 --nproc 2 --set zero.engine=fsdp", scenario);
  Result d = run("--json --steps 10 --nproc 2", scenario);
  Result s0 = run("--json --steps 10 --nproc 2 --set zero.stage=0", scenario);
  INFO(f.err << d.err << s0.err);
  REQUIRE(f.code == 0);
  REQUIRE(d.code == 0);
  REQUIRE(s0.code == 0);
  require_bytes_match(f);
  CHECK(max_rel_diff(losses(s0), losses(f)) <= 1e-6);
  CHECK(f.json.at("config").at("zero_engine") == "fsdp");
}

TEST_CASE("accumulation 4 x micro-batch 2 equals 1 x micro-batch 8", "[accumulation][gloo]") {
  for (int stage : {0, 2}) {
    INFO("stage " << stage);
    const std::string base = "--json --steps 10 --nproc 2 --set training.global_batch=16 --set zero.stage=" +
                             std::to_string(stage) + kBuckets;
    const fs::path pa = scratch() / "accum_a.bin", pb = scratch() / "accum_b.bin";
    Result a = run(base + " --set training.micro_batch=2 --dump-params " + pa.string());
    Result b = run(base + " --set training.micro_batch=8 --dump-params " + pb.string());
    INFO(a.err << b.err);
    REQUIRE(a.code == 0);
    REQUIRE(b.code == 0);
    CHECK(a.json.at("config").at("grad_accum").get<int>() == 4);
    CHECK(max_rel_diff(losses(a), losses(b)) <= 1e-6);
    CHECK(norm_rel_diff(read_floats(pa), read_floats(pb)) <= 1e-5);
  }
}

TEST_CASE("fp16 loss scaling skips overflowed steps as DeepSpeed does", "[scaler][gloo]") {
  Result r = run("--json --steps 8 --nproc 2 --set precision.dtype=fp16 --set zero.stage=2"
                 " --set precision.loss_scale.initial_scale_power=8 --set precision.loss_scale.loss_scale_window=2"
                 " --set precision.loss_scale.hysteresis=2 --inject-overflow 2,3,6");
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto scales = measured(r).at("loss_scales").get<std::vector<double>>();
  const auto skipped = measured(r).at("skipped_steps").get<std::vector<int>>();
  // The reference: the same scaler fed the same overflow sequence.
  dssim::LossScaleSpec spec;
  spec.initial_scale_power = 8;
  spec.loss_scale_window = 2;
  spec.hysteresis = 2;
  DynamicLossScaler ref(spec);
  std::vector<double> want;
  for (int step = 1; step <= 8; ++step) {
    want.push_back(ref.scale());
    ref.update(step == 2 || step == 3 || step == 6);
  }
  CHECK(scales == want);
  CHECK(skipped == std::vector<int>{2, 3, 6});
  CHECK(want == std::vector<double>{256, 256, 256, 128, 128, 256, 256, 256});
}

TEST_CASE("fp16 at the minimum loss scale fails with DeepSpeed's error", "[scaler][gloo]") {
  Result r = run("--steps 6 --nproc 2 --set precision.dtype=fp16 --set precision.loss_scale.initial_scale_power=1"
                 " --set precision.loss_scale.hysteresis=1 --set precision.loss_scale.min_loss_scale=1"
                 " --inject-overflow 1,2,3");
  CHECK(r.code == 1);
  CHECK(r.err.find("Current loss scale already at minimum - cannot decrease scale anymore") != std::string::npos);
}

TEST_CASE("checkpoint, kill, resume gives the uninterrupted run's losses bit for bit", "[checkpoint][gloo]") {
  for (int stage : {1, 3}) {
    INFO("stage " << stage);
    const std::string base = "--json --steps 8 --nproc 2 --set training.global_batch=8 --set zero.stage=" +
                             std::to_string(stage) + kBuckets;
    const fs::path dir = scratch() / ("ckpt" + std::to_string(stage));
    fs::remove_all(dir);
    Result full = run(base);
    REQUIRE(full.code == 0);
    // Checkpoint every 4 steps; rank 1 dies at the start of step 6.
    Result killed = run(base + " --checkpoint-dir " + dir.string() + " --save-every 4 --kill-rank 1 --kill-at-step 6 --timeout 20");
    CHECK(killed.code == 1);
    REQUIRE(fs::exists(dir / "manifest.json"));
    Result resumed = run(base + " --checkpoint-dir " + dir.string() + " --resume");
    INFO(resumed.err);
    REQUIRE(resumed.code == 0);
    const auto a = losses(full), b = losses(resumed);
    REQUIRE(b.size() == 4);
    CHECK(measured(resumed).at("first_step").get<int>() == 5);
    for (size_t i = 0; i < b.size(); ++i) CHECK(b[i] == a[4 + i]);  // exact
  }
}

TEST_CASE("resuming with a different world size fails clearly", "[checkpoint][gloo]") {
  const fs::path dir = scratch() / "ckpt_world";
  fs::remove_all(dir);
  Result a = run("--steps 2 --nproc 2 --set zero.stage=1 --checkpoint-dir " + dir.string());
  REQUIRE(a.code == 0);
  Result b = run("--steps 4 --nproc 1 --set zero.stage=1 --set training.global_batch=2 --checkpoint-dir " +
                 dir.string() + " --resume");
  CHECK(b.code == 2);
  CHECK(b.err.find("different world size") != std::string::npos);
}

TEST_CASE("under srun (SLURM_* set, no RANK / WORLD_SIZE, no --nproc) the ranks rendezvous from Slurm's variables",
          "[slurm][gloo]") {
  // Two tasks as srun starts them on one node: rank and world from SLURM_PROCID / SLURM_NTASKS, the
  // master from the first host of SLURM_JOB_NODELIST.
  const fs::path out = scratch() / "slurm_out.json", err0 = scratch() / "slurm_err0.txt",
                 err1 = scratch() / "slurm_err1.txt";
  const std::string port = std::to_string(20000 + getpid() % 20000);
  auto task = [&](int rank, const fs::path& stdout_to, const fs::path& stderr_to) {
    return "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR DSSIM_CPU_THREADS=1 SLURM_NTASKS=2 "
           "SLURM_TASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost,node2 MASTER_PORT=" + port + " SLURM_PROCID=" +
           std::to_string(rank) + " SLURM_LOCALID=" + std::to_string(rank) + " timeout -k 5 120 " + DSSIM_TORCH_RUN + " " +
           DSSIM_TEST_SOURCE_DIR + "/scenarios/tiny/tiny_dp2.yaml --quiet --json --steps 2 >" + stdout_to.string() +
           " 2>" + stderr_to.string();
  };
  const std::string cmd = task(1, "/dev/null", err1) + " & " + task(0, out, err0) + "; s=$?; wait $! || s=1; exit $s";
  const int status = std::system(cmd.c_str());
  INFO(cmd << "\n" << slurp(err0) << slurp(err1));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const auto j = nlohmann::json::parse(slurp(out));
  CHECK(j.at("config").at("gpus").get<int>() == 2);
  CHECK(j.at("config").at("dp").get<int>() == 2);
  CHECK(j.at("losses").size() == 2);
}

TEST_CASE("a rank killed mid-run makes the others exit with an error within the timeout", "[timeout][gloo]") {
  // No wall-clock bound (a loaded CI box stretches start-up): without the timeout the survivor
  // would wait until the harness's limit, which `timeout` ends with 124, not 1.
  Result r = run("--steps 50 --nproc 2 --timeout 10 --kill-rank 1 --kill-at-step 3", "scenarios/tiny/tiny_dp2.yaml", 120);
  CHECK(r.code == 1);
  CHECK(r.err.find("rank 1 was killed by signal 9") != std::string::npos);
  CHECK(r.err.find("rank 0:") != std::string::npos);  // the survivor reports the failed collective
}

TEST_CASE("a hung rank makes the others fail with a timeout error", "[timeout][gloo]") {
  // What proves the timeout fired is its error and the code (a run past the harness's limit exits
  // 124), not the seconds, which a loaded machine stretches.
  Result r = run("--steps 50 --nproc 2 --timeout 5 --hang-rank 1 --hang-at-step 3", "scenarios/tiny/tiny_dp2.yaml", 120);
  CHECK(r.code == 1);
  CHECK(r.err.find("rank 0: gloo collective failed") != std::string::npos);
  CHECK(r.err.find("did not exit within the timeout") != std::string::npos);  // the stopped rank is killed
}

TEST_CASE("activation checkpointing recomputes and matches the plain run", "[recompute][gloo]") {
  Result a = run("--json --steps 6 --nproc 2 --set zero.stage=2");
  Result b = run("--json --steps 6 --nproc 2 --set zero.stage=2 --set activation_checkpointing=full");
  INFO(a.err << b.err);
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  CHECK(losses(a) == losses(b));
  CHECK(measured(b).at("seconds_per_iteration_by_instruction").contains("recompute"));
}

TEST_CASE("model.cross_entropy fused_linear trains as the unfused loss does (fp32, ZeRO-0 and 3)", "[fused_ce][gloo]") {
  const std::string base = "--json --steps 8 --nproc 2 --set precision.dtype=fp32" + std::string(kBuckets);
  for (int st : {0, 3}) {
    INFO("stage " << st);
    const std::string z = " --set zero.stage=" + std::to_string(st);
    const Trained unfused = train_and_dump(base + z), fused = train_and_dump(base + z + " --set model.cross_entropy=fused_linear");
    require_bytes_match(fused.r);
    CHECK(max_rel_diff(losses(unfused.r), losses(fused.r)) <= 1e-6);
    // The head's weight gradient is summed chunk by chunk (addmm per chunk), in another order than
    // one GEMM over all tokens: fp32 rounding that 8 Adam steps carry to ~1e-6 (measured 1.03e-6);
    // a wrong gradient (a missing 1/T, the one-hot not subtracted) moves them by > 1e-2.
    CHECK(norm_rel_diff(unfused.params, fused.params) <= 1e-5);
  }
  Result tp = run("--json --steps 1 --nproc 2 --set parallel.tp=2 --set parallel.dp=1 --set model.cross_entropy=fused_linear");
  CHECK(tp.code == 2);
  CHECK(tp.err.find("model.cross_entropy") != std::string::npos);
  // The 16-bit xentropy kernel other frameworks run (`fused`) is the simulator's only: refused.
  Result xe = run("--json --steps 1 --nproc 2 --set model.cross_entropy=fused");
  CHECK(xe.code == 2);
  CHECK(xe.err.find("model.cross_entropy = fused") != std::string::npos);
  CHECK(xe.err.find("fused_linear or unfused") != std::string::npos);
}

TEST_CASE("gradient clipping across shards matches stage 0", "[clipping][gloo]") {
  const std::string base = "--json --steps 10 --nproc 2 --set training.gradient_clipping=0.05" + std::string(kBuckets);
  Result a = run(base + " --set zero.stage=0");
  Result b = run(base + " --set zero.stage=3");
  Result c = run("--json --steps 10 --nproc 2 --set zero.stage=0" + std::string(kBuckets));
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  REQUIRE(c.code == 0);
  CHECK(max_rel_diff(losses(a), losses(b)) <= 1e-6);
  CHECK(losses(a) != losses(c));  // the clip is active
}

TEST_CASE("option --data trains byte-level on a text file and the loss falls", "[data]") {
  const std::string data = std::string(DSSIM_TEST_SOURCE_DIR) + "/tests/data/tiny_corpus.txt";
  Result r = run("--json --steps 40 --nproc 1 --set training.global_batch=8 --set optimizer.lr=3e-3 --data " + data);
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto l = losses(r);
  CHECK(l.front() > 5.0);               // about ln(256) at the start
  CHECK(l.back() < l.front() - 1.5);    // and much lower after 40 steps
}

TEST_CASE("dssim run: bad input exits 2, a missing GPU exits 1 with a clear message", "[cli]") {
  Result missing = run("--steps 1", "scenarios/tiny/does_not_exist.yaml");
  CHECK(missing.code == 2);
  Result bad = run("--steps 1 --no-such-option");
  CHECK(bad.code == 2);
  Result cuda = run("--steps 1 --nproc 1 --backend cuda");
  if (cuda.code == 0) SUCCEED("a GPU is present");  // GPU machines train for real
  else {
    CHECK(cuda.code == 1);
    CHECK((cuda.err.find("CUDA") != std::string::npos));
  }
}

TEST_CASE("CPU offload of optimizer states and ZeRO-3 parameters keeps the losses", "[offload][gloo]") {
  const std::string base = "--json --steps 8 --nproc 2 --set training.global_batch=8" + std::string(kBuckets);
  Result s2 = run(base + " --set zero.stage=2");
  Result s2o = run(base + " --set zero.stage=2 --set zero.offload_optimizer=true");
  Result s3 = run(base + " --set zero.stage=3");
  Result s3o = run(base + " --set zero.stage=3 --set zero.offload_optimizer=true --set zero.offload_param=true");
  for (const Result* r : {&s2, &s2o, &s3, &s3o}) {
    INFO(r->err);
    REQUIRE(r->code == 0);
    require_bytes_match(*r);
  }
  CHECK(losses(s2) == losses(s2o));
  CHECK(max_rel_diff(losses(s3), losses(s3o)) <= 1e-6);
  CHECK(measured(s2o).at("bytes_per_iteration").contains("copy_d2h/offload_gradient"));
  CHECK(measured(s3o).at("bytes_per_iteration").contains("copy_h2d/offload_param"));
  CHECK(measured(s2o).at("seconds_per_iteration_by_instruction").contains("host_optimizer_step"));
}

// Hidden on CI (no GPU there): `dssim_torch_tests "[.gpu]"` on a GPU machine with a CUDA build.
// Each device draws the initial weights from its own generator (the CPU's mt19937, CUDA's Philox),
// so the two start from one CPU checkpoint: one step on the CPU, saved, then four more steps from
// it on each device. fp32 without TF32: the devices differ by kernel rounding only.
TEST_CASE("cuda: the tiny model trains on a GPU like on the CPU", "[.gpu]") {
  const fs::path dir = scratch() / "ckpt_cpu_gpu", cpu_dir = scratch() / "ckpt_cpu", gpu_dir = scratch() / "ckpt_gpu";
  for (const auto& d : {dir, cpu_dir, gpu_dir}) fs::remove_all(d);
  const std::string base = "--json --nproc 1 --set zero.stage=1 --set training.global_batch=4 --checkpoint-dir ";
  Result first = run(base + dir.string() + " --steps 1");
  REQUIRE(first.code == 0);
  fs::copy(dir, cpu_dir, fs::copy_options::recursive);  // each resume saves its own last step
  fs::copy(dir, gpu_dir, fs::copy_options::recursive);
  Result cpu = run(base + cpu_dir.string() + " --steps 5 --resume");
  Result gpu = run(base + gpu_dir.string() + " --steps 5 --resume --backend cuda");
  INFO(cpu.err << gpu.err);
  REQUIRE(cpu.code == 0);
  REQUIRE(gpu.code == 0);
  REQUIRE(losses(gpu).size() == 4);
  CHECK(measured(gpu).at("first_step").get<int>() == 2);
  CHECK(max_rel_diff(losses(cpu), losses(gpu)) <= 1e-5);
}

// DSSIM_TIMING (engine_measure.hpp): a bad value is refused by name; events (the default) apply on
// one GPU only, so on the host the run reports its syncs, asked for or not.
TEST_CASE("DSSIM_TIMING: a bad value refused, events only where there is one GPU", "[timing]") {
  ::setenv("DSSIM_TIMING", "sometimes", 1);
  Result bad = run("--json --steps 2 --nproc 1");
  ::setenv("DSSIM_TIMING", "events", 1);
  Result host = run("--json --steps 3 --nproc 1 --warmup 1");
  ::unsetenv("DSSIM_TIMING");
  Result host_default = run("--json --steps 3 --nproc 1 --warmup 1");
  CHECK(bad.code != 0);
  CHECK(bad.err.find("DSSIM_TIMING is 'sometimes'") != std::string::npos);
  INFO(host.err);
  REQUIRE(host.code == 0);
  CHECK(measured(host).at("instruction_timing") == "syncs");
  REQUIRE(host_default.code == 0);
  CHECK(measured(host_default).at("instruction_timing") == "syncs");
}

// On a GPU, the instructions timed by CUDA events (the default on one GPU): the same losses as with
// syncs, and the kinds' seconds add up to no more than the step (each boundary is an event on the
// one stream).
TEST_CASE("cuda: event timing keeps the losses and splits the step", "[.gpu]") {
  const std::string args = "--json --steps 6 --warmup 2 --nproc 1 --set zero.stage=1 --set training.global_batch=4 --backend cuda";
  ::setenv("DSSIM_TIMING", "sync", 1);
  Result synced = run(args);
  ::unsetenv("DSSIM_TIMING");
  Result evented = run(args);
  INFO(synced.err << evented.err);
  REQUIRE(synced.code == 0);
  REQUIRE(evented.code == 0);
  CHECK(losses(synced) == losses(evented));
  CHECK(measured(synced).at("instruction_timing") == "syncs");
  CHECK(measured(evented).at("instruction_timing") == "events");
  double sum = 0;
  for (const auto& [kind, seconds] : measured(evented).at("seconds_per_iteration_by_instruction").items()) {
    INFO(kind);
    CHECK(seconds.get<double>() > 0);
    sum += seconds.get<double>();
  }
  const double iteration = evented.json.at("throughput").at("iteration_seconds").get<double>();
  CHECK(sum <= iteration * 1.05);
  CHECK(sum >= iteration * 0.5);
}

TEST_CASE("selective activation checkpointing recomputes the attention core and matches", "[recompute][gloo]") {
  Result a = run("--json --steps 6 --nproc 2 --set zero.stage=1");
  Result b = run("--json --steps 6 --nproc 2 --set zero.stage=1 --set activation_checkpointing=selective");
  INFO(a.err << b.err);
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  CHECK(losses(a) == losses(b));
}

TEST_CASE("ZeRO-3 on one rank: parameters held once, per-layer gradient fold, offload", "[zero][offload]") {
  const std::string base = "--json --steps 6 --nproc 1 --set training.global_batch=4 --set training.micro_batch=2";
  const std::string one = "scenarios/tiny/tiny_dp1.yaml";
  Result s1 = run(base + " --set zero.stage=1", one);
  Result s3 = run(base + " --set zero.stage=3", one);
  Result s3o = run(base + " --set zero.stage=3 --set zero.offload_optimizer=true", one);
  // Parameters offloaded too: each layer is fetched (CopyH2D) before use and must be the updated
  // one (the resident layers were once left stale after step 1, on one rank).
  Result s3p = run(base + " --set zero.stage=3 --set zero.offload_optimizer=true --set zero.offload_param=true", one);
  for (const Result* r : {&s1, &s3, &s3o, &s3p}) {
    INFO(r->err);
    REQUIRE(r->code == 0);
  }
  require_bytes_match(s3o);  // one rank has no collectives; the offload copies are the Program's
  require_bytes_match(s3p);
  CHECK(max_rel_diff(losses(s1), losses(s3)) <= 1e-6);
  CHECK(max_rel_diff(losses(s3), losses(s3o)) <= 1e-6);
  CHECK(max_rel_diff(losses(s3), losses(s3p)) <= 1e-6);
  // The shard is the whole model and is used in place: no second, gathered copy.
  const double p1 = measured(s1).at("memory_bytes").at("params"), p3 = measured(s3).at("memory_bytes").at("params");
  CHECK(p3 == Approx(p1).epsilon(1e-3));
  // Offloaded gradients leave in backward, timed as the Program's CopyD2H.
  CHECK(measured(s3o).at("seconds_per_iteration_by_instruction").contains("copy_d2h"));
  CHECK(measured(s3o).at("bytes_per_iteration").contains("copy_d2h/offload_gradient"));
}

// ZeRO-3's gradient partition is in the training dtype, as DeepSpeed's grad_partitions_flat_buffer
// (gradient_accumulation_dtype defaults to it with ZeRO); zero.grad_accum_dtype: fp32 keeps an fp32
// one: twice the bytes, the same training to fp16's rounding of the summed micro-batches.
TEST_CASE("ZeRO-3's gradient partition: the training dtype, or fp32 with zero.grad_accum_dtype", "[zero][memory]") {
  const std::string base =
      "--json --steps 4 --nproc 1 --set training.global_batch=4 --set training.micro_batch=2 --set zero.stage=3 "
      "--set precision.dtype=fp16";
  Result model = run(base, "scenarios/tiny/tiny_dp1.yaml");
  Result fp32 = run(base + " --set zero.grad_accum_dtype=fp32", "scenarios/tiny/tiny_dp1.yaml");
  for (const Result* r : {&model, &fp32}) {
    INFO(r->err);
    REQUIRE(r->code == 0);
  }
  const double g16 = measured(model).at("memory_bytes").at("grads"), g32 = measured(fp32).at("memory_bytes").at("grads");
  REQUIRE(g16 > 0);
  CHECK(g32 == 2 * g16);
  CHECK(max_rel_diff(losses(model), losses(fp32)) <= 1e-3);
}

// ZeRO-3 on one rank with the partition in the training dtype: backward accumulates into the
// partition itself (core/memory.hpp zero3_backward_into_partition), so no layer group's 16-bit
// gradients exist besides it; DSSIM_ZERO3_FOLD=1 (the A/B switch) and an fp32 partition fold each
// group's into it, as with dp > 1. The same training either way, to bf16's rounding of the sums.
TEST_CASE("ZeRO-3 on one rank accumulates into the partition: no per-layer gradients, the same losses", "[zero][memory]") {
  const std::string base =
      "--json --steps 4 --nproc 1 --set training.global_batch=4 --set training.micro_batch=2 --set zero.stage=3 "
      "--set precision.dtype=bf16";
  const std::string one = "scenarios/tiny/tiny_dp1.yaml";
  Result direct = run(base, one);
  Result fp32 = run(base + " --set zero.grad_accum_dtype=fp32", one);
  ::setenv("DSSIM_ZERO3_FOLD", "1", 1);
  Result folded = run(base, one);
  ::unsetenv("DSSIM_ZERO3_FOLD");
  for (const Result* r : {&direct, &fp32, &folded}) {
    INFO(r->err);
    REQUIRE(r->code == 0);
  }
  const auto layer_grads = [](const Result& r) {
    return measured(r).at("memory_bytes").at("zero3_layer_gradients_peak").get<double>();
  };
  CHECK(layer_grads(direct) == 0);
  CHECK(layer_grads(folded) > 0);
  CHECK(layer_grads(fp32) == layer_grads(folded));
  // The report says which: what `dssim compare` checks against the model (unpriced_departure).
  CHECK(measured(direct).at("zero3_backward_into_partition") == true);
  CHECK(measured(folded).at("zero3_backward_into_partition") == false);
  CHECK(measured(fp32).at("zero3_backward_into_partition") == false);
  CHECK(measured(direct).at("memory_bytes").at("grads") == measured(folded).at("memory_bytes").at("grads"));
  CHECK(max_rel_diff(losses(direct), losses(folded)) <= 1e-2);
  CHECK(max_rel_diff(losses(direct), losses(fp32)) <= 1e-2);
}

// ZeRO-2 keeps what DeepSpeed's stage 2 keeps: this rank's 16-bit partition of the reduced
// gradients and the ipg bucket being reduced, not the whole model's gradients (stage 1: full 16-bit
// gradients and the fp32 shard accumulator). With the default reduce_bucket_size the tiny model is
// one bucket; overlap_comm off holds one bucket at a time: what core/memory counts.
TEST_CASE("ZeRO-2 holds the gradient partition and one bucket, as the memory model says", "[zero][memory][gloo]") {
  const std::string scenario = "scenarios/tiny/tiny_dp2.yaml";
  const std::vector<std::string> set = {"precision.dtype=fp16", "training.global_batch=8", "zero.overlap_comm=false"};
  std::string base = "--json --steps 2 --nproc 2";
  for (const auto& s : set) base += " --set " + s;
  Result s1 = run(base + " --set zero.stage=1", scenario);
  Result s2 = run(base + " --set zero.stage=2", scenario);
  for (const Result* r : {&s1, &s2}) {
    INFO(r->err);
    REQUIRE(r->code == 0);
    require_bytes_match(*r);
  }
  const double g1 = measured(s1).at("memory_bytes").at("grads"), g2 = measured(s2).at("memory_bytes").at("grads");
  // Stage 1: 2 bytes x the padded buffer P, no fp32 buffer (the step reads the reduced 16-bit
  // buckets in place, issue 15) = 2 P. Stage 2: the bucket (here the whole buffer) 2 P + the 16-bit
  // partition 2 x P / 2 = 3 P.
  const double padded = g1 / 2;
  CHECK(g2 == 3 * padded);
  // The memory model: gradients 2 psi / dp and one reduce bucket of min(reduce_bucket_size, psi).
  dssim::LoadOptions lo;
  lo.overrides = set;
  lo.overrides.push_back("zero.stage=2");
  const dssim::Scenario sc = dssim::load_scenario(std::string(DSSIM_TEST_SOURCE_DIR) + "/" + scenario, lo);
  const dssim::MemoryBreakdown mb = dssim::peak_memory(sc);
  const double psi = dssim::stage_parameters(sc, 0).total();
  CHECK(g2 == Approx(mb.grads + 2 * std::min(double(sc.zero.reduce_bucket_size), psi)).epsilon(1e-12));
  // Stage 1: the model's 16-bit gradients of the whole model (the buffer's padding aside).
  lo.overrides.back() = "zero.stage=1";
  const dssim::Scenario sc1 = dssim::load_scenario(std::string(DSSIM_TEST_SOURCE_DIR) + "/" + scenario, lo);
  CHECK(g1 == Approx(dssim::peak_memory(sc1).grads).epsilon(1e-3));
}

// ---- 1-bit Adam (backends/torch/onebit_adam.hpp; the algorithm itself against a one-process
// reference: comm_tests.cpp) ------------------------------------------------------------------

TEST_CASE("1-bit Adam: before freeze_step the run is AdamW's, after it compressed, 2 and 4 ranks", "[onebit][gloo]") {
  for (int n : {2, 4}) {
    INFO(n << " ranks");
    const std::string base = "--json --steps 6 --nproc " + std::to_string(n) +
                             " --set training.global_batch=" + std::to_string(2 * n);
    const fs::path pa = scratch() / ("onebit_adamw_" + std::to_string(n) + ".bin");
    const fs::path pb = scratch() / ("onebit_warm_" + std::to_string(n) + ".bin");
    Result a = run(base + " --dump-params " + pa.string());
    Result b = run(base + " --set optimizer.type=onebit_adam --set optimizer.freeze_step=100 --dump-params " + pb.string());
    Result c = run(base + " --set optimizer.type=onebit_adam --set optimizer.freeze_step=3");
    INFO(a.err << b.err << c.err);
    REQUIRE(a.code == 0);
    REQUIRE(b.code == 0);
    REQUIRE(c.code == 0);
    // All warm-up: AdamW with the same hyper-parameters, bit for bit.
    CHECK(losses(a) == losses(b));
    CHECK(read_floats(pa) == read_floats(pb));
    require_bytes_match(b);
    // freeze_step 3: steps 1-3 are AdamW's (the 4th loss is computed before the first compressed
    // update), then the compressed all-reduce moves the Program's bytes instead of the gradient.
    const auto la = losses(a), lc = losses(c);
    for (int i = 0; i < 4; ++i) CHECK(lc[i] == la[i]);
    CHECK(lc[4] != la[4]);
    require_bytes_match(c);
    const auto& got = measured(c).at("bytes_per_iteration");
    CHECK(got.contains("all_to_all/onebit_signs"));
    CHECK(got.contains("all_gather/onebit_server"));
  }
}

TEST_CASE("1-bit Adam: checkpoint, kill, resume continues bit for bit (error buffers saved)", "[onebit][checkpoint][gloo]") {
  const std::string scenario = "scenarios/tiny/tiny_onebit_dp2.yaml";
  const std::string base = "--json --steps 8 --nproc 2";
  const fs::path dir = scratch() / "ckpt_onebit";
  const fs::path pa = scratch() / "onebit_full.bin", pb = scratch() / "onebit_resumed.bin";
  fs::remove_all(dir);
  Result full = run(base + " --dump-params " + pa.string(), scenario);
  INFO(full.err);
  REQUIRE(full.code == 0);
  // Checkpoint every 4 steps (compression started after step 2); rank 1 dies at the start of step 6.
  Result killed = run(base + " --checkpoint-dir " + dir.string() + " --save-every 4 --kill-rank 1 --kill-at-step 6 --timeout 20",
                      scenario);
  CHECK(killed.code == 1);
  REQUIRE(fs::exists(dir / "manifest.json"));
  Result resumed = run(base + " --checkpoint-dir " + dir.string() + " --resume --dump-params " + pb.string(), scenario);
  INFO(resumed.err);
  REQUIRE(resumed.code == 0);
  const auto a = losses(full), b = losses(resumed);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < b.size(); ++i) CHECK(b[i] == a[4 + i]);  // exact
  CHECK(read_floats(pa) == read_floats(pb));
}

TEST_CASE("tiny_onebit_dp2 trains on tiny_corpus.txt: the loss keeps falling after compression starts", "[onebit][data][gloo]") {
  const std::string data = std::string(DSSIM_TEST_SOURCE_DIR) + "/tests/data/tiny_corpus.txt";
  Result r = run("--json --steps 30 --nproc 2 --data " + data, "scenarios/tiny/tiny_onebit_dp2.yaml");
  INFO(r.err);
  REQUIRE(r.code == 0);
  require_bytes_match(r);
  const auto l = losses(r);
  REQUIRE(l.size() == 30);
  // freeze_step 2: losses[2] is the first one after a compressed update.
  auto mean = [&](int b, int e) {
    double s = 0;
    for (int i = b; i < e; ++i) s += l[i];
    return s / (e - b);
  };
  CHECK(mean(25, 30) < mean(2, 7) - 0.5);
  CHECK(mean(15, 20) < mean(2, 7));
  CHECK(mean(25, 30) < mean(15, 20));
  // The warm-up covers the first compressed step (the third): steady compressed steps measured only.
  const auto& m = r.json.at("extras").at("measured");
  CHECK(m.at("warmup_steps").get<int>() == 3);
  CHECK(m.at("measured_steps").get<int>() == 27);
}
