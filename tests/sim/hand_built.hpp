// A hand-built cluster for the simulator's closed-form tests (tests/sim): `nodes` x `gpn` GPUs,
// `nics` NICs of `nic_bw` bytes/s per node, A100-like GPUs, pure data parallelism, one micro-batch.
#pragma once
#include "core/scenario.hpp"

namespace dssim::simtest {

inline Scenario cluster_scenario(int nodes, int gpn, int nics, double nic_bw) {
  Scenario sc;
  sc.name = "hand-built";
  sc.cluster.nodes = nodes;
  sc.cluster.gpus_per_node = gpn;
  sc.cluster.nics_per_node = nics;
  sc.cluster.nic_bandwidth = nic_bw;
  sc.cluster.nic_latency = 2e-6;
  sc.cluster.switch_latency = 0.5e-6;
  sc.cluster.gpu.peak_flops_16 = 312e12;
  sc.cluster.gpu.peak_flops_32 = 19.5e12;
  sc.cluster.gpu.hbm_bandwidth = 2e12;
  sc.cluster.gpu.nvlink_bandwidth = 300e9;
  sc.cluster.gpu.nvlink_latency = 1e-6;
  sc.cluster.gpu.pcie_bandwidth = 25e9;
  sc.cluster.gpu.pcie_latency = 2e-6;
  sc.parallel.dp = nodes * gpn;
  sc.training.micro_batch = 1;
  sc.training.grad_accum = 1;
  sc.training.global_batch = nodes * gpn;
  return sc;
}

}  // namespace dssim::simtest
