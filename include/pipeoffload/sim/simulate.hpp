// pipeoffload/sim/simulate.hpp: discrete-event simulation of a built schedule.
//
// Execution is as-soon-as-possible under each rank's orders, the data dependencies (+T_comm
// between ranks) and the cross-stream edges (docs/design.md section 3): exactly how the runtime
// executes, so the simulated makespan and peaks are the numbers the runtime must meet.
/// @file
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
  double time = 0;   ///< when the change happens (Costs' time unit)
  double alive = 0;  ///< bytes (or units) alive from then on
};

/// One rank's simulated execution.
struct RankSim {
  std::vector<double> compute_start,  ///< start of each compute op, parallel to RankProgram::compute
      compute_end;                    ///< end of each compute op, parallel to RankProgram::compute
  std::vector<double> copy_start,     ///< start of each copy op, parallel to RankProgram::copy
      copy_end;                       ///< end of each copy op, parallel to RankProgram::copy
  double busy = 0;                    ///< total compute time on the rank
  double bubble = 0;                  ///< makespan - busy: the rank's idle compute time
  double peak = 0;                    ///< most activation bytes (units with unit costs) alive at once, stashes included
  double stash_peak = 0;              ///< most stash bytes (Costs::stash_bytes) alive at once
  int warmup = 0;                     ///< forwards before the first B (or BW)
  std::vector<MemoryPoint> memory;    ///< alive activation after each change, time-ordered
};

/// A program's simulated execution under its cost model (simulate()).
struct SimResult {
  double makespan = 0;         ///< when the last op of any rank ends (Costs' time unit)
  std::vector<RankSim> ranks;  ///< one per rank, d of them

  /// Idle time / makespan, averaged over ranks.
  constexpr double bubble_fraction() const {
    if (ranks.empty() || makespan <= 0) return 0;
    double s = 0;
    for (const auto& r : ranks) s += r.bubble;
    return s / (makespan * static_cast<double>(ranks.size()));
  }
  /// The largest RankSim::peak over ranks.
  constexpr double max_peak() const {
    double x = 0;
    for (const auto& r : ranks) x = std::max(x, r.peak);
    return x;
  }
};

namespace detail {

/// Number of points rank `rp`'s memory timeline may hold: one per event (an F's start, a W's
/// or BW's end, an offload's end, a reload's start, and with stashes a B's start), before
/// events at equal times merge.
constexpr std::size_t memory_events(const RankProgram& rp, const Costs& costs) {
  const bool stashes = !costs.stash_bytes.empty();
  std::size_t n = rp.copy.size();
  for (const Op& op : rp.compute) n += op.kind != OpKind::B || stashes ? 1 : 0;
  return n;
}

/// One rank's outputs that follow from its start times, filled in as far as the start times
/// are known, so that a thread can fill them while the ASAP run goes (simulate) and another
/// finish them: each op's end, the rank's busy time and last end, and its memory timeline.
///
/// Ends: an op's end is its start plus its duration (`dur`, see duration_table), the sum the
/// run made. Busy: the sum of the compute ops' end - start, in stream order. Memory (docs/design.md
/// section 1): a unit is alive from its F's start to its W's (or BW's) end, except between the
/// end of its offload and the start of its reload; a stash (Costs::stash) from its B's start
/// to its W's end, or for a fused BW during the op (the runtime's B half leaves it for the W
/// half); half-open intervals, so at equal times releases count before acquisitions. Each stream's events are in time order (an op's end is
/// at or before the next op's start), so one cursor per stream merges them without a sort; the
/// merge stops where a stream's next event is not known yet.
class RankFollower {
 public:
  /// Fills what follows from the first `nc` compute and `nk` copy ops' start times (and, if
  /// `dur` is null, their end times, as in a measured trace). Counts only grow from call to
  /// call; the rank is done once they reach its op counts.
  constexpr void advance(const Costs& costs, const RankProgram& rp, RankSim& rs, const double* dur, std::size_t nc,
                         std::size_t nk) {
    if (!begun_) {
      rs.memory.clear();
      if (rs.memory.capacity() == 0) rs.memory.reserve(memory_events(rp, costs));
      begun_ = true;
    }
    State s = state_;  // worked on in registers: the stores below could otherwise alias it
    const Op* const comp = rp.compute.data();
    const Op* const copy = rp.copy.data();
    const double* const cs = rs.compute_start.data();
    double* const ce = rs.compute_end.data();
    const double* const ks = rs.copy_start.data();
    double* const ke = rs.copy_end.data();
    if (dur != nullptr) {
      for (; s.xe < nc; ++s.xe) {
        const double end = cs[s.xe] + table_duration(dur, comp[s.xe]);
        ce[s.xe] = end;
        s.busy += end - cs[s.xe];
        s.last = std::max(s.last, end);
      }
      for (; s.ye < nk; ++s.ye) {
        const double end = ks[s.ye] + table_duration(dur, copy[s.ye]);
        ke[s.ye] = end;
        s.last = std::max(s.last, end);
      }
    }
    const bool unit = costs.unit_bytes.empty();
    const std::size_t all_c = rp.compute.size(), all_k = rp.copy.size();
    // Each cursor's next event (time, change of alive bytes), or why there is none.
    const auto next_compute = [&] {
      for (; s.x < nc; ++s.x) {
        const Op& op = comp[s.x];
        const double stash = op.kind == OpKind::F ? 0.0 : costs.stash(op.stage);
        if (op.kind == OpKind::F) {
          s.ct = cs[s.x];
          s.cd = unit ? 1.0 : costs.bytes(op.stage);
          s.cs = 0;
        }  // acquires at its start
        else if ((op.kind == OpKind::B || (op.kind == OpKind::BW && !s.opened)) && stash > 0) {
          s.ct = cs[s.x];
          s.cd = s.cs = stash;
          if (op.kind == OpKind::BW) {  // its end is the op's second event
            s.opened = true;
            s.cstate = Cursor::event;
            return;
          }
        }  // its stash, from its start
        else if (op.kind == OpKind::W || op.kind == OpKind::BW) {
          s.ct = ce[s.x];
          s.cd = -(unit ? 1.0 : costs.bytes(op.stage)) - stash;
          s.cs = -stash;
          s.opened = false;
        }  // releases at its end
        else
          continue;
        ++s.x;
        s.cstate = Cursor::event;
        return;
      }
      s.cstate = s.x == all_c ? Cursor::done : Cursor::unknown;
    };
    // The copy stream's events: one cursor over every copy op with one stream; with two
    // (Costs::copy_streams) one over the offloads (k) and one over the reloads (k2), each
    // stream's own events being in time order while the two may interleave in any way.
    const bool two = costs.duplex();
    const auto next_copy = [&](std::size_t& y, double& t, double& delta, Cursor& state, int only) {
      for (; y < nk; ++y) {
        const Op& op = copy[y];
        if (only >= 0 && (op.kind == OpKind::R) != (only == 1)) continue;
        if (op.kind == OpKind::R) {
          t = ks[y];
          delta = unit ? 1.0 : costs.bytes(op.stage);
        } else if (op.kind == OpKind::O) {
          t = ke[y];
          delta = -(unit ? 1.0 : costs.bytes(op.stage));
        } else
          continue;
        ++y;
        state = Cursor::event;
        return;
      }
      state = y == all_k ? Cursor::done : Cursor::unknown;
    };
    const auto next_k = [&] { next_copy(s.y, s.kt, s.kd, s.kstate, two ? 0 : -1); };
    const auto next_k2 = [&] {
      if (two)
        next_copy(s.y2, s.kt2, s.kd2, s.kstate2, 1);
      else
        s.kstate2 = Cursor::done;
    };
    if (s.cstate == Cursor::unknown) next_compute();
    if (s.kstate == Cursor::unknown) next_k();
    if (s.kstate2 == Cursor::unknown) next_k2();
    auto& mem = rs.memory;
    while (s.cstate != Cursor::unknown && s.kstate != Cursor::unknown && s.kstate2 != Cursor::unknown &&
           (s.cstate == Cursor::event || s.kstate == Cursor::event || s.kstate2 == Cursor::event)) {
      // Earlier first; at equal times a release before an acquisition (half-open intervals),
      // then compute before copies.
      int take = -1;  // 0: compute, 1: copy, 2: the reloads' copy stream
      double t = 0, delta = 0;
      const auto consider = [&](int which, Cursor st, double et, double ed) {
        if (st == Cursor::event && (take < 0 || et < t || (et == t && ed < delta))) {
          take = which;
          t = et;
          delta = ed;
        }
      };
      consider(0, s.cstate, s.ct, s.cd);
      consider(1, s.kstate, s.kt, s.kd);
      consider(2, s.kstate2, s.kt2, s.kd2);
      s.alive += delta;
      s.peak = std::max(s.peak, s.alive);
      if (take == 0) {
        s.stash += s.cs;
        s.stash_peak = std::max(s.stash_peak, s.stash);
      }
      if (!mem.empty() && mem.back().time == t)
        mem.back().alive = s.alive;
      else
        mem.push_back({t, s.alive});
      if (take == 0)
        next_compute();
      else if (take == 1)
        next_k();
      else
        next_k2();
    }
    rs.peak = s.peak;
    rs.stash_peak = s.stash_peak;
    if (dur != nullptr) rs.busy = s.busy;
    state_ = s;
  }
  constexpr std::size_t compute_filled() const { return state_.xe; }
  constexpr std::size_t copy_filled() const { return state_.ye; }
  constexpr double last_end() const { return state_.last; }  ///< max(0, every end filled)

 private:
  enum class Cursor : char { unknown, event, done };
  struct State {
    std::size_t xe = 0, ye = 0;  // ends filled below these
    double busy = 0, last = 0;
    std::size_t x = 0, y = 0, y2 = 0;  // the merge's cursors: past the op of the current event
    double ct = 0, cd = 0, kt = 0, kd = 0, kt2 = 0, kd2 = 0, alive = 0, peak = 0;
    double cs = 0, stash = 0, stash_peak = 0;  // the compute event's change of stash bytes; alive; peak
    bool opened = false;                       // the BW at x has had its start event
    Cursor cstate = Cursor::unknown, kstate = Cursor::unknown, kstate2 = Cursor::unknown;
  };
  State state_;
  bool begun_ = false;
};

/// Rank `rp`'s memory timeline and peak (see RankFollower) from the start and end times in
/// `rs` (a measured trace). The timeline replaces `rs.memory`, keeping its capacity.
constexpr void memory_timeline(const Costs& costs, const RankProgram& rp, RankSim& rs) {
  RankFollower f;
  f.advance(costs, rp, rs, nullptr, rp.compute.size(), rp.copy.size());
}

}  // namespace detail

/// simulate() into `res`, reusing the memory its vectors hold (see build_into): the result
/// is the one simulate() returns, whatever `res` held before. On an exception `res` is a
/// valid SimResult with unspecified contents.
///
/// The ASAP run visits the ranks in turn on one thread; everything else is per rank and runs
/// on the machine's cores (detail/parallel.hpp):
///   1. the start and end times' vectors and the run's scratch;
///   2. the run, and beside it the memory timelines' vectors (one item each rank), then, on
///      more than one thread, one item that follows the run: it fills each rank's end times
///      and memory timeline as far as the run has timed the rank's ops (RankFollower);
///   3. per rank, the rest.
/// A memory timeline's vector is made before its length is known: it keeps room for one point
/// per event (with unit costs most events coincide: PO-F d=64 v=8 m=512 keeps 16.7 MB for
/// 6.7 MB of points).
constexpr void simulate_into(SimResult& res, const Program& p, const Costs& costs, Workers threads = {}) {
  const int d = static_cast<int>(p.ranks.size());
  const auto du = static_cast<std::size_t>(d);
  res.makespan = 0;
  res.ranks.resize(du);  // every field of every rank is overwritten below
  std::vector<detail::TimesOut> out(du);
  std::size_t ops = 0;
  for (const RankProgram& rp : p.ranks) ops += rp.compute.size() + rp.copy.size();
  const std::vector<double> dur = detail::duration_table(costs, p.shape.stages());
  const int workers = detail::worker_count(ops, d, threads);
  const bool follow = workers > 1;
  std::vector<detail::UnitEnds> ends;
  std::vector<std::size_t> progress(follow ? 2 * du : 0);  // see TimesOut::progress
  detail::for_each_item(workers, 1 + d, [&](int item, int) {
    if (item == 0) {
      ends = detail::asap_scratch(p);
      return;
    }
    const auto ru = static_cast<std::size_t>(item - 1);
    RankSim& rs = res.ranks[ru];
    rs.compute_start.resize(p.ranks[ru].compute.size());
    rs.copy_start.resize(p.ranks[ru].copy.size());
    rs.compute_end.resize(p.ranks[ru].compute.size());
    rs.copy_end.resize(p.ranks[ru].copy.size());
    out[ru] = {rs.compute_start.data(), rs.copy_start.data(), follow ? &progress[2 * ru] : nullptr};
  });
  std::vector<detail::RankFollower> follower(du);
  bool timed = false;  // the run has ended (or thrown)
  struct Flag {
    bool set = false;
  };
  std::vector<Flag> made(follow ? du : 0);  // a rank's memory timeline vector is made
  detail::for_each_item(workers, 1 + d + (follow ? 1 : 0), [&](int item, int) {
    if (item == 0) {
      struct Publish {
        bool& flag;
        constexpr ~Publish() { detail::publish(flag); }
      } done{timed};
      detail::asap_into<true>(p, costs, dur, out.data(), ends);
      return;
    }
    if (item <= d) {
      const auto ru = static_cast<std::size_t>(item - 1);
      RankSim& rs = res.ranks[ru];
      rs.memory.reserve(detail::memory_events(p.ranks[ru], costs));
      if (follow) detail::publish(made[ru].set);
      return;
    }
    // Follow the run until it ends. A rank is taken up once the run has timed a batch of its
    // ops, and never up to the last line of start times the run may still be writing.
    constexpr std::size_t batch = 256, line = 8;
    while (!detail::published(timed)) {
      bool worked = false;
      for (std::size_t r = 0; r < du && !detail::published(timed); ++r) {
        if (!detail::published(made[r].set)) continue;
        const RankProgram& rp = p.ranks[r];
        const std::size_t nc = rp.compute.size(), nk = rp.copy.size();
        std::size_t c = detail::acquired(progress[2 * r]), k = detail::acquired(progress[2 * r + 1]);
        if (c < nc) c = c > line ? c - line : 0;
        if (k < nk) k = k > line ? k - line : 0;
        detail::RankFollower& f = follower[r];
        const bool rest = c == nc && k == nk && (f.compute_filled() < nc || f.copy_filled() < nk);
        if (!rest && c < f.compute_filled() + batch && k < f.copy_filled() + batch) continue;
        f.advance(costs, rp, res.ranks[r], dur.data(), c, k);
        worked = true;
      }
      if (!worked) detail::pause();
    }
  });
  detail::for_each_item(workers, d, [&](int r, int) {
    const auto ru = static_cast<std::size_t>(r);
    const RankProgram& rp = p.ranks[ru];
    RankSim& rs = res.ranks[ru];
    follower[ru].advance(costs, rp, rs, dur.data(), rp.compute.size(), rp.copy.size());
    rs.warmup = warmup(rp);
  });
  for (const auto& f : follower) res.makespan = std::max(res.makespan, f.last_end());
  for (auto& rs : res.ranks) rs.bubble = res.makespan - rs.busy;
}

/// Simulates `p` under `costs` (the orders, edges and P2P plan of `p`, the durations of
/// `costs`). Throws schedule_error if the orders cannot run. See simulate_into for how the
/// work is split among threads (`threads`: see po::Workers).
constexpr SimResult simulate(const Program& p, const Costs& costs, Workers threads = {}) {
  SimResult res;
  simulate_into(res, p, costs, threads);
  return res;
}

/// Simulates `p` under the costs it was built with.
constexpr SimResult simulate(const Program& p, Workers threads = {}) { return simulate(p, p.costs, threads); }

/// simulate_into() under the costs `p` was built with.
constexpr void simulate_into(SimResult& res, const Program& p, Workers threads = {}) {
  simulate_into(res, p, p.costs, threads);
}

/// Rank `rank`'s simulated peak of alive activation (units under unit sizes, else bytes).
constexpr double peak(const Program& p, int rank) {
  detail::require_range("peak(program, rank): rank", rank, 0, p.shape.d - 1);
  return simulate(p).ranks[static_cast<std::size_t>(rank)].peak;
}

}  // namespace pipeoffload
