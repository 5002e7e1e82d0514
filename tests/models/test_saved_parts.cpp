// tests/models: the models' saved_parts() (po::SavedPart). For the CPU GPT and Llama stages
// and the CUDA stages' layouts: the parts tile [0, saved_bytes) in backward_input's reading
// order (the head, then the blocks last to first). For the CPU stages: a B whose saved buffer
// gets each part only when it awaits it (a reload, simulated) gives the bytes of a B that has
// the whole buffer, and awaits every part once, in order.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda_layout.hpp>
#include <models/llama/cpu.hpp>
#include <models/llama/cuda_layout.hpp>
#include <pipeoffload/packing.hpp>
#include <pipeoffload/plan/model.hpp>

namespace {

namespace po = pipeoffload;
using po::SavedPart;

/// The parts tile [0, saved) from its end down: each part ends where the one before begins,
/// the first at `saved`, the last at 0; `expect` parts, the first `first_bytes` long (when > 0).
void check_tiling(const std::vector<SavedPart>& parts, std::size_t saved, std::size_t expect, std::size_t first_bytes) {
  if (saved == 0) {
    CHECK(parts.empty());
    return;
  }
  REQUIRE(parts.size() == expect);
  std::size_t end = saved;
  for (const SavedPart& p : parts) {
    CHECK(p.bytes > 0);
    CHECK(p.offset + p.bytes == end);
    end = p.offset;
  }
  CHECK(end == 0);
  if (first_bytes > 0) CHECK(parts.front().bytes == first_bytes);
}

/// check_tiling for a stage of `blocks` blocks of `block` bytes, `per` a part, and a head of
/// `head` bytes (0: none): the head's part first, then ceil(blocks / per) parts, the first full.
void check_stage(const std::vector<SavedPart>& parts, std::size_t saved, int blocks, int per, std::size_t block,
                 std::size_t head) {
  CHECK(saved == static_cast<std::size_t>(blocks) * block + head);
  check_tiling(parts, saved, static_cast<std::size_t>((blocks + per - 1) / per) + (head > 0 ? 1 : 0),
               head > 0 ? head : static_cast<std::size_t>(std::min(blocks, per)) * block);
}

std::vector<float> noise(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(po::ops::mix64(seed, i) >> 40) / 16777216.0f - 0.5f;
  return v;
}

/// The runtime's reload, simulated: await_saved(i) copies part i from `src` into `dst`.
struct Reload {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::vector<SavedPart> parts;
  std::vector<int> awaited;
  static void wait(void* self, int part) {
    auto* r = static_cast<Reload*>(self);
    REQUIRE(part == static_cast<int>(r->awaited.size()));  // in order, each once
    REQUIRE(part < static_cast<int>(r->parts.size()));
    const SavedPart& p = r->parts[static_cast<std::size_t>(part)];
    std::memcpy(r->dst + p.offset, r->src + p.offset, p.bytes);
    r->awaited.push_back(part);
  }
};

/// Forward, then B twice: on the whole saved buffer, and on a poisoned (0xff: NaN) buffer that
/// gets each part as B awaits it. Both B's must write the same dx and stash bytes.
template <class Stage>
void check_reload(Stage& st, int stage, int stages, bool packed, int vocab) {
  const po::MicrobatchShape sh{2, 8};
  const std::size_t T = static_cast<std::size_t>(sh.tokens()), H = st.input_boundary(sh).elements / T;
  std::vector<std::int32_t> tok(T), tgt(T);
  for (std::size_t i = 0; i < T; ++i) {
    tok[i] = static_cast<std::int32_t>(po::ops::mix64(7, i) % static_cast<std::uint64_t>(vocab));
    tgt[i] = static_cast<std::int32_t>(po::ops::mix64(8, i) % static_cast<std::uint64_t>(vocab));
  }
  tok[3] = tok[12] = 0;  // packed: documents open at id 0
  const std::vector<std::int32_t> offsets = po::document_offsets(tok, sh.seq, 0);
  std::vector<po::StepInput> in = {{"tokens", po::ConstTensor(po::view(tok)), po::ConstTensor(po::view(tok))},
                                   {"targets", po::ConstTensor(po::view(tgt)), po::ConstTensor(po::view(tgt))}};
  if (packed)
    in.push_back({po::document_offsets_input, po::ConstTensor(po::view(offsets)), po::ConstTensor(po::view(offsets))});
  po::backend::CpuContext ctx;
  float loss = 0;
  po::Microbatch mb;
  mb.stage = stage;
  mb.stages = stages;
  mb.shape = sh;
  mb.step = 1;
  mb.inputs = in;
  mb.loss = stage == stages - 1 ? &loss : nullptr;
  const bool first = stage == 0, last = stage == stages - 1;
  const std::vector<float> x = noise(T * H, 11), dy = noise(T * H, 12);
  std::vector<float> y(T * H);
  const std::size_t saved_bytes = st.saved_bytes(sh), stash_bytes = st.stash_bytes(sh);
  std::vector<std::byte> saved(saved_bytes);
  st.forward(ctx, mb, first ? po::ConstTensor{} : po::ConstTensor(po::view(x)), last ? po::Tensor{} : po::view(y),
             saved.data());

  const auto backward = [&](std::byte* buf, std::vector<std::byte>& stash, std::vector<float>& dx) {
    stash.assign(stash_bytes, std::byte{0});
    dx.assign(T * H, 0.0f);
    st.backward_input(ctx, mb, last ? po::ConstTensor{} : po::ConstTensor(po::view(dy)),
                      first ? po::Tensor{} : po::view(dx), buf, stash.data());
  };
  std::vector<std::byte> whole = saved, stash_whole, stash_parts;
  std::vector<float> dx_whole, dx_parts;
  backward(whole.data(), stash_whole, dx_whole);

  Reload r;
  std::vector<std::byte> poisoned(saved_bytes, std::byte{0xff});
  r.src = saved.data();
  r.dst = poisoned.data();
  r.parts = st.saved_parts(sh);
  const po::detail::SavedWait w{&Reload::wait, &r};
  mb.saved_wait = &w;
  backward(poisoned.data(), stash_parts, dx_parts);
  mb.saved_wait = nullptr;
  CHECK(r.awaited.size() == r.parts.size());
  CHECK(std::memcmp(stash_whole.data(), stash_parts.data(), stash_bytes) == 0);
  CHECK(std::memcmp(dx_whole.data(), dx_parts.data(), T * H * sizeof(float)) == 0);
}

struct Cut {
  int stages;
  std::vector<int> blocks;  // GptConfig / LlamaConfig::stage_blocks (empty: even)
};
const std::vector<Cut> cuts = {{1, {}}, {3, {}}, {3, {0, 4, 0}}, {4, {1, 0, 2, 1}}, {2, {4, 0}}};

}  // namespace

TEST_CASE("saved parts: gpt::GptStage's tile its saved bytes, head first, blocks last to first") {
  const po::MicrobatchShape sh{2, 8};
  for (const Cut& cut : cuts)
    for (const bool recompute : {true, false})
      for (const bool packed : {false, true})
        for (int s = 0; s < cut.stages; ++s) {
          CAPTURE(cut.stages);
          CAPTURE(s);
          CAPTURE(recompute);
          CAPTURE(packed);
          const po::gpt::GptConfig cfg{.vocab = 32,
                                       .hidden = 16,
                                       .heads = 2,
                                       .layers = 4,
                                       .seq = 8,
                                       .recompute = recompute,
                                       .tie_embeddings = packed,
                                       .packed = packed,
                                       .stage_blocks = cut.blocks};
          po::gpt::GptStage st(cfg, s, cut.stages);
          const po::gpt::GptDims d = po::gpt::gpt_dims(cfg, s, cut.stages);
          check_stage(st.saved_parts(sh), st.saved_bytes(sh), d.blocks, 1, po::gpt::gpt_cpu_bytes::block_saved(d, sh),
                      d.has_head ? po::gpt::gpt_cpu_bytes::head_saved(d, sh) : 0);
          check_reload(st, s, cut.stages, packed, cfg.vocab);
        }
}

TEST_CASE("saved parts: llama::LlamaStage's tile its saved bytes, head first, blocks last to first") {
  const po::MicrobatchShape sh{2, 8};
  for (const Cut& cut : cuts)
    for (const bool packed : {false, true})
      for (int s = 0; s < cut.stages; ++s) {
        CAPTURE(cut.stages);
        CAPTURE(s);
        CAPTURE(packed);
        const po::llama::LlamaConfig cfg{.vocab = 32,
                                         .hidden = 16,
                                         .heads = 4,
                                         .kv_heads = 2,
                                         .layers = 4,
                                         .seq = 8,
                                         .tie_embeddings = packed,
                                         .packed = packed,
                                         .stage_blocks = cut.blocks};
        po::llama::LlamaStage st(cfg, s, cut.stages);
        const po::llama::LlamaDims& d = st.dims();
        check_stage(st.saved_parts(sh), st.saved_bytes(sh), d.blocks, 1, po::llama::cpu_bytes::block_saved(d, sh),
                    d.has_head ? po::llama::cpu_bytes::head_saved(d, sh) : 0);
        check_reload(st, s, cut.stages, packed, cfg.vocab);
      }
}

TEST_CASE("saved parts: the CUDA GPT and Llama layouts' tile their saved bytes, head first, blocks last to first") {
  for (const Cut& cut : cuts)
    for (const bool recompute : {true, false})
      for (int s = 0; s < cut.stages; ++s)
        for (const long long tokens : {1LL, 16LL, 100LL}) {
          CAPTURE(cut.stages);
          CAPTURE(s);
          CAPTURE(recompute);
          CAPTURE(tokens);
          const po::gpt::GptConfig g{.vocab = 50,
                                     .hidden = 24,
                                     .heads = 2,
                                     .layers = 4,
                                     .seq = 8,
                                     .recompute = recompute,
                                     .stage_blocks = cut.blocks};
          const po::gpt::GptDims gd = po::gpt::gpt_dims(g, s, cut.stages);
          const po::gpt::GptStageBuffers gb = po::gpt::gpt_stage_buffers(gd, tokens);
          check_stage(po::gpt::gpt_cuda_saved_parts(gd, tokens), gb.saved_bytes, gd.blocks, 1, gb.block.bytes,
                      gb.head.bytes);
          const po::llama::LlamaConfig l{
              .vocab = 50, .hidden = 24, .heads = 4, .kv_heads = 2, .layers = 4, .seq = 8, .stage_blocks = cut.blocks};
          const po::llama::LlamaDims ld = po::llama::llama_dims(l, s, cut.stages);
          const po::llama::LlamaStageBuffers lb = po::llama::llama_cuda_buffers(ld, tokens);
          check_stage(po::llama::llama_cuda_saved_parts(ld, tokens), lb.saved_bytes, ld.blocks, 1, lb.block.bytes,
                      lb.head.bytes);
        }
}

TEST_CASE("saved parts: a stage of more blocks than po::max_reload_parts puts two blocks in a part") {
  const po::MicrobatchShape sh{2, 8};
  const int layers = po::max_reload_parts + 100;
  for (const Cut& cut : {Cut{1, {}}, Cut{2, {layers, 0}}, Cut{2, {0, layers}}})
    for (int s = 0; s < cut.stages; ++s) {
      CAPTURE(cut.stages);
      CAPTURE(s);
      const po::gpt::GptConfig g{
          .vocab = 8, .hidden = 4, .heads = 1, .layers = layers, .seq = 8, .stage_blocks = cut.blocks};
      po::gpt::GptStage gs(g, s, cut.stages);
      const po::gpt::GptDims gd = po::gpt::gpt_dims(g, s, cut.stages);
      const int gper = po::blocks_per_saved_part(gd.blocks, gd.has_head);
      CHECK(gper == (gd.blocks > 0 ? 2 : 1));
      CHECK(gs.saved_parts(sh).size() <= static_cast<std::size_t>(po::max_reload_parts));
      check_stage(gs.saved_parts(sh), gs.saved_bytes(sh), gd.blocks, gper, po::gpt::gpt_cpu_bytes::block_saved(gd, sh),
                  gd.has_head ? po::gpt::gpt_cpu_bytes::head_saved(gd, sh) : 0);
      check_reload(gs, s, cut.stages, false, g.vocab);
      const po::gpt::GptStageBuffers gb = po::gpt::gpt_stage_buffers(gd, sh.tokens());
      check_stage(po::gpt::gpt_cuda_saved_parts(gd, sh.tokens()), gb.saved_bytes, gd.blocks, gper, gb.block.bytes,
                  gb.head.bytes);

      const po::llama::LlamaConfig l{.vocab = 8,
                                     .hidden = 4,
                                     .heads = 1,
                                     .kv_heads = 1,
                                     .ffn = 8,
                                     .layers = layers,
                                     .seq = 8,
                                     .stage_blocks = cut.blocks};
      po::llama::LlamaStage ls(l, s, cut.stages);
      const po::llama::LlamaDims& ld = ls.dims();
      const int lper = po::blocks_per_saved_part(ld.blocks, ld.has_head);
      CHECK(lper == (ld.blocks > 0 ? 2 : 1));
      CHECK(ls.saved_parts(sh).size() <= static_cast<std::size_t>(po::max_reload_parts));
      check_stage(ls.saved_parts(sh), ls.saved_bytes(sh), ld.blocks, lper, po::llama::cpu_bytes::block_saved(ld, sh),
                  ld.has_head ? po::llama::cpu_bytes::head_saved(ld, sh) : 0);
      check_reload(ls, s, cut.stages, false, l.vocab);
      const po::llama::LlamaStageBuffers lb = po::llama::llama_cuda_buffers(ld, sh.tokens());
      check_stage(po::llama::llama_cuda_saved_parts(ld, sh.tokens()), lb.saved_bytes, ld.blocks, lper, lb.block.bytes,
                  lb.head.bytes);
    }
}

TEST_CASE("saved parts: the planner's reload shares are the CPU GPT stages' own") {
  // po::stage_costs times a schedule with the sample models' parts (Costs::reload_shares); on
  // the CPU backend they must be the shares of GptStage::saved_parts, or a plan would time
  // reloads the runtime does not make. (The planner's CPU GPT recomputes, as train_gpt's does.)
  for (const bool recompute : {true})
    for (const int stages : {1, 2, 4}) {
      CAPTURE(stages);
      po::gpt::GptConfig cfg;
      cfg.layers = 8;
      cfg.hidden = 32;
      cfg.heads = 4;
      cfg.seq = 16;
      cfg.vocab = 300;
      cfg.recompute = recompute;
      const po::MicrobatchShape mb{2, cfg.seq};
      const po::TransformerSpec m{.layers = cfg.layers,
                                  .hidden = cfg.hidden,
                                  .heads = cfg.heads,
                                  .query_groups = cfg.heads,
                                  .seq = cfg.seq,
                                  .micro_batch = mb.batch,
                                  .vocab = cfg.vocab,
                                  .recompute = recompute};
      std::vector<po::StageContent> cut;
      for (int s = 0; s < stages; ++s) {
        const po::gpt::GptDims d = po::gpt::gpt_dims(cfg, s, stages);
        cut.push_back({d.blocks, d.embeds, d.has_head});
      }
      const po::Costs c = po::stage_costs(m, cut, 1e12, 1, po::PlanBackend::cpu);
      REQUIRE(c.reload_shares.size() == static_cast<std::size_t>(stages));
      for (int s = 0; s < stages; ++s) {
        CAPTURE(s);
        const po::gpt::GptStage st(cfg, s, stages);
        const std::vector<double> want = po::saved_part_shares(st.saved_parts(mb));
        const std::vector<double>& got = c.reload_shares[static_cast<std::size_t>(s)];
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-12));
      }
    }
}
