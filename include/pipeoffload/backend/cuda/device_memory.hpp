// pipeoffload/backend/cuda/device_memory.hpp: cuda::DeviceMemory, cudaMalloc'd memory a layer
// owns outside backend::Cuda's arena (its parameters, gradients and scratch), freed on its device.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "pipeoffload/backend/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "check.hpp"

namespace pipeoffload::cuda {

/// cudaMalloc'd memory of one device, freed there on destruction (errors are not thrown from a
/// destructor; the owner keeps it alive until the passes that use it are done).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  /// `bytes` (at least 1) of device `device`'s memory; throws cuda_error when it has not enough.
  DeviceMemory(int device, std::size_t bytes) : device_(device) {
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
    void* p = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    ptr_ = static_cast<std::byte*>(p);
  }
  /// Takes o's memory; o holds none after.
  DeviceMemory(DeviceMemory&& o) noexcept : device_(o.device_), ptr_(std::exchange(o.ptr_, nullptr)) {}
  /// Frees this memory and takes o's.
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    if (this != &o) {
      release();
      device_ = o.device_;
      ptr_ = std::exchange(o.ptr_, nullptr);
    }
    return *this;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { release(); }

  /// The memory as T* (null when none is held).
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(ptr_);
  }

 private:
  void release() noexcept {
    if (ptr_ == nullptr) return;
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    cudaSetDevice(device_);
    cudaFree(ptr_);
    if (previous >= 0) cudaSetDevice(previous);
    cudaGetLastError();  // a failure here must not surface in an unrelated later check
    ptr_ = nullptr;
  }
  int device_ = 0;
  std::byte* ptr_ = nullptr;
};

}  // namespace pipeoffload::cuda
