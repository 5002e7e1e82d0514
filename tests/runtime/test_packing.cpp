// tests/runtime: packed sequences (pipeoffload/packing.hpp, LlamaConfig::packed,
// GptConfig::packed). The offsets' construction and checks; for both models, a packed microbatch's blocks computing every document's outputs and
// input gradients bit for bit independently of the rest of the microbatch, and as the document
// alone in a row of its own to float rounding (weight gradients the documents' sum, the loss
// their token-weighted mean); packed training bit-identical to one rank under every family.
// The GPT's embedding restarts its positions at every document.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/llama/cpu.hpp>
#include <pipeoffload/ops/math.hpp>
#include <pipeoffload/runtime.hpp>

#include "pipeline_run.hpp"

namespace {

using po::llama::LlamaConfig;
using po::llama::LlamaStage;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// One pass of a stage on a microbatch of `shape` (its inputs given by name), on the CPU.
template <class Stage>
struct Pass {
  Stage& stage;
  po::MicrobatchShape shape;
  std::vector<po::StepInput> inputs;
  float loss = 0;
  float loss_scale = 1;
  std::vector<std::byte> saved = std::vector<std::byte>(stage.saved_bytes(shape));
  std::vector<std::byte> stash = std::vector<std::byte>(stage.stash_bytes(shape));

  po::Microbatch mb() {
    return {.stage = 0, .stages = 1, .shape = shape, .inputs = inputs, .loss = &loss, .loss_scale = loss_scale};
  }
  std::vector<float> forward(po::backend::CpuContext& ctx, std::vector<float> x) {
    std::vector<float> y(x.size());
    stage.forward(ctx, mb(), po::view(std::as_const(x)), po::view(y), saved.data());
    return y;
  }
  std::vector<float> backward(po::backend::CpuContext& ctx, std::vector<float> dy) {
    std::vector<float> dx(dy.size());
    stage.backward_input(ctx, mb(), po::view(std::as_const(dy)), po::view(dx), saved.data(), stash.data());
    stage.backward_weight(ctx, mb(), saved.data(), stash.data());
    return dx;
  }
};

po::StepInput input(const char* name, const std::vector<std::int32_t>& v) {
  return {name, po::ConstTensor(po::view(v)), po::ConstTensor(po::view(v))};
}

std::vector<float> noise(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(static_cast<double>(po::ops::mix64(seed, i) >> 11) / 9007199254740992.0 - 0.5);
  return v;
}

}  // namespace

TEST_CASE("packing: offsets from a boundary token, and every malformed row refused with its row and value") {
  const std::vector<std::int32_t> tokens = {7, 1, 2, 7, 3, 7, 7, 4,  //
                                            5, 5, 5, 5, 5, 5, 5, 7};
  const std::vector<std::int32_t> o = po::document_offsets(tokens, 8, 7);
  CHECK(o == std::vector<std::int32_t>{0, 3, 5, 6, 8, 8, 8, 8, 8,  //
                                       0, 7, 8, 8, 8, 8, 8, 8, 8});
  std::vector<po::Document> docs;
  po::append_documents(o.data(), 2, 8, docs);
  REQUIRE(docs.size() == 6);
  const std::size_t want[6][3] = {{0, 0, 3}, {0, 3, 2}, {0, 5, 1}, {0, 6, 2}, {1, 0, 7}, {1, 7, 1}};
  for (std::size_t i = 0; i < docs.size(); ++i) {
    CHECK(docs[i].row == want[i][0]);
    CHECK(docs[i].begin == want[i][1]);
    CHECK(docs[i].length == want[i][2]);
  }
  CHECK(error_of([] { po::document_offsets(std::vector<std::int32_t>(7), 4, 0); }) ==
        "po::document_offsets: 7 tokens are not a whole number of rows of seq = 4");
  const auto refused = [](std::vector<std::int32_t> row) {
    std::vector<po::Document> d;
    return error_of([&] { po::append_documents(row.data(), 1, 4, d); });
  };
  const std::string rule = " (a row's seq + 1 offsets start at 0, never decrease and end at seq = 4)";
  CHECK(refused({1, 2, 4, 4, 4}) == "cu_seqlens row 0: offset 0 is 1; expected 0" + rule);
  CHECK(refused({0, 2, 4, 4, 3}) == "cu_seqlens row 0: offset 4 is 3; expected 4" + rule);
  CHECK(refused({0, 3, 2, 4, 4}) == "cu_seqlens row 0: offset 2 is 2; outside [3, 4]" + rule);
  CHECK(refused({0, 5, 4, 4, 4}) == "cu_seqlens row 0: offset 1 is 5; outside [0, 4]" + rule);
}

TEST_CASE("packing: the per-token functions a GPU runs agree with append_documents and microbatch_documents") {
  // Seeded random rows (documents of random lengths, repeats of seq after the last), then
  // row_documents, document_position and row_document_table against the host's documents.
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const int seq = 1 + static_cast<int>(po::ops::mix64(seed, 0) % 37);
    const std::size_t rows = 1 + po::ops::mix64(seed, 1) % 5;
    std::vector<std::int32_t> o(rows * static_cast<std::size_t>(seq + 1), seq);
    for (std::size_t r = 0; r < rows; ++r) {
      std::int32_t* row = o.data() + r * static_cast<std::size_t>(seq + 1);
      std::size_t k = 0;
      row[k++] = 0;
      for (int t = 1; t < seq; ++t)
        if (po::ops::mix64(seed, 100 + r * 64 + static_cast<std::size_t>(t)) % 4 == 0) row[k++] = t;
    }
    std::vector<po::Document> docs;
    std::vector<std::int32_t> positions;
    po::microbatch_documents(o.data(), rows, seq, docs, positions);
    // Room for three empty documents past the real ones (pad_document_table's padding).
    const std::size_t slots = docs.size() + 3;
    std::vector<std::int32_t> lengths(slots, -1);
    std::vector<std::int64_t> offsets[4];
    for (auto& x : offsets) x.assign(slots + 1, -1);
    const po::DocumentTableView t{
        lengths.data(), {offsets[0].data(), offsets[1].data(), offsets[2].data(), offsets[3].data()}, {1, 6, 3, 5}};
    long long first = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      const std::int32_t* row = o.data() + r * static_cast<std::size_t>(seq + 1);
      po::row_document_table(row, seq, static_cast<long long>(r), first, t);
      first += po::row_documents(row, seq);
      for (int j = 0; j < seq; ++j)
        CHECK(po::document_position(row, seq, j) ==
              positions[r * static_cast<std::size_t>(seq) + static_cast<std::size_t>(j)]);
    }
    REQUIRE(first == static_cast<long long>(docs.size()));
    for (std::size_t n = 0; n < docs.size(); ++n) {
      CHECK(lengths[n] == static_cast<std::int32_t>(docs[n].length));
      const long long start = static_cast<long long>(docs[n].row) * seq + static_cast<long long>(docs[n].begin);
      for (int x = 0; x < 4; ++x) CHECK(offsets[x][n] == start * t.widths[x]);
    }
    for (int x = 0; x < 4; ++x) CHECK(offsets[x][docs.size()] == static_cast<long long>(rows) * seq * t.widths[x]);
    // Nothing written past the real documents' table; then the padding: empty documents at the end.
    CHECK(lengths[docs.size()] == -1);
    CHECK(offsets[0][docs.size() + 1] == -1);
    const long long tokens = static_cast<long long>(rows) * seq;
    po::pad_document_table(static_cast<long long>(docs.size()), static_cast<long long>(slots), tokens, t);
    for (std::size_t n = docs.size(); n < slots; ++n) CHECK(lengths[n] == 0);
    for (std::size_t n = docs.size(); n <= slots; ++n)
      for (int x = 0; x < 4; ++x) CHECK(offsets[x][n] == tokens * t.widths[x]);
    CHECK(lengths[docs.size() - 1] == static_cast<std::int32_t>(docs.back().length));  // the real ones untouched
  }
}

TEST_CASE("packing: packed_rows checks both views of the offsets and lists the host's documents") {
  std::vector<std::int32_t> dev = {0, 3, 4, 4, 4, 0, 1, 4, 4, 4}, host = dev;  // 2 rows of 4 tokens
  std::vector<po::Document> docs;
  const auto mb = [&](const std::vector<std::int32_t>& d, const std::vector<std::int32_t>* h,
                      std::vector<po::StepInput>& in) {
    in = {{po::document_offsets_input, po::ConstTensor(po::view(d)),
           h != nullptr ? po::ConstTensor(po::view(*h)) : po::ConstTensor{}}};
    return po::Microbatch{.shape = {2, 4}, .inputs = in};
  };
  std::vector<po::StepInput> in;
  CHECK(po::packed_rows(mb(dev, &host, in), "L", docs) == dev.data());
  REQUIRE(docs.size() == 4);
  CHECK((docs[1].row == 0 && docs[1].begin == 3 && docs[1].length == 1));
  CHECK((docs[3].row == 1 && docs[3].begin == 1 && docs[3].length == 3));
  const std::vector<std::int32_t> short_dev(9, 0);
  CHECK(error_of([&] { po::packed_rows(mb(short_dev, &host, in), "L", docs); }) ==
        "L: the step input 'cu_seqlens' holds 9 int32 values; 2 packed rows of 4 tokens need rows * (seq + 1) = 10 "
        "int32");
  CHECK(error_of([&] { po::packed_rows(mb(dev, nullptr, in), "L", docs); }) ==
        "stage 0 reads the step input 'cu_seqlens' on the host, and its caller gave no host view (StepInput::host; "
        "po::Runtime gives one)");
  host[6] = 5;  // row 1's offset 1 beyond seq
  CHECK(error_of([&] { po::packed_rows(mb(dev, &host, in), "L", docs); }) ==
        "cu_seqlens row 1: offset 1 is 5; outside [0, 4] (a row's seq + 1 offsets start at 0, never decrease and end "
        "at seq = 4)");
}

// One stage that notes, in forward, where its host view of the step input "x" points and what
// it holds beside the device view's value (a GPU layer reads a packed row's documents there),
// and in what order the runtime calls its prepare() and its forwards.
struct HostViews {
  std::vector<const float*> where;
  std::vector<float> host, device;
  std::string order;  // "p<mb>" for prepare, "f<mb>" for forward
  void prepare(const po::Microbatch& mb) {
    order += "p" + std::to_string(mb.mb);
    CHECK(mb.host_input<float>("x") != nullptr);
  }
  float w = 1, gw = 0;
  po::Boundary input_boundary(po::MicrobatchShape) const { return {1}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {1}; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return 0; }
  std::size_t stash_bytes(po::MicrobatchShape) const { return 0; }
  std::vector<po::InputSpec> inputs(po::MicrobatchShape) const { return {{"x", po::DType::float32, 2}}; }
  void forward(po::backend::CpuContext&, const po::Microbatch& mb, po::ConstTensor, po::Tensor, std::byte*) {
    const float* h = mb.host_input<float>("x");
    order += "f" + std::to_string(mb.mb);
    where.push_back(h);
    host.insert(host.end(), h, h + 2);
    device.insert(device.end(), mb.input<float>("x"), mb.input<float>("x") + 2);
    if (mb.loss != nullptr) *mb.loss = w;  // (the last stage's only)
  }
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*,
                      std::byte*) {}
  void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte*, std::byte*) {}
  std::span<float> parameters() { return {&w, 1}; }
  std::span<float> gradients() { return {&gw, 1}; }
};

TEST_CASE(
    "step inputs: each pass's host view is its slice of the batch given to the call, beside the device copy; "
    "prepare() sees every microbatch before any pass runs") {
  const po::Program program = po::build(pipeline_test::one_rank, {1, 1, 3});
  po::comm::ThreadsWorld world(1);
  std::vector<HostViews> layers(1);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    po::Runtime rt(program, dev, comm, std::span<HostViews>(layers), {.microbatch = {1, 1}});
    for (int step = 0; step < 2; ++step) {
      const std::vector<float> x{1, 2, 3, 4, 5, 6 + static_cast<float>(step)};
      po::Batch batch;
      batch.add("x", x, {3, 2});
      rt.forward_backward(batch, {.step = step});
      for (std::size_t b = 0; b < 3; ++b)
        CHECK(layers[0].where[3 * static_cast<std::size_t>(step) + b] == x.data() + 2 * b);
    }
  });
  for (const auto& e : errors) REQUIRE(e == "");
  CHECK(layers[0].host == std::vector<float>{1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7});
  CHECK(layers[0].order == "p0p1p2f0f1f2p0p1p2f0f1f2");
  CHECK(layers[0].device == layers[0].host);
  // A caller of a pass that gives no host view (a layer's own test) is told so.
  float loss = 0, x[2] = {0, 0};
  const std::vector<po::StepInput> in{
      {"x", po::ConstTensor{reinterpret_cast<const std::byte*>(x), 2, po::DType::float32}, {}}};
  const po::Microbatch mb{.inputs = in, .loss = &loss};
  po::backend::CpuContext ctx{};
  CHECK(error_of([&] { layers[0].forward(ctx, mb, {}, {}, nullptr); }) ==
        "stage 0 reads the step input 'x' on the host, and its caller gave no host view (StepInput::host; "
        "po::Runtime gives one)");
  CHECK(error_of([&] { (void)mb.host_input("y"); }) ==
        "stage 0 reads the step input 'y', which it did not declare in inputs() (it declared: x)");
}

/// HostViews whose prepare() throws on its `fail_at`-th call, as a GPU layer refuses a
/// malformed row there.
struct RefusingPrepare : HostViews {
  int calls = 0, fail_at = 0;
  void prepare(const po::Microbatch& mb) {
    if (++calls == fail_at) throw po::error("stage refuses microbatch " + std::to_string(mb.mb));
    HostViews::prepare(mb);
  }
};

TEST_CASE("a prepare() that throws on one rank ends every rank with its message, before any pass of that call") {
  // Two ranks, one stage each; rank 1's stage refuses its 5th microbatch (the second step's
  // second): rank 0 has sent its forwards of that step or waits to, and must not hang.
  const po::Program program = po::build(po::parse_schedule("1f1b"), {2, 1, 3});
  po::comm::ThreadsWorld world(2);
  std::vector<RefusingPrepare> layers(2);
  layers[1].fail_at = 5;
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    po::Runtime rt(program, dev, comm, std::span<RefusingPrepare>(&layers[static_cast<std::size_t>(r)], 1),
                   {.microbatch = {1, 1}});
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> x(6, 1.0f);
      po::Batch batch;
      batch.add("x", x, {3, 2});
      rt.forward_backward(batch, {.step = step});
    }
  });
  REQUIRE(errors.size() == 2);
  CHECK(errors[1] == "rank 1, forward_backward: stage refuses microbatch 1");
  CHECK(errors[0].find("rank 1, forward_backward: stage refuses microbatch 1") != std::string::npos);
  // Rank 1 ran no pass of the refused call: its first step's three forwards only.
  CHECK(layers[1].order == "p0p1p2f0f1f2p0");
}

/// The checks of the case below on a model whose stage 1 of 3 holds every block (stage 0 the
/// embedding, stage 2 the head): `cfg` unpacked.
template <class Stage, class Config>
void check_documents(Config cfg, const std::string& model) {
  // Three stages: the embedding, every block, the head; the middle one (attention, RoPE) is
  // where packing acts, checked on random inputs and output gradients. Bit for bit, a
  // document's outputs and input gradients do not depend on anything else in its microbatch:
  // the same document at the same place among other tokens and other documents gives the same
  // bits. Against the document alone in a row of its own (shape 1 x length, positions from 0)
  // the values agree to float rounding only: OpenBLAS's GEMMs round a row's results
  // differently for different row counts (its transposed-operand kernels at any width, the
  // plain ones from k = 768 on, measured), so equal bits there would be an accident of sizes.
  {
    cfg.stage_blocks = {0, 2, 0};
    Config packed_cfg = cfg;
    packed_cfg.packed = true;
    Stage packed(packed_cfg, 1, 3), alone(cfg, 1, 3);
    REQUIRE(pipeline_test::same(std::vector<float>(packed.parameters().begin(), packed.parameters().end()),
                                std::vector<float>(alone.parameters().begin(), alone.parameters().end())));
    // Rows of 16 tokens: documents of 5, 1 and 10; one of 16; 2, 13 and 1.
    const auto row = [](std::vector<std::int32_t> starts) {
      starts.resize(17, 16);
      return starts;
    };
    const auto rows = [](std::vector<std::vector<std::int32_t>> r) {
      std::vector<std::int32_t> all;
      for (const auto& x : r) all.insert(all.end(), x.begin(), x.end());
      return all;
    };
    const std::vector<std::int32_t> offsets = rows({row({0, 5, 6}), row({0}), row({0, 2, 15})});
    const po::MicrobatchShape sh{3, 16};
    const std::size_t h = 32, T = 48;
    CHECK(packed.inputs(sh).size() == 1);
    CHECK(packed.inputs(sh)[0].elements == 3 * 17);
    CHECK(alone.inputs(sh).empty());
    po::backend::CpuContext ctx;
    const std::vector<float> x = noise(T * h, 11), dy = noise(T * h, 12);
    Pass<Stage> p{packed, sh, {input(po::document_offsets_input, offsets)}};
    const std::vector<float> y = p.forward(ctx, x), dx = p.backward(ctx, dy);
    const std::vector<float> packed_grads(packed.gradients().begin(), packed.gradients().end());

    std::vector<po::Document> docs;
    po::append_documents(offsets.data(), 3, 16, docs);
    REQUIRE(docs.size() == 7);
    std::vector<double> summed(alone.gradients().size(), 0.0);
    double worst_y = 0, worst_dx = 0, largest_y = 0, largest_dx = 0;
    for (const po::Document& d : docs) {
      CAPTURE(d.row);
      CAPTURE(d.begin);
      const std::size_t first = (d.row * 16 + d.begin) * h, n = d.length * h;
      // Everything else replaced: other tokens' values and gradients, and the other documents
      // (one before it in its row, one after, one per other row).
      std::vector<float> x2 = noise(T * h, 100 + first), dy2 = noise(T * h, 200 + first);
      std::copy(x.begin() + first, x.begin() + first + n, x2.begin() + first);
      std::copy(dy.begin() + first, dy.begin() + first + n, dy2.begin() + first);
      std::vector<std::vector<std::int32_t>> other = {row({0}), row({0}), row({0})};
      other[d.row] = row(d.begin > 0 ? std::vector<std::int32_t>{0, static_cast<std::int32_t>(d.begin),
                                                                 static_cast<std::int32_t>(d.begin + d.length)}
                                     : std::vector<std::int32_t>{0, static_cast<std::int32_t>(d.length)});
      const std::vector<std::int32_t> offsets2 = rows(other);
      Pass<Stage> p2{packed, sh, {input(po::document_offsets_input, offsets2)}};
      const std::vector<float> y2 = p2.forward(ctx, x2), dx2 = p2.backward(ctx, dy2);
      CHECK(std::memcmp(y2.data() + first, y.data() + first, n * sizeof(float)) == 0);
      CHECK(std::memcmp(dx2.data() + first, dx.data() + first, n * sizeof(float)) == 0);
      // Alone, positions from 0.
      std::fill(alone.gradients().begin(), alone.gradients().end(), 0.0f);
      Pass<Stage> a{alone, {1, static_cast<int>(d.length)}, {}};
      const std::vector<float> ya = a.forward(ctx, {x.begin() + first, x.begin() + first + n});
      const std::vector<float> dxa = a.backward(ctx, {dy.begin() + first, dy.begin() + first + n});
      for (std::size_t i = 0; i < n; ++i) {
        worst_y = std::max(worst_y, static_cast<double>(std::abs(ya[i] - y[first + i])));
        worst_dx = std::max(worst_dx, static_cast<double>(std::abs(dxa[i] - dx[first + i])));
        largest_y = std::max(largest_y, static_cast<double>(std::abs(y[first + i])));
        largest_dx = std::max(largest_dx, static_cast<double>(std::abs(dx[first + i])));
      }
      for (std::size_t i = 0; i < summed.size(); ++i) summed[i] += alone.gradients()[i];
    }
    // Float rounding of a few dozen terms per value (relative to the largest value).
    CHECK(worst_y <= 1e-6 * largest_y);
    CHECK(worst_dx <= 1e-5 * largest_dx);
    // Weight gradients sum over tokens in another order: float rounding of sums of 48 terms.
    double worst = 0, largest = 0;
    for (std::size_t i = 0; i < summed.size(); ++i) {
      worst = std::max(worst, std::abs(summed[i] - packed_grads[i]));
      largest = std::max(largest, std::abs(summed[i]));
    }
    CHECK(largest > 0);
    CHECK(worst <= 1e-5 * largest);
    MESSAGE(model << ": alone vs packed, outputs within " << worst_y / largest_y << ", input gradients "
                  << worst_dx / largest_dx << ", weight gradients " << worst / largest << " of the largest");
    // Unpacked, the same rows (positions running on, attention across documents) are far off.
    std::fill(alone.gradients().begin(), alone.gradients().end(), 0.0f);
    Pass<Stage> u{alone, sh, {}};
    const std::vector<float> yu = u.forward(ctx, x);
    double off = 0;
    for (std::size_t i = 5 * h; i < T * h; ++i) off = std::max(off, static_cast<double>(std::abs(yu[i] - y[i])));
    CHECK(off > 1e-3 * largest_y);
    // Without the offsets, the stage says which input it lacks.
    Pass<Stage> missing{packed, sh, {}};
    CHECK(error_of([&] { missing.forward(ctx, x); }).find("reads the step input 'cu_seqlens'") != std::string::npos);
  }
}

TEST_CASE("Llama: a packed microbatch computes each document independently of the others, as the document alone") {
  for (const int kv_heads : {1, 2, 4}) {
    CAPTURE(kv_heads);
    check_documents<LlamaStage>(
        LlamaConfig{.vocab = 64, .hidden = 32, .heads = 4, .kv_heads = kv_heads, .layers = 2, .seq = 16},
        "Llama, kv_heads " + std::to_string(kv_heads));
  }
}

TEST_CASE("GPT: a packed microbatch computes each document independently of the others, as the document alone") {
  check_documents<po::gpt::GptStage>(
      po::gpt::GptConfig{.vocab = 64, .hidden = 32, .heads = 4, .layers = 2, .seq = 16, .dropout = 0.0f}, "GPT");
  // The embedding: positions restart at every document (the position table's rows 0, 1, ...).
  po::gpt::GptConfig cfg{.vocab = 64, .hidden = 32, .heads = 4, .layers = 2, .seq = 16, .dropout = 0.0f};
  cfg.stage_blocks = {0, 2};
  po::gpt::GptConfig packed_cfg = cfg;
  packed_cfg.packed = true;
  po::gpt::GptStage packed(packed_cfg, 0, 2), alone(cfg, 0, 2);
  std::vector<std::int32_t> tok(16);
  for (std::size_t i = 0; i < 16; ++i) tok[i] = static_cast<std::int32_t>((i * 11 + 3) % 64);
  const std::vector<std::int32_t> offsets = {0, 6, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
  po::backend::CpuContext ctx;
  Pass<po::gpt::GptStage> p{packed, {1, 16}, {input("tokens", tok), input(po::document_offsets_input, offsets)}};
  const std::vector<float> y = p.forward(ctx, std::vector<float>(16 * 32));
  const std::vector<std::int32_t> second(tok.begin() + 6, tok.end());
  Pass<po::gpt::GptStage> a{alone, {1, 10}, {input("tokens", second)}};
  const std::vector<float> ya = a.forward(ctx, std::vector<float>(10 * 32));
  CHECK(std::memcmp(ya.data(), y.data() + 6 * 32, 10 * 32 * sizeof(float)) == 0);
}

/// One stage holding the whole model `cfg` (unpacked): the packed loss of two rows against
/// its documents' losses run separately.
template <class Stage, class Config>
void check_loss(const Config& cfg) {
  Config packed_cfg = cfg;
  packed_cfg.packed = true;
  Stage packed(packed_cfg, 0, 1), alone(cfg, 0, 1);
  std::vector<std::int32_t> tok(32), tgt(32);
  for (std::size_t i = 0; i < 32; ++i) {
    tok[i] = static_cast<std::int32_t>((i * 37 + 5) % 64);
    tgt[i] = static_cast<std::int32_t>((i * 13 + 1) % 64);
  }
  tok[4] = tok[11] = tok[17] = 63;  // the boundary: documents 4, 7, 5 | 1, 15
  const std::vector<std::int32_t> offsets = po::document_offsets(tok, 16, 63);
  po::backend::CpuContext ctx;
  Pass<Stage> p{
      packed, {2, 16}, {input("tokens", tok), input(po::document_offsets_input, offsets), input("targets", tgt)}};
  p.forward(ctx, {});
  std::vector<po::Document> docs;
  po::append_documents(offsets.data(), 2, 16, docs);
  REQUIRE(docs.size() == 5);
  double weighted = 0;
  for (const po::Document& d : docs) {
    const std::size_t first = d.row * 16 + d.begin;
    const std::vector<std::int32_t> dt(tok.begin() + first, tok.begin() + first + d.length),
        dg(tgt.begin() + first, tgt.begin() + first + d.length);
    Pass<Stage> a{alone, {1, static_cast<int>(d.length)}, {input("tokens", dt), input("targets", dg)}};
    a.forward(ctx, {});
    weighted += static_cast<double>(a.loss) * static_cast<double>(d.length) / 32.0;
  }
  MESSAGE("packed loss " << p.loss << ", documents' weighted mean " << weighted);
  CHECK(p.loss > 3.0f);
  CHECK(std::abs(static_cast<double>(p.loss) - weighted) <= 1.5 * std::ldexp(static_cast<double>(p.loss), -23));
}

TEST_CASE("Llama: a packed microbatch's loss is its documents' losses run separately, weighted by their tokens") {
  // One stage holding the whole model, tied and untied: the per-token losses are the same bits
  // (previous case) up to the GEMMs' rounding, so the packed mean differs from the documents'
  // weighted mean by the float rounding of each document's own mean (half an ulp each).
  for (const bool tied : {false, true}) {
    CAPTURE(tied);
    check_loss<LlamaStage>(LlamaConfig{
        .vocab = 64, .hidden = 32, .heads = 4, .kv_heads = 2, .layers = 2, .seq = 16, .tie_embeddings = tied});
  }
}

TEST_CASE("GPT: a packed microbatch's loss is its documents' losses run separately, weighted by their tokens") {
  check_loss<po::gpt::GptStage>(
      po::gpt::GptConfig{.vocab = 64, .hidden = 32, .heads = 4, .layers = 2, .seq = 16, .dropout = 0.0f});
}

TEST_CASE("Llama: packed training is bit-identical to one rank under every family, and with dp 2") {
  const int steps = 2;
  pipeline_test::RunOptions<LlamaConfig> o{
      .cfg = {.vocab = 64, .hidden = 16, .heads = 4, .kv_heads = 2, .layers = 4, .seq = 8, .packed = true}};
  o.packed = true;
  const pipeline_test::Run ref = pipeline_test::check_every_family<LlamaStage>(o, steps);
  // Packing changes what is computed (not a run of unpacked rows).
  pipeline_test::RunOptions<LlamaConfig> plain = o;
  plain.packed = false;
  plain.cfg.packed = false;
  CHECK_FALSE(pipeline_test::same(
      pipeline_test::train<LlamaStage>(pipeline_test::one_rank, {1, 1, 4}, steps, plain).losses, ref.losses));
  pipeline_test::check_two_replicas<LlamaStage>(o, steps, "1f1b-i");
}

TEST_CASE("GPT: packed training is bit-identical to one rank under every family") {
  const int steps = 2;
  pipeline_test::RunOptions<po::gpt::GptConfig> o{
      .cfg = {.vocab = 64, .hidden = 16, .heads = 4, .layers = 4, .seq = 8, .dropout = 0.1f, .packed = true}};
  o.packed = true;
  const pipeline_test::Run ref = pipeline_test::check_every_family<po::gpt::GptStage>(o, steps);
  pipeline_test::RunOptions<po::gpt::GptConfig> plain = o;
  plain.packed = false;
  plain.cfg.packed = false;
  CHECK_FALSE(pipeline_test::same(
      pipeline_test::train<po::gpt::GptStage>(pipeline_test::one_rank, {1, 1, 4}, steps, plain).losses, ref.losses));
}
