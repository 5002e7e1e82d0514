// pipeoffload/backend/cuda/context.hpp: what a pass on backend::Cuda is given, apart from the
// backend itself, so that kernel files (the ops, users' own) can take it without the backend.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "pipeoffload/backend/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>

namespace pipeoffload::cuda {
class GemmPlans;
namespace attention {
class Graphs;
}
}  // namespace pipeoffload::cuda

namespace pipeoffload::backend {

class Cuda;

/// What a pass on backend::Cuda is given: the stream to enqueue on, and the device's library
/// handles and workspace, all bound to that device. The workspace is shared by the passes of
/// one stream (stream order serialises them).
struct CudaContext {
  Cuda* device = nullptr;                        ///< the backend the pass runs on
  int rank = 0;                                  ///< the backend's rank (Options::rank), for messages
  int stream = 0;                                ///< the backend's id of the stream the pass runs on
  cudaStream_t cuda_stream = nullptr;            ///< that stream: enqueue the pass's kernels here
  cublasLtHandle_t lt = nullptr;                 ///< the device's cuBLASLt handle
  cudnnHandle_t dnn = nullptr;                   ///< the device's cuDNN handle
  cuda::attention::Graphs* attention = nullptr;  ///< the SDPA graphs of `dnn`, owned by the backend
  std::byte* workspace = nullptr;                ///< (workspace_bytes) device scratch for cuBLASLt and cuDNN
  std::size_t workspace_bytes = 0;  ///< size of `workspace`, bytes (Options::workspace_bytes rounded up to a pool size)
  cuda::GemmPlans* gemms = nullptr;  ///< cuBLASLt plans of `lt`, owned by the backend (cuda::gemm)
};

}  // namespace pipeoffload::backend
