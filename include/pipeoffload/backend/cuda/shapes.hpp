// pipeoffload/backend/cuda/shapes.hpp: every launch configuration and GEMM layout of the CUDA
// backend, the bits its non-finite check tests, the layout of fused attention's operands and
// the regions a layer cuts its buffers into, as plain host functions (constexpr where they can
// be). A model's own layouts live with the model (models/gpt/layout.hpp, cuda_layout.hpp).
//
// docs/design.md section 6: CUDA code is judged by reading, so nothing about a launch is computed
// inside a kernel file or a wrapper. The kernels (src/*.cu) and the cuBLASLt wrapper call
// these functions, and tests/cuda/test_host.cpp calls the same functions on the CPU and
// checks grids, blocks, shared memory, limits and leading dimensions. No CUDA header here:
// the file builds and is tested on machines without the toolkit.
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../detail/host_device.hpp"
#include "../../error.hpp"
#include "../../memory/scratch.hpp"
#include "../../tensor.hpp"
#include "../update.hpp"

namespace pipeoffload::cuda {

// ---- kernel launches ----------------------------------------------------------------------

/// Threads per block of every kernel. One block per row kernels reduce with
/// cub::BlockReduce<float, row_block>, whose template argument must be this constant.
inline constexpr unsigned elementwise_block = 256;
inline constexpr unsigned row_block = 256;  ///< threads per block of the one-block-per-row kernels
/// Grid-stride kernels use at most this many blocks: enough to fill any GPU we target
/// (B200: 148 SMs x 8 resident blocks of 256 threads = 1184) several times over, small enough
/// that a launch never approaches gridDim.x's limit; the loop covers the rest.
inline constexpr unsigned max_grid = 8192;
/// CUDA's limit on gridDim.x (2^31 - 1) and on threads per block.
inline constexpr long long grid_x_limit = 2147483647LL;
inline constexpr unsigned block_limit = 1024;  ///< CUDA's limit on threads per block

/// A kernel's launch configuration: grid, block and dynamic shared memory.
struct Launch {
  unsigned grid = 0;       ///< blocks (gridDim.x); 0 means "nothing to do, do not launch"
  unsigned block = 0;      ///< threads per block (blockDim.x)
  std::size_t shared = 0;  ///< dynamic shared memory bytes
  /// Field-by-field equality.
  friend constexpr bool operator==(const Launch&, const Launch&) = default;
};

/// A grid-stride loop over n elements: ceil(n / block) blocks, capped at max_grid.
constexpr Launch elementwise_launch(long long n) {
  if (n < 0) throw shape_error("cuda::elementwise_launch: n = " + pipeoffload::detail::num(n) + " is negative");
  if (n == 0) return {};
  const long long blocks = (n + elementwise_block - 1) / elementwise_block;
  return {static_cast<unsigned>(std::min<long long>(blocks, max_grid)), elementwise_block, 0};
}

/// One block per row of `cols` values (LayerNorm, softmax cross-entropy): rows blocks of
/// row_block threads, each thread strides over the row; reductions use cub::BlockReduce's own
/// static shared memory, so no dynamic shared memory.
constexpr Launch per_row_launch(long long rows, long long cols) {
  if (rows < 0 || cols < 1)
    throw shape_error("cuda::per_row_launch: rows = " + pipeoffload::detail::num(rows) +
                      ", cols = " + pipeoffload::detail::num(cols) + " (need rows >= 0, cols >= 1)");
  if (rows > grid_x_limit)
    throw shape_error("cuda::per_row_launch: rows = " + pipeoffload::detail::num(rows) +
                      " is outside the allowed range [0, 2147483647] (gridDim.x)");
  if (rows == 0) return {};
  return {static_cast<unsigned>(rows), row_block, 0};
}

/// Column sums (bias and LayerNorm weight gradients, rows x cols -> cols): a block of
/// column_tile x column_lanes threads owns column_tile adjacent columns; lane l sums rows l,
/// l + column_lanes, ... in order, then the lanes' partial sums are added in lane order. A
/// fixed order (deterministic, no atomics), with column_lanes times the parallelism of one
/// thread per column (which leaves most of the GPU idle for a (4096, 4096) gradient), and each
/// warp reads column_tile adjacent values of one row (coalesced).
inline constexpr unsigned column_tile = 32;
inline constexpr unsigned column_lanes = 32;  ///< threads that share one column, each summing every column_lanes-th row
/// The launch of the column sums of `cols` columns: ceil(cols / column_tile) blocks.
constexpr Launch column_sum_launch(long long cols) {
  if (cols < 0) throw shape_error("cuda::column_sum_launch: cols = " + pipeoffload::detail::num(cols) + " is negative");
  if (cols == 0) return {};
  const long long blocks = (cols + column_tile - 1) / column_tile;
  if (blocks > grid_x_limit)
    throw shape_error("cuda::column_sum_launch: cols = " + pipeoffload::detail::num(cols) +
                      " needs more blocks than gridDim.x allows");
  return {static_cast<unsigned>(blocks), column_tile * column_lanes, 0};
}

// ---- the embedding's gradient (ops/cuda.hpp: embedding_backward) ---------------------------
//
// Each cell of the token table's gradient, (token t, column c), is owned by one thread, which
// adds the gradient rows of token t in row order, into the value already there: the order of
// the CPU twin's loop (ops/cpu.hpp), so both give the same bits, whatever the GPU's
// scheduling, with no atomics. Thread (bucket k, column c) owns the cells of the tokens with
// t % embedding_buckets == k. A block is embedding_warps warps over column_tile adjacent
// columns, warp w taking bucket (block's bucket group) * embedding_warps + w: the 32 lanes of
// a warp test the same token (no divergence) and read 32 adjacent values of its row
// (coalesced). The grid is ceil(h / 32) column tiles times embedding_buckets / embedding_warps
// bucket groups: 4096 columns give 512 blocks of 256 threads, where one thread per column gave
// 16 blocks, each thread walking every row. The position table's gradient is a plain
// elementwise loop: cell (p, c) adds rows b * seq + p, b = 0, 1, ... in order.
/// Token buckets: bucket k holds the tokens t with t % embedding_buckets == k.
inline constexpr unsigned embedding_buckets = 32;
inline constexpr unsigned embedding_warps = 8;  ///< warps per block, one bucket each

/// Blocks: tile + tiles * group for column tile `tile` and bucket group `group`.
constexpr Launch embedding_table_grad_launch(long long h) {
  if (h < 0)
    throw shape_error("cuda::embedding_table_grad_launch: h = " + pipeoffload::detail::num(h) + " is negative");
  if (h == 0) return {};
  const long long tiles = (h + column_tile - 1) / column_tile, blocks = tiles * (embedding_buckets / embedding_warps);
  if (blocks > grid_x_limit)
    throw shape_error("cuda::embedding_table_grad_launch: h = " + pipeoffload::detail::num(h) +
                      " needs more blocks than gridDim.x allows");
  return {static_cast<unsigned>(blocks), column_tile * embedding_warps, 0};
}

/// The thread that owns cell (token, column c) of the table's gradient, h columns wide.
struct CellOwner {
  unsigned block = 0,  ///< the owning thread's block (blockIdx.x)
      thread = 0;      ///< the owning thread within that block (threadIdx.x)
  /// Field-by-field equality.
  friend constexpr bool operator==(const CellOwner&, const CellOwner&) = default;
};
/// The thread that owns cell (token, column c) of a table h columns wide.
constexpr CellOwner embedding_cell_owner(int token, long long c, long long h) {
  const long long tiles = (h + column_tile - 1) / column_tile;
  const unsigned k = static_cast<unsigned>(token) % embedding_buckets;
  return {static_cast<unsigned>(c / column_tile + tiles * (k / embedding_warps)),
          static_cast<unsigned>((k % embedding_warps) * column_tile + c % column_tile)};
}
/// The bucket and column thread `thread` of block `block` owns (embedding_cell_owner's inverse).
struct OwnedCells {
  unsigned bucket = 0;   ///< k: the thread owns the cells of the tokens with token % embedding_buckets == k
  long long column = 0;  ///< the table column (0 .. h-1) the thread adds into
};
/// The bucket and column thread `thread` of block `block` owns, for a table h columns wide.
PIPEOFFLOAD_HOST_DEVICE constexpr OwnedCells embedding_owned(unsigned block, unsigned thread, long long h) {
  const long long tiles = (h + column_tile - 1) / column_tile;
  return {static_cast<unsigned>(block / tiles) * embedding_warps + thread / column_tile,
          static_cast<long long>(block % tiles) * column_tile + thread % column_tile};
}
static_assert(embedding_buckets % embedding_warps == 0 && column_tile * embedding_warps <= block_limit,
              "The embedding's buckets must split into whole warps of one block.");

static_assert(elementwise_block <= block_limit && row_block <= block_limit && row_block % 32 == 0 &&
                  column_tile == 32 && column_tile * column_lanes <= block_limit,
              "Block sizes must be whole warps within CUDA's 1024-thread limit (a column tile is one warp wide).");
static_assert(elementwise_launch(1) == Launch{1, 256, 0});
static_assert(elementwise_launch(257).grid == 2);
static_assert(elementwise_launch(1LL << 40).grid == max_grid);

// ---- the gradient norm's sums of squares (backend::Cuda::sum_squares) ---------------------
//
// A fixed reduction tree, so that the same values give the same bits on any GPU and on the CPU
// (sum_squares_reference below, which tests/cuda/test_host.cpp checks against the formula and
// the GPU test against the kernel). Each group of n values is cut into ceil(n / norm_chunk)
// blocks; block j of a group is one thread block of norm_block threads, thread t summing, in
// fp64 from 0, the squares of values j*norm_chunk + t + i*norm_block for i = 0, 1, ... (inside
// the group) in order; the block's norm_block sums are then added pairwise, s[t] += s[t + w]
// for w = norm_block/2, ..., 2, 1, and s[0] is the block's partial. One thread block per group
// then does the same with the group's partials (thread t adds partials t, t + norm_block, ...
// in order, then the same pairwise tree). Each block covers whole chunks of one group, so all
// groups reduce in one launch and a 100M-value group uses 24k blocks, not one. A float's
// square is exact in fp64, so a fused multiply-add gives the same bits as a multiply and add.

inline constexpr unsigned norm_block = 256;      ///< threads per block of both reductions (a power of two)
inline constexpr unsigned norm_per_thread = 16;  ///< values each thread sums per block
/// Values one block covers: norm_block * norm_per_thread.
inline constexpr long long norm_chunk = static_cast<long long>(norm_block) * norm_per_thread;
static_assert((norm_block & (norm_block - 1)) == 0 && norm_block <= block_limit,
              "The norm's pairwise tree needs a power-of-two block of at most 1024 threads.");

/// Which blocks reduce which group: group k's are [first_block[k], first_block[k + 1]).
struct NormPlan {
  std::vector<long long> first_block;  ///< groups + 1 entries, nondecreasing
  /// Thread blocks in all, over every group (the first launch's grid).
  long long blocks() const { return first_block.empty() ? 0 : first_block.back(); }
};

/// The blocks of groups of these sizes: ceil(n / norm_chunk) for a group of n values.
inline NormPlan sum_squares_plan(std::span<const std::size_t> groups) {
  NormPlan p;
  p.first_block.reserve(groups.size() + 1);
  long long b = 0;
  p.first_block.push_back(0);
  for (std::size_t n : groups) {
    b += (static_cast<long long>(n) + norm_chunk - 1) / norm_chunk;
    if (b > grid_x_limit)
      throw shape_error("cuda::sum_squares_plan: " + pipeoffload::detail::num(b) +
                        " blocks is outside the allowed range [0, 2147483647] (gridDim.x)");
    p.first_block.push_back(b);
  }
  return p;
}

/// The table the kernels read (device memory, int64): first_block (groups + 1 entries), then
/// each group's first value (groups), then each group's count (groups).
inline std::vector<long long> norm_table(const NormPlan& p, std::span<const std::size_t> groups) {
  std::vector<long long> t(p.first_block);
  long long at = 0;
  for (std::size_t n : groups) {
    t.push_back(at);
    at += static_cast<long long>(n);
  }
  for (std::size_t n : groups) t.push_back(static_cast<long long>(n));
  return t;
}

/// Device bytes backend::Cuda::sum_squares needs for `groups`: the table ((3g + 1) int64: see
/// norm_table), the plan's fp64 partials and the g fp64 sums, one after the other.
inline std::size_t norm_buffer_bytes(std::span<const std::size_t> groups) {
  const std::size_t g = groups.size();
  return (3 * g + 1) * sizeof(long long) +
         static_cast<std::size_t>(sum_squares_plan(groups).blocks()) * sizeof(double) + g * sizeof(double);
}

/// The first launch: `blocks` blocks of norm_block threads, one per chunk of a group.
constexpr Launch norm_partials_launch(long long blocks) {
  if (blocks < 0 || blocks > grid_x_limit)
    throw shape_error("cuda::norm_partials_launch: blocks = " + pipeoffload::detail::num(blocks) +
                      " is outside the allowed range [0, 2147483647]");
  return {static_cast<unsigned>(blocks), norm_block, 0};
}
/// The second launch: one block of norm_block threads per group, over its partials.
constexpr Launch norm_groups_launch(long long groups) { return norm_partials_launch(groups); }

/// Thread `lane`'s sum over block `j` of a group of n values at x (see above).
PIPEOFFLOAD_HOST_DEVICE inline double norm_lane(const float* x, long long n, long long j, unsigned lane) {
  double s = 0;
  const long long end = (j + 1) * norm_chunk < n ? (j + 1) * norm_chunk : n;
  for (long long i = j * norm_chunk + lane; i < end; i += norm_block) s += static_cast<double>(x[i]) * x[i];
  return s;
}
/// Thread `lane`'s sum over a group's `count` partials at p.
PIPEOFFLOAD_HOST_DEVICE inline double norm_partials_lane(const double* p, long long count, unsigned lane) {
  double s = 0;
  for (long long i = lane; i < count; i += norm_block) s += p[i];
  return s;
}
/// The block's pairwise tree on its norm_block lane sums, as the kernels run it level by level
/// (the additions of one level are independent, so any order within a level gives these bits).
inline double norm_tree(double (&s)[norm_block]) {
  for (unsigned w = norm_block / 2; w > 0; w /= 2)
    for (unsigned t = 0; t < w; ++t) s[t] += s[t + w];
  return s[0];
}

/// The CPU reference of backend::Cuda::sum_squares: the same blocks, lanes and trees.
inline void sum_squares_reference(std::span<const float> values, std::span<const std::size_t> groups,
                                  std::span<double> out) {
  const NormPlan p = sum_squares_plan(groups);
  std::size_t at = 0;
  std::vector<double> partials;
  double s[norm_block];
  for (std::size_t k = 0; k < groups.size(); ++k) {
    const long long n = static_cast<long long>(groups[k]);
    partials.assign(static_cast<std::size_t>(p.first_block[k + 1] - p.first_block[k]), 0.0);
    for (std::size_t j = 0; j < partials.size(); ++j) {
      for (unsigned t = 0; t < norm_block; ++t) s[t] = norm_lane(values.data() + at, n, static_cast<long long>(j), t);
      partials[j] = norm_tree(s);
    }
    for (unsigned t = 0; t < norm_block; ++t)
      s[t] = norm_partials_lane(partials.data(), static_cast<long long>(partials.size()), t);
    out[k] = norm_tree(s);
    at += groups[k];
  }
}

// ---- multi-tensor updates (backend::Cuda::adamw, sgd) ---------------------------------------
//
// One launch updates up to segments_per_launch runs (update::Segment): the runs travel in the
// kernel's argument, each gets ceil(count / segment_tile) blocks, and block b updates values
// [t * segment_tile, (t + 1) * segment_tile) of the run segment_of(b) finds, t being b's place
// among that run's blocks. tests/cuda/test_host.cpp walks every block on the CPU.

/// Runs one launch takes at most: its table (56 bytes a run, 8 for its first block) and the
/// step's scalars stay under the 4 KiB of kernel arguments every CUDA version allows.
inline constexpr std::size_t segments_per_launch = 48;
/// Values one block of a multi-tensor update handles (elementwise_block threads, 16 each).
inline constexpr long long segment_tile = static_cast<long long>(elementwise_block) * 16;

/// One launch of a multi-tensor update: its runs and where each one's blocks start.
struct SegmentLaunch {
  update::Segment segments[segments_per_launch]{};   ///< the runs, count of them
  long long first_block[segments_per_launch + 1]{};  ///< run k's blocks are [first_block[k], first_block[k + 1])
  int count = 0;                                     ///< runs in this launch
  /// Its launch shape: one block per tile of every run.
  constexpr Launch launch() const { return {static_cast<unsigned>(first_block[count]), elementwise_block, 0}; }
};
static_assert(sizeof(SegmentLaunch) + 64 <= 4096, "a multi-tensor launch's argument must fit CUDA's 4 KiB");

/// The run block `block` of `l` belongs to (first_block is increasing; a linear scan of at most
/// segments_per_launch entries).
PIPEOFFLOAD_HOST_DEVICE inline int segment_of(const SegmentLaunch& l, long long block) {
  int k = 0;
  while (k + 1 < l.count && l.first_block[k + 1] <= block) ++k;
  return k;
}

/// The launches that update `segments` in order (runs of no values left out), at most
/// segments_per_launch runs each.
inline std::vector<SegmentLaunch> segment_launches(std::span<const update::Segment> segments) {
  std::vector<SegmentLaunch> out;
  for (const update::Segment& s : segments) {
    if (s.count == 0) continue;
    if (out.empty() || out.back().count == static_cast<int>(segments_per_launch)) out.emplace_back();
    SegmentLaunch& l = out.back();
    const long long tiles = (static_cast<long long>(s.count) + segment_tile - 1) / segment_tile;
    const long long end = l.first_block[l.count] + tiles;
    if (end > grid_x_limit)
      throw shape_error("cuda::segment_launches: " + std::to_string(end) + " blocks exceed gridDim.x's limit " +
                        std::to_string(grid_x_limit));
    l.segments[l.count] = s;
    l.first_block[++l.count] = end;
  }
  return out;
}

// ---- the non-finite check (backend::Cuda::flag_nonfinite) ---------------------------------

/// The exponent bits of one value of `t`: an IEEE value is NaN or infinite exactly when they
/// are all ones, which is how backend::Cpu::flag_nonfinite tests a tensor; the CUDA kernel
/// tests the same bits of the same words. 0 for types without such values (integers).
constexpr std::uint64_t nonfinite_mask(DType t) {
  switch (t) {
    case DType::float32:
      return 0x7f800000u;
    case DType::float64:
      return 0x7ff0000000000000ull;
    case DType::bfloat16:
      return 0x7f80u;
    case DType::float16:
      return 0x7c00u;
    default:
      return 0;
  }
}

/// Is the value whose raw bits are `word` NaN or infinite, for the mask of its type?
template <class Word>
PIPEOFFLOAD_HOST_DEVICE constexpr bool nonfinite_word(Word word, Word mask) {
  return (word & mask) == mask;
}

static_assert(nonfinite_word(std::uint32_t{0x7fc00000u}, std::uint32_t{0x7f800000u}) &&      // float32 NaN
                  nonfinite_word(std::uint32_t{0xff800000u}, std::uint32_t{0x7f800000u}) &&  // -Inf
                  !nonfinite_word(std::uint32_t{0x7f7fffffu}, std::uint32_t{0x7f800000u}),   // the largest finite float
              "nonfinite_word must flag NaN and infinities and nothing finite.");

// ---- GEMM layouts -------------------------------------------------------------------------

/// A GEMM operand as stored (n) or transposed (t).
enum class Op : std::uint8_t { n, t };  ///< as stored, or transposed

/// A row-major GEMM as the CPU model calls OpenBLAS (backend/cpu/blas.hpp):
/// C[M x N] = alpha * op(A)[M x K] * op(B)[K x N] + beta * C, with row strides lda, ldb, ldc.
struct RowMajorGemm {
  Op ta = Op::n,      ///< op on A
      tb = Op::n;     ///< op on B
  long long M = 0,    ///< rows of C and of op(A)
      N = 0,          ///< columns of C and of op(B)
      K = 0;          ///< the inner dimension: columns of op(A), rows of op(B)
  long long lda = 0,  ///< A's row stride, elements
      ldb = 0,        ///< B's row stride, elements
      ldc = 0;        ///< C's row stride, elements
  float alpha = 1,    ///< scale on op(A) op(B)
      beta = 0;       ///< scale on the C already there (0: C is overwritten)
  /// Field-by-field equality.
  friend constexpr bool operator==(const RowMajorGemm&, const RowMajorGemm&) = default;
};

/// The same product as cuBLASLt sees it (column-major, cublasLtMatmul's A, B, C): a row-major
/// matrix is its transpose in column-major order, so C^T = op(B)^T op(A)^T: cuBLASLt's A is
/// our B and its B our A, m = N, n = M, k = K. `a_rows x a_cols` is how cuBLASLt's A is
/// stored (column-major, ld >= rows), likewise B and C; those are the matrix layouts to create.
struct ColMajorGemm {
  Op transa = Op::n,     ///< op on cuBLASLt's A (the row-major tb)
      transb = Op::n;    ///< op on cuBLASLt's B (the row-major ta)
  long long m = 0,       ///< rows of cuBLASLt's C (= N)
      n = 0,             ///< columns of cuBLASLt's C (= M)
      k = 0;             ///< the inner dimension (= K)
  long long a_rows = 0,  ///< rows of cuBLASLt's A as stored (column-major)
      a_cols = 0,        ///< columns of cuBLASLt's A as stored
      lda = 0;           ///< cuBLASLt's A = the row-major B; its leading dimension, elements
  long long b_rows = 0,  ///< rows of cuBLASLt's B as stored (column-major)
      b_cols = 0,        ///< columns of cuBLASLt's B as stored
      ldb = 0;           ///< cuBLASLt's B = the row-major A; its leading dimension, elements
  long long c_rows = 0,  ///< rows of cuBLASLt's C as stored (column-major)
      c_cols = 0,        ///< columns of cuBLASLt's C as stored
      ldc = 0;           ///< C's leading dimension, elements
  bool swapped = true;   ///< A pointer is the row-major B (always, see above)
  float alpha = 1,       ///< scale on op(A) op(B)
      beta = 0;          ///< scale on the C already there (0: C is overwritten)
  /// Field-by-field equality.
  friend constexpr bool operator==(const ColMajorGemm&, const ColMajorGemm&) = default;
};

/// Checks a row-major GEMM's leading dimensions and converts it; throws shape_error naming
/// the bad value.
constexpr ColMajorGemm to_column_major(const RowMajorGemm& g) {
  if (g.M < 0 || g.N < 0 || g.K < 0) throw shape_error("cuda::to_column_major: M, N, K must be >= 0");
  // Row-major op(A) is M x K: stored M x K (no) or K x M (t); its row stride must cover a row.
  const long long a_row_len = g.ta == Op::n ? g.K : g.M;
  const long long b_row_len = g.tb == Op::n ? g.N : g.K;
  if (g.lda < std::max(1LL, a_row_len))
    throw shape_error("cuda::to_column_major: lda = " + pipeoffload::detail::num(g.lda) + " is below the row length " +
                      pipeoffload::detail::num(a_row_len));
  if (g.ldb < std::max(1LL, b_row_len))
    throw shape_error("cuda::to_column_major: ldb = " + pipeoffload::detail::num(g.ldb) + " is below the row length " +
                      pipeoffload::detail::num(b_row_len));
  if (g.ldc < std::max(1LL, g.N))
    throw shape_error("cuda::to_column_major: ldc = " + pipeoffload::detail::num(g.ldc) +
                      " is below N = " + pipeoffload::detail::num(g.N));
  ColMajorGemm c;
  c.transa = g.tb;
  c.transb = g.ta;
  c.m = g.N;
  c.n = g.M;
  c.k = g.K;
  // cuBLASLt's A is the row-major B: a row-major R x C matrix with stride ld is a column-major
  // C x R matrix with ld. Stored row-major B is K x N (n) or N x K (t).
  c.a_rows = g.tb == Op::n ? g.N : g.K;
  c.a_cols = g.tb == Op::n ? g.K : g.N;
  c.lda = g.ldb;
  c.b_rows = g.ta == Op::n ? g.K : g.M;
  c.b_cols = g.ta == Op::n ? g.M : g.K;
  c.ldb = g.lda;
  c.c_rows = g.N;
  c.c_cols = g.M;
  c.ldc = g.ldc;
  c.alpha = g.alpha;
  c.beta = g.beta;
  return c;
}

/// The three GEMMs of a linear layer Y = X W (X rows x k, W k x n, row-major), exactly as the
/// CPU GPT (models/gpt/cpu.hpp: linear, linear_dx, linear_dw) calls the CPU GEMM.
/// Forward: Y (rows x n) = X W.
constexpr RowMajorGemm linear_forward(long long rows, long long k, long long n) {
  return {Op::n, Op::n, rows, n, k, k, n, n, 1.0f, 0.0f};
}
/// B (dgrad): dX (rows x k) = dY W^T.
constexpr RowMajorGemm linear_dgrad(long long rows, long long k, long long n) {
  return {Op::n, Op::t, rows, k, n, n, n, k, 1.0f, 0.0f};
}
/// W (wgrad): dW (k x n) += X^T dY (accumulates over microbatches: beta = 1).
constexpr RowMajorGemm linear_wgrad(long long rows, long long k, long long n) {
  return {Op::t, Op::n, k, n, rows, k, n, n, 1.0f, 1.0f};
}

/// What cuBLASLt's heuristic may assume about an operand at `address`: the largest power of two
/// dividing it, up to 256 (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, whose default is 256).
constexpr std::uint32_t pointer_alignment(std::uintptr_t address) {
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}
static_assert(pointer_alignment(0) == 256 && pointer_alignment(4096 + 16) == 16 && pointer_alignment(2) == 2 &&
              pointer_alignment(7) == 1);

/// Elements of a rows x cols matrix stored with leading dimension ld (last row/column short).
constexpr long long stored_elements(long long rows, long long cols, long long ld) {
  return cols == 0 ? 0 : ld * (cols - 1) + rows;
}

// ---- attention (cuDNN SDPA) ------------------------------------------------------------------

/// Dims and strides of one SDPA call's tensors: Q, the output and its gradient (B, heads, S,
/// head_dim); K and V (B, kv_heads, S, head_dim), where grouped-query attention has fewer
/// kv_heads than heads (query head a reads key/value head a / (heads / kv_heads)); the fp32
/// log-sum-exp statistics (B, heads, S, 1), the CPU models' lse layout (b, a, s). Row t of
/// sequence b is token b*s + t; head a of a row starts at a*head_dim.
struct SdpaLayout {
  long long dims[4] = {};           ///< (B, heads, S, head_dim) of Q and the output
  long long kv_dims[4] = {};        ///< (B, kv_heads, S, head_dim) of K and V
  long long q_strides[4] = {};      ///< strides, elements, of Q (and its gradient)
  long long kv_strides[4] = {};     ///< strides, elements, of K and V (and their gradients)
  long long q_offset = 0,           ///< Q's first element from its base
      k_offset = 0,                 ///< K's first element from its base
      v_offset = 0;                 ///< V's first element from its base
  long long out_strides[4] = {};    ///< strides, elements, of the (b*s, heads*head_dim) output
  long long stats_dims[4] = {};     ///< (B, heads, S, 1) of the log-sum-exp statistics
  long long stats_strides[4] = {};  ///< strides, elements, of the statistics
};

/// The layout of an SDPA call whose Q, K and V are rows of separate tensors: q (b*s,
/// heads*head_dim), k and v (b*s, kv_heads*head_dim). Throws shape_error for a size < 1, heads
/// not a multiple of kv_heads, or head_dim not a multiple of 8 in [8, 256].
constexpr SdpaLayout sdpa_layout_separate(long long batch, long long heads, long long kv_heads, long long seq,
                                          long long head_dim) {
  if (batch < 1 || heads < 1 || kv_heads < 1 || seq < 1 || head_dim < 1)
    throw shape_error("cuda::sdpa_layout: batch, heads, kv_heads, seq and head_dim must be >= 1");
  if (heads % kv_heads != 0)
    throw shape_error("cuda::sdpa_layout: heads = " + pipeoffload::detail::num(heads) +
                      " is not a multiple of kv_heads = " + pipeoffload::detail::num(kv_heads));
  if (head_dim % 8 != 0 || head_dim > 256)
    throw shape_error("cuda::sdpa_layout: head_dim = " + pipeoffload::detail::num(head_dim) +
                      " must be a multiple of 8 in [8, 256] (cuDNN's fused attention)");
  const long long h = heads * head_dim, hk = kv_heads * head_dim;
  SdpaLayout l;
  const long long dims[4] = {batch, heads, seq, head_dim};
  const long long kv_dims[4] = {batch, kv_heads, seq, head_dim};
  const long long q[4] = {seq * h, head_dim, h, 1};
  const long long kv[4] = {seq * hk, head_dim, hk, 1};
  const long long sd[4] = {batch, heads, seq, 1};
  const long long ss[4] = {heads * seq, seq, 1, 1};
  for (int i = 0; i < 4; ++i) {
    l.dims[i] = dims[i];
    l.kv_dims[i] = kv_dims[i];
    l.q_strides[i] = q[i];
    l.kv_strides[i] = kv[i];
    l.out_strides[i] = q[i];
    l.stats_dims[i] = sd[i];
    l.stats_strides[i] = ss[i];
  }
  return l;
}

/// The layout of an SDPA call on a fused qkv tensor (the GPT's: rows [q | k | v] of h =
/// heads * head_dim each, one base for all three, K at offset h and V at 2h); the output is
/// (b*s, h). Throws as sdpa_layout_separate.
constexpr SdpaLayout sdpa_layout(long long batch, long long heads, long long seq, long long head_dim) {
  SdpaLayout l = sdpa_layout_separate(batch, heads, heads, seq, head_dim);
  const long long h = heads * head_dim;
  const long long qkv[4] = {seq * 3 * h, head_dim, 3 * h, 1};
  for (int i = 0; i < 4; ++i) l.q_strides[i] = l.kv_strides[i] = qkv[i];
  l.q_offset = 0;
  l.k_offset = h;
  l.v_offset = 2 * h;
  return l;
}

/// The layout of a packed call (several documents a row): `l` is sdpa_layout or
/// sdpa_layout_separate built with the microbatch's documents as its batch and its rows' length
/// as seq (the longest a document can be); each document's first element in every tensor comes
/// from cuDNN's ragged offsets (ops::document_table), not from the batch stride, and the
/// statistics are token-major, (tokens, heads), as cuDNN's ragged statistics are.
constexpr SdpaLayout ragged(SdpaLayout l) {
  const long long heads = l.dims[1], seq = l.dims[2];
  const long long ss[4] = {seq * heads, 1, heads, 1};
  for (int i = 0; i < 4; ++i) l.stats_strides[i] = ss[i];
  return l;
}

/// The length cuDNN's graph of a packed call is built for (its S), given the call's longest
/// document and its rows' length `seq`: the smallest power of two at least `longest` and 64,
/// at most `seq`. The deterministic backward's workspace grows with documents x S^2
/// (docs/packing.md), so S follows the documents rather than the rows; a few lengths (powers of
/// two) keep the graphs built few.
constexpr int packed_length(int longest, int seq) {
  if (longest < 1 || longest > seq)
    throw shape_error("cuda::packed_length: the longest document has " + pipeoffload::detail::num(longest) +
                      " tokens; it must be in [1, seq = " + pipeoffload::detail::num(seq) + "]");
  long long s = 64;
  while (s < longest) s *= 2;
  return static_cast<int>(std::min<long long>(s, seq));
}

// ---- regions of a buffer ------------------------------------------------------------------

/// A byte range of a buffer.
struct Region {
  std::size_t offset = 0;  ///< first byte, from the buffer's start
  std::size_t bytes = 0;   ///< length, bytes
  /// One past the last byte, from the buffer's start.
  constexpr std::size_t end() const { return offset + bytes; }
  /// Field-by-field equality.
  friend constexpr bool operator==(const Region&, const Region&) = default;
};

/// Every region starts at a multiple of this: cuBLASLt and cuDNN want 16-byte aligned
/// operands, and 256 is what cudaMalloc and backend::Cuda's arena hand out, so a region of a
/// buffer from either is aligned.
inline constexpr std::size_t region_alignment = 256;

/// n rounded up to a multiple of a.
constexpr std::size_t align_up(std::size_t n, std::size_t a = region_alignment) { return (n + a - 1) / a * a; }

/// Lays regions out one after another, each starting aligned.
struct RegionCarver {
  std::size_t top = 0;  ///< bytes laid out so far (the end of the last region, unaligned)
  /// The next region of `bytes` bytes, starting at `top` rounded up to region_alignment.
  constexpr Region take(std::size_t bytes) {
    top = align_up(top);
    const Region r{top, bytes};
    top += bytes;
    return r;
  }
  /// Bytes the buffer needs for every region taken: `top` rounded up to region_alignment.
  constexpr std::size_t total() const { return align_up(top); }
};

}  // namespace pipeoffload::cuda
