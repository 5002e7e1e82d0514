// models/llama/cuda.hpp: llama::CudaLlamaStage, the Llama-class model's pipeline stage on one
// GPU (a po::layer_for<CudaLlamaStage, backend::CudaContext>), written on the library's CUDA ops
// (pipeoffload/ops/cuda.hpp) and GEMMs (backend/cuda/gemm.hpp), with no kernels of its own: the
// CPU stage's passes op for op on bf16 tensors. Its precisions, memory regions and what it
// refuses: docs/llama.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pipeoffload/backend/cuda/attention.hpp>
#include <pipeoffload/backend/cuda/check.hpp>
#include <pipeoffload/backend/cuda/cuda.hpp>
#include <pipeoffload/backend/cuda/device_memory.hpp>
#include <pipeoffload/backend/cuda/gemm.hpp>
#include <pipeoffload/backend/cuda/kernels.hpp>
#include <pipeoffload/error.hpp>
#include <pipeoffload/layer.hpp>
#include <pipeoffload/ops/cpu.hpp>  // RopeTable
#include <pipeoffload/ops/cuda.hpp>
#include <pipeoffload/packing.hpp>

#include "cpu.hpp"  // the initial parameters
#include "cuda_layout.hpp"
#include "layout.hpp"

namespace pipeoffload::llama {

/// Stage `stage` of S on one GPU (file comment). Models po::layer_for<CudaLlamaStage,
/// backend::CudaContext>.
class CudaLlamaStage {
 public:
  using bf16 = __nv_bfloat16;

  /// Starts from llama::LlamaStage(cfg, stage, stages)'s parameters, rounded to bf16, on the
  /// backend's device; sized for microbatches of up to max_shape.
  CudaLlamaStage(backend::Cuda& dev, const LlamaConfig& cfg, int stage, int stages, MicrobatchShape max_shape)
      : CudaLlamaStage(dev, cfg, stage, stages, max_shape, LlamaStage(cfg, stage, stages).parameters()) {}

  /// Starts from `initial`: the parameters() of a llama::LlamaStage(cfg, stage, stages);
  /// `boundaries` is the boundary tensors' type, DType::float32 or DType::bfloat16.
  CudaLlamaStage(backend::Cuda& dev, const LlamaConfig& cfg, int stage, int stages, MicrobatchShape max_shape,
                 std::span<const float> initial, DType boundaries = DType::float32)
      : c_(cfg), max_(max_shape), device_(dev.device()), boundaries_(boundaries), dev_(&dev) {
    if (boundaries != DType::float32 && boundaries != DType::bfloat16)
      throw error(std::string("llama::CudaLlamaStage: boundaries = ") + dtype_name(boundaries) +
                  "; a stage's boundaries are float32 or bfloat16");
    d_ = llama_dims(cfg, stage, stages);
    p_ = llama_stage_params(d_);
    if (max_shape.batch < 1 || max_shape.seq < 1 || max_shape.seq > cfg.seq)
      throw shape_error("llama::CudaLlamaStage: microbatch shape batch = " + std::to_string(max_shape.batch) +
                        ", seq = " + std::to_string(max_shape.seq) + " (need batch >= 1 and seq in [1, " +
                        std::to_string(cfg.seq) + "])");
    if (d_.blocks > 0)
      (void)cuda::sdpa_layout_separate(max_shape.batch, d_.heads, d_.kv_heads, max_shape.seq, d_.head_dim());
    const std::size_t n = static_cast<std::size_t>(p_.total);
    if (initial.size() != n)
      throw shape_error("llama::CudaLlamaStage: initial holds " + std::to_string(initial.size()) +
                        " parameters; stage " + std::to_string(stage) + " of " + std::to_string(stages) + " has " +
                        std::to_string(n));
    work_ = cuda::DeviceMemory(device_, n * sizeof(bf16));
    grads_ = cuda::DeviceMemory(device_, n * sizeof(float));
    scratch_ = cuda::DeviceMemory(device_, llama_cuda_workspace(d_, max_.tokens()).bytes);
    const ops::RopeTable table(cfg.seq, static_cast<int>(d_.head_dim()), cfg.rope_theta);
    rope_ = cuda::DeviceMemory(device_, 2 * table.cos.size() * sizeof(float));
    PIPEOFFLOAD_CUDA_CHECK(
        cudaMemcpy(rope_.as<float>(), table.cos.data(), table.cos.size() * sizeof(float), cudaMemcpyHostToDevice));
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(rope_.as<float>() + table.cos.size(), table.sin.data(),
                                      table.sin.size() * sizeof(float), cudaMemcpyHostToDevice));
    rope_view_ = {table.positions, table.head_dim, rope_.as<float>(), rope_.as<float>() + table.cos.size()};
    std::vector<std::uint16_t> bits(n);  // rounded to nearest even, as the optimizer rounds
    for (std::size_t i = 0; i < n; ++i) bits[i] = bf16_bits(initial[i]);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(work(), bits.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
    PIPEOFFLOAD_CUDA_CHECK(cudaMemset(grad(), 0, n * sizeof(float)));
    PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());  // the passes' streams do not wait for the legacy one
    // cuDNN builds the attention graphs of the largest microbatch now, not during a step, and
    // their workspace is checked against the device's (seq = 1 has no backward graph:
    // prepare() refuses it in training).
    if (d_.blocks > 0 && max_shape.seq >= 2) {
      // (The separate q, k, v tensors' graphs, the ones the passes run, whatever the heads.)
      // Packed, the graphs of one document a row too: the fewest documents a call can hold.
      // cuDNN's deterministic backward needs more workspace the more documents (docs/packing.md),
      // so prepare() builds and checks each bucket's (cuda::document_slots) before its passes.
      require_attention(attention_shape(max_shape), "llama::CudaLlamaStage");
      cuda::attention::Shape packed = attention_shape(max_shape);
      packed.documents = cuda::document_slots(packed.batch, max_shape.tokens());
      if (d_.packed) require_attention(packed, "llama::CudaLlamaStage");
    }
  }

  // ---- po::layer_for<CudaLlamaStage, backend::CudaContext> -----------------------------------

  Boundary input_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), boundaries_}; }
  Boundary output_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), boundaries_}; }
  std::vector<InputSpec> inputs(MicrobatchShape sh) const { return llama_inputs(d_, sh); }
  std::size_t saved_bytes(MicrobatchShape sh) const { return llama_cuda_buffers(d_, sh.tokens()).saved_bytes; }
  std::size_t stash_bytes(MicrobatchShape sh) const { return llama_cuda_buffers(d_, sh.tokens()).stash_bytes; }
  /// The saved buffer in backward_input's reading order: the head's slice, then the blocks'
  /// last to first (each awaited on the pass's stream just before its kernels read it).
  std::vector<SavedPart> saved_parts(MicrobatchShape sh) const { return llama_cuda_saved_parts(d_, sh.tokens()); }
  /// The bf16 working parameters (device memory, LlamaStage's layout) and fp32 gradients.
  Tensor parameters() {
    return {reinterpret_cast<std::byte*>(work()), static_cast<std::size_t>(p_.total), DType::bfloat16};
  }
  std::span<float> gradients() { return {grad(), static_cast<std::size_t>(p_.total)}; }
  std::vector<std::size_t> norm_groups() const { return llama_norm_groups(d_); }
  std::vector<ParamInfo> parameter_info() const { return llama_parameter_info(d_); }
  std::vector<SharedParam> shared_parameters() const { return llama_shared_parameters(d_); }
  std::string name() const { return "llama::CudaLlamaStage"; }
  /// Its calls may be captured and replayed (RuntimeOptions::graphs): it reads no step; packed
  /// rows are not, as their attention's graph follows the document count read on the host.
  bool capturable() const { return !(d_.packed && d_.blocks > 0); }
  /// Device bytes of the stage's state (llama_cuda_state_bytes) and of its scratch.
  std::size_t state_bytes() const { return llama_cuda_state_bytes(d_, c_.seq); }
  std::size_t scratch_bytes() const { return llama_cuda_workspace(d_, max_.tokens()).bytes; }
  const LlamaDims& dims() const { return d_; }

  /// Before a call's passes (layer.hpp): cuDNN's graphs for the microbatch's shape built and
  /// their workspace checked now rather than in a pass (a shape built before is a lookup; an
  /// evaluation call's forward graph alone); packed, for its document count and length, its
  /// rows checked and counted on the host. A training microbatch of seq 1, which cuDNN's
  /// backward refuses, is refused here, before any pass.
  void prepare(const Microbatch& mb) {
    if (d_.blocks == 0) return;
    if (mb.shape.seq < 2 && mb.training) throw shape_error(who("prepare") + ": " + cuda::attention::seq_one_refused);
    cuda::attention::Shape s = attention_shape(mb.shape);
    if (d_.packed) {
      (void)packed_rows(mb, who("prepare"), docs_);
      s.documents = cuda::document_slots(static_cast<long long>(docs_.size()), mb.shape.tokens());
      s.length = cuda::packed_length(longest_document(docs_), mb.shape.seq);
    }
    require_attention(s, who("prepare"), mb.training);
  }

  void forward(backend::CudaContext& ctx, const Microbatch& mb, ConstTensor xt, Tensor yt, std::byte* saved) {
    Pass p = begin("forward", mb, saved, nullptr, false);
    const long long T = p.T;
    // Both boundaries checked before any kernel is queued (a bad one throws with nothing written).
    std::byte* y = d_.has_head ? nullptr : boundary(yt, "forward", "y", T);
    const std::byte* x = d_.embeds ? nullptr : boundary(xt, "forward", "x", T);
    if (d_.has_head && mb.loss == nullptr) throw error(who("forward") + ": mb.loss is null on the last stage");
    const std::int32_t* targets = d_.has_head ? step_input(mb, "targets", "forward", T) : nullptr;
    bf16* in = d_.blocks > 0 ? at<bf16>(saved + p.buf.block_saved(0), p.buf.block.x)
               : d_.has_head ? at<bf16>(saved + p.buf.head_saved, p.buf.head.x)
                             : scratch<bf16>(p.ws.io);
    if (d_.embeds)
      ops::embedding_forward(ctx, step_input(mb, "tokens", "forward", T), work(), in, T, h(), V());
    else
      from_boundary(ctx, x, in, T);
    if (d_.blocks > 0) documents(ctx, mb, "forward", p);
    for (int i = 0; i < d_.blocks; ++i) {
      bf16* out = i + 1 < d_.blocks ? at<bf16>(saved + p.buf.block_saved(i + 1), p.buf.block.x)
                  : d_.has_head     ? at<bf16>(saved + p.buf.head_saved, p.buf.head.x)
                                    : scratch<bf16>(p.ws.io);
      block_forward(ctx, p, mb, i, saved, out);
    }
    if (d_.has_head)
      head_forward(ctx, p, mb, saved, targets);
    else
      to_boundary(ctx, scratch<bf16>(p.ws.io), y, T);
  }

  void backward_input(backend::CudaContext& ctx, const Microbatch& mb, ConstTensor dyt, Tensor dxt, std::byte* saved,
                      std::byte* stash) {
    Pass p = begin("backward_input", mb, saved, stash, true);
    const long long T = p.T;
    const std::byte* dy = d_.has_head ? nullptr : boundary(dyt, "backward_input", "dy", T);
    std::byte* dx = d_.embeds ? nullptr : boundary(dxt, "backward_input", "dx", T);
    bf16* g = scratch<bf16>(p.ws.io);
    bf16* spare = scratch<bf16>(p.ws.io2);
    int part = 0;  // the next of saved_parts() to await
    if (d_.has_head) {
      mb.await_saved(part++);
      head_backward_input(ctx, p, saved, stash, g);
    } else {
      from_boundary(ctx, dy, g, T);
    }
    if (d_.blocks > 0) documents(ctx, mb, "backward_input", p);
    const int per = blocks_per_saved_part(d_.blocks, d_.has_head);
    for (int i = d_.blocks - 1; i >= 0; --i) {
      if ((d_.blocks - 1 - i) % per == 0) mb.await_saved(part++);  // a part's last block comes first
      block_backward_input(ctx, p, mb, i, saved, stash, g, spare);
      std::swap(g, spare);
    }
    if (d_.embeds)
      copy(ctx, at<bf16>(stash, p.buf.stash_embed), g, T * h());
    else
      to_boundary(ctx, g, dx, T);
  }

  void backward_weight(backend::CudaContext& ctx, const Microbatch& mb, std::byte* saved, std::byte* stash) {
    const Pass p = begin("backward_weight", mb, saved, stash, true);
    if (d_.embeds)
      ops::embedding_backward(ctx, step_input(mb, "tokens", "backward_weight", p.T), at<bf16>(stash, p.buf.stash_embed),
                              grad(), p.T, h(), V());
    for (int i = 0; i < d_.blocks; ++i) block_backward_weight(ctx, p, i, saved, stash);
    if (d_.has_head) head_backward_weight(ctx, p, saved, stash);
  }

 private:
  using Out = cuda::Out;

  // ---- sizes, pointers, checks --------------------------------------------------------------
  int h() const { return static_cast<int>(d_.hidden); }
  int V() const { return static_cast<int>(d_.vocab); }
  long long kv() const { return d_.kv_width(); }
  long long f() const { return d_.ffn; }
  static std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
  bf16* work() const { return work_.as<bf16>(); }
  float* grad() const { return grads_.as<float>(); }
  template <class T>
  static T* at(std::byte* base, cuda::Region r) {
    return r.bytes == 0 ? nullptr : reinterpret_cast<T*>(base + r.offset);
  }
  template <class T>
  T* scratch(cuda::Region r) const {
    return at<T>(scratch_.as<std::byte>(), r);
  }
  cuda::attention::Shape attention_shape(MicrobatchShape sh) const {
    return {sh.batch, static_cast<int>(d_.heads), sh.seq, static_cast<int>(d_.head_dim()),
            static_cast<int>(d_.kv_heads)};
  }
  /// The attention graphs of `s` (separate q, k, v) built and their workspace checked.
  void require_attention(cuda::attention::Shape s, const std::string& by, bool backward = true) const {
    cuda::attention::require_workspace(dev_->attention_graphs(), s, true, dev_->options().workspace_bytes, by,
                                       backward);
  }
  std::string who(const char* pass) const {
    return std::string("llama::CudaLlamaStage (blocks ") + std::to_string(d_.first_block) + ".." +
           std::to_string(d_.first_block + d_.blocks) + ")::" + pass;
  }

  struct Pass {
    long long T = 0;
    LlamaStageBuffers buf{};
    LlamaWorkspace ws{};
    ops::AttentionShape att{};
    ops::DeviceDocuments docs{};  ///< packed rows' documents (count 0: unpacked)
  };
  /// A pass's sizes and pointers, checked on the host; `needs_stash`: B and W read and write the
  /// stash (the forward has none, so a null one there is no error).
  Pass begin(const char* pass, const Microbatch& mb, const std::byte* saved, const std::byte* stash,
             bool needs_stash) const {
    const MicrobatchShape sh = mb.shape;
    // (seq beyond the constructor's would need more attention workspace than it checked.)
    if (sh.batch < 1 || sh.seq < 1 || sh.seq > std::min(c_.seq, max_.seq) || sh.tokens() > max_.tokens())
      throw shape_error(who(pass) + ": microbatch shape batch = " + std::to_string(sh.batch) +
                        ", seq = " + std::to_string(sh.seq) +
                        " (need batch, seq >= 1, seq <= " + std::to_string(std::min(c_.seq, max_.seq)) +
                        ", batch * seq <= the constructor's " + std::to_string(max_.tokens()) + ")");
    Pass p;
    p.T = sh.tokens();
    p.buf = llama_cuda_buffers(d_, p.T);
    p.ws = llama_cuda_workspace(d_, p.T);
    const auto aligned = [](const std::byte* q) {
      return q != nullptr && reinterpret_cast<std::uintptr_t>(q) % cuda::region_alignment == 0;
    };
    const std::string align = " must be a device buffer aligned to " + std::to_string(cuda::region_alignment) +
                              " bytes (backend::Cuda's are)";
    if (p.buf.saved_bytes > 0 && !aligned(saved)) throw error(who(pass) + ": saved" + align);
    if (needs_stash && p.buf.stash_bytes > 0 && !aligned(stash)) throw error(who(pass) + ": stash" + align);
    p.att = {sh.batch, sh.seq, static_cast<int>(d_.heads), static_cast<int>(d_.kv_heads),
             static_cast<int>(d_.head_dim())};
    return p;
  }
  /// A boundary's data, checked on the host: present, of the stage's boundary type, (T, h).
  template <class View>
  auto boundary(View t, const char* pass, const char* name, long long T) const -> decltype(t.data) {
    if (!t) throw error(who(pass) + ": " + name + " is empty");
    if (t.elements != static_cast<std::size_t>(T) * static_cast<std::size_t>(h()))
      throw shape_error(who(pass) + ": " + name + " holds " + std::to_string(t.elements) + " values; a microbatch of " +
                        std::to_string(T) + " tokens needs tokens * hidden = " + std::to_string(T * h()));
    if (t.dtype != boundaries_)
      throw error(who(pass) + ": " + name + " holds " + dtype_name(t.dtype) + " values; this stage's boundaries are " +
                  dtype_name(boundaries_));
    return t.data;
  }
  /// A (T, h) boundary into the stage's bf16 and back: a conversion (fp32) or a copy (bf16).
  void from_boundary(const backend::CudaContext& ctx, const std::byte* b, bf16* out, long long T) const {
    if (boundaries_ == DType::bfloat16)
      copy(ctx, out, reinterpret_cast<const bf16*>(b), T * h());
    else
      cuda::kernels::to_bf16(reinterpret_cast<const float*>(b), out, T * h(), ctx.cuda_stream);
  }
  void to_boundary(const backend::CudaContext& ctx, const bf16* in, std::byte* b, long long T) const {
    if (boundaries_ == DType::bfloat16)
      copy(ctx, reinterpret_cast<bf16*>(b), in, T * h());
    else
      cuda::kernels::to_float(in, reinterpret_cast<float*>(b), T * h(), ctx.cuda_stream);
  }
  /// Every token's position in its document (ws.positions) and, packed, the documents' table
  /// (ws.documents, p.docs): the rows' offsets are checked and their documents counted on the
  /// host (Microbatch::host_input), the table and positions computed from the device copy.
  void documents(const backend::CudaContext& ctx, const Microbatch& mb, const char* pass, Pass& p) {
    const int seq = mb.shape.seq;
    std::int32_t* positions = scratch<std::int32_t>(p.ws.positions);
    if (!d_.packed) {
      ops::sequence_positions(ctx, positions, p.T, seq);
      return;
    }
    const std::int32_t* dev = packed_rows(mb, who(pass), docs_);
    const int count = static_cast<int>(docs_.size());
    ops::document_positions(ctx, dev, positions, p.T, seq);
    p.docs = ops::document_table(ctx, dev, mb.shape.batch, seq, count, longest_document(docs_), p.att, {},
                                 scratch<std::byte>(p.ws.documents));
  }
  /// The int32 step input `name` (one value a token), checked on the host.
  const std::int32_t* step_input(const Microbatch& mb, const char* name, const char* pass, long long T) const {
    const ConstTensor t = mb.input(name);
    if (!t || t.elements != static_cast<std::size_t>(T))
      throw shape_error(who(pass) + ": the step input '" + name + "' holds " + std::to_string(t ? t.elements : 0) +
                        " values; a microbatch of " + std::to_string(T) + " tokens needs " + std::to_string(T));
    return t.as<std::int32_t>();
  }
  static void copy(const backend::CudaContext& ctx, bf16* dst, const bf16* src, long long count) {
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(count) * sizeof(bf16),
                                           cudaMemcpyDeviceToDevice, ctx.cuda_stream));
  }

  // ---- GEMMs: Y = X W (X rows x k, W k x n), as cpu.hpp's linear, linear_dx, linear_dw ----------
  static void linear(const backend::CudaContext& ctx, long long T, const bf16* X, const bf16* W, bf16* Y, long long k,
                     long long n) {
    cuda::gemm(ctx, cuda::linear_forward(T, k, n), X, W, Y, Out::bf16);
  }
  /// dX (T x k) (+)= dY W^T; `accumulate` adds into dX (beta = 1).
  static void linear_dx(const backend::CudaContext& ctx, long long T, const bf16* dY, const bf16* W, bf16* dX,
                        long long k, long long n, bool accumulate = false) {
    cuda::RowMajorGemm g = cuda::linear_dgrad(T, k, n);
    g.beta = accumulate ? 1.0f : 0.0f;
    cuda::gemm(ctx, g, dY, W, dX, Out::bf16);
  }
  /// dW (k x n) += X^T dY, fp32.
  static void linear_dw(const backend::CudaContext& ctx, long long T, const bf16* X, const bf16* dY, float* dW,
                        long long k, long long n) {
    cuda::gemm(ctx, cuda::linear_wgrad(T, k, n), X, dY, dW, Out::f32);
  }

  struct BlockParams {
    const bf16 *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w3, *w2;
  };
  BlockParams weights(int i) const {
    const bf16* p = work() + p_.block_begin(i);
    const LlamaBlockParams& o = p_.block;
    return {p + o.attn_norm, p + o.wq, p + o.wk, p + o.wv, p + o.wo, p + o.ffn_norm, p + o.w1, p + o.w3, p + o.w2};
  }
  struct BlockGrads {
    float *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w3, *w2;
  };
  BlockGrads grads(int i) const {
    float* p = grad() + p_.block_begin(i);
    const LlamaBlockParams& o = p_.block;
    return {p + o.attn_norm, p + o.wq, p + o.wk, p + o.wv, p + o.wo, p + o.ffn_norm, p + o.w1, p + o.w3, p + o.w2};
  }
  struct Saved {
    bf16 *x, *q, *k, *v, *att, *x1, *gate, *up;
    float *rstd, *lse;
  };
  static Saved saved_block(std::byte* saved, const Pass& p, int i) {
    std::byte* b = saved + p.buf.block_saved(i);
    const LlamaBlockSaved& L = p.buf.block;
    return {at<bf16>(b, L.x),  at<bf16>(b, L.q),    at<bf16>(b, L.k),  at<bf16>(b, L.v),     at<bf16>(b, L.att),
            at<bf16>(b, L.x1), at<bf16>(b, L.gate), at<bf16>(b, L.up), at<float>(b, L.rstd), at<float>(b, L.lse)};
  }
  struct Stash {
    bf16 *dy, *dgate, *dup, *da2, *dx1, *dq, *dk, *dv, *da1;
  };
  static Stash stash_block(std::byte* stash, const Pass& p, int i) {
    std::byte* b = stash + p.buf.block_stashed(i);
    const LlamaBlockStash& L = p.buf.block_stash;
    return {at<bf16>(b, L.dy), at<bf16>(b, L.dgate), at<bf16>(b, L.dup), at<bf16>(b, L.da2), at<bf16>(b, L.dx1),
            at<bf16>(b, L.dq), at<bf16>(b, L.dk),    at<bf16>(b, L.dv),  at<bf16>(b, L.da1)};
  }

  // ---- attention over whole rows or, packed, within each document ---------------------------
  static void attention_forward(const backend::CudaContext& ctx, const Pass& p, const bf16* q, const bf16* k,
                                const bf16* v, bf16* out, float* lse) {
    if (p.docs.count > 0)
      ops::attention_forward(ctx, q, k, v, out, lse, p.att, p.docs);
    else
      ops::attention_forward(ctx, q, k, v, out, lse, p.att);
  }
  static void attention_backward(const backend::CudaContext& ctx, const Pass& p, const bf16* q, const bf16* k,
                                 const bf16* v, const bf16* out, const bf16* dout, const float* lse, bf16* dq, bf16* dk,
                                 bf16* dv) {
    if (p.docs.count > 0)
      ops::attention_backward(ctx, q, k, v, out, dout, lse, dq, dk, dv, p.att, p.docs);
    else
      ops::attention_backward(ctx, q, k, v, out, dout, lse, dq, dk, dv, p.att);
  }

  // ---- a block: cpu.hpp's block_forward, block_backward_input, block_backward_weight -----------

  void block_forward(const backend::CudaContext& ctx, const Pass& p, const Microbatch&, int i, std::byte* saved,
                     bf16* out) {
    const long long T = p.T, H = h();
    const Saved b = saved_block(saved, p, i);
    const BlockParams w = weights(i);
    bf16* a = scratch<bf16>(p.ws.a);
    bf16* tmp = scratch<bf16>(p.ws.tmp);
    const std::int32_t* pos = scratch<std::int32_t>(p.ws.positions);
    ops::rmsnorm_forward(ctx, b.x, w.attn_norm, a, b.rstd, T, h(), c_.norm_eps);
    linear(ctx, T, a, w.wq, b.q, H, H);
    linear(ctx, T, a, w.wk, b.k, H, kv());
    linear(ctx, T, a, w.wv, b.v, H, kv());
    ops::rope(ctx, b.q, pos, T, h(), rope_view_, false);
    ops::rope(ctx, b.k, pos, T, static_cast<int>(kv()), rope_view_, false);
    attention_forward(ctx, p, b.q, b.k, b.v, b.att, b.lse);
    linear(ctx, T, b.att, w.wo, tmp, H, H);
    ops::add(ctx, b.x, tmp, b.x1, T * H);
    ops::rmsnorm_forward(ctx, b.x1, w.ffn_norm, a, b.rstd + T, T, h(), c_.norm_eps);
    linear(ctx, T, a, w.w1, b.gate, H, f());
    linear(ctx, T, a, w.w3, b.up, H, f());
    ops::swiglu_forward(ctx, b.gate, b.up, tmp, T * f());
    linear(ctx, T, tmp, w.w2, out, f(), H);
    ops::add(ctx, out, b.x1, out, T * H);
  }

  /// grad (T, h) = dL/d(block output) in; out (T, h) = dL/d(block input).
  void block_backward_input(const backend::CudaContext& ctx, const Pass& p, const Microbatch&, int i, std::byte* saved,
                            std::byte* stash, const bf16* grad, bf16* out) {
    const long long T = p.T, H = h();
    const Saved b = saved_block(saved, p, i);
    const BlockParams w = weights(i);
    const Stash z = stash_block(stash, p, i);
    const std::int32_t* pos = scratch<std::int32_t>(p.ws.positions);
    bf16* dh = scratch<bf16>(p.ws.tmp);  // d(silu(gate) * up)
    bf16* datt = scratch<bf16>(p.ws.datt);
    copy(ctx, z.dy, grad, T * H);
    linear_dx(ctx, T, grad, w.w2, dh, f(), H);
    ops::swiglu_backward(ctx, dh, b.gate, b.up, z.dgate, z.dup, T * f());
    linear_dx(ctx, T, z.dgate, w.w1, z.da2, H, f());
    linear_dx(ctx, T, z.dup, w.w3, z.da2, H, f(), true);
    ops::rmsnorm_backward(ctx, z.da2, b.x1, b.rstd + T, w.ffn_norm, z.dx1, T, h(), false);
    ops::add(ctx, z.dx1, grad, z.dx1, T * H);
    linear_dx(ctx, T, z.dx1, w.wo, datt, H, H);
    attention_backward(ctx, p, b.q, b.k, b.v, b.att, datt, b.lse, z.dq, z.dk, z.dv);
    ops::rope(ctx, z.dq, pos, T, h(), rope_view_, true);  // gradients of the projections before their rotation
    ops::rope(ctx, z.dk, pos, T, static_cast<int>(kv()), rope_view_, true);
    linear_dx(ctx, T, z.dq, w.wq, z.da1, H, H);
    linear_dx(ctx, T, z.dk, w.wk, z.da1, H, kv(), true);
    linear_dx(ctx, T, z.dv, w.wv, z.da1, H, kv(), true);
    ops::rmsnorm_backward(ctx, z.da1, b.x, b.rstd, w.attn_norm, out, T, h(), false);
    ops::add(ctx, out, z.dx1, out, T * H);
  }

  void block_backward_weight(const backend::CudaContext& ctx, const Pass& p, int i, std::byte* saved,
                             std::byte* stash) {
    const long long T = p.T, H = h();
    const Saved b = saved_block(saved, p, i);
    const BlockParams w = weights(i);
    const BlockGrads g = grads(i);
    const Stash z = stash_block(stash, p, i);
    bf16* a = scratch<bf16>(p.ws.a);
    bf16* hid = scratch<bf16>(p.ws.tmp);
    ops::swiglu_forward(ctx, b.gate, b.up, hid, T * f());
    linear_dw(ctx, T, hid, z.dy, g.w2, f(), H);
    ops::rmsnorm_recompute(ctx, b.x1, b.rstd + T, w.ffn_norm, a, T, h());
    linear_dw(ctx, T, a, z.dgate, g.w1, H, f());
    linear_dw(ctx, T, a, z.dup, g.w3, H, f());
    ops::rmsnorm_weight_grad(ctx, z.da2, b.x1, b.rstd + T, g.ffn_norm, T, h());
    linear_dw(ctx, T, b.att, z.dx1, g.wo, H, H);
    ops::rmsnorm_recompute(ctx, b.x, b.rstd, w.attn_norm, a, T, h());
    linear_dw(ctx, T, a, z.dq, g.wq, H, H);
    linear_dw(ctx, T, a, z.dk, g.wk, H, kv());
    linear_dw(ctx, T, a, z.dv, g.wv, H, kv());
    ops::rmsnorm_weight_grad(ctx, z.da1, b.x, b.rstd, g.attn_norm, T, h());
  }

  // ---- the head ------------------------------------------------------------------------------
  // Untied, the output projection is (h, V) and logits = a W; tied, it is the embedding (V, h)
  // and logits = a W^T, dx = dlogits W, dW += dlogits^T a.

  void head_forward(const backend::CudaContext& ctx, const Pass& p, const Microbatch& mb, std::byte* saved,
                    const std::int32_t* targets) {
    const long long T = p.T, H = h();
    std::byte* hp = saved + p.buf.head_saved;
    const bf16* x = at<bf16>(hp, p.buf.head.x);
    float* rstd = at<float>(hp, p.buf.head.rstd);
    const bf16* norm = work() + p_.head_begin;
    const bf16* W = norm + p_.head_w;
    bf16* a = scratch<bf16>(p.ws.a);
    float* logits = scratch<float>(p.ws.logits);  // (rows, V) fp32, then the loss gradient in place
    float* losses = scratch<float>(p.ws.losses);
    bf16* dlogits = at<bf16>(hp, p.buf.head.dlogits);
    ops::rmsnorm_forward(ctx, x, norm, a, rstd, T, h(), c_.norm_eps);
    // A block of cuda::logits_rows rows at a time (the scratch holds one block): the logits, the
    // loss and its gradient in place (scaled by loss_scale / T), saved in bf16 for B and W.
    const long long block = cuda::logits_rows(T, V());
    for (long long r = 0; r < T; r += block) {
      const long long rows = std::min(block, T - r);
      if (d_.tied)
        cuda::gemm(ctx, {cuda::Op::n, cuda::Op::t, rows, V(), H, H, H, V(), 1.0f, 0.0f}, a + r * H, W, logits,
                   Out::f32);
      else
        cuda::gemm(ctx, cuda::linear_forward(rows, H, V()), a + r * H, W, logits, Out::f32);
      ops::cross_entropy(ctx, logits, targets + r, losses + r, logits, rows, V(),
                         mb.loss_scale / static_cast<float>(T));
      cuda::kernels::to_bf16(logits, dlogits + r * V(), rows * V(), ctx.cuda_stream);
    }
    ops::mean(ctx, losses, mb.loss, T);
  }

  void head_backward_input(const backend::CudaContext& ctx, const Pass& p, std::byte* saved, std::byte* stash,
                           bf16* dx) {
    const long long T = p.T, H = h();
    std::byte* hp = saved + p.buf.head_saved;
    const bf16* dlogits = at<bf16>(hp, p.buf.head.dlogits);
    const bf16* norm = work() + p_.head_begin;
    const bf16* W = norm + p_.head_w;
    bf16* da = at<bf16>(stash, p.buf.stash_head);  // stashed for the norm's weight gradient
    if (d_.tied)
      linear(ctx, T, dlogits, W, da, V(), H);
    else
      linear_dx(ctx, T, dlogits, W, da, H, V());
    ops::rmsnorm_backward(ctx, da, at<bf16>(hp, p.buf.head.x), at<float>(hp, p.buf.head.rstd), norm, dx, T, h(), false);
  }

  void head_backward_weight(const backend::CudaContext& ctx, const Pass& p, std::byte* saved, std::byte* stash) {
    const long long T = p.T, H = h();
    std::byte* hp = saved + p.buf.head_saved;
    const bf16* x = at<bf16>(hp, p.buf.head.x);
    const float* rstd = at<float>(hp, p.buf.head.rstd);
    const bf16* dlogits = at<bf16>(hp, p.buf.head.dlogits);
    const bf16* norm = work() + p_.head_begin;
    float* gnorm = grad() + p_.head_begin;
    bf16* a = scratch<bf16>(p.ws.a);
    ops::rmsnorm_recompute(ctx, x, rstd, norm, a, T, h());
    if (d_.tied)
      linear_dw(ctx, T, dlogits, a, gnorm + p_.head_w, V(), H);
    else
      linear_dw(ctx, T, a, dlogits, gnorm + p_.head_w, H, V());
    ops::rmsnorm_weight_grad(ctx, at<bf16>(stash, p.buf.stash_head), x, rstd, gnorm, T, h());
  }

  LlamaConfig c_;
  MicrobatchShape max_;
  int device_ = 0;
  DType boundaries_ = DType::float32;
  LlamaDims d_{};
  LlamaStageParams p_{};
  cuda::DeviceMemory work_;       // (total) bf16 working parameters; the optimizer updates them
  cuda::DeviceMemory grads_;      // (total) fp32 gradients, accumulated by W
  cuda::DeviceMemory scratch_;    // llama_cuda_workspace(dims, max tokens) bytes
  cuda::DeviceMemory rope_;       // RoPE's cos then sin, fp32 (seq, head_dim / 2) each
  ops::RopeView rope_view_{};     // rope_ as the ops read it
  std::vector<Document> docs_;    // a packed microbatch's documents, counted on the host
  backend::Cuda* dev_ = nullptr;  // its cuDNN graphs and workspace (prepare builds packed ones)
};

static_assert(layer_for<CudaLlamaStage, backend::CudaContext>,
              "llama::CudaLlamaStage must model po::layer_for<CudaLlamaStage, backend::CudaContext>.");

}  // namespace pipeoffload::llama
