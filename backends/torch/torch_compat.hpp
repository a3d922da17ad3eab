// The one place that knows which libtorch it is built against: Debian's 1.13 on CI (CPU only) and
// pip torch 2.x (CUDA) on GPU machines. Everything version-dependent goes through here.
#pragma once
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/Context.h>
#include <c10/core/StorageImpl.h>
#include <cmath>
#include <mutex>
#include <set>
#include <string>

#define DSSIM_TORCH_AT_LEAST(maj, min) \
  (TORCH_VERSION_MAJOR > (maj) || (TORCH_VERSION_MAJOR == (maj) && TORCH_VERSION_MINOR >= (min)))

#include <functional>
#include <memory>
#if defined(DSSIM_TORCH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#endif
#if defined(DSSIM_HAVE_NCCL)
#include <cuda_runtime.h>
#endif

namespace dssim::tb {

#if defined(DSSIM_HAVE_NCCL)
// The stream libtorch issues its kernels on (a CPU-only libtorch, as on CI, has none: the legacy
// default stream then orders everything).
inline cudaStream_t torch_current_stream(int device) {
#if defined(DSSIM_TORCH_CUDA)
  return c10::cuda::getCurrentCUDAStream(device).stream();
#else
  (void)device;
  return nullptr;
#endif
}
#endif

// A kineto trace (CPU ops, CUDA kernels) of what runs between start and stop, written as Chrome
// trace JSON (DSSIM_KERNEL_TRACE, engine.cpp). libtorch with CUDA only: elsewhere start returns
// false and nothing is written.
inline bool kernel_trace_start() {
#if defined(DSSIM_TORCH_CUDA)
  using torch::profiler::impl::ActivityType;
  // With the ops' input shapes ("Input Dims"), so a kernel can be matched to the op that launched it.
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                     /*report_input_shapes=*/true);
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  return true;
#else
  return false;
#endif
}
inline void kernel_trace_stop(const std::string& path) {
#if defined(DSSIM_TORCH_CUDA)
  torch::autograd::profiler::disableProfiler()->save(path);
#else
  (void)path;
#endif
}

// Waits for the device's queued work on every stream (step boundaries); a no-op on CPUs.
inline void device_synchronize(const at::Device& d) {
#if defined(DSSIM_TORCH_CUDA)
  if (d.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)d;
#endif
}

// Waits for the work queued on the current (compute) stream only: timing an instruction this way
// leaves side-stream copies running under the next instruction, as they do when not timed.
inline void stream_synchronize(const at::Device& d) {
#if defined(DSSIM_TORCH_CUDA)
  if (d.is_cuda()) c10::cuda::getCurrentCUDAStream(d.index()).synchronize();
#else
  (void)d;
#endif
}

// Bytes allocated by libtorch's CUDA caching allocator, now or at the peak; -1 where there is none.
inline double cuda_allocated_stat(const at::Device& d, bool peak) {
#if defined(DSSIM_TORCH_CUDA)
  if (d.is_cuda()) {
    // By value: getDeviceStats returns a temporary (a reference into it dangled, and read garbage).
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    const auto& s = stats.allocated_bytes[0];
    return double(peak ? s.peak : s.current);
  }
#else
  (void)d;
  (void)peak;
#endif
  return -1;
}
inline double cuda_peak_allocated_bytes(const at::Device& d) { return cuda_allocated_stat(d, true); }
inline double cuda_allocated_bytes(const at::Device& d) { return cuda_allocated_stat(d, false); }
// Restarts the allocator's peak counters (cuda_peak_allocated_bytes then reports the peak since).
inline void cuda_reset_peak(const at::Device& d) {
#if defined(DSSIM_TORCH_CUDA)
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#else
  (void)d;
#endif
}

// Copies a device tensor into a (pinned) host tensor on a side stream, after the work queued so
// far on the current stream, so that the compute stream goes on meanwhile; returns what waits for
// the copy. The source may be freed at once: the caching allocator holds its block until the side
// stream's copy is done (record_stream). On CPUs: a plain copy, and a no-op wait.
inline std::function<void()> copy_to_host_async(at::Tensor dst, const at::Tensor& src) {
#if defined(DSSIM_TORCH_CUDA)
  if (src.is_cuda()) {
    const auto dev = src.device().index();
    auto side = c10::cuda::getStreamFromPool(false, dev);
    auto ready = std::make_shared<at::cuda::CUDAEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(dev));
    ready->block(side);
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    {
      c10::cuda::CUDAStreamGuard guard(side);
      dst.copy_(src, /*non_blocking=*/true);
      done->record(side);
    }
    src.record_stream(side);
    return [done]() { done->synchronize(); };
  }
#endif
  dst.copy_(src);
  return [] {};
}

inline void set_cuda_device(int index) {
#if defined(DSSIM_TORCH_CUDA)
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  (void)index;
#endif
}

// The current CUDA device's name as the driver reports it ("NVIDIA H100 80GB HBM3"); "" without one.
inline std::string cuda_device_name() {
#if defined(DSSIM_TORCH_CUDA)
  int index = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&index) == cudaSuccess && cudaGetDeviceProperties(&prop, index) == cudaSuccess) return prop.name;
#endif
  return "";
}

inline constexpr bool torch_has_cuda() {
#if defined(DSSIM_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

// softmax(q k^T / sqrt(d) + causal mask) v for q, k, v of shape [B, heads, S, d].
// libtorch >= 2.0 has scaled_dot_product_attention (flash / memory-efficient kernels on GPUs);
// 1.13 gets the plain composition, which autograd differentiates the same way.
inline at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if DSSIM_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else
  const int64_t s = q.size(-2);
  const double scale = 1.0 / std::sqrt(double(q.size(-1)));
  auto scores = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  auto mask = at::ones({s, s}, q.options().dtype(at::kBool)).triu_(1);
  scores.masked_fill_(mask, -std::numeric_limits<float>::infinity());
  auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v);
#endif
}

inline bool flash_attention_available() { return DSSIM_TORCH_AT_LEAST(2, 0); }

// A generator of `device`'s kind, seeded: initialisation is a function of the seed alone (per
// device type), not of what ran before.
inline at::Generator seeded_generator(const at::Device& device, uint64_t seed) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
  return gen;
}

// ZeRO-3 frees a gathered parameter's storage after use and refills the same storage before the
// next use, so that tensors autograd saved (views of it) see the refilled data (DeepSpeed does the
// same with param.data).
inline void release_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
inline void reallocate_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes && s->data() != nullptr) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}
inline bool storage_released(const at::Tensor& t) { return t.storage().nbytes() == 0; }

}  // namespace dssim::tb
