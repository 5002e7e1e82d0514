// tests/cuda/test_host_plans.cpp: the CPU side of what keeps a GPU run from hanging and makes
// its reductions repeat bit for bit (issue 15): backend::Cuda's pool reservations against
// po::reservation_plan, comm::Nccl's fixed gather pieces, the CUDA environment a launcher
// sets, the gradient norm's fixed reduction tree, the embedding gradient's ownership of table
// cells; and the CUDA GPT's model state per parameter. Runs on every machine, with or without
// the toolkit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <models/gpt/cuda_layout.hpp>
#include <models/gpt/layout.hpp>
#include <models/llama/cuda_layout.hpp>
#include <models/llama/layout.hpp>
#include <pipeoffload/backend/cuda/environment.hpp>
#include <pipeoffload/backend/cuda/gemm_key.hpp>
#include <pipeoffload/backend/cuda/pools.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>
#include <pipeoffload/comm/nccl/gather_pieces.hpp>
#include <pipeoffload/memory/state.hpp>
#include <pipeoffload/ops/math.hpp>
#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/plan/model.hpp>
#include <pipeoffload/runtime/reserve.hpp>

namespace po = pipeoffload;
namespace pc = pipeoffload::cuda;
namespace pm = pipeoffload::gpt;

namespace {

/// The bytes po::Runtime hands reservation_plan for a gpt::CudaGptStage pipeline of `cfg` on
/// shape `sh`, microbatches of `tokens` tokens (the stage's saved and stash buffers; fp32
/// boundaries of tokens x hidden between stages).
std::vector<po::StageBytes> gpt_stage_bytes(const pm::GptConfig& cfg, po::Shape sh, long long tokens) {
  std::vector<po::StageBytes> out(static_cast<std::size_t>(sh.stages()));
  const std::size_t boundary = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(cfg.hidden) * sizeof(float);
  for (int s = 0; s < sh.stages(); ++s) {
    const pm::GptStageBuffers b = pm::gpt_stage_buffers(pm::gpt_dims(cfg, s, sh.stages()), tokens);
    po::StageBytes& x = out[static_cast<std::size_t>(s)];
    x.saved = b.saved_bytes;
    x.stash = b.stash_bytes;
    x.input = s > 0 ? boundary : 0;
    x.output = s + 1 < sh.stages() ? boundary : 0;
  }
  return out;
}

po::Program po_f(po::Shape sh) {
  return po::build({po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all}, sh);
}

}  // namespace

// ---- backend::Cuda's pools ------------------------------------------------------------------

TEST_CASE("PoolBook: reservations add up per size class and create only the blocks that are missing") {
  pc::PoolBook book;
  CHECK(book.reserve(1000, 3) == 3);  // class 1024
  CHECK(book.blocks(1000) == 3);
  CHECK(book.blocks(1024) == 3);  // the same class
  CHECK(book.reserved(1000) == 3);
  book.add_block(1024);  // one made on demand before the next reservation
  CHECK(book.missing(1000, 2) == 1);
  CHECK(book.reserve(1000, 2) == 1);  // 5 reserved, 4 existed
  CHECK(book.blocks(1000) == 5);
  CHECK(book.reserve(0, 1) == 1);  // an empty request still takes a 256-byte block
  CHECK(book.blocks(256) == 1);
  CHECK(book.reserve(1000, 0) == 0);
  CHECK(book.bytes_held() == 5 * 1024 + 256);
}

TEST_CASE("require_room throws naming the arena, what is carved and what was asked") {
  CHECK_NOTHROW(pc::require_room("backend::Cuda", 4096, 1024, 3072));
  try {
    pc::require_room("backend::Cuda::reserve_device", 4096, 1024, 3073);
    FAIL("no throw");
  } catch (const po::error& e) {
    const std::string w = e.what();
    CHECK(w.find("4096 bytes is exhausted (1024 carved, 3073 more asked)") != std::string::npos);
    CHECK(w.find("arena_bytes_for") != std::string::npos);
  }
}

TEST_CASE("the CUDA backend's reservation of a GPT PO-F pipeline: every planned block is made at construction") {
  pm::GptConfig cfg;
  cfg.layers = 4;
  cfg.hidden = 64;
  cfg.heads = 4;
  cfg.seq = 64;
  for (const po::Shape sh : {po::Shape{2, 2, 4}, po::Shape{1, 4, 4}, po::Shape{4, 2, 8}}) {
    CAPTURE(sh.d);
    const po::Program prog = po_f(sh);
    const std::vector<po::StageBytes> bytes = gpt_stage_bytes(cfg, sh, 2 * 64);
    std::size_t pinned = 0;  // over the ranks
    for (int r = 0; r < sh.d; ++r) {
      CAPTURE(r);
      const po::Reservation res = po::reservation_plan(prog, r, bytes);
      // What po::Runtime takes: the region as one reserved block (allocate_state) and the bins
      // (reserve_memory), into books that start empty as a new backend::Cuda's do.
      pc::PoolBook device, host;
      const std::size_t made_device = device.reserve(res.device, 1) * pc::pool_size_class(res.device);
      std::size_t made_host = 0;
      for (const po::BlockCount& b : res.host)
        made_host += host.reserve(b.bytes, b.count) * pc::pool_size_class(b.bytes);
      const std::size_t workspace = std::size_t{256} << 20, state = 12345;
      CHECK(made_device == device.bytes_held());
      CHECK(made_host == host.bytes_held());
      CHECK(pc::arena_bytes_for(res, workspace, state) == workspace + device.bytes_held() + state);
      CHECK(pc::pinned_bytes_for(res) == host.bytes_held());
      pinned += pc::pinned_bytes_for(res);
      // The region holds the witnessed peak of units, stashes and boundary tensors, and at
      // least one unit of this rank's stages.
      const po::LoweredRank lr = po::lower(prog, r, bytes);
      CHECK(res.device >= lr.peak_total);
      CHECK(res.device % po::buffer_alignment == 0);
      CHECK(lr.peak[0] >= po::buffer_bytes(bytes[static_cast<std::size_t>(prog.shape.stage_of(r, 0))].saved));
      // A second user of the device (a second runtime) reserves its own: the books double.
      pc::PoolBook twice;
      for (int k = 0; k < 2; ++k) twice.reserve(res.device, 1);
      CHECK(twice.bytes_held() == 2 * device.bytes_held());
    }
    CHECK(pinned > 0);  // PO-F offloads (units whose gap cannot hide the round trip stay)
  }
}

// ---- comm::Nccl's host all_gather ----------------------------------------------------------

TEST_CASE("gather_pieces covers a block once, in order, in pieces no larger than the staging") {
  for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{4097},
                            std::size_t{1} << 20, (std::size_t{1} << 20) + 3})
    for (std::size_t piece : {std::size_t{1}, std::size_t{8}, std::size_t{4096}, std::size_t{1} << 21}) {
      CAPTURE(block);
      CAPTURE(piece);
      const std::vector<po::comm::GatherPiece> ps = po::comm::gather_pieces(block, piece);
      CHECK(ps.size() == (block + piece - 1) / piece);
      std::size_t at = 0;
      for (std::size_t i = 0; i < ps.size(); ++i) {
        CHECK(ps[i].offset == at);
        CHECK(ps[i].bytes >= 1);
        CHECK(ps[i].bytes <= piece);
        if (i + 1 < ps.size()) CHECK(ps[i].bytes == piece);
        at += ps[i].bytes;
      }
      CHECK(at == block);
    }
  CHECK_THROWS_AS(po::comm::gather_pieces(10, 0), po::comm_error);
}

TEST_CASE("gathering piece by piece through a fixed staging gives what one gather of the whole blocks gives") {
  // Three ranks' blocks of 1000 bytes through staging of 3 x 64 bytes: each piece is one
  // ncclAllGather into rank order, copied out to all[q * block + offset].
  const std::size_t d = 3, block = 1000, piece = 64;
  std::vector<std::vector<std::uint8_t>> mine(d, std::vector<std::uint8_t>(block));
  for (std::size_t q = 0; q < d; ++q)
    for (std::size_t i = 0; i < block; ++i) mine[q][i] = static_cast<std::uint8_t>((q * 131 + i * 7) & 0xff);
  std::vector<std::uint8_t> all(d * block), staging(d * piece);
  for (const po::comm::GatherPiece& p : po::comm::gather_pieces(block, piece)) {
    for (std::size_t q = 0; q < d; ++q) std::memcpy(staging.data() + q * p.bytes, mine[q].data() + p.offset, p.bytes);
    for (std::size_t q = 0; q < d; ++q)
      std::memcpy(all.data() + q * block + p.offset, staging.data() + q * p.bytes, p.bytes);
  }
  for (std::size_t q = 0; q < d; ++q)
    CHECK(std::equal(mine[q].begin(), mine[q].end(), all.begin() + static_cast<std::ptrdiff_t>(q * block)));
}

// ---- the CUDA environment -------------------------------------------------------------------

TEST_CASE("apply_cuda_environment sets eager module loading and 32 hardware queues, and keeps a user's values") {
  std::map<std::string, std::string> env = {{"CUDA_DEVICE_MAX_CONNECTIONS", "8"}};
  const auto get = [&](const char* n) -> const char* {
    const auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  const auto set = [&](const char* n, const char* v) { env[n] = v; };
  const std::vector<std::string> done = pc::apply_cuda_environment(get, set);
  CHECK(done == std::vector<std::string>{"CUDA_MODULE_LOADING"});
  CHECK(env["CUDA_MODULE_LOADING"] == "EAGER");
  CHECK(env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8");  // the user's
  env.erase("CUDA_DEVICE_MAX_CONNECTIONS");
  CHECK(pc::apply_cuda_environment(get, set) == std::vector<std::string>{"CUDA_DEVICE_MAX_CONNECTIONS"});
  CHECK(env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32");
  for (const pc::EnvSetting& s : pc::cuda_environment()) CHECK(!s.why.empty());
  // Every stream of a rank with two communicators, and the legacy stream, has its own queue.
  CHECK(pc::library_streams_per_device(2) + 1 <= pc::max_device_connections);
  CHECK(pc::library_streams_per_device(2) + 1 > 8);  // why the default of 8 is not enough
}

// ---- the gradient norm's fixed reduction tree ------------------------------------------------

namespace {

/// The documented formula of backend::Cuda::sum_squares, written independently of
/// sum_squares_reference: a recursive pairwise tree over 256 leaves, leaf t of block j being
/// the in-order sum of the squares x[j*4096 + t + 256*i], i = 0..15 (inside the group).
double pairwise(const std::vector<double>& leaves, std::size_t lo, std::size_t n) {
  // One level of s[t] += s[t + w] with w = n/2 folds the upper half onto the lower half; the
  // rest of the tree is the same on the n/2 folded values.
  if (n == 1) return leaves[lo];
  std::vector<double> half(n / 2);
  for (std::size_t t = 0; t < n / 2; ++t) half[t] = leaves[lo + t] + leaves[lo + t + n / 2];
  return pairwise(half, 0, n / 2);
}

double formula(const float* x, std::size_t n) {
  std::vector<double> partials;
  for (std::size_t j = 0; j * 4096 < n; ++j) {
    std::vector<double> leaves(256, 0.0);
    for (std::size_t t = 0; t < 256; ++t)
      for (std::size_t i = 0; i < 16; ++i) {
        const std::size_t at = j * 4096 + t + 256 * i;
        if (at < n) leaves[t] += static_cast<double>(x[at]) * static_cast<double>(x[at]);
      }
    partials.push_back(pairwise(leaves, 0, 256));
  }
  std::vector<double> leaves(256, 0.0);
  for (std::size_t i = 0; i < partials.size(); ++i) leaves[i % 256] += partials[i];
  return pairwise(leaves, 0, 256);
}

}  // namespace

TEST_CASE("the norm's plan gives each group whole chunks of 4096 values and its table addresses them") {
  static_assert(pc::norm_chunk == 4096 && pc::norm_block == 256);
  const std::vector<std::size_t> groups{0, 1, 4095, 4096, 4097, 0, 100000};
  const pc::NormPlan p = pc::sum_squares_plan(groups);
  CHECK(p.first_block == std::vector<long long>{0, 0, 1, 2, 3, 5, 5, 30});
  CHECK(p.blocks() == 30);
  const std::vector<long long> t = pc::norm_table(p, groups);
  REQUIRE(t.size() == 3 * groups.size() + 1);
  CHECK(std::vector<long long>(t.begin(), t.begin() + 8) == p.first_block);
  CHECK(std::vector<long long>(t.begin() + 8, t.begin() + 15) ==
        std::vector<long long>{0, 0, 1, 4096, 8192, 12289, 12289});
  CHECK(std::vector<long long>(t.begin() + 15, t.end()) == std::vector<long long>{0, 1, 4095, 4096, 4097, 0, 100000});
  // backend::Cuda::sum_squares' one device block: the table, 30 fp64 partials, 7 fp64 sums.
  CHECK(pc::norm_buffer_bytes(groups) == t.size() * 8 + 30 * 8 + 7 * 8);
  CHECK(pc::norm_buffer_bytes(std::vector<std::size_t>{}) == 8);
  CHECK(pc::norm_partials_launch(30) == pc::Launch{30, 256, 0});
  CHECK(pc::norm_groups_launch(7) == pc::Launch{7, 256, 0});
  CHECK_THROWS_AS(pc::norm_partials_launch(-1), po::shape_error);
  // Every block belongs to the last group whose first block is at or before it (what the
  // kernel's binary search finds): empty groups own none.
  for (long long b = 0; b < p.blocks(); ++b) {
    long long k = static_cast<long long>(groups.size()) - 1;
    while (p.first_block[static_cast<std::size_t>(k)] > b) --k;
    CHECK(groups[static_cast<std::size_t>(k)] > 0);
    CHECK(b < p.first_block[static_cast<std::size_t>(k) + 1]);
  }
}

TEST_CASE("sum_squares_reference follows its documented tree bit for bit, and is within fp64 rounding of the sum") {
  std::mt19937 rng(15);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<std::size_t> sizes{0, 1, 2, 255, 256, 257, 4095, 4096, 4097, 8191, 65536, 300001};
  for (int k = 0; k < 20; ++k) sizes.push_back(std::uniform_int_distribution<std::size_t>(1, 200000)(rng));
  std::vector<float> values;
  for (std::size_t n : sizes)
    for (std::size_t i = 0; i < n; ++i) values.push_back(dist(rng) * (i % 97 == 0 ? 1e3f : 1.0f));
  std::vector<double> got(sizes.size(), -1.0);
  pc::sum_squares_reference(values, sizes, got);
  std::size_t at = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    CAPTURE(sizes[k]);
    const float* x = values.data() + at;
    const double want = formula(x, sizes[k]);
    CHECK(std::memcmp(&got[k], &want, sizeof want) == 0);
    long double exact = 0;
    for (std::size_t i = 0; i < sizes[k]; ++i) exact += static_cast<long double>(x[i]) * x[i];
    CHECK(std::abs(static_cast<long double>(got[k]) - exact) <= 1e-13L * exact);
    // A group's sum depends on its values only, not on where it sits among the groups.
    std::vector<double> alone(1);
    pc::sum_squares_reference(std::span<const float>(x, sizes[k]), std::vector<std::size_t>{sizes[k]}, alone);
    CHECK(std::memcmp(&alone[0], &got[k], sizeof(double)) == 0);
    at += sizes[k];
  }
}

// ---- the embedding's gradient ---------------------------------------------------------------

TEST_CASE("every cell of the embedding table's gradient has exactly one owning thread inside the launch") {
  for (long long h : {1LL, 31LL, 32LL, 33LL, 100LL, 768LL}) {
    CAPTURE(h);
    const pc::Launch l = pc::embedding_table_grad_launch(h);
    CHECK(l.block == pc::column_tile * pc::embedding_warps);
    CHECK(l.grid == static_cast<unsigned>((h + 31) / 32 * (pc::embedding_buckets / pc::embedding_warps)));
    std::vector<int> owners(static_cast<std::size_t>(l.grid) * l.block, 0);
    const int vocab = 100;
    for (int t = 0; t < vocab; ++t)
      for (long long c = 0; c < h; ++c) {
        const pc::CellOwner o = pc::embedding_cell_owner(t, c, h);
        REQUIRE(o.block < l.grid);
        REQUIRE(o.thread < l.block);
        const pc::OwnedCells back = pc::embedding_owned(o.block, o.thread, h);
        CHECK(back.bucket == static_cast<unsigned>(t) % pc::embedding_buckets);
        CHECK(back.column == c);
        if (t < static_cast<int>(pc::embedding_buckets))
          ++owners[static_cast<std::size_t>(o.block) * l.block + o.thread];
      }
    // One bucket's worth of tokens (one token per bucket) lands on each owning thread once.
    for (int n : owners) CHECK(n <= 1);
  }
  CHECK(pc::embedding_table_grad_launch(0).grid == 0);
  CHECK(pc::embedding_table_grad_launch(4096).grid == 512);
  CHECK_THROWS_AS(pc::embedding_table_grad_launch(-1), po::shape_error);
}

TEST_CASE("the embedding gradient's threads, run in any order, give the CPU model's sums bit for bit") {
  const long long h = 40, rows = 300;
  const int vocab = 97;
  std::mt19937 rng(5);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows));
  // Mostly a few frequent tokens (long chains in one bucket), and two out of range (skipped,
  // as the kernel skips them; the CPU stage throws for them before any sum).
  for (auto& t : tokens)
    t = std::uniform_int_distribution<int>(0, 9)(rng) < 7 ? 3 : std::uniform_int_distribution<int>(0, vocab - 1)(rng);
  tokens[17] = -1;
  tokens[201] = vocab;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> grad(static_cast<std::size_t>(rows * h)), start(static_cast<std::size_t>(vocab * h));
  for (float& g : grad) g = dist(rng);
  for (float& w : start) w = dist(rng);  // gradients accumulate over microbatches
  // models/gpt/cpu.hpp's loop: rows in order, columns inside.
  std::vector<float> want = start;
  for (long long r = 0; r < rows; ++r) {
    const int t = tokens[static_cast<std::size_t>(r)];
    if (t < 0 || t >= vocab) continue;
    for (long long c = 0; c < h; ++c)
      want[static_cast<std::size_t>(t * h + c)] += grad[static_cast<std::size_t>(r * h + c)];
  }
  const pc::Launch l = pc::embedding_table_grad_launch(h);
  std::vector<std::pair<unsigned, unsigned>> threads;
  for (unsigned b = 0; b < l.grid; ++b)
    for (unsigned t = 0; t < l.block; ++t) threads.push_back({b, t});
  const auto read = [&](long long i) { return grad[static_cast<std::size_t>(i)]; };
  for (int order = 0; order < 3; ++order) {
    std::shuffle(threads.begin(), threads.end(), rng);
    std::vector<float> got = start;
    for (const auto& [b, t] : threads) {
      const pc::OwnedCells own = pc::embedding_owned(b, t, h);
      if (own.column >= h) continue;
      po::ops::embedding_grad_cells(tokens.data(), rows, read, got.data(), h, vocab, own.bucket, pc::embedding_buckets,
                                    own.column);
    }
    CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
  }
}

// ---- cuBLASLt plans ---------------------------------------------------------------------------

TEST_CASE("a GEMM plan's key holds shape, output type, epilogue and operand alignments, not data or scalars") {
  const pc::RowMajorGemm f = pc::linear_forward(128, 64, 192);
  const std::uintptr_t base = 1 << 20;  // 256-byte aligned, as the arena's blocks
  const pc::GemmKey k = pc::gemm_key(f, pc::Out::bf16, base, base + 4096, base + 8192, 0);
  CHECK(k == pc::gemm_key(f, pc::Out::bf16, base + 256, base + 512, base + 768, 0));  // other aligned addresses
  pc::RowMajorGemm scaled = f;
  scaled.alpha = 2;
  scaled.beta = 1;
  CHECK(k == pc::gemm_key(scaled, pc::Out::bf16, base, base + 4096, base + 8192, 0));  // alpha, beta: per call
  CHECK(k != pc::gemm_key(f, pc::Out::bf16, base + 16, base + 4096, base + 8192, 0));  // A 16-byte aligned
  CHECK(k != pc::gemm_key(f, pc::Out::f32, base, base + 4096, base + 8192, 0));
  CHECK(k != pc::gemm_key(pc::linear_dgrad(128, 64, 192), pc::Out::bf16, base, base + 4096, base + 8192, 0));
  const pc::GemmKey with_bias = pc::gemm_key(f, pc::Out::bf16, base, base + 4096, base + 8192, base + 2);
  CHECK(with_bias.bias);
  CHECK(with_bias.align_bias == 2);
  CHECK(k.align_bias == 1);
  CHECK(with_bias != k);
}

TEST_CASE("a GPT stage's GEMMs need a few plans, not one per block: the cache's keys repeat from block to block") {
  pm::GptConfig cfg;
  cfg.layers = 24;
  cfg.hidden = 256;
  cfg.heads = 4;
  cfg.seq = 64;
  const pm::GptDims d = pm::gpt_dims(cfg, 0, 1);
  const pm::GptStageParams P = pm::gpt_stage_params(d);
  const long long T = 128, H = d.hidden;
  // The bf16 working copy, the fp32 gradients and an activation buffer, as cudaMalloc and the
  // arena align them; w and g address element `off` of block i's group in the first two.
  const std::uintptr_t work = 1 << 24, grads = 1 << 26, act = 1 << 28;
  const auto w = [&](int i, long long off) {
    return work + static_cast<std::uintptr_t>(2 * (P.block_begin(i) - P.blocks_begin + off));
  };
  const auto g = [&](int i, long long off) {
    return grads + static_cast<std::uintptr_t>(4 * (P.block_begin(i) + off));
  };
  std::map<pc::GemmKey, int> keys;
  const pm::GptBlockParams& o = P.block;
  const long long shapes[4][2] = {{H, 3 * H}, {H, H}, {H, 4 * H}, {4 * H, H}};
  const long long wts[4] = {o.wqkv, o.wo, o.wfc, o.wpr}, biases[4] = {o.bqkv, o.bo, o.bfc, o.bpr};
  for (int i = 0; i < d.blocks; ++i)
    for (int j = 0; j < 4; ++j) {
      const long long k = shapes[j][0], n = shapes[j][1];
      ++keys[pc::gemm_key(pc::linear_forward(T, k, n), pc::Out::bf16, act, w(i, wts[j]), act, w(i, biases[j]))];
      ++keys[pc::gemm_key(pc::linear_dgrad(T, k, n), pc::Out::bf16, act, w(i, wts[j]), act, 0)];
      ++keys[pc::gemm_key(pc::linear_wgrad(T, k, n), pc::Out::f32, act, act, g(i, wts[j]), 0)];
    }
  MESSAGE(keys.size() << " plans for " << 12 * d.blocks << " GEMMs of a step's F, B and W");
  CHECK(keys.size() <= 12 * 4);  // a block's 12 GEMMs, in the few alignments the groups' offsets take
  CHECK(keys.size() < static_cast<std::size_t>(12 * d.blocks) / 4);
}

// ---- model state per parameter of the CUDA GPT (issue 24) -----------------------------------

TEST_CASE("model state: the CUDA GPT's device bytes per parameter, both gradient paths, dp 1, 2, 8, ZeRO 0 and 1") {
  // A GPT-2 medium-like stage of 4 blocks at h = 1024 (no embedding, no head): what a rank of a
  // deep pipeline holds. The stage keeps bf16 working parameters and fp32 gradients (6 bytes a
  // parameter); po::state_bytes adds what the runtime and AdamW allocate, the fp32 master
  // included (parameter_bytes = 2, as train_gpt's cuda_options sizes it).
  const pm::GptConfig cfg{.vocab = 50304, .hidden = 1024, .heads = 16, .layers = 48, .seq = 1024};
  const pm::GptDims dims = pm::gpt_dims(cfg, 5, 12);  // a middle stage: 4 blocks
  REQUIRE(dims.blocks == 4);
  const std::size_t P = static_cast<std::size_t>(pm::gpt_stage_params(dims).total);
  CHECK(pm::gpt_state_bytes(dims) == 6 * P);
  // The last stage also keeps an fp32 copy of the head's bias.
  const pm::GptDims last = pm::gpt_dims(cfg, 11, 12);
  CHECK(pm::gpt_state_bytes(last) ==
        6 * static_cast<std::size_t>(pm::gpt_stage_params(last).total) + static_cast<std::size_t>(cfg.vocab) * 4);
  const std::size_t chunks[] = {P, P};  // two chunks of a rank (v = 2)
  for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact})
    for (int dp : {1, 2, 8})
      for (int zero : {0, 1}) {
        CAPTURE(po::gradients_name(path));
        CAPTURE(dp);
        CAPTURE(zero);
        const po::StateBytes b =
            po::state_bytes(chunks, {.gradients = path, .dp = dp, .zero = zero, .parameter_bytes = 2});
        const double per = static_cast<double>(2 * pm::gpt_state_bytes(dims) + b.arena()) / static_cast<double>(2 * P);
        // Master and moments: 12 a parameter, or 12 / dp of the owned shard with ZeRO-1 (a slice
        // of a bucket is len / dp, len a multiple of dp: at most dp - 1 values of rounding a bucket).
        const double owned = zero == 1 && dp > 1 ? 12.0 / dp : 12.0;
        const double sums = path == po::Gradients::exact ? 16.0 : 0.0;
        const double staging = static_cast<double>(b.staging) / static_cast<double>(2 * P);
        const double padding = path == po::Gradients::exact ? 16.0 * 8 / static_cast<double>(P) : 0.0;
        CHECK(per >= 2 + 4 + sums + owned + staging);
        CHECK(per <= 2 + 4 + sums + owned + staging + padding + 1e-3);
        // The staging is one bucket (2^20 values) of each kind: small beside the model state.
        if (dp > 1) CHECK(staging < (path == po::Gradients::exact ? 1.5 : 0.5));
      }
  // Issue 24's target for the CUDA GPT on the standard path: 2 + 4 + 12/dp, plus the staging.
  const po::StateBytes eight = po::state_bytes(chunks, {.dp = 8, .zero = 1, .parameter_bytes = 2});
  const double now = static_cast<double>(2 * pm::gpt_state_bytes(dims) + eight.arena()) / static_cast<double>(2 * P);
  MESSAGE("CUDA GPT, dp = 8, ZeRO-1, standard: " << now << " bytes a parameter");
  CHECK(now <= 2 + 4 + 12.0 / 8 + static_cast<double>(eight.staging) / static_cast<double>(2 * P) + 1e-3);
}

namespace {

/// Packed rows, and unpacked, at the test's sequence length and one whose tokens are no multiple
/// of 64 (regions rounded to 256 bytes): the planner's scratch is the model's workspace
/// (`workspace(dims, T)`) and the step inputs it counts are the model's inputs() (`inputs`).
void check_packed(po::TransformerSpec m, const po::StageContent& c, auto d, const auto& workspace, const auto& inputs) {
  for (const bool packed : {false, true})
    for (const int seq : {m.seq, 50}) {
      CAPTURE(packed);
      CAPTURE(seq);
      m.packed = d.packed = packed;
      m.seq = seq;
      const po::MicrobatchShape sh{m.micro_batch, seq};
      CHECK(po::stage_scratch_bytes(m, c) == static_cast<double>(workspace(d, sh.tokens())));
      const po::StageInputs want = po::stage_inputs(m, c);
      std::vector<std::string> got;
      for (const po::InputSpec& in : inputs(d, sh)) got.emplace_back(in.name);
      const auto has = [&](const char* name) { return std::find(got.begin(), got.end(), name) != got.end(); };
      CHECK(want.tokens == has("tokens"));
      CHECK(want.targets == has("targets"));
      CHECK(want.documents == has(po::document_offsets_input));
      CHECK(got.size() == static_cast<std::size_t>(want.tokens + want.targets + want.documents));
    }
}

}  // namespace

TEST_CASE(
    "the planner's per-layer formulas are the GPT code's: a block's parameters, every stage's unit, stash and scratch") {
  // plan/model.hpp counts what po::plan puts on each rank; gpt::CudaGptStage allocates it. A change
  // to either that the other does not follow fails here.
  for (const bool recompute : {true, false})
    for (const long long h : {64LL, 128LL, 256LL})
      for (const long long heads : {1LL, 4LL, 8LL}) {
        CAPTURE(recompute);
        CAPTURE(h);
        CAPTURE(heads);
        po::TransformerSpec m{.layers = 6,
                              .hidden = static_cast<int>(h),
                              .heads = static_cast<int>(heads),
                              .query_groups = static_cast<int>(heads),
                              .seq = 64,
                              .micro_batch = 2,
                              .vocab = 512,
                              .recompute = recompute};
        CHECK(po::layer_parameters(m) == static_cast<double>(po::gpt::gpt_block_params(h).count));
        for (const po::StageContent c : {po::StageContent{3, false, false}, po::StageContent{1, true, false},
                                         po::StageContent{2, false, true}, po::StageContent{0, true, true}}) {
          const po::gpt::GptDims d{.vocab = m.vocab,
                                   .hidden = h,
                                   .heads = heads,
                                   .positions = m.seq,
                                   .blocks = c.layers,
                                   .embeds = c.embedding,
                                   .has_head = c.head,
                                   .recompute = recompute};
          const long long tokens = static_cast<long long>(m.micro_batch) * m.seq;
          const pm::GptStageBuffers b = pm::gpt_stage_buffers(d, tokens);
          CHECK(po::stage_activation_bytes(m, c) == static_cast<double>(b.saved_bytes));
          CHECK(po::stage_stash_bytes(m, c) == static_cast<double>(b.stash_bytes));
          CHECK(po::stage_scratch_bytes(m, c) == static_cast<double>(pm::gpt_workspace(d, tokens).bytes));
          CHECK(po::stage_norm_buffer_bytes(m, c) ==
                static_cast<double>(pc::norm_buffer_bytes(po::gpt::gpt_norm_groups(d))));
          // Every parameter, the head's bias (V values) included.
          CHECK(po::stage_parameters(m, c) == static_cast<double>(po::gpt::gpt_stage_params(d).total));
          check_packed(
              m, c, d, [](const po::gpt::GptDims& e, long long T) { return pm::gpt_workspace(e, T).bytes; },
              [](const po::gpt::GptDims& e, po::MicrobatchShape sh) { return po::gpt::gpt_inputs(e, sh); });
        }
      }
}

TEST_CASE(
    "the planner's per-layer formulas are the CUDA Llama's: a block's parameters, every stage's unit, stash, scratch, "
    "norm buffer and own state") {
  // plan/model.hpp with swiglu counts what po::plan puts on each rank; llama::CudaLlamaStage
  // allocates it (models/llama/cuda_layout.hpp). It recomputes its norms and silu(gate) * up, so
  // the planner's unit is its saved buffer with recompute.
  for (const long long h : {64LL, 128LL, 256LL})
    for (const auto& [heads, kv_heads] : {std::pair{1LL, 1LL}, std::pair{4LL, 1LL}, std::pair{8LL, 2LL}})
      for (const long long ffn : {96LL, 352LL}) {
        CAPTURE(h);
        CAPTURE(heads);
        CAPTURE(kv_heads);
        CAPTURE(ffn);
        const po::TransformerSpec m{.layers = 6,
                                    .hidden = static_cast<int>(h),
                                    .heads = static_cast<int>(heads),
                                    .query_groups = static_cast<int>(kv_heads),
                                    .seq = 64,
                                    .micro_batch = 2,
                                    .vocab = 512,
                                    .ffn_hidden = static_cast<int>(ffn),
                                    .swiglu = true,
                                    .recompute = true};
        for (const po::StageContent c : {po::StageContent{3, false, false}, po::StageContent{1, true, false},
                                         po::StageContent{2, false, true}, po::StageContent{0, true, true}}) {
          const po::llama::LlamaDims d{.vocab = m.vocab,
                                       .hidden = h,
                                       .heads = heads,
                                       .kv_heads = kv_heads,
                                       .ffn = ffn,
                                       .blocks = c.layers,
                                       .embeds = c.embedding,
                                       .has_head = c.head};
          const long long tokens = static_cast<long long>(m.micro_batch) * m.seq;
          const po::llama::LlamaStageBuffers b = po::llama::llama_cuda_buffers(d, tokens);
          CHECK(po::layer_parameters(m) == static_cast<double>(po::llama::llama_block_params(d).count));
          CHECK(po::stage_activation_bytes(m, c) == static_cast<double>(b.saved_bytes));
          CHECK(po::stage_stash_bytes(m, c) == static_cast<double>(b.stash_bytes));
          CHECK(po::stage_scratch_bytes(m, c) == static_cast<double>(po::llama::llama_cuda_workspace(d, tokens).bytes));
          CHECK(po::stage_norm_buffer_bytes(m, c) ==
                static_cast<double>(pc::norm_buffer_bytes(po::llama::llama_norm_groups(d))));
          const double P = static_cast<double>(po::llama::llama_stage_params(d).total);
          CHECK(po::stage_parameters(m, c) == P);
          // bf16 working parameters and fp32 gradients (the planner's state_bytes), and the rest.
          CHECK(P * (2 + 4) + po::stage_own_state_bytes(m, c) ==
                static_cast<double>(po::llama::llama_cuda_state_bytes(d, m.seq)));
          check_packed(
              m, c, d,
              [](const po::llama::LlamaDims& e, long long T) { return po::llama::llama_cuda_workspace(e, T).bytes; },
              [](const po::llama::LlamaDims& e, po::MicrobatchShape sh) { return po::llama::llama_inputs(e, sh); });
        }
      }
}
