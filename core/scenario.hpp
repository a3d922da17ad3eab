// The Scenario: everything dssim needs to know about one training job, fully resolved.
// Units are SI everywhere: bytes, seconds, FLOP/s, bytes/s. Presets (GPUs, clusters, models) are
// YAML files under scenarios/; by the time a Scenario exists they have been merged in.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dssim {

struct ModelSpec {
  std::string name;          // preset name or "custom"
  int layers = 0;
  int hidden = 0;            // h
  int heads = 0;             // a
  int ffn_hidden = 0;        // MLP inner size, default 4h
  int vocab = 0;             // V (padded as the scenario says)
  int seq_len = 0;           // s
  // Mixture of experts (0 experts = dense).
  int experts = 0;           // experts per MoE layer
  int top_k = 1;
  int moe_every = 1;         // every k-th layer is a MoE layer (1 = all, 2 = alternate, as in DeepSpeed-MoE)
  double capacity_factor = 1.0;
  // DeepSpeed-MoE's TopKGate (deepspeed/moe/sharded_moe.py, layer.MoE defaults): capacity
  // max(ceil(top_k * tokens / experts * capacity_factor), min_capacity) slots per expert and
  // source rank; tokens over it dropped (drop_tokens false: capacity = the busiest expert's load,
  // a maximum over the expert-parallel group); random token selection picks which (use_rts,
  // top-1); the gate's input jittered (Jitter) or its argmax sampled (RSample, top-1); the
  // load-balancing loss l_aux added to the training loss times moe_loss_coeff (Megatron-DeepSpeed
  // --moe-loss-coeff).
  int min_capacity = 4;
  bool drop_tokens = true;
  bool use_rts = true;
  enum class NoisyGate { none, jitter, rsample } noisy_gate_policy = NoisyGate::none;
  double moe_loss_coeff = 0.01;
  bool tied_embeddings = true;   // false: a separate LM head [V, h] on the last stage
  // Llama-shaped layers (defaults = the GPT layout of Megatron eq. 2).
  int kv_heads = 0;              // key/value heads (GQA / MQA); 0 = heads (multi-head attention)
  bool swiglu = false;           // MLP: SwiGLU (gate, up [f, h], down [h, f]) instead of GELU (up, down)
  bool rmsnorm = false;          // norms: RMSNorm (weight only) instead of LayerNorm (weight + bias)
  bool rotary = false;           // positions: rotary (no wpe table; elementwise on q and k) instead of learned
  bool bias = true;              // biases in the linear layers (Llama: none)
  // How the Llama-shaped elementwise ops run (`model.elementwise`): `fused` (default) one kernel per
  // RMSNorm, rotary, SwiGLU, as Megatron's and dssim's engine run them; `eager` the composite
  // PyTorch ops of a hand-written Llama block without torch.compile (torchtitan's RMSNorm with its
  // fp32 casts, complex-number rotary, silu then mul, repeat_kv's copies for GQA), kernel by
  // kernel (core/model.cpp, docs/simulator.md "Eager elementwise ops"). LayerNorm and GeLU are one
  // native PyTorch kernel either way.
  bool eager_elementwise = false;
  // Attention kernel: fused flash attention (s x s scores never reach HBM, nothing of size s^2
  // kept for backward) or Megatron-2021 style unfused softmax(QK^T)V (batched GEMMs, scores
  // written to HBM and kept: Korthikanti's 5as/h activation term).
  bool flash_attention = true;
  // Loss (`model.cross_entropy`):
  //  - `unfused`: PyTorch's cross-entropy on the whole micro-batch's fp32 logits (Megatron's and
  //    PyTorch's default);
  //  - `fused`: one kernel on the 16-bit logits in each pass, the loss and log-sum-exp forward and
  //    the 16-bit logits' gradient backward, no fp32 [tokens x V] tensor (flash-attn's
  //    CrossEntropyLoss, apex's xentropy: MPT / llm-foundry's default `fused_crossentropy`);
  //  - `fused_linear`: the LM head's GEMM and the cross-entropy fused over token chunks (as
  //    Liger-Kernel's FusedLinearCrossEntropy): the logits' and the head's gradients are computed
  //    in the forward, chunk by chunk, and no [tokens x V] tensor is kept (core/model.hpp
  //    fused_cross_entropy_chunk_tokens; backends/torch/fused_cross_entropy.*).
  enum class CrossEntropy { unfused, fused, fused_linear } cross_entropy = CrossEntropy::unfused;
  bool fused_cross_entropy() const { return cross_entropy == CrossEntropy::fused_linear; }
  // `model.cross_entropy_kernel` (fused_linear only): each chunk's cross-entropy as one CUDA kernel
  // on the 16-bit logits (dssim's engine on GPUs, backends/torch/cross_entropy_cuda.cu): no fp32
  // copy of the chunk's logits (core/memory.cpp). false: ATen's ops through fp32.
  bool cross_entropy_kernel = false;
  // `model.gemm_epilogues`: the block's bias, GELU, residual and bias gradients in the GEMMs'
  // epilogues and q, k, v dense (dssim's torch engine on GPUs with cuBLASLt,
  // backends/torch/gemm_epilogues.hpp; Megatron and DeepSpeed run them as separate kernels). It
  // changes only GELU MLPs with biases (block_epilogues()); elsewhere it has no effect.
  bool gemm_epilogues = false;
  bool block_epilogues() const { return gemm_epilogues && !swiglu && bias; }
  // Dropout probability of the hidden, attention and embedding dropouts (Megatron applies one
  // value to all). 0 = none (modern LLM pre-training, and dssim's torch engine); > 0 keeps
  // Korthikanti's 1-byte masks and runs the dropout kernels.
  double dropout = 0.0;
  bool has_dropout() const { return dropout > 0; }
  bool is_moe() const { return experts > 0; }
  int kv_heads_or_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int moe_layers() const { return is_moe() ? layers / moe_every : 0; }
  // Expert slots per expert and source rank for `tokens` routed tokens on a rank (drop_tokens).
  int64_t expert_capacity(int64_t tokens) const;
};
const char* to_string(ModelSpec::NoisyGate);
const char* to_string(ModelSpec::CrossEntropy);

struct TrainingSpec {
  int64_t global_batch = 0;  // sequences per iteration (DeepSpeed train_batch_size)
  int micro_batch = 0;       // sequences per GPU per micro-step (train_micro_batch_size_per_gpu)
  int grad_accum = 0;        // micro-steps per iteration (gradient_accumulation_steps)
  double tokens_to_train = 0;  // 0 = not given
  double gradient_clipping = 0;  // 0 = off
  uint64_t seed = 1234;
};

enum class PipelineEngine { megatron, deepspeed };
const char* to_string(PipelineEngine);

struct ParallelSpec {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  bool sequence_parallel = false;
  int interleave = 1;              // virtual pipeline stages (model chunks) per rank; 1 = plain 1F1B
  std::vector<int> partition;      // layers per pipeline stage; empty = uniform
  // How the loader fills `partition` when it is not given (core/pipeline_partition.hpp): uniform,
  // parameters, type:REGEX, megatron; empty = the default (default_partition_method), which the
  // loader writes here when it produced a non-uniform partition.
  std::string partition_method;
  // Megatron's scatter/gather optimization (Narayanan et al. 2021, section 4.1): with tp > 1 each
  // TP rank sends only its 1/tp slice of the activation across nodes, and the receiving stage
  // all-gathers it over NVLink. DeepSpeed's pipeline engine does not (default off).
  bool scatter_gather = false;
  // Which engine runs the pipeline (core/pipeline_engine.hpp, docs/simulator.md "Pipeline
  // engines"): Megatron-LM's schedules (p2p on its own stream, scatter/gather, interleaving) or
  // DeepSpeed's PipelineEngine (TrainSchedule, blocking p2p on the compute stream, gradient
  // reduction after the schedule). The loader picks deepspeed for a ds_config with a pipeline
  // section or with pp > 1, megatron otherwise (docs/scenario-format.md).
  PipelineEngine pipeline_engine = PipelineEngine::megatron;
  // DeepSpeed's pipeline.pipe_partitioned / grad_partitioned (default true; used by the deepspeed
  // engine with tp > 1): each TP rank sends its 1/tp slice of the activation / its gradient and
  // the receiver all-gathers it over the TP group (PartitionedTensor, runtime/pipe/engine.py).
  bool pipe_partitioned = true;
  bool grad_partitioned = true;
  int world() const { return tp * pp * dp; }
};

// Which engine runs ZeRO-3: DeepSpeed's (per-submodule fetches, prefetch bucket) or PyTorch
// FSDP's (one all-gather / reduce-scatter per wrapped block); core/zero3_placement.hpp.
enum class ZeroEngine { deepspeed, fsdp };
const char* to_string(ZeroEngine);

struct ZeroSpec {
  int stage = 0;                   // 0..3
  ZeroEngine engine = ZeroEngine::deepspeed;
  bool offload_optimizer = false;  // optimizer states + step on the host (ZeRO-Offload)
  bool offload_param = false;      // stage 3 only: parameters live on the host
  // ZeRO-Infinity (DeepSpeed offload_optimizer / offload_param "device": "nvme"): the offloaded
  // optimizer states / parameters live on NVMe, swapped through host buffers at
  // cluster.nvme_bandwidth (core/device_model.cpp).
  bool nvme_optimizer = false;
  bool nvme_param = false;
  // What is priced: NVMe only where the cluster states its bandwidth (else modelled as cpu, warned).
  bool on_nvme_optimizer(double nvme_bandwidth) const { return offload_optimizer && nvme_optimizer && nvme_bandwidth > 0; }
  bool on_nvme_param(double nvme_bandwidth) const { return offload_param && nvme_param && nvme_bandwidth > 0; }
  bool overlap_comm = true;
  int64_t reduce_bucket_size = 500000000;     // elements (DeepSpeed's unit)
  int64_t allgather_bucket_size = 500000000;  // elements
  int64_t prefetch_bucket_size = 50000000;    // elements (stage3_prefetch_bucket_size)
  int64_t param_persistence_threshold = 100000;  // elements (stage3_param_persistence_threshold)
  int64_t max_live_parameters = 1000000000;   // elements (stage3_max_live_parameters)
  // ZeRO++ (Wang et al. 2023; DeepSpeed zero_quantized_weights / zero_quantized_gradients /
  // zero_hpz_partition_size), stage 3 only (docs/simulator.md, "ZeRO++").
  bool quantized_weights = false;    // qwZ: parameter all-gathers move int8 + fp32 block scales
  bool quantized_gradients = false;  // qgZ: int4 hierarchical all-to-all reduce-scatter of gradients
  int hpz_partition_size = 1;        // hpZ: secondary parameter partition over this many DP ranks (1 = off)
  bool hpz() const { return stage == 3 && hpz_partition_size > 1; }
  // `zero.grad_accum_dtype` (ds_config data_types.grad_accum_dtype): the dtype of DeepSpeed ZeRO-3's
  // gradient partitions, which hold the reduced gradients across micro-batches. `model` (default,
  // DeepSpeed's with ZeRO: engine.py get_data_types) the training dtype; `fp32` an fp32 buffer (4
  // bytes per parameter of the shard). Stage 3 with the optimizer on the GPU only (offload keeps
  // the host's fp32 buffer; stages 0-2 and FSDP have their own rules, core/memory.cpp).
  bool grad_accum_fp32 = false;
  // Stage 3 on DeepSpeed's engine, optimizer on the GPU, gradient partition in the training dtype.
  bool model_dtype_grad_partition() const {
    return stage == 3 && engine == ZeroEngine::deepspeed && !offload_optimizer && !grad_accum_fp32;
  }
};

enum class Dtype { fp32, fp16, bf16 };
const char* to_string(Dtype);
inline int bytes_of(Dtype d) { return d == Dtype::fp32 ? 4 : 2; }

struct LossScaleSpec {               // DeepSpeed fp16 block
  double loss_scale = 0;             // 0 = dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1;
};

struct PrecisionSpec {
  Dtype dtype = Dtype::bf16;         // compute / 16-bit parameter dtype; fp32 = no mixed precision
  LossScaleSpec loss_scale;          // used when dtype == fp16
  // DeepSpeed communication_data_type: the dtype the data-parallel gradient reduction moves
  // (gradients are cast to it before the all-reduce / reduce-scatter); unset = dtype.
  std::optional<Dtype> communication_dtype;
  int communication_bytes() const { return bytes_of(communication_dtype.value_or(dtype)); }
};

// lamb: momentum and variance as Adam (plus a per-tensor trust ratio); lion: one momentum. Both are
// stepped at Adam's cost (an upper bound: their steps read and write no more state than Adam's).
enum class OptimizerKind { adamw, onebit_adam, lamb, lion };
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::adamw;
  double lr = 1e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t freeze_step = 0;           // 1-bit Adam: warm-up steps with full-precision Adam
  int64_t step = 0;                  // which training step to report (1-bit Adam compresses after freeze_step)
  // dssim's torch engine: the step in one pass over the gradients where they lie (issue 15; no fp32
  // gradient buffer at ZeRO 0/1, none copied at stage 2). false: the step before it, as the
  // records measured until 2026-12-05 ran it (the gradients folded into an fp32 buffer of the
  // shard, AdamW, the clear and the 16-bit copy pass by pass through libtorch's ops).
  bool fused_step = true;
  // The reported step is in 1-bit Adam's compressed phase (ZeRO-0 only, as DeepSpeed's OnebitAdam).
  bool onebit_compressed(int zero_stage) const {
    return kind == OptimizerKind::onebit_adam && zero_stage == 0 && step >= freeze_step;
  }
};
const char* to_string(OptimizerKind);

// Fine-tuning (core/finetune.hpp): which parameters train. `full` trains every parameter except
// the parts named in `freeze`; `lora` freezes the whole base model and trains low-rank adapters
// (Hu et al. 2021, arXiv:2106.09685; Hugging Face PEFT's LoraConfig) on the `targets` linears:
// W x + (alpha / rank) B A dropout(x), A [rank, in], B [out, rank].
enum class LoraTarget { q, k, v, qkv, o, mlp_gate, mlp_up, mlp_down, lm_head };
const char* to_string(LoraTarget);
struct FinetuneSpec {
  enum class Method { full, lora } method = Method::full;
  int rank = 8;                      // PEFT's default r
  double alpha = 8;                  // PEFT's default lora_alpha
  double dropout = 0;                // lora_dropout (PEFT default 0): a dropped copy of x per adapter
  std::vector<LoraTarget> targets;   // empty: PEFT's default for the model's shape (core/finetune.cpp)
  // method full: base parts that do not train (frozen: no gradient, no optimizer state, no reduction)
  bool freeze_embeddings = false, freeze_norms = false, freeze_attention = false, freeze_mlp = false,
       freeze_head = false;
  bool declared = false;             // the scenario has a finetune section (a fine-tuning job)
  bool lora() const { return method == Method::lora; }
  bool freezes_anything() const {
    return lora() || freeze_embeddings || freeze_norms || freeze_attention || freeze_mlp || freeze_head;
  }
};

// none: every activation kept. selective: Korthikanti's, the attention core recomputed. full: each
// layer's forward again from its input. selective_op: PyTorch's op-level selective checkpointing
// with torchtitan's policy (torchtitan parallelize_llama.py `_custom_policy`, selective_ac_option
// "op"): in each block, the outputs of SDPA and of every odd-numbered matmul (q, v, mlp gate /
// GeLU's up, down: 1st, 3rd, 5th, 7th) are saved, the rest of the block (k, the attention output
// projection, SwiGLU's up, norms, rotary, activations, residuals) is recomputed in backward
// (core/model.hpp LayerOp::op_sac_recompute, core/memory.cpp). With tp > 1 the recomputed TP
// all-reduces are not repeated in the Program (full recompute's are).
enum class Recompute { none, selective, full, selective_op };
const char* to_string(Recompute);

// DeepSpeed's activation checkpointing options (deepspeed/runtime/activation_checkpointing/
// checkpointing.py, the ds_config "activation_checkpointing" block), for layers checkpointed with
// deepspeed.checkpointing.checkpoint (full recompute): the kept layer inputs split over the
// tensor-parallel group and all-gathered before the recompute (partition_activations), and those
// partitions kept in host memory, copied out in forward and back in backward
// (cpu_checkpointing; DeepSpeed offloads only partitioned checkpoints). contiguous_memory_optimization
// copies the checkpoints into one preallocated buffer against fragmentation, which dssim's memory
// model does not count: accepted, no effect on bytes or time.
struct CheckpointingSpec {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  // What applies to a scenario: full recompute, and cpu_checkpointing only with partitioning.
  bool partitions(Recompute r) const { return partition_activations && r == Recompute::full; }
  bool offloads(Recompute r) const { return partitions(r) && cpu_checkpointing; }
};

struct GpuSpec {
  std::string name;
  double memory_bytes = 0;           // HBM capacity
  double hbm_bandwidth = 0;          // bytes/s
  double peak_flops_16 = 0;          // dense fp16/bf16 tensor-core FLOP/s
  double peak_flops_32 = 0;          // fp32 FLOP/s used when precision is fp32 (TF32 off)
  double nvlink_bandwidth = 0;       // bytes/s per GPU per direction
  double nvlink_latency = 0;         // seconds
  // Fraction of the NVLink datasheet bandwidth NCCL's ring kernels reach (nccl-tests bus
  // bandwidth / link bandwidth); what collectives and transfers over NVLink actually get.
  double nvlink_efficiency = 1.0;
  double nvlink_achieved() const { return nvlink_bandwidth * nvlink_efficiency; }
  double pcie_bandwidth = 0;         // bytes/s per direction, host <-> device
  double pcie_latency = 0;
  // Device-model efficiencies (fraction of peak reached), documented with sources in the YAML.
  double gemm_efficiency = 0.8;      // large-GEMM plateau
  double gemm_half_flops = 5e9;      // GEMM FLOPs at which efficiency is half its plateau
  double attention_efficiency = 0.6; // fused attention plateau
  double memory_efficiency = 0.85;   // fraction of HBM bandwidth memory-bound kernels reach
  double kernel_launch = 4e-6;       // seconds per kernel
  // Board power: the preset's TDP (the default power limit of the SXM part) and the limit the run
  // set (nvidia-smi -pl; 0 = none, the GPU runs at its TDP). A limit below the TDP lowers the
  // sustained SM clock of compute-bound kernels (DeviceModel::power_limit_clock_factor).
  double tdp = 0;                    // watts; 0 = not stated
  double power_limit = 0;            // watts; 0 = no limit
  bool operator==(const GpuSpec&) const = default;
};

struct ClusterSpec {
  std::string name;
  GpuSpec gpu;
  int nodes = 1;
  int gpus_per_node = 8;
  std::string intra_node = "nvswitch";  // nvswitch | nvlink | pcie
  int nics_per_node = 8;
  double nic_bandwidth = 25e9;       // bytes/s per NIC per direction (200 Gb/s HDR = 25e9)
  double nic_latency = 2e-6;         // seconds, NIC to NIC through one switch
  std::string topology = "fat_tree";
  int fat_tree_levels = 2;
  double oversubscription = 1.0;     // 1 = non-blocking
  double switch_latency = 0.5e-6;    // per switch hop
  // Host CPU vendor, intel | amd: NCCL's tuner charges inter-node ring steps a network-proxy
  // overhead of 1 us on Intel hosts and 2 us on AMD hosts (core/collective_model.cpp).
  std::string host_cpu = "intel";
  double host_memory_bytes = 1024e9; // per node
  double host_memory_bandwidth = 100e9;  // bytes/s per node (CPU optimizer step is bound by it)
  // NVMe read (and write) bandwidth per node for ZeRO-Infinity's swapping; 0 = not stated (NVMe
  // offload then refused, naming this key).
  double nvme_bandwidth = 0;
  // A measured device profile (core/device_profile.hpp, written by `dssim calibrate`) the device
  // model uses in place of the GPU preset's curves; empty = presets only.
  std::string device_profile;
  int world() const { return nodes * gpus_per_node; }
  bool operator==(const ClusterSpec&) const = default;
};

// A what-if of the simulator backend (core/what_if.hpp parses the spec, backends/sim applies it;
// docs/simulator.md "What-ifs").
struct WhatIf {
  enum class Kind { SlowGpu, Link, Nic, Node, Noise, Background };
  Kind kind = Kind::SlowGpu;
  std::string spec;            // as written, for messages and the report
  std::vector<int> ranks;      // SlowGpu: the slow GPUs
  double factor = 1.0;         // SlowGpu / Link / Nic / Node: speed or bandwidth x factor;
                               // Noise: coefficient of variation (0.05 = 5 %); Background: fraction taken
  std::string link;            // Link: a link's name as the report lists it, without _UP / _DOWN
  int node = -1, nic = -1;     // Nic: node and NIC index; Node: node
};

// Failures and checkpoints over the whole run (core/reliability.hpp). Zeros mean "derive it".
struct ReliabilitySpec {
  bool declared = false;               // the scenario has a reliability section
  // Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on
  // 16,384 H100 GPUs.
  double failures_per_gpu_hour = 419.0 / (54.0 * 24.0 * 16384.0);
  double failures_per_node_day = 0;    // when given, replaces failures_per_gpu_hour
  double checkpoint_bytes = 0;         // whole checkpoint; 0 = from the memory model
  double write_bandwidth = 2e12;       // aggregate checkpoint write bandwidth, bytes/s (Llama 3's
                                       // Tectonic storage: 2 TB/s sustained)
  double read_bandwidth = 0;           // restore; 0 = write_bandwidth
  double restore_seconds = 0;          // 0 = checkpoint_bytes / read_bandwidth
  double restart_seconds = 600;        // detection, rescheduling, process and NCCL start-up
  double checkpoint_interval = 0;      // seconds of training between checkpoints; 0 = auto (Daly)
  int samples = 400;                   // Monte-Carlo jobs
  uint64_t seed = 1;
};

struct Scenario {
  std::string name;
  std::string source;                // file it came from
  ModelSpec model;
  TrainingSpec training;
  ParallelSpec parallel;
  ZeroSpec zero;
  PrecisionSpec precision;
  OptimizerSpec optimizer;
  Recompute recompute = Recompute::none;
  CheckpointingSpec checkpointing;
  FinetuneSpec finetune;
  ClusterSpec cluster;
  std::vector<WhatIf> what_if;       // the scenario's what_if list (simulator backend)
  ReliabilitySpec reliability;
  std::vector<std::string> warnings; // e.g. ds_config keys dssim does not use
};

}  // namespace dssim
