// tests/schedule/test_zero_bubble.cpp: the V placement and the zero-bubble families (ZB-H1,
// ZB-H2, ZB-V, V-Half, V-Min, DualPipeV): names, placement, validity on every small shape, peaks and
// unit-cost makespans against the formulas of docs/schedules.md, "Zero-bubble families", offload on each.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

namespace {

const std::vector<ScheduleSpec>& zero_bubble_specs() {
  static const std::vector<ScheduleSpec> specs = {ZB_H1::spec,  ZB_H2::spec, ZB_V::spec,
                                                  V_Half::spec, V_Min::spec, DualPipeV::spec};
  return specs;
}

int chunks_of(const ScheduleSpec& s) { return s.placement == Placement::vshape ? 2 : 1; }

// DualPipeV is defined for m >= 2d only (check_shape refuses the rest with a sentence).
bool legal(const ScheduleSpec& s, int d, int m) { return s.family != Family::dualpipe_v || m >= 2 * d; }

}  // namespace

static_assert(ZB_V::spec.placement == Placement::vshape && V_Half::spec.placement == Placement::vshape &&
              V_Min::spec.placement == Placement::vshape && DualPipeV::spec.placement == Placement::vshape);
static_assert(ZB_H1::spec.placement == Placement::interleaved && ZB_H2::spec.placement == Placement::interleaved);
static_assert(validate(ZB_H1::build({4, 1, 8})));
static_assert(validate(ZB_V::build({3, 2, 6})));
static_assert(validate(DualPipeV::build({3, 2, 6})));

TEST_CASE("the V placement: rank r holds stages r and 2d-1-r, and stage_of inverts rank_of") {
  for (int d : {1, 2, 3, 8})
    for (int v : {1, 2, 3, 4}) {
      const Shape s{d, v, 1, Placement::vshape};
      for (int st = 0; st < s.stages(); ++st) {
        CHECK(s.stage_of(s.rank_of(st), s.chunk_of(st)) == st);
        const int r = s.rank_of(st), c = s.chunk_of(st);
        CHECK(r == (c % 2 == 0 ? st - c * d : (c + 1) * d - 1 - st));
      }
      if (v == 2)
        for (int r = 0; r < d; ++r) {
          CHECK(s.stage_of(r, 0) == r);
          CHECK(s.stage_of(r, 1) == 2 * d - 1 - r);
        }
      // Stages d-1 and d meet on rank d-1 (no hop); every other neighbour pair crosses ranks.
      for (int st = 0; st + 1 < s.stages(); ++st) CHECK(s.crosses(st) == (d > 1 && (st + 1) % d != 0));
    }
}

TEST_CASE("zero-bubble names round-trip through the parser, and bad placements are refused with a sentence") {
  for (const char* n : {"zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"}) {
    const ScheduleSpec s = parse_schedule(n);
    CHECK(schedule_name(s, chunks_of(s)) == n);
  }
  CHECK(parse_schedule("zb-v") == ZB_V::spec);
  CHECK(schedule_name(Schedule<ZeroBubble<Family::zb_h1>, OffloadPolicy<offload::all>>::spec, 1) ==
        "zb-h1+offload(all)");
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const shape_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([] { (void)ZB_V::build({4, 3, 8}); }).find("chunks per rank v") != std::string::npos);
  CHECK(message([] { (void)ZB_H1::build({4, 2, 8}); }).find("chunks per rank v") != std::string::npos);
  ScheduleSpec wrong = GIS::spec;
  wrong.placement = Placement::vshape;
  CHECK(message([&] { (void)build(wrong, {4, 2, 8}); }) ==
        "placement: the V placement (VShape) is only for ZB-V, V-Half, V-Min and DualPipeV; use the schedule's own "
        "alias or parse_schedule()");
  CHECK(message([] { (void)GIS::build({4, 2, 8, Placement::vshape}); }) ==
        "shape: its placement is not the schedule's (build() takes the placement from the schedule)");
}

TEST_CASE("zero-bubble families: every shape d 1..12, m 1..48 validates, with peaks within the family's cap") {
  for (const ScheduleSpec& spec : zero_bubble_specs())
    for (int d = 1; d <= 12; ++d)
      for (int m = 1; m <= 48; ++m) {
        if (!legal(spec, d, m)) continue;
        const int v = chunks_of(spec);
        const Program p = build(spec, {d, v, m});
        const Validation ok = validate(p);
        REQUIRE_MESSAGE(ok, schedule_name(spec, v), " d=", d, " m=", m, ": ", ok.error);
        CHECK(p.shape.placement == spec.placement);
        const SimResult sim = simulate(p);
        const int cap = detail::greedy_cap(spec.family, d);  // V-Min, DualPipeV: their orders' peaks
        for (int r = 0; r < d; ++r) {
          CHECK_MESSAGE(sim.ranks[static_cast<std::size_t>(r)].peak <= std::min(cap, v * m), schedule_name(spec, v),
                        " d=", d, " m=", m, " rank ", r);
          CHECK(sim.ranks[static_cast<std::size_t>(r)].busy == 3.0 * v * m);
        }
        // No schedule beats the lower bound: the last rank starts at d-1 and has 3vm passes.
        CHECK(sim.makespan >= 3.0 * v * m + d - 1);
      }
}

TEST_CASE("zero-bubble ZB-H1 and ZB-H2: peaks and unit-cost makespans equal docs/design.md's formulas") {
  for (int d = 1; d <= 12; ++d)
    for (int m = 1; m <= 48; ++m) {
      // ZB-H1: every rank min(d, m) units (1F1B's rank-0 peak); makespan 3m + d - 1 for m >= d
      // (the lower bound), 2m + 2d - 1 below (the first microbatch's chain, then the rest).
      const double span = m >= d ? 3.0 * m + d - 1 : 2.0 * m + 2 * d - 1;
      const SimResult h1 = simulate(ZB_H1::build({d, 1, m}));
      CHECK_MESSAGE(h1.makespan == span, "ZB-H1 d=", d, " m=", m, ": ", h1.makespan);
      for (int r = 0; r < d; ++r)
        CHECK_MESSAGE(h1.ranks[static_cast<std::size_t>(r)].peak == std::min(d, m), "ZB-H1 d=", d, " m=", m, " rank ",
                      r);
      // ZB-H2: the same makespan under unit costs (both at the bound), rank 0's warmup bubble
      // filled with forwards: a peak of at most 2d units.
      const SimResult h2 = simulate(ZB_H2::build({d, 1, m}));
      CHECK_MESSAGE(h2.makespan == span, "ZB-H2 d=", d, " m=", m, ": ", h2.makespan);
      CHECK(h2.max_peak() <= 2 * d);
      // 1F1B's bubble is 3(d-1); ZB-H1's d-1 (m >= d).
      if (m >= d) CHECK(simulate(OneF1B::build({d, 1, m})).makespan - h1.makespan == 2.0 * (d - 1));
    }
}

TEST_CASE("zero-bubble ZB-V, V-Half, V-Min: peaks and makespans at d = 4, 8 (the figures in bench/RESULTS.md)") {
  // The results, kept so that a change shows; ZB-V reaches the bound 6m + d - 1 (whenever d
  // divides m); V-Half's equal the authors' generators' here, V-Min's equal theirs at d = 4 and
  // are a unit shorter at d = 8.
  struct Row {
    ScheduleSpec spec;
    int d, m;
    double makespan, peak;
  };
  const Row rows[] = {
      {ZB_V::spec, 4, 8, 51, 8},      {ZB_V::spec, 4, 16, 99, 8},     {ZB_V::spec, 8, 16, 103, 16},
      {ZB_V::spec, 8, 32, 199, 16},   {V_Half::spec, 4, 8, 53, 6},    {V_Half::spec, 4, 16, 101, 6},
      {V_Half::spec, 8, 16, 113, 10}, {V_Half::spec, 8, 32, 209, 10}, {V_Min::spec, 4, 8, 59, 4},
      {V_Min::spec, 4, 16, 107, 4},   {V_Min::spec, 8, 16, 122, 8},   {V_Min::spec, 8, 32, 218, 8},
  };
  for (const Row& row : rows) {
    const SimResult sim = simulate(build(row.spec, {row.d, 2, row.m}));
    CHECK_MESSAGE(sim.makespan == row.makespan, schedule_name(row.spec, 2), " d=", row.d, " m=", row.m);
    CHECK_MESSAGE(sim.max_peak() == row.peak, schedule_name(row.spec, 2), " d=", row.d, " m=", row.m);
  }
}

TEST_CASE("DualPipeV: every rank 2d + 1 units and the makespan bound 6m + d - 1 (d 1..12, m 2d..48); m < 2d refused") {
  for (int d = 1; d <= 12; ++d) {
    for (int m = 2 * d; m <= 48; ++m) {
      const SimResult sim = simulate(DualPipeV::build({d, 2, m}));
      // Unit costs: no rank idles after its first input arrives (bubble d - 1, ZB-V's ideal).
      CHECK_MESSAGE(sim.makespan == 6.0 * m + d - 1, "d=", d, " m=", m, ": ", sim.makespan);
      for (int r = 0; r < d; ++r)
        CHECK_MESSAGE(sim.ranks[static_cast<std::size_t>(r)].peak == 2 * d + 1, "d=", d, " m=", m, " rank ", r);
    }
    if (d == 1) continue;
    try {
      (void)DualPipeV::build({d, 2, 2 * d - 1});
      FAIL("m = 2d - 1 was accepted");
    } catch (const shape_error& e) {
      CHECK(std::string(e.what()) == "DualPipeV: microbatches m = " + std::to_string(2 * d - 1) +
                                         " must be at least 2d = " + std::to_string(2 * d) +
                                         " (DeepSeek's order: a warmup of 2d - 1 forwards on rank 0, then at least "
                                         "one steady-state step)");
    }
  }
  // The steady state pairs the forward of one microbatch with the full backward of another:
  // rank 0 of d = 2, m = 4 (stages 0 and 3), DeepSeek's eight steps written out.
  const Program p = DualPipeV::build({2, 2, 4});
  // Steps: 1. F0 F0  2. F0 F1  3. Bz1 W F1  4. F0 B1 F1 B0  5. B1 F1 B0  6. B1 Bz0  7. W Bz0  8. W
  const std::vector<Op> rank0 = {
      {OpKind::F, 0, 0}, {OpKind::F, 0, 1}, {OpKind::F, 0, 2}, {OpKind::F, 3, 0}, {OpKind::B, 3, 0}, {OpKind::W, 3, 0},
      {OpKind::F, 3, 1}, {OpKind::F, 0, 3}, {OpKind::B, 3, 1}, {OpKind::W, 3, 1}, {OpKind::F, 3, 2}, {OpKind::B, 0, 0},
      {OpKind::W, 0, 0}, {OpKind::B, 3, 2}, {OpKind::W, 3, 2}, {OpKind::F, 3, 3}, {OpKind::B, 0, 1}, {OpKind::W, 0, 1},
      {OpKind::B, 3, 3}, {OpKind::W, 3, 3}, {OpKind::B, 0, 2}, {OpKind::W, 0, 2}, {OpKind::B, 0, 3}, {OpKind::W, 0, 3}};
  CHECK(p.ranks[0].compute == rank0);
}

TEST_CASE("zero-bubble ZB-V, V-Half, V-Min: no worse than the authors' generators on the grid of bench/RESULTS.md") {
  // The authors' figures (zbv.py; zbv_greedy.py with 'half'), their orders replayed ASAP under
  // unit costs, peak in units held from F's start to W's end: {ZB-V?, d, m, makespan, peak}.
  struct Theirs {
    bool zb_v;
    int d, m;
    double makespan, peak;
  };
  // zbv_greedy.py with 'min' (V-Min), the same way: {d, m, makespan, peak}.
  struct TheirsMin {
    int d, m;
    double makespan, peak;
  };
  const TheirsMin min_rows[] = {{2, 2, 15, 4},   {2, 4, 27, 4},   {2, 6, 39, 4},   {2, 8, 51, 4},   {3, 3, 26, 4},
                                {3, 6, 41, 4},   {3, 9, 59, 4},   {3, 12, 77, 4},  {4, 4, 35, 4},   {4, 8, 59, 4},
                                {4, 12, 83, 4},  {4, 16, 107, 4}, {5, 5, 45, 6},   {5, 10, 75, 6},  {5, 15, 105, 6},
                                {5, 20, 135, 6}, {6, 6, 53, 6},   {6, 12, 89, 6},  {6, 18, 125, 6}, {6, 24, 161, 6},
                                {8, 8, 75, 8},   {8, 16, 123, 8}, {8, 24, 171, 8}, {8, 32, 219, 8}};
  for (const TheirsMin& row : min_rows) {
    const SimResult sim = simulate(V_Min::build({row.d, 2, row.m}));
    CHECK_MESSAGE(sim.makespan <= row.makespan, "v-min d=", row.d, " m=", row.m, ": ", sim.makespan);
    CHECK_MESSAGE(sim.max_peak() <= row.peak, "v-min d=", row.d, " m=", row.m);
  }
  const Theirs rows[] = {
      {true, 2, 2, 13, 4},   {true, 2, 4, 25, 4},     {true, 2, 6, 37, 4},     {true, 2, 8, 49, 4},
      {true, 3, 3, 20, 6},   {true, 3, 6, 38, 6},     {true, 3, 9, 56, 6},     {true, 3, 12, 74, 6},
      {true, 4, 4, 27, 8},   {true, 4, 8, 51, 8},     {true, 4, 12, 75, 8},    {true, 4, 16, 99, 8},
      {true, 5, 5, 34, 10},  {true, 5, 10, 64, 10},   {true, 5, 15, 94, 10},   {true, 5, 20, 124, 10},
      {true, 6, 6, 41, 12},  {true, 6, 12, 77, 12},   {true, 6, 18, 113, 12},  {true, 6, 24, 149, 12},
      {true, 8, 8, 55, 16},  {true, 8, 16, 103, 16},  {true, 8, 24, 151, 16},  {true, 8, 32, 199, 16},
      {false, 2, 2, 15, 4},  {false, 2, 4, 25, 4},    {false, 2, 6, 37, 4},    {false, 2, 8, 49, 4},
      {false, 3, 3, 23, 4},  {false, 3, 6, 41, 4},    {false, 3, 9, 59, 4},    {false, 3, 12, 77, 4},
      {false, 4, 4, 34, 6},  {false, 4, 8, 53, 6},    {false, 4, 12, 77, 6},   {false, 4, 16, 101, 6},
      {false, 5, 5, 44, 6},  {false, 5, 10, 71, 6},   {false, 5, 15, 101, 6},  {false, 5, 20, 131, 6},
      {false, 6, 6, 48, 8},  {false, 6, 12, 83, 8},   {false, 6, 18, 119, 8},  {false, 6, 24, 155, 8},
      {false, 8, 8, 65, 10}, {false, 8, 16, 113, 10}, {false, 8, 24, 161, 10}, {false, 8, 32, 209, 10}};
  for (const Theirs& row : rows) {
    const ScheduleSpec spec = row.zb_v ? ZB_V::spec : V_Half::spec;
    const SimResult sim = simulate(build(spec, {row.d, 2, row.m}));
    CHECK_MESSAGE(sim.makespan <= row.makespan, schedule_name(spec, 2), " d=", row.d, " m=", row.m);
    CHECK_MESSAGE(sim.max_peak() <= row.peak, schedule_name(spec, 2), " d=", row.d, " m=", row.m);
  }
  // ZB-V sits on the lower bound whenever d divides m.
  for (int d = 1; d <= 12; ++d)
    for (int m = d; m <= 48; m += d)
      CHECK_MESSAGE(simulate(ZB_V::build({d, 2, m})).makespan == 6.0 * m + d - 1, "ZB-V d=", d, " m=", m);
}

TEST_CASE("zero-bubble families with offload: valid, never above the plain peak, and no execution above the plan") {
  for (const ScheduleSpec& base : zero_bubble_specs())
    for (int d : {1, 2, 3, 4, 6})
      for (int m : {d, 2 * d, 3 * d + 1})
        for (offload::selection sel : {offload::all, offload::first(1)}) {
          if (!legal(base, d, m)) continue;
          ScheduleSpec spec = base;
          spec.offload = sel;
          const int v = chunks_of(spec);
          Costs c;
          c.k = 0.5;
          c.comm = 0.25;
          const Program p = build(spec, {d, v, m}, c);
          const Validation ok = validate(p);
          REQUIRE_MESSAGE(ok, schedule_name(spec, v), " d=", d, " m=", m, ": ", ok.error);
          const double planned = simulate(p).max_peak();
          CHECK(planned <= simulate(build(base, {d, v, m}, c)).max_peak());
          // The same randomized speed setting as PO-F's: any speeds of passes and copies.
          for (double k : {0.1, 2.0, 10.0})
            for (double f : {0.3, 2.5})
              for (double w : {0.1, 4.0}) {
                Costs x = p.costs;
                x.k = k;
                x.f = f;
                x.w = w;
                CHECK_MESSAGE(simulate(p, x).max_peak() <= planned, schedule_name(spec, v), " d=", d, " m=", m,
                              " k=", k, " f=", f, " w=", w);
              }
        }
}
