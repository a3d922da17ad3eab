#include "core/device_model.hpp"

#include <algorithm>
#include <cmath>
#include "core/device_profile.hpp"

namespace dssim {

PricingInputs::PricingInputs(const Scenario& sc)
    : cluster(sc.cluster),
      dtype(sc.precision.dtype),
      recompute(sc.recompute),
      flash_attention(sc.model.flash_attention),
      onebit_step(sc.optimizer.onebit_compressed(sc.zero.stage)) {}

DeviceModel::DeviceModel(const Scenario& sc) : DeviceModel(PricingInputs(sc)) {}

DeviceModel::DeviceModel(const PricingInputs& in)
    : DeviceModel(in.cluster, in.dtype, in.recompute, in.flash_attention) {
  onebit_step_ = in.onebit_step;
}

DeviceModel::DeviceModel(const ClusterSpec& cluster, Dtype dtype, Recompute recompute, bool flash_attention)
    : cluster_(cluster),
      recompute_(recompute),
      flash_attention_(flash_attention),
      peak_(dtype == Dtype::fp32 ? cluster.gpu.peak_flops_32 : cluster.gpu.peak_flops_16),
      clock_(power_limit_clock_factor(cluster.gpu)),
      dtype_(dtype) {
  if (!cluster.device_profile.empty())
    profile_ = shared_device_profile(resolve_device_profile_path(cluster.device_profile));
}

double DeviceModel::power_limit_clock_factor(const GpuSpec& gpu) {
  // Dynamic power P = C f V^2 with the voltage following the clock along the DVFS curve (V ~ f):
  // P ~ f^3, so a limit at a fraction x of the TDP sustains the clock x^(1/3) of the TDP clock on
  // kernels that draw the TDP (compute-bound ones). The exponent is the physical model, not a
  // measurement; leakage and the voltage floor make real curves flatter at low limits.
  if (!(gpu.power_limit > 0) || !(gpu.tdp > 0) || gpu.power_limit >= gpu.tdp) return 1.0;
  return std::cbrt(gpu.power_limit / gpu.tdp);
}

// Saturating curve: small GEMMs cannot fill the GPU's SMs (wave quantization, launch latency);
// large ones reach the plateau. eff(f) = plateau * f / (f + f_half).
double DeviceModel::gemm_efficiency(double flops) const {
  const GpuSpec& g = cluster_.gpu;
  return g.gemm_efficiency * flops / (flops + g.gemm_half_flops);
}

double DeviceModel::kernel_seconds(const LayerOp& op) const {
  if (op.gemm && !op.epilogue.empty()) {  // measured with its epilogue, else the kernels it replaces
    if (profile_)
      if (auto t = profile_->kernel_seconds(op, dtype_, flash_attention_)) return *t;
    return kernel_seconds(plain_gemm(op)) + kernel_seconds(epilogue_replaced_op(op.epilogue, op, bytes_of(dtype_)));
  }
  // A measured kernel: back-to-back timing already includes what launches cost in a stream. An op
  // that names its kernel (cross_entropy, bias_grad) is priced by that row where measured.
  if (profile_ && !op.gemm && !op.kernel.empty() && op.memory_bytes > 0)
    if (auto bw = profile_->elementwise_bytes_per_second(op.kernel, dtype_, op.memory_bytes))
      return op.memory_bytes / *bw;
  if (profile_)
    if (auto t = profile_->kernel_seconds(op, dtype_, flash_attention_)) return *t;
  // Unfused attention (Megatron 2021): batched QK^T / attention-over-V GEMMs and a softmax that
  // reads and writes the s x s scores: the generic roofline below, with their HBM bytes.
  if (!flash_attention_ || !op.attention_core) return roofline_seconds(op);
  if (!op.gemm) {
    // softmax / dropout of the attention core are fused into the flash-attention kernel
    return 0.0;
  }
  const GpuSpec& g = cluster_.gpu;
  // QK^T and attention-over-V run inside one fused (flash) kernel: FLOP-bound, and its s x s
  // intermediates never reach HBM.
  return op.flops / (peak_ * clock_ * g.attention_efficiency) + 0.5 * g.kernel_launch;  // two GEMMs, one kernel
}

double DeviceModel::flash_backward_seconds(const LayerOp& op) const {
  // The profile's flash_backward rows (same FLOP convention as the forward rows); else FlashAttention's
  // backward recomputes QK^T and runs 5 GEMM-sized products for the forward's 2 (Dao 2023,
  // arXiv:2307.08691, section 3.1.2): 2.5x the forward.
  if (profile_ && op.flops > 0) {
    const double head_dim = op.n == op.m ? op.k : op.n;  // scores [s x s] = [s x d][d x s]; over V [s x d]
    if (auto rate = profile_->attention_flops_per_second("flash_backward", dtype_, op.batch, op.m, head_dim))
      return op.flops / *rate;
  }
  return 2.5 * kernel_seconds(op);
}

double DeviceModel::memory_bound_backward_seconds(const LayerOp& op) const {
  // The backward kernels' bytes (model.cpp's op constructors) at the measured rate of the row that
  // names them, else at the forward kernel's rate (or the roofline).
  // (A scratch op per thread: assigning reuses its strings' buffers, where a copy allocated three
  // strings per call, 450 k calls in a planner search.)
  thread_local LayerOp bwd;
  bwd = op;
  bwd.memory_bytes = op.backward_memory_bytes();
  bwd.flops = op.backward_only ? op.flops : 2 * op.flops;
  if (!op.backward_only) bwd.kernel = op.backward_kernel.empty() ? op.kernel : op.backward_kernel;
  if (profile_ && !bwd.kernel.empty() && bwd.memory_bytes > 0)
    if (auto bw = profile_->elementwise_bytes_per_second(bwd.kernel, dtype_, bwd.memory_bytes))
      return bwd.memory_bytes / *bw;
  bwd.kernel.clear();  // not measured: the forward family's rate
  return kernel_seconds(bwd);
}

double DeviceModel::roofline_seconds(const LayerOp& op) const {
  const GpuSpec& g = cluster_.gpu;
  double compute = 0;
  const double memory = op.memory_bytes / (g.hbm_bandwidth * g.memory_efficiency);
  if (op.gemm && op.flops > 0) compute = op.flops / (peak_ * clock_ * gemm_efficiency(op.flops));
  return std::max(compute, memory) + g.kernel_launch;
}

double DeviceModel::compute_seconds(const Program& program, const Instruction& inst) const {
  const GpuSpec& g = cluster_.gpu;
  if (inst.ops >= 0 && inst.ops < static_cast<int>(program.op_lists.size())) {
    // The op list holds the forward kernels; the phase says what runs (cf. model.hpp's
    // backward_cost / recompute_cost): backward runs each GEMM twice (input and weight gradient;
    // at the profile's measured dgrad / wgrad rates where it has them) and moves twice the bytes
    // in elementwise kernels; selective recompute re-runs the attention core only.
    double t = 0;
    for (const LayerOp& op : program.op_lists[inst.ops]) {
      switch (inst.op) {
        case Op::Backward:
          if (op.grads_in_forward) break;  // run in the forward (fused linear cross-entropy)
          if (op.host_seconds > 0) {       // host work in series with the kernels (no kernel)
            t += op.host_seconds;
            break;
          }
          if (op.gemm && op.attention_core && flash_attention_) {
            t += flash_backward_seconds(op);
          } else if (op.gemm) {
            t += backward_gemm_seconds(op);
          } else {
            t += memory_bound_backward_seconds(op);
          }
          break;
        case Op::Recompute:
          if (op.backward_only) break;
          if (recompute_ == Recompute::selective_op) {  // the share op-level SAC re-runs
            if (op.in_layer && op.op_sac_recompute > 0) t += op.op_sac_recompute * kernel_seconds(op);
            break;
          }
          if (recompute_ == Recompute::full ? op.in_layer : op.attention_core) t += kernel_seconds(op);
          break;
        default:
          if (!op.backward_only) t += kernel_seconds(op);
          if (op.grads_in_forward && op.gemm) t += backward_gemm_seconds(op);
      }
    }
    return t;
  }
  // No kernel list (optimizer step): a fused multi-tensor kernel, memory-bound in practice. A
  // profile's optimizer_step rows time the engine's whole step sequence over the same bytes (1-bit
  // Adam's compressed phase: its onebit_step rows where measured).
  if (profile_ && inst.op == Op::OptimizerStep && inst.memory_bytes > 0) {
    if (onebit_step_)
      if (auto bw = profile_->elementwise_bytes_per_second("onebit_step", dtype_, inst.memory_bytes))
        return inst.memory_bytes / *bw;
    if (auto bw = profile_->elementwise_bytes_per_second("optimizer_step", dtype_, inst.memory_bytes))
      return inst.memory_bytes / *bw;
  }
  const double memory = inst.memory_bytes / (g.hbm_bandwidth * g.memory_efficiency);
  const double compute = inst.flops / ((cluster_.gpu.peak_flops_32 > 0 ? cluster_.gpu.peak_flops_32 : peak_) * clock_);
  return std::max(memory, compute) + g.kernel_launch;
}

double DeviceModel::collective_local_seconds(const Instruction& inst) const {
  if (inst.memory_bytes <= 0) return 0;
  const char* row = inst.purpose == Purpose::OneBitSigns    ? "onebit_worker"
                    : inst.purpose == Purpose::OneBitServer ? "onebit_server"
                                                            : "onebit_decompress";
  if (profile_)
    if (auto bw = profile_->elementwise_bytes_per_second(row, Dtype::fp32, inst.memory_bytes))
      return inst.memory_bytes / *bw;
  const GpuSpec& g = cluster_.gpu;
  return inst.memory_bytes / (g.hbm_bandwidth * g.memory_efficiency) + g.kernel_launch;
}

double DeviceModel::epilogue_backward_seconds(const LayerOp& op) const {
  // Each plain pass as backward_gemm_seconds prices it without epilogues: the profile's dgrad /
  // wgrad rows where every pass run answers, else the forward GEMM's time.
  const LayerOp plain = plain_gemm(op);
  const auto rate = [&](GemmPass p, const std::string& epilogue) -> std::optional<double> {
    if (!profile_) return std::nullopt;
    return profile_->gemm_flops_per_second(dtype_, op.m, op.n, op.k, op.batch, p, epilogue);
  };
  const auto dgrad = rate(GemmPass::dgrad, ""), wgrad = op.frozen ? std::nullopt : rate(GemmPass::wgrad, "");
  const bool measured = dgrad && (op.frozen || wgrad);
  const double forward = measured ? 0 : kernel_seconds(plain);
  const auto pass = [&](GemmPass p, const std::optional<double>& plain_rate, const std::string& epilogue) {
    if (!epilogue.empty())
      if (auto r = rate(p, epilogue)) return op.flops / *r;
    double t = measured ? op.flops / *plain_rate : forward;
    if (!epilogue.empty()) t += memory_bound_backward_seconds(epilogue_replaced_op(epilogue, op, bytes_of(dtype_)));
    return t;
  };
  return pass(GemmPass::dgrad, dgrad, op.dgrad_epilogue) + (op.frozen ? 0 : pass(GemmPass::wgrad, wgrad, op.wgrad_epilogue));
}

double DeviceModel::backward_gemm_seconds(const LayerOp& op) const {
  if (!op.attention_core && op.has_epilogue()) return epilogue_backward_seconds(op);
  if (profile_ && !op.attention_core)
    if (auto t = profile_->backward_gemm_seconds(op, dtype_)) return *t;
  // Input and weight gradient, each as costly as the forward GEMM (a frozen weight: input only).
  return (op.frozen ? 1 : 2) * kernel_seconds(op);
}

double DeviceModel::host_seconds(const Instruction& inst) const {
  // Measured: the calibration ran adamw_step in one process over all the host's cores; the node's
  // GPUs step at the same time and share them, so each takes gpus_per_node times as long.
  if (profile_ && inst.memory_bytes > 0)
    if (auto bw = profile_->elementwise_bytes_per_second("host_adamw", Dtype::fp32, inst.memory_bytes))
      return inst.memory_bytes / *bw * std::max(1, cluster_.gpus_per_node);
  // DeepSpeed's CPUAdam streams params, grads and moments through host memory; the node's
  // bandwidth is shared by the node's GPUs, which all step at the same time.
  const double per_gpu_bw = cluster_.host_memory_bandwidth / std::max(1, cluster_.gpus_per_node);
  return inst.memory_bytes / per_gpu_bw + nvme_seconds(inst.bytes);
}

double DeviceModel::nvme_seconds(double bytes) const {
  // ZeRO-Infinity's swapping (DeepSpeed's AsyncIO swapper, pipeline_read / pipeline_write off by
  // default): read in, step, write out one after the other; the node's GPUs share its drives.
  if (bytes <= 0 || !(cluster_.nvme_bandwidth > 0)) return 0;
  return bytes / (cluster_.nvme_bandwidth / std::max(1, cluster_.gpus_per_node));
}

double DeviceModel::copy_seconds(const Instruction& inst) const {
  double bus = cluster_.gpu.pcie_latency + inst.bytes / cluster_.gpu.pcie_bandwidth;
  if (profile_ && inst.bytes > 0)
    if (auto bw = profile_->copy_bytes_per_second(inst.op == Op::CopyH2D ? "h2d" : "d2h", inst.bytes))
      bus = inst.bytes / *bw;
  // A parameter fetch from NVMe (memory_bytes: the NVMe read) precedes the copy to the GPU.
  if (inst.op == Op::CopyH2D) return bus + nvme_seconds(inst.memory_bytes);
  if (inst.op != Op::CopyD2H || inst.memory_bytes <= 0) return bus;
  // Offloaded gradients are then summed on the host (memory_bytes of host traffic), the node's
  // GPUs sharing its cores; layer after layer the copies and the sums pipeline, so a layer's share
  // of the offload stream is the slower of the two.
  double host = inst.memory_bytes / (cluster_.host_memory_bandwidth / std::max(1, cluster_.gpus_per_node));
  if (profile_)
    if (auto bw = profile_->elementwise_bytes_per_second("host_accumulate", Dtype::fp32, inst.memory_bytes))
      host = inst.memory_bytes / *bw * std::max(1, cluster_.gpus_per_node);
  return std::max(bus, host);
}

}  // namespace dssim
