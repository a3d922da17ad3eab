#include "backends/torch/calibrate.hpp"
#include "backends/torch/fused_cross_entropy.hpp"
#include "backends/torch/gemm_epilogues.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/onebit_adam.hpp"

#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include "backends/torch/optimizer_kernels.hpp"
#include "backends/torch/stopwatch.hpp"
#include "backends/torch/torch_compat.hpp"

#if defined(DSSIM_TORCH_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(DSSIM_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace dssim::tb {
namespace {

at::ScalarType scalar_type(Dtype d) {
  return d == Dtype::fp32 ? at::kFloat : d == Dtype::fp16 ? at::kHalf : at::kBFloat16;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

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
                                 const std::function<void()>& forward_backward, double budget) {
  AutogradSeconds t;
  t.forward = timer.measure(forward, budget);
  const double both = timer.measure(forward_backward, budget);
  t.backward = both - t.forward;
  if (!(t.backward > kMinBackwardShare * both)) {
    t.backward = kMinBackwardShare * both;
    t.clamped = true;
  }
  return t;
}

std::string first_line(const char* what) {
  std::string s = what;
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

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

Grid grid(bool cuda, bool quick) {
  Grid g;
  if (quick) {
    g.hidden = {64, 256};
    g.tokens = {32, 256};
    g.tp = {1, 2};
    g.seq = {32, 128};
    g.head_dim = {16, 64};
    g.batch_heads = {4, 16};
    g.elements = {1 << 10, 1 << 14, 1 << 18};
    g.optimizer = {1 << 12, 1 << 16};
    g.host_adamw = {1 << 12, 1 << 16};
    g.copy_bytes = {1 << 16, 1 << 20};
    g.collective_bytes = {1 << 20, 1 << 24};
    g.bwd_hidden = {64, 256};
    g.bwd_tokens = {32, 256};
    g.ce_tokens = {32, 256};
    g.ce_vocab = {512, 2048};
    g.emb_vocab = {1024};
    g.emb_hidden = {64, 256};
    g.emb_tokens = {32, 256};
    g.moe_tokens = {64, 256};
    g.moe_hidden = {64};
    g.moe_experts = {4};
  } else if (cuda) {
    // Issue 4's ranges: hidden 1024-16384, tokens 512-16384, TP 1-8 (about 550 distinct GEMMs).
    g.hidden = {1024, 2048, 4096, 6144, 8192, 12288, 16384};
    g.tokens = {512, 1024, 2048, 4096, 8192, 16384};
    g.tp = {1, 2, 4, 8};
    g.seq = {512, 1024, 2048, 4096, 8192, 16384};
    g.head_dim = {64, 128};
    g.batch_heads = {8, 32, 128};
    for (int e = 16; e <= 28; e += 2) g.elements.push_back(int64_t(1) << e);
    // Shards of 4M .. 512M parameters (0.2 .. 27 GB of step traffic); the host: 4M .. 128M.
    for (int e = 22; e <= 28; e += 2) g.optimizer.push_back(int64_t(1) << e);
    g.optimizer.push_back(int64_t(1) << 29);
    // The host step up to 1G parameters (18 GB of host tensors): an offloaded 7B shard's arrays
    // are 27 GB each, far from any cache (and the rate of the largest size applies above it).
    for (int e = 22; e <= 30; ++e) g.host_adamw.push_back(int64_t(1) << e);
    for (int e = 16; e <= 30; e += 2) g.copy_bytes.push_back(int64_t(1) << e);
    for (int e = 16; e <= 30; e += 2) g.collective_bytes.push_back(int64_t(1) << e);
    // The transformer's widths at 4K-32K tokens: up to 32768 x 32768 (gelu_backward, 6.4 GB) and
    // 32768 x 51200 logits (cross-entropy: fp32 [T x V] tensors of 6.7 GB, ~30 GB at its peak).
    g.bwd_hidden = {1024, 2048, 4096, 8192};
    g.bwd_tokens = {4096, 16384, 32768};
    g.ce_tokens = {4096, 16384, 32768};
    g.ce_vocab = {32000, 51200};
    g.emb_vocab = {51200};
    g.emb_hidden = {1024, 2048, 4096};
    g.emb_tokens = {4096, 16384};
    g.moe_tokens = {4096, 16384, 32768};
    g.moe_hidden = {1024, 4096};
    g.moe_experts = {8, 64};
  } else {  // a full CPU calibration: small transformer sizes
    g.hidden = {256, 512, 1024, 2048};
    g.tokens = {128, 512, 2048};
    g.tp = {1, 2, 4};
    g.seq = {128, 512, 1024};
    g.head_dim = {64};
    g.batch_heads = {4, 16};
    for (int e = 12; e <= 24; e += 3) g.elements.push_back(int64_t(1) << e);
    for (int e = 16; e <= 22; e += 2) g.optimizer.push_back(int64_t(1) << e);
    for (int e = 16; e <= 24; e += 2) g.host_adamw.push_back(int64_t(1) << e);
    g.bwd_hidden = {256, 1024};
    g.bwd_tokens = {512, 2048};
    g.ce_tokens = {512, 2048};
    g.ce_vocab = {8192};
    g.emb_vocab = {8192};
    g.emb_hidden = {256, 1024};
    g.emb_tokens = {512, 2048};
    g.moe_tokens = {512, 2048};
    g.moe_hidden = {256};
    g.moe_experts = {8};
  }
  return g;
}

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

std::vector<GemmShape> transformer_gemms(const Grid& g) {
  std::set<GemmShape> shapes;  // distinct (m, n, k); the first op that asks for one names it
  for_each_layer_shape(g, [&](int64_t h, int64_t t, int64_t tokens) {
    shapes.insert({"qkv", tokens, 3 * h / t, h});
    shapes.insert({"attention_proj", tokens, h, h / t});
    shapes.insert({"mlp_up", tokens, 4 * h / t, h});
    shapes.insert({"mlp_down", tokens, h, 4 * h / t});
  });
  return {shapes.begin(), shapes.end()};
}

void say(const CalibrateOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

// Appends an `elementwise` row (bytes moved in `seconds`) and returns its bytes/s.
double add_bandwidth_row(DeviceProfile& p, const char* op, Dtype dtype, double bytes, double seconds) {
  BandwidthPoint r;
  r.op = op;
  r.dtype = dtype;
  r.bytes = bytes;
  r.bytes_per_second = bytes / seconds;
  p.elementwise.push_back(r);
  return r.bytes_per_second;
}

std::string fmt(double v, const char* unit) {
  std::ostringstream s;
  s.precision(4);
  s << v << " " << unit;
  return s.str();
}

// Per shape (m tokens, n out, k in) the three GEMMs of a linear layer, as PyTorch runs them:
//   forward y[m x n] = x[m x k] W^T     at::mm_out(y, x, w.t())   (W row-major [n x k])
//   dgrad   dX[m x k] = dY[m x n] W     at::mm_out(dx, dy, w)
//   wgrad   dW[n x k] = dY^T[n x m] X   at::mm_out(dw, dy.t(), x)
// All three rows keep the forward (m, n, k); each does 2mnk FLOPs. The backward passes get half
// the timing budget of a point (about 470 shapes on the full cuda grid: they stay within ~30 s).
void measure_gemms(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  const auto shapes = transformer_gemms(g);
  const double backward_budget = o.seconds_per_point / 2;
  for (Dtype dtype : o.dtypes) {
    const auto t0 = Clock::now();
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    double best[3] = {0, 0, 0};
    double forward_seconds = 0;
    std::vector<double> ratio;  // (dgrad + wgrad) / (2 forward) per shape
    for (const auto& s : shapes) {
      auto record = [&](GemmPass pass, double sec) {
        GemmPoint pt;
        pt.op = s.op;
        pt.dtype = dtype;
        pt.pass = pass;
        pt.m = double(s.m), pt.n = double(s.n), pt.k = double(s.k);
        pt.seconds = sec;
        pt.flops_per_second = 2.0 * pt.m * pt.n * pt.k / sec;
        double& b = best[static_cast<int>(pass)];
        b = std::max(b, pt.flops_per_second);
        p.gemm.push_back(pt);
      };
      // y = x W^T, as a linear layer runs it (cuBLAS picks its kernel for the transposed operand).
      at::Tensor x = at::randn({s.m, s.k}, opts), w = at::randn({s.n, s.k}, opts), y = at::empty({s.m, s.n}, opts);
      at::Tensor wt = w.t();
      const auto tf = Clock::now();
      const double fwd = timer.measure([&] { at::mm_out(y, x, wt); }, o.seconds_per_point);
      forward_seconds += seconds_since(tf);
      record(GemmPass::forward, fwd);
      // Backward of the same layer; the forward's output stands in for dY.
      at::Tensor dx = at::empty({s.m, s.k}, opts), dw = at::empty({s.n, s.k}, opts);
      at::Tensor dyt = y.t();
      const double dgrad = timer.measure([&] { at::mm_out(dx, y, w); }, backward_budget);
      record(GemmPass::dgrad, dgrad);
      const double wgrad = timer.measure([&] { at::mm_out(dw, dyt, x); }, backward_budget);
      record(GemmPass::wgrad, wgrad);
      ratio.push_back((dgrad + wgrad) / (2 * fwd));
    }
    std::sort(ratio.begin(), ratio.end());
    const double total = seconds_since(t0);
    say(o, "gemm " + std::string(to_string(dtype)) + ": " + std::to_string(shapes.size()) + " shapes, best " +
               fmt(best[0] / 1e12, "TFLOP/s") + " (" + fmt(forward_seconds, "s") + ")");
    say(o, "gemm " + std::string(to_string(dtype)) + " backward (dgrad dX = dY W, wgrad dW = dY^T X): best " +
               fmt(best[1] / 1e12, "TFLOP/s") + " dgrad, " + fmt(best[2] / 1e12, "TFLOP/s") +
               " wgrad; (dgrad + wgrad) / 2 forward: median " + fmt(ratio.empty() ? 0.0 : ratio[ratio.size() / 2], "") +
               "(" + fmt(total - forward_seconds, "s") + ")");
  }
}

// The fused block's GEMMs as dssim's engine runs them on GPUs (gemm_epilogues.hpp), one row per
// GEMM at the forward op's (m, n, k) with its pass and epilogue, FLOPs 2 m n k (the epilogue's work
// is inside the row's time):
//   mlp_up          forward gelu_aux_bias   pre = x W1^T + b1, m = gelu(pre)
//   mlp_down        forward bias_residual   out = m W2^T + b2 + residual;  dgrad dgelu (dpre = (dy W2) gelu'(pre))
//   attention_proj  forward bias_residual
//   every linear    wgrad bgradb            dW = dy^T x, db = sum(dy)
// On the gemm family's grid of shapes. Where the first GEMM would not run fused (a CPU, fp32, a
// build without cuBLASLt, DSSIM_GEMM_EPILOGUES=0) the family records nothing and says why.
void measure_epilogue_gemms(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                            DeviceProfile& p) {
  struct Shape {
    std::string op, epilogue;
    GemmPass pass;
    int64_t m, n, k;
    bool operator<(const Shape& x) const {
      return std::tie(epilogue, pass, m, n, k) < std::tie(x.epilogue, x.pass, x.m, x.n, x.k);
    }
  };
  std::set<Shape> shapes;  // distinct (epilogue, pass, m, n, k); the first op that asks names it
  for_each_layer_shape(g, [&](int64_t h, int64_t t, int64_t T) {
    shapes.insert({"mlp_up", "gelu_aux_bias", GemmPass::forward, T, 4 * h / t, h});
    shapes.insert({"mlp_down", "bias_residual", GemmPass::forward, T, h, 4 * h / t});
    shapes.insert({"attention_proj", "bias_residual", GemmPass::forward, T, h, h / t});
    shapes.insert({"mlp_down", "dgelu", GemmPass::dgrad, T, h, 4 * h / t});
    shapes.insert({"qkv", "bgradb", GemmPass::wgrad, T, 3 * h / t, h});
    shapes.insert({"attention_proj", "bgradb", GemmPass::wgrad, T, h, h / t});
    shapes.insert({"mlp_up", "bgradb", GemmPass::wgrad, T, 4 * h / t, h});
    shapes.insert({"mlp_down", "bgradb", GemmPass::wgrad, T, h, 4 * h / t});
  });
  for (Dtype dtype : o.dtypes) {
    if (dtype == Dtype::fp32) continue;  // the engine fuses 16-bit GEMMs only
    const auto t0 = Clock::now();
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    int rows = 0;
    std::string refused;
    for (const auto& s : shapes) {
      // Forward operands x [m x k], W [n x k]; the backward's dy [m x n]. Each GEMM runs once
      // before timing: false means it would not run fused.
      at::Tensor x = at::randn({s.m, s.k}, opts), w = at::randn({s.n, s.k}, opts), b = at::randn({s.n}, opts);
      std::function<bool()> gemm;
      at::Tensor out, aux, dw, db;
      if (s.epilogue == "gelu_aux_bias") {
        out = at::empty({s.m, s.n}, opts), aux = at::empty({s.m, s.n}, opts);
        gemm = [&] { return gemm_gelu_aux_bias(x, w, b, out, aux); };
      } else if (s.epilogue == "bias_residual") {
        out = at::empty({s.m, s.n}, opts), aux = at::randn({s.m, s.n}, opts);
        gemm = [&] { return gemm_bias_residual(x, w, b, aux, out); };
      } else if (s.epilogue == "dgelu") {
        out = at::randn({s.m, s.n}, opts), aux = at::randn({s.m, s.k}, opts), dw = at::empty({s.m, s.k}, opts);
        gemm = [&] { return gemm_dgelu(out, w, aux, dw); };
      } else {
        out = at::randn({s.m, s.n}, opts), dw = at::empty({s.n, s.k}, opts), db = at::empty({s.n}, opts);
        gemm = [&] { return gemm_bgradb(out, x, dw, db); };
      }
      if (!gemm()) {
        refused = s.op + " " + s.epilogue + " at m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                  std::to_string(s.k);
        if (rows == 0) break;  // nothing fuses here
        continue;
      }
      GemmPoint pt;
      pt.op = s.op;
      pt.dtype = dtype;
      pt.pass = s.pass;
      pt.epilogue = s.epilogue;
      pt.m = double(s.m), pt.n = double(s.n), pt.k = double(s.k);
      pt.seconds = timer.measure([&] { gemm(); }, s.pass == GemmPass::forward ? o.seconds_per_point : o.seconds_per_point / 2);
      pt.flops_per_second = 2.0 * pt.m * pt.n * pt.k / pt.seconds;
      p.gemm.push_back(pt);
      ++rows;
    }
    const std::string d = to_string(dtype);
    if (rows == 0) {
      const std::string why = gemm_epilogues_mode().empty() ? "this dssim has no cuBLASLt epilogues (a CUDA libtorch and the CUDA toolkit at build time)"
                              : gemm_epilogues_mode() == "off"    ? "DSSIM_GEMM_EPILOGUES=0"
                                                                  : "not run fused on this device (" + refused + ")";
      p.metadata.notes.push_back("epilogue GEMMs " + d + ": not measured (" + why + ")");
      say(o, "epilogue gemm " + d + ": skipped (" + why + ")");
      continue;
    }
    if (!refused.empty()) p.metadata.notes.push_back("epilogue GEMMs " + d + ": cuBLASLt refused " + refused + " (and possibly others)");
    say(o, "epilogue gemm " + d + ": " + std::to_string(rows) + " GEMMs with bias / GELU / residual / bias-gradient epilogues (" +
               fmt(seconds_since(t0), "s") + ")");
  }
}

at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const double scale = 1.0 / std::sqrt(double(q.size(-1)));
  auto scores = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  scores.masked_fill_(mask, -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(scores, -1), v);
}

void measure_attention(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  const bool sdpa = flash_attention_available();
  for (Dtype dtype : o.dtypes) {
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    int flash_points = 0, plain_points = 0;
    for (int bh : g.batch_heads)
      for (int s : g.seq)
        for (int d : g.head_dim) {
          at::Tensor q = at::randn({1, bh, s, d}, opts), k = at::randn({1, bh, s, d}, opts), v = at::randn({1, bh, s, d}, opts);
          const double flops = 4.0 * bh * double(s) * s * d;  // dssim's count: both GEMMs, no causal halving
          auto record = [&](const char* kernel, double sec) {
            AttentionPoint a;
            a.kernel = kernel;
            a.dtype = dtype;
            a.batch_heads = bh, a.seq_len = s, a.head_dim = d;
            a.causal = true;
            a.seconds = sec;
            a.flops_per_second = flops / sec;
            p.attention.push_back(a);
          };
          if (sdpa) {
            record("flash", timer.measure([&] { causal_attention(q, k, v); }, o.seconds_per_point));
            ++flash_points;
          }
          // The unfused composition materializes bh x s x s scores (several copies): keep it small.
          if (double(bh) * s * s <= (dev.is_cuda() ? 1.5e9 : 3e7)) {
            at::Tensor mask = at::ones({s, s}, opts.dtype(at::kBool)).triu_(1);
            record("plain", timer.measure([&] { plain_attention(q, k, v, mask); }, o.seconds_per_point));
            ++plain_points;
          }
        }
    say(o, "attention " + std::string(to_string(dtype)) + ": " + std::to_string(flash_points) + " flash (scaled_dot_product_attention), " +
               std::to_string(plain_points) + " plain");
  }
  if (!sdpa)
    p.metadata.notes.push_back("libtorch " + std::string(TORCH_VERSION) +
                               " has no scaled_dot_product_attention: attention measured as matmul-softmax-matmul (plain) only");
}

// Backward of the flash rows' kernel: the same causal at::scaled_dot_product_attention call on the
// same (batch_heads, seq_len, head_dim) grid, its backward (dQ, dK, dV via autograd) timed as
// (forward + backward) - forward. Rows `flash_backward`, FLOP/s = 4 bh s^2 d / backward seconds:
// the forward rows' FLOP count, so flash rate / flash_backward rate = backward / forward time.
// Only where the flash rows are measured (libtorch >= 2.0).
void measure_attention_backward(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                                DeviceProfile& p) {
  if (!flash_attention_available()) return;  // measure_attention's note says why
  const double budget = o.seconds_per_point / 2;
  at::AutoGradMode enable_grad(true);
  for (Dtype dtype : o.dtypes) {
    const auto t0 = Clock::now();
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    std::vector<double> ratio;  // backward / forward time
    int clamped = 0;
    std::string failed;
    try {
      for (int bh : g.batch_heads)
        for (int s : g.seq)
          for (int d : g.head_dim) {
            at::Tensor q = at::randn({1, bh, s, d}, opts).requires_grad_(true);
            at::Tensor k = at::randn({1, bh, s, d}, opts).requires_grad_(true);
            at::Tensor v = at::randn({1, bh, s, d}, opts).requires_grad_(true);
            at::Tensor dout = at::randn({1, bh, s, d}, opts);
            const auto t = autograd_seconds(
                timer, [&] { (void)causal_attention(q, k, v); },
                [&] {
                  at::Tensor out = causal_attention(q, k, v);
                  (void)torch::autograd::grad({out}, {q, k, v}, {dout});
                },
                budget);
            AttentionPoint a;
            a.kernel = "flash_backward";
            a.dtype = dtype;
            a.batch_heads = bh, a.seq_len = s, a.head_dim = d;
            a.causal = true;
            a.seconds = t.backward;
            a.flops_per_second = 4.0 * bh * double(s) * s * d / t.backward;
            p.attention.push_back(a);
            ratio.push_back(t.backward / t.forward);
            clamped += t.clamped;
          }
    } catch (const std::exception& err) {
      failed = first_line(err.what());
    }
    const std::string name = "attention " + std::string(to_string(dtype)) + " flash_backward";
    if (!failed.empty()) p.metadata.notes.push_back(name + ": stopped after " + std::to_string(ratio.size()) + " points: " + failed);
    if (clamped)
      p.metadata.notes.push_back(name + ": " + std::to_string(clamped) + " points clamped at 2% of forward + backward (noise)");
    std::sort(ratio.begin(), ratio.end());
    say(o, name + " (autograd dQ, dK, dV: forward + backward - forward): " + std::to_string(ratio.size()) +
               " points, backward / forward time: median " + fmt(ratio.empty() ? 0.0 : ratio[ratio.size() / 2], "x") +
               (failed.empty() ? "" : ", FAILED: " + failed) + " (" + fmt(seconds_since(t0), "s") + ")");
  }
}

void measure_elementwise(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  for (Dtype dtype : o.dtypes) {
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    const double e = bytes_of(dtype);
    double best = 0;
    for (int64_t n : g.elements) {
      at::Tensor a = at::randn({n}, opts), b = at::randn({n}, opts), c = at::empty({n}, opts);
      auto record = [&](const char* op, double bytes, double sec) {
        best = std::max(best, add_bandwidth_row(p, op, dtype, bytes, sec));
      };
      record("add", 3 * e * n, timer.measure([&] { at::add_out(c, a, b); }, o.seconds_per_point));
      record("gelu", 2 * e * n, timer.measure([&] { (void)at::gelu(a); }, o.seconds_per_point));
      const int64_t h = std::min<int64_t>(n, o.quick ? 256 : 4096);
      at::Tensor x = a.view({n / h, h}), gain = at::ones({h}, opts), bias = at::zeros({h}, opts);
      record("layer_norm", 2 * e * n + 2 * e * h,
             timer.measure([&] { (void)at::layer_norm(x, {h}, gain, bias, 1e-5, true); }, o.seconds_per_point));
    }
    say(o, "elementwise " + std::string(to_string(dtype)) + ": add, gelu, layer_norm over " + std::to_string(g.elements.size()) +
               " sizes, best " + fmt(best / 1e9, "GB/s"));
  }
}

// The backward pass's kernels other than the GEMMs and attention, as the engine runs them
// (PyTorch ops on the device, back to back). `elementwise` rows of each calibrated dtype, bytes by
// the simulator's conventions (e = the dtype's element size, N = T x width):
//   layer_norm_backward     at::native_layer_norm_backward (dx, dgain, dbias) of x [T x h]  5 e N
//   gelu_backward           at::gelu_backward(dy, x, "tanh") on [T x 4h]                    3 e N
//   bias_grad               dy.sum(0) of dy [T x n], n in {h, 3h, 4h} (a linear's bias)      e T n
//   cross_entropy           the engine's loss, cross_entropy_loss(logits.view(-1, V).to(fp32), targets),
//                           forward, logits [T x V] of the dtype requiring grad               (e + 16) T V
//   cross_entropy_backward  its autograd backward, the cast back to the dtype included       (24 + e) T V
//   embedding_backward      autograd backward of at::embedding(w [V x h], tokens [T]) into a fresh
//                           gradient (no .grad allocated before)                             2 e T h + 2 e V h
// The autograd ones are (forward + backward) - forward (autograd_seconds); each timing gets half
// the --seconds-per-point budget.
void measure_backward_kernels(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer,
                              DeviceProfile& p) {
  const double budget = o.seconds_per_point / 2;
  for (Dtype dtype : o.dtypes) {
    const auto t0 = Clock::now();
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    const auto longs = opts.dtype(at::kLong);
    const double e = bytes_of(dtype);
    const std::string dt = to_string(dtype);
    std::vector<std::string> order;
    std::map<std::string, std::pair<int, double>> made;  // op -> rows, best bytes/s
    int clamped = 0;
    auto record = [&](const char* op, double bytes, double sec) {
      const double rate = add_bandwidth_row(p, op, dtype, bytes, sec);
      if (!made.count(op)) order.push_back(op);
      auto& m = made[op];
      ++m.first;
      m.second = std::max(m.second, rate);
    };
    // One kernel family; a failure (a kernel this libtorch lacks for the dtype, out of memory)
    // keeps the rows measured so far and becomes a note, not the end of the calibration.
    std::vector<std::string> failures;
    auto family = [&](const char* op, const std::function<void()>& body) {
      try {
        body();
      } catch (const std::exception& err) {
        failures.push_back(std::string(op) + ": " + first_line(err.what()));
        p.metadata.notes.push_back(std::string(op) + " " + dt + ": not (fully) measured: " + first_line(err.what()));
      }
    };

    family("layer_norm_backward", [&] {
      for (int64_t h : g.bwd_hidden)
        for (int64_t t : g.bwd_tokens) {
          const std::vector<int64_t> shape{h};
          at::Tensor x = at::randn({t, h}, opts), dy = at::randn({t, h}, opts);
          at::Tensor gain = at::ones({h}, opts), bias = at::zeros({h}, opts);
          const auto stats = at::native_layer_norm(x, shape, gain, bias, 1e-5);
          const at::Tensor mean = std::get<1>(stats), rstd = std::get<2>(stats);
          record("layer_norm_backward", 5 * e * double(t) * h, timer.measure([&] {
            (void)at::native_layer_norm_backward(dy, x, shape, mean, rstd, gain, bias, std::array<bool, 3>{{true, true, true}});
          }, budget));
        }
    });
    family("gelu_backward", [&] {
      for (int64_t h : g.bwd_hidden)
        for (int64_t t : g.bwd_tokens) {
          at::Tensor x = at::randn({t, 4 * h}, opts), dy = at::randn({t, 4 * h}, opts);
          record("gelu_backward", 3 * e * double(t) * 4 * h,
                 timer.measure([&] { (void)at::gelu_backward(dy, x, "tanh"); }, budget));
        }
    });
    family("attention_layout_copies", [&] {
      // The copies autograd makes around the attention core (gpt.cpp's block): dq, dk, dv stacked
      // by unbind's backward, that [3, B, a, S, d] gradient permuted back and made contiguous for
      // the QKV linear, the output's gradient made contiguous for the attention backward.
      // Bytes 2 e x 7 T h (core/model.cpp's attention_layout_copies op).
      for (int64_t h : g.bwd_hidden)
        for (int64_t t : g.bwd_tokens) {
          const int64_t s = std::min<int64_t>(t, 2048), b = t / s, d = std::min<int64_t>(h, 128), a = h / d;
          at::Tensor dq = at::randn({b, a, s, d}, opts), dk = at::randn({b, a, s, d}, opts),
                     dv = at::randn({b, a, s, d}, opts), dout = at::randn({b, s, a, d}, opts);
          record("attention_layout_copies", 2 * e * 7 * double(t) * h, timer.measure([&] {
            (void)at::stack({dq, dk, dv}, 0).permute({1, 3, 0, 2, 4}).contiguous();
            (void)dout.transpose(1, 2).contiguous();
          }, budget));
        }
    });
    family("bias_grad", [&] {
      std::set<std::pair<int64_t, int64_t>> shapes;  // (T, n): 4h of h = 1024 is h of 4096
      for (int64_t h : g.bwd_hidden)
        for (int64_t t : g.bwd_tokens)
          for (int64_t n : {h, 3 * h, 4 * h}) shapes.insert({t, n});
      for (const auto& [t, n] : shapes) {
        at::Tensor dy = at::randn({t, n}, opts);
        record("bias_grad", e * double(t) * n, timer.measure([&] { (void)dy.sum(0); }, budget));
      }
    });
    family("cross_entropy", [&] {
      at::AutoGradMode enable_grad(true);
      for (int64_t t : g.ce_tokens)
        for (int64_t v : g.ce_vocab) {
          at::Tensor logits = at::randn({t, v}, opts).requires_grad_(true);
          at::Tensor targets = at::empty({t}, longs).random_(0, v);
          auto loss = [&] { return at::cross_entropy_loss(logits.view({-1, v}).to(at::kFloat), targets); };
          const auto s = autograd_seconds(
              timer, [&] { (void)loss(); },
              [&] {
                at::Tensor l = loss();
                (void)torch::autograd::grad({l}, {logits});
              },
              budget);
          record("cross_entropy", (e + 16) * double(t) * v, s.forward);
          record("cross_entropy_backward", (24 + e) * double(t) * v, s.backward);
          clamped += s.clamped;
        }
    });
    family("fused_cross_entropy", [&] {
      // The fused linear cross-entropy's elementwise core on one chunk (fused_cross_entropy.hpp
      // cross_entropy_chunk: softmax into fp32, the one-hot subtracted, scaled and cast back).
      for (int64_t t : g.ce_tokens)
        for (int64_t v : g.ce_vocab) {
          const int64_t c = fused_cross_entropy_chunk_tokens(t, v);
          at::Tensor logits = at::randn({c, v}, opts);
          at::Tensor targets = at::empty({c}, longs).random_(0, v);
          record("fused_cross_entropy", (8 + 2 * e) * double(c) * v,
                 timer.measure([&] { (void)cross_entropy_chunk(logits, targets, 1.0 / double(t)); }, budget));
        }
    });
    family("embedding_backward", [&] {
      at::AutoGradMode enable_grad(true);
      for (int64_t v : g.emb_vocab)
        for (int64_t h : g.emb_hidden)
          for (int64_t t : g.emb_tokens) {
            at::Tensor w = at::randn({v, h}, opts).requires_grad_(true);
            at::Tensor tokens = at::empty({t}, longs).random_(0, v);
            at::Tensor dy = at::randn({t, h}, opts);
            const auto s = autograd_seconds(
                timer, [&] { (void)at::embedding(w, tokens); },
                [&] {
                  at::Tensor y = at::embedding(w, tokens);
                  (void)torch::autograd::grad({y}, {w}, {dy});
                },
                budget);
            record("embedding_backward", 2 * e * double(t) * h + 2 * e * double(v) * h, s.backward);
            clamped += s.clamped;
          }
    });

    if (clamped)
      p.metadata.notes.push_back("backward kernels " + dt + ": " + std::to_string(clamped) +
                                 " autograd rows clamped at 2% of forward + backward (noise)");
    std::string line = "elementwise " + dt + " backward kernels:";
    for (size_t i = 0; i < order.size(); ++i)
      line += (i ? ", " : " ") + order[i] + " " + std::to_string(made[order[i]].first) + " up to " +
              fmt(made[order[i]].second / 1e9, "GB/s");
    for (const auto& f : failures) line += "; FAILED " + f;
    say(o, line + " (" + fmt(seconds_since(t0), "s") + ")");
  }
}

// MoE's memory-bound work as the engine runs it (backends/torch/moe.cpp): the gate after the
// token cast (moe_gate: fp32 logits, softmax, top-2 with capacity factor 1.25, positions, weights,
// l_aux), the dispatch into [E C x h] slots and the combine back, each forward and (autograd,
// (forward + backward) - forward) backward. Rows moe_routing(_backward), moe_dispatch(_backward),
// moe_combine(_backward); byte conventions in core/device_profile.hpp.
void measure_moe(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  const double budget = o.seconds_per_point / 2;
  for (Dtype dtype : o.dtypes) {
    const auto t0 = Clock::now();
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(dev);
    const double e = bytes_of(dtype);
    int rows = 0;
    try {
      at::AutoGradMode enable_grad(true);
      for (int64_t tokens : g.moe_tokens)
        for (int64_t h : g.moe_hidden)
          for (int64_t experts : g.moe_experts) {
            ModelSpec m;
            m.hidden = int(h);
            m.experts = int(experts);
            m.top_k = 2;
            m.capacity_factor = 1.25;
            at::Tensor x = at::randn({tokens, h}, opts).requires_grad_(true);
            at::Tensor w = (at::randn({experts, h}, opts) * 0.02).requires_grad_(true);
            at::Generator gen = seeded_generator(dev, 1234);
            const double routing_bytes = double(tokens) * h * (e + 4) + 32.0 * double(tokens) * experts;
            const auto route = autograd_seconds(
                timer, [&] { (void)moe_gate(x, w, m, gen); },
                [&] {
                  Routing r = moe_gate(x, w, m, gen);
                  (void)torch::autograd::grad({r.weight.sum() + r.l_aux}, {x, w});
                },
                budget);
            add_bandwidth_row(p, "moe_routing", dtype, routing_bytes, route.forward);
            add_bandwidth_row(p, "moe_routing_backward", dtype, routing_bytes, route.backward);
            const Routing r = [&] {
              at::NoGradGuard ng;
              return moe_gate(x.detach(), w.detach(), m, gen);
            }();
            const double slots = double(experts) * double(r.capacity);
            const double copy_bytes = 2 * e * slots * h;
            at::Tensor back = at::randn({int64_t(slots), h}, opts).requires_grad_(true);
            const auto dispatch = autograd_seconds(
                timer, [&] { (void)moe_dispatch(x, r, experts); },
                [&] { (void)torch::autograd::grad({moe_dispatch(x, r, experts).sum()}, {x}); }, budget);
            const auto combine = autograd_seconds(
                timer, [&] { (void)moe_combine(back, r); },
                [&] { (void)torch::autograd::grad({moe_combine(back, r).sum()}, {back}); }, budget);
            add_bandwidth_row(p, "moe_dispatch", dtype, copy_bytes, dispatch.forward);
            add_bandwidth_row(p, "moe_dispatch_backward", dtype, copy_bytes, dispatch.backward);
            add_bandwidth_row(p, "moe_combine", dtype, copy_bytes, combine.forward);
            add_bandwidth_row(p, "moe_combine_backward", dtype, copy_bytes, combine.backward);
            rows += 6;
          }
    } catch (const std::exception& err) {
      p.metadata.notes.push_back("moe " + std::string(to_string(dtype)) + ": not (fully) measured: " + first_line(err.what()));
    }
    say(o, "moe " + std::string(to_string(dtype)) + ": " + std::to_string(rows) +
               " rows of routing, dispatch and combine, forward and backward (" + fmt(seconds_since(t0), "s") + ")");
  }
}

// The engine's optimizer step, per parameter of a flat shard (backends/torch/optimizer_kernels.hpp):
// fused_adamw_step on 16-bit gradients, writing the 16-bit copy and clearing the gradients. Rows
// `optimizer_step`, bytes = kStepBytesPerParam16 (30) x N. The 16-bit dtype is each 16-bit
// calibrated dtype (bf16 when only fp32 is calibrated). Moments and gradients start at zero: the
// timing does not depend on the values, and decaying moments cannot turn denormal (slow on CPUs).
// The 1-bit rows time its compressed step as the engine runs it (fold into fp32 first).
void measure_optimizer_step(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  std::vector<Dtype> half;
  for (Dtype d : o.dtypes)
    if (d != Dtype::fp32) half.push_back(d);
  if (half.empty()) half.push_back(Dtype::bf16);
  const AdamWHyper h;
  for (Dtype dtype : half) {
    const auto t0 = Clock::now();
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
    const auto f16 = f32.dtype(scalar_type(dtype));
    double best = 0, onebit_best = 0;
    for (int64_t n : g.optimizer) {
      at::Tensor p32 = at::randn({n}, f32), g32 = at::zeros({n}, f32), m = at::zeros({n}, f32), v = at::zeros({n}, f32);
      at::Tensor p16 = at::empty({n}, f16), g16 = at::zeros({n}, f16);
      at::Tensor step_tensor;
      int64_t step = 0;
      const double sec = timer.measure([&] {
        fused_adamw_step(p32, g16, m, v, ++step, h, 1.0, 1.0, p16, /*clear_grad=*/true, &step_tensor);
      }, o.seconds_per_point);
      best = std::max(best, add_bandwidth_row(p, "optimizer_step", dtype, kStepBytesPerParam16 * double(n), sec));
      // 1-bit Adam's compressed-phase step, as the engine runs it on one rank.
      OnebitAdam onebit(n, nullptr, 1, f32);
      const double one = timer.measure([&] {
        g32.add_(g16);
        g16.zero_();
        onebit.update_momentum(m, g32, h.beta1);
        g32.zero_();
        onebit.step(p32, m, v, ++step, h);
        p16.copy_(p32);
      }, o.seconds_per_point);
      onebit_best = std::max(onebit_best, add_bandwidth_row(p, "onebit_step", dtype, kOnebitStepBytesPerParam16 * double(n), one));
      if (dtype == half.front()) {  // its compression (fp32, once): the local work of the collectives
        const double pn = double(onebit.padded_numel());
        at::Tensor scale, server_scale;
        const at::Tensor scales = at::ones({1}, f32);
        at::Tensor packed = onebit.compress_worker(m, scale);
        const double w = timer.measure([&] { packed = onebit.compress_worker(m, scale); }, o.seconds_per_point);
        at::Tensor spacked;
        const double sv = timer.measure([&] { spacked = onebit.compress_server(packed, scales, server_scale); }, o.seconds_per_point);
        const double d = timer.measure([&] { onebit.decompress(packed, scales, m); }, o.seconds_per_point);
        add_bandwidth_row(p, "onebit_worker", Dtype::fp32, kOnebitWorkerBytesPerElement * pn, w);
        add_bandwidth_row(p, "onebit_server", Dtype::fp32, kOnebitServerBytesPerElement * pn, sv);
        add_bandwidth_row(p, "onebit_decompress", Dtype::fp32, kOnebitDecompressBytesPerElement * pn, d);
      }
    }
    say(o, "optimizer step " + std::string(to_string(dtype)) + " (fused: 16-bit gradients in, AdamW, 16-bit copy out, " +
               fmt(kStepBytesPerParam16, "bytes/param") + "): " + std::to_string(g.optimizer.size()) + " sizes up to " +
               fmt(double(g.optimizer.back()), "params") + ", best " + fmt(best / 1e9, "GB/s") + " = " +
               fmt(best / kStepBytesPerParam16 / 1e9, "Gparam/s") + "; 1-bit Adam's step (" +
               fmt(kOnebitStepBytesPerParam16, "bytes/param") + ") best " + fmt(onebit_best / 1e9, "GB/s") + " (" +
               fmt(seconds_since(t0), "s") + ")");
  }
}

// CPU offload's optimizer: adamw_step on host fp32 tensors (p, g, m, v) writing the updated
// weights as bf16 (out16) and clearing g, one process over all the host's threads. Rows
// `host_adamw`, dtype fp32, bytes = 34 x N (read p, g, m, v: 16; write p, m, v, g: 16; the bf16
// copy: 2): kHostStepBytesPerParam16.
constexpr double kHostAdamWBytesPerParam = kHostStepBytesPerParam16;

// As the engine's HostOptimizerStep runs it: host_step_and_publish (chunks of 2^26, each chunk's
// bf16 parameters copied to the device being calibrated through a pinned buffer); the copies' time
// is left out (the Program's CopyH2D). Two warm-up steps, then the median of 3 or more.
void measure_host_adamw(const CalibrateOptions& o, const Grid& g, const at::Device& dev, DeviceProfile& p,
                        const std::string& cpu) {
  const auto t0 = Clock::now();
  Timer timer{at::Device(at::kCPU)};
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const AdamWHyper h;
  double best = 0;
  for (int64_t n : g.host_adamw) {
    at::Tensor p32 = at::full({n}, 1.0, f32), g32 = at::full({n}, 1e-3, f32), m = at::zeros({n}, f32), v = at::zeros({n}, f32);
    at::Tensor dst = at::empty({n}, f32.dtype(at::kBFloat16).device(dev)), staging;
    int64_t step = 0;
    auto one = [&] {
      const auto s0 = Clock::now();
      const double copies = host_step_and_publish(p32, g32, m, v, ++step, h, dst, staging);
      return std::max(1e-9, seconds_since(s0) - copies);
    };
    one(), one();
    std::vector<double> samples;
    const auto m0 = Clock::now();
    while (samples.size() < 3 || (samples.size() < 15 && seconds_since(m0) < o.seconds_per_point)) samples.push_back(one());
    std::sort(samples.begin(), samples.end());
    const double sec = samples[samples.size() / 2];
    best = std::max(best, add_bandwidth_row(p, "host_adamw", Dtype::fp32, kHostAdamWBytesPerParam * double(n), sec));
  }
  // ZeRO-Offload's gradient accumulation on the host (host_accumulate: fp32 += scale * bf16, the
  // engine's copy_gradients_to_host, on as many threads), bytes = 10 x N (read 2 + 4, write 4).
  // Up to 256M elements.
  double best_acc = 0;
  int acc_rows = 0;
  for (int64_t n : g.host_adamw) {
    if (n > (int64_t(1) << 28)) break;
    at::Tensor acc = at::zeros({n}, f32), src = at::full({n}, 1e-3, f32.dtype(at::kBFloat16));
    const double sec = timer.measure([&] { host_accumulate(acc, src, 0.5, host_accumulate_threads()); }, o.seconds_per_point);
    best_acc = std::max(best_acc, add_bandwidth_row(p, "host_accumulate", Dtype::fp32, 10.0 * double(n), sec));
    ++acc_rows;
  }
  const int nthreads = at::get_num_threads();
  const std::string threads = std::to_string(nthreads) + (nthreads == 1 ? " thread" : " threads");
  const std::string acc_threads = std::to_string(host_accumulate_threads()) + " threads";
  p.metadata.notes.push_back("host_adamw: adamw_step on host fp32 tensors + bf16 copy, one process, " + threads +
                             " on " + cpu + "; host_accumulate on " + acc_threads);
  say(o, "host gradient accumulation (10 bytes/element, " + acc_threads + "): " + std::to_string(acc_rows) +
             " sizes, best " + fmt(best_acc / 1e9, "GB/s"));
  say(o, "host adamw (" + cpu + ", " + threads + ", " + fmt(kHostAdamWBytesPerParam, "bytes/param") + "): " + std::to_string(g.host_adamw.size()) +
             " sizes up to " + fmt(double(g.host_adamw.back()), "params") + ", best " + fmt(best / 1e9, "GB/s") + " = " +
             fmt(best / kHostAdamWBytesPerParam / 1e9, "Gparam/s") + " (" + fmt(seconds_since(t0), "s") + ")");
}

void measure_copies(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  if (!dev.is_cuda()) {
    p.metadata.notes.push_back("copy: no host <-> device copies on the cpu backend");
    say(o, "copy: skipped (cpu backend)");
    return;
  }
  double h2d = 0, d2h = 0;
  for (int64_t bytes : g.copy_bytes) {
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    at::Tensor device = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
    host.fill_(1);
    const double up = timer.measure([&] { device.copy_(host, /*non_blocking=*/true); }, o.seconds_per_point);
    const double down = timer.measure([&] { host.copy_(device, /*non_blocking=*/true); }, o.seconds_per_point);
    p.copy.push_back({"h2d", Dtype::bf16, double(bytes), bytes / up});
    p.copy.push_back({"d2h", Dtype::bf16, double(bytes), bytes / down});
    h2d = std::max(h2d, bytes / up);
    d2h = std::max(d2h, bytes / down);
  }
  say(o, "copy (pinned): h2d up to " + fmt(h2d / 1e9, "GB/s") + ", d2h up to " + fmt(d2h / 1e9, "GB/s"));
}

#if defined(DSSIM_HAVE_NCCL)
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("calibrate: ") + what + ": " + ncclGetErrorString(r));
}
void cuda_check(cudaError_t r, const char* what) {
  if (r != cudaSuccess) throw std::runtime_error(std::string("calibrate: ") + what + ": " + cudaGetErrorString(r));
}

// nccl-tests' way, in one process: one communicator per GPU (ncclCommInitAll), every call of an
// iteration inside one group, wall time over `iters` iterations after warm-up; bf16 elements.
void measure_collectives(const CalibrateOptions& o, const Grid& g, int ngpus, DeviceProfile& p) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off on shared hosts
  const int n = ngpus;
  std::vector<int> devs(n);
  for (int i = 0; i < n; ++i) devs[i] = i;
  std::vector<ncclComm_t> comms(n);
  nccl_check(ncclCommInitAll(comms.data(), n, devs.data()), "ncclCommInitAll");
  const size_t max_bytes = size_t(*std::max_element(g.collective_bytes.begin(), g.collective_bytes.end()));
  std::vector<void*> send(n), recv(n);
  std::vector<cudaStream_t> streams(n);
  for (int i = 0; i < n; ++i) {
    cuda_check(cudaSetDevice(i), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMalloc(&send[i], max_bytes), "cudaMalloc");
    cuda_check(cudaMalloc(&recv[i], max_bytes), "cudaMalloc");
    cuda_check(cudaMemset(send[i], 0, max_bytes), "cudaMemset");
  }
  const ncclDataType_t type = ncclBfloat16;
  const size_t e = 2;
  auto run = [&](const std::string& c, size_t bytes) {
    const size_t count = bytes / e;
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < n; ++r) {
      if (c == "all_reduce") {
        nccl_check(ncclAllReduce(send[r], recv[r], count, type, ncclSum, comms[r], streams[r]), "ncclAllReduce");
      } else if (c == "reduce_scatter") {  // size = input bytes
        nccl_check(ncclReduceScatter(send[r], recv[r], count / n, type, ncclSum, comms[r], streams[r]), "ncclReduceScatter");
      } else if (c == "all_gather") {      // size = output bytes
        nccl_check(ncclAllGather(send[r], recv[r], count / n, type, comms[r], streams[r]), "ncclAllGather");
      } else if (c == "all_to_all") {
        const size_t chunk = count / n;
        for (int peer = 0; peer < n; ++peer) {
          nccl_check(ncclSend(static_cast<char*>(send[r]) + peer * chunk * e, chunk, type, peer, comms[r], streams[r]), "ncclSend");
          nccl_check(ncclRecv(static_cast<char*>(recv[r]) + peer * chunk * e, chunk, type, peer, comms[r], streams[r]), "ncclRecv");
        }
      } else {                             // send_recv: a ring, every rank sends `bytes` to the next
        nccl_check(ncclSend(send[r], count, type, (r + 1) % n, comms[r], streams[r]), "ncclSend");
        nccl_check(ncclRecv(recv[r], count, type, (r + n - 1) % n, comms[r], streams[r]), "ncclRecv");
      }
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  };
  auto sync = [&] {
    for (int r = 0; r < n; ++r) {
      cuda_check(cudaSetDevice(r), "cudaSetDevice");
      cuda_check(cudaStreamSynchronize(streams[r]), "cudaStreamSynchronize");
    }
  };
  for (const std::string c : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"}) {
    double best = 0;
    for (int64_t b : g.collective_bytes) {
      const size_t bytes = size_t(b) / (e * n) * (e * n);  // divisible into n chunks of whole elements
      for (int i = 0; i < 3; ++i) run(c, bytes);
      sync();
      const int iters = bytes >= (size_t(1) << 28) ? 5 : 20;
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) run(c, bytes);
      sync();
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      CollectivePoint x;
      x.collective = c;
      x.ranks = n;
      x.bytes = double(bytes);
      x.seconds = sec;
      x.algorithm_bandwidth = bytes / sec;
      x.bus_bandwidth = x.algorithm_bandwidth * bus_bandwidth_factor(c, n);
      best = std::max(best, x.bus_bandwidth);
      p.collectives.push_back(x);
    }
    say(o, "nccl " + c + " (" + std::to_string(n) + " GPUs): bus bandwidth up to " + fmt(best / 1e9, "GB/s"));
  }
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(i);
    cudaFree(send[i]);
    cudaFree(recv[i]);
    cudaStreamDestroy(streams[i]);
    ncclCommDestroy(comms[i]);
  }
  cudaSetDevice(0);
}
#endif

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "CPU";
}

}  // namespace

DeviceProfile calibrate(const CalibrateOptions& in) {
  CalibrateOptions o = in;
  const bool cuda = o.backend == "cuda";
  if (!cuda && o.backend != "cpu") throw CalibrateUsageError("--backend must be cuda or cpu, got '" + o.backend + "'");
  if (o.dtypes.empty()) o.dtypes = {cuda ? Dtype::bf16 : Dtype::fp32};
  if (o.quick) o.seconds_per_point = std::min(o.seconds_per_point, 0.005);

  DeviceProfile p;
  auto& md = p.metadata;
  md.backend = o.backend;
  md.date = utc_now();
  md.tool = o.command_line.empty() ? "dssim calibrate --backend " + o.backend : o.command_line;
  md.torch_version = TORCH_VERSION;
  md.timing = cuda ? "CUDA events on the current stream around back-to-back calls; 2 warm-up calls, median of 3-15 samples"
                   : "std::chrono around back-to-back calls; 2 warm-up calls, median of 3-15 samples";
  int ngpus = 0;
  if (cuda) {
    if (!torch_has_cuda())
      throw CalibrateUsageError("--backend cuda: this dssim was built against a libtorch without CUDA (" + std::string(TORCH_VERSION) +
                                "); build with pip torch's libtorch: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')");
    ngpus = static_cast<int>(torch::cuda::device_count());
    if (ngpus == 0) throw CalibrateUsageError("--backend cuda: no CUDA GPU is visible (torch::cuda::device_count() is 0)");
    if (o.device < 0 || o.device >= ngpus)
      throw CalibrateUsageError("--device " + std::to_string(o.device) + ": only " + std::to_string(ngpus) + " GPU(s) visible");
    set_cuda_device(o.device);
    md.gpus = ngpus;
#if defined(DSSIM_TORCH_CUDA)
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, o.device) == cudaSuccess) md.gpu = prop.name;
    int v = 0;
    if (cudaRuntimeGetVersion(&v) == cudaSuccess) md.cuda_version = std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
    if (cudaDriverGetVersion(&v) == cudaSuccess) md.driver_version = "CUDA " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
#endif
    // fp32 rows mean what precision fp32 means to dssim: TF32 off.
    at::globalContext().setFloat32MatmulPrecision("highest");
  } else {
    md.gpu = cpu_name();
    md.gpus = 0;
    md.notes.push_back("cpu backend, " + std::to_string(at::get_num_threads()) + " threads");
  }
  if (o.quick) md.notes.push_back("--quick: a few tiny shapes, for tests; not a calibration");

  const at::Device dev = cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(o.device)) : at::Device(at::kCPU);
  torch::NoGradGuard no_grad;
  Timer timer(dev);
  const Grid g = grid(cuda, o.quick);
  const auto t0 = Clock::now();
  const auto want = [&](const char* family) {
    return o.only.empty() || std::find(o.only.begin(), o.only.end(), family) != o.only.end();
  };
  if (want("gemm")) measure_gemms(o, g, dev, timer, p);
  if (want("epilogues")) measure_epilogue_gemms(o, g, dev, timer, p);
  if (want("attention")) {
    measure_attention(o, g, dev, timer, p);
    measure_attention_backward(o, g, dev, timer, p);
  }
  if (want("elementwise")) measure_elementwise(o, g, dev, timer, p);
  if (want("backward")) measure_backward_kernels(o, g, dev, timer, p);
  if (want("moe")) measure_moe(o, g, dev, timer, p);
  if (want("optimizer")) measure_optimizer_step(o, g, dev, timer, p);
  if (want("host")) measure_host_adamw(o, g, dev, p, cpu_name());
  if (want("copies")) measure_copies(o, g, dev, timer, p);
  if (!want("collectives")) {
    // not asked for
  } else if (!cuda || ngpus < 2 || !o.collectives) {
    const std::string why = !cuda ? "cpu backend" : ngpus < 2 ? "one GPU visible" : "--no-collectives";
    md.notes.push_back("collectives: not measured (" + why + ")");
    say(o, "collectives: skipped (" + why + ")");
  } else {
#if defined(DSSIM_HAVE_NCCL)
    measure_collectives(o, g, ngpus, p);
#else
    md.notes.push_back("collectives: not measured (built without NCCL; configure with -DDSSIM_WITH_CUDA=ON)");
    say(o, "collectives: skipped (built without NCCL)");
#endif
  }
  say(o, "calibrated in " + fmt(std::chrono::duration<double>(Clock::now() - t0).count(), "s"));
  return p;
}

}  // namespace dssim::tb
