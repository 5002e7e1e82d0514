// pipeoffload/schedule/detail/asap.hpp: as-soon-as-possible timing of per-rank op orders.
//
// Every stream runs its ops in order; an op starts when its stream is free, its data
// dependency has finished (plus T_comm across ranks) and its cross-stream edge is met. The
// builder uses this for its planning timeline and P2P order, the simulator for its report:
// one timing engine, so the plan and the report cannot drift apart.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "../program.hpp"

namespace pipeoffload::detail {

struct Timing {
  // Per rank, parallel to RankProgram::compute / ::copy.
  std::vector<std::vector<double>> compute_start, compute_end, copy_start, copy_end;
};

constexpr double duration(const Costs& c, const Op& op) {
  switch (op.kind) {
    case OpKind::F: return c.F(op.stage);
    case OpKind::B: return c.B(op.stage);
    case OpKind::W: return c.W(op.stage);
    case OpKind::BW: return c.B(op.stage) + c.W(op.stage);
    case OpKind::O:
    case OpKind::R: return c.T_O(op.stage);
  }
  return 0;
}

constexpr std::string describe(const Op& op) {
  return std::string(op_name(op.kind)) + "(stage " + num(op.stage) + ", mb " + num(op.mb) + ")";
}

/// ASAP timing of `p` under `costs`. With `with_copy` false the copy streams and every
/// cross-stream edge are ignored (the compute-only timeline the offload planner starts from).
/// Throws schedule_error if the orders cannot all run (a dependency cycle).
constexpr Timing asap(const Program& p, const Costs& costs, bool with_copy) {
  const int d = p.shape.d, m = p.shape.m, S = p.shape.stages();
  // Microbatch-major: neighbouring ranks work on the same microbatches at about the same time.
  const auto unit = [S](int s, int mb) { return static_cast<std::size_t>(mb) * static_cast<std::size_t>(S) + static_cast<std::size_t>(s); };
  // End of each unit's F and B (or BW), -1 until it ran; side by side, so the lookups of one
  // op (its own unit and the next stage's) share cache lines.
  struct Ends { double f = -1, b = -1; };
  std::vector<Ends> ends(static_cast<std::size_t>(S) * static_cast<std::size_t>(m));

  Timing t;
  t.compute_start.resize(static_cast<std::size_t>(d));
  t.compute_end.resize(static_cast<std::size_t>(d));
  t.copy_start.resize(static_cast<std::size_t>(d));
  t.copy_end.resize(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    t.compute_start[static_cast<std::size_t>(r)].assign(rp.compute.size(), 0.0);
    t.compute_end[static_cast<std::size_t>(r)].assign(rp.compute.size(), 0.0);
    if (with_copy) {
      t.copy_start[static_cast<std::size_t>(r)].assign(rp.copy.size(), 0.0);
      t.copy_end[static_cast<std::size_t>(r)].assign(rp.copy.size(), 0.0);
    }
  }
  std::vector<std::size_t> ci(static_cast<std::size_t>(d), 0), ki(static_cast<std::size_t>(d), 0);
  std::vector<double> cfree(static_cast<std::size_t>(d), 0.0), kfree(static_cast<std::size_t>(d), 0.0);
  std::vector<int> work;
  std::vector<char> queued(static_cast<std::size_t>(d), 1);
  for (int r = d - 1; r >= 0; --r) work.push_back(r);
  // Stages s and s+1 live on different ranks unless d = 1: every hop pays T_comm then.
  const double hop = d > 1 ? costs.comm : 0.0;

  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    const auto ru = static_cast<std::size_t>(r);
    queued[ru] = 0;
    const auto& rp = p.ranks[ru];
    bool moved = false;
    // Each stream runs as far as it can before the other is tried; the loop ends when
    // neither moved.
    for (;;) {
      bool step = false;
      while (ci[ru] < rp.compute.size()) {
        const Op& op = rp.compute[ci[ru]];
        double ready = cfree[ru];
        bool ok = true;
        const auto need = [&](double end, double lat) {
          if (end < 0) ok = false;
          else ready = std::max(ready, end + lat);
        };
        switch (op.kind) {
          case OpKind::F:
            if (op.stage > 0) need(ends[unit(op.stage - 1, op.mb)].f, hop);
            break;
          case OpKind::B:
          case OpKind::BW:
            need(ends[unit(op.stage, op.mb)].f, 0.0);
            if (op.stage < S - 1) need(ends[unit(op.stage + 1, op.mb)].b, hop);
            break;
          case OpKind::W: need(ends[unit(op.stage, op.mb)].b, 0.0); break;
          default: break;
        }
        if (ok && with_copy && op.wait >= 0) {
          if (ki[ru] <= static_cast<std::size_t>(op.wait)) ok = false;
          else ready = std::max(ready, t.copy_end[ru][static_cast<std::size_t>(op.wait)]);
        }
        if (!ok) break;
        const double end = ready + duration(costs, op);
        t.compute_start[ru][ci[ru]] = ready;
        t.compute_end[ru][ci[ru]] = end;
        if (op.kind == OpKind::F) ends[unit(op.stage, op.mb)].f = end;
        if (op.kind == OpKind::B || op.kind == OpKind::BW) ends[unit(op.stage, op.mb)].b = end;
        cfree[ru] = end;
        ++ci[ru];
        step = true;
      }
      while (with_copy && ki[ru] < rp.copy.size()) {
        const Op& op = rp.copy[ki[ru]];
        if (op.wait >= 0 && ci[ru] <= static_cast<std::size_t>(op.wait)) break;
        double ready = kfree[ru];
        if (op.wait >= 0) ready = std::max(ready, t.compute_end[ru][static_cast<std::size_t>(op.wait)]);
        const double end = ready + duration(costs, op);
        t.copy_start[ru][ki[ru]] = ready;
        t.copy_end[ru][ki[ru]] = end;
        kfree[ru] = end;
        ++ki[ru];
        step = true;
      }
      if (!step) break;
      moved = true;
    }
    if (moved) {
      for (int nb : {r + 1 == d ? 0 : r + 1, r == 0 ? d - 1 : r - 1}) {
        if (!queued[static_cast<std::size_t>(nb)]) {
          queued[static_cast<std::size_t>(nb)] = 1;
          work.push_back(nb);
        }
      }
    }
  }
  for (int r = 0; r < d; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    const auto& rp = p.ranks[ru];
    if (ci[ru] < rp.compute.size() || (with_copy && ki[ru] < rp.copy.size())) {
      std::string msg = "schedule cannot run: rank " + num(r) + " is stuck at compute op " + num(static_cast<long long>(ci[ru]));
      if (ci[ru] < rp.compute.size()) msg += " " + describe(rp.compute[ci[ru]]);
      if (with_copy && ki[ru] < rp.copy.size()) msg += " and copy op " + num(static_cast<long long>(ki[ru])) + " " + describe(rp.copy[ki[ru]]);
      throw schedule_error(msg + " (a dependency cycle between the ranks' orders)");
    }
  }
  return t;
}

}  // namespace pipeoffload::detail
