// pipeoffload/backend/cpu/cpu.hpp: backend::Cpu, the embedded default device.
//
// Each stream is a worker thread that runs its queue in order; events are completion counters
// the workers raise; device and pinned host memory are pooled arenas that count bytes in use
// and their peak. The copy engine can be given a bandwidth, so that a copy takes as long as a
// PCIe link would: that is how offload overlap is exercised without a GPU.
/// @file
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "../../error.hpp"
#include "../backend.hpp"
#include "../failure.hpp"
#include "context.hpp"

namespace pipeoffload {

namespace backend {

/// The CPU backend: streams are worker threads, device and pinned host memory are pooled host
/// memory, and copies can be paced to a PCIe-like bandwidth (the `backend` concept and its
/// optional parts).
class Cpu : public detail::Failure<Cpu> {
 public:
  using Context = CpuContext;  ///< what a pass is given (this backend, the rank, the stream)

  /// How the device is set up: its rank and copy bandwidth.
  struct Options {
    int rank = 0;                      ///< for contexts and messages
    double copy_bytes_per_second = 0;  ///< transfer() pace; 0 = as fast as memcpy
    /// Hold sum_squares' results back until the next synchronize() (its `out` reads NaN until
    /// then), as an asynchronous device may: a check that callers wait before they read.
    bool defer_results = false;
    /// The staging backend::Cuda's upload would have (its Options::upload_staging_bytes): what
    /// host_waits() counts uploads against.
    std::size_t upload_staging_bytes = default_upload_staging;
  };

  /// Device memory is host memory here (backend::host_addressable_memory).
  static constexpr bool device_memory_is_host = true;

  Cpu() : Cpu(Options{}) {}
  /// A device with no streams yet; worker threads start with make_stream.
  explicit Cpu(Options opt) : opt_(opt) { error_.reserve(sizeof out_of_memory); }
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
    wake_everyone();
    for (auto& s : streams_)
      if (s->worker.joinable()) s->worker.join();
    // The arena owns every block it handed out, including those a failed run never freed.
    for (std::byte* p : owned_) ::operator delete(p, std::align_val_t{64});
  }

  /// A new in-order stream with its own worker thread. Throws po::error with a sentence when
  /// the thread cannot be started (the process at its thread or memory limit); the device is
  /// then as it was.
  int make_stream(std::string name) {
    std::lock_guard lk(mu_);
    auto s = std::make_unique<Stream>();
    s->name = std::move(name);
    const int id = static_cast<int>(streams_.size());
    Stream* raw = s.get();
    streams_.reserve(streams_.size() + 1);  // so that the push below cannot throw once the thread runs
    try {
      raw->worker = std::thread([this, raw] { run(*raw); });
    } catch (const std::system_error& e) {
      throw error("backend::Cpu (rank " + std::to_string(opt_.rank) + "): cannot start the worker thread of stream '" +
                  raw->name + "': " + e.what() +
                  " (the process is at its thread or memory limit: ulimit -u, ulimit -v)");
    }
    streams_.push_back(std::move(s));
    return id;
  }

  /// A new event (never recorded yet); returns its id.
  int make_event() {
    std::lock_guard lk(mu_);
    events_.emplace_back();
    return static_cast<int>(events_.size()) - 1;
  }

  /// Queues fn on `stream`: its worker thread runs it after the stream's earlier work.
  void launch(int stream, std::function<void()> fn) {
    if (captured(Graph::launch, stream, 0, &fn)) return;
    push(stream, Item{Item::run, 0, 0, std::move(fn)});
  }

  /// Records `event` on `stream`: it completes when the stream reaches this point.
  void record(int event, int stream) {
    if (captured(Graph::record, stream, event)) return;
    std::uint64_t target;
    {
      std::lock_guard lk(mu_);
      target = ++ev(event).recorded;
    }
    push(stream, Item{Item::record, event, target, {}});
  }

  /// Makes `stream` wait for the latest record of `event` (none yet: no wait).
  void wait(int stream, int event) {
    if (captured(Graph::wait, stream, event)) return;
    std::uint64_t target;
    {
      std::lock_guard lk(mu_);
      target = ev(event).recorded;
    }
    if (target == 0) return;
    push(stream, Item{Item::wait, event, target, {}});
  }

  /// From inside a pass launched on ctx's stream: blocks the stream's thread until the latest
  /// record of `event` (none yet: no wait) completes (backend::waits_in_pass); throws
  /// aborted_error if the device fails meanwhile.
  void wait_in_pass(const CpuContext& ctx, int event) {
    std::unique_lock lk(mu_);
    Event& e = ev(event);
    Stream& s = at(ctx.stream);
    const std::uint64_t target = e.recorded;
    while (!failed_ && e.completed < target) {
      if (std::find(e.waiters.begin(), e.waiters.end(), &s) == e.waiters.end()) e.waiters.push_back(&s);
      s.cv.wait(lk);
    }
    if (failed_) throw aborted_error("aborted: " + error_);
  }

  // ---- captured work (backend::captures_graphs) ---------------------------------------------

  /// A captured stretch of work: the launches, records and waits, in the order they were made.
  struct Graph {
    /// Which call was captured.
    enum Kind : std::uint8_t { launch, record, wait };
    /// One captured call.
    struct Call {
      Kind kind = launch;        ///< launch, record or wait
      int stream = 0,            ///< the stream it was made on
          event = 0;             ///< record and wait: the event
      std::function<void()> fn;  ///< launch: the work
    };
    std::vector<Call> calls;  ///< what replay() makes again
  };
  /// A replay repeats the launches themselves: their host code runs again (backend.hpp).
  static constexpr bool replays_launches = true;

  /// Starts recording launch, record and wait (on any stream) instead of running them.
  void begin_capture(int origin) {
    std::lock_guard lk(mu_);
    at(origin);
    if (capture_) throw error("backend::Cpu::begin_capture: a capture is under way already");
    capture_ = std::make_unique<Graph>();
    capturing_ = true;
  }
  /// Ends the capture and returns what it recorded (throws the device's error if it failed).
  Graph end_capture() {
    std::unique_ptr<Graph> g;
    {
      std::lock_guard lk(mu_);
      if (!capture_) throw error("backend::Cpu::end_capture: no capture is under way (begin_capture)");
      g = std::move(capture_);
      capturing_ = false;
      if (failed_) throw error(error_);
    }
    return std::move(*g);
  }
  /// Makes the captured calls again, after every stream's earlier work and before any
  /// stream's later work (as a CUDA graph's launch is ordered).
  void replay(const Graph& g) {
    cross_fence();
    for (const Graph::Call& c : g.calls) switch (c.kind) {
        case Graph::launch:
          launch(c.stream, c.fn);
          break;
        case Graph::record:
          record(c.event, c.stream);
          break;
        case Graph::wait:
          wait(c.stream, c.event);
          break;
      }
    cross_fence();
  }

  /// Host waits until every stream is idle; throws the first error if any stream failed.
  void synchronize() {
    require_no_capture("synchronize");
    ++host_waits_;
    staged_ = 0;
    std::unique_lock lk(mu_);
    drain(lk);
    for (Deferred& d : deferred_) std::copy(d.sums.begin(), d.sums.end(), d.out.begin());
    deferred_.clear();
    if (failed_) throw error(error_);
  }

  /// Times the host has waited for the device, counted as backend::Cuda counts them
  /// (synchronize, download, an upload that overflows the staging): what a step would wait on
  /// a GPU.
  long long host_waits() const { return host_waits_; }

  /// What a pass on `stream` is given.
  Context context(int stream) { return Context{this, opt_.rank, stream}; }

  /// backend::marks_times: the stream is here now (fn runs on the stream's own thread).
  void mark(double* slot) const { *slot = now(); }

  /// Seconds on a clock shared by every Cpu in the process (for traces).
  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // ---- memory ------------------------------------------------------------------------

  /// A device buffer of `bytes` (64-byte aligned). Pooled by exact size, so once a run has
  /// seen its largest working set the steady state takes no memory from the system. On this
  /// backend allocation and release happen when the stream's worker executes them, so a
  /// block is reused only after its last user has run (the guard a GPU arena needs events for).
  Block device_alloc(std::size_t bytes, Memory kind) {
    std::lock_guard lk(mem_mu_);
    const std::size_t size = round_up(bytes);
    std::byte* p = take(device_, size, stats_.device_allocations, stats_.device_held);
    stats_.take(kind, bytes);
    return Block{p, bytes, kind};
  }

  /// Returns a device_alloc block to its pool (a null block is ignored).
  void device_free(Block b) {
    if (b.ptr == nullptr) return;
    std::lock_guard lk(mem_mu_);
    device_[round_up(b.bytes)].free.push_back(b.ptr);
    stats_.give(b.kind, b.bytes);
  }

  /// A pinned host buffer of exactly `bytes` (the offload layer asks for power-of-two bins).
  HostBlock host_alloc(std::size_t bytes) {
    std::lock_guard lk(mem_mu_);
    std::byte* p = take(host_, round_up(bytes), stats_.host_allocations, stats_.host_held);
    stats_.take_host(bytes);
    return HostBlock{p, bytes};
  }

  /// Returns a host_alloc block to its pool (a null block is ignored).
  void host_free(HostBlock b) {
    if (b.ptr == nullptr) return;
    std::lock_guard lk(mem_mu_);
    host_[round_up(b.bytes)].free.push_back(b.ptr);
    stats_.give_host(b.bytes);
  }

  /// Adds `count` blocks of `bytes` to what the arena holds (see backend::reserves_memory):
  /// the pool of that size grows to the sum of its reservations now, counted as allocations.
  void reserve_device(std::size_t bytes, std::size_t count) {
    std::lock_guard lk(mem_mu_);
    grow(device_[round_up(bytes)], round_up(bytes), count, stats_.device_allocations, stats_.device_held);
  }
  /// The same for pinned host blocks (host_alloc's pools).
  void reserve_host(std::size_t bytes, std::size_t count) {
    std::lock_guard lk(mem_mu_);
    grow(host_[round_up(bytes)], round_up(bytes), count, stats_.host_allocations, stats_.host_held);
  }

  /// backend::resets_arena: waits for the streams, then frees every pooled block and forgets
  /// every reservation (device_held and host_held return to 0). There is no arena size here:
  /// `bytes` is accepted for the concept and ignored. Refused with a sentence, changing nothing,
  /// while a device or host block is handed out.
  void reset_arena(std::size_t bytes = 0) {
    (void)bytes;
    require_no_capture("reset_arena");
    synchronize();
    std::lock_guard lk(mem_mu_);
    std::size_t out[2] = {0, 0};  // bytes of the blocks handed out (whole size classes)
    for (int i = 0; i < 2; ++i)
      for (const auto& [size, pool] : i == 0 ? device_ : host_) out[i] += size * (pool.blocks - pool.free.size());
    if (out[0] + out[1] > 0)
      throw error("backend::Cpu::reset_arena: " + std::to_string(out[0]) + " device and " + std::to_string(out[1]) +
                  " pinned host bytes are still handed out; give every block back first (destroy the po::Runtime "
                  "and optimizer that hold them)");
    for (std::byte* p : owned_) ::operator delete(p, std::align_val_t{64});
    owned_.clear();
    device_.clear();
    host_.clear();
    stats_.device_held = 0;
    stats_.host_held = 0;
  }

  /// The bytes a block of `n` holds in the arena: its pool's size class, `n` rounded up to a
  /// multiple of 64 (at least 64). A launcher sizing memory ahead counts blocks with it.
  static std::size_t round_up(std::size_t n) { return (std::max<std::size_t>(n, 1) + 63) / 64 * 64; }

  /// Bytes in use, peaks and allocation counts, device and pinned host.
  MemoryStats memory() const {
    std::lock_guard lk(mem_mu_);
    return stats_;
  }

  /// Restarts every peak at the bytes in use now (allocation counts are kept).
  void reset_peaks() {
    std::lock_guard lk(mem_mu_);
    stats_.reset_peaks();
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
      const auto due =
          start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(static_cast<double>(total) / opt_.copy_bytes_per_second));
      std::unique_lock lk(mu_);
      pace_cv_.wait_until(lk, due, [&] { return failed_; });
      if (failed_) throw aborted_error("aborted: " + error_);
    }
  }

  // ---- between steps (every stream idle): device memory is host memory here -------------

  /// Copies `bytes` of device memory to host memory (a memcpy here).
  void download(void* host, const void* device, std::size_t bytes) {
    require_no_capture("download");
    ++host_waits_;
    staged_ = 0;
    if (bytes > 0) std::memcpy(host, device, bytes);
  }
  /// Copies `bytes` of host memory to device memory, an enqueued operation: once the streams
  /// have drained, a memcpy. It counts the waits backend::Cuda's staged upload makes: none
  /// while the uploads since the last wait fit in Options::upload_staging_bytes, one when the
  /// staging is full or the upload is larger than all of it.
  void upload(void* device, const void* host, std::size_t bytes) {
    require_no_capture("upload");
    if (bytes == 0) return;
    const detail::StagedUpload u = detail::stage_upload(bytes, staged_, opt_.upload_staging_bytes);
    if (u.wait) ++host_waits_;
    staged_ = u.used;
    after_streams();
    std::memcpy(device, host, bytes);
  }

  /// Sets `bytes` of device memory to zero, once the streams have drained (an enqueued operation).
  void zero(void* device, std::size_t bytes) {
    after_streams();
    if (bytes > 0) std::memset(device, 0, bytes);
  }

  /// *flag = 1 if any element of `t` is NaN or infinite (the pass's own thread runs it, in
  /// stream order). Integer tensors have nothing to check.
  void flag_nonfinite(Context&, ConstTensor t, std::uint32_t* flag) {
    if (t.data == nullptr || t.elements == 0) return;
    // An IEEE value is NaN or infinite exactly when its exponent bits are all ones. Fixed
    // 16-wide blocks with no early exit, ORing all-ones or zero lanes: g++ -O2 vectorises them
    // (a plain loop, or a max-reduction, it does not on baseline x86-64).
    const auto any = [&](auto word, auto mask) {
      using W = decltype(word);
      using S = std::make_signed_t<W>;
      const auto* p = reinterpret_cast<const W*>(t.data);
      S acc = 0;
      std::size_t i = 0;
      for (; i + 16 <= t.elements; i += 16)
        for (std::size_t j = 0; j < 16; ++j) acc |= static_cast<S>(-static_cast<S>((p[i + j] & mask) == mask));
      for (; i < t.elements; ++i) acc |= static_cast<S>((p[i] & mask) == mask);
      return acc != 0;
    };
    bool bad = false;
    switch (t.dtype) {
      case DType::float32:
        bad = any(std::uint32_t{}, std::uint32_t{0x7f800000u});
        break;
      case DType::float64:
        bad = any(std::uint64_t{}, std::uint64_t{0x7ff0000000000000ull});
        break;
      case DType::bfloat16:
        bad = any(std::uint16_t{}, std::uint16_t{0x7f80u});
        break;
      case DType::float16:
        bad = any(std::uint16_t{}, std::uint16_t{0x7c00u});
        break;
      default:
        break;
    }
    if (bad) *flag = 1;
  }

  // ---- optimizer updates (backend::updates_parameters) ----------------------------------

  /// out[k] = sum of squares of the k-th run of groups[k] values, in fp64, in index order
  /// (with Options::defer_results, written by the next synchronize()).
  void sum_squares(std::span<const float> values, std::span<const std::size_t> groups, std::span<double> out) {
    detail::require_groups("backend::Cpu::sum_squares", values.size(), groups, out.size());
    after_streams();
    std::vector<double> sums(groups.size());
    std::size_t off = 0;
    for (std::size_t k = 0; k < groups.size(); ++k) {
      double s = 0;
      for (std::size_t i = off; i < off + groups[k]; ++i)
        s += static_cast<double>(values[i]) * static_cast<double>(values[i]);
      sums[k] = s;
      off += groups[k];
    }
    if (!opt_.defer_results) {
      std::copy(sums.begin(), sums.end(), out.begin());
      return;
    }
    std::fill(out.begin(), out.end(), std::numeric_limits<double>::quiet_NaN());
    std::lock_guard lk(mu_);
    deferred_.push_back({out, std::move(sums)});
  }

  /// update::adamw_at on every value of every segment, then its bfloat16 working copy.
  void adamw(std::span<const update::Segment> segments, const update::AdamWStep& step) {
    detail::require_segments("backend::Cpu::adamw", segments, 2);
    after_streams();
    for (const update::Segment& s : segments)
      for (std::size_t i = 0; i < s.count; ++i) store_working(s, i, update::adamw_at(s, i, step));
  }

  /// update::sgd_at on every value of every segment, then its bfloat16 working copy.
  void sgd(std::span<const update::Segment> segments, const update::SgdStep& step) {
    detail::require_segments("backend::Cpu::sgd", segments, step.momentum != 0.0f ? 1 : 0);
    after_streams();
    for (const update::Segment& s : segments)
      for (std::size_t i = 0; i < s.count; ++i) store_working(s, i, update::sgd_at(s, i, step));
  }

  /// Until release(), the between-steps operations (zero, upload, download, sum_squares,
  /// adamw, sgd: those after every stream's earlier work) wait for `stream` only up to this
  /// point, not for what it is given after (a second hold keeps the first point); the caller
  /// orders what depends on that with events (backend::reduces_gradients).
  void hold(int stream) {
    require_no_capture("hold");
    std::uint64_t target;
    int event;
    {
      std::lock_guard lk(mu_);
      Stream& s = at(stream);
      if (s.held_until != 0) return;
      if (s.held < 0) {
        events_.emplace_back();
        s.held = static_cast<int>(events_.size()) - 1;
      }
      event = s.held;
      target = ++ev(event).recorded;
      s.held_until = target;
    }
    push(stream, Item{Item::record, event, target, {}});
  }
  /// Every stream waited for whole again by the between-steps operations.
  void release() {
    std::lock_guard lk(mu_);
    for (const auto& s : streams_) s->held_until = 0;
  }

  // ---- gradient sums (backend::reduces_gradients): on the calling stream's thread --------

  /// out[i] = ((parts[i] + parts[n + i]) + parts[2n + i]) + ... in fp32 (n = out.size()).
  void sum_parts(Context&, std::span<float> out, std::span<const float> parts) {
    detail::require_parts("backend::Cpu::sum_parts", out.size(), parts.size());
    const std::size_t n = out.size();
    for (std::size_t i = 0; i < n; ++i) out[i] = parts[i];
    for (std::size_t k = n; k < parts.size(); k += n)
      for (std::size_t i = 0; i < n; ++i) out[i] += parts[k + i];
  }
  /// The same over bfloat16 parts (po::bf16_bits), each widened exactly.
  void sum_parts(Context&, std::span<float> out, std::span<const std::uint16_t> parts) {
    detail::require_parts("backend::Cpu::sum_parts", out.size(), parts.size());
    const std::size_t n = out.size();
    for (std::size_t i = 0; i < n; ++i) out[i] = bf16_value(parts[i]);
    for (std::size_t k = n; k < parts.size(); k += n)
      for (std::size_t i = 0; i < n; ++i) out[i] += bf16_value(parts[k + i]);
  }
  /// out[i] = po::bf16_bits(in[i]).
  void to_bf16(Context&, std::span<std::uint16_t> out, std::span<const float> in) {
    detail::require_same_size("backend::Cpu::to_bf16", out.size(), in.size());
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = bf16_bits(in[i]);
  }

  /// acc[i] += g[i] on exact's grid.
  void exact_add(Context&, std::span<exact::Fixed> acc, std::span<const float> g) {
    detail::require_same_size("backend::Cpu::exact_add", acc.size(), g.size());
    for (std::size_t i = 0; i < acc.size(); ++i) exact::add(acc[i], g[i]);
  }
  /// out[i] = parts[i] + parts[n + i] + ... (n = out.size()).
  void exact_sum(Context&, std::span<exact::Fixed> out, std::span<const exact::Fixed> parts) {
    detail::require_parts("backend::Cpu::exact_sum", out.size(), parts.size());
    const std::size_t n = out.size();
    for (std::size_t i = 0; i < n; ++i) {
      exact::Fixed s = parts[i];
      for (std::size_t k = n; k < parts.size(); k += n) s = exact::sum(s, parts[k + i]);
      out[i] = s;
    }
  }
  /// out[i] = exact::to_float(acc[i]).
  void exact_round(Context&, std::span<float> out, std::span<const exact::Fixed> acc) {
    detail::require_same_size("backend::Cpu::exact_round", out.size(), acc.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = exact::to_float(acc[i]);
  }
  /// Copies `bytes` of device memory from src to dst (the ranges may overlap).
  void copy(Context&, void* dst, const void* src, std::size_t bytes) {
    if (bytes > 0) std::memmove(dst, src, bytes);
  }
  /// Sets `bytes` of device memory at dst to zero.
  void zero(Context&, void* dst, std::size_t bytes) {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }

  // ---- PCIe pairs (backend::pairs_copies) -----------------------------------------------

  /// A monotone counter two devices' streams share; a waiting stream's worker blocks on it.
  class Counter {
   public:
    /// Sets the counter to `v` and wakes its waiters.
    void raise(std::uint64_t v) {
      value_.store(v, std::memory_order_release);
      value_.notify_all();
    }
    /// Blocks until the counter is at least `v`; throws aborted_error once abort() was called.
    void wait_at_least(std::uint64_t v) const {
      for (;;) {
        const std::uint64_t now = value_.load(std::memory_order_acquire);
        if (aborted_.load(std::memory_order_acquire)) {
          std::lock_guard lk(why_mu_);
          throw aborted_error("aborted: " + why_);
        }
        if (now >= v) return;
        value_.wait(now, std::memory_order_acquire);
      }
    }
    /// Releases every wait, present and future, with aborted_error naming `why` (the first call's).
    void abort(std::string why) {
      {
        std::lock_guard lk(why_mu_);
        if (aborted_.load()) return;
        why_ = std::move(why);
      }
      aborted_.store(true, std::memory_order_release);
      value_.fetch_add(1, std::memory_order_acq_rel);  // a changed value wakes every wait
      value_.notify_all();
    }
    /// The counter's current value.
    std::uint64_t value() const { return value_.load(std::memory_order_acquire); }

   private:
    std::atomic<std::uint64_t> value_{0};
    std::atomic<bool> aborted_{false};
    mutable std::mutex why_mu_;
    std::string why_;
  };
  /// Sets `c` to `v` on `stream`, after the stream's earlier work.
  void signal(int stream, Counter& c, std::uint64_t v) {
    launch(stream, [&c, v] { c.raise(v); });
  }
  /// Makes `stream` wait until `c` is at least `v`.
  void wait_counter(int stream, const Counter& c, std::uint64_t v) {
    launch(stream, [&c, v] { c.wait_at_least(v); });
  }

  /// The options it was constructed with.
  const Options& options() const { return opt_; }

 private:
  // Waits (holding `lk` on mu_) until every stream is idle: its queue run, or dropped by a
  // failure; with `holds`, a held stream only up to its hold().
  void drain(std::unique_lock<std::mutex>& lk, bool holds = false) {
    host_cv_.wait(lk, [&] {
      for (const auto& s : streams_) {
        if (holds && s->held_until != 0) {
          if (!failed_ && events_[static_cast<std::size_t>(s->held)].completed < s->held_until) return false;
        } else if (s->running || !s->queue.empty()) {
          return false;
        }
      }
      return true;
    });
  }
  // An enqueued operation's order: after all work enqueued on any stream before it, or, on a
  // held stream, before its hold() (no host wait on a GPU, hence not counted in host_waits).
  void after_streams() {
    std::unique_lock lk(mu_);
    drain(lk, true);
  }

  // A sum_squares result held back until the next synchronize() (Options::defer_results).
  struct Deferred {
    std::span<double> out;
    std::vector<double> sums;
  };

  // A multi-tensor update's value i of segment s into its bfloat16 working copy, if it has one.
  static void store_working(const update::Segment& s, std::size_t i, float value) {
    if (s.working != nullptr) s.working[i] = bf16_bits(value);
  }

  // Waits and records are queue items the worker handles under the lock, without running
  // user code: they cost no allocation and no extra wake-up.
  struct Item {
    enum Kind : std::uint8_t { run, record, wait } kind = run;
    int event = 0;
    std::uint64_t target = 0;
    std::function<void()> fn;  // run only
  };
  struct Stream {
    std::string name;
    std::deque<Item> queue;
    bool running = false;
    int held = -1;                 // hold()'s event (made on first hold)
    std::uint64_t held_until = 0;  // hold(): its record; 0 when not held
    std::condition_variable cv;    // this worker's alone: new work, an awaited record, failure, stop
    std::thread worker;
  };
  struct Event {
    std::uint64_t recorded = 0;    // records enqueued so far
    std::uint64_t completed = 0;   // highest record a stream has reached
    std::vector<Stream*> waiters;  // streams asleep on this event; woken and cleared by a record
  };

  // Blocks of one size: those free, how many exist, and how many callers reserved.
  struct Pool {
    std::vector<std::byte*> free;
    std::size_t blocks = 0;
    std::size_t reserved = 0;
  };

  std::byte* fresh(Pool& pool, std::size_t size, long long& allocations, std::size_t& held) {
    owned_.reserve(owned_.size() + 1);  // so the push below cannot throw after the allocation
    auto* p = static_cast<std::byte*>(::operator new(size, std::align_val_t{64}));
    owned_.push_back(p);
    ++pool.blocks;
    ++allocations;
    held += size;
    return p;
  }

  std::byte* take(std::map<std::size_t, Pool>& pools, std::size_t size, long long& allocations, std::size_t& held) {
    Pool& pool = pools[size];
    if (!pool.free.empty()) {
      std::byte* p = pool.free.back();
      pool.free.pop_back();
      return p;
    }
    return fresh(pool, size, allocations, held);
  }

  void grow(Pool& pool, std::size_t size, std::size_t count, long long& allocations, std::size_t& held) {
    pool.reserved += count;
    pool.free.reserve(pool.reserved);
    while (pool.blocks < pool.reserved) pool.free.push_back(fresh(pool, size, allocations, held));
  }

  Stream& at(int s) {
    if (s < 0 || s >= static_cast<int>(streams_.size()))
      throw error("backend::Cpu: stream " + std::to_string(s) + " does not exist; streams are 0.." +
                  std::to_string(streams_.size()) + " (exclusive)");
    return *streams_[static_cast<std::size_t>(s)];
  }
  Event& ev(int e) {
    if (e < 0 || e >= static_cast<int>(events_.size()))
      throw error("backend::Cpu: event " + std::to_string(e) + " does not exist; events are 0.." +
                  std::to_string(events_.size()) + " (exclusive)");
    return events_[static_cast<std::size_t>(e)];
  }

  /// A host wait during a capture is refused, as on a GPU (backend.hpp).
  void require_no_capture(const char* who) const {
    if (capturing_.load(std::memory_order_relaxed))
      throw error(std::string("backend::Cpu::") + who +
                  " during a capture: a captured step may only launch work on the device's streams");
  }
  /// During a capture: keeps the call (a launch's fn moved) for the graph and returns true;
  /// otherwise false.
  bool captured(Graph::Kind kind, int stream, int event, std::function<void()>* fn = nullptr) {
    if (!capturing_.load(std::memory_order_relaxed)) return false;  // (no lock on the usual path)
    std::lock_guard lk(mu_);
    if (!capture_) return false;
    at(stream);
    if (kind != Graph::launch) ev(event);
    capture_->calls.push_back({kind, stream, event, fn != nullptr ? std::move(*fn) : std::function<void()>{}});
    return true;
  }
  /// Every stream's later work after every stream's work so far (a replay's edges).
  void cross_fence() {
    std::size_t n;
    {
      std::lock_guard lk(mu_);
      n = streams_.size();
    }
    while (fences_.size() < n) fences_.push_back(make_event());
    for (std::size_t s = 0; s < n; ++s) record(fences_[s], static_cast<int>(s));
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t s = 0; s < n; ++s)
        if (s != t) wait(static_cast<int>(t), fences_[s]);
  }

  void push(int stream, Item item) {
    Stream* s;
    {
      std::lock_guard lk(mu_);
      s = &at(stream);
      s->queue.push_back(std::move(item));
    }
    s->cv.notify_one();  // one worker per stream: wake it and no one else
  }

  /// Every thread that may sleep on this device: on failure and at destruction.
  void wake_everyone() {
    std::lock_guard lk(mu_);  // so a waiter cannot miss it between its check and its sleep
    for (auto& s : streams_) s->cv.notify_all();
    host_cv_.notify_all();
    pace_cv_.notify_all();
  }

  friend class detail::Failure<Cpu>;
  void on_failure() { wake_everyone(); }

  // The worker of one stream. A thread wakes only when it has something to do: its stream got
  // work, an event it sleeps on was recorded, the device failed or is being destroyed. (A
  // shared condition variable woke all of a device's streams and its host thread on every
  // record: ~25 context switches per pass at d = 8 on two cores, and each is latency on the
  // pipeline's critical path.)
  void run(Stream& s) {
    // An allocation of the worker's own bookkeeping that fails (a wake list, an event's
    // waiters, an error's text: the process out of memory) fails the device instead of
    // ending the process with std::terminate; the worker then drains its queue as a failed
    // device's does, and the rank's host thread throws the device's error.
    for (;;) try {
        serve(s);
        return;
      } catch (...) {
        {
          std::lock_guard lk(mu_);
          s.running = false;
          if (!failed_) {
            failed_ = true;
            error_.assign(out_of_memory);  // within the capacity reserved at construction: no allocation
          }
        }
        wake_everyone();
      }
  }

  static constexpr char out_of_memory[] = "backend::Cpu: out of memory in a stream's worker thread";

  void serve(Stream& s) {
#ifdef __linux__
    // Timed waits on this thread (a paced copy, a layer that sleeps to model a device pass)
    // should end when asked: the default 50 us timer slack adds to every one of them.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    std::vector<Stream*> wake;  // waiters of events recorded while we held the lock
    std::unique_lock lk(mu_);
    for (;;) {
      if (!wake.empty()) {
        lk.unlock();  // notify outside the lock, so the woken thread does not block on it
        for (Stream* w : wake) w->cv.notify_one();
        wake.clear();
        lk.lock();
      }
      s.cv.wait(lk, [&] { return stop_ || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stop_ and nothing left
      Item& item = s.queue.front();
      if (failed_) {  // a failed device drops its queued work
        s.queue.pop_front();
        if (s.queue.empty()) host_cv_.notify_all();
        continue;
      }
      if (item.kind == Item::record) {
        Event& e = events_[static_cast<std::size_t>(item.event)];
        e.completed = std::max(e.completed, item.target);
        wake.insert(wake.end(), e.waiters.begin(), e.waiters.end());
        e.waiters.clear();
        if (item.event == s.held) host_cv_.notify_all();  // after_streams() may wait for it
        s.queue.pop_front();
      } else if (item.kind == Item::wait) {
        Event& e = events_[static_cast<std::size_t>(item.event)];
        if (!failed_ && e.completed < item.target) {
          if (!wake.empty()) continue;  // hand on our own records before we sleep
          // Register, sleep, re-check: a record wakes and forgets its waiters.
          if (std::find(e.waiters.begin(), e.waiters.end(), &s) == e.waiters.end()) e.waiters.push_back(&s);
          s.cv.wait(lk);
          continue;
        }
        s.queue.pop_front();  // done; on failure the next round drops the rest
      } else {
        std::function<void()> fn = std::move(item.fn);
        s.queue.pop_front();
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
      }
      if (s.queue.empty() && !s.running) host_cv_.notify_all();
    }
  }

  Options opt_;
  std::atomic<long long> host_waits_{0};  // see host_waits()
  std::vector<Deferred> deferred_;        // sum_squares results for the next synchronize() (under mu_)
  std::condition_variable host_cv_;       // synchronize(): a stream went idle, or the device failed
  std::condition_variable pace_cv_;       // transfer(): only a failure cuts a paced copy short
  std::vector<std::unique_ptr<Stream>> streams_;
  std::deque<Event> events_;
  bool stop_ = false;
  std::unique_ptr<Graph> capture_;      // the capture under way (under mu_)
  std::atomic<bool> capturing_{false};  // capture_ is set (read without the lock by the capturing thread)
  std::vector<int> fences_;             // one event per stream for replay's edges

  mutable std::mutex mem_mu_;
  std::map<std::size_t, Pool> device_, host_;  // by block size (bytes rounded up to 64)
  std::size_t staged_ = 0;         // upload bytes since the last wait (as backend::Cuda's staging counts them)
  std::vector<std::byte*> owned_;  // every block ever allocated (device and host), freed at destruction
  MemoryStats stats_;
};

static_assert(backend<Cpu>, "backend::Cpu must model the backend concept.");
static_assert(updates_parameters<Cpu>, "backend::Cpu must run the optimizers' updates.");
static_assert(captures_graphs<Cpu>, "backend::Cpu must capture and replay a step.");
static_assert(marks_times<Cpu>, "backend::Cpu must time where its streams are.");
static_assert(waits_in_pass<Cpu>, "backend::Cpu must let a pass wait for a part of a reload.");
static_assert(resets_arena<Cpu>, "backend::Cpu must start its arena over between runtimes.");

}  // namespace backend
}  // namespace pipeoffload
