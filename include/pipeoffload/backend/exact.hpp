// pipeoffload/backend/exact.hpp: exact gradient sums, the same on every backend: each value
// rounded once to fixed point and added to a 128-bit integer, the sum rounded once to fp32.
// Plain functions over one value, for the CPU backend's loops and the CUDA kernels
// (src/elementwise.cu). Range, resolution and poisoning: docs/gradients.md, "Exact sums".
/// @file
#pragma once

#include <cmath>
#include <cstdint>

#include "../detail/host_device.hpp"

namespace pipeoffload::exact {

__extension__ typedef __int128 Fixed;               ///< a sum, in units of 2^-fraction_bits
__extension__ typedef unsigned __int128 FixedBits;  ///< Fixed's bits, unsigned (for shifts and masks)

inline constexpr int fraction_bits = 76;            ///< bits below the binary point: Fixed counts units of 2^-76
inline constexpr double term_limit = 4294967296.0;  ///< 2^32: |g| must be below it
inline constexpr int max_terms = 1 << 16;           ///< terms of one sum (microbatches of a step, all replicas)

/// The marker of a sum that met a NaN, an infinity or an out-of-range value.
PIPEOFFLOAD_HOST_DEVICE constexpr Fixed poison() { return static_cast<Fixed>(static_cast<FixedBits>(1) << 127); }

/// acc += g rounded to the grid (poisons acc for a value it cannot hold).
PIPEOFFLOAD_HOST_DEVICE inline void add(Fixed& acc, float g) {
  if (acc == poison()) return;
  const double x = static_cast<double>(g);
  if (!(x > -term_limit && x < term_limit)) {  // NaN fails both
    acc = poison();
    return;
  }
  // x * 2^76 is exact (a power-of-two scale of a float, far from double's limits); rint rounds
  // it to an integer (ties to even) below 2^108, which converts to 128 bits exactly.
  acc += static_cast<Fixed>(rint(x * 0x1p76));
}

/// a + b (poison if either is).
PIPEOFFLOAD_HOST_DEVICE inline Fixed sum(Fixed a, Fixed b) { return a == poison() || b == poison() ? poison() : a + b; }

/// The sum as fp32: one rounding (128-bit integer to fp32, to nearest even, then an exact
/// power-of-two scale: a nonzero sum is at least 2^-76, far above fp32's subnormals). NaN
/// for a poisoned sum. The integer is cut to 64 bits with a sticky bit (any dropped bit set
/// sets the lowest kept one, which lies below fp32's rounding bit) and converted by the
/// 64-bit conversion, correctly rounded on the host and the GPU alike: a 128-bit one is
/// correctly rounded by the host's libgcc but not promised by nvcc.
PIPEOFFLOAD_HOST_DEVICE inline float to_float(Fixed a) {
  if (a == poison()) return NAN;
  const bool negative = a < 0;
  const FixedBits u = negative ? static_cast<FixedBits>(0) - static_cast<FixedBits>(a) : static_cast<FixedBits>(a);
  const auto high = static_cast<std::uint64_t>(u >> 64);
  int shift = 0;  // |a| = kept * 2^shift, rounded as one
  if (high != 0) {
#if defined(__CUDA_ARCH__)
    shift = 64 - __clzll(static_cast<long long>(high));
#else
    shift = 64 - __builtin_clzll(high);
#endif
  }
  const FixedBits dropped = shift == 0 ? 0 : u & ((static_cast<FixedBits>(1) << shift) - 1);
  const auto kept = static_cast<std::uint64_t>(u >> shift) | (dropped != 0 ? 1u : 0u);
  const float v = std::ldexp(static_cast<float>(kept), shift - fraction_bits);  // exact: a power of two
  return negative ? -v : v;
}

}  // namespace pipeoffload::exact
