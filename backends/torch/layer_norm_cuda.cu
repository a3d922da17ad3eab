// LayerNorm's backward with the residual's gradient added (backends/torch/layer_norm_cuda.hpp).
#include "backends/torch/layer_norm_cuda.hpp"
#include "backends/torch/cuda_convert.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>

namespace dssim::tb::cuda {
namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kMaxChunks = 32;  // 16-byte vectors a row: cols <= 32 * 32 * V (8 a thread, 4 warps a row)

template <class T>
__device__ __forceinline__ Vec<T> load(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// kRowWarps warps a row (a row's sums meet in shared memory when there are several). Thread t of
// the row's 32 kRowWarps holds the 16-byte vectors t, t + 32 kRowWarps, ... of its row's dy and x in
// registers from the row sums to the output, so each is read from memory once.
template <class T, int kChunks, int kRowWarps>
__global__ void __launch_bounds__(kThreads)
    layer_norm_dx(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                  const float* __restrict__ rstd, const T* __restrict__ gamma, const T* __restrict__ dres,
                  T* __restrict__ dx, int64_t rows, int64_t cols) {
  constexpr int V = Vec<T>::kSize, kRowThreads = 32 * kRowWarps;
  __shared__ float red[kWarps][2];
  const int warp = threadIdx.x / 32, t = threadIdx.x % kRowThreads;
  const int64_t row = int64_t(blockIdx.x) * (kWarps / kRowWarps) + warp / kRowWarps;
  const bool active = row < rows;
  const int64_t base = row * cols;
  const float mu = active ? mean[row] : 0.f, rs = active ? rstd[row] : 0.f;
  const auto col = [&](int k) { return (int64_t(k) * kRowThreads + t) * V; };
  Vec<T> d[kChunks], xv[kChunks];
#pragma unroll
  for (int k = 0; k < kChunks; ++k)
    if (active && col(k) < cols) d[k] = load(dy + base + col(k)), xv[k] = load(x + base + col(k));
  // ATen's stats: sum(gamma dy) and sum(gamma dy xhat), in fp32.
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!active || col(k) >= cols) continue;
    const Vec<T> g = load(gamma + col(k));
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gd = to_float(g.v[j]) * to_float(d[k].v[j]);
      s1 += gd;
      s2 += gd * (to_float(xv[k].v[j]) - mu) * rs;
    }
  }
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  if constexpr (kRowWarps > 1) {
    if (threadIdx.x % 32 == 0) red[warp][0] = s1, red[warp][1] = s2;
    __syncthreads();
    const int first = warp - warp % kRowWarps;
    s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int w = 0; w < kRowWarps; ++w) s1 += red[first + w][0], s2 += red[first + w][1];
  }
  if (!active) return;
  const float fh = float(cols), term1 = (1.f / fh) * rs;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = col(k);
    if (c >= cols) continue;
    const Vec<T> g = load(gamma + c);
    Vec<T> r;
    if (dres) r = load(dres + base + c);
    Vec<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float v = term1 * (fh * to_float(g.v[j]) * to_float(d[k].v[j]) - s1 - (to_float(xv[k].v[j]) - mu) * rs * s2);
      if (dres) v += to_float(r.v[j]);
      o.v[j] = from_float<T>(v);
    }
    *reinterpret_cast<Vec<T>*>(dx + base + c) = o;
  }
}

// dgamma's and dbeta's column sums: block (column tile of 32 vectors, row split), each thread owns
// one 16-byte vector of columns, the block's warps take every 8th row of the split (two rows in
// flight), the warps' sums meet in shared memory in a fixed order; one fp32 partial per column,
// sum and split.
template <class T>
__global__ void __launch_bounds__(kThreads)
    gamma_beta_partials(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                        const float* __restrict__ rstd, float* __restrict__ partial, int64_t rows, int64_t cols,
                        int64_t rows_per_split) {
  constexpr int V = Vec<T>::kSize, kTile = 32 * V;
  __shared__ float sums[2][kWarps][kTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c0 = int64_t(blockIdx.x) * kTile + int64_t(lane) * V;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_split;
  const int64_t r1 = rows < r0 + rows_per_split ? rows : r0 + rows_per_split;
  float ag[V], ab[V];
#pragma unroll
  for (int j = 0; j < V; ++j) ag[j] = 0.f, ab[j] = 0.f;
  const auto add = [&](const Vec<T>& d, const Vec<T>& xr, float mu, float rs) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = to_float(d.v[j]);
      ab[j] += g;
      ag[j] += g * ((to_float(xr.v[j]) - mu) * rs);
    }
  };
  if (c0 < cols) {
    int64_t r = r0 + warp;
    for (; r + kWarps < r1; r += 2 * kWarps) {
      const int64_t q = r + kWarps;
      const Vec<T> d0 = load(dy + r * cols + c0), x0 = load(x + r * cols + c0);
      const Vec<T> d1 = load(dy + q * cols + c0), x1 = load(x + q * cols + c0);
      add(d0, x0, mean[r], rstd[r]);
      add(d1, x1, mean[q], rstd[q]);
    }
    for (; r < r1; r += kWarps) add(load(dy + r * cols + c0), load(x + r * cols + c0), mean[r], rstd[r]);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sums[0][warp][lane * V + j] = ag[j], sums[1][warp][lane * V + j] = ab[j];
  __syncthreads();
  const int64_t splits = gridDim.y;
  for (int t = threadIdx.x; t < 2 * kTile; t += kThreads) {
    const int which = t / kTile, i = t % kTile;
    const int64_t c = int64_t(blockIdx.x) * kTile + i;
    if (c >= cols) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sums[which][w][i];
    partial[(which * splits + blockIdx.y) * cols + c] = s;
  }
}

template <class T>
__global__ void gamma_beta_finish(const float* __restrict__ partial, T* __restrict__ dgamma, T* __restrict__ dbeta,
                                  int64_t cols, int splits, bool accumulate) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float g = 0.f, b = 0.f;
  for (int i = 0; i < splits; ++i) g += partial[int64_t(i) * cols + c], b += partial[int64_t(splits + i) * cols + c];
  dgamma[c] = from_float<T>(accumulate ? to_float(dgamma[c]) + g : g);
  if (dbeta) dbeta[c] = from_float<T>(accumulate ? to_float(dbeta[c]) + b : b);
}

int64_t chunks_of(const LayerNormBackwardLaunch& a) {
  const int64_t per_chunk = 32 * int64_t(vec_size(a.type));
  return (a.cols + per_chunk - 1) / per_chunk;
}

template <class T, int kChunks, int kRowWarps = 1>
void launch_dx(const LayerNormBackwardLaunch& a, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kWarps / kRowWarps;
  const auto blocks = unsigned((a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  layer_norm_dx<T, kChunks, kRowWarps><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(a.dy), static_cast<const T*>(a.x), a.mean, a.rstd, static_cast<const T*>(a.gamma),
      static_cast<const T*>(a.dres), static_cast<T*>(a.dx), a.rows, a.cols);
}

template <class T>
void launch_typed(const LayerNormBackwardLaunch& a, cudaStream_t stream) {
  // The smallest register tile that holds a thread's share of the row, at most 4 vectors a thread
  // (about 100 registers in bf16, two blocks an SM; 8 take about 160) up to 16 a row, then 8.
  const int64_t chunks = chunks_of(a);
  if (chunks <= 1) launch_dx<T, 1>(a, stream);
  else if (chunks <= 2) launch_dx<T, 2>(a, stream);
  else if (chunks <= 4) launch_dx<T, 4>(a, stream);
  else if (chunks <= 8) launch_dx<T, 4, 2>(a, stream);
  else if (chunks <= 16) launch_dx<T, 4, 4>(a, stream);
  else launch_dx<T, 8, 4>(a, stream);
  constexpr int kTile = 32 * Vec<T>::kSize;
  const int64_t rows_per_split = (a.rows + a.splits - 1) / a.splits;
  const dim3 grid(unsigned((a.cols + kTile - 1) / kTile), unsigned(a.splits));
  gamma_beta_partials<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(a.dy), static_cast<const T*>(a.x),
                                                        a.mean, a.rstd, a.partial, a.rows, a.cols, rows_per_split);
  gamma_beta_finish<T><<<unsigned((a.cols + 255) / 256), 256, 0, stream>>>(
      a.partial, static_cast<T*>(a.dgamma), static_cast<T*>(a.dbeta), a.cols, a.splits, a.accumulate);
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0; }

}  // namespace

bool layer_norm_backward_supported(const LayerNormBackwardLaunch& a) {
  if (a.type == DType::None || a.rows <= 0 || a.cols <= 0 || a.splits < 1) return false;
  if (a.cols % vec_size(a.type) != 0 || chunks_of(a) > kMaxChunks) return false;
  for (const void* p : {a.dy, a.x, a.gamma})
    if (!p || !aligned(p)) return false;
  // The outputs: null (still to be allocated) or aligned.
  for (const void* p : {a.dres, static_cast<const void*>(a.dx), static_cast<const void*>(a.dgamma),
                        static_cast<const void*>(a.dbeta)})
    if (p && !aligned(p)) return false;
  return a.mean && a.rstd;
}

void launch_layer_norm_backward(const LayerNormBackwardLaunch& a, void* stream_ptr) {
  if (!a.partial || !a.dx || !a.dgamma) throw std::invalid_argument("launch_layer_norm_backward: no workspace or output");
  if (!aligned(a.dx) || !aligned(a.dgamma) || (a.dbeta && !aligned(a.dbeta)))
    throw std::invalid_argument("launch_layer_norm_backward: an output is not 16-byte aligned");
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  by_type(a.type, "launch_layer_norm_backward: no type", [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_launch("LayerNorm backward kernels");
}

}  // namespace dssim::tb::cuda
