// samples/cli.hpp: the one command-line parser of the samples and tools/pipeoffload-plan: flags
// scanned against a table, checked numbers and choices, the schedule options (--schedule NAME,
// --group G), and the figures the samples print.
//
// A bad argument is a cli::bad_argument whose message names the flag, the value and the
// allowed range; each program's main prints it after its own name and exits with status 2.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include <pipeoffload/error.hpp>
#include <pipeoffload/schedule/schedule.hpp>  // po::find_schedule, po::GroupSpec
#include <pipeoffload/sim/render.hpp>         // po::detail::fmt

namespace cli {

namespace po = pipeoffload;

struct bad_argument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A user's text quoted for a one-line message: control characters shown as '?', long text cut.
inline std::string quote(std::string_view s) {
  std::string out = "'";
  for (std::size_t i = 0; i < s.size() && i < 40; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out += (c < 0x20 || c == 0x7f) ? '?' : s[i];
  }
  return out + (s.size() > 40 ? "...'" : "'");
}

/// One option a program takes; a switch takes no value.
struct Flag {
  std::string_view name;
  bool takes_value = true;
};

/// Whether the command line asks for --help (or -h), anywhere on it.
inline bool wants_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") return true;
  return false;
}

/// Prints `usage` and ends the process with status 0 when the command line asks for --help.
inline void help(int argc, char** argv, const char* usage) {
  if (!wants_help(argc, argv)) return;
  std::fputs(usage, stdout);
  std::exit(0);
}

/// parse()'s result; when it throws bad_argument, prints "program: sentence" to stderr and ends
/// the process with status 2 (every program's answer to a bad command line).
template <class Parse>
auto parsed_or_exit(const char* program, Parse&& parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const bad_argument& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    std::exit(2);
  }
}

/// A command line's options as given: flag -> value ("" for a switch). Each flag is written
/// `--name value` or `--name=value`; unknown, repeated and value-less flags are refused.
class Args {
 public:
  Args(int argc, char** argv, std::span<const Flag> flags) {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (a.size() < 3 || a.substr(0, 2) != "--")
        throw bad_argument("unexpected argument " + quote(a) + "; options start with -- (see --help)");
      std::string_view name = a, value;
      const auto eq = a.find('=');
      if (eq != std::string_view::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
      }
      const Flag* flag = nullptr;
      for (const Flag& f : flags)
        if (f.name == name) flag = &f;
      if (!flag) throw bad_argument("unknown option " + quote(name) + " (see --help for the options)");
      if (values_.count(name)) throw bad_argument(std::string(name) + " is given twice; give it once");
      if (!flag->takes_value) {
        if (eq != std::string_view::npos)
          throw bad_argument(std::string(name) + " takes no value, got " + quote(value));
      } else if (eq == std::string_view::npos) {
        if (i + 1 >= argc || std::string_view(argv[i + 1]).substr(0, 2) == "--")
          throw bad_argument(std::string(name) + " needs a value (see --help)");
        value = argv[++i];
      }
      values_.emplace(std::string(name), std::string(value));
    }
  }

  /// The value of `flag`, or nullptr when it was not given.
  const std::string* get(std::string_view flag) const {
    const auto it = values_.find(flag);
    return it == values_.end() ? nullptr : &it->second;
  }
  bool has(std::string_view flag) const { return values_.count(flag) != 0; }

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

/// `text` as an integer in [lo, hi], or bad_argument naming `flag` (`note` follows the range).
inline long long to_int(std::string_view flag, std::string_view text, long long lo, long long hi,
                        std::string_view note = "") {
  long long x = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || x < lo || x > hi)
    throw bad_argument(std::string(flag) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "]" + std::string(note) + ", got " + quote(text));
  return x;
}

/// `text` as a finite number in [lo, hi] ((lo, hi] when lo_open), or bad_argument naming `flag`.
inline double to_real(std::string_view flag, std::string_view text, double lo, double hi, bool lo_open) {
  double x = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(x) || x > hi ||
      (lo_open ? x <= lo : x < lo))
    throw bad_argument(std::string(flag) + " must be a number in " + (lo_open ? "(" : "[") + po::detail::fmt(lo) +
                       ", " + po::detail::fmt(hi) + "], got " + quote(text));
  return x;
}

/// `text` if it is one of `choices`, or bad_argument listing them ("a or b", "one of a, b, c").
inline std::string_view one_of(std::string_view flag, std::string_view text,
                               std::initializer_list<std::string_view> choices) {
  std::string list;
  std::size_t i = 0;
  for (std::string_view c : choices) {
    if (c == text) return c;
    list += (i == 0 ? "" : (choices.size() == 2 ? " or " : ", ")) + std::string(c);
    ++i;
  }
  throw bad_argument(std::string(flag) + " must be " + (choices.size() > 2 ? "one of " : "") + list + ", got " +
                     quote(text));
}

/// The spec `--schedule name` names (po::find_schedule), or bad_argument listing the names.
inline po::ScheduleSpec schedule(const std::string& name) {
  if (const po::NamedSchedule* s = po::find_schedule(name)) return s->spec;
  throw bad_argument("--schedule must be one of " + po::schedule_names() + ", got " + quote(name));
}

/// `spec` (of --schedule `name`) with GIS(g)'s --group on d ranks: needed by gis-g, in
/// [ceil(d/2), d] (po::GroupSpec::smallest), refused by every other family.
inline po::ScheduleSpec with_group(po::ScheduleSpec spec, const std::string& name, const std::string* group, int d) {
  const int lo = po::GroupSpec::smallest(d);
  if (name == "gis-g") {
    if (!group)
      throw bad_argument("--schedule gis-g needs --group G, an integer in [" + std::to_string(lo) + ", " +
                         std::to_string(d) + "] (ceil(d/2) to d)");
    spec.group.value =
        static_cast<int>(to_int("--group", *group, lo, d, " (ceil(d/2) to d for --ranks " + std::to_string(d) + ")"));
  } else if (group) {
    throw bad_argument("--group applies only to --schedule gis-g, not " + name);
  }
  return spec;
}

/// The schedule of `--schedule name` and `--group G` on d ranks.
inline po::ScheduleSpec schedule_option(const std::string& name, const std::string* group, int d) {
  return with_group(schedule(name), name, group, d);
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

/// --copy-streams and --duplex-slowdown (po::Costs::copy_streams and duplex_slowdown): 1 or 2
/// streams, or 0 for "auto" where `allow_auto`; a slowdown only beside a second stream.
struct CopyStreams {
  int streams = 1;
  double slowdown = 1;
};
inline CopyStreams copy_streams(const Args& args, bool allow_auto) {
  CopyStreams c;
  if (const std::string* v = args.get("--copy-streams")) {
    if (*v != "1" && *v != "2" && !(allow_auto && *v == "auto"))
      throw bad_argument("--copy-streams " + *v + " is not one of 1, 2" + (allow_auto ? ", auto" : ""));
    c.streams = *v == "auto" ? 0 : *v == "2" ? 2 : 1;
  }
  if (const std::string* v = args.get("--duplex-slowdown")) {
    if (c.streams == 1)
      throw bad_argument(std::string("--duplex-slowdown needs --copy-streams 2") + (allow_auto ? " or auto" : "") +
                         " (one copy stream never copies both ways)");
    c.slowdown = to_real("--duplex-slowdown", *v, 1, 100, false);
  }
  return c;
}

}  // namespace cli
