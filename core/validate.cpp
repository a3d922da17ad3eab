#include "core/validate.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>
#include "core/pipeline_engine.hpp"
#include "core/scenario_loader.hpp"

namespace dssim {

namespace {

std::string divisors_of(int64_t n, int64_t limit = 0) {
  std::ostringstream o;
  bool first = true;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0 || (limit > 0 && d > limit)) continue;
    o << (first ? "" : ", ") << d;
    first = false;
  }
  return o.str();
}

struct Checker {
  const Scenario& s;
  const KeyLocator& where;
  std::string at(const std::string& key) const { return where ? where(key) : std::string(); }
  [[noreturn]] void fail(const std::string& msg) const {
    throw ConfigError(s.source.empty() ? msg : s.source + ": " + msg);
  }
  void positive(const std::string& key, double v, const std::string& fix) const {
    if (!(v > 0)) {
      std::ostringstream o;
      o << key << at(key) << " must be positive, got " << v << "; " << fix;
      fail(o.str());
    }
  }
  void non_negative(const std::string& key, double v) const {
    if (!(v >= 0)) {
      std::ostringstream o;
      o << key << at(key) << " must not be negative, got " << v;
      fail(o.str());
    }
  }
  void fraction(const std::string& key, double v) const {
    if (!(v > 0 && v <= 1)) {
      std::ostringstream o;
      o << key << at(key) << " is a fraction of peak: it must be in (0, 1], got " << v;
      fail(o.str());
    }
  }
};

}  // namespace

void resolve_batch(TrainingSpec& t, int dp) {
  // DeepSpeed runtime/config.py, _set_batch_related_parameters and _batch_assertion.
  int64_t train_batch = t.global_batch, micro = t.micro_batch, acc = t.grad_accum;
  const bool g = train_batch != 0, m = micro != 0, a = acc != 0;
  if (g && m && a) {
  } else if (g && m) {
    acc = micro > 0 ? train_batch / micro / dp : 0;
  } else if (g && a) {
    micro = acc > 0 ? train_batch / dp / acc : 0;
  } else if (m && a) {
    train_batch = micro * acc * dp;
  } else if (g) {
    acc = 1;
    micro = train_batch / dp;
  } else if (m) {
    train_batch = micro * dp;
    acc = 1;
  } else {
    throw ConfigError(
        "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided: set "
        "training.global_batch or training.micro_batch (DeepSpeed train_batch_size / "
        "train_micro_batch_size_per_gpu)");
  }
  const std::string hint =
      " (training.global_batch, training.micro_batch, training.grad_accum over dp = " +
      std::to_string(dp) + " data-parallel ranks)";
  if (train_batch <= 0)
    throw ConfigError("Train batch size: " + std::to_string(train_batch) + " has to be greater than 0" + hint +
                      "; training.global_batch must be at least dp = " + std::to_string(dp));
  if (micro <= 0)
    throw ConfigError("Micro batch size per gpu: " + std::to_string(micro) + " has to be greater than 0" + hint +
                      "; make training.global_batch at least dp * grad_accum = " + std::to_string(dp * std::max<int64_t>(acc, 1)));
  if (acc <= 0)
    throw ConfigError("Gradient accumulation steps: " + std::to_string(acc) + " has to be greater than 0" + hint +
                      "; make training.global_batch at least micro_batch * dp = " + std::to_string(micro * dp));
  if (train_batch != micro * acc * dp) {
    std::ostringstream o;
    o << "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
         "gradient_acc_step * world_size "
      << train_batch << " != " << micro << " * " << acc << " * " << dp << hint
      << "; give two of the three and dssim derives the third";
    if (g && m && micro * dp > 0 && train_batch % (micro * dp) == 0)
      o << " (here grad_accum = " << train_batch / (micro * dp) << ")";
    throw ConfigError(o.str());
  }
  t.global_batch = train_batch;
  t.micro_batch = static_cast<int>(micro);
  t.grad_accum = static_cast<int>(acc);
}

void validate(const Scenario& s) { validate(s, KeyLocator{}); }

void validate(const Scenario& s, const KeyLocator& where) {
  const Checker c{s, where};
  const auto& m = s.model;
  const auto& p = s.parallel;
  const auto& t = s.training;
  const auto& z = s.zero;
  const auto& cl = s.cluster;
  const auto& g = cl.gpu;
  auto at = [&](const std::string& k) { return c.at(k); };
  std::ostringstream o;
  auto fail = [&]() { c.fail(o.str()); };

  // --- model
  auto presets = [](const char* kind) {
    std::string r;
    for (auto& n : list_presets(kind)) r += (r.empty() ? "" : ", ") + n;
    return r;
  };
  const bool model_incomplete = m.layers <= 0 || m.hidden <= 0 || m.heads <= 0 || m.vocab <= 0 || m.seq_len <= 0;
  const std::string preset_fix =
      model_incomplete ? "set it in the model section or use model.preset (" + presets("models") + ")" : "";
  c.positive("model.layers", m.layers, preset_fix);
  c.positive("model.hidden", m.hidden, preset_fix);
  c.positive("model.heads", m.heads, preset_fix);
  c.positive("model.ffn_hidden", m.ffn_hidden, "omit it for the default 4 * hidden");
  c.positive("model.vocab", m.vocab, preset_fix);
  c.positive("model.seq_len", m.seq_len, preset_fix);
  if (m.hidden % m.heads != 0) {
    o << "model.hidden (" << m.hidden << ")" << at("model.hidden") << " is not divisible by model.heads (" << m.heads
      << ")" << at("model.heads") << "; the head size hidden / heads must be an integer";
    fail();
  }
  // Grouped-query attention: each key/value head serves heads / kv_heads query heads.
  if (m.kv_heads < 0 || m.kv_heads > m.heads || (m.kv_heads > 0 && m.heads % m.kv_heads != 0)) {
    o << "model.kv_heads (" << m.kv_heads << ")" << at("model.kv_heads") << " does not divide model.heads (" << m.heads
      << ")" << at("model.heads") << "; grouped-query attention shares each key/value head among heads / kv_heads "
      << "query heads: use one of " << divisors_of(m.heads, m.heads) << " (kv_heads = heads is multi-head attention, "
      << "1 is multi-query attention), or omit it";
    fail();
  }
  if (!(m.dropout >= 0 && m.dropout < 1)) {
    o << "model.dropout (" << m.dropout << ")" << at("model.dropout")
      << " is a probability: it must be in [0, 1); Megatron's GPT default is 0.1, 0 turns dropout off";
    fail();
  }
  if (m.cross_entropy_kernel && !m.fused_cross_entropy()) {
    o << "model.cross_entropy_kernel" << at("model.cross_entropy_kernel") << " is the fused linear cross-entropy's "
      << "chunk kernel, but model.cross_entropy is " << to_string(m.cross_entropy) << at("model.cross_entropy")
      << "; set model.cross_entropy: fused_linear or drop model.cross_entropy_kernel";
    fail();
  }
  if (m.experts < 0) c.non_negative("model.experts", m.experts);
  if (m.is_moe()) {
    if (m.top_k < 1 || m.top_k > m.experts) {
      o << "model.top_k (" << m.top_k << ")" << at("model.top_k") << " must be between 1 and model.experts (" << m.experts << ")";
      fail();
    }
    if (m.moe_every < 1 || m.moe_every > m.layers) {
      o << "model.moe_every (" << m.moe_every << ")" << at("model.moe_every") << " must be between 1 and model.layers ("
        << m.layers << "): 1 makes every layer MoE, 2 every other layer (DeepSpeed-MoE)";
      fail();
    }
    c.positive("model.capacity_factor", m.capacity_factor, "DeepSpeed's default is 1.0");
  }

  // --- parallel degrees
  c.positive("parallel.tp", p.tp, "1 = no tensor parallelism");
  c.positive("parallel.pp", p.pp, "1 = no pipeline parallelism");
  c.positive("parallel.dp", p.dp, "omit it to derive dp = GPUs / (tp * pp)");
  c.positive("parallel.ep", p.ep, "1 = no expert parallelism");
  c.positive("parallel.interleave", p.interleave, "1 = plain 1F1B");
  // The pipeline engine's own rules (core/pipeline_engine.cpp): deepspeed refuses Megatron's options.
  if (const std::string e = pipeline_engine_error(s, [&](const std::string& k) { return c.at(k); }); !e.empty()) c.fail(e);
  c.positive("cluster.nodes", cl.nodes, "");
  c.positive("cluster.gpus_per_node", cl.gpus_per_node, "");
  // 64-bit products: tp * pp * dp of int32 degrees overflows int (dp = 100000000 read 2105032704).
  const int64_t world = int64_t(p.tp) * p.pp * p.dp, tp_pp = int64_t(p.tp) * p.pp;
  const int64_t cluster_world = int64_t(cl.nodes) * cl.gpus_per_node;
  if (world != cluster_world) {
    o << "parallel: tp * pp * dp = " << p.tp << " * " << p.pp << " * " << p.dp << " = " << world
      << " but the cluster has " << cluster_world << " GPUs (cluster.nodes " << cl.nodes << at("cluster.nodes")
      << " x cluster.gpus_per_node " << cl.gpus_per_node << at("cluster.gpus_per_node") << "); ";
    if (cluster_world % tp_pp == 0)
      o << "set parallel.dp: " << cluster_world / tp_pp << " (or omit dp to derive it)";
    else
      o << "tp * pp = " << tp_pp << " does not divide " << cluster_world << " GPUs: change tp or pp";
    if (world % cl.gpus_per_node == 0)
      o << ", or set cluster.nodes: " << world / cl.gpus_per_node;
    fail();
  }
  if (m.heads % p.tp != 0) {
    o << "model.heads (" << m.heads << ")" << at("model.heads") << " is not divisible by parallel.tp (" << p.tp << ")"
      << at("parallel.tp") << "; Megatron splits attention heads across tensor-parallel ranks: use a tp that divides "
      << m.heads << " (" << divisors_of(m.heads, 64) << ")";
    fail();
  }
  // Megatron-LM splits the key/value heads (num_query_groups) across the tensor-parallel ranks too
  // (megatron/core/transformer/attention.py: divide(num_query_groups, tp) asserts): no replication.
  if (m.kv_heads_or_heads() % p.tp != 0) {
    o << "model.kv_heads (" << m.kv_heads_or_heads() << ")" << at("model.kv_heads") << " is not divisible by parallel.tp ("
      << p.tp << ")" << at("parallel.tp") << "; Megatron splits the key/value heads across tensor-parallel ranks "
      << "(it does not replicate them): use a tp that divides " << m.kv_heads_or_heads() << " ("
      << divisors_of(m.kv_heads_or_heads(), 64) << ")";
    fail();
  }
  if (m.ffn_hidden % p.tp != 0) {
    o << "model.ffn_hidden (" << m.ffn_hidden << ")" << at("model.ffn_hidden") << " is not divisible by parallel.tp ("
      << p.tp << ")" << at("parallel.tp") << "; the MLP is split column-wise across tensor-parallel ranks";
    fail();
  }
  if (p.sequence_parallel && p.tp == 1) {
    o << "parallel.sequence_parallel" << at("parallel.sequence_parallel")
      << " requires tensor parallelism (tp > 1): sequence parallelism splits the layer norms and dropouts across "
         "the tensor-parallel group; set parallel.tp > 1 or sequence_parallel: false";
    fail();
  }

  // --- pipeline partition
  if (!p.partition.empty()) {
    if (static_cast<int>(p.partition.size()) != p.pp) {
      o << "parallel.partition" << at("parallel.partition") << " lists " << p.partition.size()
        << " stages but parallel.pp is " << p.pp << "; give one layer count per pipeline stage";
      fail();
    }
    int sum = 0;
    for (size_t i = 0; i < p.partition.size(); ++i) {
      if (p.partition[i] < 1) {
        o << "parallel.partition" << at("parallel.partition") << ": stage " << i << " has " << p.partition[i]
          << " layers; every stage needs at least one layer";
        fail();
      }
      sum += p.partition[i];
    }
    if (sum != m.layers) {
      o << "parallel.partition" << at("parallel.partition") << " sums to " << sum << " layers but model.layers is "
        << m.layers << at("model.layers") << "; the stages must hold every layer exactly once";
      fail();
    }
    // Megatron splits each stage's layers evenly over its model chunks (transformer_block.py
    // get_num_layers_to_build asserts num_layers_per_pipeline_rank % vp_size == 0).
    for (size_t i = 0; p.interleave > 1 && i < p.partition.size(); ++i)
      if (p.partition[i] % p.interleave != 0) {
        o << "parallel.partition" << at("parallel.partition") << ": stage " << i << " has " << p.partition[i]
          << " layers, which do not split into parallel.interleave (" << p.interleave
          << ") equal model chunks; give every stage a multiple of " << p.interleave << " layers";
        fail();
      }
  } else if (m.layers % (p.pp * p.interleave) != 0) {
    // The loader resolves parallel.partition_method into parallel.partition first; a Scenario
    // built in code without it must be uniform.
    if (p.interleave > 1)
      o << "model.layers (" << m.layers << ")" << at("model.layers") << " is not divisible by parallel.pp * parallel.interleave ("
        << p.pp << " * " << p.interleave << "); every model chunk must hold the same number of layers unless "
        << "parallel.partition (or parallel.partition_method: megatron) says otherwise";
    else
      o << "model.layers (" << m.layers << ")" << at("model.layers") << " is not divisible by parallel.pp (" << p.pp << ")"
        << at("parallel.pp") << "; give parallel.partition_method (uniform, parameters, type:REGEX, megatron) or "
        << "parallel.partition, a list of " << p.pp << " layer counts summing to " << m.layers;
    fail();
  }
  if (p.interleave > 1) {
    if (p.pp == 1) {
      o << "parallel.interleave (" << p.interleave << ")" << at("parallel.interleave")
        << " requires pipeline parallelism (pp > 1); set parallel.interleave: 1";
      fail();
    }
    if (t.grad_accum % p.pp != 0) {
      o << "parallel.interleave (" << p.interleave << ")" << at("parallel.interleave") << " needs the number of micro-batches ("
        << t.grad_accum << ", training.grad_accum) to be divisible by parallel.pp (" << p.pp
        << "), as Megatron's interleaved schedule requires; change training.global_batch or training.micro_batch";
      fail();
    }
  }

  // --- experts
  if (m.is_moe()) {
    if (m.experts % p.ep != 0) {
      o << "model.experts (" << m.experts << ")" << at("model.experts") << " is not divisible by parallel.ep (" << p.ep << ")"
        << at("parallel.ep") << "; each expert-parallel rank holds experts / ep experts: use an ep that divides "
        << m.experts << " and dp";
      fail();
    }
  } else if (p.ep > 1) {
    o << "parallel.ep (" << p.ep << ")" << at("parallel.ep")
      << " requires a mixture-of-experts model: set model.experts (and model.top_k), or parallel.ep: 1";
    fail();
  }
  if (p.dp % p.ep != 0) {
    o << "parallel.ep (" << p.ep << ")" << at("parallel.ep") << " must divide parallel.dp (" << p.dp << ")"
      << at("parallel.dp") << "; DeepSpeed carves expert-parallel groups out of the data-parallel group: use an ep in {"
      << divisors_of(p.dp) << "}";
    fail();
  }
  // ZeRO++ hpZ: the secondary partition groups hpz_partition_size consecutive data-parallel ranks.
  if (s.zero.hpz() && p.dp % s.zero.hpz_partition_size != 0) {
    o << "zero.hpz_partition_size (" << s.zero.hpz_partition_size << ")" << at("zero.hpz_partition_size")
      << " must divide parallel.dp (" << p.dp << ")" << at("parallel.dp")
      << "; ZeRO++ keeps a secondary parameter partition over that many data-parallel ranks (normally one node): use one of {"
      << divisors_of(p.dp) << "}";
    fail();
  }

  // --- batch
  c.positive("training.global_batch", static_cast<double>(t.global_batch), "");
  c.positive("training.micro_batch", t.micro_batch, "");
  c.positive("training.grad_accum", t.grad_accum, "");
  if (t.global_batch != static_cast<int64_t>(t.micro_batch) * t.grad_accum * p.dp) {
    o << "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
         "gradient_acc_step * world_size "
      << t.global_batch << " != " << t.micro_batch << " * " << t.grad_accum << " * " << p.dp
      << " (training.global_batch, training.micro_batch, training.grad_accum over dp = " << p.dp << ")";
    fail();
  }
  c.non_negative("training.tokens_to_train", t.tokens_to_train);
  c.non_negative("training.gradient_clipping", t.gradient_clipping);

  // --- ZeRO
  if (z.stage < 0 || z.stage > 3) {
    o << "zero.stage" << at("zero.stage") << " must be 0, 1, 2 or 3, got " << z.stage;
    fail();
  }
  if (z.stage >= 2 && p.pp > 1) {
    o << "DeepSpeed refuses ZeRO stage 2/3 with pipeline parallelism (pp=" << p.pp << ")" << at("zero.stage")
      << ": use zero.stage 0 or 1 with pp > 1";
    fail();
  }
  if (z.offload_param && z.stage != 3) {
    o << "zero.offload_param" << at("zero.offload_param") << " requires ZeRO stage 3 (zero.stage is " << z.stage
      << "): only stage 3 partitions parameters; set zero.stage: 3 or offload_param: false";
    fail();
  }
  if (z.offload_optimizer && z.stage == 0) {
    o << "zero.offload_optimizer" << at("zero.offload_optimizer")
      << " requires ZeRO (zero.stage 1, 2 or 3): ZeRO-Offload moves the partitioned optimizer to the host; set zero.stage";
    fail();
  }
  if ((z.nvme_optimizer && !z.offload_optimizer) || (z.nvme_param && !z.offload_param)) {
    const char* k = z.nvme_optimizer && !z.offload_optimizer ? "zero.offload_optimizer_device" : "zero.offload_param_device";
    o << k << at(k) << " is nvme but the offload it names is off; set "
      << (z.nvme_optimizer && !z.offload_optimizer ? "zero.offload_optimizer" : "zero.offload_param") << ": true";
    fail();
  }
  c.non_negative("zero.reduce_bucket_size", static_cast<double>(z.reduce_bucket_size));
  c.non_negative("zero.allgather_bucket_size", static_cast<double>(z.allgather_bucket_size));
  c.non_negative("zero.prefetch_bucket_size", static_cast<double>(z.prefetch_bucket_size));
  c.non_negative("zero.param_persistence_threshold", static_cast<double>(z.param_persistence_threshold));
  c.non_negative("zero.max_live_parameters", static_cast<double>(z.max_live_parameters));

  // --- fine-tuning
  const FinetuneSpec& ft = s.finetune;
  if (ft.lora()) {
    if (p.tp > 1) {
      o << "finetune.method lora" << at("finetune.method") << " with parallel.tp " << p.tp << at("parallel.tp")
        << " is not modelled (adapters of tensor-parallel linears): LoRA fine-tuning runs data parallel with ZeRO; "
           "set parallel.tp: 1";
      fail();
    }
    if (m.is_moe()) {
      o << "finetune.method lora" << at("finetune.method") << " on a MoE model (model.experts " << m.experts
        << ") is not modelled: adapters on experts are not defined; use finetune.method full";
      fail();
    }
    if (ft.freeze_embeddings || ft.freeze_norms || ft.freeze_attention || ft.freeze_mlp || ft.freeze_head) {
      o << "finetune.freeze" << at("finetune.freeze")
        << " applies to finetune.method full: with lora every base weight is frozen already; remove finetune.freeze";
      fail();
    }
    const auto& tg = ft.targets;
    const auto has = [&](LoraTarget t) { return std::find(tg.begin(), tg.end(), t) != tg.end(); };
    if (has(LoraTarget::qkv) && (has(LoraTarget::q) || has(LoraTarget::k) || has(LoraTarget::v))) {
      o << "finetune.targets" << at("finetune.targets")
        << " names the fused qkv and one of q / k / v: the same projection twice; use either qkv or q, k, v";
      fail();
    }
    if (has(LoraTarget::mlp_gate) && !m.swiglu) {
      o << "finetune.targets" << at("finetune.targets") << " names mlp_gate (gate_proj), but model.mlp is gelu: "
        << "there is no gate projection; use mlp_up / mlp_down";
      fail();
    }
  } else if (ft.freeze_embeddings && ft.freeze_norms && ft.freeze_attention && ft.freeze_mlp && ft.freeze_head) {
    o << "finetune.freeze" << at("finetune.freeze") << " freezes every part: nothing would train; "
      << "remove a part from the list, or use finetune.method lora";
    fail();
  }

  // --- optimizer
  if (s.optimizer.kind == OptimizerKind::onebit_adam && z.stage > 0) {
    o << "1-bit Adam is not compatible with ZeRO (DeepSpeed refuses it): optimizer.type onebit_adam"
      << at("optimizer.type") << " needs zero.stage 0, got " << z.stage << at("zero.stage")
      << "; set zero.stage: 0 or optimizer.type: adamw";
    fail();
  }
  c.positive("optimizer.lr", s.optimizer.lr, "");
  if (!(s.optimizer.beta1 >= 0 && s.optimizer.beta1 < 1 && s.optimizer.beta2 >= 0 && s.optimizer.beta2 < 1)) {
    o << "optimizer.betas" << at("optimizer.betas") << " must both be in [0, 1), got [" << s.optimizer.beta1 << ", "
      << s.optimizer.beta2 << "]";
    fail();
  }
  c.positive("optimizer.eps", s.optimizer.eps, "");
  c.non_negative("optimizer.weight_decay", s.optimizer.weight_decay);
  c.non_negative("optimizer.freeze_step", static_cast<double>(s.optimizer.freeze_step));
  c.non_negative("optimizer.step", static_cast<double>(s.optimizer.step));

  // --- precision
  if (s.precision.dtype == Dtype::fp16) {
    const auto& ls = s.precision.loss_scale;
    c.non_negative("precision.loss_scale.scale", ls.loss_scale);
    c.positive("precision.loss_scale.loss_scale_window", ls.loss_scale_window, "");
    c.positive("precision.loss_scale.min_loss_scale", ls.min_loss_scale, "");
    c.non_negative("precision.loss_scale.hysteresis", ls.hysteresis);
  }

  // --- cluster and GPU
  const bool gpu_incomplete = !(g.memory_bytes > 0 && g.hbm_bandwidth > 0 && g.peak_flops_16 > 0 &&
                                g.peak_flops_32 > 0 && g.pcie_bandwidth > 0 &&
                                (cl.gpus_per_node == 1 || g.nvlink_bandwidth > 0));
  const std::string gpu_fix =
      gpu_incomplete ? "set cluster.gpu to a preset (" + presets("gpus") + ") or give the value" : "";
  c.positive("cluster.gpu.memory", g.memory_bytes, gpu_fix);
  c.positive("cluster.gpu.hbm_bandwidth", g.hbm_bandwidth, gpu_fix);
  c.positive("cluster.gpu.peak_flops_16", g.peak_flops_16, gpu_fix);
  c.positive("cluster.gpu.peak_flops_32", g.peak_flops_32, gpu_fix);
  c.positive("cluster.gpu.pcie_bandwidth", g.pcie_bandwidth, gpu_fix);
  c.non_negative("cluster.gpu.pcie_latency", g.pcie_latency);
  if (cl.gpus_per_node > 1) {
    c.positive("cluster.gpu.nvlink_bandwidth", g.nvlink_bandwidth, gpu_fix);
    c.non_negative("cluster.gpu.nvlink_latency", g.nvlink_latency);
  }
  c.fraction("cluster.gpu.gemm_efficiency", g.gemm_efficiency);
  c.fraction("cluster.gpu.attention_efficiency", g.attention_efficiency);
  c.fraction("cluster.gpu.memory_efficiency", g.memory_efficiency);
  c.non_negative("cluster.gpu.gemm_half_flops", g.gemm_half_flops);
  c.non_negative("cluster.gpu.kernel_launch", g.kernel_launch);
  c.non_negative("cluster.gpu.tdp", g.tdp);
  c.non_negative("cluster.gpu.power_limit", g.power_limit);
  if (g.power_limit > 0) {
    if (!(g.tdp > 0)) {
      o << "cluster.gpu.power_limit" << at("cluster.gpu.power_limit") << " (" << g.power_limit
        << " W) needs the GPU's TDP to compare with: set cluster.gpu.tdp (watts, e.g. '700 W' for an H100 SXM) "
           "or use a GPU preset (" << presets("gpus") << "), which states it";
      fail();
    }
    if (g.power_limit > 1.5 * g.tdp) {
      o << "cluster.gpu.power_limit" << at("cluster.gpu.power_limit") << " is " << g.power_limit
        << " W, more than 1.5 x the GPU's TDP of " << g.tdp << " W" << at("cluster.gpu.tdp")
        << ": no board accepts a limit that far above its TDP (and a limit at or above the TDP changes "
           "nothing here); give the limit in watts ('500 W'), or omit it to run at the TDP";
      fail();
    }
    if (!cl.device_profile.empty()) {
      o << "cluster.gpu.power_limit" << at("cluster.gpu.power_limit") << " with cluster.device_profile"
        << at("cluster.device_profile")
        << ": the profile's kernel rates were measured at the clocks its GPU ran at, under whatever limit it had; "
           "drop power_limit (to model a limit with a profile, calibrate under that limit)";
      fail();
    }
  }
  if (cl.intra_node != "nvswitch" && cl.intra_node != "nvlink" && cl.intra_node != "pcie") {
    o << "cluster.intra_node" << at("cluster.intra_node") << " must be nvswitch, nvlink or pcie, got '" << cl.intra_node << "'";
    fail();
  }
  if (cl.topology != "fat_tree" && cl.topology != "star") {
    o << "cluster.topology" << at("cluster.topology") << " must be fat_tree or star, got '" << cl.topology << "'";
    fail();
  }
  if (cl.nodes > 1) {
    c.positive("cluster.nics_per_node", cl.nics_per_node, "a multi-node cluster needs NICs");
    c.positive("cluster.nic_bandwidth", cl.nic_bandwidth, "e.g. '200 Gb/s' for HDR InfiniBand");
  }
  c.non_negative("cluster.nic_latency", cl.nic_latency);
  c.non_negative("cluster.switch_latency", cl.switch_latency);
  if (cl.fat_tree_levels < 1 || cl.fat_tree_levels > 3) {
    o << "cluster.fat_tree_levels" << at("cluster.fat_tree_levels") << " must be 1, 2 or 3, got " << cl.fat_tree_levels;
    fail();
  }
  if (!(cl.oversubscription >= 1)) {
    o << "cluster.oversubscription" << at("cluster.oversubscription")
      << " is the ratio of down- to up-links of a switch: it must be >= 1 (1 = non-blocking), got " << cl.oversubscription;
    fail();
  }
  c.positive("cluster.host_memory", cl.host_memory_bytes, "");
  c.positive("cluster.host_memory_bandwidth", cl.host_memory_bandwidth, "");
}

std::vector<std::string> validation_warnings(const Scenario& s) {
  std::vector<std::string> w;
  if (s.parallel.tp > s.cluster.gpus_per_node)
    w.push_back("parallel.tp (" + std::to_string(s.parallel.tp) + ") is larger than cluster.gpus_per_node (" +
                std::to_string(s.cluster.gpus_per_node) +
                "): tensor-parallel all-reduces cross the inter-node network; Megatron keeps TP inside a node");
  if (s.parallel.tp > 1 && s.cluster.gpus_per_node % s.parallel.tp != 0 && s.parallel.tp < s.cluster.gpus_per_node)
    w.push_back("parallel.tp (" + std::to_string(s.parallel.tp) + ") does not divide cluster.gpus_per_node (" +
                std::to_string(s.cluster.gpus_per_node) + "): some tensor-parallel groups span two nodes");
  if (s.optimizer.kind == OptimizerKind::onebit_adam && s.optimizer.freeze_step > 0 &&
      s.optimizer.step < s.optimizer.freeze_step)
    w.push_back("optimizer.step (" + std::to_string(s.optimizer.step) + ") is within 1-bit Adam's warm-up (freeze_step " +
                std::to_string(s.optimizer.freeze_step) +
                "): the reported iteration uses uncompressed all-reduce; set optimizer.step >= freeze_step to see the compressed phase");
  const CheckpointingSpec& ck = s.checkpointing;
  if ((ck.partition_activations || ck.cpu_checkpointing) && s.recompute != Recompute::full)
    w.push_back("activation_checkpointing.partition_activations / cpu_checkpointing act on the layers DeepSpeed "
                "checkpoints (deepspeed.checkpointing.checkpoint): with activation_checkpointing " +
                std::string(to_string(s.recompute)) + " they change nothing; set activation_checkpointing.mode: full");
  else if (ck.cpu_checkpointing && !ck.partition_activations)
    w.push_back("activation_checkpointing.cpu_checkpointing without partition_activations changes nothing: DeepSpeed "
                "moves only partitioned checkpoints to the host (checkpointing.py); set partition_activations: true");
  if ((s.zero.nvme_optimizer || s.zero.nvme_param) && !(s.cluster.nvme_bandwidth > 0))
    w.push_back("NVMe offload (zero.offload_optimizer_device / offload_param_device nvme) without cluster.nvme_bandwidth: "
                "modelled as host memory (cpu), the NVMe swapping not priced; set cluster.nvme_bandwidth to the node's "
                "NVMe read / write bandwidth");
  if (s.zero.offload_optimizer && s.precision.dtype == Dtype::fp32)
    w.push_back("zero.offload_optimizer with precision fp32: DeepSpeed's CPU Adam is normally used with fp16/bf16");
  return w;
}

}  // namespace dssim
