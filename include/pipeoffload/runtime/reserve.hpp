// pipeoffload/runtime/reserve.hpp: what one rank reserves, computed without a device.
//
// po::Runtime takes from a backend that models backend::reserves_memory, when it is
// constructed, every buffer its rank's program can need, so that no step takes device or
// pinned host memory from the system. reservation_plan() says how much: the region of the
// lowered programs' memory plans (schedule/lower.hpp), training's and evaluation's (which never
// run at once), and the pinned offload bins. The runtime runs the same lowered programs, whose
// waits keep every timing within that region. Tested in tests/runtime/test_memory.cpp.
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../schedule/lower.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// What one rank reserves for its buffers: the device region of its lowered programs' memory
/// plans (training's and evaluation's never run at once: the larger) and the pinned host bins
/// (training's: evaluation offloads nothing).
struct Reservation {
  std::size_t device = 0;        ///< device bytes: saved units, stashes and boundary tensors at their offsets
  std::vector<BlockCount> host;  ///< pinned host: offload bins (powers of two), blocks per size
};

/// The reservation of a rank's lowered training and evaluation programs.
constexpr Reservation reservation_of(const LoweredRank& train, const LoweredRank& eval) {
  return {std::max(train.region, eval.region), train.host};
}

namespace detail {
inline void check_reservation_args(const char* who, const Program& p, std::span<const StageBytes> stages) {
  if (static_cast<int>(stages.size()) != p.shape.stages())
    throw error(std::string(who) + ": " + std::to_string(stages.size()) +
                " stage sizes given; the program has S = " + std::to_string(p.shape.stages()) + " stages");
}
}  // namespace detail

/// What rank `rank` of `p` reserves: the memory plans of its training program and of its
/// evaluation (forward_only(p)), lowered with `stages[s]`, stage s's bytes. Units are taken by
/// F and R and given back by W/BW and O (by F itself in evaluation); stashes by B/BW and W/BW;
/// boundary tensors by F/B (outputs) and recvs (inputs), given back by sends and by the F/B
/// that consumed them; pinned host bins by O and R.
inline Reservation reservation_plan(const Program& p, int rank, std::span<const StageBytes> stages) {
  if (rank < 0 || rank >= p.shape.d)
    throw error("po::reservation_plan: rank = " + std::to_string(rank) + " is outside [0, " +
                std::to_string(p.shape.d - 1) + "]");
  detail::check_reservation_args("po::reservation_plan", p, stages);
  return reservation_of(lower(p, rank, stages), lower(forward_only(p), rank, stages));
}

/// reservation_plan for every rank of `p`, lowering the program once (a launcher sizing all
/// its ranks, or a sweep, without lowering the whole program again per rank).
inline std::vector<Reservation> reservation_plans(const Program& p, std::span<const StageBytes> stages) {
  detail::check_reservation_args("po::reservation_plans", p, stages);
  const std::vector<LoweredRank> train = lower_all(p, stages), eval = lower_all(forward_only(p), stages);
  std::vector<Reservation> out;
  for (std::size_t r = 0; r < train.size(); ++r) out.push_back(reservation_of(train[r], eval[r]));
  return out;
}

}  // namespace pipeoffload
