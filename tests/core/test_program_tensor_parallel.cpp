// The Program builder's Megatron tensor parallelism: the embedding, LM head and cross-entropy
// collectives, sequence parallelism's gradient sums, and the tied embedding's synchronisation.
#include <catch2/catch.hpp>

#include <cmath>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>
#include "core/grid.hpp"
#include "core/memory.hpp"
#include "core/model.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"
#include "core/estimator.hpp"
#include "core/collective_model.hpp"
#include "core/device_model.hpp"
#include "core/report.hpp"
#include "program_test_util.hpp"

using namespace dssim;
using namespace dssim::program_test;
using Catch::Matchers::Contains;

namespace {

using TpKey = std::tuple<Op, double, int>;  // op, bytes, repeat

// The TP collectives on the compute stream that follow compute instructions of `phase` for
// micro-batch `mb` (what the torch engine checks per compute instruction), as one multiset.
std::multiset<TpKey> tp_after(const RankProgram& rp, Op phase, int mb) {
  std::multiset<TpKey> out;
  Op current = Op::OptimizerStep;
  for (const Instruction& in : rp.instructions) {
    if (is_compute(in.op)) current = in.op;
    if (in.purpose != Purpose::TensorParallel || in.stream != Stream::Compute) continue;
    if (current == phase && in.micro_batch == mb) out.insert({in.op, in.bytes, in.repeat});
  }
  return out;
}

// The SP gradient sums (TP all-reduces tied to a bucket): total bytes.
double sp_grad_bytes(const Program& p, const RankProgram& rp) {
  double total = 0;
  for (const Instruction& in : rp.instructions)
    if (in.purpose == Purpose::TensorParallel && in.bucket >= 0) {
      CHECK(in.op == Op::AllReduce);
      CHECK(p.groups[in.group].kind == GroupKind::TP);
      total += in.bytes * in.repeat;
    }
  return total;
}

int micro_batches(const Scenario& sc) {
  if (sc.training.grad_accum > 0) return sc.training.grad_accum;
  return int(sc.training.global_batch / (int64_t(sc.training.micro_batch) * sc.parallel.dp));
}

Scenario load_with(const std::string& name, std::vector<std::string> overrides) {
  LoadOptions o;
  o.overrides = std::move(overrides);
  return load_scenario(name, o);
}

}  // namespace

TEST_CASE("program: Megatron's embedding, LM head and cross-entropy TP collectives", "[program]") {
  for (bool sp : {false, true}) {
    INFO("sequence_parallel " << sp);
    const Scenario sc = load_with("tiny/tiny_tp2", {sp ? "parallel.sequence_parallel=true" : "parallel.tp=2"});
    REQUIRE(sc.parallel.tp == 2);
    const Program p = build_program(sc);
    check_program(p);
    const double b = sc.training.micro_batch, s = sc.model.seq_len, h = sc.model.hidden;
    const double g = bytes_of(sc.precision.dtype), L = sc.model.layers;
    const double act = b * s * h * g, ce = b * s * 4;
    const int layer_runs = 2 * int(L);
    std::multiset<TpKey> fwd, bwd;
    if (!sp) {
      fwd = {{Op::AllReduce, act, 1},                 // vocabulary-parallel embedding
             {Op::AllReduce, act, layer_runs},        // f/g of the blocks
             {Op::AllReduce, ce, 3}};                 // vocab-parallel cross-entropy
      bwd = {{Op::AllReduce, act, layer_runs},
             {Op::AllReduce, act, 1}};                // LM head input gradient
    } else {
      fwd = {{Op::ReduceScatter, act, 1},             // embedding into sequence shards
             {Op::AllGather, act, layer_runs}, {Op::ReduceScatter, act, layer_runs},
             {Op::AllGather, act, 1},                 // final norm output before the LM head
             {Op::AllReduce, ce, 3}};
      bwd = {{Op::AllGather, act, 1},                 // backward of the embedding's reduce-scatter
             {Op::AllGather, act, layer_runs}, {Op::ReduceScatter, act, layer_runs},
             {Op::ReduceScatter, act, 1}};            // LM head input gradient into shards
    }
    const int M = micro_batches(sc);
    for (const RankProgram& rp : p.ranks) {
      INFO("rank " << rp.rank);
      for (int mb = 0; mb < M; ++mb) {
        CHECK(tp_after(rp, Op::Forward, mb) == fwd);
        CHECK(tp_after(rp, Op::Backward, mb) == bwd);
      }
      // SP: the TP group sums the partial gradients of ln1/ln2 (4h), the attention projection and
      // MLP down biases (2h) per layer, the final norm (2h) and the position embedding (s h).
      CHECK(sp_grad_bytes(p, rp) == Approx(sp ? g * (4 * h * L + 2 * h * L + 2 * h + s * h) : 0.0));
      for (const Instruction& in : rp.instructions)
        if (in.purpose == Purpose::TensorParallel && in.bucket >= 0) CHECK(in.micro_batch == M - 1);
    }
  }
  SECTION("full recompute repeats the blocks' collectives only") {
    const Scenario sc = load_with("tiny/tiny_tp2", {"activation_checkpointing=full"});
    REQUIRE(sc.recompute == Recompute::full);
    const Program p = build_program(sc);
    check_program(p);
    const double act = double(sc.training.micro_batch) * sc.model.seq_len * sc.model.hidden *
                       bytes_of(sc.precision.dtype);
    CHECK(tp_after(p.ranks[0], Op::Recompute, 0) == std::multiset<TpKey>{{Op::AllReduce, act, 2 * sc.model.layers}});
  }
}

TEST_CASE("program: SP gradient sums cover every bucket and precede its reduction", "[program]") {
  for (int zero_stage = 0; zero_stage <= 3; ++zero_stage) {
    for (int dp : {1, 2}) {
      INFO("zero " << zero_stage << " dp " << dp);
      Scenario sc = tiny(2, 1, dp, zero_stage);
      sc.parallel.sequence_parallel = true;
      sc.zero.reduce_bucket_size = 3000;  // splits layers: some buckets hold no SP tensor
      const Program p = build_program(sc);
      check_program(p);
      const double s = 32, h = 64, L = 4, g = 2, M = 4;
      const double per_step = g * (6 * h * L + 2 * h + s * h);
      for (const RankProgram& rp : p.ranks) {
        // Stages 0/1 reduce once per step, 2/3 every micro-batch.
        CHECK(sp_grad_bytes(p, rp) == Approx(zero_stage >= 2 ? M * per_step : per_step));
        for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
          const Instruction& in = rp.instructions[i];
          if (in.purpose == Purpose::TensorParallel && in.bucket >= 0) {
            CHECK(in.stream == Stream::DpComm);  // overlap_comm: the reduction's stream
            CHECK(in.bytes > 0);
            CHECK(in.deps_count == 1);
            CHECK(rp.instructions[rp.deps[in.deps_begin]].stream == Stream::Compute);  // the backward (+ its TP)
          }
          if (in.purpose != Purpose::GradientReduce) continue;
          // Its bucket's SP sum, if any, is the previous instruction and the reduction waits for it.
          const Instruction& prev = rp.instructions[i - 1];
          if (prev.purpose == Purpose::TensorParallel) {
            CHECK(prev.bucket == in.bucket);
            bool waits = false;
            for (uint32_t d = 0; d < in.deps_count; ++d) waits |= rp.deps[in.deps_begin + d] == i - 1;
            CHECK(waits);
          }
        }
      }
    }
  }
}

TEST_CASE("program: tied embedding sync precedes the reduction of the embedding's buckets", "[program]") {
  for (const std::string name : {"tiny/tiny_pp3", "tiny/tiny_interleave"}) {
    for (const std::string bucket : {"zero.reduce_bucket_size=500000000", "zero.reduce_bucket_size=20000"}) {
      for (const std::string overlap : {"zero.overlap_comm=true", "zero.overlap_comm=false"}) {
        INFO(name << " " << bucket << " " << overlap);
        const Scenario sc = load_with(name, {"parallel.dp=2", name == "tiny/tiny_pp3" ? "cluster.gpus_per_node=6" : "cluster.gpus_per_node=4",
                                          bucket, overlap});
        REQUIRE(sc.parallel.dp == 2);
        REQUIRE(sc.model.tied_embeddings);
        const Program p = build_program(sc);
        check_program(p);
        const ProcessGrid grid(sc.parallel);
        const int pp = sc.parallel.pp;
        const double g = bytes_of(sc.precision.dtype), h = sc.model.hidden;
        bool some_before = false;
        for (const RankProgram& rp : p.ranks) {
          const int stage = grid.coord(rp.rank).pp;
          INFO("rank " << rp.rank << " stage " << stage);
          int sync = -1, max_bucket = -1;
          double reduced = 0;
          for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
            const Instruction& in = rp.instructions[i];
            if (in.purpose == Purpose::EmbeddingSync) sync = int(i);
            if (in.purpose == Purpose::GradientReduce) {
              reduced += in.bytes;
              max_bucket = std::max(max_bucket, in.bucket);
            }
          }
          // Stage 0/1 all-reduce: every parameter of the stage once (no padding), reordered or not.
          const double layers = double(sc.model.layers) / pp;
          double params = layers * dense_layer_params(sc.model);
          if (stage == 0) params += double(sc.model.vocab) * h + double(sc.model.seq_len) * h;
          if (stage == pp - 1) params += 2 * h + double(sc.model.vocab) * h;
          CHECK(reduced == Approx(g * params));
          if (stage != 0 && stage != pp - 1) {
            CHECK(sync < 0);
            continue;
          }
          REQUIRE(sync >= 0);
          // The bucket holding the word embedding (stage 0: the first tensor, the last bucket) or
          // its tied copy (last stage: the last tensor, bucket 0) is reduced after the sync and
          // waits for it; the other buckets are not held back.
          const int tied_bucket = stage == 0 ? max_bucket : 0;
          int found = 0;
          for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
            const Instruction& in = rp.instructions[i];
            if (in.purpose != Purpose::GradientReduce) continue;
            if (in.bucket == tied_bucket) {
              ++found;
              CHECK(int(i) > sync);
              CHECK(in.micro_batch == micro_batches(sc) - 1);
              bool waits = false;
              for (uint32_t d = 0; d < in.deps_count; ++d) waits |= int(rp.deps[in.deps_begin + d]) == sync;
              CHECK(waits);
            } else if (int(i) < sync) {
              some_before = true;
            }
          }
          CHECK(found == 1);
          // The optimizer step waits for the last reduction, which comes after the sync.
          for (uint32_t i = 0; i < rp.instructions.size(); ++i)
            if (rp.instructions[i].op == Op::OptimizerStep) CHECK(int(i) > sync);
        }
        if (bucket.find("20000") != std::string::npos) CHECK(some_before);
      }
    }
  }
}
