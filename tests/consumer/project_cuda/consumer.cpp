// tests/consumer/project_cuda/consumer.cpp: what a CMake project that uses pipeoffload's CUDA
// backend compiles, built by check.py (route find_package_cuda) against a prefix installed from
// this build's CUDA configure. Its link is the test: it calls a kernel launcher (the kernels
// library), builds a backend::Cuda (whose cuDNN attention graphs are in the attention library;
// cuBLASLt, cuDNN) and asks NCCL its version. With a GPU it also runs the launchers: fp32 ->
// bf16 -> fp32 on the device must give back values bf16 holds exactly. Without one it says so
// and exits 77.
#include <cstdio>
#include <exception>
#include <vector>

#include <pipeoffload/cuda.hpp>

namespace {

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
    const bool same = round_trip(4096);
    std::printf("consumer_cuda: NCCL %d, bf16 round trip on the device %s\n", nccl,
                same ? "exact" : "CHANGED the values");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("consumer_cuda: %s\n", e.what());
    return 1;
  }
}
