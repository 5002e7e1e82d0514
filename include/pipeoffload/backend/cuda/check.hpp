// pipeoffload/backend/cuda/check.hpp: one check per library (CUDA runtime, cuBLAS(Lt), cuDNN).
//
// Each throws pipeoffload::cuda_error carrying the failed call's text, the library's own
// message and the caller's std::source_location. For the CUDA runtime the sticky "last error"
// is read and cleared first (cudaGetLastError), so the error reported is the call's own and a
// later, unrelated check does not report it again. NCCL's check (rank, host,
// ncclGetLastError) is in comm/nccl/nccl.hpp.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error \
    "pipeoffload/backend/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA (Meson: -Dcuda=enabled or auto with nvcc present)."
#endif

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <source_location>
#include <string>

#include "../../error.hpp"

namespace pipeoffload {

namespace cuda::detail {

inline std::string where(const std::source_location& loc) {
  return std::string(loc.file_name()) + ":" + std::to_string(loc.line()) + " (" + loc.function_name() + ")";
}

}  // namespace cuda::detail

namespace cuda {

/// Throws cuda_error unless `status` is cudaSuccess. The sticky error state is cleared first.
inline void check(cudaError_t status, const char* call, std::source_location loc = std::source_location::current()) {
  const cudaError_t last = cudaGetLastError();  // clears the sticky state as a side effect
  if (status == cudaSuccess) status = last;     // an earlier asynchronous launch failure
  if (status == cudaSuccess) return;
  throw cuda_error(std::string("CUDA error ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ") in " +
                   call + " at " + detail::where(loc));
}

/// Throws cuda_error unless `status` is CUDA_SUCCESS (driver API calls reached through
/// cudaGetDriverEntryPointByVersion, so nothing links libcuda directly).
inline void check(CUresult status, const char* call, std::source_location loc = std::source_location::current()) {
  if (status == CUDA_SUCCESS) return;
  cudaGetLastError();
  throw cuda_error(std::string("CUDA driver error ") + std::to_string(static_cast<int>(status)) + " in " + call +
                   " at " + detail::where(loc));
}

/// Throws cuda_error unless `status` is CUBLAS_STATUS_SUCCESS.
inline void check(cublasStatus_t status, const char* call, std::source_location loc = std::source_location::current()) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  cudaGetLastError();  // do not let a cuBLAS failure's CUDA side linger for the next check
  throw cuda_error(std::string("cuBLAS error ") + std::to_string(static_cast<int>(status)) + " in " + call + " at " +
                   detail::where(loc));
}

/// Throws cuda_error unless `status` is CUDNN_STATUS_SUCCESS; adds cuDNN's last error message.
inline void check(cudnnStatus_t status, const char* call, std::source_location loc = std::source_location::current()) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  cudaGetLastError();
  char message[512] = {};
  cudnnGetLastErrorString(message, sizeof message);
  throw cuda_error(std::string("cuDNN error ") + cudnnGetErrorString(status) + " in " + call + " at " +
                   detail::where(loc) + (message[0] ? std::string(": ") + message : std::string()));
}

}  // namespace cuda
}  // namespace pipeoffload

/// Checks a CUDA runtime, cuBLAS(Lt) or cuDNN call: PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s)).
/// A macro only to capture the call's text; the work is cuda::check's.
#define PIPEOFFLOAD_CUDA_CHECK(call)           \
  do {                                         \
    ::pipeoffload::cuda::check((call), #call); \
  } while (0)
