// DeepSpeed's dynamic loss scaler (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler), rule
// for rule: start at 2^initial_scale_power; on overflow skip the step and, once `hysteresis`
// overflows have used up the delay, halve the scale (never below min_loss_scale; at the minimum,
// DeepSpeed's error); after loss_scale_window steps without overflow, double it.
// Plain C++ (no torch) so its rules are tested on their own.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include "core/scenario.hpp"

namespace dssim::tb {

struct LossScaleAtMinimum : std::runtime_error {
  LossScaleAtMinimum()
      : std::runtime_error(
            "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.") {}
};

class DynamicLossScaler {
 public:
  struct State {
    double cur_scale = 1;
    int64_t cur_iter = 0;
    int64_t last_overflow_iter = -1;
    int cur_hysteresis = 1;
  };

  explicit DynamicLossScaler(const LossScaleSpec& spec, bool enabled = true)
      : dynamic_(enabled && spec.loss_scale == 0), scale_window_(spec.loss_scale_window),
        min_scale_(spec.min_loss_scale), delayed_shift_(spec.hysteresis) {
    if (!enabled) s_.cur_scale = 1;
    else if (spec.loss_scale > 0) s_.cur_scale = spec.loss_scale;  // static scale
    else s_.cur_scale = std::pow(2.0, spec.initial_scale_power);
    s_.cur_hysteresis = delayed_shift_;
  }

  double scale() const { return s_.cur_scale; }
  bool dynamic() const { return dynamic_; }
  const State& state() const { return s_; }
  void restore(const State& s) { s_ = s; }

  // Called once per optimizer step with whether any gradient overflowed (inf / nan).
  void update(bool overflow) {
    if (!dynamic_) return;
    if (overflow) {
      if (delayed_shift_ == 1 || s_.cur_hysteresis == 1) {
        if (s_.cur_scale == min_scale_) throw LossScaleAtMinimum();
        s_.cur_scale = std::max(s_.cur_scale / scale_factor_, min_scale_);
      } else {
        s_.cur_hysteresis -= 1;
      }
      s_.last_overflow_iter = s_.cur_iter;
    } else {
      if ((s_.cur_iter - s_.last_overflow_iter) % scale_window_ == 0) {
        s_.cur_hysteresis = delayed_shift_;  // consecutive_hysteresis = false (DeepSpeed default)
        s_.cur_scale *= scale_factor_;
      }
    }
    s_.cur_iter += 1;
  }

 private:
  bool dynamic_;
  int scale_window_;
  double min_scale_;
  int delayed_shift_;
  double scale_factor_ = 2.0;
  State s_;
};

}  // namespace dssim::tb
