// kernels/reduce.cu: the gradient norm's sum of squares, in one block with cub::BlockReduce in
// fp64 (a fixed order: deterministic).
#include <cub/block/block_reduce.cuh>

#include <pipeoffload/backend/cuda/device.cuh>

namespace pipeoffload::cuda::kernels {
namespace {

__global__ void __launch_bounds__(row_block) sum_squares_k(const float* x, double* out, long long n) {
  using ReduceD = cub::BlockReduce<double, row_block>;
  __shared__ ReduceD::TempStorage tmp;
  double s = 0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(x[i]) * x[i];
  const double total = ReduceD(tmp).Sum(s);
  if (threadIdx.x == 0) *out += total;
}

}  // namespace

void sum_squares(const float* x, double* out, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(sum_squares_k, per_row_launch(count > 0 ? 1 : 0, 1), s, x, out, count);
}

}  // namespace pipeoffload::cuda::kernels
