// tests/consumer/project_cuda/consumer.cpp: what a CMake project that uses pipeoffload's CUDA
// backend compiles, built by check.py (route find_package_cuda) against a prefix installed from
// this build's CUDA configure. Its link is the test: it calls a kernel launcher (the kernels
// library), a piece of a user's layer written once on the ops (docs/ops.md) for both backends,
// builds a backend::Cuda (whose cuDNN attention graphs are in the attention library; cuBLASLt,
// cuDNN) and asks NCCL its version. With a GPU it also runs them: fp32 -> bf16 -> fp32 on the
// device must give back values bf16 holds exactly, and the layer piece on the GPU must agree
// with it on the CPU within bf16 rounding. Without one it says so and exits 77.
#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

#include <pipeoffload/cuda.hpp>
#include <pipeoffload/ops/cpu.hpp>

namespace {

/// A piece of a user's layer, written once against the ops: RMSNorm, then SwiGLU of a gate
/// against the normalized rows (docs/ops.md).
template <class Context>
void norm_and_gate(const Context& ctx, const po::ops::value_t<Context>* x, const po::ops::value_t<Context>* w,
                   po::ops::value_t<Context>* normed, float* rstd, const po::ops::value_t<Context>* gate,
                   po::ops::value_t<Context>* out, long long rows, int n) {
  po::ops::rmsnorm_forward(ctx, x, w, normed, rstd, rows, n, 1e-5f);
  po::ops::swiglu_forward(ctx, gate, normed, out, rows * n);
}

/// norm_and_gate on the GPU (bf16) and on the CPU (fp32) of the same bf16 values; true if they
/// agree within two bf16 roundings.
bool layer_twins(cudaStream_t stream) {
  const int rows = 8, n = 256;
  const std::size_t N = static_cast<std::size_t>(rows) * n;
  std::vector<float> x(N), gate(N), w(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < N; ++i) {
    x[i] = __bfloat162float(__float2bfloat16(std::sin(0.37f * static_cast<float>(i))));
    gate[i] = __bfloat162float(__float2bfloat16(std::cos(0.11f * static_cast<float>(i))));
  }
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 1.0f + static_cast<float>(i % 5) / 8;
  std::vector<float> normed(N), out(N), rstd(rows);
  norm_and_gate(po::backend::CpuContext{}, x.data(), w.data(), normed.data(), rstd.data(), gate.data(), out.data(),
                rows, n);
  const auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<__nv_bfloat16> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) b[i] = __float2bfloat16(v[i]);
    return b;
  };
  const std::vector<__nv_bfloat16> hx = to_bf16(x), hg = to_bf16(gate), hw = to_bf16(w);
  __nv_bfloat16 *dx = nullptr, *dg = nullptr, *dw = nullptr, *dn = nullptr, *dout = nullptr;
  float* drstd = nullptr;
  for (__nv_bfloat16** p : {&dx, &dg, &dn, &dout}) PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(p, N * sizeof(__nv_bfloat16)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&dw, hw.size() * sizeof(__nv_bfloat16)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&drstd, rows * sizeof(float)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(dx, hx.data(), N * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(dg, hg.data(), N * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(dw, hw.data(), hw.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  po::backend::CudaContext ctx{};
  ctx.cuda_stream = stream;
  norm_and_gate(ctx, dx, dw, dn, drstd, dg, dout, rows, n);
  std::vector<__nv_bfloat16> got(N);
  PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(stream));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(got.data(), dout, N * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dg), static_cast<void*>(dw), static_cast<void*>(dn),
                  static_cast<void*>(dout), static_cast<void*>(drstd)})
    PIPEOFFLOAD_CUDA_CHECK(cudaFree(p));
  for (std::size_t i = 0; i < N; ++i)
    if (!(std::abs(__bfloat162float(got[i]) - out[i]) <= 1e-3f + std::abs(out[i]) / 64)) return false;
  return true;
}

/// to_bf16 then to_float of n small integers (exact in bf16) on the current device, on the
/// legacy stream (ordered with the blocking copies); true if they come back unchanged.
bool round_trip(int n) {
  namespace kernels = po::cuda::kernels;
  std::vector<float> host(static_cast<std::size_t>(n)), back(host.size());
  for (int i = 0; i < n; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>(i % 97 - 48);
  float *in = nullptr, *out = nullptr;
  kernels::bf16* mid = nullptr;  // (n) bf16, device
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&in, host.size() * sizeof(float)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&out, host.size() * sizeof(float)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMalloc(&mid, host.size() * sizeof(kernels::bf16)));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(in, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  kernels::to_bf16(in, mid, n, nullptr);
  kernels::to_float(mid, out, n, nullptr);
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(back.data(), out, back.size() * sizeof(float), cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaFree(in));
  PIPEOFFLOAD_CUDA_CHECK(cudaFree(out));
  PIPEOFFLOAD_CUDA_CHECK(cudaFree(mid));
  return back == host;
}

}  // namespace

int main() {
  int nccl = 0;
  if (ncclGetVersion(&nccl) != ncclSuccess) {
    std::puts("consumer_cuda: ncclGetVersion failed");
    return 1;
  }
  if (po::backend::device_count() == 0) {
    std::printf("consumer_cuda: linked (NCCL %d); no CUDA device (cudaGetDeviceCount), so not run: SKIP\n", nccl);
    return 77;
  }
  try {
    // Selects device 0 and makes cuBLASLt and cuDNN handles and the attention graphs.
    const po::backend::Cuda dev({.arena_bytes = std::size_t{512} << 20});
    const bool same = round_trip(4096), twins = layer_twins(nullptr);
    std::printf("consumer_cuda: NCCL %d, bf16 round trip on the device %s, a layer on the ops %s\n", nccl,
                same ? "exact" : "CHANGED the values",
                twins ? "agrees with its CPU twin" : "DIFFERS from its CPU twin");
    return same && twins ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("consumer_cuda: %s\n", e.what());
    return 1;
  }
}
