// pipeoffload/comm/shared_device.hpp: comm::SharedDevice<Streams>, thread ranks of one process
// that share one device: comm::Threads' matching, tags, rendezvous and abort, with the bytes
// moved by copies enqueued on the callers' streams and ordered by events (DeviceCopy), never
// through the host. comm/cuda/shared_gpu.hpp instantiates it for CUDA (comm::SharedGpu). How
// sends, receives and collectives order their events: docs/shared_device.md.
/// @file
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "threads.hpp"

namespace pipeoffload::comm {

/// The few device calls DeviceCopy makes, on the streams of contexts of type `Context`: events
/// (a pointer type: created, destroyed, recorded on a stream, waited for by a stream) and an
/// asynchronous copy within the device's memory.
template <class S>
concept device_streams =
    std::is_pointer_v<typename S::Event> && requires(S& s, const typename S::Context& ctx, typename S::Event e,
                                                     std::byte* dst, const std::byte* src, std::size_t n) {
      { s.create() } -> std::same_as<typename S::Event>;
      s.destroy(e);
      s.record(ctx, e);  // e completes when ctx's stream reaches this point
      s.wait(ctx, e);    // ctx's stream waits for e's last record (made before this call)
      s.copy(ctx, dst, src, n);
    };

/// BasicThreads' transport for ranks sharing one device (the file comment): copies on the
/// callers' streams, ordered by events from a pool of this handle's own.
template <device_streams Streams>
class DeviceCopy {
 public:
  static constexpr bool device_memory = true;  ///< the collectives copy device to device
  using Context = typename Streams::Context;   ///< the context whose stream a call is posted from
  using Event = typename Streams::Event;       ///< the streams' event

  /// A transport over default-constructed streams.
  DeviceCopy() = default;
  /// A transport over `s`.
  explicit DeviceCopy(Streams s) : s_(std::move(s)) {}
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  /// Takes `o`'s streams and events (o keeps none).
  DeviceCopy(DeviceCopy&& o) noexcept
      : s_(std::move(o.s_)),
        all_(std::exchange(o.all_, {})),
        free_(std::exchange(o.free_, {})),
        retired_(std::exchange(o.retired_, {})) {}
  /// Destroys this transport's events and takes `o`'s.
  DeviceCopy& operator=(DeviceCopy&& o) noexcept {
    if (this != &o) {
      destroy_all();
      s_ = std::move(o.s_);
      all_ = std::exchange(o.all_, {});
      free_ = std::exchange(o.free_, {});
      retired_ = std::exchange(o.retired_, {});
    }
    return *this;
  }
  ~DeviceCopy() { destroy_all(); }

  /// The streams' calls (a test's view of its fake streams).
  Streams& streams() { return s_; }
  /// Events this transport has created (its pool grows to what the calls in flight need).
  std::size_t events() const { return all_.size(); }

  /// Sender, before posting: "ready" recorded on its stream, "copied" for the receiver.
  void offer(const Context& ctx, detail::ThreadsMessage& m) {
    const Event ready = next_event(), copied = next_event();
    s_.record(ctx, ready);
    m.transport[0] = word(ready);
    m.transport[1] = word(copied);
  }
  /// Receiver: its stream waits for "ready", copies, and records "copied".
  void take(const Context& ctx, std::span<std::byte> out, detail::ThreadsMessage& m) {
    s_.wait(ctx, event(m.transport[0]));
    if (!out.empty()) s_.copy(ctx, out.data(), m.data, out.size());
    s_.record(ctx, event(m.transport[1]));
  }
  /// Sender, once the receiver has taken the message: its stream waits for "copied".
  void taken(const Context& ctx, detail::ThreadsMessage& m) {
    s_.wait(ctx, event(m.transport[1]));
    free_.push_back(event(m.transport[0]));
    free_.push_back(event(m.transport[1]));
  }

  /// A device collective named `op` (a string literal: the ranks, threads of one process,
  /// compare its address) of the ranks of `c` (the file comment): every rank calls the same op
  /// and passes `mine` of the same size, else comm_error on every rank; place(j, rank j's
  /// bytes) gives where this rank's share of them goes and which bytes that share is.
  template <class Comm, class Place>
  void collective(const Context& ctx, Comm& c, const char* op, std::span<const std::byte> mine, Place place) {
    struct Posted {
      std::uintptr_t data = 0, bytes = 0, event = 0, op = 0;
    };
    const std::size_t n = static_cast<std::size_t>(c.size());
    std::vector<Posted> all(n);
    const Event ready = next_event();
    s_.record(ctx, ready);
    const Posted own{word(mine.data()), mine.size(), word(ready), word(op)};
    {
      // Until `first` goes, no rank destroys the events or frees the memory this round tells of
      // (BasicThreads::gather_to_enqueue), even if the world is aborted meanwhile.
      const auto first = c.gather_to_enqueue(std::span<const Posted>(&own, 1), std::span<Posted>(all));
      // Every rank has left the previous collective's second round: its waits are enqueued.
      for (const Event e : retired_) free_.push_back(e);
      retired_.clear();
      const auto name = [](std::uintptr_t o) { return std::string(reinterpret_cast<const char*>(o)); };
      for (std::size_t j = 1; j < n; ++j)
        if (name(all[j].op) != name(all[0].op))  // by text: one literal may have two addresses
          throw comm_error("comm::SharedDevice: ranks called different device collectives at once (rank 0: " +
                           name(all[0].op) + ", rank " + std::to_string(j) + ": " + name(all[j].op) + ")");
      for (std::size_t j = 1; j < n; ++j)
        if (all[j].bytes != all[0].bytes)
          throw comm_error(
              "comm::SharedDevice: ranks passed buffers of different sizes to a device collective (rank 0: " +
              std::to_string(all[0].bytes) + " bytes, rank " + std::to_string(j) + ": " + std::to_string(all[j].bytes) +
              " bytes)");
      for (std::size_t j = 0; j < n; ++j) {
        s_.wait(ctx, event(all[j].event));
        const auto [dst, src] = place(static_cast<int>(j), reinterpret_cast<const std::byte*>(all[j].data));
        if (!src.empty()) s_.copy(ctx, dst, src.data(), src.size());
      }
    }
    const Event done = next_event();
    s_.record(ctx, done);
    const Posted fin{0, 0, word(done)};
    const auto second = c.gather_to_enqueue(std::span<const Posted>(&fin, 1), std::span<Posted>(all));
    for (std::size_t j = 0; j < n; ++j)
      if (j != static_cast<std::size_t>(c.rank())) s_.wait(ctx, event(all[j].event));
    retired_ = {ready, done};
  }

 private:
  static std::uintptr_t word(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  static Event event(std::uintptr_t w) { return reinterpret_cast<Event>(w); }
  Event next_event() {
    if (free_.empty()) {
      all_.reserve(all_.size() + 1);  // so a failed push cannot lose a created event
      all_.push_back(s_.create());
      return all_.back();
    }
    const Event e = free_.back();
    free_.pop_back();
    return e;
  }
  void destroy_all() noexcept {
    for (const Event e : all_) s_.destroy(e);
    all_.clear();
  }

  Streams s_;
  std::vector<Event> all_;      // every event created (destroyed with the transport)
  std::vector<Event> free_;     // ready for a new record
  std::vector<Event> retired_;  // the last collective's, free after the next one's first round
};

/// Thread ranks sharing one device through `Streams` (a ThreadsGrid's handles given a
/// transport: `SharedDevice<S> pipe(grid.pipeline(g), DeviceCopy<S>(streams))`).
template <device_streams Streams>
using SharedDevice = BasicThreads<DeviceCopy<Streams>>;

}  // namespace pipeoffload::comm
