// The executor's child process: results and errors come back through the pipe.
#include <catch2/catch.hpp>
#include <stdexcept>
#include <string>
#include "simulator/executor.hpp"
#include "tests/sim/hand_built.hpp"

using namespace dssim;

namespace {

Program two_ranks(int32_t tag0, int32_t tag1) {
  Program p;
  p.world = 2;
  p.ranks.resize(2);
  for (int r = 0; r < 2; ++r) {
    p.ranks[r].rank = r;
    Instruction c{Op::Forward};
    c.flops = 1e9;
    p.ranks[r].add(c);
  }
  Instruction send{Op::Send};
  send.stream = Stream::PpComm;
  send.peer = 1;
  send.tag = tag0;
  send.bytes = 1 << 20;
  p.ranks[0].add(send, {0});
  Instruction recv{Op::Recv};
  recv.stream = Stream::PpComm;
  recv.peer = 0;
  recv.tag = tag1;
  recv.bytes = 1 << 20;
  p.ranks[1].add(recv, {0});
  return p;
}

sim::ExecResult run(const Program& p) {
  const Scenario sc = simtest::cluster_scenario(2, 1, 1, 25e9);
  std::vector<sim::VirtualRank> vranks(2);
  for (int r = 0; r < 2; ++r) vranks[r].rank = vranks[r].program_index = r;
  const std::vector<std::vector<double>> seconds(2, std::vector<double>{1e-3, 1e-4});
  return sim::execute(sc, p, vranks, seconds, sim::ExecOptions{});
}

}  // namespace

TEST_CASE("executor: each rank's spans come back from the child, and a deadlock as its error") {
  const sim::ExecResult r = run(two_ranks(7, 7));
  REQUIRE(r.spans.size() == 2);
  REQUIRE(r.spans[0].size() == 2);
  REQUIRE(r.spans[1].size() == 2);
  CHECK(r.spans[0][0].start == 0);
  CHECK(r.spans[0][0].end == 1e-3);
  CHECK(r.spans[1][0].end == 1e-3);
  // The send and its recv share one flow, after both computes.
  CHECK(r.spans[0][1].start == 1e-3);
  CHECK(r.spans[1][1].start == 1e-3);
  CHECK(r.spans[0][1].end == r.spans[1][1].end);
  CHECK(r.spans[0][1].end > 1e-3 + (1 << 20) / 25e9);
  CHECK(r.makespan == r.spans[1][1].end);
  CHECK(r.instructions == 4);
  CHECK(r.flows == 1);
  // A recv whose tag no send carries: the simulation names the stuck rank and instruction.
  try {
    run(two_ranks(7, 8));
    FAIL("no error");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "Program deadlocks in the simulator: rank 0 stream pp_comm is stuck at send (none, micro-batch -1)");
  }
}

// Ranks whose instruction streams have the same shape (streams, dependencies, collective
// sequence numbers) share one copy of the executor's per-instruction state; a rank that differs
// only in which instruction a dependency names must keep its own.
TEST_CASE("executor: ranks of the same shape share state, a different dependency keeps its own") {
  Program p;
  p.world = 3;
  p.ranks.resize(3);
  for (int r = 0; r < 3; ++r) {
    RankProgram& rp = p.ranks[r];
    rp.rank = r;
    Instruction a{Op::Forward};
    a.flops = 1e9;
    rp.add(a);                            // 0: compute stream, 1 ms
    Instruction b{Op::Forward};
    b.stream = Stream::Host;
    rp.add(b);                            // 1: host stream, 4 ms
    Instruction c{Op::Forward};
    c.stream = Stream::Offload;
    rp.add(c, {r == 1 ? 1u : 0u});        // 2: after 0 (ranks 0, 2) or after 1 (rank 1), 0.1 ms
  }
  const Scenario sc = simtest::cluster_scenario(3, 1, 1, 25e9);
  std::vector<sim::VirtualRank> vranks(3);
  for (int r = 0; r < 3; ++r) vranks[r].rank = vranks[r].program_index = r;
  const std::vector<std::vector<double>> seconds(3, std::vector<double>{1e-3, 4e-3, 1e-4});
  const sim::ExecResult r = sim::execute(sc, p, vranks, seconds, sim::ExecOptions{});
  REQUIRE(r.spans.size() == 3);
  CHECK(r.instructions == 9);
  for (int k : {0, 2}) {
    CHECK(r.spans[k][2].start == 1e-3);
    CHECK(r.spans[k][2].end == 1e-3 + 1e-4);
  }
  CHECK(r.spans[1][2].start == 4e-3);
  CHECK(r.spans[1][2].end == 4e-3 + 1e-4);
  CHECK(r.makespan == 4e-3 + 1e-4);
}

#include "simulator/timer_queue.hpp"
TEST_CASE("the controller's timer queue: earliest first, equal times in push order, -0 is 0", "[executor]") {
  dssim::sim::TimerQueue q;
  q.push(2.0, 1, 10);
  q.push(1.0, 2, 20);
  q.push(2.0, 3, 30);
  q.push(-0.0, 4, 40);
  q.push(0.0, 5, 50);
  std::vector<int> order;
  while (!q.empty()) order.push_back(q.pop().v);
  CHECK(order == std::vector<int>{4, 5, 2, 1, 3});
  q.push(3.0, 6, 60);  // a drained bucket is reused
  CHECK(q.top_time() == 3.0);
  CHECK(q.pop().i == 60u);
  CHECK(q.empty());
}
