// Scenario format: presets, units, layering (file < ds_config < --set), --gpus, batch rules.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include "core/scenario_loader.hpp"
#include "core/scenario_units.hpp"
#include "core/validate.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using namespace dssim::test;
using Catch::Contains;

TEST_CASE("quantities with units are stored in SI", "[scenario]") {
  using D = Dimension;
  CHECK(parse_quantity("200 Gb/s", D::Bandwidth).value() == Approx(25e9));
  CHECK(parse_quantity("300 GB/s", D::Bandwidth).value() == Approx(300e9));
  CHECK(parse_quantity("200Gbps", D::Bandwidth).value() == Approx(25e9));
  CHECK(parse_quantity("3.35 TB/s", D::Bandwidth).value() == Approx(3.35e12));
  CHECK(parse_quantity("25e9", D::Bandwidth).value() == Approx(25e9));
  CHECK(parse_quantity("80 GiB", D::Bytes).value() == Approx(80.0 * 1024 * 1024 * 1024));
  CHECK(parse_quantity("2 TB", D::Bytes).value() == Approx(2e12));
  CHECK(parse_quantity("143771 MiB", D::Bytes).value() == Approx(143771.0 * 1024 * 1024));
  CHECK(parse_quantity("2 us", D::Time).value() == Approx(2e-6));
  CHECK(parse_quantity("130 ns", D::Time).value() == Approx(130e-9));
  CHECK(parse_quantity("0.5 ms", D::Time).value() == Approx(0.5e-3));
  CHECK(parse_quantity("1 s", D::Time).value() == Approx(1.0));
  CHECK(parse_quantity("1.5e12 FLOP/s", D::FlopRate).value() == Approx(1.5e12));
  CHECK(parse_quantity("312 TFLOP/s", D::FlopRate).value() == Approx(312e12));
  CHECK(parse_quantity("989.5 TFLOPS", D::FlopRate).value() == Approx(989.5e12));
  CHECK(parse_quantity("2 GFLOP", D::Flops).value() == Approx(2e9));
  CHECK(parse_quantity("0.82", D::None).value() == Approx(0.82));
  // a unit of another dimension, or none that exists, is refused
  CHECK_FALSE(parse_quantity("80 GiB", D::Bandwidth));
  CHECK_FALSE(parse_quantity("200 Gb/s", D::Bytes));
  CHECK_FALSE(parse_quantity("2 us", D::Bandwidth));
  CHECK_FALSE(parse_quantity("fast", D::Bandwidth));
  CHECK_FALSE(parse_quantity("12 parsecs", D::Time));
  CHECK_FALSE(parse_quantity("inf", D::None));
  CHECK_FALSE(parse_quantity("8 GB", D::None));
}

TEST_CASE("gpt175b: Megatron's 175B layout on 128 DGX A100 nodes", "[scenario]") {
  const Scenario s = load_scenario(shipped("gpt175b.yaml"));
  CHECK(s.name == "gpt175b");
  CHECK(s.model.name == "gpt3-175b");
  CHECK(s.model.layers == 96);
  CHECK(s.model.hidden == 12288);
  CHECK(s.model.heads == 96);
  CHECK(s.model.ffn_hidden == 4 * 12288);
  CHECK(s.model.seq_len == 2048);
  CHECK(s.model.vocab == 51200);
  CHECK(s.parallel.tp == 8);
  CHECK(s.parallel.pp == 8);
  CHECK(s.parallel.dp == 16);
  CHECK(s.cluster.nodes == 128);
  CHECK(s.cluster.world() == 1024);
  CHECK(s.training.global_batch == 1536);
  CHECK(s.training.micro_batch == 1);
  CHECK(s.training.grad_accum == 96);  // micro-batches per pipeline
  CHECK(s.zero.stage == 1);
  CHECK(s.precision.dtype == Dtype::bf16);
  CHECK(s.recompute == Recompute::full);
  CHECK(s.cluster.gpu.name == "A100-80GB");
  CHECK(s.cluster.gpu.memory_bytes == Approx(80.0 * (1ull << 30)));
  CHECK(s.cluster.gpu.peak_flops_16 == Approx(312e12));
  CHECK(s.cluster.gpu.nvlink_bandwidth == Approx(300e9));
  CHECK(s.cluster.nic_bandwidth == Approx(25e9));
  CHECK(s.cluster.nics_per_node == 8);
  CHECK(s.cluster.switch_latency == Approx(130e-9));
  CHECK(s.warnings.empty());
}

TEST_CASE("every shipped scenario loads, validates and round-trips through to_yaml", "[scenario]") {
  std::vector<std::string> files;
  for (auto dir : {data_root() + "/scenarios", data_root() + "/scenarios/tiny"})
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".yaml") files.push_back(e.path().string());
  REQUIRE(files.size() >= 12);
  for (const auto& f : files) {
    INFO(f);
    Scenario s;
    REQUIRE_NOTHROW(s = load_scenario(f));
    CHECK_NOTHROW(validate(s));
    CHECK(s.parallel.world() == s.cluster.world());
    CHECK(s.training.global_batch == int64_t(s.training.micro_batch) * s.training.grad_accum * s.parallel.dp);
    const Scenario r = load_scenario_from_string(to_yaml(s), {}, "<roundtrip>");
    CHECK(to_yaml(r) == to_yaml(s));
    CHECK(r.cluster.gpu.hbm_bandwidth == s.cluster.gpu.hbm_bandwidth);
    CHECK(r.model.ffn_hidden == s.model.ffn_hidden);
  }
}

TEST_CASE("shipped scenarios say what they model", "[scenario]") {
  const Scenario z2 = load_scenario(shipped("gpt13b_zero2.yaml"));
  CHECK(z2.zero.stage == 2);
  CHECK(z2.parallel.dp == 64);
  CHECK(z2.training.grad_accum == 4);
  CHECK(z2.cluster.gpu.name == "A100-40GB");
  CHECK(z2.cluster.host_memory_bytes == Approx(1e12));  // dgx-a100-40gb-hdr overrides its parent
  CHECK(z2.cluster.nic_bandwidth == Approx(25e9));      // inherited from dgx-a100-hdr

  const Scenario z3 = load_scenario(shipped("gpt7b_zero3_offload.yaml"));
  CHECK(z3.zero.stage == 3);
  CHECK(z3.zero.offload_optimizer);
  CHECK(z3.zero.offload_param);
  CHECK(z3.model.layers == 32);

  const Scenario moe = load_scenario(shipped("moe.yaml"));
  CHECK(moe.model.experts == 64);
  CHECK(moe.model.moe_every == 2);
  CHECK(moe.model.moe_layers() == 12);
  CHECK(moe.parallel.ep == 8);
  CHECK(moe.parallel.dp == 64);

  const Scenario ob = load_scenario(shipped("onebit_adam.yaml"));
  CHECK(ob.optimizer.kind == OptimizerKind::onebit_adam);
  CHECK(ob.optimizer.freeze_step == 23000);
  CHECK(ob.optimizer.step == 30000);
  CHECK(ob.precision.dtype == Dtype::fp16);
  CHECK(ob.model.seq_len == 128);
  CHECK(ob.cluster.gpu.nvlink_bandwidth == Approx(150e9));
  CHECK(ob.cluster.gpus_per_node == 16);

  const Scenario pp3 = load_scenario(shipped("tiny/tiny_pp3.yaml"));
  CHECK(pp3.parallel.pp == 3);
  CHECK(pp3.training.grad_accum == 4);
  CHECK(pp3.model.hidden == 64);
}

TEST_CASE("load_scenario finds shipped scenarios by name", "[scenario]") {
  CHECK(load_scenario("gpt175b").model.layers == 96);
  CHECK(load_scenario("tiny/tiny_dp2").parallel.dp == 2);
  CHECK_THAT(config_error([] { load_scenario("no_such_scenario"); }),
             Contains("cannot open scenario 'no_such_scenario'") && Contains("gpt175b"));
}

TEST_CASE("GPU presets carry the datasheet numbers", "[scenario]") {
  struct Expect { const char* name; double nvlink, mem_gib, peak16; };
  for (const auto& e : {Expect{"V100-32GB", 150e9, 32, 125e12}, Expect{"A100-40GB", 300e9, 40, 312e12},
                        Expect{"A100-80GB", 300e9, 80, 312e12}, Expect{"H100-SXM", 450e9, 80, 989.5e12},
                        Expect{"H200-SXM", 450e9, 143771.0 / 1024, 989.5e12}}) {
    INFO(e.name);
    const Scenario s = load_scenario_from_string(tiny_yaml() + "  gpu: " + e.name + "\n");
    CHECK(s.cluster.gpu.name == e.name);
    CHECK(s.cluster.gpu.nvlink_bandwidth == Approx(e.nvlink));
    CHECK(s.cluster.gpu.memory_bytes == Approx(e.mem_gib * (1ull << 30)));
    CHECK(s.cluster.gpu.peak_flops_16 == Approx(e.peak16));
    CHECK(s.cluster.gpu.peak_flops_32 > 0);
    CHECK(s.cluster.gpu.hbm_bandwidth > 0);
    CHECK(s.cluster.gpu.pcie_bandwidth > 0);
    CHECK(s.cluster.gpu.gemm_efficiency > 0.5);
    CHECK(s.cluster.gpu.gemm_efficiency < 1.0);
  }
  CHECK(list_presets("gpus") == std::vector<std::string>{"A100-40GB", "A100-80GB", "H100-SXM", "H200-SXM", "V100-32GB"});
}

TEST_CASE("model and cluster presets", "[scenario]") {
  for (const auto& name : {"gpt3-175b", "gpt-13b", "gpt-7b", "gpt-1.3b", "gpt-350m", "gpt3-125m", "gpt3-760m", "gpt3-2.7b",
                           "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "tiny"}) {
    auto models = list_presets("models");
    CHECK(std::find(models.begin(), models.end(), name) != models.end());
  }
  for (const auto& name : {"dgx-a100-hdr", "dgx-h100-ndr", "single-node-pcie"}) {
    auto clusters = list_presets("clusters");
    CHECK(std::find(clusters.begin(), clusters.end(), name) != clusters.end());
  }
  const Scenario h = load_scenario_from_string("model: tiny\ntraining: {micro_batch: 1}\ncluster: {preset: dgx-h100-ndr, nodes: 2}\n");
  CHECK(h.cluster.name == "dgx-h100-ndr");
  CHECK(h.cluster.gpu.name == "H100-SXM");
  CHECK(h.cluster.nic_bandwidth == Approx(50e9));  // 400 Gb/s NDR
  CHECK(h.cluster.world() == 16);
  CHECK(h.parallel.dp == 16);
  const Scenario h200 = load_scenario_from_string("model: tiny\ntraining: {micro_batch: 1}\ncluster: hgx-h200-ndr\n");
  CHECK(h200.cluster.gpu.name == "H200-SXM");
  CHECK(h200.cluster.nic_bandwidth == Approx(50e9));  // from the parent preset dgx-h100-ndr
}

TEST_CASE("explicit model keys override the preset", "[scenario]") {
  const Scenario s = load_scenario_from_string(
      "model:\n  preset: gpt-1.3b\n  layers: 12\n  seq_len: 1024\n"
      "training:\n  micro_batch: 1\n"
      "cluster:\n  preset: dgx-a100-hdr\n");
  CHECK(s.model.name == "gpt-1.3b");
  CHECK(s.model.layers == 12);
  CHECK(s.model.seq_len == 1024);
  CHECK(s.model.hidden == 2048);  // from the preset
  CHECK(s.parallel.dp == 8);      // derived: 8 GPUs / (tp 1 * pp 1)
  CHECK(s.training.global_batch == 8);  // DeepSpeed: micro_batch alone -> micro * dp, grad_accum 1
  CHECK(s.training.grad_accum == 1);
}

TEST_CASE("a custom model needs no preset - ffn_hidden defaults to 4h", "[scenario]") {
  const Scenario s = load_scenario_from_string(
      "model: {layers: 4, hidden: 128, heads: 8, vocab: 1000, seq_len: 64, ffn_hidden: 384, tied_embeddings: false}\n"
      "training: {global_batch: 2, micro_batch: 1}\n"
      "cluster: {preset: single-node-pcie, gpus_per_node: 1}\n");
  CHECK(s.model.name == "custom");
  CHECK(s.model.ffn_hidden == 384);
  CHECK_FALSE(s.model.tied_embeddings);
  CHECK(s.training.grad_accum == 2);
  const Scenario d = load_scenario_from_string(
      "model: {layers: 4, hidden: 128, heads: 8, vocab: 1000, seq_len: 64}\n"
      "training: {global_batch: 2, micro_batch: 1}\n"
      "cluster: {preset: single-node-pcie, gpus_per_node: 1}\n");
  CHECK(d.model.ffn_hidden == 512);
}

TEST_CASE("a GPU preset given as a path, quantities written with units", "[scenario]") {
  const Scenario s = load_scenario(scenario_data("custom_gpu.yaml"));
  CHECK(s.name == "custom_gpu_cluster");
  CHECK(s.cluster.gpu.memory_bytes == Approx(24.0 * (1ull << 30)));
  CHECK(s.cluster.gpu.hbm_bandwidth == Approx(1e12));
  CHECK(s.cluster.gpu.peak_flops_16 == Approx(165e12));
  CHECK(s.cluster.gpu.peak_flops_32 == Approx(82.6e12));
  CHECK(s.cluster.gpu.pcie_bandwidth == Approx(25e9));
  CHECK(s.cluster.gpu.kernel_launch == Approx(3e-6));
  CHECK(s.cluster.gpu.gemm_efficiency == Approx(0.82));  // inherited from A100-80GB
  CHECK(s.cluster.nic_bandwidth == Approx(12.5e9));
  CHECK(s.cluster.nic_latency == Approx(1.5e-6));
  CHECK(s.cluster.host_memory_bytes == Approx(512.0 * (1ull << 30)));
  CHECK(s.cluster.host_memory_bandwidth == Approx(200e9));
  CHECK(s.parallel.dp == 8);
  CHECK(s.training.global_batch == 8);
}

TEST_CASE("plain SI numbers and unit strings give the same scenario", "[scenario]") {
  const Scenario a = load_scenario_from_string(tiny_yaml() + "  nic_bandwidth: 200 Gb/s\n  nic_latency: 2 us\n  host_memory: 1 TB\n");
  const Scenario b = load_scenario_from_string(tiny_yaml() + "  nic_bandwidth: 25e9\n  nic_latency: 2e-6\n  host_memory: 1e12\n");
  CHECK(a.cluster.nic_bandwidth == b.cluster.nic_bandwidth);
  CHECK(a.cluster.nic_latency == b.cluster.nic_latency);
  CHECK(a.cluster.host_memory_bytes == b.cluster.host_memory_bytes);
  CHECK(a.cluster.nic_bandwidth == Approx(25e9));
}

TEST_CASE("section shorthands: a name in place of a section", "[scenario]") {
  const Scenario s = load_scenario_from_string(tiny_yaml() + "precision: fp16\nzero: 1\n"
                                               "activation_checkpointing: selective\n", {}, "<s>");
  CHECK(s.precision.dtype == Dtype::fp16);
  CHECK(s.zero.stage == 1);
  CHECK(s.model.name == "tiny");
  CHECK(s.recompute == Recompute::selective);
  const Scenario t = load_scenario_from_string(tiny_yaml() + "activation_checkpointing: true\noptimizer: onebit_adam\n");
  CHECK(t.recompute == Recompute::full);
  CHECK(t.optimizer.kind == OptimizerKind::onebit_adam);
  const Scenario n = load_scenario_from_string(tiny_yaml());
  CHECK(n.recompute == Recompute::none);
  CHECK(n.name == "custom");
  CHECK(n.zero.stage == 0);
}

TEST_CASE("precision and optimizer blocks", "[scenario]") {
  const Scenario s = load_scenario_from_string(
      "model: tiny\ncluster: {preset: single-node-pcie, gpus_per_node: 2}\n"
      "precision:\n  dtype: fp16\n  loss_scale: {scale: 1024, initial_scale_power: 12, loss_scale_window: 500, hysteresis: 3, min_loss_scale: 0.5}\n"
      "optimizer: {type: adamw, lr: 3e-4, betas: [0.8, 0.95], eps: 1e-6, weight_decay: 0.1}\n"
      "training: {global_batch: 8, micro_batch: 1, gradient_clipping: 0.5, seed: 42, tokens_to_train: 1e9}\n");
  CHECK(s.precision.loss_scale.loss_scale == 1024);
  CHECK(s.precision.loss_scale.initial_scale_power == 12);
  CHECK(s.precision.loss_scale.loss_scale_window == 500);
  CHECK(s.precision.loss_scale.hysteresis == 3);
  CHECK(s.precision.loss_scale.min_loss_scale == 0.5);
  CHECK(s.optimizer.lr == Approx(3e-4));
  CHECK(s.optimizer.beta1 == Approx(0.8));
  CHECK(s.optimizer.beta2 == Approx(0.95));
  CHECK(s.optimizer.eps == Approx(1e-6));
  CHECK(s.optimizer.weight_decay == Approx(0.1));
  CHECK(s.training.gradient_clipping == 0.5);
  CHECK(s.training.seed == 42);
  CHECK(s.training.tokens_to_train == 1e9);
  const Scenario d = load_scenario_from_string(tiny_yaml() + "precision: {dtype: fp16, loss_scale: dynamic}\n");
  CHECK(d.precision.loss_scale.loss_scale == 0);
}

TEST_CASE("option --set overrides the file, in order, with YAML values", "[scenario]") {
  LoadOptions o;
  o.overrides = {"parallel.tp=2", "zero.stage=1", "optimizer.betas=[0.9, 0.98]", "cluster.nic_bandwidth=400 Gb/s",
                 "zero.stage=2"};
  const Scenario s = load_scenario_from_string(tiny_yaml(), o);
  CHECK(s.parallel.tp == 2);
  CHECK(s.parallel.dp == 1);  // derived from the new tp
  CHECK(s.zero.stage == 2);   // the last --set wins
  CHECK(s.optimizer.beta2 == Approx(0.98));
  CHECK(s.cluster.nic_bandwidth == Approx(50e9));
  LoadOptions m;
  m.overrides = {"model=gpt-350m", "model.layers=2", "cluster.gpu=H100-SXM"};
  const Scenario t = load_scenario_from_string(tiny_yaml(), m);
  CHECK(t.model.hidden == 1024);
  CHECK(t.model.layers == 2);
  CHECK(t.cluster.gpu.name == "H100-SXM");
  CHECK_THAT(config_error([] { LoadOptions b; b.overrides = {"parallel.tp"}; load_scenario_from_string(tiny_yaml(), b); }),
             Contains("--set expects key.path=value"));
  CHECK_THAT(config_error([] { LoadOptions b; b.overrides = {"parallel.tpp=2"}; load_scenario_from_string(tiny_yaml(), b); }),
             Contains("unknown key 'parallel.tpp' (--set); did you mean 'parallel.tp'?"));
  CHECK_THAT(config_error([] { LoadOptions b; b.overrides = {"parallel.tp=two"}; load_scenario_from_string(tiny_yaml(), b); }),
             Contains("parallel.tp (--set): expected an integer, got 'two'"));
}

TEST_CASE("option --set of one batch key re-derives the one left to derive", "[scenario]") {
  LoadOptions o;
  o.overrides = {"training.micro_batch=2"};
  const Scenario s = load_scenario(shipped("gpt175b.yaml"), o);
  CHECK(s.training.global_batch == 1536);
  CHECK(s.training.micro_batch == 2);
  CHECK(s.training.grad_accum == 48);
  // a file giving all three: setting micro_batch re-derives grad_accum ...
  const std::string three = "model: tiny\ntraining: {global_batch: 8, micro_batch: 1, grad_accum: 4}\n"
                            "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n";
  o.overrides = {"training.micro_batch=2"};
  const Scenario a = load_scenario_from_string(three, o);
  CHECK(a.training.global_batch == 8);
  CHECK(a.training.grad_accum == 2);
  // ... and setting grad_accum re-derives micro_batch
  o.overrides = {"training.grad_accum=1"};
  const Scenario b = load_scenario_from_string(three, o);
  CHECK(b.training.global_batch == 8);
  CHECK(b.training.micro_batch == 4);
  // two keys set: the third is derived from them
  o.overrides = {"training.micro_batch=1", "training.grad_accum=2"};
  const Scenario c = load_scenario_from_string(three, o);
  CHECK(c.training.global_batch == 4);
}

TEST_CASE("option --gpus resizes the cluster and the data-parallel degree", "[scenario]") {
  LoadOptions o;
  o.gpus = 512;
  const Scenario s = load_scenario(shipped("gpt175b.yaml"), o);
  CHECK(s.cluster.nodes == 64);
  CHECK(s.cluster.gpus_per_node == 8);
  CHECK(s.parallel.dp == 8);
  CHECK(s.training.global_batch == 1536);
  CHECK(s.training.grad_accum == 192);

  o.gpus = 4;  // fewer than a node holds: one node of 4
  const Scenario q = load_scenario_from_string(
      "model: tiny\ntraining: {global_batch: 16, micro_batch: 1}\ncluster: {preset: dgx-a100-hdr, nodes: 2}\n", o);
  CHECK(q.cluster.nodes == 1);
  CHECK(q.cluster.gpus_per_node == 4);
  CHECK(q.parallel.dp == 4);
  CHECK(q.training.grad_accum == 4);

  // a single host without NICs grows within the host
  const Scenario t = load_scenario(shipped("tiny/tiny_zero3_dp2.yaml"), o);
  CHECK(t.cluster.nodes == 1);
  CHECK(t.cluster.gpus_per_node == 4);
  CHECK(t.parallel.dp == 4);
  CHECK(t.training.micro_batch == 1);
  CHECK(t.training.global_batch == 4);
  CHECK(t.training.grad_accum == 1);
  // a global batch too small for the new size is DeepSpeed's error
  CHECK_THAT(config_error([&] { load_scenario(shipped("tiny/tiny_dp2.yaml"), o); }),
             Contains("Gradient accumulation steps: 0 has to be greater than 0"));

  o.gpus = 1020;
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt175b.yaml"), o); }),
             Contains("--gpus 1020 is not a multiple of cluster.gpus_per_node (8)"));
  o.gpus = 8;
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt175b.yaml"), o); }),
             Contains("--gpus 8 is not a multiple of parallel.tp * parallel.pp = 8 * 8 = 64"));
}

TEST_CASE("option --gpus on a scenario giving the whole batch triple keeps global and micro batch", "[scenario]") {
  LoadOptions o;
  o.gpus = 4;
  const Scenario s = load_scenario_from_string(
      "model: tiny\ntraining: {global_batch: 8, micro_batch: 1, grad_accum: 4}\n"
      "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n", o);
  CHECK(s.parallel.dp == 4);
  CHECK(s.training.grad_accum == 2);
}

TEST_CASE("DeepSpeed's batch rules derive the missing batch size", "[scenario]") {
  auto resolved = [](int64_t g, int m, int a, int dp) {
    TrainingSpec t;
    t.global_batch = g;
    t.micro_batch = m;
    t.grad_accum = a;
    resolve_batch(t, dp);
    return std::tuple<int64_t, int, int>(t.global_batch, t.micro_batch, t.grad_accum);
  };
  CHECK(resolved(1536, 1, 0, 16) == std::tuple<int64_t, int, int>(1536, 1, 96));
  CHECK(resolved(1536, 0, 12, 16) == std::tuple<int64_t, int, int>(1536, 8, 12));
  CHECK(resolved(0, 4, 8, 2) == std::tuple<int64_t, int, int>(64, 4, 8));
  CHECK(resolved(64, 0, 0, 8) == std::tuple<int64_t, int, int>(64, 8, 1));
  CHECK(resolved(0, 3, 0, 4) == std::tuple<int64_t, int, int>(12, 3, 1));
  CHECK(resolved(8, 2, 2, 2) == std::tuple<int64_t, int, int>(8, 2, 2));
  CHECK_THAT(config_error([&] { resolved(8, 2, 1, 1); }),
             Contains("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 2 * 1 * 1"));
  // floor division, then DeepSpeed's assertion
  CHECK_THAT(config_error([&] { resolved(10, 3, 0, 1); }), Contains("10 != 3 * 3 * 1"));
  CHECK_THAT(config_error([&] { resolved(0, 0, 4, 1); }),
             Contains("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"));
  CHECK_THAT(config_error([&] { resolved(4, 0, 0, 8); }), Contains("Micro batch size per gpu: 0 has to be greater than 0"));
  CHECK_THAT(config_error([&] { resolved(4, 8, 0, 1); }), Contains("Gradient accumulation steps: 0 has to be greater than 0"));
}

TEST_CASE("data_root follows DSSIM_HOME", "[scenario]") {
  const std::string before = data_root();
  CHECK(std::filesystem::exists(before + "/scenarios/gpt175b.yaml"));
  ::setenv("DSSIM_HOME", "/nonexistent-dssim-home", 1);
  CHECK(data_root() == "/nonexistent-dssim-home");
  CHECK(list_presets("gpus").empty());
  ::unsetenv("DSSIM_HOME");
  CHECK(data_root() == before);
}

TEST_CASE("to_string of the scenario enums", "[scenario]") {
  CHECK(std::string(to_string(Dtype::bf16)) == "bf16");
  CHECK(std::string(to_string(Dtype::fp16)) == "fp16");
  CHECK(std::string(to_string(Dtype::fp32)) == "fp32");
  CHECK(std::string(to_string(Recompute::selective)) == "selective");
  CHECK(std::string(to_string(Recompute::full)) == "full");
  CHECK(std::string(to_string(Recompute::none)) == "none");
  CHECK(std::string(to_string(OptimizerKind::onebit_adam)) == "onebit_adam");
  CHECK(std::string(to_string(ModelSpec::CrossEntropy::fused)) == "fused");
  CHECK(std::string(to_string(ModelSpec::CrossEntropy::fused_linear)) == "fused_linear");
}

TEST_CASE("model.cross_entropy: unfused, fused or fused_linear - round-trips - anything else refused", "[scenario]") {
  const std::string base = "model: {preset: gpt-1.3b}\ntraining: {micro_batch: 1}\ncluster: {preset: dgx-a100-hdr}\n";
  CHECK(load_scenario_from_string(base).model.cross_entropy == ModelSpec::CrossEntropy::unfused);
  for (const auto& [name, kind] : {std::pair{"unfused", ModelSpec::CrossEntropy::unfused},
                                   std::pair{"fused", ModelSpec::CrossEntropy::fused},
                                   std::pair{"fused_linear", ModelSpec::CrossEntropy::fused_linear}}) {
    LoadOptions lo;
    lo.overrides = {std::string("model.cross_entropy=") + name};
    const Scenario s = load_scenario_from_string(base, lo);
    CHECK(s.model.cross_entropy == kind);
    CHECK(s.model.fused_cross_entropy() == (kind == ModelSpec::CrossEntropy::fused_linear));
    CHECK(load_scenario_from_string(to_yaml(s)).model.cross_entropy == kind);
  }
  LoadOptions bad;
  bad.overrides = {"model.cross_entropy=liger"};
  CHECK_THROWS_WITH(load_scenario_from_string(base, bad),
                    Contains("model.cross_entropy") && Contains("fused_linear"));
}

TEST_CASE("optimizer.fused_step: default true, false round-trips through the resolved YAML", "[scenario]") {
  const Scenario d = load_scenario_from_string("model: tiny\ntraining: {micro_batch: 1}\ncluster: hgx-h200-ndr\n");
  CHECK(d.optimizer.fused_step);
  CHECK(to_yaml(d).find("fused_step") == std::string::npos);  // only the non-default is written
  const Scenario u = load_scenario_from_string("model: tiny\ntraining: {micro_batch: 1}\ncluster: hgx-h200-ndr\noptimizer: {fused_step: false}\n");
  CHECK_FALSE(u.optimizer.fused_step);
  const Scenario r = load_scenario_from_string(to_yaml(u), {}, "<roundtrip>");
  CHECK_FALSE(r.optimizer.fused_step);  // measurement records keep what their engine ran
  CHECK_THROWS(load_scenario_from_string("model: tiny\ntraining: {micro_batch: 1}\ncluster: hgx-h200-ndr\noptimizer: {fused_step: 3}\n"));
}
