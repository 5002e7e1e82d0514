// samples/custom_model.cpp: your own model on pipeoffload, here a residual MLP that is not a GPT.
//
// Its three stage types (custom_model.hpp) train on 4 thread ranks under two compile-time
// schedules (po::PO_F::build, po::GIS_H::build) and one run-time Program (po::build of
// --schedule), each with po::AdamW and po::Sgd. Every schedule trains bit-identically, so the
// runs of one optimizer end with one final_loss (1f1b has 4 stages, not 8: a different model).
//
//   ./samples/custom_model                               # run-time schedule 1f1b-i
//   ./samples/custom_model --schedule gis-g --group 3    # GIS(3) as the run-time Program
//   ./samples/custom_model --schedule po-h --steps 80 --eval-every 20
// --help lists the arguments; a bad one exits with status 2.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "custom_model.hpp"

namespace {

constexpr int ranks = 4;   // d: thread ranks
constexpr int chunks = 2;  // v: stages per rank (1 for 1f1b)
constexpr int microbatches = 8;
constexpr int rows = 4;       // rows per microbatch
constexpr float clip = 1.0f;  // global gradient-norm clip

using Runtime = po::Runtime<po::backend::Cpu, po::comm::Threads>;

struct Options {
  std::string schedule = "1f1b-i";
  po::ScheduleSpec spec = po::Interleaved1F1B::spec;
  int steps = 40;
  int eval_every = 10;
  po::Gradients gradients = po::Gradients::standard;  // RuntimeOptions::gradients
};

using cli::bad_argument;

constexpr const char* usage_text =
    "usage: custom_model [--schedule NAME] [--group G] [--steps N] [--eval-every N] [--gradients standard|exact]\n"
    "  --schedule NAME   a run-time schedule (default 1f1b-i; zb-h1 and zb-h2 take one chunk a rank)\n"
    "  --group G         GIS(g)'s group, in [2, 4] (gis-g only)\n"
    "  --steps N         training steps, in [1, 10000] (default 40)\n"
    "  --eval-every N    steps between validation losses, in [1, 10000] (default 10)\n"
    "  --gradients P     standard (default) or exact (RuntimeOptions::gradients)\n";

constexpr cli::Flag flags[] = {{"--schedule"}, {"--group"}, {"--steps"}, {"--eval-every"}, {"--gradients"}};

Options parse(int argc, char** argv) {
  cli::help(argc, argv, usage_text);
  const cli::Args args(argc, argv, flags);
  Options o;
  if (const std::string* v = args.get("--schedule")) o.schedule = *v;
  if (const std::string* v = args.get("--gradients"))
    o.gradients = cli::one_of("--gradients", *v, {"standard", "exact"}) == "exact" ? po::Gradients::exact
                                                                                   : po::Gradients::standard;
  if (const std::string* v = args.get("--steps")) o.steps = static_cast<int>(cli::to_int("--steps", *v, 1, 10000));
  if (const std::string* v = args.get("--eval-every"))
    o.eval_every = static_cast<int>(cli::to_int("--eval-every", *v, 1, 10000));
  o.spec = cli::schedule_option(o.schedule, args.get("--group"), ranks);
  return o;
}

/// One run's losses: training at every step, validation every few steps.
struct Curve {
  std::vector<float> train;                       // per step
  std::vector<std::pair<int, float>> validation;  // (step, loss)
  double seconds = 0;
};

/// Trains the model with `program` on thread ranks; `make_optimizer(rt)` makes each rank's
/// optimizer, `lr(step)` is the learning rate.
template <class MakeOptimizer, class Lr>
Curve train(const po::Program& program, const custom::Config& cfg, const custom::Dataset& data, const Options& o,
            MakeOptimizer make_optimizer, Lr lr) {
  const po::Shape sh = program.shape;
  const std::size_t step_rows = static_cast<std::size_t>(sh.m) * rows;
  Curve curve;
  const auto t0 = std::chrono::steady_clock::now();
  po::comm::ThreadsWorld world(sh.d);
  const std::vector<std::string> errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<custom::Stage> mine = custom::make_rank_stages(cfg, sh, r);  // this rank's stages, chunk order
    const std::vector<custom::StageRef> stages = custom::refs(mine);
    Runtime rt(program, dev, comm, stages, {.microbatch = {rows, 1}, .gradients = o.gradients});
    auto opt = make_optimizer(rt);
    const custom::Dataset::Slice val = data.validation(0, step_rows);
    for (int step = 0; step < o.steps; ++step) {
      const custom::Dataset::Slice rows_now = data.train(static_cast<std::size_t>(step) * step_rows, step_rows);
      rt.zero_grad();
      const po::PassStats fb = rt.forward_backward(rows_now.batch(), {.step = step});
      const double norm = po::grad_norm(rt);
      opt.step(lr(step), po::clip_scale(norm, clip));
      if (r == 0) curve.train.push_back(fb.loss);
      if (step % o.eval_every == 0 || step + 1 == o.steps) {
        const po::PassStats ev = rt.evaluate(val.batch());  // forward only: no gradients, nothing offloaded
        if (r == 0) curve.validation.emplace_back(step, ev.loss);
      }
    }
  });
  curve.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bool failed = false;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      std::fprintf(stderr, "custom_model: rank %zu failed: %s\n", r, errors[r].c_str());
      failed = true;
    }
  if (failed) std::exit(1);
  return curve;
}

void print(const std::string& title, const po::Program& program, const Curve& c) {
  const po::Shape& sh = program.shape;
  std::printf("== %s: %d stages on %d ranks, %d microbatches of %d rows, %zu steps in %.2f s\n", title.c_str(),
              sh.stages(), sh.d, sh.m, rows, c.train.size(), c.seconds);
  std::printf("   step ");
  for (const auto& [step, loss] : c.validation) std::printf(" %8d", step);
  std::printf("\n   train");
  for (const auto& [step, loss] : c.validation)
    std::printf(" %8.5f", static_cast<double>(c.train[static_cast<std::size_t>(step)]));
  std::printf("\n   val  ");
  for (const auto& [step, loss] : c.validation) std::printf(" %8.5f", static_cast<double>(loss));
  std::printf("\nfinal_loss=%.9g\n", static_cast<double>(c.train.back()));
}

void describe(const custom::Config& cfg, int S) {
  std::vector<custom::Stage> all = custom::make_stages(cfg, S);
  const std::vector<custom::StageRef> refs = custom::refs(all);
  const po::MicrobatchShape one{1, 1};  // widths per row
  std::printf("model (%d stages):", S);
  for (int s = 0; s < S; ++s) {
    const custom::StageRef& l = refs[static_cast<std::size_t>(s)];
    std::printf("%s %d %s", s == 0 ? "" : ",", s, l.name().c_str());
    if (s == 0)
      std::printf(" %d->%zu", cfg.features, l.output_boundary(one).elements);
    else if (s == S - 1)
      std::printf(" %zu->1", l.input_boundary(one).elements);
    else
      std::printf(" %zu->%zu", l.input_boundary(one).elements, l.output_boundary(one).elements);
    std::printf(" (%zu params)", l.parameters().size());
  }
  std::printf("\n");
}

}  // namespace

int run(const Options& o) {
  const custom::Config cfg{.features = 12, .hidden = 16, .blocks = 2, .seed = 1};
  const custom::Dataset data(cfg.features, 2048, static_cast<std::size_t>(microbatches) * rows);
  const po::Shape shape{ranks, chunks, microbatches};
  const po::Shape run_time_shape{ranks, o.schedule == "1f1b" ? 1 : chunks, microbatches};
  describe(cfg, shape.stages());
  if (run_time_shape.stages() != shape.stages()) describe(cfg, run_time_shape.stages());

  // The programs: two from schedule types (compile time), one from a name (run time).
  struct Entry {
    std::string title;
    po::Program program;
  };
  std::vector<Entry> programs;
  programs.push_back({"po-f (compile time: po::PO_F::build)", po::PO_F::build(shape)});
  programs.push_back({"gis-h (compile time: po::GIS_H::build)", po::GIS_H::build(shape)});
  try {
    programs.push_back({o.schedule + " (run time: po::build)", po::build(o.spec, run_time_shape, po::Costs{})});
  } catch (const po::error& e) {
    throw bad_argument("--schedule " + o.schedule + " cannot run " + std::to_string(run_time_shape.d) + " ranks x " +
                       std::to_string(run_time_shape.v) + " chunks x " + std::to_string(run_time_shape.m) +
                       " microbatches: " + e.what());
  }

  // AdamW: GPT-2's rule, no weight decay on 1-d tensors (biases).
  const po::ParamGroup no_decay{"no decay", [](const po::ParamInfo& p) { return p.shape.size() < 2; }, 1.0f, 0.0f};
  const po::WarmupCosine adamw_lr{.lr = 1e-2f, .warmup_steps = 5, .total_steps = o.steps, .min_lr_ratio = 0.1f};
  const po::WarmupCosine sgd_lr{.lr = 5e-2f, .warmup_steps = 5, .total_steps = o.steps, .min_lr_ratio = 0.1f};
  for (const Entry& e : programs) {
    const Curve c = train(
        e.program, cfg, data, o,
        [&](Runtime& rt) { return po::AdamW(rt, {.weight_decay = 0.1f, .groups = {no_decay}}); }, adamw_lr);
    print("adamw, " + e.title, e.program, c);
  }
  for (const Entry& e : programs) {
    const Curve c = train(
        e.program, cfg, data, o, [](Runtime& rt) { return po::Sgd(rt, {.momentum = 0.9f, .nesterov = true}); }, sgd_lr);
    print("sgd, " + e.title, e.program, c);
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const bad_argument& e) {
    std::fprintf(stderr, "custom_model: %s\n", e.what());
    return 2;
  }
}
