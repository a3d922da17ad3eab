#include "backends/torch/engine.hpp"
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include "backends/torch/checkpoint.hpp"
#include "backends/torch/gpt.hpp"
#include "backends/torch/host_accumulator.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/onebit_adam.hpp"
#include "core/program_builder.hpp"
#include "backends/torch/pipeline.hpp"
#include "backends/torch/tensor_parallel.hpp"
#include "core/grid.hpp"
#include "core/memory.hpp"
#include "core/pipeline_engine.hpp"
#include "backends/torch/loss_scaler.hpp"
#include "backends/torch/optimizer_kernels.hpp"
#include "backends/torch/torch_compat.hpp"
#include "core/zero_partition.hpp"

namespace dssim::tb {

std::string counter_key(Op op, Purpose p) { return std::string(to_string(op)) + "/" + to_string(p); }

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

at::ScalarType torch_dtype(Dtype d) {
  switch (d) {
    case Dtype::fp32: return at::kFloat;
    case Dtype::fp16: return at::kHalf;
    case Dtype::bf16: return at::kBFloat16;
  }
  return at::kFloat;
}

int layer_of_unit(const GptConfig& c, int u) {
  return u == 0 ? 0 : u >= c.final_unit() ? c.layers - 1 : u - 1;
}

// The parameter tensors in model order with their layer (module) for ZeRO-3 fetching: the
// partition the Program's byte counts come from, applied here to real tensors.
ZeroPartitionSpec partition_spec(const GptConfig& c, const ZeroSpec& z, int dp, const std::vector<int>& units) {
  // As core/program_builder lays it out: the embedding belongs to layer 0, the final norm (and the
  // last stage's copy of the tied embedding) to the last layer; stage 0 all-reduces the unpadded
  // buffer (one "rank", no alignment).
  // Fine-tuning (lora.hpp): stages 0-2 partition the trainable tensors only (the frozen ones stay
  // whole on every rank), stage 3 every tensor with its trainable flag.
  ZeroPartitionSpec spec;
  for (int u : units) {
    const auto ps = unit_params(c, u);
    for (size_t i = 0; i < ps.size(); ++i) {
      const bool tr = param_trainable(c, u, int(i));
      if (!tr && z.stage < 3) continue;
      spec.numel.push_back(ps[i].numel());
      spec.layer.push_back(layer_of_unit(c, u));
      if (c.ft.active) spec.trainable.push_back(tr);
    }
  }
  spec.dp = z.stage == 0 ? 1 : dp;
  spec.alignment = z.stage == 0 ? 1 : 2;
  spec.reduce_bucket_size = std::max<int64_t>(1, z.reduce_bucket_size);
  spec.allgather_bucket_size = std::max<int64_t>(1, z.allgather_bucket_size);
  return spec;
}


// The process grid of the scenario, checked against the ranks that are running.
ProcessGrid checked_grid(const Scenario& sc, const Communicator& world) {
  const auto& p = sc.parallel;
  if (p.world() != world.size())
    throw std::invalid_argument("torch backend: the scenario's parallel layout needs tp x pp x dp = " +
                                std::to_string(p.tp) + " x " + std::to_string(p.pp) + " x " + std::to_string(p.dp) +
                                " = " + std::to_string(p.world()) + " ranks, but " + std::to_string(world.size()) +
                                " are running (use --nproc " + std::to_string(p.world()) +
                                ", or launch that many ranks)");
  return ProcessGrid(p);
}

class Engine {
 public:
  Engine(const Scenario& sc, const Program& program, Communicator& world, const EngineOptions& o,
         const torch::Device& device)
      : sc_(sc), program_(program), world_(world), o_(o), dev_(device), grid_(checked_grid(sc, world)),
        coord_(grid_.coord(world.rank())),
        cfg_(GptConfig::from(sc.model, sc.parallel.tp, coord_.tp, sc.parallel.sequence_parallel, &sc.finetune)),
        stage_(sc.zero.stage), dp_(sc.parallel.dp), rank_(world.rank()), dpr_(coord_.dp),
        dtype_(torch_dtype(sc.precision.dtype)),
        fp16_(sc.precision.dtype == Dtype::fp16),
        scaler_(sc.precision.loss_scale, fp16_),
        data_(o.data_path, cfg_.vocab, cfg_.seq_len, sc.training.seed), pipe_(world) {
    const auto& par = sc.parallel;
    if (sc.optimizer.kind != OptimizerKind::adamw && sc.optimizer.kind != OptimizerKind::onebit_adam)
      throw std::invalid_argument(std::string("torch backend: only AdamW and 1-bit Adam are implemented (the scenario "
                                              "asks for ") + to_string(sc.optimizer.kind) + ")");
    if (stage_ < 0 || stage_ > 3) throw std::invalid_argument("zero.stage must be 0..3");
    if (sc.checkpointing.partitions(sc.recompute))
      throw std::invalid_argument("torch backend: activation_checkpointing.partition_activations (and cpu_checkpointing) "
                                  "is not implemented; the analytic and sim backends model it; set "
                                  "activation_checkpointing.partition_activations: false to run");
    if (cfg_.ft.active) {  // fine-tuning: data parallelism with ZeRO 0-3 (and offload) only
      const auto refuse = [](const std::string& what) {
        return std::invalid_argument("torch backend: fine-tuning (finetune.method lora, or finetune.freeze) with " + what +
                                     " is not implemented; the analytic and sim backends model it (dssim scenario)");
      };
      if (par.pp > 1) throw refuse("pipeline parallelism (parallel.pp > 1); set parallel.pp: 1");
      if (par.tp > 1) throw refuse("tensor parallelism (parallel.tp > 1); set parallel.tp: 1");
      if (sc.model.is_moe()) throw refuse("a MoE model");
      if (sc.optimizer.kind == OptimizerKind::onebit_adam) throw refuse("1-bit Adam; use optimizer.type: adamw");
      if (cfg_.ft.dropout > 0 && sc.recompute == Recompute::full)
        throw refuse("finetune.dropout > 0 and recompute: full (the recomputed forward would draw another dropout "
                     "mask); set finetune.dropout: 0 or recompute: none / selective");
    }
    if (par.pp > 1 && stage_ >= 2)
      throw std::invalid_argument("zero.stage " + std::to_string(stage_) +
                                  " with pipeline parallelism: DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 "
                                  "only (ZeRO-2/3 partition gradients, which the pipeline accumulates over "
                                  "micro-batches); set zero.stage: 1 or parallel.pp: 1");
    if (par.tp > 1 && stage_ == 3)
      throw std::invalid_argument("torch backend: zero.stage 3 with tensor parallelism (parallel.tp > 1) is not "
                                  "implemented; use zero.stage 0-2 with tp > 1, or tp: 1");
    if (par.tp > 1 && par.scatter_gather && !par.sequence_parallel)
      throw std::invalid_argument("torch backend: parallel.scatter_gather is not implemented (the pipeline sends "
                                  "whole activations); set parallel.scatter_gather: false");
    // DeepSpeed's engine (core/pipeline_engine.hpp) runs here as emitted (blocking p2p on the
    // compute stream, reductions after the schedule), except its TP-partitioned messages.
    if (par.pipeline_engine == PipelineEngine::deepspeed && par.pp > 1 && par.tp > 1 && !par.sequence_parallel &&
        (par.pipe_partitioned || par.grad_partitioned))
      throw std::invalid_argument("torch backend: parallel.pipeline_engine deepspeed with tp > 1 partitions pipeline "
                                  "messages over the TP group (parallel.pipe_partitioned / grad_partitioned, DeepSpeed's "
                                  "default), which is not implemented (the pipeline sends whole activations); set "
                                  "parallel.pipe_partitioned: false and parallel.grad_partitioned: false, or "
                                  "parallel.pipeline_engine: megatron");
    // DeepSpeed's BF16_Optimizer (core/pipeline_engine.hpp) shards the fp32 master over DP at ZeRO-0
    // and all-gathers the bf16 parameters after the step; this engine's optimizer does neither.
    if (uses_bf16_optimizer(sc))
      throw std::invalid_argument("torch backend: parallel.pipeline_engine deepspeed with precision bf16 at zero.stage 0 "
                                  "is DeepSpeed's BF16_Optimizer (fp32 master partitioned over DP, bf16 parameters "
                                  "all-gathered after the step), which is not implemented; set zero.stage: 1, "
                                  "precision fp16 / fp32, or parallel.pipeline_engine: megatron");
    if (program.ranks.size() <= size_t(rank_) || program.ranks[rank_].rank != rank_)
      throw std::invalid_argument("torch backend: the Program has no instructions for rank " +
                                  std::to_string(rank_) + " (built representative-only?)");
    layout_ = stage_layout(cfg_, program.ranks[rank_], par.pp);
    // Communicators of this rank's groups, created in the same order (TP, DP, embedding) on every
    // rank: each group's members meet in its creation.
    if (par.tp > 1) tp_comm_ = world.subgroup(grid_.group_of(GroupKind::TP, rank_), true);
    dp_comm_ = world.subgroup(grid_.group_of(GroupKind::DP, rank_));  // one rank: the identity
    const auto emb = grid_.group_of(GroupKind::Embedding, rank_);
    if (par.pp > 1 && emb.size() > 1) emb_comm_ = world.subgroup(emb);
    tp_.comm = tp_comm_.get();
    tp_.size = par.tp;
    tp_.rank = coord_.tp;
    tp_.sequence_parallel = cfg_.sequence_parallel;
    tp_.wire_dtype = dtype_;
    tp_.sync = [this] { timing_sync(); };
    micro_batch_ = sc.training.micro_batch;
    grad_accum_ = sc.training.grad_accum;
    // full: every block is recomputed from its input in backward. selective: only the attention
    // core; SDPA's flash / memory-efficient kernels (libtorch >= 2.0) already keep no attention
    // matrix and recompute it in their backward, so there selective adds nothing.
    if (sc.recompute == Recompute::selective_op)
      throw std::invalid_argument("torch backend: activation_checkpointing.mode = selective_op (torchtitan's op-level "
                                  "checkpointing) is not implemented by dssim's engine; set it to none, selective or full");
    checkpoint_activations_ = sc.recompute == Recompute::full;
    recompute_attention_ = sc.recompute == Recompute::selective && !flash_attention_available();
    offload_ = sc.zero.offload_optimizer;
    offload_param_ = sc.zero.offload_param && stage_ == 3;
    overlap_ = sc.zero.overlap_comm;
    if (sc.precision.communication_dtype && *sc.precision.communication_dtype != sc.precision.dtype) throw std::runtime_error("torch backend: communication_data_type (precision.communication_dtype " + std::string(to_string(*sc.precision.communication_dtype)) + ") differs from the compute dtype " + to_string(sc.precision.dtype) + ": the engine reduces gradients in the compute dtype; remove the key or set it to the compute dtype");
    state_device_ = offload_ ? torch::Device(torch::kCPU) : dev_;
    // optimizer.fused_step false: the step before issue 15 (an fp32 accumulator at every stage, the
    // step pass by pass through libtorch's ops), the baseline of the measurements before it.
    if (!sc.optimizer.fused_step) step_path_ = StepPath::Ops;
    // Stages 0/1 reduce each bucket once per step, after its last backward: the reduced 16-bit
    // bucket is the step's gradient as it stands, so the step reads it in place and no fp32
    // accumulator exists (core/memory.hpp steps_gradient_buckets_in_place says when, and the
    // memory model prices it).
    grads_in_place_ = steps_gradient_buckets_in_place(sc) && step_path_ == StepPath::Fused;
    part_ = make_zero_partition(partition_spec(cfg_, sc.zero, dp_, layout_.units));
    allocate();
    plan_gradient_norm();
    if (sc.optimizer.kind == OptimizerKind::onebit_adam) setup_onebit();
    if (sc.model.is_moe()) setup_moe();
  }

  EngineResult run();

 private:
  // ---- memory -------------------------------------------------------------------------------
  // Stages 0-2: where unit u's trainable tensors start in the flat partition, and how many
  // elements they are (all of the unit's without fine-tuning; frozen tensors live in frozen16_).
  int64_t unit_offset(int u) const {
    return first_tensor_[u] < int(part_.offsets.size()) ? part_.offsets[first_tensor_[u]] : part_.numel;
  }
  int64_t train_numel(int u) const { return unit_train_numel_[u]; }

  void allocate() {
    at::NoGradGuard ng;
    auto dev16 = at::TensorOptions().dtype(dtype_).device(dev_);
    auto st32 = at::TensorOptions().dtype(at::kFloat).device(state_device_);
    // Offloaded states stay pageable: the copies go through small pinned staging buffers
    // (copy_gradients_to_host, host_step_and_publish), and the host allocator would round a
    // pinned 27 GB tensor of a 7B shard up to 32 GB.
    // The partition's tensors (stages 0-2: the trainable ones, stage 3: all) and, at stages 0-2,
    // the frozen ones' places in frozen16_.
    int t = 0;
    int64_t frozen_total = 0;
    first_tensor_.assign(cfg_.units(), -1);
    unit_train_numel_.assign(cfg_.units(), 0);
    unit_train_count_.assign(cfg_.units(), 0);
    frozen_offset_.assign(cfg_.units(), {});
    for (int u : layout_.units) {
      first_tensor_[u] = t;
      const auto ps = unit_params(cfg_, u);
      frozen_offset_[u].assign(ps.size(), -1);
      for (int i = 0; i < int(ps.size()); ++i) {
        const bool tr = param_trainable(cfg_, u, i);
        if (stage_ == 3 || tr) {
          tensor_leaf_.push_back({u, i});
          part_trainable_.push_back(tr);
          ++t;
          if (tr) unit_train_numel_[u] += ps[i].numel();
          unit_train_count_[u] += 1;
        } else {
          frozen_offset_[u][i] = frozen_total;
          frozen_total += ps[i].numel();
        }
      }
    }
    p16_.resize(cfg_.units());
    if (stage_ <= 2) {
      flat16_ = at::zeros({part_.padded_numel}, dev16);
      frozen16_ = at::zeros({frozen_total}, dev16);
      const int64_t n = stage_ == 0 ? part_.padded_numel : part_.shard_numel;
      if (stage_ <= 1) {
        grad16_ = at::zeros({part_.padded_numel}, dev16);
      } else {
        // Stage 2 (DeepSpeed's averaged_gradients): only this rank's partition of the reduced
        // gradients, 16-bit, accumulated over the micro-batches and copied to fp32 at the step;
        // backward writes into per-bucket buffers (bucket_grad) that live until their reduction
        // is folded in. With the optimizer offloaded, the partition is the host's fp32 buffer.
        // One rank without per-bucket work to do (no offload copies, no sequence-parallel sums)
        // has no buckets: the partition is the whole buffer and backward accumulates into it.
        direct_partition_ = dp_ == 1 && !offload_ && !(sc_.parallel.tp > 1 && cfg_.sequence_parallel);
        grad_acc_ = offload_ ? at::zeros({n}, st32) : at::zeros({n}, dev16);
        bucket16_.assign(part_.grad_buckets.size(), at::Tensor());
      }
      master_ = at::zeros({n}, st32);
      auto full32 = at::zeros({part_.padded_numel}, dev16.dtype(at::kFloat));
      for (int u : layout_.units) {
        // The whole unit from the seed; its trainable tensors to the partition, frozen ones aside.
        auto u32 = at::zeros({unit_numel(cfg_, u)}, full32.options());
        init_unit(cfg_, u, u32, sc_.training.seed);
        const auto views = unit_views(cfg_, u, u32);
        int ti = first_tensor_[u];
        for (size_t i = 0; i < views.size(); ++i) {
          const int64_t n = views[i].numel();
          if (frozen_offset_[u][i] >= 0) frozen16_.narrow(0, frozen_offset_[u][i], n).copy_(views[i].reshape({-1}));
          else full32.narrow(0, part_.offsets[ti++], n).copy_(views[i].reshape({-1}));
        }
      }
      flat16_.copy_(full32);
      if (stage_ == 0) master_.copy_(full32);
      else master_.copy_(full32.narrow(0, part_.shard(dpr_).begin, part_.shard_numel));
      for (int u : layout_.units) {
        const at::Tensor g = stage_ <= 1        ? grad16_
                             : direct_partition_ ? grad_acc_
                                                 : at::Tensor();  // bound to its bucket by prepare_grad
        p16_[u] = partition_leaves(u, g);
      }
      grad_dirty_.assign(part_.grad_buckets.size(), false);
      held_for_step_.assign(part_.grad_buckets.size(), false);
    } else {
      int64_t shard_total = 0, train_total = 0;
      for (const auto& g : part_.stage3_groups) {
        group_shard_offset_.push_back(shard_total);
        group_train_offset_.push_back(train_total);
        shard_total += g.shard_numel;
        train_total += g.trainable_shard_numel;
      }
      master_ = at::zeros({train_total}, st32);  // the optimizer steps the trainable tensors' shards
      shard16_ = at::zeros({shard_total}, dev16);
      const int G = int(part_.stage3_groups.size());
      group_units_.assign(G, {});
      unit_group_offset_.assign(cfg_.units(), 0);
      for (int u : layout_.units) {
        const int g = layer_of_unit(cfg_, u);
        auto& us = group_units_.at(g);
        unit_group_offset_[u] = 0;
        for (int v : us) unit_group_offset_[u] += unit_numel(cfg_, v);
        us.push_back(u);
      }
      full16_.resize(G);
      gradg_.resize(G);
      // One rank: a layer's partition is the whole layer (per-tensor ceil(n / 1) = n, no padding),
      // so the gathered parameters are the shard itself rather than a second copy of it.
      aliased_ = dp_ == 1 && !offload_param_;
      for (int g = 0; g < G; ++g) {
        auto full32 = at::zeros({part_.stage3_groups[g].numel}, dev16.dtype(at::kFloat));
        for (int u : group_units_[g])
          init_unit(cfg_, u, full32.narrow(0, unit_group_offset_[u], unit_numel(cfg_, u)), sc_.training.seed);
        master_.narrow(0, group_train_offset_[g], part_.stage3_groups[g].trainable_shard_numel)
            .copy_(full_to_shard(g, full32, dpr_, true));
        shard16_.narrow(0, group_shard_offset_[g], part_.stage3_groups[g].shard_numel)
            .copy_(full_to_shard(g, full32, dpr_));
        if (aliased_) {
          if (part_.stage3_groups[g].shard_numel != part_.stage3_groups[g].numel)
            throw std::logic_error("ZeRO-3 on one rank: a layer's partition is not the whole layer");
          full16_[g] = shard16_.narrow(0, group_shard_offset_[g], part_.stage3_groups[g].numel);
        } else {
          full16_[g] = full32.to(dtype_).clone();
        }
        for (int u : group_units_[g])
          p16_[u] = leaves(full16_[g].narrow(0, unit_group_offset_[u], unit_numel(cfg_, u)), at::Tensor(), u);
      }
      gathered_.assign(G, true);
      grad_dirty_.assign(G, false);
      // Until the Program gathers them, stage-3 parameters are not resident.
      if (!aliased_)
        for (int g = 0; g < G; ++g) release_group(g);
    }
    exp_avg_ = at::zeros_like(master_);
    exp_avg_sq_ = at::zeros_like(master_);
    if (!grad_acc_.defined() && !grads_in_place_) grad_acc_ = at::zeros(master_.sizes(), st32);
    if (offload_param_) shard16_ = shard16_.to(at::kCPU);
  }

  // Stage 3: a group's full flat tensor -> rank r's partition (per tensor ceil(n / dp), zero
  // padded); trainable_only: of its trainable tensors (what is reduce-scattered and stepped).
  at::Tensor full_to_shard(int gi, const at::Tensor& full, int r, bool trainable_only = false) const {
    const auto& g = part_.stage3_groups[gi];
    auto out = at::zeros({trainable_only ? g.trainable_shard_numel : g.shard_numel}, full.options());
    int64_t in_off = 0, out_off = 0;
    for (int ti : g.tensors) {
      const int64_t n = part_.offsets.size() > 0 ? tensor_numel(ti) : 0;
      const int64_t c = (n + dp_ - 1) / dp_;
      if (trainable_only && !part_trainable_[ti]) {
        in_off += n;
        continue;
      }
      const int64_t b = std::min<int64_t>(n, int64_t(r) * c), e = std::min<int64_t>(n, int64_t(r + 1) * c);
      if (e > b) out.narrow(0, out_off, e - b).copy_(full.narrow(0, in_off + b, e - b));
      in_off += n;
      out_off += c;
    }
    return out;
  }
  // Stage 3 with frozen tensors: the trainable pieces of this rank's shards (laid out as master_)
  // into `shard` (laid out as shard16_), or back (to_shard false).
  void trainable_pieces(const at::Tensor& train, const at::Tensor& shard, bool to_shard) const {
    at::NoGradGuard ng;
    for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
      int64_t s_off = group_shard_offset_[gi], t_off = group_train_offset_[gi];
      for (int ti : part_.stage3_groups[gi].tensors) {
        const int64_t c = (tensor_numel(ti) + dp_ - 1) / dp_;
        if (part_trainable_[ti]) {
          if (to_shard) shard.narrow(0, s_off, c).copy_(train.narrow(0, t_off, c));
          else train.narrow(0, t_off, c).copy_(shard.narrow(0, s_off, c));
          t_off += c;
        }
        s_off += c;
      }
    }
  }
  // Stage 3: all-gathered [dp * shard] -> the group's full flat tensor.
  void gathered_to_full(int gi, const at::Tensor& gathered, at::Tensor full) const {
    const auto& g = part_.stage3_groups[gi];
    auto rows = gathered.view({dp_, g.shard_numel});
    int64_t out_off = 0, in_off = 0;
    for (int ti : g.tensors) {
      const int64_t n = tensor_numel(ti), c = (n + dp_ - 1) / dp_;
      full.narrow(0, out_off, n).copy_(rows.narrow(1, in_off, c).reshape({-1}).narrow(0, 0, n));
      out_off += n;
      in_off += c;
    }
  }
  int64_t tensor_numel(int ti) const {
    return ti + 1 < int(part_.offsets.size()) ? part_.offsets[ti + 1] - part_.offsets[ti]
                                               : part_.numel - part_.offsets[ti];
  }
  void release_group(int g) {
    if (stage_ < 3 || aliased_ || !gathered_[g]) return;
    release_storage(full16_[g]);  // the units' leaves share this storage
    gathered_[g] = false;
  }
  int group_of(int u) const { return layer_of_unit(cfg_, u); }

  // ---- compute ------------------------------------------------------------------------------
  // One model chunk's forward of one micro-batch, kept for its backward: a segment per unit run.
  struct Segment {
    int unit;            // -1 the received activation, 0 embedding, 1..L block, L+1 head (loss)
    at::Tensor input;    // detached, requires grad (blocks, head)
    at::Tensor output;   // empty when recomputed in backward
    at::Tensor aux;      // MoE layer: moe_loss_coeff x l_aux (empty when recomputed in backward)
  };
  struct MicroBatchState {
    at::Tensor tokens;
    std::vector<Segment> segments;
  };
  static int64_t slot_key(int chunk, int mb) { return (int64_t(std::max(0, chunk)) << 32) | uint32_t(mb); }
  const StageLayout::Chunk& chunk_of(const Instruction& in) const {
    const int c = std::max(0, in.chunk);
    if (c >= int(layout_.chunks.size())) throw std::runtime_error("Program error: model chunk " + std::to_string(c));
    return layout_.chunks[c];
  }
  // The instruction's layers [lb, le) (the whole chunk when the Program gives none).
  std::pair<int, int> layers_of(const Instruction& in) const {
    const auto& ch = chunk_of(in);
    const int lb = in.layer_begin >= 0 ? in.layer_begin : ch.layer_begin;
    const int le = in.layer_count > 0 ? lb + in.layer_count : ch.layer_end();
    return {lb, le};
  }
  at::Tensor batch(int mb) {
    return data_.batch(step_, mb, dpr_, micro_batch_, int64_t(micro_batch_) * grad_accum_).to(dev_);
  }
  // The tied word embedding the LM head uses: the embedding's own on one stage, the last stage's
  // copy in a pipeline.
  const at::Tensor& head_weight(const char* why) {
    return sc_.parallel.pp > 1 ? param(cfg_.head_copy_unit(), why)[0] : param(0, why)[0];
  }
  int head_weight_unit() const { return sc_.parallel.pp > 1 ? cfg_.head_copy_unit() : 0; }
  // Shape of an activation between stages: [b, s, h] ([b, s/t, h] with sequence parallelism).
  at::Tensor activation_buffer() const {
    return at::empty({micro_batch_, cfg_.seq_local(), cfg_.hidden}, at::TensorOptions().dtype(dtype_).device(dev_));
  }

  // One autograd leaf per parameter tensor, a view into the flat buffer, with its .grad a view
  // into the flat gradient buffer: backward accumulates straight into the buckets (no slice
  // backward through a flat leaf), as DeepSpeed's params point into its flat groups.
  std::vector<at::Tensor> leaves(const at::Tensor& flat, const at::Tensor& grad_flat, int u) {
    std::vector<at::Tensor> out;
    auto views = unit_views(cfg_, u, flat);
    std::vector<at::Tensor> gviews;
    if (grad_flat.defined()) gviews = unit_views(cfg_, u, grad_flat);
    for (size_t i = 0; i < views.size(); ++i) {
      out.push_back(views[i].detach().requires_grad_(param_trainable(cfg_, u, int(i))));  // frozen: no gradient
      if (grad_flat.defined()) out.back().mutable_grad() = gviews[i];
    }
    return out;
  }
  // Stages 0-2: unit u's leaves, the trainable ones views of flat16_ (their .grad views of
  // `grad_flat` at the same partition offsets, when given), the frozen ones of frozen16_.
  std::vector<at::Tensor> partition_leaves(int u, const at::Tensor& grad_flat) {
    std::vector<at::Tensor> out;
    const auto ps = unit_params(cfg_, u);
    int ti = first_tensor_[u];
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t n = ps[i].numel();
      if (frozen_offset_[u][i] >= 0) {
        out.push_back(frozen16_.narrow(0, frozen_offset_[u][i], n).view(ps[i].shape).detach());
        continue;
      }
      const int64_t off = part_.offsets[ti++];
      out.push_back(flat16_.narrow(0, off, n).view(ps[i].shape).detach().requires_grad_(true));
      if (grad_flat.defined()) out.back().mutable_grad() = grad_flat.narrow(0, off, n).view(ps[i].shape);
    }
    return out;
  }

  const std::vector<at::Tensor>& param(int u, const char* why) {
    if (stage_ == 3 && !deferred_.empty()) {
      const int g = group_of(u);
      flush([g](const Deferred& d) { return d.kind == Deferred::Gather3 && d.key == g; });
    }
    if (stage_ == 3 && !gathered_[group_of(u)])
      throw std::runtime_error(std::string("Program error: ") + why + " of layer " + std::to_string(group_of(u)) +
                               " before its ZeRO-3 parameters were gathered");
    return p16_[u];
  }

  void forward(const Instruction& in) {
    flush([](const Deferred& d) { return d.kind != Deferred::Gather3; });
    check_tp_ledger();
    const int mb = in.micro_batch;
    const auto& ch = chunk_of(in);
    const auto [lb, le] = layers_of(in);
    auto& st = mbs_[slot_key(in.chunk, mb)];
    if (lb == ch.layer_begin) {  // the chunk starts: from the tokens or the previous stage
      st = {};
      if (ch.first) {
        st.tokens = batch(mb);
        auto x = embed_forward(cfg_, tp_, param(0, "forward"), st.tokens.narrow(1, 0, cfg_.seq_len));
        st.segments.push_back({0, {}, x, {}});
      } else {
        auto x = pipe_.take(Purpose::PipelineActivation, std::max(0, in.chunk), mb, &inner_seconds_["recv"]);
        st.segments.push_back({-1, {}, x, {}});
      }
    }
    for (int l = lb; l < le; ++l) {
      const int u = cfg_.block_unit(l);
      auto x = st.segments.back().output.detach().requires_grad_(true);
      MoeLayer moe;
      MoeLayer* moe_ptr = moe_layer(l, mb, moe);
      at::Tensor y;
      if (checkpoint_activations_) {
        at::NoGradGuard ng;
        y = block_forward(cfg_, tp_, param(u, "forward"), x, recompute_attention_, moe_ptr);
        st.segments.push_back({u, x, {}, {}});
        st.segments.back().output = y;  // kept only as the next input; dropped in backward
      } else {
        y = block_forward(cfg_, tp_, param(u, "forward"), x, recompute_attention_, moe_ptr);
        st.segments.push_back({u, x, y, moe_ptr ? moe.l_aux * sc_.model.moe_loss_coeff : at::Tensor()});
      }
      if (moe_ptr && measuring_) moe_stats_.add(moe);
    }
    if (ch.last && le == ch.layer_end()) {
      auto x = st.segments.back().output.detach().requires_grad_(true);
      if (!st.tokens.defined()) st.tokens = batch(mb);  // the last stage reads the targets
      auto loss = head_loss(cfg_, tp_, param(cfg_.final_unit(), "forward"), head_weight("forward"), x,
                            st.tokens.narrow(1, 1, cfg_.seq_len));
      st.segments.push_back({cfg_.final_unit(), x, loss, {}});
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + loss.detach() : loss.detach().clone();
    }
  }

  void prepare_grad(int u) {
    if (stage_ == 2 && !direct_partition_) {
      const int64_t b = unit_offset(u), e = b + train_numel(u);
      for (size_t k = 0; k < part_.grad_buckets.size(); ++k) {
        const Range& r = part_.grad_buckets[k].range;
        if (r.begin < e && b < r.end()) bucket_grad(int(k));
      }
      return;
    }
    if (stage_ < 3) return;
    const int g = group_of(u);
    if (part_.stage3_groups[g].trainable_numel == 0) return;  // every tensor frozen: no gradient
    if (!gradg_[g].defined()) {
      gradg_[g] = at::zeros({part_.stage3_groups[g].numel}, full16_[g].options());
      for (int v : group_units_[g]) {
        auto views = unit_views(cfg_, v, gradg_[g].narrow(0, unit_group_offset_[v], unit_numel(cfg_, v)));
        for (size_t i = 0; i < views.size(); ++i)
          if (p16_[v][i].requires_grad()) p16_[v][i].mutable_grad() = views[i];
      }
    }
  }

  void backward(const Instruction& in) {
    const int mb = in.micro_batch;
    flush([mb](const Deferred& d) {
      return d.kind == Deferred::Gather12 || (d.kind == Deferred::Reduce && d.micro_batch != mb);
    });
    if (!after_recompute_) check_tp_ledger();
    after_recompute_ = false;
    const auto& ch = chunk_of(in);
    const auto [lb, le] = layers_of(in);
    const int64_t key = slot_key(in.chunk, mb);
    auto& st = mbs_[key];
    at::Tensor grad;
    if (ch.last && le == ch.layer_end()) {
      auto& seg = st.segments.back();
      param(cfg_.final_unit(), "backward");
      head_weight("backward");
      prepare_grad(cfg_.final_unit());
      prepare_grad(head_weight_unit());
      const double scale = scaler_.scale() / double(grad_accum_);
      torch::autograd::backward({seg.output * scale});
      grad = seg.input.grad();
      mark_dirty(cfg_.final_unit());
      mark_dirty(head_weight_unit());
      complete_buckets(cfg_.final_unit());
      st.segments.pop_back();
    } else if (le == ch.layer_end()) {  // the chunk's output gradient comes from the next stage
      grad = pipe_.take(Purpose::PipelineGradient, std::max(0, in.chunk), mb, &inner_seconds_["recv"]);
    } else {
      grad = pending_grad_[key];
    }
    for (int l = le - 1; l >= lb; --l) {
      if (st.segments.size() < 2)
        throw std::runtime_error("Program error: backward of layer " + std::to_string(l) + ", micro-batch " +
                                 std::to_string(mb) + " (chunk " + std::to_string(in.chunk) + ") before its forward");
      auto& seg = st.segments.back();
      const int u = seg.unit;
      const auto& p = param(u, "backward");
      prepare_grad(u);
      at::Tensor out = seg.output, aux = seg.aux;
      if (checkpoint_activations_) {
        // Timed on its own (the device is synchronised around it when measuring): the Program's
        // Recompute instruction, run here, just before the layer's backward (a MoE layer draws
        // the same noise and token selection again: the same routing).
        if (measuring_) timing_sync();
        auto t0 = Clock::now();
        MoeLayer moe;
        MoeLayer* moe_ptr = moe_layer(l, mb, moe);
        out = block_forward(cfg_, tp_, p, seg.input, recompute_attention_, moe_ptr);
        if (moe_ptr) aux = moe.l_aux * sc_.model.moe_loss_coeff;
        if (measuring_) timing_sync();
        inner_seconds_["recompute"] += seconds_since(t0);
      }
      if (aux.defined() && aux.requires_grad()) {
        // The load-balancing loss joins the training loss, scaled as the LM loss is.
        const double scale = scaler_.scale() / double(grad_accum_);
        torch::autograd::backward({out, aux}, {grad.to(out.scalar_type()), at::full({}, scale, aux.options())});
      } else {
        torch::autograd::backward({out}, {grad.to(out.scalar_type())});
      }
      grad = seg.input.grad();
      mark_dirty(u);
      complete_buckets(u);
      st.segments.pop_back();
      if (l > 0) fold_group_now(group_of(u));
    }
    if (lb > ch.layer_begin) {
      pending_grad_[key] = grad;
      return;
    }
    pending_grad_.erase(key);
    auto& seg = st.segments.back();
    if (ch.first) {
      param(0, "backward");
      prepare_grad(0);
      if (seg.output.requires_grad())  // a frozen embedding has no backward
        torch::autograd::backward({seg.output}, {grad.to(seg.output.scalar_type())});
      mark_dirty(0);
      complete_buckets(0);
      fold_group_now(group_of(0));
    } else {
      send_grad_[key] = grad.to(dtype_);  // the input's gradient, for the Program's SendGrad
    }
    mbs_.erase(key);
  }

  // ZeRO-3 on one rank has no reduce-scatter in the Program: a layer group's gradients go to the
  // fp32 accumulator as soon as its backward is done (what the reduce-scatter would do), so at
  // most one group's 16-bit gradients are alive, as with dp > 1.
  // With the optimizer offloaded they go on to the host at once (DeepSpeed copies each reduced
  // partition out in the backward hooks), timed as the Program's CopyD2H.
  void fold_group_now(int g) {
    if (stage_ != 3 || dp_ != 1 || !grad_dirty_[g]) return;
    fold_local_bucket(g);
    if (!offload_) return;
    if (measuring_) timing_sync();
    auto t0 = Clock::now();
    copy_gradients_to_host(g);
    inner_seconds_["copy_d2h"] += seconds_since(t0);
  }

  void mark_dirty(int u) {
    if (stage_ == 3) {
      if (part_.stage3_groups[group_of(u)].trainable_numel > 0) grad_dirty_[group_of(u)] = true;
      return;
    }
    const int64_t b = unit_offset(u), e = b + train_numel(u);
    for (size_t k = 0; k < part_.grad_buckets.size(); ++k) {
      const Range& r = part_.grad_buckets[k].range;
      if (!(r.begin < e && b < r.end())) continue;
      if (held_for_step_[k])  // its reduced sum would be added to: the Program reduced it too early
        throw std::runtime_error("Program error: a backward writes into gradient bucket " + std::to_string(k) +
                                 " after its reduction in the same step");
      grad_dirty_[k] = true;
    }
  }

  // Stage 3 frees the units an instruction used unless the Program uses them again before
  // gathering them again.
  void after_use(const Instruction& in) {
    if (stage_ < 3) return;
    for (int g : groups_of(in))
      if (!keep_after_use_[pc_][g]) release_group(g);
  }
  std::vector<int> groups_of(const Instruction& in) const {
    std::vector<int> gs;
    for (int u : units_of(in)) {
      const int g = group_of(u);
      if (std::find(gs.begin(), gs.end(), g) == gs.end()) gs.push_back(g);
    }
    return gs;
  }
  std::vector<int> units_of(const Instruction& in) const {
    std::vector<int> us;
    const auto& ch = chunk_of(in);
    const auto [lb, le] = layers_of(in);
    const bool head = ch.last && le == ch.layer_end();
    if ((ch.first && lb == ch.layer_begin) || (head && head_weight_unit() == 0)) us.push_back(0);
    for (int l = lb; l < le; ++l) us.push_back(cfg_.block_unit(l));
    if (head) us.push_back(cfg_.final_unit());
    if (head && head_weight_unit() != 0) us.push_back(head_weight_unit());
    return us;
  }

  // ---- communication ------------------------------------------------------------------------
  // 1-bit Adam's compressed phase keeps each rank's own gradient (its momentum is averaged).
  double scale_for_average() const { return local_grads_ ? 1.0 : 1.0 / double(dp_); }

  bool expert_group(const Instruction& in) const {
    return in.group >= 0 && in.group < int(program_.groups.size()) && program_.groups[in.group].kind == GroupKind::ExpertDP;
  }

  void reduce_gradients(const Instruction& in) {
    if (expert_group(in)) {
      if (!experts_) throw std::runtime_error("Program error: an expert gradient reduction without MoE layers");
      experts_->reduce(in);
      return;
    }
    const int k = in.bucket;
    if (stage_ <= 2) {
      if (k < 0 || k >= int(part_.grad_buckets.size()))
        throw std::runtime_error("Program error: gradient bucket " + std::to_string(k) + " does not exist");
      const auto& b = part_.grad_buckets[k];
      check_bytes(in, double(b.range.count) * elt16());
      auto buf = stage_ == 2 ? take_bucket(k) : grad16_.narrow(0, b.range.begin, b.range.count);
      grad_dirty_[k] = false;
      if (in.op == Op::AllReduce || stage_ == 0) {
        auto work = dp_comm_->allreduce(buf, in.purpose);
        defer({Deferred::Reduce, k, in.micro_batch, work, [this, buf, k]() mutable {
                 if (grads_in_place_) return keep_for_step(k);
                 fold_full(part_.grad_buckets[k].range, buf, k);
                 recycle(buf);
               }});
      } else {
        // DeepSpeed reduces each rank's intersection with the bucket to its owner; the same data
        // moves as in a reduce-scatter of the bucket.
        auto work = reduce_to_owners(buf, in);
        defer({Deferred::Reduce, k, in.micro_batch, work, [this, buf, k]() mutable {
                 if (grads_in_place_) return keep_for_step(k);
                 const auto& b = part_.grad_buckets[k];
                 const Range mine = b.sub_shards[dpr_];
                 if (mine.count > 0) {
                   const Range shard = part_.shard(dpr_);
                   accumulate(k, mine.begin - shard.begin, buf.narrow(0, mine.begin - b.range.begin, mine.count));
                 }
                 recycle(buf);
               }});
      }
    } else {
      const int gi = k;
      if (gi < 0 || gi >= int(part_.stage3_groups.size()))
        throw std::runtime_error("Program error: ZeRO-3 group " + std::to_string(gi) + " does not exist");
      const auto& g = part_.stage3_groups[gi];
      // Only the trainable tensors' gradients (all of them without fine-tuning).
      check_bytes(in, double(g.trainable_padded_numel()) * elt16());
      if (!gradg_[gi].defined()) throw std::runtime_error("Program error: reducing gradients of layer " +
                                                          std::to_string(gi) + " before its backward");
      std::vector<at::Tensor> parts;
      for (int r = 0; r < dp_; ++r) parts.push_back(full_to_shard(gi, gradg_[gi], r, true));
      auto input = at::cat(parts);
      auto out = at::empty({g.trainable_shard_numel}, input.options());
      auto work = dp_comm_->reduce_scatter(out, input, in.purpose);
      drop_group_grad(gi);  // the input is a copy
      defer({Deferred::Reduce, gi, in.micro_batch, work, [this, gi, out, input]() {
               accumulate(gi, group_train_offset_[gi], out);
             }});
    }
  }

  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf, const Instruction& in) {
    // A bucket's owners hold uneven intersections of it (DeepSpeed's average_tensor).
    const auto& b = part_.grad_buckets[in.bucket];
    std::vector<std::pair<int64_t, int64_t>> owners;
    for (const Range& r : b.sub_shards) owners.push_back({r.begin - b.range.begin, r.count});
    return dp_comm_->reduce_to_owners(buf, owners, in.purpose);
  }

  // Reduced gradients (this rank's part) into the fp32 accumulator of the optimizer. With the
  // optimizer offloaded, they wait on the device for the Program's CopyD2H of their bucket.
  void accumulate(int bucket, int64_t acc_offset, const at::Tensor& reduced) {
    if (!offload_) {
      grad_acc_.narrow(0, acc_offset, reduced.numel()).add_(reduced, scale_for_average());
      return;
    }
    d2h_pending_[bucket].push_back({acc_offset, reduced.clone()});
  }
  void copy_gradients_to_host(int bucket) {
    auto it = d2h_pending_.find(bucket);
    if (it == d2h_pending_.end()) return;
    for (auto& [off, t] : it->second) {
      count_copy(Op::CopyD2H, Purpose::OffloadGradient, double(t.numel()) * elt16());
      at::Tensor acc = grad_acc_.narrow(0, off, t.numel());
      if (t.is_cpu()) {
        host_accumulate(acc, t, scale_for_average());
        continue;
      }
      // Into a pinned buffer of its own (the copy runs at the bus's pinned rate) on a side stream,
      // then added on the host by the worker once copied, leaving two cores to the thread that
      // drives the GPU: the copy and the sum overlap the backward, as DeepSpeed's do.
      at::Tensor host = at::empty({t.numel()}, t.options().device(at::kCPU).pinned_memory(true));
      auto copied = copy_to_host_async(host, t);
      const double scale = scale_for_average();
      const int threads = host_accumulate_threads();
      if (measuring_) host_acc_bytes_ += 10.0 * double(t.numel());  // read 2 + 4, write 4 (host_accumulate)
      host_acc_.submit([acc, host, scale, threads, copied, waited = &host_copy_wait_seconds_]() mutable {
        const auto t0 = Clock::now();
        copied();
        *waited += seconds_since(t0);  // only the worker writes it; read after drain()
        host_accumulate(acc, host, scale, threads);
      });
    }
    d2h_pending_.erase(it);
  }
  void count_copy(Op op, Purpose p, double bytes) {
    copy_bytes_[{op, p}] += bytes;
    copy_calls_[{op, p}] += 1;
  }

  // dp == 1 has no reduction instructions: local gradients are the reduced gradients.
  void fold_full(const Range& r, const at::Tensor& buf, int bucket) {
    if (stage_ == 0) {
      accumulate(bucket, r.begin, buf);
      return;
    }
    const Range shard = part_.shard(dpr_);
    const int64_t b = std::max(r.begin, shard.begin), e = std::min(r.end(), shard.end());
    if (e > b) accumulate(bucket, b - shard.begin, buf.narrow(0, b - r.begin, e - b));
  }
  void fold_local_bucket(int k) {
    if (!grad_dirty_[k]) return;
    if (dp_ > 1 && !local_grads_)
      throw std::runtime_error("Program error: gradients of bucket " + std::to_string(k) + " left unreduced");
    if (stage_ == 2) {
      if (!direct_partition_) {  // direct: backward accumulated into the partition itself
        auto buf = take_bucket(k);
        fold_full(part_.grad_buckets[k].range, buf, k);
        free_bucket(buf);
      }
    } else if (stage_ <= 1 && grads_in_place_) {
      keep_for_step(k);
    } else if (stage_ <= 1) {
      const auto& r = part_.grad_buckets[k].range;
      auto buf = grad16_.narrow(0, r.begin, r.count);
      fold_full(r, buf, k);
      buf.zero_();
    } else {
      accumulate(k, group_train_offset_[k],
                 dp_ == 1 && !cfg_.ft.active ? gradg_[k] : full_to_shard(k, gradg_[k], 0, true));
      drop_group_grad(k);
    }
    grad_dirty_[k] = false;
  }

  // Stages 0/1 without an fp32 accumulator: bucket k, reduced (or, with dp = 1, complete), stays
  // in grad16_ for the step, which reads this rank's shard of it and zeroes it; the rest of the
  // bucket (other ranks' parts at stage 1) is zeroed now for the next step's backward.
  void keep_for_step(int k) {
    const Range& r = part_.grad_buckets[k].range;
    if (stage_ == 1) {
      const Range shard = part_.shard(dpr_);
      const int64_t b = std::max(r.begin, shard.begin), e = std::min(r.end(), shard.end());
      if (e <= b) {
        grad16_.narrow(0, r.begin, r.count).zero_();
      } else {
        if (b > r.begin) grad16_.narrow(0, r.begin, b - r.begin).zero_();
        if (e < r.end()) grad16_.narrow(0, e, r.end() - e).zero_();
      }
    }
    held_for_step_[k] = true;
    grad_dirty_[k] = false;
  }

  void drop_group_grad(int g) {
    for (int v : group_units_[g])
      for (auto& leaf : p16_[v]) leaf.mutable_grad() = at::Tensor();
    gradg_[g] = at::Tensor();
    grad_dirty_[g] = false;
  }

  // ---- stage 2: per-bucket gradient buffers (DeepSpeed's ipg buckets) ----------------------------
  // Bucket k's 16-bit gradients: allocated (zeroed) when backward first writes into the bucket,
  // the leaves of its tensors pointing into it.
  at::Tensor& bucket_grad(int k) {
    at::Tensor& buf = bucket16_.at(k);
    if (buf.defined()) return buf;
    make_room_for_bucket();
    const GradBucket& gb = part_.grad_buckets[k];
    buf = at::zeros({gb.range.count}, flat16_.options());
    for (int t = gb.first_tensor; t <= gb.last_tensor; ++t) {
      at::Tensor& leaf = leaf_of_tensor(t);
      leaf.mutable_grad() = buf.narrow(0, part_.offsets[t] - gb.range.begin, leaf.numel()).view(leaf.sizes());
    }
    bucket_bytes_ += bytes(buf);
    bucket_peak_ = std::max(bucket_peak_, bucket_bytes_);
    return buf;
  }
  // The bucket handed to its reduction (or local fold): its leaves let go of it, so a later
  // backward writing into the bucket gets a new buffer.
  at::Tensor take_bucket(int k) {
    at::Tensor buf = bucket_grad(k);  // zeros if no backward wrote into it
    const GradBucket& gb = part_.grad_buckets[k];
    for (int t = gb.first_tensor; t <= gb.last_tensor; ++t) leaf_of_tensor(t).mutable_grad() = at::Tensor();
    bucket16_[k] = at::Tensor();
    return buf;
  }
  void free_bucket(at::Tensor& buf) {
    bucket_bytes_ -= bytes(buf);
    buf = at::Tensor();
  }
  // After its reduction is folded: stage 2 frees the bucket, stages 0/1 zero their slice of grad16_.
  void recycle(at::Tensor& buf) {
    if (stage_ == 2) free_bucket(buf);
    else buf.zero_();
  }
  at::Tensor& leaf_of_tensor(int t) { return p16_[tensor_leaf_[t].first][tensor_leaf_[t].second]; }
  // With overlap_comm DeepSpeed double-buffers the ipg bucket: a new bucket starts filling once
  // the reductions issued before the newest one have completed (at most one in flight).
  void make_room_for_bucket() {
    const Deferred* newest = nullptr;
    for (const auto& d : deferred_)
      if (d.kind == Deferred::Reduce) newest = &d;
    if (newest) flush([newest](const Deferred& d) { return d.kind == Deferred::Reduce && &d != newest; });
  }
  // Stage 2 on one rank (no reductions): a bucket is complete for the micro-batch once the unit of
  // its first tensor has run its backward, and is folded into the partition then, unless the
  // Program sums it over the TP group first (reduce_sequence_parallel_grads folds it after that).
  void complete_buckets(int u) {
    if (stage_ != 2 || direct_partition_ || dp_ != 1) return;
    const int t0 = first_tensor_[u], t1 = t0 + unit_train_count_[u];
    for (int k = 0; k < int(part_.grad_buckets.size()); ++k) {
      const int ft = part_.grad_buckets[k].first_tensor;
      if (ft >= t0 && ft < t1 && !has_sp_sum(k)) fold_local_bucket(k);
    }
  }
  bool has_sp_sum(int k) const {
    if (sc_.parallel.tp <= 1 || !cfg_.sequence_parallel) return false;
    const Range& r = part_.grad_buckets[k].range;
    for (const auto& [off, n] : replicated_ranges_)
      if (std::max(off, r.begin) < std::min(off + n, r.end())) return true;
    return false;
  }

  void fold_unreduced() {
    for (int k = 0; k < int(grad_dirty_.size()); ++k) fold_local_bucket(k);
    std::vector<int> left;
    for (auto& [k, v] : d2h_pending_) left.push_back(k);
    for (int k : left) copy_gradients_to_host(k);
  }

  void gather_params(const Instruction& in) {
    if (stage_ == 0) throw std::runtime_error("Program error: parameter all-gather under ZeRO-0");
    if (expert_group(in)) {
      if (!experts_) throw std::runtime_error("Program error: an expert all-gather without MoE layers");
      experts_->gather(in);
      return;
    }
    if (stage_ <= 2) {
      const int k = in.bucket;
      if (k < 0 || k >= int(part_.allgather_buckets.size()))
        throw std::runtime_error("Program error: all-gather bucket " + std::to_string(k) + " does not exist");
      const auto& b = part_.allgather_buckets[k];
      check_bytes(in, double(b.count_per_rank) * dp_ * elt16());
      auto mine = flat16_.narrow(0, part_.shard(dpr_).begin + b.shard_offset, b.count_per_rank).clone();
      auto out = at::empty({b.count_per_rank * dp_}, mine.options());
      auto work = dp_comm_->all_gather(out, mine, in.purpose);
      defer({Deferred::Gather12, k, -1, work, [this, out, mine, k]() {
               const auto& b = part_.allgather_buckets[k];
               auto rows = out.view({dp_, b.count_per_rank});
               at::NoGradGuard ng;
               for (int r = 0; r < dp_; ++r)
                 flat16_.narrow(0, part_.shard(r).begin + b.shard_offset, b.count_per_rank).copy_(rows[r]);
             }});
    } else {
      if (in.bucket < 0 || in.bucket >= int(part_.stage3_groups.size()))
        throw std::runtime_error("Program error: ZeRO-3 all-gather of group " + std::to_string(in.bucket));
      gather_group(in.bucket, &in);
    }
  }

  void gather_group(int gi, const Instruction* in) {
    const auto& g = part_.stage3_groups[gi];
    if (in) check_bytes(*in, double(g.padded_numel()) * elt16());
    at::Tensor mine = shard16_.narrow(0, group_shard_offset_[gi], g.shard_numel);
    if (offload_param_) {
      auto st = staged_.find(gi);
      if (st != staged_.end()) {
        mine = st->second;
        staged_.erase(st);
      } else {
        mine = mine.to(dev_);  // not fetched by the Program (dp = 1 or a persistent layer)
      }
    }
    auto out = at::empty({g.padded_numel()}, mine.options());
    auto refill = [this, gi, out, mine]() {
      at::NoGradGuard ng;
      const int64_t numel = part_.stage3_groups[gi].numel;
      reallocate_storage(full16_[gi], size_t(numel) * size_t(elt16()));
      // Write through an alias with its own version counter: the leaves (views of full16_) that
      // autograd saved in forward must not look modified when their layer is refilled for
      // backward (DeepSpeed writes param.data for the same reason).
      at::Tensor alias = at::empty({0}, full16_[gi].options());
      alias.set_(full16_[gi].storage(), 0, {numel}, {1});
      gathered_to_full(gi, out, alias);
      gathered_[gi] = true;
    };
    if (!in && dp_ == 1) {
      out.copy_(mine);
      refill();
      return;
    }
    auto work = dp_comm_->all_gather(out, mine, in ? in->purpose : Purpose::None);
    // A prefetched layer is refilled when it is first used.
    if (in) defer({Deferred::Gather3, gi, -1, work, refill});
    else {
      work->wait();
      refill();
    }
  }

  // ---- overlap ------------------------------------------------------------------------------
  // A collective's result is consumed later than it is issued, as on a comm stream: gradient
  // reductions complete when the next micro-batch (or the optimizer) needs the buckets, ZeRO-3
  // gathers when their layer is first used, so communication overlaps the compute in between
  // (gloo works on its own threads; nccl on its own stream). overlap_comm = false completes each
  // at once.
  struct Deferred {
    enum Kind { Reduce, Gather12, Gather3 } kind;
    int key;          // bucket or layer group
    int micro_batch;  // of a reduction
    std::shared_ptr<Work> work;
    std::function<void()> post;
  };
  void defer(Deferred d) {
    if (!overlap_) {
      finish(d);
      return;
    }
    deferred_.push_back(std::move(d));
  }
  void finish(Deferred& d) {
    auto t0 = Clock::now();
    d.work->wait();
    comm_wait_seconds_ += seconds_since(t0);
    d.post();
  }
  template <class Pred>
  void flush(Pred pred) {
    std::vector<Deferred> keep;
    std::vector<Deferred> todo;
    for (auto& d : deferred_) (pred(d) ? todo : keep).push_back(std::move(d));
    deferred_.swap(keep);
    for (auto& d : todo) finish(d);  // in issue order
  }
  void flush_all() { flush([](const Deferred&) { return true; }); }

  double elt16() const { return double(at::elementSize(dtype_)); }

  void check_bytes(const Instruction& in, double engine_bytes) {
    const double program_bytes = in.bytes * std::max(1, in.repeat);
    if (in.bytes > 0 && std::abs(program_bytes - engine_bytes) > 0.5)
      throw std::runtime_error("Program/engine mismatch: " + std::string(to_string(in.op)) + " bucket " +
                               std::to_string(in.bucket) + " is " + std::to_string(program_bytes) +
                               " bytes in the Program, " + std::to_string(engine_bytes) + " in the engine layout");
  }

  // ---- pipeline (backends/torch/pipeline.hpp) ------------------------------------------------
  void send(const Instruction& in) {
    const int64_t key = slot_key(in.chunk, in.micro_batch);
    if (in.purpose == Purpose::PipelineActivation) {
      auto it = mbs_.find(key);
      if (it == mbs_.end() || it->second.segments.empty())
        throw std::runtime_error("Program error: activation of micro-batch " + std::to_string(in.micro_batch) +
                                 " sent before its forward");
      pipe_.send(in, it->second.segments.back().output.detach().to(dtype_));
    } else if (in.purpose == Purpose::PipelineGradient) {
      auto it = send_grad_.find(key);
      if (it == send_grad_.end())
        throw std::runtime_error("Program error: gradient of micro-batch " + std::to_string(in.micro_batch) +
                                 " sent before its backward");
      pipe_.send(in, it->second);
      send_grad_.erase(it);
    } else {
      throw std::runtime_error(std::string("torch backend: Send of purpose ") + to_string(in.purpose));
    }
  }
  void recv(const Instruction& in) {
    if (in.purpose != Purpose::PipelineActivation && in.purpose != Purpose::PipelineGradient)
      throw std::runtime_error(std::string("torch backend: Recv of purpose ") + to_string(in.purpose));
    pipe_.post_recv(in, activation_buffer());
  }

  // The tied word embedding's gradient summed between the first and the last stage (DeepSpeed's
  // ReduceTiedGrads, Megatron's embedding group), before either side's data-parallel reduction.
  void sync_tied_embedding(const Instruction& in) {
    if (!emb_comm_) throw std::runtime_error("Program error: EmbeddingSync on a rank outside the embedding group");
    if (stage_ > 1) throw std::runtime_error("torch backend: EmbeddingSync needs ZeRO stage 0 or 1");
    const int u = layout_.owns(0) ? 0 : cfg_.head_copy_unit();
    at::Tensor g = grad16_.narrow(0, unit_offset(u), unit_params(cfg_, u)[0].numel());
    check_bytes(in, double(g.numel()) * elt16());
    for (size_t k = 0; k < part_.grad_buckets.size(); ++k) {
      const Range& r = part_.grad_buckets[k].range;
      if (r.begin < unit_offset(u) + g.numel() && unit_offset(u) < r.end() && !grad_dirty_[k])
        throw std::runtime_error("Program error: the tied embedding's gradient bucket " + std::to_string(k) +
                                 " was reduced before the EmbeddingSync");
    }
    emb_comm_->allreduce(g, in.purpose)->wait();
  }

  // ---- tensor parallelism (backends/torch/tensor_parallel.hpp) --------------------------------
  // The Program's TP collectives on the compute stream are issued inside the Forward / Backward
  // they follow; the engine checks that what was issued is what the Program lists.
  void check_tp_ledger() {
    tp_.check("before instruction " + std::to_string(pc_));
    ep_.check("before instruction " + std::to_string(pc_));
  }
  // Sequence parallelism: the replicated parameters' gradients (LayerNorms, row-parallel biases,
  // wpe) are partial sums over the sequence shards: summed over the TP group, bucket by bucket,
  // before the bucket's data-parallel reduction.
  void reduce_sequence_parallel_grads(const Instruction& in) {
    if (!tp_.active() || !cfg_.sequence_parallel)
      throw std::runtime_error("Program error: a tensor-parallel gradient all-reduce without sequence parallelism");
    if (stage_ > 2 || in.bucket < 0 || in.bucket >= int(part_.grad_buckets.size()))
      throw std::runtime_error("Program error: sequence-parallel gradient all-reduce of bucket " + std::to_string(in.bucket));
    const Range& r = part_.grad_buckets[in.bucket].range;
    std::vector<at::Tensor> views;
    for (const auto& [off, n] : replicated_ranges_) {
      const int64_t b = std::max(off, r.begin), e = std::min(off + n, r.end());
      if (e > b) views.push_back(stage_ == 2 ? bucket_grad(in.bucket).narrow(0, b - r.begin, e - b) : grad16_.narrow(0, b, e - b));
    }
    if (views.empty()) throw std::runtime_error("Program error: bucket " + std::to_string(in.bucket) + " holds no replicated parameters");
    at::Tensor flat = at::cat(views);
    check_bytes(in, double(flat.numel()) * elt16());
    tp_comm_->allreduce(flat, in.purpose)->wait();
    at::NoGradGuard ng;
    int64_t o = 0;
    for (auto& v : views) {
      v.copy_(flat.narrow(0, o, v.numel()));
      o += v.numel();
    }
    if (stage_ == 2 && dp_ == 1) fold_local_bucket(in.bucket);  // complete: no reduction follows
  }

  // Which gradients this rank counts in the global norm: a TP-replicated tensor on TP rank 0
  // only, the last stage's copy of the tied embedding never (the first stage counts it).
  void plan_gradient_norm() {
    if (cfg_.ft.active) return;  // tp = pp = 1 (checked): the whole accumulator counts
    for (int u : layout_.units) {
      int64_t off = unit_offset(u);
      const auto ps = unit_params(cfg_, u);
      for (size_t i = 0; i < ps.size(); ++i) {
        if (u != cfg_.head_copy_unit() && replicated_over_tp(cfg_, u, int(i))) replicated_ranges_.push_back({off, ps[i].numel()});
        off += ps[i].numel();
      }
    }
    if (sc_.parallel.tp == 1 && sc_.parallel.pp == 1) return;
    if (stage_ > 2) throw std::logic_error("gradient norm weights: ZeRO-3 with tp / pp > 1");
    // Excluded ranges of the flat layout, then the counted rest of this rank's accumulator.
    std::vector<std::pair<int64_t, int64_t>> excluded;
    if (coord_.tp != 0) excluded = replicated_ranges_;
    if (layout_.owns(cfg_.head_copy_unit()))
      excluded.push_back({unit_offset(cfg_.head_copy_unit()), unit_numel(cfg_, cfg_.head_copy_unit())});
    std::sort(excluded.begin(), excluded.end());
    const int64_t base = stage_ == 0 ? 0 : part_.shard(dpr_).begin;
    const int64_t end = base + (stage_ == 0 ? part_.padded_numel : part_.shard_numel);
    int64_t at = base;
    for (const auto& [off, n] : excluded) {
      const int64_t b = std::clamp(off, base, end), e = std::clamp(off + n, base, end);
      if (b > at) norm_ranges_.push_back({at - base, b - at});
      at = std::max(at, e);
    }
    if (end > at) norm_ranges_.push_back({at - base, end - at});
    norm_by_ranges_ = true;
  }

  // ---- mixture of experts (backends/torch/moe.hpp) -------------------------------------------
  // The expert-parallel group runs the all-to-alls, the expert-data-parallel group reduces the
  // experts' gradients; the experts' parameters and states are the ExpertStore's.
  void setup_moe() {
    const auto& par = sc_.parallel;
    const auto refuse = [](const std::string& what) {
      throw std::invalid_argument("torch backend: MoE with " + what + " is not implemented");
    };
    if (stage_ > 2) refuse("zero.stage 3 (the experts' ZeRO-3 partition); use zero.stage 0, 1 or 2");
    if (offload_) refuse("zero.offload_optimizer; set it to false");
    if (sc_.optimizer.kind == OptimizerKind::onebit_adam) refuse("1-bit Adam; use optimizer.type: adamw");
    const int64_t capacity = sc_.model.expert_capacity(int64_t(micro_batch_) * sc_.model.seq_len);
    if (par.tp > 1 && sc_.model.drop_tokens && capacity % par.tp != 0)
      throw std::invalid_argument("torch backend: MoE with parallel.tp = " + std::to_string(par.tp) + ": the expert capacity (" +
                                  std::to_string(capacity) + " slots) is not divisible by parallel.tp; each TP rank "
                                  "dispatches 1/tp of the slots (DeepSpeed's drop_tokens): change model.capacity_factor, "
                                  "model.min_capacity or training.micro_batch");
    if (par.ep > 1) ep_comm_ = world_.subgroup(grid_.group_of(GroupKind::EP, rank_));
    edp_comm_ = world_.subgroup(grid_.group_of(GroupKind::ExpertDP, rank_));  // one rank: the identity
    ep_.comm = ep_comm_.get();
    ep_.size = par.ep;
    ep_.rank = coord_.ep;
    ep_.wire_dtype = dtype_;
    ep_.check_bytes = sc_.model.drop_tokens;
    tp_.all_gather_bytes_dynamic = !sc_.model.drop_tokens;  // the gathers after the combine (moe.cpp)
    ep_.sync = [this] { timing_sync(); };
    std::vector<int> layers;  // this stage's MoE layers, in the Program's order
    for (int u : layout_.units)
      if (u >= 1 && u <= cfg_.layers && cfg_.moe_layer(u - 1)) layers.push_back(u - 1);
    ExpertStore::Options o;
    o.stage = stage_;
    o.dp = dp_;
    o.ep = par.ep;
    o.ep_rank = coord_.ep;
    o.edp_rank = coord_.edp;
    o.reduce_bucket_size = sc_.zero.reduce_bucket_size;
    o.allgather_bucket_size = sc_.zero.allgather_bucket_size;
    o.dtype = dtype_;
    o.device = dev_;
    o.seed = sc_.training.seed;
    experts_ = std::make_unique<ExpertStore>(sc_.model, layers, edp_comm_.get(), o);
  }
  // Layer l's MoE context for micro-batch mb (nullptr for a dense layer): its gate noise and token
  // selection are drawn from (seed, step, the micro-batch's place in the global batch, layer), so a
  // layout that splits the batch differently routes every token the same way.
  MoeLayer* moe_layer(int l, int mb, MoeLayer& out) {
    if (!experts_ || !cfg_.moe_layer(l)) return nullptr;
    out.model = &sc_.model;
    out.ep = &ep_;
    out.experts = experts_->leaves(l);
    const uint64_t global_mb = uint64_t(dpr_) * uint64_t(grad_accum_) + uint64_t(mb);
    out.seed = moe_layer_seed(sc_.training.seed, step_, global_mb, l);
    return &out;
  }
  // Rank 0 puts every MoE layer's experts together, layer by layer, expert by expert (the one-rank
  // layout): the members of each stage's first expert-parallel group (expert-data-parallel rank 0,
  // core/grid.hpp) send their own.
  at::Tensor assemble_experts() {
    constexpr int kTag = (1 << 30) + 1;
    const at::Tensor mine = experts_->full_master().to(at::kCPU);  // every rank: stages 1/2 all-gather
    if (rank_ != 0) {
      if (coord_.edp == 0) world_.send(mine, 0, kTag, Purpose::None)->wait();
      return {};
    }
    const int local = experts_->local_experts();
    const int64_t per = expert_numel(sc_.model);
    std::map<std::pair<int, int>, at::Tensor> pieces;  // (layer, global expert)
    for (int s = 0; s < sc_.parallel.pp; ++s)
      for (int j = 0; j < sc_.parallel.ep; ++j) {
        const int r = grid_.group_of(GroupKind::EP, grid_.rank_of(0, s, 0)).at(j);
        std::vector<int> layers;
        for (int u : stage_layout(cfg_, program_.ranks.at(r), sc_.parallel.pp).units)
          if (u >= 1 && u <= cfg_.layers && cfg_.moe_layer(u - 1)) layers.push_back(u - 1);
        at::Tensor flat = mine;
        if (r != 0) {
          flat = at::empty({int64_t(layers.size()) * local * per}, mine.options());
          world_.recv(flat, r, kTag, Purpose::None)->wait();
        }
        for (size_t li = 0; li < layers.size(); ++li)
          for (int e = 0; e < local; ++e)
            pieces[{layers[li], j * local + e}] = flat.narrow(0, (int64_t(li) * local + e) * per, per);
      }
    std::vector<at::Tensor> out;
    for (auto& [k, t] : pieces) out.push_back(t);
    return at::cat(out);
  }

  // ---- 1-bit Adam (backends/torch/onebit_adam.hpp) -------------------------------------------
  // The warm-up steps run the Program of a step before freeze_step (gradient all-reduce, AdamW),
  // the others the compressed one (no gradient reduction; the OneBit instructions, then the step).
  void setup_onebit() {
    const auto& par = sc_.parallel;
    if (stage_ != 0 || par.tp > 1 || par.pp > 1 || offload_ || fp16_)
      throw std::invalid_argument("torch backend: 1-bit Adam runs with zero.stage 0, tp = pp = 1, no offload and "
                                  "fp32 or bf16 (fp16's loss scaler with rank-local gradients is not implemented)");
    onebit_ = std::make_unique<OnebitAdam>(master_.numel(), dp_comm_.get(), sc_.optimizer.freeze_step, master_.options());
    Scenario warm = sc_, compressed = sc_;
    warm.optimizer.step = 0;
    compressed.optimizer.step = std::max(sc_.optimizer.step, sc_.optimizer.freeze_step);
    warm_program_ = build_program(warm);
    compressed_program_ = build_program(compressed);
  }
  const RankProgram& program_of_step() const {
    if (!onebit_) return program_.ranks[rank_];
    return (onebit_->compressing(step_) ? compressed_program_ : warm_program_).ranks.at(rank_);
  }
  void onebit_instruction(const Instruction& in) {
    if (!onebit_ || !local_grads_)
      throw std::runtime_error(std::string("Program error: ") + to_string(in.op) + "/" + to_string(in.purpose) +
                               " outside 1-bit Adam's compressed phase");
    if (in.purpose == Purpose::OneBitSigns) {  // the momentum from this rank's own gradient first
      at::Tensor g = step_gradient();
      if (!g.defined()) throw std::logic_error("1-bit Adam: skipped step");
      onebit_->update_momentum(exp_avg_, g, sc_.optimizer.beta1);
      g.zero_();
    }
    onebit_->run(in, exp_avg_);
  }

  // ---- optimizer ----------------------------------------------------------------------------
  void optimizer_step() {
    const auto& opt = sc_.optimizer;
    const AdamWHyper hyper{opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay};
    if (onebit_ && local_grads_) {  // variance frozen; the momentum was all-reduced compressed
      at::NoGradGuard ng;
      if (!onebit_->momentum_ready()) {
        if (dp_ > 1) throw std::runtime_error("Program error: 1-bit Adam's step before its compressed all-reduce");
        at::Tensor g = step_gradient();  // one rank: no communication (DeepSpeed: size > 1 only)
        onebit_->update_momentum(exp_avg_, g, opt.beta1);
        g.zero_();
      }
      step_scale_ = scaler_.scale();
      step_skipped_ = false;
      adam_step_ += 1;
      onebit_->step(master_, exp_avg_, exp_avg_sq_, adam_step_, hyper);
      publish_master();
      return;
    }
    if (offload_) {
      at::Tensor g = step_gradient();
      if (!g.defined()) return;  // skipped (fp16 overflow)
      adam_step_ += 1;
      host_step_and_publish(g, hyper);  // clears g in the AdamW pass itself
    } else {
      const StepGradient sg = step_gradient_parts();
      if (!sg.g.defined()) return;  // skipped (fp16 overflow)
      adam_step_ += 1;
      // One pass (fused_adamw_step): the gradient read where it is (the 16-bit buckets at stages
      // 0/1, the 16-bit partition at stage 2, the fp32 accumulator at stage 3), scaled, AdamW, the
      // 16-bit copy written and the gradient cleared for the next step.
      at::Tensor out = publish_target();
      fused_adamw_step(master_, sg.g, exp_avg_, exp_avg_sq_, adam_step_, hyper, sg.pre, sg.coef, out, true,
                       &adam_step_tensor_, step_path_);
      if (!out.defined()) publish_master();
      std::fill(held_for_step_.begin(), held_for_step_.end(), false);
    }
    if (experts_)
      experts_->step([&](at::Tensor& p, at::Tensor& eg, at::Tensor& m, at::Tensor& v) {
        adamw_step(p, eg, m, v, adam_step_, hyper, &expert_step_tensor_, nullptr, true);
      });
    if (fp16_) scaler_.update(false);
  }

  // The updated parameters' 16-bit home that the step writes directly: this rank's part of the
  // 16-bit buffer (stage 3: its shard); undefined where the trainable pieces are scattered (stage 3
  // with frozen tensors: publish_master copies them).
  at::Tensor publish_target() {
    if (stage_ == 0) return flat16_;
    if (stage_ <= 2) return flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel);
    if (cfg_.ft.active) return at::Tensor();
    return shard16_;
  }

  // The step's gradient as one fp32 tensor, scaled in place (offload, 1-bit Adam): undefined when
  // the step is skipped.
  at::Tensor step_gradient() {
    StepGradient sg = step_gradient_parts();
    if (!sg.g.defined()) return sg.g;
    at::Tensor g = sg.g;
    if (g.scalar_type() != at::kFloat) {
      g = sg.g.to(at::kFloat);
      sg.g.zero_();
    }
    if (sg.pre != 1.0) g.mul_(sg.pre);
    if (sg.coef != 1.0) g.mul_(sg.coef);
    return g;
  }

  // The step's gradient: reductions completed and folded, unscaled, clipped (the global norm
  // over this rank's accumulator; rank-local in 1-bit Adam's compressed phase, as DeepSpeed
  // clips before its optimizer). g undefined when the step is skipped (fp16 overflow); else the
  // gradient is g * pre * coef: pre the data-parallel average not yet applied (the 16-bit buckets
  // stepped in place), coef the loss scale's inverse and the clipping factor.
  struct StepGradient {
    at::Tensor g;
    double pre = 1, coef = 1;
  };
  StepGradient step_gradient_parts() {
    check_tp_ledger();
    flush_all();
    at::NoGradGuard ng;
    fold_unreduced();
    drain_host_accumulation();
    if (bucket_bytes_ != 0) throw std::logic_error("ZeRO-2: gradient bucket buffers left at the step");
    // Stage 2 keeps its partition in 16 bits (DeepSpeed's averaged_gradients), stages 0/1 their
    // reduced buckets (this rank's shard of grad16_, not yet averaged); stage 3 and offload an fp32
    // accumulator. The step reads each where it is.
    at::Tensor acc = grad_acc_;
    double pre = 1;
    if (grads_in_place_) {
      acc = stage_ == 0 ? grad16_ : grad16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel);
      pre = scale_for_average();
    }
    const bool inject = std::find(o_.overflow_steps.begin(), o_.overflow_steps.end(), int(step_ + 1)) !=
                        o_.overflow_steps.end();
    if (inject) acc.narrow(0, 0, 1).fill_(std::numeric_limits<float>::infinity());
    const at::Tensor expert_acc = experts_ ? experts_->step_gradient() : at::Tensor();
    const double inv_scale = 1.0 / scaler_.scale();
    const double unscale = inv_scale * pre;  // of acc's values
    const double clip = sc_.training.gradient_clipping;
    // Global squared norm of the (unscaled) gradient: whole on ZeRO-0, summed over shards else,
    // and over pipeline stages and TP slices, each parameter counted once (norm_ranges_).
    // Needed for clipping and fp16 overflow detection only (it costs a pass and a host sync).
    double norm2 = 0;
    if (clip > 0 || fp16_ || inject) {
      at::Tensor sumsq;
      if (!norm_by_ranges_) {
        sumsq = sum_of_squares(acc);
      } else {  // the counted ranges only, without a full-size temporary
        sumsq = at::zeros({}, acc.options().dtype(at::kFloat));
        for (const auto& [off, n] : norm_ranges_) sumsq.add_(sum_of_squares(acc.narrow(0, off, n)));
      }
      sumsq = sumsq.mul_(unscale * unscale).reshape({1});
      if (sc_.parallel.tp > 1 || sc_.parallel.pp > 1 || experts_) {
        if (stage_ == 0 && dpr_ != 0) sumsq.zero_();  // its data-parallel replica 0 counts the whole
        // The experts' gradients, each counted once (moe.cpp): they differ over the EP group.
        if (experts_) sumsq.add_(experts_->counted_sum_of_squares(expert_acc) * inv_scale * inv_scale);
        world_.allreduce(sumsq, Purpose::None)->wait();
      } else if (stage_ >= 1 && dp_ > 1) {
        dp_comm_->allreduce(sumsq, Purpose::None)->wait();
      }
      norm2 = sumsq.item<double>();
    }
    const bool overflow = !std::isfinite(norm2);
    step_scale_ = scaler_.scale();
    step_skipped_ = false;
    if (overflow && fp16_) {
      step_skipped_ = true;
      scaler_.update(true);  // throws at the minimum scale, with DeepSpeed's message
      acc.zero_();
      std::fill(held_for_step_.begin(), held_for_step_.end(), false);
      if (experts_) experts_->zero_gradient();
      return {};
    }
    if (overflow) throw std::runtime_error("non-finite gradient norm at step " + std::to_string(step_ + 1));
    double coef = inv_scale;
    if (clip > 0) {
      const double norm = std::sqrt(norm2);
      if (norm > clip) coef *= clip / (norm + 1e-6);
    }
    // With the optimizer offloaded, g, master and moments are host tensors: the step runs on the CPU.
    if (coef != 1.0 && experts_) expert_acc.mul_(coef);
    return {acc, pre, coef};
  }

  // The host's gradient sums must be complete before the step reads them; the wait is the part of
  // the offloaded gradients' handling that did not overlap the backward (timed as CopyD2H).
  void drain_host_accumulation() {
    if (!offload_) return;
    auto t0 = Clock::now();
    host_acc_.drain();
    inner_seconds_["copy_d2h"] += seconds_since(t0);
  }

  // Squared L2 norm: one reduction pass, no full-size temporary (the offloaded shard of a 7B
  // model is 27 GB); inf / nan gradients give a non-finite norm.
  // 16-bit gradients are squared and summed in fp32.
  static at::Tensor sum_of_squares(const at::Tensor& t) {
    if (t.scalar_type() == at::kFloat) return at::norm(t).square();
    return at::norm(t, 2, at::kFloat).square();
  }

  // ZeRO-Offload's step on the host, chunk by chunk, each chunk's updated parameters written in
  // the same pass into a pinned 16-bit buffer and copied to the device (DeepSpeed's CPUAdam
  // step-plus-copy): the Program's HostOptimizerStep and its CopyH2D, the copy timed as the latter.
  void host_step_and_publish(const at::Tensor& g, const AdamWHyper& hyper) {
    const bool pieces = stage_ == 3 && cfg_.ft.active;  // the trainable shards, then into shard16_
    at::Tensor dst = stage_ == 0 ? flat16_ : stage_ <= 2 ? flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel)
                                 : pieces ? at::empty({master_.numel()}, shard16_.options())
                                          : shard16_;
    inner_seconds_["copy_h2d"] += dssim::tb::host_step_and_publish(master_, g, exp_avg_, exp_avg_sq_, adam_step_, hyper,
                                                                   dst, staging16_);
    if (pieces) trainable_pieces(dst, shard16_, true);
    const int64_t n = master_.numel();
    count_copy(Op::CopyH2D, Purpose::OffloadParam, double(n) * elt16());  // the Program's CopyH2D
  }

  void copy_d2h(const Instruction& in) {
    flush([](const Deferred& d) { return d.kind == Deferred::Reduce; });
    if (!offload_ || in.purpose != Purpose::OffloadGradient)
      throw std::runtime_error("Program error: device-to-host copy without optimizer offload");
    if (in.bucket >= 0 && in.bucket < int(grad_dirty_.size())) fold_local_bucket(in.bucket);
    copy_gradients_to_host(in.bucket);
  }
  void copy_h2d(const Instruction& in) {
    if (in.purpose != Purpose::OffloadParam) throw std::runtime_error("Program error: unexpected host-to-device copy");
    if (in.layer_begin >= 0) {  // ZeRO-3 offload_param: fetch a layer's 16-bit shard
      if (!offload_param_) throw std::runtime_error("Program error: parameter fetch without offload_param");
      const int g = in.layer_begin;
      const auto& grp = part_.stage3_groups.at(g);
      check_bytes(in, double(grp.shard_numel) * elt16());
      staged_[g] = shard16_.narrow(0, group_shard_offset_[g], grp.shard_numel).to(dev_);
      count_copy(Op::CopyH2D, Purpose::OffloadParam, double(grp.shard_numel) * elt16());
      // A group no all-gather refills (one rank: no data-parallel group) stays resident: the
      // fetched shard, updated by the last step, refills it here (it was used stale before).
      if (std::find(persistent_.begin(), persistent_.end(), g) != persistent_.end()) gather_group(g, nullptr);
      return;
    }
    // The updated shard came back to the device inside the host step (host_step_and_publish).
  }

  // The updated master shard -> this rank's 16-bit copy (the Program's all-gathers send the rest).
  void publish_master() {
    at::NoGradGuard ng;
    if (stage_ == 0) flat16_.copy_(master_);
    else if (stage_ <= 2) flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel).copy_(master_);
    else if (cfg_.ft.active) trainable_pieces(master_, shard16_, true);
    else shard16_.copy_(master_);
  }

  // ---- checkpoints (backends/torch/checkpoint.hpp) --------------------------------------------
  CheckpointLayout checkpoint_layout() const {
    return {world_.size(), sc_.parallel.tp, sc_.parallel.pp, stage_, to_string(sc_.precision.dtype), part_.padded_numel};
  }

  void save_checkpoint() {
    at::NoGradGuard ng;
    const fs::path root(o_.checkpoint_dir);
    write_rank_checkpoint(root / checkpoint_step_dir(step_), rank_,
                          {step_, adam_step_, scaler_.state(), master_, exp_avg_, exp_avg_sq_, checkpoint_extra()});
    world_.barrier();  // every shard is in place before the manifest names the step
    if (rank_ == 0) write_checkpoint_manifest(root, step_, checkpoint_layout());
    world_.barrier();
  }

  // 1-bit Adam's error buffers (this rank's; DeepSpeed resets them on load, dssim keeps them so
  // that a resumed run continues bit for bit).
  std::vector<at::Tensor> checkpoint_extra() {
    std::vector<at::Tensor> extra;
    if (onebit_) extra = {onebit_->worker_error(), onebit_->server_error()};
    if (experts_)  // the expert partition's fp32 parameters and moments
      for (const auto& t : experts_->state()) extra.push_back(t);
    return extra;
  }

  void load_checkpoint() {
    at::NoGradGuard ng;
    int64_t step = 0;
    const fs::path dir = read_checkpoint_manifest(fs::path(o_.checkpoint_dir), checkpoint_layout(), &step);
    RankCheckpoint c{0, 0, {}, master_, exp_avg_, exp_avg_sq_, checkpoint_extra()};
    read_rank_checkpoint(dir, rank_, step, c);
    adam_step_ = c.adam_step;
    scaler_.restore(c.scaler);
    step_ = step;
    publish_master();
    if (experts_) experts_->after_load();
    // Every rank's 16-bit copy is whole again (stages 1/2: all-gather the shards, uncounted).
    if (stage_ >= 1 && stage_ <= 2 && dp_ > 1) {
      auto mine = flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel).clone();
      dp_comm_->all_gather(flat16_, mine, Purpose::None)->wait();
    }
  }

  void dump_params() {
    if (cfg_.ft.active) return dump_finetuned_params();
    at::NoGradGuard ng;
    at::Tensor full;
    if (stage_ == 0) full = master_.to(at::kCPU);
    else if (stage_ <= 2) {
      auto mine = master_.to(dev_).contiguous();
      full = at::empty({part_.padded_numel}, mine.options());
      dp_comm_->all_gather(full, mine, Purpose::None)->wait();
      full = full.to(at::kCPU);
    } else {
      std::vector<at::Tensor> groups;
      for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
        const auto& g = part_.stage3_groups[gi];
        auto mine = master_.narrow(0, group_shard_offset_[gi], g.shard_numel).to(dev_).contiguous();
        auto out = at::empty({g.padded_numel()}, mine.options());
        dp_comm_->all_gather(out, mine, Purpose::None)->wait();
        auto f = at::empty({g.numel}, mine.options());
        gathered_to_full(gi, out, f);
        groups.push_back(f.to(at::kCPU));
      }
      full = at::cat(groups);
    }
    full = full.narrow(0, 0, part_.numel).contiguous();
    if (sc_.parallel.tp > 1 || sc_.parallel.pp > 1) full = assemble_whole_model(full);
    if (experts_) {
      const at::Tensor all_experts = assemble_experts();
      if (rank_ == 0) full = at::cat({full, all_experts});
    }
    if (rank_ != 0) return;
    std::ofstream out(o_.dump_params, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(full.data_ptr()), full.numel() * 4);
  }

  // Fine-tuning (tp = pp = 1): the whole base model in fp32, laid out as a run without fine-tuning
  // dumps it (unit order), then the adapters (unit order): the fp32 master of the trainable tensors,
  // the compute-dtype copy of the frozen ones.
  void dump_finetuned_params() {
    at::NoGradGuard ng;
    std::vector<std::vector<at::Tensor>> units(cfg_.units());  // per unit, its tensors in fp32 (CPU)
    if (stage_ <= 2) {
      at::Tensor train = master_.to(at::kCPU);
      if (stage_ >= 1) {
        auto mine = master_.to(dev_).contiguous();
        auto all = at::empty({part_.padded_numel}, mine.options());
        dp_comm_->all_gather(all, mine, Purpose::None)->wait();
        train = all.to(at::kCPU);
      }
      const at::Tensor frozen = frozen16_.to(at::kCPU).to(at::kFloat);
      for (int u : layout_.units) {
        const auto ps = unit_params(cfg_, u);
        int ti = first_tensor_[u];
        for (size_t i = 0; i < ps.size(); ++i) {
          const int64_t n = ps[i].numel();
          units[u].push_back(frozen_offset_[u][i] >= 0 ? frozen.narrow(0, frozen_offset_[u][i], n)
                                                       : train.narrow(0, part_.offsets[ti++], n));
        }
      }
    } else {
      // This rank's shards in fp32: the frozen tensors' from the compute-dtype shard, the
      // trainable ones' from the master; gathered per group.
      at::Tensor shard32 = shard16_.to(at::kFloat).to(dev_);
      trainable_pieces(master_.to(dev_), shard32, true);
      for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
        const auto& g = part_.stage3_groups[gi];
        auto mine = shard32.narrow(0, group_shard_offset_[gi], g.shard_numel).contiguous();
        auto out = at::empty({g.padded_numel()}, mine.options());
        dp_comm_->all_gather(out, mine, Purpose::None)->wait();
        auto f = at::empty({g.numel}, mine.options());
        gathered_to_full(gi, out, f);
        f = f.to(at::kCPU);
        for (int u : group_units_[gi])
          for (const auto& v : unit_views(cfg_, u, f.narrow(0, unit_group_offset_[u], unit_numel(cfg_, u))))
            units[u].push_back(v.reshape({-1}));
      }
    }
    if (rank_ != 0) return;
    std::vector<at::Tensor> out;
    for (int pass = 0; pass < 2; ++pass)  // base, then adapters
      for (int u : layout_.units) {
        const int nb = base_param_count(cfg_, u);
        for (int i = 0; i < int(units[u].size()); ++i)
          if ((i >= nb) == (pass == 1)) out.push_back(units[u][i].reshape({-1}));
      }
    const at::Tensor full = at::cat(out).contiguous();
    std::ofstream f(o_.dump_params, std::ios::binary | std::ios::trunc);
    f.write(static_cast<const char*>(full.data_ptr()), full.numel() * 4);
  }

  // Rank 0 puts the whole model together from the data-parallel rank 0 of every (stage, TP rank),
  // unsliced to the tp = 1 shapes, in the one-stage order (embedding, blocks, final norm): the
  // layout of a single-rank run's dump. Other ranks return an empty tensor.
  at::Tensor assemble_whole_model(const at::Tensor& mine) {
    constexpr int kTag = 1 << 30;
    if (coord_.dp == 0 && rank_ != 0) world_.send(mine, 0, kTag, Purpose::None)->wait();
    if (rank_ != 0) return {};
    std::map<std::pair<int, int>, std::vector<at::Tensor>> pieces;  // (unit, parameter) -> by TP rank
    for (int s = 0; s < sc_.parallel.pp; ++s)
      for (int t = 0; t < sc_.parallel.tp; ++t) {
        const int r = grid_.rank_of(0, s, t);
        const StageLayout lay = stage_layout(cfg_, program_.ranks.at(r), sc_.parallel.pp);
        int64_t n = 0;
        for (int u : lay.units) n += unit_numel(cfg_, u);
        at::Tensor flat = mine;
        if (r != 0) {
          flat = at::empty({n}, mine.options());
          world_.recv(flat, r, kTag, Purpose::None)->wait();
        }
        int64_t off = 0;
        for (int u : lay.units) {
          auto views = unit_views(cfg_, u, flat.narrow(0, off, unit_numel(cfg_, u)));
          for (size_t i = 0; i < views.size(); ++i) {
            auto& v = pieces[{u, int(i)}];
            v.resize(sc_.parallel.tp);
            v[t] = views[i];
          }
          off += unit_numel(cfg_, u);
        }
      }
    std::vector<at::Tensor> out;
    for (int u = 0; u <= cfg_.final_unit(); ++u)
      for (int i = 0; i < int(unit_params(cfg_, u).size()); ++i)
        out.push_back(tp_unslice(cfg_, u, i, pieces.at({u, i})).reshape({-1}));
    return at::cat(out);
  }

  // Every rank's bytes per (op, purpose) over the measured steps are its Program's (the report
  // shows rank 0's): a difference on any rank is an error, so a run that passes moved exactly what
  // the Program says. Control traffic (purpose none) is not the Program's.
  void verify_bytes() const {
    std::map<std::string, double> got;
    for (const auto& [k, v] : world_.counters().bytes)
      if (k.second != Purpose::None) got[counter_key(k.first, k.second)] += v;
    for (const auto& [k, v] : copy_bytes_) got[counter_key(k.first, k.second)] += v;
    std::map<std::string, double> all = expected_;
    for (const auto& [k, v] : got) all.emplace(k, 0.0);
    for (const auto& [k, want] : all) {
      if (!ep_.check_bytes && (k == counter_key(Op::AllToAll, Purpose::MoEDispatch) ||
                               k == counter_key(Op::AllToAll, Purpose::MoECombine) ||
                               (tp_.all_gather_bytes_dynamic && k == counter_key(Op::AllGather, Purpose::TensorParallel))))
        continue;  // drop_tokens false: the capacity is the busiest expert's load at run time
      const auto it = got.find(k);
      const double have = it == got.end() ? 0.0 : it->second;
      if (std::abs(have - want) > 0.5)
        throw std::runtime_error("Program/engine mismatch on rank " + std::to_string(rank_) + ": " + k + " moved " +
                                 std::to_string(have) + " bytes over the measured steps, the Program says " +
                                 std::to_string(want));
    }
  }

  // ---- the step -----------------------------------------------------------------------------
  static double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  void sync() { device_synchronize(dev_); }
  // Timing inside a step waits for the compute stream only: a device-wide wait would also wait for
  // the side-stream gradient copies and serialise them with the compute they overlap otherwise
  // (0.43 s of the 7B offload run's 5.5 s iteration).
  void timing_sync() { stream_synchronize(dev_); }

  // Stage 3: for instruction i and unit u, whether u is used again (forward / backward) before the
  // Program gathers it again: then it stays resident.
  // Stage 3: for instruction i and group g, whether g is used again (forward / backward) before
  // the Program gathers it again: then it stays resident. Groups the Program never gathers (dp = 1
  // has no data-parallel group) are gathered once and kept.
  void plan_residency(const RankProgram& rp) {
    if (stage_ < 3) return;
    const int n = int(rp.instructions.size()), G = int(part_.stage3_groups.size());
    keep_after_use_.assign(n, std::vector<bool>(G, false));
    std::vector<int> next(G, 0);  // 0 none, 1 use, 2 gather
    auto visit = [&](int i, bool record) {
      const auto& in = rp.instructions[i];
      if (in.op == Op::Forward || in.op == Op::Backward) {
        const auto gs = groups_of(in);
        if (record) for (int g : gs) keep_after_use_[i][g] = next[g] == 1;
        for (int g : gs) next[g] = 1;
      } else if (in.op == Op::AllGather && in.purpose == Purpose::ParamGather && in.bucket >= 0 && in.bucket < G) {
        next[in.bucket] = 2;
      }
    };
    // The step repeats: after the last instruction comes the first event of the next step.
    for (int i = n - 1; i >= 0; --i) visit(i, false);
    for (int i = n - 1; i >= 0; --i) visit(i, true);
    for (int g = 0; g < G; ++g) {
      bool gathered_ever = false;
      for (const auto& in : rp.instructions)
        if (in.op == Op::AllGather && in.purpose == Purpose::ParamGather && in.bucket == g) gathered_ever = true;
      if (!gathered_ever) {
        persistent_.push_back(g);
        for (auto& row : keep_after_use_) row[g] = true;
      }
    }
  }

  void execute(const RankProgram& rp, std::vector<EngineResult::MemoryPoint>* timeline) {
    for (pc_ = 0; pc_ < rp.instructions.size(); ++pc_) {
      const Instruction& in = rp.instructions[pc_];
      const bool timed = measuring_;
      if (trace_)
        std::fprintf(stderr, "rank %d pc %zu: %s/%s mb %d chunk %d layers %d+%d x%d\n", rank_, pc_, to_string(in.op),
                     to_string(in.purpose), in.micro_batch, in.chunk, in.layer_begin, in.layer_count, in.repeat);
      if (timeline) {
        peak_seen_ = std::max(peak_seen_, cuda_peak_allocated_bytes(dev_));
        cuda_reset_peak(dev_);
      }
      auto t0 = Clock::now();
      const auto inner0 = timed ? inner_seconds_ : std::map<std::string, double>{};
      const double cw0 = comm_wait_seconds_;
      tp_.timing = timed;
      ep_.timing = timed;
      // (Not the sequence-parallel gradient sums, which name their bucket: on the compute stream
      // only because overlap_comm is off.)
      const bool moe_a2a = in.op == Op::AllToAll && (in.purpose == Purpose::MoEDispatch || in.purpose == Purpose::MoECombine);
      const bool ledger_only =
          moe_a2a || (in.purpose == Purpose::TensorParallel && in.stream == Stream::Compute && in.bucket < 0);
      // Issued inside the compute (tensor_parallel.cpp, moe.cpp).
      if (moe_a2a) ep_.expect(in.purpose, in.bytes, in.repeat);
      else if (ledger_only) tp_.expect(in.op, in.bytes, in.repeat);
      // A ZeRO-3 layer's `repeat` fetch all-gathers (DeepSpeed's per-submodule calls) and gradient
      // reduce-scatters (its per-bucket calls) run here as one collective of the whole group: the
      // same bytes in fewer calls.
      const bool one_call = (in.op == Op::AllGather && in.purpose == Purpose::ParamGather) ||
                            in.purpose == Purpose::GradientReduce;
      const int reps = ledger_only ? 0 : one_call ? 1 : std::max(1, in.repeat);
      for (int rep = 0; rep < reps; ++rep) {
        switch (in.op) {
          case Op::Forward: forward(in); after_use(in); break;
          case Op::Backward: backward(in); after_use(in); break;
          case Op::Recompute:  // done inside Backward (recompute-then-backward per layer)
            check_tp_ledger();
            after_recompute_ = true;
            break;
          case Op::Send: send(in); break;
          case Op::Recv: recv(in); break;
          case Op::OptimizerStep:
          case Op::HostOptimizerStep: optimizer_step(); break;
          case Op::AllReduce:
          case Op::ReduceScatter:
            if (in.purpose == Purpose::GradientReduce) reduce_gradients(in);
            else if (in.purpose == Purpose::EmbeddingSync) sync_tied_embedding(in);
            else if (in.purpose == Purpose::TensorParallel) reduce_sequence_parallel_grads(in);
            else throw std::runtime_error(std::string("torch backend: unsupported collective purpose ") + to_string(in.purpose));
            break;
          case Op::AllToAll:
            if (in.purpose == Purpose::OneBitSigns) onebit_instruction(in);
            else throw std::runtime_error(std::string("torch backend: all-to-all ") + to_string(in.purpose) +
                                          " is not supported (MoE all-to-alls are not implemented in the torch backend)");
            break;
          case Op::AllGather:
            if (in.purpose == Purpose::ParamGather) gather_params(in);
            else if (in.purpose == Purpose::OneBitScales || in.purpose == Purpose::OneBitServer) onebit_instruction(in);
            else throw std::runtime_error(std::string("torch backend: unsupported all-gather purpose ") + to_string(in.purpose));
            break;
          case Op::CopyD2H: copy_d2h(in); break;
          case Op::CopyH2D: copy_h2d(in); break;
          default:
            throw std::runtime_error(std::string("torch backend: instruction ") + to_string(in.op) + "/" +
                                     to_string(in.purpose) + " is not supported by the torch backend");
        }
      }
      // TP collectives ran inside the compute: reported under their own kinds.
      for (auto& [op, sec] : tp_.seconds) {
        inner_seconds_[to_string(op)] += sec;
        tp_comm_seconds_ += sec;
      }
      tp_.seconds.clear();
      if (ep_.seconds > 0) {
        inner_seconds_["moe_all_to_all"] += ep_.seconds;
        ep_comm_seconds_ += ep_.seconds;
        ep_.seconds = 0;
      }
      if (timed) {
        // A collective runs on the communicator's stream: timed to its completion.
        if (is_collective(in.op)) sync();
        else timing_sync();
        const double dt = seconds_since(t0);
        // Work the instruction ran on behalf of another kind (recompute inside Backward, the
        // parameter copy inside the host step) is reported under that kind.
        double inner = 0;
        for (const auto& [kind, sec] : inner_seconds_) {
          const auto it = inner0.find(kind);
          const double d = sec - (it == inner0.end() ? 0.0 : it->second);
          if (d > 0) seconds_by_op_[kind] += d, inner += d;
        }
        const double cw = comm_wait_seconds_ - cw0;
        seconds_by_op_[to_string(in.op)] += dt - inner - cw;
        if (cw > 0) seconds_by_op_["dp_comm_wait"] += cw;
        if (is_collective(in.op) || in.op == Op::CopyD2H || in.op == Op::CopyH2D || in.op == Op::Send ||
            in.op == Op::Recv)
          expected_[counter_key(in.op, in.purpose)] += in.bytes * std::max(1, in.repeat);
      }
      if (timeline) {
        const double peak = cuda_peak_allocated_bytes(dev_);
        peak_seen_ = std::max(peak_seen_, peak);
        timeline->push_back({to_string(in.op), in.micro_batch, in.layer_begin, cuda_allocated_bytes(dev_), peak});
      }
    }
  }

  static double host_peak_bytes() {
    std::ifstream st("/proc/self/status");
    std::string line;
    while (std::getline(st, line))
      if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
    return 0;
  }
  double peak_memory_bytes() {
    const double cuda = cuda_peak_allocated_bytes(dev_);
    if (cuda >= 0) return std::max(cuda, peak_seen_);  // the timeline restarts the allocator's peak
    return host_peak_bytes();
  }

  static double bytes(const at::Tensor& t) { return t.defined() ? double(t.numel() * t.element_size()) : 0; }

  const Scenario& sc_;
  const Program& program_;
  Communicator& world_;  // every rank: control traffic, pipeline messages, the parent of the groups
  EngineOptions o_;
  torch::Device dev_;
  ProcessGrid grid_;
  RankCoord coord_;
  torch::Device state_device_ = torch::Device(torch::kCPU);
  GptConfig cfg_;
  int stage_, dp_, rank_, dpr_;  // ZeRO stage, data-parallel size, world rank, data-parallel rank
  at::ScalarType dtype_;
  bool fp16_;
  DynamicLossScaler scaler_;
  DataSource data_;
  PipeMessages pipe_;
  StageLayout layout_;
  std::unique_ptr<Communicator> tp_comm_, dp_comm_, emb_comm_;
  TensorParallel tp_;
  bool after_recompute_ = false;
  const bool trace_ = std::getenv("DSSIM_TRACE_PROGRAM") != nullptr;  // one line per instruction (debugging)
  double tp_comm_seconds_ = 0, ep_comm_seconds_ = 0;  // while measuring
  std::map<int64_t, at::Tensor> send_grad_;          // by slot_key: input gradients to send
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges_;  // TP-replicated tensors in the flat layout
  // tp / pp > 1: the ranges of the accumulator this rank counts in the global norm.
  std::vector<std::pair<int64_t, int64_t>> norm_ranges_;
  bool norm_by_ranges_ = false;
  int micro_batch_ = 1, grad_accum_ = 1;
  bool recompute_attention_ = false;
  bool checkpoint_activations_ = false, offload_ = false, offload_param_ = false;
  std::map<int, std::vector<std::pair<int64_t, at::Tensor>>> d2h_pending_;
  std::map<int, at::Tensor> staged_;
  std::map<std::pair<Op, Purpose>, double> copy_bytes_;
  std::map<std::pair<Op, Purpose>, int64_t> copy_calls_;
  ZeroPartition part_;
  std::vector<int> first_tensor_;  // per unit: its first tensor in the partition
  // Fine-tuning: per unit its trainable elements and partition tensors, per (unit, parameter) the
  // offset in frozen16_ (-1: in the partition); per partition tensor whether it trains; stage 3:
  // each group's trainable shard in master_.
  std::vector<int64_t> unit_train_numel_;
  std::vector<int> unit_train_count_;
  std::vector<std::vector<int64_t>> frozen_offset_;
  std::vector<bool> part_trainable_;
  std::vector<int64_t> group_train_offset_;
  at::Tensor frozen16_;  // stages 0-2: the frozen tensors, whole, in the compute dtype
  std::vector<std::pair<int, int>> tensor_leaf_;  // per tensor of the partition: (unit, index in p16_[unit])
  std::vector<std::vector<at::Tensor>> p16_;  // per unit: the parameter leaves
  std::vector<bool> gathered_;
  at::Tensor adam_step_tensor_, staging16_;
  HostAccumulator host_acc_;  // its jobs hold the tensors they write
  double host_acc_bytes_ = 0;  // the host sums' memory traffic over the measured steps
  double host_copy_wait_seconds_ = 0;  // of the worker's busy time, waiting for the copies to land
  at::Tensor flat16_, grad16_, shard16_, master_, exp_avg_, exp_avg_sq_, grad_acc_;
  // Stages 0/1: the step reads the reduced 16-bit buckets in place (no grad_acc_); held_for_step_:
  // buckets reduced in this step, which no backward may write into before the step.
  bool grads_in_place_ = false;
  std::vector<bool> held_for_step_;
  StepPath step_path_ = StepPath::Fused;
  std::vector<at::Tensor> full16_, gradg_;         // stage 3, per layer group
  std::vector<std::vector<int>> group_units_;
  std::vector<int64_t> unit_group_offset_;
  std::vector<int64_t> group_shard_offset_;
  std::vector<bool> grad_dirty_;
  // Stage 2: the bucket buffers being filled (undefined when none), the bytes of those and of the
  // ones in flight, and their peak; direct_partition_: one rank accumulating into the partition.
  std::vector<at::Tensor> bucket16_;
  double bucket_bytes_ = 0, bucket_peak_ = 0;
  bool direct_partition_ = false;
  std::vector<std::vector<bool>> keep_after_use_;
  std::vector<int> persistent_;
  std::map<int64_t, MicroBatchState> mbs_;  // by slot_key(chunk, micro-batch)
  std::map<int64_t, at::Tensor> pending_grad_;
  at::Tensor loss_sum_;
  int64_t step_ = 0, adam_step_ = 0;
  size_t pc_ = 0;
  double step_scale_ = 1;
  bool step_skipped_ = false, measuring_ = false;
  double comm_wait_seconds_ = 0;
  double peak_seen_ = 0;  // the allocator's peak before the timeline restarted it
  std::map<std::string, double> inner_seconds_;  // by instruction kind, see execute()
  bool overlap_ = true;
  bool aliased_ = false;  // ZeRO-3 on one rank: the gathered parameters are views of the shard
  std::vector<Deferred> deferred_;
  std::map<std::string, double> seconds_by_op_, expected_;
  std::unique_ptr<OnebitAdam> onebit_;
  // MoE: the experts, the expert-parallel context, routing statistics over the measured steps.
  std::unique_ptr<ExpertStore> experts_;
  std::unique_ptr<Communicator> ep_comm_, edp_comm_;
  ExpertParallel ep_;
  at::Tensor expert_step_tensor_;
  MoeStats moe_stats_;
  Program warm_program_, compressed_program_;  // 1-bit Adam: before / from freeze_step
  bool local_grads_ = false;  // 1-bit Adam's compressed phase: gradients stay on their rank
};

EngineResult Engine::run() {
  EngineResult res;
  const RankProgram& rp = program_.ranks[rank_];
  plan_residency(rp);
  if (o_.resume) load_checkpoint();
  if (!aliased_)
    for (int g : persistent_) gather_group(g, nullptr);
  res.first_step = step_ + 1;
  const int warm = o_.warmup_steps >= 0 ? o_.warmup_steps : std::min(2, o_.steps / 4);
  const double static_bytes = peak_memory_bytes();
  int done = 0;
  while (step_ < o_.steps) {
    if (rank_ == o_.kill_rank && step_ + 1 == o_.kill_at_step) {
      std::fprintf(stderr, "rank %d: killing itself at step %lld (test hook)\n", rank_, (long long)step_ + 1);
      std::fflush(stderr);
      ::kill(::getpid(), SIGKILL);
    }
    if (rank_ == o_.hang_rank && step_ + 1 == o_.hang_at_step) {
      std::fprintf(stderr, "rank %d: stopping itself at step %lld (test hook)\n", rank_, (long long)step_ + 1);
      std::fflush(stderr);
      ::kill(::getpid(), SIGSTOP);
    }
    measuring_ = done >= warm;
    if (measuring_ && done == warm) {
      world_.reset_counters();
      copy_bytes_.clear();
      copy_calls_.clear();
      host_acc_.drain();
      host_acc_.take_stats();
      host_acc_bytes_ = 0;
      host_copy_wait_seconds_ = 0;
    }
    loss_sum_ = at::Tensor();
    sync();
    auto t0 = Clock::now();
    // The first measured step records the memory timeline (CUDA only).
    const bool record = measuring_ && done == warm && cuda_allocated_bytes(dev_) >= 0;
    local_grads_ = onebit_ && onebit_->compressing(step_);
    execute(program_of_step(), record ? &res.memory_timeline : nullptr);
    check_tp_ledger();
    pipe_.finish_sends();
    if (!mbs_.empty() || !send_grad_.empty())
      throw std::runtime_error("Program error: the step ended with micro-batches whose backward never ran");
    {
      const double cw0 = comm_wait_seconds_;
      flush_all();
      if (measuring_ && comm_wait_seconds_ > cw0) seconds_by_op_["dp_comm_wait"] += comm_wait_seconds_ - cw0;
    }
    sync();
    const double dt = seconds_since(t0);
    step_ += 1;
    done += 1;
    // Mean loss over micro-batches and ranks (control traffic, not the Program's).
    auto loss = (loss_sum_.defined() ? loss_sum_ : at::zeros({1}, at::TensorOptions().device(dev_)))
                    .to(at::kFloat).reshape({1}) / double(grad_accum_);
    if (world_.size() > 1) {
      // Only the last stage computes the loss; one rank of each TP group reports it.
      auto l = loss.clone();
      if (!layout_.chunks.back().last || coord_.tp != 0) l.zero_();
      world_.allreduce(l, Purpose::None)->wait();
      loss = l / double(dp_);
    }
    const double lv = loss.item<double>();
    res.losses.push_back(lv);
    res.loss_scales.push_back(step_scale_);
    res.skipped.push_back(step_skipped_);
    if (measuring_) res.step_seconds.push_back(dt);
    if (o_.progress && rank_ == 0) {
      std::fprintf(stderr, "step %lld/%d  loss %.6f  %s%.3f s%s\n", (long long)step_, o_.steps, lv,
                   fp16_ ? ("scale " + std::to_string(int64_t(step_scale_)) + "  ").c_str() : "", dt,
                   step_skipped_ ? "  (skipped: overflow)" : "");
      std::fflush(stderr);
    }
    if (!o_.checkpoint_dir.empty() && o_.save_every > 0 && step_ % o_.save_every == 0 && step_ < o_.steps)
      save_checkpoint();
  }
  if (!o_.checkpoint_dir.empty()) save_checkpoint();
  if (!res.step_seconds.empty()) verify_bytes();
  if (!o_.dump_params.empty()) dump_params();
  res.measured_steps = int(res.step_seconds.size());
  res.seconds_by_op = seconds_by_op_;
  res.tp_comm_seconds = tp_comm_seconds_;
  res.ep_comm_seconds = ep_comm_seconds_;
  res.comm = world_.counters();
  for (const auto& [k, v] : copy_bytes_) res.comm.bytes[k] += v;
  for (const auto& [k, v] : copy_calls_) res.comm.calls[k] += v;
  res.expected_bytes = expected_;
  if (experts_ && !res.step_seconds.empty()) res.moe = moe_stats_.over_world(world_, dev_);
  if (offload_) {
    const auto st = host_acc_.take_stats();
    res.host_offload["accumulate_seconds"] = st.busy_seconds;
    res.host_offload["accumulate_bytes"] = host_acc_bytes_;
    res.host_offload["submit_wait_seconds"] = st.submit_wait_seconds;
    res.host_offload["copy_wait_seconds"] = host_copy_wait_seconds_;
  }
  // Memory by category: the engine's own buffers, and the rest of the peak as activations and
  // temporaries.
  // With the optimizer offloaded the fp32 gradient buffer is a host one, counted with the states.
  // Stage 2: the 16-bit partition and the bucket buffers at their peak.
  double params = 0, grads = bytes(grad16_) + (offload_ ? 0 : bytes(grad_acc_)) + bucket_peak_,
         optim = bytes(master_) + bytes(exp_avg_) + bytes(exp_avg_sq_) + (offload_ ? bytes(grad_acc_) : 0) +
                 (onebit_ ? bytes(onebit_->worker_error()) + bytes(onebit_->server_error()) : 0);
  if (experts_) {
    grads += experts_->gradient_bytes();
    optim += experts_->optimizer_bytes();
  }
  if (stage_ <= 2) params = bytes(flat16_) + bytes(frozen16_) + (experts_ ? experts_->parameter_bytes() : 0.0);
  else {
    params = shard16_.is_cuda() || !dev_.is_cuda() ? bytes(shard16_) : 0;
    if (!aliased_)
      for (int g : persistent_) params += double(part_.stage3_groups[g].numel) * elt16();
  }
  auto& m = res.memory_bytes;
  m["params"] = params;
  m["grads"] = grads;
  if (offload_) m["host_optimizer"] = optim;
  else m["optimizer"] = optim;
  const double peak = peak_memory_bytes();
  m["peak"] = peak;
  m["activations_and_temporaries"] = std::max(0.0, peak - std::max(static_bytes, params + grads + (offload_ ? 0 : optim)));
  if (dev_.is_cuda()) m["host_peak"] = host_peak_bytes();  // the process's resident high-water mark
  return res;
}

}  // namespace

ZeroPartition engine_partition(const Scenario& sc) {
  const GptConfig c = GptConfig::from(sc.model, 1, 0, false, &sc.finetune);
  std::vector<int> units;
  for (int u = 0; u <= c.final_unit(); ++u) units.push_back(u);
  return make_zero_partition(partition_spec(c, sc.zero, sc.parallel.dp, units));
}

EngineResult train(const Scenario& sc, const Program& program, Communicator& comm,
                   const EngineOptions& opts, const torch::Device& device) {
  Engine e(sc, program, comm, opts, device);
  return e.run();
}

}  // namespace dssim::tb
