// pipeoffload/schedule/detail/asap.hpp: as-soon-as-possible timing of per-rank op orders.
//
// Every stream runs its ops in order; an op starts when its stream is free, its data
// dependency has finished (plus T_comm across ranks) and its cross-stream edge is met. The
// builder uses this for its planning timeline and P2P order, the simulator for its report:
// one timing engine of whole programs, so the plan and the report cannot drift apart. (The
// one other timing loop, copy_lag in edges.hpp, times a single rank's two streams against
// fixed release times to choose a PCIe pair's slot parities; it reports nothing.)
//
// An op's times depend only on the times of the ops it waits for, so any order of evaluation
// that respects the dependencies gives the same numbers. The engine runs one rank's streams
// as far as they go, then parks the rank on the one value it waits for (the end of a pass on
// a neighbouring rank) and wakes it only once that value exists: a visit always makes
// progress, and no rank is polled in vain.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../program.hpp"

namespace pipeoffload::detail {

constexpr double duration(const Costs& c, const Op& op) {
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

constexpr std::string describe(const Op& op) {
  return std::string(op_name(op.kind)) + "(stage " + num(op.stage) + ", mb " + num(op.mb) + ")";
}

/// Per-stage durations of every op kind, indexed [stage * 6 + kind]: one load per op instead
/// of a branch on the cost model's per-stage vectors. Values are computed exactly as
/// duration() computes them.
constexpr std::vector<double> duration_table(const Costs& c, int stages) {
  std::vector<double> t(static_cast<std::size_t>(stages) * 6);
  for (int s = 0; s < stages; ++s)
    for (int k = 0; k < 6; ++k)
      t[static_cast<std::size_t>(s) * 6 + static_cast<std::size_t>(k)] = duration(c, Op{static_cast<OpKind>(k), s, 0});
  return t;
}

/// Duration of `op` from a duration_table.
constexpr double table_duration(const double* table, const Op& op) {
  return table[static_cast<std::size_t>(op.stage) * 6 + static_cast<std::size_t>(op.kind)];
}

/// Where the engine writes one rank's times: arrays parallel to its compute and copy streams
/// (the copy one only when the copy streams are timed), as long as they. Only start times:
/// an op's end is its start plus its duration from duration_table, the very sum the engine
/// makes, so whoever needs the ends (or sums of them) adds them, on as many threads as it
/// likes: after the run, or during it, following `progress`.
struct TimesOut {
  double* compute_start = nullptr;
  double* copy_start = nullptr;
  /// If set: after each visit that timed some of the rank's ops, the numbers of its compute
  /// and copy ops timed so far (progress[0], progress[1]), stored with release order, so that
  /// a thread that loads them with acquire order may read that many start times.
  std::size_t* progress = nullptr;
};

/// End of a unit's F and B (or BW) in an ASAP run, -1 until it ran.
struct UnitEnds {
  double f = -1, b = -1;
};

/// The ASAP run's scratch for `p`: each unit's UnitEnds, microbatch-major, so neighbouring
/// ranks working on the same microbatches touch nearby memory, and side by side, so the
/// lookups of one op (its own unit and the next stage's) share cache lines. Made apart from
/// the run so that a caller can write its pages (megabytes) on another thread meanwhile.
constexpr std::vector<UnitEnds> asap_scratch(const Program& p) {
  return std::vector<UnitEnds>(static_cast<std::size_t>(p.shape.stages()) * static_cast<std::size_t>(p.shape.m));
}

/// ASAP timing of `p` under `costs`, written through `out` (one entry per rank); `dur` is
/// duration_table(costs, stages), `ends` a fresh asap_scratch(p) (the run uses it up). With
/// `WithCopy` false the copy streams and every cross-stream edge are ignored (the
/// compute-only timeline the offload planner starts from). Throws schedule_error if the orders
/// cannot all run (a dependency cycle).
template <bool WithCopy>
constexpr void asap_into(const Program& p, const Costs& costs, const std::vector<double>& dur, TimesOut* out,
                         std::vector<UnitEnds>& ends) {
  const int d = p.shape.d, S = p.shape.stages();
  const auto unit = [S](int s, int mb) {
    return static_cast<std::size_t>(mb) * static_cast<std::size_t>(S) + static_cast<std::size_t>(s);
  };
  // A hop between ranks pays T_comm. Interleaved: stage s - 1 lives on the previous rank of
  // the ring and s + 1 on the next (the same rank when d = 1); V: wherever rank_of says.
  const Shape sh = p.shape;
  const bool vshape = sh.placement == Placement::vshape;
  const double comm = costs.comm;

  // Each rank's state, all a visit touches, side by side.
  struct Lane {
    const Op* comp = nullptr;
    const Op* copy = nullptr;
    double* cs = nullptr;  // the rank's output arrays
    double* ks = nullptr;
    std::size_t* progress = nullptr;
    double* kdone = nullptr;  // per copy op: when it and every copy before it have ended
    std::size_t nc = 0, ci = 0, nk = 0, ki = 0;
    double cfree = 0, kfree = 0, kfree_r = 0;  // kfree_r: the reload stream's, with two copy streams
    const double* need = nullptr;              // parked: the value this rank waits for (nullptr: none can come)
    int on = -1;                               // parked: the rank that produces it
    bool queued = true;
  };
  std::vector<Lane> lanes(static_cast<std::size_t>(d));
  // With two copy streams (Costs::copy_streams) offloads queue on one and reloads on the
  // other, a reload after every copy listed before it; a wait for copy op k is for every copy
  // up to k (kdone). With one stream kdone[k] is copy k's end.
  [[maybe_unused]] const bool duplex = costs.duplex();
  std::vector<double> kdone;
  if constexpr (WithCopy) {
    std::size_t all = 0;
    for (const RankProgram& rp : p.ranks) all += rp.copy.size();
    kdone.resize(all);
  }
  // A B (or BW) whose wait is its own reload, cut into parts (Costs::reload_shares), may start
  // reload_overlap before that reload ends.
  std::vector<double> overlap;
  if constexpr (WithCopy)
    if (!costs.reload_shares.empty()) {
      overlap.resize(static_cast<std::size_t>(S));
      for (int s = 0; s < S; ++s) overlap[static_cast<std::size_t>(s)] = costs.reload_overlap(s);
    }
  std::size_t kbase = 0;
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    Lane& L = lanes[static_cast<std::size_t>(r)];
    const TimesOut& o = out[r];
    L.comp = rp.compute.data();
    L.nc = rp.compute.size();
    L.cs = o.compute_start;
    if (!std::is_constant_evaluated()) L.progress = o.progress;
    if constexpr (WithCopy) {
      L.copy = rp.copy.data();
      L.nk = rp.copy.size();
      L.ks = o.copy_start;
      L.kdone = kdone.data() + kbase;
      kbase += rp.copy.size();
    }
  }
  // A stack of the ranks to visit; each rank is on it at most once.
  std::vector<int> work(static_cast<std::size_t>(d));
  std::size_t top = 0;
  for (int r = d - 1; r >= 0; --r) work[top++] = r;

  while (top > 0) {
    const int r = work[--top];
    const auto ru = static_cast<std::size_t>(r);
    Lane& L = lanes[ru];
    L.queued = false;
    double* const cs = L.cs;
    const Op* const comp = L.comp;
    double* const ks = L.ks;
    const Op* const copy = L.copy;
    const double* const table = dur.data();
    // End of op x of a stream: its start plus its duration, as it was computed.
    const auto end_of = [table](const double* start, const Op* ops, std::size_t x) {
      return start[x] + table_duration(table, ops[x]);
    };
    std::size_t ci = L.ci, ki = L.ki;
    const std::size_t nc = L.nc, nk = L.nk;
    double cfree = L.cfree, kfree = L.kfree, kfree_r = L.kfree_r;
    [[maybe_unused]] double* const kd = L.kdone;
    const double* need = nullptr;
    int on = -1;
    // Each stream runs as far as it can; then the other. Compute goes on only if the copy
    // stream got past the op its head waits for (the copy stream waits only for compute ops,
    // all of which it got past unless the compute head has not run).
    for (;;) {
      need = nullptr;
      on = -1;
      std::size_t copy_wait = ~std::size_t{0};  // the copy op the compute head waits for, if any
      while (ci < nc) {
        const Op& op = comp[ci];
        const OpKind kind = op.kind;
        const int stage = op.stage;
        double ready = cfree;
        const std::size_t self = unit(stage, op.mb);
        // Blocked on a neighbour's pass (need set), or on a pass of this rank that has not
        // run and never will: it comes later in this stream (need unset).
        if (kind == OpKind::F) {
          if (stage > 0) {
            const double* e = &ends[self - 1].f;
            const int from = vshape ? sh.rank_of(stage - 1) : (r == 0 ? d - 1 : r - 1);
            if (*e < 0) {
              need = e;
              on = from != r ? from : -1;
              break;
            }
            ready = std::max(ready, *e + (from != r ? comm : 0.0));
          }
        } else if (kind == OpKind::W) {
          const double e = ends[self].b;
          if (e < 0) break;
          ready = std::max(ready, e);
        } else if (kind == OpKind::B || kind == OpKind::BW) {
          const double e = ends[self].f;
          if (e < 0) break;
          ready = std::max(ready, e);
          if (stage < S - 1) {
            const double* n = &ends[self + 1].b;
            const int from = vshape ? sh.rank_of(stage + 1) : (r + 1 == d ? 0 : r + 1);
            if (*n < 0) {
              need = n;
              on = from != r ? from : -1;
              break;
            }
            ready = std::max(ready, *n + (from != r ? comm : 0.0));
          }
        }
        if constexpr (WithCopy) {
          if (op.wait >= 0) {
            if (ki <= static_cast<std::size_t>(op.wait)) {
              copy_wait = static_cast<std::size_t>(op.wait);
              break;
            }
            double t = kd[op.wait];
            if (!overlap.empty() && (kind == OpKind::B || kind == OpKind::BW)) {
              const Op& c = copy[op.wait];
              if (c.kind == OpKind::R && c.stage == stage && c.mb == op.mb)
                t -= overlap[static_cast<std::size_t>(stage)];
            }
            ready = std::max(ready, t);
          }
        }
        const double end = ready + table_duration(table, op);
        cs[ci] = ready;
        if (kind == OpKind::F)
          ends[self].f = end;
        else if (kind == OpKind::B || kind == OpKind::BW)
          ends[self].b = end;
        cfree = end;
        ++ci;
      }
      if constexpr (WithCopy) {
        while (ki < nk) {
          const Op& op = copy[ki];
          const bool second = duplex && op.kind == OpKind::R;
          double ready = second ? std::max(kfree, kfree_r) : kfree;
          if (op.wait >= 0) {
            if (ci <= static_cast<std::size_t>(op.wait)) break;
            ready = std::max(ready, end_of(cs, comp, static_cast<std::size_t>(op.wait)));
          }
          ks[ki] = ready;
          const double end = ready + table_duration(table, op);
          (second ? kfree_r : kfree) = end;
          kd[ki] = ki > 0 ? std::max(kd[ki - 1], end) : end;
          ++ki;
        }
        if (copy_wait != ~std::size_t{0} && ki > copy_wait) continue;
      }
      break;
    }
    const bool moved = ci != L.ci || ki != L.ki;
    // Ranks take turns every few ops, more streams than the hardware follows: fetch what this
    // rank's next visit will read and write.
    if (!std::is_constant_evaluated()) {
      if (ci + 8 < nc) {
        __builtin_prefetch(comp + ci + 8);
        __builtin_prefetch(cs + ci + 8, 1);
        // The end times the next ops read (a backward's own F ended long ago).
        for (std::size_t j = ci; j < ci + 4; ++j) __builtin_prefetch(ends.data() + unit(comp[j].stage, comp[j].mb));
      }
      if constexpr (WithCopy) {
        if (ki + 8 < nk) {
          __builtin_prefetch(L.copy + ki + 8);
          __builtin_prefetch(L.ks + ki + 8, 1);
        }
      }
    }
    L.ci = ci;
    L.ki = ki;
    if (moved && L.progress != nullptr) {
      std::atomic_ref<std::size_t>(L.progress[0]).store(ci, std::memory_order_release);
      if constexpr (WithCopy) std::atomic_ref<std::size_t>(L.progress[1]).store(ki, std::memory_order_release);
    }
    L.cfree = cfree;
    L.kfree = kfree;
    L.kfree_r = kfree_r;
    // Parked on a neighbour's pass only if that is all the compute head lacks; whatever else
    // it lacks (a pass of its own rank, a copy op that waits for compute) can never come.
    L.need = need;
    L.on = on;
    if (moved && d > 1) {
      // Wake the neighbours that wait for a value this visit produced (on either placement
      // a rank's messages come from ranks r - 1 and r + 1 of the ring).
      for (int nb : {r + 1 == d ? 0 : r + 1, r == 0 ? d - 1 : r - 1}) {
        const auto nu = static_cast<std::size_t>(nb);
        Lane& N = lanes[nu];
        if (!N.queued && N.on == r && *N.need >= 0) {
          N.queued = true;
          work[top++] = nb;
        }
      }
    }
  }
  for (int r = 0; r < d; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    const Lane& L = lanes[ru];
    const auto& rp = p.ranks[ru];
    if (L.ci < L.nc || (WithCopy && L.ki < L.nk)) {
      std::string msg =
          "schedule cannot run: rank " + num(r) + " is stuck at compute op " + num(static_cast<long long>(L.ci));
      if (L.ci < L.nc) msg += " " + describe(rp.compute[L.ci]);
      if (WithCopy && L.ki < L.nk)
        msg += " and copy op " + num(static_cast<long long>(L.ki)) + " " + describe(rp.copy[L.ki]);
      throw schedule_error(msg + " (a dependency cycle between the ranks' orders)");
    }
  }
}

}  // namespace pipeoffload::detail
