// Compile-time properties: schedules built, validated and simulated in constant expressions.
// If any of these breaks, this file does not compile.
#include <doctest/doctest.h>

#include <pipeoffload/pipeoffload.hpp>

namespace {

// Policies compose in any order, one per slot, with GIS and no offload as defaults.
static_assert(po::Schedule<>::spec == po::GIS::spec);
static_assert(po::Schedule<po::OffloadPolicy<po::offload::all>, po::UniformRepeat>::spec == po::PO_F::spec);
static_assert(po::Schedule<po::UniformRepeat, po::OffloadPolicy<po::offload::all>>::spec == po::PO_F::spec);
static_assert(po::GIS_G<3>::spec.group == po::GroupSpec{po::GroupSpec::Kind::number, 3});
static_assert(po::OffloadPolicy<po::offload::chunks({0, 2})>::selection.mask == 0b101);

// The issue's own examples.
static_assert(po::validate(po::PO_F::build({8, 4, 32})));
static_assert(po::peak(po::PO_F::build({8, 4, 32}), 0) <= 6);
static_assert(po::validate(po::Interleaved1F1B::build({4, 2, 8})));

// docs/design.md section 2's worked example (d=4, v=2, m=8): per-rank peaks in units.
static_assert(po::peak(po::PO::build({4, 2, 8}), 0) == 7);
static_assert(po::peak(po::GIS_H::build({4, 2, 8}), 0) == 6);
static_assert(po::peak(po::GIS::build({4, 2, 8}), 0) == 8);
static_assert(po::peak(po::Interleaved1F1B::build({4, 2, 8}), 0) == 11);
static_assert(po::peak(po::GIS::build({4, 2, 8}), 3) == 5);

// GIS(g): rank 0 peaks at g(v-1)+d; GIS(g) costs (d-g)(v-1) more than GIS under unit costs.
static_assert(po::peak(po::GIS_G<3>::build({6, 3, 6}), 0) == 3 * 2 + 6);
static_assert(po::simulate(po::GIS_G<3>::build({6, 3, 6})).makespan -
                  po::simulate(po::GIS::build({6, 3, 6})).makespan ==
              (6 - 3) * (3 - 1));

// 1F1B: rank i holds min(d-i, m) units; the bubble is (d-1)(T_F+T_B+T_W).
static_assert(po::peak(po::OneF1B::build({4, 1, 8}), 1) == 3);
static_assert(po::simulate(po::OneF1B::build({4, 1, 8})).makespan == 3 * 8 + 3 * 3);

// A schedule type usable with a user's own memory budget.
template <class Sched>
constexpr bool fits(po::Shape s, double budget_units) {
  const po::Program p = Sched::build(s);
  for (int r = 0; r < s.d; ++r)
    if (po::peak(p, r) > budget_units) return false;
  return true;
}
static_assert(fits<po::PO_H>({4, 4, 16}, 8));
static_assert(!fits<po::GIS>({4, 4, 16}, 8));

}  // namespace

TEST_CASE("compile-time schedule properties hold (this file compiled)") { CHECK(true); }
