// pipeoffload/comm/handshake.hpp: the start-up handshake, for any communicator.
//
// Ranks started with different configurations (a different schedule, shape, model, or a
// different pipeoffload build) do not fail loudly on their own: they post sends and receives
// that never match and hang, or exchange tensors of the wrong meaning. Before the first send,
// every rank therefore contributes a hash of each named field of its configuration; every rank
// sees every hash (all_gather), so all of them find the same first differing field and throw
// the same sentence, naming the field and both values.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../fnv1a.hpp"
#include "../version.hpp"
#include "communicator.hpp"

namespace pipeoffload {

/// One named part of a rank's configuration, as text (e.g. {"shape", "d=4 v=2 m=8"}).
struct HandshakeField {
  std::string name;
  std::string value;
};

namespace detail {

/// FNV-1a, cut to 52 bits so that it travels exactly in a double (all_gather's type).
inline double handshake_hash(const std::string& s) { return static_cast<double>(fnv1a(s) >> 12); }

// A value travels as 6 bytes per double (48 bits: exact) after its length; longer values are
// cut, which only shortens the message (the comparison uses the full-length hash).
inline constexpr std::size_t handshake_text_doubles = 24;

inline std::vector<double> pack_text(const std::string& s) {
  std::vector<double> out(handshake_text_doubles, 0.0);
  const std::size_t n = std::min(s.size(), (handshake_text_doubles - 1) * 6);
  out[0] = static_cast<double>(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t w = 1 + i / 6;
    out[w] += static_cast<double>(static_cast<std::uint64_t>(static_cast<unsigned char>(s[i])) << (8 * (i % 6)));
  }
  return out;
}

inline std::string unpack_text(std::span<const double> in) {
  const std::size_t n = std::min(static_cast<std::size_t>(in[0]), (handshake_text_doubles - 1) * 6);
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) {
    const auto w = static_cast<std::uint64_t>(in[1 + i / 6]);
    s[i] = static_cast<char>((w >> (8 * (i % 6))) & 0xff);
  }
  return s;
}

}  // namespace detail

/// The fields every pipeline agrees on: the pipeoffload version, the schedule and the shape.
/// Callers append their own (model, data, optimizer).
inline std::vector<HandshakeField> handshake_fields(const ScheduleSpec& spec, const Shape& shape) {
  std::string sched = schedule_name(spec, shape.v);
  if (spec.family == Family::grouped && spec.group.kind == GroupSpec::Kind::number) sched += " (g=" + std::to_string(spec.group.value) + ")";
  return {{"pipeoffload version", version},
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
  const double head[2] = {static_cast<double>(fields.size()), detail::handshake_hash(names)};
  std::vector<double> heads(2 * d);
  comm.all_gather(std::span<const double>(head), std::span(heads));
  for (std::size_t r = 1; r < d; ++r)
    if (heads[2 * r] != heads[0] || heads[2 * r + 1] != heads[1])
      throw handshake_error("handshake: ranks disagree on the list of configuration fields: rank 0 has " + std::to_string(static_cast<long long>(heads[0])) +
                            " fields, rank " + std::to_string(r) + " has " + std::to_string(static_cast<long long>(heads[2 * r])) +
                            (heads[2 * r] == heads[0] ? " with other names" : "") + "; they were built from different pipeoffload sources");
  // Round 2: one hash per field value.
  const std::size_t n = fields.size();
  std::vector<double> mine(n), all(n * d);
  for (std::size_t i = 0; i < n; ++i) mine[i] = detail::handshake_hash(fields[i].value);
  comm.all_gather(std::span<const double>(mine), std::span(all));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t r = 1; r < d; ++r) {
      if (all[r * n + i] == all[i]) continue;
      // Round 3 (every rank reaches it, having seen the same hashes): the values, for the message.
      const std::vector<double> text = detail::pack_text(fields[i].value);
      std::vector<double> texts(text.size() * d);
      comm.all_gather(std::span<const double>(text), std::span(texts));
      const auto value_of = [&](std::size_t q) {
        return detail::unpack_text(std::span<const double>(texts).subspan(q * text.size(), text.size()));
      };
      throw handshake_error("handshake: ranks disagree on " + fields[i].name + ": rank 0 has '" + value_of(0) + "', rank " + std::to_string(r) + " has '" +
                            value_of(r) + "'; start every rank with the same configuration");
    }
}

template <collective C>
void handshake(C& comm, const std::vector<HandshakeField>& fields) {
  handshake(comm, std::span<const HandshakeField>(fields));
}

}  // namespace pipeoffload
