// tests/runtime/pipeline_run.hpp: trains a model of any stage type on thread ranks under any
// schedule, with replicas, and returns what the tests compare bit for bit (losses, every
// stage's parameters and last gradients, the shared parameters' messages). Used by the
// shared-parameter and the Llama tests.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

namespace pipeline_test {

namespace po = pipeoffload;

/// Thread ranks that count the shared parameters' messages they send (tags with mb < 0).
class Counting : public po::comm::Threads {
 public:
  Counting(po::comm::Threads t, std::atomic<int>* sent) : po::comm::Threads(std::move(t)), sent_(sent) {}
  void send(const po::backend::CpuContext& ctx, int peer, po::Tag tag, std::span<const std::byte> data) {
    if (tag.mb < 0) ++*sent_;
    po::comm::Threads::send(ctx, peer, tag, data);
  }

 private:
  std::atomic<int>* sent_;
};

struct Run {
  std::vector<float> losses;
  std::vector<float> params;  // every stage's, in model order
  std::vector<std::vector<float>> by_stage;
  std::vector<std::vector<float>> grads;  // every stage's gradients after the last step's pass (before the update)
  std::vector<std::string> errors;
  std::vector<int> sent;                         // shared-parameter messages each pipeline rank of replica 0 sent
  std::vector<po::backend::MemoryStats> memory;  // global rank 0's PassStats::memory, a step (its last call)
};

template <class Config>
struct RunOptions {
  Config cfg{};
  int dp = 1, zero = 0;
  po::Gradients gradients = po::Gradients::exact;
  std::filesystem::path save_dir{}, load_dir{};
  int save_after = -1, first_step = 0;
  bool packed = false;  // each row holds one to three documents (packed_offsets), given as cu_seqlens
  bool graphs = false;  // RuntimeOptions::graphs
  int parts = 1;        // forward_backward calls a step (gradient accumulation), each of the batch's rows in turn
};

/// Document offsets of a microbatch row (8 tokens) at position `k` of the global batch: one
/// document (every fifth row), or three of lengths 1-3, 1-4 and the rest.
inline void packed_offsets(std::size_t k, std::int32_t* o) {
  std::fill(o, o + 9, 8);
  o[0] = 0;
  if (k % 5 == 0) return;
  o[1] = static_cast<std::int32_t>(1 + k % 3);
  o[2] = static_cast<std::int32_t>(4 + k % 4);
}

/// `steps` steps of the model `o.cfg` (stages Layer(cfg, stage, stages)) under `spec`, dp
/// replicas of `asked` (a global batch of dp * m microbatches of 2 x 8 tokens, replica-major).
template <class Layer, class Config>
Run train(po::ScheduleSpec spec, po::Shape asked, int steps, const RunOptions<Config>& o) {
  const po::MicrobatchShape mbs{2, 8};
  const po::Program program = po::build(spec, asked);
  const po::Shape& shape = program.shape;
  const po::WarmupCosine lr{.lr = 1e-2f, .warmup_steps = 1, .total_steps = 1000, .min_lr_ratio = 0.1f};
  po::comm::ThreadsGrid grid(o.dp, shape.d);
  Run run;
  run.losses.resize(static_cast<std::size_t>(steps));
  run.by_stage.resize(static_cast<std::size_t>(shape.stages()));
  run.grads.resize(static_cast<std::size_t>(shape.stages()));
  std::vector<std::atomic<int>> sent(static_cast<std::size_t>(shape.d * o.dp));
  std::mutex mu;
  const auto vocab = static_cast<std::size_t>(o.cfg.vocab);
  run.errors = po::run_thread_ranks(grid, [&](int g) {
    const int r = g % shape.d, j = g / shape.d;
    po::backend::Cpu dev({.rank = r});
    Counting comm(grid.pipeline(g), &sent[static_cast<std::size_t>(g)]);
    Counting reps(grid.replicas(g), &sent[static_cast<std::size_t>(g)]);
    std::vector<Layer> layers;
    for (int c = 0; c < shape.v; ++c) layers.emplace_back(o.cfg, shape.stage_of(r, c), shape.stages());
    po::Runtime rt(program, dev, comm, reps, std::span<Layer>(layers),
                   {.microbatch = mbs, .gradients = o.gradients, .graphs = o.graphs});
    po::AdamW opt(rt, {.weight_decay = 0.1f, .zero = o.zero});
    const std::size_t per = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(shape.m);
    std::vector<std::int32_t> tok(per), tgt(per);
    const std::size_t rows = per / static_cast<std::size_t>(mbs.seq);
    std::vector<std::int32_t> offsets(rows * 9);
    for (std::size_t q = 0; q < rows; ++q) packed_offsets(static_cast<std::size_t>(j) * rows + q, &offsets[q * 9]);
    if (!o.load_dir.empty()) po::load_checkpoint(o.load_dir, rt, opt, 42);
    for (int s = o.first_step; s < steps; ++s) {
      for (std::size_t i = 0; i < per; ++i) {
        const std::size_t k = static_cast<std::size_t>(j) * per + i;  // position in the global batch
        tok[i] = static_cast<std::int32_t>((k * 31 + static_cast<std::size_t>(s) * 7) % vocab);
        tgt[i] = static_cast<std::int32_t>((k * 17 + 3) % vocab);
      }
      po::Batch batch;
      batch.add("tokens", tok, {shape.m * mbs.batch, mbs.seq}).add("targets", tgt, {shape.m * mbs.batch, mbs.seq});
      if (o.packed) batch.add(po::document_offsets_input, offsets, {shape.m * mbs.batch, mbs.seq + 1});
      rt.zero_grad();
      po::PassStats st;
      for (int part = 0; part < o.parts; ++part) {  // (the same rows each part: enough to accumulate)
        st = rt.forward_backward(batch, {.step = s, .part = part, .parts = o.parts});
      }
      if (s + 1 == steps && j == 0) {
        std::lock_guard lk(mu);
        for (int c = 0; c < shape.v; ++c)
          run.grads[static_cast<std::size_t>(shape.stage_of(r, c))] = rt.download_gradients(c);
      }
      opt.step(lr(s), po::clip_scale(po::grad_norm(rt), 0.5f));
      if (g == 0) {
        run.losses[static_cast<std::size_t>(s)] = st.loss;
        run.memory.push_back(st.memory);
      }
      if (s + 1 == o.save_after) po::save_checkpoint(o.save_dir, rt, opt, {42, 1, s + 1});
    }
    if (j != 0) return;
    std::lock_guard lk(mu);
    for (int c = 0; c < shape.v; ++c) {
      auto p = layers[static_cast<std::size_t>(c)].parameters();
      run.by_stage[static_cast<std::size_t>(shape.stage_of(r, c))].assign(p.begin(), p.end());
    }
  });
  for (const auto& p : run.by_stage) run.params.insert(run.params.end(), p.begin(), p.end());
  for (int r = 0; r < shape.d; ++r) run.sent.push_back(sent[static_cast<std::size_t>(r)].load());
  return run;
}

inline bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The schedule's spec and a shape of d = 2 for it (v = 2 where the family takes it), with
/// the family's placement.
inline std::pair<po::ScheduleSpec, po::Shape> family(const std::string& name, int m = 4) {
  po::ScheduleSpec spec = po::parse_schedule(name, 1);
  for (const int v : {2, 1}) try {
      return {spec, po::build(spec, {2, v, m}).shape};
    } catch (const std::exception&) {
    }
  throw std::runtime_error("no shape for " + name);
}

/// Every schedule name (po::named_schedules).
inline std::vector<std::string> schedule_names() {
  std::vector<std::string> out;
  for (const po::NamedSchedule& e : po::named_schedules) out.emplace_back(e.name);
  return out;
}

/// One rank holding the whole model: the reference every pipelined run is held to.
inline const po::ScheduleSpec one_rank{po::Family::grouped, {po::GroupSpec::Kind::full, 0}, po::offload::none};

/// `steps` steps of `o` on one rank (4 microbatches), then under every schedule family
/// (family()), each checked bit for bit against one rank (losses and parameters); returns one
/// rank's run.
template <class Layer, class Config>
Run check_every_family(const RunOptions<Config>& o, int steps) {
  const Run ref = train<Layer>(one_rank, {1, 1, 4}, steps, o);
  for (const auto& e : ref.errors) REQUIRE(e == "");
  for (const std::string& name : schedule_names()) {
    CAPTURE(name);
    const auto [spec, shape] = family(name);
    const Run run = train<Layer>(spec, shape, steps, o);
    for (const auto& e : run.errors) REQUIRE(e == "");
    CHECK(same(run.losses, ref.losses));
    CHECK(same(run.params, ref.params));
  }
  return ref;
}

/// Two replicas with ZeRO-1 under `name`, 4 microbatches each, against one rank of the same
/// global batch (8 microbatches), bit for bit.
template <class Layer, class Config>
void check_two_replicas(RunOptions<Config> o, int steps, const std::string& name) {
  const Run wide = train<Layer>(one_rank, {1, 1, 8}, steps, o);
  o.dp = 2;
  o.zero = 1;
  const auto [spec, shape] = family(name);
  const Run run = train<Layer>(spec, shape, steps, o);
  for (const auto& e : run.errors) REQUIRE(e == "");
  CHECK(same(run.losses, wide.losses));
  CHECK(same(run.params, wide.params));
}

}  // namespace pipeline_test
