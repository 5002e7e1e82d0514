// bench/gpt_block: one GPT block's F + B + W on one core against the best single-thread
// SGEMM rate of the same BLAS, measured in the same run.
//
//   ./build/bench/gpt_block [--hidden 512] [--seq 256] [--batch 2] [--heads 8]
//
// Formula: block FLOPs per pass set = 3 * (24 T h^2 + 4 T s h), T = batch * seq tokens (the
// GEMMs of F, and twice that for B + W; attention counted over the full s x s it computes;
// recompute and element-wise work not counted). Rate = FLOPs / median time of 5.
// Baseline: the best of square SGEMMs n = 512, 1024, 2048 and the block's own largest GEMM
// shape (T x h x 4h), each the best of 5.
#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "../samples/cli.hpp"

namespace {

double seconds_of(auto&& fn) {
  const auto t = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double sgemm_rate(int M, int N, int K) {
  std::vector<float> a(static_cast<std::size_t>(M) * K, 0.5f), b(static_cast<std::size_t>(K) * N, 0.25f),
      c(static_cast<std::size_t>(M) * N);
  double best = 1e9;
  for (int i = 0; i < 6; ++i)
    best = std::min(best, seconds_of([&] {
                      po::blas::sgemm(po::blas::Trans::no, po::blas::Trans::no, M, N, K, 1, a.data(), K, b.data(), N, 0,
                                      c.data(), N);
                    }));
  return 2.0 * M * N * K / best;
}

}  // namespace

int main(int argc, char** argv) {
  po::gpt::GptConfig cfg;
  int batch = 2;
  cli::parsed_or_exit("gpt_block", [&] {
    cli::help(argc, argv, "usage: gpt_block [--hidden 512] [--seq 256] [--batch 2] [--heads 8]\n");
    constexpr cli::Flag flags[] = {{"--hidden"}, {"--seq"}, {"--batch"}, {"--heads"}};
    const cli::Args args(argc, argv, flags);
    const auto get = [&](std::string_view f, long long fallback, long long hi) {
      const std::string* v = args.get(f);
      return static_cast<int>(v ? cli::to_int(f, *v, 1, hi) : fallback);
    };
    cfg.hidden = get("--hidden", 512, 8192);
    cfg.seq = get("--seq", 256, 8192);
    batch = get("--batch", 2, 4096);
    cfg.heads = get("--heads", 8, 1024);
    if (cfg.hidden % cfg.heads != 0)
      throw cli::bad_argument("--heads " + std::to_string(cfg.heads) + " must divide --hidden " +
                              std::to_string(cfg.hidden));
  });
  cfg.layers = 3;
  cfg.dropout = 0.1f;
  const po::MicrobatchShape sh{batch, cfg.seq};
  po::gpt::GptStage st(cfg, 1, 3);  // a middle stage: exactly one block
  const double T = static_cast<double>(sh.tokens()), h = cfg.hidden, s = cfg.seq;
  const double flops = 3 * (24 * T * h * h + 4 * T * s * h);
  std::vector<float> x(static_cast<std::size_t>(T * h), 0.1f), y(x.size()), dy(x.size(), 0.01f), dx(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 97) - 48) * 0.02f;
  std::vector<std::byte> saved(st.saved_bytes(sh)), stash(st.stash_bytes(sh));
  po::backend::CpuContext ctx;
  po::Microbatch mb;
  mb.stage = 1;
  mb.stages = 3;
  mb.shape = sh;
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {
    const double t = seconds_of([&] {
      st.forward(ctx, mb, po::view(x), po::view(y), saved.data());
      st.backward_input(ctx, mb, po::view(dy), po::view(dx), saved.data(), stash.data());
      st.backward_weight(ctx, mb, saved.data(), stash.data());
    });
    if (i > 0) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  const double block_rate = flops / times[times.size() / 2];
  double best = 0;
  int best_n = 0;
  for (int n : {512, 1024, 2048}) {
    const double r = sgemm_rate(n, n, n);
    if (r > best) {
      best = r;
      best_n = n;
    }
  }
  const double shape_rate = sgemm_rate(static_cast<int>(T), 4 * cfg.hidden, cfg.hidden);
  const double baseline = std::max(best, shape_rate);
  std::printf("BLAS: OpenBLAS, core %s, 1 thread\n", po::blas::core_name().c_str());
  std::printf("SGEMM square n=%d: %.1f GFLOP/s; block shape %dx%dx%d: %.1f GFLOP/s\n", best_n, best / 1e9,
              static_cast<int>(T), 4 * cfg.hidden, cfg.hidden, shape_rate / 1e9);
  std::printf(
      "GPT block h=%d s=%d b=%d heads=%d: F+B+W %.1f ms, %.1f GFLOP/s = %.1f%% of the best SGEMM (target >= 60%%)\n",
      cfg.hidden, cfg.seq, batch, cfg.heads, times[times.size() / 2] * 1e3, block_rate / 1e9,
      100 * block_rate / baseline);
  const auto bd = st.block_breakdown(sh);
  std::printf(
      "saved per block: %.1f bf16-equivalent bytes per b*s*h with selective recompute (paper: 20; without: 34)\n",
      (2.0 * static_cast<double>(bd.tensor_floats) + static_cast<double>(bd.mask_bytes)) / (T * h));
  return 0;
}
