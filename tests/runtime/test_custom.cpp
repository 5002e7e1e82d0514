// tests/runtime/test_custom.cpp: the runtime with a model that is not a GPT, the
// sample's heterogeneous stages (samples/custom_model.hpp: InputProjection, ResidualStage,
// RegressionHead; boundaries of different widths) on float inputs: every family is
// bit-identical to one rank, gradient accumulation equals one large step, evaluate equals the
// forward passes of a step, failures end every rank within seconds, parameter groups, SGD,
// and a checkpoint round trip across schedules and rank counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <pipeoffload/runtime/checkpoint.hpp>

#include "custom_model.hpp"

namespace {

using Runtime = po::Runtime<po::backend::Cpu, po::comm::Threads>;
using World = po::comm::ThreadsWorld;
using po::Family;
using GK = po::GroupSpec::Kind;
namespace off = po::offload;

// Small enough that the whole file runs in seconds; hidden 8 makes the even middle stages 6 wide.
const custom::Config model{.features = 5, .hidden = 8, .blocks = 2, .seed = 3};
constexpr int rows = 3;  // rows per microbatch
// The exact path: every bit-identity below (schedules, rank counts, replicas, accumulation,
// checkpoints) holds on it; the standard path's own properties are tested at the end.
const po::RuntimeOptions options{.microbatch = {rows, 1}, .gradients = po::Gradients::exact};
constexpr std::uint64_t config_hash = 0xC0FFEE;

const custom::Dataset& data() {
  static const custom::Dataset d(model.features, 600, 48);
  return d;
}

/// A custom-model stage whose working parameters are bfloat16 (layer.hpp's mixed-precision
/// stage): the optimizer keeps their fp32 master; the passes compute with the wrapped stage's
/// fp32 buffer, set from the bfloat16 values before each pass.
template <class L>
struct Bf16 {
  L inner;
  std::vector<std::uint16_t> bits;
  explicit Bf16(L l) : inner(std::move(l)), bits(inner.parameters().size()) {
    for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = po::bf16_bits(inner.parameters()[i]);
  }
  void widen() {
    const std::span<float> p = inner.parameters();
    for (std::size_t i = 0; i < bits.size(); ++i) p[i] = po::bf16_value(bits[i]);
  }
  po::Boundary input_boundary(po::MicrobatchShape s) const { return inner.input_boundary(s); }
  po::Boundary output_boundary(po::MicrobatchShape s) const { return inner.output_boundary(s); }
  std::size_t saved_bytes(po::MicrobatchShape s) const { return inner.saved_bytes(s); }
  std::size_t stash_bytes(po::MicrobatchShape s) const { return inner.stash_bytes(s); }
  std::vector<po::InputSpec> inputs(po::MicrobatchShape s) const
    requires po::detail::declares_inputs<L>
  {
    return inner.inputs(s);
  }
  std::vector<std::size_t> norm_groups() const { return inner.norm_groups(); }
  std::vector<po::ParamInfo> parameter_info() const { return inner.parameter_info(); }
  std::string name() const { return "bf16 " + inner.name(); }
  void forward(po::backend::CpuContext& c, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y,
               std::byte* saved) {
    widen();
    inner.forward(c, mb, x, y, saved);
  }
  void backward_input(po::backend::CpuContext& c, const po::Microbatch& mb, po::ConstTensor dy, po::Tensor dx,
                      std::byte* saved, std::byte* stash) {
    widen();
    inner.backward_input(c, mb, dy, dx, saved, stash);
  }
  void backward_weight(po::backend::CpuContext& c, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    widen();
    inner.backward_weight(c, mb, saved, stash);
  }
  po::Tensor parameters() { return {reinterpret_cast<std::byte*>(bits.data()), bits.size(), po::DType::bfloat16}; }
  std::span<float> gradients() { return inner.gradients(); }
};
using Bf16Stage =
    std::variant<Bf16<custom::InputProjection>, Bf16<custom::ResidualStage>, Bf16<custom::RegressionHead>>;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Each rank's error ("" when it returned) and wall time.
struct Ranks {
  std::vector<std::string> errors;
  std::vector<double> seconds;
};

/// Runs fn(rank, world) on d thread ranks (po::run_thread_ranks) with a deadline: a run that
/// has not returned by then ends the test process (a hang must fail, not stall the suite).
/// With W = comm::ThreadsGrid, dp replicas of d ranks: fn(global rank, grid).
template <class W = World, class F>
Ranks run_ranks(int d, F fn, double deadline = 120, int dp = 1) {
  auto fut = std::async(std::launch::async, [d, dp, fn]() mutable {
    std::unique_ptr<W> owned;
    if constexpr (std::is_same_v<W, World>)
      owned = std::make_unique<W>(d);
    else
      owned = std::make_unique<W>(dp, d);
    W& world = *owned;
    Ranks out;
    out.seconds.assign(static_cast<std::size_t>(world.size()), 0.0);
    out.errors = po::run_thread_ranks(world, [&](int r) {
      // Timed on the way out, normal or not.
      struct Clock {
        double& out;
        std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
        ~Clock() { out = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
      } clock{out.seconds[static_cast<std::size_t>(r)]};
      fn(r, world);
    });
    return out;
  });
  if (fut.wait_for(std::chrono::duration<double>(deadline)) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: thread ranks did not finish within %.0f s (hang)\n", deadline);
    std::fflush(stderr);
    std::_Exit(3);
  }
  return fut.get();
}

enum class Optim { adamw, sgd };

struct Case {
  po::Program program;
  int steps = 3;
  int parts = 1;  ///< forward_backward calls per optimizer step (accumulation)
  Optim optim = Optim::adamw;
  double copy_bytes_per_second = 0;  ///< paced copy engine (0: memcpy speed)
  std::filesystem::path save_dir{};  ///< save_checkpoint after `save_after` steps
  int save_after = -1;
  std::filesystem::path load_dir{};  ///< load_checkpoint, then train steps first_step..steps-1
  int first_step = 0;
  int dp = 1;    ///< data-parallel replicas (each runs program.shape.m microbatches per call)
  int zero = 0;  ///< ZeRO stage of the optimizer
  po::Gradients gradients = po::Gradients::exact;    ///< RuntimeOptions::gradients
  std::size_t reduce_bucket = std::size_t{1} << 20;  ///< RuntimeOptions::reduce_bucket
  po::DType reduce_dtype = po::DType::float32;       ///< RuntimeOptions::reduce_dtype
  bool overlap_gather = false;                       ///< AdamWOptions::overlap_gather (traffic is not counted)
  bool bf16 = false;  ///< bfloat16 working parameters (Bf16): the optimizer keeps the fp32 master
  std::size_t upload_staging = po::backend::default_upload_staging;  ///< Cpu::Options::upload_staging_bytes
};

struct Run {
  std::vector<std::vector<float>> losses;     ///< per step: every microbatch's loss, all parts in order
  std::vector<double> norms;                  ///< per step
  std::vector<std::vector<float>> params;     ///< per stage, after the last step
  std::vector<po::RankSim> traces;            ///< per rank, of the last forward_backward
  std::vector<std::string> errors;            ///< per rank
  std::vector<std::uint64_t> traffic;         ///< per global rank: replica-collective bytes sent in the last step
  std::vector<std::size_t> state_memory;      ///< per global rank: device state bytes after construction
  std::vector<std::size_t> optimizer_memory;  ///< per global rank: optimizer bytes after construction
  std::vector<std::size_t> fixed_state;       ///< per global rank: the step inputs', losses' and flags' bytes
  std::vector<std::vector<std::size_t>> chunk_params;  ///< per global rank: parameters of each chunk
  std::vector<std::vector<long long>> waits;           ///< per global rank, per step: the host's waits (host_waits)
  std::vector<std::size_t> inputs;                     ///< per global rank: the step inputs it uploads
};

const po::ParamGroup no_decay{"no decay", [](const po::ParamInfo& p) { return p.shape.size() < 2; }, 1.0f, 0.0f};
const po::WarmupCosine lr{.lr = 1e-2f, .warmup_steps = 2, .total_steps = 10, .min_lr_ratio = 0.1f};

/// Trains the sample model with c.program on d thread ranks (the visible training step), or
/// on dp replicas of them: replica j's call `part` of a step takes the global batch's
/// microbatches (j * parts + part) * m .. + m-1, and a step's losses are listed in that order.
Run train(const Case& c) {
  const po::Shape sh = c.program.shape;
  const std::size_t part_rows = static_cast<std::size_t>(sh.m) * rows, m = static_cast<std::size_t>(sh.m);
  const std::size_t step_rows = part_rows * static_cast<std::size_t>(c.parts * c.dp);
  Run run;
  run.losses.resize(static_cast<std::size_t>(c.steps));
  run.norms.resize(static_cast<std::size_t>(c.steps));
  run.params.resize(static_cast<std::size_t>(sh.stages()));
  run.traces.resize(static_cast<std::size_t>(sh.d));
  const std::size_t ranks = static_cast<std::size_t>(sh.d * c.dp);
  run.traffic.resize(ranks);
  run.state_memory.resize(ranks);
  run.optimizer_memory.resize(ranks);
  run.chunk_params.resize(ranks);
  run.fixed_state.resize(ranks);
  run.waits.assign(ranks, std::vector<long long>(static_cast<std::size_t>(c.steps), -1));
  run.inputs.resize(ranks);
  po::RuntimeOptions rt_options = options;
  rt_options.gradients = c.gradients;
  rt_options.reduce_bucket = c.reduce_bucket;
  rt_options.reduce_dtype = c.reduce_dtype;
  std::mutex mu;
  const auto rank = [&](int g, po::comm::Threads& comm, po::comm::Threads* replicas) {
    const int r = g % sh.d, j = g / sh.d;
    // Sums of squares held back until a wait, as on a GPU: the norm is NaN if it reads early.
    po::backend::Cpu dev({.rank = g,
                          .copy_bytes_per_second = c.copy_bytes_per_second,
                          .defer_results = true,
                          .upload_staging_bytes = c.upload_staging});
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, sh, r);
    std::vector<Bf16Stage> narrow;
    if (c.bf16)
      for (custom::Stage& st : mine)
        std::visit([&](auto& l) { narrow.emplace_back(Bf16<std::remove_cvref_t<decltype(l)>>(std::move(l))); }, st);
    std::vector<custom::StageRef> stages = custom::refs(mine);
    if (c.bf16) {
      stages.clear();
      for (Bf16Stage& st : narrow) stages.push_back(std::visit([](auto& l) { return custom::StageRef(l); }, st));
    }
    std::optional<Runtime> made;
    if (replicas != nullptr)
      made.emplace(c.program, dev, comm, *replicas, std::span<const custom::StageRef>(stages), rt_options);
    else
      made.emplace(c.program, dev, comm, std::span<const custom::StageRef>(stages), rt_options);
    Runtime& rt = *made;
    const auto loop = [&](auto& opt) {
      {
        std::lock_guard lk(mu);
        run.state_memory[static_cast<std::size_t>(g)] = dev.memory().in(po::backend::Memory::state);
        run.optimizer_memory[static_cast<std::size_t>(g)] = dev.memory().in(po::backend::Memory::optimizer);
        for (const custom::StageRef& st : stages)
          run.chunk_params[static_cast<std::size_t>(g)].push_back(st.parameter_count());
        // The step inputs (each name once), a loss per microbatch, a flag per compute op, and
        // the memory plan's region (units, stashes and boundary tensors at their offsets).
        std::vector<std::string> names;
        std::size_t fixed = m * sizeof(float) + c.program.ranks[static_cast<std::size_t>(r)].compute.size() * 4 +
                            rt.buffer_region_bytes();
        for (const custom::StageRef& st : stages)
          for (const po::InputSpec& in : st.inputs(rt_options.microbatch))
            if (std::find(names.begin(), names.end(), in.name) == names.end()) {
              names.push_back(in.name);
              fixed += m * in.elements * po::dtype_size(in.dtype);
            }
        run.fixed_state[static_cast<std::size_t>(g)] = fixed;
        run.inputs[static_cast<std::size_t>(g)] = names.size();
      }
      if (!c.load_dir.empty()) po::load_checkpoint(c.load_dir, rt, opt, config_hash);
      for (int step = c.first_step; step < c.steps; ++step) {
        std::vector<float> losses(m * static_cast<std::size_t>(c.parts * c.dp));
        if (replicas != nullptr && !c.overlap_gather) replicas->reset_traffic();
        const long long waits = dev.host_waits();
        rt.zero_grad();
        for (int part = 0; part < c.parts; ++part) {
          const std::size_t first =
              static_cast<std::size_t>(step) * step_rows + static_cast<std::size_t>(j * c.parts + part) * part_rows;
          const auto slice = data().train(first, part_rows);
          const po::PassStats fb = rt.forward_backward(slice.batch(), {.step = step, .part = part, .parts = c.parts});
          for (std::size_t k = 0; k < fb.losses.size(); ++k)  // replica-major within the call
            losses[((k / m) * static_cast<std::size_t>(c.parts) + static_cast<std::size_t>(part)) * m + k % m] =
                fb.losses[k];
        }
        const double norm = po::grad_norm(rt);
        opt.step(lr(step), po::clip_scale(norm, 0.5f));
        run.waits[static_cast<std::size_t>(g)][static_cast<std::size_t>(step)] = dev.host_waits() - waits;
        if (replicas != nullptr && !c.overlap_gather) {
          std::lock_guard lk(mu);
          run.traffic[static_cast<std::size_t>(g)] = replicas->traffic().total();
        }
        if (g == 0) {
          std::lock_guard lk(mu);
          run.losses[static_cast<std::size_t>(step)] = losses;
          run.norms[static_cast<std::size_t>(step)] = norm;
        }
        if (step + 1 == c.save_after) po::save_checkpoint(c.save_dir, rt, opt, {config_hash, 1, step + 1});
      }
    };
    if (c.optim == Optim::adamw) {
      po::AdamW opt(rt,
                    {.weight_decay = 0.1f, .groups = {no_decay}, .zero = c.zero, .overlap_gather = c.overlap_gather});
      loop(opt);
    } else {
      po::Sgd opt(rt, {.momentum = 0.9f, .nesterov = true, .zero = c.zero, .overlap_gather = c.overlap_gather});
      loop(opt);
    }
    if (j != 0) return;
    std::lock_guard lk(mu);
    for (int ch = 0; ch < sh.v; ++ch)
      run.params[static_cast<std::size_t>(sh.stage_of(r, ch))] = rt.download_parameters(ch);
    run.traces[static_cast<std::size_t>(r)] = rt.trace();
  };
  const Ranks rk = c.dp == 1 ? run_ranks(sh.d,
                                         [&](int r, World& world) {
                                           po::comm::Threads comm(world, r);
                                           rank(r, comm, nullptr);
                                         })
                             : run_ranks<po::comm::ThreadsGrid>(
                                   sh.d,
                                   [&](int g, po::comm::ThreadsGrid& grid) {
                                     po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
                                     rank(g, comm, &replicas);
                                   },
                                   120, c.dp);
  run.errors = rk.errors;
  return run;
}

/// The one-rank reference of a shape: the same S stages and m, all on rank 0, in GIS order.
po::Program one_rank(const po::Shape& sh) { return po::GIS::build({1, sh.stages(), sh.m}); }

void require_ok(const Run& run) {
  for (std::size_t r = 0; r < run.errors.size(); ++r)
    REQUIRE_MESSAGE(run.errors[r].empty(), "rank " << r << ": " << run.errors[r]);
}

/// Bitwise equality of two runs' losses, gradient norms and parameters, over steps [from, steps).
void check_same(const Run& a, const Run& b, int from = 0) {
  require_ok(a);
  require_ok(b);
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t s = static_cast<std::size_t>(from); s < a.losses.size(); ++s) {
    INFO("step " << s);
    REQUIRE(!a.losses[s].empty());
    for (float x : a.losses[s]) CHECK(std::isfinite(x));
    CHECK(same_bits(a.losses[s], b.losses[s]));
    CHECK(same_bits(a.norms[s], b.norms[s]));
  }
  REQUIRE(a.params.size() == b.params.size());
  for (std::size_t s = 0; s < a.params.size(); ++s) {
    INFO("stage " << s);
    CHECK(!a.params[s].empty());
    CHECK(same_bits(a.params[s], b.params[s]));
  }
}

// Stages that go wrong on purpose (the runtime sees their own type through StageRef).

/// Writes NaN as the loss of microbatch 2 in step 0.
struct NanLossHead : custom::RegressionHead {
  using RegressionHead::RegressionHead;
  void forward(po::backend::CpuContext& ctx, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y,
               std::byte* saved) {
    RegressionHead::forward(ctx, mb, x, y, saved);
    if (mb.step == 0 && mb.mb == 2) *mb.loss = std::numeric_limits<float>::quiet_NaN();
  }
};

/// Writes NaN into its output activation for microbatch 1 in step 0 (the stages after it
/// then see it too: the runtime must name this one).
struct NanResidual : custom::ResidualStage {
  using ResidualStage::ResidualStage;
  void forward(po::backend::CpuContext& ctx, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y,
               std::byte* saved) {
    ResidualStage::forward(ctx, mb, x, y, saved);
    if (mb.step == 0 && mb.mb == 1) y.as<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  }
};

/// Forgets its weight in parameter_info(): a gap the optimizers must refuse.
struct GapHead : custom::RegressionHead {
  using RegressionHead::RegressionHead;
  std::vector<po::ParamInfo> parameter_info() const {
    std::vector<po::ParamInfo> all = RegressionHead::parameter_info();
    return {all.back()};
  }
};

/// backend::Cpu whose AdamW update throws on rank 1.
class ThrowingCpu : public po::backend::Cpu {
 public:
  explicit ThrowingCpu(Options o) : Cpu(o), rank_(o.rank) {}
  void adamw(std::span<const po::update::Segment> segments, const po::update::AdamWStep& step) {
    if (rank_ == 1) throw std::runtime_error("injected optimizer failure on rank 1");
    Cpu::adamw(segments, step);
  }

 private:
  int rank_;
};

/// What one rank saw in a run that meets a NaN in step 0 and goes on.
struct NanOutcome {
  std::string message;  // the nonfinite_error's text
  int good_steps = 0;   // steps after it that trained normally
};

/// Three steps on 4 ranks (v = 2) with `replace(r, stages)` swapping in a faulty stage;
/// a po::nonfinite_error is caught, and the rank goes on with zero_grad() and the next step.
template <class Replace>
std::pair<Ranks, std::vector<NanOutcome>> run_nan(Replace replace) {
  const po::Program program = po::PO_F::build({4, 2, 8});
  const po::Shape sh = program.shape;
  std::vector<NanOutcome> out(4);
  const Ranks rk = run_ranks(4, [&](int r, World& world) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, sh, r);
    std::vector<custom::StageRef> stages = custom::refs(mine);
    std::optional<NanLossHead> head;
    std::optional<NanResidual> residual;
    replace(r, stages, head, residual);
    Runtime rt(program, dev, comm, stages, options);
    po::AdamW opt(rt, {.weight_decay = 0.1f, .groups = {no_decay}});
    NanOutcome& o = out[static_cast<std::size_t>(r)];
    for (int step = 0; step < 3; ++step) {
      const auto slice = data().train(static_cast<std::size_t>(step) * 8 * rows, 8 * rows);
      rt.zero_grad();
      po::PassStats fb;
      try {
        fb = rt.forward_backward(slice.batch(), {.step = step});
      } catch (const po::nonfinite_error& e) {
        o.message = e.what();
        continue;
      }
      bool finite = true;
      for (float x : fb.losses) finite = finite && std::isfinite(x);
      opt.step(lr(step), po::clip_scale(po::grad_norm(rt), 0.5f));
      if (finite) ++o.good_steps;
    }
  });
  return {rk, out};
}

}  // namespace

TEST_CASE(
    "custom model: each producer's output boundary equals its consumer's input, and the widths differ between stages") {
  for (int S = 3; S <= 9; ++S) {
    std::vector<custom::Stage> all = custom::make_stages(model, S);
    const std::vector<custom::StageRef> refs = custom::refs(all);
    CHECK(refs.front().name() == "InputProjection");
    CHECK(refs.back().name() == "RegressionHead");
    std::vector<std::size_t> widths;
    for (int s = 0; s + 1 < S; ++s) {
      INFO("S = " << S << ", stage " << s);
      const po::Boundary out = refs[static_cast<std::size_t>(s)].output_boundary(options.microbatch);
      CHECK(out == refs[static_cast<std::size_t>(s + 1)].input_boundary(options.microbatch));
      widths.push_back(out.elements);
      if (s > 0) CHECK(refs[static_cast<std::size_t>(s)].name() == "ResidualStage");
    }
    if (S >= 4) CHECK(std::adjacent_find(widths.begin(), widths.end(), std::not_equal_to<>()) != widths.end());
  }
  try {
    custom::make_stages(model, 2);
    FAIL("S = 2 was accepted");
  } catch (const po::shape_error& e) {
    CHECK(
        std::string(e.what()) ==
        "custom::make_stage: the model needs S >= 3 stages (an InputProjection, at least one ResidualStage, a RegressionHead), got S = 2");
  }
}

TEST_CASE("custom model: names, shapes and norm groups of every parameter tensor cover the stage exactly") {
  std::vector<custom::Stage> all = custom::make_stages(model, 4);
  const std::vector<custom::StageRef> refs = custom::refs(all);
  const auto names = [&](int s) {
    std::vector<std::string> n;
    for (const po::ParamInfo& p : refs[static_cast<std::size_t>(s)].parameter_info()) n.push_back(p.name);
    return n;
  };
  CHECK(names(0) == std::vector<std::string>{"input.weight", "input.bias"});
  CHECK(names(1) == std::vector<std::string>{"blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.0.fc2.weight",
                                             "blocks.0.fc2.bias", "blocks.1.fc1.weight", "blocks.1.fc1.bias",
                                             "blocks.1.fc2.weight", "blocks.1.fc2.bias"});
  CHECK(names(2).front() == "adapt.2.weight");
  CHECK(refs[2].parameter_info().front().shape == std::vector<long long>{8, 6});
  CHECK(refs[2].parameter_info()[2].shape == std::vector<long long>{6, 24});  // blocks.2.fc1.weight {w, 4w}
  CHECK(names(3) == std::vector<std::string>{"head.weight", "head.bias"});
  for (int s = 0; s < 4; ++s) {
    const custom::StageRef& l = refs[static_cast<std::size_t>(s)];
    std::size_t at = 0;
    for (const po::ParamInfo& p : l.parameter_info()) {
      CHECK(p.offset == at);
      at += p.count();
    }
    CHECK(at == l.parameters().size());
    std::size_t grouped = 0;
    for (std::size_t g : l.norm_groups()) grouped += g;
    CHECK(grouped == l.parameters().size());
  }
  CHECK(refs[1].norm_groups().size() == 2);  // one per block
  CHECK(refs[2].norm_groups().size() == 3);  // the projection and two blocks
}

TEST_CASE("custom model: B and W compute the gradient of the mean loss (central finite differences through evaluate)") {
  const po::Program program = po::GIS::build({1, 4, 2});
  std::string failures;
  const Ranks rk = run_ranks(1, [&](int, World& world) {
    po::backend::Cpu dev;
    po::comm::Threads comm(world, 0);
    std::vector<custom::Stage> all = custom::make_stages(model, 4);  // stage 2 has a projection 8 -> 6
    const std::vector<custom::StageRef> stages = custom::refs(all);
    Runtime rt(program, dev, comm, stages, options);
    const auto slice = data().train(0, 2 * rows);
    const po::Batch batch = slice.batch();
    rt.zero_grad();
    rt.forward_backward(batch, {.step = 0});
    const double eps = 1e-2;
    for (int c = 0; c < 4; ++c) {
      const std::vector<float> grad = rt.download_gradients(c), p0 = rt.download_parameters(c);
      // The first, middle and last element of every tensor.
      for (const po::ParamInfo& t : stages[static_cast<std::size_t>(c)].parameter_info())
        for (std::size_t i : {t.offset, t.offset + t.count() / 2, t.offset + t.count() - 1}) {
          std::vector<float> p = p0;
          p[i] = static_cast<float>(p0[i] + eps);
          rt.upload_parameters(c, p);
          const double up = rt.evaluate(batch).loss;
          p[i] = static_cast<float>(p0[i] - eps);
          rt.upload_parameters(c, p);
          const double down = rt.evaluate(batch).loss;
          rt.upload_parameters(c, p0);
          const double fd = (up - down) / (2 * eps), g = grad[i];
          if (std::fabs(fd - g) > 2e-4 + 2e-2 * std::max(std::fabs(fd), std::fabs(g)))
            failures += t.name + "[" + std::to_string(i - t.offset) + "]: gradient " + std::to_string(g) +
                        ", finite difference " + std::to_string(fd) + "\n";
        }
    }
  });
  CHECK(rk.errors[0] == "");
  CHECK(failures == "");
}

TEST_CASE(
    "every family trains the heterogeneous model on float inputs bit-identically to one rank (AdamW, 3 steps: losses, norms, parameters)") {
  struct Row {
    const char* name;
    po::ScheduleSpec spec;
    po::Shape shape;
    double copy_bytes_per_second = 0;
  };
  const std::vector<Row> rows_ = {
      {"1f1b", po::parse_schedule("1f1b"), {4, 1, 5}},
      {"1f1b-i", po::parse_schedule("1f1b-i"), {2, 2, 4}},
      {"1f1b-i", po::parse_schedule("1f1b-i"), {3, 2, 6}},
      {"gis", po::parse_schedule("gis"), {4, 2, 7}},
      {"gis-g", po::parse_schedule("gis-g", 3), {4, 2, 8}},
      {"gis-h", po::parse_schedule("gis-h"), {3, 2, 5}},
      {"po", po::parse_schedule("po"), {4, 2, 8}},
      {"po-h", po::parse_schedule("po-h"), {2, 3, 6}},
      {"po-f", po::parse_schedule("po-f"), {4, 2, 8}},
      {"po-f", po::parse_schedule("po-f"), {3, 2, 4}},
      {"po-f with a paced copy engine", po::parse_schedule("po-f"), {4, 2, 8}, 20e6},
  };
  std::map<std::pair<int, int>, Run> refs;  // by (S, m)
  for (const Row& row : rows_) {
    const po::Shape& sh = row.shape;
    const std::string name = row.name;
    CAPTURE(name);
    CAPTURE(sh.d);
    CAPTURE(sh.v);
    CAPTURE(sh.m);
    const auto key = std::make_pair(sh.stages(), sh.m);
    if (!refs.count(key)) refs[key] = train({.program = one_rank(sh)});
    const Run run = train({.program = po::build(row.spec, sh), .copy_bytes_per_second = row.copy_bytes_per_second});
    check_same(run, refs[key]);
    if (row.copy_bytes_per_second > 0) {
      // The copies were slow enough to matter, and compute went on while they ran.
      bool overlap = false;
      for (const po::RankSim& t : run.traces)
        for (std::size_t y = 0; y < t.copy_start.size(); ++y)
          for (std::size_t x = 0; x < t.compute_start.size(); ++x)
            overlap = overlap || (t.compute_start[x] < t.copy_end[y] && t.copy_start[y] < t.compute_end[x]);
      CHECK(overlap);
    }
  }
}

TEST_CASE("a Program from po::build at run time and one from the schedule type train the custom model alike, bitwise") {
  const po::Shape sh{4, 2, 8};
  check_same(train({.program = po::PO_F::build(sh)}),
             train({.program = po::build(po::parse_schedule("po-f"), sh, po::Costs{})}));
}

TEST_CASE(
    "gradient accumulation: 3 forward_backward calls on m microbatches, then one step, equal one step on 3m microbatches, bitwise") {
  for (const std::string name : {"gis-h", "po-f"}) {
    CAPTURE(name);
    const Run parts = train({.program = po::build(po::parse_schedule(name), {4, 2, 4}), .parts = 3});
    const Run whole = train({.program = po::build(po::parse_schedule(name), {4, 2, 12})});
    check_same(parts, whole);
    REQUIRE(parts.losses[0].size() == 12);
  }
}

TEST_CASE(
    "evaluate returns the losses of a training step's forward passes, bitwise, and changes no gradient or parameter (4 ranks, PO-F)") {
  const po::Program program = po::PO_F::build({4, 2, 8});
  const po::Shape sh = program.shape;
  std::vector<std::string> failures(4);
  const Ranks rk = run_ranks(4, [&](int r, World& world) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, sh, r);
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    Runtime rt(program, dev, comm, stages, options);
    std::string& fail = failures[static_cast<std::size_t>(r)];
    const auto snapshot = [&](bool grads) {
      std::vector<std::vector<float>> s;
      for (int c = 0; c < sh.v; ++c) s.push_back(grads ? rt.download_gradients(c) : rt.download_parameters(c));
      return s;
    };
    const auto slice = data().validation(0, static_cast<std::size_t>(sh.m) * rows);
    const po::Batch batch = slice.batch();
    rt.zero_grad();
    const auto params0 = snapshot(false), zeros = snapshot(true);
    const po::PassStats ev = rt.evaluate(batch);
    if (snapshot(true) != zeros) fail += "evaluate wrote gradients; ";
    if (snapshot(false) != params0) fail += "evaluate changed parameters; ";
    const po::PassStats fb = rt.forward_backward(batch, {.step = 0});
    if (!same_bits(fb.losses, ev.losses)) fail += "evaluate's losses differ from forward_backward's; ";
    if (!same_bits(fb.loss, ev.loss)) fail += "evaluate's mean loss differs; ";
    if (ev.losses.size() != 8) fail += "evaluate returned " + std::to_string(ev.losses.size()) + " losses; ";
    const auto grads = snapshot(true);
    if (grads == zeros) fail += "forward_backward left no gradient; ";
    const po::PassStats ev2 = rt.evaluate(batch);  // between forward_backward and the optimizer
    if (snapshot(true) != grads) fail += "evaluate disturbed accumulated gradients; ";
    if (!same_bits(ev2.losses, ev.losses)) fail += "a second evaluate differs; ";
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(rk.errors[static_cast<std::size_t>(r)] == "");
    CHECK(failures[static_cast<std::size_t>(r)] == "");
  }
}

TEST_CASE(
    "failure: rank 3 of 4 constructed with the wrong number of stages ends every rank within 10 s with its message") {
  const po::Program program = po::PO_F::build({4, 2, 8});
  const Ranks rk = run_ranks(4, [&](int r, World& world) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
    std::vector<custom::StageRef> stages = custom::refs(mine);
    if (r == 3) stages.pop_back();
    Runtime rt(program, dev, comm, stages, options);
  });
  const std::string text = "po::Runtime: rank 3 was given 1 stages; it needs v = 2 (one per chunk)";
  CHECK(rk.errors[3] == text);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(contains(rk.errors[static_cast<std::size_t>(r)], text));
    CHECK(rk.seconds[static_cast<std::size_t>(r)] < 10.0);
  }
}

TEST_CASE("failure: a boundary mismatch between two stages is refused on every rank within 10 s, naming both stages") {
  const po::Program program = po::GIS_H::build({4, 2, 8});
  const Ranks rk = run_ranks(4, [&](int r, World& world) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
    // Stage 5 (rank 1, chunk 1) believes its input is `hidden` wide; stage 4 produces 3/4 of that.
    if (r == 1)
      mine[1] = custom::Stage(std::in_place_type<custom::ResidualStage>, model, 5, model.hidden, model.hidden,
                              4 * model.blocks);
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    Runtime rt(program, dev, comm, stages, options);
  });
  const std::string text =
      "po::Runtime: stage 4 (ResidualStage on rank 0) outputs 18 float32 values per microbatch, but stage 5 (ResidualStage on rank 1) "
      "takes 24 float32; a stage's output and the next stage's input must agree";
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(rk.errors[static_cast<std::size_t>(r)] == text);
    CHECK(rk.seconds[static_cast<std::size_t>(r)] < 10.0);
  }
}

TEST_CASE(
    "failure: NaN in the loss is a nonfinite_error on every rank naming rank, op and the loss; the next step trains normally") {
  const auto [rk, out] = run_nan(
      [](int r, std::vector<custom::StageRef>& stages, std::optional<NanLossHead>& head, std::optional<NanResidual>&) {
        if (r == 3) stages[1] = head.emplace(model, custom::width_of(model, 6));  // stage 7, the last
      });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const NanOutcome& o = out[static_cast<std::size_t>(r)];
    CHECK(rk.errors[static_cast<std::size_t>(r)] == "");
    CHECK(rk.seconds[static_cast<std::size_t>(r)] < 10.0);
    CHECK(contains(o.message, "po::Runtime::forward_backward (step 0): rank 3, compute op "));
    CHECK(contains(o.message, " F(stage 7, mb 2): the loss is nan"));
    CHECK(o.message == out[0].message);
    CHECK(o.good_steps == 2);
  }
}

TEST_CASE(
    "failure: NaN in stage 2's output activation is named as stage 2's, not a later stage's; the next step trains normally") {
  const auto [rk, out] = run_nan(
      [](int r, std::vector<custom::StageRef>& stages, std::optional<NanLossHead>&, std::optional<NanResidual>& res) {
        if (r == 2)
          stages[0] =
              res.emplace(model, 2, custom::width_of(model, 1), custom::width_of(model, 2), model.blocks);  // stage 2
      });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const NanOutcome& o = out[static_cast<std::size_t>(r)];
    CHECK(rk.errors[static_cast<std::size_t>(r)] == "");
    CHECK(rk.seconds[static_cast<std::size_t>(r)] < 10.0);
    CHECK(contains(o.message, "rank 2, compute op "));
    CHECK(contains(o.message, " F(stage 2, mb 1): its output activation has a NaN or infinity"));
    for (int s = 3; s < 8; ++s) CHECK_MESSAGE(!contains(o.message, "stage " + std::to_string(s)), o.message);
    CHECK(o.good_steps == 2);
  }
}

TEST_CASE("failure: an optimizer step that throws on rank 1 ends every rank within 10 s with that error") {
  const po::Program program = po::PO_F::build({4, 2, 8});
  const Ranks rk = run_ranks(4, [&](int r, World& world) {
    ThrowingCpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    po::Runtime rt(program, dev, comm, stages, options);
    po::AdamW opt(rt, {.weight_decay = 0.1f});
    for (int step = 0; step < 3; ++step) {
      const auto slice = data().train(static_cast<std::size_t>(step) * 8 * rows, 8 * rows);
      rt.zero_grad();
      rt.forward_backward(slice.batch(), {.step = step});
      opt.step(lr(step), po::clip_scale(po::grad_norm(rt), 0.5f));
    }
  });
  CHECK(rk.errors[1] == "rank 1, po::AdamW step 0: injected optimizer failure on rank 1");
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(contains(rk.errors[static_cast<std::size_t>(r)],
                   "rank 1, po::AdamW step 0: injected optimizer failure on rank 1"));
    CHECK(rk.seconds[static_cast<std::size_t>(r)] < 10.0);
  }
}

/// backend::Cpu with sum_squares buffers to reserve (as backend::Cuda has): records the calls.
class NormReservingCpu : public po::backend::Cpu {
 public:
  using Cpu::Cpu;
  void reserve_sum_squares(std::span<const std::size_t> groups) { reserved.emplace_back(groups.begin(), groups.end()); }
  std::vector<std::vector<std::size_t>> reserved;
};
static_assert(po::backend::reserves_norm_buffers<NormReservingCpu>);
static_assert(!po::backend::reserves_norm_buffers<po::backend::Cpu>);

TEST_CASE("memory: the runtime reserves the gradient norm's buffers at construction, one call per chunk's groups") {
  const po::Program program = po::PO_F::build({2, 2, 4});
  const Ranks rk = run_ranks(2, [&](int r, World& world) {
    NormReservingCpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    po::Runtime rt(program, dev, comm, stages, options);
    // Before any step: each chunk's norm groups, in chunk order (backend::Cuda sizes its
    // table, partials and sums from them, so grad_norm never carves in a step).
    if (dev.reserved.size() != 2)
      throw std::runtime_error("reserve_sum_squares calls: " + std::to_string(dev.reserved.size()));
    for (int c = 0; c < 2; ++c)
      if (dev.reserved[static_cast<std::size_t>(c)] != rt.norm_groups(c))
        throw std::runtime_error("chunk " + std::to_string(c) + ": reserved other groups than norm_groups");
  });
  for (const std::string& e : rk.errors) CHECK(e == "");
}

/// backend::Cpu that counts the host-side calls a step makes which wait for the device on a
/// GPU (downloads and synchronizations).
class CountingCpu : public po::backend::Cpu {
 public:
  using Cpu::Cpu;
  void download(void* host, const void* device, std::size_t bytes) {
    ++downloads;
    Cpu::download(host, device, bytes);
  }
  void synchronize() {
    ++synchronizations;
    Cpu::synchronize();
  }
  int downloads = 0, synchronizations = 0;
};

TEST_CASE("a training step and an evaluation each read their results back in one download and wait once") {
  for (const po::Program& program : {po::PO_F::build({2, 2, 4}), po::GIS_H::build({4, 1, 4})}) {
    CAPTURE(program.shape.d);
    const Ranks rk = run_ranks(program.shape.d, [&](int r, World& world) {
      CountingCpu dev({.rank = r});
      po::comm::Threads comm(world, r);
      std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
      const std::vector<custom::StageRef> stages = custom::refs(mine);
      po::Runtime rt(program, dev, comm, stages, options);
      const auto slice = data().train(0, static_cast<std::size_t>(program.shape.m) * rows);
      for (int step = 0; step < 2; ++step) {
        dev.downloads = dev.synchronizations = 0;
        rt.zero_grad();
        rt.forward_backward(slice.batch(), {.step = step});
        if (dev.downloads != 1 || dev.synchronizations != 1)
          throw std::runtime_error("forward_backward: " + std::to_string(dev.downloads) + " downloads, " +
                                   std::to_string(dev.synchronizations) + " synchronizations");
      }
      dev.downloads = dev.synchronizations = 0;
      rt.evaluate(slice.batch());
      if (dev.downloads != 1 || dev.synchronizations != 1)
        throw std::runtime_error("evaluate: " + std::to_string(dev.downloads) + " downloads, " +
                                 std::to_string(dev.synchronizations) + " synchronizations");
    });
    for (const std::string& e : rk.errors) CHECK(e == "");
  }
}

TEST_CASE(
    "a training step makes the host wait only where it reads: its results, the norm's sums among them, not its inputs") {
  // The host's waits as backend::Cuda counts them (synchronize, download, and an upload only
  // where its pinned staging is full; zero_grad, the step inputs' uploads, the norm's sums and
  // the optimizers' updates are enqueued): each forward_backward waits once and reads its
  // results once, the last of a step with the norm's sums behind its work; grad_norm does not
  // wait; the optimizer waits once only for ZeRO-1's parameter gather. A staging smaller than
  // any upload makes every upload wait (the last case).
  struct Want {
    Case c;
    int extra;  // the optimizer's waits
    bool uploads_wait = false;
  };
  const std::vector<Want> cases{
      {{.program = po::PO_F::build({2, 2, 4})}, 0},
      {{.program = po::GIS_H::build({4, 1, 4}), .parts = 2, .optim = Optim::sgd}, 0},
      {{.program = po::ZB_V::build({2, 2, 4}), .dp = 2, .gradients = po::Gradients::standard}, 0},
      {{.program = po::PO_H::build({2, 2, 4}), .dp = 2, .zero = 1, .gradients = po::Gradients::standard}, 1},
      {{.program = po::PO_F::build({2, 2, 4}), .dp = 2, .zero = 1, .bf16 = true}, 1},
      {{.program = po::GIS_H::build({4, 1, 4}), .parts = 2, .upload_staging = 1}, 0, true},
  };
  for (const Want& w : cases) {
    CAPTURE(w.c.program.shape.d);
    CAPTURE(w.c.dp);
    CAPTURE(w.c.zero);
    const Run run = train(w.c);
    require_ok(run);
    for (std::size_t g = 0; g < run.waits.size(); ++g)
      for (std::size_t step = 0; step < run.waits[g].size(); ++step) {
        CAPTURE(g);
        CAPTURE(step);
        const long long uploads = w.uploads_wait ? static_cast<long long>(run.inputs[g]) : 0;
        CHECK(run.waits[g][step] == static_cast<long long>(w.c.parts) * (uploads + 2) + w.extra);
      }
  }
}

TEST_CASE("grad_norm takes the sums the step's last call read back, and otherwise waits once for its own") {
  // Exact gradients: two parts give the same bits in either order. In order, the last call
  // (part 1 of 2) brings the norm's sums back with its results and grad_norm does not wait;
  // reversed, the last call is part 0, so grad_norm sums and waits once: the same norm, bit for
  // bit. After zero_grad it sums again (zero). The backend defers the sums as a GPU does.
  const po::Program program = po::PO_F::build({2, 2, 4});
  const Ranks rk = run_ranks(2, [&](int r, World& world) {
    po::backend::Cpu dev({.rank = r, .defer_results = true});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(model, program.shape, r);
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    Runtime rt(program, dev, comm, stages, options);
    const std::size_t part_rows = static_cast<std::size_t>(program.shape.m) * rows;
    const auto a = data().train(0, part_rows), b = data().train(part_rows, part_rows);
    const auto step = [&](std::initializer_list<int> parts) {
      rt.zero_grad();
      for (int part : parts) rt.forward_backward((part == 0 ? a : b).batch(), {.step = 0, .part = part, .parts = 2});
      const long long before = dev.host_waits();
      const double norm = po::grad_norm(rt);
      return std::pair(norm, dev.host_waits() - before);
    };
    const auto [reversed, waits_reversed] = step({1, 0});
    const auto [in_order, waits_in_order] = step({0, 1});
    if (waits_in_order != 0 || waits_reversed != 1)
      throw std::runtime_error("grad_norm waited " + std::to_string(waits_in_order) + " and " +
                               std::to_string(waits_reversed) + " times; want 0 and 1");
    if (!(in_order > 0) || !same_bits(in_order, reversed))
      throw std::runtime_error("norms " + std::to_string(in_order) + " and " + std::to_string(reversed));
    rt.evaluate(a.batch());  // leaves the gradients, and the step's sums, as they are
    const long long before = dev.host_waits();
    if (!same_bits(po::grad_norm(rt), in_order) || dev.host_waits() != before)
      throw std::runtime_error("grad_norm after evaluate recomputed or changed");
    rt.zero_grad();
    if (po::grad_norm(rt) != 0.0) throw std::runtime_error("grad_norm after zero_grad is not 0");
  });
  for (const std::string& e : rk.errors) CHECK(e == "");
}

TEST_CASE(
    "parameter groups: AdamW leaves a weight-decay-0 tensor with zero gradient unchanged and shrinks the others by exactly lr*wd*p") {
  const po::Program program = po::GIS::build({1, 4, 2});
  const float wd = 0.1f, rate = 0.01f;
  const po::update::AdamWParams hyper{0.9f, 0.95f, 1e-8f, wd};
  const Ranks rk = run_ranks(1, [&](int, World& world) {
    po::backend::Cpu dev;
    po::comm::Threads comm(world, 0);
    std::vector<custom::Stage> all = custom::make_stages(model, 4);
    const std::vector<custom::StageRef> stages = custom::refs(all);
    Runtime rt(program, dev, comm, stages, options);
    po::AdamW opt(
        rt, {.beta1 = hyper.beta1, .beta2 = hyper.beta2, .eps = hyper.eps, .weight_decay = wd, .groups = {no_decay}});
    std::vector<std::vector<float>> before;
    for (int c = 0; c < 4; ++c) before.push_back(rt.download_parameters(c));
    rt.zero_grad();
    opt.step(rate);
    for (int c = 0; c < 4; ++c) {
      CAPTURE(c);
      const std::vector<float> after = rt.download_parameters(c);
      for (const po::ParamInfo& t : stages[static_cast<std::size_t>(c)].parameter_info()) {
        CAPTURE(t.name);
        bool decayed = true, untouched = true;
        for (std::size_t i = t.offset; i < t.offset + t.count(); ++i) {
          float p = before[static_cast<std::size_t>(c)][i], m = 0, v = 0;
          if (t.shape.size() < 2) {
            untouched = untouched && same_bits(after[i], p);
          } else {
            po::update::adamw(p, 0.0f, m, v, hyper, rate, po::update::adam_bias(hyper.beta1, hyper.beta2, 1));
            const float expected =
                before[static_cast<std::size_t>(c)][i] - rate * (wd * before[static_cast<std::size_t>(c)][i]);
            decayed = decayed && same_bits(after[i], p) && same_bits(after[i], expected);
          }
        }
        CHECK(decayed);
        CHECK(untouched);
      }
      // Runs: one per tensor here (2-d and 1-d alternate), contiguous, covering every parameter.
      const auto& runs = opt.runs(c);
      std::size_t at = 0;
      for (std::size_t k = 0; k < runs.size(); ++k) {
        CHECK(runs[k].offset == at);
        at += runs[k].count;
        if (k > 0) CHECK(runs[k].weight_decay != runs[k - 1].weight_decay);
      }
      CHECK(at == stages[static_cast<std::size_t>(c)].parameters().size());
      CHECK(runs.size() == stages[static_cast<std::size_t>(c)].parameter_info().size());
    }
    // Neighbours of one setting merge: a group taking block 0's four tensors makes one run of them.
    const po::ParamGroup block0{"block 0", [](const po::ParamInfo& p) { return p.name.rfind("blocks.0.", 0) == 0; },
                                0.5f, 0.1f};
    po::AdamW merged(rt, {.weight_decay = 0.1f, .groups = {block0}});
    const auto& runs = merged.runs(1);  // stage 1: blocks 0 and 1
    REQUIRE(runs.size() == 2);
    CHECK(runs[0].offset == 0);
    CHECK(runs[0].lr_scale == 0.5f);
    CHECK(runs[1].offset == runs[0].count);
    CHECK(runs[0].count + runs[1].count == stages[1].parameters().size());
    for (int c : {0, 2, 3}) CHECK(merged.runs(c).size() == 1);
  });
  CHECK(rk.errors[0] == "");
}

TEST_CASE("parameter groups: a parameter_info() that leaves a gap is refused with a sentence") {
  const po::Program program = po::GIS::build({1, 4, 2});
  const Ranks rk = run_ranks(1, [&](int, World& world) {
    po::backend::Cpu dev;
    po::comm::Threads comm(world, 0);
    std::vector<custom::Stage> all = custom::make_stages(model, 4);
    std::vector<custom::StageRef> stages = custom::refs(all);
    GapHead head(model, custom::width_of(model, 2));
    stages[3] = head;
    Runtime rt(program, dev, comm, stages, options);
    po::AdamW opt(rt);
  });
  CHECK(
      rk.errors[0] ==
      "rank 0, po::AdamW: stage 3 (RegressionHead)'s parameter_info() leaves parameters [0, 6) out; its tensors must cover "
      "parameters() exactly once");
}

TEST_CASE("po::Sgd with Nesterov momentum trains the custom model bit-identically on 4 ranks and on one rank") {
  const po::Program program = po::PO_H::build({4, 2, 8});
  check_same(train({.program = program, .optim = Optim::sgd}),
             train({.program = one_rank(program.shape), .optim = Optim::sgd}));
}

TEST_CASE(
    "checkpoint round trip: resuming after 2 steps under another schedule and rank count reaches the same parameters, bitwise") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_custom_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (Optim optim : {Optim::adamw, Optim::sgd}) {
    CAPTURE(static_cast<int>(optim));
    const Run straight =
        train({.program = po::PO_F::build({4, 2, 8}), .steps = 4, .optim = optim, .save_dir = dir, .save_after = 2});
    require_ok(straight);
    REQUIRE(std::filesystem::exists(dir / "latest"));
    const Run resumed =
        train({.program = po::GIS_H::build({2, 4, 8}), .steps = 4, .optim = optim, .load_dir = dir, .first_step = 2});
    check_same(resumed, straight, 2);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE(
    "data parallel: dp replicas of the heterogeneous model train bit-identically to one replica of the global batch "
    "(AdamW and SGD, ZeRO-1, accumulation)") {
  const po::Program one = one_rank({1, 4, 12});  // 12 microbatches in one call
  for (Optim optim : {Optim::adamw, Optim::sgd}) {
    CAPTURE(static_cast<int>(optim));
    const Run ref = train({.program = one, .optim = optim});
    for (int zero : {0, 1}) {
      CAPTURE(zero);
      check_same(train({.program = po::PO_F::build({2, 2, 6}), .optim = optim, .dp = 2, .zero = zero}), ref);
      check_same(train({.program = po::GIS_H::build({4, 1, 4}), .optim = optim, .dp = 3, .zero = zero}), ref);
      // 2 replicas x 2 calls of 3 microbatches.
      check_same(train({.program = po::PO_H::build({2, 2, 3}), .parts = 2, .optim = optim, .dp = 2, .zero = zero}),
                 ref);
    }
  }
}

TEST_CASE("data parallel: a checkpoint of 2 replicas with ZeRO-1 resumes on 3 replicas, bitwise") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_custom_dp_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const Run straight =
      train({.program = po::PO_F::build({2, 2, 6}), .steps = 4, .save_dir = dir, .save_after = 2, .dp = 2, .zero = 1});
  require_ok(straight);
  const Run resumed =
      train({.program = po::GIS::build({2, 2, 4}), .steps = 4, .load_dir = dir, .first_step = 2, .dp = 3, .zero = 1});
  check_same(resumed, straight, 2);
  std::filesystem::remove_all(dir);
}

// ---- the standard path (the default): fp32 gradients in place, reduce-scattered ----------

namespace {

/// The mean of a run's last step's microbatch losses (require_ok first).
double final_loss(const Run& run) {
  require_ok(run);
  const std::vector<float>& v = run.losses.back();
  double s = 0;
  for (float x : v) s += x;
  return s / static_cast<double>(v.size());
}

Case standard(Case c) {
  c.gradients = po::Gradients::standard;
  return c;
}

/// Does every stage of `p` compute its weight gradients in microbatch order?
bool w_in_order(const po::Program& p) {
  for (const po::RankProgram& rp : p.ranks) {
    std::map<int, int> last;
    for (const po::Op& op : rp.compute)
      if (op.kind == po::OpKind::W || op.kind == po::OpKind::BW) {
        auto [it, fresh] = last.try_emplace(op.stage, op.mb);
        if (!fresh && op.mb < it->second) return false;
        it->second = op.mb;
      }
  }
  return true;
}

}  // namespace

TEST_CASE("standard gradients: dp = 2 and 3 are deterministic: a run again and with ZeRO-1 gives the same bits") {
  for (Optim optim : {Optim::adamw, Optim::sgd}) {
    CAPTURE(static_cast<int>(optim));
    // Buckets of 16 values (several per stage, the last one padded) and of 2^20 (one): ZeRO-0
    // twice and ZeRO-1 give the same bits.
    for (std::size_t bucket : {std::size_t{16}, std::size_t{1} << 20}) {
      CAPTURE(bucket);
      const Case two{.program = po::PO_F::build({2, 2, 6}), .optim = optim, .dp = 2, .reduce_bucket = bucket};
      const Case three{.program = po::GIS_H::build({4, 1, 4}), .optim = optim, .dp = 3, .reduce_bucket = bucket};
      for (const Case& c : {two, three}) {
        const Run a = train(standard(c));
        check_same(train(standard(c)), a);
        Case sharded = standard(c);
        sharded.zero = 1;
        check_same(train(sharded), a);
      }
    }
  }
}

TEST_CASE(
    "standard gradients, bfloat16 reduce-scatter: deterministic at dp = 2 and 3, ZeRO-1 the same bits, within 1 % of fp32's loss") {
  for (std::size_t bucket : {std::size_t{16}, std::size_t{1} << 20}) {
    CAPTURE(bucket);
    const Case two{.program = po::PO_F::build({2, 2, 6}), .steps = 10, .dp = 2, .reduce_bucket = bucket};
    const Case three{.program = po::GIS_H::build({4, 1, 4}), .steps = 10, .dp = 3, .reduce_bucket = bucket};
    for (const Case& c : {two, three}) {
      CAPTURE(c.dp);
      Case narrow = standard(c);
      narrow.reduce_dtype = po::DType::bfloat16;
      const Run a = train(narrow);
      require_ok(a);
      check_same(train(narrow), a);
      Case sharded = narrow;
      sharded.zero = 1;
      check_same(train(sharded), a);
      // The parts really travel as bfloat16: the parameters differ from the fp32 reduction's,
      // and the loss stays within 1 % of it.
      const Run wide = train(standard(c));
      CHECK(wide.params != a.params);
      const double e = final_loss(wide), f = final_loss(a);
      CAPTURE(e);
      CAPTURE(f);
      CHECK(std::abs(f - e) <= 0.01 * std::abs(e));
    }
  }
  // The exact path refuses it, naming both settings.
  Case exact{.program = po::PO_F::build({2, 2, 6}), .dp = 2, .reduce_dtype = po::DType::bfloat16};
  const Run bad = train(exact);
  REQUIRE(!bad.errors.empty());
  CHECK(bad.errors[0].find("RuntimeOptions::reduce_dtype = bfloat16 needs Gradients::standard") != std::string::npos);
}

TEST_CASE(
    "ZeRO-1's parameter gather left running into the next step (overlap_gather) gives the same bits: dp 2 and 3, both paths, both optimizers, bf16 working parameters") {
  for (Optim optim : {Optim::adamw, Optim::sgd})
    for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact})
      for (bool bf16 : {false, true}) {
        CAPTURE(static_cast<int>(optim));
        CAPTURE(po::gradients_name(path));
        CAPTURE(bf16);
        const Case two{.program = po::PO_F::build({2, 2, 6}),
                       .steps = 4,
                       .optim = optim,
                       .dp = 2,
                       .zero = 1,
                       .gradients = path,
                       .reduce_bucket = 16,
                       .bf16 = bf16};
        const Case three{.program = po::GIS_H::build({4, 1, 4}),
                         .steps = 4,
                         .optim = optim,
                         .dp = 3,
                         .zero = 1,
                         .gradients = path,
                         .bf16 = bf16};
        for (const Case& c : {two, three}) {
          CAPTURE(c.dp);
          const Run a = train(c);
          require_ok(a);
          Case overlapped = c;
          overlapped.overlap_gather = true;
          check_same(train(overlapped), a);
        }
      }
  // A checkpoint saved right after an overlapped step holds the gathered parameters: a resume
  // from it continues with the uninterrupted run's bits.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_custom_overlap_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const Case base{.program = po::PO_H::build({2, 2, 6}),
                  .steps = 4,
                  .dp = 2,
                  .zero = 1,
                  .gradients = po::Gradients::standard,
                  .overlap_gather = true};
  const Run whole = train(base);
  Case save = base;
  save.save_dir = dir;
  save.save_after = 2;
  require_ok(train(save));
  Case load = base;
  load.load_dir = dir;
  load.first_step = 2;
  const Run resumed = train(load);
  require_ok(resumed);
  CHECK(resumed.params == whole.params);
  std::filesystem::remove_all(dir);
}

TEST_CASE("standard gradients: every family (each stage's W in microbatch order) trains bit-identically to one rank") {
  const po::Shape one{1, 4, 8};
  const Run ref = train(standard({.program = one_rank(one)}));
  for (const char* name : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v",
                           "v-half", "v-min", "dualpipe-v"}) {
    CAPTURE(name);
    const std::string n = name;
    const int v = n == "1f1b" || n.rfind("zb-h", 0) == 0 ? 1 : 2;
    const po::Program p = po::build(po::parse_schedule(n, n == "gis-g" ? 2 : 0), {4 / v, v, 8});
    REQUIRE(w_in_order(p));
    check_same(train(standard({.program = p})), ref);
  }
  // Accumulation in two calls of 4 sums the same microbatches in the same order.
  check_same(train(standard({.program = po::PO_F::build({4, 1, 4}), .parts = 2})), ref);
}

TEST_CASE("standard gradients: the custom model's final loss is within 1 % of the exact path's") {
  for (const Case& c : {Case{.program = po::PO_F::build({4, 2, 8}), .steps = 10},
                        Case{.program = po::GIS_H::build({2, 2, 6}), .steps = 10, .dp = 2, .zero = 1}}) {
    const double e = final_loss(train(c)), f = final_loss(train(standard(c)));
    CAPTURE(e);
    CAPTURE(f);
    CHECK(std::abs(f - e) <= 0.01 * std::abs(e));
  }
}

TEST_CASE(
    "memory: po::state_bytes is what the runtime and optimizer allocate, to the byte (both paths, dp 1, 2, 8, ZeRO 0 and 1)") {
  for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact})
    for (int dp : {1, 2, 8})
      for (int zero : {0, 1})
        for (Optim optim : {Optim::adamw, Optim::sgd}) {
          CAPTURE(po::gradients_name(path));
          CAPTURE(dp);
          CAPTURE(zero);
          CAPTURE(static_cast<int>(optim));
          Case c{.program = po::GIS::build({2, 2, 4}),
                 .steps = 1,
                 .optim = optim,
                 .dp = dp,
                 .zero = zero,
                 .gradients = path,
                 .reduce_bucket = 16};
          const Run run = train(c);
          require_ok(run);
          for (std::size_t g = 0; g < run.state_memory.size(); ++g) {
            CAPTURE(g);
            const po::StateBytes want =
                po::state_bytes(run.chunk_params[g], {.gradients = path,
                                                      .dp = dp,
                                                      .replica = static_cast<int>(g) / 2,
                                                      .zero = zero,
                                                      .optimizer_states = optim == Optim::adamw ? 2 : 1,
                                                      .reduce_bucket = 16});
            CHECK(run.state_memory[g] - run.fixed_state[g] == want.sums + want.staging);
            CHECK(run.optimizer_memory[g] == want.optimizer);
            std::size_t blocks = 0;
            for (std::size_t b : want.blocks) blocks += b;
            CHECK(blocks == want.arena());
          }
        }
}

TEST_CASE(
    "traffic: one step's replica collectives send what the layout says, per parameter within the formulas (dp 2, 3, 8)") {
  for (int dp : {2, 3, 8})
    for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact})
      for (int zero : {0, 1})
        for (po::DType reduce : {po::DType::float32, po::DType::bfloat16}) {
          if (path == po::Gradients::exact && reduce != po::DType::float32) continue;
          CAPTURE(dp);
          CAPTURE(po::gradients_name(path));
          CAPTURE(zero);
          CAPTURE(po::dtype_name(reduce));
          const std::size_t bucket = 64;
          const Run run = train({.program = po::GIS::build({2, 2, 4}),
                                 .steps = 2,
                                 .dp = dp,
                                 .zero = zero,
                                 .gradients = path,
                                 .reduce_bucket = bucket,
                                 .reduce_dtype = reduce});
          require_ok(run);
          for (std::size_t g = 0; g < run.traffic.size(); ++g) {
            CAPTURE(g);
            // Per bucket, each replica sends all but its own slice in the reduce-scatter and its
            // slice to each other replica in each all-gather (gradients unless sharded;
            // parameters with ZeRO-1).
            const std::size_t f = 4, x = 16, d1 = static_cast<std::size_t>(dp - 1), rs = po::dtype_size(reduce);
            const bool exact = path == po::Gradients::exact;
            std::size_t want = 0, params = 0;
            for (std::size_t n : run.chunk_params[g]) {
              const po::GradientLayout l = po::gradient_layout(n, dp, bucket);
              const std::size_t used = (n + l.len - 1) / l.len, slice = l.slice();
              want += used * d1 * slice * (exact ? x : rs);           // reduce-scatter
              if (exact || zero == 0) want += used * d1 * slice * f;  // gradient all-gather
              if (zero == 1) want += used * d1 * slice * f;           // parameter all-gather
              params += n;
            }
            CHECK(run.traffic[g] == want);
            CHECK(po::traffic_bytes(
                      run.chunk_params[g],
                      {.gradients = path, .dp = dp, .zero = zero, .reduce_bucket = bucket, .reduce_bytes = rs}) ==
                  want);
            // Per parameter: standard 8 (dp - 1) / dp either way (6 with a bfloat16
            // reduce-scatter); the padding of the last bucket (less than one bucket per chunk) is
            // all that may exceed it.
            const double per = static_cast<double>(run.traffic[g]) / static_cast<double>(params);
            const double formula = (exact ? (zero == 1 ? 24.0 : 20.0) : 4.0 + static_cast<double>(rs)) * (dp - 1) / dp;
            double padding = 0;
            for (std::size_t n : run.chunk_params[g]) {
              const po::GradientLayout l = po::gradient_layout(n, dp, bucket);
              padding += static_cast<double>(l.padded() - n);
            }
            CHECK(per <= formula * (1.0 + padding / static_cast<double>(params)) + 1e-9);
          }
        }
}

TEST_CASE("checkpoints load across the gradient paths: standard -> exact under other replica counts, and back") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_custom_paths_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  // Written by the standard path with 2 replicas and ZeRO-1; the exact path resumes it on one
  // replica and on three with the same bits (the exact path does not depend on dp).
  require_ok(train(standard(
      {.program = po::PO_F::build({2, 2, 6}), .steps = 4, .save_dir = dir, .save_after = 2, .dp = 2, .zero = 1})));
  const Run one = train({.program = one_rank({1, 4, 12}), .steps = 4, .load_dir = dir, .first_step = 2});
  const Run three =
      train({.program = po::GIS_H::build({4, 1, 4}), .steps = 4, .load_dir = dir, .first_step = 2, .dp = 3, .zero = 1});
  check_same(three, one, 2);
  std::filesystem::remove_all(dir);
  // Written by the exact path; the standard path resumes it with ZeRO-0 and ZeRO-1 alike.
  require_ok(train({.program = po::GIS::build({2, 2, 6}), .steps = 4, .save_dir = dir, .save_after = 2, .dp = 2}));
  const Run z0 =
      train(standard({.program = po::PO_H::build({2, 2, 6}), .steps = 4, .load_dir = dir, .first_step = 2, .dp = 2}));
  const Run z1 = train(standard(
      {.program = po::PO_H::build({2, 2, 6}), .steps = 4, .load_dir = dir, .first_step = 2, .dp = 2, .zero = 1}));
  check_same(z1, z0, 2);
  std::filesystem::remove_all(dir);
}

// ---- bfloat16 working parameters: the optimizer's fp32 master -------------------------------

TEST_CASE(
    "bfloat16 working parameters: ZeRO-1 equals ZeRO-0, the exact path keeps its bit-identity, the loss follows fp32") {
  for (Optim optim : {Optim::adamw, Optim::sgd}) {
    CAPTURE(static_cast<int>(optim));
    // Standard path, 2 replicas: run again and with ZeRO-1 (the master sharded), the same bits.
    const Case two{.program = po::PO_F::build({2, 2, 6}), .optim = optim, .dp = 2, .reduce_bucket = 16, .bf16 = true};
    const Run a = train(standard(two));
    check_same(train(standard(two)), a);
    Case sharded = standard(two);
    sharded.zero = 1;
    check_same(train(sharded), a);
    // The working parameters are bfloat16 values.
    for (const std::vector<float>& p : a.params)
      for (float x : p) REQUIRE(po::bf16_value(po::bf16_bits(x)) == x);
    // Exact path: replicas, ranks and schedules give one replica's bits.
    const Run ref = train({.program = one_rank({1, 4, 12}), .optim = optim, .bf16 = true});
    check_same(train({.program = po::GIS_H::build({4, 1, 4}), .optim = optim, .dp = 3, .zero = 1, .bf16 = true}), ref);
    // Within 5 % of the fp32 model's loss after 10 steps (the weights themselves are rounded to bfloat16).
    const Run wide = train(standard({.program = po::PO_F::build({4, 2, 8}), .steps = 10, .optim = optim}));
    const Run narrow =
        train(standard({.program = po::PO_F::build({4, 2, 8}), .steps = 10, .optim = optim, .bf16 = true}));
    const double w = final_loss(wide), n = final_loss(narrow);
    CAPTURE(w);
    CAPTURE(n);
    CHECK(std::abs(n - w) <= 0.05 * std::abs(w));
  }
}

TEST_CASE("bfloat16 working parameters: po::state_bytes counts the master to the byte; a checkpoint keeps it in fp32") {
  for (int dp : {1, 2, 8})
    for (int zero : {0, 1}) {
      CAPTURE(dp);
      CAPTURE(zero);
      const Run run = train(standard({.program = po::GIS::build({2, 2, 4}),
                                      .steps = 1,
                                      .dp = dp,
                                      .zero = zero,
                                      .reduce_bucket = 16,
                                      .bf16 = true}));
      require_ok(run);
      for (std::size_t g = 0; g < run.state_memory.size(); ++g) {
        const po::StateBytes want = po::state_bytes(
            run.chunk_params[g],
            {.dp = dp, .replica = static_cast<int>(g) / 2, .zero = zero, .reduce_bucket = 16, .parameter_bytes = 2});
        CHECK(run.optimizer_memory[g] == want.optimizer + want.master);
        CHECK(run.state_memory[g] - run.fixed_state[g] == want.sums + want.staging);
      }
    }
  // Exact path: saved under 2 replicas with the master sharded, resumed under 3, the same bits
  // as the run that went straight on (the file holds the fp32 master, not its bfloat16 rounding).
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_custom_bf16_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const Run straight = train({.program = po::PO_F::build({2, 2, 6}),
                              .steps = 4,
                              .save_dir = dir,
                              .save_after = 2,
                              .dp = 2,
                              .zero = 1,
                              .bf16 = true});
  require_ok(straight);
  const Run resumed = train({.program = po::GIS::build({2, 2, 4}),
                             .steps = 4,
                             .load_dir = dir,
                             .first_step = 2,
                             .dp = 3,
                             .zero = 1,
                             .bf16 = true});
  check_same(resumed, straight, 2);
  std::filesystem::remove_all(dir);
}
