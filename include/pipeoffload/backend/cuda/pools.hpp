// pipeoffload/backend/cuda/pools.hpp: the bookkeeping of backend::Cuda's block pools, and the
// arena and pinned bytes a reservation needs, as plain host code (no CUDA header).
//
// backend::Cuda keeps device blocks (cut from one slab taken at construction) and pinned host
// blocks (cudaHostAlloc) in pools by size class, as backend::Cpu does. It models
// backend::reserves_memory: po::Runtime reserves, when it is constructed, its memory plan's
// region and pinned bins (po::reservation_plan), and the backend creates them then. A step then takes no memory from the system: no cudaHostAlloc (which
// takes driver-wide locks while another rank's NCCL kernel may be spinning in the same
// process) and no carving that could exhaust the slab half way through a step.
//
// PoolBook says how many blocks each reservation must create and how many bytes the pools
// hold; arena_bytes_for and pinned_bytes_for give a reservation's totals, so a launcher can
// size Options::arena_bytes before constructing anything. tests/cuda/test_host.cpp checks them
// against po::reservation_plan on the CPU.
/// @file
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "../../error.hpp"

namespace pipeoffload::cuda {

/// Every block of backend::Cuda's pools is a multiple of this (cudaMalloc's alignment; enough
/// for every vector load and for cuBLASLt and cuDNN operands).
inline constexpr std::size_t pool_alignment = 256;

/// The size class of a request of `bytes` (0 counts as 1: every block has an address).
constexpr std::size_t pool_size_class(std::size_t bytes) {
  return ((bytes > 0 ? bytes : 1) + pool_alignment - 1) / pool_alignment * pool_alignment;
}
static_assert(pool_size_class(0) == 256 && pool_size_class(256) == 256 && pool_size_class(257) == 512);

/// Blocks per size class: how many exist and how many callers reserved. Reservations add up
/// (two users of one device each reserve their own), and blocks made on demand count towards
/// what later reservations need.
class PoolBook {
 public:
  /// Records `count` more reserved blocks of `bytes`; returns how many new blocks of
  /// pool_size_class(bytes) the caller must create now so that every reserved block exists.
  std::size_t reserve(std::size_t bytes, std::size_t count) {
    Class& c = classes_[pool_size_class(bytes)];
    c.reserved += count;
    const std::size_t missing = c.reserved > c.blocks ? c.reserved - c.blocks : 0;
    c.blocks += missing;
    return missing;
  }
  /// How many new blocks reserve(bytes, count) would ask for (nothing is recorded).
  std::size_t missing(std::size_t bytes, std::size_t count) const {
    const std::size_t want = reserved(bytes) + count, have = blocks(bytes);
    return want > have ? want - have : 0;
  }
  /// Records one block of `bytes` made on demand (a request no free block could serve).
  void add_block(std::size_t bytes) { ++classes_[pool_size_class(bytes)].blocks; }
  /// Blocks of `bytes`' size class that exist.
  std::size_t blocks(std::size_t bytes) const { return field(bytes, &Class::blocks); }
  /// Blocks of `bytes`' size class that were reserved.
  std::size_t reserved(std::size_t bytes) const { return field(bytes, &Class::reserved); }
  /// Bytes of every block that exists.
  std::size_t bytes_held() const {
    std::size_t total = 0;
    for (const auto& [size, c] : classes_) total += size * c.blocks;
    return total;
  }

 private:
  struct Class {
    std::size_t blocks = 0, reserved = 0;
  };
  std::size_t field(std::size_t bytes, std::size_t Class::* f) const {
    const auto it = classes_.find(pool_size_class(bytes));
    return it == classes_.end() ? 0 : it->second.*f;
  }
  std::map<std::size_t, Class> classes_;
};

namespace detail {

/// Sum of count * pool_size_class(bytes) over a list of {bytes, count} (po::BlockCount).
template <class List>
std::size_t pooled_bytes(const List& list) {
  std::size_t total = 0;
  for (const auto& b : list) total += static_cast<std::size_t>(b.count) * pool_size_class(b.bytes);
  return total;
}

}  // namespace detail

/// Device arena bytes (backend::Cuda::Options::arena_bytes) that hold the cuBLASLt/cuDNN
/// workspace, the device region of `res` (a po::Reservation: units, stashes and boundary
/// tensors at their offsets) and `state_bytes` of other long-lived buffers (the runtime's state and optimizer
/// moments, which they reserve one block at a time), each in its pool's size classes.
template <class Reservation>
std::size_t arena_bytes_for(const Reservation& res, std::size_t workspace_bytes, std::size_t state_bytes) {
  return pool_size_class(workspace_bytes) + pool_size_class(res.device) + state_bytes;
}

/// Pinned host bytes a po::Reservation's offload bins take (backend::Cuda allocates them with
/// cudaHostAlloc when the runtime reserves them).
template <class Reservation>
std::size_t pinned_bytes_for(const Reservation& res) {
  return detail::pooled_bytes(res.host);
}

/// Throws unless `more` bytes fit in an arena of `capacity` bytes of which `used` are taken:
/// the error names the arena, what is taken and what was asked.
inline void require_room(const char* who, std::size_t capacity, std::size_t used, std::size_t more) {
  if (used > capacity || more > capacity - used)
    throw error(std::string(who) + ": the device arena of " + std::to_string(capacity) + " bytes is exhausted (" +
                std::to_string(used) + " carved, " + std::to_string(more) +
                " more asked); raise Options::arena_bytes (cuda::arena_bytes_for gives what a reservation needs)");
}

}  // namespace pipeoffload::cuda
