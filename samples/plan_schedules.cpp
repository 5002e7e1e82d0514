// samples/plan_schedules: the paper's schedules for one real model shape, compared and drawn.
//
//   ./build/samples/plan_schedules --out-dir build/schedules
//   ./build/samples/plan_schedules --layers 32 --hidden 4096 --seq 4096 --ranks 8 --microbatches 32
//                                  --tflops 220 --pcie-gbps 15 --out-dir /tmp/schedules
//
// Defaults: the paper's 5.8B model (32 layers, h = 4096) at s = 4096, b = 1, on 8 A100-class
// ranks (220 TFLOP/s achieved, 15 GB/s PCIe per direction), one layer per stage (v = layers/d)
// except 1F1B (v = 1). Per layer: F+B+W = 12bsh(6h+s) FLOPs split evenly, saved activation
// 20bsh bytes (bf16, LayerNorm/GeLU/dropout recomputed), k = 10/(3(6h+s)) * Bc/Bo
// (docs/design.md section 1). Prints a table and writes one SVG per schedule.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/sim/svg.hpp>

#include "cli.hpp"

namespace {

struct Options {
  long layers = 32, hidden = 4096, seq = 4096, micro_batch = 1, ranks = 8, microbatches = 32;
  double tflops = 220, pcie_gbps = 15;
  std::string out_dir = "schedules";
};

constexpr cli::Flag flags[] = {{"--layers"},       {"--hidden"}, {"--seq"},       {"--micro-batch"}, {"--ranks"},
                               {"--microbatches"}, {"--tflops"}, {"--pcie-gbps"}, {"--out-dir"}};

Options parse(int argc, char** argv) {
  cli::help(argc, argv,
            "usage: plan_schedules [--layers L] [--hidden H] [--seq S] [--micro-batch B] [--ranks D]\n"
            "                      [--microbatches M] [--tflops T] [--pcie-gbps P] [--out-dir DIR]\n");
  const cli::Args args(argc, argv, flags);
  Options o;
  const auto integer = [&](std::string_view flag, long& dst, long hi) {
    if (const std::string* v = args.get(flag)) dst = static_cast<long>(cli::to_int(flag, *v, 1, hi));
  };
  integer("--layers", o.layers, 4096);
  integer("--hidden", o.hidden, 1 << 20);
  integer("--seq", o.seq, 1 << 24);
  integer("--micro-batch", o.micro_batch, 1 << 16);
  integer("--ranks", o.ranks, 512);
  integer("--microbatches", o.microbatches, 4096);
  if (const std::string* v = args.get("--tflops")) o.tflops = cli::to_real("--tflops", *v, 0, 1e12, true);
  if (const std::string* v = args.get("--pcie-gbps")) o.pcie_gbps = cli::to_real("--pcie-gbps", *v, 0, 1e12, true);
  if (const std::string* v = args.get("--out-dir")) o.out_dir = *v;
  if (o.layers % o.ranks != 0)
    throw cli::bad_argument("--layers " + std::to_string(o.layers) + " must be a multiple of --ranks " +
                            std::to_string(o.ranks) + " (one or more whole layers per stage)");
  if (o.microbatches % o.ranks != 0)
    throw cli::bad_argument("--microbatches " + std::to_string(o.microbatches) + " must be a multiple of --ranks " +
                            std::to_string(o.ranks) + " (1F1B-I needs it)");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = cli::parsed_or_exit("plan_schedules", [&] { return parse(argc, argv); });
  const double b = static_cast<double>(o.micro_batch), s = static_cast<double>(o.seq),
               h = static_cast<double>(o.hidden);
  const double bc = o.tflops * 1e12, bo = o.pcie_gbps * 1e9;
  const double layer_flops = 12 * b * s * h * (6 * h + s);  // F + B + W of one layer
  const double layer_bytes = 20 * b * s * h;                // saved activation, recompute on
  const double k = 10.0 / (3.0 * (6 * h + s)) * bc / bo;
  const int d = static_cast<int>(o.ranks), m = static_cast<int>(o.microbatches);
  const int v = static_cast<int>(o.layers / o.ranks);

  std::printf(
      "model: %ld layers, h=%ld, s=%ld, b=%ld; %d ranks, %d microbatches; Bc=%.0f TFLOP/s, Bo=%.0f GB/s -> k=%.3f\n",
      o.layers, o.hidden, o.seq, o.micro_batch, d, m, o.tflops, o.pcie_gbps, k);
  std::printf("activation per layer and microbatch: %.3f GiB\n\n", layer_bytes / (1u << 30));
  std::printf("%-8s %3s %3s %14s %14s %10s %12s %10s\n", "schedule", "v", "g", "peak act GiB", "rank-0 units",
              "bubble %", "iteration s", "vs 1F1B");

  struct Row {
    const char* name;
    po::ScheduleSpec spec;
    int v;
  };
  const std::vector<Row> rows = {
      {"1f1b", po::OneF1B::spec, 1}, {"1f1b-i", po::Interleaved1F1B::spec, v},
      {"gis", po::GIS::spec, v},     {"gis-h", po::GIS_H::spec, v},
      {"po", po::PO::spec, v},       {"po-h", po::PO_H::spec, v},
      {"po-f", po::PO_F::spec, v},
  };
  std::filesystem::create_directories(o.out_dir);
  double base_time = 0;
  for (const Row& row : rows) {
    // A stage holds layers/(v*d) layers: its passes and its unit scale with that count.
    const double per_stage = static_cast<double>(o.layers) / (row.v * d);
    po::Costs c;
    c.f = c.b = c.w = per_stage * layer_flops / 3 / bc;
    c.k = k;
    c.unit_bytes.assign(static_cast<std::size_t>(row.v * d), per_stage * layer_bytes);
    const po::Program p = po::build(row.spec, {d, row.v, m}, c);
    po::require_valid(p);
    const po::SimResult sim = po::simulate(p);
    if (base_time == 0) base_time = sim.makespan;
    std::printf("%-8s %3d %3d %14.2f %14.1f %10.2f %12.3f %9.3fx\n", row.name, row.v, p.group,
                sim.max_peak() / (1u << 30), sim.ranks[0].peak / (per_stage * layer_bytes), 100 * sim.bubble_fraction(),
                sim.makespan, base_time / sim.makespan);
    const std::string path = o.out_dir + "/" + row.name + ".svg";
    std::ofstream(path) << po::render_svg(p, sim);
  }
  if (k > 1)
    std::printf("\nk > 1: the copy stream cannot hide every round trip; units that cannot are kept on the device.\n");
  std::printf("\nSVG drawings (open in a browser): %s/*.svg\n", o.out_dir.c_str());
  return 0;
}
