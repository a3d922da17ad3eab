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

LayerOp gemm(double m, double n, double k) {
  LayerOp op;
  op.name = "mlp_up";
  op.gemm = true;
  op.m = m, op.n = n, op.k = k;
  op.flops = 2 * m * n * k;
  op.memory_bytes = (m * k + k * n + m * n) * 2;
  return op;
}

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
  CHECK_FALSE(p.gemm_flops_per_second(Dtype::fp16, 2048, 4096, 4096));  // no fp16 rows
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

TEST_CASE("the device model with a profile reproduces measured times; without one it is unchanged", "[profile]") {
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
