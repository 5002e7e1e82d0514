// po::plan: per-layer bytes and FLOPs, stage layout, the choice and its guarantees.
#include <doctest/doctest.h>

#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/plan/plan.hpp>

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

constexpr bool tiny_plan_fits() {
  TransformerSpec m;
  m.layers = 6;
  m.hidden = 256;
  m.heads = 4;
  m.query_groups = 4;
  m.seq = 256;
  m.global_batch = 4;
  m.vocab = 1000;
  MachineSpec x;
  x.ranks = 2;
  x.device_bytes = 2 * gib;  // 1 GiB of it is the default reserve
  const PlanResult r = plan(m, x);
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
  const double layer_f = layer_flops(m).f / x.flops, a = activation_bytes_per_layer(m);
  for (int s = 1; s < 15; ++s) {
    CHECK(L.costs.stage_f[static_cast<std::size_t>(s)] == doctest::Approx(layer_f).epsilon(1e-12));
    CHECK(L.costs.unit_bytes[static_cast<std::size_t>(s)] == a);
  }
  CHECK(L.costs.stage_f[0] == doctest::Approx(0.01 * layer_f).epsilon(1e-12));  // embedding only
  CHECK(L.costs.unit_bytes[0] == 4.0 * 2048);                                   // its token ids
  CHECK(L.costs.stage_f[15] == doctest::Approx(head_flops(m).f / x.flops).epsilon(1e-12));
  CHECK(L.costs.unit_bytes[15] == 2.0 * 2048 * 1024 + 4.0 * 2048 * 32000);  // LN input + fp32 softmax
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

TEST_CASE("plan searches 1F1B, 1F1B-I, every legal GIS(g) and PO with 0..v offloaded chunks") {
  const TransformerSpec m = small();
  const PlanResult r = plan(m, small_machine(80));
  std::set<std::tuple<std::string, int, int, int>> seen;
  for (const PlanCandidate& c : r.candidates) seen.insert({c.name, c.chunks, c.group, c.offload_chunks});
  CHECK(seen.size() == r.candidates.size());
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
  CHECK(r.candidates.size() == 1 + 1 + 2 * 5 + 2 + 3);  // no v = 3: 16 slots over 24 stages
}

TEST_CASE("every candidate's device bytes are model state + simulated activations + workspace") {
  const PlanResult r = plan(small(), small_machine(80));
  const TransformerSpec m = small();
  for (const PlanCandidate& c : r.candidates) {
    const detail::Layout L = detail::make_layout(m, small_machine(80), {}, c.chunks);
    const SimResult sim = simulate(build(c.spec, {8, c.chunks, 16}, L.costs));
    CHECK(sim.makespan == c.iteration_time_s);
    CHECK(sim.bubble_fraction() == c.bubble_fraction);
    for (int i = 0; i < 8; ++i) {
      const auto u = static_cast<std::size_t>(i);
      CHECK(c.activation_bytes[u] == sim.ranks[u].peak);
      CHECK(c.peak_device_bytes[u] == L.model_state[u] + sim.ranks[u].peak + L.workspace[u]);
      if (c.offload_chunks == 0) CHECK(c.host_bytes[u] == 0);
    }
  }
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
  x.host_bytes = 0;
  r = plan(small(), x);
  int ruled_out = 0;
  for (const PlanCandidate& c : r.candidates) {
    double total = 0;
    for (double h : c.host_bytes) total += h;
    if (c.fits) CHECK(total == 0);
    if (total > 0) {
      CHECK(c.shortfall_on_host);
      ++ruled_out;
    }
  }
  CHECK(ruled_out > 0);
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
  CHECK_THROWS_AS(plan(small(), y), shape_error);
  y = x;
  y.flops = std::nan("");
  CHECK_THROWS_AS(plan(small(), y), shape_error);
  y = x;
  y.ranks = 17;  // 16 layer slots
  CHECK_THROWS_WITH_AS(plan(small(), y), doctest::Contains("layer slots"), shape_error);
  PlanBudget b;
  b.bytes_per_parameter = -1;
  CHECK_THROWS_AS(plan(small(), x, b), shape_error);
}

TEST_CASE("plan is constexpr: a small model plans in a constant expression") {
  static_assert(tiny_plan_fits());
  CHECK(tiny_plan_fits());
}
