// tests/runtime: shared parameters (po::SharedParam) on the GPT with tied embeddings: every
// family trains it bit-identically to one rank, with replicas and ZeRO-1; the primary's
// gradient is the holders' sum; the V placement sends nothing for the tie and another
// placement one message each way per step; checkpoints store the tensor once and resume on
// another cut; a wrong declaration is named.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

namespace {

using po::model::GptConfig;
using po::model::GptStage;

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

GptConfig tied_gpt() {
  return {.hidden = 16, .heads = 2, .layers = 4, .seq = 8, .dropout = 0.1f, .tie_embeddings = true};
}

struct Run {
  std::vector<float> losses;
  std::vector<float> params;  // every stage's, in model order
  std::vector<std::vector<float>> by_stage;
  std::vector<std::vector<float>> grads;  // every stage's gradients after the last step's pass (before the update)
  std::vector<std::string> errors;
  std::vector<int> sent;  // shared-parameter messages each pipeline rank of replica 0 sent
};

struct Options {
  int dp = 1, zero = 0;
  po::Gradients gradients = po::Gradients::exact;
  GptConfig cfg = tied_gpt();
  std::filesystem::path save_dir{}, load_dir{};
  int save_after = -1, first_step = 0;
};

/// `steps` steps of the tied GPT under `spec`, dp replicas of `shape` (a global batch of
/// dp * m microbatches, replica-major), with Layer stages.
template <class Layer = GptStage>
Run train(po::ScheduleSpec spec, po::Shape asked, int steps, const Options& o = {}) {
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
  run.errors = po::run_thread_ranks(grid, [&](int g) {
    const int r = g % shape.d, j = g / shape.d;
    po::backend::Cpu dev({.rank = r});
    Counting comm(grid.pipeline(g), &sent[static_cast<std::size_t>(g)]);
    Counting reps(grid.replicas(g), &sent[static_cast<std::size_t>(g)]);
    std::vector<Layer> layers;
    for (int c = 0; c < shape.v; ++c) layers.emplace_back(o.cfg, shape.stage_of(r, c), shape.stages());
    po::Runtime rt(program, dev, comm, reps, std::span<Layer>(layers), {.microbatch = mbs, .gradients = o.gradients});
    po::AdamW opt(rt, {.weight_decay = 0.1f, .zero = o.zero});
    const std::size_t per = static_cast<std::size_t>(mbs.tokens()) * static_cast<std::size_t>(shape.m);
    std::vector<std::int32_t> tok(per), tgt(per);
    if (!o.load_dir.empty()) po::load_checkpoint(o.load_dir, rt, opt, 42);
    for (int s = o.first_step; s < steps; ++s) {
      for (std::size_t i = 0; i < per; ++i) {
        const std::size_t k = static_cast<std::size_t>(j) * per + i;  // position in the global batch
        tok[i] = static_cast<std::int32_t>((k * 31 + static_cast<std::size_t>(s) * 7) % 256);
        tgt[i] = static_cast<std::int32_t>((k * 17 + 3) % 256);
      }
      po::Batch batch;
      batch.add("tokens", tok, {shape.m * mbs.batch, mbs.seq}).add("targets", tgt, {shape.m * mbs.batch, mbs.seq});
      rt.zero_grad();
      const po::PassStats st = rt.forward_backward(batch, {.step = s});
      if (s + 1 == steps && j == 0) {
        std::lock_guard lk(mu);
        for (int c = 0; c < shape.v; ++c)
          run.grads[static_cast<std::size_t>(shape.stage_of(r, c))] = rt.download_gradients(c);
      }
      opt.step(lr(s), po::clip_scale(po::grad_norm(rt), 0.5f));
      if (g == 0) run.losses[static_cast<std::size_t>(s)] = st.loss;
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

/// A tied GPT stage that declares nothing shared (its head keeps its own (V, h) copy).
struct Untied : GptStage {
  using GptStage::GptStage;
  std::vector<po::SharedParam> shared_parameters() const { return {}; }
};

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The schedule's spec and a shape of d = 2 for it (v = 2 where the family takes it).
std::pair<po::ScheduleSpec, po::Shape> family(const std::string& name, int m = 4) {
  po::ScheduleSpec spec = po::parse_schedule(name, 1);
  for (const int v : {2, 1}) try {
      return {spec, po::build(spec, {2, v, m}).shape};  // with the family's placement
    } catch (const std::exception&) {
    }
  throw std::runtime_error("no shape for " + name);
}

std::vector<std::string> names() {
  std::vector<std::string> out;
  std::string all = po::schedule_names;
  for (std::size_t a = 0; a < all.size();) {
    const std::size_t b = std::min(all.find(',', a), all.size());
    out.push_back(all.substr(a, b - a));
    a = b + 2;
  }
  return out;
}

}  // namespace

TEST_CASE("shared parameters: the primary's gradient is the holders' sum, and every holder keeps its value") {
  // Standard path, one step: the tied run's wte gradient is the untied run's wte gradient plus
  // its head's (fp32, primary first), bit for bit; after the update both holders are equal.
  const auto [spec, shape] = family("1f1b-i");
  const Options std_path{.gradients = po::Gradients::standard};
  const Run tied = train(spec, shape, 1, std_path);
  const Run untied = train<Untied>(spec, shape, 1, std_path);
  for (const auto& e : tied.errors) REQUIRE(e == "");
  for (const auto& e : untied.errors) REQUIRE(e == "");
  const std::size_t vh = 256 * 16;
  const po::model::GptDims last = po::model::gpt_dims(tied_gpt(), 3, 4);
  const std::size_t head_w = static_cast<std::size_t>(po::model::gpt_stage_params(last).head_begin + 2 * 16);
  std::vector<float> sum(vh);
  for (std::size_t i = 0; i < vh; ++i) sum[i] = untied.grads[0][i] + untied.grads[3][head_w + i];
  CHECK(same(std::vector<float>(tied.grads[0].begin(), tied.grads[0].begin() + vh), sum));
  CHECK(std::vector<float>(tied.by_stage[0].begin(), tied.by_stage[0].begin() + vh) ==
        std::vector<float>(tied.by_stage[3].begin() + static_cast<std::ptrdiff_t>(head_w),
                           tied.by_stage[3].begin() + static_cast<std::ptrdiff_t>(head_w + vh)));
  // Untied, the two copies part after one update.
  CHECK(std::vector<float>(untied.by_stage[0].begin(), untied.by_stage[0].begin() + vh) !=
        std::vector<float>(untied.by_stage[3].begin() + static_cast<std::ptrdiff_t>(head_w),
                           untied.by_stage[3].begin() + static_cast<std::ptrdiff_t>(head_w + vh)));
}

TEST_CASE(
    "shared parameters: tied embeddings train bit-identically to one rank under every family; the V placement "
    "sends nothing for the tie, the others one message each way per step") {
  const int steps = 3;
  const Run ref = train({po::Family::grouped, {po::GroupSpec::Kind::full, 0}, po::offload::none}, {1, 1, 4}, steps);
  for (const auto& e : ref.errors) REQUIRE(e == "");
  CHECK(ref.losses[0] > ref.losses[2]);
  CHECK(ref.sent == std::vector<int>{0});
  for (const std::string& name : names()) {
    CAPTURE(name);
    const auto [spec, shape] = family(name);
    const Run run = train(spec, shape, steps);
    for (const auto& e : run.errors) REQUIRE(e == "");
    CHECK(same(run.losses, ref.losses));
    CHECK(same(run.params, ref.params));
    // Stage 0 and stage 3 on one rank (the V) send nothing; on two ranks, the primary's rank
    // sends the values once at construction and once a step, the other rank its gradients once a step.
    if (shape.rank_of(0) == shape.rank_of(shape.stages() - 1))
      CHECK(run.sent == std::vector<int>{0, 0});
    else
      CHECK(run.sent == std::vector<int>{steps + 1, steps});
  }
}

TEST_CASE("shared parameters: two replicas with ZeRO-1, standard and exact, V and interleaved placements") {
  const int steps = 2;
  const po::ScheduleSpec one{po::Family::grouped, {po::GroupSpec::Kind::full, 0}, po::offload::none};
  for (const po::Gradients g : {po::Gradients::exact, po::Gradients::standard}) {
    CAPTURE(po::gradients_name(g));
    // The reference: one rank, the whole global batch (8 microbatches).
    const Run ref = train(one, {1, 1, 8}, steps, {.gradients = g});
    for (const auto& e : ref.errors) REQUIRE(e == "");
    for (const std::string name : {"zb-v", "1f1b-i"}) {
      CAPTURE(name);
      const auto [spec, shape] = family(name);
      for (const int zero : {0, 1}) {
        CAPTURE(zero);
        const Run run = train(spec, shape, steps, {.dp = 2, .zero = zero, .gradients = g});
        for (const auto& e : run.errors) REQUIRE(e == "");
        if (g == po::Gradients::exact) {
          CHECK(same(run.losses, ref.losses));
          CHECK(same(run.params, ref.params));
        } else {  // the standard path sums replicas in another order than one rank: close, not equal
          for (std::size_t i = 0; i < ref.params.size(); ++i)
            REQUIRE(std::abs(run.params[i] - ref.params[i]) <= 1e-5f + 1e-4f * std::abs(ref.params[i]));
        }
      }
    }
  }
}

TEST_CASE("shared parameters: a checkpoint stores the tensor once and resumes on another cut, bitwise") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("po_test_shared_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto [spec, shape] = family("1f1b-i");
  const Run whole = train(spec, shape, 4);
  for (const auto& e : whole.errors) REQUIRE(e == "");
  const Run first = train(spec, shape, 2, {.save_dir = dir, .save_after = 2});
  for (const auto& e : first.errors) REQUIRE(e == "");
  // Stage 3's file names no lm_head.weight and holds its other parameters only.
  const std::filesystem::path f3 = po::checkpoint::stage_file(dir, 2, 3);
  const po::checkpoint::StageState s3 = po::checkpoint::decode(po::checkpoint::read_all(f3), f3.string());
  for (const po::ParamInfo& t : s3.tensors) CHECK(t.name != "lm_head.weight");
  GptStage last(tied_gpt(), 3, 4);
  CHECK(s3.params.size() == last.parameters().size() - 256 * 16);
  CHECK(s3.state[0].size() == s3.params.size());
  // Resumed by the same cut, by one rank (one stage holding both) and by the V (2 stages on 1 rank... 4 on 2).
  for (const auto& [sp, sh] :
       {std::pair{spec, shape},
        std::pair{po::ScheduleSpec{po::Family::grouped, {po::GroupSpec::Kind::full, 0}, po::offload::none},
                  po::Shape{1, 1, 4}},
        family("zb-v")}) {
    CAPTURE(sh.stages());
    const Run resumed = train(sp, sh, 4, {.load_dir = dir, .first_step = 2});
    for (const auto& e : resumed.errors) REQUIRE(e == "");
    CHECK(std::memcmp(resumed.losses.data() + 2, whole.losses.data() + 2, 2 * sizeof(float)) == 0);
    CHECK(same(resumed.params, whole.params));
  }
  std::filesystem::remove_all(dir);
}

namespace {
/// A GPT stage 0 that shares `tensor` under `key` (and nothing else on other stages).
template <int Which>
struct Wrong : GptStage {
  using GptStage::GptStage;
  std::vector<po::SharedParam> shared_parameters() const {
    if (Which == 0) return first() ? std::vector<po::SharedParam>{{"wte", "alone"}} : std::vector<po::SharedParam>{};
    if (Which == 1) return first() ? std::vector<po::SharedParam>{{"wpe", "wte"}} : GptStage::shared_parameters();
    return first() ? std::vector<po::SharedParam>{{"embedding", "wte"}} : GptStage::shared_parameters();
  }
  bool first() const { return embeds(); }
};
}  // namespace

TEST_CASE("shared parameters: a key with one holder, tensors of two shapes and an unknown name are named") {
  const auto [spec, shape] = family("1f1b-i");
  const Run alone = train<Wrong<0>>(spec, shape, 1, {.cfg = {.hidden = 16, .heads = 2, .layers = 4, .seq = 8}});
  for (const std::string& e : alone.errors)
    CHECK_MESSAGE(e.find("only tensor 'wte' of stage 0 shares a parameter under key 'alone'; a shared parameter needs "
                         "two holders or more") != std::string::npos,
                  e);
  const Run shapes = train<Wrong<1>>(spec, shape, 1);
  for (const std::string& e : shapes.errors)
    CHECK_MESSAGE(e.find("the tensors shared under key 'wte' differ: tensor 'wpe' of stage 0 is float32 [8, 16] and "
                         "tensor 'lm_head.weight' of stage 3 is float32 [256, 16]") != std::string::npos,
                  e);
  const Run unknown = train<Wrong<2>>(spec, shape, 1);
  CHECK_MESSAGE(unknown.errors[0].find("stage 0 (model::GptStage) shares tensor 'embedding' under key 'wte', which its "
                                       "parameter_info() does not name") != std::string::npos,
                unknown.errors[0]);
}
