#include "core/optimizer_step.hpp"

namespace dssim {
namespace {

// The one-pass step (fused_adamw_step): the gradient read where it lies and cleared (r bytes each:
// the g-byte buckets or partition that stages 0-2 step in place, r = g; an fp32 accumulator,
// r = 4), the fp32 master and both moments read and written (24), the g-byte copy written (g).
double fused_bytes(int g, int r) { return 24 + double(g) + 2.0 * r; }
// optimizer.fused_step false, the step before issue 15, after the fold: AdamW over the fp32
// gradients (28), their clear (4), the g-byte copy from the master (4 + g).
double unfused_bytes(int g) { return 28 + 4 + (4.0 + g); }
// 1-bit Adam's compressed-phase step: the fold, the momentum update (20), the clear, the
// frozen-variance update in five passes (48), the publish.
double onebit_bytes(int g) { return fold_bytes_per_param(g) + 20 + 4 + 48 + (4 + g); }
// The step's extra passes over the gradients: the global norm reads them once (r bytes each);
// unscaling (fp16) or clipping rescales fp32 ones in place where the step does not scale as it
// reads (1-bit Adam, the unfused step, the host's).
double norm_bytes(bool norm, double r, bool rescale) { return norm ? r + (rescale ? 8.0 : 0.0) : 0.0; }

}  // namespace

double fold_bytes_per_param(int g) { return 2.0 * g + 8; }

double device_step_bytes_per_param(const DeviceStep& s) {
  const int r = s.in_place ? s.g : 4;
  const double fold = s.zero_stage == 3 ? 0.0 : fold_bytes_per_param(s.g);  // (stage 3 folds in backward)
  double step = 0;
  if (s.onebit) step = onebit_bytes(s.g);
  else if (!s.fused) step = fold + unfused_bytes(s.g);
  else step = fused_bytes(s.g, r) + (s.in_place ? 0.0 : fold);
  return step + norm_bytes(s.norm, r, s.onebit || !s.fused);
}

// The AdamW pass on host fp32 tensors (28), clearing the fp32 gradients (4) and writing the g-byte
// copy for the device in the same pass.
double host_step_bytes_per_param(int g, bool norm) { return 28 + 4 + double(g) + norm_bytes(norm, 4, true); }

}  // namespace dssim
