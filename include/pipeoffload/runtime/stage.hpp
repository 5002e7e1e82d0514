// pipeoffload/runtime/stage.hpp: po::StageRef, one stage of any layer type behind one interface.
//
// The stages of a pipeline may be of different types (an embedding, blocks, a head), on one
// rank or spread over ranks. The runtime holds each as a StageRef: a pointer to the user's
// object and a table of functions made once per type, so a pass costs one indirect call
// (bench/RESULTS.md measures it against a pass of the sample GPT). A StageRef does not own its
// layer: the layer must outlive every runtime that holds it.
/// @file
#pragma once

#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#include <cxxabi.h>
#endif

#include "../layer.hpp"

namespace pipeoffload {

namespace detail {

/// The readable name of a C++ type (demangled where the ABI allows it).
template <class T>
std::string type_name() {
  const char* raw = typeid(T).name();
#if defined(__GNUC__) || defined(__clang__)
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(raw, nullptr, nullptr, &status), std::free);
  if (status == 0 && d) return d.get();
#endif
  return raw;
}

}  // namespace detail

/// A non-owning, type-erased reference to one stage whose passes run with context `Ctx`.
/// @code
///   Embedding embed; Block block; Head head;   // three layer types, one rank
///   std::vector<po::StageRef<po::backend::CpuContext>> mine = {embed, block, head};  // chunk order
///   po::Runtime rt(program, dev, comm, mine, {.microbatch = {4, 64}});
/// @endcode
template <class Ctx>
class StageRef {
 public:
  /// Refers to `layer` (which must outlive the reference); L must model layer_for<L, Ctx>.
  template <class L>
    requires(!std::is_same_v<std::remove_cvref_t<L>, StageRef>)
  StageRef(L& layer) : obj_(&layer), vt_(table_of<L>()) {  // NOLINT: implicit on purpose, like std::function_ref
    static_assert(
        layer_for<L, Ctx>,
        "po::StageRef: a stage must model po::layer_for<Stage, Context>: it needs input_boundary(shape), "
        "output_boundary(shape), saved_bytes(shape), stash_bytes(shape), forward(ctx, mb, x, y, saved) -> void, "
        "backward_input(ctx, mb, dy, dx, saved, stash), backward_weight(ctx, mb, saved, stash), parameters() and "
        "gradients(); see pipeoffload/layer.hpp.");
  }

  /// The layer's input tensor for one microbatch of shape `s`.
  Boundary input_boundary(MicrobatchShape s) const { return vt_->input_boundary(obj_, s); }
  /// The layer's output tensor for one microbatch of shape `s`.
  Boundary output_boundary(MicrobatchShape s) const { return vt_->output_boundary(obj_, s); }
  /// Bytes the layer keeps from F until W (one activation unit).
  std::size_t saved_bytes(MicrobatchShape s) const { return vt_->saved_bytes(obj_, s); }
  /// Bytes the layer's B leaves for its W.
  std::size_t stash_bytes(MicrobatchShape s) const { return vt_->stash_bytes(obj_, s); }
  /// The layer's F: y from x, keeping what backward needs in `saved`.
  void forward(Ctx& c, const Microbatch& mb, ConstTensor x, Tensor y, std::byte* saved) const {
    vt_->forward(obj_, c, mb, x, y, saved);
  }
  /// The layer's B: dx from dy (activation gradients only), leaving what W needs in `stash`.
  void backward_input(Ctx& c, const Microbatch& mb, ConstTensor dy, Tensor dx, std::byte* saved,
                      std::byte* stash) const {
    vt_->backward_input(obj_, c, mb, dy, dx, saved, stash);
  }
  /// The layer's W: accumulates (+=) its weight gradients into gradients().
  void backward_weight(Ctx& c, const Microbatch& mb, std::byte* saved, std::byte* stash) const {
    vt_->backward_weight(obj_, c, mb, saved, stash);
  }
  /// The layer's working parameters (device memory): fp32, or bfloat16 for a mixed-precision
  /// stage (layer.hpp).
  Tensor working() const { return vt_->parameters(obj_); }
  /// How many parameters the layer has.
  std::size_t parameter_count() const { return working().elements; }
  /// The layer's fp32 working parameters (device memory); throws for a stage whose working
  /// parameters are bfloat16 (read those through Runtime::download_parameters).
  std::span<float> parameters() const {
    const Tensor t = working();
    if (t.dtype != DType::float32)
      throw error("po::StageRef::parameters: stage " + name() + " keeps its working parameters in " +
                  dtype_name(t.dtype) + ", not float32 (Runtime::download_parameters converts them)");
    return {reinterpret_cast<float*>(t.data), t.elements};
  }
  /// The layer's gradients (device memory), parallel to its parameters.
  std::span<float> gradients() const { return vt_->gradients(obj_); }

  /// The parts of the saved buffer in the order backward_input reads them (layer.hpp); empty
  /// when the stage declares none (one part).
  std::vector<SavedPart> saved_parts(MicrobatchShape s) const { return vt_->saved_parts(obj_, s); }
  /// The step inputs the stage reads (none when it declares none).
  std::vector<InputSpec> inputs(MicrobatchShape s) const { return vt_->inputs(obj_, s); }
  /// Norm groups (one group of every parameter when the stage declares none).
  std::vector<std::size_t> norm_groups() const { return vt_->norm_groups(obj_); }
  /// Named parameter tensors (one 1-d tensor "parameters" when the stage declares none).
  std::vector<ParamInfo> parameter_info() const { return vt_->parameter_info(obj_); }
  /// The tensors the stage shares with other stages (none when it declares none).
  std::vector<SharedParam> shared_parameters() const { return vt_->shared_parameters(obj_); }
  /// The stage type's name() or, without one, its C++ type name.
  std::string name() const { return vt_->name(obj_); }
  /// Whether RuntimeOptions::graphs may capture the stage's passes (the layer's capturable();
  /// false when it declares none).
  bool capturable() const { return vt_->capturable(obj_); }
  /// Whether the layer has a prepare(mb) (layer.hpp).
  bool prepares() const { return vt_->prepare != nullptr; }
  /// The layer's prepare(mb) (nothing when it declares none).
  void prepare(const Microbatch& mb) const {
    if (vt_->prepare != nullptr) vt_->prepare(obj_, mb);
  }

  /// The layer itself, when the caller knows its type (nullptr for another type).
  template <class L>
  L* get() const {
    return vt_ == &table<L> ? static_cast<L*>(obj_) : nullptr;
  }

 private:
  struct VTable {
    Boundary (*input_boundary)(void*, MicrobatchShape);
    Boundary (*output_boundary)(void*, MicrobatchShape);
    std::size_t (*saved_bytes)(void*, MicrobatchShape);
    std::size_t (*stash_bytes)(void*, MicrobatchShape);
    void (*forward)(void*, Ctx&, const Microbatch&, ConstTensor, Tensor, std::byte*);
    void (*backward_input)(void*, Ctx&, const Microbatch&, ConstTensor, Tensor, std::byte*, std::byte*);
    void (*backward_weight)(void*, Ctx&, const Microbatch&, std::byte*, std::byte*);
    Tensor (*parameters)(void*);
    std::span<float> (*gradients)(void*);
    std::vector<SavedPart> (*saved_parts)(void*, MicrobatchShape);
    std::vector<InputSpec> (*inputs)(void*, MicrobatchShape);
    std::vector<std::size_t> (*norm_groups)(void*);
    std::vector<ParamInfo> (*parameter_info)(void*);
    std::vector<SharedParam> (*shared_parameters)(void*);
    std::string (*name)(void*);
    bool (*capturable)(void*);
    void (*prepare)(void*, const Microbatch&);  // null when the layer has none
  };

  // Only for layers: a type that is not one gets the static_assert's sentence and nothing else.
  template <class L>
  static constexpr const VTable* table_of() {
    if constexpr (layer_for<L, Ctx>)
      return &table<L>;
    else
      return nullptr;
  }

  template <class P>
  static Tensor working_of(P&& p) {
    if constexpr (std::is_convertible_v<P, std::span<float>>) {
      const std::span<float> s = p;
      return Tensor{reinterpret_cast<std::byte*>(s.data()), s.size(), DType::float32};
    } else {
      return Tensor(p);
    }
  }

  template <class L>
  static L& self(void* p) {
    return *static_cast<L*>(p);
  }

  /// The layer's prepare(mb), or null when it has none (Stage::prepares).
  template <class L>
  static constexpr void (*prepare_of())(void*, const Microbatch&) {
    if constexpr (detail::has_prepare<L>)
      return [](void* p, const Microbatch& mb) { self<L>(p).prepare(mb); };
    else
      return nullptr;
  }

  template <class L>
  static constexpr VTable table = {
      [](void* p, MicrobatchShape s) { return Boundary(self<L>(p).input_boundary(s)); },
      [](void* p, MicrobatchShape s) { return Boundary(self<L>(p).output_boundary(s)); },
      [](void* p, MicrobatchShape s) { return static_cast<std::size_t>(self<L>(p).saved_bytes(s)); },
      [](void* p, MicrobatchShape s) { return static_cast<std::size_t>(self<L>(p).stash_bytes(s)); },
      [](void* p, Ctx& c, const Microbatch& mb, ConstTensor x, Tensor y, std::byte* saved) {
        self<L>(p).forward(c, mb, x, y, saved);
      },
      [](void* p, Ctx& c, const Microbatch& mb, ConstTensor dy, Tensor dx, std::byte* saved, std::byte* stash) {
        self<L>(p).backward_input(c, mb, dy, dx, saved, stash);
      },
      [](void* p, Ctx& c, const Microbatch& mb, std::byte* saved, std::byte* stash) {
        self<L>(p).backward_weight(c, mb, saved, stash);
      },
      [](void* p) { return working_of(self<L>(p).parameters()); },
      [](void* p) { return std::span<float>(self<L>(p).gradients()); },
      [](void* p, MicrobatchShape s) {
        if constexpr (detail::has_saved_parts<L>)
          return std::vector<SavedPart>(self<L>(p).saved_parts(s));
        else
          return std::vector<SavedPart>{};
      },
      [](void* p, MicrobatchShape s) {
        if constexpr (detail::declares_inputs<L>)
          return std::vector<InputSpec>(self<L>(p).inputs(s));
        else
          return std::vector<InputSpec>{};
      },
      [](void* p) {
        if constexpr (detail::has_norm_groups<L>)
          return std::vector<std::size_t>(self<L>(p).norm_groups());
        else
          return std::vector<std::size_t>{working_of(self<L>(p).parameters()).elements};
      },
      [](void* p) {
        if constexpr (detail::has_parameter_info<L>) {
          return std::vector<ParamInfo>(self<L>(p).parameter_info());
        } else {
          const auto n = static_cast<long long>(working_of(self<L>(p).parameters()).elements);
          return std::vector<ParamInfo>{ParamInfo{"parameters", 0, {n}}};
        }
      },
      [](void* p) {
        if constexpr (detail::has_shared_parameters<L>)
          return std::vector<SharedParam>(self<L>(p).shared_parameters());
        else
          return std::vector<SharedParam>{};
      },
      [](void* p) {
        if constexpr (detail::has_name<L>)
          return std::string(self<L>(p).name());
        else
          return detail::type_name<L>();
      },
      [](void* p) {
        if constexpr (detail::has_capturable<L>)
          return static_cast<bool>(self<L>(p).capturable());
        else
          return false;
      },
      prepare_of<L>(),
  };

  void* obj_;
  const VTable* vt_;
};

}  // namespace pipeoffload
