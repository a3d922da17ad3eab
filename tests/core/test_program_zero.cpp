// The Program builder's ZeRO stages: their collectives' bytes, DeepSpeed's bucket and prefetch
// keys, communication_data_type, ZeRO++ (qwZ, qgZ, hpZ), the optimizer step's bytes and ZeRO-3's
// gradient fold.
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

TEST_CASE("program: ZeRO-2 reduce-scatters every micro-step, ZeRO-1 once - both gather params", "[program]") {
  for (int stage : {1, 2}) {
    Scenario sc = tiny(1, 1, 4, stage);
    const Program p = build_program(sc);
    check_program(p);
    const double psi = parameter_count(sc.model);  // divisible by 8: no padding here
    REQUIRE(std::fmod(psi, 8) == 0);
    const RankProgram& rp = p.ranks[1];
    const int steps = stage == 2 ? 4 : 1;
    CHECK(wire(p, rp, Purpose::GradientReduce) == Approx(steps * psi * 2 * 3 / 4));
    CHECK(wire(p, rp, Purpose::ParamGather) == Approx(psi * 2 * 3 / 4));
    CHECK(count(rp, Op::OptimizerStep) == 1);
    for (const Instruction& in : rp.instructions)
      if (in.op == Op::OptimizerStep) CHECK(in.flops == Approx(psi / 4 * 16));
  }
}

TEST_CASE("program: ZeRO-3 moves 3 psi per micro-batch (2 all-gathers + 1 reduce-scatter)", "[program]") {
  Scenario sc = tiny(1, 1, 4, 3);
  const Program p = build_program(sc);
  check_program(p);
  const double psi = parameter_count(sc.model);
  for (const RankProgram& rp : p.ranks) {
    double volume = 0;
    int gathers = 0;
    for (const Instruction& in : rp.instructions) {
      if (in.op == Op::AllGather || in.op == Op::ReduceScatter) volume += in.bytes * in.repeat;
      if (in.op == Op::AllGather) ++gathers;
    }
    CHECK(volume == Approx(3 * 4 * psi * 2));
    CHECK(gathers == 2 * 4 * sc.model.layers);  // per layer, forward and backward, 4 micro-batches
    CHECK(count(rp, Op::Forward) == 4 * sc.model.layers);
    // Each forward waits for its layer's gather.
    for (const Instruction& in : rp.instructions)
      if (in.op == Op::Forward) {
        bool waits_gather = false;
        for (uint32_t d = 0; d < in.deps_count; ++d)
          waits_gather |= rp.instructions[rp.deps[in.deps_begin + d]].op == Op::AllGather;
        CHECK(waits_gather);
      }
  }
  sc.zero.offload_param = true;
  sc.zero.offload_optimizer = true;
  const Program q = build_program(sc);
  check_program(q);
  CHECK(count(q.ranks[0], Op::HostOptimizerStep) == 1);
  CHECK(count(q.ranks[0], Op::OptimizerStep) == 0);
  CHECK(count(q.ranks[0], Op::CopyH2D) == 2 * 4 * sc.model.layers + 1);
  CHECK(count(q.ranks[0], Op::CopyD2H) == 4 * sc.model.layers);
}

TEST_CASE("program: stage3_prefetch_bucket_size 0 turns ZeRO-3 prefetching off", "[program][deepspeed]") {
  // Gathers issued before the first forward compute: the first layer's alone without prefetching,
  // more with DeepSpeed's default 5e7 (the whole tiny model fits in the window).
  auto gathers_before_first_forward = [](const Program& p) {
    int n = 0;
    for (const Instruction& in : p.ranks[0].instructions) {
      if (in.op == Op::Forward) break;
      n += in.op == Op::AllGather && in.purpose == Purpose::ParamGather;
    }
    return n;
  };
  Scenario sc = tiny(1, 1, 2, 3);
  const Program with = build_program(sc);
  sc.zero.prefetch_bucket_size = 0;
  const Program without = build_program(sc);
  check_program(without);
  CHECK(gathers_before_first_forward(without) == 1);
  CHECK(gathers_before_first_forward(with) > 1);
  // the same bytes are gathered either way
  CHECK(wire(without, without.ranks[0], Purpose::ParamGather) == Approx(wire(with, with.ranks[0], Purpose::ParamGather)));
}

TEST_CASE("program: zero bucket sizes (DeepSpeed's ge=0) build without dividing by zero", "[program][deepspeed]") {
  for (int stage : {1, 2, 3}) {
    Scenario sc = tiny(1, 1, 2, stage);
    sc.zero.reduce_bucket_size = 0;
    sc.zero.allgather_bucket_size = 0;
    sc.zero.max_live_parameters = 0;
    const Program p = build_program(sc);
    check_program(p);
    const double psi = parameter_count(sc.model);
    if (stage < 3) CHECK(wire(p, p.ranks[0], Purpose::ParamGather) == Approx(psi * 2 / 2).epsilon(0.01));
  }
}

// ---- communication_data_type and ZeRO++ (issue 19) ----

namespace {
// dp 8 over 2 nodes of 4 GPUs: qgZ's intra-node level has 4 ranks, its inter-node level 2.
Scenario zpp(bool qwz, bool qgz, int hpz) {
  Scenario sc = tiny(1, 1, 8, 3);
  sc.cluster.nodes = 2;
  sc.cluster.gpus_per_node = 4;
  sc.zero.quantized_weights = qwz;
  sc.zero.quantized_gradients = qgz;
  sc.zero.hpz_partition_size = hpz;
  return sc;
}
std::vector<const Instruction*> of(const RankProgram& rp, Op op, Purpose pu) {
  std::vector<const Instruction*> v;
  for (const Instruction& in : rp.instructions)
    if (in.op == op && in.purpose == pu) v.push_back(&in);
  return v;
}
}  // namespace

TEST_CASE("program: communication_data_type sets the bytes of the DP gradient reduction", "[program][deepspeed]") {
  for (int stage : {0, 2, 3}) {
    Scenario sc = tiny(1, 1, 4, stage);
    const Program base = build_program(sc);
    sc.precision.communication_dtype = Dtype::fp32;
    const Program p = build_program(sc);
    check_program(p);
    INFO("stage " << stage);
    // bf16 compute, fp32 on the wire: twice the bytes, nothing else changes
    CHECK(wire(p, p.ranks[1], Purpose::GradientReduce) == Approx(2 * wire(base, base.ranks[1], Purpose::GradientReduce)));
    CHECK(wire(p, p.ranks[1], Purpose::ParamGather) == Approx(wire(base, base.ranks[1], Purpose::ParamGather)));
    if (stage == 2) {
      const double psi = parameter_count(sc.model);
      CHECK(wire(p, p.ranks[1], Purpose::GradientReduce) == Approx(4 * psi * 4 * 3 / 4));  // 4 micro-steps, 4 B
    }
    sc.precision.communication_dtype = Dtype::bf16;  // = the compute dtype: the default
    const Program same = build_program(sc);
    CHECK(wire(same, same.ranks[1], Purpose::GradientReduce) == Approx(wire(base, base.ranks[1], Purpose::GradientReduce)));
  }
}

TEST_CASE("program: ZeRO++ qwZ gathers int8 weights plus one fp32 scale per 8000-element block", "[program][zeropp]") {
  const Program base = build_program(zpp(false, false, 1));
  const Program p = build_program(zpp(true, false, 1));
  check_program(p);
  for (int r : {0, 5}) {
    const auto b = of(base.ranks[r], Op::AllGather, Purpose::ParamGather);
    const auto q = of(p.ranks[r], Op::AllGather, Purpose::ParamGather);
    REQUIRE(b.size() == q.size());
    REQUIRE(!b.empty());
    for (size_t i = 0; i < b.size(); ++i) {
      const double shard = b[i]->bytes / 2 / 8;  // bf16, 8 ranks
      CHECK(q[i]->group == b[i]->group);
      CHECK(q[i]->bytes == Approx((shard + 4 * std::ceil(shard / 8000)) * 8));
      CHECK(q[i]->bytes < 0.51 * b[i]->bytes);
    }
    // gradients untouched
    CHECK(wire(p, p.ranks[r], Purpose::GradientReduce) == Approx(wire(base, base.ranks[r], Purpose::GradientReduce)));
  }
}

TEST_CASE("program: ZeRO++ qgZ replaces the reduce-scatter by int4 all-to-alls within then across nodes", "[program][zeropp]") {
  const Program base = build_program(zpp(false, false, 1));
  const Program p = build_program(zpp(false, true, 1));
  check_program(p);
  for (int r : {0, 6}) {
    const auto rs = of(base.ranks[r], Op::ReduceScatter, Purpose::GradientReduce);
    const auto a2a = of(p.ranks[r], Op::AllToAll, Purpose::GradientReduce);
    REQUIRE(!rs.empty());
    CHECK(of(p.ranks[r], Op::ReduceScatter, Purpose::GradientReduce).empty());
    REQUIRE(a2a.size() == 2 * rs.size());
    for (size_t i = 0; i < rs.size(); ++i) {
      const double elems = rs[i]->bytes / 2;
      const Instruction& intra = *a2a[2 * i];
      const Instruction& inter = *a2a[2 * i + 1];
      CHECK(intra.bytes == Approx(elems * 0.5));     // int4 of the whole bucket, 4 ranks of the node
      CHECK(inter.bytes == Approx(elems * 0.5 / 4));  // int4 of the node's quarter, across 2 nodes
      const Group& gi = p.groups[intra.group];
      const Group& ge = p.groups[inter.group];
      CHECK(gi.kind == GroupKind::DPIntra);
      CHECK(gi.ranks == std::vector<int>{r / 4 * 4, r / 4 * 4 + 1, r / 4 * 4 + 2, r / 4 * 4 + 3});
      CHECK(ge.kind == GroupKind::DPInter);
      CHECK(ge.ranks == std::vector<int>{r % 4, r % 4 + 4});
    }
    // on the wire: 3/4 * N/2 over NVLink, 1/2 * N/8 across nodes, vs 7/8 * 2N for the reduce-scatter
    const double n = rs.size() ? [&] { double s = 0; for (auto* in : rs) s += in->bytes * in->repeat / 2; return s; }() : 0;
    CHECK(wire(p, p.ranks[r], Purpose::GradientReduce) == Approx(0.75 * n * 0.5 + 0.5 * n * 0.5 / 4));
    CHECK(wire(base, base.ranks[r], Purpose::GradientReduce) == Approx(7.0 / 8 * 2 * n));
  }
}

TEST_CASE("program: ZeRO++ hpZ gathers the backward's parameters within the node", "[program][zeropp]") {
  const Program base = build_program(zpp(false, false, 1));
  const Program p = build_program(zpp(false, false, 4));
  check_program(p);
  const Scenario sc = zpp(false, false, 4);
  const RankProgram& rp = p.ranks[5];
  const auto b = of(base.ranks[5], Op::AllGather, Purpose::ParamGather);
  const auto g = of(rp, Op::AllGather, Purpose::ParamGather);
  REQUIRE(b.size() == g.size());
  int intra = 0, full = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const Group& grp = p.groups[g[i]->group];
    if (grp.kind == GroupKind::DPIntra) {
      ++intra;
      CHECK(grp.ranks == std::vector<int>{4, 5, 6, 7});  // rank 5's node
      for (int m : grp.ranks) CHECK(m / sc.cluster.gpus_per_node == 5 / sc.cluster.gpus_per_node);
      // the secondary shard is ceil(numel / 4) per rank: the same layer, padded to 4 ranks
      CHECK(g[i]->bytes <= b[i]->bytes);
      CHECK(g[i]->bytes >= b[i]->bytes - 2.0 * 8 * 8);
    } else {
      ++full;
      CHECK(grp.kind == GroupKind::DP);
      CHECK(g[i]->bytes == b[i]->bytes);
    }
  }
  CHECK(intra == full);  // forward gathers over the DP group, backward ones within the node
  CHECK(intra == 4 * sc.model.layers);
  // with qwZ too, the secondary gathers are quantized as well
  const Program q = build_program(zpp(true, true, 4));
  check_program(q);
  const auto qg = of(q.ranks[5], Op::AllGather, Purpose::ParamGather);
  REQUIRE(qg.size() == g.size());
  for (size_t i = 0; i < qg.size(); ++i) {
    CHECK(qg[i]->group == g[i]->group);
    const double shard = g[i]->bytes / 2 / p.groups[g[i]->group].ranks.size();
    CHECK(qg[i]->bytes == Approx((shard + 4 * std::ceil(shard / 8000)) * p.groups[g[i]->group].ranks.size()));
  }
}

TEST_CASE("program: ZeRO++ stage representatives carry every rank's sub-groups", "[program][zeropp]") {
  BuildOptions o;
  o.representative_only = true;
  const Program p = build_program(zpp(true, true, 4), o);
  int intra = 0, inter = 0;
  for (const Group& g : p.groups) {
    intra += g.kind == GroupKind::DPIntra;
    inter += g.kind == GroupKind::DPInter;
  }
  CHECK(intra == 2);  // nodes 0 and 1 (hpZ's 4 = qgZ's node-local 4: the same groups)
  CHECK(inter == 4);  // one per position in the node
}

// The first OptimizerStep's HBM bytes per model parameter of sc's Program (rank 0).
static double step_bytes_per_param(const Scenario& sc) {
  const Program p = build_program(sc);
  for (const Instruction& in : p.ranks[0].instructions)
    if (in.op == Op::OptimizerStep) return in.memory_bytes / parameter_count(sc.model);
  return 0.0;
}

// Issue 15: the OptimizerStep's HBM bytes are those of the engine's one-pass step
// (backends/torch/optimizer_kernels.hpp fused_adamw_step): the gradient read and cleared where it
// lies (g-byte buckets at stages 0-2 and stage 3's partition; an fp32 partition with
// zero.grad_accum_dtype: fp32), master and moments read and written (24), the g-byte copy written;
// the global norm, when needed, reads the gradient once more.
TEST_CASE("OptimizerStep bytes per parameter: the engine's fused step", "[program]") {
  for (bool fp32_partition : {false, true})
    for (int stage = 0; stage <= 3; ++stage) {
      INFO("stage " << stage << (fp32_partition ? ", grad_accum_dtype fp32" : ""));
      Scenario sc = tiny(1, 1, 1, stage);
      sc.zero.grad_accum_fp32 = fp32_partition;  // stage 3's partition only
      const bool acc = stage == 3 && fp32_partition;
      const double in_place = 24 + 2 + 2 * 2, acc32 = 24 + 2 + 2 * 4;  // 30, 34
      CHECK(step_bytes_per_param(sc) == Approx(acc ? acc32 : in_place).epsilon(1e-6));
      sc.training.gradient_clipping = 1.0;  // the norm reads the gradient once
      CHECK(step_bytes_per_param(sc) == Approx(acc ? acc32 + 4 : in_place + 2).epsilon(1e-6));
      sc.training.gradient_clipping = 0;
      sc.precision.dtype = Dtype::fp16;  // the overflow check's norm
      CHECK(step_bytes_per_param(sc) == Approx(acc ? acc32 + 4 : in_place + 2).epsilon(1e-6));
      sc.precision.dtype = Dtype::fp32;  // fp32 "16-bit" copy and gradients: 24 + 4 + 2 x 4
      CHECK(step_bytes_per_param(sc) == Approx(36).epsilon(1e-6));
    }
  // MoE at stage 1 keeps the fp32 accumulator: the fold at the step (2 x 2 + 8) and a 34-byte step.
  Scenario moe = tiny(1, 1, 1, 1);
  moe.model.experts = 4;
  moe.model.moe_every = 2;
  CHECK(step_bytes_per_param(moe) == Approx(12 + 34).epsilon(1e-6));
}

// optimizer.fused_step: false prices the step before issue 15 (the fold into an fp32 buffer, AdamW
// over it, its clear, the copy: 2g + 8 + 28 + 4 + 4 + g = 50 bytes with bf16; stage 3 folds in its
// backward: 38), the norm reading fp32 and the rescale pass when fp16 or clipping need them (+12),
// and the fp32 buffer at stages 0/1 (core/memory.cpp).
TEST_CASE("optimizer.fused_step false: the step before issue 15, its bytes and its fp32 buffer", "[program][memory]") {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    Scenario sc = tiny(1, 1, 1, stage);
    sc.optimizer.fused_step = false;
    CHECK_FALSE(steps_gradient_buckets_in_place(sc));
    CHECK(step_bytes_per_param(sc) == Approx(stage < 3 ? 50 : 38).epsilon(1e-6));
    sc.training.gradient_clipping = 1.0;
    CHECK(step_bytes_per_param(sc) == Approx(stage < 3 ? 62 : 50).epsilon(1e-6));
    sc.training.gradient_clipping = 0;
    Scenario fused = sc;
    fused.optimizer.fused_step = true;
    const MemoryBreakdown a = peak_memory(sc), b = peak_memory(fused);
    const double psi = parameter_count(sc.model);
    // Stages 0/1: the fp32 buffer of the (one-rank) shard; stage 2: the step's fp32 copy of the
    // partition, a transient (counted where it exceeds the activations); stage 3: the same.
    if (stage <= 1) CHECK(a.grads - b.grads == Approx(4 * psi).epsilon(1e-6));
    else CHECK(a.grads == Approx(b.grads));
    if (stage == 3) CHECK(a.total() == Approx(b.total()));
  }
}

// ZeRO-3 folds each layer group's 16-bit gradients into its gradient partition in the backward
// (core/stage_plan.cpp): zero-fill, read, and the partition read and written, g bytes each in the
// training dtype (DeepSpeed's default), 2g + 8 with an fp32 partition (zero.grad_accum_dtype:
// fp32), 3g when the partition is the host's (offload: zero-fill, read, the copy written).
namespace {
double zero3_fold_bytes(const Scenario& sc) {
  const Program p = build_program(sc);
  double bytes = 0;
  for (const auto& ops : p.op_lists)
    for (const LayerOp& op : ops)
      if (op.name == "zero3_gradient_fold") bytes += op.memory_bytes;
  return bytes;
}
}  // namespace

TEST_CASE("ZeRO-3 gradient fold: bytes per parameter by the partition's dtype", "[program]") {
  for (int dp : {1, 2}) {
    INFO("dp " << dp);
    Scenario sc = tiny(1, 1, dp, 3);
    sc.zero.grad_accum_fp32 = true;  // an fp32 partition is folded into on one rank too
    const double fp32 = zero3_fold_bytes(sc);
    REQUIRE(fp32 > 0);
    sc.zero.grad_accum_fp32 = false;
    sc.zero.offload_optimizer = true;
    CHECK(zero3_fold_bytes(sc) / fp32 == Approx(3.0 * 2 / (2.0 * 2 + 8)));  // bf16: 6 against 12 bytes
    sc.zero.offload_optimizer = false;
    if (dp > 1) CHECK(zero3_fold_bytes(sc) / fp32 == Approx(4.0 * 2 / (2.0 * 2 + 8)));  // 8 against 12
  }
}

// On one rank with the partition in the training dtype the engine's backward accumulates into the
// partition (core/memory.hpp zero3_backward_into_partition): no fold, and no layer group's 16-bit
// gradients besides it during the backward.
TEST_CASE("ZeRO-3 on one rank: backward into the partition, no fold", "[program][memory]") {
  Scenario one = tiny(1, 1, 1, 3);
  CHECK(zero3_backward_into_partition(one));
  CHECK(zero3_fold_bytes(one) == 0);
  Scenario two = tiny(1, 1, 2, 3);
  CHECK_FALSE(zero3_backward_into_partition(two));
  CHECK(zero3_fold_bytes(two) > 0);
  // Where the partition cannot take the leaves' gradients, the fold stays.
  for (int c = 0; c < 4; ++c) {
    INFO("case " << c);
    Scenario sc = one;
    if (c == 0) sc.zero.grad_accum_fp32 = true;  // fp32 partition, 16-bit leaves
    if (c == 1) sc.zero.offload_optimizer = true;
    if (c == 2) sc.zero.offload_param = true;
    if (c == 3) sc.parallel.tp = 2, sc.parallel.sequence_parallel = true;
    CHECK_FALSE(zero3_backward_into_partition(sc));
    CHECK(zero3_fold_bytes(sc) > 0);
  }
  for (int stage = 0; stage <= 2; ++stage) CHECK_FALSE(zero3_backward_into_partition(tiny(1, 1, 1, stage)));
  // Memory: the fold's transient 16-bit gradients (the largest module, here the word embedding,
  // and two layers) are gone.
  Scenario folded = one;
  folded.zero.grad_accum_fp32 = true;
  const MemoryBreakdown d = peak_memory(one), f = peak_memory(folded);
  const double layer = dense_layer_params(one.model), embedding = double(one.model.vocab) * one.model.hidden;
  CHECK(f.grads - d.grads == Approx(2.0 * parameter_count(one.model)));  // fp32 against bf16 partition
  CHECK(f.temporaries - d.temporaries == Approx(2.0 * (embedding + 2 * layer)));
}
