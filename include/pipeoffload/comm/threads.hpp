// pipeoffload/comm/threads.hpp: comm::Threads, ranks that are threads of one process, and
// comm::ThreadsGrid, dp replicas of a d-rank pipeline as threads. Sends are rendezvous (the
// strictest semantics of docs/schedules.md, "Communicator semantics"); every call blocks the
// calling thread. BasicThreads<Transport> holds the matching, tags, size checks, rendezvous and
// abort once for comm::Threads (host copies) and comm::SharedDevice (docs/shared_device.md).
/// @file
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/cpu/context.hpp"
#include "communicator.hpp"

namespace pipeoffload::comm {

class ThreadsWorld;
class ThreadsGrid;
template <class Transport>
class BasicThreads;

namespace detail {

/// A posted send: the tag, the sender's bytes, and two opaque words its transport uses (a
/// device transport's events); `taken` once the receiver has taken it.
struct ThreadsMessage {
  Tag tag;
  const std::byte* data = nullptr;
  std::size_t count = 0;
  bool taken = false;
  std::uintptr_t transport[2] = {0, 0};
};

/// comm::Threads' transport: the receiving thread copies host bytes; nothing to order.
struct HostCopy {
  static constexpr bool device_memory = false;  ///< the collectives copy through the world's host buffer
  template <class Context>
  void offer(const Context&, ThreadsMessage&) {}
  template <class Context>
  void take(const Context&, std::span<std::byte> out, ThreadsMessage& m) {
    if (!out.empty()) std::memcpy(out.data(), m.data, out.size());
  }
  template <class Context>
  void taken(const Context&, ThreadsMessage&) {}
};

/// The abort shared by the worlds of one job: the first reason wins (written once under `mu`,
/// before `aborted` is set, and never again, so a reader that saw `aborted` may read it).
struct ThreadsAbort {
  std::mutex mu;
  std::atomic<bool> aborted{false};
  std::string reason = std::string(256, '\0');  // capacity for an abort when memory is out (cleared below)
  std::vector<ThreadsWorld*> worlds;            // the worlds to wake; fixed before any rank runs
  ThreadsAbort() { reason.clear(); }
};

}  // namespace detail

/// The shared state of `size` thread ranks: one FIFO channel per ordered pair of ranks.
class ThreadsWorld {
 public:
  /// A world of `size` ranks with an abort of its own.
  explicit ThreadsWorld(int size) : ThreadsWorld(size, std::make_shared<detail::ThreadsAbort>()) {}
  ThreadsWorld(const ThreadsWorld&) = delete;
  ThreadsWorld& operator=(const ThreadsWorld&) = delete;
  /// Ranks in the world.
  int size() const { return size_; }

  /// Aborts every rank of every world that shares this world's abort (first reason wins).
  void abort(const std::string& why) {
    {
      std::lock_guard lk(abort_->mu);
      if (abort_->aborted.load()) return;
      try {
        abort_->reason = why;
      } catch (...) {  // out of memory: as much of it as the reserved capacity holds, no allocation
        abort_->reason.assign(why, 0, std::min(why.size(), abort_->reason.capacity()));
      }
      abort_->aborted.store(true);
    }
    for (ThreadsWorld* w : abort_->worlds) w->wake_all();
  }
  /// Has the world (or one sharing its abort) been aborted?
  bool aborted() const { return abort_->aborted.load(); }

 private:
  template <class>
  friend class BasicThreads;
  friend class ThreadsGrid;

  ThreadsWorld(int size, std::shared_ptr<detail::ThreadsAbort> shared) : size_(size), abort_(std::move(shared)) {
    if (size < 1 || size > 4096)
      throw comm_error("comm::ThreadsWorld: size = " + std::to_string(size) +
                       " is outside the allowed range [1, 4096]");
    channels_ = std::make_unique<Channel[]>(static_cast<std::size_t>(size) * static_cast<std::size_t>(size));
    gathered_.resize(static_cast<std::size_t>(size));
    abort_->worlds.push_back(this);
  }

  using Message = detail::ThreadsMessage;
  // One per ordered pair of ranks, with its own condition variable: a message wakes its
  // receiver (and a receipt its sender) and no other rank's comm thread.
  struct Channel {
    std::deque<Message*> queue;  // FIFO of posted sends
    std::condition_variable cv;
  };
  Channel& channel(int from, int to) {
    return channels_[static_cast<std::size_t>(from) * static_cast<std::size_t>(size_) + static_cast<std::size_t>(to)];
  }
  [[noreturn]] void throw_aborted() const { throw aborted_error("aborted: " + abort_->reason); }
  // Taking the lock orders this wake after any waiter's check of the flag: a waiter either
  // sleeps already (and is woken) or checks after the flag was set.
  void wake_all() {
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < static_cast<std::size_t>(size_) * static_cast<std::size_t>(size_); ++i)
      channels_[i].cv.notify_all();
    cv_.notify_all();
  }

  int size_;
  std::shared_ptr<detail::ThreadsAbort> abort_;
  mutable std::mutex mu_;
  std::condition_variable cv_;           // collective rounds
  std::unique_ptr<Channel[]> channels_;  // [from * size + to]
  // Collectives (all_gather, all_to_all): contributions of the round in progress, and the
  // published result of the last round (a rank can only enter round k+1 after every rank has
  // left round k's wait, because round k+1 completes only when all have arrived).
  enum class Op { all_gather, all_to_all };
  struct Contribution {
    std::vector<std::byte> bytes;
    std::size_t count = 0, value_bytes = 0;  // elements of T, and sizeof(T)
    Op op = Op::all_gather;
  };
  std::vector<Contribution> gathered_;
  std::vector<std::byte> published_;  // every rank's bytes, in rank order
  int arrived_ = 0;
  unsigned long long round_ = 0;
  // Ranks of a device transport's collective between a round and the end of the stream work
  // they enqueue on the other ranks' events and memory (BasicThreads::gather_to_enqueue).
  int enqueuing_ = 0;
};

/// One rank's handle on a ThreadsWorld, moving bytes with `Transport` (the file comment):
/// comm::Threads is BasicThreads<detail::HostCopy>.
template <class Transport>
class BasicThreads {
 public:
  /// Rank `rank` (0 .. world.size()-1) of `world`, which must outlive the handle.
  BasicThreads(ThreadsWorld& world, int rank, Transport t = {}) : w_(&world), rank_(rank), t_(std::move(t)) {
    if (rank < 0 || rank >= world.size())
      throw comm_error("comm::Threads: rank = " + std::to_string(rank) + " is outside the allowed range [0, " +
                       std::to_string(world.size() - 1) + "]");
  }
  /// The rank of `host` (a ThreadsGrid's handle, say) in its world, with transport `t`.
  template <class Other>
  BasicThreads(const BasicThreads<Other>& host, Transport t) : BasicThreads(*host.w_, host.rank_, std::move(t)) {}
  BasicThreads(const BasicThreads&) = default;             ///< another handle on the same rank
  BasicThreads& operator=(const BasicThreads&) = default;  ///< another handle on the same rank
  BasicThreads(BasicThreads&&) = default;                  ///< takes `o`'s transport
  BasicThreads& operator=(BasicThreads&&) = default;       ///< takes `o`'s transport
  /// With a device transport, first waits until no rank of the world is still enqueuing stream
  /// work on this rank's events and memory (gather_to_enqueue): then the transport destroys its
  /// events, and the backend, declared before the handle, frees its memory after it. A bounded
  /// wait (the work between a round and its end only enqueues), whatever the other ranks do next
  /// and whether or not the world was aborted; a rank that never started holds no one up.
  ~BasicThreads() {
    if constexpr (Transport::device_memory) {
      std::unique_lock lk(w_->mu_);
      w_->cv_.wait(lk, [&] { return w_->enqueuing_ == 0; });
    }
  }
  /// This handle's rank.
  int rank() const { return rank_; }
  /// Ranks in the world.
  int size() const { return w_->size(); }

  /// Blocks until `peer` has taken the message (rendezvous). The transport gets the context
  /// (HostCopy ignores it: the receiving thread copies).
  template <class Context>
  void send(const Context& ctx, int peer, Tag tag, std::span<const std::byte> data) {
    check_peer(peer, "send to");
    ThreadsWorld::Message msg{tag, data.data(), data.size(), false};
    t_.offer(ctx, msg);
    ThreadsWorld::Channel& ch = w_->channel(rank_, peer);
    std::unique_lock lk(w_->mu_);
    if (w_->aborted()) w_->throw_aborted();
    ch.queue.push_back(&msg);
    ch.cv.notify_all();
    ch.cv.wait(lk, [&] { return msg.taken || w_->aborted(); });
    if (!msg.taken) {
      // Aborted: withdraw the message, its storage is about to go away.
      for (auto it = ch.queue.begin(); it != ch.queue.end(); ++it)
        if (*it == &msg) {
          ch.queue.erase(it);
          break;
        }
      w_->throw_aborted();
    }
    lk.unlock();
    t_.taken(ctx, msg);
  }

  /// Blocks until the next message from `peer` arrives; it must carry `tag` and fit `out`.
  template <class Context>
  void recv(const Context& ctx, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    std::unique_lock lk(w_->mu_);
    ThreadsWorld::Channel& ch = w_->channel(peer, rank_);
    ch.cv.wait(lk, [&] { return !ch.queue.empty() || w_->aborted(); });
    if (w_->aborted()) w_->throw_aborted();
    ThreadsWorld::Message* msg = ch.queue.front();
    if (!(msg->tag == tag) || msg->count != out.size()) {
      const std::string what = "comm::Threads: rank " + std::to_string(rank_) + " expected " + describe(tag) + " of " +
                               std::to_string(out.size()) + " bytes from rank " + std::to_string(peer) +
                               " but received " + describe(msg->tag) + " of " + std::to_string(msg->count) + " bytes";
      lk.unlock();
      throw comm_error(what);
    }
    t_.take(ctx, out, *msg);
    msg->taken = true;
    ch.queue.pop_front();
    lk.unlock();  // the sender re-takes the lock as it wakes
    ch.cv.notify_all();
  }

  /// Every rank contributes mine.size() values of T; `all` receives them in rank order.
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    gather(mine, all, nullptr);
  }

  /// Counts its rank as enqueuing stream work on the other ranks' events and memory until it
  /// goes (gather_to_enqueue); the handles' destructors wait for none to be.
  class Enqueuing {
   public:
    Enqueuing() = default;
    Enqueuing(const Enqueuing&) = delete;
    Enqueuing& operator=(const Enqueuing&) = delete;
    /// Takes `o`'s count (o counts nothing).
    Enqueuing(Enqueuing&& o) noexcept : w_(std::exchange(o.w_, nullptr)) {}
    Enqueuing& operator=(Enqueuing&&) = delete;
    ~Enqueuing() {
      if (w_ == nullptr) return;
      std::lock_guard lk(w_->mu_);
      if (--w_->enqueuing_ == 0) w_->cv_.notify_all();
    }

   private:
    friend class BasicThreads;
    ThreadsWorld* w_ = nullptr;
  };

  /// all_gather for a device transport's collective (DeviceCopy::collective), whose ranks then
  /// enqueue waits on the events and copies from the memory the round told them of: every rank
  /// of the round counts as enqueuing from the moment the round completes until its returned
  /// Enqueuing goes, so that no rank destroys those events or frees that memory meanwhile
  /// (~BasicThreads), on the abort path too.
  template <class T>
  [[nodiscard]] Enqueuing gather_to_enqueue(std::span<const T> mine, std::span<T> all) {
    Enqueuing counted;  // before gather's lock: released after it, should anything throw
    gather(mine, all, &counted);
    return counted;
  }

  /// all_gather of bytes in the backend's memory, from a stream whose context is given
  /// (HostCopy: the calling thread copies, so the context is ignored; comm/communicator.hpp).
  template <class Context>
  void all_gather(const Context& ctx, std::span<const std::byte> mine, std::span<std::byte> all) {
    if constexpr (Transport::device_memory) {
      const std::size_t n = mine.size();
      if (all.size() != n * static_cast<std::size_t>(size()))
        throw comm_error("comm::Threads::all_gather: the output holds " + std::to_string(all.size()) +
                         " bytes; it must hold size() * mine.size() = " + std::to_string(n * size()));
      t_.collective(ctx, *this, "all_gather", mine, [&](int j, const std::byte* theirs) {
        return std::pair{all.data() + static_cast<std::size_t>(j) * n, std::span<const std::byte>(theirs, n)};
      });
    } else {
      all_gather<std::byte>(mine, all);
    }
    traffic_.all_gather(mine.size(), size());
  }

  /// Block i of `in` goes to rank i, block j of `out` comes from rank j (block = in.size() /
  /// size()). Every rank passes the same size; another size on any rank fails on every rank.
  template <class Context>
  void all_to_all(const Context& ctx, std::span<const std::byte> in, std::span<std::byte> out) {
    const std::size_t n = in.size(), d = static_cast<std::size_t>(size());
    check_all_to_all("comm::Threads::all_to_all", n, out.size(), d);
    const std::size_t block = n / d;
    if constexpr (Transport::device_memory) {
      t_.collective(ctx, *this, "all_to_all", in, [&](int j, const std::byte* theirs) {
        return std::pair{out.data() + static_cast<std::size_t>(j) * block,
                         std::span<const std::byte>(theirs + static_cast<std::size_t>(rank_) * block, block)};
      });
      traffic_.all_to_all(n, size());
      return;
    }
    std::unique_lock lk(w_->mu_);
    join_round(lk, ThreadsWorld::Op::all_to_all, in, n, 1);
    // published_ holds every rank's `in`: block j of out is block rank() of rank j's.
    for (std::size_t j = 0; j < d && block > 0; ++j)
      std::memcpy(out.data() + j * block, w_->published_.data() + j * n + static_cast<std::size_t>(rank_) * block,
                  block);
    traffic_.all_to_all(n, size());
  }

  /// Bytes this handle sent in its device collectives since construction or reset_traffic()
  /// (comm/communicator.hpp's Traffic): a snapshot any thread may take.
  Traffic traffic() const { return traffic_.load(); }
  /// Starts the count again from zero (between steps, with no collective in progress).
  void reset_traffic() { traffic_.reset(); }

  /// Aborts the world (ThreadsWorld::abort): every blocking call of every rank throws.
  void abort(const std::string& why) { w_->abort(why); }

  /// The transport (a device transport's streams and events).
  Transport& transport() { return t_; }

 private:
  template <class>
  friend class BasicThreads;

  /// all_gather; with `counted`, every rank of the round counts as enqueuing once it completes
  /// and `counted` holds this rank's count (gather_to_enqueue).
  template <class T>
  void gather(std::span<const T> mine, std::span<T> all, Enqueuing* counted) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "comm::Threads::all_gather: T must be trivially copyable; values travel as bytes.");
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size());
    if (all.size() != n * d)
      throw comm_error("comm::Threads::all_gather: the output holds " + std::to_string(all.size()) +
                       " values; it must hold size() * mine.size() = " + std::to_string(n * d));
    std::unique_lock lk(w_->mu_);
    join_round(lk, ThreadsWorld::Op::all_gather, std::as_bytes(mine), n, sizeof(T), counted != nullptr);
    if (counted != nullptr) counted->w_ = w_;
    if (!all.empty()) std::memcpy(all.data(), w_->published_.data(), all.size_bytes());
  }

  static const char* op_name(ThreadsWorld::Op op) {
    return op == ThreadsWorld::Op::all_gather ? "all_gather" : "all_to_all";
  }

  /// Joins the world's collective round with `bytes` (`count` values of `value_bytes` each) and
  /// returns, with the lock held, once every rank has joined and published_ holds every rank's
  /// bytes in rank order (`enqueue_after`: every rank of the round then counts as enqueuing). Ranks that joined with another op, count or value size all fail: the
  /// last to arrive throws comm_error naming rank 0 and one that differs, and aborts the others
  /// with that text (after releasing the lock: the abort takes each world's lock in turn).
  void join_round(std::unique_lock<std::mutex>& lk, ThreadsWorld::Op op, std::span<const std::byte> bytes,
                  std::size_t count, std::size_t value_bytes, bool enqueue_after = false) {
    if (w_->aborted()) w_->throw_aborted();
    ThreadsWorld::Contribution& own = w_->gathered_[static_cast<std::size_t>(rank_)];
    own.bytes.assign(bytes.begin(), bytes.end());
    own.count = count;
    own.value_bytes = value_bytes;
    own.op = op;
    const unsigned long long round = w_->round_;
    if (++w_->arrived_ == size()) {
      const std::string what = mismatch();
      if (!what.empty()) {
        // The round never completes: its waiters wake to the abort instead of a result.
        lk.unlock();
        w_->abort(what);
        throw comm_error(what);
      }
      w_->published_.clear();
      for (const ThreadsWorld::Contribution& g : w_->gathered_)
        w_->published_.insert(w_->published_.end(), g.bytes.begin(), g.bytes.end());
      w_->arrived_ = 0;
      if (enqueue_after) w_->enqueuing_ += size();  // every rank of the round, until its Enqueuing goes
      ++w_->round_;
      w_->cv_.notify_all();
    } else {
      w_->cv_.wait(lk, [&] { return w_->round_ != round || w_->aborted(); });
      if (w_->round_ == round) w_->throw_aborted();
    }
  }

  /// "" when every contribution of the round agrees with rank 0's, else the error's text.
  std::string mismatch() const {
    const std::vector<ThreadsWorld::Contribution>& g = w_->gathered_;
    for (std::size_t r = 1; r < g.size(); ++r) {
      const std::string ranks0 = "(rank 0: ", rank_r = ", rank " + std::to_string(r) + ": ";
      if (g[r].op != g[0].op)
        return std::string("comm::Threads: ranks called different collectives at once ") + ranks0 + op_name(g[0].op) +
               rank_r + op_name(g[r].op) + ")";
      const std::string who = std::string("comm::Threads::") + op_name(g[0].op) + ": ";
      if (g[0].op == ThreadsWorld::Op::all_to_all && g[r].count != g[0].count)
        return who + "ranks passed buffers of different sizes " + ranks0 + std::to_string(g[0].count) + " bytes" +
               rank_r + std::to_string(g[r].count) + " bytes)";
      if (g[r].count != g[0].count)
        return who + "ranks contributed different counts " + ranks0 + std::to_string(g[0].count) + rank_r +
               std::to_string(g[r].count) + ")";
      if (g[r].value_bytes != g[0].value_bytes)
        return who + "ranks contributed values of different sizes " + ranks0 + std::to_string(g[0].value_bytes) +
               " bytes" + rank_r + std::to_string(g[r].value_bytes) + " bytes)";
    }
    return "";
  }

  static void check_all_to_all(const char* who, std::size_t in, std::size_t out, std::size_t d) {
    if (out != in)
      throw comm_error(std::string(who) + ": out holds " + std::to_string(out) +
                       " bytes; it must hold as many as in (" + std::to_string(in) + ")");
    if (in % d != 0)
      throw comm_error(std::string(who) + ": in holds " + std::to_string(in) +
                       " bytes; it must hold size() * block bytes, a multiple of size() = " + std::to_string(d));
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw comm_error("comm::Threads: rank " + std::to_string(rank_) + " cannot " + what + " rank " +
                       std::to_string(peer) + "; peers are the other ranks of 0.." + std::to_string(size() - 1));
  }

  ThreadsWorld* w_;
  int rank_;
  Transport t_;
  pipeoffload::detail::TrafficCounter traffic_;
};

/// Ranks that are threads of one process, copying host memory (the file comment).
using Threads = BasicThreads<detail::HostCopy>;

/// dp replicas of a d-rank pipeline as thread ranks, dp * d in all: global rank
/// g = replica * d + rank (replica-major). Rank g is pipeline rank g % d of replica g / d; its
/// pipeline group is the d ranks of its replica, its data-parallel ("replicas") group the dp
/// ranks with the same pipeline rank, in which it is rank g / d. One ThreadsWorld per replica
/// and one per pipeline rank, sharing one abort: an abort on any communicator of any rank
/// ends every blocking call of both groups on every rank (first reason wins).
/// @code
///   po::comm::ThreadsGrid grid(2, 3);                       // 2 replicas of a 3-rank pipeline
///   po::run_thread_ranks(grid, [&](int g) {                 // g in [0, 6)
///     po::comm::Threads pipe = grid.pipeline(g);            // rank g % 3 of 3
///     po::comm::Threads reps = grid.replicas(g);            // rank g / 3 of 2
///     // ... a po::Runtime on pipe and reps
///   });
/// @endcode
class ThreadsGrid {
 public:
  /// dp replicas (1 .. 4096) of a d-rank pipeline (1 .. 4096), dp * d <= 4096 ranks in all.
  ThreadsGrid(int dp, int d) : dp_(dp), d_(d), abort_(std::make_shared<detail::ThreadsAbort>()) {
    if (dp < 1 || dp > 4096)
      throw comm_error("comm::ThreadsGrid: dp = " + std::to_string(dp) + " is outside the allowed range [1, 4096]");
    if (d < 1 || d > 4096)
      throw comm_error("comm::ThreadsGrid: d = " + std::to_string(d) + " is outside the allowed range [1, 4096]");
    if (static_cast<long long>(dp) * d > 4096)
      throw comm_error("comm::ThreadsGrid: dp * d = " + std::to_string(static_cast<long long>(dp) * d) +
                       " ranks is outside the allowed range [1, 4096]");
    for (int j = 0; j < dp; ++j) pipelines_.push_back(std::unique_ptr<ThreadsWorld>(new ThreadsWorld(d, abort_)));
    for (int r = 0; r < d; ++r) replicas_.push_back(std::unique_ptr<ThreadsWorld>(new ThreadsWorld(dp, abort_)));
  }
  ThreadsGrid(const ThreadsGrid&) = delete;
  ThreadsGrid& operator=(const ThreadsGrid&) = delete;

  /// Replicas.
  int dp() const { return dp_; }
  /// Ranks of one pipeline.
  int d() const { return d_; }
  /// Ranks in all, dp * d.
  int size() const { return dp_ * d_; }

  /// Global rank g's handle on its replica's pipeline: rank g % d of d.
  Threads pipeline(int global_rank) {
    check(global_rank, "pipeline");
    return Threads(*pipelines_[static_cast<std::size_t>(global_rank / d_)], global_rank % d_);
  }
  /// Global rank g's handle on its data-parallel group: rank g / d (its replica) of dp.
  Threads replicas(int global_rank) {
    check(global_rank, "replicas");
    return Threads(*replicas_[static_cast<std::size_t>(global_rank % d_)], global_rank / d_);
  }

  /// Aborts every rank of both groups (first reason wins); what a rank's abort on either of
  /// its communicators does too.
  void abort(const std::string& why) { pipelines_.front()->abort(why); }  // every world shares abort_
  /// Has the grid been aborted?
  bool aborted() const { return abort_->aborted.load(); }

 private:
  void check(int g, const char* group) const {
    if (g < 0 || g >= size())
      throw comm_error(std::string("comm::ThreadsGrid::") + group + ": global rank = " + std::to_string(g) +
                       " is outside the allowed range [0, " + std::to_string(size() - 1) + "]");
  }

  int dp_, d_;
  std::shared_ptr<detail::ThreadsAbort> abort_;
  std::vector<std::unique_ptr<ThreadsWorld>> pipelines_;  // [replica], size d each
  std::vector<std::unique_ptr<ThreadsWorld>> replicas_;   // [pipeline rank], size dp each
};

static_assert(communicator<Threads, backend::CpuContext>, "comm::Threads must model the communicator concept.");
static_assert(replica_communicator<Threads, backend::CpuContext>,
              "comm::Threads must model the replica_communicator concept.");

}  // namespace pipeoffload::comm
