// tools/pipeoffload-plan.cpp: build a schedule, simulate it, and print or draw it; or (--auto)
// plan which schedule fits a model on a machine. docs/planner.md walks through it; --help lists
// every option.
//
//   ./build/pipeoffload-plan --schedule po-h --ranks 4 --chunks 2 --microbatches 8
//   ./build/pipeoffload-plan --schedule po-f --ranks 8 --chunks 4 --microbatches 32 --format svg --out po-f.svg
//   ./build/pipeoffload-plan --import zb-v.csv --offload-chunks 1     (torch.distributed.pipelining's CSV)
//   ./build/pipeoffload-plan --auto --model paper-42.9b --ranks 32 --device-mem-gib 80 --host-mem-gib 512
//       --tflops 220 --pcie-gbps 15 --recompute
//
// Exit status: 0 done; 2 a bad argument or --import file (one line naming it and what is
// allowed); 3 (--auto) nothing fits (the closest plan printed, the shortfall on stderr); 1 an
// internal failure. The output formats: pipeoffload/sim/render.hpp and sim/svg.hpp.
#include <pipeoffload/pipeoffload.hpp>
#include <pipeoffload/plan/presets.hpp>
#include <pipeoffload/plan/report.hpp>
#include <pipeoffload/sim/render.hpp>
#include <pipeoffload/sim/svg.hpp>

#include "../samples/cli.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr const char* usage_text =
    R"(usage: pipeoffload-plan --schedule NAME --ranks D --chunks V --microbatches M [options]

usage: pipeoffload-plan --import FILE [--ranks D] [--chunks V] [--microbatches M] [options]

Builds a pipeline schedule, simulates it (as-soon-as-possible execution) and prints it.

  --schedule NAME       1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, zb-h1, zb-h2, zb-v,
                        v-half, v-min, dualpipe-v (--microbatches >= 2D)
  --import FILE         instead of --schedule: a schedule in torch.distributed.pipelining's
                        CSV form (one row per rank; {stage}F{mb}, I, W or fused B; SEND_F,
                        RECV_F, SEND_B, RECV_B cells are accepted and the P2P order re-planned).
                        D, V, M and the placement (interleaved or V) are inferred; --ranks,
                        --chunks, --microbatches, if given, must agree. --offload-chunks N adds
                        offload of chunks 0..N-1. A bad file exits 2 naming its row and cell.
  --ranks D             pipeline ranks, 1..4096
  --chunks V            chunks (stages) per rank, 1..256; 1 for 1f1b
  --microbatches M      microbatches per iteration, 1..65536; a multiple of D for 1f1b-i
  --group G             group size of gis-g (required there, nowhere else), ceil(D/2)..D
  --offload-chunks N    offload the activations of chunks 0..N-1, 0..V (po-h and po-f
                        imply ceil(V/2) and V)
  --k K                 round-trip copy time / (T_F + T_B + T_W); default 1
  --hidden H --seq S --micro-batch B --tflops X --pcie-gbps Y
                        k from hardware instead of --k (all five together):
                        k = 10 / (3 (6H + S)) * (X * 1e12 FLOP/s) / (Y * 1e9 B/s)
  --cost-f T --cost-b T --cost-w T
                        time of one forward, activation-gradient and weight-gradient pass
                        of one stage for one microbatch, > 0; default 1
  --cost-comm T         time of one P2P hop between ranks, >= 0; default 0
  --copy-streams N      1 (default): offloads and reloads take turns on one copy stream; 2: each on
                        a stream of its own (ranks without a PCIe partner may copy both ways at once)
  --duplex-slowdown X   with --copy-streams 2: a copy's time while the other direction copies
                        too, over its time alone, [1, 100]; default 1
  --pcie-switch pairs|none
                        ranks r and r^1 share a PCIe switch and stagger their copy slots
                        (default pairs), or each rank has its link to itself
  --format FMT          text (default), csv, json, chrome-trace, svg, torch-csv (torch's
                        schedule CSV: compute actions only), torch-csv-lowered (with its
                        SEND/RECV actions); offload ops have no torch action and are left out
  --out FILE            write to FILE instead of standard output
  --help                print this and exit


usage: pipeoffload-plan --auto (--model NAME | --layers L --hidden H --heads A --query-groups G
         --seq S --micro-batch B --global-batch N --vocab V) --ranks D --device-mem-gib X
         --host-mem-gib Y --tflops T --pcie-gbps P [--recompute] [--format text|json]
         [--dp R | --search-dp --gpus GPUS] [--zero 0|1] [--dp-gbps X] [--gpus-per-node G]
         [--node-layout contiguous|balanced] [--schedule NAME] [--copy-streams 1|2|auto]

Plans: builds and simulates 1f1b, 1f1b-i, gis, gis(g) for every legal g, and po with 0..v
chunks offloaded for every v up to (L+2)/D, and prints the fastest whose every rank fits in
device and host memory (model state as the runtime holds it: bf16 parameters, fp32
gradients, AdamW and its fp32 master, 18 bytes per parameter; peak saved activations and
B-to-W stashes; workspace), with a command line that draws it.

  --model NAME                 a preset shape, its values overridden by any model flag given:
                               paper-5.8b, paper-10.5b, paper-18.1b, paper-42.9b,
                               paper-66.6b, paper-83.8b (the paper's Table 2), llama3-8b,
                               llama3-70b (plan/presets.hpp)
  --heads A --query-groups G   attention heads and key/value groups (G = A: multi-head)
  --global-batch N             sequences per iteration; microbatches m = N / B
  --device-mem-gib X           memory of one device, GiB
  --host-mem-gib Y             pinned host memory one rank may use, GiB (>= 0); on CUDA it
                               holds backend::Cuda's own staging too (about 8 MiB)
  --tflops T                   achieved TFLOP/s of one device (Bc)
  --pcie-gbps P                host<->device GB/s of one device in one direction (Bo), > 0
  --recompute                  recompute LayerNorm, GeLU and dropout (34bsh -> 20bsh per layer)
  --pcie-switch pairs|none     ranks r and r^1 share a PCIe switch (default pairs)
  --copy-streams 1|2|auto      copy streams a rank offloads and reloads on (default 1); auto plans
                               each candidate that offloads on one and on two and keeps the
                               faster, two only where ranks have no PCIe partner (--ranks 1 or
                               --pcie-switch none); 2 needs one of those
  --duplex-slowdown X          with --copy-streams 2 or auto: a copy's time while the other
                               direction copies too, over its time alone, [1, 100]; default 1
  --ffn-hidden F               the MLP's inner width (default 4 x --hidden)
  --swiglu                     Llama-class layers: a SwiGLU MLP (three h x F matrices), RMSNorm,
                               no biases, no dropout, no position table
  --tied-embeddings            the LM head's weight is the token embedding: one parameter on the
                               first and last stage, its optimizer state held once
  --packed                     each sequence packs several documents (train_gpt --pack): the
                               stages read the rows' document offsets and on cuda hold the
                               documents' table; times stay the unpacked rows'
  --gradients standard|exact   the runtime's gradient path (default standard); exact adds its
                               128-bit sums, 16 bytes per parameter, and sends them
  --schedule NAME              only that family's candidates (1f1b, ..., dualpipe-v), for
                               every v, offload and cut it has
  --backend cuda|cpu           whose memory is counted (default cuda): the CUDA GPT's (bf16, a
                               reserve for the CUDA context); cpu: train_gpt's CPU GPT, or its
                               Llama with --swiglu (fp32, what train_gpt --backend cpu prints as
                               reserved_bytes_per_rank)

Data parallelism: dp replicas of the D-rank pipeline, D*dp GPUs; pipeline rank r of replica
j is global rank j*D + r. Each replica runs m = N / (dp * B) microbatches; each stage's
gradients are all-reduced across its replicas after its last W, overlapping the cooldown.
  --dp R                       replicas, 1..65536 (default 1); R must divide N / B;
                               0 searches dp (needs --gpus, not --ranks)
  --search-dp                  the same as --dp 0
  --gpus GPUS                  GPUs in all: with --dp 0 the planner tries every dp dividing
                               GPUS (D = GPUS / dp); otherwise it must be R * D
  --zero 0|1                   ZeRO stage (default 0); 1 shards the optimizer's state and fp32
                               master (12 of the 18 bytes per parameter) over dp
  --dp-gbps X                  reduction bandwidth in GB/s (default 100): a stage of P
                               parameters reduces in (R-1)/R * 8P bytes / X (6P with --zero 1;
                               24P or 20P with --gradients exact), as the runtime sends them
  --reduce-dtype fp32|bf16     the standard path's reduce-scatter type (default fp32); bf16
                               sends 2P of those bytes instead of 4P
  --gpus-per-node G            GPUs per node (default 8): nodes hold G consecutive global ranks
  --node-layout contiguous|balanced
                               balanced (D a multiple of an even G): node k of a pipeline holds
                               its rank blocks k and 2K-1-k of G/2 ranks (K = D/G), to even out
                               host memory; the report gives host memory per node for both

Options take their value as the next argument or after '=' (--ranks=4).
Exit status: 0 done, 2 bad argument, 3 nothing fits (--auto), 1 internal error.
)";

constexpr const char* tool = "pipeoffload-plan";

using cli::bad_argument;
using cli::quote;

constexpr cli::Flag flags[] = {{"--schedule"},
                               {"--import"},
                               {"--ranks"},
                               {"--chunks"},
                               {"--microbatches"},
                               {"--group"},
                               {"--offload-chunks"},
                               {"--k"},
                               {"--hidden"},
                               {"--seq"},
                               {"--micro-batch"},
                               {"--tflops"},
                               {"--pcie-gbps"},
                               {"--cost-f"},
                               {"--cost-b"},
                               {"--cost-w"},
                               {"--cost-comm"},
                               {"--copy-streams"},
                               {"--duplex-slowdown"},
                               {"--format"},
                               {"--out"},
                               // --auto
                               {"--auto", false},
                               {"--recompute", false},
                               {"--layers"},
                               {"--heads"},
                               {"--query-groups"},
                               {"--global-batch"},
                               {"--vocab"},
                               {"--device-mem-gib"},
                               {"--host-mem-gib"},
                               {"--pcie-switch"},
                               {"--gradients"},
                               {"--ffn-hidden"},
                               {"--swiglu", false},
                               {"--model"},
                               {"--backend"},
                               {"--tied-embeddings", false},
                               {"--packed", false},
                               // --auto, data parallelism
                               {"--dp"},
                               {"--search-dp", false},
                               {"--gpus"},
                               {"--zero"},
                               {"--dp-gbps"},
                               {"--gpus-per-node"},
                               {"--node-layout"},
                               {"--reduce-dtype"}};
/// The data-parallel flags (any of them shows the grid in the report).
constexpr std::string_view grid_flags[] = {"--dp",      "--search-dp",     "--gpus",        "--zero",
                                           "--dp-gbps", "--gpus-per-node", "--node-layout", "--reduce-dtype"};
/// Flags only --auto reads, and flags --auto does not take.
constexpr std::string_view auto_only[] = {
    "--recompute",      "--layers",        "--heads",       "--query-groups",    "--global-batch", "--vocab",
    "--device-mem-gib", "--host-mem-gib",  "--dp",          "--search-dp",       "--gpus",         "--zero",
    "--dp-gbps",        "--gpus-per-node", "--node-layout", "--gradients",       "--ffn-hidden",   "--swiglu",
    "--reduce-dtype",   "--model",         "--backend",     "--tied-embeddings", "--packed"};
constexpr std::string_view not_auto[] = {"--import", "--chunks", "--microbatches", "--group",  "--offload-chunks",
                                         "--k",      "--cost-f", "--cost-b",       "--cost-w", "--cost-comm"};
constexpr std::string_view hardware_flags[] = {"--hidden", "--seq", "--micro-batch", "--tflops", "--pcie-gbps"};
constexpr std::string_view formats[] = {"text", "csv", "json", "chrome-trace", "svg", "torch-csv", "torch-csv-lowered"};

std::string num(long long x) { return std::to_string(x); }

template <std::size_t N>
std::string join(const std::string_view (&list)[N], const char* sep = ", ") {
  std::string s;
  for (std::size_t i = 0; i < N; ++i) s += (i ? sep : "") + std::string(list[i]);
  return s;
}

using cli::Args;

/// --pcie-switch pairs (the default) or none: whether ranks r and r^1 share a PCIe switch.
bool pcie_pairs(const Args& args) {
  const std::string* sw = args.get("--pcie-switch");
  if (sw && *sw != "pairs" && *sw != "none")
    throw bad_argument("--pcie-switch must be pairs or none, got " + quote(*sw));
  return !sw || *sw == "pairs";
}

/// A required integer flag.
int required_int(const Args& args, std::string_view flag, const char* what, long long lo, long long hi) {
  const std::string* v = args.get(flag);
  if (!v)
    throw bad_argument("missing " + std::string(flag) + " (" + what + ", an integer in [" + num(lo) + ", " + num(hi) +
                       "])");
  return static_cast<int>(cli::to_int(flag, *v, lo, hi));
}

/// What the command line asks for.
struct Request {
  pipeoffload::ScheduleSpec spec;
  pipeoffload::Shape shape;
  pipeoffload::Costs costs;
  std::string format = "text";
  std::optional<std::string> out;               ///< --out, or standard output
  std::optional<std::string> import;            ///< --import: the torch CSV file instead of --schedule
  pipeoffload::TorchCsvOptions import_options;  ///< dims given with --import (0: inferred)
  int import_offload = 0;                       ///< --offload-chunks with --import
};

/// --group and --offload-chunks applied to the spec --schedule `name` names, checked against the shape.
pipeoffload::ScheduleSpec schedule_spec(const Args& args, const std::string& name, pipeoffload::ScheduleSpec spec,
                                        const pipeoffload::Shape& sh) {
  using namespace pipeoffload;
  if (name == "1f1b" && sh.v != 1)
    throw bad_argument("--chunks must be 1 with --schedule 1f1b (one stage per rank), got " + quote(num(sh.v)));
  if (name == "1f1b-i" && sh.m % sh.d != 0)
    throw bad_argument("--microbatches must be a multiple of --ranks (" + num(sh.d) + ") with --schedule 1f1b-i, got " +
                       quote(num(sh.m)));
  spec = cli::with_group(spec, name, args.get("--group"), sh.d);

  if (const std::string* n = args.get("--offload-chunks")) {
    const int x = static_cast<int>(cli::to_int("--offload-chunks", *n, 0, sh.v, " (at most --chunks)"));
    if (name == "po-h" || name == "po-f") {
      const int implied = offload::count(spec.offload, sh.v);
      if (x != implied)
        throw bad_argument("--offload-chunks must be " + num(implied) + " with --schedule " + name + " (chunks 0.." +
                           num(implied - 1) + "), got " + quote(*n) +
                           "; use po with --offload-chunks for other counts");
    } else if (x > 0) {
      spec.offload = offload::first(x);  // 0 keeps offload::none, so the name stays plain
    }
  }
  return spec;
}

/// k from --k, from the five hardware flags, or 1.
double copy_ratio(const Args& args) {
  std::vector<std::string> given, missing;
  for (std::string_view f : hardware_flags) (args.get(f) ? given : missing).push_back(std::string(f));
  const std::string* k = args.get("--k");
  if (k && !given.empty())
    throw bad_argument("--k cannot be combined with " + given.front() + ": give either --k or all of " +
                       join(hardware_flags, " "));
  if (k) return cli::to_real("--k", *k, 0, 1e6, true);
  if (given.empty()) return 1;
  if (!missing.empty()) {
    std::string m;
    for (const auto& f : missing) m += (m.empty() ? "" : ", ") + f;
    throw bad_argument("missing " + m + ": k from hardware needs all of " + join(hardware_flags, " "));
  }
  const double h = static_cast<double>(cli::to_int("--hidden", *args.get("--hidden"), 1, 1 << 20));
  const double s = static_cast<double>(cli::to_int("--seq", *args.get("--seq"), 1, 1 << 24));
  cli::to_int("--micro-batch", *args.get("--micro-batch"), 1, 1 << 16);  // b cancels out of k, but must be sane
  const double tflops = cli::to_real("--tflops", *args.get("--tflops"), 0, 1e6, true);
  const double gbps = cli::to_real("--pcie-gbps", *args.get("--pcie-gbps"), 0, 1e6, true);
  // k = 2*A*Bc / (12*b*s*h*(6h+s)*Bo) with A = 20*b*s*h bytes (bf16, selective recompute).
  return 10.0 / (3.0 * (6.0 * h + s)) * (tflops * 1e12) / (gbps * 1e9);
}

/// The whole command line, checked; throws bad_argument at the first problem.
Request interpret(const Args& args) {
  Request rq;
  for (std::string_view f : auto_only)
    if (args.get(f)) throw bad_argument(std::string(f) + " applies only with --auto (the planner)");
  const std::string* name = args.get("--schedule");
  if (const std::string* file = args.get("--import")) {
    if (name) throw bad_argument("--import and --schedule cannot be combined: the file is the schedule");
    if (args.get("--group")) throw bad_argument("--group applies only to --schedule gis-g, not --import");
    if (file->empty()) throw bad_argument("--import needs a file name, got ''");
    rq.import = *file;
    const auto optional_int = [&](std::string_view flag, int hi) {
      const std::string* v = args.get(flag);
      return v ? static_cast<int>(cli::to_int(flag, *v, 1, hi)) : 0;
    };
    rq.import_options.d = optional_int("--ranks", pipeoffload::max_ranks);
    rq.import_options.v = optional_int("--chunks", pipeoffload::max_chunks);
    rq.import_options.m = optional_int("--microbatches", pipeoffload::max_microbatches);
    if (const std::string* n = args.get("--offload-chunks"))
      rq.import_offload = static_cast<int>(cli::to_int("--offload-chunks", *n, 0, pipeoffload::max_chunks));
  } else {
    if (!name) throw bad_argument("missing --schedule (one of " + pipeoffload::schedule_names() + ")");
    const pipeoffload::ScheduleSpec named = cli::schedule(*name);
    rq.shape.d = required_int(args, "--ranks", "pipeline ranks", 1, pipeoffload::max_ranks);
    rq.shape.v = required_int(args, "--chunks", "chunks per rank", 1, pipeoffload::max_chunks);
    rq.shape.m = required_int(args, "--microbatches", "microbatches", 1, pipeoffload::max_microbatches);
    rq.spec = schedule_spec(args, *name, named, rq.shape);
  }
  // Bounds the tool's time and memory (about 3 ops per unit; seconds, not minutes).
  constexpr long long max_units = 1 << 20;
  const long long units = 1LL * rq.shape.d * rq.shape.v * rq.shape.m;
  if (units > max_units)
    throw bad_argument("--ranks * --chunks * --microbatches = " + num(units) + " is too large; at most " +
                       num(max_units) + " stage-microbatch pairs");

  rq.costs.k = copy_ratio(args);
  const auto cost = [&](std::string_view flag, double& dst, bool zero_ok) {
    if (const std::string* v = args.get(flag)) dst = cli::to_real(flag, *v, 0, 1e9, !zero_ok);
  };
  cost("--cost-f", rq.costs.f, false);
  cost("--cost-b", rq.costs.b, false);
  cost("--cost-w", rq.costs.w, false);
  cost("--cost-comm", rq.costs.comm, true);
  const cli::CopyStreams streams = cli::copy_streams(args, false);
  rq.costs.copy_streams = streams.streams;
  rq.costs.duplex_slowdown = streams.slowdown;
  rq.costs.stagger_pairs = pcie_pairs(args);

  if (const std::string* f = args.get("--format")) {
    bool known = false;
    for (std::string_view s : formats) known = known || s == *f;
    if (!known) throw bad_argument("--format must be one of " + join(formats) + ", got " + quote(*f));
    rq.format = *f;
  }
  if (const std::string* out = args.get("--out")) {
    if (out->empty()) throw bad_argument("--out needs a file name, got ''");
    rq.out = *out;
  }
  return rq;
}

/// build() places copies on a grid of slots one copy long, indexed from the run's length over
/// the copy time, with a tolerance of 1e-9 of that length. A k so small that a run spans
/// tens of millions of slots, or a run longer than 1e8 of its shortest passes, is outside what
/// that planner handles (memory, slot indices), so both are refused here with a reason.
void check_copy_plan(const Request& rq, bool k_from_hardware, double plain_makespan = -1) {
  using namespace pipeoffload;
  if (offload::count(rq.spec.offload, rq.shape.v) == 0) return;
  ScheduleSpec plain = rq.spec;
  plain.offload = offload::none;
  const Costs& c = rq.costs;
  const double pass = std::min({c.f, c.b, c.w}), mean = (c.f + c.b + c.w) / 3;
  // PO plans on its grid, somewhat longer than the ASAP run; 4x covers it with room to spare.
  const double span = 4 * std::max(plain_makespan >= 0 ? plain_makespan : simulate(build(plain, rq.shape, c)).makespan,
                                   (3.0 * rq.shape.v * rq.shape.m + 6.0 * rq.shape.stages()) * mean);
  constexpr double max_slots = 2e7, max_passes = 1e8;
  if (span / c.T_O(0) > max_slots) {
    char got[32], lo[32];
    std::snprintf(got, sizeof got, "%.3g", c.k);
    std::snprintf(lo, sizeof lo, "%.3g", c.k * span / c.T_O(0) / max_slots);
    throw bad_argument(std::string(k_from_hardware ? "k from --tflops / --pcie-gbps" : "--k") + " = " + got +
                       " is too small to plan offload for this run (over 2e7 copy slots); k must be >= " + lo);
  }
  if (span / pass > max_passes)
    throw bad_argument(
        "--cost-f/--cost-b/--cost-w/--cost-comm span too wide a range to plan offload: the run is over 1e8 of its shortest passes");
}

std::string render(const std::string& format, const pipeoffload::Program& p, const pipeoffload::SimResult& sim) {
  if (format == "csv") return pipeoffload::render_csv(p, sim);
  if (format == "json") return pipeoffload::render_json(p, sim);
  if (format == "chrome-trace") return pipeoffload::render_chrome_trace(p, sim);
  if (format == "svg") return pipeoffload::render_svg(p, sim);
  if (format == "torch-csv") return pipeoffload::to_torch_csv(p);
  if (format == "torch-csv-lowered") return pipeoffload::to_torch_csv(p, true);
  return pipeoffload::render_text(p, sim);
}

/// The schedule of --import: the file read and imported (torch_csv.hpp), without offload first,
/// then with --offload-chunks once v is known. A file that cannot be read or is not a valid
/// schedule is a bad_argument naming it.
pipeoffload::Program import_file(Request& rq) {
  using namespace pipeoffload;
  std::FILE* f = std::fopen(rq.import->c_str(), "rb");
  if (!f)
    throw bad_argument("--import " + quote(*rq.import) + " cannot be opened: " + std::string(std::strerror(errno)));
  std::string text;
  char buf[1 << 16];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) {
    text.append(buf, n);
    if (text.size() > (std::size_t{1} << 28)) {
      std::fclose(f);
      throw bad_argument("--import " + quote(*rq.import) + " is larger than 256 MiB");
    }
  }
  std::fclose(f);
  try {
    rq.import_options.costs = rq.costs;
    Program p = from_torch_csv(text, rq.import_options);
    if (rq.import_offload > 0) {
      if (rq.import_offload > p.v())
        throw bad_argument("--offload-chunks must be at most the file's " + num(p.v()) + " chunks per rank, got " +
                           quote(num(rq.import_offload)));
      rq.spec = p.spec;
      rq.shape = p.shape;
      rq.spec.offload = offload::first(rq.import_offload);
      check_copy_plan(rq, false, simulate(p).makespan);
      rq.import_options.offload = rq.spec.offload;
      p = from_torch_csv(text, rq.import_options);
    }
    return p;
  } catch (const schedule_error& e) {
    throw bad_argument(*rq.import + ": " + e.what());
  }
}

/// Writes `text` to `path` (or stdout); returns the exit status.
int emit(const std::string& text, const std::optional<std::string>& path) {
  std::FILE* f = path ? std::fopen(path->c_str(), "wb") : stdout;
  if (!f) {
    std::fprintf(stderr, "%s: --out %s cannot be opened for writing: %s\n", tool, quote(*path).c_str(),
                 std::strerror(errno));
    return 2;
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = path ? std::fclose(f) == 0 : std::fflush(f) == 0;
  if (!ok || !closed) {
    std::fprintf(stderr, "%s: writing %s failed: %s\n", tool, path ? quote(*path).c_str() : "standard output",
                 std::strerror(errno));
    return 1;
  }
  return 0;
}

/// --auto: the model, machine and budget from the command line; throws bad_argument.
struct AutoRequest {
  pipeoffload::TransformerSpec model;
  pipeoffload::MachineSpec machine;
  pipeoffload::GridSpec grid;
  pipeoffload::PlanBudget budget;
  bool grid_given = false;  ///< a data-parallel flag was given: the report shows the grid
  std::string format = "text";
  std::optional<std::string> out;
};

/// --ranks and the data-parallel flags of --auto, into rq.machine.ranks and rq.grid (the model
/// is read already).
void interpret_grid(const Args& args, AutoRequest& rq) {
  namespace po = pipeoffload;
  po::GridSpec& g = rq.grid;
  for (std::string_view f : grid_flags) rq.grid_given = rq.grid_given || args.get(f);
  const std::string* dp = args.get("--dp");
  if (dp)
    g.dp = static_cast<int>(cli::to_int("--dp", *dp, 0, po::max_grid_gpus, " (replicas; 0 searches with --gpus)"));
  if (args.get("--search-dp")) {
    if (dp && g.dp != 0)
      throw bad_argument("--search-dp cannot be combined with --dp " + quote(*dp) + " (--search-dp is --dp 0)");
    g.dp = 0;
  }
  const std::string* gpus = args.get("--gpus");
  if (g.dp == 0) {
    const char* how = dp ? "--dp 0" : "--search-dp";
    if (args.get("--ranks"))
      throw bad_argument(std::string("--ranks cannot be combined with ") + how +
                         ": the planner chooses the ranks d = --gpus / dp");
    if (!gpus)
      throw bad_argument(std::string("missing --gpus (") + how +
                         " searches the dp that divide the GPUs, an integer in [1, " + num(po::max_grid_gpus) + "])");
    g.gpus = static_cast<int>(cli::to_int("--gpus", *gpus, 1, po::max_grid_gpus));
  } else {
    rq.machine.ranks = required_int(args, "--ranks", "pipeline ranks", 1, po::max_ranks);
    const long long all = 1LL * g.dp * rq.machine.ranks;
    if (all > po::max_grid_gpus)
      throw bad_argument("--dp " + num(g.dp) + " x --ranks " + num(rq.machine.ranks) + " = " + num(all) +
                         " GPUs; at most " + num(po::max_grid_gpus));
    if (gpus && cli::to_int("--gpus", *gpus, 1, po::max_grid_gpus) != all)
      throw bad_argument("--gpus must be --dp x --ranks = " + num(all) + " (or left out), got " + quote(*gpus));
    const int mb = rq.model.global_batch / rq.model.micro_batch;
    if (mb % g.dp != 0)
      throw bad_argument("--dp " + num(g.dp) + " does not split the global batch: --global-batch " +
                         num(rq.model.global_batch) + " / --micro-batch " + num(rq.model.micro_batch) + " = " +
                         num(mb) + " microbatches are not a multiple of it; --dp must divide " + num(mb) + " (" +
                         po::detail::divisors(mb, 12) + ")");
  }
  if (const std::string* z = args.get("--zero"))
    g.zero = static_cast<int>(cli::to_int("--zero", *z, 0, 1, " (the ZeRO stage: 1 shards the optimizer state)"));
  if (const std::string* b = args.get("--dp-gbps"))
    g.allreduce_bytes_per_s = cli::to_real("--dp-gbps", *b, 0, 1e9, true) * 1e9;
  if (const std::string* n = args.get("--gpus-per-node"))
    g.gpus_per_node = static_cast<int>(cli::to_int("--gpus-per-node", *n, 1, po::max_grid_gpus));
  if (const std::string* l = args.get("--node-layout")) {
    if (*l != "contiguous" && *l != "balanced")
      throw bad_argument("--node-layout must be contiguous or balanced, got " + quote(*l));
    g.node_layout = *l == "balanced" ? po::NodeLayout::balanced : po::NodeLayout::contiguous;
  }
  const int d = rq.machine.ranks, G = g.gpus_per_node;
  if (g.dp != 0 && !po::node_layout_fits(g.node_layout, d, G))
    throw bad_argument("--node-layout balanced needs --ranks <= --gpus-per-node (" + num(G) +
                       "), or --ranks a multiple of an even --gpus-per-node; got --ranks " + num(d));
}

AutoRequest interpret_auto(const Args& args) {
  for (std::string_view f : not_auto)
    if (args.get(f))
      throw bad_argument(std::string(f) + " cannot be combined with --auto (the planner chooses the schedule)");
  AutoRequest rq;
  auto& m = rq.model;
  const auto need = [&](std::string_view flag, const char* what, long long lo, long long hi) {
    return required_int(args, flag, what, lo, hi);
  };
  // --model NAME starts from a preset; the model flags given beside it override its values.
  const po::ModelPreset* preset = nullptr;
  if (const std::string* name = args.get("--model")) {
    preset = po::find_model_preset(*name);
    if (preset == nullptr)
      throw bad_argument("--model must be one of " + po::model_preset_names() + ", got " + quote(*name));
    m = preset->model;
  }
  const auto set = [&](int& field, std::string_view flag, const char* what, long long lo, long long hi) {
    if (preset == nullptr || args.get(flag)) field = static_cast<int>(need(flag, what, lo, hi));
  };
  set(m.layers, "--layers", "transformer layers", 1, 4096);
  set(m.hidden, "--hidden", "hidden size", 1, 1 << 20);
  set(m.heads, "--heads", "attention heads", 1, 1 << 16);
  set(m.query_groups, "--query-groups", "key/value groups, the heads for multi-head attention", 1, 1 << 16);
  set(m.seq, "--seq", "sequence length", 1, 1 << 24);
  set(m.micro_batch, "--micro-batch", "sequences per microbatch", 1, 1 << 16);
  set(m.global_batch, "--global-batch", "sequences per iteration", 1, 1 << 24);
  set(m.vocab, "--vocab", "vocabulary size", 1, 1 << 24);
  m.recompute = args.get("--recompute") != nullptr;
  if (const std::string* s = args.get("--schedule")) rq.budget.schedule = *s;  // checked by plan()
  m.swiglu = m.swiglu || args.get("--swiglu") != nullptr;
  m.tied_embeddings = m.tied_embeddings || args.get("--tied-embeddings") != nullptr;
  m.packed = args.get("--packed") != nullptr;
  if (args.get("--ffn-hidden")) m.ffn_hidden = need("--ffn-hidden", "the MLP's inner width", 1, 1 << 22);
  if (m.query_groups > m.heads || m.heads % m.query_groups != 0)
    throw bad_argument("--query-groups must divide --heads (" + num(m.heads) + "), got " + quote(num(m.query_groups)));
  if (m.hidden % m.heads != 0)
    throw bad_argument("--hidden must be a multiple of --heads (" + num(m.heads) + "), got " + quote(num(m.hidden)));
  if (m.global_batch % m.micro_batch != 0)
    throw bad_argument("--global-batch must be a multiple of --micro-batch (" + num(m.micro_batch) + "), got " +
                       quote(num(m.global_batch)));
  auto& x = rq.machine;
  interpret_grid(args, rq);
  const auto real = [&](std::string_view flag, const char* what, bool zero_ok) {
    const std::string* v = args.get(flag);
    if (!v) throw bad_argument("missing " + std::string(flag) + " (" + what + ")");
    return cli::to_real(flag, *v, 0, 1e6, !zero_ok);
  };
  x.device_bytes = real("--device-mem-gib", "memory of one device in GiB, > 0", false) * pipeoffload::gib;
  x.host_bytes = real("--host-mem-gib", "pinned host memory per rank in GiB, >= 0", true) * pipeoffload::gib;
  x.flops = real("--tflops", "achieved TFLOP/s of one device, > 0", false) * 1e12;
  if (const std::string* p = args.get("--pcie-gbps"); p && cli::to_real("--pcie-gbps", *p, 0, 1e6, false) == 0)
    throw bad_argument(
        "--pcie-gbps must be > 0: k (offload copy time / compute time) needs a host<->device bandwidth, got " +
        quote(*p));
  x.pcie_bytes_per_s = real("--pcie-gbps", "host<->device GB/s of one device in one direction, > 0", false) * 1e9;
  x.pairs_share_switch = pcie_pairs(args);
  const cli::CopyStreams streams = cli::copy_streams(args, true);
  x.copy_streams = streams.streams;
  x.duplex_slowdown = streams.slowdown;
  if (x.copy_streams == 2 && x.pairs_share_switch && !(rq.grid.dp != 0 && x.ranks == 1))
    throw bad_argument(
        "--copy-streams 2 with --pcie-switch pairs (the default): paired ranks share their switch's link, whose "
        "partner fills the other direction already (a second stream gains nothing); give --pcie-switch none, "
        "--copy-streams 1 or auto");
  if (const std::string* g = args.get("--gradients")) {
    if (*g != "standard" && *g != "exact")
      throw bad_argument("--gradients must be standard or exact, got " + quote(*g));
    rq.budget.gradients = *g == "exact" ? pipeoffload::Gradients::exact : pipeoffload::Gradients::standard;
  }
  if (const std::string* b = args.get("--backend")) {
    if (*b != "cuda" && *b != "cpu") throw bad_argument("--backend must be cuda or cpu, got " + quote(*b));
    rq.budget.backend = *b == "cpu" ? pipeoffload::PlanBackend::cpu : pipeoffload::PlanBackend::cuda;
  }
  if (const std::string* r = args.get("--reduce-dtype")) {
    if (*r != "fp32" && *r != "bf16") throw bad_argument("--reduce-dtype must be fp32 or bf16, got " + quote(*r));
    if (*r == "bf16" && rq.budget.gradients != pipeoffload::Gradients::standard)
      throw bad_argument("--reduce-dtype bf16 needs --gradients standard (the exact path reduces 128-bit sums)");
    rq.budget.reduce_bytes = *r == "bf16" ? 2 : 4;
  }
  if (const std::string* f = args.get("--format")) {
    if (*f != "text" && *f != "json") throw bad_argument("--format must be text or json with --auto, got " + quote(*f));
    rq.format = *f;
  }
  if (const std::string* out = args.get("--out")) {
    if (out->empty()) throw bad_argument("--out needs a file name, got ''");
    rq.out = *out;
  }
  return rq;
}

/// --auto: plan, print, and exit 0, or 3 when nothing fits.
int run_auto(const Args& args) {
  const AutoRequest rq = interpret_auto(args);
  const pipeoffload::PlanResult r = pipeoffload::plan(rq.model, rq.machine, rq.budget, rq.grid);
  const bool grid = rq.grid_given || pipeoffload::grid_shown(r);
  const std::string text = rq.format == "json" ? pipeoffload::render_plan_json(r, rq.model, rq.machine, grid)
                                               : pipeoffload::render_plan_text(r, rq.model, rq.machine, grid);
  if (const int rc = emit(text, rq.out); rc != 0) return rc;
  if (r.fits) return 0;
  std::fprintf(stderr, "%s: %s\n", tool, r.why.c_str());
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  cli::help(argc, argv, usage_text);
  try {
    const cli::Args args(argc, argv, flags);
    if (args.has("--auto")) return run_auto(args);
    Request rq = interpret(args);
    pipeoffload::Program p;
    if (rq.import) {
      p = import_file(rq);
    } else {
      check_copy_plan(rq, args.has("--tflops"));
      p = pipeoffload::build(rq.spec, rq.shape, rq.costs);
    }
    if (const pipeoffload::Validation v = pipeoffload::validate(p); !v) {
      std::fprintf(stderr, "%s: internal error: the built schedule is invalid: %s\n", tool, v.error.c_str());
      return 1;
    }
    return emit(render(rq.format, p, pipeoffload::simulate(p)), rq.out);
  } catch (const bad_argument& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 2;
  } catch (const pipeoffload::shape_error& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", tool, e.what());
    return 1;
  }
}
