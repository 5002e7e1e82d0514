// bench/paper/paper_figures: the paper's Table 1 and three of its figures, from our own
// build()/simulate() and the planner's model of bytes and FLOPs (nothing here is hard-coded
// from the paper except its model list and hardware numbers).
//
//   ./build/bench/paper/paper_figures --out-dir build/paper
//   python3 bench/paper/screenshot.py build/paper      # PNGs of every SVG via headless Chromium
//
// Writes to --out-dir (default "paper"):
//   table1.csv, table1_a100.svg, table1_h100.svg  activation memory and bubble of each family for
//       the paper's models (its Table 2), A100-class and H100-class (bench/paper/README.md)
//   k.csv, k.svg                                  k over hidden size and sequence length (Figure 1 left)
//   better_than_linear.csv/.svg                   peak memory as chunks are offloaded one by one,
//                                                 d = 8, v = 16: PO against GIS-H
//   scaling.csv, scaling.svg                      per-device activation of each family as v*d grows,
//                                                 5.8B model (Section 5's scaling study)
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/plan/plan.hpp>

#include "../../samples/cli.hpp"
#include "models.hpp"
#include "svg_plot.hpp"

namespace {

using namespace pipeoffload;
using paper::num;
constexpr double nan_ = std::numeric_limits<double>::quiet_NaN();

using paper::models;
using paper::PaperModel;
using paper::transformer;

struct Hardware {
  const char* name;
  double tflops, gbps;
};
constexpr Hardware a100{"A100", 220, 15}, h100{"H100", 400, 30};

MachineSpec machine(int d, const Hardware& hw) {
  MachineSpec x;
  x.ranks = d;
  x.flops = hw.tflops * 1e12;
  x.pcie_bytes_per_s = hw.gbps * 1e9;
  x.device_bytes = 1e15;  // the figures measure; nothing is ruled out
  x.host_bytes = 1e15;
  return x;
}

struct Row {
  const char* label;
  PlanOption option;
  bool max_v;  // v = the most layer slots allow (the paper: at most one layer per stage); else v = 1
};

std::vector<Row> families() {
  using GK = GroupSpec::Kind;
  return {
      {"1F1B", {{Family::one_f1b, {}, offload::none}, "1f1b", 0, 0}, false},
      {"1F1B-I", {{Family::interleaved_1f1b, {}, offload::none}, "1f1b-i", 0, 0}, true},
      {"GIS", {{Family::grouped, {GK::full, 0}, offload::none}, "gis", 0, 0}, true},
      {"GIS-H", {{Family::grouped, {GK::half, 0}, offload::none}, "gis-h", 0, 0}, true},
      {"PO-H", {{Family::grouped, {GK::uniform, 1}, offload::half}, "po-h", 1, -1}, true},
      {"PO-F", {{Family::grouped, {GK::uniform, 1}, offload::all}, "po-f", 1, -1}, true},
  };
}

double max_of(const std::vector<double>& v) {
  double x = 0;
  for (double y : v) x = std::max(x, y);
  return x;
}

double sum_of(const std::vector<double>& v) {
  double x = 0;
  for (double y : v) x += y;
  return x;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) {
    std::fprintf(stderr, "paper_figures: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::printf("wrote %s\n", path.c_str());
}

// ---- Table 1 -------------------------------------------------------------------------------

void table1(const std::string& dir) {
  std::string csv =
      "hardware,model,ranks,family,chunks,microbatches,k,activation_gib,model_activation_gib,activation_over_M,paper_over_M,bubble_percent,iteration_s\n";
  for (const Hardware& hw : {a100, h100}) {
    std::vector<std::string> groups;
    std::vector<paper::Series> mem, bub;
    std::vector<std::vector<double>> marks;
    const auto fams = families();
    for (std::size_t f = 0; f < fams.size(); ++f) {
      mem.push_back({fams[f].label, {}, {}, static_cast<int>(f)});
      bub.push_back({fams[f].label, {}, {}, static_cast<int>(f)});
      marks.emplace_back();
    }
    std::printf("\nTable 1, %s-class (Bc %.0f TFLOP/s, Bo %.0f GB/s): activation / M and bubble %%\n", hw.name,
                hw.tflops, hw.gbps);
    std::printf("%-6s %4s %6s", "model", "d", "k");
    for (const auto& f : fams) std::printf(" %15s", f.label);
    std::printf("\n");
    for (const PaperModel& pm : models) {
      const TransformerSpec m = transformer(pm);
      const MachineSpec x = machine(pm.gpus, hw);
      const int d = pm.gpus, vmax = layer_slots(m) / d, mb = m.global_batch / m.micro_batch;
      groups.push_back(pm.name);
      std::printf("%-6s %4d %6.3f", pm.name, d, copy_ratio(m, x));
      for (std::size_t f = 0; f < fams.size(); ++f) {
        const int v = fams[f].max_v ? vmax : 1;
        const detail::Layout L = detail::make_layout(m, x, {}, v);
        PlanOption o = fams[f].option;
        o.offload_chunks = offload::count(o.spec.offload, v);
        const PlanCandidate c = evaluate(o, L, m, x);
        const double M = sum_of(L.costs.unit_bytes), act = max_of(c.activation_bytes);
        const double vd = static_cast<double>(v);
        const double formula[] = {1.0, (vd + 1) / vd, 1.0, (vd + 1) / (2 * vd), (vd + 2) / (8 * vd), 4.0 / (vd * d)};
        mem[f].y.push_back(act / M);
        bub[f].y.push_back(100 * c.bubble_fraction);
        marks[f].push_back(formula[f]);
        std::printf(" %6.3f %6.1f%%  ", act / M, 100 * c.bubble_fraction);
        csv += std::string(hw.name) + "," + pm.name + "," + num(d) + "," + fams[f].label + "," + num(v) + "," +
               num(mb) + "," + num(copy_ratio(m, x), "%.4f") + "," + num(act / gib, "%.3f") + "," +
               num(M / gib, "%.3f") + "," + num(act / M, "%.4f") + "," + num(formula[f], "%.4f") + "," +
               num(100 * c.bubble_fraction, "%.2f") + "," + num(c.iteration_time_s, "%.3f") + "\n";
      }
      std::printf("\n");
    }
    paper::Panel pm_{90,
                     84,
                     680,
                     300,
                     "Activation memory (max over ranks) / M, the whole model's activation of one microbatch",
                     {"model (ranks d: 8, 8, 16, 32, 32, 32; v = most stages with one layer slot each)", 0, 1},
                     {"activation / M", 0, 1.6}};
    paper::Panel pb{
        90, 484, 680, 220, "Bubble (idle / iteration, mean over ranks)", {"model", 0, 1}, {"bubble %", 0, 40}};
    double top = 0;
    for (const auto& s : bub) top = std::max(top, max_of(s.y));
    pb.ya.hi = std::ceil(top / 10) * 10;
    // Bars label their own groups: no numeric x ticks.
    pm_.xa.no_ticks = pb.xa.no_ticks = true;
    // Legends right of the plots, where no bar can hide them.
    paper::Panel lm = pm_, lb = pb;
    lm.x0 = lb.x0 = pm_.x0 + pm_.w + 4;
    lm.w = lb.w = 120;
    std::string body = paper::frame(pm_) + paper::bars(pm_, groups, mem, marks) + paper::legend(lm, mem, false, true) +
                       "<line x1=\"" + num(lm.x0 + 14) + "\" y1=\"" + num(lm.y0 + 140) + "\" x2=\"" + num(lm.x0 + 36) +
                       "\" y2=\"" + num(lm.y0 + 140) + "\" stroke=\"#000\" stroke-width=\"2.5\"/><text x=\"" +
                       num(lm.x0 + 42) + "\" y=\"" + num(lm.y0 + 144) +
                       "\" font-size=\"11\">the paper's</text><text x=\"" + num(lm.x0 + 42) + "\" y=\"" +
                       num(lm.y0 + 158) + "\" font-size=\"11\">formula</text>\n" + paper::frame(pb) +
                       paper::bars(pb, groups, bub) + paper::legend(lb, bub, false, true);
    const std::string title = std::string("Table 1 from our simulator, ") + hw.name + "-class: Bc " + num(hw.tflops) +
                              " TFLOP/s, Bo " + num(hw.gbps) + " GB/s; s 4096, b 1, GQA 8 groups, recompute";
    write(dir + "/table1_" + (hw.name == std::string("A100") ? "a100" : "h100") + ".svg",
          paper::document(920, 770, title,
                          "PO-F's tick: ~4 units = 4M/(vd). Source: bench/paper/paper_figures (table1.csv).", body));
  }
  write(dir + "/table1.csv", csv);
}

// ---- k over hidden size and sequence length ---------------------------------------------------

void k_figure(const std::string& dir) {
  std::string csv = "hidden,seq,k_mha_recompute,k_gqa8_recompute\n";
  const MachineSpec x = machine(1, a100);
  const auto k_of = [&](int h, int s, int groups) {
    TransformerSpec m;
    m.hidden = h;
    m.heads = h / 128;
    m.query_groups = groups == 0 ? m.heads : groups;
    m.seq = s;
    m.recompute = true;
    return copy_ratio(m, x);
  };
  const std::vector<int> hs = {1024, 2048, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 16384};
  const std::vector<int> ss = {1024, 2048, 4096, 8192, 16384, 32768, 65536};
  paper::Panel left{80,
                    60,
                    420,
                    300,
                    "k over hidden size",
                    {"hidden size h", 1024, 16384, true, {1024, 2048, 4096, 8192, 16384}},
                    {"k = round-trip copy / compute", 0.1, 20, true}};
  paper::Panel right{600,
                     60,
                     420,
                     300,
                     "k over sequence length",
                     {"sequence length s", 1024, 65536, true, {1024, 2048, 4096, 8192, 16384, 32768, 65536}},
                     {"k = round-trip copy / compute", 0.1, 20, true}};
  std::vector<paper::Series> ls, rs;
  int c = 0;
  for (int s : {2048, 4096, 8192, 16384, 32768}) {
    paper::Series se{"s = " + num(s), {}, {}, c++};
    for (int h : hs) se.x.push_back(h), se.y.push_back(k_of(h, s, 0));
    ls.push_back(se);
  }
  c = 0;
  for (int h : {2048, 4096, 8192, 12288, 16384}) {
    paper::Series se{"h = " + num(h), {}, {}, c++};
    for (int s : ss) se.x.push_back(s), se.y.push_back(k_of(h, s, 0));
    rs.push_back(se);
  }
  for (int h : hs)
    for (int s : ss)
      csv += num(h) + "," + num(s) + "," + num(k_of(h, s, 0), "%.4f") + "," + num(k_of(h, s, 8), "%.4f") + "\n";
  const auto one = [](const paper::Panel& p) {
    return "<line x1=\"" + num(p.x0) + "\" y1=\"" + num(p.py(1)) + "\" x2=\"" + num(p.x0 + p.w) + "\" y2=\"" +
           num(p.py(1)) + "\" stroke=\"#c00\" stroke-width=\"1.5\" stroke-dasharray=\"3,3\"/><text x=\"" +
           num(p.x0 + 8) + "\" y=\"" + num(p.py(0.12)) +
           "\" fill=\"#c00\">below the red line (k &lt;= 1) every activation can be offloaded</text>\n";
  };
  const std::string body = paper::frame(left) + one(left) + paper::lines(left, ls) + paper::legend(left, ls, true) +
                           paper::frame(right) + one(right) + paper::lines(right, rs) + paper::legend(right, rs, true);
  write(
      dir + "/k.svg",
      paper::document(
          1060, 440, "k from our model: A100-class Bc 220 TFLOP/s, Bo 15 GB/s, multi-head attention, 20bsh (recompute)",
          "k = 2A/Bo / ((F+B+W FLOPs)/Bc), A = saved bytes of a layer: the paper's 10/(3(6h+s)) Bc/Bo. Source: bench/paper/paper_figures (k.csv).",
          body));
  write(dir + "/k.csv", csv);
}

// ---- better than linear ----------------------------------------------------------------------

void better_than_linear(const std::string& dir) {
  // The paper's setting: 8 ranks, 16 stages per rank; unit passes (T_F = T_B = T_W) and k = 1,
  // so every unit's round trip fits its gap and the curve shows where the peak comes from.
  const int d = 8, v = 16, m = 64;
  Costs costs;
  costs.k = 1;
  std::string csv = "offloaded_chunks,fraction,po_peak_units,po_ratio,gis_h_peak_units,gis_h_ratio\n";
  paper::Series po{"PO (uniform repeat)", {}, {}, 0}, gh{"GIS-H (interleave)", {}, {}, 1},
      lin{"linear: 1 - n/v", {}, {}, 7, true, false};
  double po0 = 0, gh0 = 0;
  for (int n = 0; n <= v; ++n) {
    const offload::selection sel = n == 0 ? offload::none : offload::first(n);
    const double p =
        simulate(build({Family::grouped, {GroupSpec::Kind::uniform, 1}, sel}, {d, v, m}, costs)).max_peak();
    const double g = simulate(build({Family::grouped, {GroupSpec::Kind::half, 0}, sel}, {d, v, m}, costs)).max_peak();
    if (n == 0) po0 = p, gh0 = g;
    const double fr = static_cast<double>(n) / v;
    po.x.push_back(fr), po.y.push_back(p / po0);
    gh.x.push_back(fr), gh.y.push_back(g / gh0);
    lin.x.push_back(fr), lin.y.push_back(1 - fr);
    csv += num(n) + "," + num(fr, "%.4f") + "," + num(p) + "," + num(p / po0, "%.4f") + "," + num(g) + "," +
           num(g / gh0, "%.4f") + "\n";
  }
  paper::Panel pn{80,
                  60,
                  560,
                  340,
                  "Peak activation (max over ranks) relative to no offload",
                  {"fraction of chunks offloaded (chunks 0..n-1 of v = 16)", 0, 1},
                  {"peak / peak without offload", 0, 1}};
  const std::vector<paper::Series> ss = {po, gh, lin};
  const std::string body = paper::frame(pn) + paper::lines(pn, ss) + paper::legend(pn, ss, true);
  write(
      dir + "/better_than_linear.svg",
      paper::document(
          700, 480, "Better-than-linear selective offload: d = 8, v = 16, m = 64, k = 1, unit passes",
          "Peaks from build() + simulate(); offload places longest-lived chunks first. Source: bench/paper/paper_figures.",
          body));
  write(dir + "/better_than_linear.csv", csv);
  std::printf("\nbetter than linear: PO with half the chunks offloaded keeps %.3f of its peak, GIS-H %.3f\n", po.y[8],
              gh.y[8]);
}

// ---- scaling study -------------------------------------------------------------------------

void scaling(const std::string& dir) {
  TransformerSpec m = transformer(models[0]);
  m.vocab_stages = false;  // the study counts transformer layers: v*d = 32 is one layer per stage
  const auto fams = families();
  std::string csv = "family,stages_vd,ranks,chunks,activation_gib,inflight_units\n";
  std::vector<paper::Series> gibs, units;
  for (std::size_t f = 0; f < fams.size(); ++f) {
    paper::Series sg{fams[f].label, {}, {}, static_cast<int>(f)}, su = sg;
    for (int vd = 2; vd <= 32; vd *= 2) {
      double best = nan_, best_units = nan_;
      int bd = 0;
      for (int d = 2; d <= vd; d *= 2) {
        const int v = vd / d;
        if ((fams[f].option.name == "1f1b") != (v == 1)) continue;  // 1F1B has v = 1; the others interleave
        if (fams[f].option.name == "1f1b-i" && m.global_batch % d != 0) continue;
        const MachineSpec x = machine(d, a100);
        detail::Layout L = detail::make_layout(m, x, {}, v);
        L.costs.k = 1;  // the largest k at which the paper runs PO-F (A100's k here is 1.6)
        PlanOption o = fams[f].option;
        o.offload_chunks = offload::count(o.spec.offload, v);
        const PlanCandidate c = evaluate(o, L, m, x);
        const double act = max_of(c.activation_bytes);
        if (std::isnan(best) || act < best) best = act, best_units = act / L.costs.unit_bytes[0], bd = d;
      }
      if (std::isnan(best)) continue;
      sg.x.push_back(vd), sg.y.push_back(best / gib);
      su.x.push_back(vd), su.y.push_back(best_units);
      csv += std::string(fams[f].label) + "," + num(vd) + "," + num(bd) + "," + num(vd / bd) + "," +
             num(best / gib, "%.3f") + "," + num(best_units, "%.2f") + "\n";
    }
    gibs.push_back(sg);
    units.push_back(su);
  }
  double top = 0, top_u = 0;
  for (const auto& s : gibs) top = std::max(top, max_of(s.y));
  for (const auto& s : units) top_u = std::max(top_u, max_of(s.y));
  paper::Panel left{80,
                    60,
                    420,
                    320,
                    "Per-device activation memory",
                    {"total stages v*d", 2, 32, true, {2, 4, 8, 16, 32}},
                    {"activation GiB (max over ranks)", 0, std::ceil(top / 5) * 5}};
  paper::Panel right{600,
                     60,
                     420,
                     320,
                     "In-flight activations (stage-microbatches)",
                     {"total stages v*d", 2, 32, true, {2, 4, 8, 16, 32}},
                     {"units alive at the peak", 0, std::ceil(top_u / 10) * 10}};
  const std::string body = paper::frame(left) + paper::lines(left, gibs) + paper::legend(left, gibs, true) +
                           paper::frame(right) + paper::lines(right, units) + paper::legend(right, units, true);
  write(
      dir + "/scaling.svg",
      paper::document(
          1060, 460,
          "Activation memory scaling, 5.8B model (32 layers, h 4096, GQA 8, s 4096, b 1, m 32, recompute), k = 1",
          "d in 2..32, v = v*d/d; for each v*d the setting with the least activation is shown (as in the paper). Source: bench/paper/paper_figures (scaling.csv).",
          body));
  write(dir + "/scaling.csv", csv);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "paper";
  cli::parsed_or_exit("paper_figures", [&] {
    cli::help(argc, argv, "usage: paper_figures [--out-dir DIR]\n");
    constexpr cli::Flag flags[] = {{"--out-dir"}};
    const cli::Args args(argc, argv, flags);
    if (const std::string* v = args.get("--out-dir")) dir = *v;
  });
  std::filesystem::create_directories(dir);
  table1(dir);
  k_figure(dir);
  better_than_linear(dir);
  scaling(dir);
  return 0;
}
