// pipeoffload/plan/plan.hpp: from a model and a machine to the fastest schedule that fits.
// po::plan lays the model out over stages, builds and simulates every candidate with the code
// the runtime runs, and picks the fastest that fits, its memory counted as the runtime
// reserves it (more memory never makes the choice slower). How, step by step:
// docs/planner.md, "How po::plan chooses"; what it counts: docs/memory.md.
/// @file
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../policy/spec.hpp"
#include "../schedule/build.hpp"
#include "../schedule/lower.hpp"
#include "../schedule/schedule.hpp"
#include "../sim/simulate.hpp"
#include "model.hpp"

namespace pipeoffload {

/// One schedule the planner built and simulated.
struct PlanCandidate {
  ScheduleSpec spec{};  ///< the schedule (family, group, offload, placement)
  std::string name;  ///< the plan tool's --schedule name: 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, zb-h1, ...
  int chunks = 1;    ///< v
  StageCut cut = StageCut::slots;         ///< how the model is cut into its v*d stages
  int group = 0;                          ///< g of GIS(g) (1 for PO, 0 for 1F1B and 1F1B-I)
  int offload_chunks = 0;                 ///< chunks 0..n-1 offloaded
  int copy_streams = 1;                   ///< copy streams its offloads are planned on (1 when it offloads nothing)
  double iteration_time_s = 0;            ///< max(compute_time_s, every rank's last all-reduce end)
  double compute_time_s = 0;              ///< simulated makespan of the passes alone
  double allreduce_exposed_s = 0;         ///< iteration_time_s - compute_time_s: all-reduce the cooldown does not hide
  std::vector<double> allreduce_s;        ///< per rank: seconds of gradient all-reduce (its stages' sum; 0 with dp = 1)
  std::vector<double> allreduce_end_s;    ///< per rank: when its last all-reduce ends (0 with dp = 1)
  double bubble_fraction = 0;             ///< idle time / makespan, averaged over ranks
  std::vector<double> activation_bytes;   ///< per rank: simulated peak of saved activations and stashes on the device
  std::vector<double> stash_bytes;        ///< per rank: simulated peak of the stashes alone (B to W)
  std::vector<double> peak_device_bytes;  ///< per rank: model state + activations + workspace (lowered: + buffers)
  bool lowered = false;                   ///< the bytes below are its lowered memory plan's, not estimates
  std::vector<double> buffer_bytes;       ///< per rank (lowered): the memory plan's region, what the runtime reserves
  std::vector<double> message_bytes;      ///< per rank (lowered): the most boundary tensors alive at once
  std::vector<double> runtime_bytes;      ///< per rank (lowered): the runtime's step inputs, losses and flags
  std::vector<double> host_bytes;         ///< per rank: pinned host memory, offloaded units' bins and staging
  bool fits = false;                      ///< every rank's device and host memory holds what it needs
  double shortfall_bytes = 0;             ///< 0 if it fits; else the largest excess over device or host memory
  int shortfall_rank = -1;                ///< the rank with that excess
  bool shortfall_on_host = false;         ///< that excess is over host memory (false: device memory)

  /// The largest of peak_device_bytes: the most device memory any rank needs.
  constexpr double max_device_bytes() const {
    double x = 0;
    for (double b : peak_device_bytes) x = std::max(x, b);
    return x;
  }
  /// Rank r's all-reduce that ends within the compute makespan, as a fraction of its total:
  /// 1 - exposed_r / allreduce_s[r], exposed_r = max(0, allreduce_end_s[r] - compute_time_s);
  /// 1 with nothing to reduce.
  constexpr double allreduce_hidden(int r) const {
    const auto u = static_cast<std::size_t>(r);
    if (u >= allreduce_s.size() || !(allreduce_s[u] > 0)) return 1;
    return 1 - std::max(0.0, allreduce_end_s[u] - compute_time_s) / allreduce_s[u];
  }
};

/// One rank's device bytes at its peak, by kind, and its pinned host bytes (PlanResult::per_rank).
/// device = state + optimizer + buffers + scratch + workspace + reserve; activations, stash and messages are
/// what the buffers' region holds at its fullest (docs/lowering.md).
struct RankMemory {
  double device = 0;       ///< the rank's peak device bytes (PlanCandidate::peak_device_bytes)
  double host = 0;         ///< pinned host bytes: offloaded units' bins and `staging` (PlanCandidate::host_bytes)
  double state = 0;        ///< working parameters, main gradients, the runtime's sums and staging
  double optimizer = 0;    ///< the optimizer's state and fp32 master (its shard with ZeRO-1)
  double buffers = 0;      ///< the lowered memory plan's region: units, stashes, boundary tensors at their offsets
  double activations = 0;  ///< simulated peak of saved units and stashes together (within buffers)
  double stash = 0;        ///< of which the stashes alone at their own peak (B to W)
  double messages = 0;     ///< the most boundary tensors alive at once (within buffers)
  double scratch = 0;      ///< the stages' own scratch (stage_scratch_bytes of each: logits, workspaces)
  double workspace = 0;    ///< the libraries' workspace in the backend's arena (PlanBudget::workspace_bytes)
  double reserve = 0;      ///< PlanBudget::reserved_bytes (CUDA context, NCCL, libraries' allocations)
  double staging = 0;      ///< of host: the backend's pinned staging (PlanBudget::staging_bytes; 0 on the CPU)
};

/// One data-parallel degree a search (GridSpec::dp = 0) tried.
struct GridOption {
  int dp = 1;                   ///< replicas
  int ranks = 1;                ///< d = gpus / dp
  int microbatches = 0;         ///< per replica (0 when the global batch does not split into dp)
  bool planned = false;         ///< false: not plannable, `note` says why
  bool fits = false;            ///< its choice fits (PlanCandidate::fits)
  double iteration_time_s = 0;  ///< its choice's iteration time, seconds
  double shortfall_bytes = 0;   ///< its choice's shortfall, bytes (0 if it fits)
  std::string schedule;         ///< the grid's choice (its closest plan when nothing fits)
  int chunks = 0;               ///< v of that choice
  std::string note;             ///< why it was not planned, or its plan's why
};

/// What plan() returns: the choice (the closest candidate when nothing fits) and how it came.
struct PlanResult {
  bool fits = false;                          ///< the choice fits (PlanCandidate::fits)
  PlanCandidate choice;                       ///< the fastest candidate that fits, or the closest to fitting
  int microbatches = 0;                       ///< per replica: global batch / (dp * microbatch size)
  int ranks = 0;                              ///< d: MachineSpec::ranks, or the searched grid's
  int dp = 1;                                 ///< replicas (the search's choice with GridSpec::dp = 0)
  int zero = 0;                               ///< ZeRO stage
  Gradients gradients = Gradients::standard;  ///< PlanBudget's gradient path
  PlanBackend backend = PlanBackend::cuda;    ///< PlanBudget's: whose memory was counted
  bool searched = false;                      ///< dp was searched (GridSpec::dp = 0): `grids` lists every dp tried
  std::vector<GridOption> grids;              ///< with `searched`: every dp tried, in search order
  double allreduce_bytes_per_s = 0;           ///< GridSpec's
  int gpus_per_node = 8;                      ///< GridSpec's
  NodeLayout node_layout = NodeLayout::contiguous;  ///< GridSpec's
  double k = 0;                                     ///< round-trip copy / compute of one layer
  double duplex_slowdown = 1;      ///< MachineSpec's: with the choice's two copy streams, a copy's slowdown
  bool pairs_share_switch = true;  ///< MachineSpec's: ranks r and r^1 share a PCIe switch
  double flops = 0;                ///< MachineSpec::flops: the FLOP/s the choice's stage costs assume (stage_costs)
  double activation_bytes_per_layer = 0;  ///< saved bytes of one layer per microbatch
  std::vector<int> layers_per_stage;      ///< of the choice's v*d stages (embedding and LM head not counted)
  std::vector<double> model_state_bytes;  ///< per rank, of the choice's layout
  std::vector<double> workspace_bytes;    ///< per rank, of the choice's layout
  std::vector<double> optimizer_bytes;    ///< per rank: the optimizer-state part of model_state_bytes
  std::vector<RankMemory> per_rank;       ///< per rank: the choice's memory by kind
  std::vector<double> allreduce_stage_s;  ///< per stage of the choice's layout: one all-reduce of its gradients
  /// Pinned host bytes of the choice per node (the sum over the GPUs of all replicas on it),
  /// in the contiguous and in the balanced layout (empty where balanced is not defined).
  std::vector<double> host_bytes_per_node_contiguous,  ///< per node, contiguous layout
      host_bytes_per_node_balanced;                    ///< per node, balanced layout (or empty)
  std::vector<PlanCandidate> candidates;  ///< every candidate simulated, in search order (of the chosen grid)
  std::string why;                        ///< one sentence: why this choice
};

namespace detail {

/// Per-stage costs, unit sizes and per-rank fixed memory of one v.
struct Layout {
  int v = 1;
  int dp = 1;
  Placement placement = Placement::interleaved;
  StageCut cut = StageCut::slots;
  std::vector<StageContent> stages;
  Costs costs;
  std::vector<double> model_state, workspace;  ///< per rank
  std::vector<double> optimizer;               ///< per rank: the optimizer's part of model_state (state and master)
  std::vector<double> scratch;                 ///< per rank: its stages' own scratch (part of workspace)
  double messages = 0;                         ///< P2P buffers of a rank (part of workspace): the estimate's
  double libraries = 0;                        ///< PlanBudget::workspace_bytes in its size class (part of workspace)
  double reserve = 0;                          ///< PlanBudget::reserved_bytes (part of workspace)
  double staging = 0;                          ///< PlanBudget::staging_bytes on CUDA, 0 on the CPU (host bytes)
  double boundary = 0;                         ///< bytes of one boundary tensor (b s h values)
  double block = 256;                          ///< the backend's block rounding (arena size classes)
  bool cpu = false;                            ///< PlanBackend::cpu: train_gpt's CPU GPT is counted
  std::vector<double> allreduce;               ///< per stage: seconds of one all-reduce of its gradients
};

/// `bytes` (at least 1, rounded up to whole bytes) rounded up to a multiple of `block`: a block's
/// bytes in an arena of that size class.
constexpr double round_to(double bytes, double block) {
  auto n = static_cast<std::uint64_t>(bytes);
  if (static_cast<double>(n) < bytes) ++n;
  const auto k = static_cast<std::uint64_t>(block);
  return static_cast<double>((std::max<std::uint64_t>(n, 1) + k - 1) / k * k);
}

/// What sizes a rank's model state under `bud` and `grid`: replica 0's (it owns the most of
/// every bucket when the parameters do not split evenly).
constexpr StateOptions state_options(const PlanBudget& bud, const GridSpec& grid) {
  return {.gradients = bud.gradients,
          .dp = grid.dp,
          .replica = 0,
          .zero = grid.zero,
          .optimizer_states = bud.optimizer_states,
          .reduce_bucket = bud.reduce_bucket,
          .parameter_bytes = static_cast<std::size_t>(bud.backend == PlanBackend::cpu ? 4 : bud.parameter_bytes),
          .reduce_bytes = static_cast<std::size_t>(bud.reduce_bytes)};
}

/// Seconds of one gradient reduction of a stage of P parameters over dp replicas, as the
/// runtime runs it: the bytes a replica sends for it (po::traffic_bytes) / the bandwidth.
constexpr double allreduce_seconds(double P, const PlanBudget& bud, const GridSpec& grid) {
  if (grid.dp <= 1) return 0;
  const std::size_t n[1] = {static_cast<std::size_t>(P)};
  return static_cast<double>(traffic_bytes(n, state_options(bud, grid))) / grid.allreduce_bytes_per_s;
}

/// Per-stage costs and per-rank fixed memory of one v (grid.dp >= 1).
constexpr Layout make_layout(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud, int v,
                             const GridSpec& grid = {}, Placement placement = Placement::interleaved,
                             StageCut cut = StageCut::slots) {
  const int d = x.ranks, S = v * d;
  const Shape where{d, v, 1, placement};
  const bool cpu = bud.backend == PlanBackend::cpu;
  Layout L;
  L.v = v;
  L.placement = placement;
  L.dp = grid.dp;
  L.optimizer.assign(static_cast<std::size_t>(d), 0.0);
  L.cut = cut;
  L.stages = cut_layout(m, S, cut);
  L.costs = stage_costs(m, L.stages, x.flops, copy_ratio(m, x), bud.backend);
  L.costs.stagger_pairs = x.pairs_share_switch;
  L.costs.copy_streams = x.copy_streams == 2 ? 2 : 1;  // 0: plan_grid adds a two-stream layout beside
  L.costs.duplex_slowdown = x.duplex_slowdown;
  L.model_state.assign(static_cast<std::size_t>(d), 0.0);
  L.workspace.assign(static_cast<std::size_t>(d), 0.0);
  std::vector<double> transient(static_cast<std::size_t>(d), 0.0);
  // The CUDA stages' own state beyond parameters and gradients (stage_own_state_bytes).
  std::vector<double> own_state(static_cast<std::size_t>(d), 0.0);
  std::vector<std::vector<std::size_t>> chunks(static_cast<std::size_t>(d));  // per rank: its chunks' parameters
  std::vector<TiedState> ties(static_cast<std::size_t>(d));                   // per rank: tied embeddings
  for (int s = 0; s < S; ++s) {
    const StageContent& c = L.stages[static_cast<std::size_t>(s)];
    const auto r = static_cast<std::size_t>(where.rank_of(s));
    const double P = stage_parameters(m, c);
    chunks[r].push_back(static_cast<std::size_t>(P));
    if (m.tied_embeddings) {  // stage 0's embedding is the primary, the head's weight its copy
      ties[r].copies.resize(chunks[r].size());
      if (c.embedding) ties[r].primary_values = static_cast<std::size_t>(m.vocab) * static_cast<std::size_t>(m.hidden);
      if (c.head) ties[r].copies.back().push_back(head_weight_range(m, c));
    }
    L.allreduce.push_back(allreduce_seconds(P, bud, grid));
    if (!cpu) transient[r] += stage_scratch_bytes(m, c);
    if (!cpu) own_state[r] += stage_own_state_bytes(m, c);
  }
  L.block = cpu ? 64 : 256;
  L.cpu = cpu;
  const auto rounded = [&](std::size_t bytes) { return detail::round_to(static_cast<double>(bytes), L.block); };
  for (std::size_t r = 0; r < chunks.size(); ++r) {
    const StateOptions so = state_options(bud, grid);
    const StateBytes b = state_bytes(chunks[r], so, ties[r]);
    // The layers' own parameters and gradients, and each arena block in its size class; the
    // optimizer's blocks (its states and master, per chunk) among them.
    double arena = 0, optimizer = 0;
    for (std::size_t blk : b.blocks) arena += rounded(blk);
    const std::vector<ParamRange> none;
    for (std::size_t c = 0; c < chunks[r].size(); ++c) {
      const std::vector<ParamRange>& copies = c < ties[r].copies.size() ? ties[r].copies[c] : none;
      const double one = rounded(updated_parameters(chunks[r][c], so, copies) * sizeof(float));
      optimizer += one * (so.optimizer_states + (so.parameter_bytes != sizeof(float) ? 1 : 0));
    }
    L.model_state[r] = static_cast<double>(b.parameters + b.gradients) + arena + own_state[r];
    L.optimizer[r] = optimizer;
  }
  // Two P2P buffers each way (activation in/out, gradient in/out), b*s*h elements each.
  L.boundary = bsh(m) * (cpu ? 4 : m.dtype_bytes);
  const double p2p = 4.0 * L.boundary;
  L.messages = p2p;
  L.scratch = transient;
  L.reserve = cpu ? 0.0 : bud.reserved_bytes;
  L.staging = cpu ? 0.0 : bud.staging_bytes;
  L.libraries = cpu ? 0.0 : detail::round_to(bud.workspace_bytes, L.block);
  for (int r = 0; r < d; ++r)
    L.workspace[static_cast<std::size_t>(r)] = L.reserve + L.libraries + p2p + transient[static_cast<std::size_t>(r)];
  return L;
}

/// Pinned host bytes a rank needs: offloaded units resident from their offload's start to
/// their reload's end. A copy stream runs in order, so its event times are already sorted.
constexpr double host_peak(const Program& p, const RankSim& rs, int r) {
  const RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
  double alive = 0, peak = 0;
  for (std::size_t y = 0; y < rp.copy.size(); ++y) {
    const double bytes = host_bin_bytes(p.costs.bytes(rp.copy[y].stage));
    if (rp.copy[y].kind == OpKind::O)
      alive += bytes;
    else
      alive -= bytes;
    peak = std::max(peak, alive);
  }
  (void)rs;
  return peak;
}

/// Each rank's gradient all-reduces after its passes (header comment): stage s's starts when
/// its last W (or BW) has ended and the rank's previous all-reduce is done, in the order the
/// stages' last W's end (ties: lower stage first). Fills, per rank, the total seconds and the
/// end of the last one (all 0 when `stage_s` is all 0: dp = 1).
constexpr void reduce_gradients(const Program& p, const SimResult& sim, const std::vector<double>& stage_s,
                                std::vector<double>& total, std::vector<double>& end) {
  const int d = p.shape.d, v = p.shape.v;
  total.assign(static_cast<std::size_t>(d), 0.0);
  end.assign(static_cast<std::size_t>(d), 0.0);
  bool any = false;
  for (double t : stage_s) any = any || t > 0;
  if (!any) return;
  std::vector<std::pair<double, int>> last(static_cast<std::size_t>(v));  // (last W end, stage) per chunk
  for (int r = 0; r < d; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    for (int c = 0; c < v; ++c) last[static_cast<std::size_t>(c)] = {0.0, p.shape.stage_of(r, c)};
    const RankProgram& rp = p.ranks[ur];
    for (std::size_t i = 0; i < rp.compute.size(); ++i) {
      const Op& op = rp.compute[i];
      if (op.kind != OpKind::W && op.kind != OpKind::BW) continue;
      auto& l = last[static_cast<std::size_t>(p.shape.chunk_of(op.stage))];
      l.first = std::max(l.first, sim.ranks[ur].compute_end[i]);
    }
    std::sort(last.begin(), last.end());
    double t = 0, sum = 0;
    for (const auto& [w, stage] : last) {
      const double x = stage_s[static_cast<std::size_t>(stage)];
      t = std::max(t, w) + x;
      sum += x;
    }
    total[ur] = sum;
    end[ur] = t;
  }
}

constexpr std::string fmt_gib(double bytes) {
  // Two decimals without <cstdio> (constexpr).
  const long long centi = static_cast<long long>(bytes / gib * 100 + 0.5);
  std::string frac = num(centi % 100);
  if (frac.size() < 2) frac = "0" + frac;
  return num(centi / 100) + "." + frac + " GiB";
}

/// The divisors of n > 0 in increasing order, the first `most` of them: "1, 2, 4, 8, ...".
constexpr std::string divisors(long long n, int most) {
  std::string s;
  int shown = 0;
  for (long long k = 1; k <= n; ++k) {
    if (n % k != 0) continue;
    if (shown == most) return s + ", ...";
    s += (shown++ ? ", " : "") + num(k);
  }
  return s;
}

constexpr std::string describe(const PlanCandidate& c) {
  std::string s = c.name + " (v=" + num(c.chunks);
  if (c.name == "gis-g") s += ", g=" + num(c.group);
  if (c.offload_chunks > 0 && c.name != "po-h" && c.name != "po-f") s += ", offload " + num(c.offload_chunks);
  if (c.copy_streams == 2) s += ", 2 copy streams";
  if (c.cut != StageCut::slots) {
    s += ", ";
    s += stage_cut_name(c.cut);
    s += " cut";
  }
  return s + ")";
}

/// Candidate a is better than b: faster, then less device memory, then earlier in the search.
constexpr bool faster(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.iteration_time_s != b.iteration_time_s) return a.iteration_time_s < b.iteration_time_s;
  return a.max_device_bytes() < b.max_device_bytes();
}

/// Closer to fitting: a smaller shortfall, then faster.
constexpr bool closer(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.shortfall_bytes != b.shortfall_bytes) return a.shortfall_bytes < b.shortfall_bytes;
  return faster(a, b);
}

}  // namespace detail

/// The schedule specs plan() searches for d ranks and v chunks, with their tool names.
struct PlanOption {
  ScheduleSpec spec;       ///< the schedule
  std::string name;        ///< its plan tool --schedule name (1f1b, gis-h, po-f, ...)
  int group = 0;           ///< g of GIS(g) (1 for PO, 0 for families without groups)
  int offload_chunks = 0;  ///< chunks 0..n-1 offloaded
};

/// The schedules plan() tries for d ranks, v chunks per rank and m microbatches (those with
/// offload only when allow_offload), in search order. Each is its named_schedules entry, with
/// GIS(g)'s group and the offload it is tried with.
constexpr std::vector<PlanOption> plan_options(int d, int v, int m, bool allow_offload) {
  std::vector<PlanOption> out;
  const auto add = [&](std::string_view name, int group, int chunks, std::optional<offload::selection> off = {}) {
    ScheduleSpec s = find_schedule(name)->spec;
    if (s.group.kind == GroupSpec::Kind::number) s.group.value = group;
    if (off) s.offload = *off;
    out.push_back({s, std::string(name), group, chunks});
  };
  if (v == 1) add("1f1b", 0, 0);
  if (v >= 2 && m % d == 0) add("1f1b-i", 0, 0);
  // The zero-bubble families, plain and with every chunk offloaded; ZB-H1 and ZB-H2 run one
  // chunk a rank, the V families (on their own V placement, which plan() lays out) two.
  const auto zero_bubble = [&](std::string_view name) {
    add(name, 0, 0);
    if (allow_offload) add(name, 0, v, offload::all);
  };
  if (v == 1) {
    zero_bubble("zb-h1");
    zero_bubble("zb-h2");
  }
  if (v == 2) {
    zero_bubble("zb-v");
    zero_bubble("v-half");
    zero_bubble("v-min");
    if (m >= 2 * d) zero_bubble("dualpipe-v");  // DeepSeek's order needs m >= 2d
  }
  const int lo = GroupSpec::smallest(d);
  for (int g = d; g >= lo; --g) {
    if (g == 1 && d == 2) continue;  // GIS(1) on two ranks is PO's order: PO below covers it
    add(g == d ? "gis" : g == lo ? "gis-h" : "gis-g", g, 0);
  }
  const int half = (v + 1) / 2;
  for (int n = 0; n <= (allow_offload ? v : 0); ++n) {
    if (n > 0 && n == v)
      add("po-f", 1, n);
    else if (n > 0 && n == half)
      add("po-h", 1, n);
    else
      add("po", 1, n, n == 0 ? offload::none : offload::first(n));
  }
  return out;
}

namespace detail {

/// Whether every rank of `c` holds its device and host bytes on machine `x`, and if not the
/// largest excess and where.
constexpr void judge(PlanCandidate& c, const MachineSpec& x) {
  c.fits = true;
  c.shortfall_bytes = 0;
  c.shortfall_rank = -1;
  c.shortfall_on_host = false;
  for (std::size_t u = 0; u < c.peak_device_bytes.size(); ++u) {
    const double over_dev = c.peak_device_bytes[u] - x.device_bytes, over_host = c.host_bytes[u] - x.host_bytes;
    const double over = std::max(over_dev, over_host);
    if (over > 0) c.fits = false;
    if (over > c.shortfall_bytes) {
      c.shortfall_bytes = over;
      c.shortfall_rank = static_cast<int>(u);
      c.shortfall_on_host = over_host > over_dev;
    }
  }
}

/// Every stage's buffers as the runtime sizes them (po::StageBytes): its unit and stash, and
/// the boundary tensor between stages (b s h values of the model's dtype).
constexpr std::vector<StageBytes> stage_buffers(const Layout& L) {
  const int S = static_cast<int>(L.stages.size());
  const auto boundary = static_cast<std::size_t>(L.boundary);
  std::vector<StageBytes> out;
  for (int s = 0; s < S; ++s)
    out.push_back({.saved = static_cast<std::size_t>(L.costs.bytes(s)),
                   .stash = static_cast<std::size_t>(L.costs.stash(s)),
                   .input = s > 0 ? boundary : 0,
                   .output = s + 1 < S ? boundary : 0});
  return out;
}

}  // namespace detail

/// Replaces candidate `c`'s estimated activation and message bytes by its lowered memory plan
/// (po::lower_all of its training and evaluation programs, docs/lowering.md): each rank's
/// device bytes become model state + the region the runtime reserves + scratch + workspace +
/// reserve, and
/// `c` is judged again on machine `x`. `p`: scratch for the rebuilt program.
constexpr void lower_candidate(PlanCandidate& c, const detail::Layout& L, const TransformerSpec& m,
                               const MachineSpec& x, Program& p) {
  const int d = x.ranks, mb = m.global_batch / (m.micro_batch * L.dp);
  // The program timed is the one lowered, and the one a launcher runs: train_gpt builds the
  // plan's schedule with the same stage_costs (train_gpt_args' --flops and --k).
  build_into(p, c.spec, {d, L.v, mb}, L.costs);
  const std::vector<StageBytes> bytes = detail::stage_buffers(L);
  const std::vector<LoweredRank> train = lower_all(p, bytes), eval = lower_all(forward_only(p), bytes);
  c.lowered = true;
  c.buffer_bytes.clear();
  c.message_bytes.clear();
  c.runtime_bytes.clear();
  const auto rounded = [&](double b) { return detail::round_to(b, L.block); };
  const double T = static_cast<double>(m.micro_batch) * m.seq;
  for (int r = 0; r < d; ++r) {
    const auto u = static_cast<std::size_t>(r);
    const double region = static_cast<double>(std::max(train[u].region, eval[u].region));
    // The runtime's own blocks: the step inputs its stages read (stage_inputs; one block a name),
    // and its results: a non-finite flag per compute op and each microbatch's loss.
    StageInputs reads;
    for (int k = 0; k < L.v; ++k) {
      const StageInputs s = stage_inputs(m, L.stages[static_cast<std::size_t>(p.shape.stage_of(r, k))]);
      reads = {reads.tokens || s.tokens, reads.targets || s.targets, reads.documents || s.documents};
    }
    const double offsets = static_cast<double>(m.micro_batch) * (m.seq + 1.0);  // a microbatch's, int32
    const double inputs = (reads.tokens ? rounded(4 * mb * T) : 0.0) + (reads.targets ? rounded(4 * mb * T) : 0.0) +
                          (reads.documents ? rounded(4 * mb * offsets) : 0.0);
    double fixed =
        inputs + rounded(4.0 * (mb + static_cast<double>(std::max<std::size_t>(1, p.ranks[u].compute.size()))));
    // backend::Cuda's gradient-norm buffer: the runtime reserves each chunk's in chunk order,
    // and one of a larger size class is a new block (the smaller stays in its pool).
    double most = 0;
    for (int k = 0; k < L.v && !L.cpu; ++k) {
      const double need =
          rounded(stage_norm_buffer_bytes(m, L.stages[static_cast<std::size_t>(p.shape.stage_of(r, k))]));
      if (need > most) fixed += need;
      most = std::max(most, need);
    }
    c.buffer_bytes.push_back(region);
    c.message_bytes.push_back(static_cast<double>(std::max(train[u].peak[2], eval[u].peak[2])));
    c.runtime_bytes.push_back(fixed);
    double host = 0;  // the pinned bins the runtime reserves (training's; evaluation has none)
    for (const BlockCount& b : train[u].host) host += static_cast<double>(b.bytes * b.count);
    c.host_bytes[u] = host + L.staging;
    c.peak_device_bytes[u] = L.model_state[u] + fixed + region + L.scratch[u] + L.libraries + L.reserve;
  }
  detail::judge(c, x);
}

/// Largest stage-microbatch count (d*v*m) one candidate may have: bounds the planner's time
/// (about 3 compute ops per unit, ~100 ns per op to build and simulate).
inline constexpr long long max_plan_units = 1LL << 20;
/// Largest sum of d*v*m over all candidates of one plan (a few seconds of building and
/// simulating): a search beyond it is refused with a sentence rather than left to run.
inline constexpr long long max_plan_work = 1LL << 25;

/// Builds, simulates and measures one candidate on a layout, into `p` and `sim` (a search
/// reuses them from candidate to candidate: build_into, simulate_into).
constexpr PlanCandidate evaluate(const PlanOption& o, const detail::Layout& L, const TransformerSpec& m,
                                 const MachineSpec& x, Program& p, SimResult& sim) {
  const int d = x.ranks, mb = m.global_batch / (m.micro_batch * L.dp);
  build_into(p, o.spec, {d, L.v, mb}, L.costs);
  simulate_into(sim, p);
  PlanCandidate c;
  c.spec = o.spec;
  c.name = o.name;
  c.chunks = L.v;
  c.cut = L.cut;
  c.group = p.group;
  c.offload_chunks = o.offload_chunks;
  c.copy_streams = o.offload_chunks > 0 ? L.costs.copy_streams : 1;
  c.compute_time_s = sim.makespan;
  detail::reduce_gradients(p, sim, L.allreduce, c.allreduce_s, c.allreduce_end_s);
  c.iteration_time_s = sim.makespan;
  for (double e : c.allreduce_end_s) c.iteration_time_s = std::max(c.iteration_time_s, e);
  c.allreduce_exposed_s = c.iteration_time_s - sim.makespan;
  c.bubble_fraction = sim.bubble_fraction();
  for (int r = 0; r < d; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const double act = sim.ranks[ur].peak;
    c.activation_bytes.push_back(act);
    c.stash_bytes.push_back(sim.ranks[ur].stash_peak);
    c.peak_device_bytes.push_back(L.model_state[ur] + act + L.workspace[ur]);
    c.host_bytes.push_back(detail::host_peak(p, sim.ranks[ur], r) + L.staging);
  }
  detail::judge(c, x);
  return c;
}

/// Builds, simulates and measures one candidate on a layout.
constexpr PlanCandidate evaluate(const PlanOption& o, const detail::Layout& L, const TransformerSpec& m,
                                 const MachineSpec& x) {
  Program p;
  SimResult sim;
  return evaluate(o, L, m, x, p, sim);
}

/// Largest sum of d*v*m over the candidates of every grid one dp search (GridSpec::dp = 0)
/// plans: a search beyond it is refused with a sentence.
inline constexpr long long max_search_work = 2 * max_plan_work;
/// Most GPUs of a grid (dp x ranks, or GridSpec::gpus).
inline constexpr int max_grid_gpus = 1 << 16;

/// Pinned host bytes per node when pipeline rank r of each of dp replicas needs host[r] and
/// nodes hold G consecutive global ranks (rank layout: plan/model.hpp; node_layout_fits(layout,
/// d, G) must hold, d = host.size()). The last node may be partly used.
constexpr std::vector<double> host_bytes_per_node(const std::vector<double>& host, int dp, int G, NodeLayout layout) {
  const int d = static_cast<int>(host.size());
  const long long gpus = static_cast<long long>(d) * dp;
  std::vector<double> out(static_cast<std::size_t>((gpus + G - 1) / G), 0.0);
  for (int j = 0; j < dp; ++j)
    for (int r = 0; r < d; ++r)
      out[static_cast<std::size_t>(node_of(layout, d, G, j, r))] += host[static_cast<std::size_t>(r)];
  return out;
}

/// Throws shape_error with a sentence (naming the value and what is allowed) for a grid the
/// planner cannot use with this model and machine.
constexpr void check_grid(const TransformerSpec& m, const MachineSpec& x, const GridSpec& g) {
  using detail::num;
  detail::require_range("grid: data-parallel degree dp (0 = search)", g.dp, 0, max_grid_gpus);
  detail::require_range("grid: ZeRO stage", g.zero, 0, 1);
  if (!(g.allreduce_bytes_per_s >= 1 && g.allreduce_bytes_per_s <= 1e21))
    throw shape_error("grid: all-reduce bandwidth must be in [1, 1e21] bytes/s, got " +
                      detail::fmt_real(g.allreduce_bytes_per_s));
  detail::require_range("grid: GPUs per node", g.gpus_per_node, 1, max_grid_gpus);
  if (g.dp == 0) {
    detail::require_range("grid: GPUs to search over (dp = 0)", g.gpus, 1, max_grid_gpus);
    return;
  }
  const long long gpus = static_cast<long long>(g.dp) * x.ranks;
  if (gpus > max_grid_gpus)
    throw shape_error("grid: dp " + num(g.dp) + " x ranks " + num(x.ranks) + " = " + num(gpus) + " GPUs; at most " +
                      num(max_grid_gpus));
  if (g.gpus != 0 && g.gpus != gpus)
    throw shape_error("grid: gpus = " + num(g.gpus) + " must be 0 or dp x ranks = " + num(gpus));
  const int mb = m.global_batch / m.micro_batch;
  if (mb % g.dp != 0)
    throw shape_error("grid: dp = " + num(g.dp) + " does not split the global batch: its " + num(mb) +
                      " microbatches (global batch " + num(m.global_batch) + " / microbatch size " +
                      num(m.micro_batch) + ") are not a multiple of dp; dp must divide " + num(mb) + " (" +
                      detail::divisors(mb, 12) + ")");
  if (!node_layout_fits(g.node_layout, x.ranks, g.gpus_per_node))
    throw shape_error(
        "grid: the balanced node layout needs ranks d <= GPUs per node G, or d a multiple of G with G even; got d = " +
        num(x.ranks) + ", G = " + num(g.gpus_per_node));
}

namespace detail {

/// The largest v a plan of d ranks and mb microbatches per replica searches.
constexpr int plan_vmax(const TransformerSpec& m, int d, int mb, const PlanBudget& bud) {
  const int vmax = std::min(layer_slots(m) / d, bud.max_chunks > 0 ? bud.max_chunks : 64);
  return static_cast<int>(std::min<long long>(vmax, max_plan_units / (static_cast<long long>(d) * mb)));
}

/// Whether a plan of d ranks on machine x tries each candidate that offloads on two copy
/// streams as well as on one (MachineSpec::copy_streams 0, ranks without a PCIe partner).
constexpr bool tries_two_streams(const MachineSpec& x, int d) {
  return x.copy_streams == 0 && second_copy_stream_may_help(d, x.pairs_share_switch);
}

/// Stage-microbatch pairs (d*v*m) such a plan builds and simulates over all its candidates.
constexpr long long plan_work(const TransformerSpec& m, int d, int mb, const PlanBudget& bud, const MachineSpec& x) {
  long long work = 0;
  for (int v = 1; v <= plan_vmax(m, d, mb, bud); ++v)
    for (const StageCut cut : {StageCut::slots, StageCut::even})
      if (distinct_cut(m, v * d, cut))
        for (const PlanOption& o : plan_options(d, v, mb, bud.allow_offload))
          if (bud.schedule.empty() || o.name == bud.schedule)
            work += static_cast<long long>(d) * v * mb * (o.offload_chunks > 0 && tries_two_streams(x, d) ? 2 : 1);
  return work;
}

/// plan() for one grid (grid.dp >= 1, model, machine, budget and grid checked).
constexpr PlanResult plan_grid(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud,
                               const GridSpec& grid) {
  const int d = x.ranks, mb = m.global_batch / (m.micro_batch * grid.dp);
  const int slots = layer_slots(m);
  if (d > slots)
    throw shape_error("plan: " + num(d) + " ranks but only " + num(slots) + " layer slots (" + num(m.layers) +
                      " layers" + (m.vocab_stages ? " + embedding + LM head" : "") +
                      "); every rank needs at least one");
  if (static_cast<long long>(d) * mb > max_plan_units)
    throw shape_error("plan: ranks x microbatches = " + num(static_cast<long long>(d) * mb) +
                      " is too large to simulate; at most " + num(max_plan_units));
  const int vmax = plan_vmax(m, d, mb, bud);
  const long long work = plan_work(m, d, mb, bud, x);
  if (work > max_plan_work)
    throw shape_error("plan: the search would simulate " + num(work) +
                      " stage-microbatch pairs over all candidates, more than " + num(max_plan_work) +
                      "; use fewer ranks or microbatches, or cap the chunks per rank (budget.max_chunks)");

  PlanResult res;
  res.microbatches = mb;
  res.k = copy_ratio(m, x);
  res.flops = x.flops;
  res.activation_bytes_per_layer = activation_bytes_per_layer(m);
  res.duplex_slowdown = x.duplex_slowdown;
  res.pairs_share_switch = x.pairs_share_switch;
  std::vector<detail::Layout> layouts;
  Program program;  // reused by every candidate
  SimResult sim;
  // One layout per v and cut (the slot cut, and the even one where it differs), and for v = 2
  // one on the V placement too; each once more on two copy streams where those are tried.
  const int base_streams = x.copy_streams == 2 ? 2 : 1;
  const bool two = detail::tries_two_streams(x, d);
  const auto layout_of = [&](int v, Placement pl, StageCut cut, int streams) -> const detail::Layout& {
    for (const detail::Layout& L : layouts)
      if (L.v == v && L.placement == pl && L.cut == cut && L.costs.copy_streams == streams) return L;
    return layouts.front();  // not reached: every option's layout is made before it is evaluated
  };
  const auto layout_for = [&](const PlanCandidate& c) -> const detail::Layout& {
    return layout_of(c.chunks, c.spec.placement, c.cut, c.offload_chunks > 0 ? c.copy_streams : base_streams);
  };
  for (int v = 1; v <= vmax; ++v)
    for (const StageCut cut : {StageCut::slots, StageCut::even}) {
      if (!distinct_cut(m, v * d, cut)) continue;
      for (const Placement pl : {Placement::interleaved, Placement::vshape}) {
        if (pl == Placement::vshape && v != 2) continue;
        layouts.push_back(detail::make_layout(m, x, bud, v, grid, pl, cut));
        if (!two) continue;
        detail::Layout duplex = layouts.back();
        duplex.costs.copy_streams = 2;
        layouts.push_back(std::move(duplex));
      }
      for (const PlanOption& o : plan_options(d, v, mb, bud.allow_offload)) {
        if (!bud.schedule.empty() && o.name != bud.schedule) continue;
        for (int streams = base_streams; streams <= (two && o.offload_chunks > 0 ? 2 : base_streams); ++streams) {
          try {
            res.candidates.push_back(evaluate(o, layout_of(v, o.spec.placement, cut, streams), m, x, program, sim));
          } catch (const shape_error&) {
            // A copy-slot grid too fine for build() (k tiny against the run): that offload
            // candidate is not planned; its no-offload siblings are.
          }
        }
      }
    }
  if (res.candidates.empty() && bud.schedule.empty())
    throw shape_error("plan: no candidate schedule could be built for this model and machine");
  if (res.candidates.empty())
    throw shape_error("plan: no " + bud.schedule + " candidate could be built for this model and machine (" + num(d) +
                      " ranks, " + num(mb) + " microbatches per replica)");

  // The fastest candidate that fits by its estimate is lowered (its memory plan, what the
  // runtime reserves); if it no longer fits, the next is, until one does or none is left.
  PlanCandidate* best = nullptr;
  for (;;) {
    best = nullptr;
    for (PlanCandidate& c : res.candidates)
      if (c.fits && (!best || detail::faster(c, *best))) best = &c;
    if (best == nullptr || best->lowered) break;
    lower_candidate(*best, layout_for(*best), m, x, program);
    if (best->fits) break;
  }
  PlanCandidate* nearest = nullptr;
  if (best == nullptr) {
    for (PlanCandidate& c : res.candidates)
      if (!nearest || detail::closer(c, *nearest)) nearest = &c;
    if (!nearest->lowered) lower_candidate(*nearest, layout_for(*nearest), m, x, program);
    // Its estimate (stand-in message buffers) was above what its lowered program reserves,
    // which fits: a plan that fits, as a candidate that fits by its estimate would be.
    if (nearest->fits) best = nearest;
  }
  res.fits = best != nullptr;
  res.choice = best ? *best : *nearest;
  const detail::Layout& L = layout_for(res.choice);
  for (const StageContent& c : L.stages) res.layers_per_stage.push_back(c.layers);
  res.model_state_bytes = L.model_state;
  res.workspace_bytes = L.workspace;

  // Why: the fastest candidate that does not fit, if it beats the choice; or the shortfall.
  // (Built with += only: GCC 12 destroys a std::string temporary of a ?: twice in constant
  // evaluation.)
  const std::string cap = detail::fmt_gib(x.device_bytes);
  const auto where = [&](const PlanCandidate& c) {
    std::string w = " more ";
    w += c.shortfall_on_host ? "host memory" : "device memory";
    w += " on rank ";
    w += num(c.shortfall_rank);
    return w;
  };
  if (res.fits) {
    int n_fit = 0;
    const PlanCandidate* rival = nullptr;
    for (const PlanCandidate& c : res.candidates) {
      n_fit += c.fits ? 1 : 0;
      if (!c.fits && detail::faster(c, res.choice) && (!rival || detail::faster(c, *rival))) rival = &c;
    }
    res.why = "fastest of the " + num(n_fit) + " of " + num(static_cast<long long>(res.candidates.size())) +
              " simulated schedules that fit in " + cap + " per device";
    if (rival) {
      res.why += "; the faster " + detail::describe(*rival) + " needs " + detail::fmt_gib(rival->shortfall_bytes);
      res.why += where(*rival);
    } else {
      res.why += "; no schedule is faster";
    }
  } else {
    res.why = "nothing fits: the closest, " + detail::describe(res.choice) + ", needs " +
              detail::fmt_gib(res.choice.shortfall_bytes);
    res.why += where(res.choice);
    res.why += " than the ";
    if (res.choice.shortfall_on_host)
      res.why += detail::fmt_gib(x.host_bytes) + " of host memory per rank";
    else
      res.why += cap + " per device";
  }
  res.ranks = d;
  res.dp = grid.dp;
  res.zero = grid.zero;
  res.gradients = bud.gradients;
  res.backend = bud.backend;
  res.allreduce_bytes_per_s = grid.allreduce_bytes_per_s;
  res.gpus_per_node = grid.gpus_per_node;
  res.node_layout = grid.node_layout;
  res.optimizer_bytes = L.optimizer;
  for (int r = 0; r < d && static_cast<std::size_t>(r) < res.choice.peak_device_bytes.size(); ++r) {
    const auto u = static_cast<std::size_t>(r);
    res.per_rank.push_back({.device = res.choice.peak_device_bytes[u],
                            .host = res.choice.host_bytes[u],
                            .state = L.model_state[u] - L.optimizer[u] + res.choice.runtime_bytes[u],
                            .optimizer = L.optimizer[u],
                            .buffers = res.choice.buffer_bytes[u],
                            .activations = res.choice.activation_bytes[u],
                            .stash = res.choice.stash_bytes[u],
                            .messages = res.choice.message_bytes[u],
                            .scratch = L.scratch[u],
                            .workspace = L.libraries,
                            .reserve = L.reserve,
                            .staging = L.staging});
  }
  res.allreduce_stage_s = L.allreduce;
  res.host_bytes_per_node_contiguous =
      host_bytes_per_node(res.choice.host_bytes, grid.dp, grid.gpus_per_node, NodeLayout::contiguous);
  if (node_layout_fits(NodeLayout::balanced, d, grid.gpus_per_node))
    res.host_bytes_per_node_balanced =
        host_bytes_per_node(res.choice.host_bytes, grid.dp, grid.gpus_per_node, NodeLayout::balanced);
  return res;
}

/// Why a dp search cannot plan grid `o` (its dp, ranks and microbatches per replica set), or
/// "" when it can; then `work` is what planning it simulates (plan_work).
constexpr std::string unplannable(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud,
                                  const GridSpec& grid, const GridOption& o, long long& work) {
  const int d = o.ranks, G = grid.gpus_per_node, slots = layer_slots(m);
  const int mb_all = m.global_batch / m.micro_batch;
  if (o.microbatches == 0)
    return "the global batch's " + num(mb_all) + " microbatches do not split into " + num(o.dp) + " replicas";
  if (d > slots) return num(d) + " ranks but only " + num(slots) + " layer slots";
  if (d > max_ranks) return num(d) + " ranks, more than a pipeline may have (" + num(max_ranks) + ")";
  if (!node_layout_fits(grid.node_layout, d, G)) {
    std::string s = "the balanced node layout needs d <= " + num(G) + " or d a multiple of " + num(G);
    if (G % 2 != 0) s += " (an even G)";
    return s;
  }
  const long long units = static_cast<long long>(d) * o.microbatches;
  if (units > max_plan_units) return "ranks x microbatches = " + num(units) + " is too large to simulate";
  const long long w = plan_work(m, d, o.microbatches, bud, x);
  if (w > max_plan_work)
    return "its search would simulate " + num(w) + " stage-microbatch pairs, more than " + num(max_plan_work);
  work = w;
  return "";
}

/// plan() with GridSpec::dp = 0: every dp that divides grid.gpus, each on d = gpus / dp ranks.
constexpr PlanResult plan_search(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud,
                                 const GridSpec& grid) {
  const int N = grid.gpus, mb_all = m.global_batch / m.micro_batch;
  // Which grids can be planned does not depend on the memory sizes (so neither does the set
  // of candidates: more memory never gives a slower choice).
  std::vector<GridOption> grids;
  long long total = 0;
  for (int dp = 1; dp <= N; ++dp) {
    if (N % dp != 0) continue;
    GridOption o;
    o.dp = dp;
    o.ranks = N / dp;
    if (mb_all % dp == 0) o.microbatches = mb_all / dp;
    long long work = 0;
    o.note = unplannable(m, x, bud, grid, o, work);
    o.planned = o.note.empty();
    total += work;
    grids.push_back(o);
  }
  if (total > max_search_work)
    throw shape_error("plan: searching dp over " + num(N) + " GPUs would simulate " + num(total) +
                      " stage-microbatch pairs over all grids, more than " + num(max_search_work) +
                      "; use fewer GPUs or microbatches, cap the chunks per rank (budget.max_chunks), or give dp");

  PlanResult best, nearest;
  bool have_best = false, have_nearest = false;
  int planned = 0, fitting = 0;
  for (GridOption& o : grids) {
    if (!o.planned) continue;
    MachineSpec xd = x;
    xd.ranks = o.ranks;
    GridSpec gd = grid;
    gd.dp = o.dp;
    gd.gpus = N;
    try {
      PlanResult r = plan_grid(m, xd, bud, gd);
      ++planned;
      fitting += r.fits ? 1 : 0;
      o.fits = r.fits;
      o.iteration_time_s = r.choice.iteration_time_s;
      o.shortfall_bytes = r.choice.shortfall_bytes;
      o.schedule = r.choice.name;
      o.chunks = r.choice.chunks;
      o.note = r.why;
      if (r.fits && (!have_best || faster(r.choice, best.choice))) {
        best = r;
        have_best = true;
      }
      if (!have_nearest || closer(r.choice, nearest.choice)) {
        nearest = std::move(r);
        have_nearest = true;
      }
    } catch (const shape_error&) {
      o.planned = false;
      o.note = "no candidate schedule could be built";
    }
  }
  if (planned == 0) {
    std::string why = "plan: no dp that divides " + num(N) + " GPUs gives a grid that can be planned:";
    for (const GridOption& o : grids) why += " dp " + num(o.dp) + ": " + o.note + ";";
    why.back() = '.';
    throw shape_error(why);
  }
  PlanResult res = have_best ? std::move(best) : std::move(nearest);
  const std::string grid_name =
      "dp " + num(res.dp) + " x d " + num(res.ranks) + " (" + num(res.microbatches) + " microbatches per replica)";
  std::string why;
  if (res.fits) {
    why = grid_name + ": the fastest of the " + num(fitting) + " of " + num(planned) + " grids of " + num(N) +
          " GPUs that fit";
    std::string none;
    for (const GridOption& o : grids)
      if (o.planned && !o.fits) none += (none.empty() ? "" : ", ") + num(o.dp);
    if (!none.empty()) why += " (nothing fits with dp " + none + ")";
  } else {
    why = "nothing fits on any of the " + num(planned) + " grids of " + num(N) + " GPUs; the closest is " + grid_name;
  }
  why += "; in it, ";
  why += res.why;
  res.why = why;
  res.searched = true;
  res.grids = std::move(grids);
  return res;
}

}  // namespace detail

/// The fastest schedule whose every rank fits in device and host memory (header comment), for
/// dp replicas of the pipeline (GridSpec; by default one), or for the best dp when grid.dp = 0.
/// Throws shape_error, with a sentence, for a model, machine, budget or grid it cannot plan.
/// @code
///   pipeoffload::TransformerSpec model{.layers = 78, .hidden = 10240, .heads = 80, .query_groups = 8,
///                                      .seq = 4096, .micro_batch = 1, .global_batch = 256};
///   pipeoffload::MachineSpec gpus{.ranks = 32, .device_bytes = 80 * pipeoffload::gib};
///   const pipeoffload::PlanResult r = pipeoffload::plan(model, gpus, {});
///   // r.choice.name, r.choice.chunks, r.choice.offload_chunks: run it with the plan tool or train_gpt
///   // 4 replicas of 8 ranks, ZeRO-1, 50 GB/s for the all-reduce:
///   const pipeoffload::PlanResult g = pipeoffload::plan(model, {.ranks = 8}, {}, {.dp = 4, .zero = 1,
///                                                       .allreduce_bytes_per_s = 50e9});
/// @endcode
constexpr PlanResult plan(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud = {},
                          const GridSpec& grid = {}) {
  check_model(m);
  MachineSpec checked = x;
  if (grid.dp == 0) checked.ranks = 1;  // a search chooses the ranks
  check_machine(checked);
  if (bud.parameter_bytes != 2 && bud.parameter_bytes != 4)
    throw shape_error("budget: working parameter bytes must be 2 (bfloat16) or 4 (fp32), got " +
                      detail::num(bud.parameter_bytes));
  detail::require_range("budget: optimizer state buffers per parameter", bud.optimizer_states, 0, 2);
  if (bud.reduce_bucket < 1 || bud.reduce_bucket > (std::size_t{1} << 40))
    throw shape_error("budget: reduction bucket must be in [1, 2^40] values, got " +
                      detail::num(static_cast<long long>(bud.reduce_bucket)));
  detail::require_real("budget: reserved bytes (>= 0)", bud.reserved_bytes, 0, 1e18);
  detail::require_real("budget: workspace bytes (>= 0)", bud.workspace_bytes, 0, 1e18);
  detail::require_real("budget: pinned staging bytes (>= 0)", bud.staging_bytes, 0, 1e18);
  if (!bud.schedule.empty()) {
    if (find_schedule(bud.schedule) == nullptr)
      throw shape_error("budget: schedule must be empty or one of " + schedule_names() + ", got '" + bud.schedule +
                        "'");
  }
  detail::require_range("budget: max chunks (0 = no limit)", bud.max_chunks, 0, max_chunks);
  if (bud.backend == PlanBackend::cpu &&
      (!m.vocab_stages ||
       (!m.swiglu && (m.query_groups != m.heads || (m.ffn_hidden != 0 && m.ffn_hidden != 4 * m.hidden)))))
    throw shape_error(
        "budget: backend cpu counts train_gpt's CPU models, a GPT (multi-head attention, a 4h GeLU MLP) or a "
        "Llama (swiglu), whose first and last stages hold the embedding and the head; this model has other layers");
  check_grid(m, x, grid);
  // (No ?: between the two calls: GCC 12 destroys a class temporary of a ?: twice in constant
  // evaluation.)
  if (grid.dp == 0) return detail::plan_search(m, x, bud, grid);
  return detail::plan_grid(m, x, bud, grid);
}

}  // namespace pipeoffload
