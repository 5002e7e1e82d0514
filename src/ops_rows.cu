// src/ops_rows.cu: the row and column reductions of ops/cuda.hpp (LayerNorm, RMSNorm,
// softmax cross-entropy, the mean, weight and bias gradients). One block of row_block threads
// per row, with cub::BlockReduce; column sums over a tile of columns (column_sum_launch: one
// barrier, then a fixed-order sum of the lanes' partials).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <pipeoffload/backend/cuda/device.cuh>
#include <pipeoffload/ops/cuda.hpp>
#include <pipeoffload/packing.hpp>

namespace pipeoffload::ops {
namespace {

using cuda::column_lanes;
using cuda::column_sum_launch;
using cuda::column_tile;
using cuda::per_row_launch;
using cuda::row_block;
using cuda::kernels::ld;
using cuda::kernels::st;
using Reduce = cub::BlockReduce<float, row_block>;

__device__ inline float ld(const float* p, long long i) { return p[i]; }
__device__ inline void put(float* p, long long i, float v) { p[i] = v; }
__device__ inline void put(bf16* p, long long i, float v) { p[i] = st(v); }

/// Max as a function object (CCCL 3 removed cub::Max; this works with every version).
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// Block-wide sum, broadcast to every thread. The barrier after the broadcast lets the caller
/// reuse `tmp` for its next reduction.
__device__ float block_sum(float v, Reduce::TempStorage& tmp, float& shared) {
  const float s = Reduce(tmp).Sum(v);
  if (threadIdx.x == 0) shared = s;
  __syncthreads();
  const float out = shared;
  __syncthreads();
  return out;
}
__device__ float block_max(float v, Reduce::TempStorage& tmp, float& shared) {
  const float s = Reduce(tmp).Reduce(v, MaxOp{});
  if (threadIdx.x == 0) shared = s;
  __syncthreads();
  const float out = shared;
  __syncthreads();
  return out;
}

__global__ void __launch_bounds__(row_block)
    layernorm_forward_k(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y, float* stats, int n) {
  __shared__ Reduce::TempStorage tmp;
  __shared__ float shared;
  const bf16* xr = x + static_cast<long long>(blockIdx.x) * n;
  bf16* yr = y + static_cast<long long>(blockIdx.x) * n;
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += ld(xr, i);
  const float mean = block_sum(s, tmp, shared) / static_cast<float>(n);
  float v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = ld(xr, i) - mean;
    v += d * d;
  }
  const RowStats rs = row_stats_finish(mean, block_sum(v, tmp, shared), n);
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    yr[i] = st(layernorm_apply(ld(xr, i), rs, ld(gamma, i), ld(beta, i)));
  if (threadIdx.x == 0) {
    stats[2 * static_cast<long long>(blockIdx.x)] = rs.mean;
    stats[2 * static_cast<long long>(blockIdx.x) + 1] = rs.rstd;
  }
}

__global__ void __launch_bounds__(row_block) layernorm_backward_k(const bf16* dy, const bf16* x, const float* stats,
                                                                  const bf16* gamma, bf16* dx, int n, bool accumulate) {
  __shared__ Reduce::TempStorage tmp;
  __shared__ float shared;
  const long long off = static_cast<long long>(blockIdx.x) * n;
  const RowStats rs{stats[2 * static_cast<long long>(blockIdx.x)], stats[2 * static_cast<long long>(blockIdx.x) + 1]};
  float sg = 0, sgx = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float g = ld(dy, off + i) * ld(gamma, i);
    sg += g;
    sgx += g * (ld(x, off + i) - rs.mean) * rs.rstd;
  }
  const float mean_g = block_sum(sg, tmp, shared) / static_cast<float>(n);
  const float mean_gx = block_sum(sgx, tmp, shared) / static_cast<float>(n);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = layernorm_backward_elem(ld(dy, off + i), ld(x, off + i), rs, ld(gamma, i), mean_g, mean_gx);
    dx[off + i] = st(accumulate ? ld(dx, off + i) + d : d);
  }
}

__global__ void __launch_bounds__(row_block)
    rmsnorm_forward_k(const bf16* x, const bf16* w, bf16* y, float* rstd, int n, float eps) {
  __shared__ Reduce::TempStorage tmp;
  __shared__ float shared;
  const long long off = static_cast<long long>(blockIdx.x) * n;
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += ld(x, off + i) * ld(x, off + i);
  const float r = rmsnorm_rstd_finish(block_sum(s, tmp, shared), n, eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[off + i] = st(ld(x, off + i) * r * ld(w, i));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

__global__ void __launch_bounds__(row_block) rmsnorm_backward_k(const bf16* dy, const bf16* x, const float* rstd,
                                                                const bf16* w, bf16* dx, int n, bool accumulate) {
  __shared__ Reduce::TempStorage tmp;
  __shared__ float shared;
  const long long off = static_cast<long long>(blockIdx.x) * n;
  const float r = rstd[blockIdx.x];
  float dot = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) dot += ld(dy, off + i) * ld(w, i) * ld(x, off + i);
  const float c = r * r * r * block_sum(dot, tmp, shared) * (1.0f / static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    dx[off + i] =
        st(rmsnorm_backward_elem(accumulate ? ld(dx, off + i) : 0.0f, ld(dy, off + i), ld(x, off + i), r, ld(w, i), c));
}

template <class L>
__global__ void __launch_bounds__(row_block)
    cross_entropy_k(const L* logits, const std::int32_t* targets, float* losses, L* dlogits, int V, float scale) {
  __shared__ Reduce::TempStorage tmp;
  __shared__ float shared;
  const long long off = static_cast<long long>(blockIdx.x) * V;
  const int target = targets[blockIdx.x];
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, ld(logits, off + i));
  mx = block_max(mx, tmp, shared);
  float s = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(ld(logits, off + i) - mx);
  const float lse = mx + logf(block_sum(s, tmp, shared));
  // Read the target's logit before dlogits (which may alias logits) overwrites it.
  const bool valid = target >= 0 && target < V;
  const float target_logit = valid ? ld(logits, off + target) : __int_as_float(0x7fc00000);
  __syncthreads();
  if (threadIdx.x == 0) losses[blockIdx.x] = lse - target_logit;
  for (int i = threadIdx.x; i < V; i += blockDim.x)
    put(dlogits, off + i, softmax_xent_grad(ld(logits, off + i), lse, i == target, scale));
}

__global__ void __launch_bounds__(row_block) mean_k(const float* x, float* out, long long n) {
  __shared__ Reduce::TempStorage tmp;
  float s = 0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  const float total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) *out = total / static_cast<float>(n);
}

/// The column sums of column_sum_launch: `term(r, c)` summed over rows into out[k][c] += ...
/// for K outputs at once. Lane l sums rows l, l + column_lanes, ... in order; lane 0 then adds
/// the lanes' partials in lane order. Threads past the last column still reach the barrier.
template <int K, class Term>
__device__ void column_sums(long long rows, int n, Term term, float* const (&out)[K]) {
  __shared__ float part[K][column_lanes][column_tile];
  const unsigned tx = threadIdx.x % column_tile, lane = threadIdx.x / column_tile;
  const long long c = static_cast<long long>(blockIdx.x) * column_tile + tx;
  float s[K] = {};
  if (c < n)
    for (long long r = lane; r < rows; r += column_lanes) {
      float t[K];
      term(r, c, t);
      for (int k = 0; k < K; ++k) s[k] += t[k];
    }
  for (int k = 0; k < K; ++k) part[k][lane][tx] = s[k];
  __syncthreads();
  if (lane == 0 && c < n)
    for (int k = 0; k < K; ++k) {
      float total = 0;
      for (unsigned l = 0; l < column_lanes; ++l) total += part[k][l][tx];
      out[k][c] += total;
    }
}

__global__ void __launch_bounds__(column_tile* column_lanes)
    bias_grad_k(const bf16* dy, float* db, long long rows, int n) {
  float* const out[1] = {db};
  column_sums<1>(rows, n, [=](long long r, long long c, float(&t)[1]) { t[0] = ld(dy, r * n + c); }, out);
}

__global__ void __launch_bounds__(column_tile* column_lanes)
    layernorm_weight_grad_k(const bf16* dy, const bf16* x, const float* stats, float* dgamma, float* dbeta,
                            long long rows, int n) {
  float* const out[2] = {dgamma, dbeta};
  column_sums<2>(
      rows, n,
      [=](long long r, long long c, float(&t)[2]) {
        const float d = ld(dy, r * n + c);
        t[0] = d * (ld(x, r * n + c) - stats[2 * r]) * stats[2 * r + 1];  // dy * xhat, as the CPU twin
        t[1] = d;
      },
      out);
}

__global__ void __launch_bounds__(column_tile* column_lanes)
    rmsnorm_weight_grad_k(const bf16* dy, const bf16* x, const float* rstd, float* dw, long long rows, int n) {
  float* const out[1] = {dw};
  column_sums<1>(
      rows, n, [=](long long r, long long c, float(&t)[1]) { t[0] = ld(dy, r * n + c) * ld(x, r * n + c) * rstd[r]; },
      out);
}

/// One block: each thread counts the documents of a run of rows, a block scan gives each run
/// its first document, then each thread writes its rows' entries (po::row_document_table); the
/// last thread, whose count is then the total, pads the table to `slots` entries.
constexpr int table_block = 256;
__global__ void __launch_bounds__(table_block)
    document_table_k(const std::int32_t* offsets, long long rows, int seq, long long slots, DocumentTableView t) {
  using Scan = cub::BlockScan<long long, table_block>;
  __shared__ Scan::TempStorage tmp;
  const long long per = (rows + table_block - 1) / table_block;
  const long long first_row = static_cast<long long>(threadIdx.x) * per;
  const long long end_row = first_row + per < rows ? first_row + per : rows;
  long long mine = 0;
  for (long long r = first_row; r < end_row; ++r) mine += row_documents(offsets + r * (seq + 1), seq);
  long long first = 0;
  Scan(tmp).ExclusiveSum(mine, first);
  for (long long r = first_row; r < end_row; ++r) {
    const std::int32_t* o = offsets + r * (seq + 1);
    row_document_table(o, seq, r, first, t);
    first += row_documents(o, seq);
  }
  if (threadIdx.x == table_block - 1) pad_document_table(first, slots, rows * seq, t);
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                       float* stats, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(layernorm_forward_k, per_row_launch(rows, n), ctx.cuda_stream, x, gamma, beta, y, stats, n);
}
void layernorm_backward(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* stats, const bf16* gamma,
                        bf16* dx, long long rows, int n, bool accumulate) {
  PIPEOFFLOAD_LAUNCH(layernorm_backward_k, per_row_launch(rows, n), ctx.cuda_stream, dy, x, stats, gamma, dx, n,
                     accumulate);
}
void layernorm_weight_grad(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* stats, float* dgamma,
                           float* dbeta, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(layernorm_weight_grad_k, column_sum_launch(n), ctx.cuda_stream, dy, x, stats, dgamma, dbeta, rows,
                     n);
}
void rmsnorm_forward(const CudaContext& ctx, const bf16* x, const bf16* weight, bf16* y, float* rstd, long long rows,
                     int n, float eps) {
  PIPEOFFLOAD_LAUNCH(rmsnorm_forward_k, per_row_launch(rows, n), ctx.cuda_stream, x, weight, y, rstd, n, eps);
}
void rmsnorm_backward(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* rstd, const bf16* weight,
                      bf16* dx, long long rows, int n, bool accumulate) {
  PIPEOFFLOAD_LAUNCH(rmsnorm_backward_k, per_row_launch(rows, n), ctx.cuda_stream, dy, x, rstd, weight, dx, n,
                     accumulate);
}
void rmsnorm_weight_grad(const CudaContext& ctx, const bf16* dy, const bf16* x, const float* rstd, float* dweight,
                         long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(rmsnorm_weight_grad_k, column_sum_launch(n), ctx.cuda_stream, dy, x, rstd, dweight, rows, n);
}
void bias_grad(const CudaContext& ctx, const bf16* dy, float* db, long long rows, int n) {
  PIPEOFFLOAD_LAUNCH(bias_grad_k, column_sum_launch(n), ctx.cuda_stream, dy, db, rows, n);
}
void cross_entropy(const CudaContext& ctx, const float* logits, const std::int32_t* targets, float* losses,
                   float* dlogits, long long rows, int vocab, float scale) {
  PIPEOFFLOAD_LAUNCH(cross_entropy_k<float>, per_row_launch(rows, vocab), ctx.cuda_stream, logits, targets, losses,
                     dlogits, vocab, scale);
}
void cross_entropy(const CudaContext& ctx, const bf16* logits, const std::int32_t* targets, float* losses,
                   bf16* dlogits, long long rows, int vocab, float scale) {
  PIPEOFFLOAD_LAUNCH(cross_entropy_k<bf16>, per_row_launch(rows, vocab), ctx.cuda_stream, logits, targets, losses,
                     dlogits, vocab, scale);
}
void mean(const CudaContext& ctx, const float* losses, float* out, long long rows) {
  PIPEOFFLOAD_LAUNCH(mean_k, per_row_launch(rows > 0 ? 1 : 0, 1), ctx.cuda_stream, losses, out, rows);
}

DeviceDocuments document_table(const CudaContext& ctx, const std::int32_t* offsets, long long rows, int seq, int count,
                               int longest, AttentionShape s, AttentionStrides strides, std::byte* memory) {
  const long long T = rows * seq;
  if (rows < 1 || seq < 1 || count < rows || count > T)
    throw shape_error("ops::document_table: count = " + std::to_string(count) +
                      " documents in rows = " + std::to_string(rows) + " of seq = " + std::to_string(seq) +
                      " tokens; need rows, seq >= 1 and count in [rows, rows * seq]");
  const long long H = static_cast<long long>(s.heads) * s.head_dim, K = static_cast<long long>(s.groups()) * s.head_dim;
  const long long q = strides.q ? strides.q : H, k = strides.k ? strides.k : K, v = strides.v ? strides.v : K,
                  out = strides.out ? strides.out : H;
  if (k != v)
    throw shape_error("ops::document_table: k's row stride " + std::to_string(k) + " differs from v's " +
                      std::to_string(v) + "; cuDNN's packed attention reads one offset array for both");
  if (memory == nullptr || reinterpret_cast<std::uintptr_t>(memory) % 16 != 0)
    throw error("ops::document_table: memory must be device memory aligned to 16 bytes");
  const cuda::DocumentTableLayout at = cuda::document_table_layout(T);
  auto* lengths = reinterpret_cast<std::int32_t*>(memory);
  const auto array = [&](int x) { return reinterpret_cast<std::int64_t*>(memory + at.offsets[x]); };
  DocumentTableView view{lengths, {array(0), array(1), array(2), array(3)}, {q, k, out, s.heads}};
  const int slots = cuda::document_slots(count, T);
  PIPEOFFLOAD_LAUNCH(document_table_k, (cuda::Launch{1, table_block, 0}), ctx.cuda_stream, offsets, rows, seq,
                     static_cast<long long>(slots), view);
  return {slots,
          cuda::packed_length(longest, seq),
          {lengths, view.offsets[0], view.offsets[1], view.offsets[2], view.offsets[3]}};
}

}  // namespace pipeoffload::ops
