// pipeoffload/schedule/detail/dualpipe_v.hpp: step 1 of build() for DualPipeV: DeepSeek's
// DualPipe cut in half onto the V placement, its fixed steps per rank written as passes
// (order_dualpipe_v; docs/schedules.md, "Zero-bubble families").
#pragma once

#include <cstddef>
#include <vector>

#include "../program.hpp"

namespace pipeoffload::detail {

/// DualPipeV's orders (DeepSeek's DualPipe cut in half onto the V placement; v = 2, m >= 2d,
/// checked by check_shape). Rank r of d runs eight steps; "F0"/"F1" is the next forward of its
/// chunk 0 (stage r) or chunk 1 (stage 2d-1-r), "B" a full backward (B then W at once), "Bz" a
/// backward whose W is queued, "W" the oldest queued W:
///   1. 2(d-1-r) x F0                2. r+1 x (F0, F1)             3. d-1-r x (Bz1, W, F1)
///   4. m-2d+r+1 x (F0, B1, F1, B0)  5. d-1-r x (B1, F1, B0)
///   6. r+1 x (B1, B0), the W of the second half of them queued (from the middle pass on:
///      B1's on odd ranks, B0's on even ones)
///   7. d-1-r x (W, Bz0)             8. the queued W passes.
/// DeepSeek overlaps each (F, B) pair of steps 4 and 5 within the rank; this cost model runs
/// them one after the other (F first), so its bubble here is that of the plain order.
constexpr void order_dualpipe_v(Program& p) {
  const Shape sh = p.shape;
  const int d = sh.d, m = sh.m;
  for (int r = 0; r < d; ++r) {
    auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
    ops.reserve(6 * static_cast<std::size_t>(m));
    const int stage[2] = {sh.stage_of(r, 0), sh.stage_of(r, 1)};
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::vector<Op> queued;  // W passes in the order their B ran
    std::size_t head = 0;
    const auto fwd = [&](int c) { ops.push_back({OpKind::F, stage[c], next_f[c]++}); };
    const auto bwd = [&](int c, bool queue_w) {
      const int mb = next_b[c]++;
      ops.push_back({OpKind::B, stage[c], mb});
      const Op w{OpKind::W, stage[c], mb};
      if (queue_w)
        queued.push_back(w);
      else
        ops.push_back(w);
    };
    const auto wgt = [&] { ops.push_back(queued[head++]); };
    for (int i = 0; i < 2 * (d - 1 - r); ++i) fwd(0);
    for (int i = 0; i < r + 1; ++i) {
      fwd(0);
      fwd(1);
    }
    for (int i = 0; i < d - 1 - r; ++i) {
      bwd(1, true);
      wgt();
      fwd(1);
    }
    for (int i = 0; i < m - 2 * d + r + 1; ++i) {
      fwd(0);
      bwd(1, false);
      fwd(1);
      bwd(0, false);
    }
    for (int i = 0; i < d - 1 - r; ++i) {
      bwd(1, false);
      fwd(1);
      bwd(0, false);
    }
    bool zb = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) zb = true;
      bwd(1, zb);
      if (i == (r + 1) / 2 && r % 2 == 0) zb = true;
      bwd(0, zb);
    }
    for (int i = 0; i < d - 1 - r; ++i) {
      wgt();
      bwd(0, true);
    }
    while (head < queued.size()) wgt();
  }
}

}  // namespace pipeoffload::detail
