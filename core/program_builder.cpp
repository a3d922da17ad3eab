// Program builder: turns a Scenario into per-rank instruction streams.
//
// Structure: everything that is the same for all ranks of a pipeline stage (layer range, compute
// segments and their kernel lists, ZeRO partitions and buckets, the ordered list of pipeline
// actions) is planned once per stage (StagePlan); each rank then walks its stage's action list and
// appends instructions, filling in its own groups and peers (RankEmitter).
//
// Deadlock freedom. Every stream runs in order and every wait points at an earlier instruction, so
// a rank's Program is a relaxation of one sequential order (the order instructions are appended).
// That sequential order is deadlock-free across ranks:
//  - interleave = 1: it is DeepSpeed's TrainSchedule, whose steps can be separated by barriers;
//    with parallel.pipeline_engine deepspeed its p2p instructions are on the compute stream, in
//    the step's order (blocking pairs that line up between neighbours by the steps' parity), and
//    the gradient reductions and the tied-embedding sync follow the last step on every rank;
//  - interleave > 1: Megatron's interleaved order for compute, and the p2p instructions of every
//    rank sorted by one global key (the sender's finish time in a unit-cost run of the schedule,
//    ties broken by sender virtual stage, micro-batch, direction), so the pending pair with the
//    smallest key can always proceed;
//  - data-parallel, tensor-parallel, expert and embedding collectives run among ranks of one stage
//    (or first/last stage at the end), which have identical streams. The reductions a first / last
//    stage holds back until after the EmbeddingSync (tied embeddings) are the same buckets on every
//    rank of the stage, so its DP groups still see one order; the embedding group's two members
//    both reach the sync after their last backward.
//  - with sequence parallelism, the TP group's gradient sums run on the reduction stream while
//    the compute stream issues its own TP collectives: the TP members' Programs are identical, so
//    both streams' collectives are matched in one per-group order.
#include "core/program_builder.hpp"

#include <algorithm>
#include <numeric>
#include <span>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <cstring>

#include "core/chain_index.hpp"
#include "core/grid.hpp"
#include "core/memory.hpp"
#include "core/optimizer_step.hpp"
#include "core/pipeline_engine.hpp"
#include "core/schedule.hpp"
#include "core/zero_partition.hpp"
#include "core/finetune.hpp"
#include "core/zero3_placement.hpp"

namespace dssim {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

struct Tensor {
  int64_t numel;
  int layer;    // global layer it belongs to (embedding -> first layer, head -> last layer)
  bool expert;  // MoE expert weights: reduced in the expert-data-parallel group
  // Replicated over the TP group but fed sequence-sharded inputs under sequence parallelism
  // (layer norms, row-parallel biases, the position embedding): each TP rank holds a partial
  // gradient that the TP group sums before the data-parallel reduction.
  bool sp_replicated = false;
  // The word embedding (first chunk) or its tied copy (last chunk): summed over the embedding
  // group (EmbeddingSync) before its data-parallel reduction.
  bool tied = false;
  // Fine-tuning (core/finetune.hpp): a frozen tensor has no gradient and no optimizer state; ZeRO
  // 0-2 leave it out of the partition, ZeRO-3 still shards and gathers it.
  bool trainable = true;
};

// A contiguous run of layers computed by one Forward / Backward instruction.
struct Segment {
  int layer_begin = 0, layer_count = 0;
  bool embedding = false, head = false;
  int dense_layers = 0, moe_layers = 0;
  int ops = -1;
  OpsCost fwd, bwd, rec;
};

struct Chunk {
  int vs = 0;  // virtual stage: chunk * pp + stage
  int layer_begin = 0, layer_count = 0;
  bool first = false, last = false;  // holds the embedding / the head
  std::vector<Segment> fwd;          // forward segments (stage 3: one per layer); also the backward's
                                     // when no bucket needs an earlier start
  std::vector<Segment> bwd_split;    // backward segments split where gradient buckets close
};

// One reduction bucket, closed by the backward of `layer` (the lowest model-order layer it holds).
struct BucketRef {
  int bucket;
  bool expert;
  int chunk, layer;
};

using Act = PipeAct;  // (core/schedule.hpp)
using Action = PipeAction;

// Per gradient bucket / stage-3 layer group of a ZeroPartition (same indices).
struct BucketFlags {
  std::vector<int64_t> sp_elems;     // [grad bucket] SP-replicated elements inside it
  std::vector<char> tied;            // [grad bucket] holds the word embedding or its tied copy
  std::vector<int64_t> s3_sp_elems;  // [stage-3 group] SP-replicated elements
};

struct StagePlan {
  int stage = 0;
  std::vector<Chunk> chunks;
  ZeroPartition dense, expert;
  BucketFlags dense_flags, expert_flags;
  bool has_expert = false;
  std::vector<BucketRef> buckets;  // reduction order
  // Stage 3: gather groups per global layer (index into dense/expert.stage3_groups, -1 none).
  std::map<int, int> s3_dense, s3_expert;
  // Stage 3: all-gather calls the engine issues for each group (core/zero3_placement.hpp).
  std::vector<int> s3_dense_calls, s3_expert_calls;
  std::vector<int> s3_dense_reduces, s3_expert_reduces;  // reduce-scatter calls per group
};

// Every stage's plan and the kernel lists their segments index (Program::op_lists), as one
// build makes them (BuildOptions::stage_plans).
struct StagePlans {
  std::vector<StagePlan> plans;
  std::shared_ptr<std::vector<std::vector<LayerOp>>> op_lists;  // (shared with the Programs: OpLists)
};


struct OpListCache {
  // By what a segment's kernels depend on: the embedding, each layer's kind (dense / MoE), the
  // head. Segments of up to 56 layers by a packed key (the layer count in bits 58-63, embedding
  // 57, head 56, layer i's kind in bit i) in a short list; longer ones by their string.
  std::vector<std::pair<uint64_t, int>> packed;
  std::map<std::string, int> index;
  std::vector<OpsCost> fwd, bwd, rec;
};

int micro_batches_of(const Scenario& sc) {
  if (sc.training.grad_accum > 0) return sc.training.grad_accum;
  const int64_t per_step = int64_t(std::max(1, sc.training.micro_batch)) * sc.parallel.dp;
  if (sc.training.global_batch > 0 && sc.training.global_batch % per_step == 0)
    return int(sc.training.global_batch / per_step);
  throw std::invalid_argument("build_program: gradient accumulation steps unknown (set grad_accum)");
}

// Layers of each virtual stage (chunk * pp + stage), in virtual-stage order.
std::vector<int> virtual_stage_layers(const Scenario& sc) {
  const int pp = sc.parallel.pp, v = std::max(1, sc.parallel.interleave);
  const int n = pp * v;
  const auto& part = sc.parallel.partition;
  std::vector<int> layers(n, 0);
  if (part.empty()) {
    const int L = sc.model.layers;
    for (int i = 0; i < n; ++i) layers[i] = L / n + (i < L % n ? 1 : 0);
  } else if (int(part.size()) == n) {
    layers = part;
  } else if (int(part.size()) == pp) {
    for (int s = 0; s < pp; ++s)
      for (int c = 0; c < v; ++c) layers[c * pp + s] = part[s] / v + (c < part[s] % v ? 1 : 0);
  } else {
    throw std::invalid_argument("parallel.partition: needs pp (or pp * interleave) entries, got " +
                                std::to_string(part.size()));
  }
  int total = 0;
  for (int x : layers) {
    if (x < 1) throw std::invalid_argument("build_program: every pipeline stage (chunk) needs >= 1 layer");
    total += x;
  }
  if (total != sc.model.layers)
    throw std::invalid_argument("parallel.partition: layers sum to " + std::to_string(total) +
                                ", model has " + std::to_string(sc.model.layers));
  return layers;
}

class Builder {
  // The step takes a global norm of the gradients: fp16's overflow check, gradient clipping.
  bool step_takes_norm() const {
    return sc_.precision.dtype == Dtype::fp16 || sc_.training.gradient_clipping > 0;
  }

 public:
  Builder(const Scenario& sc, const BuildOptions& opts)
      : sc_(sc), opts_(opts), grid_(sc.parallel), m_(sc.model) {
    p_ = sc.parallel.pp;
    v_ = std::max(1, sc.parallel.interleave);
    t_ = sc.parallel.tp;
    M_ = micro_batches_of(sc);
    b_ = std::max(1, sc.training.micro_batch);
    g_ = bytes_of(sc.precision.dtype);
    zero_ = sc.zero.stage;
    cg_ = sc.precision.communication_bytes();
    // ZeRO++ (stage 3): hpZ's secondary partition over hpz_ DP ranks; qgZ's two levels, the DP
    // ranks of one node (qgz_local_) then the nodes. See docs/simulator.md, "ZeRO++".
    if (zero_ == 3 && sc.parallel.dp > 1) {
      hpz_ = sc.zero.hpz() && sc.zero.hpz_partition_size < sc.parallel.dp &&
                     sc.parallel.dp % sc.zero.hpz_partition_size == 0
                 ? sc.zero.hpz_partition_size : 1;
      qwz_ = sc.zero.quantized_weights;
      qgz_ = sc.zero.quantized_gradients;
      const int gpn = std::max(1, sc.cluster.gpus_per_node);
      const int local = t_ <= gpn && gpn % t_ == 0 ? gpn / t_ : 1;
      qgz_local_ = local > 1 && local < sc.parallel.dp && sc.parallel.dp % local == 0 ? local : 1;
    }
    if (zero_ < 0 || zero_ > 3) throw std::invalid_argument("zero.stage must be 0..3");
    if (m_.layers < 1 || m_.hidden < 1 || m_.seq_len < 1)
      throw std::invalid_argument("build_program: model needs layers, hidden and seq_len");
    if (v_ > 1 && M_ % p_ != 0)
      throw std::invalid_argument("interleaved pipeline schedule: micro-batches (" + std::to_string(M_) +
                                  ") must be a multiple of the pipeline size (" + std::to_string(p_) + ")");
    act_bytes_ = double(b_) * m_.seq_len * m_.hidden * g_;
    // The pipeline engine (core/pipeline_engine.hpp): where p2p runs, TP partitioning of the
    // messages (Megatron's scatter/gather, DeepSpeed's pipe_partitioned), when gradients reduce.
    engine_ = pipeline_engine_model(sc);
    if (engine_.engine == PipelineEngine::deepspeed && p_ > 1 && (v_ > 1 || zero_ >= 2))
      throw std::invalid_argument("build_program: parallel.pipeline_engine deepspeed runs neither parallel.interleave > 1 "
                                  "nor zero.stage >= 2 (core/pipeline_engine.cpp)");
    const bool sp = sc.parallel.sequence_parallel;
    p2p_act_bytes_ = (sp || engine_.partition_activations) ? act_bytes_ / t_ : act_bytes_;
    p2p_grad_bytes_ = (sp || engine_.partition_gradients) ? act_bytes_ / t_ : act_bytes_;
    // DeepSpeed's dispatch buffer [experts, capacity, h] of the b s tokens a TP rank gates, split
    // over the TP group (drop_tokens). Without dropping the capacity is the busiest expert's load,
    // known at run time only: priced as top_k x capacity_factor slots per token.
    moe_buffer_bytes_ = moe_routed_slots(m_, double(b_) * m_.seq_len) * m_.hidden * g_;
    a2a_bytes_ = moe_buffer_bytes_ / t_;
    onebit_ = sc.optimizer.onebit_compressed(zero_);
    vs_layers_ = virtual_stage_layers(sc);
    vs_first_layer_.resize(vs_layers_.size() + 1, 0);
    for (size_t i = 0; i < vs_layers_.size(); ++i) vs_first_layer_[i + 1] = vs_first_layer_[i] + vs_layers_[i];
  }

  Program build() {
    Program prog;
    prog.world = grid_.world();
    prog.representative_only = opts_.representative_only;
    group_ids_.assign(7, {});
    for (int k = 0; k < 7; ++k) group_ids_[k].assign(grid_.group_count(GroupKind(k)), -1);
    plan_stages(prog);
    stage_actions_.resize(p_);
    for (int s = 0; s < p_; ++s) stage_actions_[s] = &schedule()[s];
    std::vector<int> ranks;
    if (opts_.representative_only) {
      for (int s = 0; s < p_; ++s) ranks.push_back(grid_.rank_of(0, s, 0));
    } else {
      for (int r = 0; r < grid_.world(); ++r) ranks.push_back(r);
    }
    prog.ranks.resize(ranks.size());
    // Ranks of one stage have the same number of instructions, other stages about as many.
    std::vector<std::pair<size_t, size_t>> reserve(p_, {0, 0});  // (instructions, deps) per stage
    std::pair<size_t, size_t> last{0, 0};
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int stage = grid_.coord(ranks[i]).pp;
      RankProgram& rp = prog.ranks[i];
      rp.rank = ranks[i];
      const auto [ni, nd] = reserve[stage].first > 0 ? reserve[stage] : last;
      rp.instructions.reserve(ni + ni / 8);
      rp.deps.reserve(nd + nd / 8);
      emit_rank(prog, rp);
      last = reserve[stage] = {rp.instructions.size(), rp.deps.size()};
    }
    return prog;
  }

 private:
  // ---- planning (per stage) ----

  // A layer's tensors in module order. Llama-shaped (model.cpp [L]): qkv is (h + 2 kv) x h with
  // GQA, RMSNorm has its gain only, no bias tensors without model.bias, SwiGLU adds the gate
  // projection (f x h) before up. Their sum is dense_layer_params / t (experts: expert_mlp_params).
  std::vector<Tensor> layer_tensors(int layer) const {
    const int64_t h = m_.hidden, f = ffn_hidden_of(m_), t = t_;
    const int64_t qkv = h + 2 * static_cast<int64_t>(kv_width(m_));  // 3h without GQA
    const bool bias = m_.bias;
    std::vector<Tensor> ts;
    const FinetuneSpec& ft = sc_.finetune;
    // Marks the tensors pushed since `from` with whether `part` trains (core/finetune.hpp).
    const auto trains = [&](size_t from, BasePart part) {
      const bool tr = base_trains(m_, ft, part);
      for (size_t i = from; i < ts.size(); ++i) ts[i].trainable = tr;
    };
    auto norm = [&] {
      const size_t from = ts.size();
      ts.push_back({h, layer, false, true});                     // gain
      if (!m_.rmsnorm) ts.push_back({h, layer, false, true});    // bias (LayerNorm)
      trains(from, BasePart::norm);
    };
    norm();                                                      // layernorm_1
    size_t from = ts.size();
    ts.push_back({qkv * h / t, layer, false});                   // qkv
    if (bias) ts.push_back({qkv / t, layer, false});
    ts.push_back({h * h / t, layer, false});                     // attention projection
    if (bias) ts.push_back({h, layer, false, true});
    trains(from, BasePart::attention);
    norm();                                                      // layernorm_2
    from = ts.size();
    const int up_mats = mlp_matrices(m_) - 1;                    // up (+ gate with SwiGLU)
    if (is_moe_layer(m_, layer)) {
      ts.push_back({h * m_.experts, layer, false});  // gate (replicated)
      const int local = std::max(1, m_.experts / std::max(1, sc_.parallel.ep));
      for (int e = 0; e < local; ++e) {  // experts are not TP-split (model.cpp)
        for (int u = 0; u < up_mats; ++u) {
          ts.push_back({f * h, layer, true});
          if (bias) ts.push_back({f, layer, true});
        }
        ts.push_back({h * f, layer, true});
        if (bias) ts.push_back({h, layer, true});
      }
    } else {
      for (int u = 0; u < up_mats; ++u) {
        ts.push_back({f * h / t, layer, false});
        if (bias) ts.push_back({f / t, layer, false});
      }
      ts.push_back({h * f / t, layer, false});
      if (bias) ts.push_back({h, layer, false, true});  // MLP down bias (row-parallel)
    }
    trains(from, BasePart::mlp);
    // LoRA adapters (A then B of each), trainable (tp 1: core/validate refuses LoRA with tp > 1).
    for (const LoraAdapter& a : layer_adapters(m_, ft)) {
      ts.push_back({int64_t(ft.rank) * int64_t(a.in), layer, false});
      ts.push_back({int64_t(a.out) * int64_t(ft.rank), layer, false});
    }
    return ts;
  }

  // The word (and position) embedding's tensors, counted to `layer` (the chunk's first).
  std::vector<Tensor> embedding_tensors(int layer) const {
    const int64_t h = m_.hidden;
    const bool tr = base_trains(m_, sc_.finetune, BasePart::embedding);
    std::vector<Tensor> ts;
    ts.push_back({int64_t(m_.vocab) * h / t_, layer, false, false, true, tr});  // wte
    if (!m_.rotary) ts.push_back({int64_t(m_.seq_len) * h, layer, false, true, false, tr});  // wpe
    return ts;
  }

  // The final norm, the output layer (untied, or the tied copy on a later stage: `tied_copy`) and
  // an lm_head LoRA adapter, counted to `layer` (the chunk's last).
  std::vector<Tensor> head_tensors(int layer, bool tied_copy) const {
    const int64_t h = m_.hidden;
    const FinetuneSpec& ft = sc_.finetune;
    const bool norm_tr = base_trains(m_, ft, BasePart::norm);
    std::vector<Tensor> ts;
    ts.push_back({h, layer, false, true, false, norm_tr});  // final layer norm (gain, bias) / RMSNorm (gain)
    if (!m_.rmsnorm) ts.push_back({h, layer, false, true, false, norm_tr});
    if (!m_.tied_embeddings || tied_copy)  // output layer or the tied copy
      ts.push_back({int64_t(m_.vocab) * h / t_, layer, false, false, m_.tied_embeddings, base_trains(m_, ft, BasePart::head)});
    if (const double hp = head_adapter_params(m_, ft); hp > 0) {  // lm_head adapter: A [r, h], B [V, r]
      ts.push_back({int64_t(ft.rank) * h, layer, false});
      ts.push_back({int64_t(m_.vocab) * ft.rank, layer, false});
    }
    return ts;
  }

  int op_list(Program& prog, const Segment& seg) {
    std::string key;
    uint64_t packed = 0;
    const bool short_segment = seg.layer_count >= 0 && seg.layer_count <= 56;
    if (short_segment) {
      packed = uint64_t(seg.layer_count) << 58 | uint64_t(seg.embedding) << 57 | uint64_t(seg.head) << 56;
      for (int l = seg.layer_begin; l < seg.layer_begin + seg.layer_count; ++l)
        if (is_moe_layer(m_, l)) packed |= uint64_t(1) << (l - seg.layer_begin);
      for (const auto& [k, id] : cache_.packed)
        if (k == packed) return id;
    } else {
      key += seg.embedding ? 'E' : '-';
      for (int l = seg.layer_begin; l < seg.layer_begin + seg.layer_count; ++l)
        key += is_moe_layer(m_, l) ? 'M' : 'D';
      key += seg.head ? 'H' : '-';
      auto it = cache_.index.find(key);
      if (it != cache_.index.end()) return it->second;
    }
    LayerShape shape;
    shape.micro_batch = b_;
    shape.tp = t_;
    shape.sequence_parallel = sc_.parallel.sequence_parallel;
    shape.dtype = sc_.precision.dtype;
    shape.ep = sc_.parallel.ep;
    shape.finetune = &sc_.finetune;
    std::vector<LayerOp> ops;
    if (seg.embedding) {
      auto e = embedding_forward_ops(m_, shape);
      ops.insert(ops.end(), e.begin(), e.end());
    }
    // (A layer's kernels depend on whether it is an MoE layer only: made once per kind.)
    std::vector<LayerOp> layer_ops[2];
    for (int l = seg.layer_begin; l < seg.layer_begin + seg.layer_count; ++l) {
      shape.moe = is_moe_layer(m_, l);
      std::vector<LayerOp>& e = layer_ops[shape.moe ? 1 : 0];
      if (e.empty()) e = layer_forward_ops(m_, shape);
      ops.insert(ops.end(), e.begin(), e.end());
    }
    if (seg.head) {
      shape.moe = false;
      auto e = head_forward_ops(m_, shape);
      ops.insert(ops.end(), e.begin(), e.end());
    }
    if (zero_ == 3) {
      // ZeRO-3 reduces (on one rank: folds) each layer group's 16-bit gradients into the fp32
      // buffer in every micro-batch's backward, and zero-fills the next micro-batch's: 2g + 8 bytes
      // per parameter (the optimizer step then has no fold of its own).
      const double h = m_.hidden, t = t_;
      const FinetuneSpec& ft = sc_.finetune;
      double params = seg.layer_count * dense_layer_params(m_) / t;
      if (seg.embedding) params += double(m_.vocab) / t * h + (m_.rotary ? 0.0 : double(m_.seq_len) * h);
      if (seg.head) params += norm_params(m_) + (m_.tied_embeddings ? 0.0 : double(m_.vocab) / t * h);
      if (ft.freezes_anything()) {  // only trainable gradients are folded
        params = seg.layer_count * layer_trainable_params(m_, ft, t);
        if (seg.embedding) params += embedding_trainable_params(m_, ft, t);
        if (seg.head) params += head_trainable_params(m_, ft, !m_.tied_embeddings, t);  // ZeRO-3: pp 1
      }
      LayerOp fold;
      fold.name = "zero3_gradient_fold";
      // (Offloaded: copied for the host instead, 3g: zero-fill, read, write the copy.)
      fold.memory_bytes = (sc_.zero.offload_optimizer ? 3.0 * g_ : fold_bytes_per_param(g_)) * params;
      fold.flops = params;
      fold.backward_only = true;
      ops.push_back(fold);
      // DeepSpeed's Python reduce path: one slice per tensor and data-parallel rank (experts: per
      // expert-data-parallel rank) for every reduced gradient of the segment, on the launching
      // thread during the backward (core/zero3_placement.hpp zero3_reduce_host_seconds).
      int64_t dense = 0, expert = 0;
      const auto count = [&](const std::vector<Tensor>& ts) {
        for (const Tensor& x : ts)
          if (x.trainable) ++(x.expert ? expert : dense);
      };
      if (seg.embedding) count(embedding_tensors(seg.layer_begin));
      for (int l = seg.layer_begin; l < seg.layer_begin + seg.layer_count; ++l) count(layer_tensors(l));
      if (seg.head) count(head_tensors(seg.layer_begin + seg.layer_count - 1, false));  // ZeRO-3: pp 1
      const double host = zero3_reduce_host_seconds(dense, sc_.parallel.dp, sc_.zero) +
                          zero3_reduce_host_seconds(expert, grid_.expert_dp(), sc_.zero);
      if (host > 0) {
        LayerOp reduce_host;
        reduce_host.name = "zero3_reduce_host";
        reduce_host.host_seconds = host;
        reduce_host.backward_only = true;
        ops.push_back(reduce_host);
      }
    }
    if (engine_.bf16_optimizer) {
      // DeepSpeed's BF16_Optimizer (core/pipeline_engine.hpp): the bf16 gradients start from None
      // each micro-batch (no AccumulateGrad traffic), and update_hp_grads folds them into the fp32
      // buffer after the backward: kBf16FoldBytesPerParam per trainable parameter of the segment
      // (the last stage's tied embedding copy included).
      std::erase_if(ops, [](const LayerOp& op) { return op.name == "grad_accumulate"; });
      double params = 0;
      const auto count = [&](const std::vector<Tensor>& ts) {
        for (const Tensor& x : ts)
          if (x.trainable) params += double(x.numel);
      };
      if (seg.embedding) count(embedding_tensors(seg.layer_begin));
      for (int l = seg.layer_begin; l < seg.layer_begin + seg.layer_count; ++l) count(layer_tensors(l));
      if (seg.head) count(head_tensors(seg.layer_begin + seg.layer_count - 1, p_ > 1));
      LayerOp fold;
      fold.name = "bf16_optimizer_gradient_fold";
      fold.memory_bytes = kBf16FoldBytesPerParam * params;
      fold.flops = params;
      fold.backward_only = true;
      ops.push_back(fold);
    }
    const int id = int(prog.op_lists.size());
    cache_.fwd.push_back(sum_cost(ops));
    cache_.bwd.push_back(backward_cost(ops));
    cache_.rec.push_back(recompute_cost(ops, sc_.recompute));
    prog.op_lists.push_back(std::move(ops));
    if (short_segment) cache_.packed.emplace_back(packed, id);
    else cache_.index.emplace(key, id);
    return id;
  }

  // Splits a chunk's layers before every layer in `cuts` (global layer indices).
  std::vector<Segment> segments(Program& prog, const Chunk& c, std::vector<int> cuts) {
    cuts.push_back(c.layer_begin);
    cuts.push_back(c.layer_begin + c.layer_count);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<Segment> segs;
    segs.reserve(cuts.size() - 1);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      if (cuts[i] < c.layer_begin || cuts[i + 1] > c.layer_begin + c.layer_count) continue;
      Segment s;
      s.layer_begin = cuts[i];
      s.layer_count = cuts[i + 1] - cuts[i];
      s.embedding = c.first && s.layer_begin == c.layer_begin;
      s.head = c.last && s.layer_begin + s.layer_count == c.layer_begin + c.layer_count;
      for (int l = s.layer_begin; l < s.layer_begin + s.layer_count; ++l)
        (is_moe_layer(m_, l) ? s.moe_layers : s.dense_layers)++;
      s.ops = op_list(prog, s);
      s.fwd = cache_.fwd[s.ops];
      s.bwd = cache_.bwd[s.ops];
      s.rec = cache_.rec[s.ops];
      segs.push_back(s);
    }
    return segs;
  }

  // Every stage's plan, or the cached ones (BuildOptions::stage_plans) with their kernel lists.
  void plan_stages(Program& prog);

  // A stage's chunks (layer ranges), tensors, ZeRO partitions and buckets: what the segments are
  // cut from. It does not depend on the micro-batch size, recompute or sequence parallelism.
  void plan_partition(int s) {
    StagePlan& plan = own_plans_[s];
    plan.stage = s;
    const int last_vs = p_ * v_ - 1;
    std::vector<Tensor> tensors;
    for (int c = 0; c < v_; ++c) {
      Chunk ch;
      ch.vs = c * p_ + s;
      ch.layer_begin = vs_first_layer_[ch.vs];
      ch.layer_count = vs_layers_[ch.vs];
      ch.first = ch.vs == 0;
      ch.last = ch.vs == last_vs;
      if (ch.first) {
        auto et = embedding_tensors(ch.layer_begin);
        tensors.insert(tensors.end(), et.begin(), et.end());
      }
      for (int l = ch.layer_begin; l < ch.layer_begin + ch.layer_count; ++l) {
        auto lt = layer_tensors(l);
        tensors.insert(tensors.end(), lt.begin(), lt.end());
      }
      if (ch.last) {
        auto ht = head_tensors(ch.layer_begin + ch.layer_count - 1, p_ > 1 && !ch.first);
        tensors.insert(tensors.end(), ht.begin(), ht.end());
      }
      plan.chunks.push_back(ch);
    }
    // ZeRO partitions, dense (DP group) and expert (expert-DP group).
    ZeroPartitionSpec dspec, espec;
    std::vector<const Tensor*> dtensors, etensors;  // the specs' tensors, in spec order
    const bool frozen_any = sc_.finetune.freezes_anything();
    for (ZeroPartitionSpec* sp : {&dspec, &espec}) {
      sp->numel.reserve(tensors.size());
      sp->layer.reserve(tensors.size());
    }
    for (const Tensor& t : tensors) {
      if (!t.trainable && zero_ < 3) continue;  // replicated, never reduced or stepped
      ZeroPartitionSpec& sp = t.expert ? espec : dspec;
      sp.numel.push_back(t.numel);
      sp.layer.push_back(t.layer);
      if (frozen_any) sp.trainable.push_back(t.trainable);
      (t.expert ? etensors : dtensors).push_back(&t);
    }
    // Stage 0 (and 1-bit) all-reduces the whole unpadded buffer: partition over one rank.
    const int dp = sc_.parallel.dp, edp = grid_.expert_dp();  // experts: tp dp / ep ranks (core/grid.hpp)
    dspec.dp = zero_ == 0 ? 1 : dp;
    espec.dp = zero_ == 0 ? 1 : edp;
    for (ZeroPartitionSpec* sp : {&dspec, &espec}) {
      sp->alignment = zero_ == 0 ? 1 : 2;
      sp->reduce_bucket_size = std::max<int64_t>(0, sc_.zero.reduce_bucket_size);
      sp->allgather_bucket_size = std::max<int64_t>(0, sc_.zero.allgather_bucket_size);
    }
    plan.dense = make_zero_partition(dspec);
    plan.has_expert = !espec.numel.empty();
    if (plan.has_expert) plan.expert = make_zero_partition(espec);
    // Per gradient bucket (and stage-3 layer group): SP-replicated elements inside it (a bucket is
    // a range of the flat buffer: count the intersection), and whether it holds a tied tensor.
    const auto mark = [](const ZeroPartition& z, const std::vector<const Tensor*>& ts, BucketFlags& f) {
      for (const GradBucket& bk : z.grad_buckets) {
        int64_t sp = 0;
        bool tied = false;
        for (size_t i = 0; i < ts.size(); ++i) {
          const int64_t lo = std::max(bk.range.begin, z.offsets[i]);
          const int64_t hi = std::min(bk.range.end(), z.offsets[i] + ts[i]->numel);
          if (hi <= lo) continue;
          if (ts[i]->sp_replicated) sp += hi - lo;
          tied = tied || ts[i]->tied;
        }
        f.sp_elems.push_back(sp);
        f.tied.push_back(tied);
      }
      for (const Stage3Group& g : z.stage3_groups) {
        int64_t sp = 0;
        for (int i : g.tensors)
          if (ts[i]->sp_replicated) sp += ts[i]->numel;
        f.s3_sp_elems.push_back(sp);
      }
    };
    mark(plan.dense, dtensors, plan.dense_flags);
    if (plan.has_expert) mark(plan.expert, etensors, plan.expert_flags);

    const auto chunk_of_layer = [&](int layer) {
      for (int c = 0; c < v_; ++c)
        if (layer >= plan.chunks[c].layer_begin &&
            layer < plan.chunks[c].layer_begin + plan.chunks[c].layer_count)
          return c;
      return 0;
    };
    // Buckets in reduction order: dense and expert interleaved by closing layer (descending).
    std::vector<BucketRef> refs;
    const auto add_refs = [&](const ZeroPartition& z, const ZeroPartitionSpec& sp, bool expert) {
      for (size_t k = 0; k < z.grad_buckets.size(); ++k) {
        const auto& bk = z.grad_buckets[k];
        const int layer = sp.layer.empty() ? plan.chunks[0].layer_begin
                                           : sp.layer[std::clamp(bk.first_tensor, 0, int(sp.layer.size()) - 1)];
        refs.push_back({int(k), expert, chunk_of_layer(layer), layer});
      }
    };
    add_refs(plan.dense, dspec, false);
    if (plan.has_expert) add_refs(plan.expert, espec, true);
    std::stable_sort(refs.begin(), refs.end(), [](const BucketRef& a, const BucketRef& b) {
      return std::make_tuple(-a.chunk, -a.layer, a.expert) < std::make_tuple(-b.chunk, -b.layer, b.expert);
    });
    plan.buckets = refs;
    const auto fetch_calls = [&](const ZeroPartition& z, const ZeroPartitionSpec& sp) {
      std::vector<int> calls;
      for (const Stage3Group& g : z.stage3_groups) {
        std::vector<int64_t> numel;
        for (int i : g.tensors) numel.push_back(sp.numel[i]);
        calls.push_back(std::max(1, zero3_fetch_calls(numel, sc_.zero)));
      }
      return calls;
    };
    plan.s3_dense_calls = fetch_calls(plan.dense, dspec);
    if (plan.has_expert) plan.s3_expert_calls = fetch_calls(plan.expert, espec);
    const auto reduce_calls = [&](const ZeroPartition& z, const ZeroPartitionSpec& sp) {
      std::vector<std::vector<int64_t>> groups;
      for (const Stage3Group& g : z.stage3_groups) {
        groups.emplace_back();
        for (int i : g.tensors)
          if (sp.trainable.empty() || sp.trainable[i]) groups.back().push_back(sp.numel[i]);  // frozen: no gradient
      }
      return zero3_reduce_calls(groups, sc_.zero);
    };
    plan.s3_dense_reduces = reduce_calls(plan.dense, dspec);
    if (plan.has_expert) plan.s3_expert_reduces = reduce_calls(plan.expert, espec);
    for (size_t k = 0; k < plan.dense.stage3_groups.size(); ++k) plan.s3_dense[plan.dense.stage3_groups[k].layer] = int(k);
    if (plan.has_expert)
      for (size_t k = 0; k < plan.expert.stage3_groups.size(); ++k)
        plan.s3_expert[plan.expert.stage3_groups[k].layer] = int(k);
  }

  // A stage's compute segments and their kernel lists (into `prog`), after plan_partition.
  void plan_segments(int s, Program& prog) {
    StagePlan& plan = own_plans_[s];
    for (int c = 0; c < v_; ++c) {
      Chunk& ch = plan.chunks[c];
      if (zero_ == 3) {
        std::vector<int> per_layer;
        for (int l = ch.layer_begin; l < ch.layer_begin + ch.layer_count; ++l) per_layer.push_back(l);
        ch.fwd = segments(prog, ch, per_layer);  // (bwd_split stays empty: ZeRO-3 never splits)
      } else {
        ch.fwd = segments(prog, ch, {});
        std::vector<int> cuts;
        for (const BucketRef& r : plan.buckets)
          if (r.chunk == c) cuts.push_back(r.layer);
        ch.bwd_split = segments(prog, ch, cuts);
      }
    }
  }

  // Every stage's action list (core/schedule.hpp stage_actions: shared and cached per (pp,
  // interleave, micro-batches)).
  const std::vector<std::vector<Action>>& schedule() {
    if (!schedule_) schedule_ = stage_actions(p_, v_, M_);
    return *schedule_;
  }

  // ---- emission (per rank) ----

  int group_id(Program& prog, GroupKind kind, int rank) {
    const int gi = grid_.group_index(kind, rank);
    if (gi < 0) return -1;
    int& id = group_ids_[int(kind)][gi];
    if (id < 0) {
      id = int(prog.groups.size());
      prog.groups.push_back({kind, grid_.group_of(kind, rank)});
    }
    return id;
  }

  // ZeRO++ sub-groups of the DP groups of `rank`'s stage: DPIntra of `size` consecutive DP ranks,
  // DPInter of `size` ranks striding dp / size. All of the stage's are registered at once (in a
  // fixed order) so that a Program of stage representatives carries every rank's own sub-group.
  int sub_group(Program& prog, int rank, GroupKind kind, int size) {
    const RankCoord c = grid_.coord(rank);
    const int dp = sc_.parallel.dp, n_groups = dp / size;
    int mine = -1;
    for (int t = 0; t < t_; ++t)
      for (int k = 0; k < n_groups; ++k) {
        std::vector<int> ranks;
        for (int i = 0; i < size; ++i)
          ranks.push_back(grid_.rank_of(kind == GroupKind::DPIntra ? k * size + i : i * n_groups + k, c.pp, t));
        auto [it, fresh] = sub_groups_.try_emplace({int(kind), ranks}, int(prog.groups.size()));
        if (fresh) prog.groups.push_back({kind, ranks});
        if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) mine = it->second;
      }
    return mine;
  }

  struct RankCtx {
    RankProgram* rp = nullptr;
    const StagePlan* plan = nullptr;
    RankCoord c;
    int tp_g = -1, dp_g = -1, ep_g = -1, edp_g = -1, emb_g = -1;
    int hpz_g = -1, qgz_intra_g = -1, qgz_inter_g = -1;  // ZeRO++ sub-groups of the DP group
    int dp_n = 1, edp_n = 1;
    std::vector<uint32_t> deps;
    uint32_t last_compute = kNone;
    Program* prog = nullptr;
    uint32_t chain = kNone;            // collapse_chains: the open chain's instruction
    // Per (send / recv kind, chunk) the instruction of the first micro-batch: the later ones are
    // copies with their micro-batch and tag patched in place (p2p_from).
    std::vector<Instruction> p2p_proto;
    std::vector<char> p2p_made;
    std::vector<uint32_t> chain_deps;  // and what its first member waits for
    // collapse_chains: per (chunk, forward / backward) the one instruction a micro-batch's pass
    // emits (emit_compute_action), and whether it waits for the micro-batch's Recv.
    struct Template { bool tried = false, ok = false, waits = false; Instruction in{}; };
    std::vector<Template> templates;
    uint32_t last_reduce = kNone;   // last DP reduction (stream DpComm or Compute)
    uint32_t last_d2h = kNone;
    std::vector<uint32_t> recv_act, recv_grad, fwd_out, bwd_out;  // [chunk * M + mb]
    // stage 3: per compute segment in program order, the AG instructions it waits for
    std::vector<std::pair<uint32_t, uint32_t>> ag;  // (dense, expert)
    size_t ag_emitted = 0;
    size_t seg_cursor = 0;
    // Reductions of buckets holding the (tied) word embedding, emitted after the EmbeddingSync.
    struct Postponed {
      Op op;
      bool expert;
      int bucket;
      double elems, mine_elems;
      int mb, chunk, layer;
      uint32_t sp_sum;  // the bucket's SP gradient all-reduce (kNone: none)
      Stream st;
    };
    std::vector<Postponed> postponed;
  };

  struct SegRef {
    bool forward;
    int chunk;
    int seg;
  };

  // Appends `in` (or, with collapse_chains, folds it into the open chain it runs right after);
  // the id it returns is final: nothing is folded into it later. An instruction of another stream
  // waits for a compute-stream one only through an id from add or compute_tail, so a chain's
  // members other than its last are never waited for.
  uint32_t add(RankCtx& x, const Instruction& in, std::initializer_list<uint32_t> waits) {
    const Stream stream = in.stream;  // (read before: `in` may be the caller's only copy)
    const uint32_t id = add_link(x, in, waits);
    if (stream == Stream::Compute) finish_chain(x);
    return id;
  }

  // Appends an instruction that joins no chain; on the compute stream it is the last compute and
  // closes the open chain.
  uint32_t append(RankCtx& x, const Instruction& in, const uint32_t* deps, size_t n) {
    const bool compute = in.stream == Stream::Compute;  // (read before: `in` may be the caller's only copy)
    const uint32_t id = x.rp->add(in, deps, n);
    if (compute) {
      x.last_compute = id;
      finish_chain(x);
    }
    return id;
  }

  // As add, but the instruction stays open for the next compute-stream instruction to fold into
  // (collapse_chains): for instructions whose id the caller does not keep.
  uint32_t add_link(RankCtx& x, const Instruction& in, std::initializer_list<uint32_t> waits) {
    x.deps.clear();
    for (uint32_t w : waits)
      if (w != kNone) x.deps.push_back(w);
    const bool compute = in.stream == Stream::Compute;
    const bool link = opts_.collapse_chains && compute && starts_on_arrival(*x.prog, in);
    if (link && x.chain != kNone) {
      // It starts when the chain's last member ends if it waits for nothing the chain's first did not.
      bool covered = true;
      for (uint32_t w : x.deps)
        if (std::find(x.chain_deps.begin(), x.chain_deps.end(), w) == x.chain_deps.end()) { covered = false; break; }
      if (covered) {
        Instruction& head = x.rp->instructions[x.chain];
        Program& prog = *x.prog;
        if (head.chain < 0) {
          head.chain = static_cast<int32_t>(prog.chains.size());
          prog.chains.push_back({static_cast<uint32_t>(prog.chain_members.size()), 1});
          prog.chain_members.push_back(head);
          prog.chain_members.back().chain = -1;
        }
        prog.chain_members.push_back(in);
        prog.chain_members.back().deps_begin = prog.chain_members.back().deps_count = 0;
        ++prog.chains[head.chain].count;
        return x.chain;
      }
    }
    const uint32_t id = append(x, in, x.deps.data(), x.deps.size());
    if (!compute) return id;  // (other streams neither extend nor close the chain)
    x.chain = link ? id : kNone;
    if (link) x.chain_deps.assign(x.deps.begin(), x.deps.end());
    return id;
  }

  // The last compute-stream instruction, for a later instruction to wait for: closes its chain.
  uint32_t compute_tail(RankCtx& x) {
    finish_chain(x);
    return x.last_compute;
  }

  // Closes the open chain. A chain whose members cost what an earlier one's do (the forward of a
  // chunk is the same run for every micro-batch) shares that one's members: Program::chains stays
  // small and the estimator prices each distinct chain once.
  void finish_chain(RankCtx& x) {
    if (x.chain == kNone) return;
    Instruction& head = x.rp->instructions[x.chain];
    x.chain = kNone;
    if (head.chain < 0) return;
    Program& prog = *x.prog;
    const Chain c = prog.chains[head.chain];  // the last chain: members at the end of chain_members
    uint64_t h = c.count;
    for (uint32_t k = c.begin; k < c.begin + c.count; ++k) h = h * 1000003u ^ cost_hash(prog.chain_members[k]);
    for (int32_t other : chain_index_.find(h)) {
      const Chain& o = prog.chains[other];
      if (o.count != c.count) continue;
      bool equal = true;
      for (uint32_t k = 0; k < c.count && equal; ++k)
        equal = same_cost(prog.chain_members[o.begin + k], prog.chain_members[c.begin + k]);
      if (!equal) continue;
      prog.chain_members.resize(c.begin);
      prog.chains.pop_back();
      head.chain = other;
      return;
    }
    chain_index_.insert(h, head.chain);
  }

  // What pricing and attributing an instruction read (not its micro-batch).
  static bool same_cost(const Instruction& a, const Instruction& b) {
    return a.op == b.op && a.stream == b.stream && a.purpose == b.purpose && a.chunk == b.chunk &&
           a.layer_begin == b.layer_begin && a.layer_count == b.layer_count && a.group == b.group &&
           a.peer == b.peer && a.bucket == b.bucket && a.repeat == b.repeat && a.flops == b.flops &&
           a.bytes == b.bytes && a.memory_bytes == b.memory_bytes && a.gemm_flops == b.gemm_flops && a.ops == b.ops;
  }
  static uint64_t cost_hash(const Instruction& a) {
    uint64_t bits[4];
    std::memcpy(&bits[0], &a.flops, 8);
    std::memcpy(&bits[1], &a.bytes, 8);
    std::memcpy(&bits[2], &a.memory_bytes, 8);
    bits[3] = uint64_t(a.op) | uint64_t(a.purpose) << 8 | uint64_t(uint32_t(a.group)) << 16 | uint64_t(uint32_t(a.repeat)) << 40 |
              uint64_t(uint32_t(a.ops)) << 52;
    uint64_t h = 1469598103934665603ull;
    for (uint64_t b : bits) h = (h ^ b) * 1099511628211ull;
    return h ^ uint64_t(uint32_t(a.layer_begin)) * 0x9E3779B97F4A7C15ull;
  }

  // Runs as soon as the stream reaches it: compute, copies, and collectives of a group with one
  // materialized member (BuildOptions::representative_only: TP, DP, EP groups of a stage).
  bool starts_on_arrival(const Program& prog, const Instruction& in) {
    switch (in.op) {
      case Op::Forward: case Op::Backward: case Op::Recompute: case Op::OptimizerStep:
      case Op::CopyH2D: case Op::CopyD2H:
        return true;
      case Op::AllReduce: case Op::ReduceScatter: case Op::AllGather: case Op::AllToAll: {
        if (in.group < 0) return false;
        if (single_member_.size() <= size_t(in.group)) single_member_.resize(in.group + 1, -1);
        int8_t& known = single_member_[in.group];
        if (known < 0) {
          int materialized = 0;
          for (int r : prog.groups[in.group].ranks) {
            const RankCoord c = grid_.coord(r);
            if (!opts_.representative_only || (c.dp == 0 && c.tp == 0)) ++materialized;
          }
          known = materialized == 1 ? 1 : 0;
        }
        return known == 1;
      }
      default:
        return false;
    }
  }

  static Instruction make(Op op, Stream st, Purpose pu, int mb = -1, int chunk = -1) {
    Instruction in{};
    in.op = op;
    in.stream = st;
    in.purpose = pu;
    in.micro_batch = mb;
    in.chunk = chunk;
    return in;
  }

  void emit_rank(Program& prog, RankProgram& rp) {
    RankCtx x;
    x.rp = &rp;
    x.prog = &prog;
    x.c = grid_.coord(rp.rank);
    x.plan = &(*plans_)[x.c.pp];
    const std::vector<Action>& actions = *stage_actions_[x.c.pp];
    const StagePlan& plan = *x.plan;
    x.tp_g = t_ > 1 ? group_id(prog, GroupKind::TP, rp.rank) : -1;
    x.dp_n = sc_.parallel.dp;
    x.edp_n = grid_.expert_dp();
    x.dp_g = x.dp_n > 1 ? group_id(prog, GroupKind::DP, rp.rank) : -1;
    if (x.dp_g >= 0 && hpz_ > 1) x.hpz_g = sub_group(prog, rp.rank, GroupKind::DPIntra, hpz_);
    if (x.dp_g >= 0 && qgz_ && qgz_local_ > 1) {
      x.qgz_intra_g = sub_group(prog, rp.rank, GroupKind::DPIntra, qgz_local_);
      x.qgz_inter_g = sub_group(prog, rp.rank, GroupKind::DPInter, sc_.parallel.dp / qgz_local_);
    }
    x.edp_g = (plan.has_expert && x.edp_n > 1) ? group_id(prog, GroupKind::ExpertDP, rp.rank) : -1;
    x.ep_g = (m_.is_moe() && sc_.parallel.ep > 1) ? group_id(prog, GroupKind::EP, rp.rank) : -1;
    const bool emb_member = p_ > 1 && m_.tied_embeddings && (x.c.pp == 0 || x.c.pp == p_ - 1);
    x.emb_g = emb_member ? group_id(prog, GroupKind::Embedding, rp.rank) : -1;
    x.recv_act.assign(v_ * M_, kNone);
    x.recv_grad.assign(v_ * M_, kNone);
    x.fwd_out.assign(v_ * M_, kNone);
    x.bwd_out.assign(v_ * M_, kNone);
    x.templates.assign(2 * v_, {});
    x.p2p_proto.assign(4 * v_, Instruction{});
    x.p2p_made.assign(4 * v_, 0);

    // Stage 3: the compute segments in program order (for the prefetching gathers).
    std::vector<SegRef> segs;
    if (zero_ == 3) {
      for (const Action& a : actions) {
        if (a.act == Act::Fwd)
          for (int k = 0; k < int(plan.chunks[a.chunk].fwd.size()); ++k) segs.push_back({true, a.chunk, k});
        if (a.act == Act::Bwd)
          for (int k = int(plan.chunks[a.chunk].fwd.size()) - 1; k >= 0; --k)
            segs.push_back({false, a.chunk, k});
      }
      x.ag.assign(segs.size(), {kNone, kNone});
    }

    for (const Action& a : actions) {
      const Chunk& ch = plan.chunks[a.chunk];
      const int slot = a.chunk * M_ + a.mb;
      switch (a.act) {
        case Act::RecvAct:
          x.recv_act[slot] = add_p2p(x, 0, a, Op::Recv, Purpose::PipelineActivation, peer_of(x.c, ch.vs - 1),
                                     tag_of(ch.vs - 1, a.mb, 0), kNone);
          break;
        case Act::SendAct:
          add_p2p(x, 1, a, Op::Send, Purpose::PipelineActivation, peer_of(x.c, ch.vs + 1), tag_of(ch.vs, a.mb, 0),
                  x.fwd_out[slot]);
          break;
        case Act::RecvGrad:
          x.recv_grad[slot] = add_p2p(x, 2, a, Op::Recv, Purpose::PipelineGradient, peer_of(x.c, ch.vs + 1),
                                      tag_of(ch.vs + 1, a.mb, 1), kNone);
          break;
        case Act::SendGrad:
          add_p2p(x, 3, a, Op::Send, Purpose::PipelineGradient, peer_of(x.c, ch.vs - 1), tag_of(ch.vs, a.mb, 1),
                  x.bwd_out[slot]);
          break;
        case Act::Fwd: emit_compute_action(prog, x, segs, a, true); break;
        case Act::Bwd: emit_compute_action(prog, x, segs, a, false); break;
      }
    }
    emit_batch_end(x);
    finish_chain(x);
  }

  // A pipeline send / receive (`kind`: 0 RecvAct, 1 SendAct, 2 RecvGrad, 3 SendGrad) of action `a`,
  // waiting for `wait` (kNone: nothing). After a chunk's first, a copy of that one with its
  // micro-batch and tag written in place: an instruction assembled field by field on the stack and
  // then copied into the Program stalled on reading back its fresh stores.
  uint32_t add_p2p(RankCtx& x, int kind, const Action& a, Op op, Purpose purpose, int peer, int tag, uint32_t wait) {
    const int k = kind * v_ + a.chunk;
    if (!x.p2p_made[k]) {
      Instruction& in = x.p2p_proto[k];
      in = make(op, engine_.p2p_stream, purpose, a.mb, a.chunk);
      in.peer = peer;
      in.bytes = purpose == Purpose::PipelineActivation ? p2p_act_bytes_ : p2p_grad_bytes_;
      x.p2p_made[k] = 1;
    }
    // Not a compute instruction that starts on arrival (no chain to join): appended.
    const uint32_t id = append(x, x.p2p_proto[k], &wait, wait != kNone ? 1 : 0);
    Instruction& in = x.rp->instructions[id];
    in.micro_batch = a.mb;
    in.tag = tag;
    return id;
  }

  // A forward (or a backward that reduces nothing) of a chunk emits the same instructions for
  // every micro-batch; with collapse_chains that is one instruction (a chain) waiting for the
  // micro-batch's Recv, so after the first it is copied instead of emitted again (ZeRO 0-2; ZeRO-3's
  // gathers and reductions interleave with the compute).
  void emit_compute_action(Program& prog, RankCtx& x, const std::vector<SegRef>& segs, const Action& a, bool forward) {
    const int slot = a.chunk * M_ + a.mb;
    const bool reduces = !forward && (zero_ >= 2 || a.mb == M_ - 1);
    if (!opts_.collapse_chains || zero_ == 3 || reduces) {
      forward ? emit_forward(prog, x, segs, a) : emit_backward(prog, x, segs, a);
      return;
    }
    RankCtx::Template& t = x.templates[a.chunk * 2 + (forward ? 0 : 1)];
    const uint32_t recv = forward ? x.recv_act[slot] : x.recv_grad[slot];
    finish_chain(x);
    if (t.ok && t.waits == (recv != kNone)) {
      // (Copied from the template, then patched in place: see add_p2p.)
      const uint32_t id = t.waits ? x.rp->add(t.in, {recv}) : x.rp->add(t.in, {});
      x.rp->instructions[id].micro_batch = a.mb;
      x.last_compute = id;
      (forward ? x.fwd_out : x.bwd_out)[slot] = id;
      return;
    }
    const size_t before = x.rp->instructions.size();
    forward ? emit_forward(prog, x, segs, a) : emit_backward(prog, x, segs, a);
    if (t.tried) return;
    t.tried = true;
    const auto& ins = x.rp->instructions;
    if (ins.size() != before + 1 || ins.back().stream != Stream::Compute) return;
    const Instruction& in = ins.back();
    const bool waits = in.deps_count == 1 && x.rp->deps[in.deps_begin] == recv;
    if (!waits && !(in.deps_count == 0 && recv == kNone)) return;
    t.ok = true;
    t.in = in;
    t.waits = waits;
  }

  int peer_of(const RankCoord& c, int vs) const { return grid_.rank_of(c.dp, vs % p_, c.tp); }
  int tag_of(int sender_vs, int mb, int dir) const { return (mb * (p_ * v_) + sender_vs) * 2 + dir; }

  // Stage 3: issue the gathers of segments up to `k` plus the prefetch window.
  void issue_gathers(RankCtx& x, const std::vector<SegRef>& segs, size_t k) {
    const StagePlan& plan = *x.plan;
    const auto seg_layers = [&](size_t i) {
      const SegRef& r = segs[i];
      const Chunk& ch = plan.chunks[r.chunk];
      const Segment& s = ch.fwd[r.seg];  // (the backward runs the forward's segments)
      return std::make_pair(s.layer_begin, s.layer_count);
    };
    const auto seg_elems = [&](size_t i) {
      int64_t n = 0;
      auto [lb, lc] = seg_layers(i);
      for (int l = lb; l < lb + lc; ++l) {
        auto it = plan.s3_dense.find(l);
        if (it != plan.s3_dense.end()) n += plan.dense.stage3_groups[it->second].numel;
        auto jt = plan.s3_expert.find(l);
        if (jt != plan.s3_expert.end()) n += plan.expert.stage3_groups[jt->second].numel;
      }
      return n;
    };
    int64_t window = 0;
    for (size_t j = k + 1; j < x.ag_emitted && j < segs.size(); ++j) window += seg_elems(j);
    while (x.ag_emitted < segs.size()) {
      const size_t j = x.ag_emitted;
      if (j > k) {
        // How far ahead the engine prefetches (core/zero3_placement.hpp).
        if (!zero3_prefetch(sc_.zero, int(j - k), window, seg_elems(j))) break;
        window += seg_elems(j);
      }
      auto [lb, lc] = seg_layers(j);
      const SegRef& r = segs[j];
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        const auto& idx = expert ? plan.s3_expert : plan.s3_dense;
        const ZeroPartition& z = expert ? plan.expert : plan.dense;
        const int grp = expert ? x.edp_g : x.dp_g;
        uint32_t last = kNone;
        for (int l = lb; l < lb + lc; ++l) {
          auto it = idx.find(l);
          if (it == idx.end()) continue;
          const Stage3Group& sg = z.stage3_groups[it->second];
          uint32_t fetch = kNone;
          if (sc_.zero.offload_param) {
            Instruction h = make(Op::CopyH2D, Stream::Offload, Purpose::OffloadParam, -1, r.chunk);
            h.layer_begin = l;
            h.layer_count = 1;
            h.bytes = double(sg.shard_numel) * g_;
            // ZeRO-Infinity: the shard is read from NVMe into a host buffer first.
            if (sc_.zero.on_nvme_param(sc_.cluster.nvme_bandwidth)) h.memory_bytes = h.bytes;
            fetch = add(x, h, {});
            last = fetch;
          }
          if (grp >= 0) {
            Instruction in = make(Op::AllGather, Stream::DpComm, Purpose::ParamGather, -1, r.chunk);
            in.layer_begin = l;
            in.layer_count = 1;
            in.group = grp;
            in.bucket = it->second;
            // The engine's fetches of this layer: `repeat` all-gathers that together move the
            // group (the torch backend gathers the group in one call of the same bytes).
            in.repeat = (expert ? plan.s3_expert_calls : plan.s3_dense_calls)[it->second];
            in.bytes = s3_gather_bytes(sg.shard_numel, z.dp) / in.repeat;
            // hpZ: backward (and its recompute) gathers the secondary partition, kept after the
            // forward gather, within the node (DeepSpeed's ds_secondary_tensor); dense only.
            if (!r.forward && !expert && x.hpz_g >= 0) {
              in.group = x.hpz_g;
              in.bytes = s3_gather_bytes((sg.numel + hpz_ - 1) / hpz_, hpz_) / in.repeat;
            }
            last = add(x, in, {fetch});
          }
        }
        (expert ? x.ag[j].second : x.ag[j].first) = last;
      }
      ++x.ag_emitted;
    }
  }

  // Scatter/gather: the Recv brought this rank's 1/tp slice; the TP group all-gathers the rest
  // over NVLink before the chunk can run (Megatron's gather_split_1d_tensor).
  void gather_received_slice(RankCtx& x, uint32_t recv, Purpose purpose, int mb, int chunk) {
    const bool partitioned = purpose == Purpose::PipelineActivation ? engine_.partition_activations
                                                                    : engine_.partition_gradients;
    if (!partitioned || recv == kNone || x.tp_g < 0) return;
    Instruction in = make(Op::AllGather, Stream::Compute, purpose, mb, chunk);
    in.group = x.tp_g;
    in.bytes = act_bytes_;
    add_link(x, in, {recv});
  }

  void emit_tp(RankCtx& x, const Segment& s, int mb, int chunk) {
    const int layers = s.dense_layers + s.moe_layers;
    if (x.tp_g < 0 || layers == 0) return;
    // Megatron's f/g: 2 all-reduces per layer; with sequence parallelism each becomes an
    // all-gather + reduce-scatter pair. A MoE layer's experts are not TP-split: only its attention
    // has an f/g pair (its token drop / gather is emit_moe's).
    static constexpr Op kPlain[] = {Op::AllReduce};
    static constexpr Op kSequenceParallel[] = {Op::AllGather, Op::ReduceScatter};
    const bool sp = sc_.parallel.sequence_parallel;
    for (Op op : sp ? std::span<const Op>(kSequenceParallel) : std::span<const Op>(kPlain)) {
      Instruction in = make(op, Stream::Compute, Purpose::TensorParallel, mb, chunk);
      in.group = x.tp_g;
      in.layer_begin = s.layer_begin;
      in.layer_count = s.layer_count;
      in.repeat = sp ? 2 * layers : 2 * s.dense_layers + s.moe_layers;
      in.bytes = act_bytes_;
      add_link(x, in, {});
    }
  }

  // DeepSpeed's activation checkpointing options (core/scenario.hpp CheckpointingSpec) on the
  // layers of a segment, one instruction repeated per layer, on the compute stream: checkpointing.py
  // copies a partition to and from the host with a blocking .to(device), and all-gathers the
  // partitions over the model-parallel group before the recompute (get_full_inputs).
  // One TP rank's share of a layer input: partitioned over the group, or (sequence parallelism) a
  // sequence shard already.
  double checkpoint_partition_bytes() const { return act_bytes_ / t_; }
  void emit_checkpoint_copy(RankCtx& x, const Segment& s, int mb, int chunk, Op op) {
    const int layers = s.dense_layers + s.moe_layers;
    if (!sc_.checkpointing.offloads(sc_.recompute) || layers == 0) return;
    Instruction in = make(op, Stream::Compute, Purpose::OffloadActivation, mb, chunk);
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.repeat = layers;
    in.bytes = checkpoint_partition_bytes();
    add_link(x, in, {});
  }
  void emit_checkpoint_gather(RankCtx& x, const Segment& s, int mb, int chunk) {
    const int layers = s.dense_layers + s.moe_layers;
    // With sequence parallelism the checkpoint is a sequence shard already: nothing to gather.
    if (!sc_.checkpointing.partitions(sc_.recompute) || x.tp_g < 0 || layers == 0 ||
        sc_.parallel.sequence_parallel)
      return;
    emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_, layers);
  }

  // One TP collective of the segment's layer range on the blocking compute stream.
  void emit_tp_one(RankCtx& x, const Segment& s, int mb, int chunk, Op op, double bytes, int repeat = 1) {
    Instruction in = make(op, Stream::Compute, Purpose::TensorParallel, mb, chunk);
    in.group = x.tp_g;
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.repeat = repeat;
    in.bytes = bytes;
    add_link(x, in, {});
  }

  // Vocabulary-parallel embedding: each TP rank looks up its vocabulary slice and the partial
  // outputs are summed (all-reduce), or with sequence parallelism reduce-scattered into sequence
  // shards, whose backward is an all-gather. Not repeated by the full recompute (blocks only).
  void emit_tp_embedding(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (x.tp_g < 0 || !s.embedding) return;
    const bool sp = sc_.parallel.sequence_parallel;
    if (!backward) emit_tp_one(x, s, mb, chunk, sp ? Op::ReduceScatter : Op::AllReduce, act_bytes_);
    else if (sp) emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_);
  }

  // LM head (column-parallel over the vocabulary) and Megatron's vocab_parallel_cross_entropy.
  // Forward: with SP the final norm's sequence shards are all-gathered first; the loss all-reduces
  // three fp32 [b, s] tensors (max logit, predicted logit, sum of exponentials). Backward: the
  // input gradient of the head is summed over the TP group (the copy-to-TP-region's backward), or
  // reduce-scattered back into sequence shards with SP.
  void emit_tp_head(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (x.tp_g < 0 || !s.head) return;
    const bool sp = sc_.parallel.sequence_parallel;
    if (!backward) {
      if (sp) emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_);
      emit_tp_one(x, s, mb, chunk, Op::AllReduce, double(b_) * m_.seq_len * 4, 3);
    } else {
      emit_tp_one(x, s, mb, chunk, sp ? Op::ReduceScatter : Op::AllReduce, act_bytes_);
    }
  }

  // A MoE layer's all-to-alls over the EP group and, with tp > 1, DeepSpeed's token drop / gather
  // over the TP group (deepspeed/moe/sharded_moe.py MOELayer.forward, deepspeed/moe/mappings.py):
  // the tokens are the same on every TP rank, so each keeps 1/t of the capacity slots before the
  // dispatch (drop_tokens, no communication; its backward all-gathers the gradient) and the
  // combined slots are all-gathered after the combine (gather_tokens; its backward is a drop).
  // One all-gather of the whole [experts, capacity, h] buffer per layer and pass, after the two
  // all-to-alls in both (backward: combine, dispatch, then the drop's all-gather).
  void emit_moe(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (s.moe_layers == 0) return;
    if (x.ep_g >= 0) emit_moe_all_to_alls(x, s, mb, chunk, backward);
    if (x.tp_g >= 0 && !sc_.parallel.sequence_parallel)
      emit_tp_one(x, s, mb, chunk, Op::AllGather, moe_buffer_bytes_, s.moe_layers);
  }

  void emit_moe_all_to_alls(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    for (int k = 0; k < 2; ++k) {
      const bool dispatch = backward ? k == 1 : k == 0;
      Instruction in = make(Op::AllToAll, Stream::Compute,
                            dispatch ? Purpose::MoEDispatch : Purpose::MoECombine, mb, chunk);
      in.group = x.ep_g;
      in.layer_begin = s.layer_begin;
      in.layer_count = s.layer_count;
      in.repeat = s.moe_layers;
      in.bytes = a2a_bytes_;
      add_link(x, in, {});
    }
  }

  static void set_cost(Instruction& in, const OpsCost& c) {
    in.flops = c.flops;
    in.gemm_flops = c.gemm_flops;
    in.memory_bytes = c.memory_bytes;
  }

  // Forward / recompute / backward of one segment's layers for one micro-batch.
  static Instruction segment_compute(Op op, const Segment& s, const OpsCost& cost, const Action& a) {
    Instruction in = make(op, Stream::Compute, Purpose::None, a.mb, a.chunk);
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.ops = s.ops;
    set_cost(in, cost);
    return in;
  }

  void emit_forward(Program&, RankCtx& x, const std::vector<SegRef>& segs, const Action& a) {
    const Chunk& ch = x.plan->chunks[a.chunk];
    const int slot = a.chunk * M_ + a.mb;
    for (size_t k = 0; k < ch.fwd.size(); ++k) {
      const Segment& s = ch.fwd[k];
      uint32_t ag_d = kNone, ag_e = kNone;
      if (zero_ == 3) {
        issue_gathers(x, segs, x.seg_cursor);
        std::tie(ag_d, ag_e) = x.ag[x.seg_cursor];
        ++x.seg_cursor;
      }
      if (k == 0) gather_received_slice(x, x.recv_act[slot], Purpose::PipelineActivation, a.mb, a.chunk);
      add_link(x, segment_compute(Op::Forward, s, s.fwd, a), {k == 0 ? x.recv_act[slot] : kNone, ag_d, ag_e});
      emit_checkpoint_copy(x, s, a.mb, a.chunk, Op::CopyD2H);
      emit_tp_embedding(x, s, a.mb, a.chunk, false);
      emit_tp(x, s, a.mb, a.chunk);
      emit_tp_head(x, s, a.mb, a.chunk, false);
      emit_moe(x, s, a.mb, a.chunk, false);
    }
    x.fwd_out[slot] = compute_tail(x);
  }

  void emit_backward(Program&, RankCtx& x, const std::vector<SegRef>& segs, const Action& a) {
    const StagePlan& plan = *x.plan;
    const Chunk& ch = plan.chunks[a.chunk];
    const int slot = a.chunk * M_ + a.mb;
    const bool overlap = sc_.zero.overlap_comm;
    // Which micro-batches reduce gradients: every one for stage 2 (and 3), the last for 0 / 1.
    const bool reduce_now = zero_ >= 2 || a.mb == M_ - 1;
    // DeepSpeed's PipelineEngine reduces only in ReduceGrads, after the whole schedule, blocking
    // (core/pipeline_engine.hpp): every bucket is postponed to the batch end, on the compute stream.
    const bool after = engine_.reduce_after_schedule;
    const bool split = zero_ < 3 && overlap && reduce_now && !after;
    const std::vector<Segment>& bsegs = split ? ch.bwd_split : ch.fwd;
    const Stream red_stream = overlap && !after ? Stream::DpComm : Stream::Compute;
    for (int k = int(bsegs.size()) - 1; k >= 0; --k) {
      const Segment& s = bsegs[k];
      const bool first = k == int(bsegs.size()) - 1;
      uint32_t ag_d = kNone, ag_e = kNone;
      if (zero_ == 3) {
        issue_gathers(x, segs, x.seg_cursor);
        std::tie(ag_d, ag_e) = x.ag[x.seg_cursor];
        ++x.seg_cursor;
      }
      const uint32_t grad_in = first ? x.recv_grad[slot] : kNone;
      if (first) gather_received_slice(x, grad_in, Purpose::PipelineGradient, a.mb, a.chunk);
      if (sc_.recompute != Recompute::none) {
        emit_checkpoint_copy(x, s, a.mb, a.chunk, Op::CopyH2D);
        emit_checkpoint_gather(x, s, a.mb, a.chunk);
        add_link(x, segment_compute(Op::Recompute, s, s.rec, a), {grad_in, ag_d, ag_e});
        if (sc_.recompute == Recompute::full) {  // the recomputed forward repeats its TP / MoE comm
          emit_tp(x, s, a.mb, a.chunk);
          emit_moe(x, s, a.mb, a.chunk, false);
        }
      }
      add_link(x, segment_compute(Op::Backward, s, s.bwd, a), {grad_in, ag_d, ag_e});
      emit_tp_embedding(x, s, a.mb, a.chunk, true);
      emit_tp(x, s, a.mb, a.chunk);
      emit_tp_head(x, s, a.mb, a.chunk, true);
      emit_moe(x, s, a.mb, a.chunk, true);
      // What a reduction of this segment's gradients waits for (closes the chain: only when one follows).
      const uint32_t produced = zero_ == 3 || reduce_now ? compute_tail(x) : x.last_compute;

      if (zero_ == 3) {
        for (int pass = 0; pass < 2; ++pass) {
          const bool expert = pass == 1;
          const auto& idx = expert ? plan.s3_expert : plan.s3_dense;
          const ZeroPartition& z = expert ? plan.expert : plan.dense;
          for (int l = s.layer_begin + s.layer_count - 1; l >= s.layer_begin; --l) {
            auto it = idx.find(l);
            if (it == idx.end()) continue;
            const Stage3Group& sg = z.stage3_groups[it->second];
            const BucketFlags& f = expert ? plan.expert_flags : plan.dense_flags;
            const uint32_t sp_sum = emit_sp_grad_sum(x, f.s3_sp_elems[it->second], it->second, a.mb, a.chunk,
                                                     l, produced, red_stream);
            if (sg.trainable_numel == 0) continue;  // every tensor of the group frozen: no gradient
            emit_reduction(x, Op::ReduceScatter, expert, it->second, double(sg.trainable_padded_numel()),
                           double(sg.trainable_shard_numel), a.mb, a.chunk, l, produced, red_stream, sp_sum,
                           (expert ? plan.s3_expert_reduces : plan.s3_dense_reduces)[it->second]);
          }
        }
      } else if (reduce_now) {
        // Buckets whose lowest layer is in this segment (whole segments: the chunk's last one).
        for (const BucketRef& r : plan.buckets) {
          if (r.chunk != a.chunk || r.layer < s.layer_begin || r.layer >= s.layer_begin + s.layer_count)
            continue;
          const BucketFlags& f = r.expert ? plan.expert_flags : plan.dense_flags;
          const uint32_t sp_sum = emit_sp_grad_sum(x, f.sp_elems[r.bucket], r.bucket, a.mb, a.chunk, r.layer,
                                                   produced, red_stream);
          if (onebit_) continue;  // replaced by the compressed all-reduce at the batch end
          const ZeroPartition& z = r.expert ? plan.expert : plan.dense;
          const GradBucket& bk = z.grad_buckets[r.bucket];
          const int me = r.expert ? x.c.edp : x.c.dp;
          const double mine = zero_ == 0 ? double(bk.range.count)
                                         : double(bk.sub_shards[std::min(me, int(bk.sub_shards.size()) - 1)].count);
          const Op op = zero_ == 0 ? Op::AllReduce : Op::ReduceScatter;
          if (after || (postpones_tied(x) && f.tied[r.bucket])) {  // after the EmbeddingSync (emit_batch_end)
            x.postponed.push_back({op, r.expert, r.bucket, double(bk.range.count), mine, a.mb, a.chunk, r.layer,
                                   sp_sum, red_stream});
            continue;
          }
          emit_reduction(x, op, r.expert, r.bucket, double(bk.range.count), mine, a.mb, a.chunk, r.layer,
                         produced, red_stream, sp_sum);
        }
      }
    }
    x.bwd_out[slot] = compute_tail(x);
  }

  // DeepSpeed ReduceTiedGrads before ReduceGrads: on the first and last stage of a pipeline with
  // tied embeddings, the buckets holding the word embedding (or its copy) are reduced after the
  // EmbeddingSync at the batch end. Stages 0/1 only (DeepSpeed refuses pp > 1 with ZeRO-2/3,
  // core/validate too; those builds keep reducing such buckets in the backward).
  bool postpones_tied(const RankCtx& x) const { return x.emb_g >= 0 && zero_ <= 1 && !onebit_; }

  // Sequence parallelism: the TP group sums the partial gradients of the SP-replicated parameters
  // (layer norms, row-parallel biases, position embedding) inside a bucket before its reduction
  // (Megatron's all-reduce of sequence-parallel grads in finalize_model_grads). Emitted also
  // without a DP group. Returns the instruction, kNone when there is none.
  uint32_t emit_sp_grad_sum(RankCtx& x, int64_t sp_elems, int bucket, int mb, int chunk, int layer,
                            uint32_t produced, Stream st) {
    if (!sc_.parallel.sequence_parallel || x.tp_g < 0 || sp_elems <= 0) return kNone;
    Instruction in = make(Op::AllReduce, st, Purpose::TensorParallel, mb, chunk);
    in.group = x.tp_g;
    in.bucket = bucket;
    in.layer_begin = layer;
    in.layer_count = 1;
    in.bytes = double(sp_elems) * g_;
    return add(x, in, {produced});
  }

  // `repeat`: the engine's calls for these elements (ZeRO-3: core/zero3_placement.hpp), each
  // moving an equal share.
  void emit_reduction(RankCtx& x, Op op, bool expert, int bucket, double elems, double mine_elems,
                      int mb, int chunk, int layer, uint32_t produced, Stream st, uint32_t sp_sum = kNone,
                      int repeat = 1) {
    const int grp = expert ? x.edp_g : x.dp_g;
    uint32_t id = kNone;
    if (grp >= 0 && op == Op::ReduceScatter && qgz_ && !expert) {
      // qgZ (DeepSpeed all_to_all_quant_reduce): int4 (0.5 byte per element) all-to-all of the
      // bucket within the node, a local reduction to 1/L of it, int4 all-to-all across the nodes
      // (the DP ranks at the same place in every node). One level over the DP group when it
      // lies within a node or its node-local part is not a divisor. Scales are left out (one fp32
      // per quantization group: under 0.1% of the int4 bytes).
      const bool two = x.qgz_intra_g >= 0 && x.qgz_inter_g >= 0;
      const std::pair<int, double> levels[] = {{two ? x.qgz_intra_g : grp, elems * 0.5},
                                               {two ? x.qgz_inter_g : -1, elems * 0.5 / qgz_local_}};
      uint32_t prev = kNone;
      for (const auto& [g, bytes] : levels) {
        if (g < 0) continue;
        Instruction in = make(Op::AllToAll, st, Purpose::GradientReduce, mb, chunk);
        in.group = g;
        in.bucket = bucket;
        in.layer_begin = layer;
        in.layer_count = 1;
        in.repeat = repeat;
        in.bytes = bytes / repeat;
        prev = id = prev == kNone ? add(x, in, {produced, sp_sum}) : add(x, in, {prev});
      }
      x.last_reduce = id;
    } else if (grp >= 0) {
      Instruction in = make(op, st, Purpose::GradientReduce, mb, chunk);
      in.group = grp;
      in.bucket = bucket;
      in.layer_begin = layer;
      in.layer_count = 1;
      in.repeat = repeat;
      in.bytes = elems * cg_ / repeat;  // communication_data_type (default: the compute dtype)
      id = add(x, in, {produced, sp_sum});
      x.last_reduce = id;
    }
    if (sc_.zero.offload_optimizer) {
      Instruction d = make(Op::CopyD2H, Stream::Offload, Purpose::OffloadGradient, mb, chunk);
      d.bucket = bucket;
      d.layer_begin = layer;
      d.layer_count = 1;
      d.bytes = mine_elems * g_;
      // The host adds them into its fp32 gradient buffer: read g + 4, write 4 bytes per element.
      d.memory_bytes = mine_elems * (g_ + 8.0);
      x.last_d2h = add(x, d, {id != kNone ? id : produced, id != kNone ? kNone : sp_sum});
    }
  }

  void emit_batch_end(RankCtx& x) {
    const StagePlan& plan = *x.plan;
    uint32_t emb = kNone;
    if (x.emb_g >= 0) {  // DeepSpeed ReduceTiedGrads / Megatron's embedding group all-reduce
      Instruction in = make(Op::AllReduce, engine_.batch_end_stream, Purpose::EmbeddingSync);
      in.group = x.emb_g;
      // BF16_Optimizer: the tied weight's fp32 gradient (weight._hp_grad).
      in.bytes = double(m_.vocab) * m_.hidden / t_ * (engine_.bf16_optimizer ? 4 : g_);
      emb = add(x, in, {compute_tail(x)});
    }
    // The reductions of the buckets holding the tied embedding, as the backward would have emitted
    // them, after the sync; the optimizer step waits for them through last_reduce / last_d2h.
    for (const RankCtx::Postponed& r : x.postponed)
      emit_reduction(x, r.op, r.expert, r.bucket, r.elems, r.mine_elems, r.mb, r.chunk, r.layer, emb, r.st,
                     r.sp_sum);
    x.postponed.clear();
    if (onebit_) {
      // deepspeed/runtime/comm/nccl.py NcclBackend.compressed_allreduce on the flat momentum,
      // padded as deepspeed/runtime/fp16/onebit/adam.py pads it (corrected_tensor_size: a multiple
      // of N * divider, divider = lcm(N, 8) = N * 8 / gcd(N, 8)): all-to-all of packed worker signs,
      // all-gather of worker scales, all-gather of packed server signs, all-gather of server scales.
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int grp = expert ? x.edp_g : x.dp_g;
        const int n_ranks = expert ? x.edp_n : x.dp_n;
        if (grp < 0) continue;
        const double numel = double(expert ? plan.expert.numel : plan.dense.numel);
        const double unit = double(n_ranks) * (8.0 * n_ranks / std::gcd(n_ranks, 8));
        const double n = std::ceil(numel / unit) * unit;
        // Each phase with the local work before it (the decompression rides on the last one).
        const std::tuple<Op, Purpose, double, double> phases[] = {
            {Op::AllToAll, Purpose::OneBitSigns, n / 8, kOnebitWorkerBytesPerElement * n},
            {Op::AllGather, Purpose::OneBitScales, 4.0 * n_ranks, 0.0},
            {Op::AllGather, Purpose::OneBitServer, n / 8, kOnebitServerBytesPerElement * n},
            {Op::AllGather, Purpose::OneBitScales, 4.0 * n_ranks, kOnebitDecompressBytesPerElement * n},
        };
        for (const auto& [op, pu, bytes, local] : phases) {
          Instruction in = make(op, Stream::DpComm, pu);
          in.group = grp;
          in.bytes = bytes;
          in.memory_bytes = local;
          x.last_reduce = add(x, in, {compute_tail(x)});
        }
      }
    }
    const double shard = zero_ == 0 ? double(plan.dense.numel + (plan.has_expert ? plan.expert.numel : 0))
                       : zero_ == 3 ? double(s3_shard(plan.dense) + (plan.has_expert ? s3_shard(plan.expert) : 0))
                                    : double(plan.dense.shard_numel + (plan.has_expert ? plan.expert.shard_numel : 0));
    uint32_t updated = kNone;
    if (sc_.zero.offload_optimizer) {
      Instruction h = make(Op::HostOptimizerStep, Stream::Host, Purpose::None);  // fp32 gradients on the host
      h.flops = shard * kAdamFlopsPerParam;
      h.memory_bytes = shard * host_step_bytes_per_param(g_, step_takes_norm());
      // ZeRO-Infinity: the fp32 master, momentum and variance swapped in from NVMe and back out
      // (12 bytes each way, Lion 8), and with parameters on NVMe the updated 16-bit shard written.
      const double states = sc_.optimizer.kind == OptimizerKind::lion ? 8.0 : 12.0;
      if (sc_.zero.on_nvme_optimizer(sc_.cluster.nvme_bandwidth)) h.bytes += shard * 2 * states;
      if (sc_.zero.on_nvme_param(sc_.cluster.nvme_bandwidth)) h.bytes += shard * g_;
      const uint32_t step = add(x, h, {x.last_d2h, x.last_reduce, emb, compute_tail(x)});
      Instruction up = make(Op::CopyH2D, Stream::Offload, Purpose::OffloadParam);
      up.bytes = shard * g_;
      updated = add(x, up, {step});
    } else if (engine_.bf16_optimizer) {
      // DeepSpeed's BF16_Optimizer (core/pipeline_engine.hpp): norm (and clip) over the whole fp32
      // buffer, Adam on this rank's 1/dp partition, its copy to bf16, the buffer cleared; then the
      // bf16 partitions all-gathered over DP, blocking, in allgather_bucket_size pieces.
      double partition = 0;
      struct Gathers { int group, n; std::vector<int64_t> pieces; };  // elements per rank per call
      std::vector<Gathers> gathers;
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int64_t numel = (expert ? plan.expert : plan.dense).numel;
        const int n = expert ? x.edp_n : x.dp_n;
        partition += double(bf16_partition_numel(numel, n));
        const int grp = expert ? x.edp_g : x.dp_g;
        if (grp >= 0) gathers.push_back({grp, n, bf16_allgather_pieces(numel, n, sc_.zero.allgather_bucket_size)});
      }
      Instruction o = make(Op::OptimizerStep, Stream::Compute, Purpose::None);
      o.flops = partition * kAdamFlopsPerParam + shard;  // the norm: one multiply-add per element
      o.memory_bytes = bf16_optimizer_step_bytes(shard, partition, sc_.training.gradient_clipping > 0);
      updated = add(x, o, {x.last_reduce, emb});
      for (const Gathers& ga : gathers)
        for (size_t k = 0; k < ga.pieces.size(); ++k) {
          Instruction in = make(Op::AllGather, engine_.batch_end_stream, Purpose::ParamGather);
          in.group = ga.group;
          in.bucket = int(k);
          in.bytes = double(ga.pieces[k]) * ga.n * g_;
          add(x, in, {updated});
        }
    } else {
      Instruction o = make(Op::OptimizerStep, Stream::Compute, Purpose::None);
      o.flops = shard * kAdamFlopsPerParam;
      // Stages 0-2 read the g-byte gradients in place unless an fp32 accumulator is kept (stage 3:
      // folded in backward, op_list; stages 0/1 with 1-bit Adam or MoE: folded at the step).
      DeviceStep step;
      step.g = g_, step.zero_stage = zero_, step.fused = sc_.optimizer.fused_step, step.onebit = onebit_;
      step.in_place = step.fused && (zero_ == 2 || steps_gradient_buckets_in_place(sc_));
      step.norm = step_takes_norm();
      o.memory_bytes = shard * device_step_bytes_per_param(step);
      updated = add(x, o, {x.last_reduce, emb});
    }
    if (zero_ == 1 || zero_ == 2) {  // all-gather the updated 16-bit shards
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int grp = expert ? x.edp_g : x.dp_g;
        if (grp < 0) continue;
        const ZeroPartition& z = expert ? plan.expert : plan.dense;
        for (size_t k = 0; k < z.allgather_buckets.size(); ++k) {
          Instruction in = make(Op::AllGather, Stream::DpComm, Purpose::ParamGather);
          in.group = grp;
          in.bucket = int(k);
          in.bytes = double(z.allgather_buckets[k].count_per_rank) * z.dp * g_;
          add(x, in, {updated});
        }
      }
    }
  }

  // A stage-3 all-gather's output bytes for `shard` elements from each of `n` ranks: 16-bit, or
  // with qwZ int8 plus one fp32 scale per block of at most kQwzBlock elements of each rank's shard
  // (DeepSpeed's CUDAQuantizer: target_group_size 8000, symmetric 8-bit).
  double s3_gather_bytes(int64_t shard, int n) const {
    if (!qwz_) return double(shard) * n * g_;
    return (double(shard) + 4.0 * double((shard + kQwzBlock - 1) / kQwzBlock)) * n;
  }

  static int64_t s3_shard(const ZeroPartition& z) {  // what the optimizer steps: trainable elements
    int64_t n = 0;
    for (const auto& g : z.stage3_groups) n += g.trainable_shard_numel;
    return n;
  }

  const Scenario& sc_;
  BuildOptions opts_;
  ProcessGrid grid_;
  const ModelSpec& m_;
  int p_ = 1, v_ = 1, t_ = 1, M_ = 1, b_ = 1, g_ = 2, zero_ = 0;
  int cg_ = 2;                       // bytes per element of the DP gradient reduction (communication_data_type)
  int hpz_ = 1, qgz_local_ = 1;      // ZeRO++: secondary partition size; DP ranks per node for qgZ
  bool qwz_ = false, qgz_ = false;
  static constexpr int64_t kQwzBlock = 8000;
  std::map<std::pair<int, std::vector<int>>, int> sub_groups_;
  bool onebit_ = false;
  double act_bytes_ = 0, p2p_act_bytes_ = 0, p2p_grad_bytes_ = 0, a2a_bytes_ = 0, moe_buffer_bytes_ = 0;
  PipelineEngineModel engine_;
  std::vector<int> vs_layers_, vs_first_layer_;
  std::vector<StagePlan> own_plans_;
  const std::vector<StagePlan>* plans_ = nullptr;         // own_plans_ or cached_->plans
  std::shared_ptr<const StagePlans> cached_;               // (BuildOptions::stage_plans)
  std::vector<const std::vector<Action>*> stage_actions_;  // [stage] into schedule()
  OpListCache cache_;
  std::vector<std::vector<int>> group_ids_;
  std::shared_ptr<const std::vector<std::vector<Action>>> schedule_;
  std::vector<int8_t> single_member_;  // [group] one materialized member: 1, not: 0, not known: -1
  ChainIndex chain_index_;  // collapse_chains: chains by cost hash
};

}  // namespace

struct StagePlanCache::Impl {
  std::map<std::vector<int64_t>, std::shared_ptr<const StagePlans>> done;
  // The stages' partitions (plan_partition, no segments yet), by fewer keys.
  std::map<std::vector<int64_t>, std::shared_ptr<const std::vector<StagePlan>>> partitions;
};
StagePlanCache::StagePlanCache() : impl(std::make_unique<Impl>()) {}
StagePlanCache::~StagePlanCache() = default;

namespace {

void Builder::plan_stages(Program& prog) {
  StagePlanCache* cache = opts_.stage_plans;
  // Keys: what plan_partition reads of the scenario that a search varies (pkey: the partitions,
  // shared by configurations that differ in the micro-batch size, recompute or sequence
  // parallelism too), and what plan_segments reads on top of it (key). Not the micro-batch count.
  // The offload matters to ZeRO-3's gradient fold only.
  std::vector<int64_t> pkey, key;
  if (cache) {
    const Scenario& sc = sc_;
    pkey = {p_, v_, t_, sc.parallel.dp, sc.parallel.ep, zero_, sc.finetune.rank};
    pkey.insert(pkey.end(), vs_layers_.begin(), vs_layers_.end());
    key = pkey;
    key.insert(key.end(), {sc.parallel.sequence_parallel ? 1 : 0, b_, static_cast<int64_t>(sc.recompute),
                           zero_ == 3 && sc.zero.offload_optimizer ? 1 : 0, sc.checkpointing.partition_activations ? 1 : 0,
                           sc.checkpointing.cpu_checkpointing ? 1 : 0});
    if (auto it = cache->impl->done.find(key); it != cache->impl->done.end()) {
      cached_ = it->second;
      plans_ = &cached_->plans;
      prog.op_lists.share(cached_->op_lists);
      return;
    }
  }
  // The partitions (copied: the segments are added to them).
  const auto found = cache ? cache->impl->partitions.find(pkey) : decltype(cache->impl->partitions)::iterator{};
  if (cache && found != cache->impl->partitions.end()) {
    own_plans_ = *found->second;
  } else {
    own_plans_.assign(p_, {});
    for (int s = 0; s < p_; ++s) plan_partition(s);
    if (cache) {
      if (cache->impl->partitions.size() >= 64) cache->impl->partitions.clear();
      cache->impl->partitions.emplace(std::move(pkey), std::make_shared<const std::vector<StagePlan>>(own_plans_));
    }
  }
  for (int s = 0; s < p_; ++s) plan_segments(s, prog);
  plans_ = &own_plans_;
  if (!cache) return;
  auto e = std::make_shared<StagePlans>();
  e->plans = std::move(own_plans_);
  e->op_lists = prog.op_lists.shared();
  cached_ = e;
  plans_ = &cached_->plans;
  // A search meets its configurations' keys in runs (the fast path's Programs of one, then the
  // offload variants): the last few are enough.
  if (cache->impl->done.size() >= 64) cache->impl->done.clear();
  cache->impl->done.emplace(std::move(key), std::move(e));
}

}  // namespace

Program build_program(const Scenario& sc, const BuildOptions& opts) {
  if (sc.parallel.world() < 1) throw std::invalid_argument("build_program: empty world");
  Builder b(sc, opts);
  return b.build();
}

}  // namespace dssim
