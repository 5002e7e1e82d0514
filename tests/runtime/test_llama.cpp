// tests/runtime: the Llama-class reference model (models/llama/cpu.hpp): its loss and every
// gradient against an independent float64 implementation written here from the model's
// definition (RMSNorm, RoPE, grouped-query causal attention, SwiGLU, tied or untied output),
// pipelined training under every schedule family bit-identical to one rank, and the planner's
// Llama-class layer counting its parameters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <models/llama/cpu.hpp>
#include <pipeoffload/plan/model.hpp>
#include <pipeoffload/runtime.hpp>

#include "pipeline_run.hpp"

namespace {

using po::llama::LlamaConfig;
using po::llama::LlamaStage;

/// The tensor `name` of a one-stage model's parameters, as doubles.
struct Tensors {
  std::vector<po::ParamInfo> info;
  const std::vector<double>* p;
  const double* operator[](const std::string& name) const {
    for (const po::ParamInfo& t : info)
      if (t.name == name) return p->data() + t.offset;
    FAIL("no tensor " << name);
    return nullptr;
  }
};

/// y (rows x n) = x (rows x k) w (k x n), or w^T when `wt` (w then n x k).
std::vector<double> matmul(const std::vector<double>& x, const double* w, std::size_t rows, std::size_t k,
                           std::size_t n, bool wt = false) {
  std::vector<double> y(rows * n, 0.0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t i = 0; i < k; ++i) s += x[r * k + i] * (wt ? w[j * k + i] : w[i * n + j]);
      y[r * n + j] = s;
    }
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const double* g, std::size_t rows, std::size_t h,
                            double eps) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::size_t i = 0; i < h; ++i) ss += x[r * h + i] * x[r * h + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(h) + eps);
    for (std::size_t i = 0; i < h; ++i) y[r * h + i] = x[r * h + i] * inv * g[i];
  }
  return y;
}

/// The model's mean loss over one microbatch, in float64, from its definition.
double reference_loss(const LlamaConfig& cfg, const std::vector<double>& params, const std::vector<std::int32_t>& tok,
                      const std::vector<std::int32_t>& tgt, po::MicrobatchShape sh) {
  const po::llama::LlamaDims d = po::llama::llama_dims(cfg, 0, 1);
  const Tensors w{po::llama::llama_parameter_info(d), &params};
  const std::size_t T = static_cast<std::size_t>(sh.tokens()), S = static_cast<std::size_t>(sh.seq),
                    h = static_cast<std::size_t>(cfg.hidden), A = static_cast<std::size_t>(cfg.heads),
                    KV = static_cast<std::size_t>(cfg.kv_heads), dh = h / A, kv = KV * dh,
                    f = static_cast<std::size_t>(cfg.ffn_width()), V = static_cast<std::size_t>(cfg.vocab);
  const double eps = cfg.norm_eps;
  std::vector<double> x(T * h);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < h; ++i)
      x[t * h + i] = w["tok_embeddings.weight"][static_cast<std::size_t>(tok[t]) * h + i];
  const auto rope = [&](std::vector<double>& y, std::size_t width) {
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t e = 0; e < width; e += dh)
        for (std::size_t j = 0; j < dh / 2; ++j) {
          const double angle = static_cast<double>(t % S) *
                               std::pow(static_cast<double>(cfg.rope_theta), -2.0 * j / static_cast<double>(dh));
          double& a = y[t * width + e + 2 * j];
          double& b = y[t * width + e + 2 * j + 1];
          const double a0 = a, b0 = b;
          a = a0 * std::cos(angle) - b0 * std::sin(angle);
          b = a0 * std::sin(angle) + b0 * std::cos(angle);
        }
  };
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::vector<double> a = rmsnorm(x, w[p + "attention_norm.weight"], T, h, eps);
    std::vector<double> q = matmul(a, w[p + "attention.wq.weight"], T, h, h),
                        k = matmul(a, w[p + "attention.wk.weight"], T, h, kv),
                        v = matmul(a, w[p + "attention.wv.weight"], T, h, kv);
    rope(q, h);
    rope(k, kv);
    std::vector<double> att(T * h, 0.0);
    for (std::size_t b = 0; b < T / S; ++b)
      for (std::size_t head = 0; head < A; ++head) {
        const std::size_t g = head / (A / KV);
        for (std::size_t i = 0; i < S; ++i) {
          std::vector<double> s(i + 1);
          double mx = -1e300;
          for (std::size_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (std::size_t e = 0; e < dh; ++e)
              dot += q[(b * S + i) * h + head * dh + e] * k[(b * S + j) * kv + g * dh + e];
            s[j] = dot / std::sqrt(static_cast<double>(dh));
            mx = std::max(mx, s[j]);
          }
          double z = 0;
          for (double& sj : s) z += (sj = std::exp(sj - mx));
          for (std::size_t j = 0; j <= i; ++j)
            for (std::size_t e = 0; e < dh; ++e)
              att[(b * S + i) * h + head * dh + e] += s[j] / z * v[(b * S + j) * kv + g * dh + e];
        }
      }
    const std::vector<double> o = matmul(att, w[p + "attention.wo.weight"], T, h, h);
    for (std::size_t e = 0; e < T * h; ++e) x[e] += o[e];
    const std::vector<double> a2 = rmsnorm(x, w[p + "ffn_norm.weight"], T, h, eps);
    const std::vector<double> gate = matmul(a2, w[p + "feed_forward.w1.weight"], T, h, f),
                              up = matmul(a2, w[p + "feed_forward.w3.weight"], T, h, f);
    std::vector<double> hid(T * f);
    for (std::size_t e = 0; e < T * f; ++e) hid[e] = gate[e] / (1.0 + std::exp(-gate[e])) * up[e];
    const std::vector<double> down = matmul(hid, w[p + "feed_forward.w2.weight"], T, f, h);
    for (std::size_t e = 0; e < T * h; ++e) x[e] += down[e];
  }
  const std::vector<double> a = rmsnorm(x, w["norm.weight"], T, h, eps);
  const std::vector<double> logits = matmul(a, w["output.weight"], T, h, V, cfg.tie_embeddings);
  double loss = 0;
  for (std::size_t t = 0; t < T; ++t) {
    double mx = -1e300, z = 0;
    for (std::size_t j = 0; j < V; ++j) mx = std::max(mx, logits[t * V + j]);
    for (std::size_t j = 0; j < V; ++j) z += std::exp(logits[t * V + j] - mx);
    loss += mx + std::log(z) - logits[t * V + static_cast<std::size_t>(tgt[t])];
  }
  return loss / static_cast<double>(T);
}

/// The fp32 model's loss and gradients for one microbatch, its passes called directly.
double model_pass(LlamaStage& st, const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                  po::MicrobatchShape sh, std::vector<float>& grads) {
  po::backend::CpuContext ctx;
  const std::vector<po::StepInput> in = {{"tokens", po::ConstTensor(po::view(tok)), po::ConstTensor(po::view(tok))},
                                         {"targets", po::ConstTensor(po::view(tgt)), po::ConstTensor(po::view(tgt))}};
  float loss = 0;
  po::Microbatch mb;
  mb.shape = sh;
  mb.inputs = in;
  mb.loss = &loss;
  std::vector<std::byte> saved(st.saved_bytes(sh)), stash(st.stash_bytes(sh));
  st.forward(ctx, mb, {}, {}, saved.data());
  for (float& g : st.gradients()) g = 0;
  st.backward_input(ctx, mb, {}, {}, saved.data(), stash.data());
  st.backward_weight(ctx, mb, saved.data(), stash.data());
  grads.assign(st.gradients().begin(), st.gradients().end());
  return loss;
}

}  // namespace

TEST_CASE("Llama: the loss and every gradient match an independent float64 model (GQA, MHA, tied, untied)") {
  const po::MicrobatchShape sh{2, 6};  // two sequences: positions restart at the second
  for (const auto& [kv_heads, tied] : {std::pair{2, false}, std::pair{4, true}, std::pair{1, true}}) {
    CAPTURE(kv_heads);
    CAPTURE(tied);
    const LlamaConfig cfg{.vocab = 32,
                          .hidden = 16,
                          .heads = 4,
                          .kv_heads = kv_heads,
                          .ffn = 24,
                          .layers = 2,
                          .seq = 8,
                          .rope_theta = 500.0f,
                          .tie_embeddings = tied,
                          .seed = 3};
    LlamaStage st(cfg, 0, 1);
    // Larger weights than the init's and norm gains away from 1, so every path matters.
    auto p = st.parameters();
    for (std::size_t i = 0; i < p.size(); ++i)
      p[i] += 0.3f * (static_cast<float>(po::ops::mix64(9, i) >> 40) / 16777216.0f - 0.5f);
    std::vector<std::int32_t> tok(12), tgt(12);
    for (std::size_t i = 0; i < 12; ++i) {
      tok[i] = static_cast<std::int32_t>((i * 7 + 3) % 32);
      tgt[i] = static_cast<std::int32_t>((i * 11 + 5) % 32);
    }
    std::vector<float> grads;
    const double loss = model_pass(st, tok, tgt, sh, grads);
    std::vector<double> ref(p.begin(), p.end());
    const double want = reference_loss(cfg, ref, tok, tgt, sh);
    CHECK(std::abs(loss - want) <= 2e-6 * std::abs(want));
    // Every tensor: central differences of the float64 loss at a few of its elements.
    const double h = 1e-4;
    int checked = 0;
    double worst = 0;
    for (const po::ParamInfo& t : st.parameter_info()) {
      CAPTURE(t.name);
      const std::size_t n = t.count();
      double scale = 0;  // the tensor's largest gradient: errors are relative to it
      for (std::size_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(static_cast<double>(grads[t.offset + i])));
      for (std::size_t k = 0; k < 4; ++k) {
        const std::size_t i = t.offset + (k * 7919 + 13) % n;
        const double keep = ref[i];
        ref[i] = keep + h;
        const double up = reference_loss(cfg, ref, tok, tgt, sh);
        ref[i] = keep - h;
        const double down = reference_loss(cfg, ref, tok, tgt, sh);
        ref[i] = keep;
        const double numeric = (up - down) / (2 * h), err = std::abs(grads[i] - numeric) / std::max(scale, 1e-6);
        CAPTURE(i);
        CAPTURE(numeric);
        CHECK(err < 1e-3);
        worst = std::max(worst, err);
        ++checked;
      }
    }
    MESSAGE("kv_heads " << kv_heads << std::string(tied ? ", tied" : ", untied") << ": " << checked
                        << " gradients, worst error " << worst << " of the tensor's largest");
  }
}

TEST_CASE("Llama: pipelined training is bit-identical to one rank under every family, tied and untied, dp 2") {
  const int steps = 3;
  for (const bool tied : {false, true}) {
    CAPTURE(tied);
    const pipeline_test::RunOptions<LlamaConfig> o{
        .cfg = {.vocab = 64, .hidden = 16, .heads = 4, .kv_heads = 2, .layers = 4, .seq = 8, .tie_embeddings = tied}};
    pipeline_test::check_every_family<LlamaStage>(o, steps);
    // Two replicas with ZeRO-1 of half the microbatches each: the same global batch.
    pipeline_test::check_two_replicas<LlamaStage>(o, steps, "zb-v");
  }
}

TEST_CASE("Llama: the planner's Llama-class layer counts the model's parameters exactly, stage by stage") {
  for (const int kv_heads : {1, 2, 8})
    for (const int stages : {1, 3, 5}) {
      CAPTURE(kv_heads);
      CAPTURE(stages);
      const po::TransformerSpec m{.layers = 6,
                                  .hidden = 64,
                                  .heads = 8,
                                  .query_groups = kv_heads,
                                  .seq = 16,
                                  .vocab = 100,
                                  .ffn_hidden = 160,
                                  .swiglu = true};
      LlamaConfig cfg{.vocab = 100, .hidden = 64, .heads = 8, .kv_heads = kv_heads, .ffn = 160, .layers = 6, .seq = 16};
      const std::vector<po::StageContent> cut = po::stage_layout(m, stages);
      for (const po::StageContent& c : cut) cfg.stage_blocks.push_back(c.layers);
      for (int s = 0; s < stages; ++s) {
        const po::llama::LlamaDims d = po::llama::llama_dims(cfg, s, stages);
        CHECK(po::stage_parameters(m, cut[static_cast<std::size_t>(s)]) ==
              static_cast<double>(po::llama::llama_stage_params(d).total));
        if (d.has_head) {  // and the tied output weight where the planner takes it (head_weight_range)
          cfg.tie_embeddings = true;
          const po::ParamRange r = po::head_weight_range(m, cut[static_cast<std::size_t>(s)]);
          const po::llama::LlamaStageParams p = po::llama::llama_stage_params(po::llama::llama_dims(cfg, s, stages));
          CHECK(r.begin == static_cast<std::size_t>(p.head_begin + p.head_w));
          CHECK(r.size() == static_cast<std::size_t>(100 * 64));
          cfg.tie_embeddings = false;
        }
      }
    }
}
