// dssim calibrate's GEMM families (calibrate_families.hpp): a transformer layer's GEMMs in their
// three layouts, the fused-epilogue GEMMs the engine runs on GPUs, and attention forward and backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>
#include "backends/torch/calibrate_families.hpp"
#include "backends/torch/gemm_epilogues.hpp"

namespace dssim::tb::calibration {

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
//   every linear    wgrad bgradb            dW = dy^T x, db = sum(dy) (BGRADB); under
//                                           DSSIM_WGRAD=in_place dW += dy^T x, db += sum(dy) into
//                                           the gradient buffers (beta 1, dssim's bias kernel)
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
        // As the engine runs it: into temporaries by cuBLASLt's BGRADB epilogue, or under
        // DSSIM_WGRAD=in_place added into the gradient buffers (beta 1, dssim's bias kernel).
        out = at::randn({s.m, s.n}, opts), dw = at::zeros({s.n, s.k}, opts), db = at::zeros({s.n}, opts);
        gemm = [&] {
          if (!wgrad_in_place()) return gemm_bgradb(out, x, dw, db);
          if (!gemm_epilogues_apply(out, x, db)) return false;
          linear_weight_grads(out, x, dw, db, true);
          return true;
        };
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

}  // namespace dssim::tb::calibration
