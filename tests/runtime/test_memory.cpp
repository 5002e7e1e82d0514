// tests/runtime: measured activation memory against the simulator's peaks.
//
// Layers sleep a fixed time per pass and the copy engine is paced so a unit's one-way copy
// takes T_O = k (T_F + T_B + T_W) / 2 with k = 1, so the run follows the simulated timeline.
// What is compared: the device arena's peak of Memory::activation (the saved units, alive
// from F to W except between an offload's end and its reload's start) against simulate()'s
// peak with each stage's own unit bytes; the arena's peak of Memory::stash (B to W, or a
// BW while it runs) against simulate()'s stash_peak, exactly, for every family. Messages
// (Memory::message: boundary tensors received or waiting to be sent) are bounded apart.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tanh_layer.hpp"

namespace {

struct Measured {
  std::vector<double> measured, simulated, unit;  // per rank: activation peak bytes; largest unit
  std::vector<std::size_t> stash_peak;
  test::Run run;
};

Measured measure(po::ScheduleSpec spec, po::Shape shape) {
  test::Config c;
  c.spec = spec;
  c.shape = shape;
  c.steps = 2;
  c.h = 16;
  const double t = 0.002;
  c.timing = {t, t, t};
  c.costs.f = c.costs.b = c.costs.w = t;
  c.costs.k = 1;
  // Unit sizes per stage, as the layer reports them; pace copies for the largest.
  std::vector<double> bytes;
  double largest = 0;
  for (int s = 0; s < shape.stages(); ++s) {
    const test::TanhLayer l(s, c.h, 1);
    bytes.push_back(static_cast<double>(l.saved_bytes(c.mb)));
    largest = std::max(largest, bytes.back());
  }
  c.copy_bytes_per_second = largest / c.costs.T_O(0);
  Measured m;
  m.run = test::train_within(c, 240);
  for (const std::string& e : m.run.errors) REQUIRE(e == "");
  po::Costs sc = c.costs;
  sc.unit_bytes = bytes;
  const po::SimResult sim = po::simulate(m.run.program, sc);
  for (int r = 0; r < shape.d; ++r) {
    m.measured.push_back(
        static_cast<double>(m.run.memory[static_cast<std::size_t>(r)].peak_of(po::backend::Memory::activation)));
    m.simulated.push_back(sim.ranks[static_cast<std::size_t>(r)].peak);
    m.stash_peak.push_back(m.run.memory[static_cast<std::size_t>(r)].peak_of(po::backend::Memory::stash));
    double u = 0;
    for (int ch = 0; ch < shape.v; ++ch) u = std::max(u, bytes[static_cast<std::size_t>(shape.stage_of(r, ch))]);
    m.unit.push_back(u);
  }
  return m;
}

po::ScheduleSpec po_f() { return {po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all}; }

}  // namespace

TEST_CASE("memory: each rank's measured activation peak is within [90%, 100%] of the simulated peak") {
  using GK = po::GroupSpec::Kind;
  const std::vector<std::pair<const char*, po::ScheduleSpec>> specs = {
      {"1f1b-i", {po::Family::interleaved_1f1b, {}, po::offload::none}},
      {"gis-h", {po::Family::grouped, {GK::half, 0}, po::offload::none}},
      {"po", {po::Family::grouped, {GK::uniform, 1}, po::offload::none}},
      {"po-h", {po::Family::grouped, {GK::uniform, 1}, po::offload::half}},
      {"po-f", po_f()},
  };
  for (const auto& [name, spec] : specs) {
    CAPTURE(name);
    const Measured m = measure(spec, {4, 2, 8});
    for (std::size_t r = 0; r < m.measured.size(); ++r) {
      CAPTURE(r);
      CAPTURE(m.measured[r]);
      CAPTURE(m.simulated[r]);
      if (r == 0) MESSAGE(std::string(name), " rank 0: measured ", m.measured[r], " bytes, simulated ", m.simulated[r]);
      CHECK(m.measured[r] <= m.simulated[r]);
      CHECK(m.measured[r] >= 0.9 * m.simulated[r]);
      // Stash: B-to-W buffers; with split backward a W follows its B closely.
      CHECK(m.stash_peak[r] > 0);
    }
  }
}

TEST_CASE(
    "memory: each rank's measured stash peak equals the simulated one, every family (B to W, a BW while it runs)") {
  // On the compute stream a stash lives from its B's start to its W's end in program order, so
  // its peak does not depend on timing: the simulator's stash_peak must be the runtime's.
  for (const char* name : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v",
                           "v-half", "v-min", "dualpipe-v"}) {
    CAPTURE(name);
    const std::string n = name;
    const int v = n == "1f1b" || n.rfind("zb-h", 0) == 0 ? 1 : 2;
    test::Config c;
    c.spec = po::parse_schedule(n, n == "gis-g" ? 2 : 0);
    c.shape = {4, v, 8};
    c.steps = 1;
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    po::Costs sc = c.costs;
    for (int s = 0; s < c.shape.stages(); ++s) {
      const test::TanhLayer l(s, c.h, 1);
      sc.unit_bytes.push_back(static_cast<double>(l.saved_bytes(c.mb)));
      sc.stash_bytes.push_back(static_cast<double>(l.stash_bytes(c.mb)) * (1 + s % 3));  // uneven: who holds what
    }
    po::Costs even = sc, none = sc;  // the runtime's stashes (the layer's: equal for every stage); no stashes
    for (int s = 0; s < c.shape.stages(); ++s)
      even.stash_bytes[static_cast<std::size_t>(s)] = static_cast<double>(test::TanhLayer(s, c.h, 1).stash_bytes(c.mb));
    none.stash_bytes.clear();
    const po::SimResult uneven = po::simulate(run.program, sc), sim = po::simulate(run.program, even),
                        without = po::simulate(run.program, none);
    for (int r = 0; r < c.shape.d; ++r) {
      CAPTURE(r);
      const auto ru = static_cast<std::size_t>(r);
      CHECK(static_cast<double>(run.memory[ru].peak_of(po::backend::Memory::stash)) == sim.ranks[ru].stash_peak);
      CHECK(sim.ranks[ru].stash_peak > 0);
      // The memory timeline holds the stashes beside the units.
      CHECK(uneven.ranks[ru].peak > without.ranks[ru].peak);
      CHECK(uneven.ranks[ru].peak <= without.ranks[ru].peak + uneven.ranks[ru].stash_peak);
    }
  }
}

TEST_CASE("memory: PO-F's measured peak stays flat as d*v grows") {
  std::vector<double> units;
  for (po::Shape sh : {po::Shape{2, 2, 8}, po::Shape{4, 2, 8}, po::Shape{4, 4, 8}, po::Shape{8, 2, 16}}) {
    CAPTURE(sh.d);
    CAPTURE(sh.v);
    const Measured m = measure(po_f(), sh);
    units.push_back(m.measured[0] / m.unit[0]);
    CHECK(m.measured[0] <= m.simulated[0]);
  }
  CAPTURE(units[0]);
  CAPTURE(units[1]);
  CAPTURE(units[2]);
  CAPTURE(units[3]);
  MESSAGE("PO-F rank-0 peak in units of its largest stage, (d,v) = (2,2) (4,2) (4,4) (8,2): ", units[0], " ", units[1],
          " ", units[2], " ", units[3]);
  for (double u : units) CHECK(u <= 5.0);  // a small constant (DESIGN.md: ~4 units), against d*v up to 16
}

TEST_CASE("memory: after construction no step takes device or pinned host memory from the system") {
  // po::Runtime reserves, per buffer size, the most blocks its program can hold under any
  // timing; so with fast passes, with sleeping passes and a paced copy engine, and whatever
  // the OS does to the threads, the arena's allocation counts never move during steps.
  using GK = po::GroupSpec::Kind;
  const std::vector<std::pair<const char*, po::ScheduleSpec>> specs = {
      {"1f1b", {po::Family::one_f1b, {}, po::offload::none}},
      {"1f1b-i + offload all", {po::Family::interleaved_1f1b, {}, po::offload::all}},
      {"gis-h", {po::Family::grouped, {GK::half, 0}, po::offload::none}},
      {"po-h", {po::Family::grouped, {GK::uniform, 1}, po::offload::half}},
      {"po-f", po_f()},
  };
  for (const auto& [name, spec] : specs)
    for (int paced = 0; paced < 2; ++paced) {
      CAPTURE(name);
      CAPTURE(paced);
      test::Config c;
      c.spec = spec;
      c.shape = {spec.family == po::Family::one_f1b ? 3 : 4, spec.family == po::Family::one_f1b ? 1 : 2, 8};
      c.steps = 4;
      if (paced) {
        const double t = 0.0005;
        c.timing = {t, t, t};
        c.costs.f = c.costs.b = c.costs.w = t;
        c.copy_bytes_per_second = 2e6;  // slower than k = 1: copies lag compute
      }
      const test::Run run = test::train_within(c, 120);
      for (const std::string& e : run.errors) REQUIRE(e == "");
      for (int r = 0; r < c.shape.d; ++r) {
        CAPTURE(r);
        const auto& dev = run.device_allocations[static_cast<std::size_t>(r)];
        const auto& host = run.host_allocations[static_cast<std::size_t>(r)];
        REQUIRE(dev.size() == static_cast<std::size_t>(c.steps) + 1);
        CHECK(dev.front() > 0);  // reserved at construction
        for (std::size_t s = 1; s < dev.size(); ++s) {
          CAPTURE(s);
          CHECK(dev[s] == dev.front());
          CHECK(host[s] == host.front());
        }
      }
    }
}

TEST_CASE("memory: the reservation bound counts every interleaving of two streams") {
  using E = po::detail::BlockEffect;
  // A takes a block in op 0 and gives it back in op 2; B takes one in op 0, gives it in op 1.
  const std::vector<E> a = {{1, 0}, {0, 0}, {0, 1}}, b = {{1, 0}, {0, 1}};
  // Unordered: both can hold theirs at once.
  CHECK(po::detail::two_stream_peak(a, {}, b, {}) == 2);
  // B's op 0 waits for A's op 2 (A's block is back first): never more than one.
  CHECK(po::detail::two_stream_peak(a, {}, b, {2, -1}) == 1);
  // A's op 0 waits for B's op 1 instead: again one.
  CHECK(po::detail::two_stream_peak(a, {1, -1, -1}, b, {}) == 1);
  // B's op 0 waits only for A's op 1, which runs while A still holds its block: two.
  CHECK(po::detail::two_stream_peak(a, {}, b, {1, -1}) == 2);
  // One stream alone: the most held at once, including what the running op took.
  CHECK(po::detail::two_stream_peak({{1, 0}, {1, 0}, {0, 2}, {1, 1}}, {}, {}, {}) == 2);
}

namespace {

/// two_stream_peak by its definition: every pair of stream states the waits allow, O(|A| |B|).
long long peak_by_definition(const std::vector<po::detail::BlockEffect>& A, const std::vector<int>& aw,
                             const std::vector<po::detail::BlockEffect>& B, const std::vector<int>& bw) {
  struct St {
    long long in_use;
    std::size_t done, started;
  };
  const auto states = [](const std::vector<po::detail::BlockEffect>& ops) {
    std::vector<St> st;
    long long net = 0;
    for (std::size_t k = 0; k <= ops.size(); ++k) {
      st.push_back({net, k, k});
      if (k < ops.size()) {
        st.push_back({net + ops[k].take, k, k + 1});
        net += ops[k].take - ops[k].give;
      }
    }
    return st;
  };
  // The other stream's ops that must be done once `started` ops of this one have started.
  const auto need = [](const std::vector<int>& waits, std::size_t started) {
    std::size_t n = 0;
    for (std::size_t k = 0; k < started && k < waits.size(); ++k)
      n = std::max(n, static_cast<std::size_t>(waits[k] + 1));
    return n;
  };
  long long best = 0;
  for (const St& a : states(A))
    for (const St& b : states(B))
      if (b.done >= need(aw, a.started) && a.done >= need(bw, b.started)) best = std::max(best, a.in_use + b.in_use);
  return best;
}

po::ScheduleSpec spec_of(int i) {
  using GK = po::GroupSpec::Kind;
  switch (i) {
    case 0:
      return {po::Family::one_f1b, {}, po::offload::none};
    case 1:
      return {po::Family::interleaved_1f1b, {}, po::offload::none};
    case 2:
      return {po::Family::grouped, {GK::full, 0}, po::offload::none};
    case 3:
      return {po::Family::grouped, {GK::half, 0}, po::offload::none};
    default:
      return {po::Family::grouped, {GK::uniform, 1}, po::offload::none};
  }
}

}  // namespace

TEST_CASE("memory: two_stream_peak equals its definition on random streams and waits (seeded)") {
  std::uint64_t s = 12345;
  const auto next = [&](std::uint64_t n) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::size_t>((s >> 33) % n);
  };
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<po::detail::BlockEffect> A(next(8)), B(next(8));
    for (auto* ops : {&A, &B})
      for (auto& e : *ops) {
        e.take = static_cast<long long>(next(3));
        e.give = static_cast<long long>(next(3));
      }
    // Waits point forward into the other stream, in order (the runtime's edges are monotone).
    const auto waits = [&](std::size_t n, std::size_t other) {
      std::vector<int> w(n, -1);
      int at = -1;
      for (auto& x : w)
        if (other > 0 && next(3) == 0) {
          at = std::min(static_cast<int>(other) - 1, at + 1 + static_cast<int>(next(2)));
          x = at;
        }
      return w;
    };
    // Only one direction of waits at a time can be mutually consistent without a cycle check,
    // so draw waits for A, for B, or for neither.
    const std::size_t which = next(3);
    const std::vector<int> aw = which == 0 ? waits(A.size(), B.size()) : std::vector<int>{};
    const std::vector<int> bw = which == 1 ? waits(B.size(), A.size()) : std::vector<int>{};
    CAPTURE(trial);
    REQUIRE(po::detail::two_stream_peak(A, aw, B, bw) == peak_by_definition(A, aw, B, bw));
  }
}

TEST_CASE("memory: without offload, the reservation plan holds exactly the simulated peak of units") {
  // One stream holds the units, so the most held under any timing is the most held in its
  // order: the simulator's peak with unit costs, for every rank.
  for (int f = 0; f < 5; ++f)
    for (po::Shape sh :
         {po::Shape{2, 1, 4}, po::Shape{4, 1, 8}, po::Shape{2, 2, 4}, po::Shape{4, 2, 8}, po::Shape{3, 3, 6}}) {
      const po::ScheduleSpec spec = spec_of(f);
      if (spec.family == po::Family::one_f1b && sh.v != 1) continue;
      if (spec.family != po::Family::one_f1b && sh.v == 1) continue;
      CAPTURE(f);
      CAPTURE(sh.d);
      CAPTURE(sh.v);
      const po::Program p = po::build(spec, sh);
      const po::SimResult sim = po::simulate(p);
      std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()), po::StageBytes{1000, 500, 64, 64});
      for (int r = 0; r < sh.d; ++r) {
        const po::Reservation res = po::reservation_plan(p, r, bytes);
        REQUIRE(res.activation.size() == 1);
        CHECK(static_cast<double>(res.activation[0].count) == sim.ranks[static_cast<std::size_t>(r)].peak);
        CHECK(res.host.empty());
        REQUIRE(res.stash.size() == 1);
        CHECK(res.stash[0].count >= 1);
      }
    }
}

TEST_CASE("memory: with offload, the plan covers the simulated peak and PO-F's stays a small constant") {
  const po::ScheduleSpec po_f_spec = po_f();
  for (po::Shape sh : {po::Shape{2, 2, 8}, po::Shape{4, 2, 8}, po::Shape{4, 4, 8}, po::Shape{8, 2, 16}}) {
    CAPTURE(sh.d);
    CAPTURE(sh.v);
    const po::Program p = po::build(po_f_spec, sh);
    const po::SimResult sim = po::simulate(p);
    const std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()), po::StageBytes{4096, 512, 64, 64});
    for (int r = 0; r < sh.d; ++r) {
      const po::Reservation res = po::reservation_plan(p, r, bytes);
      REQUIRE(res.activation.size() == 1);
      CHECK(static_cast<double>(res.activation[0].count) >= sim.ranks[static_cast<std::size_t>(r)].peak);
      CHECK(res.activation[0].count <= 8);  // under any timing, not only the simulated one
      REQUIRE(res.host.size() == 1);        // 4096 bytes: one power-of-two bin per unit
      CHECK(res.host[0].bytes == 4096);
      CHECK(res.host[0].count >= 1);
    }
  }
}

TEST_CASE("memory: boundary blocks are planned per size when stages hand on tensors of different sizes") {
  // Stage s outputs 100 + s bytes; on one rank (no messages) each size is held by F(s) until
  // F(s+1) consumes it, and its gradient by B(s+1) until B(s) consumes it: in the GIS order,
  // at most one forward tensor and one gradient of each size at once, plus evaluation's.
  const po::Shape sh{1, 4, 4};
  const po::Program p = po::build(spec_of(2), sh);
  std::vector<po::StageBytes> bytes(4);
  for (int s = 0; s < 4; ++s) {
    bytes[static_cast<std::size_t>(s)] = {1000, 100, s > 0 ? std::size_t(100 + s - 1) : 0,
                                          s < 3 ? std::size_t(100 + s) : 0};
  }
  const po::Reservation res = po::reservation_plan(p, 0, bytes);
  REQUIRE(res.message.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(res.message[i].bytes == 100 + i);
    CHECK(res.message[i].count >= 1);
  }
  // Across ranks, the sizes each rank sends and receives are planned on that rank.
  const po::Shape sh2{2, 2, 4};
  const po::Program p2 = po::build(spec_of(3), sh2);
  for (int r = 0; r < 2; ++r) {
    const po::Reservation res2 = po::reservation_plan(p2, r, bytes);
    std::size_t total = 0;
    for (const po::BlockCount& b : res2.message) total += b.count;
    CHECK(total >= 3);
  }
  CHECK_THROWS_WITH(po::reservation_plan(p2, 2, bytes), "po::reservation_plan: rank = 2 is outside [0, 1]");
  CHECK_THROWS_WITH(po::reservation_plan(p2, 0, std::vector<po::StageBytes>(3)),
                    "po::reservation_plan: 3 stage sizes given; the program has S = 4 stages");
}

TEST_CASE("memory: po::state_bytes is the runtime's state memory beyond its inputs, losses and flags (both paths)") {
  // A launcher sizes backend::Cuda's arena with it before anything exists (train_gpt does):
  // it must count the exact sums the runtime takes, to the byte (and nothing on the standard
  // path with one replica).
  for (po::Gradients path : {po::Gradients::standard, po::Gradients::exact}) {
    CAPTURE(po::gradients_name(path));
    test::Config c;
    c.spec = po_f();
    c.shape = {2, 2, 4};
    c.h = 32;
    c.steps = 1;
    c.gradients = path;
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    const std::size_t m = static_cast<std::size_t>(c.shape.m), tokens = static_cast<std::size_t>(c.mb.tokens());
    for (int r = 0; r < c.shape.d; ++r) {
      CAPTURE(r);
      std::vector<std::size_t> params;
      bool embeds = false;
      for (int ch = 0; ch < c.shape.v; ++ch) {
        const int s = c.shape.stage_of(r, ch);
        params.push_back(test::TanhLayer(s, c.h, 1).parameters().size());
        embeds = embeds || s == 0;
      }
      const po::StateBytes want = po::state_bytes(params, {.gradients = path});
      CHECK(want.optimizer == 2 * 4 * (params[0] + params[1]));
      CHECK(want.sums == (path == po::Gradients::exact ? 16 * (params[0] + params[1]) : 0));
      // tokens (where stage 0 lives) and targets, int32 per token; a loss per microbatch; a flag
      // per compute op.
      const std::size_t inputs = (embeds ? 2 : 1) * m * tokens * 4, losses = m * 4,
                        flags = run.program.ranks[static_cast<std::size_t>(r)].compute.size() * 4;
      CHECK(run.memory[static_cast<std::size_t>(r)].in(po::backend::Memory::state) ==
            want.sums + want.staging + inputs + losses + flags);
    }
  }
  // The layout: buckets of at most reduce_bucket values, a multiple of dp each, covering them;
  // replica j owns slice j of every bucket.
  const po::GradientLayout l = po::gradient_layout(10, 3, 4);
  CHECK(l.buckets == 3);
  CHECK(l.len == 6);
  CHECK(l.padded() == 18);
  CHECK(l.shards(0) == std::vector<po::ParamRange>{{0, 2}, {6, 8}});
  CHECK(l.shards(2) == std::vector<po::ParamRange>{{4, 6}});
  const std::size_t one[] = {10};
  // dp = 3 adds the staging of the largest bucket: exact 16 * 6 + 16 * 2 + 4 * 2 + 4 * 6 bytes,
  // standard 4 * 6 + 4 * 6 + 4 * 2.
  CHECK(po::state_bytes(one, {.gradients = po::Gradients::exact, .dp = 3, .reduce_bucket = 4}).arena() ==
        288 + 96 + 32 + 8 + 24 + 2 * 4 * 10);
  CHECK(po::state_bytes(one, {.gradients = po::Gradients::standard, .dp = 3, .reduce_bucket = 4}).arena() ==
        24 + 24 + 8 + 2 * 4 * 10);
  // ZeRO-1: replica 0 keeps the moments of its 4 parameters.
  CHECK(po::state_bytes(one, {.dp = 3, .zero = 1, .reduce_bucket = 4}).optimizer == 2 * 4 * 4);
}
