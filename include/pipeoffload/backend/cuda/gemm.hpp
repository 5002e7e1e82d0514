// pipeoffload/backend/cuda/gemm.hpp: the GPT's GEMMs on cuBLASLt, bf16 in, fp32 accumulation.
//
// Callers describe a GEMM exactly as they would call the CPU GEMM (row-major RowMajorGemm,
// e.g. linear_forward / linear_dgrad / linear_wgrad from shapes.hpp); to_column_major turns it
// into cuBLASLt's column-major operands, checked on the CPU by tests/cuda/test_host.cpp. B
// (dgrad) and W (wgrad) are separate GEMMs, as the split backward needs: dgrad writes bf16,
// wgrad accumulates (beta = 1) into the fp32 gradient.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <memory>

#include "check.hpp"
#include "cuda.hpp"
#include "shapes.hpp"

namespace pipeoffload::cuda {

/// Element type of the output C (= D): bf16 activations or fp32 gradients.
enum class Out { bf16, f32 };

namespace detail {

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};

inline std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter> layout(cudaDataType_t t, long long rows,
                                                                         long long cols, long long ld) {
  cublasLtMatrixLayout_t l = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(
      cublasLtMatrixLayoutCreate(&l, t, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ld));
  return std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>(l);
}

inline cublasOperation_t op(Op o) { return o == Op::n ? CUBLAS_OP_N : CUBLAS_OP_T; }

}  // namespace detail

/// C = alpha op(A) op(B) + beta C with A, B bf16 row-major as in `g`, on ctx's stream with its
/// workspace. An empty product (M or N zero) does nothing; K zero scales C by beta.
inline void gemm(const backend::CudaContext& ctx, const RowMajorGemm& g, const __nv_bfloat16* A, const __nv_bfloat16* B,
                 void* C, Out out) {
  if (g.M == 0 || g.N == 0) return;
  const ColMajorGemm c = to_column_major(g);
  cublasLtMatmulDesc_t raw_desc = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  std::unique_ptr<cublasLtMatmulDescOpaque_t, detail::DescDeleter> desc(raw_desc);
  const cublasOperation_t ta = detail::op(c.transa), tb = detail::op(c.transb);
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescSetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulDescSetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  const cudaDataType_t ct = out == Out::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // cuBLASLt's A is the row-major B and its B the row-major A (c.swapped).
  auto la = detail::layout(CUDA_R_16BF, c.a_rows, c.a_cols, c.lda);
  auto lb = detail::layout(CUDA_R_16BF, c.b_rows, c.b_cols, c.ldb);
  auto lc = detail::layout(ct, c.c_rows, c.c_cols, c.ldc);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, detail::DescDeleter> pref(raw_pref);
  const std::size_t ws = ctx.workspace_bytes;
  PIPEOFFLOAD_CUDA_CHECK(
      cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  // The heuristic assumes 256-byte aligned operands unless told otherwise; operands inside a
  // parameter vector or a saved buffer may be less aligned (cuBLASLt's A is the row-major B).
  const std::uint32_t align[4] = {
      pointer_alignment(reinterpret_cast<std::uintptr_t>(B)), pointer_alignment(reinterpret_cast<std::uintptr_t>(A)),
      pointer_alignment(reinterpret_cast<std::uintptr_t>(C)), pointer_alignment(reinterpret_cast<std::uintptr_t>(C))};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(raw_pref, align_attr[i], &align[i], sizeof align[i]));
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.lt, raw_desc, la.get(), lb.get(), lc.get(), lc.get(),
                                                        raw_pref, 1, &best, &found));
  if (found == 0)
    throw cuda_error("cuda::gemm: cuBLASLt has no algorithm for m = " + std::to_string(c.m) +
                     ", n = " + std::to_string(c.n) + ", k = " + std::to_string(c.k) + " (leading dimensions " +
                     std::to_string(c.lda) + ", " + std::to_string(c.ldb) + ", " + std::to_string(c.ldc) + ")");
  const float alpha = c.alpha, beta = c.beta;
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmul(ctx.lt, raw_desc, &alpha, B, la.get(), A, lb.get(), &beta, C, lc.get(), C,
                                        lc.get(), &best.algo, ctx.workspace, ctx.workspace_bytes, ctx.cuda_stream));
}

}  // namespace pipeoffload::cuda
