// Stage planning (core/stage_plan.hpp): each stage's chunks, tensors, ZeRO partitions, gradient
// buckets and compute segments, and the kernel lists the segments index.
#include "core/stage_plan.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "core/finetune.hpp"
#include "core/memory.hpp"
#include "core/optimizer_step.hpp"
#include "core/zero3_placement.hpp"

namespace dssim {
namespace {

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

}  // namespace

struct StagePlanCache::Impl {
  std::map<std::vector<int64_t>, std::shared_ptr<const StagePlans>> done;
  // The stages' partitions (plan_partition, no segments yet), by fewer keys.
  std::map<std::vector<int64_t>, std::shared_ptr<const std::vector<StagePlan>>> partitions;
};
StagePlanCache::StagePlanCache() : impl(std::make_unique<Impl>()) {}
StagePlanCache::~StagePlanCache() = default;

namespace {

// Plans the stages of one build (plan_stages).
class StagePlanner {
 public:
  StagePlanner(const Scenario& sc, const ProcessGrid& grid, const PipelineEngineModel& engine)
      : sc_(sc), grid_(grid), m_(sc.model), engine_(engine) {
    p_ = sc.parallel.pp;
    v_ = std::max(1, sc.parallel.interleave);
    t_ = sc.parallel.tp;
    b_ = std::max(1, sc.training.micro_batch);
    g_ = bytes_of(sc.precision.dtype);
    zero_ = sc.zero.stage;
    vs_layers_ = virtual_stage_layers(sc);
    vs_first_layer_.resize(vs_layers_.size() + 1, 0);
    for (size_t i = 0; i < vs_layers_.size(); ++i) vs_first_layer_[i + 1] = vs_first_layer_[i] + vs_layers_[i];
  }

  // Every stage's plan, or the cached ones (BuildOptions::stage_plans) with their kernel lists.
  std::shared_ptr<const std::vector<StagePlan>> plan_stages(Program& prog, StagePlanCache* cache);

 private:
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
      // ZeRO-3 reduces (on one rank: folds) each layer group's 16-bit gradients into the gradient
      // partition in every micro-batch's backward, and zero-fills the next micro-batch's: g to
      // zero-fill, g read, the partition read and written (g bytes each in the training dtype,
      // 4 with zero.grad_accum_dtype: fp32): 4g, or 2g + 8 (the optimizer step then has no fold).
      // (On one rank with the partition in the training dtype backward accumulates into the
      // partition itself: nothing to fold, core/memory.hpp zero3_backward_into_partition.)
      if (!zero3_backward_into_partition(sc_)) {
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
        const double fold_bytes = sc_.zero.offload_optimizer               ? 3.0 * g_
                                  : sc_.zero.model_dtype_grad_partition() ? 4.0 * g_
                                                                          : fold_bytes_per_param(g_);
        fold.memory_bytes = fold_bytes * params;
        fold.flops = params;
        fold.backward_only = true;
        ops.push_back(fold);
      }
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

  const Scenario& sc_;
  const ProcessGrid& grid_;
  const ModelSpec& m_;
  const PipelineEngineModel& engine_;
  int p_ = 1, v_ = 1, t_ = 1, b_ = 1, g_ = 2, zero_ = 0;
  std::vector<int> vs_layers_, vs_first_layer_;
  std::vector<StagePlan> own_plans_;
  OpListCache cache_;
};

std::shared_ptr<const std::vector<StagePlan>> StagePlanner::plan_stages(Program& prog, StagePlanCache* cache) {
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
      const std::shared_ptr<const StagePlans>& cached = it->second;
      prog.op_lists.share(cached->op_lists);
      return {cached, &cached->plans};
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
  if (!cache) return std::make_shared<const std::vector<StagePlan>>(std::move(own_plans_));
  auto e = std::make_shared<StagePlans>();
  e->plans = std::move(own_plans_);
  e->op_lists = prog.op_lists.shared();
  // A search meets its configurations' keys in runs (the fast path's Programs of one, then the
  // offload variants): the last few are enough.
  if (cache->impl->done.size() >= 64) cache->impl->done.clear();
  cache->impl->done.emplace(std::move(key), e);
  return {e, &e->plans};
}

}  // namespace

std::shared_ptr<const std::vector<StagePlan>> plan_stages(const Scenario& sc, const ProcessGrid& grid,
                                                          const PipelineEngineModel& engine, Program& prog,
                                                          StagePlanCache* cache) {
  return StagePlanner(sc, grid, engine).plan_stages(prog, cache);
}

}  // namespace dssim
