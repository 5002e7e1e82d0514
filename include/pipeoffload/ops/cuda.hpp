// pipeoffload/ops/cuda.hpp: ops for users' layers on the CUDA backend, the twins of ops/cpu.hpp
// (po::ops): the same names, argument order and semantics, with a backend::CudaContext first and
// bf16 (ops::value_t<CudaContext>) where the CPU twin has float activations or working
// parameters; statistics, gradients and losses stay fp32. A layer templated on its context
// calls them unqualified-by-backend (docs/ops.md shows one).
//
// Each op enqueues on ctx.cuda_stream and returns; arithmetic is fp32 through ops/math.hpp,
// the functions the CPU twins call, with row reductions as block reductions (so a GPU result
// differs from its twin by float rounding only: tests/cuda/test_ops_gpu.cpp bounds it). Sums
// over rows (weight and bias gradients, embedding gradients) run in a fixed order: the same
// inputs give the same bits on every run. Ids read on the device cannot throw: a token,
// target or position outside its range writes NaN where the CPU twin throws, and the runtime's
// non-finite check reports it. Defined in src/ (ops_rows.cu, ops_elementwise.cu; attention
// through backend/cuda/attention.hpp), installed as the pipeoffload_cuda_kernels library.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "pipeoffload/ops/cuda.hpp needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "../backend/cuda/attention.hpp"
#include "../backend/cuda/context.hpp"
#include "math.hpp"

namespace pipeoffload::ops {

using backend::CudaContext;

/// bf16 on the CUDA backend.
template <>
struct context_value<CudaContext> {
  using type = __nv_bfloat16;  ///< CUDA's bfloat16
};

using bf16 = __nv_bfloat16;  ///< CUDA's bfloat16

// ---- LayerNorm (eps = layernorm_eps) ---------------------------------------------------------
/// y (rows, n) = (x - mean) * rstd * gamma + beta; stats (rows, 2) = (mean, rstd) per row.
void layernorm_forward(const CudaContext& ctx, const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                       float* stats, long long rows, int n);
/// y from the saved stats (a layer that recomputes the normalized input in backward).
void layernorm_recompute(const CudaContext& ctx, const bf16* x, const float* stats, const bf16* gamma, const bf16* beta,
                         bf16* y, long long rows, int n);
/// dx (rows, n) = LayerNorm's input gradient from dy; added to dx when `accumulate`.
void layernorm_backward(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* stats, const bf16* gamma,
                        bf16* dx, long long rows, int n, bool accumulate);
/// dgamma (n) += sum over rows of dy * xhat; dbeta (n) += sum over rows of dy.
void layernorm_weight_grad(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* stats, float* dgamma,
                           float* dbeta, long long rows, int n);

// ---- RMSNorm ---------------------------------------------------------------------------------
/// y (rows, n) = x * rstd * weight, rstd (rows) = 1 / sqrt(mean(x^2) + eps) per row.
void rmsnorm_forward(const CudaContext& ctx, const bf16* x, const bf16* weight, bf16* y, float* rstd, long long rows,
                     int n, float eps);
/// y from the saved rstd.
void rmsnorm_recompute(const CudaContext& ctx, const bf16* x, const float* rstd, const bf16* weight, bf16* y,
                       long long rows, int n);
/// dx (rows, n) = RMSNorm's input gradient from dy; added to dx when `accumulate`.
void rmsnorm_backward(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* rstd, const bf16* weight,
                      bf16* dx, long long rows, int n, bool accumulate);
/// dweight (n) += sum over rows of dy * x * rstd.
void rmsnorm_weight_grad(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* rstd, float* dweight,
                         long long rows, int n);

// ---- Rotary position embeddings --------------------------------------------------------------
/// Rotates, in place, each head's pairs (2j, 2j + 1) of the rows of x (rows, width; width a
/// multiple of table.head_dim) by the angles of the row's position (positions: rows int32 on
/// the device); `inverse` rotates back. `table` is a RopeView of device memory (a RopeTable's
/// cos and sin copied to the GPU); a position outside [0, table.positions) writes NaN.
void rope(const CudaContext& ctx, bf16* x, const std::int32_t* positions, long long rows, int width, RopeView table,
          bool inverse);

/// positions[r] = r % seq (device int32): every row's position when each sequence of seq rows
/// is one document.
void sequence_positions(const CudaContext& ctx, std::int32_t* positions, long long rows, int seq);
/// positions[r] = the position of token r in its document (device int32), from packed rows'
/// offsets on the device (po::document_offsets_input: seq + 1 int32 a row, checked on the host
/// by po::microbatch_documents first); the positions microbatch_documents gives.
void document_positions(const CudaContext& ctx, const std::int32_t* offsets, std::int32_t* positions, long long rows,
                        int seq);

// ---- Activations -----------------------------------------------------------------------------
/// y = GeLU(x) (tanh form), count elements.
void gelu_forward(const CudaContext& ctx, const bf16* x, bf16* y, long long count);
/// g *= GeLU'(x), in place.
void gelu_backward(const CudaContext& ctx, const bf16* x, bf16* g, long long count);
/// out = silu(gate) * up.
void swiglu_forward(const CudaContext& ctx, const bf16* gate, const bf16* up, bf16* out, long long count);
/// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
void swiglu_backward(const CudaContext& ctx, const bf16* dout, const bf16* gate, const bf16* up, bf16* dgate, bf16* dup,
                     long long count);

// ---- Residuals, dropout, biases --------------------------------------------------------------
/// out = a + b (out may be a or b).
void add(const CudaContext& ctx, const bf16* a, const bf16* b, bf16* out, long long count);
/// out = x + y * dropout_scale(seed, i, p): a residual after a dropped-out branch.
void residual_dropout(const CudaContext& ctx, const bf16* x, const bf16* y, bf16* out, long long count,
                      DropoutSeed seed, float p);
/// out = g * dropout_scale(seed, i, p): the mask regenerated from the seed, never stored.
void dropout_backward(const CudaContext& ctx, const bf16* g, bf16* out, long long count, DropoutSeed seed, float p);
/// residual_dropout that also keeps each element's keep decision as a byte (mask[i]).
void residual_dropout_mask(const CudaContext& ctx, const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask,
                           long long count, DropoutSeed seed, float p);
/// out = g * dropout_mask_scale(mask[i], p): dropout_backward from the kept mask.
void dropout_backward_mask(const CudaContext& ctx, const bf16* g, const std::uint8_t* mask, bf16* out, long long count,
                           float p);
/// y (rows, n) += bias (n), bf16.
void add_bias(const CudaContext& ctx, bf16* y, const bf16* bias, long long rows, int n);
/// y (rows, n) += bias (n), fp32 (an fp32 head's logits).
void add_bias(const CudaContext& ctx, float* y, const float* bias, long long rows, int n);
/// db (n) += sum over rows of dy.
void bias_grad(const CudaContext& ctx, const bf16* dy, float* db, long long rows, int n);

// ---- Embeddings ------------------------------------------------------------------------------
/// out (rows, n) = table[ids[r]] (table (vocab, n)); an id outside [0, vocab) writes a NaN row.
void embedding_forward(const CudaContext& ctx, const std::int32_t* ids, const bf16* table, bf16* out, long long rows,
                       int n, int vocab);
/// dtable[ids[r]] += d[r], each cell adding its id's rows in row order (ids outside the table
/// are skipped).
void embedding_backward(const CudaContext& ctx, const std::int32_t* ids, const bf16* d, float* dtable, long long rows,
                        int n, int vocab);
/// out[r] += table[r % seq]: learned absolute positions, restarting every seq rows.
void position_embedding_forward(const CudaContext& ctx, const bf16* table, bf16* out, long long rows, int n, int seq);
/// out[r] += table[positions[r]]: positions given row by row (packed rows); a position outside
/// [0, table_rows) writes a NaN row, as embedding_forward does. Its gradient is
/// embedding_backward with the positions as the ids.
void position_embedding_forward(const CudaContext& ctx, const bf16* table, const std::int32_t* positions, bf16* out,
                                long long rows, int n, int table_rows);
/// dtable[p] += d[b * seq + p] for b in order; rows must be a whole number of sequences.
void position_embedding_backward(const CudaContext& ctx, const bf16* d, float* dtable, long long rows, int n, int seq);

// ---- Softmax cross-entropy -------------------------------------------------------------------
/// losses (rows) = cross-entropy of each row of logits (rows, vocab) against targets, and
/// dlogits = scale * (softmax - onehot) (may be logits itself), from fp32 logits or from bf16
/// ones (half the bytes at a large vocabulary; the arithmetic is fp32 either way). Rows are
/// independent: a layer that cannot hold a microbatch's logits computes and consumes them a
/// block of rows at a time.
void cross_entropy(const CudaContext& ctx, const float* logits, const std::int32_t* targets, float* losses,
                   float* dlogits, long long rows, int vocab, float scale);
/// cross_entropy from bf16 logits, writing bf16 dlogits (fp32 arithmetic).
void cross_entropy(const CudaContext& ctx, const bf16* logits, const std::int32_t* targets, float* losses,
                   bf16* dlogits, long long rows, int vocab, float scale);
/// *out = the mean of losses (rows), one block.
void mean(const CudaContext& ctx, const float* losses, float* out, long long rows);

// ---- Attention -------------------------------------------------------------------------------
/// A packed microbatch's documents as the GPU's attention reads them: how many (counted on the
/// host: po::microbatch_documents over Microbatch::host_input) and where (device memory that
/// document_table writes). A count of 0 is an unpacked microbatch, each row one sequence.
struct DeviceDocuments {
  int count = 0;                          ///< the graphs' document count: the rows' documents
                                          ///< padded with empty ones (cuda::document_slots)
  int length = 0;                         ///< the graphs' length: cuda::packed_length of the longest
  cuda::attention::Documents table = {};  ///< their lengths and ragged offsets
};

/// Writes, in stream order, the table of the documents of `rows` packed rows of `seq` tokens
/// (offsets: the step input po::document_offsets_input on the device, checked on the host by
/// po::microbatch_documents, which also gives `count` and the `longest` document's tokens)
/// into `memory` (device,
/// cuda::document_table_bytes(rows * seq) bytes, 16-byte aligned; cuda::document_table_layout
/// says where each array lies), offsets in units of the
/// attention's row strides (`strides`, 0 the dense widths; k's and v's must be equal), padded
/// with empty documents at the end up to cuda::document_slots(count, rows * seq) entries, the
/// count it returns (so calls of nearby counts share a graph). One block; each thread a run of
/// rows.
DeviceDocuments document_table(const CudaContext& ctx, const std::int32_t* offsets, long long rows, int seq, int count,
                               int longest, AttentionShape s, AttentionStrides strides, std::byte* memory);

/// Causal attention through cuDNN's fused SDPA on separate q (b*s, heads*head_dim), k and v
/// (b*s, kv_heads*head_dim) rows, grouped-query when kv_heads < heads; out is shaped as q and
/// lse (b, heads, s) keeps the rows' log-sum-exps for the backward. Uses ctx.workspace:
/// cuda::attention::workspace_bytes says how much the shape needs.
inline void attention_forward(const CudaContext& ctx, const bf16* q, const bf16* k, const bf16* v, bf16* out,
                              float* lse, AttentionShape s) {
  cuda::attention::forward(*ctx.attention, ctx.cuda_stream, {s.batch, s.heads, s.seq, s.head_dim, s.kv_heads}, q, k, v,
                           out, lse, ctx.workspace, ctx.workspace_bytes);
}
/// The same over packed rows, causal within each of `docs` (the CPU twin's `docs` overload);
/// lse is then (tokens, heads), cuDNN's ragged statistics.
inline void attention_forward(const CudaContext& ctx, const bf16* q, const bf16* k, const bf16* v, bf16* out,
                              float* lse, AttentionShape s, const DeviceDocuments& docs) {
  cuda::attention::forward(*ctx.attention, ctx.cuda_stream,
                           {s.batch, s.heads, s.seq, s.head_dim, s.kv_heads, docs.count, docs.length}, q, k, v, out,
                           lse, ctx.workspace, ctx.workspace_bytes, docs.table);
}
/// dq, dk, dv (shaped as q, k, v; set, not added) from dout, recomputing the probabilities
/// from q, k and lse.
inline void attention_backward(const CudaContext& ctx, const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                               const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, AttentionShape s) {
  cuda::attention::backward(*ctx.attention, ctx.cuda_stream, {s.batch, s.heads, s.seq, s.head_dim, s.kv_heads}, q, k, v,
                            out, dout, lse, dq, dk, dv, ctx.workspace, ctx.workspace_bytes);
}
/// The same over packed rows (attention_forward's `docs` overload).
inline void attention_backward(const CudaContext& ctx, const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                               const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, AttentionShape s,
                               const DeviceDocuments& docs) {
  cuda::attention::backward(*ctx.attention, ctx.cuda_stream,
                            {s.batch, s.heads, s.seq, s.head_dim, s.kv_heads, docs.count, docs.length}, q, k, v, out,
                            dout, lse, dq, dk, dv, ctx.workspace, ctx.workspace_bytes, docs.table);
}

}  // namespace pipeoffload::ops
