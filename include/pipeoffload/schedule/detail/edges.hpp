// pipeoffload/schedule/detail/edges.hpp: step 3 of build() on PO's grid: cross-stream edges that keep
// the plan's peak rather than its order, and each PCIe pair's slot parities (place_pair, settle_pair).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../program.hpp"
#include "asap.hpp"
#include "numeric.hpp"
#include "offload_place.hpp"

namespace pipeoffload {

namespace detail {

/// Scratch of cross_stream_edges, copy_lag and settle_pair, kept across the ranks of one
/// build; and each stage's unit bytes and op durations, looked up once per op.
struct SettleScratch {
  struct Release {
    int op;
    double freed;
  };
  std::vector<int> order, ridx;
  std::vector<Release> rel_c, rel_k;
  std::vector<double> ks, ke, ce;
  std::vector<double> bytes;  // [stage]
  std::vector<double> dur;    // [stage * 6 + kind], see duration_table
  struct Kept {
    std::vector<Op> copy;
    std::vector<long long> slot;
    double slot_length = 0;
    std::vector<int> waits;
  };
  Kept kept[2];

  constexpr explicit SettleScratch(const Costs& c, int stages) : dur(duration_table(c, stages)) {
    bytes.resize(static_cast<std::size_t>(stages));
    for (int s = 0; s < stages; ++s) bytes[static_cast<std::size_t>(s)] = c.bytes(s);
  }
};

/// Cross-stream edges of rank r (docs/design.md section 3) that keep every execution within the
/// peak of its plan: start and end of each compute op (ps, pe) and copy op (ks, ke). Take the
/// plan's acquisitions (F and R starts) and releases (W/BW and O ends) in time order, a
/// release first at equal times (`eps` apart). If every release before an acquisition a there
/// also came before a in execution, whatever is alive at a in execution would be alive at a
/// in the plan, so no execution would peak above it. a needs fewer: a unit alive at a in
/// execution is alive at a in the plan or was freed by a release that a does not wait for, so
/// a may skip the latest releases before it whose bytes fit in the plan's peak less what the
/// plan holds just after a. So an F waits for the last O it may not skip (the W before it on
/// its own stream come first anyway), an R for the last W or BW, a backward for its own
/// reload, and no other op waits: only F and R acquire. Linear (the skipped tail of releases
/// is found by a galloping search, a few steps).
constexpr void cross_stream_edges(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe,
                                  const std::vector<double>& ks, const std::vector<double>& ke, double eps,
                                  SettleScratch& ws) {
  const Shape& sh = p.shape;
  auto& rp = p.ranks[static_cast<std::size_t>(r)];
  Op* const comp = rp.compute.data();
  Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  const double* const bytes = ws.bytes.data();
  const double* const cps = ps.data();
  const double* const cpe = pe.data();
  const double* const kps = ks.data();
  const double* const kpe = ke.data();
  // The plan's events in time order (x >= 0: compute op x, ~y: copy op y; B ops, which neither
  // acquire nor release, left out) and its peak: acquisitions may fill it, not exceed it.
  auto& order = ws.order;
  order.resize(nc + nk);
  int* const ord = order.data();
  std::size_t no = 0;
  double alive = 0, peak = 0;
  std::size_t x = 0, y = 0;
  const auto skip_b = [&] {
    while (x < nc && comp[x].kind == OpKind::B) ++x;
  };
  for (skip_b(); x < nc || y < nk;) {
    bool compute_first = y == nk;
    if (x < nc && y < nk) {
      const bool rc = comp[x].kind != OpKind::F, rk = copy[y].kind == OpKind::O;
      const double tc = rc ? cpe[x] : cps[x], tk = rk ? kpe[y] : kps[y];
      compute_first = rc == rk ? tc <= tk : rc ? tc <= tk + eps : tk > tc + eps;
    }
    if (compute_first) {
      const double b = bytes[comp[x].stage];
      alive += comp[x].kind == OpKind::F ? b : -b;
      ord[no++] = static_cast<int>(x++);
      skip_b();
    } else {
      const double b = bytes[copy[y].stage];
      alive += copy[y].kind == OpKind::R ? b : -b;
      ord[no++] = ~static_cast<int>(y++);
    }
    peak = std::max(peak, alive);
  }
  // The releases of each stream so far: releasing op and bytes freed up to it.
  using Release = SettleScratch::Release;
  auto& rel_c = ws.rel_c;
  auto& rel_k = ws.rel_k;
  rel_c.resize(nc + 1);
  rel_k.resize(nk + 1);
  Release* const rc = rel_c.data();
  Release* const rk = rel_k.data();
  std::size_t nrc = 0, nrk = 0;
  const double slack = tolerance(peak);
  // The release of `rel` to wait for (-1: none): the first one after which the rest, the
  // latest, free no more than `room`. Galloping back from the end, as the skipped tail is short.
  const auto wait_for = [&](const Release* rel, std::size_t n, double room) {
    room += slack;
    if (n == 0 || rel[n - 1].freed <= room) return -1;
    const double total = rel[n - 1].freed;
    const auto fits = [&](std::size_t i) { return total - rel[i].freed <= room; };
    std::size_t hi = n - 1, lo = hi, step = 1;  // fits(hi); lo < hi: !fits(lo)
    while (lo > 0) {
      lo = lo > step ? lo - step : 0;
      if (!fits(lo)) break;
      hi = lo;
      step *= 2;
    }
    while (lo + 1 < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      (fits(mid) ? hi : lo) = mid;
    }
    return rel[hi].op;
  };
  // Each unit's reload (chunk * m + mb); s / d without a division.
  const FastDiv by_d(static_cast<std::uint64_t>(sh.d), static_cast<std::uint64_t>(sh.stages()));
  const auto unit_of = [&](const Op& op) {
    return static_cast<std::size_t>(by_d(static_cast<std::uint64_t>(op.stage))) * static_cast<std::size_t>(sh.m) +
           static_cast<std::size_t>(op.mb);
  };
  auto& ridx = ws.ridx;
  ridx.assign(static_cast<std::size_t>(sh.v) * static_cast<std::size_t>(sh.m), -1);
  alive = 0;
  for (std::size_t i = 0; i < no; ++i) {
    const int e = ord[i];
    if (e >= 0) {
      Op& op = comp[e];
      const double b = bytes[op.stage];
      if (op.kind == OpKind::F) {
        alive += b;
        op.wait = wait_for(rk, nrk, peak - alive);
      } else {
        alive -= b;
        rc[nrc] = {e, (nrc == 0 ? 0.0 : rc[nrc - 1].freed) + b};
        ++nrc;
        op.wait = -1;
      }
    } else {
      Op& op = copy[~e];
      const double b = bytes[op.stage];
      if (op.kind == OpKind::R) {
        alive += b;
        op.wait = wait_for(rc, nrc, peak - alive);
        ridx[unit_of(op)] = ~e;
      } else {
        alive -= b;
        rk[nrk] = {~e, (nrk == 0 ? 0.0 : rk[nrk - 1].freed) + b};
        ++nrk;
      }
    }
  }
  for (std::size_t c = 0; c < nc; ++c)
    if (comp[c].kind == OpKind::B || comp[c].kind == OpKind::BW) comp[c].wait = ridx[unit_of(comp[c])];
}

/// How far rank r's compute falls behind `release` (when each compute op starts without
/// offload) once its copy stream and edges are added, the other ranks keeping that timing: an
/// as-soon-as-possible run of the rank's two streams alone. Returns the sum over compute ops of
/// start - release (infinite if the streams cannot finish) and adds their durations to `busy`.
constexpr double copy_lag(const Program& p, int r, const double* release, double& busy, SettleScratch& ws) {
  const auto& rp = p.ranks[static_cast<std::size_t>(r)];
  const Op* const comp = rp.compute.data();
  const Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  ws.ce.resize(nc);
  ws.ke.resize(nk);
  double* const ce = ws.ce.data();
  double* const ke = ws.ke.data();
  const double* const dur = ws.dur.data();
  const auto duration_of = [dur](const Op& op) { return table_duration(dur, op); };
  std::size_t x = 0, y = 0;
  const bool duplex = p.costs.duplex();  // reloads on a stream of their own, after every copy before them
  double cfree = 0, kfree = 0, kfree_r = 0, lag = 0,
         sum = busy;  // sum: kept in a register, not in `busy`, which the stores could alias
  while (x < nc || y < nk) {
    const std::size_t x0 = x, y0 = y;
    for (; x < nc; ++x) {
      const int w = comp[x].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= y) break;
      double t = std::max(cfree, release[x]);
      if (w >= 0) {
        double k = ke[static_cast<std::size_t>(w)];
        const Op& c = copy[w];  // a backward's own reload in parts: it may start before the reload ends
        const bool back = comp[x].kind == OpKind::B || comp[x].kind == OpKind::BW;
        if (back && c.kind == OpKind::R && c.stage == comp[x].stage && c.mb == comp[x].mb)
          k -= p.costs.reload_overlap(c.stage);
        t = std::max(t, k);
      }
      lag += t - release[x];
      const double d = duration_of(comp[x]);
      sum += d;
      cfree = ce[x] = t + d;
    }
    for (; y < nk; ++y) {
      const int w = copy[y].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= x) break;
      const bool second = duplex && copy[y].kind == OpKind::R;
      const double free = second ? std::max(kfree, kfree_r) : kfree;
      const double t = w >= 0 ? std::max(free, ce[static_cast<std::size_t>(w)]) : free;
      const double end = t + duration_of(copy[y]);
      (second ? kfree_r : kfree) = end;
      ke[y] = y > 0 ? std::max(ke[y - 1], end) : end;  // every copy up to y has ended (what a wait needs)
    }
    if (x == x0 && y == y0) {
      busy = sum;
      return 1e308;
    }
  }
  busy = sum;
  return lag;
}

/// The final edges and slot parities of a schedule planned on PO's grid (docs/design.md section 3).
/// Place_offloads' edges replay the plan's order: every release planned before an
/// acquisition stays before it, which keeps the plan's memory. But the grid is much sparser
/// than the execution, where both streams run as soon as they can, so those edges also replay
/// the grid's pauses: compute waits for offloads that a burst of forwards queued up, a reload
/// for a W that runs late, and at k = 1, where the copy stream is as busy as compute, it never
/// catches up. The final edges keep the plan's peak instead of its order (cross_stream_edges).
///
/// Which rank of a PCIe pair (r, r^1) offloads on even slots is free, and it matters: the
/// phase of a slot grid against the compute ops decides whether a reload queues behind an
/// offload whose forward runs later in execution than in the plan. So a pair (a rank, when
/// pairs are not staggered or it has no partner) whose compute falls behind `release`, the
/// execution without offload, by more than 5% of a pass per op on average (copy_lag; a
/// parity that is wrong for a rank keeps it behind by about a pass for good) is placed again
/// with both parities swapped and keeps whichever falls less behind; the even rank on even
/// slots on a tie. Linear: at most two placements and runs per rank.
///
/// place_pair places the offloads of the `n` ranks r0.. of one pair (n = 1: a rank alone)
/// with the slot parities `parities`, and derives their final edges; settle_pair then keeps
/// that placement or the swapped one. `ps[i]`/`pe[i]` are rank r0+i's planned compute start
/// and end times, `release[i]` each of its compute ops' start without offload.
constexpr void place_pair(Program& p, int r0, int n, const std::vector<double>* ps, const std::vector<double>* pe,
                          Parities parities, OffloadScratch& os, SettleScratch& ws) {
  for (int i = 0; i < n; ++i) place_offloads(p, r0 + i, ps[i], pe[i], os, parities, Edges::offloads_only);
  for (int i = 0; i < n; ++i) {
    const RankProgram& rp = p.ranks[static_cast<std::size_t>(r0 + i)];
    if (rp.copy.empty()) continue;
    const double T = rp.slot_length;
    const std::size_t nk = rp.copy.size();
    ws.ks.resize(nk);
    ws.ke.resize(nk);
    double* const ks = ws.ks.data();
    double* const ke = ws.ke.data();
    const long long* const slot = rp.copy_slot.data();
    for (std::size_t y = 0; y < nk; ++y) {
      ks[y] = static_cast<double>(slot[y]) * T;
      ke[y] = ks[y] + T;
    }
    const auto& pend = pe[i];
    const double horizon = std::max(pend.empty() ? 0.0 : pend.back(), ke[nk - 1]);
    cross_stream_edges(p, r0 + i, ps[i], pend, ws.ks, ws.ke, tolerance(std::max(T, horizon)),
                       ws);  // place_offloads' eps
  }
}

/// See place_pair. `plan()` returns the pair's ps and pe (arrays of n vectors), which only a
/// pair that falls behind needs.
template <class Plan>
constexpr void settle_pair(Program& p, int r0, int n, const double* const* release, const Plan& plan,
                           OffloadScratch& os, SettleScratch& ws) {
  // The pair's copy_lag, and the durations of the compute ops of its ranks with offloads.
  const auto lag_of = [&](double& busy) {
    double lag = 0;
    for (int i = 0; i < n; ++i)
      if (!p.ranks[static_cast<std::size_t>(r0 + i)].copy.empty()) lag += copy_lag(p, r0 + i, release[i], busy, ws);
    return lag;
  };
  double busy = 0;
  const double lag = lag_of(busy);
  if (!(lag > 0.05 * busy)) return;  // lag / ops <= 5% of busy / ops, the mean pass
  for (int i = 0; i < n; ++i) {
    RankProgram& rp = p.ranks[static_cast<std::size_t>(r0 + i)];
    auto& k = ws.kept[i];
    k.copy.swap(rp.copy);
    k.slot.swap(rp.copy_slot);
    k.slot_length = rp.slot_length;
    k.waits.resize(rp.compute.size());
    for (std::size_t x = 0; x < rp.compute.size(); ++x) k.waits[x] = rp.compute[x].wait;
    rp.copy.clear();
    rp.copy_slot.clear();
    rp.slot_length = 0;
    for (Op& op : rp.compute) op.wait = -1;
  }
  const auto [ps, pe] = plan();
  place_pair(p, r0, n, ps, pe, Parities::swapped, os, ws);
  double unused = 0;
  if (lag_of(unused) < lag) return;
  for (int i = 0; i < n; ++i) {  // keep the first placement
    RankProgram& rp = p.ranks[static_cast<std::size_t>(r0 + i)];
    auto& k = ws.kept[i];
    rp.copy.swap(k.copy);
    rp.copy_slot.swap(k.slot);
    rp.slot_length = k.slot_length;
    for (std::size_t x = 0; x < rp.compute.size(); ++x) rp.compute[x].wait = k.waits[x];
  }
}

}  // namespace detail
}  // namespace pipeoffload
