// pipeoffload/backend/cpu/cpu.hpp: backend::Cpu, the embedded default device.
//
// Each stream is a worker thread that runs its queue in order; events are completion counters
// the workers raise; device and pinned host memory are pooled arenas that count bytes in use
// and their peak. The copy engine can be given a bandwidth, so that a copy takes as long as a
// PCIe link would: that is how offload overlap is exercised without a GPU.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../error.hpp"
#include "../backend.hpp"
#include "context.hpp"

namespace pipeoffload {

/// A wait that was cut short because the device (or a peer) failed; what() names the failure.
struct aborted_error : error {
  using error::error;
};

namespace backend {

class Cpu {
 public:
  using Context = CpuContext;

  struct Options {
    int rank = 0;                        ///< for contexts and messages
    double copy_bytes_per_second = 0;    ///< transfer() pace; 0 = as fast as memcpy
  };

  Cpu() : Cpu(Options{}) {}
  explicit Cpu(Options opt) : opt_(opt) {}
  Cpu(const Cpu&) = delete;
  Cpu& operator=(const Cpu&) = delete;

  ~Cpu() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
      if (!failed_) {
        failed_ = true;  // drop what is left: nobody will wait for it
        error_ = "backend destroyed";
      }
    }
    cv_.notify_all();
    for (auto& s : streams_) s->worker.join();
    // The arena owns every block it handed out, including those a failed run never freed.
    for (std::byte* p : owned_) ::operator delete(p, std::align_val_t{64});
  }

  /// A new in-order stream with its own worker thread.
  int make_stream(std::string name) {
    std::lock_guard lk(mu_);
    auto s = std::make_unique<Stream>();
    s->name = std::move(name);
    const int id = static_cast<int>(streams_.size());
    Stream* raw = s.get();
    streams_.push_back(std::move(s));
    raw->worker = std::thread([this, raw] { run(*raw); });
    return id;
  }

  int make_event() {
    std::lock_guard lk(mu_);
    events_.emplace_back();
    return static_cast<int>(events_.size()) - 1;
  }

  void launch(int stream, std::function<void()> fn) {
    {
      std::lock_guard lk(mu_);
      at(stream).queue.push_back(std::move(fn));
    }
    cv_.notify_all();
  }

  void record(int event, int stream) {
    std::uint64_t target;
    {
      std::lock_guard lk(mu_);
      target = ++ev(event).recorded;
    }
    launch(stream, [this, event, target] {
      {
        std::lock_guard lk(mu_);
        ev(event).completed = std::max(ev(event).completed, target);
      }
      cv_.notify_all();
    });
  }

  void wait(int stream, int event) {
    std::uint64_t target;
    {
      std::lock_guard lk(mu_);
      target = ev(event).recorded;
    }
    if (target == 0) return;
    launch(stream, [this, event, target] {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return failed_ || ev(event).completed >= target; });
      if (ev(event).completed < target) throw aborted_error("aborted: " + error_);
    });
  }

  /// Host waits until every stream is idle; throws the first error if any stream failed.
  void synchronize() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] {
      for (const auto& s : streams_)
        if (s->running || !s->queue.empty()) return false;
      return true;
    });
    if (failed_) throw error(error_);
  }

  /// Fails the device: waits in progress and to come throw aborted_error naming `why`.
  void abort(std::string why) { fail(std::move(why)); }

  bool failed() const {
    std::lock_guard lk(mu_);
    return failed_;
  }

  void set_error_hook(std::function<void(const std::string&)> hook) {
    std::lock_guard lk(mu_);
    hook_ = std::move(hook);
  }

  Context context(int stream) { return Context{this, opt_.rank, stream}; }

  /// Seconds on a clock shared by every Cpu in the process (for traces).
  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

  // ---- memory ------------------------------------------------------------------------

  /// A device buffer of `bytes` (64-byte aligned). Pooled by exact size, so once a run has
  /// seen its largest working set the steady state takes no memory from the system. On this
  /// backend allocation and release happen when the stream's worker executes them, so a
  /// block is reused only after its last user has run (the guard a GPU arena needs events for).
  Block device_alloc(std::size_t bytes, Memory kind) {
    std::lock_guard lk(mem_mu_);
    const std::size_t size = round_up(bytes);
    std::byte* p = take(free_device_, size, stats_.device_allocations);
    auto& in = stats_.in_use[static_cast<std::size_t>(kind)];
    in += bytes;
    auto& pk = stats_.peak[static_cast<std::size_t>(kind)];
    pk = std::max(pk, in);
    device_total_ += bytes;
    stats_.total_peak = std::max(stats_.total_peak, device_total_);
    return Block{p, bytes, kind};
  }

  void device_free(Block b) {
    if (b.ptr == nullptr) return;
    std::lock_guard lk(mem_mu_);
    free_device_[round_up(b.bytes)].push_back(b.ptr);
    stats_.in_use[static_cast<std::size_t>(b.kind)] -= b.bytes;
    device_total_ -= b.bytes;
  }

  /// A pinned host buffer of exactly `bytes` (the offload layer asks for power-of-two bins).
  HostBlock host_alloc(std::size_t bytes) {
    std::lock_guard lk(mem_mu_);
    std::byte* p = take(free_host_, round_up(bytes), stats_.host_allocations);
    stats_.host_in_use += bytes;
    stats_.host_peak = std::max(stats_.host_peak, stats_.host_in_use);
    return HostBlock{p, bytes};
  }

  void host_free(HostBlock b) {
    if (b.ptr == nullptr) return;
    std::lock_guard lk(mem_mu_);
    free_host_[round_up(b.bytes)].push_back(b.ptr);
    stats_.host_in_use -= b.bytes;
  }

  MemoryStats memory() const {
    std::lock_guard lk(mem_mu_);
    return stats_;
  }

  /// Restarts every peak at the bytes in use now (allocation counts are kept).
  void reset_peaks() {
    std::lock_guard lk(mem_mu_);
    stats_.peak = stats_.in_use;
    stats_.total_peak = device_total_;
    stats_.host_peak = stats_.host_in_use;
  }

  /// Copies `pieces` in order, from inside work launched on a stream (the copy stream, for
  /// offload). With a bandwidth set, returns no earlier than bytes / bandwidth after it
  /// started, like a DMA engine would; an abort cuts the wait short.
  void transfer(std::span<const CopyPiece> pieces) {
    const auto start = std::chrono::steady_clock::now();
    std::size_t total = 0;
    for (const CopyPiece& c : pieces) {
      if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
      total += c.bytes;
    }
    if (opt_.copy_bytes_per_second > 0) {
      const auto due = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(static_cast<double>(total) / opt_.copy_bytes_per_second));
      std::unique_lock lk(mu_);
      cv_.wait_until(lk, due, [&] { return failed_; });
      if (failed_) throw aborted_error("aborted: " + error_);
    }
  }

  const Options& options() const { return opt_; }

 private:
  struct Stream {
    std::string name;
    std::deque<std::function<void()>> queue;
    bool running = false;
    std::thread worker;
  };
  struct Event {
    std::uint64_t recorded = 0;   // records enqueued so far
    std::uint64_t completed = 0;  // highest record a stream has reached
  };

  static std::size_t round_up(std::size_t n) { return (std::max<std::size_t>(n, 1) + 63) / 64 * 64; }

  std::byte* take(std::map<std::size_t, std::vector<std::byte*>>& pool, std::size_t size, long long& allocations) {
    auto& list = pool[size];
    if (!list.empty()) {
      std::byte* p = list.back();
      list.pop_back();
      return p;
    }
    ++allocations;
    owned_.reserve(owned_.size() + 1);  // so the push below cannot throw after the allocation
    auto* p = static_cast<std::byte*>(::operator new(size, std::align_val_t{64}));
    owned_.push_back(p);
    return p;
  }

  Stream& at(int s) {
    if (s < 0 || s >= static_cast<int>(streams_.size()))
      throw error("backend::Cpu: stream " + std::to_string(s) + " does not exist; streams are 0.." + std::to_string(streams_.size()) + " (exclusive)");
    return *streams_[static_cast<std::size_t>(s)];
  }
  Event& ev(int e) {
    if (e < 0 || e >= static_cast<int>(events_.size()))
      throw error("backend::Cpu: event " + std::to_string(e) + " does not exist; events are 0.." + std::to_string(events_.size()) + " (exclusive)");
    return events_[static_cast<std::size_t>(e)];
  }

  void fail(std::string why) {
    std::function<void(const std::string&)> hook;
    {
      std::lock_guard lk(mu_);
      if (failed_) return;
      failed_ = true;
      error_ = std::move(why);
      hook = hook_;
    }
    cv_.notify_all();
    if (hook) hook(error_);  // error_ no longer changes once failed_ is set
  }

  void run(Stream& s) {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stop_ and nothing left
      std::function<void()> fn = std::move(s.queue.front());
      s.queue.pop_front();
      if (failed_) {  // a failed device drops its queued work
        cv_.notify_all();
        continue;
      }
      s.running = true;
      lk.unlock();
      std::string err;
      try {
        fn();
      } catch (const std::exception& e) {
        err = e.what();
      } catch (...) {
        err = "unknown exception on stream " + s.name;
      }
      fn = nullptr;  // release captures outside the lock
      if (!err.empty()) fail(std::move(err));
      lk.lock();
      s.running = false;
      cv_.notify_all();
    }
  }

  Options opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::deque<Event> events_;
  bool stop_ = false;
  bool failed_ = false;
  std::string error_;
  std::function<void(const std::string&)> hook_;

  mutable std::mutex mem_mu_;
  std::map<std::size_t, std::vector<std::byte*>> free_device_, free_host_;
  std::vector<std::byte*> owned_;  // every block ever allocated (device and host), freed at destruction
  MemoryStats stats_;
  std::size_t device_total_ = 0;
};

static_assert(backend<Cpu>, "backend::Cpu must model the backend concept.");

}  // namespace backend
}  // namespace pipeoffload
