// pipeoffload/layer.hpp: the `layer` concept, what a user implements for their model.
//
// A stage is one layer object (itself any run of sub-layers). The stages of one pipeline may
// be of different types (an embedding, blocks, a head): the runtime holds them type-erased
// (runtime/stage.hpp) and checks, when it is constructed, that every producer and its consumer
// agree on the boundary tensor between them.
//
// The runtime owns the memory a pass touches: the stage's saved activations for one
// microbatch live in one contiguous device buffer of saved_bytes() (what offload moves to
// host and back), and what B leaves for W lives in a stash buffer of stash_bytes() (alive
// from B to W, never offloaded).
/// @file
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "schedule/program.hpp"  // blocks_per_saved_part, max_reload_parts
#include "tensor.hpp"

namespace pipeoffload {

/// Shape of one microbatch: `batch` sequences of `seq` tokens (a model without sequences uses
/// seq = 1 and `batch` rows).
struct MicrobatchShape {
  int batch = 1;  ///< sequences (or rows) per microbatch
  int seq = 1;    ///< tokens per sequence
  /// Tokens per microbatch, batch * seq.
  constexpr long long tokens() const { return static_cast<long long>(batch) * seq; }
  /// Field-by-field equality.
  friend constexpr bool operator==(const MicrobatchShape&, const MicrobatchShape&) = default;
};

/// The tensor between two stages for one microbatch: activations forward (the producer's
/// output, the consumer's input) and their gradient backward, of the same size and type.
struct Boundary {
  std::size_t elements = 0;      ///< elements of the tensor
  DType dtype = DType::float32;  ///< its element type
  /// Size of the tensor in bytes.
  std::size_t bytes() const { return elements * dtype_size(dtype); }
  /// Field-by-field equality.
  friend constexpr bool operator==(const Boundary&, const Boundary&) = default;
};

/// A step input a stage reads (`inputs(shape)`): its name in the batch, its element type, and
/// its elements per microbatch.
struct InputSpec {
  std::string name;              ///< its name in the batch (Batch's tensor name)
  DType dtype = DType::float32;  ///< its element type
  std::size_t elements = 0;      ///< elements per microbatch
};

/// One named parameter tensor of a stage (`parameter_info()`): elements [offset, offset +
/// count()) of parameters(), row-major with `shape`. Optimizers select parameter groups by
/// it (e.g. no weight decay on 1-d tensors); checkpoints keep the names.
struct ParamInfo {
  std::string name;              ///< the tensor's name (checkpoints keep it)
  std::size_t offset = 0;        ///< first element within parameters()
  std::vector<long long> shape;  ///< dimensions, row-major
  /// Elements of the tensor: the product of `shape`.
  std::size_t count() const {
    return static_cast<std::size_t>(std::accumulate(shape.begin(), shape.end(), 1LL, std::multiplies<>()));
  }
};

/// A parameter tensor of a stage that is one parameter with tensors of other stages
/// (shared_parameters()): every tensor declared under the same `key`, on any stage of the
/// pipeline, holds the same values (tied embeddings: the token embedding on stage 0 and the
/// output projection on the last stage). The holder with the lowest stage (then the lowest
/// offset) is the primary: the runtime adds every holder's gradient into the primary's, in
/// holder order, after the step's last W; the optimizer keeps one state, the primary's, and
/// copies the updated values to the other holders; checkpoints store the primary's tensor;
/// the gradient norm counts it once (docs/shared_parameters.md).
struct SharedParam {
  std::string tensor;  ///< the tensor's name in the stage's parameter_info()
  std::string key;     ///< the tensors declared under one key, on any stages, are one parameter
};

/// One part of a stage's saved activations (the layer's optional saved_parts()): bytes
/// [offset, offset + bytes) of the saved buffer.
struct SavedPart {
  std::size_t offset = 0;  ///< first byte within the saved buffer
  std::size_t bytes = 0;   ///< its length
  /// Field-by-field equality.
  friend constexpr bool operator==(const SavedPart&, const SavedPart&) = default;
};

/// saved_parts() of a stage whose saved buffer is `blocks` slices of `block_bytes` from offset
/// 0, then a head's `head_bytes` (0: none), and whose backward_input reads the head, then the
/// blocks last to first: the head's part, then the blocks' from the last down,
/// blocks_per_saved_part(blocks, head) blocks a part (so it awaits a part before the highest
/// block of it). Empty when the buffer is (never a zero-byte part).
inline std::vector<SavedPart> stacked_saved_parts(int blocks, std::size_t block_bytes, std::size_t head_bytes) {
  std::vector<SavedPart> parts;
  if (head_bytes > 0) parts.push_back({static_cast<std::size_t>(blocks) * block_bytes, head_bytes});
  if (block_bytes == 0) return parts;
  const int per = blocks_per_saved_part(blocks, head_bytes > 0);
  for (int top = blocks; top > 0; top -= per) {
    const int lo = top > per ? top - per : 0;
    parts.push_back({static_cast<std::size_t>(lo) * block_bytes, static_cast<std::size_t>(top - lo) * block_bytes});
  }
  return parts;
}

/// Costs::reload_shares of a stage with these saved_parts: each part's share of their bytes, in
/// their order; none for fewer than two parts (a unit that reloads whole).
inline std::vector<double> saved_part_shares(std::span<const SavedPart> parts) {
  std::vector<double> out;
  if (parts.size() < 2) return out;
  double total = 0;
  for (const SavedPart& p : parts) total += static_cast<double>(p.bytes);
  for (const SavedPart& p : parts) out.push_back(static_cast<double>(p.bytes) / total);
  return out;
}

namespace detail {
/// How Microbatch::await_saved reaches the runtime: fn(self, part).
struct SavedWait {
  void (*fn)(void* self, int part) = nullptr;
  void* self = nullptr;
};
}  // namespace detail

/// One microbatch's slice of a step input, as a pass sees it.
struct StepInput {
  std::string_view name;  ///< the step input's name (as in InputSpec::name)
  ConstTensor tensor;     ///< this microbatch's slice of it, in the backend's device memory
  /// The same slice in host memory: the batch given to the runtime's step (its caller's
  /// memory), readable on the host while the pass is called, never in stream order (a GPU
  /// layer reads it to size its launches, e.g. a packed row's document count).
  ConstTensor host;
};

/// What the runtime tells a pass about its microbatch.
struct Microbatch {
  int stage = 0;         ///< this layer's stage, 0..S-1
  int stages = 1;        ///< S
  int mb = 0;            ///< microbatch index within the optimizer step, 0..microbatches-1
  int microbatches = 1;  ///< microbatches whose gradients one optimizer step sums (m x accumulation parts)
  int step = 0;          ///< 0-based optimizer step (dropout seeds depend on it)
  /// The step again, as an int32 in device memory (read in stream order), when the runtime
  /// replays captured calls (RuntimeOptions::graphs); null otherwise. A replayed pass gets the
  /// Microbatch of the capture, so what changes from step to step is read from here
  /// (ops::DropoutSeed takes it).
  const std::int32_t* device_step = nullptr;
  bool training = true;     ///< false in Runtime::evaluate (no dropout, nothing kept for backward)
  MicrobatchShape shape{};  ///< the microbatch's shape (RuntimeOptions::microbatch)
  /// This microbatch's slices of the step inputs this stage declared in inputs(), in the
  /// backend's device memory (host memory on backend::Cpu), valid in stream order.
  std::span<const StepInput> inputs;
  /// The last stage's forward writes this microbatch's mean loss here (one float of device
  /// memory, in stream order; the runtime reads it after the passes). Null on other stages.
  float* loss = nullptr;
  /// The last stage scales its loss gradient by this: 1/microbatches, so gradients are the
  /// mean over the step's microbatches of each microbatch's mean loss.
  float loss_scale = 1;
  /// Set by the runtime for backward_input (null elsewhere): what await_saved calls.
  const detail::SavedWait* saved_wait = nullptr;

  /// For a layer that declares saved_parts(): its backward_input calls await_saved(i) before
  /// it first reads part i (parts in saved_parts() order; awaiting part i awaits every part
  /// before it, and a part awaited already returns at once). On a unit that was offloaded, the
  /// reload copies the parts in that order, and the pass waits (in stream order: a GPU layer's
  /// later kernels wait, a CPU pass blocks) only up to part i, so the B starts once the first
  /// part is back instead of the whole unit. The runtime checks, after each B, that every part
  /// was awaited.
  void await_saved(int part) const {
    if (saved_wait != nullptr) saved_wait->fn(saved_wait->self, part);
  }

  /// Is this the first stage (stage 0)?
  bool first() const { return stage == 0; }
  /// Is this the last stage (stage S-1)?
  bool last() const { return stage == stages - 1; }

  /// The step input `name` (a stage reads only what it declared); throws naming the inputs there are.
  ConstTensor input(std::string_view name) const {
    for (const StepInput& in : inputs)
      if (in.name == name) return in.tensor;
    std::string have;
    for (const StepInput& in : inputs) have += (have.empty() ? "" : ", ") + std::string(in.name);
    throw error("stage " + std::to_string(stage) + " reads the step input '" + std::string(name) +
                "', which it did not declare in inputs() (it declared: " + (have.empty() ? "none" : have) + ")");
  }
  /// The same as T elements (throws if the input holds another type).
  template <class T>
  const T* input(std::string_view name) const {
    return input(name).template as<T>();
  }
  /// The step input `name` in host memory (StepInput::host); throws as input() does, and when
  /// the caller of the pass gave no host view.
  ConstTensor host_input(std::string_view name) const {
    for (const StepInput& in : inputs)
      if (in.name == name) {
        if (!in.host)
          throw error("stage " + std::to_string(stage) + " reads the step input '" + std::string(name) +
                      "' on the host, and its caller gave no host view (StepInput::host; po::Runtime gives one)");
        return in.host;
      }
    return input(name);  // throws naming the inputs there are
  }
  /// The same as T elements.
  template <class T>
  const T* host_input(std::string_view name) const {
    return host_input(name).template as<T>();
  }
};

namespace detail {
/// What parameters() may return: fp32 values, or a tensor (of bfloat16 values).
template <class P>
concept working_parameters = std::convertible_to<P, std::span<float>> || std::convertible_to<P, Tensor>;
}  // namespace detail

/// A pipeline stage's model code, for a backend whose pass context is `Ctx` (backend::Cpu's
/// is backend::CpuContext; a CUDA context carries the stream the pass enqueues on).
///
/// Sizes, for a microbatch shape:
/// - input_boundary(shape): the Boundary this stage takes from the stage before it (ignored on
///   stage 0); output_boundary(shape): what it hands to the next one (ignored on the last).
///   A producer's output and its consumer's input must be equal (checked at construction).
/// - saved_bytes(shape): bytes kept from F until W (one activation unit; offload moves it).
/// - stash_bytes(shape): bytes B leaves for W.
/// Passes (every pointer and view is the backend's device memory; host memory on backend::Cpu):
/// - forward(ctx, mb, x, y, saved) -> void: x is empty on stage 0 (it reads a step input,
///   mb.input<T>(name)), y is empty on the last stage, which writes the microbatch's mean loss
///   to *mb.loss. A pass may run asynchronously (a GPU layer enqueues kernels on ctx's stream
///   and returns), so nothing comes back by value.
/// - backward_input(ctx, mb, dy, dx, saved, stash): activation gradients only (B). dy is empty
///   on the last stage (the loss is the output), dx is empty on stage 0.
/// - backward_weight(ctx, mb, saved, stash): accumulates (+=) into gradients() (W).
/// - parameters(), gradients(): the stage's working parameters (what its passes read) and its
///   fp32 main gradients, of equal length; each W adds into the gradients in place
///   (RuntimeOptions::gradients: the standard path; the exact path folds them into
///   fixed-point sums). Gradients accumulate across forward_backward calls until
///   Runtime::zero_grad(). The working parameters are a std::span<float> (fp32), or a
///   po::Tensor of bfloat16 values (a mixed-precision stage holds 2 + 4 bytes a parameter).
///   What the optimizer holds, on the device, for the parameters its replica owns (all of
///   them, or with ZeRO-1 its shard, Runtime::owned): its state (AdamW's moments, SGD's
///   momentum) and, for bfloat16 working parameters, their fp32 master copy, which it updates
///   and rounds back into the working parameters; fp32 working parameters are their own master
///   copy and are updated in place (docs/gradients.md).
/// Optional members the runtime uses when present:
/// - inputs(shape) -> std::vector<po::InputSpec>: the step inputs the stage reads (the
///   runtime uploads them and checks each step's batch against them);
/// - norm_groups() -> std::vector<std::size_t>: runs of parameters, in order, whose squared
///   gradients are summed separately (in fp64) before they are added in model order; cut a
///   model into stages only at group boundaries and the gradient norm is bit-identical for
///   every cut (default: one group per stage);
/// - shared_parameters() -> std::vector<po::SharedParam>: tensors of this stage that are one
///   parameter with tensors of other stages (tied embeddings; SharedParam says what the
///   runtime, the optimizers and checkpoints do with them);
/// - parameter_info() -> std::vector<po::ParamInfo>: named tensors covering parameters()
///   (default: one 1-d tensor "parameters"), for optimizer parameter groups;
/// - name() -> std::string: the stage type's name in messages (default: the C++ type name).
/// - saved_parts(shape) -> std::vector<po::SavedPart>: the saved buffer cut into parts, in the
///   order backward_input first reads them (they must tile [0, saved_bytes) without overlap);
///   backward_input then calls mb.await_saved(i) before it reads part i, and a reload copies
///   the parts in that order so that the B waits only for the part it needs next
///   (docs/design.md section 3; a model of blocks lists the head, then the blocks last to
///   first). Default: one part, the whole buffer, awaited before the B starts.
/// - capturable() -> bool: true when the passes enqueue the same work at every call but for
///   what they read from device memory, so RuntimeOptions::graphs may capture a call once and
///   replay it: the passes read the step from mb.device_step, never mb.step, and make no host
///   call that waits for the device (default: false, and graphs refuse the stage).
/// - prepare(mb): called on the host for every microbatch of a runtime call (forward_backward,
///   evaluate), its step inputs' device and host views in mb, after the inputs are uploaded and
///   before any pass of the call is enqueued or any message of it sent: where a layer makes
///   what its passes will need for these inputs (a GPU layer's kernels or cuDNN graphs for a
///   size it reads on the host, mb.host_input), so that nothing is compiled or loaded while a
///   communication kernel of the step waits for another rank (a hang: docs/faults.md), and a
///   bad input is refused before the step starts.
///
/// A minimal user layer, y = tanh(w * x) per element on a boundary of `n` floats:
/// @code
///   struct Scale {
///     float w = 0.5f, gw = 0;
///     static constexpr std::size_t n = 4;
///     po::Boundary input_boundary(po::MicrobatchShape) const { return {n}; }   // n float32
///     po::Boundary output_boundary(po::MicrobatchShape) const { return {n}; }
///     std::size_t saved_bytes(po::MicrobatchShape) const { return 2 * n * sizeof(float); }  // x, y
///     std::size_t stash_bytes(po::MicrobatchShape) const { return n * sizeof(float); }      // dz
///     std::vector<po::InputSpec> inputs(po::MicrobatchShape) const { return {{"x", po::DType::float32, n}}; }
///     void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y, std::byte* saved) {
///       const float* in = mb.first() ? mb.input<float>("x") : x.as<float>();
///       auto* s = reinterpret_cast<float*>(saved);
///       for (std::size_t i = 0; i < n; ++i) {
///         s[i] = in[i];
///         s[n + i] = std::tanh(w * s[i]);
///         if (y) y.as<float>()[i] = s[n + i];
///       }
///       if (mb.last()) *mb.loss = s[n];  // last stage: the "loss"
///     }
///     void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor dy, po::Tensor dx,
///                         std::byte* saved, std::byte* stash) {
///       const auto* s = reinterpret_cast<const float*>(saved);
///       auto* dz = reinterpret_cast<float*>(stash);
///       for (std::size_t i = 0; i < n; ++i) {
///         const float g = dy ? dy.as<float>()[i] : (i == 0 ? mb.loss_scale : 0.0f);
///         dz[i] = g * (1 - s[n + i] * s[n + i]);
///         if (dx) dx.as<float>()[i] = dz[i] * w;
///       }
///     }
///     void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte* saved, std::byte* stash) {
///       const auto* s = reinterpret_cast<const float*>(saved);
///       const auto* dz = reinterpret_cast<const float*>(stash);
///       for (std::size_t i = 0; i < n; ++i) gw += dz[i] * s[i];
///     }
///     std::span<float> parameters() { return {&w, 1}; }
///     std::span<float> gradients() { return {&gw, 1}; }
///   };
///   static_assert(po::layer_for<Scale, po::backend::CpuContext>);
/// @endcode
template <class L, class Ctx>
concept layer_for = requires(L& l, const L& cl, Ctx& ctx, const Microbatch& mb, MicrobatchShape shape, ConstTensor in,
                             Tensor out, std::byte* buf) {
  { cl.input_boundary(shape) } -> std::convertible_to<Boundary>;
  { cl.output_boundary(shape) } -> std::convertible_to<Boundary>;
  { cl.saved_bytes(shape) } -> std::convertible_to<std::size_t>;
  { cl.stash_bytes(shape) } -> std::convertible_to<std::size_t>;
  { l.forward(ctx, mb, in, out, buf) } -> std::same_as<void>;
  l.backward_input(ctx, mb, in, out, buf, buf);
  l.backward_weight(ctx, mb, buf, buf);
  requires detail::working_parameters<decltype(l.parameters())>;
  { l.gradients() } -> std::convertible_to<std::span<float>>;
};

namespace detail {
template <class L>
concept declares_inputs = requires(const L& l, MicrobatchShape s) {
  { l.inputs(s) } -> std::convertible_to<std::vector<InputSpec>>;
};
template <class L>
concept has_norm_groups = requires(const L& l) {
  { l.norm_groups() } -> std::convertible_to<std::vector<std::size_t>>;
};
template <class L>
concept has_parameter_info = requires(const L& l) {
  { l.parameter_info() } -> std::convertible_to<std::vector<ParamInfo>>;
};
template <class L>
concept has_shared_parameters = requires(const L& l) {
  { l.shared_parameters() } -> std::convertible_to<std::vector<SharedParam>>;
};
template <class L>
concept has_capturable = requires(const L& l) {
  { l.capturable() } -> std::convertible_to<bool>;
};
template <class L>
concept has_prepare = requires(L& l, const Microbatch& mb) { l.prepare(mb); };
template <class L>
concept has_saved_parts = requires(const L& l, MicrobatchShape s) {
  { l.saved_parts(s) } -> std::convertible_to<std::vector<SavedPart>>;
};
template <class L>
concept has_name = requires(const L& l) {
  { l.name() } -> std::convertible_to<std::string>;
};
}  // namespace detail

}  // namespace pipeoffload
