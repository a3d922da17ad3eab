// cluster.gpu.power_limit: the presets' TDPs, the clock factor (power_limit / tdp)^(1/3) on
// FLOP-bound kernel time only, and the loader's errors for limits that make no sense.
#include <catch2/catch.hpp>

#include <cmath>
#include "core/device_model.hpp"
#include "core/scenario_units.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using Catch::Matchers::Contains;
using dssim::test::config_error;
using dssim::test::gemm_op;

namespace {

// The tiny scenario on one H100-SXM node; `gpu_lines` are appended to cluster.gpu.
Scenario h100(const std::string& gpu_lines = "") {
  return load_scenario_from_string(dssim::test::tiny_yaml(
      "  tp: 1\n  pp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n  gpu:\n    preset: H100-SXM\n" + gpu_lines));
}

}  // namespace

TEST_CASE("GPU presets state their TDP in watts", "[power]") {
  auto tdp = [](const std::string& preset) {
    return load_scenario_from_string(dssim::test::tiny_yaml("  tp: 1\n  pp: 1\n",
                                                             "  preset: single-node-pcie\n  gpus_per_node: 2\n  gpu: " + preset + "\n"))
        .cluster.gpu.tdp;
  };
  CHECK(tdp("A100-40GB") == 400);
  CHECK(tdp("A100-80GB") == 400);
  CHECK(tdp("H100-SXM") == 700);
  CHECK(tdp("H200-SXM") == 700);
  CHECK(tdp("V100-32GB") == 300);
  CHECK(h100().cluster.gpu.power_limit == 0);  // no limit unless the scenario sets one
}

TEST_CASE("power quantities: W and kW, other units refused", "[power]") {
  CHECK(parse_quantity("500 W", Dimension::Power).value() == 500);
  CHECK(parse_quantity("0.7 kW", Dimension::Power).value() == Approx(700));
  CHECK(parse_quantity("350", Dimension::Power).value() == 350);
  CHECK_FALSE(parse_quantity("500 GB/s", Dimension::Power));
  CHECK_FALSE(parse_quantity("500 MW", Dimension::Power));
}

TEST_CASE("the power-limit clock factor is 1 without a limit and (limit / TDP)^(1/3) below it", "[power]") {
  GpuSpec g;
  g.tdp = 700;
  CHECK(DeviceModel::power_limit_clock_factor(g) == 1.0);  // no limit
  g.power_limit = 350;
  CHECK(DeviceModel::power_limit_clock_factor(g) == std::cbrt(0.5));
  CHECK(std::pow(DeviceModel::power_limit_clock_factor(g), 3) == Approx(0.5).epsilon(1e-12));
  g.power_limit = 500;
  CHECK(DeviceModel::power_limit_clock_factor(g) == Approx(0.8939).epsilon(1e-4));  // torchtitan's 500 W H100
  g.power_limit = 700;
  CHECK(DeviceModel::power_limit_clock_factor(g) == 1.0);  // at the TDP
  g.power_limit = 800;
  CHECK(DeviceModel::power_limit_clock_factor(g) == 1.0);  // above it: capped, no overclock
  g.tdp = 0;
  g.power_limit = 350;
  CHECK(DeviceModel::power_limit_clock_factor(g) == 1.0);  // no TDP to compare with (the loader refuses this)

  CHECK(DeviceModel(h100()).clock_factor() == 1.0);
  CHECK(DeviceModel(h100("    power_limit: 350 W\n")).clock_factor() == std::cbrt(0.5));
}

TEST_CASE("a power limit divides FLOP-bound kernel time by the clock factor and leaves memory-bound time alone", "[power]") {
  const std::string no_launch = "    kernel_launch: 0\n";
  const DeviceModel full(h100(no_launch));
  const DeviceModel half(h100(no_launch + "    power_limit: 350 W\n"));
  const double f = std::cbrt(0.5);
  REQUIRE(half.clock_factor() == f);
  // The datasheet peak (MFU's denominator) is the same.
  CHECK(half.peak_flops() == full.peak_flops());

  // A large GEMM is FLOP-bound: exactly 1 / factor as long, forward and backward.
  const LayerOp big = gemm_op(8192, 8192, 8192);
  REQUIRE(full.kernel_seconds(big) > big.memory_bytes / (3.35e12 * 0.85));  // FLOP-bound at full clock
  CHECK(half.kernel_seconds(big) == Approx(full.kernel_seconds(big) / f).epsilon(1e-12));
  CHECK(half.backward_gemm_seconds(big) == Approx(full.backward_gemm_seconds(big) / f).epsilon(1e-12));
  CHECK(half.kernel_seconds(big) > full.kernel_seconds(big) * 1.25);  // 1 / 0.7937 = 1.26

  // Fused (flash) attention core: FLOP-bound, scaled the same way.
  LayerOp scores = gemm_op(8192, 8192, 128);
  scores.name = "attention_scores";
  scores.attention_core = true;
  scores.batch = 32;
  scores.flops = 2 * 32 * 8192.0 * 8192 * 128;
  CHECK(half.kernel_seconds(scores) == Approx(full.kernel_seconds(scores) / f).epsilon(1e-12));

  // A memory-bound elementwise kernel: the same time to the bit.
  LayerOp ln;
  ln.name = "layernorm_1";
  ln.memory_bytes = 1.0e9;
  CHECK(half.kernel_seconds(ln) == full.kernel_seconds(ln));
  CHECK(half.memory_bound_backward_seconds(ln) == full.memory_bound_backward_seconds(ln));
  // A skinny GEMM stays memory-bound even at the lower clock: unchanged too.
  const LayerOp skinny = gemm_op(1 << 22, 8, 8);
  REQUIRE(skinny.memory_bytes / (3.35e12 * 0.85) > skinny.flops / (989.5e12 * f * 0.75));
  CHECK(half.kernel_seconds(skinny) == full.kernel_seconds(skinny));

  // Copies over PCIe are not the SMs' clock.
  Instruction copy{};
  copy.op = Op::CopyH2D;
  copy.bytes = 1.0e9;
  CHECK(half.copy_seconds(copy) == full.copy_seconds(copy));
}

TEST_CASE("power_limit errors name the key and the fix", "[power]") {
  CHECK_THAT(config_error([] { h100("    power_limit: 0\n"); }),
             Contains("cluster.gpu.power_limit") && Contains("must be greater than 0"));
  CHECK_THAT(config_error([] { h100("    power_limit: -300 W\n"); }),
             Contains("cluster.gpu.power_limit") && Contains("must be greater than 0"));
  CHECK_THAT(config_error([] { h100("    power_limit: 500 GB\n"); }),
             Contains("cluster.gpu.power_limit") && Contains("a power such as '500 W'"));
  // More than 1.5 x the TDP: a unit slip, not a board setting.
  CHECK_THAT(config_error([] { h100("    power_limit: 1100 W\n"); }),
             Contains("cluster.gpu.power_limit at line") && Contains("more than 1.5 x the GPU's TDP of 700 W") &&
                 Contains("omit it to run at the TDP"));
  CHECK(h100("    power_limit: 1050 W\n").cluster.gpu.power_limit == 1050);  // 1.5 x: accepted, factor 1
  // A GPU without a TDP has nothing to compare the limit with.
  const std::string custom =
      "  gpus_per_node: 1\n  nodes: 1\n  intra_node: pcie\n  gpu:\n    memory: 80 GiB\n    hbm_bandwidth: 2 TB/s\n"
      "    peak_flops_16: 312 TFLOP/s\n    peak_flops_32: 19.5 TFLOP/s\n    pcie_bandwidth: 25 GB/s\n";
  auto custom_scenario = [&](const std::string& extra) {
    return load_scenario_from_string("model: tiny\ntraining:\n  global_batch: 8\n  micro_batch: 8\nparallel:\n  tp: 1\n  pp: 1\n"
                                     "cluster:\n" + custom + extra);
  };
  CHECK(custom_scenario("").cluster.gpu.tdp == 0);
  CHECK_THAT(config_error([&] { custom_scenario("    power_limit: 300 W\n"); }),
             Contains("cluster.gpu.power_limit") && Contains("set cluster.gpu.tdp") && Contains("H100-SXM"));
  CHECK(DeviceModel(custom_scenario("    power_limit: 200 W\n    tdp: 400 W\n")).clock_factor() == std::cbrt(0.5));
  // A measured profile already ran at its own clocks.
  CHECK_THAT(config_error([] { h100("    power_limit: 500 W\n  device_profile: some/profile.yaml\n"); }),
             Contains("cluster.gpu.power_limit") && Contains("cluster.device_profile") && Contains("drop power_limit"));
}

TEST_CASE("power_limit survives the resolved scenario's YAML", "[power]") {
  const Scenario s = h100("    power_limit: 500 W\n");
  const Scenario back = load_scenario_from_string(to_yaml(s));
  CHECK(back.cluster.gpu.power_limit == 500);
  CHECK(back.cluster.gpu.tdp == 700);
  CHECK(DeviceModel(back).clock_factor() == DeviceModel(s).clock_factor());
}
