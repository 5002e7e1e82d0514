// models/llama/cpu.hpp: the Llama-class reference model on the CPU, as pipeline stages (a
// po::layer_for<LlamaStage, backend::CpuContext>): fp32, GEMMs on OpenBLAS, the rest po::ops
// (pipeoffload/ops/cpu.hpp), the layout layout.hpp's. What a block saves, stashes and
// recomputes, and how packed rows restart positions: docs/llama.md.
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
#include <pipeoffload/ops/cpu.hpp>  // the ops, and ops/math.hpp (exp_approx, mix64)
#include <pipeoffload/packing.hpp>

#include "layout.hpp"

namespace pipeoffload::llama {

/// The CPU stage's per-microbatch buffers, from its dims alone (what LlamaStage lays out and a
/// launcher sizes memory with).
namespace cpu_bytes {

inline std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
/// One block's saved floats per token: x, q (h each) | k, v (kv each) | att, x1 (h each) |
/// gate, up (f each) | two reciprocal RMS | a log-sum-exp per head.
inline std::size_t block_saved(const LlamaDims& d, MicrobatchShape sh) {
  const std::size_t per = static_cast<std::size_t>(4 * d.hidden + 2 * d.kv_width() + 2 * d.ffn + 2 + d.heads);
  return (tokens(sh) * per * sizeof(float) + 63) / 64 * 64;
}
/// One block's stash floats: dy, (dgate, dup: f each), da2, dx1, dq (h each), dk, dv (kv
/// each), da1 (h).
inline std::size_t block_stash_floats(const LlamaDims& d, MicrobatchShape sh) {
  return tokens(sh) * static_cast<std::size_t>(5 * d.hidden + 2 * d.ffn + 2 * d.kv_width());
}
/// The head's saved region: x (T, h) | reciprocal RMS (T) | dlogits (T, V).
inline std::size_t head_saved(const LlamaDims& d, MicrobatchShape sh) {
  return tokens(sh) * static_cast<std::size_t>(d.hidden + 1 + d.vocab) * sizeof(float);
}
/// The stage's activation unit (layer::saved_bytes).
inline std::size_t saved(const LlamaDims& d, MicrobatchShape sh) {
  return static_cast<std::size_t>(d.blocks) * block_saved(d, sh) + (d.has_head ? head_saved(d, sh) : 0);
}
/// The activation unit's parts (layer::saved_parts): the head's region, then each block's, last to first.
inline std::vector<SavedPart> saved_parts(const LlamaDims& d, MicrobatchShape sh) {
  return stacked_saved_parts(d.blocks, block_saved(d, sh), d.has_head ? head_saved(d, sh) : 0);
}
/// The stage's B-to-W stash (layer::stash_bytes): the embedding's and the head's (T, h) and each block's.
inline std::size_t stash(const LlamaDims& d, MicrobatchShape sh) {
  const std::size_t Th = tokens(sh) * static_cast<std::size_t>(d.hidden);
  return ((d.embeds ? Th : 0) + static_cast<std::size_t>(d.blocks) * block_stash_floats(d, sh) +
          (d.has_head ? Th : 0)) *
         sizeof(float);
}

}  // namespace cpu_bytes

/// Stage `stage` of S: blocks [first, first + count) of the model, with the embedding when
/// stage == 0 and the head when stage == S-1.
class LlamaStage {
 public:
  LlamaStage(const LlamaConfig& cfg, int stage, int stages)
      : c_(cfg), rope_(cfg.seq, cfg.hidden / cfg.heads, cfg.rope_theta) {
    d_ = llama_dims(cfg, stage, stages);
    p_ = llama_stage_params(d_);
    const std::size_t n = static_cast<std::size_t>(p_.total);
    params_.resize(n);
    grads_.assign(n, 0.0f);
    init();
  }

  // ---- po::layer -----------------------------------------------------------------------

  Boundary input_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), DType::float32}; }
  Boundary output_boundary(MicrobatchShape sh) const { return {tokens(sh) * h(), DType::float32}; }
  std::vector<InputSpec> inputs(MicrobatchShape sh) const { return llama_inputs(d_, sh); }
  std::size_t saved_bytes(MicrobatchShape sh) const { return cpu_bytes::saved(d_, sh); }
  std::size_t stash_bytes(MicrobatchShape sh) const { return cpu_bytes::stash(d_, sh); }
  /// The saved buffer in backward_input's reading order: the head's region, then the blocks'
  /// last to first (each awaited just before its backward reads it).
  std::vector<SavedPart> saved_parts(MicrobatchShape sh) const { return cpu_bytes::saved_parts(d_, sh); }
  std::span<float> parameters() { return params_; }
  std::span<float> gradients() { return grads_; }
  std::vector<std::size_t> norm_groups() const { return llama_norm_groups(d_); }
  std::vector<ParamInfo> parameter_info() const { return llama_parameter_info(d_); }
  std::vector<SharedParam> shared_parameters() const { return llama_shared_parameters(d_); }
  std::string name() const { return "llama::LlamaStage"; }
  /// Its calls may be captured and replayed (RuntimeOptions::graphs): it reads no step.
  bool capturable() const { return true; }
  /// This stage's dims (sizes and place in the model).
  const LlamaDims& dims() const { return d_; }

  void forward(backend::CpuContext& ctx, const Microbatch& mb, ConstTensor xt, Tensor yt, std::byte* saved) {
    const std::size_t T = tokens(mb.shape);
    check_shape(mb.shape);
    std::vector<float>& tmp = ws(T * h());
    float* cur = d_.blocks > 0 ? view(saved, 0, mb.shape).x : tmp.data();
    if (d_.blocks > 0) documents(mb);
    if (d_.embeds) {
      ops::embedding_forward(ctx, mb.input<std::int32_t>("tokens"), params_.data(), cur, n(T), n(h()), c_.vocab);
    } else {
      std::memcpy(cur, xt.as<float>(), T * h() * sizeof(float));
    }
    for (int i = 0; i < d_.blocks; ++i) {
      float* out = nullptr;
      if (i + 1 < d_.blocks)
        out = view(saved, i + 1, mb.shape).x;
      else if (d_.has_head)
        out = head_x(saved, mb.shape);
      else
        out = yt.as<float>();
      block_forward(ctx, i, mb, saved, out);
      cur = out;
    }
    if (d_.has_head) {
      if (d_.blocks == 0) std::memcpy(head_x(saved, mb.shape), cur, T * h() * sizeof(float));
      *mb.loss = head_forward(ctx, mb, saved);
      return;
    }
    if (d_.blocks == 0) std::memcpy(yt.as<float>(), cur, T * h() * sizeof(float));
  }

  void backward_input(backend::CpuContext& ctx, const Microbatch& mb, ConstTensor dyt, Tensor dxt, std::byte* saved,
                      std::byte* stash) {
    const std::size_t T = tokens(mb.shape);
    check_shape(mb.shape);
    float* st = reinterpret_cast<float*>(stash);
    std::vector<float>& g = ws(2 * T * h());
    float* grad = g.data();
    float* spare = grad + T * h();
    if (d_.blocks > 0) documents(mb);
    int part = 0;  // the next of saved_parts() to await
    if (d_.has_head) {
      mb.await_saved(part++);
      head_backward_input(ctx, mb, saved, head_stash(st, mb.shape), grad);
    } else {
      std::memcpy(grad, dyt.as<float>(), T * h() * sizeof(float));
    }
    const int per = blocks_per_saved_part(d_.blocks, d_.has_head);
    for (int i = d_.blocks - 1; i >= 0; --i) {
      if ((d_.blocks - 1 - i) % per == 0) mb.await_saved(part++);  // a part's last block comes first
      block_backward_input(ctx, i, mb, saved, block_stash(st, i, mb.shape), grad, spare);
      std::swap(grad, spare);
    }
    if (d_.embeds)
      std::memcpy(st, grad, T * h() * sizeof(float));
    else
      std::memcpy(dxt.as<float>(), grad, T * h() * sizeof(float));
  }

  void backward_weight(backend::CpuContext& ctx, const Microbatch& mb, std::byte* saved, std::byte* stash) {
    const std::size_t T = tokens(mb.shape);
    check_shape(mb.shape);
    float* st = reinterpret_cast<float*>(stash);
    if (d_.embeds)
      ops::embedding_backward(ctx, mb.input<std::int32_t>("tokens"), st, grads_.data(), n(T), n(h()), c_.vocab);
    for (int i = 0; i < d_.blocks; ++i) block_backward_weight(ctx, i, mb, saved, block_stash(st, i, mb.shape));
    if (d_.has_head) head_backward_weight(ctx, mb, saved, head_stash(st, mb.shape));
  }

 private:
  using T_ = blas::Trans;

  // ---- sizes and views ---------------------------------------------------------------------
  std::size_t h() const { return static_cast<std::size_t>(d_.hidden); }
  std::size_t V() const { return static_cast<std::size_t>(d_.vocab); }
  std::size_t hd() const { return static_cast<std::size_t>(d_.head_dim()); }
  std::size_t kv() const { return static_cast<std::size_t>(d_.kv_width()); }
  std::size_t f() const { return static_cast<std::size_t>(d_.ffn); }
  std::size_t A() const { return static_cast<std::size_t>(d_.heads); }
  static std::size_t tokens(MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }
  /// A count as the ops take it.
  static int n(std::size_t x) { return static_cast<int>(x); }
  void check_shape(MicrobatchShape sh) const {
    if (sh.seq > c_.seq)
      throw shape_error("LlamaStage: microbatch seq = " + std::to_string(sh.seq) +
                        " is longer than the model's seq = " + std::to_string(c_.seq));
  }

  struct BlockView {
    float *x, *q, *k, *v, *att, *x1, *gate, *up, *rstd, *lse;
  };
  BlockView view(std::byte* saved, int i, MicrobatchShape sh) const {
    const std::size_t T = tokens(sh);
    BlockView b{};
    b.x = reinterpret_cast<float*>(saved + static_cast<std::size_t>(i) * cpu_bytes::block_saved(d_, sh));
    b.q = b.x + T * h();
    b.k = b.q + T * h();
    b.v = b.k + T * kv();
    b.att = b.v + T * kv();
    b.x1 = b.att + T * h();
    b.gate = b.x1 + T * h();
    b.up = b.gate + T * f();
    b.rstd = b.up + T * f();  // (T) before attention, (T) before the MLP
    b.lse = b.rstd + 2 * T;   // (batch, heads, seq)
    return b;
  }
  float* head_x(std::byte* saved, MicrobatchShape sh) const {
    return reinterpret_cast<float*>(saved + static_cast<std::size_t>(d_.blocks) * cpu_bytes::block_saved(d_, sh));
  }
  float* block_stash(float* st, int i, MicrobatchShape sh) const {
    return st + (d_.embeds ? tokens(sh) * h() : 0) +
           static_cast<std::size_t>(i) * cpu_bytes::block_stash_floats(d_, sh);
  }
  float* head_stash(float* st, MicrobatchShape sh) const { return block_stash(st, d_.blocks, sh); }

  struct BlockParams {
    float *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w3, *w2;
  };
  BlockParams block(std::vector<float>& store, int i) const {
    float* p = store.data() + p_.block_begin(i);
    const LlamaBlockParams& o = p_.block;
    return {p + o.attn_norm, p + o.wq, p + o.wk, p + o.wv, p + o.wo, p + o.ffn_norm, p + o.w1, p + o.w3, p + o.w2};
  }

  std::vector<float>& ws(std::size_t n) {
    if (scratch_.size() < n) scratch_.resize(n);
    return scratch_;
  }
  float* bwd_scratch(std::size_t n) {
    if (bwd_.size() < n) bwd_.resize(n);
    return bwd_.data();
  }

  // Every tensor is seeded by its global position (embedding, block, head), so the model is the
  // same however it is cut into stages; norm weights start at 1.
  void init() {
    const auto fill = [](float* p, std::size_t n, std::uint64_t seed, float scale) {
      for (std::size_t i = 0; i < n; ++i) {
        const double u1 = (static_cast<double>(ops::mix64(seed, 2 * i) >> 11) + 1.0) / 9007199254740993.0;
        const double u2 = static_cast<double>(ops::mix64(seed, 2 * i + 1) >> 11) / 9007199254740992.0;
        p[i] = static_cast<float>(scale * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
      }
    };
    const float std_w = 0.02f, std_res = 0.02f / std::sqrt(2.0f * static_cast<float>(c_.layers));
    if (d_.embeds) fill(params_.data(), V() * h(), ops::mix64(c_.seed, 2000001), std_w);
    for (int i = 0; i < d_.blocks; ++i) {
      const BlockParams b = block(params_, i);
      const std::uint64_t s = ops::mix64(c_.seed, 3000000 + static_cast<std::uint64_t>(d_.first_block + i));
      std::fill(b.attn_norm, b.attn_norm + h(), 1.0f);
      std::fill(b.ffn_norm, b.ffn_norm + h(), 1.0f);
      fill(b.wq, h() * h(), ops::mix64(s, 1), std_w);
      fill(b.wk, h() * kv(), ops::mix64(s, 2), std_w);
      fill(b.wv, h() * kv(), ops::mix64(s, 3), std_w);
      fill(b.wo, h() * h(), ops::mix64(s, 4), std_res);
      fill(b.w1, h() * f(), ops::mix64(s, 5), std_w);
      fill(b.w3, h() * f(), ops::mix64(s, 6), std_w);
      fill(b.w2, f() * h(), ops::mix64(s, 7), std_res);
    }
    if (d_.has_head) {
      float* p = params_.data() + p_.head_begin;
      std::fill(p, p + h(), 1.0f);
      // Tied: the embedding's values, (V, h) (the runtime starts every holder from stage 0's).
      fill(p + p_.head_w, V() * h(), ops::mix64(c_.seed, d_.tied ? 2000001 : 2000002), std_w);
    }
  }

  // ---- pieces ------------------------------------------------------------------------------

  // Y (rows x n) = X (rows x k) W (k x n)
  static void linear(const float* X, const float* W, float* Y, std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::no, T_::no, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), 1.0f, X,
                static_cast<int>(k), W, static_cast<int>(n), 0.0f, Y, static_cast<int>(n));
  }
  // dX (rows x k) (+)= dY (rows x n) W^T
  static void linear_dx(const float* dY, const float* W, float* dX, std::size_t rows, std::size_t k, std::size_t n,
                        float beta = 0.0f) {
    blas::sgemm(T_::no, T_::yes, static_cast<int>(rows), static_cast<int>(k), static_cast<int>(n), 1.0f, dY,
                static_cast<int>(n), W, static_cast<int>(n), beta, dX, static_cast<int>(k));
  }
  // dW (k x n) += X^T dY
  static void linear_dw(const float* X, const float* dY, float* dW, std::size_t rows, std::size_t k, std::size_t n) {
    blas::sgemm(T_::yes, T_::no, static_cast<int>(k), static_cast<int>(n), static_cast<int>(rows), 1.0f, X,
                static_cast<int>(k), dY, static_cast<int>(n), 1.0f, dW, static_cast<int>(n));
  }

  /// The microbatch's documents and every token's position in its document (docs_, pos_):
  /// one document a row, or the rows' offsets when packed.
  void documents(const Microbatch& mb) {
    microbatch_documents(d_.packed ? mb.input<std::int32_t>(document_offsets_input) : nullptr,
                         static_cast<std::size_t>(mb.shape.batch), mb.shape.seq, docs_, pos_);
  }

  /// Rotates each head's pairs of the (T, width) rows by their positions' angles (pos_);
  /// `inverse` rotates back (the backward of a rotation is its inverse).
  void rope(const backend::CpuContext& ctx, float* x, std::size_t width, MicrobatchShape sh, bool inverse) const {
    ops::rope(ctx, x, pos_.data(), n(tokens(sh)), n(width), rope_, inverse);
  }

  /// Causal grouped-query attention of one microbatch, document by document (docs_), on the
  /// block's separate q, k and v rows.
  ops::AttentionShape attention_shape(MicrobatchShape sh) const {
    return {.batch = sh.batch,
            .seq = sh.seq,
            .heads = static_cast<int>(d_.heads),
            .kv_heads = static_cast<int>(kv() / hd()),
            .head_dim = static_cast<int>(hd())};
  }

  // ---- a block -------------------------------------------------------------------------------

  void block_forward(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* saved, float* out) {
    const std::size_t T = tokens(mb.shape), H = h();
    const BlockView b = view(saved, i, mb.shape);
    const BlockParams w = block(params_, i);
    std::vector<float>& s = ws(T * (H + std::max(H, f())));
    float* a = s.data();     // (T, h) a normalized input
    float* tmp = a + T * H;  // (T, max(h, f)): a projection's output, silu(gate) * up
    ops::rmsnorm_forward(ctx, b.x, w.attn_norm, a, b.rstd, n(T), n(H), c_.norm_eps);
    linear(a, w.wq, b.q, T, H, H);
    linear(a, w.wk, b.k, T, H, kv());
    linear(a, w.wv, b.v, T, H, kv());
    rope(ctx, b.q, H, mb.shape, false);
    rope(ctx, b.k, kv(), mb.shape, false);
    ops::attention_forward(ctx, b.q, b.k, b.v, b.att, b.lse, attention_shape(mb.shape), docs_);
    linear(b.att, w.wo, tmp, T, H, H);
    ops::add(ctx, b.x, tmp, b.x1, n(T * H));
    ops::rmsnorm_forward(ctx, b.x1, w.ffn_norm, a, b.rstd + T, n(T), n(H), c_.norm_eps);
    linear(a, w.w1, b.gate, T, H, f());
    linear(a, w.w3, b.up, T, H, f());
    ops::swiglu_forward(ctx, b.gate, b.up, tmp, n(T * f()));
    linear(tmp, w.w2, out, T, f(), H);
    ops::add(ctx, out, b.x1, out, n(T * H));
  }

  // The stash of one block: dy | dgate | dup | da2 | dx1 | dq | dk | dv | da1.
  struct StashView {
    float *dy, *dgate, *dup, *da2, *dx1, *dq, *dk, *dv, *da1;
  };
  StashView stash_view(float* st, MicrobatchShape sh) const {
    const std::size_t T = tokens(sh);
    StashView v{};
    v.dy = st;
    v.dgate = v.dy + T * h();
    v.dup = v.dgate + T * f();
    v.da2 = v.dup + T * f();
    v.dx1 = v.da2 + T * h();
    v.dq = v.dx1 + T * h();
    v.dk = v.dq + T * h();
    v.dv = v.dk + T * kv();
    v.da1 = v.dv + T * kv();
    return v;
  }

  /// grad (T, h) = dL/d(block output) in; out (T, h) = dL/d(block input).
  void block_backward_input(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* saved, float* st,
                            const float* grad, float* out) {
    const std::size_t T = tokens(mb.shape), H = h();
    const BlockView b = view(saved, i, mb.shape);
    const BlockParams w = block(params_, i);
    const StashView z = stash_view(st, mb.shape);
    float* dh = bwd_scratch(T * std::max(H, f()) + T * H);  // d(silu(gate) * up), then datt
    float* datt = dh + T * std::max(H, f());
    std::memcpy(z.dy, grad, T * H * sizeof(float));
    linear_dx(grad, w.w2, dh, T, f(), H);
    ops::swiglu_backward(ctx, dh, b.gate, b.up, z.dgate, z.dup, n(T * f()));
    linear_dx(z.dgate, w.w1, z.da2, T, H, f());
    linear_dx(z.dup, w.w3, z.da2, T, H, f(), 1.0f);
    ops::rmsnorm_backward(ctx, z.da2, b.x1, b.rstd + T, w.ffn_norm, z.dx1, n(T), n(H), false);
    ops::add(ctx, z.dx1, grad, z.dx1, n(T * H));
    linear_dx(z.dx1, w.wo, datt, T, H, H);
    ops::attention_backward(ctx, b.q, b.k, b.v, b.att, datt, b.lse, z.dq, z.dk, z.dv, attention_shape(mb.shape), docs_);
    rope(ctx, z.dq, H, mb.shape, true);  // gradients of the projections before their rotation
    rope(ctx, z.dk, kv(), mb.shape, true);
    linear_dx(z.dq, w.wq, z.da1, T, H, H);
    linear_dx(z.dk, w.wk, z.da1, T, H, kv(), 1.0f);
    linear_dx(z.dv, w.wv, z.da1, T, H, kv(), 1.0f);
    ops::rmsnorm_backward(ctx, z.da1, b.x, b.rstd, w.attn_norm, out, n(T), n(H), false);
    ops::add(ctx, out, z.dx1, out, n(T * H));
  }

  void block_backward_weight(const backend::CpuContext& ctx, int i, const Microbatch& mb, std::byte* saved, float* st) {
    const std::size_t T = tokens(mb.shape), H = h();
    const BlockView b = view(saved, i, mb.shape);
    const BlockParams w = block(params_, i), g = block(grads_, i);
    const StashView z = stash_view(st, mb.shape);
    std::vector<float>& s = ws(T * (H + std::max(H, f())));
    float* a = s.data();
    float* hid = a + T * H;
    ops::swiglu_forward(ctx, b.gate, b.up, hid, n(T * f()));
    linear_dw(hid, z.dy, g.w2, T, f(), H);
    ops::rmsnorm_recompute(ctx, b.x1, b.rstd + T, w.ffn_norm, a, n(T), n(H));
    linear_dw(a, z.dgate, g.w1, T, H, f());
    linear_dw(a, z.dup, g.w3, T, H, f());
    ops::rmsnorm_weight_grad(ctx, z.da2, b.x1, b.rstd + T, g.ffn_norm, n(T), n(H));
    linear_dw(b.att, z.dx1, g.wo, T, H, H);
    ops::rmsnorm_recompute(ctx, b.x, b.rstd, w.attn_norm, a, n(T), n(H));
    linear_dw(a, z.dq, g.wq, T, H, H);
    linear_dw(a, z.dk, g.wk, T, H, kv());
    linear_dw(a, z.dv, g.wv, T, H, kv());
    ops::rmsnorm_weight_grad(ctx, z.da1, b.x, b.rstd, g.attn_norm, n(T), n(H));
  }

  // ---- the head ------------------------------------------------------------------------------

  float head_forward(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* saved) {
    const std::size_t T = tokens(mb.shape), H = h();
    float* x = head_x(saved, mb.shape);
    float* rstd = x + T * H;
    float* dlogits = rstd + T;
    const float* g = params_.data() + p_.head_begin;
    const float* W = g + p_.head_w;
    std::vector<float>& s = ws(T * H + T * V() + T);
    float* a = s.data();
    float* logits = a + T * H;
    float* losses = logits + T * V();
    ops::rmsnorm_forward(ctx, x, g, a, rstd, n(T), n(H), c_.norm_eps);
    if (d_.tied)  // logits = a W^T, W (V, h)
      blas::sgemm(T_::no, T_::yes, static_cast<int>(T), static_cast<int>(V()), static_cast<int>(H), 1.0f, a,
                  static_cast<int>(H), W, static_cast<int>(H), 0.0f, logits, static_cast<int>(V()));
    else
      linear(a, W, logits, T, H, V());
    ops::cross_entropy(ctx, logits, mb.input<std::int32_t>("targets"), losses, dlogits, n(T), c_.vocab,
                       mb.loss_scale / static_cast<float>(T));
    double loss = 0;  // in row order
    for (std::size_t t = 0; t < T; ++t) loss += losses[t];
    return static_cast<float>(loss / static_cast<double>(T));
  }

  void head_backward_input(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* saved, float* st,
                           float* dx) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(saved, mb.shape);
    const float* rstd = x + T * H;
    const float* dlogits = rstd + T;
    const float* g = params_.data() + p_.head_begin;
    const float* W = g + p_.head_w;
    float* da = st;  // (T, h), stashed for the norm's weight gradient
    if (d_.tied)
      linear(dlogits, W, da, T, V(), H);  // da = dlogits W, W (V, h)
    else
      linear_dx(dlogits, W, da, T, H, V());
    ops::rmsnorm_backward(ctx, da, x, rstd, g, dx, n(T), n(H), false);
  }

  void head_backward_weight(const backend::CpuContext& ctx, const Microbatch& mb, std::byte* saved, const float* st) {
    const std::size_t T = tokens(mb.shape), H = h();
    const float* x = head_x(saved, mb.shape);
    const float* rstd = x + T * H;
    const float* dlogits = rstd + T;
    const float* g = params_.data() + p_.head_begin;
    float* gg = grads_.data() + p_.head_begin;
    std::vector<float>& s = ws(T * H);
    ops::rmsnorm_recompute(ctx, x, rstd, g, s.data(), n(T), n(H));
    if (d_.tied)  // dW (V, h) += dlogits^T a
      linear_dw(dlogits, s.data(), gg + p_.head_w, T, V(), H);
    else
      linear_dw(s.data(), dlogits, gg + p_.head_w, T, H, V());
    ops::rmsnorm_weight_grad(ctx, st, x, rstd, gg, n(T), n(H));
  }

  LlamaConfig c_;
  LlamaDims d_{};
  LlamaStageParams p_{};
  std::vector<float> params_, grads_;
  ops::RopeTable rope_;  // RoPE's angles for positions [0, seq)
  std::vector<float> scratch_, bwd_;
  std::vector<Document> docs_;     // the microbatch's documents (documents())
  std::vector<std::int32_t> pos_;  // each token's position in its document
};

static_assert(layer_for<LlamaStage, backend::CpuContext>,
              "LlamaStage must model po::layer_for<LlamaStage, backend::CpuContext>.");

}  // namespace pipeoffload::llama
