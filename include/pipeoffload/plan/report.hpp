// pipeoffload/plan/report.hpp: a plan as a short table a person reads, or as JSON.
//
// Pure functions to std::string (no I/O); `pipeoffload-plan --auto` prints them. The JSON keys
// are a contract scripts rely on: schedule, group, chunks, offload_chunks, k,
// activation_bytes_per_layer, peak_device_bytes, host_bytes, bubble_fraction,
// iteration_time_s, fits, and more besides.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "../sim/render.hpp"
#include "plan.hpp"

namespace pipeoffload {

/// The plan tool's command line that draws the chosen schedule (orders and offload; the
/// costs there are unit passes with this plan's k).
inline std::string plan_command(const PlanResult& r, int ranks) {
  const PlanCandidate& c = r.choice;
  std::string s = "pipeoffload-plan --schedule " + c.name + " --ranks " + detail::num(ranks) + " --chunks " +
                  detail::num(c.chunks) + " --microbatches " + detail::num(r.microbatches);
  if (c.name == "gis-g") s += " --group " + detail::num(c.group);
  if (c.name == "po" && c.offload_chunks > 0) s += " --offload-chunks " + detail::num(c.offload_chunks);
  char k[32];
  std::snprintf(k, sizeof k, "%.4g", r.k);
  return s + " --k " + k;
}

namespace detail {

inline std::string printf_str(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

inline std::string json_array(const std::vector<double>& xs) {
  std::string s = "[";
  for (std::size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + fmt(xs[i]);
  return s + "]";
}

/// Runs of equal layer counts: "stage 0: 0 layers + embedding; stages 1-47: 1 layer; ...".
inline std::string stage_runs(const std::vector<int>& layers, bool vocab_stages) {
  std::string s;
  const std::size_t S = layers.size();
  for (std::size_t i = 0; i < S;) {
    std::size_t j = i;
    // The embedding and LM-head stages stand alone so their extra load is visible.
    const auto special = [&](std::size_t x) { return vocab_stages && (x == 0 || x == S - 1); };
    while (j + 1 < S && layers[j + 1] == layers[i] && !special(i) && !special(j + 1)) ++j;
    if (!s.empty()) s += "; ";
    s += (i == j ? "stage " + num(static_cast<long long>(i))
                 : "stages " + num(static_cast<long long>(i)) + "-" + num(static_cast<long long>(j))) +
         ": " + num(layers[i]) + (layers[i] == 1 ? " layer" : " layers");
    if (vocab_stages && i == 0) s += " + embedding";
    if (vocab_stages && j == S - 1) s += " + LM head";
    i = j + 1;
  }
  return s;
}

}  // namespace detail

/// The short table: choice, why, k, per-rank device and host memory (GiB), bubble, iteration.
inline std::string render_plan_text(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x) {
  using detail::printf_str;
  const PlanCandidate& c = r.choice;
  std::string s;
  s += "model      " + detail::num(m.layers) + " layers, h " + detail::num(m.hidden) + ", " + detail::num(m.heads) +
       " heads, " + detail::num(m.query_groups) + " query groups, s " + detail::num(m.seq) + ", b " +
       detail::num(m.micro_batch) + ", vocab " + detail::num(m.vocab) + ", recompute " + (m.recompute ? "on" : "off") +
       "; " + detail::num(r.microbatches) + " microbatches per iteration\n";
  s += "machine    " + detail::num(x.ranks) + " ranks, " + printf_str("%.2f", x.device_bytes / gib) + " GiB device, " +
       printf_str("%.2f", x.host_bytes / gib) + " GiB host per rank, " + printf_str("%g", x.flops / 1e12) +
       " TFLOP/s, " + printf_str("%g", x.pcie_bytes_per_s / 1e9) + " GB/s PCIe per direction\n";
  s += std::string("choice     ") + (r.fits ? "" : "NOTHING FITS; closest: ") + c.name +
       ", v=" + detail::num(c.chunks) + " (" + detail::num(c.chunks * x.ranks) + " stages), g=" + detail::num(c.group) +
       ", offloaded chunks " + detail::num(c.offload_chunks) + " of " + detail::num(c.chunks) + "\n";
  s += "run        " + plan_command(r, x.ranks) + "\n";
  s += "why        " + r.why + "\n";
  s += "k          " + printf_str("%.3f", r.k) + " (round-trip copy / compute of one layer" +
       (r.k > 1 ? "; > 1: not every copy hides behind compute)\n" : ")\n");
  s += "activation " + printf_str("%.3f", r.activation_bytes_per_layer / gib) + " GiB per layer per microbatch (" +
       printf_str("%.2f", r.activation_bytes_per_layer / bsh(m)) + " bsh bytes)\n";
  s += "stages     " + detail::stage_runs(r.layers_per_stage, m.vocab_stages) + "\n";
  s += "bubble     " + printf_str("%.1f", 100 * c.bubble_fraction) + " % (idle / iteration, mean over ranks)\n";
  s += "iteration  " + printf_str("%.3f", c.iteration_time_s) + " s predicted\n";
  s += "\nrank  device GiB  = state + activations + workspace   host GiB\n";
  for (int i = 0; i < x.ranks; ++i) {
    const auto u = static_cast<std::size_t>(i);
    char line[160];
    std::snprintf(line, sizeof line, "%4d  %10.2f    %7.2f   %11.2f   %9.2f   %8.2f%s\n", i,
                  c.peak_device_bytes[u] / gib, r.model_state_bytes[u] / gib, c.activation_bytes[u] / gib,
                  r.workspace_bytes[u] / gib, c.host_bytes[u] / gib,
                  c.peak_device_bytes[u] > x.device_bytes || c.host_bytes[u] > x.host_bytes ? "  over" : "");
    s += line;
  }
  return s;
}

/// JSON for programs (keys in render order; arrays are per rank).
inline std::string render_plan_json(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x) {
  using detail::fmt;
  const PlanCandidate& c = r.choice;
  std::string s = "{\n";
  s += "  \"schedule\": " + detail::json_str(c.name) + ",\n";
  s += "  \"group\": " + detail::num(c.group) + ",\n";
  s += "  \"chunks\": " + detail::num(c.chunks) + ",\n";
  s += "  \"offload_chunks\": " + detail::num(c.offload_chunks) + ",\n";
  s += "  \"ranks\": " + detail::num(x.ranks) + ",\n";
  s += "  \"microbatches\": " + detail::num(r.microbatches) + ",\n";
  s += "  \"k\": " + fmt(r.k) + ",\n";
  s += "  \"activation_bytes_per_layer\": " + fmt(r.activation_bytes_per_layer) + ",\n";
  s += "  \"peak_device_bytes\": " + detail::json_array(c.peak_device_bytes) + ",\n";
  s += "  \"host_bytes\": " + detail::json_array(c.host_bytes) + ",\n";
  s += "  \"activation_peak_bytes\": " + detail::json_array(c.activation_bytes) + ",\n";
  s += "  \"model_state_bytes\": " + detail::json_array(r.model_state_bytes) + ",\n";
  s += "  \"workspace_bytes\": " + detail::json_array(r.workspace_bytes) + ",\n";
  s += "  \"bubble_fraction\": " + fmt(c.bubble_fraction) + ",\n";
  s += "  \"iteration_time_s\": " + fmt(c.iteration_time_s) + ",\n";
  s += std::string("  \"fits\": ") + (r.fits ? "true" : "false") + ",\n";
  s += "  \"shortfall_bytes\": " + fmt(c.shortfall_bytes) + ",\n";
  s += "  \"device_bytes\": " + fmt(x.device_bytes) + ",\n";
  s += "  \"host_capacity_bytes\": " + fmt(x.host_bytes) + ",\n";
  s += "  \"layers_per_stage\": [";
  for (std::size_t i = 0; i < r.layers_per_stage.size(); ++i) s += (i ? ", " : "") + detail::num(r.layers_per_stage[i]);
  s += "],\n";
  s += "  \"candidates\": " + detail::num(static_cast<long long>(r.candidates.size())) + ",\n";
  s += "  \"why\": " + detail::json_str(r.why) + ",\n";
  s += "  \"command\": " + detail::json_str(plan_command(r, x.ranks)) + "\n";
  (void)m;
  return s + "}\n";
}

}  // namespace pipeoffload
