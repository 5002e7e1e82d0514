// bench/sleep_layer.hpp: a layer that takes a fixed, known time per pass, for benchmarks that
// set measured iteration times against simulated ones (runtime_fidelity, dp_overlap).
#pragma once

#include <pipeoffload/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace bench {

inline constexpr double pass_s = 0.002;              // T_F = T_B = T_W
inline constexpr std::size_t unit_floats = 1 << 14;  // saved activations: 64 KiB per unit

/// Sleeps pass_s per pass and saves a 64 KiB unit, so offload moves real bytes; its W adds a
/// constant to each of its `params` gradients (within the pass's time), so the runtime's sums
/// and reductions move real values.
struct SleepLayer {
  explicit SleepLayer(std::size_t params = 1) : p(params, 0.0f), g(params, 0.0f) {}
  std::vector<float> p, g;
  po::Boundary input_boundary(po::MicrobatchShape) const { return {16}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {16}; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return unit_floats * sizeof(float); }
  std::size_t stash_bytes(po::MicrobatchShape) const { return 64; }
  // Sleeping overshoots by 0.1-0.2 ms on these VMs (10% of a pass): sleep to 0.3 ms before
  // the deadline, then yield until it, so a pass takes T and not T + the timer's slack.
  static void nap_until(std::chrono::steady_clock::time_point due) {
    std::this_thread::sleep_until(due - std::chrono::microseconds(300));
    while (std::chrono::steady_clock::now() < due) std::this_thread::yield();
  }
  static std::chrono::steady_clock::time_point deadline() {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(pass_s));
  }
  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor, po::Tensor y, std::byte*) {
    nap_until(deadline());
    if (y) std::fill(y.as<float>(), y.as<float>() + 16, 0.0f);
    if (mb.last()) *mb.loss = 0.0f;
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor dx, std::byte*,
                      std::byte*) {
    nap_until(deadline());
    if (dx) std::fill(dx.as<float>(), dx.as<float>() + 16, 0.0f);
  }
  void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte*, std::byte*) {
    const auto due = deadline();
    for (float& x : g) x += 1e-3f;
    nap_until(due);
  }
  std::span<float> parameters() { return p; }
  std::span<float> gradients() { return g; }
};

}  // namespace bench
