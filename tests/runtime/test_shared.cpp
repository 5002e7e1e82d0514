// tests/runtime: shared parameters (po::SharedParam) on the GPT with tied embeddings: every
// family trains it bit-identically to one rank, with replicas and ZeRO-1; the primary's
// gradient is the holders' sum; the V placement sends nothing for the tie and another
// placement one message each way per step; checkpoints store the tensor once and resume on
// another cut; a wrong declaration is named.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>

#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

#include "pipeline_run.hpp"

namespace {

using pipeline_test::Run;
using pipeline_test::same;
using po::gpt::GptConfig;
using po::gpt::GptStage;

GptConfig tied_gpt() {
  return {.hidden = 16, .heads = 2, .layers = 4, .seq = 8, .dropout = 0.1f, .tie_embeddings = true};
}

using Options = pipeline_test::RunOptions<GptConfig>;

/// `steps` steps of `cfg` (the tied GPT) under `spec` with Layer stages.
template <class Layer = GptStage>
Run train(po::ScheduleSpec spec, po::Shape asked, int steps, Options o = {}, const GptConfig& cfg = tied_gpt()) {
  o.cfg = cfg;
  return pipeline_test::train<Layer>(spec, asked, steps, o);
}

/// A tied GPT stage that declares nothing shared (its head keeps its own (V, h) copy).
struct Untied : GptStage {
  using GptStage::GptStage;
  std::vector<po::SharedParam> shared_parameters() const { return {}; }
};

}  // namespace

TEST_CASE("shared parameters: the primary's gradient is the holders' sum, and every holder keeps its value") {
  // Standard path, one step: the tied run's wte gradient is the untied run's wte gradient plus
  // its head's (fp32, primary first), bit for bit; after the update both holders are equal.
  const auto [spec, shape] = pipeline_test::family("1f1b-i");
  const Options std_path{.gradients = po::Gradients::standard};
  const Run tied = train(spec, shape, 1, std_path);
  const Run untied = train<Untied>(spec, shape, 1, std_path);
  for (const auto& e : tied.errors) REQUIRE(e == "");
  for (const auto& e : untied.errors) REQUIRE(e == "");
  const std::size_t vh = 256 * 16;
  const po::gpt::GptDims last = po::gpt::gpt_dims(tied_gpt(), 3, 4);
  const std::size_t head_w = static_cast<std::size_t>(po::gpt::gpt_stage_params(last).head_begin + 2 * 16);
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
  const Run ref = train(pipeline_test::one_rank, {1, 1, 4}, steps);
  for (const auto& e : ref.errors) REQUIRE(e == "");
  CHECK(ref.losses[0] > ref.losses[2]);
  CHECK(ref.sent == std::vector<int>{0});
  for (const std::string& name : pipeline_test::schedule_names()) {
    CAPTURE(name);
    const auto [spec, shape] = pipeline_test::family(name);
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
  for (const po::Gradients g : {po::Gradients::exact, po::Gradients::standard}) {
    CAPTURE(po::gradients_name(g));
    // The reference: one rank, the whole global batch (8 microbatches).
    const Run ref = train(pipeline_test::one_rank, {1, 1, 8}, steps, {.gradients = g});
    for (const auto& e : ref.errors) REQUIRE(e == "");
    for (const std::string name : {"zb-v", "1f1b-i"}) {
      CAPTURE(name);
      const auto [spec, shape] = pipeline_test::family(name);
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
  const auto [spec, shape] = pipeline_test::family("1f1b-i");
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
        pipeline_test::family("zb-v")}) {
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
  const auto [spec, shape] = pipeline_test::family("1f1b-i");
  const Run alone = train<Wrong<0>>(spec, shape, 1, {}, {.hidden = 16, .heads = 2, .layers = 4, .seq = 8});
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
  CHECK_MESSAGE(unknown.errors[0].find("stage 0 (gpt::GptStage) shares tensor 'embedding' under key 'wte', which its "
                                       "parameter_info() does not name") != std::string::npos,
                unknown.errors[0]);
}
