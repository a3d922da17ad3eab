#include "core/estimator.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/collective_model.hpp"
#include "core/device_model.hpp"

namespace dssim {

std::vector<std::vector<double>> instruction_seconds(const Scenario& sc, const Program& program) {
  const DeviceModel device(sc);
  // Seconds per (kernel list, phase): forward, backward, recompute.
  std::vector<std::array<double, 3>> op_list_seconds(program.op_lists.size(), {-1.0, -1.0, -1.0});
  struct Key {
    int group; Op op; double bytes;
    bool operator==(const Key& o) const { return group == o.group && op == o.op && bytes == o.bytes; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      uint64_t b; std::memcpy(&b, &k.bytes, sizeof b);
      return std::hash<uint64_t>()(b * 1000003u + uint64_t(k.group) * 31u + uint64_t(k.op));
    }
  };
  std::unordered_map<Key, double, KeyHash> collective_cache;
  struct { int from = -1, to = -1; double bytes = -1, seconds = 0; } last_p2p;  // a stage's p2p repeat

  std::vector<std::vector<double>> out(program.ranks.size());
  for (size_t ri = 0; ri < program.ranks.size(); ++ri) {
    const RankProgram& rp = program.ranks[ri];
    out[ri].resize(rp.instructions.size());
    for (size_t i = 0; i < rp.instructions.size(); ++i) {
      const Instruction& in = rp.instructions[i];
      double t = 0;
      if (in.op == Op::HostOptimizerStep) {
        t = device.host_seconds(in);
      } else if (is_compute(in.op)) {
        if (in.ops >= 0) {
          const int phase = in.op == Op::Backward ? 1 : in.op == Op::Recompute ? 2 : 0;
          double& cached = op_list_seconds.at(in.ops)[phase];
          if (cached < 0) cached = device.compute_seconds(program, in);
          t = cached;
        } else {
          t = device.compute_seconds(program, in);
        }
      } else if (is_collective(in.op)) {
        const Key key{in.group, in.op, in.bytes};
        auto it = collective_cache.find(key);
        if (it == collective_cache.end())
          it = collective_cache.emplace(key, collective_seconds(sc.cluster, in.op, in.bytes,
                                                                program.groups.at(in.group).ranks)).first;
        t = it->second + device.collective_local_seconds(in);  // 1-bit Adam: compression, then the wire
      } else if (in.op == Op::Send || in.op == Op::Recv) {
        const int me = rp.rank;
        const int from = in.op == Op::Send ? me : in.peer, to = in.op == Op::Send ? in.peer : me;
        if (from != last_p2p.from || to != last_p2p.to || in.bytes != last_p2p.bytes)
          last_p2p = {from, to, in.bytes, p2p_seconds(sc.cluster, in.bytes, from, to)};
        t = last_p2p.seconds;
      } else {
        t = device.copy_seconds(in);
      }
      out[ri][i] = t * std::max(1, in.repeat);
    }
  }
  return out;
}

namespace {

// A collective of a group with several materialized members, waiting for all of them.
struct Rendezvous {
  int arrived = 0;
  double ready = 0;
  struct Member { int rank_index; uint32_t instruction; int stream; };
  std::vector<Member> members;
};

// The first of a Send / Recv pair to be posted, waiting for its peer.
struct P2PKey {
  int src, dst, tag;
  bool operator==(const P2PKey& o) const { return src == o.src && dst == o.dst && tag == o.tag; }
};
struct P2PKeyHash {
  size_t operator()(const P2PKey& k) const {
    return std::hash<uint64_t>()((uint64_t(uint32_t(k.src)) << 40) ^ (uint64_t(uint32_t(k.dst)) << 20) ^ uint32_t(k.tag));
  }
};
struct P2PPosted {
  int rank_index;
  uint32_t instruction;
  int stream;
  double ready;
};

}  // namespace

Timeline evaluate_program(const Program& program, const std::vector<std::vector<double>>& seconds) {
  // Each stream runs in order as far as its dependencies, collective rendezvous and send/recv
  // matches allow (below: a queue of streams that can move).
  // Collectives of a group with one materialized member (every DP / TP group of a
  // representative-only Program) complete on arrival; the others meet in `collectives`.
  const size_t nr = program.ranks.size();
  Timeline tl;
  tl.spans.resize(nr);
  std::vector<int> index_of_rank(program.world > 0 ? program.world : 0, -1);
  for (size_t ri = 0; ri < nr; ++ri) {
    const int r = program.ranks[ri].rank;
    if (r >= static_cast<int>(index_of_rank.size())) index_of_rank.resize(r + 1, -1);
    index_of_rank[r] = static_cast<int>(ri);
  }
  // How many materialized members each group has: the rendezvous completes when they all arrive.
  const size_t ng = program.groups.size();
  std::vector<int> materialized(ng, 0);
  for (size_t g = 0; g < ng; ++g)
    for (int r : program.groups[g].ranks)
      if (r < static_cast<int>(index_of_rank.size()) && index_of_rank[r] >= 0) ++materialized[g];

  // Per rank and stream, in stream order: what the loop below reads of each instruction, compact
  // (the loop does not read the instructions themselves: a Program of a deep pipeline is several
  // MB of them, and reading one per step was most of the loop's cache misses).
  enum Kind : uint8_t { kPlain, kRendezvous, kPointToPoint };
  struct Entry {
    uint32_t i, deps_begin, deps_count;
    int32_t a;   // rendezvous: the group; send / recv: the peer
    uint32_t b;  // rendezvous: its sequence on the group; send / recv: the tag
    Kind kind;
    bool send;
  };
  std::vector<std::array<std::vector<Entry>, kStreams>> streams(nr);
  std::vector<std::array<size_t, kStreams>> cursor(nr);
  std::vector<std::array<double, kStreams>> stream_free(nr);
  std::vector<std::vector<char>> done(nr), posted(nr);
  std::vector<uint32_t> seq_by_group(ng);
  size_t remaining = 0;
  for (size_t ri = 0; ri < nr; ++ri) {
    const auto& ins = program.ranks[ri].instructions;
    tl.spans[ri].resize(ins.size());
    done[ri].assign(ins.size(), 0);
    posted[ri].assign(ins.size(), 0);
    std::fill(seq_by_group.begin(), seq_by_group.end(), 0);
    std::array<size_t, kStreams> per_stream{};
    for (const Instruction& in : ins) ++per_stream[static_cast<int>(in.stream)];
    for (int s = 0; s < kStreams; ++s) streams[ri][s].reserve(per_stream[s]);
    for (uint32_t i = 0; i < ins.size(); ++i) {
      const Instruction& in = ins[i];
      Entry e{i, in.deps_begin, in.deps_count, 0, 0, kPlain, false};
      if (is_collective(in.op) && materialized.at(in.group) > 1) {
        e.kind = kRendezvous;
        e.a = in.group;
        e.b = seq_by_group[in.group]++;
      } else if (in.op == Op::Send || in.op == Op::Recv) {
        e.kind = kPointToPoint;
        e.send = in.op == Op::Send;
        e.a = in.peer;
        e.b = static_cast<uint32_t>(in.tag);
      }
      streams[ri][static_cast<int>(in.stream)].push_back(e);
    }
    cursor[ri].fill(0);
    stream_free[ri].fill(0.0);
    remaining += ins.size();
  }

  std::vector<std::vector<Rendezvous>> collectives(ng);  // [group][sequence]
  std::unordered_map<P2PKey, P2PPosted, P2PKeyHash> p2p;

  // Streams to run, each as far as it can go; a stream that stops waits for one instruction (a
  // dependency on another stream of its rank, its rendezvous, its send/recv partner) and is queued
  // again when that instruction finishes. The times do not depend on the order streams run in
  // (every start is the largest of its predecessors' ends), only the work does: sweeping every
  // stream of every rank until nothing moves took O(passes x streams), one pass per pipeline stage
  // a gradient travels back.
  const size_t nstreams = nr * kStreams;
  constexpr uint32_t kNoWait = ~uint32_t(0);
  std::vector<uint32_t> waits_on(nstreams, kNoWait);  // [ri * kStreams + s] the dependency it waits for
  std::vector<char> queued(nstreams, 1);
  std::vector<uint32_t> queue(nstreams);
  for (size_t q = 0; q < nstreams; ++q) queue[q] = static_cast<uint32_t>(nstreams - 1 - q);  // popped from the back
  size_t running = nstreams;  // the stream being run (not queued again by its own instructions)
  auto wake = [&](size_t q) {
    if (q == running || queued[q]) return;
    queued[q] = 1;
    queue.push_back(static_cast<uint32_t>(q));
  };

  auto finish = [&](int ri, uint32_t i, int s, double start) {
    const double end = start + seconds[ri][i];
    tl.spans[ri][i] = {start, end};
    done[ri][i] = 1;
    stream_free[ri][s] = end;
    ++cursor[ri][s];
    tl.makespan = std::max(tl.makespan, end);
    --remaining;
    const size_t base = static_cast<size_t>(ri) * kStreams;
    wake(base + s);  // finished by a partner: its own stream can go on
    for (int o = 0; o < kStreams; ++o)
      if (waits_on[base + o] == i) {
        waits_on[base + o] = kNoWait;
        wake(base + o);
      }
  };

  while (!queue.empty()) {
    const size_t q = queue.back();
    queue.pop_back();
    queued[q] = 0;
    running = q;
    const size_t ri = q / kStreams;
    const int s = static_cast<int>(q % kStreams);
    const RankProgram& rp = program.ranks[ri];
    const char* done_r = done[ri].data();
    const Span* span_r = tl.spans[ri].data();
    const std::vector<Entry>& stream = streams[ri][s];
    while (cursor[ri][s] < stream.size()) {
      const Entry& en = stream[cursor[ri][s]];
      const uint32_t i = en.i;
      double ready = stream_free[ri][s];
      bool blocked = false;
      for (uint32_t d = 0; d < en.deps_count; ++d) {
        const uint32_t dep = rp.deps[en.deps_begin + d];
        if (!done_r[dep]) { blocked = true; waits_on[q] = dep; break; }
        ready = std::max(ready, span_r[dep].end);
      }
      if (blocked) break;
      if (en.kind == kPlain) {  // also a collective of a group with one materialized member
        finish(static_cast<int>(ri), i, s, ready);
        continue;
      }
      if (en.kind == kRendezvous) {
        if (posted[ri][i]) break;  // waiting for the rest of the group
        posted[ri][i] = 1;
        auto& seqs = collectives[en.a];
        const uint32_t seq = en.b;
        if (seqs.size() <= seq) seqs.resize(seq + 1);
        Rendezvous& rv = seqs[seq];
        rv.arrived++;
        rv.ready = std::max(rv.ready, ready);
        rv.members.push_back({static_cast<int>(ri), i, s});
        if (rv.arrived < materialized[en.a]) break;
        const double start = rv.ready;
        for (const Rendezvous::Member& m : rv.members) finish(m.rank_index, m.instruction, m.stream, start);
        rv.members = {};
        continue;
      }
      {  // send / recv
        const int me = rp.rank, peer = en.a;
        const int src = en.send ? me : peer;
        const int dst = en.send ? peer : me;
        const int peer_index = peer < static_cast<int>(index_of_rank.size()) ? index_of_rank[peer] : -1;
        if (peer_index < 0) { finish(static_cast<int>(ri), i, s, ready); continue; }
        if (posted[ri][i]) break;
        posted[ri][i] = 1;
        const P2PKey key{src, dst, static_cast<int>(en.b)};
        auto it = p2p.find(key);
        if (it == p2p.end()) {
          p2p.emplace(key, P2PPosted{static_cast<int>(ri), i, s, ready});
          break;
        }
        const P2PPosted first = it->second;
        p2p.erase(it);
        const double start = std::max(ready, first.ready);
        finish(first.rank_index, first.instruction, first.stream, start);
        finish(static_cast<int>(ri), i, s, start);
      }
    }
    running = nstreams;
  }
  if (remaining > 0) {
    for (size_t ri = 0; ri < nr; ++ri)
      for (int s = 0; s < kStreams; ++s)
        if (cursor[ri][s] < streams[ri][s].size()) {
          const Instruction& in = program.ranks[ri].instructions[streams[ri][s][cursor[ri][s]].i];
          throw std::runtime_error("Program deadlocks: rank " + std::to_string(program.ranks[ri].rank) +
                                   " stream " + to_string(in.stream) + " is stuck at " +
                                   to_string(in.op) + " (" + to_string(in.purpose) + ", micro-batch " +
                                   std::to_string(in.micro_batch) + ")");
        }
    throw std::runtime_error("Program deadlocks");
  }
  return tl;
}

Timeline estimate(const Scenario& sc, const Program& program) {
  return evaluate_program(program, instruction_seconds(sc, program));
}

}  // namespace dssim

#include "core/fit_advisor.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"

namespace dssim {

Report analytic_report(const Scenario& sc, bool suggest) {
  BuildOptions opts;
  opts.representative_only = true;
  const Program program = build_program(sc, opts);
  const Timeline tl = estimate(sc, program);
  Report r = make_report(sc, program, tl, "analytic");
  if (suggest && !r.fits) r.suggestions = fit_suggestions(sc);
  return r;
}

}  // namespace dssim
