// pipeoffload/schedule/detail/v_shape.hpp: step 1 of build() for ZB-V, V-Half and V-Min, the V
// placement's constructions on unit slots: ZB-V's slot-by-slot list schedule (order_zb_v), the
// periodic patterns of V-Half and V-Min and their squeeze (order_v_half, order_v_min), and the
// choice between a construction and greedy.hpp's cost-aware list schedule (order_v_family).
// Their rules: docs/schedules.md, "Zero-bubble families".
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "../program.hpp"
#include "asap.hpp"
#include "greedy.hpp"
#include "numeric.hpp"

namespace pipeoffload::detail {

/// V-Min's periodic pattern (v = 2 on the V placement), its slots into `at` and its orders
/// into p (order_v_min squeezes it where that is faster): every rank repeats, per microbatch, six passes at
/// fixed slots of a period of 6 (F of chunk 0, F of chunk 1, B of chunk 1, B of chunk 0, and the
/// two W passes), microbatch k at the pattern's slots + 6k. The pattern is laid out chain by
/// chain: F0 down the ranks, F1 back up, B1 down, B0 back up, each pass at the first slot after
/// its input whose residue mod 6 is still free on its rank (when 3 divides d, F1's chain starts
/// one slot later: otherwise the turns' residues collide and the pattern stretches); each W at
/// the first free slot after its B. The slots form a valid execution (every dependency at least
/// a slot earlier, no two passes of a rank in one slot); a rank's order is its passes sorted by
/// slot. A unit lives about as long as its microbatch's round trip from its rank and back, so
/// the ranks hold about (4d + 2) / 6 microbatches' worth: a third of 1F1B's bytes, plus the
/// pattern's gaps (peak 2*floor((d+1)/3) + 2 units).
constexpr void v_min_pattern(Program& p, std::vector<std::array<long long, 6>>& at) {
  const Shape sh = p.shape;
  const int d = sh.d, m = sh.m;
  at.assign(static_cast<std::size_t>(d), std::array<long long, 6>{});  // F0 F1 B1 B0 W1 W0
  std::vector<std::array<bool, 6>> used(static_cast<std::size_t>(d), std::array<bool, 6>{});
  // Puts pass `kind` of rank r at the first slot from `from` whose residue is free there.
  const auto place = [&](int r, int kind, long long from) {
    auto& u = used[static_cast<std::size_t>(r)];
    long long t = from;
    while (u[static_cast<std::size_t>(t % 6)]) ++t;
    u[static_cast<std::size_t>(t % 6)] = true;
    at[static_cast<std::size_t>(r)][static_cast<std::size_t>(kind)] = t;
  };
  const auto slot = [&](int r, int kind) { return at[static_cast<std::size_t>(r)][static_cast<std::size_t>(kind)]; };
  const int turn = d % 3 == 0 ? 1 : 0;
  for (int r = 0; r < d; ++r) place(r, 0, r == 0 ? 0 : slot(r - 1, 0) + 1);
  for (int r = d - 1; r >= 0; --r) place(r, 1, (r == d - 1 ? slot(r, 0) + turn : slot(r + 1, 1)) + 1);
  for (int r = 0; r < d; ++r) place(r, 2, (r == 0 ? slot(r, 1) : slot(r - 1, 2)) + 1);
  for (int r = d - 1; r >= 0; --r) place(r, 3, (r == d - 1 ? slot(r, 2) : slot(r + 1, 3)) + 1);
  for (int r = 0; r < d; ++r) {
    place(r, 4, slot(r, 2) + 1);
    place(r, 5, slot(r, 3) + 1);
  }
  for (int r = 0; r < d; ++r) {
    std::vector<std::pair<long long, Op>> all;
    all.reserve(6 * static_cast<std::size_t>(m));
    const auto& a = at[static_cast<std::size_t>(r)];
    const int s0 = sh.stage_of(r, 0), s1 = sh.stage_of(r, 1);
    for (int k = 0; k < m; ++k) {
      const long long o = 6LL * k;
      all.push_back({a[0] + o, Op{OpKind::F, s0, k}});
      all.push_back({a[1] + o, Op{OpKind::F, s1, k}});
      all.push_back({a[2] + o, Op{OpKind::B, s1, k}});
      all.push_back({a[3] + o, Op{OpKind::B, s0, k}});
      all.push_back({a[4] + o, Op{OpKind::W, s1, k}});
      all.push_back({a[5] + o, Op{OpKind::W, s0, k}});
    }
    std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
    for (const auto& e : all) ops.push_back(e.second);
  }
}

/// Clears every rank's compute order (a construction that did not finish hands over to
/// order_greedy).
constexpr void clear_orders(Program& p) {
  for (auto& rp : p.ranks) rp.compute.clear();
}

/// ZB-V's orders (v = 2 on the V placement, cap 2d units), built on a grid of unit slots
/// (T_F = T_B = T_W = 1, no hop time), whatever the costs: the orders are a valid execution
/// there, so their ASAP run under any costs finishes. At each slot every rank starts the first
/// of:
///   1. a ready chunk-0 F, if two units are free (its own and its chunk-1 F's) and the rank is
///      fewer than 2(d - r) - 1 microbatches ahead in chunk 0 of chunk 1;
///   2. a ready chunk-1 F, if a unit is free;
///   3. a ready B: the lowest microbatch, then the higher stage (chunk 1);
///   4. its oldest pending W.
/// Forwards first, within the memory: rank r's first chunk-1 forward arrives 2(d - r) - 1
/// slots after its first chunk-0 forward (d - 1 - r ranks down, d - r back up), so the limit
/// fills the warmup with forwards and no more; once the rank holds its cap, a new microbatch
/// waits for W passes, which run in the slots no F or B can use. Under unit costs this reaches
/// the lower bound 6m + d - 1 (the last rank starts at d - 1 and has 6m passes) whenever d
/// divides m (so on the whole grid of bench/RESULTS.md). Returns false, leaving the orders
/// empty, if a slot passes with every rank idle and passes left (never for d 1..12, m 1..48).
constexpr bool order_zb_v(Program& p) {
  const Shape sh = p.shape;
  const int d = sh.d, m = sh.m, S = sh.stages();
  const auto unit = [m](int s, int mb) { return static_cast<std::size_t>(s) * static_cast<std::size_t>(m) + mb; };
  constexpr long long never = -1;
  std::vector<long long> fend(static_cast<std::size_t>(S) * static_cast<std::size_t>(m), never), bend(fend);
  const auto done = [](long long e, long long t) { return e != never && e <= t; };
  struct Rank {
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::vector<Op> pending_w;
    std::size_t w_head = 0;
    int held = 0;
  };
  std::vector<Rank> rk(static_cast<std::size_t>(d));
  for (auto& rp : p.ranks) rp.compute.reserve(6 * static_cast<std::size_t>(m));
  const int cap = greedy_cap(Family::zb_v, d);
  std::size_t left = 6 * static_cast<std::size_t>(d) * static_cast<std::size_t>(m);
  // Slot t: every rank is idle (its last pass ended by t); passes started in this slot end at
  // t + 1, so the ranks' choices do not depend on the order they are visited in.
  for (long long t = 0; left > 0; ++t) {
    std::size_t placed = 0;
    for (int r = 0; r < d; ++r) {
      Rank& R = rk[static_cast<std::size_t>(r)];
      auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
      Op pick{};
      bool found = false;
      const auto ready_f = [&](int c) {
        const int mb = R.next_f[c];
        if (mb >= m) return false;
        const int s = sh.stage_of(r, c);
        return s == 0 || done(fend[unit(s - 1, mb)], t);
      };
      if (ready_f(0) && R.held + 2 <= cap && R.next_f[0] - R.next_f[1] < 2 * (d - r) - 1) {
        pick = Op{OpKind::F, sh.stage_of(r, 0), R.next_f[0]};  // 1. a chunk-0 F
        found = true;
      }
      if (!found && ready_f(1) && R.held + 1 <= cap) {  // 2. a chunk-1 F
        pick = Op{OpKind::F, sh.stage_of(r, 1), R.next_f[1]};
        found = true;
      }
      if (!found)
        for (int c = 1; c >= 0; --c) {  // 3. a ready B: the lowest microbatch, chunk 1 on a tie
          const int mb = R.next_b[c];
          if (mb >= m || (found && mb >= pick.mb)) continue;
          const int s = sh.stage_of(r, c);
          if (!done(fend[unit(s, mb)], t) || (s < S - 1 && !done(bend[unit(s + 1, mb)], t))) continue;
          pick = Op{OpKind::B, s, mb};
          found = true;
        }
      if (!found && R.w_head < R.pending_w.size()) {  // 4. the oldest W
        pick = R.pending_w[R.w_head++];
        found = true;
      }
      if (!found) continue;
      const int c = sh.chunk_of(pick.stage);
      if (pick.kind == OpKind::F) {
        fend[unit(pick.stage, pick.mb)] = t + 1;
        ++R.next_f[c];
        ++R.held;
      } else if (pick.kind == OpKind::B) {
        bend[unit(pick.stage, pick.mb)] = t + 1;
        ++R.next_b[c];
        R.pending_w.push_back(Op{OpKind::W, pick.stage, pick.mb});
      } else {
        --R.held;
      }
      ops.push_back(pick);
      ++placed;
    }
    if (placed == 0) {  // every rank idle, nothing running: no slot will change that
      clear_orders(p);
      return false;
    }
    left -= placed;
  }
  return true;
}

/// Steps 2 and 3 of order_v_half for a periodic pattern on the V placement: `at[r]` holds the
/// slots of rank r's F0, F1, B1, B0, W1, W0 of microbatch 0 (microbatch k at + 6k), a valid
/// execution on unit slots. Squeezes it (each pass to the earliest free slot of its rank after
/// its moved dependencies, a forward only where the units held stay within `cap`), then keeps
/// each rank's F and B passes in that order and runs its W passes in the gaps (an F only while
/// a unit is free). Fills p's compute orders; returns false, leaving them empty, if a slot
/// passes with every rank idle and passes left.
constexpr bool squeeze_v_pattern(Program& p, const std::vector<std::array<long long, 6>>& at, int cap) {
  const Shape sh = p.shape;
  const int d = sh.d, m = sh.m, S = sh.stages();
  // 2. Squeeze. Passes in slot order (slot, rank, kind, microbatch).
  struct Pass {
    long long slot;
    int r, kind, mb;
  };
  std::vector<Pass> all;
  all.reserve(6 * static_cast<std::size_t>(d) * static_cast<std::size_t>(m));
  long long top = 0;
  for (int r = 0; r < d; ++r)
    for (int mb = 0; mb < m; ++mb)
      for (int k = 0; k < 6; ++k) {
        all.push_back({at[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)] + 6LL * mb, r, k, mb});
        top = std::max(top, all.back().slot);
      }
  std::sort(all.begin(), all.end(), [](const Pass& x, const Pass& y) {
    if (x.slot != y.slot) return x.slot < y.slot;
    if (x.r != y.r) return x.r < y.r;
    return x.kind < y.kind;
  });
  const auto T = static_cast<std::size_t>(top + 2);
  const auto unit = [m](int s, int mb) { return static_cast<std::size_t>(s) * static_cast<std::size_t>(m) + mb; };
  std::vector<std::vector<char>> occ(static_cast<std::size_t>(d), std::vector<char>(T, 0));
  std::vector<std::vector<int>> held(static_cast<std::size_t>(d), std::vector<int>(T + 1, 0));  // units held in slot t
  for (const Pass& x : all) {
    const auto r = static_cast<std::size_t>(x.r);
    occ[r][static_cast<std::size_t>(x.slot)] = 1;
    if (x.kind < 2) ++held[r][static_cast<std::size_t>(x.slot)];       // from its F's start
    if (x.kind >= 4) --held[r][static_cast<std::size_t>(x.slot) + 1];  // to its W's end
  }
  for (auto& h : held)
    for (std::size_t t = 1; t < h.size(); ++t) h[t] += h[t - 1];
  constexpr int chunk_of_kind[6] = {0, 1, 1, 0, 1, 0};
  std::vector<long long> fat(static_cast<std::size_t>(S) * static_cast<std::size_t>(m)), bat(fat);
  std::vector<std::vector<std::pair<long long, Op>>> fb(static_cast<std::size_t>(d));  // squeezed F and B
  for (auto& v : fb) v.reserve(4 * static_cast<std::size_t>(m));
  for (const Pass& x : all) {
    const auto r = static_cast<std::size_t>(x.r);
    const int s = sh.stage_of(x.r, chunk_of_kind[x.kind]);
    long long dep = -1;
    if (x.kind < 2) {
      if (s > 0) dep = fat[unit(s - 1, x.mb)];
    } else if (x.kind < 4) {
      dep = fat[unit(s, x.mb)];
      if (s < S - 1) dep = std::max(dep, bat[unit(s + 1, x.mb)]);
    } else {
      dep = bat[unit(s, x.mb)];
    }
    // The earliest free slot in (dep, x.slot); for an F, one where the units held from there
    // up to its slot stay below the cap (scanned down from the slot, keeping their maximum).
    long long to = x.slot;
    int most = 0;
    for (long long t = x.slot - 1; t > dep; --t) {
      const auto ut = static_cast<std::size_t>(t);
      most = std::max(most, held[r][ut]);
      if (x.kind < 2 && most + 1 > cap) break;
      if (!occ[r][ut]) to = t;
    }
    if (to != x.slot) {
      occ[r][static_cast<std::size_t>(x.slot)] = 0;
      occ[r][static_cast<std::size_t>(to)] = 1;
      if (x.kind < 2)
        for (long long t = to; t < x.slot; ++t) ++held[r][static_cast<std::size_t>(t)];
      if (x.kind >= 4)
        for (long long t = to + 1; t <= x.slot; ++t) --held[r][static_cast<std::size_t>(t)];
    }
    if (x.kind < 2) {
      fat[unit(s, x.mb)] = to;
      fb[r].push_back({to, Op{OpKind::F, s, x.mb}});
    } else if (x.kind < 4) {
      bat[unit(s, x.mb)] = to;
      fb[r].push_back({to, Op{OpKind::B, s, x.mb}});
    }
  }
  // 3. The F and B passes in squeezed order, W passes in the gaps.
  for (auto& v : fb) std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  constexpr long long never = -1;
  std::fill(fat.begin(), fat.end(), never);
  std::fill(bat.begin(), bat.end(), never);
  const auto done = [](long long end, long long t) { return end != never && end <= t; };
  std::vector<std::size_t> next(static_cast<std::size_t>(d), 0), w_head(next);
  std::vector<std::vector<Op>> pending(static_cast<std::size_t>(d));
  std::vector<int> units(static_cast<std::size_t>(d), 0);
  for (auto& rp : p.ranks) rp.compute.reserve(6 * static_cast<std::size_t>(m));
  std::size_t left = 6 * static_cast<std::size_t>(d) * static_cast<std::size_t>(m);
  for (long long t = 0; left > 0; ++t) {  // every rank idle at slot t (see order_zb_v)
    std::size_t placed = 0;
    for (int r = 0; r < d; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      Op pick{};
      bool found = false;
      if (next[ru] < fb[ru].size()) {
        const Op o = fb[ru][next[ru]].second;
        const bool ready =
            o.kind == OpKind::F
                ? (o.stage == 0 || done(fat[unit(o.stage - 1, o.mb)], t)) && units[ru] + 1 <= cap
                : done(fat[unit(o.stage, o.mb)], t) && (o.stage == S - 1 || done(bat[unit(o.stage + 1, o.mb)], t));
        if (ready) {
          pick = o;
          found = true;
          ++next[ru];
        }
      }
      if (!found && w_head[ru] < pending[ru].size()) {
        pick = pending[ru][w_head[ru]++];
        found = true;
      }
      if (!found) continue;
      if (pick.kind == OpKind::F) {
        fat[unit(pick.stage, pick.mb)] = t + 1;
        ++units[ru];
      } else if (pick.kind == OpKind::B) {
        bat[unit(pick.stage, pick.mb)] = t + 1;
        pending[ru].push_back(Op{OpKind::W, pick.stage, pick.mb});
      } else {
        --units[ru];
      }
      p.ranks[ru].compute.push_back(pick);
      ++placed;
    }
    if (placed == 0) {
      clear_orders(p);
      return false;
    }
    left -= placed;
  }
  return true;
}

/// V-Half's orders (v = 2 on the V placement, cap d + 2 units, d + 1 for odd d), whatever the
/// costs (built on unit slots, as ZB-V's), in three steps:
///   1. A periodic pattern: microbatch k's passes on rank r at fixed slots + 6k. The chunk-0
///      forwards go down the ranks two slots apart (slot 2r), the chunk-1 forwards come back
///      up one slot apart (3d - 2 - r), the chunk-1 backwards go down two apart from the turn
///      at rank 0 (3d - 1 + e + 2r) and the chunk-0 backwards come back up one apart
///      (6d - 2 + e - r); e = 3 for even d, else 0. Those four slots differ mod 6 on every
///      rank (their differences are 3r + a small odd or even constant, and 3r is 0 or 3 mod
///      6: e moves the backwards off the forwards' residues where the parity of d would put
///      them on them); each W takes the first residue still free after its B. Each pass has a
///      dependency-free slot: this is the steady state of the V-Half building block of Qi et
///      al., "Pipeline Parallelism with Controllable Memory" (the units a rank holds are
///      about half of 1F1B's bytes, d + 2 - d % 2 at most).
///   2. Squeeze: in slot order, each pass moves to the earliest slot of its rank that is free,
///      after its dependencies (as moved), and, for a forward, where the rank's units held up
///      to its slot stay within the cap. This fills the warmup and the drain, where the
///      pattern leaves slots empty.
///   3. Each rank keeps the F and B passes in the squeezed order and runs its W passes in
///      the gaps, on unit slots: at each slot its next F or B if its inputs are there (an F
///      only if a unit is free), else its oldest pending W.
/// Returns false, leaving the orders empty, if step 3 finds every rank idle with passes left
/// (never for d 1..12, m 1..48).
constexpr bool order_v_half(Program& p) {
  const int d = p.shape.d;
  const int cap = greedy_cap(Family::v_half, d);
  // 1. The pattern: slot of F0 F1 B1 B0 W1 W0 of microbatch 0 per rank.
  const long long e = d % 2 == 0 ? 3 : 0;
  std::vector<std::array<long long, 6>> at(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) {
    auto& a = at[static_cast<std::size_t>(r)];
    a[0] = 2LL * r;
    a[1] = 3LL * d - 2 - r;
    a[2] = 3LL * d - 1 + e + 2LL * r;
    a[3] = 6LL * d - 2 + e - r;
    std::array<bool, 6> used{};
    for (int k = 0; k < 4; ++k) used[static_cast<std::size_t>(a[static_cast<std::size_t>(k)] % 6)] = true;
    for (int k = 4; k < 6; ++k) {
      long long t = a[static_cast<std::size_t>(k - 2)] + 1;  // W1 after B1, W0 after B0
      while (used[static_cast<std::size_t>(t % 6)]) ++t;
      used[static_cast<std::size_t>(t % 6)] = true;
      a[static_cast<std::size_t>(k)] = t;
    }
  }
  return squeeze_v_pattern(p, at, cap);
}

/// Makespan of the ASAP run of p's compute orders under `costs` (copy streams ignored).
constexpr double compute_makespan(const Program& p, const Costs& costs) {
  const std::vector<double> dur = duration_table(costs, p.shape.stages());
  std::vector<std::vector<double>> starts(p.ranks.size());
  std::vector<TimesOut> out(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    starts[r].resize(p.ranks[r].compute.size());
    out[r].compute_start = starts[r].data();
  }
  std::vector<UnitEnds> ends = asap_scratch(p);
  asap_into<false>(p, costs, dur, out.data(), ends);
  double span = 0;
  for (std::size_t r = 0; r < p.ranks.size(); ++r)
    if (!starts[r].empty())
      span = std::max(span, starts[r].back() + table_duration(dur.data(), p.ranks[r].compute.back()));
  return span;
}

/// ZB-V's or V-Half's orders (`f`): the family's construction (order_zb_v, order_v_half, on
/// unit slots) or the list schedule of order_greedy under `costs` with the family's cap,
/// whichever's ASAP run under `costs` ends first, the construction on a tie (within 1e-9);
/// the list schedule alone if the construction does not finish. Both keep the cap. Under
/// unit costs the construction wins on the grid of bench/RESULTS.md; under other costs (an
/// LM head's stage slower than the rest, hops that take time) the list schedule, which
/// follows the costs, may.
constexpr void order_v_family(Program& p, const Costs& costs, Family f) {
  const int cap = greedy_cap(f, p.shape.d);
  if (!(f == Family::zb_v ? order_zb_v(p) : order_v_half(p))) {
    order_greedy(p, costs, cap);
    return;
  }
  const double span = compute_makespan(p, costs);
  std::vector<std::vector<Op>> kept(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) kept[r].swap(p.ranks[r].compute);
  order_greedy(p, costs, cap);
  if (compute_makespan(p, costs) < span - tolerance(span)) return;
  for (std::size_t r = 0; r < p.ranks.size(); ++r) p.ranks[r].compute.swap(kept[r]);
}

/// V-Min's orders: its periodic pattern (v_min_pattern), squeezed as V-Half's is
/// (squeeze_v_pattern, within the pattern's own peak 2*floor((d+1)/3) + 2 units) where that
/// runs faster under unit costs: the squeeze fills the warmup and drain the pattern leaves
/// empty (d = 6: 2 units shorter, the authors' figure). The orders do not depend on the costs.
constexpr void order_v_min(Program& p) {
  std::vector<std::array<long long, 6>> at;
  v_min_pattern(p, at);
  const Costs unit_costs{};
  const double plain = compute_makespan(p, unit_costs);
  std::vector<std::vector<Op>> kept(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) kept[r].swap(p.ranks[r].compute);
  if (squeeze_v_pattern(p, at, greedy_cap(Family::v_min, p.shape.d)) &&
      compute_makespan(p, unit_costs) < plain - tolerance(plain))
    return;
  for (std::size_t r = 0; r < p.ranks.size(); ++r) p.ranks[r].compute.swap(kept[r]);
}

}  // namespace pipeoffload::detail
