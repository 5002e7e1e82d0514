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
  const Op* const comp = rp.compute.data();
  const Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  const double* const cs = rs.compute_start.data();
  const double* const ce = rs.compute_end.data();
  const double* const ks = rs.copy_start.data();
  const double* const ke = rs.copy_end.data();
  const bool unit = costs.unit_bytes.empty();
  // The cursors' current events: time and change of alive bytes; x, y = past the op that made it.
  std::size_t x = 0, y = 0;
  double ct = 0, cd = 0, kt = 0, kd = 0;
  bool cv = false, kv = false;
  const auto next_compute = [&]() {
    for (; x < nc; ++x) {
      const Op& op = comp[x];
      if (op.kind == OpKind::F) { ct = cs[x]; cd = unit ? 1.0 : costs.bytes(op.stage); }  // acquires at its start
      else if (op.kind == OpKind::W || op.kind == OpKind::BW) { ct = ce[x]; cd = -(unit ? 1.0 : costs.bytes(op.stage)); }  // releases at its end
      else continue;
      ++x;
      cv = true;
      return;
    }
    cv = false;
  };
  const auto next_copy = [&]() {
    for (; y < nk; ++y) {
      const Op& op = copy[y];
      if (op.kind == OpKind::R) { kt = ks[y]; kd = unit ? 1.0 : costs.bytes(op.stage); }
      else if (op.kind == OpKind::O) { kt = ke[y]; kd = -(unit ? 1.0 : costs.bytes(op.stage)); }
      else continue;
      ++y;
      kv = true;
      return;
    }
    kv = false;
  };
  next_compute();
  next_copy();
  double alive = 0, peak = rs.peak;
  auto& mem = rs.memory;
  mem.clear();
  mem.reserve((2 * nc) / 3 + nk);
  while (cv || kv) {
    // Earlier first; at equal times a release before an acquisition (half-open intervals).
    const bool take_comp = !kv || (cv && (ct < kt || (ct == kt && cd <= kd)));
    const double t = take_comp ? ct : kt;
    alive += take_comp ? cd : kd;
    peak = std::max(peak, alive);
    if (!mem.empty() && mem.back().time == t) mem.back().alive = alive;
    else mem.push_back({t, alive});
    if (take_comp) next_compute();
    else next_copy();
  }
  rs.peak = peak;
}

}  // namespace detail

/// Simulates `p` under `costs` (the orders, edges and P2P plan of `p`, the durations of
/// `costs`). Throws schedule_error if the orders cannot run.
constexpr SimResult simulate(const Program& p, const Costs& costs) {
  SimResult res;
  res.ranks.resize(p.ranks.size());
  std::vector<detail::TimesOut> out(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    RankSim& rs = res.ranks[r];
    rs.compute_start.resize(p.ranks[r].compute.size());
    rs.compute_end.resize(p.ranks[r].compute.size());
    rs.copy_start.resize(p.ranks[r].copy.size());
    rs.copy_end.resize(p.ranks[r].copy.size());
    out[r] = {&rs.compute_start, &rs.compute_end, &rs.copy_start, &rs.copy_end};
  }
  detail::asap_into<true>(p, costs, out.data());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    RankSim& rs = res.ranks[r];
    rs.busy = out[r].busy;
    res.makespan = std::max(res.makespan, out[r].last);
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
