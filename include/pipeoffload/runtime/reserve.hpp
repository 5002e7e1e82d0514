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
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../schedule/lower.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// What one rank reserves for its buffers: the device region of its lowered programs' memory
/// plans (training's and evaluation's never run at once: the larger) and the pinned host bins.
struct Reservation {
  std::size_t device = 0;             ///< device bytes: saved units, stashes and boundary tensors at their offsets
  std::vector<BlockCount> host;       ///< pinned host: offload bins (powers of two), blocks per size
  std::array<std::size_t, 3> peak{};  ///< training's witnessed peaks: units, stashes, boundary tensors (bytes)
};

/// The reservation of a rank's lowered training and evaluation programs.
inline Reservation reservation_of(const LoweredRank& train, const LoweredRank& eval) {
  Reservation res{std::max(train.region, eval.region), train.host, train.peak};
  for (const BlockCount& b : eval.host) {
    auto it = std::find_if(res.host.begin(), res.host.end(), [&](const BlockCount& x) { return x.bytes == b.bytes; });
    if (it == res.host.end())
      res.host.push_back(b);
    else
      it->count = std::max(it->count, b.count);
  }
  std::sort(res.host.begin(), res.host.end(),
            [](const BlockCount& a, const BlockCount& b) { return a.bytes < b.bytes; });
  return res;
}

/// What rank `rank` of `p` reserves: the memory plans of its training program and of its
/// evaluation (forward_only(p)), lowered with `stages[s]`, stage s's bytes. Units are taken by
/// F and R and given back by W/BW and O (by F itself in evaluation); stashes by B/BW and W/BW;
/// boundary tensors by F/B (outputs) and recvs (inputs), given back by sends and by the F/B
/// that consumed them; pinned host bins by O and R.
inline Reservation reservation_plan(const Program& p, int rank, std::span<const StageBytes> stages) {
  const Shape& sh = p.shape;
  if (rank < 0 || rank >= sh.d)
    throw error("po::reservation_plan: rank = " + std::to_string(rank) + " is outside [0, " + std::to_string(sh.d - 1) +
                "]");
  if (static_cast<int>(stages.size()) != sh.stages())
    throw error("po::reservation_plan: " + std::to_string(stages.size()) +
                " stage sizes given; the program has S = " + std::to_string(sh.stages()) + " stages");
  return reservation_of(lower(p, rank, stages), lower(forward_only(p), rank, stages));
}

}  // namespace pipeoffload
