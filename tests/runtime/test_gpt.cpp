// tests/runtime: the reference GPT model: gradients against finite differences, selective
// recompute (same gradients, fewer saved bytes), pipelined training bit-identical to one rank,
// and checkpoints that load into another cut of the model by tensor names.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

namespace {

using po::gpt::GptConfig;
using po::gpt::GptStage;

struct Pass {
  std::vector<float> y, dx, grads;
  std::size_t saved = 0;
};

/// One block (a middle stage: no embedding, no head): forward, B with dy = r, W.
Pass run_block(GptStage& st, const std::vector<float>& x, const std::vector<float>& r, po::MicrobatchShape sh) {
  po::backend::CpuContext ctx;
  po::Microbatch mb;
  mb.stage = 1;
  mb.stages = 3;
  mb.shape = sh;
  mb.step = 2;
  mb.mb = 1;
  Pass p;
  p.saved = st.saved_bytes(sh);
  std::vector<std::byte> saved(st.saved_bytes(sh)), stash(st.stash_bytes(sh));
  p.y.resize(x.size());
  p.dx.resize(x.size());
  st.forward(ctx, mb, po::view(x), po::view(p.y), saved.data());
  st.backward_input(ctx, mb, po::view(r), po::view(p.dx), saved.data(), stash.data());
  for (float& g : st.gradients()) g = 0;
  st.backward_weight(ctx, mb, saved.data(), stash.data());
  p.grads.assign(st.gradients().begin(), st.gradients().end());
  return p;
}

double objective(GptStage& st, const std::vector<float>& x, const std::vector<float>& r, po::MicrobatchShape sh) {
  po::backend::CpuContext ctx;
  po::Microbatch mb;
  mb.stage = 1;
  mb.stages = 3;
  mb.shape = sh;
  mb.step = 2;
  mb.mb = 1;
  std::vector<std::byte> saved(st.saved_bytes(sh));
  std::vector<float> y(x.size());
  st.forward(ctx, mb, po::view(x), po::view(y), saved.data());
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(y[i]) * r[i];
  return s;
}

std::vector<float> noise(std::size_t n, std::uint64_t seed, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = scale * (static_cast<float>(po::ops::mix64(seed, i) >> 40) / 16777216.0f - 0.5f);
  return v;
}

/// Floats in [lo, hi] at a relative step of 6.1e-5 (about 2^-14; 1e-8 near 0): ~ 40k points
/// per decade, dense enough to meet each polynomial's worst case.
template <class F>
void sweep(float lo, float hi, F&& f) {
  for (float x = lo; x <= hi; x += std::max(std::fabs(x) * 6.1e-5f, 1e-8f)) f(x);
}

}  // namespace

TEST_CASE("math: exp_approx is within 1.5e-7 relative of exp, and exact at its edges") {
  double worst = 0;
  sweep(-87.0f, 88.0f, [&](float x) {
    const double ref = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(static_cast<double>(po::ops::exp_approx(x)) - ref) / ref);
  });
  MESSAGE("exp_approx: largest relative error ", worst);
  CHECK(worst < 1.5e-7);
  CHECK(po::ops::exp_approx(0.0f) == 1.0f);
  CHECK(po::ops::exp_approx(-100.0f) == 0.0f);
  CHECK(po::ops::exp_approx(-INFINITY) == 0.0f);
  CHECK(po::ops::exp_approx(100.0f) == INFINITY);
  CHECK(std::isnan(po::ops::exp_approx(NAN)));
}

TEST_CASE("math: tanh_approx is within 1.5e-7 absolute and 5e-7 relative of tanh; GeLU follows") {
  double worst_abs = 0, worst_rel = 0;
  sweep(-20.0f, 20.0f, [&](float x) {
    const double ref = std::tanh(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(po::ops::tanh_approx(x)) - ref);
    worst_abs = std::max(worst_abs, err);
    if (ref != 0) worst_rel = std::max(worst_rel, err / std::fabs(ref));
  });
  MESSAGE("tanh_approx: largest absolute error ", worst_abs, ", relative ", worst_rel);
  CHECK(worst_abs < 1.5e-7);
  CHECK(worst_rel < 5e-7);
  CHECK(po::ops::tanh_approx(0.0f) == 0.0f);
  CHECK(std::signbit(po::ops::tanh_approx(-0.0f)));
  CHECK(po::ops::tanh_approx(INFINITY) == 1.0f);
  CHECK(po::ops::tanh_approx(-INFINITY) == -1.0f);
  CHECK(po::ops::tanh_approx(1e30f) == 1.0f);
  CHECK(std::isnan(po::ops::tanh_approx(NAN)));
  // tanh is odd, bit for bit.
  sweep(0.0f, 20.0f, [&](float x) { REQUIRE(po::ops::tanh_approx(-x) == -po::ops::tanh_approx(x)); });
  // GeLU and its derivative against the same formulas in double with exact tanh.
  double worst_gelu = 0, worst_grad = 0;
  sweep(-12.0f, 12.0f, [&](float xf) {
    const double x = xf, c = 0.7978845608028654, a = 0.044715;
    const double t = std::tanh(c * (x + a * x * x * x));
    const double gelu = 0.5 * x * (1 + t);
    const double grad = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x);
    worst_gelu = std::max(worst_gelu, std::fabs(po::ops::gelu(xf) - gelu) / (1 + std::fabs(gelu)));
    worst_grad = std::max(worst_grad, std::fabs(po::ops::gelu_grad(xf) - grad) / (1 + std::fabs(grad)));
  });
  MESSAGE("gelu: largest error ", worst_gelu, ", gelu_grad: ", worst_grad, " (relative to 1 + |value|)");
  CHECK(worst_gelu < 1e-6);
  CHECK(worst_grad < 2e-6);
}

TEST_CASE("math: exp_approx and tanh_approx give the same bits in a vectorised loop as one at a time") {
  // The GPT runs them through GptStage's 16-wide loops and scalar tails: an element's value
  // must not depend on which of the two it went through.
  std::vector<float> x(4099);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = (static_cast<float>(po::ops::mix64(7, i) >> 40) / 16777216.0f - 0.5f) * 40.0f;
  std::vector<float> e(x.size()), t(x.size());
  for (std::size_t i = 0; i + 16 <= x.size(); i += 16) {
    for (std::size_t j = 0; j < 16; ++j) e[i + j] = po::ops::exp_approx(x[i + j]);
    for (std::size_t j = 0; j < 16; ++j) t[i + j] = po::ops::tanh_approx(x[i + j]);
  }
  for (std::size_t i = 0; i < x.size() / 16 * 16; ++i) {
    volatile float xi = x[i];  // one scalar call at a time
    REQUIRE(e[i] == po::ops::exp_approx(xi));
    REQUIRE(t[i] == po::ops::tanh_approx(xi));
  }
}

TEST_CASE("GPT block: B and W match central finite differences") {
  GptConfig cfg;
  cfg.hidden = 8;
  cfg.heads = 2;
  cfg.layers = 3;  // stage 1 of 3 holds block 1 only
  cfg.seq = 4;
  cfg.dropout = 0.2f;
  const po::MicrobatchShape sh{2, 4};
  GptStage st(cfg, 1, 3);
  REQUIRE(st.blocks() == 1);
  // Larger weights than the init's so every path matters.
  for (float& p : st.parameters()) p += noise(1, static_cast<std::uint64_t>(&p - st.parameters().data()), 0.6f)[0];
  const std::size_t n = static_cast<std::size_t>(sh.tokens()) * 8;
  std::vector<float> x = noise(n, 11, 2.0f), r = noise(n, 12, 2.0f);
  const Pass p = run_block(st, x, r, sh);
  const float eps = 1e-2f;
  int checked = 0;
  double worst = 0;
  const auto compare = [&](double analytic, double numeric) {
    const double err = std::abs(analytic - numeric) / std::max(1e-2, std::abs(analytic) + std::abs(numeric));
    worst = std::max(worst, err);
    ++checked;
  };
  for (std::size_t i = 0; i < n; i += 3) {
    const float keep = x[i];
    x[i] = keep + eps;
    const double up = objective(st, x, r, sh);
    x[i] = keep - eps;
    const double down = objective(st, x, r, sh);
    x[i] = keep;
    compare(p.dx[i], (up - down) / (2 * eps));
  }
  auto params = st.parameters();
  for (std::size_t i = 0; i < params.size(); i += 7) {
    const float keep = params[i];
    params[i] = keep + eps;
    const double up = objective(st, x, r, sh);
    params[i] = keep - eps;
    const double down = objective(st, x, r, sh);
    params[i] = keep;
    compare(p.grads[i], (up - down) / (2 * eps));
  }
  CAPTURE(checked);
  CHECK(checked > 100);
  CHECK(worst < 2e-2);
}

TEST_CASE("GPT block: selective recompute gives the same bits and saves 20bsh-equivalent instead of 34bsh") {
  GptConfig cfg;
  cfg.hidden = 32;
  cfg.heads = 4;
  cfg.layers = 3;
  cfg.seq = 16;
  cfg.dropout = 0.1f;
  const po::MicrobatchShape sh{2, 16};
  GptStage lean(cfg, 1, 3);
  cfg.recompute = false;
  GptStage full(cfg, 1, 3);
  const std::size_t n = static_cast<std::size_t>(sh.tokens()) * 32;
  const std::vector<float> x = noise(n, 5, 2.0f), r = noise(n, 6, 1.0f);
  const Pass a = run_block(lean, x, r, sh), b = run_block(full, x, r, sh);
  CHECK(std::memcmp(a.y.data(), b.y.data(), n * 4) == 0);
  CHECK(std::memcmp(a.dx.data(), b.dx.data(), n * 4) == 0);
  CHECK(std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * 4) == 0);
  // In bf16-equivalent bytes per b*s*h (a float tensor counts 2 bytes per element, as in the
  // paper's bf16 accounting; masks 1 byte): 20 with recompute, 34 without.
  const double bsh = static_cast<double>(sh.tokens()) * 32;
  const auto lb = lean.block_breakdown(sh), fb = full.block_breakdown(sh);
  CHECK(2.0 * static_cast<double>(lb.tensor_floats) / bsh + static_cast<double>(lb.mask_bytes) / bsh == 20.0);
  CHECK(2.0 * static_cast<double>(fb.tensor_floats) / bsh + static_cast<double>(fb.mask_bytes) / bsh == 34.0);
  // And the buffers the runtime allocates hold exactly that plus the per-row extras.
  CHECK(a.saved == (lb.tensor_floats + lb.extra_floats) * 4);
  CHECK(b.saved == (fb.tensor_floats + fb.extra_floats) * 4 + fb.mask_bytes);
}

namespace {

struct GptRun {
  std::vector<float> losses;
  std::vector<float> params;  // all stages, model order
  std::vector<std::string> errors;
};

/// The small GPT these tests train.
GptConfig small_gpt() { return {.hidden = 16, .heads = 2, .layers = 4, .seq = 8, .dropout = 0.1f}; }

/// Where a run saves a checkpoint (after `save_after` steps) and what it resumes from (then it
/// trains steps first_step..steps-1).
struct Checkpoints {
  std::filesystem::path save_dir{};
  int save_after = -1;
  std::filesystem::path load_dir{};
  int first_step = 0;
};

/// `steps` steps of `cfg` (the small GPT) under `spec` on thread ranks, its stages of type
/// Layer (a GptStage or a wrapper), with the buffer guard when `guard`.
template <class Layer = GptStage>
GptRun train_gpt(po::ScheduleSpec spec, po::Shape shape, int steps, bool guard = false, GptConfig cfg = small_gpt(),
                 const Checkpoints& ck = {}) {
  const po::MicrobatchShape mbs{2, 8};
  const po::Program program = po::build(spec, shape);
  const po::WarmupCosine lr{.lr = 1e-2f, .warmup_steps = 1, .total_steps = 1000, .min_lr_ratio = 0.1f};
  po::comm::ThreadsWorld world(shape.d);
  GptRun run;
  run.losses.resize(static_cast<std::size_t>(steps));
  std::vector<std::vector<float>> per_stage(static_cast<std::size_t>(shape.stages()));
  std::mutex mu;
  run.errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<Layer> layers;
    for (int c = 0; c < shape.v; ++c) layers.emplace_back(cfg, shape.stage_of(r, c), shape.stages());
    po::Runtime rt(program, dev, comm, std::span<Layer>(layers),
                   {.microbatch = mbs, .gradients = po::Gradients::exact, .guard_buffers = guard});
    po::AdamW opt(rt, {.weight_decay = 0.1f});
    const std::size_t n = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(shape.m);
    std::vector<std::int32_t> tok(n), tgt(n);
    if (!ck.load_dir.empty()) po::load_checkpoint(ck.load_dir, rt, opt, 42);
    for (int s = ck.first_step; s < steps; ++s) {
      for (std::size_t i = 0; i < n; ++i) {
        tok[i] = static_cast<std::int32_t>((i * 31 + static_cast<std::size_t>(s) * 7) % 256);
        tgt[i] = static_cast<std::int32_t>((i * 17 + 3) % 256);
      }
      po::Batch batch;
      batch.add("tokens", tok, {shape.m * mbs.batch, mbs.seq}).add("targets", tgt, {shape.m * mbs.batch, mbs.seq});
      rt.zero_grad();
      const po::PassStats st = rt.forward_backward(batch, {.step = s});
      opt.step(lr(s), po::clip_scale(po::grad_norm(rt), 0.5f));
      if (r == 0) run.losses[static_cast<std::size_t>(s)] = st.loss;
      if (s + 1 == ck.save_after) po::save_checkpoint(ck.save_dir, rt, opt, {42, 1, s + 1});
    }
    std::lock_guard lk(mu);
    for (int c = 0; c < shape.v; ++c) {
      auto p = layers[static_cast<std::size_t>(c)].parameters();
      per_stage[static_cast<std::size_t>(shape.stage_of(r, c))].assign(p.begin(), p.end());
    }
  });
  for (const auto& p : per_stage) run.params.insert(run.params.end(), p.begin(), p.end());
  return run;
}

/// A GPT stage that writes one byte past one of its buffers on stage 1: in forward past its
/// saved_bytes (Where 0), in backward_input past its stash_bytes (1), in backward_weight 10
/// bytes past its saved_bytes (2).
template <int Where>
struct Overrun : GptStage {
  using GptStage::GptStage;
  void forward(po::backend::CpuContext& ctx, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y,
               std::byte* saved) {
    GptStage::forward(ctx, mb, x, y, saved);
    if (Where == 0 && mb.stage == 1) saved[saved_bytes(mb.shape)] = std::byte{1};
  }
  void backward_input(po::backend::CpuContext& ctx, const po::Microbatch& mb, po::ConstTensor dy, po::Tensor dx,
                      std::byte* saved, std::byte* stash) {
    GptStage::backward_input(ctx, mb, dy, dx, saved, stash);
    if (Where == 1 && mb.stage == 1) stash[stash_bytes(mb.shape)] = std::byte{1};
  }
  void backward_weight(po::backend::CpuContext& ctx, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    GptStage::backward_weight(ctx, mb, saved, stash);
    if (Where == 2 && mb.stage == 1) saved[saved_bytes(mb.shape) + 10] = std::byte{1};
  }
};

}  // namespace

TEST_CASE("GPT: the buffer guard changes nothing for a correct layer and names one byte written past a buffer") {
  const po::ScheduleSpec spec{po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all};
  const po::Shape shape{2, 2, 4};
  const GptRun plain = train_gpt(spec, shape, 2), guarded = train_gpt(spec, shape, 2, true);
  for (const auto& e : guarded.errors) REQUIRE(e == "");
  CHECK(std::memcmp(plain.losses.data(), guarded.losses.data(), 2 * sizeof(float)) == 0);
  REQUIRE(plain.params.size() == guarded.params.size());
  CHECK(std::memcmp(plain.params.data(), guarded.params.data(), plain.params.size() * sizeof(float)) == 0);
  const po::MicrobatchShape mbs{2, 8};
  const GptStage probe(small_gpt(), 1, 4);
  const std::string saved = std::to_string(probe.saved_bytes(mbs)), stash = std::to_string(probe.stash_bytes(mbs));
  const std::string e0 = train_gpt<Overrun<0>>(spec, shape, 1, true).errors[1];
  CHECK_MESSAGE(e0.find("F(stage 1, mb 0): the stage's forward wrote past its saved_bytes() = " + saved +
                        " bytes (byte " + saved + " of the buffer changed") != std::string::npos,
                e0);
  const std::string e1 = train_gpt<Overrun<1>>(spec, shape, 1, true).errors[1];
  CHECK_MESSAGE(e1.find("(stage 1, mb 0): the stage's backward_input wrote past its stash_bytes() = " + stash +
                        " bytes (byte " + stash + " of") != std::string::npos,
                e1);
  const std::string e2 = train_gpt<Overrun<2>>(spec, shape, 1, true).errors[1];
  CHECK_MESSAGE(e2.find("(stage 1, mb 0): the stage's backward_weight wrote past its saved_bytes() = " + saved +
                        " bytes (byte " + std::to_string(probe.saved_bytes(mbs) + 10) + " of") != std::string::npos,
                e2);
}

TEST_CASE("GPT: pipelined training is bit-identical to one rank holding the whole model") {
  using GK = po::GroupSpec::Kind;
  const GptRun ref = train_gpt({po::Family::grouped, {GK::full, 0}, po::offload::none}, {1, 1, 4}, 3);
  for (const auto& e : ref.errors) REQUIRE(e == "");
  CHECK(ref.losses[0] > ref.losses[2]);
  const std::vector<std::pair<po::ScheduleSpec, po::Shape>> runs = {
      {{po::Family::grouped, {GK::uniform, 1}, po::offload::all}, {2, 2, 4}},
      {{po::Family::interleaved_1f1b, {}, po::offload::none}, {2, 2, 4}},
      {{po::Family::one_f1b, {}, po::offload::none}, {4, 1, 4}},
      {{po::Family::grouped, {GK::half, 0}, po::offload::half}, {3, 2, 4}},  // 6 stages over 4 blocks: some hold none
  };
  for (const auto& [spec, shape] : runs) {
    CAPTURE(shape.d);
    CAPTURE(shape.v);
    const GptRun run = train_gpt(spec, shape, 3);
    for (const auto& e : run.errors) REQUIRE(e == "");
    CHECK(std::memcmp(run.losses.data(), ref.losses.data(), 3 * sizeof(float)) == 0);
    REQUIRE(run.params.size() == ref.params.size());
    CHECK(std::memcmp(run.params.data(), ref.params.data(), ref.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE(
    "GPT: a checkpoint loads into another cut of the model by tensor names, bitwise; a mismatch names the tensor") {
  using GK = po::GroupSpec::Kind;
  const po::ScheduleSpec gis{po::Family::grouped, {GK::full, 0}, po::offload::none},
      po_f{po::Family::grouped, {GK::uniform, 1}, po::offload::all};
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_gpt_cut_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  // Uninterrupted, 4 stages: the exact path trains any cut to the same bits.
  const GptRun whole = train_gpt(gis, {2, 2, 4}, 4);
  for (const auto& e : whole.errors) REQUIRE(e == "");
  // Saved after 2 steps by 8 stages (4 blocks: some stages hold none), resumed by 4 stages, by an
  // uneven cut of 4 and by one rank of 3 stages.
  REQUIRE(train_gpt(po_f, {4, 2, 4}, 2, false, small_gpt(), {.save_dir = dir, .save_after = 2}).errors ==
          std::vector<std::string>(4));
  GptConfig uneven = small_gpt();
  uneven.stage_blocks = {0, 3, 1, 0};
  for (const auto& [cfg, shape] : {std::pair{small_gpt(), po::Shape{2, 2, 4}}, std::pair{uneven, po::Shape{2, 2, 4}},
                                   std::pair{small_gpt(), po::Shape{1, 3, 4}}}) {
    CAPTURE(shape.stages());
    CAPTURE(cfg.stage_blocks.size());
    const GptRun resumed = train_gpt(gis, shape, 4, false, cfg, {.load_dir = dir, .first_step = 2});
    for (const auto& e : resumed.errors) REQUIRE(e == "");
    CHECK(std::memcmp(resumed.losses.data() + 2, whole.losses.data() + 2, 2 * sizeof(float)) == 0);
    REQUIRE(resumed.params.size() == whole.params.size());
    CHECK(std::memcmp(resumed.params.data(), whole.params.data(), whole.params.size() * sizeof(float)) == 0);
  }
  // A model with a block more: the tensor the checkpoint lacks is named, on every rank.
  GptConfig deeper = small_gpt();
  deeper.layers = 5;
  const GptRun missing = train_gpt(gis, {2, 2, 4}, 4, false, deeper, {.load_dir = dir, .first_step = 2});
  for (const std::string& e : missing.errors)
    CHECK_MESSAGE(e.find("(8 stages) has no tensor 'blocks.4.") != std::string::npos, e);
  // A wider one: the first tensor of another shape is named with both shapes.
  GptConfig wider = small_gpt();
  wider.hidden = 24;
  const GptRun shapes = train_gpt(gis, {2, 2, 4}, 4, false, wider, {.load_dir = dir, .first_step = 2});
  CHECK_MESSAGE(shapes.errors[0].find("tensor 'wte' has shape [256, 16] in ") != std::string::npos, shapes.errors[0]);
  CHECK_MESSAGE(shapes.errors[0].find("; stage 0 of this run has [256, 24]") != std::string::npos, shapes.errors[0]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("GPT: the stage names itself in the runtime's messages (not a wrapper's C++ type name)") {
  const po::gpt::GptConfig cfg{.hidden = 16, .heads = 2, .layers = 2, .seq = 8};
  struct Wrapped : po::gpt::GptStage {  // as train_gpt's fault-injecting stage
    using GptStage::GptStage;
  };
  Wrapped w(cfg, 0, 2);
  CHECK(po::StageRef<po::backend::CpuContext>(w).name() == "gpt::GptStage");
}
