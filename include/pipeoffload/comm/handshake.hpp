// pipeoffload/comm/handshake.hpp: the start-up handshake, for any communicator.
//
// Ranks started with different configurations (a different schedule, shape, model, or a
// different pipeoffload build) do not fail loudly on their own: they post sends and receives
// that never match and hang, or exchange tensors of the wrong meaning. Before the first send,
// every rank therefore contributes a hash (64-bit FNV-1a) of each named field of its
// configuration; every rank sees every hash (all_gather), so all of them find the same first
// differing field and throw the same sentence, naming the field and both values.
/// @file
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"
#include "../fnv1a.hpp"
#include "../version.hpp"
#include "communicator.hpp"

namespace pipeoffload {

/// One named part of a rank's configuration, as text (e.g. {"shape", "d=4 v=2 m=8"}).
struct HandshakeField {
  std::string name;   ///< what the field is (e.g. "shape")
  std::string value;  ///< its value on this rank, as text
};

namespace detail {

/// A text as it travels in an all_gather (a configuration value, a stage's name): its first
/// `capacity` bytes and its length. Longer texts are cut, which only shortens a message (the
/// handshake compares the full values' hashes).
struct ShortText {
  static constexpr std::size_t capacity = 138;
  std::uint32_t size = 0;
  std::array<char, capacity> bytes{};

  static ShortText of(std::string_view s) {
    ShortText t;
    t.size = static_cast<std::uint32_t>(std::min(s.size(), capacity));
    std::copy_n(s.data(), t.size, t.bytes.data());
    return t;
  }
  std::string str() const { return std::string(bytes.data(), std::min<std::size_t>(size, capacity)); }
};

}  // namespace detail

/// The fields every pipeline agrees on: the pipeoffload version, the schedule and the shape.
/// Callers append their own (model, data, optimizer).
inline std::vector<HandshakeField> handshake_fields(const ScheduleSpec& spec, const Shape& shape) {
  std::string sched = schedule_name(spec, shape.v);
  if (spec.family == Family::grouped && spec.group.kind == GroupSpec::Kind::number)
    sched += " (g=" + std::to_string(spec.group.value) + ")";
  return {
      {"pipeoffload version", version},
      {"schedule", sched},
      {"shape", "d=" + std::to_string(shape.d) + " v=" + std::to_string(shape.v) + " m=" + std::to_string(shape.m)}};
}

/// Collective: every rank calls it with its own fields, before its first send. Returns when
/// all ranks hold the same names and values; otherwise throws handshake_error on every rank,
/// naming the first differing field, the lowest rank that differs from rank 0, and both values.
/// @code
///   auto fields = po::handshake_fields(spec, shape);
///   fields.push_back({"model", "layers=8 hidden=64"});
///   po::handshake(comm, fields);   // throws on every rank if any rank differs
/// @endcode
template <collective C>
void handshake(C& comm, std::span<const HandshakeField> fields) {
  const std::size_t d = static_cast<std::size_t>(comm.size());
  // Round 1: the list of field names. It must agree before the per-field round can (the
  // all_gather count must be the same on every rank).
  std::string names;
  for (const auto& f : fields) names += f.name + '\n';
  const std::uint64_t head[2] = {static_cast<std::uint64_t>(fields.size()), fnv1a(names)};
  std::vector<std::uint64_t> heads(2 * d);
  comm.all_gather(std::span<const std::uint64_t>(head), std::span(heads));
  for (std::size_t r = 1; r < d; ++r)
    if (heads[2 * r] != heads[0] || heads[2 * r + 1] != heads[1])
      throw handshake_error("handshake: ranks disagree on the list of configuration fields: rank 0 has " +
                            std::to_string(heads[0]) + " fields, rank " + std::to_string(r) + " has " +
                            std::to_string(heads[2 * r]) + (heads[2 * r] == heads[0] ? " with other names" : "") +
                            "; they were built from different pipeoffload sources");
  // Round 2: one hash per field value.
  const std::size_t n = fields.size();
  std::vector<std::uint64_t> mine(n), all(n * d);
  for (std::size_t i = 0; i < n; ++i) mine[i] = fnv1a(fields[i].value);
  comm.all_gather(std::span<const std::uint64_t>(mine), std::span(all));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t r = 1; r < d; ++r) {
      if (all[r * n + i] == all[i]) continue;
      // Round 3 (every rank reaches it, having seen the same hashes): the values, for the message.
      const detail::ShortText text = detail::ShortText::of(fields[i].value);
      std::vector<detail::ShortText> texts(d);
      comm.all_gather(std::span<const detail::ShortText>(&text, 1), std::span(texts));
      throw handshake_error("handshake: ranks disagree on " + fields[i].name + ": rank 0 has '" + texts[0].str() +
                            "', rank " + std::to_string(r) + " has '" + texts[r].str() +
                            "'; start every rank with the same configuration");
    }
}

/// The same, from a vector of fields.
template <collective C>
void handshake(C& comm, const std::vector<HandshakeField>& fields) {
  handshake(comm, std::span<const HandshakeField>(fields));
}

}  // namespace pipeoffload
