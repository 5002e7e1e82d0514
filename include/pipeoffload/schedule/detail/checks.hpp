// pipeoffload/schedule/detail/checks.hpp: the specs, shapes and costs build() accepts (each bad value named with its range).
#pragma once

#include <string>
#include <vector>

#include "../program.hpp"

namespace pipeoffload {

namespace detail {

constexpr long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

/// Resolved group size g of a grouped spec for d ranks, checked against its legal range.
constexpr int resolve_group(const GroupSpec& g, int d) {
  const int lo = GroupSpec::smallest(d);
  switch (g.kind) {
    case GroupSpec::Kind::full:
      return d;
    case GroupSpec::Kind::half:
      return lo;
    case GroupSpec::Kind::uniform:
      return 1;
    case GroupSpec::Kind::number:
      require_range("GIS(g): group size g (legal: ceil(d/2) <= g <= d)", g.value, lo, d);
      return g.value;
  }
  return d;
}

constexpr void check_shape(const ScheduleSpec& spec, const Shape& s) {
  require_range("shape: ranks d", s.d, 1, max_ranks);
  require_range("shape: chunks per rank v", s.v, 1, max_chunks);
  require_range("shape: microbatches m", s.m, 1, max_microbatches);
  if (spec.family == Family::one_f1b) require_range("1F1B: chunks per rank v (1F1B has one stage per rank)", s.v, 1, 1);
  if (spec.family == Family::interleaved_1f1b && s.m % s.d != 0)
    throw shape_error("1F1B-I (Megatron's interleaved order): microbatches m = " + num(s.m) +
                      " must be a multiple of ranks d = " + num(s.d));
  const bool zb_line = spec.family == Family::zb_h1 || spec.family == Family::zb_h2;
  const bool v_placed = v_family(spec.family);
  if (zb_line) require_range("ZB-H1/ZB-H2: chunks per rank v (one stage per rank)", s.v, 1, 1);
  if (v_placed)
    require_range("ZB-V/V-Half/V-Min/DualPipeV: chunks per rank v (two stages per rank, as a V)", s.v, 2, 2);
  if (spec.family == Family::dualpipe_v && s.m < 2 * s.d)
    throw shape_error(
        "DualPipeV: microbatches m = " + num(s.m) + " must be at least 2d = " + num(2 * s.d) +
        " (DeepSeek's order: a warmup of 2d - 1 forwards on rank 0, then at least one steady-state step)");
  if (v_placed != (spec.placement == Placement::vshape))
    throw shape_error(std::string("placement: ") +
                      (v_placed ? "ZB-V, V-Half, V-Min and DualPipeV need the V placement (VShape)"
                                : "the V placement (VShape) is only for ZB-V, V-Half, V-Min and DualPipeV") +
                      "; use the schedule's own alias or parse_schedule()");
  if (s.placement != Placement::interleaved && s.placement != spec.placement)
    throw shape_error("shape: its placement is not the schedule's (build() takes the placement from the schedule)");
  if (spec.offload.kind == offload::selection::Kind::set && s.v < 64 && (spec.offload.mask >> s.v) != 0)
    throw shape_error("offload::chunks: a listed chunk index is >= v = " + num(s.v) + "; allowed chunks are 0.." +
                      num(s.v - 1));
}

constexpr bool finite_positive(double x) { return x > 0 && x < 1e300; }

constexpr void check_costs(const Costs& c, const Shape& s) {
  if (!finite_positive(c.f)) throw shape_error("costs: T_F must be a finite number > 0");
  if (!finite_positive(c.b)) throw shape_error("costs: T_B must be a finite number > 0");
  if (!finite_positive(c.w)) throw shape_error("costs: T_W must be a finite number > 0");
  if (!(c.comm >= 0 && c.comm < 1e300)) throw shape_error("costs: T_comm must be a finite number >= 0");
  if (!finite_positive(c.k) && !finite_positive(c.t_o))
    throw shape_error("costs: k (or T_O) must be a finite number > 0");
  if (!(c.t_o >= 0 && c.t_o < 1e300)) throw shape_error("costs: T_O must be a finite number >= 0 (0 means: from k)");
  if (c.copy_streams != 1 && c.copy_streams != 2)
    throw shape_error("costs: copy_streams = " + num(c.copy_streams) + " is outside the allowed range [1, 2]");
  if (!(c.duplex_slowdown >= 1 && c.duplex_slowdown < 1e300))
    throw shape_error(
        "costs: duplex_slowdown must be a finite number >= 1 (a copy is no faster while the other "
        "direction copies too)");
  const auto check_vec = [&](const std::vector<double>& vec, const char* what, bool positive) {
    if (vec.empty()) return;
    if (static_cast<long long>(vec.size()) != s.stages())
      throw shape_error(std::string("costs: per-stage ") + what + " has " + num(static_cast<long long>(vec.size())) +
                        " entries; it must have S = v*d = " + num(s.stages()) + " (or none)");
    for (double x : vec)
      if (positive ? !finite_positive(x) : !(x >= 0 && x < 1e300))
        throw shape_error(std::string("costs: every per-stage ") + what + " must be a finite number " +
                          (positive ? "> 0" : ">= 0"));
  };
  check_vec(c.stage_f, "T_F", true);
  check_vec(c.stage_b, "T_B", true);
  check_vec(c.stage_w, "T_W", true);
  check_vec(c.unit_bytes, "unit size", false);
  check_vec(c.stash_bytes, "stash size", false);
  if (!c.reload_shares.empty()) {
    if (static_cast<long long>(c.reload_shares.size()) != s.stages())
      throw shape_error("costs: per-stage reload shares has " + num(static_cast<long long>(c.reload_shares.size())) +
                        " entries; it must have S = v*d = " + num(s.stages()) + " (or none)");
    for (std::size_t st = 0; st < c.reload_shares.size(); ++st) {
      const std::vector<double>& sh = c.reload_shares[st];
      if (static_cast<long long>(sh.size()) > max_reload_parts)
        throw shape_error("costs: stage " + num(static_cast<long long>(st)) + " reloads in " +
                          num(static_cast<long long>(sh.size())) + " parts; at most " + num(max_reload_parts) +
                          " are allowed");
      double total = 0;
      for (double x : sh) {
        if (!finite_positive(x))
          throw shape_error("costs: stage " + num(static_cast<long long>(st)) +
                            "'s reload shares must be finite numbers > 0");
        total += x;
      }
      if (!sh.empty() && !(total > 1 - 1e-6 && total < 1 + 1e-6))
        throw shape_error("costs: stage " + num(static_cast<long long>(st)) + "'s reload shares add up to " +
                          num(static_cast<long long>(total * 1e6 + 0.5)) +
                          " millionths; they must add up to 1 (each part's share of the unit's bytes)");
    }
  }
}

}  // namespace detail
}  // namespace pipeoffload
