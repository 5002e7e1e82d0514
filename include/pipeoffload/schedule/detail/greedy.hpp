// pipeoffload/schedule/detail/greedy.hpp: step 1 of build() for ZB-H2: the memory-capped list
// schedule (order_greedy; v_shape.hpp also runs it for ZB-V and V-Half, and keeps it where it is
// faster), and each zero-bubble family's cap in units (greedy_cap). The list schedule's rules,
// and why it cannot deadlock: docs/schedules.md, "The list schedule".
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "../program.hpp"
#include "asap.hpp"

namespace pipeoffload::detail {

/// The per-rank cap, in units, of a zero-bubble family for d ranks (ZB-H1's peak for zb_h1).
constexpr int greedy_cap(Family f, int d) {
  switch (f) {
    case Family::zb_h1:
      return d;
    case Family::zb_h2:
      return 2 * d;
    case Family::zb_v:
      return 2 * d;
    case Family::v_half:
      return d + 2 - d % 2;  // d + 1 for odd d
    case Family::v_min:
      return 2 * ((d + 1) / 3) + 2;  // not a cap: the peak its pattern reaches (about a third of 2d)
    case Family::dualpipe_v:
      return 2 * d + 1;  // not a cap: rank 0's peak in DeepSeek's order (their "PP + 1" with PP = 2d stages)
    default:
      return 0;
  }
}

/// Every rank's compute order of a zero-bubble family (see the file comment), for
/// p.shape (its placement set) under `costs`. Throws schedule_error if the run cannot finish
/// (it cannot, by the argument above; the check guards the implementation).
constexpr void order_greedy(Program& p, const Costs& costs, int cap) {
  const Shape sh = p.shape;
  const int d = sh.d, v = sh.v, m = sh.m, S = sh.stages();
  const auto unit = [m](int s, int mb) { return static_cast<std::size_t>(s) * static_cast<std::size_t>(m) + mb; };
  std::vector<double> fend(static_cast<std::size_t>(S) * static_cast<std::size_t>(m), -1.0), bend(fend);
  struct Rank {
    std::vector<int> next_f, next_b;  // per chunk: the next microbatch of its F and of its B
    std::vector<std::pair<int, int>> pending_w;
    std::size_t w_head = 0;
    double free = 0;
    int held = 0, reserved = 0;
  };
  std::vector<Rank> rk(static_cast<std::size_t>(d));
  for (auto& r : rk) {
    r.next_f.assign(static_cast<std::size_t>(v), 0);
    r.next_b.assign(static_cast<std::size_t>(v), 0);
    r.pending_w.reserve(static_cast<std::size_t>(v) * static_cast<std::size_t>(m));
  }
  for (auto& rp : p.ranks) rp.compute.reserve(3 * static_cast<std::size_t>(v) * static_cast<std::size_t>(m));
  // Decision events (time, rank), earliest first, then lowest rank.
  struct Event {
    double t;
    int r;
  };
  const auto later = [](const Event& a, const Event& b) { return a.t != b.t ? a.t > b.t : a.r > b.r; };
  std::vector<Event> events;
  const auto push = [&](double t, int r) {
    events.push_back({t, r});
    std::push_heap(events.begin(), events.end(), later);
  };
  for (int r = 0; r < d; ++r) push(0.0, r);
  const auto hop = [&](int s) { return sh.crosses(s) ? costs.comm : 0.0; };  // between stages s and s+1
  std::size_t left = 3 * static_cast<std::size_t>(S) * static_cast<std::size_t>(m);
  while (!events.empty()) {
    std::pop_heap(events.begin(), events.end(), later);
    const Event ev = events.back();
    events.pop_back();
    Rank& R = rk[static_cast<std::size_t>(ev.r)];
    if (R.free > ev.t) continue;  // busy: its own event at R.free decides
    const double t = ev.t;
    Op pick{};
    bool found = false;
    // 1. A ready B: lowest microbatch, then highest stage.
    for (int c = 0; c < v; ++c) {
      const int mb = R.next_b[static_cast<std::size_t>(c)];
      if (mb >= m) continue;
      const int s = sh.stage_of(ev.r, c);
      const double f = fend[unit(s, mb)];
      if (f < 0 || f > t) continue;
      if (s < S - 1) {
        const double g = bend[unit(s + 1, mb)];
        if (g < 0 || g + hop(s) > t) continue;
      }
      if (!found || mb < pick.mb || (mb == pick.mb && s > pick.stage)) {
        pick = Op{OpKind::B, s, mb};
        found = true;
      }
    }
    // 2. A ready F the cap allows: highest stage first.
    if (!found)
      for (int c = v - 1; c >= 0 && !found; --c) {
        const int mb = R.next_f[static_cast<std::size_t>(c)];
        if (mb >= m) continue;
        const int s = sh.stage_of(ev.r, c);
        if (s > 0) {
          const double f = fend[unit(s - 1, mb)];
          if (f < 0 || f + hop(s - 1) > t) continue;
        }
        // The first chunk admits the microbatch (its v units, the later ones reserved).
        if (c == 0 && R.held + R.reserved + v > cap) continue;
        pick = Op{OpKind::F, s, mb};
        found = true;
      }
    // 3. The oldest pending W.
    if (!found && R.w_head < R.pending_w.size()) {
      const auto [s, mb] = R.pending_w[R.w_head];
      pick = Op{OpKind::W, s, mb};
      found = true;
    }
    if (!found) continue;  // idle until a message arrives (its producer pushed the event)
    const double end = t + duration(costs, pick);
    R.free = end;
    const int c = sh.chunk_of(pick.stage);
    switch (pick.kind) {
      case OpKind::F:
        fend[unit(pick.stage, pick.mb)] = end;
        ++R.next_f[static_cast<std::size_t>(c)];
        ++R.held;
        R.reserved += c == 0 ? v - 1 : -1;
        if (pick.stage < S - 1) push(end + hop(pick.stage), sh.rank_of(pick.stage + 1));
        if (pick.stage == S - 1) push(end, ev.r);
        break;
      case OpKind::B:
        bend[unit(pick.stage, pick.mb)] = end;
        ++R.next_b[static_cast<std::size_t>(c)];
        R.pending_w.push_back({static_cast<int>(pick.stage), pick.mb});
        if (pick.stage > 0) push(end + hop(pick.stage - 1), sh.rank_of(pick.stage - 1));
        break;
      case OpKind::W:
        ++R.w_head;
        --R.held;
        break;
      default:
        break;
    }
    p.ranks[static_cast<std::size_t>(ev.r)].compute.push_back(pick);
    push(end, ev.r);
    --left;
  }
  if (left != 0)
    throw schedule_error("zero-bubble list schedule: " + num(static_cast<long long>(left)) +
                         " passes could not be placed (cap " + num(cap) + " units); this is a bug in pipeoffload");
}

}  // namespace pipeoffload::detail
