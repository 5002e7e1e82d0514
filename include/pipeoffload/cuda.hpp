// pipeoffload/cuda.hpp: the CUDA umbrella: backend::Cuda, comm::Nccl, comm::SharedGpu, the
// backend's kernels, the ops for layers (ops/cuda.hpp), cuBLASLt GEMMs and cuDNN attention (the
// sample GPT's stage is models/gpt/cuda.hpp, outside the library). Build
// with the pipeoffload_cuda Meson dependency or CMake's pipeoffload::cuda (they define
// PIPEOFFLOAD_WITH_CUDA and link the kernels and NVIDIA libraries); the CPU-safe umbrella is
// pipeoffload/pipeoffload.hpp.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error \
    "pipeoffload/cuda.hpp needs a CUDA build: use Meson's pipeoffload_cuda_dep (-Dcuda=auto with nvcc, cuDNN, NCCL present) or CMake's pipeoffload::cuda, which define PIPEOFFLOAD_WITH_CUDA."
#endif

#include "backend/cuda/attention.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/cuda.hpp"
#include "backend/cuda/device_memory.hpp"
#include "backend/cuda/environment.hpp"
#include "backend/cuda/gemm.hpp"
#include "backend/cuda/gemm_key.hpp"
#include "backend/cuda/gemm_plans.hpp"
#include "backend/cuda/kernels.hpp"
#include "backend/cuda/pools.hpp"
#include "backend/cuda/shapes.hpp"
#include "backend/cuda/topology.hpp"
#include "comm/cuda/shared_gpu.hpp"
#include "comm/nccl/gather_pieces.hpp"
#include "comm/nccl/id_file.hpp"
#include "comm/nccl/nccl.hpp"
#include "ops/cuda.hpp"
#include "pipeoffload.hpp"
