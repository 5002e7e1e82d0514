// tests/consumer/project/consumer.cpp: what a project that uses pipeoffload compiles, built by
// check.py outside this build three ways (CMake find_package of an installed prefix, CMake
// add_subdirectory of the checkout, a Meson subproject). It builds, validates and simulates a
// schedule, then trains a chain of scalar layers on two thread ranks and checks the loss falls.
#include <cstddef>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <pipeoffload/runtime.hpp>

namespace {

constexpr std::size_t width = 4;  // floats per row, on every boundary

/// y = w * x per element; the last stage's loss is the mean of 0.5 (y - t)^2 over its rows.
struct Scale {
  float w = 0.5f, gw = 0;

  po::Boundary input_boundary(po::MicrobatchShape sh) const { return {floats(sh)}; }
  po::Boundary output_boundary(po::MicrobatchShape sh) const { return {floats(sh)}; }
  std::size_t saved_bytes(po::MicrobatchShape sh) const { return floats(sh) * sizeof(float); }  // x
  std::size_t stash_bytes(po::MicrobatchShape sh) const { return floats(sh) * sizeof(float); }  // dy
  std::vector<po::InputSpec> inputs(po::MicrobatchShape sh) const {
    return {{"x", po::DType::float32, floats(sh)}, {"t", po::DType::float32, floats(sh)}};
  }

  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor x, po::Tensor y, std::byte* saved) {
    const std::size_t n = floats(mb.shape);
    const float* in = mb.first() ? mb.input<float>("x") : x.as<float>();
    auto* xs = reinterpret_cast<float*>(saved);
    float loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      xs[i] = in[i];
      const float out = w * in[i];
      if (mb.last()) {
        const float d = out - mb.input<float>("t")[i];
        loss += 0.5f * d * d;
      } else {
        y.as<float>()[i] = out;
      }
    }
    if (mb.last()) *mb.loss = loss / static_cast<float>(n);
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor dy, po::Tensor dx,
                      std::byte* saved, std::byte* stash) {
    const std::size_t n = floats(mb.shape);
    const auto* xs = reinterpret_cast<const float*>(saved);
    auto* g = reinterpret_cast<float*>(stash);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] =
          mb.last() ? mb.loss_scale * (w * xs[i] - mb.input<float>("t")[i]) / static_cast<float>(n) : dy.as<float>()[i];
      if (!mb.first()) dx.as<float>()[i] = g[i] * w;
    }
  }
  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
    const auto* xs = reinterpret_cast<const float*>(saved);
    const auto* g = reinterpret_cast<const float*>(stash);
    for (std::size_t i = 0; i < floats(mb.shape); ++i) gw += g[i] * xs[i];
  }
  std::span<float> parameters() { return {&w, 1}; }
  std::span<float> gradients() { return {&gw, 1}; }

  static std::size_t floats(po::MicrobatchShape sh) { return static_cast<std::size_t>(sh.tokens()) * width; }
};
static_assert(po::layer_for<Scale, po::backend::CpuContext>);

}  // namespace

int main() {
  // The schedule alone: build, validate, simulate.
  const po::Program big = po::PO_F::build({4, 2, 8});
  po::require_valid(big);
  const po::SimResult sim = po::simulate(big);
  if (!(sim.makespan > 0)) {
    std::fprintf(stderr, "consumer: the simulated makespan is %g\n", sim.makespan);
    return 1;
  }

  // Training: 2 thread ranks x 2 chunks = 4 stages, 4 microbatches of 2 rows. The targets are
  // 1.5 x the inputs, so the product of the four weights should move from 0.0625 towards 1.5.
  const po::Program program = po::PO_F::build({2, 2, 4});
  constexpr int rows = 2, steps = 20;
  const std::size_t n = static_cast<std::size_t>(program.shape.m) * rows * width;
  std::vector<float> x(n), t(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = 0.25f + static_cast<float>(i % 7) * 0.125f;
    t[i] = 1.5f * x[i];
  }
  po::Batch batch;
  const std::vector<long long> shape = {static_cast<long long>(program.shape.m) * rows, static_cast<long long>(width)};
  batch.add("x", x, shape).add("t", t, shape);

  std::vector<float> losses(steps);
  po::comm::ThreadsWorld world(program.shape.d);
  const std::vector<std::string> errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<Scale> mine(static_cast<std::size_t>(program.shape.v));
    po::Runtime rt(program, dev, comm, std::span<Scale>(mine), {.microbatch = {rows, 1}});
    po::Sgd opt(rt);
    for (int step = 0; step < steps; ++step) {
      rt.zero_grad();
      const po::PassStats st = rt.forward_backward(batch, {.step = step});
      opt.step(0.5f);
      if (r == 0) losses[static_cast<std::size_t>(step)] = st.loss;
    }
  });
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      std::fprintf(stderr, "consumer: rank %zu failed: %s\n", r, errors[r].c_str());
      return 1;
    }
  std::printf("consumer: makespan %g, loss %g -> %g\n", sim.makespan, static_cast<double>(losses.front()),
              static_cast<double>(losses.back()));
  return losses.back() < 0.5f * losses.front() ? 0 : 1;
}
