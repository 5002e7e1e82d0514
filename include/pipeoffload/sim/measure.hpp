// pipeoffload/sim/measure.hpp: a program's costs, from a measured run of it.
//
// After a run of program `p` whose every rank's op times were recorded (Runtime::trace(),
// gathered over the pipeline), measured_costs() gives the costs the run behaved by: each
// stage's T_F, T_B and T_W as the median of its measured passes (a fused BW's time split evenly
// between B and W), and the copy ratio k as the median, over the stages whose units were
// offloaded, of (median offload + median reload) / (T_F + T_B + T_W). Building the same
// schedule with them replans its offload for the machine it ran on: which units go to host
// memory and where their copies go (train_gpt --k auto).
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../schedule/program.hpp"
#include "simulate.hpp"

namespace pipeoffload {

/// The costs a measured run of `p` behaved by (header comment): `base` with its per-stage T_F,
/// T_B and T_W and its k replaced by the measured ones (k kept where nothing was offloaded;
/// times below 1 ns count as 1 ns). `traces[r]`: rank r's measured op times (RankSim's
/// compute and copy starts and ends, parallel to the rank's streams). Throws po::error when
/// the traces do not match the program.
inline Costs measured_costs(const Program& p, std::span<const RankSim> traces, const Costs& base) {
  const int S = p.shape.stages();
  if (static_cast<int>(traces.size()) != p.shape.d)
    throw error("po::measured_costs: " + std::to_string(traces.size()) + " traces for " + std::to_string(p.shape.d) +
                " ranks");
  // Durations per stage: F, B, W, BW, O, R.
  std::vector<std::vector<double>> took(static_cast<std::size_t>(S) * 6);
  const auto slot = [&](int stage, OpKind kind) -> std::vector<double>& {
    return took[static_cast<std::size_t>(stage) * 6 + static_cast<std::size_t>(kind)];
  };
  for (int r = 0; r < p.shape.d; ++r) {
    const RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
    const RankSim& t = traces[static_cast<std::size_t>(r)];
    if (t.compute_start.size() != rp.compute.size() || t.compute_end.size() != rp.compute.size() ||
        t.copy_start.size() != rp.copy.size() || t.copy_end.size() != rp.copy.size())
      throw error("po::measured_costs: rank " + std::to_string(r) + "'s trace has " +
                  std::to_string(t.compute_start.size()) + " compute and " + std::to_string(t.copy_start.size()) +
                  " copy ops; its program has " + std::to_string(rp.compute.size()) + " and " +
                  std::to_string(rp.copy.size()));
    for (std::size_t x = 0; x < rp.compute.size(); ++x)
      slot(rp.compute[x].stage, rp.compute[x].kind).push_back(t.compute_end[x] - t.compute_start[x]);
    for (std::size_t y = 0; y < rp.copy.size(); ++y)
      slot(rp.copy[y].stage, rp.copy[y].kind).push_back(t.copy_end[y] - t.copy_start[y]);
  }
  // The median (the lower of the middle two), at least 1 ns; 0 when nothing was measured.
  const auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return std::max(1e-9, v[(v.size() - 1) / 2]);
  };
  Costs out = base;
  out.stage_f.assign(static_cast<std::size_t>(S), 0);
  out.stage_b.assign(static_cast<std::size_t>(S), 0);
  out.stage_w.assign(static_cast<std::size_t>(S), 0);
  std::vector<double> ks;
  for (int s = 0; s < S; ++s) {
    const auto u = static_cast<std::size_t>(s);
    const double bw = median(slot(s, OpKind::BW));
    out.stage_f[u] = std::max(1e-9, median(slot(s, OpKind::F)));
    out.stage_b[u] = std::max(1e-9, slot(s, OpKind::B).empty() ? bw / 2 : median(slot(s, OpKind::B)));
    out.stage_w[u] = std::max(1e-9, slot(s, OpKind::W).empty() ? bw / 2 : median(slot(s, OpKind::W)));
    const double o = median(slot(s, OpKind::O)), back = median(slot(s, OpKind::R));
    if (o > 0 && back > 0) ks.push_back((o + back) / (out.stage_f[u] + out.stage_b[u] + out.stage_w[u]));
  }
  // (With two copy streams T_O includes Costs::duplex_slowdown: the measured copies did too.)
  if (!ks.empty()) out.k = median(ks) / (base.duplex() ? base.duplex_slowdown : 1.0);
  out.t_o = 0;
  return out;
}

}  // namespace pipeoffload
