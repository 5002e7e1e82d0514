// pipeoffload/backend/backend.hpp: the `backend` concept the runtime drives (one device:
// in-order streams, events, a device and a pinned host arena, copies, the between-steps
// operations), and backend::updates_parameters for the optimizers. Its contract:
// docs/backends.md, "The backend concept".
/// @file
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "../error.hpp"
#include "../memory/state.hpp"
#include "../tensor.hpp"
#include "exact.hpp"
#include "update.hpp"

namespace pipeoffload::backend {

/// What a device buffer holds; the arena counts each kind separately.
enum class Memory : std::uint8_t {
  activation,  ///< saved activations of one (stage, microbatch): the units schedules count
  stash,       ///< what B leaves for W
  message,     ///< P2P boundary tensors (received inputs, outputs waiting to be sent)
  state,       ///< the runtime's long-lived buffers: the step's inputs, losses, check flags
  optimizer,   ///< optimizer state (AdamW moments, SGD momentum)
};
inline constexpr std::size_t memory_kinds = 5;  ///< how many Memory kinds there are

/// The kind's name for messages ("activation", "stash", ...).
constexpr const char* memory_name(Memory m) {
  switch (m) {
    case Memory::activation:
      return "activation";
    case Memory::stash:
      return "stash";
    case Memory::message:
      return "message";
    case Memory::state:
      return "state";
    case Memory::optimizer:
      return "optimizer";
  }
  return "?";
}

using pipeoffload::default_upload_staging;  // memory/state.hpp

namespace detail {

/// Where an upload goes in a pinned staging of `capacity` bytes: backend::Cuda's staged
/// uploads follow it, and backend::Cpu counts its waits by it, so the two count alike.
struct StagedUpload {
  bool staged = true;    ///< through the staging; false: larger than all of it, a blocking copy
  bool wait = false;     ///< the host waits first (staged: for the copies using the staging; else: its own)
  std::size_t at = 0;    ///< its offset in the staging (staged only)
  std::size_t used = 0;  ///< the staging's bytes in use after it (until the next wait)
};

/// An upload of `bytes` with `used` bytes of the staging taken since the last wait: each takes
/// whole 256-byte pieces (so that every staged copy starts aligned); one that does not fit in
/// what is left waits for the staging to empty first.
constexpr StagedUpload stage_upload(std::size_t bytes, std::size_t used, std::size_t capacity) {
  const std::size_t size = (bytes + 255) / 256 * 256;
  if (size > capacity) return {false, true, 0, 0};
  const bool full = used + size > capacity;
  const std::size_t at = full ? 0 : used;
  return {true, full, at, at + size};
}

/// The argument checks every backend's sum_squares, adamw and sgd make (`who` names the call).
inline void require_groups(const char* who, std::size_t values, std::span<const std::size_t> groups, std::size_t outs) {
  std::size_t total = 0;
  for (std::size_t g : groups) total += g;
  if (total != values || outs != groups.size())
    throw error(std::string(who) + ": " + std::to_string(groups.size()) + " groups cover " + std::to_string(total) +
                " of " + std::to_string(values) + " values with " + std::to_string(outs) +
                " outputs; they must cover all values, one output each");
}
/// Each segment of an update has the buffers its rule reads: parameters and gradients, and
/// `states` state buffers (AdamW 2; SGD 1 with momentum, 0 without, which must then be null).
inline void require_segments(const char* who, std::span<const update::Segment> segments, int states) {
  for (std::size_t k = 0; k < segments.size(); ++k) {
    const update::Segment& s = segments[k];
    const bool has0 = s.state0 != nullptr, has1 = s.state1 != nullptr;
    if (s.count == 0) continue;
    if (s.params == nullptr || s.grads == nullptr || has0 != (states >= 1) || has1 != (states >= 2))
      throw error(std::string(who) + ": segment " + std::to_string(k) + " of " + std::to_string(segments.size()) +
                  " has parameters " + (s.params ? "set" : "null") + ", gradients " + (s.grads ? "set" : "null") +
                  " and " + std::to_string(int{has0} + int{has1}) + " state buffers; the rule needs parameters, " +
                  "gradients and exactly " + std::to_string(states) + " state buffers (state0 first)");
  }
}

inline void require_same_size(const char* who, std::size_t a, std::size_t b) {
  if (a != b)
    throw error(std::string(who) + ": the buffers hold " + std::to_string(a) + " and " + std::to_string(b) +
                " elements; they must be equal");
}
inline void require_parts(const char* who, std::size_t out, std::size_t parts) {
  if (out == 0 ? parts != 0 : parts % out != 0 || parts == 0)
    throw error(std::string(who) + ": " + std::to_string(parts) + " partial sums do not make whole parts of " +
                std::to_string(out) + " values");
}

}  // namespace detail

/// Byte counters of a device (and its pinned host memory).
struct MemoryStats {
  std::array<std::size_t, memory_kinds> in_use{};  ///< device bytes in use, per kind
  std::array<std::size_t, memory_kinds> peak{};    ///< most device bytes in use at once, per kind
  std::size_t total_peak = 0;                      ///< most device bytes in use at once, all kinds together
  long long device_allocations = 0;                ///< times the arena had to get new memory from the system
  std::size_t device_held = 0;  ///< device bytes the arena holds for blocks (what the runtime reserved and took since)
  std::size_t host_in_use = 0;  ///< pinned host bytes in use (offloaded units' bins)
  std::size_t host_peak = 0;    ///< most pinned host bytes in use at once
  long long host_allocations = 0;  ///< times the pinned arena had to get new memory from the system
  std::size_t host_held = 0;       ///< pinned host bytes the arena holds for blocks
  std::size_t total_in_use = 0;    ///< device bytes in use, all kinds together
  /// Device bytes of kind `m` in use.
  std::size_t in(Memory m) const { return in_use[static_cast<std::size_t>(m)]; }
  /// Most device bytes of kind `m` in use at once.
  std::size_t peak_of(Memory m) const { return peak[static_cast<std::size_t>(m)]; }

  /// Counts `bytes` of kind `m` (device) handed out; the peaks follow. (The backends' one
  /// bookkeeping of their arenas.)
  void take(Memory m, std::size_t bytes) {
    std::size_t& in = in_use[static_cast<std::size_t>(m)];
    in += bytes;
    peak[static_cast<std::size_t>(m)] = std::max(peak[static_cast<std::size_t>(m)], in);
    total_in_use += bytes;
    total_peak = std::max(total_peak, total_in_use);
  }
  /// Counts `bytes` of kind `m` (device) given back.
  void give(Memory m, std::size_t bytes) {
    in_use[static_cast<std::size_t>(m)] -= bytes;
    total_in_use -= bytes;
  }
  /// Counts `bytes` of pinned host memory handed out; the host peak follows.
  void take_host(std::size_t bytes) {
    host_in_use += bytes;
    host_peak = std::max(host_peak, host_in_use);
  }
  /// Counts `bytes` of pinned host memory given back.
  void give_host(std::size_t bytes) { host_in_use -= bytes; }
  /// Restarts every peak at the bytes in use now (allocation counts are kept).
  void reset_peaks() {
    peak = in_use;
    total_peak = total_in_use;
    host_peak = host_in_use;
  }
};

/// A device buffer from the arena.
struct Block {
  std::byte* ptr = nullptr;          ///< its first byte, device memory (null: no block)
  std::size_t bytes = 0;             ///< what was asked for (the arena may hold more)
  Memory kind = Memory::activation;  ///< what it holds (the arena counts it under this kind)
};

/// A pinned host buffer (a power-of-two bin).
struct HostBlock {
  std::byte* ptr = nullptr;  ///< its first byte, pinned host memory (null: no block)
  std::size_t bytes = 0;     ///< what was asked for
};

/// One contiguous piece of a copy.
struct CopyPiece {
  void* dst = nullptr;        ///< where to copy to (device or host memory)
  const void* src = nullptr;  ///< where to copy from (device or host memory)
  std::size_t bytes = 0;      ///< length, bytes
};

/// A device the runtime can drive (see the file comment for the semantics).
/// @code
///   po::backend::Cpu dev({.copy_bytes_per_second = 12e9});   // a PCIe-like copy engine
///   const int compute = dev.make_stream("compute"), copy = dev.make_stream("copy");
///   const int done = dev.make_event();
///   po::backend::Block b;
///   dev.launch(compute, [&] { b = dev.device_alloc(1 << 20, po::backend::Memory::activation); });
///   dev.record(done, compute);
///   dev.wait(copy, done);
///   dev.launch(copy, [&] { dev.device_free(b); });
///   dev.synchronize();
/// @endcode
template <class B>
concept backend =
    requires(B& b, int stream, int event, std::function<void()> fn, std::function<void(const std::string&)> hook,
             std::size_t n, Memory kind, Block blk, HostBlock hb, std::span<const CopyPiece> pieces, std::string why,
             void* ptr, const void* cptr, typename B::Context& ctx, ConstTensor t, std::uint32_t* flag) {
      typename B::Context;
      { b.make_stream(why) } -> std::same_as<int>;
      { b.make_event() } -> std::same_as<int>;
      b.launch(stream, std::move(fn));
      b.record(event, stream);
      b.wait(stream, event);
      b.synchronize();
      b.abort(why);
      b.set_error_hook(std::move(hook));
      { b.device_alloc(n, kind) } -> std::same_as<Block>;
      b.device_free(blk);
      { b.host_alloc(n) } -> std::same_as<HostBlock>;
      b.host_free(hb);
      b.transfer(pieces);
      { b.memory() } -> std::same_as<MemoryStats>;
      b.reset_peaks();
      { b.context(stream) } -> std::same_as<typename B::Context>;
      { b.now() } -> std::same_as<double>;
      b.download(ptr, cptr, n);
      b.upload(ptr, cptr, n);
      b.zero(ptr, n);
      b.flag_nonfinite(ctx, t, flag);
    };

/// Optional, on top of `backend`: what po::AdamW, po::Sgd and po::grad_norm run on the device,
/// enqueued (see the file comment):
///   - sum_squares(values, groups, out): out[k] = sum of squares, in fp64 and a fixed order,
///     of the k-th run of groups[k] values (the gradient norm's pieces); `out` (host memory,
///     alive until then) is written by the time the next synchronize() returns;
///   - adamw(segments, step): update::adamw_at on every value of every segment, then the
///     segment's bfloat16 working copy (where it has one) from the result, rounded to nearest
///     even (po::bf16_bits): one call a chunk, one launch a GPU for up to
///     cuda::segments_per_launch segments; the segment table is read during the call;
///   - sgd(segments, step): update::sgd_at likewise.
/// Gradients are left as they are (Runtime::zero_grad clears them).
template <class B>
concept updates_parameters =
    requires(B& b, std::span<const float> cfs, std::span<const std::size_t> groups, std::span<double> out,
             std::span<const update::Segment> segments, const update::AdamWStep& aw, const update::SgdStep& sg) {
      b.sum_squares(cfs, groups, out);
      b.adamw(segments, aw);
      b.sgd(segments, sg);
    };

/// What po::Runtime needs of a backend to sum and reduce gradients, on either path
/// (RuntimeOptions::gradients), each in a stream's order (`ctx`: a GPU backend enqueues on its
/// stream, the CPU backend runs it on the calling stream's thread):
///   - sum_parts(ctx, out, parts): out[i] = ((parts[i] + parts[n + i]) + parts[2n + i]) + ...
///     in fp32, in that order (n = out.size(), parts.size() a multiple of it): the standard
///     path's reduce-scatter adds the replicas' parts in replica order; parts may be fp32 or
///     bfloat16 (std::uint16_t bits, po::bf16_bits), widened exactly before each addition;
///   - to_bf16(ctx, out, in): out[i] = po::bf16_bits(in[i]) (to nearest even): a bucket of
///     gradients narrowed for a bfloat16 reduce-scatter (RuntimeOptions::reduce_dtype);
///   - exact_add(ctx, acc, g): acc[i] += g[i], on exact's grid (backend/exact.hpp);
///   - exact_sum(ctx, out, parts): out[i] = parts[i] + parts[n + i] + ... (n = out.size(),
///     parts.size() a multiple of it; exact, so the order does not matter);
///   - exact_round(ctx, out, acc): out[i] = exact::to_float(acc[i]);
///   - copy(ctx, dst, src, bytes), zero(ctx, dst, bytes): device memory;
///   - hold(stream): until release(), the between-steps operations (zero, upload, download,
///     sum_squares, adamw, sgd) wait for `stream` only up to this point, not for what it is
///     given after (a second hold keeps the first point): ZeRO-1's parameter gather left running
///     (AdamWOptions::overlap_gather), which the next step's zeroing and uploads need not wait
///     for and its passes wait for by events; release(): every stream waited for whole again.
template <class B>
concept reduces_gradients =
    requires(B& b, typename B::Context& ctx, std::span<exact::Fixed> acc, std::span<const exact::Fixed> cacc,
             std::span<float> fs, std::span<const float> cfs, std::span<std::uint16_t> hs,
             std::span<const std::uint16_t> chs, void* p, const void* cp, std::size_t n, int stream) {
      b.sum_parts(ctx, fs, cfs);
      b.sum_parts(ctx, fs, chs);
      b.to_bf16(ctx, hs, cfs);
      b.exact_add(ctx, acc, cfs);
      b.exact_sum(ctx, acc, cacc);
      b.exact_round(ctx, fs, cacc);
      b.copy(ctx, p, cp, n);
      b.zero(ctx, p, n);
      b.hold(stream);
      b.release();
    };

/// Optional, on top of `backend`: the "synchronized interleaved" copies of two devices under
/// one PCIe switch (docs/design.md section 3). `B::Counter` is a monotone 64-bit counter that two
/// devices of one process share; signal(stream, c, v) sets it to v in stream order (after the
/// stream's earlier work), wait_counter(stream, c, v) makes the stream wait until it is at
/// least v. Monotone values, unlike events, need no care about which record a wait sees.
/// c.abort(why) releases every wait on it, present and future, with an error naming `why`.
template <class B>
concept pairs_copies = requires(B& b, int stream, typename B::Counter& c, std::uint64_t v, std::string why) {
  b.signal(stream, c, v);
  b.wait_counter(stream, c, v);
  c.abort(why);
};

/// Optional, on top of `backend`: an arena that can take memory from the system ahead of use.
/// reserve_device(bytes, count) adds `count` blocks of `bytes` (as device_alloc would size
/// them) to what the arena holds for its callers; reservations add up, so two users of one
/// device each reserve their own. po::Runtime reserves, at construction, its lowered memory
/// plan's region (one block) and the pinned bins its program holds (po::reservation_plan), so
/// no step (the first included) takes device or pinned host memory from the system.
template <class B>
concept reserves_memory = requires(B& b, std::size_t bytes, std::size_t count) {
  b.reserve_device(bytes, count);
  b.reserve_host(bytes, count);
};

/// Optional, on top of reserves_memory: reset_arena(bytes) starts the arena over between two
/// users of a device, once they have given back every block they took (a profiling po::Runtime
/// and the one its measurements sized, as `train_gpt --k auto` runs them): it waits for the
/// device, gives every pooled block back (pinned host blocks to the system, device blocks to
/// the arena) and forgets every reservation, so that the next reservation is counted from
/// nothing instead of adding to the last. `bytes` (0: unchanged) is the device arena's new size
/// where the backend has one (backend::Cuda's slab; backend::Cpu takes from the system as it
/// goes). Refused with a sentence while a block is handed out.
template <class B>
concept resets_arena = reserves_memory<B> && requires(B& b, std::size_t bytes) { b.reset_arena(bytes); };

/// Optional, on top of reserves_memory: sum_squares keeps device buffers of its own (the CUDA
/// backend's table, partials and sums); reserve_sum_squares(groups) makes them large enough for
/// `groups` ahead of use. po::Runtime calls it at construction for each chunk's norm groups.
template <class B>
concept reserves_norm_buffers =
    reserves_memory<B> && requires(B& b, std::span<const std::size_t> groups) { b.reserve_sum_squares(groups); };

/// Optional, on top of `backend`: wait_in_pass(ctx, event), called by a pass launched on
/// ctx's stream, makes the rest of that pass (and the stream) wait for the latest record of
/// `event`: backend::Cuda enqueues the wait on the stream, backend::Cpu blocks the stream's
/// thread. po::Runtime uses it to let a B start once the first part of its reloaded unit is
/// back (the layer's saved_parts, Microbatch::await_saved); without it the B waits for the whole.
template <class B>
concept waits_in_pass = requires(B& b, const typename B::Context& ctx, int event) { b.wait_in_pass(ctx, event); };

/// Optional, on top of `backend`: where a stream is, in time. Called from work launched on a
/// stream, mark(slot) writes into *slot (host memory, alive until then), by the next
/// synchronize(), the time on now()'s clock at which the stream reached that point; the
/// runtime's trace of every op (Runtime::trace) is made of them. backend::Cpu writes now() as
/// the stream's thread gets there; backend::Cuda records a timing event there and converts it
/// at the next synchronize (during a capture: the time of the call, as a replay runs later).
template <class B>
concept marks_times = requires(B& b, double* slot) { b.mark(slot); };

/// Optional, on top of `backend`: work enqueued once and replayed (RuntimeOptions::graphs).
/// begin_capture(origin) starts a capture of every stream: launch, record and wait are
/// recorded, not run, until end_capture() returns the Graph; replay(g) enqueues the captured
/// work again, after every stream's earlier work and before any stream's later work. What a
/// replay repeats: backend::Cuda's CUDA graph repeats the device work the launches enqueued
/// (the host code in them ran once, during the capture); backend::Cpu repeats the launches
/// themselves (B::replays_launches). A capture holds no host wait and no between-steps
/// operation (synchronize, upload, download, zero...; a layer's pass that makes one cannot be
/// captured). A capture that fails (a pass
/// threw, or CUDA refused a call) fails the device and end_capture() throws its message.
template <class B>
concept captures_graphs = requires(B& b, int stream, const typename B::Graph& g) {
  typename B::Graph;
  { B::replays_launches } -> std::convertible_to<bool>;
  b.begin_capture(stream);
  { b.end_capture() } -> std::same_as<typename B::Graph>;
  b.replay(g);
};

/// A backend whose device memory the host reads and writes directly (backend::Cpu says so
/// with `static constexpr bool device_memory_is_host = true`): the runtime's buffer guard
/// (RuntimeOptions::guard_buffers) checks its canaries there.
template <class B>
concept host_addressable_memory = requires { requires B::device_memory_is_host; };

}  // namespace pipeoffload::backend
