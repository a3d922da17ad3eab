// The engine's optimizer step as one CUDA kernel (backends/torch/fused_adamw_cuda.hpp): per
// element of the shard it reads the gradient (16-bit or fp32), the fp32 master and both moments,
// writes master and moments, the 16-bit copy of the parameter, and zero into the gradient. The
// AdamW arithmetic is that of torch.optim.AdamW(fused=True) (ATen's fused_adam_utils.cuh,
// ADAMW mode: hyper-parameters in double, the tensors' values in float).
#include "backends/torch/fused_adamw_cuda.hpp"
#include "backends/torch/cuda_convert.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dssim::tb::cuda {
namespace {

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2_sqrt;
  float pre, coef;
  bool apply_pre, apply_coef, clear;
};

// One element: the same expressions, in the same types, as ATen's adam_math (ADAMW, no amsgrad,
// no grad scale): the gradient is first scaled as the engine's accumulator would be (g * pre, then
// * coef, each a float multiply).
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const Hyper& h) {
  if (h.apply_pre) g *= h.pre;
  if (h.apply_coef) g *= h.coef;
  if (h.weight_decay != 0) p -= h.lr * h.weight_decay * p;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  const float step_size = h.lr / h.bias_correction1;
  const float denom = (sqrtf(v) / h.bias_correction2_sqrt) + h.eps;
  p -= step_size * m / denom;
}

constexpr int kVec = 4;

// Grid-stride over groups of kVec elements (vector loads where every pointer is aligned), then
// the tail element by element.
template <class G, class O, bool kVecLoads>
__global__ void fused_adamw_kernel(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                                   G* __restrict__ g, O* __restrict__ out, int64_t n, Hyper h) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t groups = n / kVec;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < groups; i += stride) {
    const int64_t b = i * kVec;
    float pr[kVec], mr[kVec], vr[kVec], gr[kVec];
    if constexpr (kVecLoads) {
      const float4 p4 = reinterpret_cast<const float4*>(p)[i], m4 = reinterpret_cast<const float4*>(m)[i],
                   v4 = reinterpret_cast<const float4*>(v)[i];
      pr[0] = p4.x, pr[1] = p4.y, pr[2] = p4.z, pr[3] = p4.w;
      mr[0] = m4.x, mr[1] = m4.y, mr[2] = m4.z, mr[3] = m4.w;
      vr[0] = v4.x, vr[1] = v4.y, vr[2] = v4.z, vr[3] = v4.w;
      struct alignas(sizeof(G) * kVec) GV { G x[kVec]; };
      const GV gv = reinterpret_cast<const GV*>(g)[i];
#pragma unroll
      for (int k = 0; k < kVec; ++k) gr[k] = to_float(gv.x[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) pr[k] = p[b + k], mr[k] = m[b + k], vr[k] = v[b + k], gr[k] = to_float(g[b + k]);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) adamw_element(pr[k], mr[k], vr[k], gr[k], h);
    if constexpr (kVecLoads) {
      reinterpret_cast<float4*>(p)[i] = make_float4(pr[0], pr[1], pr[2], pr[3]);
      reinterpret_cast<float4*>(m)[i] = make_float4(mr[0], mr[1], mr[2], mr[3]);
      reinterpret_cast<float4*>(v)[i] = make_float4(vr[0], vr[1], vr[2], vr[3]);
      if (h.clear) {
        struct alignas(sizeof(G) * kVec) GV { G x[kVec]; } z;
#pragma unroll
        for (int k = 0; k < kVec; ++k) z.x[k] = from_float<G>(0.0f);
        reinterpret_cast<GV*>(g)[i] = z;
      }
      if (out) {
        struct alignas(sizeof(O) * kVec) OV { O x[kVec]; } o;
#pragma unroll
        for (int k = 0; k < kVec; ++k) o.x[k] = from_float<O>(pr[k]);
        reinterpret_cast<OV*>(out)[i] = o;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        p[b + k] = pr[k], m[b + k] = mr[k], v[b + k] = vr[k];
        if (h.clear) g[b + k] = from_float<G>(0.0f);
        if (out) out[b + k] = from_float<O>(pr[k]);
      }
    }
  }
  // The last n % kVec elements.
  const int64_t t = groups * kVec + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) {
    float pr = p[t], mr = m[t], vr = v[t];
    adamw_element(pr, mr, vr, to_float(g[t]), h);
    p[t] = pr, m[t] = mr, v[t] = vr;
    if (h.clear) g[t] = from_float<G>(0.0f);
    if (out) out[t] = from_float<O>(pr);
  }
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <class G, class O>
void launch_typed(const FusedAdamWLaunch& a, const Hyper& h, cudaStream_t stream) {
  auto* g = static_cast<G*>(a.g);
  auto* out = static_cast<O*>(a.out);
  const int threads = 256;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t groups = (a.n + kVec - 1) / kVec;
  // Enough blocks to fill every SM several times over; the grid-stride loop covers the rest.
  const int blocks = int(std::max<int64_t>(1, std::min<int64_t>((groups + threads - 1) / threads, int64_t(sms) * 16)));
  const bool vec = aligned(a.p, 16) && aligned(a.m, 16) && aligned(a.v, 16) && aligned(a.g, sizeof(G) * kVec) &&
                   (!a.out || aligned(a.out, sizeof(O) * kVec));
  if (vec) fused_adamw_kernel<G, O, true><<<blocks, threads, 0, stream>>>(a.p, a.m, a.v, g, out, a.n, h);
  else fused_adamw_kernel<G, O, false><<<blocks, threads, 0, stream>>>(a.p, a.m, a.v, g, out, a.n, h);
}

template <class G>
void launch_out(const FusedAdamWLaunch& a, const Hyper& h, cudaStream_t stream) {
  switch (a.out_type) {
    case DType::None:  // no copy to write: the kernel tests `out` for null
    case DType::F32: return launch_typed<G, float>(a, h, stream);
    case DType::BF16: return launch_typed<G, __nv_bfloat16>(a, h, stream);
    case DType::F16: return launch_typed<G, __half>(a, h, stream);
  }
}

}  // namespace

void launch_fused_adamw(const FusedAdamWLaunch& a, void* stream_ptr) {
  if (a.n <= 0) return;
  Hyper h;
  h.lr = a.lr, h.beta1 = a.beta1, h.beta2 = a.beta2, h.eps = a.eps, h.weight_decay = a.weight_decay;
  // As ATen's FusedAdamMathFunctor: the bias corrections in double from the step, kept as float.
  h.bias_correction1 = float(1 - ::pow(a.beta1, double(a.step)));
  h.bias_correction2_sqrt = float(std::sqrt(1 - ::pow(a.beta2, double(a.step))));
  h.pre = a.pre, h.coef = a.coef;
  h.apply_pre = a.pre != 1.0f, h.apply_coef = a.coef != 1.0f, h.clear = a.clear_grad;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  by_type(a.grad_type, "launch_fused_adamw: no gradient", [&](auto g) { launch_out<decltype(g)>(a, h, stream); });
  check_launch("fused AdamW kernel");
}

}  // namespace dssim::tb::cuda
