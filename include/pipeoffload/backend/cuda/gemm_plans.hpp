// pipeoffload/backend/cuda/gemm_plans.hpp: cuBLASLt plans (matmul descriptor, matrix layouts,
// preference, heuristic choice) cached per GemmKey, owned by backend::Cuda.
//
// A plan depends on the GEMM's shape, leading dimensions, output type, epilogue and operand
// alignments, never on the data (gemm_key.hpp), so one plan serves every call with that key:
// the descriptors are built and the heuristic asked once per key, not for each of a step's
// GEMMs. The bias epilogue's pointer is the one attribute that changes between calls; it is set
// on the cached descriptor just before each cublasLtMatmul. A GemmPlans belongs to one device
// and is used by its one driving thread (backend::Cuda is not shared between threads).
/// @file
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "check.hpp"
#include "gemm_key.hpp"
#include "shapes.hpp"

namespace pipeoffload::cuda {

namespace detail {

struct LtDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};

inline std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LtDeleter> lt_layout(cudaDataType_t t, long long rows,
                                                                          long long cols, long long ld) {
  cublasLtMatrixLayout_t l = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(
      cublasLtMatrixLayoutCreate(&l, t, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ld));
  return std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LtDeleter>(l);
}

inline cublasOperation_t lt_op(Op o) { return o == Op::n ? CUBLAS_OP_N : CUBLAS_OP_T; }

}  // namespace detail

/// One GEMM's cuBLASLt objects and the heuristic's algorithm. `found` is false when cuBLASLt has
/// no algorithm for the key (with the bias epilogue, the caller then adds the bias itself).
struct GemmPlan {
  ColMajorGemm c;  ///< the product as cuBLASLt sees it (to_column_major of the key's)
  std::unique_ptr<cublasLtMatmulDescOpaque_t, detail::LtDeleter> desc;  ///< the matmul descriptor
  std::unique_ptr<cublasLtMatrixLayoutOpaque_t, detail::LtDeleter> a,   ///< cuBLASLt's A layout (bf16)
      b,                                                                ///< cuBLASLt's B layout (bf16)
      d;                                                                ///< the layout of C and D (the output type)
  cublasLtMatmulAlgo_t algo{};  ///< the heuristic's algorithm (valid when `found`)
  bool found = false;           ///< did cuBLASLt have an algorithm for the key?
};

/// Builds the plan of `key` (see the file comment): bf16 operands, fp32 compute and scale,
/// cuBLASLt's A being the row-major B (to_column_major), a workspace of `workspace_bytes`.
inline std::unique_ptr<GemmPlan> make_gemm_plan(cublasLtHandle_t lt, const GemmKey& key, std::size_t workspace_bytes) {
  auto p = std::make_unique<GemmPlan>();
  p->c = to_column_major(RowMajorGemm{key.ta, key.tb, key.M, key.N, key.K, key.lda, key.ldb, key.ldc, 1.0f, 0.0f});
  const ColMajorGemm& c = p->c;
  cublasLtMatmulDesc_t raw = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  p->desc.reset(raw);
  const cublasOperation_t ta = detail::lt_op(c.transa), tb = detail::lt_op(c.transb);
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (key.bias) {
    // D (column-major, c_rows = the row-major N features) gets bias[i] added to row i of every
    // column, in fp32 before D's rounding; the bias has D's type (cuBLASLt's default).
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  }
  const cudaDataType_t ct = key.out == Out::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  p->a = detail::lt_layout(CUDA_R_16BF, c.a_rows, c.a_cols, c.lda);
  p->b = detail::lt_layout(CUDA_R_16BF, c.b_rows, c.b_cols, c.ldb);
  p->d = detail::lt_layout(ct, c.c_rows, c.c_cols, c.ldc);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, detail::LtDeleter> pref(raw_pref);
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace_bytes, sizeof workspace_bytes));
  // The heuristic assumes 256-byte aligned operands unless told otherwise; operands inside a
  // parameter vector or a saved buffer may be less aligned (cuBLASLt's A is the row-major B).
  const std::uint32_t align[4] = {key.align_b, key.align_a, key.align_c, key.align_c};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(raw_pref, align_attr[i], &align[i], sizeof align[i]));
  if (key.bias) {
    // The heuristic reads the bias pointer's alignment from the descriptor: one with exactly
    // the key's alignment stands in for the calls' pointers.
    const void* stand_in = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(key.align_bias));
    PIPEOFFLOAD_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &stand_in, sizeof stand_in));
  }
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, raw, p->a.get(), p->b.get(), p->d.get(), p->d.get(),
                                                           raw_pref, 1, &best, &found);
  // An epilogue cuBLASLt does not offer for this key is not an error: the caller adds the bias.
  if (!(key.bias && st == CUBLAS_STATUS_NOT_SUPPORTED)) PIPEOFFLOAD_CUDA_CHECK(st);
  p->found = st == CUBLAS_STATUS_SUCCESS && found > 0;
  p->algo = best.algo;
  return p;
}

/// The plans of one device, by key.
class GemmPlans {
 public:
  /// Plans for handle `lt`, each allowed a workspace of `workspace_bytes`.
  GemmPlans(cublasLtHandle_t lt, std::size_t workspace_bytes) : lt_(lt), workspace_(workspace_bytes) {}
  /// The plan of `key`, built on its first use.
  GemmPlan& get(const GemmKey& key) {
    std::unique_ptr<GemmPlan>& p = plans_[key];
    if (!p) p = make_gemm_plan(lt_, key, workspace_);
    return *p;
  }
  /// Plans built so far.
  std::size_t size() const { return plans_.size(); }

 private:
  cublasLtHandle_t lt_;
  std::size_t workspace_;
  std::map<GemmKey, std::unique_ptr<GemmPlan>> plans_;
};

}  // namespace pipeoffload::cuda
