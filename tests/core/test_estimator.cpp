// The analytic estimator's evaluation of a Program: stream order, cross-stream waits, collective
// rendezvous, send/recv matching, and the attribution of time to compute / comm / bubble.
#include <catch2/catch.hpp>

#include "core/collective_model.hpp"
#include "core/estimator.hpp"
#include "core/timeline.hpp"

using namespace dssim;

namespace {
Instruction compute(Op op, int mb = -1) {
  Instruction i{};
  i.op = op;
  i.stream = Stream::Compute;
  i.micro_batch = mb;
  return i;
}
Instruction p2p(Op op, int peer, int tag, Purpose purpose) {
  Instruction i{};
  i.op = op;
  i.stream = Stream::PpComm;
  i.peer = peer;
  i.tag = tag;
  i.purpose = purpose;
  return i;
}
}  // namespace

TEST_CASE("a Recv waits for the matching Send - the wait is bubble, the transfer exposed PP", "[estimator]") {
  Program p;
  p.world = 2;
  p.ranks.resize(2);
  p.ranks[0].rank = 0;
  p.ranks[1].rank = 1;
  // rank 0: forward (1 s) then send (0.25 s)
  uint32_t f0 = p.ranks[0].add(compute(Op::Forward, 0));
  p.ranks[0].add(p2p(Op::Send, 1, 7, Purpose::PipelineActivation), {f0});
  // rank 1: recv, then forward (2 s) waiting for it
  uint32_t r1 = p.ranks[1].add(p2p(Op::Recv, 0, 7, Purpose::PipelineActivation));
  p.ranks[1].add(compute(Op::Forward, 0), {r1});
  std::vector<std::vector<double>> secs = {{1.0, 0.25}, {0.25, 2.0}};
  Timeline tl = evaluate_program(p, secs);
  CHECK(tl.spans[1][0].start == Approx(1.0));
  CHECK(tl.spans[1][0].end == Approx(1.25));
  CHECK(tl.spans[1][1].start == Approx(1.25));
  CHECK(tl.makespan == Approx(3.25));
  TimeBreakdown t1 = attribute_time(p, tl, 1);
  CHECK(t1.forward == Approx(2.0));
  CHECK(t1.bubble == Approx(1.0));
  CHECK(t1.exposed_pp == Approx(0.25));
  CHECK(t1.total() == Approx(tl.makespan));
  TimeBreakdown t0 = attribute_time(p, tl, 0);
  CHECK(t0.exposed_pp == Approx(0.25));  // trailing send after the last compute
  CHECK(t0.idle == Approx(2.0));
  CHECK(t0.total() == Approx(tl.makespan));
}

TEST_CASE("a collective starts when its last member arrives", "[estimator]") {
  Program p;
  p.world = 2;
  p.groups.push_back({GroupKind::DP, {0, 1}});
  p.ranks.resize(2);
  for (int r = 0; r < 2; ++r) {
    p.ranks[r].rank = r;
    uint32_t b = p.ranks[r].add(compute(Op::Backward));
    Instruction ar{};
    ar.op = Op::AllReduce;
    ar.stream = Stream::DpComm;
    ar.group = 0;
    ar.purpose = Purpose::GradientReduce;
    uint32_t a = p.ranks[r].add(ar, {b});
    p.ranks[r].add(compute(Op::OptimizerStep), {a});
  }
  std::vector<std::vector<double>> secs = {{1.0, 0.5, 0.1}, {3.0, 0.5, 0.1}};
  Timeline tl = evaluate_program(p, secs);
  CHECK(tl.spans[0][1].start == Approx(3.0));
  CHECK(tl.spans[0][2].start == Approx(3.5));
  CHECK(tl.makespan == Approx(3.6));
  TimeBreakdown t0 = attribute_time(p, tl, 0);
  CHECK(t0.exposed_dp == Approx(0.5));
  CHECK(t0.bubble == Approx(2.0));  // waiting for the straggler
  CHECK(t0.total() == Approx(tl.makespan));
}

TEST_CASE("communication overlapped with compute is not exposed", "[estimator]") {
  Program p;
  p.world = 2;
  p.groups.push_back({GroupKind::DP, {0, 1}});
  p.ranks.resize(1);  // representative: rank 1 behaves like rank 0
  p.representative_only = true;
  RankProgram& rp = p.ranks[0];
  rp.rank = 0;
  uint32_t b0 = rp.add(compute(Op::Backward));
  Instruction ar{};
  ar.op = Op::ReduceScatter;
  ar.stream = Stream::DpComm;
  ar.group = 0;
  ar.purpose = Purpose::GradientReduce;
  uint32_t a0 = rp.add(ar, {b0});
  uint32_t b1 = rp.add(compute(Op::Backward));
  uint32_t a1 = rp.add(ar, {b1});
  rp.add(compute(Op::OptimizerStep), {a0, a1});
  // reduce of bucket 0 (0.8 s) hides under backward 1 (1 s); bucket 1's (0.8 s) is exposed.
  Timeline tl = evaluate_program(p, {{1.0, 0.8, 1.0, 0.8, 0.2}});
  CHECK(tl.makespan == Approx(3.0));
  TimeBreakdown t = attribute_time(p, tl, 0);
  CHECK(t.backward == Approx(2.0));
  CHECK(t.exposed_dp == Approx(0.8));
  CHECK(t.optimizer == Approx(0.2));
  CHECK(t.bubble == Approx(0.0));
}

TEST_CASE("a Program that cannot complete is reported, not looped on", "[estimator]") {
  Program p;
  p.world = 2;
  p.ranks.resize(2);
  p.ranks[0].rank = 0;
  p.ranks[1].rank = 1;
  p.ranks[0].add(p2p(Op::Recv, 1, 1, Purpose::PipelineGradient));
  p.ranks[1].add(p2p(Op::Recv, 0, 2, Purpose::PipelineActivation));
  CHECK_THROWS_WITH(evaluate_program(p, {{0.1}, {0.1}}), Catch::Contains("deadlock"));
}

TEST_CASE("ring collective closed forms", "[estimator][collective]") {
  ClusterSpec c;
  c.gpus_per_node = 8;
  c.gpu.nvlink_bandwidth = 300e9;
  c.gpu.nvlink_latency = 0;
  c.nics_per_node = 8;
  c.nic_bandwidth = 25e9;
  c.nic_latency = 0;
  c.switch_latency = 0;
  const double S = 1e9;
  // inside one node: 2 (N-1)/N S / B_nvlink plus NCCL's latency (core/collective_model.hpp;
  // its closed forms are tested in test_collective_model.cpp): the bandwidth term within 2%
  std::vector<int> node0 = {0, 1, 2, 3, 4, 5, 6, 7};
  CHECK(collective_seconds(c, Op::AllReduce, S, node0) == Approx(2.0 * 7 / 8 * S / 300e9).epsilon(0.02));
  CHECK(collective_seconds(c, Op::AllGather, S, node0) == Approx(7.0 / 8 * S / 300e9).epsilon(0.02));
  // one GPU per node (a Megatron DP group with TP 8): each GPU's share is one NIC
  std::vector<int> dp = {0, 8, 16, 24};
  CHECK(collective_seconds(c, Op::AllReduce, S, dp) == Approx(2.0 * 3 / 4 * S / 25e9).epsilon(0.02));
  // a whole-node group across nodes crosses each node boundary once per channel: all 8 NICs
  std::vector<int> world16;
  for (int r = 0; r < 16; ++r) world16.push_back(r);
  CHECK(collective_seconds(c, Op::AllReduce, S, world16) == Approx(2.0 * 15 / 16 * S / 200e9).epsilon(0.02));
  // an empty all-reduce costs NCCL's LL ring latency: 6.6 us + 14 NVLink steps of 0.6 us
  CHECK(collective_seconds(c, Op::AllReduce, 0, node0) == Approx((6.6 + 14 * 0.6) * 1e-6));
  c.gpu.nvlink_latency = 1e-6;  // point-to-point hop latency
  CHECK(p2p_seconds(c, 1e6, 0, 1) == Approx(1e-6 + 1e6 / 300e9));
  CHECK(p2p_seconds(c, 1e6, 0, 8) == Approx(1e6 / 25e9));
}

#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"

TEST_CASE("the timeline does not depend on the order the estimator visits ranks in", "[estimator]") {
  // evaluate_program runs whichever stream can move next; every start is the largest of its
  // predecessors' ends, so the timeline must be the same (bit for bit) whatever the order. Here
  // the ranks are listed backwards, which changes the order streams are queued and run in:
  // pipelines (1F1B, interleaved, DeepSpeed's blocking engine), TP + DP collectives that meet in a
  // rendezvous (full Programs), ZeRO-3, 1-bit Adam, MoE.
  struct Case { const char* scenario; std::vector<std::string> set; };
  const std::vector<Case> cases = {
      {"tiny/tiny_pp3", {}},
      {"tiny/tiny_interleave", {}},
      {"tiny/tiny_3d", {}},
      {"tiny/tiny_moe", {}},
      {"tiny/tiny_zero3_dp2", {}},
      {"tiny/tiny_onebit_dp2", {}},
      {"tiny/tiny_pp3", {"parallel.pipeline_engine=deepspeed"}},
      {"gpt175b", {"parallel.interleave=3", "training.micro_batch=2", "parallel.pp=16", "parallel.dp=8"}},
  };
  for (const Case& c : cases)
    for (bool representative : {false, true}) {
      LoadOptions lo;
      lo.overrides = c.set;
      const Scenario sc = load_scenario(c.scenario, lo);
      if (!representative && sc.parallel.world() > 64) continue;
      BuildOptions bo;
      bo.representative_only = representative;
      const Program p = build_program(sc, bo);
      const auto secs = instruction_seconds(sc, p);
      Program rev = p;
      std::reverse(rev.ranks.begin(), rev.ranks.end());
      auto rev_secs = secs;
      std::reverse(rev_secs.begin(), rev_secs.end());
      const Timeline a = evaluate_program(p, secs), b = evaluate_program(rev, rev_secs);
      INFO(c.scenario << (c.set.empty() ? "" : " " + c.set[0]) << (representative ? " representative" : " full"));
      REQUIRE(a.spans.size() == b.spans.size());
      CHECK(a.makespan == b.makespan);
      size_t differing = 0, n = 0;
      for (size_t r = 0; r < a.spans.size(); ++r) {
        const auto &x = a.spans[r], &y = b.spans[a.spans.size() - 1 - r];
        REQUIRE(x.size() == y.size());
        for (size_t i = 0; i < x.size(); ++i, ++n)
          if (x[i].start != y[i].start || x[i].end != y[i].end) ++differing;
      }
      CHECK(n > 0);
      CHECK(differing == 0);
    }
}

TEST_CASE("evaluate_program_reusing gives evaluate_program's timeline bit for bit", "[estimator][plan]") {
  // A Program evaluated against another's timeline (the planner's configurations that differ only
  // at the batch end: ZeRO 0 / 1, optimizer offload) takes the spans it provably shares and
  // evaluates the rest; the timeline must be the whole evaluation's, bit for bit. Also against
  // references that share little or nothing (another micro-batch count, another layout), and for
  // full Programs (rendezvous of several materialized ranks).
  struct Case { const char* scenario; std::vector<std::string> a, b; bool shares; };
  const std::vector<std::string> big = {"parallel.pp=16", "parallel.dp=8", "training.micro_batch=2"};
  auto with = [&](std::vector<std::string> v, std::initializer_list<const char*> more) {
    for (const char* m : more) v.push_back(m);
    return v;
  };
  const std::vector<Case> cases = {
      {"tiny/tiny_3d", {"zero.stage=0"}, {"zero.stage=1"}, true},
      {"tiny/tiny_3d", {"zero.stage=1"}, {"zero.stage=1", "zero.offload_optimizer=true"}, true},
      {"tiny/tiny_3d", {"zero.stage=1"}, {"zero.stage=1", "training.micro_batch=2"}, false},
      {"tiny/tiny_3d", {}, {"parallel.tp=1", "parallel.dp=4"}, false},
      {"gpt175b", with(big, {"zero.stage=0"}), with(big, {"zero.stage=1"}), true},
      {"gpt175b", with(big, {"zero.stage=1"}), with(big, {"zero.stage=1", "zero.offload_optimizer=true"}), true},
      {"gpt175b", with(big, {"zero.stage=0", "parallel.interleave=3"}), with(big, {"zero.stage=1", "parallel.interleave=3"}), true},
      {"gpt175b", with(big, {"zero.stage=1", "parallel.interleave=3"}),
       with(big, {"zero.stage=1", "parallel.interleave=3", "zero.offload_optimizer=true"}), true},
  };
  int compared = 0;
  for (const Case& c : cases)
    for (bool representative : {false, true})
      for (bool collapse : {false, true}) {
        LoadOptions la, lb;
        la.overrides = c.a;
        lb.overrides = c.b;
        const Scenario sa = load_scenario(c.scenario, la), sb = load_scenario(c.scenario, lb);
        if (!representative && sa.parallel.world() > 64) continue;
        BuildOptions bo;
        bo.representative_only = representative;
        bo.collapse_chains = collapse;
        EvaluatedProgram ref;
        ref.program = build_program(sa, bo);
        std::vector<double> members;
        ref.seconds = instruction_seconds(sa, ref.program, &members);
        ref.timeline = evaluate_program(ref.program, ref.seconds);
        ref.timeline.chain_member_seconds = members;
        const Program p = build_program(sb, bo);
        std::vector<double> b_members;
        const auto secs = instruction_seconds(sb, p, &b_members);
        const Timeline whole = evaluate_program(p, secs);
        // Priced against the reference: the same seconds bit for bit, and the common prefix.
        ref.pricing = std::make_shared<const PricingInputs>(sa);
        CommonPrefix common;
        std::vector<double> r_members;
        CHECK(instruction_seconds_reusing(sb, p, &r_members, nullptr, ref, &common) == secs);
        CHECK(r_members == b_members);
        {
          // Poisoned reference seconds: taken only where the pricing inputs are the same (then
          // some are, where the Programs share a prefix), never otherwise.
          EvaluatedProgram poisoned;
          poisoned.program = ref.program;
          poisoned.seconds = ref.seconds;
          for (auto& r : poisoned.seconds) std::fill(r.begin(), r.end(), -7.0);
          poisoned.timeline.chain_member_seconds = members;
          std::vector<double> m;
          size_t took_poison = 0;
          for (const auto& r : instruction_seconds_reusing(sb, p, &m, nullptr, poisoned))
            took_poison += size_t(std::count(r.begin(), r.end(), -7.0));
          CHECK(took_poison == 0);  // (no pricing inputs: nothing taken)
          poisoned.pricing = ref.pricing;
          took_poison = 0;
          for (const auto& r : instruction_seconds_reusing(sb, p, &m, nullptr, poisoned))
            took_poison += size_t(std::count(r.begin(), r.end(), -7.0));
          if (c.shares) CHECK(took_poison > 0);
          Scenario other = sa;
          other.cluster.nic_bandwidth *= 2;  // other pricing inputs: nothing taken
          poisoned.pricing = std::make_shared<const PricingInputs>(other);
          took_poison = 0;
          for (const auto& r : instruction_seconds_reusing(sb, p, &m, nullptr, poisoned))
            took_poison += size_t(std::count(r.begin(), r.end(), -7.0));
          CHECK(took_poison == 0);
        }
        Timeline reused, reused_common;
        const bool took = evaluate_program_reusing(p, secs, ref, reused);
        CHECK(evaluate_program_reusing(p, secs, ref, reused_common, &common) == took);
        if (took) {
          CHECK(reused_common.makespan == reused.makespan);
          bool same = reused_common.spans.size() == reused.spans.size();
          for (size_t r = 0; same && r < reused.spans.size(); ++r) {
            same = reused_common.spans[r].size() == reused.spans[r].size();
            for (size_t i = 0; same && i < reused.spans[r].size(); ++i)
              same = reused_common.spans[r][i].start == reused.spans[r][i].start &&
                     reused_common.spans[r][i].end == reused.spans[r][i].end;
          }
          CHECK(same);
        }
        INFO(c.scenario << " " << c.b.back() << (representative ? " representative" : " full")
                        << (collapse ? " collapsed" : ""));
        // (A full Program's TP collectives meet several materialized ranks: nothing after the
        // first is taken, and then neither are the sends and receives.)
        if (c.shares && representative) CHECK(took);
        if (!took) continue;
        ++compared;
        REQUIRE(reused.spans.size() == whole.spans.size());
        CHECK(reused.makespan == whole.makespan);
        size_t differing = 0, n = 0;
        for (size_t r = 0; r < whole.spans.size(); ++r) {
          REQUIRE(reused.spans[r].size() == whole.spans[r].size());
          for (size_t i = 0; i < whole.spans[r].size(); ++i, ++n)
            if (reused.spans[r][i].start != whole.spans[r][i].start || reused.spans[r][i].end != whole.spans[r][i].end)
              ++differing;
        }
        CHECK(n > 0);
        CHECK(differing == 0);
      }
  CHECK(compared >= 12);
}
