// pipeoffload/ops/cpu.hpp: ops for users' layers on the CPU backend (po::ops, fp32, row-major
// (rows, n) tensors): LayerNorm, RMSNorm, rotary embeddings, GeLU, SwiGLU, residuals, dropout,
// biases, token and position embeddings, softmax cross-entropy, causal grouped-query attention.
// Each takes the pass's backend::CpuContext first, as its CUDA twin (ops/cuda.hpp) takes a
// CudaContext, so a layer templated on its context calls them by the same names; the
// per-element math is ops/math.hpp's, which the CUDA kernels share. Sums run in index order:
// the same inputs give the same bits on every run. Bad ids are refused with a sentence naming
// the value and the range. Attention runs on OpenBLAS GEMMs, document by document (packed
// rows, docs/packing.md), with strided q, k, v; ops::reference holds its plain twin.
/// @file
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "../backend/cpu/blas.hpp"
#include "../backend/cpu/context.hpp"
#include "../error.hpp"
#include "../packing.hpp"
#include "math.hpp"

namespace pipeoffload::ops {

using backend::CpuContext;

namespace detail {
/// out[e] = f(e) for e in [0, n). g++ -O2 vectorises only loops that need neither a scalar tail
/// nor an alias check; these fixed 16-wide groups through a local buffer need neither, so a
/// branch-free f (math.hpp's exp_approx, gelu, ...) runs on SIMD lanes. The tail calls the same
/// f, which gives the same bits. f may read out[e]: a group is written back only after all of
/// it is computed. (A plain tail loop draws g++ 12's -Waggressive-loop-optimizations at
/// constant counts.)
template <class F>
inline void elementwise(float* out, long long count, F&& f) {
  if (count <= 0) return;
  constexpr std::size_t w = 16;
  const std::size_t n = static_cast<std::size_t>(count);
  std::size_t i = 0;
  for (; i + w <= n; i += w) {
    float buf[w];
    for (std::size_t j = 0; j < w; ++j) buf[j] = f(static_cast<long long>(i + j));
    for (std::size_t j = 0; j < w; ++j) out[i + j] = buf[j];
  }
  const std::size_t rest = n - i;  // < w
  float buf[w];
  for (std::size_t j = 0; j < rest && j < w; ++j) buf[j] = f(static_cast<long long>(i + j));
  for (std::size_t j = 0; j < rest && j < w; ++j) out[i + j] = buf[j];
}
}  // namespace detail

/// float on the CPU backend.
template <>
struct context_value<CpuContext> {
  using type = float;  ///< fp32 activations and parameters
};

// ---- LayerNorm (eps = layernorm_eps) -----------------------------------------------------------

/// y (rows, n) = (x - mean) * rstd * gamma + beta; stats (rows, 2) = (mean, rstd) per row.
inline void layernorm_forward(const CpuContext&, const float* x, const float* gamma, const float* beta, float* y,
                              float* stats, long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    const RowStats st = row_stats(x + r * n, n);
    stats[2 * r] = st.mean;
    stats[2 * r + 1] = st.rstd;
    const float* xr = x + r * n;
    detail::elementwise(y + r * n, n, [&](long long i) { return layernorm_apply(xr[i], st, gamma[i], beta[i]); });
  }
}

/// y from the saved stats (a layer that recomputes the normalized input in backward).
inline void layernorm_recompute(const CpuContext&, const float* x, const float* stats, const float* gamma,
                                const float* beta, float* y, long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    const RowStats st{stats[2 * r], stats[2 * r + 1]};
    const float* xr = x + r * n;
    detail::elementwise(y + r * n, n, [&](long long i) { return layernorm_apply(xr[i], st, gamma[i], beta[i]); });
  }
}

/// dx (rows, n) = LayerNorm's input gradient from dy; added to dx when `accumulate`.
inline void layernorm_backward(const CpuContext&, const float* dy, const float* x, const float* stats,
                               const float* gamma, float* dx, long long rows, int n, bool accumulate) {
  std::vector<float> row(accumulate ? static_cast<std::size_t>(n) : 0);
  for (long long r = 0; r < rows; ++r) {
    float* out = accumulate ? row.data() : dx + r * n;
    layernorm_backward_row(dy + r * n, x + r * n, {stats[2 * r], stats[2 * r + 1]}, gamma, out, n);
    if (accumulate) {
      float* dr = dx + r * n;
      detail::elementwise(dr, n, [&](long long i) { return dr[i] + row[static_cast<std::size_t>(i)]; });
    }
  }
}

/// dgamma (n) += sum over rows of dy * xhat; dbeta (n) += sum over rows of dy, rows in order.
inline void layernorm_weight_grad(const CpuContext&, const float* dy, const float* x, const float* stats, float* dgamma,
                                  float* dbeta, long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    const float mean = stats[2 * r], rstd = stats[2 * r + 1];
    const float *dyr = dy + r * n, *xr = x + r * n;
    detail::elementwise(dgamma, n, [&](long long i) { return dgamma[i] + dyr[i] * (xr[i] - mean) * rstd; });
    detail::elementwise(dbeta, n, [&](long long i) { return dbeta[i] + dyr[i]; });
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------

/// y (rows, n) = x * rstd * weight, rstd (rows) = 1 / sqrt(mean(x^2) + eps) per row.
inline void rmsnorm_forward(const CpuContext&, const float* x, const float* weight, float* y, float* rstd,
                            long long rows, int n, float eps) {
  for (long long r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float s = rstd[r] = rmsnorm_rstd(xr, n, eps);
    detail::elementwise(y + r * n, n, [&](long long i) { return xr[i] * s * weight[i]; });
  }
}

/// y from the saved rstd (a layer that recomputes the normalized input in backward).
inline void rmsnorm_recompute(const CpuContext&, const float* x, const float* rstd, const float* weight, float* y,
                              long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float s = rstd[r];
    detail::elementwise(y + r * n, n, [&](long long i) { return xr[i] * s * weight[i]; });
  }
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
  for (long long r = 0; r < rows; ++r) {
    const float *dyr = dy + r * n, *xr = x + r * n;
    const float s = rstd[r];
    detail::elementwise(dweight, n, [&](long long i) { return dweight[i] + dyr[i] * xr[i] * s; });
  }
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

  /// The table as the ops read it (host memory; copy cos and sin to the GPU for the CUDA op).
  RopeView view() const { return {positions, head_dim, cos.data(), sin.data()}; }
};

/// Rotates, in place, each head's pairs (2j, 2j + 1) of the rows of x (rows, width; width a
/// multiple of the table's head_dim) by the angles of the row's position (positions, one per
/// row, each in [0, table.positions)); `inverse` rotates back (the backward of a rotation).
inline void rope(const CpuContext&, float* x, const std::int32_t* positions, long long rows, int width, RopeView table,
                 bool inverse) {
  const std::size_t dh = static_cast<std::size_t>(table.head_dim), half = dh / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (long long t = 0; t < rows; ++t) {
    const std::int32_t p = positions[t];
    if (p < 0 || p >= table.positions)
      throw shape_error("ops::rope: row " + std::to_string(t) + " has position " + std::to_string(p) +
                        ", outside [0, " + std::to_string(table.positions - 1) + "]");
    const float* c = table.cos + static_cast<std::size_t>(p) * half;
    const float* s = table.sin + static_cast<std::size_t>(p) * half;
    for (std::size_t e = 0; e < static_cast<std::size_t>(width); e += dh)
      for (std::size_t j = 0; j < half; ++j)
        rope_pair(x + static_cast<std::size_t>(t) * static_cast<std::size_t>(width) + e + 2 * j, c[j], sign * s[j]);
  }
}

/// positions[r] = r % seq: every row's position when each sequence of seq rows is one document.
inline void sequence_positions(const CpuContext&, std::int32_t* positions, long long rows, int seq) {
  for (long long r = 0; r < rows; ++r) positions[r] = static_cast<std::int32_t>(r % seq);
}

/// rope from a host table.
inline void rope(const CpuContext& ctx, float* x, const std::int32_t* positions, long long rows, int width,
                 const RopeTable& table, bool inverse) {
  rope(ctx, x, positions, rows, width, table.view(), inverse);
}

// ---- GeLU ----------------------------------------------------------------------------------

/// y = GeLU(x) (tanh form), count elements.
inline void gelu_forward(const CpuContext&, const float* x, float* y, long long count) {
  detail::elementwise(y, count, [&](long long e) { return gelu(x[e]); });
}

/// g *= GeLU'(x), in place.
inline void gelu_backward(const CpuContext&, const float* x, float* g, long long count) {
  detail::elementwise(g, count, [&](long long e) { return g[e] * gelu_grad(x[e]); });
}

// ---- SwiGLU --------------------------------------------------------------------------------

/// out = silu(gate) * up, count elements.
inline void swiglu_forward(const CpuContext&, const float* gate, const float* up, float* out, long long count) {
  detail::elementwise(out, count, [&](long long e) { return silu(gate[e]) * up[e]; });
}

/// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
inline void swiglu_backward(const CpuContext&, const float* dout, const float* gate, const float* up, float* dgate,
                            float* dup, long long count) {
  for (long long e = 0; e < count; ++e) {
    dgate[e] = dout[e] * up[e] * silu_grad(gate[e]);
    dup[e] = dout[e] * silu(gate[e]);
  }
}

// ---- Dropout and biases ----------------------------------------------------------------------

/// out = x + y * dropout_scale(seed, i, p): a residual after a dropped-out branch.
inline void residual_dropout(const CpuContext&, const float* x, const float* y, float* out, long long count,
                             DropoutSeed site, float p) {
  const std::uint64_t seed = site.value();
  detail::elementwise(out, count, [&](long long e) {
    return ops::residual_dropout(x[e], y[e], seed, static_cast<std::uint64_t>(e), p);
  });
}

/// out = g * dropout_scale(seed, i, p): the mask regenerated from the seed.
inline void dropout_backward(const CpuContext&, const float* g, float* out, long long count, DropoutSeed site,
                             float p) {
  const std::uint64_t seed = site.value();
  detail::elementwise(out, count,
                      [&](long long e) { return g[e] * dropout_scale(seed, static_cast<std::uint64_t>(e), p); });
}

/// residual_dropout that also keeps each element's keep decision as a byte (mask[i]).
inline void residual_dropout_mask(const CpuContext&, const float* x, const float* y, float* out, std::uint8_t* mask,
                                  long long count, DropoutSeed site, float p) {
  const std::uint64_t seed = site.value();
  for (long long e = 0; e < count; ++e) {
    const float k = dropout_scale(seed, static_cast<std::uint64_t>(e), p);
    mask[e] = k != 0.0f;
    out[e] = x[e] + y[e] * k;
  }
}

/// out = g * dropout_mask_scale(mask[i], p).
inline void dropout_backward_mask(const CpuContext&, const float* g, const std::uint8_t* mask, float* out,
                                  long long count, float p) {
  detail::elementwise(out, count, [&](long long e) { return g[e] * dropout_mask_scale(mask[e] != 0, p); });
}

/// y (rows, n) += bias (n).
inline void add_bias(const CpuContext&, float* y, const float* bias, long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    float* yr = y + r * n;
    detail::elementwise(yr, n, [&](long long i) { return yr[i] + bias[i]; });
  }
}

/// db (n) += sum over rows of dy, rows in order.
inline void bias_grad(const CpuContext&, const float* dy, float* db, long long rows, int n) {
  for (long long r = 0; r < rows; ++r) {
    const float* dyr = dy + r * n;
    detail::elementwise(db, n, [&](long long i) { return db[i] + dyr[i]; });
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

/// dtable[ids[r]] += d[r] for r in order (each cell adds its id's rows in row order; dtable
/// (vocab, n)); an id outside [0, vocab) is refused before anything is added.
inline void embedding_backward(const CpuContext&, const std::int32_t* ids, const float* d, float* dtable,
                               long long rows, int n, int vocab) {
  for (long long r = 0; r < rows; ++r)
    if (ids[r] < 0 || ids[r] >= vocab)
      throw error("ops::embedding_backward: id " + std::to_string(ids[r]) + " at row " + std::to_string(r) +
                  " is outside [0, " + std::to_string(vocab - 1) + "]");
  for (long long r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) dtable[static_cast<long long>(ids[r]) * n + i] += d[r * n + i];
}

/// out[r] += table[r % seq]: learned absolute positions, restarting every seq rows.
inline void position_embedding_forward(const CpuContext&, const float* table, float* out, long long rows, int n,
                                       int seq) {
  for (long long r = 0; r < rows; ++r) {
    const float* tr = table + (r % seq) * n;
    float* o = out + r * n;
    detail::elementwise(o, n, [&](long long i) { return o[i] + tr[i]; });
  }
}

/// out[r] += table[positions[r]]: learned positions given row by row (packed rows restart them
/// at every document, po::microbatch_documents); a position outside [0, table_rows) is refused.
/// Its gradient is embedding_backward with the positions as the ids.
inline void position_embedding_forward(const CpuContext&, const float* table, const std::int32_t* positions, float* out,
                                       long long rows, int n, int table_rows) {
  for (long long r = 0; r < rows; ++r) {
    if (positions[r] < 0 || positions[r] >= table_rows)
      throw shape_error("ops::position_embedding_forward: position " + std::to_string(positions[r]) + " at row " +
                        std::to_string(r) + " is outside [0, " + std::to_string(table_rows - 1) + "]");
    const float* tr = table + static_cast<long long>(positions[r]) * n;
    float* o = out + r * n;
    detail::elementwise(o, n, [&](long long i) { return o[i] + tr[i]; });
  }
}

/// dtable[p] += d[b * seq + p] for b in order; rows must be a whole number of sequences.
inline void position_embedding_backward(const CpuContext&, const float* d, float* dtable, long long rows, int n,
                                        int seq) {
  if (seq < 1 || rows % seq != 0)
    throw shape_error("ops::position_embedding_backward: rows = " + std::to_string(rows) +
                      " is not a whole number of sequences of seq = " + std::to_string(seq));
  for (long long r = 0; r < rows; ++r) {
    float* tr = dtable + (r % seq) * n;
    const float* dr = d + r * n;
    detail::elementwise(tr, n, [&](long long i) { return tr[i] + dr[i]; });
  }
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

/// *out = the mean of losses (rows), summed in order.
inline void mean(const CpuContext&, const float* losses, float* out, long long rows) {
  float s = 0;
  for (long long r = 0; r < rows; ++r) s += losses[r];
  *out = s / static_cast<float>(rows);
}

// ---- Residual ------------------------------------------------------------------------------

/// out = a + b, count elements (out may be a or b).
inline void add(const CpuContext&, const float* a, const float* b, float* out, long long count) {
  detail::elementwise(out, count, [&](long long e) { return a[e] + b[e]; });
}

// ---- Attention -----------------------------------------------------------------------------

namespace detail {
/// The shape's sizes checked: positive, heads a multiple of the key/value heads.
inline void check_attention(AttentionShape s, const char* who) {
  if (s.batch < 1 || s.seq < 1 || s.heads < 1 || s.groups() < 1 || s.head_dim < 1 || s.heads % s.groups() != 0)
    throw shape_error(std::string(who) + ": batch = " + std::to_string(s.batch) + ", seq = " + std::to_string(s.seq) +
                      ", heads = " + std::to_string(s.heads) + ", kv_heads = " + std::to_string(s.groups()) +
                      ", head_dim = " + std::to_string(s.head_dim) +
                      "; need every size >= 1 and heads a multiple of kv_heads");
}

/// What the GEMM path reads of a shape and its strides.
struct AttentionDims {
  long long q, k, v, out;  ///< row strides
  int dh, per;             ///< a head's width; query heads per key/value head
  float scale;             ///< 1 / sqrt(head_dim)
};

/// The shape, its strides and its documents checked (each inside its row, never empty); the
/// dims the GEMM path reads.
inline AttentionDims attention_dims(AttentionShape s, AttentionStrides st, std::span<const Document> docs,
                                    const char* who) {
  check_attention(s, who);
  const long long H = static_cast<long long>(s.heads) * s.head_dim, K = static_cast<long long>(s.groups()) * s.head_dim;
  const AttentionDims d{st.q ? st.q : H,
                        st.k ? st.k : K,
                        st.v ? st.v : K,
                        st.out ? st.out : H,
                        s.head_dim,
                        s.heads / s.groups(),
                        1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  if (d.q < H || d.k < K || d.v < K || d.out < H)
    throw shape_error(std::string(who) + ": strides q = " + std::to_string(d.q) + ", k = " + std::to_string(d.k) +
                      ", v = " + std::to_string(d.v) + ", out = " + std::to_string(d.out) +
                      "; need q and out >= heads * head_dim = " + std::to_string(H) +
                      " and k, v >= kv_heads * head_dim = " + std::to_string(K));
  for (const Document& doc : docs)
    if (doc.row >= static_cast<std::size_t>(s.batch) || doc.length < 1 ||
        doc.begin + doc.length > static_cast<std::size_t>(s.seq))
      throw shape_error(std::string(who) + ": a document at row " + std::to_string(doc.row) + ", tokens [" +
                        std::to_string(doc.begin) + ", " + std::to_string(doc.begin + doc.length) +
                        ") is outside rows [0, " + std::to_string(s.batch) + ") of tokens [0, " +
                        std::to_string(s.seq) + ") or empty");
  return d;
}

/// Each sequence of the shape as one document.
inline std::vector<Document> whole_sequences(AttentionShape s) {
  std::vector<Document> docs;
  for (int b = 0; b < s.batch; ++b) docs.push_back({static_cast<std::size_t>(b), 0, static_cast<std::size_t>(s.seq)});
  return docs;
}

/// The calling thread's scores, grown to n floats: a pass runs on one stream's thread, and its
/// attention calls one at a time.
inline float* attention_scratch(std::size_t n) {
  thread_local std::vector<float> scores;
  if (scores.size() < n) scores.resize(n);
  return scores.data();
}
}  // namespace detail

/// Causal attention (query i sees keys 0..i of its document, scale 1/sqrt(head_dim)), document
/// by document (`docs`: po::microbatch_documents; rows in no document are left as they are), on
/// q rows of heads * head_dim and k, v rows of kv_heads * head_dim at the given strides,
/// grouped-query when kv_heads < heads (query head a reads key/value head a / (heads /
/// kv_heads)); out is shaped as q, lse (batch, heads, seq) keeps each query's log-sum-exp. Per
/// (document, head): the scores by one GEMM, each row's softmax with exp_approx (exp(s - lse),
/// as backward recomputes it), the output by a second GEMM.
inline void attention_forward(const CpuContext&, const float* q, const float* k, const float* v, float* out, float* lse,
                              AttentionShape s, std::span<const Document> docs, AttentionStrides strides = {}) {
  using blas::Trans;
  const detail::AttentionDims d = detail::attention_dims(s, strides, docs, "ops::attention_forward");
  const std::size_t S = static_cast<std::size_t>(s.seq), A = static_cast<std::size_t>(s.heads);
  const std::size_t dh = static_cast<std::size_t>(d.dh);
  float* P = detail::attention_scratch(S * S + S);
  for (const Document& doc : docs)
    for (std::size_t a = 0; a < A; ++a) {
      const std::size_t L = doc.length, first = doc.row * S + doc.begin, g = a / static_cast<std::size_t>(d.per);
      const int n = static_cast<int>(L);
      float* ex = P + L * L;  // (L) exp(s - max) of one score row
      const float* qa = q + first * d.q + a * dh;
      const float* kg = k + first * d.k + g * dh;
      const float* vg = v + first * d.v + g * dh;
      blas::sgemm(Trans::no, Trans::yes, n, n, d.dh, d.scale, qa, static_cast<int>(d.q), kg, static_cast<int>(d.k),
                  0.0f, P, n);
      float* l = lse + (doc.row * A + a) * S + doc.begin;
      for (std::size_t i = 0; i < L; ++i) {
        float* row = P + i * L;
        float mx = row[0];
        for (std::size_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        detail::elementwise(ex, static_cast<long long>(i + 1), [&](long long j) { return exp_approx(row[j] - mx); });
        float sum = 0;
        for (std::size_t j = 0; j <= i; ++j) sum += ex[j];  // in index order: the same sum on every run
        const float li = mx + std::log(sum);
        l[i] = li;
        detail::elementwise(row, static_cast<long long>(i + 1), [&](long long j) { return exp_approx(row[j] - li); });
        for (std::size_t j = i + 1; j < L; ++j) row[j] = 0.0f;
      }
      blas::sgemm(Trans::no, Trans::no, n, d.dh, n, 1.0f, P, n, vg, static_cast<int>(d.v), 0.0f,
                  out + first * d.out + a * dh, static_cast<int>(d.out));
    }
}

/// Causal attention on dense rows, each sequence one document: the CPU twin of the CUDA op
/// (cuDNN's fused attention on the same layout).
inline void attention_forward(const CpuContext& ctx, const float* q, const float* k, const float* v, float* out,
                              float* lse, AttentionShape s) {
  attention_forward(ctx, q, k, v, out, lse, s, detail::whole_sequences(s));
}

/// dq, dk, dv (at q's, k's and v's strides; set, not added, within the documents) from dout
/// (at out's stride), document by document, with the probabilities recomputed from q, k and
/// lse: dS = P (dout v^T - rowsum(dout o)), dq = scale dS k, dk = scale dS^T q, dv = P^T dout;
/// dk and dv sum the query heads of a group in head order.
inline void attention_backward(const CpuContext&, const float* q, const float* k, const float* v, const float* out,
                               const float* dout, const float* lse, float* dq, float* dk, float* dv, AttentionShape s,
                               std::span<const Document> docs, AttentionStrides strides = {}) {
  using blas::Trans;
  const detail::AttentionDims d = detail::attention_dims(s, strides, docs, "ops::attention_backward");
  const std::size_t S = static_cast<std::size_t>(s.seq), A = static_cast<std::size_t>(s.heads);
  const std::size_t dh = static_cast<std::size_t>(d.dh), per = static_cast<std::size_t>(d.per);
  const int ldq = static_cast<int>(d.q), ldk = static_cast<int>(d.k), ldv = static_cast<int>(d.v),
            ldo = static_cast<int>(d.out);
  float* P = detail::attention_scratch(2 * S * S);
  for (const Document& doc : docs)
    for (std::size_t a = 0; a < A; ++a) {
      const std::size_t L = doc.length, first = doc.row * S + doc.begin, g = a / per;
      const int n = static_cast<int>(L);
      float* dP = P + L * L;
      const float beta = a % per == 0 ? 0.0f : 1.0f;  // the group's first head sets dk, dv
      const float* qa = q + first * d.q + a * dh;
      const float* kg = k + first * d.k + g * dh;
      const float* vg = v + first * d.v + g * dh;
      const float* o = out + first * d.out + a * dh;
      const float* dO = dout + first * d.out + a * dh;
      const float* l = lse + (doc.row * A + a) * S + doc.begin;
      blas::sgemm(Trans::no, Trans::yes, n, n, d.dh, d.scale, qa, ldq, kg, ldk, 0.0f, P, n);
      for (std::size_t i = 0; i < L; ++i) {
        float* row = P + i * L;
        const float li = l[i];
        detail::elementwise(row, static_cast<long long>(i + 1), [&](long long j) { return exp_approx(row[j] - li); });
        for (std::size_t j = i + 1; j < L; ++j) row[j] = 0.0f;
      }
      blas::sgemm(Trans::no, Trans::yes, n, n, d.dh, 1.0f, dO, ldo, vg, ldv, 0.0f, dP, n);
      for (std::size_t i = 0; i < L; ++i) {
        float D = 0;
        for (std::size_t e = 0; e < dh; ++e) D += dO[i * d.out + e] * o[i * d.out + e];
        const float* prow = P + i * L;
        float* drow = dP + i * L;
        detail::elementwise(drow, static_cast<long long>(i + 1), [&](long long j) { return prow[j] * (drow[j] - D); });
        for (std::size_t j = i + 1; j < L; ++j) drow[j] = 0.0f;
      }
      blas::sgemm(Trans::yes, Trans::no, n, d.dh, n, 1.0f, P, n, dO, ldo, beta, dv + first * d.v + g * dh, ldv);
      blas::sgemm(Trans::no, Trans::no, n, d.dh, n, d.scale, dP, n, kg, ldk, 0.0f, dq + first * d.q + a * dh, ldq);
      blas::sgemm(Trans::yes, Trans::no, n, d.dh, n, d.scale, dP, n, qa, ldq, beta, dk + first * d.k + g * dh, ldk);
    }
}

/// Attention's backward on dense rows, each sequence one document (the CPU twin of the CUDA op).
inline void attention_backward(const CpuContext& ctx, const float* q, const float* k, const float* v, const float* out,
                               const float* dout, const float* lse, float* dq, float* dk, float* dv, AttentionShape s) {
  attention_backward(ctx, q, k, v, out, dout, lse, dq, dk, dv, s, detail::whole_sequences(s));
}

/// Plain twins of the GEMM paths above, for tests that compare the two.
namespace reference {

/// ops::attention_forward on dense rows, written plainly (scores, softmax with std::exp, a
/// weighted sum per query, in key order): what the GEMM path is tested against.
inline void attention_forward(const CpuContext&, const float* q, const float* k, const float* v, float* out, float* lse,
                              AttentionShape s) {
  detail::check_attention(s, "ops::reference::attention_forward");
  const long long H = static_cast<long long>(s.heads) * s.head_dim, K = static_cast<long long>(s.groups()) * s.head_dim;
  const int per = s.heads / s.groups();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> p(static_cast<std::size_t>(s.seq));
  for (int b = 0; b < s.batch; ++b)
    for (int a = 0; a < s.heads; ++a)
      for (int i = 0; i < s.seq; ++i) {
        const float* qi = q + (static_cast<long long>(b) * s.seq + i) * H + static_cast<long long>(a) * s.head_dim;
        float mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const float* kj =
              k + (static_cast<long long>(b) * s.seq + j) * K + static_cast<long long>(a / per) * s.head_dim;
          float d = 0;
          for (int e = 0; e < s.head_dim; ++e) d += qi[e] * kj[e];
          p[static_cast<std::size_t>(j)] = d * scale;
          mx = std::fmax(mx, d * scale);
        }
        float sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(p[static_cast<std::size_t>(j)] - mx);
        const float l = mx + std::log(sum);
        lse[(static_cast<long long>(b) * s.heads + a) * s.seq + i] = l;
        float* oi = out + (static_cast<long long>(b) * s.seq + i) * H + static_cast<long long>(a) * s.head_dim;
        for (int e = 0; e < s.head_dim; ++e) oi[e] = 0;
        for (int j = 0; j <= i; ++j) {
          const float w = std::exp(p[static_cast<std::size_t>(j)] - l);
          const float* vj =
              v + (static_cast<long long>(b) * s.seq + j) * K + static_cast<long long>(a / per) * s.head_dim;
          for (int e = 0; e < s.head_dim; ++e) oi[e] += w * vj[e];
        }
      }
}

/// ops::attention_backward on dense rows, written plainly, one query and key at a time.
inline void attention_backward(const CpuContext&, const float* q, const float* k, const float* v, const float* out,
                               const float* dout, const float* lse, float* dq, float* dk, float* dv, AttentionShape s) {
  detail::check_attention(s, "ops::reference::attention_backward");
  const long long H = static_cast<long long>(s.heads) * s.head_dim, K = static_cast<long long>(s.groups()) * s.head_dim;
  const long long T = static_cast<long long>(s.batch) * s.seq;
  const int per = s.heads / s.groups();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::fill(dq, dq + T * H, 0.0f);
  std::fill(dk, dk + T * K, 0.0f);
  std::fill(dv, dv + T * K, 0.0f);
  for (int b = 0; b < s.batch; ++b)
    for (int a = 0; a < s.heads; ++a) {
      const long long qh = static_cast<long long>(a) * s.head_dim, kh = static_cast<long long>(a / per) * s.head_dim;
      for (int i = 0; i < s.seq; ++i) {
        const long long ri = static_cast<long long>(b) * s.seq + i;
        const float* qi = q + ri * H + qh;
        const float* doi = dout + ri * H + qh;
        const float* oi = out + ri * H + qh;
        const float l = lse[(static_cast<long long>(b) * s.heads + a) * s.seq + i];
        float Di = 0;
        for (int e = 0; e < s.head_dim; ++e) Di += doi[e] * oi[e];
        for (int j = 0; j <= i; ++j) {
          const long long rj = static_cast<long long>(b) * s.seq + j;
          const float* kj = k + rj * K + kh;
          const float* vj = v + rj * K + kh;
          float d = 0, dp = 0;
          for (int e = 0; e < s.head_dim; ++e) {
            d += qi[e] * kj[e];
            dp += doi[e] * vj[e];
          }
          const float pij = std::exp(d * scale - l);
          const float ds = pij * (dp - Di) * scale;
          for (int e = 0; e < s.head_dim; ++e) {
            dq[ri * H + qh + e] += ds * kj[e];
            dk[rj * K + kh + e] += ds * qi[e];
            dv[rj * K + kh + e] += pij * doi[e];
          }
        }
      }
    }
}

}  // namespace reference

}  // namespace pipeoffload::ops
