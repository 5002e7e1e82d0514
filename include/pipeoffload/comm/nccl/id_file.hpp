// pipeoffload/comm/nccl/id_file.hpp: passing NCCL's unique id through a file on a shared path.
//
// One process per GPU, no MPI: rank 0 calls ncclGetUniqueId and publishes the 128 bytes; the
// other ranks wait for them. Publication is write-then-rename: rank 0 writes
// "<path>.tmp.<pid>" completely, flushes it, and renames it to <path>. rename() is atomic on a
// POSIX file system (and on NFS within one directory), so a reader never sees a partial id:
// the file either does not exist or holds all of it. The file carries a magic line and a
// generation number (the job's, chosen by the launcher) so that a stale id left by an earlier
// job is refused instead of hanging ncclCommInitRank. No NCCL header: tests/cuda checks the
// protocol on any machine.
/// @file
#pragma once

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "../communicator.hpp"

namespace pipeoffload::comm {

/// NCCL_UNIQUE_ID_BYTES (nccl.h); checked against ncclUniqueId in comm/nccl/nccl.hpp.
inline constexpr std::size_t nccl_id_bytes = 128;
using NcclIdBytes = std::array<unsigned char, nccl_id_bytes>;  ///< an ncclUniqueId's bytes

/// The first line of an id file.
inline constexpr const char* id_file_magic = "pipeoffload-nccl-id v1";

/// File text: magic line, "generation <g>", one line of 256 hex digits.
inline std::string encode_id(const NcclIdBytes& id, std::uint64_t generation) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string s = std::string(id_file_magic) + "\ngeneration " + std::to_string(generation) + "\n";
  for (unsigned char b : id) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s + "\n";
}

/// Parses encode_id's text; throws comm_error naming what is wrong (wrong magic, another
/// generation, a short or malformed id).
inline NcclIdBytes decode_id(const std::string& text, std::uint64_t generation) {
  std::istringstream in(text);
  std::string magic, word, hexid;
  std::uint64_t gen = 0;
  std::getline(in, magic);
  if (magic != id_file_magic)
    throw comm_error("comm::Nccl id file: first line is \"" + magic + "\", expected \"" + id_file_magic + "\"");
  if (!(in >> word >> gen) || word != "generation") throw comm_error("comm::Nccl id file: no generation line");
  if (gen != generation)
    throw comm_error("comm::Nccl id file: generation " + std::to_string(gen) + " is not this job's " +
                     std::to_string(generation) + " (a stale file?)");
  if (!(in >> hexid) || hexid.size() != 2 * nccl_id_bytes)
    throw comm_error("comm::Nccl id file: the id has " + std::to_string(hexid.size()) + " hex digits, expected " +
                     std::to_string(2 * nccl_id_bytes));
  NcclIdBytes id{};
  const auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw comm_error(std::string("comm::Nccl id file: '") + c + "' is not a lowercase hex digit");
  };
  for (std::size_t i = 0; i < nccl_id_bytes; ++i)
    id[i] = static_cast<unsigned char>(nib(hexid[2 * i]) * 16 + nib(hexid[2 * i + 1]));
  return id;
}

/// Rank 0: writes the id to "<path>.tmp.<pid>", then renames it to `path`.
inline void publish_id(const std::string& path, const NcclIdBytes& id, std::uint64_t generation) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << encode_id(id, generation);
    out.flush();
    if (!out) throw comm_error("comm::Nccl: cannot write the id file " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw comm_error("comm::Nccl: cannot rename " + tmp + " to " + path);
  }
}

/// Other ranks: polls for `path` until it appears (then it is complete, see the file
/// comment) or `timeout` passes (comm_error naming the path and the wait).
inline NcclIdBytes await_id(const std::string& path, std::uint64_t generation, std::chrono::milliseconds timeout,
                            std::chrono::milliseconds poll = std::chrono::milliseconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::ostringstream text;
      text << in.rdbuf();
      return decode_id(text.str(), generation);
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw comm_error("comm::Nccl: no id file at " + path + " after " + std::to_string(timeout.count()) +
                       " ms (is rank 0 running, and is the path shared?)");
    std::this_thread::sleep_for(poll);
  }
}

}  // namespace pipeoffload::comm
