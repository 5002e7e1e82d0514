// bench/paper/plan_choices: what po::plan chooses for the paper's models (its Table 2) now that
// the zero-bubble families (ZB-H1, ZB-H2, ZB-V, V-Half, V-Min, DualPipeV) are searched beside
// the paper's own (1F1B, 1F1B-I, GIS(g), PO with offload), and what it would choose among the
// paper's families alone.
//
//   ./build/bench/paper/plan_choices [--device-gib G]   # A100-class (220 TFLOP/s, 15 GB/s), 80 GiB
//
// One plan() per model and recompute setting; every candidate is built and simulated, and the
// choices are lowered (their memory plans: what the runtime reserves). Then the fastest plan on
// each of the planner's two cuts of the model into stages (the paper's slot cut, the even one),
// and a Llama-3-70B-class model on 64 and 128 GPUs with the data-parallel degree searched. The
// output is Markdown tables (bench/RESULTS.md keeps them).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <pipeoffload/plan/plan.hpp>
#include <pipeoffload/plan/presets.hpp>

#include "../../samples/cli.hpp"
#include "models.hpp"

namespace {

using namespace pipeoffload;

bool paper_family(Family f) { return f == Family::one_f1b || f == Family::interleaved_1f1b || f == Family::grouped; }

std::string describe(const PlanCandidate& c) {
  if (c.name.empty()) return "nothing fits";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s v=%d off=%d%s: %.3f s, %.1f GiB", c.name.c_str(), c.chunks, c.offload_chunks,
                c.cut == StageCut::even ? " even" : "", c.iteration_time_s, c.max_device_bytes() / gib);
  return buf;
}

/// The fastest of r's candidates that `keep` selects whose lowered memory plan fits (lowered
/// as they come, fastest first), or an empty candidate.
template <class Keep>
PlanCandidate fastest_fitting(const PlanResult& r, const TransformerSpec& m, const MachineSpec& x, Keep keep) {
  std::vector<PlanCandidate> all;
  for (const PlanCandidate& c : r.candidates)
    if (c.fits && keep(c)) all.push_back(c);
  std::sort(all.begin(), all.end(),
            [](const PlanCandidate& a, const PlanCandidate& b) { return a.iteration_time_s < b.iteration_time_s; });
  Program scratch;
  for (PlanCandidate& c : all) {
    if (!c.lowered)
      lower_candidate(c, detail::make_layout(m, x, {}, c.chunks, {}, c.spec.placement, c.cut), m, x, scratch);
    if (c.fits) return c;
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  double device_gib = 80;
  cli::parsed_or_exit("plan_choices", [&] {
    cli::help(argc, argv, "usage: plan_choices [--device-gib G]\n");
    constexpr cli::Flag flags[] = {{"--device-gib"}};
    const cli::Args args(argc, argv, flags);
    if (const std::string* v = args.get("--device-gib")) device_gib = cli::to_real("--device-gib", *v, 0, 4096, true);
  });
  // Every paper model, recompute on and off, planned once for both tables.
  struct Planned {
    const paper::PaperModel* pm;
    bool recompute;
    TransformerSpec m;
    MachineSpec x;
    PlanResult r;
  };
  std::vector<Planned> planned;
  for (const paper::PaperModel& pm : paper::models)
    for (bool recompute : {true, false}) {
      Planned p{&pm, recompute, paper::transformer(pm, recompute), {}, {}};
      p.x.ranks = pm.gpus;
      p.x.device_bytes = device_gib * gib;
      p.r = plan(p.m, p.x);
      planned.push_back(std::move(p));
    }
  const auto ratio = [](const PlanCandidate& num, const PlanCandidate& den) {
    return !num.name.empty() && !den.name.empty()
               ? std::to_string(num.iteration_time_s / den.iteration_time_s).substr(0, 5) + "x"
               : std::string("-");
  };
  std::printf("| model | d | m | recompute | choice (all families) | best of the paper's families | speed-up |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Planned& p : planned) {
    // The fastest of the paper's families whose lowered memory plan fits.
    const PlanCandidate paper_best =
        fastest_fitting(p.r, p.m, p.x, [](const PlanCandidate& c) { return paper_family(c.spec.family); });
    const PlanCandidate chosen = p.r.fits ? p.r.choice : PlanCandidate{};
    std::printf("| %s | %d | %d | %s | %s | %s | %s |\n", p.pm->name, p.pm->gpus, p.r.microbatches,
                p.recompute ? "on" : "off", describe(chosen).c_str(), describe(paper_best).c_str(),
                ratio(paper_best, chosen).c_str());
  }
  // The two cuts: the fastest plan (all families) on each, where the even cut exists (a layer
  // for every stage of some v).
  std::printf("\n| model | d | recompute | fastest on the slot cut | fastest on the even cut | slot vs even |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Planned& p : planned) {
    const PlanCandidate a = fastest_fitting(p.r, p.m, p.x,
                                            [](const PlanCandidate& c) { return c.cut == StageCut::slots; }),
                        b = fastest_fitting(p.r, p.m, p.x,
                                            [](const PlanCandidate& c) { return c.cut == StageCut::even; });
    std::printf("| %s | %d | %s | %s | %s | %s |\n", p.pm->name, p.pm->gpus, p.recompute ? "on" : "off",
                describe(a).c_str(), describe(b).c_str(), ratio(b, a).c_str());
  }
  // A Llama-3-70B-class model on 64 and 128 GPUs of 80 GiB: the planner searches dp (ZeRO-1).
  std::printf("\n| model | GPUs | dp x d | m | choice | worst rank |\n|---|---|---|---|---|---|\n");
  for (const int gpus : {64, 128}) {
    const TransformerSpec m = find_model_preset("llama3-70b")->model;
    MachineSpec x;
    x.device_bytes = device_gib * gib;
    const PlanResult r = plan(m, x, {}, {.dp = 0, .zero = 1, .gpus = gpus});
    std::printf("| llama3-70b | %d | %d x %d | %d | %s | %s |\n", gpus, r.dp, r.ranks, r.microbatches,
                describe(r.fits ? r.choice : PlanCandidate{}).c_str(), r.fits ? "fits" : r.why.c_str());
  }
  return 0;
}
