// pipeoffload/schedule/detail/numeric.hpp: the schedule core's two numeric habits, each
// defined once: division by a fixed divisor as a multiply and a shift (FastDiv), and the
// tolerance within which two planned times or byte counts are taken as equal (tolerance).
#pragma once

#include <cstdint>
#include <limits>

#include "../../error.hpp"

namespace pipeoffload::detail {

/// n / d for a divisor fixed ahead of a hot loop: (n * magic) >> 40 with magic = 2^40 / d + 1.
/// Exact for 0 <= n <= max_n whenever max_n * d < 2^40 (the error n * (magic - 2^40/d) / 2^40
/// stays below 1/d) and n * magic fits in 64 bits; the constructor refuses a range outside
/// that (a library bug: callers pass the bounds of a checked shape, such as s < S <= 2^20 with
/// d <= 2^12, or a unit u < v*m <= 2^24 with m <= 2^16).
class FastDiv {
 public:
  constexpr FastDiv() = default;  // d = 1
  constexpr FastDiv(std::uint64_t d, std::uint64_t max_n) : magic_(d == 0 ? 0 : (std::uint64_t{1} << 40) / d + 1) {
    if (d == 0 || max_n >= (std::uint64_t{1} << 40) / d || max_n > std::numeric_limits<std::uint64_t>::max() / magic_)
      throw error("FastDiv: numerators up to " + num(static_cast<long long>(max_n)) + " by " +
                  num(static_cast<long long>(d)) +
                  " are outside its exact range (max_n * d < 2^40, max_n * magic < 2^64)");
  }
  constexpr std::uint64_t operator()(std::uint64_t n) const { return (n * magic_) >> 40; }

 private:
  std::uint64_t magic_ = (std::uint64_t{1} << 40) + 1;
};

/// The slack within which two planned quantities of magnitude up to `scale` are equal:
/// 1e-9 of it, far above double rounding over a schedule's sums and far below any cost.
constexpr double tolerance(double scale) { return 1e-9 * scale; }

}  // namespace pipeoffload::detail
