// tests/runtime/tanh_layer.hpp: a small real layer, y = tanh(W x + b) per token, for runtime
// tests, and a helper that trains it with any schedule on thread ranks.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <pipeoffload/runtime.hpp>

namespace test {

/// Per-rank failure injection: the layer throws on the `fail_at`-th pass (1-based) it runs
/// on rank `fail_rank`.
struct Failure {
  int fail_rank = -1;
  int fail_at = 0;
  std::atomic<int> calls{0};
};

/// Stage `stage` of a chain of tanh layers of width h. Stage 0 embeds tokens (a 16-row
/// table); the last stage's loss is the mean of 0.5 (y - t)^2 with t derived from targets.
/// Its activation unit is x, y and a stage-dependent pad (so stages have different unit
/// sizes) that W checks, which catches a corrupted offload round trip.
/// Seconds each pass of a TanhLayer sleeps (0: as fast as it computes).
struct Timing {
  double f = 0, b = 0, w = 0;
};

class TanhLayer {
 public:
  TanhLayer(int stage, int h, std::uint64_t seed, Timing timing = {}, Failure* failure = nullptr, int rank = 0)
      : stage_(stage), h_(h), timing_(timing), failure_(failure), rank_(rank) {
    const std::size_t n = static_cast<std::size_t>(h) * static_cast<std::size_t>(h) + static_cast<std::size_t>(h) +
                          (stage == 0 ? 16 * static_cast<std::size_t>(h) : 0);
    params_.resize(n);
    grads_.assign(n, 0.0f);
    std::uint64_t s = seed * 1000003u + static_cast<std::uint64_t>(stage);
    for (float& p : params_) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      p = (static_cast<float>(s >> 40) / 16777216.0f - 0.5f) * (2.0f / std::sqrt(static_cast<float>(h)));
    }
  }

  std::size_t boundary_floats(po::MicrobatchShape sh) const {
    return static_cast<std::size_t>(sh.tokens()) * static_cast<std::size_t>(h_);
  }
  po::Boundary input_boundary(po::MicrobatchShape sh) const { return {boundary_floats(sh)}; }
  po::Boundary output_boundary(po::MicrobatchShape sh) const { return {boundary_floats(sh)}; }
  /// Stage 0 reads token ids (an embedding row each), the last stage targets: int32, one per
  /// token. (A TanhLayer does not know the stage count, so every stage declares the targets.)
  std::vector<po::InputSpec> inputs(po::MicrobatchShape sh) const {
    std::vector<po::InputSpec> in;
    if (stage_ == 0) in.push_back({"tokens", po::DType::int32, static_cast<std::size_t>(sh.tokens())});
    in.push_back({"targets", po::DType::int32, static_cast<std::size_t>(sh.tokens())});
    return in;
  }
  std::size_t pad_floats(po::MicrobatchShape sh) const {
    return static_cast<std::size_t>(sh.tokens()) * static_cast<std::size_t>(stage_ % 3);
  }
  std::size_t saved_bytes(po::MicrobatchShape sh) const {
    return (2 * boundary_floats(sh) + pad_floats(sh)) * sizeof(float);
  }
  std::size_t stash_bytes(po::MicrobatchShape sh) const { return boundary_floats(sh) * sizeof(float); }
  /// With parts (Config::parts): y (what B reads), then x, then the pad (what only W reads).
  std::vector<po::SavedPart> saved_parts(po::MicrobatchShape sh) const {
    if (!parts_) return {};
    const std::size_t n = boundary_floats(sh) * sizeof(float);
    std::vector<po::SavedPart> p = {{n, n}, {0, n}};
    if (pad_floats(sh) > 0) p.push_back({2 * n, pad_floats(sh) * sizeof(float)});
    return p;
  }
  /// Declare saved_parts; `await_all`: B awaits every part (false: only the first, a bug
  /// the runtime reports).
  void use_parts(bool await_all = true) {
    parts_ = true;
    await_all_ = await_all;
  }

  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor xt, po::Tensor yt,
               std::byte* saved) {
    pass(timing_.f);
    const float* x = xt.as<float>();
    float* y = yt.as<float>();
    const std::int32_t* tokens = x ? nullptr : mb.input<std::int32_t>("tokens");
    const std::size_t T = static_cast<std::size_t>(mb.shape.tokens()), h = static_cast<std::size_t>(h_);
    float* xs = reinterpret_cast<float*>(saved);
    float* ys = xs + T * h;
    float* pad = ys + T * h;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < h; ++i)
        xs[t * h + i] = x ? x[t * h + i] : emb()[static_cast<std::size_t>(tokens[t] & 15) * h + i];
    const float* W = params_.data();
    const float* bias = W + h * h;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t o = 0; o < h; ++o) {
        float z = bias[o];
        for (std::size_t i = 0; i < h; ++i) z += W[o * h + i] * xs[t * h + i];
        ys[t * h + o] = std::tanh(z);
        if (y) y[t * h + o] = ys[t * h + o];
      }
    for (std::size_t i = 0; i < pad_floats(mb.shape); ++i)
      pad[i] = static_cast<float>(stage_ * 1000 + mb.mb) + static_cast<float>(i % 7);
    if (!mb.last()) return;
    float loss = 0;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < h; ++i) {
        const float d = ys[t * h + i] - target(mb, t, i);
        loss += 0.5f * d * d;
      }
    *mb.loss = loss / static_cast<float>(T * h);
  }

  void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor dyt, po::Tensor dxt,
                      std::byte* saved, std::byte* stash) {
    mb.await_saved(0);  // y (with parts; otherwise the whole unit, already there)
    pass(timing_.b);
    const float* dy = dyt.as<float>();
    float* dx = dxt.as<float>();
    const std::size_t T = static_cast<std::size_t>(mb.shape.tokens()), h = static_cast<std::size_t>(h_);
    const float* ys = reinterpret_cast<const float*>(saved) + T * h;
    float* dz = reinterpret_cast<float*>(stash);
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < h; ++i) {
        const float y = ys[t * h + i];
        const float g = dy ? dy[t * h + i] : mb.loss_scale * (y - target(mb, t, i)) / static_cast<float>(T * h);
        dz[t * h + i] = g * (1.0f - y * y);
      }
    // x and the pad, which only W reads: awaiting the last part awaits every part before it.
    if (parts_ && await_all_) mb.await_saved(static_cast<int>(saved_parts(mb.shape).size()) - 1);
    if (dx == nullptr) return;
    const float* W = params_.data();
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < h; ++i) {
        float s = 0;
        for (std::size_t o = 0; o < h; ++o) s += W[o * h + i] * dz[t * h + o];
        dx[t * h + i] = s;
      }
  }

  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    pass(timing_.w);
    const std::size_t T = static_cast<std::size_t>(mb.shape.tokens()), h = static_cast<std::size_t>(h_);
    const float* xs = reinterpret_cast<const float*>(saved);
    const float* pad = xs + 2 * T * h;
    for (std::size_t i = 0; i < pad_floats(mb.shape); ++i)
      if (pad[i] != static_cast<float>(stage_ * 1000 + mb.mb) + static_cast<float>(i % 7))
        throw std::runtime_error("saved activations of stage " + std::to_string(stage_) + " mb " +
                                 std::to_string(mb.mb) + " were corrupted");
    const float* dz = reinterpret_cast<const float*>(stash);
    float* gW = grads_.data();
    float* gb = gW + h * h;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t o = 0; o < h; ++o) {
        gb[o] += dz[t * h + o];
        for (std::size_t i = 0; i < h; ++i) gW[o * h + i] += dz[t * h + o] * xs[t * h + i];
      }
    if (stage_ != 0) return;
    const std::int32_t* tokens = mb.input<std::int32_t>("tokens");
    const float* W = params_.data();
    float* ge = gb + h;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < h; ++i) {
        float s = 0;
        for (std::size_t o = 0; o < h; ++o) s += W[o * h + i] * dz[t * h + o];
        ge[static_cast<std::size_t>(tokens[t] & 15) * h + i] += s;
      }
  }

  std::span<float> parameters() { return params_; }
  std::span<float> gradients() { return grads_; }

 private:
  const float* emb() const {
    return params_.data() + static_cast<std::size_t>(h_) * static_cast<std::size_t>(h_) + static_cast<std::size_t>(h_);
  }
  static float target(const po::Microbatch& mb, std::size_t t, std::size_t i) {
    return static_cast<float>((mb.input<std::int32_t>("targets")[t] + static_cast<int>(i)) % 5 - 2) * 0.2f;
  }
  void pass(double seconds) {
    if (failure_ != nullptr && rank_ == failure_->fail_rank && ++failure_->calls == failure_->fail_at)
      throw std::runtime_error("injected failure in pass " + std::to_string(failure_->fail_at));
    if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }

  int stage_, h_;
  bool parts_ = false, await_all_ = true;
  Timing timing_;
  Failure* failure_;
  int rank_;
  std::vector<float> params_, grads_;
};
static_assert(po::layer_for<TanhLayer, po::backend::CpuContext>);

/// The outcome of a training run on thread ranks.
struct Run {
  std::vector<float> losses;                     ///< per step
  std::vector<double> grad_norms;                ///< per step
  std::vector<std::vector<float>> params;        ///< per stage, after the last step
  std::vector<po::backend::MemoryStats> memory;  ///< per rank, of the last step
  std::vector<double> seconds;                   ///< per rank, of the last step
  std::vector<std::string> errors;               ///< per rank ("" = ok)
  std::vector<po::RankSim> traces;               ///< per rank, of the last step
  /// Per rank: the device's allocation counts (device, pinned host) once the runtime is
  /// constructed, then after each step.
  std::vector<std::vector<long long>> device_allocations, host_allocations;
  po::Program program;
};

struct Config {
  po::ScheduleSpec spec{};
  po::Shape shape{};
  po::MicrobatchShape mb{2, 3};
  int h = 8;
  int steps = 3;
  std::uint64_t seed = 7;
  Timing timing{};
  double copy_bytes_per_second = 0;
  po::Costs costs{};
  Failure* failure = nullptr;
  bool pairs = false;  ///< link ranks (r, r^1) with po::PairLink (synchronised copies)
  /// Layers declare saved_parts (TanhLayer::use_parts); RuntimeOptions::reload_parts.
  bool parts = false;
  bool reload_parts = true;
  /// The exact path: every family's run is compared with one rank's, bit for bit.
  po::Gradients gradients = po::Gradients::exact;
};

/// Deterministic tokens and targets of one step.
inline void make_batch(const Config& c, int step, std::vector<std::int32_t>& tok, std::vector<std::int32_t>& tgt) {
  const std::size_t n = static_cast<std::size_t>(c.mb.tokens()) * static_cast<std::size_t>(c.shape.m);
  tok.resize(n);
  tgt.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    tok[i] = static_cast<std::int32_t>((i * 7 + static_cast<std::size_t>(step) * 3) % 11);
    tgt[i] = static_cast<std::int32_t>((i * 5 + static_cast<std::size_t>(step)) % 13);
  }
}

/// Step `step`'s batch: tokens and targets, (m * batch, seq) each.
inline po::Batch batch_of(const Config& c, const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt) {
  const std::vector<long long> shape = {static_cast<long long>(c.shape.m) * c.mb.batch, c.mb.seq};
  po::Batch b;
  b.add("tokens", tok, shape).add("targets", tgt, shape);
  return b;
}

/// The training step of these tests, as visible calls: AdamW with warmup + cosine and a clip.
struct Trainer {
  po::WarmupCosine lr{.lr = 0.05f, .warmup_steps = 2, .total_steps = 10, .min_lr_ratio = 0.1f};
  float clip = 0.5f;
  template <class Runtime, class Optimizer>
  std::pair<po::PassStats, double> step(Runtime& rt, Optimizer& opt, const po::Batch& b, int s) const {
    rt.zero_grad();
    po::PassStats st = rt.forward_backward(b, {.step = s});
    const double norm = po::grad_norm(rt);
    opt.step(lr(s), po::clip_scale(norm, clip));
    return {std::move(st), norm};
  }
};

/// Trains c.steps steps with d thread ranks; ranks that fail leave their error in `errors`.
inline Run train(const Config& c) {
  const po::Shape sh = c.shape;
  Run run;
  run.params.resize(static_cast<std::size_t>(sh.stages()));
  run.memory.resize(static_cast<std::size_t>(sh.d));
  run.seconds.resize(static_cast<std::size_t>(sh.d));
  run.traces.resize(static_cast<std::size_t>(sh.d));
  run.losses.resize(static_cast<std::size_t>(c.steps));
  run.grad_norms.resize(static_cast<std::size_t>(c.steps));
  run.device_allocations.resize(static_cast<std::size_t>(sh.d));
  run.host_allocations.resize(static_cast<std::size_t>(sh.d));
  po::comm::ThreadsWorld world(sh.d);
  const po::Program program = po::build(c.spec, sh, c.costs);
  std::mutex mu;
  std::vector<std::unique_ptr<po::PairLink<po::backend::Cpu>>> links;
  for (int p = 0; c.pairs && 2 * p + 1 < sh.d; ++p) links.push_back(std::make_unique<po::PairLink<po::backend::Cpu>>());
  run.errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r, .copy_bytes_per_second = c.copy_bytes_per_second});
    po::comm::Threads comm(world, r);
    std::vector<TanhLayer> layers;
    for (int ch = 0; ch < sh.v; ++ch) {
      layers.emplace_back(sh.stage_of(r, ch), c.h, c.seed, c.timing, c.failure, r);
      if (c.parts) layers.back().use_parts();
    }
    po::Runtime rt(program, dev, comm, std::span<TanhLayer>(layers),
                   {.microbatch = c.mb, .gradients = c.gradients, .reload_parts = c.reload_parts});
    if (static_cast<std::size_t>(r / 2) < links.size()) rt.pair_with(*links[static_cast<std::size_t>(r / 2)]);
    po::AdamW opt(rt, {.weight_decay = 0.1f});
    auto& dev_allocs = run.device_allocations[static_cast<std::size_t>(r)];
    auto& host_allocs = run.host_allocations[static_cast<std::size_t>(r)];
    dev_allocs.push_back(dev.memory().device_allocations);
    host_allocs.push_back(dev.memory().host_allocations);
    std::vector<std::int32_t> tok, tgt;
    const Trainer trainer;
    for (int s = 0; s < c.steps; ++s) {
      make_batch(c, s, tok, tgt);
      const auto [st, norm] = trainer.step(rt, opt, batch_of(c, tok, tgt), s);
      dev_allocs.push_back(st.memory.device_allocations);
      host_allocs.push_back(st.memory.host_allocations);
      std::lock_guard lk(mu);
      if (r == 0) {
        run.losses[static_cast<std::size_t>(s)] = st.loss;
        run.grad_norms[static_cast<std::size_t>(s)] = norm;
      }
      run.memory[static_cast<std::size_t>(r)] = st.memory;
      run.seconds[static_cast<std::size_t>(r)] = st.seconds;
    }
    std::lock_guard lk(mu);
    for (int ch = 0; ch < sh.v; ++ch) {
      auto p = layers[static_cast<std::size_t>(ch)].parameters();
      run.params[static_cast<std::size_t>(sh.stage_of(r, ch))].assign(p.begin(), p.end());
    }
    run.traces[static_cast<std::size_t>(r)] = rt.trace();
    if (r == 0) run.program = rt.program();
  });
  return run;
}

/// train() with a deadline: a run that has not returned by then fails the test process
/// outright (a hang must not stall the suite).
inline Run train_within(const Config& c, double seconds) {
  auto fut = std::async(std::launch::async, [c] { return train(c); });
  if (fut.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: a training run did not finish within %.0f s (hang)\n", seconds);
    std::fflush(stderr);
    std::_Exit(3);
  }
  return fut.get();
}

}  // namespace test
