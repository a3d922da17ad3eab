// The Program builder tests' shared helpers (test_program*.cpp): a tiny scenario of any layout,
// the test interpreter that runs a Program's ranks against each other (deadlocks, unmatched
// collectives), the consistency checks every built Program passes, the bytes a rank moves by
// purpose, and instruction counts.
#pragma once
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

namespace dssim::program_test {

inline Scenario tiny(int tp, int pp, int dp, int zero_stage, int micro_batches = 4) {
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
inline bool runs_to_completion(const Program& p, std::string* why = nullptr) {
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
inline void check_program(const Program& p) {
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

inline double wire(const Program& p, const RankProgram& rp, Purpose pu) {
  double total = 0;
  for (const Instruction& in : rp.instructions)
    if (in.purpose == pu && is_collective(in.op))
      total += in.repeat * wire_bytes_per_rank(in.op, in.bytes, int(p.groups[in.group].ranks.size()));
  return total;
}

inline int count(const RankProgram& rp, Op op, Purpose pu = Purpose::None, bool any_purpose = true) {
  int n = 0;
  for (const Instruction& in : rp.instructions)
    if (in.op == op && (any_purpose || in.purpose == pu)) ++n;
  return n;
}

}  // namespace dssim::program_test
