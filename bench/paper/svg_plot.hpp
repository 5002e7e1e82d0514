// bench/paper/svg_plot.hpp: just enough SVG plotting for the paper's figures (line and grouped
// bar panels with axes, ticks, labels and a legend). Bench-only: strings in, a file out.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace paper {

inline std::string num(double x, const char* f = "%g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

inline std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&')
      o += "&amp;";
    else if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else
      o += c;
  }
  return o;
}

/// Colour-blind-safe palette (Okabe-Ito), then greys.
inline const char* colour(int i) {
  static const char* c[] = {"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#999999"};
  return c[static_cast<std::size_t>(i) % 8];
}

struct Axis {
  std::string label;
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<double> ticks = {};  ///< empty: about 6 nice ticks
  bool no_ticks = false;           ///< no ticks at all (bar charts label their groups)
};

struct Series {
  std::string name;
  std::vector<double> x, y;
  int colour = 0;
  bool dashed = false;
  bool markers = true;
};

/// A panel at (x0, y0) of size w x h (the plot area; labels go outside it).
struct Panel {
  double x0 = 80, y0 = 50, w = 420, h = 300;
  std::string title;
  Axis xa, ya;

  double px(double x) const {
    const double t =
        xa.log ? (std::log(x) - std::log(xa.lo)) / (std::log(xa.hi) - std::log(xa.lo)) : (x - xa.lo) / (xa.hi - xa.lo);
    return x0 + t * w;
  }
  double py(double y) const {
    const double t =
        ya.log ? (std::log(y) - std::log(ya.lo)) / (std::log(ya.hi) - std::log(ya.lo)) : (y - ya.lo) / (ya.hi - ya.lo);
    return y0 + h - t * h;
  }
};

inline std::vector<double> nice_ticks(const Axis& a) {
  if (a.no_ticks) return {};
  if (!a.ticks.empty()) return a.ticks;
  std::vector<double> t;
  if (a.log) {
    for (double p = std::pow(10.0, std::floor(std::log10(a.lo))); p <= a.hi * 1.0001; p *= 10)
      for (double m : {1.0, 2.0, 5.0})
        if (p * m >= a.lo * 0.9999 && p * m <= a.hi * 1.0001) t.push_back(p * m);
    return t;
  }
  const double raw = (a.hi - a.lo) / 6, p10 = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * p10;
  for (double m : {1.0, 2.0, 5.0})
    if (m * p10 >= raw) {
      step = m * p10;
      break;
    }
  for (double v = std::ceil(a.lo / step) * step; v <= a.hi + step * 1e-9; v += step)
    t.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  return t;
}

/// Frame, grid, ticks, axis labels and title of a panel.
inline std::string frame(const Panel& p) {
  std::string s;
  s += "<rect x=\"" + num(p.x0) + "\" y=\"" + num(p.y0) + "\" width=\"" + num(p.w) + "\" height=\"" + num(p.h) +
       "\" fill=\"#fff\" stroke=\"#333\"/>\n";
  for (double t : nice_ticks(p.xa)) {
    const double x = p.px(t);
    s += "<line x1=\"" + num(x) + "\" y1=\"" + num(p.y0) + "\" x2=\"" + num(x) + "\" y2=\"" + num(p.y0 + p.h) +
         "\" stroke=\"#e5e5e5\"/>\n";
    s += "<text x=\"" + num(x) + "\" y=\"" + num(p.y0 + p.h + 16) + "\" text-anchor=\"middle\">" + num(t) + "</text>\n";
  }
  for (double t : nice_ticks(p.ya)) {
    const double y = p.py(t);
    s += "<line x1=\"" + num(p.x0) + "\" y1=\"" + num(y) + "\" x2=\"" + num(p.x0 + p.w) + "\" y2=\"" + num(y) +
         "\" stroke=\"#e5e5e5\"/>\n";
    s += "<text x=\"" + num(p.x0 - 6) + "\" y=\"" + num(y + 4) + "\" text-anchor=\"end\">" + num(t) + "</text>\n";
  }
  s += "<rect x=\"" + num(p.x0) + "\" y=\"" + num(p.y0) + "\" width=\"" + num(p.w) + "\" height=\"" + num(p.h) +
       "\" fill=\"none\" stroke=\"#333\"/>\n";
  s += "<text x=\"" + num(p.x0 + p.w / 2) + "\" y=\"" + num(p.y0 + p.h + 36) + "\" text-anchor=\"middle\">" +
       esc(p.xa.label) + "</text>\n";
  s += "<text transform=\"translate(" + num(p.x0 - 48) + "," + num(p.y0 + p.h / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">" + esc(p.ya.label) + "</text>\n";
  s += "<text x=\"" + num(p.x0) + "\" y=\"" + num(p.y0 - 10) + "\" font-weight=\"bold\">" + esc(p.title) + "</text>\n";
  return s;
}

/// A legend box inside the panel at its top-left (or top-right) corner.
inline std::string legend(const Panel& p, const std::vector<Series>& ss, bool right = false, bool bars = false) {
  double wmax = 0;
  for (const Series& s : ss) wmax = std::max(wmax, 6.6 * static_cast<double>(s.name.size()));
  const double bw = wmax + 44, bh = 18.0 * static_cast<double>(ss.size()) + 8;
  const double lx = right ? p.x0 + p.w - bw - 8 : p.x0 + 8, ly = p.y0 + 8;
  std::string s = "<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"" + num(bw) + "\" height=\"" + num(bh) +
                  "\" fill=\"#fff\" fill-opacity=\"0.9\" stroke=\"#bbb\"/>\n";
  for (std::size_t i = 0; i < ss.size(); ++i) {
    const double y = ly + 14 + 18.0 * static_cast<double>(i);
    if (bars)
      s += "<rect x=\"" + num(lx + 6) + "\" y=\"" + num(y - 6) + "\" width=\"22\" height=\"10\" fill=\"" +
           colour(ss[i].colour) + "\"/>\n";
    else
      s += "<line x1=\"" + num(lx + 6) + "\" y1=\"" + num(y - 1) + "\" x2=\"" + num(lx + 28) + "\" y2=\"" + num(y - 1) +
           "\" stroke=\"" + colour(ss[i].colour) + "\" stroke-width=\"2.2\"" +
           (ss[i].dashed ? " stroke-dasharray=\"6,4\"" : "") + "/>\n";
    s += "<text x=\"" + num(lx + 34) + "\" y=\"" + num(y + 3) + "\">" + esc(ss[i].name) + "</text>\n";
  }
  return s;
}

/// Lines (and markers) of each series.
inline std::string lines(const Panel& p, const std::vector<Series>& ss) {
  std::string s;
  for (const Series& se : ss) {
    std::string pts;
    for (std::size_t i = 0; i < se.x.size(); ++i)
      pts += num(p.px(se.x[i]), "%.2f") + "," + num(p.py(se.y[i]), "%.2f") + " ";
    s += "<polyline points=\"" + pts + "\" fill=\"none\" stroke=\"" + colour(se.colour) + "\" stroke-width=\"2.2\"" +
         (se.dashed ? " stroke-dasharray=\"6,4\"" : "") + "/>\n";
    if (se.markers)
      for (std::size_t i = 0; i < se.x.size(); ++i)
        s += "<circle cx=\"" + num(p.px(se.x[i]), "%.2f") + "\" cy=\"" + num(p.py(se.y[i]), "%.2f") +
             "\" r=\"3.2\" fill=\"" + colour(se.colour) + "\"/>\n";
  }
  return s;
}

/// Grouped bars: groups along x (labels), one bar per series in each group; `marks` (same shape
/// as the series' y, NaN for none) draws a short black tick on a bar (a reference value).
inline std::string bars(const Panel& p, const std::vector<std::string>& groups, const std::vector<Series>& ss,
                        const std::vector<std::vector<double>>& marks = {}) {
  std::string s;
  const double gw = p.w / static_cast<double>(groups.size()), bw = gw * 0.8 / static_cast<double>(ss.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const double gx = p.x0 + gw * static_cast<double>(g) + gw * 0.1;
    s += "<text x=\"" + num(p.x0 + gw * (static_cast<double>(g) + 0.5)) + "\" y=\"" + num(p.y0 + p.h + 16) +
         "\" text-anchor=\"middle\">" + esc(groups[g]) + "</text>\n";
    for (std::size_t i = 0; i < ss.size(); ++i) {
      const double v = ss[i].y[g];
      const double x = gx + bw * static_cast<double>(i);
      if (std::isfinite(v)) {
        const double top = p.py(std::max(v, p.ya.lo)), base = p.py(p.ya.lo);
        s += "<rect x=\"" + num(x, "%.2f") + "\" y=\"" + num(top, "%.2f") + "\" width=\"" + num(bw * 0.92, "%.2f") +
             "\" height=\"" + num(std::max(0.0, base - top), "%.2f") + "\" fill=\"" + colour(ss[i].colour) +
             "\"><title>" + esc(ss[i].name + " " + groups[g] + ": " + num(v, "%.3g")) + "</title></rect>\n";
      }
      if (i < marks.size() && g < marks[i].size() && std::isfinite(marks[i][g]) && marks[i][g] <= p.ya.hi) {
        const double y = p.py(marks[i][g]);
        s += "<line x1=\"" + num(x - 1, "%.2f") + "\" y1=\"" + num(y, "%.2f") + "\" x2=\"" +
             num(x + bw * 0.92 + 1, "%.2f") + "\" y2=\"" + num(y, "%.2f") +
             "\" stroke=\"#000\" stroke-width=\"2.5\"/>\n";
      }
    }
  }
  return s;
}

/// A whole SVG document of width x height around `body`, with a title line and a note line.
inline std::string document(double width, double height, const std::string& title, const std::string& note,
                            const std::string& body) {
  std::string s =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) +
      "\" height=\"" + num(height) + "\" viewBox=\"0 0 " + num(width) + " " + num(height) +
      "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  s += "<text x=\"20\" y=\"24\" font-size=\"16\" font-weight=\"bold\">" + esc(title) + "</text>\n";
  s += "<text x=\"20\" y=\"" + num(height - 12) + "\" fill=\"#555\" font-size=\"11\">" + esc(note) + "</text>\n";
  return s + body + "</svg>\n";
}

}  // namespace paper
