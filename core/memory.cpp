// Memory model. Sources:
//  [Z]   Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
//        Models", arXiv:1910.02054, section 3.1 and 5 / Table 1: mixed-precision Adam keeps 2 psi
//        (fp16 params) + 2 psi (fp16 grads) + K psi (fp32 params, momentum, variance; K = 12).
//  [ZO]  Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840: optimizer states, fp32 gradients and the
//        update live on the host; the GPU keeps the 16-bit parameters.
//  [K]   Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
//        arXiv:2205.05198: section 4 (activations per layer, eq. 1-2, table 2), section 4.2.3
//        (pipeline: stage 0 holds p micro-batches; interleaving: factor 1 + (p-1)/(p m)), section 4.3
//        (embedding dropout, output layer, cross-entropy), section 5 (selective recompute).
//  [DS]  DeepSpeed sources: runtime/zero/stage_1_and_2.py (ipg reduce buckets, double-buffered when
//        overlap_comm; fp32 partition gradient for the step; allgather_bucket_size), stage3.py /
//        partitioned_param_coordinator.py (prefetch_bucket_size, max_live_parameters,
//        param_persistence_threshold), runtime/fp16/onebit/adam.py (worker/server error buffers),
//        moe/ (experts sharded over the expert-data-parallel group tp dp / ep).
//  [M]   Megatron-LM: vocab-parallel embedding and cross-entropy (fp32 logits), tied word embedding
//        copy on the last pipeline stage, scatter-gather p2p of s b h / t with sequence parallelism.
#include "core/memory.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/finetune.hpp"
#include "core/grid.hpp"
#include "core/model.hpp"
#include "core/optimizer_step.hpp"
#include "core/pipeline_engine.hpp"

namespace dssim {

// [Z] section 5.1 and Table 1.
double zero_model_state_bytes(double psi, int stage, int n, double k) {
  const double dp = std::max(1, n);
  switch (stage) {
    case 0: return (2 + 2 + k) * psi;
    case 1: return (2 + 2) * psi + k * psi / dp;
    case 2: return 2 * psi + (2 + k) * psi / dp;
    default: return (2 + 2 + k) * psi / dp;
  }
}

// [K] eq. 1 (no parallelism), eq. 2 (TP), section 4.2.2 (TP + SP), table 2 (recompute variants).
double activation_bytes_per_layer(double s, double b, double h, double a, int t,
                                  bool sequence_parallel, Recompute r) {
  const double tp = std::max(1, t);
  const double sbh = s * b * h;
  if (r == Recompute::full) return sequence_parallel ? 2 * sbh / tp : 2 * sbh;
  const double core = r == Recompute::selective ? 0 : 5 * a * s / (h * tp);
  if (sequence_parallel) return sbh * (34 / tp + core);
  return sbh * (10 + 24 / tp + core);
}

// Generalised [K] section 4.1 per layer, 16-bit (scale sc = bytes/2 for fp32; masks stay 1 byte):
//   replicated in the TP group (split by SP): LN inputs 4, QKV input 2, MLP input 2, 2 dropout
//     masks 2 -> 10 sbh;
//   TP-split: Q, K 4, V 2, projection input 2 = 8 sbh; MLP: GeLU input 2 ffn sb, down input 2 ffn sb;
//   attention core (TP-split, dropped by selective recompute): softmax output 2 a s^2 b, dropout
//     mask a s^2 b, dropout output 2 a s^2 b = 5 a s^2 b.
// MoE layer [DS]: the expert MLP keeps its inputs for the routed tokens of this GPU,
// R = s b top_k capacity / t, each 2h (up input) + 4 ffn (GeLU and down inputs), plus fp32 gate
// probabilities s b E (on s b / t tokens with SP). Around the experts, with index-based dispatch
// and combine (the torch engine's moe.cpp; DeepSpeed's einsum instead keeps s x E x C combine
// weights): the gate's fp32 copy of its input, 4h per token (DeepSpeed's TopKGate runs its linear
// in fp32 too), in place of the 16-bit MLP input a dense layer keeps (the dispatch keeps only
// indices: moe.cpp's DispatchFunction); and the combine's gathered expert outputs, top_k rows of 2h
// per token (their product with the gate weights keeps both).
// Llama-shaped layers (the same accounting, term by term; kv = kv_heads * head_dim):
//   GQA: Q 2h, K 2kv, V 2kv, projection input 2h -> (4h + 4kv) s b / t (= 8 sbh at kv = h); rotary
//     keeps nothing more (q, k are kept rotated; its backward needs only the cos / sin tables);
//   SwiGLU: the gate and up outputs (2 ffn each, what silu(g) * u's backward reads) and the down
//     input (2 ffn) -> 6 ffn s b / t (GeLU: 4 ffn); MoE experts likewise 2h + 6 ffn per routed token;
//   RMSNorm: its input (as LayerNorm's) and one fp32 1/rms per token (4 bytes, LayerNorm 8).
double activation_bytes_per_layer(const ModelSpec& m, int micro_batch, int tp,
                                  bool sequence_parallel, Recompute r, bool moe_layer, Dtype dtype) {
  const double s = m.seq_len, b = micro_batch, h = m.hidden, a = m.heads, f = ffn_hidden_of(m);
  const double kv = kv_width(m);
  const double mlp_kept = 2.0 * (mlp_matrices(m) - 1) + 2;  // GeLU 4 ffn, SwiGLU 6 ffn (x sc)
  const double t = std::max(1, tp);
  const double sc = bytes_of(dtype) / 2.0;
  const double sbh = s * b * h;
  const double sp_div = sequence_parallel ? t : 1.0;
  if (r == Recompute::full) return 2 * sc * sbh / sp_div;  // only the layer input is kept
  if (r == Recompute::selective_op) {
    // torchtitan's op-level SAC (core/scenario.hpp): the block's input (the checkpoint's), the
    // saved matmul outputs: q (h/t) and v (kv/t), SwiGLU's gate (ffn/t) and down (h: the row-
    // parallel GEMM's output before its reduction) or GeLU's up (ffn/t); and SDPA's output with its
    // fp32 row log-sum-exp (flash). An unfused attention core and MoE experts are recomputed.
    double kept = 2 * sc * sbh / sp_div + 2 * sc * s * b * (h + kv) / t;
    if (m.flash_attention) kept += 2 * sc * sbh / t + 4.0 * a * s * b / t;
    if (!(moe_layer && m.is_moe())) kept += m.swiglu ? 2 * sc * s * b * f / t + 2 * sc * sbh : 2 * sc * s * b * f / t;
    return kept;
  }
  // Dropout masks (1 byte): after the attention projection and after the MLP. LayerNorm keeps its
  // fp32 mean and 1/std per token (2 LayerNorms x 8 bytes), which Korthikanti leaves out.
  const double masks = m.has_dropout() ? 2 : 0;
  const double norm_stats = m.rmsnorm ? 8 : 16;  // fp32 bytes per token, both norms
  const double replicated = (8 * sc + masks) * sbh / sp_div + norm_stats * s * b / sp_div;
  double split = 4 * sc * s * b * (h + kv) / t;
  if (moe_layer && m.is_moe()) {
    const double routed = moe_routed_slots(m, s * b) / t;
    split += routed * (2 * h + mlp_kept * f) * sc + 4.0 * s * b * m.experts / sp_div;
    split += (4.0 - 2 * sc + 2 * sc * m.top_k) * sbh / sp_div;  // fp32 gate input for the MLP input; combine rows
  } else {
    split += mlp_kept * sc * s * b * f / t;
  }
  // Flash attention keeps only its output (counted above) and the fp32 row log-sum-exp. Unfused:
  // the softmax output, and with dropout its mask (1 byte) and the dropped-out probabilities.
  const double unfused_core = m.has_dropout() ? (4 * sc + 1) : 2 * sc;
  const double core = m.flash_attention         ? 4.0 * a * s * b / t
                      : r == Recompute::selective ? 0
                                                  : unfused_core * a * s * s * b / t;
  return replicated + split + core;
}

// [K] section 4.2.3; Megatron's schedules.py warm-up counts: 1F1B stage i runs pp - i - 1 warm-up
// forwards before its first backward; interleaved: 2 (pp - i - 1) + (v - 1) pp warm-up chunks.
double in_flight_micro_batches(int pp, int stage, int interleave, int micro_batches) {
  const int p = std::max(1, pp);
  const int v = std::max(1, interleave);
  const int mb = micro_batches > 0 ? micro_batches : p;
  if (v == 1) return std::max(1, std::min(p - stage, mb));
  const double chunks = std::min(2.0 * (p - stage - 1) + (v - 1.0) * p + 1, 1.0 * v * mb);
  return std::max(1.0, chunks) / v;
}

StageLayers stage_layers(const Scenario& sc, int stage) {
  const int pp = std::max(1, sc.parallel.pp);
  const auto& part = sc.parallel.partition;
  const int layers = sc.model.layers;
  if (static_cast<int>(part.size()) == pp &&
      std::accumulate(part.begin(), part.end(), 0) == layers) {
    int first = std::accumulate(part.begin(), part.begin() + stage, 0);
    return {first, first + part[stage]};
  }
  const int base = layers / pp, extra = layers % pp;
  const int first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

namespace {

int micro_batches_of(const Scenario& sc) {
  if (sc.training.grad_accum > 0) return sc.training.grad_accum;
  const double per_step = static_cast<double>(sc.training.micro_batch) * std::max(1, sc.parallel.dp);
  if (sc.training.global_batch > 0 && per_step > 0)
    return std::max<int>(1, static_cast<int>(sc.training.global_batch / per_step));
  return std::max(1, sc.parallel.pp);
}

}  // namespace

// Experts are replicated over the expert-data-parallel group tp dp / ep [DS moe] (core/grid.hpp).
StageParameters stage_parameters(const Scenario& sc, int stage) {
  const ModelSpec& m = sc.model;
  const double h = m.hidden, f = ffn_hidden_of(m), v = m.vocab, s = m.seq_len;
  const double t = std::max(1, sc.parallel.tp);
  const double ep = std::max(1, sc.parallel.ep);
  const int pp = std::max(1, sc.parallel.pp);
  const double threshold = sc.zero.param_persistence_threshold;
  stage = std::clamp(stage, 0, pp - 1);
  StageParameters p;
  auto module = [&](double elems) { p.largest_module = std::max(p.largest_module, elems); };
  auto small = [&](double elems) { if (elems < threshold) p.persistent += elems; };

  const FinetuneSpec& ft = sc.finetune;
  const bool frozen_any = ft.freezes_anything();
  const StageLayers range = stage_layers(sc, stage);
  for (int i = range.first; i < range.last; ++i) {
    const double before = p.dense + p.expert;
    const bool moe = is_moe_layer(m, i);
    if (frozen_any) {
      // What trains of this layer (adapters are added to dense below, after the base's module
      // sizes): attention, norms, the MLP or its experts and gate, as FinetuneSpec says.
      p.trainable_dense += layer_trainable_params(m, ft, t);
      if (moe && base_trains(m, ft, BasePart::mlp)) {
        p.trainable_dense += h * m.experts - expert_mlp_params(m) / t;  // the gate, not a dense MLP
        p.trainable_expert += std::ceil(m.experts / ep) * expert_mlp_params(m);
      }
      p.dense += layer_adapter_params(m, ft);
      for (const LoraAdapter& a : layer_adapters(m, ft)) small(ft.rank * a.in), small(ft.rank * a.out);  // A, B
    }
    // Megatron TP splits every weight matrix and the column-parallel biases by t; LayerNorms and
    // row-parallel biases are replicated. We divide the whole layer by t (error O(h) per layer).
    const double attention_and_norms = dense_layer_params(m) - expert_mlp_params(m);
    p.dense += attention_and_norms / t;
    const double qkv = h + 2 * kv_width(m), bias = m.bias ? 1 : 0;  // qkv = 3h without GQA
    module(qkv * h / t + bias * qkv / t);
    module(h * h / t + bias * h);
    for (int n = 0; n < 2; ++n) {  // 2 norms: gain (+ bias for LayerNorm)
      small(h);
      if (!m.rmsnorm) small(h);
    }
    if (m.bias) small(qkv / t), small(h);  // QKV and proj biases
    const int up_biases = mlp_matrices(m) - 1;  // up (+ gate)
    if (moe) {
      // experts are not TP-split (DeepSpeed's default); the gate is replicated in the TP group
      p.dense += h * m.experts;
      p.expert += std::ceil(m.experts / ep) * expert_mlp_params(m);
      module(h * m.experts);
      module(h * f + bias * f);
      if (m.bias)
        for (int e = 0; e < std::ceil(m.experts / ep); ++e) {
          for (int u = 0; u < up_biases; ++u) small(f);
          small(h);
        }
    } else {
      p.dense += expert_mlp_params(m) / t;
      module(h * f / t + bias * f / t);
      if (m.bias) {
        for (int u = 0; u < up_biases; ++u) small(f / t);
        small(h);
      }
    }
    p.largest_block = std::max(p.largest_block, p.dense + p.expert - before);
  }
  const bool first = stage == 0, last = stage == pp - 1;
  if (frozen_any) {
    if (first) p.trainable_dense += embedding_trainable_params(m, ft, t);
    if (last) {
      p.trainable_dense += head_trainable_params(m, ft, !m.tied_embeddings || (pp > 1 && !first), t);
      p.dense += head_adapter_params(m, ft);
    }
  }
  if (first) {
    p.dense += v * h / t + (m.rotary ? 0 : s * h);  // vocab-parallel word embedding + positions
    p.largest_block = std::max(p.largest_block, v * h / t + (m.rotary ? 0 : s * h));
    module(v * h / t);
    if (!m.rotary) module(s * h);
  }
  if (last) {
    p.dense += norm_params(m);  // final LayerNorm / RMSNorm
    small(h);
    if (!m.rmsnorm) small(h);
    // Untied output layer, or Megatron's copy of the tied word embedding on the last stage.
    if (!m.tied_embeddings || (pp > 1 && !first)) {
      p.dense += v * h / t;
      p.largest_block = std::max(p.largest_block, v * h / t);
      module(v * h / t);
    }
  }
  if (!frozen_any) p.trainable_dense = p.dense, p.trainable_expert = p.expert;
  return p;
}

MemoryBreakdown stage_memory(const Scenario& sc, int stage) {
  const ModelSpec& m = sc.model;
  const ParallelSpec& par = sc.parallel;
  const ZeroSpec& z = sc.zero;
  const int pp = std::max(1, par.pp);
  stage = std::clamp(stage, 0, pp - 1);
  const double t = std::max(1, par.tp);
  const double dp = std::max(1, par.dp);
  const double expert_dp = expert_data_parallel_size(par);  // tp dp / ep ranks hold the same experts (core/grid.hpp)
  const bool mixed = sc.precision.dtype != Dtype::fp32;
  const double pb = bytes_of(sc.precision.dtype);  // compute copy of params (16-bit or fp32)
  const double gb = pb;                            // gradients in the parameter dtype [Z]
  // [Z] K = 12 for mixed precision (fp32 master, momentum, variance); plain fp32 Adam keeps only
  // momentum and variance (the parameters are their own master): K = 8.
  // Lamb keeps Adam's two moments; Lion keeps one (momentum): K = 8 mixed, 4 in fp32.
  const double kb = sc.optimizer.kind == OptimizerKind::lion ? (mixed ? 8 : 4) : (mixed ? 12 : 8);
  const int zstage = std::clamp(z.stage, 0, 3);

  const StageParameters sp = stage_parameters(sc, stage);
  const double psi = sp.total();
  const double shard = sp.dense / dp + sp.expert / expert_dp;  // ZeRO partition of this GPU
  // What trains (core/finetune.hpp; everything unless something is frozen): gradients, optimizer
  // states and the reduction buffers follow it; frozen parameters keep only their compute copy.
  const double train = sp.trainable();
  const double train_shard = sp.trainable_dense / dp + sp.trainable_expert / expert_dp;
  // Optimizer states sharded by stage >= 1, and by DeepSpeed's BF16_Optimizer at stage 0 (its fp32
  // master and moments are this rank's 1/dp partition: core/pipeline_engine.hpp).
  const double opt_elems = zstage >= 1 || uses_bf16_optimizer(sc) ? train_shard : train;
  MemoryBreakdown mb;

  // Parameters [Z]: full copy for stages 0-2; stage 3 keeps its shard plus what is gathered.
  if (zstage < 3) {
    mb.params = pb * psi;
  } else if (dp == 1 && !z.offload_param) {
    // One rank: each layer's partition is the whole layer, gathered in place (nothing to gather).
    mb.params = pb * shard;
  } else {
    // [DS stage3] a module is all-gathered before its forward/backward; the coordinator prefetches
    // further modules up to prefetch_bucket_size elements, never holding more than
    // max_live_parameters; small tensors below param_persistence_threshold stay whole.
    const double largest = sp.largest_module;
    const double live_cap = std::max(largest, static_cast<double>(z.max_live_parameters));
    // FSDP (core/zero3_placement.hpp): the running block whole and the next one prefetched.
    const double gathered =
        z.engine == ZeroEngine::fsdp
            ? std::min(psi, 2 * sp.largest_block)
            : std::min(psi, std::min(live_cap, largest + static_cast<double>(z.prefetch_bucket_size)));
    mb.params_gathered = pb * (gathered + sp.persistent);
    mb.params = (z.offload_param ? 0 : pb * shard) + mb.params_gathered;
    // ZeRO++ hpZ: each rank also keeps its 1/hpz_partition_size secondary shard of the dense
    // parameters (16-bit, DeepSpeed's ds_secondary_tensor) for the backward's intra-node gathers.
    if (z.hpz() && z.hpz_partition_size < dp && std::fmod(dp, z.hpz_partition_size) == 0)
      mb.params += pb * sp.dense / z.hpz_partition_size;
  }

  // Gradients [Z]: full for stages 0-1, partitioned for 2-3. With optimizer offload (stage >= 2)
  // each reduced partition goes straight to the host fp32 gradient buffer [ZO].
  // dssim's ZeRO-3 engine keeps no 16-bit gradients between layers: each layer group's are reduced
  // (or folded) into the gradient partition after its backward (see temporaries).
  // DeepSpeed's ZeRO-3 keeps the reduced gradients of its shard in a flat buffer of
  // gradient_accumulation_dtype across the micro-batches [DS stage3.py grad_partitions_flat_buffer]:
  // the training dtype by default (engine.py get_data_types), fp32 with zero.grad_accum_dtype: fp32
  // (below). FSDP keeps fp32 sharded gradients (its fp32 sharded parameters' .grad): as the fp32 case.
  if (zstage < 2)
    mb.grads = gb * train;
  else if (zstage == 2)
    mb.grads = z.offload_optimizer ? 0 : gb * train_shard;
  else if (z.model_dtype_grad_partition())
    mb.grads = gb * train_shard;
  // [DS bf16_optimizer.py] DeepSpeed's BF16_Optimizer (bf16, ZeRO 0/1) keeps a persistent fp32
  // gradient buffer (grad_acc_dtype fp32) besides the 16-bit gradients; dssim's torch engine keeps
  // one for the rank's optimizer shard at stage 3 with zero.grad_accum_dtype: fp32 (the reduced
  // gradients land there; FSDP: its fp32 sharded gradients), and at stages
  // 0/1 only where it does not step the 16-bit buckets in place (steps_gradient_buckets_in_place:
  // 1-bit Adam, MoE). Its step reads 16-bit gradients where they are (stage 2: the partition), so
  // it makes no fp32 copy of them (DeepSpeed's ZeRO optimizer does, at the step).
  // BF16_Optimizer's buffer spans the whole flat group (bf16_optimizer.py: zeros_like of
  // bf16_groups_flat), so bf16 at stages 0/1 keeps 4 psi; the engine's is its shard's (the same
  // with dp = 1, the runs measured here).
  const bool fp32_grad_buffer =
      mixed && !z.offload_optimizer &&
      ((zstage == 3 && (z.engine == ZeroEngine::fsdp || z.grad_accum_fp32)) || uses_bf16_optimizer(sc) ||
       (zstage <= 1 && !steps_gradient_buckets_in_place(sc)));
  const bool bf16_optimizer = sc.precision.dtype == Dtype::bf16 && zstage < 2;
  if (fp32_grad_buffer) mb.grads += 4 * (bf16_optimizer ? train : opt_elems);

  // Optimizer states [Z], or on the host with ZeRO-Offload [ZO]: fp32 params + m + v + fp32 grad
  // of the shard = 16 bytes per element (for fp32 training too: the host keeps its own fp32 copy).
  if (z.offload_optimizer) {
    mb.host += (sc.optimizer.kind == OptimizerKind::lion ? 12 : 16) * opt_elems;
    if (z.on_nvme_optimizer(sc.cluster.nvme_bandwidth)) {  // the states on NVMe, the fp32 gradients stay
      const double states = (sc.optimizer.kind == OptimizerKind::lion ? 8 : 12) * opt_elems;
      mb.host -= states;
      mb.nvme += states;
    }
  } else {
    mb.optimizer = kb * opt_elems;
    // 1-bit Adam [DS onebit/adam.py]: fp32 worker error (whole flat buffer) and server error
    // (1/n of it) for the error-compensated compressed all-reduce.
    if (sc.optimizer.kind == OptimizerKind::onebit_adam) mb.optimizer += 4 * train + 4 * train / dp;
  }
  if (zstage == 3 && z.offload_param)  // 16-bit params live on the host (ZeRO-Infinity: on NVMe)
    (z.on_nvme_param(sc.cluster.nvme_bandwidth) ? mb.nvme : mb.host) += pb * shard;

  // Activations [K]: per layer x the stage's layers x in-flight micro-batches.
  const int b = std::max(1, sc.training.micro_batch);
  const double s = m.seq_len, h = m.hidden, v = m.vocab;
  const double sp_div = par.sequence_parallel ? t : 1.0;
  const double sc2 = pb / 2.0;
  const StageLayers range = stage_layers(sc, stage);
  double per_micro_batch = 0;
  for (int i = range.first; i < range.last; ++i)
    per_micro_batch += activation_bytes_per_layer(m, b, par.tp, par.sequence_parallel, sc.recompute,
                                                  is_moe_layer(m, i), sc.precision.dtype);
  // DeepSpeed's partition_activations / cpu_checkpointing (core/scenario.hpp CheckpointingSpec):
  // the full recompute's kept layer inputs split over the TP group (already so with sequence
  // parallelism), and moved to host memory.
  double offloaded_per_micro_batch = 0;
  if (sc.checkpointing.partitions(sc.recompute)) {
    for (int i = range.first; i < range.last; ++i) {
      const double kept = activation_bytes_per_layer(m, b, par.tp, par.sequence_parallel, Recompute::full,
                                                     is_moe_layer(m, i), sc.precision.dtype);
      const double part = par.sequence_parallel ? kept : kept / t;
      per_micro_batch -= kept - part;
      if (sc.checkpointing.offloads(sc.recompute)) {
        per_micro_batch -= part;
        offloaded_per_micro_batch += part;
      }
    }
  }
  const double in_flight = in_flight_micro_batches(pp, stage, par.interleave, micro_batches_of(sc));
  mb.host += offloaded_per_micro_batch * in_flight;
  // [K] 4.3: the embedding dropout mask (1 byte) of every in-flight micro-batch on stage 0.
  if (stage == 0 && m.has_dropout()) per_micro_batch += s * b * h / sp_div;
  // LoRA adapters' saved tensors (core/finetune.hpp); a full recompute keeps only the layer input.
  if (sc.recompute != Recompute::full)
    per_micro_batch += range.count() * lora_activation_bytes_per_layer(m, sc.finetune, b, sc.precision.dtype);
  mb.activations = per_micro_batch * in_flight;
  // [K] 4.3: the last stage keeps the final LayerNorm input and the output-layer input (4 s b h / t
  // with SP) of the one micro-batch whose backward follows its forward.
  if (stage == pp - 1) mb.activations += 4 * sc2 * s * b * h / sp_div;

  // Communication buffers (none for data parallelism on one rank: nothing is reduced or gathered).
  // [DS stage_1_and_2 / stage3] ipg gradient bucket of reduce_bucket_size elements, double-buffered
  // with overlap_comm; stage 0's engine flattens gradients in buckets of the same size (one at a time).
  // FSDP has no such bucket: it reduce-scatters each block's flat gradient, the ZeRO-3 transient
  // below (the block's gradients and, with the reduce-scatter in flight, its input copy).
  const double reduce_bucket = std::min(static_cast<double>(z.reduce_bucket_size), train);
  if (dp > 1 && !(zstage == 3 && z.engine == ZeroEngine::fsdp)) {
    if (zstage == 0)
      mb.comm_buffers += gb * reduce_bucket;
    else
      mb.comm_buffers += gb * reduce_bucket * (z.overlap_comm ? 2 : 1);
    // [DS stage_1_and_2] the updated 16-bit partitions are all-gathered in allgather_bucket_size chunks.
    if (zstage == 1 || zstage == 2)
      mb.comm_buffers += pb * std::min(static_cast<double>(z.allgather_bucket_size), train);
  }
  // [M] pipeline p2p: receive buffers for the forward activation and the backward gradient of one
  // micro-batch, s b h (/t with the scatter-gather optimisation under SP).
  if (pp > 1) mb.comm_buffers += 2 * pb * s * b * h / sp_div;

  // Temporaries: the largest transient of the backward phase, or of the optimizer step, whichever
  // raises the peak more (activations are freed before the step).
  double backward_transient = 0;
  // Cross-entropy on fp32 logits (PyTorch's, as dssim's engine runs it): its backward holds the
  // saved log-softmax, the incoming gradient and the input gradient at once, 3 x 4 b s V / t on
  // the last stage, on top of every activation of the micro-batch (its backward comes first).
  // (Megatron's fused vocab-parallel cross-entropy works in place: about 1 x 4 b s V / t.)
  // Fused linear cross-entropy (ModelSpec::fused_cross_entropy): one chunk's logits, fp32
  // probabilities and gradient (fp16: 8 bytes per logit; bf16 also holds the logits' fp32 cast
  // while the softmax runs: 10; fp32: 12), and the gradients kept from the forward for the
  // backward: the head input's [b s x h] and the head weight's [V / t x h].
  // Fused cross-entropy on 16-bit logits (flash-attn v1.0.9 flash_attn/losses/cross_entropy.py on
  // apex's xentropy kernels: saves the logits and a float log-sum-exp per token, and its backward
  // writes a new gradient unless inplace_backward, off by default): 2 x e b s V / t.
  if (stage == pp - 1) {
    if (m.cross_entropy == ModelSpec::CrossEntropy::fused) {
      backward_transient = 2 * pb * b * s * v / t;
    } else if (m.fused_cross_entropy()) {
      const double chunk = double(fused_cross_entropy_chunk_tokens(int64_t(b * s), int64_t(v / t)));
      // model.cross_entropy_kernel (the engine's one CUDA kernel a chunk): the 16-bit logits and
      // their 16-bit gradient, and a float loss per row; no fp32 copy. On an H100, GPT 1.3B 8 x 1
      // bf16 peaked at 44.89 GiB with the kernel against 46.07 GiB with the fp32 chunk (the A/B
      // of docs/torch-backend.md, issue 15).
      const double per_logit = m.cross_entropy_kernel              ? 2 * pb
                               : sc.precision.dtype == Dtype::bf16 ? 8.0 + pb
                                                                   : 4.0 + 2 * pb;
      backward_transient = per_logit * chunk * v / t + (m.cross_entropy_kernel ? 4 * chunk : 0) +
                           pb * (b * s * h + v / t * h);
    } else {
      backward_transient = 12.0 * b * s * v / t;
    }
  }
  // ZeRO-3: the 16-bit gradients of the layer groups in backward at once, before the reduce-scatter
  // (or, on one rank, the fold into the gradient partition) frees them (none where backward
  // accumulates into the partition itself: zero3_backward_into_partition): at the head's backward, the last
  // layer's group and the tied embedding's (the largest module and two layers); with a
  // reduce-scatter in flight, its input copy too.
  if (zstage == 3 && !zero3_backward_into_partition(sc)) {
    const double grads_at_once = sc.finetune.freezes_anything()
                                     ? 3 * layer_trainable_params(m, sc.finetune, t)  // only trainable gradients
                                     : sp.largest_module + 2 * dense_layer_params(m) / t;
    backward_transient += gb * grads_at_once * (dp > 1 ? 2 : 1);
  }
  // Recompute working set: the layer being recomputed materialises its full activations (full) or
  // its attention core (selective) for one micro-batch.
  if (sc.recompute != Recompute::none) {
    const bool moe = range.count() > 0 && m.is_moe();
    const double full = activation_bytes_per_layer(m, b, par.tp, par.sequence_parallel,
                                                   Recompute::none, moe, sc.precision.dtype);
    const double kept = activation_bytes_per_layer(m, b, par.tp, par.sequence_parallel, sc.recompute,
                                                   moe, sc.precision.dtype);
    backward_transient = std::max(backward_transient, full - kept);
  }
  // The engine's step reads 16-bit gradients in place; with optimizer.fused_step false (the step
  // before issue 15, DeepSpeed's ZeRO optimizer too) it runs on an fp32 copy of stage 2's partition.
  // 1-bit Adam's compressed-phase update holds its denominator's two fp32 temporaries, one piece of
  // kOnebitStepChunkElements at a time.
  const double step_transient =
      (mixed && !z.offload_optimizer && !fp32_grad_buffer && !sc.optimizer.fused_step) ? 4 * opt_elems
      : sc.optimizer.onebit_compressed(zstage) ? 8 * std::min(opt_elems, double(kOnebitStepChunkElements))
                                               : 0;
  mb.temporaries = std::max(backward_transient, step_transient - mb.activations);
  return mb;
}

bool steps_gradient_buckets_in_place(const Scenario& sc) {
  return sc.optimizer.fused_step && sc.zero.stage <= 1 && !sc.zero.offload_optimizer &&
         sc.optimizer.kind != OptimizerKind::onebit_adam && !sc.model.is_moe();
}

bool zero3_backward_into_partition(const Scenario& sc) {
  return sc.zero.model_dtype_grad_partition() && sc.parallel.dp == 1 && !sc.zero.offload_param &&
         !sc.finetune.freezes_anything() && !(sc.parallel.tp > 1 && sc.parallel.sequence_parallel);
}

MemoryBreakdown peak_memory(const Scenario& sc) {
  const int pp = std::max(1, sc.parallel.pp);
  MemoryBreakdown best = stage_memory(sc, 0);
  for (int st = 1; st < pp; ++st) {
    MemoryBreakdown cur = stage_memory(sc, st);
    if (cur.total() > best.total()) best = cur;
  }
  return best;
}

}  // namespace dssim
