// pipeoffload/backend/cuda/environment.hpp: the CUDA environment a process that trains on GPUs
// sets first thing in main (apply_cuda_environment: CUDA_MODULE_LOADING=EAGER,
// CUDA_DEVICE_MAX_CONNECTIONS=32, a user's own values left alone). Plain host code, tested on
// the CPU (tests/cuda/test_host.cpp). Why each: docs/processes_and_gpus.md, "The CUDA environment".
/// @file
#pragma once

#include <stdlib.h>  // setenv (POSIX)

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace pipeoffload::cuda {

/// CUDA's limit on CUDA_DEVICE_MAX_CONNECTIONS (hardware work queues per device).
inline constexpr int max_device_connections = 32;

/// Streams this library creates on one device: po::Runtime's compute, copy and comm streams,
/// backend::Cuda's between-steps stream, and per comm::Nccl its gather stream plus, counted
/// generously, NCCL's two internal streams of a communicator (its device and host streams).
constexpr int library_streams_per_device(int communicators) { return 3 + 1 + communicators * (1 + 2); }
static_assert(library_streams_per_device(2) + 1 <= max_device_connections,
              "Every stream of a rank with a pipeline and a replicas communicator (and the legacy default "
              "stream) must get its own hardware queue.");

/// One environment variable and why it is set.
struct EnvSetting {
  std::string name,  ///< the variable's name
      value,         ///< the value it is set to
      why;           ///< why it is set
};

/// The settings apply_cuda_environment makes (see the file comment).
inline std::vector<EnvSetting> cuda_environment() {
  return {{"CUDA_MODULE_LOADING", "EAGER",
           "load every kernel module when the context is created, not during a step while another "
           "rank's NCCL kernel runs"},
          {"CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(max_device_connections),
           "one hardware queue per stream, so a copy stream parked on a pair counter stalls no other stream"}};
}

/// Sets every variable of cuda_environment() that `get` reports unset (null), through `set`;
/// returns the names it set. The two functions stand for getenv and setenv (tests pass their own).
inline std::vector<std::string> apply_cuda_environment(const std::function<const char*(const char*)>& get,
                                                       const std::function<void(const char*, const char*)>& set) {
  std::vector<std::string> done;
  for (const EnvSetting& s : cuda_environment())
    if (get(s.name.c_str()) == nullptr) {
      set(s.name.c_str(), s.value.c_str());
      done.push_back(s.name);
    }
  return done;
}

/// apply_cuda_environment on this process's environment: call it first in main, before any
/// CUDA call (the driver reads both variables when it creates a context).
inline std::vector<std::string> apply_cuda_environment() {
  return apply_cuda_environment([](const char* n) { return static_cast<const char*>(std::getenv(n)); },
                                [](const char* n, const char* v) { ::setenv(n, v, 0); });
}

}  // namespace pipeoffload::cuda
