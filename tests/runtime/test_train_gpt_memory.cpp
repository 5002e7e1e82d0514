// tests/runtime/test_train_gpt_memory.cpp: train_gpt's memory check counts what its ranks
// hold: train_gpt::cpu_rank_bytes, computed before anything is allocated, equals every rank's
// arena (MemoryStats::device_held, host_held) plus its stages' own buffers after a training
// step and an evaluation, to the byte, over schedules, offload, replicas, ZeRO-1 and both
// gradient paths; and a run that cannot fit is refused with a sentence. (The planner's memory
// against the same functions: test_plan_memory.cpp.)
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <models/llama/cpu.hpp>
#include <models/llama/cuda_layout.hpp>
#include <pipeoffload/runtime.hpp>

#include "train_gpt_memory.hpp"

namespace {

/// Options as train_gpt parses them from `args`.
train_gpt::Options parsed(std::vector<std::string> args) {
  std::vector<char*> argv = {const_cast<char*>("train_gpt")};
  for (std::string& a : args) argv.push_back(a.data());
  return train_gpt::parse(static_cast<int>(argv.size()), argv.data());
}

/// Every global rank's bytes after one step and one evaluation of the run `o` (its stages of type Layer).
template <class Layer>
std::vector<train_gpt::RankBytes> measured_with(const train_gpt::Options& o, const train_gpt::Setup& su,
                                                const auto& cfg) {
  const po::Program program = train_gpt::program_of(o, su.costs);
  po::comm::ThreadsGrid grid(o.dp, o.shape.d);
  std::vector<train_gpt::RankBytes> out(static_cast<std::size_t>(o.dp * o.shape.d));
  const auto errors = po::run_thread_ranks(grid, [&](int g) {
    po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
    const int r = g % o.shape.d;
    po::backend::Cpu dev({.rank = g});
    std::vector<Layer> mine;
    for (int c = 0; c < o.shape.v; ++c) mine.emplace_back(cfg, o.shape.stage_of(r, c), o.shape.stages());
    po::Runtime rt(program, dev, comm, replicas, std::span<Layer>(mine), su.runtime);
    po::AdamW opt(rt, su.adamw);
    const std::size_t n = su.tokens_per_step;
    std::vector<std::int32_t> tok(n), tgt(n);
    for (std::size_t i = 0; i < n; ++i) {
      tok[i] = static_cast<std::int32_t>(su.tokens[i]);
      tgt[i] = static_cast<std::int32_t>(su.tokens[i + 1]);
    }
    po::Batch b;
    const std::vector<long long> shape = {static_cast<long long>(n) / o.model.seq, o.model.seq};
    b.add("tokens", tok, shape).add("targets", tgt, shape);
    const std::vector<std::int32_t> offsets =
        o.pack >= 0 ? po::document_offsets(tok, o.model.seq, o.pack) : std::vector<std::int32_t>{};
    if (o.pack >= 0) b.add(po::document_offsets_input, offsets, {shape[0], shape[1] + 1});
    rt.zero_grad();
    rt.forward_backward(b, {.step = 0});
    opt.step(1e-3f, po::clip_scale(po::grad_norm(rt), 1.0f));
    rt.evaluate(b);
    train_gpt::RankBytes& m = out[static_cast<std::size_t>(g)];
    m.device = dev.memory().device_held;
    m.host = dev.memory().host_held;
    for (Layer& l : mine) m.device += l.parameters().size_bytes() + l.gradients().size_bytes();
  });
  for (const std::string& e : errors) REQUIRE_MESSAGE(e.empty(), e);
  return out;
}
std::vector<train_gpt::RankBytes> measured(const train_gpt::Options& o, const train_gpt::Setup& su) {
  if (o.llama) return measured_with<po::llama::LlamaStage>(o, su, train_gpt::llama_config(o));
  return measured_with<po::gpt::GptStage>(o, su, o.model);
}

}  // namespace

TEST_CASE("train_gpt's memory check: cpu_rank_bytes is what every rank's arena and stages hold, to the byte") {
  const std::vector<std::string> small = {"--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2"};
  const std::vector<std::vector<std::string>> runs = {
      {"--ranks", "1", "--chunks", "1"},
      {"--schedule", "1f1b", "--ranks", "4", "--chunks", "1"},
      {"--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--gradients", "exact"},
      {"--schedule", "po-h", "--ranks", "3", "--chunks", "2", "--microbatches", "6", "--dp", "2", "--zero", "1"},
      {"--schedule", "gis-h", "--ranks", "4", "--chunks", "1", "--offload-chunks", "1", "--dp", "2", "--reduce-bucket",
       "1000"},
      {"--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--offload-chunks", "1"},
      {"--schedule", "dualpipe-v", "--ranks", "2", "--chunks", "2", "--gradients", "exact", "--dp", "2"},
      {"--schedule", "zb-h2", "--ranks", "3", "--chunks", "1", "--microbatches", "5", "--eval-every", "1"},
      {"--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--stage-blocks", "0,3,1,0"},
      // Tied embeddings: the head's copy has no moments, the primary's rank a staging (fp32, 128-bit).
      {"--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", "--tie-embeddings", "--dp", "2", "--zero", "1"},
      {"--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--tie-embeddings", "--gradients", "exact", "--dp", "2"},
      {"--ranks", "1", "--chunks", "1", "--tie-embeddings", "--reduce-bucket", "1000"},
      // The Llama: grouped-query attention, SwiGLU, tied or not.
      {"--model", "llama", "--kv-heads", "2", "--schedule", "po-f", "--ranks", "2", "--chunks", "2"},
      {"--model", "llama", "--tie-embeddings", "--ffn", "40", "--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2",
       "--dp", "2", "--zero", "1", "--gradients", "exact"},
      // Packed rows: the ranks with blocks hold the step's document offsets too.
      {"--model", "llama", "--pack", "32", "--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--dp", "2"},
      {"--pack", "32", "--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", "--stage-blocks", "1,0,2,1"},
      {"--model", "llama", "--pack", "32", "--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--stage-blocks",
       "0,2,2,0"},
  };
  std::string text;
  for (int i = 0; text.size() < 20000; ++i) text += "the quick brown fox " + std::to_string(i * 7919 % 1000) + ". ";
  for (const std::vector<std::string>& run : runs) {
    std::vector<std::string> args = small;
    args.insert(args.end(), run.begin(), run.end());
    std::string label;
    for (const std::string& a : args) label += a + " ";
    CAPTURE(label);
    const train_gpt::Options o = parsed(args);
    const train_gpt::Setup su = train_gpt::make_setup(o, sample::Tokens::from_text(text));
    const po::Program program = train_gpt::program_of(o, su.costs);
    const std::vector<train_gpt::RankBytes> got = measured(o, su);
    for (int g = 0; g < o.dp * o.shape.d; ++g) {
      CAPTURE(g);
      const train_gpt::RankBytes want = train_gpt::cpu_rank_bytes(o, su, program, g % o.shape.d, g / o.shape.d);
      CHECK(want.device == got[static_cast<std::size_t>(g)].device);
      CHECK(want.host == got[static_cast<std::size_t>(g)].host);
    }
  }
}

TEST_CASE("train_gpt's memory check: a run larger than the memory available is refused, naming the need") {
  const train_gpt::Options o = parsed({"--ranks", "64", "--dp", "16", "--chunks", "1", "--schedule", "1f1b",
                                       "--microbatches", "64", "--layers", "64", "--hidden", "4096"});
  std::string text(5000, 'a');
  const train_gpt::Setup su = train_gpt::make_setup(o, sample::Tokens::from_text(text));
  const po::Program program = train_gpt::program_of(o, su.costs);
  REQUIRE(train_gpt::available_bytes() > 0);
  CHECK_THROWS_WITH_AS(
      train_gpt::check_memory(o, su, program, 0, 1024),
      doctest::Contains("ranks (activations, stashes, messages, offload bins and model state; rank 0 the most"),
      cli::bad_argument);
}

TEST_CASE("train_gpt's CUDA memory for the Llama: its stages' buffers are llama::CudaLlamaStage's, its own bytes too") {
  const train_gpt::Options o = parsed({"--model",  "llama", "--kv-heads", "2", "--ffn",          "96", "--ranks", "2",
                                       "--chunks", "2",     "--layers",   "4", "--hidden",       "32", "--heads", "4",
                                       "--seq",    "16",    "--batch",    "2", "--microbatches", "4"});
  std::string text;
  for (int i = 0; text.size() < 5000; ++i) text += "the quick brown fox " + std::to_string(i) + ". ";
  const train_gpt::Setup su = train_gpt::make_setup(o, sample::Tokens::from_text(text));
  const po::Program program = train_gpt::program_of(o, su.costs);
  const po::llama::LlamaConfig cfg = train_gpt::llama_config(o);
  const long long T = su.runtime.microbatch.tokens();
  const std::size_t workspace = std::size_t{1} << 20;
  for (int r = 0; r < o.shape.d; ++r) {
    CAPTURE(r);
    std::size_t own = 0;
    for (int c = 0; c < o.shape.v; ++c) {
      const int s = o.shape.stage_of(r, c);
      const po::llama::LlamaDims d = po::llama::llama_dims(cfg, s, o.shape.stages());
      const po::llama::LlamaStageBuffers b = po::llama::llama_cuda_buffers(d, T);
      const train_gpt::StageFacts f = train_gpt::stage_facts(o, s, o.shape.stages(), true, su.runtime.microbatch);
      CHECK(f.own.saved == b.saved_bytes);
      CHECK(f.own.stash == b.stash_bytes);
      CHECK(f.own.saved != train_gpt::stage_facts(o, s, o.shape.stages(), false, su.runtime.microbatch).own.saved);
      own += po::llama::llama_cuda_state_bytes(d, cfg.seq) + po::llama::llama_cuda_workspace(d, T).bytes;
    }
    CHECK(train_gpt::cuda_rank_bytes(o, su, program, r, 0, workspace).device ==
          train_gpt::cuda_arena_bytes(o, su, program, r, 0, workspace) + own);
  }
}

namespace {

/// One GPU's memory as ranks sharing it see it: cudaMalloc fails past what is free.
struct FakeGpu {
  std::mutex mu;
  std::size_t free = 0;
};

/// A rank's device: reset_arena frees its slab, then takes one of the new size (a shrinking
/// rank slowly, as a loaded device would), or throws as a refused cudaMalloc would.
struct FakeDevice {
  FakeGpu& gpu;
  std::size_t slab = 0;
  void reset_arena(std::size_t bytes) {
    if (bytes <= slab) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard lk(gpu.mu);
    gpu.free += slab;
    slab = 0;
    if (bytes > gpu.free)
      throw po::error("cannot take a slab of " + std::to_string(bytes) + " bytes: " + std::to_string(gpu.free) +
                      " free");
    gpu.free -= bytes;
    slab = bytes;
  }
};

/// Ranks of a 2 x 2 grid sharing one fake GPU remake their slabs from `before` to `after`
/// (per global rank) in turns (`turns`) or each at once; the errors of the ranks, and into
/// `slabs` what each holds after.
std::vector<std::string> remake(const std::vector<std::size_t>& before, const std::vector<std::size_t>& after,
                                std::size_t spare, bool turns, std::vector<std::size_t>& slabs) {
  po::comm::ThreadsGrid grid(2, 2);
  FakeGpu gpu;
  gpu.free = spare;
  slabs.assign(before.size(), 0);
  return po::run_thread_ranks(grid, [&](int g) {
    po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
    FakeDevice dev{gpu, before[static_cast<std::size_t>(g)]};
    const auto line_up = [&] {
      int none = 0, all[2];
      comm.all_gather(std::span<const int>(&none, 1), std::span<int>(all));
      replicas.all_gather(std::span<const int>(&none, 1), std::span<int>(all));
    };
    try {
      train_gpt::remake_arena(dev, after[static_cast<std::size_t>(g)], dev.slab, turns, line_up);
    } catch (...) {
      slabs[static_cast<std::size_t>(g)] = dev.slab;
      throw;
    }
    slabs[static_cast<std::size_t>(g)] = dev.slab;
  });
}

}  // namespace

TEST_CASE(
    "--k auto with --ranks-per-gpu: ranks sharing a GPU make their slabs again in turns, the shrinking first, so no "
    "new slab waits for memory a neighbour still holds") {
  // Four ranks of 100 each on a GPU with 10 spare: ranks 0 and 2 shrink to 50, ranks 1 and 3
  // grow to 150 (400 + 10 in all; the new slabs need exactly 400).
  const std::vector<std::size_t> before = {100, 100, 100, 100}, after = {50, 150, 50, 150};
  std::vector<std::size_t> slabs;
  std::vector<std::string> errors = remake(before, after, 10, true, slabs);
  for (const std::string& e : errors) CHECK(e.empty());
  CHECK(slabs == after);
  // All at once, a growing rank asks before the shrinking ones have given theirs back.
  errors = remake(before, after, 10, false, slabs);
  int refused = 0;
  for (const std::string& e : errors) refused += e.find("cannot take a slab of 150 bytes") != std::string::npos;
  CHECK(refused > 0);
}
