// pipeoffload/plan/report.hpp: a plan as a short table a person reads, or as JSON.
//
// Pure functions to std::string (no I/O); `pipeoffload-plan --auto` prints them. The JSON keys
// are a contract scripts rely on: schedule, group, chunks, cut, offload_chunks, copy_streams, k,
// activation_bytes_per_layer, peak_device_bytes, host_bytes, bubble_fraction,
// iteration_time_s, fits, and more besides. A plan of a data-parallel grid (dp > 1, ZeRO-1 or
// a dp search; or asked for) adds its lines and keys: dp, zero, gpus, allreduce_exposed_s,
// allreduce_s, host_bytes_per_node and more (render_plan_json); without them the report is
// the one-pipeline report, byte for byte, and means dp = 1, ZeRO-0.
/// @file
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../sim/render.hpp"
#include "plan.hpp"

namespace pipeoffload {

namespace detail {
/// The shortest decimal (15 to 17 digits) that reads back as `x` to the bit.
inline std::string exact_real(double x) {
  char buf[32];
  for (int digits = 15;; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, x);
    if (digits == 17 || std::strtod(buf, nullptr) == x) return buf;
  }
}

/// The chosen schedule as the plan tool and train_gpt both take it: --schedule, --ranks,
/// --chunks, --microbatches, and --group / --offload-chunks / --copy-streams 2 (with its
/// --duplex-slowdown) where they apply.
inline std::vector<std::string> schedule_args(const PlanResult& r, int ranks) {
  const PlanCandidate& c = r.choice;
  std::vector<std::string> a = {"--schedule", c.name,        "--ranks",        num(ranks),
                                "--chunks",   num(c.chunks), "--microbatches", num(r.microbatches)};
  if (c.name == "gis-g") a.insert(a.end(), {"--group", num(c.group)});
  if (c.name != "po-h" && c.name != "po-f" && c.offload_chunks > 0)
    a.insert(a.end(), {"--offload-chunks", num(c.offload_chunks)});
  if (c.copy_streams == 2) {
    a.insert(a.end(), {"--copy-streams", "2"});
    if (r.duplex_slowdown != 1) a.insert(a.end(), {"--duplex-slowdown", exact_real(r.duplex_slowdown)});
  }
  return a;
}
}  // namespace detail

/// The plan tool's command line that draws the chosen schedule (orders and offload, with
/// --pcie-switch none where ranks have no PCIe partner; the costs there are unit passes with
/// this plan's k).
inline std::string plan_command(const PlanResult& r, int ranks) {
  std::string s = "pipeoffload-plan";
  for (const std::string& a : detail::schedule_args(r, ranks)) s += " " + a;
  if (!r.pairs_share_switch && ranks >= 2 && r.choice.offload_chunks > 0) s += " --pcie-switch none";
  char k[32];
  std::snprintf(k, sizeof k, "%.4g", r.k);
  return s + " --k " + k;
}

/// samples/train_gpt's arguments that run the chosen plan (the schedule, the grid, the shape,
/// the cut: --stage-blocks from layers_per_stage, the embedding and the head on the first and
/// last stage, the model: its GPT, or with swiglu its Llama with --kv-heads and --ffn, and the
/// backend whose memory was counted; packed rows: --pack 10, a document a line), or empty with `why` set when train_gpt cannot build the
/// model: its GPT has multi-head attention and a 4h GeLU MLP, its Llama an even head size, both
/// hold the embedding and head stages and learn from a byte-level corpus (vocabulary 256), on
/// CUDA recompute, within its options' ranges.
inline std::vector<std::string> train_gpt_args(const PlanResult& r, const TransformerSpec& m, std::string& why) {
  const PlanCandidate& c = r.choice;
  why.clear();
  if (m.swiglu && (m.hidden / m.heads) % 2 != 0)
    why = "train_gpt's Llama rotates pairs of each head's values (RoPE): h / heads must be even";
  else if (!m.swiglu && ((m.ffn_hidden != 0 && m.ffn_hidden != 4 * m.hidden) || m.query_groups != m.heads))
    why = "train_gpt's GPT has multi-head attention and a 4h GeLU MLP";
  else if (!m.vocab_stages)
    why = "train_gpt's GPT holds the embedding and head on the first and last stage";
  else if (m.vocab != 256)
    why = "train_gpt learns the byte-level corpus (vocabulary 256); --vocab is " + detail::num(m.vocab);
  else if (r.backend == PlanBackend::cuda && !m.recompute)
    why = m.swiglu
              ? "train_gpt's CUDA Llama recomputes its RMSNorms and silu(gate) * up in backward: plan with --recompute"
              : "train_gpt's CUDA GPT recomputes LayerNorm, GeLU and dropout in backward: plan with --recompute";
  else if (r.backend == PlanBackend::cuda && m.tied_embeddings && !m.swiglu)
    why = "train_gpt's CUDA GPT does not tie its embeddings yet (--backend cpu does)";
  else if (m.layers > 4096 || m.hidden > 8192 || m.heads > 1024 || m.seq > 8192 || m.micro_batch > 4096 ||
           r.ranks > 64 || c.chunks > 64 || r.microbatches > 4096 || r.dp > 64 || !(r.k > 0 && r.k <= 100) ||
           !(r.flops > 0 && r.flops <= 1e18))
    why = "the plan is outside train_gpt's ranges (--help lists them)";
  if (!why.empty() || c.name.empty()) return {};
  std::vector<std::string> a = detail::schedule_args(r, r.ranks);
  std::string blocks;
  for (const int l : r.layers_per_stage) blocks += (blocks.empty() ? "" : ",") + detail::num(l);
  a.insert(a.end(),
           {"--layers", detail::num(m.layers), "--hidden", detail::num(m.hidden), "--heads", detail::num(m.heads),
            "--seq", detail::num(m.seq), "--batch", detail::num(m.micro_batch), "--stage-blocks", blocks});
  if (m.swiglu)
    a.insert(a.end(), {"--model", "llama", "--kv-heads", detail::num(m.query_groups), "--ffn",
                       detail::num(static_cast<long long>(ffn_width(m)))});
  if (r.dp > 1) a.insert(a.end(), {"--dp", detail::num(r.dp), "--zero", detail::num(r.zero)});
  if (r.gradients == Gradients::exact) a.insert(a.end(), {"--gradients", "exact"});
  if (m.tied_embeddings) a.push_back("--tie-embeddings");
  if (m.packed) a.insert(a.end(), {"--pack", "10"});  // a document a line of the byte-level corpus
  // The plan's k and FLOP/s, to the bit: the program is built with them (stage_costs).
  char k[32], flops[32];
  std::snprintf(k, sizeof k, "%.17g", r.k);
  std::snprintf(flops, sizeof flops, "%.17g", r.flops);
  a.insert(a.end(), {"--k", k, "--flops", flops, "--backend", r.backend == PlanBackend::cpu ? "cpu" : "cuda"});
  return a;
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

inline std::string json_node_lists(const std::vector<double>& contiguous, const std::vector<double>& balanced,
                                   bool max_only) {
  const auto max_of = [](const std::vector<double>& xs) {
    double m = 0;
    for (double x : xs) m = std::max(m, x);
    return m;
  };
  const auto one = [&](const std::vector<double>& xs) {
    if (xs.empty()) return std::string("null");
    return max_only ? fmt(max_of(xs)) : json_array(xs);
  };
  return "{\"contiguous\": " + one(contiguous) + ", \"balanced\": " + one(balanced) + "}";
}

/// "max 12.00 GiB; per node 12.00 3.00 ..." (at most 16 nodes listed).
inline std::string node_list_text(const std::vector<double>& xs) {
  double most = 0;
  for (double x : xs) most = std::max(most, x);
  std::string s = "max " + printf_str("%.2f", most / gib) + " GiB over " + num(static_cast<long long>(xs.size())) +
                  (xs.size() == 1 ? " node" : " nodes") + " (";
  for (std::size_t i = 0; i < xs.size() && i < 16; ++i) s += (i ? " " : "") + printf_str("%.2f", xs[i] / gib);
  return s + (xs.size() > 16 ? " ...)" : ")");
}

inline const char* layout_name(NodeLayout l) { return l == NodeLayout::balanced ? "balanced" : "contiguous"; }

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

/// Whether a report shows the data-parallel grid by default: dp > 1, ZeRO-1 or a dp search.
inline bool grid_shown(const PlanResult& r) { return r.dp > 1 || r.zero > 0 || r.searched; }

/// The short table: choice, why, k, per-rank device and host memory (GiB), bubble, iteration;
/// with `grid`, the data-parallel grid, its all-reduce and host memory per node.
inline std::string render_plan_text(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x, bool grid) {
  using detail::printf_str;
  const PlanCandidate& c = r.choice;
  const int d = r.ranks;
  std::string s;
  s += "model      " + detail::num(m.layers) + " layers, h " + detail::num(m.hidden) + ", " + detail::num(m.heads) +
       " heads, " + detail::num(m.query_groups) + " query groups, s " + detail::num(m.seq) + ", b " +
       detail::num(m.micro_batch) + ", vocab " + detail::num(m.vocab) + (m.tied_embeddings ? " (tied)" : "") +
       (m.packed ? ", packed rows" : "") + ", recompute " + (m.recompute ? "on" : "off") + "; " +
       detail::num(r.microbatches) +
       (grid ? " microbatches per replica (global batch " + detail::num(m.global_batch) + " = dp " + detail::num(r.dp) +
                   " x " + detail::num(r.microbatches) + " x b " + detail::num(m.micro_batch) + ")\n"
             : std::string(" microbatches per iteration\n"));
  s += "machine    " + detail::num(d) + " ranks, " + printf_str("%.2f", x.device_bytes / gib) + " GiB device, " +
       printf_str("%.2f", x.host_bytes / gib) + " GiB host per rank, " + printf_str("%g", x.flops / 1e12) +
       " TFLOP/s, " + printf_str("%g", x.pcie_bytes_per_s / 1e9) + " GB/s PCIe per direction\n";
  s += std::string("choice     ") + (r.fits ? "" : "NOTHING FITS; closest: ") + c.name +
       ", v=" + detail::num(c.chunks) + " (" + detail::num(c.chunks * d) + " stages), g=" + detail::num(c.group) +
       ", offloaded chunks " + detail::num(c.offload_chunks) + " of " + detail::num(c.chunks) +
       (c.copy_streams == 2 ? " on 2 copy streams" : "") + "\n";
  s += "run        " + plan_command(r, d) + "\n";
  {
    std::string no;
    const std::vector<std::string> args = train_gpt_args(r, m, no);
    std::string line = args.empty() ? "(none: " + no + ")" : std::string("train_gpt");
    for (const std::string& a : args) line += " " + a;
    s += "train_gpt  " + line + "\n";
  }
  s += "why        " + r.why + "\n";
  s += "k          " + printf_str("%.3f", r.k) + " (round-trip copy / compute of one layer" +
       (r.k > 1 ? "; > 1: not every copy hides behind compute)\n" : ")\n");
  s += "activation " + printf_str("%.3f", r.activation_bytes_per_layer / gib) + " GiB per layer per microbatch (" +
       printf_str("%.2f", r.activation_bytes_per_layer / bsh(m)) + " bsh bytes)\n";
  s +=
      "stages     " + detail::stage_runs(r.layers_per_stage, m.vocab_stages) + " (" + stage_cut_name(c.cut) + " cut)\n";
  s += "bubble     " + printf_str("%.1f", 100 * c.bubble_fraction) + " % (idle / iteration, mean over ranks)\n";
  s += "iteration  " + printf_str("%.3f", c.iteration_time_s) + " s predicted";
  if (grid)
    s += " (compute " + printf_str("%.3f", c.compute_time_s) + " s + exposed all-reduce " +
         printf_str("%.3f", c.allreduce_exposed_s) + " s)";
  s += "\n";
  if (grid) {
    double most = 0, worst = 1, mean = 0;
    for (int i = 0; i < d; ++i) {
      most = std::max(most, c.allreduce_s[static_cast<std::size_t>(i)]);
      worst = std::min(worst, c.allreduce_hidden(i));
      mean += c.allreduce_hidden(i) / d;
    }
    s += "grid       dp " + detail::num(r.dp) + " x d " + detail::num(d) + " = " + detail::num(r.dp * d) +
         " GPUs, ZeRO-" + detail::num(r.zero) + "; pipeline rank r of replica j is global rank j*" + detail::num(d) +
         (r.node_layout == NodeLayout::balanced && d > r.gpus_per_node ? " + its balanced slot" : " + r") + "; " +
         detail::num(r.gpus_per_node) + " GPUs per node, " + detail::layout_name(r.node_layout) + " layout\n";
    s += "all-reduce " + printf_str("%.3f", most) + " s on the busiest rank at " +
         printf_str("%g", r.allreduce_bytes_per_s / 1e9) + " GB/s, " + printf_str("%.3f", c.allreduce_exposed_s) +
         " s exposed after the cooldown; hidden " + printf_str("%.1f", std::max(0.0, 100 * worst)) +
         " % on the worst rank, " + printf_str("%.1f", 100 * mean) + " % on average over ranks\n";
    s += "host/node  contiguous: " + detail::node_list_text(r.host_bytes_per_node_contiguous) + "\n";
    s += "           balanced:   " +
         (r.host_bytes_per_node_balanced.empty()
              ? std::string("not defined (needs d <= ") + detail::num(r.gpus_per_node) +
                    " or d a multiple of an even " + detail::num(r.gpus_per_node) + ")"
              : detail::node_list_text(r.host_bytes_per_node_balanced)) +
         "\n";
  }
  if (grid && r.searched) {
    s += "\ngrids      every dp that divides " + detail::num(r.dp * d) + " GPUs\n";
    s += "              dp      d      m  fits  iteration s  choice\n";
    for (const GridOption& g : r.grids) {
      char line[96];
      std::snprintf(line, sizeof line, "%11s%5d  %5d  %5d  %-4s  ", "", g.dp, g.ranks, g.microbatches,
                    g.planned ? (g.fits ? "yes" : "no") : "-");
      s += line;
      if (g.planned)
        s += printf_str("%11.3f", g.iteration_time_s) + "  " + g.schedule + " v=" + detail::num(g.chunks) +
             (g.dp == r.dp ? "  <- chosen" : "") + "\n";
      else
        s += "          -  not planned: " + g.note + "\n";
    }
  }
  s += "\nrank  device GiB  = state + optimizer + buffers [activations (stash) + messages] + scratch + workspace + "
       "reserve   host GiB\n";
  for (std::size_t u = 0; u < r.per_rank.size(); ++u) {
    const RankMemory& k = r.per_rank[u];
    char line[240];
    std::snprintf(line, sizeof line, "%4zu%12.2f%9.2f%12.2f%10.2f%14.2f%8.2f%11.2f%10.2f%12.2f%10.2f%11.2f%s\n", u,
                  k.device / gib, k.state / gib, k.optimizer / gib, k.buffers / gib, k.activations / gib, k.stash / gib,
                  k.messages / gib, k.scratch / gib, k.workspace / gib, k.reserve / gib, k.host / gib,
                  k.device > x.device_bytes || k.host > x.host_bytes ? "  over" : "");
    s += line;
  }
  if (grid) {
    s += "\nrank  optimizer GiB  all-reduce s  ends at s  hidden %\n";
    for (int i = 0; i < d; ++i) {
      const auto u = static_cast<std::size_t>(i);
      char line[128];
      std::snprintf(line, sizeof line, "%4d  %13.2f  %12.4f  %9.4f  %8.1f\n", i, r.optimizer_bytes[u] / gib,
                    c.allreduce_s[u], c.allreduce_end_s[u], 100 * c.allreduce_hidden(i));
      s += line;
    }
  }
  return s;
}

/// The short table, with the grid when grid_shown(r).
inline std::string render_plan_text(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x) {
  return render_plan_text(r, m, x, grid_shown(r));
}

/// JSON for programs (keys in render order; arrays are per rank). per_rank: each rank's memory by
/// kind (RankMemory: device_bytes = state_bytes + optimizer_bytes + buffer_bytes +
/// scratch_bytes + workspace_bytes + reserve_bytes; buffer_bytes is the lowered memory plan's region, which holds
/// activation_bytes (units and stashes at their simulated peak; stash_bytes the stashes' own)
/// and message_bytes; host_bytes). train_gpt_args: train_gpt_args() as strings, or
/// null and train_gpt_args_why_not. With `grid`, the grid's keys:
/// dp, zero, gpus (dp x ranks), global_batch, gpus_per_node, node_layout,
/// allreduce_bytes_per_s, compute_time_s (the passes alone), allreduce_exposed_s
/// (iteration_time_s - compute_time_s), per rank allreduce_s, allreduce_end_s,
/// allreduce_hidden_fraction (1 - exposed / allreduce_s) and optimizer_bytes, per stage
/// allreduce_stage_s, host_bytes_per_node and host_bytes_per_node_max ({"contiguous": ...,
/// "balanced": ... or null where that layout is not defined}), searched, and with a dp search
/// grids (every dp tried: dp, ranks, microbatches, planned, fits, iteration_time_s, schedule,
/// chunks, note).
inline std::string render_plan_json(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x, bool grid) {
  using detail::fmt;
  const PlanCandidate& c = r.choice;
  std::string s = "{\n";
  s += "  \"schedule\": " + detail::json_str(c.name) + ",\n";
  s += "  \"group\": " + detail::num(c.group) + ",\n";
  s += "  \"chunks\": " + detail::num(c.chunks) + ",\n";
  s += "  \"cut\": " + detail::json_str(stage_cut_name(c.cut)) + ",\n";
  s += "  \"offload_chunks\": " + detail::num(c.offload_chunks) + ",\n";
  s += "  \"copy_streams\": " + detail::num(c.copy_streams) + ",\n";
  s += "  \"ranks\": " + detail::num(r.ranks) + ",\n";
  s += "  \"microbatches\": " + detail::num(r.microbatches) + ",\n";
  s += "  \"k\": " + fmt(r.k) + ",\n";
  s += "  \"activation_bytes_per_layer\": " + fmt(r.activation_bytes_per_layer) + ",\n";
  s += "  \"peak_device_bytes\": " + detail::json_array(c.peak_device_bytes) + ",\n";
  s += "  \"host_bytes\": " + detail::json_array(c.host_bytes) + ",\n";
  s += "  \"activation_peak_bytes\": " + detail::json_array(c.activation_bytes) + ",\n";
  s += "  \"stash_peak_bytes\": " + detail::json_array(c.stash_bytes) + ",\n";
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
  s += "  \"per_rank\": [";
  for (std::size_t i = 0; i < r.per_rank.size(); ++i) {
    const RankMemory& k = r.per_rank[i];
    s += std::string(i ? ",\n    " : "\n    ") + "{\"device_bytes\": " + fmt(k.device) +
         ", \"host_bytes\": " + fmt(k.host) + ", \"state_bytes\": " + fmt(k.state) +
         ", \"optimizer_bytes\": " + fmt(k.optimizer) + ", \"buffer_bytes\": " + fmt(k.buffers) +
         ", \"activation_bytes\": " + fmt(k.activations) + ", \"stash_bytes\": " + fmt(k.stash) +
         ", \"message_bytes\": " + fmt(k.messages) + ", \"scratch_bytes\": " + fmt(k.scratch) +
         ", \"workspace_bytes\": " + fmt(k.workspace) + ", \"reserve_bytes\": " + fmt(k.reserve) +
         ", \"staging_bytes\": " + fmt(k.staging) + "}";
  }
  s += r.per_rank.empty() ? "],\n" : "\n  ],\n";
  if (grid) {
    std::vector<double> hidden;
    for (int i = 0; i < r.ranks; ++i) hidden.push_back(c.allreduce_hidden(i));
    s += "  \"dp\": " + detail::num(r.dp) + ",\n";
    s += "  \"zero\": " + detail::num(r.zero) + ",\n";
    s += "  \"gpus\": " + detail::num(static_cast<long long>(r.dp) * r.ranks) + ",\n";
    s += "  \"global_batch\": " + detail::num(m.global_batch) + ",\n";
    s += "  \"gpus_per_node\": " + detail::num(r.gpus_per_node) + ",\n";
    s += "  \"node_layout\": " + detail::json_str(detail::layout_name(r.node_layout)) + ",\n";
    s += "  \"allreduce_bytes_per_s\": " + fmt(r.allreduce_bytes_per_s) + ",\n";
    s += "  \"compute_time_s\": " + fmt(c.compute_time_s) + ",\n";
    s += "  \"allreduce_exposed_s\": " + fmt(c.allreduce_exposed_s) + ",\n";
    s += "  \"allreduce_s\": " + detail::json_array(c.allreduce_s) + ",\n";
    s += "  \"allreduce_end_s\": " + detail::json_array(c.allreduce_end_s) + ",\n";
    s += "  \"allreduce_hidden_fraction\": " + detail::json_array(hidden) + ",\n";
    s += "  \"optimizer_bytes\": " + detail::json_array(r.optimizer_bytes) + ",\n";
    s += "  \"allreduce_stage_s\": " + detail::json_array(r.allreduce_stage_s) + ",\n";
    s += "  \"host_bytes_per_node\": " +
         detail::json_node_lists(r.host_bytes_per_node_contiguous, r.host_bytes_per_node_balanced, false) + ",\n";
    s += "  \"host_bytes_per_node_max\": " +
         detail::json_node_lists(r.host_bytes_per_node_contiguous, r.host_bytes_per_node_balanced, true) + ",\n";
    s += std::string("  \"searched\": ") + (r.searched ? "true" : "false") + ",\n";
    if (r.searched) {
      s += "  \"grids\": [";
      for (std::size_t i = 0; i < r.grids.size(); ++i) {
        const GridOption& g = r.grids[i];
        s += std::string(i ? ",\n" : "\n") + "    {\"dp\": " + detail::num(g.dp) +
             ", \"ranks\": " + detail::num(g.ranks) + ", \"microbatches\": " + detail::num(g.microbatches) +
             ", \"planned\": " + (g.planned ? "true" : "false") + ", \"fits\": " + (g.fits ? "true" : "false") +
             ", \"iteration_time_s\": " + fmt(g.iteration_time_s) + ", \"shortfall_bytes\": " + fmt(g.shortfall_bytes) +
             ", \"schedule\": " + detail::json_str(g.schedule) + ", \"chunks\": " + detail::num(g.chunks) +
             ", \"note\": " + detail::json_str(g.note) + "}";
      }
      s += "\n  ],\n";
    }
  }
  s += "  \"why\": " + detail::json_str(r.why) + ",\n";
  std::string no_args;
  const std::vector<std::string> args = train_gpt_args(r, m, no_args);
  if (args.empty()) {
    s += "  \"train_gpt_args\": null,\n";
    s += "  \"train_gpt_args_why_not\": " + detail::json_str(no_args) + ",\n";
  } else {
    s += "  \"train_gpt_args\": [";
    for (std::size_t i = 0; i < args.size(); ++i) s += (i ? ", " : "") + detail::json_str(args[i]);
    s += "],\n";
  }
  s += "  \"command\": " + detail::json_str(plan_command(r, r.ranks)) + "\n";
  return s + "}\n";
}

/// JSON, with the grid's keys when grid_shown(r).
inline std::string render_plan_json(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x) {
  return render_plan_json(r, m, x, grid_shown(r));
}

}  // namespace pipeoffload
