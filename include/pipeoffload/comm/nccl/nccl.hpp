// pipeoffload/comm/nccl/nccl.hpp: comm::Nccl, the communicator of GPU ranks.
//
// Semantics are the communicator concept's (comm/communicator.hpp) with NCCL's rendezvous:
//   - send(ctx, ...) and recv(ctx, ...) enqueue an ncclSend/ncclRecv on ctx.cuda_stream (the
//     runtime passes its comm stream's backend::CudaContext) and return at once. The runtime
//     orders the comm stream after the compute op that produced a send's data, and the compute
//     stream after a recv, with events, so the host never waits;
//   - calls are posted in RankProgram::comm order, which validate() proved deadlock-free for a
//     send that waits for its receive (NCCL's behaviour); each message is one NCCL group of
//     two operations, a 24-byte tag header and the data. Messages are bytes (a boundary tensor
//     of any element type: comm/communicator.hpp), sent as ncclUint8, so the header counts
//     bytes, in 64 bits;
//   - tags cannot be checked when the data arrives without a host sync, so each recv's header
//     lands in a device log and is compared with the expected tag at the next all_gather (the
//     runtime calls one per step, after synchronize): a mismatch throws comm_error naming both
//     tags, never a silent swap (a step computed on swapped data is never applied, because the
//     optimizer runs after that all_gather);
//   - all_gather of any trivially copyable T is ncclAllGather of its bytes (ncclUint8) on a
//     private stream, staged through a device buffer and synchronised on the host (it is called
//     between steps). Ranks must contribute equal counts of one type: NCCL does not check;
//   - the device collectives of a data-parallel group, all_to_all(ctx, in, out) (an NCCL group
//     of one ncclSend and one ncclRecv per peer) and all_gather(ctx, mine, all)
//     (ncclAllGather), enqueue on ctx.cuda_stream and return at once, like send and recv: no
//     host sync and no staging. Ranks must pass equal sizes: NCCL does not check;
//   - abort(why): ncclCommAbort on every communicator in this process of the world and of
//     every world split from it or from which it was split (a rank's pipeline and replicas
//     groups); calls to come throw aborted_error.
// Bootstrap: NcclWorld::all_local (ncclCommInitAll, one process driving every listed GPU, one
// thread per rank as po::run_thread_ranks runs them) or NcclWorld::from_file / from_id (one
// process per GPU, ncclGetUniqueId published through comm/nccl/id_file.hpp or broadcast over
// MPI). The groups of a grid of pipeline replicas: NcclWorld::split (ncclCommSplit, NCCL >=
// 2.18). Every NCCL call is checked; errors carry rank, host and ncclGetLastError.
#pragma once

#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../../backend/cuda/cuda.hpp"
#include "../communicator.hpp"
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

namespace detail {

/// The abort shared by an NcclWorld and every world split from it: every live communicator
/// of them in this process, aborted together; the first reason wins.
struct NcclAbort {
  std::mutex mu;
  std::atomic<bool> aborted{false};
  std::string reason;             // written once, under mu, before `aborted` is set
  std::vector<ncclComm_t> comms;  // every sharing world's communicators (this process)
};

}  // namespace detail

/// The communicators of the ranks this process drives, and their abort state (shared with the
/// worlds split from it).
class NcclWorld {
 public:
  /// One process, one rank per listed device (rank r on devices[r]): ncclCommInitAll.
  static std::shared_ptr<NcclWorld> all_local(std::span<const int> devices) {
    auto w = std::shared_ptr<NcclWorld>(new NcclWorld(std::make_shared<detail::NcclAbort>()));
    w->size_ = static_cast<int>(devices.size());
    w->comms_.assign(devices.size(), nullptr);
    w->ranks_.resize(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i) w->ranks_[i] = static_cast<int>(i);
    PIPEOFFLOAD_NCCL_CHECK(ncclCommInitAll(w->comms_.data(), w->size_, devices.data()), 0, nullptr);
    w->share_comms();
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
    ncclUniqueId id{};
    std::memcpy(&id, bytes.data(), sizeof id);
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
    PIPEOFFLOAD_NCCL_CHECK(ncclCommInitRank(&w->comms_[0], size, id, rank), rank, nullptr);
    w->share_comms();
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
  ~NcclWorld() {
    {
      std::lock_guard lk(abort_->mu);
      if (abort_->aborted.load()) return;  // ncclCommAbort already freed them
      // Withdrawn first, so that an abort from now on leaves them to this destructor.
      std::erase_if(abort_->comms,
                    [&](ncclComm_t c) { return std::find(comms_.begin(), comms_.end(), c) != comms_.end(); });
    }
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
  }

  int size() const { return size_; }
  /// The communicator of `rank`, which this process must drive.
  ncclComm_t comm(int rank) const {
    for (std::size_t i = 0; i < ranks_.size(); ++i)
      if (ranks_[i] == rank) return comms_[i];
    throw comm_error("comm::NcclWorld: rank " + std::to_string(rank) + " is not driven by this process");
  }

  /// Collective over this world (ncclCommSplit, NCCL >= 2.18): every rank of the world calls
  /// it once; the ranks that pass the same `color` (>= 0) form one group, ordered by `key`
  /// (ties by rank). Returns the world of this process's rank `rank` in its group: it drives
  /// that one rank (Nccl(world, world->rank(), dev)). In a world that drives several ranks
  /// (all_local), each rank's thread calls it at the same time. The new world shares this
  /// one's abort: an abort on either (or on any Nccl of either) calls ncclCommAbort on every
  /// communicator of both in this process.
  /// @code
  ///   auto job = po::comm::NcclWorld::from_id(id, g, dp * d, device);   // g = replica * d + rank
  ///   auto pipe = job->split(g / d, g % d);   // the d ranks of replica g / d
  ///   auto reps = job->split(g % d, g / d);   // the dp ranks of pipeline rank g % d
  ///   po::comm::Nccl pipeline(pipe, pipe->rank(), dev), replicas(reps, reps->rank(), dev);
  /// @endcode
  std::shared_ptr<NcclWorld> split(int rank, int color, int key) const {
    if (color < 0)
      throw comm_error("comm::NcclWorld::split: color = " + std::to_string(color) +
                       " is outside the allowed range [0, " + std::to_string(INT_MAX) + "]");
    const ncclComm_t parent = comm(rank);
    if (aborted()) throw_aborted();
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    int device = 0;
    PIPEOFFLOAD_NCCL_CHECK(ncclCommCuDevice(parent, &device), rank, parent);
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
    ncclComm_t child = nullptr;
    PIPEOFFLOAD_NCCL_CHECK(ncclCommSplit(parent, color, key, &child, nullptr), rank, parent);
    auto w = std::shared_ptr<NcclWorld>(new NcclWorld(abort_));
    w->comms_ = {child};
    w->ranks_ = {0};
    PIPEOFFLOAD_NCCL_CHECK(ncclCommCount(child, &w->size_), rank, child);
    PIPEOFFLOAD_NCCL_CHECK(ncclCommUserRank(child, &w->ranks_[0]), rank, child);
    w->share_comms();
    return w;
#else
    (void)parent;
    (void)key;
    throw comm_error("comm::NcclWorld::split needs NCCL >= 2.18 (ncclCommSplit); this build has NCCL " +
                     std::to_string(NCCL_VERSION_CODE));
#endif
  }
  /// split(rank, color, key) for a world that drives one rank (from_id, from_file).
  std::shared_ptr<NcclWorld> split(int color, int key) const {
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

  /// Aborts every communicator of this world and of every world that shares its abort, in
  /// this process (first reason wins).
  void abort(const std::string& why) {
    std::lock_guard lk(abort_->mu);
    if (abort_->aborted.load()) return;
    abort_->reason = why;
    abort_->aborted.store(true);
    for (ncclComm_t c : abort_->comms)
      if (c) ncclCommAbort(c);  // best effort: nothing to report to while failing
  }
  bool aborted() const { return abort_->aborted.load(); }
  [[noreturn]] void throw_aborted() const {
    std::lock_guard lk(abort_->mu);
    throw aborted_error("aborted: " + abort_->reason);
  }

 private:
  explicit NcclWorld(std::shared_ptr<detail::NcclAbort> shared) : abort_(std::move(shared)) {}

  /// Hands this world's communicators to the shared abort; if it came first (a split racing
  /// an abort), aborts them now and throws.
  void share_comms() {
    {
      std::lock_guard lk(abort_->mu);
      if (!abort_->aborted.load()) {
        abort_->comms.insert(abort_->comms.end(), comms_.begin(), comms_.end());
        return;
      }
      for (ncclComm_t c : comms_)
        if (c) ncclCommAbort(c);
    }
    throw_aborted();
  }

  int size_ = 0;
  std::vector<ncclComm_t> comms_;
  std::vector<int> ranks_;
  std::shared_ptr<detail::NcclAbort> abort_;
};

/// One rank's communicator on one backend::Cuda device.
class Nccl {
 public:
  struct Options {
    std::size_t max_messages_per_step = 1 << 16;  ///< tag headers kept between two all_gathers
  };

  Nccl(std::shared_ptr<NcclWorld> world, int rank, backend::Cuda& dev) : Nccl(std::move(world), rank, dev, Options{}) {}
  Nccl(std::shared_ptr<NcclWorld> world, int rank, backend::Cuda& dev, Options opt)
      : w_(std::move(world)), rank_(rank), dev_(&dev), opt_(opt) {
    comm_ = w_->comm(rank);
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(dev.device()));
    const std::size_t n = opt_.max_messages_per_step;
    void* p = nullptr;
    // (max_messages_per_step) Header: headers of sends, pinned host, owned here, written by
    // the host when a send is posted and read by the copy that stages them to the device.
    PIPEOFFLOAD_CUDA_CHECK(cudaHostAlloc(&p, n * sizeof(Header), cudaHostAllocPortable));
    send_host_ = static_cast<Header*>(p);
    // (max_messages_per_step) Header, device: staged send headers, and received headers.
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, n * sizeof(Header)));
    send_dev_ = static_cast<Header*>(p);
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, n * sizeof(Header)));
    recv_dev_ = static_cast<Header*>(p);
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, 1 << 20));  // all_gather staging, grown on demand between steps
    gather_dev_ = static_cast<std::byte*>(p);
    gather_capacity_ = 1 << 20;
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamCreateWithFlags(&gather_stream_, cudaStreamNonBlocking));
  }
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  ~Nccl() {
    cudaSetDevice(dev_->device());
    cudaStreamSynchronize(gather_stream_);
    cudaStreamDestroy(gather_stream_);
    cudaFree(gather_dev_);
    cudaFree(recv_dev_);
    cudaFree(send_dev_);
    cudaFreeHost(send_host_);
    cudaGetLastError();
  }

  int rank() const { return rank_; }
  int size() const { return w_->size(); }

  /// Enqueues `data` (device memory, any element type) to `peer` on ctx's stream.
  void send(const backend::CudaContext& ctx, int peer, Tag tag, std::span<const std::byte> data) {
    check_peer(peer, "send to");
    const cudaStream_t s = stream(ctx);
    const std::size_t i = next_slot(sent_, "send");
    send_host_[i] = header(tag, data.size());
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(send_dev_ + i, send_host_ + i, sizeof(Header), cudaMemcpyHostToDevice, s));
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupStart(), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclSend(send_dev_ + i, sizeof(Header), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclSend(data.data(), data.size(), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupEnd(), rank_, comm_);
  }

  /// Enqueues the receive of `out.size()` bytes from `peer` into `out` (device memory) on
  /// ctx's stream; its tag and size are checked at the next all_gather (see the file comment).
  void recv(const backend::CudaContext& ctx, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    const cudaStream_t s = stream(ctx);
    const std::size_t i = next_slot(received_, "recv");
    expected_.push_back({peer, header(tag, out.size())});
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupStart(), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclRecv(recv_dev_ + i, sizeof(Header), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclRecv(out.data(), out.size(), ncclUint8, peer, comm_, s), rank_, comm_);
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupEnd(), rank_, comm_);
  }

  /// Verifies the tags received since the last call, then gathers `mine` (host memory, values
  /// of any trivially copyable T) from every rank into `all` (host memory).
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "comm::Nccl::all_gather: T must be trivially copyable; values travel as bytes.");
    if (w_->aborted()) w_->throw_aborted();
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size());
    if (all.size() != n * d)
      throw comm_error("comm::Nccl::all_gather: the output holds " + std::to_string(all.size()) +
                       " values; it must hold size() * mine.size() = " + std::to_string(n * d));
    PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(dev_->device()));
    verify_tags();
    const std::size_t block = n * sizeof(T);  // bytes per rank
    if (block * d > gather_capacity_) {       // between steps: the only allocation after construction
      PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(gather_stream_));
      PIPEOFFLOAD_CUDA_CHECK(cudaFree(gather_dev_));
      gather_dev_ = nullptr;
      gather_capacity_ = 0;
      void* p = nullptr;
      PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, block * d));
      gather_dev_ = static_cast<std::byte*>(p);
      gather_capacity_ = block * d;
    }
    std::byte* slot = gather_dev_ + static_cast<std::size_t>(rank_) * block;
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(slot, mine.data(), block, cudaMemcpyHostToDevice, gather_stream_));
    PIPEOFFLOAD_NCCL_CHECK(ncclAllGather(slot, gather_dev_, block, ncclUint8, comm_, gather_stream_), rank_, comm_);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(all.data(), gather_dev_, block * d, cudaMemcpyDeviceToHost, gather_stream_));
    PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(gather_stream_));
    if (w_->aborted()) w_->throw_aborted();
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
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupStart(), rank_, comm_);
    for (int p = 0; p < size(); ++p) {
      if (p == rank_) continue;
      const std::size_t at = static_cast<std::size_t>(p) * block;
      PIPEOFFLOAD_NCCL_CHECK(ncclSend(in.data() + at, block, ncclUint8, p, comm_, s), rank_, comm_);
      PIPEOFFLOAD_NCCL_CHECK(ncclRecv(out.data() + at, block, ncclUint8, p, comm_, s), rank_, comm_);
    }
    PIPEOFFLOAD_NCCL_CHECK(ncclGroupEnd(), rank_, comm_);
    PIPEOFFLOAD_CUDA_CHECK(
        cudaMemcpyAsync(out.data() + me * block, in.data() + me * block, block, cudaMemcpyDeviceToDevice, s));
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
    PIPEOFFLOAD_NCCL_CHECK(ncclAllGather(mine.data(), all.data(), n, ncclUint8, comm_, s), rank_, comm_);
  }

  /// Aborts this rank's communicators: this world's and those of every world that shares its
  /// abort (the rank's other group, split from the same world).
  void abort(const std::string& why) { w_->abort(why); }

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

  /// ctx's stream, once ctx is known to be of this communicator's device.
  cudaStream_t stream(const backend::CudaContext& ctx) const {
    if (w_->aborted()) w_->throw_aborted();
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
    std::vector<Header> got(received_);
    if (!got.empty()) {
      PIPEOFFLOAD_CUDA_CHECK(
          cudaMemcpyAsync(got.data(), recv_dev_, got.size() * sizeof(Header), cudaMemcpyDeviceToHost, gather_stream_));
      PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(gather_stream_));
    }
    for (std::size_t i = 0; i < got.size(); ++i)
      if (!(got[i] == expected_[i].h))
        throw comm_error("comm::Nccl: rank " + std::to_string(rank_) + " expected " + describe_header(expected_[i].h) +
                         " from rank " + std::to_string(expected_[i].peer) + " but received " +
                         describe_header(got[i]));
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
  Header* send_dev_ = nullptr;
  Header* recv_dev_ = nullptr;
  std::byte* gather_dev_ = nullptr;  // (gather_capacity_ bytes) device, owned: all_gather staging
  std::size_t gather_capacity_ = 0;
  cudaStream_t gather_stream_ = nullptr;
  std::size_t sent_ = 0, received_ = 0;
  std::vector<Expected> expected_;
};

static_assert(communicator<Nccl, backend::CudaContext>, "comm::Nccl must model the communicator concept.");
static_assert(replica_communicator<Nccl, backend::CudaContext>,
              "comm::Nccl must model the replica_communicator concept.");

}  // namespace pipeoffload::comm
