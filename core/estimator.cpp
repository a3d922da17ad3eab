#include "core/estimator.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/collective_model.hpp"
#include "core/device_model.hpp"

namespace dssim {

std::vector<std::vector<double>> instruction_seconds(const Scenario& sc, const Program& program) {
  return instruction_seconds(sc, program, nullptr);
}

namespace {

// The first index at which two arrays of trivially copyable values differ in their bytes (the
// shorter one's size when one is a prefix of the other).
template <class T>
size_t first_difference(const std::vector<T>& x, const std::vector<T>& y) {
  const size_t n = std::min(x.size(), y.size());
  constexpr size_t kBlock = 64;
  size_t i = 0;
  while (i + kBlock <= n && std::memcmp(x.data() + i, y.data() + i, kBlock * sizeof(T)) == 0) i += kBlock;
  while (i < n && std::memcmp(x.data() + i, y.data() + i, sizeof(T)) == 0) ++i;
  return i;
}

// instruction_seconds from `pin` alone (nothing else of the Scenario is read). With `ref` (priced
// from inputs equal to `pin`), an instruction in a rank's common prefix with ref's is given ref's
// seconds when everything its price reads is provably the same: its bytes, its rank, its kernel
// list (the very lists shared), its group's ranks. (Collapsed chains are priced as before: once
// per distinct chain already.)
std::vector<std::vector<double>> price_program(const PricingInputs& pin, const Program& program,
                                               std::vector<double>* chain_member_seconds, CollectivePrices* shared,
                                               const EvaluatedProgram* ref, const std::vector<size_t>* prefixes) {
  const DeviceModel device(pin);
  const ClusterSpec& cluster = pin.cluster;
  // Seconds per (kernel list, phase): forward, backward, recompute.
  std::vector<std::array<double, 3>> op_list_seconds(program.op_lists.size(), {-1.0, -1.0, -1.0});
  struct Key {
    int group; Op op; double bytes;
    bool operator==(const Key& o) const { return group == o.group && op == o.op && bytes == o.bytes; }
  };
  // Collectives by (group, op, bytes): an open-addressing table (no node per entry), grown at half full.
  struct Slot { Key key; double seconds; bool used; };
  const Slot empty{{-1, Op::AllReduce, 0}, 0, false};
  std::vector<Slot> collective_slots(64, empty);
  size_t collective_count = 0;
  const auto slot_of = [](const std::vector<Slot>& slots, const Key& k) {
    uint64_t b;
    std::memcpy(&b, &k.bytes, sizeof b);
    const uint64_t h = (b * 1000003u + uint64_t(uint32_t(k.group)) * 31u + uint64_t(k.op)) * 0x9E3779B97F4A7C15ull;
    const size_t mask = slots.size() - 1;
    size_t i = size_t(h >> 32) & mask;
    while (slots[i].used && !(slots[i].key == k)) i = (i + 1) & mask;
    return i;
  };
  // A stage's sends and receives repeat four kinds (to and from each neighbour): a small table
  // indexed by the pair (a miss, rare, replaces the entry).
  struct P2PSeconds { int from = -1, to = -1; double bytes = -1, seconds = 0; };
  std::array<P2PSeconds, 64> p2p_cache{};

  auto shared_collective_seconds = [&](Op op, double bytes, const std::vector<int>& ranks) {
    if (!shared) return collective_seconds(cluster, op, bytes, ranks);
    uint64_t h;
    std::memcpy(&h, &bytes, sizeof h);
    h = (h * 1099511628211ull) ^ uint64_t(op);
    for (int r : ranks) h = (h ^ uint64_t(uint32_t(r))) * 1099511628211ull;
    std::vector<CollectivePrices::Entry>& bucket = shared->by_hash[h];
    for (const CollectivePrices::Entry& e : bucket)
      if (e.op == op && e.bytes == bytes && e.ranks == ranks) return e.seconds;
    const double t = collective_seconds(cluster, op, bytes, ranks);
    bucket.push_back({op, bytes, ranks, t});
    return t;
  };

  // One repetition's seconds times `repeat`, of an instruction of `me`.
  auto price = [&](const Instruction& in, int me) {
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
      size_t i = slot_of(collective_slots, key);
      if (!collective_slots[i].used) {
        if (2 * (collective_count + 1) > collective_slots.size()) {
          std::vector<Slot> old(collective_slots.size() * 2, empty);
          old.swap(collective_slots);
          for (const Slot& o : old)
            if (o.used) collective_slots[slot_of(collective_slots, o.key)] = o;
          i = slot_of(collective_slots, key);
        }
        collective_slots[i] = {key, shared_collective_seconds(in.op, in.bytes, program.groups.at(in.group).ranks), true};
        ++collective_count;
      }
      t = collective_slots[i].seconds + device.collective_local_seconds(in);  // 1-bit Adam: compression, then the wire
    } else if (in.op == Op::Send || in.op == Op::Recv) {
      const int from = in.op == Op::Send ? me : in.peer, to = in.op == Op::Send ? in.peer : me;
      P2PSeconds& c = p2p_cache[(uint32_t(from) * 0x9E3779B1u + uint32_t(to) * 0x85EBCA77u) >> 26];
      if (c.from != from || c.to != to || c.bytes != in.bytes) c = {from, to, in.bytes, p2p_seconds(cluster, in.bytes, from, to)};
      t = c.seconds;
    } else {
      t = device.copy_seconds(in);
    }
    return t * std::max(1, in.repeat);
  };

  if (chain_member_seconds) chain_member_seconds->assign(program.chain_members.size(), 0.0);
  else if (!program.chains.empty())
    throw std::logic_error("instruction_seconds: a Program with collapsed chains needs their members' seconds");
  std::vector<double> chain_seconds(program.chains.size(), -1.0);
  std::vector<std::vector<double>> out(program.ranks.size());

  // What may be taken from `ref` (see above).
  const Program* a = ref ? &ref->program : nullptr;
  if (a && (a->ranks.size() != program.ranks.size() || ref->seconds.size() != program.ranks.size())) a = nullptr;
  const bool same_lists = a && a->op_lists.shared() == program.op_lists.shared();
  std::vector<int8_t> same_group;  // -1: not compared yet
  if (a) same_group.assign(program.groups.size(), -1);
  auto same_inputs = [&](const Instruction& in) {  // (its bytes, and its rank's, compared already)
    if (is_compute(in.op) && in.ops >= 0 && !same_lists) return false;
    if (is_collective(in.op)) {
      const size_t g = static_cast<size_t>(in.group);
      if (in.group < 0 || g >= program.groups.size() || g >= a->groups.size()) return false;
      if (same_group[g] < 0) same_group[g] = program.groups[g].ranks == a->groups[g].ranks;
      return same_group[g] == 1;
    }
    return true;
  };
  for (size_t ri = 0; ri < program.ranks.size(); ++ri) {
    const RankProgram& rp = program.ranks[ri];
    out[ri].resize(rp.instructions.size());
    size_t prefix = 0;
    if (a && a->ranks[ri].rank == rp.rank && ref->seconds[ri].size() == a->ranks[ri].instructions.size())
      prefix = (*prefixes)[ri];
    for (size_t i = 0; i < rp.instructions.size(); ++i) {
      const Instruction& in = rp.instructions[i];
      if (i < prefix && in.chain < 0 && same_inputs(in)) {
        out[ri][i] = ref->seconds[ri][i];
        continue;
      }
      if (in.chain < 0) {
        out[ri][i] = price(in, rp.rank);
        continue;
      }
      // A collapsed chain: its members back to back (priced once per distinct chain).
      double& t = chain_seconds[in.chain];
      if (t < 0) {
        const Chain& c = program.chains[in.chain];
        t = 0;
        for (uint32_t k = c.begin; k < c.begin + c.count; ++k)
          t += (*chain_member_seconds)[k] = price(program.chain_members[k], rp.rank);
      }
      out[ri][i] = t;
    }
  }
  return out;
}

}  // namespace

std::vector<std::vector<double>> instruction_seconds(const Scenario& sc, const Program& program,
                                                     std::vector<double>* chain_member_seconds, CollectivePrices* shared) {
  return price_program(PricingInputs(sc), program, chain_member_seconds, shared, nullptr, nullptr);
}

std::vector<std::vector<double>> instruction_seconds_reusing(const Scenario& sc, const Program& program,
                                                             std::vector<double>* chain_member_seconds,
                                                             CollectivePrices* shared, const EvaluatedProgram& ref,
                                                             CommonPrefix* common) {
  const PricingInputs pin(sc);
  const bool same = ref.pricing && *ref.pricing == pin;
  CommonPrefix local;
  CommonPrefix& c = common ? *common : local;
  c.program = &program;
  c.ref = &ref;
  c.instructions.assign(program.ranks.size(), 0);
  if (ref.program.ranks.size() == program.ranks.size())
    for (size_t ri = 0; ri < program.ranks.size(); ++ri)
      c.instructions[ri] = first_difference(program.ranks[ri].instructions, ref.program.ranks[ri].instructions);
  return price_program(pin, program, chain_member_seconds, shared, same ? &ref : nullptr, &c.instructions);
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

// Index of each materialized rank (-1: not materialized), and how many materialized members each
// group has: a rendezvous completes when they all arrive.
void materialized_members(const Program& program, std::vector<int>& index_of_rank, std::vector<int>& materialized) {
  const size_t nr = program.ranks.size();
  index_of_rank.assign(program.world > 0 ? program.world : 0, -1);
  for (size_t ri = 0; ri < nr; ++ri) {
    const int r = program.ranks[ri].rank;
    if (r >= static_cast<int>(index_of_rank.size())) index_of_rank.resize(r + 1, -1);
    index_of_rank[r] = static_cast<int>(ri);
  }
  const size_t ng = program.groups.size();
  materialized.assign(ng, 0);
  for (size_t g = 0; g < ng; ++g)
    for (int r : program.groups[g].ranks)
      if (r < static_cast<int>(index_of_rank.size()) && index_of_rank[r] >= 0) ++materialized[g];
}

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
// Kept between calls (per thread): a planner evaluates thousands of Programs, and allocating
// these afresh each time had every first write miss the cache. `done` also carries what
// evaluate_program_reusing took from its reference into evaluate.
thread_local std::vector<std::array<std::vector<Entry>, kStreams>> t_streams;
thread_local std::vector<std::vector<char>> t_done, t_posted;

// Instructions evaluate_program_reusing took from its reference: marked in t_done, their spans in
// the timeline; per rank and stream, when the last of them ends.
struct Preset {
  std::vector<std::array<double, kStreams>> free;
  std::vector<uint32_t> from;  // per rank: every instruction before it is taken
};

// evaluate_program; with `preset`, the instructions marked done keep their spans.
Timeline evaluate(const Program& program, const std::vector<std::vector<double>>& seconds, Timeline tl,
                  const Preset* preset) {
  // Each stream runs in order as far as its dependencies, collective rendezvous and send/recv
  // matches allow (below: a queue of streams that can move).
  // Collectives of a group with one materialized member (every DP / TP group of a
  // representative-only Program) complete on arrival; the others meet in `collectives`.
  const size_t nr = program.ranks.size();
  tl.spans.resize(nr);
  std::vector<int> index_of_rank, materialized;
  materialized_members(program, index_of_rank, materialized);
  const size_t ng = program.groups.size();
  auto& streams = t_streams;
  auto& done = t_done;
  auto& posted = t_posted;
  if (streams.size() < nr) streams.resize(nr);
  if (done.size() < nr) done.resize(nr), posted.resize(nr);
  std::vector<std::array<size_t, kStreams>> cursor(nr);
  std::vector<std::array<double, kStreams>> stream_free(nr);
  std::vector<uint32_t> seq_by_group(ng);
  size_t remaining = 0;
  int64_t min_tag = INT32_MAX, max_tag = INT32_MIN;  // over the sends and receives
  size_t p2p_count = 0;
  for (size_t ri = 0; ri < nr; ++ri) {
    const auto& ins = program.ranks[ri].instructions;
    if (!preset) {
      tl.spans[ri].resize(ins.size());
      done[ri].assign(ins.size(), 0);
    }
    posted[ri].assign(ins.size(), 0);
    const char* done_r = done[ri].data();
    std::fill(seq_by_group.begin(), seq_by_group.end(), 0);
    for (int s = 0; s < kStreams; ++s) streams[ri][s].clear();  // (their capacity stays: no counting pass)
    for (uint32_t i = preset ? preset->from[ri] : 0; i < ins.size(); ++i) {
      if (preset && done_r[i]) continue;  // (never a rendezvous: their sequences count the rest only)
      const Instruction& in = ins[i];
      // Written in place, field by field (an Entry assembled on the stack and then copied was
      // read back wider than it was written: a store-forwarding stall on every instruction).
      Entry& e = streams[ri][static_cast<int>(in.stream)].emplace_back();
      e.i = i;
      e.deps_begin = in.deps_begin;
      e.deps_count = in.deps_count;
      if (is_collective(in.op) && materialized[in.group] > 1) {
        e.kind = kRendezvous;
        e.send = false;
        e.a = in.group;
        e.b = seq_by_group[in.group]++;
      } else if (in.op == Op::Send || in.op == Op::Recv) {
        e.kind = kPointToPoint;
        e.send = in.op == Op::Send;
        e.a = in.peer;
        e.b = static_cast<uint32_t>(in.tag);
        min_tag = std::min<int64_t>(min_tag, in.tag);
        max_tag = std::max<int64_t>(max_tag, in.tag);
        ++p2p_count;
      } else {
        e.kind = kPlain;
        e.send = false;
        e.a = 0;
        e.b = 0;
      }
    }
    cursor[ri].fill(0);
    if (preset) stream_free[ri] = preset->free[ri];
    else stream_free[ri].fill(0.0);
    for (int s = 0; s < kStreams; ++s) remaining += streams[ri][s].size();
  }

  std::vector<std::vector<Rendezvous>> collectives(ng);  // [group][sequence]
  // Posted sends / receives waiting for their partner, found by tag: per tag a short list (one
  // entry in a representative Program, one per replica in a whole one) in an array indexed by
  // the tag, or a hash map when the tags are too sparse for one.
  const bool by_tag = p2p_count > 0 && max_tag >= min_tag && uint64_t(max_tag - min_tag) <= 4 * uint64_t(p2p_count) + 1024;
  struct PostedNode { P2PKey key; P2PPosted posted; int32_t next; };
  std::vector<int32_t> posted_head(by_tag ? size_t(max_tag - min_tag) + 1 : 0, -1);
  std::vector<PostedNode> posted_nodes;
  int32_t free_node = -1;
  std::unordered_map<P2PKey, P2PPosted, P2PKeyHash> p2p;
  // The partner posted first (removed), or false after posting this one.
  auto match = [&](const P2PKey& key, const P2PPosted& mine, P2PPosted& first) {
    if (!by_tag) {
      auto it = p2p.find(key);
      if (it == p2p.end()) {
        p2p.emplace(key, mine);
        return false;
      }
      first = it->second;
      p2p.erase(it);
      return true;
    }
    int32_t* link = &posted_head[size_t(key.tag - min_tag)];
    for (int32_t n = *link; n >= 0; link = &posted_nodes[n].next, n = *link)
      if (posted_nodes[n].key == key) {
        first = posted_nodes[n].posted;
        *link = posted_nodes[n].next;
        posted_nodes[n].next = free_node;
        free_node = n;
        return true;
      }
    int32_t n = free_node;
    if (n >= 0) {
      free_node = posted_nodes[n].next;
      posted_nodes[n] = {key, mine, -1};
    } else {
      n = static_cast<int32_t>(posted_nodes.size());
      posted_nodes.push_back({key, mine, -1});
    }
    posted_nodes[n].next = posted_head[size_t(key.tag - min_tag)];
    posted_head[size_t(key.tag - min_tag)] = n;
    return false;
  };

  // Streams to run, each as far as it can go; a stream that stops waits for one instruction (a
  // dependency on another stream of its rank, its rendezvous, its send/recv partner) and is queued
  // again when that instruction finishes. The times do not depend on the order streams run in
  // (every start is the largest of its predecessors' ends), only the work does: sweeping every
  // stream of every rank until nothing moves took O(passes x streams), one pass per pipeline stage
  // a gradient travels back.
  const size_t nstreams = nr * kStreams;
  constexpr uint32_t kNoWait = ~uint32_t(0);
  std::vector<uint32_t> waits_on(nstreams, kNoWait);  // [ri * kStreams + s] the dependency it waits for
  std::vector<uint8_t> waiting(nr, 0);                 // per rank: a bit per stream whose waits_on is set
  static_assert(kStreams <= 8, "one byte of stream bits per rank");
  std::vector<char> queued(nstreams, 1);
  std::vector<uint32_t> queue(nstreams);
  for (size_t q = 0; q < nstreams; ++q) queue[q] = static_cast<uint32_t>(nstreams - 1 - q);  // popped from the back
  size_t running = nstreams;  // the stream being run (not queued again by its own instructions)
  auto wake = [&](size_t q) {
    if (q == running || queued[q]) return;
    queued[q] = 1;
    queue.push_back(static_cast<uint32_t>(q));
  };

  // Wakes the streams of rank `ri` that wait for its instruction i (just finished).
  auto wake_waiters = [&](size_t ri, uint32_t i) {
    const size_t base = ri * kStreams;
    for (uint8_t w = waiting[ri]; w != 0; w &= uint8_t(w - 1)) {
      const int o = __builtin_ctz(w);
      if (waits_on[base + o] == i) {
        waits_on[base + o] = kNoWait;
        waiting[ri] &= uint8_t(~(1u << o));
        wake(base + o);
      }
    }
  };
  // `running`: on the stream being run, which goes on by itself (nothing to wake there).
  auto finish = [&](int ri, uint32_t i, int s, double start, bool running = false) {
    const double end = start + seconds[ri][i];
    tl.spans[ri][i] = {start, end};
    done[ri][i] = 1;
    stream_free[ri][s] = end;
    ++cursor[ri][s];
    tl.makespan = std::max(tl.makespan, end);
    --remaining;
    if (!running) wake(static_cast<size_t>(ri) * kStreams + s);  // finished by a partner: its own stream can go on
    if (waiting[ri]) wake_waiters(static_cast<size_t>(ri), i);
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
    const uint32_t* deps_r = rp.deps.data();
    double& free_s = stream_free[ri][s];
    size_t& cursor_s = cursor[ri][s];
    const std::vector<Entry>& stream = streams[ri][s];
    while (cursor_s < stream.size()) {
      const Entry& en = stream[cursor_s];
      const uint32_t i = en.i;
      double ready = free_s;
      bool blocked = false;
      for (uint32_t d = 0; d < en.deps_count; ++d) {
        const uint32_t dep = deps_r[en.deps_begin + d];
        if (!done_r[dep]) {
          blocked = true;
          waits_on[q] = dep;
          waiting[ri] |= uint8_t(1u << s);
          break;
        }
        ready = std::max(ready, span_r[dep].end);
      }
      if (blocked) break;
      if (en.kind == kPlain) {  // also a collective of a group with one materialized member
        finish(static_cast<int>(ri), i, s, ready, true);
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
        P2PPosted first{};
        if (!match(key, P2PPosted{static_cast<int>(ri), i, s, ready}, first)) break;
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

}  // namespace

Timeline evaluate_program(const Program& program, const std::vector<std::vector<double>>& seconds) {
  return evaluate(program, seconds, Timeline{}, nullptr);
}

bool evaluate_program_reusing(const Program& program, const std::vector<std::vector<double>>& seconds,
                              const EvaluatedProgram& ref, Timeline& out, const CommonPrefix* common) {
  const Program& a = ref.program;
  const size_t nr = program.ranks.size();
  if (a.ranks.size() != nr || a.world != program.world || a.groups.size() != program.groups.size() ||
      ref.timeline.spans.size() != nr || ref.seconds.size() != nr)
    return false;
  for (size_t g = 0; g < a.groups.size(); ++g)
    if (a.groups[g].kind != program.groups[g].kind || a.groups[g].ranks != program.groups[g].ranks) return false;
  if (common && (common->program != &program || common->ref != &ref || common->instructions.size() != nr)) common = nullptr;
  std::vector<int> index_of_rank, materialized;
  materialized_members(program, index_of_rank, materialized);
  auto& done = t_done;
  if (t_streams.size() < nr) t_streams.resize(nr);
  if (done.size() < nr) done.resize(nr), t_posted.resize(nr);
  Timeline tl;
  tl.spans.resize(nr);
  Preset preset;
  preset.free.assign(nr, {});
  preset.from.assign(nr, 0);
  std::vector<uint32_t> pos, apos;                     // place of each instruction (from P on) in its stream
  std::array<std::vector<uint32_t>, kStreams> a_rest;  // the reference's instructions from P on, per stream
  for (size_t ri = 0; ri < nr; ++ri) {
    const RankProgram& rp = program.ranks[ri];
    const RankProgram& ra = a.ranks[ri];
    if (rp.rank != ra.rank) return false;
    const auto& ins = rp.instructions;
    const auto& ains = ra.instructions;
    const Span* aspan = ref.timeline.spans[ri].data();
    const double* asec = ref.seconds[ri].data();
    const double* sec = seconds[ri].data();
    // The common prefix [0, P): the same instructions (byte for byte), waiting for the same ones,
    // with the same seconds, no rendezvous. Instructions wait for earlier ones only, so nothing in
    // it waits for anything after it; its spans are the reference's unless a send / receive in it
    // has its partner elsewhere, which the rule below excludes (every send / receive is taken).
    size_t P = common ? common->instructions[ri] : first_difference(ins, ains);
    P = std::min(P, first_difference(seconds[ri], ref.seconds[ri]));
    const size_t D = first_difference(rp.deps, ra.deps);
    // One pass over the prefix: where it ends, and per stream how many of it and its last.
    std::array<uint32_t, kStreams> count{}, a_count{};
    std::array<size_t, kStreams> last{};
    for (size_t j = 0; j < P; ++j) {  // (deps_begin grows with j: stop at the first reading past D)
      const Instruction& in = ins[j];
      if (in.deps_begin + in.deps_count > D ||
          (is_collective(in.op) && materialized[in.group] > 1)) {  // (a rendezvous: never taken)
        P = j;
        break;
      }
      const int s = static_cast<int>(in.stream);
      ++count[s];
      last[s] = j;
    }
    tl.spans[ri].reserve(ins.size());
    tl.spans[ri].assign(aspan, aspan + P);
    tl.spans[ri].resize(ins.size());
    Span* span = tl.spans[ri].data();
    done[ri].assign(ins.size(), 0);
    char* done_r = done[ri].data();
    std::memset(done_r, 1, P);
    preset.from[ri] = static_cast<uint32_t>(P);
    // Past P, stream by stream: the reference's instruction at the same place of the same stream.
    for (int s = 0; s < kStreams; ++s) a_rest[s].clear();
    a_count = count;
    const std::array<uint32_t, kStreams> in_prefix = count;
    for (int s = 0; s < kStreams; ++s)
      if (count[s] > 0) {  // the last of the prefix on stream s: spans on a stream end in order
        preset.free[ri][s] = span[last[s]].end;
        tl.makespan = std::max(tl.makespan, span[last[s]].end);
      }
    apos.resize(ains.size());
    for (size_t i = P; i < ains.size(); ++i) {
      const int s = static_cast<int>(ains[i].stream);
      apos[i] = a_count[s]++;
      a_rest[s].push_back(static_cast<uint32_t>(i));
    }
    pos.resize(ins.size());
    std::array<bool, kStreams> open;
    open.fill(true);
    for (size_t j = P; j < ins.size(); ++j) {
      const Instruction& in = ins[j];
      const int s = static_cast<int>(in.stream);
      const uint32_t k = count[s]++;
      pos[j] = k;
      const bool p2p = in.op == Op::Send || in.op == Op::Recv;
      const size_t r = k - in_prefix[s];  // index into a_rest[s]
      bool same = open[s] && r < a_rest[s].size();
      uint32_t ai = 0;
      if (same) {
        ai = a_rest[s][r];
        const Instruction& x = ains[ai];
        same = x.op == in.op && x.group == in.group && x.peer == in.peer && x.tag == in.tag &&
               x.deps_count == in.deps_count && sec[j] == asec[ai] &&
               !(is_collective(in.op) && materialized[in.group] > 1);
        for (uint32_t d = 0; same && d < in.deps_count; ++d) {
          // The same instruction: in the prefix, the same index; past it, the same place.
          const uint32_t bj = rp.deps[in.deps_begin + d], aj = ra.deps[x.deps_begin + d];
          if (bj < P || aj < P) same = bj == aj;
          else same = done_r[bj] && ins[bj].stream == ains[aj].stream && pos[bj] == apos[aj];
        }
      }
      if (!same) {
        if (p2p) return false;  // (a send / receive not taken: its partner's span may differ too)
        open[s] = false;
        continue;
      }
      done_r[j] = 1;
      span[j] = aspan[ai];
      preset.free[ri][s] = span[j].end;
      tl.makespan = std::max(tl.makespan, span[j].end);
    }
  }
  out = evaluate(program, seconds, std::move(tl), &preset);
  return true;
}

Timeline estimate(const Scenario& sc, const Program& program, CollectivePrices* shared) {
  std::vector<double> members;
  Timeline tl = evaluate_program(program, instruction_seconds(sc, program, &members, shared));
  tl.chain_member_seconds = std::move(members);
  return tl;
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
