// Conversions between the 16-bit types dssim's CUDA kernels read and write and the float they
// compute in (round to nearest even), shared by fused_adamw_cuda.cu and cross_entropy_cuda.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dssim::tb::cuda {

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

}  // namespace dssim::tb::cuda
