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

// Tensor uids of the variant pack; the last seven only in a packed call's.
enum Uid : std::int64_t { Q = 1, K, V, O, STATS, DO, DQ, DK, DV, SEQ_Q, SEQ_KV, Q_OFF, K_OFF, V_OFF, O_OFF, STATS_OFF };

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
/// The graph's per-sequence length: a packed call's Shape::length (0: seq), else seq.
int length_of(Shape s) { return s.documents > 0 && s.length > 0 ? s.length : s.seq; }
/// Whether the call reads one fused qkv tensor: not asked for separate tensors, and as many
/// key/value heads as query heads.
bool fused_of(Shape s, bool separate) { return !separate && kv_heads_of(s) == s.heads; }

/// The layout of a call: Q, K and V in one fused qkv tensor, or in three; packed (ragged, the
/// documents as the batch) when shape.documents > 0.
SdpaLayout layout_of(Shape s, bool fused) {
  if (fused && kv_heads_of(s) != s.heads)
    throw shape_error("cuda::attention: a fused qkv tensor has as many key/value heads as query heads (" +
                      std::to_string(s.heads) + "), not kv_heads = " + std::to_string(s.kv_heads) +
                      "; pass q, k and v separately for grouped-query attention");
  if (s.documents < 0 || (s.documents > 0 && s.documents < s.batch) ||
      static_cast<long long>(s.documents) > static_cast<long long>(s.batch) * s.seq)
    throw shape_error("cuda::attention: documents = " + std::to_string(s.documents) + " is outside 0 (unpacked) or [" +
                      std::to_string(s.batch) + ", " + std::to_string(static_cast<long long>(s.batch) * s.seq) +
                      "] (at least one a row, at most one a token) for batch = " + std::to_string(s.batch) +
                      ", seq = " + std::to_string(s.seq));
  if (s.documents > 0 && (s.length < 0 || s.length > s.seq))
    throw shape_error("cuda::attention: length = " + std::to_string(s.length) +
                      " is outside [0, seq = " + std::to_string(s.seq) + "] (a packed call's graph length; 0: seq)");
  const int b = s.documents > 0 ? s.documents : s.batch;
  const int S = length_of(s);
  const SdpaLayout l =
      fused ? sdpa_layout(b, s.heads, S, s.head_dim) : sdpa_layout_separate(b, s.heads, kv_heads_of(s), S, s.head_dim);
  return s.documents > 0 ? ragged(l) : l;
}

/// A packed call's extra tensors: each document's length (for queries and keys alike) and
/// the ragged offsets of Q, K, V, O and the statistics (int64, documents + 1).
struct Packed {
  std::shared_ptr<fe::graph::Tensor_attributes> seq_q, seq_kv, q, k, v, o, stats;
};
Packed packed_tensors(fe::graph::Graph& g, Shape s) {
  const std::int64_t n = s.documents;
  const auto lengths = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  };
  const auto offsets = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n + 1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT64));
  };
  return {lengths("seq_q", SEQ_Q),
          lengths("seq_kv", SEQ_KV),
          offsets("q_offsets", Q_OFF),
          offsets("k_offsets", K_OFF),
          offsets("v_offsets", V_OFF),
          offsets("o_offsets", O_OFF),
          offsets("stats_offsets", STATS_OFF)};
}

/// Tokens of a call (its rows' and the packed tensors' extent).
std::int64_t tokens_of(Shape s) { return static_cast<std::int64_t>(s.batch) * s.seq; }

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

/// A packed call's inputs ragged and its attributes (forward or backward) masked to each
/// document's length, the packed tensors' extent the call's tokens.
template <class Attributes>
Packed make_packed(fe::graph::Graph& g, Shape s, Attributes& opts, const TensorPtr& q, const TensorPtr& k,
                   const TensorPtr& v) {
  Packed p = packed_tensors(g, s);
  q->set_ragged_offset(p.q);
  k->set_ragged_offset(p.k);
  v->set_ragged_offset(p.v);
  opts.set_padding_mask(true)
      .set_seq_len_q(p.seq_q)
      .set_seq_len_kv(p.seq_kv)
      .set_max_total_seq_len_q(tokens_of(s))
      .set_max_total_seq_len_kv(tokens_of(s));
  return p;
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
                  .set_diagonal_band_right_bound(0);  // causal: key j <= query i (of its document)
  const Packed p = s.documents > 0 ? make_packed(g, s, opts, q, k, v) : Packed{};
  auto [o, stats] = g.sdpa(q, k, v, opts);
  o->set_output(true).set_uid(O).set_dim(vec(l.dims)).set_stride(vec(l.out_strides));
  stats->set_output(true)
      .set_uid(STATS)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(vec(l.stats_dims))
      .set_stride(vec(l.stats_strides));
  if (s.documents > 0) {
    o->set_ragged_offset(p.o);
    stats->set_ragged_offset(p.stats);
  }
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
  const Packed p = s.documents > 0 ? make_packed(g, s, opts, q, k, v) : Packed{};
  if (s.documents > 0) {
    o->set_ragged_offset(p.o);
    dout->set_ragged_offset(p.o);
    stats->set_ragged_offset(p.stats);
  }
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
  dq->set_output(true).set_uid(DQ).set_dim(vec(l.dims)).set_stride(vec(l.q_strides));
  dk->set_output(true).set_uid(DK).set_dim(vec(l.kv_dims)).set_stride(vec(l.kv_strides));
  dv->set_output(true).set_uid(DV).set_dim(vec(l.kv_dims)).set_stride(vec(l.kv_strides));
  if (s.documents > 0) {
    dq->set_ragged_offset(p.q);
    dk->set_ragged_offset(p.k);
    dv->set_ragged_offset(p.v);
  }
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

/// A packed call's table into its variant pack, checked to be there; an unpacked call takes none.
void add_documents(std::unordered_map<std::int64_t, void*>& pack, Shape s, Documents d) {
  const bool given = d.lengths != nullptr || d.q_offsets != nullptr || d.kv_offsets != nullptr ||
                     d.out_offsets != nullptr || d.stats_offsets != nullptr;
  if (s.documents == 0) {
    if (given)
      throw shape_error("cuda::attention: a documents table was given for an unpacked call (shape.documents = 0)");
    return;
  }
  if (d.lengths == nullptr || d.q_offsets == nullptr || d.kv_offsets == nullptr || d.out_offsets == nullptr ||
      d.stats_offsets == nullptr)
    throw shape_error("cuda::attention: a packed call (shape.documents = " + std::to_string(s.documents) +
                      ") needs every array of its Documents table (ops::document_table writes them)");
  const auto at = [](const void* p) { return const_cast<void*>(p); };  // cuDNN only reads them
  pack[SEQ_Q] = pack[SEQ_KV] = at(d.lengths);
  pack[Q_OFF] = at(d.q_offsets);
  pack[K_OFF] = pack[V_OFF] = at(d.kv_offsets);
  pack[O_OFF] = at(d.out_offsets);
  pack[STATS_OFF] = at(d.stats_offsets);
}

}  // namespace

struct Graphs::Impl {
  cudnnHandle_t handle = nullptr;
  bool deterministic = true;
  std::mutex mu;
  // (backward, fused, batch, heads, kv_heads, seq, head_dim, documents, length)
  std::map<std::tuple<bool, bool, int, int, int, int, int, int, int>, Built> built;

  /// The graph of one direction, layout and shape, built on first use.
  const Built& get(bool backward, Shape s, bool fused = true) {
    if (backward && s.seq < 2)
      throw cuda_error(
          "cuda::attention: seq = " + std::to_string(s.seq) +
          " is outside the range the cuDNN frontend's SDPA backward supports ([2, ...)); train with seq >= 2");
    std::lock_guard lk(mu);
    const auto key = std::make_tuple(backward, fused, s.batch, s.heads, kv_heads_of(s), s.seq, s.head_dim, s.documents,
                                     length_of(s));
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

namespace {
/// Workspace the forward graph of `shape` needs, and with `backward` the larger of it and the
/// backward graph's (building both).
std::size_t need_of(Graphs& graphs, Shape shape, bool separate, bool backward) {
  const bool fused = fused_of(shape, separate);
  const auto f = graphs.impl().get(false, shape, fused).workspace;
  return static_cast<std::size_t>(backward ? std::max(f, graphs.impl().get(true, shape, fused).workspace) : f);
}
}  // namespace

std::size_t workspace_bytes(Graphs& graphs, Shape shape, bool separate) {
  return need_of(graphs, shape, separate, true);
}

void require_workspace(Graphs& graphs, Shape shape, bool separate, std::size_t limit, const std::string& who,
                       bool backward) {
  const std::size_t need = need_of(graphs, shape, separate, backward);
  if (need <= limit) return;
  throw cuda_error(
      who + ": cuDNN's attention needs a workspace of " + std::to_string(need) + " bytes for microbatches of " +
      std::to_string(shape.batch) + " x " + std::to_string(shape.seq) + " tokens" +
      (shape.documents > 0 ? " in " + std::to_string(shape.documents) + " packed documents (graph length " +
                                 std::to_string(length_of(shape)) + ")"
                           : "") +
      "; backend::Cuda::Options::workspace_bytes = " + std::to_string(limit) + " is below it");
}

std::size_t workspace_bytes(Shape shape, bool deterministic, int device, bool separate) {
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
  return workspace_bytes(graphs, shape, separate);
}

void forward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* qkv, __nv_bfloat16* out, float* stats,
             void* ws, std::size_t ws_bytes, Documents docs) {
  const SdpaLayout l = sdpa_layout(s.batch, s.heads, s.seq, s.head_dim);
  auto* base = const_cast<__nv_bfloat16*>(qkv);  // the variant pack takes void*; cuDNN only reads inputs
  std::unordered_map<std::int64_t, void*> pack = {
      {Q, base + l.q_offset}, {K, base + l.k_offset}, {V, base + l.v_offset}, {O, out}, {STATS, stats}};
  add_documents(pack, s, docs);
  run(graphs.handle(), stream, graphs.impl().get(false, s), pack, ws, ws_bytes);
}

void backward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* qkv, const __nv_bfloat16* out,
              const __nv_bfloat16* dout, const float* stats, __nv_bfloat16* dqkv, void* ws, std::size_t ws_bytes,
              Documents docs) {
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
  add_documents(pack, s, docs);
  run(graphs.handle(), stream, graphs.impl().get(true, s), pack, ws, ws_bytes);
}

void forward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* q, const __nv_bfloat16* k,
             const __nv_bfloat16* v, __nv_bfloat16* out, float* stats, void* ws, std::size_t ws_bytes, Documents docs) {
  std::unordered_map<std::int64_t, void*> pack = {{Q, const_cast<__nv_bfloat16*>(q)},
                                                  {K, const_cast<__nv_bfloat16*>(k)},
                                                  {V, const_cast<__nv_bfloat16*>(v)},
                                                  {O, out},
                                                  {STATS, stats}};
  add_documents(pack, s, docs);
  run(graphs.handle(), stream, graphs.impl().get(false, s, false), pack, ws, ws_bytes);
}

void backward(Graphs& graphs, cudaStream_t stream, Shape s, const __nv_bfloat16* q, const __nv_bfloat16* k,
              const __nv_bfloat16* v, const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* stats,
              __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, void* ws, std::size_t ws_bytes, Documents docs) {
  std::unordered_map<std::int64_t, void*> pack = {{Q, const_cast<__nv_bfloat16*>(q)},
                                                  {K, const_cast<__nv_bfloat16*>(k)},
                                                  {V, const_cast<__nv_bfloat16*>(v)},
                                                  {O, const_cast<__nv_bfloat16*>(out)},
                                                  {DO, const_cast<__nv_bfloat16*>(dout)},
                                                  {STATS, const_cast<float*>(stats)},
                                                  {DQ, dq},
                                                  {DK, dk},
                                                  {DV, dv}};
  add_documents(pack, s, docs);
  run(graphs.handle(), stream, graphs.impl().get(true, s, false), pack, ws, ws_bytes);
}

}  // namespace pipeoffload::cuda::attention
