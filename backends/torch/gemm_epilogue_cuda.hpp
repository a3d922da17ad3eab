// One GEMM through cuBLASLt with a fused epilogue (gemm_epilogue_cuda.cpp, built where
// DSSIM_WITH_CUDA=ON finds the toolkit; DSSIM_HAVE_CUBLASLT is then defined). No torch header:
// gemm_epilogues.cpp fills the call from its tensors and libtorch's stream.
//
// cuBLAS's convention, column-major: D (m x n) = op(A) (m x k) . op(B) (k x n) [+ beta D], then the
// epilogue. A row-major torch matrix X (r x c) is the column-major (c x r) matrix X^T with ld = c;
// gemm_epilogues.cpp maps the block's row-major products onto this once.
#pragma once
#include <cstddef>
#include <cstdint>
#include "backends/torch/fused_adamw_cuda.hpp"  // DType

namespace dssim::tb::cuda {

enum class Epilogue {
  None,
  Bias,         // D += bias (length m, broadcast over columns)
  GeluAuxBias,  // aux = A.B + bias; D = gelu_tanh(aux)
  DGelu,        // D = (A.B) * gelu_tanh'(aux)
  BGradB,       // bias = sum of op(B) over k (length n): a weight-gradient GEMM's bias gradient
};

struct LtGemm {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  const void* c = nullptr;   // the addend of beta (laid out as D); null: D itself
  DType type = DType::BF16;  // of A, B, D, bias and aux (BF16 or F16)
  float beta = 0;            // D = A.B + beta C
  Epilogue epilogue = Epilogue::None;
  void* bias = nullptr;  // read (Bias, GeluAuxBias) or written (BGradB)
  void* aux = nullptr;   // written (GeluAuxBias) or read (DGelu), column-major m x n
  int64_t ld_aux = 0;
};

// Queues the GEMM on `stream` (a cudaStream_t) with `workspace` (cuBLASLt scratch, 256-byte
// aligned). Returns false, queuing nothing, when cuBLASLt offers no algorithm for this epilogue,
// type and shape (the caller then runs the unfused ops); throws on any other cuBLASLt error.
bool lt_gemm(const LtGemm& g, void* workspace, size_t workspace_bytes, void* stream);

// The workspace lt_gemm is planned for (bytes).
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

}  // namespace dssim::tb::cuda
