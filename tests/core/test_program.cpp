#include <cmath>
#include <catch2/catch.hpp>

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

using namespace dssim;
using Catch::Matchers::Contains;

namespace {

Scenario tiny(int tp, int pp, int dp, int zero_stage, int micro_batches = 4) {
  Scenario sc;
  sc.name = "tiny";
  sc.model.name = "tiny";
  sc.model.layers = 4;
  sc.model.hidden = 64;
  sc.model.heads = 4;
  sc.model.ffn_hidden = 256;
  sc.model.vocab = 512;
  sc.model.seq_len = 32;
  sc.training.micro_batch = 2;
  sc.training.grad_accum = micro_batches;
  sc.training.global_batch = int64_t(2) * micro_batches * dp;
  sc.parallel.tp = tp;
  sc.parallel.pp = pp;
  sc.parallel.dp = dp;
  sc.zero.stage = zero_stage;
  sc.zero.reduce_bucket_size = 20000;  // several buckets
  sc.zero.allgather_bucket_size = 30000;
  sc.precision.dtype = Dtype::bf16;
  sc.cluster.nodes = 1;
  sc.cluster.gpus_per_node = tp * pp * dp;
  return sc;
}

// Interprets a Program with unit costs and NCCL / rendezvous semantics: streams in order, deps,
// collectives start when every member is at the matching (same per-group sequence) instruction,
// a Send and its Recv complete together. Returns false on deadlock.
bool runs_to_completion(const Program& p, std::string* why = nullptr) {
  const int nr = int(p.ranks.size());
  std::vector<std::array<std::vector<uint32_t>, kStreams>> streams(nr);
  std::vector<std::array<size_t, kStreams>> cur(nr);
  std::vector<std::vector<char>> done(nr), posted(nr);
  std::vector<std::vector<uint32_t>> seq(nr);
  size_t remaining = 0;
  for (int r = 0; r < nr; ++r) {
    const auto& ins = p.ranks[r].instructions;
    done[r].assign(ins.size(), 0);
    posted[r].assign(ins.size(), 0);
    seq[r].assign(ins.size(), 0);
    std::map<int, uint32_t> per_group;
    for (uint32_t i = 0; i < ins.size(); ++i) {
      streams[r][int(ins[i].stream)].push_back(i);
      if (is_collective(ins[i].op)) seq[r][i] = per_group[ins[i].group]++;
    }
    cur[r].fill(0);
    remaining += ins.size();
  }
  std::map<std::pair<int, uint32_t>, std::vector<std::pair<int, uint32_t>>> coll;
  std::map<std::tuple<int, int, int>, std::pair<int, uint32_t>> sends, recvs;
  const auto finish = [&](int r, uint32_t i) {
    done[r][i] = 1;
    --remaining;
  };
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int r = 0; r < nr; ++r) {
      const RankProgram& rp = p.ranks[r];
      for (int s = 0; s < kStreams; ++s) {
        while (cur[r][s] < streams[r][s].size()) {
          const uint32_t i = streams[r][s][cur[r][s]];
          if (done[r][i]) { ++cur[r][s]; progress = true; continue; }
          if (posted[r][i]) break;
          const Instruction& in = rp.instructions[i];
          bool ready = true;
          for (uint32_t d = 0; d < in.deps_count; ++d) ready = ready && done[r][rp.deps[in.deps_begin + d]];
          if (!ready) break;
          posted[r][i] = 1;
          progress = true;
          if (is_collective(in.op)) {
            auto& arrived = coll[{in.group, seq[r][i]}];
            arrived.push_back({r, i});
            if (arrived.size() == p.groups[in.group].ranks.size())
              for (auto [rr, ii] : arrived) finish(rr, ii);
          } else if (in.op == Op::Send || in.op == Op::Recv) {
            const auto key = in.op == Op::Send ? std::make_tuple(rp.rank, in.peer, in.tag)
                                               : std::make_tuple(in.peer, rp.rank, in.tag);
            auto& mine = in.op == Op::Send ? sends : recvs;
            auto& other = in.op == Op::Send ? recvs : sends;
            auto it = other.find(key);
            if (it != other.end()) {
              finish(r, i);
              finish(it->second.first, it->second.second);
              other.erase(it);
            } else {
              mine[key] = {r, i};
            }
          } else {
            finish(r, i);
          }
          if (!done[r][i]) break;
        }
      }
    }
  }
  if (remaining > 0 && why) {
    for (int r = 0; r < nr && why->empty(); ++r)
      for (int s = 0; s < kStreams; ++s)
        if (cur[r][s] < streams[r][s].size()) {
          const Instruction& in = p.ranks[r].instructions[streams[r][s][cur[r][s]]];
          *why = "rank " + std::to_string(r) + " stuck at " + to_string(in.op) + " (" +
                 to_string(in.purpose) + ") on " + to_string(in.stream);
          break;
        }
  }
  return remaining == 0;
}

// Structural invariants every Program must satisfy.
void check_program(const Program& p) {
  REQUIRE(int(p.ranks.size()) == p.world);
  std::map<std::tuple<int, int, int>, double> sends, recvs;
  std::map<int, std::map<int, std::vector<std::tuple<int, double, int, int>>>> per_group;  // group -> rank -> seq
  for (int r = 0; r < p.world; ++r) {
    const RankProgram& rp = p.ranks[r];
    REQUIRE(rp.rank == r);
    for (uint32_t i = 0; i < rp.instructions.size(); ++i) {
      const Instruction& in = rp.instructions[i];
      for (uint32_t d = 0; d < in.deps_count; ++d) REQUIRE(rp.deps[in.deps_begin + d] < i);
      if (in.op == Op::Send) CHECK(sends.emplace(std::make_tuple(r, in.peer, in.tag), in.bytes).second);
      if (in.op == Op::Recv) CHECK(recvs.emplace(std::make_tuple(in.peer, r, in.tag), in.bytes).second);
      if (is_collective(in.op)) {
        REQUIRE(in.group >= 0);
        REQUIRE(in.group < int(p.groups.size()));
        const auto& members = p.groups[in.group].ranks;
        REQUIRE(std::find(members.begin(), members.end(), r) != members.end());
        per_group[in.group][r].push_back({int(in.op), in.bytes, in.repeat, int(in.purpose)});
      }
      if (is_compute(in.op) && in.op != Op::OptimizerStep && in.op != Op::HostOptimizerStep) {
        REQUIRE(in.ops >= 0);
        REQUIRE(in.ops < int(p.op_lists.size()));
      }
    }
  }
  // Every Send has its Recv with the same tag and bytes.
  CHECK(sends == recvs);
  // Every collective appears in the same order on all members of its group.
  for (const auto& [g, by_rank] : per_group) {
    INFO("group " << g << " kind " << to_string(p.groups[g].kind));
    CHECK(by_rank.size() == p.groups[g].ranks.size());
    const auto& first = by_rank.begin()->second;
    for (const auto& [r, s] : by_rank) CHECK(s == first);
  }
  // Groups are deduplicated.
  std::set<std::pair<int, std::vector<int>>> uniq;
  for (const Group& g : p.groups) CHECK(uniq.insert({int(g.kind), g.ranks}).second);
  std::string why;
  CHECK(runs_to_completion(p, &why));
  INFO(why);
  CHECK(why.empty());
}

double wire(const Program& p, const RankProgram& rp, Purpose pu) {
  double total = 0;
  for (const Instruction& in : rp.instructions)
    if (in.purpose == pu && is_collective(in.op))
      total += in.repeat * wire_bytes_per_rank(in.op, in.bytes, int(p.groups[in.group].ranks.size()));
  return total;
}

int count(const RankProgram& rp, Op op, Purpose pu = Purpose::None, bool any_purpose = true) {
  int n = 0;
  for (const Instruction& in : rp.instructions)
    if (in.op == op && (any_purpose || in.purpose == pu)) ++n;
  return n;
}

}  // namespace

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
