// tests/cuda/gpu_main.cpp: doctest main of the GPU tests: exit 77 (Meson's SKIP) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include <pipeoffload/backend/cuda/cuda.hpp>

int main(int argc, char** argv) {
  if (pipeoffload::backend::device_count() == 0) {
    std::puts("no CUDA device (cudaGetDeviceCount): SKIP");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
