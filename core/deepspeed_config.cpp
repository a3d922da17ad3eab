#include "core/deepspeed_config.hpp"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>
#include "core/scenario_loader.hpp"

namespace dssim {

namespace {

using json = nlohmann::json;

// Top-level keys DeepSpeed's config defines (deepspeed/runtime/config.py and the config-json docs).
const std::set<std::string> kDeepSpeedTopLevel = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
    "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "aio", "autotuning", "flops_profiler", "activation_checkpointing", "sparse_attention", "data_efficiency",
    "curriculum_learning", "monitor_config", "tensorboard", "wandb", "csv_monitor", "comet", "elasticity",
    "checkpoint", "data_types", "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "comms_logger", "compression_training", "pipeline", "progressive_layer_drop", "eigenvalue",
    "quantize_training", "hybrid_engine", "nebula", "weight_quantization", "disable_allgather",
    "load_universal_checkpoint", "use_node_local_storage", "graph_harvesting", "zero_optimization_stage",
    "gradient_accumulation_dtype", "use_data_before_expert_parallelism", "timers", "compile",
    "train_batch_size_per_gpu",
};

struct Mapper {
  std::string origin;
  DeepSpeedLayer out;

  static std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

  [[noreturn]] void fail(const std::string& ds_key, const std::string& msg) const {
    throw ConfigError(origin + ": " + ds_key + ": " + msg);
  }

  void warn_unused(const std::string& ds_key, const std::string& why) {
    out.warnings.push_back("ds_config key '" + ds_key + "' " + why + "; ignored");
  }
  // Every leaf under `j` as its own warning, so nothing is dropped silently.
  void warn_all(const std::string& ds_key, const json& j, const std::string& why) {
    if (j.is_object() && !j.empty()) {
      for (auto it = j.begin(); it != j.end(); ++it) warn_all(join(ds_key, it.key()), it.value(), why);
    } else {
      warn_unused(ds_key, why);
    }
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
  }
  // Maps a ds value onto `key`; "auto" (Hugging Face's placeholder) leaves the scenario's value.
  void map(const std::string& key, const std::string& ds_key, const json& j) {
    if (is_auto(j)) {
      out.warnings.push_back("ds_config key '" + ds_key +
                             "' is \"auto\" (resolved by the Hugging Face Trainer, not DeepSpeed); dssim keeps the "
                             "scenario's " + key);
      return;
    }
    if (j.is_object()) fail(ds_key, "expected a value, got an object");
    set(key, ds_key, to_yaml(j));
  }

  bool get_bool(const std::string& ds_key, const json& j) const {
    if (j.is_boolean()) return j.get<bool>();
    fail(ds_key, "expected true or false, got " + j.dump());
  }

  void device(const std::string& key, const std::string& ds_key, const json& block) {
    if (block.is_null()) return;
    if (!block.is_object()) fail(ds_key, "expected an object such as {\"device\": \"cpu\"}, got " + block.dump());
    for (auto it = block.begin(); it != block.end(); ++it) {
      const std::string k = join(ds_key, it.key());
      if (it.key() == "device") {
        if (!it->is_string()) fail(k, "expected \"cpu\", \"nvme\" or \"none\", got " + it->dump());
        std::string d = it->get<std::string>();
        if (d == "cpu") set(key, k, YAML::Node("true"));
        else if (d == "none") set(key, k, YAML::Node("false"));
        else if (d == "nvme") {
          set(key, k, YAML::Node("true"));
          out.warnings.push_back("ds_config key '" + k + "' is \"nvme\": dssim models the offload to host memory (cpu); NVMe bandwidth is not modeled");
        } else fail(k, "expected \"cpu\", \"nvme\" or \"none\", got \"" + d + "\"");
      } else {
        warn_unused(k, "has no effect in dssim (offload buffers and pinning are not modeled)");
      }
    }
  }

  void zero(const json& z) {
    const std::string base = "zero_optimization";
    if (z.is_boolean()) {  // legacy: "zero_optimization": true means stage 1
      set("zero.stage", base, YAML::Node(z.get<bool>() ? "1" : "0"));
      return;
    }
    if (!z.is_object()) fail(base, "expected an object, got " + z.dump());
    for (auto it = z.begin(); it != z.end(); ++it) {
      const std::string& k = it.key();
      const std::string dk = join(base, k);
      const json& v = it.value();
      if (k == "stage") map("zero.stage", dk, v);
      else if (k == "offload_optimizer") device("zero.offload_optimizer", dk, v);
      else if (k == "offload_param") device("zero.offload_param", dk, v);
      else if (k == "cpu_offload") {  // deprecated spelling of offload_optimizer.device = cpu
        set("zero.offload_optimizer", dk, YAML::Node(get_bool(dk, v) ? "true" : "false"));
        out.warnings.push_back("ds_config key '" + dk + "' is deprecated in DeepSpeed; use zero_optimization.offload_optimizer.device");
      } else if (k == "cpu_offload_params") {
        set("zero.offload_param", dk, YAML::Node(get_bool(dk, v) ? "true" : "false"));
        out.warnings.push_back("ds_config key '" + dk + "' is deprecated in DeepSpeed; use zero_optimization.offload_param.device");
      } else if (k == "overlap_comm") map("zero.overlap_comm", dk, v);
      else if (k == "reduce_bucket_size") map("zero.reduce_bucket_size", dk, v);
      else if (k == "allgather_bucket_size") map("zero.allgather_bucket_size", dk, v);
      else if (k == "stage3_prefetch_bucket_size") map("zero.prefetch_bucket_size", dk, v);
      else if (k == "stage3_param_persistence_threshold") map("zero.param_persistence_threshold", dk, v);
      else if (k == "stage3_max_live_parameters") map("zero.max_live_parameters", dk, v);
      else if (k == "contiguous_gradients") {
        // dssim always models one contiguous gradient buffer: only `false` changes anything.
        if (!get_bool(dk, v)) warn_unused(dk, "is false: dssim always models contiguous gradient buffers");
      } else if (k == "reduce_scatter" || k == "allgather_partitions") {
        if (!get_bool(dk, v)) warn_unused(dk, "is false: dssim models ZeRO with reduce-scatter and all-gather");
      } else {
        warn_all(dk, v, "has no effect in dssim");
      }
    }
  }

  void precision(const json& root) {
    // DeepSpeed: fp16.enabled or bf16.enabled (older spelling: bfloat16); both off = fp32.
    auto block = [&](const char* name) -> const json* {
      auto it = root.find(name);
      if (it == root.end()) return nullptr;
      if (!it->is_object()) fail(name, "expected an object such as {\"enabled\": true}, got " + it->dump());
      return &*it;
    };
    const json* f = block("fp16");
    const char* bf16_name = root.contains("bf16") ? "bf16" : "bfloat16";
    const json* b = block(bf16_name);
    bool explicit_enabled = false;
    auto enabled = [&](const json* blk, const std::string& name) {
      if (!blk || !blk->contains("enabled")) return false;
      const json& e = blk->at("enabled");
      if (is_auto(e)) {
        out.warnings.push_back("ds_config key '" + name + ".enabled' is \"auto\"; dssim keeps the scenario's precision.dtype");
        return false;
      }
      explicit_enabled = true;
      return get_bool(name + ".enabled", e);
    };
    const bool fp16 = enabled(f, "fp16");
    const bool bf16 = enabled(b, bf16_name);
    if (fp16 && bf16)
      throw ConfigError(origin + ": bf16 and fp16 modes cannot be simultaneously enabled (fp16.enabled and " +
                        std::string(bf16_name) + ".enabled are both true); enable one of them");
    if (fp16) set("precision.dtype", "fp16.enabled", YAML::Node("fp16"));
    else if (bf16) set("precision.dtype", std::string(bf16_name) + ".enabled", YAML::Node("bf16"));
    else if (explicit_enabled)
      set("precision.dtype", f ? "fp16.enabled" : std::string(bf16_name) + ".enabled", YAML::Node("fp32"));
    if (f) {
      for (auto it = f->begin(); it != f->end(); ++it) {
        const std::string dk = "fp16." + it.key();
        const std::string& k = it.key();
        if (k == "enabled") continue;
        if (k == "loss_scale") map("precision.loss_scale.scale", dk, it.value());
        else if (k == "initial_scale_power") map("precision.loss_scale.initial_scale_power", dk, it.value());
        else if (k == "loss_scale_window") map("precision.loss_scale.loss_scale_window", dk, it.value());
        else if (k == "hysteresis") map("precision.loss_scale.hysteresis", dk, it.value());
        else if (k == "min_loss_scale") map("precision.loss_scale.min_loss_scale", dk, it.value());
        else warn_all(dk, it.value(), "has no effect in dssim");
      }
    }
    if (b)
      for (auto it = b->begin(); it != b->end(); ++it)
        if (it.key() != "enabled") warn_all(std::string(bf16_name) + "." + it.key(), it.value(), "has no effect in dssim");
  }

  void optimizer(const json& o) {
    if (!o.is_object()) fail("optimizer", "expected an object with \"type\" and \"params\", got " + o.dump());
    for (auto it = o.begin(); it != o.end(); ++it) {
      const std::string dk = "optimizer." + it.key();
      if (it.key() == "type") {
        if (!it->is_string()) fail(dk, "expected a string such as \"AdamW\", got " + it->dump());
        std::string t = it->get<std::string>();
        std::string lower = t;
        for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (lower == "adam" || lower == "adamw" || lower == "fusedadam" || lower == "cpuadam")
          set("optimizer.type", dk, YAML::Node("adamw"));
        else if (lower == "onebitadam")
          set("optimizer.type", dk, YAML::Node("onebit_adam"));
        else
          fail(dk, "dssim models the optimizers Adam, AdamW and OneBitAdam, got \"" + t + "\"");
      } else if (it.key() == "params") {
        if (!it->is_object()) fail(dk, "expected an object, got " + it->dump());
        for (auto p = it->begin(); p != it->end(); ++p) {
          const std::string pk = dk + "." + p.key();
          const std::string& k = p.key();
          if (k == "lr") map("optimizer.lr", pk, p.value());
          else if (k == "betas") map("optimizer.betas", pk, p.value());
          else if (k == "eps") map("optimizer.eps", pk, p.value());
          else if (k == "weight_decay") map("optimizer.weight_decay", pk, p.value());
          else if (k == "freeze_step") map("optimizer.freeze_step", pk, p.value());
          else warn_all(pk, p.value(), "has no effect in dssim");
        }
      } else {
        warn_all(dk, it.value(), "has no effect in dssim");
      }
    }
  }

  void moe(const json& m) {
    // Not a DeepSpeed config block (DeepSpeed configures MoE in Python, deepspeed.moe.layer.MoE):
    // dssim's extension, with the MoE layer's argument names.
    if (!m.is_object()) fail("moe", "expected an object, got " + m.dump());
    if (m.contains("enabled") && !get_bool("moe.enabled", m.at("enabled"))) {
      warn_all("moe", m, "is in a disabled moe block (moe.enabled is false)");
      return;
    }
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string dk = "moe." + it.key();
      const std::string& k = it.key();
      if (k == "enabled") continue;
      if (k == "expert_parallel_size" || k == "ep_size") map("parallel.ep", dk, it.value());
      else if (k == "num_experts") map("model.experts", dk, it.value());
      else if (k == "top_k" || k == "k") map("model.top_k", dk, it.value());
      else if (k == "capacity_factor") map("model.capacity_factor", dk, it.value());
      else if (k == "noisy_gate_policy")
        warn_unused(dk, "changes which experts tokens go to, not the cost dssim models");
      else warn_all(dk, it.value(), "has no effect in dssim");
    }
  }

  void activation_checkpointing(const json& a) {
    // DeepSpeed's block tunes deepspeed.checkpointing; whether layers are recomputed is decided by
    // the model code, which in dssim is the scenario's activation_checkpointing.
    if (!a.is_object()) fail("activation_checkpointing", "expected an object, got " + a.dump());
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string dk = "activation_checkpointing." + it.key();
      const std::string& k = it.key();
      if (k == "partition_activations" || k == "contiguous_memory_optimization" || k == "cpu_checkpointing" ||
          k == "synchronize_checkpoint_boundary" || k == "profile") {
        if (it->is_boolean() && !it->get<bool>()) continue;  // off is what dssim models
        warn_unused(dk, "is on: dssim does not model it (set the scenario's activation_checkpointing: none|selective|full)");
      } else if (k == "number_checkpoints") {
        if (!it->is_null()) warn_unused(dk, "has no effect in dssim");
      } else {
        warn_all(dk, it.value(), "has no effect in dssim");
      }
    }
  }

  void run(const json& root) {
    if (!root.is_object()) throw ConfigError(origin + ": a ds_config must be a JSON object");
    precision(root);
    for (auto it = root.begin(); it != root.end(); ++it) {
      const std::string& k = it.key();
      const json& v = it.value();
      if (k == "train_batch_size") { map("training.global_batch", k, v); out.sets_batch = true; }
      else if (k == "train_micro_batch_size_per_gpu") { map("training.micro_batch", k, v); out.sets_batch = true; }
      else if (k == "gradient_accumulation_steps") { map("training.grad_accum", k, v); out.sets_batch = true; }
      else if (k == "gradient_clipping") map("training.gradient_clipping", k, v);
      else if (k == "zero_optimization") zero(v);
      else if (k == "fp16" || k == "bf16") continue;  // precision() above
      else if (k == "bfloat16" && !root.contains("bf16")) continue;
      else if (k == "optimizer") optimizer(v);
      else if (k == "moe") moe(v);
      else if (k == "activation_checkpointing") activation_checkpointing(v);
      else if (kDeepSpeedTopLevel.count(k)) warn_all(k, v, "has no effect in dssim");
      else warn_all(k, v, "is not a DeepSpeed config key");
    }
    // An "auto" batch key does not count as given.
    if (out.sets_batch)
      out.sets_batch = out.settings.count("training.global_batch") || out.settings.count("training.micro_batch") ||
                       out.settings.count("training.grad_accum");
  }
};

}  // namespace

DeepSpeedLayer map_deepspeed_config(const nlohmann::json& config, const std::string& origin) {
  Mapper m{origin, {}};
  m.run(config);
  return std::move(m.out);
}

DeepSpeedLayer load_deepspeed_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open the DeepSpeed config '" + path + "' (--deepspeed_config)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in, nullptr, true, /*ignore_comments=*/true);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann reports a byte offset; turn it into a line for the user.
    std::ifstream again(path);
    std::string text((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>());
    size_t upto = std::min<size_t>(e.byte, text.size());
    int line = 1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<long>(upto), '\n'));
    std::string what = e.what();
    throw ConfigError(path + ": malformed JSON at line " + std::to_string(line) + ": " + what);
  }
  return map_deepspeed_config(j, path);
}

}  // namespace dssim
