// tests/schedule/test_differential.cpp: the schedule core's speed-tuned paths against a plain
// reference (reference.hpp, written from docs/design.md) or against their own plain paths, over
// seeded random shapes, families, costs and mutated programs: compute orders, P2P plans,
// proven_valid, threads and reused outputs, simulate, offload plans. What each case compares,
// and how to run more cases: docs/testing.md, "Differential tests of the schedule core".
//
//   PIPEOFFLOAD_DIFF_CASES=20000 ./build/tests/test_schedule_differential   (default 400)
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

#include "reference.hpp"

namespace {

namespace ref = pipeoffload_test::ref;

// ---- the library's entry points ----------------------------------------------------------
// The only names from po::detail this file uses (the linear proof and the rule-by-rule
// checks that validate() combines); after the schedule core is split, update them here.

bool proven_valid(const po::Program& p, po::Workers t = {}) { return po::detail::proven_valid(p, t); }

/// validate() without its fast path: the rules one by one (validate.hpp).
po::Validation full_check(const po::Program& p) {
  if (po::Validation v = po::detail::check_passes(p); !v) return v;
  if (po::Validation v = po::detail::check_copies(p); !v) return v;
  return po::detail::check_execution(p);
}

// ---- seeded randomness (its own mapping of bits to numbers, the same on every platform) ----

class Rng {
 public:
  // The seed is mixed first: seeds n and n+1 then start far apart in splitmix64's sequence.
  explicit Rng(std::uint64_t seed) : s_(mix(seed ^ 0x632be59bd9b4e019ULL)) {}
  std::uint64_t next() { return mix(s_ += 0x9e3779b97f4a7c15ULL); }  // splitmix64
  int below(int n) { return n <= 1 ? 0 : static_cast<int>(next() % static_cast<std::uint64_t>(n)); }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return uniform(0, 1) < p; }

 private:
  static std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint64_t s_;
};

/// Random configurations each randomized test case draws: PIPEOFFLOAD_DIFF_CASES, else `ci`.
int case_count(int ci = 400) {
  const char* env = std::getenv("PIPEOFFLOAD_DIFF_CASES");
  if (env == nullptr || *env == '\0') return ci;
  const long n = std::strtol(env, nullptr, 10);
  return n > 0 ? static_cast<int>(std::min(n, 10000000L)) : ci;
}

// ---- random configurations ---------------------------------------------------------------

struct Case {
  po::ScheduleSpec spec;
  po::Shape shape;
  po::Costs costs;
};

std::string num(double x) { return std::to_string(x); }

std::string text(const Case& c) {
  std::string s = po::schedule_name(c.spec, c.shape.v);
  if (c.spec.family == po::Family::grouped) s += " (g=" + std::to_string(ref::group_size(c.spec, c.shape.d)) + ")";
  s += " d=" + std::to_string(c.shape.d) + " v=" + std::to_string(c.shape.v) + " m=" + std::to_string(c.shape.m);
  const po::Costs& k = c.costs;
  s += " costs{f=" + num(k.f) + " b=" + num(k.b) + " w=" + num(k.w) + " comm=" + num(k.comm) + " k=" + num(k.k) +
       " t_o=" + num(k.t_o) + " stagger=" + (k.stagger_pairs ? "1" : "0") + (k.stage_f.empty() ? "" : " per-stage") +
       (k.unit_bytes.empty() ? "" : " unit_bytes") + "}";
  return s;
}

/// Random costs for S stages: unit, scalar or per-stage passes; T_comm zero, small or large;
/// T_O from k or given; staggered pairs or not; unit sizes multiples of 1/8 in [0, 8] (so
/// that sums of them are exact and memory can be compared bit for bit).
po::Costs random_costs(Rng& rng, int S) {
  po::Costs c;
  switch (rng.below(3)) {
    case 0:
      break;  // unit passes
    case 1:
      c.f = rng.uniform(0.25, 2);
      c.b = rng.uniform(0.25, 3);
      c.w = rng.uniform(0.1, 2);
      break;
    default:
      for (int s = 0; s < S; ++s) {
        c.stage_f.push_back(rng.uniform(0.25, 3));
        c.stage_b.push_back(rng.uniform(0.25, 4));
        c.stage_w.push_back(rng.uniform(0.1, 2));
      }
  }
  if (rng.chance(0.5)) c.comm = rng.chance(0.25) ? rng.uniform(0, 3) : rng.uniform(0, 0.3);
  if (rng.chance(0.2))
    c.t_o = rng.uniform(0.2, 2.5);
  else
    c.k = rng.chance(0.5) ? 0.25 * (1 + rng.below(6)) : rng.uniform(0.15, 2);
  c.stagger_pairs = rng.chance(0.7);
  if (rng.chance(0.4))
    for (int s = 0; s < S; ++s) c.unit_bytes.push_back(rng.below(65) / 8.0);
  return c;
}

po::offload::selection random_offload(Rng& rng, int v) {
  switch (rng.below(4)) {
    case 0:
      return po::offload::half;
    case 1:
      return po::offload::all;
    case 2:
      return po::offload::first(1 + rng.below(v));
    default: {
      po::offload::selection s{po::offload::selection::Kind::set, 0, 0};
      for (int c = 0; c < v; ++c)
        if (rng.chance(0.5)) s.mask |= std::uint64_t{1} << c;
      if (s.mask == 0) s.mask = std::uint64_t{1} << rng.below(v);
      return s;
    }
  }
}

/// A random legal configuration with d <= dmax, v <= vmax, m <= mmax (1F1B forces v = 1,
/// 1F1B-I m a multiple of d), offloading some chunks with probability p_offload.
Case random_case(Rng& rng, int dmax, int vmax, int mmax, double p_offload) {
  Case c;
  int d = 1 + rng.below(dmax), v = 1 + rng.below(vmax), m = 1 + rng.below(mmax);
  const int h = (d + 1) / 2;
  switch (rng.below(8)) {
    case 0:
      c.spec = po::OneF1B::spec;
      v = 1;
      break;
    case 1:
      c.spec = po::Interleaved1F1B::spec;
      m = d * (1 + rng.below(std::max(1, mmax / d)));
      break;
    case 2:
      c.spec = po::GIS::spec;
      break;
    case 3:
      c.spec = po::GIS_H::spec;
      break;
    case 4:
      c.spec = {po::Family::grouped, {po::GroupSpec::Kind::number, h + rng.below(d - h + 1)}, po::offload::none};
      break;
    default:
      c.spec = po::PO::spec;
  }
  if (rng.chance(p_offload)) c.spec.offload = random_offload(rng, v);
  c.shape = {d, v, m};
  c.costs = random_costs(rng, d * v);
  return c;
}

// ---- comparisons -------------------------------------------------------------------------

bool same_bits(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b); }

std::string describe(const po::CommOp& c) {
  return std::string(c.send ? "send to " : "recv from ") + std::to_string(c.peer) + " (stage " +
         std::to_string(c.stage) + ", mb " + std::to_string(c.mb) +
         (c.dir == po::Dir::forward ? ", forward)" : ", backward)");
}

/// Where two op lists first differ ("" if they do not); `with_wait` compares the edges too.
std::string diff_ops(const std::vector<po::Op>& a, const std::vector<po::Op>& b, bool with_wait) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i].kind != b[i].kind || a[i].stage != b[i].stage || a[i].mb != b[i].mb ||
        (with_wait && a[i].wait != b[i].wait))
      return "op " + std::to_string(i) + ": " + ref::describe(a[i]) + " wait " + std::to_string(a[i].wait) + " vs " +
             ref::describe(b[i]) + " wait " + std::to_string(b[i].wait);
  if (a.size() != b.size()) return "lengths " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  return "";
}

std::string diff_comm(const std::vector<po::CommOp>& a, const std::vector<po::CommOp>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (!(a[i] == b[i])) return "P2P op " + std::to_string(i) + ": " + describe(a[i]) + " vs " + describe(b[i]);
  if (a.size() != b.size()) return "P2P lengths " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  return "";
}

/// Where two programs first differ, bit for bit ("" if they do not).
std::string diff_programs(const po::Program& a, const po::Program& b) {
  if (!(a.spec == b.spec) || !(a.shape == b.shape) || a.group != b.group) return "spec, shape or group";
  if (a.ranks.size() != b.ranks.size()) return "number of ranks";
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const po::RankProgram& x = a.ranks[r];
    const po::RankProgram& y = b.ranks[r];
    const std::string at = "rank " + std::to_string(r) + ": ";
    if (std::string e = diff_ops(x.compute, y.compute, true); !e.empty()) return at + "compute " + e;
    if (std::string e = diff_ops(x.copy, y.copy, true); !e.empty()) return at + "copy " + e;
    if (x.copy_slot != y.copy_slot) return at + "copy slots";
    if (!same_bits(x.slot_length, y.slot_length))
      return at + "slot_length " + num(x.slot_length) + " vs " + num(y.slot_length);
    if (std::string e = diff_comm(x.comm, y.comm); !e.empty()) return at + e;
  }
  return "";
}

std::string diff_times(const char* what, const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::string(what) + " lengths differ";
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i]))
      return std::string(what) + "[" + std::to_string(i) + "] " + num(a[i]) + " vs " + num(b[i]);
  return "";
}

std::string diff_memory(const std::vector<po::MemoryPoint>& a, const std::vector<po::MemoryPoint>& b) {
  if (a.size() != b.size())
    return "memory timeline lengths " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i].time, b[i].time) || !same_bits(a[i].alive, b[i].alive))
      return "memory point " + std::to_string(i) + ": (" + num(a[i].time) + ", " + num(a[i].alive) + ") vs (" +
             num(b[i].time) + ", " + num(b[i].alive) + ")";
  return "";
}

/// Where a rank's four op-time lists (compute and copy starts and ends; the library's RankSim or
/// the reference's RankTimes) first differ, bit for bit ("" if they do not).
template <class X, class Y>
std::string diff_op_times(const X& x, const Y& y) {
  for (const auto& [what, u, w] :
       {std::tuple{"compute_start", &x.compute_start, &y.compute_start},
        std::tuple{"compute_end", &x.compute_end, &y.compute_end},
        std::tuple{"copy_start", &x.copy_start, &y.copy_start}, std::tuple{"copy_end", &x.copy_end, &y.copy_end}})
    if (std::string e = diff_times(what, *u, *w); !e.empty()) return e;
  return "";
}

/// Where two simulations first differ, bit for bit ("" if they do not).
std::string diff_sims(const po::SimResult& a, const po::SimResult& b) {
  if (!same_bits(a.makespan, b.makespan)) return "makespan " + num(a.makespan) + " vs " + num(b.makespan);
  if (a.ranks.size() != b.ranks.size()) return "number of ranks";
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const po::RankSim& x = a.ranks[r];
    const po::RankSim& y = b.ranks[r];
    const std::string at = "rank " + std::to_string(r) + ": ";
    if (std::string e = diff_op_times(x, y); !e.empty()) return at + e;
    if (!same_bits(x.busy, y.busy) || !same_bits(x.bubble, y.bubble)) return at + "busy or bubble";
    if (!same_bits(x.peak, y.peak)) return at + "peak " + num(x.peak) + " vs " + num(y.peak);
    if (x.warmup != y.warmup) return at + "warmup";
    if (std::string e = diff_memory(x.memory, y.memory); !e.empty()) return at + e;
  }
  return "";
}

/// Where the library's simulation differs from the reference's ("" if it does not).
/// Tolerances: start and end times and the makespan are compared exactly. Every start is a
/// max over ends of earlier ops (plus T_comm) and every end is start + duration: max is exact,
/// and each sum has the same two operands in both simulators, so any order of evaluation
/// gives the same bits. Peaks and memory timelines exactly too: the tests' unit sizes are
/// multiples of 1/8, so every sum of them is exact. Busy time (a sum of durations, rounded in
/// the order each simulator adds) and bubble (makespan - busy) within ref::close (1e-9
/// relative).
std::string diff_reference(const po::SimResult& s, const ref::Times& t) {
  if (!t.finished) return "the reference simulator cannot run the program";
  if (!same_bits(s.makespan, t.makespan)) return "makespan " + num(s.makespan) + " vs reference " + num(t.makespan);
  if (s.ranks.size() != t.ranks.size()) return "number of ranks";
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const po::RankSim& x = s.ranks[r];
    const ref::RankTimes& y = t.ranks[r];
    const std::string at = "rank " + std::to_string(r) + ": ";
    if (std::string e = diff_op_times(x, y); !e.empty()) return at + e;
    if (!ref::close(x.busy, y.busy)) return at + "busy " + num(x.busy) + " vs reference " + num(y.busy);
    if (!ref::close(x.bubble, t.makespan - y.busy))
      return at + "bubble " + num(x.bubble) + " vs reference " + num(t.makespan - y.busy);
    if (!same_bits(x.peak, y.peak)) return at + "peak " + num(x.peak) + " vs reference " + num(y.peak);
    if (!same_bits(x.stash_peak, y.stash_peak))
      return at + "stash peak " + num(x.stash_peak) + " vs reference " + num(y.stash_peak);
    if (x.warmup != y.warmup)
      return at + "warmup " + std::to_string(x.warmup) + " vs reference " + std::to_string(y.warmup);
    if (std::string e = diff_memory(x.memory, y.memory); !e.empty()) return at + e;
  }
  return "";
}

/// Where a program's compute orders (kind, stage, mb; not the edges) differ from the
/// reference orders ("" if they do not).
std::string diff_orders(const po::Program& p, const std::vector<ref::RankOrder>& ord) {
  if (p.ranks.size() != ord.size()) return "number of ranks";
  for (std::size_t r = 0; r < ord.size(); ++r)
    if (std::string e = diff_ops(p.ranks[r].compute, ord[r].ops, false); !e.empty())
      return "rank " + std::to_string(r) + " compute " + e + " (built vs reference)";
  return "";
}

std::string diff_plans(const po::Program& p, const std::vector<std::vector<po::CommOp>>& plan) {
  for (std::size_t r = 0; r < plan.size(); ++r)
    if (std::string e = diff_comm(p.ranks[r].comm, plan[r]); !e.empty())
      return "rank " + std::to_string(r) + " " + e + " (built vs reference)";
  return "";
}

/// Every spec of the families for shape (d, v, m), each legal g included.
std::vector<po::ScheduleSpec> every_spec(int d, int v, int m) {
  std::vector<po::ScheduleSpec> specs;
  if (v == 1) specs.push_back(po::OneF1B::spec);
  if (m % d == 0) specs.push_back(po::Interleaved1F1B::spec);
  specs.push_back(po::GIS::spec);
  specs.push_back(po::GIS_H::spec);
  specs.push_back(po::PO::spec);
  for (int g = (d + 1) / 2; g <= d; ++g)
    specs.push_back({po::Family::grouped, {po::GroupSpec::Kind::number, g}, po::offload::none});
  return specs;
}

}  // namespace

// ---- 1. compute orders -------------------------------------------------------------------

TEST_CASE("the reference orders reproduce docs/design.md's worked example (d=4, v=2, m=8) and its per-rank peaks") {
  // The example's rank-0 prefixes, written as docs/design.md prints them (F mb.chunk).
  const auto prefix = [](const po::ScheduleSpec& spec, std::size_t n) {
    const std::vector<ref::RankOrder> ord = ref::orders(spec, {4, 2, 8});
    std::string s;
    for (std::size_t x = 0; x < n; ++x) {
      const po::Op& op = ord[0].ops[x];
      s += (x ? " " : "") + std::string(po::op_name(op.kind)) + std::to_string(op.mb) + "." +
           std::to_string(op.stage / 4);
    }
    return s;
  };
  CHECK(prefix(po::PO::spec, 16) == "F0.0 F1.0 F0.1 F2.0 F1.1 F3.0 B0.1 W0.1 F2.1 F4.0 B1.1 W1.1 F3.1 B0.0 W0.0 F5.0");
  CHECK(prefix(po::GIS_H::spec, 15) == "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B0.0 W0.0 F4.0");
  CHECK(prefix(po::GIS::spec, 14) == "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 W0.1 F4.0 B1.1 W1.1 F5.0");
  const auto peaks = [](const po::ScheduleSpec& spec) {
    const po::Program p = ref::program_of(spec, {4, 2, 8}, {}, ref::orders(spec, {4, 2, 8}));
    const ref::Times t = ref::simulate(p, p.costs);
    std::vector<double> out;
    for (const auto& r : t.ranks) out.push_back(r.peak);
    return out;
  };
  CHECK(peaks(po::PO::spec) == std::vector<double>{7, 6, 5, 4});
  CHECK(peaks(po::GIS_H::spec) == std::vector<double>{6, 5, 4, 3});
  CHECK(peaks(po::GIS::spec) == std::vector<double>{8, 7, 6, 5});
  CHECK(peaks(po::Interleaved1F1B::spec) == std::vector<double>{11, 9, 7, 5});
}

TEST_CASE(
    "compute orders of every family and every legal g equal docs/design.md's definitions over d 1..8, v 1..6, m 1..24") {
  long long builds = 0;
  for (int d = 1; d <= 8; ++d)
    for (int v = 1; v <= 6; ++v)
      for (int m = 1; m <= 24; ++m)
        for (const po::ScheduleSpec& spec : every_spec(d, v, m)) {
          const po::Shape sh{d, v, m};
          const po::Program p = po::build(spec, sh);
          const std::vector<ref::RankOrder> ord = ref::orders(spec, sh);
          const std::string where = po::schedule_name(spec, v) + " g=" + std::to_string(ref::group_size(spec, d)) +
                                    " d=" + std::to_string(d) + " v=" + std::to_string(v) + " m=" + std::to_string(m);
          ++builds;
          // The reference itself against docs/design.md's table of warmups (forwards before the first
          // backward on rank i), for the families the table gives exactly.
          const int g = ref::group_size(spec, d);
          for (int i = 0; i < d; ++i) {
            int want = -1;
            if (spec.family == po::Family::one_f1b) want = std::min(d - i, m);
            if (spec.family == po::Family::interleaved_1f1b) want = std::min(d * (v - 1) + 2 * (d - i) - 1, m * v);
            if (spec.family == po::Family::grouped && g >= (d + 1) / 2)
              want = std::min(std::min(g, m) * (v - 1) + std::min(d - i, m), m * v);
            if (want >= 0 && po::warmup(po::RankProgram{ord[static_cast<std::size_t>(i)].ops, {}, {}, 0, {}}) != want) {
              FAIL_CHECK(where << ": the reference order of rank " << i
                               << " warms up with another count than docs/design.md's table, " << want);
            }
          }
          if (std::string e = diff_orders(p, ord); !e.empty()) FAIL_CHECK(where << ": " << e);
          if (std::string e = diff_plans(p, ref::p2p_plan(spec, sh, p.costs)); !e.empty())
            FAIL_CHECK(where << ": " << e);
        }
  MESSAGE("built and compared " << builds << " schedules");
  CHECK(builds > 5000);
}

// ---- 2. P2P plans ------------------------------------------------------------------------

TEST_CASE(
    "P2P plans of every family, PO's own planner included, equal the messages sorted by planning time, with random costs") {
  const int n = case_count();
  int offloaded = 0, po_cases = 0;
  for (int i = 0; i < n; ++i) {
    Rng rng(1000 + static_cast<std::uint64_t>(i));
    const Case c = random_case(rng, 9, 6, 28, 0.5);
    const po::Program p = po::build(c.spec, c.shape, c.costs);
    const std::string where = "case " + std::to_string(i) + ": " + text(c);
    offloaded += p.spec.offload.kind != po::offload::selection::Kind::none;
    po_cases += ref::plans_on_grid(c.spec, c.shape.d);
    if (std::string e = diff_orders(p, ref::orders(c.spec, c.shape)); !e.empty()) FAIL(where << ": " << e);
    if (std::string e = diff_plans(p, ref::p2p_plan(c.spec, c.shape, c.costs)); !e.empty()) FAIL(where << ": " << e);
    if (std::string e = ref::p2p_properties(p); !e.empty()) FAIL(where << ": " << e);
    if (std::string e = ref::check(p); !e.empty()) FAIL(where << ": the reference rules reject it: " << e);
    if (!full_check(p)) FAIL(where << ": " << full_check(p).error);
    if (!po::validate(p)) FAIL(where << ": " << po::validate(p).error);
  }
  CHECK(offloaded > n / 4);
  CHECK(po_cases > n / 4);
}

// ---- 3. proven_valid against the full check ---------------------------------------------

namespace {

/// One random change to a program, of the kinds a bug in a builder could make; returns its
/// name, or nullptr if the program has nothing it applies to.
const char* mutate_once(po::Program& p, Rng& rng, int kind) {
  const int d = p.shape.d;
  po::RankProgram& rp = p.ranks[static_cast<std::size_t>(rng.below(d))];
  auto& comp = rp.compute;
  auto& copy = rp.copy;
  auto& comm = rp.comm;
  const auto at = [&rng](const auto& v) { return static_cast<std::size_t>(rng.below(static_cast<int>(v.size()))); };
  const auto near = [&rng](std::size_t i, std::size_t n) {  // another index within 4 of i
    const long long j = static_cast<long long>(i) + (rng.chance(0.5) ? 1 : -1) * (1 + rng.below(4));
    return static_cast<std::size_t>(std::clamp(j, 0LL, static_cast<long long>(n) - 1));
  };
  switch (kind) {
    case 0: {
      if (comp.size() < 2) return nullptr;
      const std::size_t i = at(comp) % (comp.size() - 1);
      std::swap(comp[i], comp[i + 1]);
      return "swap two adjacent compute ops";
    }
    case 1: {
      if (comm.size() < 2) return nullptr;
      const std::size_t i = at(comm), j = rng.chance(0.5) ? near(i, comm.size()) : at(comm);
      if (i == j) return nullptr;
      std::swap(comm[i], comm[j]);
      return "swap two P2P ops";
    }
    case 2: {
      const int which = rng.below(3);
      if (which == 0 && !comp.empty()) {
        comp.erase(comp.begin() + static_cast<long>(at(comp)));
        return "drop a compute op";
      }
      if (which == 1 && !copy.empty()) {
        const std::size_t y = at(copy);
        copy.erase(copy.begin() + static_cast<long>(y));
        rp.copy_slot.erase(rp.copy_slot.begin() + static_cast<long>(y));
        return "drop a copy op";
      }
      if (which == 2 && !comm.empty()) {
        comm.erase(comm.begin() + static_cast<long>(at(comm)));
        return "drop a P2P op";
      }
      return nullptr;
    }
    case 3: {
      const int which = rng.below(3);
      if (which == 0 && !comp.empty()) {
        const std::size_t i = at(comp);
        comp.insert(comp.begin() + static_cast<long>(near(i, comp.size())), comp[i]);
        return "duplicate a compute op";
      }
      if (which == 1 && !copy.empty()) {
        const std::size_t y = at(copy);
        copy.insert(copy.begin() + static_cast<long>(y), copy[y]);
        rp.copy_slot.insert(rp.copy_slot.begin() + static_cast<long>(y), rp.copy_slot[y] - 1);
        return "duplicate a copy op";
      }
      if (which == 2 && !comm.empty()) {
        const std::size_t i = at(comm);
        comm.insert(comm.begin() + static_cast<long>(near(i, comm.size())), comm[i]);
        return "duplicate a P2P op";
      }
      return nullptr;
    }
    case 4: {  // an offload (or reload) moved to another slot, or to another place in the stream
      if (copy.size() < 2) return nullptr;
      const std::size_t y = at(copy);
      if (rng.chance(0.5)) {
        rp.copy_slot[y] += (rng.chance(0.5) ? 1 : -1) * (1 + rng.below(3));
        return "move a copy op's slot";
      }
      const std::size_t z = near(y, copy.size());
      if (z == y) return nullptr;
      const po::Op op = copy[y];
      copy.erase(copy.begin() + static_cast<long>(y));
      copy.insert(copy.begin() + static_cast<long>(z), op);
      return "move a copy op in its stream (slots stay)";
    }
    case 5: {
      if (comp.empty()) return nullptr;
      po::Op& op = comp[at(comp)];
      const int w = rng.chance(0.3) ? -1 : rng.below(static_cast<int>(copy.size()) + 1);
      if (w == op.wait) return nullptr;
      op.wait = w;
      return "break a compute op's edge";
    }
    case 6: {
      if (copy.empty()) return nullptr;
      po::Op& op = copy[at(copy)];
      const int w = rng.chance(0.3)
                        ? -1
                        : (op.wait >= 0 && rng.chance(0.5) ? op.wait + (rng.chance(0.5) ? 1 : -1) * (1 + rng.below(3))
                                                           : rng.below(static_cast<int>(comp.size()) + 1));
      if (w == op.wait || w < -1) return nullptr;
      op.wait = w;
      return "break a copy op's edge";
    }
    case 7: {
      if (comm.empty()) return nullptr;
      po::CommOp& c = comm[at(comm)];
      switch (rng.below(4)) {
        case 0:
          c.peer = rng.below(d);
          return "change a P2P op's peer";
        case 1:
          c.mb = std::max(0, c.mb + (rng.chance(0.5) ? 1 : -1));
          return "change a P2P op's mb";
        case 2:
          c.stage = std::max(0, c.stage + (rng.chance(0.5) ? 1 : d));
          return "change a P2P op's stage";
        default:
          c.dir = c.dir == po::Dir::forward ? po::Dir::backward : po::Dir::forward;
          return "change a P2P op's direction";
      }
    }
    case 8: {  // a send and the nearest receive trade places
      if (comm.size() < 2) return nullptr;
      const std::size_t i = at(comm);
      for (std::size_t k = 1; k < comm.size(); ++k)
        for (const std::size_t j : {i + k, i - k})
          if (j < comm.size() && comm[j].send != comm[i].send) {
            std::swap(comm[i], comm[j]);
            return "swap a send and a receive";
          }
      return nullptr;
    }
    case 9: {  // a window of the P2P list reversed or rotated
      if (comm.size() < 3) return nullptr;
      const std::size_t i = at(comm),
                        len = std::min<std::size_t>(comm.size() - i, 2 + static_cast<std::size_t>(rng.below(5)));
      if (len < 2) return nullptr;
      if (rng.chance(0.5))
        std::reverse(comm.begin() + static_cast<long>(i), comm.begin() + static_cast<long>(i + len));
      else
        std::rotate(comm.begin() + static_cast<long>(i), comm.begin() + static_cast<long>(i + 1),
                    comm.begin() + static_cast<long>(i + len));
      return "reorder a window of a P2P list";
    }
    case 10: {
      if (copy.empty()) return nullptr;
      const std::size_t y = at(copy);
      rp.copy_slot[y] = rng.chance(0.5) ? (y > 0 ? rp.copy_slot[y - 1] : rp.copy_slot[y] + 1)
                                        : rp.copy_slot[y] + (rng.chance(0.5) ? 2 : -2);
      return "change a copy slot";
    }
    case 11: {
      if (copy.size() < 2) return nullptr;
      const std::size_t y = at(copy) % (copy.size() - 1);
      std::swap(copy[y], copy[y + 1]);
      return "swap two adjacent copy ops";
    }
    case 12: {
      if (comp.empty()) return nullptr;
      po::Op& op = comp[at(comp)];
      switch (rng.below(3)) {
        case 0:
          op.mb = (op.mb + 1) % p.shape.m;
          return "change a compute op's mb";
        case 1:
          op.stage = (op.stage + d) % p.shape.stages();
          return "change a compute op's stage (chunk)";
        default:
          op.kind = op.kind == po::OpKind::F   ? po::OpKind::B
                    : op.kind == po::OpKind::W ? po::OpKind::BW
                                               : po::OpKind::F;
          return "change a compute op's kind";
      }
    }
    default: {  // a P2P op moved far away in its list
      if (comm.size() < 2) return nullptr;
      const std::size_t i = at(comm), j = at(comm);
      if (i == j) return nullptr;
      const po::CommOp c = comm[i];
      comm.erase(comm.begin() + static_cast<long>(i));
      comm.insert(comm.begin() + static_cast<long>(j), c);
      return "move a P2P op far in its list";
    }
  }
}

constexpr int mutation_kinds = 14;

struct Tally {
  int made = 0, rejected = 0, proven = 0;
};

}  // namespace

TEST_CASE(
    "proven_valid never accepts a mutated program that the full check rejects, and the full check agrees with the reference rules") {
  const int n = case_count();
  std::map<std::string, Tally> tally;
  int programs = 0, proven_built = 0, valid_mutants_simulated = 0;
  for (int i = 0; i < n; ++i) {
    Rng rng(2000 + static_cast<std::uint64_t>(i));
    const Case c = random_case(rng, 8, 5, 20, 0.8);
    const po::Program built = po::build(c.spec, c.shape, c.costs);
    const std::string where = "case " + std::to_string(i) + ": " + text(c);
    ++programs;
    const bool built_proven = proven_valid(built);
    proven_built += built_proven;
    if (!full_check(built)) FAIL(where << ": the built program fails the full check: " << full_check(built).error);
    for (int k = 0; k < 8; ++k) {
      po::Program mut = built;
      const int mutations = rng.chance(0.8) ? 1 : 2;
      std::string name;
      for (int applied = 0; applied < mutations;) {
        if (const char* what = mutate_once(mut, rng, rng.below(mutation_kinds)); what != nullptr) {
          name = applied == 0 ? std::string(what) : "two changes";
          ++applied;
        }
      }
      const po::Validation full = full_check(mut);
      const bool proven = proven_valid(mut);
      const po::Validation fast = po::validate(mut);
      const std::string rules = ref::check(mut);
      Tally& t = tally[name];
      ++t.made;
      t.rejected += !full.ok;
      t.proven += proven;
      const std::string said = where + ", mutant " + std::to_string(k) + " (" + name + "): full check " +
                               (full.ok ? "accepts" : "rejects: " + full.error) + "; reference rules " +
                               (rules.empty() ? "accept" : "reject: " + rules);
      if (proven && !full.ok) FAIL(said << "; but proven_valid accepts it");
      if (fast.ok != full.ok || fast.error != full.error)
        FAIL(said << "; validate() says " << (fast.ok ? "valid" : fast.error));
      if (rules.empty() != full.ok) FAIL(said);
      if (full.ok) {  // a valid mutant still runs, and runs as the reference runs it
        ++valid_mutants_simulated;
        const po::SimResult s = po::simulate(mut);
        if (std::string e = diff_reference(s, ref::simulate(mut, mut.costs)); !e.empty())
          FAIL(said << "; simulate: " << e);
      }
    }
  }
  int made = 0, rejected = 0;
  for (const auto& [name, t] : tally) {
    MESSAGE(name << ": " << t.made << " mutants, " << t.rejected << " rejected, " << t.proven << " proven valid");
    made += t.made;
    rejected += t.rejected;
    // Each kind of mutation (that occurred often enough) must break some programs.
    if (t.made >= 40) CHECK_MESSAGE(t.rejected > 0, name);
  }
  MESSAGE(made << " mutants of " << programs << " programs: " << rejected << " rejected; " << proven_built
               << " built programs proven valid by the fast path; " << valid_mutants_simulated
               << " valid mutants simulated");
  // Not vacuous: most mutants are broken, and the fast path proves most built programs.
  CHECK(rejected * 10 >= made * 5);
  CHECK(proven_built * 10 >= programs * 9);
}

// ---- 4. fast paths against their plain paths -------------------------------------------

namespace {

/// Build, validate and simulate on one thread, by default and on 3 threads, and into outputs
/// reused from other programs: every result bit-identical. `pool` holds earlier programs
/// and simulations (other shapes, larger and smaller) to build and simulate into.
void require_fast_equals_plain(const Case& c, const std::string& where, std::vector<po::Program>& pool,
                               std::vector<po::SimResult>& sims, Rng& rng, int& reused_larger, int& reused_smaller) {
  po::Program one;
  po::SimResult sim_one, sim_other;
  bool proven_one = false;
  po::Validation valid_one;
  const po::Costs other = random_costs(rng, c.shape.stages());
  {
    const po::Workers t(1);
    one = po::build(c.spec, c.shape, c.costs, t);
    proven_one = proven_valid(one, t);
    valid_one = po::validate(one, t);
    sim_one = po::simulate(one, t);
    sim_other = po::simulate(one, other, t);
  }
  REQUIRE_MESSAGE(valid_one.ok, where << ": " << valid_one.error);
  for (const int threads : {0, 3}) {
    const po::Workers t(threads);
    const std::string at =
        where + " on " + (threads == 0 ? std::string("the default threads") : std::to_string(threads) + " threads");
    const po::Program p = po::build(c.spec, c.shape, c.costs, t);
    if (std::string e = diff_programs(p, one); !e.empty()) FAIL(at << ": build: " << e);
    if (proven_valid(p, t) != proven_one) FAIL(at << ": proven_valid differs");
    if (std::string e = diff_sims(po::simulate(p, t), sim_one); !e.empty()) FAIL(at << ": simulate: " << e);
    if (std::string e = diff_sims(po::simulate(p, other, t), sim_other); !e.empty())
      FAIL(at << ": simulate under other costs: " << e);
    // Into outputs that held another program.
    const std::size_t slot = static_cast<std::size_t>(rng.below(static_cast<int>(pool.size())));
    po::Program& q = pool[slot];
    std::size_t before = 0, now = 0;
    for (const auto& rp : q.ranks) before += rp.compute.size() + rp.copy.size() + rp.comm.size();
    for (const auto& rp : one.ranks) now += rp.compute.size() + rp.copy.size() + rp.comm.size();
    reused_larger += before > now;
    reused_smaller += before < now;
    po::build_into(q, c.spec, c.shape, c.costs, t);
    if (std::string e = diff_programs(q, one); !e.empty())
      FAIL(at << ": build_into a Program that held another schedule: " << e);
    po::SimResult& s = sims[static_cast<std::size_t>(rng.below(static_cast<int>(sims.size())))];
    po::simulate_into(s, q, t);
    if (std::string e = diff_sims(s, sim_one); !e.empty())
      FAIL(at << ": simulate_into a SimResult that held another run: " << e);
    po::simulate_into(s, q, other, t);
    if (std::string e = diff_sims(s, sim_other); !e.empty()) FAIL(at << ": simulate_into under other costs: " << e);
  }
}

}  // namespace

TEST_CASE(
    "threads and reused outputs give bit-identical programs, verdicts and simulations over random configurations") {
  const int n = case_count();
  std::vector<po::Program> pool(3);
  std::vector<po::SimResult> sims(3);
  int larger = 0, smaller = 0;
  for (int i = 0; i < n; ++i) {
    Rng rng(3000 + static_cast<std::uint64_t>(i));
    const Case c = random_case(rng, 12, 6, 32, 0.7);
    require_fast_equals_plain(c, "case " + std::to_string(i) + ": " + text(c), pool, sims, rng, larger, smaller);
  }
  CHECK(larger > n / 10);
  CHECK(smaller > n / 10);
}

TEST_CASE("threads and reused outputs on shapes large enough that every threaded pass splits") {
  // PO's builder splits its ranks among workers for 3*S*m >= 2^16 ops per extra worker
  // (detail/parallel.hpp's grain), validate and simulate for as many ops of the program; with
  // po::Workers{3} every pass splits whatever its size.
  Rng rng(4000);
  std::vector<Case> cases = {
      {po::PO_F::spec, {32, 8, 256}, {}},
      {po::PO_H::spec, {32, 8, 256}, random_costs(rng, 256)},
      {po::PO::spec, {33, 4, 200}, random_costs(rng, 132)},
      {po::GIS_H::spec, {24, 4, 128}, random_costs(rng, 96)},
      {po::Interleaved1F1B::spec, {16, 4, 128}, random_costs(rng, 64)},
      {po::PO_F::spec, {17, 5, 96}, random_costs(rng, 85)},
  };
  cases[3].spec.offload = po::offload::all;
  cases[4].spec.offload = po::offload::first(2);
  cases[5].costs.stagger_pairs = false;
  const int extra = case_count() > 400 ? 6 : 0;  // more with PIPEOFFLOAD_DIFF_CASES
  for (int i = 0; i < extra; ++i) cases.push_back(random_case(rng, 40, 8, 256, 0.8));
  std::vector<po::Program> pool(2);
  std::vector<po::SimResult> sims(2);
  int larger = 0, smaller = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string where = "large case " + std::to_string(i) + ": " + text(c);
    require_fast_equals_plain(c, where, pool, sims, rng, larger, smaller);
    const po::Program p = po::build(c.spec, c.shape, c.costs, po::Workers{8});
    if (std::string e = diff_orders(p, ref::orders(c.spec, c.shape)); !e.empty()) FAIL(where << ": " << e);
    if (std::string e = diff_plans(p, ref::p2p_plan(c.spec, c.shape, c.costs)); !e.empty()) FAIL(where << ": " << e);
    if (i < 2) {  // the reference simulator and rules on the largest (slow: maps of every unit)
      if (std::string e = diff_reference(po::simulate(p), ref::simulate(p, p.costs)); !e.empty())
        FAIL(where << ": simulate: " << e);
      if (std::string e = ref::check(p); !e.empty()) FAIL(where << ": the reference rules reject it: " << e);
    }
  }
  CHECK(larger + smaller > 0);
}

// ---- 5. the simulator against the reference ---------------------------------------------

TEST_CASE("simulate equals the reference ASAP simulator op by op, and offload plans keep their promises") {
  const int n = case_count();
  int with_copies = 0;
  for (int i = 0; i < n; ++i) {
    Rng rng(5000 + static_cast<std::uint64_t>(i));
    const Case c = random_case(rng, 8, 6, 24, 0.7);
    const po::Program p = po::build(c.spec, c.shape, c.costs);
    const std::string where = "case " + std::to_string(i) + ": " + text(c);
    if (std::string e = diff_orders(p, ref::orders(c.spec, c.shape)); !e.empty()) FAIL(where << ": " << e);
    const ref::Times own = ref::simulate(p, p.costs);
    if (std::string e = diff_reference(po::simulate(p), own); !e.empty()) FAIL(where << ": " << e);
    // Under other costs the orders and edges stay; the edges must still keep the plan's peak.
    po::Costs other = random_costs(rng, c.shape.stages());
    other.unit_bytes = c.costs.unit_bytes;  // the plan's peak is in these bytes
    const ref::Times moved = ref::simulate(p, other);
    if (std::string e = diff_reference(po::simulate(p, other), moved); !e.empty())
      FAIL(where << ": under other costs: " << e);
    // With stashes (B to W), which every split backward leaves and no copy moves.
    po::Costs stashed = other;
    for (int s = 0; s < c.shape.stages(); ++s) stashed.stash_bytes.push_back(rng.below(33) / 8.0);
    if (std::string e = diff_reference(po::simulate(p, stashed), ref::simulate(p, stashed)); !e.empty())
      FAIL(where << ": with stashes: " << e);
    for (const auto& rp : p.ranks) with_copies += !rp.copy.empty();
    if (std::string e = ref::offload_properties(p, ref::plan_of(c.spec, c.shape, c.costs), {&own, &moved}); !e.empty())
      FAIL(where << ": " << e);
  }
  CHECK(with_copies > n);
}
