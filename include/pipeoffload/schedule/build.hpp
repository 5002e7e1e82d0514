// pipeoffload/schedule/build.hpp: from a schedule spec, a shape and a cost model to op lists.
//
// build() runs in four steps, all constexpr:
//   1. each rank's compute order (1F1B, Megatron's 1F1B-I, or the GIS building block),
//   2. a planning timeline of those orders (PO's shifted grid, otherwise ASAP),
//   3. offload placement on one copy stream per rank, and the cross-stream edges that keep
//      execution within the planned memory (DESIGN.md section 3); on PO's grid, edges that
//      keep the plan's peak rather than its order, and each PCIe pair's slot parities chosen
//      so that its copies keep pace with the execution (settle_offloads),
//   4. the P2P plan: each rank posts its sends and receives in the order of the messages'
//      times on the planning timeline, one global order that every rank agrees with, so a
//      communicator whose send waits for the matching receive cannot deadlock (a message's
//      producer starts after every message it consumes, so induction over that order
//      completes them all; validate() checks it).
#pragma once

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "detail/asap.hpp"
#include "program.hpp"

namespace pipeoffload {

/// Allowed ranges of a shape (wide enough for any real pipeline; they bound memory use).
inline constexpr int max_ranks = 4096;
inline constexpr int max_chunks = 256;
inline constexpr int max_microbatches = 1 << 16;
/// Most copy slots one rank's offload plan may span (the plan keeps one byte per slot).
inline constexpr long long max_copy_slots = 1LL << 26;

namespace detail {

constexpr long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

/// Resolved group size g of a grouped spec for d ranks, checked against its legal range.
constexpr int resolve_group(const GroupSpec& g, int d) {
  const int lo = static_cast<int>(ceil_div(d, 2));
  switch (g.kind) {
    case GroupSpec::Kind::full: return d;
    case GroupSpec::Kind::half: return lo;
    case GroupSpec::Kind::uniform: return 1;
    case GroupSpec::Kind::number:
      require_range("GIS(g): group size g (legal: ceil(d/2) <= g <= d)", g.value, lo, d);
      return g.value;
  }
  return d;
}

constexpr void check_shape(const ScheduleSpec& spec, const Shape& s) {
  require_range("shape: ranks d", s.d, 1, max_ranks);
  require_range("shape: chunks per rank v", s.v, 1, max_chunks);
  require_range("shape: microbatches m", s.m, 1, max_microbatches);
  if (spec.family == Family::one_f1b) require_range("1F1B: chunks per rank v (1F1B has one stage per rank)", s.v, 1, 1);
  if (spec.family == Family::interleaved_1f1b && s.m % s.d != 0)
    throw shape_error("1F1B-I (Megatron's interleaved order): microbatches m = " + num(s.m) +
                      " must be a multiple of ranks d = " + num(s.d));
  if (spec.offload.kind == offload::selection::Kind::set && s.v < 64 && (spec.offload.mask >> s.v) != 0)
    throw shape_error("offload::chunks: a listed chunk index is >= v = " + num(s.v) + "; allowed chunks are 0.." + num(s.v - 1));
}

constexpr bool finite_positive(double x) { return x > 0 && x < 1e300; }

constexpr void check_costs(const Costs& c, const Shape& s) {
  if (!finite_positive(c.f)) throw shape_error("costs: T_F must be a finite number > 0");
  if (!finite_positive(c.b)) throw shape_error("costs: T_B must be a finite number > 0");
  if (!finite_positive(c.w)) throw shape_error("costs: T_W must be a finite number > 0");
  if (!(c.comm >= 0 && c.comm < 1e300)) throw shape_error("costs: T_comm must be a finite number >= 0");
  if (!finite_positive(c.k) && !finite_positive(c.t_o)) throw shape_error("costs: k (or T_O) must be a finite number > 0");
  if (!(c.t_o >= 0 && c.t_o < 1e300)) throw shape_error("costs: T_O must be a finite number >= 0 (0 means: from k)");
  const auto check_vec = [&](const std::vector<double>& vec, const char* what, bool positive) {
    if (vec.empty()) return;
    if (static_cast<long long>(vec.size()) != s.stages())
      throw shape_error(std::string("costs: per-stage ") + what + " has " + num(static_cast<long long>(vec.size())) +
                        " entries; it must have S = v*d = " + num(s.stages()) + " (or none)");
    for (double x : vec)
      if (positive ? !finite_positive(x) : !(x >= 0 && x < 1e300))
        throw shape_error(std::string("costs: every per-stage ") + what + " must be a finite number " + (positive ? "> 0" : ">= 0"));
  };
  check_vec(c.stage_f, "T_F", true);
  check_vec(c.stage_b, "T_B", true);
  check_vec(c.stage_w, "T_W", true);
  check_vec(c.unit_bytes, "unit size", false);
}

// ---- step 1: compute orders ------------------------------------------------------------

constexpr void order_1f1b(Program& p) {
  const int d = p.shape.d, m = p.shape.m;
  for (int i = 0; i < d; ++i) {
    auto& ops = p.ranks[static_cast<std::size_t>(i)].compute;
    const int w = std::min(d - i - 1, m);
    for (int k = 0; k < w; ++k) ops.push_back({OpKind::F, i, k});
    for (int k = 0; k < m - w; ++k) {
      ops.push_back({OpKind::F, i, w + k});
      ops.push_back({OpKind::BW, i, k});
    }
    for (int k = m - w; k < m; ++k) ops.push_back({OpKind::BW, i, k});
  }
}

constexpr void order_interleaved(Program& p) {
  const int d = p.shape.d, v = p.shape.v, m = p.shape.m, total = m * v;
  for (int i = 0; i < d; ++i) {
    auto& ops = p.ranks[static_cast<std::size_t>(i)].compute;
    const auto fwd = [&](int k) {
      const int c = (k % (d * v)) / d;
      return Op{OpKind::F, c * d + i, (k / (d * v)) * d + k % d};
    };
    const auto bwd = [&](int k) {
      const int c = v - 1 - (k % (d * v)) / d;
      return Op{OpKind::BW, c * d + i, (k / (d * v)) * d + k % d};
    };
    const int w = std::min(2 * (d - i - 1) + (v - 1) * d, total);
    for (int k = 0; k < w; ++k) ops.push_back(fwd(k));
    for (int k = 0; k < total - w; ++k) {
      ops.push_back(fwd(w + k));
      ops.push_back(bwd(k));
    }
    for (int k = total - w; k < total; ++k) ops.push_back(bwd(k));
  }
}

/// The GIS(g) building block repeated every L = 3gv slots (DESIGN.md section 2). Fills the
/// compute orders and, if `grid` is given, each rank's slot of each op on the shifted grid.
constexpr void order_grouped(Program& p, std::vector<std::vector<long long>>* grid = nullptr) {
  const long long d = p.shape.d, v = p.shape.v, m = p.shape.m, g = p.group;
  const long long h = ceil_div(d, 2), kp = ceil_div(h, g), gk = std::gcd(v, kp), q = v / gk, L = 3 * g * v;
  const auto f = [&](long long c, long long j, long long i) { return 3 * kp * g * c + 3 * j + i + 3 * g * (c / q); };
  // Shift: rank i starts min(i, e) slots late, e the smallest slack between a chunk's forward
  // on rank d-1 and the next chunk's on rank 0 (independent of the group index).
  long long e = d - 1;
  for (long long c = 1; c < v; ++c) e = std::min(e, f(c, 0, 0) - f(c - 1, 0, d - 1) - 1);
  if (grid != nullptr) grid->assign(static_cast<std::size_t>(d), {});
  // Slots are distinct, and dense on a rank unless trimming emptied most of them (m < g), so
  // the order usually comes from placing each pass at its slot in a table and reading the
  // table back (linear); a sparse rank sorts instead.
  std::vector<Op> table;
  std::vector<char> filled;
  std::vector<std::pair<long long, Op>> sparse;
  const long long groups = ceil_div(m, g);
  for (long long i = 0; i < d; ++i) {
    const long long b0 = f(v - 1, 0, i) + 3 * (d - 1 - i) + 1;
    const long long last = b0 + f(v - 1, g - 1, 0) + (groups - 1) * L + 1;  // the latest W slot
    const bool dense = last + 1 <= 4 * 3 * v * m;
    if (dense) {
      table.assign(static_cast<std::size_t>(last + 1), Op{});
      filled.assign(table.size(), 0);
    }
    sparse.clear();
    const auto put = [&](long long slot, Op op) {
      if (!dense) {
        sparse.push_back({slot, op});
        return;
      }
      table[static_cast<std::size_t>(slot)] = op;
      filled[static_cast<std::size_t>(slot)] = 1;
    };
    for (long long n = 0; n < groups; ++n)
      for (long long j = 0; j < g; ++j) {
        const long long mb = n * g + j;
        if (mb >= m) break;  // trim: the slot stays idle, nothing moves
        for (long long c = 0; c < v; ++c) {
          const int fs = static_cast<int>(c * d + i), bs = static_cast<int>((v - 1 - c) * d + i);
          const long long bslot = b0 + f(c, j, 0) + n * L;
          put(f(c, j, i) + n * L, Op{OpKind::F, fs, static_cast<int>(mb)});
          put(bslot, Op{OpKind::B, bs, static_cast<int>(mb)});
          put(bslot + 1, Op{OpKind::W, bs, static_cast<int>(mb)});
        }
      }
    auto& ops = p.ranks[static_cast<std::size_t>(i)].compute;
    ops.reserve(static_cast<std::size_t>(3 * v * m));
    std::vector<long long>* slots = grid != nullptr ? &(*grid)[static_cast<std::size_t>(i)] : nullptr;
    if (slots != nullptr) slots->reserve(static_cast<std::size_t>(3 * v * m));
    if (dense) {
      for (std::size_t slot = 0; slot < table.size(); ++slot)
        if (filled[slot]) sparse.push_back({static_cast<long long>(slot), table[slot]});
    } else {
      std::sort(sparse.begin(), sparse.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    for (const auto& [slot, op] : sparse) {
      ops.push_back(op);
      if (slots != nullptr) slots->push_back(slot + std::min(i, e));
    }
  }
}

// ---- step 3: offload placement ----------------------------------------------------------

/// Places one rank's offloads and reloads on its copy-slot grid and derives the cross-stream
/// edges. `ps`/`pe` are the planned start/end of each compute op. `flip` swaps the parities
/// of its offload and reload slots (see settle_offloads).
constexpr void place_offloads(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe, bool flip = false) {
  const Shape& sh = p.shape;
  auto& rp = p.ranks[static_cast<std::size_t>(r)];
  const int m = sh.m, v = sh.v;
  // Index of each unit's forward and backward (B or BW) in the compute order.
  std::vector<int> fidx(static_cast<std::size_t>(v * m), -1), bidx(fidx.size(), -1);
  for (int x = 0; x < static_cast<int>(rp.compute.size()); ++x) {
    const Op& op = rp.compute[static_cast<std::size_t>(x)];
    const auto u = static_cast<std::size_t>(sh.chunk_of(op.stage) * m + op.mb);
    if (op.kind == OpKind::F) fidx[u] = x;
    if (op.kind == OpKind::B || op.kind == OpKind::BW) bidx[u] = x;
  }
  const double horizon = pe.empty() ? 0.0 : pe.back();
  const auto gap = [&](int c, int mb) {
    const auto u = static_cast<std::size_t>(c * m + mb);
    return ps[static_cast<std::size_t>(bidx[u])] - pe[static_cast<std::size_t>(fidx[u])];
  };
  // The selected chunks that have at least one unit whose gap can hide its own round trip;
  // the others stay on the device and must not stretch the slots (an LM-head chunk's long
  // copies would otherwise slow every other chunk's).
  std::vector<int> chunks;
  double T = 0;
  for (int c = 0; c < v; ++c) {
    if (!offload::offloaded(p.spec.offload, c, v)) continue;
    const double t_o = p.costs.T_O(sh.stage_of(r, c));
    for (int mb = 0; mb < m; ++mb)
      if (gap(c, mb) + 1e-9 * std::max(t_o, horizon) >= 2 * t_o) {
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
                      " are allowed; raise k (or T_O) at least " + num(static_cast<long long>(horizon / T / max_copy_slots) + 1) + "-fold");
  const double eps = 1e-9 * std::max(T, horizon);
  // Slot n = [nT, (n+1)T). Offload slots have parity `po`; the odd rank of a PCIe pair
  // (r, r^1) takes the other parity, so the pair never copies in one direction at once.
  const long long po = ((p.costs.stagger_pairs && (r & 1) == 1) ? 1 : 0) ^ (flip ? 1 : 0);

  // Longest lifespan (forward end to backward start) first; chunk 0 wins ties.
  std::vector<std::pair<double, int>> life;
  for (int c : chunks) {
    double sum = 0;
    for (int mb = 0; mb < m; ++mb) sum += gap(c, mb);
    life.push_back({-sum, c});
  }
  std::sort(life.begin(), life.end());

  std::vector<char> used;
  const auto is_used = [&](long long n) { return n >= 0 && n < static_cast<long long>(used.size()) && used[static_cast<std::size_t>(n)]; };
  const auto mark = [&](long long n, char val) {
    if (n >= static_cast<long long>(used.size())) used.resize(static_cast<std::size_t>(n + 1) * 2, 0);
    used[static_cast<std::size_t>(n)] = val;
  };
  // Each chunk's microbatches in the order of their forwards and of their backwards.
  std::vector<std::vector<int>> forder(static_cast<std::size_t>(v)), border(static_cast<std::size_t>(v));
  for (const Op& op : rp.compute) {
    if (op.kind == OpKind::F) forder[static_cast<std::size_t>(sh.chunk_of(op.stage))].push_back(op.mb);
    if (op.kind == OpKind::B || op.kind == OpKind::BW) border[static_cast<std::size_t>(sh.chunk_of(op.stage))].push_back(op.mb);
  }
  std::vector<long long> oslot(static_cast<std::size_t>(v * m), -1), rslot(oslot.size(), -1);
  std::vector<char> want(oslot.size(), 0);
  for (const auto& [neg, c] : life) {
    const auto uc = static_cast<std::size_t>(c);
    // A unit whose gap cannot hide the round trip stays on the device.
    for (int mb = 0; mb < m; ++mb) want[static_cast<std::size_t>(c * m + mb)] = gap(c, mb) + eps >= 2 * T;
    // Offloads left to right: the earliest free offload slot starting at or after F ends.
    for (int mb : forder[uc]) {
      const auto u = static_cast<std::size_t>(c * m + mb);
      if (!want[u]) continue;
      const double fe = pe[static_cast<std::size_t>(fidx[u])];
      long long n = std::max(0LL, static_cast<long long>((fe - eps) / T));
      while (static_cast<double>(n) * T + eps < fe) ++n;
      if ((n & 1) != po) ++n;
      while (is_used(n)) n += 2;
      oslot[u] = n;
      mark(n, 1);
    }
    // Reloads right to left: the latest free reload slot that ends before B starts.
    for (auto it = border[uc].rbegin(); it != border[uc].rend(); ++it) {
      const auto u = static_cast<std::size_t>(c * m + *it);
      if (!want[u]) continue;
      const double bs = ps[static_cast<std::size_t>(bidx[u])];
      long long n = static_cast<long long>((bs + eps) / T) - 1;
      while (n >= 0 && (n + 1) * T > bs + eps) --n;
      if (n >= 0 && (n & 1) == po) --n;
      while (n > oslot[u] && is_used(n)) n -= 2;
      if (n > oslot[u]) {
        rslot[u] = n;
        mark(n, 1);
      } else {
        mark(oslot[u], 0);  // no reload slot after the offload: keep this unit on the device
        oslot[u] = -1;
      }
    }
  }

  // The copy stream in slot order: slots are distinct, so a table indexed by slot sorts them.
  std::vector<Op> by_slot(used.size() + 1);
  std::vector<char> has(by_slot.size(), 0);
  for (std::size_t u = 0; u < oslot.size(); ++u) {
    if (oslot[u] < 0) continue;
    const int c = static_cast<int>(u) / m, mb = static_cast<int>(u) % m, s = sh.stage_of(r, c);
    by_slot[static_cast<std::size_t>(oslot[u])] = Op{OpKind::O, s, mb, fidx[u]};
    by_slot[static_cast<std::size_t>(rslot[u])] = Op{OpKind::R, s, mb, -1};
    has[static_cast<std::size_t>(oslot[u])] = has[static_cast<std::size_t>(rslot[u])] = 1;
  }
  for (std::size_t n = 0; n < by_slot.size(); ++n)
    if (has[n]) {
      rp.copy.push_back(by_slot[n]);
      rp.copy_slot.push_back(static_cast<long long>(n));
    }
  // Cross-stream edges. A compute op waits for every offload that ends before it starts in
  // the plan (so a release planned earlier also happens earlier); a reload waits for every
  // compute op that ends before it starts there; a backward waits for its own reload.
  const int nc = static_cast<int>(rp.compute.size()), nk = static_cast<int>(rp.copy.size());
  int last_o = -1, k = 0;
  for (int x = 0; x < nc; ++x) {
    while (k < nk && static_cast<double>(rp.copy_slot[static_cast<std::size_t>(k)] + 1) * T <= ps[static_cast<std::size_t>(x)] + eps) {
      if (rp.copy[static_cast<std::size_t>(k)].kind == OpKind::O) last_o = k;
      ++k;
    }
    rp.compute[static_cast<std::size_t>(x)].wait = last_o;
  }
  std::vector<int> ridx(static_cast<std::size_t>(v * m), -1);
  for (int y = 0; y < nk; ++y) {
    const Op& op = rp.copy[static_cast<std::size_t>(y)];
    if (op.kind == OpKind::R) ridx[static_cast<std::size_t>(sh.chunk_of(op.stage) * m + op.mb)] = y;
  }
  for (int x = 0; x < nc; ++x) {
    Op& op = rp.compute[static_cast<std::size_t>(x)];
    if (op.kind != OpKind::B && op.kind != OpKind::BW) continue;
    const int y = ridx[static_cast<std::size_t>(sh.chunk_of(op.stage) * m + op.mb)];
    op.wait = std::max(op.wait, y);
  }
  int x = 0;
  for (int y = 0; y < nk; ++y) {
    Op& op = rp.copy[static_cast<std::size_t>(y)];
    if (op.kind != OpKind::R) continue;
    const double start = static_cast<double>(rp.copy_slot[static_cast<std::size_t>(y)]) * T;
    while (x < nc && pe[static_cast<std::size_t>(x)] <= start + eps) ++x;
    op.wait = x - 1;
  }
}

/// Cross-stream edges of rank r (DESIGN.md section 3) that keep every execution within the
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
constexpr void cross_stream_edges(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe, const std::vector<double>& ks,
                                  const std::vector<double>& ke, double eps) {
  const Shape& sh = p.shape;
  auto& rp = p.ranks[static_cast<std::size_t>(r)];
  Op* const comp = rp.compute.data();
  Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  const Costs& costs = p.costs;
  // The plan's events in time order (x >= 0: compute op x, ~y: copy op y; B ops, which neither
  // acquire nor release, left out) and its peak: acquisitions may fill it, not exceed it.
  std::vector<int> order;
  order.reserve(nc + nk);
  double alive = 0, peak = 0;
  std::size_t x = 0, y = 0;
  const auto skip_b = [&] {
    while (x < nc && comp[x].kind == OpKind::B) ++x;
  };
  for (skip_b(); x < nc || y < nk;) {
    bool compute_first = y == nk;
    if (x < nc && y < nk) {
      const bool rc = comp[x].kind != OpKind::F, rk = copy[y].kind == OpKind::O;
      const double tc = rc ? pe[x] : ps[x], tk = rk ? ke[y] : ks[y];
      compute_first = rc == rk ? tc <= tk : rc ? tc <= tk + eps : tk > tc + eps;
    }
    if (compute_first) {
      alive += comp[x].kind == OpKind::F ? costs.bytes(comp[x].stage) : -costs.bytes(comp[x].stage);
      order.push_back(static_cast<int>(x++));
      skip_b();
    } else {
      alive += copy[y].kind == OpKind::R ? costs.bytes(copy[y].stage) : -costs.bytes(copy[y].stage);
      order.push_back(~static_cast<int>(y++));
    }
    peak = std::max(peak, alive);
  }
  // The releases of each stream so far: releasing op and bytes freed up to it.
  struct Release {
    int op;
    double freed;
  };
  std::vector<Release> rel_c, rel_k;
  rel_c.reserve(nc / 2 + 1);
  rel_k.reserve(nk / 2 + 1);
  const double slack = 1e-9 * peak;
  // The release of `rel` to wait for (-1: none): the first one after which the rest, the
  // latest, free no more than `room`. Galloping back from the end, as the skipped tail is short.
  const auto wait_for = [&](const std::vector<Release>& rel, double room) {
    const std::size_t n = rel.size();
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
  alive = 0;
  std::vector<int> ridx(static_cast<std::size_t>(sh.v) * static_cast<std::size_t>(sh.m), -1);
  for (const int e : order) {
    if (e >= 0) {
      Op& op = comp[e];
      const double b = costs.bytes(op.stage);
      if (op.kind == OpKind::F) {
        alive += b;
        op.wait = wait_for(rel_k, peak - alive);
      } else {
        alive -= b;
        rel_c.push_back({e, (rel_c.empty() ? 0.0 : rel_c.back().freed) + b});
        op.wait = -1;
      }
    } else {
      Op& op = copy[~e];
      const double b = costs.bytes(op.stage);
      if (op.kind == OpKind::R) {
        alive += b;
        op.wait = wait_for(rel_c, peak - alive);
        ridx[static_cast<std::size_t>(sh.chunk_of(op.stage)) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(op.mb)] = ~e;
      } else {
        alive -= b;
        rel_k.push_back({~e, (rel_k.empty() ? 0.0 : rel_k.back().freed) + b});
      }
    }
  }
  for (std::size_t c = 0; c < nc; ++c)
    if (comp[c].kind == OpKind::B || comp[c].kind == OpKind::BW)
      comp[c].wait = ridx[static_cast<std::size_t>(sh.chunk_of(comp[c].stage)) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(comp[c].mb)];
}

/// How far rank r's compute falls behind `release` (when each compute op starts without
/// offload) once its copy stream and edges are added, the other ranks keeping that timing: an
/// as-soon-as-possible run of the rank's two streams alone. Returns the sum over compute ops of
/// start - release (infinite if the streams cannot finish) and adds their durations to `busy`.
/// `ce`, `ke`: scratch for the end of each compute and copy op.
constexpr double copy_lag(const Program& p, int r, const std::vector<double>& release, double& busy, std::vector<double>& ce,
                          std::vector<double>& ke) {
  const auto& rp = p.ranks[static_cast<std::size_t>(r)];
  const Op* const comp = rp.compute.data();
  const Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  ce.resize(nc);
  ke.resize(nk);
  std::size_t x = 0, y = 0;
  double cfree = 0, kfree = 0, lag = 0;
  while (x < nc || y < nk) {
    const std::size_t x0 = x, y0 = y;
    for (; x < nc; ++x) {
      const int w = comp[x].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= y) break;
      double t = std::max(cfree, release[x]);
      if (w >= 0) t = std::max(t, ke[static_cast<std::size_t>(w)]);
      lag += t - release[x];
      const double dur = duration(p.costs, comp[x]);
      busy += dur;
      cfree = ce[x] = t + dur;
    }
    for (; y < nk; ++y) {
      const int w = copy[y].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= x) break;
      const double t = w >= 0 ? std::max(kfree, ce[static_cast<std::size_t>(w)]) : kfree;
      kfree = ke[y] = t + duration(p.costs, copy[y]);
    }
    if (x == x0 && y == y0) return 1e308;
  }
  return lag;
}

/// The final edges and slot parities of a schedule planned on PO's grid (DESIGN.md section 3),
/// after place_offloads. Its edges replay the plan's order: every release planned before an
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
/// `plan(r)` gives rank r's planned compute start and end times (pointers to two vectors that
/// stay valid until the next call), `release` each compute op's start without offload.
template <class Plan>
constexpr void settle_offloads(Program& p, const Plan& plan, const std::vector<std::vector<double>>& release) {
  const int d = p.shape.d;
  const bool pairs = p.costs.stagger_pairs;
  std::vector<double> ks, ke, ce;
  // Rank r's final edges; returns its copy_lag.
  const auto settle = [&](int r, double& busy) {
    const auto ru = static_cast<std::size_t>(r);
    const RankProgram& rp = p.ranks[ru];
    if (rp.copy.empty()) return 0.0;
    const double T = rp.slot_length;
    ks.resize(rp.copy.size());
    ke.resize(rp.copy.size());
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      ks[y] = static_cast<double>(rp.copy_slot[y]) * T;
      ke[y] = ks[y] + T;
    }
    const auto [ps, pe] = plan(r);
    const double horizon = std::max(pe->empty() ? 0.0 : pe->back(), ke.back());
    cross_stream_edges(p, r, *ps, *pe, ks, ke, 1e-9 * std::max(T, horizon));  // place_offloads' eps
    return copy_lag(p, r, release[ru], busy, ce, ke);
  };
  struct Kept {
    std::vector<Op> copy;
    std::vector<long long> slot;
    double slot_length = 0;
    std::vector<int> waits;
  };
  std::vector<Kept> kept(pairs ? 2 : 1);
  for (int r0 = 0; r0 < d; r0 += pairs ? 2 : 1) {
    const int n = pairs && r0 + 1 < d ? 2 : 1;
    double lag = 0, busy = 0;
    for (int r = r0; r < r0 + n; ++r) lag += settle(r, busy);
    if (!(lag > 0.05 * busy)) continue;  // lag / ops <= 5% of busy / ops, the mean pass
    for (int i = 0; i < n; ++i) {
      RankProgram& rp = p.ranks[static_cast<std::size_t>(r0 + i)];
      Kept& k = kept[static_cast<std::size_t>(i)];
      k.copy.swap(rp.copy);
      k.slot.swap(rp.copy_slot);
      k.slot_length = rp.slot_length;
      k.waits.resize(rp.compute.size());
      for (std::size_t x = 0; x < rp.compute.size(); ++x) k.waits[x] = rp.compute[x].wait;
      rp.copy.clear();
      rp.copy_slot.clear();
      rp.slot_length = 0;
      for (Op& op : rp.compute) op.wait = -1;
      const auto [ps, pe] = plan(r0 + i);
      place_offloads(p, r0 + i, *ps, *pe, true);
    }
    double flipped = 0, unused = 0;
    for (int r = r0; r < r0 + n; ++r) flipped += settle(r, unused);
    if (flipped < lag) continue;
    for (int i = 0; i < n; ++i) {  // keep the first placement
      RankProgram& rp = p.ranks[static_cast<std::size_t>(r0 + i)];
      Kept& k = kept[static_cast<std::size_t>(i)];
      rp.copy.swap(k.copy);
      rp.copy_slot.swap(k.slot);
      rp.slot_length = k.slot_length;
      for (std::size_t x = 0; x < rp.compute.size(); ++x) rp.compute[x].wait = k.waits[x];
    }
  }
}

// ---- step 4: P2P plan -------------------------------------------------------------------

constexpr void plan_p2p(Program& p, const std::vector<std::vector<double>>& plan_end) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  if (d == 1) return;  // one rank: no messages
  // A message's key: (time its producer ends, producer stage, mb, dir). Sender and receiver
  // order by the same key, which gives one global order that every rank's plan follows.
  // A rank's sends follow its compute stream, so they are already in key order; so are the
  // messages each neighbour sends it. A rank's plan is the merge of those three lists.
  struct Cursor {
    const Op* ops = nullptr;     // the compute ops of the rank this cursor walks
    const double* end = nullptr; // their planned end times
    std::size_t n = 0, x = 0;
    int rank = -1;               // that rank
    int to_rank = -1;            // -1: every message it sends; else only those to to_rank
  };
  // Rank the message produced by `op` on rank `from` goes to, or -1 if it sends none.
  const auto sends_to = [S, d](const Op& op, int from) {
    if (op.kind == OpKind::F) return op.stage < S - 1 ? (from + 1 == d ? 0 : from + 1) : -1;
    if (op.kind == OpKind::B || op.kind == OpKind::BW) return op.stage > 0 ? (from == 0 ? d - 1 : from - 1) : -1;
    return -1;
  };
  const auto settle = [&](Cursor& c) {
    for (; c.x < c.n; ++c.x) {
      const int to = sends_to(c.ops[c.x], c.rank);
      if (to >= 0 && (c.to_rank < 0 || to == c.to_rank)) return;
    }
  };
  const auto before = [](const Cursor& a, const Cursor& b) {
    const double ta = a.end[a.x], tb = b.end[b.x];
    if (ta != tb) return ta < tb;
    const Op& oa = a.ops[a.x];
    const Op& ob = b.ops[b.x];
    if (oa.stage != ob.stage) return oa.stage < ob.stage;
    if (oa.mb != ob.mb) return oa.mb < ob.mb;
    return (oa.kind == OpKind::F ? 0 : 1) < (ob.kind == OpKind::F ? 0 : 1);
  };
  const auto cursor = [&](int rank, int to_rank) {
    Cursor c;
    if (rank < 0) return c;
    const auto& ops = p.ranks[static_cast<std::size_t>(rank)].compute;
    c = Cursor{ops.data(), plan_end[static_cast<std::size_t>(rank)].data(), ops.size(), 0, rank, to_rank};
    settle(c);
    return c;
  };
  for (int r = 0; r < d; ++r) {
    const int prev = r == 0 ? d - 1 : r - 1, next = r + 1 == d ? 0 : r + 1;
    Cursor cur[3] = {cursor(r, -1), cursor(prev, r), cursor(prev == next ? -1 : next, r)};
    auto& comm = p.ranks[static_cast<std::size_t>(r)].comm;
    comm.reserve(4 * p.ranks[static_cast<std::size_t>(r)].compute.size() / 3 + 4);
    for (;;) {
      int best = -1;
      for (int l = 0; l < 3; ++l)
        if (cur[l].x < cur[l].n && (best < 0 || before(cur[l], cur[best]))) best = l;
      if (best < 0) break;
      Cursor& c = cur[best];
      const Op& op = c.ops[c.x];
      const bool fwd = op.kind == OpKind::F;
      const int consumer = fwd ? op.stage + 1 : op.stage - 1;
      const Dir dir = fwd ? Dir::forward : Dir::backward;
      if (best == 0) comm.push_back(CommOp{true, sends_to(op, r), consumer, op.mb, dir});
      else comm.push_back(CommOp{false, c.rank, consumer, op.mb, dir});
      ++c.x;
      settle(c);
    }
  }
}

}  // namespace detail

/// Builds the op lists of `spec` for `shape` under `costs` (unit costs and k = 1 by default).
/// constexpr: with a constant shape and costs, usable in static_assert. Throws shape_error
/// naming the bad value and its allowed range.
constexpr Program build(const ScheduleSpec& spec, const Shape& shape, const Costs& costs = {}) {
  detail::check_shape(spec, shape);
  detail::check_costs(costs, shape);
  Program p;
  p.spec = spec;
  p.shape = shape;
  p.costs = costs;
  p.ranks.resize(static_cast<std::size_t>(shape.d));
  std::vector<std::vector<long long>> grid;
  switch (spec.family) {
    case Family::one_f1b: detail::order_1f1b(p); break;
    case Family::interleaved_1f1b: detail::order_interleaved(p); break;
    case Family::grouped:
      p.group = detail::resolve_group(spec.group, shape.d);
      detail::order_grouped(p, p.group == 1 ? &grid : nullptr);
      break;
  }
  // Planning timeline: PO (g = 1) plans on its shifted grid, one slot = the mean of
  // (T_F + T_B + T_W) / 3 over the stages; every other family on its compute-only ASAP
  // timeline. Both meet every dependency with time to spare, which is all steps 3 and 4 need.
  std::vector<std::vector<double>> ps, pe;
  if (p.group == 1) {
    double tau = 0;
    for (int s = 0; s < shape.stages(); ++s) tau += costs.F(s) + costs.B(s) + costs.W(s);
    tau /= 3.0 * shape.stages();
    ps.resize(grid.size());
    pe.resize(grid.size());
    for (std::size_t r = 0; r < grid.size(); ++r) {
      ps[r].reserve(grid[r].size());
      pe[r].reserve(grid[r].size());
      for (long long slot : grid[r]) {
        ps[r].push_back(static_cast<double>(slot) * tau);
        pe[r].push_back(static_cast<double>(slot + 1) * tau);
      }
    }
  } else {
    detail::Timing t = detail::asap(p, costs, false);
    ps = std::move(t.compute_start);
    pe = std::move(t.compute_end);
  }
  if (offload::count(spec.offload, shape.v) > 0) {
    for (int r = 0; r < shape.d; ++r) detail::place_offloads(p, r, ps[static_cast<std::size_t>(r)], pe[static_cast<std::size_t>(r)]);
    if (p.group == 1) {
      const auto plan = [&](int r) { return std::pair{&ps[static_cast<std::size_t>(r)], &pe[static_cast<std::size_t>(r)]}; };
      detail::settle_offloads(p, plan, detail::asap(p, costs, false).compute_start);
    }
  }
  detail::plan_p2p(p, pe);
  return p;
}

}  // namespace pipeoffload
