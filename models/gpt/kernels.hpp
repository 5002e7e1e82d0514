// models/gpt/kernels.hpp: plain C++ declarations of the GPT's CUDA kernels (models/gpt/kernels/).
//
// Compiled by nvcc into the build's pipeoffload_gpt_kernels library; this header is all host
// code sees. Every launcher enqueues on `stream`, computes its launch shape with
// pipeoffload/backend/cuda/shapes.hpp and checks the launch. Storage is bf16 for activations
// (`bf16`) and parameters (the stage's working parameters), fp32 for gradients and statistics; all arithmetic is fp32 through
// pipeoffload/ops/math.hpp, the same functions the CPU model (cpu.hpp) calls.
// Shapes: `rows` tokens (b*s) by `n` features, row-major.
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "models/gpt/kernels.hpp needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include <pipeoffload/backend/cuda/kernels.hpp>  // bf16

#include <pipeoffload/ops/math.hpp>

namespace pipeoffload::cuda::kernels {

// ---- LayerNorm: one block per row --------------------------------------------------------
/// y (rows, n) = LayerNorm(x) * gamma + beta; stats (rows, 2) = (mean, rstd) per row.
void layernorm_forward(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y, float* stats, long long rows, int n,
                       cudaStream_t stream);
/// y recomputed from saved stats (selective recompute): ops::layernorm_apply per element.
void layernorm_recompute(const bf16* x, const float* stats, const bf16* gamma, const bf16* beta, bf16* y,
                         long long rows, int n, cudaStream_t stream);
/// dx (rows, n) = LayerNorm's input gradient from dy (grad of the normalized output); when
/// `accumulate`, dx += instead of = (the residual branch adds into the skip gradient).
void layernorm_backward(const bf16* dy, const bf16* x, const float* stats, const bf16* gamma, bf16* dx, long long rows,
                        int n, bool accumulate, cudaStream_t stream);
/// dgamma (n) += sum_rows dy * xhat; dbeta (n) += sum_rows dy (fp32, column_sum_launch's fixed order).
void layernorm_weight_grad(const bf16* dy, const bf16* x, const float* stats, float* dgamma, float* dbeta,
                           long long rows, int n, cudaStream_t stream);

// ---- element-wise ------------------------------------------------------------------------
/// y = GeLU(x), count elements.
void gelu_forward(const bf16* x, bf16* y, long long count, cudaStream_t stream);
/// g *= GeLU'(x) in place.
void gelu_backward(const bf16* x, bf16* g, long long count, cudaStream_t stream);
/// out = x + y * dropout_scale(seed, i, p) (residual after a dropped-out branch).
void residual_dropout(const bf16* x, const bf16* y, bf16* out, long long count, std::uint64_t seed, float p,
                      cudaStream_t stream);
/// out = g * dropout_scale(seed, i, p) (the mask regenerated from the seed, never stored).
void dropout_backward(const bf16* g, bf16* out, long long count, std::uint64_t seed, float p, cudaStream_t stream);
/// residual_dropout that also saves each element's keep decision as a byte (recompute off):
/// mask[i] = dropout_scale(seed, i, p) != 0.
void residual_dropout_mask(const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask, long long count,
                           std::uint64_t seed, float p, cudaStream_t stream);
/// out = g * dropout_mask_scale(mask[i], p): dropout_backward from the saved mask.
void dropout_backward_mask(const bf16* g, const std::uint8_t* mask, bf16* out, long long count, float p,
                           cudaStream_t stream);
/// out = a + b.
void add(const bf16* a, const bf16* b, bf16* out, long long count, cudaStream_t stream);
/// y (rows, n) += bias (n): bf16 activations and bias, or fp32 (the LM head's logits and the
/// stage's fp32 copy of its bias).
void add_bias(bf16* y, const bf16* bias, long long rows, int n, cudaStream_t stream);
void add_bias(float* y, const float* bias, long long rows, int n, cudaStream_t stream);
/// db (n) += sum_rows dy (fp32, column_sum_launch's fixed order).
void bias_grad(const bf16* dy, float* db, long long rows, int n, cudaStream_t stream);

// ---- embedding ---------------------------------------------------------------------------
/// out (rows, h) = wte[token] + wpe[row % seq]; tokens out of [0, vocab) write NaN rows (the
/// host cannot throw for a device-side value; the step's finite-gradient check catches it).
void embedding_forward(const std::int32_t* tokens, const bf16* wte, const bf16* wpe, bf16* out, long long rows, int seq,
                       int h, int vocab, cudaStream_t stream);
/// dwte[token] += d, dwpe[row % seq] += d: each cell of either table is one thread's, adding
/// its rows in row order (the CPU model's order, so the same bits; cuda::embedding_cell_owner).
/// rows must be a whole number of sequences of seq.
void embedding_backward(const std::int32_t* tokens, const bf16* d, float* dwte, float* dwpe, long long rows, int seq,
                        int h, int vocab, cudaStream_t stream);

// ---- softmax cross-entropy: one block per row ----------------------------------------------
/// losses (rows) = cross-entropy of each row of logits (rows, vocab) fp32 against targets;
/// dlogits (may alias logits) = scale * (softmax - onehot).
void softmax_xent(const float* logits, const std::int32_t* targets, float* losses, float* dlogits, long long rows,
                  int vocab, float scale, cudaStream_t stream);
/// *out = mean of losses (rows), one block; in row order per thread, then BlockReduce.
void mean(const float* losses, float* out, long long rows, cudaStream_t stream);

}  // namespace pipeoffload::cuda::kernels
