#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/schedule.hpp"

using namespace dssim;

// DeepSpeed TrainSchedule for M = 4 micro-batches, S = 3 stages, every stage, every step. Derived by
// executing deepspeed/runtime/pipe/schedule.py's algorithm step by step (TrainSchedule.steps with
// _step_to_micro_batch and _buffer_idx = micro_batch % num_pipe_buffers) in a separate script.
static const std::vector<std::vector<std::vector<std::string>>> kDeepSpeedM4S3 = {
    {  // stage 0
        {"LoadMicroBatch b0 m0", "ForwardPass b0 m0"},
        {"SendActivation b0 m0"},
        {"LoadMicroBatch b1 m1", "ForwardPass b1 m1"},
        {"SendActivation b1 m1"},
        {"LoadMicroBatch b2 m2", "ForwardPass b2 m2"},
        {"RecvGrad b0 m0", "SendActivation b2 m2", "BackwardPass b0 m0"},
        {"LoadMicroBatch b0 m3", "ForwardPass b0 m3"},
        {"RecvGrad b1 m1", "SendActivation b0 m3", "BackwardPass b1 m1"},
        {},
        {"RecvGrad b2 m2", "BackwardPass b2 m2"},
        {},
        {"RecvGrad b0 m3", "BackwardPass b0 m3", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"},
    },
    {  // stage 1
        {},
        {"RecvActivation b0 m0", "ForwardPass b0 m0"},
        {"SendActivation b0 m0"},
        {"RecvActivation b1 m1", "ForwardPass b1 m1"},
        {"RecvGrad b0 m0", "SendActivation b1 m1", "BackwardPass b0 m0"},
        {"SendGrad b0 m0", "RecvActivation b0 m2", "ForwardPass b0 m2"},
        {"RecvGrad b1 m1", "SendActivation b0 m2", "BackwardPass b1 m1"},
        {"SendGrad b1 m1", "RecvActivation b1 m3", "ForwardPass b1 m3"},
        {"RecvGrad b0 m2", "SendActivation b1 m3", "BackwardPass b0 m2"},
        {"SendGrad b0 m2"},
        {"RecvGrad b1 m3", "BackwardPass b1 m3"},
        {"SendGrad b1 m3", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"},
    },
    {  // stage 2
        {},
        {},
        {"RecvActivation b0 m0", "LoadMicroBatch b0 m0", "ForwardPass b0 m0"},
        {"BackwardPass b0 m0"},
        {"SendGrad b0 m0", "RecvActivation b1 m1", "LoadMicroBatch b1 m1", "ForwardPass b1 m1"},
        {"BackwardPass b1 m1"},
        {"SendGrad b1 m1", "RecvActivation b0 m2", "LoadMicroBatch b0 m2", "ForwardPass b0 m2"},
        {"BackwardPass b0 m2"},
        {"SendGrad b0 m2", "RecvActivation b1 m3", "LoadMicroBatch b1 m3", "ForwardPass b1 m3"},
        {"BackwardPass b1 m3"},
        {"SendGrad b1 m3"},
        {"ReduceTiedGrads", "ReduceGrads", "OptimizerStep"},
    },
};

TEST_CASE("schedule: DeepSpeed TrainSchedule M=4 S=3, exact instruction sequence", "[schedule]") {
  for (int stage = 0; stage < 3; ++stage) {
    const TrainSchedule s(4, 3, stage);
    REQUIRE(s.total_steps() == 12);
    const auto steps = s.steps();
    REQUIRE(steps.size() == kDeepSpeedM4S3[stage].size());
    for (int i = 0; i < s.total_steps(); ++i) {
      std::vector<std::string> got;
      for (const auto& cmd : steps[i]) got.push_back(to_string(cmd));
      INFO("stage " << stage << " step " << i);
      CHECK(got == kDeepSpeedM4S3[stage][i]);
    }
    const auto& last = steps.back();
    REQUIRE(last.size() >= 3);
    CHECK(last[last.size() - 3].cmd == PipeCmd::ReduceTiedGrads);
    CHECK(last[last.size() - 2].cmd == PipeCmd::ReduceGrads);
    CHECK(last[last.size() - 1].cmd == PipeCmd::OptimizerStep);
  }
  CHECK(TrainSchedule(4, 3, 0).num_pipe_buffers() == 3);
  CHECK(TrainSchedule(4, 3, 2).num_pipe_buffers() == 2);
}

TEST_CASE("schedule: DeepSpeed sends pair with the neighbour's receives step by step", "[schedule]") {
  for (int M : {1, 2, 5, 8}) {
    for (int S : {1, 2, 3, 4, 7}) {
      std::vector<TrainSchedule> st;
      for (int s = 0; s < S; ++s) st.emplace_back(M, S, s);
      for (int i = 0; i < st[0].total_steps(); ++i) {
        for (int s = 0; s + 1 < S; ++s) {
          // Activations s -> s+1 and gradients s+1 -> s, in the same order on both sides.
          std::vector<std::pair<int, int>> down, up;  // (kind, micro-batch)
          for (const auto& c : st[s].step(i)) {
            if (c.cmd == PipeCmd::SendActivation) down.push_back({0, c.micro_batch});
            if (c.cmd == PipeCmd::RecvGrad) down.push_back({1, c.micro_batch});
          }
          for (const auto& c : st[s + 1].step(i)) {
            if (c.cmd == PipeCmd::RecvActivation) up.push_back({0, c.micro_batch});
            if (c.cmd == PipeCmd::SendGrad) up.push_back({1, c.micro_batch});
          }
          std::sort(down.begin(), down.end());
          std::sort(up.begin(), up.end());
          INFO("M " << M << " S " << S << " step " << i << " stage " << s);
          CHECK(down == up);
        }
      }
      // Each stage runs every forward and backward once, forward first.
      for (int s = 0; s < S; ++s) {
        const auto order = compute_order(st[s]);
        REQUIRE(order.size() == size_t(2 * M));
        std::map<int, int> fwd_pos;
        for (size_t k = 0; k < order.size(); ++k) {
          if (order[k].forward) fwd_pos[order[k].micro_batch] = int(k);
          else CHECK(fwd_pos.count(order[k].micro_batch) == 1);
        }
        CHECK(fwd_pos.size() == size_t(M));
      }
    }
  }
}

TEST_CASE("schedule: Megatron interleaved 1F1B", "[schedule]") {
  // p = 2, v = 2, M = 4, stage 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards, then 1F1B, then
  // cool-down; chunk of forward k = (k mod 4) / 2, of backward k = 1 - (k mod 4) / 2.
  const std::vector<std::string> expected = {
      "F c0 m0", "F c0 m1", "F c1 m0", "F c1 m1", "F c0 m2", "B c1 m0", "F c0 m3", "B c1 m1",
      "F c1 m2", "B c0 m0", "F c1 m3", "B c0 m1", "B c1 m2", "B c1 m3", "B c0 m2", "B c0 m3"};
  std::vector<std::string> got;
  for (const auto& st : interleaved_1f1b(4, 2, 0, 2)) got.push_back(to_string(st));
  CHECK(got == expected);
  CHECK(interleaved_warmup(4, 2, 0, 2) == 4);
  CHECK(interleaved_warmup(4, 2, 1, 2) == 2);
  CHECK(interleaved_warmup(8, 4, 0, 3) == (4 - 0 - 1) * 2 + 2 * 4);
  CHECK_THROWS_AS(interleaved_1f1b(6, 4, 0, 2), std::invalid_argument);

  for (int p : {1, 2, 4}) {
    for (int v : {1, 2, 3}) {
      for (int M : {p, 2 * p, 3 * p}) {
        for (int s = 0; s < p; ++s) {
          const auto order = interleaved_1f1b(M, p, s, v);
          INFO("p " << p << " v " << v << " M " << M << " stage " << s);
          REQUIRE(order.size() == size_t(2 * M * v));
          std::set<std::pair<int, int>> fwd, bwd;
          for (const auto& st : order) {
            const auto key = std::make_pair(st.chunk, st.micro_batch);
            CHECK(st.chunk >= 0);
            CHECK(st.chunk < v);
            CHECK(st.micro_batch >= 0);
            CHECK(st.micro_batch < M);
            if (st.forward) {
              CHECK(fwd.insert(key).second);
            } else {
              CHECK(fwd.count(key) == 1);  // forward before backward
              CHECK(bwd.insert(key).second);
            }
          }
          CHECK(fwd.size() == size_t(M * v));
          CHECK(bwd.size() == size_t(M * v));
        }
      }
    }
  }
}

// stage_actions: what the Program builder emits per stage, from the two schedules above.
TEST_CASE("schedule: stage_actions follows TrainSchedule (one chunk) and interleaved_1f1b (several), each send with one receive", "[schedule]") {
  for (const auto& [pp, v, M] : std::vector<std::tuple<int, int, int>>{{3, 1, 4}, {4, 1, 2}, {4, 2, 8}, {2, 3, 4}, {1, 1, 3}}) {
    CAPTURE(pp, v, M);
    const auto all = stage_actions(pp, v, M);
    REQUIRE(all->size() == size_t(pp));
    std::multiset<std::tuple<int, int, int, int>> sends, recvs;  // (from stage, to stage, micro-batch, direction)
    for (int s = 0; s < pp; ++s) {
      const auto& acts = (*all)[s];
      // The compute steps in order: TrainSchedule's forward / backward passes, or Megatron's order.
      std::vector<PipeStep> compute;
      for (const PipeAction& a : acts)
        if (a.act == PipeAct::Fwd || a.act == PipeAct::Bwd) compute.push_back({a.act == PipeAct::Fwd, a.chunk, a.mb});
      if (v == 1) {
        CHECK(compute == compute_order(TrainSchedule(M, pp, s)));
        // and every command of the schedule that moves data, in its order
        std::vector<std::string> expected, got;
        const TrainSchedule ts(M, pp, s);
        for (int i = 0; i < ts.total_steps(); ++i)
          for (const PipeInstruction& pi : ts.step(i)) {
            const char* name = pi.cmd == PipeCmd::RecvActivation ? "RecvAct" : pi.cmd == PipeCmd::SendActivation ? "SendAct"
                               : pi.cmd == PipeCmd::RecvGrad ? "RecvGrad" : pi.cmd == PipeCmd::SendGrad ? "SendGrad"
                               : pi.cmd == PipeCmd::ForwardPass ? "Fwd" : pi.cmd == PipeCmd::BackwardPass ? "Bwd" : nullptr;
            if (name) expected.push_back(std::string(name) + " c0 m" + std::to_string(pi.micro_batch));
          }
        for (const PipeAction& a : acts) got.push_back(to_string(a));
        CHECK(got == expected);
      } else {
        CHECK(compute == interleaved_1f1b(M, pp, s, v));
      }
      for (const PipeAction& a : acts) {
        const int vs = a.chunk * pp + s;
        switch (a.act) {
          case PipeAct::SendAct: sends.insert({vs, vs + 1, a.mb, 0}); break;
          case PipeAct::RecvAct: recvs.insert({vs - 1, vs, a.mb, 0}); break;
          case PipeAct::SendGrad: sends.insert({vs, vs - 1, a.mb, 1}); break;
          case PipeAct::RecvGrad: recvs.insert({vs + 1, vs, a.mb, 1}); break;
          default: break;
        }
      }
    }
    CHECK(sends == recvs);
    // every virtual stage but the last sends each micro-batch's activation on, and every one but
    // the first its gradient back
    CHECK(sends.size() == size_t(2 * (pp * v - 1) * M));
    CHECK(stage_actions(pp, v, M) == all);  // kept: the same shared lists
  }
}
