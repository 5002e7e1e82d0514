// bench/runtime_fidelity: does po::Runtime on backend::Cpu execute schedules as simulate()
// predicts? Layers sleep a fixed T per pass (T_F = T_B = T_W), so the measured iteration time
// can be set against the simulated makespan for every family, d in {4, 8}, m = 32. Then PO-F
// with a copy engine paced so one unit's one-way copy takes T_O = k (T_F+T_B+T_W)/2, k = 1,
// against PO without offload: the cost of full offload.
//
//   ./build/bench/runtime_fidelity            # T = 2 ms; prints one row per (family, d)
//
// Formula: ratio = measured iteration time (enqueue to last stream idle, rank max, median of
// 3 steps after one warm-up) / simulated makespan (T_comm = 0).
#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "sleep_layer.hpp"

namespace {

using bench::pass_s;
using bench::SleepLayer;
using bench::unit_floats;

/// Median over steps 2..4 of the slowest rank's step time. `paired`: ranks (r, r^1) are PCIe
/// pairs with synchronised copies (po::PairLink).
double run(const po::ScheduleSpec& spec, po::Shape sh, double copy_rate, const po::Costs& costs, bool paired = false) {
  po::comm::ThreadsWorld world(sh.d);
  std::vector<std::unique_ptr<po::PairLink<po::backend::Cpu>>> links;
  for (int p = 0; paired && 2 * p + 1 < sh.d; ++p) links.push_back(std::make_unique<po::PairLink<po::backend::Cpu>>());
  const po::Program program = po::build(spec, sh, costs);
  std::vector<std::vector<double>> secs(static_cast<std::size_t>(sh.d));
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r, .copy_bytes_per_second = copy_rate});
    po::comm::Threads comm(world, r);
    std::vector<SleepLayer> layers(static_cast<std::size_t>(sh.v));
    po::Runtime rt(program, dev, comm, std::span<SleepLayer>(layers), {.microbatch = {1, 1}});
    if (static_cast<std::size_t>(r / 2) < links.size()) rt.pair_with(*links[static_cast<std::size_t>(r / 2)]);
    for (int s = 0; s < 4; ++s) secs[static_cast<std::size_t>(r)].push_back(rt.forward_backward(po::Batch{}).seconds);
  });
  for (const auto& e : errors)
    if (!e.empty()) {
      std::fprintf(stderr, "runtime_fidelity: %s\n", e.c_str());
      std::exit(1);
    }
  std::vector<double> per_step;
  for (std::size_t s = 1; s < 4; ++s) {
    double mx = 0;
    for (const auto& v : secs) mx = std::max(mx, v[s]);
    per_step.push_back(mx);
  }
  std::sort(per_step.begin(), per_step.end());
  return per_step[1];
}

}  // namespace

int main() {
  using po::Family;
  using GK = po::GroupSpec::Kind;
  po::Costs costs;
  costs.f = costs.b = costs.w = pass_s;
  costs.k = 1;
  struct Row {
    const char* name;
    po::ScheduleSpec spec;
    int v;
  };
  const Row rows[] = {
      {"1f1b", {Family::one_f1b, {}, po::offload::none}, 1},
      {"1f1b-i", {Family::interleaved_1f1b, {}, po::offload::none}, 2},
      {"gis", {Family::grouped, {GK::full, 0}, po::offload::none}, 2},
      {"gis-g(d-1)", {Family::grouped, {GK::number, -1}, po::offload::none}, 2},
      {"gis-h", {Family::grouped, {GK::half, 0}, po::offload::none}, 2},
      {"po", {Family::grouped, {GK::uniform, 1}, po::offload::none}, 2},
      {"po-h", {Family::grouped, {GK::uniform, 1}, po::offload::half}, 2},
      {"po-f", {Family::grouped, {GK::uniform, 1}, po::offload::all}, 2},
  };
  // k = 1: one unit's one-way copy takes (T_F + T_B + T_W) / 2.
  const double rate = static_cast<double>(unit_floats * sizeof(float)) / costs.T_O(0);
  std::printf("T_F = T_B = T_W = %.1f ms, m = 32, copy engine %.1f MB/s (k = 1 for offloaded schedules)\n",
              pass_s * 1e3, rate / 1e6);
  std::printf("%-12s %3s %3s %12s %12s %8s\n", "schedule", "d", "v", "measured ms", "simulated ms", "ratio");
  double worst = 0;
  for (int d : {4, 8}) {
    for (const Row& row : rows) {
      po::ScheduleSpec spec = row.spec;
      if (spec.group.kind == GK::number) spec.group.value = d - 1;
      const po::Shape sh{d, row.v, 32};
      const po::Program p = po::build(spec, sh, costs);
      const double sim = po::simulate(p).makespan;
      const double real = run(spec, sh, rate, costs);
      worst = std::max(worst, std::abs(real / sim - 1));
      std::printf("%-12s %3d %3d %12.1f %12.1f %8.3f\n", row.name, d, row.v, real * 1e3, sim * 1e3, real / sim);
      std::fflush(stdout);
    }
  }
  std::printf("largest |measured/simulated - 1| = %.3f (target < 0.05)\n", worst);
  for (int d : {4, 8}) {
    const po::Shape sh{d, 2, 32};
    const double po_t = run({Family::grouped, {GK::uniform, 1}, po::offload::none}, sh, rate, costs);
    const double pof = run({Family::grouped, {GK::uniform, 1}, po::offload::all}, sh, rate, costs);
    const double paired = run({Family::grouped, {GK::uniform, 1}, po::offload::all}, sh, rate, costs, true);
    std::printf(
        "d=%d v=2 m=32: PO-F %.1f ms vs PO %.1f ms: offload costs %+.2f%% (target < 3%%); with PCIe pairs synchronised %.1f ms, %+.2f%%\n",
        d, pof * 1e3, po_t * 1e3, (pof / po_t - 1) * 100, paired * 1e3, (paired / po_t - 1) * 100);
  }
  return 0;
}
