// pipeoffload/sim/render.hpp: text, CSV, JSON and Chrome-trace views of a timed schedule (the SVG
// view: svg.hpp).
//
// Pure functions from a Program and a SimResult (simulated, or measured by a real run and
// filled into the same per-op start/end vectors) to a std::string; the caller writes it out.
// The plan tool (tools/pipeoffload-plan.cpp) documents the formats; other tools parse them,
// so field names and orders here are a contract.
/// @file
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "../schedule/program.hpp"
#include "simulate.hpp"

namespace pipeoffload {

/// One op with its simulated (or measured) time, as every renderer lists them.
struct TimedOp {
  int rank = 0;       ///< the rank that runs it, 0 .. d-1
  bool copy = false;  ///< on the copy stream (O, R) rather than the compute stream
  int index = 0;      ///< position in its stream
  Op op{};            ///< the op (kind, stage, microbatch)
  double start = 0,   ///< when it starts (the simulation's time unit, or seconds when measured)
      end = 0;        ///< when it ends, likewise
};

/// Every op of every rank, sorted by rank, then start time; at equal starts the compute stream
/// comes before the copy stream, then the lower stream index first.
inline std::vector<TimedOp> timed_ops(const Program& p, const SimResult& sim) {
  std::vector<TimedOp> out;
  const std::size_t nr = std::min(p.ranks.size(), sim.ranks.size());
  for (std::size_t r = 0; r < nr; ++r) {
    const RankProgram& rp = p.ranks[r];
    const RankSim& rs = sim.ranks[r];
    // A partially measured run may time fewer ops than the program has: list what is timed.
    const std::size_t nc = std::min({rp.compute.size(), rs.compute_start.size(), rs.compute_end.size()});
    const std::size_t nk = std::min({rp.copy.size(), rs.copy_start.size(), rs.copy_end.size()});
    const std::size_t first = out.size();
    for (std::size_t x = 0; x < nc; ++x)
      out.push_back(
          {static_cast<int>(r), false, static_cast<int>(x), rp.compute[x], rs.compute_start[x], rs.compute_end[x]});
    for (std::size_t y = 0; y < nk; ++y)
      out.push_back({static_cast<int>(r), true, static_cast<int>(y), rp.copy[y], rs.copy_start[y], rs.copy_end[y]});
    std::sort(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(), [](const TimedOp& a, const TimedOp& b) {
      if (a.start != b.start) return a.start < b.start;
      if (a.copy != b.copy) return !a.copy;
      return a.index < b.index;
    });
  }
  return out;
}

namespace detail {

/// A time or count as plain decimal text: integers as "12", fractions as "1.5" (9 significant
/// digits), never an exponent, never "nan" (non-finite values print as 0: JSON has no NaN).
inline std::string fmt(double x) {
  if (!std::isfinite(x)) return "0";
  char buf[400];
  if (x == std::floor(x) && std::fabs(x) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", x == 0 ? 0.0 : x);  // no "-0"
    return buf;
  }
  std::snprintf(buf, sizeof buf, "%.9g", x);
  if (std::string_view(buf).find('e') == std::string_view::npos) return buf;
  // Very large or very small: fixed notation with 9 significant digits, trailing zeros cut.
  const int mag = static_cast<int>(std::floor(std::log10(std::fabs(x))));
  const int decimals = std::clamp(8 - mag, 0, 40);
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  std::string s = buf;
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  return s == "-0" ? "0" : s;
}

/// A JSON string literal (quotes included).
inline std::string json_str(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"')
      out += "\\\"";
    else if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else
      out += ch;
  }
  return out + "\"";
}

/// Number of offloaded chunks of a program (its offload selection is always a prefix here).
inline int offloaded_chunks(const Program& p) { return offload::count(p.spec.offload, p.v()); }

/// JSON array of one per-rank value.
template <class Get>
std::string json_rank_array(const SimResult& sim, Get get) {
  std::string s = "[";
  for (std::size_t r = 0; r < sim.ranks.size(); ++r) {
    if (r) s += ",";
    s += fmt(get(sim.ranks[r]));
  }
  return s + "]";
}

/// Ops' label in traces: op, microbatch, chunk ("F3.1").
inline std::string op_label(const Program& p, const Op& op) {
  return std::string(op_name(op.kind)) + num(op.mb) + "." + num(p.shape.chunk_of(op.stage));
}

}  // namespace detail

/// CSV: header `rank,op,chunk,stage,microbatch,start,end`, one row per op of both streams in
/// timed_ops() order.
inline std::string render_csv(const Program& p, const SimResult& sim) {
  std::string s = "rank,op,chunk,stage,microbatch,start,end\n";
  for (const TimedOp& t : timed_ops(p, sim)) {
    s += detail::num(t.rank);
    s += ',';
    s += op_name(t.op.kind);
    s += ',' + detail::num(p.shape.chunk_of(t.op.stage)) + ',' + detail::num(t.op.stage) + ',' + detail::num(t.op.mb) +
         ',' + detail::fmt(t.start) + ',' + detail::fmt(t.end) + '\n';
  }
  return s;
}

/// JSON: schedule, shape, group, offload_chunks, copy_streams, k, costs, makespan,
/// bubble_fraction, max_peak; per-rank arrays warmup, peak, bubble, busy; and "ops" in
/// timed_ops() order, each on its stream: "compute", "copy", and with two copy streams
/// "reload" for the reloads' own.
inline std::string render_json(const Program& p, const SimResult& sim) {
  using detail::fmt;
  std::string s = "{\n";
  s += "  \"schedule\": " + detail::json_str(schedule_name(p.spec, p.v())) + ",\n";
  s += "  \"ranks\": " + detail::num(p.d()) + ",\n";
  s += "  \"chunks\": " + detail::num(p.v()) + ",\n";
  s += "  \"microbatches\": " + detail::num(p.m()) + ",\n";
  s += "  \"group\": " + detail::num(p.group) + ",\n";
  s += "  \"offload_chunks\": " + detail::num(detail::offloaded_chunks(p)) + ",\n";
  s += "  \"copy_streams\": " + detail::num(p.costs.duplex() ? 2 : 1) + ",\n";
  s += "  \"k\": " + fmt(p.costs.k) + ",\n";
  s += "  \"costs\": {\"f\": " + fmt(p.costs.f) + ", \"b\": " + fmt(p.costs.b) + ", \"w\": " + fmt(p.costs.w) +
       ", \"comm\": " + fmt(p.costs.comm) + "},\n";
  s += "  \"makespan\": " + fmt(sim.makespan) + ",\n";
  s += "  \"bubble_fraction\": " + fmt(sim.bubble_fraction()) + ",\n";
  s += "  \"max_peak\": " + fmt(sim.max_peak()) + ",\n";
  s += "  \"warmup\": " + detail::json_rank_array(sim, [](const RankSim& r) { return static_cast<double>(r.warmup); }) +
       ",\n";
  s += "  \"peak\": " + detail::json_rank_array(sim, [](const RankSim& r) { return r.peak; }) + ",\n";
  s += "  \"bubble\": " + detail::json_rank_array(sim, [](const RankSim& r) { return r.bubble; }) + ",\n";
  s += "  \"busy\": " + detail::json_rank_array(sim, [](const RankSim& r) { return r.busy; }) + ",\n";
  s += "  \"ops\": [";
  bool first = true;
  for (const TimedOp& t : timed_ops(p, sim)) {
    s += first ? "\n    " : ",\n    ";
    first = false;
    const char* stream = !t.copy ? "compute" : p.costs.duplex() && t.op.kind == OpKind::R ? "reload" : "copy";
    s += "{\"rank\": " + detail::num(t.rank) + ", \"stream\": \"" + stream + "\", \"op\": \"" + op_name(t.op.kind) +
         "\", \"stage\": " + detail::num(t.op.stage) + ", \"chunk\": " + detail::num(p.shape.chunk_of(t.op.stage)) +
         ", \"microbatch\": " + detail::num(t.op.mb) + ", \"start\": " + fmt(t.start) + ", \"end\": " + fmt(t.end) +
         "}";
  }
  s += first ? "]\n}\n" : "\n  ]\n}\n";
  return s;
}

/// Chrome trace event format (chrome://tracing, Perfetto): one process per rank (pid = rank),
/// thread 0 "compute" and thread 1 "copy" (with two copy streams thread 2 "reload" beside it),
/// an "X" event per op named op+microbatch.chunk, and
/// an "activation" counter per rank from the memory timeline. One time unit = 1000 us.
inline std::string render_chrome_trace(const Program& p, const SimResult& sim) {
  using detail::fmt;
  constexpr double us = 1000;
  std::string s = "{\"displayTimeUnit\": \"ms\",\n\"traceEvents\": [\n";
  bool first = true;
  const auto add = [&](const std::string& ev) {
    if (!first) s += ",\n";
    first = false;
    s += ev;
  };
  for (int r = 0; r < p.d(); ++r) {
    const std::string pid = detail::num(r);
    add("{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " + pid + ", \"tid\": 0, \"args\": {\"name\": \"rank " +
        pid + "\"}}");
    add("{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": " + pid +
        ", \"tid\": 0, \"args\": {\"sort_index\": " + pid + "}}");
    add("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + pid +
        ", \"tid\": 0, \"args\": {\"name\": \"compute\"}}");
    add("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + pid + ", \"tid\": 1, \"args\": {\"name\": \"copy\"}}");
    if (p.costs.duplex())
      add("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " + pid +
          ", \"tid\": 2, \"args\": {\"name\": \"reload\"}}");
  }
  for (const TimedOp& t : timed_ops(p, sim)) {
    add("{\"ph\": \"X\", \"name\": \"" + detail::op_label(p, t.op) + "\", \"cat\": \"" + (t.copy ? "copy" : "compute") +
        "\", \"pid\": " + detail::num(t.rank) + ", \"tid\": " +
        (!t.copy                                      ? "0"
         : p.costs.duplex() && t.op.kind == OpKind::R ? "2"
                                                      : "1") +
        ", \"ts\": " + fmt(t.start * us) + ", \"dur\": " + fmt((t.end - t.start) * us) + ", \"args\": {\"stage\": " +
        detail::num(t.op.stage) + ", \"chunk\": " + detail::num(p.shape.chunk_of(t.op.stage)) +
        ", \"microbatch\": " + detail::num(t.op.mb) + "}}");
  }
  for (std::size_t r = 0; r < sim.ranks.size(); ++r)
    for (const MemoryPoint& mp : sim.ranks[r].memory)
      add("{\"ph\": \"C\", \"name\": \"activation\", \"pid\": " + detail::num(static_cast<long long>(r)) +
          ", \"ts\": " + fmt(mp.time * us) + ", \"args\": {\"alive\": " + fmt(mp.alive) + "}}");
  s += "\n]}\n";
  return s;
}

namespace detail {

/// The quantum of the text grid: one time step per column. Uniform costs give the unit-cost
/// grid (step = T_F); otherwise the shortest compute pass, so every pass gets a column.
inline double text_step(const Program& p) {
  double step = std::min({p.costs.f, p.costs.b, p.costs.w});
  for (int s = 0; s < p.stages(); ++s) step = std::min({step, p.costs.F(s), p.costs.B(s), p.costs.W(s)});
  return step > 0 && std::isfinite(step) ? step : 1.0;
}

/// Pads or cuts `s` to exactly `n` characters.
inline std::string fit(std::string s, std::size_t n) {
  s.resize(n, ' ');
  return s;
}

}  // namespace detail

/// Terminal view: a header line of key=value pairs, a rank-by-time grid (one row per rank's
/// compute stream, one for each copy stream in use: "copy", and with two copy streams "reload"
/// for the reloads' own; cells show op letter and microbatch, with
/// chunk 1 in lower case when v <= 2 and ".chunk" appended when v > 2, '.' for idle), and one
/// `rank R: warmup=W peak=P bubble=B` line per rank. The grid is cut at `max_width` characters.
inline std::string render_text(const Program& p, const SimResult& sim, int max_width = 240) {
  using detail::fmt;
  std::string s = "schedule=" + schedule_name(p.spec, p.v()) + " ranks=" + detail::num(p.d()) +
                  " chunks=" + detail::num(p.v()) + " microbatches=" + detail::num(p.m()) +
                  " group=" + detail::num(p.group) + " offload_chunks=" + detail::num(detail::offloaded_chunks(p)) +
                  " k=" + fmt(p.costs.k) +
                  (p.costs.duplex() ? " copy_streams=2 duplex_slowdown=" + fmt(p.costs.duplex_slowdown) : "") +
                  " makespan=" + fmt(sim.makespan) + " bubble_fraction=" + fmt(sim.bubble_fraction()) + "\n";

  const double step = detail::text_step(p);
  // Columns in double first: a makespan of very many steps must not overflow a long long.
  const long long total_cols = static_cast<long long>(std::clamp(std::ceil(sim.makespan / step - 1e-9), 1.0, 1e15));
  const int mb_digits = static_cast<int>(detail::num(std::max(0, p.m() - 1)).size());
  // Two chunks show as letter case; more need the chunk number in the cell ("F3.2").
  const bool by_case = p.v() <= 2;
  const int chunk_digits = by_case ? 0 : 1 + static_cast<int>(detail::num(p.v() - 1).size());
  const int cw = 2 + mb_digits + chunk_digits;  // letter, microbatch, [.chunk], one space
  const std::string row_label = "rank " + detail::num(std::max(0, p.d() - 1));
  const bool duplex = p.costs.duplex();  // a "reload" row per rank: one more column of labels
  const int lw = std::max(static_cast<int>(row_label.size()) + 2, duplex ? 9 : 0);
  const long long fit_cols = std::max(1, (max_width - lw) / cw);
  const long long cols = std::min(total_cols, fit_cols);

  const char* cells = p.v() == 1 ? "op + microbatch"
                      : by_case  ? "op + microbatch, upper case chunk 0, lower case chunk 1"
                                 : "op + microbatch.chunk";
  s += "grid: time step " + fmt(step) + " per column; cell = " + cells + "; . = idle\n";
  // Time ruler: a tick every 5 columns, labelled where the label fits.
  std::string ruler(static_cast<std::size_t>(lw + cols * cw), ' ');
  for (long long c = 0; c < cols; c += 5) {
    const std::string t = fmt(static_cast<double>(c) * step);
    const auto at = static_cast<std::size_t>(lw + c * cw);
    if (at + t.size() <= ruler.size()) ruler.replace(at, t.size(), t);
  }
  while (!ruler.empty() && ruler.back() == ' ') ruler.pop_back();
  s += ruler + "\n";

  const std::vector<TimedOp> ops = timed_ops(p, sim);
  // Per rank: compute, copy (with two copy streams: the offloads), the reloads' stream.
  std::vector<std::string> rows(p.ranks.size() * 3);
  for (std::size_t r = 0; r < p.ranks.size(); ++r)
    for (int stream = 0; stream < 3; ++stream) {
      std::string& row = rows[r * 3 + static_cast<std::size_t>(stream)];
      row.assign(static_cast<std::size_t>(cols * cw), ' ');
      for (long long c = 0; c < cols; ++c) row[static_cast<std::size_t>(c * cw)] = '.';
    }
  for (const TimedOp& t : ops) {
    // Rounding (not flooring) keeps ops that start half a step off the grid, as copies and
    // the compute they gate do, one column wide; consecutive ops of a stream never overlap.
    const double c0d = std::round(t.start / step);
    if (!(c0d >= 0 && c0d < static_cast<double>(cols))) continue;
    const auto c0 = static_cast<long long>(c0d);
    const long long c1 =
        std::max(c0 + 1, static_cast<long long>(std::min(std::round(t.end / step), static_cast<double>(cols))));
    std::string label = op_name(t.op.kind);
    if (by_case && p.shape.chunk_of(t.op.stage) == 1)
      for (char& ch : label) ch = static_cast<char>(ch - 'A' + 'a');
    label += detail::num(t.op.mb);
    if (!by_case) label += "." + detail::num(p.shape.chunk_of(t.op.stage));
    // The op covers columns [c0, c1): its label, then '-' to its last column.
    const auto span = static_cast<std::size_t>((c1 - c0) * cw - 1);
    std::string cell = label.size() >= span ? label.substr(0, span) : label + std::string(span - label.size(), '-');
    const std::size_t stream = !t.copy ? 0 : duplex && t.op.kind == OpKind::R ? 2 : 1;
    rows[static_cast<std::size_t>(t.rank) * 3 + stream].replace(static_cast<std::size_t>(c0 * cw), span, cell);
  }
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    std::string line =
        detail::fit("rank " + detail::num(static_cast<long long>(r)), static_cast<std::size_t>(lw)) + rows[r * 3];
    while (!line.empty() && line.back() == ' ') line.pop_back();
    s += line + "\n";
    if (p.ranks[r].copy.empty()) continue;
    for (int stream = 1; stream < (duplex ? 3 : 2); ++stream) {
      line = detail::fit(stream == 1 ? "  copy" : "  reload", static_cast<std::size_t>(lw)) +
             rows[r * 3 + static_cast<std::size_t>(stream)];
      while (!line.empty() && line.back() == ' ') line.pop_back();
      s += line + "\n";
    }
  }
  if (cols < total_cols)
    s += "(grid cut: showing t < " + fmt(static_cast<double>(cols) * step) + " of makespan " + fmt(sim.makespan) +
         "; csv, json and svg list every op)\n";
  for (std::size_t r = 0; r < sim.ranks.size(); ++r) {
    const RankSim& rs = sim.ranks[r];
    s += "rank " + detail::num(static_cast<long long>(r)) + ": warmup=" + detail::num(rs.warmup) +
         " peak=" + fmt(rs.peak) + " bubble=" + fmt(rs.bubble) + "\n";
  }
  return s;
}

}  // namespace pipeoffload
