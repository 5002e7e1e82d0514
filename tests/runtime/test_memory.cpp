// tests/runtime: measured activation memory against the simulator's peaks.
//
// Layers sleep a fixed time per pass and the copy engine is paced so a unit's one-way copy
// takes T_O = k (T_F + T_B + T_W) / 2 with k = 1, so the run follows the simulated timeline.
// What is compared: the device arena's peak of Memory::activation (the saved units, alive
// from F to W except between an offload's end and its reload's start) against simulate()'s
// peak with each stage's own unit bytes; the arena's peak of Memory::stash (B to W, or a
// BW while it runs) against simulate()'s stash_peak, exactly, for every family. Messages
// (Memory::message: boundary tensors received or waiting to be sent) are bounded apart.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tanh_layer.hpp"

namespace {

struct Measured {
  std::vector<double> measured, simulated, unit;  // per rank: activation peak bytes; largest unit
  std::vector<std::size_t> stash_peak;
  test::Run run;
};

Measured measure(po::ScheduleSpec spec, po::Shape shape) {
  test::Config c;
  c.spec = spec;
  c.shape = shape;
  c.steps = 2;
  c.h = 16;
  const double t = 0.002;
  c.timing = {t, t, t};
  c.costs.f = c.costs.b = c.costs.w = t;
  c.costs.k = 1;
  // Unit sizes per stage, as the layer reports them; pace copies for the largest.
  std::vector<double> bytes;
  double largest = 0;
  for (int s = 0; s < shape.stages(); ++s) {
    const test::TanhLayer l(s, c.h, 1);
    bytes.push_back(static_cast<double>(l.saved_bytes(c.mb)));
    largest = std::max(largest, bytes.back());
  }
  c.copy_bytes_per_second = largest / c.costs.T_O(0);
  Measured m;
  m.run = test::train_within(c, 240);
  for (const std::string& e : m.run.errors) REQUIRE(e == "");
  po::Costs sc = c.costs;
  sc.unit_bytes = bytes;
  const po::SimResult sim = po::simulate(m.run.program, sc);
  for (int r = 0; r < shape.d; ++r) {
    m.measured.push_back(
        static_cast<double>(m.run.memory[static_cast<std::size_t>(r)].peak_of(po::backend::Memory::activation)));
    m.simulated.push_back(sim.ranks[static_cast<std::size_t>(r)].peak);
    m.stash_peak.push_back(m.run.memory[static_cast<std::size_t>(r)].peak_of(po::backend::Memory::stash));
    double u = 0;
    for (int ch = 0; ch < shape.v; ++ch) u = std::max(u, bytes[static_cast<std::size_t>(shape.stage_of(r, ch))]);
    m.unit.push_back(u);
  }
  return m;
}

po::ScheduleSpec po_f() { return {po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all}; }

}  // namespace

TEST_CASE("memory: each rank's measured activation peak is within [90%, 100%] of the simulated peak") {
  using GK = po::GroupSpec::Kind;
  const std::vector<std::pair<const char*, po::ScheduleSpec>> specs = {
      {"1f1b-i", {po::Family::interleaved_1f1b, {}, po::offload::none}},
      {"gis-h", {po::Family::grouped, {GK::half, 0}, po::offload::none}},
      {"po", {po::Family::grouped, {GK::uniform, 1}, po::offload::none}},
      {"po-h", {po::Family::grouped, {GK::uniform, 1}, po::offload::half}},
      {"po-f", po_f()},
  };
  for (const auto& [name, spec] : specs) {
    CAPTURE(name);
    const Measured m = measure(spec, {4, 2, 8});
    for (std::size_t r = 0; r < m.measured.size(); ++r) {
      CAPTURE(r);
      CAPTURE(m.measured[r]);
      CAPTURE(m.simulated[r]);
      if (r == 0) MESSAGE(std::string(name), " rank 0: measured ", m.measured[r], " bytes, simulated ", m.simulated[r]);
      CHECK(m.measured[r] <= m.simulated[r]);
      CHECK(m.measured[r] >= 0.9 * m.simulated[r]);
      // Stash: B-to-W buffers; with split backward a W follows its B closely.
      CHECK(m.stash_peak[r] > 0);
    }
  }
}

TEST_CASE(
    "memory: each rank's measured stash peak equals the simulated one, every family (B to W, a BW while it runs)") {
  // On the compute stream a stash lives from its B's start to its W's end in program order, so
  // its peak does not depend on timing: the simulator's stash_peak must be the runtime's.
  for (const char* name : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v",
                           "v-half", "v-min", "dualpipe-v"}) {
    CAPTURE(name);
    const std::string n = name;
    const int v = n == "1f1b" || n.rfind("zb-h", 0) == 0 ? 1 : 2;
    test::Config c;
    c.spec = po::parse_schedule(n, n == "gis-g" ? 2 : 0);
    c.shape = {4, v, 8};
    c.steps = 1;
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    po::Costs sc = c.costs;
    for (int s = 0; s < c.shape.stages(); ++s) {
      const test::TanhLayer l(s, c.h, 1);
      sc.unit_bytes.push_back(static_cast<double>(l.saved_bytes(c.mb)));
      sc.stash_bytes.push_back(static_cast<double>(l.stash_bytes(c.mb)) * (1 + s % 3));  // uneven: who holds what
    }
    po::Costs even = sc, none = sc;  // the runtime's stashes (the layer's: equal for every stage); no stashes
    for (int s = 0; s < c.shape.stages(); ++s)
      even.stash_bytes[static_cast<std::size_t>(s)] = static_cast<double>(test::TanhLayer(s, c.h, 1).stash_bytes(c.mb));
    none.stash_bytes.clear();
    const po::SimResult uneven = po::simulate(run.program, sc), sim = po::simulate(run.program, even),
                        without = po::simulate(run.program, none);
    for (int r = 0; r < c.shape.d; ++r) {
      CAPTURE(r);
      const auto ru = static_cast<std::size_t>(r);
      CHECK(static_cast<double>(run.memory[ru].peak_of(po::backend::Memory::stash)) == sim.ranks[ru].stash_peak);
      CHECK(sim.ranks[ru].stash_peak > 0);
      // The memory timeline holds the stashes beside the units.
      CHECK(uneven.ranks[ru].peak > without.ranks[ru].peak);
      CHECK(uneven.ranks[ru].peak <= without.ranks[ru].peak + uneven.ranks[ru].stash_peak);
    }
  }
}

TEST_CASE("memory: PO-F's measured peak stays flat as d*v grows") {
  std::vector<double> units;
  for (po::Shape sh : {po::Shape{2, 2, 8}, po::Shape{4, 2, 8}, po::Shape{4, 4, 8}, po::Shape{8, 2, 16}}) {
    CAPTURE(sh.d);
    CAPTURE(sh.v);
    const Measured m = measure(po_f(), sh);
    units.push_back(m.measured[0] / m.unit[0]);
    CHECK(m.measured[0] <= m.simulated[0]);
  }
  CAPTURE(units[0]);
  CAPTURE(units[1]);
  CAPTURE(units[2]);
  CAPTURE(units[3]);
  MESSAGE("PO-F rank-0 peak in units of its largest stage, (d,v) = (2,2) (4,2) (4,4) (8,2): ", units[0], " ", units[1],
          " ", units[2], " ", units[3]);
  for (double u : units) CHECK(u <= 5.0);  // a small constant (docs/design.md: ~4 units), against d*v up to 16
}

TEST_CASE("memory: after construction no step takes device or pinned host memory from the system") {
  // po::Runtime reserves, per buffer size, the most blocks its program can hold under any
  // timing; so with fast passes, with sleeping passes and a paced copy engine, and whatever
  // the OS does to the threads, the arena's allocation counts never move during steps.
  using GK = po::GroupSpec::Kind;
  const std::vector<std::pair<const char*, po::ScheduleSpec>> specs = {
      {"1f1b", {po::Family::one_f1b, {}, po::offload::none}},
      {"1f1b-i + offload all", {po::Family::interleaved_1f1b, {}, po::offload::all}},
      {"gis-h", {po::Family::grouped, {GK::half, 0}, po::offload::none}},
      {"po-h", {po::Family::grouped, {GK::uniform, 1}, po::offload::half}},
      {"po-f", po_f()},
  };
  for (const auto& [name, spec] : specs)
    for (int paced = 0; paced < 2; ++paced) {
      CAPTURE(name);
      CAPTURE(paced);
      test::Config c;
      c.spec = spec;
      c.shape = {spec.family == po::Family::one_f1b ? 3 : 4, spec.family == po::Family::one_f1b ? 1 : 2, 8};
      c.steps = 4;
      if (paced) {
        const double t = 0.0005;
        c.timing = {t, t, t};
        c.costs.f = c.costs.b = c.costs.w = t;
        c.copy_bytes_per_second = 2e6;  // slower than k = 1: copies lag compute
      }
      const test::Run run = test::train_within(c, 120);
      for (const std::string& e : run.errors) REQUIRE(e == "");
      for (int r = 0; r < c.shape.d; ++r) {
        CAPTURE(r);
        const auto& dev = run.device_allocations[static_cast<std::size_t>(r)];
        const auto& host = run.host_allocations[static_cast<std::size_t>(r)];
        REQUIRE(dev.size() == static_cast<std::size_t>(c.steps) + 1);
        CHECK(dev.front() > 0);  // reserved at construction
        for (std::size_t s = 1; s < dev.size(); ++s) {
          CAPTURE(s);
          CHECK(dev[s] == dev.front());
          CHECK(host[s] == host.front());
        }
      }
    }
}

namespace {

/// Runs every rank of `p` lowered (lower(p, r, bytes)) in random interleavings: an op starts
/// once its stream's previous op has ended and every op it waits for has ended, a send and its
/// receive start together, running ops end in random order. Buffers are taken at the plan's
/// offsets and given back as the runtime does (lifetimes re-derived here, not read from
/// lower.hpp): F takes its unit and output, gives its input (and, in evaluation, its unit) back
/// at its end; B/BW takes a stash and its dx, gives dy back; W/BW gives the stash and unit back;
/// O gives the unit back (and takes host bins), R takes it; a recv takes its tensor, a send
/// gives it back. With two copy streams (Costs::copy_streams) the offloads and the reloads run
/// on streams of their own, and a wait for copy op k is for every copy up to k. With `parts`
/// a B or BW whose copy wait is its own reload (Runtime::split_reload) starts once that reload
/// has started and ends only after it ended, as a reload copied in parts lets it. Checks that
/// every run finishes (no deadlock), that no two live buffers of a rank overlap in its region,
/// that each lies inside it, and that the host bins suffice.
struct Executor {
  const po::Program& p;
  const std::vector<po::StageBytes>& bytes;
  std::vector<po::LoweredRank> lowered;
  bool training = true;
  bool parts = false;

  // Returns "" or what went wrong.
  std::string run(std::uint64_t seed) {
    const po::Shape& sh = p.shape;
    const int S = sh.stages();
    const std::size_t d = static_cast<std::size_t>(sh.d);
    std::uint64_t s = seed;
    const auto next = [&](std::size_t n) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<std::size_t>((s >> 33) % n);
    };
    std::vector<std::array<std::vector<char>, 3>> ended(d);
    // Streams: compute, copy (with two copy streams: the offloads), comm, the reloads (two
    // copy streams only); a copy stream's cursor runs over the copy list.
    const bool duplex = p.costs.duplex();
    const auto list_of = [](int q) { return q == 3 ? 1 : q; };
    std::vector<std::array<std::size_t, 4>> issued(d, {0, 0, 0, 0});
    std::vector<std::array<bool, 4>> busy(d, {false, false, false, false});
    for (std::size_t r = 0; r < d; ++r) {
      ended[r][0].assign(p.ranks[r].compute.size(), 0);
      ended[r][1].assign(p.ranks[r].copy.size(), 0);
      ended[r][2].assign(p.ranks[r].comm.size(), 0);
    }
    // Per rank: live buffers by offset (end, name); where each named buffer is; host bins in use.
    std::vector<std::map<std::size_t, std::pair<std::size_t, std::string>>> live(d);
    std::vector<std::map<std::string, std::size_t>> where(d);
    std::vector<std::map<std::size_t, long long>> bins(d);
    struct Running {
      std::size_t r;
      int stream, index;
    };
    // With parts: each compute op's own reload, copied in parts (-1: none), as the runtime
    // finds it.
    std::vector<std::vector<int>> split(d);
    for (std::size_t r = 0; r < d && parts; ++r) {
      const auto& rp = p.ranks[r];
      split[r].assign(rp.compute.size(), -1);
      for (std::size_t x = 0; x < rp.compute.size(); ++x) {
        const po::Op& op = rp.compute[x];
        const int y = lowered[r].compute[x].on(po::Stream::copy);
        if ((op.kind == po::OpKind::B || op.kind == po::OpKind::BW) && y >= 0) {
          const po::Op& c = rp.copy[static_cast<std::size_t>(y)];
          if (c.kind == po::OpKind::R && c.stage == op.stage && c.mb == op.mb) split[r][x] = y;
        }
      }
    }
    const auto split_of = [&](std::size_t r, int stream, std::size_t i) {
      return parts && stream == 0 ? split[r][i] : -1;
    };
    std::vector<Running> running;
    std::string err;
    const auto fail = [&](const std::string& why) {
      if (err.empty()) err = why;
    };
    const auto take = [&](std::size_t r, const std::string& name, std::size_t at, std::size_t n) {
      n = po::buffer_bytes(n);
      const std::string who = "rank " + std::to_string(r) + " " + name;
      if (at == po::no_buffer || at + n > lowered[r].region) return fail(who + " has no place in the region");
      auto it = live[r].upper_bound(at);
      if (it != live[r].end() && it->first < at + n) return fail(who + " overlaps " + it->second.second);
      if (it != live[r].begin() && std::prev(it)->second.first > at)
        return fail(who + " overlaps " + std::prev(it)->second.second);
      live[r][at] = {at + n, name};
      where[r][name] = at;
    };
    const auto give = [&](std::size_t r, const std::string& name) {
      auto w = where[r].find(name);
      if (w == where[r].end()) return fail("rank " + std::to_string(r) + " gives back " + name + ", never taken");
      live[r].erase(w->second);
      where[r].erase(w);
    };
    const auto planned = [&](std::size_t r, std::size_t b) {
      for (const po::BlockCount& c : lowered[r].host)
        if (c.bytes == b) return c.count;
      return std::size_t{0};
    };
    const auto host = [&](std::size_t r, std::size_t b, long long n) {
      long long& x = bins[r][b];
      x += n;
      if (n > 0 && static_cast<std::size_t>(x) > planned(r, b))
        fail("rank " + std::to_string(r) + " holds " + std::to_string(x) + " host bins of " + std::to_string(b) +
             " bytes; its plan has " + std::to_string(planned(r, b)));
    };
    const auto tag = [](const char* what, int stage, int mb) {
      return std::string(what) + "(" + std::to_string(stage) + "," + std::to_string(mb) + ")";
    };
    const auto box_name = [&](int stage, int mb, po::Dir dir) {
      return tag(dir == po::Dir::forward ? "x" : "dy", stage, mb);
    };
    const auto box = [&](int stage, po::Dir dir) {
      return dir == po::Dir::forward ? bytes[static_cast<std::size_t>(stage)].input
                                     : bytes[static_cast<std::size_t>(stage)].output;
    };
    const auto effect = [&](std::size_t r, int stream, int i, bool start) {
      const po::LoweredRank& lr = lowered[r];
      const std::size_t ui = static_cast<std::size_t>(i);
      if (stream == 2) {
        const po::CommOp& c = p.ranks[r].comm[ui];
        if (!c.send && start) take(r, box_name(c.stage, c.mb, c.dir), lr.comm_at[ui], box(c.stage, c.dir));
        if (c.send && !start) give(r, box_name(c.stage, c.mb, c.dir));
        return;
      }
      const po::Op& op = stream == 0 ? p.ranks[r].compute[ui] : p.ranks[r].copy[ui];
      const po::StageBytes& b = bytes[static_cast<std::size_t>(op.stage)];
      const int sg = op.stage, mb = op.mb;
      switch (op.kind) {
        case po::OpKind::F:
          if (start) {
            take(r, tag("unit", sg, mb), lr.compute_at[ui][0], b.saved);
            if (sg < S - 1) take(r, box_name(sg + 1, mb, po::Dir::forward), lr.compute_at[ui][1], b.output);
          } else {
            if (sg > 0) give(r, box_name(sg, mb, po::Dir::forward));
            if (!training) give(r, tag("unit", sg, mb));
          }
          break;
        case po::OpKind::B:
        case po::OpKind::BW:
          if (start) {
            take(r, tag("stash", sg, mb), lr.compute_at[ui][0], b.stash);
            if (sg > 0) take(r, box_name(sg - 1, mb, po::Dir::backward), lr.compute_at[ui][1], b.input);
          } else {
            if (sg < S - 1) give(r, box_name(sg, mb, po::Dir::backward));
            if (op.kind == po::OpKind::BW) {
              give(r, tag("stash", sg, mb));
              give(r, tag("unit", sg, mb));
            }
          }
          break;
        case po::OpKind::W:
          if (!start) {
            give(r, tag("stash", sg, mb));
            give(r, tag("unit", sg, mb));
          }
          break;
        case po::OpKind::O:
        case po::OpKind::R: {
          const po::offload::BinPlan plan = po::offload::plan_bins(b.saved);
          const bool o = op.kind == po::OpKind::O;
          if (o == start)
            for (int j = 0; j < plan.count; ++j)
              host(r, static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(j)]), o ? 1 : -1);
          if (o && !start) give(r, tag("unit", sg, mb));
          if (!o && start) take(r, tag("unit", sg, mb), lr.copy_at[ui], b.saved);
          break;
        }
      }
    };
    const auto waits_of = [&](std::size_t r, int stream, std::size_t i) -> const po::Waits& {
      const po::LoweredRank& lr = lowered[r];
      return stream == 0 ? lr.compute[i] : stream == 2 ? lr.comm[i] : lr.copy[i];
    };
    // The copy streams' cursors skip the other stream's copies.
    const auto skip = [&](std::size_t r, int q) {
      if (!duplex || (q != 1 && q != 3)) return;
      std::size_t& i = issued[r][static_cast<std::size_t>(q)];
      const auto& copy = p.ranks[r].copy;
      while (i < copy.size() && (copy[i].kind == po::OpKind::R) != (q == 3)) ++i;
    };
    const auto can_start = [&](std::size_t r, int stream) {
      if (stream == 3 && !duplex) return false;
      skip(r, stream);
      const std::size_t i = issued[r][static_cast<std::size_t>(stream)];
      const std::size_t list = static_cast<std::size_t>(list_of(stream));
      if (busy[r][static_cast<std::size_t>(stream)] || i >= ended[r][list].size()) return false;
      const po::Waits& w = waits_of(r, stream, i);
      const int own = split_of(r, stream, i);
      if (own >= 0 && issued[r][duplex ? 3 : 1] <= static_cast<std::size_t>(own)) return false;  // not started
      for (std::size_t k = 0; k < 3; ++k) {
        if (w.last[k] < 0 || (own >= 0 && k == 1)) continue;
        // A wait for copy op j: every copy up to j (one stream: j ends after all before it).
        const std::size_t j = static_cast<std::size_t>(w.last[k]);
        for (std::size_t e = k == 1 ? 0 : j; e <= j; ++e)
          if (ended[r][k][e] == 0) return false;
      }
      return true;
    };
    for (;;) {
      // Candidates: ops that may start (a send with its receive), and running ops that may end.
      std::vector<std::pair<int, std::size_t>> moves;  // (0: start rank r stream q) encoded
      std::vector<std::array<std::size_t, 4>> starts;  // r, stream, peer r, peer stream index (comm)
      for (std::size_t r = 0; r < d; ++r)
        for (int q = 0; q < 4; ++q) {
          if (!can_start(r, q)) continue;
          if (q != 2) {
            starts.push_back({r, static_cast<std::size_t>(q), d, 0});
            continue;
          }
          const po::CommOp& c = p.ranks[r].comm[issued[r][2]];
          if (!c.send) continue;  // started with its send
          const std::size_t pr = static_cast<std::size_t>(c.peer);
          if (!can_start(pr, 2)) continue;
          const po::CommOp& m = p.ranks[pr].comm[issued[pr][2]];
          if (m.send || m.stage != c.stage || m.mb != c.mb || m.dir != c.dir) continue;
          starts.push_back({r, 2, pr, 0});
        }
      if (starts.empty() && running.empty()) break;
      if (!starts.empty() && (running.empty() || next(2) == 0)) {
        const auto st = starts[next(starts.size())];
        for (std::size_t side = 0; side < (st[2] < d ? 2u : 1u); ++side) {
          const std::size_t r = side == 0 ? st[0] : st[2];
          const int q = static_cast<int>(st[1]);
          const int i = static_cast<int>(issued[r][static_cast<std::size_t>(q)]++);
          busy[r][static_cast<std::size_t>(q)] = true;
          effect(r, q, i, true);
          running.push_back({r, q, i});
        }
      } else {
        // A B started on the first part of its reload ends after the reload.
        std::vector<std::size_t> can_end;
        for (std::size_t j = 0; j < running.size(); ++j) {
          const Running& x = running[j];
          const int own = split_of(x.r, x.stream, static_cast<std::size_t>(x.index));
          if (own < 0 || ended[x.r][1][static_cast<std::size_t>(own)] != 0) can_end.push_back(j);
        }
        if (can_end.empty()) return "a B waits for a reload that cannot end";
        const std::size_t k = can_end[next(can_end.size())];
        const Running x = running[k];
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(k));
        busy[x.r][static_cast<std::size_t>(x.stream)] = false;
        ended[x.r][static_cast<std::size_t>(list_of(x.stream))][static_cast<std::size_t>(x.index)] = 1;
        effect(x.r, x.stream, x.index, false);
      }
      if (!err.empty()) return err;
    }
    for (std::size_t r = 0; r < d; ++r)
      for (std::size_t q = 0; q < 3; ++q)
        for (std::size_t e = 0; e < ended[r][q].size(); ++e)
          if (ended[r][q][e] == 0)
            return "deadlock: rank " + std::to_string(r) + " stream " + std::to_string(q) + " stopped at op " +
                   std::to_string(e) + " of " + std::to_string(ended[r][q].size());
    return "";
  }
};

}  // namespace

TEST_CASE(
    "memory: random timings of every family's lowered program never exceed its memory plan, nor deadlock (seeded)") {
  // The lowered program's waits are all the runtime orders its streams by; whatever the timing,
  // no rank may hold more blocks of a kind and size than the slots its plan reserves.
  std::uint64_t seed = 7;
  for (const char* name : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v",
                           "v-half", "v-min", "dualpipe-v"})
    for (po::Shape sh : {po::Shape{2, 2, 4}, po::Shape{4, 2, 8}, po::Shape{3, 2, 6}}) {
      const std::string n = name;
      if (n == "1f1b" || n.rfind("zb-h", 0) == 0) sh.v = 1;
      if (n == "dualpipe-v" && sh.m < 2 * sh.d) sh.m = 2 * sh.d;
      CAPTURE(n);
      CAPTURE(sh.d);
      const po::Program p = po::build(po::parse_schedule(n, n == "gis-g" ? 2 : 0), sh);
      // Sizes that differ per stage (several pools) and collide across kinds.
      std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()));
      for (int s = 0; s < sh.stages(); ++s)
        bytes[static_cast<std::size_t>(s)] = {std::size_t(1000 + 8 * (s % 2)), std::size_t(300 + 8 * (s % 3)),
                                              s > 0 ? std::size_t(64 + (s - 1) % 2) : 0,
                                              s + 1 < sh.stages() ? std::size_t(64 + s % 2) : 0};
      for (bool training : {true, false}) {
        CAPTURE(training);
        const po::Program q = training ? p : po::forward_only(p);
        Executor ex{q, bytes, {}, training};
        for (int r = 0; r < sh.d; ++r) ex.lowered.push_back(po::lower(q, r, bytes));
        for (int trial = 0; trial < 12; ++trial) {
          CAPTURE(trial);
          REQUIRE(ex.run(seed++) == "");
        }
      }
    }
}

TEST_CASE(
    "memory: with two copy streams, random timings never exceed the memory plan nor deadlock, paired or not "
    "(seeded)") {
  // Offloads and reloads on streams of their own end out of order; the waits lower() gives
  // them (a reload after every copy before it, an offload after the reload that gave back its
  // host bins) keep every timing within the plan.
  std::uint64_t seed = 11;
  int shared_slots = 0;  // slots holding a reload and an offload at once, over every case
  for (const char* name : {"po-f", "po-h", "po", "1f1b-i", "zb-v"})
    for (po::Shape sh : {po::Shape{1, 4, 8}, po::Shape{2, 2, 4}, po::Shape{4, 2, 8}, po::Shape{3, 2, 6}})
      for (bool stagger : {true, false})
        for (double k : {1.0, 2.0}) {
          const std::string n = name;
          CAPTURE(n);
          CAPTURE(sh.d);
          CAPTURE(sh.v);
          CAPTURE(stagger);
          CAPTURE(k);
          po::Costs c;
          c.copy_streams = 2;
          c.stagger_pairs = stagger;
          c.k = k;
          po::ScheduleSpec spec = po::parse_schedule(n);
          if (spec.offload.kind == po::offload::selection::Kind::none) spec.offload = po::offload::all;
          if (n == "1f1b-i" && sh.m % sh.d != 0) continue;
          if (n == "zb-v") sh.v = 2;
          const po::Program p = po::build(spec, sh, c);
          REQUIRE(po::validate(p));
          for (const po::RankProgram& rp : p.ranks)
            for (std::size_t y = 1; y < rp.copy.size(); ++y) shared_slots += rp.copy_slot[y] == rp.copy_slot[y - 1];
          std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()));
          for (int s = 0; s < sh.stages(); ++s)
            bytes[static_cast<std::size_t>(s)] = {std::size_t(1000 + 8 * (s % 2)), std::size_t(300 + 8 * (s % 3)),
                                                  s > 0 ? std::size_t(64 + (s - 1) % 2) : 0,
                                                  s + 1 < sh.stages() ? std::size_t(64 + s % 2) : 0};
          Executor ex{p, bytes, {}, true};
          for (int r = 0; r < sh.d; ++r) ex.lowered.push_back(po::lower(p, r, bytes));
          for (int trial = 0; trial < 8; ++trial) {
            CAPTURE(trial);
            REQUIRE(ex.run(seed++) == "");
          }
        }
  CHECK(shared_slots > 0);  // the cases do put a reload and an offload in one slot
}

TEST_CASE("memory: the lowered waits hold every data edge of the program, and memory only adds waits") {
  // The data edges re-derived here: a compute op waits for the recv of its input and, by
  // Op::wait, for a copy; a copy for a compute op; a send for the compute op that made it.
  for (const char* name : {"1f1b-i", "gis-h", "po-f", "zb-v", "dualpipe-v"}) {
    CAPTURE(name);
    const po::Shape sh{4, 2, 8};
    const po::Program p = po::build(po::parse_schedule(name, 0), sh);
    const std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()), po::StageBytes{1000, 500, 64, 64});
    for (int r = 0; r < sh.d; ++r) {
      const po::RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
      const po::LoweredRank lr = po::lower(p, r, bytes);
      REQUIRE(lr.compute.size() == rp.compute.size());
      REQUIRE(lr.copy.size() == rp.copy.size());
      REQUIRE(lr.comm.size() == rp.comm.size());
      const auto find_comm = [&](bool send, int stage, int mb, po::Dir dir) {
        for (std::size_t k = 0; k < rp.comm.size(); ++k)
          if (rp.comm[k].send == send && rp.comm[k].stage == stage && rp.comm[k].mb == mb && rp.comm[k].dir == dir)
            return static_cast<int>(k);
        return -1;
      };
      int data = 0, total = 0;
      for (std::size_t x = 0; x < rp.compute.size(); ++x) {
        const po::Op& op = rp.compute[x];
        int recv = -1;
        if (op.kind == po::OpKind::F && op.stage > 0) recv = find_comm(false, op.stage, op.mb, po::Dir::forward);
        if ((op.kind == po::OpKind::B || op.kind == po::OpKind::BW) && op.stage < sh.stages() - 1)
          recv = find_comm(false, op.stage, op.mb, po::Dir::backward);
        CHECK(lr.compute[x].on(po::Stream::comm) >= recv);
        CHECK(lr.compute[x].on(po::Stream::copy) >= op.wait);
        CHECK(lr.compute[x].on(po::Stream::compute) == -1);
        data += (recv >= 0) + (op.wait >= 0);
      }
      for (std::size_t y = 0; y < rp.copy.size(); ++y) {
        CHECK(lr.copy[y].on(po::Stream::compute) >= rp.copy[y].wait);
        data += rp.copy[y].wait >= 0;
      }
      for (std::size_t k = 0; k < rp.comm.size(); ++k) {
        const po::CommOp& c = rp.comm[k];
        if (!c.send) continue;
        // The producer: F of stage - 1 (forward) or B/BW of stage + 1 (backward).
        const int from = c.dir == po::Dir::forward ? c.stage - 1 : c.stage + 1;
        int producer = -1;
        for (std::size_t x = 0; x < rp.compute.size(); ++x) {
          const po::Op& op = rp.compute[x];
          if (op.stage == from && op.mb == c.mb &&
              (c.dir == po::Dir::forward ? op.kind == po::OpKind::F
                                         : (op.kind == po::OpKind::B || op.kind == po::OpKind::BW)))
            producer = static_cast<int>(x);
        }
        REQUIRE(producer >= 0);
        CHECK(lr.comm[k].on(po::Stream::compute) >= producer);
        ++data;
      }
      for (const auto* list : {&lr.compute, &lr.copy, &lr.comm})
        for (const po::Waits& w : *list)
          for (int i : w.last) total += i >= 0;
      // Every wait is a data edge or one the memory plan added (some data edges coincide).
      CHECK(total <= data + static_cast<int>(lr.memory_waits));
    }
  }
}

namespace {

po::ScheduleSpec spec_of(int i) {
  using GK = po::GroupSpec::Kind;
  switch (i) {
    case 0:
      return {po::Family::one_f1b, {}, po::offload::none};
    case 1:
      return {po::Family::interleaved_1f1b, {}, po::offload::none};
    case 2:
      return {po::Family::grouped, {GK::full, 0}, po::offload::none};
    case 3:
      return {po::Family::grouped, {GK::half, 0}, po::offload::none};
    default:
      return {po::Family::grouped, {GK::uniform, 1}, po::offload::none};
  }
}

}  // namespace

namespace {

const char* const families[] = {"1f1b", "1f1b-i", "gis",   "gis-h", "gis-g",  "po",    "po-h",
                                "po-f", "zb-h1",  "zb-h2", "zb-v",  "v-half", "v-min", "dualpipe-v"};

/// A GPT block's proportions in 256-byte pieces: a unit of 20 T h bytes, a stash of 22, a
/// boundary tensor of 1 (bf16, T h 2 bytes with T h = 128).
po::Costs gpt_like(int stages) {
  po::Costs c;
  c.unit_bytes.assign(static_cast<std::size_t>(stages), 20 * 256);
  c.stash_bytes.assign(static_cast<std::size_t>(stages), 22 * 256);
  c.k = 1.28;  // the copy ratio measured on an H100 (bench/RESULTS.md)
  return c;
}

std::vector<po::StageBytes> gpt_like_bytes(int stages) {
  return std::vector<po::StageBytes>(static_cast<std::size_t>(stages), po::StageBytes{20 * 256, 22 * 256, 256, 256});
}

/// Family `n` built at `sh` (v = 1 for 1F1B and ZB-H*, 2 for the V families) with gpt_like costs.
po::Program family_program(const std::string& n, po::Shape sh) {
  if (n == "1f1b" || n.rfind("zb-h", 0) == 0) sh.v = 1;
  if (n == "zb-v" || n == "v-half" || n == "v-min" || n == "dualpipe-v") sh.v = 2;
  return po::build(po::parse_schedule(n, n == "gis-g" ? sh.d / 2 + 1 : 0), sh, gpt_like(sh.stages()));
}

}  // namespace

TEST_CASE(
    "memory: the lowered program's witness holds simulate()'s peaks of units and of stashes, every rank and family") {
  for (const std::string name : families)
    for (po::Shape sh : {po::Shape{4, 2, 16}, po::Shape{8, 2, 32}, po::Shape{3, 3, 9}}) {
      CAPTURE(name);
      CAPTURE(sh.d);
      const po::Program p = family_program(name, sh);
      const po::Costs& c = p.costs;
      po::Costs units = c;
      units.stash_bytes.clear();
      const po::SimResult sim = po::simulate(p, c), unit_sim = po::simulate(p, units);
      const std::vector<po::StageBytes> bytes = gpt_like_bytes(p.stages());
      const std::vector<po::LoweredRank> all = po::lower_all(p, bytes);
      for (int r = 0; r < p.d(); ++r) {
        CAPTURE(r);
        const po::LoweredRank& lr = all[static_cast<std::size_t>(r)];
        CHECK(static_cast<double>(lr.peak[0]) == unit_sim.ranks[static_cast<std::size_t>(r)].peak);
        CHECK(static_cast<double>(lr.peak[1]) == sim.ranks[static_cast<std::size_t>(r)].stash_peak);
        CHECK(lr.peak_total <= lr.peak[0] + lr.peak[1] + lr.peak[2]);
      }
    }
}

TEST_CASE("memory: each rank's region is within 5% of the simulated peak and its boundary tensors, every family") {
  // The reservation (training's region, or evaluation's if larger) against what simulate()
  // says is alive at once plus the witnessed boundary tensors (which simulate() does not count).
  for (const std::string n : families)
    for (po::Shape sh : {po::Shape{4, 2, 16}, po::Shape{8, 2, 32}, po::Shape{16, 2, 64}}) {
      CAPTURE(n);
      CAPTURE(sh.d);
      const po::Program p = family_program(n, sh);
      const po::SimResult sim = po::simulate(p, p.costs);
      const std::vector<po::StageBytes> bytes = gpt_like_bytes(p.stages());
      const std::vector<po::LoweredRank> all = po::lower_all(p, bytes);
      const std::vector<po::Reservation> reserved = po::reservation_plans(p, bytes);
      for (int r = 0; r < p.d(); ++r) {
        CAPTURE(r);
        const po::LoweredRank& lr = all[static_cast<std::size_t>(r)];
        const po::Reservation& res = reserved[static_cast<std::size_t>(r)];
        // One rank lowered alone agrees with the whole program lowered at once.
        if (r == p.d() - 1) CHECK(po::reservation_plan(p, r, bytes).device == res.device);
        const double simulated = sim.ranks[static_cast<std::size_t>(r)].peak + static_cast<double>(lr.peak[2]);
        CAPTURE(res.device);
        CAPTURE(simulated);
        CHECK(res.device >= lr.peak_total);
        CHECK(static_cast<double>(res.device) <= 1.05 * simulated);
        CHECK(res.device % po::buffer_alignment == 0);
      }
    }
}

TEST_CASE("memory: evaluation holds a few boundary tensors on every rank, not one per microbatch") {
  // Nothing in the forward-only program stops rank 0's forwards from running ahead of its
  // sends; the memory plan's waits do, so its tensors stay a handful whatever m is.
  for (const std::string name : {"1f1b", "gis-h", "po-f", "zb-v"}) {
    CAPTURE(name);
    const po::Shape sh{4, 2, 64};
    const po::Program p = family_program(name, sh);
    const po::Program eval = po::forward_only(p);
    const std::vector<po::StageBytes> bytes = gpt_like_bytes(p.stages());
    for (int r = 0; r < p.d(); ++r) {
      CAPTURE(r);
      const po::LoweredRank lr = po::lower(eval, r, bytes);
      CHECK(lr.peak[2] <= 4 * 256);
      CHECK(lr.peak[0] == 20 * 256);  // one scratch unit: evaluation keeps nothing
      CHECK(lr.peak[1] == 0);
    }
  }
}

TEST_CASE("memory: lowering keeps the PCIe pairs' copy waits where they leave no cycle, and says where they would") {
  // The pairs' waits come from the planned copy slots (po::pair_waits). For PO-F they agree with
  // the program's edges; for DualPipeV with every chunk offloaded at d = 4, m = 8 they do not:
  // together they form a cycle, so a paired run would hang. Lowering then drops them from its
  // witness, says so (LoweredRank::paired), and Runtime::pair_with refuses such a program.
  po::Costs c;
  c.stagger_pairs = true;
  c.b = 1.1;
  c.w = 0.9;
  const std::vector<po::StageBytes> bytes(8, po::StageBytes{1000, 1100, 64, 64});
  const po::Program po_f_program = po::build(po_f(), {4, 2, 8}, c);
  po::ScheduleSpec dv = po::parse_schedule("dualpipe-v", 0);
  dv.offload = po::offload::all;
  const po::Program dual = po::build(dv, {4, 2, 8}, c);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(po::lower(po_f_program, r, bytes).paired);
    const po::LoweredRank lr = po::lower(dual, r, bytes);
    CHECK_FALSE(lr.paired);
    CHECK(lr.region > 0);
  }
  po::Program unstaggered = po_f_program;
  unstaggered.costs.stagger_pairs = false;
  CHECK_FALSE(po::lower(unstaggered, 0, bytes).paired);
}

TEST_CASE("memory: boundary tensors of different sizes get their own bytes; reservation_plan names bad arguments") {
  // Stage s outputs 100 + s bytes; on one rank each size is held by F(s) until F(s+1)
  // consumes it, and its gradient by B(s+1) until B(s) consumes it.
  const po::Shape sh{1, 4, 4};
  const po::Program p = po::build(spec_of(2), sh);
  std::vector<po::StageBytes> bytes(4);
  for (int s = 0; s < 4; ++s)
    bytes[static_cast<std::size_t>(s)] = {1000, 100, s > 0 ? std::size_t(100 + s - 1) : 0,
                                          s < 3 ? std::size_t(100 + s) : 0};
  const po::LoweredRank lr = po::lower(p, 0, bytes);
  CHECK(lr.peak[2] >= po::buffer_bytes(100));
  for (std::size_t x = 0; x < lr.compute_at.size(); ++x) {
    const po::Op& op = p.ranks[0].compute[x];
    CHECK((lr.compute_at[x][0] != po::no_buffer) == (op.kind != po::OpKind::W));  // F's unit, B's stash
    if (op.kind == po::OpKind::F) CHECK((lr.compute_at[x][1] != po::no_buffer) == (op.stage < 3));
  }
  const po::Shape sh2{2, 2, 4};
  const po::Program p2 = po::build(spec_of(3), sh2);
  CHECK_THROWS_WITH(po::reservation_plan(p2, 2, bytes), "po::reservation_plan: rank = 2 is outside [0, 1]");
  CHECK_THROWS_WITH(po::reservation_plan(p2, 0, std::vector<po::StageBytes>(3)),
                    "po::reservation_plan: 3 stage sizes given; the program has S = 4 stages");
  CHECK_THROWS_WITH(po::lower(p2, -1, bytes), "po::lower: rank = -1 is outside [0, 1]");
}

TEST_CASE("memory: po::state_bytes is the runtime's state memory beyond its inputs, losses and flags (both paths)") {
  // A launcher sizes backend::Cuda's arena with it before anything exists (train_gpt does):
  // it must count the exact sums the runtime takes, to the byte (and nothing on the standard
  // path with one replica).
  for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact}) {
    CAPTURE(po::gradients_name(path));
    test::Config c;
    c.spec = po_f();
    c.shape = {2, 2, 4};
    c.h = 32;
    c.steps = 1;
    c.gradients = path;
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    const std::size_t m = static_cast<std::size_t>(c.shape.m), tokens = static_cast<std::size_t>(c.mb.tokens());
    for (int r = 0; r < c.shape.d; ++r) {
      CAPTURE(r);
      std::vector<std::size_t> params;
      bool embeds = false;
      for (int ch = 0; ch < c.shape.v; ++ch) {
        const int s = c.shape.stage_of(r, ch);
        params.push_back(test::TanhLayer(s, c.h, 1).parameters().size());
        embeds = embeds || s == 0;
      }
      const po::StateBytes want = po::state_bytes(params, {.gradients = path});
      CHECK(want.optimizer == 2 * 4 * (params[0] + params[1]));
      CHECK(want.sums == (path == po::Gradients::exact ? 16 * (params[0] + params[1]) : 0));
      // tokens (where stage 0 lives) and targets, int32 per token; a loss per microbatch; a flag
      // per compute op.
      const std::size_t inputs = (embeds ? 2 : 1) * m * tokens * 4, losses = m * 4,
                        flags = run.program.ranks[static_cast<std::size_t>(r)].compute.size() * 4;
      CHECK(run.memory[static_cast<std::size_t>(r)].in(po::backend::Memory::state) ==
            want.sums + want.staging + inputs + losses + flags);
    }
  }
  // The layout: buckets of at most reduce_bucket values, a multiple of dp each, covering them;
  // replica j owns slice j of every bucket.
  const po::GradientLayout l = po::gradient_layout(10, 3, 4);
  CHECK(l.buckets == 3);
  CHECK(l.len == 6);
  CHECK(l.padded() == 18);
  CHECK(l.shards(0) == std::vector<po::ParamRange>{{0, 2}, {6, 8}});
  CHECK(l.shards(2) == std::vector<po::ParamRange>{{4, 6}});
  const std::size_t one[] = {10};
  // dp = 3 adds the staging of the largest bucket: exact 16 * 6 + 16 * 2 + 4 * 2 + 4 * 6 bytes,
  // standard 4 * 6 + 4 * 6 + 4 * 2.
  CHECK(po::state_bytes(one, {.gradients = po::Gradients::exact, .dp = 3, .reduce_bucket = 4}).arena() ==
        288 + 96 + 32 + 8 + 24 + 2 * 4 * 10);
  CHECK(po::state_bytes(one, {.gradients = po::Gradients::standard, .dp = 3, .reduce_bucket = 4}).arena() ==
        24 + 24 + 8 + 2 * 4 * 10);
  // ZeRO-1: replica 0 keeps the moments of its 4 parameters.
  CHECK(po::state_bytes(one, {.dp = 3, .zero = 1, .reduce_bucket = 4}).optimizer == 2 * 4 * 4);
}

TEST_CASE(
    "memory: a B that starts on the first part of its reload (reloads in parts) never exceeds the memory plan, "
    "nor deadlocks (seeded)") {
  // Between a reload's start and its end only the reload itself ends, which frees no device
  // memory: so a B that starts there holds no more than one that waits for the end.
  std::uint64_t seed = 23;
  int early = 0;  // B ops that wait for their own reload only: the ones a split lets start early
  for (const char* name : {"po-f", "po-h", "po"})
    for (po::Shape sh : {po::Shape{1, 4, 8}, po::Shape{2, 2, 4}, po::Shape{4, 2, 8}})
      for (int streams : {1, 2})
        for (double k : {1.0, 2.0}) {
          const std::string n = name;
          CAPTURE(n);
          CAPTURE(sh.d);
          CAPTURE(streams);
          CAPTURE(k);
          po::Costs c;
          c.copy_streams = streams;
          c.k = k;
          c.reload_shares.assign(static_cast<std::size_t>(sh.stages()), {0.4, 0.2, 0.2, 0.2});
          const po::Program p = po::build(po::parse_schedule(n), sh, c);
          REQUIRE(po::validate(p));
          std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()));
          for (int s = 0; s < sh.stages(); ++s)
            bytes[static_cast<std::size_t>(s)] = {std::size_t(1000 + 8 * (s % 2)), std::size_t(300 + 8 * (s % 3)),
                                                  s > 0 ? std::size_t(64 + (s - 1) % 2) : 0,
                                                  s + 1 < sh.stages() ? std::size_t(64 + s % 2) : 0};
          Executor ex{p, bytes, {}, true, true};
          for (int r = 0; r < sh.d; ++r) ex.lowered.push_back(po::lower(p, r, bytes));
          for (int r = 0; r < sh.d; ++r)
            for (std::size_t x = 0; x < p.ranks[static_cast<std::size_t>(r)].compute.size(); ++x) {
              const po::Op& op = p.ranks[static_cast<std::size_t>(r)].compute[x];
              const int y = ex.lowered[static_cast<std::size_t>(r)].compute[x].on(po::Stream::copy);
              early += op.kind == po::OpKind::B && y >= 0 &&
                       p.ranks[static_cast<std::size_t>(r)].copy[static_cast<std::size_t>(y)].kind == po::OpKind::R &&
                       p.ranks[static_cast<std::size_t>(r)].copy[static_cast<std::size_t>(y)].mb == op.mb;
            }
          for (int trial = 0; trial < 8; ++trial) {
            CAPTURE(trial);
            REQUIRE(ex.run(seed++) == "");
          }
        }
  CHECK(early > 0);
}
