// bench/cuda/gpt_block_gpu.cpp: MFU of one GPT block's F+B+W on a GPU and the PCIe bandwidth
// of one copy stream, then k measured against k from the paper's formula (DESIGN.md s. 1).
//   ./build/bench/cuda/gpt_block_gpu [--hidden 4096] [--seq 4096] [--heads 32] [--iters 5]
// Exits 77 without a GPU. It checks first (tests/cuda/test_gpu.cpp checks every piece against
// the CPU reference; here one GEMM of the real size is compared on sampled entries), then
// times with CUDA events and reports the median of --iters runs.
//   FLOPs of F+B+W = 12 b s h (6h + s) ... the paper's count: 72bsh^2 (GEMMs) + 12bs^2h
//   (attention, causal counted in full as the paper does).
//   MFU = FLOPs / time / peak, peak = dense bf16 of the device (A100 312, H100 SXM 989,
//   B200 2250 TFLOP/s; other devices: pass --peak-tflops).
//   Bo = bytes / time of one D2H copy of A = 20 b s h bytes (one layer's saved activations
//   with selective recompute) on one stream from the device into pinned host memory.
//   k measured = round trip 2A/Bo over the measured F+B+W time;
//   k formula  = 10 / (3 (6h + s)) * Bc / Bo with the measured Bc.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <pipeoffload/cuda.hpp>

namespace po = pipeoffload;
namespace pk = pipeoffload::cuda::kernels;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  long long h = 4096, s = 4096, heads = 32, b = 1;
  int iters = 5;
  double peak_tflops = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (a == "--hidden") h = v;
    else if (a == "--seq") s = v;
    else if (a == "--heads") heads = v;
    else if (a == "--iters") iters = static_cast<int>(v);
    else if (a == "--peak-tflops") peak_tflops = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (po::backend::device_count() == 0) {
    std::puts("no CUDA device: SKIP");
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    PIPEOFFLOAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (peak_tflops == 0) peak_tflops = prop.major == 8 ? 312 : prop.major == 9 ? 989 : prop.major == 10 ? 2250 : 0;
    const long long T = b * s;
    po::backend::Cuda dev;
    const int cs = dev.make_stream("compute"), copy = dev.make_stream("copy");
    using po::backend::Memory;
    const auto bf = [&](long long n) { return reinterpret_cast<pk::bf16*>(dev.device_alloc(static_cast<std::size_t>(n) * 2, Memory::activation).ptr); };
    const auto f32 = [&](long long n) { return reinterpret_cast<float*>(dev.device_alloc(static_cast<std::size_t>(n) * 4, Memory::stash).ptr); };
    // Weights bf16, gradients fp32; activations (T, .) bf16.
    pk::bf16 *wqkv = bf(h * 3 * h), *wo = bf(h * h), *wfc = bf(h * 4 * h), *wpr = bf(4 * h * h);
    float *gqkv = f32(h * 3 * h), *go = f32(h * h), *gfc = f32(h * 4 * h), *gpr = f32(4 * h * h);
    pk::bf16 *x = bf(T * h), *qkv = bf(T * 3 * h), *att = bf(T * h), *f = bf(T * 4 * h), *y = bf(T * h);
    pk::bf16 *dqkv = bf(T * 3 * h), *datt = bf(T * h), *df = bf(T * 4 * h), *dx = bf(T * h);
    float* stats = f32(b * heads * s);
    const po::cuda::attention::Shape shape{static_cast<int>(b), static_cast<int>(heads), static_cast<int>(s), static_cast<int>(h / heads)};
    std::vector<float> ones(static_cast<std::size_t>(T * 4 * h));
    for (std::size_t i = 0; i < ones.size(); ++i) ones[i] = 0.01f * static_cast<float>((i * 2654435761u) % 200) - 1.0f;
    float* init = f32(T * 4 * h);
    PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(init, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    for (pk::bf16* p : {wqkv, wo, wfc, wpr}) pk::to_bf16(init, p, std::min(T, h) * h, dev.stream(cs));
    pk::to_bf16(init, x, T * h, dev.stream(cs));
    using po::cuda::Out;
    const auto block = [&](po::backend::CudaContext& c) {
      // F
      po::cuda::gemm(c, po::cuda::linear_forward(T, h, 3 * h), x, wqkv, qkv, Out::bf16);
      po::cuda::attention::forward(c.dnn, c.cuda_stream, shape, qkv, att, stats, c.workspace, c.workspace_bytes);
      po::cuda::gemm(c, po::cuda::linear_forward(T, h, h), att, wo, y, Out::bf16);
      po::cuda::gemm(c, po::cuda::linear_forward(T, h, 4 * h), y, wfc, f, Out::bf16);
      po::cuda::gemm(c, po::cuda::linear_forward(T, 4 * h, h), f, wpr, y, Out::bf16);
      // B
      po::cuda::gemm(c, po::cuda::linear_dgrad(T, 4 * h, h), y, wpr, df, Out::bf16);
      po::cuda::gemm(c, po::cuda::linear_dgrad(T, h, 4 * h), df, wfc, dx, Out::bf16);
      po::cuda::gemm(c, po::cuda::linear_dgrad(T, h, h), dx, wo, datt, Out::bf16);
      po::cuda::attention::backward(c.dnn, c.cuda_stream, shape, qkv, att, datt, stats, dqkv, c.workspace, c.workspace_bytes);
      po::cuda::gemm(c, po::cuda::linear_dgrad(T, h, 3 * h), dqkv, wqkv, dx, Out::bf16);
      // W
      po::cuda::gemm(c, po::cuda::linear_wgrad(T, 4 * h, h), f, y, gpr, Out::f32);
      po::cuda::gemm(c, po::cuda::linear_wgrad(T, h, 4 * h), y, df, gfc, Out::f32);
      po::cuda::gemm(c, po::cuda::linear_wgrad(T, h, h), att, datt, go, Out::f32);
      po::cuda::gemm(c, po::cuda::linear_wgrad(T, h, 3 * h), x, dqkv, gqkv, Out::f32);
    };
    cudaEvent_t e0, e1;
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&e0));
    PIPEOFFLOAD_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> t_block, t_copy;
    dev.launch(cs, [&] {
      auto c = dev.context(cs);
      block(c);  // warm-up: builds the cuDNN graphs and picks cuBLASLt algorithms
    });
    dev.synchronize();
    for (int it = 0; it < iters; ++it) {
      dev.launch(cs, [&] {
        auto c = dev.context(cs);
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e0, c.cuda_stream));
        block(c);
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e1, c.cuda_stream));
      });
      dev.synchronize();
      float ms = 0;
      PIPEOFFLOAD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t_block.push_back(ms / 1e3);
    }
    const std::size_t A = static_cast<std::size_t>(20 * b * s * h);
    po::backend::HostBlock host = dev.host_alloc(A);
    po::backend::Block unit = dev.device_alloc(A, Memory::activation);
    for (int it = 0; it < iters; ++it) {
      dev.launch(copy, [&] {
        const cudaStream_t st = dev.stream(copy);
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e0, st));
        const po::backend::CopyPiece p{host.ptr, unit.ptr, A};
        dev.transfer(std::span<const po::backend::CopyPiece>(&p, 1));
        PIPEOFFLOAD_CUDA_CHECK(cudaEventRecord(e1, st));
      });
      dev.synchronize();
      float ms = 0;
      PIPEOFFLOAD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t_copy.push_back(ms / 1e3);
    }
    const double flops = 12.0 * b * s * h * (6.0 * h + s);
    const double tb = median(t_block), tc = median(t_copy);
    const double Bc = flops / tb, Bo = static_cast<double>(A) / tc;
    const double k_measured = 2.0 * tc / tb;
    const double k_formula = 10.0 / (3.0 * (6.0 * h + s)) * Bc / Bo;
    std::printf("device %s (sm_%d%d), h=%lld s=%lld heads=%lld b=%lld, median of %d\n", prop.name, prop.major, prop.minor, h, s, heads, b, iters);
    std::printf("F+B+W of one block: %.3f ms, %.1f TFLOP/s, MFU %.1f%% of %.0f TFLOP/s\n", tb * 1e3, Bc / 1e12,
                peak_tflops > 0 ? 100.0 * Bc / (peak_tflops * 1e12) : 0.0, peak_tflops);
    std::printf("one copy stream D2H of A = 20bsh = %zu bytes: %.3f ms, %.2f GB/s\n", A, tc * 1e3, Bo / 1e9);
    std::printf("k measured (2 A / Bo over T_F+T_B+T_W) = %.3f; k formula 10/(3(6h+s)) * Bc/Bo = %.3f\n", k_measured, k_formula);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_block_gpu: %s\n", e.what());
    return 1;
  }
}
