// pipeoffload/detail/host_device.hpp: PIPEOFFLOAD_HOST_DEVICE, for math that nvcc compiles for
// the device and the host compiler for the CPU (docs/design.md section 6).
#pragma once

#if defined(__CUDACC__)
#define PIPEOFFLOAD_HOST_DEVICE __host__ __device__
#else
#define PIPEOFFLOAD_HOST_DEVICE
#endif
