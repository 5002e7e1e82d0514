// pipeoffload/schedule/build.hpp: from a schedule spec, a shape and a cost model to op lists.
//
// build() runs in four constexpr steps: each rank's compute order, a planning timeline of
// those orders (PO's shifted grid, otherwise ASAP), offload placement on each rank's copy
// stream (or its two, Costs::copy_streams) with the cross-stream edges that keep execution within the planned memory
// (docs/design.md section 3), and the P2P plan, one global order of the messages, so that a
// rendezvous communicator cannot deadlock. This file only orchestrates: each step is a file of
// detail/ (docs/schedules.md, "How a schedule is built, checked and simulated").
/// @file
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "detail/asap.hpp"
#include "detail/checks.hpp"
#include "detail/default_init.hpp"
#include "detail/dualpipe_v.hpp"
#include "detail/edges.hpp"
#include "detail/greedy.hpp"
#include "detail/offload_place.hpp"
#include "detail/orders.hpp"
#include "detail/p2p.hpp"
#include "detail/parallel.hpp"
#include "detail/v_shape.hpp"
#include "program.hpp"

namespace pipeoffload {

/// build() into `p`, reusing the memory its vectors hold: for a caller that builds many
/// schedules in turn (a planner's search, re-planning with measured costs), whose outputs
/// then take no page faults after the first (tens of megabytes for a large schedule). The
/// result is the one build() returns, whatever `p` held before. A bad shape or cost throws
/// before `p` is touched; any later exception leaves `p` a valid Program with unspecified
/// contents. `threads`: see po::Workers.
constexpr void build_into(Program& p, const ScheduleSpec& spec, const Shape& shape, const Costs& costs = {},
                          Workers threads = {}) {
  detail::check_shape(spec, shape);
  detail::check_costs(costs, shape);
  p.spec = spec;
  p.shape = shape;
  p.shape.placement = spec.placement;
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
    const auto end = [&](int rank, std::size_t, const Op& op) {
      return static_cast<double>(bk.slot(rank, op) + 1) * tau;
    };
    const int workers = detail::worker_count(
        3 * static_cast<std::size_t>(shape.stages()) * static_cast<std::size_t>(shape.m), d, threads);
    // Each compute op's start without offload (the compute-only ASAP run).
    std::vector<std::vector<double, detail::default_init<double>>> rs(
        static_cast<std::size_t>(offloads ? d : 0));  // written by the run
    std::vector<double> dur;                          // the ASAP run's op durations
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
    for (int w = 0; w < workers; ++w)
      scratch.push_back(Scratch{{}, {}, {}, {}, {}, detail::SettleScratch(costs, offloads ? shape.stages() : 0)});
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
      fallback[static_cast<std::size_t>(r)] =
          !slot_keys || !detail::plan_p2p_po_rank(p, bk, ws.slots[i].data(), r, ws.p2p);
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
        detail::place_pair(p, r0, n, ws.ps, ws.pe, detail::Parities::planned, ws.place, ws.settle);
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
    case Family::one_f1b:
      detail::order_1f1b(p);
      break;
    case Family::interleaved_1f1b:
      detail::order_interleaved(p);
      break;
    case Family::grouped:
      detail::order_grouped(p);
      break;
    case Family::zb_h1:
      detail::order_zb_h1(p);
      break;
    case Family::v_min:
      detail::order_v_min(p);
      break;
    case Family::dualpipe_v:
      detail::order_dualpipe_v(p);
      break;
    case Family::zb_h2:
      detail::order_greedy(p, costs, detail::greedy_cap(spec.family, d));
      break;
    case Family::zb_v:
    case Family::v_half:
      detail::order_v_family(p, costs, spec.family);
      break;
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
    for (std::size_t x = 0; x < comp.size(); ++x) pe[r][x] = ps[r][x] + detail::table_duration(dur.data(), comp[x]);
  }
  if (offloads) {
    detail::OffloadScratch scratch;
    for (int r = 0; r < d; ++r)
      detail::place_offloads(p, r, ps[static_cast<std::size_t>(r)], pe[static_cast<std::size_t>(r)], scratch);
  }
  const auto end = [&](int rank, std::size_t x, const Op&) { return pe[static_cast<std::size_t>(rank)][x]; };
  for (int r = 0; r < d; ++r) detail::plan_p2p_rank(p, r, end);
  if (offloads) detail::pin_run_order(p, costs, dur);
}

/// Builds the op lists of `spec` for `shape` under `costs` (unit costs and k = 1 by default).
/// constexpr: with a constant shape and costs, usable in static_assert. Throws shape_error
/// naming the bad value and its allowed range. `threads`: see po::Workers.
constexpr Program build(const ScheduleSpec& spec, const Shape& shape, const Costs& costs = {}, Workers threads = {}) {
  Program p;
  build_into(p, spec, shape, costs, threads);
  return p;
}

}  // namespace pipeoffload
