// Every validation rule (docs/scenario-format.md, "Validation"): a ConfigError naming the key, the
// line where the key was written, and the fix.
#include <catch2/catch.hpp>
#include "core/scenario_loader.hpp"
#include "core/validate.hpp"
#include "scenario_test_util.hpp"
#include "validation/harness.hpp"

#include <filesystem>
#include <fstream>

using namespace dssim;
using namespace dssim::test;
using Catch::Contains;

namespace {
std::string load_error(const std::string& yaml, LoadOptions o = {}) {
  return config_error([&] { load_scenario_from_string(yaml, o, "t.yaml"); });
}
}  // namespace

TEST_CASE("unknown key: line and the closest valid key", "[validate]") {
  CHECK_THAT(config_error([] { load_scenario(scenario_data("unknown_key.yaml")); }),
             Contains("unknown key 'parallel.tpp' at line 7; did you mean 'parallel.tp'?") && Contains("unknown_key.yaml"));
  CHECK_THAT(load_error(tiny_yaml() + "  nic_bandwith: 25e9\n"),
             Contains("unknown key 'cluster.nic_bandwith' at line 11; did you mean 'cluster.nic_bandwidth'?"));
  CHECK_THAT(load_error("paralel:\n  tp: 2\n"), Contains("unknown key 'paralel' at line 1; did you mean 'parallel'?"));
  // nothing close: the valid keys of the section are listed
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n  bananas: 3\n")),
             Contains("unknown key 'parallel.bananas' at line 7; valid keys in 'parallel': tp, pp, dp, ep"));
  CHECK_THAT(load_error("model: tiny\nfoo_bar_baz: 1\n"), Contains("valid top-level keys: name, description"));
  // the right key in the wrong section
  CHECK_THAT(load_error("model: tiny\ntraining:\n  tp: 2\n"), Contains("unknown key 'training.tp' at line 3; did you mean 'parallel.tp'?"));
  CHECK_THAT(load_error("model: tiny\nlayers: 2\n"), Contains("unknown key 'layers' at line 2; did you mean 'model.layers'?"));
}

TEST_CASE("a key given twice in one file", "[validate]") {
  CHECK_THAT(load_error("model: tiny\ntraining:\n  micro_batch: 1\n  micro_batch: 2\n"),
             Contains("t.yaml: training.micro_batch is given twice, at line 3 and at line 4; keep one"));
}

TEST_CASE("wrong type: the key, its line and what was expected", "[validate]") {
  CHECK_THAT(config_error([] { load_scenario(scenario_data("wrong_type.yaml")); }),
             Contains("parallel.tp at line 3: expected an integer, got 'eight'"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1.5\n")), Contains("parallel.tp at line 6: expected an integer, got '1.5'"));
  CHECK_THAT(load_error(tiny_yaml("  sequence_parallel: maybe\n")),
             Contains("parallel.sequence_parallel at line 6: expected true or false, got 'maybe'"));
  CHECK_THAT(load_error(tiny_yaml() + "  nic_bandwidth: 80 GiB\n"),
             Contains("cluster.nic_bandwidth at line 11: expected a bandwidth such as '200 Gb/s'") && Contains("got '80 GiB'"));
  CHECK_THAT(load_error(tiny_yaml() + "  nic_latency: [1, 2]\n"), Contains("cluster.nic_latency at line 11: expected a time") &&
                                                                       Contains("got a list"));
  CHECK_THAT(load_error(tiny_yaml("  tp: {a: 1}\n")), Contains("parallel.tp at line 6: expected a value, got a mapping"));
  CHECK_THAT(load_error("model: tiny\nparallel: [1, 2]\n"), Contains("parallel at line 2: expected a mapping of parallel keys"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "precision: fp8\n")),
             Contains("precision.dtype at line 7: expected one of fp32, fp16, bf16, got 'fp8'"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "activation_checkpointing: ful\n")),
             Contains("expected one of none, selective, full, selective_op, got 'ful'; did you mean 'full'?"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "optimizer: {betas: [0.9]}\n")),
             Contains("optimizer.betas at line 7: expected a list of two numbers"));
  CHECK_THAT(load_error(tiny_yaml("  pp: 2\n  partition: [1, x]\n")), Contains("parallel.partition[1]") && Contains("got 'x'"));
}

TEST_CASE("malformed YAML: yaml-cpp's line and column", "[validate]") {
  const std::string e = config_error([] { load_scenario(scenario_data("malformed.yaml")); });
  // the flow sequence opened on line 4 is found unclosed where line 5 starts
  CHECK_THAT(e, Contains("malformed.yaml: malformed YAML at line 5, column") && Contains("end of sequence flow not found"));
  CHECK_THAT(load_error("model: tiny\n  bad indent: [\n"), Contains("t.yaml: malformed YAML at line 2"));
  CHECK_THAT(load_error(""), Contains("the scenario is empty"));
  CHECK_THAT(load_error("- a\n- b\n"), Contains("a scenario must be a YAML mapping"));
}

TEST_CASE("batch triple inconsistent", "[validate]") {
  CHECK_THAT(load_error("model: tiny\ntraining: {global_batch: 8, micro_batch: 2, grad_accum: 1}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("t.yaml: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                      "gradient_acc_step * world_size 8 != 2 * 1 * 2") &&
                 Contains("training.global_batch at line 2"));
  CHECK_THAT(load_error("model: tiny\ntraining: {grad_accum: 2}\ncluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"));
  CHECK_THAT(load_error("model: tiny\ntraining: {micro_batch: 0}\ncluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("training.micro_batch at line 2: must be at least 1, got 0"));
}

TEST_CASE("heads must be divisible by tp", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  tp: 3\n", "  preset: single-node-pcie\n  gpus_per_node: 3\n")),
             Contains("model.heads (4)") && Contains("is not divisible by parallel.tp (3) at line 6") && Contains("1, 2, 4"));
}

TEST_CASE("layers pp does not divide get a partition - an explicit one is checked", "[validate]") {
  // parallel.partition_method (core/pipeline_partition.hpp, tests in test_pipeline_partition.cpp).
  CHECK(load_scenario_from_string("model: {preset: tiny, layers: 5}\ntraining: {micro_batch: 1}\nparallel: {pp: 2}\n"
                                  "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n")
            .parallel.partition.size() == 2);
  const Scenario s = load_scenario(scenario_data("partition.yaml"));
  CHECK(s.parallel.partition == std::vector<int>{3, 2});
  CHECK_THAT(load_error("model: {preset: tiny, layers: 5}\ntraining: {micro_batch: 1}\nparallel: {pp: 2, partition: [3, 3]}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("parallel.partition at line 3 sums to 6 layers but model.layers is 5"));
  CHECK_THAT(load_error("model: {preset: tiny, layers: 5}\ntraining: {micro_batch: 1}\nparallel: {pp: 2, partition: [5]}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("parallel.partition at line 3 lists 1 stages but parallel.pp is 2"));
}

TEST_CASE("experts must be divisible by ep, and ep must divide dp", "[validate]") {
  const std::string moe6 = "model: {preset: tiny, experts: 6}\ntraining: {micro_batch: 1}\n";
  CHECK_THAT(load_error(moe6 + "parallel: {ep: 4}\ncluster: {preset: single-node-pcie, gpus_per_node: 4}\n"),
             Contains("model.experts (6) at line 1 is not divisible by parallel.ep (4) at line 3"));
  CHECK_THAT(load_error("model: {preset: tiny, experts: 8}\ntraining: {micro_batch: 1}\n"
                        "parallel: {ep: 4}\ncluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("parallel.ep (4) at line 3 must divide parallel.dp (2)") && Contains("{1, 2}"));
  CHECK_THAT(load_error(tiny_yaml("  ep: 2\n")), Contains("parallel.ep (2) at line 6 requires a mixture-of-experts model"));
  CHECK_THAT(load_error("model: {preset: tiny, experts: 2, top_k: 3}\ntraining: {micro_batch: 1}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("model.top_k (3) at line 1 must be between 1 and model.experts (2)"));
}

TEST_CASE("tp * pp * dp must equal the GPU count", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n  dp: 4\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n")),
             Contains("tp * pp * dp = 1 * 1 * 4 = 4 but the cluster has 2 GPUs") && Contains("set parallel.dp: 2") &&
                 Contains("cluster.gpus_per_node 2 at line 10"));
  LoadOptions gpt;
  gpt.overrides = {"parallel.dp=8"};
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt175b.yaml"), gpt); }),
             Contains("8 * 8 * 8 = 512 but the cluster has 1024 GPUs") && Contains("set parallel.dp: 16") &&
                 Contains("or set cluster.nodes: 64"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n  pp: 3\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n")),
             Contains("does not divide the cluster's 2 GPUs"));
}

TEST_CASE("tensor parallelism across nodes is allowed with a warning", "[validate]") {
  const Scenario s = load_scenario_from_string(
      "model: tiny\ntraining: {micro_batch: 1}\nparallel: {tp: 4}\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: 2, nodes: 2}\n");
  CHECK(s.parallel.tp == 4);
  CHECK(has_warning_with(s, "parallel.tp (4) is larger than cluster.gpus_per_node (2)"));
  CHECK(validation_warnings(s).size() == 1);
}

TEST_CASE("ZeRO stage 2/3 with pipeline parallelism is refused", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  pp: 2\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "zero:\n  stage: 2\n")),
             Contains("DeepSpeed refuses ZeRO stage 2/3 with pipeline parallelism (pp=2) at line 8: use zero.stage 0 or 1 with pp > 1"));
  LoadOptions o;
  o.overrides = {"zero.stage=3"};
  CHECK_THAT(config_error([&] { load_scenario(shipped("gpt175b.yaml"), o); }),
             Contains("DeepSpeed refuses ZeRO stage 2/3 with pipeline parallelism (pp=8) (--set)"));
  CHECK_NOTHROW(load_scenario_from_string(tiny_yaml("  pp: 2\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "zero: 1\n")));
}

TEST_CASE("1-bit Adam with ZeRO is refused", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                                  "zero: {stage: 1}\noptimizer: {type: onebit_adam}\n")),
             Contains("1-bit Adam is not compatible with ZeRO") && Contains("set zero.stage: 0"));
}

TEST_CASE("fp16 and bf16 both enabled is refused (ds_config)", "[validate]") {
  LoadOptions o;
  o.deepspeed_config = ds_data("bad_fp16_and_bf16.json");
  CHECK_THAT(config_error([&] { load_scenario(scenario_data("minimal.yaml"), o); }),
             Contains("bf16 and fp16 modes cannot be simultaneously enabled"));
}

TEST_CASE("offload_param needs ZeRO stage 3 - offload_optimizer needs ZeRO", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                                  "zero: {stage: 2, offload_param: true}\n")),
             Contains("zero.offload_param at line 7 requires ZeRO stage 3 (zero.stage is 2)"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                                  "zero: {offload_optimizer: true}\n")),
             Contains("zero.offload_optimizer at line 7 requires ZeRO"));
  CHECK_NOTHROW(load_scenario_from_string(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                                                    "zero: {stage: 3, offload_param: true, offload_optimizer: true}\n")));
}

TEST_CASE("interleaving needs pp > 1 and micro-batches divisible by pp", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  interleave: 2\n")),
             Contains("parallel.interleave (2) at line 6 requires pipeline parallelism (pp > 1)"));
  // 4 layers, pp 2, interleave 2, global 6 / micro 1 -> 6 micro-batches on dp 1: 6 % 2 == 0 fine; 3 is not
  const std::string base = "model: {preset: tiny, layers: 4}\nparallel: {pp: 2, interleave: 2}\n"
                           "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n";
  CHECK_NOTHROW(load_scenario_from_string(base + "training: {global_batch: 6, micro_batch: 1}\n"));
  CHECK_THAT(load_error(base + "training: {global_batch: 3, micro_batch: 1}\n"),
             Contains("needs the number of micro-batches (3, training.grad_accum) to be divisible by parallel.pp (2)"));
  // 6 layers on pp 2 x interleave 2: Megatron's split in whole chunks, 2 and 4 layers.
  CHECK(load_scenario_from_string("model: {preset: tiny, layers: 6}\nparallel: {pp: 2, interleave: 2}\ntraining: {global_batch: 4, micro_batch: 1}\n"
                                  "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n")
            .parallel.partition == std::vector<int>{2, 4});
  CHECK_THAT(load_error("model: {preset: tiny, layers: 5}\nparallel: {pp: 2, interleave: 2}\ntraining: {global_batch: 4, micro_batch: 1}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"),
             Contains("parallel.partition_method megatron with parallel.interleave 2: model.layers (5) must be divisible by the interleave"));
}

TEST_CASE("sequence parallelism needs tp > 1", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  sequence_parallel: true\n")),
             Contains("parallel.sequence_parallel at line 6 requires tensor parallelism (tp > 1)"));
  CHECK_NOTHROW(load_scenario_from_string(tiny_yaml("  tp: 2\n  sequence_parallel: true\n")));
}

TEST_CASE("unknown preset names list the available presets", "[validate]") {
  CHECK_THAT(load_error("model: gpt-8b\n"),
             Contains("t.yaml: model.preset at line 1: unknown model preset 'gpt-8b'; did you mean 'gpt-7b'?") &&
                 Contains("Available model presets: gpt-1.3b, gpt-13b, gpt-350m, gpt-7b, gpt3-125m, gpt3-175b, gpt3-2.7b, gpt3-760m, llama2-7b, llama3-405b, llama3-70b, llama3-8b, mixtral-8x7b, tiny"));
  CHECK_THAT(load_error("model: tiny\ncluster:\n  gpu: A100\n"),
             Contains("cluster.gpu.preset at line 3: unknown GPU preset 'A100'") && Contains("A100-40GB, A100-80GB, H100-SXM"));
  CHECK_THAT(load_error("model: tiny\ncluster: dgx-b200\n"), Contains("unknown cluster preset 'dgx-b200'") &&
                                                                 Contains("dgx-a100-hdr") && Contains("single-node-pcie"));
  CHECK_THAT(load_error("model: tiny\ncluster:\n  gpu: ./nope.yaml\n"), Contains("GPU preset file") && Contains("does not exist"));
}

TEST_CASE("numbers must be positive where it matters", "[validate]") {
  CHECK_THAT(load_error(tiny_yaml("  tp: 0\n")), Contains("parallel.tp at line 6: must be at least 1, got 0"));
  CHECK_THAT(load_error(tiny_yaml() + "  nic_bandwidth: 0\n"), Contains("cluster.nic_bandwidth at line 11: must be greater than 0"));
  CHECK_THAT(load_error(tiny_yaml() + "  nic_latency: -1 us\n"), Contains("cluster.nic_latency at line 11: must be at least 0"));
  CHECK_THAT(load_error(tiny_yaml() + "  oversubscription: 0.5\n"), Contains("cluster.oversubscription at line 11: must be at least 1"));
  CHECK_THAT(load_error("model: {preset: tiny, hidden: -64}\n"), Contains("model.hidden at line 1: must be at least 1, got -64"));
  CHECK_THAT(load_error(tiny_yaml("  tp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n", "zero: {stage: 4}\n")),
             Contains("zero.stage at line 7: ZeRO stage must be 0, 1, 2 or 3, got 4"));
  CHECK_THAT(load_error(tiny_yaml() + "  gpu: {preset: A100-80GB, gemm_efficiency: 1.2}\n"),
             Contains("cluster.gpu.gemm_efficiency") && Contains("must be in (0, 1], got 1.2"));
  CHECK_THAT(load_error("model: {layers: 2, hidden: 64, heads: 4, seq_len: 8}\ntraining: {micro_batch: 1}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 1}\n"),
             Contains("model.vocab must be positive, got 0; set it in the model section or use model.preset"));
  CHECK_THAT(load_error("model: {preset: tiny, hidden: 66}\ntraining: {micro_batch: 1}\n"
                        "cluster: {preset: single-node-pcie, gpus_per_node: 1}\n"),
             Contains("model.hidden (66) at line 1 is not divisible by model.heads (4)"));
  CHECK_THAT(load_error("model: tiny\ntraining: {micro_batch: 1}\ncluster: {gpus_per_node: 1, nodes: 1}\n"),
             Contains("cluster.gpu.memory must be positive, got 0; set cluster.gpu to a preset (A100-40GB"));
}

TEST_CASE("validate() checks a Scenario built in code", "[validate]") {
  Scenario s = load_scenario(shipped("tiny/tiny_dp2.yaml"));
  CHECK_NOTHROW(validate(s));
  Scenario a = s;
  a.parallel.tp = 3;
  CHECK_THROWS_AS(validate(a), ConfigError);
  Scenario b = s;
  b.zero.stage = 3;
  b.parallel.pp = 2;
  b.parallel.dp = 1;
  b.training.grad_accum = 2;
  CHECK_THAT(config_error([&] { validate(b); }), Contains("DeepSpeed refuses ZeRO stage 2/3 with pipeline parallelism (pp=2)"));
  Scenario c = s;
  c.training.grad_accum = 3;
  CHECK_THAT(config_error([&] { validate(c); }), Contains("4 != 2 * 3 * 2"));
  Scenario d = s;
  d.cluster.topology = "torus";
  CHECK_THAT(config_error([&] { validate(d); }), Contains("cluster.topology must be fat_tree or star, got 'torus'"));
}

// validation/harness.cpp: a throughput table's `tokens_per_second_per_gpu` is the job's tokens/s
// over its GPUs (llm-foundry's "Throughput (T/s/GPU)", torchtitan's "TPS/GPU").
TEST_CASE("validate: tokens_per_second_per_gpu divides the job's tokens/s by its GPUs", "[validate]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "dssim_test_tokens_per_gpu";
  fs::create_directories(dir);
  const fs::path table = dir / "t.yaml";
  {
    std::ofstream o(table);
    o << "name: t\ncitation: test\nkind: throughput\nmetric: tokens_per_second_per_gpu\n"
         "unit: tokens/s per GPU\nscenario:\n"
         "  model: tiny\n  training: {global_batch: 8, micro_batch: 1}\n"
         "  cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"
         "rows:\n  - {label: two, published: 2000}\n"
         "  - {label: four, published: 1000, set: [cluster.gpus_per_node=4]}\n";
  }
  // Every prediction: 4000 tokens/s for the whole job.
  const dssim::validation::Predictor predict = [](const Scenario&) {
    Report r;
    r.iteration_seconds = 1;
    r.tokens_per_second = 4000;
    return r;
  };
  const dssim::validation::Table t = dssim::validation::run_table(table.string(), predict);
  fs::remove_all(dir);
  REQUIRE(t.rows.size() == 2);
  CHECK(t.rows[0].predicted == Approx(2000));  // 4000 / 2 GPUs
  CHECK(t.rows[1].predicted == Approx(1000));  // 4000 / 4 GPUs
  CHECK(t.rows[0].error == Approx(0));
  CHECK(t.max_abs_error == Approx(0));
}

TEST_CASE("validate: an unknown metric names the known ones", "[validate]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "dssim_test_unknown_metric";
  fs::create_directories(dir);
  const fs::path table = dir / "t.yaml";
  {
    std::ofstream o(table);
    o << "name: t\ncitation: test\nkind: throughput\nmetric: tokens_per_gpu\nunit: x\nscenario:\n"
         "  model: tiny\n  training: {global_batch: 8, micro_batch: 1}\n"
         "  cluster: {preset: single-node-pcie, gpus_per_node: 2}\n"
         "rows:\n  - {label: two, published: 2000}\n";
  }
  const std::string err = config_error([&] {
    dssim::validation::run_table(table.string(), [](const Scenario&) { Report r; r.tokens_per_second = 1; return r; });
  });
  fs::remove_all(dir);
  CHECK_THAT(err, Contains("unknown metric 'tokens_per_gpu'") && Contains("tokens_per_second_per_gpu"));
}
