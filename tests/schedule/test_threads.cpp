// build(), validate() and simulate() split their per-rank work among threads
// (schedule/detail/parallel.hpp): every result must be bit-identical to a run on one thread,
// for valid programs and for broken ones (same verdict, same message), and an exception thrown
// on a worker must reach the caller. This suite also runs under ThreadSanitizer (dev.sh).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

#include "same.hpp"

using namespace pipeoffload;
using pipeoffload_test::same_program;
using pipeoffload_test::same_sim;

namespace {

/// Everything a call produced, or the message it threw.
struct Outcome {
  std::string error;
  Program program;
  Validation valid;
  SimResult sim;
};

/// Builds (or takes `given`), validates and simulates on `threads` threads.
Outcome run(int threads, const ScheduleSpec& spec, const Shape& shape, const Costs& costs,
            const std::function<void(Program&)>& change = {}) {
  const Workers t(threads);
  Outcome o;
  try {
    o.program = build(spec, shape, costs, t);
  } catch (const std::exception& e) {
    o.error = std::string("build: ") + e.what();
    return o;
  }
  if (change) change(o.program);
  o.valid = validate(o.program, t);
  try {
    o.sim = simulate(o.program, t);
  } catch (const std::exception& e) {
    o.error = std::string("simulate: ") + e.what();
  }
  return o;
}

void require_same(const Outcome& one, const Outcome& many) {
  REQUIRE(many.error == one.error);
  REQUIRE(same_program(many.program, one.program));
  REQUIRE(bool(many.valid) == bool(one.valid));
  REQUIRE(many.valid.error == one.valid.error);
  REQUIRE(same_sim(many.sim, one.sim));
}

const ScheduleSpec specs[] = {OneF1B::spec, Interleaved1F1B::spec, GIS::spec, GIS_H::spec, PO::spec, PO_H::spec,
                              PO_F::spec};

}  // namespace

TEST_CASE("po::Workers: the count given, 0 by default; a bad count names the range") {
  CHECK(Workers{}.count == 0);
  CHECK(Workers{3}.count == 3);
  try {
    (void)Workers{-1};
    FAIL("no exception");
  } catch (const shape_error& e) {
    CHECK(std::string(e.what()) == "po::Workers: n = -1 is outside the allowed range [0, 256]");
  }
  CHECK_THROWS_AS((void)Workers{257}, shape_error);
  // In a constant expression everything runs on the calling thread, whatever the count.
  static_assert(validate(build(PO_F::spec, {4, 2, 8}, {}, Workers{4}), Workers{4}));
}

TEST_CASE("build, validate and simulate are bit-identical on 1 to 4 threads") {
  int cases = 0;
  for (const ScheduleSpec& spec : specs)
    for (int d : {1, 2, 3, 4, 5, 8})
      for (int v : {1, 2, 3})
        for (int m : {1, 4, 9}) {
          Costs c;
          if ((d + v + m) % 3 == 0) c.k = 0.5;
          if ((d + v + m) % 3 == 1) {
            c.comm = 0.25;
            c.stage_f.assign(static_cast<std::size_t>(d * v), 1.0);
            c.stage_f.back() = 2.5;  // a slower last stage (an LM head)
            c.stage_b = c.stage_w = c.stage_f;
          }
          const Outcome one = run(1, spec, {d, v, m}, c);
          for (int threads : {2, 3, 4}) require_same(one, run(threads, spec, {d, v, m}, c));
          if (one.error.empty()) {
            REQUIRE(one.valid);
            ++cases;
          }
        }
  CHECK(cases > 300);  // 1F1B-I refuses m not a multiple of d (the same refusal on any thread count)
}

TEST_CASE("broken programs: the same verdict and the same message on any number of threads") {
  // Each change breaks a different rule; the message comes from validate() and, where the
  // orders cannot run, from simulate()'s ASAP run.
  const std::function<void(Program&)> changes[] = {
      [](Program& p) {
        std::rotate(p.ranks[2].compute.begin(), p.ranks[2].compute.end() - 1, p.ranks[2].compute.end());
      },                                                                                 // a W first
      [](Program& p) { p.ranks[2].comm.pop_back(); },                                    // a message never received
      [](Program& p) { std::reverse(p.ranks[0].comm.begin(), p.ranks[0].comm.end()); },  // a P2P order that deadlocks
      [](Program& p) {                                                                   // a reload before its offload
        auto& k = p.ranks[3].copy;
        const auto r = std::find_if(k.begin(), k.end(), [](const Op& op) { return op.kind == OpKind::R; });
        if (r != k.end()) std::rotate(k.begin(), r, r + 1);
      },
      [](Program& p) {
        p.ranks[0].compute.back().wait = static_cast<int>(p.ranks[0].copy.size());
      },  // an edge past the end
      [](Program& p) {
        std::rotate(p.ranks[1].compute.begin(), p.ranks[1].compute.begin() + 3, p.ranks[1].compute.end());
      },
  };
  int broken = 0;
  for (const ScheduleSpec& spec : {GIS::spec, PO_H::spec, PO_F::spec})
    for (const auto& change : changes) {
      const Outcome one = run(1, spec, {4, 2, 8}, {}, change);
      broken += one.valid ? 0 : 1;
      for (int threads : {2, 4}) require_same(one, run(threads, spec, {4, 2, 8}, {}, change));
    }
  CHECK(broken == 3 * 6 - 1);  // GIS has no reload to move
}

TEST_CASE("an exception on a worker thread reaches the caller with its message") {
  // A copy time far below a pass: the copy-slot grid would be too fine. PO-F places each
  // pair's offloads on a worker.
  Costs c;
  c.t_o = 1e-12;
  const Outcome one = run(1, PO_F::spec, {8, 2, 16}, c);
  REQUIRE(one.error.rfind("build: costs: T_O = k(T_F+T_B+T_W)/2 is too small for this schedule", 0) == 0);
  for (int threads : {2, 4}) CHECK(run(threads, PO_F::spec, {8, 2, 16}, c).error == one.error);
}

TEST_CASE("a schedule large enough to use every core by default matches one thread") {
  // 6 * 4 * 256 units on each of 16 ranks: past the default grain, so threads = 0 splits it.
  const Outcome one = run(1, PO_F::spec, {16, 4, 256}, {});
  const Outcome all = run(0, PO_F::spec, {16, 4, 256}, {});
  require_same(one, all);
  CHECK(all.valid);
}

TEST_CASE("simulate fills end times and memory timelines while its ASAP run goes, as one thread does") {
  // Large enough that the item following the run takes up ranks before it ends; per-stage
  // costs and unit sizes make the events of a timeline fall at distinct times.
  Costs c;
  for (int s = 0; s < 32 * 4; ++s) {
    c.stage_f.push_back(1.0 + 0.25 * (s % 3));
    c.stage_b.push_back(2.0 + 0.5 * (s % 5));
    c.stage_w.push_back(0.5 + 0.25 * (s % 4));
    c.unit_bytes.push_back(1.0 + (s % 7));
  }
  c.comm = 0.125;
  for (const Costs& costs : {Costs{}, c}) {
    const Outcome one = run(1, PO_F::spec, {32, 4, 128}, costs);
    REQUIRE(one.error.empty());
    for (int threads : {2, 3}) require_same(one, run(threads, PO_F::spec, {32, 4, 128}, costs));
  }
  // A rank that cannot start: the run throws while the other ranks' outputs are being filled.
  const auto stuck = [](Program& p) {
    std::swap(p.ranks[5].compute[0], p.ranks[5].compute[p.ranks[5].compute.size() / 2]);
  };
  const Outcome one = run(1, PO_F::spec, {32, 4, 128}, {}, stuck);
  REQUIRE(one.error.rfind("simulate: schedule cannot run: rank", 0) == 0);
  for (int threads : {2, 3}) CHECK(run(threads, PO_F::spec, {32, 4, 128}, {}, stuck).error == one.error);
}
