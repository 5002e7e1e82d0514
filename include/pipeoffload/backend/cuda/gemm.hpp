// pipeoffload/backend/cuda/gemm.hpp: the GPT's GEMMs on cuBLASLt, bf16 in, fp32 accumulation.
//
// Callers describe a GEMM exactly as they would call the CPU GEMM (row-major RowMajorGemm,
// e.g. linear_forward / linear_dgrad / linear_wgrad from shapes.hpp); to_column_major turns it
// into cuBLASLt's column-major operands, checked on the CPU by tests/cuda/test_host.cpp. B
// (dgrad) and W (wgrad) are separate GEMMs, as the split backward needs: dgrad writes bf16,
// wgrad accumulates (beta = 1) into the fp32 gradient. The cuBLASLt objects and the
// heuristic's choice come from the device's plan cache (gemm_plans.hpp: one per shape, output
// type, epilogue and operand alignment), so a step builds none of them.
/// @file
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <string>

#include "check.hpp"
#include "cuda.hpp"
#include "gemm_key.hpp"
#include "gemm_plans.hpp"
#include "shapes.hpp"

namespace pipeoffload::cuda {

namespace detail {

/// The GEMM of `g` with `bias` (null: none) through ctx's plan cache (a context without one
/// builds a plan for this call). Returns false, having done nothing, when a bias was asked
/// and cuBLASLt has no algorithm with the bias epilogue for this key.
inline bool run_gemm(const backend::CudaContext& ctx, const RowMajorGemm& g, const __nv_bfloat16* A,
                     const __nv_bfloat16* B, void* C, Out out, const void* bias) {
  if (g.M == 0 || g.N == 0) return true;
  const GemmKey key = gemm_key(g, out, reinterpret_cast<std::uintptr_t>(A), reinterpret_cast<std::uintptr_t>(B),
                               reinterpret_cast<std::uintptr_t>(C), reinterpret_cast<std::uintptr_t>(bias));
  std::unique_ptr<GemmPlan> own;
  GemmPlan* plan = nullptr;
  if (ctx.gemms != nullptr) {
    plan = &ctx.gemms->get(key);
  } else {
    own = make_gemm_plan(ctx.lt, key, ctx.workspace_bytes);
    plan = own.get();
  }
  const ColMajorGemm& c = plan->c;
  if (!plan->found) {
    if (bias != nullptr) return false;
    throw cuda_error("cuda::gemm: cuBLASLt has no algorithm for m = " + std::to_string(c.m) +
                     ", n = " + std::to_string(c.n) + ", k = " + std::to_string(c.k) + " (leading dimensions " +
                     std::to_string(c.lda) + ", " + std::to_string(c.ldb) + ", " + std::to_string(c.ldc) + ")");
  }
  if (bias != nullptr)
    PIPEOFFLOAD_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  const float alpha = g.alpha, beta = g.beta;
  // cuBLASLt's A is the row-major B and its B the row-major A (c.swapped).
  PIPEOFFLOAD_CUDA_CHECK(cublasLtMatmul(ctx.lt, plan->desc.get(), &alpha, B, plan->a.get(), A, plan->b.get(), &beta, C,
                                        plan->d.get(), C, plan->d.get(), &plan->algo, ctx.workspace,
                                        ctx.workspace_bytes, ctx.cuda_stream));
  return true;
}

}  // namespace detail

/// C = alpha op(A) op(B) + beta C with A, B bf16 row-major as in `g`, on ctx's stream with its
/// workspace. An empty product (M or N zero) does nothing; K zero scales C by beta.
inline void gemm(const backend::CudaContext& ctx, const RowMajorGemm& g, const __nv_bfloat16* A, const __nv_bfloat16* B,
                 void* C, Out out) {
  detail::run_gemm(ctx, g, A, B, C, out, nullptr);
}

/// C = alpha op(A) op(B) + beta C + bias, the bias (g.N values, of C's type: bf16 for
/// Out::bf16, fp32 for Out::f32) added to every row of the row-major C by cuBLASLt's bias
/// epilogue, in fp32 before C's one rounding. Returns false, having computed the GEMM without
/// the bias, when cuBLASLt offers no algorithm with the epilogue for this key: the caller then
/// adds the bias itself.
inline bool gemm_bias(const backend::CudaContext& ctx, const RowMajorGemm& g, const __nv_bfloat16* A,
                      const __nv_bfloat16* B, void* C, Out out, const void* bias) {
  if (detail::run_gemm(ctx, g, A, B, C, out, bias)) return true;
  detail::run_gemm(ctx, g, A, B, C, out, nullptr);
  return false;
}

}  // namespace pipeoffload::cuda
