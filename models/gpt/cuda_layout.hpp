// models/gpt/cuda_layout.hpp: the CUDA GPT stage's buffers: its bf16 saved activations, the
// stash B leaves for W, and its own workspace, as byte regions (plain host code, constexpr).
//
// gpt::CudaGptStage (cuda.hpp) keeps its activations in bf16 and its parameters in fp32 at
// layout.hpp's offsets (the CPU model's, byte for byte). Every offset it uses into its saved
// activations, its stash and its workspace comes from these functions, which
// tests/cuda/test_host.cpp checks on the CPU: saved bytes per block of 20 b s h with selective
// recompute and 34 b s h without (docs/design.md section 1), and regions that are aligned and never
// overlap.
#pragma once

#include <cstddef>
#include <vector>

#include <pipeoffload/backend/cuda/shapes.hpp>  // Region, RegionCarver, align_up
#include <pipeoffload/error.hpp>

#include "layout.hpp"

namespace pipeoffload::gpt {

using cuda::align_up;
using cuda::Region;
using cuda::region_alignment;
using cuda::RegionCarver;

/// One block's slice of the saved buffer for a microbatch of T = b*s tokens:
///   bf16  x (T, h) | qkv (T, 3h) | att (T, h) | x1 (T, h) | f (T, 4h)      20 T h bytes
///   fp32  stats (T, 4): LN1 (mean, rstd) per row, then LN2's | lse (b, a, s) (16 + 4a) T bytes
///   recompute off, also bf16 a1 (T, h) | a2 (T, h) | g (T, 4h) and the two dropout masks as
///   bytes m1, m2 (T, h): 14 T h more, 34 T h in all.
/// x is the block's input, x1 the residual stream after attention, f the MLP pre-activation,
/// a1/a2 the LayerNorm outputs and g = GeLU(f) (recomputed in W when not saved).
struct GptBlockSaved {
  Region x, qkv, att, x1, f, stats, lse, a1, a2, g, m1, m2;
  std::size_t bytes = 0;         ///< the slice: a multiple of region_alignment
  std::size_t tensor_bytes = 0;  ///< what the paper's 20bsh / 34bsh counts
  std::size_t extra_bytes = 0;   ///< the per-row fp32 statistics
};

/// The head's slice: bf16 x (T, h) | fp32 LN stats (T, 2) | bf16 dlogits (T, V) (the loss
/// gradient, computed in F with the loss).
struct GptHeadSaved {
  Region x, stats, dlogits;
  std::size_t bytes = 0;
};

/// One block's stash (what B leaves for W), bf16, the gradients of each GEMM's output and of
/// each LayerNorm's output: dP2 (T, h) | dF (T, 4h) | dA2 (T, h) | dO1 (T, h) | dQKV (T, 3h) |
/// dA1 (T, h), 22 T h bytes.
struct GptBlockStash {
  Region dP2, dF, dA2, dO1, dQKV, dA1;
  std::size_t bytes = 0;
};

/// A stage's saved buffer (blocks in order, then the head) and stash (the embedding's output
/// gradient (T, h) bf16, blocks in order, the head LayerNorm's output gradient (T, h) bf16).
struct GptStageBuffers {
  GptBlockSaved block{};
  GptHeadSaved head{};
  std::size_t head_saved = 0;  ///< offset of the head's slice in saved
  std::size_t saved_bytes = 0;
  GptBlockStash block_stash{};
  Region stash_embed;  ///< bytes 0 unless the stage embeds
  std::size_t stash_blocks = 0;
  Region stash_head;  ///< bytes 0 unless the stage has the head
  std::size_t stash_bytes = 0;
  constexpr std::size_t block_saved(int i) const { return static_cast<std::size_t>(i) * block.bytes; }
  constexpr std::size_t block_stashed(int i) const {
    return stash_blocks + static_cast<std::size_t>(i) * block_stash.bytes;
  }
};

namespace detail {
constexpr void check_gpt(const gpt::GptDims& d, long long tokens, const char* who) {
  if (tokens < 1 || d.hidden < 1 || d.heads < 1 || d.hidden % d.heads != 0 || d.vocab < 1 || d.blocks < 0)
    throw shape_error(std::string(who) + ": tokens = " + pipeoffload::detail::num(tokens) + ", hidden = " +
                      pipeoffload::detail::num(d.hidden) + ", heads = " + pipeoffload::detail::num(d.heads) +
                      ", vocab = " + pipeoffload::detail::num(d.vocab) +
                      " (need tokens, hidden, heads, vocab >= 1 and heads dividing hidden)");
}
}  // namespace detail

constexpr GptBlockSaved gpt_block_saved(const gpt::GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "gpt::gpt_block_saved");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden),
                    a = static_cast<std::size_t>(d.heads);
  const std::size_t bf = 2, f32 = 4;
  GptBlockSaved s;
  RegionCarver c;
  s.x = c.take(T * h * bf);
  s.qkv = c.take(3 * T * h * bf);
  s.att = c.take(T * h * bf);
  s.x1 = c.take(T * h * bf);
  s.f = c.take(4 * T * h * bf);
  s.stats = c.take(4 * T * f32);
  s.lse = c.take(T * a * f32);
  if (!d.recompute) {
    s.a1 = c.take(T * h * bf);
    s.a2 = c.take(T * h * bf);
    s.g = c.take(4 * T * h * bf);
    s.m1 = c.take(T * h);
    s.m2 = c.take(T * h);
  }
  s.bytes = c.total();
  s.tensor_bytes = s.x.bytes + s.qkv.bytes + s.att.bytes + s.x1.bytes + s.f.bytes + s.a1.bytes + s.a2.bytes +
                   s.g.bytes + s.m1.bytes + s.m2.bytes;
  s.extra_bytes = s.stats.bytes + s.lse.bytes;
  return s;
}

constexpr GptStageBuffers gpt_stage_buffers(const gpt::GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "gpt::gpt_stage_buffers");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden),
                    V = static_cast<std::size_t>(d.vocab);
  GptStageBuffers b;
  b.block = gpt_block_saved(d, tokens);
  b.head_saved = static_cast<std::size_t>(d.blocks) * b.block.bytes;
  if (d.has_head) {
    RegionCarver c;
    b.head.x = c.take(T * h * 2);
    b.head.stats = c.take(2 * T * 4);
    b.head.dlogits = c.take(T * V * 2);
    b.head.bytes = c.total();
  }
  b.saved_bytes = b.head_saved + b.head.bytes;
  RegionCarver bs;
  b.block_stash.dP2 = bs.take(T * h * 2);
  b.block_stash.dF = bs.take(4 * T * h * 2);
  b.block_stash.dA2 = bs.take(T * h * 2);
  b.block_stash.dO1 = bs.take(T * h * 2);
  b.block_stash.dQKV = bs.take(3 * T * h * 2);
  b.block_stash.dA1 = bs.take(T * h * 2);
  b.block_stash.bytes = bs.total();
  RegionCarver st;
  b.stash_embed = st.take(d.embeds ? T * h * 2 : 0);
  b.stash_blocks = st.total();
  st.top = b.stash_blocks + static_cast<std::size_t>(d.blocks) * b.block_stash.bytes;
  b.stash_head = st.take(d.has_head ? T * h * 2 : 0);
  b.stash_bytes = st.total();
  return b;
}

/// saved_parts() of gpt::CudaGptStage: gpt_stage_buffers' head slice, then its block slices
/// last to first (backward_input's reading order); they tile [0, saved_bytes).
inline std::vector<SavedPart> gpt_cuda_saved_parts(const gpt::GptDims& d, long long tokens) {
  const GptStageBuffers b = gpt_stage_buffers(d, tokens);
  return stacked_saved_parts(d.blocks, b.block.bytes, b.head.bytes);
}

/// The stage's own workspace, allocated once for its largest microbatch; no region lives from
/// one pass to the next (the runtime may run other stages' and microbatches' passes between):
///   bf16 ln (T, h): a LayerNorm output (F; W's recompute) | proj (T, h): an attention or MLP
///   projection output (F), the attention output's gradient (B) | gelu (T, 4h): GeLU output
///   (F and W with recompute) | io (T, h): the stage's bf16 output before to_float (F), the
///   gradient flowing down (B) | packed rows: int32 positions (T) on the embedding's stage and
///   the documents' table (cuda::document_table_bytes(T)) on a stage with blocks | fp32 logits
///   of a block of rows (cuda::logits_rows(T, V), V) and per-row losses (T) on the last stage.
struct GptWorkspace {
  Region ln, proj, gelu, io, positions, documents, logits, losses;
  std::size_t bytes = 0;
};
/// Device bytes gpt::CudaGptStage holds for its parameters and gradients: bf16 working
/// parameters and fp32 gradients (2 + 4 bytes a parameter), and on the last stage an fp32 copy
/// of the head's bias (vocab values). The fp32 master copy is the optimizer's (po::state_bytes
/// with parameter_bytes = 2).
constexpr std::size_t gpt_state_bytes(const gpt::GptDims& d) {
  const gpt::GptStageParams p = gpt::gpt_stage_params(d);
  return static_cast<std::size_t>(p.total) * (2 + 4) + (d.has_head ? static_cast<std::size_t>(d.vocab) * 4 : 0);
}

constexpr GptWorkspace gpt_workspace(const gpt::GptDims& d, long long tokens) {
  detail::check_gpt(d, tokens, "gpt::gpt_workspace");
  const std::size_t T = static_cast<std::size_t>(tokens), h = static_cast<std::size_t>(d.hidden),
                    V = static_cast<std::size_t>(d.vocab);
  GptWorkspace w;
  RegionCarver c;
  w.ln = c.take(T * h * 2);
  w.proj = c.take(T * h * 2);
  w.gelu = c.take(d.recompute ? 4 * T * h * 2 : 0);
  w.io = c.take(T * h * 2);
  w.positions = c.take(d.packed && d.embeds ? T * 4 : 0);
  w.documents = c.take(d.packed && d.blocks > 0 ? cuda::document_table_bytes(tokens) : 0);
  w.logits = c.take(d.has_head ? static_cast<std::size_t>(cuda::logits_rows(tokens, d.vocab)) * V * 4 : 0);
  w.losses = c.take(d.has_head ? T * 4 : 0);
  w.bytes = c.total();
  return w;
}

}  // namespace pipeoffload::gpt
