// pipeoffload/backend/update.hpp: the per-element optimizer updates every backend runs.
//
// Plain functions over one parameter, compiled for the CPU backend's loops and for the CUDA
// kernels (src/elementwise.cu), so the CPU tests cover what the GPU runs: every product is
// rounded on its own (detail::mul, which nvcc never fuses into an FMA), so the GPU's values equal
// the CPU's bit for bit where the host compiler does not contract either (x86-64 without FMA
// code generation, this project's build; -ffp-contract=off elsewhere). And the runs
// (Segment) one backend call updates together: a chunk's whole update is one call, one
// launch on a GPU for up to cuda::segments_per_launch runs. The optimizers that build them
// (po::AdamW, po::Sgd) are in runtime/optimizer.hpp.
/// @file
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../detail/host_device.hpp"

namespace pipeoffload::update {

namespace detail {
/// a * b rounded to nearest: on the device __fmul_rn, which nvcc never contracts with an
/// addition into an FMA (its default, -fmad=true, would: one rounding fewer than the CPU's).
PIPEOFFLOAD_HOST_DEVICE inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
}  // namespace detail

/// AdamW's hyperparameters for one run of parameters (the learning rate comes per step).
struct AdamWParams {
  float beta1 = 0.9f;         ///< decay of the first moment m
  float beta2 = 0.95f;        ///< decay of the second moment v
  float eps = 1e-8f;          ///< added to sqrt(v-hat) in the denominator
  float weight_decay = 0.1f;  ///< decoupled: p -= lr * weight_decay * p
};

/// Bias corrections 1 - beta1^t and 1 - beta2^t of 1-based step t (once per step, not per element).
struct AdamBias {
  float c1 = 1;  ///< 1 - beta1^t: m-hat = m / c1
  float c2 = 1;  ///< 1 - beta2^t: v-hat = v / c2
};
/// The bias corrections of 1-based step t.
PIPEOFFLOAD_HOST_DEVICE inline AdamBias adam_bias(float beta1, float beta2, int t) {
  return {1.0f - std::pow(beta1, static_cast<float>(t)), 1.0f - std::pow(beta2, static_cast<float>(t))};
}

/// One AdamW update of one parameter (decoupled weight decay); `g` is already clipped.
PIPEOFFLOAD_HOST_DEVICE inline void adamw(float& p, float g, float& m, float& v, const AdamWParams& o, float lr,
                                          AdamBias bc) {
  using detail::mul;
  m = mul(o.beta1, m) + mul(1.0f - o.beta1, g);
  v = mul(o.beta2, v) + mul(mul(1.0f - o.beta2, g), g);
  const float mhat = m / bc.c1;
  const float vhat = v / bc.c2;
  p -= mul(lr, mhat / (std::sqrt(vhat) + o.eps) + mul(o.weight_decay, p));
}

/// SGD's hyperparameters for one run of parameters (PyTorch's torch.optim.SGD semantics).
struct SgdParams {
  float momentum = 0;      ///< 0: plain SGD, no buffer
  float dampening = 0;     ///< buf = momentum buf + (1 - dampening) g after the first step
  bool nesterov = false;   ///< needs momentum > 0 and dampening = 0
  float weight_decay = 0;  ///< L2, added to the gradient: g += weight_decay * p
};

/// One SGD update of one parameter: g += wd p; buf = first ? g : momentum buf + (1 - dampening) g;
/// g = nesterov ? g + momentum buf : buf; p -= lr g. `first`: the buffer's first step.
PIPEOFFLOAD_HOST_DEVICE inline void sgd(float& p, float g, float& buf, const SgdParams& o, float lr, bool first) {
  using detail::mul;
  if (o.weight_decay != 0.0f) g = g + mul(o.weight_decay, p);
  if (o.momentum != 0.0f) {
    buf = first ? g : mul(o.momentum, buf) + mul(1.0f - o.dampening, g);
    g = o.nesterov ? g + mul(o.momentum, buf) : buf;
  }
  p -= mul(lr, g);
}

/// One run of parameters a multi-tensor update call updates with one learning rate and weight
/// decay. Every pointer is device memory of `count` values (or null where said).
struct Segment {
  float* params = nullptr;           ///< fp32 values updated: the master copy, or fp32 working parameters
  const float* grads = nullptr;      ///< their gradients (only read)
  float* state0 = nullptr;           ///< AdamW's m, SGD's momentum buffer (null without momentum)
  float* state1 = nullptr;           ///< AdamW's v (null for SGD)
  std::uint16_t* working = nullptr;  ///< bfloat16 working copy written from params after the update, or null
  std::size_t count = 0;             ///< values in the run
  float lr = 0;                      ///< the run's learning rate (the step's times its group's scale)
  float weight_decay = 0;            ///< the run's weight decay
};

/// What one AdamW call applies to every segment besides the segment's lr and weight decay.
struct AdamWStep {
  float beta1 = 0.9f;    ///< decay of the first moment (AdamWParams::beta1)
  float beta2 = 0.95f;   ///< decay of the second moment (AdamWParams::beta2)
  float eps = 1e-8f;     ///< added to sqrt(v-hat) in the denominator (AdamWParams::eps)
  AdamBias bias{};       ///< the step's bias corrections
  float grad_scale = 1;  ///< gradients are multiplied by it (the clip)
};
/// What one SGD call applies to every segment besides the segment's lr and weight decay.
struct SgdStep {
  float momentum = 0;     ///< SgdParams::momentum (0: no buffer)
  float dampening = 0;    ///< SgdParams::dampening
  bool nesterov = false;  ///< SgdParams::nesterov
  bool first = false;     ///< the momentum buffer's first step
  float grad_scale = 1;   ///< gradients are multiplied by it (the clip)
};

/// Element i of segment s after one AdamW update (the value the working copy is rounded from).
PIPEOFFLOAD_HOST_DEVICE inline float adamw_at(const Segment& s, std::size_t i, const AdamWStep& st) {
  const AdamWParams o{st.beta1, st.beta2, st.eps, s.weight_decay};
  adamw(s.params[i], detail::mul(s.grads[i], st.grad_scale), s.state0[i], s.state1[i], o, s.lr, st.bias);
  return s.params[i];
}
/// Element i of segment s after one SGD update (state0 is not touched without momentum).
PIPEOFFLOAD_HOST_DEVICE inline float sgd_at(const Segment& s, std::size_t i, const SgdStep& st) {
  const SgdParams o{st.momentum, st.dampening, st.nesterov, s.weight_decay};
  float unused = 0;
  sgd(s.params[i], detail::mul(s.grads[i], st.grad_scale), s.state0 != nullptr ? s.state0[i] : unused, o, s.lr,
      st.first);
  return s.params[i];
}

}  // namespace pipeoffload::update
