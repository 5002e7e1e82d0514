// pipeoffload/backend/cuda/gemm_key.hpp: what a cuBLASLt GEMM plan depends on, as a plain value
// (no CUDA header: tests/cuda/test_host_plans.cpp checks it on the CPU).
//
// cuBLASLt's matmul descriptor, its three matrix layouts, the preference (workspace and operand
// alignments) and the heuristic's choice depend only on the product's shape and leading
// dimensions, the output type, the epilogue and how aligned each operand is; not on the data.
// backend::Cuda keeps one plan per GemmKey (cuda::GemmPlans), so a step's GEMMs (12 per GPT
// block per pass) reuse them instead of rebuilding all of it and asking the heuristic again.
/// @file
#pragma once

#include <compare>
#include <cstdint>

#include "shapes.hpp"

namespace pipeoffload::cuda {

/// Element type of the output C (= D): bf16 activations or fp32 gradients.
enum class Out : std::uint8_t { bf16, f32 };

/// What one cuBLASLt plan is for: a row-major GEMM's shape, output type, epilogue and operand
/// alignments (cuda::RowMajorGemm's names). Ordered, so it can key a map.
struct GemmKey {
  Op ta = Op::n,        ///< op on the row-major A
      tb = Op::n;       ///< op on the row-major B
  long long M = 0,      ///< rows of C
      N = 0,            ///< columns of C
      K = 0,            ///< the inner dimension
      lda = 0,          ///< A's row stride, elements
      ldb = 0,          ///< B's row stride, elements
      ldc = 0;          ///< C's row stride, elements
  Out out = Out::bf16;  ///< element type of C
  bool bias = false;    ///< CUBLASLT_EPILOGUE_BIAS: D += bias broadcast over rows (of the row-major product)
  /// pointer_alignment of the row-major A, B, C and of the bias (1 when there is none).
  std::uint32_t align_a = 256,
                align_b = 256,  ///< B's alignment, bytes
      align_c = 256,            ///< C's alignment, bytes
      align_bias = 1;           ///< the bias's alignment, bytes (1 without bias)
  /// Lexicographic order over the fields, in declaration order (and equality).
  friend constexpr auto operator<=>(const GemmKey&, const GemmKey&) = default;
};

/// The key of C = op(A) op(B) (+ bias) with operands at these addresses (alpha and beta are
/// arguments of each call, not part of the plan).
constexpr GemmKey gemm_key(const RowMajorGemm& g, Out out, std::uintptr_t a, std::uintptr_t b, std::uintptr_t c,
                           std::uintptr_t bias) {
  return {g.ta,
          g.tb,
          g.M,
          g.N,
          g.K,
          g.lda,
          g.ldb,
          g.ldc,
          out,
          bias != 0,
          pointer_alignment(a),
          pointer_alignment(b),
          pointer_alignment(c),
          bias != 0 ? pointer_alignment(bias) : 1u};
}

}  // namespace pipeoffload::cuda
