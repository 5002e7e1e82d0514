// pipeoffload/backend/cuda/device.cuh: what every kernel file shares (the backend's in src/,
// a model's beside it, a user's own): the launch check, bf16 loads and stores, grid-stride
// indices. nvcc only.
/// @file
#pragma once

#include <cuda_bf16.h>

#include "check.hpp"
#include "kernels.hpp"
#include "shapes.hpp"

namespace pipeoffload::cuda::kernels {

/// p[i] as fp32.
__device__ inline float ld(const bf16* p, long long i) { return __bfloat162float(p[i]); }
/// x rounded to bf16 (to nearest even).
__device__ inline bf16 st(float x) { return __float2bfloat16(x); }

/// Grid-stride index range: for (long long i = first(); i < n; i += stride()).
__device__ inline long long first_index() { return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; }
/// The stride of a grid-stride loop: threads in the grid.
__device__ inline long long grid_stride() { return static_cast<long long>(gridDim.x) * blockDim.x; }

}  // namespace pipeoffload::cuda::kernels

/// Launches kernel<<<shape>>> on `stream` if the shape has work, then checks the launch
/// (configuration errors surface here; execution errors at the next synchronizing check).
#define PIPEOFFLOAD_LAUNCH(kernel, shape, stream, ...)                                                  \
  do {                                                                                                  \
    const ::pipeoffload::cuda::Launch launch_shape_ = (shape);                                          \
    if (launch_shape_.grid > 0) {                                                                       \
      kernel<<<launch_shape_.grid, launch_shape_.block, launch_shape_.shared, (stream)>>>(__VA_ARGS__); \
      ::pipeoffload::cuda::check(cudaGetLastError(), #kernel "<<<...>>>");                              \
    }                                                                                                   \
  } while (0)
