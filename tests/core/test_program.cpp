// The Program builder (core/program_builder.hpp): the test interpreter, instruction lists, data-,
// tensor- and pipeline-parallel bytes against their closed forms, strategy combinations, Llama
// shapes, chain collapsing and the stage-plan cache. ZeRO and ZeRO++: test_program_zero.cpp;
// Megatron's TP / SP collectives: test_program_tensor_parallel.cpp.
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

TEST_CASE("program: the test interpreter detects deadlocks", "[program]") {
  // Two ranks that both receive before sending on one stream: a rendezvous deadlock.
  Program p;
  p.world = 2;
  p.ranks.resize(2);
  for (int r = 0; r < 2; ++r) {
    p.ranks[r].rank = r;
    Instruction recv{};
    recv.op = Op::Recv; recv.stream = Stream::PpComm; recv.peer = 1 - r; recv.tag = 1 - r;
    Instruction send{};
    send.op = Op::Send; send.stream = Stream::PpComm; send.peer = 1 - r; send.tag = r;
    p.ranks[r].add(recv);
    p.ranks[r].add(send);
  }
  CHECK_FALSE(runs_to_completion(p));
  std::swap(p.ranks[0].instructions[0], p.ranks[0].instructions[1]);
  CHECK(runs_to_completion(p));
  // Collectives of two groups in opposite orders on two ranks.
  Program q;
  q.world = 2;
  q.groups = {{GroupKind::DP, {0, 1}}, {GroupKind::TP, {0, 1}}};
  q.ranks.resize(2);
  for (int r = 0; r < 2; ++r) {
    q.ranks[r].rank = r;
    for (int k = 0; k < 2; ++k) {
      Instruction in{};
      in.op = Op::AllReduce; in.stream = Stream::Compute; in.group = r == 0 ? k : 1 - k;
      q.ranks[r].add(in);
    }
  }
  CHECK_FALSE(runs_to_completion(q));
}

TEST_CASE("program: tiny pipeline has the expected instructions", "[program]") {
  Scenario sc = tiny(1, 2, 1, 0);
  sc.zero.overlap_comm = false;
  const Program p = build_program(sc);
  check_program(p);
  for (int r = 0; r < 2; ++r) {
    const RankProgram& rp = p.ranks[r];
    INFO("rank " << r);
    CHECK(count(rp, Op::Forward) == 4);
    CHECK(count(rp, Op::Backward) == 4);
    CHECK(count(rp, Op::Recompute) == 0);
    CHECK(count(rp, Op::Send) == 4);
    CHECK(count(rp, Op::Recv) == 4);
    CHECK(count(rp, Op::AllReduce) == 1);  // tied embedding sync; dp = tp = 1: nothing else
    CHECK(count(rp, Op::OptimizerStep) == 1);
    CHECK(rp.instructions.size() == 18);
  }
  const RankProgram& s0 = p.ranks[0];
  CHECK(s0.instructions[0].op == Op::Forward);
  CHECK(s0.instructions[0].micro_batch == 0);
  CHECK(s0.instructions[1].op == Op::Send);
  CHECK(s0.instructions[1].stream == Stream::PpComm);
  CHECK(s0.instructions[1].purpose == Purpose::PipelineActivation);
  CHECK(s0.deps[s0.instructions[1].deps_begin] == 0);  // the send waits for its forward
  const RankProgram& s1 = p.ranks[1];
  CHECK(s1.instructions[0].op == Op::Recv);
  CHECK(s1.instructions[1].op == Op::Forward);
  CHECK(s1.instructions[1].deps_count == 1);
  CHECK(s1.deps[s1.instructions[1].deps_begin] == 0);  // the forward waits for its activation
  // Embedding on stage 0, head + loss on stage 1, in the kernel lists.
  const auto has = [&](int ops, const std::string& name) {
    for (const LayerOp& o : p.op_lists[ops]) if (o.name.find(name) != std::string::npos) return true;
    return false;
  };
  const int f0 = s0.instructions[0].ops, f1 = s1.instructions[1].ops;
  CHECK(s0.instructions[0].layer_begin == 0);
  CHECK(s0.instructions[0].layer_count == 2);
  CHECK(s1.instructions[1].layer_begin == 2);
  CHECK(has(f0, "embedding_lookup"));
  CHECK(!has(f0, "logits"));
  CHECK(has(f1, "logits"));
  CHECK(!has(f1, "embedding_lookup"));
  const OpsCost fc = sum_cost(p.op_lists[f0]);
  CHECK(s0.instructions[0].flops == Approx(fc.flops));
  CHECK(s0.instructions[0].gemm_flops == Approx(fc.gemm_flops));
}

TEST_CASE("program: DP all-reduce volume is 2 psi (N-1)/N per rank", "[program]") {
  Scenario sc = tiny(1, 1, 4, 0);
  const Program p = build_program(sc);
  check_program(p);
  const double psi_bytes = parameter_count(sc.model) * 2;
  for (const RankProgram& rp : p.ranks) {
    CHECK(wire(p, rp, Purpose::GradientReduce) == Approx(2 * psi_bytes * 3 / 4));
    CHECK(count(rp, Op::AllReduce) > 3);  // bucketed
    for (const Instruction& in : rp.instructions)
      if (in.op == Op::AllReduce) {
        // DeepSpeed never splits a tensor: only a lone tensor (the 512 x 64 embedding) exceeds it.
        CHECK(in.bytes <= 2.0 * std::max<double>(sc.zero.reduce_bucket_size, 512 * 64));
        CHECK(in.micro_batch == 3);  // at the accumulation boundary
      }
  }
}

TEST_CASE("program: TP and PP bytes match the closed forms", "[program]") {
  for (bool sp : {false, true}) {
    Scenario sc = tiny(4, 2, 2, 1);
    sc.parallel.sequence_parallel = sp;
    const Program p = build_program(sc);
    check_program(p);
    const double b = 2, s = 32, h = 64, t = 4, M = 4, g = 2;
    const int layers_per_stage = 2;
    for (const RankProgram& rp : p.ranks) {
      INFO("rank " << rp.rank << " sp " << sp);
      // Megatron: 2 all-reduces forward + 2 backward per layer of b s h 16-bit values:
      // 4 * 2 (t-1)/t * 2bsh = 8 b s h (t-1)/t elements = 16 b s h (t-1)/t bytes per layer per
      // micro-batch; SP's all-gather + reduce-scatter pairs move the same.
      const int stage = rp.rank / 8;
      const double act_bytes = b * s * h * g, ar = 2 * (t - 1) / t;
      double expected = layers_per_stage * M * 8 * b * s * h * g * (t - 1) / t;
      // Embedding (stage 0): all-reduce forward, or SP's reduce-scatter forward + all-gather
      // backward; head (stage 1): SP all-gather, 3 fp32 [b, s] all-reduces of the loss forward,
      // and the input-gradient all-reduce (SP: reduce-scatter) backward. Both ways the same wire.
      if (stage == 0) expected += M * act_bytes * ar;
      else expected += M * (act_bytes * ar + 3 * ar * b * s * 4);
      // SP: once per step (ZeRO-1), the TP sum of the layer norms', row-parallel biases' and
      // position embedding's partial gradients.
      if (sp) expected += ar * g * (layers_per_stage * 6 * h + (stage == 0 ? s * h : 2 * h));
      CHECK(wire(p, rp, Purpose::TensorParallel) == Approx(expected));
      double act = 0, grad = 0;
      for (const Instruction& in : rp.instructions) {
        if (in.op != Op::Send) continue;
        (in.purpose == Purpose::PipelineActivation ? act : grad) += in.bytes;
      }
      const double per = sp ? b * s * h * g / t : b * s * h * g;
      CHECK(act == Approx(stage == 0 ? M * per : 0));
      CHECK(grad == Approx(stage == 1 ? M * per : 0));
    }
  }
}

TEST_CASE("program: recompute, overlap split, interleaving, MoE, 1-bit, offload stay consistent", "[program]") {
  SECTION("full recompute repeats the forward's TP all-reduces") {
    Scenario sc = tiny(2, 2, 2, 1);
    sc.recompute = Recompute::full;
    const Program p = build_program(sc);
    check_program(p);
    CHECK(count(p.ranks[0], Op::Recompute) >= 4);
    const double b = 2, s = 32, h = 64, t = 2, M = 4, g = 2;
    // + the embedding's forward all-reduce (stage 0), which the recompute does not repeat
    CHECK(wire(p, p.ranks[0], Purpose::TensorParallel) ==
          Approx(2 * M * 12 * b * s * h * g * (t - 1) / t + M * 2 * (t - 1) / t * b * s * h * g));
  }
  SECTION("overlap_comm splits the last backward where buckets close") {
    Scenario sc = tiny(1, 1, 2, 1);
    const Program p = build_program(sc);
    check_program(p);
    const RankProgram& rp = p.ranks[0];
    CHECK(count(rp, Op::Backward) > 4);
    // The first reduce-scatter waits for a backward that is not the last one.
    uint32_t last_bwd = 0, first_rs = 0;
    for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
      if (rp.instructions[i].op == Op::Backward) last_bwd = i;
      if (rp.instructions[i].op == Op::ReduceScatter && first_rs == 0) first_rs = i;
    }
    CHECK(first_rs < last_bwd);
    CHECK(rp.instructions[first_rs].stream == Stream::DpComm);
  }
  SECTION("interleaved 1F1B") {
    Scenario sc = tiny(1, 2, 2, 2);
    sc.model.layers = 8;
    sc.parallel.interleave = 2;
    const Program p = build_program(sc);
    check_program(p);
    CHECK(count(p.ranks[0], Op::Forward) == 8);
    CHECK(count(p.ranks[0], Op::Send) == 8 + 4);  // activations of both chunks, grads of chunk 1
    sc.training.grad_accum = 3;
    CHECK_THROWS_AS(build_program(sc), std::invalid_argument);
  }
  SECTION("MoE all-to-all in the EP group, experts reduced in the expert-DP group") {
    Scenario sc = tiny(2, 1, 4, 2);
    sc.model.experts = 4;
    sc.model.moe_every = 2;
    sc.parallel.ep = 2;
    const Program p = build_program(sc);
    check_program(p);
    int a2a = 0;
    bool expert_dp = false;
    for (const Instruction& in : p.ranks[0].instructions) {
      if (in.op == Op::AllToAll) {
        a2a += in.repeat;
        CHECK(p.groups[in.group].kind == GroupKind::EP);
      }
      if (in.purpose == Purpose::GradientReduce && p.groups[in.group].kind == GroupKind::ExpertDP)
        expert_dp = true;
    }
    CHECK(a2a == 2 * 4 * 4);  // 2 MoE layers x 4 micro-batches x (dispatch + combine) x fwd/bwd
    CHECK(expert_dp);
    // Bytes per all-to-all: DeepSpeed's dispatch buffer [experts, capacity, h] of the rank's b s
    // tokens, capacity max(ceil(k T / E x capacity_factor), min_capacity)
    const auto a2a_bytes = [&](const Scenario& s) {
      const Program prog = build_program(s);
      for (const Instruction& in : prog.ranks[0].instructions)
        if (in.op == Op::AllToAll) return in.bytes;
      return 0.0;
    };
    // (split over the TP group of 2: DeepSpeed drops the TP-duplicate tokens)
    const double T = double(sc.training.micro_batch) * sc.model.seq_len, h = sc.model.hidden, g = 2.0 / 2;  // bf16 / tp
    REQUIRE(sc.model.expert_capacity(int64_t(T)) == int64_t(std::ceil(T / 4 * sc.model.capacity_factor)));
    CHECK(a2a_bytes(sc) == 4 * std::ceil(T / 4 * sc.model.capacity_factor) * h * g);
    Scenario c = sc;
    c.model.capacity_factor = 1.3;
    c.model.top_k = 2;
    CHECK(a2a_bytes(c) == 4 * std::ceil(T / 4 * 1.3 * 2) * h * g);
    c.model.min_capacity = int(T);  // the floor wins
    CHECK(a2a_bytes(c) == 4 * T * h * g);
    c.model.drop_tokens = false;  // run-time capacity: priced as k x capacity_factor slots per token
    CHECK(a2a_bytes(c) == Approx(T * 2 * 1.3 * h * g));
  }
  SECTION("MoE with tp > 1: DeepSpeed's token drop / gather over the TP group, experts reduced with the TP peers") {
    // tp 2 x dp 2, 4 layers, MoE every other layer (layers 1 and 3), 4 micro-batches, bf16.
    for (int ep : {1, 2}) {
      Scenario sc = tiny(2, 1, 2, 1);
      sc.model.experts = 4;
      sc.model.moe_every = 2;
      sc.parallel.ep = ep;
      INFO("ep " << sc.parallel.ep);
      const Program p = build_program(sc);
      check_program(p);
      const double T = double(sc.training.micro_batch) * sc.model.seq_len, h = sc.model.hidden, g = 2;
      const double C = std::ceil(T / 4 * sc.model.capacity_factor);  // top-1, capacity per expert
      REQUIRE(sc.model.expert_capacity(int64_t(T)) == int64_t(C));
      const double buffer = 4 * C * h * g;  // [experts, capacity, h]
      for (const RankProgram& rp : p.ranks) {
        double a2a_bytes = 0, gather_bytes = 0;
        int a2a = 0, gathers = 0, all_reduces = 0, fwd_gathers = 0;
        bool after_forward = false;
        for (const Instruction& in : rp.instructions) {
          if (in.op == Op::Forward) after_forward = true;
          if (in.op == Op::Backward) after_forward = false;
          if (in.op == Op::AllToAll) {
            a2a += in.repeat;
            a2a_bytes = in.bytes;
            CHECK(p.groups[in.group].kind == GroupKind::EP);
          }
          if (in.purpose == Purpose::TensorParallel && in.op == Op::AllGather) {
            CHECK(p.groups[in.group].kind == GroupKind::TP);
            gathers += in.repeat;
            fwd_gathers += after_forward ? in.repeat : 0;
            gather_bytes = in.bytes;
          }
          // Per layer Megatron's f/g pair forward and backward for the dense layers, the attention's
          // only for the MoE ones; plus the embedding's forward and the head's 3 + 1.
          if (in.purpose == Purpose::TensorParallel && in.op == Op::AllReduce) all_reduces += in.repeat;
          if (in.purpose == Purpose::GradientReduce && p.groups[in.group].kind == GroupKind::ExpertDP) {
            // the ranks of the stage holding the same experts: tp dp / ep of them, TP peers among them
            CHECK(p.groups[in.group].ranks.size() == size_t(2 * 2 / sc.parallel.ep));
          }
        }
        // Per MoE layer and micro-batch: the dispatch and combine of 1/tp of the capacity slots
        // in each pass, one all-gather of the whole buffer after the combine (forward) and one for
        // the drop's gradient (backward).
        CHECK(a2a == (sc.parallel.ep > 1 ? 2 * 4 * 2 * 2 : 0));
        if (sc.parallel.ep > 1) CHECK(a2a_bytes == buffer / 2);
        CHECK(gathers == 2 * 4 * 2);
        CHECK(fwd_gathers == 2 * 4);
        CHECK(gather_bytes == buffer);
        CHECK(all_reduces == 4 * (2 * (2 * 2 + 2 * 1) + 1 + 3 + 1));
      }
      // The expert partition spans tp dp / ep ranks (core/grid.hpp): ZeRO-1 all-gathers the
      // updated experts over them.
      const ProcessGrid grid(sc.parallel);
      CHECK(grid.group_of(GroupKind::ExpertDP, 0).size() == size_t(2 * 2 / sc.parallel.ep));
    }
    // With sequence parallelism the Program keeps the layers' all-gather / reduce-scatter pairs
    // (the torch backend refuses MoE with sequence parallelism).
    Scenario sp = tiny(2, 1, 2, 1);
    sp.model.experts = 4;
    sp.model.moe_every = 2;
    sp.parallel.ep = 2;
    sp.parallel.sequence_parallel = true;
    check_program(build_program(sp));
  }
  SECTION("1-bit Adam after freeze_step replaces the all-reduce") {
    Scenario sc = tiny(1, 1, 4, 0);
    sc.optimizer.kind = OptimizerKind::onebit_adam;
    sc.optimizer.freeze_step = 10;
    sc.optimizer.step = 5;
    const Program warm = build_program(sc);
    CHECK(count(warm.ranks[0], Op::AllReduce) > 0);
    sc.optimizer.step = 10;
    const Program p = build_program(sc);
    // The compressed phase's step: 90 bytes per parameter (momentum update and a five-pass
    // frozen-variance update) against the warm-up's AdamW, 46, bf16 (optimizer_kernels.hpp: 1-bit
    // Adam keeps the fp32 accumulator, so its warm-up step folds into it, 12, and steps it, 34).
    const auto step_bytes = [](const Program& q) {
      for (const Instruction& in : q.ranks[0].instructions)
        if (in.op == Op::OptimizerStep) return in.memory_bytes;
      return 0.0;
    };
    CHECK(step_bytes(p) - step_bytes(warm) == Approx(44.0 * parameter_count(sc.model)));
    check_program(p);
    const RankProgram& rp = p.ranks[0];
    CHECK(count(rp, Op::AllReduce) == 0);
    const double psi = parameter_count(sc.model);
    const double n = std::ceil(psi / 32) * 32;
    double signs = 0, server = 0;
    int scales = 0;
    for (const Instruction& in : rp.instructions) {
      if (in.purpose == Purpose::OneBitSigns) {
        CHECK(in.op == Op::AllToAll);
        signs += in.bytes;
        CHECK(in.memory_bytes == kOnebitWorkerBytesPerElement * n);  // the compression before it
      }
      if (in.purpose == Purpose::OneBitServer) {
        CHECK(in.op == Op::AllGather);
        server += in.bytes;
        CHECK(in.memory_bytes == kOnebitServerBytesPerElement * n);
      }
      if (in.purpose == Purpose::OneBitScales) ++scales;
    }
    CHECK(signs == Approx(n / 8));
    CHECK(server == Approx(n / 8));
    CHECK(scales == 2);
  }
  SECTION("1-bit Adam pads the momentum as DeepSpeed does: a multiple of N * lcm(N, 8)") {
    // deepspeed/runtime/fp16/onebit/adam.py: divider = size * 8 / gcd(size, 8); the buffer is
    // padded to a multiple of size * divider (3 ranks: 72 elements, not 24; 6 ranks: 144).
    for (const auto& [dp, unit] : {std::pair{2, 16.0}, {3, 72.0}, {4, 32.0}, {6, 144.0}, {8, 64.0}}) {
      INFO("dp " << dp);
      Scenario sc = tiny(1, 1, dp, 0);
      sc.optimizer.kind = OptimizerKind::onebit_adam;
      sc.optimizer.freeze_step = 1;
      sc.optimizer.step = 1;
      const Program p = build_program(sc);
      const double n = std::ceil(parameter_count(sc.model) / unit) * unit;
      for (const Instruction& in : p.ranks[0].instructions) {
        if (in.purpose == Purpose::OneBitSigns || in.purpose == Purpose::OneBitServer) CHECK(in.bytes == Approx(n / 8));
        if (in.purpose == Purpose::OneBitScales) CHECK(in.bytes == Approx(4.0 * dp));
      }
    }
  }
  SECTION("CPU offload: D2H gradients, host step, H2D parameters") {
    Scenario sc = tiny(1, 2, 2, 2);
    sc.zero.offload_optimizer = true;
    const Program p = build_program(sc);
    check_program(p);
    const RankProgram& rp = p.ranks[0];
    CHECK(count(rp, Op::HostOptimizerStep) == 1);
    CHECK(count(rp, Op::OptimizerStep) == 0);
    CHECK(count(rp, Op::CopyD2H) > 0);
    CHECK(count(rp, Op::CopyH2D) == 1);
    for (const Instruction& in : rp.instructions) {
      if (in.op == Op::HostOptimizerStep) CHECK(in.stream == Stream::Host);
      if (in.op == Op::CopyD2H) CHECK(in.purpose == Purpose::OffloadGradient);
    }
  }
}

TEST_CASE("program: gpt175b-sized build (1024 ranks, pp 8, 96 micro-batches)", "[program]") {
  Scenario sc;
  sc.model.layers = 96;
  sc.model.hidden = 12288;
  sc.model.heads = 96;
  sc.model.vocab = 51200;
  sc.model.seq_len = 2048;
  sc.training.micro_batch = 1;
  sc.training.grad_accum = 96;
  sc.training.global_batch = 1536;
  sc.parallel.tp = 8;
  sc.parallel.pp = 8;
  sc.parallel.dp = 16;
  sc.zero.stage = 1;
  sc.recompute = Recompute::full;
  sc.cluster.nodes = 128;
  auto t0 = std::chrono::steady_clock::now();
  const Program rep = build_program(sc, {true});
  auto t1 = std::chrono::steady_clock::now();
  const Program full = build_program(sc);
  auto t2 = std::chrono::steady_clock::now();
  const double rep_s = std::chrono::duration<double>(t1 - t0).count();
  const double full_s = std::chrono::duration<double>(t2 - t1).count();
  size_t total = 0;
  for (const RankProgram& rp : full.ranks) total += rp.instructions.size();
  WARN("gpt175b: representative " << rep_s * 1e3 << " ms, full " << full_s * 1e3 << " ms, "
       << total << " instructions, stage 0 rank " << full.ranks[0].instructions.size()
       << ", last stage rank " << full.ranks.back().instructions.size() << ", groups " << full.groups.size());
  CHECK(rep.representative_only);
  REQUIRE(rep.ranks.size() == 8);
  const ProcessGrid grid(sc.parallel);
  for (int s = 0; s < 8; ++s) {
    CHECK(rep.ranks[s].rank == grid.rank_of(0, s, 0));
    CHECK(rep.ranks[s].instructions.size() == full.ranks[grid.rank_of(0, s, 0)].instructions.size());
  }
  for (const Group& g : rep.groups)
    if (g.kind == GroupKind::DP) CHECK(g.ranks.size() == 16);
  // Sizes, not seconds (the WARN above prints those; a loaded CI box stretches them): the
  // representative Program is one rank per stage, and repeat-encoding keeps the full one near a
  // million instructions.
  size_t rep_total = 0;
  for (const RankProgram& rp : rep.ranks) rep_total += rp.instructions.size();
  CHECK(rep_total * 8 * 16 == total);
  CHECK(total < 1024 * 2000);
  CHECK(full.ranks[0].instructions.size() < 2000);
}

TEST_CASE("program: many strategy combinations are consistent and deadlock-free", "[program]") {
  int built = 0;
  for (int pp : {1, 2, 3}) {
    for (int dp : {1, 2, 4}) {
      for (int zero_stage = 0; zero_stage <= 3; ++zero_stage) {
        for (int variant = 0; variant < 4; ++variant) {
          const int tp = variant % 2 == 0 ? 1 : 2;
          const int v = (variant == 3 && pp > 1) ? 2 : 1;
          Scenario sc = tiny(tp, pp, dp, zero_stage, pp * 2);
          sc.model.layers = pp * v * 2;
          sc.parallel.interleave = v;
          sc.parallel.sequence_parallel = variant == 1;
          sc.recompute = variant == 2 ? Recompute::selective : variant == 1 ? Recompute::full : Recompute::none;
          sc.zero.overlap_comm = variant != 2;
          sc.zero.offload_optimizer = zero_stage > 0 && variant == 1;
          sc.zero.offload_param = zero_stage == 3 && variant == 1;
          if (dp >= 2 && variant == 0) {
            sc.model.experts = 4;
            sc.model.moe_every = 2;
            sc.parallel.ep = 2;
          }
          sc.model.tied_embeddings = variant != 3;
          INFO("pp " << pp << " dp " << dp << " zero " << zero_stage << " variant " << variant);
          const Program p = build_program(sc);
          check_program(p);
          ++built;
        }
      }
    }
  }
  CHECK(built == 3 * 3 * 4 * 4);
}

TEST_CASE("program: Llama-shaped models build consistently across tp, pp, ZeRO and MoE", "[program][llama]") {
  // GQA (2 kv heads of 4), SwiGLU, RMSNorm, rotary, no biases, untied head (tests/core/test_llama.cpp
  // checks the partition sizes against the parameter count).
  int built = 0;
  for (int pp : {1, 2}) {
    for (int tp : {1, 2}) {
      for (int zero_stage = 0; zero_stage <= 3; ++zero_stage) {
        for (int moe = 0; moe < 2; ++moe) {
          Scenario sc = tiny(tp, pp, 2, zero_stage, pp * 2);
          sc.model.kv_heads = 2;
          sc.model.ffn_hidden = 192;
          sc.model.swiglu = sc.model.rmsnorm = sc.model.rotary = true;
          sc.model.bias = false;
          sc.model.tied_embeddings = false;
          sc.parallel.sequence_parallel = tp > 1;
          sc.recompute = zero_stage == 2 ? Recompute::full : Recompute::none;
          if (moe) {
            sc.model.experts = 4;
            sc.model.top_k = 2;
            sc.parallel.ep = 2;
          }
          INFO("pp " << pp << " tp " << tp << " zero " << zero_stage << " moe " << moe);
          const Program p = build_program(sc);
          check_program(p);
          // The ops the device model prices: two MLP up GEMMs and SwiGLU, no GELU, no bias gradients.
          int gates = 0, gelus = 0, biases = 0;
          for (const auto& ops : p.op_lists)
            for (const LayerOp& op : ops) {
              gates += op.name == "mlp_gate";
              gelus += op.name == "gelu";
              biases += op.name == "bias_grads";
            }
          CHECK(gates > 0);
          CHECK(gelus == 0);
          CHECK(biases == 0);
          ++built;
        }
      }
    }
  }
  CHECK(built == 2 * 2 * 4 * 2);
}

TEST_CASE("report: 1-bit Adam's bytes per iteration before and after freeze_step", "[program][onebit][report]") {
  // scenarios/onebit_adam.yaml: 64 V100, fp16 gradients, 0.35B parameters. Before freeze_step
  // the gradient all-reduce moves 2 (N-1)/N x 2 bytes per parameter; after it the compressed
  // all-reduce moves 1-bit signs in its two phases (all-to-all, all-gather: (N-1)/N x 1/8 byte
  // each) plus 4-byte scales: 1/16 of the all-reduce and a few bytes.
  const Scenario sc = load_scenario(std::string(DSSIM_SOURCE_ROOT) + "/scenarios/onebit_adam.yaml");
  const OneBitTraffic t = onebit_traffic(sc);
  const double n = sc.parallel.dp;
  const double params = parameter_count(sc.model);
  CHECK(t.uncompressed == Approx(2 * (n - 1) / n * 2 * params).epsilon(0.01));
  CHECK(t.compressed == Approx(t.uncompressed / 16).epsilon(0.01));
  CHECK(t.compressed > t.uncompressed / 16);  // the scales ride along
  const Report r = analytic_report(sc, false);
  CHECK_THAT(report_text(sc, r), Contains("1-bit compression") && Contains("93.7 % less"));
  CHECK(report_json(sc, r)["onebit_adam"]["compressed_bytes_per_iteration"] == Approx(t.compressed));
  // Plain AdamW reports none.
  Scenario adam = sc;
  adam.optimizer.kind = OptimizerKind::adamw;
  CHECK(onebit_traffic(adam).uncompressed == 0);
  // The compressed phase's collectives carry their local work: each one's time is the wire's plus
  // the compression's (the HBM roofline of its bytes here: the V100 preset has no profile).
  Scenario c = sc;
  c.optimizer.step = c.optimizer.freeze_step;
  const Program p = build_program(c);
  const auto secs = instruction_seconds(c, p);
  const DeviceModel dev(c);
  int with_local = 0;
  for (size_t i = 0; i < p.ranks[0].instructions.size(); ++i) {
    const Instruction& in = p.ranks[0].instructions[i];
    if (!is_collective(in.op) || in.group < 0) continue;
    const double wire = collective_seconds(c.cluster, in.op, in.bytes, p.groups[in.group].ranks);
    const double local = dev.collective_local_seconds(in);
    CHECK(secs[0][i] == Approx((wire + local) * std::max(1, in.repeat)));
    if (local > 0) {
      ++with_local;
      CHECK(local == Approx(in.memory_bytes / (c.cluster.gpu.hbm_bandwidth * c.cluster.gpu.memory_efficiency) +
                            c.cluster.gpu.kernel_launch));
    }
  }
  CHECK(with_local == 3);  // worker, server, decompression
}

TEST_CASE("program: collapse_chains folds back-to-back compute-stream runs and nothing else", "[program][estimator]") {
  // Every scenario of the repository and the tiny ones, representative Programs: the collapsed
  // Program is the uncollapsed one with runs of compute-stream instructions replaced by one
  // instruction each. Expanding every chain gives back each rank's compute stream (op, purpose,
  // chunk, cost fields, in order; a chain's micro-batch is its first instruction's, members are
  // shared between chains that cost the same) and every other stream unchanged; a chain's members
  // after the first wait for nothing; chains are shared (fewer distinct than collapsed
  // instructions); the estimate is the same within 1e-9 of the iteration.
  size_t all_chains = 0, all_collapsed = 0;
  for (const char* name : {"gpt175b", "gpt13b_zero2", "gpt7b_zero3_offload", "moe", "onebit_adam", "llama-7b-lora",
                           "llama3_8b_zero3", "tiny/tiny_3d", "tiny/tiny_pp3", "tiny/tiny_interleave", "tiny/tiny_moe",
                           "tiny/tiny_zero3_dp2", "tiny/tiny_tp2"}) {
    INFO(name);
    const Scenario sc = load_scenario(std::string(DSSIM_SOURCE_ROOT) + "/scenarios/" + name + ".yaml");
    BuildOptions o;
    o.representative_only = true;
    const Program whole = build_program(sc, o);
    o.collapse_chains = true;
    const Program folded = build_program(sc, o);
    REQUIRE(folded.ranks.size() == whole.ranks.size());
    size_t n_whole = 0, n_folded = 0, folded_members = 0, collapsed = 0;
    for (const Chain& c : folded.chains) CHECK(c.count >= 2);
    auto same = [](const Instruction& a, const Instruction& b, bool member) {
      return a.op == b.op && a.stream == b.stream && a.purpose == b.purpose && (member || a.micro_batch == b.micro_batch) &&
             a.chunk == b.chunk && a.group == b.group && a.repeat == b.repeat && a.bytes == b.bytes &&
             a.flops == b.flops && a.memory_bytes == b.memory_bytes && a.ops == b.ops && a.layer_begin == b.layer_begin;
    };
    for (size_t ri = 0; ri < whole.ranks.size(); ++ri) {
      const auto& w = whole.ranks[ri].instructions;
      const auto& f = folded.ranks[ri].instructions;
      n_whole += w.size();
      n_folded += f.size();
      for (int s = 0; s < kStreams; ++s) {
        std::vector<const Instruction*> ws, fs;
        std::vector<char> member;
        for (const Instruction& in : w)
          if (static_cast<int>(in.stream) == s) ws.push_back(&in);
        for (const Instruction& in : f) {
          if (static_cast<int>(in.stream) != s) continue;
          if (in.chain < 0) { fs.push_back(&in); member.push_back(0); continue; }
          ++collapsed;
          CHECK(in.stream == Stream::Compute);
          const Chain& c = folded.chains.at(in.chain);
          CHECK(same(in, folded.chain_members[c.begin], true));  // the head carries the first member's cost
          for (uint32_t k = c.begin; k < c.begin + c.count; ++k) {
            fs.push_back(k == c.begin ? &in : &folded.chain_members[k]);  // the head: its own micro-batch
            member.push_back(k > c.begin);
            if (k > c.begin) CHECK(folded.chain_members[k].deps_count == 0);
            folded_members += k > c.begin;
          }
        }
        REQUIRE(ws.size() == fs.size());
        for (size_t i = 0; i < ws.size(); ++i) CHECK(same(*ws[i], *fs[i], member[i]));
      }
    }
    CHECK(n_folded + folded_members == n_whole);
    CHECK((folded.chains.empty() ? n_folded == n_whole : n_folded < n_whole));  // tp 1: nothing to fold
    CHECK(folded.chains.size() <= collapsed);
    all_chains += folded.chains.size();
    all_collapsed += collapsed;
    const Timeline tw = estimate(sc, whole), tf = estimate(sc, folded);
    CHECK(std::abs(tf.makespan - tw.makespan) <= 1e-9 * tw.makespan);
    const int cw = critical_rank_index(tw), cf = critical_rank_index(tf);
    const TimeBreakdown a = attribute_time(whole, tw, cw), b = attribute_time(folded, tf, cf);
    for (auto [x, y] : std::vector<std::pair<double, double>>{{a.forward, b.forward}, {a.backward, b.backward},
                                                              {a.recompute, b.recompute}, {a.optimizer, b.optimizer},
                                                              {a.exposed_tp, b.exposed_tp}, {a.exposed_pp, b.exposed_pp},
                                                              {a.exposed_dp, b.exposed_dp}, {a.exposed_ep, b.exposed_ep},
                                                              {a.exposed_offload, b.exposed_offload}, {a.bubble, b.bubble}})
      CHECK(std::abs(x - y) <= 1e-9 * tw.makespan);
  }
  CHECK(all_chains * 4 < all_collapsed);  // most collapsed instructions share a chain
}

TEST_CASE("program: a collapsed Program cannot be timed or attributed without its chains' member seconds", "[program][estimator]") {
  BuildOptions o;
  o.representative_only = true;
  o.collapse_chains = true;
  const Scenario sc = load_scenario(std::string(DSSIM_SOURCE_ROOT) + "/scenarios/tiny/tiny_tp2.yaml");
  const Program p = build_program(sc, o);
  REQUIRE(!p.chains.empty());
  CHECK_THROWS_WITH(instruction_seconds(sc, p), Contains("collapsed chains"));
  Timeline tl = estimate(sc, p);
  CHECK(tl.chain_member_seconds.size() == p.chain_members.size());
  tl.chain_member_seconds.clear();
  CHECK_THROWS_WITH(attribute_time(p, tl, 0), Contains("members' seconds"));
}

TEST_CASE("build_program with a StagePlanCache builds the Programs it builds without one", "[program][plan]") {
  // A planner's search shares the stage plans (and their kernel lists) between Programs of one
  // base scenario; each Program must be the one built alone: the same instructions byte for byte
  // (every field), dependencies, chains and kernel lists. The sequence revisits
  // cached keys (another micro-batch count, ZeRO-1 with and without offload), misses them, and
  // takes the stage partitions (not the segments) of another micro-batch size, recompute or SP.
  const auto same = [](const std::vector<Instruction>& x, const std::vector<Instruction>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      const Instruction &a = x[i], &b = y[i];
      if (std::make_tuple(a.op, a.stream, a.purpose, a.micro_batch, a.chunk, a.layer_begin, a.layer_count, a.group, a.peer,
                          a.tag, a.bucket, a.repeat, a.ops, a.deps_begin, a.deps_count, a.chain) !=
              std::make_tuple(b.op, b.stream, b.purpose, b.micro_batch, b.chunk, b.layer_begin, b.layer_count, b.group, b.peer,
                              b.tag, b.bucket, b.repeat, b.ops, b.deps_begin, b.deps_count, b.chain) ||
          std::memcmp(&a.flops, &b.flops, sizeof a.flops) || std::memcmp(&a.bytes, &b.bytes, sizeof a.bytes) ||
          std::memcmp(&a.memory_bytes, &b.memory_bytes, sizeof a.memory_bytes) ||
          std::memcmp(&a.gemm_flops, &b.gemm_flops, sizeof a.gemm_flops))
        return false;
    }
    return true;
  };
  StagePlanCache cache;
  const std::vector<std::vector<std::string>> points = {
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1", "zero.offload_optimizer=true"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=0"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1", "training.micro_batch=2"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1", "activation_checkpointing.mode=selective"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1", "parallel.sequence_parallel=true"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1", "parallel.interleave=3"},
      {"parallel.pp=1", "parallel.dp=128", "zero.stage=3", "training.micro_batch=2"},
      {"parallel.pp=1", "parallel.dp=128", "zero.stage=3", "training.micro_batch=2", "zero.offload_optimizer=true"},
      {"parallel.pp=8", "parallel.dp=16", "zero.stage=1"},
  };
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& set : points) {
      LoadOptions lo;
      lo.overrides = set;
      Scenario sc = load_scenario("gpt175b", lo);
      if (pass == 1) {  // fewer micro-batches: the same key, another schedule
        sc.training.grad_accum = sc.parallel.pp * 2;
        sc.training.global_batch = int64_t(sc.training.grad_accum) * sc.training.micro_batch * sc.parallel.dp;
      }
      BuildOptions alone;
      alone.representative_only = true;
      alone.collapse_chains = true;
      BuildOptions shared = alone;
      shared.stage_plans = &cache;
      const Program a = build_program(sc, alone), b = build_program(sc, shared);
      INFO(set.back() << " pass " << pass);
      REQUIRE(a.ranks.size() == b.ranks.size());
      for (size_t r = 0; r < a.ranks.size(); ++r) {
        CHECK(same(a.ranks[r].instructions, b.ranks[r].instructions));
        CHECK(a.ranks[r].deps == b.ranks[r].deps);
      }
      CHECK(same(a.chain_members, b.chain_members));
      REQUIRE(a.op_lists.size() == b.op_lists.size());
      for (size_t k = 0; k < a.op_lists.size(); ++k) {
        REQUIRE(a.op_lists[k].size() == b.op_lists[k].size());
        for (size_t o = 0; o < a.op_lists[k].size(); ++o) {
          CHECK(a.op_lists[k][o].name == b.op_lists[k][o].name);
          CHECK(a.op_lists[k][o].flops == b.op_lists[k][o].flops);
          CHECK(a.op_lists[k][o].memory_bytes == b.op_lists[k][o].memory_bytes);
        }
      }
    }
}
