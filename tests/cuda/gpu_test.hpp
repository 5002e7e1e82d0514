// tests/cuda/gpu_test.hpp: what the GPU tests share: bf16-rounded random inputs, a stream with
// device buffers freed at the end, and a tolerance check that names the first bad elements.
#pragma once

#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <pipeoffload/backend/cuda/check.hpp>

namespace {

float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<float> random_bf16(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = round_bf16(d(rng));
  return v;
}

/// Device buffers for one test: uploads, downloads, frees at the end.
struct Gpu {
  cudaStream_t s = nullptr;
  std::vector<void*> owned;
  Gpu() { PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Gpu() {
    cudaStreamSynchronize(s);
    for (void* p : owned) cudaFree(p);
    cudaStreamDestroy(s);
  }
  template <class T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
    owned.push_back(p);
    return static_cast<T*>(p);
  }
  __nv_bfloat16* bf16(const std::vector<float>& v) {
    std::vector<__nv_bfloat16> h(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]);
    __nv_bfloat16* d = alloc<__nv_bfloat16>(v.size());
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    return d;
  }
  template <class T>
  T* copy(const std::vector<T>& v) {
    T* d = alloc<T>(v.size());
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  std::vector<float> get(const __nv_bfloat16* d, std::size_t n) {
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<__nv_bfloat16> h(n);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    std::vector<float> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
    return out;
  }
  template <class T>
  std::vector<T> get(const T* d, std::size_t n) {
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<T> out(n);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
};

void check_close(const std::vector<float>& got, const std::vector<float>& want, float rel, float abs_tol) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size() && bad < 10; ++i)
    if (!(std::abs(got[i] - want[i]) <= abs_tol + rel * std::abs(want[i]))) {
      ++bad;
      FAIL_CHECK("element " << i << ": got " << got[i] << ", want " << want[i]);
    }
}

constexpr float bf16_rel = 1.0f / 128;  // one rounding to bf16, with margin

}  // namespace
