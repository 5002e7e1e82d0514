// tests/runtime/alloc_faults.cpp: a small pipelined training run (2 replicas of a 2-rank PO-F
// pipeline of the CPU GPT: runtime, AdamW with ZeRO-1, two steps, an evaluation, a checkpoint
// saved and loaded) in which one allocation fails: this program replaces the global operator
// new, counts the run's allocations in every thread (the ranks' and their streams'), and
// throws std::bad_alloc at the k-th. Every k must end the run, within a deadline, with each
// failed rank's sentence: no std::terminate, no hang. Thread creation fails through the
// same path (std::thread allocates its state), and under an address-space limit in
// test_thread_limit.py.
//
// usage: alloc_faults CASES SEED   runs a clean count, then CASES runs failing at allocations
//                                  drawn with SEED; exit 0 when every one ended with a sentence
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <new>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

namespace {

std::atomic<bool> counting{false};
std::atomic<long> seen{0};      // allocations since counting began
std::atomic<long> fail_at{-1};  // the allocation to fail (-1: none)
std::atomic<long> injected{0};  // failures thrown

void* allocate(std::size_t n, std::size_t align) {
  if (counting.load(std::memory_order_relaxed)) {
    const long k = seen.fetch_add(1, std::memory_order_relaxed);
    if (k == fail_at.load(std::memory_order_relaxed)) {
      injected.fetch_add(1);
      throw std::bad_alloc();
    }
  }
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) { return allocate(n, 0); }
void* operator new[](std::size_t n) { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

namespace po = pipeoffload;

/// One run; each global rank's error ("" when it returned).
std::vector<std::string> train(const std::filesystem::path& dir) {
  const po::Shape shape{2, 2, 4};
  const po::Program program = po::PO_F::build(shape);
  po::gpt::GptConfig cfg;
  cfg.layers = 4;
  cfg.hidden = 16;
  cfg.heads = 2;
  cfg.seq = 8;
  const po::MicrobatchShape mb{2, 8};
  po::comm::ThreadsGrid grid(2, shape.d);
  return po::run_thread_ranks(grid, [&](int g) {
    po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
    const int r = g % shape.d;
    po::backend::Cpu dev({.rank = g});
    std::vector<po::gpt::GptStage> mine;
    for (int c = 0; c < shape.v; ++c) mine.emplace_back(cfg, shape.stage_of(r, c), shape.stages());
    po::Runtime rt(program, dev, comm, replicas, std::span<po::gpt::GptStage>(mine),
                   {.microbatch = mb, .check_finite = true});
    po::AdamW opt(rt, {.zero = 1});
    const std::size_t n = static_cast<std::size_t>(shape.m * mb.tokens());
    std::vector<std::int32_t> tok(n), tgt(n);
    for (std::size_t i = 0; i < n; ++i) {
      tok[i] = static_cast<std::int32_t>((i * 31 + static_cast<std::size_t>(g / shape.d)) % 256);
      tgt[i] = static_cast<std::int32_t>((i * 17 + 3) % 256);
    }
    const std::vector<long long> dims = {static_cast<long long>(shape.m) * mb.batch, mb.seq};
    po::Batch b;
    b.add("tokens", tok, dims).add("targets", tgt, dims);
    for (int step = 0; step < 2; ++step) {
      rt.zero_grad();
      rt.forward_backward(b, {.step = step});
      opt.step(1e-3f, po::clip_scale(po::grad_norm(rt), 1.0f));
    }
    rt.evaluate(b);
    po::save_checkpoint(dir, rt, opt, {1, 1, 2});
    po::load_checkpoint(dir, rt, opt, 1);
  });
}

/// train() with a deadline: a run that has not ended by then is a hang (exit 3).
std::vector<std::string> train_within(const std::filesystem::path& dir, double seconds, long k) {
  auto fut = std::async(std::launch::async, [&] {
    // What the caller sees: the ranks' errors, or one error when the run's own setup (the
    // program, the grid, run_thread_ranks itself) threw before any rank ran.
    std::vector<std::string> errors;
    counting = true;
    try {
      errors = train(dir);
    } catch (const std::exception& e) {
      counting = false;
      errors.assign(1, std::string("setup: ") + e.what());
    }
    counting = false;
    return errors;
  });
  if (fut.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "FAIL: the run failing at allocation %ld did not end within %.0f s (hang)\n", k, seconds);
    std::fflush(stderr);
    std::_Exit(3);
  }
  return fut.get();
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 100;
  const unsigned seed = argc > 2 ? static_cast<unsigned>(std::atoi(argv[2])) : 1;
  if (cases < 0 || cases > 100000) {
    std::fprintf(stderr, "alloc_faults: CASES = %s must be in [0, 100000]\n", argv[1]);
    return 2;
  }
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po-alloc-faults-" + std::to_string(::getpid()));
  // A clean run: every rank returns, and how many allocations it made.
  std::vector<std::string> errors = train_within(dir, 60, -1);
  for (const std::string& e : errors)
    if (!e.empty()) {
      std::fprintf(stderr, "FAIL: the clean run failed: %s\n", e.c_str());
      for (const std::string& x : errors) std::fprintf(stderr, "  %s\n", x.c_str());
      return 1;
    }
  const long total = seen.load();
  std::mt19937_64 rng(seed);
  int ended = 0, absorbed = 0;
  for (int c = 0; c < cases; ++c) {
    const long k = static_cast<long>(rng() % static_cast<unsigned long>(total));
    seen = 0;
    injected = 0;
    fail_at = k;
    errors = train_within(dir, 60, k);
    fail_at = -1;
    int failed = 0;
    for (const std::string& e : errors) failed += !e.empty();
    if (injected.load() == 0) continue;  // this run made fewer allocations: nothing failed
    if (failed == 0) {
      ++absorbed;  // a best-effort step (pruning old checkpoints) took the failure
      continue;
    }
    bool named = false;  // some rank's sentence says what happened
    for (const std::string& e : errors)
      named = named || e.find("std::bad_alloc") != std::string::npos || e.find("out of memory") != std::string::npos;
    if (!named) {
      std::fprintf(stderr, "FAIL: allocation %ld of %ld failed; no rank's error says so:\n", k, total);
      for (const std::string& e : errors) std::fprintf(stderr, "  %s\n", e.c_str());
      return 1;
    }
    ++ended;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::printf(
      "%d of %d runs failed one of %ld allocations and ended with each failed rank's sentence; %d absorbed by a "
      "best-effort step\n",
      ended, cases, total, absorbed);
  return 0;
}
