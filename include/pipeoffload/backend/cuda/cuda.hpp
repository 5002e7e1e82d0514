// pipeoffload/backend/cuda/cuda.hpp: backend::Cuda, one GPU as a pipeoffload device: the
// `backend` concept on CUDA streams, events, one device slab and pinned bins, with no
// allocation after construction. How each part of the concept maps to CUDA: docs/backends.md,
// "backend::Cuda".
/// @file
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../error.hpp"
#include "../backend.hpp"
#include "../failure.hpp"
#include "attention.hpp"
#include "check.hpp"
#include "context.hpp"
#include "gemm_plans.hpp"
#include "kernels.hpp"
#include "pools.hpp"
#include "shapes.hpp"
#include "topology.hpp"

namespace pipeoffload::backend {

class Cuda;

namespace cuda_detail {

/// cuStreamWaitValue64 / cuStreamWriteValue64, looked up once through the runtime (so the
/// build links cudart only, not the driver library).
struct StreamMemOps {
  PFN_cuStreamWaitValue64_v11070 wait = nullptr;
  PFN_cuStreamWriteValue64_v11070 write = nullptr;
};
inline const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 11070, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw cuda_error("backend::Cuda: the driver has no cuStreamWaitValue64 (PCIe-pair copies need it)");
    o.wait = reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(fn);
    fn = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 11070, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw cuda_error("backend::Cuda: the driver has no cuStreamWriteValue64 (PCIe-pair copies need it)");
    o.write = reinterpret_cast<PFN_cuStreamWriteValue64_v11070>(fn);
    return o;
  }();
  return ops;
}

}  // namespace cuda_detail

/// Free and total bytes of a device.
struct DeviceMemory {
  std::size_t free = 0;   ///< bytes free now
  std::size_t total = 0;  ///< the device's bytes
};

/// The sentence refusing an arena of `arena_bytes` for rank `rank` on GPU `device`, which has
/// `m`, or "" when it fits: backend::Cuda's constructor throws it, and a launcher that checks
/// every rank before constructing any prints it.
inline std::string arena_refusal(std::size_t arena_bytes, int device, int rank, DeviceMemory m) {
  if (arena_bytes <= m.free) return {};
  char t[200];
  std::snprintf(t, sizeof t, "needs %.2f GiB of GPU %d's memory for its arena but the GPU has %.2f GiB free of %.2f",
                static_cast<double>(arena_bytes) / (1ull << 30), device, static_cast<double>(m.free) / (1ull << 30),
                static_cast<double>(m.total) / (1ull << 30));
  return "rank " + std::to_string(rank) + " " + t +
         " (Options::arena_bytes: activations, stashes, messages, model state, workspace); use fewer layers or "
         "microbatches per rank, a smaller batch or sequence, or more ranks";
}

/// The CUDA backend: one GPU, its streams and events, a device arena carved from one slab and
/// a pinned host arena (the `backend` concept, backend/backend.hpp, and its optional parts).
class Cuda : public detail::Failure<Cuda> {
 public:
  using Context = CudaContext;  ///< what a pass is given (stream, library handles, workspace)

  /// How the backend is set up: which device, how much memory it takes.
  struct Options {
    int device = 0;                                        ///< CUDA device ordinal
    int rank = 0;                                          ///< for contexts and messages
    std::size_t arena_bytes = 0;                           ///< device slab; 0 = 3/4 of the device's free memory
    std::size_t workspace_bytes = std::size_t{256} << 20;  ///< cuBLASLt + cuDNN scratch, inside the slab
    bool deterministic_attention = true;  ///< cuDNN's deterministic SDPA backward (runs repeat bit for bit)
    std::size_t max_norm_groups =
        default_max_norm_groups;  ///< most groups one sum_squares call takes (its pinned staging)
    /// Pinned host bytes the uploads since the last wait may use: an upload that fits does not
    /// wait (see upload).
    std::size_t upload_staging_bytes = default_upload_staging;
  };

  Cuda() : Cuda(Options{}) {}
  /// Selects the device and takes its slab, library handles and pinned staging; throws if the
  /// slab cannot hold the workspace or a CUDA call fails.
  explicit Cuda(Options opt) : opt_(opt) {
    select();
    DeviceMemory m;
    PIPEOFFLOAD_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
    if (opt_.arena_bytes == 0) opt_.arena_bytes = m.free / 4 * 3;
    // What the run asked for, against what the device has, before anything is taken.
    if (const std::string no = arena_refusal(opt_.arena_bytes, opt_.device, opt_.rank, m); !no.empty())
      throw error("backend::Cuda: " + no);
    opt_.arena_bytes = opt_.arena_bytes / alignment * alignment;
    // The workspace is carved from the arena: an arena that cannot hold it is refused before
    // anything is allocated (a constructor that throws later would leak the slab).
    if (round_up(opt_.workspace_bytes) > opt_.arena_bytes)
      throw error("backend::Cuda: Options::arena_bytes = " + std::to_string(opt_.arena_bytes) + " cannot hold the " +
                  std::to_string(round_up(opt_.workspace_bytes)) +
                  "-byte cuBLASLt/cuDNN workspace (Options::workspace_bytes) carved from it; "
                  "give at least the workspace plus what the run allocates");
    void* slab = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&slab, opt_.arena_bytes));
    slab_ = static_cast<std::byte*>(slab);
    PIPEOFFLOAD_CUDA_CHECK(cublasLtCreate(&lt_));
    PIPEOFFLOAD_CUDA_CHECK(cudnnCreate(&dnn_));
    attention_ = std::make_unique<cuda::attention::Graphs>(dnn_, opt_.deterministic_attention);
    gemms_ = std::make_unique<cuda::GemmPlans>(lt_, round_up(opt_.workspace_bytes));
    // The workspace is carved first and never freed: it is not one of the runtime's kinds.
    workspace_ = carve(round_up(opt_.workspace_bytes));
    // The stream of the between-steps operations (download, upload, zero, sum_squares, adamw, sgd).
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreateWithFlags(&aux_, cudaStreamNonBlocking));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&aux_done_, cudaEventDisableTiming));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreateWithFlags(&clock_, cudaStreamNonBlocking));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&anchor_));
    // (3 * max_norm_groups + 1) int64 table and max_norm_groups fp64 sums, then the uploads'
    // staging, pinned host, owned here: sum_squares' uploads and results and upload()'s copies,
    // so that no step copies through pageable memory.
    void* staging = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaHostAlloc(&staging, cuda_staging_bytes(opt_.max_norm_groups, opt_.upload_staging_bytes),
                                         cudaHostAllocPortable));
    norm_staging_ = static_cast<std::byte*>(staging);
    upload_staging_ = norm_staging_ + norm_staging_bytes();
  }
  Cuda(const Cuda&) = delete;
  Cuda& operator=(const Cuda&) = delete;

  /// Waits for the device, then releases everything (errors are not thrown from here).
  ~Cuda() {
    cudaSetDevice(opt_.device);
    // Every stream's work, this backend's and every other user's of the device: ranks sharing
    // a GPU (comm::SharedGpu) may have copies queued that read this one's memory (each waits
    // only for records made).
    cudaDeviceSynchronize();
    for (auto& [size, list] : free_host_)
      for (const Free& f : list) cudaFreeHost(f.ptr);
    for (std::byte* p : host_in_use_) cudaFreeHost(p);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : guard_pool_) cudaEventDestroy(e);
    for (auto& [size, list] : free_device_)
      for (const Free& f : list)
        if (f.guard) cudaEventDestroy(f.guard);
    for (auto& s : streams_) {
      cudaStreamDestroy(s.stream);
      cudaEventDestroy(s.joined);
      if (s.held) cudaEventDestroy(s.held);
    }
    if (aux_) cudaStreamDestroy(aux_);
    if (aux_done_) cudaEventDestroy(aux_done_);
    if (fork_) cudaEventDestroy(fork_);
    for (const Mark& m : marks_) cudaEventDestroy(m.event);
    for (cudaEvent_t e : timing_pool_) cudaEventDestroy(e);
    if (anchor_) cudaEventDestroy(anchor_);
    if (clock_) cudaStreamDestroy(clock_);
    if (norm_staging_) cudaFreeHost(norm_staging_);
    attention_.reset();  // its graphs were finalized against dnn_
    gemms_.reset();      // its descriptors belong to lt_'s device
    if (dnn_) cudnnDestroy(dnn_);
    if (lt_) cublasLtDestroy(lt_);
    cudaFree(slab_);
    cudaGetLastError();
  }

  /// A new non-blocking stream, named `name` in messages; returns its id.
  int make_stream(std::string name) {
    select();
    cudaStream_t s = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t joined = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
    streams_.push_back({std::move(name), s, joined, nullptr, false});
    return static_cast<int>(streams_.size()) - 1;
  }

  /// A new event (timing disabled); returns its id.
  int make_event() {
    select();
    cudaEvent_t e = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
    return static_cast<int>(events_.size()) - 1;
  }

  /// Calls fn now, with `stream` as the current stream (fn enqueues work on it).
  void launch(int stream, std::function<void()> fn) {
    at(stream);
    if (failed()) return;  // a failed device drops new work, as backend::Cpu does
    select();
    fence();
    const int saved = current_;
    current_ = stream;
    try {
      fn();
    } catch (const std::exception& e) {
      fail(e.what());
    } catch (...) {
      fail("unknown exception on stream " + streams_[static_cast<std::size_t>(stream)].name);
    }
    current_ = saved;
  }

  /// Records `event` on `stream` (cudaEventRecord); nothing once the device has failed.
  void record(int event, int stream) {
    if (failed()) return;
    select();
    fence();
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev(event), at(stream)));
  }

  /// Makes `stream` wait for the latest record of `event` (cudaStreamWaitEvent).
  void wait(int stream, int event) {
    if (failed()) return;
    select();
    fence();
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(at(stream), ev(event), 0));
  }

  /// From inside a pass on ctx's stream: the pass's later kernels wait for the latest record
  /// of `event` (backend::waits_in_pass; the host code of a pass runs as it is launched, so
  /// this is wait() on the pass's stream).
  void wait_in_pass(const Context& ctx, int event) { wait(ctx.stream, event); }

  /// Host waits for every stream and the enqueued between-steps operations (sum_squares'
  /// results are then in their `out`); throws the first error (a failed pass, or a CUDA error
  /// reported by a stream), after which the device stays failed.
  void synchronize() {
    require_no_capture("synchronize");
    select();
    ++host_waits_;
    try {
      finish_aux(false);
    } catch (const std::exception& e) {
      fail(std::string("between-steps operations: ") + e.what());
    }
    for (const auto& s : streams_) {
      try {
        if (polls_.empty())
          PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(s.stream));
        else
          poll_until_idle(s.stream);
      } catch (const std::exception& e) {
        fail("stream " + s.name + ": " + e.what());
      }
    }
    resolve_marks();
    std::lock_guard lk(mu_);
    if (failed_) throw error(error_);
  }

  // ---- captured work (backend::captures_graphs) ---------------------------------------------

  /// A captured stretch of work: an instantiated CUDA graph and the stream it is launched on.
  class Graph {
   public:
    Graph() = default;
    /// Takes `o`'s graph (`o` is left empty).
    Graph(Graph&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)), origin_(o.origin_) {}
    /// Drops this graph and takes `o`'s (`o` is left empty).
    Graph& operator=(Graph&& o) noexcept {
      if (this != &o) {
        reset();
        exec_ = std::exchange(o.exec_, nullptr);
        origin_ = o.origin_;
      }
      return *this;
    }
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() { reset(); }
    /// Whether it holds a graph (end_capture's do).
    explicit operator bool() const { return exec_ != nullptr; }

   private:
    friend class Cuda;
    void reset() {
      if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
      exec_ = nullptr;
    }
    cudaGraphExec_t exec_ = nullptr;
    int origin_ = -1;
  };
  /// A replay repeats the device work the launches enqueued, not the launches (backend.hpp).
  static constexpr bool replays_launches = false;

  /// Starts capturing every stream into one CUDA graph (cudaStreamBeginCapture on `origin`,
  /// thread-local mode, the other streams forked from it). Waits for the device first, so no
  /// earlier work or block guard crosses into the capture.
  void begin_capture(int origin) {
    if (capturing_ >= 0)
      throw error("backend::Cuda::begin_capture: stream " + std::to_string(capturing_) + " is capturing already");
    at(origin);
    synchronize();
    fence();  // (the between-steps work is done: its fence stays outside the capture)
    forget_guards();
    select();
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamBeginCapture(at(origin), cudaStreamCaptureModeThreadLocal));
    capturing_ = origin;
    try {
      PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(fork_, at(origin)));
      for (std::size_t i = 0; i < streams_.size(); ++i)
        if (static_cast<int>(i) != origin) PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(streams_[i].stream, fork_, 0));
    } catch (...) {
      end_capture_quietly();
      throw;
    }
  }

  /// Ends the capture: joins the other streams back into the origin, instantiates the graph
  /// and returns it. Throws (the device failed, with the first error) when a pass failed or
  /// CUDA refused a call during the capture. Blocks freed during the capture are free again
  /// without a guard: their last use is in the graph, which replay() orders before every
  /// stream's later work.
  Graph end_capture() {
    if (capturing_ < 0) throw error("backend::Cuda::end_capture: no capture is under way (begin_capture)");
    const int origin = capturing_;
    select();
    cudaError_t joined = cudaSuccess;
    for (std::size_t i = 0; i < streams_.size() && joined == cudaSuccess; ++i) {
      if (static_cast<int>(i) == origin) continue;
      joined = cudaEventRecord(streams_[i].joined, streams_[i].stream);
      if (joined == cudaSuccess) joined = cudaStreamWaitEvent(at(origin), streams_[i].joined, 0);
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(at(origin), &graph);
    capturing_ = -1;
    forget_guards();
    std::string why;
    {
      std::lock_guard lk(mu_);
      if (failed_) why = error_;
    }
    const auto text = [](const char* call, cudaError_t e) {
      return std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    };
    if (why.empty() && joined != cudaSuccess) why = text("joining the streams", joined);
    if (why.empty() && ended != cudaSuccess) why = text("cudaStreamEndCapture", ended);
    Graph g;
    g.origin_ = origin;
    if (why.empty())
      if (const cudaError_t e = cudaGraphInstantiate(&g.exec_, graph, 0); e != cudaSuccess)
        why = text("cudaGraphInstantiate", e);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!why.empty()) {
      cudaGetLastError();
      fail("capturing a step: " + why);
      throw error("backend::Cuda: the capture failed: " + why);
    }
    return g;
  }

  /// Launches `g` on its origin stream, after every stream's earlier work; every stream's
  /// later work waits for it. Nothing once the device has failed.
  void replay(const Graph& g) {
    if (!g) throw error("backend::Cuda::replay: an empty Graph (end_capture makes them)");
    if (failed()) return;
    select();
    fence();
    const int o = g.origin_;
    for (std::size_t i = 0; i < streams_.size(); ++i)
      if (static_cast<int>(i) != o) {
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(streams_[i].joined, streams_[i].stream));
        PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(at(o), streams_[i].joined, 0));
      }
    PIPEOFFLOAD_CUDA_CHECK(cudaGraphLaunch(g.exec_, at(o)));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(fork_, at(o)));
    for (std::size_t i = 0; i < streams_.size(); ++i)
      if (static_cast<int>(i) != o) PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(streams_[i].stream, fork_, 0));
  }

  /// Registers `poll`, which synchronize() calls on the waiting (the rank's own) thread while
  /// a stream is busy; a poll that throws fails the device with its message, and the wait goes
  /// on until the streams drain (the poll is expected to have ended what they wait for: an
  /// NCCL communicator aborts itself there). Returns an id for remove_wait_poll.
  int add_wait_poll(std::function<void()> poll) {
    polls_.push_back({next_poll_, std::move(poll)});
    return next_poll_++;
  }
  /// Unregisters the poll add_wait_poll returned `id` for.
  void remove_wait_poll(int id) {
    std::erase_if(polls_, [id](const Poll& p) { return p.id == id; });
  }

  /// What a pass on `stream` is given: the stream, the device's library handles and workspace.
  Context context(int stream) {
    select();
    fence();
    return Context{this,
                   opt_.rank,
                   stream,
                   at(stream),
                   lt_,
                   dnn_,
                   attention_.get(),
                   workspace_,
                   round_up(opt_.workspace_bytes),
                   gemms_.get()};
  }

  /// Host seconds on a clock shared by every device of the process (the clock of mark()).
  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  /// backend::marks_times: a timing event on the current stream, converted at the next
  /// synchronize() to now()'s clock through an anchor event recorded on an idle stream of its
  /// own at the first mark after a synchronize (the GPU reaches it within microseconds of the
  /// call). During a capture, or on a failed device: the time of the call.
  void mark(double* slot) {
    const int s = current_or_throw("mark");
    if (capturing_ >= 0 || failed()) {
      *slot = now();
      return;
    }
    select();
    if (!anchored_) {
      PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(anchor_, clock_));
      anchor_host_ = now();
      anchored_ = true;
    }
    if (timing_pool_.empty()) {
      cudaEvent_t e = nullptr;
      PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&e));  // (timing on)
      timing_pool_.push_back(e);
    }
    const cudaEvent_t e = timing_pool_.back();
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e, at(s)));
    timing_pool_.pop_back();
    marks_.push_back({e, slot});
  }

  // ---- memory ------------------------------------------------------------------------

  /// A block of the device slab (256-byte aligned), in the current stream's order: a free
  /// block of its size class (reserved ones included), else a new one carved from the slab.
  Block device_alloc(std::size_t bytes, Memory kind) {
    select();
    const std::size_t size = round_up(bytes);
    std::byte* p = take_free(free_device_[size]);
    if (p == nullptr) {
      p = carve(size);
      device_book_.add_block(size);
      ++stats_.device_allocations;
    }
    stats_.take(kind, bytes);
    return Block{p, bytes, kind};
  }

  /// Returns a block; it is reused only after the current stream has passed this point.
  void device_free(Block b) {
    if (b.ptr == nullptr) return;
    select();
    free_device_[round_up(b.bytes)].push_back(guarded(b.ptr));
    stats_.give(b.kind, b.bytes);
  }

  /// A pinned host buffer of `bytes` (the runtime asks for power-of-two bins).
  HostBlock host_alloc(std::size_t bytes) {
    select();
    const std::size_t size = round_up(bytes);
    std::byte* p = take_free(free_host_[size]);
    if (p == nullptr) {  // nothing reserved of this size: a run without po::Runtime's reservation
      p = pin(size);
      host_book_.add_block(size);
      ++stats_.host_allocations;
    }
    host_in_use_.push_back(p);
    stats_.take_host(bytes);
    return HostBlock{p, bytes};
  }

  /// Returns a host_alloc block to the pinned arena (a null block is ignored).
  void host_free(HostBlock b) {
    if (b.ptr == nullptr) return;
    select();
    const auto it = std::find(host_in_use_.begin(), host_in_use_.end(), b.ptr);
    if (it == host_in_use_.end())
      throw error("backend::Cuda::host_free: the block was not handed out by this device's host_alloc");
    host_in_use_.erase(it);
    free_host_[round_up(b.bytes)].push_back(guarded(b.ptr));
    stats_.give_host(b.bytes);
  }

  /// backend::reserves_memory: adds `count` blocks of `bytes` to what the pools hold for their
  /// callers (reservations add up), carving the missing ones from the slab now; throws, naming
  /// the sizes, when the slab cannot hold them.
  void reserve_device(std::size_t bytes, std::size_t count) {
    select();
    const std::size_t size = round_up(bytes), make = device_book_.missing(bytes, count);
    cuda::require_room("backend::Cuda::reserve_device", opt_.arena_bytes, top_, make * size);
    std::vector<Free>& list = free_device_[size];
    list.reserve(list.size() + make);
    for (std::size_t i = 0; i < make; ++i) list.push_back(Free{carve(size)});
    device_book_.reserve(bytes, count);
    stats_.device_allocations += static_cast<long long>(make);
  }
  /// Likewise for pinned host blocks (cudaHostAlloc, portable), made now.
  void reserve_host(std::size_t bytes, std::size_t count) {
    select();
    const std::size_t size = round_up(bytes), make = host_book_.missing(bytes, count);
    std::vector<Free>& list = free_host_[size];
    list.reserve(list.size() + make);
    // Each pinned block joins its pool as soon as it exists (the destructor frees the pools),
    // so a failing cudaHostAlloc leaks nothing; the book counts what exists.
    for (std::size_t i = 0; i < make; ++i) {
      list.push_back(Free{pin(size)});
      host_book_.add_block(size);
      ++stats_.host_allocations;
    }
    host_book_.reserve(bytes, count);
  }

  /// backend::resets_arena: once every block is given back, waits for the device, frees the
  /// pooled pinned blocks, rewinds the slab to the workspace and forgets every reservation (the
  /// next ones are carved from the front again); sum_squares' own block goes too and is taken
  /// again by the next reserve_sum_squares. `arena_bytes` (0: unchanged) becomes the slab's
  /// size: the old slab is freed first, then the new size is checked against the device's free
  /// memory as the constructor checks it; a size refused there keeps the old size (the arena
  /// is started over all the same) and the refusal is thrown. Refused with a sentence, changing
  /// nothing, while a block is handed out, during a capture, or when the new size cannot hold
  /// the workspace.
  void reset_arena(std::size_t arena_bytes = 0) {
    require_no_capture("reset_arena");
    synchronize();
    if (arena_bytes != 0 && round_up(opt_.workspace_bytes) > arena_bytes / alignment * alignment)
      throw error("backend::Cuda::reset_arena: arena_bytes = " + std::to_string(arena_bytes) + " cannot hold the " +
                  std::to_string(round_up(opt_.workspace_bytes)) + "-byte cuBLASLt/cuDNN workspace carved from it");
    std::size_t pooled[2] = {0, 0};
    for (int i = 0; i < 2; ++i)
      for (const auto& [size, list] : i == 0 ? free_device_ : free_host_) pooled[i] += size * list.size();
    const std::size_t own = norms_.ptr != nullptr ? round_up(norms_.bytes) : 0;
    const std::size_t out[2] = {device_book_.bytes_held() - pooled[0] - own, host_book_.bytes_held() - pooled[1]};
    if (out[0] + out[1] > 0)
      throw error("backend::Cuda::reset_arena: " + std::to_string(out[0]) + " device and " + std::to_string(out[1]) +
                  " pinned host bytes are still handed out; give every block back first (destroy the po::Runtime and "
                  "optimizer that hold them)");
    device_free(norms_);  // outside launch(): no guard, the device is idle
    norms_ = {};
    norm_table_.clear();
    forget_guards();
    for (auto& [size, list] : free_host_)
      for (const Free& f : list) {
        PIPEOFFLOAD_CUDA_CHECK(cudaFreeHost(f.ptr));
        stats_.host_held -= size;
      }
    free_host_.clear();
    free_device_.clear();
    host_book_ = {};
    device_book_ = {};
    top_ = 0;
    std::string refused;
    if (arena_bytes != 0 && arena_bytes / alignment * alignment != opt_.arena_bytes) refused = resize_slab(arena_bytes);
    workspace_ = carve(round_up(opt_.workspace_bytes));
    if (!refused.empty()) throw error("backend::Cuda::reset_arena: " + refused);
  }

  /// Bytes in use and peaks, device and pinned host.
  MemoryStats memory() const { return stats_; }

  /// Starts new peaks: every peak becomes what is in use now.
  void reset_peaks() { stats_.reset_peaks(); }

  /// Enqueues the pieces, in order, on the current stream (cudaMemcpyAsync with
  /// cudaMemcpyDefault: unified addressing tells host from device). Called from work launched
  /// on the copy stream, so offloads and reloads share that one stream.
  void transfer(std::span<const CopyPiece> pieces) {
    select();
    const cudaStream_t s = at(current_or_throw("transfer"));
    for (const CopyPiece& c : pieces)
      if (c.bytes > 0) PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, s));
  }

  // ---- between steps, on a private stream: copies blocking, the rest enqueued -------------

  /// Copies `bytes` from device memory to host memory, after the enqueued operations, and
  /// waits for the copy.
  void download(void* host, const void* device, std::size_t bytes) { blocking_copy(host, device, bytes); }
  /// Copies `bytes` from host memory to device memory, enqueued (after every stream's work so
  /// far, before any later work; `host` may be reused when it returns): through the pinned
  /// staging with no wait when it fits in what the uploads since the last wait have left of
  /// Options::upload_staging_bytes; one that finds the staging full waits for the copies
  /// before it first, and one larger than the whole staging waits for its own copy.
  void upload(void* device, const void* host, std::size_t bytes) {
    require_no_capture("upload");
    if (bytes == 0) return;
    select();
    const detail::StagedUpload u = detail::stage_upload(bytes, upload_top_, opt_.upload_staging_bytes);
    // A full staging waits for the uploads before (empties it), not for the streams' work:
    // the copy is ordered after that (join) only once it is enqueued.
    if (u.staged && u.wait) finish_aux(true);
    join();
    if (!u.staged) {
      blocking_copy(device, host, bytes);
      return;
    }
    std::byte* staged = upload_staging_ + u.at;
    std::memcpy(staged, host, bytes);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(device, staged, bytes, cudaMemcpyHostToDevice, aux_));
    upload_top_ = u.used;
    aux_pending_ = true;
  }

  /// Enqueues setting `bytes` of device memory to zero (Runtime::zero_grad, the runtime's check
  /// flags); the host does not wait.
  void zero(void* device, std::size_t bytes) {
    if (bytes == 0) return;
    select();
    join();
    PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(device, 0, bytes, aux_));
    aux_pending_ = true;
  }

  /// Times the host has waited for the device: synchronize(), download(), and upload() where
  /// its staging is full (the enqueued operations never wait). A training step waits where it
  /// reads its results.
  long long host_waits() const { return host_waits_; }

  // ---- within a pass's stream order --------------------------------------------------------

  /// Enqueues, on the pass's stream, a kernel that sets the uint32 at `flag` (device memory)
  /// to 1 if any element of `t` is NaN or infinite (kernels::flag_nonfinite: the bits
  /// backend::Cpu tests). Integer tensors have nothing to check; an empty view is skipped.
  void flag_nonfinite(Context& ctx, ConstTensor t, std::uint32_t* flag) {
    if (t.data == nullptr || t.elements == 0 || !is_floating(t.dtype)) return;
    select();
    cuda::kernels::flag_nonfinite(t.data, static_cast<long long>(t.elements), t.dtype, flag, ctx.cuda_stream);
  }

  // ---- optimizer updates (backend::updates_parameters): enqueued on the private stream -------

  /// Enqueues out[k] = sum of squares of the k-th run of groups[k] values, in fp64 and in the
  /// fixed order of cuda::sum_squares_reference (shapes.hpp): every group is cut into blocks of
  /// norm_chunk values reduced by one thread block each, all groups in one launch, then one
  /// block per group adds its blocks' partial sums. The same gradients give the same bits,
  /// whatever the GPU. `out` is written when the next synchronize() (or download, upload)
  /// returns, so every piece of a norm costs one wait together. Its buffers (the group table,
  /// the partials and the sums, one device block of cuda::norm_buffer_bytes) are made by
  /// reserve_sum_squares, which po::Runtime calls at construction for every chunk's groups, so
  /// no step carves; a call with larger groups than reserved (a caller outside the runtime)
  /// carves a larger block then. The table is uploaded again only when the groups change; the
  /// tables and sums of the calls since the last wait share the pinned staging (a call that
  /// finds it full waits for the ones before it first).
  void sum_squares(std::span<const float> values, std::span<const std::size_t> groups, std::span<double> out) {
    detail::require_groups("backend::Cuda::sum_squares", values.size(), groups, out.size());
    if (groups.empty()) return;
    check_norm_groups("backend::Cuda::sum_squares", groups.size());
    select();
    const cuda::NormPlan plan = cuda::sum_squares_plan(groups);
    const std::vector<long long> table = cuda::norm_table(plan, groups);
    const std::size_t g = groups.size(), table_bytes = table.size() * sizeof(long long);
    if (staging_top_ + table_bytes + g * sizeof(double) > norm_staging_bytes()) finish_aux(true);
    join();
    reserve_sum_squares(groups);  // a no-op where the runtime reserved them
    // norms_: (3g + 1) int64 table, then plan.blocks() fp64 partials, then g fp64 sums.
    auto* dev_table = reinterpret_cast<long long*>(norms_.ptr);
    auto* partials = reinterpret_cast<double*>(norms_.ptr + table_bytes);
    double* sums = partials + plan.blocks();
    if (table != norm_table_) {
      std::memcpy(norm_staging_ + staging_top_, table.data(), table_bytes);
      PIPEOFFLOAD_CUDA_CHECK(
          cudaMemcpyAsync(dev_table, norm_staging_ + staging_top_, table_bytes, cudaMemcpyHostToDevice, aux_));
      staging_top_ += table_bytes;
      norm_table_ = table;
    }
    cuda::kernels::sum_squares(values.data(), dev_table, static_cast<long long>(g), plan.blocks(), partials, sums,
                               aux_);
    PIPEOFFLOAD_CUDA_CHECK(
        cudaMemcpyAsync(norm_staging_ + staging_top_, sums, g * sizeof(double), cudaMemcpyDeviceToHost, aux_));
    pending_sums_.push_back({out, staging_top_});
    staging_top_ += g * sizeof(double);
    aux_pending_ = true;
  }

  /// Makes sum_squares' device block large enough for `groups` now (see sum_squares; the
  /// runtime calls it for each chunk's norm groups at construction). It only grows.
  void reserve_sum_squares(std::span<const std::size_t> groups) {
    // Refused here, when the runtime reserves, rather than inside a step.
    check_norm_groups("backend::Cuda::reserve_sum_squares", groups.size());
    // Whole size classes: a need that its block's class holds takes no new block.
    const std::size_t need = round_up(cuda::norm_buffer_bytes(groups));
    if (norms_.bytes >= need) return;
    select();
    device_free(norms_);
    norms_ = device_alloc(need, Memory::state);
    norm_table_.clear();
  }

  /// Enqueues update::adamw_at on every value of every segment and the bfloat16 working
  /// copies (kernels::adamw: one launch per cuda::segments_per_launch segments). Gradients are
  /// only read (Runtime::zero_grad clears them), so several updates may follow one backward.
  void adamw(std::span<const update::Segment> segments, const update::AdamWStep& step) {
    detail::require_segments("backend::Cuda::adamw", segments, 2);
    select();
    join();
    for (const cuda::SegmentLaunch& l : cuda::segment_launches(segments)) cuda::kernels::adamw(l, step, aux_);
    aux_pending_ = true;
  }

  /// Enqueues update::sgd_at likewise (kernels::sgd); without momentum the segments have no state.
  void sgd(std::span<const update::Segment> segments, const update::SgdStep& step) {
    detail::require_segments("backend::Cuda::sgd", segments, step.momentum != 0.0f ? 1 : 0);
    select();
    join();
    for (const cuda::SegmentLaunch& l : cuda::segment_launches(segments)) cuda::kernels::sgd(l, step, aux_);
    aux_pending_ = true;
  }

  /// Until release(), the between-steps operations (zero, upload, sum_squares, adamw, sgd:
  /// those after every stream's earlier work) wait for `stream` only up to this point, not for
  /// what it is given after (a second hold keeps the first point); the caller orders what
  /// depends on that with events (backend::reduces_gradients: ZeRO-1's overlapped parameter
  /// gather, which the next step's zeroing and uploads need not wait for).
  void hold(int stream) {
    require_no_capture("hold");
    (void)at(stream);
    StreamInfo& s = streams_[static_cast<std::size_t>(stream)];
    if (s.holding) return;
    select();
    if (s.held == nullptr) PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&s.held, cudaEventDisableTiming));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(s.held, s.stream));
    s.holding = true;
    streams_used_ = true;  // the next between-steps operation waits for that point
  }
  /// Every stream waited for whole again by the between-steps operations.
  void release() {
    for (StreamInfo& s : streams_)
      if (s.holding) {
        s.holding = false;
        streams_used_ = true;
      }
  }

  // ---- gradient sums (backend::reduces_gradients): enqueued on the pass's stream ---------

  /// out[i] = ((parts[i] + parts[n + i]) + ...) in fp32 (n = out.size()), enqueued on ctx's stream.
  void sum_parts(Context& ctx, std::span<float> out, std::span<const float> parts) {
    detail::require_parts("backend::Cuda::sum_parts", out.size(), parts.size());
    if (out.empty()) return;
    select();
    cuda::kernels::sum_parts(out.data(), parts.data(), static_cast<long long>(out.size()),
                             static_cast<int>(parts.size() / out.size()), ctx.cuda_stream);
  }
  /// The same over bfloat16 parts (po::bf16_bits), each widened exactly, enqueued on ctx's stream.
  void sum_parts(Context& ctx, std::span<float> out, std::span<const std::uint16_t> parts) {
    detail::require_parts("backend::Cuda::sum_parts", out.size(), parts.size());
    if (out.empty()) return;
    select();
    cuda::kernels::sum_parts(out.data(), reinterpret_cast<const __nv_bfloat16*>(parts.data()),
                             static_cast<long long>(out.size()), static_cast<int>(parts.size() / out.size()),
                             ctx.cuda_stream);
  }
  /// out[i] = po::bf16_bits(in[i]), enqueued on ctx's stream.
  void to_bf16(Context& ctx, std::span<std::uint16_t> out, std::span<const float> in) {
    detail::require_same_size("backend::Cuda::to_bf16", out.size(), in.size());
    if (in.empty()) return;
    select();
    cuda::kernels::to_bf16(in.data(), reinterpret_cast<__nv_bfloat16*>(out.data()), static_cast<long long>(in.size()),
                           ctx.cuda_stream);
  }

  /// acc[i] += g[i] on exact's grid, enqueued on ctx's stream.
  void exact_add(Context& ctx, std::span<exact::Fixed> acc, std::span<const float> g) {
    detail::require_same_size("backend::Cuda::exact_add", acc.size(), g.size());
    if (acc.empty()) return;
    select();
    cuda::kernels::exact_add(acc.data(), g.data(), static_cast<long long>(acc.size()), ctx.cuda_stream);
  }
  /// out[i] = parts[i] + parts[n + i] + ... (n = out.size()), enqueued on ctx's stream.
  void exact_sum(Context& ctx, std::span<exact::Fixed> out, std::span<const exact::Fixed> parts) {
    detail::require_parts("backend::Cuda::exact_sum", out.size(), parts.size());
    if (out.empty()) return;
    select();
    cuda::kernels::exact_sum(out.data(), parts.data(), static_cast<long long>(out.size()),
                             static_cast<int>(parts.size() / out.size()), ctx.cuda_stream);
  }
  /// out[i] = exact::to_float(acc[i]), enqueued on ctx's stream.
  void exact_round(Context& ctx, std::span<float> out, std::span<const exact::Fixed> acc) {
    detail::require_same_size("backend::Cuda::exact_round", out.size(), acc.size());
    if (out.empty()) return;
    select();
    cuda::kernels::exact_round(out.data(), acc.data(), static_cast<long long>(out.size()), ctx.cuda_stream);
  }
  /// Copies `bytes` of device memory from src to dst, enqueued on ctx's stream.
  void copy(Context& ctx, void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    select();
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx.cuda_stream));
  }
  /// Sets `bytes` of device memory at dst to zero, enqueued on ctx's stream.
  void zero(Context& ctx, void* dst, std::size_t bytes) {
    if (bytes == 0) return;
    select();
    PIPEOFFLOAD_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, ctx.cuda_stream));
  }

  // ---- PCIe pairs (backend::pairs_copies) -----------------------------------------------

  /// A monotone counter in pinned, mapped host memory (portable: every device of the process
  /// sees it). A stream raises it with cuStreamWriteValue64 after its earlier work and waits
  /// for it with cuStreamWaitValue64 (GEQ); the host never blocks. abort() writes a value far
  /// above any wait's, so a stream parked on it drains (the device is failed by then). A write
  /// enqueued before the abort may still land after it and lower the value again, parking a
  /// stream that waits for more: keep_aborted() raises it back, and po::Runtime::pair_with
  /// registers it as a wait poll, so that every wait for the streams keeps the abort in force.
  /// CUDA's scheduler does not see these waits: a parked stream stalls the hardware queue it
  /// is mapped to, and with more streams than queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by
  /// default) a compute or comm stream may share it and wait for the copy, a dependency no
  /// schedule validated. Processes set 32 queues before their first CUDA call
  /// (cuda::apply_cuda_environment, backend/cuda/environment.hpp), one per stream.
  class Counter {
   public:
    Counter() {
      void* p = nullptr;
      PIPEOFFLOAD_CUDA_CHECK(cudaHostAlloc(&p, sizeof(std::uint64_t), cudaHostAllocPortable | cudaHostAllocMapped));
      host_ = static_cast<std::uint64_t*>(p);
      *host_ = 0;
      void* d = nullptr;
      PIPEOFFLOAD_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
      device_ = reinterpret_cast<CUdeviceptr>(d);
    }
    Counter(const Counter&) = delete;
    Counter& operator=(const Counter&) = delete;
    ~Counter() { cudaFreeHost(host_); }
    /// Raises the counter far above any wait's value, releasing every stream waiting on it.
    void abort(std::string) {
      aborted_.store(true, std::memory_order_release);
      std::atomic_ref<std::uint64_t>(*host_).store(aborted_value, std::memory_order_release);
    }
    /// After abort(): raises the counter back above every wait's value if a stream's write
    /// has lowered it since (before abort(): nothing).
    void keep_aborted() {
      if (aborted_.load(std::memory_order_acquire) && value() < aborted_value)
        std::atomic_ref<std::uint64_t>(*host_).store(aborted_value, std::memory_order_release);
    }
    /// The counter's current value, read on the host.
    std::uint64_t value() const { return std::atomic_ref<std::uint64_t>(*host_).load(std::memory_order_acquire); }
    /// The counter's address as devices see it (for cuStreamWriteValue64 / cuStreamWaitValue64).
    CUdeviceptr device_address() const { return device_; }

   private:
    static constexpr std::uint64_t aborted_value = std::uint64_t{1} << 62;
    std::uint64_t* host_ = nullptr;
    CUdeviceptr device_ = 0;
    std::atomic<bool> aborted_{false};
  };
  /// Sets `c` to `v` on `stream`, after the stream's earlier work (cuStreamWriteValue64).
  void signal(int stream, Counter& c, std::uint64_t v) {
    if (failed()) return;
    select();
    fence();
    PIPEOFFLOAD_CUDA_CHECK(cuda_detail::stream_mem_ops().write(reinterpret_cast<CUstream>(at(stream)),
                                                               c.device_address(), v, CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  /// Makes `stream` wait until `c` is at least `v` (cuStreamWaitValue64, GEQ).
  void wait_counter(int stream, const Counter& c, std::uint64_t v) {
    if (failed()) return;
    select();
    fence();
    PIPEOFFLOAD_CUDA_CHECK(cuda_detail::stream_mem_ops().wait(reinterpret_cast<CUstream>(at(stream)),
                                                              c.device_address(), v, CU_STREAM_WAIT_VALUE_GEQ));
  }

  // ---- CUDA specifics ------------------------------------------------------------------

  /// The CUDA stream with id `s` (make_stream's id), ordered after the enqueued operations.
  cudaStream_t stream(int s) {
    select();
    fence();
    return at(s);
  }
  /// The SDPA graphs of this device's cuDNN handle (a layer builds its shapes' graphs at
  /// construction through it, so that no step builds one: attention::workspace_bytes).
  cuda::attention::Graphs& attention_graphs() { return *attention_; }
  /// The CUDA event with id `e` (make_event's id).
  cudaEvent_t event(int e) { return ev(e); }
  /// The CUDA device ordinal this backend runs on.
  int device() const { return opt_.device; }
  /// The options in force (arena_bytes filled in when it was 0).
  const Options& options() const { return opt_; }
  /// Bytes of the slab handed out so far (the arena's high-water mark, which never goes down).
  std::size_t arena_used() const { return static_cast<std::size_t>(top_); }

 private:
  static constexpr std::size_t alignment = cuda::pool_alignment;
  static std::size_t round_up(std::size_t n) { return cuda::pool_size_class(n); }
  /// The norm's part of the pinned staging (po::cuda_staging_bytes), rounded up to 256 bytes:
  /// the uploads' part after it starts aligned (and so does every staged upload, stage_upload).
  std::size_t norm_staging_bytes() const { return cuda_staging_bytes(opt_.max_norm_groups, 0); }
  /// Throws when one call's `groups` exceed Options::max_norm_groups (its staging's size).
  void check_norm_groups(const char* who, std::size_t groups) const {
    if (groups > opt_.max_norm_groups)
      throw error(std::string(who) + ": " + std::to_string(groups) + " groups is outside the allowed range [0, " +
                  std::to_string(opt_.max_norm_groups) +
                  "] (Options::max_norm_groups, the size of its pinned staging)");
  }

  struct Poll {
    int id = 0;
    std::function<void()> fn;
  };
  /// A sum_squares result on its way: where it lands in the staging, and where it goes.
  struct PendingSums {
    std::span<double> out;
    std::size_t staging = 0;
  };

  struct StreamInfo {
    std::string name;
    cudaStream_t stream = nullptr;
    cudaEvent_t joined = nullptr;  // recorded for join()
    cudaEvent_t held = nullptr;    // hold()'s point, which join() waits for instead (made on first hold)
    bool holding = false;          // hold() until release()
  };
  /// A freed block and the event its freeing stream recorded (null: freed outside launch(),
  /// where the caller has already synchronised).
  struct Free {
    std::byte* ptr = nullptr;
    cudaEvent_t guard = nullptr;
    int stream = -1;
  };

  void select() const { PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(opt_.device)); }

  void blocking_copy(void* dst, const void* src, std::size_t bytes) {
    require_no_capture("upload/download");
    if (bytes == 0) return;
    select();
    ++host_waits_;
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, aux_));
    finish_aux(false);
  }

  /// Makes every stream wait, on the GPU, for the operations enqueued on aux_ since the last
  /// fence (once: a stream's later work is behind that wait in stream order). Called before
  /// any use of a stream, which join() then orders the next enqueued operation after.
  void fence() {
    streams_used_ = true;
    if (!aux_pending_) return;
    aux_pending_ = false;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(aux_done_, aux_));
    for (const StreamInfo& s : streams_) PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(s.stream, aux_done_, 0));
  }

  /// Makes aux_ wait, on the GPU, for the work enqueued on every stream so far (before an
  /// enqueued operation: backend.hpp's order), once per use of the streams.
  void join() {
    require_no_capture("a between-steps operation");
    if (!streams_used_) return;
    streams_used_ = false;
    for (const StreamInfo& s : streams_) {
      if (s.holding) {  // up to hold()'s point only
        PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(aux_, s.held, 0));
        continue;
      }
      PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(s.joined, s.stream));
      PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(aux_, s.joined, 0));
    }
  }

  /// Waits for aux_ (polling as synchronize() does), then hands sum_squares' results to their
  /// callers and empties the staging. `count`: a wait of its own (host_waits).
  void finish_aux(bool count) {
    if (count) ++host_waits_;
    try {
      if (polls_.empty())
        PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(aux_));
      else
        poll_until_idle(aux_);
    } catch (...) {  // a failed device: the results never come, and nobody may wait for them
      pending_sums_.clear();
      staging_top_ = upload_top_ = 0;
      throw;
    }
    for (const PendingSums& p : pending_sums_)
      std::memcpy(p.out.data(), norm_staging_ + p.staging, p.out.size() * sizeof(double));
    pending_sums_.clear();
    staging_top_ = upload_top_ = 0;
  }

  /// reset_arena's new slab of `bytes` (the old one freed first, so that both never exist at
  /// once); a size the device cannot give keeps the old size and returns the refusal.
  std::string resize_slab(std::size_t bytes) {
    PIPEOFFLOAD_CUDA_CHECK(cudaFree(slab_));
    slab_ = nullptr;
    DeviceMemory m;
    PIPEOFFLOAD_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
    const std::string no = arena_refusal(bytes, opt_.device, opt_.rank, m);
    const std::size_t size = no.empty() ? bytes / alignment * alignment : opt_.arena_bytes;
    void* slab = nullptr;
    if (const cudaError_t e = cudaMalloc(&slab, size); e != cudaSuccess) {
      cudaGetLastError();
      opt_.arena_bytes = 0;  // nothing can be carved any more
      workspace_ = nullptr;
      stats_.device_held = 0;
      const std::string why = "backend::Cuda::reset_arena: cannot take a slab of " + std::to_string(size) +
                              " bytes: " + cudaGetErrorString(e);
      fail(why);
      throw error(why);
    }
    slab_ = static_cast<std::byte*>(slab);
    opt_.arena_bytes = size;
    return no;
  }

  std::byte* carve(std::size_t size) {
    cuda::require_room("backend::Cuda", opt_.arena_bytes, top_, size);
    std::byte* p = slab_ + top_;
    top_ += size;
    stats_.device_held = top_;
    return p;
  }

  /// A new pinned host block. Portable: a pair of GPUs driven from one process may read each
  /// other's bins.
  std::byte* pin(std::size_t size) {
    require_no_capture("host_alloc beyond the reserved pinned blocks (po::Runtime reserves them)");
    void* raw = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaHostAlloc(&raw, size, cudaHostAllocPortable));
    stats_.host_held += size;
    return static_cast<std::byte*>(raw);
  }

  /// Set by a host function enqueued behind a stream's work when the stream reaches it.
  struct Drained {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };

  /// The host function behind poll_until_idle's stream: wakes the waiting thread, then lets
  /// go of its share of the state (the waiter may have left already, on a failure).
  static void CUDART_CB on_drained(void* hold) {
    const std::unique_ptr<std::shared_ptr<Drained>> h(static_cast<std::shared_ptr<Drained>*>(hold));
    {
      std::lock_guard lk((*h)->mu);
      (*h)->done = true;
    }
    (*h)->cv.notify_all();
  }

  /// Waits for `s`, running the wait polls meanwhile: querying and yielding first (a step's
  /// tail is short), then blocking until a host function enqueued behind `s`'s work wakes this
  /// thread, with the polls run at least once a millisecond until then. So the wait ends when
  /// the stream does, never a sleep later. A poll that throws fails the device (its hook aborts
  /// the communicators) and the wait goes on until `s` drains.
  void poll_until_idle(cudaStream_t s) {
    const auto poll = [&] {
      for (const Poll& p : polls_) {
        try {
          p.fn();
        } catch (const std::exception& e) {
          fail(e.what());
        }
      }
    };
    const auto idle = [&] {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaErrorNotReady) {
        cudaGetLastError();  // "not ready" is no error, but it is the thread's last one until cleared
        return false;
      }
      PIPEOFFLOAD_CUDA_CHECK(q);
      return true;
    };
    for (int spins = 0; spins < 1000; ++spins) {
      if (idle()) return;
      poll();
      std::this_thread::yield();
    }
    const auto drained = std::make_shared<Drained>();
    auto hold = std::make_unique<std::shared_ptr<Drained>>(drained);
    PIPEOFFLOAD_CUDA_CHECK(cudaLaunchHostFunc(s, &Cuda::on_drained, hold.get()));
    hold.release();  // on_drained's now
    while (!idle()) {
      poll();
      std::unique_lock lk(drained->mu);
      if (drained->cv.wait_for(lk, std::chrono::milliseconds(1), [&] { return drained->done; })) {
        lk.unlock();
        std::this_thread::yield();  // the host function has run; the stream ends as it returns
      }
    }
  }

  /// The marks' times, once every stream is idle (synchronize); their events back to the pool.
  /// A mark whose time cannot be read (a failed device) keeps the time of its call's anchor.
  void resolve_marks() {
    if (marks_.empty()) return;
    const bool ok = !failed() && cudaEventSynchronize(anchor_) == cudaSuccess;
    for (const Mark& m : marks_) {
      float ms = 0;
      *m.slot =
          ok && cudaEventElapsedTime(&ms, anchor_, m.event) == cudaSuccess ? anchor_host_ + 1e-3 * ms : anchor_host_;
      timing_pool_.push_back(m.event);
    }
    cudaGetLastError();
    marks_.clear();
    anchored_ = false;
  }

  /// Every freed block's guard dropped (its event back to the pool): for when no guard can be
  /// waited on, at the edges of a capture (see begin_capture and end_capture).
  void forget_guards() {
    for (auto* pools : {&free_device_, &free_host_})
      for (auto& [size, list] : *pools)
        for (Free& f : list)
          if (f.guard != nullptr) guard_pool_.push_back(std::exchange(f.guard, nullptr));
  }
  /// Ends a capture that cannot go on (its graph is dropped).
  void end_capture_quietly() {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(at(capturing_), &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    capturing_ = -1;
    cudaGetLastError();
  }
  /// The between-steps operations wait for the device or run on aux_, outside any capture:
  /// refused while one is under way.
  void require_no_capture(const char* who) const {
    if (capturing_ >= 0)
      throw error(std::string("backend::Cuda::") + who +
                  " during a capture: a captured step may only launch work on the device's streams");
  }

  Free guarded(std::byte* p) {
    Free f{p, nullptr, current_};
    if (current_ < 0) return f;
    if (guard_pool_.empty()) {
      cudaEvent_t e = nullptr;
      PIPEOFFLOAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      guard_pool_.push_back(e);
    }
    f.guard = guard_pool_.back();
    guard_pool_.pop_back();
    PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(f.guard, at(current_)));
    return f;
  }

  /// Orders the current stream after the block's last use on another stream (same stream:
  /// stream order already does), then recycles the event (a wait captures the record at
  /// call time, so re-recording it later is safe).
  void release_guard(const Free& f) {
    if (f.guard == nullptr) return;
    if (current_ >= 0 && current_ != f.stream) PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(at(current_), f.guard, 0));
    // Outside launch() the caller has synchronised, so the block is idle.
    guard_pool_.push_back(f.guard);
  }

  /// The most recently freed block of a size class, once its guard lets this stream reuse it;
  /// nullptr when the class has none.
  std::byte* take_free(std::vector<Free>& list) {
    if (list.empty()) return nullptr;
    const Free f = list.back();
    list.pop_back();
    release_guard(f);
    return f.ptr;
  }

  int current_or_throw(const char* what) const {
    if (current_ < 0)
      throw error(std::string("backend::Cuda: ") + what + " must be called from work passed to launch(stream, fn)");
    return current_;
  }

  cudaStream_t at(int s) const {
    if (s < 0 || s >= static_cast<int>(streams_.size()))
      throw error("backend::Cuda: stream " + std::to_string(s) + " does not exist; streams are 0.." +
                  std::to_string(streams_.size()) + " (exclusive)");
    return streams_[static_cast<std::size_t>(s)].stream;
  }
  cudaEvent_t ev(int e) const {
    if (e < 0 || e >= static_cast<int>(events_.size()))
      throw error("backend::Cuda: event " + std::to_string(e) + " does not exist; events are 0.." +
                  std::to_string(events_.size()) + " (exclusive)");
    return events_[static_cast<std::size_t>(e)];
  }

  friend class detail::Failure<Cuda>;
  void on_failure() {}  // no thread sleeps on its state: its calls check failed() themselves

  Options opt_;
  std::vector<StreamInfo> streams_;
  std::vector<cudaEvent_t> events_;
  int current_ = -1;

  std::byte* slab_ = nullptr;  // (arena_bytes) device, owned; blocks are carved from its front
  std::size_t top_ = 0;
  std::byte* workspace_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  cudnnHandle_t dnn_ = nullptr;
  std::unique_ptr<cuda::attention::Graphs> attention_;  // SDPA graphs of dnn_ (destroyed before it)
  std::unique_ptr<cuda::GemmPlans> gemms_;              // cuBLASLt plans of lt_ (destroyed before it)
  cudaStream_t aux_ = nullptr;                          // between-steps operations
  Block norms_{};                                       // sum_squares' table, partials and sums (see there)
  std::vector<long long> norm_table_;                   // the table norms_ holds now
  std::byte* norm_staging_ = nullptr;                   // pinned, see the constructor
  std::size_t staging_top_ = 0;                         // staging bytes the pending sum_squares calls use
  std::byte* upload_staging_ = nullptr;                 // upload()'s (after norm_staging_'s, in its allocation)
  std::size_t upload_top_ = 0;                          // of it, bytes the uploads since the last wait use
  std::vector<PendingSums> pending_sums_;               // results to hand over at the next wait
  cudaEvent_t aux_done_ = nullptr;                      // aux_'s fence (see fence())
  cudaEvent_t fork_ = nullptr;                          // a capture's and a replay's fork (begin_capture, replay)
  struct Mark {
    cudaEvent_t event = nullptr;
    double* slot = nullptr;
  };
  cudaStream_t clock_ = nullptr;          // idle but for the marks' anchor
  cudaEvent_t anchor_ = nullptr;          // (timing) recorded on clock_ at anchor_host_
  double anchor_host_ = 0;                // now() when anchor_ was recorded
  bool anchored_ = false;                 // anchor_ recorded since the last synchronize
  std::vector<Mark> marks_;               // marks to convert at the next synchronize
  std::vector<cudaEvent_t> timing_pool_;  // timing events for marks
  int capturing_ = -1;                    // the origin stream of the capture under way
  bool aux_pending_ = false;              // work enqueued on aux_ since the last fence
  bool streams_used_ = false;             // a stream used since the last join()
  long long host_waits_ = 0;              // see host_waits()
  std::vector<Poll> polls_;               // wait polls (add_wait_poll), this thread's
  int next_poll_ = 0;
  cuda::PoolBook device_book_, host_book_;  // blocks and reservations per size class
  std::map<std::size_t, std::vector<Free>> free_device_, free_host_;
  std::vector<std::byte*> host_in_use_;  // pinned bins handed out, freed at destruction if never returned
  std::vector<cudaEvent_t> guard_pool_;
  MemoryStats stats_;
};

static_assert(backend<Cuda>, "backend::Cuda must model the backend concept.");
static_assert(updates_parameters<Cuda>, "backend::Cuda must run the optimizers' updates on the device.");
static_assert(reserves_memory<Cuda>, "backend::Cuda must reserve the runtime's blocks when it is constructed.");
static_assert(captures_graphs<Cuda>, "backend::Cuda must capture and replay a step (CUDA graphs).");
static_assert(marks_times<Cuda>, "backend::Cuda must time where its streams are (timing events).");
static_assert(waits_in_pass<Cuda>, "backend::Cuda must let a pass wait for a part of a reload.");
static_assert(resets_arena<Cuda>, "backend::Cuda must start its arena over between runtimes.");

/// The sysfs PCI path of CUDA device `device` (for cuda::pair_devices).
inline std::string pci_path(int device) {
  char bus[32] = {};
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  std::string id(bus);
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // CUDA prints an 8-digit domain ("00000000:3b:00.0"); sysfs uses 4 ("0000:3b:00.0").
  if (id.size() > 12 && id.find(':') == 8) id = id.substr(4);
  const std::string link = "/sys/bus/pci/devices/" + id;
  char resolved[PATH_MAX] = {};
  if (::realpath(link.c_str(), resolved) == nullptr) return "";  // no sysfs (a container): unknown, so unpaired
  return resolved;
}

/// PCIe pairing of every visible GPU (cuda::pair_devices over their PCI paths).
inline cuda::Pairing device_pairing() {
  int n = 0;
  PIPEOFFLOAD_CUDA_CHECK(cudaGetDeviceCount(&n));
  std::vector<std::string> paths;
  for (int i = 0; i < n; ++i) paths.push_back(pci_path(i));
  return cuda::pair_devices(paths);
}

/// Device `device`'s free and total bytes now (cudaMemGetInfo; the calling thread's current
/// device is kept), for a launcher that checks a run's needs before constructing anything.
inline DeviceMemory device_memory(int device) {
  int was = 0;
  PIPEOFFLOAD_CUDA_CHECK(cudaGetDevice(&was));
  PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
  DeviceMemory m;
  const cudaError_t e = cudaMemGetInfo(&m.free, &m.total);
  cudaSetDevice(was);
  PIPEOFFLOAD_CUDA_CHECK(e);
  return m;
}

/// Number of CUDA devices, 0 when there is no GPU or no driver (never throws: tests use it to
/// decide to SKIP).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();
  return n;
}

/// Why CUDA finds no device although a driver is installed (one older than this toolkit needs,
/// a broken installation): cudaGetDeviceCount's error, in words. Empty where it finds devices,
/// or none for want of a GPU or of any driver (libcuda.so.1 not there): only then may a test
/// SKIP, never when the GPU is there and unusable.
inline std::string device_count_problem() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e == cudaSuccess || e == cudaErrorNoDevice) return "";
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) return "";
  dlclose(driver);
  return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         "), with a CUDA driver installed: this build's CUDA runtime " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10) + " needs a driver at least as new";
}

}  // namespace pipeoffload::backend
