// Schedule core: construction, the paper's warmup/peak/bubble facts, offload placement and
// validation, swept over many shapes (d 1..16, v 1..8, m 1..64, every legal g).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

namespace {

ScheduleSpec gis_g(int g, offload::selection off = offload::none) {
  return {Family::grouped, {GroupSpec::Kind::number, g}, off};
}

/// "F0.0 F1.0 ..." of rank r's first n compute ops (mb.chunk, as docs/design.md writes them).
std::string order_text(const Program& p, int r, std::size_t n) {
  std::string s;
  const auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
  for (std::size_t x = 0; x < std::min(n, ops.size()); ++x) {
    if (!s.empty()) s += ' ';
    s += std::string(op_name(ops[x].kind)) + std::to_string(ops[x].mb) + "." +
         std::to_string(p.shape.chunk_of(ops[x].stage));
  }
  return s;
}

std::vector<double> peaks(const Program& p) {
  std::vector<double> out;
  for (const auto& r : simulate(p).ranks) out.push_back(r.peak);
  return out;
}

/// The shapes a sweep visits: every m in 1..64 for d <= 8, else a spread that keeps the
/// multiples of d and of every g (the run stays under a minute on two cores).
bool visit_m(int d, int m) { return d <= 8 || m <= 16 || m % 4 == 0 || m % d == 0; }

}  // namespace

TEST_CASE("worked example d=4 v=2 m=8: each family's rank-0 order and per-rank peaks match docs/design.md") {
  const Shape s{4, 2, 8};
  const Program po_ = PO::build(s), gish = GIS_H::build(s), gis = GIS::build(s), i1f1b = Interleaved1F1B::build(s);
  CHECK(order_text(po_, 0, 16) == "F0.0 F1.0 F0.1 F2.0 F1.1 F3.0 B0.1 W0.1 F2.1 F4.0 B1.1 W1.1 F3.1 B0.0 W0.0 F5.0");
  CHECK(order_text(gish, 0, 15) == "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B0.0 W0.0 F4.0");
  CHECK(order_text(gis, 0, 14) == "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 W0.1 F4.0 B1.1 W1.1 F5.0");
  CHECK(peaks(po_) == std::vector<double>{7, 6, 5, 4});
  CHECK(peaks(gish) == std::vector<double>{6, 5, 4, 3});
  CHECK(peaks(gis) == std::vector<double>{8, 7, 6, 5});
  CHECK(peaks(i1f1b) == std::vector<double>{11, 9, 7, 5});
  for (const Program* p : {&po_, &gish, &gis, &i1f1b}) CHECK(validate(*p));
}

TEST_CASE("1F1B: rank i warms up with min(d-i, m) forwards, peaks there, bubble (d-1)(T_F+T_B+T_W)") {
  for (int d = 1; d <= 16; ++d)
    for (int m = 1; m <= 64; ++m) {
      const Program p = OneF1B::build({d, 1, m});
      REQUIRE_MESSAGE(validate(p), validate(p).error);
      const SimResult sim = simulate(p);
      for (int i = 0; i < d; ++i) {
        CHECK(sim.ranks[static_cast<std::size_t>(i)].warmup == std::min(d - i, m));
        CHECK(sim.ranks[static_cast<std::size_t>(i)].peak == std::min(d - i, m));
      }
      CHECK(sim.makespan == 3.0 * m + 3.0 * (d - 1));
    }
}

TEST_CASE("1F1B-I: warmup min(d(v-1)+2(d-i)-1, mv), rank 0 peaks at dv+d-1, bubble (d-1)(T_F+T_B+T_W)") {
  for (int d = 1; d <= 16; ++d)
    for (int v = 1; v <= 8; ++v)
      for (int m = d; m <= 64; m += d) {
        const Program p = Interleaved1F1B::build({d, v, m});
        REQUIRE_MESSAGE(validate(p), validate(p).error);
        const SimResult sim = simulate(p);
        for (int i = 0; i < d; ++i) {
          const int w = std::min(d * (v - 1) + 2 * (d - i) - 1, m * v);
          CHECK(sim.ranks[static_cast<std::size_t>(i)].warmup == w);
          CHECK(sim.ranks[static_cast<std::size_t>(i)].peak == w);
        }
        CHECK(sim.ranks[0].peak == std::min(d * v + d - 1, m * v));
        CHECK(sim.makespan == 3.0 * m * v + 3.0 * (d - 1));
      }
}

TEST_CASE("1F1B-I with m not a multiple of d is a clear error naming m and d") {
  CHECK_THROWS_WITH_AS(Interleaved1F1B::build({4, 2, 6}),
                       "1F1B-I (Megatron's interleaved order): microbatches m = 6 must be a multiple of ranks d = 4",
                       shape_error);
  CHECK_THROWS_AS(Interleaved1F1B::build({3, 1, 1}), shape_error);
}

TEST_CASE("GIS(g) for every legal g: rank i's peak = its warmup = min(g,m)(v-1)+min(d-i,m), capped at mv") {
  for (int d = 1; d <= 16; ++d)
    for (int g = (d + 1) / 2; g <= d; ++g)
      for (int v = 1; v <= 8; ++v)
        for (int m = 1; m <= 64; ++m) {
          if (!visit_m(d, m)) continue;
          const Program p = build(gis_g(g), {d, v, m});
          const Validation ok = validate(p);
          REQUIRE_MESSAGE(ok, "d=", d, " g=", g, " v=", v, " m=", m, ": ", ok.error);
          const SimResult sim = simulate(p);
          for (int i = 0; i < d; ++i) {
            const int want = std::min(std::min(g, m) * (v - 1) + std::min(d - i, m), m * v);
            CHECK_MESSAGE(sim.ranks[static_cast<std::size_t>(i)].peak == want, "d=", d, " g=", g, " v=", v, " m=", m,
                          " rank ", i);
            CHECK(sim.ranks[static_cast<std::size_t>(i)].warmup == want);
          }
          // The bubble row of Table 1 is exact when g | m: 2(d-1) + (d-g)(v-1) unit passes.
          if (m % g == 0) CHECK(sim.makespan - 3.0 * m * v == 2.0 * (d - 1) + 1.0 * (d - g) * (v - 1));
        }
}

TEST_CASE("GIS(g) costs exactly (d-g)(v-1) more than GIS under unit costs when d >= 3 and g, d divide m") {
  int checked = 0;
  for (int d = 3; d <= 16; ++d)
    for (int g = (d + 1) / 2; g <= d; ++g)
      for (int v = 1; v <= 8; ++v)
        for (int m = 1; m <= 64; ++m) {
          if (m % g != 0 || m % d != 0) continue;
          const double gis = simulate(GIS::build({d, v, m})).makespan;
          CHECK(simulate(build(gis_g(g), {d, v, m})).makespan - gis == 1.0 * (d - g) * (v - 1));
          ++checked;
        }
  CHECK(checked > 500);
}

TEST_CASE("symbolic groups: GIS is g=d, GIS-H is g=ceil(d/2), PO is g=1, and PO equals GIS-H for d <= 2") {
  for (int d = 1; d <= 9; ++d) {
    CHECK(GIS::build({d, 2, 4}).group == d);
    CHECK(GIS_H::build({d, 2, 4}).group == (d + 1) / 2);
    CHECK(PO::build({d, 2, 4}).group == 1);
  }
  for (int d = 1; d <= 2; ++d)
    for (int v = 1; v <= 4; ++v)
      for (int m = 1; m <= 9; ++m) {
        const Program a = PO::build({d, v, m}), b = GIS_H::build({d, v, m});
        for (int r = 0; r < d; ++r)
          CHECK(a.ranks[static_cast<std::size_t>(r)].compute == b.ranks[static_cast<std::size_t>(r)].compute);
      }
}

TEST_CASE("every family, with and without offload, validates over d 1..16, v 1..8, m 1..64") {
  long programs = 0;
  for (int d = 1; d <= 16; ++d)
    for (int v = 1; v <= 8; ++v)
      for (int m = 1; m <= 64; ++m) {
        if (!visit_m(d, m) || (d > 8 && m % 3 != 0 && m % d != 0)) continue;
        std::vector<ScheduleSpec> specs = {PO::spec,
                                           PO_H::spec,
                                           PO_F::spec,
                                           GIS_H::spec,
                                           ScheduleSpec{Family::grouped, {GroupSpec::Kind::half, 0}, offload::first(1)},
                                           ScheduleSpec{Family::grouped, {GroupSpec::Kind::full, 0}, offload::all}};
        if (v == 1) specs.push_back(ScheduleSpec{Family::one_f1b, {}, offload::all});
        if (m % d == 0) specs.push_back(ScheduleSpec{Family::interleaved_1f1b, {}, offload::half});
        for (const ScheduleSpec& spec : specs) {
          const Program p = build(spec, {d, v, m});
          const Validation ok = validate(p);
          REQUIRE_MESSAGE(ok, schedule_name(spec, v), " d=", d, " v=", v, " m=", m, ": ", ok.error);
          ++programs;
        }
      }
  CHECK(programs > 20000);
}

TEST_CASE("the PO planning grid (shifted building block) meets every dependency with unit slots") {
  for (int d = 1; d <= 16; ++d)
    for (int v = 1; v <= 8; ++v)
      for (int m : {1, 2, 3, 5, 8, 13, 32}) {
        Program p;
        p.spec = PO::spec;
        p.shape = {d, v, m};
        p.group = 1;
        p.ranks.resize(static_cast<std::size_t>(d));
        const detail::Block bk(p);
        std::vector<std::vector<long long>> grid(static_cast<std::size_t>(d));
        for (int r = 0; r < d; ++r) {
          detail::order_grouped_rank(p, bk, r);
          // Each pass's slot (Block::slot, and the per-rank table the builder uses); the order
          // is sorted by it (checked below).
          const detail::Block::RankGrid rg = bk.grid(r);
          for (const Op& op : p.ranks[static_cast<std::size_t>(r)].compute) {
            grid[static_cast<std::size_t>(r)].push_back(bk.slot(r, op));
            REQUIRE(rg.slot(op) == grid[static_cast<std::size_t>(r)].back());
          }
          REQUIRE(grid[static_cast<std::size_t>(r)].size() == static_cast<std::size_t>(3 * v * m));
        }
        const int S = d * v;
        std::vector<long long> fslot(static_cast<std::size_t>(S * m)), bslot(fslot.size()), wslot(fslot.size());
        for (int r = 0; r < d; ++r)
          for (std::size_t x = 0; x < grid[static_cast<std::size_t>(r)].size(); ++x) {
            const Op& op = p.ranks[static_cast<std::size_t>(r)].compute[x];
            auto& dst = op.kind == OpKind::F ? fslot : op.kind == OpKind::B ? bslot : wslot;
            dst[static_cast<std::size_t>(op.stage * m + op.mb)] = grid[static_cast<std::size_t>(r)][x];
            if (x > 0) REQUIRE(grid[static_cast<std::size_t>(r)][x] > grid[static_cast<std::size_t>(r)][x - 1]);
          }
        for (int s = 0; s < S; ++s)
          for (int mb = 0; mb < m; ++mb) {
            const auto u = static_cast<std::size_t>(s * m + mb);
            if (s > 0) CHECK(fslot[u] >= fslot[u - static_cast<std::size_t>(m)] + 1);
            if (s < S - 1) CHECK(bslot[u] >= bslot[u + static_cast<std::size_t>(m)] + 1);
            CHECK(bslot[u] >= fslot[u] + 1);
            CHECK(wslot[u] >= bslot[u] + 1);
          }
      }
}

TEST_CASE("PO's P2P plan from each rank's own list equals the merge of its neighbours' send lists") {
  // build() plans PO's P2P rank by rank from the rank's own passes (detail::plan_p2p_po_rank);
  // the general planner merges the neighbours' send lists (detail::plan_p2p_rank). Same plan.
  for (const ScheduleSpec& spec : {PO::spec, PO_F::spec})
    for (int d = 1; d <= 9; ++d)
      for (int v = 1; v <= 4; ++v)
        for (int m : {1, 2, 3, 5, 8, 13}) {
          const Program p = build(spec, {d, v, m});
          Program q = p;
          double tau = 0;
          for (int s = 0; s < d * v; ++s) tau += p.costs.F(s) + p.costs.B(s) + p.costs.W(s);
          tau /= 3.0 * d * v;
          const detail::Block bk(q);
          const auto end = [&](int rank, std::size_t, const Op& op) {
            return static_cast<double>(bk.slot(rank, op) + 1) * tau;
          };
          for (int r = 0; r < d; ++r) {
            q.ranks[static_cast<std::size_t>(r)].comm.clear();
            detail::plan_p2p_rank(q, r, end);
            REQUIRE(q.ranks[static_cast<std::size_t>(r)].comm == p.ranks[static_cast<std::size_t>(r)].comm);
          }
        }
}

TEST_CASE("bad shapes throw shape_error naming the value and the allowed range") {
  CHECK_THROWS_WITH_AS(GIS_G<2>::build({8, 2, 16}),
                       "GIS(g): group size g (legal: ceil(d/2) <= g <= d) = 2 is outside the allowed range [4, 8]",
                       shape_error);
  CHECK_THROWS_WITH_AS(GIS_G<9>::build({8, 2, 16}),
                       "GIS(g): group size g (legal: ceil(d/2) <= g <= d) = 9 is outside the allowed range [4, 8]",
                       shape_error);
  CHECK_THROWS_WITH_AS(PO::build({4, 2, 0}), "shape: microbatches m = 0 is outside the allowed range [1, 65536]",
                       shape_error);
  CHECK_THROWS_WITH_AS(PO::build({0, 2, 4}), "shape: ranks d = 0 is outside the allowed range [1, 4096]", shape_error);
  CHECK_THROWS_WITH_AS(PO::build({2, 0, 4}), "shape: chunks per rank v = 0 is outside the allowed range [1, 256]",
                       shape_error);
  CHECK_THROWS_WITH_AS(OneF1B::build({4, 2, 8}),
                       "1F1B: chunks per rank v (1F1B has one stage per rank) = 2 is outside the allowed range [1, 1]",
                       shape_error);
  CHECK_THROWS_WITH_AS(build(ScheduleSpec{Family::grouped, {}, offload::chunks({0, 5})}, {4, 2, 8}),
                       "offload::chunks: a listed chunk index is >= v = 2; allowed chunks are 0..1", shape_error);
  CHECK_THROWS_WITH_AS(
      offload::first(-1),
      "offload::first(n): n, the number of offloaded chunks, = -1 is outside the allowed range [0, 1073741824]",
      shape_error);
  Costs c;
  c.f = 0;
  CHECK_THROWS_WITH_AS(PO::build({2, 2, 4}, c), "costs: T_F must be a finite number > 0", shape_error);
  c.f = 1;
  c.stage_b = {1, 1, 1};
  CHECK_THROWS_WITH_AS(PO::build({2, 2, 4}, c),
                       "costs: per-stage T_B has 3 entries; it must have S = v*d = 4 (or none)", shape_error);
  CHECK_THROWS_WITH_AS(peak(PO::build({2, 2, 4}), 2),
                       "peak(program, rank): rank = 2 is outside the allowed range [0, 1]", shape_error);
}

TEST_CASE("m much smaller than g: trimmed groups leave the building block sparse, and it still builds fast and right") {
  const Program p = GIS::build({512, 16, 1});
  CHECK(validate(p));
  const SimResult s = simulate(p);
  CHECK(s.ranks[0].peak == 16);             // min(g, m)(v-1) + min(d, m) = 15 + 1
  CHECK(s.makespan == 2.0 * 16 * 512 + 1);  // F down every stage, B back up, then the last W
}

TEST_CASE("parse_schedule: every paper name gives its alias's spec and round-trips through schedule_name") {
  CHECK(po::parse_schedule("1f1b") == po::OneF1B::spec);
  CHECK(po::parse_schedule("1f1b-i") == po::Interleaved1F1B::spec);
  CHECK(po::parse_schedule("gis") == po::GIS::spec);
  CHECK(po::parse_schedule("gis-h") == po::GIS_H::spec);
  CHECK(po::parse_schedule("gis-g", 3) == po::GIS_G<3>::spec);
  CHECK(po::parse_schedule("po") == po::PO::spec);
  CHECK(po::parse_schedule("po-h") == po::PO_H::spec);
  CHECK(po::parse_schedule("po-f") == po::PO_F::spec);
  for (const char* n : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f"})
    CHECK(po::schedule_name(po::parse_schedule(n, 3)) == n);
  CHECK_THROWS_WITH(po::parse_schedule("zb-h3"),
                    "schedule must be one of 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, "
                    "po-f, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v, got 'zb-h3'");
}
