// The bias gradient of a linear layer, db = the sum of dy's rows, as one CUDA kernel pair
// (bias_grad_cuda.cu, compiled by nvcc when DSSIM_WITH_CUDA=ON finds the toolkit). cuBLASLt's BGRADB
// epilogue runs this sum as a separate kernel of its own (about 2 TB/s on an H100) and ATen's
// column sum is no faster; here each thread reads 16 bytes a row, meant to run the sum at the card's
// read bandwidth (on an H100: 144 sums, 5.3 ms a 1.3B step, where BGRADB's took 7.1 ms), and it can add into the bias's gradient (accumulate)
// instead of writing a temporary for AccumulateGrad to add. Used under DSSIM_WGRAD=in_place (the default). No torch or CUDA headers: gemm_epilogues.cpp fills the
// launch from its tensors and libtorch's stream.
#pragma once
#include <cstdint>
#include "backends/torch/fused_adamw_cuda.hpp"  // DType

namespace dssim::tb::cuda {

// out[c] (+)= sum over r < rows of x[r * ld + c], c < cols, summed in fp32 in a fixed order (two
// passes: `splits` partial sums per column into `partial`, then their sum), so the result does
// not depend on scheduling. x and out are of `type`.
struct ColumnSumLaunch {
  const void* x = nullptr;
  void* out = nullptr;
  float* partial = nullptr;  // [splits x cols] fp32 workspace
  int64_t rows = 0, cols = 0, ld = 0;
  int splits = 1;
  DType type = DType::BF16;
  bool accumulate = false;  // out += the sum (else out = the sum)
};

// Whether the kernel takes this layout: cols and ld multiples of 16 bytes' worth of elements, x
// 16-byte aligned. Otherwise the caller sums with ATen.
bool column_sum_supported(const void* x, int64_t cols, int64_t ld, DType type);
// The number of row splits the launch should use (enough blocks to fill the card).
int column_sum_splits(int64_t rows, int64_t cols, int multiprocessors);
// Queues both passes on `stream` (a cudaStream_t); throws on a launch error.
void launch_column_sum(const ColumnSumLaunch& a, void* stream);

}  // namespace dssim::tb::cuda
