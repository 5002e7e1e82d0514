// src/attention.cpp: backend/cuda/attention.hpp on the cuDNN frontend's SDPA graphs.
// Host C++ (no device code): built by the C++ compiler into pipeoffload_cuda_kernels.
#include <pipeoffload/backend/cuda/attention.hpp>

#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <source_location>
#include <string>
#include <tuple>
#include <unordered_map>

#include <pipeoffload/backend/cuda/check.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>

namespace pipeoffload::cuda::attention {
namespace {

namespace fe = cudnn_frontend;

/// The frontend's error_t, checked like every cuDNN call: call text, message, location.
void check_fe(fe::error_t e, const char* call, std::source_location loc = std::source_location::current()) {
  if (e.is_good()) return;
  cudaGetLastError();
  throw cuda_error(std::string("cuDNN frontend error ") + std::to_string(static_cast<int>(e.get_code())) + " in " +
                   call + " at " + detail::where(loc) + ": " + e.get_message());
}
#define PIPEOFFLOAD_FE_CHECK(call) check_fe((call), #call)

// Tensor uids of the variant pack.
enum Uid : std::int64_t { Q = 1, K, V, O, STATS, DO, DQ, DK, DV };

std::vector<std::int64_t> vec(const long long (&a)[4]) { return {a[0], a[1], a[2], a[3]}; }

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid,
                                                    const std::vector<std::int64_t>& dims,
                                                    const std::vector<std::int64_t>& strides) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  std::int64_t workspace = 0;
};

void finish(fe::graph::Graph& g, cudnnHandle_t h, Built& b) {
  PIPEOFFLOAD_FE_CHECK(g.validate());
  PIPEOFFLOAD_FE_CHECK(g.build_operation_graph(h));
  PIPEOFFLOAD_FE_CHECK(g.create_execution_plans({fe::HeurMode_t::A}));
  PIPEOFFLOAD_FE_CHECK(g.check_support(h));
  PIPEOFFLOAD_FE_CHECK(g.build_plans(h));
  PIPEOFFLOAD_FE_CHECK(g.get_workspace_size(b.workspace));
}

void common(fe::graph::Graph& g) {
  g.set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
}

float scale_of(Shape s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

int kv_heads_of(Shape s) { return s.kv_heads == 0 ? s.heads : s.kv_heads; }

/// The layout of a call: Q, K and V in one fused qkv tensor, or in three.
SdpaLayout layout_of(Shape s, bool fused) {
  if (fused && kv_heads_of(s) != s.heads)
    throw shape_error("cuda::attention: a fused qkv tensor has as many key/value heads as query heads (" +
                      std::to_string(s.heads) + "), not kv_heads = " + std::to_string(s.kv_heads) +
                      "; pass q, k and v separately for grouped-query attention");
  return fused ? sdpa_layout(s.batch, s.heads, s.seq, s.head_dim)
               : sdpa_layout_separate(s.batch, s.heads, kv_heads_of(s), s.seq, s.head_dim);
}

Built build_forward(cudnnHandle_t h, Shape s, bool fused) {
  const SdpaLayout l = layout_of(s, fused);
  Built b;
  b.graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph& g = *b.graph;
  common(g);
  auto q = input(g, "Q", Q, vec(l.dims), vec(l.q_strides));
  auto k = input(g, "K", K, vec(l.kv_dims), vec(l.kv_strides));
  auto v = input(g, "V", V, vec(l.kv_dims), vec(l.kv_strides));
  auto opts = fe::graph::SDPA_attributes()
                  .set_name("sdpa_forward")
                  .set_generate_stats(true)  // training: keep the log-sum-exps for backward
                  .set_attn_scale(scale_of(s))
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                  .set_diagonal_band_right_bound(0);  // causal: key j <= query i
  auto [o, stats] = g.sdpa(q, k, v, opts);
  o->set_output(true).set_uid(O).set_dim(vec(l.dims)).set_stride(vec(l.out_strides));
  stats->set_output(true)
      .set_uid(STATS)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(vec(l.stats_dims))
      .set_stride(vec(l.stats_strides));
  finish(g, h, b);
  return b;
}

Built build_backward(cudnnHandle_t h, Shape s, bool fused, bool deterministic) {
  const SdpaLayout l = layout_of(s, fused);
  Built b;
  b.graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph& g = *b.graph;
  common(g);
  auto q = input(g, "Q", Q, vec(l.dims), vec(l.q_strides));
  auto k = input(g, "K", K, vec(l.kv_dims), vec(l.kv_strides));
  auto v = input(g, "V", V, vec(l.kv_dims), vec(l.kv_strides));
  auto o = input(g, "O", O, vec(l.dims), vec(l.out_strides));
  auto dout = input(g, "dO", DO, vec(l.dims), vec(l.out_strides));
  auto stats = g.tensor(fe::graph::Tensor_attributes()
                            .set_name("Stats")
                            .set_uid(STATS)
                            .set_dim(vec(l.stats_dims))
                            .set_stride(vec(l.stats_strides))
                            .set_data_type(fe::DataType_t::FLOAT));
  auto opts = fe::graph::SDPA_backward_attributes()
                  .set_name("sdpa_backward")
                  .set_deterministic_algorithm(deterministic)
                  .set_attn_scale(scale_of(s))
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                  .set_diagonal_band_right_bound(0);
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
  dq->set_output(true).set_uid(DQ).set_dim(vec(l.dims)).set_stride(vec(l.q_strides));
  dk->set_output(true).set_uid(DK).set_dim(vec(l.kv_dims)).set_stride(vec(l.kv_strides));
  dv->set_output(true).set_uid(DV).set_dim(vec(l.kv_dims)).set_stride(vec(l.kv_strides));
  finish(g, h, b);
  return b;
}

void run(cudnnHandle_t h, cudaStream_t stream, const Built& b, std::unordered_map<std::int64_t, void*>& pack, void* ws,
         std::size_t ws_bytes) {
  if (static_cast<std::size_t>(b.workspace) > ws_bytes)
    throw cuda_error("cuda::attention: the graph needs " + std::to_string(b.workspace) +
                     " bytes of workspace, the context has " + std::to_string(ws_bytes) +
                     " (raise backend::Cuda::Options::workspace_bytes)");
  PIPEOFFLOAD_CUDA_CHECK(cudnnSetStream(h, stream));
  PIPEOFFLOAD_FE_CHECK(b.graph->execute(h, pack, ws));
}

}  // namespace

struct Graphs::Impl {
  cudnnHandle_t handle = nullptr;
  bool deterministic = true;
  std::mutex mu;
  // (backward, fused, batch, heads, kv_heads, seq, head_dim)
  std::map<std::tuple<bool, bool, int, int, int, int, int>, Built> built;

  /// The graph of one direction, layout and shape, built on first use.
  const Built& get(bool backward, Shape s, bool fused = true) {
    if (backward && s.seq < 2)
      throw cuda_error(
          "cuda::attention: seq = " + std::to_string(s.seq) +
          " is outside the range the cuDNN frontend's SDPA backward supports ([2, ...)); train with seq >= 2");
    std::lock_guard lk(mu);
    const auto key = std::make_tuple(backward, fused, s.batch, s.heads, kv_heads_of(s), s.seq, s.head_dim);
    auto it = built.find(key);
    if (it == built.end())
      it = built
               .emplace(key,
                        backward ? build_backward(handle, s, fused, deterministic) : build_forward(handle, s, fused))
               .first;
    return it->second;
  }
};

Graphs::Graphs(cudnnHandle_t handle, bool deterministic) : impl_(std::make_unique<Impl>()) {
  impl_->handle = handle;
  impl_->deterministic = deterministic;
}
Graphs::~Graphs() = default;
cudnnHandle_t Graphs::handle() const { return impl_->handle; }
bool Graphs::deterministic() const { return impl_->deterministic; }

std::size_t workspace_bytes(Graphs& graphs, Shape shape, bool separate) {
  const bool fused = !separate && kv_heads_of(shape) == shape.heads;
  const auto f = graphs.impl().get(false, shape, fused).workspace, bw = graphs.impl().get(true, shape, fused).workspace;
  return static_cast<std::size_t>(std::max(f, bw));
}

std::size_t workspace_bytes(Shape shape, bool deterministic, int device) {
  // Restores the caller's device and destroys the handle, however this returns.
  struct Scope {
    int previous = 0;
    cudnnHandle_t handle = nullptr;
    ~Scope() {
      if (handle != nullptr) cudnnDestroy(handle);
      cudaSetDevice(previous);
    }
  } scope;
  PIPEOFFLOAD_CUDA_CHECK(cudaGetDevice(&scope.previous));
  PIPEOFFLOAD_CUDA_CHECK(cudaSetDevice(device));
  PIPEOFFLOAD_CUDA_CHECK(cudnnCreate(&scope.handle));
  Graphs graphs(scope.handle, deterministic);  // destroyed before the scope's handle
  return workspace_bytes(graphs, shape);
}

void forward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* qkv, __nv_bfloat16* out, float* stats,
             void* ws, std::size_t ws_bytes) {
  const SdpaLayout l = sdpa_layout(s.batch, s.heads, s.seq, s.head_dim);
  auto* base = const_cast<__nv_bfloat16*>(qkv);  // the variant pack takes void*; cuDNN only reads inputs
  std::unordered_map<std::int64_t, void*> pack = {
      {Q, base + l.q_offset}, {K, base + l.k_offset}, {V, base + l.v_offset}, {O, out}, {STATS, stats}};
  run(graphs.handle(), stream, graphs.impl().get(false, s), pack, ws, ws_bytes);
}

void backward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* qkv, const __nv_bfloat16* out,
              const __nv_bfloat16* dout, const float* stats, __nv_bfloat16* dqkv, void* ws, std::size_t ws_bytes) {
  const SdpaLayout l = sdpa_layout(s.batch, s.heads, s.seq, s.head_dim);
  auto* base = const_cast<__nv_bfloat16*>(qkv);
  std::unordered_map<std::int64_t, void*> pack = {{Q, base + l.q_offset},
                                                  {K, base + l.k_offset},
                                                  {V, base + l.v_offset},
                                                  {O, const_cast<__nv_bfloat16*>(out)},
                                                  {DO, const_cast<__nv_bfloat16*>(dout)},
                                                  {STATS, const_cast<float*>(stats)},
                                                  {DQ, dqkv + l.q_offset},
                                                  {DK, dqkv + l.k_offset},
                                                  {DV, dqkv + l.v_offset}};
  run(graphs.handle(), stream, graphs.impl().get(true, s), pack, ws, ws_bytes);
}

void forward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* q, const __nv_bfloat16* k,
             const __nv_bfloat16* v, __nv_bfloat16* out, float* stats, void* ws, std::size_t ws_bytes) {
  std::unordered_map<std::int64_t, void*> pack = {{Q, const_cast<__nv_bfloat16*>(q)},
                                                  {K, const_cast<__nv_bfloat16*>(k)},
                                                  {V, const_cast<__nv_bfloat16*>(v)},
                                                  {O, out},
                                                  {STATS, stats}};
  run(graphs.handle(), stream, graphs.impl().get(false, s, false), pack, ws, ws_bytes);
}

void backward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* q, const __nv_bfloat16* k,
              const __nv_bfloat16* v, const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* stats,
              __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, void* ws, std::size_t ws_bytes) {
  std::unordered_map<std::int64_t, void*> pack = {{Q, const_cast<__nv_bfloat16*>(q)},
                                                  {K, const_cast<__nv_bfloat16*>(k)},
                                                  {V, const_cast<__nv_bfloat16*>(v)},
                                                  {O, const_cast<__nv_bfloat16*>(out)},
                                                  {DO, const_cast<__nv_bfloat16*>(dout)},
                                                  {STATS, const_cast<float*>(stats)},
                                                  {DQ, dq},
                                                  {DK, dk},
                                                  {DV, dv}};
  run(graphs.handle(), stream, graphs.impl().get(true, s, false), pack, ws, ws_bytes);
}

}  // namespace pipeoffload::cuda::attention
