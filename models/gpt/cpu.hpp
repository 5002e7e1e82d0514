// models/gpt/cpu.hpp: the reference GPT model on the CPU, as pipeline stages (a
// po::layer_for<GptStage, backend::CpuContext>).
//
// Token + position embedding, N pre-LN transformer blocks (causal multi-head self-attention,
// GeLU MLP, residual dropout), final LayerNorm, LM head, softmax cross-entropy; fp32 on the
// CPU with GEMMs on OpenBLAS (backend/cpu/blas.hpp). A stage is a run of blocks; stage 0 also
// holds the embedding, the last stage the head. Which blocks, and where every parameter lives,
// is layout.hpp's (shared with the CUDA implementation, cuda.hpp).
//
// Split backward: B (backward_input) computes activation gradients only and stashes each
// GEMM's output gradient; W (backward_weight) turns the stash into weight gradients.
// Selective recompute: LayerNorm outputs, GeLU outputs and dropout masks are not saved but
// recomputed (masks from a counter-based seed), so a block saves x, qkv, the attention output,
// x1 and the MLP pre-activation: 10 floats per token and hidden unit, the fp32 counterpart of
// the paper's 20bsh bytes in bf16 (plus per-row LayerNorm statistics and attention
// log-sum-exps). With recompute off it also saves both LayerNorm outputs, the GeLU output
// and both masks (bytes): 16 floats + 2 bytes, the counterpart of 34bsh.
// Attention keeps no s x s matrix: backward recomputes the scores from q, k and the saved
// log-sum-exps (flash-attention style), so there is no 5as^2b term. With packed rows
// (GptConfig::packed, docs/packing.md) positions restart at every document and attention runs
// document by document.
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

#include <pipeoffload/ops/math.hpp>
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

  void forward(backend::CpuContext&, const Microbatch& mb, ConstTensor xt, Tensor yt, std::byte* saved) {
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
      const float* wpe = wte + static_cast<std::size_t>(layout_.wpe);
      const std::int32_t* tokens = mb.input<std::int32_t>("tokens");
      for (std::size_t t = 0; t < T; ++t) {
        const int tok = tokens[t];
        if (tok < 0 || tok >= c_.vocab)
          throw error("GptStage: token " + std::to_string(tok) + " at position " + std::to_string(t) +
                      " is outside [0, " + std::to_string(c_.vocab - 1) + "]");
        const std::size_t pos = pos_[t];
        for (std::size_t i = 0; i < h(); ++i)
          cur[t * h() + i] = wte[static_cast<std::size_t>(tok) * h() + i] + wpe[pos * h() + i];
      }
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
      block_forward(i, mb, bp, out);
      cur = out;
    }
    if (heads()) {
      std::byte* hp = p + count_ * block_saved(mb.shape);
      if (count_ == 0) std::memcpy(head_x(hp), cur, T * h() * sizeof(float));
      *mb.loss = head_forward(mb, hp);
      return;
    }
    if (count_ == 0 && y != nullptr) std::memcpy(y, cur, T * h() * sizeof(float));
  }

  void backward_input(backend::CpuContext&, const Microbatch& mb, ConstTensor dyt, Tensor dxt, std::byte* saved,
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
    if (heads())
      head_backward_input(mb, saved + count_ * block_saved(mb.shape), st_head, grad);
    else
      std::memcpy(grad, dy, T * h() * sizeof(float));
    for (int i = count_ - 1; i >= 0; --i) {
      block_backward_input(i, mb, saved + static_cast<std::size_t>(i) * block_saved(mb.shape),
                           st_blocks + static_cast<std::size_t>(i) * block_stash_floats(mb.shape), grad, spare);
      std::swap(grad, spare);
    }
    if (embeds())
      std::memcpy(st_embed, grad, T * h() * sizeof(float));
    else
      std::memcpy(dx, grad, T * h() * sizeof(float));
  }

  void backward_weight(backend::CpuContext&, const Microbatch& mb, std::byte* saved, std::byte* stash) {
    const std::size_t T = tokens(mb.shape);
    check_shape(mb.shape);
    const float* st = reinterpret_cast<const float*>(stash);
    const float* st_blocks = st + (embeds() ? T * h() : 0);
    const float* st_head = st_blocks + count_ * block_stash_floats(mb.shape);
    if (embeds()) {
      documents(mb);
      float* gte = grads_.data();
      float* gpe = gte + static_cast<std::size_t>(layout_.wpe);
      const std::int32_t* tokens = mb.input<std::int32_t>("tokens");
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t tok = static_cast<std::size_t>(tokens[t]), pos = pos_[t];
        for (std::size_t i = 0; i < h(); ++i) {
          gte[tok * h() + i] += st[t * h() + i];
          gpe[pos * h() + i] += st[t * h() + i];
        }
      }
    }
    for (int i = 0; i < count_; ++i)
      block_backward_weight(i, mb, saved + static_cast<std::size_t>(i) * block_saved(mb.shape),
                            st_blocks + static_cast<std::size_t>(i) * block_stash_floats(mb.shape));
    if (heads()) head_backward_weight(mb, saved + count_ * block_saved(mb.shape), st_head);
  }

 private:
  // ---- sizes -------------------------------------------------------------------------------
  std::size_t h() const { return static_cast<std::size_t>(h_); }
  std::size_t V() const { return static_cast<std::size_t>(c_.vocab); }
  static std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
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

  std::uint64_t drop_seed(const Microbatch& mb, int block, int site) const {
    return ops::dropout_seed(c_.seed, mb.step, first_ + block, site, mb.mb);
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

  /// out = LayerNorm(x) row by row; writes each row's (mean, rstd) to stats.
  void layernorm(const float* x, float* stats, const float* g, const float* b, float* out, std::size_t T) const {
    for (std::size_t t = 0; t < T; ++t) {
      const ops::RowStats st = ops::row_stats(x + t * h(), h_);
      stats[2 * t] = st.mean;
      stats[2 * t + 1] = st.rstd;
      const float* xr = x + t * h();
      elementwise(out + t * h(), h(), [&](std::size_t i) { return ops::layernorm_apply(xr[i], st, g[i], b[i]); });
    }
  }
  /// The same output recomputed from saved statistics (selective recompute).
  void relayernorm(const float* x, const float* stats, const float* g, const float* b, float* out,
                   std::size_t T) const {
    for (std::size_t t = 0; t < T; ++t) {
      const ops::RowStats st{stats[2 * t], stats[2 * t + 1]};
      const float* xr = x + t * h();
      elementwise(out + t * h(), h(), [&](std::size_t i) { return ops::layernorm_apply(xr[i], st, g[i], b[i]); });
    }
  }
  /// out[e] = f(e) for e in [0, n). g++ -O2 vectorises only loops that need neither a scalar
  /// tail nor an alias check; these fixed 16-wide loops through a local buffer need neither,
  /// so a branch-free f (ops/math.hpp's exp_approx, tanh_approx, gelu) runs on SIMD lanes. The
  /// tail calls the same f, which gives the same bits. f may read out[e]: a group is written
  /// back only after all of it is computed.
  template <class F>
  static void elementwise(float* out, std::size_t n, F&& f) {
    constexpr std::size_t w = 16;
    std::size_t i = 0;
    for (; i + w <= n; i += w) {
      float buf[w];
      for (std::size_t j = 0; j < w; ++j) buf[j] = f(i + j);
      for (std::size_t j = 0; j < w; ++j) out[i + j] = buf[j];
    }
    for (; i < n; ++i) out[i] = f(i);
  }

  static void add_bias(float* y, const float* b, std::size_t rows, std::size_t cols) {
    for (std::size_t r = 0; r < rows; ++r) {
      float* yr = y + r * cols;
      elementwise(yr, cols, [&](std::size_t c) { return yr[c] + b[c]; });
    }
  }
  static void col_sum_into(float* out, const float* x, std::size_t rows, std::size_t cols) {
    // Row by row, so each column still sums in row order.
    for (std::size_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      elementwise(out, cols, [&](std::size_t c) { return out[c] + xr[c]; });
    }
  }
  // Y (rows x n) = X (rows x k) W (k x n) [+ bias]
  static void linear(const float* X, const float* W, const float* bias, float* Y, std::size_t rows, std::size_t k,
                     std::size_t n) {
    blas::sgemm(T_::no, T_::no, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), 1.0f, X,
                static_cast<int>(k), W, static_cast<int>(n), 0.0f, Y, static_cast<int>(n));
    if (bias) add_bias(Y, bias, rows, n);
  }
  // dX (rows x k) = dY (rows x n) W^T
  static void linear_dx(const float* dY, const float* W, float* dX, std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::no, T_::yes, static_cast<int>(rows), static_cast<int>(k), static_cast<int>(n), 1.0f, dY,
                static_cast<int>(n), W, static_cast<int>(n), 0.0f, dX, static_cast<int>(k));
  }
  // dW (k x n) += X^T dY ; db += colsum dY
  static void linear_dw(const float* X, const float* dY, float* dW, float* db, std::size_t rows, std::size_t k,
                        std::size_t n) {
    blas::sgemm(T_::yes, T_::no, static_cast<int>(k), static_cast<int>(n), static_cast<int>(rows), 1.0f, X,
                static_cast<int>(k), dY, static_cast<int>(n), 1.0f, dW, static_cast<int>(n));
    if (db) col_sum_into(db, dY, rows, n);
  }

  /// The microbatch's documents and every token's position in its document (docs_, pos_):
  /// one document a row, or the rows' offsets when packed.
  void documents(const Microbatch& mb) {
    microbatch_documents(c_.packed ? mb.input<std::int32_t>(document_offsets_input) : nullptr,
                         static_cast<std::size_t>(mb.shape.batch), mb.shape.seq, docs_, pos_);
  }

  /// Causal attention of one microbatch, document by document (docs_): att = softmax(q k^T /
  /// sqrt(dh)) v per (document, head); writes the log-sum-exp of each score row for backward.
  void attention_forward(const float* qkv, float* att, float* lse, MicrobatchShape sh) {
    const std::size_t S = static_cast<std::size_t>(sh.seq), A = static_cast<std::size_t>(c_.heads), H = h(), dh = H / A;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    if (scores_.size() < S * S + S) scores_.resize(S * S + S);
    for (const Document& doc : docs_)
      for (std::size_t a = 0; a < A; ++a) {
        const std::size_t L = doc.length, first = doc.row * S + doc.begin;
        float* P = scores_.data();
        float* ex = P + L * L;  // (L) exp(s - max) of one score row
        const float* q = qkv + first * 3 * H + a * dh;
        const float* k = q + H;
        const float* v = q + 2 * H;
        blas::sgemm(T_::no, T_::yes, static_cast<int>(L), static_cast<int>(L), static_cast<int>(dh), scale, q,
                    static_cast<int>(3 * H), k, static_cast<int>(3 * H), 0.0f, P, static_cast<int>(L));
        float* l = lse + (doc.row * A + a) * S + doc.begin;
        for (std::size_t i = 0; i < L; ++i) {
          float* row = P + i * L;
          float mx = row[0];
          for (std::size_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
          elementwise(ex, i + 1, [&](std::size_t j) { return ops::exp_approx(row[j] - mx); });
          float sum = 0;
          for (std::size_t j = 0; j <= i; ++j) sum += ex[j];  // in index order: the same sum on every run
          const float li = mx + std::log(sum);
          l[i] = li;
          // exp(s - lse), as backward recomputes it, rather than ex / sum: the same P both ways.
          elementwise(row, i + 1, [&](std::size_t j) { return ops::exp_approx(row[j] - li); });
          for (std::size_t j = i + 1; j < L; ++j) row[j] = 0.0f;
        }
        blas::sgemm(T_::no, T_::no, static_cast<int>(L), static_cast<int>(dh), static_cast<int>(L), 1.0f, P,
                    static_cast<int>(L), v, static_cast<int>(3 * H), 0.0f, att + first * H + a * dh,
                    static_cast<int>(H));
      }
  }

  /// dqkv from datt, document by document, recomputing the probabilities from q, k and the
  /// log-sum-exps.
  void attention_backward(const float* qkv, const float* att, const float* lse, const float* datt, float* dqkv,
                          MicrobatchShape sh) {
    const std::size_t S = static_cast<std::size_t>(sh.seq), A = static_cast<std::size_t>(c_.heads), H = h(), dh = H / A;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    if (scores_.size() < 2 * S * S) scores_.resize(2 * S * S);
    for (const Document& doc : docs_)
      for (std::size_t a = 0; a < A; ++a) {
        const std::size_t L = doc.length, first = doc.row * S + doc.begin;
        const int n = static_cast<int>(L), ld = static_cast<int>(3 * H);
        float* P = scores_.data();
        float* dP = P + L * L;
        const float* q = qkv + first * 3 * H + a * dh;
        const float* k = q + H;
        const float* v = q + 2 * H;
        float* dq = dqkv + first * 3 * H + a * dh;
        float* dk = dq + H;
        float* dv = dq + 2 * H;
        const float* o = att + first * H + a * dh;
        const float* dO = datt + first * H + a * dh;
        const float* l = lse + (doc.row * A + a) * S + doc.begin;
        blas::sgemm(T_::no, T_::yes, n, n, static_cast<int>(dh), scale, q, ld, k, ld, 0.0f, P, n);
        for (std::size_t i = 0; i < L; ++i) {
          float* row = P + i * L;
          const float li = l[i];
          elementwise(row, i + 1, [&](std::size_t j) { return ops::exp_approx(row[j] - li); });
          for (std::size_t j = i + 1; j < L; ++j) row[j] = 0.0f;
        }
        // dP = dO v^T ; dS = P (dP - rowsum(dO o)) ; dv = P^T dO ; dq = dS k scale ; dk = dS^T q scale
        blas::sgemm(T_::no, T_::yes, n, n, static_cast<int>(dh), 1.0f, dO, static_cast<int>(H), v, ld, 0.0f, dP, n);
        for (std::size_t i = 0; i < L; ++i) {
          float D = 0;
          for (std::size_t e = 0; e < dh; ++e) D += dO[i * H + e] * o[i * H + e];
          const float* prow = P + i * L;
          float* drow = dP + i * L;
          elementwise(drow, i + 1, [&](std::size_t j) { return prow[j] * (drow[j] - D); });
          for (std::size_t j = i + 1; j < L; ++j) drow[j] = 0.0f;
        }
        blas::sgemm(T_::yes, T_::no, n, static_cast<int>(dh), n, 1.0f, P, n, dO, static_cast<int>(H), 0.0f, dv, ld);
        blas::sgemm(T_::no, T_::no, n, static_cast<int>(dh), n, scale, dP, n, k, ld, 0.0f, dq, ld);
        blas::sgemm(T_::yes, T_::no, n, static_cast<int>(dh), n, scale, dP, n, q, ld, 0.0f, dk, ld);
      }
  }

  void block_forward(int i, const Microbatch& mb, std::byte* bp, float* out) {
    const std::size_t T = tokens(mb.shape), H = h();
    BlockView v = view(bp, mb.shape);
    BlockParams w = block(params_, i);
    std::vector<float>& s = ws(6 * T * H);
    float* a1 = c_.recompute ? s.data() : v.a1;
    float* tmp = s.data() + T * H;                // (T, h) projection outputs
    float* g = c_.recompute ? tmp + T * H : v.g;  // (T, 4h)
    layernorm(v.x, v.stats, w.ln1g, w.ln1b, a1, T);
    linear(a1, w.wqkv, w.bqkv, v.qkv, T, H, 3 * H);
    attention_forward(v.qkv, v.att, v.lse, mb.shape);
    linear(v.att, w.wo, w.bo, tmp, T, H, H);
    const std::uint64_t s1 = drop_seed(mb, i, 0), s2 = drop_seed(mb, i, 1);
    residual_dropout(v.x1, v.x, tmp, s1, v.m1, T * H, dropout(mb));
    float* a2 = c_.recompute ? s.data() : v.a2;
    layernorm(v.x1, v.stats + 2 * T, w.ln2g, w.ln2b, a2, T);
    linear(a2, w.wfc, w.bfc, v.f, T, H, 4 * H);
    elementwise(g, 4 * T * H, [&](std::size_t e) { return ops::gelu(v.f[e]); });
    linear(g, w.wpr, w.bpr, tmp, T, 4 * H, H);
    residual_dropout(out, v.x1, tmp, s2, v.m2, T * H, dropout(mb));
  }

  /// Dropout's probability in this pass: none when evaluating.
  float dropout(const Microbatch& mb) const { return mb.training ? c_.dropout : 0.0f; }

  /// out = x + y * dropout mask (seed); with recompute off the mask is saved to `mask` too.
  void residual_dropout(float* out, const float* x, const float* y, std::uint64_t seed, std::uint8_t* mask,
                        std::size_t n, float p) const {
    if (c_.recompute) {
      elementwise(out, n, [&](std::size_t e) { return ops::residual_dropout(x[e], y[e], seed, e, p); });
      return;
    }
    for (std::size_t e = 0; e < n; ++e) {
      const float k = ops::dropout_scale(seed, e, p);
      mask[e] = k != 0.0f;
      out[e] = x[e] + y[e] * k;
    }
  }

  float mask_scale(const std::uint8_t* saved_mask, std::uint64_t seed, std::size_t e) const {
    if (c_.dropout <= 0.0f) return 1.0f;
    if (!c_.recompute) return ops::dropout_mask_scale(saved_mask[e] != 0, c_.dropout);  // as the CUDA stage
    return ops::dropout_scale(seed, e, c_.dropout);
  }

  /// grad (T,h) = dL/d(block output) in; out (T,h) = dL/d(block input).
  void block_backward_input(int i, const Microbatch& mb, std::byte* bp, float* st, const float* grad, float* out) {
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
    const std::uint64_t s1 = drop_seed(mb, i, 0), s2 = drop_seed(mb, i, 1);
    for (std::size_t e = 0; e < T * H; ++e) dP2[e] = grad[e] * mask_scale(v.m2, s2, e);
    linear_dx(dP2, w.wpr, dF, T, 4 * H, H);  // dG
    elementwise(dF, 4 * T * H, [&](std::size_t e) { return dF[e] * ops::gelu_grad(v.f[e]); });
    linear_dx(dF, w.wfc, dA2, T, H, 4 * H);
    for (std::size_t t = 0; t < T; ++t) {
      const ops::RowStats st2{v.stats[2 * T + 2 * t], v.stats[2 * T + 2 * t + 1]};
      ops::layernorm_backward_row(dA2 + t * H, v.x1 + t * H, st2, w.ln2g, dx1 + t * H, h_);
    }
    for (std::size_t e = 0; e < T * H; ++e) {
      dx1[e] += grad[e];
      dO1[e] = dx1[e] * mask_scale(v.m1, s1, e);
    }
    linear_dx(dO1, w.wo, datt, T, H, H);
    attention_backward(v.qkv, v.att, v.lse, datt, dQKV, mb.shape);
    linear_dx(dQKV, w.wqkv, dA1, T, H, 3 * H);
    for (std::size_t t = 0; t < T; ++t) {
      const ops::RowStats st1{v.stats[2 * t], v.stats[2 * t + 1]};
      ops::layernorm_backward_row(dA1 + t * H, v.x + t * H, st1, w.ln1g, out + t * H, h_);
    }
    for (std::size_t e = 0; e < T * H; ++e) out[e] += dx1[e];
  }

  void block_backward_weight(int i, const Microbatch& mb, std::byte* bp, const float* st) {
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
    linear_dw(v.att, dO1, gw.wo, gw.bo, T, H, H);
    const float* gsrc = v.g;
    if (c_.recompute) {
      elementwise(g, 4 * T * H, [&](std::size_t e) { return ops::gelu(v.f[e]); });
      gsrc = g;
    }
    linear_dw(gsrc, dP2, gw.wpr, gw.bpr, T, 4 * H, H);
    const float* a2 = v.a2;
    if (c_.recompute) {
      relayernorm(v.x1, v.stats + 2 * T, w.ln2g, w.ln2b, a, T);
      a2 = a;
    }
    linear_dw(a2, dF, gw.wfc, gw.bfc, T, H, 4 * H);
    ln_weight_grads(v.x1, v.stats + 2 * T, dA2, gw.ln2g, gw.ln2b, T);
    const float* a1 = v.a1;
    if (c_.recompute) {
      relayernorm(v.x, v.stats, w.ln1g, w.ln1b, a, T);
      a1 = a;
    }
    linear_dw(a1, dQKV, gw.wqkv, gw.bqkv, T, H, 3 * H);
    ln_weight_grads(v.x, v.stats, dA1, gw.ln1g, gw.ln1b, T);
  }

  void ln_weight_grads(const float* x, const float* stats, const float* dy, float* gg, float* gb, std::size_t T) const {
    for (std::size_t t = 0; t < T; ++t) {
      const float mean = stats[2 * t], rstd = stats[2 * t + 1];
      const float* dyr = dy + t * h();
      const float* xr = x + t * h();
      elementwise(gg, h(), [&](std::size_t i) { return gg[i] + dyr[i] * (xr[i] - mean) * rstd; });
      elementwise(gb, h(), [&](std::size_t i) { return gb[i] + dyr[i]; });
    }
  }

  float* bwd_scratch(std::size_t n) {
    if (bwd_.size() < n) bwd_.resize(n);
    return bwd_.data();
  }

  // ---- head ----------------------------------------------------------------------------------
  float head_forward(const Microbatch& mb, std::byte* hp) {
    const std::size_t T = tokens(mb.shape), H = h();
    float* x = head_x(hp);
    float* stats = x + T * H;
    float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_);
    std::vector<float>& s = ws(T * H + T * V());
    float* a = s.data();
    float* logits = a + T * H;
    layernorm(x, stats, p.lnfg, p.lnfb, a, T);
    if (dims_.tied) {  // logits = a W^T + b, W (V, h)
      blas::sgemm(T_::no, T_::yes, static_cast<int>(T), static_cast<int>(V()), static_cast<int>(H), 1.0f, a,
                  static_cast<int>(H), p.w, static_cast<int>(H), 0.0f, logits, static_cast<int>(V()));
      add_bias(logits, p.b, T, V());
    } else {
      linear(a, p.w, p.b, logits, T, H, V());
    }
    double loss = 0;
    const float scale = mb.loss_scale / static_cast<float>(T);
    const std::int32_t* targets = mb.input<std::int32_t>("targets");
    for (std::size_t t = 0; t < T; ++t) {
      const int tgt = targets[t];
      if (tgt < 0 || tgt >= c_.vocab)
        throw error("GptStage: target " + std::to_string(tgt) + " at position " + std::to_string(t) +
                    " is outside [0, " + std::to_string(c_.vocab - 1) + "]");
      loss += ops::softmax_xent_row(logits + t * V(), c_.vocab, tgt, scale, dlogits + t * V());
    }
    return static_cast<float>(loss / static_cast<double>(T));
  }

  void head_backward_input(const Microbatch& mb, std::byte* hp, float* st, float* dx) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(hp);
    const float* stats = x + T * H;
    const float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_);
    float* da = st;  // (T, h) stashed for the LayerNorm weight gradients
    if (dims_.tied)
      linear(dlogits, p.w, nullptr, da, T, V(), H);  // da = dlogits W, W (V, h)
    else
      linear_dx(dlogits, p.w, da, T, H, V());
    for (std::size_t t = 0; t < T; ++t)
      ops::layernorm_backward_row(da + t * H, x + t * H, {stats[2 * t], stats[2 * t + 1]}, p.lnfg, dx + t * H, h_);
  }

  void head_backward_weight(const Microbatch& mb, std::byte* hp, const float* st) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(hp);
    const float* stats = x + T * H;
    const float* dlogits = stats + 2 * T;
    const HeadParams p = head(params_), g = head(grads_);
    std::vector<float>& s = ws(T * H);
    relayernorm(x, stats, p.lnfg, p.lnfb, s.data(), T);
    if (dims_.tied) {  // dW (V, h) += dlogits^T a
      linear_dw(dlogits, s.data(), g.w, nullptr, T, V(), H);
      col_sum_into(g.b, dlogits, T, V());
    } else {
      linear_dw(s.data(), dlogits, g.w, g.b, T, H, V());
    }
    ln_weight_grads(x, stats, st, g.lnfg, g.lnfb, T);
  }

  GptConfig c_;
  int stage_, stages_;
  GptDims dims_{};
  GptStageParams layout_{};
  int first_ = 0, count_ = 0, h_ = 0;
  std::vector<float> params_, grads_;
  std::vector<float> scratch_, bwd_, scores_;
  std::vector<Document> docs_;    // the microbatch's documents (documents())
  std::vector<std::size_t> pos_;  // each token's position in its document
};

static_assert(layer_for<GptStage, backend::CpuContext>,
              "GptStage must model po::layer_for<GptStage, backend::CpuContext>.");

}  // namespace pipeoffload::gpt
