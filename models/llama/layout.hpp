// models/llama/layout.hpp: the Llama-class model's layout, written once: its configuration,
// which blocks a stage holds, where each parameter tensor lives in a stage's parameter vector,
// the norm groups, the tensors' names, the shared embedding and the step inputs (with packed
// rows, their document offsets). Plain host
// code: the CPU model (cpu.hpp) and the sizes a launcher computes take it from here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <pipeoffload/error.hpp>
#include <pipeoffload/layer.hpp>    // ParamInfo, InputSpec, SharedParam, MicrobatchShape, SavedPart
#include <pipeoffload/packing.hpp>  // document_offsets_input

namespace pipeoffload::llama {

/// The model: a Llama-class decoder (cpu.hpp's file comment has the architecture).
struct LlamaConfig {
  int vocab = 256;              ///< V
  int hidden = 64;              ///< h
  int heads = 4;                ///< query heads a; h % a == 0
  int kv_heads = 2;             ///< key/value heads (grouped-query attention); a % kv_heads == 0
  int ffn = 0;                  ///< SwiGLU's inner width f; 0: 8h/3 rounded up to a multiple of 32
  int layers = 4;               ///< transformer blocks in the whole model
  int seq = 64;                 ///< longest sequence (RoPE needs no table)
  float rope_theta = 10000.0f;  ///< RoPE's base
  float norm_eps = 1e-5f;       ///< RMSNorm's epsilon
  bool tie_embeddings = false;  ///< the output projection is the token embedding (po::SharedParam)
  /// Packed rows: several documents a row, their offsets the step input "cu_seqlens"
  /// (po::document_offsets_input, read by every stage with blocks); attention stays within a
  /// document and RoPE positions restart at each.
  bool packed = false;
  std::uint64_t seed = 1;           ///< initialisation seed
  std::vector<int> stage_blocks{};  ///< blocks of each stage (empty: as even as can be)

  /// f: `ffn`, or 8h/3 rounded up to a multiple of 32.
  int ffn_width() const { return ffn > 0 ? ffn : (8 * hidden / 3 + 31) / 32 * 32; }
  /// Elements of one key (or value) row: kv_heads * h / heads.
  int kv_width() const { return kv_heads * (hidden / heads); }

  void check() const {
    const auto need = [](bool ok, const std::string& what) {
      if (!ok) throw shape_error("LlamaConfig: " + what);
    };
    need(vocab >= 2 && vocab <= (1 << 20), "vocab = " + std::to_string(vocab) + " is outside [2, 1048576]");
    need(hidden >= 2 && hidden <= (1 << 16), "hidden = " + std::to_string(hidden) + " is outside [2, 65536]");
    need(heads >= 1 && hidden % heads == 0 && (hidden / heads) % 2 == 0,
         "heads = " + std::to_string(heads) + " must divide hidden = " + std::to_string(hidden) +
             " into heads of an even size (RoPE rotates pairs)");
    need(kv_heads >= 1 && heads % kv_heads == 0,
         "kv_heads = " + std::to_string(kv_heads) + " must be >= 1 and divide heads = " + std::to_string(heads));
    need(ffn >= 0 && ffn <= (1 << 20), "ffn = " + std::to_string(ffn) + " is outside [0, 1048576] (0: 8h/3)");
    need(layers >= 1 && layers <= 4096, "layers = " + std::to_string(layers) + " is outside [1, 4096]");
    need(seq >= 1 && seq <= (1 << 16), "seq = " + std::to_string(seq) + " is outside [1, 65536]");
    need(rope_theta > 1.0f, "rope_theta = " + std::to_string(rope_theta) + " must be > 1");
    need(norm_eps > 0.0f && norm_eps < 1.0f, "norm_eps = " + std::to_string(norm_eps) + " is outside (0, 1)");
    long long sum = 0;
    for (const int b : stage_blocks) {
      need(b >= 0, "stage_blocks has " + std::to_string(b) + " blocks for a stage; each must be >= 0");
      sum += b;
    }
    need(stage_blocks.empty() || sum == layers,
         "stage_blocks add up to " + std::to_string(sum) + " blocks; the model has layers = " + std::to_string(layers));
  }
};

/// What the layout of one stage depends on: the configuration's sizes and the stage's place.
struct LlamaDims {
  long long vocab = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0;
  int first_block = 0;  ///< this stage holds blocks [first_block, first_block + blocks)
  int blocks = 0;
  bool embeds = false;    ///< stage 0: the token embedding
  bool has_head = false;  ///< the last stage: final RMSNorm, output projection, cross-entropy
  bool tied = false;      ///< LlamaConfig::tie_embeddings
  bool packed = false;    ///< LlamaConfig::packed
  constexpr long long head_dim() const { return hidden / heads; }
  constexpr long long kv_width() const { return kv_heads * head_dim(); }
};

/// Element offsets of one block's parameters inside its group, in order: attention_norm (h) |
/// wq (h, h) | wk (h, kv) | wv (h, kv) | wo (h, h) | ffn_norm (h) | w1 gate (h, f) | w3 up (h, f)
/// | w2 down (f, h). Matrices are (in, out) row-major.
struct LlamaBlockParams {
  long long attn_norm = 0, wq = 0, wk = 0, wv = 0, wo = 0, ffn_norm = 0, w1 = 0, w3 = 0, w2 = 0;
  long long count = 0;  ///< elements of the group
};
inline LlamaBlockParams llama_block_params(const LlamaDims& d) {
  LlamaBlockParams b;
  long long at = 0;
  const auto take = [&at](long long n) {
    const long long o = at;
    at += n;
    return o;
  };
  const long long h = d.hidden, kv = d.kv_width(), f = d.ffn;
  b.attn_norm = take(h);
  b.wq = take(h * h);
  b.wk = take(h * kv);
  b.wv = take(h * kv);
  b.wo = take(h * h);
  b.ffn_norm = take(h);
  b.w1 = take(h * f);
  b.w3 = take(h * f);
  b.w2 = take(f * h);
  b.count = at;
  return b;
}

/// A stage's parameter vector: the embedding (V, h) on stage 0, one group per block, the head
/// group (norm (h) | output (h, V), or (V, h) when tied) on the last stage; offsets in elements.
struct LlamaStageParams {
  long long embed = 0;         ///< elements of the embedding (0 unless dims.embeds)
  long long blocks_begin = 0;  ///< offset of the first block's group
  LlamaBlockParams block{};    ///< offsets inside every block's group
  long long head_begin = 0;    ///< offset of the head group
  long long head = 0;          ///< elements of the head group (0 unless dims.has_head)
  long long head_w = 0;        ///< offset of the output projection inside the head group
  long long total = 0;
  long long block_begin(int i) const { return blocks_begin + i * block.count; }
};
inline LlamaStageParams llama_stage_params(const LlamaDims& d) {
  LlamaStageParams p;
  p.embed = d.embeds ? d.vocab * d.hidden : 0;
  p.blocks_begin = p.embed;
  p.block = llama_block_params(d);
  p.head_begin = p.blocks_begin + d.blocks * p.block.count;
  p.head = d.has_head ? d.hidden + d.hidden * d.vocab : 0;
  p.head_w = d.hidden;
  p.total = p.head_begin + p.head;
  return p;
}

/// The norm groups: one per embedding, block and head, in model order (the gradient norm is the
/// same for every cut at block boundaries).
inline std::vector<std::size_t> llama_norm_groups(const LlamaDims& d) {
  const LlamaStageParams p = llama_stage_params(d);
  std::vector<std::size_t> g;
  if (d.embeds) g.push_back(static_cast<std::size_t>(p.embed));
  for (int i = 0; i < d.blocks; ++i) g.push_back(static_cast<std::size_t>(p.block.count));
  if (d.has_head) g.push_back(static_cast<std::size_t>(p.head));
  return g;
}

/// The named tensors of a stage (Meta's Llama names; weights stored (in, out), the tied output
/// (V, h) as the embedding).
inline std::vector<ParamInfo> llama_parameter_info(const LlamaDims& d) {
  const LlamaStageParams p = llama_stage_params(d);
  const long long h = d.hidden, V = d.vocab, kv = d.kv_width(), f = d.ffn;
  std::vector<ParamInfo> t;
  const auto add = [&t](std::string name, long long offset, std::vector<long long> shape) {
    t.push_back(ParamInfo{std::move(name), static_cast<std::size_t>(offset), std::move(shape)});
  };
  if (d.embeds) add("tok_embeddings.weight", 0, {V, h});
  const LlamaBlockParams& o = p.block;
  for (int i = 0; i < d.blocks; ++i) {
    const std::string b = "layers." + std::to_string(d.first_block + i) + ".";
    const long long at = p.block_begin(i);
    add(b + "attention_norm.weight", at + o.attn_norm, {h});
    add(b + "attention.wq.weight", at + o.wq, {h, h});
    add(b + "attention.wk.weight", at + o.wk, {h, kv});
    add(b + "attention.wv.weight", at + o.wv, {h, kv});
    add(b + "attention.wo.weight", at + o.wo, {h, h});
    add(b + "ffn_norm.weight", at + o.ffn_norm, {h});
    add(b + "feed_forward.w1.weight", at + o.w1, {h, f});
    add(b + "feed_forward.w3.weight", at + o.w3, {h, f});
    add(b + "feed_forward.w2.weight", at + o.w2, {f, h});
  }
  if (d.has_head) {
    add("norm.weight", p.head_begin, {h});
    add("output.weight", p.head_begin + p.head_w, d.tied ? std::vector<long long>{V, h} : std::vector<long long>{h, V});
  }
  return t;
}

/// With tied embeddings: stage 0's tok_embeddings.weight and the last stage's output.weight are
/// one parameter.
inline std::vector<SharedParam> llama_shared_parameters(const LlamaDims& d) {
  std::vector<SharedParam> s;
  if (!d.tied) return s;
  if (d.embeds) s.push_back({"tok_embeddings.weight", "tok_embeddings"});
  if (d.has_head) s.push_back({"output.weight", "tok_embeddings"});
  return s;
}

/// Stage 0 reads the token ids, the last stage the next-token targets: int32, one per token;
/// packed, every stage with blocks reads the rows' document offsets (int32, seq + 1 a row).
inline std::vector<InputSpec> llama_inputs(const LlamaDims& d, MicrobatchShape sh) {
  const std::size_t tokens = static_cast<std::size_t>(sh.tokens());
  std::vector<InputSpec> in;
  if (d.embeds) in.push_back({"tokens", DType::int32, tokens});
  if (d.packed && d.blocks > 0)
    in.push_back({document_offsets_input, DType::int32,
                  static_cast<std::size_t>(sh.batch) * (static_cast<std::size_t>(sh.seq) + 1)});
  if (d.has_head) in.push_back({"targets", DType::int32, tokens});
  return in;
}

/// The dims of stage `stage` of `stages` (checked).
inline LlamaDims llama_dims(const LlamaConfig& cfg, int stage, int stages) {
  cfg.check();
  if (stages < 1 || stage < 0 || stage >= stages)
    throw shape_error("llama::llama_dims: stage = " + std::to_string(stage) + " is outside [0, " +
                      std::to_string(stages - 1) + "]");
  int first = 0, count = 0;
  if (cfg.stage_blocks.empty()) {
    first = static_cast<int>(static_cast<long long>(cfg.layers) * stage / stages);
    count = static_cast<int>(static_cast<long long>(cfg.layers) * (stage + 1) / stages) - first;
  } else {
    if (static_cast<int>(cfg.stage_blocks.size()) != stages)
      throw shape_error("llama::llama_dims: LlamaConfig::stage_blocks gives " +
                        std::to_string(cfg.stage_blocks.size()) + " stages; the pipeline has " +
                        std::to_string(stages));
    for (int s = 0; s < stage; ++s) first += cfg.stage_blocks[static_cast<std::size_t>(s)];
    count = cfg.stage_blocks[static_cast<std::size_t>(stage)];
  }
  LlamaDims d;
  d.vocab = cfg.vocab;
  d.hidden = cfg.hidden;
  d.heads = cfg.heads;
  d.kv_heads = cfg.kv_heads;
  d.ffn = cfg.ffn_width();
  d.first_block = first;
  d.blocks = count;
  d.embeds = stage == 0;
  d.has_head = stage == stages - 1;
  d.tied = cfg.tie_embeddings;
  d.packed = cfg.packed;
  return d;
}

}  // namespace pipeoffload::llama
