// models/gpt/kernels/elementwise.cu: grid-stride loops over pipeoffload/ops/math.hpp's per-element functions
// (GeLU, dropout, residual adds, biases, LayerNorm's recompute) and the embedding, whose
// gradient gives each table cell to one thread that adds its rows in order (deterministic, the
// CPU model's order: backend/cuda/shapes.hpp embedding_table_grad_launch).
#include <pipeoffload/backend/cuda/device.cuh>

#include "../kernels.hpp"

namespace pipeoffload::cuda::kernels {
namespace {

__global__ void gelu_forward_k(const bf16* x, bf16* y, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) y[i] = st(ops::gelu(ld(x, i)));
}
__global__ void gelu_backward_k(const bf16* x, bf16* g, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) g[i] = st(ld(g, i) * ops::gelu_grad(ld(x, i)));
}
__global__ void residual_dropout_k(const bf16* x, const bf16* y, bf16* out, long long n, std::uint64_t seed, float p) {
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(ops::residual_dropout(ld(x, i), ld(y, i), seed, static_cast<std::uint64_t>(i), p));
}
__global__ void dropout_backward_k(const bf16* g, bf16* out, long long n, std::uint64_t seed, float p) {
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(ld(g, i) * ops::dropout_scale(seed, static_cast<std::uint64_t>(i), p));
}
__global__ void residual_dropout_mask_k(const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask, long long n,
                                        std::uint64_t seed, float p) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    // ops::residual_dropout's x + y * dropout_scale, with the factor kept for the mask.
    const float k = ops::dropout_scale(seed, static_cast<std::uint64_t>(i), p);
    mask[i] = k != 0.0f;
    out[i] = st(ld(x, i) + ld(y, i) * k);
  }
}
__global__ void dropout_backward_mask_k(const bf16* g, const std::uint8_t* mask, bf16* out, long long n, float p) {
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(ld(g, i) * ops::dropout_mask_scale(mask[i] != 0, p));
}
__global__ void add_k(const bf16* a, const bf16* b, bf16* out, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) out[i] = st(ld(a, i) + ld(b, i));
}
__global__ void add_bias_k(bf16* y, const bf16* bias, long long total, int n) {
  for (long long i = first_index(); i < total; i += grid_stride()) y[i] = st(ld(y, i) + ld(bias, i % n));
}
__global__ void add_bias_f32_k(float* y, const float* bias, long long total, int n) {
  for (long long i = first_index(); i < total; i += grid_stride()) y[i] += bias[i % n];
}
__global__ void layernorm_recompute_k(const bf16* x, const float* stats, const bf16* gamma, const bf16* beta, bf16* y,
                                      long long total, int n) {
  for (long long i = first_index(); i < total; i += grid_stride()) {
    const long long r = i / n;
    const ops::RowStats s{stats[2 * r], stats[2 * r + 1]};
    y[i] = st(ops::layernorm_apply(ld(x, i), s, ld(gamma, i % n), ld(beta, i % n)));
  }
}
__global__ void embedding_forward_k(const std::int32_t* tokens, const bf16* wte, const bf16* wpe, bf16* out,
                                    long long total, int seq, int h, int vocab) {
  for (long long i = first_index(); i < total; i += grid_stride()) {
    const long long r = i / h, c = i % h;
    const int tok = tokens[r];
    out[i] = (tok < 0 || tok >= vocab) ? st(__int_as_float(0x7fc00000))
                                       : st(ld(wte, static_cast<long long>(tok) * h + c) + ld(wpe, (r % seq) * h + c));
  }
}
/// One value of a bf16 (rows, h) gradient, for ops::embedding_grad_cells.
struct Bf16Grad {
  const bf16* d;
  __device__ float operator()(long long i) const { return ld(d, i); }
};
/// The token table's gradient: this thread's bucket and column (cuda::embedding_owned), its
/// rows in order. No barrier, so threads past the last column simply leave.
__global__ void __launch_bounds__(column_tile* embedding_warps)
    embedding_table_grad_k(const std::int32_t* tokens, const bf16* d, float* dwte, long long rows, int h, int vocab) {
  const OwnedCells own = embedding_owned(blockIdx.x, threadIdx.x, h);
  if (own.column >= h) return;
  ops::embedding_grad_cells(tokens, rows, Bf16Grad{d}, dwte, h, vocab, own.bucket, embedding_buckets, own.column);
}
/// The position table's gradient: cell (p, c) adds rows b * seq + p in order of b.
__global__ void embedding_position_grad_k(const bf16* d, float* dwpe, long long batch, int seq, int h) {
  const long long n = static_cast<long long>(seq) * h;
  for (long long i = first_index(); i < n; i += grid_stride()) {
    float acc = dwpe[i];
    for (long long b = 0; b < batch; ++b) acc += ld(d, b * n + i);
    dwpe[i] = acc;
  }
}

}  // namespace

void gelu_forward(const bf16* x, bf16* y, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(gelu_forward_k, elementwise_launch(count), s, x, y, count);
}
void gelu_backward(const bf16* x, bf16* g, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(gelu_backward_k, elementwise_launch(count), s, x, g, count);
}
void residual_dropout(const bf16* x, const bf16* y, bf16* out, long long count, std::uint64_t seed, float p,
                      cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(residual_dropout_k, elementwise_launch(count), s, x, y, out, count, seed, p);
}
void dropout_backward(const bf16* g, bf16* out, long long count, std::uint64_t seed, float p, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(dropout_backward_k, elementwise_launch(count), s, g, out, count, seed, p);
}
void residual_dropout_mask(const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask, long long count,
                           std::uint64_t seed, float p, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(residual_dropout_mask_k, elementwise_launch(count), s, x, y, out, mask, count, seed, p);
}
void dropout_backward_mask(const bf16* g, const std::uint8_t* mask, bf16* out, long long count, float p,
                           cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(dropout_backward_mask_k, elementwise_launch(count), s, g, mask, out, count, p);
}
void add(const bf16* a, const bf16* b, bf16* out, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(add_k, elementwise_launch(count), s, a, b, out, count);
}
void add_bias(bf16* y, const bf16* bias, long long rows, int n, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(add_bias_k, elementwise_launch(rows * n), s, y, bias, rows * n, n);
}
void add_bias(float* y, const float* bias, long long rows, int n, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(add_bias_f32_k, elementwise_launch(rows * n), s, y, bias, rows * n, n);
}
void layernorm_recompute(const bf16* x, const float* stats, const bf16* gamma, const bf16* beta, bf16* y,
                         long long rows, int n, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(layernorm_recompute_k, elementwise_launch(rows * n), s, x, stats, gamma, beta, y, rows * n, n);
}
void embedding_forward(const std::int32_t* tokens, const bf16* wte, const bf16* wpe, bf16* out, long long rows, int seq,
                       int h, int vocab, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(embedding_forward_k, elementwise_launch(rows * h), s, tokens, wte, wpe, out, rows * h, seq, h,
                     vocab);
}
void embedding_backward(const std::int32_t* tokens, const bf16* d, float* dwte, float* dwpe, long long rows, int seq,
                        int h, int vocab, cudaStream_t s) {
  if (seq < 1 || rows % seq != 0)
    throw shape_error("cuda::kernels::embedding_backward: rows = " + std::to_string(rows) +
                      " is not a whole number of sequences of seq = " + std::to_string(seq) + " (need seq >= 1)");
  PIPEOFFLOAD_LAUNCH(embedding_table_grad_k, embedding_table_grad_launch(h), s, tokens, d, dwte, rows, h, vocab);
  PIPEOFFLOAD_LAUNCH(embedding_position_grad_k, elementwise_launch(static_cast<long long>(seq) * h), s, d, dwpe,
                     rows / seq, seq, h);
}

}  // namespace pipeoffload::cuda::kernels
