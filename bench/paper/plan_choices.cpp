// bench/paper/plan_choices: what po::plan chooses for the paper's models (its Table 2) now that
// the zero-bubble families (ZB-H1, ZB-H2, ZB-V, V-Half, V-Min, DualPipeV) are searched beside
// the paper's own (1F1B, 1F1B-I, GIS(g), PO with offload), and what it would choose among the
// paper's families alone.
//
//   ./build/bench/paper/plan_choices [--device-gib G]   # A100-class (220 TFLOP/s, 15 GB/s), 80 GiB
//
// One plan() per model and recompute setting; every candidate is built and simulated. The
// output is a Markdown table (bench/RESULTS.md keeps it).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <pipeoffload/plan/plan.hpp>

#include "models.hpp"

namespace {

using namespace pipeoffload;

bool paper_family(Family f) { return f == Family::one_f1b || f == Family::interleaved_1f1b || f == Family::grouped; }

std::string describe(const PlanCandidate& c) {
  if (c.name.empty()) return "nothing fits";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s v=%d off=%d: %.3f s, %.1f GiB", c.name.c_str(), c.chunks, c.offload_chunks,
                c.iteration_time_s, c.max_device_bytes() / gib);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  double device_gib = 80;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device-gib") == 0 && i + 1 < argc) {
      char* end = nullptr;
      device_gib = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(device_gib > 0 && device_gib <= 4096)) {
        std::fprintf(stderr, "plan_choices: --device-gib must be a number in (0, 4096], got '%s'\n", argv[i]);
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: plan_choices [--device-gib G]\n");
      return 2;
    }
  }
  std::printf("| model | d | m | recompute | choice (all families) | best of the paper's families | speed-up |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const paper::PaperModel& pm : paper::models)
    for (bool recompute : {true, false}) {
      const TransformerSpec m = paper::transformer(pm, recompute);
      MachineSpec x;
      x.ranks = pm.gpus;
      x.device_bytes = device_gib * gib;
      const PlanResult r = plan(m, x);
      PlanCandidate paper_best;
      for (const PlanCandidate& c : r.candidates)
        if (c.fits && paper_family(c.spec.family) &&
            (paper_best.name.empty() || c.iteration_time_s < paper_best.iteration_time_s))
          paper_best = c;
      const PlanCandidate chosen = r.fits ? r.choice : PlanCandidate{};
      const double speedup =
          !chosen.name.empty() && !paper_best.name.empty() ? paper_best.iteration_time_s / chosen.iteration_time_s : 0;
      std::printf("| %s | %d | %d | %s | %s | %s | %s |\n", pm.name, pm.gpus, r.microbatches, recompute ? "on" : "off",
                  describe(chosen).c_str(), describe(paper_best).c_str(),
                  speedup > 0 ? (std::to_string(speedup).substr(0, 5) + "x").c_str() : "-");
    }
  return 0;
}
