#include "core/deepspeed_config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include "core/scenario_loader.hpp"

namespace dssim {

namespace {

using json = nlohmann::json;

// Top-level keys DeepSpeed's config defines (deepspeed/runtime/config.py and the config-json docs)
// that dssim does not map. Each is warned as one line per block.
const std::set<std::string> kDeepSpeedTopLevel = {
    "scheduler", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "amp", "torch_autocast",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "aio", "autotuning", "flops_profiler",
    "sparse_attention", "data_efficiency", "curriculum_learning", "monitor_config", "tensorboard", "wandb",
    "csv_monitor", "comet", "elasticity", "checkpoint", "steps_per_print", "wall_clock_breakdown", "dump_state",
    "memory_breakdown", "comms_logger", "compression_training", "pipeline", "progressive_layer_drop", "eigenvalue",
    "quantize_training", "hybrid_engine", "nebula", "weight_quantization", "disable_allgather",
    "load_universal_checkpoint", "use_node_local_storage", "graph_harvesting", "zero_optimization_stage",
    "use_data_before_expert_parallelism", "timers", "compile", "train_batch_size_per_gpu", "gradient_accumulation_dtype",
    "communication_data_type", "seq_parallel_communication_data_type", "data_types", "zero_force_ds_cpu_optimizer",
    "fp16_master_weights_and_gradients", "dataloader_drop_last", "memory_breakdown", "bf16_optimizer",
    "checkpoint_parallel_write_pipeline", "tensor_parallel", "sequence_parallel_size", "pld", "mup",
    "gradient_allreduce_op", "log_level", "managed_gradient_accumulation",
};

// Keys that change memory or communication in DeepSpeed but not in dssim, with the value that
// means "off" (what dssim models): any other value gets the strong warning.
struct Unmodelled {
  const char* key;
  json off;  // null: any value given is warned
  const char* what;
};
const std::vector<Unmodelled>& unmodelled() {
  static const std::vector<Unmodelled> u = {
      {"seq_parallel_communication_data_type", json(), "the dtype of sequence-parallel collectives (traffic)"},
      {"bf16.bf16_master_weights_and_grads", json(false), "bf16 master weights and gradients (memory)"},
      {"bf16.bf16_optimizer_states", json(false), "bf16 optimizer states (memory)"},
      {"bf16.immediate_grad_update", json(false), "gradient update timing (memory)"},
      {"fp16.fp16_master_weights_and_grads", json(false), "fp16 master weights and gradients (memory)"},
      {"zero_optimization.sub_group_size", json(1000000000), "the optimizer step's sub-group size (memory)"},
      {"zero_optimization.stage3_max_reuse_distance", json(1000000000), "ZeRO-3 parameter reuse (memory, traffic)"},
      {"zero_optimization.model_persistence_threshold", json(), "ZeRO-3 persistent parameters (memory)"},
      {"zero_optimization.zero_quantized_nontrainable_weights", json(false), "ZeRO++ quantized frozen weights (memory)"},
      {"zero_optimization.zeropp_loco_param", json(), "ZeRO++ LoCo error feedback (memory, traffic)"},
      {"zero_optimization.mics_shard_size", json(-1), "MiCS sharding (memory, traffic)"},
      {"zero_optimization.mics_hierarchical_params_gather", json(false), "MiCS hierarchical gather (traffic)"},
      {"zero_optimization.use_all_reduce_for_fetch_params", json(false), "ZeRO-3 parameter fetch (traffic)"},
      {"zero_optimization.stage3_use_all_reduce_for_fetch_params", json(false), "ZeRO-3 parameter fetch (traffic)"},
      {"zero_optimization.round_robin_gradients", json(false), "gradient partition order (traffic)"},
      {"zero_optimization.use_multi_rank_bucket_allreduce", json(true), "bucketed all-reduce (traffic)"},
      {"zero_optimization.zenflow", json(), "ZenFlow offload (memory, traffic)"},
      {"zero_optimization.memory_efficient_linear", json(true), "ZeRO-3 linear memory (memory)"},
      {"zero_optimization.offload_optimizer.ratio", json(1.0), "partial optimizer offload (memory)"},
      {"sparse_gradients", json(false), "sparse embedding gradients (traffic)"},
      {"disable_allgather", json(false), "the ZeRO all-gather (traffic)"},
      {"torch_autocast", json(), "torch.autocast mixed precision (memory, compute)"},
      {"amp", json(), "NVIDIA apex AMP mixed precision (memory, compute)"},
  };
  return u;
}

// zero_optimization keys DeepSpeed defines (DeepSpeedZeroConfig, extra="forbid") that dssim does
// not map and that change nothing dssim models: accepted with a plain warning.
const std::set<std::string> kZeroKnown = {
    "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold", "stage3_allgather_sequential",
    "allgather_sequential", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module", "cpu_offload_use_pin_memory",
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "module_granularity_threshold", "allgather_size",
};

// Names torch.optim defines; DeepSpeed builds any of them by name (getattr(torch.optim, type)).
const std::set<std::string> kTorchOptim = {"adadelta", "adafactor", "adagrad", "adam", "adamw", "sparseadam",
                                           "adamax", "asgd", "lbfgs", "nadam", "radam", "rmsprop", "rprop", "sgd"};

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A launch script's placeholder left in place: $GLOBAL_BATCH, ${MBS}, CONFIG_BATCH_SIZE.
bool looks_like_template(const std::string& s) {
  if (s.empty()) return false;
  if (s[0] == '$') return true;
  bool upper = false;
  for (char c : s) {
    if (std::isupper(static_cast<unsigned char>(c))) upper = true;
    else if (c != '_' && !std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return upper && s.size() >= 2 && (s.find('_') != std::string::npos || s.size() >= 3);
}

std::string template_message(const std::string& ds_key, const std::string& token) {
  return ds_key + ": unexpanded template placeholder " + token +
         ": this ds_config is a template that a launch script fills in (sed or a shell heredoc); run that "
         "substitution, or write the value in its place";
}

// Top-level keys the mapper handles itself.
const std::set<std::string> kMapped = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "moe", "activation_checkpointing",
    "tensor_parallel", "sequence_parallel_size", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "communication_data_type", "data_types", "gradient_accumulation_dtype"};

struct Mapper {
  std::string origin;
  DeepSpeedLayer out;
  std::set<std::string> warned_blocks;

  static std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

  [[noreturn]] void fail(const std::string& ds_key, const std::string& msg) const {
    throw ConfigError(origin + ": " + ds_key + ": " + msg);
  }

  void warn(const std::string& msg) { out.warnings.push_back(msg); }
  void warn_unused(const std::string& ds_key, const std::string& why) {
    warn("ds_config key '" + ds_key + "' " + why + "; ignored");
  }
  static size_t leaves(const json& j) {
    if (!j.is_object() || j.empty()) return 1;
    size_t n = 0;
    for (const auto& v : j) n += leaves(v);
    return n;
  }
  // A key or block dssim does not use: one line, however many keys the block holds. Keys that
  // change memory or traffic in DeepSpeed get the stronger wording.
  void ignore(const std::string& ds_key, const json& j, const std::string& why = "has no effect in dssim") {
    if (strong(ds_key, j)) return;
    if (j.is_object() && !j.empty()) {
      // the strong keys inside a block are still named one by one
      bool any_strong = false;
      for (auto it = j.begin(); it != j.end(); ++it)
        for (const auto& u : unmodelled())
          if (join(ds_key, it.key()) == u.key) any_strong = true;
      if (any_strong) {
        for (auto it = j.begin(); it != j.end(); ++it) ignore(join(ds_key, it.key()), it.value(), why);
        return;
      }
      if (j.contains("enabled") && j.at("enabled").is_boolean() && !j.at("enabled").get<bool>()) {
        warn("ds_config block '" + ds_key + "' is disabled (enabled: false); ignored");
        return;
      }
      const size_t n = leaves(j);
      warn("ds_config block '" + ds_key + "' (" + std::to_string(n) + (n == 1 ? " key" : " keys") + ") " + why +
           "; ignored");
      return;
    }
    warn_unused(ds_key, why);
  }
  bool strong(const std::string& ds_key, const json& j) {
    for (const auto& u : unmodelled()) {
      if (ds_key != u.key) continue;
      if (is_auto(j) || j.is_null()) return true;
      if (j.is_object() && j.contains("enabled") && j.at("enabled") == json(false)) return false;  // "is disabled"
      if (!u.off.is_null() && (j == u.off || (j.is_number() && u.off.is_number() && j.get<double>() == u.off.get<double>())))
        return true;  // the value dssim models
      warn("ds_config key '" + ds_key + "' = " + j.dump() + " changes " + u.what +
           " in DeepSpeed, which dssim does not model: the prediction is for the run without it");
      return true;
    }
    return false;
  }

  static bool is_auto(const json& j) { return j.is_string() && j.get<std::string>() == "auto"; }

  static YAML::Node to_yaml(const json& j) {
    if (j.is_array()) {
      YAML::Node seq(YAML::NodeType::Sequence);
      for (const auto& e : j) seq.push_back(to_yaml(e));
      return seq;
    }
    if (j.is_string()) return YAML::Node(j.get<std::string>());
    if (j.is_null()) return YAML::Node(YAML::NodeType::Null);
    if (j.is_object()) return YAML::Node(YAML::NodeType::Map);  // rejected by the typed reader
    return YAML::Node(j.dump());  // numbers and booleans keep their JSON spelling
  }

  void set(const std::string& key, const std::string& ds_key, const YAML::Node& value) {
    Entry e;
    e.key = key;
    e.value.reset(value);
    e.origin = origin;
    e.written_as = ds_key;
    out.settings[key] = e;
    out.defaulted.erase(key);
  }
  // DeepSpeed's default for a key the ds_config leaves out (the layering rule).
  void set_default(const std::string& key, const std::string& ds_key, const std::string& value, const std::string& why) {
    if (out.settings.count(key) || auto_keys.count(key)) return;
    set(key, ds_key, YAML::Node(value));
    out.defaulted[key] = why;
  }
  // "auto" keys are listed in one warning at the end.
  void keep_auto(const std::string& key, const std::string& ds_key) {
    auto_names.push_back(ds_key + " (" + key + ")");
    auto_keys.insert(key);
  }
  std::vector<std::string> auto_names;
  std::set<std::string> auto_keys;  // "auto": neither set nor defaulted

  enum class Kind { Number, Integer, Bool, Any };
  void check_type(const std::string& ds_key, const json& j, Kind kind) const {
    if (kind == Kind::Any) return;
    if (j.is_string()) {
      const std::string s = j.get<std::string>();
      if (looks_like_template(s)) throw ConfigError(origin + ": " + template_message(ds_key, "\"" + s + "\""));
      if (kind == Kind::Bool) fail(ds_key, "expected true or false, got the string " + j.dump() + "; write it without quotes");
      fail(ds_key, "expected a number, got the string " + j.dump() +
                       " (DeepSpeed does not convert strings to numbers); write it without quotes");
    }
    if (kind == Kind::Bool) {
      if (!j.is_boolean()) fail(ds_key, "expected true or false, got " + j.dump());
      return;
    }
    if (!j.is_number()) fail(ds_key, std::string("expected ") + (kind == Kind::Integer ? "an integer" : "a number") + ", got " + j.dump());
    if (kind == Kind::Integer && j.is_number_float()) {
      const double d = j.get<double>();
      if (std::isfinite(d) && d != std::floor(d)) fail(ds_key, "expected an integer, got " + j.dump());
    }
  }
  // Maps a ds value onto `key`; "auto" (Hugging Face's placeholder) keeps the scenario's value.
  void map(const std::string& key, const std::string& ds_key, const json& j, Kind kind = Kind::Any) {
    if (is_auto(j)) {
      keep_auto(key, ds_key);
      return;
    }
    if (j.is_object()) fail(ds_key, "expected a value, got an object");
    check_type(ds_key, j, kind);
    set(key, ds_key, to_yaml(j));
  }

  bool get_bool(const std::string& ds_key, const json& j) const {
    check_type(ds_key, j, Kind::Bool);
    return j.get<bool>();
  }

  void device(const std::string& key, const std::string& ds_key, const json& block) {
    if (block.is_null()) {
      set(key, ds_key, YAML::Node("false"));
      return;
    }
    if (!block.is_object()) fail(ds_key, "expected an object such as {\"device\": \"cpu\"}, got " + block.dump());
    bool on = false;
    for (auto it = block.begin(); it != block.end(); ++it) {
      const std::string k = join(ds_key, it.key());
      if (it.key() == "device") {
        if (is_auto(*it)) { keep_auto(key, k); continue; }
        if (!it->is_string()) fail(k, "expected \"cpu\", \"nvme\" or \"none\", got " + it->dump());
        std::string d = it->get<std::string>();
        if (d == "cpu") { set(key, k, YAML::Node("true")); on = true; }
        else if (d == "none") set(key, k, YAML::Node("false"));
        else if (d == "nvme") {  // ZeRO-Infinity: swapped through host buffers at cluster.nvme_bandwidth
          set(key, k, YAML::Node("true"));
          set(key + "_device", k, YAML::Node("nvme"));
          on = true;
        } else fail(k, "expected \"cpu\", \"nvme\" or \"none\", got \"" + d + "\"");
      } else if (it.key() == "ratio") {
        ignore(k, it.value());
      }
    }
    // offload buffers and pinning: one line for the lot
    json rest = json::object();
    for (auto it = block.begin(); it != block.end(); ++it)
      if (it.key() != "device" && it.key() != "ratio") rest[it.key()] = it.value();
    if (!rest.empty() && on) {
      std::string names;
      for (auto it = rest.begin(); it != rest.end(); ++it) names += (names.empty() ? "" : ", ") + it.key();
      warn("ds_config keys under '" + ds_key + "' (" + names + ") have no effect in dssim (offload buffers and pinning are not modeled); ignored");
    }
    if (!block.contains("device")) set(key, join(ds_key, "device"), YAML::Node("false"));  // DeepSpeed: device defaults to none
  }

  int zero_stage = -1;  // as the ds_config gives it; -1 = auto / unknown

  void zero(const json& z) {
    const std::string base = "zero_optimization";
    const std::string why = "the zero_optimization block leaves it out: DeepSpeed's default";
    if (z.is_boolean()) {  // legacy: "zero_optimization": true means stage 1
      set("zero.stage", base, YAML::Node(z.get<bool>() ? "1" : "0"));
      zero_stage = z.get<bool>() ? 1 : 0;
      zero_defaults(why);
      return;
    }
    if (!z.is_object()) fail(base, "expected an object, got " + z.dump());
    for (auto it = z.begin(); it != z.end(); ++it) {
      const std::string& k = it.key();
      const std::string dk = join(base, k);
      const json& v = it.value();
      if (k == "stage") {
        map("zero.stage", dk, v, Kind::Integer);
        if (v.is_number()) zero_stage = v.get<int>();
      } else if (k == "offload_optimizer") device("zero.offload_optimizer", dk, v);
      else if (k == "offload_param") device("zero.offload_param", dk, v);
      else if (k == "cpu_offload") {  // deprecated spelling of offload_optimizer.device = cpu
        set("zero.offload_optimizer", dk, YAML::Node(get_bool(dk, v) ? "true" : "false"));
        warn("ds_config key '" + dk + "' is deprecated in DeepSpeed; use zero_optimization.offload_optimizer.device");
      } else if (k == "cpu_offload_params" || k == "cpu_offload_param") {
        set("zero.offload_param", dk, YAML::Node(get_bool(dk, v) ? "true" : "false"));
        warn("ds_config key '" + dk + "' is deprecated in DeepSpeed; use zero_optimization.offload_param.device");
      } else if (k == "overlap_comm") map("zero.overlap_comm", dk, v, Kind::Bool);
      else if (k == "reduce_bucket_size") map("zero.reduce_bucket_size", dk, v, Kind::Integer);
      else if (k == "allgather_bucket_size") map("zero.allgather_bucket_size", dk, v, Kind::Integer);
      else if (k == "stage3_prefetch_bucket_size" || k == "prefetch_bucket_size") map("zero.prefetch_bucket_size", dk, v, Kind::Integer);
      else if (k == "stage3_param_persistence_threshold" || k == "param_persistence_threshold")
        map("zero.param_persistence_threshold", dk, v, Kind::Integer);
      else if (k == "stage3_max_live_parameters" || k == "max_live_parameters") map("zero.max_live_parameters", dk, v, Kind::Integer);
      // ZeRO++ (stage 3; the loader warns and drops them below): qwZ, qgZ, hpZ.
      else if (k == "zero_quantized_weights") map("zero.quantized_weights", dk, v, Kind::Bool);
      else if (k == "zero_quantized_gradients") map("zero.quantized_gradients", dk, v, Kind::Bool);
      else if (k == "zero_hpz_partition_size") map("zero.hpz_partition_size", dk, v, Kind::Integer);
      else if (k == "contiguous_gradients") {
        // dssim always models one contiguous gradient buffer: only `false` changes anything.
        if (!is_auto(v) && !get_bool(dk, v)) warn_unused(dk, "is false: dssim always models contiguous gradient buffers");
      } else if (k == "reduce_scatter" || k == "allgather_partitions") {
        if (!is_auto(v) && !get_bool(dk, v)) warn_unused(dk, "is false: dssim models ZeRO with reduce-scatter and all-gather");
      } else if (kZeroKnown.count(k)) {
        ignore(dk, v);
      } else {
        bool is_strong = false;
        for (const auto& u : unmodelled()) is_strong |= dk == u.key;
        if (is_strong) ignore(dk, v);
        else warn_unused(dk, "is not a zero_optimization key DeepSpeed defines (DeepSpeed refuses it)");
      }
    }
    zero_defaults(why);
  }
  void zero_defaults(const std::string& why) {
    const std::string base = "zero_optimization.";
    set_default("zero.stage", base + "stage", "0", why);
    if (zero_stage < 0 && !auto_keys.count("zero.stage")) zero_stage = 0;
    auto dflt = [&](const char* key, const char* ds, const std::string& v) { set_default(key, base + ds, v, why); };
    dflt("zero.offload_optimizer", "offload_optimizer", "false");
    dflt("zero.offload_param", "offload_param", "false");
    // DeepSpeed: overlap_comm defaults to true at stage 3, false below
    if (zero_stage >= 0) dflt("zero.overlap_comm", "overlap_comm", zero_stage == 3 ? "true" : "false");
    dflt("zero.reduce_bucket_size", "reduce_bucket_size", "500000000");
    dflt("zero.allgather_bucket_size", "allgather_bucket_size", "500000000");
    dflt("zero.prefetch_bucket_size", "stage3_prefetch_bucket_size", "50000000");
    dflt("zero.param_persistence_threshold", "stage3_param_persistence_threshold", "100000");
    dflt("zero.max_live_parameters", "stage3_max_live_parameters", "1000000000");
    dflt("zero.quantized_weights", "zero_quantized_weights", "false");
    dflt("zero.quantized_gradients", "zero_quantized_gradients", "false");
    dflt("zero.hpz_partition_size", "zero_hpz_partition_size", "1");
  }

  void precision(const json& root) {
    // DeepSpeed: fp16.enabled or bf16.enabled (older spelling: bfloat16); both off = fp32, and
    // "enabled" defaults to false inside a block.
    auto block = [&](const char* name) -> const json* {
      auto it = root.find(name);
      if (it == root.end()) return nullptr;
      if (!it->is_object()) fail(name, "expected an object such as {\"enabled\": true}, got " + it->dump());
      return &*it;
    };
    const json* f = block("fp16");
    const char* bf16_name = root.contains("bf16") ? "bf16" : "bfloat16";
    const json* b = block(bf16_name);
    bool any_auto = false;
    auto enabled = [&](const json* blk, const std::string& name) {
      if (!blk || !blk->contains("enabled")) return false;
      const json& e = blk->at("enabled");
      if (is_auto(e)) {
        any_auto = true;
        return false;
      }
      return get_bool(name + ".enabled", e);
    };
    const bool fp16 = enabled(f, "fp16");
    const bool bf16 = enabled(b, bf16_name);
    if (fp16 && bf16)
      throw ConfigError(origin + ": bf16 and fp16 modes cannot be simultaneously enabled (fp16.enabled and " +
                        std::string(bf16_name) + ".enabled are both true); enable one of them");
    if (fp16) set("precision.dtype", "fp16.enabled", YAML::Node("fp16"));
    else if (bf16) set("precision.dtype", std::string(bf16_name) + ".enabled", YAML::Node("bf16"));
    else if (any_auto) {
      // "auto" keeps the scenario's dtype, whatever the other block says when it is off.
      const bool f_auto = f && f->contains("enabled") && is_auto(f->at("enabled"));
      const bool b_auto = b && b->contains("enabled") && is_auto(b->at("enabled"));
      keep_auto("precision.dtype", f_auto && b_auto ? "fp16.enabled / " + std::string(bf16_name) + ".enabled"
                                   : f_auto       ? std::string("fp16.enabled")
                                                  : std::string(bf16_name) + ".enabled");
    } else {
      std::string why = !f && !b ? "the ds_config has neither an fp16 nor a bf16 block: DeepSpeed trains in fp32"
                                 : "neither fp16.enabled nor bf16.enabled is true: DeepSpeed trains in fp32";
      set_default("precision.dtype", f ? "fp16.enabled" : b ? std::string(bf16_name) + ".enabled" : "fp16 / bf16", "fp32", why);
    }
    if (f) {
      for (auto it = f->begin(); it != f->end(); ++it) {
        const std::string dk = "fp16." + it.key();
        const std::string& k = it.key();
        if (k == "enabled") continue;
        if (k == "loss_scale") map("precision.loss_scale.scale", dk, it.value(), Kind::Number);
        else if (k == "initial_scale_power") map("precision.loss_scale.initial_scale_power", dk, it.value(), Kind::Integer);
        else if (k == "loss_scale_window") map("precision.loss_scale.loss_scale_window", dk, it.value(), Kind::Integer);
        else if (k == "hysteresis") map("precision.loss_scale.hysteresis", dk, it.value(), Kind::Integer);
        else if (k == "min_loss_scale") map("precision.loss_scale.min_loss_scale", dk, it.value(), Kind::Number);
        else if (k == "auto_cast" || k == "consecutive_hysteresis") {
          if (!(it->is_boolean() && !it->get<bool>())) ignore(dk, it.value());
        } else ignore(dk, it.value());
      }
      if (fp16) {
        const std::string why = "the fp16 block leaves it out: DeepSpeed's default";
        set_default("precision.loss_scale.scale", "fp16.loss_scale", "0", why);
        set_default("precision.loss_scale.initial_scale_power", "fp16.initial_scale_power", "16", why);
        set_default("precision.loss_scale.loss_scale_window", "fp16.loss_scale_window", "1000", why);
        set_default("precision.loss_scale.hysteresis", "fp16.hysteresis", "2", why);
        set_default("precision.loss_scale.min_loss_scale", "fp16.min_loss_scale", "1", why);
      }
    }
    if (b)
      for (auto it = b->begin(); it != b->end(); ++it)
        if (it.key() != "enabled") ignore(std::string(bf16_name) + "." + it.key(), it.value());
  }

  void optimizer(const json& o) {
    if (!o.is_object()) fail("optimizer", "expected an object with \"type\" and \"params\", got " + o.dump());
    std::string kind;
    for (auto it = o.begin(); it != o.end(); ++it) {
      const std::string dk = "optimizer." + it.key();
      if (it.key() == "type") {
        if (is_auto(*it)) { keep_auto("optimizer.type", dk); continue; }
        if (!it->is_string()) fail(dk, "expected a string such as \"AdamW\", got " + it->dump());
        const std::string t = it->get<std::string>();
        const std::string l = lower(t);
        if (l == "adam" || l == "adamw" || l == "fusedadam" || l == "cpuadam" || l == "deepspeedcpuadam") kind = "adamw";
        else if (l == "onebitadam") kind = "onebit_adam";
        else if (l == "lamb" || l == "fusedlamb") kind = "lamb";
        else if (l == "lion" || l == "fusedlion" || l == "cpulion") kind = "lion";
        else if (l == "onebitlamb" || l == "zerooneadam")
          fail(dk, "\"" + t + "\" (compressed communication like 1-bit Adam, with its own error buffers and schedule) "
                   "is not modeled by dssim; use \"OneBitAdam\" for a 1-bit run or \"AdamW\" for the uncompressed one");
        else if (kTorchOptim.count(l) || l == "adagrad" || l == "muadam" || l == "muadamw" || l == "musgd" || l == "muon") {
          kind = "adamw";
          warn("ds_config key 'optimizer.type' is \"" + t + "\": dssim sizes it as Adam (two fp32 states per parameter, "
               "Adam's step cost), an upper bound for most optimizers");
        } else if (looks_like_template(t)) {
          throw ConfigError(origin + ": " + template_message(dk, "\"" + t + "\""));
        } else
          fail(dk, "unknown optimizer \"" + t + "\": DeepSpeed accepts its own (Adam, AdamW, Lamb, Lion, OneBitAdam, "
                   "Adagrad, ...) and torch.optim names (SGD, RMSprop, ...); dssim models Adam, AdamW, Lamb, Lion and OneBitAdam");
        set("optimizer.type", dk, YAML::Node(kind));
        if (kind == "lamb" || kind == "lion")
          warn("ds_config key 'optimizer.type' is \"" + t + "\": dssim models its optimizer states (" +
               (kind == "lamb" ? "momentum and variance, as Adam" : "one momentum") + ") and an Adam-sized step");
      } else if (it.key() == "params") {
        if (!it->is_object()) fail(dk, "expected an object, got " + it->dump());
        for (auto p = it->begin(); p != it->end(); ++p) {
          const std::string pk = dk + "." + p.key();
          const std::string& k = p.key();
          if (k == "lr") map("optimizer.lr", pk, p.value(), Kind::Number);
          else if (k == "betas") {
            if (!is_auto(p.value()) && !p->is_array()) fail(pk, "expected a list of two numbers such as [0.9, 0.999], got " + p->dump());
            if (p->is_array())
              for (size_t i = 0; i < p->size(); ++i) check_type(pk + "[" + std::to_string(i) + "]", p->at(i), Kind::Number);
            map("optimizer.betas", pk, p.value());
          } else if (k == "eps") map("optimizer.eps", pk, p.value(), Kind::Number);
          else if (k == "weight_decay") map("optimizer.weight_decay", pk, p.value(), Kind::Number);
          else if (k == "freeze_step") map("optimizer.freeze_step", pk, p.value(), Kind::Integer);
          else ignore(pk, p.value());
        }
      } else {
        ignore(dk, it.value());
      }
    }
    if (!kind.empty()) {
      // DeepSpeed builds the optimizer from params alone: what params leaves out is the optimizer's
      // default (FusedAdam / FusedLamb / FusedLion: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0).
      const std::string why = "optimizer.params leaves it out: the optimizer's default";
      set_default("optimizer.lr", "optimizer.params.lr", "0.001", why);
      if (!out.settings.count("optimizer.betas") && !auto_keys.count("optimizer.betas")) {
        YAML::Node b(YAML::NodeType::Sequence);
        b.push_back(YAML::Node("0.9"));
        b.push_back(YAML::Node("0.999"));
        set("optimizer.betas", "optimizer.params.betas", b);
        out.defaulted["optimizer.betas"] = why;
      }
      set_default("optimizer.eps", "optimizer.params.eps", "1e-08", why);
      set_default("optimizer.weight_decay", "optimizer.params.weight_decay", "0", why);
      if (kind == "onebit_adam") set_default("optimizer.freeze_step", "optimizer.params.freeze_step", "100000", why);
    }
  }

  void moe(const json& m) {
    // Not a DeepSpeed config block (DeepSpeed configures MoE in Python, deepspeed.moe.layer.MoE):
    // dssim's extension, with the MoE layer's argument names.
    if (!m.is_object()) fail("moe", "expected an object, got " + m.dump());
    if (m.contains("enabled") && !get_bool("moe.enabled", m.at("enabled"))) {
      warn("ds_config block 'moe' is disabled (moe.enabled is false); ignored");
      return;
    }
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string dk = "moe." + it.key();
      const std::string& k = it.key();
      if (k == "enabled") continue;
      if (k == "expert_parallel_size" || k == "ep_size") map("parallel.ep", dk, it.value(), Kind::Integer);
      else if (k == "num_experts") map("model.experts", dk, it.value(), Kind::Integer);
      else if (k == "top_k" || k == "k") map("model.top_k", dk, it.value(), Kind::Integer);
      else if (k == "capacity_factor") map("model.capacity_factor", dk, it.value(), Kind::Number);
      else if (k == "min_capacity") map("model.min_capacity", dk, it.value(), Kind::Integer);
      else if (k == "drop_tokens") map("model.drop_tokens", dk, it.value(), Kind::Bool);
      else if (k == "use_rts") map("model.use_rts", dk, it.value(), Kind::Bool);
      else if (k == "moe_loss_coeff" || k == "aux_loss_coeff") map("model.moe_loss_coeff", dk, it.value(), Kind::Number);
      else if (k == "noisy_gate_policy") {
        if (!it->is_null()) map("model.noisy_gate_policy", dk, it.value(), Kind::Any);  // None / Jitter / RSample
      }
      else ignore(dk, it.value());
    }
  }

  void activation_checkpointing(const json& a) {
    // DeepSpeed's block tunes deepspeed.checkpointing; whether layers are recomputed is decided by
    // the model code, which in dssim is the scenario's activation_checkpointing.
    if (!a.is_object()) fail("activation_checkpointing", "expected an object, got " + a.dump());
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string dk = "activation_checkpointing." + it.key();
      const std::string& k = it.key();
      if (k == "partition_activations" || k == "contiguous_memory_optimization" || k == "cpu_checkpointing") {
        // Modelled (core/scenario.hpp CheckpointingSpec) for layers the scenario recomputes in full.
        set("activation_checkpointing." + k, dk, YAML::Node(get_bool(dk, it.value()) ? "true" : "false"));
      } else if (k == "synchronize_checkpoint_boundary" || k == "profile") {
        if (it->is_boolean() && !it->get<bool>()) continue;  // off is what dssim models
        warn_unused(dk, "is on: dssim does not model it (set the scenario's activation_checkpointing: none|selective|full)");
      } else if (k == "number_checkpoints") {
        if (!it->is_null()) warn_unused(dk, "has no effect in dssim");
      } else {
        ignore(dk, it.value());
      }
    }
  }

  // DeepSpeed's pipeline block (runtime/config.py get_pipeline_config): its presence says the run is
  // DeepSpeed's PipelineEngine (parallel.pipeline_engine: deepspeed, core/pipeline_engine.hpp);
  // pipe_partitioned / grad_partitioned choose whether a stage sends its 1/tp slice.
  void pipeline(const json& t) {
    if (!t.is_object()) fail("pipeline", "expected an object such as {\"pipe_partitioned\": true}, got " + t.dump());
    set("parallel.pipeline_engine", "pipeline", YAML::Node("deepspeed"));
    for (auto it = t.begin(); it != t.end(); ++it) {
      const std::string dk = "pipeline." + it.key();
      if (it.key() == "pipe_partitioned") map("parallel.pipe_partitioned", dk, it.value(), Kind::Bool);
      else if (it.key() == "grad_partitioned") map("parallel.grad_partitioned", dk, it.value(), Kind::Bool);
      else ignore(dk, it.value());
    }
  }

  void tensor_parallel(const json& t) {
    if (!t.is_object()) fail("tensor_parallel", "expected an object such as {\"autotp_size\": 4}, got " + t.dump());
    for (auto it = t.begin(); it != t.end(); ++it) {
      const std::string dk = "tensor_parallel." + it.key();
      if (it.key() == "autotp_size") {
        map("parallel.tp", dk, it.value(), Kind::Integer);
        if (it->is_number() && it->get<double>() > 1)
          warn("ds_config key '" + dk + "' = " + it->dump() + ": AutoTP is modeled as Megatron-style tensor parallelism "
               "(column/row-parallel linears, two all-reduces per layer forward); the data-parallel size becomes GPUs / (tp * pp)");
      } else {
        ignore(dk, it.value());
      }
    }
  }

  // A DeepSpeed dtype name at key k, as `names` spells them (lower case -> fp32 / fp16 / bf16):
  // nullopt for null, and for "auto" (kept as auto for `target`); anything else fails.
  std::optional<std::string> dtype_name(const std::string& k, const json& v, const char* target,
                                        const std::map<std::string, std::string>& names) {
    if (v.is_null()) return std::nullopt;
    if (is_auto(v)) {
      keep_auto(target, k);
      return std::nullopt;
    }
    if (!v.is_string()) fail(k, "expected \"fp32\", \"fp16\" or \"bf16\", got " + v.dump());
    const auto it = names.find(lower(v.get<std::string>()));
    if (it != names.end()) return it->second;
    if (looks_like_template(v.get<std::string>())) throw ConfigError(origin + ": " + template_message(k, v.dump()));
    fail(k, "expected \"fp32\", \"fp16\" or \"bf16\" (DeepSpeed refuses anything else), got " + v.dump());
  }

  // DeepSpeed's get_communication_data_type: fp32 / fp16 / bf16 (bfp16), any case; null = the
  // compute dtype. The data-parallel gradient reduction moves that dtype (core/program_builder.cpp).
  void communication_data_type(const json& v) {
    const std::string k = "communication_data_type";
    static const std::map<std::string, std::string> names = {
        {"fp32", "fp32"}, {"fp16", "fp16"}, {"bf16", "bf16"}, {"bfp16", "bf16"}};
    if (const auto t = dtype_name(k, v, "precision.communication_dtype", names))
      set("precision.communication_dtype", k, YAML::Node(*t));
  }

  // DeepSpeed's gradient_accumulation_dtype (data_types.grad_accum_dtype, DtypeEnum's names, any
  // case): ZeRO-3's gradient partition dtype (zero.grad_accum_dtype). fp32 -> fp32; the 16-bit
  // names -> the training dtype, DeepSpeed's default with ZeRO. Stages 0-2 keep dssim's rules.
  void grad_accum_dtype(const std::string& k, const json& v) {
    static const std::map<std::string, std::string> names = {
        {"fp32", "fp32"},     {"float32", "fp32"}, {"float", "fp32"}, {"fp16", "fp16"},  {"float16", "fp16"},
        {"half", "fp16"},     {"bf16", "bf16"},    {"bfloat16", "bf16"}, {"bfp16", "bf16"}};
    if (const auto t = dtype_name(k, v, "zero.grad_accum_dtype", names))
      set("zero.grad_accum_dtype", k, YAML::Node(*t == "fp32" ? "fp32" : "model"));
  }

  void run(const json& root) {
    if (!root.is_object()) throw ConfigError(origin + ": a ds_config must be a JSON object");
    // A JSON file none of whose (several) top-level keys DeepSpeed knows is not a ds_config.
    std::vector<std::string> unknown;
    for (auto it = root.begin(); it != root.end(); ++it)
      if (!kDeepSpeedTopLevel.count(it.key()) && !kMapped.count(it.key())) unknown.push_back(it.key());
    if (unknown.size() >= 3 && unknown.size() == root.size()) {
      std::string some;
      for (size_t i = 0; i < std::min<size_t>(3, unknown.size()); ++i) some += (i ? ", " : "") + unknown[i];
      throw ConfigError(origin + ": none of its " + std::to_string(unknown.size()) + " top-level keys (" + some +
                        ", ...) is a DeepSpeed config key: is this a ds_config.json? (DeepSpeed's keys include "
                        "train_batch_size, zero_optimization, fp16, bf16, optimizer)");
    }
    precision(root);
    bool any_batch = false;
    for (auto it = root.begin(); it != root.end(); ++it) {
      const std::string& k = it.key();
      const json& v = it.value();
      if (k == "train_batch_size" || k == "train_micro_batch_size_per_gpu" || k == "gradient_accumulation_steps") {
        const char* key = k == "train_batch_size" ? "training.global_batch"
                          : k == "train_micro_batch_size_per_gpu" ? "training.micro_batch" : "training.grad_accum";
        any_batch = true;
        if (is_auto(v)) out.batch_auto = true;
        map(key, k, v, Kind::Integer);
      } else if (k == "gradient_clipping") map("training.gradient_clipping", k, v, Kind::Number);
      else if (k == "communication_data_type") communication_data_type(v);
      else if (k == "gradient_accumulation_dtype") grad_accum_dtype(k, v);
      else if (k == "data_types") {
        if (!v.is_object()) fail(k, "expected an object such as {\"grad_accum_dtype\": \"fp32\"}, got " + v.dump());
        for (auto it = v.begin(); it != v.end(); ++it)
          if (it.key() == "grad_accum_dtype") grad_accum_dtype(join(k, it.key()), it.value());
          else ignore(join(k, it.key()), it.value());
      }
      else if (k == "zero_optimization") zero(v);
      else if (k == "fp16" || k == "bf16") continue;  // precision() above
      else if (k == "bfloat16" && !root.contains("bf16")) continue;
      else if (k == "optimizer") optimizer(v);
      else if (k == "moe") moe(v);
      else if (k == "activation_checkpointing") activation_checkpointing(v);
      else if (k == "tensor_parallel") tensor_parallel(v);
      else if (k == "pipeline") { out.pipeline_section = true; pipeline(v); }
      else if (k == "sequence_parallel_size") {
        if (is_auto(v)) continue;
        check_type(k, v, Kind::Integer);
        if (v.get<double>() > 1)
          fail(k, "Ulysses sequence parallelism (sequence_parallel_size " + v.dump() +
                      ") is not modeled by dssim yet (its all-to-alls of q, k, v and the attention output per layer); "
                      "remove the key or set it to 1 to simulate the run without it");
      } else if (k == "zero_allow_untested_optimizer" || k == "zero_force_ds_cpu_optimizer") {
        continue;  // permission flags: nothing to model
      } else if (kDeepSpeedTopLevel.count(k)) {
        if (k == "pipeline") out.pipeline_section = true;
        ignore(k, v);
      }
      else ignore(k, v, "is not a DeepSpeed config key");
    }
    // The layering rule: what the ds_config leaves out is DeepSpeed's default.
    if (!root.contains("zero_optimization")) zero_defaults("the ds_config has no zero_optimization block: DeepSpeed's default");
    if (!root.contains("gradient_clipping"))
      set_default("training.gradient_clipping", "gradient_clipping", "0",
                  "the ds_config has no gradient_clipping: DeepSpeed does not clip");
    out.sets_batch = !out.batch_auto && (out.settings.count("training.global_batch") ||
                                         out.settings.count("training.micro_batch") ||
                                         out.settings.count("training.grad_accum"));
    if (!auto_names.empty()) {
      std::string names;
      for (const auto& a : auto_names) names += (names.empty() ? "" : ", ") + a;
      warn("ds_config keys left \"auto\" for the Hugging Face launcher to fill (DeepSpeed itself would take its "
           "defaults): dssim keeps the scenario's values for " + names);
    }
    if (!any_batch)
      warn("the ds_config names none of train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps "
           "(DeepSpeed needs one; a launcher such as the Hugging Face Trainer fills them): dssim keeps the scenario's batch");
  }
};

}  // namespace

DeepSpeedLayer map_deepspeed_config(const nlohmann::json& config, const std::string& origin) {
  Mapper m{origin, {}, {}};
  m.run(config);
  return std::move(m.out);
}

// hjson as ds_configs use it, turned into JSON: # and // and /* */ comments and trailing commas
// become spaces (lines are kept), quoteless keys are quoted, a bare word in a value is a launch
// script's placeholder when it looks like one ($X, ALL_CAPS), else hjson's quoteless string.
nlohmann::json parse_deepspeed_json(const std::string& text, const std::string& origin) {
  std::string o;
  o.reserve(text.size() + 64);
  size_t i = 0;
  const size_t n = text.size();
  int line = 1;
  std::string last_string, current_key;
  auto skip_ws_comments = [&](size_t j) {
    while (j < n) {
      if (std::isspace(static_cast<unsigned char>(text[j]))) ++j;
      else if (text[j] == '#' || (text[j] == '/' && j + 1 < n && text[j + 1] == '/')) {
        while (j < n && text[j] != '\n') ++j;
      } else if (text[j] == '/' && j + 1 < n && text[j + 1] == '*') {
        j += 2;
        while (j + 1 < n && !(text[j] == '*' && text[j + 1] == '/')) ++j;
        j += 2;
      } else break;
    }
    return j;
  };
  auto blank = [&](size_t from, size_t to) {
    for (size_t k = from; k < to && k < n; ++k) {
      o += text[k] == '\n' ? '\n' : ' ';
      if (text[k] == '\n') ++line;
    }
  };
  char prev_sig = 0;  // last significant character written
  while (i < n) {
    const char c = text[i];
    if (c == '"' || c == '\'') {
      size_t j = i + 1;
      std::string s;
      while (j < n && text[j] != c) {
        if (text[j] == '\\' && j + 1 < n) { s += text[j]; ++j; }
        if (text[j] == '\n') ++line;
        s += text[j];
        ++j;
      }
      o += '"';
      for (char ch : s) {
        if (c == '\'' && ch == '"') o += "\\\"";
        else o += ch;
      }
      o += '"';
      last_string = s;
      i = j + 1;
      prev_sig = '"';
      continue;
    }
    if (c == '#' || (c == '/' && i + 1 < n && (text[i + 1] == '/' || text[i + 1] == '*'))) {
      const size_t j = skip_ws_comments(i);
      blank(i, j);
      i = j;
      continue;
    }
    if (c == ',') {
      const size_t j = skip_ws_comments(i + 1);
      if (j < n && (text[j] == '}' || text[j] == ']')) { o += ' '; ++i; continue; }  // trailing comma
      o += c;
      prev_sig = c;
      ++i;
      continue;
    }
    if (c == ':') current_key = last_string;
    if (std::isdigit(static_cast<unsigned char>(c)) || ((c == '-' || c == '+' || c == '.') && i + 1 < n &&
                                                        (std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '.'))) {
      size_t j = i;
      while (j < n && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '.' || text[j] == '+' || text[j] == '-')) ++j;
      o += text.substr(i, j - i);  // a number (nlohmann refuses what is not one)
      prev_sig = '0';
      i = j;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == '$') {
      size_t j = i;
      while (j < n && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_' || text[j] == '$' ||
                       text[j] == '{' || text[j] == '}' || text[j] == '-' || text[j] == '.')) {
        if (text[j] == '}' && text.find('{', i) > j) break;  // a closing brace of the object
        ++j;
      }
      std::string word = text.substr(i, j - i);
      const size_t after = skip_ws_comments(j);
      if (word == "true" || word == "false" || word == "null") {
        o += word;
      } else if (after < n && text[after] == ':' && (prev_sig == '{' || prev_sig == ',' || prev_sig == 0)) {
        o += "\"" + word + "\"";  // hjson quoteless key
        last_string = word;
      } else if (looks_like_template(word)) {
        const std::string key = current_key.empty() ? std::string("value") : current_key;
        throw ConfigError(origin + ": line " + std::to_string(line) + ": " + template_message(key, word));
      } else {
        o += word;  // not JSON: nlohmann reports the line (a typo such as `tru` is likelier than hjson's quoteless string)
      }
      prev_sig = '"';
      i = j;
      continue;
    }
    if (c == '\n') ++line;
    if (!std::isspace(static_cast<unsigned char>(c))) prev_sig = c;
    o += c;
    ++i;
  }

  // Duplicate keys are refused, as DeepSpeed's dict_raise_error_on_duplicate_keys does.
  struct Frame {
    bool object;
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<Frame> stack;
  auto path = [&](const std::string& leaf) {
    std::string p;
    for (size_t k = 1; k < stack.size(); ++k) p += stack[k - 1].key + (stack[k - 1].object ? "." : "");
    return p + leaf;
  };
  nlohmann::json::parser_callback_t cb = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) stack.push_back({true, {}, ""});
    else if (ev == E::array_start) stack.push_back({false, {}, "[]"});
    else if (ev == E::object_end || ev == E::array_end) { if (!stack.empty()) stack.pop_back(); }
    else if (ev == E::key && !stack.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!stack.back().keys.insert(k).second)
        throw ConfigError(origin + ": duplicate key '" + path(k) + "': DeepSpeed refuses a config with duplicate keys "
                          "(\"Duplicate keys in DeepSpeed config\"); keep one of them");
      stack.back().key = k;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(o, cb, true, /*ignore_comments=*/true);
  } catch (const nlohmann::json::parse_error& e) {
    size_t upto = std::min<size_t>(e.byte, o.size());
    int at = 1 + static_cast<int>(std::count(o.begin(), o.begin() + static_cast<long>(upto), '\n'));
    throw ConfigError(origin + ": malformed JSON at line " + std::to_string(at) + ": " + e.what());
  }
}

DeepSpeedLayer load_deepspeed_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open the DeepSpeed config '" + path + "' (--deepspeed_config)");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return map_deepspeed_config(parse_deepspeed_json(text, path), path);
}

nlohmann::json to_deepspeed_config(const Scenario& sc) {
  using nlohmann::json;
  json j;
  j["train_batch_size"] = sc.training.global_batch;
  j["train_micro_batch_size_per_gpu"] = sc.training.micro_batch;
  j["gradient_accumulation_steps"] = sc.training.grad_accum;
  if (sc.training.gradient_clipping > 0) j["gradient_clipping"] = sc.training.gradient_clipping;
  const Dtype d = sc.precision.dtype;
  j["bf16"] = {{"enabled", d == Dtype::bf16}};
  if (d == Dtype::fp16) {
    const auto& ls = sc.precision.loss_scale;
    j["fp16"] = {{"enabled", true}, {"loss_scale", ls.loss_scale}, {"initial_scale_power", ls.initial_scale_power},
                 {"loss_scale_window", ls.loss_scale_window}, {"hysteresis", ls.hysteresis},
                 {"min_loss_scale", ls.min_loss_scale}};
  } else {
    j["fp16"] = {{"enabled", false}};
  }
  if (sc.precision.communication_dtype) j["communication_data_type"] = to_string(*sc.precision.communication_dtype);
  if (sc.zero.grad_accum_fp32) j["data_types"]["grad_accum_dtype"] = "fp32";
  const ZeroSpec& z = sc.zero;
  json zo = {{"stage", z.stage}, {"overlap_comm", z.overlap_comm}, {"reduce_bucket_size", z.reduce_bucket_size},
             {"allgather_bucket_size", z.allgather_bucket_size}};
  if (z.stage == 3) {
    zo["stage3_prefetch_bucket_size"] = z.prefetch_bucket_size;
    zo["stage3_param_persistence_threshold"] = z.param_persistence_threshold;
    zo["stage3_max_live_parameters"] = z.max_live_parameters;
    if (z.quantized_weights) zo["zero_quantized_weights"] = true;
    if (z.quantized_gradients) zo["zero_quantized_gradients"] = true;
    if (z.hpz_partition_size > 1) zo["zero_hpz_partition_size"] = z.hpz_partition_size;
  }
  if (z.offload_optimizer) zo["offload_optimizer"] = {{"device", "cpu"}};
  if (z.offload_param) zo["offload_param"] = {{"device", "cpu"}};
  j["zero_optimization"] = zo;
  const OptimizerSpec& o = sc.optimizer;
  const char* type = o.kind == OptimizerKind::onebit_adam ? "OneBitAdam"
                     : o.kind == OptimizerKind::lamb      ? "Lamb"
                     : o.kind == OptimizerKind::lion      ? "Lion"
                                                          : "AdamW";
  json params = {{"lr", o.lr}, {"betas", {o.beta1, o.beta2}}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
  if (o.kind == OptimizerKind::onebit_adam) params["freeze_step"] = o.freeze_step;
  j["optimizer"] = {{"type", type}, {"params", params}};
  if (sc.model.is_moe())
    j["moe"] = {{"enabled", true}, {"num_experts", sc.model.experts}, {"expert_parallel_size", sc.parallel.ep},
                {"top_k", sc.model.top_k}, {"capacity_factor", sc.model.capacity_factor}};
  return j;
}

}  // namespace dssim
