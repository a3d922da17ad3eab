// The planner (`dssim plan`, docs/plan.md): for a fixed model, cluster size and global batch, every
// combination of TP / PP / micro-batch / ZeRO stage / recompute / interleave / sequence parallelism /
// offload / EP (MoE only) that core/validate admits, kept when it fits in GPU and host memory
// (core/memory), scored with the analytic estimator and ranked by an objective. Deterministic: ties
// break on PlanPoint::key().
//
// Scoring. The estimator evaluates the Program of the whole iteration. A pipeline of m micro-batches
// reaches its steady state after a few micro-batches, from where every further micro-batch adds the
// same time to each part of the breakdown; the fast path (the default) evaluates the Program at
// three short micro-batch counts and, when they lie on one line and no stream of any rank falls
// behind it, extends it to m (extrapolation_points; 1F1B only, interleaved schedules are evaluated
// whole).
// tests/core/test_plan.cpp checks it against the full Program on a stated sample. Memory is always
// the closed form of the real scenario (it does not depend on m beyond the pipeline's in-flight
// micro-batches).
#pragma once
#include <array>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/memory.hpp"
#include "core/scenario.hpp"
#include "core/timeline.hpp"

namespace dssim {

// The searched dimensions. dp is not one: it is always GPUs / (tp * pp).
enum class PlanDim { tp, pp, micro_batch, zero, recompute, interleave, sequence_parallel, offload, ep,
                     lora_rank, checkpointing };
constexpr int kPlanDims = 11;
const char* to_string(PlanDim);
// "tp", "pp", "micro_batch" (also "mb"), "zero", "recompute", "interleave", "sequence_parallel"
// (also "sp"), "offload", "ep", "lora_rank" (LoRA scenarios: 4 .. 64), "checkpointing" (with full
// recompute: DeepSpeed's partition_activations, then with cpu_checkpointing); "dp" is accepted by
// the CLI as a no-op. nullopt for anything else.
std::optional<PlanDim> parse_plan_dim(const std::string&);

enum class Offload { none, optimizer, optimizer_and_params };
const char* to_string(Offload);

// Lower objective value is better: throughput = seconds per token; cost = GPU-seconds per token
// (GPU-hours to train); time-to-train = seconds per token as well, shown as days. At one GPU count
// all three rank alike; across a --gpus sweep cost favours fewer GPUs.
enum class PlanObjective { throughput, cost, time_to_train };
const char* to_string(PlanObjective);
std::optional<PlanObjective> parse_plan_objective(const std::string&);

// One point of the space.
struct PlanPoint {
  int tp = 1, pp = 1, dp = 1, micro_batch = 1, zero = 0, interleave = 1, ep = 1;
  Recompute recompute = Recompute::none;
  bool sequence_parallel = false;
  Offload offload = Offload::none;
  int lora_rank = 0;         // finetune.rank of a LoRA scenario (0: not LoRA)
  int checkpointing = 0;     // 0 none, 1 partition_activations, 2 + cpu_checkpointing
  int value(PlanDim) const;  // Recompute / Offload / bool as their integer values
  // Stable key, e.g. "tp8.pp8.dp16.mb1.z1.rc2.v1.sp0.off0.ep1": ties and the sort break on it.
  std::string key() const;
  // Human label (ASCII, for aligned tables), e.g. "TP8 PP8 DP16 v2 SP | mb 1 | ZeRO-1 | full recompute".
  std::string label() const;
  // The family, for comparing the winner with another kind of layout: which of TP / PP / DP / EP
  // it uses, and ZeRO-3 (parameters sharded) or not ("TP+PP+DP", "DP ZeRO-3").
  std::string family() const;
  bool operator==(const PlanPoint& o) const { return key() == o.key(); }
};
PlanPoint point_of(const Scenario&);
// The base scenario with the point's values: parallel degrees, batch triple (global kept), ZeRO,
// offload, recompute; the pipeline partition re-resolved (the base's kept when pp and interleave
// are the base's). Throws ConfigError when the layers cannot be partitioned; does not validate.
Scenario apply_point(const Scenario& base, const PlanPoint&);

// A --fix constraint on a dimension: "parallel.tp=8", "zero.stage=3", "activation_checkpointing=full",
// "zero.offload_optimizer=true", "parallel.dp=16" (restricts tp * pp), ...
struct PlanFix {
  std::string key;  // as written
  int value = 0;
};
// True when `key` is one the planner searches (then parse_plan_fix reads it); other keys are
// plain scenario overrides (--set) the caller applies to the base.
bool is_plan_key(const std::string& key);
// Throws ConfigError naming --fix and the expected values.
PlanFix parse_plan_fix(const std::string& key, const std::string& value);

struct PlanEntry;
// Where a search is, for a progress line: enumerating (points generated and validated / all of the
// space, how many fit so far) or scoring (configurations scored / all that fit, the best so far).
struct PlanProgress {
  enum Phase { enumerating, scoring } phase = enumerating;
  int gpus = 0;
  size_t done = 0, total = 0;
  size_t fitting = 0;
  const PlanEntry* best = nullptr;    // scoring: the best so far (valid during the call only)
};

struct PlanOptions {
  int gpus = 0;                       // 0 = the scenario's cluster
  std::vector<PlanDim> vary;          // empty = every dimension that applies (ep: MoE only)
  std::vector<PlanFix> fixes;
  PlanObjective objective = PlanObjective::throughput;
  int max_tp = 0;                     // 0 = cluster.gpus_per_node (Megatron keeps TP in a node); a fix overrides
  bool exact = false;                 // score every point with the whole Program (no extrapolation)
  // Called while enumerating and while scoring, each about every 2% and at the end.
  std::function<void(const PlanProgress&)> progress;
};

struct PlanScore {
  double iteration_seconds = 0;
  TimeBreakdown time;                 // of the critical rank, as the report attributes it
  bool extrapolated = false;
};
// The analytic estimate of one scenario: with exact, the Program of the whole iteration
// (analytic_report); otherwise extrapolated from three shorter iterations when grad_accum is large
// enough to gain from it and they are steady (and exactly otherwise). With collapse (what plan
// uses), the Programs are built with BuildOptions::collapse_chains: the same timeline, far fewer
// instructions (within 1e-9 of the uncollapsed Program: the sums of the chains round differently).
struct CollectivePrices;  // core/estimator.hpp
class StagePlanCache;     // core/program_builder.hpp
// `prices`, when given, keeps collective prices across calls: only for scenarios of one cluster;
// `stage_plans` keeps the builder's stage plans: only for the points of one search (apply_point
// of one base scenario).
// `reuse` (plan's scoring loop): the previous configuration's Programs, when it differs from this
// one only at the batch end, to take its pipeline's timeline from (evaluate_program_reusing).
struct PipelineReuse;
PlanScore score_scenario(const Scenario&, bool exact, bool collapse = true, CollectivePrices* prices = nullptr,
                         StagePlanCache* stage_plans = nullptr, PipelineReuse* reuse = nullptr);
// A point that core/validate certainly refuses once applied to `base` (a subset of its rules,
// checked on the point's values): the search counts it as refused without building its scenario.
bool refused_early(const Scenario& base, const PlanPoint&);
// The three micro-batch counts the fast path evaluates for a scenario, {0, 0, 0} when it evaluates
// the whole iteration (it also does when the three are not on one line).
std::array<int, 3> extrapolation_points(const Scenario&);

struct PlanEntry {
  PlanPoint point;
  double iteration_seconds = 0, tokens_per_second = 0, mfu = 0;
  double time_to_train_seconds = 0;   // tokens_to_train, or 1e9 tokens when the scenario gives none
  double gpu_hours = 0;               // GPUs x time_to_train
  // With a reliability: section (core/reliability.hpp): Daly's closed-form goodput at the optimal
  // checkpoint interval; time_to_train and gpu_hours above include failures (divided by it), and
  // so do the cost and time-to-train objectives. 1 without the section.
  double goodput = 1;
  double objective = 0;               // lower is better
  TimeBreakdown time;
  MemoryBreakdown memory;
  double capacity = 0;                // GPU memory
  // Dominant part of the iteration: "compute" (forward + backward + recompute + optimizer), "TP",
  // "PP", "DP", "EP", "offload", "bubble"; and the largest part that is not compute.
  std::pair<std::string, double> dominant() const;
  std::pair<std::string, double> largest_overhead() const;
};

struct PlanResult {
  int gpus = 0;
  int64_t global_batch = 0;
  size_t enumerated = 0;              // points generated
  size_t invalid = 0;                 // refused by core/validate (or no pipeline partition)
  size_t too_big = 0;                 // valid, but over GPU or host memory
  std::vector<PlanEntry> ranked;      // fits, scored, best first
  size_t extrapolated = 0;            // of which scored by the fast path's line (the rest: whole Programs)
  std::optional<size_t> base_rank;    // index in ranked of the base scenario's own point
  std::optional<PlanPoint> base_point;  // when the base fits this GPU count
  // The valid point with the smallest peak GPU memory (for "does not fit" messages).
  std::optional<PlanPoint> smallest_point;
  MemoryBreakdown smallest_memory;
  std::string first_invalid;          // one validate message, for an empty space
  double seconds = 0;                 // wall time of the search
  double enumerate_seconds = 0;       // of which generating, validating and sizing the points
  double score_seconds = 0;           // and scoring the ones that fit
};

PlanResult plan(const Scenario& base, const PlanOptions&);

// When nothing fits: the smallest GPU count (doubling from the plan's, up to 64x, multiples of a
// node) at which some point fits with the same fixes, and that point; nullopt if none.
struct FitHint {
  int gpus = 0;
  PlanPoint point;
  MemoryBreakdown memory;
};
std::optional<FitHint> smallest_fitting_gpus(const Scenario& base, const PlanOptions&);
// The same GPU count with the fixes released: the point that fits with the least memory.
std::optional<FitHint> fit_without_fixes(const Scenario& base, const PlanOptions&);

// Megatron-LM's command-line flags for what a ds_config cannot say: --tensor-model-parallel-size,
// --pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, --sequence-parallel,
// the recompute flags, the batch sizes (and --expert-model-parallel-size for MoE). One flag a line.
std::string megatron_args(const Scenario&);

// Why `winner` beats `other`, from the two breakdowns: the (at most two) parts where `other`
// spends most more than `winner`, largest first, each named with its side ("TP+PP+DP's pipeline
// bubble takes 0.515 s (3%) against TP+DP ZeRO-3's 0.002 s (0%), 0.513 s of the difference"), in
// seconds and shares of each side's iteration; then the part where `winner` spends most more, if
// any, as what it gives back. One or two sentences.
std::string explain(const PlanEntry& winner, const PlanEntry& other);
// The best entry of a family other than ranked[0]'s; nullopt when all share it.
std::optional<size_t> best_other_family(const PlanResult&);

// `dssim plan --json` (schema dssim.plan/1, docs/plan.md) of searches of `base` at one or more GPU
// counts: each plan's top `top` entries, the best GPU count (plan_index) and the why. The CLI adds
// verify_sim; the Python module (python/) returns it as a dict. Results must not all be empty.
nlohmann::json plan_entry_json(const PlanEntry&, size_t rank, const PlanEntry& best, const Scenario& base);
size_t best_plan_index(const std::vector<PlanResult>&);
// When no search found a fitting configuration: why (counts, the smallest peak or a validation
// message) and what would fit (without the fixes, or the smallest GPU count): the text after
// "dssim plan: error: ", also the Python module's ConfigError.
std::string nothing_fits_message(const Scenario& base, const std::vector<PlanResult>&, const PlanOptions&);
nlohmann::json plan_json(const Scenario& base, const std::vector<PlanResult>&, size_t top, const PlanOptions&);

}  // namespace dssim
