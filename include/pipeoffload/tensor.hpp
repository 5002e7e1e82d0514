// pipeoffload/tensor.hpp: element types and the untyped tensor views that passes and batches use.
//
// The runtime moves bytes (boundary tensors between stages, a step's inputs to the device); a
// stage reads them through a view that knows its element type and refuses the wrong one:
//   const float* x = in.as<float>();   // throws if `in` holds int32 values
/// @file
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <string>
#include <type_traits>

#include "error.hpp"

namespace pipeoffload {

/// Element type of a tensor the runtime moves (boundaries, inputs).
enum class DType : std::uint8_t { float32, float64, bfloat16, float16, int32, int64, uint8, int8 };

/// Bytes per element of type t.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::float64:
    case DType::int64:
      return 8;
    case DType::float32:
    case DType::int32:
      return 4;
    case DType::bfloat16:
    case DType::float16:
      return 2;
    case DType::uint8:
    case DType::int8:
      return 1;
  }
  return 0;
}

/// The type's name for messages ("float32", "bfloat16", ...).
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::float32:
      return "float32";
    case DType::float64:
      return "float64";
    case DType::bfloat16:
      return "bfloat16";
    case DType::float16:
      return "float16";
    case DType::int32:
      return "int32";
    case DType::int64:
      return "int64";
    case DType::uint8:
      return "uint8";
    case DType::int8:
      return "int8";
  }
  return "?";
}

/// Floating-point types, whose values can be non-finite (the runtime's NaN/Inf check).
constexpr bool is_floating(DType t) {
  return t == DType::float32 || t == DType::float64 || t == DType::bfloat16 || t == DType::float16;
}

/// The DType of a C++ element type (bf16 and fp16 have no standard C++ type before C++23: a
/// GPU layer views them through its own 2-byte type with as_bytes()).
template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return DType::float32;
  else if constexpr (std::is_same_v<U, double>)
    return DType::float64;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return DType::int32;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return DType::int64;
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return DType::uint8;
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return DType::int8;
  else
    static_assert(sizeof(U) == 0,
                  "po::dtype_of<T>: T must be float, double, std::int32_t, std::int64_t, std::uint8_t or std::int8_t.");
}

/// `x` rounded to bfloat16 (to nearest, ties to even; every NaN becomes the canonical 0x7fff):
/// its 16 bits, as cuda_bf16.h's __float2bfloat16 gives them on the host and the GPU
/// (cvt.rn.bf16.f32), so the CPU backend's conversions equal the CUDA kernels' bit for bit.
constexpr std::uint16_t bf16_bits(float x) {
  const auto u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/// The float a bfloat16's 16 bits hold (exact).
constexpr float bf16_value(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
static_assert(bf16_bits(1.0f) == 0x3f80 && bf16_value(0x3f80) == 1.0f && bf16_bits(1.00390625f) == 0x3f80 &&
              bf16_bits(1.01171875f) == 0x3f82 && bf16_bits(std::bit_cast<float>(0xffc00001u)) == 0x7fff &&
              bf16_bits(std::bit_cast<float>(0x7f800000u)) == 0x7f80);

namespace detail {

template <class Byte>
struct TensorView {
  Byte* data = nullptr;      ///< device memory of the backend (host memory on backend::Cpu); null when absent
  std::size_t elements = 0;  ///< element count
  DType dtype = DType::float32;

  constexpr TensorView() = default;
  constexpr TensorView(Byte* d, std::size_t n, DType t) : data(d), elements(n), dtype(t) {}
  /// A writable view is also a read-only one.
  template <class Other>
    requires(std::is_const_v<Byte> && std::is_same_v<Other, std::remove_const_t<Byte>>)
  constexpr TensorView(const TensorView<Other>& o) : data(o.data), elements(o.elements), dtype(o.dtype) {}

  explicit operator bool() const { return data != nullptr; }
  std::size_t bytes() const { return elements * dtype_size(dtype); }

  /// The data as T elements (null when absent); throws po::error if the view holds another type.
  template <class T>
  auto as() const {
    using Out = std::conditional_t<std::is_const_v<Byte>, const T*, T*>;
    if (data == nullptr) return static_cast<Out>(nullptr);
    if (dtype_of<T>() != dtype)
      throw error(std::string("po::Tensor::as: the tensor holds ") + dtype_name(dtype) + " values, not " +
                  dtype_name(dtype_of<T>()));
    return reinterpret_cast<Out>(data);
  }
};

}  // namespace detail

/// A writable view of device memory: a pass's output boundary (y) or input gradient (dx).
using Tensor = detail::TensorView<std::byte>;
/// A read-only view: a pass's input boundary (x), output gradient (dy), or a step input.
using ConstTensor = detail::TensorView<const std::byte>;

/// A view of a contiguous range of float, double, int32, int64, uint8 or int8 elements (host
/// memory: for calling a CPU layer's passes directly, as tests do); read-only for const ones.
template <std::ranges::contiguous_range R>
auto view(R&& r) {
  using T = std::remove_reference_t<std::ranges::range_reference_t<R>>;
  const auto n = static_cast<std::size_t>(std::ranges::size(r));
  if constexpr (std::is_const_v<T>)
    return ConstTensor{reinterpret_cast<const std::byte*>(std::ranges::data(r)), n, dtype_of<T>()};
  else
    return Tensor{reinterpret_cast<std::byte*>(std::ranges::data(r)), n, dtype_of<T>()};
}

}  // namespace pipeoffload
