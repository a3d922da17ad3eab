// The memory options users reach for on OOM (issue 18): DeepSpeed's activation checkpointing
// partition_activations / cpu_checkpointing and ZeRO-Infinity's NVMe offload, in the memory model,
// the Program and the device model, against closed forms.
#include <catch2/catch.hpp>

#include "core/device_model.hpp"
#include "core/estimator.hpp"
#include "core/fit_advisor.hpp"
#include "core/memory.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "tests/core/scenario_test_util.hpp"

using namespace dssim;
using Catch::Detail::Approx;
using Catch::Matchers::Contains;

namespace {

// GPT 13B on one DGX A100, TP 4 x DP 2, micro-batch 2, 4 micro-batches per replica, full recompute.
Scenario gpt13b(const std::string& checkpointing, const std::string& extra = "") {
  return load_scenario_from_string("model: {preset: gpt-13b}\ntraining: {global_batch: 16, micro_batch: 2}\n"
                                   "parallel: {tp: 4, pp: 1}\nzero: {stage: 1}\nprecision: bf16\n"
                                   "activation_checkpointing: " + checkpointing + "\n" + extra +
                                   "cluster: {preset: dgx-a100-hdr, nodes: 1}\n");
}

std::vector<const Instruction*> of(const Program& p, Op op, Purpose pu) {
  std::vector<const Instruction*> v;
  for (const Instruction& in : p.ranks[0].instructions)
    if (in.op == op && in.purpose == pu) v.push_back(&in);
  return v;
}

}  // namespace

TEST_CASE("partition_activations splits the kept layer inputs over TP and gathers them before the recompute", "[memory][checkpointing]") {
  const Scenario plain = gpt13b("full");
  const Scenario part = gpt13b("{mode: full, partition_activations: true}");
  const double s = 2048, b = 2, h = 5120, layers = 40, t = 4;
  const double kept = 2 * s * b * h;  // full recompute keeps each layer's bf16 input [K]
  const double in_flight = 1;         // pp 1: one micro-batch's at a time
  CHECK(stage_memory(plain, 0).activations - stage_memory(part, 0).activations ==
        Approx(layers * in_flight * kept * (1 - 1 / t)));
  BuildOptions bo;
  bo.representative_only = true;
  const Program p = build_program(part, bo), q = build_program(plain, bo);
  // Per micro-batch, one all-gather of the full input per layer before its recompute, in the TP group.
  double gathered = 0;
  for (const Instruction* in : of(p, Op::AllGather, Purpose::TensorParallel)) gathered += in->bytes * in->repeat;
  CHECK(gathered == Approx(4 * layers * kept));
  CHECK(of(q, Op::AllGather, Purpose::TensorParallel).empty());
  // Not with selective recompute: DeepSpeed partitions what deepspeed.checkpointing keeps; warned.
  const Scenario sel = gpt13b("{mode: selective, partition_activations: true}");
  CHECK(test::has_warning_with(sel, "they change nothing"));
  CHECK(stage_memory(sel, 0).activations == Approx(stage_memory(gpt13b("selective"), 0).activations));
}

TEST_CASE("cpu_checkpointing moves the partitions to host memory over PCIe, blocking", "[memory][checkpointing]") {
  const Scenario part = gpt13b("{mode: full, partition_activations: true}");
  const Scenario cpu = gpt13b("{mode: full, partition_activations: true, cpu_checkpointing: true}");
  const double s = 2048, b = 2, h = 5120, layers = 40, t = 4;
  const double partition = 2 * s * b * h / t;
  const MemoryBreakdown a = stage_memory(part, 0), c = stage_memory(cpu, 0);
  CHECK(a.activations - c.activations == Approx(layers * partition));
  CHECK(c.host - a.host == Approx(layers * partition));
  BuildOptions bo;
  bo.representative_only = true;
  const Program p = build_program(cpu, bo);
  for (Op op : {Op::CopyD2H, Op::CopyH2D}) {
    double bytes = 0;
    for (const Instruction* in : of(p, op, Purpose::OffloadActivation)) {
      CHECK(in->stream == Stream::Compute);
      bytes += in->bytes * in->repeat;
    }
    CHECK(bytes == Approx(4 * layers * partition));  // 4 micro-batches, each layer out and back
  }
  // It costs time: the copies block the compute stream.
  CHECK(analytic_report(cpu, false).iteration_seconds > analytic_report(part, false).iteration_seconds);
  // Without partitioning DeepSpeed offloads nothing: warned, unchanged.
  const Scenario alone = gpt13b("{mode: full, cpu_checkpointing: true}");
  CHECK(test::has_warning_with(alone, "without partition_activations changes nothing"));
  CHECK(stage_memory(alone, 0).total() == Approx(stage_memory(gpt13b("full"), 0).total()));
}

TEST_CASE("ZeRO-Infinity: optimizer states and parameters on NVMe at the node's bandwidth", "[memory][nvme]") {
  const std::string z3 = "zero: {stage: 3, offload_optimizer: true, offload_param: true";
  const Scenario host = load_scenario_from_string(
      "model: gpt-7b\ntraining: {global_batch: 8, micro_batch: 1}\n" + z3 + "}\nprecision: bf16\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 1}\n");
  const Scenario nvme = load_scenario_from_string(
      "model: gpt-7b\ntraining: {global_batch: 8, micro_batch: 1}\n" + z3 +
      ", offload_optimizer_device: nvme, offload_param_device: nvme}\nprecision: bf16\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 1, nvme_bandwidth: 16 GB/s}\n");
  const MemoryBreakdown mh = stage_memory(host, 0), mn = stage_memory(nvme, 0);
  const double shard = stage_parameters(host, 0).total() / 8;
  CHECK(mn.nvme == Approx(12 * shard + 2 * shard).epsilon(1e-6));  // fp32 master + m + v, bf16 params
  CHECK(mh.host - mn.host == Approx(mn.nvme).epsilon(1e-6));
  CHECK(mh.total() == Approx(mn.total()));  // nothing changes on the GPU
  // The host step swaps the states in and out (24 bytes per element) and writes the params (2):
  // 26 shard bytes at 16 GB/s shared by the node's 8 GPUs.
  BuildOptions bo;
  bo.representative_only = true;
  const Program pn = build_program(nvme, bo), ph = build_program(host, bo);
  const DeviceModel dn(nvme), dh(host);
  for (const Instruction& in : pn.ranks[0].instructions)
    if (in.op == Op::HostOptimizerStep) {
      CHECK(in.bytes == Approx(26 * shard).epsilon(1e-3));
      CHECK(dn.host_seconds(in) - dh.host_seconds(in) == Approx(26 * shard / (16e9 / 8)).epsilon(1e-3));
    }
  // Every parameter fetch reads its shard from NVMe before the PCIe copy.
  int fetches = 0;
  for (const Instruction& in : pn.ranks[0].instructions)
    if (in.op == Op::CopyH2D && in.purpose == Purpose::OffloadParam && in.micro_batch >= -1 && in.memory_bytes > 0) {
      ++fetches;
      CHECK(in.memory_bytes == Approx(in.bytes));
      CHECK(dn.copy_seconds(in) == Approx(dh.copy_seconds(in) + in.bytes / (16e9 / 8)));
    }
  CHECK(fetches > 0);
  CHECK(analytic_report(nvme, false).iteration_seconds > analytic_report(host, false).iteration_seconds);
  // No bandwidth stated: modelled as host memory, warned.
  const Scenario unstated = load_scenario_from_string(
      "model: gpt-7b\ntraining: {global_batch: 8, micro_batch: 1}\n" + z3 +
      ", offload_optimizer_device: nvme}\nprecision: bf16\ncluster: {preset: dgx-a100-hdr, nodes: 1}\n");
  CHECK(test::has_warning_with(unstated, "without cluster.nvme_bandwidth"));
  CHECK(stage_memory(unstated, 0).nvme == 0);
  CHECK_THAT(test::config_error([&] {
               load_scenario_from_string("model: gpt-7b\ntraining: {global_batch: 8, micro_batch: 1}\n"
                                         "zero: {stage: 3, offload_optimizer_device: nvme}\n"
                                         "cluster: {preset: dgx-a100-hdr, nodes: 1}\n");
             }),
             Contains("zero.offload_optimizer_device") && Contains("zero.offload_optimizer: true"));
}

TEST_CASE("the fit advisor proposes the checkpointing options and LoRA where they apply", "[memory][advisor]") {
  // GPT 13B full fine-tune with TP 4 on 80 GB at micro-batch 16: every option that applies is listed.
  const Scenario sc = load_scenario_from_string(
      "model: {preset: gpt-13b}\ntraining: {global_batch: 32, micro_batch: 16}\nparallel: {tp: 4, pp: 1}\n"
      "zero: {stage: 1}\nprecision: bf16\nactivation_checkpointing: full\nfinetune: full\n"
      "cluster: {preset: dgx-a100-hdr, nodes: 1}\n");
  const auto has = [&](const std::string& change) {
    for (const FitCandidate& c : fit_candidates(sc))
      if (c.change == change) return true;
    return false;
  };
  CHECK(has("activation_checkpointing.partition_activations=true"));
  CHECK(has("activation_checkpointing.partition_activations=true activation_checkpointing.cpu_checkpointing=true"));
  CHECK_FALSE(has("finetune.method=lora finetune.rank=16"));  // LoRA with TP 4 is refused: not a suggestion
  const Scenario dp = load_scenario_from_string(
      "model: {preset: gpt-13b}\ntraining: {global_batch: 32, micro_batch: 4}\nzero: {stage: 1}\nprecision: bf16\n"
      "activation_checkpointing: full\nfinetune: full\ncluster: {preset: dgx-a100-hdr, nodes: 1}\n");
  bool lora = false;
  for (const FitCandidate& c : fit_candidates(dp)) lora = lora || c.change == "finetune.method=lora finetune.rank=16";
  CHECK(lora);
  CHECK_FALSE(has("zero.offload_optimizer=true zero.offload_param=true zero.offload_optimizer_device=nvme zero.offload_param_device=nvme"));  // no NVMe stated
  // Each candidate's change, applied with --set, gives its scenario.
  for (const FitCandidate& c : fit_candidates(sc)) {
    if (c.change.rfind("activation_checkpointing.", 0) != 0 && c.change.rfind("finetune.", 0) != 0) continue;
    LoadOptions lo;
    std::string rest = c.change;
    for (size_t at; !rest.empty(); rest = at == std::string::npos ? "" : rest.substr(at + 1)) {
      at = rest.find(' ');
      lo.overrides.push_back(rest.substr(0, at));
    }
    const Scenario again = load_scenario_from_string(
        "model: {preset: gpt-13b}\ntraining: {global_batch: 32, micro_batch: 16}\nparallel: {tp: 4, pp: 1}\n"
        "zero: {stage: 1}\nprecision: bf16\nactivation_checkpointing: full\nfinetune: full\n"
        "cluster: {preset: dgx-a100-hdr, nodes: 1}\n", lo);
    CHECK(stage_memory(again, 0).total() == Approx(stage_memory(c.scenario, 0).total()));
  }
}

TEST_CASE("op-level selective checkpointing (torchtitan's policy): kept tensors, recomputed matmuls", "[memory][recompute]") {
  // Llama 3 8B, micro-batch 2 x 8192 tokens, bf16, FSDP on 8 H100 (validation/published/torchtitan_fsdp.yaml).
  const auto load = [](const std::string& mode) {
    return load_scenario_from_string("model: {preset: llama3-8b, seq_len: 8192}\ntraining: {global_batch: 16, micro_batch: 2}\n"
                                     "zero: {stage: 3, engine: fsdp}\nprecision: bf16\nactivation_checkpointing: " + mode +
                                     "\ncluster: {preset: dgx-h100-ndr, nodes: 1}\n");
  };
  const Scenario sc = load("selective_op");
  REQUIRE(sc.recompute == Recompute::selective_op);
  CHECK(std::string(to_string(sc.recompute)) == "selective_op");
  const ModelSpec& m = sc.model;
  const double tokens = 2.0 * 8192, h = 4096, kv = 1024, f = 14336, a = 32;
  // Kept per layer: the block input, q, v, SDPA's output (bf16) and its fp32 log-sum-exp, the gate
  // (w1) and down (w2) outputs: (8h + 2kv + 2f + 4a) bytes per token = 63,616.
  CHECK(8 * h + 2 * kv + 2 * f + 4 * a == 63616);
  CHECK(activation_bytes_per_layer(m, 2, 1, false, Recompute::selective_op, false, Dtype::bf16) ==
        Approx(63616.0 * tokens));
  CHECK(activation_bytes_per_layer(m, 2, 1, false, Recompute::selective_op, false, Dtype::bf16) <
        activation_bytes_per_layer(m, 2, 1, false, Recompute::selective, false, Dtype::bf16));
  // Recomputed: k, the attention output projection and SwiGLU's up (w3), 2 FLOPs per MAC.
  const double per_layer = tokens * 2 * (h * kv + h * h + h * f);
  CHECK(hardware_flops_per_iteration(m, 16, Recompute::selective_op) - hardware_flops_per_iteration(m, 16, Recompute::none) ==
        Approx(8.0 * 32 * per_layer));
  LayerShape shape;
  shape.micro_batch = 2;
  const auto ops = layer_forward_ops(m, shape);
  CHECK(recompute_cost(ops, Recompute::selective_op).gemm_flops == Approx(per_layer));
  // The estimator prices the recompute in the Program: more than selective, less than full.
  const auto recompute_seconds = [&](const std::string& mode) {
    const Scenario s = load(mode);
    const Program p = build_program(s, BuildOptions{});
    const DeviceModel dev(s);
    double t = 0;
    for (const Instruction& in : p.ranks[0].instructions)
      if (in.op == Op::Recompute) t += dev.compute_seconds(p, in);
    return t;
  };
  const double op = recompute_seconds("selective_op"), full = recompute_seconds("full");
  CHECK(op > recompute_seconds("selective"));
  CHECK(op < 0.6 * full);
  CHECK_THAT(test::config_error([&] { load("selective_ops"); }), Contains("selective_op"));
}
