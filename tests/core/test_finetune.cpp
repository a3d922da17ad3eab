// Fine-tuning (issue 18, core/finetune.hpp): LoRA adapters and frozen parameters through the
// parameter counts, the op lists and FLOPs, the memory model and the Program, against closed forms
// and the counts PEFT prints for Llama 2 7B.
#include <catch2/catch.hpp>

#include "core/finetune.hpp"
#include "core/memory.hpp"
#include "core/model.hpp"
#include "core/program_builder.hpp"
#include "core/estimator.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "tests/core/scenario_test_util.hpp"

using namespace dssim;
using Catch::Detail::Approx;
using Catch::Matchers::Contains;

namespace {

Scenario llama7b(const std::string& finetune, const std::string& zero = "0", int gpus = 1) {
  return load_scenario_from_string("model: {preset: llama2-7b, seq_len: 2048}\n"
                                   "training: {global_batch: " + std::to_string(4 * gpus) + ", micro_batch: 4}\n"
                                   "zero: {stage: " + zero + "}\nprecision: bf16\n" + finetune +
                                   "cluster: {preset: dgx-h100-ndr, gpus_per_node: " + std::to_string(gpus) + "}\n");
}

double wire(const Program& p, Op op, Purpose pu) {
  double b = 0;
  for (const Instruction& in : p.ranks[0].instructions)
    if (in.op == op && in.purpose == pu) b += in.bytes * std::max(1, in.repeat);
  return b;
}

}  // namespace

TEST_CASE("LoRA on Llama 2 7B: PEFT's trainable and total parameter counts", "[finetune]") {
  // meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters; PEFT, LoraConfig(r=8, target_modules=
  // ["q_proj", "v_proj"]): "trainable params: 4,194,304 || all params: 6,742,609,920".
  const Scenario sc = llama7b("finetune: {method: lora, rank: 8, targets: [q_proj, v_proj]}\n");
  CHECK(parameter_count(sc.model) == 6'738'415'616.0);
  CHECK(adapter_parameter_count(sc.model, sc.finetune) == 4'194'304.0);  // 32 x 2 x 8 x (4096 + 4096)
  CHECK(trainable_parameter_count(sc.model, sc.finetune) == 4'194'304.0);
  CHECK(total_parameter_count(sc.model, sc.finetune) == 6'742'609'920.0);
  // all-linear at r 16: q, o 4096 -> 4096; k, v 4096 -> 4096 (no GQA); gate, up 4096 -> 11008;
  // down 11008 -> 4096: 16 (4 x 8192 + 3 x 15104) = 1,249,280 a layer.
  const Scenario all = llama7b("finetune: {method: lora, rank: 16, targets: [all-linear]}\n");
  CHECK(layer_adapter_params(all.model, all.finetune) == 1'249'280.0);
  CHECK(adapter_parameter_count(all.model, all.finetune) == 32 * 1'249'280.0);
}

TEST_CASE("LoRA targets: PEFT's defaults per architecture, aliases, all-linear", "[finetune]") {
  FinetuneSpec f;
  f.method = FinetuneSpec::Method::lora;
  const Scenario llama = llama7b("");
  CHECK(lora_targets(llama.model, f) == std::vector<LoraTarget>{LoraTarget::q, LoraTarget::v});
  const ModelSpec gpt = load_scenario_from_string("model: gpt-1.3b\ntraining: {micro_batch: 1}\ncluster: dgx-h100-ndr\n").model;
  CHECK(lora_targets(gpt, f) == std::vector<LoraTarget>{LoraTarget::qkv});  // GPT-2's c_attn
  std::vector<LoraTarget> t;
  CHECK(parse_lora_target("c_fc", t));
  CHECK(parse_lora_target("down_proj", t));
  CHECK(parse_lora_target("mlp_up", t));  // already there: not twice
  CHECK(t == std::vector<LoraTarget>{LoraTarget::mlp_up, LoraTarget::mlp_down});
  CHECK_FALSE(parse_lora_target("c_proj", t));  // GPT-2's c_proj is two different linears
  f.targets.clear();
  parse_lora_target("all-linear", f.targets);
  CHECK(lora_targets(gpt, f).size() == 6);  // no gate projection in a GELU MLP
  CHECK(lora_targets(llama.model, f).size() == 7);
}

TEST_CASE("fine-tuning keys: clear errors naming the key", "[finetune][validate]") {
  using test::config_error;
  CHECK_THAT(config_error([] { llama7b("finetune: {method: lora, targets: [c_proj]}\n"); }),
             Contains("finetune.targets") && Contains("unknown LoRA target 'c_proj'") && Contains("mlp_down"));
  CHECK_THAT(config_error([] { llama7b("finetune: {method: lora, targets: [qkv, q_proj]}\n"); }),
             Contains("qkv") && Contains("q, k, v"));
  CHECK_THAT(config_error([] { llama7b("finetune: {method: lora, freeze: [embeddings]}\n"); }),
             Contains("finetune.freeze") && Contains("method full"));
  CHECK_THAT(config_error([] { llama7b("finetune: {method: full, freeze: [embeddings, norms, attention, mlp, lm_head]}\n"); }),
             Contains("nothing would train"));
  CHECK_THAT(config_error([] { llama7b("finetune: {method: lora}\nparallel: {tp: 2}\n", "0", 2); }),
             Contains("parallel.tp") && Contains("finetune.method lora"));
  CHECK_THAT(config_error([] { load_scenario_from_string("model: gpt-1.3b\ntraining: {micro_batch: 1}\nfinetune: {method: lora, targets: [gate_proj]}\ncluster: dgx-h100-ndr\n"); }),
             Contains("mlp_gate"));
  CHECK_THAT(config_error([] { llama7b("finetune: {method: lora, dropout: 1.5}\n"); }), Contains("finetune.dropout"));
  // The scalar form names the method.
  CHECK(llama7b("finetune: lora\n").finetune.lora());
}

TEST_CASE("a frozen GEMM's backward is its input gradient only - adapters train", "[finetune][model]") {
  const Scenario full = llama7b("");
  const Scenario lora = llama7b("finetune: {method: lora, rank: 16, targets: [q_proj, v_proj]}\n");
  LayerShape shape;
  shape.micro_batch = 4;
  shape.dtype = Dtype::bf16;
  const auto base_ops = layer_forward_ops(full.model, shape);
  shape.finetune = &lora.finetune;
  const auto ops = layer_forward_ops(lora.model, shape);
  // Forward: the base GEMMs plus two adapters (A: T x r x h, B: T x h x r each).
  const double tokens = 4.0 * 2048, r = 16, h = 4096;
  const double adapter_fwd = 2 * (2 * tokens * r * h + 2 * tokens * h * r);
  CHECK(sum_cost(ops).gemm_flops == Approx(sum_cost(base_ops).gemm_flops + adapter_fwd));
  // Backward: the weights' GEMMs lose their wgrad (one forward's FLOPs), the attention core keeps
  // both, the adapters take 2x their forward.
  double weights = 0;
  for (const LayerOp& op : base_ops)
    if (op.gemm && !op.attention_core) weights += op.flops;
  CHECK(backward_cost(ops).gemm_flops == Approx(backward_cost(base_ops).gemm_flops - weights + 2 * adapter_fwd));
  for (const LayerOp& op : ops) {
    if (op.name == "qkv" || op.name == "mlp_down") CHECK(op.frozen);
    if (op.name.rfind("lora_", 0) == 0) CHECK_FALSE(op.frozen);
    CHECK(op.name != "bias_grads");
  }
  // Only the adapters' gradients are accumulated.
  for (const LayerOp& op : ops)
    if (op.name == "grad_accumulate") CHECK(op.flops == Approx(2 * r * (h + h)));
  // The iteration's FLOPs from the closed form match the op lists: per sequence, one layer's
  // weights' wgrad removed, 3x the adapters added (the head frozen too: one logits GEMM less).
  const double B = 4;
  const double delta = finetune_flops_delta(lora.model, lora.finetune, B, Recompute::none, false);
  const double head = head_forward_flops_per_sequence(lora.model);
  CHECK(delta == Approx(B / 4 * 32 * (3 * adapter_fwd - weights) - B * head));
}

TEST_CASE("LoRA memory: frozen weights keep their bf16 copy only", "[finetune][memory]") {
  // One GPU, ZeRO-0, bf16: full fine-tuning keeps 2 (params) + 2 (grads) + 12 (Adam) bytes per
  // parameter (the engine steps the bf16 gradients in place: no fp32 gradient buffer); LoRA the
  // 2-byte base plus 16 bytes per adapter parameter.
  const Scenario full = llama7b("");
  const Scenario lora = llama7b("finetune: {method: lora, rank: 8, targets: [q_proj, v_proj]}\n");
  const double P = 6'738'415'616.0, A = 4'194'304.0;
  const MemoryBreakdown f = stage_memory(full, 0), l = stage_memory(lora, 0);
  CHECK(f.params == Approx(2 * P));
  CHECK(f.grads == Approx(2 * P));
  CHECK(f.optimizer == Approx(12 * P));
  CHECK(l.params == Approx(2 * (P + A)));
  CHECK(l.grads == Approx(2 * A));
  CHECK(l.optimizer == Approx(12 * A));
  // The adapters' saved tensors: A's output, b s r bf16 per adapter and layer (no dropout copy).
  CHECK(l.activations - f.activations == Approx(32 * 2 * 4.0 * 2048 * 8 * 2));
  CHECK(l.total() < 0.36 * f.total());  // the activations of b 8 x s 2048 dominate LoRA's
  // ZeRO-3 still shards the frozen base over the DP group; the optimizer holds the adapters' shard.
  const Scenario z3 = llama7b("finetune: {method: lora, rank: 8, targets: [q_proj, v_proj]}\n", "3", 8);
  const MemoryBreakdown m3 = stage_memory(z3, 0);
  CHECK(m3.optimizer == Approx(12 * A / 8).epsilon(1e-3));
  CHECK(m3.params - m3.params_gathered == Approx(2 * (P + A) / 8).epsilon(1e-3));
}

TEST_CASE("the Program reduces only trainable gradients - ZeRO-3 still gathers the frozen base", "[finetune][program]") {
  const std::string lora = "finetune: {method: lora, rank: 8, targets: [q_proj, v_proj]}\n";
  const double P = 6'738'415'616.0, A = 4'194'304.0;
  BuildOptions bo;
  bo.representative_only = true;
  for (const char* stage : {"0", "2"}) {
    const Program p = build_program(llama7b(lora, stage, 8), bo);
    const Op op = std::string(stage) == "0" ? Op::AllReduce : Op::ReduceScatter;
    // The adapters' bf16 gradients (padded to the DP size), nothing of the 6.7B frozen weights.
    CHECK(wire(p, op, Purpose::GradientReduce) == Approx(2 * A).epsilon(1e-4));
    if (std::string(stage) == "2") CHECK(wire(p, Op::AllGather, Purpose::ParamGather) == Approx(2 * A).epsilon(1e-4));
  }
  const Program p3 = build_program(llama7b(lora, "3", 8), bo);
  // Forward and backward gather every parameter, frozen or not (one micro-batch); reduce the adapters.
  CHECK(wire(p3, Op::AllGather, Purpose::ParamGather) == Approx(2 * 2 * (P + A)).epsilon(1e-3));
  CHECK(wire(p3, Op::ReduceScatter, Purpose::GradientReduce) == Approx(2 * A).epsilon(1e-3));
  // The optimizer steps the adapters' shard.
  for (const Instruction& in : p3.ranks[0].instructions)
    if (in.op == Op::OptimizerStep) CHECK(in.flops == Approx(A / 8 * 16).epsilon(1e-3));
}

TEST_CASE("full fine-tuning with frozen parts: the frozen parts leave gradients, states and reductions", "[finetune]") {
  const Scenario sc = llama7b("finetune: {method: full, freeze: [embeddings, lm_head]}\n", "2", 8);
  const double vh = 32000.0 * 4096;
  CHECK(trainable_parameter_count(sc.model, sc.finetune) == Approx(6'738'415'616.0 - 2 * vh));
  BuildOptions bo;
  bo.representative_only = true;
  const Program p = build_program(sc, bo);
  CHECK(wire(p, Op::ReduceScatter, Purpose::GradientReduce) == Approx(2 * (6'738'415'616.0 - 2 * vh)).epsilon(1e-4));
  // The report says what trains.
  const Report r = analytic_report(sc, false);
  CHECK(r.trainable_parameters == Approx(6'738'415'616.0 - 2 * vh));
  CHECK_THAT(report_text(sc, r, false), Contains("fine-tuning") && Contains("frozen: embeddings, lm_head"));
}

TEST_CASE("the scenario file round-trips its finetune section", "[finetune]") {
  const Scenario sc = llama7b("finetune: {method: lora, rank: 4, alpha: 8, targets: [all-linear]}\n");
  const Scenario again = load_scenario_from_string(to_yaml(sc));
  CHECK(again.finetune.lora());
  CHECK(again.finetune.rank == 4);
  CHECK(lora_targets(again.model, again.finetune) == lora_targets(sc.model, sc.finetune));
}
