// The block's linears with their bias, GELU and bias gradients fused into the GEMMs (issue 15).
//
// On CUDA with 16-bit tensors, where dssim is built with cuBLASLt (DSSIM_HAVE_CUBLASLT), the MLP
// runs as four GEMMs and the biased linears' backward as two, each epilogue doing what ATen runs
// as separate kernels (Megatron's and Transformer Engine's layout of the same idea):
//   forward   pre = x W1^T + b1, m = gelu_tanh(pre)   one GEMM (GELU_AUX_BIAS: writes m and pre)
//             out = m W2^T + b2 + residual            one GEMM (BIAS, beta 1)
//   backward  dpre = (dout W2) * gelu'(pre)           one GEMM (DGELU)
//             dW2 = dout^T m, db2 = sum(dout)         one GEMM (BGRADB)
//             dW1 = dpre^T x, db1 = sum(dpre)         one GEMM (BGRADB)
//             dx = dpre W1                            one GEMM
// and for a biased linear's backward dW = dy^T x with db = sum(dy) in one call (BGRADB; on an H100
// cuBLASLt runs that sum as a kernel of its own, about 2 TB/s, as fast as ATen's, so BGRADB saves
// launches, not bytes). Into temporaries, which AccumulateGrad adds into the gradient buffers.
// DSSIM_WGRAD=in_place (the default since one H100 measured it faster: the 1.3B model's backward
// 3.6 ms a micro-batch less, docs/torch-backend.md) instead adds each weight
// gradient by its GEMM (beta 1) straight into the parameter's preset gradient buffer
// (grad_in_place) and each bias gradient by dssim's column-sum kernel (bias_grad_cuda.hpp):
//             dW2 += dout^T m, db2 += sum(dout)       one GEMM (beta 1) + the column-sum kernel
// with no temporary and no AccumulateGrad kernel. Saved tensors are ATen's (x, pre, m), so memory
// is unchanged. Elsewhere (CPUs, fp32, libtorch 1.13, no cuBLASLt, shapes cuBLASLt refuses) these
// are ATen's ops, exactly the expressions they replace. DSSIM_GEMM_EPILOGUES=0 in the environment turns the fused path off, its
// letters pick parts (f forward, g GELU backward, b bias gradients): A/B measurements.
#pragma once
#include <string>
#include <utility>
#include <torch/torch.h>

namespace dssim::tb {

// gelu_tanh(x W1^T + b1) W2^T, plus b2 when it is defined (tensor parallelism adds the row-parallel
// layer's bias after the reduction instead), plus `residual` when it is defined (added by the GEMM).
at::Tensor mlp(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
               const at::Tensor& b2, const at::Tensor& residual = at::Tensor());
// x W^T + b, plus `residual` when it is defined (added by the GEMM).
at::Tensor biased_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const at::Tensor& residual = at::Tensor());
// dw = dy^T x and db = the sum of dy's rows (db may be undefined: no bias), written into dw and db
// (contiguous, views allowed), or added into them with `accumulate` (the GEMM with beta 1, the sum
// added). Not accumulating, under DSSIM_WGRAD=bgradb (the engine before), one cuBLASLt GEMM with the sum in
// its BGRADB epilogue where the letter b allows; in place, the GEMM and dssim's column-sum kernel
// (bias_grad_cuda.hpp). ATen's ops elsewhere.
void linear_weight_grads(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw, const at::Tensor& db,
                         bool accumulate = false);
// db (+)= the sum of dy's rows, dy [T x n] with unit column stride: dssim's kernel on GPUs in the
// in-place mode (wgrad_in_place), ATen's sum elsewhere.
void bias_grad(const at::Tensor& dy, const at::Tensor& db, bool accumulate);
// The gradient buffer of leaf parameter p, where the block's backward adds p's gradient into it in
// place: defined (the engine's preset view into its gradient buffer), of p's shape and type, dense,
// with no graph of the backward being built, and DSSIM_WGRAD=in_place. AccumulateGrad would add
// into that same buffer (`grad += new` with grad mode off), so the values are the same up to
// rounding (the GEMM adds in fp32 before rounding once; AccumulateGrad rounds the temporary first);
// the temporary, AccumulateGrad's kernel and its read of the temporary are gone. Undefined otherwise:
// the caller returns the gradient for AccumulateGrad.
at::Tensor grad_in_place(const at::Tensor& p);
// DSSIM_WGRAD: "bgradb" (false), each weight and bias gradient into a temporary by one
// cuBLASLt BGRADB GEMM (where the letter b of DSSIM_GEMM_EPILOGUES allows), which AccumulateGrad
// then adds into the gradient buffer; or "in_place" (unset: true): grad_in_place, the bias kernel.
bool wgrad_in_place();
// Where a linear's weight and bias gradients go (b empty or undefined: no bias): both parameters'
// buffers, added into (in_place), where grad_in_place gives both; else new tensors of their shapes
// for linear_weight_grads to write and the backward to return for AccumulateGrad.
struct WeightGradTarget {
  at::Tensor dw, db;
  bool in_place = false;
  // What the backward returns for w and b: nothing where added in place.
  std::pair<at::Tensor, at::Tensor> returned() const {
    return in_place ? std::pair<at::Tensor, at::Tensor>() : std::pair<at::Tensor, at::Tensor>(dw, db);
  }
};
WeightGradTarget weight_grad_target(const at::Tensor& w, const at::Tensor& b);
// Overrides DSSIM_WGRAD for this process (tests, A/B runs in one process).
void set_wgrad_in_place(bool on);
// The fused block's GEMMs one at a time, on 2-D contiguous tensors, as mlp / biased_linear and
// their backward run them (and dssim calibrate's `epilogues` family times them, backends/torch/
// calibrate_gemm.cpp). Each writes its outputs and returns true; false, running nothing, where it would
// not run fused (not built, CPU, fp32, turned off, a shape cuBLASLt refuses). x [T x k], w [n x k]:
//   gemm_gelu_aux_bias  pre = x W^T + b, m = gelu_tanh(pre)        (GELU_AUX_BIAS)
//   gemm_bias_residual  out = x W^T [+ b] [+ residual]             (BIAS, beta 1; b, residual optional)
//   gemm_dgelu          dpre = (dy W) * gelu_tanh'(pre), dy [T x n] (DGELU)
//   gemm_bgradb         dw = dy^T x, db = the sum of dy's rows      (BGRADB)
bool gemm_gelu_aux_bias(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& m,
                        const at::Tensor& pre);
bool gemm_bias_residual(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& residual,
                        const at::Tensor& out);
bool gemm_dgelu(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& pre, const at::Tensor& dpre);
bool gemm_bgradb(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw, const at::Tensor& db);
// Whether mlp / biased_linear would run fused for these tensors (false where not built, on CPUs,
// or when turned off).
bool gemm_epilogues_apply(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = at::Tensor());
// What runs fused on GPUs, for the run's report: "" where this dssim has no cuBLASLt (or no CUDA
// libtorch), "off" with DSSIM_GEMM_EPILOGUES=0, else its letters ("fgb" by default).
std::string gemm_epilogues_mode();
// GEMMs that cuBLASLt had no kernel for with their epilogue, run through ATen's ops instead (the
// first one is reported on stderr).
int64_t gemm_epilogue_fallbacks();

}  // namespace dssim::tb
