// `dssim calibrate`: measures the device it runs on with libtorch and returns a DeviceProfile
// (core/device_profile.hpp) that the device model reads in place of the preset curves.
// GEMMs of a transformer layer (QKV, attention projection, MLP up / down) over hidden sizes, token
// counts and TP splits, each in its forward (y = x W^T) and backward (dgrad dX = dY W, wgrad
// dW = dY^T X) layout; attention (scaled_dot_product_attention where the libtorch has it, recorded
// as "flash", and matmul-softmax-matmul, "plain"), and the flash kernel's backward via autograd
// ("flash_backward"); add / gelu / layer_norm bandwidth; the backward pass's other kernels
// (layer_norm_backward, gelu_backward, bias_grad, cross_entropy and its backward,
// embedding_backward; (forward + backward) - forward where only autograd runs them); the engine's
// optimizer step (backends/torch/optimizer_kernels.hpp) on the device and AdamW on the host (CPU
// offload); pinned host <-> device copies; NCCL collectives when several GPUs are visible
// (nccl-tests bus bandwidth).
// Timing: CUDA events on the current stream (std::chrono on CPUs), warm-up, median of samples.
#pragma once
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>
#include "core/device_profile.hpp"

namespace dssim::tb {

struct CalibrateOptions {
  std::string backend = "cpu";         // cuda | cpu
  bool quick = false;                  // a few tiny shapes, seconds (CI)
  std::vector<Dtype> dtypes;           // empty: bf16 on cuda, fp32 on cpu
  int device = 0;                      // CUDA device index
  double seconds_per_point = 0.05;     // timing budget of one measured point (after warm-up)
  bool collectives = true;             // NCCL collectives when > 1 GPU (and NCCL was built in)
  // Families to measure (empty: all): gemm, epilogues, attention, elementwise, backward, moe, optimizer,
  // host, copies, collectives.
  std::vector<std::string> only;
  std::string command_line;            // recorded in metadata.tool
  std::function<void(const std::string&)> progress;  // one line per section; may be empty
};

// What the user can fix (no GPU for --backend cuda, a libtorch without CUDA): exit code 2.
struct CalibrateUsageError : std::runtime_error {
  using runtime_error::runtime_error;
};

DeviceProfile calibrate(const CalibrateOptions&);

}  // namespace dssim::tb
