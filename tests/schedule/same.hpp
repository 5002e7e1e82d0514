// Bit-for-bit comparison of programs and simulations, for the tests that require two ways
// of computing one (threads, reused outputs) to agree exactly.
#pragma once

#include <cstddef>

#include <pipeoffload/pipeoffload.hpp>

namespace pipeoffload_test {

using namespace pipeoffload;

inline bool same_sim(const SimResult& a, const SimResult& b) {
  if (a.makespan != b.makespan || a.ranks.size() != b.ranks.size()) return false;
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const RankSim& x = a.ranks[r];
    const RankSim& y = b.ranks[r];
    if (x.compute_start != y.compute_start || x.compute_end != y.compute_end || x.copy_start != y.copy_start ||
        x.copy_end != y.copy_end)
      return false;
    if (x.busy != y.busy || x.bubble != y.bubble || x.peak != y.peak || x.warmup != y.warmup ||
        x.memory.size() != y.memory.size())
      return false;
    for (std::size_t i = 0; i < x.memory.size(); ++i)
      if (x.memory[i].time != y.memory[i].time || x.memory[i].alive != y.memory[i].alive) return false;
  }
  return true;
}

inline bool same_program(const Program& a, const Program& b) {
  if (!(a.shape == b.shape) || a.ranks.size() != b.ranks.size() || a.group != b.group) return false;
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const RankProgram& x = a.ranks[r];
    const RankProgram& y = b.ranks[r];
    if (x.compute != y.compute || x.copy != y.copy || x.copy_slot != y.copy_slot || x.slot_length != y.slot_length ||
        x.comm != y.comm)
      return false;
  }
  return true;
}

}  // namespace pipeoffload_test
