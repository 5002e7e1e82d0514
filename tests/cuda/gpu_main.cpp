// tests/cuda/gpu_main.cpp: doctest main of the GPU tests: exit 77 (Meson's SKIP) without a GPU.
// The CUDA environment (eager module loading, one hardware queue per stream) is set before the
// first CUDA call, as train_gpt sets it (backend/cuda/environment.hpp says why).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include <pipeoffload/backend/cuda/cuda.hpp>
#include <pipeoffload/backend/cuda/environment.hpp>

int main(int argc, char** argv) {
  pipeoffload::cuda::apply_cuda_environment();
  if (pipeoffload::backend::device_count() == 0) {
    std::puts("no CUDA device (cudaGetDeviceCount): SKIP");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
