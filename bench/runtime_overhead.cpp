// bench/runtime_overhead: what the runtime adds to a pass of the sample GPT, measured in one run.
//
//   ./build/bench/runtime_overhead
//
// 1. Type erasure: a pass through po::StageRef (one indirect call through a table made once
//    per stage type) against the same call on the layer itself, with a layer whose pass does
//    nothing, so only the call is timed. Formula: ns per call = time of N calls / N, median of 5.
// 2. The non-finite check: backend::Cpu::flag_nonfinite over one boundary tensor (what the
//    runtime runs after each F and B when RuntimeOptions::check_finite is on).
// 3. A pass of the sample GPT's stage at train_gpt's defaults (h = 64, 4 heads, seq 64, batch 4,
//    one block): F + B + W, median of 9; the two costs above are reported as a fraction of it.
#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

double seconds_of(auto&& fn) {
  const auto t = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double median_of(int runs, auto&& fn) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) t.push_back(seconds_of(fn));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// A layer whose passes only touch their output, so a call costs its call.
struct NoOp {
  float p = 0, g = 0;
  po::Boundary input_boundary(po::MicrobatchShape) const { return {1}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {1}; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return 4; }
  std::size_t stash_bytes(po::MicrobatchShape) const { return 4; }
  [[gnu::noinline]] void forward(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor y,
                                 std::byte*) {
    *y.data = std::byte{1};
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*,
                      std::byte*) {}
  void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte*, std::byte*) {}
  std::span<float> parameters() { return {&p, 1}; }
  std::span<float> gradients() { return {&g, 1}; }
};

}  // namespace

int main() {
  // 1. The call.
  NoOp layer;
  const po::StageRef<po::backend::CpuContext> ref(layer);
  po::backend::CpuContext ctx;
  po::Microbatch mb;
  std::byte out{};
  const po::Tensor y{&out, 1, po::DType::uint8};
  constexpr int calls = 20'000'000;
  const double direct = median_of(5,
                                  [&] {
                                    for (int i = 0; i < calls; ++i) layer.forward(ctx, mb, {}, y, nullptr);
                                  }) /
                        calls;
  const double erased = median_of(5,
                                  [&] {
                                    for (int i = 0; i < calls; ++i) ref.forward(ctx, mb, {}, y, nullptr);
                                  }) /
                        calls;

  // 3. A GPT stage pass at train_gpt's defaults.
  po::gpt::GptConfig cfg;
  cfg.hidden = 64;
  cfg.heads = 4;
  cfg.seq = 64;
  cfg.layers = 3;
  const po::MicrobatchShape sh{4, 64};
  po::gpt::GptStage st(cfg, 1, 3);  // a middle stage: one block
  const std::size_t n = st.output_boundary(sh).elements;
  std::vector<float> x(n), yv(n), dy(n, 0.01f), dx(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(i % 97) - 48) * 0.02f;
  std::vector<std::byte> saved(st.saved_bytes(sh)), stash(st.stash_bytes(sh));
  mb.stage = 1;
  mb.stages = 3;
  mb.shape = sh;
  const double pass = median_of(9, [&] {
    st.forward(ctx, mb, po::view(x), po::view(yv), saved.data());
    st.backward_input(ctx, mb, po::view(dy), po::view(dx), saved.data(), stash.data());
    st.backward_weight(ctx, mb, saved.data(), stash.data());
  });
  const double forward = median_of(9, [&] { st.forward(ctx, mb, po::view(x), po::view(yv), saved.data()); });

  // 2. The check of one boundary (after F, and after B on dx: two per F+B+W).
  po::backend::Cpu dev;
  auto dctx = dev.context(0);
  std::uint32_t flag = 0;
  constexpr int checks = 2000;
  const double check = median_of(5,
                                 [&] {
                                   for (int i = 0; i < checks; ++i)
                                     dev.flag_nonfinite(dctx, po::view(std::as_const(yv)), &flag);
                                 }) /
                       checks;
  if (flag != 0) {
    std::fprintf(stderr, "runtime_overhead: the check flagged a finite tensor\n");
    return 1;
  }

  std::printf("pass call through po::StageRef: %.2f ns; direct: %.2f ns; the indirection costs %.2f ns per pass\n",
              erased * 1e9, direct * 1e9, (erased - direct) * 1e9);
  std::printf("GPT stage (h=64, seq 64, batch 4, 1 block): F %.3f ms, F+B+W %.3f ms\n", forward * 1e3, pass * 1e3);
  std::printf("non-finite check of one boundary (%zu floats): %.2f us = %.3f%% of F+B+W for two checks\n", n,
              check * 1e6, 100 * 2 * check / pass);
  std::printf("indirection: %.5f%% of F+B+W for three calls\n", 100 * 3 * std::max(0.0, erased - direct) / pass);
  return 0;
}
