// bench/gradient_paths: the gradient paths side by side, under MPI.
//
//   mpirun -np 4 ./build/bench/gradient_paths [--rounds N]   # dp = 2 replicas of PO-F, d = 2, v = 2
//
// The CPU GPT (4 blocks, h = 128, seq 64, batch 2, m = 8 per replica) trains with AdamW ZeRO-1
// under each variant in turn (the standard path; it with a bfloat16 reduce-scatter; it with
// the parameter gather left running into the next step, AdamWOptions::overlap_gather; the
// exact path), `rounds` times (default 5), each round a fresh runtime from the same initial
// parameters: one warm-up step, then 3 measured ones. Per step and variant, the slowest rank's
// forward_backward (enqueue to idle, reductions included), its gradient reductions (the sum of
// Runtime::reductions' durations), its optimizer step and the two together; medians over
// every measured step of every round, and ratios to the standard path. Rank 0 prints; state
// and traffic per parameter come from po::state_bytes and the communicator's counters (not
// counted with the overlapped gather, which is still running when the step returns).
#include <pipeoffload/comm/mpi/mpi.hpp>
#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include "../samples/cli.hpp"

namespace {

namespace po = pipeoffload;

struct Variant {
  const char* name;
  po::Gradients path;
  po::DType reduce_dtype;
  bool overlap;
};

struct Figures {
  std::vector<double> pass, reduce, update, step;  // seconds, the slowest rank's, per measured step
  double state = 0, traffic = 0;                   // bytes per parameter, the largest over ranks
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void one_round(po::comm::Mpi& world, po::comm::Mpi& pipe, po::comm::Mpi& reps, const Variant& var, Figures& f) {
  const int d = 2, g = world.rank(), r = g % d;
  const po::Shape sh{d, 2, 8};
  const po::gpt::GptConfig cfg{.hidden = 128, .heads = 4, .layers = 4, .seq = 64, .dropout = 0.0f};
  const po::MicrobatchShape mbs{2, cfg.seq};
  const po::Program program = po::PO_F::build(sh);
  po::backend::Cpu dev({.rank = g});
  std::vector<po::gpt::GptStage> layers;
  for (int c = 0; c < sh.v; ++c) layers.emplace_back(cfg, sh.stage_of(r, c), sh.stages());
  po::Runtime rt(program, dev, pipe, reps, std::span<po::gpt::GptStage>(layers),
                 {.microbatch = mbs, .gradients = var.path, .reduce_dtype = var.reduce_dtype});
  po::AdamW opt(rt, {.zero = 1, .overlap_gather = var.overlap});
  const std::size_t n = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(sh.m);
  std::vector<std::int32_t> tok(n), tgt(n);
  std::size_t params = 0;
  for (po::gpt::GptStage& l : layers) params += l.parameters().size();
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < n; ++i) {
      tok[i] = static_cast<std::int32_t>((i * 31 + static_cast<std::size_t>(step * 7 + reps.rank() * 13)) % 256);
      tgt[i] = static_cast<std::int32_t>((i * 17 + static_cast<std::size_t>(step)) % 256);
    }
    const std::vector<long long> shape = {static_cast<long long>(sh.m) * mbs.batch, mbs.seq};
    po::Batch batch;
    batch.add("tokens", tok, shape).add("targets", tgt, shape);
    if (!var.overlap) reps.reset_traffic();
    rt.zero_grad();
    const po::PassStats st = rt.forward_backward(batch, {.step = step});
    double reduce = 0;
    for (const auto& x : rt.reductions()) reduce += x.end - x.start;
    const auto t0 = std::chrono::steady_clock::now();
    opt.step(1e-3f, po::clip_scale(po::grad_norm(rt), 1.0f));
    const double update = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mine[5] = {
        st.seconds, reduce, update,
        static_cast<double>(rt.gradient_buffer_bytes() + opt.state_bytes() + 8 * params) / static_cast<double>(params),
        var.overlap ? 0.0 : static_cast<double>(reps.traffic().total()) / static_cast<double>(params)};
    std::vector<double> all(5 * static_cast<std::size_t>(world.size()));
    world.all_gather(std::span<const double>(mine), std::span(all));
    double worst[5] = {0, 0, 0, 0, 0}, step_s = 0;
    for (std::size_t k = 0; k < all.size(); ++k) worst[k % 5] = std::max(worst[k % 5], all[k]);
    for (std::size_t q = 0; q < all.size(); q += 5) step_s = std::max(step_s, all[q] + all[q + 2]);
    if (step == 0) continue;  // warm-up
    f.pass.push_back(worst[0]);
    f.reduce.push_back(worst[1]);
    f.update.push_back(worst[2]);
    f.step.push_back(step_s);
    f.state = worst[3];
    f.traffic = worst[4];
  }
}

}  // namespace

int main(int argc, char** argv) {
  po::comm::MpiSession session(argc, argv);
  int rounds = 5;
  try {
    cli::help(argc, argv, "usage: mpirun -np 4 gradient_paths [--rounds N]\n");
    constexpr cli::Flag flags[] = {{"--rounds"}};
    const cli::Args args(argc, argv, flags);
    if (const std::string* v = args.get("--rounds")) rounds = static_cast<int>(cli::to_int("--rounds", *v, 1, 1000));
  } catch (const cli::bad_argument& e) {
    if (session.rank() == 0) std::fprintf(stderr, "gradient_paths: %s\n", e.what());
    return 2;
  }
  po::comm::Mpi world;
  if (world.size() != 4) {
    if (world.rank() == 0) std::fprintf(stderr, "gradient_paths: run under mpirun -np 4 (got %d)\n", world.size());
    return 2;
  }
  const int d = 2, g = world.rank(), r = g % d, j = g / d;
  po::comm::Mpi pipe = world.split(j, r), reps = world.split(r, j);
  const Variant variants[] = {{"standard", po::Gradients::standard, po::DType::float32, false},
                              {"bf16-reduce", po::Gradients::standard, po::DType::bfloat16, false},
                              {"overlap", po::Gradients::standard, po::DType::float32, true},
                              {"exact", po::Gradients::exact, po::DType::float32, false}};
  std::vector<Figures> figures(std::size(variants));
  for (int round = 0; round < rounds; ++round)  // interleaved
    for (std::size_t k = 0; k < figures.size(); ++k) one_round(world, pipe, reps, variants[k], figures[k]);
  if (g == 0) {
    std::printf("gradient paths, dp = 2 x PO-F d = 2 v = 2 m = 8, CPU GPT h = 128, 4 blocks, AdamW ZeRO-1, %d rounds\n",
                rounds);
    std::printf("%-12s %9s %10s %10s %18s %14s %16s\n", "variant", "pass ms", "reduce ms", "update ms",
                "pass+update ms", "state B/param", "traffic B/param");
    const Figures& base = figures[0];
    for (std::size_t k = 0; k < figures.size(); ++k) {
      const Figures& f = figures[k];
      std::printf("%-12s %9.2f %10.2f %10.2f %9.2f (%.3fx) %14.2f %16s\n", variants[k].name, 1e3 * median(f.pass),
                  1e3 * median(f.reduce), 1e3 * median(f.update), 1e3 * median(f.step),
                  median(f.step) / median(base.step), f.state,
                  variants[k].overlap ? "-" : std::to_string(f.traffic).substr(0, 5).c_str());
    }
  }
  return 0;
}
