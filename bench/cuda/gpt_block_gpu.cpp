// bench/cuda/gpt_block_gpu.cpp: MFU of one real GPT block (gpt::CudaGptStage: LayerNorms, bias
// adds, GeLU, dropout, cuBLASLt GEMMs, cuDNN attention) and of one Llama-class block for F, B
// and W, beside the bare GEMMs and attention, then the pinned PCIe bandwidth and k measured
// against the paper's formula. Exits 77 without a GPU; checks the stage against the CPU
// reference first, then times with CUDA events (medians of --iters runs).
//   ./build/bench/cuda/gpt_block_gpu [--hidden 4096] [--seq 4096] [--heads 32] [--batch 1]
//                                    [--iters 5] [--recompute 1] [--peak-tflops P]
//                                    [--kv-heads 8] [--ffn 14336]
// FLOPs, MFU's peaks, Bo and k as it measures them: docs/benchmarks.md, "bench/cuda/gpt_block_gpu".
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda.hpp>
#include <models/llama/cuda.hpp>
#include <pipeoffload/cuda.hpp>
#include "../../samples/cli.hpp"

namespace po = pipeoffload;
namespace pc = pipeoffload::cuda;
namespace pm = pipeoffload::gpt;
namespace pk = pipeoffload::cuda::kernels;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<float> random_bf16(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = __bfloat162float(__float2bfloat16(d(rng)));
  return v;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, w = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    d += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    w += static_cast<double>(want[i]) * want[i];
  }
  return w > 0 ? std::sqrt(d / w) : std::sqrt(d);
}

template <class T>
T* device_copy(const std::vector<T>& v) {
  void* p = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> host_copy(const T* d, std::size_t n) {
  std::vector<T> v(n);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

/// fp32 boundary views (a middle stage reads no step inputs).
po::ConstTensor in_view(const float* p, std::size_t n) {
  return {reinterpret_cast<const std::byte*>(p), n, po::DType::float32};
}
po::Tensor out_view(float* p, std::size_t n) { return {reinterpret_cast<std::byte*>(p), n, po::DType::float32}; }

po::Microbatch middle_microbatch(po::MicrobatchShape shape, int mb) {
  po::Microbatch m;
  m.stage = 1;
  m.stages = 3;
  m.mb = mb;
  m.microbatches = 2;
  m.shape = shape;
  m.loss_scale = 0.5f;
  return m;
}

/// One middle block at a small size on the GPU and on the CPU; false (and a message) when the
/// GPU is off by more than bf16 accounts for (tests/cuda/test_gpt_gpu.cpp argues the bounds).
bool check_against_cpu(bool recompute) {
  po::gpt::GptConfig c;
  c.vocab = 256;
  c.hidden = 256;
  c.heads = 4;
  c.layers = 3;
  c.seq = 256;
  c.recompute = recompute;
  const po::MicrobatchShape shape{1, 256};
  po::gpt::GptStage cpu(c, 1, 3);
  po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
  const int cs = dev.make_stream("compute");
  pm::CudaGptStage gpu(dev, c, 1, 3, shape, cpu.parameters());
  const std::size_t n = cpu.input_boundary(shape).elements;
  const std::vector<float> x = random_bf16(n, 1), dy = random_bf16(n, 2);
  std::vector<float> y(n), dx(n);
  std::vector<std::byte> saved(cpu.saved_bytes(shape)), stash(cpu.stash_bytes(shape));
  po::backend::CpuContext cctx{};
  const po::Microbatch mb = middle_microbatch(shape, 0);
  cpu.forward(cctx, mb, in_view(x.data(), n), out_view(y.data(), n), saved.data());
  cpu.backward_input(cctx, mb, in_view(dy.data(), n), out_view(dx.data(), n), saved.data(), stash.data());
  cpu.backward_weight(cctx, mb, saved.data(), stash.data());
  float *dxd = device_copy(x), *ddy = device_copy(dy), *dyd = device_copy(y), *ddx = device_copy(dx);
  std::byte *dsaved = nullptr, *dstash = nullptr;
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dsaved), gpu.saved_bytes(shape)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dstash), gpu.stash_bytes(shape)));
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  dev.launch(cs, [&] {
    po::backend::CudaContext ctx = dev.context(cs);
    gpu.forward(ctx, mb, in_view(dxd, n), out_view(dyd, n), dsaved);
    gpu.backward_input(ctx, mb, in_view(ddy, n), out_view(ddx, n), dsaved, dstash);
    gpu.backward_weight(ctx, mb, dsaved, dstash);
  });
  dev.synchronize();
  const double ey = rel_error(host_copy(dyd, n), y), edx = rel_error(host_copy(ddx, n), dx);
  const std::vector<float> want_g(cpu.gradients().begin(), cpu.gradients().end());
  const double eg = rel_error(host_copy(gpu.gradients().data(), want_g.size()), want_g);
  for (void* p : {static_cast<void*>(dxd), static_cast<void*>(ddy), static_cast<void*>(dyd), static_cast<void*>(ddx),
                  static_cast<void*>(dsaved), static_cast<void*>(dstash)})
    PIPEOFFLOAD_CUDA_CHECK(cudaFree(p));
  std::printf(
      "check vs CPU (h=256, s=256, one block, recompute %s): relative error y %.2e, dx %.2e, weight gradients %.2e\n",
      recompute ? "on" : "off", ey, edx, eg);
  const bool ok = ey <= 2e-2 && edx <= 5e-2 && eg <= 5e-2;
  if (!ok)
    std::fprintf(
        stderr,
        "gpt_block_gpu: the GPU block disagrees with the CPU reference (bounds 2e-2, 5e-2, 5e-2); not timing\n");
  return ok;
}

/// A block's boundary tensors (fp32 x, y, dy, dx of Th values) and its saved and stash buffers
/// from `dev`'s arena, x and dy filled with the same bf16 values (seed `seed`).
struct BlockBuffers {
  float *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
  std::byte *saved = nullptr, *stash = nullptr;
};
BlockBuffers block_buffers(po::backend::Cuda& dev, std::size_t Th, std::size_t saved, std::size_t stash,
                           unsigned seed) {
  using po::backend::Memory;
  const auto f32 = [&] { return reinterpret_cast<float*>(dev.device_alloc(Th * 4, Memory::message).ptr); };
  BlockBuffers b{f32(),
                 f32(),
                 f32(),
                 f32(),
                 dev.device_alloc(saved, Memory::activation).ptr,
                 dev.device_alloc(stash, Memory::stash).ptr};
  const std::vector<float> init = random_bf16(Th, seed);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(b.x, init.data(), Th * 4, cudaMemcpyHostToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(b.dy, init.data(), Th * 4, cudaMemcpyHostToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
  return b;
}

/// A Llama block's F+B+W: what it times and counts.
struct LlamaBlock {
  double seconds = 0;  ///< median F+B+W
  double flops = 0;    ///< 3 x (2T (2h^2 + 2h kv + 3h f) + 4 b s^2 h): the GPT formula's terms for this block
};

/// One middle Llama block (llama::CudaLlamaStage, stage 1 of 3 of a 3-block model) timed as the
/// GPT block is, on a backend of its own (destroyed before the GPT's is made). With `documents`
/// > 0 its rows are packed, each holding that many documents of equal length (the last takes
/// the remainder), through cuDNN's ragged attention; its FLOPs then count the documents'
/// attention, 4 b h sum(length^2), in the place of 4 b s^2 h.
LlamaBlock llama_block(long long h, long long s, long long heads, long long kv_heads, long long ffn, long long b,
                       int iters, int documents = 0) {
  po::llama::LlamaConfig cfg;
  cfg.vocab = 256;
  cfg.hidden = static_cast<int>(h);
  cfg.heads = static_cast<int>(heads);
  cfg.kv_heads = static_cast<int>(kv_heads);
  cfg.ffn = static_cast<int>(ffn);
  cfg.layers = 3;
  cfg.seq = static_cast<int>(s);
  cfg.packed = documents > 0;
  const po::MicrobatchShape shape{static_cast<int>(b), static_cast<int>(s)};
  // The rows' offsets (po::document_offsets_input): equal documents, the remainder in the last.
  std::vector<std::int32_t> offsets;
  double squares = static_cast<double>(b) * static_cast<double>(s) * static_cast<double>(s);
  if (documents > 0) {
    squares = 0;
    const long long len = s / documents;
    for (long long r = 0; r < b; ++r) {
      for (int d = 0; d < documents; ++d) offsets.push_back(static_cast<std::int32_t>(d * len));
      offsets.resize(static_cast<std::size_t>((r + 1) * (s + 1)), static_cast<std::int32_t>(s));
      const double last = static_cast<double>(s - (documents - 1) * len);
      squares += (documents - 1) * static_cast<double>(len) * static_cast<double>(len) + last * last;
    }
  }
  const po::llama::LlamaDims dims = po::llama::llama_dims(cfg, 1, 3);
  const po::llama::LlamaStageBuffers bufs = po::llama::llama_cuda_buffers(dims, b * s);
  const std::size_t Th = static_cast<std::size_t>(b * s * h);
  po::backend::Cuda::Options opt;
  const pc::attention::Shape att{static_cast<int>(b), static_cast<int>(heads), static_cast<int>(s),
                                 static_cast<int>(h / heads), static_cast<int>(kv_heads)};
  opt.workspace_bytes = std::max(opt.workspace_bytes, pc::attention::workspace_bytes(att, true, 0, true));
  if (documents > 0) {
    pc::attention::Shape packed = att;
    packed.documents = static_cast<int>(b) * documents;
    // (the graphs' length: the longest document's, the last, rounded up as the stage rounds it)
    packed.length = pc::packed_length(static_cast<int>(s - (documents - 1) * (s / documents)), static_cast<int>(s));
    opt.workspace_bytes = std::max(opt.workspace_bytes, pc::attention::workspace_bytes(packed, true, 0, true));
  }
  opt.arena_bytes = bufs.saved_bytes + bufs.stash_bytes + 16 * Th + opt.workspace_bytes + (std::size_t{512} << 20);
  po::backend::Cuda dev(opt);
  const int cs = dev.make_stream("compute");
  std::printf("building the Llama block's parameters on the CPU (llama::LlamaStage init)...\n");
  po::llama::CudaLlamaStage stage(dev, cfg, 1, 3, shape);
  const BlockBuffers bb = block_buffers(dev, Th, bufs.saved_bytes, bufs.stash_bytes, 5);
  std::vector<po::StepInput> inputs;
  if (documents > 0) {
    auto* d = reinterpret_cast<std::int32_t*>(dev.device_alloc(offsets.size() * 4, po::backend::Memory::state).ptr);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(d, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
    PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
    inputs.push_back({po::document_offsets_input,
                      {reinterpret_cast<const std::byte*>(d), offsets.size(), po::DType::int32},
                      po::ConstTensor(po::view(std::as_const(offsets)))});
  }
  const auto microbatch = [&] {
    po::Microbatch m = middle_microbatch(shape, 1);
    m.inputs = inputs;
    return m;
  };
  stage.prepare(microbatch());  // a packed microbatch's graphs, before the timing
  float *x = bb.x, *y = bb.y, *dy = bb.dy, *dx = bb.dx;
  std::byte *saved = bb.saved, *stash = bb.stash;
  cudaEvent_t ev[2];
  for (cudaEvent_t& e : ev) PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> t;
  for (int it = 0; it <= iters; ++it) {  // run 0 warms up
    dev.launch(cs, [&] {
      po::backend::CudaContext c = dev.context(cs);
      const po::Microbatch m = microbatch();
      PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[0], c.cuda_stream));
      stage.forward(c, m, in_view(x, Th), out_view(y, Th), saved);
      stage.backward_input(c, m, in_view(dy, Th), out_view(dx, Th), saved, stash);
      stage.backward_weight(c, m, saved, stash);
      PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[1], c.cuda_stream));
    });
    dev.synchronize();
    float ms = 0;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    if (it > 0) t.push_back(ms / 1e3);
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  const double T = static_cast<double>(b * s), kv = static_cast<double>(kv_heads * (h / heads));
  const double hd = static_cast<double>(h), f = static_cast<double>(ffn);
  return {median(t), 3.0 * (2.0 * T * (2.0 * hd * hd + 2.0 * hd * kv + 3.0 * hd * f) + 4.0 * squares * hd)};
}

}  // namespace

int main(int argc, char** argv) {
  long long h = 4096, s = 4096, heads = 32, b = 1, kv_heads = 8, ffn = 14336, documents = 8;
  int iters = 5;
  bool recompute = true;
  double peak_tflops = 0;
  cli::parsed_or_exit("gpt_block_gpu", [&] {
    cli::help(
        argc, argv,
        "usage: gpt_block_gpu [--hidden 4096] [--seq 4096] [--heads 32] [--batch 1] [--iters 5] [--recompute 1]\n                     [--peak-tflops P] [--kv-heads 8] [--ffn 14336] [--documents 8]\n"
        "  --documents D: the Llama block again with each row packed with D equal documents (0: not)\n");
    constexpr cli::Flag flags[] = {{"--hidden"}, {"--seq"},   {"--heads"},     {"--batch"},       {"--kv-heads"},
                                   {"--ffn"},    {"--iters"}, {"--recompute"}, {"--peak-tflops"}, {"--documents"}};
    const cli::Args args(argc, argv, flags);
    const auto get = [&](std::string_view f, long long& dst, long long lo, long long hi) {
      if (const std::string* v = args.get(f)) dst = cli::to_int(f, *v, lo, hi);
    };
    get("--hidden", h, 1, 1 << 16);
    get("--seq", s, 1, 1 << 20);
    get("--heads", heads, 1, 1024);
    get("--batch", b, 1, 4096);
    get("--kv-heads", kv_heads, 1, 1024);
    get("--ffn", ffn, 1, 1 << 20);
    get("--documents", documents, 0, 1 << 20);
    long long n = iters, rc = recompute ? 1 : 0;
    get("--iters", n, 1, 1000);
    get("--recompute", rc, 0, 1);
    iters = static_cast<int>(n);
    recompute = rc != 0;
    if (const std::string* v = args.get("--peak-tflops")) peak_tflops = cli::to_real("--peak-tflops", *v, 0, 1e6, true);
    if (h % heads != 0 || heads % kv_heads != 0)
      throw cli::bad_argument("--heads " + std::to_string(heads) + " must divide --hidden " + std::to_string(h) +
                              ", and --kv-heads " + std::to_string(kv_heads) + " must divide --heads");
    if (documents > s)
      throw cli::bad_argument("--documents " + std::to_string(documents) + " is outside [0, --seq " +
                              std::to_string(s) + "] (at most one a token)");
  });
  if (po::backend::device_count() == 0) {
    std::puts("no CUDA device: SKIP");
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    PIPEOFFLOAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (peak_tflops == 0) peak_tflops = prop.major == 8 ? 312 : prop.major == 9 ? 989 : prop.major == 10 ? 2250 : 0;
    if (!check_against_cpu(recompute)) return 1;
    // The Llama block first, on a backend of its own, so that the GPT's has the memory after it.
    const LlamaBlock llama = llama_block(h, s, heads, kv_heads, ffn, b, iters);
    const LlamaBlock packed =
        documents > 0 ? llama_block(h, s, heads, kv_heads, ffn, b, iters, static_cast<int>(documents)) : LlamaBlock{};

    // ---- the block: stage 1 of 3 of a 3-block model, so exactly one block, no embedding or head.
    po::gpt::GptConfig cfg;
    cfg.vocab = 256;
    cfg.hidden = static_cast<int>(h);
    cfg.heads = static_cast<int>(heads);
    cfg.layers = 3;
    cfg.seq = static_cast<int>(s);
    cfg.recompute = recompute;
    const po::MicrobatchShape shape{static_cast<int>(b), static_cast<int>(s)};
    const long long T = b * s;
    const pm::GptDims dims{cfg.vocab, h, heads, s, 1, 1, false, false, recompute};
    const pm::GptStageBuffers bufs = pm::gpt_stage_buffers(dims, T);
    // Workspace: the default 256 MiB or what cuDNN's deterministic attention backward asks for
    // this shape, whichever is larger (1 GiB at s = 4096, 32 heads).
    po::backend::Cuda::Options opt;
    opt.workspace_bytes = std::max(opt.workspace_bytes,
                                   pc::attention::workspace_bytes({static_cast<int>(b), static_cast<int>(heads),
                                                                   static_cast<int>(s), static_cast<int>(h / heads)}));
    // Arena: saved, stash, four boundaries, the bare block's buffers below, the workspace, and
    // 512 MiB of slack for the allocator's rounding.
    const std::size_t Th = static_cast<std::size_t>(T * h), hh = static_cast<std::size_t>(h * h);
    const std::size_t bare = 24 * hh + 48 * hh + 38 * Th + 16 * Th + static_cast<std::size_t>(b * heads * s) * 4;
    // (Two saved buffers: the copy benchmark moves one each way at once.)
    opt.arena_bytes =
        2 * bufs.saved_bytes + bufs.stash_bytes + 16 * Th + bare + opt.workspace_bytes + (std::size_t{512} << 20);
    po::backend::Cuda dev(opt);
    const int cs = dev.make_stream("compute"), copy = dev.make_stream("copy");
    std::printf("building the block's parameters on the CPU (gpt::GptStage init, %lld parameters)...\n",
                12 * h * h + 13 * h);
    pm::CudaGptStage stage(dev, cfg, 1, 3, shape);
    using po::backend::Memory;
    const auto dalloc = [&](std::size_t bytes, Memory kind) { return dev.device_alloc(bytes, kind).ptr; };
    const BlockBuffers bb = block_buffers(dev, Th, stage.saved_bytes(shape), stage.stash_bytes(shape), 3);
    float *x = bb.x, *y = bb.y, *dy = bb.dy, *dx = bb.dx;
    std::byte *saved = bb.saved, *stash = bb.stash;
    cudaEvent_t ev[4];
    for (cudaEvent_t& e : ev) PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&e));
    const auto elapsed = [&](int a, int z) {
      float ms = 0;
      PIPEOFFLOAD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[a], ev[z]));
      return ms / 1e3;
    };
    const auto fbw = [&](int mb, bool timed) {
      dev.launch(cs, [&] {
        po::backend::CudaContext c = dev.context(cs);
        const po::Microbatch m = middle_microbatch(shape, mb);
        if (timed) PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[0], c.cuda_stream));
        stage.forward(c, m, in_view(x, Th), out_view(y, Th), saved);
        if (timed) PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[1], c.cuda_stream));
        stage.backward_input(c, m, in_view(dy, Th), out_view(dx, Th), saved, stash);
        if (timed) PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[2], c.cuda_stream));
        stage.backward_weight(c, m, saved, stash);
        if (timed) PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[3], c.cuda_stream));
      });
      dev.synchronize();
    };
    fbw(0, false);  // warm-up: builds the cuDNN graphs, picks cuBLASLt algorithms
    std::vector<double> tf, tb, tw, tfbw;
    for (int it = 0; it < iters; ++it) {
      fbw(1, true);
      tf.push_back(elapsed(0, 1));
      tb.push_back(elapsed(1, 2));
      tw.push_back(elapsed(2, 3));
      tfbw.push_back(elapsed(0, 3));
    }

    // ---- baseline: the same block's bare GEMMs and attention (no LayerNorm, bias, GeLU, dropout).
    const auto bf = [&](long long n) {
      return reinterpret_cast<pk::bf16*>(dalloc(static_cast<std::size_t>(n) * 2, Memory::stash));
    };
    const auto f32 = [&](long long n) {
      return reinterpret_cast<float*>(dalloc(static_cast<std::size_t>(n) * 4, Memory::stash));
    };
    pk::bf16 *wqkv = bf(h * 3 * h), *wo = bf(h * h), *wfc = bf(h * 4 * h), *wpr = bf(4 * h * h);
    float *gqkv = f32(h * 3 * h), *go = f32(h * h), *gfc = f32(h * 4 * h), *gpr = f32(4 * h * h);
    pk::bf16 *bx = bf(T * h), *qkv = bf(T * 3 * h), *att = bf(T * h), *f = bf(T * 4 * h), *by = bf(T * h);
    pk::bf16 *dqkv = bf(T * 3 * h), *datt = bf(T * h), *df = bf(T * 4 * h), *bdx = bf(T * h);
    float* stats = f32(b * heads * s);
    float* init = f32(T * 4 * h);
    const pc::attention::Shape att_shape{static_cast<int>(b), static_cast<int>(heads), static_cast<int>(s),
                                         static_cast<int>(h / heads)};
    {
      std::vector<float> v(static_cast<std::size_t>(T * 4 * h));
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((i * 2654435761u) % 200) - 1.0f;
      PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(init, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
      PIPEOFFLOAD_CUDA_CHECK(cudaDeviceSynchronize());
    }
    dev.launch(cs, [&] {
      const cudaStream_t st = dev.stream(cs);
      // Every element of every operand from `init` (T * 4h values), cycling when an operand is larger.
      const std::pair<pk::bf16*, long long> operands[] = {
          {wqkv, 3 * h * h}, {wo, h * h}, {wfc, 4 * h * h}, {wpr, 4 * h * h}, {bx, T * h}};
      for (const auto& [p, count] : operands)
        for (long long at = 0; at < count; at += T * 4 * h)
          pk::to_bf16(init, p + at, std::min(T * 4 * h, count - at), st);
    });
    using pc::Out;
    const auto bare_block = [&](po::backend::CudaContext& c) {
      pc::gemm(c, pc::linear_forward(T, h, 3 * h), bx, wqkv, qkv, Out::bf16);
      pc::attention::forward(*c.attention, c.cuda_stream, att_shape, qkv, att, stats, c.workspace, c.workspace_bytes);
      pc::gemm(c, pc::linear_forward(T, h, h), att, wo, by, Out::bf16);
      pc::gemm(c, pc::linear_forward(T, h, 4 * h), by, wfc, f, Out::bf16);
      pc::gemm(c, pc::linear_forward(T, 4 * h, h), f, wpr, by, Out::bf16);
      pc::gemm(c, pc::linear_dgrad(T, 4 * h, h), by, wpr, df, Out::bf16);
      pc::gemm(c, pc::linear_dgrad(T, h, 4 * h), df, wfc, bdx, Out::bf16);
      pc::gemm(c, pc::linear_dgrad(T, h, h), bdx, wo, datt, Out::bf16);
      pc::attention::backward(*c.attention, c.cuda_stream, att_shape, qkv, att, datt, stats, dqkv, c.workspace,
                              c.workspace_bytes);
      pc::gemm(c, pc::linear_dgrad(T, h, 3 * h), dqkv, wqkv, bdx, Out::bf16);
      pc::gemm(c, pc::linear_wgrad(T, 4 * h, h), f, by, gpr, Out::f32);
      pc::gemm(c, pc::linear_wgrad(T, h, 4 * h), by, df, gfc, Out::f32);
      pc::gemm(c, pc::linear_wgrad(T, h, h), att, datt, go, Out::f32);
      pc::gemm(c, pc::linear_wgrad(T, h, 3 * h), bx, dqkv, gqkv, Out::f32);
    };
    std::vector<double> tbare;
    for (int it = 0; it <= iters; ++it) {
      dev.launch(cs, [&] {
        po::backend::CudaContext c = dev.context(cs);
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[0], c.cuda_stream));
        bare_block(c);
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[1], c.cuda_stream));
      });
      dev.synchronize();
      if (it > 0) tbare.push_back(elapsed(0, 1));  // run 0 warms up
    }

    // ---- pinned copies of the block's saved activations: D2H alone, H2D alone, and both at
    // once on two streams (PCIe is full duplex; offload's one copy stream alternates them).
    const std::size_t A = stage.saved_bytes(shape);
    po::backend::HostBlock host = dev.host_alloc(A), host_in = dev.host_alloc(A);
    std::byte* saved_in = dalloc(A, Memory::activation);
    const int copy_in = dev.make_stream("copy in");
    const cudaStream_t s_out = dev.stream(copy), s_in = dev.stream(copy_in);
    const auto time_copies = [&](bool out, bool in) {
      std::vector<double> t;
      for (int it = 0; it <= iters; ++it) {
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[0], s_out));
        PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(s_in, ev[0]));
        if (out) PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(host.ptr, saved, A, cudaMemcpyDeviceToHost, s_out));
        if (in) PIPEOFFLOAD_CUDA_CHECK(cudaMemcpyAsync(saved_in, host_in.ptr, A, cudaMemcpyHostToDevice, s_in));
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[2], s_in));
        PIPEOFFLOAD_CUDA_CHECK(cudaStreamWaitEvent(s_out, ev[2]));
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(ev[1], s_out));
        PIPEOFFLOAD_CUDA_CHECK(cudaEventSynchronize(ev[1]));
        if (it > 0) t.push_back(elapsed(0, 1));  // run 0 warms up
      }
      return median(t);
    };
    const double t_d2h = time_copies(true, false), t_h2d = time_copies(false, true), t_both = time_copies(true, true);

    const double flops = 12.0 * b * s * h * (6.0 * h + s);
    const double t = median(tfbw), t0 = median(tbare), tc = t_d2h;
    const double Bc = flops / t, Bo = static_cast<double>(A) / tc;
    const auto mfu = [&](double seconds) {
      return peak_tflops > 0 ? 100.0 * flops / seconds / (peak_tflops * 1e12) : 0.0;
    };
    std::printf("device %s (sm_%d%d), h=%lld s=%lld heads=%lld b=%lld, recompute %s, median of %d\n", prop.name,
                prop.major, prop.minor, h, s, heads, b, recompute ? "on" : "off", iters);
    std::printf(
        "gpt::CudaGptStage, one block: F %.3f ms, B %.3f ms, W %.3f ms; F+B+W %.3f ms, %.1f TFLOP/s, MFU %.1f%% of %.0f TFLOP/s\n",
        median(tf) * 1e3, median(tb) * 1e3, median(tw) * 1e3, t * 1e3, Bc / 1e12, mfu(t), peak_tflops);
    std::printf(
        "baseline, the block's bare GEMMs + cuDNN attention: %.3f ms, MFU %.1f%%; the stage takes %.2fx the baseline\n",
        t0 * 1e3, mfu(t0), t / t0);
    std::printf(
        "saved activations of the block: %zu bytes = %.2f bsh (20 bsh = %lld bytes of tensors + fp32 statistics)\n", A,
        static_cast<double>(A) / static_cast<double>(T * h), 20 * T * h);
    std::printf(
        "pinned copies of them: D2H %.3f ms, %.2f GB/s; H2D %.3f ms, %.2f GB/s; both at once %.3f ms, %.2f GB/s each way "
        "(%.2f GB/s together)\n",
        t_d2h * 1e3, Bo / 1e9, t_h2d * 1e3, static_cast<double>(A) / t_h2d / 1e9, t_both * 1e3,
        static_cast<double>(A) / t_both / 1e9, 2.0 * static_cast<double>(A) / t_both / 1e9);
    std::printf(
        "llama::CudaLlamaStage, one block (GQA %lld/%lld heads, ffn %lld, RMSNorm, RoPE, SwiGLU): F+B+W %.3f ms, "
        "%.1f TFLOP/s, MFU %.1f%%; %.3f of the GPT block's MFU\n",
        heads, kv_heads, ffn, llama.seconds * 1e3, llama.flops / llama.seconds / 1e12,
        peak_tflops > 0 ? 100.0 * llama.flops / llama.seconds / (peak_tflops * 1e12) : 0.0,
        (llama.flops / llama.seconds) / Bc);
    if (documents > 0)
      std::printf(
          "the same Llama block, each row packed with %lld documents (cuDNN's ragged attention): F+B+W %.3f ms, "
          "%.3fx the unpacked block's time; %.1f TFLOP/s counting the documents' attention, MFU %.1f%%\n",
          documents, packed.seconds * 1e3, packed.seconds / llama.seconds, packed.flops / packed.seconds / 1e12,
          peak_tflops > 0 ? 100.0 * packed.flops / packed.seconds / (peak_tflops * 1e12) : 0.0);
    const double k_measured = 2.0 * tc / t;
    const double k_formula = 10.0 / (3.0 * (6.0 * h + s)) * Bc / Bo;
    std::printf("k measured (2 A / Bo over T_F+T_B+T_W) = %.3f; k formula 10/(3(6h+s)) * Bc/Bo = %.3f\n", k_measured,
                k_formula);
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    dev.host_free(host);
    dev.host_free(host_in);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_block_gpu: %s\n", e.what());
    return 1;
  }
}
