// samples/custom_model.hpp: a model that is not a GPT, as pipeline stages of three types: a
// residual MLP regressing one float target from float features (docs/your_model.md, "The sample
// model", has its equations, boundaries, norm groups, names and step inputs).
//
//   stage 0          InputProjection  h = gelu(x W + b)                    features -> hidden
//   stages 1..S-2    ResidualStage    [h = h A + a when widths differ], then N blocks
//                                     h = h + gelu(h W1 + b1) W2 + b2      (4w inner width)
//   stage S-1        RegressionHead   pred = h w + b, loss = mean over rows of 0.5 (pred - t)^2
//
// fp32 plain loops in a fixed order, so a run is bit-identical under every schedule and cut.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <pipeoffload/fnv1a.hpp>
#include <pipeoffload/runtime.hpp>

namespace custom {

struct Config {
  int features = 12;       ///< input features per row
  int hidden = 32;         ///< width of stage 0 and the odd middle stages; even middle stages use 3*hidden/4
  int blocks = 2;          ///< residual blocks per middle stage
  std::uint64_t seed = 1;  ///< parameter initialisation

  /// Throws po::shape_error naming the bad value and the allowed range.
  void check() const {
    po::detail::require_range("custom::Config: features", features, 1, 1 << 16);
    po::detail::require_range("custom::Config: hidden", hidden, 4, 1 << 14);
    po::detail::require_range("custom::Config: blocks", blocks, 1, 1024);
    if (hidden % 4 != 0)
      throw po::shape_error("custom::Config: hidden = " + std::to_string(hidden) +
                            " must be a multiple of 4 (even middle stages are 3*hidden/4 wide)");
  }
};

/// The width of stage s's output (s < S-1): hidden for stage 0 and odd middle stages,
/// 3*hidden/4 for even middle stages. The last stage's output is its loss.
inline int width_of(const Config& c, int s) { return (s == 0 || s % 2 == 1) ? c.hidden : 3 * c.hidden / 4; }

namespace detail {

/// (rows, out) = x (rows, in) W (in, out) + b, summing over `in` in order.
inline void linear(const float* x, const float* W, const float* b, float* y, std::size_t rows, std::size_t in,
                   std::size_t out) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t o = 0; o < out; ++o) {
      float s = b[o];
      for (std::size_t i = 0; i < in; ++i) s += x[r * in + i] * W[i * out + o];
      y[r * out + o] = s;
    }
}

/// dx (rows, in) = dy (rows, out) W^T, added to what dx holds when `add`.
inline void linear_dx(const float* dy, const float* W, float* dx, std::size_t rows, std::size_t in, std::size_t out,
                      bool add) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t i = 0; i < in; ++i) {
      float s = 0;
      for (std::size_t o = 0; o < out; ++o) s += dy[r * out + o] * W[i * out + o];
      dx[r * in + i] = add ? dx[r * in + i] + s : s;
    }
}

/// gW (in, out) += x^T dy and gb (out) += column sums of dy: this microbatch's sum over its
/// rows first, then one addition, so gradients accumulate in microbatch order.
inline void linear_dw(const float* x, const float* dy, float* gW, float* gb, std::size_t rows, std::size_t in,
                      std::size_t out) {
  for (std::size_t i = 0; i < in; ++i)
    for (std::size_t o = 0; o < out; ++o) {
      float s = 0;
      for (std::size_t r = 0; r < rows; ++r) s += x[r * in + i] * dy[r * out + o];
      gW[i * out + o] += s;
    }
  for (std::size_t o = 0; o < out; ++o) {
    float s = 0;
    for (std::size_t r = 0; r < rows; ++r) s += dy[r * out + o];
    gb[o] += s;
  }
}

/// 64-bit FNV-1a of a name: the "global position" of a tensor, the same in every cut.
inline std::uint64_t name_hash(const std::string& s) { return po::fnv1a(s); }

/// 64 well-mixed bits from (a, b): SplitMix64's finaliser of a + b's golden-ratio multiple.
inline std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a + 0x9e3779b97f4a7c15ULL * (b + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// A uniform value in [-1, 1) from (seed, key, i).
inline float uniform(std::uint64_t seed, std::uint64_t key, std::uint64_t i) {
  return static_cast<float>(mix(mix(seed, key), i) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/// GeLU, tanh form (GPT-2's): x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline float gelu(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}
/// d GeLU / dx at x.
inline float gelu_grad(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x), t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

/// Parameters and gradients of a stage, and its named tensors in parameters() order.
class Params {
 public:
  /// Appends tensor `name` of `shape`, drawn uniformly from [-scale, scale) by (seed, name).
  void add(std::uint64_t seed, std::string name, std::vector<long long> shape, float scale) {
    po::ParamInfo p{std::move(name), values_.size(), std::move(shape)};
    const std::uint64_t key = name_hash(p.name);
    for (std::size_t i = 0; i < p.count(); ++i) values_.push_back(scale * uniform(seed, key, i));
    info_.push_back(std::move(p));
    grads_.assign(values_.size(), 0.0f);
  }
  /// Closes a norm group: the tensors added since the last call.
  void end_group() {
    groups_.push_back(values_.size() - grouped_);
    grouped_ = values_.size();
  }
  float* at(std::size_t tensor) { return values_.data() + info_[tensor].offset; }
  const float* at(std::size_t tensor) const { return values_.data() + info_[tensor].offset; }
  float* grad(std::size_t tensor) { return grads_.data() + info_[tensor].offset; }

  std::span<float> parameters() { return values_; }
  std::span<float> gradients() { return grads_; }
  const std::vector<std::size_t>& groups() const { return groups_; }
  const std::vector<po::ParamInfo>& info() const { return info_; }

 private:
  std::vector<float> values_, grads_;
  std::vector<po::ParamInfo> info_;
  std::vector<std::size_t> groups_;
  std::size_t grouped_ = 0;
};

inline std::size_t rows_of(po::MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()); }

}  // namespace detail

/// Stage 0: h = gelu(x W + b) from the step input "features", (rows, features) float32.
class InputProjection {
 public:
  explicit InputProjection(const Config& c)
      : f_(static_cast<std::size_t>(c.features)), w_(static_cast<std::size_t>(c.hidden)) {
    c.check();
    const long long F = c.features, W = c.hidden;
    p_.add(c.seed, "input.weight", {F, W}, std::sqrt(3.0f / static_cast<float>(F)));
    p_.add(c.seed, "input.bias", {W}, 0.1f);
    p_.end_group();
  }

  po::Boundary input_boundary(po::MicrobatchShape) const {
    return {0, po::DType::float32};
  }  // stage 0 reads a step input
  po::Boundary output_boundary(po::MicrobatchShape sh) const { return {detail::rows_of(sh) * w_, po::DType::float32}; }
  std::vector<po::InputSpec> inputs(po::MicrobatchShape sh) const {
    return {{"features", po::DType::float32, detail::rows_of(sh) * f_}};
  }
  // saved: x (rows, F) | z (rows, W); stash: dz (rows, W)
  std::size_t saved_bytes(po::MicrobatchShape sh) const { return detail::rows_of(sh) * (f_ + w_) * sizeof(float); }
  std::size_t stash_bytes(po::MicrobatchShape sh) const { return detail::rows_of(sh) * w_ * sizeof(float); }

  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor, po::Tensor yt, std::byte* saved) {
    const std::size_t R = detail::rows_of(mb.shape);
    float* x = reinterpret_cast<float*>(saved);
    float* z = x + R * f_;
    std::memcpy(x, mb.input<float>("features"), R * f_ * sizeof(float));
    detail::linear(x, p_.at(0), p_.at(1), z, R, f_, w_);
    float* y = yt.as<float>();
    for (std::size_t e = 0; e < R * w_; ++e) y[e] = detail::gelu(z[e]);
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor dyt, po::Tensor,
                      std::byte* saved, std::byte* stash) {
    const std::size_t R = detail::rows_of(mb.shape);
    const float* z = reinterpret_cast<const float*>(saved) + R * f_;
    const float* dy = dyt.as<float>();
    float* dz = reinterpret_cast<float*>(stash);
    for (std::size_t e = 0; e < R * w_; ++e) dz[e] = dy[e] * detail::gelu_grad(z[e]);
  }
  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    const float* x = reinterpret_cast<const float*>(saved);
    detail::linear_dw(x, reinterpret_cast<const float*>(stash), p_.grad(0), p_.grad(1), detail::rows_of(mb.shape), f_,
                      w_);
  }

  std::span<float> parameters() { return p_.parameters(); }
  std::span<float> gradients() { return p_.gradients(); }
  std::vector<std::size_t> norm_groups() const { return p_.groups(); }
  std::vector<po::ParamInfo> parameter_info() const { return p_.info(); }
  std::string name() const { return "InputProjection"; }

 private:
  std::size_t f_, w_;
  detail::Params p_;
};

/// A middle stage: a projection in_width -> width when they differ, then `blocks` residual
/// MLP blocks h + gelu(h W1 + b1) W2 + b2 at `width`. Blocks are numbered across the model
/// (first_block, first_block + 1, ...), which names and seeds their tensors.
class ResidualStage {
 public:
  ResidualStage(const Config& c, int stage, int in_width, int width, int first_block)
      : win_(static_cast<std::size_t>(in_width)),
        w_(static_cast<std::size_t>(width)),
        n_(static_cast<std::size_t>(c.blocks)) {
    c.check();
    po::detail::require_range("custom::ResidualStage: in_width", in_width, 1, 1 << 16);
    po::detail::require_range("custom::ResidualStage: width", width, 1, 1 << 16);
    const long long Wi = in_width, W = width;
    if (adapts()) {
      const std::string a = "adapt." + std::to_string(stage) + ".";
      p_.add(c.seed, a + "weight", {Wi, W}, std::sqrt(3.0f / static_cast<float>(Wi)));
      p_.add(c.seed, a + "bias", {W}, 0.1f);
      p_.end_group();
    }
    for (int j = 0; j < c.blocks; ++j) {
      const std::string b = "blocks." + std::to_string(first_block + j) + ".";
      p_.add(c.seed, b + "fc1.weight", {W, 4 * W}, std::sqrt(3.0f / static_cast<float>(W)));
      p_.add(c.seed, b + "fc1.bias", {4 * W}, 0.1f);
      p_.add(c.seed, b + "fc2.weight", {4 * W, W}, 0.5f * std::sqrt(3.0f / static_cast<float>(4 * W)));
      p_.add(c.seed, b + "fc2.bias", {W}, 0.1f);
      p_.end_group();
    }
  }

  bool adapts() const { return win_ != w_; }

  po::Boundary input_boundary(po::MicrobatchShape sh) const { return {detail::rows_of(sh) * win_, po::DType::float32}; }
  po::Boundary output_boundary(po::MicrobatchShape sh) const { return {detail::rows_of(sh) * w_, po::DType::float32}; }
  // saved: [x (rows, in_width) when it adapts] | per block: h (rows, w) | u (rows, 4w)
  std::size_t saved_bytes(po::MicrobatchShape sh) const {
    return detail::rows_of(sh) * ((adapts() ? win_ : 0) + n_ * 5 * w_) * sizeof(float);
  }
  // stash: [dh0 (rows, w) when it adapts] | per block: dout (rows, w) | du (rows, 4w)
  std::size_t stash_bytes(po::MicrobatchShape sh) const {
    return detail::rows_of(sh) * ((adapts() ? w_ : 0) + n_ * 5 * w_) * sizeof(float);
  }

  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor xt, po::Tensor yt,
               std::byte* saved) {
    const std::size_t R = detail::rows_of(mb.shape);
    const float* x = xt.as<float>();
    float* s = reinterpret_cast<float*>(saved);
    if (adapts()) {
      std::memcpy(s, x, R * win_ * sizeof(float));
      detail::linear(s, p_.at(0), p_.at(1), block_h(s, R, 0), R, win_, w_);
    } else {
      std::memcpy(block_h(s, R, 0), x, R * w_ * sizeof(float));
    }
    std::vector<float> a(R * 4 * w_), t(R * w_);
    for (std::size_t j = 0; j < n_; ++j) {
      const float* h = block_h(s, R, j);
      float* u = block_u(s, R, j);
      const std::size_t k = first_tensor(j);
      detail::linear(h, p_.at(k), p_.at(k + 1), u, R, w_, 4 * w_);
      for (std::size_t e = 0; e < R * 4 * w_; ++e) a[e] = detail::gelu(u[e]);
      detail::linear(a.data(), p_.at(k + 2), p_.at(k + 3), t.data(), R, 4 * w_, w_);
      float* out = j + 1 < n_ ? block_h(s, R, j + 1) : yt.as<float>();
      for (std::size_t e = 0; e < R * w_; ++e) out[e] = h[e] + t[e];
    }
  }

  void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor dyt, po::Tensor dxt,
                      std::byte* saved, std::byte* stash) {
    const std::size_t R = detail::rows_of(mb.shape);
    const float* s = reinterpret_cast<const float*>(saved);
    float* st = reinterpret_cast<float*>(stash);
    std::memcpy(block_dout(st, R, n_ - 1), dyt.as<float>(), R * w_ * sizeof(float));
    std::vector<float> da(R * 4 * w_);
    for (std::size_t j = n_; j-- > 0;) {
      const float* g = block_dout(st, R, j);  // d loss / d (block j's output)
      const float* u = block_u(s, R, j);
      float* du = block_du(st, R, j);
      const std::size_t k = first_tensor(j);
      detail::linear_dx(g, p_.at(k + 2), da.data(), R, 4 * w_, w_, false);
      for (std::size_t e = 0; e < R * 4 * w_; ++e) du[e] = da[e] * detail::gelu_grad(u[e]);
      // d (block j's input) = g + du W1^T: the next block down's output gradient, or dh0.
      float* dh = j > 0 ? block_dout(st, R, j - 1) : (adapts() ? st : dxt.as<float>());
      std::memcpy(dh, g, R * w_ * sizeof(float));
      detail::linear_dx(du, p_.at(k), dh, R, w_, 4 * w_, true);
    }
    if (adapts()) detail::linear_dx(st, p_.at(0), dxt.as<float>(), R, win_, w_, false);
  }

  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    const std::size_t R = detail::rows_of(mb.shape);
    const float* s = reinterpret_cast<const float*>(saved);
    const float* st = reinterpret_cast<const float*>(stash);
    if (adapts()) detail::linear_dw(s, st, p_.grad(0), p_.grad(1), R, win_, w_);
    std::vector<float> a(R * 4 * w_);
    for (std::size_t j = 0; j < n_; ++j) {
      const float* u = block_u(s, R, j);
      for (std::size_t e = 0; e < R * 4 * w_; ++e) a[e] = detail::gelu(u[e]);  // recomputed, not saved
      const std::size_t k = first_tensor(j);
      detail::linear_dw(block_h(s, R, j), block_du(st, R, j), p_.grad(k), p_.grad(k + 1), R, w_, 4 * w_);
      detail::linear_dw(a.data(), block_dout(st, R, j), p_.grad(k + 2), p_.grad(k + 3), R, 4 * w_, w_);
    }
  }

  std::span<float> parameters() { return p_.parameters(); }
  std::span<float> gradients() { return p_.gradients(); }
  std::vector<std::size_t> norm_groups() const { return p_.groups(); }
  std::vector<po::ParamInfo> parameter_info() const { return p_.info(); }
  std::string name() const { return "ResidualStage"; }

 private:
  std::size_t first_tensor(std::size_t block) const { return (adapts() ? 2 : 0) + 4 * block; }
  std::size_t lead(std::size_t rows, std::size_t in) const { return adapts() ? rows * in : 0; }
  float* block_h(float* s, std::size_t R, std::size_t j) const { return s + lead(R, win_) + j * R * 5 * w_; }
  const float* block_h(const float* s, std::size_t R, std::size_t j) const {
    return s + lead(R, win_) + j * R * 5 * w_;
  }
  float* block_u(float* s, std::size_t R, std::size_t j) const { return block_h(s, R, j) + R * w_; }
  const float* block_u(const float* s, std::size_t R, std::size_t j) const { return block_h(s, R, j) + R * w_; }
  float* block_dout(float* st, std::size_t R, std::size_t j) const { return st + lead(R, w_) + j * R * 5 * w_; }
  const float* block_dout(const float* st, std::size_t R, std::size_t j) const {
    return st + lead(R, w_) + j * R * 5 * w_;
  }
  float* block_du(float* st, std::size_t R, std::size_t j) const { return block_dout(st, R, j) + R * w_; }
  const float* block_du(const float* st, std::size_t R, std::size_t j) const { return block_dout(st, R, j) + R * w_; }

  std::size_t win_, w_, n_;
  detail::Params p_;
};

/// The last stage: pred = h w + b per row, and the microbatch's loss, the mean over its rows
/// of 0.5 (pred - t)^2 with t from the step input "targets", (rows) float32.
class RegressionHead {
 public:
  RegressionHead(const Config& c, int in_width) : w_(static_cast<std::size_t>(in_width)) {
    c.check();
    po::detail::require_range("custom::RegressionHead: in_width", in_width, 1, 1 << 16);
    const long long W = in_width;
    p_.add(c.seed, "head.weight", {W, 1}, std::sqrt(3.0f / static_cast<float>(W)));
    p_.add(c.seed, "head.bias", {1}, 0.1f);
    p_.end_group();
  }

  po::Boundary input_boundary(po::MicrobatchShape sh) const { return {detail::rows_of(sh) * w_, po::DType::float32}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {0, po::DType::float32}; }  // the loss is its output
  std::vector<po::InputSpec> inputs(po::MicrobatchShape sh) const {
    return {{"targets", po::DType::float32, detail::rows_of(sh)}};
  }
  // saved: x (rows, w) | pred - t (rows); stash: d loss / d pred (rows)
  std::size_t saved_bytes(po::MicrobatchShape sh) const { return detail::rows_of(sh) * (w_ + 1) * sizeof(float); }
  std::size_t stash_bytes(po::MicrobatchShape sh) const { return detail::rows_of(sh) * sizeof(float); }

  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor xt, po::Tensor, std::byte* saved) {
    const std::size_t R = detail::rows_of(mb.shape);
    float* x = reinterpret_cast<float*>(saved);
    float* err = x + R * w_;
    std::memcpy(x, xt.as<float>(), R * w_ * sizeof(float));
    detail::linear(x, p_.at(0), p_.at(1), err, R, w_, 1);
    const float* t = mb.input<float>("targets");
    float loss = 0;
    for (std::size_t r = 0; r < R; ++r) {
      err[r] -= t[r];
      loss += 0.5f * err[r] * err[r];
    }
    *mb.loss = loss / static_cast<float>(R);
  }
  /// Starts from mb.loss_scale (1 / the step's microbatches): d loss / d pred = scale (pred - t) / rows.
  void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor, po::Tensor dxt,
                      std::byte* saved, std::byte* stash) {
    const std::size_t R = detail::rows_of(mb.shape);
    const float* err = reinterpret_cast<const float*>(saved) + R * w_;
    float* dpred = reinterpret_cast<float*>(stash);
    for (std::size_t r = 0; r < R; ++r) dpred[r] = mb.loss_scale * err[r] / static_cast<float>(R);
    detail::linear_dx(dpred, p_.at(0), dxt.as<float>(), R, w_, 1, false);
  }
  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    detail::linear_dw(reinterpret_cast<const float*>(saved), reinterpret_cast<const float*>(stash), p_.grad(0),
                      p_.grad(1), detail::rows_of(mb.shape), w_, 1);
  }

  std::span<float> parameters() { return p_.parameters(); }
  std::span<float> gradients() { return p_.gradients(); }
  std::vector<std::size_t> norm_groups() const { return p_.groups(); }
  std::vector<po::ParamInfo> parameter_info() const { return p_.info(); }
  std::string name() const { return "RegressionHead"; }

 private:
  std::size_t w_;
  detail::Params p_;
};

static_assert(po::layer_for<InputProjection, po::backend::CpuContext>,
              "custom::InputProjection must model po::layer_for<_, po::backend::CpuContext>");
static_assert(po::layer_for<ResidualStage, po::backend::CpuContext>,
              "custom::ResidualStage must model po::layer_for<_, po::backend::CpuContext>");
static_assert(po::layer_for<RegressionHead, po::backend::CpuContext>,
              "custom::RegressionHead must model po::layer_for<_, po::backend::CpuContext>");

/// One stage of any of the three types, owned.
using Stage = std::variant<InputProjection, ResidualStage, RegressionHead>;
using StageRef = po::StageRef<po::backend::CpuContext>;

/// Stage s of an S-stage model (S >= 3): stage 0 an InputProjection, S-1 a RegressionHead,
/// the others ResidualStages whose input width is the previous stage's output width.
inline Stage make_stage(const Config& c, int S, int s) {
  if (S < 3)
    throw po::shape_error(
        "custom::make_stage: the model needs S >= 3 stages (an InputProjection, at least one ResidualStage, a RegressionHead), got S = " +
        std::to_string(S));
  po::detail::require_range("custom::make_stage: stage", s, 0, S - 1);
  if (s == 0) return Stage(std::in_place_type<InputProjection>, c);
  if (s == S - 1) return Stage(std::in_place_type<RegressionHead>, c, width_of(c, S - 2));
  return Stage(std::in_place_type<ResidualStage>, c, s, width_of(c, s - 1), width_of(c, s), (s - 1) * c.blocks);
}

/// Every stage of an S-stage model, by stage index (a one-rank run holds them all).
inline std::vector<Stage> make_stages(const Config& c, int S) {
  std::vector<Stage> out;
  out.reserve(static_cast<std::size_t>(S > 0 ? S : 0));
  if (S < 3) make_stage(c, S, 0);  // throws the sentence
  for (int s = 0; s < S; ++s) out.push_back(make_stage(c, S, s));
  return out;
}

/// Rank r's stages of a pipeline of shape sh, in chunk order (chunk c is stage c*d + r).
inline std::vector<Stage> make_rank_stages(const Config& c, const po::Shape& sh, int r) {
  std::vector<Stage> out;
  out.reserve(static_cast<std::size_t>(sh.v));
  for (int ch = 0; ch < sh.v; ++ch) out.push_back(make_stage(c, sh.stages(), sh.stage_of(r, ch)));
  return out;
}

/// What a po::Runtime takes: references to `stages`, in their order (the vector must not
/// grow or go away while a runtime holds them).
inline std::vector<StageRef> refs(std::vector<Stage>& stages) {
  std::vector<StageRef> out;
  out.reserve(stages.size());
  for (Stage& s : stages) out.push_back(std::visit([](auto& l) { return StageRef(l); }, s));
  return out;
}

/// A deterministic regression problem: features uniform in [-1, 1) from a hash of (seed,
/// row, feature), and targets a fixed smooth function of them (no noise). Rows [0, train)
/// are the training split, the next `validation` rows the validation split.
class Dataset {
 public:
  Dataset(int features, std::size_t train, std::size_t validation, std::uint64_t seed = 2024)
      : f_(static_cast<std::size_t>(features)), train_(train), validation_(validation) {
    po::detail::require_range("custom::Dataset: features", features, 1, 1 << 16);
    const std::size_t n = train + validation;
    x_.resize(n * f_);
    t_.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      float* x = x_.data() + r * f_;
      for (std::size_t i = 0; i < f_; ++i) x[i] = detail::uniform(seed, r, i);
      t_[r] = target(x);
    }
  }

  /// The target of one row: a fixed nonlinear function of its features.
  float target(const float* x) const {
    float lin = 0;
    for (std::size_t i = 0; i < f_; ++i) lin += x[i] * (i % 2 == 0 ? 1.0f : -0.5f) / static_cast<float>(i + 1);
    const float a = x[0], b = x[f_ > 1 ? 1 : 0], c = x[f_ > 2 ? 2 : 0];
    return std::sin(2.0f * lin) + 0.5f * a * b - 0.3f * c * c;
  }

  /// A batch's rows, copied out: features (rows, F) and targets (rows).
  struct Slice {
    std::vector<float> features, targets;
    std::size_t rows = 0, width = 0;
    /// The step inputs (a view: the slice must outlive the call it is passed to).
    po::Batch batch() const {
      po::Batch b;
      b.add("features", features, {static_cast<long long>(rows), static_cast<long long>(width)});
      b.add("targets", targets, {static_cast<long long>(rows)});
      return b;
    }
  };

  /// `rows` training rows starting at `first`, wrapping around the training split.
  Slice train(std::size_t first, std::size_t rows) const { return slice(0, train_, first, rows); }
  /// `rows` validation rows starting at `first`, wrapping around the validation split.
  Slice validation(std::size_t first, std::size_t rows) const { return slice(train_, validation_, first, rows); }

  std::size_t features() const { return f_; }
  std::size_t train_rows() const { return train_; }
  std::size_t validation_rows() const { return validation_; }

 private:
  Slice slice(std::size_t base, std::size_t split, std::size_t first, std::size_t rows) const {
    if (split == 0) throw po::error("custom::Dataset: the split is empty");
    Slice s;
    s.rows = rows;
    s.width = f_;
    s.features.resize(rows * f_);
    s.targets.resize(rows);
    for (std::size_t k = 0; k < rows; ++k) {
      const std::size_t r = base + (first + k) % split;
      std::memcpy(s.features.data() + k * f_, x_.data() + r * f_, f_ * sizeof(float));
      s.targets[k] = t_[r];
    }
    return s;
  }

  std::size_t f_, train_, validation_;
  std::vector<float> x_, t_;  // (train + validation, F) features, (train + validation) targets
};

}  // namespace custom
