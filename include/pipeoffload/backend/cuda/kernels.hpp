// pipeoffload/backend/cuda/kernels.hpp: plain C++ declarations of the CUDA backend's kernels
// in src/ (precision conversions, optimizer updates, gradient norms, the non-finite check).
//
// The kernels are compiled by nvcc into the build's pipeoffload_cuda_kernels library; this
// header is all host code sees (llm.c's habit of keeping device code behind a small header).
// Every launcher enqueues on `stream`, computes its launch shape with backend/cuda/shapes.hpp
// and checks the launch. Storage is bf16 for activations (`bf16`), fp32 for parameters,
// gradients and optimizer state; the updates' arithmetic is backend/update.hpp's. The ops for
// layers are ops/cuda.hpp.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "pipeoffload/backend/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../tensor.hpp"
#include "../exact.hpp"
#include "../update.hpp"
#include "shapes.hpp"

namespace pipeoffload::cuda::kernels {

using bf16 = __nv_bfloat16;  ///< CUDA's bfloat16

// ---- precision ----------------------------------------------------------------------------
/// Precision conversions (weights: fp32 master -> bf16 working copy; boundaries: bf16 <-> fp32).
void to_bf16(const float* in, bf16* out, long long count, cudaStream_t stream);
/// count bf16 values to fp32, enqueued on `stream`.
void to_float(const bf16* in, float* out, long long count, cudaStream_t stream);

// ---- optimizer -----------------------------------------------------------------------------
/// update::adamw_at on every value of launch's runs, then each run's bfloat16 working copy
/// where it has one (cuda::SegmentLaunch: one block per segment_tile values of a run).
void adamw(const SegmentLaunch& launch, const update::AdamWStep& step, cudaStream_t stream);
/// update::sgd_at likewise.
void sgd(const SegmentLaunch& launch, const update::SgdStep& step, cudaStream_t stream);
/// out[k] = sum of squares of group k of `values` for k < groups, in fp64 and in the fixed
/// order of cuda::sum_squares_reference (shapes.hpp): `table` (device) is cuda::norm_table of
/// the groups' plan, `blocks` its plan's blocks(), `partials` (device) holds `blocks` fp64.
/// Two launches: one block per chunk of every group, then one block per group.
void sum_squares(const float* values, const long long* table, long long groups, long long blocks, double* partials,
                 double* out, cudaStream_t stream);

// ---- exact gradient sums (backend/exact.hpp) ----------------------------------------------
/// acc[i] += g[i] on exact's grid (exact::add).
void exact_add(exact::Fixed* acc, const float* g, long long count, cudaStream_t stream);
/// out[i] = parts[i] + parts[count + i] + ... over `parts` runs of count (exact::sum).
void exact_sum(exact::Fixed* out, const exact::Fixed* parts, long long count, int runs, cudaStream_t stream);
/// out[i] = ((parts[i] + parts[count + i]) + ...) over `runs` parts, in fp32 and that order.
void sum_parts(float* out, const float* parts, long long count, int runs, cudaStream_t stream);
/// The same over bf16 parts, each widened exactly.
void sum_parts(float* out, const bf16* parts, long long count, int runs, cudaStream_t stream);
/// out[i] = exact::to_float(acc[i]).
void exact_round(float* out, const exact::Fixed* acc, long long count, cudaStream_t stream);

// ---- checks ------------------------------------------------------------------------------
/// *flag = 1 if any of the `count` values at `data` is NaN or infinite (nonfinite_word with
/// nonfinite_mask(dtype), shapes.hpp); *flag is left as it is otherwise, and for integer
/// types, which have no such values. Runs in stream order, like the pass it checks.
void flag_nonfinite(const void* data, long long count, DType dtype, std::uint32_t* flag, cudaStream_t stream);

// ---- tests -------------------------------------------------------------------------------------
/// Spins one thread for about `cycles` clock cycles: makes stream ordering observable.
void spin(long long cycles, cudaStream_t stream);

}  // namespace pipeoffload::cuda::kernels
