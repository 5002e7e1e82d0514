// src/elementwise.cu: grid-stride loops for the backend: precision conversions,
// backend/update.hpp's optimizer updates (multi-tensor: cuda::SegmentLaunch), backend/exact.hpp's gradient sums, the non-finite
// check, and a spin for tests.
#include <pipeoffload/backend/cuda/device.cuh>

namespace pipeoffload::cuda::kernels {
namespace {

__global__ void to_bf16_k(const float* in, bf16* out, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) out[i] = st(in[i]);
}
__global__ void to_float_k(const bf16* in, float* out, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) out[i] = ld(in, i);
}
__device__ float update_at(const update::Segment& s, std::size_t i, const update::AdamWStep& step) {
  return update::adamw_at(s, i, step);
}
__device__ float update_at(const update::Segment& s, std::size_t i, const update::SgdStep& step) {
  return update::sgd_at(s, i, step);
}
/// A multi-tensor update (cuda::SegmentLaunch): block b updates its tile of run segment_of(b),
/// then rounds the tile into the run's working copy where it has one.
template <class Step>
__global__ void segments_k(const __grid_constant__ SegmentLaunch l, Step step) {
  const long long b = blockIdx.x;
  const int k = segment_of(l, b);
  const update::Segment& s = l.segments[k];
  const long long n = static_cast<long long>(s.count), begin = (b - l.first_block[k]) * segment_tile;
  const long long end = begin + segment_tile < n ? begin + segment_tile : n;
  bf16* working = reinterpret_cast<bf16*>(s.working);
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float p = update_at(s, static_cast<std::size_t>(i), step);
    if (working != nullptr) working[i] = st(p);
  }
}
/// Each thread ORs its words' verdicts (no early exit, no divergence) and only a thread that
/// saw a non-finite value stores: every store writes the same 1, so their order does not matter.
template <class Word>
__global__ void flag_nonfinite_k(const Word* x, long long n, Word mask, std::uint32_t* flag) {
  bool bad = false;
  for (long long i = first_index(); i < n; i += grid_stride()) bad |= nonfinite_word(x[i], mask);
  if (bad) *flag = 1;
}
__global__ void exact_add_k(exact::Fixed* acc, const float* g, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) exact::add(acc[i], g[i]);
}
__global__ void exact_sum_k(exact::Fixed* out, const exact::Fixed* parts, long long n, int runs) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    exact::Fixed s = parts[i];
    for (int k = 1; k < runs; ++k) s = exact::sum(s, parts[k * n + i]);
    out[i] = s;
  }
}
__global__ void sum_parts_k(float* out, const float* parts, long long n, int runs) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    float s = parts[i];
    for (int k = 1; k < runs; ++k) s = __fadd_rn(s, parts[k * n + i]);  // in replica order, never fused
    out[i] = s;
  }
}
__global__ void sum_parts_bf16_k(float* out, const bf16* parts, long long n, int runs) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    float s = ld(parts, i);
    for (int k = 1; k < runs; ++k) s = __fadd_rn(s, ld(parts, k * n + i));  // in replica order, never fused
    out[i] = s;
  }
}
__global__ void exact_round_k(float* out, const exact::Fixed* acc, long long n) {
  for (long long i = first_index(); i < n; i += grid_stride()) out[i] = exact::to_float(acc[i]);
}
__global__ void spin_k(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

void to_bf16(const float* in, bf16* out, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(to_bf16_k, elementwise_launch(count), s, in, out, count);
}
void to_float(const bf16* in, float* out, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(to_float_k, elementwise_launch(count), s, in, out, count);
}
void adamw(const SegmentLaunch& launch, const update::AdamWStep& step, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(segments_k<update::AdamWStep>, launch.launch(), s, launch, step);
}
void sgd(const SegmentLaunch& launch, const update::SgdStep& step, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(segments_k<update::SgdStep>, launch.launch(), s, launch, step);
}
void flag_nonfinite(const void* data, long long count, DType dtype, std::uint32_t* flag, cudaStream_t s) {
  const std::uint64_t mask = nonfinite_mask(dtype);
  if (mask == 0) return;  // integers: nothing can be non-finite
  // One word per value: the value's own width (dtype_size), so the mask lands on its exponent.
  switch (dtype_size(dtype)) {
    case 2: {
      const auto* x = static_cast<const std::uint16_t*>(data);
      PIPEOFFLOAD_LAUNCH(flag_nonfinite_k<std::uint16_t>, elementwise_launch(count), s, x, count,
                         static_cast<std::uint16_t>(mask), flag);
      break;
    }
    case 4: {
      const auto* x = static_cast<const std::uint32_t*>(data);
      PIPEOFFLOAD_LAUNCH(flag_nonfinite_k<std::uint32_t>, elementwise_launch(count), s, x, count,
                         static_cast<std::uint32_t>(mask), flag);
      break;
    }
    case 8: {
      const auto* x = static_cast<const std::uint64_t*>(data);
      PIPEOFFLOAD_LAUNCH(flag_nonfinite_k<std::uint64_t>, elementwise_launch(count), s, x, count,
                         static_cast<std::uint64_t>(mask), flag);
      break;
    }
    default:
      throw shape_error(std::string("cuda::kernels::flag_nonfinite: ") + dtype_name(dtype) + " values are " +
                        std::to_string(dtype_size(dtype)) + " bytes wide; floating types are 2, 4 or 8");
  }
}
void exact_add(exact::Fixed* acc, const float* g, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(exact_add_k, elementwise_launch(count), s, acc, g, count);
}
void exact_sum(exact::Fixed* out, const exact::Fixed* parts, long long count, int runs, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(exact_sum_k, elementwise_launch(count), s, out, parts, count, runs);
}
void sum_parts(float* out, const float* parts, long long count, int runs, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(sum_parts_k, elementwise_launch(count), s, out, parts, count, runs);
}
void sum_parts(float* out, const bf16* parts, long long count, int runs, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(sum_parts_bf16_k, elementwise_launch(count), s, out, parts, count, runs);
}
void exact_round(float* out, const exact::Fixed* acc, long long count, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(exact_round_k, elementwise_launch(count), s, out, acc, count);
}
void spin(long long cycles, cudaStream_t s) { PIPEOFFLOAD_LAUNCH(spin_k, (Launch{1, 1, 0}), s, cycles); }

}  // namespace pipeoffload::cuda::kernels
