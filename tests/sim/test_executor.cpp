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
