// models/gpt/cpu.hpp: the reference GPT on the CPU, as pipeline stages (gpt::GptStage, a
// po::layer_for<GptStage, backend::CpuContext>): fp32, GEMMs on OpenBLAS, the rest on the CPU
// ops. What it saves, stashes and recomputes: docs/gpt.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <pipeoffload/backend/cpu/blas.hpp>
#include <pipeoffload/backend/cpu/context.hpp>
#include <pipeoffload/error.hpp>
#include <pipeoffload/layer.hpp>
#include <pipeoffload/packing.hpp>

#include <pipeoffload/ops/cpu.hpp>
#include "layout.hpp"

namespace pipeoffload::gpt {

/// The CPU stage's per-microbatch buffers, from its dims alone: GptStage lays its buffers out
/// with these, and a launcher sizes a rank's memory with them before building any stage.
namespace gpt_cpu_bytes {

inline std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
/// One block's saved region: its b*s*h tensors (10 of them with recompute, else 16), the
/// per-row LayerNorm statistics and attention log-sum-exps, the dropout masks without
/// recompute; 64-byte aligned.
inline std::size_t block_saved(const GptDims& d, MicrobatchShape sh) {
  const std::size_t T = tokens(sh), h = static_cast<std::size_t>(d.hidden);
  const std::size_t floats = T * h * (d.recompute ? 10 : 16) + 4 * T + T * static_cast<std::size_t>(d.heads);
  const std::size_t bytes = floats * sizeof(float) + (d.recompute ? 0 : 2 * T * h);
  return (bytes + 63) / 64 * 64;
}
/// One block's stash: dP2 (T,h) | dF (T,4h) | dA2 (T,h) | dO1 (T,h) | dQKV (T,3h) | dA1 (T,h).
inline std::size_t block_stash_floats(const GptDims& d, MicrobatchShape sh) {
  return tokens(sh) * static_cast<std::size_t>(d.hidden) * 11;
}
/// The head's saved region: x (T,h) | lnf stats (T,2) | dlogits (T,V).
inline std::size_t head_saved(const GptDims& d, MicrobatchShape sh) {
  return tokens(sh) * static_cast<std::size_t>(d.hidden + 2 + d.vocab) * sizeof(float);
}
/// The stage's activation unit (layer::saved_bytes).
inline std::size_t saved(const GptDims& d, MicrobatchShape sh) {
  return static_cast<std::size_t>(d.blocks) * block_saved(d, sh) + (d.has_head ? head_saved(d, sh) : 0);
}
/// The activation unit's parts (layer::saved_parts): the head's region, then each block's, last to first.
inline std::vector<SavedPart> saved_parts(const GptDims& d, MicrobatchShape sh) {
  return stacked_saved_parts(d.blocks, block_saved(d, sh), d.has_head ? head_saved(d, sh) : 0);
}
/// The stage's B-to-W stash (layer::stash_bytes): the embedding's and the head's (T,h) and each block's.
inline std::size_t stash(const GptDims& d, MicrobatchShape sh) {
  const std::size_t Th = tokens(sh) * static_cast<std::size_t>(d.hidden);
  return ((d.embeds ? Th : 0) + static_cast<std::size_t>(d.blocks) * block_stash_floats(d, sh) +
          (d.has_head ? Th : 0)) *
         sizeof(float);
}

}  // namespace gpt_cpu_bytes

/// Stage `stage` of S: blocks [first, first + count) of the model, with the embedding when
/// stage == 0 and the head when stage == S-1. Blocks are spread as evenly as possible.
class GptStage {
 public:
  GptStage(const GptConfig& cfg, int stage, int stages) : c_(cfg), stage_(stage), stages_(stages) {
    cfg.check();
    if (stages < 1 || stage < 0 || stage >= stages)
      throw shape_error("GptStage: stage = " + std::to_string(stage) + " is outside [0, " + std::to_string(stages - 1) +
                        "]");
    dims_ = gpt_dims(cfg, stage, stages);
    layout_ = gpt_stage_params(dims_);
    first_ = dims_.first_block;
    count_ = dims_.blocks;
    h_ = cfg.hidden;
    const std::size_t n = static_cast<std::size_t>(layout_.total);
    params_.resize(n);
    grads_.assign(n, 0.0f);
    init();
  }

  int first_block() const { return first_; }
  int blocks() const { return count_; }
  bool embeds() const { return stage_ == 0; }
  bool heads() const { return stage_ == stages_ - 1; }

  // ---- po::layer -----------------------------------------------------------------------

  Boundary input_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), DType::float32}; }
  Boundary output_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), DType::float32}; }
  /// Stage 0 reads the token ids, the last stage the next-token targets: int32, (batch, seq)
  /// per microbatch.
  std::vector<InputSpec> inputs(MicrobatchShape sh) const { return gpt_inputs(dims_, sh); }
  std::size_t saved_bytes(MicrobatchShape sh) const { return gpt_cpu_bytes::saved(dims_, sh); }
  std::size_t stash_bytes(MicrobatchShape sh) const { return gpt_cpu_bytes::stash(dims_, sh); }
  /// The saved buffer in backward_input's reading order: the head's region, then the blocks'
  /// last to first (each awaited just before its backward reads it).
  std::vector<SavedPart> saved_parts(MicrobatchShape sh) const { return gpt_cpu_bytes::saved_parts(dims_, sh); }
  std::span<float> parameters() { return params_; }
  std::span<float> gradients() { return grads_; }
  /// One group per embedding, block and head: the runtime sums squared gradients per group
  /// in model order, so the clip is the same however the model is cut into stages.
  std::vector<std::size_t> norm_groups() const { return gpt_norm_groups(dims_); }
  /// The named tensors, in parameters() order (GPT-2's names; weights stored (in, out)).
  std::vector<ParamInfo> parameter_info() const { return gpt_parameter_info(dims_); }
  /// With tied embeddings: `wte` (stage 0) and `lm_head.weight` (last stage) are one parameter.
  std::vector<SharedParam> shared_parameters() const { return gpt_shared_parameters(dims_); }
  /// The stage type's name in the runtime's messages.
  std::string name() const { return "gpt::GptStage"; }
  /// Its calls may be captured and replayed (RuntimeOptions::graphs): its dropout reads the step from mb.device_step.
  bool capturable() const { return true; }

  /// Saved bytes of one block for a microbatch, split into what the 20bsh / 34bsh accounting
  /// counts (per-token tensors) and the small per-row extras (statistics, log-sum-exps).
  struct SavedBreakdown {
    std::size_t tensor_floats = 0;  ///< floats of b*s*h-proportional tensors
    std::size_t mask_bytes = 0;     ///< dropout masks (recompute off only)
    std::size_t extra_floats = 0;   ///< LayerNorm mean/rstd and attention log-sum-exp per row
  };
  SavedBreakdown block_breakdown(MicrobatchShape sh) const {
    const std::size_t T = tokens(sh);
    SavedBreakdown b;
    b.tensor_floats = T * h() * (c_.recompute ? 10 : 16);
    b.mask_bytes = c_.recompute ? 0 : 2 * T * h();
    b.extra_floats = 4 * T + T * static_cast<std::size_t>(c_.heads);
    return b;
  }

  void forward(backend::CpuContext& ctx, const Microbatch& mb, ConstTensor xt, Tensor yt, std::byte* saved) {
    const std::size_t T = tokens(mb.shape);
    const float* x = xt.as<float>();
    float* y = yt.as<float>();
    check_shape(mb.shape);
    float* cur = nullptr;  // (T, h) input of the next block, in that block's saved region
    std::byte* p = saved;
    std::vector<float>& tmp = ws(T * h());
    if (embeds() || count_ > 0) documents(mb);
    if (embeds()) {
      cur = count_ > 0 ? block_x(p) : tmp.data();
      const float* wte = params_.data();
      ops::embedding_forward(ctx, mb.input<std::int32_t>("tokens"), wte, cur, n(T), h_, c_.vocab);
      ops::position_embedding_forward(ctx, wte + layout_.wpe, pos_.data(), cur, n(T), h_,
                                      static_cast<int>(dims_.positions));
    } else {
      cur = count_ > 0 ? block_x(p) : tmp.data();
      std::memcpy(cur, x, T * h() * sizeof(float));
    }
    for (int i = 0; i < count_; ++i) {
      std::byte* bp = p + static_cast<std::size_t>(i) * block_saved(mb.shape);
      float* out = nullptr;
      if (i + 1 < count_)
        out = block_x(bp + block_saved(mb.shape));
      else if (heads())
        out = head_x(p + count_ * block_saved(mb.shape));
      else
        out = y;
      block_forward(ctx, i, mb, bp, out);
      cur = out;
    }
    if (heads()) {
      std::byte* hp = p + count_ * block_saved(mb.shape);
      if (count_ == 0) std::memcpy(head_x(hp), cur, T * h() * sizeof(float));
      *mb.loss = head_forward(ctx, mb, hp);
      return;
    }
    if (count_ == 0 && y != nullptr) std::memcpy(y, cur, T * h() * sizeof(float));
  }

  void backward_input(backend::CpuContext& ctx, const Microbatch& mb, ConstTensor dyt, Tensor dxt, std::byte* saved,
                      std::byte* stash) {
    const std::size_t T = tokens(mb.shape);
    const float* dy = dyt.as<float>();
    float* dx = dxt.as<float>();
    check_shape(mb.shape);
    float* st = reinterpret_cast<float*>(stash);
    float* st_embed = st;
    float* st_blocks = st + (embeds() ? T * h() : 0);
    float* st_head = st_blocks + count_ * block_stash_floats(mb.shape);
    std::vector<float>& g = ws(2 * T * h());
    if (count_ > 0) documents(mb);
    float* grad = g.data();  // (T, h) gradient flowing down through the blocks
    float* spare = grad + T * h();
    int part = 0;  // the next of saved_parts() to await
    if (heads()) {
      mb.await_saved(part++);
      head_backward_input(ctx, mb, saved + count_ * block_saved(mb.shape), st_head, grad);
    } else {
      std::memcpy(grad, dy, T * h() * sizeof(float));
    }
    const int per = blocks_per_saved_part(count_, heads());
    for (int i = count_ - 1; i >= 0; --i) {
      if ((count_ - 1 - i) % per == 0) mb.await_saved(part++);  // a part's last block comes first
      block_backward_input(ctx, i, mb, saved + static_cast<std::size_t>(i) * block_saved(mb.shape),
                           st_blocks + static_cast<std::size_t>(i) * block_stash_floats(mb.shape), grad, spare);
      std::swap(grad, spare);
    }
    if (embeds())
      std::memcpy(st_embed, grad, T * h() * sizeof(float));
    else
      std::memcpy(dx, grad, T * h() * sizeof(float));
  }

  void backward_weight(backend::CpuContext& ctx, const Microbatch& mb, std::byte* saved, std::byte* stash) {
    const std::size_t T = tokens(mb.shape);
    check_shape(mb.shape);
    const float* st = reinterpret_cast<const float*>(stash);
    const float* st_blocks = st + (embeds() ? T * h() : 0);
    const float* st_head = st_blocks + count_ * block_stash_floats(mb.shape);
    if (embeds()) {
      documents(mb);
      float* gte = grads_.data();
      ops::embedding_backward(ctx, mb.input<std::int32_t>("tokens"), st, gte, n(T), h_, c_.vocab);
      ops::embedding_backward(ctx, pos_.data(), st, gte + layout_.wpe, n(T), h_,
                              static_cast<int>(dims_.positions));  // positions as the ids
    }
    for (int i = 0; i < count_; ++i)
      block_backward_weight(ctx, i, mb, saved + static_cast<std::size_t>(i) * block_saved(mb.shape),
                            st_blocks + static_cast<std::size_t>(i) * block_stash_floats(mb.shape));
    if (heads()) head_backward_weight(ctx, mb, saved + count_ * block_saved(mb.shape), st_head);
  }

 private:
  // ---- sizes -------------------------------------------------------------------------------
  std::size_t h() const { return static_cast<std::size_t>(h_); }
  std::size_t V() const { return static_cast<std::size_t>(c_.vocab); }
  static std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
  static long long n(std::size_t v) { return static_cast<long long>(v); }
  void check_shape(MicrobatchShape sh) const {
    if (sh.seq > c_.seq)
      throw shape_error("GptStage: microbatch seq = " + std::to_string(sh.seq) +
                        " is longer than the position table (" + std::to_string(c_.seq) + ")");
  }

  // Block saved layout (floats unless noted), T = b*s tokens:
  //   x (T,h) | qkv (T,3h) | att (T,h) | x1 (T,h) | f (T,4h) | ln stats (T,4) | lse (b,a,s)
  //   recompute off, also: a1 (T,h) | a2 (T,h) | g (T,4h) | masks (2,T,h) bytes
  std::size_t block_saved(MicrobatchShape sh) const { return gpt_cpu_bytes::block_saved(dims_, sh); }
  std::size_t block_stash_floats(MicrobatchShape sh) const { return gpt_cpu_bytes::block_stash_floats(dims_, sh); }

  static float* block_x(std::byte* bp) { return reinterpret_cast<float*>(bp); }
  static float* head_x(std::byte* hp) { return reinterpret_cast<float*>(hp); }

  struct BlockView {
    float *x, *qkv, *att, *x1, *f, *stats, *lse, *a1, *a2, *g;
    std::uint8_t *m1, *m2;
  };
  BlockView view(std::byte* bp, MicrobatchShape sh) const {
    const std::size_t T = tokens(sh), H = h();
    BlockView v{};
    float* p = reinterpret_cast<float*>(bp);
    v.x = p;
    v.qkv = v.x + T * H;
    v.att = v.qkv + 3 * T * H;
    v.x1 = v.att + T * H;
    v.f = v.x1 + T * H;
    v.stats = v.f + 4 * T * H;
    v.lse = v.stats + 4 * T;
    float* end = v.lse + T * static_cast<std::size_t>(c_.heads);
    if (!c_.recompute) {
      v.a1 = end;
      v.a2 = v.a1 + T * H;
      v.g = v.a2 + T * H;
      v.m1 = reinterpret_cast<std::uint8_t*>(v.g + 4 * T * H);
      v.m2 = v.m1 + T * H;
    }
    return v;
  }

  struct BlockParams {
    float *ln1g, *ln1b, *wqkv, *bqkv, *wo, *bo, *ln2g, *ln2b, *wfc, *bfc, *wpr, *bpr;
  };
  BlockParams block(std::vector<float>& store, int i) const {
    float* p = store.data() + layout_.block_begin(i);
    const GptBlockParams& o = layout_.block;
    return {p + o.ln1g, p + o.ln1b, p + o.wqkv, p + o.bqkv, p + o.wo,  p + o.bo,
            p + o.ln2g, p + o.ln2b, p + o.wfc,  p + o.bfc,  p + o.wpr, p + o.bpr};
  }
  struct HeadParams {
    float *lnfg, *lnfb, *w, *b;
  };
  HeadParams head(std::vector<float>& store) const {
    float* p = store.data() + layout_.head_begin;
    return {p + layout_.lnfg, p + layout_.lnfb, p + layout_.head_w, p + layout_.head_b};
  }

  /// Layer-owned scratch: one pass at a time runs on a rank's compute stream.
  std::vector<float>& ws(std::size_t n) {
    if (scratch_.size() < n) scratch_.resize(n);
    return scratch_;
  }

  /// A dropout site's seed; the step is read from mb.device_step when the runtime gives it.
  ops::DropoutSeed drop_seed(const Microbatch& mb, int block, int site) const {
    return {c_.seed, mb.step, mb.device_step, first_ + block, site, mb.mb};
  }

  void init() {
    // Every tensor is seeded by its global position (embedding, block index, head), so the
    // model is the same however it is cut into stages.
    const auto fill = [](float* p, std::size_t n, std::uint64_t seed, float scale) {
      for (std::size_t i = 0; i < n; ++i) {
        // Box-Muller on two counter-based uniforms.
        const double u1 = (static_cast<double>(ops::mix64(seed, 2 * i) >> 11) + 1.0) / 9007199254740993.0;
        const double u2 = static_cast<double>(ops::mix64(seed, 2 * i + 1) >> 11) / 9007199254740992.0;
        p[i] = static_cast<float>(scale * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
      }
    };
    const std::size_t H = h();
    const float std_w = 0.02f, std_res = 0.02f / std::sqrt(2.0f * static_cast<float>(c_.layers));
    if (embeds()) {
      fill(params_.data(), V() * H, ops::mix64(c_.seed, 1000001), std_w);
      fill(params_.data() + V() * H, static_cast<std::size_t>(c_.seq) * H, ops::mix64(c_.seed, 1000002), std_w * 0.5f);
    }
    for (int i = 0; i < count_; ++i) {
      BlockParams b = block(params_, i);
      const std::uint64_t s = ops::mix64(c_.seed, static_cast<std::uint64_t>(first_ + i));
      std::fill(b.ln1g, b.ln1g + H, 1.0f);
      std::fill(b.ln2g, b.ln2g + H, 1.0f);
      fill(b.wqkv, 3 * H * H, ops::mix64(s, 1), std_w);
      fill(b.wo, H * H, ops::mix64(s, 2), std_res);
      fill(b.wfc, 4 * H * H, ops::mix64(s, 3), std_w);
      fill(b.wpr, 4 * H * H, ops::mix64(s, 4), std_res);
    }
    if (heads()) {
      const HeadParams hp = head(params_);
      std::fill(hp.lnfg, hp.lnfg + H, 1.0f);
      // Tied: the embedding's values, (V, h) (the runtime starts every holder from stage 0's).
      if (dims_.tied)
        fill(hp.w, V() * H, ops::mix64(c_.seed, 1000001), std_w);
      else
        fill(hp.w, H * V(), ops::mix64(c_.seed, 1000003), std_w);
    }
  }

  // ---- pieces ------------------------------------------------------------------------------
  using T_ = blas::Trans;

  // Y (rows x n) = X (rows x k) W (k x n) [+ bias]
  static void linear(const backend::CpuContext& ctx, const float* X, const float* W, const float* bias, float* Y,
                     std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::no, T_::no, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), 1.0f, X,
                static_cast<int>(k), W, static_cast<int>(n), 0.0f, Y, static_cast<int>(n));
    if (bias) ops::add_bias(ctx, Y, bias, GptStage::n(rows), static_cast<int>(n));
  }
  // dX (rows x k) = dY (rows x n) W^T
  static void linear_dx(const float* dY, const float* W, float* dX, std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::no, T_::yes, static_cast<int>(rows), static_cast<int>(k), static_cast<int>(n), 1.0f, dY,
                static_cast<int>(n), W, static_cast<int>(n), 0.0f, dX, static_cast<int>(k));
  }
  // dW (k x n) += X^T dY ; db += colsum dY
  static void linear_dw(const backend::CpuContext& ctx, const float* X, const float* dY, float* dW, float* db,
                        std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::yes, T_::no, static_cast<int>(k), static_cast<int>(n), static_cast<int>(rows), 1.0f, X,
                static_cast<int>(k), dY, static_cast<int>(n), 1.0f, dW, static_cast<int>(n));
    if (db) ops::bias_grad(ctx, dY, db, GptStage::n(rows), static_cast<int>(n));
  }

  /// The microbatch's documents and every token's position in its document (docs_, pos_):
  /// one document a row, or the rows' offsets when packed.
  void documents(const Microbatch& mb) {
    microbatch_documents(c_.packed ? mb.input<std::int32_t>(document_offsets_input) : nullptr,
                         static_cast<std::size_t>(mb.shape.batch), mb.shape.seq, docs_, pos_);
  }

  /// Causal attention's shape and the packed [q | k | v] rows' strides.
  ops::AttentionShape attention_shape(MicrobatchShape sh) const {
    return {.batch = sh.batch, .seq = sh.seq, .heads = c_.heads, .kv_heads = 0, .head_dim = h_ / c_.heads};
  }
  ops::AttentionStrides qkv_strides() const {
    const long long H = n(h());
    return {.q = 3 * H, .k = 3 * H, .v = 3 * H, .out = H};
  }

  void block_forward(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* bp, float* out) {
    const std::size_t T = tokens(mb.shape), H = h();
    BlockView v = view(bp, mb.shape);
    BlockParams w = block(params_, i);
    std::vector<float>& s = ws(6 * T * H);
    float* a1 = c_.recompute ? s.data() : v.a1;
    float* tmp = s.data() + T * H;                // (T, h) projection outputs
    float* g = c_.recompute ? tmp + T * H : v.g;  // (T, 4h)
    ops::layernorm_forward(ctx, v.x, w.ln1g, w.ln1b, a1, v.stats, n(T), h_);
    linear(ctx, a1, w.wqkv, w.bqkv, v.qkv, T, H, 3 * H);
    ops::attention_forward(ctx, v.qkv, v.qkv + H, v.qkv + 2 * H, v.att, v.lse, attention_shape(mb.shape), docs_,
                           qkv_strides());
    linear(ctx, v.att, w.wo, w.bo, tmp, T, H, H);
    residual_dropout(ctx, v.x1, v.x, tmp, drop_seed(mb, i, 0), v.m1, T * H, dropout(mb));
    float* a2 = c_.recompute ? s.data() : v.a2;
    ops::layernorm_forward(ctx, v.x1, w.ln2g, w.ln2b, a2, v.stats + 2 * T, n(T), h_);
    linear(ctx, a2, w.wfc, w.bfc, v.f, T, H, 4 * H);
    ops::gelu_forward(ctx, v.f, g, n(4 * T * H));
    linear(ctx, g, w.wpr, w.bpr, tmp, T, 4 * H, H);
    residual_dropout(ctx, out, v.x1, tmp, drop_seed(mb, i, 1), v.m2, T * H, dropout(mb));
  }

  /// Dropout's probability in this pass: none when evaluating.
  float dropout(const Microbatch& mb) const { return mb.training ? c_.dropout : 0.0f; }

  /// out = x + y * dropout mask (seed); with recompute off the mask is saved to `mask` too.
  void residual_dropout(const backend::CpuContext& ctx, float* out, const float* x, const float* y,
                        ops::DropoutSeed seed, std::uint8_t* mask, std::size_t count, float p) const {
    if (c_.recompute)
      ops::residual_dropout(ctx, x, y, out, n(count), seed, p);
    else
      ops::residual_dropout_mask(ctx, x, y, out, mask, n(count), seed, p);
  }
  /// out = g * the dropout mask: regenerated from the seed, or the saved one (as the CUDA stage).
  void dropout_backward(const backend::CpuContext& ctx, const float* g, const std::uint8_t* saved_mask,
                        ops::DropoutSeed seed, float* out, std::size_t count) const {
    if (c_.recompute)
      ops::dropout_backward(ctx, g, out, n(count), seed, c_.dropout);
    else
      ops::dropout_backward_mask(ctx, g, saved_mask, out, n(count), c_.dropout);
  }

  /// grad (T,h) = dL/d(block output) in; out (T,h) = dL/d(block input).
  void block_backward_input(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* bp, float* st,
                            const float* grad, float* out) {
    const std::size_t T = tokens(mb.shape), H = h();
    BlockView v = view(bp, mb.shape);
    BlockParams w = block(params_, i);
    float* dP2 = st;
    float* dF = dP2 + T * H;
    float* dA2 = dF + 4 * T * H;
    float* dO1 = dA2 + T * H;
    float* dQKV = dO1 + T * H;
    float* dA1 = dQKV + 3 * T * H;
    // Not ws(): the caller's grad and out live there.
    float* dx1 = bwd_scratch(2 * T * H);  // (T, h) dL/dx1, then (T, h) dL/d(attention output)
    float* datt = dx1 + T * H;
    dropout_backward(ctx, grad, v.m2, drop_seed(mb, i, 1), dP2, T * H);
    linear_dx(dP2, w.wpr, dF, T, 4 * H, H);  // dG
    ops::gelu_backward(ctx, v.f, dF, n(4 * T * H));
    linear_dx(dF, w.wfc, dA2, T, H, 4 * H);
    ops::layernorm_backward(ctx, dA2, v.x1, v.stats + 2 * T, w.ln2g, dx1, n(T), h_, false);
    ops::add(ctx, dx1, grad, dx1, n(T * H));
    dropout_backward(ctx, dx1, v.m1, drop_seed(mb, i, 0), dO1, T * H);
    linear_dx(dO1, w.wo, datt, T, H, H);
    ops::attention_backward(ctx, v.qkv, v.qkv + H, v.qkv + 2 * H, v.att, datt, v.lse, dQKV, dQKV + H, dQKV + 2 * H,
                            attention_shape(mb.shape), docs_, qkv_strides());
    linear_dx(dQKV, w.wqkv, dA1, T, H, 3 * H);
    ops::layernorm_backward(ctx, dA1, v.x, v.stats, w.ln1g, out, n(T), h_, false);
    ops::add(ctx, out, dx1, out, n(T * H));
  }

  void block_backward_weight(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* bp,
                             const float* st) {
    const std::size_t T = tokens(mb.shape), H = h();
    BlockView v = view(bp, mb.shape);
    BlockParams gw = block(grads_, i);
    BlockParams w = block(params_, i);
    const float* dP2 = st;
    const float* dF = dP2 + T * H;
    const float* dA2 = dF + 4 * T * H;
    const float* dO1 = dA2 + T * H;
    const float* dQKV = dO1 + T * H;
    const float* dA1 = dQKV + 3 * T * H;
    std::vector<float>& s = ws(5 * T * H);
    float* a = s.data();   // (T, h): a1, then a2 (recomputed LayerNorm outputs)
    float* g = a + T * H;  // (T, 4h): recomputed GeLU output
    // Attention-out projection and MLP output projection.
    linear_dw(ctx, v.att, dO1, gw.wo, gw.bo, T, H, H);
    const float* gsrc = v.g;
    if (c_.recompute) {
      ops::gelu_forward(ctx, v.f, g, n(4 * T * H));
      gsrc = g;
    }
    linear_dw(ctx, gsrc, dP2, gw.wpr, gw.bpr, T, 4 * H, H);
    const float* a2 = v.a2;
    if (c_.recompute) {
      ops::layernorm_recompute(ctx, v.x1, v.stats + 2 * T, w.ln2g, w.ln2b, a, n(T), h_);
      a2 = a;
    }
    linear_dw(ctx, a2, dF, gw.wfc, gw.bfc, T, H, 4 * H);
    ops::layernorm_weight_grad(ctx, dA2, v.x1, v.stats + 2 * T, gw.ln2g, gw.ln2b, n(T), h_);
    const float* a1 = v.a1;
    if (c_.recompute) {
      ops::layernorm_recompute(ctx, v.x, v.stats, w.ln1g, w.ln1b, a, n(T), h_);
      a1 = a;
    }
    linear_dw(ctx, a1, dQKV, gw.wqkv, gw.bqkv, T, H, 3 * H);
    ops::layernorm_weight_grad(ctx, dA1, v.x, v.stats, gw.ln1g, gw.ln1b, n(T), h_);
  }

  float* bwd_scratch(std::size_t count) {
    if (bwd_.size() < count) bwd_.resize(count);
    return bwd_.data();
  }

  // ---- head ----------------------------------------------------------------------------------
  float head_forward(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* hp) {
    const std::size_t T = tokens(mb.shape), H = h();
    float* x = head_x(hp);
    float* stats = x + T * H;
    float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_);
    std::vector<float>& s = ws(T * H + T * V() + T);
    float* a = s.data();
    float* logits = a + T * H;
    float* losses = logits + T * V();
    ops::layernorm_forward(ctx, x, p.lnfg, p.lnfb, a, stats, n(T), h_);
    if (dims_.tied) {  // logits = a W^T + b, W (V, h)
      blas::sgemm(T_::no, T_::yes, static_cast<int>(T), static_cast<int>(V()), static_cast<int>(H), 1.0f, a,
                  static_cast<int>(H), p.w, static_cast<int>(H), 0.0f, logits, static_cast<int>(V()));
      ops::add_bias(ctx, logits, p.b, n(T), c_.vocab);
    } else {
      linear(ctx, a, p.w, p.b, logits, T, H, V());
    }
    ops::cross_entropy(ctx, logits, mb.input<std::int32_t>("targets"), losses, dlogits, n(T), c_.vocab,
                       mb.loss_scale / static_cast<float>(T));
    // The mean in double, rows in order (ops::mean sums in float, as the CUDA stage does).
    double loss = 0;
    for (std::size_t t = 0; t < T; ++t) loss += losses[t];
    return static_cast<float>(loss / static_cast<double>(T));
  }

  void head_backward_input(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* hp, float* st, float* dx) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(hp);
    const float* stats = x + T * H;
    const float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_);
    float* da = st;  // (T, h) stashed for the LayerNorm weight gradients
    if (dims_.tied)
      linear(ctx, dlogits, p.w, nullptr, da, T, V(), H);  // da = dlogits W, W (V, h)
    else
      linear_dx(dlogits, p.w, da, T, H, V());
    ops::layernorm_backward(ctx, da, x, stats, p.lnfg, dx, n(T), h_, false);
  }

  void head_backward_weight(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* hp, const float* st) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(hp);
    const float* stats = x + T * H;
    const float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_), g = head(grads_);
    std::vector<float>& s = ws(T * H);
    ops::layernorm_recompute(ctx, x, stats, p.lnfg, p.lnfb, s.data(), n(T), h_);
    if (dims_.tied) {  // dW (V, h) += dlogits^T a
      linear_dw(ctx, dlogits, s.data(), g.w, nullptr, T, V(), H);
      ops::bias_grad(ctx, dlogits, g.b, n(T), c_.vocab);
    } else {
      linear_dw(ctx, s.data(), dlogits, g.w, g.b, T, H, V());
    }
    ops::layernorm_weight_grad(ctx, st, x, stats, g.lnfg, g.lnfb, n(T), h_);
  }

  GptConfig c_;
  int stage_, stages_;
  GptDims dims_{};
  GptStageParams layout_{};
  int first_ = 0, count_ = 0, h_ = 0;
  std::vector<float> params_, grads_;
  std::vector<float> scratch_, bwd_;
  std::vector<Document> docs_;     // the microbatch's documents (documents())
  std::vector<std::int32_t> pos_;  // each token's position in its document
};

static_assert(layer_for<GptStage, backend::CpuContext>,
              "GptStage must model po::layer_for<GptStage, backend::CpuContext>.");

}  // namespace pipeoffload::gpt
