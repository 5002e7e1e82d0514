// pipeoffload/comm/mpi/mpi.hpp: comm::Mpi, ranks that are MPI processes: one pipeline, or
// (Mpi::split) the pipeline and data-parallel groups of a grid of pipeline replicas. The
// communicator concepts' contract over MPI (synchronous sends, tagged messages, bounded waits,
// an abort that reaches every rank): docs/processes_and_gpus.md, "comm::Mpi".
/// @file
#pragma once

// Only MPI's C API is used; its deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
/// Keeps Open MPI's C++ bindings out of mpi.h.
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
/// Keeps MPICH's C++ bindings out of mpi.h.
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
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
/// period up to `max_us`, so that ranks oversubscribed on few cores leave them to the ranks
/// that compute. The cap is a message's added latency: a wait that has backed off to it
/// notices an arrival max_us/2 late on average, once per pipeline hop.
class Backoff {
 public:
  explicit Backoff(int max_us) : max_us_(max_us) {}
  void pause() {
    if (n_ < 200) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    sleep_us_ = std::min(sleep_us_ * 2, max_us_);
  }

 private:
  int max_us_;
  int n_ = 0;
  int sleep_us_ = 10;
};

}  // namespace detail

/// Checks an MPI call's return code (the communicator sets MPI_ERRORS_RETURN on its own
/// communicator, so errors arrive here instead of ending the process).
#define PIPEOFFLOAD_MPI_CHECK(rank, call)                          \
  do {                                                             \
    ::pipeoffload::comm::detail::mpi_check((call), #call, (rank)); \
  } while (0)

namespace detail {

/// Polls `req` until it completes (true) or `timeout` seconds have passed (false: the request
/// is still pending, so whatever it reads or writes must stay alive and the job must end).
/// The waits before any comm::Mpi exists: they have no abort notes to watch.
inline bool test_within(MPI_Request& req, int rank, double timeout) {
  const auto start = std::chrono::steady_clock::now();
  for (int done = 0, sleep_us = 1;;) {
    PIPEOFFLOAD_MPI_CHECK(rank, MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) return true;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, 1000);
  }
}

/// `seconds` as the messages print it ("%g").
inline std::string seconds_text(double seconds) {
  char out[32];
  std::snprintf(out, sizeof out, "%g", seconds);
  return out;
}

/// MPI_Comm_dup of `parent` (collective over it), waited for at most `timeout` seconds: a
/// process of `parent` that never constructs its communicator fails the others with a
/// sentence instead of leaving them in MPI_Comm_dup forever. After a timeout the request is
/// let go (its handle's memory too) and the job must end.
inline MPI_Comm dup_within(MPI_Comm parent, int rank, double timeout, const char* who) {
  auto out = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req = MPI_REQUEST_NULL;
  PIPEOFFLOAD_MPI_CHECK(rank, MPI_Comm_idup(parent, out.get(), &req));
  if (test_within(req, rank, timeout)) return *out;
  (void)out.release();
  throw comm_error(std::string(who) + ": rank " + std::to_string(rank) + " waited " + seconds_text(timeout) +
                   " s (the timeout) for every process of its parent communicator to construct theirs "
                   "(MPI_Comm_idup): a process has failed or is elsewhere");
}

}  // namespace detail

/// MPI for the life of a program: MPI_Init_thread with MPI_THREAD_MULTIPLE (unless someone
/// already initialized MPI) and MPI_Finalize at the end.
/// @code
///   int main(int argc, char** argv) {
///     po::comm::MpiSession mpi(argc, argv);  // throws if MPI lacks MPI_THREAD_MULTIPLE
///     po::comm::Mpi comm;                    // a private duplicate of MPI_COMM_WORLD
///     // ... train with comm
///   }
/// @endcode
class MpiSession {
 public:
  /// Initializes MPI (unless it already is); throws comm_error if MPI lacks MPI_THREAD_MULTIPLE.
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

  /// This process's rank in MPI_COMM_WORLD.
  int rank() const { return rank_; }
  /// Processes in MPI_COMM_WORLD.
  int size() const { return size_; }
  /// This process's host name (MPI_Get_processor_name).
  std::string host() const { return detail::mpi_host(); }

  /// What agree() found: every rank ready (`ok`), or the first rank (lowest) that was not and why.
  struct Agreement {
    bool ok = true;          ///< every rank passed its checks and was given rank 0's arguments
    int rank = -1;           ///< the first rank that failed (or differed); -1 with `ok` or after a timeout
    std::string error;       ///< that rank's sentence, or what differed, or what timed out
    int failed = 0;          ///< how many ranks failed their own checks
    bool timed_out = false;  ///< not every rank reached agree() in time: MPI_Abort is the only way out
  };

  /// Before anything collective that could wait forever: every process tells every other
  /// whether its own checks passed (`local_error` empty) and a hash of its arguments, which
  /// must equal rank 0's. One MPI_Iallgather on MPI_COMM_WORLD, polled for at most
  /// `timeout_seconds` (> 0). Every rank returns the same Agreement, so all can leave
  /// normally (MPI_Finalize) when it is not ok, except after a timeout, when a request is
  /// still pending and the caller must end the job (abort_job). A sentence longer than 1000
  /// bytes is cut.
  Agreement agree(std::string_view local_error, std::uint64_t arguments_hash, double timeout_seconds) const {
    if (!(timeout_seconds > 0))
      throw comm_error("comm::MpiSession::agree: timeout_seconds = " + std::to_string(timeout_seconds) +
                       " must be > 0");
    struct Entry {
      std::int32_t failed;
      std::uint64_t hash;
      char text[1004];
    };
    // On the heap: after a timeout the request still writes into them, so they are let go.
    auto mine = std::make_unique<Entry>();
    mine->failed = local_error.empty() ? 0 : 1;
    mine->hash = arguments_hash;
    local_error.copy(mine->text, std::min(local_error.size(), sizeof mine->text - 1));
    auto all = std::make_unique<std::vector<Entry>>(static_cast<std::size_t>(size_));
    MPI_Request req = MPI_REQUEST_NULL;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Iallgather(mine.get(), sizeof(Entry), MPI_BYTE, all->data(), sizeof(Entry),
                                                MPI_BYTE, MPI_COMM_WORLD, &req));
    if (!detail::test_within(req, rank_, timeout_seconds)) {
      (void)mine.release();
      (void)all.release();
      return {false, -1,
              "not every process reached the start within " + detail::seconds_text(timeout_seconds) +
                  " s (is every rank the same program, started with the same arguments?)",
              0, true};
    }
    const std::vector<Entry>& got = *all;
    Agreement a;
    for (int r = 0; r < size_; ++r)
      if (got[static_cast<std::size_t>(r)].failed && a.failed++ == 0) {
        a.ok = false;
        a.rank = r;
        a.error = got[static_cast<std::size_t>(r)].text;
      }
    if (!a.ok) return a;
    for (int r = 1; r < size_; ++r)
      if (got[static_cast<std::size_t>(r)].hash != got[0].hash)
        return {false, r, "it was given other arguments than rank 0; every rank must be given the same ones"};
    return {};
  }

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

namespace detail {

/// The abort state shared by a communicator and every one split from it (Mpi::split): the
/// job's communicator the notes travel on, and the first failure. Whoever holds it keeps the
/// note communicator alive.
struct MpiAbort {
  MPI_Comm notes = MPI_COMM_NULL;  // a private duplicate of the first communicator's parent (the job)
  int rank = 0, size = 1;          // this process's rank in `notes` (its job rank), and the job's size
  std::mutex mu;
  bool aborted = false;
  int origin = -1;  // the job rank that failed
  std::string reason;
  std::unique_ptr<std::string> note;                             // sent from here (Isend)
  std::vector<std::unique_ptr<std::vector<std::byte>>> orphans;  // buffers of requests cut short

  MpiAbort() = default;
  MpiAbort(const MpiAbort&) = delete;
  MpiAbort& operator=(const MpiAbort&) = delete;
  ~MpiAbort() {
    // After an abort or a timeout, requests may still read the note or point into orphans:
    // they are left allocated, and the communicator is not freed (the job is ending anyway).
    if (aborted || !orphans.empty()) {
      (void)note.release();
      for (auto& o : orphans) (void)o.release();
      return;
    }
    int finalized = 1;
    if (notes != MPI_COMM_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Comm_free(&notes);
  }
};

}  // namespace detail

/// One rank's handle on a group of MPI processes: a pipeline, or (split) one of the groups of
/// a grid of pipeline replicas.
/// @code
///   po::comm::MpiSession mpi(argc, argv);
///   po::comm::Mpi comm({.timeout_seconds = 60});   // collective over MPI_COMM_WORLD
///   po::Runtime<po::PO_F, MyLayer, po::backend::Cpu, po::comm::Mpi> rt({d, v, m}, dev, comm, mine);
/// @endcode
class Mpi {
 public:
  /// How the communicator waits and which group it spans.
  struct Options {
    /// How long a send, recv or collective may wait for its peer before it fails with a
    /// message naming the op and the peer (a peer that died or hangs).
    double timeout_seconds = 300;
    /// The group to duplicate (collective over it); MPI_COMM_WORLD by default. Abort notes
    /// reach every rank of it (the job).
    MPI_Comm parent = MPI_COMM_WORLD;
    /// Longest sleep, in microseconds, of a rank polling for a message (1..100000). It is the
    /// latency a waiting rank adds to each hop: at the former 1000, 8 processes on 2 cores ran
    /// bench/dp_overlap 24 to 38 % above the model's prediction, at 40 within 5 % (no
    /// measurable cost to CPU-bound train_gpt runs; bench/RESULTS.md).
    int poll_sleep_max_us = 40;
  };

  Mpi() : Mpi(Options{}) {}
  /// Duplicates Options::parent (collective over it, within the timeout); throws comm_error
  /// for a timeout <= 0 or when some process of the parent does not construct its own in time.
  explicit Mpi(Options opt) : opt_(opt) {
    if (!(opt.timeout_seconds > 0))
      throw comm_error("comm::Mpi: timeout_seconds = " + std::to_string(opt.timeout_seconds) + " must be > 0");
    if (opt.poll_sleep_max_us < 1 || opt.poll_sleep_max_us > 100000)
      throw comm_error("comm::Mpi: poll_sleep_max_us = " + std::to_string(opt.poll_sleep_max_us) +
                       " is outside the allowed range [1, 100000]");
    int r = 0;
    PIPEOFFLOAD_MPI_CHECK(-1, MPI_Comm_rank(opt.parent, &r));
    // Private communicators: our tags cannot meet the program's own MPI traffic, and abort
    // notes travel apart from the data.
    auto state = std::make_shared<detail::MpiAbort>();
    state->notes = detail::dup_within(opt.parent, r, opt.timeout_seconds, "comm::Mpi");
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_set_errhandler(state->notes, MPI_ERRORS_RETURN));
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_rank(state->notes, &state->rank));
    PIPEOFFLOAD_MPI_CHECK(r, MPI_Comm_size(state->notes, &state->size));
    adopt(detail::dup_within(opt.parent, r, opt.timeout_seconds, "comm::Mpi"), std::move(state));
  }
  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  /// Moves the handle (a moved-from Mpi may only be destroyed). Not while a call is in progress.
  Mpi(Mpi&& o) noexcept
      : opt_(o.opt_),
        comm_(std::exchange(o.comm_, MPI_COMM_NULL)),
        rank_(o.rank_),
        size_(o.size_),
        job_rank_(std::move(o.job_rank_)),
        state_(std::move(o.state_)),
        last_gather_(std::move(o.last_gather_)),
        traffic_(o.traffic_) {}
  Mpi& operator=(Mpi&&) = delete;
  ~Mpi() {
    // After an abort or a timeout, requests may still point into buffers the state keeps
    // (orphans): freeing the communicator then is not allowed, and the job is ending anyway.
    int finalized = 1;
    if (comm_ != MPI_COMM_NULL && !aborted() && no_orphans() && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized)
      MPI_Comm_free(&comm_);
  }

  /// This process's rank in the communicator.
  int rank() const { return rank_; }
  /// Ranks in the communicator.
  int size() const { return size_; }
  /// The private MPI communicator underneath.
  MPI_Comm native() const { return comm_; }
  /// The options it was constructed with.
  const Options& options() const { return opt_; }
  /// This process's rank in the job (the first communicator's Options::parent), the rank that
  /// abort notes and aborted_error name.
  int job_rank() const { return state_->rank; }

  /// Collective over this communicator (MPI_Comm_split): the ranks that pass the same `color`
  /// (>= 0) form one group, ordered by `key` (ties by rank). The new communicator shares this
  /// one's abort: an abort on either sends its note to every rank of the job, and every wait
  /// of either watches for notes from the whole job, so one failing rank ends every group.
  /// Colors are compared on every rank first (a negative one fails everywhere, and a rank that
  /// never joins fails the others after the timeout); MPI_Comm_split itself then cannot wait
  /// on a missing rank. Its options are this one's, with `parent` this communicator.
  /// @code
  ///   po::comm::Mpi job;                             // dp * d processes, g = job.rank()
  ///   po::comm::Mpi pipe = job.split(g / d, g % d);  // the d ranks of replica g / d
  ///   po::comm::Mpi reps = job.split(g % d, g / d);  // the dp ranks of pipeline rank g % d
  /// @endcode
  Mpi split(int color, int key) {
    const long long mine[2] = {color, key};
    std::vector<long long> all(2 * static_cast<std::size_t>(size_));
    all_gather(std::span<const long long>(mine), std::span(all));
    for (int r = 0; r < size_; ++r)
      if (all[2 * static_cast<std::size_t>(r)] < 0)
        throw comm_error("comm::Mpi::split: rank " + std::to_string(r) +
                         " passed color = " + std::to_string(all[2 * static_cast<std::size_t>(r)]) +
                         ", outside the allowed range [0, " + std::to_string(INT_MAX) + "]");
    MPI_Comm comm = MPI_COMM_NULL;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Comm_split(comm_, color, key, &comm));
    Options opt = opt_;
    opt.parent = comm_;
    return Mpi(opt, comm, state_);
  }

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
    wait(req, std::move(buf), nullptr, [&] { return "send to " + name(peer) + " of " + describe(tag); }, peer);
  }

  /// Blocks until the next message from `peer` arrives; it must carry `tag` and fit `out`.
  template <class Context>
  void recv(const Context&, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    throw_if_aborted();
    const auto start = std::chrono::steady_clock::now();
    detail::Backoff backoff(opt_.poll_sleep_max_us);
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Status st{};
    for (;;) {
      int found = 0;
      PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Improbe(peer, data_tag, comm_, &found, &msg, &st));
      if (found) break;
      poll_notes();
      throw_if_aborted();
      if (elapsed(start) > opt_.timeout_seconds)
        throw comm_error(timed_out("recv from " + name(peer) + " of " + describe(tag), peer, start));
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
    agree(Op::all_gather, n, sizeof(T));
    const std::size_t block = n * sizeof(T);
    if (block > static_cast<std::size_t>(INT_MAX))
      throw comm_error("comm::Mpi::all_gather: " + std::to_string(n) + " values are too many for one call");
    auto values = std::make_unique<std::vector<std::byte>>((d + 1) * block);
    if (n > 0) std::memcpy(values->data(), mine.data(), block);
    gather_owned(std::move(values), block, MPI_BYTE, static_cast<int>(block));
    if (n > 0) std::memcpy(all.data(), last_gather_.data() + block, d * block);
  }

  /// all_gather of bytes in the backend's memory, from a stream whose context is given: the
  /// calling thread waits, so the context is ignored (comm/communicator.hpp).
  template <class Context>
  void all_gather(const Context&, std::span<const std::byte> mine, std::span<std::byte> all) {
    all_gather<std::byte>(mine, all);
    traffic_.all_gather(mine.size(), size_);
  }

  /// Block i of `in` goes to rank i, block j of `out` comes from rank j (block = in.size() /
  /// size()): MPI_Ialltoall of bytes, waited for as every other call. Every rank passes the
  /// same size; another size on any rank fails on every rank.
  template <class Context>
  void all_to_all(const Context&, std::span<const std::byte> in, std::span<std::byte> out) {
    const std::size_t n = in.size(), d = static_cast<std::size_t>(size_);
    if (out.size() != n)
      throw comm_error("comm::Mpi::all_to_all: out holds " + std::to_string(out.size()) +
                       " bytes; it must hold as many as in (" + std::to_string(n) + ")");
    if (n % d != 0)
      throw comm_error("comm::Mpi::all_to_all: in holds " + std::to_string(n) +
                       " bytes; it must hold size() * block bytes, a multiple of size() = " + std::to_string(d));
    throw_if_aborted();
    agree(Op::all_to_all, n, 1);
    const std::size_t block = n / d;
    if (block > static_cast<std::size_t>(INT_MAX))
      throw comm_error("comm::Mpi::all_to_all: blocks of " + std::to_string(block) +
                       " bytes are too large for one call; the limit is " + std::to_string(INT_MAX));
    if (n == 0) return;
    // Owned here, as every buffer of a request: `in` first, the result after it.
    auto buf = std::make_unique<std::vector<std::byte>>(2 * n);
    std::memcpy(buf->data(), in.data(), n);
    std::byte* base = buf->data();
    MPI_Request req = MPI_REQUEST_NULL;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Ialltoall(base, static_cast<int>(block), MPI_BYTE, base + n,
                                               static_cast<int>(block), MPI_BYTE, comm_, &req));
    std::vector<std::byte> got;
    wait(req, std::move(buf), &got, [] { return std::string("all_to_all"); }, -1);
    std::memcpy(out.data(), got.data() + n, n);
    traffic_.all_to_all(n, size_);
  }

  /// Bytes this rank sent in its device collectives since construction or reset_traffic()
  /// (comm/communicator.hpp's Traffic): a snapshot any thread may take.
  Traffic traffic() const { return traffic_.load(); }
  /// Starts the count again from zero (between steps, with no collective in progress).
  void reset_traffic() { traffic_.reset(); }

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
    wait(req, std::move(buf), &got, [&] { return "broadcast from " + name(root); }, root);
    std::copy(got.begin(), got.end(), data.begin());
  }

  /// Stops every rank of the job: local waits (of this communicator and of every one that
  /// shares its abort) throw aborted_error now, and every other rank of the job gets a note
  /// that makes its waits throw aborted_error naming this rank's job rank. The first abort
  /// wins; never throws.
  void abort(const std::string& why) noexcept {
    try {
      detail::MpiAbort& s = *state_;
      {
        std::lock_guard lk(s.mu);
        if (s.aborted) return;
        s.aborted = true;
        s.origin = s.rank;
        s.reason = why;
        s.note = std::make_unique<std::string>(why.substr(0, 4000));  // must outlive the requests
      }
      for (int p = 0; p < s.size; ++p) {
        if (p == s.rank) continue;
        MPI_Request req = MPI_REQUEST_NULL;
        if (MPI_Isend(s.note->data(), static_cast<int>(s.note->size()), MPI_CHAR, p, abort_tag, s.notes, &req) ==
            MPI_SUCCESS)
          MPI_Request_free(&req);
      }
    } catch (...) {
      // Out of memory while aborting: the local state is set, which is what matters most.
    }
  }

  /// The job rank whose failure aborted this communicator: this process's for a local abort()
  /// (on this communicator or one sharing its abort), the sender of the note otherwise, -1
  /// while nothing failed.
  int abort_origin() const {
    std::lock_guard lk(state_->mu);
    return state_->aborted ? state_->origin : -1;
  }
  /// Has this communicator (or one sharing its abort) been aborted, here or by a note?
  bool aborted() const {
    std::lock_guard lk(state_->mu);
    return state_->aborted;
  }

  /// Looks for an abort note from any rank of the job without blocking (waits do this
  /// themselves).
  void poll_notes() {
    detail::MpiAbort& s = *state_;
    int found = 0;
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Status st{};
    if (MPI_Improbe(MPI_ANY_SOURCE, abort_tag, s.notes, &found, &msg, &st) != MPI_SUCCESS || !found) return;
    int len = 0;
    MPI_Get_count(&st, MPI_CHAR, &len);
    std::string text(static_cast<std::size_t>(std::max(len, 0)), '\0');
    MPI_Mrecv(text.data(), len, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
    std::lock_guard lk(s.mu);
    if (s.aborted) return;
    s.aborted = true;
    s.origin = st.MPI_SOURCE;
    s.reason = "rank " + std::to_string(st.MPI_SOURCE) + " failed: " + text;
  }

 private:
  static constexpr int data_tag = 1, abort_tag = 2;
  struct Header {
    std::int32_t stage, mb, dir, pad;
    std::uint64_t count;
  };
  enum class Op : long long { all_gather = 1, all_to_all = 2 };

  /// A communicator split from another (see split), sharing its abort state.
  Mpi(Options opt, MPI_Comm comm, std::shared_ptr<detail::MpiAbort> state) : opt_(opt) {
    adopt(comm, std::move(state));
  }

  /// Takes ownership of `comm` (freed by the destructor), with `state`'s abort.
  void adopt(MPI_Comm comm, std::shared_ptr<detail::MpiAbort> state) {
    comm_ = comm;
    state_ = std::move(state);
    PIPEOFFLOAD_MPI_CHECK(state_->rank, MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    PIPEOFFLOAD_MPI_CHECK(state_->rank, MPI_Comm_rank(comm_, &rank_));
    PIPEOFFLOAD_MPI_CHECK(state_->rank, MPI_Comm_size(comm_, &size_));
    // The job rank of every rank of this group, for messages; none where they are the same.
    MPI_Group mine = MPI_GROUP_NULL, job = MPI_GROUP_NULL;
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Comm_group(comm_, &mine));
    PIPEOFFLOAD_MPI_CHECK(rank_, MPI_Comm_group(state_->notes, &job));
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[static_cast<std::size_t>(r)] = r;
    job_rank_.assign(ranks.size(), MPI_UNDEFINED);
    const int rc = MPI_Group_translate_ranks(mine, size_, ranks.data(), job, job_rank_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&job);
    PIPEOFFLOAD_MPI_CHECK(rank_, rc);
    if (size_ == state_->size && job_rank_ == ranks) job_rank_.clear();
  }

  /// "rank r", with its job rank where this group is not the job.
  std::string name(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (!job_rank_.empty() && r >= 0 && r < size_)
      s += " (job rank " + std::to_string(job_rank_[static_cast<std::size_t>(r)]) + ")";
    return s;
  }

  static double elapsed(std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  }

  std::string timed_out(const std::string& op, int peer, std::chrono::steady_clock::time_point since) const {
    char secs[32], limit[32];
    std::snprintf(secs, sizeof secs, "%.1f", elapsed(since));
    std::snprintf(limit, sizeof limit, "%g", opt_.timeout_seconds);
    // The peer named is the one this op waits for; it may itself be waiting on a lost rank.
    const std::string me = job_rank_.empty() ? "rank " + std::to_string(rank_) + " (" + detail::mpi_host() + ")"
                                             : "rank " + std::to_string(rank_) + " (job rank " +
                                                   std::to_string(state_->rank) + ", " + detail::mpi_host() + ")";
    return "comm::Mpi: " + me + " has waited " + secs + " s in " + op + " (timeout " + limit + " s); " +
           (peer >= 0 ? name(peer) + " has not answered: it is lost, stuck, or waiting itself"
                      : std::string("some rank has not joined: it is lost, stuck, or waiting itself"));
  }

  void throw_if_aborted() {
    std::lock_guard lk(state_->mu);
    if (state_->aborted) throw aborted_error("aborted: " + state_->reason);
  }

  bool no_orphans() const {
    if (!state_) return true;
    std::lock_guard lk(state_->mu);
    return state_->orphans.empty();
  }

  /// Waits for `req`, watching for abort notes and the timeout. `buf` is what the request
  /// reads or writes: on failure it is kept (the state's orphans) because the request still
  /// uses it.
  template <class What>
  void wait(MPI_Request& req, std::unique_ptr<std::vector<std::byte>> buf, std::vector<std::byte>* into, What what,
            int peer) {
    const auto start = std::chrono::steady_clock::now();
    detail::Backoff backoff(opt_.poll_sleep_max_us);
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
    std::lock_guard lk(state_->mu);
    state_->orphans.push_back(std::move(buf));
  }

  static const char* op_name(long long op) {
    return op == static_cast<long long>(Op::all_gather)   ? "all_gather"
           : op == static_cast<long long>(Op::all_to_all) ? "all_to_all"
                                                          : "an unknown collective";
  }

  /// The first round of a collective: every rank's {op, count, value bytes}, so that ranks that
  /// disagree all throw comm_error naming rank 0 and one that differs, instead of an MPI
  /// truncation on some or a hang.
  void agree(Op op, std::size_t count, std::size_t value_bytes) {
    const std::size_t d = static_cast<std::size_t>(size_);
    const long long mine[3] = {static_cast<long long>(op), static_cast<long long>(count),
                               static_cast<long long>(value_bytes)};
    // Owned here: a request cut short must not point into the caller's memory.
    auto buf = std::make_unique<std::vector<std::byte>>((d + 1) * sizeof mine);
    std::memcpy(buf->data(), mine, sizeof mine);
    gather_owned(std::move(buf), sizeof mine, MPI_LONG_LONG, 3);
    const long long* c = reinterpret_cast<const long long*>(last_gather_.data() + sizeof mine);  // [rank * 3 + i]
    for (std::size_t r = 1; r < d; ++r) {
      const long long* o = c + 3 * r;
      const std::string ranks = " (rank 0: ", rank_r = ", rank " + std::to_string(r) + ": ";
      if (o[0] != c[0])
        throw comm_error(std::string("comm::Mpi: ranks called different collectives at once") + ranks + op_name(c[0]) +
                         rank_r + op_name(o[0]) + ")");
      const std::string who = std::string("comm::Mpi::") + op_name(c[0]) + ": ";
      if (o[1] != c[1] && op == Op::all_to_all)
        throw comm_error(who + "ranks passed buffers of different sizes" + ranks + std::to_string(c[1]) + " bytes" +
                         rank_r + std::to_string(o[1]) + " bytes)");
      if (o[1] != c[1])
        throw comm_error(who + "ranks contributed different counts" + ranks + std::to_string(c[1]) + rank_r +
                         std::to_string(o[1]) + ")");
      if (o[2] != c[2])
        throw comm_error(who + "ranks contributed values of different sizes" + ranks + std::to_string(c[2]) + " bytes" +
                         rank_r + std::to_string(o[2]) + " bytes)");
    }
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
  MPI_Comm comm_ = MPI_COMM_NULL;  // owned: a duplicate of the parent, or a split
  int rank_ = 0, size_ = 1;
  std::vector<int> job_rank_;                // [rank]: its job rank; empty where the same
  std::shared_ptr<detail::MpiAbort> state_;  // shared with every split of the same job
  std::vector<std::byte> last_gather_;       // result of the last all_gather round (host thread only)
  pipeoffload::detail::TrafficCounter traffic_;
};

static_assert(communicator<Mpi, backend::CpuContext>, "comm::Mpi must model the communicator concept.");
static_assert(replica_communicator<Mpi, backend::CpuContext>, "comm::Mpi must model the replica_communicator concept.");

}  // namespace pipeoffload::comm
