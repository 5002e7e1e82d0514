// pipeoffload/model/layer.hpp: the `layer` concept, what a user implements for their model.
//
// A stage is one layer object (itself any run of sub-layers). The runtime owns the memory a
// pass touches: the stage's saved activations for one microbatch live in one contiguous
// device buffer of saved_bytes() (what offload moves to host and back), and what B leaves for
// W lives in a stash buffer of stash_bytes() (alive from B to W, never offloaded).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "../backend/cpu/context.hpp"

namespace pipeoffload {

/// Shape of one microbatch: `batch` sequences of `seq` tokens.
struct MicrobatchShape {
  int batch = 1;
  int seq = 1;
  constexpr long long tokens() const { return static_cast<long long>(batch) * seq; }
  friend constexpr bool operator==(const MicrobatchShape&, const MicrobatchShape&) = default;
};

/// What the runtime tells a pass about its microbatch.
struct Microbatch {
  int stage = 0;         ///< this layer's stage, 0..S-1
  int stages = 1;        ///< S
  int mb = 0;            ///< microbatch index in the iteration, 0..m-1
  int microbatches = 1;  ///< m
  int step = 0;          ///< 0-based optimizer step (dropout seeds depend on it)
  MicrobatchShape shape{};
  /// Inputs in the backend's device memory (host memory on backend::Cpu), valid in stream order:
  const std::int32_t* tokens = nullptr;   ///< (batch, seq) token ids of this microbatch
  const std::int32_t* targets = nullptr;  ///< (batch, seq) next-token targets of this microbatch
  /// The last stage's forward writes this microbatch's mean loss here (one float of device
  /// memory, in stream order; the runtime reads it after the step). Null on other stages.
  float* loss = nullptr;
  /// The last stage scales its loss gradient by this: 1/m, so gradients are the mean over
  /// microbatches of each microbatch's mean loss.
  float loss_scale = 1;
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

/// A pipeline stage's model code, for a backend whose pass context is `Ctx` (backend::Cpu's
/// is backend::CpuContext; a CUDA context carries the stream the pass enqueues on).
///
/// - boundary_floats(shape): floats of the tensor passed between stages (activations forward,
///   gradients backward); the same for every stage.
/// - saved_bytes(shape): bytes kept from F until W (one activation unit; offload moves it).
/// - stash_bytes(shape): bytes B leaves for W.
/// - forward(ctx, mb, x, y, saved) -> void: x is null on the first stage (read mb.tokens), y
///   is null on the last stage, which writes the microbatch's mean loss to *mb.loss. A pass
///   may run asynchronously (a GPU layer enqueues kernels on ctx's stream and returns), so
///   nothing comes back by value.
/// All pointers a pass gets (x, y, dy, dx, saved, stash, mb.tokens, mb.targets, mb.loss) and
/// the spans parameters() and gradients() are the backend's device memory; on backend::Cpu
/// that is host memory.
/// - backward_input(ctx, mb, dy, dx, saved, stash): activation gradients only (B). dy is null
///   on the last stage (the loss is the output), dx is null on the first stage.
/// - backward_weight(ctx, mb, saved, stash): accumulates (+=) into gradients() (W).
/// - parameters(), gradients(): contiguous fp32 spans of equal length; the runtime zeroes the
///   gradients after each optimizer step and updates the parameters in place.
///
/// A minimal user layer, y = tanh(w * x) per element on a boundary of `n` floats:
/// @code
///   struct Scale {
///     float w = 0.5f, gw = 0;
///     static constexpr long long n = 4;
///     std::size_t boundary_floats(po::MicrobatchShape) const { return n; }
///     std::size_t saved_bytes(po::MicrobatchShape) const { return 2 * n * sizeof(float); }  // x, y
///     std::size_t stash_bytes(po::MicrobatchShape) const { return n * sizeof(float); }      // dz
///     void forward(po::backend::CpuContext&, const po::Microbatch& mb, const float* x, float* y, std::byte* saved) {
///       auto* s = reinterpret_cast<float*>(saved);
///       for (long long i = 0; i < n; ++i) {
///         s[i] = x ? x[i] : static_cast<float>(mb.tokens[0] % 7);  // first stage reads tokens
///         s[n + i] = std::tanh(w * s[i]);
///         if (y) y[i] = s[n + i];
///       }
///       if (mb.last()) *mb.loss = s[n];  // last stage: the "loss"
///     }
///     void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, const float* dy, float* dx,
///                         std::byte* saved, std::byte* stash) {
///       const auto* s = reinterpret_cast<const float*>(saved);
///       auto* dz = reinterpret_cast<float*>(stash);
///       for (long long i = 0; i < n; ++i) {
///         const float g = dy ? dy[i] : (i == 0 ? mb.loss_scale : 0.0f);
///         dz[i] = g * (1 - s[n + i] * s[n + i]);
///         if (dx) dx[i] = dz[i] * w;
///       }
///     }
///     void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte* saved, std::byte* stash) {
///       const auto* s = reinterpret_cast<const float*>(saved);
///       const auto* dz = reinterpret_cast<const float*>(stash);
///       for (long long i = 0; i < n; ++i) gw += dz[i] * s[i];
///     }
///     std::span<float> parameters() { return {&w, 1}; }
///     std::span<float> gradients() { return {&gw, 1}; }
///   };
///   static_assert(po::layer<Scale>);
/// @endcode
template <class L, class Ctx>
concept layer_for =
    requires(L& l, const L& cl, Ctx& ctx, const Microbatch& mb, MicrobatchShape shape, const float* cx, float* x,
             std::byte* buf) {
      { cl.boundary_floats(shape) } -> std::convertible_to<std::size_t>;
      { cl.saved_bytes(shape) } -> std::convertible_to<std::size_t>;
      { cl.stash_bytes(shape) } -> std::convertible_to<std::size_t>;
      { l.forward(ctx, mb, cx, x, buf) } -> std::same_as<void>;
      l.backward_input(ctx, mb, cx, x, buf, buf);
      l.backward_weight(ctx, mb, buf, buf);
      { l.parameters() } -> std::convertible_to<std::span<float>>;
      { l.gradients() } -> std::convertible_to<std::span<float>>;
    };

/// A layer for the CPU backend (the embedded default).
template <class L>
concept layer = layer_for<L, backend::CpuContext>;

}  // namespace pipeoffload
