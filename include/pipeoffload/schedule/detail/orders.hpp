// pipeoffload/schedule/detail/orders.hpp: step 1 of build(): each rank's compute order (1F1B, ZB-H1's
// 1F1B with deferred W passes, Megatron's 1F1B-I, the GIS(g) building block of docs/design.md
// section 2 and its slot grid, Block). The other zero-bubble families: greedy.hpp, v_shape.hpp,
// dualpipe_v.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "../program.hpp"
#include "checks.hpp"
#include "numeric.hpp"

namespace pipeoffload {

namespace detail {

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

/// ZB-H1's orders: 1F1B with a split backward whose W passes rank i defers by up to `i`
/// (docs/schedules.md, "Zero-bubble families"). Rank i runs min(d-i, m) forwards, then for each microbatch k its
/// B(k), the oldest pending W passes while more than i are pending, and its next forward;
/// then the W passes left. Units held: 1F1B's d-i plus the i deferred, so d on every rank.
constexpr void order_zb_h1(Program& p) {
  const int d = p.shape.d, m = p.shape.m;
  for (int i = 0; i < d; ++i) {
    auto& ops = p.ranks[static_cast<std::size_t>(i)].compute;
    ops.reserve(3 * static_cast<std::size_t>(m));
    int f = 0, w = 0;
    for (; f < std::min(d - i, m); ++f) ops.push_back({OpKind::F, i, f});
    for (int k = 0; k < m; ++k) {
      ops.push_back({OpKind::B, i, k});
      for (; k + 1 - w > i; ++w) ops.push_back({OpKind::W, i, w});
      if (f < m) ops.push_back({OpKind::F, i, f++});
    }
    for (; w < m; ++w) ops.push_back({OpKind::W, i, w});
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

/// Geometry of the GIS(g) building block of a program (docs/design.md section 2): block slots,
/// the repeat period L = 3gv, and the shift of each rank on PO's planning grid.
struct Block {
  long long d = 1, v = 1, m = 1, g = 1, kp = 1, q = 1, L = 3, e = 0, groups = 1;
  FastDiv by_d;              // s / d, see chunk()
  std::vector<long long> a;  // a[c] = f(c, 0, 0): the part of f that depends on the chunk only

  constexpr explicit Block(const Program& p) : d(p.shape.d), v(p.shape.v), m(p.shape.m), g(p.group) {
    by_d = FastDiv(static_cast<std::uint64_t>(d), static_cast<std::uint64_t>(max_ranks) * max_chunks);
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
  constexpr long long f(long long c, long long j, long long i) const {
    return a[static_cast<std::size_t>(c)] + 3 * j + i;
  }
  /// Block slot of rank i's first backward.
  constexpr long long b0(long long i) const { return f(v - 1, 0, i) + 3 * (d - 1 - i) + 1; }
  /// Rank i's latest W slot (unshifted).
  constexpr long long last(long long i) const { return b0(i) + f(v - 1, g - 1, 0) + (groups - 1) * L + 1; }
  constexpr long long shift(long long i) const { return std::min(i, e); }
  /// Chunk of a stage, s / d without a division.
  constexpr long long chunk(int s) const { return static_cast<long long>(by_d(static_cast<std::uint64_t>(s))); }
  /// The slots of rank i's passes with g = 1 (PO), from two per-chunk tables: Block::slot
  /// with its terms that depend only on the rank and chunk added up once.
  struct RankGrid {
    std::vector<long long> base;  // [2c]: F(chunk c, mb 0); [2c+1]: B(stage of chunk c, mb 0)
    long long L = 3;
    FastDiv by_d;
    constexpr long long slot(const Op& op) const {
      const auto c = static_cast<std::size_t>(by_d(static_cast<std::uint64_t>(op.stage)));
      return op.kind == OpKind::F ? base[2 * c] + op.mb * L
                                  : base[2 * c + 1] + op.mb * L + (op.kind == OpKind::W ? 1 : 0);
    }
  };
  constexpr RankGrid grid(long long i) const {
    RankGrid gr;
    gr.L = L;
    gr.by_d = by_d;
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
    const long long base =
        op.kind == OpKind::F ? f(cc, j, i) : b0(i) + f(v - 1 - cc, j, 0) + (op.kind == OpKind::W ? 1 : 0);
    return base + n * L + shift(i);
  }
};

/// Rank i's compute order under the GIS(g) building block repeated every L = 3gv slots
/// (docs/design.md section 2): its passes sorted by slot.
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
      Op op{};            // kind, stage and member j (in mb) of the block pass at this residue
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

}  // namespace detail
}  // namespace pipeoffload
