// The fused loss's cross-entropy per chunk as one kernel (backends/torch/cross_entropy_cuda.hpp).
// ATen's path (fused_cross_entropy.cpp) casts the bf16 logits to fp32, runs softmax, subtracts the
// one-hot, scales and casts back: five passes over a [chunk, vocab] tensor, three of them in fp32.
// Here one block per row: an online max / sum of exponentials over the row (Milakov & Gimelshein
// 2018), then the gradient written straight in the logits' type.
#include "backends/torch/cross_entropy_cuda.hpp"
#include "backends/torch/cuda_convert.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dssim::tb::cuda {
namespace {

constexpr int kThreads = 512;

// (max, sum of exp(x - max)) of two parts.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2, s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

// One more element into (max, sum).
__device__ __forceinline__ void add(float& m, float& s, float v) {
  if (v > m) {
    s = s * expf(m - v) + 1.0f;
    m = v;
  } else {
    s += expf(v - m);
  }
}

// VEC elements per load (16 bytes when the row allows it).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) cross_entropy_rows(const T* __restrict__ logits, T* __restrict__ grad,
                                                               const int64_t* __restrict__ targets,
                                                               float* __restrict__ loss, int64_t vocab, float scale) {
  const int64_t row = blockIdx.x;
  const auto* x = reinterpret_cast<const Pack<T, VEC>*>(logits + row * vocab);
  const int64_t packs = vocab / VEC;
  float m = -INFINITY, s = 0;
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    const Pack<T, VEC> p = x[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) add(m, s, to_float(p.v[j]));
  }
  // Block reduction: warps by shuffles, then the first warp over the warps' results.
  for (int o = 16; o > 0; o >>= 1) combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  __shared__ float wm[kThreads / 32], ws[kThreads / 32];
  __shared__ float lse_shared;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) wm[warp] = m, ws[warp] = s;
  __syncthreads();
  if (warp == 0) {
    m = lane < kThreads / 32 ? wm[lane] : -INFINITY;
    s = lane < kThreads / 32 ? ws[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) {
      const float lse = m + logf(s);
      lse_shared = lse;
      loss[row] = lse - to_float(logits[row * vocab + targets[row]]);
    }
  }
  __syncthreads();
  if (grad == nullptr) return;
  const float lse = lse_shared;
  const int64_t t = targets[row];
  auto* g = reinterpret_cast<Pack<T, VEC>*>(grad + row * vocab);
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    const Pack<T, VEC> p = x[i];
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float q = expf(to_float(p.v[j]) - lse) - (i * VEC + j == t ? 1.0f : 0.0f);
      out.v[j] = from_float<T>(q * scale);
    }
    g[i] = out;
  }
}

template <class T>
void launch_typed(const CrossEntropyLaunch& a, cudaStream_t stream) {
  const auto* l = static_cast<const T*>(a.logits);
  auto* g = static_cast<T*>(a.grad);
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = a.vocab % kVec == 0 && reinterpret_cast<uintptr_t>(l) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(g) % 16 == 0;
  if (aligned)
    cross_entropy_rows<T, kVec><<<a.rows, kThreads, 0, stream>>>(l, g, a.targets, a.loss, a.vocab, a.scale);
  else
    cross_entropy_rows<T, 1><<<a.rows, kThreads, 0, stream>>>(l, g, a.targets, a.loss, a.vocab, a.scale);
}

}  // namespace

void launch_cross_entropy(const CrossEntropyLaunch& a, void* stream_ptr) {
  if (a.rows <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  by_type(a.type, "launch_cross_entropy: no logits type", [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_launch("cross-entropy kernel");
}

}  // namespace dssim::tb::cuda
