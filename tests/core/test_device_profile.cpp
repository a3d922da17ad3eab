// Measured device profiles: loading and its errors, log-space interpolation, and the device model
// using a profile (and staying exactly as it was without one).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include "core/device_model.hpp"
#include "core/device_profile.hpp"
#include "core/estimator.hpp"
#include "core/model.hpp"
#include "core/report.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using dssim::test::config_error;

namespace {

const char* kProfile = R"(version: 1
metadata:
  gpu: Test GPU
  backend: cuda
  date: 2026-01-01T00:00:00Z
  tool: hand-written for tests
  torch_version: 2.11.0
gemm:
  - {op: mlp_up, dtype: bf16, m: 1024, n: 4096, k: 4096, flops_per_second: 2.0e14}
  - {op: mlp_up, dtype: bf16, m: 2048, n: 4096, k: 4096, flops_per_second: 4.0e14}
  - {op: mlp_up, dtype: bf16, m: 4096, n: 4096, k: 4096, flops_per_second: 6.0e14}
  - {op: mlp_up, dtype: bf16, m: 8192, n: 4096, k: 4096, flops_per_second: 7.0e14}
  - {op: qkv, dtype: bf16, m: 1024, n: 8192, k: 4096, flops_per_second: 3.0e14}
  - {op: qkv, dtype: bf16, m: 8192, n: 8192, k: 4096, flops_per_second: 7.5e14}
attention:
  - {kernel: flash, dtype: bf16, batch_heads: 32, seq_len: 1024, head_dim: 128, causal: true, flops_per_second: 3.0e14}
  - {kernel: flash, dtype: bf16, batch_heads: 32, seq_len: 4096, head_dim: 128, causal: true, flops_per_second: 5.0e14}
elementwise:
  - {op: add, dtype: bf16, bytes: 1.0e6, bytes_per_second: 1.0e12}
  - {op: add, dtype: bf16, bytes: 1.0e9, bytes_per_second: 4.0e12}
  - {op: layer_norm, dtype: bf16, bytes: 1.0e6, bytes_per_second: 0.5e12}
  - {op: layer_norm, dtype: bf16, bytes: 1.0e9, bytes_per_second: 3.0e12}
copy:
  - {direction: h2d, bytes: 1.0e6, bytes_per_second: 2.0e10}
  - {direction: h2d, bytes: 1.0e9, bytes_per_second: 5.0e10}
  - {direction: d2h, bytes: 1.0e9, bytes_per_second: 4.0e10}
collectives:
  - {collective: all_reduce, ranks: 8, bytes: 1.0e9, bus_bandwidth: 3.6e11}
)";

std::string with_line(const std::string& find, const std::string& replace) {
  std::string s = kProfile;
  const auto at = s.find(find);
  REQUIRE(at != std::string::npos);
  s.replace(at, find.size(), replace);
  return s;
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

LayerOp gemm(double m, double n, double k) { return dssim::test::gemm_op(m, n, k); }

}  // namespace

TEST_CASE("a device profile loads: metadata, tables, nccl-tests bus bandwidth factors", "[profile]") {
  const DeviceProfile p = parse_device_profile(kProfile, "h.yaml");
  CHECK(p.metadata.gpu == "Test GPU");
  CHECK(p.metadata.tool == "hand-written for tests");
  CHECK(p.gemm.size() == 6);
  CHECK(p.attention.size() == 2);
  CHECK(p.elementwise.size() == 4);
  CHECK(p.copy.size() == 3);
  REQUIRE(p.collectives.size() == 1);
  CHECK(p.collectives[0].algorithm_bandwidth == Approx(3.6e11 / (2.0 * 7 / 8)));
  CHECK(bus_bandwidth_factor("all_reduce", 8) == Approx(1.75));
  CHECK(bus_bandwidth_factor("all_gather", 4) == Approx(0.75));
  CHECK(bus_bandwidth_factor("send_recv", 2) == 1.0);
  // to_yaml round-trips
  const DeviceProfile q = parse_device_profile(to_yaml(p), "round.yaml");
  REQUIRE(q.gemm.size() == p.gemm.size());
  CHECK(q.gemm[2].flops_per_second == p.gemm[2].flops_per_second);
  CHECK(q.attention[1].seq_len == 4096);
  CHECK(q.collectives[0].bus_bandwidth == 3.6e11);
}

TEST_CASE("device profile errors name the file, the key and the line", "[profile]") {
  using Catch::Matchers::Contains;
  CHECK_THAT(config_error([] { parse_device_profile(with_line("flops_per_second: 4.0e14", "flops_per_second: fast"), "h.yaml"); }),
             Contains("h.yaml: gemm[1].flops_per_second (line 10)") && Contains("expected a positive number, got 'fast'"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("flops_per_second: 4.0e14", "flops_per_second: -1"), "h.yaml"); }),
             Contains("gemm[1].flops_per_second") && Contains("must be a positive number"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("dtype: bf16, m: 2048", "dtype: int8, m: 2048"), "h.yaml"); }),
             Contains("gemm[1].dtype") && Contains("expected one of fp32, fp16, bf16, got 'int8'"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("op: mlp_up, dtype: bf16, m: 1024, n: 4096, ", "op: mlp_up, dtype: bf16, m: 1024, "), "h.yaml"); }),
             Contains("gemm[0].n") && Contains("missing"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("kernel: flash, dtype: bf16, batch_heads: 32, seq_len: 1024", "kernel: fast, dtype: bf16, batch_heads: 32, seq_len: 1024"), "h.yaml"); }),
             Contains("attention[0].kernel") && Contains("flash, plain"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("direction: h2d, bytes: 1.0e6", "direction: up, bytes: 1.0e6"), "h.yaml"); }),
             Contains("copy[0].direction"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("ranks: 8", "ranks: 1"), "h.yaml"); }),
             Contains("collectives[0].ranks") && Contains(">= 2"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("gemm:", "gemms:"), "h.yaml"); }),
             Contains("gemms") && Contains("unknown key"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("  gpu: Test GPU\n", ""), "h.yaml"); }),
             Contains("metadata.gpu") && Contains("missing"));
  CHECK_THAT(config_error([] { parse_device_profile("metadata: {gpu: x, date: d, tool: t}\n", "empty.yaml"); }),
             Contains("empty.yaml") && Contains("no measurements"));
  CHECK_THAT(config_error([] { parse_device_profile("gemm: [\n", "bad.yaml"); }), Contains("bad.yaml") && Contains("not valid YAML"));
  CHECK_THAT(config_error([] { load_device_profile("/nonexistent/dir/h200.yaml"); }),
             Contains("cannot open device profile '/nonexistent/dir/h200.yaml'"));
}

TEST_CASE("profile interpolation: exact on table points, monotone between, preset outside", "[profile]") {
  const DeviceProfile p = parse_device_profile(kProfile, "h.yaml");
  for (const auto& g : p.gemm) {
    const auto r = p.gemm_flops_per_second(Dtype::bf16, g.m, g.n, g.k);
    REQUIRE(r);
    CHECK(*r == Approx(g.flops_per_second).epsilon(1e-12));
  }
  // Along m at n = k = 4096: strictly increasing from 1024 to 8192, between the bracketing points.
  double prev = 0;
  for (double m = 1024; m <= 8192; m *= 1.05) {
    const double r = *p.gemm_flops_per_second(Dtype::bf16, m, 4096, 4096);
    CHECK(r > prev);
    prev = r;
  }
  const double mid = *p.gemm_flops_per_second(Dtype::bf16, std::sqrt(1024.0 * 2048.0), 4096, 4096);
  CHECK(mid == Approx(std::sqrt(2.0e14 * 4.0e14)));  // log-linear: geometric mean half-way in log m
  // Between n = 4096 and n = 8192 at m = 1024: between the two measured values.
  const double between_n = *p.gemm_flops_per_second(Dtype::bf16, 1024, 6000, 4096);
  CHECK(between_n > 2.0e14);
  CHECK(between_n < 3.0e14);
  // A batched GEMM counts as m * batch rows.
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 1024, 4096, 4096, 4) == Approx(6.0e14));
  // Below the table: no answer (preset curve); above: the largest measured size's value.
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::bf16, 512, 4096, 4096));
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::bf16, 2048, 2048, 4096));
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 65536, 4096, 4096) == Approx(7.0e14));
  // No fp16 rows: the bf16 rows price fp16 (one tensor-core rate); fp32 never borrows them.
  CHECK(*p.gemm_flops_per_second(Dtype::fp16, 2048, 4096, 4096) == *p.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096));
  CHECK(*p.gemm_flops_per_second(Dtype::fp16, 1500, 6000, 4096) == *p.gemm_flops_per_second(Dtype::bf16, 1500, 6000, 4096));
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::fp16, 512, 4096, 4096));  // below the table, as bf16
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::fp32, 2048, 4096, 4096));
  // Bandwidth tables: exact, monotone, other ops fall back to add's rows.
  CHECK(*p.elementwise_bytes_per_second("layer_norm", Dtype::bf16, 1.0e9) == Approx(3.0e12));
  CHECK(*p.elementwise_bytes_per_second("gelu", Dtype::bf16, 1.0e9) == Approx(4.0e12));
  CHECK(*p.elementwise_bytes_per_second("add", Dtype::fp32, 1.0e6) == Approx(1.0e12));  // other dtype's rows
  CHECK(*p.elementwise_bytes_per_second("add", Dtype::bf16, 3.0e7) > 1.0e12);
  CHECK(*p.elementwise_bytes_per_second("add", Dtype::bf16, 3.0e7) < 4.0e12);
  CHECK_FALSE(p.copy_bytes_per_second("d2h", 1.0e6));
  CHECK(*p.copy_bytes_per_second("h2d", 1.0e6) == Approx(2.0e10));
  CHECK(*p.bus_bandwidth("all_reduce", 8, 4.0e9) == Approx(3.6e11));
  CHECK_FALSE(p.bus_bandwidth("all_reduce", 4, 1.0e9));
  CHECK(elementwise_family("layernorm_1") == "layer_norm");
  CHECK(elementwise_family("final_layernorm") == "layer_norm");
  CHECK(elementwise_family("gelu") == "gelu");
  CHECK(elementwise_family("dropout_residual_1") == "add");
}

TEST_CASE("fp16 and bf16: each type's own rows where the profile has them, else the other 16-bit type's", "[profile]") {
  // Rows of both types at one shape, at different rates: each type answers with its own.
  const DeviceProfile both = parse_device_profile(
      with_line("attention:", "  - {op: mlp_up, dtype: fp16, m: 2048, n: 4096, k: 4096, flops_per_second: 1.0e14}\n"
                              "attention:\n"
                              "  - {kernel: flash, dtype: fp16, batch_heads: 32, seq_len: 1024, head_dim: 128, causal: true, flops_per_second: 1.0e14}"),
      "h.yaml");
  CHECK(*both.gemm_flops_per_second(Dtype::fp16, 2048, 4096, 4096) == 1.0e14);
  CHECK(*both.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096) == 4.0e14);
  CHECK(*both.attention_flops_per_second("flash", Dtype::fp16, 32, 1024, 128) == 1.0e14);
  CHECK(*both.attention_flops_per_second("flash", Dtype::bf16, 32, 1024, 128) == 3.0e14);
  // fp16's own table answers alone: below it no bf16 row stands in (bf16 has m = 1024).
  CHECK_FALSE(both.gemm_flops_per_second(Dtype::fp16, 1024, 4096, 4096));
  CHECK(*both.gemm_flops_per_second(Dtype::bf16, 1024, 4096, 4096) == 2.0e14);
  // A profile of fp16 rows only prices bf16 from them, and a model of either type the same.
  const DeviceProfile fp16_only = parse_device_profile(
      "version: 1\nmetadata: {gpu: Test GPU, backend: cuda, date: d, tool: t}\ngemm:\n"
      "  - {op: mlp_up, dtype: fp16, m: 2048, n: 4096, k: 4096, flops_per_second: 1.0e14}\n",
      "f.yaml");
  CHECK(*fp16_only.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096) == 1.0e14);
  const LayerOp op = gemm(2048, 4096, 4096);
  CHECK(*fp16_only.kernel_seconds(op, Dtype::bf16, true) == *fp16_only.kernel_seconds(op, Dtype::fp16, true));
  CHECK_FALSE(fp16_only.kernel_seconds(op, Dtype::fp32, true));
}

TEST_CASE("the device model with a profile reproduces measured times - without one it is unchanged", "[profile]") {
  const std::string path = write_temp("dssim_test_profile_a.yaml", kProfile);
  Scenario sc = load_scenario_from_string(dssim::test::tiny_yaml());
  const DeviceModel preset(sc);
  CHECK(preset.profile() == nullptr);
  Scenario with = sc;
  with.cluster.device_profile = path;
  const DeviceModel measured(with);
  REQUIRE(measured.profile() != nullptr);

  // A measured GEMM: exactly its measured time, 2 m n k / (FLOP/s).
  const LayerOp op = gemm(2048, 4096, 4096);
  CHECK(measured.kernel_seconds(op) == 2.0 * 2048 * 4096 * 4096 / 4.0e14);
  CHECK(measured.profile()->efficiency(op, Dtype::bf16, true, measured.peak_flops()) ==
        Approx(4.0e14 / measured.peak_flops()));
  // Outside the table the preset curve applies, identical to the model without a profile.
  const LayerOp small = gemm(64, 64, 64);
  CHECK(measured.kernel_seconds(small) == preset.kernel_seconds(small));
  // Preset path bit-identical to the closed form.
  const GpuSpec& g = sc.cluster.gpu;
  const double peak = sc.precision.dtype == Dtype::fp32 ? g.peak_flops_32 : g.peak_flops_16;
  const double eff = g.gemm_efficiency * op.flops / (op.flops + g.gemm_half_flops);
  CHECK(preset.kernel_seconds(op) ==
        std::max(op.flops / (peak * eff), op.memory_bytes / (g.hbm_bandwidth * g.memory_efficiency)) + g.kernel_launch);

  // Flash attention core: both GEMMs at the measured attention rate; fused softmax costs nothing.
  LayerOp scores = gemm(1024, 1024, 128);
  scores.name = "attention_scores";
  scores.attention_core = true;
  scores.batch = 32;
  scores.flops = 2 * 32 * 1024.0 * 1024 * 128;
  CHECK(measured.kernel_seconds(scores) == scores.flops / 3.0e14);
  LayerOp softmax;
  softmax.name = "softmax";
  softmax.attention_core = true;
  softmax.memory_bytes = 1e9;
  CHECK(measured.kernel_seconds(softmax) == 0.0);
  // Elementwise: bytes / measured bandwidth of its family.
  LayerOp ln;
  ln.name = "layernorm_1";
  ln.memory_bytes = 1.0e9;
  CHECK(measured.kernel_seconds(ln) == 1.0e9 / 3.0e12);
  // Copies.
  Instruction copy{};
  copy.op = Op::CopyH2D;
  copy.bytes = 1.0e9;
  CHECK(measured.copy_seconds(copy) == 1.0e9 / 5.0e10);
  CHECK(preset.copy_seconds(copy) == g.pcie_latency + 1.0e9 / g.pcie_bandwidth);
  std::filesystem::remove(path);
}

TEST_CASE("cluster.device_profile: scenario key, to_yaml, the estimator uses it, bad files are config errors", "[profile]") {
  // A profile where every tiny-model GEMM is measured far slower than the preset curve says.
  std::string slow = "version: 1\nmetadata: {gpu: slow, date: d, tool: t}\ngemm:\n";
  for (double m : {16.0, 1.0e6})
    for (double n : {16.0, 1.0e6})
      for (double k : {16.0, 1.0e6})
        slow += "  - {dtype: bf16, m: " + std::to_string(m) + ", n: " + std::to_string(n) + ", k: " + std::to_string(k) +
                ", flops_per_second: 1.0e9}\n";
  const std::string path = write_temp("dssim_test_profile_slow.yaml", slow);
  const Scenario plain = load_scenario_from_string(dssim::test::tiny_yaml());
  LoadOptions o;
  o.overrides = {"cluster.device_profile=" + path};
  const Scenario with = load_scenario_from_string(dssim::test::tiny_yaml(), o);
  CHECK(with.cluster.device_profile == path);
  CHECK(to_yaml(with).find("device_profile: " + path) != std::string::npos);
  CHECK(load_scenario_from_string(to_yaml(with)).cluster.device_profile == path);
  CHECK(to_yaml(plain).find("device_profile") == std::string::npos);
  const double t_plain = analytic_report(plain, false).iteration_seconds;
  const double t_slow = analytic_report(with, false).iteration_seconds;
  CHECK(t_slow > 10 * t_plain);

  Scenario broken = plain;
  broken.cluster.device_profile = write_temp("dssim_test_profile_broken.yaml", "metadata: {gpu: x}\ngemm: 3\n");
  CHECK_THAT(config_error([&] { DeviceModel d(broken); }), Catch::Matchers::Contains("dssim_test_profile_broken.yaml"));
  broken.cluster.device_profile = "no/such/profile.yaml";
  CHECK_THAT(config_error([&] { DeviceModel d(broken); }), Catch::Matchers::Contains("cannot open device profile 'no/such/profile.yaml'"));
  std::filesystem::remove(path);
}

// ---------------------------------------------------------------------------------------------
// Backward GEMM layouts (dgrad / wgrad), the optimizer step and the host AdamW.

namespace {

GemmPoint gemm_row(GemmPass pass, double m, double n, double k, double rate) {
  GemmPoint g;
  g.op = "mlp_up";
  g.dtype = Dtype::bf16;
  g.pass = pass;
  g.m = m, g.n = n, g.k = k;
  g.flops_per_second = rate;
  return g;
}

BandwidthPoint bw_row(const std::string& op, Dtype dtype, double bytes, double rate) {
  BandwidthPoint b;
  b.op = op;
  b.dtype = dtype;
  b.bytes = bytes;
  b.bytes_per_second = rate;
  return b;
}

DeviceProfile base_profile() { return dssim::test::empty_profile(); }

// Forward / dgrad / wgrad rows at m = 1024, 2048, 4096 and n = k = 4096, each pass its own rates.
const double kFwd[] = {2.0e14, 4.0e14, 6.0e14}, kDgrad[] = {1.5e14, 3.0e14, 5.0e14}, kWgrad[] = {1.0e14, 2.5e14, 4.0e14};

DeviceProfile backward_profile(bool dgrad, bool wgrad) {
  DeviceProfile p = base_profile();
  const double ms[] = {1024, 2048, 4096};
  for (int i = 0; i < 3; ++i) {
    p.gemm.push_back(gemm_row(GemmPass::forward, ms[i], 4096, 4096, kFwd[i]));
    if (dgrad) p.gemm.push_back(gemm_row(GemmPass::dgrad, ms[i], 4096, 4096, kDgrad[i]));
    if (wgrad) p.gemm.push_back(gemm_row(GemmPass::wgrad, ms[i], 4096, 4096, kWgrad[i]));
  }
  return p;
}

ClusterSpec cluster_with(const std::string& name, const DeviceProfile& p) {
  ClusterSpec c = load_scenario_from_string(dssim::test::tiny_yaml()).cluster;
  c.device_profile = write_temp(name, to_yaml(p));
  return c;
}

Instruction compute(Op op, int ops) {
  Instruction in{};
  in.op = op;
  in.ops = ops;
  return in;
}

}  // namespace

TEST_CASE("gemm rows: pass parses, defaults to forward, round-trips - a bad pass names gemm[i].pass", "[profile]") {
  using Catch::Matchers::Contains;
  // gemm[1] becomes a dgrad row; a wgrad row and an explicit forward row are added to the table.
  std::string yaml = with_line("dtype: bf16, m: 2048", "dtype: bf16, pass: dgrad, m: 2048");
  yaml.insert(yaml.find("attention:\n"),
              "  - {op: qkv, dtype: bf16, pass: wgrad, m: 1024, n: 8192, k: 4096, flops_per_second: 1.0e14}\n"
              "  - {op: qkv, dtype: bf16, pass: forward, m: 4096, n: 8192, k: 4096, flops_per_second: 5.0e14}\n");
  const DeviceProfile p = parse_device_profile(yaml, "b.yaml");
  REQUIRE(p.gemm.size() == 8);
  CHECK(p.gemm[0].pass == GemmPass::forward);  // no key: forward
  CHECK(p.gemm[1].pass == GemmPass::dgrad);
  CHECK(p.gemm[6].pass == GemmPass::wgrad);
  CHECK(p.gemm[7].pass == GemmPass::forward);
  const std::string out = to_yaml(p);
  CHECK(out.find("pass: dgrad") != std::string::npos);
  CHECK(out.find("pass: wgrad") != std::string::npos);
  CHECK(out.find("pass: forward") == std::string::npos);  // written only when not forward
  const DeviceProfile q = parse_device_profile(out, "round.yaml");
  REQUIRE(q.gemm.size() == p.gemm.size());
  for (size_t i = 0; i < p.gemm.size(); ++i) {
    CHECK(q.gemm[i].pass == p.gemm[i].pass);
    CHECK(q.gemm[i].m == p.gemm[i].m);
    CHECK(q.gemm[i].flops_per_second == p.gemm[i].flops_per_second);
  }
  // Lookups see only their pass's rows: the dgrad row is no forward point any more.
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096, 1, GemmPass::dgrad) == 4.0e14);
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096, 1, GemmPass::wgrad));  // below the wgrad table (n)
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 1024, 8192, 4096, 1, GemmPass::wgrad) == 1.0e14);
  const double fwd = *p.gemm_flops_per_second(Dtype::bf16, 2048, 4096, 4096);
  CHECK(fwd > 2.0e14);  // between m = 1024 and 4096, interpolated without the dgrad row's 4e14 as a point
  CHECK(fwd < 6.0e14);
  CHECK(fwd == Approx(std::sqrt(2.0e14 * 6.0e14)));
  CHECK(*p.gemm_flops_per_second(Dtype::bf16, 4096, 8192, 4096) == 5.0e14);
  CHECK(std::string(to_string(GemmPass::wgrad)) == "wgrad");
  // The summary lists the passes separately.
  const std::string summary = device_profile_summary(p);
  CHECK(summary.find("gemm dgrad bf16") != std::string::npos);
  CHECK(summary.find("gemm wgrad bf16") != std::string::npos);

  CHECK_THAT(config_error([] { parse_device_profile(with_line("dtype: bf16, m: 2048", "dtype: bf16, pass: backward, m: 2048"), "h.yaml"); }),
             Contains("h.yaml: gemm[1].pass (line 10)") && Contains("expected one of forward, dgrad, wgrad, got 'backward'"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("dtype: bf16, m: 2048", "dtype: bf16, pass: [dgrad], m: 2048"), "h.yaml"); }),
             Contains("gemm[1].pass") && Contains("expected a string"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("op: add, dtype: bf16, bytes: 1.0e6", "op: adam, dtype: bf16, bytes: 1.0e6"), "h.yaml"); }),
             Contains("elementwise[0].op") && Contains("optimizer_step, host_adamw"));
}

TEST_CASE("Backward of a GEMM: dgrad + wgrad rows when both are measured, else 2x the forward", "[profile]") {
  const DeviceModel both(cluster_with("dssim_test_profile_bwd.yaml", backward_profile(true, true)), Dtype::bf16);
  const DeviceModel dgrad_only(cluster_with("dssim_test_profile_bwd_d.yaml", backward_profile(true, false)), Dtype::bf16);
  const DeviceModel forward_only(cluster_with("dssim_test_profile_bwd_f.yaml", backward_profile(false, false)), Dtype::bf16);
  REQUIRE(both.profile());
  for (int i = 0; i < 3; ++i) {
    const double m = 1024.0 * (1 << i);
    Program prog;
    prog.op_lists = {{gemm(m, 4096, 4096)}};
    const LayerOp& op = prog.op_lists[0][0];
    const double fwd = op.flops / kFwd[i];
    CHECK(both.compute_seconds(prog, compute(Op::Forward, 0)) == fwd);
    CHECK(both.compute_seconds(prog, compute(Op::Backward, 0)) == op.flops / kDgrad[i] + op.flops / kWgrad[i]);
    CHECK(both.backward_gemm_seconds(op) == op.flops / kDgrad[i] + op.flops / kWgrad[i]);
    CHECK(*both.profile()->backward_gemm_seconds(op, Dtype::bf16) == op.flops / kDgrad[i] + op.flops / kWgrad[i]);
    // Half the passes measured, or none: 2x the (measured) forward kernel, as without backward rows.
    CHECK(dgrad_only.compute_seconds(prog, compute(Op::Backward, 0)) == 2 * fwd);
    CHECK(forward_only.compute_seconds(prog, compute(Op::Backward, 0)) == 2 * fwd);
    CHECK_FALSE(dgrad_only.profile()->backward_gemm_seconds(op, Dtype::bf16));
  }
  // Looked up by the forward shape: a batched (MoE) GEMM as m * batch rows, between points log-linear.
  LayerOp batched = gemm(1024, 4096, 4096);
  batched.batch = 2;
  batched.flops *= 2;
  CHECK(both.backward_gemm_seconds(batched) == batched.flops / kDgrad[1] + batched.flops / kWgrad[1]);
  const LayerOp mid = gemm(std::sqrt(2048.0 * 4096.0), 4096, 4096);
  CHECK(both.backward_gemm_seconds(mid) ==
        Approx(mid.flops / std::sqrt(kDgrad[1] * kDgrad[2]) + mid.flops / std::sqrt(kWgrad[1] * kWgrad[2])).epsilon(1e-12));
  // Outside the table (below it, or fp32): 2x the preset forward kernel; fp16 borrows bf16's rows.
  const LayerOp small = gemm(256, 4096, 4096);
  CHECK(both.backward_gemm_seconds(small) == 2 * both.kernel_seconds(small));
  CHECK_FALSE(both.profile()->backward_gemm_seconds(gemm(2048, 4096, 4096), Dtype::fp32));
  CHECK(*both.profile()->backward_gemm_seconds(gemm(2048, 4096, 4096), Dtype::fp16) ==
        *both.profile()->backward_gemm_seconds(gemm(2048, 4096, 4096), Dtype::bf16));

  // Attention-core GEMMs keep their rules: flash 2.5x the forward; unfused 2x, not the dgrad/wgrad rows.
  Program att;
  LayerOp scores = gemm(1024, 4096, 4096);
  scores.name = "attention_scores";
  scores.attention_core = true;
  scores.batch = 2;
  scores.flops *= 2;
  att.op_lists = {{scores}};
  CHECK(both.compute_seconds(att, compute(Op::Backward, 0)) == 2.5 * both.kernel_seconds(scores));
  const DeviceModel unfused(cluster_with("dssim_test_profile_bwd_u.yaml", backward_profile(true, true)), Dtype::bf16,
                            Recompute::none, /*flash_attention=*/false);
  CHECK(unfused.kernel_seconds(scores) == scores.flops / kFwd[1]);
  CHECK(unfused.compute_seconds(att, compute(Op::Backward, 0)) == 2 * scores.flops / kFwd[1]);
  CHECK_FALSE(both.profile()->backward_gemm_seconds(scores, Dtype::bf16));
  for (const char* f : {"dssim_test_profile_bwd.yaml", "dssim_test_profile_bwd_d.yaml", "dssim_test_profile_bwd_f.yaml",
                        "dssim_test_profile_bwd_u.yaml"})
    std::filesystem::remove(std::filesystem::temp_directory_path() / f);
}

TEST_CASE("optimizer_step rows time the OptimizerStep as memory_bytes / rate - host_adamw rows the host step", "[profile]") {
  DeviceProfile p = base_profile();
  p.elementwise = {bw_row("add", Dtype::bf16, 1.0e6, 1.0e12), bw_row("add", Dtype::bf16, 1.0e10, 4.0e12)};
  const ClusterSpec add_only = cluster_with("dssim_test_profile_opt_add.yaml", p);
  p.elementwise.push_back(bw_row("optimizer_step", Dtype::bf16, 5.0e7, 1.0e12));
  p.elementwise.push_back(bw_row("optimizer_step", Dtype::bf16, 5.0e8, 2.0e12));
  p.elementwise.push_back(bw_row("optimizer_step", Dtype::bf16, 5.0e9, 3.0e12));
  const ClusterSpec with_opt = cluster_with("dssim_test_profile_opt.yaml", p);
  p.elementwise.push_back(bw_row("host_adamw", Dtype::fp32, 3.0e8, 2.0e10));
  p.elementwise.push_back(bw_row("host_adamw", Dtype::fp32, 3.0e9, 4.0e10));
  const ClusterSpec with_host = cluster_with("dssim_test_profile_host.yaml", p);

  ClusterSpec none = add_only;
  none.device_profile.clear();
  const DeviceModel preset(none, Dtype::bf16), adds(add_only, Dtype::bf16), opt(with_opt, Dtype::bf16),
      host(with_host, Dtype::bf16);
  const Program prog;
  Instruction step = compute(Op::OptimizerStep, -1);
  step.flops = 16 * 1.0e7;
  for (double bytes : {5.0e7, 5.0e8, 5.0e9}) {
    step.memory_bytes = bytes;
    const double rate = bytes == 5.0e7 ? 1.0e12 : bytes == 5.0e8 ? 2.0e12 : 3.0e12;
    CHECK(opt.compute_seconds(prog, step) == bytes / rate);
    // No optimizer_step rows: the roofline, even though add rows exist (no stand-in).
    CHECK(adds.compute_seconds(prog, step) == preset.compute_seconds(prog, step));
    CHECK(opt.compute_seconds(prog, step) != preset.compute_seconds(prog, step));
  }
  CHECK_FALSE(opt.profile()->elementwise_bytes_per_second("optimizer_step", Dtype::bf16, 1.0e6));  // below the table
  CHECK_FALSE(adds.profile()->elementwise_bytes_per_second("optimizer_step", Dtype::bf16, 5.0e8));
  CHECK_FALSE(adds.profile()->elementwise_bytes_per_second("host_adamw", Dtype::fp32, 3.0e9));
  CHECK(*adds.profile()->elementwise_bytes_per_second("gelu", Dtype::bf16, 1.0e10) == 4.0e12);  // gelu still falls back
  step.memory_bytes = 1.0e6;
  CHECK(opt.compute_seconds(prog, step) == preset.compute_seconds(prog, step));
  step.memory_bytes = 5.0e10;  // above the table: the largest size's rate
  CHECK(opt.compute_seconds(prog, step) == 5.0e10 / 3.0e12);
  // Another training dtype: the bf16 rows stand in (bandwidth hardly depends on it).
  const DeviceModel opt32(with_opt, Dtype::fp32);
  step.memory_bytes = 5.0e8;
  CHECK(opt32.compute_seconds(prog, step) == 5.0e8 / 2.0e12);

  // Host AdamW: the node's GPUs share the host that one calibration process used whole.
  Instruction h = compute(Op::HostOptimizerStep, -1);
  h.stream = Stream::Host;
  const int gpus = with_host.gpus_per_node;
  REQUIRE(gpus == 2);
  h.memory_bytes = 3.0e9;
  CHECK(host.host_seconds(h) == 3.0e9 / 4.0e10 * gpus);
  h.memory_bytes = 3.0e8;
  CHECK(host.host_seconds(h) == 3.0e8 / 2.0e10 * gpus);
  const double formula = 3.0e8 / (none.host_memory_bandwidth / gpus);
  CHECK(preset.host_seconds(h) == formula);
  CHECK(opt.host_seconds(h) == formula);  // no host_adamw rows: the bandwidth formula
  CHECK(host.host_seconds(h) != formula);
  for (const char* f : {"dssim_test_profile_opt_add.yaml", "dssim_test_profile_opt.yaml", "dssim_test_profile_host.yaml"})
    std::filesystem::remove(std::filesystem::temp_directory_path() / f);
}

// ---------------------------------------------------------------------------------------------
// Backward-pass kernels: the elementwise rows layer_norm_backward ... embedding_backward and the
// attention kernel flash_backward.

namespace {

const char* const kBackwardOps[] = {"layer_norm_backward", "gelu_backward", "bias_grad", "cross_entropy",
                                    "cross_entropy_backward", "embedding_backward"};

// kProfile plus two rows of each backward op (rates 1e12 x (i + 1) and 2e12 x (i + 1) at 1e6 and
// 1e9 bytes) and two flash_backward rows (half the flash rows' rates).
std::string backward_yaml() {
  std::string rows;
  for (int i = 0; i < 6; ++i)
    rows += "  - {op: " + std::string(kBackwardOps[i]) + ", dtype: bf16, bytes: 1.0e6, bytes_per_second: " +
            std::to_string(i + 1) + ".0e12}\n  - {op: " + kBackwardOps[i] + ", dtype: bf16, bytes: 1.0e9, bytes_per_second: " +
            std::to_string(2 * (i + 1)) + ".0e12}\n";
  std::string s = kProfile;
  s.insert(s.find("copy:\n"), rows);
  s.insert(s.find("elementwise:\n"),
           "  - {kernel: flash_backward, dtype: bf16, batch_heads: 32, seq_len: 1024, head_dim: 128, causal: true, flops_per_second: 1.5e14, seconds: 0.001}\n"
           "  - {kernel: flash_backward, dtype: bf16, batch_heads: 32, seq_len: 4096, head_dim: 128, causal: true, flops_per_second: 2.5e14}\n");
  return s;
}

}  // namespace

TEST_CASE("backward-kernel rows parse, round-trip and are looked up by their own op only", "[profile]") {
  const DeviceProfile p = parse_device_profile(backward_yaml(), "bk.yaml");
  REQUIRE(p.elementwise.size() == 4 + 12);
  REQUIRE(p.attention.size() == 4);
  CHECK(p.attention[2].kernel == "flash_backward");
  CHECK(p.attention[2].seconds == 0.001);
  for (int i = 0; i < 6; ++i) {
    CHECK(p.elementwise[4 + 2 * i].op == kBackwardOps[i]);
    CHECK(p.elementwise[4 + 2 * i + 1].bytes == 1.0e9);
  }
  // to_yaml round-trips every row.
  const std::string out = to_yaml(p);
  const DeviceProfile q = parse_device_profile(out, "round.yaml");
  REQUIRE(q.elementwise.size() == p.elementwise.size());
  for (size_t i = 0; i < p.elementwise.size(); ++i) {
    CHECK(q.elementwise[i].op == p.elementwise[i].op);
    CHECK(q.elementwise[i].dtype == p.elementwise[i].dtype);
    CHECK(q.elementwise[i].bytes == p.elementwise[i].bytes);
    CHECK(q.elementwise[i].bytes_per_second == p.elementwise[i].bytes_per_second);
  }
  REQUIRE(q.attention.size() == p.attention.size());
  for (size_t i = 0; i < p.attention.size(); ++i) {
    CHECK(q.attention[i].kernel == p.attention[i].kernel);
    CHECK(q.attention[i].seq_len == p.attention[i].seq_len);
    CHECK(q.attention[i].flops_per_second == p.attention[i].flops_per_second);
  }
  CHECK(out.find("kernel: flash_backward") != std::string::npos);
  // Byte counts are written exactly (the calibration's are whole numbers of 8+ digits), rates to 7 digits.
  DeviceProfile exact = base_profile();
  exact.elementwise = {bw_row("cross_entropy_backward", Dtype::bf16, 26.0 * 32768 * 51200, 1.234567891e12),
                       bw_row("layer_norm_backward", Dtype::bf16, 10.0 * 16384 * 4096, 2.0e12)};
  const DeviceProfile back = parse_device_profile(to_yaml(exact), "exact.yaml");
  REQUIRE(back.elementwise.size() == 2);
  CHECK(back.elementwise[0].bytes == 26.0 * 32768 * 51200);
  CHECK(back.elementwise[1].bytes == 10.0 * 16384 * 4096);
  CHECK(back.elementwise[0].bytes_per_second == Approx(1.234567891e12).epsilon(1e-6));

  // Lookups: exact on the table points, log-linear between, clamped above, nullopt below.
  for (int i = 0; i < 6; ++i) {
    const std::string op = kBackwardOps[i];
    CHECK(*p.elementwise_bytes_per_second(op, Dtype::bf16, 1.0e6) == (i + 1) * 1.0e12);
    CHECK(*p.elementwise_bytes_per_second(op, Dtype::bf16, 1.0e9) == 2 * (i + 1) * 1.0e12);
    CHECK(*p.elementwise_bytes_per_second(op, Dtype::bf16, std::sqrt(1.0e6 * 1.0e9)) ==
          Approx(std::sqrt(2.0) * (i + 1) * 1.0e12));
    CHECK(*p.elementwise_bytes_per_second(op, Dtype::bf16, 1.0e12) == 2 * (i + 1) * 1.0e12);
    CHECK_FALSE(p.elementwise_bytes_per_second(op, Dtype::bf16, 1.0e5));
    CHECK(*p.elementwise_bytes_per_second(op, Dtype::fp16, 1.0e9) == 2 * (i + 1) * 1.0e12);  // another dtype's rows
  }
  // The forward families are untouched by the backward rows.
  CHECK(*p.elementwise_bytes_per_second("layer_norm", Dtype::bf16, 1.0e9) == 3.0e12);
  CHECK(*p.elementwise_bytes_per_second("add", Dtype::bf16, 1.0e9) == 4.0e12);
  // flash_backward like flash, each among its own rows; flash lookups and kernel_seconds unchanged.
  CHECK(*p.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 1024, 128) == 1.5e14);
  CHECK(*p.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 4096, 128) == 2.5e14);
  CHECK(*p.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 2048, 128) == Approx(std::sqrt(1.5e14 * 2.5e14)));
  CHECK(*p.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 65536, 128) == 2.5e14);
  CHECK_FALSE(p.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 512, 128));
  CHECK(*p.attention_flops_per_second("flash_backward", Dtype::fp16, 32, 1024, 128) == 1.5e14);  // bf16's rows
  CHECK_FALSE(p.attention_flops_per_second("flash_backward", Dtype::fp32, 32, 1024, 128));
  CHECK(*p.attention_flops_per_second("flash", Dtype::bf16, 32, 1024, 128) == 3.0e14);
  const DeviceProfile base = parse_device_profile(kProfile, "h.yaml");
  LayerOp scores = gemm(1024, 1024, 128);
  scores.name = "attention_scores";
  scores.attention_core = true;
  scores.batch = 32;
  scores.flops = 2 * 32 * 1024.0 * 1024 * 128;
  CHECK(*p.kernel_seconds(scores, Dtype::bf16, true) == *base.kernel_seconds(scores, Dtype::bf16, true));
  CHECK_FALSE(base.attention_flops_per_second("flash_backward", Dtype::bf16, 32, 1024, 128));  // flash rows don't stand in

  // The summary lists the new groups.
  const std::string summary = device_profile_summary(p);
  CHECK(summary.find("attention flash_backward bf16") != std::string::npos);
  for (const char* op : kBackwardOps) CHECK(summary.find(std::string(op) + " bf16 ") != std::string::npos);
}

TEST_CASE("backward-kernel ops never fall back to add's rows, unknown ops and kernels are errors", "[profile]") {
  using Catch::Matchers::Contains;
  // kProfile has add and layer_norm rows, no backward rows: nullopt, while gelu still uses add's.
  const DeviceProfile p = parse_device_profile(kProfile, "h.yaml");
  for (const char* op : kBackwardOps)
    for (double bytes : {1.0e6, 1.0e8, 1.0e9, 1.0e12}) {
      CHECK_FALSE(p.elementwise_bytes_per_second(op, Dtype::bf16, bytes));
      CHECK_FALSE(p.elementwise_bytes_per_second(op, Dtype::fp32, bytes));
    }
  CHECK(*p.elementwise_bytes_per_second("gelu", Dtype::bf16, 1.0e9) == 4.0e12);
  // Rows of one backward op don't answer for another (or for layer_norm).
  DeviceProfile only_ln = base_profile();
  only_ln.elementwise = {bw_row("layer_norm_backward", Dtype::bf16, 1.0e6, 1.0e12), bw_row("add", Dtype::bf16, 1.0e6, 2.0e12)};
  CHECK(*only_ln.elementwise_bytes_per_second("layer_norm_backward", Dtype::bf16, 1.0e6) == 1.0e12);
  CHECK(*only_ln.elementwise_bytes_per_second("layer_norm", Dtype::bf16, 1.0e6) == 2.0e12);  // add's, not the backward's
  CHECK_FALSE(only_ln.elementwise_bytes_per_second("gelu_backward", Dtype::bf16, 1.0e6));
  CHECK_FALSE(only_ln.elementwise_bytes_per_second("cross_entropy", Dtype::bf16, 1.0e6));

  // Unknown names are errors naming the key and the allowed values.
  CHECK_THAT(config_error([] { parse_device_profile(with_line("op: layer_norm, dtype: bf16, bytes: 1.0e9", "op: layer_norm_bwd, dtype: bf16, bytes: 1.0e9"), "h.yaml"); }),
             Contains("h.yaml: elementwise[3].op") && Contains("layer_norm_backward, layer_norm_residual_backward, gelu_backward, bias_grad, cross_entropy, "
                                                              "cross_entropy_backward, fused_cross_entropy, embedding_backward") &&
                 Contains("got 'layer_norm_bwd'"));
  CHECK_THAT(config_error([] { parse_device_profile(with_line("kernel: flash, dtype: bf16, batch_heads: 32, seq_len: 4096", "kernel: flash_bwd, dtype: bf16, batch_heads: 32, seq_len: 4096"), "h.yaml"); }),
             Contains("attention[1].kernel") && Contains("flash, plain, flash_backward") && Contains("got 'flash_bwd'"));
  // A backward row is validated like every row.
  std::string bad = backward_yaml();
  const std::string from = "op: bias_grad, dtype: bf16, bytes: 1.0e6, bytes_per_second: 3.0e12";
  REQUIRE(bad.find(from) != std::string::npos);
  bad.replace(bad.find(from), from.size(), "op: bias_grad, dtype: bf16, bytes: 1.0e6, bytes_per_second: 0");
  CHECK_THAT(config_error([&] { parse_device_profile(bad, "h.yaml"); }),
             Contains("elementwise[8].bytes_per_second") && Contains("must be a positive number"));
}

TEST_CASE("elementwise rows of equal bytes count as one point at the geometric mean of their rates", "[profile]") {
  // bias_grad of [4096 x 8192] and [32768 x 1024]: the same bytes, two shapes, two rates.
  DeviceProfile p = base_profile();
  p.elementwise = {bw_row("bias_grad", Dtype::bf16, 1.0e6, 1.0e12), bw_row("bias_grad", Dtype::bf16, 1.0e8, 1.0e12),
                   bw_row("bias_grad", Dtype::bf16, 1.0e8, 4.0e12), bw_row("bias_grad", Dtype::bf16, 1.0e10, 8.0e12)};
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e8) == Approx(2.0e12).epsilon(1e-12));
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e6) == 1.0e12);   // unique bytes: exact
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e10) == 8.0e12);
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e7) == Approx(std::sqrt(2.0) * 1.0e12));  // log-linear to the merged point
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e9) == Approx(4.0e12));
  // The order of the rows does not matter (it did while the first row of a size won).
  std::swap(p.elementwise[1], p.elementwise[2]);
  CHECK(*p.elementwise_bytes_per_second("bias_grad", Dtype::bf16, 1.0e8) == Approx(2.0e12).epsilon(1e-12));
}

TEST_CASE("merging a calibration into a profile replaces only the kinds of rows it measured", "[profile]") {
  const DeviceProfile base = parse_device_profile(kProfile, "h.yaml");
  DeviceProfile fresh;
  fresh.metadata = base.metadata;
  fresh.metadata.date = "2026-12-03T00:00:00Z";
  fresh.metadata.tool = "dssim calibrate --only moe";
  BandwidthPoint r;
  r.op = "moe_dispatch";
  r.bytes = 1e8;
  r.bytes_per_second = 5e11;
  fresh.elementwise.push_back(r);
  r.op = "layer_norm";  // a re-measured family replaces its old rows
  r.bytes_per_second = 2e12;
  fresh.elementwise.push_back(r);
  const DeviceProfile m = merge_device_profile(base, fresh);
  CHECK(m.gemm.size() == base.gemm.size());
  CHECK(m.attention.size() == base.attention.size());
  CHECK(m.copy.size() == base.copy.size());
  CHECK(m.collectives.size() == base.collectives.size());
  int adds = 0, norms = 0, moe = 0, others = 0;
  for (const auto& e : m.elementwise)
    (e.op == "add" ? adds : e.op == "layer_norm" ? norms : e.op == "moe_dispatch" ? moe : others)++;
  CHECK(others == 0);
  CHECK(adds == 2);
  CHECK(norms == 1);
  CHECK(moe == 1);
  CHECK(m.metadata.date == base.metadata.date);
  REQUIRE(!m.metadata.notes.empty());
  CHECK_THAT(m.metadata.notes.back(), Catch::Contains("moe_dispatch"));
  CHECK(*m.elementwise_bytes_per_second("moe_dispatch", Dtype::bf16, 1e8) == Approx(5e11));
  DeviceProfile other = fresh;
  other.metadata.gpu = "Another GPU";
  CHECK_THROWS_WITH(merge_device_profile(base, other), Catch::Contains("Another GPU"));
}
