// models/gpt/cuda.hpp: gpt::CudaGptStage, the reference GPT's pipeline stage on one GPU (bf16
// working parameters and activations, fp32 gradients; cuBLASLt GEMMs, cuDNN attention), stage
// for stage the same model as gpt::GptStage. Its precision, memory and contract: docs/gpt.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <pipeoffload/backend/cuda/attention.hpp>
#include <pipeoffload/backend/cuda/check.hpp>
#include <pipeoffload/backend/cuda/cuda.hpp>
#include <pipeoffload/backend/cuda/device_memory.hpp>
#include <pipeoffload/backend/cuda/gemm.hpp>
#include <pipeoffload/backend/cuda/kernels.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>
#include <pipeoffload/error.hpp>
#include <pipeoffload/layer.hpp>

#include <pipeoffload/ops/cuda.hpp>
#include <pipeoffload/packing.hpp>
#include "cpu.hpp"  // the initial parameters
#include "cuda_layout.hpp"
#include "layout.hpp"

namespace pipeoffload::gpt {

/// How a gpt::CudaGptStage's boundary tensors (input_boundary, output_boundary) travel.
enum class Boundaries : std::uint8_t {
  /// fp32, gpt::GptStage's: a pipeline may mix CPU and GPU stages, and tests compare a GPU
  /// stage's y and dx with the CPU stage's directly.
  f32,
  /// bf16, the stage's own activations and gradients as they are: half the bytes over NCCL and
  /// the same results, since an fp32 boundary only widens bf16 values, which the next stage
  /// rounds back to the same bf16 exactly. Every stage of the pipeline must use it (the runtime
  /// checks that producer and consumer agree). train_gpt's CUDA launchers use it.
  bf16,
};

/// Stage `stage` of `stages` of the reference GPT (gpt::GptConfig) on a GPU; see the file
/// comment. Models po::layer_for<gpt::CudaGptStage, backend::CudaContext>.
class CudaGptStage {
 public:
  using bf16 = __nv_bfloat16;

  /// Starts from gpt::GptStage(cfg, stage, stages)'s initial parameters (built on the CPU,
  /// so a GPU run starts from exactly a CPU run's parameters); microbatches of at most
  /// max_shape.tokens() tokens and max_shape.seq <= cfg.seq.
  CudaGptStage(backend::Cuda& dev, const gpt::GptConfig& cfg, int stage, int stages, MicrobatchShape max_shape,
               Boundaries boundaries = Boundaries::f32)
      : CudaGptStage(dev, cfg, stage, stages, max_shape, gpt::GptStage(cfg, stage, stages).parameters(), boundaries) {}

  /// Starts from `initial`: the parameters() of a gpt::GptStage(cfg, stage, stages), e.g. a
  /// CPU run's current ones (same layout, copied as they are).
  CudaGptStage(backend::Cuda& dev, const gpt::GptConfig& cfg, int stage, int stages, MicrobatchShape max_shape,
               std::span<const float> initial, Boundaries boundaries = Boundaries::f32)
      : cfg_(cfg), max_(max_shape), device_(dev.device()), boundaries_(boundaries), dev_(&dev) {
    dims_ = gpt::gpt_dims(cfg, stage, stages);
    params_ = gpt::gpt_stage_params(dims_);
    if (max_shape.batch < 1 || max_shape.seq < 1 || max_shape.seq > cfg.seq)
      throw shape_error("gpt::CudaGptStage: microbatch shape batch = " + std::to_string(max_shape.batch) +
                        ", seq = " + std::to_string(max_shape.seq) +
                        " (need batch >= 1 and 1 <= seq <= the position table's " + std::to_string(cfg.seq) + ")");
    if (cfg.tie_embeddings)
      throw error(
          "gpt::CudaGptStage: GptConfig::tie_embeddings is not implemented on the CUDA GPT yet (its head GEMMs take the "
          "weight (h, V)); tie the embeddings on the CPU GPT (gpt::GptStage)");
    if (dims_.blocks > 0)
      (void)cuda::sdpa_layout(max_shape.batch, cfg.heads, max_shape.seq,
                              cfg.hidden / cfg.heads);  // cuDNN's head_dim limits
    if (static_cast<long long>(initial.size()) != params_.total)
      throw error("gpt::CudaGptStage: stage " + std::to_string(stage) + " of " + std::to_string(stages) + " has " +
                  std::to_string(params_.total) + " parameters; the initial values have " +
                  std::to_string(initial.size()));
    const std::size_t n = static_cast<std::size_t>(params_.total);
    work_ = cuda::DeviceMemory(device_, n * sizeof(bf16));
    grads_ = cuda::DeviceMemory(device_, n * sizeof(float));
    if (dims_.has_head) head_bias_ = cuda::DeviceMemory(device_, static_cast<std::size_t>(dims_.vocab) * sizeof(float));
    scratch_ = cuda::DeviceMemory(device_, gpt_workspace(dims_, max_.tokens()).bytes);
    {
      std::vector<std::uint16_t> bits(n);  // rounded to nearest even, as the optimizer rounds
      for (std::size_t i = 0; i < n; ++i) bits[i] = bf16_bits(initial[i]);
      PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(work(), bits.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
    }
    PIPEOFFLOAD_CUDA_CHECK(cudaMemset(grad(), 0, n * sizeof(float)));
    refresh_head_bias(nullptr);
    // The passes run on non-blocking streams, which do not wait for the legacy stream above.
    PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
    // cuDNN builds (and compiles, and loads) the SDPA graphs of the microbatch shape now, not
    // in the first step while another rank's NCCL kernel may run (issue 15's hang class), and
    // their workspace is checked against the device's. seq = 1 has no backward graph
    // (attention.hpp): prepare() refuses it in training.
    if (dims_.blocks > 0 && max_shape.seq >= 2) {
      // Packed, the graphs of one document a row too: the fewest documents a call can hold.
      // cuDNN's deterministic backward needs more workspace the more documents (docs/packing.md),
      // so prepare() builds and checks each bucket's (cuda::document_slots) before its passes.
      cuda::attention::Shape s = attention_shape(max_shape);
      require_attention(s, "gpt::CudaGptStage");
      s.documents = cuda::document_slots(s.batch, max_shape.tokens());
      if (dims_.packed) require_attention(s, "gpt::CudaGptStage");
    }
  }

  // ---- po::layer_for<CudaGptStage, backend::CudaContext> -------------------------------------------

  /// (tokens, hidden) both ways, fp32 (gpt::GptStage's) or bf16 (see Boundaries).
  Boundary input_boundary(MicrobatchShape sh) const { return boundary(sh); }
  Boundary output_boundary(MicrobatchShape sh) const { return boundary(sh); }
  /// gpt::GptStage's step inputs: int32 "tokens" on stage 0, "targets" on the last stage.
  std::vector<InputSpec> inputs(MicrobatchShape sh) const { return gpt::gpt_inputs(dims_, sh); }
  std::size_t saved_bytes(MicrobatchShape sh) const { return gpt_stage_buffers(dims_, sh.tokens()).saved_bytes; }
  std::size_t stash_bytes(MicrobatchShape sh) const { return gpt_stage_buffers(dims_, sh.tokens()).stash_bytes; }
  /// The saved buffer in backward_input's reading order: the head's slice, then the blocks'
  /// last to first (each awaited on the pass's stream just before its kernels read it).
  std::vector<SavedPart> saved_parts(MicrobatchShape sh) const { return gpt_cuda_saved_parts(dims_, sh.tokens()); }
  /// The bf16 working parameters (a po::Tensor of bfloat16 values) and the fp32 gradients,
  /// device memory, gpt::GptStage's layout. The optimizer holds the fp32 master copy.
  Tensor parameters() {
    return {reinterpret_cast<std::byte*>(work()), static_cast<std::size_t>(params_.total), DType::bfloat16};
  }
  std::span<float> gradients() { return {grad(), static_cast<std::size_t>(params_.total)}; }
  std::vector<std::size_t> norm_groups() const { return gpt::gpt_norm_groups(dims_); }
  /// Device bytes of the stage's parameters and gradients: the bf16 parameters, the fp32
  /// gradients and the head's fp32 bias copy (gpt_state_bytes).
  std::size_t state_bytes() const { return gpt_state_bytes(dims_); }
  /// Device bytes of the stage's scratch (gpt_workspace for its largest microbatch).
  std::size_t scratch_bytes() const { return gpt_workspace(dims_, max_.tokens()).bytes; }
  /// gpt::GptStage::parameter_info(): the same names, offsets and shapes.
  std::vector<ParamInfo> parameter_info() const { return gpt::gpt_parameter_info(dims_); }
  /// The stage type's name in the runtime's messages.
  std::string name() const { return "gpt::CudaGptStage"; }
  /// Its calls may be captured and replayed (RuntimeOptions::graphs): its dropout reads the step
  /// from mb.device_step. Packed rows through blocks are not: their attention's graph follows the
  /// document count read on the host.
  bool capturable() const { return !(dims_.packed && dims_.blocks > 0); }

  /// Before a call's passes (layer.hpp): cuDNN's graphs for the microbatch's shape built and
  /// their workspace checked now rather than in a pass (a shape built before is a lookup; an
  /// evaluation call's forward graph alone); packed, for its document count and length, its
  /// rows checked and counted on the host. A training microbatch of seq 1, which cuDNN's
  /// backward refuses, is refused here, before any pass. The embedding's stage without blocks
  /// checks its packed rows here too: its passes may be a replayed graph's, which checks nothing.
  void prepare(const Microbatch& mb) {
    if (dims_.blocks == 0) {
      if (dims_.packed && dims_.embeds) (void)packed_rows(mb, who("prepare"), docs_);
      return;
    }
    if (mb.shape.seq < 2 && mb.training) throw shape_error(who("prepare") + ": " + cuda::attention::seq_one_refused);
    cuda::attention::Shape s = attention_shape(mb.shape);
    if (dims_.packed) {
      (void)packed_rows(mb, who("prepare"), docs_);
      s.documents = cuda::document_slots(static_cast<long long>(docs_.size()), mb.shape.tokens());
      s.length = cuda::packed_length(longest_document(docs_), mb.shape.seq);
    }
    require_attention(s, who("prepare"), mb.training);
  }

  void forward(backend::CudaContext& ctx, const Microbatch& mb, ConstTensor xt, Tensor yt, std::byte* saved) {
    Pass p = begin("forward", ctx, mb, saved, nullptr, false);
    const std::byte* x = boundary_data(xt, !dims_.embeds, "forward", "x", "only stage 0 reads tokens instead", p.T);
    std::byte* y = boundary_data(yt, !dims_.has_head, "forward", "y", "only the last stage has no output", p.T);
    const std::int32_t* tokens = dims_.embeds ? step_input(mb, "tokens", "forward", p.T) : nullptr;
    const std::int32_t* targets = dims_.has_head ? step_input(mb, "targets", "forward", p.T) : nullptr;
    if (dims_.has_head && mb.loss == nullptr) throw error(who("forward") + ": mb.loss is null on the last stage");
    if (mb.mb == 0) refresh_head_bias(p.s);
    const long long T = p.T;
    // The stage's input goes where the first consumer keeps it: block 0's saved x, the head's
    // saved x, or (no blocks, no head) the scratch output that becomes y.
    bf16* in = dims_.blocks > 0 ? saved_block(saved, p, 0).x
               : dims_.has_head ? head_x(saved, p)
                                : scratch<bf16>(p.ws.io);
    if (dims_.embeds) {
      ops::embedding_forward(ctx, tokens, work(), in, T, h(), V());
      if (dims_.packed)  // learned positions restart at every document
        ops::position_embedding_forward(ctx, work() + params_.wpe, positions(ctx, mb, "forward", p), in, T, h(),
                                        static_cast<int>(dims_.positions));
      else
        ops::position_embedding_forward(ctx, work() + params_.wpe, in, T, h(), mb.shape.seq);
    } else
      from_boundary(x, in, p);
    if (dims_.blocks > 0) documents(ctx, mb, "forward", p);
    for (int i = 0; i < dims_.blocks; ++i) {
      bf16* out = i + 1 < dims_.blocks ? saved_block(saved, p, i + 1).x
                  : dims_.has_head     ? head_x(saved, p)
                                       : scratch<bf16>(p.ws.io);
      block_forward(ctx, mb, p, i, saved, out);
    }
    if (dims_.has_head)
      head_forward(ctx, mb, p, saved, targets);
    else
      to_boundary(scratch<bf16>(p.ws.io), y, p);
  }

  void backward_input(backend::CudaContext& ctx, const Microbatch& mb, ConstTensor dyt, Tensor dxt, std::byte* saved,
                      std::byte* stash) {
    Pass p = begin("backward_input", ctx, mb, saved, stash, true);
    if (dims_.blocks > 0) documents(ctx, mb, "backward_input", p);
    const std::byte* dy =
        boundary_data(dyt, !dims_.has_head, "backward_input", "dy", "only the last stage starts from its loss", p.T);
    std::byte* dx =
        boundary_data(dxt, !dims_.embeds, "backward_input", "dx", "only stage 0 has no input gradient", p.T);
    // (T, h) bf16 gradient flowing down through the blocks. Stage 0 keeps the last one in the
    // stash, where W's embedding gradient reads it.
    bf16* g = dims_.embeds ? at<bf16>(stash, p.buf.stash_embed) : scratch<bf16>(p.ws.io);
    int part = 0;  // the next of saved_parts() to await
    if (dims_.has_head) {
      mb.await_saved(part++);
      head_backward_input(ctx, p, saved, stash, g);
    } else {
      from_boundary(dy, g, p);
    }
    const int per = blocks_per_saved_part(dims_.blocks, dims_.has_head);
    for (int i = dims_.blocks - 1; i >= 0; --i) {
      if ((dims_.blocks - 1 - i) % per == 0) mb.await_saved(part++);  // a part's last block comes first
      block_backward_input(ctx, mb, p, i, saved, stash, g);
    }
    if (!dims_.embeds) to_boundary(g, dx, p);
  }

  void backward_weight(backend::CudaContext& ctx, const Microbatch& mb, std::byte* saved, std::byte* stash) {
    const Pass p = begin("backward_weight", ctx, mb, saved, stash, true);
    if (dims_.embeds) {
      const std::int32_t* tokens = step_input(mb, "tokens", "backward_weight", p.T);
      ops::embedding_backward(ctx, tokens, at<bf16>(stash, p.buf.stash_embed), grad(), p.T, h(), V());
      if (dims_.packed)  // the positions as the ids
        ops::embedding_backward(ctx, positions(ctx, mb, "backward_weight", p), at<bf16>(stash, p.buf.stash_embed),
                                grad() + params_.wpe, p.T, h(), static_cast<int>(dims_.positions));
      else
        ops::position_embedding_backward(ctx, at<bf16>(stash, p.buf.stash_embed), grad() + params_.wpe, p.T, h(),
                                         mb.shape.seq);
    }
    for (int i = 0; i < dims_.blocks; ++i) block_backward_weight(ctx, p, i, saved, stash);
    if (dims_.has_head) head_backward_weight(ctx, p, saved, stash);
  }

  // ---- what the tests and benchmarks look at ----------------------------------------------------

  const gpt::GptDims& dims() const { return dims_; }
  const gpt::GptStageParams& parameter_layout() const { return params_; }
  MicrobatchShape max_shape() const { return max_; }

 private:
  // ---- sizes and pointers -------------------------------------------------------------------

  int h() const { return static_cast<int>(dims_.hidden); }
  int V() const { return static_cast<int>(dims_.vocab); }
  bf16* work() const { return work_.as<bf16>(); }
  float* grad() const { return grads_.as<float>(); }
  /// Element `off` of block i's group in the bf16 parameters or the fp32 gradients.
  const bf16* weight(int i, long long off) const { return work() + params_.block_begin(i) + off; }
  float* grad(int i, long long off) const { return grad() + params_.block_begin(i) + off; }
  const bf16* head_weight(long long off) const { return work() + params_.head_begin + off; }
  float* head_grad(long long off) const { return grad() + params_.head_begin + off; }

  template <class T>
  static T* at(std::byte* base, Region r) {
    return r.bytes == 0 ? nullptr : reinterpret_cast<T*>(base + r.offset);
  }
  template <class T>
  T* scratch(Region r) const {
    return at<T>(scratch_.as<std::byte>(), r);
  }

  /// The attention shape of an unpacked microbatch of shape `sh` (as many key/value heads as heads).
  cuda::attention::Shape attention_shape(MicrobatchShape sh) const {
    return {sh.batch, static_cast<int>(dims_.heads), sh.seq, static_cast<int>(dims_.hidden / dims_.heads)};
  }
  /// The attention graphs of `s` (the fused qkv layout) built and their workspace checked.
  void require_attention(const cuda::attention::Shape& s, const std::string& by, bool backward = true) const {
    cuda::attention::require_workspace(dev_->attention_graphs(), s, false, dev_->options().workspace_bytes, by,
                                       backward);
  }
  std::string who(const char* pass) const {
    return std::string("gpt::CudaGptStage (blocks ") + std::to_string(dims_.first_block) + ".." +
           std::to_string(dims_.first_block + dims_.blocks) + ")::" + pass;
  }

  DType boundary_dtype() const { return boundaries_ == Boundaries::bf16 ? DType::bfloat16 : DType::float32; }
  Boundary boundary(MicrobatchShape sh) const {
    return {static_cast<std::size_t>(sh.tokens() * dims_.hidden), boundary_dtype()};
  }

  /// A boundary view's data, checked on the host: present exactly when the stage uses it
  /// (`used`; `why_absent` says when it is not), of the stage's boundary type and of the
  /// microbatch's (T, h) size.
  template <class View>
  auto boundary_data(View t, bool used, const char* pass, const char* name, const char* why_absent, long long T) const
      -> decltype(t.data) {
    if (!used) return t.data;  // the runtime passes an empty view; nothing reads it
    if (!t) throw error(who(pass) + ": " + name + " is empty; " + why_absent);
    const std::size_t want = static_cast<std::size_t>(T * dims_.hidden);
    if (t.elements != want)
      throw shape_error(who(pass) + ": " + name + " holds " + std::to_string(t.elements) + " values; a microbatch of " +
                        std::to_string(T) + " tokens needs tokens * hidden = " + std::to_string(want));
    if (t.dtype != boundary_dtype())
      throw error(who(pass) + ": " + name + " holds " + dtype_name(t.dtype) + " values; this stage's boundaries are " +
                  dtype_name(boundary_dtype()) + " (its Boundaries option)");
    return t.data;
  }
  /// The step input `name` of this microbatch (device memory, the runtime's copy), checked on
  /// the host: declared in inputs(), int32, one value per token; the kernels read it.
  const std::int32_t* step_input(const Microbatch& mb, const char* name, const char* pass, long long T) const {
    const ConstTensor t = mb.input(name);  // throws naming the inputs there are
    if (!t || t.elements != static_cast<std::size_t>(T))
      throw shape_error(who(pass) + ": the step input '" + name + "' holds " + std::to_string(t ? t.elements : 0) +
                        " values; a microbatch of " + std::to_string(T) + " tokens needs " + std::to_string(T));
    return t.as<std::int32_t>();  // throws unless int32
  }

  /// What every pass needs about its microbatch, checked once on the host.
  struct Pass {
    cudaStream_t s = nullptr;
    long long T = 0;
    GptStageBuffers buf{};
    GptWorkspace ws{};
    cuda::attention::Shape att{};       ///< att.documents: packed rows' document count (0: unpacked)
    cuda::attention::Documents docs{};  ///< where they are (packed)
  };
  Pass begin(const char* pass, const backend::CudaContext& ctx, const Microbatch& mb, const std::byte* saved,
             const std::byte* stash, bool needs_stash) const {
    const MicrobatchShape sh = mb.shape;
    if (sh.batch < 1 || sh.seq < 1 || sh.seq > cfg_.seq || sh.tokens() > max_.tokens())
      throw shape_error(who(pass) + ": microbatch shape batch = " + std::to_string(sh.batch) + ", seq = " +
                        std::to_string(sh.seq) + " (need batch, seq >= 1, seq <= " + std::to_string(cfg_.seq) +
                        ", batch * seq <= the constructor's " + std::to_string(max_.tokens()) + ")");
    Pass p;
    p.s = ctx.cuda_stream;
    p.T = sh.tokens();
    p.buf = gpt_stage_buffers(dims_, p.T);
    // (A stage without blocks, embedding or head keeps nothing: its buffers may be null.)
    const auto aligned = [](const std::byte* q) {
      return q != nullptr && reinterpret_cast<std::uintptr_t>(q) % region_alignment == 0;
    };
    const std::string align = " must be a device buffer aligned to " + std::to_string(region_alignment) +
                              " bytes (backend::Cuda's blocks are)";
    if (p.buf.saved_bytes > 0 && !aligned(saved)) throw error(who(pass) + ": saved" + align);
    if (needs_stash && p.buf.stash_bytes > 0 && !aligned(stash)) throw error(who(pass) + ": stash" + align);
    p.ws = gpt_workspace(dims_, p.T);
    p.att = attention_shape(sh);
    return p;
  }

  /// Every token's position in its document (ws.positions), computed on the device.
  const std::int32_t* positions(const backend::CudaContext& ctx, const Microbatch& mb, const char* pass,
                                const Pass& p) {
    std::int32_t* out = scratch<std::int32_t>(p.ws.positions);
    ops::document_positions(ctx, packed_rows(mb, who(pass), docs_), out, p.T, mb.shape.seq);
    return out;
  }
  /// Packed rows' documents for the blocks' attention: checked and counted on the host
  /// (Microbatch::host_input), their table (ws.documents) written on the device, offsets in
  /// units of the fused [q | k | v] row and of the output's.
  void documents(const backend::CudaContext& ctx, const Microbatch& mb, const char* pass, Pass& p) {
    if (!dims_.packed) return;
    const std::int32_t* dev = packed_rows(mb, who(pass), docs_);
    const int count = static_cast<int>(docs_.size());
    const long long H = dims_.hidden;
    const ops::DeviceDocuments d =
        ops::document_table(ctx, dev, mb.shape.batch, mb.shape.seq, count, longest_document(docs_),
                            {mb.shape.batch, mb.shape.seq, p.att.heads, 0, p.att.head_dim}, {3 * H, 3 * H, 3 * H, H},
                            scratch<std::byte>(p.ws.documents));
    p.att.documents = d.count;
    p.att.length = d.length;
    p.docs = d.table;
  }
  /// A (T, h) boundary into the stage's bf16, and back: a conversion (fp32) or a copy (bf16).
  void from_boundary(const std::byte* b, bf16* out, const Pass& p) const {
    if (boundaries_ == Boundaries::bf16)
      PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(out, b, static_cast<std::size_t>(p.T * dims_.hidden) * sizeof(bf16),
                                             cudaMemcpyDeviceToDevice, p.s));
    else
      cuda::kernels::to_bf16(reinterpret_cast<const float*>(b), out, p.T * h(), p.s);
  }
  void to_boundary(const bf16* in, std::byte* b, const Pass& p) const {
    if (boundaries_ == Boundaries::bf16)
      PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(b, in, static_cast<std::size_t>(p.T * dims_.hidden) * sizeof(bf16),
                                             cudaMemcpyDeviceToDevice, p.s));
    else
      cuda::kernels::to_float(in, reinterpret_cast<float*>(b), p.T * h(), p.s);
  }

  /// One block's saved tensors (null where recompute leaves a region out).
  struct Saved {
    bf16 *x, *qkv, *att, *x1, *f, *a1, *a2, *g;
    float *stats, *lse;  // stats: LN1 (mean, rstd) rows, then LN2's at + 2T
    std::uint8_t *m1, *m2;
  };
  static Saved saved_block(std::byte* saved, const Pass& p, int i) {
    std::byte* b = saved + p.buf.block_saved(i);
    const GptBlockSaved& L = p.buf.block;
    return {at<bf16>(b, L.x),      at<bf16>(b, L.qkv),  at<bf16>(b, L.att),        at<bf16>(b, L.x1),
            at<bf16>(b, L.f),      at<bf16>(b, L.a1),   at<bf16>(b, L.a2),         at<bf16>(b, L.g),
            at<float>(b, L.stats), at<float>(b, L.lse), at<std::uint8_t>(b, L.m1), at<std::uint8_t>(b, L.m2)};
  }
  static bf16* head_x(std::byte* saved, const Pass& p) { return at<bf16>(saved + p.buf.head_saved, p.buf.head.x); }

  /// One block's stash: the gradients of its GEMM and LayerNorm outputs.
  struct Stash {
    bf16 *dP2, *dF, *dA2, *dO1, *dQKV, *dA1;
  };
  static Stash stash_block(std::byte* stash, const Pass& p, int i) {
    std::byte* b = stash + p.buf.block_stashed(i);
    const GptBlockStash& L = p.buf.block_stash;
    return {at<bf16>(b, L.dP2), at<bf16>(b, L.dF),   at<bf16>(b, L.dA2),
            at<bf16>(b, L.dO1), at<bf16>(b, L.dQKV), at<bf16>(b, L.dA1)};
  }

  /// A dropout site's seed; the kernels read the step from mb.device_step when the runtime
  /// gives it (a captured step replays with later steps).
  ops::DropoutSeed drop_seed(const Microbatch& mb, int block, int site) const {
    return {cfg_.seed, mb.step, mb.device_step, dims_.first_block + block, site, mb.mb};
  }
  /// Dropout's probability in a forward: none when evaluating (gpt::GptStage::dropout). B
  /// runs only in training, so it uses cfg_.dropout, as the CPU stage does.
  float dropout(const Microbatch& mb) const { return mb.training ? cfg_.dropout : 0.0f; }

  /// The LM head's bias widened to fp32 for the logits GEMM's epilogue (the last stage only).
  void refresh_head_bias(cudaStream_t s) {
    if (dims_.has_head) cuda::kernels::to_float(head_weight(params_.head_b), head_bias_.as<float>(), V(), s);
  }

  // ---- one block -----------------------------------------------------------------------------
  // Y = X W + b as models/gpt/cpu.hpp's linear. The bias is cuBLASLt's epilogue: the bf16
  // bias added in fp32 to the accumulator before Y's one rounding to bf16 (the GPU stage is
  // held to the CPU within bf16 tolerance, never bit for bit). Where cuBLASLt offers no such
  // algorithm, the bias is added after the GEMM's rounding instead (kernels::add_bias).

  void linear(const backend::CudaContext& ctx, const Pass& p, const bf16* X, const bf16* W, const bf16* b, bf16* Y,
              long long k, long long n) const {
    if (!cuda::gemm_bias(ctx, cuda::linear_forward(p.T, k, n), X, W, Y, cuda::Out::bf16, b))
      ops::add_bias(ctx, Y, b, p.T, static_cast<int>(n));
  }
  /// dW (k, n) += X^T dY ; db (n) += column sums of dY.
  void linear_weight_grad(const backend::CudaContext& ctx, const Pass& p, const bf16* X, const bf16* dY, float* dW,
                          float* db, long long k, long long n) const {
    cuda::gemm(ctx, cuda::linear_wgrad(p.T, k, n), X, dY, dW, cuda::Out::f32);
    ops::bias_grad(ctx, dY, db, p.T, static_cast<int>(n));
  }

  void block_forward(const backend::CudaContext& ctx, const Microbatch& mb, const Pass& p, int i, std::byte* saved,
                     bf16* out) {
    const Saved v = saved_block(saved, p, i);
    const gpt::GptBlockParams& o = params_.block;
    const long long T = p.T, H = dims_.hidden;
    const float drop = dropout(mb);
    bf16* proj = scratch<bf16>(p.ws.proj);  // (T, h) projection output before its residual
    bf16* a1 = cfg_.recompute ? scratch<bf16>(p.ws.ln) : v.a1;
    ops::layernorm_forward(ctx, v.x, weight(i, o.ln1g), weight(i, o.ln1b), a1, v.stats, T, h());
    linear(ctx, p, a1, weight(i, o.wqkv), weight(i, o.bqkv), v.qkv, H, 3 * H);
    cuda::attention::forward(*ctx.attention, p.s, p.att, v.qkv, v.att, v.lse, ctx.workspace, ctx.workspace_bytes,
                             p.docs);
    linear(ctx, p, v.att, weight(i, o.wo), weight(i, o.bo), proj, H, H);
    if (cfg_.recompute)
      ops::residual_dropout(ctx, v.x, proj, v.x1, T * H, drop_seed(mb, i, 0), drop);
    else
      ops::residual_dropout_mask(ctx, v.x, proj, v.x1, v.m1, T * H, drop_seed(mb, i, 0), drop);
    bf16* a2 = cfg_.recompute ? scratch<bf16>(p.ws.ln) : v.a2;
    ops::layernorm_forward(ctx, v.x1, weight(i, o.ln2g), weight(i, o.ln2b), a2, v.stats + 2 * T, T, h());
    linear(ctx, p, a2, weight(i, o.wfc), weight(i, o.bfc), v.f, H, 4 * H);
    bf16* g = cfg_.recompute ? scratch<bf16>(p.ws.gelu) : v.g;
    ops::gelu_forward(ctx, v.f, g, 4 * T * H);
    linear(ctx, p, g, weight(i, o.wpr), weight(i, o.bpr), proj, 4 * H, H);
    if (cfg_.recompute)
      ops::residual_dropout(ctx, v.x1, proj, out, T * H, drop_seed(mb, i, 1), drop);
    else
      ops::residual_dropout_mask(ctx, v.x1, proj, out, v.m2, T * H, drop_seed(mb, i, 1), drop);
  }

  /// g (T, h): dL/d(block output) in, dL/d(block input) out, in place. models/gpt/cpu.hpp's
  /// block_backward_input, with LayerNorm backward accumulating into the residual gradient.
  void block_backward_input(const backend::CudaContext& ctx, const Microbatch& mb, const Pass& p, int i,
                            std::byte* saved, std::byte* stash, bf16* g) {
    const Saved v = saved_block(saved, p, i);
    const Stash st = stash_block(stash, p, i);
    const gpt::GptBlockParams& o = params_.block;
    const long long T = p.T, H = dims_.hidden;
    const float drop = cfg_.dropout;
    // MLP: dP2 = dropout'(g); dG = dP2 Wpr^T; dF = dG * GeLU'(f); dA2 = dF Wfc^T.
    if (cfg_.recompute)
      ops::dropout_backward(ctx, g, st.dP2, T * H, drop_seed(mb, i, 1), drop);
    else
      ops::dropout_backward_mask(ctx, g, v.m2, st.dP2, T * H, drop);
    cuda::gemm(ctx, cuda::linear_dgrad(T, 4 * H, H), st.dP2, weight(i, o.wpr), st.dF, cuda::Out::bf16);
    ops::gelu_backward(ctx, v.f, st.dF, 4 * T * H);
    cuda::gemm(ctx, cuda::linear_dgrad(T, H, 4 * H), st.dF, weight(i, o.wfc), st.dA2, cuda::Out::bf16);
    // g becomes dL/dx1 = g + LN2's input gradient.
    ops::layernorm_backward(ctx, st.dA2, v.x1, v.stats + 2 * T, weight(i, o.ln2g), g, T, h(), true);
    // Attention: dO1 = dropout'(dL/dx1); datt = dO1 Wo^T; dqkv by cuDNN; dA1 = dqkv Wqkv^T.
    if (cfg_.recompute)
      ops::dropout_backward(ctx, g, st.dO1, T * H, drop_seed(mb, i, 0), drop);
    else
      ops::dropout_backward_mask(ctx, g, v.m1, st.dO1, T * H, drop);
    bf16* datt = scratch<bf16>(p.ws.proj);
    cuda::gemm(ctx, cuda::linear_dgrad(T, H, H), st.dO1, weight(i, o.wo), datt, cuda::Out::bf16);
    cuda::attention::backward(*ctx.attention, p.s, p.att, v.qkv, v.att, datt, v.lse, st.dQKV, ctx.workspace,
                              ctx.workspace_bytes, p.docs);
    cuda::gemm(ctx, cuda::linear_dgrad(T, H, 3 * H), st.dQKV, weight(i, o.wqkv), st.dA1, cuda::Out::bf16);
    // g becomes dL/dx = dL/dx1 + LN1's input gradient.
    ops::layernorm_backward(ctx, st.dA1, v.x, v.stats, weight(i, o.ln1g), g, T, h(), true);
  }

  /// models/gpt/cpu.hpp's block_backward_weight: the recomputed (or saved) GEMM inputs against the
  /// stashed output gradients.
  void block_backward_weight(const backend::CudaContext& ctx, const Pass& p, int i, std::byte* saved,
                             std::byte* stash) {
    const Saved v = saved_block(saved, p, i);
    const Stash st = stash_block(stash, p, i);
    const gpt::GptBlockParams& o = params_.block;
    const long long T = p.T, H = dims_.hidden;
    linear_weight_grad(ctx, p, v.att, st.dO1, grad(i, o.wo), grad(i, o.bo), H, H);
    bf16* g = v.g;
    if (cfg_.recompute) {
      g = scratch<bf16>(p.ws.gelu);
      ops::gelu_forward(ctx, v.f, g, 4 * T * H);
    }
    linear_weight_grad(ctx, p, g, st.dP2, grad(i, o.wpr), grad(i, o.bpr), 4 * H, H);
    bf16* a2 = v.a2;
    if (cfg_.recompute) {
      a2 = scratch<bf16>(p.ws.ln);
      ops::layernorm_recompute(ctx, v.x1, v.stats + 2 * T, weight(i, o.ln2g), weight(i, o.ln2b), a2, T, h());
    }
    linear_weight_grad(ctx, p, a2, st.dF, grad(i, o.wfc), grad(i, o.bfc), H, 4 * H);
    ops::layernorm_weight_grad(ctx, st.dA2, v.x1, v.stats + 2 * T, grad(i, o.ln2g), grad(i, o.ln2b), T, h());
    bf16* a1 = v.a1;
    if (cfg_.recompute) {
      a1 = scratch<bf16>(p.ws.ln);
      ops::layernorm_recompute(ctx, v.x, v.stats, weight(i, o.ln1g), weight(i, o.ln1b), a1, T, h());
    }
    linear_weight_grad(ctx, p, a1, st.dQKV, grad(i, o.wqkv), grad(i, o.bqkv), H, 3 * H);
    ops::layernorm_weight_grad(ctx, st.dA1, v.x, v.stats, grad(i, o.ln1g), grad(i, o.ln1b), T, h());
  }

  // ---- head ----------------------------------------------------------------------------------

  void head_forward(const backend::CudaContext& ctx, const Microbatch& mb, const Pass& p, std::byte* saved,
                    const std::int32_t* targets) {
    std::byte* hp = saved + p.buf.head_saved;
    const bf16* x = at<bf16>(hp, p.buf.head.x);
    float* stats = at<float>(hp, p.buf.head.stats);
    bf16* a = scratch<bf16>(p.ws.ln);
    float* logits = scratch<float>(p.ws.logits);  // (rows, V) fp32, then the loss gradient in place
    float* losses = scratch<float>(p.ws.losses);
    bf16* dlogits = at<bf16>(hp, p.buf.head.dlogits);
    ops::layernorm_forward(ctx, x, head_weight(params_.lnfg), head_weight(params_.lnfb), a, stats, p.T, h());
    // A block of cuda::logits_rows rows at a time (the scratch holds one block): fp32 logits with
    // the bias (its fp32 copy) in cuBLASLt's epilogue (or after the GEMM where it has none), the
    // loss and its gradient in place (as models/gpt/cpu.hpp, scaled by loss_scale / T), saved in
    // bf16 for B and W.
    const long long block = cuda::logits_rows(p.T, V());
    for (long long r = 0; r < p.T; r += block) {
      const long long rows = std::min(block, p.T - r);
      if (!cuda::gemm_bias(ctx, cuda::linear_forward(rows, dims_.hidden, dims_.vocab), a + r * dims_.hidden,
                           head_weight(params_.head_w), logits, cuda::Out::f32, head_bias_.as<float>()))
        ops::add_bias(ctx, logits, head_bias_.as<float>(), rows, V());
      ops::cross_entropy(ctx, logits, targets + r, losses + r, logits, rows, V(),
                         mb.loss_scale / static_cast<float>(p.T));
      cuda::kernels::to_bf16(logits, dlogits + r * dims_.vocab, rows * dims_.vocab, p.s);
    }
    ops::mean(ctx, losses, mb.loss, p.T);
  }

  /// g (T, h) = dL/d(head input); the LayerNorm output's gradient goes to the stash for W.
  void head_backward_input(const backend::CudaContext& ctx, const Pass& p, std::byte* saved, std::byte* stash,
                           bf16* g) {
    std::byte* hp = saved + p.buf.head_saved;
    bf16* da = at<bf16>(stash, p.buf.stash_head);
    cuda::gemm(ctx, cuda::linear_dgrad(p.T, dims_.hidden, dims_.vocab), at<bf16>(hp, p.buf.head.dlogits),
               head_weight(params_.head_w), da, cuda::Out::bf16);
    ops::layernorm_backward(ctx, da, at<bf16>(hp, p.buf.head.x), at<float>(hp, p.buf.head.stats),
                            head_weight(params_.lnfg), g, p.T, h(), false);
  }

  void head_backward_weight(const backend::CudaContext& ctx, const Pass& p, std::byte* saved, std::byte* stash) {
    std::byte* hp = saved + p.buf.head_saved;
    const bf16* x = at<bf16>(hp, p.buf.head.x);
    const float* stats = at<float>(hp, p.buf.head.stats);
    bf16* a = scratch<bf16>(p.ws.ln);
    ops::layernorm_recompute(ctx, x, stats, head_weight(params_.lnfg), head_weight(params_.lnfb), a, p.T, h());
    linear_weight_grad(ctx, p, a, at<bf16>(hp, p.buf.head.dlogits), head_grad(params_.head_w),
                       head_grad(params_.head_b), dims_.hidden, dims_.vocab);
    ops::layernorm_weight_grad(ctx, at<bf16>(stash, p.buf.stash_head), x, stats, head_grad(params_.lnfg),
                               head_grad(params_.lnfb), p.T, h());
  }

  gpt::GptConfig cfg_;
  MicrobatchShape max_;
  int device_ = 0;
  Boundaries boundaries_ = Boundaries::f32;
  gpt::GptDims dims_{};
  gpt::GptStageParams params_{};
  cuda::DeviceMemory work_;       // (total) bf16 working parameters; the optimizer updates them
  cuda::DeviceMemory grads_;      // (total) fp32 gradients, accumulated by W, zeroed by Runtime::zero_grad
  cuda::DeviceMemory head_bias_;  // (vocab) fp32 copy of the head's bias (the last stage only)
  cuda::DeviceMemory scratch_;    // gpt_workspace(dims, max tokens) bytes
  std::vector<Document> docs_;    // a packed microbatch's documents, counted on the host
  backend::Cuda* dev_ = nullptr;  // its cuDNN graphs and workspace (prepare builds packed ones)
};

static_assert(layer_for<CudaGptStage, backend::CudaContext>,
              "gpt::CudaGptStage must model po::layer_for<CudaGptStage, backend::CudaContext>.");

}  // namespace pipeoffload::gpt
