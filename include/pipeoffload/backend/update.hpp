// pipeoffload/backend/update.hpp: the per-element optimizer updates every backend runs.
//
// Plain functions over one parameter, compiled for the CPU backend's loops and for the CUDA
// kernels' grid-stride loops (kernels/elementwise.cu), so the CPU tests cover what the GPU
// runs. The optimizers that call them (po::AdamW, po::Sgd) are in runtime/optimizer.hpp.
/// @file
#pragma once

#include <cmath>

#include "../detail/host_device.hpp"

namespace pipeoffload::update {

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
  m = o.beta1 * m + (1.0f - o.beta1) * g;
  v = o.beta2 * v + (1.0f - o.beta2) * g * g;
  const float mhat = m / bc.c1;
  const float vhat = v / bc.c2;
  p -= lr * (mhat / (std::sqrt(vhat) + o.eps) + o.weight_decay * p);
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
  if (o.weight_decay != 0.0f) g = g + o.weight_decay * p;
  if (o.momentum != 0.0f) {
    buf = first ? g : o.momentum * buf + (1.0f - o.dampening) * g;
    g = o.nesterov ? g + o.momentum * buf : buf;
  }
  p -= lr * g;
}

}  // namespace pipeoffload::update
