// tests/cuda/test_conformance_cpu.cpp: the backend conformance cases on backend::Cpu.
#include <chrono>
#include <memory>
#include <thread>

#include <pipeoffload/backend/cpu/cpu.hpp>

#include "backend_conformance.hpp"

namespace {

struct CpuTraits {
  static constexpr float tolerance = 0.0f;  // the same function on the same CPU: exact
  static constexpr float fp32_tolerance = 0.0f;
  static constexpr bool abort_throws = true;  // the waiting worker throws the abort
  static std::unique_ptr<pipeoffload::backend::Cpu> make() { return std::make_unique<pipeoffload::backend::Cpu>(); }
  static void delay(const pipeoffload::backend::CpuContext&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  static void gelu_forward(pipeoffload::backend::CpuContext&, const float* x, float* y, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) y[i] = pipeoffload::ops::gelu(x[i]);
  }
  static void gelu_backward(pipeoffload::backend::CpuContext&, const float* x, const float* dy, float* dx,
                            std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) dx[i] = dy[i] * pipeoffload::ops::gelu_grad(x[i]);
  }
};

}  // namespace

PIPEOFFLOAD_CONFORMANCE_CASES(CpuTraits, "backend::Cpu")
