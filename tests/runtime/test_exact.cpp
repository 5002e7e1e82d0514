// tests/runtime/test_exact.cpp: backend/exact.hpp, the exact gradient sums, against a plain
// integer reference (each float taken apart with frexp, shifted and rounded to the grid by
// integer arithmetic; a sum rounded to fp32 bit by bit), on seeded random values of every
// magnitude; and the property the runtime relies on: any order and any split into partial sums
// give the same bits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <pipeoffload/backend/cpu/cpu.hpp>
#include <pipeoffload/backend/exact.hpp>

namespace {

namespace ex = pipeoffload::exact;
using Fixed = ex::Fixed;
using Bits = ex::FixedBits;

/// The reference of one term: x = m * 2^e with an integer m of at most 24 bits, then
/// m * 2^(e + 76) rounded to an integer, ties to even, by integer shifts.
Fixed ref_term(float x) {
  if (x == 0.0f) return 0;
  int e = 0;
  const double f = std::frexp(static_cast<double>(x), &e);      // x = f * 2^e, 0.5 <= |f| < 1
  const auto m = static_cast<std::int64_t>(std::ldexp(f, 24));  // exact: a float has 24 bits
  const int shift = e - 24 + ex::fraction_bits;                 // x * 2^76 = m * 2^shift
  const bool neg = m < 0;
  Bits a = static_cast<Bits>(neg ? -m : m);
  if (shift >= 0) {
    a <<= shift;
  } else if (shift <= -64) {
    a = 0;  // below half a unit
  } else {
    const int s = -shift;
    const Bits q = a >> s, rem = a & ((static_cast<Bits>(1) << s) - 1), half = static_cast<Bits>(1) << (s - 1);
    a = q + ((rem > half || (rem == half && (q & 1) != 0)) ? 1 : 0);
  }
  return neg ? -static_cast<Fixed>(a) : static_cast<Fixed>(a);
}

/// The reference of a sum's fp32 value: the top 24 bits of |a|, rounded to nearest even on the
/// rest, times 2^(exponent - 76).
float ref_float(Fixed a) {
  if (a == 0) return 0.0f;
  const bool neg = a < 0;
  Bits u = neg ? static_cast<Bits>(-a) : static_cast<Bits>(a);
  int top = 127;
  while (((u >> top) & 1) == 0) --top;
  std::uint64_t mant = 0;
  int exp2 = 0;  // value = mant * 2^exp2 units
  if (top < 24) {
    mant = static_cast<std::uint64_t>(u);
  } else {
    const int s = top - 23;
    Bits q = u >> s;
    const Bits rem = u & ((static_cast<Bits>(1) << s) - 1), half = static_cast<Bits>(1) << (s - 1);
    if (rem > half || (rem == half && (q & 1) != 0)) ++q;
    mant = static_cast<std::uint64_t>(q);
    exp2 = s;
  }
  const float v = std::ldexp(static_cast<float>(mant), exp2 - ex::fraction_bits);
  return neg ? -v : v;
}

bool same(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// Values of every magnitude fp32 gradients take, both signs, some exact zeros.
std::vector<float> values(std::mt19937_64& rng, std::size_t n) {
  std::uniform_real_distribution<double> mag(-60, 31), unit(0, 1);
  std::vector<float> out(n);
  for (float& x : out) {
    const double u = unit(rng);
    x = u < 0.05 ? 0.0f : static_cast<float>((u < 0.5 ? -1 : 1) * std::exp2(mag(rng)) * (1 + unit(rng)));
  }
  return out;
}

}  // namespace

TEST_CASE("exact sums: one term and one sum's fp32 value match a plain integer reference, bit for bit") {
  std::mt19937_64 rng(20261124);
  const std::vector<float> xs = values(rng, 200000);
  for (float x : xs) {
    Fixed acc = 0;
    ex::add(acc, x);
    REQUIRE(acc == ref_term(x));
  }
  // Sums of a few terms, read back.
  for (std::size_t i = 0; i + 7 < xs.size(); i += 7) {
    Fixed acc = 0, ref = 0;
    for (std::size_t k = i; k < i + 7; ++k) {
      ex::add(acc, xs[k]);
      ref += ref_term(xs[k]);
    }
    REQUIRE(acc == ref);
    REQUIRE(same(ex::to_float(acc), ref_float(ref)));
  }
  // Small values are exact: a float is its own sum.
  for (float x : {1.0f, -3.5f, 1e-6f, 6.1e-5f, 12345.678f, -0.1f}) {
    Fixed acc = 0;
    ex::add(acc, x);
    CHECK(same(ex::to_float(acc), x));
  }
}

TEST_CASE(
    "exact sums: to_float rounds every 128-bit sum as one correct rounding, ties and sticky bits beyond 64 bits") {
  // Sums above 2^64 units (to_float cuts them to 64 bits with a sticky bit): exact ties, ties
  // broken by a bit below the 64 kept, both signs; against the integer reference and the host's
  // own 128-bit conversion (libgcc's, correctly rounded).
  const auto host = [](Fixed a) { return static_cast<float>(a) * 0x1p-76f; };
  std::vector<Fixed> cases;
  for (int top = 60; top <= 120; ++top)
    for (int guard : {top - 24, top - 25}) {
      const Fixed base = static_cast<Fixed>(1) << top;
      for (const Fixed extra : {Fixed{0}, Fixed{1}, static_cast<Fixed>(1) << (guard > 1 ? guard - 1 : 0)}) {
        cases.push_back(base + (static_cast<Fixed>(1) << guard) + extra);  // a tie, then just above it
        cases.push_back(base + (static_cast<Fixed>(3) << guard) + extra);  // odd kept bits: ties round up
        cases.push_back(base + (static_cast<Fixed>(1) << guard) - 1);      // just below the tie
      }
    }
  cases.push_back((static_cast<Fixed>(1) << 100) + (static_cast<Fixed>(1) << 76) + 1);
  std::mt19937_64 rng(20261129);
  for (int i = 0; i < 200000; ++i) {
    const int bits = 1 + static_cast<int>(rng() % 120);
    Bits u = (static_cast<Bits>(rng()) << 64) | rng();
    u >>= 128 - bits;
    cases.push_back(static_cast<Fixed>(u));
  }
  std::size_t differ = 0;
  for (const Fixed a : cases)
    for (const Fixed x : {a, -a}) differ += !same(ex::to_float(x), ref_float(x)) || !same(ex::to_float(x), host(x));
  CHECK(cases.size() > 200000);
  CHECK(differ == 0);
}

TEST_CASE("exact sums: any order and any split into partial sums give the same bits; bad values poison") {
  std::mt19937_64 rng(7);
  const std::size_t terms = 96, n = 257;
  std::vector<std::vector<float>> g(terms);
  for (auto& t : g) t = values(rng, n);
  pipeoffload::backend::Cpu dev(pipeoffload::backend::Cpu::Options{});
  pipeoffload::backend::CpuContext ctx{};
  const auto sum_in = [&](std::vector<std::size_t> order, std::size_t parts) {
    // `parts` partial sums over consecutive runs of `order`, then exact_sum of the parts.
    std::vector<Fixed> acc(n * parts, 0);
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t p = k * parts / order.size();
      dev.exact_add(ctx, std::span<Fixed>(acc).subspan(p * n, n), std::span<const float>(g[order[k]]));
    }
    std::vector<Fixed> total(n);
    dev.exact_sum(ctx, std::span<Fixed>(total), std::span<const Fixed>(acc));
    std::vector<float> out(n);
    dev.exact_round(ctx, std::span<float>(out), std::span<const Fixed>(total));
    return out;
  };
  std::vector<std::size_t> order(terms);
  for (std::size_t k = 0; k < terms; ++k) order[k] = k;
  const std::vector<float> ref = sum_in(order, 1);
  // A sequential fp32 sum would not do: it differs from the exact one somewhere.
  std::vector<float> naive(n, 0.0f);
  for (const auto& t : g)
    for (std::size_t i = 0; i < n; ++i) naive[i] += t[i];
  CHECK(naive != ref);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t parts : {1, 2, 3, 5, 8}) {
      CAPTURE(trial);
      CAPTURE(parts);
      const std::vector<float> got = sum_in(order, parts);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(same(got[i], ref[i]));
    }
  }
  // NaN, infinity and values beyond the range poison their sum, which reads back as NaN.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -5e9f}) {
    Fixed acc = 0;
    ex::add(acc, 1.0f);
    ex::add(acc, bad);
    ex::add(acc, 2.0f);
    CHECK(acc == ex::poison());
    CHECK(std::isnan(ex::to_float(acc)));
    CHECK(ex::sum(acc, Fixed{3}) == ex::poison());
  }
  CHECK_THROWS_WITH_AS(dev.exact_sum(ctx, std::span<Fixed>(std::vector<Fixed>(4).data(), 4),
                                     std::span<const Fixed>(std::vector<Fixed>(6).data(), 6)),
                       "backend::Cpu::exact_sum: 6 partial sums do not make whole parts of 4 values",
                       pipeoffload::error);
}
