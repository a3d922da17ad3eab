#include "core/scenario_loader.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include "core/deepspeed_config.hpp"
#include "core/finetune.hpp"
#include "core/pipeline_partition.hpp"
#include "core/scenario_layer.hpp"
#include "core/scenario_units.hpp"
#include "core/validate.hpp"
#include "core/what_if.hpp"

#ifndef DSSIM_SOURCE_ROOT
#define DSSIM_SOURCE_ROOT "."
#endif

namespace dssim {

namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------------------------
// Reading typed values out of entries.

std::string describe(const YAML::Node& v) {
  if (!v.IsDefined() || v.IsNull()) return "nothing";
  if (v.IsSequence()) return "a list";
  if (v.IsMap()) return "a mapping";
  return "'" + v.Scalar() + "'";
}

[[noreturn]] void type_error(const Entry& e, const std::string& expected) {
  throw ConfigError(e.origin + ": " + e.where() + ": expected " + expected + ", got " + describe(e.value));
}

std::string scalar(const Entry& e, const std::string& expected) {
  if (!e.value.IsScalar()) type_error(e, expected);
  return e.value.Scalar();
}

int64_t get_int(const Entry& e, int64_t min_value = std::numeric_limits<int64_t>::min()) {
  const std::string s = scalar(e, "an integer");
  // Integers may be written as 5e8 (bucket sizes are): accept any number that is integral.
  auto v = parse_quantity(s, Dimension::None);
  if (!v || !std::isfinite(*v)) type_error(e, "an integer");
  if (std::abs(*v) > 9.0e18)
    throw ConfigError(e.origin + ": " + e.where() + ": " + s + " is out of range (integers here are at most 9e18)");
  if (*v != static_cast<double>(static_cast<int64_t>(*v))) type_error(e, "an integer");
  const auto i = static_cast<int64_t>(*v);
  if (i < min_value)
    throw ConfigError(e.origin + ": " + e.where() + ": must be at least " + std::to_string(min_value) + ", got " + s);
  return i;
}

int get_int32(const Entry& e, int64_t min_value = std::numeric_limits<int>::min()) {
  const int64_t v = get_int(e, min_value);
  if (v > std::numeric_limits<int>::max())
    throw ConfigError(e.origin + ": " + e.where() + ": " + std::to_string(v) + " is out of range (at most 2147483647)");
  return static_cast<int>(v);
}

double get_number(const Entry& e, Dimension d = Dimension::None, double min_value = -std::numeric_limits<double>::infinity(),
                  bool exclusive = false) {
  const std::string s = scalar(e, example_of(d));
  auto v = parse_quantity(s, d);
  if (!v) type_error(e, example_of(d));
  if (*v < min_value || (exclusive && *v == min_value)) {
    std::ostringstream o;
    o << e.origin << ": " << e.where() << ": must be " << (exclusive ? "greater than " : "at least ") << min_value
      << ", got '" << s << "'";
    throw ConfigError(o.str());
  }
  return *v;
}

double get_positive(const Entry& e, Dimension d) { return get_number(e, d, 0, true); }
double get_non_negative(const Entry& e, Dimension d) { return get_number(e, d, 0, false); }

bool get_bool(const Entry& e) {
  const std::string s = scalar(e, "true or false");
  bool b = false;
  if (!YAML::convert<bool>::decode(e.value, b)) type_error(e, "true or false");
  return b;
}

std::string get_string(const Entry& e) { return scalar(e, "a string"); }

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) { best_d = d; best = c; }
  }
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  return best_d <= limit ? best : std::string();
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string r;
  for (const auto& s : v) r += (r.empty() ? "" : sep) + s;
  return r;
}

std::string get_enum(const Entry& e, const std::vector<std::string>& options) {
  const std::string s = scalar(e, "one of " + join(options, ", "));
  for (const auto& o : options)
    if (o == s) return s;
  std::string msg = e.origin + ": " + e.where() + ": expected one of " + join(options, ", ") + ", got '" + s + "'";
  std::string near = closest(s, options);
  if (!near.empty()) msg += "; did you mean '" + near + "'?";
  throw ConfigError(msg);
}

Dtype parse_dtype(const Entry& e) {
  std::string s = scalar(e, "fp32, fp16 or bf16");
  if (s == "fp32" || s == "float32") return Dtype::fp32;
  if (s == "fp16" || s == "float16" || s == "half") return Dtype::fp16;
  if (s == "bf16" || s == "bfloat16") return Dtype::bf16;
  get_enum(e, {"fp32", "fp16", "bf16"});  // throws, naming the choices
  return Dtype::fp32;
}

// ---------------------------------------------------------------------------------------------
// The schema: every key a scenario may contain and how it lands in the Scenario.

using Setter = std::function<void(Scenario&, const Entry&)>;
struct Field {
  std::string key;
  Setter set;
};

const std::vector<Field>& fields() {
  static const std::vector<Field> f = [] {
    std::vector<Field> v;
    auto add = [&](std::string k, Setter s) { v.push_back({std::move(k), std::move(s)}); };
    using D = Dimension;
    // top level
    add("name", [](Scenario& s, const Entry& e) { s.name = get_string(e); });
    add("description", [](Scenario&, const Entry& e) { get_string(e); });
    add("activation_checkpointing.mode", [](Scenario& s, const Entry& e) {
      bool b = false;
      if (e.value.IsScalar() && e.value.Scalar() != "none" && YAML::convert<bool>::decode(e.value, b)) {
        s.recompute = b ? Recompute::full : Recompute::none;  // Megatron's --checkpoint-activations
        return;
      }
      auto r = get_enum(e, {"none", "selective", "full", "selective_op"});
      s.recompute = r == "full"           ? Recompute::full
                    : r == "selective"    ? Recompute::selective
                    : r == "selective_op" ? Recompute::selective_op
                                          : Recompute::none;
    });
    add("activation_checkpointing.partition_activations",
        [](Scenario& s, const Entry& e) { s.checkpointing.partition_activations = get_bool(e); });
    add("activation_checkpointing.cpu_checkpointing",
        [](Scenario& s, const Entry& e) { s.checkpointing.cpu_checkpointing = get_bool(e); });
    add("activation_checkpointing.contiguous_memory_optimization",
        [](Scenario& s, const Entry& e) { s.checkpointing.contiguous_memory_optimization = get_bool(e); });
    // model
    add("model.preset", [](Scenario&, const Entry& e) { get_string(e); });
    add("model.name", [](Scenario& s, const Entry& e) { s.model.name = get_string(e); });
    add("model.description", [](Scenario&, const Entry& e) { get_string(e); });
    add("model.layers", [](Scenario& s, const Entry& e) { s.model.layers = get_int32(e, 1); });
    add("model.hidden", [](Scenario& s, const Entry& e) { s.model.hidden = get_int32(e, 1); });
    add("model.heads", [](Scenario& s, const Entry& e) { s.model.heads = get_int32(e, 1); });
    add("model.ffn_hidden", [](Scenario& s, const Entry& e) { s.model.ffn_hidden = get_int32(e, 1); });
    add("model.vocab", [](Scenario& s, const Entry& e) { s.model.vocab = get_int32(e, 1); });
    add("model.seq_len", [](Scenario& s, const Entry& e) { s.model.seq_len = get_int32(e, 1); });
    add("model.experts", [](Scenario& s, const Entry& e) { s.model.experts = get_int32(e, 0); });
    add("model.top_k", [](Scenario& s, const Entry& e) { s.model.top_k = get_int32(e, 1); });
    add("model.moe_every", [](Scenario& s, const Entry& e) { s.model.moe_every = get_int32(e, 1); });
    add("model.capacity_factor", [](Scenario& s, const Entry& e) { s.model.capacity_factor = get_positive(e, D::None); });
    add("model.min_capacity", [](Scenario& s, const Entry& e) { s.model.min_capacity = get_int32(e, 0); });
    add("model.drop_tokens", [](Scenario& s, const Entry& e) { s.model.drop_tokens = get_bool(e); });
    add("model.use_rts", [](Scenario& s, const Entry& e) { s.model.use_rts = get_bool(e); });
    add("model.noisy_gate_policy", [](Scenario& s, const Entry& e) {
      const auto v = get_enum(e, {"none", "jitter", "rsample", "None", "Jitter", "RSample"});
      s.model.noisy_gate_policy = (v == "jitter" || v == "Jitter")     ? ModelSpec::NoisyGate::jitter
                                  : (v == "rsample" || v == "RSample") ? ModelSpec::NoisyGate::rsample
                                                                       : ModelSpec::NoisyGate::none;
    });
    add("model.moe_loss_coeff", [](Scenario& s, const Entry& e) { s.model.moe_loss_coeff = get_non_negative(e, D::None); });
    add("model.tied_embeddings", [](Scenario& s, const Entry& e) { s.model.tied_embeddings = get_bool(e); });
    add("model.dropout", [](Scenario& s, const Entry& e) { s.model.dropout = get_non_negative(e, D::None); });
    add("model.attention", [](Scenario& s, const Entry& e) {
      s.model.flash_attention = get_enum(e, {"flash", "unfused"}) == "flash";
    });
    add("model.cross_entropy", [](Scenario& s, const Entry& e) {
      const std::string v = get_enum(e, {"unfused", "fused", "fused_linear"});
      s.model.cross_entropy = v == "fused_linear" ? ModelSpec::CrossEntropy::fused_linear
                              : v == "fused"      ? ModelSpec::CrossEntropy::fused
                                                  : ModelSpec::CrossEntropy::unfused;
    });
    add("model.cross_entropy_kernel", [](Scenario& s, const Entry& e) { s.model.cross_entropy_kernel = get_bool(e); });
    add("model.gemm_epilogues", [](Scenario& s, const Entry& e) { s.model.gemm_epilogues = get_bool(e); });
    // Llama-shaped layers (core/model.cpp [L]).
    add("model.kv_heads", [](Scenario& s, const Entry& e) { s.model.kv_heads = get_int32(e, 1); });
    add("model.mlp", [](Scenario& s, const Entry& e) { s.model.swiglu = get_enum(e, {"gelu", "swiglu"}) == "swiglu"; });
    add("model.norm", [](Scenario& s, const Entry& e) { s.model.rmsnorm = get_enum(e, {"layernorm", "rmsnorm"}) == "rmsnorm"; });
    add("model.position", [](Scenario& s, const Entry& e) { s.model.rotary = get_enum(e, {"learned", "rotary"}) == "rotary"; });
    add("model.bias", [](Scenario& s, const Entry& e) { s.model.bias = get_bool(e); });
    add("model.elementwise", [](Scenario& s, const Entry& e) {
      s.model.eager_elementwise = get_enum(e, {"fused", "eager"}) == "eager";
    });
    // training
    add("training.global_batch", [](Scenario& s, const Entry& e) { s.training.global_batch = get_int(e, 1); });
    add("training.micro_batch", [](Scenario& s, const Entry& e) { s.training.micro_batch = get_int32(e, 1); });
    add("training.grad_accum", [](Scenario& s, const Entry& e) { s.training.grad_accum = get_int32(e, 1); });
    add("training.tokens_to_train", [](Scenario& s, const Entry& e) { s.training.tokens_to_train = get_non_negative(e, D::None); });
    add("training.gradient_clipping", [](Scenario& s, const Entry& e) { s.training.gradient_clipping = get_non_negative(e, D::None); });
    add("training.seed", [](Scenario& s, const Entry& e) { s.training.seed = static_cast<uint64_t>(get_int(e, 0)); });
    // parallel
    add("parallel.tp", [](Scenario& s, const Entry& e) { s.parallel.tp = get_int32(e, 1); });
    add("parallel.pp", [](Scenario& s, const Entry& e) { s.parallel.pp = get_int32(e, 1); });
    add("parallel.dp", [](Scenario& s, const Entry& e) { s.parallel.dp = get_int32(e, 1); });
    add("parallel.ep", [](Scenario& s, const Entry& e) { s.parallel.ep = get_int32(e, 1); });
    add("parallel.sequence_parallel", [](Scenario& s, const Entry& e) { s.parallel.sequence_parallel = get_bool(e); });
    add("parallel.interleave", [](Scenario& s, const Entry& e) { s.parallel.interleave = get_int32(e, 1); });
    add("parallel.partition", [](Scenario& s, const Entry& e) {
      if (!e.value.IsSequence()) type_error(e, "a list of layer counts, one per pipeline stage, such as [13, 12, 12, 11]");
      s.parallel.partition.clear();
      for (size_t i = 0; i < e.value.size(); ++i) {
        Entry item = e;
        item.value.reset(e.value[i]);
        item.written_as = (e.written_as.empty() ? e.key : e.written_as) + "[" + std::to_string(i) + "]";
        if (!item.value.IsScalar()) type_error(item, "an integer");
        s.parallel.partition.push_back(get_int32(item, 1));
      }
    });
    // fine-tuning (core/finetune.hpp)
    add("finetune.method", [](Scenario& s, const Entry& e) {
      s.finetune.method = get_enum(e, {"full", "lora"}) == "lora" ? FinetuneSpec::Method::lora : FinetuneSpec::Method::full;
      s.finetune.declared = true;
    });
    add("zero.offload_optimizer_device", [](Scenario& s, const Entry& e) {
      s.zero.nvme_optimizer = get_enum(e, {"cpu", "nvme"}) == "nvme";
    });
    add("zero.offload_param_device", [](Scenario& s, const Entry& e) {
      s.zero.nvme_param = get_enum(e, {"cpu", "nvme"}) == "nvme";
    });
    add("finetune.rank", [](Scenario& s, const Entry& e) { s.finetune.rank = get_int32(e, 1); });
    add("finetune.alpha", [](Scenario& s, const Entry& e) { s.finetune.alpha = get_positive(e, D::None); });
    add("finetune.dropout", [](Scenario& s, const Entry& e) {
      s.finetune.dropout = get_non_negative(e, D::None);
      if (s.finetune.dropout >= 1)
        throw ConfigError(e.origin + ": " + e.where() + ": a dropout probability is below 1, got " + e.value.Scalar());
    });
    add("finetune.targets", [](Scenario& s, const Entry& e) {
      const char* example = "a list of linears such as [q_proj, v_proj], [qkv, o, mlp_up, mlp_down] or [all-linear]";
      if (!e.value.IsSequence() && !e.value.IsScalar()) type_error(e, example);
      s.finetune.targets.clear();
      const size_t n = e.value.IsSequence() ? e.value.size() : 1;
      for (size_t i = 0; i < n; ++i) {
        const YAML::Node item = e.value.IsSequence() ? e.value[i] : e.value;
        if (!item.IsScalar()) type_error(e, example);
        const std::string name = item.Scalar();
        if (!parse_lora_target(name, s.finetune.targets)) {
          std::string msg = e.origin + ": " + e.where() + ": unknown LoRA target '" + name + "'";
          if (name == "c_proj")  // GPT-2 names two different linears so
            throw ConfigError(msg + ": GPT-2's c_proj is both the attention output and the MLP down projection; "
                                    "name them o (o_proj) and / or mlp_down (down_proj)");
          const std::string near = closest(name, lora_target_names());
          if (!near.empty()) msg += "; did you mean '" + near + "'?";
          throw ConfigError(msg + "; known: " + join(lora_target_names()));
        }
      }
    });
    add("finetune.freeze", [](Scenario& s, const Entry& e) {
      const char* example = "a list of parts: embeddings, norms, attention, mlp, lm_head";
      if (!e.value.IsSequence()) type_error(e, example);
      FinetuneSpec& f = s.finetune;
      f.freeze_embeddings = f.freeze_norms = f.freeze_attention = f.freeze_mlp = f.freeze_head = false;
      for (size_t i = 0; i < e.value.size(); ++i) {
        Entry item = e;
        item.value.reset(e.value[i]);
        item.written_as = (e.written_as.empty() ? e.key : e.written_as) + "[" + std::to_string(i) + "]";
        const std::string part = get_enum(item, {"embeddings", "norms", "attention", "mlp", "lm_head"});
        (part == "embeddings" ? f.freeze_embeddings : part == "norms" ? f.freeze_norms
         : part == "attention" ? f.freeze_attention : part == "mlp" ? f.freeze_mlp : f.freeze_head) = true;
      }
    });
    add("parallel.partition_method", [](Scenario& s, const Entry& e) {
      // DeepSpeed lower-cases the method; a type:REGEX is checked when the partition is resolved.
      const std::string m = get_string(e);
      std::string lower = m;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      const std::vector<std::string> methods = {"uniform", "parameters", "megatron"};
      if (lower.rfind("type:", 0) != 0 && std::find(methods.begin(), methods.end(), lower) == methods.end()) {
        std::string msg = e.origin + ": " + e.where() + ": unknown pipeline partition method '" + m +
                          "'; use one of uniform, parameters (DeepSpeed's default), type:REGEX (e.g. type:transformer), megatron";
        if (const std::string near = closest(lower, methods); !near.empty()) msg += "; did you mean '" + near + "'?";
        throw ConfigError(msg);
      }
      s.parallel.partition_method = m;
    });
    // zero
    add("parallel.scatter_gather", [](Scenario& s, const Entry& e) { s.parallel.scatter_gather = get_bool(e); });
    add("parallel.pipeline_engine", [](Scenario& s, const Entry& e) {
      s.parallel.pipeline_engine = get_enum(e, {"megatron", "deepspeed"}) == "deepspeed" ? PipelineEngine::deepspeed
                                                                                       : PipelineEngine::megatron;
    });
    add("parallel.pipe_partitioned", [](Scenario& s, const Entry& e) { s.parallel.pipe_partitioned = get_bool(e); });
    add("parallel.grad_partitioned", [](Scenario& s, const Entry& e) { s.parallel.grad_partitioned = get_bool(e); });
    add("zero.stage", [](Scenario& s, const Entry& e) {
      s.zero.stage = get_int32(e, 0);
      if (s.zero.stage > 3) throw ConfigError(e.origin + ": " + e.where() + ": ZeRO stage must be 0, 1, 2 or 3, got " + e.value.Scalar());
    });
    add("zero.offload_optimizer", [](Scenario& s, const Entry& e) { s.zero.offload_optimizer = get_bool(e); });
    add("zero.offload_param", [](Scenario& s, const Entry& e) { s.zero.offload_param = get_bool(e); });
    add("zero.engine", [](Scenario& s, const Entry& e) {
      s.zero.engine = get_enum(e, {"deepspeed", "fsdp"}) == "fsdp" ? ZeroEngine::fsdp : ZeroEngine::deepspeed;
    });
    add("zero.overlap_comm", [](Scenario& s, const Entry& e) { s.zero.overlap_comm = get_bool(e); });
    add("zero.reduce_bucket_size", [](Scenario& s, const Entry& e) { s.zero.reduce_bucket_size = get_int(e, 0); });
    add("zero.allgather_bucket_size", [](Scenario& s, const Entry& e) { s.zero.allgather_bucket_size = get_int(e, 0); });
    add("zero.prefetch_bucket_size", [](Scenario& s, const Entry& e) { s.zero.prefetch_bucket_size = get_int(e, 0); });
    add("zero.param_persistence_threshold", [](Scenario& s, const Entry& e) { s.zero.param_persistence_threshold = get_int(e, 0); });
    add("zero.max_live_parameters", [](Scenario& s, const Entry& e) { s.zero.max_live_parameters = get_int(e, 0); });
    add("zero.quantized_weights", [](Scenario& s, const Entry& e) { s.zero.quantized_weights = get_bool(e); });
    add("zero.quantized_gradients", [](Scenario& s, const Entry& e) { s.zero.quantized_gradients = get_bool(e); });
    add("zero.hpz_partition_size", [](Scenario& s, const Entry& e) { s.zero.hpz_partition_size = get_int32(e, 1); });
    add("zero.grad_accum_dtype", [](Scenario& s, const Entry& e) {
      s.zero.grad_accum_fp32 = get_enum(e, {"model", "fp32"}) == "fp32";
    });
    // precision
    add("precision.dtype", [](Scenario& s, const Entry& e) { s.precision.dtype = parse_dtype(e); });
    add("precision.communication_dtype", [](Scenario& s, const Entry& e) { s.precision.communication_dtype = parse_dtype(e); });
    add("precision.loss_scale.scale", [](Scenario& s, const Entry& e) {
      if (e.value.IsScalar() && e.value.Scalar() == "dynamic") { s.precision.loss_scale.loss_scale = 0; return; }
      s.precision.loss_scale.loss_scale = get_non_negative(e, D::None);
    });
    add("precision.loss_scale.initial_scale_power", [](Scenario& s, const Entry& e) { s.precision.loss_scale.initial_scale_power = get_int32(e, 0); });
    add("precision.loss_scale.loss_scale_window", [](Scenario& s, const Entry& e) { s.precision.loss_scale.loss_scale_window = get_int32(e, 1); });
    add("precision.loss_scale.hysteresis", [](Scenario& s, const Entry& e) { s.precision.loss_scale.hysteresis = get_int32(e, 0); });
    add("precision.loss_scale.min_loss_scale", [](Scenario& s, const Entry& e) { s.precision.loss_scale.min_loss_scale = get_positive(e, D::None); });
    // optimizer
    add("optimizer.type", [](Scenario& s, const Entry& e) {
      auto t = get_enum(e, {"adamw", "adam", "onebit_adam", "lamb", "lion"});
      s.optimizer.kind = t == "onebit_adam" ? OptimizerKind::onebit_adam
                         : t == "lamb"      ? OptimizerKind::lamb
                         : t == "lion"      ? OptimizerKind::lion
                                            : OptimizerKind::adamw;
    });
    add("optimizer.lr", [](Scenario& s, const Entry& e) { s.optimizer.lr = get_positive(e, D::None); });
    add("optimizer.betas", [](Scenario& s, const Entry& e) {
      if (!e.value.IsSequence() || e.value.size() != 2) type_error(e, "a list of two numbers such as [0.9, 0.95]");
      Entry b = e;
      b.value.reset(e.value[0]);
      s.optimizer.beta1 = get_non_negative(b, D::None);
      b.value.reset(e.value[1]);
      s.optimizer.beta2 = get_non_negative(b, D::None);
    });
    add("optimizer.eps", [](Scenario& s, const Entry& e) { s.optimizer.eps = get_positive(e, D::None); });
    add("optimizer.weight_decay", [](Scenario& s, const Entry& e) { s.optimizer.weight_decay = get_non_negative(e, D::None); });
    add("optimizer.freeze_step", [](Scenario& s, const Entry& e) { s.optimizer.freeze_step = get_int(e, 0); });
    add("optimizer.step", [](Scenario& s, const Entry& e) { s.optimizer.step = get_int(e, 0); });
    add("optimizer.fused_step", [](Scenario& s, const Entry& e) { s.optimizer.fused_step = get_bool(e); });
    // cluster
    add("cluster.preset", [](Scenario&, const Entry& e) { get_string(e); });
    add("cluster.name", [](Scenario& s, const Entry& e) { s.cluster.name = get_string(e); });
    add("cluster.description", [](Scenario&, const Entry& e) { get_string(e); });
    add("cluster.nodes", [](Scenario& s, const Entry& e) { s.cluster.nodes = get_int32(e, 1); });
    add("cluster.gpus_per_node", [](Scenario& s, const Entry& e) { s.cluster.gpus_per_node = get_int32(e, 1); });
    add("cluster.intra_node", [](Scenario& s, const Entry& e) { s.cluster.intra_node = get_enum(e, {"nvswitch", "nvlink", "pcie"}); });
    add("cluster.nics_per_node", [](Scenario& s, const Entry& e) { s.cluster.nics_per_node = get_int32(e, 0); });
    add("cluster.nic_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.nic_bandwidth = get_positive(e, D::Bandwidth); });
    add("cluster.nic_latency", [](Scenario& s, const Entry& e) { s.cluster.nic_latency = get_non_negative(e, D::Time); });
    add("cluster.topology", [](Scenario& s, const Entry& e) { s.cluster.topology = get_enum(e, {"fat_tree", "star"}); });
    add("cluster.fat_tree_levels", [](Scenario& s, const Entry& e) { s.cluster.fat_tree_levels = get_int32(e, 1); });
    add("cluster.oversubscription", [](Scenario& s, const Entry& e) { s.cluster.oversubscription = get_number(e, D::None, 1); });
    add("cluster.host_cpu", [](Scenario& s, const Entry& e) { s.cluster.host_cpu = get_enum(e, {"intel", "amd"}); });
    add("cluster.switch_latency", [](Scenario& s, const Entry& e) { s.cluster.switch_latency = get_non_negative(e, D::Time); });
    add("cluster.host_memory", [](Scenario& s, const Entry& e) { s.cluster.host_memory_bytes = get_positive(e, D::Bytes); });
    add("cluster.host_memory_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.host_memory_bandwidth = get_positive(e, D::Bandwidth); });
    add("cluster.nvme_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.nvme_bandwidth = get_non_negative(e, D::Bandwidth); });
    add("cluster.device_profile", [](Scenario& s, const Entry& e) { s.cluster.device_profile = get_string(e); });
    // cluster.gpu
    add("cluster.gpu.preset", [](Scenario&, const Entry& e) { get_string(e); });
    add("cluster.gpu.name", [](Scenario& s, const Entry& e) { s.cluster.gpu.name = get_string(e); });
    add("cluster.gpu.description", [](Scenario&, const Entry& e) { get_string(e); });
    add("cluster.gpu.memory", [](Scenario& s, const Entry& e) { s.cluster.gpu.memory_bytes = get_positive(e, D::Bytes); });
    add("cluster.gpu.hbm_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.gpu.hbm_bandwidth = get_positive(e, D::Bandwidth); });
    add("cluster.gpu.peak_flops_16", [](Scenario& s, const Entry& e) { s.cluster.gpu.peak_flops_16 = get_positive(e, D::FlopRate); });
    add("cluster.gpu.peak_flops_32", [](Scenario& s, const Entry& e) { s.cluster.gpu.peak_flops_32 = get_positive(e, D::FlopRate); });
    add("cluster.gpu.nvlink_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.gpu.nvlink_bandwidth = get_non_negative(e, D::Bandwidth); });
    add("cluster.gpu.nvlink_latency", [](Scenario& s, const Entry& e) { s.cluster.gpu.nvlink_latency = get_non_negative(e, D::Time); });
    add("cluster.gpu.pcie_bandwidth", [](Scenario& s, const Entry& e) { s.cluster.gpu.pcie_bandwidth = get_positive(e, D::Bandwidth); });
    add("cluster.gpu.pcie_latency", [](Scenario& s, const Entry& e) { s.cluster.gpu.pcie_latency = get_non_negative(e, D::Time); });
    add("cluster.gpu.nvlink_efficiency", [](Scenario& s, const Entry& e) { s.cluster.gpu.nvlink_efficiency = get_positive(e, D::None); });
    add("cluster.gpu.gemm_efficiency", [](Scenario& s, const Entry& e) { s.cluster.gpu.gemm_efficiency = get_positive(e, D::None); });
    add("cluster.gpu.gemm_half_flops", [](Scenario& s, const Entry& e) { s.cluster.gpu.gemm_half_flops = get_non_negative(e, D::Flops); });
    add("cluster.gpu.attention_efficiency", [](Scenario& s, const Entry& e) { s.cluster.gpu.attention_efficiency = get_positive(e, D::None); });
    add("cluster.gpu.memory_efficiency", [](Scenario& s, const Entry& e) { s.cluster.gpu.memory_efficiency = get_positive(e, D::None); });
    add("cluster.gpu.kernel_launch", [](Scenario& s, const Entry& e) { s.cluster.gpu.kernel_launch = get_non_negative(e, D::Time); });
    add("cluster.gpu.tdp", [](Scenario& s, const Entry& e) { s.cluster.gpu.tdp = get_positive(e, D::Power); });
    add("cluster.gpu.power_limit", [](Scenario& s, const Entry& e) { s.cluster.gpu.power_limit = get_positive(e, D::Power); });
    // what-ifs of the simulator backend (core/what_if.hpp)
    add("what_if", [](Scenario& s, const Entry& e) {
      if (!e.value.IsSequence())
        type_error(e, std::string("a list of what-ifs such as ['slow-gpu 17 x0.8', 'noise 5%'] (") + what_if_grammar() + ")");
      s.what_if.clear();
      for (size_t i = 0; i < e.value.size(); ++i) {
        Entry item = e;
        item.value.reset(e.value[i]);
        item.written_as = (e.written_as.empty() ? e.key : e.written_as) + "[" + std::to_string(i) + "]";
        const std::string spec = scalar(item, "a what-if such as 'slow-gpu 17 x0.8'");
        try {
          s.what_if.push_back(parse_what_if(spec));
        } catch (const ConfigError& ex) {
          throw ConfigError(e.origin + ": " + item.where() + ": " + ex.what());
        }
      }
    });
    // failures and goodput (core/reliability.hpp)
    // A reliability key also marks the section as declared (the report then shows goodput).
    const auto add_reliability = [&add](const char* key, void (*set)(Scenario&, const Entry&)) {
      add(key, [set](Scenario& s, const Entry& e) {
        set(s, e);
        s.reliability.declared = true;
      });
    };
    add_reliability("reliability.failures_per_gpu_hour", [](Scenario& s, const Entry& e) {
      s.reliability.failures_per_gpu_hour = get_non_negative(e, D::None);
      s.reliability.failures_per_node_day = 0;
    });
    add_reliability("reliability.failures_per_node_day", [](Scenario& s, const Entry& e) {
      s.reliability.failures_per_node_day = get_positive(e, D::None);
    });
    add_reliability("reliability.checkpoint_size", [](Scenario& s, const Entry& e) {
      s.reliability.checkpoint_bytes = get_positive(e, D::Bytes);
    });
    add_reliability("reliability.write_bandwidth", [](Scenario& s, const Entry& e) {
      s.reliability.write_bandwidth = get_positive(e, D::Bandwidth);
    });
    add_reliability("reliability.read_bandwidth", [](Scenario& s, const Entry& e) {
      s.reliability.read_bandwidth = get_positive(e, D::Bandwidth);
    });
    add_reliability("reliability.restore_time", [](Scenario& s, const Entry& e) {
      s.reliability.restore_seconds = get_positive(e, D::Time);
    });
    add_reliability("reliability.restart_overhead", [](Scenario& s, const Entry& e) {
      s.reliability.restart_seconds = get_non_negative(e, D::Time);
    });
    add_reliability("reliability.checkpoint_interval", [](Scenario& s, const Entry& e) {
      if (e.value.IsScalar() && e.value.Scalar() == "auto") { s.reliability.checkpoint_interval = 0; return; }
      const std::string v = scalar(e, "'auto' or a time such as '3600 s'");
      auto t = parse_quantity(v, D::Time);
      if (!t || *t <= 0) type_error(e, "'auto' (Young / Daly's optimum) or a positive time such as '3600 s'");
      s.reliability.checkpoint_interval = *t;
    });
    add_reliability("reliability.samples", [](Scenario& s, const Entry& e) {
      s.reliability.samples = get_int32(e, 1);
    });
    add_reliability("reliability.seed", [](Scenario& s, const Entry& e) {
      s.reliability.seed = static_cast<uint64_t>(get_int(e, 0));
    });
    return v;
  }();
  return f;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : fields())
    if (f.key == key) return &f;
  return nullptr;
}

// Sections, and the key a scalar written in place of the section means ("cluster: dgx-a100-hdr").
const std::map<std::string, std::string>& sections() {
  static const std::map<std::string, std::string> s = {
      {"model", "model.preset"},       {"training", ""},
      {"parallel", ""},                {"zero", "zero.stage"},
      {"precision", "precision.dtype"}, {"precision.loss_scale", "precision.loss_scale.scale"},
      {"optimizer", "optimizer.type"}, {"cluster", "cluster.preset"},
      {"cluster.gpu", "cluster.gpu.preset"}, {"finetune", "finetune.method"},
      {"activation_checkpointing", "activation_checkpointing.mode"},
      {"reliability", ""},
  };
  return s;
}

std::vector<std::string> all_keys() {
  std::vector<std::string> k;
  for (const auto& f : fields()) k.push_back(f.key);
  for (const auto& [s, _] : sections()) k.push_back(s);
  return k;
}

std::vector<std::string> keys_of_section(const std::string& section) {
  std::vector<std::string> k;
  for (const auto& f : fields()) {
    if (f.key.rfind(section + ".", 0) == 0 && f.key.find('.', section.size() + 1) == std::string::npos)
      k.push_back(f.key.substr(section.size() + 1));
  }
  for (const auto& [s, _] : sections())
    if (s.rfind(section + ".", 0) == 0) k.push_back(s.substr(section.size() + 1));
  return k;
}

[[noreturn]] void unknown_key(const std::string& key, const std::string& origin, int line) {
  std::string msg = origin + ": unknown key '" + key + "'";
  if (line > 0) msg += " at line " + std::to_string(line);
  else if (origin == "--set") msg += " (--set)";
  // the right key in the wrong section ("training.tp", or "tp" at top level), else the closest key
  std::string near;
  const std::string leaf = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
  for (const auto& f : fields())
    if (f.key.size() > leaf.size() && f.key.compare(f.key.size() - leaf.size() - 1, std::string::npos, "." + leaf) == 0) {
      near = f.key;
      break;
    }
  if (near.empty()) near = closest(key, all_keys());
  if (!near.empty()) {
    msg += "; did you mean '" + near + "'?";
  } else {
    const auto dot = key.rfind('.');
    const std::string section = dot == std::string::npos ? "" : key.substr(0, dot);
    if (sections().count(section))
      msg += "; valid keys in '" + section + "': " + join(keys_of_section(section));
    else {
      std::vector<std::string> top = {"name", "description", "what_if"};
      for (const auto& [s, _] : sections())
        if (s.find('.') == std::string::npos) top.push_back(s);
      msg += "; valid top-level keys: " + join(top);
    }
  }
  throw ConfigError(msg);
}

int line_of(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.line >= 0 ? m.line + 1 : 0;
}

// Flattens `value`, found at `path`, into `out`.
void flatten(const std::string& path, const YAML::Node& value, int key_line, const std::string& origin, Layer& out) {
  auto sec = sections().find(path);
  if (sec != sections().end() || path.empty()) {
    if (value.IsMap()) {
      for (auto it = value.begin(); it != value.end(); ++it) {
        const std::string k = it->first.IsScalar() ? it->first.Scalar() : std::string("?");
        flatten(path.empty() ? k : path + "." + k, it->second, line_of(it->first), origin, out);
      }
      return;
    }
    if (value.IsNull()) return;  // an empty section
    if (!path.empty() && value.IsScalar() && !sec->second.empty()) {
      flatten(sec->second, value, key_line, origin, out);
      return;
    }
    Entry e{path.empty() ? "<document>" : path, value, origin, line_of(value) ? line_of(value) : key_line, ""};
    if (path.empty()) throw ConfigError(origin + ": a scenario must be a YAML mapping of sections (model, training, parallel, ...), got " + describe(value));
    std::string hint = sec->second.empty() ? "" : " or a " + sec->second.substr(path.size() + 1) + " name";
    type_error(e, "a mapping of " + path + " keys (" + join(keys_of_section(path)) + ")" + hint);
  }
  if (!find_field(path)) unknown_key(path, origin, key_line);
  Entry e{path, value, origin, key_line, ""};
  if (value.IsMap()) type_error(e, "a value");
  if (auto prev = out.find(path); prev != out.end() && prev->second.origin == origin && origin != "--set")
    throw ConfigError(origin + ": " + path + " is given twice, at line " + std::to_string(prev->second.line) +
                      " and at line " + std::to_string(key_line) + "; keep one");
  out[path] = e;
}

// ---------------------------------------------------------------------------------------------
// Presets.

fs::path preset_dir(const std::string& kind) { return fs::path(data_root()) / "scenarios" / kind; }

const char* preset_kind_word(const std::string& kind) {
  return kind == "models" ? "model" : kind == "clusters" ? "cluster" : "GPU";
}

// A preset is a name under scenarios/<kind>/ or a path to a YAML file (relative to the file that
// names it).
fs::path find_preset(const Entry& e, const std::string& kind) {
  const std::string name = get_string(e);
  const bool is_path = name.find('/') != std::string::npos || (name.size() > 5 && name.substr(name.size() - 5) == ".yaml");
  if (is_path) {
    fs::path p(name);
    if (p.is_relative() && e.line > 0) p = fs::path(e.origin).parent_path() / p;
    if (fs::exists(p)) return p;
    throw ConfigError(e.origin + ": " + e.where() + ": " + preset_kind_word(kind) + " preset file '" + p.string() + "' does not exist");
  }
  fs::path p = preset_dir(kind) / (name + ".yaml");
  if (fs::exists(p)) return p;
  const auto available = list_presets(kind);
  std::string msg = e.origin + ": " + e.where() + ": unknown " + preset_kind_word(kind) + " preset '" + name + "'";
  const std::string near = closest(name, available);
  if (!near.empty()) msg += "; did you mean '" + near + "'?";
  msg += " Available " + std::string(preset_kind_word(kind)) + " presets: " + (available.empty() ? "(none found under " + preset_dir(kind).string() + ")" : join(available));
  throw ConfigError(msg);
}

YAML::Node load_yaml_file(const std::string& path, const std::string& shown) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open '" + shown + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return YAML::Load(ss.str());
  } catch (const YAML::ParserException& ex) {
    throw ConfigError(shown + ": malformed YAML at line " + std::to_string(ex.mark.line + 1) + ", column " +
                      std::to_string(ex.mark.column + 1) + ": " + ex.msg);
  }
}

// Adds to `merged` every key of the preset named at merged[preset_key] that `merged` lacks (a
// preset may itself name a preset). Returns the preset's name.
std::string merge_preset(Layer& merged, const std::string& section, const std::string& kind) {
  const std::string preset_key = section + ".preset";
  std::string first_name;
  std::set<std::string> seen;
  auto it = merged.find(preset_key);
  if (it == merged.end()) return {};
  Entry current = it->second;
  first_name = get_string(current);
  for (int depth = 0; depth < 8; ++depth) {
    const fs::path file = find_preset(current, kind);
    const std::string shown = file.lexically_normal().string();
    if (!seen.insert(shown).second) throw ConfigError(shown + ": presets name each other in a cycle");
    YAML::Node root = load_yaml_file(file.string(), shown);
    if (!root.IsMap()) throw ConfigError(shown + ": a " + std::string(preset_kind_word(kind)) + " preset must be a YAML mapping of " + section + " keys");
    Layer layer;
    flatten(section, root, 0, shown, layer);
    std::optional<Entry> next;
    for (auto& [k, e] : layer) {
      if (k == preset_key) { next = e; continue; }
      if (!merged.count(k)) merged[k] = e;
    }
    if (!next) return first_name;
    current = *next;
  }
  throw ConfigError(current.origin + ": presets nest more than 8 deep");
}

// ---------------------------------------------------------------------------------------------

const char* kBatchKeys[] = {"training.global_batch", "training.micro_batch", "training.grad_accum"};

// Puts `upper` over `lower`. A layer that sets some of the batch triple keeps the lower layers'
// other batch keys only while they leave one of the three to derive (docs: "Batch size").
void overlay(Layer& lower, const Layer& upper, bool replaces_batch) {
  bool set[3];
  int n_set = 0, n_low_others = 0;
  for (int i = 0; i < 3; ++i) {
    set[i] = upper.count(kBatchKeys[i]) > 0;
    n_set += set[i];
    n_low_others += !set[i] && lower.count(kBatchKeys[i]) > 0;
  }
  if (replaces_batch || n_set >= 2) {
    for (auto* k : kBatchKeys) lower.erase(k);
  } else if (n_set == 1 && n_low_others == 2) {
    // one key set over a lower layer that has the other two: re-derive grad_accum, or micro_batch
    // when grad_accum is the one being set.
    lower.erase(set[2] ? kBatchKeys[1] : kBatchKeys[2]);
  }
  for (const auto& [k, e] : upper) lower[k] = e;
}

// A key's value in the resolved form to_yaml writes ("2", "[0.9, 0.95]"), for comparisons.
std::string resolved_value(const Scenario& s, const std::string& key) {
  YAML::Node n = YAML::Load(to_yaml(s));
  std::stringstream path(key);
  std::string part;
  while (std::getline(path, part, '.')) {
    if (!n.IsMap() || !n[part]) return {};
    n.reset(n[part]);
  }
  YAML::Emitter y;
  y << YAML::Flow << n;
  return y.c_str();
}

// One warning per scenario value (written, from a preset, or dssim's default) that the ds_config
// replaces, saying whether the ds_config wrote it or it is DeepSpeed's default for a key left out.
std::vector<std::string> ds_override_warnings(const Layer& merged, const DeepSpeedLayer& ds) {
  Layer base = merged;
  try {
    merge_preset(base, "model", "models");
  } catch (const ConfigError&) {
  }
  std::vector<std::string> out;
  for (const auto& [k, e] : ds.settings) {
    Scenario a, b;
    auto it = base.find(k);
    if (it == base.end() && k.rfind("training.", 0) == 0 && k != "training.gradient_clipping") continue;  // derived
    try {
      if (it != base.end()) find_field(k)->set(a, it->second);
      find_field(k)->set(b, e);
    } catch (const ConfigError&) {
      continue;  // reported when the value is read
    }
    const std::string was = resolved_value(a, k), now = resolved_value(b, k);
    if (was == now) continue;
    auto d = ds.defaulted.find(k);
    if (d != ds.defaulted.end())
      out.push_back("ds_config: " + k + " = " + now + " replaces the scenario's " + was + " (" + d->second + ")");
    else
      out.push_back("ds_config key '" + e.written_as + "' sets " + k + " = " + now + ", replacing the scenario's " + was);
  }
  return out;
}

Layer parse_overrides(const std::vector<std::string>& overrides) {
  Layer layer;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      throw ConfigError("--set expects key.path=value (e.g. --set parallel.tp=4), got '" + o + "'");
    std::string key = o.substr(0, eq);
    while (!key.empty() && key.back() == ' ') key.pop_back();
    const std::string text = o.substr(eq + 1);
    YAML::Node value;
    try {
      value.reset(YAML::Load(text));
    } catch (const YAML::Exception&) {
      value.reset(YAML::Node(text));
    }
    if (!value.IsDefined() || value.IsNull()) value.reset(YAML::Node(text));
    Layer one;
    if (!find_field(key) && !sections().count(key)) unknown_key(key, "--set", 0);
    flatten(key, value, 0, "--set", one);
    for (auto& [k, e] : one) {
      e.written_as = "";
      layer[k] = e;
    }
  }
  return layer;
}

std::string stem_of(const std::string& source) {
  if (source.empty() || source[0] == '<') return "custom";
  return fs::path(source).stem().string();
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string data_root() {
  if (const char* h = std::getenv("DSSIM_HOME"); h && *h) return h;
  return DSSIM_SOURCE_ROOT;
}

std::vector<std::string> list_presets(const std::string& kind) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(preset_dir(kind), ec))
    if (e.path().extension() == ".yaml") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

Scenario load_scenario(const std::string& path, const LoadOptions& opts) {
  fs::path p(path);
  if (!fs::exists(p) && p.is_relative()) {
    for (const auto& candidate : {fs::path(data_root()) / "scenarios" / path,
                                  fs::path(data_root()) / "scenarios" / (path + ".yaml")})
      if (fs::is_regular_file(candidate)) { p = candidate; break; }
  }
  if (!fs::is_regular_file(p)) {
    std::vector<std::string> shipped;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::path(data_root()) / "scenarios", ec))
      if (e.path().extension() == ".yaml") shipped.push_back(e.path().stem().string());
    std::sort(shipped.begin(), shipped.end());
    throw ConfigError("cannot open scenario '" + path + "': no such file" +
                      (shipped.empty() ? std::string() : "; shipped scenarios: " + join(shipped)));
  }
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return load_scenario_from_string(ss.str(), opts, p.string());
}

Scenario load_scenario_from_string(const std::string& yaml, const LoadOptions& opts, const std::string& source) {
  // 1. The scenario file.
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& ex) {
    throw ConfigError(source + ": malformed YAML at line " + std::to_string(ex.mark.line + 1) + ", column " +
                      std::to_string(ex.mark.column + 1) + ": " + ex.msg);
  }
  if (!root.IsDefined() || root.IsNull()) throw ConfigError(source + ": the scenario is empty; start from one under " + data_root() + "/scenarios/");
  Layer merged;
  flatten("", root, 0, source, merged);

  // 2. ds_config.json, then 3. --set.
  std::vector<std::string> warnings;
  bool deepspeed_pipeline = false;  // the ds_config has a pipeline section: DeepSpeed's PipelineModule partitions
  if (!opts.deepspeed_config.empty()) {
    DeepSpeedLayer ds = load_deepspeed_config(opts.deepspeed_config);
    deepspeed_pipeline = ds.pipeline_section;
    for (const auto& [k, e] : ds.settings)
      if (!find_field(k)) throw std::logic_error("ds_config mapping produced unknown key " + k);
    warnings = std::move(ds.warnings);
    for (auto& w : ds_override_warnings(merged, ds)) warnings.push_back(std::move(w));
    // AutoTP changes tp: a data-parallel size the scenario wrote for its own tp is re-derived.
    if (ds.settings.count("parallel.tp") && merged.count("parallel.dp") &&
        merged.at("parallel.dp").origin != "--set") {
      warnings.push_back("the ds_config sets parallel.tp (" + ds.settings.at("parallel.tp").written_as +
                         "): the scenario's parallel.dp is re-derived as GPUs / (tp * pp)");
      merged.erase("parallel.dp");
    }
    overlay(merged, ds.settings, ds.sets_batch);
  }
  overlay(merged, parse_overrides(opts.overrides), false);

  // 4. Presets fill in what no layer set.
  const std::string model_preset = merge_preset(merged, "model", "models");
  const std::string cluster_preset = merge_preset(merged, "cluster", "clusters");
  const std::string gpu_preset = merge_preset(merged, "cluster.gpu", "gpus");

  // 5. Typed values.
  Scenario s;
  s.source = source;
  s.name = stem_of(source);
  s.model.name = model_preset.empty() ? "custom" : model_preset;
  s.cluster.name = cluster_preset.empty() ? "custom" : cluster_preset;
  s.cluster.gpu.name = gpu_preset.empty() ? "custom" : gpu_preset;
  for (const auto& [k, e] : merged) find_field(k)->set(s, e);
  if (!merged.count("model.ffn_hidden")) s.model.ffn_hidden = 4 * s.model.hidden;
  // DeepSpeed ignores offload_param below stage 3 (only stage 3 partitions parameters).
  if (auto it = merged.find("zero.offload_param");
      it != merged.end() && it->second.origin == opts.deepspeed_config && !opts.deepspeed_config.empty() &&
      s.zero.offload_param && s.zero.stage != 3) {
    warnings.push_back("ds_config key '" + it->second.written_as + "' offloads parameters, but zero.stage is " +
                       std::to_string(s.zero.stage) + ": DeepSpeed ignores offload_param below stage 3, and so does dssim");
    s.zero.offload_param = false;
    merged.erase(it);
  }
  // ZeRO++ (qwZ, qgZ, hpZ) is stage 3's: DeepSpeed's stages 1 and 2 ignore the keys.
  for (const char* key : {"zero.quantized_weights", "zero.quantized_gradients", "zero.hpz_partition_size"}) {
    auto it = merged.find(key);
    if (it == merged.end() || s.zero.stage == 3) continue;
    const bool on = std::string(key) == "zero.hpz_partition_size" ? s.zero.hpz_partition_size > 1
                    : std::string(key) == "zero.quantized_weights" ? s.zero.quantized_weights
                                                                   : s.zero.quantized_gradients;
    if (!on) continue;
    warnings.push_back((it->second.written_as.empty() ? std::string(key) : "ds_config key '" + it->second.written_as + "'") +
                       " is a ZeRO++ option, but zero.stage is " + std::to_string(s.zero.stage) +
                       ": ZeRO++ applies to stage 3 only (DeepSpeed ignores it below), and so does dssim");
  }
  if (s.zero.stage != 3) {
    s.zero.quantized_weights = s.zero.quantized_gradients = false;
    s.zero.hpz_partition_size = 1;
  }

  auto where = [&](const std::string& key) -> std::string {
    auto it = merged.find(key);
    if (it == merged.end()) return {};
    const Entry& e = it->second;
    if (e.origin == "--set") return " (--set)";
    if (!e.written_as.empty()) return " (ds_config " + e.written_as + ")";
    if (e.line > 0) return e.origin == source ? " at line " + std::to_string(e.line)
                                               : " (line " + std::to_string(e.line) + " of " + e.origin + ")";
    return {};
  };
  const bool dp_given = merged.count("parallel.dp") > 0;
  auto& par = s.parallel;
  auto& cl = s.cluster;

  // 6. --gpus resizes the cluster and the data-parallel degree.
  bool dp_from_gpus = false;
  if (opts.gpus != 0) {
    const int n = opts.gpus;
    resize_cluster(cl, n);
    if (n % (par.tp * par.pp) != 0)
      throw ConfigError("--gpus " + std::to_string(n) + " is not a multiple of parallel.tp * parallel.pp = " +
                        std::to_string(par.tp) + " * " + std::to_string(par.pp) + " = " + std::to_string(par.tp * par.pp) +
                        ": use a multiple of " + std::to_string(par.tp * par.pp) + " or change tp / pp");
    par.dp = n / (par.tp * par.pp);
    dp_from_gpus = true;
  }
  // 7. dp defaults to what the cluster leaves after tp and pp.
  if (!dp_given && !dp_from_gpus) {
    const int w = cl.world();
    if (w % (par.tp * par.pp) != 0)
      throw ConfigError(source + ": parallel.tp * parallel.pp = " + std::to_string(par.tp) + " * " + std::to_string(par.pp) +
                        " = " + std::to_string(par.tp * par.pp) + " does not divide the cluster's " + std::to_string(w) +
                        " GPUs (cluster.nodes " + std::to_string(cl.nodes) + " x cluster.gpus_per_node " +
                        std::to_string(cl.gpus_per_node) + "); change tp, pp or the cluster size");
    par.dp = w / (par.tp * par.pp);
  }
  // 8. DeepSpeed's batch rules over the data-parallel world. After --gpus, a fully given triple
  // keeps global_batch and micro_batch and re-derives grad_accum.
  if (dp_from_gpus && s.training.global_batch && s.training.micro_batch && s.training.grad_accum)
    s.training.grad_accum = 0;
  if (par.world() != cl.world()) validate(s, where);  // the size mismatch, before batch rules use dp
  if (par.dp >= 1) {
    try {
      resolve_batch(s.training, par.dp);
    } catch (const ConfigError& ex) {
      std::string loc;
      for (auto* k : kBatchKeys)
        if (auto w = where(k); !w.empty()) loc += (loc.empty() ? "" : ", ") + std::string(k) + w;
      throw ConfigError(source + ": " + ex.what() + (loc.empty() ? "" : " [" + loc + "]"));
    }
  }

  // 9. The pipeline engine (core/pipeline_engine.hpp). Unless a layer names it (a ds_config's
  // pipeline section names deepspeed), a run given a ds_config with pp > 1 is DeepSpeed's
  // PipelineEngine (Megatron-DeepSpeed, GPT-NeoX build a PipelineModule whenever pp > 1);
  // otherwise Megatron-LM's schedules.
  const bool engine_defaulted = !merged.count("parallel.pipeline_engine") && !opts.deepspeed_config.empty() && par.pp > 1;
  if (engine_defaulted) par.pipeline_engine = PipelineEngine::deepspeed;
  const KeyLocator locate = [&](const std::string& key) -> std::string {
    if (key == "parallel.pipeline_engine" && engine_defaulted)
      return " (the default for a ds_config with parallel.pp > 1)";
    return where(key);
  };

  // 10. Layers per pipeline stage (parallel.partition_method), then the cross-field rules.
  // DeepSpeed's pipeline engine partitions with PipelineModule's default, `parameters` (its json's
  // pipeline.partition, default "best", is parsed but read by nothing in DeepSpeed).
  if (deepspeed_pipeline && s.parallel.partition_method.empty() && s.parallel.interleave == 1)
    s.parallel.partition_method = "parameters";
  resolve_pipeline_partition(s, where);
  validate(s, locate);
  for (auto& w : validation_warnings(s)) warnings.push_back(std::move(w));
  s.warnings = std::move(warnings);
  return s;
}

// ---------------------------------------------------------------------------------------------

void resize_cluster(ClusterSpec& cl, int n) {
  if (n < 1) throw ConfigError("--gpus must be positive, got " + std::to_string(n));
  if (n < cl.gpus_per_node || (cl.nodes == 1 && cl.nics_per_node == 0)) {
    // fewer GPUs than a node holds, or a single host with no network: one node of n GPUs
    cl.nodes = 1;
    cl.gpus_per_node = n;
  } else if (n % cl.gpus_per_node != 0) {
    throw ConfigError("--gpus " + std::to_string(n) + " is not a multiple of cluster.gpus_per_node (" +
                      std::to_string(cl.gpus_per_node) + "): use a multiple of " + std::to_string(cl.gpus_per_node) +
                      " or fewer than " + std::to_string(cl.gpus_per_node));
  } else {
    cl.nodes = n / cl.gpus_per_node;
  }
}

std::string to_yaml(const Scenario& s) {
  YAML::Emitter y;
  y.SetDoublePrecision(17);
  y << YAML::BeginMap;
  y << YAML::Key << "name" << YAML::Value << s.name;
  const auto& m = s.model;
  y << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "name" << YAML::Value << m.name;
  y << YAML::Key << "layers" << YAML::Value << m.layers << YAML::Key << "hidden" << YAML::Value << m.hidden;
  y << YAML::Key << "heads" << YAML::Value << m.heads << YAML::Key << "ffn_hidden" << YAML::Value << m.ffn_hidden;
  y << YAML::Key << "vocab" << YAML::Value << m.vocab << YAML::Key << "seq_len" << YAML::Value << m.seq_len;
  y << YAML::Key << "experts" << YAML::Value << m.experts << YAML::Key << "top_k" << YAML::Value << m.top_k;
  y << YAML::Key << "moe_every" << YAML::Value << m.moe_every << YAML::Key << "capacity_factor" << YAML::Value << m.capacity_factor;
  if (m.is_moe()) {
    y << YAML::Key << "min_capacity" << YAML::Value << m.min_capacity << YAML::Key << "drop_tokens" << YAML::Value
      << m.drop_tokens << YAML::Key << "use_rts" << YAML::Value << m.use_rts;
    y << YAML::Key << "noisy_gate_policy" << YAML::Value << to_string(m.noisy_gate_policy) << YAML::Key
      << "moe_loss_coeff" << YAML::Value << m.moe_loss_coeff;
  }
  y << YAML::Key << "tied_embeddings" << YAML::Value << m.tied_embeddings;
  y << YAML::Key << "attention" << YAML::Value << (m.flash_attention ? "flash" : "unfused");
  y << YAML::Key << "cross_entropy" << YAML::Value << to_string(m.cross_entropy);
  y << YAML::Key << "dropout" << YAML::Value << m.dropout;
  y << YAML::Key << "kv_heads" << YAML::Value << m.kv_heads_or_heads();
  y << YAML::Key << "mlp" << YAML::Value << (m.swiglu ? "swiglu" : "gelu");
  y << YAML::Key << "norm" << YAML::Value << (m.rmsnorm ? "rmsnorm" : "layernorm");
  y << YAML::Key << "position" << YAML::Value << (m.rotary ? "rotary" : "learned");
  y << YAML::Key << "bias" << YAML::Value << m.bias;
  y << YAML::Key << "elementwise" << YAML::Value << (m.eager_elementwise ? "eager" : "fused");
  // The engine's fused kernels, written only when on (a record of a run that took them).
  if (m.cross_entropy_kernel) y << YAML::Key << "cross_entropy_kernel" << YAML::Value << true;
  if (m.gemm_epilogues) y << YAML::Key << "gemm_epilogues" << YAML::Value << true;
  y << YAML::EndMap;
  const auto& t = s.training;
  y << YAML::Key << "training" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "global_batch" << YAML::Value << t.global_batch << YAML::Key << "micro_batch" << YAML::Value << t.micro_batch;
  y << YAML::Key << "grad_accum" << YAML::Value << t.grad_accum << YAML::Key << "tokens_to_train" << YAML::Value << t.tokens_to_train;
  y << YAML::Key << "gradient_clipping" << YAML::Value << t.gradient_clipping << YAML::Key << "seed" << YAML::Value << t.seed;
  y << YAML::EndMap;
  const auto& p = s.parallel;
  y << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "tp" << YAML::Value << p.tp << YAML::Key << "pp" << YAML::Value << p.pp;
  y << YAML::Key << "dp" << YAML::Value << p.dp << YAML::Key << "ep" << YAML::Value << p.ep;
  y << YAML::Key << "sequence_parallel" << YAML::Value << p.sequence_parallel << YAML::Key << "interleave" << YAML::Value << p.interleave;
  if (!p.partition.empty()) y << YAML::Key << "partition" << YAML::Value << YAML::Flow << p.partition;
  if (!p.partition_method.empty()) y << YAML::Key << "partition_method" << YAML::Value << p.partition_method;
  y << YAML::Key << "pipeline_engine" << YAML::Value << to_string(p.pipeline_engine);
  if (p.pipeline_engine == PipelineEngine::deepspeed)
    y << YAML::Key << "pipe_partitioned" << YAML::Value << p.pipe_partitioned << YAML::Key << "grad_partitioned"
      << YAML::Value << p.grad_partitioned;
  y << YAML::EndMap;
  const auto& z = s.zero;
  y << YAML::Key << "zero" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "stage" << YAML::Value << z.stage << YAML::Key << "engine" << YAML::Value << to_string(z.engine);
  y << YAML::Key << "offload_optimizer" << YAML::Value << z.offload_optimizer;
  y << YAML::Key << "offload_param" << YAML::Value << z.offload_param << YAML::Key << "overlap_comm" << YAML::Value << z.overlap_comm;
  if (z.nvme_optimizer) y << YAML::Key << "offload_optimizer_device" << YAML::Value << "nvme";
  if (z.nvme_param) y << YAML::Key << "offload_param_device" << YAML::Value << "nvme";
  y << YAML::Key << "reduce_bucket_size" << YAML::Value << z.reduce_bucket_size;
  y << YAML::Key << "allgather_bucket_size" << YAML::Value << z.allgather_bucket_size;
  y << YAML::Key << "prefetch_bucket_size" << YAML::Value << z.prefetch_bucket_size;
  y << YAML::Key << "param_persistence_threshold" << YAML::Value << z.param_persistence_threshold;
  y << YAML::Key << "max_live_parameters" << YAML::Value << z.max_live_parameters;
  y << YAML::Key << "quantized_weights" << YAML::Value << z.quantized_weights;
  y << YAML::Key << "quantized_gradients" << YAML::Value << z.quantized_gradients;
  y << YAML::Key << "hpz_partition_size" << YAML::Value << z.hpz_partition_size;
  y << YAML::Key << "grad_accum_dtype" << YAML::Value << (z.grad_accum_fp32 ? "fp32" : "model");
  y << YAML::EndMap;
  const auto& ls = s.precision.loss_scale;
  y << YAML::Key << "precision" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "dtype" << YAML::Value << to_string(s.precision.dtype);
  // the dtype the gradient reduction moves (unset = dtype: written as such)
  y << YAML::Key << "communication_dtype" << YAML::Value << to_string(s.precision.communication_dtype.value_or(s.precision.dtype));
  y << YAML::Key << "loss_scale" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "scale" << YAML::Value << ls.loss_scale << YAML::Key << "initial_scale_power" << YAML::Value << ls.initial_scale_power;
  y << YAML::Key << "loss_scale_window" << YAML::Value << ls.loss_scale_window << YAML::Key << "hysteresis" << YAML::Value << ls.hysteresis;
  y << YAML::Key << "min_loss_scale" << YAML::Value << ls.min_loss_scale;
  y << YAML::EndMap << YAML::EndMap;
  const auto& o = s.optimizer;
  y << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "type" << YAML::Value << to_string(o.kind) << YAML::Key << "lr" << YAML::Value << o.lr;
  y << YAML::Key << "betas" << YAML::Value << YAML::Flow << std::vector<double>{o.beta1, o.beta2};
  y << YAML::Key << "eps" << YAML::Value << o.eps << YAML::Key << "weight_decay" << YAML::Value << o.weight_decay;
  y << YAML::Key << "freeze_step" << YAML::Value << o.freeze_step << YAML::Key << "step" << YAML::Value << o.step;
  if (!o.fused_step) y << YAML::Key << "fused_step" << YAML::Value << false;
  y << YAML::EndMap;
  const auto& ck = s.checkpointing;
  if (ck.partition_activations || ck.cpu_checkpointing || ck.contiguous_memory_optimization) {
    y << YAML::Key << "activation_checkpointing" << YAML::Value << YAML::BeginMap;
    y << YAML::Key << "mode" << YAML::Value << to_string(s.recompute);
    y << YAML::Key << "partition_activations" << YAML::Value << ck.partition_activations;
    y << YAML::Key << "cpu_checkpointing" << YAML::Value << ck.cpu_checkpointing;
    y << YAML::Key << "contiguous_memory_optimization" << YAML::Value << ck.contiguous_memory_optimization;
    y << YAML::EndMap;
  } else {
    y << YAML::Key << "activation_checkpointing" << YAML::Value << to_string(s.recompute);
  }
  const auto& ft = s.finetune;
  if (ft.freezes_anything()) {
    y << YAML::Key << "finetune" << YAML::Value << YAML::BeginMap;
    y << YAML::Key << "method" << YAML::Value << (ft.lora() ? "lora" : "full");
    if (ft.lora()) {
      y << YAML::Key << "rank" << YAML::Value << ft.rank << YAML::Key << "alpha" << YAML::Value << ft.alpha;
      y << YAML::Key << "dropout" << YAML::Value << ft.dropout;
      std::vector<std::string> t;
      for (LoraTarget x : lora_targets(s.model, ft)) t.push_back(to_string(x));
      y << YAML::Key << "targets" << YAML::Value << YAML::Flow << t;
    } else {
      std::vector<std::string> fr;
      if (ft.freeze_embeddings) fr.push_back("embeddings");
      if (ft.freeze_norms) fr.push_back("norms");
      if (ft.freeze_attention) fr.push_back("attention");
      if (ft.freeze_mlp) fr.push_back("mlp");
      if (ft.freeze_head) fr.push_back("lm_head");
      y << YAML::Key << "freeze" << YAML::Value << YAML::Flow << fr;
    }
    y << YAML::EndMap;
  }
  const auto& c = s.cluster;
  y << YAML::Key << "cluster" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "name" << YAML::Value << c.name;
  y << YAML::Key << "nodes" << YAML::Value << c.nodes << YAML::Key << "gpus_per_node" << YAML::Value << c.gpus_per_node;
  y << YAML::Key << "intra_node" << YAML::Value << c.intra_node << YAML::Key << "nics_per_node" << YAML::Value << c.nics_per_node;
  y << YAML::Key << "host_cpu" << YAML::Value << c.host_cpu;
  y << YAML::Key << "nic_bandwidth" << YAML::Value << c.nic_bandwidth << YAML::Key << "nic_latency" << YAML::Value << c.nic_latency;
  y << YAML::Key << "topology" << YAML::Value << c.topology << YAML::Key << "fat_tree_levels" << YAML::Value << c.fat_tree_levels;
  y << YAML::Key << "oversubscription" << YAML::Value << c.oversubscription << YAML::Key << "switch_latency" << YAML::Value << c.switch_latency;
  y << YAML::Key << "host_memory" << YAML::Value << c.host_memory_bytes;
  y << YAML::Key << "host_memory_bandwidth" << YAML::Value << c.host_memory_bandwidth;
  if (c.nvme_bandwidth > 0) y << YAML::Key << "nvme_bandwidth" << YAML::Value << c.nvme_bandwidth;
  if (!c.device_profile.empty()) y << YAML::Key << "device_profile" << YAML::Value << c.device_profile;
  const auto& g = c.gpu;
  y << YAML::Key << "gpu" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "name" << YAML::Value << g.name;
  y << YAML::Key << "memory" << YAML::Value << g.memory_bytes << YAML::Key << "hbm_bandwidth" << YAML::Value << g.hbm_bandwidth;
  y << YAML::Key << "peak_flops_16" << YAML::Value << g.peak_flops_16 << YAML::Key << "peak_flops_32" << YAML::Value << g.peak_flops_32;
  y << YAML::Key << "nvlink_bandwidth" << YAML::Value << g.nvlink_bandwidth << YAML::Key << "nvlink_latency" << YAML::Value << g.nvlink_latency;
  y << YAML::Key << "nvlink_efficiency" << YAML::Value << g.nvlink_efficiency;
  y << YAML::Key << "pcie_bandwidth" << YAML::Value << g.pcie_bandwidth << YAML::Key << "pcie_latency" << YAML::Value << g.pcie_latency;
  y << YAML::Key << "gemm_efficiency" << YAML::Value << g.gemm_efficiency << YAML::Key << "gemm_half_flops" << YAML::Value << g.gemm_half_flops;
  y << YAML::Key << "attention_efficiency" << YAML::Value << g.attention_efficiency;
  y << YAML::Key << "memory_efficiency" << YAML::Value << g.memory_efficiency << YAML::Key << "kernel_launch" << YAML::Value << g.kernel_launch;
  if (g.tdp > 0) y << YAML::Key << "tdp" << YAML::Value << g.tdp;
  if (g.power_limit > 0) y << YAML::Key << "power_limit" << YAML::Value << g.power_limit;
  y << YAML::EndMap << YAML::EndMap;
  y << YAML::EndMap;
  return std::string(y.c_str()) + "\n";
}

}  // namespace dssim
