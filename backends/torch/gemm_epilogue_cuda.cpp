// cuBLASLt GEMMs with fused epilogues (gemm_epilogue_cuda.hpp): descriptors built per call, the
// algorithm cuBLASLt's heuristic picks cached per shape and epilogue (the heuristic query costs
// tens of microseconds; a block runs a dozen GEMMs per micro-batch).
#include "backends/torch/gemm_epilogue_cuda.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

namespace dssim::tb::cuda {
namespace {

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt: ") + what + " failed (status " + std::to_string(int(s)) + ")");
}

cublasLtHandle_t handle() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t x = nullptr;
    check(cublasLtCreate(&x), "cublasLtCreate");
    return x;
  }();
  return h;
}

cudaDataType_t data_type(DType t) {
  if (t == DType::BF16) return CUDA_R_16BF;
  if (t == DType::F16) return CUDA_R_16F;
  throw std::invalid_argument("lt_gemm: A, B and D must be bf16 or fp16");
}

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::GeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::BGradB: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Owns the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Descriptors() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// What the heuristic's choice depends on (pointers only through their alignment, which the
// caching allocator keeps at 512 bytes; the caller checks 16).
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool, int64_t>;
struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

}  // namespace

bool lt_gemm(const LtGemm& g, void* workspace, size_t workspace_bytes, void* stream) {
  const cudaDataType_t t = data_type(g.type);
  Descriptors ds;
  check(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
  check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
  const cublasLtEpilogue_t e = lt_epilogue(g.epilogue);
  check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e), "set EPILOGUE");
  if (g.epilogue != Epilogue::None && g.epilogue != Epilogue::DGelu) {
    check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias), "set BIAS_POINTER");
    check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &t, sizeof t), "set BIAS_DATA_TYPE");
  }
  if (g.epilogue == Epilogue::GeluAuxBias || g.epilogue == Epilogue::DGelu) {
    check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof g.aux),
          "set EPILOGUE_AUX_POINTER");
    check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.ld_aux, sizeof g.ld_aux),
          "set EPILOGUE_AUX_LD");
    check(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &t, sizeof t),
          "set EPILOGUE_AUX_DATA_TYPE");
  }
  // Stored shapes: op(A) is m x k, so A itself is k x m when transposed.
  check(cublasLtMatrixLayoutCreate(&ds.a, t, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda), "layout A");
  check(cublasLtMatrixLayoutCreate(&ds.b, t, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb), "layout B");
  check(cublasLtMatrixLayoutCreate(&ds.d, t, g.m, g.n, g.ldd), "layout D");

  static std::mutex mu;
  static std::map<Key, Choice> cache;
  const Key key{g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, int(g.type), int(g.epilogue), g.beta != 0, g.ld_aux};
  Choice choice;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      choice = it->second;
    } else {
      cublasLtMatmulPreference_t pref = nullptr;
      check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
      cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace_bytes, sizeof workspace_bytes);
      cublasLtMatmulHeuristicResult_t result{};
      int returned = 0;
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(handle(), ds.op, ds.a, ds.b, ds.d, ds.d, pref, 1, &result, &returned);
      cublasLtMatmulPreferenceDestroy(pref);
      // An epilogue cuBLASLt does not offer for these types or this shape is not an error: the
      // caller runs the unfused ops.
      if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) check(s, "cublasLtMatmulAlgoGetHeuristic");
      choice.found = s == CUBLAS_STATUS_SUCCESS && returned > 0;
      if (choice.found) choice.algo = result.algo;
      cache.emplace(key, choice);
    }
  }
  if (!choice.found) return false;
  const float alpha = 1.0f, beta = g.beta;
  check(cublasLtMatmul(handle(), ds.op, &alpha, g.a, ds.a, g.b, ds.b, &beta, g.c ? g.c : g.d, ds.d, g.d, ds.d, &choice.algo, workspace,
                       workspace_bytes, static_cast<cudaStream_t>(stream)),
        "cublasLtMatmul");
  return true;
}

}  // namespace dssim::tb::cuda
