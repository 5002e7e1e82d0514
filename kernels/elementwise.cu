// kernels/elementwise.cu: grid-stride loops for the backend: precision conversions,
// backend/update.hpp's optimizer updates, backend/exact.hpp's gradient sums, the non-finite
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
__global__ void adamw_k(float* p, const float* g, float* m, float* v, long long n, update::AdamWParams o, float lr,
                        update::AdamBias bc, float scale) {
  for (long long i = first_index(); i < n; i += grid_stride()) update::adamw(p[i], g[i] * scale, m[i], v[i], o, lr, bc);
}
__global__ void sgd_k(float* p, const float* g, float* buf, long long n, update::SgdParams o, float lr, float scale,
                      bool first) {
  for (long long i = first_index(); i < n; i += grid_stride()) {
    // Without momentum there is no buffer and update::sgd does not touch it (backend::Cpu's loop likewise).
    float unused = 0;
    update::sgd(p[i], g[i] * scale, buf != nullptr ? buf[i] : unused, o, lr, first);
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
void adamw(float* params, const float* grads, float* m, float* v, long long count, update::AdamWParams hyper, float lr,
           update::AdamBias bias, float grad_scale, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(adamw_k, elementwise_launch(count), s, params, grads, m, v, count, hyper, lr, bias, grad_scale);
}
void sgd(float* params, const float* grads, float* buf, long long count, update::SgdParams hyper, float lr,
         float grad_scale, bool first, cudaStream_t s) {
  PIPEOFFLOAD_LAUNCH(sgd_k, elementwise_launch(count), s, params, grads, buf, count, hyper, lr, grad_scale, first);
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
