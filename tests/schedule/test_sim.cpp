// simulate(): ASAP execution under the cost model; bubble, makespan and memory timeline.
#include <doctest/doctest.h>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

TEST_CASE("memory intervals are half-open: a release at t counts before an acquisition at t") {
  const Program p = OneF1B::build({1, 1, 2});  // F0 [0,1) BW0 [1,3) F1 [3,4) BW1 [4,6)
  const SimResult s = simulate(p);
  CHECK(s.makespan == 6);
  CHECK(s.ranks[0].peak == 1);
  CHECK(s.ranks[0].memory.back().alive == 0);
  CHECK(s.ranks[0].bubble == 0);
}

TEST_CASE("P2P latency: a message arrives T_comm after its producer ends") {
  Costs c;
  c.comm = 0.5;
  // d=2, m=1: F on rank 0 [0,1), F on rank 1 [1.5,2.5), BW on rank 1 [2.5,4.5), BW on rank 0 [5,7).
  const SimResult s = simulate(OneF1B::build({2, 1, 1}, c));
  CHECK(s.ranks[1].compute_start[0] == 1.5);
  CHECK(s.ranks[0].compute_start[1] == 5);
  CHECK(s.makespan == 7);
  // Latency never shortens a schedule, and one rank has no hops.
  CHECK(simulate(OneF1B::build({4, 1, 8}, c)).makespan > simulate(OneF1B::build({4, 1, 8})).makespan);
  CHECK(simulate(PO::build({1, 4, 8}, c)).makespan == simulate(PO::build({1, 4, 8})).makespan);
}

TEST_CASE("per-stage costs: a rank's busy time is the sum of its stages' F, B and W over microbatches") {
  Costs c;
  c.stage_f = {1, 2, 3, 4};
  c.stage_b = {2, 2, 2, 2};
  c.stage_w = {1, 1, 1, 1};
  const SimResult s = simulate(PO::build({2, 2, 5}, c));
  CHECK(s.ranks[0].busy == doctest::Approx(5 * ((1 + 2 + 1) + (3 + 2 + 1))));
  CHECK(s.ranks[1].busy == doctest::Approx(5 * ((2 + 2 + 1) + (4 + 2 + 1))));
  CHECK(s.ranks[0].bubble == doctest::Approx(s.makespan - s.ranks[0].busy));
}

TEST_CASE("simulate under other costs keeps the orders and rescales time") {
  const Program p = GIS::build({4, 2, 8});
  Costs twice;
  twice.f = twice.b = twice.w = 2;
  CHECK(simulate(p, twice).makespan == 2 * simulate(p).makespan);
  CHECK(simulate(p).bubble_fraction() == doctest::Approx(6.0 / 54.0));
}

TEST_CASE("PO-F costs little more than PO at k = 1 under unit costs (d=8, v=4, m=32)") {
  const double po = simulate(PO::build({8, 4, 32})).makespan;
  const double pof = simulate(PO_F::build({8, 4, 32})).makespan;
  CHECK(pof >= po);
  CHECK(pof <= po * 1.05);
}

TEST_CASE(
    "measured_costs: a simulated run's trace gives back the costs it ran by; BW splits evenly; bad traces named") {
  // Per-stage F, B, W and a copy ratio: the simulation is a perfect measurement of them.
  Costs c;
  c.k = 1.75;
  for (int s = 0; s < 8; ++s) {
    c.stage_f.push_back(1.0 + 0.25 * s);
    c.stage_b.push_back(2.0 + 0.5 * s);
    c.stage_w.push_back(1.5 + 0.125 * s);
  }
  const Program po_f = build({Family::grouped, {GroupSpec::Kind::uniform, 1}, offload::all}, {4, 2, 8}, c);
  const SimResult sim = simulate(po_f);
  const Costs got = measured_costs(po_f, sim.ranks, Costs{});
  CHECK(got.stage_f == c.stage_f);
  CHECK(got.stage_b == c.stage_b);
  CHECK(got.stage_w == c.stage_w);
  CHECK(got.k == doctest::Approx(c.k).epsilon(1e-12));
  // Fused BW (1F1B): its time split evenly between B and W; nothing offloaded keeps base's k.
  Costs base;
  base.k = 3;
  const Program one = OneF1B::build({4, 1, 8});
  const Costs fused = measured_costs(one, simulate(one).ranks, base);
  for (int s = 0; s < 4; ++s) {
    CHECK(fused.stage_f[static_cast<std::size_t>(s)] == 1);
    CHECK(fused.stage_b[static_cast<std::size_t>(s)] == 1);  // BW takes T_B + T_W = 2
    CHECK(fused.stage_w[static_cast<std::size_t>(s)] == 1);
  }
  CHECK(fused.k == 3);
  // A trace that is not the program's.
  std::vector<RankSim> short_one = sim.ranks;
  short_one[2].copy_end.pop_back();
  CHECK_THROWS_WITH(measured_costs(po_f, short_one, Costs{}), doctest::Contains("rank 2's trace has"));
  CHECK_THROWS_WITH(measured_costs(po_f, std::span(sim.ranks).first(3), Costs{}),
                    "po::measured_costs: 3 traces for 4 ranks");
}
