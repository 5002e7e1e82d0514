// tests/cuda/test_ops_gpu.cpp: every op of pipeoffload/ops/cuda.hpp against its CPU twin
// (ops/cpu.hpp) on the same bf16-valued inputs (needs a GPU; gpu_main.cpp exits 77 without one).
// Tolerances, from what differs: element-wise ops compute the twin's fp32 expression and round
// once to bf16 (2^-8 relative, bf16_rel with margin); row reductions sum the same fp32 terms in
// another order before that rounding (1e-5 relative on the statistics); a backward that reads a
// bf16-rounded forward output or accumulates into bf16 adds one more rounding (2 bf16_rel);
// the embeddings' gradients add the same fp32 terms in the same order (bit-identical); cuDNN's
// attention rounds its probabilities and their gradients to bf16 inside its GEMMs, sums of up
// to seq terms of either sign, so it is held to 2 % of the largest value of each output (an
// error in a head, a mask or a group shows as O(1) of it).
#include <doctest/doctest.h>

#include <cudnn.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <pipeoffload/backend/cuda/attention.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>
#include <pipeoffload/ops/cpu.hpp>
#include <pipeoffload/ops/cuda.hpp>

#include "gpu_test.hpp"

namespace po = pipeoffload;
namespace ops = pipeoffload::ops;
using bf16 = __nv_bfloat16;

namespace {

const po::backend::CpuContext cpu{};

/// A stream and a CudaContext on it (no backend: the ops need only the stream, and attention
/// its cuDNN graphs and workspace, made on first use).
struct Ops : Gpu {
  po::backend::CudaContext ctx{};
  cudnnHandle_t dnn = nullptr;
  std::unique_ptr<po::cuda::attention::Graphs> graphs;
  Ops() { ctx.cuda_stream = s; }
  ~Ops() {
    cudaStreamSynchronize(s);
    graphs.reset();
    if (dnn != nullptr) cudnnDestroy(dnn);
  }
  void attention(po::cuda::attention::Shape shape) {
    PIPEOFFLOAD_CUDA_CHECK(cudnnCreate(&dnn));
    graphs = std::make_unique<po::cuda::attention::Graphs>(dnn);
    ctx.dnn = dnn;
    ctx.attention = graphs.get();
    ctx.workspace_bytes = po::cuda::attention::workspace_bytes(*graphs, shape);
    ctx.workspace = alloc<std::byte>(ctx.workspace_bytes);
  }
};

/// max |got - want| <= frac * max |want|: for outputs whose error scales with the largest term.
void check_norm(const std::vector<float>& got, const std::vector<float>& want, double frac) {
  REQUIRE(got.size() == want.size());
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
    largest = std::max(largest, static_cast<double>(std::abs(want[i])));
  }
  CHECK(largest > 0);
  CHECK(worst <= frac * largest);
}

std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

}  // namespace

TEST_CASE("ops on the GPU: LayerNorm and RMSNorm forward, recompute, backward and weight gradients match the CPU") {
  Ops g;
  for (const auto& [rows, n] : {std::pair{37, 1000}, std::pair{5, 33}}) {
    CAPTURE(rows);
    CAPTURE(n);
    const std::size_t N = static_cast<std::size_t>(rows) * n;
    const std::vector<float> x = random_bf16(N, 3, 3.0f), dy = random_bf16(N, 4), w = random_bf16(n, 5),
                             b = random_bf16(n, 6), base = random_bf16(N, 7);
    bf16 *dx_in = g.bf16(x), *ddy = g.bf16(dy), *dw = g.bf16(w), *db = g.bf16(b), *y = g.alloc<bf16>(N),
         *y2 = g.alloc<bf16>(N), *dx = g.bf16(base);
    float *stats = g.alloc<float>(2 * rows), *dgam = g.copy(std::vector<float>(n, 0.5f)),
          *dbet = g.copy(std::vector<float>(n, 0.25f));
    std::vector<float> cy(N), cstats(2 * rows), cdx = base, cdg(n, 0.5f), cdb(n, 0.25f);
    // LayerNorm, backward accumulating into dx (the residual branch's use).
    ops::layernorm_forward(g.ctx, dx_in, dw, db, y, stats, rows, n);
    ops::layernorm_recompute(g.ctx, dx_in, stats, dw, db, y2, rows, n);
    ops::layernorm_backward(g.ctx, ddy, dx_in, stats, dw, dx, rows, n, true);
    ops::layernorm_weight_grad(g.ctx, ddy, dx_in, stats, dgam, dbet, rows, n);
    ops::layernorm_forward(cpu, x.data(), w.data(), b.data(), cy.data(), cstats.data(), rows, n);
    ops::layernorm_backward(cpu, dy.data(), x.data(), cstats.data(), w.data(), cdx.data(), rows, n, true);
    ops::layernorm_weight_grad(cpu, dy.data(), x.data(), cstats.data(), cdg.data(), cdb.data(), rows, n);
    check_close(g.get(stats, 2 * rows), cstats, 1e-5f, 1e-5f);
    check_close(g.get(y, N), cy, bf16_rel, 1e-3f);
    check_close(g.get(y2, N), g.get(y, N), bf16_rel, 1e-3f);  // per element instead of per row: contraction may differ
    check_close(g.get(dx, N), cdx, 2 * bf16_rel, 2e-3f);
    check_close(g.get(dgam, n), cdg, 1e-4f, 1e-3f);
    check_close(g.get(dbet, n), cdb, 1e-4f, 1e-3f);
    // RMSNorm, backward overwriting dx.
    float *rstd = g.alloc<float>(rows), *dww = g.copy(std::vector<float>(n, 0.0f));
    std::vector<float> crstd(rows), cdw(n, 0.0f);
    ops::rmsnorm_forward(g.ctx, dx_in, dw, y, rstd, rows, n, 1e-6f);
    ops::rmsnorm_recompute(g.ctx, dx_in, rstd, dw, y2, rows, n);
    ops::rmsnorm_backward(g.ctx, ddy, dx_in, rstd, dw, dx, rows, n, false);
    ops::rmsnorm_weight_grad(g.ctx, ddy, dx_in, rstd, dww, rows, n);
    ops::rmsnorm_forward(cpu, x.data(), w.data(), cy.data(), crstd.data(), rows, n, 1e-6f);
    ops::rmsnorm_backward(cpu, dy.data(), x.data(), crstd.data(), w.data(), cdx.data(), rows, n, false);
    ops::rmsnorm_weight_grad(cpu, dy.data(), x.data(), crstd.data(), cdw.data(), rows, n);
    check_close(g.get(rstd, rows), crstd, 1e-5f, 0.0f);
    check_close(g.get(y, N), cy, bf16_rel, 1e-3f);
    check_close(g.get(y2, N), g.get(y, N), bf16_rel, 1e-3f);
    check_close(g.get(dx, N), cdx, 2 * bf16_rel, 2e-3f);
    check_close(g.get(dww, n), cdw, 1e-4f, 1e-3f);
  }
}

TEST_CASE("ops on the GPU: RoPE and its inverse match the CPU; a position outside the table writes NaN") {
  Ops g;
  const int rows = 6, head_dim = 8, width = 3 * head_dim;
  const ops::RopeTable table(16, head_dim, 10000.0f);
  const std::vector<std::int32_t> pos = {0, 1, 2, 0, 15, 7};  // a document restarting at row 3
  const std::vector<float> x = random_bf16(static_cast<std::size_t>(rows) * width, 8);
  float *dcos = g.copy(table.cos), *dsin = g.copy(table.sin);
  const ops::RopeView dev{table.positions, table.head_dim, dcos, dsin};
  bf16* dx = g.bf16(x);
  std::int32_t* dpos = g.copy(pos);
  std::vector<float> cx = x;
  ops::rope(g.ctx, dx, dpos, rows, width, dev, false);
  ops::rope(cpu, cx.data(), pos.data(), rows, width, table, false);
  check_close(g.get(dx, x.size()), cx, bf16_rel, 1e-6f);
  ops::rope(g.ctx, dx, dpos, rows, width, dev, true);
  check_close(g.get(dx, x.size()), x, 2 * bf16_rel, 1e-2f);  // back, through two bf16 roundings
  const std::vector<std::int32_t> bad = {0, 16, 0, 0, 0, 0};
  ops::rope(g.ctx, dx, g.copy(bad), rows, width, dev, false);
  const std::vector<float> got = g.get(dx, x.size());
  for (int i = 0; i < width; ++i) CHECK(std::isnan(got[static_cast<std::size_t>(width + i)]));
  CHECK(!std::isnan(got[0]));
}

TEST_CASE("ops on the GPU: GeLU, SwiGLU, residual, dropout and bias ops match the CPU") {
  Ops g;
  const std::size_t n = 100003;
  const std::vector<float> x = random_bf16(n, 1, 2.0f), y = random_bf16(n, 2), z = random_bf16(n, 9, 3.0f);
  bf16 *dx = g.bf16(x), *dy = g.bf16(y), *dz = g.bf16(z), *out = g.alloc<bf16>(n), *out2 = g.alloc<bf16>(n);
  std::vector<float> want(n), want2(n);
  ops::gelu_forward(g.ctx, dx, out, n);
  ops::gelu_forward(cpu, x.data(), want.data(), n);
  check_close(g.get(out, n), want, bf16_rel, 1e-6f);
  bf16* gr = g.bf16(y);
  want = y;
  ops::gelu_backward(g.ctx, dx, gr, n);
  ops::gelu_backward(cpu, x.data(), want.data(), n);
  check_close(g.get(gr, n), want, bf16_rel, 1e-6f);
  ops::swiglu_forward(g.ctx, dz, dy, out, n);
  ops::swiglu_forward(cpu, z.data(), y.data(), want.data(), n);
  check_close(g.get(out, n), want, bf16_rel, 1e-6f);
  ops::swiglu_backward(g.ctx, dx, dz, dy, out, out2, n);
  ops::swiglu_backward(cpu, x.data(), z.data(), y.data(), want.data(), want2.data(), n);
  check_close(g.get(out, n), want, bf16_rel, 1e-6f);
  check_close(g.get(out2, n), want2, bf16_rel, 1e-6f);
  ops::add(g.ctx, dx, dy, out, n);
  ops::add(cpu, x.data(), y.data(), want.data(), n);
  check_close(g.get(out, n), want, bf16_rel, 0.0f);
  const ops::DropoutSeed seed{3, 1, nullptr, 2, 0, 4};
  ops::residual_dropout(g.ctx, dx, dy, out, n, seed, 0.1f);
  ops::residual_dropout(cpu, x.data(), y.data(), want.data(), n, seed, 0.1f);
  check_close(g.get(out, n), want, bf16_rel, 1e-6f);
  ops::dropout_backward(g.ctx, dy, out, n, seed, 0.1f);
  ops::dropout_backward(cpu, y.data(), want.data(), n, seed, 0.1f);
  const std::vector<float> got = g.get(out, n);
  check_close(got, want, bf16_rel, 0.0f);
  for (std::size_t i = 0; i < n; ++i) CHECK((got[i] == 0.0f) == (want[i] == 0.0f));  // the very same mask
  std::uint8_t* mask = g.alloc<std::uint8_t>(n);
  std::vector<std::uint8_t> cmask(n);
  ops::residual_dropout_mask(g.ctx, dx, dy, out2, mask, n, seed, 0.1f);
  ops::residual_dropout_mask(cpu, x.data(), y.data(), want.data(), cmask.data(), n, seed, 0.1f);
  CHECK(g.get(mask, n) == cmask);
  check_close(g.get(out2, n), want, bf16_rel, 1e-6f);
  ops::dropout_backward_mask(g.ctx, dy, mask, out2, n, 0.1f);
  check_close(g.get(out2, n), got, 0.0f, 0.0f);  // one product with the same factor: exact
  // The step read from device memory (a pass captured in a CUDA graph): the kernel's mask is
  // the one of the step stored there, not of the host field.
  const std::int32_t* step_word = g.copy(std::vector<std::int32_t>{1});
  ops::dropout_backward(g.ctx, dy, out2, n, ops::DropoutSeed{3, 99, step_word, 2, 0, 4}, 0.1f);
  check_close(g.get(out2, n), got, 0.0f, 0.0f);
  // Biases: a bf16 and an fp32 row vector added, and the column sums of a gradient.
  const int rows = 333, cols = 1000;
  const std::vector<float> m = random_bf16(static_cast<std::size_t>(rows) * cols, 21), b = random_bf16(cols, 22);
  bf16* mb = g.bf16(m);
  float *mf = g.copy(m), *bf = g.copy(b), *db = g.copy(std::vector<float>(cols, 0.5f));
  std::vector<float> cm = m, cdb(cols, 0.5f);
  ops::add_bias(g.ctx, mb, g.bf16(b), rows, cols);
  ops::add_bias(g.ctx, mf, bf, rows, cols);
  ops::add_bias(cpu, cm.data(), b.data(), rows, cols);
  check_close(g.get(mb, m.size()), cm, bf16_rel, 0.0f);
  check_close(g.get(mf, m.size()), cm, 0.0f, 0.0f);  // one fp32 addition, as the CPU does
  ops::bias_grad(g.ctx, g.bf16(m), db, rows, cols);
  ops::bias_grad(cpu, m.data(), cdb.data(), rows, cols);
  check_close(g.get(db, cols), cdb, 1e-4f, 1e-3f);  // the same fp32 terms in another fixed order
}

TEST_CASE("ops on the GPU: token and position embeddings and their gradients give the CPU's bits") {
  Ops g;
  const int seq = 5, n = 40, vocab = 11, rows = 10;
  const std::vector<std::int32_t> ids = {1, 3, 3, 0, 10, 2, 2, 9, 1, 1};
  const std::vector<float> table = random_bf16(static_cast<std::size_t>(vocab) * n, 10),
                           pos = random_bf16(static_cast<std::size_t>(seq) * n, 11),
                           d = random_bf16(static_cast<std::size_t>(rows) * n, 12);
  std::int32_t* dids = g.copy(ids);
  bf16* out = g.alloc<bf16>(static_cast<std::size_t>(rows) * n);
  std::vector<float> cout(static_cast<std::size_t>(rows) * n);
  ops::embedding_forward(g.ctx, dids, g.bf16(table), out, rows, n, vocab);
  ops::position_embedding_forward(g.ctx, g.bf16(pos), out, rows, n, seq);
  ops::embedding_forward(cpu, ids.data(), table.data(), cout.data(), rows, n, vocab);
  ops::position_embedding_forward(cpu, pos.data(), cout.data(), rows, n, seq);
  CHECK(g.get(out, cout.size()) == rounded(cout));  // one addition of two bf16 values, rounded once
  float *dt = g.copy(std::vector<float>(table.size(), 0.25f)), *dp = g.copy(std::vector<float>(pos.size(), 0.0f));
  std::vector<float> cdt(table.size(), 0.25f), cdp(pos.size(), 0.0f);
  bf16* dd = g.bf16(d);
  ops::embedding_backward(g.ctx, dids, dd, dt, rows, n, vocab);
  ops::position_embedding_backward(g.ctx, dd, dp, rows, n, seq);
  ops::embedding_backward(cpu, ids.data(), d.data(), cdt.data(), rows, n, vocab);
  ops::position_embedding_backward(cpu, d.data(), cdp.data(), rows, n, seq);
  CHECK(g.get(dt, cdt.size()) == cdt);  // the same fp32 sums in the same order
  CHECK(g.get(dp, cdp.size()) == cdp);
  // Positions given row by row (packed rows restart them at each document).
  const std::vector<std::int32_t> positions = {0, 1, 2, 0, 1, 2, 3, 4, 0, 1};
  ops::embedding_forward(g.ctx, dids, g.bf16(table), out, rows, n, vocab);
  ops::position_embedding_forward(g.ctx, g.bf16(pos), g.copy(positions), out, rows, n, seq);
  ops::embedding_forward(cpu, ids.data(), table.data(), cout.data(), rows, n, vocab);
  ops::position_embedding_forward(cpu, pos.data(), positions.data(), cout.data(), rows, n, seq);
  CHECK(g.get(out, cout.size()) == rounded(cout));
  ops::position_embedding_forward(g.ctx, g.bf16(pos), g.copy(std::vector<std::int32_t>{seq}), out, 1, n, seq);
  CHECK(std::isnan(g.get(out, 1)[0]));
  // An id outside the table: a NaN row on the GPU (the CPU twin throws).
  ops::embedding_forward(g.ctx, g.copy(std::vector<std::int32_t>{11}), g.bf16(table), out, 1, n, vocab);
  CHECK(std::isnan(g.get(out, 1)[0]));
}

TEST_CASE("ops on the GPU: cross-entropy from fp32 and from bf16 logits, and the mean, match the CPU") {
  Ops g;
  const int rows = 19, V = 50257;
  const std::vector<float> logits = random_bf16(static_cast<std::size_t>(rows) * V, 7, 2.0f);
  std::vector<std::int32_t> targets(rows);
  for (int r = 0; r < rows; ++r) targets[static_cast<std::size_t>(r)] = (r * 7919) % V;
  std::int32_t* dt = g.copy(targets);
  std::vector<float> cd(logits.size()), cl(rows);
  ops::cross_entropy(cpu, logits.data(), targets.data(), cl.data(), cd.data(), rows, V, 0.5f);
  float mean_cpu = 0;
  ops::mean(cpu, cl.data(), &mean_cpu, rows);
  float *dl = g.copy(logits), *losses = g.alloc<float>(rows), *mean = g.alloc<float>(1);
  ops::cross_entropy(g.ctx, dl, dt, losses, dl, rows, V, 0.5f);  // in place, as a head does
  ops::mean(g.ctx, losses, mean, rows);
  check_close(g.get(losses, rows), cl, 1e-5f, 1e-5f);
  check_close(g.get(dl, logits.size()), cd, 1e-4f, 1e-8f);
  CHECK(g.get(mean, 1)[0] == doctest::Approx(mean_cpu).epsilon(1e-5));
  bf16* bl = g.bf16(logits);
  ops::cross_entropy(g.ctx, bl, dt, losses, bl, rows, V, 0.5f);
  check_close(g.get(losses, rows), cl, 1e-5f, 1e-5f);  // the same fp32 arithmetic on the same values
  check_close(g.get(bl, logits.size()), cd, bf16_rel, 1e-8f);
}

TEST_CASE("ops on the GPU: grouped-query attention through cuDNN matches the CPU twin, forward and backward") {
  Ops g;
  const ops::AttentionShape s{.batch = 2, .seq = 128, .heads = 8, .kv_heads = 2, .head_dim = 64};
  g.attention({s.batch, s.heads, s.seq, s.head_dim, s.kv_heads});
  const std::size_t T = static_cast<std::size_t>(s.batch) * s.seq, H = static_cast<std::size_t>(s.heads) * s.head_dim,
                    K = static_cast<std::size_t>(s.kv_heads) * s.head_dim,
                    L = static_cast<std::size_t>(s.batch) * s.heads * s.seq;
  const std::vector<float> q = random_bf16(T * H, 13), k = random_bf16(T * K, 14), v = random_bf16(T * K, 15),
                           dout = random_bf16(T * H, 16);
  bf16 *dq_in = g.bf16(q), *dk_in = g.bf16(k), *dv_in = g.bf16(v), *ddout = g.bf16(dout), *out = g.alloc<bf16>(T * H),
       *dq = g.alloc<bf16>(T * H), *dk = g.alloc<bf16>(T * K), *dv = g.alloc<bf16>(T * K);
  float* lse = g.alloc<float>(L);
  ops::attention_forward(g.ctx, dq_in, dk_in, dv_in, out, lse, s);
  ops::attention_backward(g.ctx, dq_in, dk_in, dv_in, out, ddout, lse, dq, dk, dv, s);
  std::vector<float> cout(T * H), clse(L), cdq(T * H), cdk(T * K), cdv(T * K);
  ops::attention_forward(cpu, q.data(), k.data(), v.data(), cout.data(), clse.data(), s);
  // The CPU backward reads the GPU's bf16 output, as the GPU's does (its D = rowsum(dout o)).
  const std::vector<float> gout = g.get(out, T * H);
  ops::attention_backward(cpu, q.data(), k.data(), v.data(), gout.data(), dout.data(), clse.data(), cdq.data(),
                          cdk.data(), cdv.data(), s);
  check_norm(gout, cout, 0.02);
  check_close(g.get(lse, L), clse, 1e-3f, 1e-3f);
  check_norm(g.get(dq, T * H), cdq, 0.02);
  check_norm(g.get(dk, T * K), cdk, 0.02);
  check_norm(g.get(dv, T * K), cdv, 0.02);
}

namespace {

/// Two rows of 128 tokens whose documents start at `first` and `second`: the table and positions
/// computed on the GPU from the device offsets, checked exactly against the host's documents
/// (and the table's padding up to `slots` entries: empty documents at the end); the attention
/// within each document against the CPU twin's `docs` overload, at the tolerances of the
/// unpacked case above.
void packed_attention_case(std::vector<std::int32_t> first, std::vector<std::int32_t> second, std::size_t count,
                           int slots) {
  Ops g;
  const ops::AttentionShape s{.batch = 2, .seq = 128, .heads = 8, .kv_heads = 2, .head_dim = 64};
  std::vector<std::int32_t> offsets = std::move(first);
  offsets.resize(129, 128);
  second.resize(129, 128);
  offsets.insert(offsets.end(), second.begin(), second.end());
  std::vector<po::Document> docs;
  std::vector<std::int32_t> positions;
  po::microbatch_documents(offsets.data(), 2, s.seq, docs, positions);
  REQUIRE(docs.size() == count);
  REQUIRE(po::cuda::document_slots(static_cast<long long>(count), 256) == slots);
  g.attention({s.batch, s.heads, s.seq, s.head_dim, s.kv_heads, slots});
  const std::size_t T = static_cast<std::size_t>(s.batch) * s.seq, H = static_cast<std::size_t>(s.heads) * s.head_dim,
                    K = static_cast<std::size_t>(s.kv_heads) * s.head_dim, A = static_cast<std::size_t>(s.heads);
  const std::int32_t* doffsets = g.copy(offsets);
  std::int32_t* dpositions = g.alloc<std::int32_t>(T);
  auto* table = g.alloc<std::byte>(po::cuda::document_table_bytes(static_cast<long long>(T)));
  ops::document_positions(g.ctx, doffsets, dpositions, static_cast<long long>(T), s.seq);
  const ops::DeviceDocuments dd = ops::document_table(g.ctx, doffsets, s.batch, s.seq, static_cast<int>(count),
                                                      po::longest_document(docs), s, {}, table);
  CHECK(dd.length == 128);  // the longest document has 65 to 128 tokens: the next power of two
  CHECK(dd.count == slots);
  const std::size_t n_slots = static_cast<std::size_t>(slots);
  std::vector<std::int32_t> got_positions(T), lengths(n_slots);
  std::vector<std::int64_t> qo(n_slots + 1), kvo(n_slots + 1), oo(n_slots + 1), so(n_slots + 1);
  PIPEOFFLOAD_CUDA_CHECK(cudaStreamSynchronize(g.s));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(got_positions.data(), dpositions, T * 4, cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(lengths.data(), dd.table.lengths, lengths.size() * 4, cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(qo.data(), dd.table.q_offsets, qo.size() * 8, cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(kvo.data(), dd.table.kv_offsets, kvo.size() * 8, cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(oo.data(), dd.table.out_offsets, oo.size() * 8, cudaMemcpyDeviceToHost));
  PIPEOFFLOAD_CUDA_CHECK(cudaMemcpy(so.data(), dd.table.stats_offsets, so.size() * 8, cudaMemcpyDeviceToHost));
  CHECK(got_positions == positions);
  for (std::size_t n = 0; n <= n_slots; ++n) {
    const long long start =
        n < docs.size() ? static_cast<long long>(docs[n].row * 128 + docs[n].begin) : static_cast<long long>(T);
    if (n < n_slots) CHECK(lengths[n] == (n < docs.size() ? static_cast<std::int32_t>(docs[n].length) : 0));
    CHECK(qo[n] == start * static_cast<long long>(H));
    CHECK(kvo[n] == start * static_cast<long long>(K));
    CHECK(oo[n] == start * static_cast<long long>(H));
    CHECK(so[n] == start * static_cast<long long>(A));
  }
  const std::vector<float> q = random_bf16(T * H, 23), k = random_bf16(T * K, 24), v = random_bf16(T * K, 25),
                           dout = random_bf16(T * H, 26);
  bf16 *dq_in = g.bf16(q), *dk_in = g.bf16(k), *dv_in = g.bf16(v), *ddout = g.bf16(dout), *out = g.alloc<bf16>(T * H),
       *dq = g.alloc<bf16>(T * H), *dk = g.alloc<bf16>(T * K), *dv = g.alloc<bf16>(T * K);
  float* lse = g.alloc<float>(T * A);
  ops::attention_forward(g.ctx, dq_in, dk_in, dv_in, out, lse, s, dd);
  ops::attention_backward(g.ctx, dq_in, dk_in, dv_in, out, ddout, lse, dq, dk, dv, s, dd);
  std::vector<float> cout(T * H), clse(T * A), cdq(T * H), cdk(T * K), cdv(T * K);
  ops::attention_forward(cpu, q.data(), k.data(), v.data(), cout.data(), clse.data(), s, docs);
  const std::vector<float> gout = g.get(out, T * H);
  ops::attention_backward(cpu, q.data(), k.data(), v.data(), gout.data(), dout.data(), clse.data(), cdq.data(),
                          cdk.data(), cdv.data(), s, docs);
  check_norm(gout, cout, 0.02);
  // The GPU's statistics are token-major (tokens, heads); the CPU's (batch, heads, seq).
  const std::vector<float> glse = g.get(lse, T * A);
  std::vector<float> glse_bhs(T * A);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t a = 0; a < A; ++a) glse_bhs[(t / 128) * A * 128 + a * 128 + t % 128] = glse[t * A + a];
  check_close(glse_bhs, clse, 1e-3f, 1e-3f);
  check_norm(g.get(dq, T * H), cdq, 0.02);
  check_norm(g.get(dk, T * K), cdk, 0.02);
  check_norm(g.get(dv, T * K), cdv, 0.02);
}

}  // namespace

TEST_CASE(
    "ops on the GPU: attention over packed rows (cuDNN's ragged layout) matches the CPU twin document by document") {
  // Documents of 17, 43, 1 and 67 tokens, and of 100 and 28: six, a graph of six.
  packed_attention_case({0, 17, 60, 61}, {0, 100}, 6, 6);
  // Eleven documents (8 and 3 a row, one of a single token, the longest 98 tokens): the table
  // padded to 12 with one empty document at the end, which cuDNN must pass over.
  packed_attention_case({0, 10, 20, 30, 45, 60, 61, 90}, {0, 10, 30}, 11, 12);
}
