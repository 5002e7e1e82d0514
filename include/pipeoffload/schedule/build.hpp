// pipeoffload/schedule/build.hpp: from a schedule spec, a shape and a cost model to op lists.
//
// build() runs in four steps, all constexpr:
//   1. each rank's compute order (1F1B, Megatron's 1F1B-I, or the GIS building block),
//   2. a planning timeline of those orders (PO's shifted grid, otherwise ASAP),
//   3. offload placement on one copy stream per rank, and the cross-stream edges that keep
//      execution within the planned memory (DESIGN.md section 3); on PO's grid, edges that
//      keep the plan's peak rather than its order, and each PCIe pair's slot parities chosen
//      so that its copies keep pace with the execution (settle_pair),
//   4. the P2P plan: each rank posts its sends and receives in the order of the messages'
//      times on the planning timeline, one global order that every rank agrees with, so a
//      communicator whose send waits for the matching receive cannot deadlock (a message's
//      producer starts after every message it consumes, so induction over that order
//      completes them all; validate() checks it).
// For PO the grid gives each pass's slot from the pass itself (Block::slot), so the four steps
// run rank by rank while that rank's lists are in cache; its P2P plan comes from its own
// compute list, since the messages it receives are those its passes consume.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "detail/asap.hpp"
#include "detail/default_init.hpp"
#include "detail/parallel.hpp"
#include "program.hpp"

namespace pipeoffload {

/// Most copy slots one rank's offload plan may span (the plan keeps a few bytes per slot).
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

/// Geometry of the GIS(g) building block of a program (DESIGN.md section 2): block slots,
/// the repeat period L = 3gv, and the shift of each rank on PO's planning grid.
struct Block {
  long long d = 1, v = 1, m = 1, g = 1, kp = 1, q = 1, L = 3, e = 0, groups = 1;
  std::uint64_t magic = 1;   // (2^40 / d) + 1, see chunk()
  std::vector<long long> a;  // a[c] = f(c, 0, 0): the part of f that depends on the chunk only

  constexpr explicit Block(const Program& p) : d(p.shape.d), v(p.shape.v), m(p.shape.m), g(p.group) {
    magic = (std::uint64_t{1} << 40) / static_cast<std::uint64_t>(d) + 1;
    const long long h = ceil_div(d, 2);
    kp = ceil_div(h, g);
    q = v / std::gcd(v, kp);
    L = 3 * g * v;
    groups = ceil_div(m, g);
    a.resize(static_cast<std::size_t>(v));
    for (long long c = 0; c < v; ++c) a[static_cast<std::size_t>(c)] = 3 * kp * g * c + 3 * g * (c / q);
    // Shift: rank i starts min(i, e) slots late, e the smallest slack between a chunk's
    // forward on rank d-1 and the next chunk's on rank 0 (independent of the group index).
    e = d - 1;
    for (long long c = 1; c < v; ++c) e = std::min(e, f(c, 0, 0) - f(c - 1, 0, d - 1) - 1);
  }
  /// Block slot of F(chunk c, member j) on rank i.
  constexpr long long f(long long c, long long j, long long i) const { return a[static_cast<std::size_t>(c)] + 3 * j + i; }
  /// Block slot of rank i's first backward.
  constexpr long long b0(long long i) const { return f(v - 1, 0, i) + 3 * (d - 1 - i) + 1; }
  /// Rank i's latest W slot (unshifted).
  constexpr long long last(long long i) const { return b0(i) + f(v - 1, g - 1, 0) + (groups - 1) * L + 1; }
  constexpr long long shift(long long i) const { return std::min(i, e); }
  /// Chunk of a stage, s / d without a division (exact for s < 2^20 and d <= 2^12).
  constexpr long long chunk(int s) const { return static_cast<long long>((static_cast<std::uint64_t>(s) * magic) >> 40); }
  /// The slots of rank i's passes with g = 1 (PO), from two per-chunk tables: Block::slot
  /// with its terms that depend only on the rank and chunk added up once.
  struct RankGrid {
    std::vector<long long> base;  // [2c]: F(chunk c, mb 0); [2c+1]: B(stage of chunk c, mb 0)
    long long L = 3;
    std::uint64_t magic = 1;
    constexpr long long slot(const Op& op) const {
      const auto c = static_cast<std::size_t>((static_cast<std::uint64_t>(op.stage) * magic) >> 40);
      return op.kind == OpKind::F ? base[2 * c] + op.mb * L : base[2 * c + 1] + op.mb * L + (op.kind == OpKind::W ? 1 : 0);
    }
  };
  constexpr RankGrid grid(long long i) const {
    RankGrid gr;
    gr.L = L;
    gr.magic = magic;
    gr.base.resize(static_cast<std::size_t>(2 * v));
    for (long long c = 0; c < v; ++c) {
      gr.base[static_cast<std::size_t>(2 * c)] = f(c, 0, i) + shift(i);
      gr.base[static_cast<std::size_t>(2 * c + 1)] = b0(i) + f(v - 1 - c, 0, 0) + shift(i);
    }
    return gr;
  }
  /// Slot of `op` (a pass of rank i) on the shifted grid.
  constexpr long long slot(long long i, const Op& op) const {
    const long long cc = chunk(op.stage);
    long long j = 0, n = op.mb;
    if (g != 1) {
      j = op.mb % g;
      n = op.mb / g;
    }
    const long long base = op.kind == OpKind::F ? f(cc, j, i) : b0(i) + f(v - 1 - cc, j, 0) + (op.kind == OpKind::W ? 1 : 0);
    return base + n * L + shift(i);
  }
};

/// Rank i's compute order under the GIS(g) building block repeated every L = 3gv slots
/// (DESIGN.md section 2): its passes sorted by slot.
constexpr void order_grouped_rank(Program& p, const Block& bk, long long i) {
  const long long d = bk.d, v = bk.v, m = bk.m, g = bk.g, L = bk.L, groups = bk.groups;
  const long long b0 = bk.b0(i), last = bk.last(i);
  auto& ops = p.ranks[static_cast<std::size_t>(i)].compute;
  ops.reserve(static_cast<std::size_t>(3 * v * m));
  // Slots are distinct, and dense on a rank unless trimming emptied most of them (m < g).
  // Dense: the block's 3gv slots are distinct mod L, so one table entry per residue says
  // which pass a slot holds, and the slots are walked in order (linear, no table of the
  // whole timeline). Sparse: sort.
  if (last + 1 <= 4 * 3 * v * m) {
    struct Entry {
      Op op{};          // kind, stage and member j (in mb) of the block pass at this residue
      long long hi = -1;  // its block slot / L; -1: no pass
    };
    std::vector<Entry> table(static_cast<std::size_t>(L));
    bool distinct = true;
    const auto put = [&](long long slot, Op op) {
      Entry& en = table[static_cast<std::size_t>(slot % L)];
      if (en.hi >= 0) distinct = false;
      en = Entry{op, slot / L};
    };
    for (long long j = 0; j < g; ++j)
      for (long long c = 0; c < v; ++c) {
        const int fs = static_cast<int>(c * d + i), bs = static_cast<int>((v - 1 - c) * d + i);
        const long long bslot = b0 + bk.f(c, j, 0);
        put(bk.f(c, j, i), Op{OpKind::F, fs, static_cast<int>(j)});
        put(bslot, Op{OpKind::B, bs, static_cast<int>(j)});
        put(bslot + 1, Op{OpKind::W, bs, static_cast<int>(j)});
      }
    if (distinct) {
      long long res = i % L, k = i / L;  // the slot i = f(0, 0, i) is the rank's first
      for (long long slot = i; slot <= last; ++slot) {
        const Entry& en = table[static_cast<std::size_t>(res)];
        const long long n = k - en.hi;
        if (en.hi >= 0 && n >= 0 && n < groups) {
          const long long mb = n * g + en.op.mb;
          if (mb < m) ops.push_back(Op{en.op.kind, en.op.stage, static_cast<int>(mb)});  // trim: mb >= m stays idle
        }
        if (++res == L) {
          res = 0;
          ++k;
        }
      }
      return;
    }
  }
  std::vector<std::pair<long long, Op>> sparse;
  for (long long n = 0; n < groups; ++n)
    for (long long j = 0; j < g; ++j) {
      const long long mb = n * g + j;
      if (mb >= m) break;  // trim: the slot stays idle, nothing moves
      for (long long c = 0; c < v; ++c) {
        const int fs = static_cast<int>(c * d + i), bs = static_cast<int>((v - 1 - c) * d + i);
        const long long bslot = b0 + bk.f(c, j, 0) + n * L;
        sparse.push_back({bk.f(c, j, i) + n * L, Op{OpKind::F, fs, static_cast<int>(mb)}});
        sparse.push_back({bslot, Op{OpKind::B, bs, static_cast<int>(mb)}});
        sparse.push_back({bslot + 1, Op{OpKind::W, bs, static_cast<int>(mb)}});
      }
    }
  std::sort(sparse.begin(), sparse.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (const auto& entry : sparse) ops.push_back(entry.second);
}

/// Every rank's compute order under the GIS(g) building block (see order_grouped_rank); the
/// slot of each pass on PO's shifted grid is Block::slot.
constexpr void order_grouped(Program& p) {
  const Block bk(p);
  for (long long i = 0; i < bk.d; ++i) order_grouped_rank(p, bk, i);
}

// ---- step 3: offload placement ----------------------------------------------------------

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

/// Places one rank's offloads and reloads on its copy-slot grid and derives the cross-stream
/// edges. `ps`/`pe` are the planned start/end of each compute op. `flip` swaps the parities
/// of its offload and reload slots (see settle_pair). Without `edges` only the offloads'
/// edges (each O waits for its F) are set: place_pair derives the others.
constexpr void place_offloads(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe,
                              OffloadScratch* scratch = nullptr, bool flip = false, bool edges = true) {
  OffloadScratch own;
  OffloadScratch& ws = scratch != nullptr ? *scratch : own;
  const Shape& sh = p.shape;
  auto& rp = p.ranks[static_cast<std::size_t>(r)];
  const int m = sh.m, v = sh.v, d = sh.d;
  const std::size_t units = static_cast<std::size_t>(v) * static_cast<std::size_t>(m);
  const Op* const comp = rp.compute.data();
  const int nc = static_cast<int>(rp.compute.size());
  // Each op's chunk (its stage is chunk * d + r), s / d without a division (exact for
  // s < 2^20, d <= 2^12), and its unit (chunk * m + mb).
  const std::uint64_t magic = (std::uint64_t{1} << 40) / static_cast<std::uint64_t>(d) + 1;
  const auto chunk_of = [magic](const Op& op) { return static_cast<std::size_t>((static_cast<std::uint64_t>(op.stage) * magic) >> 40); };
  const auto unit_of = [&](const Op& op) { return chunk_of(op) * static_cast<std::size_t>(m) + static_cast<std::size_t>(op.mb); };
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
  for (std::size_t u = 0; u < units; ++u) gaps[u] = ps[static_cast<std::size_t>(bidx[u])] - pe[static_cast<std::size_t>(fidx[u])];
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
  const auto is_used = [&](long long n) { return n >= 0 && n < static_cast<long long>(owner.size()) && owner[static_cast<std::size_t>(n)] >= 0; };
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
      if ((n & 1) != po) ++n;
      while (is_used(n)) n += 2;
      oslot[u] = n;
      mark(n, static_cast<int>(2 * u));
    }
    // Reloads right to left: the latest free reload slot that ends before B starts.
    for (int k = nb[uc] - 1; k >= 0; --k) {
      const auto u = static_cast<std::size_t>(c * m + bo[k]);
      if (!want[u]) continue;
      const double bs = ps[static_cast<std::size_t>(bidx[u])];
      long long n = static_cast<long long>((bs + eps) / T) - 1;
      while (n >= 0 && (n + 1) * T > bs + eps) --n;
      if (n >= 0 && (n & 1) == po) --n;
      while (n > oslot[u] && is_used(n)) n -= 2;
      if (n > oslot[u]) {
        rslot[u] = n;
        mark(n, static_cast<int>(2 * u + 1));
      } else {
        mark(oslot[u], -1);  // no reload slot after the offload: keep this unit on the device
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
  if (edges) ridx.assign(units, -1);
  // u / m without a division (exact for u < 2^24, m <= 2^16).
  const std::uint64_t mmagic = (std::uint64_t{1} << 40) / static_cast<std::uint64_t>(m) + 1;
  int x = 0;
  for (std::size_t n = 0; n < owner.size(); ++n) {
    const int o = owner[n];
    if (o < 0) continue;
    const auto u = static_cast<std::size_t>(o / 2);
    const int c = static_cast<int>((static_cast<std::uint64_t>(u) * mmagic) >> 40), mb = static_cast<int>(u) - c * m, s = sh.stage_of(r, c);
    if ((o & 1) == 0) {
      rp.copy.push_back(Op{OpKind::O, s, mb, fidx[u]});
    } else if (!edges) {
      rp.copy.push_back(Op{OpKind::R, s, mb, -1});
    } else {
      ridx[u] = static_cast<int>(rp.copy.size());
      const double start = static_cast<double>(static_cast<long long>(n)) * T;
      while (x < nc && pe[static_cast<std::size_t>(x)] <= start + eps) ++x;
      rp.copy.push_back(Op{OpKind::R, s, mb, x - 1});
    }
    rp.copy_slot.push_back(static_cast<long long>(n));
  }
  if (!edges) return;
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

constexpr void cross_stream_edges(Program& p, int r, const std::vector<double>& ps, const std::vector<double>& pe, const std::vector<double>& ks,
                                  const std::vector<double>& ke, double eps, SettleScratch& ws) {
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
  const double slack = 1e-9 * peak;
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
  // Each unit's reload (chunk * m + mb); s / d without a division (exact for s < 2^20, d <= 2^12).
  const std::uint64_t magic = (std::uint64_t{1} << 40) / static_cast<std::uint64_t>(sh.d) + 1;
  const auto unit_of = [&](const Op& op) {
    return static_cast<std::size_t>((static_cast<std::uint64_t>(op.stage) * magic) >> 40) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(op.mb);
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
  double cfree = 0, kfree = 0, lag = 0, sum = busy;  // sum: kept in a register, not in `busy`, which the stores could alias
  while (x < nc || y < nk) {
    const std::size_t x0 = x, y0 = y;
    for (; x < nc; ++x) {
      const int w = comp[x].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= y) break;
      double t = std::max(cfree, release[x]);
      if (w >= 0) t = std::max(t, ke[static_cast<std::size_t>(w)]);
      lag += t - release[x];
      const double d = duration_of(comp[x]);
      sum += d;
      cfree = ce[x] = t + d;
    }
    for (; y < nk; ++y) {
      const int w = copy[y].wait;
      if (w >= 0 && static_cast<std::size_t>(w) >= x) break;
      const double t = w >= 0 ? std::max(kfree, ce[static_cast<std::size_t>(w)]) : kfree;
      kfree = ke[y] = t + duration_of(copy[y]);
    }
    if (x == x0 && y == y0) {
      busy = sum;
      return 1e308;
    }
  }
  busy = sum;
  return lag;
}

/// The final edges and slot parities of a schedule planned on PO's grid (DESIGN.md section 3).
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
/// place_pair places the offloads of the `n` ranks r0.. of one pair (n = 1: a rank alone),
/// with both parities swapped if `flip`, and derives their final edges; settle_pair then keeps
/// that placement or the swapped one. `ps[i]`/`pe[i]` are rank r0+i's planned compute start
/// and end times, `release[i]` each of its compute ops' start without offload.
constexpr void place_pair(Program& p, int r0, int n, const std::vector<double>* ps, const std::vector<double>* pe, bool flip, OffloadScratch& os,
                          SettleScratch& ws) {
  for (int i = 0; i < n; ++i) place_offloads(p, r0 + i, ps[i], pe[i], &os, flip, false);
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
    cross_stream_edges(p, r0 + i, ps[i], pend, ws.ks, ws.ke, 1e-9 * std::max(T, horizon), ws);  // place_offloads' eps
  }
}

/// See place_pair. `plan()` returns the pair's ps and pe (arrays of n vectors), which only a
/// pair that falls behind needs.
template <class Plan>
constexpr void settle_pair(Program& p, int r0, int n, const double* const* release, const Plan& plan, OffloadScratch& os, SettleScratch& ws) {
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
  place_pair(p, r0, n, ps, pe, true, os, ws);
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

// ---- step 4: P2P plan -------------------------------------------------------------------

/// Rank r's P2P plan. `end(rank, x, op)` is the planned end time of compute op x (`op`) of a
/// rank. A message's key: (time its producer ends, producer stage, mb, dir). Sender and
/// receiver order by the same key, which gives one global order that every rank's plan
/// follows. A rank's sends follow its compute stream, so they are already in key order; so
/// are the messages each neighbour sends it. A rank's plan is the merge of those three lists.
template <class End>
constexpr void plan_p2p_rank(Program& p, int r, const End& end) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  if (d == 1) return;  // one rank: no messages
  struct Cursor {
    const Op* ops = nullptr;  // the compute ops of the rank this cursor walks
    std::size_t n = 0, x = 0;
    int rank = -1;    // that rank
    int to_rank = -1; // -1: every message it sends; else only those to to_rank
    double t = 0;     // planned end of ops[x]
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
      if (to >= 0 && (c.to_rank < 0 || to == c.to_rank)) {
        c.t = end(c.rank, c.x, c.ops[c.x]);
        return;
      }
    }
  };
  const auto before = [](const Cursor& a, const Cursor& b) {
    if (a.t != b.t) return a.t < b.t;
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
    c = Cursor{ops.data(), ops.size(), 0, rank, to_rank, 0.0};
    settle(c);
    return c;
  };
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

/// Scratch of plan_p2p_po_rank, kept across ranks.
struct P2PScratch {
  struct Item {
    long long key;  // producer slot * 2^21 + producer stage
    int x;          // the compute op of this rank that sends or consumes the message
  };
  std::vector<Item> own, from_prev, from_next;
  std::vector<long long> delta;
};

/// Rank r's P2P plan on PO's grid, from rank r's own compute list (`slots`: the slot of each
/// of its ops, Block::slot): the messages it receives are those its passes consume (F of stage s > 0 from
/// rank r-1, B of stage s < S-1 from rank r+1), and their producers' slots follow from
/// Block::slot. Merged with its sends in the key order of plan_p2p_rank, this is that plan
/// as long as rank r consumes each neighbour's messages in the order they are sent (their
/// keys increase along rank r's list); otherwise it returns false and writes nothing.
/// The key (slot end, producer stage, ...) is compared as (slot, producer stage): the caller
/// makes sure slot end times increase strictly with the slot, and one slot and stage name
/// one pass.
constexpr bool plan_p2p_po_rank(Program& p, const Block& bk, const long long* slots, int r, P2PScratch& ws) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  if (d == 1) return true;
  const int prev = r == 0 ? d - 1 : r - 1, next = r + 1 == d ? 0 : r + 1;
  const auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
  const Op* const o = ops.data();
  const int n = static_cast<int>(ops.size());
  // A producer's slot is the consumer's plus an offset that depends only on the consumer's
  // chunk (g = 1: both slots grow by L per microbatch).
  const auto v = static_cast<std::size_t>(bk.v);
  auto& delta = ws.delta;
  delta.resize(2 * v);
  for (std::size_t c = 0; c < v; ++c) {
    const int s = static_cast<int>(c) * d + r;
    delta[2 * c] = s > 0 ? bk.slot(prev, Op{OpKind::F, s - 1, 0}) - bk.slot(r, Op{OpKind::F, s, 0}) : 0;
    delta[2 * c + 1] = s < S - 1 ? bk.slot(next, Op{OpKind::B, s + 1, 0}) - bk.slot(r, Op{OpKind::B, s, 0}) : 0;
  }
  auto& own = ws.own;
  auto& fp = ws.from_prev;
  auto& fn = ws.from_next;
  own.resize(static_cast<std::size_t>(n));
  fp.resize(static_cast<std::size_t>(n));
  fn.resize(static_cast<std::size_t>(n));
  std::size_t ni = 0, nj = 0, nk = 0;
  for (int x = 0; x < n; ++x) {
    const Op& op = o[x];
    const long long slot = slots[x];
    const auto c = static_cast<std::size_t>(bk.chunk(op.stage));
    if (op.kind == OpKind::F) {
      if (op.stage < S - 1) own[ni++] = {(slot << 21) | op.stage, x};
      if (op.stage > 0) {
        const long long key = ((slot + delta[2 * c]) << 21) | (op.stage - 1);
        if (nj > 0 && fp[nj - 1].key >= key) return false;
        fp[nj++] = {key, x};
      }
    } else if (op.kind == OpKind::B || op.kind == OpKind::BW) {
      if (op.stage > 0) own[ni++] = {(slot << 21) | op.stage, x};
      if (op.stage < S - 1) {
        const long long key = ((slot + delta[2 * c + 1]) << 21) | (op.stage + 1);
        if (nk > 0 && fn[nk - 1].key >= key) return false;
        fn[nk++] = {key, x};
      }
    }
  }
  // Sized first and then filled: CommOp's bit-fields are stored read-modify-write, and a read
  // of a fresh page maps the zero page, which the write then has to replace.
  auto& comm = p.ranks[static_cast<std::size_t>(r)].comm;
  comm.resize(ni + nj + nk);
  CommOp* q = comm.data();
  constexpr long long end = 0x7fffffffffffffffLL;
  std::size_t i = 0, j = 0, k = 0;
  for (;; ++q) {
    const long long ki = i < ni ? own[i].key : end, kj = j < nj ? fp[j].key : end, kk = k < nk ? fn[k].key : end;
    if (ki < kj && ki < kk) {
      const Op& op = o[own[i++].x];
      const bool fwd = op.kind == OpKind::F;
      *q = CommOp{true, fwd ? next : prev, fwd ? op.stage + 1 : op.stage - 1, op.mb, fwd ? Dir::forward : Dir::backward};
    } else if (kj < kk) {
      const Op& op = o[fp[j++].x];
      *q = CommOp{false, prev, op.stage, op.mb, Dir::forward};
    } else if (kk != end) {
      const Op& op = o[fn[k++].x];
      *q = CommOp{false, next, op.stage, op.mb, Dir::backward};
    } else {
      break;
    }
  }
  return true;
}

}  // namespace detail

/// build() into `p`, reusing the memory its vectors hold: for a caller that builds many
/// schedules in turn (a planner's search, re-planning with measured costs), whose outputs
/// then take no page faults after the first (tens of megabytes for a large schedule). The
/// result is the one build() returns, whatever `p` held before. A bad shape or cost throws
/// before `p` is touched; any later exception leaves `p` a valid Program with unspecified
/// contents.
constexpr void build_into(Program& p, const ScheduleSpec& spec, const Shape& shape, const Costs& costs = {}) {
  detail::check_shape(spec, shape);
  detail::check_costs(costs, shape);
  p.spec = spec;
  p.shape = shape;
  p.costs = costs;
  p.group = 0;
  p.ranks.resize(static_cast<std::size_t>(shape.d));
  for (RankProgram& rp : p.ranks) {
    rp.compute.clear();
    rp.copy.clear();
    rp.copy_slot.clear();
    rp.slot_length = 0;
    rp.comm.clear();
  }
  if (spec.family == Family::grouped) p.group = detail::resolve_group(spec.group, shape.d);
  const bool offloads = offload::count(spec.offload, shape.v) > 0;
  const int d = shape.d;
  if (p.group == 1) {
    // PO (g = 1) plans on its shifted grid, one slot = the mean of (T_F + T_B + T_W) / 3 over
    // the stages. A pass's slot follows from the pass itself (Block::slot), so each rank's
    // P2P plan and each pair's offloads need only that rank's or pair's own order: the work
    // splits into independent items, run on the machine's cores (detail/parallel.hpp), each
    // with its worker's scratch:
    //   1. each rank's order (and the ASAP run's scratch);
    //   2. the compute-only ASAP run (one item, on one thread), and per pair its ranks' P2P
    //      plans and offloads with their final edges, and once the ASAP run has finished,
    //      its slot parities against it (settle_pair);
    //   3. the parities of the pairs placed before the ASAP run finished.
    double tau = 0;
    for (int s = 0; s < shape.stages(); ++s) tau += costs.F(s) + costs.B(s) + costs.W(s);
    tau /= 3.0 * shape.stages();
    const detail::Block bk(p);
    // Slot ends (slot + 1) * tau increase strictly with the slot unless they overflow or go
    // subnormal (slots stay below 2^31); then the P2P keys compare as slots.
    long long top = 0;
    for (long long i = 0; i < bk.d; ++i) top = std::max(top, bk.last(i) + bk.shift(i));
    const bool slot_keys = tau >= 1e-300 && static_cast<double>(top + 2) * tau < 1e300;
    const auto end = [&](int rank, std::size_t, const Op& op) { return static_cast<double>(bk.slot(rank, op) + 1) * tau; };
    const int workers = detail::worker_count(3 * static_cast<std::size_t>(shape.stages()) * static_cast<std::size_t>(shape.m), d);
    // Each compute op's start without offload (the compute-only ASAP run).
    std::vector<std::vector<double, detail::default_init<double>>> rs(static_cast<std::size_t>(offloads ? d : 0));  // written by the run
    std::vector<double> dur;  // the ASAP run's op durations
    if (offloads) dur = detail::duration_table(costs, shape.stages());
    std::vector<detail::TimesOut> out(rs.size());
    std::vector<detail::UnitEnds> ends;  // the ASAP run's scratch
    detail::for_each_item(workers, (offloads ? 1 : 0) + d, [&](int item, int) {
      if (offloads && item == 0) {
        ends = detail::asap_scratch(p);
        return;
      }
      const int r = item - (offloads ? 1 : 0);
      detail::order_grouped_rank(p, bk, r);
      if (offloads) {
        const auto ru = static_cast<std::size_t>(r);
        rs[ru].resize(p.ranks[ru].compute.size());
        out[ru].compute_start = rs[ru].data();
      }
    });
    // Per worker: the slots of the ops of the rank at hand, its P2P scratch, and the pair's
    // planned times and offload scratch.
    struct Scratch {
      std::vector<long long> slots[2];
      detail::P2PScratch p2p;
      std::vector<double> ps[2], pe[2];
      detail::OffloadScratch place;
      detail::SettleScratch settle;
    };
    std::vector<Scratch> scratch;
    scratch.reserve(static_cast<std::size_t>(workers));
    for (int w = 0; w < workers; ++w) scratch.push_back(Scratch{{}, {}, {}, {}, {}, detail::SettleScratch(costs, offloads ? shape.stages() : 0)});
    std::vector<char> fallback(static_cast<std::size_t>(d));  // ranks whose plan needs their neighbours' lists
    // Slots of rank r's ops into ws.slots[i]; with `times`, its planned start and end too.
    const auto plan = [&](Scratch& ws, int r, int i, bool times) {
      const auto& comp = p.ranks[static_cast<std::size_t>(r)].compute;
      const detail::Block::RankGrid grid = bk.grid(r);
      auto& sl = ws.slots[i];
      sl.resize(comp.size());
      for (std::size_t x = 0; x < comp.size(); ++x) sl[x] = grid.slot(comp[x]);
      if (!times) return;
      ws.ps[i].resize(comp.size());
      ws.pe[i].resize(comp.size());
      for (std::size_t x = 0; x < comp.size(); ++x) {
        ws.ps[i][x] = static_cast<double>(sl[x]) * tau;
        ws.pe[i][x] = static_cast<double>(sl[x] + 1) * tau;
      }
    };
    const auto plan_p2p = [&](Scratch& ws, int r, int i) {
      fallback[static_cast<std::size_t>(r)] = !slot_keys || !detail::plan_p2p_po_rank(p, bk, ws.slots[i].data(), r, ws.p2p);
    };
    if (!offloads) {
      detail::for_each_item(workers, d, [&](int r, int w) {
        Scratch& ws = scratch[static_cast<std::size_t>(w)];
        plan(ws, r, 0, false);
        plan_p2p(ws, r, 0);
      });
    } else {
      // Pair by pair (a rank alone when pairs are not staggered).
      const int step = costs.stagger_pairs ? 2 : 1, pairs = (d + step - 1) / step;
      // A pair placed once the ASAP run has finished settles at once, while its lists are in
      // cache; the others after this step.
      const auto settle = [&](Scratch& ws, int pair, bool planned_now) {
        const int r0 = pair * step, n = std::min(step, d - r0);
        const double* release[2] = {nullptr, nullptr};
        for (int i = 0; i < n; ++i) release[i] = rs[static_cast<std::size_t>(r0 + i)].data();
        const auto planned = [&] {
          if (!planned_now)
            for (int i = 0; i < n; ++i) plan(ws, r0 + i, i, true);
          return std::pair<const std::vector<double>*, const std::vector<double>*>{ws.ps, ws.pe};
        };
        detail::settle_pair(p, r0, n, release, planned, ws.place, ws.settle);
      };
      bool timed = false;  // the ASAP run has finished
      std::vector<char> settled(static_cast<std::size_t>(pairs));
      detail::for_each_item(workers, 1 + pairs, [&](int item, int w) {
        if (item == 0) {
          detail::asap_into<false>(p, costs, dur, out.data(), ends);
          detail::publish(timed);
          return;
        }
        Scratch& ws = scratch[static_cast<std::size_t>(w)];
        const int pair = item - 1, r0 = pair * step, n = std::min(step, d - r0);
        for (int i = 0; i < n; ++i) {
          plan(ws, r0 + i, i, true);
          plan_p2p(ws, r0 + i, i);
        }
        detail::place_pair(p, r0, n, ws.ps, ws.pe, false, ws.place, ws.settle);
        if (detail::published(timed)) {
          settle(ws, pair, true);
          settled[static_cast<std::size_t>(pair)] = 1;
        }
      });
      detail::for_each_item(workers, pairs, [&](int pair, int w) {
        if (!settled[static_cast<std::size_t>(pair)]) settle(scratch[static_cast<std::size_t>(w)], pair, false);
      });
    }
    for (int r = 0; r < d; ++r)
      if (fallback[static_cast<std::size_t>(r)]) detail::plan_p2p_rank(p, r, end);
    return;
  }
  switch (spec.family) {
    case Family::one_f1b: detail::order_1f1b(p); break;
    case Family::interleaved_1f1b: detail::order_interleaved(p); break;
    case Family::grouped: detail::order_grouped(p); break;
  }
  // Every other family plans on its compute-only ASAP timeline. Both timelines meet every
  // dependency with time to spare, which is all offload placement and the P2P plan need.
  std::vector<std::vector<double>> ps(static_cast<std::size_t>(d)), pe(static_cast<std::size_t>(d));
  std::vector<detail::TimesOut> out(static_cast<std::size_t>(d));
  for (std::size_t r = 0; r < ps.size(); ++r) {
    ps[r].resize(p.ranks[r].compute.size());
    out[r].compute_start = ps[r].data();
  }
  const std::vector<double> dur = detail::duration_table(costs, shape.stages());
  std::vector<detail::UnitEnds> ends = detail::asap_scratch(p);
  detail::asap_into<false>(p, costs, dur, out.data(), ends);
  for (std::size_t r = 0; r < ps.size(); ++r) {
    const auto& comp = p.ranks[r].compute;
    pe[r].resize(comp.size());
    for (std::size_t x = 0; x < comp.size(); ++x)
      pe[r][x] = ps[r][x] + detail::table_duration(dur.data(), comp[x]);
  }
  if (offloads) {
    detail::OffloadScratch scratch;
    for (int r = 0; r < d; ++r) detail::place_offloads(p, r, ps[static_cast<std::size_t>(r)], pe[static_cast<std::size_t>(r)], &scratch);
  }
  const auto end = [&](int rank, std::size_t x, const Op&) { return pe[static_cast<std::size_t>(rank)][x]; };
  for (int r = 0; r < d; ++r) detail::plan_p2p_rank(p, r, end);
}

/// Builds the op lists of `spec` for `shape` under `costs` (unit costs and k = 1 by default).
/// constexpr: with a constant shape and costs, usable in static_assert. Throws shape_error
/// naming the bad value and its allowed range.
constexpr Program build(const ScheduleSpec& spec, const Shape& shape, const Costs& costs = {}) {
  Program p;
  build_into(p, spec, shape, costs);
  return p;
}

}  // namespace pipeoffload
