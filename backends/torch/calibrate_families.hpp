// The pieces `dssim calibrate`'s families share (calibrate.cpp runs them): the timer, the grid of
// shapes, the row helpers, and each family's entry point. The families: calibrate_gemm.cpp (GEMMs,
// the fused epilogue GEMMs, attention), calibrate_memory.cpp (elementwise and backward kernels, MoE
// routing, the optimizer step), calibrate_host.cpp (host AdamW, host <-> device copies, NCCL
// collectives). Internal to the torch backend.
#pragma once
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <tuple>
#include <vector>
#include "backends/torch/calibrate.hpp"
#include "backends/torch/stopwatch.hpp"
#include "backends/torch/torch_compat.hpp"

#if defined(DSSIM_TORCH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace dssim::tb::calibration {

at::ScalarType scalar_type(Dtype d);

// Times `calls` back-to-back calls: CUDA events around them on the current stream (what the
// kernels themselves take, launch overhead hidden as in training), wall clock on CPUs.
class Timer {
 public:
  explicit Timer(const at::Device& device) : device_(device) {
#if defined(DSSIM_TORCH_CUDA)
    if (device_.is_cuda()) {
      cudaEventCreate(&start_);
      cudaEventCreate(&stop_);
    }
#endif
  }
  ~Timer() {
#if defined(DSSIM_TORCH_CUDA)
    if (device_.is_cuda()) {
      cudaEventDestroy(start_);
      cudaEventDestroy(stop_);
    }
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  double seconds(const std::function<void()>& fn, int calls) {
#if defined(DSSIM_TORCH_CUDA)
    if (device_.is_cuda()) {
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
      cudaEventRecord(start_, stream);
      for (int i = 0; i < calls; ++i) fn();
      cudaEventRecord(stop_, stream);
      cudaEventSynchronize(stop_);
      float ms = 0;
      cudaEventElapsedTime(&ms, start_, stop_);
      return ms * 1e-3;
    }
#endif
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) fn();
    device_synchronize(device_);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // Seconds per call: two warm-up calls, then the median of samples of `inner` calls each, with
  // `inner` chosen so a sample lasts at least ~1 ms (event resolution) and the samples together
  // about `budget` seconds.
  double measure(const std::function<void()>& fn, double budget, int* samples_out = nullptr) {
    fn();
    fn();
    device_synchronize(device_);
    const double one = std::max(seconds(fn, 1), 1e-7);
    const int inner = std::max(1, static_cast<int>(std::ceil(1e-3 / one)));
    const int samples = std::clamp(static_cast<int>(budget / (inner * one)), 3, 15);
    std::vector<double> t;
    for (int i = 0; i < samples; ++i) t.push_back(seconds(fn, inner) / inner);
    std::sort(t.begin(), t.end());
    if (samples_out) *samples_out = samples;
    return t[t.size() / 2];
  }

 private:
  at::Device device_;
#if defined(DSSIM_TORCH_CUDA)
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#endif
};

// An autograd-only kernel: (forward + backward) - forward, each timed with the Timer on its own
// (grad mode on, so the forward saves what training saves), at least kMinBackwardShare of the
// forward + backward time (on tiny CPU shapes the difference can drown in noise; `clamped` says so).
constexpr double kMinBackwardShare = 0.02;

struct AutogradSeconds {
  double forward = 0, backward = 0;
  bool clamped = false;
};

AutogradSeconds autograd_seconds(Timer& timer, const std::function<void()>& forward,
                                 const std::function<void()>& forward_backward, double budget);

std::string first_line(const char* what);

struct Grid {
  std::vector<int> hidden, tokens, tp;
  std::vector<int> seq, head_dim, batch_heads;
  std::vector<int64_t> elements;   // elementwise tensor sizes
  std::vector<int64_t> optimizer;  // parameters of the optimizer step (flat shards)
  std::vector<int64_t> host_adamw; // parameters of the host AdamW (CPU offload)
  std::vector<int64_t> copy_bytes;
  std::vector<int64_t> collective_bytes;
  // Backward-pass kernels besides the GEMMs: layer_norm_backward [T x h], gelu_backward [T x 4h],
  // bias_grad [T x n] for n in {h, 3h, 4h}; cross_entropy(_backward) [T x V]; embedding_backward.
  std::vector<int64_t> bwd_hidden, bwd_tokens;
  std::vector<int64_t> ce_tokens, ce_vocab;
  std::vector<int64_t> emb_vocab, emb_hidden, emb_tokens;
  // MoE routing / dispatch / combine: tokens per micro-batch and rank, hidden, experts.
  std::vector<int64_t> moe_tokens, moe_hidden, moe_experts;
};

struct GemmShape {
  std::string op;
  int64_t m, n, k;
  bool operator<(const GemmShape& o) const { return std::tie(m, n, k) < std::tie(o.m, o.n, o.k); }
};

// Every layer shape of the grid: hidden h split over t TP ranks (h / t whole, at least 16), at
// each token count.
template <class F>
void for_each_layer_shape(const Grid& g, F f) {
  for (int h : g.hidden)
    for (int t : g.tp) {
      if (h % t || h / t < 16) continue;
      for (int tokens : g.tokens) f(int64_t(h), int64_t(t), int64_t(tokens));
    }
}

std::vector<GemmShape> transformer_gemms(const Grid& g);

void say(const CalibrateOptions& o, const std::string& line);
// Appends an `elementwise` row (bytes moved in `seconds`) and returns its bytes/s.
double add_bandwidth_row(DeviceProfile& p, const char* op, Dtype dtype, double bytes, double seconds);
std::string fmt(double v, const char* unit);

// The families (each file's comments say what they measure).
void measure_gemms(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
void measure_epilogue_gemms(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                            DeviceProfile& p);
void measure_attention(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
void measure_attention_backward(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                                DeviceProfile& p);
void measure_elementwise(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
void measure_backward_kernels(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                              DeviceProfile& p);
void measure_moe(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
void measure_optimizer_step(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
void measure_host_adamw(const CalibrateOptions& o, const Grid& g, const at::Device& dev, DeviceProfile& p,
                        const std::string& cpu);
void measure_copies(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p);
#if defined(DSSIM_HAVE_NCCL)
void measure_collectives(const CalibrateOptions& o, const Grid& g, int ngpus, DeviceProfile& p);
#endif

}  // namespace dssim::tb::calibration
