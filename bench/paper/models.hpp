// bench/paper/models.hpp: the paper's Table 2 models, as the planner's TransformerSpec, for the
// programs in bench/paper/.
#pragma once

#include <pipeoffload/plan/model.hpp>

namespace paper {

struct PaperModel {
  const char* name;
  int layers, heads, hidden, batch, gpus;
};

// The paper's Table 2 (all with 8 query groups). The 5.8B model runs on 2-32 GPUs there; its
// Table 1 row uses 8.
inline constexpr PaperModel models[] = {
    {"5.8B", 32, 32, 4096, 32, 8},    {"10.5B", 38, 40, 5120, 64, 8},    {"18.1B", 46, 48, 6144, 128, 16},
    {"42.9B", 62, 64, 8192, 256, 32}, {"66.6B", 62, 80, 10240, 256, 32}, {"83.8B", 78, 80, 10240, 256, 32},
};

/// The model with the paper's setting: sequence 4096, micro-batch 1, vocabulary 51200, its
/// global batch; `recompute` as the paper does (GeLU and friends, its Section 4.1) by default.
inline pipeoffload::TransformerSpec transformer(const PaperModel& pm, bool recompute = true) {
  pipeoffload::TransformerSpec m;
  m.layers = pm.layers;
  m.hidden = pm.hidden;
  m.heads = pm.heads;
  m.query_groups = 8;
  m.seq = 4096;
  m.micro_batch = 1;
  m.global_batch = pm.batch;
  m.vocab = 51200;
  m.recompute = recompute;
  return m;
}

}  // namespace paper
