// bench/cuda/train_step.cpp: the steady-state training step of a GPT held by --ranks thread
// ranks in v chunks each, as a user runs it (zero_grad, forward_backward, grad_norm, clip,
// AdamW): after --warmup steps, --steps timed ones; median and p90 step time, tokens/s, MFU,
// host waits a step, device and pinned peaks, for each schedule asked, each run as usual and
// with its steps captured and replayed (RuntimeOptions::graphs; one rank only on a GPU), side
// by side in one run; from the runtime's traces of the last step run, the passes' and copies'
// busy shares, the measured k and the simulator's step under the measured times. Several
// ranks share the one GPU (comm::SharedGpu) or the CPU (comm::Threads). --backend cpu runs the
// CPU model through the same code (a check that it runs; no MFU). Exits 77 on --backend cuda
// without a GPU.
//   ./build/bench/cuda/train_step [--backend cuda] [--hidden 4096] [--seq 4096] [--heads 32]
//       [--layers 4] [--ranks 1] [--chunks 2] [--microbatches 8] [--batch 1] [--vocab 50304]
//       [--schedules po-f,gis-h,zb-v,1f1b-i] [--warmup 3] [--steps 10] [--peak-tflops P]
//       [--copy-streams 1|2] [--duplex-slowdown X]
// FLOPs and MFU: docs/benchmarks.md, "bench/cuda/train_step".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda.hpp>
#include <pipeoffload/cuda.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/sim/measure.hpp>
#include "../../samples/cli.hpp"

namespace po = pipeoffload;

namespace {

struct Settings {
  bool cuda = true;
  po::gpt::GptConfig cfg{};
  int ranks = 1, chunks = 2, microbatches = 8, batch = 1, warmup = 3, steps = 10;
  std::vector<std::string> schedules{"po-f", "gis-h", "zb-v", "1f1b-i"};
  double peak_tflops = 0;
  po::Costs costs{};         // the programs' build costs: unit passes, k = 1; --copy-streams, --duplex-slowdown
  bool reload_parts = true;  // --no-reload-parts: reloads whole (RuntimeOptions::reload_parts)
};

/// What one rank measured (rank_run), then the pipeline's figures (run).
struct Timing {
  std::vector<double> step_seconds;              // the timed steps, start to start (the last: to the end)
  double host_waits = 0;                         // per timed step (the pipeline: its most waiting rank)
  std::size_t device_held = 0, pinned_peak = 0;  // (the pipeline: its largest rank)
  float last_loss = 0;
  po::RankSim trace;  // the last forward_backward's op times (where the device ran each op)
  // From every rank's trace: first start to last end; busy seconds of passes and copies, a
  // rank on average; the measured k; po::simulate under the measured costs.
  double span = 0, passes = 0, copies = 0;
  double k = 0, simulated = 0;
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

/// Warm-up and timed steps of `program` on pipeline rank comm.rank(), on `dev`, with stages
/// made by `make(stage, stages)`.
template <class Stage, class Backend, class Comm, class Make>
Timing rank_run(const Settings& s, const po::Program& program, Backend& dev, Comm& comm, Make make, bool graphs) {
  const po::Shape& shape = program.shape;
  const po::MicrobatchShape mbs{s.batch, s.cfg.seq};
  std::vector<Stage> layers;
  layers.reserve(static_cast<std::size_t>(shape.v));
  for (int c = 0; c < shape.v; ++c) layers.push_back(make(shape.stage_of(comm.rank(), c), shape.stages()));
  po::Runtime rt(program, dev, comm, std::span<Stage>(layers),
                 {.microbatch = mbs, .graphs = graphs, .reload_parts = s.reload_parts});
  po::AdamW opt(rt);
  const po::WarmupCosine lr{.lr = 1e-4f, .warmup_steps = 1};
  const std::size_t n = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(shape.m);
  std::vector<std::int32_t> tok(n), tgt(n);
  for (std::size_t i = 0; i < n; ++i) {
    tok[i] = static_cast<std::int32_t>((i * 2654435761u) % static_cast<std::size_t>(s.cfg.vocab));
    tgt[i] = static_cast<std::int32_t>((i * 40503u + 7) % static_cast<std::size_t>(s.cfg.vocab));
  }
  const long long rows = static_cast<long long>(mbs.batch) * shape.m;
  po::Batch batch;
  batch.add("tokens", tok, {rows, mbs.seq}).add("targets", tgt, {rows, mbs.seq});
  Timing t;
  std::vector<double> starts;
  long long waits = 0;
  for (int step = 0; step < s.warmup + s.steps; ++step) {
    if (step == s.warmup) {
      dev.synchronize();
      dev.reset_peaks();
      waits = dev.host_waits();
    }
    if (step >= s.warmup) starts.push_back(now());
    rt.zero_grad();
    t.last_loss = rt.forward_backward(batch, {.step = step}).loss;
    opt.step(lr(step), po::clip_scale(po::grad_norm(rt), 1.0f));
  }
  dev.synchronize();
  starts.push_back(now());
  t.host_waits = static_cast<double>(dev.host_waits() - waits - 1) / s.steps;  // (less the closing wait)
  for (std::size_t i = 0; i + 1 < starts.size(); ++i) t.step_seconds.push_back(starts[i + 1] - starts[i]);
  t.device_held = dev.memory().device_held;
  t.pinned_peak = dev.memory().host_peak;
  t.trace = rt.trace();
  return t;
}

/// The pipeline's figures from its ranks' (`ranks[r]`: rank r's): rank 0's step times, the
/// most host waits and bytes of any rank, and from every rank's trace the span, the busy shares
/// (a rank on average), the measured k and the simulated step.
Timing pipeline_figures(const po::Program& program, std::vector<Timing> ranks) {
  Timing t = ranks[0];
  std::vector<po::RankSim> traces;
  double first = 1e300, last = -1e300;
  for (Timing& rk : ranks) {
    t.host_waits = std::max(t.host_waits, rk.host_waits);
    t.device_held = std::max(t.device_held, rk.device_held);
    t.pinned_peak = std::max(t.pinned_peak, rk.pinned_peak);
    const po::RankSim& tr = rk.trace;
    for (std::size_t x = 0; x < tr.compute_start.size(); ++x) {
      t.passes += tr.compute_end[x] - tr.compute_start[x];
      first = std::min(first, tr.compute_start[x]);
      last = std::max(last, tr.compute_end[x]);
    }
    for (std::size_t y = 0; y < tr.copy_start.size(); ++y) {
      t.copies += tr.copy_end[y] - tr.copy_start[y];
      first = std::min(first, tr.copy_start[y]);
      last = std::max(last, tr.copy_end[y]);
    }
    traces.push_back(std::move(rk.trace));
  }
  t.passes /= static_cast<double>(ranks.size());
  t.copies /= static_cast<double>(ranks.size());
  t.span = last - first;
  // (The program's own costs as the base: its copy streams and reload parts stay.)
  const po::Costs measured = po::measured_costs(program, std::span<const po::RankSim>(traces), program.costs);
  t.k = measured.k;
  t.simulated = po::simulate(program, measured).makespan;
  return t;
}

/// Every rank of `program` on its own thread: `rank(r, world)` returns rank r's Timing (its
/// device and communicator made on that thread); the first rank's error is thrown.
template <class Rank>
Timing run(const po::Program& program, Rank rank) {
  po::comm::ThreadsWorld world(program.shape.d);
  std::vector<Timing> ranks(static_cast<std::size_t>(program.shape.d));
  const std::vector<std::string> errors =
      po::run_thread_ranks(world, [&](int r) { ranks[static_cast<std::size_t>(r)] = rank(r, world); });
  for (const std::string& e : errors)
    if (!e.empty()) throw po::error(e);
  return pipeline_figures(program, std::move(ranks));
}

/// One schedule as usual and, where `graphs` allows, with graphs: a line each, and the ratio.
template <class Fn>
void compare(const Settings& s, const std::string& name, double flops_per_step, double tokens_per_step, bool graphs_too,
             Fn&& time) {
  po::Program program;
  try {
    program = po::build(po::parse_schedule(name), {s.ranks, s.chunks, s.microbatches}, s.costs);
  } catch (const std::exception& e) {
    std::printf("%-10s skipped: %s\n", name.c_str(), e.what());
    return;
  }
  double median[2] = {0, 0};
  for (const bool graphs : {false, true}) {
    if (graphs && !graphs_too) break;
    const Timing t = time(program, graphs);
    const double med = quantile(t.step_seconds, 0.5), p90 = quantile(t.step_seconds, 0.9);
    median[graphs] = med;
    std::printf("%-10s %-6s step %9.3f ms (p90 %9.3f)  %11.0f tokens/s", name.c_str(), graphs ? "graphs" : "run",
                med * 1e3, p90 * 1e3, tokens_per_step / med);
    if (s.cuda && s.peak_tflops > 0)
      std::printf("  MFU %5.1f%%", 100.0 * flops_per_step / med / (s.peak_tflops * 1e12));
    std::printf("  host waits %.1f  device %.2f GiB  pinned %.2f GiB  loss %.4f\n", t.host_waits,
                static_cast<double>(t.device_held) / (1ull << 30), static_cast<double>(t.pinned_peak) / (1ull << 30),
                static_cast<double>(t.last_loss));
    if (!graphs)  // (a replay records no times: its trace is the capture's)
      std::printf(
          "%-10s passes %.1f%% and copies %.1f%% of the passes' span %.3f ms; k measured %.3g; simulated "
          "%.3f ms from the measured passes (%.3f of the span)\n",
          name.c_str(), 100 * t.passes / t.span, 100 * t.copies / t.span, t.span * 1e3, t.k, t.simulated * 1e3,
          t.simulated / t.span);
  }
  if (graphs_too) std::printf("%-10s graphs / run: %.3f\n", name.c_str(), median[1] / median[0]);
}

Settings parse(int argc, char** argv) {
  cli::help(argc, argv,
            "usage: train_step [--backend cuda] [--hidden 4096] [--seq 4096] [--heads 32] [--layers 4] [--ranks 1]\n"
            "                  [--chunks 2] [--microbatches 8] [--batch 1] [--vocab 50304]\n"
            "                  [--schedules po-f,gis-h,zb-v,1f1b-i] [--warmup 3] [--steps 10] [--peak-tflops P]\n"
            "                  [--copy-streams 1|2] [--duplex-slowdown X] [--no-reload-parts]\n"
            "  --copy-streams 2: offloads and reloads on streams of their own (Costs::copy_streams), the\n"
            "  schedules built with Costs::duplex_slowdown X (default 1)\n"
            "  --no-reload-parts: each offloaded unit reloads whole, its B after it (default: the head's part,\n"
            "  then each block's, the B starting at the first; Costs::reload_shares)\n"
            "  --ranks D: D pipeline ranks as threads sharing the one GPU (or the CPU); with graphs only at D = 1 on a "
            "GPU\n");
  constexpr cli::Flag flags[] = {{"--backend"},      {"--hidden"},          {"--seq"},
                                 {"--heads"},        {"--layers"},          {"--ranks"},
                                 {"--chunks"},       {"--microbatches"},    {"--batch"},
                                 {"--vocab"},        {"--schedules"},       {"--warmup"},
                                 {"--steps"},        {"--dropout"},         {"--peak-tflops"},
                                 {"--copy-streams"}, {"--duplex-slowdown"}, {"--no-reload-parts", false}};
  const cli::Args args(argc, argv, flags);
  Settings s;
  s.cfg.hidden = 4096;
  s.cfg.seq = 4096;
  s.cfg.heads = 32;
  s.cfg.layers = 4;
  s.cfg.vocab = 50304;
  const auto get = [&](std::string_view f, int& out, long long lo, long long hi) {
    if (const std::string* v = args.get(f)) out = static_cast<int>(cli::to_int(f, *v, lo, hi));
  };
  if (const std::string* v = args.get("--backend")) s.cuda = cli::one_of("--backend", *v, {"cuda", "cpu"}) == "cuda";
  get("--hidden", s.cfg.hidden, 8, 65536);
  get("--seq", s.cfg.seq, 1, 1 << 20);
  get("--heads", s.cfg.heads, 1, 1024);
  get("--layers", s.cfg.layers, 1, 1024);
  get("--ranks", s.ranks, 1, 64);
  get("--chunks", s.chunks, 1, 64);
  get("--microbatches", s.microbatches, 1, 4096);
  get("--batch", s.batch, 1, 4096);
  get("--vocab", s.cfg.vocab, 2, 1 << 20);
  get("--warmup", s.warmup, 2, 1000);  // (a captured kind runs once, then is captured: 2 steps)
  get("--steps", s.steps, 1, 100000);
  if (const std::string* v = args.get("--dropout"))
    s.cfg.dropout = static_cast<float>(cli::to_real("--dropout", *v, 0, 1, false));
  if (const std::string* v = args.get("--peak-tflops")) s.peak_tflops = cli::to_real("--peak-tflops", *v, 0, 1e6, true);
  const cli::CopyStreams streams = cli::copy_streams(args, false);
  s.costs.copy_streams = streams.streams;
  s.costs.duplex_slowdown = streams.slowdown;
  s.reload_parts = !args.has("--no-reload-parts");
  if (const std::string* v = args.get("--schedules")) {
    s.schedules.clear();
    std::stringstream in(*v);
    for (std::string name; std::getline(in, name, ',');) {
      if (po::find_schedule(name) == nullptr)
        throw cli::bad_argument("--schedules: " + cli::quote(name) + " is not a schedule (pipeoffload-plan --list)");
      s.schedules.push_back(name);
    }
  }
  if (s.cfg.hidden % s.cfg.heads != 0)
    throw cli::bad_argument("--heads " + std::to_string(s.cfg.heads) + " must divide --hidden " +
                            std::to_string(s.cfg.hidden));
  if (s.cfg.layers < s.ranks * s.chunks)
    throw cli::bad_argument("--layers " + std::to_string(s.cfg.layers) + " must be at least --ranks x --chunks = " +
                            std::to_string(s.ranks * s.chunks) + " (a block a stage)");
  // The stages' saved_parts, as the schedules are timed (po::stacked_saved_parts: the head's, the blocks').
  const int S = s.ranks * s.chunks;
  for (int st = 0; s.reload_parts && st < S; ++st) {
    const po::gpt::GptDims d = po::gpt::gpt_dims(s.cfg, st, S);
    const po::MicrobatchShape mb{s.batch, s.cfg.seq};
    s.costs.reload_shares.push_back(po::saved_part_shares(s.cuda ? po::gpt::gpt_cuda_saved_parts(d, mb.tokens())
                                                                 : po::gpt::gpt_cpu_bytes::saved_parts(d, mb)));
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s = cli::parsed_or_exit("train_step", [&] { return parse(argc, argv); });
  const double b = s.batch, seq = s.cfg.seq, h = s.cfg.hidden, V = s.cfg.vocab;
  // A step's FLOPs: every block's F+B+W, 12 b s h (6h + s) (gpt_block_gpu's count), and the
  // head's GEMM, 6 b s h V, for each microbatch.
  const double flops = s.microbatches * (s.cfg.layers * 12 * b * seq * h * (6 * h + seq) + 6 * b * seq * h * V);
  const double tokens = s.microbatches * b * seq;
  try {
    if (!s.cuda) {
      std::printf("train_step --backend cpu: h %d, s %d, %d layers, %d ranks x %d chunks, %d microbatches of %d\n",
                  s.cfg.hidden, s.cfg.seq, s.cfg.layers, s.ranks, s.chunks, s.microbatches, s.batch);
      for (const std::string& name : s.schedules)
        compare(s, name, flops, tokens, true, [&](const po::Program& p, bool graphs) {
          return run(p, [&](int r, po::comm::ThreadsWorld& world) {
            po::backend::Cpu dev({.rank = r});
            po::comm::Threads comm(world, r);
            return rank_run<po::gpt::GptStage>(
                s, p, dev, comm, [&](int st, int S) { return po::gpt::GptStage(s.cfg, st, S); }, graphs);
          });
        });
      return 0;
    }
    if (po::backend::device_count() == 0) {
      std::printf("train_step: no GPU; skipped\n");
      return 77;
    }
    cudaDeviceProp prop{};
    PIPEOFFLOAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (s.peak_tflops == 0) s.peak_tflops = prop.major == 8 ? 312 : prop.major == 9 ? 989 : prop.major == 10 ? 2250 : 0;
    std::printf(
        "train_step on %s (bf16 peak %.0f TFLOP/s): h %d, s %d, %d layers, %d ranks x %d chunks, %d "
        "microbatches of %d; %.1f TFLOP a step\n",
        prop.name, s.peak_tflops, s.cfg.hidden, s.cfg.seq, s.cfg.layers, s.ranks, s.chunks, s.microbatches, s.batch,
        flops / 1e12);
    const po::MicrobatchShape mbs{s.batch, s.cfg.seq};
    // Several ranks share the GPU: each takes 3/4 of an equal share of its free memory for its
    // arena (its stages' own buffers come from the rest).
    const std::size_t share = po::backend::device_memory(0).free / static_cast<std::size_t>(s.ranks) / 4 * 3;
    for (const std::string& name : s.schedules)
      compare(s, name, flops, tokens, s.ranks == 1, [&](const po::Program& p, bool graphs) {
        return run(p, [&](int r, po::comm::ThreadsWorld& world) {
          po::backend::Cuda dev({.rank = r, .arena_bytes = s.ranks == 1 ? 0 : share});
          po::comm::SharedGpu comm(world, r);
          return rank_run<po::gpt::CudaGptStage>(
              s, p, dev, comm, [&](int st, int S) { return po::gpt::CudaGptStage(dev, s.cfg, st, S, mbs); }, graphs);
        });
      });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
