#include "core/scenario.hpp"

namespace dssim {

const char* to_string(Dtype d) {
  switch (d) {
    case Dtype::fp32: return "fp32";
    case Dtype::fp16: return "fp16";
    case Dtype::bf16: return "bf16";
  }
  return "?";
}

const char* to_string(ZeroEngine e) { return e == ZeroEngine::fsdp ? "fsdp" : "deepspeed"; }

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
    case Recompute::selective_op: return "selective_op";
  }
  return "?";
}

const char* to_string(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::adamw: return "adamw";
    case OptimizerKind::onebit_adam: return "onebit_adam";
    case OptimizerKind::lamb: return "lamb";
    case OptimizerKind::lion: return "lion";
  }
  return "?";
}

}  // namespace dssim
