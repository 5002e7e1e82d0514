// pipeoffload/backend/cuda/attention.hpp: causal flash attention through cuDNN's fused SDPA.
//
// Three functions, implemented in src/attention.cpp with NVIDIA's cuDNN frontend graph
// API (its headers come from the nvidia-cudnn-frontend package that scripts/dev.sh installs;
// only that one file includes them, so its compile cost is paid once). Tensors use the GPT's
// layouts (backend/cuda/shapes.hpp sdpa_layout): qkv (b*s, 3h) bf16 with rows [q | k | v],
// out and dout (b*s, h) bf16, stats (b, heads, s) fp32 log-sum-exps, dqkv like qkv. The
// attention scale is 1/sqrt(head_dim) and the mask causal (query i sees keys 0..i), as the
// CPU model's attention. Graphs are built once per shape and kept in an attention::Graphs, which
// the owner of the cuDNN handle owns (backend::Cuda), so they never outlive the handle they were
// finalized against.
/// @file
#pragma once

#ifndef PIPEOFFLOAD_WITH_CUDA
#error "pipeoffload/backend/cuda needs a CUDA build: the build defines PIPEOFFLOAD_WITH_CUDA."
#endif

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pipeoffload::cuda::attention {

/// The shape of one SDPA call (what its graphs are built for).
struct Shape {
  int batch = 1,      ///< B: sequences
      heads = 1,      ///< attention (query) heads
      seq = 1,        ///< S: tokens per sequence
      head_dim = 8,   ///< elements per head (a multiple of 8, at most 256)
      kv_heads = 0,   ///< key/value heads, dividing heads (grouped-query attention); 0: heads
      documents = 0,  ///< packed rows: the documents in the batch's rows, each causal on its
                      ///< own (a Documents table says where); 0: each row is one sequence
      length = 0;     ///< packed rows: the graph's length, at least the longest document and
                      ///< at most seq (cuda::packed_length); 0: seq
};

/// Where a packed microbatch's documents are (device memory, ops::document_table writes it):
/// cuDNN's ragged layout, the documents as its batch and the rows' length as the longest.
/// Offsets are in elements from each tensor's base, Shape::documents + 1 of each (the last
/// is the end of the last document). The statistics of a packed call are (tokens, heads).
struct Documents {
  const std::int32_t* lengths = nullptr;        ///< (documents) tokens of each
  const std::int64_t* q_offsets = nullptr;      ///< first token * q's row stride (also dq's)
  const std::int64_t* kv_offsets = nullptr;     ///< first token * k's and v's row stride
  const std::int64_t* out_offsets = nullptr;    ///< first token * the output's (and dout's)
  const std::int64_t* stats_offsets = nullptr;  ///< first token * heads
};

/// The SDPA graphs of one cuDNN handle, built on first use per (direction, shape) under a lock
/// (a handle may serve several threads). Owned by whoever owns the handle, and destroyed before
/// it. `deterministic`: the backward graph uses cuDNN's deterministic algorithm, so a run
/// repeats bit for bit (the default; off trades that for speed).
class Graphs {
 public:
  /// No graph yet: each is built on first use, on `handle`.
  explicit Graphs(cudnnHandle_t handle, bool deterministic = true);
  ~Graphs();
  Graphs(const Graphs&) = delete;
  Graphs& operator=(const Graphs&) = delete;
  /// The cuDNN handle the graphs are built on.
  cudnnHandle_t handle() const;
  /// Does the backward graph use cuDNN's deterministic algorithm?
  bool deterministic() const;

  struct Impl;
  /// The graphs and their lock (defined in src/attention.cpp, which builds and runs them).
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// Why a training microbatch of one token a row is refused (a layer's prepare() says it, before
/// any pass): the frontend's SDPA backward needs seq >= 2.
inline constexpr const char* seq_one_refused =
    "seq = 1 is outside the range the cuDNN frontend's SDPA backward supports ([2, ...)); train with seq >= 2 "
    "(evaluation takes seq = 1)";

/// Bytes of workspace the larger of the forward and backward graphs needs for `shape` (the
/// fused qkv layout when kv_heads is 0 or heads and `separate` is false, the separate one
/// otherwise: what the caller's passes will run) (builds both graphs; call once before the
/// steady state). The frontend's backward needs seq >= 2: seq = 1 throws cuda_error with a
/// sentence.
std::size_t workspace_bytes(Graphs& graphs, Shape shape, bool separate = false);

/// workspace_bytes(graphs, shape, separate) (with `backward` false the forward graph's alone:
/// an evaluation call builds and needs no backward), checked against `limit` (the backend's
/// Options::workspace_bytes): throws cuda_error with `who`, the need, the shape (and its packed
/// documents) and the limit when the need is larger.
void require_workspace(Graphs& graphs, Shape shape, bool separate, std::size_t limit, const std::string& who,
                       bool backward = true);

/// The same need before any backend exists, to size backend::Cuda::Options::workspace_bytes:
/// builds the graphs on a cuDNN handle of its own on `device` (the current device is restored)
/// and destroys them; `separate` as above (a stage that passes q, k and v apart, as
/// llama::CudaLlamaStage does, sizes those graphs). The deterministic backward needs far more
/// than the other at long sequences (1 GiB for 32 heads of 128 at 4096 tokens on an H100,
/// where the 256 MiB default covers a few hundred tokens).
std::size_t workspace_bytes(Shape shape, bool deterministic = true, int device = 0, bool separate = false);

/// out = softmax(q k^T / sqrt(head_dim), causal) v; stats = the rows' log-sum-exps. With
/// shape.documents > 0 the rows are packed and `docs` says where each document is (its q and
/// kv offsets both in units of the fused row, 3 * heads * head_dim; stats (tokens, heads)).
void forward(Graphs& graphs, cudaStream_t stream, Shape shape, const __nv_bfloat16* qkv, __nv_bfloat16* out,
             float* stats, void* workspace, std::size_t workspace_bytes, Documents docs = {});

/// dqkv from dout, recomputing the probabilities from qkv and stats (no s x s matrix kept).
void backward(Graphs& graphs, cudaStream_t stream, Shape shape, const __nv_bfloat16* qkv, const __nv_bfloat16* out,
              const __nv_bfloat16* dout, const float* stats, __nv_bfloat16* dqkv, void* workspace,
              std::size_t workspace_bytes, Documents docs = {});

/// The same on separate tensors (shapes.hpp sdpa_layout_separate): q (b*s, heads*head_dim), k
/// and v (b*s, kv_heads*head_dim), grouped-query when kv_heads < heads. With
/// shape.documents > 0 the rows are packed and `docs` says where each document is (causal
/// within each; stats (tokens, heads)); a graph is built per document count (ops::document_table
/// pads the count to cuda::document_slots with empty documents, so nearby counts share one).
void forward(Graphs& graphs, cudaStream_t stream, Shape shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
             const __nv_bfloat16* v, __nv_bfloat16* out, float* stats, void* workspace, std::size_t workspace_bytes,
             Documents docs = {});

/// dq, dk, dv (shaped as q, k, v) from dout, on separate tensors (packed as forward).
void backward(Graphs& graphs, cudaStream_t stream, Shape shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
              const __nv_bfloat16* v, const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* stats,
              __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, std::size_t workspace_bytes,
              Documents docs = {});

}  // namespace pipeoffload::cuda::attention
