// pipeoffload/comm/nccl/gather_pieces.hpp: how comm::Nccl's host all_gather cuts a gather into
// pieces of its fixed staging (plain host code, tested on the CPU in tests/cuda/test_host.cpp).
//
// comm::Nccl allocates its staging once, at construction (Options::gather_bytes: a device
// buffer and pinned host buffers), so that no gather allocates while another rank's NCCL
// kernel may be running. A gather of `block` bytes per rank that does not fit runs as
// consecutive ncclAllGathers of at most `piece` bytes per rank; every rank computes the same
// pieces from the same block size, so they issue the same collectives in the same order.
/// @file
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "../../error.hpp"

namespace pipeoffload::comm {

/// Bytes [offset, offset + bytes) of every rank's block travel in one ncclAllGather.
struct GatherPiece {
  std::size_t offset = 0;  ///< first byte of the piece within each rank's block
  std::size_t bytes = 0;   ///< length of the piece, bytes
  /// Field-by-field equality.
  friend constexpr bool operator==(const GatherPiece&, const GatherPiece&) = default;
};

/// The pieces of a gather of `block` bytes per rank through staging of `piece` bytes per rank:
/// in order, each `piece` bytes but the last, covering [0, block) once; none for an empty block.
inline std::vector<GatherPiece> gather_pieces(std::size_t block, std::size_t piece) {
  if (piece == 0) throw comm_error("comm::gather_pieces: piece = 0 bytes is outside the allowed range [1, ...]");
  std::vector<GatherPiece> out;
  out.reserve((block + piece - 1) / piece);
  for (std::size_t at = 0; at < block; at += piece) out.push_back({at, block - at < piece ? block - at : piece});
  return out;
}

}  // namespace pipeoffload::comm
