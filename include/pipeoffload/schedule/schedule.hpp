// pipeoffload/schedule/schedule.hpp: Schedule<Policies...> and the paper's schedules.
/// @file
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "../policy/policy.hpp"
#include "build.hpp"

namespace pipeoffload {

namespace detail {
// The slot a type names, or void: lets the static_asserts below speak before any lookup of a
// missing `policy_slot` turns into a template backtrace.
template <class P>
struct slot_of {
  using type = void;
};
template <class P>
  requires requires { typename P::policy_slot; }
struct slot_of<P> {
  using type = typename P::policy_slot;
};

template <class Slot, class... Ps>
constexpr int count_slot = (0 + ... + (std::is_same_v<typename slot_of<Ps>::type, Slot> ? 1 : 0));

template <class Slot, class Default, class... Ps>
struct pick_slot {
  using type = Default;
};
template <class Slot, class Default, class P, class... Ps>
struct pick_slot<Slot, Default, P, Ps...> {
  using type = std::conditional_t<std::is_same_v<typename slot_of<P>::type, Slot>, P,
                                  typename pick_slot<Slot, Default, Ps...>::type>;
};
}  // namespace detail

/// A pipeline schedule type composed of policies, in any order, at most one per slot:
/// a grouping (InterleavePolicy<g>, UniformRepeat, OneF1BOrder, MegatronInterleave,
/// ZeroBubble<F>; default GIS), an offload (OffloadPolicy<...>; default none) and a placement
/// (Interleaved, VShape; default Interleaved).
/// @code
///   using Mine = pipeoffload::Schedule<pipeoffload::OffloadPolicy<pipeoffload::offload::first(1)>,
///                                      pipeoffload::InterleavePolicy<pipeoffload::group::half>>;
///   static_assert(pipeoffload::validate(Mine::build({8, 4, 32})));
///   constexpr double peak0 = pipeoffload::peak(Mine::build({8, 4, 32}), 0);
/// @endcode
template <class... Ps>
struct Schedule {
  static_assert((policy<Ps> && ...),
                "pipeoffload::Schedule: every template argument must be a policy, a type with "
                "`using policy_slot = slot::grouping;`, `slot::offload` or `slot::placement`.");
  static_assert(detail::count_slot<slot::grouping, Ps...> <= 1,
                "pipeoffload::Schedule: two grouping policies were given; choose one of "
                "InterleavePolicy<g>, UniformRepeat, OneF1BOrder or MegatronInterleave.");
  static_assert(detail::count_slot<slot::offload, Ps...> <= 1,
                "pipeoffload::Schedule: two offload policies were given; merge them into one "
                "OffloadPolicy<...>.");
  static_assert(detail::count_slot<slot::placement, Ps...> <= 1,
                "pipeoffload::Schedule: two placement policies were given; choose Interleaved or VShape.");

  /// The grouping policy given (InterleavePolicy<group::full> when none is).
  using grouping = typename detail::pick_slot<slot::grouping, InterleavePolicy<group::full>, Ps...>::type;
  /// The offload policy given (OffloadPolicy<offload::none> when none is).
  using offloading = typename detail::pick_slot<slot::offload, OffloadPolicy<offload::none>, Ps...>::type;
  /// The placement policy given (Interleaved when none is).
  using placing = typename detail::pick_slot<slot::placement, Interleaved, Ps...>::type;

  static_assert(v_family(grouping::family) == (placing::placement == Placement::vshape),
                "pipeoffload::Schedule: ZB-V, V-Half, V-Min and DualPipeV run on the V placement (add VShape), and "
                "only they do.");

  /// What the three policies fix: family, group, offload selection and placement.
  static constexpr ScheduleSpec spec{grouping::family, grouping::group_spec, offloading::selection, placing::placement};

  /// Op lists for `shape` under `costs` (unit costs, k = 1 by default). See pipeoffload::build.
  static constexpr Program build(const Shape& shape, const Costs& costs = {}, Workers threads = {}) {
    return pipeoffload::build(spec, shape, costs, threads);
  }
  /// build() into `p`, reusing its memory. See pipeoffload::build_into.
  static constexpr void build_into(Program& p, const Shape& shape, const Costs& costs = {}, Workers threads = {}) {
    pipeoffload::build_into(p, spec, shape, costs, threads);
  }
};

// The paper's schedules.
using OneF1B = Schedule<OneF1BOrder>;                   ///< 1F1B
using Interleaved1F1B = Schedule<MegatronInterleave>;   ///< 1F1B-I (Megatron)
using GIS = Schedule<InterleavePolicy<group::full>>;    ///< g = d
using GIS_H = Schedule<InterleavePolicy<group::half>>;  ///< g = ceil(d/2)
template <int G>
using GIS_G = Schedule<InterleavePolicy<G>>;                         ///< GIS(g)
using PO = Schedule<UniformRepeat>;                                  ///< PipeOffload, no offload
using PO_H = Schedule<UniformRepeat, OffloadPolicy<offload::half>>;  ///< chunks 0..ceil(v/2)-1 offloaded
using PO_F = Schedule<UniformRepeat, OffloadPolicy<offload::all>>;   ///< every chunk offloaded

// The zero-bubble families (docs/schedules.md, "Zero-bubble families").
using ZB_H1 = Schedule<ZeroBubble<Family::zb_h1>>;                   ///< ZB-H1: 1F1B's peak, bubble (d-1)(T_F+T_B-T_W)
using ZB_H2 = Schedule<ZeroBubble<Family::zb_h2>>;                   ///< ZB-H2: up to 2d units, no steady-state bubble
using ZB_V = Schedule<ZeroBubble<Family::zb_v>, VShape>;             ///< ZB-V: v = 2 as a V, 1F1B's peak in bytes
using V_Half = Schedule<ZeroBubble<Family::v_half>, VShape>;         ///< V-Half: about half of 1F1B's bytes
using V_Min = Schedule<ZeroBubble<Family::v_min>, VShape>;           ///< V-Min: about a third of 1F1B's bytes
using DualPipeV = Schedule<ZeroBubble<Family::dualpipe_v>, VShape>;  ///< DeepSeek's DualPipeV: m >= 2d, 2d + 1 units

/// Whether every alias above has its named_schedules entry's spec (gis-g's group aside).
constexpr bool aliases_named() {
  const auto is = [](std::string_view name, ScheduleSpec spec) {
    if (spec.group.kind == GroupSpec::Kind::number) spec.group.value = 0;
    return find_schedule(name)->spec == spec;
  };
  return is("1f1b", OneF1B::spec) && is("1f1b-i", Interleaved1F1B::spec) && is("gis", GIS::spec) &&
         is("gis-h", GIS_H::spec) && is("gis-g", GIS_G<1>::spec) && is("po", PO::spec) && is("po-h", PO_H::spec) &&
         is("po-f", PO_F::spec) && is("zb-h1", ZB_H1::spec) && is("zb-h2", ZB_H2::spec) && is("zb-v", ZB_V::spec) &&
         is("v-half", V_Half::spec) && is("v-min", V_Min::spec) && is("dualpipe-v", DualPipeV::spec);
}
static_assert(aliases_named(), "pipeoffload: a schedule alias and its named_schedules entry disagree");

/// The spec of a schedule named as schedule_name() names it (named_schedules: 1f1b, 1f1b-i,
/// gis, gis-h, gis-g, po, po-h, po-f, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v): the
/// alias's own spec (parse_schedule("po-f") == PO_F::spec), and for gis-g the group size
/// `group` (checked against a shape by build). Throws shape_error with the allowed names for
/// any other name. schedule_name(parse_schedule(n, g)) == n.
inline ScheduleSpec parse_schedule(std::string_view name, int group = 0) {
  const NamedSchedule* e = find_schedule(name);
  if (e == nullptr)
    throw shape_error("schedule must be one of " + schedule_names() + ", got '" + std::string(name) + "'");
  ScheduleSpec spec = e->spec;
  if (spec.group.kind == GroupSpec::Kind::number) spec.group.value = group;
  return spec;
}

}  // namespace pipeoffload
