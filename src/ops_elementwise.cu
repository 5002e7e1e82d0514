// src/ops_elementwise.cu: the element-wise ops of ops/cuda.hpp, grid-stride loops over
// ops/math.hpp's functions (GeLU, SwiGLU, rotary embeddings, dropout, residuals, biases, the
// norms' recompute), and the embeddings, whose table gradient gives each cell to one thread
// that adds its rows in order (deterministic: backend/cuda/shapes.hpp
// embedding_table_grad_launch).
#include <pipeoffload/backend/cuda/device.cuh>
#include <pipeoffload/ops/cuda.hpp>
#include <pipeoffload/packing.hpp>

namespace pipeoffload::ops {
namespace {

using cuda::elementwise_launch;
using cuda::embedding_buckets;
using cuda::embedding_owned;
using cuda::embedding_table_grad_launch;
using cuda::OwnedCells;
using cuda::kernels::first_index;
using cuda::kernels::grid_stride;
using cuda::kernels::ld;
using cuda::kernels::st;

__device__ inline float nan_value() { return __int_as_float(0x7fc00000); }

__global__ void gelu_forward_k(const bf16* x, bf16* y, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) y[i] = st(gelu(ld(x, i)));
}
__global__ void gelu_backward_k(const bf16* x, bf16* g, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) g[i] = st(ld(g, i) * gelu_grad(ld(x, i)));
}
__global__ void swiglu_forward_k(const bf16* gate, const bf16* up, bf16* out, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) out[i] = st(silu(ld(gate, i)) * ld(up, i));
}
__global__ void swiglu_backward_k(const bf16* dout, const bf16* gate, const bf16* up, bf16* dgate, bf16* dup,
                                  long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    const float d = ld(dout, i), g = ld(gate, i), u = ld(up, i);
    dgate[i] = st(d * u * silu_grad(g));
    dup[i] = st(d * silu(g));
  }
}
/// One thread per pair (2j, 2j + 1) of a head of a row.
__global__ void rope_k(bf16* x, const std::int32_t* positions, long long pairs, int width, RopeView table, float sign) {
  const int half = table.head_dim / 2, row_pairs = width / 2;
  for (long long i = first_index(); i < pairs; i += grid_stride()) {
    const long long t = i / row_pairs;
    const int in_row = static_cast<int>(i % row_pairs), j = in_row % half;
    const std::int32_t p = positions[t];
    bf16* e = x + t * width + 2 * in_row;
    if (p < 0 || p >= table.positions) {
      e[0] = e[1] = st(nan_value());
      continue;
    }
    float v[2] = {__bfloat162float(e[0]), __bfloat162float(e[1])};
    rope_pair(v, table.cos[static_cast<long long>(p) * half + j],
              sign * table.sin[static_cast<long long>(p) * half + j]);
    e[0] = st(v[0]);
    e[1] = st(v[1]);
  }
}
__global__ void sequence_positions_k(std::int32_t* positions, long long rows, int seq) {
  for (long long i = first_index(); i < rows; i += grid_stride()) positions[i] = static_cast<std::int32_t>(i % seq);
}
__global__ void document_positions_k(const std::int32_t* offsets, std::int32_t* positions, long long rows, int seq) {
  for (long long i = first_index(); i < rows; i += grid_stride())
    positions[i] = document_position(offsets + (i / seq) * (seq + 1), seq, static_cast<int>(i % seq));
}
// The dropout kernels take the site (DropoutSeed) and make its seed once a thread: the step
// may be read from device memory (a captured pass replayed at a later step).
__global__ void residual_dropout_k(const bf16* x, const bf16* y, bf16* out, long long n, DropoutSeed site, float p) {
  const std::uint64_t seed = site.value();
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(residual_dropout(ld(x, i), ld(y, i), seed, static_cast<std::uint64_t>(i), p));
}
__global__ void dropout_backward_k(const bf16* g, bf16* out, long long n, DropoutSeed site, float p) {
  const std::uint64_t seed = site.value();
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(ld(g, i) * dropout_scale(seed, static_cast<std::uint64_t>(i), p));
}
__global__ void residual_dropout_mask_k(const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask, long long n,
                                        DropoutSeed site, float p) {
  const std::uint64_t seed = site.value();
  for (long long i = first_index(); i < n; i += grid_stride()) {
    // residual_dropout's x + y * dropout_scale, with the factor kept for the mask.
    const float k = dropout_scale(seed, static_cast<std::uint64_t>(i), p);
    mask[i] = k != 0.0f;
    out[i] = st(ld(x, i) + ld(y, i) * k);
  }
}
__global__ void dropout_backward_mask_k(const bf16* g, const std::uint8_t* mask, bf16* out, long long n, float p) {
  for (long long i = first_index(); i < n; i += grid_stride())
    out[i] = st(ld(g, i) * dropout_mask_scale(mask[i] != 0, p));
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
    const RowStats s{stats[2 * r], stats[2 * r + 1]};
    y[i] = st(layernorm_apply(ld(x, i), s, ld(gamma, i % n), ld(beta, i % n)));
  }
}
__global__ void rmsnorm_recompute_k(const bf16* x, const float* rstd, const bf16* w, bf16* y, long long total, int n) {
  for (long long i = first_index(); i < total; i += grid_stride()) y[i] = st(ld(x, i) * rstd[i / n] * ld(w, i % n));
}
__global__ void embedding_forward_k(const std::int32_t* ids, const bf16* table, bf16* out, long long total, int n,
                                    int vocab) {
  for (long long i = first_index(); i < total; i += grid_stride()) {
    const int id = ids[i / n];
    out[i] = (id < 0 || id >= vocab) ? st(nan_value()) : table[static_cast<long long>(id) * n + i % n];
  }
}
__global__ void position_embedding_forward_k(const bf16* table, bf16* out, long long total, int n, int seq) {
  for (long long i = first_index(); i < total; i += grid_stride())
    out[i] = st(ld(out, i) + ld(table, ((i / n) % seq) * n + i % n));
}
__global__ void position_ids_forward_k(const bf16* table, const std::int32_t* positions, bf16* out, long long total,
                                       int n, int table_rows) {
  for (long long i = first_index(); i < total; i += grid_stride()) {
    const int p = positions[i / n];
    out[i] =
        st((p < 0 || p >= table_rows) ? nan_value() : ld(out, i) + ld(table, static_cast<long long>(p) * n + i % n));
  }
}
/// One value of a bf16 (rows, n) gradient, for embedding_grad_cells.
struct Bf16Grad {
  const bf16* d;
  __device__ float operator()(long long i) const { return ld(d, i); }
};
/// The table's gradient: this thread's bucket and column (cuda::embedding_owned), its rows in
/// order. No barrier, so threads past the last column simply leave.
__global__ void __launch_bounds__(cuda::column_tile* cuda::embedding_warps)
    embedding_table_grad_k(const std::int32_t* ids, const bf16* d, float* dtable, long long rows, int n, int vocab) {
  const OwnedCells own = embedding_owned(blockIdx.x, threadIdx.x, n);
  if (own.column >= n) return;
  embedding_grad_cells(ids, rows, Bf16Grad{d}, dtable, n, vocab, own.bucket, embedding_buckets, own.column);
}
/// The position table's gradient: cell (p, c) adds rows b * seq + p in order of b.
__global__ void position_embedding_grad_k(const bf16* d, float* dtable, long long batch, int seq, int n) {
  const long long cells = static_cast<long long>(seq) * n;
  for (long long i = first_index(); i < cells; i += grid_stride()) {
    float acc = dtable[i];
    for (long long b = 0; b < batch; ++b) acc += ld(d, b * cells + i);
    dtable[i] = acc;
  }
}

}  // namespace

void gelu_forward(const CudaContext& ctx, const bf16* x, bf16* y, long long count) {
  PIPEOFFLOAD_LAUNCH(gelu_forward_k, elementwise_launch(count), ctx.cuda_stream, x, y, count);
}
void gelu_backward(const CudaContext& ctx, const bf16* x, bf16* g, long long count) {
  PIPEOFFLOAD_LAUNCH(gelu_backward_k, elementwise_launch(count), ctx.cuda_stream, x, g, count);
}
void swiglu_forward(const CudaContext& ctx, const bf16* gate, const bf16* up, bf16* out, long long count) {
  PIPEOFFLOAD_LAUNCH(swiglu_forward_k, elementwise_launch(count), ctx.cuda_stream, gate, up, out, count);
}
void swiglu_backward(const CudaContext& ctx, const bf16* dout, const bf16* gate, const bf16* up, bf16* dgate, bf16* dup,
                     long long count) {
  PIPEOFFLOAD_LAUNCH(swiglu_backward_k, elementwise_launch(count), ctx.cuda_stream, dout, gate, up, dgate, dup, count);
}
void rope(const CudaContext& ctx, bf16* x, const std::int32_t* positions, long long rows, int width, RopeView table,
          bool inverse) {
  if (table.head_dim < 2 || table.head_dim % 2 != 0 || width % table.head_dim != 0)
    throw shape_error("ops::rope: width = " + std::to_string(width) + " is not a multiple of the table's head_dim = " +
                      std::to_string(table.head_dim) + " (an even number >= 2)");
  PIPEOFFLOAD_LAUNCH(rope_k, elementwise_launch(rows * (width / 2)), ctx.cuda_stream, x, positions, rows * (width / 2),
                     width, table, inverse ? -1.0f : 1.0f);
}
void sequence_positions(const CudaContext& ctx, std::int32_t* positions, long long rows, int seq) {
  if (seq < 1) throw shape_error("ops::sequence_positions: seq = " + std::to_string(seq) + " is outside [1, ...)");
  PIPEOFFLOAD_LAUNCH(sequence_positions_k, elementwise_launch(rows), ctx.cuda_stream, positions, rows, seq);
}
void document_positions(const CudaContext& ctx, const std::int32_t* offsets, std::int32_t* positions, long long rows,
                        int seq) {
  if (seq < 1 || rows % seq != 0)
    throw shape_error("ops::document_positions: rows = " + std::to_string(rows) + ", seq = " + std::to_string(seq) +
                      "; need seq >= 1 and whole rows of seq tokens");
  PIPEOFFLOAD_LAUNCH(document_positions_k, elementwise_launch(rows), ctx.cuda_stream, offsets, positions, rows, seq);
}
void add(const CudaContext& ctx, const bf16* a, const bf16* b, bf16* out, long long count) {
  PIPEOFFLOAD_LAUNCH(add_k, elementwise_launch(count), ctx.cuda_stream, a, b, out, count);
}
void residual_dropout(const CudaContext& ctx, const bf16* x, const bf16* y, bf16* out, long long count,
                      DropoutSeed seed, float p) {
  PIPEOFFLOAD_LAUNCH(residual_dropout_k, elementwise_launch(count), ctx.cuda_stream, x, y, out, count, seed, p);
}
void dropout_backward(const CudaContext& ctx, const bf16* g, bf16* out, long long count, DropoutSeed seed, float p) {
  PIPEOFFLOAD_LAUNCH(dropout_backward_k, elementwise_launch(count), ctx.cuda_stream, g, out, count, seed, p);
}
void residual_dropout_mask(const CudaContext& ctx, const bf16* x, const bf16* y, bf16* out, std::uint8_t* mask,
                           long long count, DropoutSeed seed, float p) {
  PIPEOFFLOAD_LAUNCH(residual_dropout_mask_k, elementwise_launch(count), ctx.cuda_stream, x, y, out, mask, count, seed,
                     p);
}
void dropout_backward_mask(const CudaContext& ctx, const bf16* g, const std::uint8_t* mask, bf16* out, long long count,
                           float p) {
  PIPEOFFLOAD_LAUNCH(dropout_backward_mask_k, elementwise_launch(count), ctx.cuda_stream, g, mask, out, count, p);
}
void add_bias(const CudaContext& ctx, bf16* y, const bf16* bias, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(add_bias_k, elementwise_launch(rows * n), ctx.cuda_stream, y, bias, rows * n, n);
}
void add_bias(const CudaContext& ctx, float* y, const float* bias, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(add_bias_f32_k, elementwise_launch(rows * n), ctx.cuda_stream, y, bias, rows * n, n);
}
void layernorm_recompute(const CudaContext& ctx, const bf16* x, const float* stats, const bf16* gamma, const bf16* beta,
                         bf16* y, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(layernorm_recompute_k, elementwise_launch(rows * n), ctx.cuda_stream, x, stats, gamma, beta, y,
                     rows * n, n);
}
void rmsnorm_recompute(const CudaContext& ctx, const bf16* x, const float* rstd, const bf16* weight, bf16* y,
                       long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(rmsnorm_recompute_k, elementwise_launch(rows * n), ctx.cuda_stream, x, rstd, weight, y, rows * n,
                     n);
}
void embedding_forward(const CudaContext& ctx, const std::int32_t* ids, const bf16* table, bf16* out, long long rows,
                       int n, int vocab) {
  PIPEOFFLOAD_LAUNCH(embedding_forward_k, elementwise_launch(rows * n), ctx.cuda_stream, ids, table, out, rows * n, n,
                     vocab);
}
void embedding_backward(const CudaContext& ctx, const std::int32_t* ids, const bf16* d, float* dtable, long long rows,
                        int n, int vocab) {
  PIPEOFFLOAD_LAUNCH(embedding_table_grad_k, embedding_table_grad_launch(n), ctx.cuda_stream, ids, d, dtable, rows, n,
                     vocab);
}
void position_embedding_forward(const CudaContext& ctx, const bf16* table, bf16* out, long long rows, int n, int seq) {
  if (seq < 1)
    throw shape_error("ops::position_embedding_forward: seq = " + std::to_string(seq) + " is outside [1, ...)");
  PIPEOFFLOAD_LAUNCH(position_embedding_forward_k, elementwise_launch(rows * n), ctx.cuda_stream, table, out, rows * n,
                     n, seq);
}
void position_embedding_forward(const CudaContext& ctx, const bf16* table, const std::int32_t* positions, bf16* out,
                                long long rows, int n, int table_rows) {
  PIPEOFFLOAD_LAUNCH(position_ids_forward_k, elementwise_launch(rows * n), ctx.cuda_stream, table, positions, out,
                     rows * n, n, table_rows);
}
void position_embedding_backward(const CudaContext& ctx, const bf16* d, float* dtable, long long rows, int n, int seq) {
  if (seq < 1 || rows % seq != 0)
    throw shape_error("ops::position_embedding_backward: rows = " + std::to_string(rows) +
                      " is not a whole number of sequences of seq = " + std::to_string(seq));
  PIPEOFFLOAD_LAUNCH(position_embedding_grad_k, elementwise_launch(static_cast<long long>(seq) * n), ctx.cuda_stream, d,
                     dtable, rows / seq, seq, n);
}

}  // namespace pipeoffload::ops
