// tests/runtime/test_graphs.cpp: RuntimeOptions::graphs on backend::Cpu, the CPU counterpart
// of a CUDA graph per rank: a captured and replayed training call equals the call run, bit for
// bit (every family, replicas, ZeRO-1, accumulation, both gradient paths); a replay's passes
// see the captured call, so only what a pass reads from device memory follows the step; the
// backend's capture records and replays; what cannot be captured is refused with a sentence.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>

#include "pipeline_run.hpp"
#include "tanh_layer.hpp"

namespace {

using pipeline_test::Run;
using pipeline_test::same;
using po::gpt::GptConfig;
using po::gpt::GptStage;

// Dropout on: the masks depend on the step, which a replay reads from Microbatch::device_step.
const GptConfig tiny{.vocab = 32, .hidden = 16, .heads = 2, .layers = 4, .seq = 8, .dropout = 0.1f};
constexpr int steps = 4;  // step 0 runs as usual, step 1 is captured, steps 2 and 3 are replayed

void check_same(const Run& graphed, const Run& eager) {
  for (const auto& e : graphed.errors) REQUIRE(e == "");
  for (const auto& e : eager.errors) REQUIRE(e == "");
  CHECK(same(graphed.losses, eager.losses));
  CHECK(same(graphed.params, eager.params));
  REQUIRE(graphed.grads.size() == eager.grads.size());
  for (std::size_t s = 0; s < eager.grads.size(); ++s) CHECK(same(graphed.grads[s], eager.grads[s]));
}

TEST_CASE("graphs: replayed training calls are bit-identical to run ones under every family (GPT, dropout on)") {
  for (const std::string& name : pipeline_test::schedule_names()) {
    CAPTURE(name);
    const auto [spec, shape] = pipeline_test::family(name);
    pipeline_test::RunOptions<GptConfig> o{.cfg = tiny, .gradients = po::Gradients::standard};
    const Run eager = pipeline_test::train<GptStage>(spec, shape, steps, o);
    o.graphs = true;
    check_same(pipeline_test::train<GptStage>(spec, shape, steps, o), eager);
  }
}

// A replay reports its captured call's memory (a CUDA graph's replay takes no buffer on the
// host; tests/cuda/test_gpt_gpu.cpp checks it there). backend::Cpu's replay runs the launches
// again, so here the figures hold either way: the property, kept for both backends.
TEST_CASE("graphs: a replayed call reports the memory its captured call took, as a run call does") {
  for (const char* family : {"po-f", "zb-v"}) {
    CAPTURE(family);
    const auto [spec, shape] = pipeline_test::family(family);
    pipeline_test::RunOptions<GptConfig> o{.cfg = tiny};
    const Run eager = pipeline_test::train<GptStage>(spec, shape, steps, o);
    o.graphs = true;
    const Run replayed = pipeline_test::train<GptStage>(spec, shape, steps, o);
    REQUIRE(eager.memory.size() == static_cast<std::size_t>(steps));
    REQUIRE(replayed.memory.size() == static_cast<std::size_t>(steps));
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      const po::backend::MemoryStats &a = eager.memory[static_cast<std::size_t>(s)],
                                     &b = replayed.memory[static_cast<std::size_t>(s)];
      // (The state differs by the step's int32, which a captured run keeps on the device.)
      CHECK(b.peak_of(po::backend::Memory::activation) > 0);
      for (const po::backend::Memory k :
           {po::backend::Memory::activation, po::backend::Memory::stash, po::backend::Memory::message})
        CHECK(b.peak_of(k) == a.peak_of(k));
      CHECK(b.host_peak == a.host_peak);
    }
  }
}

TEST_CASE("graphs: with replicas, ZeRO-1, accumulation and either gradient path, replays equal runs") {
  struct Case {
    po::Gradients gradients;
    int dp, zero, parts;
  };
  for (const Case k : {Case{po::Gradients::standard, 2, 1, 1}, Case{po::Gradients::exact, 2, 1, 1},
                       Case{po::Gradients::standard, 1, 0, 2}, Case{po::Gradients::exact, 2, 0, 2}}) {
    CAPTURE(static_cast<int>(k.gradients));
    CAPTURE(k.dp);
    CAPTURE(k.parts);
    const auto [spec, shape] = pipeline_test::family("po-f");
    pipeline_test::RunOptions<GptConfig> o{
        .cfg = tiny, .dp = k.dp, .zero = k.zero, .gradients = k.gradients, .parts = k.parts};
    const Run eager = pipeline_test::train<GptStage>(spec, shape, steps, o);
    o.graphs = true;
    check_same(pipeline_test::train<GptStage>(spec, shape, steps, o), eager);
  }
}

// One stage whose "loss" is w * x + the step, the step read on the host (mb.step) or from
// device memory (*mb.device_step), as a layer author may write it.
struct StepLoss {
  bool from_device = false;
  float w = 1, gw = 0;
  po::Boundary input_boundary(po::MicrobatchShape) const { return {1}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {1}; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return sizeof(float); }
  std::size_t stash_bytes(po::MicrobatchShape) const { return sizeof(float); }
  std::vector<po::InputSpec> inputs(po::MicrobatchShape) const { return {{"x", po::DType::float32, 1}}; }
  bool capturable() const { return true; }  // (true of from_device only: what the test shows)
  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor, po::Tensor, std::byte* saved) {
    const float x = mb.input<float>("x")[0];
    const int step = !from_device ? mb.step : mb.device_step != nullptr ? *mb.device_step : 0;
    *reinterpret_cast<float*>(saved) = x;
    *mb.loss = w * x + static_cast<float>(step);
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*,
                      std::byte*) {}
  void backward_weight(po::backend::CpuContext&, const po::Microbatch& mb, std::byte* saved, std::byte*) {
    gw += mb.loss_scale * *reinterpret_cast<const float*>(saved);
  }
  std::span<float> parameters() { return {&w, 1}; }
  std::span<float> gradients() { return {&gw, 1}; }
};

/// The loss of each of five steps of one StepLoss stage (x = 1, w fixed).
std::vector<float> step_losses(bool graphs, bool from_device) {
  const po::Program program = po::build(pipeline_test::one_rank, {1, 1, 2});
  po::comm::ThreadsWorld world(1);
  std::vector<float> losses;
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<StepLoss> layers(1);
    layers[0].from_device = from_device;
    po::Runtime rt(program, dev, comm, std::span<StepLoss>(layers), {.microbatch = {1, 1}, .graphs = graphs});
    const std::vector<float> x{1.0f, 1.0f};
    po::Batch batch;
    batch.add("x", x, {2, 1});
    for (int s = 0; s < 5; ++s) losses.push_back(rt.forward_backward(batch, {.step = s}).loss);
  });
  for (const auto& e : errors) REQUIRE(e == "");
  return losses;
}

TEST_CASE("graphs: a replay's passes see the captured call; the step follows only through device memory") {
  const std::vector<float> follows{1, 2, 3, 4, 5};
  CHECK(step_losses(false, false) == follows);
  CHECK(step_losses(false, true) == std::vector<float>{1, 1, 1, 1, 1});  // (no device step without graphs: 0)
  CHECK(step_losses(true, true) == follows);
  // A pass that reads mb.step keeps the captured step (1) on every replay, on the CPU as on a
  // GPU: the difference a layer's own test under graphs shows.
  CHECK(step_losses(true, false) == std::vector<float>{1, 2, 2, 2, 2});
}

TEST_CASE("graphs: backend::Cpu's capture records launches, records and waits, and each replay makes them again") {
  po::backend::Cpu dev;
  const int a = dev.make_stream("a"), b = dev.make_stream("b");
  const int e = dev.make_event();
  std::atomic<int> ran{0};
  std::vector<int> order;
  dev.begin_capture(a);
  dev.launch(a, [&] {
    ++ran;
    order.push_back(1);
  });
  dev.record(e, a);
  dev.wait(b, e);
  dev.launch(b, [&] { order.push_back(2); });
  CHECK_THROWS_WITH(dev.synchronize(),
                    "backend::Cpu::synchronize during a capture: a captured step may only launch work on the "
                    "device's streams");
  CHECK_THROWS_WITH(dev.reset_arena(0),
                    "backend::Cpu::reset_arena during a capture: a captured step may only launch work on the "
                    "device's streams");
  CHECK_THROWS_WITH(dev.begin_capture(a), "backend::Cpu::begin_capture: a capture is under way already");
  const po::backend::Cpu::Graph g = dev.end_capture();
  CHECK(g.calls.size() == 4);
  dev.synchronize();
  CHECK(ran == 0);  // captured, not run
  dev.replay(g);
  dev.replay(g);
  dev.synchronize();
  CHECK(ran == 2);
  CHECK(order == std::vector<int>{1, 2, 1, 2});  // b's launch waits for a's each time
  CHECK_THROWS_WITH(dev.end_capture(), "backend::Cpu::end_capture: no capture is under way (begin_capture)");
}

TEST_CASE("graphs: a stage that does not say it can be captured is refused, naming its type") {
  const po::Program program = po::build(pipeline_test::one_rank, {1, 1, 2});
  po::comm::ThreadsWorld world(1);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<test::TanhLayer> layers;
    layers.emplace_back(0, 4, 1, test::Timing{}, nullptr, 0);
    po::Runtime rt(program, dev, comm, std::span<test::TanhLayer>(layers), {.microbatch = {1, 1}, .graphs = true});
  });
  CHECK(errors[0] ==
        "po::Runtime: RuntimeOptions::graphs: the stage type test::TanhLayer does not say its passes can be captured "
        "(a member bool capturable() const returning true: the passes read the step from mb.device_step and make "
        "no host wait; layer.hpp)");
}

// backend::Cpu as a backend whose captures do not replay its communicators' calls (as
// backend::Cuda's CUDA graphs): the runtime then captures one rank without replicas.
struct GraphsCpu : po::backend::Cpu {
  using po::backend::Cpu::Cpu;
  static constexpr bool replays_launches = false;
};
static_assert(po::backend::captures_graphs<GraphsCpu>);

TEST_CASE(
    "graphs: on a backend that does not replay communicators, one rank of one replica is captured, more refused") {
  const po::Program program = po::build(po::parse_schedule("po-f"), {1, 2, 4});
  for (const int dp : {1, 2}) {
    CAPTURE(dp);
    po::comm::ThreadsGrid grid(dp, 1);
    const auto errors = po::run_thread_ranks(grid, [&](int g) {
      GraphsCpu dev({.rank = g});
      po::comm::Threads comm = grid.pipeline(g), replicas = grid.replicas(g);
      std::vector<GptStage> layers;
      for (int c = 0; c < 2; ++c) layers.emplace_back(tiny, program.shape.stage_of(0, c), program.shape.stages());
      po::Runtime rt(program, dev, comm, replicas, std::span<GptStage>(layers), {.microbatch = {2, 8}, .graphs = true});
    });
    // A replicas communicator of one rank (as train_gpt passes at --dp 1) is no replica.
    if (dp == 1)
      CHECK(errors[0] == "");
    else
      for (const std::string& e : errors)
        CHECK(e.find("po::Runtime: RuntimeOptions::graphs on this backend captures one rank without replicas (d = 1, "
                     "dp = 1); this run has d = 1 and dp = 2") != std::string::npos);
  }
}

TEST_CASE("graphs: the runtime reserves one int32 more (the step), within the state's alignment") {
  const po::Program program = po::build(po::parse_schedule("po-f"), {1, 2, 4});
  const auto held = [&](bool graphs) {
    std::size_t bytes = 0;
    po::comm::ThreadsWorld world(1);
    const auto errors = po::run_thread_ranks(world, [&](int r) {
      po::backend::Cpu dev({.rank = r});
      po::comm::Threads comm(world, r);
      std::vector<GptStage> layers;
      for (int c = 0; c < 2; ++c) layers.emplace_back(tiny, program.shape.stage_of(0, c), program.shape.stages());
      po::Runtime rt(program, dev, comm, std::span<GptStage>(layers), {.microbatch = {2, 8}, .graphs = graphs});
      bytes = dev.memory().device_held;
    });
    REQUIRE(errors[0] == "");
    return bytes;
  };
  const std::size_t without = held(false), with = held(true);
  CHECK(with >= without);
  CHECK(with - without <= 64);  // backend::Cpu's blocks are 64-byte aligned
}

}  // namespace
