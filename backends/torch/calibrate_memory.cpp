// dssim calibrate's memory-bound families (calibrate_families.hpp): elementwise kernels, the backward
// pass's other kernels, MoE routing / dispatch / combine, and the engine's optimizer step.
#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include "backends/torch/calibrate_families.hpp"
#include "backends/torch/fused_cross_entropy.hpp"
#include "backends/torch/layer_norm_residual.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/onebit_adam.hpp"
#include "backends/torch/optimizer_kernels.hpp"

namespace dssim::tb::calibration {

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
//   layer_norm_residual_backward  the same with the residual's gradient added to dx
//                           (layer_norm_residual_backward: dssim's kernels on GPUs)       6 e N
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

    // The norm's backward inputs at each backward shape [t x h]: x, dy and the residual's gradient,
    // gain and bias, the forward's mean and rstd; `time` measures a kernel on them (N = t h).
    struct NormInputs {
      std::vector<int64_t> shape;
      at::Tensor x, dy, dres, gain, bias, mean, rstd;
    };
    const auto each_norm_shape = [&](const std::function<void(double, const NormInputs&)>& time) {
      for (int64_t h : g.bwd_hidden)
        for (int64_t t : g.bwd_tokens) {
          NormInputs in{{h}, at::randn({t, h}, opts), at::randn({t, h}, opts), at::randn({t, h}, opts),
                        at::ones({h}, opts), at::zeros({h}, opts), {}, {}};
          std::tie(std::ignore, in.mean, in.rstd) = at::native_layer_norm(in.x, in.shape, in.gain, in.bias, 1e-5);
          time(double(t) * h, in);
        }
    };
    family("layer_norm_backward", [&] {
      each_norm_shape([&](double n, const NormInputs& in) {
        record("layer_norm_backward", 5 * e * n, timer.measure([&] {
          (void)at::native_layer_norm_backward(in.dy, in.x, in.shape, in.mean, in.rstd, in.gain, in.bias,
                                               std::array<bool, 3>{{true, true, true}});
        }, budget));
      });
    });
    // The block's norm with the residual's gradient added (layer_norm_residual.hpp): dssim's
    // kernel pair on GPUs, ATen's backward and an add elsewhere; 6 e N (read dy, x, dres, write dx,
    // dy and x again for the gain and bias).
    family("layer_norm_residual_backward", [&] {
      each_norm_shape([&](double n, const NormInputs& in) {
        record("layer_norm_residual_backward", 6 * e * n, timer.measure([&] {
          (void)layer_norm_residual_backward(in.dy, in.x, in.mean, in.rstd, in.gain, in.bias, in.dres);
        }, budget));
      });
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

}  // namespace dssim::tb::calibration
