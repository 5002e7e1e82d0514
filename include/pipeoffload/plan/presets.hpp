// pipeoffload/plan/presets.hpp: named model shapes for the planner (pipeoffload-plan --auto
// --model NAME): the paper's Table 2 models and Llama-3-class ones, one definition that the
// plan tool, bench/paper and the tests read.
/// @file
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "model.hpp"

namespace pipeoffload {

/// A model shape with a name, and the GPU count its source trains it on.
struct ModelPreset {
  std::string_view name;  ///< what --model takes, e.g. "paper-42.9b", "llama3-8b"
  std::string_view what;  ///< where the shape comes from, one line
  TransformerSpec model;  ///< the shape, its global batch and sequence length; recompute off
  int gpus = 0;           ///< the pipeline's GPUs in the source (the paper's Table 2); 0 if none
};

namespace detail {
/// The paper's Table 2 models: sequence 4096, micro-batch 1, vocabulary 51200, 8 query groups,
/// GPT layers (4h GeLU MLP).
constexpr ModelPreset paper_model(std::string_view name, int layers, int heads, int hidden, int batch, int gpus) {
  return {name, "the PipeOffload paper's Table 2 (GPT layers, 8 query groups, seq 4096, vocab 51200)",
          TransformerSpec{.layers = layers,
                          .hidden = hidden,
                          .heads = heads,
                          .query_groups = 8,
                          .seq = 4096,
                          .micro_batch = 1,
                          .global_batch = batch,
                          .vocab = 51200},
          gpus};
}
/// Meta's Llama 3: SwiGLU, grouped-query attention (8 groups), untied 128256-token vocabulary,
/// sequence 8192; a global batch of 512 sequences (4M tokens).
constexpr ModelPreset llama3(std::string_view name, int layers, int heads, int hidden, int ffn) {
  return {name, "Meta's Llama 3 (SwiGLU, 8 query groups, untied vocab 128256, seq 8192; 512 sequences a step)",
          TransformerSpec{.layers = layers,
                          .hidden = hidden,
                          .heads = heads,
                          .query_groups = 8,
                          .seq = 8192,
                          .micro_batch = 1,
                          .global_batch = 512,
                          .vocab = 128256,
                          .ffn_hidden = ffn,
                          .swiglu = true},
          0};
}
}  // namespace detail

/// Every preset, in size order within each family. The paper's 5.8B runs on 2 to 32 GPUs
/// there; its Table 1 row (and `gpus` here) uses 8.
inline constexpr std::array<ModelPreset, 8> model_presets = {
    detail::paper_model("paper-5.8b", 32, 32, 4096, 32, 8),
    detail::paper_model("paper-10.5b", 38, 40, 5120, 64, 8),
    detail::paper_model("paper-18.1b", 46, 48, 6144, 128, 16),
    detail::paper_model("paper-42.9b", 62, 64, 8192, 256, 32),
    detail::paper_model("paper-66.6b", 62, 80, 10240, 256, 32),
    detail::paper_model("paper-83.8b", 78, 80, 10240, 256, 32),
    detail::llama3("llama3-8b", 32, 32, 4096, 14336),
    detail::llama3("llama3-70b", 80, 64, 8192, 28672),
};

/// The preset called `name`, or null.
constexpr const ModelPreset* find_model_preset(std::string_view name) {
  for (const ModelPreset& p : model_presets)
    if (p.name == name) return &p;
  return nullptr;
}

/// The presets' names, comma-separated (for messages and --help).
inline std::string model_preset_names() {
  std::string s;
  for (const ModelPreset& p : model_presets) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

}  // namespace pipeoffload
