// pipeoffload/backend/cuda/shapes.hpp: every launch configuration and GEMM layout of the CUDA
// backend, the CUDA GPT stage's layouts (parameters, buffers, named tensors, step inputs) and
// the bits its non-finite check tests, as plain host functions (constexpr where they can be).
//
// DESIGN.md section 6: CUDA code is judged by reading, so nothing about a launch is computed
// inside a kernel file or a wrapper. The kernels (kernels/*.cu) and the cuBLASLt wrapper call
// these functions, and tests/cuda/test_host.cpp calls the same functions on the CPU and
// checks grids, blocks, shared memory, limits and leading dimensions. No CUDA header here:
// the file builds and is tested on machines without the toolkit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../detail/host_device.hpp"
#include "../../error.hpp"
#include "../../model/layer.hpp"  // ParamInfo, InputSpec, MicrobatchShape (CPU-safe)
#include "../../tensor.hpp"

namespace pipeoffload::cuda {

// ---- kernel launches ----------------------------------------------------------------------

/// Threads per block of every kernel. One block per row kernels reduce with
/// cub::BlockReduce<float, row_block>, whose template argument must be this constant.
inline constexpr unsigned elementwise_block = 256;
inline constexpr unsigned row_block = 256;
/// Grid-stride kernels use at most this many blocks: enough to fill any GPU we target
/// (B200: 148 SMs x 8 resident blocks of 256 threads = 1184) several times over, small enough
/// that a launch never approaches gridDim.x's limit; the loop covers the rest.
inline constexpr unsigned max_grid = 8192;
/// CUDA's limit on gridDim.x (2^31 - 1) and on threads per block.
inline constexpr long long grid_x_limit = 2147483647LL;
inline constexpr unsigned block_limit = 1024;

struct Launch {
  unsigned grid = 0;         ///< blocks (gridDim.x); 0 means "nothing to do, do not launch"
  unsigned block = 0;        ///< threads per block (blockDim.x)
  std::size_t shared = 0;    ///< dynamic shared memory bytes
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
  if (rows < 0 || cols < 1) throw shape_error("cuda::per_row_launch: rows = " + pipeoffload::detail::num(rows) + ", cols = " + pipeoffload::detail::num(cols) + " (need rows >= 0, cols >= 1)");
  if (rows > grid_x_limit) throw shape_error("cuda::per_row_launch: rows = " + pipeoffload::detail::num(rows) + " is outside the allowed range [0, 2147483647] (gridDim.x)");
  if (rows == 0) return {};
  return {static_cast<unsigned>(rows), row_block, 0};
}

/// The embedding's gradient: one thread per column, each walking the rows in order (a row
/// adds into the table row of its token, so rows cannot be split; deterministic, no atomics).
constexpr Launch per_column_launch(long long cols) { return elementwise_launch(cols); }

/// Column sums (bias and LayerNorm weight gradients, rows x cols -> cols): a block of
/// column_tile x column_lanes threads owns column_tile adjacent columns; lane l sums rows l,
/// l + column_lanes, ... in order, then the lanes' partial sums are added in lane order. A
/// fixed order (deterministic, no atomics), with column_lanes times the parallelism of one
/// thread per column (which leaves most of the GPU idle for a (4096, 4096) gradient), and each
/// warp reads column_tile adjacent values of one row (coalesced).
inline constexpr unsigned column_tile = 32;
inline constexpr unsigned column_lanes = 32;
constexpr Launch column_sum_launch(long long cols) {
  if (cols < 0) throw shape_error("cuda::column_sum_launch: cols = " + pipeoffload::detail::num(cols) + " is negative");
  if (cols == 0) return {};
  const long long blocks = (cols + column_tile - 1) / column_tile;
  if (blocks > grid_x_limit) throw shape_error("cuda::column_sum_launch: cols = " + pipeoffload::detail::num(cols) + " needs more blocks than gridDim.x allows");
  return {static_cast<unsigned>(blocks), column_tile * column_lanes, 0};
}

static_assert(elementwise_block <= block_limit && row_block <= block_limit && row_block % 32 == 0 && column_tile == 32 &&
                  column_tile * column_lanes <= block_limit,
              "Block sizes must be whole warps within CUDA's 1024-thread limit (a column tile is one warp wide).");
static_assert(elementwise_launch(1) == Launch{1, 256, 0});
static_assert(elementwise_launch(257).grid == 2);
static_assert(elementwise_launch(1LL << 40).grid == max_grid);

// ---- the non-finite check (backend::Cuda::flag_nonfinite) ---------------------------------

/// The exponent bits of one value of `t`: an IEEE value is NaN or infinite exactly when they
/// are all ones, which is how backend::Cpu::flag_nonfinite tests a tensor; the CUDA kernel
/// tests the same bits of the same words. 0 for types without such values (integers).
constexpr std::uint64_t nonfinite_mask(DType t) {
  switch (t) {
    case DType::float32: return 0x7f800000u;
    case DType::float64: return 0x7ff0000000000000ull;
    case DType::bfloat16: return 0x7f80u;
    case DType::float16: return 0x7c00u;
    default: return 0;
  }
}

/// Is the value whose raw bits are `word` NaN or infinite, for the mask of its type?
template <class Word>
PIPEOFFLOAD_HOST_DEVICE constexpr bool nonfinite_word(Word word, Word mask) {
  return (word & mask) == mask;
}

static_assert(nonfinite_word(std::uint32_t{0x7fc00000u}, std::uint32_t{0x7f800000u}) &&  // float32 NaN
                  nonfinite_word(std::uint32_t{0xff800000u}, std::uint32_t{0x7f800000u}) &&  // -Inf
                  !nonfinite_word(std::uint32_t{0x7f7fffffu}, std::uint32_t{0x7f800000u}),   // the largest finite float
              "nonfinite_word must flag NaN and infinities and nothing finite.");

// ---- GEMM layouts -------------------------------------------------------------------------

enum class Op : std::uint8_t { n, t };  ///< as stored, or transposed

/// A row-major GEMM as the CPU model calls OpenBLAS (backend/cpu/blas.hpp):
/// C[M x N] = alpha * op(A)[M x K] * op(B)[K x N] + beta * C, with row strides lda, ldb, ldc.
struct RowMajorGemm {
  Op ta = Op::n, tb = Op::n;
  long long M = 0, N = 0, K = 0;
  long long lda = 0, ldb = 0, ldc = 0;
  float alpha = 1, beta = 0;
  friend constexpr bool operator==(const RowMajorGemm&, const RowMajorGemm&) = default;
};

/// The same product as cuBLASLt sees it (column-major, cublasLtMatmul's A, B, C): a row-major
/// matrix is its transpose in column-major order, so C^T = op(B)^T op(A)^T: cuBLASLt's A is
/// our B and its B our A, m = N, n = M, k = K. `a_rows x a_cols` is how cuBLASLt's A is
/// stored (column-major, ld >= rows), likewise B and C; those are the matrix layouts to create.
struct ColMajorGemm {
  Op transa = Op::n, transb = Op::n;
  long long m = 0, n = 0, k = 0;
  long long a_rows = 0, a_cols = 0, lda = 0;  ///< cuBLASLt's A = the row-major B
  long long b_rows = 0, b_cols = 0, ldb = 0;  ///< cuBLASLt's B = the row-major A
  long long c_rows = 0, c_cols = 0, ldc = 0;
  bool swapped = true;                        ///< A pointer is the row-major B (always, see above)
  float alpha = 1, beta = 0;
  friend constexpr bool operator==(const ColMajorGemm&, const ColMajorGemm&) = default;
};

/// Checks a row-major GEMM's leading dimensions and converts it; throws shape_error naming
/// the bad value.
constexpr ColMajorGemm to_column_major(const RowMajorGemm& g) {
  if (g.M < 0 || g.N < 0 || g.K < 0) throw shape_error("cuda::to_column_major: M, N, K must be >= 0");
  // Row-major op(A) is M x K: stored M x K (no) or K x M (t); its row stride must cover a row.
  const long long a_row_len = g.ta == Op::n ? g.K : g.M;
  const long long b_row_len = g.tb == Op::n ? g.N : g.K;
  if (g.lda < std::max(1LL, a_row_len)) throw shape_error("cuda::to_column_major: lda = " + pipeoffload::detail::num(g.lda) + " is below the row length " + pipeoffload::detail::num(a_row_len));
  if (g.ldb < std::max(1LL, b_row_len)) throw shape_error("cuda::to_column_major: ldb = " + pipeoffload::detail::num(g.ldb) + " is below the row length " + pipeoffload::detail::num(b_row_len));
  if (g.ldc < std::max(1LL, g.N)) throw shape_error("cuda::to_column_major: ldc = " + pipeoffload::detail::num(g.ldc) + " is below N = " + pipeoffload::detail::num(g.N));
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

/// The GPT's three GEMMs of a linear layer Y = X W (X rows x k, W k x n, row-major), exactly
/// as model/gpt.hpp's linear, linear_dx and linear_dw call the CPU GEMM.
/// Forward: Y (rows x n) = X W.
constexpr RowMajorGemm linear_forward(long long rows, long long k, long long n) { return {Op::n, Op::n, rows, n, k, k, n, n, 1.0f, 0.0f}; }
/// B (dgrad): dX (rows x k) = dY W^T.
constexpr RowMajorGemm linear_dgrad(long long rows, long long k, long long n) { return {Op::n, Op::t, rows, k, n, n, n, k, 1.0f, 0.0f}; }
/// W (wgrad): dW (k x n) += X^T dY (accumulates over microbatches: beta = 1).
constexpr RowMajorGemm linear_wgrad(long long rows, long long k, long long n) { return {Op::t, Op::n, k, n, rows, k, n, n, 1.0f, 1.0f}; }

/// What cuBLASLt's heuristic may assume about an operand at `address`: the largest power of two
/// dividing it, up to 256 (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, whose default is 256).
constexpr std::uint32_t pointer_alignment(std::uintptr_t address) {
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}
static_assert(pointer_alignment(0) == 256 && pointer_alignment(4096 + 16) == 16 && pointer_alignment(2) == 2 && pointer_alignment(7) == 1);

/// Elements of a rows x cols matrix stored with leading dimension ld (last row/column short).
constexpr long long stored_elements(long long rows, long long cols, long long ld) { return cols == 0 ? 0 : ld * (cols - 1) + rows; }

// ---- attention (cuDNN SDPA) ------------------------------------------------------------------

/// Dims and strides (B, heads, S, head_dim) of Q, K, V inside the GPT's fused qkv tensor
/// (rows b*s + t, each row [q | k | v] of h = heads * head_dim, head a at a*head_dim), of the
/// (b*s, h) output, and of the (B, heads, S, 1) fp32 log-sum-exp statistics, which is the CPU
/// model's lse layout (b, a, s).
struct SdpaLayout {
  long long dims[4] = {};
  long long qkv_strides[4] = {};
  long long q_offset = 0, k_offset = 0, v_offset = 0;  ///< elements from the qkv base
  long long out_strides[4] = {};
  long long stats_dims[4] = {};
  long long stats_strides[4] = {};
};

constexpr SdpaLayout sdpa_layout(long long batch, long long heads, long long seq, long long head_dim) {
  if (batch < 1 || heads < 1 || seq < 1 || head_dim < 1) throw shape_error("cuda::sdpa_layout: batch, heads, seq and head_dim must be >= 1");
  if (head_dim % 8 != 0 || head_dim > 256)
    throw shape_error("cuda::sdpa_layout: head_dim = " + pipeoffload::detail::num(head_dim) + " must be a multiple of 8 in [8, 256] (cuDNN's fused attention)");
  const long long h = heads * head_dim;
  SdpaLayout l;
  const long long dims[4] = {batch, heads, seq, head_dim};
  const long long qkv[4] = {seq * 3 * h, head_dim, 3 * h, 1};
  const long long out[4] = {seq * h, head_dim, h, 1};
  const long long sd[4] = {batch, heads, seq, 1};
  const long long ss[4] = {heads * seq, seq, 1, 1};
  for (int i = 0; i < 4; ++i) {
    l.dims[i] = dims[i];
    l.qkv_strides[i] = qkv[i];
    l.out_strides[i] = out[i];
    l.stats_dims[i] = sd[i];
    l.stats_strides[i] = ss[i];
  }
  l.q_offset = 0;
  l.k_offset = h;
  l.v_offset = 2 * h;
  return l;
}

// ---- the GPT stage's buffers (backend/cuda/gpt.hpp) --------------------------------------------
//
// cuda::GptStage keeps its activations in bf16 and its parameters in fp32 with the CPU model's
// layout (model/gpt.hpp). Every offset it uses into its parameters, its saved activations, its
// stash and its own workspace comes from these functions, which tests/cuda/test_host.cpp checks
// against model::GptStage on the CPU: the same parameter groups and tensor offsets, saved bytes
// per block of 20 b s h with selective recompute and 34 b s h without (DESIGN.md section 1),
// and regions that are aligned and never overlap.

/// A byte range of a buffer.
struct Region {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  constexpr std::size_t end() const { return offset + bytes; }
  friend constexpr bool operator==(const Region&, const Region&) = default;
};

/// Every region starts at a multiple of this: cuBLASLt and cuDNN want 16-byte aligned
/// operands, and 256 is what cudaMalloc and backend::Cuda's arena hand out, so a region of a
/// buffer from either is aligned.
inline constexpr std::size_t region_alignment = 256;

constexpr std::size_t align_up(std::size_t n, std::size_t a = region_alignment) { return (n + a - 1) / a * a; }

/// Lays regions out one after another, each starting aligned.
struct RegionCarver {
  std::size_t top = 0;
  constexpr Region take(std::size_t bytes) {
    top = align_up(top);
    const Region r{top, bytes};
    top += bytes;
    return r;
  }
  constexpr std::size_t total() const { return align_up(top); }
};

/// What the layouts of one GPT stage depend on: model::GptConfig's sizes and the stage's place.
struct GptDims {
  long long vocab = 0;      ///< V
  long long hidden = 0;     ///< h
  long long heads = 0;      ///< a (h % a == 0)
  long long positions = 0;  ///< rows of the position table (GptConfig::seq)
  int first_block = 0;      ///< this stage holds model blocks [first_block, first_block + blocks)
  int blocks = 0;
  bool embeds = false;      ///< stage 0: token and position embedding
  bool has_head = false;    ///< last stage: final LayerNorm, LM head, cross-entropy
  bool recompute = true;    ///< selective recompute of LayerNorm, GeLU and dropout masks
};

/// The blocks of stage `stage` of `stages` in a model of `layers` blocks, spread as evenly as
/// possible: model::GptStage's split.
struct BlockRange {
  int first = 0;
  int count = 0;
  friend constexpr bool operator==(const BlockRange&, const BlockRange&) = default;
};
constexpr BlockRange gpt_blocks_of_stage(int layers, int stage, int stages) {
  if (layers < 1 || stages < 1 || stage < 0 || stage >= stages)
    throw shape_error("cuda::gpt_blocks_of_stage: layers = " + pipeoffload::detail::num(layers) + ", stage = " + pipeoffload::detail::num(stage) +
                      ", stages = " + pipeoffload::detail::num(stages) + " (need layers >= 1 and 0 <= stage < stages)");
  const int first = static_cast<int>(static_cast<long long>(layers) * stage / stages);
  return {first, static_cast<int>(static_cast<long long>(layers) * (stage + 1) / stages) - first};
}

/// Element offsets of one block's parameters inside its group, model::GptStage's order:
/// ln1 gamma, beta (h) | Wqkv (h, 3h) | bqkv (3h) | Wo (h, h) | bo (h) | ln2 gamma, beta (h) |
/// Wfc (h, 4h) | bfc (4h) | Wpr (4h, h) | bpr (h). Matrices are (in, out) row-major.
struct GptBlockParams {
  long long ln1g = 0, ln1b = 0, wqkv = 0, bqkv = 0, wo = 0, bo = 0, ln2g = 0, ln2b = 0, wfc = 0, bfc = 0, wpr = 0, bpr = 0;
  long long count = 0;  ///< elements of the group: 12 h^2 + 13 h
};
constexpr GptBlockParams gpt_block_params(long long h) {
  GptBlockParams b;
  long long at = 0;
  const auto take = [&at](long long n) {
    const long long o = at;
    at += n;
    return o;
  };
  b.ln1g = take(h);
  b.ln1b = take(h);
  b.wqkv = take(3 * h * h);
  b.bqkv = take(3 * h);
  b.wo = take(h * h);
  b.bo = take(h);
  b.ln2g = take(h);
  b.ln2b = take(h);
  b.wfc = take(4 * h * h);
  b.bfc = take(4 * h);
  b.wpr = take(4 * h * h);
  b.bpr = take(h);
  b.count = at;
  return b;
}

/// A stage's parameter vector (fp32): embedding group (wte (V, h) | wpe (positions, h)) on
/// stage 0, one group per block, head group (lnf gamma, beta (h) | W (h, V) | b (V)) on the
/// last stage; offsets in elements.
struct GptStageParams {
  long long embed = 0;         ///< elements of the embedding group (0 unless dims.embeds)
  long long wpe = 0;           ///< offset of the position table
  long long blocks_begin = 0;  ///< offset of block 0's group (= embed)
  GptBlockParams block{};      ///< offsets inside every block's group
  long long head_begin = 0;    ///< offset of the head group
  long long head = 0;          ///< elements of the head group (0 unless dims.has_head)
  long long lnfg = 0, lnfb = 0, head_w = 0, head_b = 0;  ///< offsets inside the head group
  long long total = 0;
  constexpr long long block_begin(int i) const { return blocks_begin + i * block.count; }
};
constexpr GptStageParams gpt_stage_params(const GptDims& d) {
  GptStageParams p;
  const long long h = d.hidden, V = d.vocab;
  p.embed = d.embeds ? (V + d.positions) * h : 0;
  p.wpe = V * h;
  p.blocks_begin = p.embed;
  p.block = gpt_block_params(h);
  p.head_begin = p.blocks_begin + d.blocks * p.block.count;
  p.head = d.has_head ? 2 * h + h * V + V : 0;
  p.lnfg = 0;
  p.lnfb = h;
  p.head_w = 2 * h;
  p.head_b = 2 * h + h * V;
  p.total = p.head_begin + p.head;
  return p;
}

/// model::GptStage::norm_groups(): one group per embedding, block and head, in model order.
inline std::vector<std::size_t> gpt_norm_groups(const GptDims& d) {
  const GptStageParams p = gpt_stage_params(d);
  std::vector<std::size_t> g;
  if (d.embeds) g.push_back(static_cast<std::size_t>(p.embed));
  for (int i = 0; i < d.blocks; ++i) g.push_back(static_cast<std::size_t>(p.block.count));
  if (d.has_head) g.push_back(static_cast<std::size_t>(p.head));
  return g;
}

/// model::GptStage::parameter_info(): the named tensors of the stage's parameter vector, with
/// the offsets of gpt_stage_params (so a CPU test that compares the two lists checks those
/// offsets against the CPU model's). GPT-2's names; weights stored (in, out).
inline std::vector<ParamInfo> gpt_parameter_info(const GptDims& d) {
  const GptStageParams p = gpt_stage_params(d);
  const long long h = d.hidden, V = d.vocab;
  std::vector<ParamInfo> t;
  const auto add = [&t](std::string name, long long offset, std::vector<long long> shape) {
    t.push_back(ParamInfo{std::move(name), static_cast<std::size_t>(offset), std::move(shape)});
  };
  if (d.embeds) {
    add("wte", 0, {V, h});
    add("wpe", p.wpe, {d.positions, h});
  }
  const GptBlockParams& o = p.block;
  for (int i = 0; i < d.blocks; ++i) {
    const std::string b = "blocks." + std::to_string(d.first_block + i) + ".";
    const long long at = p.block_begin(i);
    add(b + "ln1.weight", at + o.ln1g, {h});
    add(b + "ln1.bias", at + o.ln1b, {h});
    add(b + "attn.qkv.weight", at + o.wqkv, {h, 3 * h});
    add(b + "attn.qkv.bias", at + o.bqkv, {3 * h});
    add(b + "attn.proj.weight", at + o.wo, {h, h});
    add(b + "attn.proj.bias", at + o.bo, {h});
    add(b + "ln2.weight", at + o.ln2g, {h});
    add(b + "ln2.bias", at + o.ln2b, {h});
    add(b + "mlp.fc.weight", at + o.wfc, {h, 4 * h});
    add(b + "mlp.fc.bias", at + o.bfc, {4 * h});
    add(b + "mlp.proj.weight", at + o.wpr, {4 * h, h});
    add(b + "mlp.proj.bias", at + o.bpr, {h});
  }
  if (d.has_head) {
    add("lnf.weight", p.head_begin + p.lnfg, {h});
    add("lnf.bias", p.head_begin + p.lnfb, {h});
    add("lm_head.weight", p.head_begin + p.head_w, {h, V});
    add("lm_head.bias", p.head_begin + p.head_b, {V});
  }
  return t;
}

/// model::GptStage::inputs(): stage 0 reads the token ids, the last stage the next-token
/// targets, int32, one per token of the microbatch.
inline std::vector<InputSpec> gpt_inputs(const GptDims& d, MicrobatchShape sh) {
  const std::size_t tokens = static_cast<std::size_t>(sh.tokens());
  std::vector<InputSpec> in;
  if (d.embeds) in.push_back({"tokens", DType::int32, tokens});
  if (d.has_head) in.push_back({"targets", DType::int32, tokens});
  return in;
}

/// One block's slice of the saved buffer for a microbatch of T = b*s tokens:
///   bf16  x (T, h) | qkv (T, 3h) | att (T, h) | x1 (T, h) | f (T, 4h)      20 T h bytes
///   fp32  stats (T, 4): LN1 (mean, rstd) per row, then LN2's | lse (b, a, s) (16 + 4a) T bytes
///   recompute off, also bf16 a1 (T, h) | a2 (T, h) | g (T, 4h) and the two dropout masks as
///   bytes m1, m2 (T, h): 14 T h more, 34 T h in all.
/// x is the block's input, x1 the residual stream after attention, f the MLP pre-activation,
/// a1/a2 the LayerNorm outputs and g = GeLU(f) (recomputed in W when not saved).
struct GptBlockSaved {
  Region x, qkv, att, x1, f, stats, lse, a1, a2, g, m1, m2;
  std::size_t bytes = 0;         ///< the slice: a multiple of region_alignment
  std::size_t tensor_bytes = 0;  ///< what the paper's 20bsh / 34bsh counts
  std::size_t extra_bytes = 0;   ///< the per-row fp32 statistics
};

/// The head's slice: bf16 x (T, h) | fp32 LN stats (T, 2) | bf16 dlogits (T, V) (the loss
/// gradient, computed in F with the loss).
struct GptHeadSaved {
  Region x, stats, dlogits;
  std::size_t bytes = 0;
};

/// One block's stash (what B leaves for W), bf16, the gradients of each GEMM's output and of
/// each LayerNorm's output: dP2 (T, h) | dF (T, 4h) | dA2 (T, h) | dO1 (T, h) | dQKV (T, 3h) |
/// dA1 (T, h), 22 T h bytes.
struct GptBlockStash {
  Region dP2, dF, dA2, dO1, dQKV, dA1;
  std::size_t bytes = 0;
};

/// A stage's saved buffer (blocks in order, then the head) and stash (the embedding's output
/// gradient (T, h) bf16, blocks in order, the head LayerNorm's output gradient (T, h) bf16).
struct GptStageBuffers {
  GptBlockSaved block{};
  GptHeadSaved head{};
  std::size_t head_saved = 0;  ///< offset of the head's slice in saved
  std::size_t saved_bytes = 0;
  GptBlockStash block_stash{};
  Region stash_embed;          ///< bytes 0 unless the stage embeds
  std::size_t stash_blocks = 0;
  Region stash_head;           ///< bytes 0 unless the stage has the head
  std::size_t stash_bytes = 0;
  constexpr std::size_t block_saved(int i) const { return static_cast<std::size_t>(i) * block.bytes; }
  constexpr std::size_t block_stashed(int i) const { return stash_blocks + static_cast<std::size_t>(i) * block_stash.bytes; }
};

namespace detail {
constexpr void check_gpt(const GptDims& d, long long tokens, const char* who) {
  if (tokens < 1 || d.hidden < 1 || d.heads < 1 || d.hidden % d.heads != 0 || d.vocab < 1 || d.blocks < 0)
    throw shape_error(std::string(who) + ": tokens = " + pipeoffload::detail::num(tokens) + ", hidden = " + pipeoffload::detail::num(d.hidden) +
                      ", heads = " + pipeoffload::detail::num(d.heads) + ", vocab = " + pipeoffload::detail::num(d.vocab) +
                      " (need tokens, hidden, heads, vocab >= 1 and heads dividing hidden)");
}
}  // namespace detail

constexpr GptBlockSaved gpt_block_saved(const GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "cuda::gpt_block_saved");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden), a = static_cast<std::size_t>(d.heads);
  const std::size_t bf = 2, f32 = 4;
  GptBlockSaved s;
  RegionCarver c;
  s.x = c.take(T * h * bf);
  s.qkv = c.take(3 * T * h * bf);
  s.att = c.take(T * h * bf);
  s.x1 = c.take(T * h * bf);
  s.f = c.take(4 * T * h * bf);
  s.stats = c.take(4 * T * f32);
  s.lse = c.take(T * a * f32);
  if (!d.recompute) {
    s.a1 = c.take(T * h * bf);
    s.a2 = c.take(T * h * bf);
    s.g = c.take(4 * T * h * bf);
    s.m1 = c.take(T * h);
    s.m2 = c.take(T * h);
  }
  s.bytes = c.total();
  s.tensor_bytes = s.x.bytes + s.qkv.bytes + s.att.bytes + s.x1.bytes + s.f.bytes + s.a1.bytes + s.a2.bytes + s.g.bytes + s.m1.bytes + s.m2.bytes;
  s.extra_bytes = s.stats.bytes + s.lse.bytes;
  return s;
}

constexpr GptStageBuffers gpt_stage_buffers(const GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "cuda::gpt_stage_buffers");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden), V = static_cast<std::size_t>(d.vocab);
  GptStageBuffers b;
  b.block = gpt_block_saved(d, tokens);
  b.head_saved = static_cast<std::size_t>(d.blocks) * b.block.bytes;
  if (d.has_head) {
    RegionCarver c;
    b.head.x = c.take(T * h * 2);
    b.head.stats = c.take(2 * T * 4);
    b.head.dlogits = c.take(T * V * 2);
    b.head.bytes = c.total();
  }
  b.saved_bytes = b.head_saved + b.head.bytes;
  RegionCarver bs;
  b.block_stash.dP2 = bs.take(T * h * 2);
  b.block_stash.dF = bs.take(4 * T * h * 2);
  b.block_stash.dA2 = bs.take(T * h * 2);
  b.block_stash.dO1 = bs.take(T * h * 2);
  b.block_stash.dQKV = bs.take(3 * T * h * 2);
  b.block_stash.dA1 = bs.take(T * h * 2);
  b.block_stash.bytes = bs.total();
  RegionCarver st;
  b.stash_embed = st.take(d.embeds ? T * h * 2 : 0);
  b.stash_blocks = st.total();
  st.top = b.stash_blocks + static_cast<std::size_t>(d.blocks) * b.block_stash.bytes;
  b.stash_head = st.take(d.has_head ? T * h * 2 : 0);
  b.stash_bytes = st.total();
  return b;
}

/// The stage's own workspace, allocated once for its largest microbatch; no region lives from
/// one pass to the next (the runtime may run other stages' and microbatches' passes between):
///   bf16 ln (T, h): a LayerNorm output (F; W's recompute) | proj (T, h): an attention or MLP
///   projection output (F), the attention output's gradient (B) | gelu (T, 4h): GeLU output
///   (F and W with recompute) | io (T, h): the stage's bf16 output before to_float (F), the
///   gradient flowing down (B) | fp32 logits (T, V) and per-row losses (T) on the last stage.
struct GptWorkspace {
  Region ln, proj, gelu, io, logits, losses;
  std::size_t bytes = 0;
};
constexpr GptWorkspace gpt_workspace(const GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "cuda::gpt_workspace");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden), V = static_cast<std::size_t>(d.vocab);
  GptWorkspace w;
  RegionCarver c;
  w.ln = c.take(T * h * 2);
  w.proj = c.take(T * h * 2);
  w.gelu = c.take(d.recompute ? 4 * T * h * 2 : 0);
  w.io = c.take(T * h * 2);
  w.logits = c.take(d.has_head ? T * V * 4 : 0);
  w.losses = c.take(d.has_head ? T * 4 : 0);
  w.bytes = c.total();
  return w;
}

}  // namespace pipeoffload::cuda
