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
//  - Elementwise / LayerNorm, host <-> device copies: bytes/s over the bytes moved, log-linear.
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

struct GemmPoint {            // C[m x n] = A[m x k] B[k x n]
  Dtype dtype = Dtype::bf16;
  double m = 0, n = 0, k = 0;
  double flops_per_second = 0;
  double seconds = 0;         // median per GEMM (informational; flops_per_second is what is used)
  std::string op;             // which transformer GEMM it stands for (qkv, attention_proj, ...), informational
};

struct AttentionPoint {
  std::string kernel;         // flash (fused, scaled_dot_product_attention) | plain (matmul-softmax-matmul)
  Dtype dtype = Dtype::bf16;
  double batch_heads = 0, seq_len = 0, head_dim = 0;
  bool causal = true;
  double flops_per_second = 0;  // 4 * batch_heads * s^2 * head_dim / seconds
  double seconds = 0;
};

struct BandwidthPoint {       // memory-bound kernels and copies
  std::string op;             // elementwise: add | gelu | layer_norm; copies: h2d | d2h
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

  // Achieved FLOP/s of a GEMM C[m x n] = A[m x k] B[k x n] repeated `batch` times.
  std::optional<double> gemm_flops_per_second(Dtype, double m, double n, double k, double batch = 1) const;
  std::optional<double> attention_flops_per_second(const std::string& kernel, Dtype, double batch_heads,
                                                   double seq_len, double head_dim) const;
  // `op`: add | gelu | layer_norm; an op with no rows of its own uses add's.
  std::optional<double> elementwise_bytes_per_second(const std::string& op, Dtype, double bytes) const;
  std::optional<double> copy_bytes_per_second(const std::string& direction, double bytes) const;
  std::optional<double> bus_bandwidth(const std::string& collective, int ranks, double bytes) const;

  // Measured time of one forward kernel of a layer (core/model.hpp's LayerOp); nullopt where the
  // table does not cover it (the preset curve applies). `flash`: attention-core GEMMs run as one
  // fused kernel (their FLOPs at the flash rate); the fused-away softmax / dropout give nullopt.
  std::optional<double> kernel_seconds(const LayerOp&, Dtype, bool flash) const;
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

// Which elementwise row family a non-GEMM LayerOp uses: layer_norm, gelu, or add.
std::string elementwise_family(const std::string& op_name);

}  // namespace dssim
