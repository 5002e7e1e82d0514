// pipeoffload/policy/policy.hpp: the policies a schedule type is composed of.
//
// Each policy names its slot (grouping, offload or placement) with a `policy_slot` tag and re-exports its
// parameters; Schedule<Policies...> (schedule/schedule.hpp) takes them in any order, at most
// one per slot.
/// @file
#pragma once

#include <concepts>
#include <type_traits>

#include "spec.hpp"

namespace pipeoffload {

namespace slot {
struct grouping {};   ///< how microbatches are grouped and chunks interleaved (the order family).
struct offload {};    ///< which chunks' activations go to host memory.
struct placement {};  ///< which rank holds which stage (Shape::rank_of).
}  // namespace slot

namespace detail {
template <class G>
constexpr bool is_group_value = std::is_integral_v<G> || std::is_same_v<G, group::symbolic>;
}

/// GIS(g): interleaved 1F1B with split backward (B, W), adjusted warmup, and g microbatches
/// repeated per group; legal for ceil(d/2) <= g <= d.
/// @code
///   using MySched = pipeoffload::Schedule<pipeoffload::InterleavePolicy<6>>;       // GIS(6)
///   using Half = pipeoffload::Schedule<pipeoffload::InterleavePolicy<pipeoffload::group::half>>;
/// @endcode
template <auto G>
struct InterleavePolicy {
  static_assert(detail::is_group_value<decltype(G)>,
                "InterleavePolicy<G>: G must be an integer group size or group::full / group::half.");
  using policy_slot = slot::grouping;  ///< fills the grouping slot
  static constexpr auto group = G;     ///< G as given: a group size or group::full / group::half
  /// G as a GroupSpec (Kind::number with g = G, or Kind::full / Kind::half).
  static constexpr GroupSpec group_spec = [] {
    if constexpr (std::is_same_v<decltype(G), group::symbolic>) {
      return G == group::full ? GroupSpec{GroupSpec::Kind::full, 0} : GroupSpec{GroupSpec::Kind::half, 0};
    } else {
      static_assert(G >= 1, "InterleavePolicy<G>: the group size G must be at least 1.");
      return GroupSpec{GroupSpec::Kind::number, static_cast<int>(G)};
    }
  }();
  static constexpr Family family = Family::grouped;  ///< the grouped family (GIS and uniform repeating)
};

/// PipeOffload's uniform repeating: the GIS building block with g = 1, so every microbatch
/// follows the previous one after a fixed offset and each chunk's share of the peak is
/// proportional to its lifespan (what makes selective offload better than linear).
/// @code
///   using PO_H = pipeoffload::Schedule<pipeoffload::UniformRepeat,
///                                      pipeoffload::OffloadPolicy<pipeoffload::offload::half>>;
/// @endcode
struct UniformRepeat {
  using policy_slot = slot::grouping;                                  ///< fills the grouping slot
  static constexpr GroupSpec group_spec{GroupSpec::Kind::uniform, 1};  ///< uniform repeating, g = 1
  static constexpr Family family = Family::grouped;  ///< the grouped family (GIS and uniform repeating)
};

/// 1F1B (PipeDream-flush): one stage per rank (v = 1), fused backward.
struct OneF1BOrder {
  using policy_slot = slot::grouping;                ///< fills the grouping slot
  static constexpr GroupSpec group_spec{};           ///< unused (only Family::grouped reads a GroupSpec)
  static constexpr Family family = Family::one_f1b;  ///< 1F1B
};

/// Megatron-LM's interleaved 1F1B: v chunks per rank, fused backward, m a multiple of d.
struct MegatronInterleave {
  using policy_slot = slot::grouping;                         ///< fills the grouping slot
  static constexpr GroupSpec group_spec{};                    ///< unused (only Family::grouped reads a GroupSpec)
  static constexpr Family family = Family::interleaved_1f1b;  ///< interleaved 1F1B
};

/// The zero-bubble families (split backward; docs/schedules.md, "Zero-bubble families"): a memory-capped list
/// schedule, each family its cap. ZB-H1 and ZB-H2 take v = 1; ZB-V, V-Half and V-Min take
/// v = 2 on the V placement (compose them with VShape, as their aliases do).
/// @code
///   using ZbV = pipeoffload::Schedule<pipeoffload::ZeroBubble<pipeoffload::Family::zb_v>,
///                                     pipeoffload::VShape>;   // == pipeoffload::ZB_V
/// @endcode
template <Family F>
struct ZeroBubble {
  static_assert(F == Family::zb_h1 || F == Family::zb_h2 || v_family(F),
                "ZeroBubble<F>: F must be Family::zb_h1, zb_h2, zb_v, v_half, v_min or dualpipe_v.");
  using policy_slot = slot::grouping;       ///< fills the grouping slot
  static constexpr GroupSpec group_spec{};  ///< unused (only Family::grouped reads a GroupSpec)
  static constexpr Family family = F;       ///< the zero-bubble family F
};

/// Interleaved placement (the default): stage c*d + r on rank r.
struct Interleaved {
  using policy_slot = slot::placement;                            ///< fills the placement slot
  static constexpr Placement placement = Placement::interleaved;  ///< stage c*d + r on rank r
};

/// V placement: chunks alternate direction, so with v = 2 rank r holds stages r and 2d-1-r.
struct VShape {
  using policy_slot = slot::placement;                       ///< fills the placement slot
  static constexpr Placement placement = Placement::vshape;  ///< chunks alternate direction
};

/// Which chunks are offloaded: offload::none, offload::half (chunks 0..ceil(v/2)-1),
/// offload::all, offload::first(n), or offload::chunks({c0, c1, ...}).
/// @code
///   using GisHOff2 = pipeoffload::Schedule<pipeoffload::InterleavePolicy<pipeoffload::group::half>,
///                                          pipeoffload::OffloadPolicy<pipeoffload::offload::first(2)>>;
/// @endcode
template <offload::selection Sel>
struct OffloadPolicy {
  using policy_slot = slot::offload;                    ///< fills the offload slot
  static constexpr offload::selection selection = Sel;  ///< the chunks whose activations are offloaded
};

/// A policy is a type that names its slot.
template <class P>
concept policy = requires { typename P::policy_slot; } && (std::same_as<typename P::policy_slot, slot::grouping> ||
                                                           std::same_as<typename P::policy_slot, slot::offload> ||
                                                           std::same_as<typename P::policy_slot, slot::placement>);

}  // namespace pipeoffload
