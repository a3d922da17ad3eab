#include "core/plan.hpp"
#include "core/reliability.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <tuple>

#include "core/estimator.hpp"
#include "core/pipeline_partition.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "core/validate.hpp"

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace dssim {

const char* to_string(PlanDim d) {
  switch (d) {
    case PlanDim::tp: return "tp";
    case PlanDim::pp: return "pp";
    case PlanDim::micro_batch: return "micro_batch";
    case PlanDim::zero: return "zero";
    case PlanDim::recompute: return "recompute";
    case PlanDim::interleave: return "interleave";
    case PlanDim::sequence_parallel: return "sequence_parallel";
    case PlanDim::offload: return "offload";
    case PlanDim::ep: return "ep";
    case PlanDim::lora_rank: return "lora_rank";
    case PlanDim::checkpointing: return "checkpointing";
  }
  return "?";
}

std::optional<PlanDim> parse_plan_dim(const std::string& s) {
  for (int i = 0; i < kPlanDims; ++i)
    if (s == to_string(static_cast<PlanDim>(i))) return static_cast<PlanDim>(i);
  if (s == "mb") return PlanDim::micro_batch;
  if (s == "sp") return PlanDim::sequence_parallel;
  return std::nullopt;
}

const char* to_string(Offload o) {
  return o == Offload::none ? "none" : o == Offload::optimizer ? "optimizer" : "optimizer+params";
}

const char* to_string(PlanObjective o) {
  return o == PlanObjective::throughput ? "throughput" : o == PlanObjective::cost ? "cost" : "time-to-train";
}

std::optional<PlanObjective> parse_plan_objective(const std::string& s) {
  if (s == "throughput") return PlanObjective::throughput;
  if (s == "cost") return PlanObjective::cost;
  if (s == "time-to-train" || s == "time_to_train") return PlanObjective::time_to_train;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Points

int PlanPoint::value(PlanDim d) const {
  switch (d) {
    case PlanDim::tp: return tp;
    case PlanDim::pp: return pp;
    case PlanDim::micro_batch: return micro_batch;
    case PlanDim::zero: return zero;
    case PlanDim::recompute: return static_cast<int>(recompute);
    case PlanDim::interleave: return interleave;
    case PlanDim::sequence_parallel: return sequence_parallel ? 1 : 0;
    case PlanDim::offload: return static_cast<int>(offload);
    case PlanDim::ep: return ep;
    case PlanDim::lora_rank: return lora_rank;
    case PlanDim::checkpointing: return checkpointing;
  }
  return 0;
}

std::string PlanPoint::key() const {
  char buf[128];
  std::snprintf(buf, sizeof buf, "tp%d.pp%d.dp%d.mb%d.z%d.rc%d.v%d.sp%d.off%d.ep%d", tp, pp, dp, micro_batch, zero,
                static_cast<int>(recompute), interleave, sequence_parallel ? 1 : 0, static_cast<int>(offload), ep);
  std::string k = buf;
  if (lora_rank > 0) k += ".r" + std::to_string(lora_rank);
  if (checkpointing > 0) k += ".ck" + std::to_string(checkpointing);
  return k;
}

std::string PlanPoint::label() const {
  std::ostringstream o;
  o << "TP" << tp << " PP" << pp << " DP" << dp;
  if (ep > 1) o << " EP" << ep;
  if (interleave > 1) o << " v" << interleave;
  if (sequence_parallel) o << " SP";
  o << " | mb " << micro_batch << " | ZeRO-" << zero;
  if (offload == Offload::optimizer) o << " opt-offload";
  if (offload == Offload::optimizer_and_params) o << " opt+param-offload";
  o << " | "
    << (recompute == Recompute::none           ? "no recompute"
        : recompute == Recompute::selective    ? "selective"
        : recompute == Recompute::selective_op ? "op-level SAC"
                                               : "full recompute");
  if (checkpointing > 0) o << (checkpointing == 1 ? " partitioned" : " partitioned+cpu");
  if (lora_rank > 0) o << " | LoRA r" << lora_rank;
  return o.str();
}

std::string PlanPoint::family() const {
  std::string f;
  auto add = [&](const char* s) { f += (f.empty() ? "" : "+") + std::string(s); };
  if (tp > 1) add("TP");
  if (pp > 1) add("PP");
  if (dp > 1) add("DP");
  if (ep > 1) add("EP");
  if (f.empty()) f = "single GPU";
  if (zero == 3) f += " ZeRO-3";
  return f;
}

PlanPoint point_of(const Scenario& sc) {
  PlanPoint p;
  p.tp = sc.parallel.tp;
  p.pp = sc.parallel.pp;
  p.dp = sc.parallel.dp;
  p.ep = sc.parallel.ep;
  p.micro_batch = sc.training.micro_batch;
  p.zero = sc.zero.stage;
  p.interleave = sc.parallel.interleave;
  p.sequence_parallel = sc.parallel.sequence_parallel;
  p.recompute = sc.recompute;
  p.offload = sc.zero.offload_param ? Offload::optimizer_and_params
              : sc.zero.offload_optimizer ? Offload::optimizer : Offload::none;
  p.lora_rank = sc.finetune.lora() ? sc.finetune.rank : 0;
  p.checkpointing = sc.checkpointing.offloads(sc.recompute) ? 2 : sc.checkpointing.partitions(sc.recompute) ? 1 : 0;
  return p;
}

namespace {

// Layers per stage for (pp, interleave, ep), resolved once per search: the balanced partitions are
// a dynamic programme over the layer list.
struct PartitionCache {
  std::map<std::tuple<int, int, int>, std::pair<std::vector<int>, std::string>> done;
  std::map<std::tuple<int, int, int>, std::string> failed;
};

Scenario apply_point_cached(const Scenario& base, const PlanPoint& p, PartitionCache* cache) {
  Scenario s = base;
  s.warnings.clear();
  auto& par = s.parallel;
  par.tp = p.tp;
  par.pp = p.pp;
  par.dp = p.dp;
  par.ep = p.ep;
  par.interleave = p.interleave;
  par.sequence_parallel = p.sequence_parallel;
  s.training.micro_batch = p.micro_batch;
  const int64_t per_step = int64_t(p.micro_batch) * p.dp;
  s.training.grad_accum = per_step > 0 ? static_cast<int>(s.training.global_batch / per_step) : 0;
  s.zero.stage = p.zero;
  s.zero.offload_optimizer = p.offload != Offload::none;
  s.zero.offload_param = p.offload == Offload::optimizer_and_params;
  s.recompute = p.recompute;
  if (p.lora_rank > 0) s.finetune.rank = p.lora_rank;
  if (p.recompute == Recompute::full) {  // the options act on the full recompute's checkpoints only
    s.checkpointing.partition_activations = p.checkpointing >= 1;
    s.checkpointing.cpu_checkpointing = p.checkpointing >= 2;
  }
  if (p.pp == base.parallel.pp && p.interleave == base.parallel.interleave && p.ep == base.parallel.ep) return s;
  const auto key = std::make_tuple(p.pp, p.interleave, p.ep);
  if (cache) {
    if (auto it = cache->done.find(key); it != cache->done.end()) {
      par.partition = it->second.first;
      par.partition_method = it->second.second;
      return s;
    }
    if (auto it = cache->failed.find(key); it != cache->failed.end()) throw ConfigError(it->second);
  }
  par.partition.clear();
  // DeepSpeed's pipeline engine partitions by parameters (PipelineModule's default); otherwise
  // dssim's default method (uniform when pp divides the layers, megatron when interleaving).
  par.partition_method = base.parallel.pipeline_engine == PipelineEngine::deepspeed && p.interleave == 1 && p.pp > 1
                             ? "parameters" : "";
  try {
    resolve_pipeline_partition(s);
  } catch (const ConfigError& e) {
    if (cache) cache->failed[key] = e.what();
    throw;
  }
  if (cache) cache->done[key] = {par.partition, par.partition_method};
  return s;
}

std::vector<int> divisors(int64_t n, int64_t cap) {
  std::vector<int> d;
  for (int64_t i = 1; i <= n && i <= cap; ++i)
    if (n % i == 0) d.push_back(static_cast<int>(i));
  return d;
}

void add_unique(std::vector<int>& v, int x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
  std::sort(v.begin(), v.end());
}

bool fits(const Scenario& s, const MemoryBreakdown& m) {
  return m.total() <= s.cluster.gpu.memory_bytes &&
         m.host * s.cluster.gpus_per_node <= s.cluster.host_memory_bytes;
}

// The constraints of a search: which values each dimension takes.
struct Space {
  const Scenario& base;  // resized to the plan's GPU count
  int gpus = 0;
  std::array<bool, kPlanDims> vary{};
  std::vector<PlanFix> fixes;
  int max_tp = 0;

  std::optional<int> fixed(const char* key) const {
    for (const auto& f : fixes)
      if (f.key == key) return f.value;
    return std::nullopt;
  }
  bool varies(PlanDim d) const { return vary[static_cast<int>(d)]; }
  // The values of a dimension: its candidates when varied, else the base's; a fix wins.
  std::vector<int> values(PlanDim d, std::vector<int> candidates, int base_value, const char* fix_key) const {
    if (auto f = fixed(fix_key)) return {*f};
    if (!varies(d)) return {base_value};
    return candidates;
  }
  bool admits(const PlanPoint& p) const {
    if (auto f = fixed("parallel.dp"); f && p.dp != *f) return false;
    if (auto f = fixed("zero.offload_optimizer"); f && (p.offload != Offload::none) != (*f != 0)) return false;
    if (auto f = fixed("zero.offload_param"); f && (p.offload == Offload::optimizer_and_params) != (*f != 0)) return false;
    return true;
  }
};

// Every point of the space that the fixes admit, in a fixed order: `f(point)`.
template <class F>
void for_each_point(const Space& sp, F&& f) {
  const Scenario& b = sp.base;
  const int n = sp.gpus;
  const int64_t batch = b.training.global_batch;
  const int layers = b.model.layers;
  std::vector<int> tps = sp.values(PlanDim::tp, divisors(n, sp.max_tp), b.parallel.tp, "parallel.tp");
  if (sp.varies(PlanDim::tp) && !sp.fixed("parallel.tp") && n % b.parallel.tp == 0) add_unique(tps, b.parallel.tp);
  std::vector<int> zeros = sp.values(PlanDim::zero, {0, 1, 2, 3}, b.zero.stage, "zero.stage");
  std::vector<int> recomputes = sp.values(PlanDim::recompute, {0, 1, 2}, static_cast<int>(b.recompute), "activation_checkpointing");
  std::vector<int> sps = sp.values(PlanDim::sequence_parallel, {0, 1}, b.parallel.sequence_parallel, "parallel.sequence_parallel");
  const PlanPoint bp = point_of(b);
  // The two offload keys constrain one dimension: with either fixed, all three values are generated
  // and Space::admits keeps those that agree.
  const bool offload_fixed = sp.fixed("zero.offload_optimizer") || sp.fixed("zero.offload_param");
  std::vector<int> offloads = offload_fixed ? std::vector<int>{0, 1, 2}
                                            : sp.values(PlanDim::offload, {0, 1, 2}, static_cast<int>(bp.offload), "zero.offload");
  // LoRA rank: 4 .. 64 (the ranks the LoRA paper and PEFT recipes use), LoRA scenarios only.
  std::vector<int> ranks = b.finetune.lora() ? sp.values(PlanDim::lora_rank, {4, 8, 16, 32, 64}, b.finetune.rank, "finetune.rank")
                                             : std::vector<int>{0};
  if (b.finetune.lora() && sp.varies(PlanDim::lora_rank) && !sp.fixed("finetune.rank")) add_unique(ranks, b.finetune.rank);
  const int base_ck = bp.checkpointing;
  std::vector<int> eps = sp.values(PlanDim::ep, b.model.is_moe() ? divisors(b.model.experts, b.model.experts) : std::vector<int>{1},
                                   b.parallel.ep, "parallel.ep");
  for (int tp : tps) {
    if (tp < 1 || n % tp != 0) continue;
    std::vector<int> pps = sp.values(PlanDim::pp, divisors(n / tp, layers), b.parallel.pp, "parallel.pp");
    for (int pp : pps) {
      if (pp < 1 || (n / tp) % pp != 0) continue;
      const int dp = n / (tp * pp);
      std::vector<int> mbs = sp.values(PlanDim::micro_batch, batch % dp == 0 ? divisors(batch / dp, batch) : std::vector<int>{1},
                                       b.training.micro_batch, "training.micro_batch");
      std::vector<int> vs{1};
      if (pp > 1)
        for (int v = 2; v * pp <= layers; ++v)
          if (layers % v == 0) vs.push_back(v);
      vs = sp.values(PlanDim::interleave, vs, b.parallel.interleave, "parallel.interleave");
      if (sp.varies(PlanDim::interleave) && !sp.fixed("parallel.interleave") && pp == b.parallel.pp)
        add_unique(vs, b.parallel.interleave);
      for (int ep : eps)
        for (int mb : mbs)
          for (int z : zeros)
            for (int rc : recomputes)
              for (int v : vs)
                for (int s : sps)
                  for (int off : offloads)
                    for (int r : ranks)
                      for (int ck : rc == static_cast<int>(Recompute::full)
                                        ? sp.values(PlanDim::checkpointing, {0, 1, 2}, base_ck, "(not a --fix key)")
                                        : std::vector<int>{0}) {
                    PlanPoint p;
                    p.tp = tp; p.pp = pp; p.dp = dp; p.ep = ep; p.micro_batch = mb; p.zero = z;
                    p.recompute = static_cast<Recompute>(rc);
                    p.interleave = v;
                    p.sequence_parallel = s != 0;
                    p.offload = static_cast<Offload>(off);
                    p.lora_rank = r;
                    p.checkpointing = ck;
                    if (sp.admits(p)) f(p);
                  }
    }
  }
}

}  // namespace

bool refused_early(const Scenario& base, const PlanPoint& p) {
  // validate's ZeRO, offload, SP and interleave rules on the values apply_point sets: most refused
  // points of a search (GPT-3 175B: 73k of 84k) fail one of these, and building their scenario to
  // have validate throw and unwind was ~13% of a search.
  if (p.zero >= 2 && p.pp > 1) return true;
  if (p.offload == Offload::optimizer_and_params && p.zero != 3) return true;
  if (p.offload != Offload::none && p.zero == 0) return true;
  if (p.sequence_parallel && p.tp == 1) return true;
  if (p.interleave > 1) {
    if (p.pp == 1) return true;
    const int64_t per_step = int64_t(p.micro_batch) * p.dp;
    const int grad_accum = per_step > 0 ? static_cast<int>(base.training.global_batch / per_step) : 0;
    if (grad_accum % p.pp != 0) return true;
  }
  return false;
}

namespace {

// Every point of the space, validated; `visit(point, scenario, memory)` for each valid one that
// fits. `progress`, when set, is told about every 2% of the points (counted first) and at the end.
template <class Visit>
void enumerate(const Space& sp, PlanResult& res, PartitionCache& cache, Visit&& visit,
               const std::function<void(const PlanProgress&)>& progress = {}) {
  PlanProgress pr;
  pr.phase = PlanProgress::enumerating;
  pr.gpus = sp.gpus;
  if (progress) for_each_point(sp, [&](const PlanPoint&) { ++pr.total; });
  const size_t step = std::max<size_t>(1, pr.total / 50);
  for_each_point(sp, [&](const PlanPoint& p) {
    ++res.enumerated;
    if (progress && (res.enumerated % step == 0 || res.enumerated == pr.total)) {
      pr.done = res.enumerated;
      pr.fitting = res.enumerated - res.invalid - res.too_big - 1;  // this point is not sized yet
      progress(pr);
    }
    if (!res.first_invalid.empty() && refused_early(sp.base, p)) {  // (the first keeps validate's message)
      ++res.invalid;
      return;
    }
    Scenario sc;
    try {
      sc = apply_point_cached(sp.base, p, &cache);
      validate(sc);
    } catch (const ConfigError& e) {
      ++res.invalid;
      if (res.first_invalid.empty()) res.first_invalid = e.what();
      return;
    }
    const MemoryBreakdown m = peak_memory(sc);
    if (!res.smallest_point || m.total() < res.smallest_memory.total()) {
      res.smallest_point = p;
      res.smallest_memory = m;
    }
    if (!fits(sc, m)) {
      ++res.too_big;
      return;
    }
    visit(p, std::move(sc), m);
  });
}

Space make_space(const Scenario& resized, const PlanOptions& o) {
  Space sp{resized, 0, {}, {}, 0};
  sp.gpus = resized.cluster.world();
  if (o.vary.empty()) {
    sp.vary.fill(true);
    // Searched only when named: the LoRA rank changes what is trained (quality, not only speed),
    // and the checkpointing options are for runs that do not fit otherwise.
    sp.vary[static_cast<int>(PlanDim::lora_rank)] = false;
    sp.vary[static_cast<int>(PlanDim::checkpointing)] = false;
  }
  for (PlanDim d : o.vary) sp.vary[static_cast<int>(d)] = true;
  sp.fixes = o.fixes;
  sp.max_tp = o.max_tp > 0 ? o.max_tp : resized.cluster.gpus_per_node;
  return sp;
}

Scenario resized(const Scenario& base, int gpus) {
  Scenario s = base;
  if (gpus > 0 && gpus != base.cluster.world()) resize_cluster(s.cluster, gpus);
  return s;
}

double objective_of(PlanObjective o, double tokens_per_second, int gpus) {
  if (!(tokens_per_second > 0)) return INFINITY;
  return o == PlanObjective::cost ? gpus / tokens_per_second : 1.0 / tokens_per_second;
}

// The analytic estimate at `grad_accum` micro-batches (global batch scaled to match), and, with
// `busy`, how long each stream of each materialized rank is busy (the fast path's steadiness check).
struct Evaluation {
  PlanScore score;
  std::vector<double> busy;  // [rank index * kStreams + stream] seconds
};

}  // namespace

// The Programs of one configuration, kept for the next one of its family (score_scenario).
struct PipelineReuse {
  struct Kept { int grad_accum; std::unique_ptr<EvaluatedProgram> e; };
  std::vector<Kept> refs;  // the last configuration's, to evaluate against
  std::vector<Kept> next;  // this configuration's, kept when `keep`
  bool keep = false;
  const EvaluatedProgram* find(int grad_accum) const {
    for (const Kept& k : refs)
      if (k.grad_accum == grad_accum) return k.e.get();
    return nullptr;
  }
};

namespace {

Evaluation evaluate_at(const Scenario& sc, int grad_accum, bool collapse, CollectivePrices* prices, StagePlanCache* stage_plans,
                       PipelineReuse* reuse, bool busy = false) {
  Scenario s = sc;
  s.training.grad_accum = grad_accum;
  s.training.global_batch = int64_t(grad_accum) * s.training.micro_batch * s.parallel.dp;
  BuildOptions bo;
  bo.representative_only = true;
  bo.collapse_chains = collapse;
  bo.stage_plans = stage_plans;
  Program program = build_program(s, bo);
  std::vector<double> members;
  const EvaluatedProgram* ref = reuse ? reuse->find(grad_accum) : nullptr;
  CommonPrefix common;
  std::vector<std::vector<double>> seconds = ref ? instruction_seconds_reusing(s, program, &members, prices, *ref, &common)
                                                 : instruction_seconds(s, program, &members, prices);
  Timeline tl;
  if (!ref || !evaluate_program_reusing(program, seconds, *ref, tl, &common)) tl = evaluate_program(program, seconds);
  tl.chain_member_seconds = std::move(members);
  Evaluation r;
  r.score.iteration_seconds = tl.makespan;
  if (!program.ranks.empty()) r.score.time = attribute_time(program, tl, critical_rank_index(tl));
  if (busy) {
    r.busy.assign(program.ranks.size() * kStreams, 0.0);
    for (size_t ri = 0; ri < program.ranks.size(); ++ri) {
      const auto& ins = program.ranks[ri].instructions;
      for (size_t i = 0; i < ins.size(); ++i)
        r.busy[ri * kStreams + static_cast<int>(ins[i].stream)] += tl.spans[ri][i].end - tl.spans[ri][i].start;
    }
  }
  if (reuse && reuse->keep) {
    auto e = std::make_unique<EvaluatedProgram>();
    e->program = std::move(program);
    e->seconds = std::move(seconds);
    e->timeline = std::move(tl);
    e->pricing = std::make_shared<const PricingInputs>(s);
    reuse->next.push_back({grad_accum, std::move(e)});
  }
  return r;
}

}  // namespace

Scenario apply_point(const Scenario& base, const PlanPoint& p) { return apply_point_cached(base, p, nullptr); }

// ---------------------------------------------------------------------------------------------
// Fixes

namespace {

struct FixKey {
  const char* key;
  enum Kind { integer, boolean, recompute } kind;
};
constexpr FixKey kFixKeys[] = {
    {"parallel.tp", FixKey::integer},          {"parallel.pp", FixKey::integer},
    {"parallel.dp", FixKey::integer},          {"parallel.ep", FixKey::integer},
    {"parallel.interleave", FixKey::integer},  {"training.micro_batch", FixKey::integer},
    {"zero.stage", FixKey::integer},           {"parallel.sequence_parallel", FixKey::boolean},
    {"zero.offload_optimizer", FixKey::boolean}, {"zero.offload_param", FixKey::boolean},
    {"activation_checkpointing", FixKey::recompute}, {"finetune.rank", FixKey::integer},
};

}  // namespace

bool is_plan_key(const std::string& key) {
  for (const auto& k : kFixKeys)
    if (key == k.key) return true;
  return false;
}

PlanFix parse_plan_fix(const std::string& key, const std::string& value) {
  for (const auto& k : kFixKeys) {
    if (key != k.key) continue;
    const std::string at = "--fix " + key + "=" + value + ": ";
    switch (k.kind) {
      case FixKey::integer: {
        size_t used = 0;
        int v = 0;
        try {
          v = std::stoi(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != value.size() || value.empty()) throw ConfigError(at + "expected an integer (e.g. --fix " + key + "=8)");
        if (v < (key == "zero.stage" ? 0 : 1) || (key == "zero.stage" && v > 3))
          throw ConfigError(at + (key == "zero.stage" ? "expected 0, 1, 2 or 3" : "must be at least 1"));
        return {key, v};
      }
      case FixKey::boolean:
        if (value == "true" || value == "1" || value == "yes") return {key, 1};
        if (value == "false" || value == "0" || value == "no") return {key, 0};
        throw ConfigError(at + "expected true or false");
      case FixKey::recompute:
        if (value == "none" || value == "false") return {key, static_cast<int>(Recompute::none)};
        if (value == "selective") return {key, static_cast<int>(Recompute::selective)};
        if (value == "full" || value == "true") return {key, static_cast<int>(Recompute::full)};
        throw ConfigError(at + "expected none, selective or full");
    }
  }
  throw ConfigError("--fix " + key + ": not a key the planner searches");
}

// ---------------------------------------------------------------------------------------------
// Scoring

std::array<int, 3> extrapolation_points(const Scenario& sc) {
  // Past its first micro-batches a pipeline is in its steady state: each further micro-batch adds
  // the same time to every part of the breakdown. The estimator's T(m) is, in effect, the largest
  // of lines A_k + m S_k, one per pipeline stage k (S_k: its time per micro-batch), so it bends
  // up until the slowest stage's line takes over, after a transient that grows with how close the
  // stages are (1F1B: GPT-3 175B with even stages none; 96 layers on 64 stages until m = pp / 2;
  // GPT 13B, 40 layers on 32 stages, until m = 1.7 pp or 3 pp). Three consecutive counts are
  // evaluated from m1 = max(pp, 4) (consecutive, so that a schedule alternating between two
  // patterns shows as two slopes), and the line through the last two is used when the first agrees
  // with it and no stream of any rank is busier per micro-batch than the line grows (one that is
  // falls behind: a slower stage's line still to take over; score_scenario). Otherwise, or when
  // the three cost more than the whole iteration, the whole iteration is evaluated.
  // Interleaved schedules are always evaluated whole: their transients also come from latencies
  // (GPT 13B on pp 4, v 2 steadies at m = 20, the MoE scenario on pp 2, v 3 later than m = 16, no
  // stream falling behind), and points placed after them cost more than the whole iteration for
  // every interleaved configuration of GPT-3 175B on 1024 GPUs.
  const int pp = sc.parallel.pp;
  if (sc.parallel.interleave > 1) return {0, 0, 0};
  const int m1 = std::max(pp, 4), m2 = m1 + 1, m3 = m2 + 1;
  if (sc.training.grad_accum <= m1 + m2 + m3) return {0, 0, 0};
  return {m1, m2, m3};
}

PlanScore score_scenario(const Scenario& sc, bool exact, bool collapse, CollectivePrices* prices, StagePlanCache* stage_plans,
                         PipelineReuse* reuse) {
  const auto [m1, m2, m3] = exact ? std::array<int, 3>{0, 0, 0} : extrapolation_points(sc);
  if (m1 == 0) return evaluate_at(sc, sc.training.grad_accum, collapse, prices, stage_plans, reuse).score;
  // Steady between two evaluations: no stream of any rank is busy longer per micro-batch than the
  // makespan grows (one that is falls further behind with every micro-batch: a slower stage whose
  // line has not taken over yet).
  auto steady = [](const Evaluation& x, const Evaluation& y, int mx, int my) {
    const double slope = (y.score.iteration_seconds - x.score.iteration_seconds) / (my - mx);
    double busiest = 0;
    for (size_t i = 0; i < x.busy.size() && i < y.busy.size(); ++i)
      busiest = std::max(busiest, (y.busy[i] - x.busy[i]) / (my - mx));
    return busiest <= slope * (1 + 1e-6);
  };
  const Evaluation ea = evaluate_at(sc, m1, collapse, prices, stage_plans, reuse, true), eb = evaluate_at(sc, m2, collapse, prices, stage_plans, reuse, true);
  if (!steady(ea, eb, m1, m2)) return evaluate_at(sc, sc.training.grad_accum, collapse, prices, stage_plans, reuse).score;
  const Evaluation ec = evaluate_at(sc, m3, collapse, prices, stage_plans, reuse, true);
  const PlanScore &a = ea.score, &b = eb.score, &c = ec.score;
  const double s12 = (b.iteration_seconds - a.iteration_seconds) / (m2 - m1);
  const double s23 = (c.iteration_seconds - b.iteration_seconds) / (m3 - m2);
  if (std::abs(s23 - s12) > 1e-6 * std::abs(s23) || !steady(eb, ec, m2, m3))
    return evaluate_at(sc, sc.training.grad_accum, collapse, prices, stage_plans, reuse).score;  // not steady yet
  const double k = double(sc.training.grad_accum - m2) / double(m3 - m2);
  auto line = [&](double x, double y) { return x + k * (y - x); };
  PlanScore r;
  r.extrapolated = true;
  r.iteration_seconds = line(b.iteration_seconds, c.iteration_seconds);
  const TimeBreakdown &ta = b.time, &tb = c.time;
  TimeBreakdown& t = r.time;
  t.forward = line(ta.forward, tb.forward);
  t.backward = line(ta.backward, tb.backward);
  t.recompute = line(ta.recompute, tb.recompute);
  t.optimizer = line(ta.optimizer, tb.optimizer);
  t.exposed_tp = line(ta.exposed_tp, tb.exposed_tp);
  t.exposed_pp = line(ta.exposed_pp, tb.exposed_pp);
  t.exposed_dp = line(ta.exposed_dp, tb.exposed_dp);
  t.exposed_ep = line(ta.exposed_ep, tb.exposed_ep);
  t.exposed_offload = line(ta.exposed_offload, tb.exposed_offload);
  t.bubble = line(ta.bubble, tb.bubble);
  t.idle = line(ta.idle, tb.idle);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Entries

namespace {

std::vector<std::pair<std::string, double>> parts(const TimeBreakdown& t) {
  return {{"compute", t.forward + t.backward + t.recompute + t.optimizer},
          {"TP", t.exposed_tp}, {"PP", t.exposed_pp}, {"DP", t.exposed_dp}, {"EP", t.exposed_ep},
          {"offload", t.exposed_offload}, {"bubble", t.bubble + t.idle}};
}

}  // namespace

std::pair<std::string, double> PlanEntry::dominant() const {
  std::pair<std::string, double> best{"compute", -1};
  for (auto& p : parts(time))
    if (p.second > best.second) best = p;
  return best;
}

std::pair<std::string, double> PlanEntry::largest_overhead() const {
  std::pair<std::string, double> best{"none", 0};
  for (auto& p : parts(time))
    if (p.first != "compute" && p.second > best.second) best = p;
  return best;
}

namespace {

// A search builds and frees thousands of Programs, up to tens of MB each. glibc's defaults hand
// such blocks back to the kernel on every free (mmap / munmap, trimming the heap), and the kernel
// zeroes the pages again on the next touch: for GPT-3 175B on 1024 GPUs, ~16% of perf's samples
// were page faults, page clearing and unmapping, and scoring ran 1.6x faster (bench_plan) with
// freed memory kept in the process's heap (the high-water mark stays resident, 113 MB for that
// search). Set once per process, on the first search.
void keep_freed_memory() {
#ifdef __GLIBC__
  static const bool once = [] {
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
    return true;
  }();
  (void)once;
#endif
}

}  // namespace

PlanResult plan(const Scenario& base_in, const PlanOptions& o) {
  keep_freed_memory();
  const auto t0 = std::chrono::steady_clock::now();
  const Scenario base = resized(base_in, o.gpus);
  const Space sp = make_space(base, o);
  PlanResult res;
  res.gpus = sp.gpus;
  res.global_batch = base.training.global_batch;
  PartitionCache cache;
  struct Candidate { PlanPoint point; Scenario scenario; MemoryBreakdown memory; };
  std::vector<Candidate> fitting;
  enumerate(sp, res, cache, [&](const PlanPoint& p, Scenario&& s, const MemoryBreakdown& m) {
    fitting.push_back({p, std::move(s), m});
  }, o.progress);

  const auto t1 = std::chrono::steady_clock::now();
  res.enumerate_seconds = std::chrono::duration<double>(t1 - t0).count();
  const size_t total = fitting.size();
  const size_t step = std::max<size_t>(1, total / 50);
  PlanProgress pr;
  pr.phase = PlanProgress::scoring;
  pr.gpus = sp.gpus;
  pr.total = total;
  pr.fitting = total;
  res.ranked.reserve(total);
  CollectivePrices prices;  // every point of this search runs on the same cluster
  StagePlanCache stage_plans;  // and is apply_point of one base scenario
  // Configurations that differ only in ZeRO 0 / 1 and the optimizer offload emit the same pipeline
  // (they differ from the last micro-batch's gradient reductions on): scored one after the other,
  // each takes what it shares of its timeline from the one before (PipelineReuse). The order of
  // scoring does not change the ranking (sorted below, ties on the key).
  const auto family = [](const PlanPoint& p) -> std::string {
    if (p.zero > 1 || p.offload == Offload::optimizer_and_params) return {};
    PlanPoint f = p;
    f.zero = 0;
    f.offload = Offload::none;
    return f.key();
  };
  std::vector<std::string> families(total);
  std::vector<size_t> scoring;
  scoring.reserve(total);
  {
    std::map<std::string, std::vector<size_t>> members;
    for (size_t i = 0; i < total; ++i) {
      families[i] = family(fitting[i].point);
      if (!families[i].empty()) members[families[i]].push_back(i);
    }
    for (size_t i = 0; i < total; ++i) {
      if (families[i].empty()) {
        scoring.push_back(i);
        continue;
      }
      auto it = members.find(families[i]);
      if (it == members.end()) continue;  // (placed with its family's first)
      scoring.insert(scoring.end(), it->second.begin(), it->second.end());
      members.erase(it);
    }
  }
  PipelineReuse reuse;
  for (size_t n = 0; n < total; ++n) {
    const size_t i = scoring[n];
    const Candidate& c = fitting[i];
    const bool same_family = n > 0 && !families[i].empty() && families[scoring[n - 1]] == families[i];
    if (!same_family) reuse.refs.clear();
    reuse.keep = n + 1 < total && !families[i].empty() && families[scoring[n + 1]] == families[i];
    const PlanScore score = score_scenario(c.scenario, o.exact, true, &prices, &stage_plans, &reuse);
    if (reuse.keep) reuse.refs = std::move(reuse.next);
    reuse.next.clear();
    if (score.extrapolated) ++res.extrapolated;
    Report r;
    r.iteration_seconds = score.iteration_seconds;
    fill_throughput(c.scenario, r);
    PlanEntry e;
    e.point = c.point;
    e.iteration_seconds = score.iteration_seconds;
    e.time = score.time;
    e.memory = c.memory;
    e.capacity = c.scenario.cluster.gpu.memory_bytes;
    e.tokens_per_second = r.tokens_per_second;
    e.mfu = r.mfu;
    e.time_to_train_seconds = c.scenario.training.tokens_to_train > 0 ? r.time_to_train_seconds
                                                                      : (r.tokens_per_second > 0 ? 1e9 / r.tokens_per_second : 0);
    if (c.scenario.reliability.declared && e.iteration_seconds > 0) {
      e.goodput = goodput_report(c.scenario, e.iteration_seconds, /*monte_carlo=*/false).goodput;
      e.time_to_train_seconds /= e.goodput;
    }
    e.gpu_hours = sp.gpus * e.time_to_train_seconds / 3600;
    // Throughput ranks by tokens/s of an iteration; cost and time to train by what the run delivers.
    e.objective = objective_of(o.objective, r.tokens_per_second * (o.objective == PlanObjective::throughput ? 1 : e.goodput),
                               sp.gpus);
    res.ranked.push_back(std::move(e));
    if (!pr.best || res.ranked.back().objective < pr.best->objective ||
        (res.ranked.back().objective == pr.best->objective && res.ranked.back().point.key() < pr.best->point.key()))
      pr.best = &res.ranked.back();  // reserved: the pointer stays valid until the sort below
    if (o.progress && ((n + 1) % step == 0 || n + 1 == total)) {
      pr.done = n + 1;
      o.progress(pr);
    }
  }
  // Sort keys once: objective, then the stable key.
  std::vector<std::pair<std::string, size_t>> keys;
  keys.reserve(res.ranked.size());
  for (size_t i = 0; i < res.ranked.size(); ++i) keys.emplace_back(res.ranked[i].point.key(), i);
  std::vector<size_t> order(res.ranked.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const double oa = res.ranked[a].objective, ob = res.ranked[b].objective;
    if (oa != ob) return oa < ob;
    return keys[a].first < keys[b].first;
  });
  std::vector<PlanEntry> sorted;
  sorted.reserve(order.size());
  for (size_t i : order) sorted.push_back(std::move(res.ranked[i]));
  res.ranked = std::move(sorted);

  if (base_in.cluster.world() == sp.gpus) {
    res.base_point = point_of(base_in);
    const std::string k = res.base_point->key();
    for (size_t i = 0; i < res.ranked.size(); ++i)
      if (res.ranked[i].point.key() == k) { res.base_rank = i; break; }
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.score_seconds = res.seconds - res.enumerate_seconds;
  return res;
}

// ---------------------------------------------------------------------------------------------
// When nothing fits

namespace {

std::optional<FitHint> least_memory_fit(const Scenario& base_in, const PlanOptions& o, int gpus) {
  Scenario base;
  try {
    base = resized(base_in, gpus);
  } catch (const ConfigError&) {
    return std::nullopt;
  }
  PlanOptions opts = o;
  opts.gpus = gpus;
  const Space sp = make_space(base, opts);
  PlanResult res;
  PartitionCache cache;
  std::optional<FitHint> best;
  enumerate(sp, res, cache, [&](const PlanPoint& p, Scenario&&, const MemoryBreakdown& m) {
    if (!best || m.total() < best->memory.total()) best = FitHint{gpus, p, m};
  });
  return best;
}

}  // namespace

std::optional<FitHint> smallest_fitting_gpus(const Scenario& base, const PlanOptions& o) {
  const int n0 = o.gpus > 0 ? o.gpus : base.cluster.world();
  const int node = base.cluster.gpus_per_node;
  for (int n = n0 * 2; n <= n0 * 64; n *= 2) {
    const int g = n >= node && n % node != 0 ? (n / node + 1) * node : n;
    if (auto h = least_memory_fit(base, o, g)) return h;
  }
  return std::nullopt;
}

std::optional<FitHint> fit_without_fixes(const Scenario& base, const PlanOptions& o) {
  if (o.fixes.empty() && o.vary.empty()) return std::nullopt;
  PlanOptions free = o;
  free.fixes.clear();
  free.vary.clear();
  return least_memory_fit(base, free, o.gpus > 0 ? o.gpus : base.cluster.world());
}

std::string megatron_args(const Scenario& sc) {
  const ParallelSpec& p = sc.parallel;
  std::ostringstream o;
  o << "--tensor-model-parallel-size " << p.tp << "\n";
  o << "--pipeline-model-parallel-size " << p.pp << "\n";
  if (p.interleave > 1) o << "--num-layers-per-virtual-pipeline-stage " << sc.model.layers / (p.pp * p.interleave) << "\n";
  if (p.sequence_parallel) o << "--sequence-parallel\n";
  if (sc.model.is_moe() && p.ep > 1) o << "--expert-model-parallel-size " << p.ep << "\n";
  o << "--micro-batch-size " << sc.training.micro_batch << "\n";
  o << "--global-batch-size " << sc.training.global_batch << "\n";
  if (sc.recompute == Recompute::selective) o << "--recompute-activations\n";
  if (sc.recompute == Recompute::full)
    o << "--recompute-granularity full\n--recompute-method uniform\n--recompute-num-layers 1\n";
  if (sc.recompute == Recompute::selective_op)
    o << "# op-level selective checkpointing (torchtitan's selective_ac_option op) has no Megatron flag\n";
  if (p.scatter_gather) o << "# scatter/gather of pipeline activations is Megatron's default with tp > 1\n";
  if (sc.precision.dtype == Dtype::bf16) o << "--bf16\n";
  if (sc.precision.dtype == Dtype::fp16) o << "--fp16\n";
  return o.str();
}

// ---------------------------------------------------------------------------------------------
// Why

std::optional<size_t> best_other_family(const PlanResult& r) {
  if (r.ranked.empty()) return std::nullopt;
  const std::string f = r.ranked[0].point.family();
  for (size_t i = 1; i < r.ranked.size(); ++i)
    if (r.ranked[i].point.family() != f) return i;
  return std::nullopt;
}

std::string explain(const PlanEntry& w, const PlanEntry& o) {
  // Each part is named with its side ("TP+PP+DP's pipeline bubble"), the parts that make up most of
  // the difference first; a part where the winner spends more comes last, as what it gives back.
  auto names = [](const std::string& k) -> std::string {
    if (k == "compute") return "compute (forward, backward, recompute, optimizer)";
    if (k == "bubble") return "pipeline bubble";
    if (k == "offload") return "exposed offload (PCIe)";
    return "exposed " + k + " communication";
  };
  const std::string wn = w.point.family(), on = o.point.family();
  const double gap = o.iteration_seconds - w.iteration_seconds;
  char buf[640];
  std::ostringstream s;
  std::snprintf(buf, sizeof buf, "%s (%.3f s per iteration) beats the best %s (%.3f s, %.3f s or %.1f%% slower)", wn.c_str(),
                w.iteration_seconds, on.c_str(), o.iteration_seconds, gap, 100 * gap / w.iteration_seconds);
  s << buf;
  const auto pw = parts(w.time), po = parts(o.time);
  struct Diff { double d; std::string name; double other, winner; };
  std::vector<Diff> diffs;
  for (size_t i = 0; i < pw.size(); ++i) diffs.push_back({po[i].second - pw[i].second, pw[i].first, po[i].second, pw[i].second});
  std::sort(diffs.begin(), diffs.end(), [](const Diff& a, const Diff& b) { return a.d != b.d ? a.d > b.d : a.name < b.name; });
  auto share = [](double part, double iteration) { return iteration > 0 ? 100 * part / iteration : 0.0; };
  const double threshold = 0.005 * w.iteration_seconds;
  int said = 0;
  for (const Diff& d : diffs) {
    if (d.d <= threshold || said == 2) break;
    std::snprintf(buf, sizeof buf, "%s%s's %s takes %.3f s (%.0f%%) against %s's %.3f s (%.0f%%), %.3f s of the difference",
                  said == 0 ? ": " : "; ", on.c_str(), names(d.name).c_str(), d.other, share(d.other, o.iteration_seconds),
                  wn.c_str(), d.winner, share(d.winner, w.iteration_seconds), d.d);
    s << buf;
    ++said;
  }
  s << ".";
  const Diff& back = diffs.back();
  if (back.d < -threshold) {
    std::snprintf(buf, sizeof buf, " %s gives back %.3f s in %s (%.3f s against %s's %.3f s).", wn.c_str(), -back.d,
                  names(back.name).c_str(), back.winner, on.c_str(), back.other);
    s << buf;
  }
  return s.str();
}

nlohmann::json plan_entry_json(const PlanEntry& e, size_t rank, const PlanEntry& best, const Scenario& sc) {
  const PlanPoint& p = e.point;
  const TimeBreakdown& t = e.time;
  const auto dom = e.dominant();
  return {{"rank", rank + 1},
          {"key", p.key()},
          {"label", p.label()},
          {"family", p.family()},
          {"config", {{"tp", p.tp}, {"pp", p.pp}, {"dp", p.dp}, {"ep", p.ep}, {"micro_batch", p.micro_batch},
                      {"grad_accum", sc.training.global_batch / (int64_t(p.micro_batch) * p.dp)},
                      {"zero_stage", p.zero}, {"offload", to_string(p.offload)}, {"recompute", to_string(p.recompute)},
                      {"interleave", p.interleave}, {"sequence_parallel", p.sequence_parallel},
                      {"lora_rank", p.lora_rank},  // 0: not a LoRA scenario
                      {"checkpointing", p.checkpointing == 2 ? "partition+cpu" : p.checkpointing == 1 ? "partition" : "none"}}},
          {"iteration_seconds", e.iteration_seconds},
          {"tokens_per_second", e.tokens_per_second},
          {"mfu", e.mfu},
          {"time_to_train_seconds", e.time_to_train_seconds},
          {"gpu_hours", e.gpu_hours},
          {"goodput", e.goodput},
          {"objective", e.objective},
          {"gap_to_best", best.objective > 0 ? e.objective / best.objective - 1 : 0},
          {"memory_bytes", {{"peak", e.memory.total()}, {"capacity", e.capacity}, {"host", e.memory.host}}},
          {"dominant", {{"part", dom.first}, {"seconds", dom.second}}},
          {"time_seconds", {{"forward", t.forward}, {"backward", t.backward}, {"recompute", t.recompute},
                            {"optimizer", t.optimizer}, {"exposed_tp", t.exposed_tp}, {"exposed_pp", t.exposed_pp},
                            {"exposed_dp", t.exposed_dp}, {"exposed_ep", t.exposed_ep},
                            {"exposed_offload", t.exposed_offload}, {"bubble", t.bubble}, {"idle", t.idle}}}};
}

size_t best_plan_index(const std::vector<PlanResult>& results) {
  size_t bi = 0;
  for (size_t i = 0; i < results.size(); ++i)
    if (!results[i].ranked.empty() &&
        (results[bi].ranked.empty() || results[i].ranked[0].objective < results[bi].ranked[0].objective))
      bi = i;
  return bi;
}

nlohmann::json plan_json(const Scenario& base, const std::vector<PlanResult>& results, size_t top, const PlanOptions& po_) {
  const size_t bi = best_plan_index(results);
  const PlanResult& R = results.at(bi);
  const auto other = best_other_family(R);
  nlohmann::json j;
  j["schema"] = "dssim.plan/1";
  j["scenario"] = {{"name", base.name}, {"source", base.source}};
  j["objective"] = to_string(po_.objective);
  j["exact"] = po_.exact;
  nlohmann::json plans = nlohmann::json::array();
  for (const PlanResult& r : results) {
    nlohmann::json p;
    p["gpus"] = r.gpus;
    p["global_batch"] = r.global_batch;
    p["counts"] = {{"enumerated", r.enumerated}, {"invalid", r.invalid}, {"too_big", r.too_big}, {"scored", r.ranked.size()}};
    p["search_seconds"] = r.seconds;
    nlohmann::json ranked = nlohmann::json::array();
    for (size_t i = 0; i < std::min<size_t>(top, r.ranked.size()); ++i)
      ranked.push_back(plan_entry_json(r.ranked[i], i, r.ranked[0], base));
    p["ranked"] = ranked;
    p["scenario_config"] = nullptr;
    if (r.base_point)
      p["scenario_config"] = {{"key", r.base_point->key()}, {"label", r.base_point->label()},
                              {"rank", r.base_rank ? nlohmann::json(*r.base_rank + 1) : nlohmann::json(nullptr)},
                              {"entry", r.base_rank ? plan_entry_json(r.ranked[*r.base_rank], *r.base_rank, r.ranked[0], base)
                                                    : nlohmann::json(nullptr)}};
    plans.push_back(p);
  }
  j["plans"] = plans;
  j["best"] = {{"gpus", R.gpus}, {"key", R.ranked[0].point.key()}, {"plan_index", bi}};
  j["why"] = nullptr;
  if (other)
    j["why"] = {{"other_rank", *other + 1}, {"other_key", R.ranked[*other].point.key()},
                {"text", explain(R.ranked[0], R.ranked[*other])}};
  return j;
}

std::string nothing_fits_message(const Scenario& base, const std::vector<PlanResult>& results, const PlanOptions& po_) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  auto fmt = [](const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return std::string(buf);
  };
  std::ostringstream why;
  const PlanResult& r = results.back();
  why << "no configuration of " << base.name << " fits " << (results.size() > 1 ? "any of the GPU counts asked (up to " : "")
      << r.gpus << (results.size() > 1 ? ")" : "") << " x " << base.cluster.gpu.name << " at global batch " << r.global_batch << " ("
      << r.enumerated << " configurations: " << r.invalid << " refused by validation, " << r.too_big << " over memory)";
  if (r.smallest_point)
    why << "; the smallest peak is " << fmt("%.1f", r.smallest_memory.total() / kGiB) << " GiB of "
        << fmt("%.0f", base.cluster.gpu.memory_bytes / kGiB) << " GiB (" << r.smallest_point->label() << ")";
  else if (!r.first_invalid.empty())
    why << "; e.g. " << r.first_invalid;
  PlanOptions o = po_;
  o.gpus = r.gpus;
  if (auto h = fit_without_fixes(base, o))
    why << "; without --fix / --vary it fits at " << r.gpus << " GPUs: " << h->point.label() << " ("
        << fmt("%.1f GiB", h->memory.total() / kGiB) << ")";
  else if (auto g = smallest_fitting_gpus(base, o))
    why << "; the smallest GPU count that fits is " << g->gpus << " (" << g->point.label() << ", "
        << fmt("%.1f GiB", g->memory.total() / kGiB) << "): try --gpus " << g->gpus;
  else
    why << "; nothing fits up to " << r.gpus * 64 << " GPUs either";
  return why.str();
}

}  // namespace dssim
