// tests/cuda/test_conformance_cuda.cpp: the backend conformance cases on backend::Cuda.
#include <memory>

#include <pipeoffload/cuda.hpp>

#include <pipeoffload/ops/cuda.hpp>  // GeLU, the conformance stage's element-wise pass on the GPU

#include "backend_conformance.hpp"

namespace {

namespace pk = pipeoffload::cuda::kernels;

struct CudaTraits {
  static constexpr float tolerance = 1.0f / 64;   // through bf16 (8 significant bits) and back
  static constexpr float fp32_tolerance = 1e-6f;  // fp32 on both sides; FMA contraction may differ
  static constexpr bool abort_throws = false;     // the stream drains (the runtime fails the device itself)
  static std::unique_ptr<pipeoffload::backend::Cuda> make() {
    return std::make_unique<pipeoffload::backend::Cuda>(
        pipeoffload::backend::Cuda::Options{.arena_bytes = std::size_t{1} << 30});
  }
  static void delay(const pipeoffload::backend::CudaContext& ctx) { pk::spin(100'000'000, ctx.cuda_stream); }  // ~50 ms
  // The ops store bf16: convert in, run, convert out (scratch from the arena's workspace).
  static void gelu_forward(pipeoffload::backend::CudaContext& ctx, const float* x, float* y, std::size_t n) {
    auto* a = reinterpret_cast<pk::bf16*>(ctx.workspace);
    auto* b = a + n;
    pk::to_bf16(x, a, static_cast<long long>(n), ctx.cuda_stream);
    pipeoffload::ops::gelu_forward(ctx, a, b, static_cast<long long>(n));
    pk::to_float(b, y, static_cast<long long>(n), ctx.cuda_stream);
  }
  static void gelu_backward(pipeoffload::backend::CudaContext& ctx, const float* x, const float* dy, float* dx,
                            std::size_t n) {
    auto* a = reinterpret_cast<pk::bf16*>(ctx.workspace);
    auto* g = a + n;
    pk::to_bf16(x, a, static_cast<long long>(n), ctx.cuda_stream);
    pk::to_bf16(dy, g, static_cast<long long>(n), ctx.cuda_stream);
    pipeoffload::ops::gelu_backward(ctx, a, g, static_cast<long long>(n));
    pk::to_float(g, dx, static_cast<long long>(n), ctx.cuda_stream);
  }
};

}  // namespace

PIPEOFFLOAD_CONFORMANCE_CASES(CudaTraits, "backend::Cuda")
