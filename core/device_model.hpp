// How long a compute instruction takes on a GPU: per kernel, a roofline with efficiency curves
// taken from the GPU preset (or a measured calibration profile), plus kernel-launch overhead.
//   t(kernel) = max(flops / (peak * clock * eff(kernel)), bytes / (hbm_bandwidth * memory_efficiency)) + launch
// (clock: the power limit's clock factor, 1 at TDP).
// Shared by the analytic estimator and the simulator so both agree when nothing contends.
#pragma once
#include <memory>
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct DeviceProfile;  // core/device_profile.hpp

// Everything DeviceModel(const Scenario&) reads of a Scenario (and the collective model reads only
// the cluster): instruction_seconds prices from these alone, so two Scenarios whose inputs compare
// equal price equal instructions of equal kernel lists and groups the same, bit for bit.
struct PricingInputs {
  ClusterSpec cluster;
  Dtype dtype;
  Recompute recompute;
  bool flash_attention;
  bool onebit_step;  // the step is 1-bit Adam's compressed-phase update
  explicit PricingInputs(const Scenario& sc);
  bool operator==(const PricingInputs&) const = default;
};

class DeviceModel {
 public:
  DeviceModel(const ClusterSpec& cluster, Dtype dtype, Recompute recompute = Recompute::none,
              bool flash_attention = true);
  explicit DeviceModel(const Scenario& sc);
  explicit DeviceModel(const PricingInputs& in);

  // A GEMM with a forward epilogue (LayerOp::epilogue): the profile's rows of that epilogue where
  // they answer, else the plain GEMM plus the kernel the epilogue replaces (epilogue_replaced_op),
  // each priced as without epilogues.
  double kernel_seconds(const LayerOp& op) const;
  // Backward of a GEMM LayerOp (given by its forward shape, not attention-core): the profile's
  // dgrad + wgrad time where both are measured, else 2x kernel_seconds. A pass with an epilogue
  // (dgrad_epilogue, wgrad_epilogue): that epilogue's rows of the pass where they answer, else
  // the plain pass plus the backward of the kernel it replaces.
  double backward_gemm_seconds(const LayerOp& op) const;
  // Backward of a flash-attention GEMM op: the profile's flash_backward rate, else 2.5x forward.
  double flash_backward_seconds(const LayerOp& op) const;
  // Backward of a memory-bound op (LayerOp::backward_memory_bytes at its backward kernel's rate).
  double memory_bound_backward_seconds(const LayerOp& op) const;
  // Compute instruction on the GPU (Forward/Backward/Recompute/OptimizerStep), one repetition.
  // Program::op_lists hold forward kernels; Backward and Recompute derive theirs from them.
  double compute_seconds(const Program& program, const Instruction& inst) const;
  // Host optimizer step: bound by host memory bandwidth shared by the node's GPUs (or the profile's
  // host_adamw rate, shared by the node's GPUs), plus its NVMe swap (`bytes`: ZeRO-Infinity).
  double host_seconds(const Instruction& inst) const;
  // PCIe copy (CopyH2D / CopyD2H); a CopyH2D's memory_bytes are read from NVMe first.
  double copy_seconds(const Instruction& inst) const;
  // NVMe traffic at the node's cluster.nvme_bandwidth shared by its GPUs (0 when not stated).
  double nvme_seconds(double bytes) const;
  // A collective's local work before it sends (Instruction::memory_bytes; 1-bit Adam's compression
  // at the profile's onebit_* rows, else the HBM roofline); 0 for plain collectives.
  double collective_local_seconds(const Instruction& inst) const;

  // Sustained SM clock of compute-bound kernels under cluster.gpu.power_limit, as a fraction of
  // the clock at TDP: (power_limit / tdp)^(1/3), 1 without a limit or with one at or above the TDP.
  // Physical model, not measured: dynamic power ~ f V^2 and V ~ f along the DVFS curve, so P ~ f^3.
  // Divides the FLOP-bound time of GEMMs, fused attention and the optimizer step's FLOP term;
  // memory-bound kernels (they stay below the limit: bench/gemm_power_clock.py), copies and
  // communication are unchanged. A measured device profile already holds the clocks it ran at, so the loader
  // refuses power_limit with device_profile.
  static double power_limit_clock_factor(const GpuSpec& gpu);
  double clock_factor() const { return clock_; }
  // The datasheet peak (MFU / HFU denominators): the power limit does not change it.
  double peak_flops() const { return peak_; }
  const ClusterSpec& cluster() const { return cluster_; }
  // The measured profile named by cluster.device_profile; null when the preset curves apply.
  const DeviceProfile* profile() const { return profile_.get(); }

 private:
  double gemm_efficiency(double flops) const;
  double epilogue_backward_seconds(const LayerOp& op) const;
  double roofline_seconds(const LayerOp& op) const;
  ClusterSpec cluster_;
  Recompute recompute_;
  bool flash_attention_;
  bool onebit_step_ = false;  // the step is 1-bit Adam's compressed-phase update
  double peak_;
  double clock_ = 1.0;  // power_limit_clock_factor(cluster.gpu)
  Dtype dtype_;
  std::shared_ptr<const DeviceProfile> profile_;
};

}  // namespace dssim
