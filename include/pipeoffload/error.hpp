// pipeoffload/error.hpp: every exception type the library throws, each derived from po::error.
//
// The library never prints or exits on its own: misuse that can only be seen at run time throws
// one of these, with a message that names the bad value and the allowed range. In a constant
// expression the throw itself is the compile error, and the failing call's line (which carries
// the message literal) is what the compiler shows.
/// @file
#pragma once

#include <stdexcept>
#include <string>

namespace pipeoffload {

/// Base of every error the library throws.
struct error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A schedule shape, cost model or option outside its allowed range.
struct shape_error : error {
  using error::error;
};

/// A schedule that breaks one of validate()'s rules (a missing pass, an unmet dependency,
/// a P2P plan that deadlocks, a reload after its backward, ...).
struct schedule_error : error {
  using error::error;
};

/// A NaN or infinity where a step computes: in an activation, a loss, an input gradient or the
/// gradient norm. Every rank throws the same one (its message names rank, stage and op), and
/// the communicator stays usable: a loss-scaling caller may zero_grad() and go on.
struct nonfinite_error : error {
  using error::error;
};

/// A wait that was cut short because the device or a peer failed; what() names the failure.
struct aborted_error : error {
  using error::error;
};

/// A message that is not the one the receiver expected, or a communicator misused.
struct comm_error : error {
  using error::error;
};

/// Ranks whose configurations differ at the start-up handshake (comm/handshake.hpp); the
/// message names the field and both values.
struct handshake_error : comm_error {
  using comm_error::comm_error;
};

/// A checkpoint that cannot be written or read (the message names the file and the reason).
struct checkpoint_error : error {
  using error::error;
};

/// A CUDA, cuBLAS, cuDNN or NCCL call that failed (backend/cuda/check.hpp, comm/nccl/nccl.hpp).
struct cuda_error : error {
  using error::error;
};

namespace detail {

/// Decimal text of an integer, usable in constant expressions (std::to_string is not).
constexpr std::string num(long long x) {
  std::string s;
  const bool neg = x < 0;
  unsigned long long u = neg ? 0ull - static_cast<unsigned long long>(x) : static_cast<unsigned long long>(x);
  do {
    s.insert(s.begin(), static_cast<char>('0' + u % 10));
    u /= 10;
  } while (u != 0);
  if (neg) s.insert(s.begin(), '-');
  return s;
}

/// Throws shape_error("<what> = <got> is outside the allowed range [lo, hi]") unless
/// lo <= got <= hi. Pass the description as a string literal at the call site: in a constant
/// expression the compiler prints that call, so the sentence is visible in the error.
constexpr void require_range(const char* what, long long got, long long lo, long long hi) {
  if (got < lo || got > hi)
    throw shape_error(std::string(what) + " = " + num(got) + " is outside the allowed range [" + num(lo) + ", " +
                      num(hi) + "]");
}

}  // namespace detail
}  // namespace pipeoffload
