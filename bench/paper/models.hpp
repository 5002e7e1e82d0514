// bench/paper/models.hpp: the paper's Table 2 models for the programs in bench/paper/, taken
// from the planner's presets (pipeoffload/plan/presets.hpp, "paper-*").
#pragma once

#include <pipeoffload/plan/presets.hpp>

#include <array>

namespace paper {

struct PaperModel {
  const char* name;                   // "5.8B" ... "83.8B", as the paper names them
  const pipeoffload::ModelPreset* p;  // its preset: shape, global batch, GPUs
  int gpus;                           // the pipeline's GPUs (the 5.8B model's Table 1 row uses 8)
};

inline const std::array<PaperModel, 6> models = [] {
  constexpr const char* names[] = {"5.8B", "10.5B", "18.1B", "42.9B", "66.6B", "83.8B"};
  std::array<PaperModel, 6> out{};
  for (std::size_t i = 0; i < out.size(); ++i) {
    const pipeoffload::ModelPreset& p = pipeoffload::model_presets[i];
    out[i] = {names[i], &p, p.gpus};
  }
  return out;
}();

/// The model with the paper's setting: its preset (sequence 4096, micro-batch 1, vocabulary
/// 51200, its global batch), with `recompute` as the paper does (GeLU and friends, its
/// Section 4.1) by default.
inline pipeoffload::TransformerSpec transformer(const PaperModel& pm, bool recompute = true) {
  pipeoffload::TransformerSpec m = pm.p->model;
  m.recompute = recompute;
  return m;
}

}  // namespace paper
