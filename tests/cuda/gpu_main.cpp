// tests/cuda/gpu_main.cpp: doctest main of the GPU tests: exit 77 (Meson's SKIP) without a GPU.
// The CUDA environment (eager module loading, one hardware queue per stream) is set before the
// first CUDA call, as train_gpt sets it (backend/cuda/environment.hpp says why).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include <pipeoffload/backend/cuda/cuda.hpp>
#include <pipeoffload/backend/cuda/environment.hpp>

int main(int argc, char** argv) {
  pipeoffload::cuda::apply_cuda_environment();
  if (pipeoffload::backend::device_count() == 0) {
    if (const std::string why = pipeoffload::backend::device_count_problem(); !why.empty()) {
      std::printf("FAIL: %s\n", why.c_str());  // a GPU that cannot be used is no reason to SKIP
      return 1;
    }
    std::puts("no CUDA device (cudaGetDeviceCount): SKIP");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
