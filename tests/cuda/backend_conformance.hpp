// tests/cuda/backend_conformance.hpp: the same cases on every backend (issue 4).
//
// Each case is a template over a Traits type that says how to make the device and the little
// a case cannot express through the backend concept itself: a delay on a stream (to make an
// ordering bug observable) and a stage's forward/backward body (y = GeLU(x), dx = dy GeLU'(x),
// the per-element math of model/math.hpp). Data moves in and out only through the concept:
// pinned host blocks, transfer(), synchronize() (and upload/download where a case tests them).
// Instantiated for backend::Cpu in
// test_conformance_cpu.cpp (runs everywhere) and backend::Cuda in test_conformance_cuda.cpp
// (SKIP without a GPU).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <pipeoffload/backend/backend.hpp>
#include <pipeoffload/model/math.hpp>
#include <pipeoffload/offload/host_bins.hpp>

namespace conformance {

namespace pb = pipeoffload::backend;

/// Copies `bytes` from host memory into device block `dst` on `stream` (via a pinned block).
template <class Dev>
void upload(Dev& dev, int stream, pb::Block dst, const void* src, std::size_t bytes) {
  pb::HostBlock h = dev.host_alloc(bytes);
  std::memcpy(h.ptr, src, bytes);
  dev.launch(stream, [&] {
    const pb::CopyPiece p{dst.ptr, h.ptr, bytes};
    dev.transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev.synchronize();
  dev.host_free(h);
}

/// The bytes of a device block, after everything enqueued so far.
template <class Dev>
std::vector<std::byte> download(Dev& dev, int stream, pb::Block src) {
  pb::HostBlock h = dev.host_alloc(src.bytes);
  dev.launch(stream, [&] {
    const pb::CopyPiece p{h.ptr, src.ptr, src.bytes};
    dev.transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev.synchronize();
  std::vector<std::byte> out(h.ptr, h.ptr + src.bytes);
  dev.host_free(h);
  return out;
}

template <class Traits>
void allocation_and_reuse() {
  auto dev = Traits::make();
  const int s = dev->make_stream("compute"), t = dev->make_stream("copy");
  const long long before = dev->memory().device_allocations;
  pb::Block a, b, c;
  dev->launch(s, [&] { a = dev->device_alloc(1000, pb::Memory::activation); });
  dev->launch(s, [&] { dev->device_free(a); });
  dev->launch(s, [&] { b = dev->device_alloc(1000, pb::Memory::stash); });  // same size: pooled
  dev->launch(t, [&] { c = dev->device_alloc(5000, pb::Memory::message); });
  dev->synchronize();
  CHECK(b.ptr == a.ptr);
  CHECK(c.ptr != b.ptr);
  pb::MemoryStats m = dev->memory();
  CHECK(m.device_allocations - before == 2);
  CHECK(m.in(pb::Memory::activation) == 0);
  CHECK(m.in(pb::Memory::stash) == 1000);
  CHECK(m.in(pb::Memory::message) == 5000);
  CHECK(m.peak_of(pb::Memory::activation) == 1000);
  CHECK(m.total_peak == 6000);
  // Freed on one stream, reused from another that waits for the free's event (backend::Cpu
  // frees when the worker runs the free; backend::Cuda also guards the block with an event).
  const int freed = dev->make_event();
  dev->launch(s, [&] { dev->device_free(b); });
  dev->record(freed, s);
  dev->wait(t, freed);
  pb::Block d;
  dev->launch(t, [&] { d = dev->device_alloc(1000, pb::Memory::activation); });
  dev->launch(t, [&] {
    dev->device_free(c);
    dev->device_free(d);
  });
  dev->synchronize();
  CHECK(d.ptr == a.ptr);
  CHECK(dev->memory().device_allocations - before == 2);
  // Pinned host bins pool by size too.
  const long long host_before = dev->memory().host_allocations;
  pb::HostBlock h1 = dev->host_alloc(4096);
  dev->host_free(h1);
  pb::HostBlock h2 = dev->host_alloc(4096);
  CHECK(h2.ptr == h1.ptr);
  CHECK(dev->memory().host_allocations - host_before == 1);
  CHECK(dev->memory().host_in_use == 4096);
  dev->host_free(h2);
  CHECK(dev->memory().host_in_use == 0);
}

template <class Traits>
void event_ordering() {
  auto dev = Traits::make();
  const int a = dev->make_stream("a"), b = dev->make_stream("b");
  const int done = dev->make_event();
  const std::size_t n = 1 << 20;
  pb::Block src = dev->device_alloc(n, pb::Memory::activation), dst = dev->device_alloc(n, pb::Memory::activation);
  std::vector<unsigned char> zeros(n, 0), ones(n, 1);
  upload(*dev, a, src, zeros.data(), n);
  upload(*dev, a, dst, zeros.data(), n);
  pb::HostBlock h = dev->host_alloc(n);
  std::memcpy(h.ptr, ones.data(), n);
  // Stream a: a long delay, then src = ones. Stream b waits for a's event, then dst = src.
  dev->launch(a, [&] { Traits::delay(*dev); });
  dev->launch(a, [&] {
    const pb::CopyPiece p{src.ptr, h.ptr, n};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev->record(done, a);
  dev->wait(b, done);
  dev->launch(b, [&] {
    const pb::CopyPiece p{dst.ptr, src.ptr, n};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev->synchronize();
  const std::vector<std::byte> got = download(*dev, b, dst);
  CHECK(std::memcmp(got.data(), ones.data(), n) == 0);  // b saw a's write, not the zeros
  dev->host_free(h);
  dev->device_free(src);
  dev->device_free(dst);
}

template <class Traits>
void copy_round_trip() {
  auto dev = Traits::make();
  const int compute = dev->make_stream("compute"), copy = dev->make_stream("copy");
  const std::size_t bytes = 3 * 1000 * 1000 + 17;  // not a power of two: 3 bins
  std::vector<unsigned char> pattern(bytes);
  for (std::size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<unsigned char>(i * 131 + 7);
  pb::Block unit = dev->device_alloc(bytes, pb::Memory::activation);
  upload(*dev, compute, unit, pattern.data(), bytes);
  // Offload into the bins host_bins.hpp chooses, wipe the device copy, reload.
  const pipeoffload::offload::BinPlan plan = pipeoffload::offload::plan_bins(bytes);
  CHECK(plan.count <= 3);
  CHECK(plan.total() >= bytes);
  std::vector<pb::HostBlock> bins;
  std::vector<pb::CopyPiece> out, in;
  std::size_t off = 0;
  for (int i = 0; i < plan.count; ++i) {
    bins.push_back(dev->host_alloc(plan.bins[static_cast<std::size_t>(i)]));
    const std::size_t len = std::min<std::size_t>(plan.bins[static_cast<std::size_t>(i)], bytes - off);
    out.push_back({bins.back().ptr, unit.ptr + off, len});
    in.push_back({unit.ptr + off, bins.back().ptr, len});
    off += len;
  }
  CHECK(off == bytes);
  dev->launch(copy, [&] { dev->transfer(out); });
  dev->synchronize();
  std::vector<unsigned char> zeros(bytes, 0);
  upload(*dev, compute, unit, zeros.data(), bytes);
  dev->launch(copy, [&] { dev->transfer(in); });
  dev->synchronize();
  const std::vector<std::byte> got = download(*dev, compute, unit);
  CHECK(std::memcmp(got.data(), pattern.data(), bytes) == 0);
  for (auto& b : bins) dev->host_free(b);
  dev->device_free(unit);
}

template <class Traits>
void stage_forward_backward() {
  auto dev = Traits::make();
  const int compute = dev->make_stream("compute");
  const std::size_t n = 4096;
  std::vector<float> x(n), dy(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = -4.0f + 8.0f * static_cast<float>(i) / n;
    dy[i] = 0.5f + static_cast<float>(i % 7) * 0.25f;
  }
  pb::Block bx = dev->device_alloc(n * 4, pb::Memory::activation), by = dev->device_alloc(n * 4, pb::Memory::message);
  pb::Block bdy = dev->device_alloc(n * 4, pb::Memory::message), bdx = dev->device_alloc(n * 4, pb::Memory::stash);
  upload(*dev, compute, bx, x.data(), n * 4);
  upload(*dev, compute, bdy, dy.data(), n * 4);
  dev->launch(compute, [&] {
    auto ctx = dev->context(compute);
    Traits::gelu_forward(ctx, reinterpret_cast<const float*>(bx.ptr), reinterpret_cast<float*>(by.ptr), n);
    Traits::gelu_backward(ctx, reinterpret_cast<const float*>(bx.ptr), reinterpret_cast<const float*>(bdy.ptr), reinterpret_cast<float*>(bdx.ptr), n);
  });
  dev->synchronize();
  const std::vector<std::byte> y = download(*dev, compute, by), dx = download(*dev, compute, bdx);
  for (std::size_t i = 0; i < n; ++i) {
    const float yi = reinterpret_cast<const float*>(y.data())[i], dxi = reinterpret_cast<const float*>(dx.data())[i];
    CHECK(std::abs(yi - pipeoffload::math::gelu(x[i])) <= Traits::tolerance * (1 + std::abs(yi)));
    CHECK(std::abs(dxi - dy[i] * pipeoffload::math::gelu_grad(x[i])) <= Traits::tolerance * (1 + std::abs(dxi)));
  }
  for (pb::Block b : {bx, by, bdy, bdx}) dev->device_free(b);
}

/// The blocking between-steps operations: upload/download, per-group sums of squares, AdamW.
/// fp32 arithmetic is exact on the CPU and within `fp32_tolerance` (an FMA contracted or not)
/// on a GPU; the fp64 sums within 1e-9 relative (another summation order).
template <class Traits>
void optimizer_operations() {
  auto dev = Traits::make();
  const std::size_t n = 10007;
  std::vector<float> p(n), g(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = std::sin(0.01f * static_cast<float>(i));
    g[i] = 0.1f * std::cos(0.013f * static_cast<float>(i)) - 0.02f;
    m[i] = 0.01f * static_cast<float>(i % 5);
    v[i] = 1e-4f * static_cast<float>(i % 3);
  }
  pb::Block bp = dev->device_alloc(n * 4, pb::Memory::state), bg = dev->device_alloc(n * 4, pb::Memory::state);
  pb::Block bm = dev->device_alloc(n * 4, pb::Memory::state), bv = dev->device_alloc(n * 4, pb::Memory::state);
  dev->upload(bp.ptr, p.data(), n * 4);
  dev->upload(bg.ptr, g.data(), n * 4);
  dev->upload(bm.ptr, m.data(), n * 4);
  dev->upload(bv.ptr, v.data(), n * 4);
  std::vector<float> back(n);
  dev->download(back.data(), bg.ptr, n * 4);
  CHECK(std::memcmp(back.data(), g.data(), n * 4) == 0);
  // Sums of squares over three groups, one of them empty.
  const std::vector<std::size_t> groups{5000, 0, n - 5000};
  std::vector<double> sums(3, -1.0);
  const auto fs = [](pb::Block b, std::size_t count) { return std::span<float>(reinterpret_cast<float*>(b.ptr), count); };
  dev->sum_squares(fs(bg, n), groups, sums);
  std::size_t off = 0;
  for (std::size_t k = 0; k < groups.size(); ++k) {
    double want = 0;
    for (std::size_t i = off; i < off + groups[k]; ++i) want += static_cast<double>(g[i]) * g[i];
    off += groups[k];
    CAPTURE(k);
    CHECK(std::abs(sums[k] - want) <= 1e-9 * want);
  }
  // AdamW with a clip scale, against math::adamw_update on the host; gradients zeroed after.
  pipeoffload::math::AdamW opt;
  opt.lr = 1e-2f;
  opt.weight_decay = 0.1f;
  const float lr = 3e-3f, scale = 0.5f;
  const pipeoffload::math::AdamBias bias = pipeoffload::math::adam_bias(opt, 3);
  dev->adamw(fs(bp, n), fs(bg, n), fs(bm, n), fs(bv, n), opt, lr, bias, scale);
  std::vector<float> got_p(n), got_g(n), got_m(n);
  dev->download(got_p.data(), bp.ptr, n * 4);
  dev->download(got_g.data(), bg.ptr, n * 4);
  dev->download(got_m.data(), bm.ptr, n * 4);
  for (std::size_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    pipeoffload::math::adamw_update(pi, g[i] * scale, mi, vi, opt, lr, bias);
    CHECK(std::abs(got_p[i] - pi) <= Traits::fp32_tolerance * (1 + std::abs(pi)));
    CHECK(std::abs(got_m[i] - mi) <= Traits::fp32_tolerance * (1 + std::abs(mi)));
    CHECK(got_g[i] == 0.0f);
  }
  for (pb::Block b : {bp, bg, bm, bv}) dev->device_free(b);
}

/// backend::pairs_copies: a stream that waits for a counter runs after the stream that raised
/// it, and an aborted counter releases its waiters (the device may then report the abort).
template <class Traits>
void pair_counters() {
  auto dev = Traits::make();
  const int a = dev->make_stream("a"), b = dev->make_stream("b");
  const std::size_t n = 1 << 20;
  pb::Block src = dev->device_alloc(n, pb::Memory::activation), dst = dev->device_alloc(n, pb::Memory::activation);
  std::vector<unsigned char> zeros(n, 0), ones(n, 1);
  dev->upload(src.ptr, zeros.data(), n);
  dev->upload(dst.ptr, zeros.data(), n);
  pb::HostBlock h = dev->host_alloc(n);
  std::memcpy(h.ptr, ones.data(), n);
  auto counter = std::make_unique<typename std::remove_reference_t<decltype(*dev)>::Counter>();
  // b waits for the counter to reach 2, then copies src; a delays, writes src, raises it to 2.
  dev->wait_counter(b, *counter, 2);
  dev->launch(b, [&] {
    const pb::CopyPiece p{dst.ptr, src.ptr, n};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev->launch(a, [&] { Traits::delay(*dev); });
  dev->launch(a, [&] {
    const pb::CopyPiece p{src.ptr, h.ptr, n};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev->signal(a, *counter, 1);
  dev->signal(a, *counter, 2);
  dev->synchronize();
  std::vector<unsigned char> got(n);
  dev->download(got.data(), dst.ptr, n);
  CHECK(std::memcmp(got.data(), ones.data(), n) == 0);
  dev->host_free(h);
  dev->device_free(src);
  dev->device_free(dst);
  // A wait for a value nobody raises ends once the counter is aborted.
  auto other = Traits::make();
  const int c = other->make_stream("c");
  auto stuck = std::make_unique<typename std::remove_reference_t<decltype(*dev)>::Counter>();
  other->wait_counter(c, *stuck, 5);
  stuck->abort("the partner failed");
  bool threw = false;
  try {
    other->synchronize();
  } catch (const std::exception& e) {
    threw = true;
    CHECK(std::string(e.what()).find("the partner failed") != std::string::npos);
  }
  CHECK(threw == Traits::abort_throws);
}

}  // namespace conformance

/// Registers the cases for one backend; `name` goes into the test names.
#define PIPEOFFLOAD_CONFORMANCE_CASES(Traits, name)                                                               \
  TEST_CASE(name ": blocks are pooled by size and reused across streams without new allocations") {              \
    conformance::allocation_and_reuse<Traits>();                                                                \
  }                                                                                                             \
  TEST_CASE(name ": a wait orders one stream after another stream's record") { conformance::event_ordering<Traits>(); } \
  TEST_CASE(name ": an offload into power-of-two bins and its reload give back every byte") {                    \
    conformance::copy_round_trip<Traits>();                                                                     \
  }                                                                                                             \
  TEST_CASE(name ": a stage's forward and backward match model/math.hpp") { conformance::stage_forward_backward<Traits>(); } \
  TEST_CASE(name ": upload, download, sums of squares and AdamW between steps") { conformance::optimizer_operations<Traits>(); } \
  TEST_CASE(name ": a counter orders one stream after another; an aborted counter releases its waiters") {        \
    conformance::pair_counters<Traits>();                                                                       \
  }
