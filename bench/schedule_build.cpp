// bench/schedule_build: how long building + validating + simulating a schedule takes.
//
//   ./build/bench/schedule_build            # PO-F d=64 v=8 m=512 (target: < 50 ms), then d = 8..1024
//   ./build/bench/schedule_build --quick    # fewer repetitions, d up to 256
//
// Each figure is the median of several runs of the whole pipeline (build, validate,
// simulate) in this process; the phases are timed separately so their growth can be read.
// The pipeline splits its per-rank work among the machine's cores (po::Workers); the
// target shape is also timed on one thread, and into reused outputs (build_into,
// simulate_into: a planner's search, where no output memory is new after the first).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>
#include "../samples/cli.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Phases {
  double build = 0, validate = 0, simulate = 0, total = 0;
  long ops = 0;
};

/// Medians of `reps` runs after one untimed run (which pays the process's one-time costs);
/// with `reuse`, each run builds and simulates into the previous run's Program and
/// SimResult, else into fresh ones.
Phases measure(const po::Shape& s, int reps, bool reuse = false, po::Workers workers = {}) {
  std::vector<double> b, v, sim, tot;
  long ops = 0;
  po::Program kept;
  po::SimResult kept_sim;
  po::PO_F::build_into(kept, s);
  po::simulate_into(kept_sim, kept);
  if (!reuse) {
    kept = {};
    kept_sim = {};
  }
  for (int i = 0; i < reps; ++i) {
    po::Program fresh;
    po::SimResult fresh_sim;
    po::Program& p = reuse ? kept : fresh;
    po::SimResult& r = reuse ? kept_sim : fresh_sim;
    const auto t0 = clock_type::now();
    po::PO_F::build_into(p, s, {}, workers);
    const double tb = ms_since(t0);
    const auto t1 = clock_type::now();
    const po::Validation ok = po::validate(p, workers);
    const double tv = ms_since(t1);
    const auto t2 = clock_type::now();
    po::simulate_into(r, p, workers);
    const double ts = ms_since(t2);
    if (!ok || r.makespan <= 0) {
      std::fprintf(stderr, "schedule_build: d=%d v=%d m=%d is invalid: %s\n", s.d, s.v, s.m, ok.error.c_str());
      std::exit(1);
    }
    ops = 0;
    for (const auto& rp : p.ranks) ops += static_cast<long>(rp.compute.size() + rp.copy.size());
    b.push_back(tb);
    v.push_back(tv);
    sim.push_back(ts);
    tot.push_back(tb + tv + ts);
  }
  return {median(b), median(v), median(sim), median(tot), ops};
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  cli::parsed_or_exit("schedule_build", [&] {
    cli::help(argc, argv, "usage: schedule_build [--quick]\n");
    constexpr cli::Flag flags[] = {{"--quick", false}};
    quick = cli::Args(argc, argv, flags).has("--quick");
  });
  const po::Shape target{64, 8, 512};
  const unsigned cores = std::thread::hardware_concurrency();
  const int reps = quick ? 3 : 7;
  const Phases t = measure(target, reps);
  std::printf(
      "PO-F d=64 v=8 m=512: build+validate+simulate %.1f ms (median of %d; build %.1f, validate %.1f, simulate %.1f; %ld ops; %u cores); target < 50 ms: %s\n",
      t.total, reps, t.build, t.validate, t.simulate, t.ops, cores, t.total < 50 ? "met" : "MISSED");
  // The same into the outputs of the run before (build_into, simulate_into).
  const Phases again = measure(target, reps, true);
  std::printf("  into reused outputs: %.1f ms (build %.1f, validate %.1f, simulate %.1f); target < 50 ms: %s\n",
              again.total, again.build, again.validate, again.simulate, again.total < 50 ? "met" : "MISSED");
  // The same on one thread, for machines with one core to spare.
  const Phases one = measure(target, reps, false, po::Workers{1});
  std::printf("  on one thread (po::Workers{1}): %.1f ms (build %.1f, validate %.1f, simulate %.1f)\n", one.total,
              one.build, one.validate, one.simulate);
  std::printf("\n%6s %4s %5s %10s %10s %10s %10s %10s %12s\n", "d", "v", "m", "ops", "build_ms", "valid_ms", "sim_ms",
              "total_ms", "ns_per_op");
  for (int d = 8; d <= (quick ? 256 : 1024); d *= 2) {
    const Phases p = measure({d, 8, 512}, d >= 512 ? 1 : 3);
    std::printf("%6d %4d %5d %10ld %10.1f %10.1f %10.1f %10.1f %12.1f\n", d, 8, 512, p.ops, p.build, p.validate,
                p.simulate, p.total, 1e6 * p.total / static_cast<double>(p.ops));
  }
  return 0;
}
