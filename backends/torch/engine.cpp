#include "backends/torch/engine.hpp"
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <unistd.h>
#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include "backends/torch/checkpoint.hpp"
#include "backends/torch/engine_measure.hpp"
#include "backends/torch/env.hpp"
#include "backends/torch/gpt.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/onebit_adam.hpp"
#include "backends/torch/param_dump.hpp"
#include "core/program_builder.hpp"
#include "backends/torch/pipeline.hpp"
#include "backends/torch/tensor_parallel.hpp"
#include "core/grid.hpp"
#include "core/memory.hpp"
#include "core/pipeline_engine.hpp"
#include "backends/torch/loss_scaler.hpp"
#include "backends/torch/optimizer_kernels.hpp"
#include "backends/torch/torch_compat.hpp"
#include "backends/torch/zero_state.hpp"
#include "core/zero_partition.hpp"

namespace dssim::tb {

std::string counter_key(Op op, Purpose p) { return std::string(to_string(op)) + "/" + to_string(p); }

namespace {

namespace fs = std::filesystem;

at::ScalarType torch_dtype(Dtype d) {
  switch (d) {
    case Dtype::fp32: return at::kFloat;
    case Dtype::fp16: return at::kHalf;
    case Dtype::bf16: return at::kBFloat16;
  }
  return at::kFloat;
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
        data_(o.data_path, cfg_.vocab, cfg_.seq_len, sc.training.seed), pipe_(world), meter_(device) {
    const auto& par = sc.parallel;
    meter_.use_events_from_env(world.size());  // DSSIM_TIMING (engine_measure.hpp)
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
    if (sc.precision.communication_dtype && *sc.precision.communication_dtype != sc.precision.dtype) throw std::runtime_error("torch backend: communication_data_type (precision.communication_dtype " + std::string(to_string(*sc.precision.communication_dtype)) + ") differs from the compute dtype " + to_string(sc.precision.dtype) + ": the engine reduces gradients in the compute dtype; remove the key or set it to the compute dtype");
    // optimizer.fused_step false: the step before issue 15 (an fp32 accumulator at every stage, the
    // step pass by pass through libtorch's ops), the baseline of the measurements before it.
    if (!sc.optimizer.fused_step) step_path_ = StepPath::Ops;
    // Stages 0/1 reduce each bucket once per step, after its last backward: the reduced 16-bit
    // bucket is the step's gradient as it stands, so the step reads it in place and no fp32
    // accumulator exists (core/memory.hpp steps_gradient_buckets_in_place says when, and the
    // memory model prices it).
    ZeroState::Context z;
    z.stage = stage_;
    z.dp = dp_;
    z.dpr = dpr_;
    z.tp_rank = coord_.tp;
    z.dtype = dtype_;
    z.device = dev_;
    z.state_device = offload_ ? torch::Device(torch::kCPU) : dev_;
    z.offload = offload_;
    z.offload_param = sc.zero.offload_param && stage_ == 3;
    z.overlap = sc.zero.overlap_comm;
    z.grads_in_place = steps_gradient_buckets_in_place(sc) && step_path_ == StepPath::Fused;
    z.dp_comm = dp_comm_.get();
    z.measuring = &measuring_;
    z.local_grads = &local_grads_;
    z.inner_seconds = &meter_.inner_seconds;
    z.timing_sync = [this] { timing_sync(); };
    zero_ = std::make_unique<ZeroState>(sc, cfg_, layout_, z);
    if (sc.optimizer.kind == OptimizerKind::onebit_adam) setup_onebit();
    if (sc.model.is_moe()) setup_moe();
  }

  EngineResult run();

 private:
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

  const std::vector<at::Tensor>& param(int u, const char* why) { return zero_->param(u, why); }

  void forward(const Instruction& in) {
    zero_->flush([](const ZeroState::Deferred& d) { return d.kind != ZeroState::Deferred::Gather3; });
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
        auto x = pipe_.take(Purpose::PipelineActivation, std::max(0, in.chunk), mb, &meter_.inner_seconds["recv"]);
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

  void backward(const Instruction& in) {
    const int mb = in.micro_batch;
    zero_->flush([mb](const ZeroState::Deferred& d) {
      return d.kind == ZeroState::Deferred::Gather12 || (d.kind == ZeroState::Deferred::Reduce && d.micro_batch != mb);
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
      zero_->prepare_grad(cfg_.final_unit());
      zero_->prepare_grad(head_weight_unit());
      const double scale = scaler_.scale() / double(grad_accum_);
      torch::autograd::backward({seg.output * scale});
      grad = seg.input.grad();
      zero_->mark_dirty(cfg_.final_unit());
      zero_->mark_dirty(head_weight_unit());
      zero_->complete_buckets(cfg_.final_unit());
      st.segments.pop_back();
    } else if (le == ch.layer_end()) {  // the chunk's output gradient comes from the next stage
      grad = pipe_.take(Purpose::PipelineGradient, std::max(0, in.chunk), mb, &meter_.inner_seconds["recv"]);
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
      zero_->prepare_grad(u);
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
        meter_.inner_seconds["recompute"] += seconds_since(t0);
      }
      if (aux.defined() && aux.requires_grad()) {
        // The load-balancing loss joins the training loss, scaled as the LM loss is.
        const double scale = scaler_.scale() / double(grad_accum_);
        torch::autograd::backward({out, aux}, {grad.to(out.scalar_type()), at::full({}, scale, aux.options())});
      } else {
        torch::autograd::backward({out}, {grad.to(out.scalar_type())});
      }
      grad = seg.input.grad();
      zero_->mark_dirty(u);
      zero_->complete_buckets(u);
      st.segments.pop_back();
      if (l > 0) zero_->fold_group_now(zero_->group_of(u));
    }
    if (lb > ch.layer_begin) {
      pending_grad_[key] = grad;
      return;
    }
    pending_grad_.erase(key);
    auto& seg = st.segments.back();
    if (ch.first) {
      param(0, "backward");
      zero_->prepare_grad(0);
      if (seg.output.requires_grad())  // a frozen embedding has no backward
        torch::autograd::backward({seg.output}, {grad.to(seg.output.scalar_type())});
      zero_->mark_dirty(0);
      zero_->complete_buckets(0);
      zero_->fold_group_now(zero_->group_of(0));
    } else {
      send_grad_[key] = grad.to(dtype_);  // the input's gradient, for the Program's SendGrad
    }
    mbs_.erase(key);
  }

  // Stage 3 frees the units an instruction used unless the Program uses them again before
  // gathering them again.
  void after_use(const Instruction& in) {
    if (stage_ < 3) return;
    zero_->after_use(pc_, groups_of(in));
  }
  std::vector<int> groups_of(const Instruction& in) const {
    std::vector<int> gs;
    for (int u : units_of(in)) {
      const int g = zero_->group_of(u);
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
  bool expert_group(const Instruction& in) const {
    return in.group >= 0 && in.group < int(program_.groups.size()) && program_.groups[in.group].kind == GroupKind::ExpertDP;
  }

  void reduce_gradients(const Instruction& in) {
    if (expert_group(in)) {
      if (!experts_) throw std::runtime_error("Program error: an expert gradient reduction without MoE layers");
      experts_->reduce(in);
      return;
    }
    zero_->reduce_gradients(in);
  }

  void gather_params(const Instruction& in) {
    if (stage_ == 0) throw std::runtime_error("Program error: parameter all-gather under ZeRO-0");
    if (expert_group(in)) {
      if (!experts_) throw std::runtime_error("Program error: an expert all-gather without MoE layers");
      experts_->gather(in);
      return;
    }
    zero_->gather_params(in);
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
    at::Tensor g = zero_->grad16().narrow(0, zero_->unit_offset(u), unit_params(cfg_, u)[0].numel());
    check_bytes(in, double(g.numel()) * zero_->elt16());
    for (size_t k = 0; k < zero_->partition().grad_buckets.size(); ++k) {
      const Range& r = zero_->partition().grad_buckets[k].range;
      if (r.begin < zero_->unit_offset(u) + g.numel() && zero_->unit_offset(u) < r.end() && !zero_->grad_dirty(k))
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
    if (stage_ > 2 || in.bucket < 0 || in.bucket >= int(zero_->partition().grad_buckets.size()))
      throw std::runtime_error("Program error: sequence-parallel gradient all-reduce of bucket " + std::to_string(in.bucket));
    const Range& r = zero_->partition().grad_buckets[in.bucket].range;
    std::vector<at::Tensor> views;
    for (const auto& [off, n] : zero_->replicated_ranges()) {
      const int64_t b = std::max(off, r.begin), e = std::min(off + n, r.end());
      if (e > b)
        views.push_back(stage_ == 2 ? zero_->bucket_grad(in.bucket).narrow(0, b - r.begin, e - b)
                                    : zero_->grad16().narrow(0, b, e - b));
    }
    if (views.empty()) throw std::runtime_error("Program error: bucket " + std::to_string(in.bucket) + " holds no replicated parameters");
    at::Tensor flat = at::cat(views);
    check_bytes(in, double(flat.numel()) * zero_->elt16());
    tp_comm_->allreduce(flat, in.purpose)->wait();
    at::NoGradGuard ng;
    int64_t o = 0;
    for (auto& v : views) {
      v.copy_(flat.narrow(0, o, v.numel()));
      o += v.numel();
    }
    if (stage_ == 2 && dp_ == 1) zero_->fold_local_bucket(in.bucket);  // complete: no reduction follows
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
  // ---- 1-bit Adam (backends/torch/onebit_adam.hpp) -------------------------------------------
  // The warm-up steps run the Program of a step before freeze_step (gradient all-reduce, AdamW),
  // the others the compressed one (no gradient reduction; the OneBit instructions, then the step).
  void setup_onebit() {
    const auto& par = sc_.parallel;
    if (stage_ != 0 || par.tp > 1 || par.pp > 1 || offload_ || fp16_)
      throw std::invalid_argument("torch backend: 1-bit Adam runs with zero.stage 0, tp = pp = 1, no offload and "
                                  "fp32 or bf16 (fp16's loss scaler with rank-local gradients is not implemented)");
    onebit_ = std::make_unique<OnebitAdam>(zero_->master().numel(), dp_comm_.get(), sc_.optimizer.freeze_step,
                                           zero_->master().options());
    Scenario warm = sc_, compressed = sc_;
    warm.optimizer.step = 0;
    compressed.optimizer.step = std::max(sc_.optimizer.step, sc_.optimizer.freeze_step);
    warm_program_ = build_program(warm);
    compressed_program_ = build_program(compressed);
  }
  // The Program a step runs, by the number of steps done before it.
  const RankProgram& program_at(int64_t steps_done) const {
    if (!onebit_) return program_.ranks[rank_];
    return (onebit_->compressing(steps_done) ? compressed_program_ : warm_program_).ranks.at(rank_);
  }
  const RankProgram& program_of_step() const { return program_at(step_); }
  void onebit_instruction(const Instruction& in) {
    if (!onebit_ || !local_grads_)
      throw std::runtime_error(std::string("Program error: ") + to_string(in.op) + "/" + to_string(in.purpose) +
                               " outside 1-bit Adam's compressed phase");
    if (in.purpose == Purpose::OneBitSigns) {  // the momentum from this rank's own gradient first
      at::Tensor g = step_gradient();
      if (!g.defined()) throw std::logic_error("1-bit Adam: skipped step");
      onebit_->update_momentum(zero_->exp_avg(), g, sc_.optimizer.beta1);
      g.zero_();
    }
    onebit_->run(in, zero_->exp_avg());
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
        onebit_->update_momentum(zero_->exp_avg(), g, opt.beta1);
        g.zero_();
      }
      step_scale_ = scaler_.scale();
      step_skipped_ = false;
      adam_step_ += 1;
      onebit_->step(zero_->master(), zero_->exp_avg(), zero_->exp_avg_sq(), adam_step_, hyper);
      zero_->publish_master();
      return;
    }
    if (offload_) {
      at::Tensor g = step_gradient();
      if (!g.defined()) return;  // skipped (fp16 overflow)
      adam_step_ += 1;
      zero_->host_step_and_publish(g, hyper, adam_step_);  // clears g in the AdamW pass itself
    } else {
      const StepGradient sg = step_gradient_parts();
      if (!sg.g.defined()) return;  // skipped (fp16 overflow)
      adam_step_ += 1;
      // One pass (fused_adamw_step): the gradient read where it is (the 16-bit buckets at stages
      // 0/1, the 16-bit partition at stage 2, the fp32 accumulator at stage 3), scaled, AdamW, the
      // 16-bit copy written and the gradient cleared for the next step.
      at::Tensor out = zero_->publish_target();
      fused_adamw_step(zero_->master(), sg.g, zero_->exp_avg(), zero_->exp_avg_sq(), adam_step_, hyper, sg.pre, sg.coef,
                       out, true, &adam_step_tensor_, step_path_);
      if (!out.defined()) zero_->publish_master();
      zero_->clear_held_for_step();
    }
    if (experts_)
      experts_->step([&](at::Tensor& p, at::Tensor& eg, at::Tensor& m, at::Tensor& v) {
        adamw_step(p, eg, m, v, adam_step_, hyper, &expert_step_tensor_, nullptr, true);
      });
    if (fp16_) scaler_.update(false);
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
    zero_->flush_all();
    at::NoGradGuard ng;
    double pre = 1;
    at::Tensor acc = zero_->step_gradient_buffer(pre);
    const bool inject = std::find(o_.overflow_steps.begin(), o_.overflow_steps.end(), int(step_ + 1)) !=
                        o_.overflow_steps.end();
    if (inject) acc.narrow(0, 0, 1).fill_(std::numeric_limits<float>::infinity());
    const at::Tensor expert_acc = experts_ ? experts_->step_gradient() : at::Tensor();
    const double inv_scale = 1.0 / scaler_.scale();
    const double unscale = inv_scale * pre;  // of acc's values
    const double clip = sc_.training.gradient_clipping;
    // Global squared norm of the (unscaled) gradient: whole on ZeRO-0, summed over shards else,
    // and over pipeline stages and TP slices, each parameter counted once (zero_state.cpp norm_ranges_).
    // Needed for clipping and fp16 overflow detection only (it costs a pass and a host sync).
    double norm2 = 0;
    if (clip > 0 || fp16_ || inject) {
      at::Tensor sumsq = zero_->counted_sum_of_squares(acc);
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
      zero_->clear_held_for_step();
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

  // ---- checkpoints (backends/torch/checkpoint.hpp) --------------------------------------------
  CheckpointLayout checkpoint_layout() const {
    return {world_.size(), sc_.parallel.tp, sc_.parallel.pp, stage_, to_string(sc_.precision.dtype),
            zero_->partition().padded_numel};
  }

  void save_checkpoint() {
    at::NoGradGuard ng;
    const fs::path root(o_.checkpoint_dir);
    write_rank_checkpoint(root / checkpoint_step_dir(step_), rank_,
                          {step_, adam_step_, scaler_.state(), zero_->master(), zero_->exp_avg(), zero_->exp_avg_sq(),
                           checkpoint_extra()});
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
    RankCheckpoint c{0, 0, {}, zero_->master(), zero_->exp_avg(), zero_->exp_avg_sq(), checkpoint_extra()};
    read_rank_checkpoint(dir, rank_, step, c);
    adam_step_ = c.adam_step;
    scaler_.restore(c.scaler);
    step_ = step;
    zero_->publish_master();
    if (experts_) experts_->after_load();
    zero_->regather_params();
  }

  // --dump-params (param_dump.hpp): the whole model in fp32, a single-rank run's layout.
  void dump_params() {
    if (cfg_.ft.active) return dump_finetuned_params();
    at::NoGradGuard ng;
    const DumpWorld w{sc_, program_, grid_, cfg_, world_, rank_, coord_};
    at::Tensor full = zero_->full_master();
    if (sc_.parallel.tp > 1 || sc_.parallel.pp > 1) full = assemble_whole_model(w, full);
    if (experts_) {
      // Every rank gathers its own experts (stages 1/2 all-gather), rank 0 collects them.
      const at::Tensor all_experts = assemble_experts(w, experts_->full_master().to(at::kCPU), experts_->local_experts());
      if (rank_ == 0) full = at::cat({full, all_experts});
    }
    if (rank_ == 0) write_fp32(o_.dump_params, full);
  }

  // Fine-tuning (tp = pp = 1): the whole base model in fp32, laid out as a run without fine-tuning
  // dumps it (unit order), then the adapters (unit order): the fp32 master of the trainable tensors,
  // the compute-dtype copy of the frozen ones.
  void dump_finetuned_params() {
    at::NoGradGuard ng;
    const std::vector<std::vector<at::Tensor>> units = zero_->unit_params_fp32();  // per unit, in fp32 (CPU)
    if (rank_ != 0) return;
    std::vector<at::Tensor> out;
    for (int pass = 0; pass < 2; ++pass)  // base, then adapters
      for (int u : layout_.units) {
        const int nb = base_param_count(cfg_, u);
        for (int i = 0; i < int(units[u].size()); ++i)
          if ((i >= nb) == (pass == 1)) out.push_back(units[u][i].reshape({-1}));
      }
    write_fp32(o_.dump_params, at::cat(out));
  }

  // The bytes this rank's communicators and copies moved over the measured steps, by "op/purpose",
  // checked against the Program's (InstructionMeter::verify_bytes).
  void verify_bytes() const {
    std::map<std::string, double> moved;
    for (const auto& [k, v] : world_.counters().bytes)
      if (k.second != Purpose::None) moved[counter_key(k.first, k.second)] += v;
    for (const auto& [k, v] : zero_->copy_bytes()) moved[counter_key(k.first, k.second)] += v;
    std::set<std::string> unchecked;  // drop_tokens false: the capacity is the busiest expert's load at run time
    if (!ep_.check_bytes)
      unchecked = {counter_key(Op::AllToAll, Purpose::MoEDispatch), counter_key(Op::AllToAll, Purpose::MoECombine)};
    if (tp_.all_gather_bytes_dynamic) unchecked.insert(counter_key(Op::AllGather, Purpose::TensorParallel));
    meter_.verify_bytes(moved, unchecked, rank_);
  }

  // ---- the step -----------------------------------------------------------------------------
  void sync() { device_synchronize(dev_); }
  // Timing inside a step waits for the compute stream only: a device-wide wait would also wait for
  // the side-stream gradient copies and serialise them with the compute they overlap otherwise
  // (0.43 s of the 7B offload run's 5.5 s iteration).
  void timing_sync() { stream_synchronize(dev_); }
  // Whether the next instruction is a compute instruction of the same kind (timed with this one).
  bool continues_same_kind(const RankProgram& rp) const {
    if (pc_ + 1 >= rp.instructions.size()) return false;
    const Op a = rp.instructions[pc_].op, b = rp.instructions[pc_ + 1].op;
    return a == b && (a == Op::Forward || a == Op::Backward);
  }

  // "dssim forward/none mb 2 layers 0+24": the instruction's range name in a kernel trace.
  static std::string instruction_label(const Instruction& in) {
    return std::string("dssim ") + to_string(in.op) + "/" + to_string(in.purpose) + " mb " +
           std::to_string(in.micro_batch) + " layers " + std::to_string(in.layer_begin) + "+" +
           std::to_string(in.layer_count);
  }

  void execute(const RankProgram& rp, std::vector<EngineResult::MemoryPoint>* timeline) {
    for (pc_ = 0; pc_ < rp.instructions.size(); ++pc_) {
      const Instruction& in = rp.instructions[pc_];
      const bool timed = measuring_;
      if (trace_)
        std::fprintf(stderr, "rank %d pc %zu: %s/%s mb %d chunk %d layers %d+%d x%d\n", rank_, pc_, to_string(in.op),
                     to_string(in.purpose), in.micro_batch, in.chunk, in.layer_begin, in.layer_count, in.repeat);
      if (timeline) meter_.memory_before();
      // In a kernel trace (DSSIM_KERNEL_TRACE) each instruction is a named range, so the trace's
      // kernels can be told apart by instruction (bench/kernel_trace_summary.py --by-instruction).
      const std::string label = kernel_tracing_ ? instruction_label(in) : std::string();
      RECORD_USER_SCOPE(label);
      const auto span = meter_.begin(timed, zero_->comm_wait_seconds());
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
          case Op::CopyD2H: zero_->copy_d2h(in); break;
          case Op::CopyH2D: zero_->copy_h2d(in); break;
          default:
            throw std::runtime_error(std::string("torch backend: instruction ") + to_string(in.op) + "/" +
                                     to_string(in.purpose) + " is not supported by the torch backend");
        }
      }
      // TP and MoE collectives ran inside the compute: reported under their own kinds.
      meter_.add_compute_collectives(tp_.seconds, ep_.seconds);
      if (timed) {
        // A collective runs on the communicator's stream: timed to its completion. Consecutive
        // compute instructions of one kind (ZeRO-3's per-layer forward and backward on one rank,
        // a backward split where gradient buckets close) are timed as one span: a host sync
        // between them would leave the GPU idle while the host queues the next one.
        // With event timing (one rank, engine_measure.hpp) the boundary is an event, not a sync.
        if (is_collective(in.op)) sync();
        else if (!meter_.events() && !continues_same_kind(rp)) timing_sync();
        meter_.end(span, in, zero_->comm_wait_seconds());
      }
      if (timeline) meter_.memory_after(in, *timeline);
    }
  }

  const Scenario& sc_;
  const Program& program_;
  Communicator& world_;  // every rank: control traffic, pipeline messages, the parent of the groups
  EngineOptions o_;
  torch::Device dev_;
  ProcessGrid grid_;
  RankCoord coord_;
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
  std::map<int64_t, at::Tensor> send_grad_;          // by slot_key: input gradients to send
  int micro_batch_ = 1, grad_accum_ = 1;
  bool recompute_attention_ = false;
  bool checkpoint_activations_ = false, offload_ = false;
  // The ZeRO state (zero_state.hpp): layout, flat buffers, gradient buckets, stage-3 groups, the
  // sharded optimizer state, offload.
  std::unique_ptr<ZeroState> zero_;
  at::Tensor adam_step_tensor_;
  StepPath step_path_ = StepPath::Fused;
  std::map<int64_t, MicroBatchState> mbs_;  // by slot_key(chunk, micro-batch)
  std::map<int64_t, at::Tensor> pending_grad_;
  at::Tensor loss_sum_;
  int64_t step_ = 0, adam_step_ = 0;
  size_t pc_ = 0;
  double step_scale_ = 1;
  bool step_skipped_ = false, measuring_ = false, kernel_tracing_ = false;
  InstructionMeter meter_;  // seconds, bytes and memory of what execute() runs (engine_measure.hpp)
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
  zero_->plan_residency(rp, [this](const Instruction& in) { return groups_of(in); });
  if (o_.resume) load_checkpoint();
  zero_->gather_persistent();
  res.first_step = step_ + 1;
  int warm = o_.warmup_steps >= 0 ? o_.warmup_steps : std::min(2, o_.steps / 4);
  // A step whose Program differs from the step before it (counting steps before a resume) pays
  // one-time costs (1-bit Adam's first compressed step: about 20 ms on an H100, 26 ms on an H200 in
  // its optimizer step, over the next steps'; not traced to their source): the warm-up covers the
  // last such step, where the run has steps to spare after it.
  for (int d = 0; d + 1 < o_.steps; ++d)
    if (step_ + d > 0 && &program_at(step_ + d) != &program_at(step_ + d - 1)) warm = std::max(warm, d + 1);
  res.warmup_steps = warm;
  // What is resident as training starts (on a GPU the allocator's current bytes, not its peak: set-up
  // transients such as the experts' fp32 initialisation are not model state; on the host the
  // process's high-water mark, the only figure there is).
  const double cuda_resident = cuda_allocated_bytes(dev_);
  const double static_bytes = cuda_resident >= 0 ? cuda_resident : meter_.peak_memory_bytes();
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
      zero_->start_measuring();
    }
    loss_sum_ = at::Tensor();
    sync();
    // DSSIM_KERNEL_TRACE=FILE: rank 0's last step as a kineto trace (CUDA builds).
    static const std::string trace_file = env_str("DSSIM_KERNEL_TRACE", "");
    const bool tracing = !trace_file.empty() && rank_ == 0 && step_ + 1 == o_.steps && kernel_trace_start();
    kernel_tracing_ = tracing;
    auto t0 = Clock::now();
    // The first measured step records the memory timeline (CUDA only).
    const bool record = measuring_ && done == warm && cuda_allocated_bytes(dev_) >= 0;
    local_grads_ = onebit_ && onebit_->compressing(step_);
    meter_.step_start();
    execute(program_of_step(), record ? &res.memory_timeline : nullptr);
    check_tp_ledger();
    pipe_.finish_sends();
    if (!mbs_.empty() || !send_grad_.empty())
      throw std::runtime_error("Program error: the step ended with micro-batches whose backward never ran");
    {
      const double cw0 = zero_->comm_wait_seconds();
      zero_->flush_all();
      const double cw = zero_->comm_wait_seconds();
      if (measuring_) meter_.add_comm_wait(cw - cw0);
    }
    sync();
    meter_.resolve_step();
    const double dt = seconds_since(t0);
    if (tracing) kernel_trace_stop(trace_file);
    kernel_tracing_ = false;
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
  res.seconds_by_op = meter_.seconds_by_op;
  res.event_timing = meter_.events();
  res.tp_comm_seconds = meter_.tp_comm_seconds;
  res.ep_comm_seconds = meter_.ep_comm_seconds;
  res.comm = world_.counters();
  for (const auto& [k, v] : zero_->copy_bytes()) res.comm.bytes[k] += v;
  for (const auto& [k, v] : zero_->copy_calls()) res.comm.calls[k] += v;
  res.expected_bytes = meter_.expected;
  if (experts_ && !res.step_seconds.empty()) res.moe = moe_stats_.over_world(world_, dev_);
  if (offload_) {
    zero_->host_offload_stats(res.host_offload);
  }
  // Memory by category: the engine's own buffers, and the rest of the peak as activations and
  // temporaries.
  // The ZeRO buffers (zero_state.cpp memory_bytes), the experts' and 1-bit Adam's error buffers.
  const ZeroState::MemoryBytes zm = zero_->memory_bytes();
  double params = zm.params, grads = zm.grads,
         optim = zm.optim + (onebit_ ? ZeroState::bytes(onebit_->worker_error()) + ZeroState::bytes(onebit_->server_error()) : 0);
  if (experts_) {
    grads += experts_->gradient_bytes();
    optim += experts_->optimizer_bytes();
  }
  if (stage_ <= 2 && experts_) params += experts_->parameter_bytes();
  auto& m = res.memory_bytes;
  m["params"] = params;
  m["grads"] = grads;
  // ZeRO-3: the layer groups' 16-bit gradients alive at once before their reduction (or fold);
  // none where backward accumulates into the partition (core/memory.hpp zero3_backward_into_partition).
  if (stage_ == 3) {
    m["zero3_layer_gradients_peak"] = zm.layer_grads_peak;
    res.zero3_backward_into_partition = zero_->zero3_backward_into_partition();
  }
  if (offload_) m["host_optimizer"] = optim;
  else m["optimizer"] = optim;
  const double peak = meter_.peak_memory_bytes();
  m["peak"] = peak;
  m["activations_and_temporaries"] = std::max(0.0, peak - std::max(static_bytes, params + grads + (offload_ ? 0 : optim)));
  if (dev_.is_cuda()) m["host_peak"] = InstructionMeter::host_peak_bytes();  // the process's resident high-water mark
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
