// tests/cuda/test_host.cpp: the CPU side of the CUDA backend. Runs on every machine,
// with or without the toolkit: the shared math the kernels call, every launch shape and GEMM
// layout the backend computes, the PCIe pairing decision and the NCCL id-file protocol.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda_layout.hpp>
#include <models/gpt/layout.hpp>
#include <models/llama/cuda_layout.hpp>
#include <pipeoffload/backend/cpu/cpu.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>
#include <pipeoffload/backend/cuda/topology.hpp>
#include <pipeoffload/comm/nccl/id_file.hpp>
#include <pipeoffload/ops/math.hpp>

namespace po = pipeoffload;
namespace pc = pipeoffload::cuda;
namespace pm = pipeoffload::gpt;
namespace ops = pipeoffload::ops;

namespace {

std::vector<float> random_vector(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Row-major reference: C = alpha op(A) op(B) + beta C, the CPU GEMM's convention.
void gemm_row_major(const pc::RowMajorGemm& g, const float* A, const float* B, float* C) {
  for (long long i = 0; i < g.M; ++i)
    for (long long j = 0; j < g.N; ++j) {
      double s = 0;
      for (long long p = 0; p < g.K; ++p) {
        const float a = g.ta == pc::Op::n ? A[i * g.lda + p] : A[p * g.lda + i];
        const float b = g.tb == pc::Op::n ? B[p * g.ldb + j] : B[j * g.ldb + p];
        s += static_cast<double>(a) * b;
      }
      C[i * g.ldc + j] = static_cast<float>(g.alpha * s + g.beta * C[i * g.ldc + j]);
    }
}

// Column-major reference with cuBLAS semantics: C(m x n) = alpha op(A) op(B) + beta C, element
// (r, c) of a matrix with leading dimension ld at r + c * ld.
void gemm_col_major(const pc::ColMajorGemm& g, const float* A, const float* B, float* C) {
  for (long long i = 0; i < g.m; ++i)
    for (long long j = 0; j < g.n; ++j) {
      double s = 0;
      for (long long p = 0; p < g.k; ++p) {
        const float a = g.transa == pc::Op::n ? A[i + p * g.lda] : A[p + i * g.lda];
        const float b = g.transb == pc::Op::n ? B[p + j * g.ldb] : B[j + p * g.ldb];
        s += static_cast<double>(a) * b;
      }
      C[i + j * g.ldc] = static_cast<float>(g.alpha * s + g.beta * C[i + j * g.ldc]);
    }
}

}  // namespace

// ---- shared math -------------------------------------------------------------------------

TEST_CASE("row_stats_finish gives row_stats's statistics from the two sums a block reduction computes") {
  for (int n : {1, 7, 64, 1000}) {
    const std::vector<float> x = random_vector(static_cast<std::size_t>(n), static_cast<unsigned>(n), 3.0f);
    const ops::RowStats ref = ops::row_stats(x.data(), n);
    float s = 0;
    for (float v : x) s += v;
    const float mean = s / static_cast<float>(n);
    float ssd = 0;
    for (float v : x) ssd += (v - mean) * (v - mean);
    const ops::RowStats got = ops::row_stats_finish(mean, ssd, n);
    CHECK(got.mean == ref.mean);  // same sums in the same order: the same bits
    CHECK(got.rstd == ref.rstd);
  }
}

TEST_CASE("layernorm_backward_elem reproduces layernorm_backward_row element by element") {
  const int n = 96;
  const std::vector<float> x = random_vector(n, 1), dy = random_vector(n, 2), gamma = random_vector(n, 3);
  const ops::RowStats st = ops::row_stats(x.data(), n);
  std::vector<float> ref(n);
  ops::layernorm_backward_row(dy.data(), x.data(), st, gamma.data(), ref.data(), n);
  float sg = 0, sgx = 0;
  for (int i = 0; i < n; ++i) {
    const float g = dy[i] * gamma[i];
    sg += g;
    sgx += g * (x[i] - st.mean) * st.rstd;
  }
  for (int i = 0; i < n; ++i)
    CHECK(ops::layernorm_backward_elem(dy[i], x[i], st, gamma[i], sg / n, sgx / n) == ref[static_cast<std::size_t>(i)]);
}

TEST_CASE("softmax_xent_grad reproduces softmax_xent_row's gradient from the row's log-sum-exp") {
  const int n = 50, target = 17;
  const std::vector<float> logits = random_vector(n, 4, 2.0f);
  std::vector<float> ref(n);
  const float loss = ops::softmax_xent_row(logits.data(), n, target, 0.25f, ref.data());
  const float lse = loss + logits[target];
  for (int i = 0; i < n; ++i)
    CHECK(ops::softmax_xent_grad(logits[i], lse, i == target, 0.25f) == doctest::Approx(ref[i]).epsilon(1e-5));
}

TEST_CASE("residual_dropout keeps about 1-p of the branch, scaled by 1/(1-p), and regenerates the same mask") {
  const std::uint64_t seed = ops::dropout_seed(7, 3, 2, 1, 5);
  int kept = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const float y = ops::residual_dropout(1.0f, 2.0f, seed, static_cast<std::uint64_t>(i), 0.25f);
    CHECK((y == 1.0f || y == doctest::Approx(1.0f + 2.0f / 0.75f)));
    kept += y != 1.0f;
    CHECK(y == ops::residual_dropout(1.0f, 2.0f, seed, static_cast<std::uint64_t>(i), 0.25f));
  }
  CHECK(std::abs(kept / static_cast<double>(n) - 0.75) < 0.01);
  CHECK(ops::residual_dropout(1.0f, 2.0f, seed, 0, 0.0f) == 3.0f);
}

TEST_CASE("dropout_mask_scale of the saved keep decision gives dropout_scale's factor (recompute off)") {
  for (float p : {0.0f, 0.1f, 0.5f}) {
    const std::uint64_t seed = ops::dropout_seed(11, 2, 3, 1, 0);
    for (std::uint64_t i = 0; i < 10000; ++i) {
      const float k = ops::dropout_scale(seed, i, p);
      const std::uint8_t saved = k != 0.0f;  // what kernels::residual_dropout_mask and the CPU model store
      CHECK(ops::dropout_mask_scale(saved != 0, p) == k);
    }
  }
}

// ---- launch shapes -----------------------------------------------------------------------

TEST_CASE("elementwise launches cover every element once with a grid within CUDA's limits") {
  for (long long n : {0LL, 1LL, 255LL, 256LL, 257LL, 1000000LL, 2097152LL, 2097153LL, 1LL << 34}) {
    const pc::Launch l = pc::elementwise_launch(n);
    if (n == 0) {
      CHECK(l.grid == 0);
      continue;
    }
    CHECK(l.block == pc::elementwise_block);
    CHECK(l.shared == 0);
    CHECK(l.grid >= 1);
    CHECK(l.grid <= pc::max_grid);
    // A grid-stride loop visits i, i + grid*block, ...: every element iff grid*block >= 1 and
    // the grid is no larger than needed.
    CHECK(static_cast<long long>(l.grid - 1) * l.block < n);
    if (n <= static_cast<long long>(pc::max_grid) * pc::elementwise_block)
      CHECK(static_cast<long long>(l.grid) * l.block >= n);
  }
  CHECK_THROWS_AS(pc::elementwise_launch(-1), po::shape_error);
}

TEST_CASE("multi-tensor update launches cover every value of every run once, in at most segments_per_launch runs") {
  // Seeded run sizes around the tile (4096) edges, empty runs among them; the walk is the
  // kernel's: block b updates values [t * segment_tile, (t + 1) * segment_tile) of run
  // segment_of(b), t its place among that run's blocks.
  std::mt19937 rng(31);
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    const std::size_t runs = 1 + rng() % 130;
    const std::size_t sizes[] = {0, 1, 255, 4095, 4096, 4097, 8192, 12289};
    std::vector<po::update::Segment> segments(runs);
    std::vector<std::vector<int>> seen(runs);
    std::size_t nonempty = 0;
    for (std::size_t k = 0; k < runs; ++k) {
      segments[k].count = rng() % 3 == 0 ? sizes[rng() % 8] : rng() % 20000;
      segments[k].lr = static_cast<float>(k);  // names the run
      seen[k].assign(segments[k].count, 0);
      nonempty += segments[k].count > 0;
    }
    const std::vector<pc::SegmentLaunch> launches = pc::segment_launches(segments);
    CHECK(launches.size() == (nonempty + pc::segments_per_launch - 1) / pc::segments_per_launch);
    std::size_t listed = 0;
    for (const pc::SegmentLaunch& l : launches) {
      REQUIRE(l.count >= 1);
      REQUIRE(static_cast<std::size_t>(l.count) <= pc::segments_per_launch);
      listed += static_cast<std::size_t>(l.count);
      CHECK(l.launch().block == pc::elementwise_block);
      for (long long b = 0; b < static_cast<long long>(l.launch().grid); ++b) {
        const int k = pc::segment_of(l, b);
        const po::update::Segment& s = l.segments[k];
        const long long begin = (b - l.first_block[k]) * pc::segment_tile;
        const long long end = std::min(begin + pc::segment_tile, static_cast<long long>(s.count));
        REQUIRE(begin < end);  // no block without work
        for (long long i = begin; i < end; ++i) ++seen[static_cast<std::size_t>(s.lr)][static_cast<std::size_t>(i)];
      }
    }
    CHECK(listed == nonempty);
    std::size_t wrong = 0;
    for (const std::vector<int>& v : seen)
      for (int x : v) wrong += x != 1;
    CHECK(wrong == 0);
  }
}

TEST_CASE("per-row launches give one block of row_block threads per row and refuse grids CUDA cannot launch") {
  const pc::Launch l = pc::per_row_launch(4096 * 8, 4096);
  CHECK(l.grid == 4096u * 8u);
  CHECK(l.block == pc::row_block);
  CHECK(l.block % 32 == 0);
  CHECK(pc::per_row_launch(0, 5).grid == 0);
  CHECK(pc::per_row_launch(2147483647LL, 1).grid == 2147483647u);
  CHECK_THROWS_AS(pc::per_row_launch(2147483648LL, 1), po::shape_error);
  CHECK_THROWS_AS(pc::per_row_launch(1, 0), po::shape_error);
}

TEST_CASE("column-sum launches give one block of 32 columns x 32 row lanes per 32 columns") {
  CHECK(pc::column_sum_launch(0).grid == 0);
  for (long long cols : {1LL, 31LL, 32LL, 33LL, 4096LL, 16384LL, 50257LL}) {
    const pc::Launch l = pc::column_sum_launch(cols);
    CHECK(l.block == pc::column_tile * pc::column_lanes);
    CHECK(l.block <= pc::block_limit);
    CHECK(l.block % 32 == 0);
    // Every column has exactly one block (tiles cover [0, cols) and no tile is all past the end).
    CHECK(static_cast<long long>(l.grid) * pc::column_tile >= cols);
    CHECK(static_cast<long long>(l.grid - 1) * pc::column_tile < cols);
  }
  CHECK_THROWS_AS(pc::column_sum_launch(-1), po::shape_error);
}

// ---- the non-finite check -------------------------------------------------------------------

namespace {

/// What backend::Cpu::flag_nonfinite (the reference) says about one value with these bits.
template <class Word>
bool cpu_flags(Word word, po::DType t) {
  static po::backend::Cpu cpu;  // no streams: flag_nonfinite runs on the calling thread
  po::backend::CpuContext ctx = cpu.context(0);
  std::uint32_t flag = 0;
  std::uint64_t storage = 0;  // 8 bytes, whatever the type: the compiler sees every case of the CPU's switch
  std::memcpy(&storage, &word, sizeof word);
  cpu.flag_nonfinite(ctx, po::ConstTensor{reinterpret_cast<const std::byte*>(&storage), 1, t}, &flag);
  return flag != 0;
}

template <class Word>
bool cuda_flags(Word word, po::DType t) {
  const std::uint64_t mask = pc::nonfinite_mask(t);
  return mask != 0 && pc::nonfinite_word(word, static_cast<Word>(mask));
}

}  // namespace

TEST_CASE("the CUDA non-finite check tests the bits backend::Cpu tests, and flags exactly NaN and infinities") {
  std::mt19937 rng(5);
  // float32 and float64: against std::isfinite as well, over the special values and random bits.
  std::vector<std::uint32_t> w32 = {0x00000000u, 0x80000000u, 0x00000001u, 0x3f800000u, 0x7f7fffffu, 0xff7fffffu,
                                    0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u};
  std::vector<std::uint64_t> w64 = {0x0ull,
                                    0x1ull,
                                    0x3ff0000000000000ull,
                                    0x7fefffffffffffffull,
                                    0x7ff0000000000000ull,
                                    0xfff0000000000000ull,
                                    0x7ff8000000000000ull,
                                    0xfff0000000000001ull};
  for (int i = 0; i < 2000; ++i) {
    w32.push_back(static_cast<std::uint32_t>(rng()));
    w64.push_back((static_cast<std::uint64_t>(rng()) << 32) | rng());
  }
  for (std::uint32_t w : w32) {
    CAPTURE(w);
    CHECK(cuda_flags(w, po::DType::float32) == cpu_flags(w, po::DType::float32));
    CHECK(cuda_flags(w, po::DType::float32) == !std::isfinite(std::bit_cast<float>(w)));
    CHECK_FALSE(cuda_flags(w, po::DType::int32));  // integers have no non-finite values
    CHECK(cpu_flags(w, po::DType::int32) == false);
  }
  for (std::uint64_t w : w64) {
    CAPTURE(w);
    CHECK(cuda_flags(w, po::DType::float64) == cpu_flags(w, po::DType::float64));
    CHECK(cuda_flags(w, po::DType::float64) == !std::isfinite(std::bit_cast<double>(w)));
    CHECK_FALSE(cuda_flags(w, po::DType::int64));
  }
  // bfloat16 is the top half of a float32: every one of the 65536 values, both ways.
  for (std::uint32_t w = 0; w <= 0xffffu; ++w) {
    const auto h = static_cast<std::uint16_t>(w);
    CAPTURE(h);
    CHECK(cuda_flags(h, po::DType::bfloat16) == cpu_flags(h, po::DType::bfloat16));
    CHECK(cuda_flags(h, po::DType::bfloat16) == !std::isfinite(std::bit_cast<float>(w << 16)));
    CHECK(cuda_flags(h, po::DType::float16) == cpu_flags(h, po::DType::float16));
    CHECK(cuda_flags(h, po::DType::float16) == ((h & 0x7c00u) == 0x7c00u));  // IEEE half: exponent all ones
  }
  for (po::DType t : {po::DType::int32, po::DType::int64, po::DType::uint8, po::DType::int8})
    CHECK(pc::nonfinite_mask(t) == 0);
  // The kernel reads one word per value: the mask fits the value's width.
  for (po::DType t : {po::DType::float32, po::DType::float64, po::DType::bfloat16, po::DType::float16})
    CHECK((pc::nonfinite_mask(t) >> (8 * po::dtype_size(t) - 1)) == 0u);
}

// ---- GEMM layouts --------------------------------------------------------------------------

TEST_CASE("the GPT's three GEMMs are the calls models/gpt/cpu.hpp makes to the CPU GEMM") {
  // linear:    sgemm(no, no,  rows, n, k,  X lda=k, W ldb=n, beta 0, Y ldc=n)
  CHECK(pc::linear_forward(10, 3, 5) == pc::RowMajorGemm{pc::Op::n, pc::Op::n, 10, 5, 3, 3, 5, 5, 1.0f, 0.0f});
  // linear_dx: sgemm(no, yes, rows, k, n,  dY lda=n, W ldb=n, beta 0, dX ldc=k)
  CHECK(pc::linear_dgrad(10, 3, 5) == pc::RowMajorGemm{pc::Op::n, pc::Op::t, 10, 3, 5, 5, 5, 3, 1.0f, 0.0f});
  // linear_dw: sgemm(yes, no, k, n, rows,  X lda=k, dY ldb=n, beta 1, dW ldc=n)
  CHECK(pc::linear_wgrad(10, 3, 5) == pc::RowMajorGemm{pc::Op::t, pc::Op::n, 3, 5, 10, 3, 5, 5, 1.0f, 1.0f});
}

TEST_CASE("to_column_major computes the same product under cuBLAS's column-major convention") {
  std::vector<pc::RowMajorGemm> cases = {pc::linear_forward(7, 4, 6), pc::linear_dgrad(7, 4, 6),
                                         pc::linear_wgrad(7, 4, 6), pc::linear_forward(1, 1, 1),
                                         pc::linear_wgrad(33, 8, 24)};
  // Padded leading dimensions and every transpose combination.
  for (pc::Op ta : {pc::Op::n, pc::Op::t})
    for (pc::Op tb : {pc::Op::n, pc::Op::t}) {
      pc::RowMajorGemm g{ta, tb, 5, 9, 3, 0, 0, 11, 0.5f, 0.25f};
      g.lda = (ta == pc::Op::n ? g.K : g.M) + 2;
      g.ldb = (tb == pc::Op::n ? g.N : g.K) + 1;
      cases.push_back(g);
    }
  for (const pc::RowMajorGemm& g : cases) {
    const pc::ColMajorGemm c = pc::to_column_major(g);
    CHECK(c.m == g.N);
    CHECK(c.n == g.M);
    CHECK(c.k == g.K);
    CHECK(c.lda >= std::max(1LL, c.a_rows));
    CHECK(c.ldb >= std::max(1LL, c.b_rows));
    CHECK(c.ldc >= std::max(1LL, c.c_rows));
    // op(A) is m x k, op(B) is k x n in cuBLAS terms.
    CHECK((c.transa == pc::Op::n ? c.a_rows : c.a_cols) == c.m);
    CHECK((c.transa == pc::Op::n ? c.a_cols : c.a_rows) == c.k);
    CHECK((c.transb == pc::Op::n ? c.b_rows : c.b_cols) == c.k);
    CHECK((c.transb == pc::Op::n ? c.b_cols : c.b_rows) == c.n);
    const long long a_rows_stored = g.ta == pc::Op::n ? g.M : g.K, b_rows_stored = g.tb == pc::Op::n ? g.K : g.N;
    const std::vector<float> A = random_vector(static_cast<std::size_t>(a_rows_stored * g.lda), 11);
    const std::vector<float> B = random_vector(static_cast<std::size_t>(b_rows_stored * g.ldb), 12);
    std::vector<float> C1 = random_vector(static_cast<std::size_t>(g.M * g.ldc), 13), C2 = C1;
    gemm_row_major(g, A.data(), B.data(), C1.data());
    gemm_col_major(c, B.data(), A.data(), C2.data());  // cuBLAS's A is our B (c.swapped)
    CHECK(c.swapped);
    for (std::size_t i = 0; i < C1.size(); ++i) CHECK(C1[i] == C2[i]);
    CHECK(pc::stored_elements(c.a_rows, c.a_cols, c.lda) <= static_cast<long long>(B.size()));
    CHECK(pc::stored_elements(c.b_rows, c.b_cols, c.ldb) <= static_cast<long long>(A.size()));
  }
}

TEST_CASE("to_column_major refuses leading dimensions shorter than a row") {
  pc::RowMajorGemm g = pc::linear_forward(4, 8, 16);
  g.lda = 7;
  CHECK_THROWS_AS(pc::to_column_major(g), po::shape_error);
  g = pc::linear_forward(4, 8, 16);
  g.ldc = 15;
  CHECK_THROWS_AS(pc::to_column_major(g), po::shape_error);
}

TEST_CASE("sdpa_layout addresses q, k and v of the GPT's fused qkv rows and the CPU model's lse layout") {
  const long long B = 2, A = 4, S = 5, D = 16, H = A * D;
  const pc::SdpaLayout l = pc::sdpa_layout(B, A, S, D);
  // Element (b, a, s, e) of q in the CPU layout: qkv[(b*S + s) * 3H + a*D + e].
  for (long long b = 0; b < B; ++b)
    for (long long a = 0; a < A; ++a)
      for (long long s = 0; s < S; ++s)
        for (long long e = 0; e < D; ++e) {
          const long long off = b * l.q_strides[0] + a * l.q_strides[1] + s * l.q_strides[2] + e * l.q_strides[3];
          CHECK(off == b * l.kv_strides[0] + a * l.kv_strides[1] + s * l.kv_strides[2] + e * l.kv_strides[3]);
          CHECK(off + l.q_offset == (b * S + s) * 3 * H + a * D + e);
          CHECK(off + l.k_offset == (b * S + s) * 3 * H + H + a * D + e);
          CHECK(off + l.v_offset == (b * S + s) * 3 * H + 2 * H + a * D + e);
          const long long o = b * l.out_strides[0] + a * l.out_strides[1] + s * l.out_strides[2] + e * l.out_strides[3];
          CHECK(o == (b * S + s) * H + a * D + e);
        }
  for (long long b = 0; b < B; ++b)
    for (long long a = 0; a < A; ++a)
      for (long long s = 0; s < S; ++s)
        CHECK(b * l.stats_strides[0] + a * l.stats_strides[1] + s * l.stats_strides[2] == (b * A + a) * S + s);
  CHECK_THROWS_AS(pc::sdpa_layout(1, 1, 1, 12), po::shape_error);
  CHECK_THROWS_AS(pc::sdpa_layout(1, 1, 1, 264), po::shape_error);
}

TEST_CASE("sdpa_layout_separate addresses grouped-query heads of separate q, k, v rows") {
  const long long B = 2, A = 8, G = 2, S = 3, D = 16, H = A * D, K = G * D;
  const pc::SdpaLayout l = pc::sdpa_layout_separate(B, A, G, S, D);
  CHECK(l.kv_dims[1] == G);
  CHECK(l.dims[1] == A);
  for (long long b = 0; b < B; ++b)
    for (long long s = 0; s < S; ++s)
      for (long long e = 0; e < D; ++e) {
        for (long long a = 0; a < A; ++a)
          CHECK(b * l.q_strides[0] + a * l.q_strides[1] + s * l.q_strides[2] + e * l.q_strides[3] ==
                (b * S + s) * H + a * D + e);
        for (long long g = 0; g < G; ++g)
          CHECK(b * l.kv_strides[0] + g * l.kv_strides[1] + s * l.kv_strides[2] + e * l.kv_strides[3] ==
                (b * S + s) * K + g * D + e);
      }
  CHECK(l.q_offset == 0);
  CHECK(l.k_offset == 0);
  CHECK(l.v_offset == 0);
  CHECK_THROWS_WITH_AS((void)pc::sdpa_layout_separate(1, 6, 4, 1, 16),
                       "cuda::sdpa_layout: heads = 6 is not a multiple of kv_heads = 4", po::shape_error);
}

// ---- the GPT stage's layouts (models/gpt/layout.hpp, cuda_layout.hpp) -----------------------------------------

namespace {

po::gpt::GptConfig small_gpt(int layers, bool recompute = true) {
  po::gpt::GptConfig c;
  c.vocab = 40;
  c.hidden = 64;
  c.heads = 4;
  c.layers = layers;
  c.seq = 16;
  c.recompute = recompute;
  return c;
}

pm::GptDims dims_of(const po::gpt::GptConfig& c, int stage, int stages) {
  const pm::BlockRange r = pm::gpt_blocks_of_stage(c.layers, stage, stages);
  return {c.vocab, c.hidden, c.heads, c.seq, r.first, r.count, stage == 0, stage == stages - 1, c.recompute};
}

double std_dev(const float* p, long long n) {
  double s = 0, s2 = 0;
  for (long long i = 0; i < n; ++i) {
    s += p[i];
    s2 += static_cast<double>(p[i]) * p[i];
  }
  const double m = s / static_cast<double>(n);
  return std::sqrt(s2 / static_cast<double>(n) - m * m);
}
bool all_equal(const float* p, long long n, float v) {
  return std::all_of(p, p + n, [v](float x) { return x == v; });
}

/// The non-empty regions, each checked aligned, pairwise disjoint and inside [0, total).
void check_regions(std::vector<pc::Region> rs, std::size_t total) {
  std::erase_if(rs, [](const pc::Region& r) { return r.bytes == 0; });
  std::sort(rs.begin(), rs.end(), [](const pc::Region& a, const pc::Region& b) { return a.offset < b.offset; });
  for (std::size_t i = 0; i < rs.size(); ++i) {
    CHECK(rs[i].offset % pc::region_alignment == 0);
    CHECK(rs[i].end() <= total);
    if (i > 0) CHECK(rs[i - 1].end() <= rs[i].offset);
  }
}

}  // namespace

TEST_CASE("gpt_blocks_of_stage splits the blocks as gpt::GptStage does") {
  for (int layers = 1; layers <= 9; ++layers)
    for (int stages = 1; stages <= 7; ++stages)
      for (int s = 0; s < stages; ++s) {
        const po::gpt::GptStage cpu(small_gpt(layers), s, stages);
        const pm::BlockRange r = pm::gpt_blocks_of_stage(layers, s, stages);
        CHECK(r.first == cpu.first_block());
        CHECK(r.count == cpu.blocks());
      }
  CHECK_THROWS_AS(pm::gpt_blocks_of_stage(4, 4, 4), po::shape_error);
}

TEST_CASE("gpt_stage_params addresses every tensor of gpt::GptStage's parameter vector") {
  // The CPU model initialises LayerNorm gains to 1, biases and LayerNorm shifts to 0, the
  // embedding with std 0.02 (positions 0.01), Wqkv, Wfc and the head with 0.02 and the two
  // residual projections Wo, Wpr with 0.02 / sqrt(2 layers): each offset must land on its tensor.
  const int layers = 4, stages = 2;
  for (int s = 0; s < stages; ++s) {
    const po::gpt::GptConfig c = small_gpt(layers);
    po::gpt::GptStage cpu(c, s, stages);
    const pm::GptDims d = dims_of(c, s, stages);
    const pm::GptStageParams L = pm::gpt_stage_params(d);
    CHECK(pm::gpt_norm_groups(d) == cpu.norm_groups());
    REQUIRE(L.total == static_cast<long long>(cpu.parameters().size()));
    const float* p = cpu.parameters().data();
    const long long h = c.hidden, V = c.vocab;
    const double w = 0.02, res = 0.02 / std::sqrt(2.0 * layers),
                 tol = 0.1;  // relative error of a sample std over >= 4096 values
    if (d.embeds) {
      CHECK(std_dev(p, V * h) == doctest::Approx(w).epsilon(tol));
      CHECK(std_dev(p + L.wpe, c.seq * h) == doctest::Approx(0.01).epsilon(tol));
    }
    for (int i = 0; i < d.blocks; ++i) {
      const float* b = p + L.block_begin(i);
      const pm::GptBlockParams& o = L.block;
      CHECK(all_equal(b + o.ln1g, h, 1.0f));
      CHECK(all_equal(b + o.ln1b, h, 0.0f));
      CHECK(all_equal(b + o.bqkv, 3 * h, 0.0f));
      CHECK(all_equal(b + o.bo, h, 0.0f));
      CHECK(all_equal(b + o.ln2g, h, 1.0f));
      CHECK(all_equal(b + o.ln2b, h, 0.0f));
      CHECK(all_equal(b + o.bfc, 4 * h, 0.0f));
      CHECK(all_equal(b + o.bpr, h, 0.0f));
      CHECK(std_dev(b + o.wqkv, 3 * h * h) == doctest::Approx(w).epsilon(tol));
      CHECK(std_dev(b + o.wo, h * h) == doctest::Approx(res).epsilon(tol));
      CHECK(std_dev(b + o.wfc, 4 * h * h) == doctest::Approx(w).epsilon(tol));
      CHECK(std_dev(b + o.wpr, 4 * h * h) == doctest::Approx(res).epsilon(tol));
      CHECK(o.count == 12 * h * h + 13 * h);
    }
    if (d.has_head) {
      const float* hp = p + L.head_begin;
      CHECK(all_equal(hp + L.lnfg, h, 1.0f));
      CHECK(all_equal(hp + L.lnfb, h, 0.0f));
      CHECK(std_dev(hp + L.head_w, h * V) == doctest::Approx(w).epsilon(tol));
      CHECK(all_equal(hp + L.head_b, V, 0.0f));
      CHECK(L.head_b + V == L.head);
    }
  }
}

TEST_CASE(
    "gpt::CudaGptStage's parameter_info() and inputs() are gpt::GptStage's: the same names, offsets, shapes and inputs") {
  for (bool recompute : {true, false})
    for (int layers : {1, 2, 5})
      for (int stages : {1, 2, 3})
        for (int s = 0; s < stages; ++s) {
          CAPTURE(layers);
          CAPTURE(stages);
          CAPTURE(s);
          const po::gpt::GptConfig c = small_gpt(layers, recompute);
          const po::gpt::GptStage cpu(c, s, stages);
          const pm::GptDims d = dims_of(c, s, stages);
          const std::vector<po::ParamInfo> want = cpu.parameter_info(), got = pm::gpt_parameter_info(d);
          REQUIRE(got.size() == want.size());
          for (std::size_t i = 0; i < got.size(); ++i) {
            CAPTURE(want[i].name);
            CHECK(got[i].name == want[i].name);
            CHECK(got[i].offset == want[i].offset);
            CHECK(got[i].shape == want[i].shape);
          }
          // They tile the parameter vector (gpt_stage_params' total) without gaps.
          std::size_t end = 0;
          for (const po::ParamInfo& t : got) {
            CHECK(t.offset == end);
            end = t.offset + t.count();
          }
          CHECK(static_cast<long long>(end) == pm::gpt_stage_params(d).total);
          for (const po::MicrobatchShape sh :
               {po::MicrobatchShape{1, 1}, po::MicrobatchShape{2, 16}, po::MicrobatchShape{3, 7}}) {
            const std::vector<po::InputSpec> wi = cpu.inputs(sh), gi = pm::gpt_inputs(d, sh);
            REQUIRE(gi.size() == wi.size());
            for (std::size_t i = 0; i < gi.size(); ++i) {
              CHECK(gi[i].name == wi[i].name);
              CHECK(gi[i].dtype == wi[i].dtype);
              CHECK(gi[i].elements == wi[i].elements);
            }
          }
        }
}

TEST_CASE("the CUDA GPT block saves 20bsh bytes with selective recompute and 34bsh without, plus fp32 statistics") {
  for (bool recompute : {true, false})
    for (long long heads : {1LL, 4LL, 32LL})
      for (long long T : {1LL, 7LL, 4096LL})
        for (long long h : {256LL, 4096LL}) {
          CAPTURE(recompute);
          CAPTURE(T);
          CAPTURE(h);
          const pm::GptDims d{50257, h, heads, 4096, 0, 1, false, false, recompute};
          const pm::GptBlockSaved s = pm::gpt_block_saved(d, T);
          const std::size_t Th = static_cast<std::size_t>(T * h);
          CHECK(s.tensor_bytes == (recompute ? 20 : 34) * Th);
          CHECK(s.extra_bytes ==
                static_cast<std::size_t>((16 + 4 * heads) * T));  // LN (mean, rstd) x 2, one lse per head
          CHECK(s.bytes % pc::region_alignment == 0);
          CHECK(s.bytes >= s.tensor_bytes + s.extra_bytes);
          CHECK(s.bytes < s.tensor_bytes + s.extra_bytes + 12 * pc::region_alignment);  // only alignment padding
          check_regions({s.x, s.qkv, s.att, s.x1, s.f, s.stats, s.lse, s.a1, s.a2, s.g, s.m1, s.m2}, s.bytes);
        }
  // The same tensors as the CPU model's fp32 accounting, at half the bytes (masks are bytes on both).
  for (bool recompute : {true, false}) {
    const po::gpt::GptConfig c = small_gpt(3, recompute);
    const po::gpt::GptStage cpu(c, 1, 3);
    const po::MicrobatchShape sh{2, 16};
    const auto b = cpu.block_breakdown(sh);
    const pm::GptBlockSaved s = pm::gpt_block_saved(dims_of(c, 1, 3), sh.tokens());
    CHECK(s.tensor_bytes == 2 * b.tensor_floats + b.mask_bytes);
    CHECK(s.extra_bytes == 4 * b.extra_floats);
  }
}

TEST_CASE("the CUDA GPT stage's saved, stash and scratch regions are aligned, disjoint and inside their buffers") {
  for (bool recompute : {true, false})
    for (int layers : {1, 2, 5})
      for (int stages : {1, 3})
        for (int s = 0; s < stages; ++s)
          for (long long T : {1LL, 33LL, 512LL}) {
            CAPTURE(recompute);
            CAPTURE(layers);
            CAPTURE(stages);
            CAPTURE(s);
            CAPTURE(T);
            const pm::GptDims d = dims_of(small_gpt(layers, recompute), s, stages);
            const pm::GptStageBuffers b = pm::gpt_stage_buffers(d, T);
            std::vector<pc::Region> saved, stash;
            for (int i = 0; i < d.blocks; ++i) {
              const std::size_t o = b.block_saved(i);
              for (pc::Region r : {b.block.x, b.block.qkv, b.block.att, b.block.x1, b.block.f, b.block.stats,
                                   b.block.lse, b.block.a1, b.block.a2, b.block.g, b.block.m1, b.block.m2})
                saved.push_back({o + r.offset, r.bytes});
              const std::size_t t = b.block_stashed(i);
              for (pc::Region r : {b.block_stash.dP2, b.block_stash.dF, b.block_stash.dA2, b.block_stash.dO1,
                                   b.block_stash.dQKV, b.block_stash.dA1})
                stash.push_back({t + r.offset, r.bytes});
            }
            for (pc::Region r : {b.head.x, b.head.stats, b.head.dlogits})
              saved.push_back({b.head_saved + r.offset, r.bytes});
            stash.push_back(b.stash_embed);
            stash.push_back(b.stash_head);
            check_regions(saved, b.saved_bytes);
            check_regions(stash, b.stash_bytes);
            const std::size_t Th = static_cast<std::size_t>(T * d.hidden);
            CHECK(b.block_stash.dQKV.bytes == 3 * Th * 2);
            CHECK((b.stash_embed.bytes > 0) == d.embeds);
            CHECK((b.stash_head.bytes > 0) == d.has_head);
            CHECK((b.head.bytes > 0) == d.has_head);
            CHECK(b.saved_bytes == static_cast<std::size_t>(d.blocks) * b.block.bytes + b.head.bytes);
            if (d.has_head) CHECK(b.head.dlogits.bytes == static_cast<std::size_t>(T * d.vocab * 2));
            const pm::GptWorkspace w = pm::gpt_workspace(d, T);
            check_regions({w.ln, w.proj, w.gelu, w.io, w.positions, w.documents, w.logits, w.losses}, w.bytes);
            CHECK((w.gelu.bytes > 0) == recompute);
            CHECK((w.logits.bytes > 0) == d.has_head);
            CHECK(w.positions.bytes == 0);
            CHECK(w.documents.bytes == 0);
            // Packed: the embedding's positions (T int32) and the blocks' document table.
            pm::GptDims packed = d;
            packed.packed = true;
            const pm::GptWorkspace wp = pm::gpt_workspace(packed, T);
            check_regions({wp.ln, wp.proj, wp.gelu, wp.io, wp.positions, wp.documents, wp.logits, wp.losses}, wp.bytes);
            CHECK(wp.positions.bytes == (d.embeds ? static_cast<std::size_t>(T) * 4 : 0));
            CHECK(wp.documents.bytes == (d.blocks > 0 ? pc::document_table_bytes(T) : 0));
          }
  CHECK_THROWS_AS(pm::gpt_stage_buffers(pm::GptDims{10, 64, 3, 8, 0, 1, false, false, true}, 4),
                  po::shape_error);  // 3 does not divide 64
  CHECK_THROWS_AS(pm::gpt_workspace(pm::GptDims{10, 64, 4, 8, 0, 1, false, false, true}, 0), po::shape_error);
}

TEST_CASE("the LM head's logits block: rows of 64 within 256 MiB, at least 64, at most the microbatch") {
  // The heads compute their fp32 logits a block of logits_rows rows at a time.
  CHECK(pc::logits_rows(4096, 50304) == 1280);  // GPT-2's vocabulary: 1280 x 50304 x 4 = 245.6 MiB
  CHECK(pc::logits_rows(4096, 128256) == 512);  // Llama 3's: 512 x 128256 x 4 = 250.5 MiB, not 2 GiB
  CHECK(pc::logits_rows(100, 256) == 100);      // the tests' models: the whole microbatch at once
  CHECK(pc::logits_rows(4096, 1 << 24) == 64);  // a vocabulary too wide for 64 rows in the budget: 64
  for (const long long V : {1LL, 255LL, 50257LL, 65536LL, 128256LL, 262144LL, 1LL << 22})
    for (const long long T : {1LL, 63LL, 64LL, 1000LL, 8192LL}) {
      CAPTURE(V);
      CAPTURE(T);
      const long long r = pc::logits_rows(T, V);
      CHECK(r >= 1);
      CHECK(r <= T);
      CHECK((r == T || r % 64 == 0));
      CHECK((r <= 64 || static_cast<std::size_t>(r) * static_cast<std::size_t>(V) * 4 <= pc::logits_block_bytes));
      CHECK((r == T || static_cast<std::size_t>(r + 64) * static_cast<std::size_t>(V) * 4 > pc::logits_block_bytes));
    }
  CHECK_THROWS_WITH(pc::logits_rows(0, 10), "cuda::logits_rows: tokens = 0 and vocab = 10 must both be >= 1");
  CHECK_THROWS_WITH(pc::logits_rows(10, 0), "cuda::logits_rows: tokens = 10 and vocab = 0 must both be >= 1");
}

TEST_CASE(
    "a packed call's graph document count: exact up to 8, then buckets of a quarter doubling, at most the tokens") {
  CHECK(pc::document_slots(1, 4096) == 1);
  CHECK(pc::document_slots(8, 4096) == 8);
  CHECK(pc::document_slots(9, 4096) == 10);
  CHECK(pc::document_slots(17, 4096) == 20);
  CHECK(pc::document_slots(33, 4096) == 40);
  CHECK(pc::document_slots(100, 4096) == 112);
  CHECK(pc::document_slots(9, 9) == 9);  // capped by the tokens: one document a token at most
  // Every count of a 4,096-token microbatch: its bucket holds it, within 25 % and the tokens;
  // buckets never shrink as counts grow; counts 8 to 1,000 need 29 graphs, not 993.
  std::set<int> buckets;
  int last = 0;
  for (long long c = 1; c <= 4096; ++c) {
    CAPTURE(c);
    const int b = pc::document_slots(c, 4096);
    CHECK(b >= c);
    CHECK(b <= 4096);
    CHECK(4 * static_cast<long long>(b) <= 5 * c);
    CHECK(b >= last);
    last = b;
    if (c >= 8 && c <= 1000) buckets.insert(b);
  }
  CHECK(buckets.size() == 29);
  for (const long long bad : {0LL, 4097LL})
    CHECK_THROWS_WITH(pc::document_slots(bad, 4096), ("cuda::document_slots: count = " + std::to_string(bad) +
                                                      " documents is outside the allowed range [1, tokens = 4096]")
                                                         .c_str());
}

TEST_CASE("packed attention's layout: the documents as the batch, token-major statistics, and the table's bytes") {
  const pc::SdpaLayout l = pc::ragged(pc::sdpa_layout_separate(5, 8, 2, 128, 64));
  CHECK(l.dims[0] == 5);
  CHECK(l.dims[2] == 128);
  CHECK(l.kv_dims[1] == 2);
  const long long stats[4] = {128 * 8, 1, 8, 1};  // element (doc, head, i) at its offset + i * heads + head
  for (int i = 0; i < 4; ++i) CHECK(l.stats_strides[i] == stats[i]);
  const long long q[4] = {128 * 512, 64, 512, 1};  // q's own strides: packed ragged rows of heads * head_dim
  for (int i = 0; i < 4; ++i) CHECK(l.q_strides[i] == q[i]);
  // int32 lengths, then four int64 arrays of tokens + 1, each at a multiple of 16 bytes (cuDNN
  // takes every tensor 16-byte aligned), disjoint, in order, within the table.
  CHECK(pc::document_table_bytes(3) == 16 + 4 * 4 * 8);
  CHECK(pc::document_table_bytes(4096) == 4096 * 4 + 4 * 4098 * 8);
  // A packed call's graph length: the longest document rounded up to a power of two, at least
  // 64, at most the rows' length; outside [1, seq] refused with the range.
  CHECK(pc::packed_length(1, 4096) == 64);
  CHECK(pc::packed_length(64, 4096) == 64);
  CHECK(pc::packed_length(65, 4096) == 128);
  CHECK(pc::packed_length(100, 128) == 128);
  CHECK(pc::packed_length(2049, 3000) == 3000);
  CHECK(pc::packed_length(30, 32) == 32);
  for (int longest = 1; longest <= 300; ++longest) {
    const int l = pc::packed_length(longest, 300);
    CHECK(l >= longest);
    CHECK((l == 300 || (l >= 64 && (l & (l - 1)) == 0 && (l == 64 || l / 2 < longest))));
  }
  for (const int bad : {0, 33})
    CHECK_THROWS_WITH(pc::packed_length(bad, 32), ("cuda::packed_length: the longest document has " +
                                                   std::to_string(bad) + " tokens; it must be in [1, seq = 32]")
                                                      .c_str());
  for (long long T = 1; T <= 67; ++T) {
    CAPTURE(T);
    const pc::DocumentTableLayout t = pc::document_table_layout(T);
    std::size_t end = static_cast<std::size_t>(T) * 4;  // the lengths
    for (const std::size_t at : t.offsets) {
      CHECK(at % 16 == 0);
      CHECK(at >= end);
      CHECK(at - end < 16);
      end = at + static_cast<std::size_t>(T + 1) * 8;
    }
    CHECK(t.bytes >= end);
    CHECK(t.bytes - end < 16);
    CHECK(pc::document_table_bytes(T) == t.bytes);
  }
}

TEST_CASE("the CUDA Llama stage's saved, stash and scratch regions are aligned, disjoint, inside and of their sizes") {
  for (bool tied : {false, true})
    for (int stages : {1, 3})
      for (int s = 0; s < stages; ++s)
        for (long long T : {1LL, 33LL, 512LL}) {
          CAPTURE(tied);
          CAPTURE(stages);
          CAPTURE(s);
          CAPTURE(T);
          po::llama::LlamaConfig c;
          c.vocab = 300;
          c.hidden = 96;
          c.heads = 6;
          c.kv_heads = 2;
          c.ffn = 200;
          c.layers = 4;
          c.tie_embeddings = tied;
          const po::llama::LlamaDims d = po::llama::llama_dims(c, s, stages);
          const po::llama::LlamaStageBuffers b = po::llama::llama_cuda_buffers(d, T);
          std::vector<pc::Region> saved, stash;
          std::size_t saved_tensors = 0, stash_tensors = 0;
          for (int i = 0; i < d.blocks; ++i) {
            const std::size_t o = b.block_saved(i);
            const po::llama::LlamaBlockSaved& k = b.block;
            for (pc::Region r : {k.x, k.q, k.k, k.v, k.att, k.x1, k.gate, k.up, k.rstd, k.lse}) {
              saved.push_back({o + r.offset, r.bytes});
              saved_tensors += r.bytes;
            }
            const std::size_t t = b.block_stashed(i);
            const po::llama::LlamaBlockStash& z = b.block_stash;
            for (pc::Region r : {z.dy, z.dgate, z.dup, z.da2, z.dx1, z.dq, z.dk, z.dv, z.da1}) {
              stash.push_back({t + r.offset, r.bytes});
              stash_tensors += r.bytes;
            }
          }
          for (pc::Region r : {b.head.x, b.head.rstd, b.head.dlogits})
            saved.push_back({b.head_saved + r.offset, r.bytes});
          stash.push_back(b.stash_embed);
          stash.push_back(b.stash_head);
          check_regions(saved, b.saved_bytes);
          check_regions(stash, b.stash_bytes);
          // Per block, bf16 2T(4h + 2kv + 2f) saved with fp32 4T(2 + heads), and 2T(5h + 2f + 2kv) stashed.
          const std::size_t Tz = static_cast<std::size_t>(T), h = 96, kv = 32, f = 200, heads = 6;
          CHECK(saved_tensors ==
                static_cast<std::size_t>(d.blocks) * (2 * Tz * (4 * h + 2 * kv + 2 * f) + 4 * Tz * (2 + heads)));
          CHECK(stash_tensors == static_cast<std::size_t>(d.blocks) * 2 * Tz * (5 * h + 2 * f + 2 * kv));
          CHECK((b.stash_embed.bytes > 0) == d.embeds);
          CHECK((b.head.bytes > 0) == d.has_head);
          const po::llama::LlamaWorkspace w = po::llama::llama_cuda_workspace(d, T);
          check_regions({w.a, w.tmp, w.datt, w.io, w.io2, w.positions, w.documents, w.logits, w.losses}, w.bytes);
          CHECK(w.documents.bytes == 0);
          po::llama::LlamaDims packed = d;
          packed.packed = true;  // the blocks' document table besides
          const po::llama::LlamaWorkspace wp = po::llama::llama_cuda_workspace(packed, T);
          check_regions({wp.a, wp.tmp, wp.datt, wp.io, wp.io2, wp.positions, wp.documents, wp.logits, wp.losses},
                        wp.bytes);
          CHECK(wp.documents.bytes == (d.blocks > 0 ? pc::document_table_bytes(T) : 0));
          CHECK(w.tmp.bytes == Tz * f * 2);
          CHECK((w.logits.bytes > 0) == d.has_head);
          CHECK(po::llama::llama_cuda_state_bytes(d, 64) ==
                static_cast<std::size_t>(po::llama::llama_stage_params(d).total) * 6 + 2 * 64 * 8 * 4);
        }
  CHECK_THROWS_WITH_AS(po::llama::llama_cuda_workspace(po::llama::LlamaDims{}, 0),
                       "llama::llama_cuda_workspace: tokens = 0 must be >= 1", po::shape_error);
}

// ---- topology ----------------------------------------------------------------------------

TEST_CASE("pair_devices pairs GPUs under one PCIe switch and places pairs on ranks (r, r^1)") {
  // A DGX-like box: two switches with two GPUs each, on different root ports.
  const std::vector<std::string> paths = {
      "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",  // switch A
      "/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:00.0/0000:43:00.0",  // switch B
      "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0",  // switch A
      "/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:10.0/0000:44:00.0",  // switch B
  };
  const pc::Pairing p = pc::pair_devices(paths);
  CHECK(p.pairs == 2);
  CHECK(p.stagger_pairs);
  CHECK(p.device_of_rank == std::vector<int>{0, 2, 1, 3});
  CHECK(p.partner_of_rank == std::vector<int>{1, 0, 3, 2});
}

TEST_CASE("pair_devices runs a machine without shared switches unpaired") {
  // Each GPU directly under its own root port (no switch), and one lone GPU.
  const pc::Pairing none = pc::pair_devices(
      {"/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0", "/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0"});
  CHECK(none.pairs == 0);
  CHECK_FALSE(none.stagger_pairs);
  CHECK(none.device_of_rank == std::vector<int>{0, 1});
  CHECK(none.partner_of_rank == std::vector<int>{-1, -1});
  // Two GPUs under one root port but no switch between: siblings on the root bus, not paired.
  CHECK(pc::switch_of("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0") == "");
  // Three under one switch: one pair, the third unpaired, so the schedule must not stagger.
  const pc::Pairing three =
      pc::pair_devices({"/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
                        "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:05:00.0",
                        "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:06:00.0"});
  CHECK(three.pairs == 1);
  CHECK_FALSE(three.stagger_pairs);
  CHECK(three.device_of_rank == std::vector<int>{0, 1, 2});
  CHECK(three.partner_of_rank == std::vector<int>{1, 0, -1});
  CHECK(pc::pair_devices({}).device_of_rank.empty());
}

// ---- NCCL id file --------------------------------------------------------------------------

TEST_CASE("the NCCL id file round-trips the 128 bytes and refuses stale or damaged files") {
  po::comm::NcclIdBytes id{};
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<unsigned char>(i * 37 + 5);
  const std::string text = po::comm::encode_id(id, 42);
  CHECK(po::comm::decode_id(text, 42) == id);
  CHECK_THROWS_AS(po::comm::decode_id(text, 43), po::comm_error);  // another job's id
  CHECK_THROWS_AS(po::comm::decode_id("garbage\n", 42), po::comm_error);
  CHECK_THROWS_AS(po::comm::decode_id(text.substr(0, text.size() - 10), 42), po::comm_error);  // truncated
}

TEST_CASE("publish_id is write-then-rename: a waiting rank sees no file or the whole id") {
  const auto dir = std::filesystem::temp_directory_path() / ("pipeoffload-id-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "nccl.id").string();
  po::comm::NcclIdBytes id{};
  id.fill(0xAB);
  std::thread reader_thread;
  po::comm::NcclIdBytes got{};
  std::string reader_error;
  reader_thread = std::thread([&] {
    try {
      got = po::comm::await_id(path, 7, std::chrono::milliseconds(10000), std::chrono::milliseconds(1));
    } catch (const std::exception& e) {
      reader_error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  po::comm::publish_id(path, id, 7);
  reader_thread.join();
  CHECK(reader_error.empty());
  CHECK(got == id);
  // Nothing but the published file is left behind.
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
  CHECK(files == 1);
  CHECK_THROWS_AS(po::comm::await_id((dir / "absent").string(), 7, std::chrono::milliseconds(30)), po::comm_error);
  std::filesystem::remove_all(dir);
}
