#include "backends/sim/sim_backend.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include "core/collective_model.hpp"
#include "core/estimator.hpp"
#include "core/grid.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"
#include "simulator/executor.hpp"
#include "simulator/trace.hpp"
#include <sys/resource.h>

namespace dssim {

SimOptions::CollectiveDetail parse_collective_detail(const std::string& s) {
  if (s == "phase") return SimOptions::CollectiveDetail::Phase;
  if (s == "step") return SimOptions::CollectiveDetail::Step;
  throw std::invalid_argument("--collective-detail must be 'phase' or 'step', not '" + s + "'");
}

namespace {

// Groups by (rank, kind): which groups of a kind a rank belongs to.
class GroupIndex {
 public:
  explicit GroupIndex(const Program& p) : p_(p) {
    for (size_t g = 0; g < p.groups.size(); ++g) {
      const auto& ranks = p.groups[g].ranks;
      for (size_t k = 0; k < ranks.size(); ++k)
        index_[key(ranks[k], p.groups[g].kind)].push_back({static_cast<int>(g), static_cast<int>(k)});
    }
  }
  // The group of `kind` containing `rank` at `position` with `size` members, or -1.
  int find(int rank, GroupKind kind, int position = -1, size_t size = 0) const {
    auto it = index_.find(key(rank, kind));
    if (it == index_.end()) return -1;
    for (auto [g, pos] : it->second)
      if ((position < 0 || pos == position) && (size == 0 || p_.groups[g].ranks.size() == size)) return g;
    return -1;
  }
  int position(int rank, int group) const {
    const auto& r = p_.groups[group].ranks;
    auto it = std::find(r.begin(), r.end(), rank);
    return it == r.end() ? -1 : static_cast<int>(it - r.begin());
  }

 private:
  static uint64_t key(int rank, GroupKind k) { return (uint64_t(uint32_t(rank)) << 8) | uint64_t(k); }
  const Program& p_;
  std::unordered_map<uint64_t, std::vector<std::pair<int, int>>> index_;
};

bool tp_closed_form(const ClusterSpec& c, const Program& p, bool nvswitch_closed_form) {
  if (!nvswitch_closed_form || c.intra_node != "nvswitch") return false;
  const int gpn = std::max(1, c.gpus_per_node);
  for (const Group& g : p.groups) {
    if (g.kind != GroupKind::TP || g.ranks.size() <= 1) continue;
    for (int r : g.ranks)
      if (r / gpn != g.ranks[0] / gpn) return false;
  }
  return true;
}

// The member at `position` of the TP group of `rank` (the TP shift that maps a representative's
// world onto its k-th TP peer's); `rank` itself when it has no TP group.
int tp_shift(const GroupIndex& gi, const Program& p, int rank, int position) {
  const int g = gi.find(rank, GroupKind::TP);
  if (g < 0) return position == 0 ? rank : -1;
  const int me = gi.position(rank, g);
  const auto& r = p.groups[g].ranks;
  const int k = me + position;
  return k < static_cast<int>(r.size()) ? r[k] : -1;
}

// Member q (TP position k) of a TP group runs the representative's program, TP-shifted by k:
// same ops, costs, streams and dependencies; groups and peers are the shifted ones.
bool tp_isomorphic(const GroupIndex& gi, const Program& p, const RankProgram& rep, const RankProgram& q, int k) {
  if (rep.instructions.size() != q.instructions.size() || rep.deps != q.deps) return false;
  for (size_t i = 0; i < rep.instructions.size(); ++i) {
    const Instruction& a = rep.instructions[i];
    const Instruction& b = q.instructions[i];
    if (a.op != b.op || a.stream != b.stream || a.purpose != b.purpose || a.micro_batch != b.micro_batch ||
        a.repeat != b.repeat || a.flops != b.flops || a.bytes != b.bytes || a.memory_bytes != b.memory_bytes ||
        a.gemm_flops != b.gemm_flops || a.ops != b.ops || a.tag != b.tag || a.deps_begin != b.deps_begin ||
        a.deps_count != b.deps_count)
      return false;
    if (a.peer >= 0 && tp_shift(gi, p, a.peer, k) != b.peer) return false;
    if (a.group >= 0) {
      const Group& ga = p.groups[a.group];
      const Group& gb = p.groups[b.group];
      if (ga.kind != gb.kind || ga.ranks.size() != gb.ranks.size()) return false;
      if (ga.kind == GroupKind::TP) { if (a.group != b.group) return false; continue; }
      for (size_t j = 0; j < ga.ranks.size(); ++j)
        if (tp_shift(gi, p, ga.ranks[j], k) != gb.ranks[j]) return false;
    }
  }
  return true;
}

struct Plan {
  std::vector<sim::VirtualRank> vranks;
  bool folded_tp = false;
  bool expanded = false;
  int represented = 0;
};

Plan plan_ranks(const Scenario& sc, const Program& p, const SimOptions& opts) {
  Plan plan;
  const GroupIndex gi(p);
  // MoE with tp > 1: TP peers share expert-parallel / expert-data-parallel groups (core/grid.hpp),
  // so one TP rank cannot stand for its peers.
  const bool fold_ok = opts.symmetry && opts.what_ifs.empty() && tp_closed_form(sc.cluster, p, opts.nvswitch_closed_form) &&
                       !(sc.model.is_moe() && sc.parallel.tp > 1);
  auto represented_of = [&](int rank) {
    std::vector<int> out;
    const int g = gi.find(rank, GroupKind::TP);
    if (g >= 0) out = p.groups[g].ranks;
    return out;
  };
  if (!p.representative_only) {
    std::vector<int> index_of(p.world > 0 ? p.world : 0, -1);
    for (size_t i = 0; i < p.ranks.size(); ++i) {
      if (p.ranks[i].rank >= static_cast<int>(index_of.size())) index_of.resize(p.ranks[i].rank + 1, -1);
      index_of[p.ranks[i].rank] = static_cast<int>(i);
    }
    bool fold = fold_ok;
    std::set<int> reps;
    if (fold) {
      for (size_t i = 0; i < p.ranks.size() && fold; ++i) {
        const int r = p.ranks[i].rank;
        const int g = gi.find(r, GroupKind::TP);
        if (g < 0 || p.groups[g].ranks[0] == r) { reps.insert(r); continue; }
        const int rep = p.groups[g].ranks[0];
        const int k = gi.position(r, g);
        const int ri = rep < static_cast<int>(index_of.size()) ? index_of[rep] : -1;
        fold = ri >= 0 && tp_isomorphic(gi, p, p.ranks[ri], p.ranks[i], k);
      }
      // Flow-modeled groups and peers of representatives must be representatives themselves.
      for (size_t i = 0; i < p.ranks.size() && fold; ++i) {
        if (!reps.count(p.ranks[i].rank)) continue;
        for (const Instruction& in : p.ranks[i].instructions) {
          if (in.peer >= 0 && !reps.count(in.peer) && in.peer < static_cast<int>(index_of.size()) &&
              index_of[in.peer] >= 0) { fold = false; break; }
          if (in.group >= 0 && p.groups[in.group].kind != GroupKind::TP)
            for (int m : p.groups[in.group].ranks)
              if (!reps.count(m) && m < static_cast<int>(index_of.size()) && index_of[m] >= 0) { fold = false; break; }
          if (!fold) break;
        }
      }
    }
    plan.folded_tp = fold;
    for (size_t i = 0; i < p.ranks.size(); ++i) {
      const int r = p.ranks[i].rank;
      if (fold && !reps.count(r)) continue;
      sim::VirtualRank vr;
      vr.rank = r;
      vr.program_index = static_cast<int>(i);
      if (fold) vr.represented = represented_of(r);
      plan.represented += fold ? std::max<int>(1, vr.represented.size()) : 1;
      plan.vranks.push_back(std::move(vr));
    }
    return plan;
  }
  // One representative per stage: expand to the stage's replicas (DP / EP peers, and TP peers
  // unless folded), renaming groups by kind and position, and peers through the PP groups.
  plan.expanded = true;
  plan.folded_tp = fold_ok;
  for (size_t t = 0; t < p.ranks.size(); ++t) {
    const RankProgram& rp = p.ranks[t];
    const int r0 = rp.rank;
    std::set<int> replicas{r0};
    std::vector<int> frontier{r0};
    std::vector<GroupKind> kinds{GroupKind::DP, GroupKind::EP, GroupKind::ExpertDP};
    if (!fold_ok) kinds.push_back(GroupKind::TP);
    while (!frontier.empty()) {
      const int r = frontier.back();
      frontier.pop_back();
      for (GroupKind k : kinds) {
        const int g = gi.find(r, k);
        if (g < 0) continue;
        for (int m : p.groups[g].ranks)
          if (replicas.insert(m).second) frontier.push_back(m);
      }
    }
    std::vector<int> groups_used, peers_used;
    for (const Instruction& in : rp.instructions) {
      if (in.group >= 0) groups_used.push_back(in.group);
      if (in.peer >= 0) peers_used.push_back(in.peer);
    }
    std::sort(groups_used.begin(), groups_used.end());
    groups_used.erase(std::unique(groups_used.begin(), groups_used.end()), groups_used.end());
    std::sort(peers_used.begin(), peers_used.end());
    peers_used.erase(std::unique(peers_used.begin(), peers_used.end()), peers_used.end());
    const int pp0 = gi.find(r0, GroupKind::PP);
    const int pp0_pos = pp0 >= 0 ? gi.position(r0, pp0) : -1;
    for (int v : replicas) {
      sim::VirtualRank vr;
      vr.rank = v;
      vr.program_index = static_cast<int>(t);
      if (fold_ok) vr.represented = represented_of(v);
      plan.represented += fold_ok ? std::max<int>(1, vr.represented.size()) : 1;
      if (v != r0) {
        for (int g : groups_used) {
          const Group& grp = p.groups[g];
          if (gi.position(v, g) >= 0) continue;  // v is a member too: same group
          // v's own group of the kind: at r0's position when the kind's groups are laid out alike
          // (DP, EP), else wherever v sits in it (expert-data-parallel groups of another expert).
          int g2 = gi.find(v, grp.kind, gi.position(r0, g), grp.ranks.size());
          if (g2 < 0) g2 = gi.find(v, grp.kind, -1, grp.ranks.size());
          if (g2 < 0)
            throw std::runtime_error("simulator: cannot expand stage representative " + std::to_string(r0) +
                                     " to rank " + std::to_string(v) + ": no " + to_string(grp.kind) + " group");
          vr.group_map.emplace_back(g, g2);
        }
        if (!peers_used.empty()) {
          const int ppv = pp0 >= 0 ? gi.find(v, GroupKind::PP, pp0_pos) : -1;
          for (int peer : peers_used) {
            const int pos = pp0 >= 0 ? gi.position(peer, pp0) : -1;
            if (ppv < 0 || pos < 0)
              throw std::runtime_error("simulator: cannot map peer " + std::to_string(peer) + " of rank " +
                                       std::to_string(r0) + " to rank " + std::to_string(v));
            vr.peer_map.emplace_back(peer, p.groups[ppv].ranks[pos]);
          }
        }
      }
      plan.vranks.push_back(std::move(vr));
    }
  }
  std::sort(plan.vranks.begin(), plan.vranks.end(),
            [](const sim::VirtualRank& a, const sim::VirtualRank& b) { return a.rank < b.rank; });
  return plan;
}

// Measure of [a, b) covered by sorted, disjoint intervals.
double covered(const std::vector<std::pair<double, double>>& iv, double a, double b) {
  double s = 0;
  auto it = std::lower_bound(iv.begin(), iv.end(), std::make_pair(a, a),
                             [](const auto& x, const auto& y) { return x.second < y.first; });
  for (; it != iv.end() && it->first < b; ++it) s += std::max(0.0, std::min(b, it->second) - std::max(a, it->first));
  return s;
}

const char* comm_kind(const Program& p, const Instruction& in) {
  if (in.op == Op::Send || in.op == Op::Recv) return "pp";
  if (in.op == Op::CopyD2H || in.op == Op::CopyH2D) return "offload";
  if (in.group >= 0) return to_string(p.groups[in.group].kind);
  return "other";
}

}  // namespace

// A Program of stage representatives only lists the groups its ranks use; expanding it to the
// other ranks of each stage needs theirs too, which the scenario's process grid gives.
Program with_all_groups(const Scenario& sc, const Program& program) {
  Program ext = program;
  ProcessGrid grid(sc.parallel);
  if (grid.world() != program.world) return ext;
  std::set<std::pair<int, std::vector<int>>> have;
  std::set<GroupKind> kinds{GroupKind::TP, GroupKind::DP, GroupKind::PP};
  for (const Group& g : program.groups) { have.insert({int(g.kind), g.ranks}); kinds.insert(g.kind); }
  for (GroupKind k : kinds) {
    if (k == GroupKind::World) continue;
    for (auto& members : grid.groups(k))
      if (!members.empty() && have.insert({int(k), members}).second) ext.groups.push_back({k, members});
  }
  return ext;
}

SimRun simulate_program_run(const Scenario& sc, const Program& given, const SimOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  const Program extended = given.representative_only ? with_all_groups(sc, given) : Program{};
  const Program& program = given.representative_only ? extended : given;
  check_what_ifs(sc, opts.what_ifs);
  sim::ExecOptions eo;
  eo.detail = opts.detail == SimOptions::CollectiveDetail::Step ? sim::CollectiveDetail::Step
                                                               : sim::CollectiveDetail::Phase;
  eo.nvswitch_closed_form = opts.nvswitch_closed_form;
  eo.platform.nodes_per_leaf = opts.nodes_per_leaf;
  eo.platform.leaves_per_pod = opts.leaves_per_pod;
  eo.busiest_links = opts.busiest_links;
  std::map<int, double> slow;  // rank -> kernel time factor
  for (const WhatIf& w : opts.what_ifs) {
    switch (w.kind) {
      case WhatIf::Kind::SlowGpu:
        for (int r : w.ranks) slow[r] = (slow.count(r) ? slow[r] : 1.0) / w.factor;
        break;
      case WhatIf::Kind::Link: {
        const std::string why = sim::link_name_problem(sc.cluster, eo.platform, w.link);
        if (!why.empty()) throw ConfigError("what-if '" + w.spec + "': " + why);
        if (w.factor == 0) {  // down: only a NIC's traffic can go elsewhere (another NIC of its node)
          int node = -1, rail = -1;
          if (std::sscanf(w.link.c_str(), "nic-%d-%d", &node, &rail) != 2)
            throw ConfigError("what-if '" + w.spec + "': traffic cannot be rerouted around " + w.link +
                              " in this topology (one route: a star of leaves, one uplink per leaf and rail); "
                              "degrade it instead, e.g. 'link " + w.link + " x0.01'");
          eo.platform.nic_down.insert({node, rail});
          break;
        }
        auto& f = eo.platform.link_factor.emplace(w.link, 1.0).first->second;
        f *= w.factor;
        if (w.link.rfind("nvlink-", 0) == 0) eo.nvswitch_closed_form = false;  // the closed form assumes every port at speed
        break;
      }
      case WhatIf::Kind::Nic: {
        const auto [name, share] = sim::nic_link(sc.cluster, w.node, w.nic);
        if (w.factor == 0 && share == 1.0) {  // the rail's only NIC: reroute through another NIC
          eo.platform.nic_down.insert({w.node, std::stoi(name.substr(name.rfind('-') + 1))});
          break;
        }
        auto& f = eo.platform.link_factor.emplace(name, 1.0).first->second;
        f *= 1 - share * (1 - w.factor);  // down with NICs aggregated per rail: the others carry it
        break;
      }
      case WhatIf::Kind::Node:
        for (int j = 0; j < sim::rails_of(sc.cluster); ++j) {
          auto& f = eo.platform.link_factor.emplace("nic-" + std::to_string(w.node) + "-" + std::to_string(j), 1.0).first->second;
          f *= w.factor;
        }
        break;
      case WhatIf::Kind::Noise:
        eo.noise_cv = w.factor;
        eo.noise_seed = opts.noise_seed;
        break;
      case WhatIf::Kind::Background:
        eo.platform.fabric_factor *= 1 - w.factor;
        break;
    }
  }
  // Every NIC of a node down: nothing to reroute through.
  for (const auto& [node, rail] : eo.platform.nic_down) {
    int working = 0;
    for (int j = 0; j < sim::rails_of(sc.cluster); ++j) working += !eo.platform.nic_down.count({node, j});
    if (working == 0)
      throw ConfigError("what-ifs: every NIC of node " + std::to_string(node) + " is down (cluster.nics_per_node " +
                        std::to_string(sc.cluster.nics_per_node) + "): its GPUs cannot reach other nodes; "
                        "degrade them instead ('node " + std::to_string(node) + " down-links x0.1')");
  }
  SimOptions plan_opts = opts;
  if (!eo.nvswitch_closed_form) plan_opts.nvswitch_closed_form = false;
  Plan plan = plan_ranks(sc, program, plan_opts);
  const auto seconds = instruction_seconds(sc, program);
  if (!slow.empty()) {
    eo.compute_scale.assign(plan.vranks.size(), 1.0);
    for (size_t v = 0; v < plan.vranks.size(); ++v)
      if (auto it = slow.find(plan.vranks[v].rank); it != slow.end()) eo.compute_scale[v] = it->second;
  }
  sim::ExecResult ex = sim::execute(sc, program, plan.vranks, seconds, eo);

  SimRun run;
  run.ranks_represented = plan.represented;
  run.flows = ex.flows;
  run.instructions = ex.instructions;
  run.engine_seconds = ex.engine_wall_seconds;
  run.timeline.makespan = ex.makespan;
  for (auto& vr : plan.vranks) { run.ranks.push_back(vr.rank); run.templates.push_back(vr.program_index); }
  run.timeline.spans = std::move(ex.spans);

  // A Timeline over Program::ranks for make_report: each program rank gets the spans of the
  // slowest simulated rank running its instructions, or of the rank that represents it.
  const size_t nr = program.ranks.size();
  std::vector<int> chosen(nr, -1);
  std::vector<double> rank_end(run.ranks.size(), 0);
  for (size_t k = 0; k < run.ranks.size(); ++k) {
    for (const Span& s : run.timeline.spans[k]) rank_end[k] = std::max(rank_end[k], s.end);
    int& c = chosen[run.templates[k]];
    if (c < 0 || rank_end[k] > rank_end[c] * (1 + 1e-12)) c = static_cast<int>(k);
  }
  std::unordered_map<int, int> sim_of_rank;
  for (size_t k = 0; k < run.ranks.size(); ++k) {
    if (plan.vranks[k].represented.empty()) sim_of_rank[run.ranks[k]] = static_cast<int>(k);
    for (int q : plan.vranks[k].represented) sim_of_rank[q] = static_cast<int>(k);
  }
  Timeline full;
  full.makespan = ex.makespan;
  full.spans.resize(nr);
  for (size_t i = 0; i < nr; ++i) {
    int k = chosen[i];
    if (k < 0) {
      auto it = sim_of_rank.find(program.ranks[i].rank);
      if (it == sim_of_rank.end()) throw std::runtime_error("simulator: rank without a timeline");
      k = it->second;
    }
    full.spans[i] = run.timeline.spans[k];
  }
  Report r = make_report(sc, program, full, "sim");
  int crit_index = 0;
  for (size_t i = 0; i < nr; ++i)
    if (program.ranks[i].rank == r.critical_rank) crit_index = static_cast<int>(i);
  if (chosen[crit_index] >= 0) r.critical_rank = run.ranks[chosen[crit_index]];

  // --- What only the simulation tells --------------------------------------------------------
  nlohmann::json sim;
  // Exposed vs overlapped communication per group kind: overlapped = the part of a communication
  // instruction's span during which its rank's compute stream was busy computing.
  std::map<std::string, std::array<double, 2>> comm_crit, comm_sum;  // kind -> {total, overlapped}
  std::vector<double> bubbles(run.ranks.size(), 0);
  struct Slack { double end, slack, busy; int rank; };
  std::vector<Slack> slack;
  // attribute_time reads one rank's spans: one Timeline of empty spans serves every simulated rank
  // (its spans lent in and out), not a Timeline of nr rows per rank, which was O(ranks^2).
  Timeline one;
  one.makespan = ex.makespan;
  one.spans.resize(nr);
  for (size_t k = 0; k < run.ranks.size(); ++k) {
    const RankProgram& rp = program.ranks[run.templates[k]];
    const auto& sp = run.timeline.spans[k];
    std::vector<std::pair<double, double>> busy;
    double busy_s = 0;
    for (size_t i = 0; i < rp.instructions.size(); ++i)
      if (rp.instructions[i].stream == Stream::Compute && is_compute(rp.instructions[i].op) && sp[i].end > sp[i].start) {
        busy.emplace_back(sp[i].start, sp[i].end);
        busy_s += sp[i].end - sp[i].start;
      }
    std::sort(busy.begin(), busy.end());
    const bool is_crit = run.ranks[k] == r.critical_rank;
    for (size_t i = 0; i < rp.instructions.size(); ++i) {
      const Instruction& in = rp.instructions[i];
      if (is_compute(in.op)) continue;
      const double d = sp[i].end - sp[i].start;
      const double ov = in.stream == Stream::Compute ? 0.0 : covered(busy, sp[i].start, sp[i].end);
      auto& s = comm_sum[comm_kind(program, in)];
      s[0] += d; s[1] += ov;
      if (is_crit) { auto& c = comm_crit[comm_kind(program, in)]; c[0] += d; c[1] += ov; }
    }
    one.spans[run.templates[k]].swap(run.timeline.spans[k]);
    const TimeBreakdown tb = attribute_time(program, one, run.templates[k]);
    one.spans[run.templates[k]].swap(run.timeline.spans[k]);
    bubbles[k] = tb.bubble;
    slack.push_back({rank_end[k], ex.makespan - rank_end[k], busy_s, run.ranks[k]});
  }
  const double nsim = std::max<size_t>(1, run.ranks.size());
  nlohmann::json comm = nlohmann::json::object();
  for (auto& [kind, s] : comm_sum) {
    const auto c = comm_crit.count(kind) ? comm_crit[kind] : std::array<double, 2>{0, 0};
    comm[kind] = {{"critical_rank", {{"seconds", c[0]}, {"overlapped_seconds", c[1]}, {"exposed_seconds", c[0] - c[1]}}},
                  {"mean_per_rank", {{"seconds", s[0] / nsim}, {"overlapped_seconds", s[1] / nsim},
                                     {"exposed_seconds", (s[0] - s[1]) / nsim}}}};
  }
  sim["communication"] = comm;
  double bmean = 0, bmax = 0;
  for (double b : bubbles) { bmean += b / nsim; bmax = std::max(bmax, b); }
  const int pp = sc.parallel.pp, m = sc.training.grad_accum;
  sim["bubble"] = {{"critical_rank_seconds", r.time.bubble},
                   {"critical_rank_fraction", ex.makespan > 0 ? r.time.bubble / ex.makespan : 0.0},
                   {"mean_seconds", bmean}, {"max_seconds", bmax},
                   {"ideal_1f1b_fraction", pp > 1 && m > 0 ? double(pp - 1) / (m + pp - 1) : 0.0},
                   // With pp = 1 there is no pipeline: the wait is for other ranks at collectives.
                   {"kind", pp > 1 ? "pipeline" : "waiting_for_other_ranks"}};
  sim["links"] = {{"busiest", ex.links}, {"classes", ex.link_classes}};
  // Stragglers: the ranks that end last set the iteration time; slack = how much later they
  // could have finished without delaying it.
  std::stable_sort(slack.begin(), slack.end(), [](const Slack& a, const Slack& b) { return a.slack < b.slack; });
  nlohmann::json st = nlohmann::json::array();
  for (size_t k = 0; k < std::min<size_t>(8, slack.size()); ++k)
    st.push_back({{"rank", slack[k].rank}, {"end_seconds", slack[k].end}, {"slack_seconds", slack[k].slack},
                  {"compute_busy_seconds", slack[k].busy}});
  double max_slack = slack.empty() ? 0 : slack.back().slack;
  std::string why = "compute";
  {
    const TimeBreakdown& t = r.time;
    const std::pair<double, const char*> parts[] = {
        {t.exposed_tp, "exposed tensor-parallel communication"}, {t.exposed_pp, "exposed pipeline communication"},
        {t.exposed_dp, "exposed data-parallel communication"}, {t.exposed_ep, "exposed expert all-to-all"},
        {t.exposed_offload, "exposed offload traffic"}, {t.bubble, "pipeline bubble"},
        {t.forward + t.backward + t.recompute + t.optimizer, "compute"}};
    double best = -1;
    for (auto& [v, name] : parts) if (v > best) { best = v; why = name; }
  }
  sim["critical_path"] = {{"straggler_rank", r.critical_rank}, {"dominant", why},
                          {"ranks_by_slack", st}, {"max_slack_seconds", max_slack},
                          {"late_at_collectives", ex.late}};
  sim["simulation"] = {{"ranks_simulated", run.ranks.size()}, {"ranks_represented", plan.represented},
                       {"folded_tensor_parallel", plan.folded_tp}, {"expanded_stage_representatives", plan.expanded},
                       {"collective_detail", opts.detail == SimOptions::CollectiveDetail::Step ? "step" : "phase"},
                       {"flows", ex.flows}, {"instructions", ex.instructions}, {"timers", ex.timers},
                       {"comm_jobs", ex.jobs}};
  // Wall-clock figures of this run: the only part of the report that varies between runs.
  sim["run_stats"] = {{"engine_wall_seconds", ex.engine_wall_seconds}, {"platform_seconds", ex.platform_seconds},
                      {"peak_rss_kb", ex.child_peak_rss_kb}};
  r.extras["sim"] = sim;

  if (!opts.trace_path.empty())
    sim::write_chrome_trace(opts.trace_path, program, run.ranks, run.templates, run.timeline.spans, opts.trace_ranks);
  run.report = std::move(r);
  run.peak_rss_kb = ex.child_peak_rss_kb;
  run.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

SimRun simulate_run(const Scenario& sc, const SimOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  BuildOptions bo;
  bo.representative_only = opts.symmetry;
  const Program program = build_program(sc, bo);
  SimRun run = simulate_program_run(sc, program, opts);
  run.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

Report simulate(const Scenario& sc, const SimOptions& opts) { return simulate_run(sc, opts).report; }

Report simulate_what_if(const Scenario& sc, const SimOptions& opts, int samples) {
  check_what_ifs(sc, opts.what_ifs);
  SimOptions clean_opts = opts;
  clean_opts.what_ifs.clear();
  clean_opts.trace_path.clear();
  const Report clean = simulate(sc, clean_opts);
  bool noise = false;
  double cv = 0;
  std::vector<std::string> specs;
  for (const WhatIf& w : opts.what_ifs) {
    specs.push_back(w.spec);
    if (w.kind == WhatIf::Kind::Noise) { noise = true; cv = w.factor; }
  }
  if (samples < 1) throw ConfigError("--samples must be at least 1, got " + std::to_string(samples));
  const int n = noise ? samples : 1;
  Report r;
  std::vector<double> its;
  for (int k = 0; k < n; ++k) {
    SimOptions o = opts;
    o.noise_seed = opts.noise_seed + uint64_t(k);
    if (k > 0) o.trace_path.clear();
    Report rk = simulate(sc, o);
    its.push_back(rk.iteration_seconds);
    if (k == 0) r = std::move(rk);
  }
  const double t0 = clean.iteration_seconds;
  const double t = r.iteration_seconds;
  nlohmann::json w;
  w["specs"] = specs;
  w["clean_iteration_seconds"] = t0;
  w["iteration_seconds"] = t;
  w["change"] = t0 > 0 ? t / t0 - 1 : 0.0;
  w["clean_time_seconds"] = {{"compute", clean.time.forward + clean.time.backward + clean.time.recompute + clean.time.optimizer},
                             {"exposed_communication", clean.time.exposed_tp + clean.time.exposed_pp + clean.time.exposed_dp +
                                                           clean.time.exposed_ep + clean.time.exposed_offload},
                             {"bubble", clean.time.bubble}, {"idle", clean.time.idle}};
  w["time_seconds"] = {{"compute", r.time.forward + r.time.backward + r.time.recompute + r.time.optimizer},
                       {"exposed_communication", r.time.exposed_tp + r.time.exposed_pp + r.time.exposed_dp +
                                                     r.time.exposed_ep + r.time.exposed_offload},
                       {"bubble", r.time.bubble}, {"idle", r.time.idle}};
  // The rank that kept the others waiting longest at collectives.
  std::string summary;
  {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%+.1f%%", 100 * w["change"].get<double>());
    summary = buf;
  }
  const auto& late = r.extras["sim"]["critical_path"]["late_at_collectives"];
  if (std::abs(t - t0) <= 1e-9 * t0) {
    summary += ": no change (what the what-ifs touch is not on the critical path, or has headroom)";
  } else if (!late.empty()) {
    const auto& s = late[0];
    w["straggler"] = s;
    std::string kinds;
    for (auto& [kind, cnt] : s["last_by_kind"].items())
      kinds += (kinds.empty() ? "" : ", ") + kind + " " + std::to_string(cnt.get<uint64_t>());
    char buf[256];
    std::snprintf(buf, sizeof buf, ": rank %d arrived last at %llu of the %llu collectives it joined (%s); the others waited %.3f s for it",
                  s["rank"].get<int>(), (unsigned long long)s["last"].get<uint64_t>(),
                  (unsigned long long)s["joined"].get<uint64_t>(), kinds.c_str(), s["waited_for_seconds"].get<double>());
    summary += buf;
  }
  w["summary"] = summary;
  if (noise) {
    double mean = 0, var = 0;
    for (double x : its) mean += x / n;
    for (double x : its) var += (x - mean) * (x - mean);
    const double sd = n > 1 ? std::sqrt(var / (n - 1)) : 0.0;
    w["noise"] = {{"cv", cv}, {"samples", n}, {"seed", opts.noise_seed}, {"iteration_seconds", its},
                  {"mean_seconds", mean}, {"stddev_seconds", sd},
                  {"min_seconds", *std::min_element(its.begin(), its.end())},
                  {"max_seconds", *std::max_element(its.begin(), its.end())},
                  {"mean_change", t0 > 0 ? mean / t0 - 1 : 0.0}};
  }
  r.extras["what_if"] = w;
  return r;
}
Report simulate_program(const Scenario& sc, const Program& program, const SimOptions& opts) {
  return simulate_program_run(sc, program, opts).report;
}

}  // namespace dssim
