// A pre-norm block's LayerNorm and the residual stream it forks from, as one autograd function
// (issue 15). In the block
//   x1 = x + attention(LayerNorm_1(x)),  x2 = x1 + mlp(LayerNorm_2(x1))
// x and x1 each feed a norm and a residual add, so autograd sums two gradients at each: the norm's
// dx and the residual's, an add kernel that reads both and writes the sum (3 bytes an element,
// twice a layer). layer_norm_residual(x) returns the norm's output and x itself (a view of it that
// carries this function's edge), so the backward receives both gradients and sums them inside
// LayerNorm's backward: dx = LayerNorm'(dy) + dres, dgamma, dbeta. On CUDA with contiguous 16-bit
// or fp32 rows that is layer_norm_cuda.hpp's kernel pair (6 bytes an element where ATen's backward
// and the add move 8); elsewhere ATen's native_layer_norm_backward and an in-place add, the same
// expressions. The forward is ATen's native_layer_norm; the saved tensors (x, gamma, beta, mean,
// rstd) are those at::layer_norm saves, so memory is unchanged. The norm's gain and bias gradients
// are added into the parameters' preset gradient buffers where gemm_epilogues.hpp's grad_in_place
// gives them (AccumulateGrad otherwise).
//
// DSSIM_NORM_RESIDUAL=separate in the environment keeps the engine before (at::layer_norm, the
// fork's add by autograd), for A/B runs; "fused" (unset) uses this function.
#pragma once
#include <torch/torch.h>

#include <tuple>

namespace dssim::tb {

struct NormResidual {
  at::Tensor y;         // LayerNorm(x) over the last dimension, eps 1e-5
  at::Tensor residual;  // x (through the function where it runs: its gradient joins the norm's)
};
// The block's norm of x [.., h] with gain w and bias b [h]; the function where the fused mode is
// on and a gradient is wanted, else at::layer_norm and x as it is.
NormResidual layer_norm_residual(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// The backward: dx = LayerNorm's input gradient of dy plus dres (undefined: none), and the gain's
// and bias's gradients (b undefined: no bias gradient). mean and rstd as native_layer_norm returns
// them. Where dw_into / db_into are defined the sums are added into them and the returned dw / db
// are undefined. Used by the function and by dssim calibrate's layer_norm_residual_backward row.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& w,
    const at::Tensor& b, const at::Tensor& dres, const at::Tensor& dw_into = at::Tensor(),
    const at::Tensor& db_into = at::Tensor());

// DSSIM_NORM_RESIDUAL: true unless "separate"; set_norm_residual_fused overrides it (tests, A/B).
bool norm_residual_fused();
void set_norm_residual_fused(bool on);
// Whether the last backward ran dssim's kernels (false: ATen's), for tests.
bool norm_residual_ran_kernel();

}  // namespace dssim::tb
