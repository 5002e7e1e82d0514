// bench/memory_plan.cpp: what each family's ranks reserve under the lowered memory plan, against
// the simulated peak (docs/lowering.md).
//
// For every family at d = 4, 8, 16 (m = 4d, v = 2; v = 1 for 1F1B and ZB-H*), with a GPT
// block's proportions in 256-byte pieces (a unit of 20, a stash of 22, a boundary tensor of 1;
// copy ratio k = 1.28), prints over the ranks the largest ratio of the reserved region
// (po::reservation_plan's device bytes, training's and evaluation's) to the simulated peak
// of units and stashes plus the witnessed boundary tensors, the largest ratio of the region to
// the witness's own peak (the placement's fragmentation), and the most boundary tensors a rank
// holds in training and in evaluation. No timing: the figures are exact for the program.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/runtime.hpp>

namespace po = pipeoffload;

int main() {
  std::printf("%-11s %3s %3s %3s  %-22s %-18s %s\n", "family", "d", "v", "m", "region / (sim + tensors)",
              "region / witness", "tensors: training, evaluation");
  for (const char* name : {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v",
                           "v-half", "v-min", "dualpipe-v"})
    for (int d : {4, 8, 16}) {
      const std::string n = name;
      po::Shape sh{d, 2, 4 * d};
      if (n == "1f1b" || n.rfind("zb-h", 0) == 0) sh.v = 1;
      const std::size_t piece = 256;
      po::Costs c;
      c.unit_bytes.assign(static_cast<std::size_t>(sh.stages()), 20.0 * piece);
      c.stash_bytes.assign(static_cast<std::size_t>(sh.stages()), 22.0 * piece);
      c.k = 1.28;
      const po::Program p = po::build(po::parse_schedule(n, n == "gis-g" ? d / 2 + 1 : 0), sh, c);
      const po::SimResult sim = po::simulate(p, c);
      const std::vector<po::StageBytes> bytes(static_cast<std::size_t>(sh.stages()),
                                              po::StageBytes{20 * piece, 22 * piece, piece, piece});
      const std::vector<po::LoweredRank> train = po::lower_all(p, bytes),
                                         eval = po::lower_all(po::forward_only(p), bytes);
      double worst = 0, frag = 0;
      std::size_t tensors = 0, eval_tensors = 0;
      for (int r = 0; r < d; ++r) {
        const auto u = static_cast<std::size_t>(r);
        const double region = static_cast<double>(std::max(train[u].region, eval[u].region));
        worst = std::max(worst, region / (sim.ranks[u].peak + static_cast<double>(train[u].peak[2])));
        frag = std::max(frag, static_cast<double>(train[u].region) / static_cast<double>(train[u].peak_total));
        tensors = std::max(tensors, train[u].peak[2] / piece);
        eval_tensors = std::max(eval_tensors, eval[u].peak[2] / piece);
      }
      std::printf("%-11s %3d %3d %3d  %-24.3f %-18.3f %zu, %zu\n", name, sh.d, sh.v, sh.m, worst, frag, tensors,
                  eval_tensors);
    }
  return 0;
}
