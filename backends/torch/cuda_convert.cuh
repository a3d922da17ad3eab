// Conversions between the 16-bit types dssim's CUDA kernels read and write and the float they
// compute in (round to nearest even), the 16-byte vector the row kernels load, and the launchers'
// dispatch on a DType and error check, shared by fused_adamw_cuda.cu, cross_entropy_cuda.cu,
// bias_grad_cuda.cu and layer_norm_cuda.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>
#include "backends/torch/fused_adamw_cuda.hpp"  // DType

namespace dssim::tb::cuda {

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// One 16-byte load or store: 8 16-bit elements or 4 floats.
constexpr int kVecBytes = 16;
template <class T>
struct alignas(kVecBytes) Vec {
  static constexpr int kSize = kVecBytes / sizeof(T);
  T v[kSize];
};
inline int vec_size(DType type) { return type == DType::F32 ? 4 : 8; }

// Calls f with a value of type's element type (float, __nv_bfloat16, __half); DType::None throws
// std::invalid_argument(`none`).
template <class F>
void by_type(DType type, const char* none, F&& f) {
  switch (type) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    case DType::None: break;
  }
  throw std::invalid_argument(none);
}

// After a launch: a launch error becomes std::runtime_error("`kernel`: the error").
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(kernel) + ": " + cudaGetErrorString(err));
}

}  // namespace dssim::tb::cuda
