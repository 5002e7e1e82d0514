// samples/train_gpt: trains a small byte-level GPT on data/corpus.txt with d pipeline ranks,
// as threads of one process or as MPI processes, under any schedule, with real activation
// offload, on the CPU backend or (--backend cuda, a CUDA build) one GPU per rank.
//
//   ./build/samples/train_gpt --schedule po-f --ranks 4 --chunks 2 --microbatches 8 --steps 200
//   ./build/samples/train_gpt --ranks 1 --chunks 1 --microbatches 8 --steps 200   # one-rank reference
//   ./build/samples/train_gpt --schedule po-f --ranks 4 --chunks 2 --microbatches 8 --steps 5 --copy-gbps 0.5 --trace po-f.json
//   mpirun -np 4 ./build/samples/train_gpt --comm mpi --schedule po-f --chunks 2 --microbatches 8 --steps 200
//   ./build/samples/train_gpt ... --checkpoint-every 50 --checkpoint-dir ckpt     # then: ... --resume ckpt
//   ./build/samples/train_gpt --backend cuda --schedule po-f --ranks 2 --chunks 2 --microbatches 8   # 2 GPUs, NCCL
//
// The last two lines, `final_loss=...` and `params_hash=...`, are the same for every schedule,
// rank count and communicator with the same model, data and seed (bit-exact pipelining), and
// for a run resumed from a checkpoint; scripts compare them.
#include <models/gpt/cpu.hpp>
#include <models/llama/cpu.hpp>
#include <pipeoffload/comm/handshake.hpp>
#include <pipeoffload/fnv1a.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>
#include <pipeoffload/sim/render.hpp>
#ifdef PIPEOFFLOAD_WITH_MPI
#include <pipeoffload/comm/mpi/mpi.hpp>
#endif
#ifdef PIPEOFFLOAD_WITH_CUDA
#include <models/gpt/cuda.hpp>
#include <models/llama/cuda.hpp>
#include <pipeoffload/cuda.hpp>
#ifdef PIPEOFFLOAD_WITH_MPI
#include <pipeoffload/comm/mpi/nccl_id.hpp>
#endif
#endif

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <thread>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "train_gpt_memory.hpp"
#include "train_gpt_options.hpp"
#include "train_gpt_report.hpp"

namespace {

using cli::bad_argument;
using cli::hex64;
using cli::mib;
using train_gpt::exit_status;
using train_gpt::Options;
using train_gpt::print_banner;
using train_gpt::Setup;

/// A model's stage (the GPT's or the Llama's, on the CPU or the GPU) with an optional injected
/// fault: the runtime sees it as the layer type, so a fault fires inside a real forward pass,
/// mid-iteration, with other passes in flight. `args` construct the stage.
template <class Base>
struct Faulty : Base {
  template <class... Args>
  Faulty(const Options::Fault* fault, int replicas, Args&&... args)
      : Base(std::forward<Args>(args)...), fault_(fault), replicas_(replicas) {}
  template <class Context>
  void forward(Context& ctx, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y, std::byte* saved) {
    // The second forward pass of the step on this stage (the first with one microbatch per
    // replica): mid-iteration, with other passes in flight.
    if (fault_ != nullptr && mb.training && mb.step == fault_->step &&
        ++forwards_ == std::min(2, mb.microbatches / replicas_)) {
      std::fprintf(stderr, "train_gpt: rank %d: injecting '%s' in F(stage %d, mb %d) of step %d\n", fault_->rank,
                   fault_->kind.c_str(), mb.stage, mb.mb, mb.step);
      std::fflush(stderr);
      if (fault_->kind == "kill") std::raise(SIGKILL);
      if (fault_->kind == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
      throw po::error("injected fault (--inject-fault " + std::to_string(fault_->rank) + ":" +
                      std::to_string(fault_->step) + ":throw)");
    }
    Base::forward(ctx, mb, x, y, saved);
  }

 private:
  const Options::Fault* fault_;
  int replicas_ = 1;
  int forwards_ = 0;
};

/// The first SIGINT or SIGTERM (0: none): every rank stops at the end of the step in which its
/// process saw it (after saving a checkpoint when checkpointing is on) and the run exits
/// 128 + the signal. A second signal ends the process at once, as if there were no handler.
std::atomic<int> stop_signal{0};

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (!stop_signal.compare_exchange_strong(none, sig)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  static constexpr char note[] =
      "train_gpt: signal received: stopping at the end of this step (a second one ends the run at once)\n";
  [[maybe_unused]] const ::ssize_t n = ::write(STDERR_FILENO, note, sizeof note - 1);
}

void catch_stop_signals() {
  struct sigaction sa{};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &sa, nullptr);
}

/// Every rank's `mine`, whatever their lengths (a collective: every rank calls it): the
/// lengths first, then the values padded to the longest.
template <class T, class Comm>
std::vector<std::vector<T>> gather_ragged(Comm& comm, std::span<const T> mine) {
  const std::size_t d = static_cast<std::size_t>(comm.size()), n = mine.size();
  std::vector<std::size_t> lengths(d);
  comm.all_gather(std::span<const std::size_t>(&n, 1), std::span(lengths));
  const std::size_t width = *std::max_element(lengths.begin(), lengths.end());
  std::vector<T> padded(width), all(width * d);
  std::copy(mine.begin(), mine.end(), padded.begin());
  comm.all_gather(std::span<const T>(padded), std::span(all));
  std::vector<std::vector<T>> out(d);
  for (std::size_t q = 0; q < d; ++q) out[q].assign(all.data() + q * width, all.data() + q * width + lengths[q]);
  return out;
}

/// --k auto: one forward and backward of `batch` (step 0's) under the schedule with every
/// chunk offloaded (so that every stage's copies are timed), on a runtime of its own that is
/// gone before training starts; its gradients are dropped (step 0 then trains from zero
/// gradients, as always). Every rank gathers the pipeline's traces and derives the same
/// po::measured_costs; replica 0's are every replica's (one program for all). The lead prints
/// the measured k and, under the measured times, the simulated step of the schedule rebuilt
/// with them against the one built with k = 1.
template <class Comm, class Device, class Layer>
po::Costs measure_costs(const Options& o, const Setup& su, Comm& comm, Comm& replicas, Device& dev,
                        std::vector<Layer>& mine, const po::Batch& batch, bool lead) {
  const po::Program probe = train_gpt::probe_program(o, su.costs);
  const po::Shape& sh = probe.shape;
  std::vector<po::RankSim> traces(static_cast<std::size_t>(sh.d));
  {
    // Reloads whole: a B timed from its start then includes no wait for the rest of its unit.
    po::RuntimeOptions whole = su.runtime;
    whole.reload_parts = false;
    po::Runtime prt(probe, dev, comm, replicas, std::span<Layer>(mine), whole);
    prt.zero_grad();
    prt.forward_backward(batch, {.step = 0});
    for (auto times :
         {&po::RankSim::compute_start, &po::RankSim::compute_end, &po::RankSim::copy_start, &po::RankSim::copy_end}) {
      std::vector<std::vector<double>> got = gather_ragged<double>(comm, prt.trace().*times);
      for (std::size_t q = 0; q < traces.size(); ++q) traces[q].*times = std::move(got[q]);
    }
    prt.zero_grad();
  }
  po::Costs measured = po::measured_costs(probe, traces, probe.costs);
  measured.copy_streams = su.costs.copy_streams;  // (the probe times each copy alone, on one stream)
  measured.duplex_slowdown = su.costs.duplex_slowdown;
  measured.reload_shares = su.costs.reload_shares;
  // Replica 0's, on every replica: F, B, W of each stage, then k.
  const std::size_t S = static_cast<std::size_t>(sh.stages()), width = 3 * S + 1;
  std::vector<double> packed, every(width * static_cast<std::size_t>(o.dp));
  for (const auto* v : {&measured.stage_f, &measured.stage_b, &measured.stage_w})
    packed.insert(packed.end(), v->begin(), v->end());
  packed.push_back(measured.k);
  replicas.all_gather(std::span<const double>(packed), std::span(every));
  for (std::size_t i = 0; i < S; ++i) {
    measured.stage_f[i] = every[i];
    measured.stage_b[i] = every[S + i];
    measured.stage_w[i] = every[2 * S + i];
  }
  measured.k = every[3 * S];
  if (lead && !o.quiet) {
    const po::Program rebuilt = train_gpt::program_of(o, measured), fixed = train_gpt::program_of(o, su.costs);
    std::printf(
        "k auto: measured k = %.4g; simulated step under the measured times: %.4g s as rebuilt, %.4g s "
        "with --k %.4g\n",
        measured.k, po::simulate(rebuilt, measured).makespan, po::simulate(fixed, measured).makespan, o.k);
  }
  return measured;
}

/// The arena reset_arena gives `dev` for the program it runs after --k auto's profiling pass:
/// backend::Cpu has no size (0); backend::Cuda's slab is what train_gpt::cuda_arena_bytes
/// counts for that program (its workspace as constructed).
std::size_t arena_bytes(const Options&, const Setup&, const po::Program&, int, int, const po::backend::Cpu&) {
  return 0;
}
/// The slab `dev` holds now (backend::Cpu has none).
std::size_t slab_bytes(const po::backend::Cpu&) { return 0; }
#ifdef PIPEOFFLOAD_WITH_CUDA
std::size_t arena_bytes(const Options& o, const Setup& su, const po::Program& program, int r, int replica,
                        const po::backend::Cuda& dev) {
  return train_gpt::cuda_arena_bytes(o, su, program, r, replica, dev.options().workspace_bytes);
}
std::size_t slab_bytes(const po::backend::Cuda& dev) { return dev.options().arena_bytes; }
#endif

/// One rank's whole run on `dev` with its v stages `mine`, the same code under threads and
/// MPI and on every backend: handshake, train, checkpoint, then gather what global rank 0
/// prints (peaks, unit sizes, traces, parameters for the hash). `comm` connects the rank's
/// pipeline, `replicas` its data-parallel peers (dp of them, replica order). `pair`: the
/// PCIe-pair link of this rank and rank^1 (thread ranks share one; MPI ranks, separate
/// processes, run unpaired), or null. `barrier` lines up the ranks that share this process
/// and its GPUs' driver (--backend cuda --comm threads: NcclWorld::host_barrier; with
/// --ranks-per-gpu a host all-gather over both groups) after each rank has made its
/// allocations and before its first NCCL kernel: once before the handshake (the stages are
/// built) and once before the first step (the runtime and optimizer are); with --k auto also
/// around the slabs made again (remake_arena).
/// Returns 0, or 128 + the signal when a stop signal ended the run early (stop_signal).
template <class Comm, class Device, class Layer>
int train_rank(
    const Options& o, const Setup& su, Comm& comm, Comm& replicas, Device& dev, std::vector<Layer>& mine,
    std::chrono::steady_clock::time_point t_start, po::PairLink<Device>* pair = nullptr,
    const std::function<void()>& barrier = [] {}, std::vector<std::vector<float>> initial = {}) {
  const int r = comm.rank(), replica = replicas.rank();
  const bool lead = r == 0 && replica == 0;  // global rank 0 prints
  const po::Shape sh = o.shape;
  const po::MicrobatchShape mbs = su.runtime.microbatch;
  const std::size_t seq = static_cast<std::size_t>(o.model.seq);
  barrier();
  // Before the first pipeline message: every rank must run the same configuration.
  po::handshake(comm, su.fields);
  po::handshake(replicas, su.fields);
  // Peaks of every rank so far (rank 0 prints them): activation, device total, pinned host.
  std::vector<std::size_t> peaks(3 * static_cast<std::size_t>(sh.d), 0);
  std::vector<std::int32_t> tok(su.tokens_per_step), tgt(su.tokens_per_step), offsets;
  const std::vector<long long> shape = {static_cast<long long>(sh.m) * mbs.batch, mbs.seq};
  // Sequences starting at src[from + at] for each sequence q's draw `at`, as a batch: this
  // replica's share of the global batch (its sequences are the global ones after the
  // earlier replicas').
  const std::size_t sequences = su.tokens_per_step / seq, offset = static_cast<std::size_t>(replica) * sequences;
  const auto batch_at = [&](const sample::Tokens& src, std::size_t from, auto&& draw) {
    for (std::size_t q = 0; q < sequences; ++q) {
      const std::size_t at = from + draw(offset + q);
      for (std::size_t t = 0; t < seq; ++t) {
        tok[q * seq + t] = static_cast<std::int32_t>(src[at + t]);
        tgt[q * seq + t] = static_cast<std::int32_t>(src[at + t + 1]);
      }
    }
    po::Batch b;
    b.add("tokens", tok, shape).add("targets", tgt, shape);
    if (o.pack >= 0) {  // --pack: each sequence's documents, one starting at every boundary token
      offsets = po::document_offsets(tok, mbs.seq, o.pack);
      b.add(po::document_offsets_input, offsets, {shape[0], shape[1] + 1});
    }
    return b;
  };
  // The step's batch: sequences drawn from (seed, step), so a resumed run reads the batches an
  // uninterrupted one would.
  const auto step_batch = [&](int step) {
    return batch_at(su.tokens, 0, [&](std::size_t q) {
      return po::ops::mix64(o.seed, static_cast<std::uint64_t>(step) * 1000003u + q) % (su.train_tokens - seq - 1);
    });
  };
  // --k auto: the schedule built from a profiling pass's measured times (measure_costs).
  // Its runtime is gone: the arena starts over, sized for the program the run builds (on a GPU
  // the slab is the rebuilt program's; without this the two runtimes' reservations add up).
  // The ranks that share this process line up first: no slab is freed while another's NCCL
  // kernel may still be launched; ranks that share a GPU then make theirs in turns.
  const po::Costs costs = o.k_auto ? measure_costs(o, su, comm, replicas, dev, mine, step_batch(0), lead) : su.costs;
  if (o.k_auto) {
    barrier();
    train_gpt::remake_arena(dev, arena_bytes(o, su, train_gpt::program_of(o, costs), r, replica, dev), slab_bytes(dev),
                            o.ranks_per_gpu > 1, barrier);
  }
  const po::Program program = train_gpt::program_of(o, costs);
  if (lead && !o.quiet && o.copy_streams == 0)
    std::printf("copy streams: %d (auto: the faster in the simulator)\n", program.costs.copy_streams);
  po::Runtime rt(program, dev, comm, replicas, std::span<Layer>(mine), su.runtime);
  if (pair != nullptr) rt.pair_with(*pair);
  po::AdamW opt(rt, su.adamw);
  // bf16 stages: the optimizer's fp32 master starts from the model's fp32 initial values, not
  // from their bf16 rounding (a resume overwrites it from the checkpoint).
  for (std::size_t c = 0; c < initial.size(); ++c)
    if (opt.has_master(static_cast<int>(c))) opt.set_full_master(static_cast<int>(c), initial[c]);
  initial = {};
  barrier();
  int first = 0;
  if (!o.resume.empty()) {
    const po::CheckpointInfo info = po::load_checkpoint(o.resume, rt, opt, su.config_hash, su.config);
    first = opt.steps_taken();
    if (info.data_position != first || info.rng_seed != o.seed)
      throw po::checkpoint_error("checkpoint: " + o.resume + " has data position " +
                                 std::to_string(info.data_position) + " and seed " + std::to_string(info.rng_seed) +
                                 "; expected " + std::to_string(first) + " and " + std::to_string(o.seed));
    if (first >= o.steps)
      throw po::checkpoint_error("checkpoint: " + o.resume + " is at step " + std::to_string(first) +
                                 ", already at --steps " + std::to_string(o.steps) + "; nothing to resume");
    if (lead && !o.quiet) std::printf("resumed from %s at step %d\n", o.resume.c_str(), first);
  }
  double tokens_seconds = 0;
  std::vector<double> fb_seconds;  // each step's forward_backward (--k auto sets it beside the simulator's)
  float final_loss = 0;
  std::uint64_t step_traffic = 0;  // bytes this rank sent in the last step's replica collectives
  for (int step = first; step < o.steps; ++step) {
    const po::Batch batch = step_batch(step);
    // The last step's replica traffic is counted whole: the step before it has finished its
    // (overlapped) parameter gather first.
    const bool last = step + 1 == o.steps;
    if (last) {
      rt.settle();
      replicas.reset_traffic();
    }
    // The training step, call by call: gradients of one batch, their norm, one AdamW update.
    rt.zero_grad();
    const po::PassStats st = rt.forward_backward(batch, {.step = step});
    const double norm = po::grad_norm(rt);
    tokens_seconds += st.seconds;
    fb_seconds.push_back(st.seconds);
    final_loss = st.loss;
    // The peaks, and whether a stop signal came (the largest signal number any rank saw):
    // every rank of every replica decides from the same value. Before the update, whose
    // parameter gather may still run on the replicas' communicator when it returns.
    const std::size_t my[4] = {st.memory.peak_of(po::backend::Memory::activation), st.memory.total_peak,
                               st.memory.host_peak, static_cast<std::size_t>(stop_signal.load())};
    std::vector<std::size_t> now(4 * static_cast<std::size_t>(sh.d));
    comm.all_gather(std::span<const std::size_t>(my), std::span(now));
    std::size_t stop = 0;
    for (std::size_t q = 0; q < static_cast<std::size_t>(sh.d); ++q) {
      for (std::size_t k = 0; k < 3; ++k) peaks[3 * q + k] = std::max(peaks[3 * q + k], now[4 * q + k]);
      stop = std::max(stop, now[4 * q + 3]);
    }
    if (o.dp > 1) {
      std::vector<std::size_t> stops(static_cast<std::size_t>(o.dp));
      replicas.all_gather(std::span<const std::size_t>(&stop, 1), std::span(stops));
      stop = *std::max_element(stops.begin(), stops.end());
    }
    const float lr = su.lr(step);
    opt.step(lr, po::clip_scale(norm, su.clip));
    if (last) {
      rt.settle();
      step_traffic = replicas.traffic().total();
    }
    const bool save = o.checkpoint_every > 0 && ((step + 1) % o.checkpoint_every == 0 || stop != 0);
    if (save)
      po::save_checkpoint(o.checkpoint_dir, rt, opt,
                          {su.config_hash, o.seed, static_cast<std::int64_t>(step + 1), su.config});
    if (stop != 0) {
      if (lead) {
        std::fprintf(stderr, "train_gpt: stopped by %s after step %d of %d; %s\n",
                     stop == SIGINT ? "SIGINT" : "SIGTERM", step + 1, o.steps,
                     save ? ("checkpoint saved in " +
                             (std::filesystem::path(o.checkpoint_dir) / po::checkpoint::step_name(step + 1)).string() +
                             " (continue with --resume " + o.checkpoint_dir + ")")
                                .c_str()
                          : "no checkpoint saved (--checkpoint-every was not given)");
        std::fflush(stderr);
      }
      if (o.dp > 1) {
        // Every replica has enqueued its part of the optimizer's overlapped gathers before any
        // tears down: on a shared GPU (comm::SharedGpu) they wait for each other's events.
        std::vector<std::size_t> stops(static_cast<std::size_t>(o.dp));
        replicas.all_gather(std::span<const std::size_t>(&stop, 1), std::span(stops));
      }
      return static_cast<int>(128 + stop);
    }
    if (o.eval_every > 0 && ((step + 1) % o.eval_every == 0 || step + 1 == o.steps)) {
      // The same held-out sequences every time: m microbatches from the held-out tokens.
      const std::size_t held_out = su.held_end - su.held_begin;
      const po::PassStats val = rt.evaluate(batch_at(su.held, su.held_begin, [&](std::size_t q) {
        return po::ops::mix64(o.seed ^ 0x5eedULL, q) % (held_out - seq - 1);
      }));
      if (lead) {
        std::printf("eval step %d/%d: val_loss %.4f (train loss %.4f)\n", step + 1, o.steps,
                    static_cast<double>(val.loss), static_cast<double>(st.loss));
        std::fflush(stdout);
      }
    }
    if (lead) {
      const bool report =
          !o.quiet && (step == first || (step + 1) % std::max(1, o.steps / 20) == 0 || step + 1 == o.steps);
      if (report) {
        const int width = 20, done = (step + 1) * width / o.steps;
        std::string bar(static_cast<std::size_t>(done), '#');
        bar.resize(static_cast<std::size_t>(width), '.');
        std::string line;
        for (int q = 0; q < sh.d; ++q) line += (q ? " " : "") + mib(peaks[3 * static_cast<std::size_t>(q)]);
        std::printf("[%s] step %d/%d loss %.4f lr %.2e | %.0f tokens/s | peak activation MiB per rank: %s\n",
                    bar.c_str(), step + 1, o.steps, static_cast<double>(st.loss), static_cast<double>(lr),
                    static_cast<double>(su.tokens_per_step) * o.dp * (step + 1 - first) / tokens_seconds, line.c_str());
        std::fflush(stdout);
      }
    }
  }

  // --k auto: what the rebuilt program took against what the simulator said it would under the
  // measured costs (the median after the first step, which warms the pools and caches).
  if (o.k_auto && lead && !o.quiet && !fb_seconds.empty()) {
    const std::size_t skip = fb_seconds.size() > 1 ? 1 : 0, n = fb_seconds.size() - skip;
    std::vector<double> t(fb_seconds.begin() + static_cast<std::ptrdiff_t>(skip), fb_seconds.end());
    std::sort(t.begin(), t.end());
    const double median = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
    std::printf(
        "k auto: the rebuilt program's forward and backward: %.4g s measured (median of %zu steps%s), %.4g s "
        "simulated\n",
        median, n, skip ? " after the first" : "", po::simulate(rt.program(), costs).makespan);
  }

  // Unit bytes of every stage, for the simulator's view of this run and of 1F1B-I.
  std::vector<std::size_t> my_units(static_cast<std::size_t>(sh.v)), units(static_cast<std::size_t>(sh.stages()));
  for (int c = 0; c < sh.v; ++c)
    my_units[static_cast<std::size_t>(c)] = mine[static_cast<std::size_t>(c)].saved_bytes(mbs);
  comm.all_gather(std::span<const std::size_t>(my_units), std::span(units));  // [rank * v + chunk]
  // The last step's measured op times of every rank.
  std::vector<po::RankSim> traces(static_cast<std::size_t>(sh.d));
  if (o.trace)
    for (auto times :
         {&po::RankSim::compute_start, &po::RankSim::compute_end, &po::RankSim::copy_start, &po::RankSim::copy_end}) {
      std::vector<std::vector<double>> all = gather_ragged<double>(comm, rt.trace().*times);
      for (std::size_t q = 0; q < traces.size(); ++q) traces[q].*times = std::move(all[q]);
    }
  // Every stage's parameters for rank 0's hash, through all_gather (host memory on every
  // communicator).
  std::vector<std::vector<float>> params(static_cast<std::size_t>(sh.stages()));
  for (int c = 0; c < sh.v; ++c) {
    std::vector<std::vector<float>> all = gather_ragged<float>(comm, rt.download_parameters(c));
    for (int q = 0; q < sh.d; ++q)
      params[static_cast<std::size_t>(sh.stage_of(q, c))] = std::move(all[static_cast<std::size_t>(q)]);
  }
  // Model state per parameter, the largest over ranks: the stages' own parameters and
  // gradients, the runtime's gradient buffers and the optimizer's state; and the bytes sent
  // in the last step's gradient and parameter collectives.
  std::size_t rank_params = 0, held = rt.gradient_buffer_bytes() + opt.state_bytes();
  for (Layer& l : mine) {
    rank_params += l.gradients().size();  // one fp32 gradient a parameter
    held += train_gpt::layer_state_bytes(l);
  }
  const double n = static_cast<double>(std::max<std::size_t>(1, rank_params));
  const double my_figures[2] = {static_cast<double>(held) / n, static_cast<double>(step_traffic) / n};
  std::vector<double> pipe(2 * static_cast<std::size_t>(sh.d)), reps(2 * static_cast<std::size_t>(o.dp));
  comm.all_gather(std::span<const double>(my_figures), std::span(pipe));
  double worst[2] = {0, 0};
  for (std::size_t q = 0; q < pipe.size(); ++q) worst[q % 2] = std::max(worst[q % 2], pipe[q]);
  replicas.all_gather(std::span<const double>(worst), std::span(reps));
  for (std::size_t q = 0; q < reps.size(); ++q) worst[q % 2] = std::max(worst[q % 2], reps[q]);
  // What each pipeline rank reserved: its arena's blocks and its stages' own buffers.
  std::size_t my_reserved = dev.memory().device_held;
  for (Layer& l : mine) my_reserved += train_gpt::layer_reserved_bytes(l);
  std::vector<std::size_t> reserved(static_cast<std::size_t>(sh.d));
  comm.all_gather(std::span<const std::size_t>(&my_reserved, 1), std::span(reserved));
  if (lead)
    report(o, su, params, rt.program(), first, peaks, units, traces, final_loss, t_start,
           {opt.state_bytes(), worst[0], worst[1], reserved});
  // Nobody leaves (and exits 0) before global rank 0 has printed everything: if it fails
  // there, this wait fails on every rank instead.
  const double done = 1;
  std::vector<double> all_done(static_cast<std::size_t>(sh.d)), replicas_done(static_cast<std::size_t>(o.dp));
  replicas.all_gather(std::span<const double>(&done, 1), std::span(replicas_done));
  comm.all_gather(std::span<const double>(&done, 1), std::span(all_done));
  return 0;
}

/// Rank r's link with its PCIe partner r^1 (links[p] joins ranks 2p and 2p+1), or null.
template <class Device>
po::PairLink<Device>* link_of(const std::vector<std::unique_ptr<po::PairLink<Device>>>& links, int r) {
  const auto p = static_cast<std::size_t>(r / 2);
  return p < links.size() ? links[p].get() : nullptr;
}

/// Global rank g's v stages on the CPU (with the injected fault, if it is this rank's).
/// Global rank g's v stages of the run's model on the CPU, handed to `fn` (which returns what
/// the rank returns).
template <class F>
auto with_cpu_stages(const Options& o, int g, F&& fn) {
  const int r = g % o.shape.d;
  const auto make = [&]<class Layer>(const auto& cfg) {
    std::vector<Faulty<Layer>> mine;
    mine.reserve(static_cast<std::size_t>(o.shape.v));
    for (int c = 0; c < o.shape.v; ++c)
      mine.emplace_back(o.fault.rank == g ? &o.fault : nullptr, o.dp, cfg, o.shape.stage_of(r, c), o.shape.stages());
    return fn(mine);
  };
  if (o.llama) return make.template operator()<po::llama::LlamaStage>(train_gpt::llama_config(o));
  return make.template operator()<po::gpt::GptStage>(o.model);
}

#ifdef PIPEOFFLOAD_WITH_CUDA
/// Global rank g's v stages on the GPU (with the injected fault, if it is this rank's), from
/// the CPU model's initial parameters (kept in `initial`, fp32, for the optimizer's master
/// copy: the stages hold them rounded to bf16), handed to `fn`; returns what fn returns. Either
/// model's CUDA stage, with bf16 boundaries: every stage is a GPU stage computing in bf16.
template <class Fn>
int with_cuda_stages(const Options& o, const Setup& su, po::backend::Cuda& dev, int g,
                     std::vector<std::vector<float>>& initial, Fn&& fn) {
  const int r = g % o.shape.d;
  const auto make = [&]<class Cpu, class Gpu>(const auto& cfg, auto boundaries) {
    std::vector<Faulty<Gpu>> mine;
    mine.reserve(static_cast<std::size_t>(o.shape.v));
    initial.clear();
    for (int c = 0; c < o.shape.v; ++c) {
      const int stage = o.shape.stage_of(r, c);
      Cpu cpu(cfg, stage, o.shape.stages());
      initial.emplace_back(cpu.parameters().begin(), cpu.parameters().end());
      mine.emplace_back(o.fault.rank == g ? &o.fault : nullptr, o.dp, dev, cfg, stage, o.shape.stages(),
                        su.runtime.microbatch, initial.back(), boundaries);
    }
    return fn(mine);
  };
  if (o.llama)
    return make.template operator()<po::llama::LlamaStage, po::llama::CudaLlamaStage>(train_gpt::llama_config(o),
                                                                                      po::DType::bfloat16);
  return make.template operator()<po::gpt::GptStage, po::gpt::CudaGptStage>(o.model, po::gpt::Boundaries::bf16);
}

/// A rank's backend options, sized before anything is constructed: the cuBLASLt/cuDNN
/// workspace is the default 256 MiB or what cuDNN's attention asks for this microbatch shape,
/// whichever is larger (1 GiB at 4096 tokens of 32 heads); the arena holds it and everything
/// else the runtime, AdamW and the backend reserve for rank `r` (train_gpt::cuda_arena_bytes)
/// under the program it runs first.
/// The stages' parameters, gradients and scratch are cudaMalloc'd outside it.
po::backend::Cuda::Options cuda_options(const Options& o, const Setup& su, int device, int global_rank, int r) {
  po::backend::Cuda::Options opt{.device = device, .rank = global_rank};
  const po::MicrobatchShape mb = su.runtime.microbatch;
  if (o.model.layers > 0 && mb.seq >= 2)
    opt.workspace_bytes =
        std::max(opt.workspace_bytes,
                 po::cuda::attention::workspace_bytes({mb.batch, o.model.heads, mb.seq, o.model.hidden / o.model.heads,
                                                       o.llama ? train_gpt::llama_config(o).kv_heads : 0},
                                                      true, device, o.llama));  // the Llama: q, k, v apart
  // --k auto: the profiling program's first (train_rank resizes the slab for the rebuilt one).
  opt.arena_bytes = train_gpt::cuda_arena_bytes(
      o, su, o.k_auto ? train_gpt::probe_program(o, su.costs) : train_gpt::program_of(o, su.costs), r,
      global_rank / o.shape.d, opt.workspace_bytes);
  return opt;
}

/// --backend cuda --ranks-per-gpu N: global rank g on GPU g / N, every group a comm::SharedGpu
/// (device copies ordered by events; no NCCL, which refuses two ranks on one device). The
/// arenas of the ranks that share a GPU are checked together against its free memory.
int run_shared_gpus(const Options& o, Setup su) {
  const int n = o.ranks_per_gpu, need = o.dp * o.shape.d, gpus = (need + n - 1) / n;
  su.costs.stagger_pairs = false;
  // Each rank's arena and its stages' own buffers (train_gpt::cuda_rank_bytes), all of them
  // together: then no rank's own check at construction can fail for want of what an earlier
  // one took.
  std::vector<std::size_t> arenas(static_cast<std::size_t>(gpus), 0);
  const po::Program first = o.k_auto ? train_gpt::probe_program(o, su.costs) : train_gpt::program_of(o, su.costs);
  for (int g = 0; g < need; ++g) {
    const po::backend::Cuda::Options opt = cuda_options(o, su, g / n, g, g % o.shape.d);
    arenas[static_cast<std::size_t>(g / n)] +=
        train_gpt::cuda_rank_bytes(o, su, first, g % o.shape.d, g / o.shape.d, opt.workspace_bytes).device;
  }
  for (int dv = 0; dv < gpus; ++dv) {
    const po::backend::DeviceMemory m = po::backend::device_memory(dv);
    if (arenas[static_cast<std::size_t>(dv)] > m.free) {
      std::fprintf(stderr,
                   "train_gpt: GPU %d holds ranks %d..%d (--ranks-per-gpu %d), whose arenas and stages need %.3f GiB "
                   "together; "
                   "it has %.3f GiB free (use fewer ranks per GPU, a smaller --batch or more GPUs)\n",
                   dv, dv * n, std::min(need, (dv + 1) * n) - 1, n,
                   static_cast<double>(arenas[static_cast<std::size_t>(dv)]) / (1 << 30),
                   static_cast<double>(m.free) / (1 << 30));
      return 2;
    }
  }
  print_banner(o, su);
  std::printf("GPUs by global rank:");
  for (int g = 0; g < need; ++g) std::printf(" %d", g / n);
  std::printf(" (%d ranks a GPU, comm::SharedGpu)\n", n);
  po::comm::ThreadsGrid grid(o.dp, o.shape.d);
  const auto t_start = std::chrono::steady_clock::now();
  std::atomic<int> stopped{0};
  const auto errors = po::run_thread_ranks(grid, [&](int g) {
    const int r = g % o.shape.d;
    po::backend::Cuda dev(cuda_options(o, su, g / n, g, r));
    std::vector<std::vector<float>> initial;
    stopped = with_cuda_stages(o, su, dev, g, initial, [&](auto& mine) {
      // The handles after the stages, so they go first: their teardown wait (peers still
      // enqueuing copies that read this rank's memory, the stages' gradients among it: the
      // reduce-scatter reads a full bucket in place) ends before the stages free that memory.
      po::comm::SharedGpu comm(grid.pipeline(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
      po::comm::SharedGpu replicas(grid.replicas(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
      // The ranks share the GPU's memory: --k auto's slabs are made again in turns (remake_arena),
      // lined up by a host all-gather over both groups (every rank of the run; abort-aware).
      const auto line_up = [&] {
        int none = 0;
        std::vector<int> all(static_cast<std::size_t>(std::max(comm.size(), replicas.size())));
        comm.all_gather(std::span<const int>(&none, 1),
                        std::span<int>(all.data(), static_cast<std::size_t>(comm.size())));
        replicas.all_gather(std::span<const int>(&none, 1),
                            std::span<int>(all.data(), static_cast<std::size_t>(replicas.size())));
      };
      return train_rank(o, su, comm, replicas, dev, mine, t_start,
                        static_cast<po::PairLink<po::backend::Cuda>*>(nullptr), line_up, std::move(initial));
    });
  });
  return exit_status(errors, stopped);
}

/// --backend cuda --comm threads: one process drives R*D GPUs (global rank g on the g-th GPU of
/// the pairing order, so that PCIe pairs are ranks (r, r^1) of a replica, whose copies then
/// synchronise), or --ranks-per-gpu N of them on each GPU (run_shared_gpus).
int run_cuda_threads(const Options& o, Setup su) {
  const int gpus = po::backend::device_count(), need = o.dp * o.shape.d;
  if (o.ranks_per_gpu > 1 && o.ranks_per_gpu < need) {
    std::fprintf(stderr,
                 "train_gpt: --ranks-per-gpu %d would spread the %d ranks over %d GPUs; comm::SharedGpu moves "
                 "messages within one GPU only (ranks on two GPUs would record each other's events, which CUDA "
                 "refuses): give --ranks-per-gpu %d to put every rank on one GPU\n",
                 o.ranks_per_gpu, need, (need + o.ranks_per_gpu - 1) / o.ranks_per_gpu, need);
    return 2;
  }
  const int needed = (need + o.ranks_per_gpu - 1) / o.ranks_per_gpu;
  if (gpus < needed) {
    const std::string dp = o.dp > 1 ? " --dp " + std::to_string(o.dp) : "";
    const std::string per = o.ranks_per_gpu > 1 ? " --ranks-per-gpu " + std::to_string(o.ranks_per_gpu) : "";
    const int fit = need;  // comm::SharedGpu: every rank on one GPU (run_shared_gpus)
    std::fprintf(stderr, "train_gpt: --backend cuda --ranks %d%s%s needs %d GPUs; this machine has %d%s\n", o.shape.d,
                 dp.c_str(), per.c_str(), needed, gpus,
                 gpus > 0 && fit <= 64
                     ? (" (--ranks-per-gpu " + std::to_string(fit) + " puts the " + std::to_string(need) +
                        " ranks on them, sharing each GPU: a debugging mode, not a speed-up)")
                           .c_str()
                     : "");
    return 2;
  }
  if (o.ranks_per_gpu > 1) return run_shared_gpus(o, std::move(su));
  const po::cuda::Pairing pairing = po::backend::device_pairing();
  std::vector<int> devices(pairing.device_of_rank.begin(), pairing.device_of_rank.begin() + need);
  bool paired = o.shape.d >= 2 && o.shape.d % 2 == 0;
  for (int g = 0; g < need && paired; ++g) paired = pairing.partner_of_rank[static_cast<std::size_t>(g)] == (g ^ 1);
  su.costs.stagger_pairs = paired;
  if (paired && o.copy_streams == 2) {
    std::fprintf(stderr,
                 "train_gpt: --copy-streams 2: these GPUs share PCIe switches in pairs, whose partners fill the "
                 "other direction's slots already (a second stream gains nothing); give --copy-streams 1 or auto\n");
    return 2;
  }
  // Each rank's arena (cuda_options: the runtime's reservation, model state, workspace)
  // against its GPU's free memory, before any rank takes any.
  for (int g = 0; g < need; ++g) {
    const int dv = devices[static_cast<std::size_t>(g)];
    const std::size_t arena = cuda_options(o, su, dv, g, g % o.shape.d).arena_bytes;
    const std::string no = po::backend::arena_refusal(arena, dv, g, po::backend::device_memory(dv));
    if (!no.empty()) {
      std::fprintf(stderr, "train_gpt: %s\n", no.c_str());
      return 2;
    }
  }
  print_banner(o, su);
  std::printf("GPUs by global rank:");
  for (int dv : devices) std::printf(" %d", dv);
  std::printf("%s\n", paired ? " (PCIe pairs (r, r^1): synchronised copies)" : " (no PCIe pairs: copies unpaired)");
  // One world of all R*D GPUs, split by every rank's thread into its pipeline and its
  // replicas; the splits share the world's abort, so a failing rank (run_thread_ranks aborts
  // the world) ends every rank of every replica.
  auto world = po::comm::NcclWorld::all_local(devices);
  std::vector<std::unique_ptr<po::PairLink<po::backend::Cuda>>> links;
  for (int p = 0; paired && 2 * p + 1 < need; ++p) links.push_back(std::make_unique<po::PairLink<po::backend::Cuda>>());
  const auto t_start = std::chrono::steady_clock::now();
  std::atomic<int> stopped{0};
  const auto errors = po::run_thread_ranks(*world, [&](int g) {
    const int r = g % o.shape.d, j = g / o.shape.d;
    po::backend::Cuda dev(cuda_options(o, su, devices[static_cast<std::size_t>(g)], g, r));
    auto pipe_world = world->split(g, j, r), reps_world = world->split(g, r, j);
    po::comm::Nccl comm(pipe_world, pipe_world->rank(), dev);
    po::comm::Nccl replicas(reps_world, reps_world->rank(), dev);
    std::vector<std::vector<float>> initial;
    stopped = with_cuda_stages(o, su, dev, g, initial, [&](auto& mine) {
      return train_rank(
          o, su, comm, replicas, dev, mine, t_start, link_of(links, g), [&] { world->host_barrier(); },
          std::move(initial));
    });
  });
  return exit_status(errors, stopped);
}

#ifdef PIPEOFFLOAD_WITH_MPI
/// --backend cuda --comm mpi: one process per GPU (the node-local rank picks it); MPI only
/// carries NCCL's unique id, NCCL carries the pipeline. Processes are separate, so their
/// copies run unpaired.
int run_cuda_rank(const Options& o, Setup su, po::comm::Mpi& mpi, std::chrono::steady_clock::time_point t_start) {
  const int r = mpi.rank();
  const int gpus = po::backend::device_count();
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const int device = local != nullptr ? std::atoi(local) : r;
  if (device >= gpus)
    throw po::error("--backend cuda: this process (rank " + std::to_string(r) + ") needs GPU " +
                    std::to_string(device) + " but its node has " + std::to_string(gpus));
  su.costs.stagger_pairs = false;
  // One NCCL world of the job (its id broadcast over MPI), split into this process's pipeline
  // and replicas groups, which share its abort.
  const po::comm::NcclIdBytes id =
      po::comm::broadcast_nccl_id(mpi, r == 0 ? po::comm::NcclWorld::new_id() : po::comm::NcclIdBytes{});
  auto job = po::comm::NcclWorld::from_id(id, r, mpi.size(), device);
  auto pipeline_world = job->split(r / o.shape.d, r % o.shape.d);
  auto replicas_world = job->split(r % o.shape.d, r / o.shape.d);
  po::backend::Cuda dev(cuda_options(o, su, device, r, r % o.shape.d));
  po::comm::Nccl comm(pipeline_world, pipeline_world->rank(), dev);
  po::comm::Nccl reps(replicas_world, replicas_world->rank(), dev);
  try {
    std::vector<std::vector<float>> initial;
    return with_cuda_stages(o, su, dev, r, initial, [&](auto& mine) {
      return train_rank(
          o, su, comm, reps, dev, mine, t_start, static_cast<po::PairLink<po::backend::Cuda>*>(nullptr), [] {},
          std::move(initial));
    });
  } catch (const std::exception& e) {
    comm.abort(e.what());  // the groups share the job's abort
    throw;
  }
  return 0;
}
#endif
#endif

int run_threads(const Options& o, const Setup& su) {
#ifdef PIPEOFFLOAD_WITH_CUDA
  if (o.cuda) return run_cuda_threads(o, su);
#endif
  print_banner(o, su);
  // dp replicas of a d-rank pipeline: global rank g = replica * d + rank.
  po::comm::ThreadsGrid grid(o.dp, o.shape.d);
  // --pcie-pairs: ranks (r, r^1) are a PCIe pair, as the schedule's staggered slots assume,
  // and their copies synchronise (docs/design.md section 3). A last rank of an odd d has none.
  std::vector<std::unique_ptr<po::PairLink<po::backend::Cpu>>> links;  // per replica, per pair
  for (int p = 0; o.pcie_pairs && p < o.dp * (o.shape.d / 2); ++p)
    links.push_back(std::make_unique<po::PairLink<po::backend::Cpu>>());
  const auto t_start = std::chrono::steady_clock::now();
  std::atomic<int> stopped{0};
  // A rank that throws aborts the grid (run_thread_ranks), so no rank of any replica waits for it.
  const auto errors = po::run_thread_ranks(grid, [&](int g) {
    po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
    const int r = g % o.shape.d, j = g / o.shape.d;
    po::backend::Cpu dev({.rank = g, .copy_bytes_per_second = o.copy_gbps * 1e9});
    po::PairLink<po::backend::Cpu>* link =
        r / 2 < o.shape.d / 2 ? link_of(links, 2 * (j * (o.shape.d / 2) + r / 2) + (r & 1)) : nullptr;
    stopped =
        with_cpu_stages(o, g, [&](auto& mine) { return train_rank(o, su, comm, replicas, dev, mine, t_start, link); });
  });
  return exit_status(errors, stopped);
}

/// A fresh run (no --resume) whose --checkpoint-dir holds another run's checkpoints (another
/// configuration or seed) would replace them: refused unless --overwrite.
void refuse_other_run(const Options& o, const Setup& su) {
  if (o.checkpoint_every == 0 || !o.resume.empty() || o.overwrite) return;
  const std::optional<po::CheckpointInfo> owner = po::checkpoint_owner(o.checkpoint_dir);
  if (owner && (owner->config_hash != su.config_hash || owner->rng_seed != o.seed))
    throw bad_argument("--checkpoint-dir " + o.checkpoint_dir + " holds another run's checkpoints (at step " +
                       std::to_string(owner->data_position) + ", " +
                       (owner->rng_seed != o.seed ? "seed " + std::to_string(owner->rng_seed)
                        : owner->config.empty()
                            ? std::string("another configuration")
                            : "another configuration: " + po::checkpoint::config_difference(owner->config, su.config)) +
                       "); continue it with --resume, replace it with --overwrite, or choose another directory");
}

/// `dir` exists (created if missing, with `create`) and takes a new file: a probe is written
/// and removed. Throws bad_argument naming `what` and the path.
void probe_writable(const std::filesystem::path& dir, const std::string& what, bool create, int rank) {
  std::error_code ec;
  if (create) std::filesystem::create_directories(dir, ec);
  if (ec) throw bad_argument(what + " '" + dir.string() + "' cannot be created: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    throw bad_argument(what + " '" + dir.string() + "' " +
                       (std::filesystem::exists(dir, ec) ? "is not a directory" : "does not exist"));
  const std::filesystem::path probe =
      dir / (".train_gpt-write-test." + std::to_string(rank) + "." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw bad_argument(what + " '" + dir.string() + "' is not writable: " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

/// Every output checked before any work, so that no run trains and then fails to write: the
/// checkpoint directory (created, written to), another run's checkpoints in it (refused), and
/// the trace's directory (global rank 0 writes the trace).
void check_outputs(const Options& o, const Setup& su, int global_rank) {
  if (o.checkpoint_every > 0) {
    probe_writable(o.checkpoint_dir, "--checkpoint-dir", true, global_rank);
    refuse_other_run(o, su);
  }
  if (o.trace && global_rank == 0) {
    const std::filesystem::path trace(*o.trace);
    std::error_code ec;
    if (std::filesystem::is_directory(trace, ec))
      throw bad_argument("--trace '" + *o.trace + "' is a directory; give a file name");
    probe_writable(trace.parent_path().empty() ? "." : trace.parent_path(), "--trace's directory", false, 0);
  }
}

#ifdef PIPEOFFLOAD_WITH_MPI
/// The number of processes an MPI launcher started with this one (its environment says so),
/// or 0 when none did.
int launched_processes() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* v = std::getenv(name)) return std::max(1, std::atoi(v));
  return std::getenv("PMIX_RANK") != nullptr ? 2 : 0;
}

/// Whether this process is one of several an MPI launcher started: then a bad argument (or a
/// missing --comm mpi) is told to every process before any leaves, instead of leaving the
/// others waiting in MPI_Init or a collective.
bool mpi_launch() { return launched_processes() > 1; }

/// FNV-1a of a process's arguments: every rank of an MPI job must be given the same ones.
std::uint64_t arguments_hash(int argc, char** argv) {
  std::uint64_t h = po::fnv1a_start;
  for (int i = 1; i < argc; ++i) h = po::fnv1a(std::string_view(argv[i], std::strlen(argv[i]) + 1), h);
  return h;
}

/// The agreement every MPI rank reaches before anything collective can wait forever: each
/// rank's own checks (`bad`, empty when they passed) and its arguments, which must be rank
/// 0's. Returns 0 to go on, or the exit status every rank leaves with (2: a bad argument on
/// some rank, named; the first rank prints it).
int agree_or_leave(const po::comm::MpiSession& session, const std::string& bad, std::uint64_t args, double timeout) {
  const po::comm::MpiSession::Agreement a = session.agree(bad, args, timeout);
  if (a.ok) return 0;
  if (a.timed_out) {
    std::fprintf(stderr, "train_gpt: rank %d: %s\n", session.rank(), a.error.c_str());
    std::fflush(stderr);
    po::comm::MpiSession::abort_job(2);
  }
  if (session.rank() == 0) {
    if (a.failed == session.size())
      std::fprintf(stderr, "train_gpt: %s\n", a.error.c_str());
    else
      std::fprintf(stderr, "train_gpt: rank %d: %s\n", a.rank, a.error.c_str());
  }
  return 2;
}

/// A process of an MPI job whose arguments or data failed its checks before it could train:
/// it joins the job only to tell every rank why.
int refuse_mpi(int& argc, char**& argv, const std::string& why) {
  const std::uint64_t args = arguments_hash(argc, argv);
  po::comm::MpiSession session(argc, argv);
  return agree_or_leave(session, why, args, 60);
}

int run_mpi(Options& o, const sample::Tokens& tokens, const std::optional<sample::Tokens>& val, int& argc,
            char**& argv) {
  const std::uint64_t args = arguments_hash(argc, argv);
  po::comm::MpiSession session(argc, argv);
  const int r = session.rank();
  // Every rank decides these from the same arguments and world size, so they all agree.
  if (!o.ranks_given && session.size() % o.dp == 0) o.shape.d = session.size() / o.dp;
  std::string bad;
  std::optional<Setup> setup;
  if (o.shape.d * o.dp != session.size())
    bad = "--ranks " + std::to_string(o.shape.d) + " x --dp " + std::to_string(o.dp) + " = " +
          std::to_string(o.shape.d * o.dp) + " ranks but mpirun started " + std::to_string(session.size()) +
          " processes; they must be equal";
  else if (o.fault.rank >= session.size())
    bad = "--inject-fault's rank " + std::to_string(o.fault.rank) + " is outside [0, " +
          std::to_string(session.size() - 1) + "]";
  else {
    try {
      train_gpt::program_of(o);
      setup.emplace(make_setup(o, tokens, val));
      if (!o.cuda) train_gpt::check_memory(o, *setup, train_gpt::program_of(o, setup->costs), r, 1);
      check_outputs(o, *setup, r);  // every rank reads the same directory: all refuse alike
    } catch (const std::exception& e) {
      bad = e.what();
    }
  }
  // Nothing collective before every rank has passed its checks with rank 0's arguments.
  if (const int status = agree_or_leave(session, bad, args, o.comm_timeout); status != 0) return status;
  const Setup& su = *setup;
  // dp replicas of a d-rank pipeline: global rank g = replica * d + rank; each process joins
  // its pipeline and its replicas (an abort on either ends the whole job).
  std::optional<po::comm::Mpi> joined;
  try {
    joined.emplace(po::comm::Mpi::Options{.timeout_seconds = o.comm_timeout});
  } catch (const std::exception& e) {  // a request may still be pending: only MPI_Abort ends it
    std::fprintf(stderr, "train_gpt: rank %d (%s): %s\n", r, session.host().c_str(), e.what());
    std::fflush(stderr);
    po::comm::MpiSession::abort_job(1);
  }
  po::comm::Mpi& world = *joined;
  po::comm::Mpi comm = world.split(r / o.shape.d, r % o.shape.d);
  po::comm::Mpi replicas = world.split(r % o.shape.d, r / o.shape.d);
  if (r == 0) print_banner(o, su);
  const auto t_start = std::chrono::steady_clock::now();
  try {
#ifdef PIPEOFFLOAD_WITH_CUDA
    if (o.cuda) return run_cuda_rank(o, su, world, t_start);
#endif
    po::backend::Cpu dev({.rank = r, .copy_bytes_per_second = o.copy_gbps * 1e9});
    return with_cpu_stages(o, r, [&](auto& mine) { return train_rank(o, su, comm, replicas, dev, mine, t_start); });
  } catch (const po::handshake_error& e) {
    // Every rank saw the same hashes and throws the same sentence, before any pipeline
    // message: nothing is in flight, so each rank can leave normally (MPI_Finalize).
    std::fprintf(stderr, "train_gpt: rank %d: %s\n", r, e.what());
    return 1;
  } catch (const std::exception& e) {
    world.abort(e.what());  // tell the others (a no-op when the runtime already did)
    std::fprintf(stderr, "train_gpt: rank %d (%s): %s\n", r, session.host().c_str(), e.what());
    std::fflush(stderr);
    // No MPI 4.1 job survives a lost rank, and peers may hold requests that never complete,
    // so the job ends with MPI_Abort. The rank that failed first calls it, a moment after its
    // note went out, so that mpirun's message names it and the others can print theirs; a
    // rank that was told of another's failure waits for that, and ends the job itself only
    // if it does not come.
    const int origin = world.abort_origin();
    if (origin == r || origin < 0) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(15));
    }
    po::comm::MpiSession::abort_job(1);
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifdef PIPEOFFLOAD_WITH_CUDA
  po::cuda::apply_cuda_environment();  // before any CUDA call: backend/cuda/environment.hpp says why
#endif
  Options o;
  try {
    o = train_gpt::parse(argc, argv);
#ifdef PIPEOFFLOAD_WITH_MPI
    if (!o.mpi && mpi_launch())
      throw bad_argument("this process is one of " + std::to_string(launched_processes()) +
                         " an MPI launcher started, without --comm mpi (each would run the whole job alone); "
                         "give every process --comm mpi");
#endif
    if (!o.mpi) {
      train_gpt::program_of(o);  // shape errors (1f1b with v > 1, 1f1b-i with m % d != 0) as bad arguments
      if (o.fault.rank >= o.shape.d * o.dp)
        throw bad_argument("--inject-fault's rank " + std::to_string(o.fault.rank) + " is outside [0, " +
                           std::to_string(o.shape.d * o.dp - 1) + "]");
    }
  } catch (const std::exception& e) {
#ifdef PIPEOFFLOAD_WITH_MPI
    if (mpi_launch()) return refuse_mpi(argc, argv, e.what());
#endif
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  // The tokens: the corpus's bytes, or a --data shard (whose vocabulary the model takes).
  sample::Tokens tokens;
  std::optional<sample::Tokens> val;
  try {
    if (!o.data.empty()) {
      tokens = sample::Tokens::from_shard(o.data, o.vocab);
      if (!o.val_data.empty()) {
        val = sample::Tokens::from_shard(o.val_data, tokens.vocab());
        if (val->vocab() != tokens.vocab())
          throw bad_argument("--val-data's vocabulary " + std::to_string(val->vocab()) + " differs from --data's " +
                             std::to_string(tokens.vocab()));
      }
      o.model.vocab = static_cast<int>(tokens.vocab());
    } else {
      tokens = sample::Tokens::from_text(sample::read_regular_file(o.corpus, "the corpus"));
    }
    if (o.pack >= tokens.vocab())
      throw bad_argument("--pack " + std::to_string(o.pack) + " is outside the vocabulary [0, " +
                         std::to_string(tokens.vocab() - 1) + "]");
    const std::size_t seq = static_cast<std::size_t>(o.model.seq), n = tokens.size();
    const char* what = o.data.empty() ? "the corpus" : "the --data shard";
    if (n < seq + 2)
      throw bad_argument(std::string(what) + " has " + std::to_string(n) +
                         " tokens; it needs at least --seq + 2 = " + std::to_string(seq + 2));
    if (o.eval_every > 0 && !val && n / 10 < seq + 2)
      throw bad_argument("--eval-every holds out " + std::string(what) + "'s last 10% (" + std::to_string(n / 10) +
                         " tokens); it needs at least --seq + 2 = " + std::to_string(seq + 2));
    if (val && val->size() < seq + 2)
      throw bad_argument("the --val-data shard has " + std::to_string(val->size()) +
                         " tokens; it needs at least --seq + 2 = " + std::to_string(seq + 2));
  } catch (const std::exception& e) {
#ifdef PIPEOFFLOAD_WITH_MPI
    if (o.mpi) return refuse_mpi(argc, argv, e.what());
#endif
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  po::blas::core_name();  // load the BLAS before the ranks start
  catch_stop_signals();
  try {
#ifdef PIPEOFFLOAD_WITH_MPI
    if (o.mpi) return run_mpi(o, tokens, val, argc, argv);
#endif
    const Setup su = make_setup(o, std::move(tokens), std::move(val));
    if (!o.cuda) train_gpt::check_memory(o, su, train_gpt::program_of(o, su.costs), 0, o.dp * o.shape.d);
    check_outputs(o, su, 0);
    return run_threads(o, su);
  } catch (const bad_argument& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
