// pipeoffload/comm/communicator.hpp: the `collective`, `communicator` and
// `replica_communicator` concepts, which comm::Threads, comm::Mpi, comm::Nccl and
// comm::SharedGpu model. Their contract (order, rendezvous, tags, collectives, abort) is
// docs/schedules.md, "Communicator semantics": validate() checks schedules against it.
/// @file
#pragma once

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "../error.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// A P2P message's tag: `stage` is the stage that consumes the message (RankProgram::comm's
/// convention), `dir` forward for activations, backward for gradients.
struct Tag {
  int stage = 0;           ///< the stage that consumes the message, 0 .. S-1
  int mb = 0;              ///< the microbatch, 0 .. m-1
  Dir dir = Dir::forward;  ///< forward (activations) or backward (gradients)
  /// Field-by-field equality.
  friend constexpr bool operator==(const Tag&, const Tag&) = default;
};

/// The tag as text for messages: "(forward, stage s, mb i)". A negative mb -1-k tags bucket k
/// of a shared parameter's values (forward) or gradients (backward) for stage s (po::SharedParam).
inline std::string describe(const Tag& t) {
  if (t.mb < 0)
    return std::string("(shared parameter ") + (t.dir == Dir::forward ? "values" : "gradients") + ", stage " +
           std::to_string(t.stage) + ", bucket " + std::to_string(-1 - t.mb) + ")";
  return std::string("(") + (t.dir == Dir::forward ? "forward" : "backward") + ", stage " + std::to_string(t.stage) +
         ", mb " + std::to_string(t.mb) + ")";
}

/// Bytes one rank sent to other ranks in its device collectives (all_to_all(ctx, ...) and
/// all_gather(ctx, ...)), counted as the algorithm's least per-rank sends over n = size()
/// ranks: all_to_all sends every block but its own (in.size() - in.size() / n), all_gather
/// sends its part to each other rank (mine.size() * (n - 1)); a group of one sends nothing.
/// Host all_gather (handshakes, losses, norms) and P2P messages are not counted.
/// comm::Threads, comm::Mpi and comm::Nccl keep one (traffic(), reset_traffic()); in training
/// they count po::Runtime's gradient reduction and the optimizers' parameter gather.
/// @code
///   reps.reset_traffic();
///   reps.all_to_all(ctx, std::span<const std::byte>(in, dp * block), std::span(out, dp * block));
///   const po::Traffic t = reps.traffic();  // t.all_to_all == (dp - 1) * block, t.all_gather == 0
/// @endcode
struct Traffic {
  std::uint64_t all_to_all = 0;  ///< bytes sent in all_to_all(ctx, in, out)
  std::uint64_t all_gather = 0;  ///< bytes sent in all_gather(ctx, mine, all)
  /// Both together.
  constexpr std::uint64_t total() const { return all_to_all + all_gather; }
};

namespace detail {

// A communicator's Traffic, added to by the thread that runs its collectives (the CPU
// backend's comm stream) while the host may read it between steps: relaxed atomics, since
// only the counts matter. Copies and moves take the counts along.
class TrafficCounter {
 public:
  TrafficCounter() = default;
  TrafficCounter(const TrafficCounter& o) { *this = o; }
  TrafficCounter& operator=(const TrafficCounter& o) {
    const Traffic t = o.load();
    a2a_.store(t.all_to_all, std::memory_order_relaxed);
    gather_.store(t.all_gather, std::memory_order_relaxed);
    return *this;
  }
  void all_to_all(std::size_t in, int n) {
    if (n > 1) a2a_.fetch_add(in - in / static_cast<std::size_t>(n), std::memory_order_relaxed);
  }
  void all_gather(std::size_t mine, int n) {
    if (n > 1) gather_.fetch_add(mine * static_cast<std::size_t>(n - 1), std::memory_order_relaxed);
  }
  Traffic load() const { return {a2a_.load(std::memory_order_relaxed), gather_.load(std::memory_order_relaxed)}; }
  void reset() { *this = TrafficCounter(); }

 private:
  std::atomic<std::uint64_t> a2a_{0}, gather_{0};
};

}  // namespace detail

/// The collectives of a group of ranks: who am I, how many are we, all_gather of any trivially
/// copyable type, abort (see the file comment). What the handshake, the gradient norm and
/// checkpoints need; the concept checks all_gather for double and std::byte.
/// @code
///   const std::uint64_t mine[2] = {samples, tokens};
///   std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(c.size()));
///   c.all_gather(std::span<const std::uint64_t>(mine), std::span(all));   // [rank * 2 + i]
/// @endcode
template <class C>
concept collective = requires(C& c, const C& cc, std::span<const double> mine, std::span<double> all,
                              std::span<const std::byte> mine_bytes, std::span<std::byte> all_bytes, std::string why) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.all_gather(mine, all);
  c.all_gather(mine_bytes, all_bytes);
  c.abort(why);
};

/// Tagged point-to-point messages between the ranks of one pipeline, posted from streams whose
/// context is `Context` (the backend's: po::Runtime passes its comm stream's), plus the
/// collectives (see the file comment for the semantics).
/// @code
///   po::comm::ThreadsWorld world(2);            // two ranks that are threads of one process
///   po::comm::Threads c0(world, 0), c1(world, 1);
///   po::backend::CpuContext ctx;                // Threads ignores it; Nccl enqueues on its stream
///   // thread of rank 0:                       // thread of rank 1:
///   c0.send(ctx, 1, {1, 0, po::Dir::forward}, std::as_bytes(std::span(x)));
///                                               c1.recv(ctx, 0, {1, 0, po::Dir::forward}, std::as_writable_bytes(std::span(y)));
/// @endcode
template <class C, class Context>
concept communicator = collective<C> && requires(C& c, const Context& ctx, int peer, Tag tag,
                                                 std::span<const std::byte> in, std::span<std::byte> out) {
  c.send(ctx, peer, tag, in);
  c.recv(ctx, peer, tag, out);
};

/// A communicator of a data-parallel group ("replicas": the ranks of one pipeline rank across
/// the dp replicas), with the device collectives the gradient reduction and ZeRO-1 use:
/// all_to_all and a byte all_gather on the backend's memory, posted from a stream whose
/// context is given (see the file comment).
/// @code
///   // dp ranks, each with dp blocks of `block` bytes in `in` (device memory):
///   reps.all_to_all(ctx, std::span<const std::byte>(in, dp * block), std::span(out, dp * block));
///   // block j of out is rank j's block reps.rank(): reduce them in rank order, then
///   reps.all_gather(ctx, std::span<const std::byte>(mine, block), std::span(all, dp * block));
/// @endcode
template <class C, class Context>
concept replica_communicator =
    communicator<C, Context> &&
    requires(C& c, const Context& ctx, std::span<const std::byte> in, std::span<std::byte> out) {
      c.all_to_all(ctx, in, out);
      c.all_gather(ctx, in, out);
    };

}  // namespace pipeoffload
