// samples/cli.hpp: what the samples share on their command lines and in their reports: checked
// numbers, the schedule options (--schedule NAME, --group G), and the figures they print.
//
// A bad argument is a sample::bad_argument whose message names the flag, the value and the
// allowed range; each sample's main prints it after its own name and exits with status 2.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include <pipeoffload/error.hpp>
#include <pipeoffload/schedule/schedule.hpp>  // po::parse_schedule

namespace sample {

namespace po = pipeoffload;

struct bad_argument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// `text` as an integer in [lo, hi], or bad_argument naming `flag`.
inline long long to_int(const std::string& flag, const std::string& text, long long lo, long long hi) {
  long long x = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || x < lo || x > hi)
    throw bad_argument(flag + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                       text + "'");
  return x;
}

/// `text` as a finite number in [lo, hi] ((lo, hi] when lo_open), or bad_argument naming `flag`.
inline double to_real(const std::string& flag, const std::string& text, double lo, double hi, bool lo_open) {
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(x) || x > hi || (lo_open ? x <= lo : x < lo))
    throw bad_argument(flag + " must be a number in " + (lo_open ? "(" : "[") + std::to_string(lo) + ", " +
                       std::to_string(hi) + "], got '" + text + "'");
  return x;
}

/// The schedule of `--schedule name` and `--group G` on d ranks: po::parse_schedule's spec, with
/// GIS(g)'s group (needed by gis-g, in [ceil(d/2), d], refused by every other family).
inline po::ScheduleSpec schedule_option(const std::string& name, const std::optional<std::string>& group, int d) {
  po::ScheduleSpec spec{};
  try {
    spec = po::parse_schedule(name);
  } catch (const po::shape_error& e) {
    throw bad_argument(std::string("--") + e.what());
  }
  const int lo = po::GroupSpec::smallest(d);
  if (name == "gis-g") {
    if (!group)
      throw bad_argument("--schedule gis-g needs --group G, an integer in [" + std::to_string(lo) + ", " +
                         std::to_string(d) + "]");
    spec.group.value = static_cast<int>(to_int("--group", *group, lo, d));
  } else if (group) {
    throw bad_argument("--group applies only to --schedule gis-g, not " + name);
  }
  return spec;
}

/// 16 hex digits (the samples' parameter hashes).
inline std::string hex64(std::uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

/// Bytes as MiB with two decimals.
inline std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / (1024.0 * 1024.0));
  return buf;
}
inline std::string mib(std::size_t bytes) { return mib(static_cast<double>(bytes)); }

}  // namespace sample
