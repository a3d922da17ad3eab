// model.gemm_epilogues and model.cross_entropy_kernel: the torch engine's fused block and loss
// kernel in the model (core/model.cpp apply_gemm_epilogues, core/device_model.cpp, the device
// profile's epilogue rows). test_measured_kernels.cpp: `dssim compare` pricing what a run took.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include "core/device_model.hpp"
#include "core/device_profile.hpp"
#include "core/model.hpp"
#include "gpt_spec.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using Catch::Matchers::Contains;
using dssim::test::config_error;

namespace {

const LayerOp* find(const std::vector<LayerOp>& ops, const std::string& name) {
  for (const LayerOp& op : ops)
    if (op.name == name) return &op;
  return nullptr;
}

ModelSpec fused_gpt() {
  ModelSpec m = dssim::test::gpt_spec(24, 2048, 16);
  m.dropout = 0;  // the engine's
  m.gemm_epilogues = true;
  return m;
}

LayerShape shape(int tp = 1) {
  LayerShape s;
  s.micro_batch = 2;
  s.tp = tp;
  s.dtype = Dtype::bf16;
  return s;
}


GemmPoint row(const std::string& op, GemmPass pass, const std::string& epilogue, double m, double n, double k, double rate) {
  GemmPoint g;
  g.op = op;
  g.dtype = Dtype::bf16;
  g.pass = pass;
  g.epilogue = epilogue;
  g.m = m, g.n = n, g.k = k;
  g.flops_per_second = rate;
  return g;
}

DeviceProfile profile_of(std::vector<GemmPoint> rows) {
  DeviceProfile p = dssim::test::empty_profile();
  p.gemm = std::move(rows);
  return p;
}

ClusterSpec cluster_with(const std::string& name, const DeviceProfile& p) {
  ClusterSpec c = load_scenario_from_string(dssim::test::tiny_yaml()).cluster;
  const auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << to_yaml(p);
  c.device_profile = path.string();
  return c;
}

// The separate kernels as the unfused layer has them, written out (bytes per element of [m x n]).
LayerOp gelu_kernel(double elements, double e) {
  LayerOp op;
  op.name = "gelu";
  op.flops = 8 * elements;
  op.memory_bytes = 2 * e * elements;
  op.backward_bytes = 3 * e * elements;
  op.backward_kernel = "gelu_backward";
  return op;
}
LayerOp bias_grad_kernel(double elements, double e) {
  LayerOp op;
  op.name = "bias_grads";
  op.kernel = "bias_grad";
  op.flops = elements;
  op.memory_bytes = e * elements;
  op.backward_only = true;
  return op;
}

}  // namespace

TEST_CASE("model.gemm_epilogues and model.cross_entropy_kernel: keys, defaults, to_yaml, errors", "[epilogues]") {
  const Scenario off = load_scenario_from_string(dssim::test::tiny_yaml());
  CHECK_FALSE(off.model.gemm_epilogues);
  CHECK_FALSE(off.model.cross_entropy_kernel);
  CHECK(to_yaml(off).find("gemm_epilogues") == std::string::npos);  // written only when on
  CHECK(to_yaml(off).find("cross_entropy_kernel") == std::string::npos);
  const Scenario on = load_scenario_from_string(
      dssim::test::tiny_yaml_with_model("  gemm_epilogues: true\n  cross_entropy: fused_linear\n  cross_entropy_kernel: true\n"));
  CHECK(on.model.gemm_epilogues);
  CHECK(on.model.cross_entropy_kernel);
  CHECK(on.model.block_epilogues());
  const Scenario again = load_scenario_from_string(to_yaml(on));
  CHECK(again.model.gemm_epilogues);
  CHECK(again.model.cross_entropy_kernel);
  CHECK_THAT(config_error([] { load_scenario_from_string(dssim::test::tiny_yaml_with_model("  cross_entropy_kernel: true\n"), {}, "k.yaml"); }),
             Contains("model.cross_entropy_kernel") && Contains("fused_linear"));
  CHECK_THAT(config_error([] { load_scenario_from_string(dssim::test::tiny_yaml_with_model("  gemm_epilogues: maybe\n")); }),
             Contains("model.gemm_epilogues"));
  // SwiGLU or no biases: the key is accepted and changes nothing.
  const Scenario llama = load_scenario_from_string(dssim::test::tiny_yaml_with_model("  gemm_epilogues: true\n  mlp: swiglu\n"));
  CHECK_FALSE(llama.model.block_epilogues());
}

TEST_CASE("gemm_epilogues op list: no gelu or bias_grads op, epilogues on the GEMMs, the residuals in the norms", "[epilogues]") {
  ModelSpec m = fused_gpt();
  const double e = 2, T = 2 * 2048.0, h = 2048, f = 4 * h;
  const auto ops = layer_forward_ops(m, shape());
  m.gemm_epilogues = false;
  const auto plain = layer_forward_ops(m, shape());
  CHECK(find(plain, "gelu"));
  CHECK(find(plain, "bias_grads"));
  CHECK_FALSE(find(ops, "gelu"));
  CHECK_FALSE(find(ops, "bias_grads"));
  const LayerOp *qkv = find(ops, "qkv"), *proj = find(ops, "attention_proj"), *up = find(ops, "mlp_up"),
                *down = find(ops, "mlp_down");
  REQUIRE((qkv && proj && up && down));
  CHECK((qkv->epilogue == "" && qkv->dgrad_epilogue == "" && qkv->wgrad_epilogue == "bgradb"));
  CHECK((proj->epilogue == "bias_residual" && proj->dgrad_epilogue == "" && proj->wgrad_epilogue == "bgradb"));
  CHECK((up->epilogue == "gelu_aux_bias" && up->dgrad_epilogue == "" && up->wgrad_epilogue == "bgradb"));
  CHECK((down->epilogue == "bias_residual" && down->dgrad_epilogue == "dgelu" && down->wgrad_epilogue == "bgradb"));
  // The epilogues' own bytes: GELU's input written, the residual read, GELU's input read by dgelu.
  CHECK(up->memory_bytes == find(plain, "mlp_up")->memory_bytes + e * T * f);
  CHECK(up->epilogue_bytes == e * T * f);
  CHECK(proj->memory_bytes == find(plain, "attention_proj")->memory_bytes + e * T * h);
  CHECK(down->dgrad_epilogue_bytes == e * T * f);  // GELU's input [T x f], the dgrad's output
  CHECK(plain_gemm(*up).memory_bytes == find(plain, "mlp_up")->memory_bytes);
  CHECK_FALSE(plain_gemm(*down).has_epilogue());
  // The residual adds run in the GEMMs and their backward (the gradient sum at the fork) in the
  // norms' backward (layer_norm_residual): no residual op is left, each norm's backward reads the
  // residual's gradient too (6 e where ATen's moved 5 e) at its own row.
  for (const char* r : {"residual_1", "residual_2"}) {
    CHECK_FALSE(find(ops, r));
    CHECK(find(plain, r)->backward_memory_bytes() == 3 * e * T * h);
  }
  for (const char* n : {"layernorm_1", "layernorm_2"}) {
    const LayerOp *op = find(ops, n), *was = find(plain, n);
    REQUIRE((op && was));
    CHECK(op->backward_memory_bytes() == 6 * e * T * h);
    CHECK(was->backward_memory_bytes() == 5 * e * T * h);
    CHECK(op->backward_kernel == "layer_norm_residual_backward");
    CHECK(op->memory_bytes == was->memory_bytes);  // the forward is ATen's
  }
  // Dense q, k, v: the layout copies are the attention output's gradient only (h wide, was h + 2 * 3h).
  CHECK(find(ops, "attention_layout_copies")->memory_bytes == 2 * e * T * h);
  CHECK(find(plain, "attention_layout_copies")->memory_bytes == 2 * e * T * (h + 2 * 3 * h));
  // Backward bytes: 2x the plain GEMMs, plus dgelu's read.
  OpsCost fused_bwd = backward_cost(ops), plain_bwd = backward_cost(plain);
  CHECK(fused_bwd.kernels == plain_bwd.kernels - 5);  // no gelu backward, no bias_grads, no fork sums or grad_accumulate
  CHECK(sum_cost(ops).kernels == sum_cost(plain).kernels - 3);  // no gelu, no residual adds
  // The four linears' weight and bias gradients are added into the gradient buffer by their wgrad
  // GEMMs and the bias kernel (the engine's grad_in_place), the norms' gains and biases by the norm
  // kernels: nothing is left for AccumulateGrad.
  CHECK(find(plain, "grad_accumulate")->memory_bytes == 3 * e * dense_layer_params(m));
  CHECK_FALSE(find(ops, "grad_accumulate"));
}

TEST_CASE("gemm_epilogues under tensor parallelism, with dropout, SwiGLU, MoE and LoRA", "[epilogues]") {
  const double e = 2, T = 2 * 2048.0, h = 2048;
  ModelSpec m = fused_gpt();
  const auto tp = layer_forward_ops(m, shape(2));
  CHECK_FALSE(find(tp, "gelu"));
  CHECK(find(tp, "mlp_up")->epilogue == "gelu_aux_bias");
  CHECK(find(tp, "mlp_up")->wgrad_epilogue == "bgradb");
  CHECK(find(tp, "qkv")->wgrad_epilogue == "bgradb");
  CHECK((find(tp, "mlp_down")->epilogue == "" && find(tp, "mlp_down")->dgrad_epilogue == "dgelu" &&
         find(tp, "mlp_down")->wgrad_epilogue == ""));
  CHECK(!find(tp, "attention_proj")->has_epilogue());
  CHECK_FALSE(find(tp, "residual_1")->backward_only);  // the residual after the reduction: ATen's add
  CHECK(find(tp, "layernorm_1")->backward_kernel == "layer_norm_backward");  // and ATen's norm
  REQUIRE(find(tp, "bias_grads"));
  CHECK(find(tp, "bias_grads")->memory_bytes == Approx(e * T * 2 * h));  // the row-parallel layers' biases
  // In place under TP: qkv and mlp_up with their biases, mlp_down's weight (its bias follows the
  // reduction); the projection is ATen's linear, so AccumulateGrad adds it.
  const double t = 2;
  CHECK(find(tp, "grad_accumulate")->flops ==
        Approx(dense_layer_params(m) / t - (3 * h * h / t + 3 * h / t) - (4 * h * h / t + 4 * h / t) - 4 * h * h / t));

  ModelSpec drop = fused_gpt();
  drop.dropout = 0.1;
  const auto d = layer_forward_ops(drop, shape());
  CHECK(find(d, "attention_proj")->epilogue == "");
  CHECK_FALSE(find(d, "dropout_residual_1")->backward_only);
  CHECK(find(d, "mlp_up")->epilogue == "gelu_aux_bias");
  CHECK(find(d, "layernorm_2")->backward_kernel == "layer_norm_backward");

  ModelSpec swiglu = fused_gpt();
  swiglu.swiglu = true;
  swiglu.bias = false;
  const auto sw = layer_forward_ops(swiglu, shape());
  swiglu.gemm_epilogues = false;
  const auto sw_plain = layer_forward_ops(swiglu, shape());
  REQUIRE(sw.size() == sw_plain.size());
  for (size_t i = 0; i < sw.size(); ++i) {
    CHECK(sw[i].memory_bytes == sw_plain[i].memory_bytes);
    CHECK_FALSE(sw[i].has_epilogue());
  }

  ModelSpec moe = fused_gpt();
  moe.experts = 8;
  LayerShape ms = shape();
  ms.moe = true;
  const auto mo = layer_forward_ops(moe, ms);
  CHECK(find(mo, "gelu"));  // the experts run ATen's ops
  CHECK(find(mo, "mlp_up")->epilogue == "");
  CHECK(find(mo, "attention_proj")->epilogue == "bias_residual");
  CHECK_FALSE(find(mo, "residual_2")->backward_only);
  // MoE's residual add runs in the forward; its fork's sum is in the norm's backward.
  CHECK(find(mo, "residual_2")->backward_memory_bytes() == 0);
  CHECK(find(mo, "layernorm_2")->backward_kernel == "layer_norm_residual_backward");
}

TEST_CASE("an epilogue the profile has no rows for: the plain GEMM plus the kernel it replaces", "[epilogues]") {
  const double e = 2, T = 2 * 2048.0, h = 2048, f = 4 * h;
  const auto ops = layer_forward_ops(fused_gpt(), shape());
  const LayerOp &up = *find(ops, "mlp_up"), &down = *find(ops, "mlp_down"), &proj = *find(ops, "attention_proj");
  LayerOp residual;  // the residual add: read two, write one
  residual.name = "residual";
  residual.flops = T * h;
  residual.memory_bytes = 3 * e * T * h;
  // The preset curves, and a profile without epilogue rows: the same rule.
  const DeviceModel preset(load_scenario_from_string(dssim::test::tiny_yaml()).cluster, Dtype::bf16);
  const DeviceModel old(cluster_with("dssim_test_epilogue_old.yaml",
                                     profile_of({row("mlp_up", GemmPass::forward, "", 1024, 1024, 1024, 1e14),
                                                 row("mlp_up", GemmPass::forward, "", 65536, 65536, 65536, 5e14)})),
                        Dtype::bf16);
  for (const DeviceModel* dm : {&preset, &old}) {
    CHECK(dm->kernel_seconds(up) == Approx(dm->kernel_seconds(plain_gemm(up)) + dm->kernel_seconds(gelu_kernel(T * f, e))));
    CHECK(dm->kernel_seconds(proj) == Approx(dm->kernel_seconds(plain_gemm(proj)) + dm->kernel_seconds(residual)));
    // dgrad + dgelu, wgrad + bgradb: 2x the plain forward GEMM, gelu's backward, a bias sum of T x h.
    CHECK(dm->backward_gemm_seconds(down) ==
          Approx(2 * dm->kernel_seconds(plain_gemm(down)) + dm->memory_bound_backward_seconds(gelu_kernel(T * f, e)) +
                 dm->memory_bound_backward_seconds(bias_grad_kernel(T * h, e))));
    CHECK(dm->backward_gemm_seconds(down) > dm->backward_gemm_seconds(plain_gemm(down)));
  }
  // The layer forward with the fused block prices as the unfused one (the separate kernels, priced
  // as before); the layout copies are the difference in backward.
  Program with, without;
  ModelSpec m = fused_gpt();
  with.op_lists = {layer_forward_ops(m, shape())};
  m.gemm_epilogues = false;
  without.op_lists = {layer_forward_ops(m, shape())};
  Instruction fwd{};
  fwd.op = Op::Forward;
  fwd.ops = 0;
  CHECK(preset.compute_seconds(with, fwd) == Approx(preset.compute_seconds(without, fwd)).epsilon(1e-12));
  CHECK(old.compute_seconds(with, fwd) == Approx(old.compute_seconds(without, fwd)).epsilon(1e-12));
  std::filesystem::remove(std::filesystem::temp_directory_path() / "dssim_test_epilogue_old.yaml");
}

TEST_CASE("epilogue rows: parse, round-trip, isolated lookups, merge, summary, the GEMM priced at their rate", "[epilogues]") {
  const char* yaml = R"(version: 1
metadata: {gpu: Test GPU, backend: cuda, date: 2026-01-01T00:00:00Z, tool: tests, torch_version: 2.11.0}
gemm:
  - {op: mlp_up, dtype: bf16, m: 4096, n: 8192, k: 2048, flops_per_second: 6.0e14}
  - {op: mlp_up, dtype: bf16, epilogue: gelu_aux_bias, m: 4096, n: 8192, k: 2048, flops_per_second: 5.0e14, seconds: 0.00027}
  - {op: mlp_down, dtype: bf16, pass: dgrad, epilogue: dgelu, m: 4096, n: 2048, k: 8192, flops_per_second: 4.0e14}
  - {op: mlp_down, dtype: bf16, pass: dgrad, m: 4096, n: 2048, k: 8192, flops_per_second: 5.5e14}
  - {op: mlp_down, dtype: bf16, pass: wgrad, m: 4096, n: 2048, k: 8192, flops_per_second: 5.2e14}
  - {op: mlp_down, dtype: bf16, pass: wgrad, epilogue: bgradb, m: 4096, n: 2048, k: 8192, flops_per_second: 4.5e14}
  - {op: mlp_down, dtype: bf16, m: 4096, n: 2048, k: 8192, flops_per_second: 5.8e14}
  - {op: mlp_down, dtype: bf16, epilogue: bias_residual, m: 4096, n: 2048, k: 8192, flops_per_second: 5.6e14}
)";
  const DeviceProfile p = parse_device_profile(yaml, "e.yaml");
  REQUIRE(p.gemm.size() == 8);
  CHECK(p.gemm[0].epilogue.empty());
  CHECK(p.gemm[1].epilogue == "gelu_aux_bias");
  CHECK(p.gemm[2].epilogue == "dgelu");
  CHECK(p.gemm[2].pass == GemmPass::dgrad);
  const std::string out = to_yaml(p);
  CHECK(out.find("epilogue: bgradb") != std::string::npos);
  const DeviceProfile q = parse_device_profile(out, "round.yaml");
  for (size_t i = 0; i < p.gemm.size(); ++i) CHECK(q.gemm[i].epilogue == p.gemm[i].epilogue);
  // Lookups: plain ones never see epilogue rows, epilogue ones only their own.
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048) == 6.0e14);
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048, 1, GemmPass::forward, "gelu_aux_bias") == 5.0e14);
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048, 1, GemmPass::forward, "bias_residual"));  // below n
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 4096, 2048, 8192, 1, GemmPass::dgrad) == 5.5e14);
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 4096, 2048, 8192, 1, GemmPass::dgrad, "dgelu") == 4.0e14);
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::bf16, 4096, 2048, 8192, 1, GemmPass::wgrad, "dgelu"));
  const DeviceProfile only_fused = parse_device_profile(
      R"(version: 1
metadata: {gpu: Test GPU, backend: cuda, date: 2026-01-01T00:00:00Z, tool: tests}
gemm:
  - {op: mlp_up, dtype: bf16, epilogue: gelu_aux_bias, m: 4096, n: 8192, k: 2048, flops_per_second: 5.0e14}
)",
      "f.yaml");
  CHECK_FALSE(only_fused.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048));
  // The summary lists the epilogue rows apart.
  const std::string summary = device_profile_summary(p);
  CHECK(summary.find("gemm gelu_aux_bias bf16") != std::string::npos);
  CHECK(summary.find("gemm dgrad dgelu bf16") != std::string::npos);
  CHECK(summary.find("gemm wgrad bgradb bf16") != std::string::npos);
  // Merging keys GEMM rows by dtype, pass and epilogue: fresh epilogue rows leave the plain ones.
  DeviceProfile fresh = only_fused;
  fresh.gemm[0].flops_per_second = 5.3e14;
  const DeviceProfile merged = merge_device_profile(p, fresh);
  CHECK(merged.gemm.size() == 8);
  CHECK(*merged.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048, 1, GemmPass::forward, "gelu_aux_bias") == 5.3e14);
  CHECK(*merged.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 2048) == 6.0e14);

  // Errors name the key and its line; the epilogue must be one of its pass's.
  std::string bad = yaml;
  bad.replace(bad.find("epilogue: gelu_aux_bias"), 23, "epilogue: dgelu");
  CHECK_THAT(config_error([&] { parse_device_profile(bad, "b.yaml"); }),
             Contains("b.yaml: gemm[1].epilogue (line 5)") && Contains("a forward GEMM's epilogue is one of gelu_aux_bias, bias_residual, got 'dgelu'"));
  bad = yaml;
  bad.replace(bad.find("epilogue: bgradb"), 16, "epilogue: gelu");
  CHECK_THAT(config_error([&] { parse_device_profile(bad, "b.yaml"); }),
             Contains("gemm[5].epilogue") && Contains("a wgrad GEMM's epilogue is one of bgradb, got 'gelu'"));

  // The device model: a GEMM with an epilogue at its row's rate, the plain passes at theirs.
  const DeviceModel dm(cluster_with("dssim_test_epilogue_rows.yaml", p), Dtype::bf16);
  LayerOp up = dssim::test::gemm_op(4096, 8192, 2048);
  CHECK(dm.kernel_seconds(up) == up.flops / 6.0e14);
  up.epilogue = "gelu_aux_bias";
  up.epilogue_bytes = 2 * 4096.0 * 8192;
  up.memory_bytes += up.epilogue_bytes;
  CHECK(dm.kernel_seconds(up) == up.flops / 5.0e14);
  LayerOp down = dssim::test::gemm_op(4096, 2048, 8192);
  down.name = "mlp_down";
  CHECK(dm.backward_gemm_seconds(down) == down.flops / 5.5e14 + down.flops / 5.2e14);
  down.epilogue = "bias_residual";
  down.dgrad_epilogue = "dgelu";
  down.wgrad_epilogue = "bgradb";
  CHECK(dm.kernel_seconds(down) == down.flops / 5.6e14);
  CHECK(dm.backward_gemm_seconds(down) == down.flops / 4.0e14 + down.flops / 4.5e14);
  // A pass whose epilogue has no rows: its plain row plus the replaced kernel's backward.
  LayerOp fresh_dgelu = down;
  fresh_dgelu.wgrad_epilogue.clear();
  const DeviceModel no_dgelu(cluster_with("dssim_test_epilogue_rows2.yaml", merged), Dtype::bf16);
  CHECK(no_dgelu.backward_gemm_seconds(fresh_dgelu) == down.flops / 4.0e14 + down.flops / 5.2e14);
  LayerOp frozen = down;
  frozen.frozen = true;
  CHECK(dm.backward_gemm_seconds(frozen) == down.flops / 4.0e14);  // no weight gradient
  for (const char* f : {"dssim_test_epilogue_rows.yaml", "dssim_test_epilogue_rows2.yaml"})
    std::filesystem::remove(std::filesystem::temp_directory_path() / f);
}
