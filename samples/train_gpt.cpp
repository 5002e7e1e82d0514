// samples/train_gpt: trains a small byte-level GPT on data/corpus.txt with d pipeline ranks as
// threads, under any schedule, with real activation offload on the CPU backend.
//
//   ./build/samples/train_gpt --schedule po-f --ranks 4 --chunks 2 --microbatches 8 --steps 200
//   ./build/samples/train_gpt --ranks 1 --chunks 1 --microbatches 8 --steps 200   # one-rank reference
//   ./build/samples/train_gpt --schedule po-f --ranks 4 --chunks 2 --microbatches 8 --steps 5 --copy-gbps 0.5 --trace po-f.json
//
// The last two lines, `final_loss=...` and `params_hash=...`, are the same for every schedule
// and rank count with the same model, data and seed (bit-exact pipelining); scripts compare them.
#include <pipeoffload/model/gpt.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/sim/render.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#ifndef PIPEOFFLOAD_CORPUS
#define PIPEOFFLOAD_CORPUS "data/corpus.txt"
#endif

namespace {

constexpr const char* usage_text = R"(usage: train_gpt [options]

  --schedule NAME       1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f (default po-f; gis with --ranks 1)
  --ranks D             pipeline ranks (threads), 1..64; 1 is the one-rank sequential reference (default 4)
  --chunks V            chunks (stages) per rank, 1..64; 1 for 1f1b (default 2)
  --microbatches M      microbatches per step, 1..4096; a multiple of D for 1f1b-i (default 8)
  --group G             group size of gis-g (required there), ceil(D/2)..D
  --offload-chunks N    offload chunks 0..N-1 (0..V) for any schedule (po-h, po-f imply ceil(V/2), V)
  --k K                 planning: round-trip copy time / (T_F+T_B+T_W), (0, 100]; default 1
  --copy-gbps X         pace the copy engine at X GB/s (a PCIe link); 0 = memcpy speed (default 0)
  --steps N             optimizer steps, 1..1000000 (default 200)
  --seed S              model, dropout and data seed (default 1)
  --trace FILE          write a Chrome trace of the last step's real run (compute and copy streams per rank)
  --layers L --hidden H --heads A --seq S --batch B --lr LR --dropout P
                        model: 8 blocks, h=64, 4 heads, seq 64, batch 4 per microbatch, lr 3e-3, dropout 0.1
  --corpus FILE         text to train on (default data/corpus.txt)
  --quiet               no progress lines
)";

struct bad_argument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

long long to_int(const std::string& flag, const std::string& text, long long lo, long long hi) {
  long long x = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || x < lo || x > hi)
    throw bad_argument(flag + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + text + "'");
  return x;
}
double to_real(const std::string& flag, const std::string& text, double lo, double hi, bool lo_open) {
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(x) || x > hi || (lo_open ? x <= lo : x < lo))
    throw bad_argument(flag + " must be a number in " + (lo_open ? "(" : "[") + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + text + "'");
  return x;
}

struct Options {
  std::string schedule;
  po::ScheduleSpec spec{};
  po::Shape shape{4, 2, 8};
  double k = 1, copy_gbps = 0;
  int steps = 200;
  std::uint64_t seed = 1;
  std::optional<std::string> trace;
  po::model::GptConfig model{};
  int batch = 4;
  float lr = 3e-3f;
  std::string corpus = PIPEOFFLOAD_CORPUS;
  bool quiet = false;
};

Options parse(int argc, char** argv) {
  std::map<std::string, std::string> a;
  bool quiet = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    }
    if (f == "--quiet") {
      quiet = true;
      continue;
    }
    static const char* known[] = {"--schedule", "--ranks", "--chunks", "--microbatches", "--group", "--offload-chunks", "--k", "--copy-gbps",
                                  "--steps", "--seed", "--trace", "--layers", "--hidden", "--heads", "--seq", "--batch", "--lr", "--dropout", "--corpus"};
    if (std::find(std::begin(known), std::end(known), f) == std::end(known)) throw bad_argument("unknown option '" + f + "' (--help lists them)");
    if (i + 1 >= argc) throw bad_argument(f + " needs a value");
    if (a.count(f)) throw bad_argument(f + " was given twice");
    a[f] = argv[++i];
  }
  Options o;
  o.quiet = quiet;
  const auto get = [&](const char* f) -> const std::string* { auto it = a.find(f); return it == a.end() ? nullptr : &it->second; };
  if (auto v = get("--ranks")) o.shape.d = static_cast<int>(to_int("--ranks", *v, 1, 64));
  if (auto v = get("--chunks")) o.shape.v = static_cast<int>(to_int("--chunks", *v, 1, 64));
  if (auto v = get("--microbatches")) o.shape.m = static_cast<int>(to_int("--microbatches", *v, 1, 4096));
  if (auto v = get("--steps")) o.steps = static_cast<int>(to_int("--steps", *v, 1, 1000000));
  if (auto v = get("--seed")) o.seed = static_cast<std::uint64_t>(to_int("--seed", *v, 0, (1LL << 62)));
  if (auto v = get("--k")) o.k = to_real("--k", *v, 0, 100, true);
  if (auto v = get("--copy-gbps")) o.copy_gbps = to_real("--copy-gbps", *v, 0, 1e4, false);
  if (auto v = get("--trace")) o.trace = *v;
  if (auto v = get("--corpus")) o.corpus = *v;
  o.model.layers = 8;
  o.model.hidden = 64;
  o.model.heads = 4;
  o.model.seq = 64;
  if (auto v = get("--layers")) o.model.layers = static_cast<int>(to_int("--layers", *v, 1, 4096));
  if (auto v = get("--hidden")) o.model.hidden = static_cast<int>(to_int("--hidden", *v, 1, 8192));
  if (auto v = get("--heads")) o.model.heads = static_cast<int>(to_int("--heads", *v, 1, 1024));
  if (auto v = get("--seq")) o.model.seq = static_cast<int>(to_int("--seq", *v, 1, 8192));
  if (auto v = get("--batch")) o.batch = static_cast<int>(to_int("--batch", *v, 1, 4096));
  if (auto v = get("--lr")) o.lr = static_cast<float>(to_real("--lr", *v, 0, 10, true));
  if (auto v = get("--dropout")) o.model.dropout = static_cast<float>(to_real("--dropout", *v, 0, 0.99, false));
  if (o.model.hidden % o.model.heads != 0)
    throw bad_argument("--heads " + std::to_string(o.model.heads) + " must divide --hidden " + std::to_string(o.model.hidden));
  o.model.seed = o.seed;

  using po::Family;
  using GK = po::GroupSpec::Kind;
  o.schedule = get("--schedule") ? *get("--schedule") : (o.shape.d == 1 ? "gis" : "po-f");
  const std::string& n = o.schedule;
  if (n == "1f1b") o.spec = {Family::one_f1b, {}, po::offload::none};
  else if (n == "1f1b-i") o.spec = {Family::interleaved_1f1b, {}, po::offload::none};
  else if (n == "gis") o.spec = {Family::grouped, {GK::full, 0}, po::offload::none};
  else if (n == "gis-h") o.spec = {Family::grouped, {GK::half, 0}, po::offload::none};
  else if (n == "gis-g") o.spec = {Family::grouped, {GK::number, 0}, po::offload::none};
  else if (n == "po") o.spec = {Family::grouped, {GK::uniform, 1}, po::offload::none};
  else if (n == "po-h") o.spec = {Family::grouped, {GK::uniform, 1}, po::offload::half};
  else if (n == "po-f") o.spec = {Family::grouped, {GK::uniform, 1}, po::offload::all};
  else throw bad_argument("--schedule must be one of 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, got '" + n + "'");
  const int lo = (o.shape.d + 1) / 2;
  if (n == "gis-g") {
    if (!get("--group")) throw bad_argument("--schedule gis-g needs --group G, an integer in [" + std::to_string(lo) + ", " + std::to_string(o.shape.d) + "]");
    o.spec.group.value = static_cast<int>(to_int("--group", *get("--group"), lo, o.shape.d));
  } else if (get("--group")) {
    throw bad_argument("--group applies only to --schedule gis-g, not " + n);
  }
  if (auto v = get("--offload-chunks")) {
    const int x = static_cast<int>(to_int("--offload-chunks", *v, 0, o.shape.v));
    if (n == "po-h" || n == "po-f") throw bad_argument("--offload-chunks does not apply to " + n + " (it offloads " + (n == "po-h" ? "half" : "all") + " the chunks)");
    o.spec.offload = po::offload::first(x);
  }
  return o;
}

std::string hex64(std::uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
    po::build(o.spec, o.shape);  // shape errors (1f1b with v > 1, 1f1b-i with m % d != 0) as bad arguments
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  std::ifstream in(o.corpus, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "train_gpt: cannot read the corpus '%s'\n", o.corpus.c_str());
    return 2;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t seq = static_cast<std::size_t>(o.model.seq);
  if (text.size() < seq + 2) {
    std::fprintf(stderr, "train_gpt: the corpus has %zu bytes; it needs at least --seq + 2 = %zu\n", text.size(), seq + 2);
    return 2;
  }
  po::blas::core_name();  // load the BLAS before the ranks start

  const po::Shape sh = o.shape;
  const po::MicrobatchShape mbs{o.batch, o.model.seq};
  po::RuntimeOptions ropt;
  ropt.shape = sh;
  ropt.spec = o.spec;
  ropt.microbatch = mbs;
  ropt.costs.k = o.k;
  ropt.optimizer.lr = o.lr;
  ropt.optimizer.warmup_steps = std::max(1, std::min(20, o.steps / 10));
  ropt.optimizer.total_steps = o.steps;
  ropt.optimizer.weight_decay = 0.01f;

  // Every rank's layers live here so the main thread can hash them after the run.
  std::vector<std::vector<po::model::GptStage>> layers(static_cast<std::size_t>(sh.d));
  std::vector<po::RankSim> traces(static_cast<std::size_t>(sh.d));
  std::vector<std::size_t> peak(static_cast<std::size_t>(sh.d), 0), peak_total(static_cast<std::size_t>(sh.d), 0);
  std::vector<std::size_t> host_peak(static_cast<std::size_t>(sh.d), 0);
  float final_loss = 0;
  po::Program program;
  std::mutex mu;
  const std::size_t tokens_per_step = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(sh.m);

  std::printf("train_gpt: %s, d=%d v=%d m=%d, GPT %d blocks h=%d heads=%d seq=%d batch=%d, %zu-byte corpus, BLAS %s\n", o.schedule.c_str(), sh.d, sh.v,
              sh.m, o.model.layers, o.model.hidden, o.model.heads, o.model.seq, o.batch, text.size(), po::blas::core_name().c_str());
  po::comm::ThreadsWorld world(sh.d);
  const auto t_start = std::chrono::steady_clock::now();
  const auto errors = po::run_thread_ranks(sh.d, [&](int r) {
    po::backend::Cpu dev({.rank = r, .copy_bytes_per_second = o.copy_gbps * 1e9});
    po::comm::Threads comm(world, r);
    auto& mine = layers[static_cast<std::size_t>(r)];
    for (int c = 0; c < sh.v; ++c) mine.emplace_back(o.model, sh.stage_of(r, c), sh.stages());
    po::Runtime<po::AnySchedule, po::model::GptStage, po::backend::Cpu, po::comm::Threads> rt(ropt, dev, comm, mine);
    std::vector<std::int32_t> tok(tokens_per_step), tgt(tokens_per_step);
    double tokens_seconds = 0;
    for (int step = 0; step < o.steps; ++step) {
      // Each sequence starts at a position drawn from (seed, step, sequence).
      for (std::size_t q = 0; q < tokens_per_step / seq; ++q) {
        const std::size_t at = po::math::mix64(o.seed, static_cast<std::uint64_t>(step) * 1000003u + q) % (text.size() - seq - 1);
        for (std::size_t t = 0; t < seq; ++t) {
          tok[q * seq + t] = static_cast<unsigned char>(text[at + t]);
          tgt[q * seq + t] = static_cast<unsigned char>(text[at + t + 1]);
        }
      }
      const po::StepStats st = rt.step({tok, tgt});
      tokens_seconds += st.seconds;
      std::lock_guard lk(mu);
      peak[static_cast<std::size_t>(r)] = std::max(peak[static_cast<std::size_t>(r)], st.memory.peak_of(po::backend::Memory::activation));
      peak_total[static_cast<std::size_t>(r)] = std::max(peak_total[static_cast<std::size_t>(r)], st.memory.total_peak);
      host_peak[static_cast<std::size_t>(r)] = std::max(host_peak[static_cast<std::size_t>(r)], st.memory.host_peak);
      if (r == 0) {
        final_loss = st.loss;
        const bool report = !o.quiet && (step == 0 || (step + 1) % std::max(1, o.steps / 20) == 0 || step + 1 == o.steps);
        if (report) {
          const int width = 20, done = (step + 1) * width / o.steps;
          std::string bar(static_cast<std::size_t>(done), '#');
          bar.resize(static_cast<std::size_t>(width), '.');
          std::string peaks;
          for (std::size_t q = 0; q < peak.size(); ++q) peaks += (q ? " " : "") + mib(static_cast<double>(peak[q]));
          std::printf("[%s] step %d/%d loss %.4f lr %.2e | %.0f tokens/s | peak activation MiB per rank: %s\n", bar.c_str(), step + 1, o.steps,
                      static_cast<double>(st.loss), static_cast<double>(st.lr), static_cast<double>(tokens_per_step) * (step + 1) / tokens_seconds,
                      peaks.c_str());
          std::fflush(stdout);
        }
      }
    }
    std::lock_guard lk(mu);
    traces[static_cast<std::size_t>(r)] = rt.trace();
    if (r == 0) program = rt.program();
  });
  for (int r = 0; r < sh.d; ++r)
    if (!errors[static_cast<std::size_t>(r)].empty()) {
      std::fprintf(stderr, "train_gpt: rank %d: %s\n", r, errors[static_cast<std::size_t>(r)].c_str());
      return 1;
    }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  // Unit bytes per stage, for the simulator's view of this run and of 1F1B-I.
  po::Costs sizes;
  sizes.unit_bytes.resize(static_cast<std::size_t>(sh.stages()));
  for (int r = 0; r < sh.d; ++r)
    for (int c = 0; c < sh.v; ++c)
      sizes.unit_bytes[static_cast<std::size_t>(sh.stage_of(r, c))] = static_cast<double>(layers[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)].saved_bytes(mbs));
  std::printf("peak activation per rank, measured (MiB):   ");
  for (std::size_t r = 0; r < peak.size(); ++r) std::printf(" %s", mib(static_cast<double>(peak[r])).c_str());
  std::printf("   (device total incl. stash and messages:");
  for (std::size_t r = 0; r < peak.size(); ++r) std::printf(" %s", mib(static_cast<double>(peak_total[r])).c_str());
  std::printf("; pinned host:");
  for (std::size_t r = 0; r < peak.size(); ++r) std::printf(" %s", mib(static_cast<double>(host_peak[r])).c_str());
  std::printf(")\n");
  if (sh.m % sh.d == 0) {
    const po::Program ref = po::build({po::Family::interleaved_1f1b, {}, po::offload::none}, sh);
    const po::SimResult sim = po::simulate(ref, sizes);
    std::printf("1F1B-I would need, simulated (MiB):          ");
    for (const auto& rs : sim.ranks) std::printf(" %s", mib(rs.peak).c_str());
    std::printf("\n");
  } else {
    std::printf("1F1B-I would need: n/a (1F1B-I needs m to be a multiple of d)\n");
  }
  std::printf("wall %.2f s, %.0f tokens/s\n", wall, static_cast<double>(tokens_per_step) * o.steps / wall);

  if (o.trace) {
    // The last step's measured times, from the earliest op, in milliseconds (the renderer's
    // time unit is 1000 us).
    po::SimResult real;
    real.ranks = traces;
    double t0 = 1e300, t1 = 0;
    for (const auto& rs : real.ranks) {
      for (double t : rs.compute_start) t0 = std::min(t0, t);
      for (double t : rs.copy_start) t0 = std::min(t0, t);
    }
    for (std::size_t r = 0; r < real.ranks.size(); ++r) {
      auto& rs = real.ranks[r];
      for (auto* vec : {&rs.compute_start, &rs.compute_end, &rs.copy_start, &rs.copy_end})
        for (double& t : *vec) {
          t = (t - t0) * 1e3;
          t1 = std::max(t1, t);
        }
      for (std::size_t x = 0; x < rs.compute_start.size(); ++x) rs.busy += rs.compute_end[x] - rs.compute_start[x];
      po::detail::memory_timeline(sizes, program.ranks[r], rs);
    }
    real.makespan = t1;
    for (auto& rs : real.ranks) rs.bubble = real.makespan - rs.busy;
    std::ofstream out(*o.trace);
    out << po::render_chrome_trace(program, real);
    if (!out) {
      std::fprintf(stderr, "train_gpt: cannot write the trace '%s'\n", o.trace->c_str());
      return 1;
    }
    std::printf("trace of the last step (%.1f ms) written to %s\n", t1, o.trace->c_str());
  }

  // FNV-1a over every parameter's fp32 bytes, stage by stage in model order: the same bytes
  // in the same order however the model is cut into stages and ranks.
  std::uint64_t hash = 1469598103934665603ull;
  for (int s = 0; s < sh.stages(); ++s) {
    auto& l = layers[static_cast<std::size_t>(sh.rank_of(s))][static_cast<std::size_t>(sh.chunk_of(s))];
    const auto p = l.parameters();
    const auto* bytes = reinterpret_cast<const unsigned char*>(p.data());
    for (std::size_t i = 0; i < p.size() * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  }
  std::printf("final_loss=%.9g\n", static_cast<double>(final_loss));
  std::printf("params_hash=%s\n", hex64(hash).c_str());
  return 0;
}
