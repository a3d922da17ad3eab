// Pipeline partitions (core/pipeline_partition.hpp): DeepSpeed's partition_uniform /
// partition_balanced on vectors worked out by hand, the parameter / type weighting of the
// PipelineModule's layer list, Megatron's uneven first / last stage, the loader's defaults and
// errors, and that the partition reaches the memory model and the estimator.
#include <catch2/catch.hpp>
#include <numeric>
#include "core/estimator.hpp"
#include "core/memory.hpp"
#include "core/pipeline_partition.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using namespace dssim::test;
using Catch::Contains;
using V = std::vector<int>;

namespace {

std::string load_error(const std::string& yaml, LoadOptions o = {}) {
  return config_error([&] { load_scenario_from_string(yaml, o, "t.yaml"); });
}

// A model of `layers` layers (h 64, 4 heads, s 32, vocabulary `vocab`) on pp stages of one GPU.
std::string pp_yaml(int layers, int pp, const std::string& extra_parallel = "", int vocab = 256, int interleave = 1) {
  return "model: {preset: tiny, layers: " + std::to_string(layers) + ", vocab: " + std::to_string(vocab) + "}\n"
         "training: {global_batch: " + std::to_string(2 * pp) + ", micro_batch: 1}\n"
         "parallel: {pp: " + std::to_string(pp) + ", interleave: " + std::to_string(interleave) + extra_parallel + "}\n"
         "cluster: {preset: single-node-pcie, gpus_per_node: " + std::to_string(pp) + "}\n";
}

V sizes(const V& parts) {
  V out;
  for (size_t i = 0; i + 1 < parts.size(); ++i) out.push_back(parts[i + 1] - parts[i]);
  return out;
}

}  // namespace

TEST_CASE("partition_uniform is DeepSpeed's: the first (n % p) parts take one more", "[partition]") {
  // arange(0, 4*2, 2) = [0, 2, 4, 6], then parts[1:] += 1 (residual 1): [0, 3, 5, 7].
  CHECK(partition_uniform(7, 3) == V{0, 3, 5, 7});
  CHECK(partition_uniform(6, 3) == V{0, 2, 4, 6});
  // n <= p: part p holds item p, later parts are empty.
  CHECK(partition_uniform(2, 3) == V{0, 1, 2, 2});
  CHECK(sizes(partition_uniform(70, 12)) == V{6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5});
}

TEST_CASE("partition_balanced reproduces DeepSpeed's dynamic programme, ties included", "[partition]") {
  // Cost = heaviest part - lightest part. [1,1,1,1] in 2: splits 1|3 (2), 2|2 (0), 3|1 (2) -> k = 2.
  CHECK(partition_balanced({1, 1, 1, 1}, 2) == V{0, 2, 4});
  // [3,1,1,1]: 3|3 costs 0.
  CHECK(partition_balanced({3, 1, 1, 1}, 2) == V{0, 1, 4});
  // [1,1,1]: 1|2 and 2|1 both cost 1; `dp_cost >= cost` keeps the later split point: [0, 2, 3].
  CHECK(partition_balanced({1, 1, 1}, 2) == V{0, 2, 3});
  // [1,0,0,1]: 1|0,0,1 ... every split into {1},{1} costs 0; the last (k = 3) wins.
  CHECK(partition_balanced({1, 0, 0, 1}, 2) == V{0, 3, 4});
  // [1,2,3,4,5]: 6|9 (cost 3) beats 10|5 (5) and 3|12 (9).
  CHECK(partition_balanced({1, 2, 3, 4, 5}, 2) == V{0, 3, 5});
  // [5,1,1,1,1,5] in 3: 5|4|5 (cost 1) beats 5|3|6 (3) and 6|2|6 (4).
  CHECK(partition_balanced({5, 1, 1, 1, 1, 5}, 3) == V{0, 1, 5, 6});
  // No more items than parts: partition_uniform.
  CHECK(partition_balanced({2, 2}, 3) == V{0, 1, 2, 2});
}

TEST_CASE("the PipelineModule layer list: embedding, layers, final norm, head (tied embedding counted twice)", "[partition]") {
  Scenario s = load_scenario_from_string(pp_yaml(4, 2));
  const auto l = pipeline_module_layers(s);
  REQUIRE(l.size() == 7);
  CHECK(l.front().name == "EmbeddingPipe");
  CHECK(l.front().parameters == (256 + 32) * 64);
  CHECK(l[1].name == "ParallelTransformerLayerPipe");
  CHECK(l[1].parameters == 12 * 64 * 64 + 13 * 64);  // 49984
  CHECK(l[5].name == "LayerNorm");
  CHECK(l[5].parameters == 128);
  CHECK(l[6].name == "EmbeddingPipe");
  CHECK(l[6].parameters == l[0].parameters);
  s.model.tied_embeddings = false;
  CHECK(pipeline_module_layers(s).back().name == "LMHeadPipe");
  CHECK(pipeline_module_layers(s).back().parameters == 256 * 64);
}

TEST_CASE("parameters: the embedding and head take layers off the first and last stage", "[partition]") {
  // Vocabulary 2048: E = (2048 + 32) * 64 = 133120 (2.66 layers of 49984), N = 128. Total 666240,
  // 166560 a stage. [E+T | 3T | 3T | T+N+E] = 183104, 149952, 149952, 183232 costs 33280; moving a
  // layer to either end (E+2T = 233088) or out of the middle (2T = 99968) costs more.
  const Scenario s = load_scenario_from_string(pp_yaml(8, 4, ", partition_method: parameters", 2048));
  CHECK(s.parallel.partition == V{1, 3, 3, 1});
  CHECK(partition_layers(s, "uniform") == V{2, 2, 2, 2});
  // The same model with a small vocabulary (E = 18432, a third of a layer): uniform.
  const Scenario small = load_scenario_from_string(pp_yaml(8, 4, ", partition_method: parameters", 256));
  CHECK(small.parallel.partition.empty());
  CHECK(layers_per_stage(small) == V{2, 2, 2, 2});
}

TEST_CASE("70 layers on 12 stages and 126 on 16 load, with DeepSpeed's and Megatron's counts", "[partition]") {
  // BLOOM-shaped (h 14336, V 250880, no position table, tied): E = 3.60e9, a layer 2.47e9; the
  // DeepSpeed balance (checked against a Python port of partition_balanced) is 5, 6 x 10, 5.
  const std::string bloom =
      "model: {layers: 70, hidden: 14336, heads: 112, vocab: 250880, seq_len: 2048, position: rotary}\n"
      "training: {global_batch: 24, micro_batch: 1}\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 12}\n"
      "parallel: {tp: 8, pp: 12";
  const V bloom_split{5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5};
  CHECK(load_scenario_from_string(bloom + "}\n").parallel.partition == bloom_split);  // default: parameters
  CHECK(load_scenario_from_string(bloom + ", partition_method: parameters}\n").parallel.partition == bloom_split);
  // BLOOM's own setting, type:transformer|embedding: 73 items weighted 1, 1 x 70, 0, 1 -> 6 items each.
  CHECK(load_scenario_from_string(bloom + ", partition_method: 'type:transformer|embedding'}\n").parallel.partition == bloom_split);
  // type:transformer alone: 70 layers of weight 1; the balance puts the two short stages last.
  CHECK(load_scenario_from_string(bloom + ", partition_method: 'type:transformer'}\n").parallel.partition ==
        V{6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5});
  CHECK(load_scenario_from_string(bloom + ", partition_method: uniform}\n").parallel.partition ==
        V{6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5});
  // Megatron: middle stages ceil(70 / 12) = 6, the ends 70 - 60 = 10 -> 5 and 5.
  const Scenario meg = load_scenario_from_string(bloom + ", partition_method: megatron}\n");
  CHECK(meg.parallel.partition == bloom_split);

  // Llama 3 405B on 16 stages (untied, E = H = V h = 2.10e9, a layer 3.2e9): DeepSpeed's balance
  // (Python port) and Megatron's (middle 8, ends (126 - 112) / 2) agree: 7, 8 x 14, 7.
  const std::string llama = "model: llama3-405b\ntraining: {global_batch: 32, micro_batch: 1}\n"
                            "cluster: {preset: dgx-h100-ndr, nodes: 16}\nparallel: {tp: 8, pp: 16";
  V llama_split(16, 8);
  llama_split.front() = llama_split.back() = 7;
  CHECK(load_scenario_from_string(llama + "}\n").parallel.partition == llama_split);
  CHECK(load_scenario_from_string(llama + ", partition_method: megatron}\n").parallel.partition == llama_split);
  V uniform_126(16, 8);
  uniform_126[14] = uniform_126[15] = 7;
  CHECK(load_scenario_from_string(llama + ", partition_method: uniform}\n").parallel.partition == uniform_126);
}

TEST_CASE("uniform on a count pp does not divide - defaults - an explicit partition wins", "[partition]") {
  CHECK(load_scenario_from_string(pp_yaml(7, 3, ", partition_method: uniform")).parallel.partition == V{3, 2, 2});
  // Divisible, no method: uniform, nothing stored (as before partition_method existed).
  const Scenario even = load_scenario_from_string(pp_yaml(6, 3));
  CHECK(even.parallel.partition.empty());
  CHECK(even.parallel.partition_method.empty());
  CHECK(uniform_partition(even));
  // Not divisible, no method: DeepSpeed's default, parameters (tiny: E = 18432, T = 49984):
  // [E+2T | 3T | 2T+N+E] = 118400, 149952, 118528 costs 31552; [E+3T | 2T | 2T+N+E] costs 68416.
  const Scenario odd = load_scenario_from_string(pp_yaml(7, 3));
  CHECK(odd.parallel.partition == V{2, 3, 2});
  CHECK(odd.parallel.partition_method == "parameters");
  CHECK_FALSE(uniform_partition(odd));
  // An explicit list wins over the method.
  CHECK(load_scenario_from_string(pp_yaml(7, 3, ", partition: [1, 3, 3], partition_method: megatron")).parallel.partition ==
        V{1, 3, 3});
  // Megatron with pp 2 has no middle stage: 7 -> 3, 4.
  CHECK(megatron_partition(7, 2) == V{3, 4});
  // Middle stages shrink when ceil(L / pp) leaves the ends under a layer: 20 on 16 -> 1 x 14, 3, 3.
  V m20(16, 1);
  m20.front() = m20.back() = 3;
  CHECK(megatron_partition(20, 16) == m20);
  CHECK(megatron_partition(71, 12) == V{5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6});
}

TEST_CASE("a ds_config pipeline section makes DeepSpeed's parameters the default", "[partition]") {
  // 8 layers, vocabulary 2048 on 4 stages: divisible, but DeepSpeed's engine balances parameters.
  const std::string path = std::string(DSSIM_TEST_DATA_DIR) + "/ds_configs/corpus/dse_pipeline_parallel.json";
  LoadOptions o;
  o.deepspeed_config = path;
  const std::string yaml = "model: {preset: tiny, layers: 8, vocab: 2048}\nparallel: {pp: 4}\n"
                           "cluster: {preset: single-node-pcie, gpus_per_node: 4}\n";
  Scenario s;
  try {
    s = load_scenario_from_string(yaml, o, "t.yaml");
  } catch (const ConfigError& e) {
    FAIL(e.what());
  }
  CHECK(s.parallel.partition_method == "parameters");
  CHECK(s.parallel.partition == V{1, 3, 3, 1});
}

TEST_CASE("partition_method errors name the key and the fix", "[partition]") {
  CHECK_THAT(load_error(pp_yaml(7, 3, ", partition_method: balanced")),
             Contains("parallel.partition_method at line 3: unknown pipeline partition method 'balanced'") &&
                 Contains("uniform, parameters (DeepSpeed's default), type:REGEX (e.g. type:transformer), megatron"));
  CHECK_THAT(load_error(pp_yaml(7, 3, ", partition_method: 'type:attention'")),
             Contains("parallel.partition_method at line 3 'type:attention' matches no layer") && Contains("type:transformer"));
  CHECK_THAT(load_error(pp_yaml(7, 3, ", partition_method: 'type:(('")), Contains("is not a valid regular expression"));
  // A huge vocabulary (E = 4.2e6 = 84 layers) on 3 layers, 3 stages: DeepSpeed's balance is
  // [E | 3T + N | E] (cost E - 3T - N), the embedding and the head each alone on a stage.
  CHECK_THAT(load_error(pp_yaml(3, 3, ", partition_method: parameters", 65536)),
             Contains("leaves pipeline stage 0 without a transformer layer") && Contains("use uniform or megatron"));
  CHECK_THAT(load_error(pp_yaml(2, 4)), Contains("parallel.pp (4) is larger than model.layers (2)"));
  // DeepSpeed's methods with interleaving.
  CHECK_THAT(load_error(pp_yaml(8, 2, ", partition_method: parameters", 256, 2)),
             Contains("DeepSpeed's PipelineModule, whose pipeline engine does not interleave"));
}

TEST_CASE("interleaving with a count pp * interleave does not divide: Megatron's split in whole chunks", "[partition]") {
  // 12 layers, pp 4, interleave 2: 6 groups of 2 over 4 stages -> 1, 2, 2, 1 -> 2, 4, 4, 2 layers.
  const Scenario s = load_scenario_from_string(pp_yaml(12, 4, "", 256, 2));
  CHECK(s.parallel.partition == V{2, 4, 4, 2});
  CHECK(s.parallel.partition_method == "megatron");
  CHECK_NOTHROW(build_program(s));
  // Odd layers cannot split into 2 chunks per stage.
  CHECK_THAT(load_error(pp_yaml(7, 2, "", 256, 2)),
             Contains("parallel.partition_method") && Contains("must be divisible by the interleave"));
  // An explicit partition whose stages do not split into the chunks.
  CHECK_THAT(load_error(pp_yaml(6, 2, ", partition: [3, 3]", 256, 2)),
             Contains("parallel.partition at line 3: stage 0 has 3 layers, which do not split into parallel.interleave (2)"));
}

TEST_CASE("70 layers on pp 12: the Program, memory and estimator follow the partition", "[partition]") {
  const Scenario s = load_scenario_from_string(
      "model: {preset: gpt-350m, layers: 70, vocab: 51200}\n"
      "training: {global_batch: 24, micro_batch: 1}\n"
      "parallel: {pp: 12, partition_method: uniform}\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 3, gpus_per_node: 4, nics_per_node: 4}\n",
      {}, "t.yaml");
  REQUIRE(s.parallel.partition == V{6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5});
  for (int st = 0; st < 12; ++st) CHECK(stage_layers(s, st).count() == s.parallel.partition[st]);
  // Stage 9 (6 layers) and stage 10 (5 layers) hold the same in-flight micro-batches up to one
  // (min(pp - stage, m)): per layer, stage 10 holds fewer parameters and optimizer states.
  const MemoryBreakdown m9 = stage_memory(s, 9), m10 = stage_memory(s, 10);
  CHECK(m10.params == Approx(m9.params * 5 / 6).epsilon(1e-9));
  CHECK(m10.optimizer == Approx(m9.optimizer * 5 / 6).epsilon(1e-9));
  const Report r = analytic_report(s, false);
  CHECK(r.iteration_seconds > 0);
  const auto j = report_json(s, r);
  CHECK(j["config"]["layers_per_stage"] == s.parallel.partition);
  CHECK(j["config"]["uniform_partition"] == false);
  CHECK_THAT(report_text(s, r), Contains("layers per stage") && Contains("6 x 10, 5 x 2 (uniform)"));
}
