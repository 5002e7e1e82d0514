// samples/train_gpt_report.hpp: what train_gpt prints: its banner, rank 0's closing report
// (measured peaks beside 1F1B-I's simulated ones, wall time, the trace, and the two lines scripts
// compare: final_loss and params_hash) and each failed rank's error.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <pipeoffload/backend/cpu/blas.hpp>
#include <pipeoffload/fnv1a.hpp>
#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/sim/render.hpp>

#include "cli.hpp"
#include "train_gpt_options.hpp"

namespace train_gpt {

using cli::hex64;
using cli::mib;

/// Device bytes a stage holds for its parameters and gradients: its own state_bytes() where
/// it has one (gpt::CudaGptStage: the bf16 parameters, the fp32 gradients, the head's fp32 bias),
/// else its parameters() and gradients().
template <class Layer>
std::size_t layer_state_bytes(Layer& l) {
  if constexpr (requires { l.state_bytes(); })
    return l.state_bytes();
  else
    return l.parameters().size_bytes() + l.gradients().size_bytes();
}

/// Device bytes a stage holds for itself: layer_state_bytes and, where it keeps one for the
/// whole run, its scratch (gpt::CudaGptStage::scratch_bytes).
template <class Layer>
std::size_t layer_reserved_bytes(Layer& l) {
  if constexpr (requires { l.scratch_bytes(); })
    return layer_state_bytes(l) + l.scratch_bytes();
  else
    return layer_state_bytes(l);
}

/// What a run measured of its model state, the largest over ranks (report prints it).
struct StateFigures {
  std::size_t optimizer_bytes = 0;  ///< global rank 0's optimizer state
  double state_per_parameter = 0;   ///< device bytes for parameters, gradients, their buffers and optimizer state
  double reduce_per_parameter = 0;  ///< bytes sent in the last step's gradient and parameter collectives
  /// Per pipeline rank of replica 0: the device bytes its arena holds (backend MemoryStats::
  /// device_held: what the runtime and optimizer reserved and took) plus its stages' own.
  std::vector<std::size_t> reserved;
};

inline  /// Rank 0's closing report: peaks, 1F1B-I's simulated peaks, wall time, the trace, and the
    /// two lines scripts compare.
    /// `params`: every stage's parameters, in stage order.
    void
    report(const Options& o, const Setup& su, const std::vector<std::vector<float>>& params, const po::Program& program,
           int first, const std::vector<std::size_t>& peaks, const std::vector<std::size_t>& units,
           std::vector<po::RankSim>& traces, float final_loss, std::chrono::steady_clock::time_point t_start,
           const StateFigures& state) {
  const po::Shape sh = o.shape;
  if (o.dp > 1)
    std::printf("optimizer state of global rank 0 (AdamW moments, zero %d): %zu bytes\n", o.zero,
                state.optimizer_bytes);

  po::Costs sizes;
  sizes.unit_bytes.resize(static_cast<std::size_t>(sh.stages()));
  for (int q = 0; q < sh.d; ++q)
    for (int c = 0; c < sh.v; ++c)
      sizes.unit_bytes[static_cast<std::size_t>(sh.stage_of(q, c))] =
          static_cast<double>(units[static_cast<std::size_t>(q * sh.v + c)]);
  std::printf("peak activation per rank, measured (MiB):   ");
  for (int q = 0; q < sh.d; ++q) std::printf(" %s", mib(peaks[3 * static_cast<std::size_t>(q)]).c_str());
  std::printf("   (device total incl. stash and messages:");
  for (int q = 0; q < sh.d; ++q) std::printf(" %s", mib(peaks[3 * static_cast<std::size_t>(q) + 1]).c_str());
  std::printf("; pinned host:");
  for (int q = 0; q < sh.d; ++q) std::printf(" %s", mib(peaks[3 * static_cast<std::size_t>(q) + 2]).c_str());
  std::printf(")\n");
  if (sh.m % sh.d == 0) {
    po::Shape ish = sh;  // 1F1B-I places its stages interleaved; a stage's unit is the same either way
    ish.placement = po::Placement::interleaved;
    const po::Program ref = po::build({po::Family::interleaved_1f1b, {}, po::offload::none}, ish);
    const po::SimResult sim = po::simulate(ref, sizes);
    std::printf("1F1B-I would need, simulated (MiB):          ");
    for (const auto& rs : sim.ranks) std::printf(" %s", mib(rs.peak).c_str());
    std::printf("\n");
  } else {
    std::printf("1F1B-I would need: n/a (1F1B-I needs m to be a multiple of d)\n");
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("wall %.2f s, %.0f tokens/s\n", wall,
              static_cast<double>(su.tokens_per_step) * o.dp * (o.steps - first) / wall);

  if (o.trace) {
    // The last step's measured times, from the earliest op, in milliseconds (the renderer's
    // time unit is 1000 us).
    po::SimResult real;
    real.ranks = traces;
    double t0 = 1e300, t1 = 0;
    for (const auto& rs : real.ranks) {
      for (double t : rs.compute_start) t0 = std::min(t0, t);
      for (double t : rs.copy_start) t0 = std::min(t0, t);
    }
    for (std::size_t q = 0; q < real.ranks.size(); ++q) {
      auto& rs = real.ranks[q];
      for (auto* vec : {&rs.compute_start, &rs.compute_end, &rs.copy_start, &rs.copy_end})
        for (double& t : *vec) {
          t = (t - t0) * 1e3;
          t1 = std::max(t1, t);
        }
      for (std::size_t x = 0; x < rs.compute_start.size(); ++x) rs.busy += rs.compute_end[x] - rs.compute_start[x];
      po::detail::memory_timeline(sizes, program.ranks[q], rs);
    }
    real.makespan = t1;
    for (auto& rs : real.ranks) rs.bubble = real.makespan - rs.busy;
    std::ofstream out(*o.trace);
    out << po::render_chrome_trace(program, real);
    if (!out) throw po::error("cannot write the trace '" + *o.trace + "'");
    std::printf("trace of the last step (%.1f ms) written to %s\n", t1, o.trace->c_str());
  }

  // FNV-1a over every parameter's fp32 bytes, stage by stage in model order: the same bytes
  // in the same order however the model is cut into stages and ranks.
  std::uint64_t hash = po::fnv1a_start;
  for (const auto& p : params) hash = po::fnv1a(std::as_bytes(std::span(p)), hash);
  std::printf("state_bytes_per_parameter=%.4f\n", state.state_per_parameter);
  std::printf("reduce_bytes_per_parameter=%.4f\n", state.reduce_per_parameter);
  std::printf("reserved_bytes_per_rank=");
  for (std::size_t q = 0; q < state.reserved.size(); ++q) std::printf("%s%zu", q ? "," : "", state.reserved[q]);
  std::printf("\n");
  std::printf("final_loss=%.9g\n", static_cast<double>(final_loss));
  std::printf("params_hash=%s\n", hex64(hash).c_str());
  std::fflush(stdout);
}

inline void print_banner(const Options& o, const Setup& su) {
  const po::Shape sh = o.shape;
  const std::string data = o.data.empty() ? std::to_string(su.tokens.size()) + "-byte corpus"
                                          : std::to_string(su.tokens.size()) + "-token shard (vocab " +
                                                std::to_string(su.tokens.vocab()) + ", " +
                                                std::to_string(8 * su.tokens.width()) + "-bit ids)";
  const std::string model =
      o.llama
          ? "Llama " + std::to_string(o.model.layers) + " blocks h=" + std::to_string(o.model.hidden) +
                " heads=" + std::to_string(o.model.heads) + " kv-heads=" + std::to_string(llama_config(o).kv_heads) +
                " ffn=" + std::to_string(llama_config(o).ffn_width())
          : "GPT " + std::to_string(o.model.layers) + " blocks h=" + std::to_string(o.model.hidden) +
                " heads=" + std::to_string(o.model.heads);
  const std::string packed = o.pack >= 0 ? ", packed (a document at every token " + std::to_string(o.pack) + ")" : "";
  std::printf("train_gpt: %s, d=%d v=%d m=%d, %s%s seq=%d batch=%d, %s, %s%s\n", o.schedule.c_str(), sh.d, sh.v, sh.m,
              (model + packed).c_str(), o.model.tie_embeddings ? " tied" : "", o.model.seq, o.batch, data.c_str(),
              o.cuda ? "CUDA (bf16, NCCL)" : ("BLAS " + po::blas::core_name()).c_str(), o.mpi ? ", MPI processes" : "");
  if (o.dp > 1)
    std::printf("data parallel: %d replicas of the pipeline (%d ranks, global rank = replica * %d + rank), zero %d\n",
                o.dp, o.dp * sh.d, sh.d, o.zero);
  std::fflush(stdout);
}

/// Each rank's error ("" = none) to stderr; 1 if any rank failed, else `stopped`.
inline int exit_status(const std::vector<std::string>& errors, int stopped = 0) {
  int status = stopped;  // 128 + a stop signal (train_gpt.cpp's stop_signal), or 0
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      std::fprintf(stderr, "train_gpt: rank %zu: %s\n", r, errors[r].c_str());
      status = 1;
    }
  return status;
}

}  // namespace train_gpt
