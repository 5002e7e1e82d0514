// pipeoffload/comm/nccl/nccl.hpp: comm::Nccl, the communicator of GPU ranks: the communicator
// concepts' contract (docs/schedules.md, "Communicator semantics") over NCCL, non-blocking,
// with tags checked from a device log and an abort shared by a job's groups. How each call
// maps to NCCL, and the bootstrap (NcclWorld): docs/processes_and_gpus.md, "comm::Nccl".
/// @file
#pragma once

#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../../backend/cuda/cuda.hpp"
#include "../communicator.hpp"
#include "gather_pieces.hpp"
#include "id_file.hpp"

namespace pipeoffload::comm {

static_assert(sizeof(ncclUniqueId) == nccl_id_bytes,
              "comm::Nccl: NCCL's unique id is not the 128 bytes id_file.hpp transports.");

namespace detail {

inline std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof h - 1) != 0) return "?";
  return h;
}

}  // namespace detail

/// Throws cuda_error unless `status` is ncclSuccess: the call, NCCL's message, rank, host and
/// ncclGetLastError (comm may be null before a communicator exists).
inline void nccl_check(ncclResult_t status, const char* call, int rank, ncclComm_t comm = nullptr,
                       std::source_location loc = std::source_location::current()) {
  if (status == ncclSuccess) return;
  cudaGetLastError();  // NCCL's CUDA failures must not resurface in the next CUDA check
  const char* last = ncclGetLastError(comm);
  throw cuda_error(std::string("NCCL error ") + ncclGetErrorString(status) + " in " + call + " on rank " +
                   std::to_string(rank) + " (host " + detail::host_name() + ") at " + cuda::detail::where(loc) +
                   (last && *last ? std::string(": ") + last : std::string()));
}

/// Checks an NCCL call made on behalf of rank `rank_of_call` with communicator `handle`.
#define PIPEOFFLOAD_NCCL_CHECK(call, rank_of_call, handle)                    \
  do {                                                                        \
    ::pipeoffload::comm::nccl_check((call), #call, (rank_of_call), (handle)); \
  } while (0)

/// NCCL calls that end in ncclInProgress on a non-blocking communicator are posted, not failed.
inline void nccl_posted(ncclResult_t status, const char* call, int rank, ncclComm_t comm = nullptr,
                        std::source_location loc = std::source_location::current()) {
  nccl_check(status == ncclInProgress ? ncclSuccess : status, call, rank, comm, loc);
}

/// Posts an NCCL call on a non-blocking communicator (checked; ncclInProgress is not an error).
#define PIPEOFFLOAD_NCCL_POST(call, rank_of_call, handle)                      \
  do {                                                                         \
    ::pipeoffload::comm::nccl_posted((call), #call, (rank_of_call), (handle)); \
  } while (0)

namespace detail {

/// The abort shared by an NcclWorld and every world split from it: a host flag and its first
/// reason, and the host barrier of a world whose ranks are threads of this process.
struct NcclAbort {
  std::mutex mu;
  std::condition_variable cv;  // host_barrier's waiters: woken by the last arrival or by abort
  std::atomic<bool> aborted{false};
  std::string reason;  // written once, under mu, before `aborted` is set
};

/// Polls `comm` (non-blocking) until its last call has completed: returns its state then
/// (ncclSuccess or an error), or ncclInProgress as soon as `stop()` is true. Spins first (most
/// calls complete at once), then sleeps 50 us at a time.
template <class Stop>
ncclResult_t settle(ncclComm_t comm, Stop stop) {
  for (long spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (stop()) return ncclInProgress;
    if (spins < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// The configuration of every communicator made here: non-blocking (see the file comment).
inline ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

}  // namespace detail

/// The communicators of the ranks this process drives, and their abort state (shared with the
/// worlds split from it). Each communicator is used by one thread, its rank's: that thread
/// calls split, drives the comm::Nccl made on it, and aborts it (release) when the shared flag
/// is set. The world frees what is left when it is destroyed.
class NcclWorld {
 public:
  /// One process, one rank per listed device (rank r on devices[r]), each communicator
  /// initialised non-blocking in one NCCL group (ncclCommInitAll's job, with a configuration).
  static std::shared_ptr<NcclWorld> all_local(std::span<const int> devices) {
    auto w = std::shared_ptr<NcclWorld>(new NcclWorld(std::make_shared<detail::NcclAbort>()));
    const int n = static_cast<int>(devices.size());
    w->size_ = n;
    w->comms_.assign(devices.size(), nullptr);
    w->released_.assign(devices.size(), false);
    w->ranks_.resize(devices.size());
    for (int i = 0; i < n; ++i) w->ranks_[static_cast<std::size_t>(i)] = i;
    const NcclIdBytes bytes = new_id(0);
    ncclUniqueId id{};
    std::memcpy(&id, bytes.data(), sizeof id);
    ncclConfig_t config = detail::nonblocking_config();
    w->fail_on_throw([&] {
      PIPEOFFLOAD_NCCL_POST(ncclGroupStart(), 0, nullptr);
      for (int i = 0; i < n; ++i) {
        PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(devices[static_cast<std::size_t>(i)]));
        PIPEOFFLOAD_NCCL_POST(ncclCommInitRankConfig(&w->comms_[static_cast<std::size_t>(i)], n, id, i, &config), i,
                              nullptr);
      }
      PIPEOFFLOAD_NCCL_POST(ncclGroupEnd(), 0, nullptr);
      for (int i = 0; i < n; ++i) w->settle_or_throw(static_cast<std::size_t>(i), i, "ncclCommInitRankConfig");
    });
    return w;
  }

  /// A fresh NCCL unique id, for rank 0 to hand to the others (over MPI with
  /// comm/mpi/nccl_id.hpp's broadcast_nccl_id, or through a file with from_file).
  static NcclIdBytes new_id(int rank = 0) {
    ncclUniqueId id{};
    PIPEOFFLOAD_NCCL_CHECK(ncclGetUniqueId(&id), rank, nullptr);
    NcclIdBytes bytes{};
    std::memcpy(bytes.data(), &id, sizeof id);
    return bytes;
  }

  /// One process per GPU, the unique id already shared by every rank (e.g. broadcast over MPI:
  /// `from_id(broadcast_nccl_id(mpi, rank == 0 ? NcclWorld::new_id() : NcclIdBytes{}), ...)`).
  static std::shared_ptr<NcclWorld> from_id(const NcclIdBytes& bytes, int rank, int size, int device) {
    auto w = std::shared_ptr<NcclWorld>(new NcclWorld(std::make_shared<detail::NcclAbort>()));
    w->size_ = size;
    w->ranks_ = {rank};
    w->comms_.assign(1, nullptr);
    w->released_.assign(1, false);
    ncclUniqueId id{};
    std::memcpy(&id, bytes.data(), sizeof id);
    ncclConfig_t config = detail::nonblocking_config();
    w->fail_on_throw([&] {
      PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
      PIPEOFFLOAD_NCCL_POST(ncclCommInitRankConfig(&w->comms_[0], size, id, rank, &config), rank, nullptr);
      w->settle_or_throw(0, rank, "ncclCommInitRankConfig");
    });
    return w;
  }

  /// One process per GPU: rank 0 creates the unique id and publishes it at `path` (a shared
  /// file system), the others wait up to `timeout` for it. `generation` tells this job's file
  /// from a stale one (use the job id).
  static std::shared_ptr<NcclWorld> from_file(const std::string& path, std::uint64_t generation, int rank, int size,
                                              int device, std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
    NcclIdBytes bytes{};
    if (rank == 0) {
      bytes = new_id(rank);
      publish_id(path, bytes, generation);
    } else {
      bytes = await_id(path, generation, timeout);
    }
    return from_id(bytes, rank, size, device);
  }

  NcclWorld(const NcclWorld&) = delete;
  NcclWorld& operator=(const NcclWorld&) = delete;
  /// Frees the communicators their ranks have not aborted: after an abort with ncclCommAbort
  /// (which waits for no peer); otherwise ncclCommFinalize on all of them first (non-blocking,
  /// so one thread can finalize several ranks' communicators, each waiting for its peers),
  /// then ncclCommDestroy. Errors are not thrown from here.
  ~NcclWorld() {
    std::vector<ncclComm_t> live;
    {
      std::lock_guard lk(mu_);
      for (std::size_t i = 0; i < comms_.size(); ++i)
        if (comms_[i] != nullptr && !released_[i]) live.push_back(comms_[i]);
    }
    const auto stop = [&] { return aborted(); };
    if (!aborted()) {
      for (ncclComm_t c : live) ncclCommFinalize(c);
      for (ncclComm_t c : live) detail::settle(c, stop);
    }
    for (ncclComm_t c : live) aborted() ? ncclCommAbort(c) : ncclCommDestroy(c);
    cudaGetLastError();
  }

  /// Ranks in the world.
  int size() const { return size_; }
  /// The communicator of `rank`, which this process must drive.
  ncclComm_t comm(int rank) const { return comms_[index(rank)]; }

  /// Collective over this world (ncclCommSplit, NCCL >= 2.18): every rank of the world calls
  /// it once; the ranks that pass the same `color` (>= 0) form one group, ordered by `key`
  /// (ties by rank). Returns the world of this process's rank `rank` in its group: it drives
  /// that one rank (Nccl(world, world->rank(), dev)). In a world that drives several ranks
  /// (all_local), each rank's thread calls it at the same time. The new world shares this
  /// one's abort (and inherits its non-blocking configuration).
  /// @code
  ///   auto job = po::comm::NcclWorld::from_id(id, g, dp * d, device);   // g = replica * d + rank
  ///   auto pipe = job->split(g / d, g % d);   // the d ranks of replica g / d
  ///   auto reps = job->split(g % d, g / d);   // the dp ranks of pipeline rank g % d
  ///   po::comm::Nccl pipeline(pipe, pipe->rank(), dev), replicas(reps, reps->rank(), dev);
  /// @endcode
  std::shared_ptr<NcclWorld> split(int rank, int color, int key) {
    if (color < 0)
      throw comm_error("comm::NcclWorld::split: color = " + std::to_string(color) +
                       " is outside the allowed range [0, " + std::to_string(INT_MAX) + "]");
    const ncclComm_t parent = comm(rank);
    check_live(rank);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    int device = 0;
    PIPEOFFLOAD_NCCL_CHECK(ncclCommCuDevice(parent, &device), rank, parent);
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
    auto w = std::shared_ptr<NcclWorld>(new NcclWorld(abort_));
    w->comms_ = {nullptr};
    w->released_ = {false};
    w->ranks_ = {0};
    PIPEOFFLOAD_NCCL_POST(ncclCommSplit(parent, color, key, &w->comms_[0], nullptr), rank, parent);
    settle_or_throw(index(rank), rank, "ncclCommSplit");
    w->fail_on_throw([&] {
      w->settle_or_throw(0, rank, "ncclCommSplit (the new communicator)");
      PIPEOFFLOAD_NCCL_CHECK(ncclCommCount(w->comms_[0], &w->size_), rank, w->comms_[0]);
      int child_rank = 0;
      PIPEOFFLOAD_NCCL_CHECK(ncclCommUserRank(w->comms_[0], &child_rank), rank, w->comms_[0]);
      w->ranks_[0] = child_rank;
    });
    return w;
#else
    (void)parent;
    (void)key;
    throw comm_error("comm::NcclWorld::split needs NCCL >= 2.18 (ncclCommSplit); this build has NCCL " +
                     std::to_string(NCCL_VERSION_CODE));
#endif
  }
  /// split(rank, color, key) for a world that drives one rank (from_id, from_file).
  std::shared_ptr<NcclWorld> split(int color, int key) {
    if (ranks_.size() != 1)
      throw comm_error("comm::NcclWorld::split: this process drives " + std::to_string(ranks_.size()) +
                       " ranks of the world; name the one that splits (split(rank, color, key))");
    return split(ranks_[0], color, key);
  }
  /// The rank this process drives, in a world that drives one (a split's, from_id's).
  int rank() const {
    if (ranks_.size() != 1)
      throw comm_error("comm::NcclWorld::rank: this process drives " + std::to_string(ranks_.size()) +
                       " ranks of the world, not one");
    return ranks_[0];
  }

  /// Sets the abort shared by this world and every world split from it or from which it was
  /// split (first reason wins), and wakes host_barrier's waiters. Any thread may call it; no
  /// NCCL call is made here: each rank's thread aborts its own communicator (release) when it
  /// next calls or waits on it.
  void abort(const std::string& why) {
    {
      std::lock_guard lk(abort_->mu);
      if (abort_->aborted.load()) return;
      abort_->reason = why;
      abort_->aborted.store(true);
    }
    abort_->cv.notify_all();
  }
  /// Has the world been aborted?
  bool aborted() const { return abort_->aborted.load(); }
  /// Throws aborted_error naming the abort's reason.
  [[noreturn]] void throw_aborted() const {
    std::lock_guard lk(abort_->mu);
    throw aborted_error("aborted: " + abort_->reason);
  }

  /// Aborts rank `rank`'s communicator (ncclCommAbort), once; called by that rank's thread
  /// only (NCCL's one-thread rule), when it sees the abort or an NCCL error.
  void release(int rank) { release_at(index(rank)); }
  /// If the world was aborted: aborts rank `rank`'s communicator and throws aborted_error.
  void check_live(int rank) {
    if (!aborted()) return;
    release(rank);
    throw_aborted();
  }

  /// Waits until every rank this process drives has called it (a host barrier of the threads
  /// of an all_local world; nothing to wait for in a world of one rank per process). Call it
  /// after each rank has made every allocation of its run (its backend::Cuda, comm::Nccl,
  /// layers, po::Runtime and optimizer) and before its first NCCL kernel: a cudaMalloc,
  /// cudaHostAlloc or module load in one thread while another thread's NCCL kernel spins,
  /// waiting for the first, can wait on that kernel for ever. Throws aborted_error if the
  /// world is aborted meanwhile (a rank that failed never arrives).
  void host_barrier() {
    if (ranks_.size() <= 1) return;
    std::unique_lock lk(abort_->mu);
    if (abort_->aborted.load()) throw aborted_error("aborted: " + abort_->reason);
    const std::uint64_t generation = barrier_generation_;
    if (++barrier_arrived_ == ranks_.size()) {
      barrier_arrived_ = 0;
      ++barrier_generation_;
      abort_->cv.notify_all();
      return;
    }
    abort_->cv.wait(lk, [&] { return barrier_generation_ != generation || abort_->aborted.load(); });
    if (barrier_generation_ == generation) throw aborted_error("aborted: " + abort_->reason);
  }

 private:
  explicit NcclWorld(std::shared_ptr<detail::NcclAbort> shared) : abort_(std::move(shared)) {}

  std::size_t index(int rank) const {
    for (std::size_t i = 0; i < ranks_.size(); ++i)
      if (ranks_[i] == rank) return i;
    throw comm_error("comm::NcclWorld: rank " + std::to_string(rank) + " is not driven by this process");
  }

  /// Waits, on the calling thread (the one of rank `rank`, whose messages name it), until
  /// communicator i has completed its last call; an NCCL error or the shared abort aborts it
  /// and throws.
  void settle_or_throw(std::size_t i, int rank, const char* what) {
    const ncclResult_t state = detail::settle(comms_[i], [&] { return aborted(); });
    if (state == ncclSuccess) return;
    std::string why = "aborted while waiting for " + std::string(what);
    if (state != ncclInProgress) {
      why = std::string("NCCL error ") + ncclGetErrorString(state) + " in " + what + " on rank " +
            std::to_string(rank) + " (host " + detail::host_name() + ")";
      abort(why);
    }
    release_at(i);
    if (state == ncclInProgress) throw_aborted();
    throw cuda_error(why);
  }
  void release_at(std::size_t i) {
    {
      std::lock_guard lk(mu_);
      if (released_[i] || comms_[i] == nullptr) return;
      released_[i] = true;
    }
    ncclCommAbort(comms_[i]);  // best effort: nothing to report to while failing
    cudaGetLastError();
  }

  /// Runs fn; if it throws, aborts this world's communicators (which may be half made) so that
  /// the destructor frees them without waiting for peers, and throws on.
  template <class F>
  void fail_on_throw(F&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      abort(e.what());
      throw;
    }
  }

  int size_ = 0;
  std::vector<ncclComm_t> comms_;
  std::vector<int> ranks_;
  std::shared_ptr<detail::NcclAbort> abort_;
  mutable std::mutex mu_;                 // released_
  std::vector<bool> released_;            // per communicator: aborted by its rank's thread
  std::size_t barrier_arrived_ = 0;       // host_barrier, under abort_->mu
  std::uint64_t barrier_generation_ = 0;  // likewise
};

/// One rank's communicator on one backend::Cuda device, driven by one thread (the rank's: it
/// posts the calls and runs dev.synchronize(), whose waits poll this communicator).
class Nccl {
 public:
  /// Sizes of the communicator's staging buffers.
  struct Options {
    std::size_t max_messages_per_step = 1 << 16;  ///< tag headers kept between two all_gathers
    /// The host all_gather's staging, device and pinned host (twice), allocated here: a gather
    /// of more than gather_bytes runs in pieces. At least size() bytes.
    std::size_t gather_bytes = std::size_t{4} << 20;
  };

  /// Rank `rank` of `world` on `dev`, with default Options.
  Nccl(std::shared_ptr<NcclWorld> world, int rank, backend::Cuda& dev) : Nccl(std::move(world), rank, dev, Options{}) {}
  /// Rank `rank` of `world` on `dev`: allocates the staging buffers (device and pinned host) and
  /// registers a wait poll on `dev`; throws comm_error when gather_bytes < size().
  Nccl(std::shared_ptr<NcclWorld> world, int rank, backend::Cuda& dev, Options opt)
      : w_(std::move(world)), rank_(rank), dev_(&dev), opt_(opt) {
    comm_ = w_->comm(rank);
    const std::size_t d = static_cast<std::size_t>(size());
    if (opt_.gather_bytes < d)
      throw comm_error("comm::Nccl: Options::gather_bytes = " + std::to_string(opt_.gather_bytes) +
                       " is outside the allowed range [" + std::to_string(d) + ", ...]: every rank needs a byte");
    piece_ = opt_.gather_bytes / d;
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(dev.device()));
    const std::size_t n = opt_.max_messages_per_step;
    // (max_messages_per_step) Header, pinned host: headers of sends, written by the host when
    // a send is posted and read by the copy that stages them to the device; and received
    // headers, copied back for verify_tags.
    send_host_ = static_cast<Header*>(pinned(n * sizeof(Header)));
    recv_host_ = static_cast<Header*>(pinned(n * sizeof(Header)));
    // (max_messages_per_step) Header, device: staged send headers, and received headers.
    send_dev_ = static_cast<Header*>(device(n * sizeof(Header)));
    recv_dev_ = static_cast<Header*>(device(n * sizeof(Header)));
    // (size() * piece_ bytes) device and pinned host: the host all_gather's pieces.
    gather_dev_ = static_cast<std::byte*>(device(d * piece_));
    gather_in_ = static_cast<std::byte*>(pinned(piece_));
    gather_out_ = static_cast<std::byte*>(pinned(d * piece_));
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreateWithFlags(&gather_stream_, cudaStreamNonBlocking));
    poll_id_ = dev.add_wait_poll([this] { poll(); });
  }
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  ~Nccl() {
    dev_->remove_wait_poll(poll_id_);
    if (w_->aborted()) w_->release(rank_);  // this rank's thread: its communicator's last user
    cudaSetDevice(dev_->device());
    if (gather_stream_) {
      cudaStreamSynchronize(gather_stream_);
      cudaStreamDestroy(gather_stream_);
    }
    for (void* p : {static_cast<void*>(gather_dev_), static_cast<void*>(recv_dev_), static_cast<void*>(send_dev_)})
      if (p) cudaFree(p);
    for (void* p : {static_cast<void*>(gather_out_), static_cast<void*>(gather_in_), static_cast<void*>(recv_host_),
                    static_cast<void*>(send_host_)})
      if (p) cudaFreeHost(p);
    cudaGetLastError();
  }

  /// This communicator's rank.
  int rank() const { return rank_; }
  /// Ranks in the world.
  int size() const { return w_->size(); }

  /// Enqueues `data` (device memory, any element type) to `peer` on ctx's stream.
  void send(const backend::CudaContext& ctx, int peer, Tag tag, std::span<const std::byte> data) {
    check_peer(peer, "send to");
    const cudaStream_t s = stream(ctx);
    const std::size_t i = next_slot(sent_, "send");
    send_host_[i] = header(tag, data.size());
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(send_dev_ + i, send_host_ + i, sizeof(Header), cudaMemcpyHostToDevice, s));
    PIPEOFFLOAD_NCCL_POST(ncclGroupStart(), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclSend(send_dev_ + i, sizeof(Header), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclSend(data.data(), data.size(), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclGroupEnd(), rank_, comm_);
    settle("send");
  }

  /// Enqueues the receive of `out.size()` bytes from `peer` into `out` (device memory) on
  /// ctx's stream; its tag and size are checked at the next all_gather (see the file comment).
  void recv(const backend::CudaContext& ctx, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    const cudaStream_t s = stream(ctx);
    const std::size_t i = next_slot(received_, "recv");
    expected_.push_back({peer, header(tag, out.size())});
    PIPEOFFLOAD_NCCL_POST(ncclGroupStart(), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclRecv(recv_dev_ + i, sizeof(Header), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclRecv(out.data(), out.size(), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_POST(ncclGroupEnd(), rank_, comm_);
    settle("recv");
  }

  /// Verifies the tags received since the last call, then gathers `mine` (host memory, values
  /// of any trivially copyable T) from every rank into `all` (host memory), in pieces of at
  /// most Options::gather_bytes / size() bytes per rank through the staging made at
  /// construction; the wait polls the abort flag and NCCL's errors.
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "comm::Nccl::all_gather: T must be trivially copyable; values travel as bytes.");
    w_->check_live(rank_);
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size());
    if (all.size() != n * d)
      throw comm_error("comm::Nccl::all_gather: the output holds " + std::to_string(all.size()) +
                       " values; it must hold size() * mine.size() = " + std::to_string(n * d));
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(dev_->device()));
    verify_tags();
    const std::size_t block = n * sizeof(T);  // bytes per rank
    const auto* in = reinterpret_cast<const std::byte*>(mine.data());
    auto* out = reinterpret_cast<std::byte*>(all.data());
    for (const GatherPiece& p : gather_pieces(block, piece_)) {
      std::memcpy(gather_in_, in + p.offset, p.bytes);
      std::byte* slot = gather_dev_ + static_cast<std::size_t>(rank_) * p.bytes;
      PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(slot, gather_in_, p.bytes, cudaMemcpyHostToDevice, gather_stream_));
      PIPEOFFLOAD_NCCL_POST(ncclAllGather(slot, gather_dev_, p.bytes, ncclUint8, comm_, gather_stream_), rank_, comm_);
      settle("all_gather");
      PIPEOFFLOAD_CUDA_CHECK(
          cudaMemcpyAsync(gather_out_, gather_dev_, d * p.bytes, cudaMemcpyDeviceToHost, gather_stream_));
      wait_gather();
      for (std::size_t q = 0; q < d; ++q) std::memcpy(out + q * block + p.offset, gather_out_ + q * p.bytes, p.bytes);
    }
  }

  /// Enqueues an all_to_all of bytes in device memory on ctx's stream and returns at once:
  /// block i of `in` goes to rank i, block j of `out` comes from rank j (block = in.size() /
  /// size(); block rank() is copied on the stream). One NCCL group of a send and a receive per
  /// peer. `in` and `out` must not overlap; every rank must pass the same size (NCCL cannot
  /// compare them).
  void all_to_all(const backend::CudaContext& ctx, std::span<const std::byte> in, std::span<std::byte> out) {
    const cudaStream_t s = stream(ctx);
    const std::size_t n = in.size(), d = static_cast<std::size_t>(size());
    if (out.size() != n)
      throw comm_error("comm::Nccl::all_to_all: out holds " + std::to_string(out.size()) +
                       " bytes; it must hold as many as in (" + std::to_string(n) + ")");
    if (n % d != 0)
      throw comm_error("comm::Nccl::all_to_all: in holds " + std::to_string(n) +
                       " bytes; it must hold size() * block bytes, a multiple of size() = " + std::to_string(d));
    const std::size_t block = n / d, me = static_cast<std::size_t>(rank_);
    if (block == 0) return;
    PIPEOFFLOAD_NCCL_POST(ncclGroupStart(), rank_, comm_);
    for (int p = 0; p < size(); ++p) {
      if (p == rank_) continue;
      const std::size_t at = static_cast<std::size_t>(p) * block;
      PIPEOFFLOAD_NCCL_POST(ncclSend(in.data() + at, block, ncclUint8, p, comm_, s), rank_, comm_);
      PIPEOFFLOAD_NCCL_POST(ncclRecv(out.data() + at, block, ncclUint8, p, comm_, s), rank_, comm_);
    }
    PIPEOFFLOAD_NCCL_POST(ncclGroupEnd(), rank_, comm_);
    settle("all_to_all");
    PIPEOFFLOAD_CUDA_CHECK(
        cudaMemcpyAsync(out.data() + me * block, in.data() + me * block, block, cudaMemcpyDeviceToDevice, s));
    traffic_.all_to_all(n, size());
  }

  /// Enqueues ncclAllGather of `mine` (bytes in device memory) into `all` (size() blocks, in
  /// rank order) on ctx's stream and returns at once: no host sync, no staging. Every rank
  /// must pass the same size (NCCL cannot compare them).
  void all_gather(const backend::CudaContext& ctx, std::span<const std::byte> mine, std::span<std::byte> all) {
    const cudaStream_t s = stream(ctx);
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size());
    if (all.size() != n * d)
      throw comm_error("comm::Nccl::all_gather: the output holds " + std::to_string(all.size()) +
                       " bytes; it must hold size() * mine.size() = " + std::to_string(n * d));
    if (n == 0) return;
    PIPEOFFLOAD_NCCL_POST(ncclAllGather(mine.data(), all.data(), n, ncclUint8, comm_, s), rank_, comm_);
    settle("all_gather");
    traffic_.all_gather(n, size());
  }

  /// Bytes this rank enqueued to send in its device collectives since construction or
  /// reset_traffic() (comm/communicator.hpp's Traffic), counted on the host as they are posted.
  Traffic traffic() const { return traffic_.load(); }
  /// Starts the count again from zero (between steps, with no collective being posted).
  void reset_traffic() { traffic_.reset(); }

  /// Sets the abort shared by this rank's groups (NcclWorld::abort): every rank's thread, this
  /// one's included, aborts its own communicator at its next call or wait, which throws
  /// aborted_error. Any thread may call it.
  void abort(const std::string& why) { w_->abort(why); }

  /// The wait poll backend::Cuda::synchronize runs on this rank's thread while its streams
  /// are busy: after an abort, or an error NCCL reports, aborts this rank's communicator
  /// (which ends the NCCL kernels the streams wait for) and throws.
  void poll() {
    w_->check_live(rank_);
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state == ncclSuccess || state == ncclInProgress) return;
    fail(state, "a pending operation");
  }

 private:
  /// A message's tag and size as it travels ahead of the data (24 bytes, no padding: every
  /// byte is defined, so received headers compare with ==). 64-bit bytes: a boundary of
  /// 2 GiB or more is a valid message.
  struct Header {
    std::int32_t stage = 0, mb = 0, dir = 0, reserved = 0;
    std::int64_t bytes = 0;
    friend bool operator==(const Header&, const Header&) = default;
  };
  static_assert(sizeof(Header) == 24, "comm::Nccl: the tag header must be 24 bytes without padding.");
  struct Expected {
    int peer = 0;
    Header h;
  };

  static Header header(Tag t, std::size_t bytes) {
    return {t.stage, t.mb, t.dir == Dir::forward ? 0 : 1, 0, static_cast<std::int64_t>(bytes)};
  }
  static std::string describe_header(const Header& h) {
    return describe(Tag{h.stage, h.mb, h.dir == 0 ? Dir::forward : Dir::backward}) + " of " + std::to_string(h.bytes) +
           " bytes";
  }

  static void* pinned(std::size_t bytes) {
    void* p = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaHostAlloc(&p, std::max<std::size_t>(bytes, 1), cudaHostAllocPortable));
    return p;
  }
  static void* device(std::size_t bytes) {
    void* p = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)));
    return p;
  }

  /// NCCL reported `state` for this rank: aborts the world (the other ranks' threads see it)
  /// and this rank's communicator, then throws naming rank, host and NCCL's message.
  [[noreturn]] void fail(ncclResult_t state, const char* what) {
    const char* last = ncclGetLastError(comm_);
    const std::string why = std::string("NCCL error ") + ncclGetErrorString(state) + " in " + what + " on rank " +
                            std::to_string(rank_) + " (host " + detail::host_name() + ")" +
                            (last && *last ? std::string(": ") + last : std::string());
    w_->abort(why);
    w_->release(rank_);
    throw cuda_error(why);
  }

  /// Waits until the call just posted on the non-blocking communicator has completed (or
  /// throws: the abort, or NCCL's error).
  void settle(const char* what) {
    const ncclResult_t state = detail::settle(comm_, [&] { return w_->aborted(); });
    if (state == ncclSuccess) return;
    if (state == ncclInProgress) w_->check_live(rank_);  // stopped by the abort: throws
    fail(state, what);
  }

  /// Waits for the gather stream by querying it, polling between queries.
  void wait_gather() {
    for (long spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(gather_stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) PIPEOFFLOAD_CUDA_CHECK(q);
      cudaGetLastError();  // "not ready" is no error, but it is the thread's last one until cleared
      poll();
      if (spins < 1000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  /// ctx's stream, once ctx is known to be of this communicator's device.
  cudaStream_t stream(const backend::CudaContext& ctx) {
    w_->check_live(rank_);
    if (ctx.device != dev_ || ctx.cuda_stream == nullptr)
      throw comm_error(
          "comm::Nccl: rank " + std::to_string(rank_) + " was given the context of " +
          (ctx.device == nullptr ? std::string("no device") : "device " + std::to_string(ctx.device->device())) +
          "; send, recv and the device collectives take a stream context of its own device " +
          std::to_string(dev_->device()) + " (backend::Cuda::context(stream))");
    return ctx.cuda_stream;
  }

  std::size_t next_slot(std::size_t& counter, const char* what) {
    if (counter >= opt_.max_messages_per_step)
      throw comm_error(std::string("comm::Nccl: more than max_messages_per_step = ") +
                       std::to_string(opt_.max_messages_per_step) + " " + what +
                       "s between two all_gathers; raise Nccl::Options::max_messages_per_step");
    return counter++;
  }

  /// The received headers of this step against the expected ones (one host sync, between steps).
  void verify_tags() {
    if (received_ > 0) {
      PIPEOFFLOAD_CUDA_CHECK(
          cudaMemcpyAsync(recv_host_, recv_dev_, received_ * sizeof(Header), cudaMemcpyDeviceToHost, gather_stream_));
      wait_gather();
    }
    for (std::size_t i = 0; i < received_; ++i)
      if (!(recv_host_[i] == expected_[i].h))
        throw comm_error("comm::Nccl: rank " + std::to_string(rank_) + " expected " + describe_header(expected_[i].h) +
                         " from rank " + std::to_string(expected_[i].peer) + " but received " +
                         describe_header(recv_host_[i]));
    // Every message of the step has completed (the caller synchronised), so slots are free.
    sent_ = received_ = 0;
    expected_.clear();
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw comm_error("comm::Nccl: rank " + std::to_string(rank_) + " cannot " + what + " rank " +
                       std::to_string(peer) + "; peers are the other ranks of 0.." + std::to_string(size() - 1));
  }

  std::shared_ptr<NcclWorld> w_;
  int rank_;
  backend::Cuda* dev_;
  Options opt_;
  ncclComm_t comm_ = nullptr;
  Header* send_host_ = nullptr;  // see the constructor for shapes and owners
  Header* recv_host_ = nullptr;
  Header* send_dev_ = nullptr;
  Header* recv_dev_ = nullptr;
  std::size_t piece_ = 0;            // bytes per rank of one all_gather piece
  std::byte* gather_dev_ = nullptr;  // (size() * piece_) device: all_gather staging
  std::byte* gather_in_ = nullptr;   // (piece_) pinned host: this rank's piece
  std::byte* gather_out_ = nullptr;  // (size() * piece_) pinned host: every rank's piece
  cudaStream_t gather_stream_ = nullptr;
  int poll_id_ = -1;
  std::size_t sent_ = 0, received_ = 0;
  std::vector<Expected> expected_;
  pipeoffload::detail::TrafficCounter traffic_;  // counted on the host as collectives are posted
};

static_assert(communicator<Nccl, backend::CudaContext>, "comm::Nccl must model the communicator concept.");
static_assert(replica_communicator<Nccl, backend::CudaContext>,
              "comm::Nccl must model the replica_communicator concept.");

}  // namespace pipeoffload::comm
