// pipeoffload/schedule/detail/offload_place.hpp: step 3 of build(): one rank's offloads and reloads placed on
// its copy-slot grid, longest lifespan first (docs/design.md section 3), with edges that replay the plan's order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../program.hpp"
#include "asap.hpp"
#include "numeric.hpp"

namespace pipeoffload {

/// Most copy slots one rank's offload plan may span (the plan keeps a few bytes per slot).
inline constexpr long long max_copy_slots = 1LL << 26;

namespace detail {

/// Scratch of place_offloads, kept across the ranks of one build so that each rank reuses
/// the memory of the one before.
struct OffloadScratch {
  std::vector<int> fidx, bidx, forder, border, nf, nb, ridx, owner;
  std::vector<long long> oslot, rslot;
  std::vector<double> gaps;
  std::vector<char> want;
  std::vector<std::pair<double, int>> life;
  std::vector<int> chunks;
};

/// Which copy slots a rank's offloads take: the parity its place in its PCIe pair gives
/// (even slots for the even rank of a staggered pair), or the other one (settle_pair tries it).
enum class Parities : bool { planned, swapped };

/// Which cross-stream edges place_offloads derives: all of them, replaying the plan's order
/// (every family but PO), or only each offload's wait for its forward (PO's grid, whose other
/// edges place_pair derives to keep the plan's peak instead, cross_stream_edges).
enum class Edges : bool { replay_plan, offloads_only };

/// Places one rank's offloads and reloads on its copy-slot grid and derives the cross-stream
/// edges that `edges` names. `ps`/`pe` are the planned start/end of each compute op; `ws`
/// keeps its memory from one rank to the next.
constexpr void place_offloads(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe,
                              OffloadScratch& ws, Parities parities = Parities::planned,
                              Edges edges = Edges::replay_plan) {
  const Shape& sh = p.shape;
  auto& rp = p.ranks[static_cast<std::size_t>(r)];
  const int m = sh.m, v = sh.v, d = sh.d;
  const std::size_t units = static_cast<std::size_t>(v) * static_cast<std::size_t>(m);
  const Op* const comp = rp.compute.data();
  const int nc = static_cast<int>(rp.compute.size());
  // Each op's chunk (its stage is chunk * d + r), s / d without a division, and its unit
  // (chunk * m + mb).
  const FastDiv by_d(static_cast<std::uint64_t>(d), static_cast<std::uint64_t>(sh.stages()));
  const auto chunk_of = [by_d](const Op& op) {
    return static_cast<std::size_t>(by_d(static_cast<std::uint64_t>(op.stage)));
  };
  const auto unit_of = [&](const Op& op) {
    return chunk_of(op) * static_cast<std::size_t>(m) + static_cast<std::size_t>(op.mb);
  };
  // Index of each unit's forward and backward (B or BW) in the compute order, and each
  // chunk's microbatches in the order of their forwards and of their backwards.
  auto& fidx = ws.fidx;
  auto& bidx = ws.bidx;
  auto& forder = ws.forder;
  auto& border = ws.border;
  auto& nf = ws.nf;
  auto& nb = ws.nb;
  fidx.assign(units, -1);
  bidx.assign(units, -1);
  forder.resize(units);
  border.resize(units);
  nf.assign(static_cast<std::size_t>(v), 0);
  nb.assign(static_cast<std::size_t>(v), 0);
  for (int x = 0; x < nc; ++x) {
    const Op& op = comp[x];
    const std::size_t c = chunk_of(op), u = c * static_cast<std::size_t>(m) + static_cast<std::size_t>(op.mb);
    if (op.kind == OpKind::F) {
      fidx[u] = x;
      forder[c * static_cast<std::size_t>(m) + static_cast<std::size_t>(nf[c]++)] = op.mb;
    } else if (op.kind == OpKind::B || op.kind == OpKind::BW) {
      bidx[u] = x;
      border[c * static_cast<std::size_t>(m) + static_cast<std::size_t>(nb[c]++)] = op.mb;
    }
  }
  const double horizon = pe.empty() ? 0.0 : pe.back();
  // Each unit's gap between the end of its F and the start of its backward.
  auto& gaps = ws.gaps;
  gaps.resize(units);
  for (std::size_t u = 0; u < units; ++u)
    gaps[u] = ps[static_cast<std::size_t>(bidx[u])] - pe[static_cast<std::size_t>(fidx[u])];
  const auto gap = [&](int c, int mb) { return gaps[static_cast<std::size_t>(c * m + mb)]; };
  // The selected chunks that have at least one unit whose gap can hide its own round trip;
  // the others stay on the device and must not stretch the slots (an LM-head chunk's long
  // copies would otherwise slow every other chunk's).
  auto& chunks = ws.chunks;
  chunks.clear();
  double T = 0;
  for (int c = 0; c < v; ++c) {
    if (!offload::offloaded(p.spec.offload, c, v)) continue;
    const double t_o = p.costs.T_O(sh.stage_of(r, c));
    for (int mb = 0; mb < m; ++mb)
      if (gap(c, mb) + tolerance(std::max(t_o, horizon)) >= 2 * t_o) {
        chunks.push_back(c);
        T = std::max(T, t_o);
        break;
      }
  }
  if (chunks.empty()) return;
  rp.slot_length = T;
  // Slots cover the planning timeline; a T_O tiny against it would need an absurd grid.
  if (horizon / T > static_cast<double>(max_copy_slots))
    throw shape_error("costs: T_O = k(T_F+T_B+T_W)/2 is too small for this schedule: its copy-slot grid would need " +
                      num(static_cast<long long>(horizon / T + 0.5)) + " slots, at most " + num(max_copy_slots) +
                      " are allowed; raise k (or T_O) at least " +
                      num(static_cast<long long>(horizon / T / max_copy_slots) + 1) + "-fold");
  const double eps = tolerance(std::max(T, horizon));
  // Slot n = [nT, (n+1)T). Offload slots have parity `po`; the odd rank of a PCIe pair
  // (r, r^1) takes the other parity, so the pair never copies in one direction at once.
  const long long po = ((p.costs.stagger_pairs && (r & 1) == 1) ? 1 : 0) ^ (parities == Parities::swapped ? 1 : 0);
  // With two copy streams a rank without a PCIe partner offloads and reloads in any slot, both
  // in one slot at once (a partner's copies already fill the other direction's slots). Slot n
  // then has two places, its reload's (key 2n) and its offload's (2n + 1), so the copy list
  // has a slot's reload before its offload; with one stream a slot has one place (key n).
  const bool free_slots = p.costs.duplex() && !(p.costs.stagger_pairs && (r ^ 1) < d);
  const long long step = free_slots ? 1 : 2;  // from one slot a copy may take to the next
  const auto key = [free_slots](long long n, bool reload) { return free_slots ? 2 * n + (reload ? 0 : 1) : n; };

  // Longest lifespan (forward end to backward start) first; chunk 0 wins ties.
  auto& life = ws.life;
  life.clear();
  for (int c : chunks) {
    double sum = 0;
    for (int mb = 0; mb < m; ++mb) sum += gap(c, mb);
    life.push_back({-sum, c});
  }
  std::sort(life.begin(), life.end());

  // The unit in each copy slot (2u: its offload, 2u+1: its reload), -1 if the slot is free.
  auto& owner = ws.owner;
  owner.clear();
  const auto is_used = [&](long long n) {
    return n >= 0 && n < static_cast<long long>(owner.size()) && owner[static_cast<std::size_t>(n)] >= 0;
  };
  const auto mark = [&](long long n, int val) {
    if (n >= static_cast<long long>(owner.size())) owner.resize(static_cast<std::size_t>(n + 1) * 2, -1);
    owner[static_cast<std::size_t>(n)] = val;
  };
  auto& oslot = ws.oslot;
  auto& rslot = ws.rslot;
  auto& want = ws.want;
  oslot.assign(units, -1);
  rslot.assign(units, -1);
  want.assign(units, 0);
  for (const auto& [neg, c] : life) {
    const auto uc = static_cast<std::size_t>(c);
    const int* const fo = forder.data() + uc * static_cast<std::size_t>(m);
    const int* const bo = border.data() + uc * static_cast<std::size_t>(m);
    // A unit whose gap cannot hide the round trip stays on the device.
    for (int mb = 0; mb < m; ++mb) want[static_cast<std::size_t>(c * m + mb)] = gap(c, mb) + eps >= 2 * T;
    // Offloads left to right: the earliest free offload slot starting at or after F ends.
    for (int k = 0; k < nf[uc]; ++k) {
      const auto u = static_cast<std::size_t>(c * m + fo[k]);
      if (!want[u]) continue;
      const double fe = pe[static_cast<std::size_t>(fidx[u])];
      long long n = std::max(0LL, static_cast<long long>((fe - eps) / T));
      while (static_cast<double>(n) * T + eps < fe) ++n;
      if (!free_slots && (n & 1) != po) ++n;
      while (is_used(key(n, false))) n += step;
      oslot[u] = n;
      mark(key(n, false), static_cast<int>(2 * u));
    }
    // Reloads right to left: the latest free reload slot that ends before B starts.
    for (int k = nb[uc] - 1; k >= 0; --k) {
      const auto u = static_cast<std::size_t>(c * m + bo[k]);
      if (!want[u]) continue;
      const double bs = ps[static_cast<std::size_t>(bidx[u])];
      long long n = static_cast<long long>((bs + eps) / T) - 1;
      while (n >= 0 && (n + 1) * T > bs + eps) --n;
      if (!free_slots && n >= 0 && (n & 1) == po) --n;
      while (n > oslot[u] && is_used(key(n, true))) n -= step;
      if (n > oslot[u]) {
        rslot[u] = n;
        mark(key(n, true), static_cast<int>(2 * u + 1));
      } else {
        mark(key(oslot[u], false), -1);  // no reload slot after the offload: keep this unit on the device
        oslot[u] = -1;
      }
    }
  }

  // The copy stream in slot order, and the cross-stream edges. A compute op waits for every
  // offload that ends before it starts in the plan (so a release planned earlier also
  // happens earlier); a reload waits for every compute op that ends before it starts there;
  // a backward waits for its own reload.
  std::size_t ncopy = 0;
  for (std::size_t u = 0; u < units; ++u) ncopy += oslot[u] >= 0 ? 2 : 0;
  rp.copy.reserve(ncopy);
  rp.copy_slot.reserve(ncopy);
  auto& ridx = ws.ridx;
  const bool all_edges = edges == Edges::replay_plan;
  if (all_edges) ridx.assign(units, -1);
  // u / m without a division.
  const FastDiv by_m(static_cast<std::uint64_t>(m), units - 1);
  int x = 0;
  for (std::size_t i = 0; i < owner.size(); ++i) {
    const int o = owner[i];
    if (o < 0) continue;
    const std::size_t n = free_slots ? i / 2 : i;  // the slot of key i
    const auto u = static_cast<std::size_t>(o / 2);
    const int c = static_cast<int>(by_m(u)), mb = static_cast<int>(u) - c * m, s = sh.stage_of(r, c);
    if ((o & 1) == 0) {
      rp.copy.push_back(Op{OpKind::O, s, mb, fidx[u]});
    } else if (!all_edges) {
      rp.copy.push_back(Op{OpKind::R, s, mb, -1});
    } else {
      ridx[u] = static_cast<int>(rp.copy.size());
      const double start = static_cast<double>(static_cast<long long>(n)) * T;
      while (x < nc && pe[static_cast<std::size_t>(x)] <= start + eps) ++x;
      rp.copy.push_back(Op{OpKind::R, s, mb, x - 1});
    }
    rp.copy_slot.push_back(static_cast<long long>(n));
  }
  if (!all_edges) return;
  const int nk = static_cast<int>(rp.copy.size());
  Op* const cmp = rp.compute.data();
  const Op* const cpy = rp.copy.data();
  const long long* const cslot = rp.copy_slot.data();
  int last_o = -1, k = 0;
  for (int y = 0; y < nc; ++y) {
    while (k < nk && static_cast<double>(cslot[k] + 1) * T <= ps[static_cast<std::size_t>(y)] + eps) {
      if (cpy[k].kind == OpKind::O) last_o = k;
      ++k;
    }
    Op& op = cmp[y];
    op.wait = last_o;
    if (op.kind == OpKind::B || op.kind == OpKind::BW) op.wait = std::max(op.wait, ridx[unit_of(op)]);
  }
}

/// Tightens the cross-stream edges that place_offloads derived from the copy-slot grid so that
/// every execution keeps the order of releases and acquisitions of the program's own ASAP run
/// under `costs` (what simulate(p) reports as the plan): an F waits for every offload that ends
/// at or before its start there, a reload for every compute op that ends at or before its
/// start there. The slot grid alone does not give this: a copy runs as soon as its edge lets
/// it, often before its slot, so the run may free a unit earlier than the grid planned and
/// admit a forward that the grid's order would not (DualPipeV with offload on one rank: the
/// grid's peak 3 units, the run's 2, and slower copies then reached 3). Each edge added is met
/// in the run already (the op it waits for ends by then), so the run, and so the plan's
/// timeline and peak, stay as they were; and now no execution frees later, relative to an
/// acquisition, than the run did, so none holds more at once (docs/design.md section 3).
/// `dur` is duration_table(costs, stages).
constexpr void pin_run_order(Program& p, const Costs& costs, const std::vector<double>& dur) {
  const std::size_t du = p.ranks.size();
  std::vector<std::vector<double>> cs(du), ks(du);
  std::vector<TimesOut> out(du);
  for (std::size_t r = 0; r < du; ++r) {
    cs[r].resize(p.ranks[r].compute.size());
    ks[r].resize(p.ranks[r].copy.size());
    out[r] = {cs[r].data(), ks[r].data(), nullptr};
  }
  std::vector<UnitEnds> ends = asap_scratch(p);
  asap_into<true>(p, costs, dur, out.data(), ends);
  for (std::size_t r = 0; r < du; ++r) {
    auto& comp = p.ranks[r].compute;
    auto& copy = p.ranks[r].copy;
    const int nc = static_cast<int>(comp.size()), nk = static_cast<int>(copy.size());
    if (nk == 0) continue;
    // Ends as the run makes them (start + duration, the same sum), in stream order.
    const auto end_c = [&](int x) {
      return cs[r][static_cast<std::size_t>(x)] + table_duration(dur.data(), comp[static_cast<std::size_t>(x)]);
    };
    // When copy x and every copy before it have ended (two copy streams may end them out of
    // order; a wait for copy x is for all of them).
    double done = 0;
    const auto done_k = [&](int x) {
      return std::max(
          done, ks[r][static_cast<std::size_t>(x)] + table_duration(dur.data(), copy[static_cast<std::size_t>(x)]));
    };
    int k = 0, last_o = -1;
    for (int y = 0; y < nc; ++y) {
      const double start = cs[r][static_cast<std::size_t>(y)];
      while (k < nk && done_k(k) <= start) {
        done = done_k(k);
        if (copy[static_cast<std::size_t>(k)].kind == OpKind::O) last_o = k;
        ++k;
      }
      Op& op = comp[static_cast<std::size_t>(y)];
      if (op.kind == OpKind::F) op.wait = std::max(op.wait, last_o);
    }
    int x = 0;
    for (int y = 0; y < nk; ++y) {
      Op& op = copy[static_cast<std::size_t>(y)];
      if (op.kind != OpKind::R) continue;
      const double start = ks[r][static_cast<std::size_t>(y)];
      while (x < nc && end_c(x) <= start) ++x;
      op.wait = std::max(op.wait, x - 1);
    }
  }
}

}  // namespace detail
}  // namespace pipeoffload
