// src/reduce.cu: the gradient norm's sums of squares in fp64, in the fixed order of
// cuda::sum_squares_reference (backend/cuda/shapes.hpp): one block per chunk of every group in
// one launch, then one block per group adding its chunks' partials. Every block ends with the
// same pairwise tree over its lanes (s[t] += s[t + w], w halving), which the CPU reference runs
// level by level: deterministic, and bit for bit the reference's.
#include <pipeoffload/backend/cuda/device.cuh>

namespace pipeoffload::cuda::kernels {
namespace {

/// The pairwise tree of norm_tree on shared memory; every thread of the block calls it.
__device__ double block_tree(double* s, double mine) {
  s[threadIdx.x] = mine;
  for (unsigned w = norm_block / 2; w > 0; w /= 2) {
    __syncthreads();
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
  }
  __syncthreads();
  return s[0];
}

/// Block b reduces chunk b - first_block[k] of group k, the last group with first_block[k] <= b
/// (empty groups own no block, so the last such group is the one that owns it).
__global__ void __launch_bounds__(norm_block)
    norm_partials_k(const float* values, const long long* first_block, const long long* begin, const long long* count,
                    long long groups, double* partials) {
  __shared__ double s[norm_block];
  const long long b = blockIdx.x;
  long long lo = 0, hi = groups - 1;
  while (lo < hi) {
    const long long mid = (lo + hi + 1) / 2;
    if (first_block[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double total = block_tree(s, norm_lane(values + begin[lo], count[lo], b - first_block[lo], threadIdx.x));
  if (threadIdx.x == 0) partials[b] = total;
}

__global__ void __launch_bounds__(norm_block)
    norm_groups_k(const double* partials, const long long* first_block, double* out) {
  __shared__ double s[norm_block];
  const long long k = blockIdx.x, first = first_block[k];
  const double total = block_tree(s, norm_partials_lane(partials + first, first_block[k + 1] - first, threadIdx.x));
  if (threadIdx.x == 0) out[k] = total;
}

}  // namespace

void sum_squares(const float* values, const long long* table, long long groups, long long blocks, double* partials,
                 double* out, cudaStream_t s) {
  if (groups <= 0) return;
  const long long* first_block = table;
  const long long* begin = table + groups + 1;
  const long long* count = begin + groups;
  PIPEOFFLOAD_LAUNCH(norm_partials_k, norm_partials_launch(blocks), s, values, first_block, begin, count, groups,
                     partials);
  PIPEOFFLOAD_LAUNCH(norm_groups_k, norm_groups_launch(groups), s, partials, first_block, out);
}

}  // namespace pipeoffload::cuda::kernels
