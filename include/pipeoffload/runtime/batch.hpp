// pipeoffload/runtime/batch.hpp: po::Batch, one step's inputs as named host tensors.
//
// A batch holds any number of named tensors of any element type and shape (float features,
// int32 or int64 ids, bytes). Each is split into the step's m microbatches along its first
// dimension: microbatch i reads elements [i n/m, (i+1) n/m) of a tensor of n elements. Every
// rank gets the whole batch; a stage reads the tensors it declares in inputs() (the runtime
// uploads those to the device and checks their type and size). A Batch does not own the data:
// it must stay valid during the call it is passed to.
/// @file
#pragma once

#include <cstddef>
#include <functional>
#include <numeric>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace pipeoffload {

/// One named tensor of a batch, in host memory.
struct HostTensor {
  std::string name;                 ///< the name stages ask for (InputSpec::name)
  DType dtype = DType::float32;     ///< element type
  std::vector<long long> shape;     ///< row-major; shape[0] is split into microbatches
  const std::byte* data = nullptr;  ///< the elements, host memory the caller owns
  std::size_t elements = 0;         ///< elements in all (every microbatch)
  /// Size of the tensor in bytes.
  std::size_t bytes() const { return elements * dtype_size(dtype); }
};

/// A step's inputs.
/// @code
///   po::Batch batch;
///   batch.add("features", features, {m * rows, 12})   // std::vector<float>: float32
///        .add("targets", targets, {m * rows});        // float32 regression targets
///   rt.forward_backward(batch, {.step = step});
/// @endcode
class Batch {
 public:
  /// Adds a tensor from any contiguous range of float, double, int32, int64, uint8 or int8
  /// (its element type gives the DType). `shape` defaults to one dimension of its size.
  template <std::ranges::contiguous_range R>
  Batch& add(std::string name, R&& data, std::vector<long long> shape = {}) {
    static_assert(
        std::is_lvalue_reference_v<R> || std::ranges::borrowed_range<R>,
        "po::Batch::add: a batch does not own its data; pass a range that outlives the call, not a temporary.");
    using T = std::ranges::range_value_t<R>;
    return add(std::move(name), dtype_of<T>(), std::ranges::data(data),
               static_cast<std::size_t>(std::ranges::size(data)), std::move(shape));
  }

  /// Adds a tensor of `elements` values of `dtype` at `data` (for types without a C++
  /// counterpart here, such as bfloat16).
  Batch& add(std::string name, DType dtype, const void* data, std::size_t elements, std::vector<long long> shape = {}) {
    if (find(name) != nullptr) throw error("po::Batch::add: the batch already has a tensor named '" + name + "'");
    if (shape.empty()) shape.push_back(static_cast<long long>(elements));
    long long n = 1;
    for (long long x : shape) {
      if (x < 0)
        throw error("po::Batch::add: tensor '" + name + "' has a negative dimension (" + std::to_string(x) + ")");
      n *= x;
    }
    if (static_cast<std::size_t>(n) != elements)
      throw error("po::Batch::add: tensor '" + name + "' has " + std::to_string(elements) +
                  " elements but its shape holds " + std::to_string(n));
    tensors_.push_back({std::move(name), dtype, std::move(shape), static_cast<const std::byte*>(data), elements});
    return *this;
  }

  /// The tensor called `name`, or null.
  const HostTensor* find(std::string_view name) const {
    for (const HostTensor& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  /// Every tensor of the batch, in the order they were added.
  std::span<const HostTensor> tensors() const { return tensors_; }

  /// The names of every tensor, for messages ("none" when empty).
  std::string names() const {
    std::string s;
    for (const HostTensor& t : tensors_) s += (s.empty() ? "" : ", ") + t.name;
    return s.empty() ? "none" : s;
  }

 private:
  std::vector<HostTensor> tensors_;
};

}  // namespace pipeoffload
