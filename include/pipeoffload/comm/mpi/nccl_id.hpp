// pipeoffload/comm/mpi/nccl_id.hpp: NCCL's unique id, broadcast over MPI.
//
// Under `mpirun -np 8` on a GPU node (or across nodes), the MPI job already connects every
// rank, so the NCCL bootstrap needs no shared file: rank 0 calls ncclGetUniqueId and this
// broadcast hands its 128 bytes to every rank, which then calls ncclCommInitRank. The id
// travels as comm/nccl/id_file.hpp's NcclIdBytes, so this header needs no NCCL and is tested
// on the CPU (tests/mpi/test_mpi.cpp). A rank that never joins fails the broadcast after the
// communicator's timeout instead of hanging ncclCommInitRank.
/// @file
#pragma once

#include <span>

#include "../nccl/id_file.hpp"
#include "mpi.hpp"

namespace pipeoffload::comm {

/// Collective over `comm`: returns rank `root`'s `id` on every rank (other ranks' `id` is
/// ignored).
/// @code
///   po::comm::NcclIdBytes id{};
///   if (mpi.rank() == 0) { ncclUniqueId u; ncclGetUniqueId(&u); std::memcpy(id.data(), &u, sizeof u); }
///   id = po::comm::broadcast_nccl_id(mpi, id);   // then ncclCommInitRank(&c, size, id, rank)
/// @endcode
inline NcclIdBytes broadcast_nccl_id(Mpi& comm, const NcclIdBytes& id, int root = 0) {
  NcclIdBytes out = id;
  comm.broadcast(root, std::as_writable_bytes(std::span<unsigned char>(out)));
  return out;
}

}  // namespace pipeoffload::comm
