// models/gpt/layout.hpp: the GPT's layout, written once: its configuration, which blocks a
// stage holds, where each parameter tensor lives in a stage's parameter vector, the norm
// groups, the tensors' names and the step inputs.
//
// Both implementations take every one of these from here: gpt::GptStage (cpu.hpp, fp32 on
// OpenBLAS) and gpt::CudaGptStage (cuda.hpp, bf16 activations on cuBLASLt and cuDNN), so their
// parameter vectors are the same bytes and a checkpoint of one loads into the other. What
// differs between them (the saved activations: fp32 on the CPU, bf16 on the GPU) is in each
// implementation's own file (cuda_layout.hpp for the GPU). Plain host code, constexpr where it
// can be: it builds and is tested without the CUDA toolkit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <pipeoffload/error.hpp>
#include <pipeoffload/layer.hpp>    // ParamInfo, InputSpec, MicrobatchShape, SavedPart
#include <pipeoffload/packing.hpp>  // document_offsets_input
#include <pipeoffload/tensor.hpp>

namespace pipeoffload::gpt {

/// The model: a GPT-2 style decoder (cpu.hpp's file comment has the architecture).
struct GptConfig {
  int vocab = 256;        ///< byte-level
  int hidden = 128;       ///< h
  int heads = 4;          ///< a; h % a == 0
  int layers = 4;         ///< transformer blocks in the whole model
  int seq = 64;           ///< s, also the position table size
  float dropout = 0.1f;   ///< residual dropout after attention and MLP
  bool recompute = true;  ///< selective recompute of LayerNorm, GeLU and dropout
  std::uint64_t seed = 1;
  /// The LM head's weight is the token embedding (GPT-2's tie): the head keeps its copy (V, h)
  /// and shares it with stage 0's `wte` (po::SharedParam), so the runtime sums the two
  /// gradients and the optimizer updates one tensor.
  bool tie_embeddings = false;
  /// Packed rows: several documents a row, their offsets the step input "cu_seqlens"
  /// (po::document_offsets_input, read by the embedding and every stage with blocks); positions
  /// restart at each document and attention stays within it (the CPU GPT; the CUDA GPT refuses).
  bool packed = false;
  /// Blocks of each stage, in stage order, summing to `layers` (stage 0 also holds the
  /// embedding, the last stage the head, so they may take fewer); empty: as even as the stage
  /// count allows (gpt_blocks_of_stage).
  std::vector<int> stage_blocks{};

  void check() const {
    const auto need = [](bool ok, const std::string& what) {
      if (!ok) throw shape_error("GptConfig: " + what);
    };
    need(vocab >= 2 && vocab <= (1 << 20), "vocab = " + std::to_string(vocab) + " is outside [2, 1048576]");
    need(hidden >= 1 && hidden <= (1 << 16), "hidden = " + std::to_string(hidden) + " is outside [1, 65536]");
    need(heads >= 1 && hidden % heads == 0,
         "heads = " + std::to_string(heads) + " must be >= 1 and divide hidden = " + std::to_string(hidden));
    need(layers >= 1 && layers <= 4096, "layers = " + std::to_string(layers) + " is outside [1, 4096]");
    need(seq >= 1 && seq <= (1 << 16), "seq = " + std::to_string(seq) + " is outside [1, 65536]");
    need(dropout >= 0.0f && dropout < 1.0f, "dropout = " + std::to_string(dropout) + " is outside [0, 1)");
    long long sum = 0;
    for (const int b : stage_blocks) {
      need(b >= 0, "stage_blocks has " + std::to_string(b) + " blocks for a stage; each must be >= 0");
      sum += b;
    }
    need(stage_blocks.empty() || sum == layers,
         "stage_blocks add up to " + std::to_string(sum) + " blocks; the model has layers = " + std::to_string(layers));
  }
};

/// What the layouts of one GPT stage depend on: GptConfig's sizes and the stage's place.
struct GptDims {
  long long vocab = 0;      ///< V
  long long hidden = 0;     ///< h
  long long heads = 0;      ///< a (h % a == 0)
  long long positions = 0;  ///< rows of the position table (GptConfig::seq)
  int first_block = 0;      ///< this stage holds model blocks [first_block, first_block + blocks)
  int blocks = 0;
  bool embeds = false;    ///< stage 0: token and position embedding
  bool has_head = false;  ///< last stage: final LayerNorm, LM head, cross-entropy
  bool recompute = true;  ///< selective recompute of LayerNorm, GeLU and dropout masks
  bool tied = false;      ///< GptConfig::tie_embeddings: the head's weight is (V, h), shared with wte
  bool packed = false;    ///< GptConfig::packed
};

/// The blocks of stage `stage` of `stages` in a model of `layers` blocks, spread as evenly as
/// possible (both implementations' split).
struct BlockRange {
  int first = 0;
  int count = 0;
  friend constexpr bool operator==(const BlockRange&, const BlockRange&) = default;
};
constexpr BlockRange gpt_blocks_of_stage(int layers, int stage, int stages) {
  if (layers < 1 || stages < 1 || stage < 0 || stage >= stages)
    throw shape_error("gpt::gpt_blocks_of_stage: layers = " + pipeoffload::detail::num(layers) +
                      ", stage = " + pipeoffload::detail::num(stage) +
                      ", stages = " + pipeoffload::detail::num(stages) + " (need layers >= 1 and 0 <= stage < stages)");
  const int first = static_cast<int>(static_cast<long long>(layers) * stage / stages);
  return {first, static_cast<int>(static_cast<long long>(layers) * (stage + 1) / stages) - first};
}

/// Element offsets of one block's parameters inside its group, in order:
/// ln1 gamma, beta (h) | Wqkv (h, 3h) | bqkv (3h) | Wo (h, h) | bo (h) | ln2 gamma, beta (h) |
/// Wfc (h, 4h) | bfc (4h) | Wpr (4h, h) | bpr (h). Matrices are (in, out) row-major.
struct GptBlockParams {
  long long ln1g = 0, ln1b = 0, wqkv = 0, bqkv = 0, wo = 0, bo = 0, ln2g = 0, ln2b = 0, wfc = 0, bfc = 0, wpr = 0,
            bpr = 0;
  long long count = 0;  ///< elements of the group: 12 h^2 + 13 h
};
constexpr GptBlockParams gpt_block_params(long long h) {
  GptBlockParams b;
  long long at = 0;
  const auto take = [&at](long long n) {
    const long long o = at;
    at += n;
    return o;
  };
  b.ln1g = take(h);
  b.ln1b = take(h);
  b.wqkv = take(3 * h * h);
  b.bqkv = take(3 * h);
  b.wo = take(h * h);
  b.bo = take(h);
  b.ln2g = take(h);
  b.ln2b = take(h);
  b.wfc = take(4 * h * h);
  b.bfc = take(4 * h);
  b.wpr = take(4 * h * h);
  b.bpr = take(h);
  b.count = at;
  return b;
}

/// A stage's parameter vector (fp32): embedding group (wte (V, h) | wpe (positions, h)) on
/// stage 0, one group per block, head group (lnf gamma, beta (h) | W (h, V), or (V, h) when
/// tied | b (V)) on the last stage; offsets in elements.
struct GptStageParams {
  long long embed = 0;                                   ///< elements of the embedding group (0 unless dims.embeds)
  long long wpe = 0;                                     ///< offset of the position table
  long long blocks_begin = 0;                            ///< offset of block 0's group (= embed)
  GptBlockParams block{};                                ///< offsets inside every block's group
  long long head_begin = 0;                              ///< offset of the head group
  long long head = 0;                                    ///< elements of the head group (0 unless dims.has_head)
  long long lnfg = 0, lnfb = 0, head_w = 0, head_b = 0;  ///< offsets inside the head group
  long long total = 0;
  constexpr long long block_begin(int i) const { return blocks_begin + i * block.count; }
};
constexpr GptStageParams gpt_stage_params(const GptDims& d) {
  GptStageParams p;
  const long long h = d.hidden, V = d.vocab;
  p.embed = d.embeds ? (V + d.positions) * h : 0;
  p.wpe = V * h;
  p.blocks_begin = p.embed;
  p.block = gpt_block_params(h);
  p.head_begin = p.blocks_begin + d.blocks * p.block.count;
  p.head = d.has_head ? 2 * h + h * V + V : 0;
  p.lnfg = 0;
  p.lnfb = h;
  p.head_w = 2 * h;
  p.head_b = 2 * h + h * V;
  p.total = p.head_begin + p.head;
  return p;
}

/// norm_groups() of both implementations: one group per embedding, block and head, in model order.
inline std::vector<std::size_t> gpt_norm_groups(const GptDims& d) {
  const GptStageParams p = gpt_stage_params(d);
  std::vector<std::size_t> g;
  if (d.embeds) g.push_back(static_cast<std::size_t>(p.embed));
  for (int i = 0; i < d.blocks; ++i) g.push_back(static_cast<std::size_t>(p.block.count));
  if (d.has_head) g.push_back(static_cast<std::size_t>(p.head));
  return g;
}

/// parameter_info() of both implementations: the named tensors of the stage's parameter vector,
/// at gpt_stage_params' offsets. GPT-2's names; weights stored (in, out).
inline std::vector<ParamInfo> gpt_parameter_info(const GptDims& d) {
  const GptStageParams p = gpt_stage_params(d);
  const long long h = d.hidden, V = d.vocab;
  std::vector<ParamInfo> t;
  const auto add = [&t](std::string name, long long offset, std::vector<long long> shape) {
    t.push_back(ParamInfo{std::move(name), static_cast<std::size_t>(offset), std::move(shape)});
  };
  if (d.embeds) {
    add("wte", 0, {V, h});
    add("wpe", p.wpe, {d.positions, h});
  }
  const GptBlockParams& o = p.block;
  for (int i = 0; i < d.blocks; ++i) {
    const std::string b = "blocks." + std::to_string(d.first_block + i) + ".";
    const long long at = p.block_begin(i);
    add(b + "ln1.weight", at + o.ln1g, {h});
    add(b + "ln1.bias", at + o.ln1b, {h});
    add(b + "attn.qkv.weight", at + o.wqkv, {h, 3 * h});
    add(b + "attn.qkv.bias", at + o.bqkv, {3 * h});
    add(b + "attn.proj.weight", at + o.wo, {h, h});
    add(b + "attn.proj.bias", at + o.bo, {h});
    add(b + "ln2.weight", at + o.ln2g, {h});
    add(b + "ln2.bias", at + o.ln2b, {h});
    add(b + "mlp.fc.weight", at + o.wfc, {h, 4 * h});
    add(b + "mlp.fc.bias", at + o.bfc, {4 * h});
    add(b + "mlp.proj.weight", at + o.wpr, {4 * h, h});
    add(b + "mlp.proj.bias", at + o.bpr, {h});
  }
  if (d.has_head) {
    add("lnf.weight", p.head_begin + p.lnfg, {h});
    add("lnf.bias", p.head_begin + p.lnfb, {h});
    add("lm_head.weight", p.head_begin + p.head_w,
        d.tied ? std::vector<long long>{V, h} : std::vector<long long>{h, V});
    add("lm_head.bias", p.head_begin + p.head_b, {V});
  }
  return t;
}

/// shared_parameters() of both implementations: with tied embeddings, stage 0's `wte` and the
/// last stage's `lm_head.weight` under one key.
inline std::vector<SharedParam> gpt_shared_parameters(const GptDims& d) {
  std::vector<SharedParam> s;
  if (!d.tied) return s;
  if (d.embeds) s.push_back({"wte", "wte"});
  if (d.has_head) s.push_back({"lm_head.weight", "wte"});
  return s;
}

/// inputs() of both implementations: stage 0 reads the token ids, the last stage the next-token
/// targets, int32, one per token of the microbatch; packed, the embedding and every stage with
/// blocks read the rows' document offsets (int32, seq + 1 a row).
inline std::vector<InputSpec> gpt_inputs(const GptDims& d, MicrobatchShape sh) {
  const std::size_t tokens = static_cast<std::size_t>(sh.tokens());
  std::vector<InputSpec> in;
  if (d.embeds) in.push_back({"tokens", DType::int32, tokens});
  if (d.packed && (d.embeds || d.blocks > 0))
    in.push_back({document_offsets_input, DType::int32,
                  static_cast<std::size_t>(sh.batch) * (static_cast<std::size_t>(sh.seq) + 1)});
  if (d.has_head) in.push_back({"targets", DType::int32, tokens});
  return in;
}

/// The dims of stage `stage` of `stages` of the model `cfg` (checked).
inline GptDims gpt_dims(const GptConfig& cfg, int stage, int stages) {
  cfg.check();
  BlockRange r;
  if (cfg.stage_blocks.empty()) {
    r = gpt_blocks_of_stage(cfg.layers, stage, stages);
  } else {
    if (static_cast<int>(cfg.stage_blocks.size()) != stages || stage < 0 || stage >= stages)
      throw shape_error("gpt::gpt_dims: GptConfig::stage_blocks gives " + std::to_string(cfg.stage_blocks.size()) +
                        " stages; the pipeline has " + std::to_string(stages) + " (stage " + std::to_string(stage) +
                        ")");
    for (int s = 0; s < stage; ++s) r.first += cfg.stage_blocks[static_cast<std::size_t>(s)];
    r.count = cfg.stage_blocks[static_cast<std::size_t>(stage)];
  }
  return GptDims{cfg.vocab,           cfg.hidden,    cfg.heads,          cfg.seq,   r.first, r.count, stage == 0,
                 stage == stages - 1, cfg.recompute, cfg.tie_embeddings, cfg.packed};
}

}  // namespace pipeoffload::gpt
