// pipeoffload/sim/svg.hpp: the SVG view of a timed schedule, a Gantt chart (render_svg).
//
// A pure function from a Program and a SimResult (simulated, or measured by a real run and
// filled into the same per-op start/end vectors) to a standalone SVG document; the caller
// writes it out. The other views, and the op list they all draw (timed_ops), are in render.hpp.
/// @file
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../schedule/program.hpp"
#include "render.hpp"
#include "simulate.hpp"

namespace pipeoffload {

namespace detail {

/// Text escaped for XML content and attribute values.
inline std::string xml_str(std::string_view s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters other than tab and newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(ch) >= 0x20 || ch == '\t' || ch == '\n') out += ch;
    }
  }
  return out;
}

struct Rgb {
  double r = 0, g = 0, b = 0;  // 0..1
};

inline Rgb mix(Rgb a, Rgb b, double t) { return {a.r + (b.r - a.r) * t, a.g + (b.g - a.g) * t, a.b + (b.b - a.b) * t}; }

inline std::string hex(Rgb c) {
  const auto byte = [](double x) { return static_cast<int>(std::lround(std::clamp(x, 0.0, 1.0) * 255)); };
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", byte(c.r), byte(c.g), byte(c.b));
  return buf;
}

/// Fill colour of chunk c: ten hand-picked distinct hues, then golden-angle hues.
inline Rgb chunk_colour(int c) {
  static constexpr unsigned palette[] = {0x4e79a7, 0xf28e2b, 0x59a14f, 0xe15759, 0x76b7b2,
                                         0xedc948, 0xb07aa1, 0xff9da7, 0x9c755f, 0xbcbd22};
  if (c >= 0 && c < 10) {
    const unsigned x = palette[c];
    return {((x >> 16) & 0xff) / 255.0, ((x >> 8) & 0xff) / 255.0, (x & 0xff) / 255.0};
  }
  // HSL with s = 0.55, l = 0.55 at hue c * 137.5 degrees.
  const double h = std::fmod(c * 137.508, 360.0) / 60.0, l = 0.55, sat = 0.55;
  const double ch = (1 - std::fabs(2 * l - 1)) * sat, x = ch * (1 - std::fabs(std::fmod(h, 2.0) - 1)), m0 = l - ch / 2;
  Rgb o;
  if (h < 1)
    o = {ch, x, 0};
  else if (h < 2)
    o = {x, ch, 0};
  else if (h < 3)
    o = {0, ch, x};
  else if (h < 4)
    o = {0, x, ch};
  else if (h < 5)
    o = {x, 0, ch};
  else
    o = {ch, 0, x};
  return {o.r + m0, o.g + m0, o.b + m0};
}

/// F solid, B darker, W lighter, O like F, R like W: one shade per kind of pass.
inline Rgb shade(Rgb base, OpKind k) {
  switch (k) {
    case OpKind::B:
      return mix(base, {0, 0, 0}, 0.38);
    case OpKind::W:
    case OpKind::R:
      return mix(base, {1, 1, 1}, 0.5);
    default:
      return base;
  }
}

inline const char* text_colour(Rgb c) { return 0.299 * c.r + 0.587 * c.g + 0.114 * c.b > 0.6 ? "#111" : "#fff"; }

/// A "nice" tick spacing (1, 2 or 5 times a power of ten) near `raw`.
inline double nice_step(double raw) {
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double p10 = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0})
    if (f * p10 >= raw) return f * p10;
  return 10 * p10;
}

/// SVG number: pixels with at most two decimals.
inline std::string px(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

/// An arrow-ended box: pointing right (offload, device to host) or left (reload).
inline std::string arrow_box(double x, double y, double w, double h, bool right, const std::string& fill,
                             const std::string& extra) {
  const double tip = std::min(h / 2, w / 3);
  std::string pts;
  if (right)
    pts = px(x) + "," + px(y) + " " + px(x + w - tip) + "," + px(y) + " " + px(x + w) + "," + px(y + h / 2) + " " +
          px(x + w - tip) + "," + px(y + h) + " " + px(x) + "," + px(y + h);
  else
    pts = px(x + tip) + "," + px(y) + " " + px(x + w) + "," + px(y) + " " + px(x + w) + "," + px(y + h) + " " +
          px(x + tip) + "," + px(y + h) + " " + px(x) + "," + px(y + h / 2);
  return "<polygon points=\"" + pts + "\" fill=\"" + fill + "\"" + extra + ">";
}

}  // namespace detail

/// Standalone SVG Gantt chart: per rank a compute row and, where the rank copies, a thinner
/// copy row beneath (two with two copy streams: "copy" for offloads, "reload"); one colour per chunk, F solid, B darker, W lighter, BW split into its B and
/// W parts; offloads as right-pointing and reloads as left-pointing arrows; microbatch numbers
/// where boxes are wide enough; time axis, legend and a title with the schedule and makespan.
/// About 18 px per mean pass, the plot between 480 and 2800 px wide.
inline std::string render_svg(const Program& p, const SimResult& sim) {
  using detail::px;
  const double tau = std::max(1e-300, (p.costs.f + p.costs.b + p.costs.w) / 3);
  const double span = sim.makespan > 0 ? sim.makespan : 1;
  const double plot_w = std::clamp(18.0 * span / tau, 480.0, 2800.0);
  const double sx = plot_w / span;
  const double left = 64, right = 92, top = 48, row_h = 26, copy_h = 13, gap = 8;
  const int d = static_cast<int>(p.ranks.size());

  // With two copy streams (Costs::duplex) a rank that copies has two copy rows: "copy" (the
  // offloads) and "reload", so that an offload and a reload at once do not overdraw each other.
  const int copy_rows = p.costs.duplex() ? 2 : 1;
  std::vector<double> row_y(static_cast<std::size_t>(d));
  double y = top;
  for (int r = 0; r < d; ++r) {
    row_y[static_cast<std::size_t>(r)] = y;
    y += row_h + (p.ranks[static_cast<std::size_t>(r)].copy.empty() ? 0 : copy_rows * (copy_h + 2)) + gap;
  }
  const double axis_y = y - gap + 4;
  const double width = left + plot_w + right;

  // Legend entries laid out left to right, wrapping at the plot's width.
  struct Entry {
    std::string svg;  // drawn at (0, 0), 12 px tall
    std::string label;
    double w;  // swatch width
  };
  std::vector<Entry> legend;
  const int shown_chunks = std::min(p.v(), 16);
  for (int c = 0; c < shown_chunks; ++c)
    legend.push_back({"<rect width=\"14\" height=\"12\" fill=\"" + detail::hex(detail::chunk_colour(c)) + "\"/>",
                      "chunk " + detail::num(c), 14});
  if (p.v() > shown_chunks) legend.push_back({"", "(+" + detail::num(p.v() - shown_chunks) + " more chunks)", 0});
  const detail::Rgb c0{0.55, 0.55, 0.55};  // kinds of pass in neutral grey: colour is the chunk
  const bool fused = fused_backward(p.spec.family);
  legend.push_back({"<rect width=\"14\" height=\"12\" fill=\"" + detail::hex(c0) + "\"/>", "F forward", 14});
  if (fused) {
    legend.push_back({"<rect width=\"8\" height=\"12\" fill=\"" + detail::hex(detail::shade(c0, OpKind::B)) +
                          "\"/><rect x=\"8\" width=\"6\" height=\"12\" fill=\"" +
                          detail::hex(detail::shade(c0, OpKind::W)) + "\"/>",
                      "BW fused backward (B part, W part)", 14});
  } else {
    legend.push_back({"<rect width=\"14\" height=\"12\" fill=\"" + detail::hex(detail::shade(c0, OpKind::B)) + "\"/>",
                      "B activation grad", 14});
    legend.push_back({"<rect width=\"14\" height=\"12\" fill=\"" + detail::hex(detail::shade(c0, OpKind::W)) + "\"/>",
                      "W weight grad", 14});
  }
  bool any_copy = false;
  for (const auto& rp : p.ranks) any_copy = any_copy || !rp.copy.empty();
  if (any_copy) {
    const char* outline = " stroke=\"#333\" stroke-width=\"0.6\"/";
    legend.push_back({detail::arrow_box(0, 0, 22, 12, true, detail::hex(c0), outline), "O offload", 22});
    legend.push_back(
        {detail::arrow_box(0, 0, 22, 12, false, detail::hex(detail::shade(c0, OpKind::R)), outline), "R reload", 22});
  }
  std::vector<std::pair<double, double>> legend_at;  // (x, y) of each entry
  double lx = left, ly = axis_y + 34;
  for (const Entry& e : legend) {
    const double ew = e.w + 5 + 6.2 * static_cast<double>(e.label.size()) + 16;
    if (lx + ew > width - 8 && lx > left) {
      lx = left;
      ly += 20;
    }
    legend_at.push_back({lx, ly});
    lx += ew;
  }
  const double height = ly + 24;

  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) + "\" height=\"" + px(height) +
       "\" viewBox=\"0 0 " + px(width) + " " + px(height) +
       "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  const std::string name = schedule_name(p.spec, p.v());
  std::string title = name + ": d=" + detail::num(p.d()) + ", v=" + detail::num(p.v()) + ", m=" + detail::num(p.m());
  if (p.group > 0) title += ", g=" + detail::num(p.group);
  title += ", offloaded chunks " + detail::num(detail::offloaded_chunks(p)) + ", k=" + detail::fmt(p.costs.k);
  char bf[32];
  std::snprintf(bf, sizeof bf, "%.1f%%", 100 * sim.bubble_fraction());
  std::string sub = "makespan " + detail::fmt(sim.makespan) + ", bubble " + bf + ", max peak " +
                    detail::fmt(sim.max_peak()) + " activation units";
  s += "<title>" + detail::xml_str(title) + "</title>\n";
  s += "<text x=\"" + px(left) + "\" y=\"20\" font-size=\"15\" font-weight=\"bold\">" + detail::xml_str(title) +
       "</text>\n";
  s += "<text x=\"" + px(left) + "\" y=\"37\" fill=\"#444\">" + detail::xml_str(sub) + "</text>\n";

  // Time axis: light grid lines and labels at nice steps.
  const double tick = detail::nice_step(span / std::max(1.0, plot_w / 70));
  s += "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (double t = 0; t <= span + tick * 1e-9; t += tick)
    s += "<line x1=\"" + px(left + t * sx) + "\" y1=\"" + px(top - 4) + "\" x2=\"" + px(left + t * sx) + "\" y2=\"" +
         px(axis_y) + "\"/>\n";
  s += "</g>\n<g fill=\"#333\" text-anchor=\"middle\">\n";
  for (double t = 0; t <= span + tick * 1e-9; t += tick)
    s += "<text x=\"" + px(left + t * sx) + "\" y=\"" + px(axis_y + 13) + "\">" + detail::fmt(t) + "</text>\n";
  s += "</g>\n<line x1=\"" + px(left) + "\" y1=\"" + px(axis_y) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" +
       px(axis_y) + "\" stroke=\"#333\"/>\n";
  s += "<text x=\"" + px(left + plot_w) + "\" y=\"" + px(axis_y + 26) +
       "\" text-anchor=\"end\" fill=\"#444\">time</text>\n";

  // Row labels and per-rank numbers.
  for (int r = 0; r < d; ++r) {
    const double ry = row_y[static_cast<std::size_t>(r)];
    s += "<text x=\"" + px(left - 6) + "\" y=\"" + px(ry + row_h / 2 + 4) + "\" text-anchor=\"end\">rank " +
         detail::num(r) + "</text>\n";
    if (!p.ranks[static_cast<std::size_t>(r)].copy.empty())
      for (int c = 0; c < copy_rows; ++c)
        s += "<text x=\"" + px(left - 6) + "\" y=\"" + px(ry + row_h + 2 + c * (copy_h + 2) + copy_h - 3) +
             "\" text-anchor=\"end\" font-size=\"9\" fill=\"#555\">" + (c == 0 ? "copy" : "reload") + "</text>\n";
    if (static_cast<std::size_t>(r) < sim.ranks.size())
      s += "<text x=\"" + px(left + plot_w + 8) + "\" y=\"" + px(ry + row_h / 2 + 4) + "\" fill=\"#333\">peak " +
           detail::fmt(sim.ranks[static_cast<std::size_t>(r)].peak) + "</text>\n";
    s += "<rect x=\"" + px(left) + "\" y=\"" + px(ry) + "\" width=\"" + px(plot_w) + "\" height=\"" + px(row_h) +
         "\" fill=\"none\" stroke=\"#bbb\" stroke-width=\"0.5\"/>\n";
  }

  // The ops, in three groups that carry the shared attributes (big runs have millions of
  // ops): compute boxes, copy arrows, labels. Tooltips only while the file stays small.
  const std::vector<TimedOp> ops = timed_ops(p, sim);
  const bool tips = ops.size() <= 20000;
  std::string compute = "<g stroke=\"#fff\" stroke-width=\"0.6\">\n";
  std::string copies = "<g stroke=\"#333\" stroke-width=\"0.6\">\n";
  std::string labels = "<g text-anchor=\"middle\" font-size=\"10.5\" pointer-events=\"none\">\n";
  for (const TimedOp& t : ops) {
    const double x = left + t.start * sx, w = std::max(0.5, (t.end - t.start) * sx);
    const detail::Rgb base = detail::chunk_colour(p.shape.chunk_of(t.op.stage));
    const detail::Rgb fill = detail::shade(base, t.op.kind);
    const std::string tip = tips ? "<title>" + detail::op_label(p, t.op) + " stage " + detail::num(t.op.stage) + " [" +
                                       detail::fmt(t.start) + ", " + detail::fmt(t.end) + ")</title>"
                                 : "";
    const double ry = row_y[static_cast<std::size_t>(t.rank)];
    const int copy_row = copy_rows == 2 && t.op.kind == OpKind::R ? 1 : 0;
    const double oy = t.copy ? ry + row_h + 2 + copy_row * (copy_h + 2) : ry, oh = t.copy ? copy_h : row_h;
    // A fused BW is drawn as its B part then its W part, and carries its label in the B part.
    const double bpart =
        t.op.kind == OpKind::BW ? p.costs.B(t.op.stage) / (p.costs.B(t.op.stage) + p.costs.W(t.op.stage)) : 1;
    if (t.copy) {
      copies += detail::arrow_box(x, oy, w, oh, t.op.kind == OpKind::O, detail::hex(fill), "") + tip + "</polygon>\n";
    } else if (t.op.kind == OpKind::BW) {
      compute += "<g>" + tip + "<rect x=\"" + px(x) + "\" y=\"" + px(oy) + "\" width=\"" + px(w * bpart) +
                 "\" height=\"" + px(oh) + "\" fill=\"" + detail::hex(detail::shade(base, OpKind::B)) +
                 "\" stroke=\"none\"/><rect x=\"" + px(x + w * bpart) + "\" y=\"" + px(oy) + "\" width=\"" +
                 px(w * (1 - bpart)) + "\" height=\"" + px(oh) + "\" fill=\"" +
                 detail::hex(detail::shade(base, OpKind::W)) + "\" stroke=\"none\"/><rect x=\"" + px(x) + "\" y=\"" +
                 px(oy) + "\" width=\"" + px(w) + "\" height=\"" + px(oh) + "\" fill=\"none\"/></g>\n";
    } else {
      compute += "<rect x=\"" + px(x) + "\" y=\"" + px(oy) + "\" width=\"" + px(w) + "\" height=\"" + px(oh) +
                 "\" fill=\"" + detail::hex(fill) + "\">" + tip + "</rect>\n";
    }
    const std::string label = detail::num(t.op.mb);
    const double font = t.copy ? 8.5 : 10.5, lw = w * bpart;
    if (lw >= font * 0.62 * static_cast<double>(label.size()) + 3) {
      const char* tc = detail::text_colour(t.op.kind == OpKind::BW ? detail::shade(base, OpKind::B) : fill);
      labels += "<text x=\"" + px(x + lw / 2) + "\" y=\"" + px(oy + oh / 2 + font * 0.36) + "\" fill=\"" + tc + "\"" +
                (t.copy ? " font-size=\"8.5\"" : "") + ">" + label + "</text>\n";
    }
  }
  s += compute + "</g>\n" + copies + "</g>\n" + labels + "</g>\n";

  for (std::size_t i = 0; i < legend.size(); ++i) {
    const auto [ex, ey] = legend_at[i];
    s += "<g transform=\"translate(" + px(ex) + "," + px(ey) + ")\">" + legend[i].svg + "<text x=\"" +
         px(legend[i].w + (legend[i].w > 0 ? 5 : 0)) + "\" y=\"10\">" + detail::xml_str(legend[i].label) +
         "</text></g>\n";
  }
  s += "</svg>\n";
  return s;
}

}  // namespace pipeoffload
