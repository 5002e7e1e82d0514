// Offload placement (docs/design.md section 3): one copy stream (or two), one-offload-one-reload slots,
// longest lifespan first, units that cannot hide the round trip kept, PCIe pairs staggered,
// cross-stream edges that keep execution within the planned memory.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

namespace {

ScheduleSpec with_offload(ScheduleSpec s, offload::selection sel) {
  s.offload = sel;
  return s;
}

double max_peak(const Program& p) { return simulate(p).max_peak(); }

int offloaded_units(const Program& p) {
  int n = 0;
  for (const auto& r : p.ranks)
    for (const Op& op : r.copy) n += op.kind == OpKind::O ? 1 : 0;
  return n;
}

/// Every copy op runs in simulated time where the rules say: O after its F, R after its O and
/// before its B, and the copy stream runs one op at a time (with two copy streams: each stream
/// one op at a time, a reload after every copy before it).
void check_copy_timing(const Program& p) {
  const SimResult sim = simulate(p);
  const bool duplex = p.costs.duplex();
  const int m = p.shape.m;
  for (int r = 0; r < p.shape.d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    const auto& rs = sim.ranks[static_cast<std::size_t>(r)];
    std::vector<double> fend(static_cast<std::size_t>(p.shape.stages() * m)), bstart(fend.size()), oend(fend.size());
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const Op& op = rp.compute[x];
      const auto u = static_cast<std::size_t>(op.stage * m + op.mb);
      if (op.kind == OpKind::F) fend[u] = rs.compute_end[x];
      if (op.kind == OpKind::B || op.kind == OpKind::BW) bstart[u] = rs.compute_start[x];
    }
    double all_end = 0, o_end = 0;  // latest end of any copy so far, of any offload so far
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      const Op& op = rp.copy[y];
      const auto u = static_cast<std::size_t>(op.stage * m + op.mb);
      REQUIRE(rs.copy_start[y] >= (duplex && op.kind == OpKind::O ? o_end : all_end));
      all_end = std::max(all_end, rs.copy_end[y]);
      if (op.kind == OpKind::O) o_end = rs.copy_end[y];
      if (op.kind == OpKind::O) {
        REQUIRE(rs.copy_start[y] >= fend[u]);
        oend[u] = rs.copy_end[y];
      } else {
        REQUIRE(rs.copy_start[y] >= oend[u]);
        REQUIRE(rs.copy_end[y] <= bstart[u]);
      }
    }
  }
}

}  // namespace

TEST_CASE("PO-F at k <= 1 keeps every rank's simulated peak at a small constant as d*v grows from 8 to 128") {
  for (double k : {1.0, 0.5}) {
    for (int dv = 8; dv <= 128; dv *= 2)
      for (int d : {2, 4, 8, 16}) {
        const int v = dv / d;
        if (v < 1) continue;
        Costs c;
        c.k = k;
        const Program p = PO_F::build({d, v, 4 * d}, c);
        REQUIRE(validate(p));
        const double pf = max_peak(p);
        CHECK_MESSAGE(pf <= 6, "k=", k, " d=", d, " v=", v, ": PO-F peak ", pf);
        // Without offload the same order holds O(M) units, growing with d*v.
        CHECK(max_peak(PO::build({d, v, 4 * d})) >= v + d - 1);
      }
  }
}

TEST_CASE("PO's peak falls better than linearly as chunks are offloaded one by one (d=8, 16 stages per device)") {
  const Shape s{8, 16, 64};
  const double po0 = max_peak(PO::build(s));
  const double gish0 = max_peak(GIS_H::build(s));
  std::vector<double> po_curve;
  for (int n = 0; n <= 16; ++n) {
    const double pn = max_peak(build(with_offload(PO::spec, offload::first(n)), s));
    po_curve.push_back(pn);
    if (n > 0 && n < 16)
      CHECK_MESSAGE(pn < po0 * (16 - n) / 16.0, "n=", n, " peak ", pn, " linear ", po0 * (16 - n) / 16.0);
    if (n > 0) CHECK(pn < po_curve[static_cast<std::size_t>(n - 1)]);
  }
  // Half of the chunks offloaded: about a quarter of the peak left (the paper's Section 1),
  // against GIS-H, whose per-chunk contribution is flat, so its reduction is only linear.
  CHECK(po_curve[8] <= po0 / 3);
  Costs half_k;
  half_k.k = 0.5;
  const double gish8 = max_peak(build(with_offload(GIS_H::spec, offload::first(8)), s, half_k));
  CHECK(gish8 >= gish0 * 0.4);
  CHECK(po_curve[8] / po0 < gish8 / gish0);
}

TEST_CASE("offload works with v = 1 and with odd d (no partner, no stagger)") {
  for (int d : {1, 2, 3, 5, 7, 8})
    for (int m : {1, 3, 8, 16}) {
      const Program p = PO_F::build({d, 1, m});
      REQUIRE_MESSAGE(validate(p), validate(p).error);
      check_copy_timing(p);
      CHECK(max_peak(p) <= max_peak(PO::build({d, 1, m})));
      const Program q = build(ScheduleSpec{Family::one_f1b, {}, offload::all}, {d, 1, m});
      REQUIRE(validate(q));
      check_copy_timing(q);
    }
  // 1F1B with every unit that can hide its round trip offloaded: rank 0 at d=8, m=32 holds
  // far fewer than its d units.
  const Program q = build(ScheduleSpec{Family::one_f1b, {}, offload::all}, {8, 1, 32});
  CHECK(offloaded_units(q) > 0);
  CHECK(simulate(q).ranks[0].peak < 8);
}

namespace {

/// The parity of a rank's offload slots, after checking that its reload slots take the other
/// one (one-offload-one-reload).
long long offload_parity(const RankProgram& rp) {
  REQUIRE_FALSE(rp.copy.empty());
  const long long po = (rp.copy_slot[0] & 1) ^ (rp.copy[0].kind == OpKind::O ? 0 : 1);
  for (std::size_t y = 0; y < rp.copy.size(); ++y)
    CHECK((rp.copy_slot[y] & 1) == (rp.copy[y].kind == OpKind::O ? po : 1 - po));
  return po;
}

}  // namespace

TEST_CASE("paired ranks r and r^1 offload in opposite slot parities; every rank's offload and reload slots alternate") {
  // Which rank of a pair takes the even slots is chosen per pair (settle_pair), so only
  // the pairing is fixed: rank 4 of d = 5 has no partner.
  for (const Shape s : {Shape{5, 2, 10}, Shape{8, 2, 32}, Shape{16, 2, 32}, Shape{7, 4, 14}}) {
    const Program p = PO_F::build(s);
    std::vector<long long> po;
    for (const auto& rp : p.ranks) po.push_back(offload_parity(rp));
    for (int r = 0; r + 1 < s.d; r += 2)
      CHECK_MESSAGE(po[static_cast<std::size_t>(r)] != po[static_cast<std::size_t>(r + 1)], "d=", s.d, " r=", r);
  }
  // d = 8, v = 2, m = 32: the pair (4, 5) swaps (rank 4 on even slots would queue reloads
  // behind offloads and stay two passes behind), the others keep rank r on parity r & 1.
  const Program p = PO_F::build({8, 2, 32});
  for (int r = 0; r < 8; ++r)
    CHECK(offload_parity(p.ranks[static_cast<std::size_t>(r)]) == ((r & 1) ^ (r / 2 == 2 ? 1 : 0)));
  Costs c;
  c.stagger_pairs = false;
  const Program q = PO_F::build({4, 2, 8}, c);
  for (const auto& rp : q.ranks) offload_parity(rp);
}

TEST_CASE("with k <= 1, PO-F runs as fast as PO in the simulator, with a peak of 3 units") {
  // The copy stream of PO-F at k = 1 is as busy as compute, so any pause that edges replaying
  // the sparse PO grid put into it, or a reload queued behind a late offload, cost compute
  // time for good (it was +3.0% at d = 8, v = 2, m = 32).
  for (double k : {0.5, 1.0})
    for (int d : {2, 3, 4, 5, 8, 16})
      for (int v : {1, 2, 3, 4, 8})
        for (int m : {d, 3 * d + 1, 32}) {
          Costs c;
          c.k = k;
          const Program p = PO_F::build({d, v, m}, c);
          REQUIRE(validate(p));
          const SimResult sim = simulate(p);
          const double po = simulate(PO::build({d, v, m}, c)).makespan;
          CHECK_MESSAGE(sim.makespan <= po * (1 + 1e-12), "k=", k, " d=", d, " v=", v, " m=", m, ": PO-F ",
                        sim.makespan, " PO ", po);
          CHECK_MESSAGE(sim.max_peak() <= (k < 1 ? 2 : 3), "k=", k, " d=", d, " v=", v, " m=", m, ": peak ",
                        sim.max_peak());
        }
}

TEST_CASE("PO-F's edges keep its plan's peak of 3 units whatever the speeds of passes and copies") {
  // The edges let an F or an R skip a release only as far as the plan's peak has room, so no
  // timing exceeds that peak (3 units for these plans, built at k = 1 with unit costs).
  for (const Shape s : {Shape{4, 2, 16}, Shape{8, 2, 32}, Shape{5, 4, 10}, Shape{3, 3, 7}}) {
    const Program p = PO_F::build(s);
    for (double k : {0.1, 2.0, 10.0})
      for (double b : {0.2, 3.0})
        for (double w : {0.1, 4.0})
          for (double f : {0.3, 2.5}) {
            Costs c = p.costs;
            c.k = k;
            c.f = f;
            c.b = b;
            c.w = w;
            CHECK_MESSAGE(simulate(p, c).max_peak() <= 3, "d=", s.d, " v=", s.v, " k=", k, " f=", f, " b=", b,
                          " w=", w);
          }
  }
}

TEST_CASE("a unit whose forward-to-backward gap cannot hide the round trip stays on the device") {
  const Program p = PO_F::build({4, 2, 8});
  // The last stage runs its B right after its F: never worth a round trip.
  for (const Op& op : p.ranks[3].copy) CHECK(op.stage != 7);
  CHECK(offloaded_units(p) > 0);
  Costs slow;
  slow.k = 1000;
  CHECK(offloaded_units(PO_F::build({4, 2, 8}, slow)) == 0);
}

TEST_CASE("longest-lifespan chunks are offloaded first when the copy stream is short of slots") {
  Costs c;
  c.k = 2.5;  // the copy stream cannot carry everything
  const Program p = PO_F::build({4, 4, 16}, c);
  std::vector<int> per_chunk(4, 0);
  for (const Op& op : p.ranks[0].copy)
    if (op.kind == OpKind::O) ++per_chunk[static_cast<std::size_t>(p.shape.chunk_of(op.stage))];
  CHECK(per_chunk[0] == 16);
  CHECK(per_chunk[0] >= per_chunk[1]);
  CHECK(per_chunk[1] >= per_chunk[3]);
}

TEST_CASE("offload composes with every family, and every copy respects its F, O and B in simulated time") {
  for (int d : {1, 2, 3, 4, 6, 8})
    for (int v : {1, 2, 3, 4})
      for (int m : {d, 2 * d, 3 * d + 1}) {
        std::vector<ScheduleSpec> specs = {with_offload(GIS::spec, offload::first(1)),
                                           with_offload(GIS_H::spec, offload::half), PO_H::spec, PO_F::spec,
                                           with_offload(PO::spec, offload::chunks({v - 1}))};
        if (m % d == 0) specs.push_back(with_offload(Interleaved1F1B::spec, offload::all));
        if (v == 1) specs.push_back(with_offload(OneF1B::spec, offload::all));
        for (const auto& spec : specs)
          for (double k : {0.5, 1.0, 2.0}) {
            Costs c;
            c.k = k;
            c.comm = 0.25;
            const Program p = build(spec, {d, v, m}, c);
            const Validation ok = validate(p);
            REQUIRE_MESSAGE(ok, schedule_name(spec, v), " d=", d, " v=", v, " m=", m, " k=", k, ": ", ok.error);
            check_copy_timing(p);
            Program plain = p;
            plain.spec.offload = offload::none;
            CHECK(max_peak(p) <= max_peak(build(plain.spec, {d, v, m}, c)));
          }
      }
}

TEST_CASE("per-stage unit sizes: peaks are in bytes, and offload counts each stage's own size") {
  Costs c;
  for (int s = 0; s < 8; ++s) c.unit_bytes.push_back(s == 0 ? 1000.0 : 10.0);
  for (const Program& p : {GIS::build({4, 2, 8}, c), PO_H::build({4, 2, 8}, c)}) {
    const SimResult sim = simulate(p);
    for (int r = 0; r < 4; ++r) {
      // Oracle: at every acquisition time, add up the bytes of the units alive there.
      const auto& rp = p.ranks[static_cast<std::size_t>(r)];
      const auto& rs = sim.ranks[static_cast<std::size_t>(r)];
      std::vector<std::pair<double, double>> alive;  // [from, to) of each on-device interval
      std::vector<double> sizes;
      for (std::size_t x = 0; x < rp.compute.size(); ++x) {
        const Op& f = rp.compute[x];
        if (f.kind != OpKind::F) continue;
        double from = rs.compute_start[x], to = 0, oend = -1, rstart = -1;
        for (std::size_t y = 0; y < rp.compute.size(); ++y)
          if (rp.compute[y].kind == OpKind::W && rp.compute[y].stage == f.stage && rp.compute[y].mb == f.mb)
            to = rs.compute_end[y];
        for (std::size_t y = 0; y < rp.copy.size(); ++y)
          if (rp.copy[y].stage == f.stage && rp.copy[y].mb == f.mb)
            (rp.copy[y].kind == OpKind::O ? oend : rstart) =
                rp.copy[y].kind == OpKind::O ? rs.copy_end[y] : rs.copy_start[y];
        if (oend >= 0) {
          alive.push_back({from, oend});
          alive.push_back({rstart, to});
          sizes.push_back(c.bytes(f.stage));
        } else {
          alive.push_back({from, to});
        }
        sizes.push_back(c.bytes(f.stage));
      }
      double oracle = 0;
      for (const auto& [t, unused] : alive) {
        double sum = 0;
        for (std::size_t i = 0; i < alive.size(); ++i)
          if (alive[i].first <= t && t < alive[i].second) sum += sizes[i];
        oracle = std::max(oracle, sum);
      }
      CHECK(rs.peak == oracle);
      CHECK(rs.memory.back().alive == 0);
    }
  }
  // Rank 0 of GIS holds all 8 units of its heavy stage 0 at once in the steady state.
  CHECK(simulate(GIS::build({4, 2, 8}, c)).ranks[0].peak >= 8 * 1000.0);
}

TEST_CASE("offload placement copes with extreme costs: huge T_comm, a T_O too small for a slot grid") {
  Costs far;
  far.comm = 1e6;  // planning times dwarf the slot length
  const Program p = build(with_offload(GIS::spec, offload::first(1)), {4, 2, 8}, far);
  CHECK(validate(p));
  far.comm = 1e9;  // a slot grid over this timeline would need 2e10 slots: refused, not a crash
  CHECK_THROWS_AS(build(with_offload(GIS::spec, offload::first(1)), {4, 2, 8}, far), shape_error);
  Costs tiny;
  tiny.k = 1e-9;
  CHECK_THROWS_WITH_AS(PO_F::build({4, 2, 8}, tiny),
                       "costs: T_O = k(T_F+T_B+T_W)/2 is too small for this schedule: its copy-slot grid would need "
                       "48000000000 slots, at most 67108864 are allowed; raise k (or T_O) at least 716-fold",
                       shape_error);
}

TEST_CASE("a chunk none of whose units can be offloaded does not stretch the rank's copy slots") {
  // Stage 7 (rank 3, chunk 1) is ten times heavier, so its T_O is long, but as the last stage
  // its B follows its F at once: it never offloads, and rank 3's slots stay chunk 0's length.
  Costs c;
  c.stage_f.assign(8, 1.0);
  c.stage_f[7] = 10;
  const Program p = PO_F::build({4, 2, 8}, c);
  REQUIRE(validate(p));
  CHECK(p.ranks[3].slot_length == c.T_O(3));
  for (const Op& op : p.ranks[3].copy) CHECK(op.stage == 3);
  CHECK_FALSE(p.ranks[3].copy.empty());
}

TEST_CASE("two copy streams: every family validates, and each copy keeps its order in simulated time") {
  for (int d : {1, 2, 3, 4})
    for (int v : {1, 2, 4})
      for (int m : {d, 3 * d + 1})
        for (bool stagger : {true, false}) {
          std::vector<ScheduleSpec> specs = {with_offload(GIS_H::spec, offload::half), PO_H::spec, PO_F::spec,
                                             with_offload(PO::spec, offload::chunks({v - 1}))};
          if (m % d == 0) specs.push_back(with_offload(Interleaved1F1B::spec, offload::all));
          for (const auto& spec : specs)
            for (double k : {0.5, 2.0}) {
              Costs c;
              c.k = k;
              c.comm = 0.25;
              c.copy_streams = 2;
              c.duplex_slowdown = 1.31;
              c.stagger_pairs = stagger;
              const Program p = build(spec, {d, v, m}, c);
              const Validation ok = validate(p);
              REQUIRE_MESSAGE(ok, schedule_name(spec, v), " d=", d, " v=", v, " m=", m, " k=", k, ": ", ok.error);
              check_copy_timing(p);
              // A rank with a PCIe partner keeps one stream's slots: one copy a slot, offloads
              // on one parity and reloads on the other.
              for (int r = 0; r < d; ++r) {
                const RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
                if (!stagger || (r ^ 1) >= d) continue;
                for (std::size_t y = 1; y < rp.copy.size(); ++y) REQUIRE(rp.copy_slot[y] > rp.copy_slot[y - 1]);
                if (!rp.copy.empty()) offload_parity(rp);
              }
            }
        }
}

TEST_CASE("two copy streams: a rank without a PCIe partner offloads and reloads in one slot") {
  Costs c;
  c.k = 2;
  c.copy_streams = 2;
  const Program p = PO_F::build({1, 4, 8}, c);
  const RankProgram& rp = p.ranks[0];
  int shared = 0;
  for (std::size_t y = 1; y < rp.copy.size(); ++y)
    if (rp.copy_slot[y] == rp.copy_slot[y - 1]) {
      ++shared;
      CHECK(rp.copy[y - 1].kind == OpKind::R);  // the slot's reload, then its offload
      CHECK(rp.copy[y].kind == OpKind::O);
    }
  CHECK(shared > 0);
  // Slots are what validate() checks: an offload before a reload in one slot, or two of a
  // kind, double-book a stream.
  Program bad = p;
  for (std::size_t y = 1; y < bad.ranks[0].copy.size(); ++y)
    if (bad.ranks[0].copy_slot[y] == bad.ranks[0].copy_slot[y - 1]) {
      std::swap(bad.ranks[0].copy[y], bad.ranks[0].copy[y - 1]);
      break;
    }
  CHECK(!validate(bad));
  Costs one = c;
  one.copy_streams = 1;
  Program single = p;
  single.costs = one;
  CHECK(!validate(single));
}

namespace {
/// The passes of a GPT block at h = s = 4096 on an H100 (ms), k and `streams` copy streams
/// (55 GB/s one way, 41.9 each way both at once), ranks without PCIe partners.
Costs h100_block(double k, int streams) {
  Costs c;
  c.f = 3.09;
  c.b = 3.66;
  c.w = 2.81;
  c.k = k;
  c.stagger_pairs = false;
  c.copy_streams = streams;
  c.duplex_slowdown = 55.0 / 41.9;
  return c;
}
}  // namespace

TEST_CASE("one or two copy streams, whichever the times say (an H100's copies: 55 GB/s one way, 41.9 each both ways)") {
  // PO-F, d = 4, v = 2, m = 16, ranks without PCIe partners, the passes of a GPT block at
  // h = s = 4096 (ms). With recompute (k = 1.279) one stream carries the copies and two only
  // slow each copy down; without (k = 2.224) one stream falls behind and two catch up.
  const auto run = [](double k, int streams) {
    const Program p = PO_F::build({4, 2, 16}, h100_block(k, streams));
    REQUIRE(validate(p));
    return simulate(p);
  };
  const SimResult one = run(1.279, 1), two = run(1.279, 2);
  CHECK(one.makespan < two.makespan);
  const SimResult one_slow = run(2.224, 1), two_slow = run(2.224, 2);
  CHECK(two_slow.makespan < 0.97 * one_slow.makespan);
  CHECK(two_slow.max_peak() < one_slow.max_peak());
}

TEST_CASE("copy streams and the duplex slowdown are checked") {
  Costs c;
  c.copy_streams = 3;
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c), "costs: copy_streams = 3 is outside the allowed range [1, 2]");
  c.copy_streams = 2;
  c.duplex_slowdown = 0.5;
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c),
                    "costs: duplex_slowdown must be a finite number >= 1 (a copy is no faster while the other "
                    "direction copies too)");
  // T_O of a duplex copy includes the slowdown.
  c.duplex_slowdown = 1.5;
  c.k = 1;
  CHECK(c.T_O(0) == 1.5 * 1.5);
}

TEST_CASE("reloads in parts: a B starts once its first part is back, and copy-bound schedules run faster") {
  // The H100's times at h = s = 4096 (ms), as above, with each unit reloaded whole or in 4
  // equal parts (Costs::reload_shares: a chunk of 4 blocks).
  const auto run = [](double k, int streams, int parts) {
    Costs c = h100_block(k, streams);
    if (parts > 1) c.reload_shares.assign(8, std::vector<double>(static_cast<std::size_t>(parts), 1.0 / parts));
    const Program p = PO_F::build({4, 2, 16}, c);
    REQUIRE(validate(p));
    return std::pair{p, simulate(p)};
  };
  for (double k : {1.279, 2.224})
    for (int streams : {1, 2}) {
      CAPTURE(k);
      CAPTURE(streams);
      const auto [p1, one] = run(k, streams, 1);
      const auto [p4, four] = run(k, streams, 4);
      // Every B on its own reload starts no earlier than reload_overlap before the
      // reload ends, and some start exactly then (the reload is what they wait for).
      int limited = 0;
      for (std::size_t r = 0; r < p4.ranks.size(); ++r) {
        const RankProgram& rp = p4.ranks[r];
        const RankSim& t = four.ranks[r];
        for (std::size_t x = 0; x < rp.compute.size(); ++x) {
          const Op& op = rp.compute[x];
          if (op.kind != OpKind::B || op.wait < 0) continue;
          const Op& c = rp.copy[static_cast<std::size_t>(op.wait)];
          if (c.kind != OpKind::R || c.stage != op.stage || c.mb != op.mb) continue;
          const double earliest = t.copy_end[static_cast<std::size_t>(op.wait)] - p4.costs.reload_overlap(op.stage);
          CHECK(t.compute_start[x] >= earliest - 1e-9);
          limited += std::abs(t.compute_start[x] - earliest) < 1e-9;
        }
      }
      if (k == 1.279 && streams == 1) {
        CHECK(four.makespan == doctest::Approx(one.makespan));  // the copies keep up: nothing to gain
      } else {
        CHECK(limited > 0);
        CHECK(four.makespan < 0.995 * one.makespan);
      }
      CHECK(four.max_peak() == one.max_peak());
    }
  // 2.224, one stream: 356.49 -> 353.75; 1.279, two streams: 343.85 -> 338.68 (the figures
  // docs/design.md section 3 quotes).
  CHECK(run(2.224, 1, 4).second.makespan == doctest::Approx(353.748).epsilon(1e-5));
  CHECK(run(1.279, 2, 4).second.makespan == doctest::Approx(338.675).epsilon(1e-5));
}

TEST_CASE("reload shares are checked, and reload_overlap follows the parts' sizes") {
  Costs c;
  c.reload_shares = {{0.5, 0.5}, {}, {1}};
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c),
                    "costs: per-stage reload shares has 3 entries; it must have S = v*d = 4 (or none)");
  c.reload_shares = {{0.5, 0.5}, {0.5, 0}, {}, {}};
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c), "costs: stage 1's reload shares must be finite numbers > 0");
  c.reload_shares = {{0.5, 0.25}, {}, {}, {}};
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c),
                    "costs: stage 0's reload shares add up to 750000 millionths; they must add up to 1 (each part's "
                    "share of the unit's bytes)");
  c.reload_shares = {{}, std::vector<double>(1025, 1.0 / 1025), {}, {}};
  CHECK_THROWS_WITH(PO_F::build({2, 2, 4}, c), "costs: stage 1 reloads in 1025 parts; at most 1024 are allowed");
  // T_O = 1.5, T_B = 1 (k = 1): equal halves min(1.5, 1)(1 - 1/2) = 0.5; a first part of half
  // the unit and two quarters: min(0.5 * 1.5, 0.25 * 1.5 + 0.5, 0.75) = 0.75; a large first
  // part (an LM head) leaves little: min(0.2 * 1.5, 0.8) = 0.3.
  c.reload_shares = {{}, {0.5, 0.5}, {0.5, 0.25, 0.25}, {0.8, 0.2}};
  c.k = 1;
  CHECK(c.reload_overlap(0) == 0);
  CHECK(c.reload_overlap(1) == doctest::Approx(0.5));
  CHECK(c.reload_overlap(2) == doctest::Approx(0.75));
  CHECK(c.reload_overlap(3) == doctest::Approx(0.3));
  // The sample models' shares: the head's, then the blocks' from the last down.
  CHECK(stacked_reload_shares(2, 10, 20) == std::vector<double>{0.5, 0.25, 0.25});
  CHECK(stacked_reload_shares(1, 10, 0).empty());
  CHECK(stacked_reload_shares(0, 10, 5).empty());
}
