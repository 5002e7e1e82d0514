// tests/cuda/test_gpu.cpp: the backend's kernels (updates, non-finite check), cuBLASLt GEMMs,
// cuDNN attention and NCCL against the CPU math (needs a GPU; gpu_main.cpp exits 77 without
// one); the ops are test_ops_gpu.cpp's. Inputs are rounded to bf16 first, so a difference is
// the GPU's arithmetic, not the input rounding; tolerances are those of one bf16 rounding of the
// output (2^-8 relative) unless a case says otherwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <pipeoffload/cuda.hpp>

#include <pipeoffload/runtime/thread_ranks.hpp>

#include "gpu_test.hpp"

namespace po = pipeoffload;
namespace pk = pipeoffload::cuda::kernels;
namespace up = pipeoffload::update;

TEST_CASE("backend::Cuda refuses an arena larger than the device's free memory, naming both, before taking any") {
  CHECK_THROWS_WITH_AS(po::backend::Cuda({.arena_bytes = std::size_t{1} << 50}),
                       doctest::Contains("rank 0 needs 1048576.00 GiB of GPU 0's memory for its arena but the GPU has"),
                       po::error);
}

TEST_CASE("backend::Cuda::reset_arena makes the slab again at a new size; one the GPU cannot give keeps the old") {
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const std::size_t workspace = dev.memory().device_held;
  dev.reserve_device(std::size_t{64} << 20, 2);
  dev.reset_arena(std::size_t{1} << 30);
  CHECK(dev.options().arena_bytes == std::size_t{1} << 30);
  CHECK(dev.memory().device_held == workspace);
  dev.reserve_device(std::size_t{300} << 20, 2);  // 600 MiB: more than the first slab held
  CHECK_THROWS_WITH_AS(dev.reset_arena(std::size_t{1} << 50),
                       doctest::Contains("reset_arena: rank 0 needs 1048576.00 GiB of GPU 0's memory"), po::error);
  CHECK(dev.options().arena_bytes == std::size_t{1} << 30);
  CHECK(!dev.failed());
  CHECK_THROWS_WITH_AS(dev.reset_arena(4096), doctest::Contains("cannot hold the"), po::error);
  dev.reserve_device(std::size_t{300} << 20, 2);
  const po::backend::Block b = dev.device_alloc(std::size_t{300} << 20, po::backend::Memory::activation);
  CHECK(b.ptr != nullptr);
  dev.device_free(b);
}

TEST_CASE("AdamW and SGD equal the CPU updates bit for bit; the non-finite check") {
  // update.hpp rounds every product on its own on both sides (nvcc fuses none into an FMA), and
  // division and sqrt are IEEE on both: the same operations in the same order give the same bits.
  Gpu g;
  const std::size_t n = 4099;
  std::vector<float> p = random_bf16(n, 8), gr = random_bf16(n, 9), m(n, 0.01f), v(n, 0.02f);
  float *dp = g.copy(p), *dgr = g.copy(gr), *dm = g.copy(m), *dv = g.copy(v);
  const up::AdamWParams o{};
  const up::AdamBias bc = up::adam_bias(o.beta1, o.beta2, 3);
  // One segment through the multi-tensor kernel (cuda::segment_launches' shape).
  const auto one = [&](float* params, float* s0, float* s1, float lr, float wd) {
    return std::vector<up::Segment>{{params, dgr, s0, s1, nullptr, n, lr, wd}};
  };
  for (const po::cuda::SegmentLaunch& l : po::cuda::segment_launches(one(dp, dm, dv, 1e-3f, o.weight_decay)))
    pk::adamw(l, up::AdamWStep{o.beta1, o.beta2, o.eps, bc, 0.5f}, g.s);
  for (std::size_t i = 0; i < n; ++i) up::adamw(p[i], gr[i] * 0.5f, m[i], v[i], o, 1e-3f, bc);
  CHECK(g.get(dp, n) == p);
  CHECK(g.get(dm, n) == m);
  CHECK(g.get(dv, n) == v);
  CHECK(g.get(dgr, n) == gr);  // read, not zeroed
  // SGD: Nesterov momentum with weight decay, the buffer's first step then a second; and plain
  // SGD with no buffer at all (null).
  const up::SgdParams nesterov{0.9f, 0.0f, true, 0.01f};
  std::vector<float> buf(n, 0.0f);
  float* dbuf = g.copy(buf);
  for (bool first : {true, false}) {
    for (const po::cuda::SegmentLaunch& l : po::cuda::segment_launches(one(dp, dbuf, nullptr, 0.1f, 0.01f)))
      pk::sgd(l, up::SgdStep{0.9f, 0.0f, true, first, 0.5f}, g.s);
    for (std::size_t i = 0; i < n; ++i) up::sgd(p[i], gr[i] * 0.5f, buf[i], nesterov, 0.1f, first);
    CHECK(g.get(dp, n) == p);
    CHECK(g.get(dbuf, n) == buf);
  }
  for (const po::cuda::SegmentLaunch& l : po::cuda::segment_launches(one(dp, nullptr, nullptr, 0.1f, 0.0f)))
    pk::sgd(l, up::SgdStep{0.0f, 0.0f, false, true, 1.0f}, g.s);
  float unused = 0;
  for (std::size_t i = 0; i < n; ++i) up::sgd(p[i], gr[i], unused, up::SgdParams{}, 0.1f, true);
  CHECK(g.get(dp, n) == p);
  // The non-finite check on a bf16 tensor: flags an infinity in the last element only.
  std::vector<float> finite = random_bf16(n, 30);
  pk::bf16* act = g.bf16(finite);
  std::uint32_t* flag = g.copy(std::vector<std::uint32_t>{0});
  pk::flag_nonfinite(act, static_cast<long long>(n), po::DType::bfloat16, flag, g.s);
  CHECK(g.get(flag, 1)[0] == 0u);
  finite.back() = INFINITY;
  act = g.bf16(finite);
  pk::flag_nonfinite(act, static_cast<long long>(n), po::DType::bfloat16, flag, g.s);
  CHECK(g.get(flag, 1)[0] == 1u);
}

TEST_CASE("backend::Cuda refuses more norm groups than its staging holds when the runtime reserves them") {
  if (po::backend::device_count() < 1) {
    MESSAGE("needs a GPU; skipped");
    return;
  }
  // Refused at reservation (a Runtime's construction), not inside a step where a throw could
  // leave queued results pointing into freed memory.
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20, .max_norm_groups = 1});
  const std::size_t groups[2] = {4, 4};
  CHECK_THROWS_WITH(dev.reserve_sum_squares(groups),
                    "backend::Cuda::reserve_sum_squares: 2 groups is outside the allowed range [0, 1] "
                    "(Options::max_norm_groups, the size of its pinned staging)");
}

TEST_CASE("backend::Cuda::sum_squares gives cuda::sum_squares_reference's bits, all groups in one launch") {
  // Sizes around the chunk (4096) and block (256) edges, an empty group, a large one, and the
  // same call twice (the cached group table) and with other groups (a new table).
  const std::vector<std::size_t> groups{4097, 0, 1, 255, 4096, 300001, 8191};
  std::size_t n = 0;
  for (std::size_t g : groups) n += g;
  std::vector<float> host = random_bf16(n, 77, 3.0f);
  po::backend::Cuda dev({.arena_bytes = po::backend::Cuda::Options{}.workspace_bytes + (std::size_t{8} << 20)});
  po::backend::Block b = dev.device_alloc(n * sizeof(float), po::backend::Memory::state);
  dev.upload(b.ptr, host.data(), n * sizeof(float));
  const std::span<const float> values(reinterpret_cast<const float*>(b.ptr), n);
  std::vector<double> want(groups.size()), got(groups.size(), -1.0);
  po::cuda::sum_squares_reference(host, groups, want);
  for (int round = 0; round < 2; ++round) {
    dev.sum_squares(values, groups, got);
    dev.synchronize();  // the sums are written by the next wait
    for (std::size_t k = 0; k < groups.size(); ++k) {
      CAPTURE(k);
      CHECK(std::memcmp(&got[k], &want[k], sizeof(double)) == 0);
    }
  }
  const std::vector<std::size_t> two{n - 5, 5};
  std::vector<double> want2(2), got2(2);
  po::cuda::sum_squares_reference(host, two, want2);
  dev.sum_squares(values, two, got2);
  dev.synchronize();
  CHECK(std::memcmp(got2.data(), want2.data(), 2 * sizeof(double)) == 0);
  dev.device_free(b);
}

TEST_CASE("cuBLASLt runs the GPT's forward, dgrad and wgrad GEMMs as the CPU GEMM computes them") {
  po::backend::Cuda dev({.arena_bytes = std::size_t{1} << 30});
  const int s = dev.make_stream("compute");
  Gpu g;
  const long long rows = 96, k = 64, n = 192;
  const std::vector<float> X = random_bf16(static_cast<std::size_t>(rows * k), 12),
                           W = random_bf16(static_cast<std::size_t>(k * n), 13),
                           dY = random_bf16(static_cast<std::size_t>(rows * n), 14);
  pk::bf16 *dX = g.bf16(X), *dW = g.bf16(W), *ddY = g.bf16(dY);
  pk::bf16 *Y = g.alloc<pk::bf16>(static_cast<std::size_t>(rows * n)),
           *dXo = g.alloc<pk::bf16>(static_cast<std::size_t>(rows * k));
  std::vector<float> gw0 = random_bf16(static_cast<std::size_t>(k * n), 15);
  float* gW = g.copy(gw0);
  dev.launch(s, [&] {
    auto ctx = dev.context(s);
    po::cuda::gemm(ctx, po::cuda::linear_forward(rows, k, n), dX, dW, Y, po::cuda::Out::bf16);
    po::cuda::gemm(ctx, po::cuda::linear_dgrad(rows, k, n), ddY, dW, dXo, po::cuda::Out::bf16);
    po::cuda::gemm(ctx, po::cuda::linear_wgrad(rows, k, n), dX, ddY, gW, po::cuda::Out::f32);
  });
  dev.synchronize();
  std::vector<float> y(static_cast<std::size_t>(rows * n), 0), dx(static_cast<std::size_t>(rows * k), 0), gw = gw0;
  for (long long r = 0; r < rows; ++r)
    for (long long c = 0; c < n; ++c)
      for (long long p = 0; p < k; ++p) {
        y[static_cast<std::size_t>(r * n + c)] +=
            X[static_cast<std::size_t>(r * k + p)] * W[static_cast<std::size_t>(p * n + c)];
        dx[static_cast<std::size_t>(r * k + p)] +=
            dY[static_cast<std::size_t>(r * n + c)] * W[static_cast<std::size_t>(p * n + c)];
        gw[static_cast<std::size_t>(p * n + c)] +=
            X[static_cast<std::size_t>(r * k + p)] * dY[static_cast<std::size_t>(r * n + c)];
      }
  check_close(g.get(Y, y.size()), y, bf16_rel, 1e-2f);
  check_close(g.get(dXo, dx.size()), dx, bf16_rel, 1e-2f);
  check_close(g.get(gW, gw.size()), gw, 1e-4f, 1e-3f);  // fp32 output: only the summation order differs
  // Operands 16 bytes past a 256-byte boundary, as tensors inside a parameter vector may be:
  // gemm tells cuBLASLt's heuristic each operand's alignment.
  pk::bf16* X16 = g.alloc<pk::bf16>(static_cast<std::size_t>(rows * k) + 8) + 8;
  pk::bf16* W16 = g.alloc<pk::bf16>(static_cast<std::size_t>(k * n) + 8) + 8;
  pk::bf16* Y16 = g.alloc<pk::bf16>(static_cast<std::size_t>(rows * n) + 8) + 8;
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(X16, dX, static_cast<std::size_t>(rows * k) * 2, cudaMemcpyDeviceToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(W16, dW, static_cast<std::size_t>(k * n) * 2, cudaMemcpyDeviceToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  dev.launch(s, [&] {
    po::cuda::gemm(dev.context(s), po::cuda::linear_forward(rows, k, n), X16, W16, Y16, po::cuda::Out::bf16);
  });
  dev.synchronize();
  check_close(g.get(Y16, y.size()), y, bf16_rel, 1e-2f);
}

TEST_CASE("cuDNN's causal SDPA forward and backward match the CPU model's attention") {
  po::backend::Cuda dev({.arena_bytes = std::size_t{1} << 30});
  const int s = dev.make_stream("compute");
  Gpu g;
  const int B = 2, A = 4, S = 64, D = 64, H = A * D;
  const std::vector<float> qkv = random_bf16(static_cast<std::size_t>(B) * S * 3 * H, 16),
                           dout = random_bf16(static_cast<std::size_t>(B) * S * H, 17);
  pk::bf16 *dqkv_in = g.bf16(qkv), *ddout = g.bf16(dout), *out = g.alloc<pk::bf16>(dout.size()),
           *dqkv = g.alloc<pk::bf16>(qkv.size());
  float* stats = g.alloc<float>(static_cast<std::size_t>(B) * A * S);
  const po::cuda::attention::Shape shape{B, A, S, D};
  dev.launch(s, [&] {
    auto ctx = dev.context(s);
    REQUIRE(po::cuda::attention::workspace_bytes(*ctx.attention, shape) <= ctx.workspace_bytes);
    po::cuda::attention::forward(*ctx.attention, ctx.cuda_stream, shape, dqkv_in, out, stats, ctx.workspace,
                                 ctx.workspace_bytes);
    po::cuda::attention::backward(*ctx.attention, ctx.cuda_stream, shape, dqkv_in, out, ddout, stats, dqkv,
                                  ctx.workspace, ctx.workspace_bytes);
  });
  dev.synchronize();
  // The CPU model's attention (models/gpt/cpu.hpp), in double.
  std::vector<float> want_out(dout.size()), want_lse(static_cast<std::size_t>(B) * A * S), want_d(qkv.size(), 0.0f);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto at = [&](int b, int t, int part, int a, int e) {
    return static_cast<std::size_t>((b * S + t) * 3 * H + part * H + a * D + e);
  };
  for (int b = 0; b < B; ++b)
    for (int a = 0; a < A; ++a) {
      std::vector<double> P(static_cast<std::size_t>(S) * S, 0.0);
      for (int i = 0; i < S; ++i) {
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double sc = 0;
          for (int e = 0; e < D; ++e) sc += static_cast<double>(qkv[at(b, i, 0, a, e)]) * qkv[at(b, j, 1, a, e)];
          P[static_cast<std::size_t>(i * S + j)] = sc * scale;
          mx = std::max(mx, sc * scale);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(P[static_cast<std::size_t>(i * S + j)] - mx);
        const double lse = mx + std::log(sum);
        want_lse[static_cast<std::size_t>((b * A + a) * S + i)] = static_cast<float>(lse);
        for (int j = 0; j <= i; ++j)
          P[static_cast<std::size_t>(i * S + j)] = std::exp(P[static_cast<std::size_t>(i * S + j)] - lse);
        for (int e = 0; e < D; ++e) {
          double o = 0;
          for (int j = 0; j <= i; ++j) o += P[static_cast<std::size_t>(i * S + j)] * qkv[at(b, j, 2, a, e)];
          want_out[static_cast<std::size_t>((b * S + i) * H + a * D + e)] = static_cast<float>(o);
        }
      }
      for (int i = 0; i < S; ++i) {
        double Di = 0;
        for (int e = 0; e < D; ++e)
          Di += static_cast<double>(dout[static_cast<std::size_t>((b * S + i) * H + a * D + e)]) *
                want_out[static_cast<std::size_t>((b * S + i) * H + a * D + e)];
        for (int j = 0; j <= i; ++j) {
          double dp = 0;
          for (int e = 0; e < D; ++e)
            dp += static_cast<double>(dout[static_cast<std::size_t>((b * S + i) * H + a * D + e)]) *
                  qkv[at(b, j, 2, a, e)];
          const double p = P[static_cast<std::size_t>(i * S + j)], ds = p * (dp - Di);
          for (int e = 0; e < D; ++e) {
            want_d[at(b, j, 2, a, e)] +=
                static_cast<float>(p * dout[static_cast<std::size_t>((b * S + i) * H + a * D + e)]);
            want_d[at(b, i, 0, a, e)] += static_cast<float>(ds * scale * qkv[at(b, j, 1, a, e)]);
            want_d[at(b, j, 1, a, e)] += static_cast<float>(ds * scale * qkv[at(b, i, 0, a, e)]);
          }
        }
      }
    }
  check_close(g.get(stats, want_lse.size()), want_lse, 1e-3f, 1e-2f);
  check_close(g.get(out, want_out.size()), want_out, 2 * bf16_rel, 2e-2f);
  check_close(g.get(dqkv, want_d.size()), want_d, 4 * bf16_rel, 5e-2f);  // bf16 P and dP inside the fused kernel
}

TEST_CASE("comm::Nccl moves tagged messages between two GPUs on the comm stream and catches a wrong tag") {
  if (po::backend::device_count() < 2) {
    MESSAGE("needs 2 GPUs (NCCL refuses two ranks on one GPU); skipped");
    return;
  }
  const std::vector<int> devices = {0, 1};
  auto world = po::comm::NcclWorld::all_local(devices);
  const std::size_t n = 1 << 16, bytes = n * sizeof(float);
  // Each rank's arena holds the cuBLASLt/cuDNN workspace the constructor carves first, and the
  // one message block (issue 15: 64 MiB could not hold the 256 MiB workspace, and the throw
  // inside a bare std::thread terminated the whole binary).
  const std::size_t arena = po::backend::Cuda::Options{}.workspace_bytes + bytes + 4096;
  std::vector<float> got(n, 0.0f);
  std::string wrong_tag_error;
  // run_thread_ranks catches what a rank throws, returns it, and aborts the world so that the
  // other rank's waits end too.
  const std::vector<std::string> errors = po::run_thread_ranks(*world, [&](int r) {
    po::backend::Cuda dev({.device = r, .rank = r, .arena_bytes = arena});
    po::comm::Nccl comm(world, r, dev);
    const int cs = dev.make_stream("comm");
    po::backend::Block b = dev.device_alloc(bytes, po::backend::Memory::message);
    std::vector<float> mine(n);
    for (std::size_t i = 0; i < n; ++i) mine[i] = static_cast<float>(r * 1000000 + static_cast<int>(i));
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(b.ptr, mine.data(), bytes, cudaMemcpyHostToDevice));
    const std::span<std::byte> data(b.ptr, bytes);
    // Step 1: rank 0 sends, rank 1 receives the right tag.
    dev.launch(cs, [&] {
      if (r == 0)
        comm.send(dev.context(cs), 1, {1, 0, po::Dir::forward}, data);
      else
        comm.recv(dev.context(cs), 0, {1, 0, po::Dir::forward}, data);
    });
    dev.synchronize();
    const double one[1] = {1.0};
    std::vector<double> all(2);
    comm.all_gather(std::span<const double>(one), std::span(all));  // verifies the step's tags
    if (r == 1) PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(got.data(), b.ptr, bytes, cudaMemcpyDeviceToHost));
    // Step 2: rank 1 expects another microbatch than rank 0 sends.
    dev.launch(cs, [&] {
      if (r == 0)
        comm.send(dev.context(cs), 1, {1, 1, po::Dir::forward}, data);
      else
        comm.recv(dev.context(cs), 0, {1, 2, po::Dir::forward}, data);
    });
    dev.synchronize();
    try {
      comm.all_gather(std::span<const double>(one), std::span(all));
    } catch (const po::comm_error& e) {
      // Rank 1's verdict. Thrown on, so that run_thread_ranks aborts the world: rank 0, already
      // inside ncclAllGather, waits for rank 1 until then.
      wrong_tag_error = e.what();
      throw;
    }
  });
  for (int r = 0; r < 2; ++r)
    MESSAGE(
        "rank " << r << ": "
                << (errors[static_cast<std::size_t>(r)].empty() ? "returned" : errors[static_cast<std::size_t>(r)]));
  for (std::size_t i = 0; i < n; ++i) CHECK(got[i] == static_cast<float>(i));
  CHECK(errors[1] == wrong_tag_error);  // rank 1 failed with the wrong tag, nothing earlier
  CHECK(wrong_tag_error.find("expected (forward, stage 1, mb 2) of " + std::to_string(bytes) + " bytes") !=
        std::string::npos);
  CHECK(wrong_tag_error.find("received (forward, stage 1, mb 1) of " + std::to_string(bytes) + " bytes") !=
        std::string::npos);
}

namespace {

/// What each global rank of a dp x d grid received from its groups' collectives, and what its
/// call after the abort threw.
struct GridResults {
  static constexpr std::size_t block = 1000;
  std::vector<std::vector<std::byte>> reps_a2a, pipe_a2a, reps_ag;
  std::vector<std::string> after_abort;
  explicit GridResults(int size) : reps_a2a(size), pipe_a2a(size), reps_ag(size), after_abort(size) {}
};

/// Global rank g's part: all_to_all in its replicas group, then in its pipeline, an all_gather
/// in its replicas group, each on the comm stream of `dev`; once every rank is idle the last
/// rank aborts its replicas group, and every rank's next call (in its pipeline) must throw.
template <class Comm>
void grid_rank(po::backend::Cuda& dev, Comm& pipe, Comm& reps, int g, int size, std::barrier<>& sync,
               GridResults& out) {
  constexpr std::size_t block = GridResults::block;
  const int cs = dev.make_stream("comm");
  const std::size_t most = static_cast<std::size_t>(std::max(pipe.size(), reps.size())) * block;
  po::backend::Block in = dev.device_alloc(most, po::backend::Memory::message);
  po::backend::Block out_block = dev.device_alloc(most, po::backend::Memory::message);
  std::vector<std::byte> host(most);
  for (std::size_t i = 0; i < most; ++i)
    host[i] = static_cast<std::byte>((static_cast<std::size_t>(g) * 37 + i) & 0xff);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(in.ptr, host.data(), most, cudaMemcpyHostToDevice));
  const po::backend::CudaContext ctx = dev.context(cs);
  auto run = [&](Comm& c, std::vector<std::byte>& got, bool gather) {
    const std::size_t n = static_cast<std::size_t>(c.size()) * block;
    if (gather)
      c.all_gather(ctx, std::span<const std::byte>(in.ptr, block), std::span(out_block.ptr, n));
    else
      c.all_to_all(ctx, std::span<const std::byte>(in.ptr, n), std::span(out_block.ptr, n));
    got.resize(n);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(got.data(), out_block.ptr, n, cudaMemcpyDeviceToHost, ctx.cuda_stream));
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(ctx.cuda_stream));
  };
  const auto G = static_cast<std::size_t>(g);
  run(reps, out.reps_a2a[G], false);
  run(pipe, out.pipe_a2a[G], false);
  run(reps, out.reps_ag[G], true);
  // The last rank aborts its replicas group once every rank is idle: both groups of every
  // rank (one process here) are aborted, and their calls to come throw.
  sync.arrive_and_wait();
  if (g == size - 1) reps.abort("replica 1 failed");
  sync.arrive_and_wait();
  try {
    pipe.all_gather(ctx, std::span<const std::byte>(in.ptr, block),
                    std::span(out_block.ptr, static_cast<std::size_t>(pipe.size()) * block));
  } catch (const po::aborted_error& e) {
    out.after_abort[G] = e.what();
  }
}

/// Rank q of the replicas group is global q * d + r; of the pipeline, j * d + q.
void check_grid(const GridResults& got, const std::vector<std::string>& errors, int dp, int d) {
  constexpr std::size_t block = GridResults::block;
  auto sent = [](int from, std::size_t i) {
    return static_cast<std::byte>((static_cast<std::size_t>(from) * 37 + i) & 0xff);
  };
  for (int g = 0; g < dp * d; ++g) {
    CAPTURE(g);
    const std::size_t G = static_cast<std::size_t>(g);
    CHECK(errors[G] == "");
    const int j = g / d, r = g % d;
    for (int q = 0; q < dp; ++q)
      for (std::size_t i = 0; i < block; ++i) {
        CHECK(got.reps_a2a[G][static_cast<std::size_t>(q) * block + i] ==
              sent(q * d + r, static_cast<std::size_t>(j) * block + i));
        CHECK(got.reps_ag[G][static_cast<std::size_t>(q) * block + i] == sent(q * d + r, i));
      }
    for (int q = 0; q < d; ++q)
      for (std::size_t i = 0; i < block; ++i)
        CHECK(got.pipe_a2a[G][static_cast<std::size_t>(q) * block + i] ==
              sent(j * d + q, static_cast<std::size_t>(r) * block + i));
    CHECK(got.after_abort[G] == "aborted: replica 1 failed");
  }
}

}  // namespace

TEST_CASE("comm::NcclWorld::split: a grid's two groups on GPUs, all_to_all and all_gather on the stream, one abort") {
  const int gpus = po::backend::device_count();
  if (gpus < 2) {
    MESSAGE("needs 2 GPUs (NCCL refuses two ranks on one GPU); skipped");
    return;
  }
  const int dp = 2, d = gpus >= 4 ? 2 : 1, size = dp * d;  // g = replica * d + rank, one GPU each
  std::vector<int> devices(static_cast<std::size_t>(size));
  for (int g = 0; g < size; ++g) devices[static_cast<std::size_t>(g)] = g;
  auto world = po::comm::NcclWorld::all_local(devices);
  const std::size_t arena = po::backend::Cuda::Options{}.workspace_bytes + 4 * GridResults::block * 16 + 4096;
  GridResults got(size);
  std::barrier sync(size);
  const std::vector<std::string> errors = po::run_thread_ranks(*world, [&](int g) {
    po::backend::Cuda dev({.device = g, .rank = g, .arena_bytes = arena});
    auto pipe_world = world->split(g, g / d, g % d);  // every rank's thread at once
    auto reps_world = world->split(g, g % d, g / d);
    po::comm::Nccl pipe(pipe_world, pipe_world->rank(), dev), reps(reps_world, reps_world->rank(), dev);
    CHECK(pipe.rank() == g % d);
    CHECK(pipe.size() == d);
    CHECK(reps.rank() == g / d);
    CHECK(reps.size() == dp);
    grid_rank(dev, pipe, reps, g, size, sync, got);
  });
  check_grid(got, errors, dp, d);
  CHECK(world->aborted());
}

TEST_CASE("comm::SharedGpu: ranks sharing one GPU pass tagged messages on their streams and catch a wrong tag") {
  if (po::backend::device_count() < 1) {
    MESSAGE("needs a GPU; skipped");
    return;
  }
  // Two ranks on GPU 0, each with its own arena and comm stream: rank 0's block reaches rank 1's
  // through a device copy ordered by events, while each rewrites its buffer on its stream right
  // after the call returns (the sender for its next message, the receiver scribbling on what it
  // read): only the events keep the copy between the two; a wrong tag is refused at the receive.
  po::comm::ThreadsWorld world(2);
  const std::size_t bytes = std::size_t{1} << 20;
  const std::size_t arena = po::backend::Cuda::Options{}.workspace_bytes + bytes + 4096;
  const int messages = 4;
  std::vector<std::vector<unsigned char>> seen(messages, std::vector<unsigned char>(bytes, 0));  // rank 1's reads
  const std::vector<std::string> errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cuda dev({.device = 0, .rank = r, .arena_bytes = arena});
    po::comm::SharedGpu comm(po::comm::Threads(world, r), po::comm::DeviceCopy<po::comm::CudaStreams>{});
    const int cs = dev.make_stream("comm");
    po::backend::Block b = dev.device_alloc(bytes, po::backend::Memory::message);
    const std::span<std::byte> data(b.ptr, bytes);
    const po::backend::CudaContext ctx = dev.context(cs);
    for (int k = 0; k < messages; ++k) {
      if (r == 0) {
        PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(b.ptr, k + 1, bytes, ctx.cuda_stream));  // message k, on the stream
        comm.send(ctx, 1, {1, k, po::Dir::forward}, data);
        PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(b.ptr, 0xee, bytes, ctx.cuda_stream));  // rewritten at once
      } else {
        comm.recv(ctx, 0, {1, k, po::Dir::forward}, data);
        PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(seen[static_cast<std::size_t>(k)].data(), b.ptr, bytes,
                                               cudaMemcpyDeviceToHost, ctx.cuda_stream));
        PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(b.ptr, 0xdd, bytes, ctx.cuda_stream));  // scribbled on at once
      }
    }
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(ctx.cuda_stream));
    if (r == 0)
      comm.send(ctx, 1, {1, messages, po::Dir::forward}, data);
    else
      comm.recv(ctx, 0, {1, messages + 1, po::Dir::forward}, data);
  });
  for (int k = 0; k < messages; ++k) {
    const std::vector<unsigned char>& v = seen[static_cast<std::size_t>(k)];
    CHECK(std::count(v.begin(), v.end(), static_cast<unsigned char>(k + 1)) == static_cast<long>(bytes));
  }
  CHECK(errors[1] == "comm::Threads: rank 1 expected (forward, stage 1, mb " + std::to_string(messages + 1) + ") of " +
                         std::to_string(bytes) + " bytes from rank 0 but received (forward, stage 1, mb " +
                         std::to_string(messages) + ") of " + std::to_string(bytes) + " bytes");
  CHECK(errors[0].rfind("aborted: ", 0) == 0);  // rank 1's failure ended rank 0's send
}

TEST_CASE("comm::SharedGpu: a grid's two groups on one GPU, all_to_all and all_gather on the streams, one abort") {
  if (po::backend::device_count() < 1) {
    MESSAGE("needs a GPU; skipped");
    return;
  }
  const int dp = 2, d = 2, size = dp * d;  // g = replica * d + rank, all on GPU 0
  po::comm::ThreadsGrid grid(dp, d);
  const std::size_t arena = po::backend::Cuda::Options{}.workspace_bytes + 4 * GridResults::block * 16 + 4096;
  GridResults got(size);
  std::barrier sync(size);
  const std::vector<std::string> errors = po::run_thread_ranks(grid, [&](int g) {
    po::backend::Cuda dev({.device = 0, .rank = g, .arena_bytes = arena});
    po::comm::SharedGpu pipe(grid.pipeline(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
    po::comm::SharedGpu reps(grid.replicas(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
    grid_rank(dev, pipe, reps, g, size, sync, got);
  });
  check_grid(got, errors, dp, d);
  CHECK(grid.aborted());
}

TEST_CASE("device_pairing covers every visible GPU exactly once") {
  const po::cuda::Pairing p = po::backend::device_pairing();
  std::vector<int> devs = p.device_of_rank;
  std::sort(devs.begin(), devs.end());
  for (int i = 0; i < static_cast<int>(devs.size()); ++i) CHECK(devs[static_cast<std::size_t>(i)] == i);
  CHECK(static_cast<int>(devs.size()) == po::backend::device_count());
}
