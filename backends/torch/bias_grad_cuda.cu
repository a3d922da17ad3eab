// The column sum behind a linear layer's bias gradient (backends/torch/bias_grad_cuda.hpp).
// Pass 1: block (column tile of 256, row split) — each thread owns 8 adjacent columns and reads
// them as one 16-byte vector a row, the block's 8 warps take every 8th row of the split, and the
// warps' sums meet in shared memory; one fp32 partial per column and split. Pass 2: a thread per
// column sums its partials in split order and writes (or adds into) the output.
#include "backends/torch/bias_grad_cuda.hpp"
#include "backends/torch/cuda_convert.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dssim::tb::cuda {
namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;

template <class T>
__global__ void __launch_bounds__(kThreads) column_partials(const T* __restrict__ x, float* __restrict__ partial,
                                                            int64_t rows, int64_t cols, int64_t ld,
                                                            int64_t rows_per_split) {
  constexpr int V = Vec<T>::kSize;
  constexpr int kTile = 32 * V;  // columns of a block
  __shared__ float sums[kWarps][kTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c0 = int64_t(blockIdx.x) * kTile + int64_t(lane) * V;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_split, r1 = rows < r0 + rows_per_split ? rows : r0 + rows_per_split;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  if (c0 < cols) {
    int64_t r = r0 + warp;
    // Four rows in flight per thread, then the rest one at a time.
    for (; r + 3 * kWarps < r1; r += 4 * kWarps) {
      Vec<T> a[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] = *reinterpret_cast<const Vec<T>*>(x + (r + u * kWarps) * ld + c0);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += to_float(a[u].v[j]);
    }
    for (; r < r1; r += kWarps) {
      const Vec<T> a = *reinterpret_cast<const Vec<T>*>(x + r * ld + c0);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += to_float(a.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sums[warp][lane * V + j] = acc[j];
  __syncthreads();
  for (int t = threadIdx.x; t < kTile; t += kThreads) {
    const int64_t c = int64_t(blockIdx.x) * kTile + t;
    if (c >= cols) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sums[w][t];
    partial[int64_t(blockIdx.y) * cols + c] = s;
  }
}

template <class T>
__global__ void column_finish(const float* __restrict__ partial, T* __restrict__ out, int64_t cols, int splits,
                              bool accumulate) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = accumulate ? to_float(out[c]) : 0.f;
  float p = 0.f;
  for (int i = 0; i < splits; ++i) p += partial[int64_t(i) * cols + c];
  out[c] = from_float<T>(s + p);
}

template <class T>
void launch_typed(const ColumnSumLaunch& a, cudaStream_t stream) {
  constexpr int V = Vec<T>::kSize, kTile = 32 * V;
  const int64_t rows_per_split = (a.rows + a.splits - 1) / a.splits;
  const dim3 grid(unsigned((a.cols + kTile - 1) / kTile), unsigned(a.splits));
  column_partials<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(a.x), a.partial, a.rows, a.cols, a.ld,
                                                    rows_per_split);
  column_finish<T><<<unsigned((a.cols + 255) / 256), 256, 0, stream>>>(a.partial, static_cast<T*>(a.out), a.cols,
                                                                      a.splits, a.accumulate);
}

}  // namespace

bool column_sum_supported(const void* x, int64_t cols, int64_t ld, DType type) {
  if (type == DType::None || cols <= 0) return false;
  const int v = vec_size(type);
  return cols % v == 0 && ld % v == 0 && reinterpret_cast<uintptr_t>(x) % kVecBytes == 0;
}

int column_sum_splits(int64_t rows, int64_t cols, int multiprocessors) {
  const int64_t tiles = (cols + 255) / 256;  // at least this many columns a block (fp32: 128)
  const int64_t want = (4 * int64_t(std::max(multiprocessors, 1)) + tiles - 1) / tiles;
  const int64_t most = std::max<int64_t>(1, rows / (4 * kWarps));  // a block reads 32 rows or more
  return int(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 1024)));
}

void launch_column_sum(const ColumnSumLaunch& a, void* stream_ptr) {
  if (a.cols <= 0) return;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  by_type(a.type, "launch_column_sum: no type", [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_launch("column-sum kernel");
}

}  // namespace dssim::tb::cuda
