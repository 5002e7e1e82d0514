// pipeoffload/comm/communicator.hpp: the `communicator` concept.
//
// Semantics (README "Communicator semantics"; validate() checks schedules against them):
//   - a rank calls send and recv from its comm stream, in the order of RankProgram::comm;
//   - send(peer, tag, data) may block until the peer has posted the matching recv and taken
//     the data (rendezvous, as NCCL's may); recv blocks until the matching send is posted;
//   - between an ordered pair of ranks, messages are received in the order they were sent;
//   - a message is bytes (a boundary tensor of any element type); every message carries its
//     tag (stage, microbatch, forward|backward) and its size; a recv that meets another tag or
//     size throws comm_error naming both, never a silent swap;
//   - all_gather(mine, all): every rank contributes mine.size() doubles (the same count on
//     every rank); all receives them in rank order. It is a collective: every rank calls it
//     the same number of times;
//   - abort(why): every blocking call in progress or to come, on every rank, throws
//     aborted_error naming `why` (the first abort wins); it is how one failing rank stops
//     the others (NCCL: ncclCommAbort).
#pragma once

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
  int stage = 0;
  int mb = 0;
  Dir dir = Dir::forward;
  friend constexpr bool operator==(const Tag&, const Tag&) = default;
};

inline std::string describe(const Tag& t) {
  return std::string("(") + (t.dir == Dir::forward ? "forward" : "backward") + ", stage " + std::to_string(t.stage) + ", mb " +
         std::to_string(t.mb) + ")";
}

/// Tagged point-to-point messages between the ranks of one pipeline, plus the one small
/// collective an optimizer step needs (see the file comment for the semantics).
/// @code
///   po::comm::ThreadsWorld world(2);            // two ranks that are threads of one process
///   po::comm::Threads c0(world, 0), c1(world, 1);
///   // thread of rank 0:                       // thread of rank 1:
///   c0.send(1, {1, 0, po::Dir::forward}, std::as_bytes(std::span(x)));
///                                               c1.recv(0, {1, 0, po::Dir::forward}, std::as_writable_bytes(std::span(y)));
/// @endcode
template <class C>
concept communicator = requires(C& c, const C& cc, int peer, Tag tag, std::span<const std::byte> in, std::span<std::byte> out,
                                std::span<const double> mine, std::span<double> all, std::string why) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.send(peer, tag, in);
  c.recv(peer, tag, out);
  c.all_gather(mine, all);
  c.abort(why);
};

}  // namespace pipeoffload
