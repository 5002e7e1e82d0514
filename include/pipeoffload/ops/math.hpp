// pipeoffload/ops/math.hpp: per-element and per-row math for layers (po::ops), shared by CPU
// code and CUDA kernels: exp and tanh without libm, GeLU, LayerNorm and RMSNorm rows, SiLU,
// rotary embeddings, dropout masks from a counter, softmax cross-entropy.
//
// Plain functions, no state, no allocation: CPU code (ops/cpu.hpp, the sample models) calls
// them in loops and CUDA kernels call the same functions from grid-stride loops, so the CPU
// tests cover the math the GPU runs (docs/design.md section 6). Everything is float in, float out, with the
// accumulations the callers need spelled out (double where a sum must not depend on length).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include <pipeoffload/detail/host_device.hpp>

namespace pipeoffload::ops {

/// The element type a context's ops store activations and working parameters in: float with
/// backend::CpuContext (ops/cpu.hpp), bf16 with backend::CudaContext (ops/cuda.hpp), so a layer
/// templated on its context writes `using T = ops::value_t<Context>;`. Statistics, gradients
/// and losses are float on both.
template <class Context>
struct context_value;
/// context_value's type.
template <class Context>
using value_t = typename context_value<Context>::type;

// ---- Branch-free exp and tanh ------------------------------------------------------------------
//
// The block's element-wise work is GeLU (a tanh per element of the (T, 4h) MLP activation,
// forward, backward and recompute) and the attention softmax (an exp per score). libm's
// tanhf and expf are scalar calls, and tanhf alone took a quarter of a GPT block's F+B+W on
// one core. These are pure arithmetic (no table, no branch, no libm) so a loop over them
// vectorises, and a GPU runs the same operations. Both are deterministic: the same input
// gives the same bits in a SIMD lane and in scalar code (no operation depends on position).
//
// GCC will not if-convert `c ? a : b` when computing `a` could raise a floating-point
// exception (-ftrapping-math, the default), which stops vectorisation; select() blends bits
// of two values that are both already computed, which it can.

/// The bits of a float, and the float of some bits.
PIPEOFFLOAD_HOST_DEVICE inline std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(__float_as_uint(x));
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}
PIPEOFFLOAD_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

/// c ? a : b by masking bits (both sides already computed; see above).
PIPEOFFLOAD_HOST_DEVICE inline float select(bool c, float a, float b) {
  const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
  return bits_float((float_bits(a) & m) | (float_bits(b) & ~m));
}

/// e^x. Relative error below 1.5e-7 (about 2 ulp) for x in [-87, 88] (tests/runtime/test_gpt.cpp
/// asserts it against double exp); 0 below -87.5, +inf above 88.5, NaN for NaN.
/// x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor polynomial to degree 7 (truncation below
/// 5e-9 relative), 2^n put straight into the exponent bits.
PIPEOFFLOAD_HOST_DEVICE inline float exp_approx(float x) {
  const float xc = select(x < -87.0f, -87.0f, select(x > 88.0f, 88.0f, x));  // 2^n stays a normal float
  // Adding 1.5 * 2^23 rounds x / ln2 to an integer n and leaves n in the low mantissa bits.
  const float shifter = 12582912.0f;
  const float t = xc * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  // r = x - n ln2 with ln2 split in two (Cody and Waite), so r keeps its bits for |n| <= 127.
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float y = p * bits_float((float_bits(t) - float_bits(shifter) + 127u) << 23);
  return select(x < -87.5f, 0.0f, select(x > 88.5f, INFINITY, y));
}

/// tanh(x). Absolute error below 1.5e-7 everywhere, relative error below 5e-7 (tests assert
/// both against double tanh); tanh(+-inf) = +-1, NaN for NaN.
/// |x| < 0.25: the odd Taylor series to x^9 (next term below 1e-8 relative); above,
/// 1 - 2 / (e^{2|x|} + 1). The sign is copied back from x.
PIPEOFFLOAD_HOST_DEVICE inline float tanh_approx(float x) {
  const float a = x < 0.0f ? -x : x;
  const float a2 = a * a;
  float s = 62.0f / 2835.0f;
  s = s * a2 - 17.0f / 315.0f;
  s = s * a2 + 2.0f / 15.0f;
  s = s * a2 - 1.0f / 3.0f;
  s = s * a2 * a + a;
  const float big = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  const float m = select(a < 0.25f, s, big);
  return bits_float(float_bits(m) | (float_bits(x) & 0x80000000u));
}

// ---- GeLU (tanh approximation, as GPT-2) ------------------------------------------------

inline constexpr float gelu_c = 0.7978845608028654f;  // sqrt(2/pi)
inline constexpr float gelu_a = 0.044715f;

/// GeLU(x) = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with tanh_approx (vectorises).
PIPEOFFLOAD_HOST_DEVICE inline float gelu(float x) {
  const float u = gelu_c * (x + gelu_a * x * x * x);
  return 0.5f * x * (1.0f + tanh_approx(u));
}

/// d GeLU / dx at x (the derivative of the formula above, with the same tanh_approx).
PIPEOFFLOAD_HOST_DEVICE inline float gelu_grad(float x) {
  const float u = gelu_c * (x + gelu_a * x * x * x);
  const float t = tanh_approx(u);
  const float du = gelu_c * (1.0f + 3.0f * gelu_a * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// ---- LayerNorm ------------------------------------------------------------------------------

/// The GPT's LayerNorm epsilon.
inline constexpr float layernorm_eps = 1e-5f;

/// A row's LayerNorm statistics.
struct RowStats {
  float mean = 0;  ///< the row's mean
  float rstd = 0;  ///< 1 / sqrt(variance + layernorm_eps)
};

/// Mean and reciprocal standard deviation of one row of n values (two passes, float sums in
/// index order: the same bits on every backend that sums in the same order).
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
PIPEOFFLOAD_HOST_DEVICE inline void layernorm_backward_row(const float* dy, const float* x, RowStats st,
                                                           const float* gamma, float* dx, int n) {
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

/// Row statistics from a row's mean and its sum of squared deviations from that mean: the
/// second half of row_stats, for kernels that compute the two sums with a block reduction
/// (row_stats(x, n) == row_stats_finish(mean, sum (x_i - mean)^2, n) for the same sums).
PIPEOFFLOAD_HOST_DEVICE inline RowStats row_stats_finish(float mean, float sum_sq_dev, int n) {
  return {mean, 1.0f / std::sqrt(sum_sq_dev / static_cast<float>(n) + layernorm_eps)};
}

/// One element of layernorm_backward_row, given the row means of g = dy * gamma and of
/// g * xhat (mean_g, mean_gxhat): the per-element half, for kernels that reduce per block.
PIPEOFFLOAD_HOST_DEVICE inline float layernorm_backward_elem(float dy, float x, RowStats st, float gamma, float mean_g,
                                                             float mean_gxhat) {
  const float xhat = (x - st.mean) * st.rstd;
  return st.rstd * (dy * gamma - mean_g - xhat * mean_gxhat);
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
PIPEOFFLOAD_HOST_DEVICE inline std::uint64_t dropout_seed(std::uint64_t run_seed, int step, int layer, int site,
                                                          int mb) {
  std::uint64_t s = mix64(run_seed, static_cast<std::uint64_t>(step));
  s = mix64(s, static_cast<std::uint64_t>(layer));
  s = mix64(s, static_cast<std::uint64_t>(site));
  return mix64(s, static_cast<std::uint64_t>(mb));
}

/// The seed of one dropout site as a pass hands it to the dropout ops: dropout_seed(run_seed,
/// step, layer, site, mb), with the step read where the mask is made from `step_at` (device
/// memory, Microbatch::device_step) when that is set, else `step`. A pass captured in a CUDA
/// graph (RuntimeOptions::graphs) is replayed at later steps: the kernel reads the step then.
struct DropoutSeed {
  std::uint64_t run_seed = 0;             ///< the run's seed
  int step = 0;                           ///< the optimizer step (when step_at is null)
  const std::int32_t* step_at = nullptr;  ///< the step in device memory, read at run time (null: `step`)
  int layer = 0,                          ///< the layer (block) index in the model
      site = 0,                           ///< which dropout of the layer
      mb = 0;                             ///< the microbatch index within the step
  /// The seed: dropout_seed of the fields, the step from step_at where set.
  PIPEOFFLOAD_HOST_DEVICE std::uint64_t value() const {
    return dropout_seed(run_seed, step_at != nullptr ? *step_at : step, layer, site, mb);
  }
};

/// Keep element i? (probability 1 - p). Uses the top 24 bits as a uniform in [0, 1).
PIPEOFFLOAD_HOST_DEVICE inline bool dropout_keep(std::uint64_t seed, std::uint64_t i, float p) {
  const float u = static_cast<float>(mix64(seed, i) >> 40) * (1.0f / 16777216.0f);
  return u >= p;
}

/// Dropout's factor for an element whose keep decision is `kept`: 0 or 1/(1-p), and 1 when
/// p <= 0. With recompute off the GPT saves the decision as a byte and backward calls this.
PIPEOFFLOAD_HOST_DEVICE inline float dropout_mask_scale(bool kept, float p) {
  return select(p <= 0.0f, 1.0f, select(kept, 1.0f / (1.0f - p), 0.0f));
}

/// Dropout's forward and backward factor of element i: 0 or 1/(1-p).
/// Branch-free (select), so loops over it vectorise; 1/(1-p) is loop-invariant.
PIPEOFFLOAD_HOST_DEVICE inline float dropout_scale(std::uint64_t seed, std::uint64_t i, float p) {
  return dropout_mask_scale(dropout_keep(seed, i, p), p);
}

// ---- Softmax cross-entropy ----------------------------------------------------------------------

/// Loss of one row of n logits against `target`, and (when dlogits is not null) its gradient
/// times `scale`: scale * (softmax(logits) - onehot(target)). dlogits may be logits itself (the
/// target's logit is read before any gradient is written).
PIPEOFFLOAD_HOST_DEVICE inline float softmax_xent_row(const float* logits, int n, int target, float scale,
                                                      float* dlogits) {
  const float target_logit = logits[target];
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
  return lse - target_logit;
}

/// Residual plus dropped-out branch of one element: x + y * dropout_scale(seed, i, p), as the
/// GPT block's two residual sites compute it.
PIPEOFFLOAD_HOST_DEVICE inline float residual_dropout(float x, float y, std::uint64_t seed, std::uint64_t i, float p) {
  return x + y * dropout_scale(seed, i, p);
}

/// One element of softmax_xent_row's gradient from the row's log-sum-exp `lse`:
/// scale * (exp(logit - lse) - [i == target]).
PIPEOFFLOAD_HOST_DEVICE inline float softmax_xent_grad(float logit, float lse, bool is_target, float scale) {
  return scale * (std::exp(logit - lse) - (is_target ? 1.0f : 0.0f));
}

// ---- The embedding's gradient ---------------------------------------------------------------

/// What the thread that owns the token-table cells (t, c) for the tokens t of `bucket` (t %
/// buckets == bucket) does (cuda::embedding_cell_owner): for r = 0, 1, ..., rows - 1 in order,
/// when tokens[r] is in [0, vocab) and in the bucket, dwte[tokens[r] * h + c] += grad(r * h + c).
/// Each cell thus adds its token's rows in row order, as the CPU model's loop does. `grad`
/// reads one value of the (rows, h) gradient (bf16 on the GPU, float in tests).
template <class Grad>
PIPEOFFLOAD_HOST_DEVICE inline void embedding_grad_cells(const std::int32_t* tokens, long long rows, const Grad& grad,
                                                         float* dwte, long long h, int vocab, unsigned bucket,
                                                         unsigned buckets, long long c) {
  for (long long r = 0; r < rows; ++r) {
    const std::int32_t t = tokens[r];
    if (t >= 0 && t < vocab && static_cast<unsigned>(t) % buckets == bucket)
      dwte[static_cast<long long>(t) * h + c] += grad(r * h + c);
  }
}

// ---- RMSNorm, SiLU, rotary embeddings (the Llama-class layer) -------------------------------

/// rmsnorm_rstd's second half, from a row's sum of squares (kernels that sum with a block
/// reduction): rmsnorm_rstd(x, n, eps) == rmsnorm_rstd_finish(sum x_i^2, n, eps) for that sum.
PIPEOFFLOAD_HOST_DEVICE inline float rmsnorm_rstd_finish(float sum_sq, int n, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

/// 1 / sqrt(mean(x^2) + eps) of one row of n values (a float sum in index order).
PIPEOFFLOAD_HOST_DEVICE inline float rmsnorm_rstd(const float* x, int n, float eps) {
  float ss = 0;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  return rmsnorm_rstd_finish(ss, n, eps);
}

/// One element of rmsnorm_backward_row given c = rstd^3 * mean(dy g x) (the row's reduction),
/// added to `acc` (0, or dx's value when accumulating) in the row function's order.
PIPEOFFLOAD_HOST_DEVICE inline float rmsnorm_backward_elem(float acc, float dy, float x, float rstd, float g, float c) {
  return acc + rstd * g * dy - x * c;
}

/// dx of one row of y = x * rstd * g from dy: dx_i = rstd g_i dy_i - x_i rstd^3 mean(dy g x);
/// added to dx when `accumulate`.
PIPEOFFLOAD_HOST_DEVICE inline void rmsnorm_backward_row(const float* dy, const float* x, float rstd, const float* g,
                                                         float* dx, int n, bool accumulate) {
  float dot = 0;
  for (int i = 0; i < n; ++i) dot += dy[i] * g[i] * x[i];
  const float c = rstd * rstd * rstd * dot * (1.0f / static_cast<float>(n));
  for (int i = 0; i < n; ++i) dx[i] = rmsnorm_backward_elem(accumulate ? dx[i] : 0.0f, dy[i], x[i], rstd, g[i], c);
}

/// SiLU(x) = x sigmoid(x), with exp_approx.
PIPEOFFLOAD_HOST_DEVICE inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

/// d SiLU / dx at x: sigmoid(x) (1 + x (1 - sigmoid(x))).
PIPEOFFLOAD_HOST_DEVICE inline float silu_grad(float x) {
  const float sg = 1.0f / (1.0f + exp_approx(-x));
  return sg * (1.0f + x * (1.0f - sg));
}

/// A rotary table as the ops read it: cos and sin of position p and pair j at p * head_dim / 2
/// + j, for positions p in [0, positions) (host memory for the CPU ops, device memory for the
/// CUDA ones; ops::RopeTable computes it).
struct RopeView {
  int positions = 0;           ///< rows of the table
  int head_dim = 0;            ///< a head's width (even)
  const float* cos = nullptr;  ///< (positions, head_dim / 2)
  const float* sin = nullptr;  ///< (positions, head_dim / 2)
};

/// The shape of one causal attention call on separate q (batch*seq, heads*head_dim), k and v
/// (batch*seq, kv_heads*head_dim) rows; query head a reads key/value head a / (heads /
/// kv_heads).
struct AttentionShape {
  int batch = 1,     ///< sequences
      seq = 1,       ///< tokens per sequence
      heads = 1,     ///< query heads
      kv_heads = 0,  ///< key/value heads, dividing heads; 0: heads
      head_dim = 8;  ///< a head's width
  /// kv_heads, with 0 read as heads.
  PIPEOFFLOAD_HOST_DEVICE constexpr int groups() const { return kv_heads == 0 ? heads : kv_heads; }
};

/// Row strides, in elements, of attention's tensors (q and dq share one, k and dk, v and dv, out
/// and dout); 0 takes the dense width: heads * head_dim for q and out, kv_heads * head_dim for
/// k and v. A packed [q | k | v] row of width 3h is {3h, 3h, 3h, h} with k = q + h, v = q + 2h.
struct AttentionStrides {
  long long q = 0;    ///< q's and dq's row stride
  long long k = 0;    ///< k's and dk's
  long long v = 0;    ///< v's and dv's
  long long out = 0;  ///< out's and dout's
};

/// Rotates the pair (a, b) = (p[0], p[1]) by the angle whose cosine and sine are c and s:
/// (a c - b s, a s + b c). The inverse rotation is the same with -s.
PIPEOFFLOAD_HOST_DEVICE inline void rope_pair(float* p, float c, float s) {
  const float a = p[0], b = p[1];
  p[0] = a * c - b * s;
  p[1] = a * s + b * c;
}

}  // namespace pipeoffload::ops
