// pipeoffload/policy/host_bins.hpp: how one offloaded unit is laid out in pinned host memory, an
// offload rule beside spec.hpp's (which chunks): the planner sizes host memory with it and the
// runtime allocates by it.
//
// docs/design.md section 3: one offload writes into at most 3 power-of-two bins whose total is the
// minimum that fits. Power-of-two bins let a host pool serve every unit size from a few size
// classes (pinned allocations are slow, so they are made once and reused); three bins keep
// the waste small (under 1/4 of the unit in the worst case, against 1/2 for one bin).
/// @file
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>

namespace pipeoffload::offload {

/// Up to three power-of-two bin sizes, largest first; unused entries are 0.
struct BinPlan {
  std::array<std::uint64_t, 3> bins{};  ///< bin sizes, bytes, largest first
  int count = 0;                        ///< bins used, 0 .. 3
  /// Bytes of all bins together.
  constexpr std::uint64_t total() const { return bins[0] + bins[1] + bins[2]; }
};

/// The smallest total of at most 3 powers of two that holds `bytes`. It keeps the three
/// highest set bits of `bytes`; if lower bits remain, it rounds up at the third bit (any
/// smaller total above `bytes` would share those three bits and need a fourth).
constexpr BinPlan plan_bins(std::uint64_t bytes) {
  BinPlan p;
  if (bytes == 0) return p;
  std::uint64_t x = bytes;
  if (std::popcount(bytes) > 3) {
    int seen = 0, third = 0;
    for (int b = 63; b >= 0; --b)
      if ((bytes >> b) & 1u) {
        if (++seen == 3) {
          third = b;
          break;
        }
      }
    x = ((bytes >> third) << third) + (std::uint64_t{1} << third);
  }
  for (int b = 63; b >= 0; --b)
    if ((x >> b) & 1u) p.bins[static_cast<std::size_t>(p.count++)] = std::uint64_t{1} << b;
  return p;
}

static_assert(plan_bins(0).count == 0);
static_assert(plan_bins(4096).count == 1 && plan_bins(4096).total() == 4096);
static_assert(plan_bins(7).total() == 7 && plan_bins(7).count == 3);
static_assert(plan_bins(15).total() == 16 && plan_bins(15).count == 1);  // 8+4+2+1 -> 16
static_assert(plan_bins(0b10110100).total() == 0b11000000);              // 128+32+16+4 -> 128+64

}  // namespace pipeoffload::offload
