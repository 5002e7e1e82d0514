// pipeoffload/plan/plan.hpp: from a model and a machine to the fastest schedule that fits.
//
// po::plan(model, machine, budget) lays the model out over v*d stages (plan/model.hpp), turns
// each stage's FLOPs and saved bytes into per-stage costs (seconds) and unit sizes (bytes),
// builds and simulates every candidate schedule with the same build()/simulate() the plan tool
// and the runtime use, adds model state and workspace to each rank's simulated activation
// peak, and picks, among the candidates that fit in device and host memory, the one with the
// shortest simulated iteration. The candidate set does not depend on the memory sizes, so more
// memory can only add candidates that fit: the choice never gets slower.
//
// Candidates (m = global batch / microbatch size, v from 1 to layer slots / d):
//   1F1B (v = 1); 1F1B-I (v >= 2, m a multiple of d); GIS(g) for every g in [ceil(d/2), d]
//   and every v (g = d is GIS, g = ceil(d/2) GIS-H); PO with 0..v chunks offloaded for every v
//   (ceil(v/2) is PO-H, v is PO-F).
// Per rank: device bytes = model state (bytes_per_parameter x its parameters) + simulated peak
// of saved activations + workspace (reserved bytes, two P2P activation buffers each way, and
// the largest transient of one pass on the rank: plan/model.hpp); host bytes = the most
// offloaded units resident at once (from the start of an offload to the end of its reload),
// each rounded up to its pinned bins.
// Costs: T_F, T_B, T_W of a stage = its FLOPs / Bc; a copy of a unit takes k x its stage's
// (T_F+T_B+T_W) / 2, exact (its bytes / Bo) for stages of whole layers; P2P time is left out
// (the same few hops in every schedule).
//
// constexpr: a small model plans in a constant expression (tests/plan/test_plan.cpp).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "../policy/spec.hpp"
#include "../schedule/build.hpp"
#include "../sim/simulate.hpp"
#include "model.hpp"

namespace pipeoffload {

/// One schedule the planner built and simulated.
struct PlanCandidate {
  ScheduleSpec spec{};
  std::string name;        ///< the plan tool's --schedule name: 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f
  int chunks = 1;          ///< v
  int group = 0;           ///< g of GIS(g) (1 for PO, 0 for 1F1B and 1F1B-I)
  int offload_chunks = 0;  ///< chunks 0..n-1 offloaded
  double iteration_time_s = 0;
  double bubble_fraction = 0;             ///< idle time / makespan, averaged over ranks
  std::vector<double> activation_bytes;   ///< per rank: simulated peak of saved activations on the device
  std::vector<double> peak_device_bytes;  ///< per rank: model state + activations + workspace
  std::vector<double> host_bytes;         ///< per rank: pinned host memory for offloaded units
  bool fits = false;
  double shortfall_bytes = 0;  ///< 0 if it fits; else the largest excess over device or host memory
  int shortfall_rank = -1;     ///< the rank with that excess
  bool shortfall_on_host = false;

  constexpr double max_device_bytes() const {
    double x = 0;
    for (double b : peak_device_bytes) x = std::max(x, b);
    return x;
  }
};

/// What plan() returns: the choice (the closest candidate when nothing fits) and how it came.
struct PlanResult {
  bool fits = false;
  PlanCandidate choice;
  int microbatches = 0;
  double k = 0;                           ///< round-trip copy / compute of one layer
  double activation_bytes_per_layer = 0;  ///< saved bytes of one layer per microbatch
  std::vector<int> layers_per_stage;      ///< of the choice's v*d stages (embedding and LM head not counted)
  std::vector<double> model_state_bytes;  ///< per rank, of the choice's layout
  std::vector<double> workspace_bytes;    ///< per rank, of the choice's layout
  std::vector<PlanCandidate> candidates;  ///< every candidate simulated, in search order
  std::string why;                        ///< one sentence: why this choice
};

namespace detail {

/// Per-stage costs, unit sizes and per-rank fixed memory of one v.
struct Layout {
  int v = 1;
  std::vector<StageContent> stages;
  Costs costs;
  std::vector<double> model_state, workspace;  ///< per rank
};

constexpr Layout make_layout(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud, int v) {
  const int d = x.ranks, S = v * d;
  Layout L;
  L.v = v;
  L.stages = stage_layout(m, S);
  L.costs.k = copy_ratio(m, x);
  L.costs.stagger_pairs = x.pairs_share_switch;
  L.model_state.assign(static_cast<std::size_t>(d), 0.0);
  L.workspace.assign(static_cast<std::size_t>(d), 0.0);
  std::vector<double> transient(static_cast<std::size_t>(d), 0.0);
  for (int s = 0; s < S; ++s) {
    const StageContent& c = L.stages[static_cast<std::size_t>(s)];
    const PassFlops fl = stage_flops(m, c);
    L.costs.stage_f.push_back(fl.f / x.flops);
    L.costs.stage_b.push_back(fl.b / x.flops);
    L.costs.stage_w.push_back(fl.w / x.flops);
    L.costs.unit_bytes.push_back(stage_activation_bytes(m, c));
    const auto r = static_cast<std::size_t>(s % d);
    L.model_state[r] += bud.bytes_per_parameter * stage_parameters(m, c);
    transient[r] = std::max(transient[r], stage_transient_bytes(m, c));
  }
  // Two P2P buffers each way (activation in/out, gradient in/out), b*s*h elements each.
  const double p2p = 4.0 * bsh(m) * m.dtype_bytes;
  for (int r = 0; r < d; ++r)
    L.workspace[static_cast<std::size_t>(r)] = bud.reserved_bytes + p2p + transient[static_cast<std::size_t>(r)];
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

constexpr std::string fmt_gib(double bytes) {
  // Two decimals without <cstdio> (constexpr).
  const long long centi = static_cast<long long>(bytes / gib * 100 + 0.5);
  std::string frac = num(centi % 100);
  if (frac.size() < 2) frac = "0" + frac;
  return num(centi / 100) + "." + frac + " GiB";
}

constexpr std::string describe(const PlanCandidate& c) {
  std::string s = c.name + " (v=" + num(c.chunks);
  if (c.name == "gis-g") s += ", g=" + num(c.group);
  if (c.offload_chunks > 0 && c.name == "po") s += ", offload " + num(c.offload_chunks);
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
  ScheduleSpec spec;
  std::string name;
  int group = 0;
  int offload_chunks = 0;
};

constexpr std::vector<PlanOption> plan_options(int d, int v, int m, bool allow_offload) {
  using GK = GroupSpec::Kind;
  std::vector<PlanOption> out;
  if (v == 1) out.push_back({{Family::one_f1b, {}, offload::none}, "1f1b", 0, 0});
  if (v >= 2 && m % d == 0) out.push_back({{Family::interleaved_1f1b, {}, offload::none}, "1f1b-i", 0, 0});
  const int lo = (d + 1) / 2;
  for (int g = d; g >= lo; --g) {
    if (g == 1 && d == 2) continue;  // GIS(1) on two ranks is PO's order: PO below covers it
    if (g == d)
      out.push_back({{Family::grouped, {GK::full, 0}, offload::none}, "gis", g, 0});
    else if (g == lo)
      out.push_back({{Family::grouped, {GK::half, 0}, offload::none}, "gis-h", g, 0});
    else
      out.push_back({{Family::grouped, {GK::number, g}, offload::none}, "gis-g", g, 0});
  }
  const int half = (v + 1) / 2;
  for (int n = 0; n <= (allow_offload ? v : 0); ++n) {
    if (n == 0)
      out.push_back({{Family::grouped, {GK::uniform, 1}, offload::none}, "po", 1, 0});
    else if (n == v)
      out.push_back({{Family::grouped, {GK::uniform, 1}, offload::all}, "po-f", 1, n});
    else if (n == half)
      out.push_back({{Family::grouped, {GK::uniform, 1}, offload::half}, "po-h", 1, n});
    else
      out.push_back({{Family::grouped, {GK::uniform, 1}, offload::first(n)}, "po", 1, n});
  }
  return out;
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
  const int d = x.ranks, mb = m.global_batch / m.micro_batch;
  build_into(p, o.spec, {d, L.v, mb}, L.costs);
  simulate_into(sim, p);
  PlanCandidate c;
  c.spec = o.spec;
  c.name = o.name;
  c.chunks = L.v;
  c.group = p.group;
  c.offload_chunks = o.offload_chunks;
  c.iteration_time_s = sim.makespan;
  c.bubble_fraction = sim.bubble_fraction();
  c.fits = true;
  for (int r = 0; r < d; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const double act = sim.ranks[ur].peak;
    const double dev = L.model_state[ur] + act + L.workspace[ur];
    const double host = detail::host_peak(p, sim.ranks[ur], r);
    c.activation_bytes.push_back(act);
    c.peak_device_bytes.push_back(dev);
    c.host_bytes.push_back(host);
    const double over_dev = dev - x.device_bytes, over_host = host - x.host_bytes;
    const double over = std::max(over_dev, over_host);
    if (over > 0) c.fits = false;
    if (over > c.shortfall_bytes) {
      c.shortfall_bytes = over;
      c.shortfall_rank = r;
      c.shortfall_on_host = over_host > over_dev;
    }
  }
  return c;
}

/// Builds, simulates and measures one candidate on a layout.
constexpr PlanCandidate evaluate(const PlanOption& o, const detail::Layout& L, const TransformerSpec& m,
                                 const MachineSpec& x) {
  Program p;
  SimResult sim;
  return evaluate(o, L, m, x, p, sim);
}

/// The fastest schedule whose every rank fits in device and host memory (header comment).
/// Throws shape_error, with a sentence, for a model, machine or budget it cannot plan.
/// @code
///   pipeoffload::TransformerSpec model{.layers = 78, .hidden = 10240, .heads = 80, .query_groups = 8,
///                                      .seq = 4096, .micro_batch = 1, .global_batch = 256};
///   pipeoffload::MachineSpec gpus{.ranks = 32, .device_bytes = 80 * pipeoffload::gib};
///   const pipeoffload::PlanResult r = pipeoffload::plan(model, gpus, {});
///   // r.choice.name, r.choice.chunks, r.choice.offload_chunks: run it with the plan tool or train_gpt
/// @endcode
constexpr PlanResult plan(const TransformerSpec& m, const MachineSpec& x, const PlanBudget& bud = {}) {
  using detail::num;
  check_model(m);
  check_machine(x);
  detail::require_real("budget: bytes per parameter (>= 0)", bud.bytes_per_parameter, 0, 1e6);
  detail::require_real("budget: reserved bytes (>= 0)", bud.reserved_bytes, 0, 1e18);
  detail::require_range("budget: max chunks (0 = no limit)", bud.max_chunks, 0, max_chunks);
  const int d = x.ranks, mb = m.global_batch / m.micro_batch;
  const int slots = layer_slots(m);
  if (d > slots)
    throw shape_error("plan: " + num(d) + " ranks but only " + num(slots) + " layer slots (" + num(m.layers) +
                      " layers" + (m.vocab_stages ? " + embedding + LM head" : "") +
                      "); every rank needs at least one");
  if (static_cast<long long>(d) * mb > max_plan_units)
    throw shape_error("plan: ranks x microbatches = " + num(static_cast<long long>(d) * mb) +
                      " is too large to simulate; at most " + num(max_plan_units));
  int vmax = std::min(slots / d, bud.max_chunks > 0 ? bud.max_chunks : 64);
  vmax = static_cast<int>(std::min<long long>(vmax, max_plan_units / (static_cast<long long>(d) * mb)));
  long long work = 0;
  for (int v = 1; v <= vmax; ++v)
    work += static_cast<long long>(plan_options(d, v, mb, bud.allow_offload).size()) * d * v * mb;
  if (work > max_plan_work)
    throw shape_error("plan: the search would simulate " + num(work) +
                      " stage-microbatch pairs over all candidates, more than " + num(max_plan_work) +
                      "; use fewer ranks or microbatches, or cap the chunks per rank (budget.max_chunks)");

  PlanResult res;
  res.microbatches = mb;
  res.k = copy_ratio(m, x);
  res.activation_bytes_per_layer = activation_bytes_per_layer(m);
  std::vector<detail::Layout> layouts;
  Program program;  // reused by every candidate
  SimResult sim;
  for (int v = 1; v <= vmax; ++v) {
    layouts.push_back(detail::make_layout(m, x, bud, v));
    for (const PlanOption& o : plan_options(d, v, mb, bud.allow_offload)) {
      try {
        res.candidates.push_back(evaluate(o, layouts.back(), m, x, program, sim));
      } catch (const shape_error&) {
        // A copy-slot grid too fine for build() (k tiny against the run): that offload
        // candidate is not planned; its no-offload siblings are.
      }
    }
  }
  if (res.candidates.empty())
    throw shape_error("plan: no candidate schedule could be built for this model and machine");

  const PlanCandidate* best = nullptr;
  const PlanCandidate* nearest = nullptr;
  for (const PlanCandidate& c : res.candidates) {
    if (c.fits && (!best || detail::faster(c, *best))) best = &c;
    if (!nearest || detail::closer(c, *nearest)) nearest = &c;
  }
  res.fits = best != nullptr;
  res.choice = best ? *best : *nearest;
  const detail::Layout& L = layouts[static_cast<std::size_t>(res.choice.chunks - 1)];
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
  return res;
}

}  // namespace pipeoffload
