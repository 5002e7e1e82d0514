// pipeoffload/model/math.hpp: per-element and per-row math shared by every backend.
//
// Plain functions, no state, no allocation: the CPU backend calls them in loops and the CUDA
// kernels (issue 4) call the same functions from grid-stride loops, so the CPU tests cover the
// math the GPU runs (DESIGN.md section 6). Everything is float in, float out, with the
// accumulations the callers need spelled out (double where a sum must not depend on length).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define PIPEOFFLOAD_HOST_DEVICE __host__ __device__
#else
#define PIPEOFFLOAD_HOST_DEVICE
#endif

namespace pipeoffload::math {

// ---- GeLU (tanh approximation, as GPT-2) ------------------------------------------------

inline constexpr float gelu_c = 0.7978845608028654f;  // sqrt(2/pi)
inline constexpr float gelu_a = 0.044715f;

/// GeLU(x) = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
PIPEOFFLOAD_HOST_DEVICE inline float gelu(float x) {
  const float u = gelu_c * (x + gelu_a * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}

/// d GeLU / dx at x.
PIPEOFFLOAD_HOST_DEVICE inline float gelu_grad(float x) {
  const float u = gelu_c * (x + gelu_a * x * x * x);
  const float t = std::tanh(u);
  const float du = gelu_c * (1.0f + 3.0f * gelu_a * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// ---- LayerNorm ------------------------------------------------------------------------------

inline constexpr float layernorm_eps = 1e-5f;

/// Mean and reciprocal standard deviation of one row of n values (two passes, float sums in
/// index order: the same bits on every backend that sums in the same order).
struct RowStats {
  float mean = 0;
  float rstd = 0;
};

PIPEOFFLOAD_HOST_DEVICE inline RowStats row_stats(const float* x, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += x[i];
  const float mean = s / static_cast<float>(n);
  float v = 0;
  for (int i = 0; i < n; ++i) {
    const float d = x[i] - mean;
    v += d * d;
  }
  return {mean, 1.0f / std::sqrt(v / static_cast<float>(n) + layernorm_eps)};
}

/// y = (x - mean) * rstd * gamma + beta for one element.
PIPEOFFLOAD_HOST_DEVICE inline float layernorm_apply(float x, RowStats st, float gamma, float beta) {
  return (x - st.mean) * st.rstd * gamma + beta;
}

/// dx of one row of LayerNorm from dy (grad of the normalized output), the input x, its stats
/// and gamma: dx_i = rstd * (g_i - mean(g) - xhat_i * mean(g . xhat)), g = dy * gamma.
PIPEOFFLOAD_HOST_DEVICE inline void layernorm_backward_row(const float* dy, const float* x, RowStats st, const float* gamma,
                                                           float* dx, int n) {
  float sg = 0, sgx = 0;
  for (int i = 0; i < n; ++i) {
    const float g = dy[i] * gamma[i];
    sg += g;
    sgx += g * (x[i] - st.mean) * st.rstd;
  }
  sg /= static_cast<float>(n);
  sgx /= static_cast<float>(n);
  for (int i = 0; i < n; ++i) {
    const float xhat = (x[i] - st.mean) * st.rstd;
    dx[i] = st.rstd * (dy[i] * gamma[i] - sg - xhat * sgx);
  }
}

// ---- Dropout with a counter-based RNG ---------------------------------------------------------

/// A 64-bit mix of (seed, counter): the mask bit of element i of one tensor is a pure function
/// of the tensor's seed and i, so backward regenerates it instead of saving it.
PIPEOFFLOAD_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t seed, std::uint64_t counter) {
  std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * (counter + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Seed of one dropout site: a function of the run seed and (step, stage, layer, site, mb).
PIPEOFFLOAD_HOST_DEVICE inline std::uint64_t dropout_seed(std::uint64_t run_seed, int step, int layer, int site, int mb) {
  std::uint64_t s = mix64(run_seed, static_cast<std::uint64_t>(step));
  s = mix64(s, static_cast<std::uint64_t>(layer));
  s = mix64(s, static_cast<std::uint64_t>(site));
  return mix64(s, static_cast<std::uint64_t>(mb));
}

/// Keep element i? (probability 1 - p). Uses the top 24 bits as a uniform in [0, 1).
PIPEOFFLOAD_HOST_DEVICE inline bool dropout_keep(std::uint64_t seed, std::uint64_t i, float p) {
  const float u = static_cast<float>(mix64(seed, i) >> 40) * (1.0f / 16777216.0f);
  return u >= p;
}

/// Dropout's forward and backward factor of element i: 0 or 1/(1-p).
PIPEOFFLOAD_HOST_DEVICE inline float dropout_scale(std::uint64_t seed, std::uint64_t i, float p) {
  return p <= 0.0f ? 1.0f : (dropout_keep(seed, i, p) ? 1.0f / (1.0f - p) : 0.0f);
}

// ---- Softmax cross-entropy ----------------------------------------------------------------------

/// Loss of one row of n logits against `target`, and (when dlogits is not null) its gradient
/// times `scale`: scale * (softmax(logits) - onehot(target)).
PIPEOFFLOAD_HOST_DEVICE inline float softmax_xent_row(const float* logits, int n, int target, float scale, float* dlogits) {
  float mx = logits[0];
  for (int i = 1; i < n; ++i) mx = logits[i] > mx ? logits[i] : mx;
  float sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(logits[i] - mx);
  const float lse = mx + std::log(sum);
  if (dlogits != nullptr) {
    for (int i = 0; i < n; ++i) {
      const float p = std::exp(logits[i] - lse);
      dlogits[i] = scale * (p - (i == target ? 1.0f : 0.0f));
    }
  }
  return lse - logits[target];
}

// ---- AdamW and the learning-rate schedule --------------------------------------------------------

struct AdamW {
  float lr = 3e-4f;          ///< peak learning rate
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  int warmup_steps = 10;     ///< linear warmup from lr/warmup to lr
  int total_steps = 1000;    ///< cosine decay from lr to min_lr_ratio*lr at this step
  float min_lr_ratio = 0.1f;
  float clip = 1.0f;         ///< global gradient-norm clip (<= 0: no clip)
};

/// Learning rate at 0-based step t: linear warmup over warmup_steps, then cosine to
/// min_lr_ratio * lr at total_steps, flat after.
PIPEOFFLOAD_HOST_DEVICE inline float learning_rate(const AdamW& o, int t) {
  if (t < o.warmup_steps) return o.lr * static_cast<float>(t + 1) / static_cast<float>(o.warmup_steps);
  const int span = o.total_steps - o.warmup_steps;
  if (span <= 0 || t >= o.total_steps) return o.lr * o.min_lr_ratio;
  const double frac = static_cast<double>(t - o.warmup_steps) / static_cast<double>(span);
  const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * frac));
  return static_cast<float>(o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine));
}

/// Bias corrections 1 - beta1^t and 1 - beta2^t of 1-based step t (once per step, not per element).
struct AdamBias {
  float c1 = 1;
  float c2 = 1;
};
PIPEOFFLOAD_HOST_DEVICE inline AdamBias adam_bias(const AdamW& o, int t) {
  return {1.0f - std::pow(o.beta1, static_cast<float>(t)), 1.0f - std::pow(o.beta2, static_cast<float>(t))};
}

/// One AdamW update of one parameter (decoupled weight decay); `g` is already clipped.
PIPEOFFLOAD_HOST_DEVICE inline void adamw_update(float& p, float g, float& m, float& v, const AdamW& o, float lr, AdamBias bc) {
  m = o.beta1 * m + (1.0f - o.beta1) * g;
  v = o.beta2 * v + (1.0f - o.beta2) * g * g;
  const float mhat = m / bc.c1;
  const float vhat = v / bc.c2;
  p -= lr * (mhat / (std::sqrt(vhat) + o.eps) + o.weight_decay * p);
}

}  // namespace pipeoffload::math
