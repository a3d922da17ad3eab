// A measured device profile: what `dssim calibrate` timed on one GPU (or CPU), read by the device
// model in place of the preset efficiency curves. YAML, e.g. profiles/h200.yaml; the format is
// written by to_yaml below and documented in docs/device-profile.md.
//
// Lookup rules (DeviceModel applies them per kernel):
//  - GEMMs: achieved FLOP/s interpolated in log space over (m * batch, n, k): linear in
//    log(FLOP/s) between the bracketing measured coordinates on each axis (exact on table points,
//    monotone between two of them on an axis); a bracketing corner that was not measured is
//    estimated from the nearest measured shapes (inverse distance, log space). A batched GEMM
//    counts as one GEMM of m * batch rows (it fills the GPU as that would).
//  - Fused attention: FLOP/s over (batch * heads, seq_len, head_dim), the same way. FLOPs are
//    counted as dssim's model counts them, 4 * batch * heads * s^2 * head_dim (no causal halving).
//  - Backward GEMMs of a linear layer (dgrad dX = dY W, wgrad dW = dY^T X): rows with `pass`
//    dgrad / wgrad, kept at the forward op's (m, n, k); looked up only among rows of that pass.
//  - Fused attention backward (kernel flash_backward: dQ, dK, dV of the flash kernel via autograd):
//    FLOP/s over the same axes and with the same FLOP count as flash, so flash / flash_backward =
//    backward / forward time.
//  - Elementwise / LayerNorm, host <-> device copies: bytes/s over the bytes moved, log-linear;
//    rows of equal bytes count as one point at the geometric mean of their rates.
//  - Backward-pass kernels (elementwise ops layer_norm_backward, gelu_backward, bias_grad,
//    cross_entropy, cross_entropy_backward, embedding_backward): bytes/s over the byte conventions
//    of BandwidthPoint below; no fallback to add's rows (nullopt when not measured).
//  - The optimizer step (elementwise op optimizer_step: the engine's one-pass fused_adamw_step on
//    16-bit gradients, 30 bytes per parameter; profiles calibrated before issue 15 timed the fold +
//    AdamW + clear + publish sequence over 50) and the host AdamW of CPU offload (host_adamw, 30 bytes per
//    parameter): bytes/s over those byte counts; no fallback to add's rows.
//  - Outside the table: below the smallest measured size on some axis the preset curve applies
//    (nullopt here: launch- and latency-bound territory the table does not cover); above the
//    largest, the largest measured size's value (throughput plateaus with size).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "core/model.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct DeviceProfileMetadata {
  std::string gpu;            // device name as the driver reports it ("NVIDIA H200")
  std::string backend;        // cuda | cpu
  std::string date;           // ISO 8601 UTC, when it was measured
  std::string tool;           // what measured it ("dssim calibrate --backend cuda")
  std::string torch_version;  // libtorch it ran on
  std::string cuda_version;   // CUDA runtime ("13.0"); empty on CPU
  std::string driver_version;
  int gpus = 1;               // devices visible when it ran
  std::string timing;         // "cuda events, median of N after warm-up" ...
  std::vector<std::string> notes;
};

// Which GEMM of a linear layer y[m x n] = x[m x k] W^T (W row-major [n x k]) a row times:
// forward y = x W^T; dgrad dX[m x k] = dY[m x n] W; wgrad dW[n x k] = dY^T[n x m] X[m x k].
// Every row keeps the forward op's (m, n, k), so a lookup is by the forward shape plus the pass;
// the FLOPs are 2 m n k in each.
enum class GemmPass { forward, dgrad, wgrad };
const char* to_string(GemmPass);

struct GemmPoint {            // C[m x n] = A[m x k] B[k x n]
  Dtype dtype = Dtype::bf16;
  double m = 0, n = 0, k = 0;
  GemmPass pass = GemmPass::forward;  // YAML `pass:`, written only when not forward
  // YAML `epilogue:`, written only when set: the GEMM timed with what its epilogue does besides
  // the product (cuBLASLt, as the torch engine runs the block with model.gemm_epilogues): forward
  // gelu_aux_bias (bias + GELU, GELU's input written too) | bias_residual (bias + the residual,
  // beta 1); dgrad dgelu (times GELU's derivative); wgrad bgradb (the bias gradient). "" = the
  // plain GEMM. FLOPs 2 m n k as for plain rows at the forward op's (m, n, k); the epilogue's time
  // is inside the row's seconds. Such rows answer only lookups for that pass and epilogue.
  std::string epilogue;
  double flops_per_second = 0;
  double seconds = 0;         // median per GEMM (informational; flops_per_second is what is used)
  std::string op;             // which transformer GEMM it stands for (qkv, attention_proj, ...), informational
};

struct AttentionPoint {
  // flash (fused, scaled_dot_product_attention) | plain (matmul-softmax-matmul) | flash_backward
  // (the flash kernel's backward, autograd (forward + backward) - forward; FLOPs counted as flash's)
  std::string kernel;
  Dtype dtype = Dtype::bf16;
  double batch_heads = 0, seq_len = 0, head_dim = 0;
  bool causal = true;
  double flops_per_second = 0;  // 4 * batch_heads * s^2 * head_dim / seconds
  double seconds = 0;
};

struct BandwidthPoint {       // memory-bound kernels and copies
  // elementwise: add | gelu | layer_norm | optimizer_step | host_adamw | layer_norm_backward |
  // gelu_backward | bias_grad | cross_entropy | cross_entropy_backward | embedding_backward;
  // copies: h2d | d2h.
  // optimizer_step: the engine's GPU step per parameter (backends/torch/optimizer_kernels.hpp),
  // bytes = 50 per parameter, dtype = the 16-bit dtype of the gradients / published weights.
  // host_adamw: adamw_step on host fp32 tensors writing a bf16 copy, bytes = 30 per parameter
  // (read 16, write 12 + 2), dtype fp32.
  // Backward-pass kernels, e = the dtype's element size, N = the tensor's elements:
  //   layer_norm_backward  (dx, dgain, dbias) of x [T x h]                  bytes = 5 e N
  //   gelu_backward        (tanh) on [T x 4h]                               bytes = 3 e N
  //   bias_grad            dy.sum(0) of dy [T x n]                          bytes = e T n
  //   cross_entropy        forward, 16-bit logits [T x V] cast to fp32      bytes = (e + 16) T V
  //   cross_entropy_backward  its backward, cast back to 16-bit included    bytes = (24 + e) T V
  //   embedding_backward   w [V x h], tokens [T], a fresh weight gradient   bytes = 2 e T h + 2 e V h
  // onebit_step: 1-bit Adam's compressed-phase step on the device, 90 bytes per parameter
  // (backends/torch/optimizer_kernels.hpp kOnebitStepBytesPerParam16), dtype as optimizer_step.
  // onebit_worker / onebit_server / onebit_decompress: 1-bit Adam's compression around its
  // collectives, fp32, bytes = 84 / 40 / 40 per element of the padded momentum (core/program.hpp).
  // MoE (backends/torch/moe.cpp's functions; E experts, C capacity, T tokens):
  //   moe_routing(_backward)  the gate after its inputs: fp32 cast of [T x h], the gate GEMM,
  //                           softmax, top-k, positions, weights, l_aux    bytes = T h (e + 4) + 32 T E
  //   moe_dispatch(_backward) tokens into [E C x h] slots                  bytes = 2 e E C h
  //   moe_combine(_backward)  [E C x h] weighted back to [T x h]           bytes = 2 e E C h
  std::string op;
  Dtype dtype = Dtype::bf16;  // unused for copies
  double bytes = 0;           // bytes read + written (copies: bytes copied)
  double bytes_per_second = 0;
};

struct CollectivePoint {      // nccl-tests definitions: algbw = bytes / time, busbw = algbw * factor
  std::string collective;     // all_reduce | reduce_scatter | all_gather | all_to_all | send_recv
  int ranks = 0;
  double bytes = 0;           // nccl-tests "size": all_gather output, reduce_scatter input
  double seconds = 0;
  double algorithm_bandwidth = 0;
  double bus_bandwidth = 0;
};
// nccl-tests' bus-bandwidth factor: all_reduce 2(n-1)/n, reduce_scatter / all_gather /
// all_to_all (n-1)/n, send_recv 1.
double bus_bandwidth_factor(const std::string& collective, int ranks);

struct DeviceProfile {
  std::string source;         // file it was read from
  DeviceProfileMetadata metadata;
  std::vector<GemmPoint> gemm;
  std::vector<AttentionPoint> attention;
  std::vector<BandwidthPoint> elementwise;
  std::vector<BandwidthPoint> copy;
  std::vector<CollectivePoint> collectives;

  // Achieved FLOP/s of a GEMM C[m x n] = A[m x k] B[k x n] repeated `batch` times; `pass`: which
  // of the linear layer's GEMMs, (m, n, k) being the forward op's; only rows of that pass and that
  // `epilogue` count ("" = plain GEMMs: rows with an epilogue never answer). fp16 and bf16 share
  // the tensor cores' rate: a profile with no rows of one prices it from the other's (attention too).
  std::optional<double> gemm_flops_per_second(Dtype, double m, double n, double k, double batch = 1,
                                              GemmPass pass = GemmPass::forward,
                                              const std::string& epilogue = "") const;
  std::optional<double> attention_flops_per_second(const std::string& kernel, Dtype, double batch_heads,
                                                   double seq_len, double head_dim) const;
  // `op`: an elementwise op of BandwidthPoint. gelu / layer_norm with no rows of their own use
  // add's; every other op uses only its own (nullopt without).
  std::optional<double> elementwise_bytes_per_second(const std::string& op, Dtype, double bytes) const;
  std::optional<double> copy_bytes_per_second(const std::string& direction, double bytes) const;
  std::optional<double> bus_bandwidth(const std::string& collective, int ranks, double bytes) const;

  // Measured time of one forward kernel of a layer (core/model.hpp's LayerOp); nullopt where the
  // table does not cover it (the preset curve applies). `flash`: attention-core GEMMs run as one
  // fused kernel (their FLOPs at the flash rate); the fused-away softmax / dropout give nullopt.
  // A GEMM with an epilogue (LayerOp::epilogue): the rows of that epilogue only.
  std::optional<double> kernel_seconds(const LayerOp&, Dtype, bool flash) const;
  // Measured backward time of a (non-attention-core) GEMM LayerOp given by its forward shape:
  // flops / dgrad rate + flops / wgrad rate (plain rows), when both passes have rows for this dtype
  // and both lookups answer; nullopt otherwise (the caller prices backward as 2x the forward
  // kernel). The op's dgrad / wgrad epilogues are the caller's (DeviceModel::backward_gemm_seconds).
  std::optional<double> backward_gemm_seconds(const LayerOp&, Dtype) const;
  // Measured efficiency (achieved / peak FLOP/s) of a GEMM or attention LayerOp.
  std::optional<double> efficiency(const LayerOp&, Dtype, bool flash, double peak_flops) const;
};

// Parses and validates; throws ConfigError (core/scenario_loader.hpp) naming the file, the key
// (gemm[3].flops_per_second) and its line.
DeviceProfile parse_device_profile(const std::string& yaml, const std::string& source = "<string>");
DeviceProfile load_device_profile(const std::string& path);
// The same file loaded once per process (the estimator builds a DeviceModel per evaluation).
std::shared_ptr<const DeviceProfile> shared_device_profile(const std::string& path);
// cluster.device_profile as written: absolute, else relative to the working directory if it
// exists there, else relative to data_root() (profiles/h200.yaml ships in the source tree).
std::string resolve_device_profile_path(const std::string& path);

std::string to_yaml(const DeviceProfile&);
// A short table for people: per table and kind, rows and the min / median / max rate.
std::string device_profile_summary(const DeviceProfile&);

// `base` with the rows `fresh` measured put in place of base's of the same kind (elementwise and
// copy rows by op, GEMM rows by dtype, pass and epilogue, attention rows by kernel and dtype, collectives by
// name): `dssim calibrate --only moe --merge profiles/h200.yaml` adds a family without
// re-measuring the rest. base's metadata stays, with a note naming what was merged and when.
DeviceProfile merge_device_profile(DeviceProfile base, const DeviceProfile& fresh);

// Which elementwise row family a non-GEMM LayerOp uses: layer_norm, gelu, or add.
std::string elementwise_family(const std::string& op_name);

}  // namespace dssim
