// pipeoffload/sim/simulate.hpp: discrete-event simulation of a built schedule.
//
// Execution is as-soon-as-possible under each rank's orders, the data dependencies (+T_comm
// between ranks) and the cross-stream edges (DESIGN.md section 3): exactly how the runtime
// executes, so the simulated makespan and peaks are the numbers the runtime must meet.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "../schedule/detail/asap.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// One point of a memory timeline: from `time` on, `alive` bytes (or units) are alive.
struct MemoryPoint {
  double time = 0;
  double alive = 0;
};

/// One rank's simulated execution.
struct RankSim {
  std::vector<double> compute_start, compute_end;  ///< parallel to RankProgram::compute
  std::vector<double> copy_start, copy_end;        ///< parallel to RankProgram::copy
  double busy = 0;    ///< total compute time on the rank
  double bubble = 0;  ///< makespan - busy: the rank's idle compute time
  double peak = 0;    ///< most activation bytes (units with unit costs) alive at once
  int warmup = 0;     ///< forwards before the first B (or BW)
  std::vector<MemoryPoint> memory;  ///< alive activation after each change, time-ordered
};

struct SimResult {
  double makespan = 0;
  std::vector<RankSim> ranks;

  /// Idle time / makespan, averaged over ranks.
  constexpr double bubble_fraction() const {
    if (ranks.empty() || makespan <= 0) return 0;
    double s = 0;
    for (const auto& r : ranks) s += r.bubble;
    return s / (makespan * static_cast<double>(ranks.size()));
  }
  constexpr double max_peak() const {
    double x = 0;
    for (const auto& r : ranks) x = std::max(x, r.peak);
    return x;
  }
};

namespace detail {

/// Alive activation over time from the start/end of one rank's ops (DESIGN.md section 1): a
/// unit is alive from its F's start to its W's (or BW's) end, except between the end of its
/// offload and the start of its reload. Half-open intervals: at equal times releases count
/// before acquisitions.
constexpr void memory_timeline(const Costs& costs, const RankProgram& rp, RankSim& rs) {
  // Each stream's events are already in time order (an op's end is at or before the next
  // op's start), so one cursor per stream merges them without a sort.
  struct Cursor {
    const std::vector<Op>* ops;
    const std::vector<double>* start;
    const std::vector<double>* end;
    std::size_t x = 0;
    double t = 0, delta = 0;  // the cursor's current event
    bool valid = false;
  };
  const auto advance = [&](Cursor& c) {
    c.valid = false;
    for (; c.x < c.ops->size(); ++c.x) {
      const Op& op = (*c.ops)[c.x];
      const double bytes = costs.bytes(op.stage);
      switch (op.kind) {
        case OpKind::F: c.t = (*c.start)[c.x]; c.delta = bytes; break;   // acquires at its start
        case OpKind::R: c.t = (*c.start)[c.x]; c.delta = bytes; break;
        case OpKind::W:
        case OpKind::BW: c.t = (*c.end)[c.x]; c.delta = -bytes; break;   // releases at its end
        case OpKind::O: c.t = (*c.end)[c.x]; c.delta = -bytes; break;
        default: continue;
      }
      ++c.x;
      c.valid = true;
      return;
    }
  };
  Cursor comp{&rp.compute, &rs.compute_start, &rs.compute_end};
  Cursor copy{&rp.copy, &rs.copy_start, &rs.copy_end};
  advance(comp);
  advance(copy);
  double alive = 0;
  rs.memory.clear();
  rs.memory.reserve((2 * rp.compute.size()) / 3 + rp.copy.size());
  while (comp.valid || copy.valid) {
    // Earlier first; at equal times a release before an acquisition (half-open intervals).
    const bool take_comp = !copy.valid || (comp.valid && (comp.t < copy.t || (comp.t == copy.t && comp.delta <= copy.delta)));
    Cursor& c = take_comp ? comp : copy;
    alive += c.delta;
    rs.peak = std::max(rs.peak, alive);
    if (!rs.memory.empty() && rs.memory.back().time == c.t) rs.memory.back().alive = alive;
    else rs.memory.push_back({c.t, alive});
    advance(c);
  }
}

}  // namespace detail

/// Simulates `p` under `costs` (the orders, edges and P2P plan of `p`, the durations of
/// `costs`). Throws schedule_error if the orders cannot run.
constexpr SimResult simulate(const Program& p, const Costs& costs) {
  detail::Timing t = detail::asap(p, costs, true);
  SimResult res;
  res.ranks.resize(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    RankSim& rs = res.ranks[r];
    rs.compute_start = std::move(t.compute_start[r]);
    rs.compute_end = std::move(t.compute_end[r]);
    rs.copy_start = std::move(t.copy_start[r]);
    rs.copy_end = std::move(t.copy_end[r]);
    for (std::size_t x = 0; x < rs.compute_start.size(); ++x) {
      rs.busy += rs.compute_end[x] - rs.compute_start[x];
      res.makespan = std::max(res.makespan, rs.compute_end[x]);
    }
    for (double e : rs.copy_end) res.makespan = std::max(res.makespan, e);
    rs.warmup = warmup(p.ranks[r]);
    detail::memory_timeline(costs, p.ranks[r], rs);
  }
  for (auto& rs : res.ranks) rs.bubble = res.makespan - rs.busy;
  return res;
}

/// Simulates `p` under the costs it was built with.
constexpr SimResult simulate(const Program& p) { return simulate(p, p.costs); }

/// Rank `rank`'s simulated peak of alive activation (units under unit sizes, else bytes).
constexpr double peak(const Program& p, int rank) {
  detail::require_range("peak(program, rank): rank", rank, 0, p.shape.d - 1);
  return simulate(p).ranks[static_cast<std::size_t>(rank)].peak;
}

}  // namespace pipeoffload
