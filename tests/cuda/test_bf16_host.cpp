// tests/cuda/test_bf16_host.cpp: po::bf16_bits (the CPU backend's float -> bfloat16) against
// cuda_bf16.h's __float2bfloat16, whose host path rounds as the GPU's cvt.rn.bf16.f32 does
// (to nearest even; every NaN to the canonical 0x7fff). Built where the toolkit's headers are;
// runs without a GPU.
#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <random>

#include <pipeoffload/tensor.hpp>

namespace {

std::uint16_t cuda_bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16(x);
  std::uint16_t out = 0;
  std::memcpy(&out, &b, sizeof out);
  return out;
}

}  // namespace

TEST_CASE(
    "po::bf16_bits equals cuda_bf16.h's __float2bfloat16 on every high half and the low halves that decide rounding") {
  // Every sign, exponent and leading mantissa (all 65,536 high halves: zeros, subnormals,
  // infinities and NaNs among them) with the low halves below, at and above the tie, and random.
  std::mt19937 rng(20261129);
  std::size_t checked = 0, mismatches = 0;
  for (std::uint32_t high = 0; high < 0x10000u; ++high)
    for (std::uint32_t low :
         {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, static_cast<std::uint32_t>(rng() & 0xffffu)}) {
      const float x = std::bit_cast<float>(high << 16 | low);
      mismatches += pipeoffload::bf16_bits(x) != cuda_bits(x);
      ++checked;
    }
  CHECK(checked == 65536u * 7u);
  CHECK(mismatches == 0u);
  CHECK(cuda_bits(std::bit_cast<float>(0xffc00001u)) == 0x7fffu);  // a negative NaN with a payload
}
