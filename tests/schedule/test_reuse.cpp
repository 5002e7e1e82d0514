// build_into() and simulate_into(): outputs built into a Program or SimResult that held
// another schedule (larger, smaller, another family, other costs) are bit-identical to fresh
// ones; a bad shape leaves the Program as it was. Compiled into the threads binary, which
// dev.sh also runs under ThreadSanitizer and AddressSanitizer (stale lengths would show).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

#include "same.hpp"

using namespace pipeoffload;
using pipeoffload_test::same_program;
using pipeoffload_test::same_sim;

namespace {

struct Case {
  ScheduleSpec spec;
  Shape shape;
  Costs costs;
};

/// Per-stage costs and unit sizes for S stages (distinct event times in the timelines).
Costs uneven(int S) {
  Costs c;
  for (int s = 0; s < S; ++s) {
    c.stage_f.push_back(1.0 + 0.25 * (s % 3));
    c.stage_b.push_back(2.0 + 0.5 * (s % 5));
    c.stage_w.push_back(0.5 + 0.25 * (s % 4));
    c.unit_bytes.push_back(1.0 + (s % 7));
  }
  c.comm = 0.125;
  return c;
}

// The sequence changes d, v and m both ways, the family (fused or not), offload on and off,
// and the cost model; the large PO-F shapes take the threaded paths.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {PO_F::spec, {16, 4, 256}, {}},
      {Interleaved1F1B::spec, {4, 2, 8}, {}},
      {PO_H::spec, {8, 4, 32}, uneven(32)},
      {OneF1B::spec, {2, 1, 3}, {}},
      {GIS_H::spec, {7, 3, 20}, {}},
      {PO_F::spec, {32, 4, 128}, uneven(128)},
      {PO::spec, {5, 2, 9}, {}},
      {PO_F::spec, {1, 1, 1}, {}},
      {PO_F::spec, {16, 4, 256}, {}},
  };
  return all;
}

}  // namespace

TEST_CASE("build_into and simulate_into over a changing sequence of schedules match fresh outputs") {
  Program p;
  SimResult s;
  for (const Case& c : cases()) {
    CAPTURE(schedule_name(c.spec, c.shape.v));
    CAPTURE(c.shape.d);
    CAPTURE(c.shape.v);
    CAPTURE(c.shape.m);
    build_into(p, c.spec, c.shape, c.costs);
    const Program fresh = build(c.spec, c.shape, c.costs);
    REQUIRE(same_program(p, fresh));
    REQUIRE(validate(p));
    simulate_into(s, p);
    REQUIRE(same_sim(s, simulate(fresh)));
    // Under other costs too (the durations change, the orders stay).
    simulate_into(s, p, uneven(c.shape.stages()));
    REQUIRE(same_sim(s, simulate(fresh, uneven(c.shape.stages()))));
  }
}

TEST_CASE("build_into through a schedule type, and a bad shape that leaves the Program as it was") {
  Program p;
  PO_H::build_into(p, {8, 4, 32});
  REQUIRE(same_program(p, PO_H::build({8, 4, 32})));
  std::string error;
  try {
    build_into(p, PO_F::spec, {8, 4, 0});
  } catch (const shape_error& e) {
    error = e.what();
  }
  CHECK(error == "shape: microbatches m = 0 is outside the allowed range [1, 65536]");
  CHECK(same_program(p, PO_H::build({8, 4, 32})));
}

// In a constant expression: a Program rebuilt in place.
static_assert([] {
  Program p;
  build_into(p, PO_F::spec, {4, 4, 16});
  build_into(p, PO_H::spec, {2, 2, 4});
  return validate(p).ok && p.ranks.size() == 2 && simulate(p).makespan == simulate(PO_H::build({2, 2, 4})).makespan;
}());
