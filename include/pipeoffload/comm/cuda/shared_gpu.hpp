// pipeoffload/comm/cuda/shared_gpu.hpp: comm::SharedGpu, pipeline ranks that are threads of one
// process sharing one GPU (comm/shared_device.hpp's protocol on CUDA streams and events): a
// rank's sends and receives are device-to-device copies on its comm stream, ordered by events,
// so several ranks of a pipeline, and replicas with ZeRO's collectives, run and can be checked
// on a single GPU. NCCL refuses two ranks on one device; this needs no NCCL. The ranks share
// the GPU's SMs and memory bandwidth: a mode for debugging and validation, not a speed-up.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error \
    "pipeoffload/comm/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA (Meson: -Dcuda=enabled or auto with nvcc present)."
#endif

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../../backend/cuda/check.hpp"
#include "../../backend/cuda/cuda.hpp"
#include "../shared_device.hpp"

namespace pipeoffload::comm {

/// DeviceCopy's device calls on CUDA (comm::device_streams): events without timing, recorded on
/// and waited for by a context's stream, and cudaMemcpyAsync device to device. Every rank's
/// thread has selected the shared device (backend::Cuda's constructor does), and the ranks
/// share the process's primary context, so one rank's event may be waited for on another's
/// stream.
struct CudaStreams {
  using Context = backend::CudaContext;  ///< a pass's or the comm stream's context
  using Event = cudaEvent_t;             ///< a CUDA event
  /// A new event without timing.
  Event create() {
    Event e = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  /// Destroys `e` (errors ignored: called from destructors).
  void destroy(Event e) noexcept { (void)cudaEventDestroy(e); }
  /// `e` completes when ctx's stream reaches this point.
  void record(const Context& ctx, Event e) { PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e, ctx.cuda_stream)); }
  /// ctx's stream waits for e's last record.
  void wait(const Context& ctx, Event e) { PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(ctx.cuda_stream, e, 0)); }
  /// Copies `n` bytes from `src` to `dst`, both device memory, on ctx's stream.
  void copy(const Context& ctx, std::byte* dst, const std::byte* src, std::size_t n) {
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, ctx.cuda_stream));
  }
};

/// Thread ranks sharing one GPU: a comm::ThreadsGrid's handles with CUDA copies.
/// @code
///   po::comm::ThreadsGrid grid(2, 4);                  // 2 replicas of a 4-rank pipeline, one GPU
///   po::run_thread_ranks(grid, [&](int g) {
///     po::backend::Cuda dev({.device = 0, .rank = g, .arena_bytes = std::size_t{8} << 30});  // 8 GiB each
///     // ... the rank's stages (their own device memory) before the handles: whatever a peer
///     // may copy from must outlive them (a handle's destructor waits for its peers' copies)
///     po::comm::SharedGpu pipe(grid.pipeline(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
///     po::comm::SharedGpu reps(grid.replicas(g), po::comm::DeviceCopy<po::comm::CudaStreams>{});
///     // ... a po::Runtime on dev, the stages, pipe and reps
///   });
/// @endcode
using SharedGpu = SharedDevice<CudaStreams>;

static_assert(replica_communicator<SharedGpu, backend::CudaContext>,
              "comm::SharedGpu must model replica_communicator on backend::Cuda's contexts.");

}  // namespace pipeoffload::comm
