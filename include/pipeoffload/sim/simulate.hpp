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
#include "../schedule/detail/parallel.hpp"
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

/// Number of points rank `rp`'s memory timeline may hold: one per event (an F's start, a W's
/// or BW's end, an offload's end, a reload's start), before events at equal times merge.
constexpr std::size_t memory_events(const RankProgram& rp) {
  std::size_t n = rp.copy.size();
  for (const Op& op : rp.compute) n += (op.kind == OpKind::F || op.kind == OpKind::W || op.kind == OpKind::BW) ? 1 : 0;
  return n;
}

/// Alive activation over time from the start/end of one rank's ops (DESIGN.md section 1): a
/// unit is alive from its F's start to its W's (or BW's) end, except between the end of its
/// offload and the start of its reload. Half-open intervals: at equal times releases count
/// before acquisitions. The timeline replaces `rs.memory`, keeping its capacity (simulate
/// makes the vector while the ASAP run goes, so that this pass takes no page faults). With
/// `dur` (see duration_table), each op's end is written on the way: its start plus its
/// duration, the sum the ASAP run made; without, the ends are read (a measured trace).
constexpr void memory_timeline(const Costs& costs, const RankProgram& rp, RankSim& rs, const std::vector<double>* dur = nullptr) {
  // Each stream's events are already in time order (an op's end is at or before the next
  // op's start), so one cursor per stream merges them without a sort.
  const Op* const comp = rp.compute.data();
  const Op* const copy = rp.copy.data();
  const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
  const double* const cs = rs.compute_start.data();
  double* const ce = rs.compute_end.data();
  const double* const ks = rs.copy_start.data();
  double* const ke = rs.copy_end.data();
  const double* const length = dur != nullptr ? dur->data() : nullptr;
  const bool unit = costs.unit_bytes.empty();
  // The cursors' current events: time and change of alive bytes; x, y = past the op that made it.
  std::size_t x = 0, y = 0;
  double ct = 0, cd = 0, kt = 0, kd = 0;
  bool cv = false, kv = false;
  const auto next_compute = [&]() {
    for (; x < nc; ++x) {
      const Op& op = comp[x];
      if (length != nullptr) ce[x] = cs[x] + table_duration(length, op);
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
      if (length != nullptr) ke[y] = ks[y] + table_duration(length, op);
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
  if (mem.capacity() == 0) mem.reserve(memory_events(rp));
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
///
/// The ASAP run visits the ranks in turn on one thread; everything else is per rank and runs
/// on the machine's cores (detail/parallel.hpp): the start times' vectors are made before
/// it, the other outputs' vectors alongside it (one item each rank, the run being item 0),
/// and the end times and memory timelines are filled after it. So, on more than one thread, a
/// memory timeline's vector is made before its length is known: it keeps room for one point
/// per event (with unit costs most events coincide: PO-F d=64 v=8 m=512 keeps 16.7 MB for
/// 6.7 MB of points).
constexpr SimResult simulate(const Program& p, const Costs& costs) {
  SimResult res;
  const int d = static_cast<int>(p.ranks.size());
  res.ranks.resize(p.ranks.size());
  std::vector<detail::TimesOut> out(p.ranks.size());
  std::size_t ops = 0;
  for (const RankProgram& rp : p.ranks) ops += rp.compute.size() + rp.copy.size();
  const std::vector<double> dur = detail::duration_table(costs, p.shape.stages());
  const int workers = detail::worker_count(ops, d);
  detail::for_each_item(workers, d, [&](int r, int) {
    const auto ru = static_cast<std::size_t>(r);
    RankSim& rs = res.ranks[ru];
    rs.compute_start.resize(p.ranks[ru].compute.size());
    rs.copy_start.resize(p.ranks[ru].copy.size());
    out[ru] = {rs.compute_start.data(), rs.copy_start.data()};
  });
  detail::for_each_item(workers, 1 + d, [&](int item, int) {
    if (item == 0) {
      detail::asap_into<true>(p, costs, dur, out.data());
      return;
    }
    const auto ru = static_cast<std::size_t>(item - 1);
    RankSim& rs = res.ranks[ru];
    rs.compute_end.resize(p.ranks[ru].compute.size());
    rs.copy_end.resize(p.ranks[ru].copy.size());
    if (workers > 1) rs.memory.resize(detail::memory_events(p.ranks[ru]));  // its pages written now, off the critical path
  });
  detail::for_each_item(workers, d, [&](int r, int) {
    const auto ru = static_cast<std::size_t>(r);
    const RankProgram& rp = p.ranks[ru];
    RankSim& rs = res.ranks[ru];
    rs.busy = out[ru].busy;
    rs.warmup = warmup(rp);
    detail::memory_timeline(costs, rp, rs, &dur);
  });
  for (const auto& o : out) res.makespan = std::max(res.makespan, o.last);
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
