// bench/dp_overlap: data parallelism under MPI: is a dp = 2 iteration as long as predicted, and
// how much of the gradient reduction does the cooldown hide?
//
//   mpirun -np 8 ./build/bench/dp_overlap [--trace FILE]     # dp = 2 replicas of PO-F, d = 4, v = 2..16,
//                                                            # comm::Mpi polling capped at 1000 us, then at its default
//
// Sleeping layers with real gradients and paced collectives; what is predicted, measured,
// calibrated and hidden: docs/benchmarks.md, "bench/dp_overlap".
#include <pipeoffload/comm/mpi/mpi.hpp>
#include <pipeoffload/plan/plan.hpp>
#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "../samples/cli.hpp"
#include "sleep_layer.hpp"

namespace {

using bench::pass_s;
using bench::SleepLayer;
using bench::unit_floats;
constexpr std::size_t params = 1 << 12;  // per stage

/// comm::Mpi whose replica collectives take as long as a link of `rate` bytes/s would: after
/// the real exchange, it sleeps the rest of bytes sent / rate.
class Paced {
 public:
  Paced(po::comm::Mpi& c, double rate) : c_(c), rate_(rate) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    c_.all_gather(mine, all);
  }
  void abort(const std::string& why) { c_.abort(why); }
  template <class Context>
  void send(const Context& ctx, int peer, po::Tag tag, std::span<const std::byte> data) {
    c_.send(ctx, peer, tag, data);
  }
  template <class Context>
  void recv(const Context& ctx, int peer, po::Tag tag, std::span<std::byte> out) {
    c_.recv(ctx, peer, tag, out);
  }
  template <class Context>
  void all_to_all(const Context& ctx, std::span<const std::byte> in, std::span<std::byte> out) {
    paced([&] { c_.all_to_all(ctx, in, out); }, in.size() / static_cast<std::size_t>(size()) * (size() - 1));
  }
  template <class Context>
  void all_gather(const Context& ctx, std::span<const std::byte> mine, std::span<std::byte> all) {
    paced([&] { c_.all_gather(ctx, mine, all); }, mine.size() * static_cast<std::size_t>(size() - 1));
  }

 private:
  template <class F>
  void paced(F&& op, std::size_t bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    op();
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                           std::chrono::duration<double>(static_cast<double>(bytes) / rate_)));
  }
  po::comm::Mpi& c_;
  double rate_;
};

/// One grid run of PO-F with v chunks per rank: the slowest rank's median step with the
/// replicas' reductions (dp = 2) and without them (the two pipelines alone, under the same
/// load), the prediction, and each rank's hidden fraction (global rank 0 prints).
bool run(po::comm::Mpi& world, po::comm::Mpi& pipe_mpi, po::comm::Mpi& reps_mpi, int v, const std::string& trace) {
  const int dp = 2, d = 4, g = world.rank(), r = g % d;
  po::Costs costs;
  costs.f = costs.b = costs.w = pass_s;
  costs.k = 1;
  const po::Shape sh{d, v, 16};
  const po::Program program = po::PO_F::build(sh, costs);
  // A rank's reductions take R = 4 T in all: R / v per stage, as one model cut into v chunks
  // per rank. One stage's reduction moves (16 + 4) * P * (dp-1)/dp bytes (128-bit sums
  // scattered, fp32 slices gathered).
  const double reduce_s = 4 * pass_s / v;
  const double rate = 20.0 * params * (dp - 1) / dp / reduce_s;
  Paced pipe(pipe_mpi, 1e30), reps(reps_mpi, rate);
  const double copy_rate = static_cast<double>(unit_floats * sizeof(float)) / costs.T_O(0);
  const auto median_step = [&](auto& rt) {
    std::vector<double> secs;
    for (int s = 0; s < 6; ++s) {
      rt.zero_grad();
      secs.push_back(rt.forward_backward(po::Batch{}).seconds);
    }
    std::vector<double> all(static_cast<std::size_t>(dp * d) * secs.size());
    world.all_gather(std::span<const double>(secs), std::span(all));
    std::vector<double> per_step;
    for (std::size_t s = 1; s < secs.size(); ++s) {
      double mx = 0;
      for (int q = 0; q < dp * d; ++q) mx = std::max(mx, all[static_cast<std::size_t>(q) * secs.size() + s]);
      per_step.push_back(mx);
    }
    std::sort(per_step.begin(), per_step.end());
    return per_step[per_step.size() / 2];
  };
  double alone = 0;
  {
    po::backend::Cpu dev({.rank = g, .copy_bytes_per_second = copy_rate});
    std::vector<SleepLayer> layers(static_cast<std::size_t>(sh.v), SleepLayer(params));
    po::Runtime rt(program, dev, pipe, std::span<SleepLayer>(layers), {.microbatch = {1, 1}});
    alone = median_step(rt);
  }
  po::backend::Cpu dev({.rank = g, .copy_bytes_per_second = copy_rate});
  std::vector<SleepLayer> layers(static_cast<std::size_t>(sh.v), SleepLayer(params));
  // The exact path, whose reduction the planner models (128-bit sums scattered, fp32 gathered).
  po::Runtime rt(program, dev, pipe, reps, std::span<SleepLayer>(layers),
                 {.microbatch = {1, 1}, .gradients = po::Gradients::exact});
  const double measured = median_step(rt);
  // This rank's last step, from its own trace.
  const po::RankSim& tr = rt.trace();
  const double t0 = *std::min_element(tr.compute_start.begin(), tr.compute_start.end());
  const double compute_end = *std::max_element(tr.compute_end.begin(), tr.compute_end.end());
  double reduce_sum = 0, reduce_end = 0, reduce_first = 1e300;
  for (const auto& x : rt.reductions()) {
    reduce_sum += x.end - x.start;
    reduce_end = std::max(reduce_end, x.end);
    reduce_first = std::min(reduce_first, x.start);
  }
  const double mine[4] = {1 - std::max(0.0, reduce_end - compute_end) / reduce_sum, reduce_sum, reduce_first - t0,
                          compute_end - t0};
  std::vector<double> hidden(4 * static_cast<std::size_t>(dp * d));
  world.all_gather(std::span<const double>(mine), std::span(hidden));
  // The passes, copies and reductions as this machine ran them in that step (sums and counts),
  // for the calibrated prediction: the same model fed the measured durations.
  double ran[6] = {0, 0, 0, 0, 0, 0};
  for (std::size_t x = 0; x < tr.compute_start.size(); ++x) ran[0] += tr.compute_end[x] - tr.compute_start[x];
  ran[1] = static_cast<double>(tr.compute_start.size());
  for (std::size_t y = 0; y < tr.copy_start.size(); ++y) ran[2] += tr.copy_end[y] - tr.copy_start[y];
  ran[3] = static_cast<double>(tr.copy_start.size());
  ran[4] = reduce_sum;
  ran[5] = static_cast<double>(rt.reductions().size());
  std::vector<double> ran_all(6 * static_cast<std::size_t>(dp * d));
  world.all_gather(std::span<const double>(ran), std::span(ran_all));
  // Every rank's compute starts and ends of that step (PO-F gives every rank 3vm passes), for
  // the gaps between passes: a message's latency (a pass that waited for another rank's pass)
  // and the stream's dispatch gap (a pass that waited for nothing but the one before it).
  const std::size_t nc = tr.compute_start.size();
  std::vector<double> se(2 * nc), se_all(2 * nc * static_cast<std::size_t>(dp * d));
  std::copy(tr.compute_start.begin(), tr.compute_start.end(), se.begin());
  std::copy(tr.compute_end.begin(), tr.compute_end.end(), se.begin() + static_cast<std::ptrdiff_t>(nc));
  world.all_gather(std::span<const double>(se), std::span(se_all));
  if (!trace.empty()) {
    // One Chrome trace per rank of the last step: compute, copy and reduction spans.
    std::ofstream f(trace + "." + std::to_string(g) + ".json");
    f << "{\"traceEvents\":[";
    bool first = true;
    const auto span = [&](const char* tid, const std::string& name, double a, double b) {
      f << (first ? "" : ",") << "{\"name\":\"" << name << "\",\"ph\":\"X\",\"pid\":" << g << ",\"tid\":\"" << tid
        << "\",\"ts\":" << (a - t0) * 1e6 << ",\"dur\":" << (b - a) * 1e6 << "}";
      first = false;
    };
    const po::RankProgram& rp = program.ranks[static_cast<std::size_t>(r)];
    for (std::size_t x = 0; x < rp.compute.size(); ++x)
      span("compute",
           std::string(po::op_name(rp.compute[x].kind)) + std::to_string(rp.compute[x].stage) + "." +
               std::to_string(rp.compute[x].mb),
           tr.compute_start[x], tr.compute_end[x]);
    for (std::size_t y = 0; y < rp.copy.size(); ++y)
      span("copy", std::string(po::op_name(rp.copy[y].kind)) + std::to_string(rp.copy[y].stage), tr.copy_start[y],
           tr.copy_end[y]);
    for (const auto& x : rt.reductions())
      span("comm", "reduce stage " + std::to_string(sh.stage_of(r, x.chunk)), x.start, x.end);
    f << "]}\n";
  }
  if (g != 0) return true;
  const po::SimResult sim = po::simulate(program);
  std::vector<double> stage_s(static_cast<std::size_t>(sh.stages()), reduce_s), total, end;
  po::detail::reduce_gradients(program, sim, stage_s, total, end);
  double predicted = sim.makespan;
  for (double e : end) predicted = std::max(predicted, e);
  double avg = 0, worst = 1;
  for (int q = 0; q < dp * d; ++q) {
    avg += hidden[4 * static_cast<std::size_t>(q)] / (dp * d);
    worst = std::min(worst, hidden[4 * static_cast<std::size_t>(q)]);
  }
  // Calibrated: the same model with T_F = T_B = T_W (pass plus dispatch gap), T_O, T_comm and
  // each stage's reduction set to the means measured in the step above: what is left of
  // measured / calibrated is the model's composition (dependencies, copies, reductions after
  // each stage's last W), not this machine's speeds.
  double sums[6] = {0, 0, 0, 0, 0, 0};
  for (int q = 0; q < dp * d; ++q)
    for (int k = 0; k < 6; ++k) sums[k] += ran_all[6 * static_cast<std::size_t>(q) + static_cast<std::size_t>(k)];
  // Message latency and dispatch gap, from every replica's pipeline (steady_clock is one clock
  // for the processes of this machine).
  double lat_sum = 0, lat_n = 0, gap_sum = 0, gap_n = 0;
  {
    const auto start_of = [&](int q, std::size_t x) { return se_all[2 * nc * static_cast<std::size_t>(q) + x]; };
    const auto end_of = [&](int q, std::size_t x) { return se_all[2 * nc * static_cast<std::size_t>(q) + nc + x]; };
    // Index of each (kind, stage, mb) compute pass in its rank's order.
    std::vector<std::size_t> at(3 * static_cast<std::size_t>(sh.stages()) * 16);
    const auto key = [&](po::OpKind k, int st, int mb) {
      return (static_cast<std::size_t>(k == po::OpKind::F   ? 0
                                       : k == po::OpKind::B ? 1
                                                            : 2) *
                  static_cast<std::size_t>(sh.stages()) +
              static_cast<std::size_t>(st)) *
                 16 +
             static_cast<std::size_t>(mb);
    };
    for (int q = 0; q < d; ++q)
      for (std::size_t x = 0; x < nc; ++x) {
        const po::Op& op = program.ranks[static_cast<std::size_t>(q)].compute[x];
        at[key(op.kind, op.stage, op.mb)] = x;
      }
    for (int j = 0; j < dp; ++j)
      for (int q = 0; q < d; ++q) {
        const auto& ops = program.ranks[static_cast<std::size_t>(q)].compute;
        for (std::size_t x = 1; x < nc; ++x) {
          const po::Op& op = ops[x];
          int from = -1;  // the stage whose pass sends this one its input, on another rank
          if (op.kind == po::OpKind::F && op.stage > 0 && sh.crosses(op.stage - 1)) from = op.stage - 1;
          if (op.kind == po::OpKind::B && op.stage + 1 < sh.stages() && sh.crosses(op.stage)) from = op.stage + 1;
          const double before = end_of(j * d + q, x - 1);
          double sent = -1e300;
          if (from >= 0) sent = end_of(j * d + sh.rank_of(from), at[key(op.kind, from, op.mb)]);
          if (from >= 0 && sent >= before) {
            lat_sum += start_of(j * d + q, x) - sent;
            lat_n += 1;
          } else if (op.wait < 0) {
            gap_sum += start_of(j * d + q, x) - before;
            gap_n += 1;
          }
        }
      }
  }
  const double latency = lat_n > 0 ? lat_sum / lat_n : 0, gap = gap_n > 0 ? gap_sum / gap_n : 0;
  po::Costs cal = costs;
  cal.f = cal.b = cal.w = sums[0] / sums[1] + gap;
  cal.comm = latency;
  if (sums[3] > 0) cal.t_o = sums[2] / sums[3];
  const po::SimResult sim_cal = po::simulate(program, cal);
  std::vector<double> stage_cal(static_cast<std::size_t>(sh.stages()), sums[4] / sums[5]), total_cal, end_cal;
  po::detail::reduce_gradients(program, sim_cal, stage_cal, total_cal, end_cal);
  double calibrated = sim_cal.makespan;
  for (double e : end_cal) calibrated = std::max(calibrated, e);
  double bound = 1;  // the prediction's hidden fraction of the worst rank
  for (int q = 0; q < d; ++q)
    bound = std::min(
        bound, 1 - std::max(0.0, end[static_cast<std::size_t>(q)] - sim.makespan) / total[static_cast<std::size_t>(q)]);
  std::printf("%2d %10.1f %10.1f %10.1f %12.1f %8.3f %8.3f %9.3f %9.3f %9.3f %8.2f %7.3f %7.3f %9.1f %8.3f\n", v,
              reduce_s * 1e3, alone * 1e3, measured * 1e3, predicted * 1e3, measured / predicted,
              (measured / alone) / (predicted / sim.makespan), avg, worst, bound, sums[0] / sums[1] * 1e3, gap * 1e3,
              latency * 1e3, calibrated * 1e3, measured / calibrated);
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  po::comm::MpiSession session(argc, argv);
  std::string trace;
  try {
    cli::help(argc, argv, "usage: mpirun -np 8 dp_overlap [--trace FILE]\n");
    constexpr cli::Flag flags[] = {{"--trace"}};
    const cli::Args args(argc, argv, flags);
    if (const std::string* v = args.get("--trace")) trace = *v;
  } catch (const cli::bad_argument& e) {
    if (session.rank() == 0) std::fprintf(stderr, "dp_overlap: %s\n", e.what());
    return 2;
  }
  const int dp = 2, d = 4, g = session.rank();
  if (session.size() != dp * d) {
    if (g == 0)
      std::fprintf(stderr, "dp_overlap: run it as mpirun -np %d (dp = %d replicas of d = %d)\n", dp * d, dp, d);
    return 2;
  }
  const int r = g % d, j = g / d;
  if (g == 0)
    std::printf("PO-F d=%d m=16, dp=%d replicas as MPI processes, T = %.1f ms per pass, a rank's reductions R = 4T\n",
                d, dp, pass_s * 1e3);
  // Side by side: the former polling cap (1000 us) and comm::Mpi's default.
  for (const int cap : {1000, po::comm::Mpi::Options{}.poll_sleep_max_us}) {
    po::comm::Mpi::Options opt;
    opt.poll_sleep_max_us = cap;
    po::comm::Mpi world(opt);
    po::comm::Mpi pipe_mpi = world.split(j, r), reps_mpi = world.split(r, j);
    if (g == 0) {
      std::printf("comm::Mpi poll_sleep_max_us = %d\n", cap);
      std::printf("%2s %10s %10s %10s %12s %8s %8s %9s %9s %9s %8s %7s %7s %9s %8s\n", "v", "R/stage ms", "alone ms",
                  "dp=2 ms", "predicted ms", "ratio", "matched", "hid.mean", "hid.worst", "hid.model", "pass ms",
                  "gap ms", "msg ms", "calib. ms", "ratio");
    }
    const bool last = cap == po::comm::Mpi::Options{}.poll_sleep_max_us;
    for (int v : {2, 4, 8, 16}) run(world, pipe_mpi, reps_mpi, v, v == 4 && last ? trace : std::string());
  }
  if (g == 0 && !trace.empty()) std::printf("traces (v = 4, the default cap): %s.<global rank>.json\n", trace.c_str());
  return 0;
}
