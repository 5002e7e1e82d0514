// pipeoffload/comm/threads.hpp: comm::Threads, ranks that are threads of one process.
//
// Sends are rendezvous: a send waits until its receiver has copied the data out, the
// strictest of the semantics in comm/communicator.hpp (NCCL's may do the same), so a schedule
// that runs here cannot deadlock on a GPU for want of buffering. Every call blocks the calling
// thread, so send and recv take any backend context and ignore it; all_gather copies bytes.
#pragma once

#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "../backend/cpu/context.hpp"
#include "communicator.hpp"

namespace pipeoffload::comm {

/// The shared state of `size` thread ranks: one FIFO channel per ordered pair of ranks.
class ThreadsWorld {
 public:
  explicit ThreadsWorld(int size) : size_(size) {
    if (size < 1 || size > 4096)
      throw comm_error("comm::ThreadsWorld: size = " + std::to_string(size) +
                       " is outside the allowed range [1, 4096]");
    channels_ = std::make_unique<Channel[]>(static_cast<std::size_t>(size) * static_cast<std::size_t>(size));
    gathered_.resize(static_cast<std::size_t>(size));
  }
  int size() const { return size_; }

  /// Aborts every rank (first reason wins).
  void abort(const std::string& why) {
    std::lock_guard lk(mu_);
    abort_locked(why);
  }
  bool aborted() const {
    std::lock_guard lk(mu_);
    return aborted_;
  }

 private:
  friend class Threads;
  struct Message {
    Tag tag;
    const std::byte* data = nullptr;
    std::size_t count = 0;
    bool taken = false;
  };
  // One per ordered pair of ranks, with its own condition variable: a message wakes its
  // receiver (and a receipt its sender) and no other rank's comm thread.
  struct Channel {
    std::deque<Message*> queue;  // FIFO of posted sends
    std::condition_variable cv;
  };
  Channel& channel(int from, int to) {
    return channels_[static_cast<std::size_t>(from) * static_cast<std::size_t>(size_) + static_cast<std::size_t>(to)];
  }
  [[noreturn]] void throw_aborted() const { throw aborted_error("aborted: " + reason_); }
  // Under the lock, so no waiter can miss it between its check and its sleep.
  void abort_locked(const std::string& why) {
    if (aborted_) return;
    aborted_ = true;
    reason_ = why;
    for (std::size_t i = 0; i < static_cast<std::size_t>(size_) * static_cast<std::size_t>(size_); ++i)
      channels_[i].cv.notify_all();
    cv_.notify_all();
  }

  int size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;           // all_gather rounds
  std::unique_ptr<Channel[]> channels_;  // [from * size + to]
  bool aborted_ = false;
  std::string reason_;
  // all_gather: contributions of the round in progress, and the published result of the last
  // round (a rank can only enter round k+1 after every rank has left round k's wait, because
  // round k+1 completes only when all have arrived).
  struct Contribution {
    std::vector<std::byte> bytes;
    std::size_t count = 0, value_bytes = 0;  // elements of T, and sizeof(T)
  };
  std::vector<Contribution> gathered_;
  std::vector<std::byte> published_;
  int arrived_ = 0;
  unsigned long long round_ = 0;
};

/// One rank's handle on a ThreadsWorld.
class Threads {
 public:
  Threads(ThreadsWorld& world, int rank) : w_(&world), rank_(rank) {
    if (rank < 0 || rank >= world.size())
      throw comm_error("comm::Threads: rank = " + std::to_string(rank) + " is outside the allowed range [0, " +
                       std::to_string(world.size() - 1) + "]");
  }
  int rank() const { return rank_; }
  int size() const { return w_->size(); }

  /// Blocks until `peer` has received the message (rendezvous). The context is not needed:
  /// the calling thread does the work.
  template <class Context>
  void send(const Context&, int peer, Tag tag, std::span<const std::byte> data) {
    check_peer(peer, "send to");
    ThreadsWorld::Message msg{tag, data.data(), data.size(), false};
    ThreadsWorld::Channel& ch = w_->channel(rank_, peer);
    std::unique_lock lk(w_->mu_);
    if (w_->aborted_) w_->throw_aborted();
    ch.queue.push_back(&msg);
    ch.cv.notify_all();
    ch.cv.wait(lk, [&] { return msg.taken || w_->aborted_; });
    if (!msg.taken) {
      // Aborted: withdraw the message, its storage is about to go away.
      for (auto it = ch.queue.begin(); it != ch.queue.end(); ++it)
        if (*it == &msg) {
          ch.queue.erase(it);
          break;
        }
      w_->throw_aborted();
    }
  }

  /// Blocks until the next message from `peer` arrives; it must carry `tag` and fit `out`.
  template <class Context>
  void recv(const Context&, int peer, Tag tag, std::span<std::byte> out) {
    check_peer(peer, "recv from");
    std::unique_lock lk(w_->mu_);
    ThreadsWorld::Channel& ch = w_->channel(peer, rank_);
    ch.cv.wait(lk, [&] { return !ch.queue.empty() || w_->aborted_; });
    if (w_->aborted_) w_->throw_aborted();
    ThreadsWorld::Message* msg = ch.queue.front();
    if (!(msg->tag == tag) || msg->count != out.size()) {
      const std::string what = "comm::Threads: rank " + std::to_string(rank_) + " expected " + describe(tag) + " of " +
                               std::to_string(out.size()) + " bytes from rank " + std::to_string(peer) +
                               " but received " + describe(msg->tag) + " of " + std::to_string(msg->count) + " bytes";
      lk.unlock();
      throw comm_error(what);
    }
    if (!out.empty()) std::memcpy(out.data(), msg->data, out.size());
    msg->taken = true;
    ch.queue.pop_front();
    lk.unlock();  // the sender re-takes the lock as it wakes
    ch.cv.notify_all();
  }

  /// Every rank contributes mine.size() values of T; `all` receives them in rank order.
  template <class T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    static_assert(std::is_trivially_copyable_v<T>,
                  "comm::Threads::all_gather: T must be trivially copyable; values travel as bytes.");
    const std::size_t n = mine.size(), d = static_cast<std::size_t>(size());
    if (all.size() != n * d)
      throw comm_error("comm::Threads::all_gather: the output holds " + std::to_string(all.size()) +
                       " values; it must hold size() * mine.size() = " + std::to_string(n * d));
    std::unique_lock lk(w_->mu_);
    if (w_->aborted_) w_->throw_aborted();
    ThreadsWorld::Contribution& own = w_->gathered_[static_cast<std::size_t>(rank_)];
    const std::span<const std::byte> bytes = std::as_bytes(mine);
    own.bytes.assign(bytes.begin(), bytes.end());
    own.count = n;
    own.value_bytes = sizeof(T);
    const unsigned long long round = w_->round_;
    if (++w_->arrived_ == size()) {
      w_->published_.clear();
      for (const ThreadsWorld::Contribution& g : w_->gathered_) {
        if (g.count != n || g.value_bytes != sizeof(T)) {
          const std::string what =
              g.count != n ? "comm::Threads::all_gather: ranks contributed different counts"
                           : "comm::Threads::all_gather: ranks contributed values of different sizes (" +
                                 std::to_string(g.value_bytes) + " and " + std::to_string(sizeof(T)) + " bytes)";
          // The round never completes: its waiters wake to the abort (set before the lock is
          // released, so none can take the partial result for a finished round).
          w_->abort_locked(what);
          throw comm_error(what);
        }
        w_->published_.insert(w_->published_.end(), g.bytes.begin(), g.bytes.end());
      }
      w_->arrived_ = 0;
      ++w_->round_;
      w_->cv_.notify_all();
    } else {
      w_->cv_.wait(lk, [&] { return w_->round_ != round || w_->aborted_; });
      if (w_->round_ == round) w_->throw_aborted();
    }
    if (!all.empty()) std::memcpy(all.data(), w_->published_.data(), all.size_bytes());
  }

  void abort(const std::string& why) { w_->abort(why); }

 private:
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw comm_error("comm::Threads: rank " + std::to_string(rank_) + " cannot " + what + " rank " +
                       std::to_string(peer) + "; peers are the other ranks of 0.." + std::to_string(size() - 1));
  }

  ThreadsWorld* w_;
  int rank_;
};

static_assert(communicator<Threads, backend::CpuContext>, "comm::Threads must model the communicator concept.");

}  // namespace pipeoffload::comm
