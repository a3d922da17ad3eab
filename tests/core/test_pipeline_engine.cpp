// parallel.pipeline_engine (core/pipeline_engine.hpp): closed forms of the two engines on a
// 4-stage 1F1B pipeline, what the deepspeed engine's Program places where, the loader's default
// and the errors.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>

#include "core/estimator.hpp"
#include "core/memory.hpp"
#include "core/pipeline_engine.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;

namespace {

Scenario pipeline(int pp, int micro_batches, PipelineEngine engine) {
  Scenario sc = test::tiny_pipeline(pp, micro_batches);
  sc.parallel.pipeline_engine = engine;
  return sc;
}

// Forward t_f, backward t_b, every pipeline send / recv c (both ends of a transfer take c, from
// the moment both are posted, as the estimator and the simulator price it), the rest free.
std::vector<std::vector<double>> costs(const Program& p, double tf, double tb, double c) {
  std::vector<std::vector<double>> s(p.ranks.size());
  for (size_t r = 0; r < p.ranks.size(); ++r)
    for (const Instruction& in : p.ranks[r].instructions)
      s[r].push_back(in.op == Op::Forward    ? tf
                     : in.op == Op::Backward ? tb
                     : (in.op == Op::Send || in.op == Op::Recv) ? c
                                                                 : 0.0);
  return s;
}

}  // namespace

// DeepSpeed's engine on p = 4 stages, M >= 2 micro-batches, on one node (every transfer c):
//
//   T_ds = (M + p - 1)(t_f + t_b) + (4M + 2p - 8) c  =  (M + 3)(t_f + t_b) + 4 M c   (p = 4).
//
// Derivation. The compute part is 1F1B's: the last stage runs M (F, B) pairs, framed by the fill
// (p - 1 forwards upstream) and the drain (p - 1 backwards downstream). Every p2p is blocking on
// the compute stream, so each transfer on the critical path adds c:
//  - fill: micro-batch 0's activation crosses p - 1 links before the last stage's first F: (p - 1) c;
//  - the last stage's turn-around from micro-batch 0 to 1: SendGrad(0), RecvActivation(1): 2 c.
//    Stage p - 2 is still in its warm-up, so nothing else is in between;
//  - each later turn-around (M - 2 of them): 4 c. The last stage's SendGrad(m) pairs with stage
//    p - 2's RecvGrad(m), which stage p - 2 reaches only after its own step exchange with stage
//    p - 3 (SendGrad, RecvActivation: TrainSchedule puts them at the head of its forward step);
//    so the last stage waits 2 c, sends (c) and then receives the next activation (c);
//  - the last stage's final SendGrad (c), then the drain: stages p - 2 .. 0 each run B after
//    receiving the gradient, p - 2 more transfers: (p - 1) c in all with the send.
// Sum: (p - 1) + 2 + 4 (M - 2) + (p - 1) = 4M + 2p - 8 transfers of c.
//
// Megatron's engine (same order, p2p on PpComm) does not block compute on a send, but a stage
// still needs each micro-batch's input: the receive of the next activation (forward) and of the
// gradient (backward) are exposed once per micro-batch at the last stage's turn-arounds
// (2 (M - 1) c), besides the fill and the drain (2 (p - 1) c):
//
//   T_mg = (M + p - 1)(t_f + t_b) + (2 (M - 1) + 2 (p - 1)) c,
//
// so the DeepSpeed engine is slower by exactly 2 (M - 2) c: in each of the M - 2 steady-state
// turn-arounds, the second exchange that DeepSpeed's blocking pairs serialize (stage p - 2's
// SendGrad / RecvActivation with stage p - 3) and that Megatron's separate p2p stream overlaps.
TEST_CASE("pipeline engines: closed forms of the 4-stage 1F1B iteration", "[pipeline_engine]") {
  const int p = 4;
  const double tf = 1.0, tb = 2.0;
  for (int m : {2, 4, 8, 16})
    for (double c : {0.05, 0.2}) {
      INFO("M " << m << " c " << c);
      const Program ds = build_program(pipeline(p, m, PipelineEngine::deepspeed), {});
      const Program mg = build_program(pipeline(p, m, PipelineEngine::megatron), {});
      const double t_ds = evaluate_program(ds, costs(ds, tf, tb, c)).makespan;
      const double t_mg = evaluate_program(mg, costs(mg, tf, tb, c)).makespan;
      CHECK(t_ds == Approx((m + p - 1) * (tf + tb) + (4.0 * m + 2 * p - 8) * c));
      CHECK(t_mg == Approx((m + p - 1) * (tf + tb) + (2.0 * (m - 1) + 2.0 * (p - 1)) * c));
      CHECK(t_ds - t_mg == Approx(2.0 * (m - 2) * c));
      // free communication: both are 1F1B, (M + p - 1)(t_f + t_b)
      CHECK(evaluate_program(ds, costs(ds, tf, tb, 0)).makespan == Approx((m + p - 1) * (tf + tb)));
    }
}

TEST_CASE("pipeline engines: the estimator prices the deepspeed engine slower by its blocking p2p", "[pipeline_engine]") {
  // A real device model on one node: same compute, the difference is exposed pipeline communication.
  const Scenario ds = pipeline(4, 8, PipelineEngine::deepspeed);
  const Scenario mg = pipeline(4, 8, PipelineEngine::megatron);
  const double t_ds = estimate(ds, build_program(ds, {})).makespan;
  const double t_mg = estimate(mg, build_program(mg, {})).makespan;
  CHECK(t_ds >= t_mg);
}

TEST_CASE("pipeline engines: what the deepspeed engine's Program places where", "[pipeline_engine]") {
  Scenario sc = load_scenario("tiny/tiny_pp3");
  sc.parallel.tp = 2;
  sc.parallel.dp = 2;
  sc.cluster.gpus_per_node = 12;
  sc.training.global_batch = 8;
  sc.training.grad_accum = 4;
  const double act = double(sc.training.micro_batch) * sc.model.seq_len * sc.model.hidden * bytes_of(sc.precision.dtype);
  for (PipelineEngine e : {PipelineEngine::megatron, PipelineEngine::deepspeed}) {
    sc.parallel.pipeline_engine = e;
    const bool deepspeed = e == PipelineEngine::deepspeed;
    INFO(to_string(e));
    const Program prog = build_program(sc, {});
    for (const RankProgram& rp : prog.ranks) {
      int last_backward = -1, first_reduce = -1, gathers = 0;
      for (size_t i = 0; i < rp.instructions.size(); ++i) {
        const Instruction& in = rp.instructions[i];
        if (in.op == Op::Send || in.op == Op::Recv) {
          CHECK(in.stream == (deepspeed ? Stream::Compute : Stream::PpComm));
          // DeepSpeed partitions the message over the TP group by default (pipe_partitioned)
          CHECK(in.bytes == Approx(deepspeed ? act / 2 : act));
        }
        if (in.op == Op::AllGather && (in.purpose == Purpose::PipelineActivation || in.purpose == Purpose::PipelineGradient))
          ++gathers;
        if (in.op == Op::Backward) last_backward = int(i);
        if (in.purpose == Purpose::GradientReduce && first_reduce < 0) first_reduce = int(i);
        if (deepspeed && (in.purpose == Purpose::GradientReduce || in.purpose == Purpose::EmbeddingSync))
          CHECK(in.stream == Stream::Compute);
      }
      CHECK((gathers > 0) == deepspeed);
      REQUIRE(first_reduce >= 0);
      // ReduceGrads after the whole schedule (no overlap with backward) vs overlap_comm's stream
      if (deepspeed) CHECK(first_reduce > last_backward);
      else CHECK(rp.instructions[first_reduce].stream == Stream::DpComm);
    }
  }
  // pipe_partitioned / grad_partitioned false: whole messages, no gathers
  sc.parallel.pipeline_engine = PipelineEngine::deepspeed;
  sc.parallel.pipe_partitioned = sc.parallel.grad_partitioned = false;
  for (const RankProgram& rp : build_program(sc, {}).ranks)
    for (const Instruction& in : rp.instructions) {
      if (in.op == Op::Send) CHECK(in.bytes == Approx(act));
      CHECK(!(in.op == Op::AllGather && in.purpose == Purpose::PipelineActivation));
    }
}

TEST_CASE("pipeline engines: the loader's default and the ds_config pipeline section", "[pipeline_engine]") {
  using test::tiny_yaml;
  const std::string two_stages = "  tp: 1\n  pp: 2\n";
  // no ds_config: Megatron-LM's schedules
  CHECK(load_scenario_from_string(tiny_yaml(two_stages), {}, "t.yaml").parallel.pipeline_engine == PipelineEngine::megatron);

  const std::string with_pipeline = "/tmp/dssim_test_ds_pipeline.json", without = "/tmp/dssim_test_ds_plain.json";
  std::ofstream(with_pipeline) << R"({"train_micro_batch_size_per_gpu": 1, "pipeline": {"pipe_partitioned": false}})";
  std::ofstream(without) << R"({"train_micro_batch_size_per_gpu": 1})";
  LoadOptions o;
  // a pipeline section names DeepSpeed's engine, with its options
  o.deepspeed_config = with_pipeline;
  Scenario s = load_scenario_from_string(tiny_yaml(two_stages), o, "t.yaml");
  CHECK(s.parallel.pipeline_engine == PipelineEngine::deepspeed);
  CHECK_FALSE(s.parallel.pipe_partitioned);
  CHECK(s.parallel.grad_partitioned);
  // a ds_config with pp > 1 is DeepSpeed's PipelineEngine (Megatron-DeepSpeed, GPT-NeoX)
  o.deepspeed_config = without;
  CHECK(load_scenario_from_string(tiny_yaml(two_stages), o, "t.yaml").parallel.pipeline_engine == PipelineEngine::deepspeed);
  // ... and without pipeline parallelism nothing changes
  CHECK(load_scenario_from_string(tiny_yaml(), o, "t.yaml").parallel.pipeline_engine == PipelineEngine::megatron);
  // the scenario (or --set) can still say megatron
  o.overrides = {"parallel.pipeline_engine=megatron"};
  CHECK(load_scenario_from_string(tiny_yaml(two_stages), o, "t.yaml").parallel.pipeline_engine == PipelineEngine::megatron);
  std::remove(with_pipeline.c_str());
  std::remove(without.c_str());
}

TEST_CASE("pipeline engines: the deepspeed engine refuses Megatron's options, naming key and fix", "[pipeline_engine]") {
  using test::config_error;
  using test::tiny_yaml;
  const std::string interleave =
      config_error([] { load_scenario_from_string(tiny_yaml("  tp: 1\n  pp: 2\n  interleave: 2\n  pipeline_engine: deepspeed\n"), {}, "t.yaml"); });
  CHECK_THAT(interleave, Catch::Contains("parallel.interleave (2)") && Catch::Contains("parallel.pipeline_engine is deepspeed") &&
                             Catch::Contains("Set parallel.interleave: 1") && Catch::Contains("parallel.pipeline_engine: megatron"));
  const std::string sg = config_error([] {
    load_scenario_from_string(tiny_yaml("  tp: 2\n  pp: 1\n  scatter_gather: true\n  pipeline_engine: deepspeed\n"), {}, "t.yaml");
  });
  CHECK_THAT(sg, Catch::Contains("parallel.scatter_gather") && Catch::Contains("pipe_partitioned") &&
                     Catch::Contains("Remove parallel.scatter_gather") && Catch::Contains("parallel.pipeline_engine: megatron"));
  // the default engine of a ds_config with pp > 1 is named as such
  std::ofstream("/tmp/dssim_test_ds_plain2.json") << R"({"train_micro_batch_size_per_gpu": 1})";
  LoadOptions o;
  o.deepspeed_config = "/tmp/dssim_test_ds_plain2.json";
  const std::string dflt =
      config_error([&] { load_scenario_from_string(tiny_yaml("  tp: 1\n  pp: 2\n  interleave: 2\n"), o, "t.yaml"); });
  CHECK_THAT(dflt, Catch::Contains("the default for a ds_config with parallel.pp > 1"));
  std::remove("/tmp/dssim_test_ds_plain2.json");
  // Megatron's engine keeps its options
  CHECK(config_error([] {
          load_scenario_from_string(tiny_yaml("  tp: 2\n  pp: 1\n  scatter_gather: true\n"), {}, "t.yaml");
        }) == "<no error>");
}

// DeepSpeed's BF16_Optimizer (core/pipeline_engine.hpp) under the deepspeed engine, bf16, ZeRO-0.
namespace {

Scenario bf16_pipeline(PipelineEngine engine) {
  Scenario sc = load_scenario("tiny/tiny_pp3");
  sc.parallel.pp = 3;
  sc.parallel.dp = 2;
  sc.parallel.pipeline_engine = engine;
  sc.cluster.gpus_per_node = 6;
  sc.precision.dtype = Dtype::bf16;
  sc.training.micro_batch = 1;
  sc.training.grad_accum = 4;
  sc.training.global_batch = 8;
  return sc;
}

struct RankSummary {
  double fold_bytes = 0;      // bf16_optimizer_gradient_fold bytes over the backwards of micro-batch 0
  int folds = 0, accumulates = 0, backwards = 0;
  int last_backward = -1, emb_sync = -1, first_reduce = -1, last_reduce = -1, step = -1, first_gather = -1;
  double emb_bytes = 0, step_bytes = 0, step_flops = 0;
  std::vector<double> gather_bytes;
  bool all_on_compute = true;  // the batch-end instructions
};

RankSummary summarize(const Program& prog, const RankProgram& rp) {
  RankSummary s;
  for (size_t i = 0; i < rp.instructions.size(); ++i) {
    const Instruction& in = rp.instructions[i];
    const int k = int(i);
    if (in.op == Op::Backward) {
      ++s.backwards;
      s.last_backward = k;
      for (const LayerOp& op : prog.op_lists.at(in.ops)) {
        if (op.name == "grad_accumulate") ++s.accumulates;
        if (op.name != "bf16_optimizer_gradient_fold") continue;
        ++s.folds;
        CHECK(op.backward_only);
        if (in.micro_batch == 0) s.fold_bytes += op.memory_bytes;
      }
    }
    if (in.purpose == Purpose::EmbeddingSync) { s.emb_sync = k; s.emb_bytes = in.bytes; }
    if (in.purpose == Purpose::GradientReduce) { if (s.first_reduce < 0) s.first_reduce = k; s.last_reduce = k; }
    if (in.op == Op::OptimizerStep) { s.step = k; s.step_bytes = in.memory_bytes; s.step_flops = in.flops; }
    if (in.op == Op::AllGather && in.purpose == Purpose::ParamGather) {
      if (s.first_gather < 0) s.first_gather = k;
      s.gather_bytes.push_back(in.bytes);
    }
    if ((in.purpose == Purpose::EmbeddingSync || in.purpose == Purpose::GradientReduce ||
         in.purpose == Purpose::ParamGather || in.op == Op::OptimizerStep) && in.stream != Stream::Compute)
      s.all_on_compute = false;
  }
  return s;
}

}  // namespace

TEST_CASE("BF16_Optimizer: bf16 folds per micro-batch, fp32 tied sync, partitioned step, bf16 all-gathers",
          "[pipeline_engine][bf16_optimizer]") {
  Scenario sc = bf16_pipeline(PipelineEngine::deepspeed);
  REQUIRE(uses_bf16_optimizer(sc));
  const int dp = sc.parallel.dp, M = 4;
  const double V = sc.model.vocab, h = sc.model.hidden;
  for (double clip : {0.0, 1.0}) {
    sc.training.gradient_clipping = clip;
    const Program prog = build_program(sc, {});
    REQUIRE(prog.ranks.size() == 6);
    for (const RankProgram& rp : prog.ranks) {
      const int stage = rp.rank / dp;  // ranks of a stage are contiguous (tp 1)
      INFO("rank " << rp.rank << " stage " << stage << " clip " << clip);
      const double N = stage_parameters(sc, stage).trainable();  // this GPU's parameters, tied copy included
      const RankSummary s = summarize(prog, rp);
      // update_hp_grads after every micro-batch's backward: 18 bytes per parameter, no AccumulateGrad
      CHECK(s.fold_bytes == Approx(kBf16FoldBytesPerParam * N));
      CHECK(s.folds == s.backwards);
      CHECK(s.backwards == M);
      CHECK(s.accumulates == 0);
      // ReduceTiedGrads on the fp32 gradient of the tied weight (first and last stage)
      if (stage == 0 || stage == 2) CHECK(s.emb_bytes == Approx(V * h * 4));
      else CHECK(s.emb_sync < 0);
      // the step: norm (+ clip) and clear over all N, Adam + copy to bf16 on the 1/dp partition
      const double part = double(bf16_partition_numel(int64_t(N), dp));
      CHECK(part == Approx(std::ceil(N / (2.0 * dp)) * 2));
      CHECK(s.step_bytes == Approx(N * (4 + (clip > 0 ? 8 : 0) + 4) + part * (28 + 6)));
      CHECK(s.step_flops == Approx(16 * part + N));
      // bf16 partitions all-gathered over DP: one call (N < 5e8), output part x dp x 2 bytes
      REQUIRE(s.gather_bytes.size() == 1);
      CHECK(s.gather_bytes[0] == Approx(part * dp * 2));
      // order: backward, [tied sync], DP reduction, step, all-gathers; blocking on the compute stream
      CHECK(s.all_on_compute);
      CHECK(s.first_reduce > s.last_backward);
      if (s.emb_sync >= 0) CHECK(s.emb_sync < s.first_reduce);
      CHECK(s.step > s.last_reduce);
      CHECK(s.first_gather > s.step);
    }
  }
  // allgather_bucket_size splits the gather as all_gather_dp_groups does
  sc.zero.allgather_bucket_size = 5000;
  const Program prog = build_program(sc, {});
  for (const RankProgram& rp : prog.ranks) {
    const int stage = rp.rank / dp;
    const int64_t N = int64_t(stage_parameters(sc, stage).trainable());
    const std::vector<int64_t> pieces = bf16_allgather_pieces(N, dp, 5000);
    const RankSummary s = summarize(prog, rp);
    REQUIRE(s.gather_bytes.size() == pieces.size());
    CHECK(pieces.size() == size_t(std::max<int64_t>(1, bf16_partition_numel(N, dp) * dp / 5000)));
    CHECK(pieces.size() > 1);
    double sum = 0;
    for (size_t k = 0; k < pieces.size(); ++k) {
      CHECK(s.gather_bytes[k] == Approx(double(pieces[k]) * dp * 2));
      sum += s.gather_bytes[k];
    }
    CHECK(sum == Approx(double(bf16_partition_numel(N, dp)) * dp * 2));
  }
}

TEST_CASE("BF16_Optimizer: all_gather_dp_groups pieces and the padded partition", "[pipeline_engine][bf16_optimizer]") {
  // 1000 elements over 4 ranks: partition 250; 250 x 4 / 300 = 3 calls of 83 aligned to 82, the last 86
  CHECK(bf16_allgather_pieces(1000, 4, 300) == std::vector<int64_t>{82, 82, 86});
  CHECK(bf16_allgather_pieces(1000, 4, 0) == std::vector<int64_t>{250});
  CHECK(bf16_allgather_pieces(1000, 4, 500000000) == std::vector<int64_t>{250});
  // padded to a multiple of 2 dp: 1001 -> 1008
  CHECK(bf16_partition_numel(1001, 4) == 252);
  CHECK(bf16_partition_numel(1001, 1) == 1002);
  CHECK(bf16_optimizer_step_bytes(100, 25, false) == Approx(100 * 8 + 25 * 34));
  CHECK(bf16_optimizer_step_bytes(100, 25, true) == Approx(100 * 16 + 25 * 34));
}

TEST_CASE("BF16_Optimizer: optimizer states sharded over DP at ZeRO-0, the fp32 buffer whole", "[pipeline_engine][bf16_optimizer]") {
  const Scenario ds = bf16_pipeline(PipelineEngine::deepspeed);
  const Scenario mg = bf16_pipeline(PipelineEngine::megatron);
  for (int stage = 0; stage < 3; ++stage) {
    INFO("stage " << stage);
    const double N = stage_parameters(ds, stage).trainable();
    const MemoryBreakdown a = stage_memory(ds, stage), b = stage_memory(mg, stage);
    CHECK(a.optimizer == Approx(12 * N / 2));  // fp32 master, momentum, variance of 1/dp
    CHECK(b.optimizer == Approx(12 * N));
    CHECK(a.grads == Approx((2 + 4) * N));     // bf16 gradients and the whole fp32 buffer
    CHECK(b.grads == Approx(2 * N));           // dssim's engine steps the bf16 gradients in place
    CHECK(b.total() - a.total() == Approx(12 * N * (1 - 1.0 / 2) - 4 * N));
  }
}

TEST_CASE("BF16_Optimizer: only for the deepspeed engine with bf16 at ZeRO-0 and pp > 1", "[pipeline_engine][bf16_optimizer]") {
  const auto check_absent = [](const Scenario& sc) {
    CHECK_FALSE(uses_bf16_optimizer(sc));
    const Program prog = build_program(sc, {});
    for (const RankProgram& rp : prog.ranks) {
      const RankSummary s = summarize(prog, rp);
      CHECK(s.folds == 0);
      CHECK(s.accumulates > 0);
      if (s.emb_sync >= 0) CHECK(s.emb_bytes == Approx(double(sc.model.vocab) * sc.model.hidden * bytes_of(sc.precision.dtype)));
      if (sc.zero.stage == 0) CHECK(s.gather_bytes.empty());
    }
  };
  {
    INFO("megatron engine");
    check_absent(bf16_pipeline(PipelineEngine::megatron));
  }
  {
    INFO("fp16");
    Scenario sc = bf16_pipeline(PipelineEngine::deepspeed);
    sc.precision.dtype = Dtype::fp16;
    check_absent(sc);
  }
  {
    INFO("ZeRO-1 keeps DeepSpeed's ZeRO optimizer model");
    Scenario sc = bf16_pipeline(PipelineEngine::deepspeed);
    sc.zero.stage = 1;
    check_absent(sc);
  }
}
