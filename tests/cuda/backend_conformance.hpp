// tests/cuda/backend_conformance.hpp: the same cases on every backend (issue 4).
//
// Each case is a template over a Traits type that says how to make the device and the little
// a case cannot express through the backend concept itself: a delay on a stream (to make an
// ordering bug observable) and a stage's forward/backward body (y = GeLU(x), dx = dy GeLU'(x),
// the per-element math of model/math.hpp). Data moves in and out only through the concept:
// pinned host blocks, transfer(), synchronize(). Instantiated for backend::Cpu in
// test_conformance_cpu.cpp (runs everywhere) and backend::Cuda in test_conformance_cuda.cpp
// (SKIP without a GPU).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
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

}  // namespace conformance

/// Registers the four cases for one backend; `name` goes into the test names.
#define PIPEOFFLOAD_CONFORMANCE_CASES(Traits, name)                                                               \
  TEST_CASE(name ": blocks are pooled by size and reused across streams without new allocations") {              \
    conformance::allocation_and_reuse<Traits>();                                                                \
  }                                                                                                             \
  TEST_CASE(name ": a wait orders one stream after another stream's record") { conformance::event_ordering<Traits>(); } \
  TEST_CASE(name ": an offload into power-of-two bins and its reload give back every byte") {                    \
    conformance::copy_round_trip<Traits>();                                                                     \
  }                                                                                                             \
  TEST_CASE(name ": a stage's forward and backward match model/math.hpp") { conformance::stage_forward_backward<Traits>(); }
