#include "simulator/executor.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <simgrid/s4u.hpp>
#include <simgrid/simix.hpp>
#include <simgrid/kernel/resource/Action.hpp>
#include "core/device_model.hpp"
#include "simulator/child_heap.hpp"
#include "simulator/timer_queue.hpp"
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace sg4 = simgrid::s4u;

namespace dssim::sim {

namespace {

int32_t lookup(const std::vector<std::pair<int32_t, int32_t>>& map, int32_t key) {
  if (map.empty()) return key;
  auto it = std::lower_bound(map.begin(), map.end(), std::make_pair(key, INT32_MIN));
  if (it == map.end() || it->first != key) return key;
  return it->second;
}

// A plan as the executor runs it, built once per distinct transfer (collective: group, op, bytes;
// send/recv: source, destination, bytes; copy: direction, rank, bytes, host time after) and reused
// by every instruction that repeats it. `charges`: (link index, bytes) for each link of each flow's
// route, in phase, flow and route order, so that charging a job adds exactly what walking its
// flows' routes added, in the same order (bit-identical link bytes) without a route lookup.
struct Planned {
  CommPlan plan;
  std::vector<std::pair<int, double>> charges;
  uint64_t flows = 0;  // flows of one repetition
};

struct PlanKey {
  int op; int a; int b; double bytes; double after;
  bool operator==(const PlanKey& o) const {
    return op == o.op && a == o.a && b == o.b && bytes == o.bytes && after == o.after;
  }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t b, c;
    std::memcpy(&b, &k.bytes, sizeof b);
    std::memcpy(&c, &k.after, sizeof c);
    uint64_t h = b * 1000003u ^ c;
    h = h * 31u + uint64_t(uint32_t(k.a));
    h = h * 31u + uint64_t(uint32_t(k.b));
    return std::hash<uint64_t>()(h * 31u + uint64_t(k.op));
  }
};

// The ranks waiting for a collective (group, sequence number). Entries are pooled per group and
// reused, member lists included: a collective's job refers to its entry until the job ends.
struct Rendezvous {
  int32_t group = -1;
  uint32_t seq = 0;
  int arrived = 0;
  double ready = 0;
  std::vector<std::pair<int, uint32_t>> members;  // (virtual rank, instruction)
  std::vector<double> readies;                    // each member's arrival
};

struct Job {
  const Planned* plan = nullptr;
  int repeat = 1;
  int rendezvous = -1;                               // a collective's members; or
  std::array<std::pair<int, uint32_t>, 2> pair{};    // a send/recv's two ranks, a copy's one
  int npair = 0;
};

// Who arrives last at collectives.
struct Lateness {
  uint64_t joined = 0, last = 0;
  double waited_for = 0;
  std::map<int, uint64_t> last_by_kind;
};

struct P2PPost {
  int v;
  uint32_t i;
  double ready;
};

struct TupleHash {
  size_t operator()(const std::tuple<int, int, int>& k) const {
    return std::hash<uint64_t>()((uint64_t(uint32_t(std::get<0>(k))) << 40) ^
                                 (uint64_t(uint32_t(std::get<1>(k))) << 20) ^ uint64_t(uint32_t(std::get<2>(k))));
  }
};

using RouteKey = std::pair<const sg4::Host*, const sg4::Host*>;
struct RouteKeyHash {
  size_t operator()(const RouteKey& k) const {
    const auto a = reinterpret_cast<uintptr_t>(k.first), b = reinterpret_cast<uintptr_t>(k.second);
    return std::hash<uintptr_t>()(a * 0x9E3779B97F4A7C15ull ^ b);
  }
};

class Simulation {
 public:
  Simulation(const Scenario& sc, const Program& program, const std::vector<VirtualRank>& vranks,
             const std::vector<std::vector<double>>& seconds, const ExecOptions& opts)
      : sc_(sc), program_(program), vranks_(vranks), seconds_(seconds), opts_(opts), device_(sc) {}

  ExecResult run();

 private:
  void controller();
  void advance(int v, unsigned streams);
  void start(int v, uint32_t i, double ready);
  void finish(int v, uint32_t i, double t);
  void timer(int v, uint32_t i, double t) { timers_.push(t, v, i); ++result_.timers; }
  void dispatch(const Planned& plan, int repeat, int rendezvous, std::initializer_list<std::pair<int, uint32_t>> pair);
  // Flows started by one actor in one go, and the semaphore that actor waits on until they have
  // all ended (released by the network's completion callback, flow_ended).
  struct Slice {
    int pending = 0;
    sg4::SemaphorePtr ended;
  };
  void start_flows(const Flow* begin, const Flow* end, std::vector<sg4::ExecPtr>& out, Slice& slice);
  static void wait_flows(std::vector<sg4::ExecPtr>& out, Slice& slice);
  void flow_ended(const void* activity);
  void progress(bool last);
  const Planned& planned(const PlanKey& key, CommPlan (*make)(const Simulation&, const PlanKey&));
  void account(const Planned& plan, int repeat);
  int rendezvous(int32_t g, uint32_t seq);
  int vrank_of(int rank) const {
    return rank >= 0 && rank < static_cast<int>(vrank_of_rank_.size()) ? vrank_of_rank_[rank] : -1;
  }
  const Instruction& inst(int v, uint32_t i) const {
    return program_.ranks[vranks_[v].program_index].instructions[i];
  }

  const Scenario& sc_;
  const Program& program_;
  // A collective's local work before it sends (1-bit Adam's compression): each member arrives
  // that much later; the closed-form durations in seconds_ include it already.
  DeviceModel device_;
  const std::vector<VirtualRank>& vranks_;
  const std::vector<std::vector<double>>& seconds_;
  const ExecOptions& opts_;
  ExecResult result_;

  std::unique_ptr<Platform> platform_;
  std::unique_ptr<CollectivePlanner> planner_;
  std::vector<int> vrank_of_rank_;
  // The executor's state, laid out for an instruction's end and a stream head's start, which run
  // once per instruction on a working set that grows with the cluster (at 65,536 GPUs, with a
  // Program per rank, a vector per rank and kind of state put each of them on cache lines of their
  // own): per template, flat arrays indexed from one offset; per simulated rank, one cache line.
  // Per template instruction: its stream, its position there, its dependencies, and the streams
  // whose head its end may let start (bit s = stream s: its own stream's next, and the streams of
  // the instructions that depend on it).
  // kind: a compute instruction's start reads only this and secs_ (not the Instruction, which is
  // the rank's own: its first read was the executor's largest cache miss at 65,536 GPUs).
  enum Kind : uint8_t { kOther = 0, kGpuCompute = 1, kHostCompute = 2 };
  struct Hot {
    uint32_t deps_begin = 0;  // into the template's RankProgram::deps
    uint32_t pos = 0;         // position in its stream
    uint16_t deps_count = 0;
    uint8_t stream = 0;
    uint8_t wakes = 0;
    uint8_t kind = kOther;
  };
  struct Tpl {
    uint32_t hot = 0;                  // its first instruction in hot_ and coll_seq_
    uint32_t order[kStreams + 1] = {};  // stream s's instructions, in order: order_[order[s], order[s + 1])
    const uint32_t* deps = nullptr;    // RankProgram::deps
  };
  // Per simulated rank: how far each stream is (its first `cursor` instructions have ended, so an
  // instruction has ended iff its position is below its stream's cursor), whether the stream's
  // head has started, and when the stream's last instruction ended.
  struct alignas(64) RankState {
    double stream_free[kStreams] = {};
    uint32_t cursor[kStreams] = {};
    uint8_t posted = 0;  // bit s: stream s's head has started
  };
  std::vector<Hot> hot_;
  std::vector<uint32_t> order_, coll_seq_;
  std::vector<double> secs_;  // seconds_, per instruction of hot_
  std::vector<Tpl> tpls_;
  std::vector<int32_t> tpl_of_;  // per simulated rank: its template (vranks_[v].program_index)
  std::vector<RankState> state_;
  std::vector<int> materialized_;
  std::deque<Rendezvous> rendezvous_;             // stable references: jobs read their members
  std::vector<std::vector<int>> open_rendezvous_;  // per group: entries collecting arrivals
  std::vector<std::vector<int>> free_rendezvous_;  // per group: entries to reuse
  std::unordered_map<std::tuple<int, int, int>, P2PPost, TupleHash> p2p_;
  std::unordered_map<PlanKey, std::unique_ptr<Planned>, PlanKeyHash> plans_;
  TimerQueue timers_;

  // Comm jobs and their waiters.
  struct Waiter { sg4::SemaphorePtr sem, done; int job = -1; Slice slice; };
  // Helpers that start and wait for a slice of a large phase's flows (run_flows).
  struct Helper {
    sg4::SemaphorePtr go, done;
    const Flow* begin = nullptr;
    const Flow* end = nullptr;
    Helper* next = nullptr;
    Slice slice;
  };
  std::vector<std::unique_ptr<Helper>> helpers_;
  std::vector<Helper*> idle_helpers_;
  Helper* helper();
  void run_flows(const Phase& p, Waiter& me, std::vector<sg4::ExecPtr>& flows);
  std::deque<Job> jobs_;  // stable references: waiters read their job while others are added
  std::vector<int> free_jobs_;
  std::vector<std::unique_ptr<Waiter>> waiters_;
  std::vector<int> idle_waiters_;
  // Jobs ended, in order, not yet finished by the controller: a vector read from `completed_head_`
  // and emptied once the controller has caught up (a deque allocated a node every 32 jobs: 1.2 %
  // of the CPU at 16,384 GPUs).
  std::vector<std::pair<int, double>> completed_;
  size_t completed_head_ = 0;
  sg4::SemaphorePtr wake_;
  // A waiter has released wake_ since the controller last started catching up: the controller will
  // see every job ended since, so the waiters that end after it need not release it again (one
  // release and one controller round per instant, not one per ended job).
  bool wake_pending_ = false;
  int active_jobs_ = 0;
  // Running flows: their activity -> the slice that waits for them. Open addressing (linear
  // probing, backward-shift deletion) keyed by the activity's address: one cache line per lookup
  // where std::unordered_map took a bucket and a node (2.7 % of the CPU at 65,536 GPUs).
  class FlowTable {
   public:
    void insert(const void* key, Slice* slice) {
      if ((n_ + 1) * 2 > t_.size()) grow();
      size_t i = slot(key);
      while (t_[i].key) i = (i + 1) & mask_;
      t_[i] = {key, slice};
      ++n_;
    }
    // Removes `key`, returning its slice (nullptr if absent).
    Slice* take(const void* key) {
      if (t_.empty()) return nullptr;
      size_t i = slot(key);
      while (t_[i].key != key) {
        if (!t_[i].key) return nullptr;
        i = (i + 1) & mask_;
      }
      Slice* slice = t_[i].slice;
      for (size_t j = i;;) {
        j = (j + 1) & mask_;
        if (!t_[j].key) break;
        const size_t h = slot(t_[j].key);
        if (i <= j ? (i < h && h <= j) : (i < h || h <= j)) continue;  // j's home is after the hole
        t_[i] = t_[j];
        i = j;
      }
      t_[i] = {};
      --n_;
      return slice;
    }

   private:
    struct Entry { const void* key = nullptr; Slice* slice = nullptr; };
    size_t slot(const void* key) const {
      uint64_t x = reinterpret_cast<uintptr_t>(key);
      x ^= x >> 33;
      x *= 0xff51afd7ed558ccdull;
      x ^= x >> 33;
      return static_cast<size_t>(x) & mask_;
    }
    void grow() {
      std::vector<Entry> old = std::move(t_);
      t_.assign(std::max<size_t>(size_t(1) << 16, old.size() * 2), Entry{});
      mask_ = t_.size() - 1;
      n_ = 0;
      for (const Entry& e : old)
        if (e.key) insert(e.key, e.slice);
    }
    std::vector<Entry> t_;
    size_t mask_ = 0, n_ = 0;
  };
  FlowTable running_;

  // Progress on stderr for long simulations.
  std::chrono::steady_clock::time_point wall0_, last_progress_;
  uint64_t total_instructions_ = 0;
  bool progress_shown_ = false;

  // Link accounting.
  std::unordered_map<const sg4::Link*, int> link_index_;
  std::vector<double> link_bytes_;
  std::unordered_map<RouteKey, std::vector<int>, RouteKeyHash> route_cache_;  // used when planning
  std::vector<int> nvl_up_index_, nvl_down_index_;  // per virtual rank: its NVSwitch ports' links, or -1
  std::vector<Lateness> late_;
};

// The plan for `key`, made by `make` the first time, with its link charges.
const Planned& Simulation::planned(const PlanKey& key, CommPlan (*make)(const Simulation&, const PlanKey&)) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Planned>();
  p->plan = make(*this, key);
  for (const Phase& ph : p->plan.phases) {
    p->flows += ph.flows.size();
    for (const Flow& f : ph.flows) {
      // Keyed by the hosts themselves: a NetPoint's id() is its rank inside its own zone, so ids
      // repeat across zones (every rail's leaf zone numbers its NICs alike).
      const RouteKey rk{f.src, f.dst};
      auto r = route_cache_.find(rk);
      if (r == route_cache_.end()) {
        std::vector<sg4::Link*> links;
        double lat = 0;
        f.src->route_to(f.dst, links, &lat);
        std::vector<int> idx;
        for (auto* l : links) {
          auto li = link_index_.find(l);
          if (li != link_index_.end()) idx.push_back(li->second);
        }
        r = route_cache_.emplace(rk, std::move(idx)).first;
      }
      for (int li : r->second) p->charges.emplace_back(li, f.bytes);
    }
  }
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Simulation::account(const Planned& plan, int repeat) {
  for (const auto& [li, bytes] : plan.charges) link_bytes_[li] += bytes * repeat;
}

// The entry collecting arrivals at group g's collective number `seq`.
int Simulation::rendezvous(int32_t g, uint32_t seq) {
  std::vector<int>& open = open_rendezvous_[g];
  for (int k : open)
    if (rendezvous_[k].seq == seq) return k;
  int k;
  std::vector<int>& spare = free_rendezvous_[g];
  if (!spare.empty()) { k = spare.back(); spare.pop_back(); }
  else {
    k = static_cast<int>(rendezvous_.size());
    rendezvous_.emplace_back();
    // One allocation of the final size: a member list grown by doubling up to dp entries made
    // large requests that triggered glibc's malloc_consolidate (3 % of the CPU at 16k GPUs).
    rendezvous_[k].members.reserve(materialized_[g]);
    rendezvous_[k].readies.reserve(materialized_[g]);
  }
  Rendezvous& rv = rendezvous_[k];
  rv.group = g;
  rv.seq = seq;
  rv.arrived = 0;
  rv.ready = 0;
  rv.members.clear();
  rv.readies.clear();
  open.push_back(k);
  return k;
}

// A flow is a parallel execution on its two hosts with no flops and one byte count: the host
// model (CLM03, the default with CM02) turns it into exactly the network action
// Comm::sendto_async would create (same route, size, rate), so the timings are identical. Not a
// Comm because SimGrid 3.32 keeps every host-to-host Comm in one list on maestro (detached) and
// removes it with std::list::remove when it ends: linear in the number of live comms of the whole
// simulation (28% of the CPU at 8,192 GPUs, more beyond). An Exec is listed only on the actor that
// started it.
//
// A slice of flows costs one simcall: each s4u setter and start() is a simcall of its own (an
// actor context switch and a scheduling round each, five per flow), so the Execs are created here,
// in the calling actor (whose list holds them, see run_flows), and their amounts, hosts and start
// are set in maestro in one go, in the slice's order.
void Simulation::start_flows(const Flow* begin, const Flow* end, std::vector<sg4::ExecPtr>& out, Slice& slice) {
  const size_t first = out.size();
  for (const Flow* f = begin; f != end; ++f)
    if (f->bytes > 0) out.push_back(sg4::Exec::init());
  if (out.size() == first) return;
  slice.pending = static_cast<int>(out.size() - first);
  simgrid::kernel::actor::simcall_answered([this, begin, end, first, &out, &slice] {
    size_t k = first;
    for (const Flow* f = begin; f != end; ++f) {
      if (!(f->bytes > 0)) continue;
      const double bytes = static_cast<double>(static_cast<uint64_t>(std::llround(f->bytes)));  // sendto's uint64_t
      sg4::Exec* e = out[k++].get();
      e->set_flops_amounts({0.0, 0.0})->set_bytes_amounts({0.0, bytes, 0.0, 0.0})->set_hosts({f->src, f->dst});
      e->start();
      running_.insert(e->get_impl(), &slice);
    }
  });
}

// Waits until the slice's flows have ended, then lets their Execs go.
void Simulation::wait_flows(std::vector<sg4::ExecPtr>& out, Slice& slice) {
  if (out.empty()) return;
  slice.ended->acquire();
  out.clear();
}

// A flow's network action has ended (in maestro, while the network model updates): the last of a
// slice wakes the actor waiting for it.
void Simulation::flow_ended(const void* activity) {
  Slice* slice = running_.take(activity);
  if (slice && --slice->pending == 0) slice->ended->release();
}

// Starts a phase's flows and waits for them all. SimGrid 3.32 lists every exec on the actor that
// started it and takes it off with std::list::remove when it ends, so one actor starting N flows
// pays O(N^2) for the phase (7 % of the CPU at 32,768 GPUs, where a DP ring phase has 512 flows).
// Beyond kFlowsPerActor the phase is sliced: the waiter starts the first slice, then each helper
// starts the next one and hands over to the following helper, so the flows start one after the
// other in the phase's order, at the same simulated instant, as when one actor started them all.
constexpr size_t kFlowsPerActor = 64;

Simulation::Helper* Simulation::helper() {
  if (!idle_helpers_.empty()) {
    Helper* h = idle_helpers_.back();
    idle_helpers_.pop_back();
    return h;
  }
  helpers_.push_back(std::make_unique<Helper>());
  Helper* h = helpers_.back().get();
  h->go = sg4::Semaphore::create(0);
  h->slice.ended = sg4::Semaphore::create(0);
  sg4::Actor::create("flows-" + std::to_string(helpers_.size() - 1), platform_->driver(), [this, h] {
    std::vector<sg4::ExecPtr> mine;
    for (;;) {
      h->go->acquire();
      start_flows(h->begin, h->end, mine, h->slice);
      if (h->next) h->next->go->release();
      const sg4::SemaphorePtr done = h->done;
      wait_flows(mine, h->slice);
      idle_helpers_.push_back(h);
      done->release();
    }
  })->daemonize();
  return h;
}

void Simulation::run_flows(const Phase& p, Waiter& me, std::vector<sg4::ExecPtr>& flows) {
  const size_t n = p.flows.size();
  const size_t slices = (n + kFlowsPerActor - 1) / kFlowsPerActor;
  std::vector<Helper*> hs;
  for (size_t k = 1; k < slices; ++k) hs.push_back(helper());
  for (size_t k = 1; k < slices; ++k) {
    Helper* h = hs[k - 1];
    h->begin = p.flows.data() + k * kFlowsPerActor;
    h->end = p.flows.data() + std::min(n, (k + 1) * kFlowsPerActor);
    h->next = k + 1 < slices ? hs[k] : nullptr;
    h->done = me.done;
  }
  flows.clear();
  start_flows(p.flows.data(), p.flows.data() + std::min(n, kFlowsPerActor), flows, me.slice);
  if (!hs.empty()) hs[0]->go->release();
  wait_flows(flows, me.slice);
  for (size_t k = 1; k < slices; ++k) me.done->acquire();
}

void Simulation::dispatch(const Planned& plan, int repeat, int rendezvous,
                          std::initializer_list<std::pair<int, uint32_t>> pair) {
  int id;
  if (!free_jobs_.empty()) { id = free_jobs_.back(); free_jobs_.pop_back(); }
  else { id = static_cast<int>(jobs_.size()); jobs_.emplace_back(); }
  Job& job = jobs_[id];
  job.plan = &plan;
  job.repeat = repeat;
  job.rendezvous = rendezvous;
  job.npair = 0;
  for (const auto& m : pair) job.pair[job.npair++] = m;
  account(plan, repeat);
  ++result_.jobs;
  result_.flows += plan.flows * repeat;
  ++active_jobs_;
  int w;
  if (!idle_waiters_.empty()) { w = idle_waiters_.back(); idle_waiters_.pop_back(); }
  else {
    w = static_cast<int>(waiters_.size());
    waiters_.push_back(std::make_unique<Waiter>());
    Waiter* me = waiters_.back().get();
    me->sem = sg4::Semaphore::create(0);
    me->done = sg4::Semaphore::create(0);
    me->slice.ended = sg4::Semaphore::create(0);
    sg4::Actor::create("waiter-" + std::to_string(w), platform_->driver(), [this, me, w] {
      std::vector<sg4::ExecPtr> flows;
      for (;;) {
        me->sem->acquire();
        const Job& job = jobs_[me->job];
        for (int r = 0; r < job.repeat; ++r)
          for (const Phase& p : job.plan->plan.phases) {
            if (p.before_seconds > 0) sg4::this_actor::sleep_for(p.before_seconds);
            const double started = sg4::Engine::get_clock();
            run_flows(p, *me, flows);
            const double floor = started + p.min_seconds - sg4::Engine::get_clock();
            if (floor > 0) sg4::this_actor::sleep_for(floor);
            if (p.after_seconds > 0) sg4::this_actor::sleep_for(p.after_seconds);
          }
        completed_.emplace_back(me->job, sg4::Engine::get_clock());
        idle_waiters_.push_back(w);
        if (!wake_pending_) {
          wake_pending_ = true;
          wake_->release();
        }
      }
    })->daemonize();
  }
  waiters_[w]->job = id;
  waiters_[w]->sem->release();
}

void Simulation::finish(int v, uint32_t i, double t) {
  const Hot& h = hot_[tpls_[tpl_of_[v]].hot + i];
  result_.spans[v][i].end = t;
  RankState& rs = state_[v];
  const int s = h.stream;
  ++rs.cursor[s];
  rs.posted &= uint8_t(~(1u << s));
  rs.stream_free[s] = t;
  result_.makespan = std::max(result_.makespan, t);
  ++result_.instructions;
  if ((result_.instructions & 0xfff) == 0) progress(false);
  advance(v, h.wakes);
}

// One line on stderr every few seconds once a simulation has run for a few seconds (rewritten in
// place on a terminal): how far it is, in instructions and simulated time, and how fast it goes.
void Simulation::progress(bool last) {
  constexpr double kFirst = 3.0, kEvery = 2.0;
  const auto now = std::chrono::steady_clock::now();
  const double wall = std::chrono::duration<double>(now - wall0_).count();
  if (!last && (wall < kFirst || std::chrono::duration<double>(now - last_progress_).count() < kEvery)) return;
  if (last && !progress_shown_) return;
  last_progress_ = now;
  progress_shown_ = true;
  const bool tty = ::isatty(2);
  const double done = double(result_.instructions), total = double(std::max<uint64_t>(1, total_instructions_));
  std::fprintf(stderr, "%ssim: %5.1f%% of %llu instructions, simulated %.3f s, %llu flows, %.1f s wall, %.0f k events/s%s",
               tty ? "\r" : "", 100.0 * done / total, (unsigned long long)total_instructions_,
               sg4::Engine::get_clock(), (unsigned long long)result_.flows, wall,
               wall > 0 ? (done + double(result_.flows)) / wall / 1e3 : 0.0, tty && !last ? "" : "\n");
  std::fflush(stderr);
}

// Starts the heads of rank v's `streams` (a bit mask) whose dependencies are done, in stream order.
// A head outside the mask is running or waits for another instruction than the one that just
// ended, so looking at it would start nothing (the mask saves the cache misses of doing so).
void Simulation::advance(int v, unsigned streams) {
  const Tpl& tp = tpls_[tpl_of_[v]];
  const Hot* hot = hot_.data() + tp.hot;
  RankState& rs = state_[v];
  for (int s = 0; s < kStreams; ++s) {
    if (!(streams >> s & 1u) || tp.order[s] + rs.cursor[s] >= tp.order[s + 1]) continue;
    if (rs.posted >> s & 1u) continue;
    const uint32_t i = order_[tp.order[s] + rs.cursor[s]];
    const Hot& h = hot[i];
    double ready = rs.stream_free[s];
    bool blocked = false;
    for (uint32_t d = 0; d < h.deps_count; ++d) {
      const uint32_t dep = tp.deps[h.deps_begin + d];
      if (hot[dep].pos >= rs.cursor[hot[dep].stream]) { blocked = true; break; }
      ready = std::max(ready, result_.spans[v][dep].end);
    }
    if (blocked) continue;
    rs.posted |= uint8_t(1u << s);
    start(v, i, ready);
  }
}

void Simulation::start(int v, uint32_t i, double ready) {
  result_.spans[v][i].start = ready;
  {
    const uint32_t k = tpls_[tpl_of_[v]].hot + i;
    const uint8_t kind = hot_[k].kind;
    if (kind != kOther) {
      double d = secs_[k];
      if (kind == kGpuCompute) {  // the GPU's kernels, not the host's
        if (!opts_.compute_scale.empty()) d *= opts_.compute_scale[v];
        if (opts_.noise_cv > 0) d *= noise_factor(opts_.noise_cv, opts_.noise_seed, vranks_[v].rank, i);
      }
      timer(v, i, ready + d);
      return;
    }
  }
  const VirtualRank& vr = vranks_[v];
  const Instruction& in = inst(v, i);
  const double secs = seconds_[vr.program_index][i];
  const int repeat = std::max(1, in.repeat);
  if (is_collective(in.op)) {
    const int32_t g = lookup(vr.group_map, in.group);
    const int r = rendezvous(g, coll_seq_[tpls_[tpl_of_[v]].hot + i]);
    Rendezvous& rv = rendezvous_[r];
    rv.arrived++;
    const double local = device_.collective_local_seconds(in) * repeat;
    rv.ready = std::max(rv.ready, ready + local);
    rv.members.emplace_back(v, i);
    rv.readies.push_back(ready + local);
    if (rv.arrived < materialized_[g]) return;
    std::vector<int>& open = open_rendezvous_[g];
    open.erase(std::find(open.begin(), open.end(), r));
    if (rv.members.size() > 1) {
      // The last to arrive, if strictly after every other member, held the others up.
      size_t last = 0;
      double second = -INFINITY;
      for (size_t k = 1; k < rv.readies.size(); ++k)
        if (rv.readies[k] > rv.readies[last]) last = k;
      for (size_t k = 0; k < rv.readies.size(); ++k)
        if (k != last) second = std::max(second, rv.readies[k]);
      for (auto& [mv, mi] : rv.members) late_[mv].joined++;
      if (rv.readies[last] > second + 1e-12) {
        Lateness& l = late_[rv.members[last].first];
        l.last++;
        l.waited_for += rv.readies[last] - second;
        l.last_by_kind[int(program_.groups[g].kind)]++;
      }
    }
    const Planned& plan = planned(PlanKey{int(in.op), g, -1, in.bytes, 0}, [](const Simulation& s, const PlanKey& k) {
      const std::vector<int>& ranks = s.program_.groups[k.a].ranks;
      return s.planner_->collective(Op(k.op), k.bytes, ranks);
    });
    for (auto& [mv, mi] : rv.members) result_.spans[mv][mi].start = rv.ready;
    if (plan.plan.closed_form) {
      const std::vector<int>& ranks = program_.groups[g].ranks;
      const double wire = wire_bytes_per_rank(in.op, in.bytes, static_cast<int>(ranks.size())) * repeat;
      const bool nvlink = wire > 0 && ranks.size() > 1 && planner_->is_closed_form(in.op, ranks);
      for (auto& [mv, mi] : rv.members) {
        const double local = device_.collective_local_seconds(inst(mv, mi)) * repeat;  // in rv.ready
        timer(mv, mi, rv.ready + seconds_[vranks_[mv].program_index][mi] - local);
        if (nvlink) {
          if (nvl_up_index_[mv] >= 0) link_bytes_[nvl_up_index_[mv]] += wire;
          if (nvl_down_index_[mv] >= 0) link_bytes_[nvl_down_index_[mv]] += wire;
        }
      }
      free_rendezvous_[g].push_back(r);
      return;
    }
    dispatch(plan, repeat, r, {});
    return;
  }
  if (in.op == Op::Send || in.op == Op::Recv) {
    const int me = vr.rank;
    const int peer = lookup(vr.peer_map, in.peer);
    if (vrank_of(peer) < 0) { timer(v, i, ready + secs); return; }
    const int src = in.op == Op::Send ? me : peer;
    const int dst = in.op == Op::Send ? peer : me;
    const auto key = std::make_tuple(src, dst, in.tag);
    auto it = p2p_.find(key);
    if (it == p2p_.end()) { p2p_.emplace(key, P2PPost{v, i, ready}); return; }
    const P2PPost other = it->second;
    p2p_.erase(it);
    const double t0 = std::max(ready, other.ready);
    result_.spans[v][i].start = t0;
    result_.spans[other.v][other.i].start = t0;
    const Planned& plan = planned(PlanKey{int(Op::Send), src, dst, in.bytes, 0}, [](const Simulation& s, const PlanKey& k) {
      return s.planner_->p2p(k.bytes, k.a, k.b);
    });
    if (plan.plan.closed_form) {
      timer(v, i, t0 + secs);
      timer(other.v, other.i, t0 + seconds_[vranks_[other.v].program_index][other.i]);
      return;
    }
    dispatch(plan, repeat, -1, {{other.v, other.i}, {v, i}});
    return;
  }
  // PCIe copies. The device model's time may exceed the bus's (a CopyD2H of offloaded gradients
  // includes the host's sum of them): the excess follows the flow.
  const auto& gpu = sc_.cluster.gpu;
  const double bus = gpu.pcie_latency + (gpu.pcie_bandwidth > 0 ? in.bytes / gpu.pcie_bandwidth : 0.0);
  // (A CopyH2D's NVMe read precedes the bus in reality; its time is added after the flow alike.)
  const double host_after = in.memory_bytes > 0 ? std::max(0.0, secs - bus) : 0.0;
  const Planned& plan = planned(PlanKey{int(in.op), vr.rank, -1, in.bytes, host_after}, [](const Simulation& s, const PlanKey& k) {
    return s.planner_->copy(Op(k.op), k.bytes, k.a, k.after);
  });
  if (plan.plan.closed_form) { timer(v, i, ready + secs); return; }
  dispatch(plan, repeat, -1, {{v, i}});
}

void Simulation::controller() {
  for (int v = 0; v < static_cast<int>(vranks_.size()); ++v) advance(v, (1u << kStreams) - 1);
  constexpr double kTick = 2e-9;  // SimGrid's timing precision is 1e-9 s
  for (;;) {
    wake_pending_ = false;
    bool any = true;
    while (any) {
      any = false;
      // Waiters may append while the controller finishes (a job of no flows ends at once).
      while (completed_head_ < completed_.size()) {
        const auto [id, t] = completed_[completed_head_++];
        --active_jobs_;
        // finish() may start new jobs (this id among them) and rendezvous, not this one's.
        const Job job = jobs_[id];
        free_jobs_.push_back(id);
        if (job.rendezvous >= 0) {
          const Rendezvous& rv = rendezvous_[job.rendezvous];
          for (auto& [mv, mi] : rv.members) finish(mv, mi, t);
          free_rendezvous_[rv.group].push_back(job.rendezvous);
        } else {
          for (int k = 0; k < job.npair; ++k) finish(job.pair[k].first, job.pair[k].second, t);
        }
        any = true;
      }
      completed_.clear();  // caught up; no waiter runs before the next simcall
      completed_head_ = 0;
      const double now = sg4::Engine::get_clock();
      while (!timers_.empty() && timers_.top_time() <= now + kTick) {
        const TimerQueue::Timer tm = timers_.pop();
        finish(tm.v, tm.i, tm.t);
        any = true;
      }
    }
    if (timers_.empty() && active_jobs_ == 0) break;
    if (timers_.empty()) {
      wake_->acquire();
    } else {
      const double dt = timers_.top_time() - sg4::Engine::get_clock();
      if (dt > kTick) wake_->acquire_timeout(dt);
    }
  }
  // Anything left means the Program deadlocks.
  for (int v = 0; v < static_cast<int>(vranks_.size()); ++v) {
    const Tpl& tp = tpls_[tpl_of_[v]];
    for (int s = 0; s < kStreams; ++s)
      if (tp.order[s] + state_[v].cursor[s] < tp.order[s + 1]) {
        const Instruction& in = inst(v, order_[tp.order[s] + state_[v].cursor[s]]);
        throw std::runtime_error("Program deadlocks in the simulator: rank " + std::to_string(vranks_[v].rank) +
                                 " stream " + to_string(in.stream) + " is stuck at " + to_string(in.op) + " (" +
                                 to_string(in.purpose) + ", micro-batch " + std::to_string(in.micro_batch) + ")");
      }
  }
}

ExecResult Simulation::run() {
  const auto wall0 = std::chrono::steady_clock::now();
  wall0_ = last_progress_ = wall0;
  int argc = 2;
  char arg0[] = "dssim-sim";
  char arg1[] = "--log=root.thres:warning";
  char* argv[] = {arg0, arg1, nullptr};
  sg4::Engine engine(&argc, argv);
  engine.set_config("network/model:CM02");
  engine.set_config("network/crosstraffic:0");
  engine.set_config("network/TCP-gamma:1e300");  // no TCP window cap on a flow's rate
  engine.set_config("contexts/stack-size:256");  // KiB; waiters are shallow

  // Which ranks exist, and which groups each uses.
  int max_rank = 0;
  for (auto& vr : vranks_) max_rank = std::max(max_rank, vr.rank);
  vrank_of_rank_.assign(max_rank + 1, -1);
  std::vector<int> used;
  std::vector<std::vector<int>> represented;
  for (size_t v = 0; v < vranks_.size(); ++v) {
    if (vrank_of_rank_[vranks_[v].rank] >= 0)
      throw std::invalid_argument("simulator: rank " + std::to_string(vranks_[v].rank) + " appears twice");
    vrank_of_rank_[vranks_[v].rank] = static_cast<int>(v);
  }
  for (int r = 0; r <= max_rank; ++r)
    if (vrank_of_rank_[r] >= 0) {
      used.push_back(r);
      represented.push_back(vranks_[vrank_of_rank_[r]].represented);
    }
  bool copies = false;
  for (auto& rp : program_.ranks)
    for (auto& in : rp.instructions) copies = copies || in.op == Op::CopyD2H || in.op == Op::CopyH2D;
  PlatformOptions popts = opts_.platform;
  popts.with_pcie = popts.with_pcie && copies;
  platform_ = std::make_unique<Platform>(sc_.cluster, used, popts, represented);
  planner_ = std::make_unique<CollectivePlanner>(
      CollectivePlanner{sc_.cluster, *platform_, opts_.detail, opts_.nvswitch_closed_form});
  for (size_t k = 0; k < platform_->links().size(); ++k) link_index_[platform_->links()[k].link] = static_cast<int>(k);
  link_bytes_.assign(platform_->links().size(), 0.0);
  nvl_up_index_.assign(vranks_.size(), -1);
  nvl_down_index_.assign(vranks_.size(), -1);
  for (size_t v = 0; v < vranks_.size(); ++v) {
    auto up = link_index_.find(platform_->nvlink_up(vranks_[v].rank));
    auto down = link_index_.find(platform_->nvlink_down(vranks_[v].rank));
    if (up != link_index_.end()) nvl_up_index_[v] = up->second;
    if (down != link_index_.end()) nvl_down_index_[v] = down->second;
  }
  result_.platform_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();

  // Per template: stream order, positions, wake masks, collective sequence numbers, and each compute
  // instruction's kind and seconds. Templates of the same shape (the same streams, dependencies,
  // collective sequence numbers, ops and seconds: every rank of a pipeline stage and TP position
  // when each rank has its own template) share one copy, so that what every instruction's end and
  // a compute instruction's start read stays in the cache whatever the cluster's size.
  static_assert(kStreams <= 8, "Hot::wakes and RankState::posted hold a stream mask in 8 bits");
  size_t total = 0;
  for (const RankProgram& rp : program_.ranks) total += rp.instructions.size();
  if (total > UINT32_MAX) throw std::runtime_error("simulator: more than 2^32 instructions");
  hot_.reserve(total);
  coll_seq_.reserve(total);
  secs_.reserve(total);
  order_.reserve(total);
  tpls_.resize(program_.ranks.size());
  std::unordered_map<uint64_t, std::vector<uint32_t>> shapes;  // shape hash -> templates kept
  std::vector<uint32_t> seqs;
  for (size_t t = 0; t < program_.ranks.size(); ++t) {
    const RankProgram& rp = program_.ranks[t];
    const auto& ins = rp.instructions;
    if (t >= seconds_.size() || seconds_[t].size() < ins.size())
      throw std::invalid_argument("simulator: no seconds for some instructions of rank " + std::to_string(rp.rank));
    seqs.assign(ins.size(), 0);
    std::unordered_map<int, uint32_t> seq;
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
    mix(ins.size());
    for (uint32_t i = 0; i < ins.size(); ++i) {
      if (ins[i].deps_count > UINT16_MAX) throw std::runtime_error("simulator: an instruction with more than 65535 dependencies");
      if (is_collective(ins[i].op)) seqs[i] = seq[ins[i].group]++;
      mix(uint64_t(ins[i].stream) | uint64_t(ins[i].deps_count) << 8 | uint64_t(ins[i].op) << 24 | uint64_t(seqs[i]) << 32);
      uint64_t bits;
      std::memcpy(&bits, &seconds_[t][i], sizeof bits);
      mix(bits);
      for (uint32_t d = 0; d < ins[i].deps_count; ++d) mix(rp.deps[ins[i].deps_begin + d]);
    }
    std::vector<uint32_t>& same = shapes[h];
    bool shared = false;
    for (uint32_t c : same) {
      const Tpl& tc = tpls_[c];
      if (program_.ranks[c].instructions.size() != ins.size()) continue;
      bool eq = true;
      for (uint32_t i = 0; i < ins.size() && eq; ++i) {
        const Hot& hc = hot_[tc.hot + i];
        const Instruction& ic = program_.ranks[c].instructions[i];
        eq = hc.stream == static_cast<uint8_t>(ins[i].stream) && hc.deps_count == ins[i].deps_count &&
             coll_seq_[tc.hot + i] == seqs[i] && ic.op == ins[i].op &&
             std::memcmp(&secs_[tc.hot + i], &seconds_[t][i], sizeof(double)) == 0;
        for (uint32_t d = 0; d < ins[i].deps_count && eq; ++d)
          eq = tc.deps[hc.deps_begin + d] == rp.deps[ins[i].deps_begin + d];
      }
      if (eq) { tpls_[t] = tc; shared = true; break; }
    }
    if (shared) continue;
    same.push_back(static_cast<uint32_t>(t));
    const size_t base = hot_.size();
    hot_.resize(base + ins.size());
    order_.resize(base + ins.size());
    coll_seq_.insert(coll_seq_.end(), seqs.begin(), seqs.end());
    secs_.insert(secs_.end(), seconds_[t].begin(), seconds_[t].begin() + ins.size());
    Tpl& tp = tpls_[t];
    tp.hot = static_cast<uint32_t>(base);
    tp.deps = rp.deps.data();
    Hot* hot = hot_.data() + base;
    uint32_t count[kStreams] = {};
    for (const Instruction& in : ins) ++count[static_cast<int>(in.stream)];
    tp.order[0] = static_cast<uint32_t>(base);
    for (int s = 0; s < kStreams; ++s) tp.order[s + 1] = tp.order[s] + count[s];
    uint32_t fill[kStreams] = {};
    for (uint32_t i = 0; i < ins.size(); ++i) {
      const int s = static_cast<int>(ins[i].stream);
      order_[tp.order[s] + fill[s]] = i;
      hot[i].pos = fill[s]++;
      hot[i].stream = static_cast<uint8_t>(s);
      hot[i].deps_begin = ins[i].deps_begin;
      hot[i].deps_count = static_cast<uint16_t>(ins[i].deps_count);
      if (is_compute(ins[i].op)) hot[i].kind = ins[i].op == Op::HostOptimizerStep ? kHostCompute : kGpuCompute;
      hot[i].wakes |= uint8_t(1u << s);
      for (uint32_t d = 0; d < ins[i].deps_count; ++d) hot[rp.deps[ins[i].deps_begin + d]].wakes |= uint8_t(1u << s);
    }
  }
  hot_.shrink_to_fit();
  order_.shrink_to_fit();
  coll_seq_.shrink_to_fit();
  secs_.shrink_to_fit();
  const size_t nv = vranks_.size();
  state_.assign(nv, RankState{});
  tpl_of_.resize(nv);
  for (size_t v = 0; v < nv; ++v) tpl_of_[v] = vranks_[v].program_index;
  result_.spans.resize(nv);
  late_.assign(nv, Lateness{});
  materialized_.assign(program_.groups.size(), 0);
  open_rendezvous_.assign(program_.groups.size(), {});
  free_rendezvous_.assign(program_.groups.size(), {});
  for (size_t v = 0; v < nv; ++v) {
    const auto& rp = program_.ranks.at(vranks_[v].program_index);
    total_instructions_ += rp.instructions.size();
    result_.spans[v].assign(rp.instructions.size(), Span{});
    std::vector<int32_t> groups;
    for (auto& in : rp.instructions)
      if (is_collective(in.op)) groups.push_back(lookup(vranks_[v].group_map, in.group));
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    for (int32_t g : groups) materialized_.at(g)++;
  }

  wake_ = sg4::Semaphore::create(0);
  // Flow ends, from the network model (see start_flows). A NetworkAction is an Action (its only
  // base), which the public headers declare; the state is the new one.
  sg4::Link::on_communication_state_change_cb(
      [this](simgrid::kernel::resource::NetworkAction& na, simgrid::kernel::resource::Action::State) {
        const auto& a = reinterpret_cast<const simgrid::kernel::resource::Action&>(na);
        const auto st = a.get_state();
        if (st == simgrid::kernel::resource::Action::State::FINISHED ||
            st == simgrid::kernel::resource::Action::State::FAILED)
          flow_ended(a.get_activity());
      });
  std::string error;
  sg4::Actor::create("controller", platform_->driver(), [this, &error] {
    try { controller(); } catch (const std::exception& e) { error = e.what(); }
  });
  engine.run();
  if (!error.empty()) throw std::runtime_error(error);
  progress(true);

  // Busiest links.
  const auto& links = platform_->links();
  std::vector<int> order(links.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int>(k);
  const double T = result_.makespan > 0 ? result_.makespan : 1;
  auto util = [&](int k) { return link_bytes_[k] / (links[k].link->get_bandwidth() * T); };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return util(a) > util(b); });
  for (int k = 0; k < std::min<int>(opts_.busiest_links, order.size()); ++k) {
    const int li = order[k];
    if (link_bytes_[li] <= 0) break;
    result_.links.push_back({{"name", links[li].link->get_name()},
                             {"bandwidth", links[li].link->get_bandwidth() / links[li].scale},
                             {"bytes", link_bytes_[li] / links[li].scale},
                             {"utilization", util(li)}});
  }
  std::map<std::string, std::pair<double, double>> cls;  // class -> (max, sum)
  std::map<std::string, int> cls_n;
  for (size_t k = 0; k < links.size(); ++k) {
    std::string name = links[k].link->get_name();
    std::string c = name.substr(0, name.find('-'));
    if (name.size() > 3 && name.compare(name.size() - 3, 3, "_UP") == 0) c += "_up";
    else if (name.size() > 5 && name.compare(name.size() - 5, 5, "_DOWN") == 0) c += "_down";
    auto& e = cls[c];
    e.first = std::max(e.first, util(static_cast<int>(k)));
    e.second += util(static_cast<int>(k));
    cls_n[c]++;
  }
  for (auto& [c, e] : cls)
    result_.link_classes[c] = {{"links", cls_n[c]}, {"max_utilization", e.first},
                               {"mean_utilization", e.second / cls_n[c]}};
  // The ranks that kept others waiting longest at collectives (at most 16 listed).
  std::vector<int> by_wait;
  for (size_t v = 0; v < late_.size(); ++v)
    if (late_[v].last > 0) by_wait.push_back(static_cast<int>(v));
  std::stable_sort(by_wait.begin(), by_wait.end(), [&](int a, int b) { return late_[a].waited_for > late_[b].waited_for; });
  for (size_t k = 0; k < std::min<size_t>(16, by_wait.size()); ++k) {
    const Lateness& l = late_[by_wait[k]];
    nlohmann::json kinds = nlohmann::json::object();
    for (auto& [kind, n] : l.last_by_kind) kinds[to_string(GroupKind(kind))] = n;
    result_.late.push_back({{"rank", vranks_[by_wait[k]].rank}, {"joined", l.joined}, {"last", l.last},
                            {"waited_for_seconds", l.waited_for}, {"last_by_kind", kinds}});
  }
  result_.engine_wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  return std::move(result_);
}

// --- Running in a child process -------------------------------------------------------------

// The child's result goes through the pipe as it is written: small fields through a buffer, each
// rank's spans straight from their vector (at 131,072 GPUs they are hundreds of MB; building one
// string of them first doubled the child's peak memory and copied every byte twice more).
class PipeWriter {
 public:
  explicit PipeWriter(int fd) : fd_(fd) {}
  ~PipeWriter() { flush(); }
  void write(const void* data, size_t n) {
    if (buf_.size() + n <= kBuffer) {
      buf_.append(static_cast<const char*>(data), n);
      return;
    }
    flush();
    if (n < kBuffer) buf_.append(static_cast<const char*>(data), n);
    else write_all(data, n);
  }
  template <class T> void put(const T& v) { write(&v, sizeof v); }
  void flush() {
    write_all(buf_.data(), buf_.size());
    buf_.clear();
  }

 private:
  static constexpr size_t kBuffer = 1 << 16;
  void write_all(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t k = ::write(fd_, p, n);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) _exit(3);
      p += k;
      n -= static_cast<size_t>(k);
    }
  }
  int fd_;
  std::string buf_;
};

// The parent's side: reads each field into its place; throws on a short result.
class PipeReader {
 public:
  explicit PipeReader(int fd) : fd_(fd) {}
  // Up to n bytes; fewer only at the end of the stream.
  size_t read_some(void* data, size_t n) {
    char* p = static_cast<char*>(data);
    size_t got = 0;
    while (got < n) {
      const ssize_t k = ::read(fd_, p + got, n - got);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) break;
      got += static_cast<size_t>(k);
    }
    return got;
  }
  void read(void* data, size_t n) {
    if (read_some(data, n) != n) throw std::runtime_error("simulator: truncated result from the child");
  }
  template <class T> T get() { T v; read(&v, sizeof v); return v; }
  std::string rest() {
    std::string out;
    char buf[4096];
    for (size_t k; (k = read_some(buf, sizeof buf)) > 0;) out.append(buf, k);
    return out;
  }

 private:
  int fd_;
};

}  // namespace

double noise_factor(double cv, uint64_t seed, int rank, uint32_t instruction) {
  if (cv <= 0) return 1.0;
  // splitmix64 of (seed, rank, instruction): two uniforms, Box-Muller, lognormal of mean 1.
  auto mix = [](uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const uint64_t h = mix(mix(mix(seed) ^ uint64_t(uint32_t(rank))) ^ (uint64_t(instruction) << 1));
  const double u1 = (double(h >> 11) + 0.5) * 0x1.0p-53;
  const double u2 = double(mix(h) >> 11) * 0x1.0p-53;
  const double z = std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
  const double s2 = std::log1p(cv * cv);
  return std::exp(std::sqrt(s2) * z - s2 / 2);
}

ExecResult execute(const Scenario& sc, const Program& program, const std::vector<VirtualRank>& vranks,
                   const std::vector<std::vector<double>>& seconds, const ExecOptions& opts) {
  int fds[2];
  std::fflush(nullptr);  // the child must not flush the parent's buffered output again
  if (::pipe(fds) != 0) throw std::runtime_error("simulator: pipe() failed");
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("simulator: fork() failed");
  if (pid == 0) {
    ::close(fds[0]);
    child_heap::enable();  // small objects from per-size free lists (child_heap.hpp)
    PipeWriter out(fds[1]);
    try {
      ExecResult r = Simulation(sc, program, vranks, seconds, opts).run();
      struct rusage ru{};
      ::getrusage(RUSAGE_SELF, &ru);
      nlohmann::json meta = {{"instructions", r.instructions}, {"flows", r.flows}, {"timers", r.timers},
                             {"jobs", r.jobs}, {"engine_wall_seconds", r.engine_wall_seconds},
                             {"platform_seconds", r.platform_seconds}, {"rss_kb", long(ru.ru_maxrss)},
                             {"links", r.links}, {"link_classes", r.link_classes}, {"late", r.late}};
      const std::string m = meta.dump();
      out.put<char>('O');
      out.put<double>(r.makespan);
      out.put<uint64_t>(m.size());
      out.write(m.data(), m.size());
      out.put<uint64_t>(r.spans.size());
      for (auto& s : r.spans) {
        out.put<uint64_t>(s.size());
        out.write(s.data(), s.size() * sizeof(Span));
      }
    } catch (const std::exception& e) {
      out.put<char>('E');
      out.write(e.what(), std::strlen(e.what()));
    }
    out.flush();
    ::close(fds[1]);
    _exit(0);
  }
  ::close(fds[1]);
  // Read the result into place, then reap the child whatever happened (closing the pipe first, so
  // that a child still writing gets EPIPE instead of blocking).
  ExecResult r;
  nlohmann::json meta;
  std::string error, read_error;
  char tag = 0;
  try {
    PipeReader in(fds[0]);
    if (in.read_some(&tag, 1) != 1) throw std::runtime_error("simulator: no result from the child");
    if (tag == 'E') {
      error = in.rest();
    } else {
      r.makespan = in.get<double>();
      std::string m(in.get<uint64_t>(), '\0');
      in.read(m.data(), m.size());
      meta = nlohmann::json::parse(m);
      const uint64_t n = in.get<uint64_t>();
      if (n > vranks.size()) throw std::runtime_error("simulator: malformed result from the child");
      r.spans.resize(n);
      for (auto& s : r.spans) {
        const uint64_t k = in.get<uint64_t>();
        if (k > (uint64_t(1) << 40) / sizeof(Span)) throw std::runtime_error("simulator: malformed result from the child");
        s.resize(k);
        in.read(s.data(), k * sizeof(Span));
      }
    }
  } catch (const std::exception& e) {
    read_error = e.what();
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || tag == 0)
    throw std::runtime_error("simulator: the simulation process failed (status " + std::to_string(status) + ")");
  if (!read_error.empty()) throw std::runtime_error(read_error);
  if (tag == 'E') throw std::runtime_error(error);
  r.instructions = meta["instructions"];
  r.flows = meta["flows"];
  r.timers = meta["timers"];
  r.jobs = meta["jobs"];
  r.engine_wall_seconds = meta["engine_wall_seconds"];
  r.platform_seconds = meta["platform_seconds"];
  r.child_peak_rss_kb = meta["rss_kb"];
  r.links = meta["links"];
  r.link_classes = meta["link_classes"];
  r.late = meta["late"];
  return r;
}

}  // namespace dssim::sim
