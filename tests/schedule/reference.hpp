// tests/schedule/reference.hpp: plain reference implementations of the schedule core, written
// for clarity from docs/design.md (sections 1-4), not from the speed-tuned code in include/. They
// are slow (sorts, maps of flags, loops that sweep until nothing moves) and meant to stay so:
// test_differential.cpp compares every fast path with them.
//
//   orders()      each rank's compute order, from the definitions of section 2;
//   simulate()    as-soon-as-possible execution under the cost model of section 1, with
//                 per-op times, per-rank memory timelines and peaks;
//   p2p_plan()    the P2P plan: every message in the order of its producer's end on the
//                 planning timeline (docs/schedules.md, step 4 of build);
//   check()       the rules of section 4 and the communicator semantics (docs/schedules.md) as
//                 an untimed run; p2p_properties(), offload_properties(): what any correct plan
//                 satisfies. Only the library's public types are used; no algorithm of include/.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

namespace pipeoffload_test::ref {

using po::CommOp;
using po::Costs;
using po::Dir;
using po::Op;
using po::OpKind;
using po::Program;
using po::ScheduleSpec;
using po::Shape;

inline std::string str(long long x) { return std::to_string(x); }

inline std::string describe(const Op& op) {
  return std::string(po::op_name(op.kind)) + "(stage " + str(op.stage) + ", mb " + str(op.mb) + ")";
}

/// The one tolerance of these tests: equal within 1e-9 of the larger magnitude (used only
/// where two correct computations may round differently; see each use).
inline bool close(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max({1.0, std::abs(a), std::abs(b)}); }

// ---- names (docs/design.md section 2, "Names"; section 4, Schedule) ------------------------------

/// g of a grouped spec for d ranks: GIS g = d, GIS-H g = ceil(d/2), PO g = 1, GIS(g) its own.
inline int group_size(const ScheduleSpec& s, int d) {
  switch (s.group.kind) {
    case po::GroupSpec::Kind::full:
      return d;
    case po::GroupSpec::Kind::half:
      return (d + 1) / 2;
    case po::GroupSpec::Kind::uniform:
      return 1;
    case po::GroupSpec::Kind::number:
      return s.group.value;
  }
  return d;
}

/// 1F1B and 1F1B-I fuse B and W into BW; the grouped families split them.
inline bool fused(const ScheduleSpec& s) { return s.family != po::Family::grouped; }

/// PO (g = 1) plans on its shifted grid; every other family on its ASAP timeline.
inline bool plans_on_grid(const ScheduleSpec& s, int d) {
  return s.family == po::Family::grouped && group_size(s, d) == 1;
}

/// Is chunk c of v offloaded (docs/design.md section 3: half = chunks 0..ceil(v/2)-1, all, the
/// first n, or an explicit set)?
inline bool chunk_offloaded(const po::offload::selection& sel, int c, int v) {
  using K = po::offload::selection::Kind;
  switch (sel.kind) {
    case K::none:
      return false;
    case K::half:
      return c < (v + 1) / 2;
    case K::all:
      return true;
    case K::first:
      return c < sel.n;
    case K::set:
      return c < 64 && ((sel.mask >> c) & 1u) != 0;
  }
  return false;
}

// ---- 1. compute orders (docs/design.md section 2) ---------------------------------------------

/// One rank's compute order; for the grouped families also each pass's slot on the shifted
/// grid (the block slot + n*L + the rank's shift), PO's planning timeline.
struct RankOrder {
  std::vector<Op> ops;
  std::vector<long long> slot;
};

/// 1F1B: rank i runs w = min(d-i-1, m) forwards; then for k = 0..m-w-1 the pair F(w+k),
/// BW(k); then the remaining BWs in order.
inline std::vector<RankOrder> order_1f1b(const Shape& sh) {
  std::vector<RankOrder> out(static_cast<std::size_t>(sh.d));
  for (int i = 0; i < sh.d; ++i) {
    auto& ops = out[static_cast<std::size_t>(i)].ops;
    const int w = std::min(sh.d - i - 1, sh.m);
    for (int k = 0; k < w; ++k) ops.push_back(Op{OpKind::F, i, k, -1});
    for (int k = 0; k < sh.m - w; ++k) {
      ops.push_back(Op{OpKind::F, i, w + k, -1});
      ops.push_back(Op{OpKind::BW, i, k, -1});
    }
    for (int k = sh.m - w; k < sh.m; ++k) ops.push_back(Op{OpKind::BW, i, k, -1});
  }
  return out;
}

/// 1F1B-I (Megatron): forward number k is chunk floor((k mod dv)/d), microbatch
/// floor(k/dv)*d + (k mod d); backward number k the same microbatch, chunk
/// v-1-floor((k mod dv)/d). Rank i runs forwards 0..w-1, w = min(2(d-i-1) + (v-1)d, mv), then
/// forward(w+k), backward(k) for k = 0..mv-w-1, then the remaining backwards.
inline std::vector<RankOrder> order_1f1b_i(const Shape& sh) {
  const int d = sh.d, v = sh.v, total = sh.m * sh.v;
  std::vector<RankOrder> out(static_cast<std::size_t>(d));
  for (int i = 0; i < d; ++i) {
    const auto mb_of = [&](int k) { return (k / (d * v)) * d + k % d; };
    const auto forward = [&](int k) { return Op{OpKind::F, ((k % (d * v)) / d) * d + i, mb_of(k), -1}; };
    const auto backward = [&](int k) { return Op{OpKind::BW, (v - 1 - (k % (d * v)) / d) * d + i, mb_of(k), -1}; };
    auto& ops = out[static_cast<std::size_t>(i)].ops;
    const int w = std::min(2 * (d - i - 1) + (v - 1) * d, total);
    for (int k = 0; k < w; ++k) ops.push_back(forward(k));
    for (int k = 0; k < total - w; ++k) {
      ops.push_back(forward(w + k));
      ops.push_back(backward(k));
    }
    for (int k = total - w; k < total; ++k) ops.push_back(backward(k));
  }
  return out;
}

/// GIS(g), GIS-H, GIS and PO from one building block: every pass at its absolute slot
/// (group n = 0..ceil(m/g)-1 places member j as microbatch n*g + j at its block slot + n*L),
/// passes with microbatch >= m deleted, each rank's passes sorted by slot; then the shift of
/// rank i by min(i, e) slots. Throws std::logic_error if two passes of a rank share a slot
/// (the block promises they never do).
inline std::vector<RankOrder> order_grouped(const Shape& sh, int g) {
  const long long d = sh.d, v = sh.v, m = sh.m;
  const long long h = (d + 1) / 2;
  const long long kp = (h + g - 1) / g;  // k' = ceil(h/g)
  const long long q = v / std::gcd(v, kp);
  const long long L = 3 * g * v;
  const auto f = [&](long long c, long long j, long long i) { return 3 * kp * g * c + 3 * j + i + 3 * g * (c / q); };
  const auto b0 = [&](long long i) { return f(v - 1, 0, i) + 3 * (d - 1 - i) + 1; };
  // Absolute (unshifted) slots of a microbatch's passes: member j = mb mod g of group n = mb / g.
  const auto f_slot = [&](long long c, long long mb, long long i) { return f(c, mb % g, i) + (mb / g) * L; };
  const auto b_slot = [&](long long c, long long mb, long long i) {  // B of chunk c
    return b0(i) + f(v - 1 - c, mb % g, 0) + (mb / g) * L;
  };
  // e = min(d-1, min over kept microbatches and c >= 1 of the slack between F(mb, c-1) on rank
  // d-1 and F(mb, c) on rank 0).
  long long e = d - 1;
  for (long long mb = 0; mb < m; ++mb)
    for (long long c = 1; c < v; ++c) e = std::min(e, f_slot(c, mb, 0) - f_slot(c - 1, mb, d - 1) - 1);
  std::vector<RankOrder> out(static_cast<std::size_t>(d));
  for (long long i = 0; i < d; ++i) {
    std::vector<std::pair<long long, Op>> passes;
    for (long long mb = 0; mb < m; ++mb)
      for (long long c = 0; c < v; ++c) {
        const int stage = static_cast<int>(c * d + i), mbi = static_cast<int>(mb);
        passes.push_back({f_slot(c, mb, i), Op{OpKind::F, stage, mbi, -1}});
        passes.push_back({b_slot(c, mb, i), Op{OpKind::B, stage, mbi, -1}});
        passes.push_back({b_slot(c, mb, i) + 1, Op{OpKind::W, stage, mbi, -1}});
      }
    std::sort(passes.begin(), passes.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (std::size_t x = 1; x < passes.size(); ++x)
      if (passes[x].first == passes[x - 1].first)
        throw std::logic_error("reference: two passes of rank " + str(i) + " share slot " + str(passes[x].first));
    RankOrder& ro = out[static_cast<std::size_t>(i)];
    for (const auto& [slot, op] : passes) {
      ro.ops.push_back(op);
      ro.slot.push_back(slot + std::min(i, e));
    }
  }
  return out;
}

/// Each rank's compute order for a spec and shape (no offload: it never changes the order).
inline std::vector<RankOrder> orders(const ScheduleSpec& spec, const Shape& sh) {
  switch (spec.family) {
    case po::Family::one_f1b:
      return order_1f1b(sh);
    case po::Family::interleaved_1f1b:
      return order_1f1b_i(sh);
    case po::Family::grouped:
      return order_grouped(sh, group_size(spec, sh.d));
    case po::Family::zb_h1:
    case po::Family::zb_h2:
    case po::Family::zb_v:
    case po::Family::v_half:
    case po::Family::v_min:
    case po::Family::dualpipe_v:
      break;  // no reference order here: test_zero_bubble.cpp checks their constructions
  }
  throw std::invalid_argument("reference.hpp: no reference compute order for the zero-bubble families");
}

/// A Program holding only the reference compute orders (no copies, no P2P plan).
inline Program program_of(const ScheduleSpec& spec, const Shape& sh, const Costs& costs,
                          const std::vector<RankOrder>& ord) {
  Program p;
  p.spec = spec;
  p.shape = sh;
  p.costs = costs;
  p.ranks.resize(static_cast<std::size_t>(sh.d));
  for (std::size_t r = 0; r < ord.size(); ++r) p.ranks[r].compute = ord[r].ops;
  return p;
}

// ---- 2. as-soon-as-possible simulation (docs/design.md sections 1, 3, 4 "sim") -----------------

/// Duration of an op under the cost model: T_F, T_B, T_W of its stage, T_B + T_W for a fused
/// BW, T_O for a copy.
inline double duration(const Costs& c, const Op& op) {
  switch (op.kind) {
    case OpKind::F:
      return c.F(op.stage);
    case OpKind::B:
      return c.B(op.stage);
    case OpKind::W:
      return c.W(op.stage);
    case OpKind::BW:
      return c.B(op.stage) + c.W(op.stage);
    case OpKind::O:
    case OpKind::R:
      return c.T_O(op.stage);
  }
  return 0;
}

struct RankTimes {
  std::vector<double> compute_start, compute_end, copy_start, copy_end;
  double busy = 0;  // sum of the compute ops' durations
  double peak = 0;
  double stash_peak = 0;  // most stash bytes alive at once
  int warmup = 0;
  std::vector<po::MemoryPoint> memory;
};

struct Times {
  bool finished = false;  // false: some op can never start (a cycle)
  double makespan = 0;
  std::vector<RankTimes> ranks;
};

enum class Streams { compute_only, compute_and_copy };

/// A rank's memory timeline (docs/design.md section 1): a unit is alive from its F's start to its
/// W's (or BW's) end, except from its offload's end to its reload's start; a stash from its
/// B's start to its W's end, or a BW's start to its end (when Costs::stash_bytes is given). Intervals are
/// half-open: at equal times releases count before acquisitions. One point per distinct event
/// time, holding what is alive after every event at that time; the peak is the most alive
/// after any event (with releases first at a time, that is after some time's last event).
inline void memory_of(const po::RankProgram& rp, const Costs& costs, RankTimes& rt) {
  struct Event {
    double time;
    bool acquire;
    double bytes;
  };
  std::vector<Event> ev;
  const auto bytes = [&](int stage) { return costs.unit_bytes.empty() ? 1.0 : costs.bytes(stage); };
  for (std::size_t x = 0; x < rp.compute.size(); ++x) {
    const Op& op = rp.compute[x];
    const double stash = costs.stash_bytes.empty() ? 0.0 : costs.stash_bytes[static_cast<std::size_t>(op.stage)];
    if (op.kind == OpKind::F) ev.push_back({rt.compute_start[x], true, bytes(op.stage)});
    if (op.kind == OpKind::W || op.kind == OpKind::BW) ev.push_back({rt.compute_end[x], false, bytes(op.stage)});
    if ((op.kind == OpKind::B || op.kind == OpKind::BW) && stash > 0) ev.push_back({rt.compute_start[x], true, stash});
    if ((op.kind == OpKind::W || op.kind == OpKind::BW) && stash > 0) ev.push_back({rt.compute_end[x], false, stash});
  }
  // Stashes alone: the compute stream runs B and W in order, so program order is time order.
  double stashed = 0;
  rt.stash_peak = 0;
  for (const Op& op : rp.compute) {
    const double stash = costs.stash_bytes.empty() ? 0.0 : costs.stash_bytes[static_cast<std::size_t>(op.stage)];
    if (op.kind == OpKind::B || op.kind == OpKind::BW) stashed += stash;
    rt.stash_peak = std::max(rt.stash_peak, stashed);
    if (op.kind == OpKind::W || op.kind == OpKind::BW) stashed -= stash;
  }
  for (std::size_t y = 0; y < rp.copy.size(); ++y) {
    const Op& op = rp.copy[y];
    if (op.kind == OpKind::O) ev.push_back({rt.copy_end[y], false, bytes(op.stage)});
    if (op.kind == OpKind::R) ev.push_back({rt.copy_start[y], true, bytes(op.stage)});
  }
  std::stable_sort(ev.begin(), ev.end(), [](const Event& a, const Event& b) {
    if (a.time != b.time) return a.time < b.time;
    return !a.acquire && b.acquire;
  });
  double alive = 0;
  rt.peak = 0;
  rt.memory.clear();
  for (const Event& e : ev) {
    alive += e.acquire ? e.bytes : -e.bytes;
    rt.peak = std::max(rt.peak, alive);
    if (!rt.memory.empty() && rt.memory.back().time == e.time)
      rt.memory.back().alive = alive;
    else
      rt.memory.push_back({e.time, alive});
  }
}

/// ASAP execution: every stream runs its ops in order, each op as soon as its stream is free,
/// its data has arrived and its cross-stream edge is met. Data: F of stage s > 0 needs F of
/// stage s-1 (same mb); B or BW of stage s needs its own F and, for s < S-1, the B (or BW) of
/// stage s+1; W needs its own B. A message between two ranks takes T_comm after its producer
/// ends; within one rank (d = 1) none. Edges (Op::wait): a compute op waits for the end of
/// copy op `wait`, a copy op for the end of compute op `wait`. Copies only move memory.
/// With Streams::compute_only the copy streams and every edge are left out (the timeline the
/// builder plans on). The loop sweeps the ranks, starting every op whose predecessors are done,
/// until a sweep starts none.
inline Times simulate(const Program& p, const Costs& costs, Streams streams = Streams::compute_and_copy) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = static_cast<int>(p.ranks.size());
  const bool copies = streams == Streams::compute_and_copy;
  // End of each unit's F and of its B (or BW), once it ran.
  std::map<std::pair<int, int>, double> f_end, b_end;
  const auto hop = [&](int from_stage, int to_stage) {
    return sh.rank_of(from_stage) != sh.rank_of(to_stage) ? costs.comm : 0.0;
  };
  Times t;
  t.ranks.resize(static_cast<std::size_t>(d));
  std::vector<std::size_t> ci(static_cast<std::size_t>(d), 0), ki(static_cast<std::size_t>(d), 0);
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    RankTimes& rt = t.ranks[static_cast<std::size_t>(r)];
    rt.compute_start.assign(rp.compute.size(), 0);
    rt.compute_end.assign(rp.compute.size(), 0);
    rt.copy_start.assign(copies ? rp.copy.size() : 0, 0);
    rt.copy_end.assign(copies ? rp.copy.size() : 0, 0);
  }
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < d; ++r) {
      const auto& rp = p.ranks[static_cast<std::size_t>(r)];
      RankTimes& rt = t.ranks[static_cast<std::size_t>(r)];
      std::size_t& x = ci[static_cast<std::size_t>(r)];
      std::size_t& y = ki[static_cast<std::size_t>(r)];
      for (bool step = true; step;) {
        step = false;
        // The compute stream's next op, if everything it needs has ended.
        if (x < rp.compute.size()) {
          const Op& op = rp.compute[x];
          const std::pair<int, int> unit{op.stage, op.mb};
          double ready = x > 0 ? rt.compute_end[x - 1] : 0.0;
          bool can = true;
          const auto need = [&](const std::map<std::pair<int, int>, double>& ends, std::pair<int, int> u, double lag) {
            const auto it = ends.find(u);
            if (it == ends.end())
              can = false;
            else
              ready = std::max(ready, it->second + lag);
          };
          if (op.kind == OpKind::F && op.stage > 0) need(f_end, {op.stage - 1, op.mb}, hop(op.stage - 1, op.stage));
          if (op.kind == OpKind::B || op.kind == OpKind::BW) {
            need(f_end, unit, 0.0);
            if (op.stage < S - 1) need(b_end, {op.stage + 1, op.mb}, hop(op.stage + 1, op.stage));
          }
          if (op.kind == OpKind::W) need(b_end, unit, 0.0);
          if (copies && op.wait >= 0) {
            if (y <= static_cast<std::size_t>(op.wait))
              can = false;
            else
              ready = std::max(ready, rt.copy_end[static_cast<std::size_t>(op.wait)]);
          }
          if (can) {
            rt.compute_start[x] = ready;
            rt.compute_end[x] = ready + duration(costs, op);
            if (op.kind == OpKind::F) f_end[unit] = rt.compute_end[x];
            if (op.kind == OpKind::B || op.kind == OpKind::BW) b_end[unit] = rt.compute_end[x];
            ++x;
            step = true;
          }
        }
        // The copy stream's next op, if its edge is met.
        if (copies && y < rp.copy.size()) {
          const Op& op = rp.copy[y];
          double ready = y > 0 ? rt.copy_end[y - 1] : 0.0;
          bool can = true;
          if (op.wait >= 0) {
            if (x <= static_cast<std::size_t>(op.wait))
              can = false;
            else
              ready = std::max(ready, rt.compute_end[static_cast<std::size_t>(op.wait)]);
          }
          if (can) {
            rt.copy_start[y] = ready;
            rt.copy_end[y] = ready + duration(costs, op);
            ++y;
            step = true;
          }
        }
        moved = moved || step;
      }
    }
  }
  t.finished = true;
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    if (ci[static_cast<std::size_t>(r)] < rp.compute.size() ||
        (copies && ki[static_cast<std::size_t>(r)] < rp.copy.size()))
      t.finished = false;
  }
  if (!t.finished) return t;
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    RankTimes& rt = t.ranks[static_cast<std::size_t>(r)];
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      rt.busy += duration(costs, rp.compute[x]);
      t.makespan = std::max(t.makespan, rt.compute_end[x]);
    }
    for (double e : rt.copy_end) t.makespan = std::max(t.makespan, e);
    rt.warmup = 0;
    for (const Op& op : rp.compute) {
      if (op.kind == OpKind::B || op.kind == OpKind::BW) break;
      if (op.kind == OpKind::F) ++rt.warmup;
    }
    if (copies) memory_of(rp, costs, rt);
  }
  return t;
}

// ---- 3. planning timeline and P2P plan (build.hpp's header, steps 2 and 4) ----------------

/// Planned start and end of every compute op: on PO's shifted grid slot t runs from t*tau to
/// (t+1)*tau, tau = the mean over stages of (T_F + T_B + T_W)/3 (docs/design.md section 2, g = 1);
/// every other family plans on the compute-only ASAP run of its orders.
struct Plan {
  std::vector<std::vector<double>> start, end;
  std::vector<std::vector<long long>> slot;  // grid slots (PO only)
};

inline Plan plan_of(const ScheduleSpec& spec, const Shape& sh, const Costs& costs) {
  const std::vector<RankOrder> ord = orders(spec, sh);
  Plan pl;
  pl.start.resize(ord.size());
  pl.end.resize(ord.size());
  if (plans_on_grid(spec, sh.d)) {
    double tau = 0;
    for (int s = 0; s < sh.stages(); ++s) tau += costs.F(s) + costs.B(s) + costs.W(s);
    tau /= 3.0 * sh.stages();
    for (std::size_t r = 0; r < ord.size(); ++r) {
      pl.slot.push_back(ord[r].slot);
      for (long long t : ord[r].slot) {
        pl.start[r].push_back(static_cast<double>(t) * tau);
        pl.end[r].push_back(static_cast<double>(t + 1) * tau);
      }
    }
    return pl;
  }
  const Times t = simulate(program_of(spec, sh, costs, ord), costs, Streams::compute_only);
  if (!t.finished) throw std::logic_error("reference: the compute orders cannot run");
  for (std::size_t r = 0; r < ord.size(); ++r) {
    pl.start[r] = t.ranks[r].compute_start;
    pl.end[r] = t.ranks[r].compute_end;
  }
  return pl;
}

/// Every message between two ranks in the order of its producer's planned end, ties broken by
/// (producer stage, microbatch, forward before backward), which names one message: each rank
/// posts its sends and receives in that order. A message into stage s: forward, produced by
/// F(s-1) on rank (s-1) mod d; backward, produced by B or BW(s+1). Its tag is (s, mb, dir).
/// On PO's grid the key is the producer's slot (its end is (slot+1)*tau, increasing with it).
inline std::vector<std::vector<CommOp>> p2p_plan(const ScheduleSpec& spec, const Shape& sh, const Costs& costs) {
  std::vector<std::vector<CommOp>> plan(static_cast<std::size_t>(sh.d));
  if (sh.d == 1) return plan;
  const std::vector<RankOrder> ord = orders(spec, sh);
  const Plan pl = plan_of(spec, sh, costs);
  const bool grid = plans_on_grid(spec, sh.d);
  struct Message {
    double key;
    int producer_stage, mb;
    Dir dir;
  };
  std::vector<Message> all;
  const int S = sh.stages();
  for (std::size_t r = 0; r < ord.size(); ++r)
    for (std::size_t x = 0; x < ord[r].ops.size(); ++x) {
      const Op& op = ord[r].ops[x];
      const double key = grid ? static_cast<double>(pl.slot[r][x]) : pl.end[r][x];
      if (op.kind == OpKind::F && op.stage < S - 1) all.push_back({key, op.stage, op.mb, Dir::forward});
      if ((op.kind == OpKind::B || op.kind == OpKind::BW) && op.stage > 0)
        all.push_back({key, op.stage, op.mb, Dir::backward});
    }
  std::sort(all.begin(), all.end(), [](const Message& a, const Message& b) {
    return std::tuple(a.key, a.producer_stage, a.mb, a.dir == Dir::forward ? 0 : 1) <
           std::tuple(b.key, b.producer_stage, b.mb, b.dir == Dir::forward ? 0 : 1);
  });
  for (const Message& msg : all) {
    const int consumer = msg.dir == Dir::forward ? msg.producer_stage + 1 : msg.producer_stage - 1;
    const int from = sh.rank_of(msg.producer_stage), to = sh.rank_of(consumer);
    plan[static_cast<std::size_t>(from)].push_back(CommOp{true, to, consumer, msg.mb, msg.dir});
    plan[static_cast<std::size_t>(to)].push_back(CommOp{false, from, consumer, msg.mb, msg.dir});
  }
  return plan;
}

/// What any deadlock-free plan of messages satisfies, whatever its tie-breaking ("" if it
/// does): (a) every message between ranks is posted once as a send on its producer's rank
/// (to its consumer's) and once as a receive on its consumer's rank (from its producer's), and
/// nothing else is posted; (b) between each ordered pair of ranks the sends and the receives
/// list the messages in one order; (c) all ranks' lists are restrictions of one global order
/// of the messages (the graph of consecutive entries has no cycle).
inline std::string p2p_properties(const Program& p) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  using Tag = std::tuple<int, int, int>;  // (consumer stage, mb, dir)
  const auto tag = [](const CommOp& c) { return Tag{c.stage, c.mb, c.dir == Dir::forward ? 0 : 1}; };
  std::map<Tag, int> sends, recvs;
  for (int r = 0; r < d; ++r)
    for (const CommOp& c : p.ranks[static_cast<std::size_t>(r)].comm) {
      if (d == 1) return "one rank posts a P2P op";
      const int producer = c.dir == Dir::forward ? c.stage - 1 : c.stage + 1;
      if (c.stage < 0 || c.stage >= S || producer < 0 || producer >= S || c.mb < 0 || c.mb >= sh.m)
        return "rank " + str(r) + " posts a message that does not exist";
      const int from = sh.rank_of(producer), to = sh.rank_of(c.stage);
      if (r != (c.send ? from : to) || c.peer != (c.send ? to : from))
        return "rank " + str(r) + " posts a message between the wrong ranks";
      ++(c.send ? sends : recvs)[tag(c)];
    }
  if (d > 1)
    for (int s = 0; s < S; ++s)
      for (int mb = 0; mb < sh.m; ++mb)
        for (int dir = 0; dir < 2; ++dir) {
          if (dir == 0 ? s == 0 : s == S - 1) continue;
          const Tag t{s, mb, dir};
          if (sends[t] != 1 || recvs[t] != 1)
            return "message into stage " + str(s) + " mb " + str(mb) + (dir == 0 ? " forward" : " backward") +
                   " sent " + str(sends[t]) + "x, received " + str(recvs[t]) + "x";
        }
  // (b) per ordered pair (from, to): the tags of the sends on `from` and of the receives on `to`.
  std::map<std::pair<int, int>, std::vector<Tag>> sent, received;
  for (int r = 0; r < d; ++r)
    for (const CommOp& c : p.ranks[static_cast<std::size_t>(r)].comm)
      (c.send ? sent[{r, c.peer}] : received[{c.peer, r}]).push_back(tag(c));
  for (const auto& [pair, tags] : sent)
    if (received[pair] != tags)
      return "ranks " + str(pair.first) + " -> " + str(pair.second) + " send and receive in different orders";
  // (c) Kahn's algorithm over the messages, an edge from each entry of a rank's list to the next.
  std::map<Tag, std::vector<Tag>> next;
  std::map<Tag, int> indegree;
  for (const auto& [t, n] : sends) indegree[t] = 0;
  for (int r = 0; r < d; ++r) {
    const auto& comm = p.ranks[static_cast<std::size_t>(r)].comm;
    for (std::size_t i = 1; i < comm.size(); ++i) {
      next[tag(comm[i - 1])].push_back(tag(comm[i]));
      ++indegree[tag(comm[i])];
    }
  }
  std::vector<Tag> ready;
  for (const auto& [t, n] : indegree)
    if (n == 0) ready.push_back(t);
  std::size_t placed = 0;
  while (!ready.empty()) {
    const Tag t = ready.back();
    ready.pop_back();
    ++placed;
    for (const Tag& u : next[t])
      if (--indegree[u] == 0) ready.push_back(u);
  }
  if (placed != indegree.size()) return "the ranks' P2P lists order the messages in a cycle";
  return "";
}

// ---- 4. validity: the rules of docs/design.md section 4 ---------------------------------------

/// "" if `p` is a valid program, else the first broken rule found (in this file's words):
///   passes: each (stage, mb) has F, B and W (split families) or F and BW (fused) exactly once,
///     on the rank the stage lives on, F before its backward before its W, nothing else on
///     the compute stream;
///   copies: only O and R, of the rank's own units; each unit offloaded at most once and then
///     reloaded once, the reload after the offload; slots strictly increasing (never
///     double-booked); an offload waits (edge) for its F, a backward for its unit's reload;
///     every edge names an op that exists;
///   P2P plan: exactly the messages between ranks, each posted once as a send by its producer's
///     rank and once as a receive by its consumer's (none with one rank);
///   execution: an untimed run completes every op of every stream, where a compute op needs
///     its inputs (on one rank the producing pass, else the received message), its stream
///     predecessor and its edge; a copy op its predecessor and edge; a send and its receive
///     complete together, only when both are at the heads of their ranks' P2P lists and the
///     producing pass has run (rendezvous; a pair of heads with different tags never
///     completes).
inline std::string check(const Program& p) {
  const Shape& sh = p.shape;
  const int d = sh.d, m = sh.m, S = sh.stages();
  const bool fu = fused(p.spec);
  if (static_cast<int>(p.ranks.size()) != d) return "wrong number of ranks";
  using Unit = std::pair<int, int>;  // (stage, mb)
  // Passes.
  std::map<Unit, int> fpos, bpos, wpos;
  for (int r = 0; r < d; ++r) {
    const auto& comp = p.ranks[static_cast<std::size_t>(r)].compute;
    for (std::size_t x = 0; x < comp.size(); ++x) {
      const Op& op = comp[x];
      if (op.stage < 0 || op.stage >= S || op.mb < 0 || op.mb >= m) return "rank " + str(r) + ": pass out of range";
      if (sh.rank_of(op.stage) != r) return "rank " + str(r) + " runs " + describe(op) + " of another rank";
      std::map<Unit, int>* pos = nullptr;
      if (op.kind == OpKind::F)
        pos = &fpos;
      else if (op.kind == (fu ? OpKind::BW : OpKind::B))
        pos = &bpos;
      else if (op.kind == OpKind::W && !fu)
        pos = &wpos;
      else
        return "rank " + str(r) + ": " + describe(op) + " does not belong on this compute stream";
      if (!pos->emplace(Unit{op.stage, op.mb}, static_cast<int>(x)).second) return describe(op) + " twice";
    }
  }
  for (int s = 0; s < S; ++s)
    for (int mb = 0; mb < m; ++mb) {
      const Unit u{s, mb};
      if (!fpos.count(u) || !bpos.count(u) || (!fu && !wpos.count(u)))
        return "a pass of stage " + str(s) + " mb " + str(mb) + " is missing";
      if (bpos[u] < fpos[u] || (!fu && wpos[u] < bpos[u]))
        return "the passes of stage " + str(s) + " mb " + str(mb) + " are out of order";
    }
  // Copies.
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    if (rp.copy_slot.size() != rp.copy.size()) return "rank " + str(r) + ": copy slots and copy ops differ in number";
    std::map<Unit, int> opos, rpos;
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      const Op& op = rp.copy[y];
      if (op.kind != OpKind::O && op.kind != OpKind::R) return "rank " + str(r) + ": a pass on the copy stream";
      if (op.stage < 0 || op.stage >= S || op.mb < 0 || op.mb >= m || sh.rank_of(op.stage) != r)
        return "rank " + str(r) + ": a copy of another rank's unit";
      if (op.wait >= static_cast<int>(rp.compute.size()))
        return "rank " + str(r) + ": a copy waits for a compute op that does not exist";
      if (y > 0 && rp.copy_slot[y] <= rp.copy_slot[y - 1]) return "rank " + str(r) + ": copy slots not increasing";
      if (!(op.kind == OpKind::O ? opos : rpos).emplace(Unit{op.stage, op.mb}, static_cast<int>(y)).second)
        return "rank " + str(r) + ": " + describe(op) + " twice";
    }
    for (const auto& [u, y] : opos) {
      if (!rpos.count(u)) return "rank " + str(r) + ": an offload without its reload";
      if (rpos[u] < y) return "rank " + str(r) + ": a reload before its offload";
      if (rp.copy[static_cast<std::size_t>(y)].wait < fpos[u])
        return "rank " + str(r) + ": an offload that does not wait for its F";
    }
    for (const auto& [u, y] : rpos)
      if (!opos.count(u)) return "rank " + str(r) + ": a reload without its offload";
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const Op& op = rp.compute[x];
      if (op.wait >= static_cast<int>(rp.copy.size()))
        return "rank " + str(r) + ": a pass waits for a copy op that does not exist";
      const Unit u{op.stage, op.mb};
      if ((op.kind == OpKind::B || op.kind == OpKind::BW) && rpos.count(u) && op.wait < rpos[u])
        return "rank " + str(r) + ": " + describe(op) + " does not wait for its reload";
    }
  }
  // P2P plan.
  using Tag = std::tuple<int, int, int>;  // (consumer stage, mb, dir)
  std::map<Tag, int> sends, recvs;
  for (int r = 0; r < d; ++r)
    for (const CommOp& c : p.ranks[static_cast<std::size_t>(r)].comm) {
      if (d == 1) return "one rank posts a P2P op";
      const int producer = c.dir == Dir::forward ? c.stage - 1 : c.stage + 1;
      if (c.stage < 0 || c.stage >= S || producer < 0 || producer >= S || c.mb < 0 || c.mb >= m)
        return "rank " + str(r) + ": a message that does not exist";
      const int from = sh.rank_of(producer), to = sh.rank_of(c.stage);
      if (r != (c.send ? from : to) || c.peer != (c.send ? to : from))
        return "rank " + str(r) + ": a message between the wrong ranks";
      if (++(c.send ? sends : recvs)[Tag{c.stage, c.mb, c.dir == Dir::forward ? 0 : 1}] > 1)
        return "rank " + str(r) + ": a message posted twice";
    }
  if (d > 1)
    for (int s = 0; s < S; ++s)
      for (int mb = 0; mb < m; ++mb)
        for (int dir = 0; dir < 2; ++dir)
          if (!(dir == 0 ? s == 0 : s == S - 1) && (!sends.count(Tag{s, mb, dir}) || !recvs.count(Tag{s, mb, dir})))
            return "a message into stage " + str(s) + " mb " + str(mb) + " is never sent or never received";
  // Execution.
  std::map<Unit, bool> f_done, b_done, f_msg, b_msg;
  std::vector<std::size_t> ci(static_cast<std::size_t>(d), 0), ki(ci), qi(ci);
  const auto rp_of = [&](int r) -> const po::RankProgram& { return p.ranks[static_cast<std::size_t>(r)]; };
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < d; ++r) {
      const auto& rp = rp_of(r);
      std::size_t& x = ci[static_cast<std::size_t>(r)];
      std::size_t& y = ki[static_cast<std::size_t>(r)];
      std::size_t& q = qi[static_cast<std::size_t>(r)];
      for (bool step = true; step;) {
        step = false;
        if (x < rp.compute.size()) {  // the next pass, if its inputs and its edge are there
          const Op& op = rp.compute[x];
          const Unit u{op.stage, op.mb};
          bool can = op.wait < 0 || y > static_cast<std::size_t>(op.wait);
          if (op.kind == OpKind::F && op.stage > 0) can = can && (d == 1 ? f_done[{op.stage - 1, op.mb}] : f_msg[u]);
          if (op.kind == OpKind::B || op.kind == OpKind::BW)
            can = can && f_done[u] && (op.stage == S - 1 || (d == 1 ? b_done[{op.stage + 1, op.mb}] : b_msg[u]));
          if (op.kind == OpKind::W) can = can && b_done[u];
          if (can) {
            if (op.kind == OpKind::F) f_done[u] = true;
            if (op.kind == OpKind::B || op.kind == OpKind::BW) b_done[u] = true;
            ++x;
            step = true;
          }
        }
        if (y < rp.copy.size()) {  // the next copy, if its edge is met
          const Op& op = rp.copy[y];
          if (op.wait < 0 || x > static_cast<std::size_t>(op.wait)) {
            ++y;
            step = true;
          }
        }
        if (q < rp.comm.size() && rp.comm[q].send) {  // a send completes with its receive
          const CommOp& c = rp.comm[q];
          const auto& other = rp_of(c.peer).comm;
          std::size_t& oq = qi[static_cast<std::size_t>(c.peer)];
          const int producer = c.dir == Dir::forward ? c.stage - 1 : c.stage + 1;
          if (oq < other.size()) {
            const CommOp& o = other[oq];
            if (!o.send && o.peer == r && o.stage == c.stage && o.mb == c.mb && o.dir == c.dir &&
                (c.dir == Dir::forward ? f_done : b_done)[{producer, c.mb}]) {
              (c.dir == Dir::forward ? f_msg : b_msg)[{c.stage, c.mb}] = true;
              ++q;
              ++oq;
              step = true;
            }
          }
        }
        moved = moved || step;
      }
    }
  }
  for (int r = 0; r < d; ++r) {
    const auto& rp = rp_of(r);
    if (ci[static_cast<std::size_t>(r)] < rp.compute.size() || ki[static_cast<std::size_t>(r)] < rp.copy.size() ||
        qi[static_cast<std::size_t>(r)] < rp.comm.size())
      return "the untimed run stops: rank " + str(r) + " cannot finish (deadlock)";
  }
  return "";
}

// ---- 5. offload plans (docs/design.md section 3) ------------------------------------------------

/// The peak of a rank's plan: compute ops at their planned times, copy op y in its slot
/// [slot*T, (slot+1)*T). A release counts before an acquisition up to `eps` later (the
/// builder's tolerance for times that differ only by rounding).
inline double planned_peak(const po::RankProgram& rp, const Costs& costs, const std::vector<double>& ps,
                           const std::vector<double>& pe, double eps) {
  std::vector<std::pair<double, double>> ev;  // (time, change); releases moved eps earlier
  const auto bytes = [&](int stage) { return costs.unit_bytes.empty() ? 1.0 : costs.bytes(stage); };
  for (std::size_t x = 0; x < rp.compute.size(); ++x) {
    const Op& op = rp.compute[x];
    if (op.kind == OpKind::F) ev.push_back({ps[x], bytes(op.stage)});
    if (op.kind == OpKind::W || op.kind == OpKind::BW) ev.push_back({pe[x] - eps, -bytes(op.stage)});
  }
  const double T = rp.slot_length;
  for (std::size_t y = 0; y < rp.copy.size(); ++y) {
    const Op& op = rp.copy[y];
    const double start = static_cast<double>(rp.copy_slot[y]) * T;
    if (op.kind == OpKind::O) ev.push_back({start + T - eps, -bytes(op.stage)});
    if (op.kind == OpKind::R) ev.push_back({start, bytes(op.stage)});
  }
  std::sort(ev.begin(), ev.end());  // at equal times the negative change (release) first
  double alive = 0, peak = 0;
  for (const auto& [t, change] : ev) {
    alive += change;
    peak = std::max(peak, alive);
  }
  return peak;
}

/// What every offload plan of a built program must satisfy ("" if it does), given its
/// planning timeline `pl` (plan_of) and its ASAP executions `runs` (any costs):
///   - copies only of the selected chunks' units; slot_length at least each copy's T_O;
///   - one copy stream alternates: on each rank offloads take the slots of one parity and
///     reloads the other; ranks r and r^1 of a PCIe pair (when staggered) offload in opposite
///     parities, so the pair never copies in one direction at once;
///   - an offload's slot starts after its F ends in the plan, a reload's slot ends before its
///     backward starts, and the unit's gap hides the round trip (2T);
///   - the cross-stream edges keep every execution within the plan's peak.
inline std::string offload_properties(const Program& p, const Plan& pl, const std::vector<const Times*>& runs) {
  const Shape& sh = p.shape;
  const int d = sh.d;
  std::vector<int> o_parity(static_cast<std::size_t>(d), -1);
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    if (rp.copy.empty()) continue;
    const double T = rp.slot_length;
    const auto& ps = pl.start[static_cast<std::size_t>(r)];
    const auto& pe = pl.end[static_cast<std::size_t>(r)];
    double horizon = pe.empty() ? 0.0 : pe.back();
    horizon = std::max(horizon, static_cast<double>(rp.copy_slot.back() + 1) * T);
    const double eps = 1e-9 * std::max(T, horizon);
    std::map<std::pair<int, int>, std::size_t> fx, bx;  // unit -> compute index of F, backward
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const Op& op = rp.compute[x];
      if (op.kind == OpKind::F) fx[{op.stage, op.mb}] = x;
      if (op.kind == OpKind::B || op.kind == OpKind::BW) bx[{op.stage, op.mb}] = x;
    }
    int rpar = -1;
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      const Op& op = rp.copy[y];
      const std::string who = "rank " + str(r) + " " + describe(op);
      if (!chunk_offloaded(p.spec.offload, sh.chunk_of(op.stage), sh.v))
        return who + ": its chunk is not selected for offload";
      if (!(T >= duration(p.costs, op))) return who + ": slot_length " + std::to_string(T) + " is shorter than its T_O";
      const long long slot = rp.copy_slot[y];
      const int parity = static_cast<int>(slot & 1);
      int& mine = op.kind == OpKind::O ? o_parity[static_cast<std::size_t>(r)] : rpar;
      if (mine < 0) mine = parity;
      if (mine != parity) return who + ": its slot " + str(slot) + " has the other parity";
      const std::pair<int, int> u{op.stage, op.mb};
      const double f_end = pe[fx.at(u)], b_start = ps[bx.at(u)];
      if (op.kind == OpKind::O && static_cast<double>(slot) * T + eps < f_end)
        return who + ": slot starts before its F ends in the plan";
      if (op.kind == OpKind::R && static_cast<double>(slot + 1) * T > b_start + eps)
        return who + ": slot ends after its backward starts in the plan";
      if (b_start - f_end + eps < 2 * T) return who + ": its gap cannot hide the round trip";
    }
    if (rpar >= 0 && rpar == o_parity[static_cast<std::size_t>(r)])
      return "rank " + str(r) + ": offloads and reloads share a slot parity";
    const double plan_peak = planned_peak(rp, p.costs, ps, pe, eps);
    for (const Times* t : runs)
      if (t->ranks[static_cast<std::size_t>(r)].peak > plan_peak * (1 + 1e-9) + 1e-12)
        return "rank " + str(r) + ": executes with a peak of " +
               std::to_string(t->ranks[static_cast<std::size_t>(r)].peak) + ", above its plan's " +
               std::to_string(plan_peak);
  }
  if (p.costs.stagger_pairs)
    for (int r = 0; r + 1 < d; r += 2)
      if (o_parity[static_cast<std::size_t>(r)] >= 0 &&
          o_parity[static_cast<std::size_t>(r)] == o_parity[static_cast<std::size_t>(r + 1)])
        return "ranks " + str(r) + " and " + str(r + 1) + " offload in the same slot parity";
  return "";
}

}  // namespace pipeoffload_test::ref
