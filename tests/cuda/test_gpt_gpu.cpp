// tests/cuda/test_gpt_gpu.cpp: the CUDA sample models against their CPU references,
// gpt::CudaGptStage against gpt::GptStage and llama::CudaLlamaStage against llama::LlamaStage
// (needs a GPU; gpu_main.cpp exits 77 without one).
//
// Each case runs the same stage on both backends from the same bf16-rounded parameters and
// inputs, in a pipeline's order F0 F1 B0 B1 W0 W1, with NaN-poisoned saved and stash buffers and
// microbatch 0's saved buffer offloaded and reloaded elsewhere, and compares losses, y, dx and
// every weight gradient by norm-wise relative error. Why the parameters are drawn as they are,
// and the tolerances' derivation (2e-2 for y and the loss, 5e-2 for gradients): docs/testing.md,
// "GPU stages against their CPU references".
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda.hpp>
#include <models/llama/cpu.hpp>
#include <models/llama/cuda.hpp>
#include <pipeoffload/runtime.hpp>

namespace po = pipeoffload;
namespace pc = pipeoffload::cuda;
namespace pm = pipeoffload::gpt;

namespace {

constexpr double forward_tol = 2e-2;   // y and the loss
constexpr double backward_tol = 5e-2;  // dx and every weight gradient

float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<float> random_bf16(std::size_t n, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = round_bf16(d(rng));
  return v;
}

double rel_error(const float* got, const float* want, std::size_t n) {
  double d = 0, w = 0;
  for (std::size_t i = 0; i < n; ++i) {
    d += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    w += static_cast<double>(want[i]) * want[i];
  }
  if (w == 0) return d == 0 ? 0.0 : INFINITY;
  return std::sqrt(d / w);  // NaN in got gives NaN, which fails every <= check
}

void check_rel(const std::string& what, const float* got, const float* want, std::size_t n, double tol) {
  const double e = rel_error(got, want, n);
  MESSAGE(what << ": relative error " << e << " (tolerance " << tol << ")");
  CHECK_MESSAGE(e <= tol, what << ": relative error " << e << " is above " << tol);
}

/// Sensitive test parameters (see the file comment), bf16-representable, in the CPU layout.
void draw_parameters(std::span<float> p, const pm::GptDims& d, unsigned seed) {
  const pm::GptStageParams L = pm::gpt_stage_params(d);
  REQUIRE(static_cast<long long>(p.size()) == L.total);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const auto fill = [&](long long off, long long count, float mean, float sd) {
    for (long long i = 0; i < count; ++i) p[static_cast<std::size_t>(off + i)] = round_bf16(mean + sd * n01(rng));
  };
  const long long h = d.hidden, V = d.vocab;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h)), in_4h = 1.0f / std::sqrt(static_cast<float>(4 * h));
  if (d.embeds) {
    fill(0, V * h, 0.0f, 1.0f);
    fill(L.wpe, d.positions * h, 0.0f, 0.5f);
  }
  for (int i = 0; i < d.blocks; ++i) {
    const long long b = L.block_begin(i);
    const pm::GptBlockParams& o = L.block;
    fill(b + o.ln1g, h, 1.0f, 0.1f);
    fill(b + o.ln1b, h, 0.0f, 0.1f);
    fill(b + o.wqkv, 3 * h * h, 0.0f, in_h);
    fill(b + o.bqkv, 3 * h, 0.0f, 0.1f);
    fill(b + o.wo, h * h, 0.0f, in_h);
    fill(b + o.bo, h, 0.0f, 0.1f);
    fill(b + o.ln2g, h, 1.0f, 0.1f);
    fill(b + o.ln2b, h, 0.0f, 0.1f);
    fill(b + o.wfc, 4 * h * h, 0.0f, in_h);
    fill(b + o.bfc, 4 * h, 0.0f, 0.1f);
    fill(b + o.wpr, 4 * h * h, 0.0f, in_4h);
    fill(b + o.bpr, h, 0.0f, 0.1f);
  }
  if (d.has_head) {
    const long long b = L.head_begin;
    fill(b + L.lnfg, h, 1.0f, 0.1f);
    fill(b + L.lnfb, h, 0.0f, 0.1f);
    fill(b + L.head_w, h * V, 0.0f, in_h);
    fill(b + L.head_b, V, 0.0f, 0.1f);
  }
}

/// Two microbatches' inputs of one stage; `training` false runs the forwards alone, as
/// Runtime::evaluate does.
struct Inputs {
  po::MicrobatchShape shape;
  bool training = true;
  std::vector<std::int32_t> tokens[2], targets[2];
  std::vector<std::int32_t> offsets[2];  ///< packed rows' document offsets (empty: unpacked)
  std::vector<float> x[2], dy[2];
};

template <class Config>
Inputs make_inputs(const Config& c, po::MicrobatchShape shape, unsigned seed) {
  Inputs in;
  in.shape = shape;
  const std::size_t T = static_cast<std::size_t>(shape.tokens()), n = T * static_cast<std::size_t>(c.hidden);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, c.vocab - 1);
  for (int k = 0; k < 2; ++k) {
    in.tokens[k].resize(T);
    in.targets[k].resize(T);
    for (std::size_t t = 0; t < T; ++t) {
      in.tokens[k][t] = tok(rng);
      in.targets[k][t] = tok(rng);
    }
    in.x[k] = random_bf16(n, seed + 10 + static_cast<unsigned>(k), 1.0f);
    in.dy[k] = random_bf16(n, seed + 20 + static_cast<unsigned>(k), 1.0f);
  }
  return in;
}

/// Packs both microbatches' rows (two of 32 tokens each): documents of 5, 1, 18 and 8 tokens,
/// then of 31 and 1 tokens (microbatch 0) or 2 and 30 (microbatch 1).
void pack_rows(Inputs& in) {
  REQUIRE(in.shape.batch == 2);
  REQUIRE(in.shape.seq == 32);
  for (int k = 0; k < 2; ++k) {
    in.offsets[k] = {0, 5, 6, 24};
    in.offsets[k].resize(33, 32);
    std::vector<std::int32_t> second = {0, k == 0 ? 31 : 2};
    second.resize(33, 32);
    in.offsets[k].insert(in.offsets[k].end(), second.begin(), second.end());
  }
}

/// What a stage produced for the two microbatches.
struct Outputs {
  float loss[2] = {0, 0};
  std::vector<float> y[2], dx[2], grads;
};

/// fp32 views of boundary tensors (host memory on the CPU, device memory on the GPU).
po::ConstTensor view(const float* p, std::size_t n) {
  return {reinterpret_cast<const std::byte*>(p), n, po::DType::float32};
}
po::Tensor view(float* p, std::size_t n) { return {reinterpret_cast<std::byte*>(p), n, po::DType::float32}; }

/// The step inputs a stage reads for one microbatch (tokens on stage 0, targets on the last,
/// packed rows' offsets on every stage), int32 at `tokens` and `targets` (host or device
/// memory), the offsets at `offsets` and on the host at `host_offsets`, as the runtime hands
/// them over.
std::vector<po::StepInput> step_inputs(int stage, int stages, const std::int32_t* tokens, const std::int32_t* targets,
                                       std::size_t T, const std::int32_t* offsets = nullptr,
                                       const std::vector<std::int32_t>* host_offsets = nullptr) {
  std::vector<po::StepInput> in;
  if (stage == 0) in.push_back({"tokens", {reinterpret_cast<const std::byte*>(tokens), T, po::DType::int32}, {}});
  if (stage == stages - 1)
    in.push_back({"targets", {reinterpret_cast<const std::byte*>(targets), T, po::DType::int32}, {}});
  if (host_offsets != nullptr && !host_offsets->empty())
    in.push_back({po::document_offsets_input,
                  {reinterpret_cast<const std::byte*>(offsets), host_offsets->size(), po::DType::int32},
                  po::ConstTensor(po::view(*host_offsets))});
  return in;
}

po::Microbatch microbatch(int stage, int stages, int k, const Inputs& in, std::span<const po::StepInput> inputs,
                          float* loss) {
  po::Microbatch mb;
  mb.stage = stage;
  mb.stages = stages;
  mb.mb = k;
  mb.microbatches = 2;
  mb.step = 3;  // any step: the seeds depend on it the same way on both sides
  mb.training = in.training;
  mb.shape = in.shape;
  mb.inputs = inputs;
  mb.loss = loss;
  mb.loss_scale = 0.5f;
  return mb;
}

template <class Stage>
Outputs run_cpu(Stage& l, int stage, int stages, const Inputs& in) {
  const std::size_t n = l.input_boundary(in.shape).elements, T = static_cast<std::size_t>(in.shape.tokens());
  Outputs out;
  std::vector<std::byte> saved[2], stash[2];
  std::vector<po::StepInput> inputs[2];
  po::backend::CpuContext ctx{};
  const bool first = stage == 0, last = stage == stages - 1;
  for (int k = 0; k < 2; ++k) {
    saved[k].resize(l.saved_bytes(in.shape));
    stash[k].resize(l.stash_bytes(in.shape));
    out.y[k].assign(last ? 0 : n, 0.0f);
    out.dx[k].assign(first ? 0 : n, 0.0f);
    inputs[k] =
        step_inputs(stage, stages, in.tokens[k].data(), in.targets[k].data(), T, in.offsets[k].data(), &in.offsets[k]);
  }
  for (int k = 0; k < 2; ++k) {
    const po::Microbatch mb = microbatch(stage, stages, k, in, inputs[k], last ? &out.loss[k] : nullptr);
    l.forward(ctx, mb, first ? po::ConstTensor{} : view(in.x[k].data(), n),
              last ? po::Tensor{} : view(out.y[k].data(), n), saved[k].data());
  }
  if (!in.training) return out;
  for (int k = 0; k < 2; ++k) {
    const po::Microbatch mb = microbatch(stage, stages, k, in, inputs[k], nullptr);
    l.backward_input(ctx, mb, last ? po::ConstTensor{} : view(in.dy[k].data(), n),
                     first ? po::Tensor{} : view(out.dx[k].data(), n), saved[k].data(), stash[k].data());
  }
  for (int k = 0; k < 2; ++k)
    l.backward_weight(ctx, microbatch(stage, stages, k, in, inputs[k], nullptr), saved[k].data(), stash[k].data());
  out.grads.assign(l.gradients().begin(), l.gradients().end());
  return out;
}

/// Device buffers of one test, freed at the end.
struct DeviceBuffers {
  std::vector<void*> owned;
  ~DeviceBuffers() {
    cudaDeviceSynchronize();
    for (void* p : owned) cudaFree(p);
  }
  template <class T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n * sizeof(T), 1)));
    owned.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* copy(const std::vector<T>& v) {
    T* d = alloc<T>(v.size());
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  std::byte* poisoned(std::size_t bytes) {
    auto* d = alloc<std::byte>(bytes);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemset(d, 0xFF, bytes));  // bf16 and fp32 NaN
    return d;
  }
};

template <class T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> v(n);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

/// The stage's bf16 parameters, widened to fp32 on the host.
template <class Stage>
std::vector<float> download_parameters(Stage& l) {
  const po::Tensor w = l.parameters();
  const std::vector<std::uint16_t> bits = download(reinterpret_cast<const std::uint16_t*>(w.data), w.elements);
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = po::bf16_value(bits[i]);
  return out;
}

/// Writes fp32 values, rounded to bf16, into the stage's parameters (what the optimizer does).
void upload_parameters(pm::CudaGptStage& l, std::span<const float> values) {
  const po::Tensor w = l.parameters();
  REQUIRE(values.size() == w.elements);
  std::vector<std::uint16_t> bits(values.size());
  for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = po::bf16_bits(values[i]);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(w.data, bits.data(), bits.size() * sizeof(std::uint16_t), cudaMemcpyHostToDevice));
}

template <class Stage>
Outputs run_gpu(Stage& l, po::backend::Cuda& dev, int stream, int stage, int stages, const Inputs& in) {
  const std::size_t n = l.input_boundary(in.shape).elements, sb = l.saved_bytes(in.shape), tb = l.stash_bytes(in.shape);
  const std::size_t T = static_cast<std::size_t>(in.shape.tokens());
  const bool first = stage == 0, last = stage == stages - 1;
  DeviceBuffers b;
  float *x[2], *y[2], *dy[2], *dx[2];
  std::byte *saved[2], *stash[2];
  std::vector<po::StepInput> inputs[2];  // views of the device copies of tokens and targets
  float* loss = b.alloc<float>(2);
  for (int k = 0; k < 2; ++k) {
    inputs[k] = step_inputs(stage, stages, b.copy(in.tokens[k]), b.copy(in.targets[k]), T,
                            in.offsets[k].empty() ? nullptr : b.copy(in.offsets[k]), &in.offsets[k]);
    x[k] = b.copy(in.x[k]);
    dy[k] = b.copy(in.dy[k]);
    y[k] = b.alloc<float>(n);
    dx[k] = b.alloc<float>(n);
    saved[k] = b.poisoned(sb);
    stash[k] = b.poisoned(tb);
  }
  // The passes run on a non-blocking stream, which does not wait for the copies and memsets
  // above (legacy stream; a pageable upload may return before its DMA is done).
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  const auto pass = [&](auto&& fn) {
    dev.launch(stream, [&] {
      po::backend::CudaContext ctx = dev.context(stream);
      fn(ctx);
    });
    dev.synchronize();  // throws what the pass threw
  };
  for (int k = 0; k < 2; ++k)
    pass([&](po::backend::CudaContext& ctx) {
      l.forward(ctx, microbatch(stage, stages, k, in, inputs[k], last ? loss + k : nullptr),
                first ? po::ConstTensor{} : view(x[k], n), last ? po::Tensor{} : view(y[k], n), saved[k]);
    });
  if (in.training) {
    // Offload and reload microbatch 0's activations into another buffer; poison the old one.
    const std::vector<std::byte> host = download(saved[0], sb);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemset(saved[0], 0xFF, sb));
    saved[0] = b.poisoned(sb);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(saved[0], host.data(), sb, cudaMemcpyHostToDevice));
    PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
    for (int k = 0; k < 2; ++k)
      pass([&](po::backend::CudaContext& ctx) {
        l.backward_input(ctx, microbatch(stage, stages, k, in, inputs[k], nullptr),
                         last ? po::ConstTensor{} : view(dy[k], n), first ? po::Tensor{} : view(dx[k], n), saved[k],
                         stash[k]);
      });
    for (int k = 0; k < 2; ++k)
      pass([&](po::backend::CudaContext& ctx) {
        l.backward_weight(ctx, microbatch(stage, stages, k, in, inputs[k], nullptr), saved[k], stash[k]);
      });
  }
  Outputs out;
  if (last) {
    const std::vector<float> lv = download(loss, 2);
    out.loss[0] = lv[0];
    out.loss[1] = lv[1];
  }
  for (int k = 0; k < 2; ++k) {
    if (!last) out.y[k] = download(y[k], n);
    if (!first && in.training) out.dx[k] = download(dx[k], n);
  }
  if (in.training) out.grads = download(l.gradients().data(), l.gradients().size());
  return out;
}

/// The GPU's outputs against the CPU's: y or the loss, and after a training run dx and the
/// gradient of every tensor of parameter_info().
void compare(const Outputs& gpu, const Outputs& cpu, const std::vector<po::ParamInfo>& tensors, bool embeds,
             bool has_head, bool training = true) {
  for (int k = 0; k < 2; ++k) {
    const std::string mb = "mb " + std::to_string(k) + " ";
    if (has_head) {
      const double e =
          std::abs(static_cast<double>(gpu.loss[k]) - cpu.loss[k]) / std::abs(static_cast<double>(cpu.loss[k]));
      MESSAGE(mb << "loss: gpu " << gpu.loss[k] << ", cpu " << cpu.loss[k] << ", relative error " << e);
      CHECK(e <= forward_tol);
    } else {
      check_rel(mb + "y", gpu.y[k].data(), cpu.y[k].data(), cpu.y[k].size(), forward_tol);
    }
    if (!embeds && training) check_rel(mb + "dx", gpu.dx[k].data(), cpu.dx[k].data(), cpu.dx[k].size(), backward_tol);
  }
  if (!training) return;
  REQUIRE(gpu.grads.size() == cpu.grads.size());
  // (wpe's rows past the microbatch's seq get no gradient on either side: zeros compare equal.)
  for (const po::ParamInfo& t : tensors)
    check_rel("gradient of " + t.name, gpu.grads.data() + t.offset, cpu.grads.data() + t.offset, t.count(),
              backward_tol);
}

po::gpt::GptConfig test_config(int layers, bool recompute) {
  po::gpt::GptConfig c;
  c.vocab = 256;
  c.hidden = 128;
  c.heads = 4;  // head_dim 32: cuDNN's SDPA needs a multiple of 8
  c.layers = layers;
  c.seq = 64;  // the position table; microbatches use seq 32 (rows % 32 index it)
  c.dropout = 0.1f;
  c.recompute = recompute;
  c.seed = 7;
  return c;
}

/// Runs stage `stage` of `stages` on both backends and compares (`training` false: the
/// forwards alone, without dropout) on microbatches of `shape`.
void check_stage(const po::gpt::GptConfig& c, int stage, int stages, bool training = true,
                 po::MicrobatchShape shape = {2, 32}, std::size_t arena = std::size_t{512} << 20) {
  CAPTURE(stage);
  CAPTURE(stages);
  CAPTURE(c.recompute);
  CAPTURE(c.packed);
  CAPTURE(training);
  po::gpt::GptStage cpu(c, stage, stages);
  const pm::BlockRange r = pm::gpt_blocks_of_stage(c.layers, stage, stages);
  const pm::GptDims d{c.vocab,    c.hidden, c.heads, c.seq, r.first, r.count, stage == 0, stage == stages - 1,
                      c.recompute};
  draw_parameters(cpu.parameters(), d, 100 + static_cast<unsigned>(stage));
  po::backend::Cuda dev({.arena_bytes = arena});  // the cuBLASLt + cuDNN workspace (256 MiB) lives here
  const int s = dev.make_stream("compute");
  pm::CudaGptStage gpu(dev, c, stage, stages, shape, cpu.parameters());
  CHECK(gpu.norm_groups() == cpu.norm_groups());
  CHECK(gpu.parameter_info().size() == cpu.parameter_info().size());  // names and offsets: test_host.cpp
  // draw_parameters' values are bf16 already: the stage holds them exactly.
  CHECK(download_parameters(gpu) == std::vector<float>(cpu.parameters().begin(), cpu.parameters().end()));
  CHECK(gpu.input_boundary(shape) == cpu.input_boundary(shape));
  CHECK(gpu.output_boundary(shape) == cpu.output_boundary(shape));
  Inputs in = make_inputs(c, shape, 1000 + static_cast<unsigned>(stage));
  in.training = training;
  if (c.packed) pack_rows(in);
  const Outputs want = run_cpu(cpu, stage, stages, in);
  const Outputs got = run_gpu(gpu, dev, s, stage, stages, in);
  compare(got, want, pm::gpt_parameter_info(d), d.embeds, d.has_head, training);
}

}  // namespace

TEST_CASE(
    "gpt::CudaGptStage matches gpt::GptStage on the first, a middle and the last stage, with selective recompute") {
  const po::gpt::GptConfig c = test_config(6, true);  // 3 stages of 2 blocks
  for (int s = 0; s < 3; ++s) check_stage(c, s, 3);
}

TEST_CASE(
    "gpt::CudaGptStage matches gpt::GptStage on the first, a middle and the last stage, recompute off (saved LayerNorm, GeLU, masks)") {
  const po::gpt::GptConfig c = test_config(6, false);
  for (int s = 0; s < 3; ++s) check_stage(c, s, 3);
}

TEST_CASE(
    "gpt::CudaGptStage over packed rows (cuDNN's ragged attention on fused qkv, positions restarting) matches "
    "gpt::GptStage packed") {
  po::gpt::GptConfig c = test_config(6, true);
  c.packed = true;
  for (int s = 0; s < 3; ++s) check_stage(c, s, 3);
  c.recompute = false;
  check_stage(c, 0, 1);
}

TEST_CASE(
    "gpt::CudaGptStage matches gpt::GptStage as one stage holding the whole model, and as stages without blocks") {
  check_stage(test_config(2, true), 0, 1);  // embedding, two blocks, head
  // 2 blocks on 3 stages: stage 0 holds only the embedding, stages 1 and 2 one block each.
  for (int s = 0; s < 3; ++s) check_stage(test_config(2, true), s, 3);
}

namespace {

/// A middle stage's F and B with bf16 boundaries (`narrow`) give the bits they give with fp32
/// boundaries (`wide`): an fp32 boundary holds widened bf16 values, so narrowing loses nothing;
/// the wrong type is refused with a sentence.
template <class Stage>
void check_narrow_boundaries(po::backend::Cuda& dev, int s, Stage& wide, Stage& narrow, Inputs in, int stage,
                             int stages) {
  const po::MicrobatchShape shape = in.shape;
  in.training = true;
  const std::size_t n = wide.input_boundary(shape).elements;
  CHECK(narrow.input_boundary(shape) == po::Boundary{n, po::DType::bfloat16});
  CHECK(narrow.output_boundary(shape) == po::Boundary{n, po::DType::bfloat16});
  const auto narrowed = [](const std::vector<float>& v) {
    std::vector<__nv_bfloat16> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
    return out;
  };
  DeviceBuffers b;
  float *x = b.copy(in.x[0]), *dy = b.copy(in.dy[0]), *y = b.alloc<float>(n), *dx = b.alloc<float>(n);
  __nv_bfloat16 *x16 = b.copy(narrowed(in.x[0])), *dy16 = b.copy(narrowed(in.dy[0]));
  __nv_bfloat16 *y16 = b.alloc<__nv_bfloat16>(n), *dx16 = b.alloc<__nv_bfloat16>(n);
  const std::size_t sb = wide.saved_bytes(shape), tb = wide.stash_bytes(shape);
  std::byte *saved[2] = {b.poisoned(sb), b.poisoned(sb)}, *stash[2] = {b.poisoned(tb), b.poisoned(tb)};
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  const auto bytes = [](auto* p) { return reinterpret_cast<std::byte*>(p); };
  const auto run = [&](Stage& l, po::ConstTensor xv, po::Tensor yv, po::ConstTensor dyv, po::Tensor dxv, int k) {
    dev.launch(s, [&] {
      po::backend::CudaContext ctx = dev.context(s);
      l.forward(ctx, microbatch(stage, stages, 0, in, {}, nullptr), xv, yv, saved[k]);
      l.backward_input(ctx, microbatch(stage, stages, 0, in, {}, nullptr), dyv, dxv, saved[k], stash[k]);
    });
    dev.synchronize();
  };
  run(wide, view(x, n), view(y, n), view(dy, n), view(dx, n), 0);
  run(narrow, {bytes(x16), n, po::DType::bfloat16}, {bytes(y16), n, po::DType::bfloat16},
      {bytes(dy16), n, po::DType::bfloat16}, {bytes(dx16), n, po::DType::bfloat16}, 1);
  // An fp32 boundary holds widened bf16 values: narrowing it loses nothing.
  CHECK(std::memcmp(narrowed(download(y, n)).data(), download(y16, n).data(), n * sizeof(__nv_bfloat16)) == 0);
  CHECK(std::memcmp(narrowed(download(dx, n)).data(), download(dx16, n).data(), n * sizeof(__nv_bfloat16)) == 0);
  // And the wrong type is refused with a sentence.
  dev.launch(s, [&] {
    po::backend::CudaContext ctx = dev.context(s);
    narrow.forward(ctx, microbatch(stage, stages, 0, in, {}, nullptr), view(x, n), {bytes(y16), n, po::DType::bfloat16},
                   saved[1]);
  });
  try {
    dev.synchronize();
    FAIL("no throw");
  } catch (const po::error& e) {
    CHECK(std::string(e.what()).find("x holds float32 values; this stage's boundaries are bfloat16") !=
          std::string::npos);
  }
}

}  // namespace

TEST_CASE(
    "gpt::CudaGptStage with bf16 boundaries gives the bits it gives with fp32 boundaries (a middle stage's y, dx)") {
  const po::gpt::GptConfig c = test_config(6, true);
  const int stage = 1, stages = 3;
  const po::MicrobatchShape shape{2, 32};
  po::gpt::GptStage cpu(c, stage, stages);
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int s = dev.make_stream("compute");
  pm::CudaGptStage wide(dev, c, stage, stages, shape, cpu.parameters());
  pm::CudaGptStage narrow(dev, c, stage, stages, shape, cpu.parameters(), pm::Boundaries::bf16);
  check_narrow_boundaries(dev, s, wide, narrow, make_inputs(c, shape, 4242), stage, stages);
}

TEST_CASE("gpt::CudaGptStage evaluates (mb.training false) as gpt::GptStage does: no dropout, on every stage kind") {
  for (bool recompute : {true, false}) {
    const po::gpt::GptConfig c = test_config(6, recompute);  // dropout 0.1: a training forward would differ
    for (int s = 0; s < 3; ++s) check_stage(c, s, 3, false);
  }
}

TEST_CASE(
    "gpt::CudaGptStage holds bf16 parameters: the initial values rounded, and what the optimizer writes reaches the next forward (the head's bias included)") {
  const po::gpt::GptConfig c = test_config(3, true);
  const int stage = 2, stages = 3;  // the last stage: a block and the head
  const po::MicrobatchShape shape{2, 32};
  po::gpt::GptStage cpu(c, stage, stages);
  const pm::BlockRange r = pm::gpt_blocks_of_stage(c.layers, stage, stages);
  const pm::GptDims d{c.vocab, c.hidden, c.heads, c.seq, r.first, r.count, false, true, c.recompute};
  po::backend::Cuda dev(
      {.arena_bytes = std::size_t{512} << 20});  // the cuBLASLt + cuDNN workspace (256 MiB) lives here
  const int s = dev.make_stream("compute");
  pm::CudaGptStage gpu(dev, c, stage, stages, shape);  // the CPU model's init, rounded to bf16
  const po::Tensor w = gpu.parameters();
  CHECK(w.dtype == po::DType::bfloat16);
  REQUIRE(w.elements == cpu.parameters().size());
  std::vector<float> rounded(cpu.parameters().begin(), cpu.parameters().end());
  for (float& x : rounded) x = po::bf16_value(po::bf16_bits(x));
  CHECK(download_parameters(gpu) == rounded);
  // What the runtime's optimizer step does: new parameters, rounded into the bf16 ones.
  draw_parameters(cpu.parameters(), d, 5);
  upload_parameters(gpu, cpu.parameters());
  const Inputs in = make_inputs(c, shape, 77);
  const Outputs want = run_cpu(cpu, stage, stages, in);
  const Outputs got = run_gpu(gpu, dev, s, stage, stages, in);
  compare(got, want, pm::gpt_parameter_info(d), d.embeds, d.has_head);
}

TEST_CASE("gpt::CudaGptStage refuses microbatches larger than its scratch and misaligned buffers") {
  const po::gpt::GptConfig c = test_config(3, true);
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int s = dev.make_stream("compute");
  pm::CudaGptStage gpu(dev, c, 1, 3, {1, 32});
  DeviceBuffers b;
  const po::MicrobatchShape big{2, 32};
  const std::size_t n = gpu.input_boundary(big).elements, small = gpu.input_boundary({1, 32}).elements;
  float* x = b.alloc<float>(n);
  float* y = b.alloc<float>(n);
  std::byte* saved = b.alloc<std::byte>(gpu.saved_bytes(big) + 256);
  Inputs in;
  in.shape = big;
  po::backend::CudaContext ctx = dev.context(s);
  CHECK_THROWS_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr), view(x, n), view(y, n), saved),
                  po::shape_error);
  in.shape = {1, 32};
  CHECK_THROWS_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr), view(x, small), view(y, small), saved + 16),
                  po::error);
  CHECK_THROWS_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr), po::ConstTensor{}, view(y, small), saved),
                  po::error);
  // A boundary of the wrong size or element type.
  CHECK_THROWS_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr), view(x, n), view(y, small), saved),
                  po::shape_error);
  CHECK_THROWS_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr),
                              po::ConstTensor{reinterpret_cast<const std::byte*>(x), small, po::DType::int32},
                              view(y, small), saved),
                  po::error);
  CHECK_THROWS_AS(pm::CudaGptStage(dev, c, 1, 3, {1, 65}), po::shape_error);  // longer than the position table
  po::gpt::GptConfig odd = c;
  odd.heads = 32;  // head_dim 4: cuDNN's SDPA needs a multiple of 8
  CHECK_THROWS_AS(pm::CudaGptStage(dev, odd, 1, 3, {1, 32}), po::shape_error);
}

namespace {

/// Losses of `steps` training steps of a 4-block GPT cut into 2 stages held by one rank
/// (d = 1, v = 2, m = 4) under PO with every activation offloaded, on `Backend` with `Stage`:
/// the visible training step (zero_grad, forward_backward, grad_norm, clip, AdamW); `memory`,
/// if given, receives each step's PassStats::memory.
template <class Stage, class Backend, class MakeStage>
std::vector<float> train(Backend& dev, MakeStage make, int steps, bool graphs = false,
                         std::vector<po::backend::MemoryStats>* memory = nullptr) {
  const po::Shape shape{1, 2, 4};
  const po::MicrobatchShape mbs{2, 16};
  const po::Program program =
      po::build({po::Family::grouped, {po::GroupSpec::Kind::uniform, 1}, po::offload::all}, shape);
  po::comm::ThreadsWorld world(1);
  po::comm::Threads comm(world, 0);
  std::vector<Stage> layers;
  layers.reserve(2);
  for (int c = 0; c < shape.v; ++c) layers.push_back(make(shape.stage_of(0, c), shape.stages(), mbs));
  po::Runtime rt(program, dev, comm, std::span<Stage>(layers), {.microbatch = mbs, .graphs = graphs});
  po::AdamW opt(rt);  // the defaults: weight decay 0.1 on every tensor
  const po::WarmupCosine lr{.lr = 1e-2f, .warmup_steps = 1};
  const std::size_t rows = static_cast<std::size_t>(mbs.batch) * static_cast<std::size_t>(shape.m);
  const std::size_t n = rows * static_cast<std::size_t>(mbs.seq);
  std::vector<std::int32_t> tok(n), tgt(n);
  for (std::size_t i = 0; i < n; ++i) {  // the same batch every step: the loss must fall
    tok[i] = static_cast<std::int32_t>((i * 31) % 256);
    tgt[i] = static_cast<std::int32_t>((i * 17 + 3) % 256);
  }
  po::Batch batch;
  batch.add("tokens", tok, {static_cast<long long>(rows), mbs.seq})
      .add("targets", tgt, {static_cast<long long>(rows), mbs.seq});
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const long long waits = dev.host_waits();
    rt.zero_grad();
    const po::PassStats st = rt.forward_backward(batch, {.step = s});
    losses.push_back(st.loss);
    if (memory != nullptr) memory->push_back(st.memory);
    opt.step(lr(s), po::clip_scale(po::grad_norm(rt), 1.0f));
    // The host waits where it reads: the step's end and its one readback (the norm's sums
    // behind it); the two input uploads (through the pinned staging), zero_grad, the norm and
    // AdamW (one launch a chunk) wait for nothing. With graphs also the capture's start (step 1).
    CHECK(dev.host_waits() - waits == 2 + (graphs && s == 1 ? 1 : 0));
  }
  return losses;
}

}  // namespace

TEST_CASE("po::Runtime trains gpt::CudaGptStage stages (PO, every unit offloaded) along the CPU model's loss curve") {
  po::gpt::GptConfig c = test_config(4, true);
  c.hidden = 64;
  c.heads = 2;
  c.seq = 16;
  const int steps = 4;
  po::backend::Cpu cpu_dev;
  const std::vector<float> want = train<po::gpt::GptStage>(
      cpu_dev, [&](int s, int S, po::MicrobatchShape) { return po::gpt::GptStage(c, s, S); }, steps);
  po::backend::Cuda gpu_dev({.arena_bytes = std::size_t{512} << 20});
  const std::vector<float> got = train<pm::CudaGptStage>(
      gpu_dev, [&](int s, int S, po::MicrobatchShape mbs) { return pm::CudaGptStage(gpu_dev, c, s, S, mbs); }, steps);
  // The same initial parameters and data: step 0's loss differs by the forward's bf16 error;
  // later ones also by the parameters' response to bf16 gradient errors through AdamW (whose
  // first steps move each parameter by about lr * sign(gradient)), hence backward_tol there.
  for (int s = 0; s < steps; ++s) {
    const std::size_t i = static_cast<std::size_t>(s);
    const double e = std::abs(static_cast<double>(got[i]) - want[i]) / want[i];
    MESSAGE("step " << s << ": loss gpu " << got[i] << ", cpu " << want[i] << ", relative error " << e);
    CHECK(e <= (s == 0 ? forward_tol : backward_tol));
  }
  CHECK(want[steps - 1] < want[0]);  // both learn
  CHECK(got[steps - 1] < got[0]);
}

TEST_CASE("po::Runtime replays captured steps on a GPU (CUDA graphs) bit for bit as it runs them (PO, dropout)") {
  po::gpt::GptConfig c = test_config(4, true);
  c.hidden = 64;
  c.heads = 2;
  c.seq = 16;
  c.dropout = 0.1f;     // the masks follow the step only through Microbatch::device_step
  const int steps = 5;  // step 0 runs, step 1 is captured, steps 2 to 4 are replayed
  std::vector<po::backend::MemoryStats> eager_memory, graphed_memory;
  const auto run = [&](bool graphs, std::vector<po::backend::MemoryStats>& memory) {
    po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
    return train<pm::CudaGptStage>(
        dev, [&](int s, int S, po::MicrobatchShape mbs) { return pm::CudaGptStage(dev, c, s, S, mbs); }, steps, graphs,
        &memory);
  };
  const std::vector<float> eager = run(false, eager_memory), graphed = run(true, graphed_memory);
  for (int s = 0; s < steps; ++s) {
    const std::size_t i = static_cast<std::size_t>(s);
    MESSAGE("step " << s << ": loss " << eager[i] << " run, " << graphed[i] << " replayed");
    CHECK(std::memcmp(&eager[i], &graphed[i], sizeof(float)) == 0);
    // A replay takes no buffer itself: it reports its captured call's memory, the run's.
    for (const po::backend::Memory k :
         {po::backend::Memory::activation, po::backend::Memory::stash, po::backend::Memory::message})
      CHECK(graphed_memory[i].peak_of(k) == eager_memory[i].peak_of(k));
    CHECK(graphed_memory[i].host_peak == eager_memory[i].host_peak);
  }
}

// ---- the Llama-class model ----------------------------------------------------------------------

namespace {

/// Sensitive parameters for a Llama stage, by tensor (as draw_parameters for the GPT): norm
/// weights 1 +- 0.1, matrices std 1/sqrt(fan_in) (their first dimension; the output's h), the
/// embedding std 1; bf16 values.
void draw_llama(std::span<float> p, const std::vector<po::ParamInfo>& tensors, long long hidden, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (const po::ParamInfo& t : tensors) {
    const bool norm = t.shape.size() == 1, embedding = t.name == "tok_embeddings.weight";
    // The output projection's fan-in is h whether it is stored (h, V) or, tied, (V, h).
    const float fan_in = norm ? 1.0f : static_cast<float>(t.name == "output.weight" ? hidden : t.shape[0]);
    for (std::size_t i = 0; i < t.count(); ++i)
      p[t.offset + i] =
          round_bf16(norm ? 1.0f + 0.1f * n01(rng) : (embedding ? 1.0f : 1.0f / std::sqrt(fan_in)) * n01(rng));
  }
}

po::llama::LlamaConfig llama_config(int layers) {
  po::llama::LlamaConfig c;
  c.vocab = 256;
  c.hidden = 128;
  c.heads = 4;  // head_dim 32: cuDNN's SDPA needs a multiple of 8
  c.kv_heads = 2;
  c.ffn = 320;
  c.layers = layers;
  c.seq = 64;
  c.seed = 9;
  return c;
}

void check_llama_stage(const po::llama::LlamaConfig& c, int stage, int stages, po::MicrobatchShape shape = {2, 32},
                       std::size_t arena = std::size_t{512} << 20) {
  CAPTURE(stage);
  CAPTURE(stages);
  CAPTURE(c.tie_embeddings);
  CAPTURE(c.packed);
  po::llama::LlamaStage cpu(c, stage, stages);
  draw_llama(cpu.parameters(), cpu.parameter_info(), c.hidden, 200 + static_cast<unsigned>(stage));
  po::backend::Cuda dev({.arena_bytes = arena});
  const int s = dev.make_stream("compute");
  po::llama::CudaLlamaStage gpu(dev, c, stage, stages, shape, cpu.parameters());
  CHECK(gpu.norm_groups() == cpu.norm_groups());
  CHECK(download_parameters(gpu) == std::vector<float>(cpu.parameters().begin(), cpu.parameters().end()));
  CHECK(gpu.input_boundary(shape) == cpu.input_boundary(shape));
  Inputs in = make_inputs(c, shape, 2000 + static_cast<unsigned>(stage));
  if (c.packed) pack_rows(in);
  const Outputs want = run_cpu(cpu, stage, stages, in);
  const Outputs got = run_gpu(gpu, dev, s, stage, stages, in);
  compare(got, want, cpu.parameter_info(), cpu.dims().embeds, cpu.dims().has_head);
}

}  // namespace

TEST_CASE("llama::CudaLlamaStage matches llama::LlamaStage on the first, a middle and the last stage (GQA 4/2 heads)") {
  const po::llama::LlamaConfig c = llama_config(6);
  for (int s = 0; s < 3; ++s) check_llama_stage(c, s, 3);
}

TEST_CASE("llama::CudaLlamaStage over packed rows (cuDNN's ragged attention) matches llama::LlamaStage packed") {
  po::llama::LlamaConfig c = llama_config(6);
  c.packed = true;
  for (int s = 0; s < 3; ++s) check_llama_stage(c, s, 3);
}

TEST_CASE("llama::CudaLlamaStage: a packed microbatch's loss is its documents' losses run alone, token-weighted") {
  // The whole model on one stage; each microbatch of two packed rows against each of
  // its documents run alone as a row of its own on an unpacked stage with the same parameters
  // (the forwards only). On the CPU the two agree to float rounding (tests/runtime/
  // test_packing.cpp); here to forward_tol, the GPU's bf16 against itself.
  po::llama::LlamaConfig c = llama_config(2);
  c.packed = true;
  const po::MicrobatchShape shape{2, 32};
  po::llama::LlamaStage cpu(c, 0, 1);
  draw_llama(cpu.parameters(), cpu.parameter_info(), c.hidden, 77);
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int s = dev.make_stream("compute");
  po::llama::CudaLlamaStage packed(dev, c, 0, 1, shape, cpu.parameters());
  po::llama::LlamaConfig alone_cfg = c;
  alone_cfg.packed = false;
  po::llama::CudaLlamaStage alone(dev, alone_cfg, 0, 1, shape, cpu.parameters());
  Inputs in = make_inputs(c, shape, 5151);
  in.training = false;
  // Documents of 5, 8 and 19 tokens, then of 20 and 12 (none of 1 token: cuDNN's SDPA has a
  // known issue with a lone query and key, which a document alone would be).
  for (int k = 0; k < 2; ++k) {
    in.offsets[k] = {0, 5, 13};
    in.offsets[k].resize(33, 32);
    std::vector<std::int32_t> second = {0, 20};
    second.resize(33, 32);
    in.offsets[k].insert(in.offsets[k].end(), second.begin(), second.end());
  }
  const Outputs whole = run_gpu(packed, dev, s, 0, 1, in);
  for (int k = 0; k < 2; ++k) {
    std::vector<po::Document> docs;
    po::append_documents(in.offsets[k].data(), 2, 32, docs);
    double sum = 0;
    for (const po::Document& d : docs) {
      Inputs one;
      one.shape = {1, static_cast<int>(d.length)};
      one.training = false;
      const std::size_t from = d.row * 32 + d.begin;
      for (int j = 0; j < 2; ++j) {
        one.tokens[j].assign(in.tokens[k].begin() + from, in.tokens[k].begin() + from + d.length);
        one.targets[j].assign(in.targets[k].begin() + from, in.targets[k].begin() + from + d.length);
      }
      sum += static_cast<double>(d.length) * run_gpu(alone, dev, s, 0, 1, one).loss[0];
    }
    const double want = sum / 64, e = std::abs(whole.loss[k] - want) / want;
    MESSAGE("mb " << k << ": packed loss " << whole.loss[k] << ", documents alone " << want << ", relative error "
                  << e);
    CHECK(e <= forward_tol);
  }
}

TEST_CASE("llama::CudaLlamaStage::prepare builds a packed microbatch's graphs and refuses a malformed row first") {
  po::llama::LlamaConfig c = llama_config(6);
  c.packed = true;
  const po::MicrobatchShape shape{2, 32};
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  po::llama::CudaLlamaStage gpu(dev, c, 1, 3, shape);
  Inputs in = make_inputs(c, shape, 99);
  pack_rows(in);
  DeviceBuffers b;
  const std::vector<po::StepInput> good =
      step_inputs(1, 3, nullptr, nullptr, 64, b.copy(in.offsets[0]), &in.offsets[0]);
  gpu.prepare(microbatch(1, 3, 0, in, good, nullptr));  // builds the graphs of 6 documents
  std::vector<std::int32_t> bad = in.offsets[0];
  bad[3] = 40;  // row 0's offset 3 beyond seq
  const std::vector<po::StepInput> wrong = step_inputs(1, 3, nullptr, nullptr, 64, b.copy(bad), &bad);
  CHECK_THROWS_WITH(gpu.prepare(microbatch(1, 3, 0, in, wrong, nullptr)),
                    doctest::Contains("cu_seqlens row 0: offset 3 is 40; outside [6, 32]"));
}

TEST_CASE("llama::CudaLlamaStage checks its boundaries before queuing anything and refuses a null stash in B and W") {
  const po::llama::LlamaConfig c = llama_config(6);
  const po::MicrobatchShape shape{1, 32};
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int s = dev.make_stream("compute");
  po::llama::CudaLlamaStage gpu(dev, c, 1, 3, shape);  // a middle stage: boundaries both ways
  DeviceBuffers b;
  const std::size_t n = gpu.input_boundary(shape).elements, saved_bytes = gpu.saved_bytes(shape);
  float* x = b.alloc<float>(n);
  float* y = b.alloc<float>(n);
  std::byte* saved = b.poisoned(saved_bytes);
  Inputs in;
  in.shape = shape;
  po::backend::CudaContext ctx = dev.context(s);
  // y one value short: refused with nothing written into the saved buffer.
  CHECK_THROWS_WITH_AS(gpu.forward(ctx, microbatch(1, 3, 0, in, {}, nullptr), view(x, n), view(y, n - 1), saved),
                       doctest::Contains(": y holds"), po::shape_error);
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> after(saved_bytes);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(after.data(), saved, saved_bytes, cudaMemcpyDeviceToHost));
  CHECK(std::all_of(after.begin(), after.end(), [](unsigned char v) { return v == 0xFF; }));
  // B and W without a stash: refused on the host, not a fault on the device.
  CHECK_THROWS_WITH_AS(
      gpu.backward_input(ctx, microbatch(1, 3, 0, in, {}, nullptr), view(y, n), view(x, n), saved, nullptr),
      doctest::Contains("::backward_input: stash must be a device buffer aligned to"), po::error);
  CHECK_THROWS_WITH_AS(gpu.backward_weight(ctx, microbatch(1, 3, 0, in, {}, nullptr), saved, nullptr),
                       doctest::Contains("::backward_weight: stash must be a device buffer aligned to"), po::error);
}

TEST_CASE("llama::CudaLlamaStage with bf16 boundaries gives the bits it gives with fp32 boundaries (a middle stage)") {
  const po::llama::LlamaConfig c = llama_config(6);
  const int stage = 1, stages = 3;
  const po::MicrobatchShape shape{2, 32};
  po::llama::LlamaStage cpu(c, stage, stages);
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int s = dev.make_stream("compute");
  po::llama::CudaLlamaStage wide(dev, c, stage, stages, shape, cpu.parameters());
  po::llama::CudaLlamaStage narrow(dev, c, stage, stages, shape, cpu.parameters(), po::DType::bfloat16);
  check_narrow_boundaries(dev, s, wide, narrow, make_inputs(c, shape, 4343), stage, stages);
}

TEST_CASE("llama::CudaLlamaStage matches llama::LlamaStage as one stage holding the whole model, tied and untied") {
  po::llama::LlamaConfig c = llama_config(2);
  check_llama_stage(c, 0, 1);
  c.tie_embeddings = true;
  check_llama_stage(c, 0, 1);
}

// A vocabulary wide enough that the head's fp32 logits come in blocks of 64 rows
// (cuda::logits_rows): 160 tokens run as 64 + 64 + 32, the last block partial.
constexpr int wide_vocab = 600000;
constexpr po::MicrobatchShape wide_shape{2, 80};
static_assert(po::cuda::logits_rows(2 * 80, wide_vocab) == 64);

TEST_CASE("the CUDA heads run their logits in blocks of rows (a 600k vocabulary) and match the CPU stages") {
  po::gpt::GptConfig g = test_config(1, true);
  g.vocab = wide_vocab;
  g.seq = 80;
  check_stage(g, 1, 2, true, wide_shape, std::size_t{3} << 30);  // the head's stage
  po::llama::LlamaConfig c = llama_config(1);
  c.vocab = wide_vocab;
  c.seq = 80;
  check_llama_stage(c, 0, 1, wide_shape, std::size_t{3} << 30);  // embedding, a block and the head
  c.tie_embeddings = true;
  check_llama_stage(c, 0, 1, wide_shape, std::size_t{3} << 30);
}

TEST_CASE(
    "po::Runtime trains llama::CudaLlamaStage stages (PO, every unit offloaded) along the CPU model's loss curve") {
  po::llama::LlamaConfig c = llama_config(4);
  c.hidden = 64;
  c.heads = 4;  // head_dim 16
  c.kv_heads = 2;
  c.ffn = 128;
  c.seq = 16;
  const int steps = 4;
  po::backend::Cpu cpu_dev;
  const std::vector<float> want = train<po::llama::LlamaStage>(
      cpu_dev, [&](int s, int S, po::MicrobatchShape) { return po::llama::LlamaStage(c, s, S); }, steps);
  po::backend::Cuda gpu_dev({.arena_bytes = std::size_t{512} << 20});
  const std::vector<float> got = train<po::llama::CudaLlamaStage>(
      gpu_dev, [&](int s, int S, po::MicrobatchShape mbs) { return po::llama::CudaLlamaStage(gpu_dev, c, s, S, mbs); },
      steps);
  for (int s = 0; s < steps; ++s) {
    const std::size_t i = static_cast<std::size_t>(s);
    const double e = std::abs(static_cast<double>(got[i]) - want[i]) / want[i];
    MESSAGE("step " << s << ": loss gpu " << got[i] << ", cpu " << want[i] << ", relative error " << e);
    CHECK(e <= (s == 0 ? forward_tol : backward_tol));
  }
  CHECK(want[steps - 1] < want[0]);
  CHECK(got[steps - 1] < got[0]);
}
