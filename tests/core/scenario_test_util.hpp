// Helpers shared by the scenario / ds_config / validation tests.
#pragma once
#include <functional>
#include <string>
#include "core/device_profile.hpp"
#include "core/model.hpp"
#include "core/scenario_loader.hpp"

namespace dssim::test {

inline std::string scenario_data(const std::string& name) { return std::string(DSSIM_TEST_DATA_DIR) + "/scenarios/" + name; }
inline std::string ds_data(const std::string& name) { return std::string(DSSIM_TEST_DATA_DIR) + "/ds_configs/" + name; }
inline std::string shipped(const std::string& name) { return data_root() + "/scenarios/" + name; }

// The ConfigError message `f` throws; fails the test with "<no error>" when it does not throw.
inline std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no error>";
}

// tiny_pp3 re-laid as a pp-stage pipeline on one node: two layers a stage, micro-batch 1,
// `micro_batches` of them in the global batch (the pipeline tests' closed forms).
inline Scenario tiny_pipeline(int pp, int micro_batches) {
  Scenario sc = load_scenario("tiny/tiny_pp3");
  sc.parallel.pp = pp;
  sc.model.layers = 2 * pp;
  sc.cluster.gpus_per_node = pp;
  sc.cluster.nodes = 1;
  sc.training.micro_batch = 1;
  sc.training.grad_accum = micro_batches;
  sc.training.global_batch = micro_batches;
  return sc;
}

// A complete small scenario (tiny model, global batch 8, micro-batch 1), the cluster section last
// so that lines appended to the result land in it; `extra` adds top-level sections before it.
inline std::string tiny_yaml(const std::string& parallel = "  tp: 1\n  pp: 1\n",
                             const std::string& cluster = "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                             const std::string& extra = "") {
  return "model: tiny\n"
         "training:\n  global_batch: 8\n  micro_batch: 1\n"
         "parallel:\n" + parallel + extra + "cluster:\n" + cluster;
}

// tiny_yaml() with its model section written out as `model: {preset: tiny}` plus `keys` (lines
// indented by two spaces).
inline std::string tiny_yaml_with_model(const std::string& keys) {
  std::string y = tiny_yaml();
  y.replace(y.find("model: tiny\n"), 12, "model:\n  preset: tiny\n" + keys);
  return y;
}

// A bf16 GEMM LayerOp [m x k] x [k x n] ("mlp_up"): 2 m n k FLOPs, its three matrices' bytes.
inline LayerOp gemm_op(double m, double n, double k) {
  LayerOp op;
  op.name = "mlp_up";
  op.gemm = true;
  op.m = m, op.n = n, op.k = k;
  op.flops = 2 * m * n * k;
  op.memory_bytes = (m * k + k * n + m * n) * 2;
  return op;
}

// A device profile with the metadata a profile needs and no rows (the tests add theirs).
inline DeviceProfile empty_profile() {
  DeviceProfile p;
  p.metadata.gpu = "Test GPU";
  p.metadata.backend = "cuda";
  p.metadata.date = "2026-01-01T00:00:00Z";
  p.metadata.tool = "built in tests";
  p.metadata.torch_version = "2.11.0";
  return p;
}

inline bool has_warning_with(const Scenario& s, const std::string& text) {
  for (const auto& w : s.warnings)
    if (w.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace dssim::test
