// pipeoffload/fnv1a.hpp: the one checksum of the project, 64-bit FNV-1a.
//
// Checkpoint files carry it (runtime/checkpoint.hpp), the start-up handshake compares it
// (comm/handshake.hpp), and the samples print and key on it (train_gpt's params_hash and
// config hash, custom_model's tensor names). Its starting value is 1469598103934665603, not
// FNV's published offset basis 14695981039346656037 (a digit short): every hash the project
// has written or printed was made with it, checkpoints on disk included, so it stays.
/// @file
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace pipeoffload {

/// The hash of no bytes: where a hash starts (see the file comment).
inline constexpr std::uint64_t fnv1a_start = 1469598103934665603ull;

/// FNV-1a of `bytes`, continuing from `h`: fnv1a(b, fnv1a(a)) hashes a then b.
constexpr std::uint64_t fnv1a(std::span<const std::byte> bytes, std::uint64_t h = fnv1a_start) {
  for (const std::byte b : bytes) h = (h ^ static_cast<unsigned char>(b)) * 1099511628211ull;
  return h;
}

/// FNV-1a of the characters of `s`, continuing from `h`.
constexpr std::uint64_t fnv1a(std::string_view s, std::uint64_t h = fnv1a_start) {
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

}  // namespace pipeoffload
