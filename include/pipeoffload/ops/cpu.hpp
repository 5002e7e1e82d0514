// pipeoffload/ops/cpu.hpp: ops for users' layers on the CPU backend (po::ops, fp32, row-major
// (rows, n) tensors): RMSNorm, rotary embeddings, SwiGLU, token embedding, softmax
// cross-entropy, residual add. Each takes the pass's backend::CpuContext first, as a CUDA twin
// would take its CudaContext, so a layer templated on its context calls them by the same names;
// the per-element math is ops/math.hpp's, which CUDA kernels share. Sums run in index order:
// the same inputs give the same bits on every run. Bad ids are refused with a sentence naming
// the value and the range.
/// @file
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../backend/cpu/context.hpp"
#include "../error.hpp"
#include "math.hpp"

namespace pipeoffload::ops {

using backend::CpuContext;

// ---- RMSNorm ---------------------------------------------------------------------------------

/// y (rows, n) = x * rstd * weight, rstd (rows) = 1 / sqrt(mean(x^2) + eps) per row.
inline void rmsnorm_forward(const CpuContext&, const float* x, const float* weight, float* y, float* rstd,
                            long long rows, int n, float eps) {
  for (long long r = 0; r < rows; ++r) rstd[r] = rmsnorm_rstd(x + r * n, n, eps);
  for (long long r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * rstd[r] * weight[i];
}

/// y from the saved rstd (a layer that recomputes the normalized input in backward).
inline void rmsnorm_recompute(const CpuContext&, const float* x, const float* rstd, const float* weight, float* y,
                              long long rows, int n) {
  for (long long r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * rstd[r] * weight[i];
}

/// dx (rows, n) = RMSNorm's input gradient from dy (the normalized output's gradient); added to
/// dx when `accumulate`.
inline void rmsnorm_backward(const CpuContext&, const float* dy, const float* x, const float* rstd, const float* weight,
                             float* dx, long long rows, int n, bool accumulate) {
  for (long long r = 0; r < rows; ++r)
    rmsnorm_backward_row(dy + r * n, x + r * n, rstd[r], weight, dx + r * n, n, accumulate);
}

/// dweight (n) += sum over rows of dy * x * rstd, rows in order.
inline void rmsnorm_weight_grad(const CpuContext&, const float* dy, const float* x, const float* rstd, float* dweight,
                                long long rows, int n) {
  for (long long r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) dweight[i] += dy[r * n + i] * x[r * n + i] * rstd[r];
}

// ---- Rotary position embeddings -----------------------------------------------------------

/// RoPE's angles: cos and sin of p * theta^(-2j / head_dim) for positions p in [0, positions)
/// and pairs j in [0, head_dim / 2), (positions, head_dim / 2) each, computed in double.
struct RopeTable {
  int positions = 0;       ///< rows of the table
  int head_dim = 0;        ///< a head's width (even)
  std::vector<float> cos;  ///< (positions, head_dim / 2)
  std::vector<float> sin;  ///< (positions, head_dim / 2)

  /// The table for `positions` positions of heads of `head_dim` (even) with base `theta`.
  RopeTable(int positions_, int head_dim_, float theta) : positions(positions_), head_dim(head_dim_) {
    if (positions < 1 || head_dim < 2 || head_dim % 2 != 0 || !(theta > 1.0f))
      throw shape_error("ops::RopeTable: positions = " + std::to_string(positions) +
                        ", head_dim = " + std::to_string(head_dim) + ", theta = " + std::to_string(theta) +
                        "; need positions >= 1, an even head_dim >= 2 and theta > 1");
    const std::size_t half = static_cast<std::size_t>(head_dim) / 2;
    cos.resize(static_cast<std::size_t>(positions) * half);
    sin.resize(cos.size());
    for (std::size_t p = 0; p < static_cast<std::size_t>(positions); ++p)
      for (std::size_t j = 0; j < half; ++j) {
        const double angle =
            static_cast<double>(p) *
            std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
        cos[p * half + j] = static_cast<float>(std::cos(angle));
        sin[p * half + j] = static_cast<float>(std::sin(angle));
      }
  }
};

/// Rotates, in place, each head's pairs (2j, 2j + 1) of the rows of x (rows, width; width a
/// multiple of the table's head_dim) by the angles of the row's position (positions, one per
/// row, each in [0, table.positions)); `inverse` rotates back (the backward of a rotation).
inline void rope(const CpuContext&, float* x, const std::int32_t* positions, long long rows, int width,
                 const RopeTable& table, bool inverse) {
  const std::size_t dh = static_cast<std::size_t>(table.head_dim), half = dh / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (long long t = 0; t < rows; ++t) {
    const std::int32_t p = positions[t];
    if (p < 0 || p >= table.positions)
      throw shape_error("ops::rope: row " + std::to_string(t) + " has position " + std::to_string(p) +
                        ", outside [0, " + std::to_string(table.positions - 1) + "]");
    const float* c = table.cos.data() + static_cast<std::size_t>(p) * half;
    const float* s = table.sin.data() + static_cast<std::size_t>(p) * half;
    for (std::size_t e = 0; e < static_cast<std::size_t>(width); e += dh)
      for (std::size_t j = 0; j < half; ++j)
        rope_pair(x + static_cast<std::size_t>(t) * static_cast<std::size_t>(width) + e + 2 * j, c[j], sign * s[j]);
  }
}

// ---- SwiGLU --------------------------------------------------------------------------------

/// out = silu(gate) * up, count elements.
inline void swiglu_forward(const CpuContext&, const float* gate, const float* up, float* out, long long count) {
  for (long long e = 0; e < count; ++e) out[e] = silu(gate[e]) * up[e];
}

/// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
inline void swiglu_backward(const CpuContext&, const float* dout, const float* gate, const float* up, float* dgate,
                            float* dup, long long count) {
  for (long long e = 0; e < count; ++e) {
    dgate[e] = dout[e] * up[e] * silu_grad(gate[e]);
    dup[e] = dout[e] * silu(gate[e]);
  }
}

// ---- Token embedding -------------------------------------------------------------------------

/// out (rows, n) = table[tokens[r]] (table (vocab, n)); a token outside [0, vocab) is refused.
inline void embedding_forward(const CpuContext&, const std::int32_t* tokens, const float* table, float* out,
                              long long rows, int n, int vocab) {
  for (long long r = 0; r < rows; ++r) {
    if (tokens[r] < 0 || tokens[r] >= vocab)
      throw error("ops::embedding_forward: token " + std::to_string(tokens[r]) + " at row " + std::to_string(r) +
                  " is outside [0, " + std::to_string(vocab - 1) + "]");
    std::memcpy(out + r * n, table + static_cast<long long>(tokens[r]) * n,
                static_cast<std::size_t>(n) * sizeof(float));
  }
}

/// dtable[tokens[r]] += d[r] for r in order (each cell adds its token's rows in row order).
inline void embedding_backward(const CpuContext&, const std::int32_t* tokens, const float* d, float* dtable,
                               long long rows, int n) {
  for (long long r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) dtable[static_cast<long long>(tokens[r]) * n + i] += d[r * n + i];
}

// ---- Softmax cross-entropy -------------------------------------------------------------------

/// losses (rows) = cross-entropy of each row of logits (rows, vocab) against targets, and
/// dlogits (rows, vocab) = scale * (softmax - onehot) (may be logits itself); a target outside
/// [0, vocab) is refused.
inline void cross_entropy(const CpuContext&, const float* logits, const std::int32_t* targets, float* losses,
                          float* dlogits, long long rows, int vocab, float scale) {
  for (long long r = 0; r < rows; ++r) {
    if (targets[r] < 0 || targets[r] >= vocab)
      throw error("ops::cross_entropy: target " + std::to_string(targets[r]) + " at row " + std::to_string(r) +
                  " is outside [0, " + std::to_string(vocab - 1) + "]");
    losses[r] = softmax_xent_row(logits + r * vocab, vocab, targets[r], scale, dlogits + r * vocab);
  }
}

// ---- Residual ------------------------------------------------------------------------------

/// out = a + b, count elements (out may be a or b).
inline void add(const CpuContext&, const float* a, const float* b, float* out, long long count) {
  for (long long e = 0; e < count; ++e) out[e] = a[e] + b[e];
}

}  // namespace pipeoffload::ops
