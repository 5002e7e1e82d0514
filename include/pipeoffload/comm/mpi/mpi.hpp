// pipeoffload/comm/mpi/mpi.hpp: comm::Mpi, pipeline ranks that are MPI processes.
//
// The `communicator` concept (comm/communicator.hpp) over MPI point-to-point, with the same
// semantics as comm::Threads (every call blocks the calling thread, so send and recv take any
// backend context and ignore it):
//   - send is synchronous (MPI_Issend): it completes only once the receiver has matched it,
//     the rendezvous that validate() plans for, so a schedule that runs here cannot rely on
//     buffering a GPU link would not give;
//   - every message carries a header (stage, microbatch, direction, byte count) in front of
//     its data; MPI keeps messages of one (source, tag, communicator) in order, and a recv
//     that meets another tag or size throws comm_error naming both;
//   - all_gather of any trivially copyable T moves MPI_BYTEs, after a round that compares every
//     rank's count (elements of T) and sizeof(T);
//   - no wait is unbounded: every send, recv and all_gather polls its request and gives up
//     after Options::timeout_seconds with a message naming the op, this rank and the peer;
//   - abort(why) sends a short note to every other rank. Each rank polls for notes while it
//     waits, so a failure on one rank wakes the others with aborted_error naming the rank that
//     failed. MPI 4.1 cannot recover a job after a failure, so the program then ends the job
//     (MpiSession::abort_job); a rank killed outright is reported by mpirun, which ends the rest.
// Needs MPI_THREAD_MULTIPLE: the runtime's comm stream, its host thread and a failing stream's
// error hook may all call into the communicator at once.
#pragma once

// Only MPI's C API is used; its deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../../backend/cpu/context.hpp"
#include "../communicator.hpp"

namespace pipeoffload::comm {

namespace detail {

inline std::string mpi_host() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  if (MPI_Get_processor_name(name, &len) != MPI_SUCCESS) return "unknown host";
  return std::string(name, static_cast<std::size_t>(std::max(0, len)));
}

/// Throws comm_error with the failed call's text, MPI's error string, rank, host and place.
inline void mpi_check(int rc, const char* call, int rank, std::source_location at = std::source_location::current()) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw comm_error(std::string(call) + " failed on rank " + std::to_string(rank) + " (" + mpi_host() + "): " +
                   (len > 0 ? std::string(text, static_cast<std::size_t>(len)) : "error " + std::to_string(rc)) + " [" +
                   at.file_name() + ":" + std::to_string(at.line()) + "]");
}

/// Polling pause: yield first (a reply is often microseconds away), then sleep with a growing
/// period, so that ranks oversubscribed on few cores leave them to the ranks that compute.
class Backoff {
 public:
  void pause() {
    if (n_ < 200) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    sleep_us_ = std::min(sleep_us_ * 2, 1000);
  }

 private:
  int n_ = 0;
  int sleep_us_ = 20;
};

}  // namespace detail

/// Checks an MPI call's return code (the communicator sets MPI_ERRORS_RETURN on its own
/// communicator, so errors arrive here instead of ending the process).
#define PIPEOFFLOAD_MPI_CHECK(rank, call)                          \
  do {                                                             \
    ::pipeoffload::comm::detail::mpi_check((call), #call, (rank)); \
  } while (0)

/// MPI for the life of a program: MPI_Init_thread with MPI_THREAD_MULTIPLE (unless someone
/// already initialized MPI) and MPI_Finalize at the end.
/// @code
///   int main(int argc, char** argv) {
///     po::comm::MpiSession mpi(argc, argv);  // throws if MPI lacks MPI_THREAD_MULTIPLE
///     po::comm::Mpi comm;                    // a private duplicate of MPI_COMM_WORLD
///     ...
///   }
/// @endcode
class MpiSession {
 public:
  MpiSession(int& argc, char**& argv) {
    int inited = 0, provided = 0;
    PIPEOFFLOAD_MPI_CHECK(-1, MPI_Initialized(&inited));
    if (!inited) {
      PIPEOFFLOAD_MPI_CHECK(-1, MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
      owner_ = true;
    } else {
      PIPEOFFLOAD_MPI_CHECK(-1, MPI_Query_thread(&provided));
    }
    PIPEOFFLOAD_MPI_CHECK(-1, MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Comm_size(MPI_COMM_WORLD, &size_));
    if (provided < MPI_THREAD_MULTIPLE)
      throw comm_error("comm::MpiSession: this MPI provides thread level " + std::to_string(provided) +
                       ", comm::Mpi needs MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
                       "): the comm stream and the host thread call MPI at once");
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalized = 1;
    if (owner_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string host() const { return detail::mpi_host(); }

  /// Ends every process of the job with `code` (MPI_Abort on MPI_COMM_WORLD): the only way
  /// out of a failed job under MPI without fault tolerance, since peers may hold requests that
  /// will never complete and MPI_Finalize would wait for them.
  [[noreturn]] static void abort_job(int code) {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; this keeps [[noreturn]] honest if it did
  }

 private:
  bool owner_ = false;
  int rank_ = 0, size_ = 1;
};

/// One rank's handle on a group of MPI processes that form a pipeline.
/// @code
///   po::comm::MpiSession mpi(argc, argv);
///   po::comm::Mpi comm({.timeout_seconds = 60});   // collective over MPI_COMM_WORLD
///   po::Runtime<po::PO_F, MyLayer, po::backend::Cpu, po::comm::Mpi> rt(opts, dev, comm, mine);
/// @endcode
class Mpi {
 public:
  struct Options {
    /// How long a send, recv or all_gather may wait for its peer before it fails with a
    /// message naming the op and the peer (a peer that died or hangs).
    double timeout_seconds = 300;
    /// The group to duplicate (collective over it); MPI_COMM_WORLD by default.
    MPI_Comm parent = MPI_COMM_WORLD;
  };

  Mpi() : Mpi(Options{}) {}
  explicit Mpi(Options opt) : opt_(opt) {
    if (!(opt.timeout_seconds > 0))
      throw comm_error("comm::Mpi: timeout_seconds = " + std::to_string(opt.timeout_seconds) + " must be > 0");
    int r = 0;
    PIPEOFFLOAD_MPI_CHECK(-1, MPI_Comm_rank(opt.parent, &r));
    // A private communicator: our tags cannot meet the program's own MPI traffic.
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_dup(opt.parent, &comm_));
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_rank(comm_, &rank_));
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_size(comm_, &size_));
  }
  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  ~Mpi() {
    // After an abort or a timeout, requests may still point into buffers we keep (orphans_):
    // freeing the communicator then is not allowed, and the job is ending anyway.
    int finalized = 1;
    if (!aborted() && orphans_.empty() && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_; }
  const Options& options() const { return opt_; }

  /// Blocks until `peer` has matched the message (synchronous send), or fails. The context is
  /// not needed: the calling thread does the work.
  template <class Context>
  void send(const Context&, int peer, Tag tag, std::span<const std::byte> data) {
    check_peer(peer, "send to");
    throw_if_aborted();
    auto buf = std::make_unique<std::vector<std::byte>>(sizeof(Header) + data.size_bytes());
    const Header h{tag.stage, tag.mb, static_cast<std::int32_t>(tag.dir), 0, static_cast<std::uint64_t>(data.size())};
    std::memcpy(buf->data(), &h, sizeof h);
    if (!data.empty()) std::memcpy(buf->data() + sizeof h, data.data(), data.size_bytes());
    if (buf->size() > static_cast<std::size_t>(INT_MAX))
      throw comm_error("comm::Mpi: rank " + std::to_string(rank_) + " cannot send " + std::to_string(data.size()) +
                       " bytes in one message; the limit is " + std::to_string(INT_MAX - sizeof(Header)));
    MPI_Request req = MPI_REQUEST_NULL;
    PIPEOFFLOAD_MPI_CHECK(
        rank_, MPI_Issend(buf->data(), static_cast<int>(buf->size()), MPI_BYTE, peer, data_tag, comm_, &req));
    wait(
        req, std::move(buf), nullptr, [&] { return "send to rank " + std::to_string(peer) + " of " + describe(tag); },
        peer);
  }

  /// Blocks until the next message from `peer` arrives; it must carry `tag` and fit `out`.
  template <class Context>
  void recv(const Context&, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    throw_if_aborted();
    const auto start = std::chrono::steady_clock::now();
    detail::Backoff backoff;
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Status st{};
    for (;;) {
      int found = 0;
      PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Improbe(peer, data_tag, comm_, &found, &msg, &st));
      if (found) break;
      poll_notes();
      throw_if_aborted();
      if (elapsed(start) > opt_.timeout_seconds)
        throw comm_error(timed_out("recv from rank " + std::to_string(peer) + " of " + describe(tag), peer, start));
      backoff.pause();
    }
    int bytes = 0;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Get_count(&st, MPI_BYTE, &bytes));
    // The message is matched, so this receive completes without waiting on the peer.
    std::vector<std::byte> buf(static_cast<std::size_t>(std::max(bytes, 0)));
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Mrecv(buf.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE));
    Header h{};
    if (buf.size() < sizeof h)
      throw comm_error("comm::Mpi: rank " + std::to_string(rank_) + " expected " + describe(tag) + " from rank " +
                       std::to_string(peer) + " but received a " + std::to_string(buf.size()) +
                       "-byte message without a header");
    std::memcpy(&h, buf.data(), sizeof h);
    const Tag got{h.stage, h.mb, h.dir == 0 ? Dir::forward : Dir::backward};
    const std::size_t count = buf.size() - sizeof h;
    if (!(got == tag) || h.count != out.size() || count != out.size())
      throw comm_error("comm::Mpi: rank " + std::to_string(rank_) + " expected " + describe(tag) + " of " +
                       std::to_string(out.size()) + " bytes from rank " + std::to_string(peer) + " but received " +
                       describe(got) + " of " + std::to_string(h.count) + " bytes");
    if (!out.empty()) std::memcpy(out.data(), buf.data() + sizeof h, out.size());
  }

  /// Every rank contributes mine.size() values of T; `all` receives them in rank order. Ranks
  /// that contribute different counts (or types of different sizes) all throw comm_error
  /// naming two of them.
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "comm::Mpi::all_gather: T must be trivially copyable; values travel as MPI_BYTE.");
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size_);
    if (all.size() != n * d)
      throw comm_error("comm::Mpi::all_gather: the output holds " + std::to_string(all.size()) +
                       " values; it must hold size() * mine.size() = " + std::to_string(n * d));
    throw_if_aborted();
    // First the counts and value sizes, so that a mismatch is an error on every rank instead
    // of an MPI truncation on some. Buffers are owned here: a request cut short must not point
    // into the caller's memory.
    auto counts = std::make_unique<std::vector<std::byte>>((d + 1) * 2 * sizeof(long long));
    const long long my_count[2] = {static_cast<long long>(n), static_cast<long long>(sizeof(T))};
    std::memcpy(counts->data(), my_count, sizeof my_count);
    gather_owned(std::move(counts), sizeof my_count, MPI_LONG_LONG, 2);
    const long long* c =
        reinterpret_cast<const long long*>(last_gather_.data() + sizeof my_count);  // [rank * 2 + {count, size}]
    for (std::size_t r = 0; r < d; ++r)
      if (c[2 * r] != c[0])
        throw comm_error("comm::Mpi::all_gather: ranks contributed different counts (rank 0: " + std::to_string(c[0]) +
                         ", rank " + std::to_string(r) + ": " + std::to_string(c[2 * r]) + ")");
    for (std::size_t r = 0; r < d; ++r)
      if (c[2 * r + 1] != c[1])
        throw comm_error(
            "comm::Mpi::all_gather: ranks contributed values of different sizes (rank 0: " + std::to_string(c[1]) +
            " bytes, rank " + std::to_string(r) + ": " + std::to_string(c[2 * r + 1]) + " bytes)");
    const std::size_t block = n * sizeof(T);
    if (block > static_cast<std::size_t>(INT_MAX))
      throw comm_error("comm::Mpi::all_gather: " + std::to_string(n) + " values are too many for one call");
    auto values = std::make_unique<std::vector<std::byte>>((d + 1) * block);
    if (n > 0) std::memcpy(values->data(), mine.data(), block);
    gather_owned(std::move(values), block, MPI_BYTE, static_cast<int>(block));
    if (n > 0) std::memcpy(all.data(), last_gather_.data() + block, d * block);
  }

  /// Collective: `data` of rank `root` lands in `data` on every rank (same size everywhere),
  /// with the same timeout and abort handling as every other wait. Bootstraps use it (the
  /// NCCL unique id: comm/mpi/nccl_id.hpp).
  void broadcast(int root, std::span<std::byte> data) {
    if (root < 0 || root >= size_)
      throw comm_error("comm::Mpi::broadcast: root = " + std::to_string(root) + " is outside [0, " +
                       std::to_string(size_ - 1) + "]");
    if (data.size() > static_cast<std::size_t>(INT_MAX))
      throw comm_error("comm::Mpi::broadcast: " + std::to_string(data.size()) + " bytes are too many for one call");
    throw_if_aborted();
    auto buf = std::make_unique<std::vector<std::byte>>(data.begin(), data.end());
    MPI_Request req = MPI_REQUEST_NULL;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Ibcast(buf->data(), static_cast<int>(buf->size()), MPI_BYTE, root, comm_, &req));
    std::vector<std::byte> got;
    wait(req, std::move(buf), &got, [&] { return "broadcast from rank " + std::to_string(root); }, root);
    std::copy(got.begin(), got.end(), data.begin());
  }

  /// Stops every rank: local waits throw aborted_error now, and every other rank gets a note
  /// that makes its waits throw aborted_error naming this rank. The first abort wins; never throws.
  void abort(const std::string& why) noexcept {
    try {
      {
        std::lock_guard lk(mu_);
        if (aborted_) return;
        aborted_ = true;
        origin_ = rank_;
        reason_ = why;
        note_ = why.substr(0, 4000);  // sent from here; must live as long as the requests
      }
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        MPI_Request req = MPI_REQUEST_NULL;
        if (MPI_Isend(note_.data(), static_cast<int>(note_.size()), MPI_CHAR, p, abort_tag, comm_, &req) == MPI_SUCCESS)
          MPI_Request_free(&req);
      }
    } catch (...) {
      // Out of memory while aborting: the local state is set, which is what matters most.
    }
  }

  /// The rank whose failure aborted this communicator: this rank for a local abort(), the
  /// sender of the note otherwise, -1 while nothing failed.
  int abort_origin() const {
    std::lock_guard lk(mu_);
    return aborted_ ? origin_ : -1;
  }
  bool aborted() const {
    std::lock_guard lk(mu_);
    return aborted_;
  }

  /// Looks for an abort note without blocking (waits do this themselves).
  void poll_notes() {
    int found = 0;
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Status st{};
    if (MPI_Improbe(MPI_ANY_SOURCE, abort_tag, comm_, &found, &msg, &st) != MPI_SUCCESS || !found) return;
    int len = 0;
    MPI_Get_count(&st, MPI_CHAR, &len);
    std::string text(static_cast<std::size_t>(std::max(len, 0)), '\0');
    MPI_Mrecv(text.data(), len, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
    std::lock_guard lk(mu_);
    if (aborted_) return;
    aborted_ = true;
    origin_ = st.MPI_SOURCE;
    reason_ = "rank " + std::to_string(st.MPI_SOURCE) + " failed: " + text;
  }

 private:
  static constexpr int data_tag = 1, abort_tag = 2;
  struct Header {
    std::int32_t stage, mb, dir, pad;
    std::uint64_t count;
  };

  static double elapsed(std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  }

  std::string timed_out(const std::string& op, int peer, std::chrono::steady_clock::time_point since) const {
    char secs[32], limit[32];
    std::snprintf(secs, sizeof secs, "%.1f", elapsed(since));
    std::snprintf(limit, sizeof limit, "%g", opt_.timeout_seconds);
    // The peer named is the one this op waits for; it may itself be waiting on a lost rank.
    return "comm::Mpi: rank " + std::to_string(rank_) + " (" + detail::mpi_host() + ") has waited " + secs + " s in " +
           op + " (timeout " + limit + " s); " +
           (peer >= 0 ? "rank " + std::to_string(peer) + " has not answered: it is lost, stuck, or waiting itself"
                      : std::string("some rank has not joined: it is lost, stuck, or waiting itself"));
  }

  void throw_if_aborted() {
    std::lock_guard lk(mu_);
    if (aborted_) throw aborted_error("aborted: " + reason_);
  }

  /// Waits for `req`, watching for abort notes and the timeout. `buf` is what the request
  /// reads or writes: on failure it is kept (orphans_) because the request still uses it.
  template <class What>
  void wait(MPI_Request& req, std::unique_ptr<std::vector<std::byte>> buf, std::vector<std::byte>* into, What what,
            int peer) {
    const auto start = std::chrono::steady_clock::now();
    detail::Backoff backoff;
    for (;;) {
      int done = 0;
      const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        keep(std::move(buf));
        detail::mpi_check(rc, "MPI_Test", rank_);
      }
      if (done) {
        if (into) *into = std::move(*buf);
        return;
      }
      poll_notes();
      if (aborted()) {
        keep(std::move(buf));
        throw_if_aborted();
      }
      if (elapsed(start) > opt_.timeout_seconds) {
        keep(std::move(buf));
        throw comm_error(timed_out(what(), peer, start));
      }
      backoff.pause();
    }
  }

  void keep(std::unique_ptr<std::vector<std::byte>> buf) {
    std::lock_guard lk(mu_);
    orphans_.push_back(std::move(buf));
  }

  /// MPI_Iallgather of `block` bytes per rank: the first block of *buf is this rank's, the
  /// result lands after it and is moved to last_gather_.
  void gather_owned(std::unique_ptr<std::vector<std::byte>> buf, std::size_t block, MPI_Datatype type, int count) {
    MPI_Request req = MPI_REQUEST_NULL;
    std::byte* base = buf->data();
    if (count == 0) {
      last_gather_ = std::move(*buf);
      return;
    }
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Iallgather(base, count, type, base + block, count, type, comm_, &req));
    wait(req, std::move(buf), &last_gather_, [] { return std::string("all_gather"); }, -1);
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw comm_error("comm::Mpi: rank " + std::to_string(rank_) + " cannot " + what + " rank " +
                       std::to_string(peer) + "; peers are the other ranks of 0.." + std::to_string(size_ - 1));
  }

  Options opt_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  mutable std::mutex mu_;
  bool aborted_ = false;
  int origin_ = -1;
  std::string reason_, note_;
  std::vector<std::unique_ptr<std::vector<std::byte>>> orphans_;
  std::vector<std::byte> last_gather_;  // result of the last all_gather round (host thread only)
};

static_assert(communicator<Mpi, backend::CpuContext>, "comm::Mpi must model the communicator concept.");

}  // namespace pipeoffload::comm
