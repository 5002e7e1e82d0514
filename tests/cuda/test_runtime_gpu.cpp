// tests/cuda/test_runtime_gpu.cpp: po::Runtime on backend::Cuda with gpt::CudaGptStage and
// comm::Nccl, against the same run on backend::Cpu with gpt::GptStage (needs a GPU;
// gpu_main.cpp exits 77 without one).
//
// Three PO-F training steps, each the visible sequence zero_grad, forward_backward, grad_norm,
// clip and AdamW: 2 ranks on 2 GPUs (PCIe-paired when the machine pairs them), or, on a
// one-GPU machine, 1 rank with 4 chunks (PO-F still offloads and reloads every unit). The GPU
// keeps activations in bf16 and accumulates in fp32, the CPU in fp32 throughout, so the losses
// agree within bf16's error, not bit for bit: each step's loss within 2% of the CPU's, a bound
// about 5x the spread of bf16-vs-fp32 runs of models this size (relative rounding 2^-8 per
// stored activation, partly cancelling over the 2 * 4 blocks the loss passes through).
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda.hpp>
#include <pipeoffload/cuda.hpp>
#include <pipeoffload/runtime.hpp>

namespace po = pipeoffload;

namespace {

struct Result {
  std::vector<float> losses;                     // per step
  std::vector<po::backend::MemoryStats> memory;  // per rank, last step
  std::vector<po::backend::MemoryStats> setup;   // per rank, once constructed (before the first step)
  std::vector<po::backend::MemoryStats> first;   // per rank, after the first step
  std::vector<po::backend::MemoryStats> last;    // per rank, after the last step (the device's counts)
  std::vector<std::string> errors;
};

po::gpt::GptConfig config() {
  po::gpt::GptConfig c;
  c.layers = 4;
  c.hidden = 64;
  c.heads = 4;  // head_dim 16: inside cuDNN SDPA's limits
  c.seq = 64;
  c.dropout = 0.1f;
  c.seed = 3;
  return c;
}

/// PO-F's program for `sh`; `stagger` plans the copy slots of PCIe pairs staggered.
po::Program program(po::Shape sh, bool stagger) {
  po::Costs costs;
  costs.stagger_pairs = stagger;
  return po::build({po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all}, sh, costs);
}

constexpr po::MicrobatchShape microbatch{2, 64};
constexpr int steps = 3;
constexpr float clip = 1.0f;
const po::WarmupCosine learning_rate{.lr = 3e-3f, .warmup_steps = 1, .total_steps = 4};

/// Step `step`'s batch of m microbatches: (m * batch, seq) int32 tokens and targets.
struct StepBatch {
  std::vector<std::int32_t> tok, tgt;
  po::Batch batch;  // views of tok and tgt: a StepBatch is never copied
  StepBatch(const StepBatch&) = delete;
  StepBatch& operator=(const StepBatch&) = delete;
  StepBatch(int step, int m) {
    const std::size_t rows = static_cast<std::size_t>(m) * microbatch.batch, n = rows * microbatch.seq;
    tok.resize(n);
    tgt.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      tok[i] = static_cast<std::int32_t>((i * 31 + static_cast<std::size_t>(step) * 7) % 256);
      tgt[i] = static_cast<std::int32_t>((i * 17 + 3 + static_cast<std::size_t>(step)) % 256);
    }
    const std::vector<long long> shape{static_cast<long long>(rows), microbatch.seq};
    batch.add("tokens", tok, shape).add("targets", tgt, shape);
  }
};

/// One rank's training, the visible step: zero_grad, forward_backward, grad_norm, clip, AdamW.
/// Rank 0 writes the losses, every rank its memory after the last step.
/// `barrier` runs once everything is allocated, before the first step's NCCL traffic.
template <class Runtime>
void train(Runtime& rt, int r, Result& res, std::mutex& mu, const std::function<void()>& barrier = [] {}) {
  po::AdamW opt(rt);  // the defaults: weight decay 0.1 on every tensor
  barrier();
  const po::backend::MemoryStats setup = rt.device().memory();
  for (int s = 0; s < steps; ++s) {
    const StepBatch b(s, rt.program().shape.m);
    rt.zero_grad();
    const po::PassStats st = rt.forward_backward(b.batch, {.step = s});
    opt.step(learning_rate(s), po::clip_scale(po::grad_norm(rt), clip));
    std::lock_guard lk(mu);
    if (r == 0) res.losses[static_cast<std::size_t>(s)] = st.loss;
    res.memory[static_cast<std::size_t>(r)] = st.memory;
    if (s == 0) res.first[static_cast<std::size_t>(r)] = rt.device().memory();
  }
  std::lock_guard lk(mu);
  res.setup[static_cast<std::size_t>(r)] = setup;
  res.last[static_cast<std::size_t>(r)] = rt.device().memory();
}

Result run_cpu(const po::Program& prog) {
  const po::Shape sh = prog.shape;
  Result res;
  res.losses.resize(steps);
  res.memory.resize(static_cast<std::size_t>(sh.d));
  res.setup.resize(static_cast<std::size_t>(sh.d));
  res.first.resize(static_cast<std::size_t>(sh.d));
  res.last.resize(static_cast<std::size_t>(sh.d));
  po::comm::ThreadsWorld world(sh.d);
  std::mutex mu;
  res.errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<po::gpt::GptStage> mine;
    for (int c = 0; c < sh.v; ++c) mine.emplace_back(config(), sh.stage_of(r, c), sh.stages());
    po::Runtime rt(prog, dev, comm, std::span<po::gpt::GptStage>(mine), {.microbatch = microbatch});
    train(rt, r, res, mu);
  });
  return res;
}

Result run_gpu(const po::Program& prog, const std::vector<int>& devices, bool paired) {
  const po::Shape sh = prog.shape;
  Result res;
  res.losses.resize(steps);
  res.memory.resize(static_cast<std::size_t>(sh.d));
  res.setup.resize(static_cast<std::size_t>(sh.d));
  res.first.resize(static_cast<std::size_t>(sh.d));
  res.last.resize(static_cast<std::size_t>(sh.d));
  auto world = po::comm::NcclWorld::all_local(devices);
  po::PairLink<po::backend::Cuda> link;
  std::mutex mu;
  // A rank that throws has its error returned, and the world aborted so the other rank's
  // NCCL calls end too.
  res.errors = po::run_thread_ranks(*world, [&](int r) {
    po::backend::Cuda dev(
        {.device = devices[static_cast<std::size_t>(r)], .rank = r, .arena_bytes = std::size_t{1} << 30});
    po::comm::Nccl comm(world, r, dev);
    std::vector<po::gpt::CudaGptStage> mine;
    // bf16 boundaries over NCCL (gpt::Boundaries), as train_gpt sends them.
    for (int c = 0; c < sh.v; ++c)
      mine.emplace_back(dev, config(), sh.stage_of(r, c), sh.stages(), microbatch, po::gpt::Boundaries::bf16);
    // Every rank's allocations are made before any rank's first NCCL kernel (the runtime's
    // constructor gathers the stage table, then reserves memory): a host barrier before it
    // and after it (NcclWorld::host_barrier says why).
    world->host_barrier();
    po::Runtime rt(prog, dev, comm, std::span<po::gpt::CudaGptStage>(mine), {.microbatch = microbatch});
    if (paired) rt.pair_with(link);
    train(rt, r, res, mu, [&] { world->host_barrier(); });
  });
  return res;
}

}  // namespace

TEST_CASE("PO-F on backend::Cuda trains like backend::Cpu within bf16 tolerance, offloading every unit") {
  const int gpus = po::backend::device_count();
  const po::Shape sh = gpus >= 2 ? po::Shape{2, 2, 4} : po::Shape{1, 4, 4};
  CAPTURE(sh.d);
  const po::cuda::Pairing pairing = po::backend::device_pairing();
  const std::vector<int> devices(pairing.device_of_rank.begin(), pairing.device_of_rank.begin() + sh.d);
  const bool paired = sh.d == 2 && pairing.partner_of_rank[0] == 1;
  // One program for both runs (the CPU run's losses do not depend on the copy slots).
  const po::Program prog = program(sh, paired);
  const Result cpu = run_cpu(prog);
  for (const std::string& e : cpu.errors) REQUIRE(e == "");
  const Result gpu = run_gpu(prog, devices, paired);
  for (const std::string& e : gpu.errors) REQUIRE(e == "");
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const float a = gpu.losses[static_cast<std::size_t>(s)], b = cpu.losses[static_cast<std::size_t>(s)];
    REQUIRE(std::isfinite(a));
    CHECK(std::abs(a - b) <= 0.02f * std::abs(b));
  }
  CHECK(gpu.losses.back() < gpu.losses.front());
  // Every unit went through pinned host bins and came back. The runtime reserved every pinned
  // bin when it was constructed (backend::reserves_memory), so no step called cudaHostAlloc,
  // and no step after the first took a new device block (the first carves sum_squares' buffer;
  // the arena reuses its blocks under event guards).
  for (int r = 0; r < sh.d; ++r) {
    CAPTURE(r);
    const std::size_t R = static_cast<std::size_t>(r);
    CHECK(gpu.memory[R].host_peak > 0);
    CHECK(gpu.memory[R].host_in_use == 0);
    CHECK(gpu.memory[R].in(po::backend::Memory::activation) == 0);
    CHECK(gpu.last[R].host_allocations == gpu.setup[R].host_allocations);
    CHECK(gpu.last[R].device_allocations == gpu.first[R].device_allocations);
  }
}
