// po::plan: per-layer bytes and FLOPs, stage layout, the choice and its guarantees.
#include <doctest/doctest.h>

#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/plan/plan.hpp>
#include <pipeoffload/plan/presets.hpp>
#include <pipeoffload/plan/report.hpp>
#include <pipeoffload/runtime/reserve.hpp>

#include <cmath>
#include <set>
#include <string>
#include <tuple>

using namespace pipeoffload;

namespace {

TransformerSpec model(int layers, int h, int heads, int groups, int s, int b, bool recompute) {
  TransformerSpec m;
  m.layers = layers;
  m.hidden = h;
  m.heads = heads;
  m.query_groups = groups;
  m.seq = s;
  m.micro_batch = b;
  m.recompute = recompute;
  return m;
}

/// A small model that plans in milliseconds: 14 layers, h = 1024, 8 ranks, m = 16.
TransformerSpec small() {
  TransformerSpec m = model(14, 1024, 16, 4, 2048, 1, true);
  m.global_batch = 16;
  m.vocab = 32000;
  return m;
}

MachineSpec small_machine(double device_gib) {
  MachineSpec x;
  x.ranks = 8;
  x.device_bytes = device_gib * gib;
  x.host_bytes = 64 * gib;
  x.flops = 220e12;
  x.pcie_bytes_per_s = 15e9;
  return x;
}

/// A model and machine small enough to plan in a constant expression.
constexpr TransformerSpec tiny_model(int global_batch) {
  TransformerSpec m;
  m.layers = 6;
  m.hidden = 256;
  m.heads = 4;
  m.query_groups = 4;
  m.seq = 256;
  m.global_batch = global_batch;
  m.vocab = 1000;
  return m;
}
constexpr MachineSpec tiny_machine() {
  MachineSpec x;
  x.ranks = 2;
  x.device_bytes = 2 * gib;  // 1 GiB of it is the default reserve
  return x;
}

constexpr bool tiny_plan_fits() {
  const PlanResult r = plan(tiny_model(4), tiny_machine());
  return r.fits && r.choice.chunks >= 1 && r.microbatches == 4;
}

}  // namespace

// Multi-head attention: the paper's 34bsh, and 20bsh with LayerNorm/GeLU/dropout recomputed.
TEST_CASE("multi-head attention saves exactly 34bsh bytes per layer, 20bsh with recompute") {
  for (auto [h, a, s, b] :
       {std::tuple{4096, 32, 4096, 1}, {5120, 40, 2048, 2}, {10240, 80, 32768, 1}, {768, 12, 1024, 8}}) {
    const double bsh_ = static_cast<double>(b) * s * h;
    CHECK(activation_bytes_per_layer(model(32, h, a, a, s, b, false)) == 34 * bsh_);
    CHECK(activation_bytes_per_layer(model(32, h, a, a, s, b, true)) == 20 * bsh_);
  }
}

// Grouped-query attention shrinks only K and V (4bsh) by G/a: (30 + 4G/a)bsh and (16 + 4G/a)bsh.
TEST_CASE("grouped-query attention saves (30 + 4G/a)bsh, (16 + 4G/a)bsh with recompute") {
  const double bsh_ = 4096.0 * 4096;
  CHECK(activation_bytes_per_layer(model(32, 4096, 32, 8, 4096, 1, false)) ==
        31 * bsh_);  // the paper's 5.8B: G/a = 1/4
  CHECK(activation_bytes_per_layer(model(32, 4096, 32, 8, 4096, 1, true)) == 17 * bsh_);
  CHECK(activation_bytes_per_layer(model(32, 4096, 32, 1, 4096, 1, true)) == 16.125 * bsh_);  // multi-query
  const double big = 10240.0 * 4096;
  CHECK(activation_bytes_per_layer(model(78, 10240, 80, 8, 4096, 1, true)) ==
        doctest::Approx(16.4 * big).epsilon(1e-15));
  for (int g : {1, 2, 4, 8, 16})
    CHECK(activation_bytes_per_layer(model(8, 4096, 32, g, 4096, 1, true)) <
          activation_bytes_per_layer(model(8, 4096, 32, 32, 4096, 1, true)));
}

TEST_CASE("a layer's F+B+W is 12bsh(6h+s) FLOPs with multi-head attention, and fewer with GQA") {
  const TransformerSpec m = model(32, 4096, 32, 32, 4096, 2, true);
  const double b = 2, s = 4096, h = 4096;
  CHECK(layer_flops(m).total() == 12 * b * s * h * (6 * h + s));
  CHECK(layer_flops(m).w < layer_flops(m).f);  // no weights in the attention core
  CHECK(layer_flops(m).f < layer_flops(m).b);  // its backward is twice its forward
  CHECK(layer_flops(model(32, 4096, 32, 8, 4096, 2, true)).total() < layer_flops(m).total());
}

TEST_CASE("k equals the paper's 10/(3(6h+s)) * Bc/Bo for multi-head attention with recompute") {
  MachineSpec x;
  x.flops = 220e12;
  x.pcie_bytes_per_s = 15e9;
  for (auto [h, s] : {std::pair{4096, 4096}, {8192, 4096}, {4096, 16384}, {2048, 1024}}) {
    const double paper = 10.0 / (3.0 * (6.0 * h + s)) * 220e12 / 15e9;
    CHECK(copy_ratio(model(8, h, 32, 32, s, 1, true), x) == doctest::Approx(paper).epsilon(1e-12));
    // Without recompute the saved bytes, and so k, are 34/20 times larger.
    CHECK(copy_ratio(model(8, h, 32, 32, s, 1, false), x) == doctest::Approx(paper * 34 / 20).epsilon(1e-12));
  }
}

TEST_CASE("parameter counts match the paper's model names (5.8B, 42.9B, 83.8B with G = 8)") {
  const auto total = [](TransformerSpec m) {
    double p = 0;
    for (const StageContent& c : stage_layout(m, 1)) p += stage_parameters(m, c);
    return p - static_cast<double>(m.vocab) * m.hidden;  // count the tied LM head once
  };
  TransformerSpec m = model(32, 4096, 32, 8, 4096, 1, true);
  CHECK(total(m) / 1e9 == doctest::Approx(5.8).epsilon(0.02));
  m = model(62, 8192, 64, 8, 4096, 1, true);
  CHECK(total(m) / 1e9 == doctest::Approx(42.9).epsilon(0.02));
  m = model(78, 10240, 80, 8, 4096, 1, true);
  CHECK(total(m) / 1e9 == doctest::Approx(83.8).epsilon(0.02));
}

TEST_CASE("stage layout: the embedding and LM head take one layer slot each, the remainder goes to the last stages") {
  TransformerSpec m = model(78, 10240, 80, 8, 4096, 1, true);  // 80 slots
  const auto st = stage_layout(m, 64);
  int sum = 0;
  for (const auto& c : st) sum += c.layers;
  CHECK(sum == 78);
  CHECK(st[0].embedding);
  CHECK(st[0].layers == 0);
  CHECK(st[63].head);
  CHECK(st[63].layers == 1);
  for (int s = 1; s < 48; ++s) CHECK(st[static_cast<std::size_t>(s)].layers == 1);
  for (int s = 48; s < 63; ++s) CHECK(st[static_cast<std::size_t>(s)].layers == 2);
  // Even split without the vocabulary stages; too many stages is an error with a sentence.
  m.vocab_stages = false;
  for (const auto& c : stage_layout(m, 78)) CHECK((c.layers == 1 && !c.embedding && !c.head));
  CHECK_THROWS_AS(stage_layout(m, 79), shape_error);
  CHECK(stage_layout(model(1, 64, 1, 1, 8, 1, true), 1)[0].layers == 1);
}

TEST_CASE("per-stage costs and unit sizes follow each stage's layers, embedding and LM head") {
  const TransformerSpec m = small();  // 16 slots on 8 ranks: v = 2 gives 1 slot per stage
  const MachineSpec x = small_machine(80);
  const detail::Layout L = detail::make_layout(m, x, {}, 2);
  // A layer's tensors and its fp32 statistics (two LayerNorms' mean and rstd, a log-sum-exp a head).
  const double T = 2048, layer_f = layer_flops(m).f / x.flops,
               a = activation_bytes_per_layer(m) + 4 * T * (4 + m.heads);
  for (int s = 1; s < 15; ++s) {
    CHECK(L.costs.stage_f[static_cast<std::size_t>(s)] == doctest::Approx(layer_f).epsilon(1e-12));
    CHECK(L.costs.unit_bytes[static_cast<std::size_t>(s)] == a);
  }
  CHECK(L.costs.stage_f[0] == doctest::Approx(0.01 * layer_f).epsilon(1e-12));  // embedding only
  CHECK(L.costs.unit_bytes[0] == 0);  // the token ids are the step's input, not the unit's
  CHECK(L.costs.stage_f[15] == doctest::Approx(head_flops(m).f / x.flops).epsilon(1e-12));
  CHECK(L.costs.unit_bytes[15] == 2 * T * 1024 + 8 * T + 2 * T * 32000);  // input, norm statistics, bf16 dlogits
  // Uneven: 3 stages per rank (24 stages for 16 slots) is refused; v = 1 puts 2 slots per stage.
  const detail::Layout L1 = detail::make_layout(m, x, {}, 1);
  CHECK(L1.costs.unit_bytes[3] == 2 * a);
}

TEST_CASE("host bins: the smallest sum of at most three powers of two that holds the unit") {
  CHECK(host_bin_bytes(0) == 0);
  CHECK(host_bin_bytes(1) == 1);
  CHECK(host_bin_bytes(7) == 7);
  CHECK(host_bin_bytes(11) == 11);
  CHECK(host_bin_bytes(15) == 16);
  CHECK(host_bin_bytes(23) == 24);
  CHECK(host_bin_bytes(1000.5) == 1024);  // rounded up to 1001 = 512 + 256 + 233: 512 + 256 + 256
  CHECK(host_bin_bytes(1000) == 1024);    // 512 + 256 + 232: the third bin rounds 232 up to 256
  CHECK(host_bin_bytes(896) == 896);      // 512 + 256 + 128 exactly
  for (double x = 1; x < 5000; x += 37) {
    CHECK(host_bin_bytes(x) >= x);
    CHECK(host_bin_bytes(x) * 3 < x * 4 + 3);  // the third bin wastes less than a third of the whole
  }
}

TEST_CASE(
    "plan searches 1F1B, 1F1B-I, every legal GIS(g), PO with 0..v offloaded chunks and the zero-bubble families") {
  const TransformerSpec m = small();
  const PlanResult r = plan(m, small_machine(80));
  std::set<std::tuple<std::string, int, int, int>> seen;
  std::set<std::tuple<std::string, int, int, int, StageCut>> cuts;
  for (const PlanCandidate& c : r.candidates) {
    seen.insert({c.name, c.chunks, c.group, c.offload_chunks});
    cuts.insert({c.name, c.chunks, c.group, c.offload_chunks, c.cut});
  }
  CHECK(cuts.size() == r.candidates.size());
  CHECK(seen.count({"1f1b", 1, 0, 0}) == 1);
  CHECK(seen.count({"1f1b-i", 2, 0, 0}) == 1);
  for (int v = 1; v <= 2; ++v) {
    CHECK(seen.count({"gis", v, 8, 0}) == 1);
    CHECK(seen.count({"gis-h", v, 4, 0}) == 1);
    for (int g = 5; g <= 7; ++g) CHECK(seen.count({"gis-g", v, g, 0}) == 1);
    CHECK(seen.count({"po", v, 1, 0}) == 1);
    CHECK(seen.count({"po-f", v, 1, v}) == 1);
  }
  CHECK(seen.count({"po-h", 2, 1, 1}) == 1);
  // The zero-bubble families, plain and with every chunk offloaded.
  for (const char* n : {"zb-h1", "zb-h2"}) {
    CHECK(seen.count({n, 1, 0, 0}) == 1);
    CHECK(seen.count({n, 1, 0, 1}) == 1);
  }
  for (const char* n : {"zb-v", "v-half", "v-min", "dualpipe-v"}) {  // dualpipe-v: m = 16 >= 2d
    CHECK(seen.count({n, 2, 0, 0}) == 1);
    CHECK(seen.count({n, 2, 0, 2}) == 1);
  }
  CHECK(seen.size() == 1 + 1 + 2 * 5 + 2 + 3 + 2 * 2 + 4 * 2);  // no v = 3: 16 slots over 24 stages
  // v = 1 (8 stages of 14 layers) is searched on the slot cut and the even one; v = 2 (16
  // stages) has no even cut (a stage would hold no layer).
  const long long v1 =
      std::count_if(r.candidates.begin(), r.candidates.end(), [](const PlanCandidate& c) { return c.chunks == 1; });
  CHECK(static_cast<std::size_t>(v1) == 2 * (1 + 5 + 2 + 2 * 2));
  CHECK(r.candidates.size() == seen.size() + static_cast<std::size_t>(v1) / 2);
  for (const PlanCandidate& c : r.candidates) CHECK((c.cut == StageCut::slots || c.chunks == 1));
}

TEST_CASE("stage cuts: the slot cut gives the embedding and the head a layer's place, the even cut adds them") {
  const TransformerSpec m = small();  // 14 layers
  const std::vector<StageContent> slots = stage_layout(m, 8), even = even_layout(m, 8);
  std::vector<int> a, b;
  for (const StageContent& c : slots) a.push_back(c.layers);
  for (const StageContent& c : even) b.push_back(c.layers);
  CHECK(a == std::vector<int>{1, 2, 2, 2, 2, 2, 2, 1});  // 16 slots
  CHECK(b == std::vector<int>{1, 2, 2, 2, 1, 2, 2, 2});  // floor(14 (s+1) / 8) - floor(14 s / 8)
  CHECK((even.front().embedding && even.back().head && !even[3].embedding && !even[3].head));
  CHECK(distinct_cut(m, 8, StageCut::even));
  CHECK(!distinct_cut(m, 16, StageCut::even));  // 16 stages of 14 layers: not searched
  CHECK_THROWS_WITH_AS(even_layout(m, 15), "even stage layout: 15 stages for 14 layers; at most one stage a layer",
                       shape_error);
  // The planner reports the cut of its choice, which train_gpt's --stage-blocks follows.
  const PlanResult r = plan(m, small_machine(80));
  std::vector<int> want;
  for (const StageContent& c : cut_layout(m, r.choice.chunks * 8, r.choice.cut)) want.push_back(c.layers);
  CHECK(r.layers_per_stage == want);
}

TEST_CASE(
    "every candidate's estimate is model state + simulated activations + workspace; a lowered one's is its memory plan") {
  const PlanResult r = plan(small(), small_machine(80));
  const TransformerSpec m = small();
  for (const PlanCandidate& c : r.candidates) {
    const detail::Layout L = detail::make_layout(m, small_machine(80), {}, c.chunks, {}, c.spec.placement, c.cut);
    const SimResult sim = simulate(build(c.spec, {8, c.chunks, 16}, L.costs));
    CHECK(sim.makespan == c.iteration_time_s);
    CHECK(sim.bubble_fraction() == c.bubble_fraction);
    for (int i = 0; i < 8; ++i) {
      const auto u = static_cast<std::size_t>(i);
      CHECK(c.activation_bytes[u] == sim.ranks[u].peak);
      CHECK(c.stash_bytes[u] == sim.ranks[u].stash_peak);
      CHECK(c.stash_bytes[u] >= stage_stash_bytes(m, L.stages[u]));  // at least one B's (or BW's)
      if (c.lowered) {
        // The region the runtime would reserve for this rank (po::reservation_plan's device).
        const Program p = build(c.spec, {8, c.chunks, 16}, L.costs);
        const std::vector<StageBytes> bytes = detail::stage_buffers(L);
        const double region = static_cast<double>(reservation_plan(p, i, bytes).device);
        CHECK(c.buffer_bytes[u] == region);
        CHECK(c.buffer_bytes[u] >= sim.ranks[u].peak);
        CHECK(c.peak_device_bytes[u] ==
              L.model_state[u] + c.runtime_bytes[u] + region + L.scratch[u] + L.libraries + L.reserve);
      } else {
        CHECK(c.peak_device_bytes[u] == L.model_state[u] + sim.ranks[u].peak + L.workspace[u]);
      }
      if (c.offload_chunks == 0) CHECK(c.host_bytes[u] == L.staging);  // backend::Cuda's pinned staging only
    }
  }
  CHECK(r.choice.lowered);
}

TEST_CASE("the choice fits on every rank and is the fastest candidate that fits") {
  const MachineSpec x = small_machine(8);
  const PlanResult r = plan(small(), x);
  REQUIRE(r.fits);
  for (std::size_t i = 0; i < 8; ++i) {
    CHECK(r.choice.peak_device_bytes[i] <= x.device_bytes);
    CHECK(r.choice.host_bytes[i] <= x.host_bytes);
  }
  for (const PlanCandidate& c : r.candidates)
    if (c.fits) CHECK(c.iteration_time_s >= r.choice.iteration_time_s);
  CHECK(r.why.find("fastest of the") == 0);
}

TEST_CASE("more device memory never gives a slower plan (sweep 0.5..60 GiB, two models)") {
  for (bool recompute : {false, true}) {
    TransformerSpec m = small();
    m.recompute = recompute;
    double prev = 1e300;
    bool prev_fits = false;
    int fitting = 0;
    for (double g = 0.5; g <= 60; g *= 1.15) {
      const PlanResult r = plan(m, small_machine(g));
      CHECK((r.fits || !prev_fits));  // once something fits, it keeps fitting
      if (r.fits) {
        ++fitting;
        CHECK(r.choice.iteration_time_s <= prev);
        prev = r.choice.iteration_time_s;
      }
      prev_fits = r.fits;
    }
    CHECK(fitting > 5);
    CHECK(prev_fits);
  }
}

TEST_CASE("nothing fits: the closest plan is reported with its shortfall") {
  const MachineSpec x = small_machine(0.05);
  const PlanResult r = plan(small(), x);
  CHECK_FALSE(r.fits);
  CHECK_FALSE(r.choice.fits);
  CHECK(r.choice.shortfall_bytes > 0);
  const double over = r.choice.peak_device_bytes[static_cast<std::size_t>(r.choice.shortfall_rank)] - x.device_bytes;
  CHECK(r.choice.shortfall_bytes == over);
  for (const PlanCandidate& c : r.candidates) CHECK(c.shortfall_bytes >= r.choice.shortfall_bytes);
  CHECK(r.why.find("nothing fits") == 0);
  CHECK(r.why.find(detail::fmt_gib(over)) != std::string::npos);
}

TEST_CASE("host memory counts: offload candidates need host bytes, and too little host memory rules them out") {
  MachineSpec x = small_machine(80);
  PlanResult r = plan(small(), x);
  bool some = false;
  for (const PlanCandidate& c : r.candidates)
    if (c.name == "po-f") {
      double total = 0;
      for (double h : c.host_bytes) total += h;
      some = some || total > 0;
    }
  CHECK(some);
  // Every CUDA rank pins backend::Cuda's staging (po::cuda_staging_bytes); with only that much
  // host memory nothing that offloads fits.
  const double staging = static_cast<double>(cuda_staging_bytes());
  CHECK(staging == ((4 * 4096 + 1) * 8 + 255) / 256 * 256 + 8 * 1024 * 1024);
  x.host_bytes = staging;
  r = plan(small(), x);
  int ruled_out = 0;
  for (const PlanCandidate& c : r.candidates) {
    double most = 0;
    for (double h : c.host_bytes) most = std::max(most, h);
    CHECK(most >= staging);
    if (c.fits) CHECK(most == staging);
    if (most > staging) {
      CHECK(c.shortfall_on_host);
      ++ruled_out;
    }
  }
  CHECK(ruled_out > 0);
  // Less than the staging: nothing fits.
  x.host_bytes = staging - 1;
  CHECK_FALSE(plan(small(), x).fits);
  CHECK(plan(small(), x).why.find("more host memory") != std::string::npos);
}

TEST_CASE("bad models, machines and budgets throw shape_error with a sentence") {
  const MachineSpec x = small_machine(80);
  TransformerSpec m = small();
  m.layers = 0;
  CHECK_THROWS_AS(plan(m, x), shape_error);
  m = small();
  m.query_groups = 3;  // 16 heads
  CHECK_THROWS_WITH_AS(plan(m, x), doctest::Contains("query groups"), shape_error);
  m = small();
  m.micro_batch = 2;
  m.global_batch = 15;
  CHECK_THROWS_WITH_AS(plan(m, x), doctest::Contains("global batch"), shape_error);
  MachineSpec y = x;
  y.pcie_bytes_per_s = 0;
  CHECK_THROWS_WITH_AS(plan(small(), y), doctest::Contains("needs a bandwidth"), shape_error);
  y = x;
  y.device_bytes = -1;
  CHECK_THROWS_WITH_AS(plan(small(), y),
                       "machine: device memory (bytes, > 0) = -1 is outside the allowed range [1, 1e+18]", shape_error);
  y = x;
  y.flops = std::nan("");
  CHECK_THROWS_WITH_AS(plan(small(), y), "machine: achieved FLOP/s (> 0) = nan is outside the allowed range [1, 1e+22]",
                       shape_error);
  y = x;
  y.host_bytes = 2.5e19;
  CHECK_THROWS_WITH_AS(plan(small(), y),
                       "machine: host memory per rank (bytes, >= 0) = 2.5e+19 is outside the allowed range [0, 1e+18]",
                       shape_error);
  y = x;
  y.ranks = 17;  // 16 layer slots
  CHECK_THROWS_WITH_AS(plan(small(), y), doctest::Contains("layer slots"), shape_error);
  PlanBudget b;
  b.parameter_bytes = 3;
  CHECK_THROWS_WITH_AS(plan(small(), x, b), doctest::Contains("must be 2 (bfloat16) or 4 (fp32), got 3"), shape_error);
  b = {};
  b.optimizer_states = 3;
  CHECK_THROWS_WITH_AS(plan(small(), x, b), doctest::Contains("optimizer state buffers"), shape_error);
  b = {};
  b.reduce_bucket = 0;
  CHECK_THROWS_WITH_AS(plan(small(), x, b), doctest::Contains("reduction bucket must be in [1, 2^40] values, got 0"),
                       shape_error);
}

TEST_CASE("plan is constexpr: a small model plans in a constant expression") {
  static_assert(tiny_plan_fits());
  CHECK(tiny_plan_fits());
}

// ---- data parallelism: dp replicas of the pipeline ----------------------------------------------

namespace {

GridSpec grid(int dp, int zero = 0, double bytes_per_s = 100e9) {
  GridSpec g;
  g.dp = dp;
  g.zero = zero;
  g.allreduce_bytes_per_s = bytes_per_s;
  return g;
}

/// 14 layers on 4 ranks, 48 sequences: dp 1, 2, 3, 4, 6, 8, ... all split the batch.
TransformerSpec small48() {
  TransformerSpec m = small();
  m.global_batch = 48;
  return m;
}

MachineSpec four_ranks(double device_gib) {
  MachineSpec x = small_machine(device_gib);
  x.ranks = 4;
  return x;
}

/// Each rank's all-reduces, the long way: repeatedly the unreduced stage whose last W ended
/// first (lower stage on ties), started when that W and the previous reduction are done.
void reference_reductions(const Program& p, const SimResult& sim, const std::vector<double>& stage_s, int r,
                          double& total, double& end) {
  std::vector<double> last(static_cast<std::size_t>(p.shape.stages()), -1.0);
  const RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
  for (std::size_t i = 0; i < rp.compute.size(); ++i)
    if (rp.compute[i].kind == OpKind::W || rp.compute[i].kind == OpKind::BW) {
      double& l = last[static_cast<std::size_t>(rp.compute[i].stage)];
      l = std::max(l, sim.ranks[static_cast<std::size_t>(r)].compute_end[i]);
    }
  total = 0;
  end = 0;
  std::vector<bool> done(last.size(), false);
  for (;;) {
    int next = -1;
    for (int s = 0; s < p.shape.stages(); ++s) {
      const auto u = static_cast<std::size_t>(s);
      if (last[u] < 0 || done[u]) continue;
      if (next < 0 || last[u] < last[static_cast<std::size_t>(next)]) next = s;
    }
    if (next < 0) break;
    const auto u = static_cast<std::size_t>(next);
    done[u] = true;
    end = std::max(end, last[u]) + stage_s[u];
    total += stage_s[u];
  }
}

}  // namespace

TEST_CASE("data parallelism: each replica runs global batch / (dp x microbatch size) microbatches") {
  const TransformerSpec m = small48();
  for (int dp : {1, 2, 3, 4, 6, 12}) {
    CAPTURE(dp);
    const PlanResult r = plan(m, four_ranks(80), {}, grid(dp));
    CHECK(r.microbatches == 48 / dp);
    CHECK(r.dp == dp);
    CHECK(r.ranks == 4);
    // The choice is the simulation of that many microbatches on one pipeline.
    const detail::Layout L =
        detail::make_layout(m, four_ranks(80), {}, r.choice.chunks, grid(dp), r.choice.spec.placement, r.choice.cut);
    const SimResult sim = simulate(build(r.choice.spec, {4, r.choice.chunks, 48 / dp}, L.costs));
    CHECK(sim.makespan == r.choice.compute_time_s);
  }
  TransformerSpec b2 = small48();
  b2.micro_batch = 2;  // 24 microbatches of 2
  CHECK(plan(b2, four_ranks(80), {}, grid(3)).microbatches == 8);
}

TEST_CASE("dp = 1 changes nothing: the same plan as without a grid, and no all-reduce") {
  const TransformerSpec m = small();
  for (double g : {1.0, 3.0, 8.0, 80.0}) {
    const PlanResult a = plan(m, small_machine(g));
    const PlanResult b = plan(m, small_machine(g), {}, grid(1, 0, 1e3));  // any bandwidth: nothing to reduce
    CHECK(a.fits == b.fits);
    CHECK(a.why == b.why);
    CHECK(a.microbatches == b.microbatches);
    CHECK(a.model_state_bytes == b.model_state_bytes);
    REQUIRE(a.candidates.size() == b.candidates.size());
    for (std::size_t i = 0; i < a.candidates.size(); ++i) {
      const PlanCandidate &x = a.candidates[i], &y = b.candidates[i];
      CHECK(x.iteration_time_s == y.iteration_time_s);
      CHECK(x.iteration_time_s == x.compute_time_s);
      CHECK(x.allreduce_exposed_s == 0);
      CHECK(x.peak_device_bytes == y.peak_device_bytes);
      CHECK(x.host_bytes == y.host_bytes);
      for (std::size_t r = 0; r < 8; ++r) CHECK((y.allreduce_s[r] == 0 && y.allreduce_end_s[r] == 0));
    }
  }
}

TEST_CASE(
    "model state per rank is po::state_bytes of its chunks: 2 + 4 + 12 bytes a parameter, the 12 sharded by ZeRO-1, 16 more on the exact path") {
  const TransformerSpec m = small48();
  const MachineSpec x = four_ranks(80);
  const PlanBudget bud;
  PlanBudget exact = bud, fp32 = bud;
  exact.gradients = Gradients::exact;
  fp32.parameter_bytes = 4;
  for (int v : {1, 2, 4}) {
    CAPTURE(v);
    const detail::Layout z0 = detail::make_layout(m, x, bud, v, grid(1)),
                         ze = detail::make_layout(m, x, exact, v, grid(1)),
                         z4 = detail::make_layout(m, x, fp32, v, grid(1));
    const auto params_of = [&](int r) {
      std::vector<std::size_t> out;
      for (int s = r; s < 4 * v; s += 4)
        out.push_back(static_cast<std::size_t>(stage_parameters(m, z0.stages[static_cast<std::size_t>(s)])));
      return out;
    };
    // The CUDA GPT's fp32 copy of the LM head's bias (V values), on the head's rank.
    const auto bias = [&](int r) { return r == 3 ? 4.0 * m.vocab : 0.0; };
    for (int r = 0; r < 4; ++r) {
      const auto u = static_cast<std::size_t>(r);
      double params = 0, padded = 0;
      for (std::size_t n : params_of(r)) {
        params += static_cast<double>(n);
        padded += static_cast<double>(gradient_layout(n, 1, bud.reduce_bucket).padded());
      }
      // Each arena block sits in a 256-byte size class: up to 255 bytes more per block (at most
      // four a chunk: the sums, two moments, the master; and four staging buffers).
      const double slack = 256.0 * (4 * v + 4);
      CHECK(std::abs(z0.model_state[u] - bias(r) - 18 * params) <
            slack);  // bf16 working 2, fp32 gradients 4, master 4, AdamW 8
      CHECK(std::abs(z0.optimizer[u] - 12 * params) < slack);
      CHECK(std::abs(ze.model_state[u] - bias(r) - (18 * params + 16 * padded)) < slack);  // and the 128-bit sums
      CHECK(padded < params + static_cast<double>(v) * static_cast<double>(bud.reduce_bucket) / 100);
      CHECK(std::abs(z4.model_state[u] - bias(r) - 16 * params) < slack);  // fp32 working parameters are the master
    }
    for (int dp : {2, 3, 4, 6}) {
      CAPTURE(dp);
      const detail::Layout z0dp = detail::make_layout(m, x, bud, v, grid(dp, 0));
      const detail::Layout z1 = detail::make_layout(m, x, bud, v, grid(dp, 1));
      for (int r = 0; r < 4; ++r) {
        const auto u = static_cast<std::size_t>(r);
        const std::vector<std::size_t> chunks = params_of(r);
        double params = 0, owned = 0, buckets = 0;
        std::size_t most = 0;
        for (std::size_t n : chunks) {
          const GradientLayout l = gradient_layout(n, dp, bud.reduce_bucket);
          params += static_cast<double>(n);
          owned += static_cast<double>(l.owned(0));  // replica 0 owns the most
          buckets += static_cast<double>(l.buckets);
          most = std::max(most, l.len);
        }
        double staging = 0;
        for (std::size_t b : reduction_staging_bytes(most, dp, Gradients::standard)) staging += static_cast<double>(b);
        const StateBytes want = state_bytes(chunks, detail::state_options(bud, grid(dp, 1)));
        double arena = 0;  // what the CUDA arena holds for the blocks: each in its 256-byte class
        for (std::size_t b : want.blocks) arena += static_cast<double>((b + 255) / 256 * 256);
        const double slack = 256.0 * (4 * v + 4);
        CHECK(z1.model_state[u] == static_cast<double>(want.parameters + want.gradients) + arena + bias(r));
        CHECK(std::abs(z0dp.model_state[u] - bias(r) - (18 * params + staging)) <
              slack);  // ZeRO-0: every replica holds everything
        CHECK(std::abs(z1.optimizer[u] - 12 * owned) < slack);
        CHECK(std::abs(z1.model_state[u] - bias(r) - (6 * params + 12 * owned + staging)) < slack);
        // 1/dp, plus less than one value per bucket for the slices' rounding.
        CHECK(owned >= params / dp);
        CHECK(owned <= params / dp + buckets);
      }
    }
  }
  // The plan reports it, and ZeRO-1 needs less device memory than ZeRO-0.
  const PlanResult p0 = plan(m, x, bud, grid(4, 0)), p1 = plan(m, x, bud, grid(4, 1));
  CHECK(p1.zero == 1);
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(p1.optimizer_bytes[r] < p0.optimizer_bytes[r] / 3);
    CHECK(p1.model_state_bytes[r] < p0.model_state_bytes[r]);
  }
}

TEST_CASE("per_rank: the choice's device bytes by kind add up to its peak, and each kind is the layout's") {
  const TransformerSpec m = small();
  for (const GridSpec g : {GridSpec{}, grid(2, 0, 1e11), grid(2, 1, 1e11)})
    for (double gib_ : {3.0, 80.0}) {
      CAPTURE(g.dp);
      CAPTURE(g.zero);
      CAPTURE(gib_);
      const PlanResult r = plan(m, small_machine(gib_), {}, g);
      const PlanCandidate& c = r.choice;
      const detail::Layout L = detail::make_layout(m, small_machine(gib_), {}, c.chunks, g, c.spec.placement, c.cut);
      REQUIRE(r.per_rank.size() == 8);
      for (std::size_t u = 0; u < 8; ++u) {
        const RankMemory& k = r.per_rank[u];
        CHECK(k.device == c.peak_device_bytes[u]);
        CHECK(k.device == k.state + k.optimizer + k.buffers + k.scratch + k.workspace + k.reserve);
        CHECK(k.host == c.host_bytes[u]);
        CHECK(k.staging == static_cast<double>(cuda_staging_bytes()));
        CHECK(k.host >= k.staging);
        CHECK(k.state + k.optimizer == L.model_state[u] + c.runtime_bytes[u]);  // and the runtime's own blocks
        CHECK(k.optimizer == L.optimizer[u]);
        CHECK(k.scratch == L.scratch[u]);
        CHECK(k.buffers == c.buffer_bytes[u]);
        CHECK(k.buffers >= k.activations);  // the region holds the simulated peak, and the tensors
        CHECK(k.buffers <= 1.05 * (k.activations + k.messages));
        CHECK(k.messages > 0);
        CHECK(k.activations == c.activation_bytes[u]);
        CHECK(k.stash == c.stash_bytes[u]);
        CHECK(k.reserve == PlanBudget{}.reserved_bytes);
        CHECK(k.workspace == PlanBudget{}.workspace_bytes);  // 256 MiB, a whole size class
        CHECK(k.scratch > 0);
      }
    }
}

TEST_CASE("ZeRO-1 lets a model fit where ZeRO-0 does not, with enough replicas") {
  const TransformerSpec m = small48();
  double lo = 0.5;
  while (!plan(m, four_ranks(lo), {}, grid(6, 1)).fits) lo *= 1.1;
  CHECK_FALSE(plan(m, four_ranks(lo), {}, grid(6, 0)).fits);
}

TEST_CASE(
    "all-reduce: the bytes a replica sends (8 (dp-1)/dp a parameter, 6 with ZeRO-1) / bandwidth per stage, serialized after each stage's last W") {
  const TransformerSpec m = small48();
  const MachineSpec x = four_ranks(80);
  for (int dp : {2, 3, 6}) {
    const detail::Layout L = detail::make_layout(m, x, {}, 2, grid(dp, 0, 50e9)),
                         Z = detail::make_layout(m, x, {}, 2, grid(dp, 1, 50e9));
    for (int s = 0; s < 8; ++s) {
      const double P = stage_parameters(m, L.stages[static_cast<std::size_t>(s)]);
      const std::size_t n[1] = {static_cast<std::size_t>(P)};
      CHECK(L.allreduce[static_cast<std::size_t>(s)] ==
            static_cast<double>(traffic_bytes(n, detail::state_options({}, grid(dp, 0)))) / 50e9);
      // Within the last bucket's padding of the formulas: fp32 reduce-scatter and all-gather of
      // the gradients; with ZeRO-1 the all-gather of the bf16 working parameters instead.
      const double pad =
          static_cast<double>(gradient_layout(n[0], dp, PlanBudget{}.reduce_bucket).padded()) / P * (1 + 1e-12);
      CHECK(L.allreduce[static_cast<std::size_t>(s)] >= static_cast<double>(dp - 1) / dp * 8 * P / 50e9);
      CHECK(L.allreduce[static_cast<std::size_t>(s)] <= static_cast<double>(dp - 1) / dp * 8 * P * pad / 50e9);
      CHECK(Z.allreduce[static_cast<std::size_t>(s)] >= static_cast<double>(dp - 1) / dp * 6 * P / 50e9);
      CHECK(Z.allreduce[static_cast<std::size_t>(s)] <= static_cast<double>(dp - 1) / dp * 6 * P * pad / 50e9);
    }
    for (const PlanOption& o : plan_options(4, 2, 48 / dp, true)) {
      CAPTURE(o.name);
      const PlanCandidate c = evaluate(o, L, m, x);
      const Program p = build(o.spec, {4, 2, 48 / dp}, L.costs);
      const SimResult sim = simulate(p);
      double latest = 0;
      for (int r = 0; r < 4; ++r) {
        double total = 0, end = 0;
        reference_reductions(p, sim, L.allreduce, r, total, end);
        CHECK(c.allreduce_s[static_cast<std::size_t>(r)] == doctest::Approx(total).epsilon(1e-12));
        CHECK(c.allreduce_end_s[static_cast<std::size_t>(r)] == doctest::Approx(end).epsilon(1e-12));
        latest = std::max(latest, end);
        CHECK(c.allreduce_hidden(r) >= 0);
        CHECK(c.allreduce_hidden(r) <= 1);
      }
      CHECK(c.compute_time_s == sim.makespan);
      CHECK(c.iteration_time_s == doctest::Approx(std::max(sim.makespan, latest)).epsilon(1e-12));
      CHECK(c.allreduce_exposed_s == doctest::Approx(c.iteration_time_s - sim.makespan).epsilon(1e-12));
    }
  }
}

TEST_CASE("all-reduce exposed is ~0 with a huge bandwidth and grows as the bandwidth shrinks") {
  const TransformerSpec m = small48();
  const MachineSpec x = four_ranks(80);
  for (const PlanOption& o : plan_options(4, 2, 24, true)) {
    CAPTURE(o.name);
    double prev = -1, prev_total = -1;
    for (double bw : {1e21, 1e13, 1e12, 1e11, 1e10, 1e9}) {
      const PlanCandidate c = evaluate(o, detail::make_layout(m, x, {}, 2, grid(2, 0, bw)), m, x);
      if (bw == 1e21) CHECK(c.allreduce_exposed_s < 1e-9 * c.compute_time_s);
      CHECK(c.allreduce_exposed_s >= prev);
      CHECK(c.allreduce_s[0] > prev_total);
      prev = c.allreduce_exposed_s;
      prev_total = c.allreduce_s[0];
    }
    CHECK(prev > 0);  // at 1 GB/s the gradients of a stage take longer than the cooldown hides
  }
  // The plan: a slower all-reduce never gives a faster plan; the last stage to finish (stage 0,
  // on rank 0) is never hidden, so its rank hides the least.
  double prev = 0;
  for (double bw : {1e21, 1e11, 1e10, 1e9, 1e8}) {
    const PlanResult r = plan(m, x, {}, grid(2, 0, bw));
    CHECK(r.choice.iteration_time_s >= prev);
    CHECK(r.choice.iteration_time_s == r.choice.compute_time_s + r.choice.allreduce_exposed_s);
    prev = r.choice.iteration_time_s;
  }
}

TEST_CASE("rank layout: global rank j*d + r, the balanced node layout, and back") {
  using NL = NodeLayout;
  // Contiguous: replica-major, PCIe pairs (r, r^1) are global pairs (g, g^1) when d is even.
  static_assert(global_rank(NL::contiguous, 4, 8, 0, 3) == 3);
  static_assert(global_rank(NL::contiguous, 4, 8, 2, 1) == 9);
  static_assert(node_of(NL::contiguous, 4, 8, 2, 1) == 1);
  static_assert(grid_rank(NL::contiguous, 4, 8, 9) == GridRank{2, 1});
  // The paper's example: d = 16, G = 8: node 0 holds pipeline ranks 0-3 and 12-15, node 1 holds 4-11.
  static_assert(node_layout_fits(NL::balanced, 16, 8));
  for (int r = 0; r < 16; ++r) {
    CAPTURE(r);
    CHECK(node_of(NL::balanced, 16, 8, 0, r) == (r < 4 || r >= 12 ? 0 : 1));
    CHECK(node_of(NL::balanced, 16, 8, 1, r) == (r < 4 || r >= 12 ? 2 : 3));
    CHECK(node_of(NL::contiguous, 16, 8, 1, r) == 2 + r / 8);
  }
  static_assert(global_rank(NL::balanced, 16, 8, 0, 12) == 4);  // block 3 in node 0's second half
  static_assert(global_rank(NL::balanced, 16, 8, 0, 4) == 8);
  static_assert(global_rank(NL::balanced, 16, 8, 0, 8) == 12);
  static_assert(grid_rank(NL::balanced, 16, 8, 20) == GridRank{1, 12});
  // Three nodes a pipeline (K = 3): node k holds blocks k and 5-k of 4 ranks.
  for (int r = 0; r < 24; ++r) {
    const int block = r / 4;
    CHECK(node_of(NL::balanced, 24, 8, 0, r) == std::min(block, 5 - block));
  }
  // Where balanced is not defined; d <= G is contiguous.
  static_assert(!node_layout_fits(NL::balanced, 12, 8));
  static_assert(!node_layout_fits(NL::balanced, 6, 3) && node_layout_fits(NL::balanced, 3, 3));
  static_assert(node_layout_fits(NL::contiguous, 12, 8));
  // Both ways, both layouts, many shapes: a permutation of the global ranks, inverted exactly,
  // each node holding G consecutive global ranks, and pairs kept when G/2 is even.
  for (NL l : {NL::contiguous, NL::balanced})
    for (int G : {1, 2, 4, 6, 8, 16})
      for (int d : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48}) {
        if (!node_layout_fits(l, d, G)) continue;
        CAPTURE(G);
        CAPTURE(d);
        const int dp = 3;
        std::set<int> seen;
        for (int j = 0; j < dp; ++j)
          for (int r = 0; r < d; ++r) {
            const int g = global_rank(l, d, G, j, r);
            CHECK(g / d == j);  // a replica's d consecutive global ranks
            CHECK(grid_rank(l, d, G, g) == GridRank{j, r});
            CHECK(node_of(l, d, G, j, r) == g / G);
            if (l == NL::contiguous || d <= G) CHECK(g == j * d + r);
            if (d % 2 == 0 && (l == NL::contiguous || d <= G || (G / 2) % 2 == 0))
              CHECK(global_rank(l, d, G, j, r ^ 1) == (g ^ 1));
            seen.insert(g);
          }
        CHECK(seen.size() == static_cast<std::size_t>(dp * d));
        CHECK(*seen.rbegin() == dp * d - 1);
      }
}

TEST_CASE("host memory per node: every replica's ranks on their nodes, in both layouts") {
  std::vector<double> host(16);
  for (int r = 0; r < 16; ++r) host[static_cast<std::size_t>(r)] = 100.0 - 5 * r;  // early ranks offload most
  const auto c = host_bytes_per_node(host, 2, 8, NodeLayout::contiguous);
  const auto b = host_bytes_per_node(host, 2, 8, NodeLayout::balanced);
  REQUIRE(c.size() == 4);
  REQUIRE(b.size() == 4);
  double first = 0, last = 0, outer = 0, inner = 0;
  for (int r = 0; r < 16; ++r) {
    const double h = host[static_cast<std::size_t>(r)];
    (r < 8 ? first : last) += h;
    (r < 4 || r >= 12 ? outer : inner) += h;
  }
  CHECK(c == std::vector<double>{first, last, first, last});
  CHECK(b == std::vector<double>{outer, inner, outer, inner});
  CHECK(std::max(b[0], b[1]) < std::max(c[0], c[1]));  // balanced evens it out
  // Two replicas of 4 ranks on one node of 8; a partly used last node.
  CHECK(host_bytes_per_node({1, 2, 3, 4}, 2, 8, NodeLayout::contiguous) == std::vector<double>{20});
  CHECK(host_bytes_per_node({1, 2, 3}, 3, 4, NodeLayout::contiguous) == std::vector<double>{7, 8, 3});
  // The plan reports both lists for its choice.
  const PlanResult r = plan(small48(), four_ranks(80), {}, grid(2));
  CHECK(r.host_bytes_per_node_contiguous.size() == 1);
  CHECK(r.host_bytes_per_node_balanced == r.host_bytes_per_node_contiguous);
}

TEST_CASE("search over dp: a valid grid of the given GPUs, the fastest that fits") {
  const TransformerSpec m = small48();  // 48 microbatches, 16 layer slots
  GridSpec g;
  g.dp = 0;
  g.gpus = 16;
  const PlanResult r = plan(m, small_machine(6), {}, g);
  REQUIRE(r.fits);
  CHECK(r.searched);
  CHECK(r.dp * r.ranks == 16);
  CHECK(48 % r.dp == 0);
  CHECK(r.microbatches == 48 / r.dp);
  std::set<int> dps;
  for (const GridOption& o : r.grids) {
    dps.insert(o.dp);
    CHECK(o.dp * o.ranks == 16);
    CHECK(o.planned == (48 % o.dp == 0));  // 16 GPUs: dp 16 does not split 48
    if (o.planned && o.fits) CHECK(o.iteration_time_s >= r.choice.iteration_time_s);
    if (o.dp == r.dp) CHECK(o.iteration_time_s == r.choice.iteration_time_s);
  }
  CHECK(dps == std::set<int>{1, 2, 4, 8, 16});
  // The same plan as asking for that dp directly.
  const PlanResult direct = plan(
      m,
      [&] {
        MachineSpec x = small_machine(6);
        x.ranks = r.ranks;
        return x;
      }(),
      {}, grid(r.dp));
  CHECK(direct.choice.iteration_time_s == r.choice.iteration_time_s);
  CHECK(direct.choice.name == r.choice.name);
  CHECK(r.why.find("dp " + std::to_string(r.dp) + " x d " + std::to_string(r.ranks)) == 0);
}

TEST_CASE("more device memory never gives a slower plan, with a fixed dp and with a dp search") {
  const TransformerSpec m = small48();
  for (int mode : {0, 1, 2}) {  // dp 2 ZeRO-0, dp 4 ZeRO-1, search over 16 GPUs
    CAPTURE(mode);
    GridSpec g = mode == 0 ? grid(2) : grid(4, 1);
    MachineSpec x = four_ranks(1);
    if (mode == 2) {
      g.dp = 0;
      g.gpus = 16;
    }
    double prev = 1e300;
    bool prev_fits = false;
    int fitting = 0;
    for (double gib = 0.5; gib <= 40; gib *= 1.2) {
      x.device_bytes = gib * pipeoffload::gib;
      const PlanResult r = plan(m, x, {}, g);
      CHECK((r.fits || !prev_fits));
      if (r.fits) {
        ++fitting;
        CHECK(r.choice.iteration_time_s <= prev);
        prev = r.choice.iteration_time_s;
      }
      prev_fits = r.fits;
    }
    CHECK(fitting > 3);
  }
}

TEST_CASE("bad grids throw shape_error naming the value and what is allowed") {
  const TransformerSpec m = small();  // 16 microbatches
  const MachineSpec x = small_machine(80);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(-1)),
                       doctest::Contains("dp (0 = search) = -1 is outside the allowed range [0, 65536]"), shape_error);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(3)),
                       doctest::Contains("dp = 3 does not split the global batch: its 16 microbatches"), shape_error);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(3)), doctest::Contains("dp must divide 16 (1, 2, 4, 8, 16)"), shape_error);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(2, 2)),
                       doctest::Contains("ZeRO stage = 2 is outside the allowed range [0, 1]"), shape_error);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(2, 0, 0)),
                       doctest::Contains("all-reduce bandwidth must be in [1, 1e21] bytes/s, got 0"), shape_error);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, grid(2, 0, std::nan(""))), doctest::Contains("got nan"), shape_error);
  GridSpec g = grid(2);
  g.gpus = 12;
  CHECK_THROWS_WITH_AS(plan(m, x, {}, g), doctest::Contains("gpus = 12 must be 0 or dp x ranks = 16"), shape_error);
  g = grid(0);
  CHECK_THROWS_WITH_AS(plan(m, x, {}, g), doctest::Contains("GPUs to search over (dp = 0) = 0"), shape_error);
  g = grid(1);
  g.node_layout = NodeLayout::balanced;
  g.gpus_per_node = 6;
  CHECK_THROWS_WITH_AS(plan(m, x, {}, g), doctest::Contains("got d = 8, G = 6"), shape_error);
  g.gpus_per_node = 0;
  CHECK_THROWS_WITH_AS(plan(m, x, {}, g), doctest::Contains("GPUs per node = 0"), shape_error);
  // A search with no grid that can be planned says why for every dp.
  g = grid(0);
  g.gpus = 64;  // 16 layer slots: d <= 16 needs dp >= 4, but 16 microbatches split into at most 16
  TransformerSpec one = small();
  one.global_batch = 2;
  CHECK_THROWS_WITH_AS(plan(one, x, {}, g), doctest::Contains("no dp that divides 64 GPUs"), shape_error);
}

namespace {

constexpr bool tiny_grid_plan() {
  GridSpec g;
  g.dp = 2;
  g.zero = 1;
  g.allreduce_bytes_per_s = 1e9;
  const PlanResult r = plan(tiny_model(8), tiny_machine(), {}, g);
  return r.fits && r.microbatches == 4 && r.choice.allreduce_exposed_s > 0 &&
         node_of(NodeLayout::balanced, 16, 8, 0, 12) == 0;
}

}  // namespace

TEST_CASE("a data-parallel plan is constexpr too") {
  static_assert(tiny_grid_plan());
  CHECK(tiny_grid_plan());
}

TEST_CASE("model presets: the paper's Table 2 and Llama 3, counted to their published sizes") {
  const auto total = [](const TransformerSpec& m) {
    double p = 0;
    for (const StageContent& c : stage_layout(m, 1)) p += stage_parameters(m, c);
    return p;
  };
  REQUIRE(find_model_preset("llama3-8b") != nullptr);
  REQUIRE(find_model_preset("llama3-70b") != nullptr);
  CHECK(total(find_model_preset("llama3-8b")->model) == 8030261248.0);
  CHECK(total(find_model_preset("llama3-70b")->model) == 70553706496.0);
  CHECK(find_model_preset("llama3-8b")->model.swiglu);
  CHECK(find_model_preset("gpt-9") == nullptr);
  // The paper names its models by their size. The planner counts an untied LM head and a
  // position table beside the embedding (2 V h + s h more than a tied, rotary model), so its
  // counts run 0.8 % (83.8B) to 5 % (5.8B) above the names; a shape typed wrong would not.
  for (const ModelPreset& p : model_presets) {
    CAPTURE(p.name);
    if (!p.name.starts_with("paper-")) continue;
    const double named = std::stod(std::string(p.name.substr(6, p.name.size() - 7))) * 1e9;  // "paper-42.9b"
    const double counted = total(p.model), h = p.model.hidden, V = p.model.vocab;
    CAPTURE(counted);
    CHECK(counted >= named);
    CHECK(counted - 2 * V * h - p.model.seq * h <= named * 1.01);
    CHECK(p.gpus > 0);
    CHECK(p.model.global_batch % p.model.micro_batch == 0);
  }
  CHECK(model_preset_names().find("paper-83.8b") != std::string::npos);
}

TEST_CASE("Llama-class layers: Llama-3-8B and 70B parameter counts, and a SwiGLU layer's bytes and FLOPs") {
  // Meta's published sizes: 8,030,261,248 and 70,553,706,496 parameters (untied 128256 x h
  // embedding and head, RMSNorms, no biases).
  const auto total = [](const TransformerSpec& m) {
    double p = 0;
    for (const StageContent& c : stage_layout(m, 1)) p += stage_parameters(m, c);
    return p;
  };
  TransformerSpec l8{.layers = 32,
                     .hidden = 4096,
                     .heads = 32,
                     .query_groups = 8,
                     .vocab = 128256,
                     .ffn_hidden = 14336,
                     .swiglu = true};
  TransformerSpec l70{.layers = 80,
                      .hidden = 8192,
                      .heads = 64,
                      .query_groups = 8,
                      .vocab = 128256,
                      .ffn_hidden = 28672,
                      .swiglu = true};
  CHECK(layer_parameters(l8) == 218112000.0);
  CHECK(total(l8) == 8030261248.0);
  CHECK(total(l70) == 70553706496.0);
  // Per token of one layer, with recompute (e = 2): norm 1 in, Q, attention out, norm 2 in (4h),
  // K and V (2 x 1024), gate and up (2f); without: norm outputs (2h) and the product (f) too.
  const double T = 4096, h = 4096, f = 14336;
  l8.recompute = true;
  CHECK(activation_bytes_per_layer(l8) == 2 * T * (4 * h + 2048 + 2 * f));
  l8.recompute = false;
  CHECK(activation_bytes_per_layer(l8) == 2 * T * (4 * h + 2048 + 2 * f + 2 * h + f));
  // Linear FLOPs: QKV (h x 6144), projection, gate, up and down.
  CHECK(layer_linear_flops(l8) == 2 * T * h * (6144 + h + 3 * f));
  // The stash holds fc1's (gate and up) output gradient: 2f where GPT's holds f.
  CHECK(stage_stash_bytes(l8, {1, false, false}) == 2 * T * (4 * h + 6144 + 2 * f));
  // --ffn-hidden 4h on a GPT layer is the default.
  TransformerSpec g{.hidden = 1024, .heads = 16};
  TransformerSpec g4 = g;
  g4.ffn_hidden = 4096;
  CHECK(layer_parameters(g4) == layer_parameters(g));
  CHECK(activation_bytes_per_layer(g4) == activation_bytes_per_layer(g));
  CHECK(layer_linear_flops(g4) == layer_linear_flops(g));
  // A Llama-class model's plan counts its larger layers (the 24 % more than a GPT layer).
  const MachineSpec x{.ranks = 8};
  TransformerSpec gpt8 = l8;
  gpt8.swiglu = false;
  gpt8.ffn_hidden = 0;
  gpt8.vocab = 128256;
  CHECK(detail::make_layout(l8, x, {}, 1).model_state[1] > 1.2 * detail::make_layout(gpt8, x, {}, 1).model_state[1]);
}

TEST_CASE("PlanBudget::schedule pins one family: every candidate is of it, the choice too; a bad name is refused") {
  const TransformerSpec m = small();
  PlanBudget bud;
  bud.schedule = "zb-v";
  const PlanResult r = plan(m, small_machine(80), bud);
  REQUIRE(!r.candidates.empty());
  for (const PlanCandidate& c : r.candidates) CHECK(c.name == "zb-v");
  CHECK(r.choice.name == "zb-v");
  // The pinned choice is the fastest zb-v candidate of the unpinned search.
  const PlanResult all = plan(m, small_machine(80));
  double fastest = 0;
  for (const PlanCandidate& c : all.candidates)
    if (c.name == "zb-v" && c.fits && (fastest == 0 || c.iteration_time_s < fastest)) fastest = c.iteration_time_s;
  CHECK(r.choice.iteration_time_s == fastest);
  bud.schedule = "zb-w";
  CHECK_THROWS_WITH_AS(plan(m, small_machine(80), bud),
                       doctest::Contains("budget: schedule must be empty or one of 1f1b, 1f1b-i, gis, gis-h, gis-g, "
                                         "po, po-h, po-f, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v, got 'zb-w'"),
                       shape_error);
}

TEST_CASE(
    "copy streams: auto plans every offloading candidate on one stream and on two and keeps the faster; two only "
    "without PCIe partners") {
  const TransformerSpec m = small();
  MachineSpec x = small_machine(80);
  x.pcie_bytes_per_s = 36e9;  // k = 2.3: copies, not compute, bound how much a rank offloads
  x.pairs_share_switch = false;
  x.duplex_slowdown = 1.31;
  const PlanResult one = plan(m, x);
  x.copy_streams = 0;
  const PlanResult both = plan(m, x);
  // The same candidates in the same order, each offloading one followed by its two-stream twin.
  std::size_t i = 0, twins = 0, better = 0;
  for (const PlanCandidate& c : one.candidates) {
    REQUIRE(i < both.candidates.size());
    const PlanCandidate& a = both.candidates[i++];
    CHECK(a.name == c.name);
    CHECK(a.copy_streams == 1);
    CHECK(a.iteration_time_s == c.iteration_time_s);
    if (c.offload_chunks == 0) continue;
    REQUIRE(i < both.candidates.size());
    const PlanCandidate& b = both.candidates[i++];
    CHECK((b.name == c.name && b.chunks == c.chunks && b.cut == c.cut && b.offload_chunks == c.offload_chunks));
    CHECK(b.copy_streams == 2);
    ++twins;
    // Better: faster, or as fast in less memory (a reload no longer waits behind offloads, so
    // PO's placement offloads more of its units in the same time).
    better += detail::faster(b, c) ? 1 : 0;
    // Its time is the simulated makespan of its schedule built on two copy streams.
    detail::Layout L = detail::make_layout(m, x, {}, b.chunks, {}, b.spec.placement, b.cut);
    L.costs.copy_streams = 2;
    CHECK(b.iteration_time_s == simulate(build(b.spec, {x.ranks, b.chunks, both.microbatches}, L.costs)).makespan);
  }
  CHECK(i == both.candidates.size());
  CHECK(twins >= 10);
  CHECK(better > 0);
  REQUIRE(both.fits);
  for (const PlanCandidate& c : both.candidates)
    if (c.fits) CHECK(c.iteration_time_s >= both.choice.iteration_time_s);

  // Over device memory: auto fits wherever one stream does and is never slower (its candidates
  // are a superset), and somewhere it is faster, on two streams, which its command lines carry
  // (16 layers of h = 1024 at s = 4096 on 4 ranks: at 4.7 GiB DualPipeV offloading on two
  // streams, 0.396 s, where one stream's best that fits is V-Half, 0.451 s).
  TransformerSpec wide = model(16, 1024, 16, 4, 4096, 1, false);
  wide.global_batch = 16;
  wide.vocab = 32000;
  MachineSpec y{.ranks = 4, .host_bytes = 64 * gib, .flops = 100e12, .pcie_bytes_per_s = 30e9};
  y.pairs_share_switch = false;
  y.duplex_slowdown = 1.31;
  int wins = 0;
  for (double g = 4; g <= 6; g *= 1.02) {
    CAPTURE(g);
    y.device_bytes = g * gib;
    y.copy_streams = 1;
    const PlanResult a = plan(wide, y);
    y.copy_streams = 0;
    const PlanResult b = plan(wide, y);
    CHECK((b.fits || !a.fits));
    if (!a.fits || !b.fits) continue;
    CHECK(b.choice.iteration_time_s <= a.choice.iteration_time_s);
    if (!(b.choice.iteration_time_s < a.choice.iteration_time_s)) continue;
    ++wins;
    CHECK(b.choice.copy_streams == 2);
    CHECK(b.duplex_slowdown == 1.31);
    CHECK(plan_command(b, y.ranks).find(" --copy-streams 2 --duplex-slowdown 1.31 ") != std::string::npos);
  }
  CHECK(wins > 0);

  // Ranks with PCIe partners: auto tries one stream only, and plans as with one.
  x.pairs_share_switch = true;
  x.copy_streams = 0;
  const PlanResult paired = plan(m, x);
  x.copy_streams = 1;
  const PlanResult paired_one = plan(m, x);
  CHECK(paired.candidates.size() == paired_one.candidates.size());
  for (const PlanCandidate& c : paired.candidates) CHECK(c.copy_streams == 1);
  CHECK(paired.choice.iteration_time_s == paired_one.choice.iteration_time_s);

  // Bad values are refused with the field's name.
  x.copy_streams = 3;
  CHECK_THROWS_WITH_AS(plan(m, x),
                       doctest::Contains("machine: copy streams (0 = try one and two) = 3 is outside the allowed range "
                                         "[0, 2]"),
                       shape_error);
  x.copy_streams = 2;
  x.duplex_slowdown = 0.5;
  CHECK_THROWS_WITH_AS(plan(m, x), doctest::Contains("machine: duplex slowdown"), shape_error);
}

TEST_CASE("messages' real numbers: three decimals, and a power of ten from 1e9 up and below 1e-3") {
  for (const auto& [x, want] : std::initializer_list<std::pair<double, const char*>>{{0, "0"},
                                                                                     {12.5, "12.5"},
                                                                                     {-3, "-3"},
                                                                                     {0.0015, "0.002"},
                                                                                     {999999999, "999999999"},
                                                                                     {1e9, "1e+09"},
                                                                                     {1e18, "1e+18"},
                                                                                     {2.5e21, "2.5e+21"},
                                                                                     {9.9999e12, "1e+13"},
                                                                                     {2.5e-5, "2.5e-05"},
                                                                                     {1.23456e-300, "1.235e-300"},
                                                                                     {1e308 * 10, "inf"},
                                                                                     {-1e308 * 10, "-inf"},
                                                                                     {std::nan(""), "nan"}}) {
    CAPTURE(want);
    CHECK(detail::fmt_real(x) == want);
  }
  static_assert(detail::fmt_real(1e21) == "1e+21");
}
