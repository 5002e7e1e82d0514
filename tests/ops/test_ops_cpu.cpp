// tests/ops/test_ops_cpu.cpp: po::ops on the CPU (pipeoffload/ops/cpu.hpp). Each op with a
// backward against central differences of a float64 implementation of its forward written
// here (the analytic gradient in fp32 within 1e-4 of the largest, far above fp32 rounding of
// sums of 64 terms and far below an error in a term); RoPE as a rotation (its inverse undoes
// it, it keeps inner products, position 0 is the identity); the embedding's gradient the rows'
// sum in row order; bad ids and positions refused with their value and range; the GEMM
// attention (documents, strides, head groups) against its plain twin, ops::reference, on seeded
// random shapes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <pipeoffload/ops/cpu.hpp>

namespace {

namespace ops = pipeoffload::ops;
const pipeoffload::backend::CpuContext ctx{};

std::vector<float> noise(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(scale * (static_cast<double>(ops::mix64(seed, i) >> 11) / 9007199254740992.0 - 0.5));
  return v;
}

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// d/dx_i of a float64 objective at x, by central differences (step 1e-5), for every i.
std::vector<double> numeric_grad(const std::vector<float>& x,
                                 const std::function<double(const std::vector<double>&)>& f) {
  std::vector<double> xd(x.begin(), x.end()), g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double h = 1e-5, keep = xd[i];
    xd[i] = keep + h;
    const double up = f(xd);
    xd[i] = keep - h;
    const double down = f(xd);
    xd[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

/// max |a - b| / max |b|.
double rel_error(const std::vector<float>& a, const std::vector<double>& b) {
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    largest = std::max(largest, std::abs(b[i]));
  }
  REQUIRE(largest > 0);
  return worst / largest;
}

}  // namespace

TEST_CASE("ops: RMSNorm's input and weight gradients match float64 central differences") {
  const int rows = 5, n = 16;
  const float eps = 1e-5f;
  const std::vector<float> x = noise(rows * n, 1, 4.0), w = noise(n, 2, 2.0), c = noise(rows * n, 3);
  // L = sum c * y with y = x * rstd(x) * w, in float64.
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    double L = 0;
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int i = 0; i < n; ++i) ss += xv[r * n + i] * xv[r * n + i];
      const double rs = 1.0 / std::sqrt(ss / n + eps);
      for (int i = 0; i < n; ++i) L += c[r * n + i] * xv[r * n + i] * rs * wv[i];
    }
    return L;
  };
  std::vector<float> y(rows * n), rstd(rows), dx(rows * n), dw(n, 0.0f);
  ops::rmsnorm_forward(ctx, x.data(), w.data(), y.data(), rstd.data(), rows, n, eps);
  std::vector<float> again(rows * n);
  ops::rmsnorm_recompute(ctx, x.data(), rstd.data(), w.data(), again.data(), rows, n);
  CHECK(again == y);
  ops::rmsnorm_backward(ctx, c.data(), x.data(), rstd.data(), w.data(), dx.data(), rows, n, false);
  ops::rmsnorm_weight_grad(ctx, c.data(), x.data(), rstd.data(), dw.data(), rows, n);
  const std::vector<double> wd(w.begin(), w.end()), xd(x.begin(), x.end());
  CHECK(rel_error(dx, numeric_grad(x, [&](const std::vector<double>& v) { return loss(v, wd); })) < 1e-4);
  CHECK(rel_error(dw, numeric_grad(w, [&](const std::vector<double>& v) { return loss(xd, v); })) < 1e-4);
  // accumulate adds to what dx holds (its two terms added to it one at a time: float rounding).
  std::vector<float> acc(rows * n, 1.0f);
  ops::rmsnorm_backward(ctx, c.data(), x.data(), rstd.data(), w.data(), acc.data(), rows, n, true);
  for (std::size_t i = 0; i < acc.size(); ++i)
    CHECK(std::abs(acc[i] - (1.0f + dx[i])) <= 4e-7f * (2 + std::abs(dx[i])));
}

TEST_CASE("ops: SwiGLU's gradients match float64 central differences") {
  const int count = 64;
  const std::vector<float> gate = noise(count, 4, 8.0), up = noise(count, 5, 4.0), c = noise(count, 6);
  const auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  std::vector<float> out(count), dgate(count), dup(count);
  ops::swiglu_forward(ctx, gate.data(), up.data(), out.data(), count);
  for (int e = 0; e < count; ++e) CHECK(std::abs(out[e] - silu(gate[e]) * up[e]) <= 1e-6 * (1 + std::abs(out[e])));
  ops::swiglu_backward(ctx, c.data(), gate.data(), up.data(), dgate.data(), dup.data(), count);
  const std::vector<double> gd(gate.begin(), gate.end()), ud(up.begin(), up.end());
  const auto loss = [&](const std::vector<double>& g, const std::vector<double>& u) {
    double L = 0;
    for (int e = 0; e < count; ++e) L += c[e] * silu(g[e]) * u[e];
    return L;
  };
  CHECK(rel_error(dgate, numeric_grad(gate, [&](const std::vector<double>& v) { return loss(v, ud); })) < 1e-4);
  CHECK(rel_error(dup, numeric_grad(up, [&](const std::vector<double>& v) { return loss(gd, v); })) < 1e-4);
}

TEST_CASE(
    "ops: RoPE rotates each head's pairs: position 0 is the identity, the inverse undoes it, inner products stay") {
  const int rows = 6, heads = 3, dh = 8, width = heads * dh;
  const ops::RopeTable table(16, dh, 10000.0f);
  const std::vector<std::int32_t> pos = {0, 1, 2, 7, 15, 3};
  const std::vector<float> x = noise(rows * width, 7), y = noise(rows * width, 8);
  std::vector<float> rx = x, ry = y;
  ops::rope(ctx, rx.data(), pos.data(), rows, width, table, false);
  ops::rope(ctx, ry.data(), pos.data(), rows, width, table, false);
  for (int i = 0; i < width; ++i) CHECK(rx[i] == x[i]);  // position 0: cos 1, sin 0
  double before = 0, after = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    before += static_cast<double>(x[i]) * y[i];
    after += static_cast<double>(rx[i]) * ry[i];
  }
  CHECK(std::abs(before - after) <= 1e-5 * std::abs(before) + 1e-6);
  // Against float64: pair j of a head at position p turns by p * theta^(-2j/dh).
  for (int t = 0; t < rows; ++t)
    for (int e = 0; e < width; e += 2) {
      const int j = (e % dh) / 2;
      const double a = pos[t] * std::pow(10000.0, -2.0 * j / dh);
      const double u = x[t * width + e], v = x[t * width + e + 1];
      CHECK(std::abs(rx[t * width + e] - (u * std::cos(a) - v * std::sin(a))) <= 2e-6);
      CHECK(std::abs(rx[t * width + e + 1] - (u * std::sin(a) + v * std::cos(a))) <= 2e-6);
    }
  ops::rope(ctx, rx.data(), pos.data(), rows, width, table, true);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::abs(rx[i] - x[i]) <= 1e-6);
  const std::vector<std::int32_t> bad = {0, 16};
  CHECK(error_of([&] { ops::rope(ctx, rx.data(), bad.data(), 2, width, table, false); }) ==
        "ops::rope: row 1 has position 16, outside [0, 15]");
  CHECK(error_of([] { ops::RopeTable(4, 7, 10000.0f); }) ==
        "ops::RopeTable: positions = 4, head_dim = 7, theta = 10000.000000; need positions >= 1, an even head_dim "
        ">= 2 and theta > 1");
}

TEST_CASE("ops: the embedding copies its rows and its gradient adds them in row order; bad ids are refused") {
  const int rows = 7, n = 4, vocab = 5;
  const std::vector<std::int32_t> tokens = {3, 0, 3, 4, 1, 3, 0};
  const std::vector<float> table = noise(vocab * n, 9), d = noise(rows * n, 10);
  std::vector<float> out(rows * n), dtable(vocab * n, 0.0f), want(vocab * n, 0.0f);
  ops::embedding_forward(ctx, tokens.data(), table.data(), out.data(), rows, n, vocab);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) CHECK(out[r * n + i] == table[tokens[r] * n + i]);
  ops::embedding_backward(ctx, tokens.data(), d.data(), dtable.data(), rows, n, vocab);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) want[tokens[r] * n + i] += d[r * n + i];
  CHECK(dtable == want);
  const std::vector<std::int32_t> bad = {1, 5};
  CHECK(error_of([&] { ops::embedding_forward(ctx, bad.data(), table.data(), out.data(), 2, n, vocab); }) ==
        "ops::embedding_forward: token 5 at row 1 is outside [0, 4]");
  // The gradient refuses a bad id before it adds anything (no row added, then a throw).
  const std::vector<float> before = dtable;
  CHECK(error_of([&] { ops::embedding_backward(ctx, bad.data(), d.data(), dtable.data(), 2, n, vocab); }) ==
        "ops::embedding_backward: id 5 at row 1 is outside [0, 4]");
  CHECK(dtable == before);
}

TEST_CASE("ops: cross-entropy's losses and logit gradients match float64; bad targets are refused") {
  const int rows = 4, vocab = 50;
  const std::vector<float> logits = noise(rows * vocab, 11, 6.0);
  const std::vector<std::int32_t> targets = {0, 49, 17, 17};
  const float scale = 0.25f;
  std::vector<float> losses(rows), dlogits(rows * vocab);
  ops::cross_entropy(ctx, logits.data(), targets.data(), losses.data(), dlogits.data(), rows, vocab, scale);
  const auto loss = [&](const std::vector<double>& z) {
    double L = 0;
    for (int r = 0; r < rows; ++r) {
      double mx = z[r * vocab];
      for (int v = 1; v < vocab; ++v) mx = std::max(mx, z[r * vocab + v]);
      double sum = 0;
      for (int v = 0; v < vocab; ++v) sum += std::exp(z[r * vocab + v] - mx);
      L += scale * (mx + std::log(sum) - z[r * vocab + targets[r]]);
    }
    return L;
  };
  const std::vector<double> zd(logits.begin(), logits.end());
  double total = 0;
  for (float l : losses) total += scale * l;
  CHECK(std::abs(total - loss(zd)) <= 1e-6 * std::abs(loss(zd)));
  CHECK(rel_error(dlogits, numeric_grad(logits, loss)) < 1e-4);
  // In place (dlogits = logits, as the CUDA heads call it): the same losses and gradients, bit for bit.
  std::vector<float> in_place = logits, in_place_losses(rows);
  ops::cross_entropy(ctx, in_place.data(), targets.data(), in_place_losses.data(), in_place.data(), rows, vocab, scale);
  CHECK(in_place_losses == losses);
  CHECK(in_place == dlogits);
  const std::vector<std::int32_t> bad = {0, -1};
  CHECK(error_of([&] {
          ops::cross_entropy(ctx, logits.data(), bad.data(), losses.data(), dlogits.data(), 2, vocab, 1.0f);
        }) == "ops::cross_entropy: target -1 at row 1 is outside [0, 49]");
  std::vector<float> sum(8);
  const std::vector<float> a = noise(8, 12), b = noise(8, 13);
  ops::add(ctx, a.data(), b.data(), sum.data(), 8);
  for (int e = 0; e < 8; ++e) CHECK(sum[e] == a[e] + b[e]);
}

TEST_CASE("ops: LayerNorm's input, gamma and beta gradients match float64 central differences") {
  const int rows = 4, n = 16;
  const std::vector<float> x = noise(rows * n, 21, 4.0), gamma = noise(n, 22, 2.0), beta = noise(n, 23),
                           c = noise(rows * n, 24);
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& gv, const std::vector<double>& bv) {
    double L = 0;
    for (int r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      for (int i = 0; i < n; ++i) mean += xv[r * n + i] / n;
      for (int i = 0; i < n; ++i) var += (xv[r * n + i] - mean) * (xv[r * n + i] - mean) / n;
      const double rs = 1.0 / std::sqrt(var + ops::layernorm_eps);
      for (int i = 0; i < n; ++i) L += c[r * n + i] * ((xv[r * n + i] - mean) * rs * gv[i] + bv[i]);
    }
    return L;
  };
  std::vector<float> y(rows * n), stats(2 * rows), again(rows * n), dx(rows * n), dg(n, 0.0f), db(n, 0.0f);
  ops::layernorm_forward(ctx, x.data(), gamma.data(), beta.data(), y.data(), stats.data(), rows, n);
  ops::layernorm_recompute(ctx, x.data(), stats.data(), gamma.data(), beta.data(), again.data(), rows, n);
  CHECK(again == y);
  ops::layernorm_backward(ctx, c.data(), x.data(), stats.data(), gamma.data(), dx.data(), rows, n, false);
  ops::layernorm_weight_grad(ctx, c.data(), x.data(), stats.data(), dg.data(), db.data(), rows, n);
  const std::vector<double> xd(x.begin(), x.end()), gd(gamma.begin(), gamma.end()), bd(beta.begin(), beta.end());
  CHECK(rel_error(dx, numeric_grad(x, [&](const std::vector<double>& v) { return loss(v, gd, bd); })) < 1e-4);
  CHECK(rel_error(dg, numeric_grad(gamma, [&](const std::vector<double>& v) { return loss(xd, v, bd); })) < 1e-4);
  CHECK(rel_error(db, numeric_grad(beta, [&](const std::vector<double>& v) { return loss(xd, gd, v); })) < 1e-4);
  std::vector<float> acc(rows * n, 1.0f);
  ops::layernorm_backward(ctx, c.data(), x.data(), stats.data(), gamma.data(), acc.data(), rows, n, true);
  for (std::size_t i = 0; i < acc.size(); ++i) CHECK(acc[i] == 1.0f + dx[i]);  // one addition
}

TEST_CASE("ops: GeLU's gradient matches float64 central differences of its tanh form") {
  const int count = 64;
  const std::vector<float> x = noise(count, 25, 8.0), c = noise(count, 26);
  const auto gelu = [](double v) { return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
  std::vector<float> y(count), g = c;
  ops::gelu_forward(ctx, x.data(), y.data(), count);
  for (int e = 0; e < count; ++e) CHECK(std::abs(y[e] - gelu(x[e])) <= 1e-6 * (1 + std::abs(gelu(x[e]))));
  ops::gelu_backward(ctx, x.data(), g.data(), count);
  CHECK(rel_error(g, numeric_grad(x, [&](const std::vector<double>& v) {
                    double L = 0;
                    for (int e = 0; e < count; ++e) L += c[e] * gelu(v[e]);
                    return L;
                  })) < 1e-4);
}

TEST_CASE("ops: dropout keeps what its seed says, the mask variant agrees, biases add and sum in row order") {
  const long long count = 1000;
  const std::vector<float> x = noise(count, 27), y = noise(count, 28);
  const ops::DropoutSeed site{1, 2, nullptr, 3, 0, 4};
  const std::uint64_t seed = ops::dropout_seed(1, 2, 3, 0, 4);
  CHECK(site.value() == seed);
  const std::int32_t step_on_device = 2;  // the step read at run time gives the same seed
  CHECK(ops::DropoutSeed{1, 99, &step_on_device, 3, 0, 4}.value() == seed);
  std::vector<float> out(count), out2(count), back(count), back2(count);
  std::vector<std::uint8_t> mask(count);
  ops::residual_dropout(ctx, x.data(), y.data(), out.data(), count, site, 0.25f);
  ops::residual_dropout_mask(ctx, x.data(), y.data(), out2.data(), mask.data(), count, site, 0.25f);
  CHECK(out == out2);
  long long kept = 0;
  for (long long e = 0; e < count; ++e) {
    CHECK(mask[e] == (ops::dropout_keep(seed, static_cast<std::uint64_t>(e), 0.25f) ? 1 : 0));
    kept += mask[e];
    CHECK(out[e] == (mask[e] ? x[e] + y[e] * (1.0f / 0.75f) : x[e]));
  }
  CHECK(kept > 650);  // about 750 of 1000 kept
  CHECK(kept < 850);
  ops::dropout_backward(ctx, y.data(), back.data(), count, site, 0.25f);
  ops::dropout_backward_mask(ctx, y.data(), mask.data(), back2.data(), count, 0.25f);
  CHECK(back == back2);
  const int rows = 3, n = 4;
  std::vector<float> m = noise(rows * n, 29), bias = noise(n, 30), db(n, 0.5f);
  const std::vector<float> m0 = m;
  ops::add_bias(ctx, m.data(), bias.data(), rows, n);
  ops::bias_grad(ctx, m0.data(), db.data(), rows, n);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) CHECK(m[r * n + i] == m0[r * n + i] + bias[i]);
  for (int i = 0; i < n; ++i) CHECK(db[i] == ((0.5f + m0[i]) + m0[n + i]) + m0[2 * n + i]);
  float mean = 0;
  ops::mean(ctx, m0.data(), &mean, rows * n);
  float sum = 0;
  for (float v : m0) sum += v;
  CHECK(mean == sum / static_cast<float>(rows * n));
}

TEST_CASE("ops: position embeddings restart every seq rows; the gradient adds a position's rows in order") {
  const int seq = 3, n = 2, rows = 6;
  const std::vector<float> table = noise(seq * n, 31), d = noise(rows * n, 32);
  std::vector<float> out(rows * n, 1.0f), dtable(seq * n, 0.0f);
  ops::position_embedding_forward(ctx, table.data(), out.data(), rows, n, seq);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) CHECK(out[r * n + i] == 1.0f + table[(r % seq) * n + i]);
  ops::position_embedding_backward(ctx, d.data(), dtable.data(), rows, n, seq);
  for (int p = 0; p < seq; ++p)
    for (int i = 0; i < n; ++i) CHECK(dtable[p * n + i] == (0.0f + d[p * n + i]) + d[(seq + p) * n + i]);
  CHECK(error_of([&] { ops::position_embedding_backward(ctx, d.data(), dtable.data(), 5, n, seq); }) ==
        "ops::position_embedding_backward: rows = 5 is not a whole number of sequences of seq = 3");
}

TEST_CASE("ops: grouped-query attention matches float64 softmax attention and its central differences") {
  const ops::AttentionShape s{.batch = 2, .seq = 5, .heads = 4, .kv_heads = 2, .head_dim = 4};
  const int T = s.batch * s.seq, H = s.heads * s.head_dim, K = s.kv_heads * s.head_dim;
  const std::vector<float> q = noise(T * H, 33, 2.0), k = noise(T * K, 34, 2.0), v = noise(T * K, 35),
                           c = noise(T * H, 36);
  // L = sum c * out, out by the textbook formula in float64; query head a reads kv head a / 2.
  const auto attend = [&](const std::vector<double>& qv, const std::vector<double>& kv, const std::vector<double>& vv) {
    std::vector<double> out(static_cast<std::size_t>(T * H), 0.0);
    for (int b = 0; b < s.batch; ++b)
      for (int a = 0; a < s.heads; ++a)
        for (int i = 0; i < s.seq; ++i) {
          std::vector<double> w(static_cast<std::size_t>(i + 1));
          double mx = -1e300, sum = 0;
          for (int j = 0; j <= i; ++j) {
            double dot = 0;
            for (int e = 0; e < s.head_dim; ++e)
              dot += qv[(b * s.seq + i) * H + a * s.head_dim + e] * kv[(b * s.seq + j) * K + (a / 2) * s.head_dim + e];
            w[j] = dot / std::sqrt(static_cast<double>(s.head_dim));
            mx = std::max(mx, w[j]);
          }
          for (int j = 0; j <= i; ++j) sum += std::exp(w[j] - mx);
          for (int j = 0; j <= i; ++j)
            for (int e = 0; e < s.head_dim; ++e)
              out[(b * s.seq + i) * H + a * s.head_dim + e] +=
                  std::exp(w[j] - mx) / sum * vv[(b * s.seq + j) * K + (a / 2) * s.head_dim + e];
        }
    return out;
  };
  const auto loss = [&](const std::vector<double>& qv, const std::vector<double>& kv, const std::vector<double>& vv) {
    const std::vector<double> o = attend(qv, kv, vv);
    double L = 0;
    for (std::size_t i = 0; i < o.size(); ++i) L += c[i] * o[i];
    return L;
  };
  std::vector<float> out(T * H), lse(s.batch * s.heads * s.seq), dq(T * H), dk(T * K), dv(T * K);
  ops::attention_forward(ctx, q.data(), k.data(), v.data(), out.data(), lse.data(), s);
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end());
  CHECK(rel_error(out, attend(qd, kd, vd)) < 1e-6);
  ops::attention_backward(ctx, q.data(), k.data(), v.data(), out.data(), c.data(), lse.data(), dq.data(), dk.data(),
                          dv.data(), s);
  CHECK(rel_error(dq, numeric_grad(q, [&](const std::vector<double>& x) { return loss(x, kd, vd); })) < 1e-4);
  CHECK(rel_error(dk, numeric_grad(k, [&](const std::vector<double>& x) { return loss(qd, x, vd); })) < 1e-4);
  CHECK(rel_error(dv, numeric_grad(v, [&](const std::vector<double>& x) { return loss(qd, kd, x); })) < 1e-4);
  CHECK(error_of([&] {
          ops::attention_forward(ctx, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                 {.batch = 1, .seq = 5, .heads = 6, .kv_heads = 4, .head_dim = 4});
        }) ==
        "ops::attention_forward: batch = 1, seq = 5, heads = 6, kv_heads = 4, head_dim = 4; need every size >= 1 "
        "and heads a multiple of kv_heads");
}

TEST_CASE("ops: position embeddings by row positions add the table's rows; bad positions are refused") {
  const int n = 3, table_rows = 4, rows = 6;
  const std::vector<std::int32_t> positions = {0, 1, 2, 0, 1, 3};
  const std::vector<float> table = noise(table_rows * n, 37);
  std::vector<float> out(rows * n, 1.0f);
  ops::position_embedding_forward(ctx, table.data(), positions.data(), out.data(), rows, n, table_rows);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) CHECK(out[r * n + i] == 1.0f + table[positions[r] * n + i]);
  // Positions r % seq give the restarting overload's bits.
  const std::vector<std::int32_t> cyclic = {0, 1, 2, 0, 1, 2};
  std::vector<float> a(rows * n, 0.5f), b(rows * n, 0.5f);
  ops::position_embedding_forward(ctx, table.data(), cyclic.data(), a.data(), rows, n, table_rows);
  ops::position_embedding_forward(ctx, table.data(), b.data(), rows, n, 3);
  CHECK(a == b);
  const std::vector<std::int32_t> bad = {0, 1, 4};
  CHECK(error_of([&] {
          ops::position_embedding_forward(ctx, table.data(), bad.data(), out.data(), 3, n, table_rows);
        }) == "ops::position_embedding_forward: position 4 at row 2 is outside [0, 3]");
}

TEST_CASE("ops: the GEMM attention equals the plain reference on random documents, strides and head groups") {
  // Seeded shapes: 1 to 3 rows of 1 to 12 tokens cut into random documents, 1 to 3 key/value
  // heads of 1 to 3 query heads each, head widths 1 to 8, dense rows or a packed [q | k | v]
  // row with a padded output. Each document of the GEMM path against the reference on that
  // document alone (one sequence): the same sums in another order with exp_approx for
  // std::exp (a few ulps), so 1e-5 of the largest value is far above their rounding and far
  // below any wrong term (a score is O(1)); a one-token document's dq and dk are 0 exactly in
  // the reference and the rounding of dP - rowsum(dout o) (1e-8) in the GEMM path, hence the
  // floor of 1e-2 under the largest value.
  const auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    double worst = 0, largest = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
      largest = std::max(largest, static_cast<double>(std::abs(b[i])));
    }
    return worst <= 1e-5 * std::max(largest, 1e-2);
  };
  int checked = 0;
  for (std::uint64_t trial = 0; trial < 40; ++trial) {
    const auto pick = [&](std::uint64_t what, int lo, int hi) {
      return lo + static_cast<int>(ops::mix64(ops::mix64(991, trial), what) % static_cast<std::uint64_t>(hi - lo + 1));
    };
    const int kvh = pick(1, 1, 3), per = pick(2, 1, 3), dh = pick(3, 1, 8), B = pick(4, 1, 3), S = pick(5, 1, 12);
    const bool packed = pick(6, 0, 1) == 1;
    const ops::AttentionShape s{.batch = B, .seq = S, .heads = kvh * per, .kv_heads = kvh, .head_dim = dh};
    const long long H = static_cast<long long>(s.heads) * dh, K = static_cast<long long>(kvh) * dh, T = B * S;
    const ops::AttentionStrides st =
        packed ? ops::AttentionStrides{H + 2 * K, H + 2 * K, H + 2 * K, H + 3} : ops::AttentionStrides{};
    const long long lq = packed ? H + 2 * K : H, lk = packed ? H + 2 * K : K, lo = packed ? H + 3 : H;
    std::vector<pipeoffload::Document> docs;
    for (int b = 0; b < B; ++b)
      for (int begin = 0; begin < S;) {
        const int len = std::min(S - begin, pick(100 + static_cast<std::uint64_t>(b * S + begin), 1, S));
        docs.push_back({static_cast<std::size_t>(b), static_cast<std::size_t>(begin), static_cast<std::size_t>(len)});
        begin += len;
      }
    const std::vector<float> qkv = noise(static_cast<std::size_t>(T * lq), 500 + trial, 3.0),
                             kd = noise(static_cast<std::size_t>(T * K), 600 + trial, 3.0),
                             vd = noise(static_cast<std::size_t>(T * K), 700 + trial),
                             dout = noise(static_cast<std::size_t>(T * lo), 800 + trial);
    const float* q = qkv.data();
    const float* k = packed ? q + H : kd.data();
    const float* v = packed ? q + H + K : vd.data();
    std::vector<float> out(static_cast<std::size_t>(T * lo)), lse(static_cast<std::size_t>(B * s.heads * S));
    std::vector<float> dq(static_cast<std::size_t>(T * lq)), dk(static_cast<std::size_t>(T * lk)),
        dv(static_cast<std::size_t>(T * lk));
    float* dkp = packed ? dq.data() + H : dk.data();
    float* dvp = packed ? dq.data() + H + K : dv.data();
    ops::attention_forward(ctx, q, k, v, out.data(), lse.data(), s, docs, st);
    ops::attention_backward(ctx, q, k, v, out.data(), dout.data(), lse.data(), dq.data(), dkp, dvp, s, docs, st);
    for (const pipeoffload::Document& doc : docs) {
      // The document alone, dense: rows first .. first + L of every tensor.
      const long long L = static_cast<long long>(doc.length),
                      first = static_cast<long long>(doc.row) * S + static_cast<long long>(doc.begin);
      const auto rows_of = [&](const float* p, long long stride, long long width) {
        std::vector<float> r(static_cast<std::size_t>(L * width));
        for (long long t = 0; t < L; ++t) std::copy_n(p + (first + t) * stride, width, r.begin() + t * width);
        return r;
      };
      const ops::AttentionShape one{
          .batch = 1, .seq = static_cast<int>(L), .heads = s.heads, .kv_heads = kvh, .head_dim = dh};
      const std::vector<float> q1 = rows_of(q, lq, H), k1 = rows_of(k, lk, K), v1 = rows_of(v, lk, K),
                               do1 = rows_of(dout.data(), lo, H);
      std::vector<float> o1(static_cast<std::size_t>(L * H)), l1(static_cast<std::size_t>(s.heads * L)), dq1(o1.size()),
          dk1(k1.size()), dv1(v1.size());
      ops::reference::attention_forward(ctx, q1.data(), k1.data(), v1.data(), o1.data(), l1.data(), one);
      ops::reference::attention_backward(ctx, q1.data(), k1.data(), v1.data(), o1.data(), do1.data(), l1.data(),
                                         dq1.data(), dk1.data(), dv1.data(), one);
      std::vector<float> lse_doc;
      for (int a = 0; a < s.heads; ++a)
        for (long long t = 0; t < L; ++t)
          lse_doc.push_back(lse[(doc.row * static_cast<std::size_t>(s.heads) + static_cast<std::size_t>(a)) *
                                    static_cast<std::size_t>(S) +
                                doc.begin + static_cast<std::size_t>(t)]);
      CHECK(close(rows_of(out.data(), lo, H), o1));
      CHECK(close(lse_doc, l1));
      CHECK(close(rows_of(dq.data(), lq, H), dq1));
      CHECK(close(rows_of(dkp, lk, K), dk1));
      CHECK(close(rows_of(dvp, lk, K), dv1));
      ++checked;
    }
  }
  CHECK(checked > 80);  // documents compared over the trials
  // A stride narrower than a row, a document outside its row: refused with the values.
  const ops::AttentionShape s{.batch = 1, .seq = 4, .heads = 2, .kv_heads = 1, .head_dim = 2};
  const std::vector<float> x(64, 0.0f);
  std::vector<float> y(64), l(8);
  const std::vector<pipeoffload::Document> whole = {{0, 0, 4}}, outside = {{0, 2, 3}};
  CHECK(error_of([&] {
          ops::attention_forward(ctx, x.data(), x.data(), x.data(), y.data(), l.data(), s, whole, {.q = 3});
        }) ==
        "ops::attention_forward: strides q = 3, k = 2, v = 2, out = 4; need q and out >= heads * head_dim = 4 "
        "and k, v >= kv_heads * head_dim = 2");
  CHECK(error_of([&] {
          ops::attention_backward(ctx, x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), y.data(), y.data(),
                                  y.data(), s, outside);
        }) ==
        "ops::attention_backward: a document at row 0, tokens [2, 5) is outside rows [0, 1) of tokens [0, 4) or "
        "empty");
}
