// models/llama/cuda_layout.hpp: the CUDA Llama stage's buffers as byte regions (plain host code,
// constexpr): what F saves for B and W, the stash B leaves for W, the stage's own workspace and
// the device bytes of its state. Every offset llama::CudaLlamaStage (cuda.hpp) uses comes from
// here, and tests/cuda/test_host.cpp checks them on the CPU (aligned, never overlapping, the
// sizes below).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <pipeoffload/backend/cuda/shapes.hpp>  // Region, RegionCarver
#include <pipeoffload/error.hpp>

#include "layout.hpp"

namespace pipeoffload::llama {

/// One block's slice of the saved buffer for T = b*s tokens (f = ffn, kv = kv_width):
///   bf16 x, q (T, h) | k, v (T, kv) | att, x1 (T, h) | gate, up (T, f): 2T (4h + 2kv + 2f) bytes
///   fp32 rstd (2, T): attention's norm's, then the MLP's | lse (b, heads, s): 4T (2 + heads) bytes.
/// q and k are saved rotated; the normalized inputs and silu(gate) * up are recomputed.
struct LlamaBlockSaved {
  cuda::Region x, q, k, v, att, x1, gate, up, rstd, lse;
  std::size_t bytes = 0;  ///< the slice: a multiple of cuda::region_alignment
};

/// The head's slice: bf16 x (T, h) | fp32 rstd (T) | bf16 dlogits (T, V) (the loss gradient,
/// computed in F with the loss).
struct LlamaHeadSaved {
  cuda::Region x, rstd, dlogits;
  std::size_t bytes = 0;
};

/// One block's stash, bf16: dy (T, h) | dgate, dup (T, f) | da2, dx1, dq (T, h) | dk, dv (T, kv)
/// | da1 (T, h).
struct LlamaBlockStash {
  cuda::Region dy, dgate, dup, da2, dx1, dq, dk, dv, da1;
  std::size_t bytes = 0;
};

/// A stage's saved buffer (blocks in order, then the head) and stash (the embedding's output
/// gradient (T, h), blocks in order, the head norm's output gradient (T, h); bf16).
struct LlamaStageBuffers {
  LlamaBlockSaved block{};
  LlamaHeadSaved head{};
  std::size_t head_saved = 0;  ///< offset of the head's slice in saved
  std::size_t saved_bytes = 0;
  LlamaBlockStash block_stash{};
  cuda::Region stash_embed;  ///< bytes 0 unless the stage embeds
  std::size_t stash_blocks = 0;
  cuda::Region stash_head;  ///< bytes 0 unless the stage has the head
  std::size_t stash_bytes = 0;
  constexpr std::size_t block_saved(int i) const { return static_cast<std::size_t>(i) * block.bytes; }
  constexpr std::size_t block_stashed(int i) const {
    return stash_blocks + static_cast<std::size_t>(i) * block_stash.bytes;
  }
};

/// The stage's workspace, allocated once for its largest microbatch; no region lives from one
/// pass to the next: bf16 a (T, h) a normalized input | tmp (T, max(h, f)) a projection's
/// output, silu(gate) * up, its gradient | datt (T, h) | io, io2 (T, h) the stage's bf16 output
/// and the gradient flowing down | int32 positions (T) | packed rows' document table
/// (cuda::document_table_bytes(T), on a packed stage with blocks) | fp32 logits of a block of
/// rows (cuda::logits_rows(T, V), V) and losses (T) on the last stage.
struct LlamaWorkspace {
  cuda::Region a, tmp, datt, io, io2, positions, documents, logits, losses;
  std::size_t bytes = 0;
};

namespace detail {
constexpr void check_tokens(long long tokens, const char* who) {
  if (tokens < 1)
    throw shape_error(std::string(who) + ": tokens = " + pipeoffload::detail::num(tokens) + " must be >= 1");
}
}  // namespace detail

/// The saved and stash layout of a stage for microbatches of `tokens` tokens.
constexpr LlamaStageBuffers llama_cuda_buffers(const LlamaDims& d, long long tokens) {
  detail::check_tokens(tokens, "llama::llama_cuda_buffers");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden),
                    kv = static_cast<std::size_t>(d.kv_width()), f = static_cast<std::size_t>(d.ffn),
                    V = static_cast<std::size_t>(d.vocab), a = static_cast<std::size_t>(d.heads);
  constexpr std::size_t bf = 2, f32 = 4;
  LlamaStageBuffers b;
  cuda::RegionCarver c;
  LlamaBlockSaved& s = b.block;
  s.x = c.take(T * h * bf);
  s.q = c.take(T * h * bf);
  s.k = c.take(T * kv * bf);
  s.v = c.take(T * kv * bf);
  s.att = c.take(T * h * bf);
  s.x1 = c.take(T * h * bf);
  s.gate = c.take(T * f * bf);
  s.up = c.take(T * f * bf);
  s.rstd = c.take(2 * T * f32);
  s.lse = c.take(T * a * f32);
  s.bytes = c.total();
  b.head_saved = static_cast<std::size_t>(d.blocks) * s.bytes;
  if (d.has_head) {
    cuda::RegionCarver hc;
    b.head.x = hc.take(T * h * bf);
    b.head.rstd = hc.take(T * f32);
    b.head.dlogits = hc.take(T * V * bf);
    b.head.bytes = hc.total();
  }
  b.saved_bytes = b.head_saved + b.head.bytes;
  cuda::RegionCarver bs;
  LlamaBlockStash& z = b.block_stash;
  z.dy = bs.take(T * h * bf);
  z.dgate = bs.take(T * f * bf);
  z.dup = bs.take(T * f * bf);
  z.da2 = bs.take(T * h * bf);
  z.dx1 = bs.take(T * h * bf);
  z.dq = bs.take(T * h * bf);
  z.dk = bs.take(T * kv * bf);
  z.dv = bs.take(T * kv * bf);
  z.da1 = bs.take(T * h * bf);
  z.bytes = bs.total();
  cuda::RegionCarver st;
  b.stash_embed = st.take(d.embeds ? T * h * bf : 0);
  b.stash_blocks = st.total();
  st.top = b.stash_blocks + static_cast<std::size_t>(d.blocks) * z.bytes;
  b.stash_head = st.take(d.has_head ? T * h * bf : 0);
  b.stash_bytes = st.total();
  return b;
}

/// saved_parts() of llama::CudaLlamaStage: llama_cuda_buffers' head slice, then its block slices
/// last to first (backward_input's reading order); they tile [0, saved_bytes).
inline std::vector<SavedPart> llama_cuda_saved_parts(const LlamaDims& d, long long tokens) {
  const LlamaStageBuffers b = llama_cuda_buffers(d, tokens);
  return stacked_saved_parts(d.blocks, b.block.bytes, b.head.bytes);
}

/// The stage's workspace for microbatches of up to `tokens` tokens.
constexpr LlamaWorkspace llama_cuda_workspace(const LlamaDims& d, long long tokens) {
  detail::check_tokens(tokens, "llama::llama_cuda_workspace");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden),
                    f = static_cast<std::size_t>(d.ffn), V = static_cast<std::size_t>(d.vocab);
  LlamaWorkspace w;
  cuda::RegionCarver c;
  w.a = c.take(T * h * 2);
  w.tmp = c.take(T * (h > f ? h : f) * 2);
  w.datt = c.take(T * h * 2);
  w.io = c.take(T * h * 2);
  w.io2 = c.take(T * h * 2);
  w.positions = c.take(T * 4);
  w.documents = c.take(d.packed && d.blocks > 0 ? cuda::document_table_bytes(tokens) : 0);
  w.logits = c.take(d.has_head ? static_cast<std::size_t>(cuda::logits_rows(tokens, d.vocab)) * V * 4 : 0);
  w.losses = c.take(d.has_head ? T * 4 : 0);
  w.bytes = c.total();
  return w;
}

/// Device bytes llama::CudaLlamaStage holds for its state: bf16 working parameters and fp32
/// gradients (2 + 4 bytes a parameter) and RoPE's fp32 cos and sin for `seq` positions.
inline std::size_t llama_cuda_state_bytes(const LlamaDims& d, int seq) {
  return static_cast<std::size_t>(llama_stage_params(d).total) * (2 + 4) +
         2 * static_cast<std::size_t>(seq) * static_cast<std::size_t>(d.head_dim() / 2) * 4;
}

}  // namespace pipeoffload::llama
