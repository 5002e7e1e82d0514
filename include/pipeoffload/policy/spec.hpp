// pipeoffload/policy/spec.hpp: the value a schedule type stands for.
//
// A schedule type (Schedule<Policies...>) and a schedule chosen at run time by name (the plan
// tool, train_gpt) both reduce to one ScheduleSpec, and one builder turns a spec into op lists:
// there is a single way from a schedule to its passes.
/// @file
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "../error.hpp"

namespace pipeoffload {

/// The order family a grouping policy selects.
enum class Family : std::uint8_t {
  one_f1b,           ///< 1F1B: v = 1, fused backward (BW).
  interleaved_1f1b,  ///< Megatron's interleaved 1F1B: fused backward, warmup d(v-1)+2(d-i)-1.
  grouped,           ///< GIS(g) building block (split B/W); g = 1 is PipeOffload's uniform repeat.
  // The zero-bubble families (split B/W; docs/schedules.md, "Zero-bubble families"). ZB-H1 is 1F1B with
  // deferred W passes, V-Min a periodic pattern, DualPipeV DeepSeek's fixed steps; ZB-H2 is a
  // memory-capped list schedule (every rank runs, whenever it is free, a ready B, else a ready F
  // that keeps its units, and those its microbatches in flight still need, within the cap, else
  // its oldest pending W); ZB-V and V-Half are constructions on unit slots, or that list
  // schedule with their cap where it runs faster under the costs.
  zb_h1,   ///< ZB-H1: v = 1, peak d units (1F1B's rank-0 peak), bubble (d-1)(T_F+T_B-T_W).
  zb_h2,   ///< ZB-H2: v = 1, cap 2d units, rank 0's warmup bubble filled with forwards.
  zb_v,    ///< ZB-V: v = 2 on the V placement, cap 2d units (1F1B's peak in bytes).
  v_half,  ///< V-Half: v = 2 on the V placement, cap d + 2 units (d + 1 for odd d).
  v_min,   ///< V-Min: v = 2 on the V placement, peak 2*floor((d+1)/3) + 2 units (a third of 1F1B).
  /// DualPipeV (DeepSeek's order, "cut in half" onto the V placement): v = 2, m >= 2d, a fixed
  /// eight-step order per rank whose steady state pairs a forward of one microbatch with the full
  /// backward of another; peak 2d + 1 units on rank 0 (docs/schedules.md, "Zero-bubble families").
  dualpipe_v,
};

/// Whether family f runs on the V placement (v = 2): ZB-V, V-Half, V-Min and DualPipeV.
constexpr bool v_family(Family f) {
  return f == Family::zb_v || f == Family::v_half || f == Family::v_min || f == Family::dualpipe_v;
}

/// Where a schedule puts its stages (Shape::rank_of): interleaved (stage c*d + r on rank r)
/// or vshape (chunks alternate direction: rank r holds stages r and 2d-1-r when v = 2).
enum class Placement : std::uint8_t { interleaved, vshape };

namespace group {
/// Group sizes that depend on d and are resolved when a shape is known.
enum class symbolic : std::uint8_t { full, half };
inline constexpr symbolic full = symbolic::full;  ///< g = d (GIS).
inline constexpr symbolic half = symbolic::half;  ///< g = ceil(d/2) (GIS-H).
}  // namespace group

/// Which group size a grouped schedule uses: a number, d, or ceil(d/2).
struct GroupSpec {
  /// number: g = value; full: g = d; half: g = ceil(d/2); uniform: g = 1 for any d (PO).
  enum class Kind : std::uint8_t { number, full, half, uniform } kind = Kind::full;  ///< how g is chosen.
  int value = 0;                                                                     ///< g when kind == number.

  /// The smallest group size of d ranks, ceil(d/2): GIS(g) takes g in [ceil(d/2), d] (GIS-H's g).
  static constexpr int smallest(int d) { return (d + 1) / 2; }

  /// Field-by-field equality.
  friend constexpr bool operator==(const GroupSpec&, const GroupSpec&) = default;
};

namespace offload {
/// Which chunks (stages of a rank, 0..v-1) have their activations offloaded to host memory.
/// A structural type, so it can be a template argument: OffloadPolicy<offload::first(2)>.
struct selection {
  /// none: no chunk; half: chunks 0..ceil(v/2)-1; all: every chunk; first: chunks 0..n-1; set: the chunks in mask.
  enum class Kind : std::uint8_t { none, half, all, first, set } kind = Kind::none;  ///< which rule picks the chunks.
  int n = 0;                                                                         ///< kind == first: chunks 0..n-1.
  std::uint64_t mask = 0;  ///< kind == set: bit c set = chunk c offloaded (chunks 0..63).

  /// Field-by-field equality.
  friend constexpr bool operator==(const selection&, const selection&) = default;
};

inline constexpr selection none{selection::Kind::none};  ///< no chunk (no offload).
inline constexpr selection half{selection::Kind::half};  ///< chunks 0..ceil(v/2)-1 (PO-H).
inline constexpr selection all{selection::Kind::all};    ///< every chunk (PO-F).

/// Chunks 0..n-1, n >= 0 (n larger than v means all).
constexpr selection first(int n) {
  detail::require_range("offload::first(n): n, the number of offloaded chunks,", n, 0, 1 << 30);
  return {selection::Kind::first, n, 0};
}

/// An explicit set of chunk indices, each in [0, 63].
constexpr selection chunks(std::initializer_list<int> cs) {
  selection s{selection::Kind::set, 0, 0};
  for (int c : cs) {
    detail::require_range("offload::chunks({...}): a chunk index", c, 0, 63);
    s.mask |= std::uint64_t{1} << c;
  }
  return s;
}

/// Is chunk c of v offloaded under selection sel?
constexpr bool offloaded(const selection& sel, int c, int v) {
  switch (sel.kind) {
    case selection::Kind::none:
      return false;
    case selection::Kind::half:
      return c < (v + 1) / 2;
    case selection::Kind::all:
      return true;
    case selection::Kind::first:
      return c < sel.n;
    case selection::Kind::set:
      return c < 64 && ((sel.mask >> c) & 1u) != 0;
  }
  return false;
}

/// Number of chunks of v that sel offloads.
constexpr int count(const selection& sel, int v) {
  int n = 0;
  for (int c = 0; c < v; ++c) n += offloaded(sel, c, v) ? 1 : 0;
  return n;
}
}  // namespace offload

/// Everything a schedule type fixes before it sees a shape.
struct ScheduleSpec {
  Family family = Family::grouped;               ///< the order family.
  GroupSpec group{};                             ///< meaningful for Family::grouped only.
  offload::selection offload = offload::none;    ///< which chunks' activations are offloaded.
  Placement placement = Placement::interleaved;  ///< vshape for the V families (v_family()).

  /// Field-by-field equality.
  friend constexpr bool operator==(const ScheduleSpec&, const ScheduleSpec&) = default;
};

}  // namespace pipeoffload
