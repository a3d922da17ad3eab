// ds_config.json as users write them (tests/data/ds_configs/README.md): good ones load with a
// warning per unused key, bad ones are refused.
#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>
#include "core/deepspeed_config.hpp"
#include "core/memory.hpp"
#include "core/scenario_loader.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using namespace dssim::test;
using Catch::Contains;

namespace {
Scenario with_ds(const std::string& scenario, const std::string& ds, LoadOptions o = {}) {
  o.deepspeed_config = ds_data(ds);
  return load_scenario(scenario, o);
}
std::string temp_json(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/dssim_test_" + name + ".json";
  std::ofstream(path) << text;
  return path;
}
}  // namespace

TEST_CASE("zero2_13b_typical.json: ZeRO-2, AdamW, bf16, clipping - print keys warned", "[deepspeed]") {
  const Scenario s = with_ds(shipped("gpt13b_zero2.yaml"), "zero2_13b_typical.json");
  CHECK(s.training.global_batch == 512);
  CHECK(s.training.micro_batch == 2);
  CHECK(s.training.grad_accum == 4);
  CHECK(s.zero.stage == 2);
  CHECK(s.zero.overlap_comm);
  CHECK(s.zero.reduce_bucket_size == 500000000);
  CHECK(s.zero.allgather_bucket_size == 500000000);
  CHECK(s.optimizer.kind == OptimizerKind::adamw);
  CHECK(s.optimizer.lr == Approx(1e-4));
  CHECK(s.optimizer.beta2 == Approx(0.95));
  CHECK(s.optimizer.weight_decay == Approx(0.1));
  CHECK(s.precision.dtype == Dtype::bf16);
  CHECK(s.training.gradient_clipping == 1.0);
  CHECK(has_warning_with(s, "'steps_per_print'"));
  CHECK(has_warning_with(s, "'wall_clock_breakdown'"));
  // contiguous_gradients: true and activation checkpointing options off are what dssim models
  CHECK_FALSE(has_warning_with(s, "contiguous_gradients"));
  CHECK_FALSE(has_warning_with(s, "partition_activations"));
  // the scenario is this config's layout: nothing it says differs from the scenario
  CHECK(s.warnings.size() == 2);
}

TEST_CASE("cross_dc_comm.json: keys DeepSpeed does not define are warned, not dropped", "[deepspeed]") {
  const Scenario s = with_ds(shipped("gpt13b_zero2.yaml"), "cross_dc_comm.json");
  CHECK(has_warning_with(s, "'timeout' is not a DeepSpeed config key"));
  CHECK(has_warning_with(s, "'nccl_socket_ifname' is not a DeepSpeed config key"));
  // communication_data_type is modelled (the gradient reduction's bytes): mapped, no warning
  CHECK(s.precision.communication_dtype == Dtype::fp16);
  CHECK_FALSE(has_warning_with(s, "changes the dtype of gradient all-reduce"));
  // a ds_config describes the whole DeepSpeed run: no zero_optimization block = stage 0, neither
  // fp16 nor bf16 = fp32, no gradient_clipping = 0; each replaced scenario value is warned
  CHECK(s.zero.stage == 0);
  CHECK(s.precision.dtype == Dtype::fp32);
  CHECK(s.training.gradient_clipping == 0);
  CHECK(has_warning_with(s, "zero.stage = 0 replaces the scenario's 2 (the ds_config has no zero_optimization block"));
  CHECK(has_warning_with(s, "precision.dtype = fp32 replaces the scenario's bf16"));
  CHECK(has_warning_with(s, "'train_batch_size' sets training.global_batch = 1024, replacing the scenario's 512"));
  // train_batch_size alone replaces the scenario's triple: micro = 1024 / 64, grad_accum 1
  CHECK(s.training.global_batch == 1024);
  CHECK(s.training.micro_batch == 16);
  CHECK(s.training.grad_accum == 1);
}

TEST_CASE("fp16_loss_scale_clip.json: fp16 with dynamic loss scaling", "[deepspeed]") {
  const Scenario s = with_ds(shipped("tiny/tiny_dp2.yaml"), "fp16_loss_scale_clip.json");
  CHECK(s.precision.dtype == Dtype::fp16);
  CHECK(s.precision.loss_scale.loss_scale == 0);
  CHECK(s.precision.loss_scale.loss_scale_window == 1000);
  CHECK(s.precision.loss_scale.initial_scale_power == 16);
  CHECK(s.precision.loss_scale.hysteresis == 2);
  CHECK(s.precision.loss_scale.min_loss_scale == 1);
  CHECK(s.training.gradient_clipping == 1.0);
  CHECK(s.training.micro_batch == 4);
  CHECK(s.training.grad_accum == 8);
  CHECK(s.training.global_batch == 4 * 8 * 2);
  CHECK(s.zero.stage == 0);
  for (const auto& w : s.warnings) CHECK_THAT(w, Contains("the scenario's"));
}

TEST_CASE("the moe block's gate options set the model's (capacity floor, dropping, token selection, l_aux weight)", "[deepspeed]") {
  LoadOptions o;
  o.deepspeed_config = temp_json("moe_gate_options", R"({"train_micro_batch_size_per_gpu": 2,
    "moe": {"enabled": true, "num_experts": 8, "k": 1, "min_capacity": 0, "drop_tokens": false,
            "use_rts": false, "noisy_gate_policy": "RSample", "moe_loss_coeff": 0.1}})");
  const Scenario s = load_scenario(shipped("tiny/tiny_moe.yaml"), o);
  CHECK(s.model.experts == 8);
  CHECK(s.model.top_k == 1);
  CHECK(s.model.min_capacity == 0);
  CHECK_FALSE(s.model.drop_tokens);
  CHECK_FALSE(s.model.use_rts);
  CHECK(s.model.noisy_gate_policy == ModelSpec::NoisyGate::rsample);
  CHECK(s.model.moe_loss_coeff == Approx(0.1));
  o.deepspeed_config = temp_json("moe_gate_bad", R"({"moe": {"noisy_gate_policy": "Gaussian"}})");
  CHECK_THROWS_WITH(load_scenario(shipped("tiny/tiny_moe.yaml"), o), Contains("noisy_gate_policy"));
}

TEST_CASE("moe_ep8_jitter.json: dssim's moe block sets expert parallelism", "[deepspeed]") {
  const Scenario s = with_ds(shipped("moe.yaml"), "moe_ep8_jitter.json");
  CHECK(s.parallel.ep == 8);
  CHECK(s.training.micro_batch == 8);
  CHECK(s.training.global_batch == 8 * 64);
  CHECK(s.precision.dtype == Dtype::bf16);
  CHECK(s.model.noisy_gate_policy == ModelSpec::NoisyGate::jitter);  // runs in the torch backend (moe.cpp)
  // on the tiny MoE scenario, ep 8 needs 8 data-parallel ranks
  LoadOptions o;
  o.gpus = 8;
  const Scenario t = with_ds(shipped("tiny/tiny_moe.yaml"), "moe_ep8_jitter.json", o);
  CHECK(t.parallel.ep == 8);
  CHECK(t.parallel.dp == 8);
  CHECK_THAT(config_error([] { with_ds(shipped("tiny/tiny_moe.yaml"), "moe_ep8_jitter.json"); }),
             Contains("parallel.ep (8) (ds_config moe.expert_parallel_size) must divide parallel.dp (2)"));
  CHECK_THAT(config_error([] { with_ds(shipped("tiny/tiny_dp2.yaml"), "moe_ep8_jitter.json"); }),
             Contains("requires a mixture-of-experts model"));
}

TEST_CASE("onebit_adam.json: OneBitAdam with freeze_step - comm params warned", "[deepspeed]") {
  const Scenario s = with_ds(shipped("onebit_adam.yaml"), "onebit_adam.json");
  CHECK(s.optimizer.kind == OptimizerKind::onebit_adam);
  CHECK(s.optimizer.freeze_step == 23000);
  CHECK(s.optimizer.lr == Approx(4e-4));
  CHECK(s.optimizer.weight_decay == Approx(0.01));
  CHECK(s.precision.dtype == Dtype::fp16);
  CHECK(s.training.global_batch == 4096);
  CHECK(s.training.grad_accum == 4);
  CHECK(has_warning_with(s, "'optimizer.params.cuda_aware'"));
  CHECK(has_warning_with(s, "'optimizer.params.comm_backend_name'"));
}

TEST_CASE("zero3_offload_bs4096.json: ZeRO-3 with optimizer offload", "[deepspeed]") {
  const Scenario s = with_ds(shipped("tiny/tiny_dp2.yaml"), "zero3_offload_bs4096.json");
  CHECK(s.zero.stage == 3);
  CHECK(s.zero.offload_optimizer);
  CHECK_FALSE(s.zero.offload_param);
  CHECK(s.training.global_batch == 4096);
  CHECK(s.training.micro_batch == 2048);  // DeepSpeed: train_batch_size alone -> micro = 4096 / dp
  CHECK(s.training.grad_accum == 1);
}

TEST_CASE("bad ds_configs are refused with DeepSpeed's wording", "[deepspeed]") {
  // tiny_tp2: a 1-GPU data-parallel world (tp 2 on 2 GPUs)
  CHECK_THAT(config_error([] { with_ds(shipped("tiny/tiny_tp2.yaml"), "bad_batch_triple.json"); }),
             Contains("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 2 * 1 * 1") &&
                 Contains("ds_config train_batch_size"));
  CHECK_THAT(config_error([] { with_ds(shipped("tiny/tiny_dp2.yaml"), "bad_fp16_and_bf16.json"); }),
             Contains("bf16 and fp16 modes cannot be simultaneously enabled") && Contains("bad_fp16_and_bf16.json"));
}

TEST_CASE("ds_config overrides the YAML and --set overrides both", "[deepspeed]") {
  LoadOptions o;
  o.deepspeed_config = scenario_data("ds_override.json");
  const Scenario s = load_scenario(scenario_data("minimal.yaml"), o);
  CHECK(s.zero.stage == 2);
  CHECK(s.zero.reduce_bucket_size == 2000000);
  CHECK(s.training.micro_batch == 1);
  CHECK(s.training.grad_accum == 3);
  CHECK(s.training.global_batch == 6);  // the YAML's global_batch 8 is replaced with the triple
  o.overrides = {"zero.stage=1", "training.micro_batch=2"};
  const Scenario t = load_scenario(scenario_data("minimal.yaml"), o);
  CHECK(t.zero.stage == 1);
  CHECK(t.training.micro_batch == 2);
  CHECK(t.training.grad_accum == 3);
  CHECK(t.training.global_batch == 12);
  const Scenario y = load_scenario(scenario_data("minimal.yaml"));
  CHECK(y.zero.stage == 0);
  CHECK(y.training.global_batch == 8);
  CHECK(y.training.grad_accum == 2);
}

TEST_CASE("ds_config mapping of individual keys", "[deepspeed]") {
  using json = nlohmann::json;
  auto layer = map_deepspeed_config(json::parse(R"({
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "pin_memory": true},
                          "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 3e8, "sub_group_size": 1e9, "contiguous_gradients": false},
    "fp16": {"enabled": false}, "bf16": {"enabled": false},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "torch_adam": true}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false}
  })"), "x.json");
  auto value = [&](const std::string& k) { return layer.settings.at(k).value.Scalar(); };
  CHECK(value("zero.stage") == "3");
  CHECK(value("zero.offload_param") == "true");
  CHECK(value("zero.prefetch_bucket_size") == "10000000.0");
  CHECK(value("zero.param_persistence_threshold") == "10000.0");
  CHECK(value("zero.max_live_parameters") == "300000000.0");
  CHECK(value("precision.dtype") == "fp32");  // both explicitly disabled: DeepSpeed trains in fp32
  CHECK(value("optimizer.type") == "adamw");
  CHECK(layer.settings.at("optimizer.betas").value.size() == 2);
  CHECK(layer.settings.at("zero.stage").written_as == "zero_optimization.stage");
  CHECK_FALSE(layer.sets_batch);
  auto warned = [&](const std::string& k) {
    for (auto& w : layer.warnings)
      if (w.find("'" + k + "'") != std::string::npos) return true;
    return false;
  };
  CHECK_FALSE(warned("zero_optimization.offload_param.device"));  // nvme: ZeRO-Infinity, modelled
  CHECK(value("zero.offload_param_device") == "nvme");
  // the offload block's buffers and pinning: one line
  CHECK(std::any_of(layer.warnings.begin(), layer.warnings.end(), [](const std::string& w) {
    return w.find("'zero_optimization.offload_param' (pin_memory)") != std::string::npos;
  }));
  CHECK_FALSE(warned("zero_optimization.sub_group_size"));  // 1e9 is DeepSpeed's default: not warned
  CHECK(warned("zero_optimization.contiguous_gradients"));
  CHECK(warned("optimizer.params.torch_adam"));
  CHECK(warned("scheduler"));  // one line for the block
  CHECK_FALSE(warned("activation_checkpointing.partition_activations"));  // modelled
  CHECK(value("activation_checkpointing.partition_activations") == "true");
  CHECK(value("activation_checkpointing.cpu_checkpointing") == "false");
  CHECK(layer.warnings.size() == 5);

  auto legacy = map_deepspeed_config(json::parse(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})"), "l.json");
  CHECK(legacy.settings.at("zero.offload_optimizer").value.Scalar() == "true");

  auto hf = map_deepspeed_config(json::parse(R"({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"})"), "hf.json");
  CHECK_FALSE(hf.settings.count("training.micro_batch"));
  CHECK_FALSE(hf.settings.count("training.gradient_clipping"));
  CHECK_FALSE(hf.sets_batch);
  CHECK(hf.batch_auto);
  CHECK(hf.settings.at("zero.stage").value.Scalar() == "0");  // no zero_optimization block
  CHECK(hf.defaulted.count("zero.stage"));
}

TEST_CASE("ds_config errors name the DeepSpeed key", "[deepspeed]") {
  using json = nlohmann::json;
  CHECK_THAT(config_error([] { map_deepspeed_config(json::parse(R"({"optimizer": {"type": "OneBitLamb"}})"), "o.json"); }),
             Contains("o.json: optimizer.type: \"OneBitLamb\"") && Contains("not modeled"));
  CHECK_THAT(config_error([] { map_deepspeed_config(json::parse(R"({"optimizer": {"type": "Sophia"}})"), "o.json"); }),
             Contains("optimizer.type: unknown optimizer \"Sophia\""));
  CHECK_THAT(config_error([] { map_deepspeed_config(json::parse(R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})"), "d.json"); }),
             Contains("zero_optimization.offload_optimizer.device: expected \"cpu\", \"nvme\" or \"none\""));
  CHECK_THAT(config_error([] { map_deepspeed_config(json::parse(R"([1, 2])"), "a.json"); }),
             Contains("a ds_config must be a JSON object"));
  // a wrong type is reported by the ds key, through the scenario's typed reader
  LoadOptions o;
  o.deepspeed_config = temp_json("wrong_stage", R"({"zero_optimization": {"stage": "two"}})");
  CHECK_THAT(config_error([&] { load_scenario(scenario_data("minimal.yaml"), o); }),
             Contains("zero_optimization.stage: expected a number, got the string \"two\""));
  o.deepspeed_config = temp_json("malformed", "{\n  \"train_batch_size\": 8,\n  \"fp16\": {\"enabled\": tru}\n}\n");
  CHECK_THAT(config_error([&] { load_scenario(scenario_data("minimal.yaml"), o); }),
             Contains("malformed JSON at line 3"));
  o.deepspeed_config = "/nonexistent/ds.json";
  CHECK_THAT(config_error([&] { load_scenario(scenario_data("minimal.yaml"), o); }),
             Contains("cannot open the DeepSpeed config '/nonexistent/ds.json'"));
}

TEST_CASE("ds_config read as DeepSpeed reads it (hjson)", "[deepspeed]") {
  // comments, trailing commas and quoteless keys are accepted; lines are kept for messages
  const auto j = parse_deepspeed_json("# top\n{\n  // c\n  stage_keys: {a: 1, b: [1, 2,],},  # x\n  \"s\": 'it\"s', /* y */\n}\n", "h.json");
  CHECK(j.at("stage_keys").at("b").size() == 2);
  CHECK(j.at("s") == "it\"s");
  CHECK_THAT(config_error([] { parse_deepspeed_json("{\n \"a\": {\"b\": 1,\n \"b\": 2}}", "d.json"); }),
             Contains("d.json: duplicate key 'a.b'") && Contains("keep one"));
  CHECK_THAT(config_error([] { parse_deepspeed_json("{\n\"train_batch_size\": $GBS,\n}", "t.json"); }),
             Contains("t.json: line 2: train_batch_size: unexpanded template placeholder $GBS"));
  CHECK_THAT(config_error([] { parse_deepspeed_json("{\"zero_optimization\": {\"stage\": ZERO_STAGE}}", "t.json"); }),
             Contains("stage: unexpanded template placeholder ZERO_STAGE"));
  CHECK_THAT(config_error([] { parse_deepspeed_json("{\n\"fp16\": {\"enabled\": tru}}", "m.json"); }),
             Contains("malformed JSON at line 2"));
}

TEST_CASE("ds_config \"auto\" batch keys keep the scenario's - a numeric one re-derives as --set does", "[deepspeed]") {
  LoadOptions o;
  o.deepspeed_config = temp_json("acc", R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                            "gradient_accumulation_steps": 2, "bf16": {"enabled": "auto"}})");
  const Scenario s = load_scenario(shipped("gpt13b_zero2.yaml"), o);
  LoadOptions set;
  set.overrides = {"training.grad_accum=2"};
  const Scenario t = load_scenario(shipped("gpt13b_zero2.yaml"), set);
  CHECK(s.training.global_batch == t.training.global_batch);
  CHECK(s.training.micro_batch == t.training.micro_batch);
  CHECK(s.training.grad_accum == 2);
  CHECK(s.precision.dtype == Dtype::bf16);
  // one line for all the "auto" keys
  int autos = 0;
  for (const auto& w : s.warnings) autos += w.find("\"auto\"") != std::string::npos;
  CHECK(autos == 1);
}

TEST_CASE("ds_config: Lion keeps one moment, Lamb Adam's two", "[deepspeed][memory]") {
  LoadOptions o;
  auto opt = [&](const std::string& type) {
    o.deepspeed_config = temp_json("opt_" + type, R"({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 2, "overlap_comm": true}, "bf16": {"enabled": true}, "optimizer": {"type": ")" + type + R"("}})");
    return load_scenario(shipped("gpt13b_zero2.yaml"), o);
  };
  const Scenario adam = opt("AdamW"), lamb = opt("Lamb"), lion = opt("Lion");
  CHECK(lamb.optimizer.kind == OptimizerKind::lamb);
  CHECK(lion.optimizer.kind == OptimizerKind::lion);
  CHECK(peak_memory(lamb).optimizer == Approx(peak_memory(adam).optimizer));
  CHECK(peak_memory(lion).optimizer == Approx(peak_memory(adam).optimizer * 8 / 12));
}

TEST_CASE("ds_config: AutoTP sets tp and the batch is checked over the new data-parallel size", "[deepspeed]") {
  LoadOptions o;
  o.deepspeed_config = temp_json("autotp", R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                               "tensor_parallel": {"autotp_size": 4}, "bf16": {"enabled": true}})");
  const Scenario s = load_scenario(shipped("gpt13b_zero2.yaml"), o);
  CHECK(s.parallel.tp == 4);
  CHECK(s.parallel.dp == 16);
  CHECK(s.training.grad_accum == 2);  // 64 / (2 * 16), not 64 / (2 * 64)
  o.deepspeed_config = temp_json("ulysses", R"({"train_batch_size": 64, "sequence_parallel_size": 2})");
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt13b_zero2.yaml"), o); }),
             Contains("sequence_parallel_size: Ulysses sequence parallelism"));
  o.deepspeed_config = temp_json("range", R"({"train_batch_size": 64, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e20}})");
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt13b_zero2.yaml"), o); }),
             Contains("zero_optimization.reduce_bucket_size (zero.reduce_bucket_size): 1e+20 is out of range"));
}

TEST_CASE("ds_config: a JSON file with no DeepSpeed key at all is not taken for one", "[deepspeed]") {
  using json = nlohmann::json;
  CHECK_THAT(config_error([] { map_deepspeed_config(json::parse(R"({"cat_images1": 1, "cat_images2": 2, "waterview": 3})"), "v.json"); }),
             Contains("v.json: none of its 3 top-level keys (cat_images1, cat_images2, waterview, ...) is a DeepSpeed config key"));
  // a config with a key or two DeepSpeed does not define is still one (warned)
  auto few = map_deepspeed_config(json::parse(R"({"timeout": 1800})"), "t.json");
  CHECK_FALSE(few.warnings.empty());
  // prescale_gradients changes the arithmetic, not memory or traffic: the plain wording
  auto pre = map_deepspeed_config(json::parse(R"({"train_batch_size": 8, "prescale_gradients": true})"), "p.json");
  bool plain = false;
  for (const auto& w : pre.warnings) plain |= w == "ds_config key 'prescale_gradients' has no effect in dssim; ignored";
  CHECK(plain);
}

TEST_CASE("communication_data_type maps onto precision.communication_dtype", "[deepspeed]") {
  const std::string base = R"("train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "bf16": {"enabled": true})";
  auto load = [&](const std::string& v) {
    LoadOptions o;
    o.deepspeed_config = temp_json("comm_dtype", "{" + base + ", \"communication_data_type\": " + v + "}");
    return load_scenario(shipped("gpt13b_zero2.yaml"), o);
  };
  CHECK(load("\"fp32\"").precision.communication_dtype == Dtype::fp32);
  CHECK(load("\"FP16\"").precision.communication_dtype == Dtype::fp16);
  CHECK(load("\"bfp16\"").precision.communication_dtype == Dtype::bf16);  // DeepSpeed's other spelling
  CHECK_FALSE(load("null").precision.communication_dtype.has_value());   // DeepSpeed's default: the compute dtype
  CHECK_FALSE(load("\"auto\"").precision.communication_dtype.has_value());
  const Scenario s = load("\"fp32\"");
  CHECK(s.precision.communication_bytes() == 4);
  CHECK_FALSE(has_warning_with(s, "which dssim does not model"));
  CHECK(has_warning_with(s, "'communication_data_type' sets precision.communication_dtype = fp32, replacing the scenario's bf16"));
  const std::string e = config_error([&] { load("\"int8\""); });
  CHECK_THAT(e, Contains("communication_data_type") && Contains("int8"));
  CHECK_THAT(config_error([&] { load("16"); }), Contains("communication_data_type"));
}

TEST_CASE("ZeRO++ keys (qwZ, qgZ, hpZ) are modelled at stage 3 and ignored with a warning below", "[deepspeed][zeropp]") {
  const Scenario s = with_ds(shipped("gpt13b_zero2.yaml"), "corpus/dst_zeropp.json");
  CHECK(s.zero.stage == 3);
  CHECK(s.zero.quantized_weights);
  CHECK(s.zero.quantized_gradients);
  CHECK(s.zero.hpz_partition_size == 8);
  CHECK(s.zero.hpz());
  CHECK_FALSE(has_warning_with(s, "ZeRO++"));
  CHECK_FALSE(has_warning_with(s, "which dssim does not model"));
  CHECK(has_warning_with(s, "'zero_optimization.zero_quantized_gradients' sets zero.quantized_gradients = true"));
  // below stage 3 DeepSpeed ignores them: so does dssim, with a warning naming the key
  LoadOptions o;
  o.deepspeed_config = temp_json("zeropp_stage2", R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "zero_quantized_weights": true, "zero_hpz_partition_size": 8}})");
  const Scenario z2 = load_scenario(shipped("gpt13b_zero2.yaml"), o);
  CHECK(z2.zero.stage == 2);
  CHECK_FALSE(z2.zero.quantized_weights);
  CHECK(z2.zero.hpz_partition_size == 1);
  CHECK(has_warning_with(z2, "'zero_optimization.zero_quantized_weights' is a ZeRO++ option, but zero.stage is 2"));
  CHECK(has_warning_with(z2, "'zero_optimization.zero_hpz_partition_size' is a ZeRO++ option"));
  // hpZ must divide the data-parallel size (DeepSpeed asserts it when it builds the groups)
  o.deepspeed_config = temp_json("zeropp_hpz3", R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})");
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt13b_zero2.yaml"), o); }),
             Contains("zero.hpz_partition_size (3)") && Contains("zero_optimization.zero_hpz_partition_size"));
  CHECK_THAT(config_error([&] { with_ds(shipped("gpt13b_zero2.yaml"), "corpus/dst_zeropp.json", [] {
               LoadOptions l; l.overrides = {"zero.hpz_partition_size=true"}; return l; }()); }),
             Contains("zero.hpz_partition_size"));
}
