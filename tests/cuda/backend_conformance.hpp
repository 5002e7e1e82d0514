// tests/cuda/backend_conformance.hpp: the same cases on every backend.
//
// Each case is a template over a Traits type that says how to make the device and the little
// a case cannot express through the backend concept itself: a delay on the stream of a context
// (to make an ordering bug observable) and a stage's forward/backward body (y = GeLU(x),
// dx = dy GeLU'(x), the per-element math of models/gpt/math.hpp). Data moves in and out only through
// the concept: pinned host blocks, transfer(), synchronize() (and upload, download, zero,
// flag_nonfinite and the optimizer updates where a case tests them).
// Instantiated for backend::Cpu in
// test_conformance_cpu.cpp (runs everywhere) and backend::Cuda in test_conformance_cuda.cpp
// (SKIP without a GPU).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <pipeoffload/backend/backend.hpp>
#include <pipeoffload/backend/update.hpp>
#include <pipeoffload/ops/math.hpp>
#include <pipeoffload/policy/host_bins.hpp>
#include <pipeoffload/tensor.hpp>

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
  const std::size_t held_before = dev->memory().device_held;
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
  // The arena holds the two blocks it made, each rounded up to its alignment (64 or 256).
  CHECK(m.device_held - held_before >= 6000);
  CHECK(m.device_held - held_before < 6000 + 2 * 256);
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
  CHECK(dev->memory().device_held == m.device_held);  // reuse holds nothing more
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

/// reset_arena between two users of a device: refused, naming the bytes, while a block is
/// handed out; then every pooled block goes and the reservations are forgotten (the same
/// reservation again holds what the first did, not twice that), and the device works on.
template <class Traits>
void arena_reset() {
  auto dev = Traits::make();
  const int s = dev->make_stream("compute");
  const pb::MemoryStats start = dev->memory();  // backend::Cuda: its workspace is held already
  dev->reserve_device(3000, 2);
  dev->reserve_host(4096, 1);
  const pb::MemoryStats reserved = dev->memory();
  CHECK(reserved.device_held - start.device_held >= 6000);
  CHECK(reserved.host_held - start.host_held >= 4096);
  pb::Block a;
  dev->launch(s, [&] { a = dev->device_alloc(3000, pb::Memory::activation); });
  pb::HostBlock h = dev->host_alloc(4096);
  dev->synchronize();
  const std::size_t block = reserved.host_held - start.host_held;  // one pinned block's size class
  const std::string both = std::to_string((reserved.device_held - start.device_held) / 2) + " device and " +
                           std::to_string(block) + " pinned host bytes are still handed out";
  CHECK_THROWS_WITH_AS(dev->reset_arena(0), doctest::Contains(both.c_str()), pipeoffload::error);
  dev->host_free(h);
  CHECK_THROWS_WITH_AS(dev->reset_arena(0), doctest::Contains(" device and 0 pinned host bytes"), pipeoffload::error);
  CHECK(dev->memory().device_held == reserved.device_held);  // a refusal changes nothing
  dev->launch(s, [&] { dev->device_free(a); });
  dev->reset_arena(0);
  const pb::MemoryStats m = dev->memory();
  CHECK(m.device_held == start.device_held);
  CHECK(m.host_held == start.host_held);
  CHECK(m.total_in_use == 0);
  dev->reserve_device(3000, 2);
  dev->reserve_host(4096, 1);
  CHECK(dev->memory().device_held == reserved.device_held);
  CHECK(dev->memory().host_held == reserved.host_held);
  CHECK(dev->memory().device_allocations - m.device_allocations == 2);
  std::vector<float> v(750);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * static_cast<float>(i);
  pb::Block b;
  dev->launch(s, [&] { b = dev->device_alloc(3000, pb::Memory::activation); });
  dev->synchronize();
  upload(*dev, s, b, v.data(), 3000);
  const std::vector<std::byte> back = download(*dev, s, b);
  CHECK(std::memcmp(back.data(), v.data(), 3000) == 0);
  dev->launch(s, [&] { dev->device_free(b); });
  dev->synchronize();
}

template <class Traits>
void event_ordering(bool in_pass) {
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
  dev->launch(a, [&] { Traits::delay(dev->context(a)); });
  dev->launch(a, [&] {
    const pb::CopyPiece p{src.ptr, h.ptr, n};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  dev->record(done, a);
  if (in_pass) {  // wait_in_pass (backend::waits_in_pass): from inside the pass, as a B awaits a part
    dev->launch(b, [&] {
      auto ctx = dev->context(b);
      dev->wait_in_pass(ctx, done);
      dev->copy(ctx, dst.ptr, src.ptr, n);
    });
  } else {
    dev->wait(b, done);
    dev->launch(b, [&] {
      const pb::CopyPiece p{dst.ptr, src.ptr, n};
      dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
    });
  }
  dev->synchronize();
  const std::vector<std::byte> got = download(*dev, b, dst);
  CHECK(std::memcmp(got.data(), ones.data(), n) == 0);  // b saw a's write, not the zeros
  dev->host_free(h);
  dev->device_free(src);
  dev->device_free(dst);
}

/// upload is enqueued: it lands after a stream's late write to the same block, the caller's
/// memory may be reused as soon as it returns, and the host waits only where the staging is
/// full or cannot hold the upload at all (backend::Cpu counts the waits backend::Cuda makes).
template <class Traits>
void staged_uploads() {
  auto dev = Traits::make();
  const int s = dev->make_stream("compute");
  const std::size_t n = 1 << 16, bytes = n * sizeof(float);
  pb::Block b = dev->device_alloc(bytes, pb::Memory::state);
  std::vector<float> late(n, 3.0f), mine(n), want(n);
  for (std::size_t i = 0; i < n; ++i) mine[i] = want[i] = 0.25f * static_cast<float>(i);
  pb::HostBlock h = dev->host_alloc(bytes);
  std::memcpy(h.ptr, late.data(), bytes);
  dev->launch(s, [&] { Traits::delay(dev->context(s)); });
  dev->launch(s, [&] {
    const pb::CopyPiece p{b.ptr, h.ptr, bytes};
    dev->transfer(std::span<const pb::CopyPiece>(&p, 1));
  });
  const long long waits = dev->host_waits();
  dev->upload(b.ptr, mine.data(), bytes);
  std::fill(mine.begin(), mine.end(), -1.0f);  // reused at once
  dev->upload(b.ptr, mine.data(), 0);          // nothing to copy
  CHECK(dev->host_waits() == waits);           // staged: no wait
  const std::vector<std::byte> got = download(*dev, s, b);
  CHECK(std::memcmp(got.data(), want.data(), bytes) == 0);  // after the late write, the values as uploaded
  // Two uploads of more than half the staging: the second finds it full and waits first.
  const std::size_t half = pb::default_upload_staging / 2 + 256;
  std::vector<unsigned char> halves(2 * half);
  for (std::size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<unsigned char>(i * 5 + 3);
  pb::Block two = dev->device_alloc(2 * half, pb::Memory::state);
  dev->synchronize();  // (the staging starts empty)
  const long long before_halves = dev->host_waits();
  dev->upload(two.ptr, halves.data(), half);
  CHECK(dev->host_waits() == before_halves);
  dev->upload(two.ptr + half, halves.data() + half, half);
  CHECK(dev->host_waits() == before_halves + 1);
  const std::vector<std::byte> both = download(*dev, s, two);
  CHECK(std::memcmp(both.data(), halves.data(), 2 * half) == 0);
  // Larger than the whole staging: the upload waits for its own copy.
  const std::size_t big = pb::default_upload_staging + 4;
  std::vector<unsigned char> pattern(big);
  for (std::size_t i = 0; i < big; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 1);
  pb::Block large = dev->device_alloc(big, pb::Memory::state);
  const long long before = dev->host_waits();
  dev->upload(large.ptr, pattern.data(), big);
  CHECK(dev->host_waits() == before + 1);
  const std::vector<std::byte> round = download(*dev, s, large);
  CHECK(std::memcmp(round.data(), pattern.data(), big) == 0);
  dev->host_free(h);
  dev->device_free(b);
  dev->device_free(two);
  dev->device_free(large);
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
    Traits::gelu_backward(ctx, reinterpret_cast<const float*>(bx.ptr), reinterpret_cast<const float*>(bdy.ptr),
                          reinterpret_cast<float*>(bdx.ptr), n);
  });
  dev->synchronize();
  const std::vector<std::byte> y = download(*dev, compute, by), dx = download(*dev, compute, bdx);
  for (std::size_t i = 0; i < n; ++i) {
    const float yi = reinterpret_cast<const float*>(y.data())[i], dxi = reinterpret_cast<const float*>(dx.data())[i];
    CHECK(std::abs(yi - pipeoffload::ops::gelu(x[i])) <= Traits::tolerance * (1 + std::abs(yi)));
    CHECK(std::abs(dxi - dy[i] * pipeoffload::ops::gelu_grad(x[i])) <= Traits::tolerance * (1 + std::abs(dxi)));
  }
  for (pb::Block b : {bx, by, bdy, bdx}) dev->device_free(b);
}

/// A device buffer of `n` floats holding `values`, and its span (the optimizer operations
/// take spans of device memory).
template <class Dev>
std::span<float> device_floats(Dev& dev, std::vector<pb::Block>& owned, const std::vector<float>& values) {
  owned.push_back(dev.device_alloc(values.size() * sizeof(float), pb::Memory::optimizer));
  dev.upload(owned.back().ptr, values.data(), values.size() * sizeof(float));
  return {reinterpret_cast<float*>(owned.back().ptr), values.size()};
}
template <class Dev>
std::vector<float> host_floats(Dev& dev, std::span<const float> device) {
  std::vector<float> out(device.size());
  dev.download(out.data(), device.data(), device.size_bytes());
  return out;
}

/// Element-wise agreement with the host reference: exact on the CPU, within `tol` (an FMA
/// contracted or not) relative on a GPU; a NaN never agrees.
inline void check_floats(const char* what, const std::vector<float>& got, const std::vector<float>& want, float tol) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size() && bad < 10; ++i)
    if (!(std::abs(got[i] - want[i]) <= tol * (1 + std::abs(want[i])))) {
      ++bad;
      FAIL_CHECK(what << "[" << i << "]: got " << got[i] << ", want " << want[i]);
    }
}

/// The between-steps operations: upload/download, per-group sums of squares (written into
/// `out` by the next synchronize), multi-tensor AdamW. fp32 arithmetic is exact on the CPU and
/// within `fp32_tolerance` (an FMA contracted or not) on a GPU; the fp64 sums within 1e-9
/// relative (another summation order).
template <class Traits>
void optimizer_operations() {
  namespace up = pipeoffload::update;
  auto dev = Traits::make();
  const std::size_t n = 250007;
  std::vector<float> p(n), g(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = std::sin(0.01f * static_cast<float>(i));
    g[i] = 0.1f * std::cos(0.013f * static_cast<float>(i)) - 0.02f;
    m[i] = 0.01f * static_cast<float>(i % 5);
    v[i] = 1e-4f * static_cast<float>(i % 3);
  }
  std::vector<pb::Block> owned;
  const std::span<float> dp = device_floats(*dev, owned, p), dg = device_floats(*dev, owned, g);
  const std::span<float> dm = device_floats(*dev, owned, m), dv = device_floats(*dev, owned, v);
  CHECK(host_floats(*dev, dg) == g);
  // Sums of squares over three groups, one of them empty, twice (two calls before one wait).
  const std::vector<std::size_t> groups{5000, 0, n - 5000}, two{n / 2, n - n / 2};
  std::vector<double> sums(3, -1.0), sums2(2, -1.0);
  dev->sum_squares(dg, groups, sums);
  dev->sum_squares(dg, two, sums2);
  dev->synchronize();
  const auto squares = [&](std::size_t from, std::size_t to) {
    double want = 0;
    for (std::size_t i = from; i < to; ++i) want += static_cast<double>(g[i]) * g[i];
    return want;
  };
  std::size_t off = 0;
  for (std::size_t k = 0; k < groups.size(); ++k) {
    const double want = squares(off, off + groups[k]);
    off += groups[k];
    CAPTURE(k);
    CHECK(std::abs(sums[k] - want) <= 1e-9 * want);
  }
  CHECK(std::abs(sums2[0] - squares(0, n / 2)) <= 1e-9 * sums2[0]);
  CHECK(std::abs(sums2[1] - squares(n / 2, n)) <= 1e-9 * sums2[1]);
  // AdamW over 100 segments (more than one launch takes) of seeded sizes, some empty, some
  // longer than a block's tile, each with its own lr and weight decay, every other one writing
  // a bfloat16 working copy; against update::adamw on the host. The gradients are only read.
  const std::size_t words = n;
  pb::Block work = dev->device_alloc(words * sizeof(std::uint16_t), pb::Memory::state);
  owned.push_back(work);
  const std::vector<std::uint16_t> blank(words, 0x7fc1);  // a NaN no update writes
  dev->upload(work.ptr, blank.data(), words * sizeof(std::uint16_t));
  auto* dwork = reinterpret_cast<std::uint16_t*>(work.ptr);
  std::vector<up::Segment> segments;
  std::vector<float> want_p = p, want_m = m, want_v = v;
  std::vector<std::uint16_t> want_work = blank;
  const up::AdamWStep step{0.9f, 0.95f, 1e-8f, up::adam_bias(0.9f, 0.95f, 3), 0.5f};
  std::uint32_t seed = 12345;
  const auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (std::size_t k = 0, at = 0; k < 100 && at < n; ++k) {
    const std::size_t count = std::min<std::size_t>(n - at, k % 7 == 3 ? 0 : (k % 9 == 0 ? 9000 : next() % 3000));
    up::Segment s{dp.data() + at,
                  dg.data() + at,
                  dm.data() + at,
                  dv.data() + at,
                  k % 2 == 0 ? dwork + at : nullptr,
                  count,
                  1e-3f * static_cast<float>(1 + k % 4),
                  k % 3 == 0 ? 0.0f : 0.1f};
    segments.push_back(s);
    const up::AdamWParams hyper{step.beta1, step.beta2, step.eps, s.weight_decay};
    for (std::size_t i = at; i < at + count; ++i) {
      up::adamw(want_p[i], g[i] * step.grad_scale, want_m[i], want_v[i], hyper, s.lr, step.bias);
      if (s.working != nullptr) want_work[i] = pipeoffload::bf16_bits(want_p[i]);
    }
    at += count;
  }
  dev->adamw(std::span<const up::Segment>(segments), step);
  check_floats("adamw p", host_floats(*dev, dp), want_p, Traits::fp32_tolerance);
  check_floats("adamw m", host_floats(*dev, dm), want_m, Traits::fp32_tolerance);
  check_floats("adamw v", host_floats(*dev, dv), want_v, Traits::fp32_tolerance);
  std::vector<std::uint16_t> got_work(words);
  dev->download(got_work.data(), work.ptr, words * sizeof(std::uint16_t));
  std::size_t bad_words = 0;
  for (std::size_t i = 0; i < words; ++i) {
    const bool both_blank = got_work[i] == 0x7fc1 && want_work[i] == 0x7fc1;
    if (!both_blank && (Traits::fp32_tolerance == 0.0f
                            ? got_work[i] != want_work[i]
                            : std::abs(pipeoffload::bf16_value(got_work[i]) - pipeoffload::bf16_value(want_work[i])) >
                                  1e-2f * std::abs(pipeoffload::bf16_value(want_work[i]))))
      ++bad_words;
  }
  CHECK(bad_words == 0);
  CHECK(host_floats(*dev, dg) == g);
  // A segment without its state is refused, naming it.
  std::vector<up::Segment> broken(segments.begin(), segments.begin() + 2);
  broken[1].count = 5;
  broken[1].state1 = nullptr;
  CHECK_THROWS_WITH_AS(dev->adamw(std::span<const up::Segment>(broken), step), doctest::Contains("segment 1 of 2"),
                       pipeoffload::error);
  for (pb::Block b : owned) dev->device_free(b);
}

/// hold(stream): a between-steps operation (zero) waits for the stream's work before the hold,
/// not for what it is given after (ZeRO-1's gather left running); release() makes the next one
/// wait for all of it again. The order shows in the bytes: a zero behind a copy leaves zeros,
/// one ahead of it leaves the copy's ones.
template <class Traits>
void hold_and_release() {
  auto dev = Traits::make();
  const int s = dev->make_stream("comm");
  const std::size_t n = 4096;
  const std::vector<unsigned char> ones(n, 1);
  pb::Block src = dev->device_alloc(n, pb::Memory::state), before = dev->device_alloc(n, pb::Memory::state),
            after = dev->device_alloc(n, pb::Memory::state), again = dev->device_alloc(n, pb::Memory::state);
  dev->upload(src.ptr, ones.data(), n);
  const auto copy_to = [&](pb::Block dst) {
    dev->launch(s, [&, dst] {
      auto ctx = dev->context(s);
      dev->copy(ctx, dst.ptr, src.ptr, n);
    });
  };
  dev->launch(s, [&] { Traits::delay(dev->context(s)); });
  copy_to(before);
  dev->hold(s);
  dev->hold(s);  // a second hold keeps the first point
  for (int i = 0; i < 4; ++i) dev->launch(s, [&] { Traits::delay(dev->context(s)); });
  copy_to(after);
  dev->zero(before.ptr, n);  // behind the copy before the hold
  dev->zero(after.ptr, n);   // ahead of the copy after it (four delays later)
  dev->release();
  dev->launch(s, [&] { Traits::delay(dev->context(s)); });
  copy_to(again);
  dev->zero(again.ptr, n);  // released: behind every copy
  dev->synchronize();
  const auto all = [&](pb::Block b, unsigned char v) {
    std::vector<unsigned char> got(n);
    dev->download(got.data(), b.ptr, n);
    return std::all_of(got.begin(), got.end(), [v](unsigned char x) { return x == v; });
  };
  CHECK(all(before, 0));
  CHECK(all(after, 1));
  CHECK(all(again, 0));
  for (pb::Block b : {src, before, after, again}) dev->device_free(b);
}

/// zero(device, bytes) clears exactly the bytes asked for, at any offset and length.
template <class Traits>
void zero_clears_a_range() {
  auto dev = Traits::make();
  const std::size_t n = 4099;
  std::vector<unsigned char> pattern(n);
  for (std::size_t i = 0; i < n; ++i) pattern[i] = static_cast<unsigned char>(i * 37 + 1) | 1u;  // never 0
  pb::Block b = dev->device_alloc(n, pb::Memory::state);
  dev->upload(b.ptr, pattern.data(), n);
  const std::size_t from = 3, len = 1001;  // unaligned start and length
  dev->zero(b.ptr + from, len);
  dev->zero(b.ptr, 0);  // nothing
  std::vector<unsigned char> got(n);
  dev->download(got.data(), b.ptr, n);
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(got[i] == (i >= from && i < from + len ? 0 : pattern[i]));
  }
  dev->device_free(b);
}

/// flag_nonfinite on a tensor of `words` raw values of `dtype`, in stream order on a
/// compute stream, starting from `initial`; returns the flag.
template <class Dev, class Word>
std::uint32_t nonfinite_flag(Dev& dev, int stream, const std::vector<Word>& words, pipeoffload::DType dtype,
                             std::uint32_t initial = 0) {
  pb::Block data = dev.device_alloc(std::max<std::size_t>(1, words.size() * sizeof(Word)), pb::Memory::message);
  pb::Block flag = dev.device_alloc(sizeof(std::uint32_t), pb::Memory::state);
  if (!words.empty()) dev.upload(data.ptr, words.data(), words.size() * sizeof(Word));
  dev.zero(flag.ptr, sizeof(std::uint32_t));
  if (initial != 0) dev.upload(flag.ptr, &initial, sizeof initial);
  dev.launch(stream, [&] {
    auto ctx = dev.context(stream);
    dev.flag_nonfinite(ctx, pipeoffload::ConstTensor{data.ptr, words.size(), dtype},
                       reinterpret_cast<std::uint32_t*>(flag.ptr));
  });
  dev.synchronize();
  std::uint32_t out = 7;
  dev.download(&out, flag.ptr, sizeof out);
  dev.device_free(data);
  dev.device_free(flag);
  return out;
}

/// A tensor of n finite values of a type with one word replaced by `bad` at position `at`.
template <class Word>
std::vector<Word> with_word(std::size_t n, Word finite, std::size_t at, Word bad) {
  std::vector<Word> w(n, finite);
  w[at] = bad;
  return w;
}

/// flag_nonfinite sets the flag for a NaN, +Inf or -Inf anywhere in a float32, bfloat16,
/// float16 or float64 tensor, never for finite values (the largest, denormals, -0), never for
/// integers, and never clears a flag already set.
template <class Traits>
void nonfinite_flags() {
  using pipeoffload::DType;
  auto dev = Traits::make();
  const int s = dev->make_stream("compute");
  const std::size_t n = 100003;  // several grid-stride rounds on a GPU
  for (std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
    CAPTURE(at);
    // float32: NaN, +Inf, -Inf; finite: 1.0, the largest float, a denormal, -0.
    for (std::uint32_t bad : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7f800000u, 0xff800000u}) {
      CAPTURE(bad);
      CHECK(nonfinite_flag(*dev, s, with_word<std::uint32_t>(n, 0x3f800000u, at, bad), DType::float32) == 1);
    }
    for (std::uint32_t finite : {0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x80000000u})
      CHECK(nonfinite_flag(*dev, s, with_word<std::uint32_t>(n, 0x3f800000u, at, finite), DType::float32) == 0);
    // bfloat16 (the top half of a float32): NaN, +Inf, -Inf; finite: the largest, a denormal.
    for (std::uint16_t bad :
         {std::uint16_t{0x7fc0}, std::uint16_t{0x7f80}, std::uint16_t{0xff80}, std::uint16_t{0xffc1}})
      CHECK(nonfinite_flag(*dev, s, with_word<std::uint16_t>(n, 0x3f80, at, bad), DType::bfloat16) == 1);
    for (std::uint16_t finite : {std::uint16_t{0x7f7f}, std::uint16_t{0xff7f}, std::uint16_t{0x0001}})
      CHECK(nonfinite_flag(*dev, s, with_word<std::uint16_t>(n, 0x3f80, at, finite), DType::bfloat16) == 0);
    // float16 and float64.
    CHECK(nonfinite_flag(*dev, s, with_word<std::uint16_t>(n, 0x3c00, at, std::uint16_t{0x7c00}), DType::float16) == 1);
    CHECK(nonfinite_flag(*dev, s, with_word<std::uint16_t>(n, 0x3c00, at, std::uint16_t{0x7bff}), DType::float16) == 0);
    CHECK(nonfinite_flag(*dev, s, with_word<std::uint64_t>(n, 0x3ff0000000000000ull, at, 0xfff0000000000000ull),
                         DType::float64) == 1);
    CHECK(nonfinite_flag(*dev, s, with_word<std::uint64_t>(n, 0x3ff0000000000000ull, at, 0x7fefffffffffffffull),
                         DType::float64) == 0);
    // Integers whose bits would be a float's NaN have nothing to check.
    CHECK(nonfinite_flag(*dev, s, with_word<std::uint32_t>(n, 1u, at, 0x7fc00000u), DType::int32) == 0);
  }
  // A finite tensor leaves a flag that is already set; an empty one does nothing.
  CHECK(nonfinite_flag(*dev, s, std::vector<std::uint32_t>(n, 0x3f800000u), DType::float32, 1) == 1);
  CHECK(nonfinite_flag(*dev, s, std::vector<std::uint32_t>{}, DType::float32) == 0);
}

/// sgd against update::sgd on the host: plain SGD without a buffer, momentum with dampening,
/// Nesterov, L2 weight decay, and the buffer's first step (set to the gradient) followed by a
/// second (decayed); gradients scaled by grad_scale and left as they are.
template <class Traits>
void sgd_updates() {
  namespace up = pipeoffload::update;
  auto dev = Traits::make();
  const std::size_t n = 10007;
  std::vector<float> p0(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = std::sin(0.02f * static_cast<float>(i)) + 0.1f;
    g[i] = 0.2f * std::cos(0.007f * static_cast<float>(i)) - 0.05f;
  }
  struct Case {
    const char* name;
    up::SgdParams hyper;
  };
  const Case cases[] = {
      {"plain", {0.0f, 0.0f, false, 0.0f}},
      {"plain with weight decay", {0.0f, 0.0f, false, 0.01f}},
      {"momentum with dampening and weight decay", {0.9f, 0.1f, false, 0.01f}},
      {"Nesterov", {0.9f, 0.0f, true, 0.0f}},
      {"Nesterov with weight decay", {0.8f, 0.0f, true, 0.05f}},
  };
  const float lr = 0.05f, scale = 0.5f;
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const bool momentum = c.hyper.momentum != 0.0f;
    std::vector<pb::Block> owned;
    const std::span<float> dp = device_floats(*dev, owned, p0), dg = device_floats(*dev, owned, g);
    // Without momentum the buffer is absent (an empty span), as po::Sgd passes it.
    const std::span<float> dbuf =
        momentum ? device_floats(*dev, owned, std::vector<float>(n, 123.0f)) : std::span<float>{};
    std::vector<float> want_p = p0, want_buf(n, 123.0f);
    // Two segments (the second with twice the learning rate), as po::Sgd passes a chunk.
    const std::size_t half = n / 2;
    up::Segment seg[2] = {{dp.data(), dg.data(), momentum ? dbuf.data() : nullptr, nullptr, nullptr, half, lr, 0},
                          {dp.data() + half, dg.data() + half, momentum ? dbuf.data() + half : nullptr, nullptr,
                           nullptr, n - half, 2 * lr, 0}};
    for (up::Segment& x : seg) x.weight_decay = c.hyper.weight_decay;
    for (bool first : {true, false}) {
      CAPTURE(first);
      dev->sgd(std::span<const up::Segment>(seg),
               up::SgdStep{c.hyper.momentum, c.hyper.dampening, c.hyper.nesterov, first, scale});
      float unused = 0;
      for (std::size_t i = 0; i < n; ++i)
        up::sgd(want_p[i], g[i] * scale, momentum ? want_buf[i] : unused, c.hyper, i < half ? lr : 2 * lr, first);
      check_floats("sgd p", host_floats(*dev, dp), want_p, Traits::fp32_tolerance);
      if (momentum) check_floats("sgd buf", host_floats(*dev, dbuf), want_buf, Traits::fp32_tolerance);
      CHECK(host_floats(*dev, dg) == g);
    }
    // Momentum needs its buffer; without momentum there is none.
    up::Segment wrong = seg[0];
    wrong.state0 = momentum ? nullptr : dp.data();
    CHECK_THROWS_AS(dev->sgd(std::span<const up::Segment>(&wrong, 1),
                             up::SgdStep{c.hyper.momentum, c.hyper.dampening, c.hyper.nesterov, false, scale}),
                    pipeoffload::error);
    for (pb::Block b : owned) dev->device_free(b);
  }
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
  dev->launch(a, [&] { Traits::delay(dev->context(a)); });
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

/// backend::reduces_gradients: exact_add, exact_sum and exact_round in a stream's order give the
/// bits of backend/exact.hpp's functions on the host (the CPU backend's loops).
template <class Traits>
void exact_sums() {
  namespace ex = pipeoffload::exact;
  auto dev = Traits::make();
  const int s = dev->make_stream("s");
  const std::size_t n = 4099, terms = 6, parts = 2;
  std::vector<std::vector<float>> g(terms, std::vector<float>(n));
  for (std::size_t k = 0; k < terms; ++k)
    for (std::size_t i = 0; i < n; ++i)
      g[k][i] = std::ldexp(std::sin(0.37f * static_cast<float>(i * (k + 1)) + 0.1f), static_cast<int>(i % 61) - 40);
  pb::Block acc = dev->device_alloc(n * parts * sizeof(ex::Fixed), pb::Memory::state);
  pb::Block total = dev->device_alloc(n * sizeof(ex::Fixed), pb::Memory::state);
  std::vector<pb::Block> owned;
  const std::span<float> dg = device_floats(*dev, owned, std::vector<float>(n, 0.0f));
  const std::span<float> out = device_floats(*dev, owned, std::vector<float>(n, 0.0f));
  dev->zero(acc.ptr, acc.bytes);
  auto* a = reinterpret_cast<ex::Fixed*>(acc.ptr);
  auto* t = reinterpret_cast<ex::Fixed*>(total.ptr);
  std::vector<ex::Fixed> want_part(n * parts, 0);
  for (std::size_t k = 0; k < terms; ++k) {
    dev->upload(dg.data(), g[k].data(), n * sizeof(float));
    const std::size_t p = k % parts;
    dev->launch(s, [&, p] {
      auto ctx = dev->context(s);
      dev->exact_add(ctx, std::span<ex::Fixed>(a + p * n, n), std::span<const float>(dg));
    });
    dev->synchronize();
    for (std::size_t i = 0; i < n; ++i) ex::add(want_part[p * n + i], g[k][i]);
  }
  dev->launch(s, [&] {
    auto ctx = dev->context(s);
    dev->exact_sum(ctx, std::span<ex::Fixed>(t, n), std::span<const ex::Fixed>(a, n * parts));
    dev->exact_round(ctx, out, std::span<const ex::Fixed>(t, n));
  });
  dev->synchronize();
  const std::vector<float> got = host_floats(*dev, out);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float want = ex::to_float(ex::sum(want_part[i], want_part[n + i]));
    differ += std::memcmp(&want, &got[i], sizeof want) != 0;
  }
  CHECK(differ == 0);
  // Sums past 64 bits whose rounding a bit below the 64 the conversion keeps decides (a
  // 128-bit conversion through double would round the first to even, not up).
  const ex::Fixed one = 1;
  const std::vector<ex::Fixed> edge = {(one << 100) + (one << 76) + 1, -((one << 100) + (one << 76) + 1),
                                       (one << 100) + (one << 76),     (one << 120) + (one << 96) + (one << 30),
                                       (one << 70) + (one << 46) + 1,  (one << 126) - 1};
  pb::Block e = dev->device_alloc(edge.size() * sizeof(ex::Fixed), pb::Memory::state);
  dev->upload(e.ptr, edge.data(), edge.size() * sizeof(ex::Fixed));
  dev->launch(s, [&] {
    auto ctx = dev->context(s);
    dev->exact_round(ctx, out.first(edge.size()),
                     std::span<const ex::Fixed>(reinterpret_cast<const ex::Fixed*>(e.ptr), edge.size()));
  });
  dev->synchronize();
  const std::vector<float> rounded = host_floats(*dev, out);
  for (std::size_t i = 0; i < edge.size(); ++i) {
    CAPTURE(i);
    const float want = ex::to_float(edge[i]);
    CHECK(std::memcmp(&want, &rounded[i], sizeof want) == 0);
  }
  dev->device_free(e);
  dev->device_free(acc);
  dev->device_free(total);
  for (pb::Block b : owned) dev->device_free(b);
}

/// backend::reduces_gradients: sum_parts in a stream's order adds the parts in their order in
/// fp32, as a plain host loop does, bit for bit (the standard path's reduce-scatter); over
/// bfloat16 parts (the bfloat16 reduce-scatter) it widens each first, and to_bf16 rounds as
/// po::bf16_bits does.
template <class Traits>
void sum_parts() {
  auto dev = Traits::make();
  const int s = dev->make_stream("s");
  const std::size_t n = 4099, parts = 5;
  std::vector<float> host(n * parts);
  for (std::size_t i = 0; i < host.size(); ++i)
    host[i] = std::ldexp(std::sin(0.61f * static_cast<float>(i) + 0.3f), static_cast<int>(i % 29) - 10);
  std::vector<pb::Block> owned;
  const std::span<float> in = device_floats(*dev, owned, host);
  const std::span<float> out = device_floats(*dev, owned, std::vector<float>(n, 0.0f));
  const std::span<float> out16 = device_floats(*dev, owned, std::vector<float>(n, 0.0f));
  owned.push_back(dev->device_alloc(host.size() * sizeof(std::uint16_t), pb::Memory::optimizer));
  const std::span<std::uint16_t> narrow(reinterpret_cast<std::uint16_t*>(owned.back().ptr), host.size());
  dev->launch(s, [&] {
    auto ctx = dev->context(s);
    dev->sum_parts(ctx, out, std::span<const float>(in));
    dev->to_bf16(ctx, narrow, std::span<const float>(in));
    dev->sum_parts(ctx, out16, std::span<const std::uint16_t>(narrow));
  });
  dev->synchronize();
  std::vector<std::uint16_t> bits(host.size());
  dev->download(bits.data(), narrow.data(), narrow.size_bytes());
  std::size_t wrong_bits = 0;
  for (std::size_t i = 0; i < host.size(); ++i) wrong_bits += bits[i] != pipeoffload::bf16_bits(host[i]);
  CHECK(wrong_bits == 0);
  const auto differ = [&](std::span<const float> device, auto&& value) {
    const std::vector<float> got = host_floats(*dev, device);
    std::size_t count = 0;
    for (std::size_t i = 0; i < n; ++i) {
      volatile float want = value(i);  // one rounding per addition, in part order
      for (std::size_t k = 1; k < parts; ++k) want = want + value(k * n + i);
      const float w = want;
      count += std::memcmp(&w, &got[i], sizeof w) != 0;
    }
    return count;
  };
  CHECK(differ(out, [&](std::size_t i) { return host[i]; }) == 0);
  CHECK(differ(out16, [&](std::size_t i) { return pipeoffload::bf16_value(pipeoffload::bf16_bits(host[i])); }) == 0);
  for (pb::Block b : owned) dev->device_free(b);
}

}  // namespace conformance

/// Registers the cases for one backend; `name` goes into the test names.
#define PIPEOFFLOAD_CONFORMANCE_CASES(Traits, name)                                                                 \
  TEST_CASE(name ": blocks are pooled by size and reused across streams without new allocations") {                 \
    conformance::allocation_and_reuse<Traits>();                                                                    \
  }                                                                                                                 \
  TEST_CASE(name ": reset_arena gives every block back and forgets the reservations once nothing is handed out") {  \
    conformance::arena_reset<Traits>();                                                                             \
  }                                                                                                                 \
  TEST_CASE(name ": an upload is enqueued behind the streams' work and waits only when the staging is full") {      \
    conformance::staged_uploads<Traits>();                                                                          \
  }                                                                                                                 \
  TEST_CASE(name ": a wait orders one stream after another stream's record") {                                      \
    conformance::event_ordering<Traits>(false);                                                                     \
  }                                                                                                                 \
  TEST_CASE(name ": a pass that waits for another stream's record sees its write (wait_in_pass)") {                 \
    conformance::event_ordering<Traits>(true);                                                                      \
  }                                                                                                                 \
  TEST_CASE(name ": an offload into power-of-two bins and its reload give back every byte") {                       \
    conformance::copy_round_trip<Traits>();                                                                         \
  }                                                                                                                 \
  TEST_CASE(name ": a stage's forward and backward match models/gpt/math.hpp") {                                    \
    conformance::stage_forward_backward<Traits>();                                                                  \
  }                                                                                                                 \
  TEST_CASE(name                                                                                                    \
            ": sums of squares by the next wait, multi-tensor AdamW with working copies, gradients as they are") {  \
    conformance::optimizer_operations<Traits>();                                                                    \
  }                                                                                                                 \
  TEST_CASE(name ": zero clears exactly the bytes asked for") { conformance::zero_clears_a_range<Traits>(); }       \
  TEST_CASE(name ": a between-steps operation waits for a held stream up to its hold only, until release") {        \
    conformance::hold_and_release<Traits>();                                                                        \
  }                                                                                                                 \
  TEST_CASE(name ": flag_nonfinite flags NaN and infinities of every floating type, nothing finite, no integers") { \
    conformance::nonfinite_flags<Traits>();                                                                         \
  }                                                                                                                 \
  TEST_CASE(name ": sgd matches update::sgd with momentum, dampening, Nesterov, weight decay and the first step") { \
    conformance::sgd_updates<Traits>();                                                                             \
  }                                                                                                                 \
  TEST_CASE(name ": a counter orders one stream after another; an aborted counter releases its waiters") {          \
    conformance::pair_counters<Traits>();                                                                           \
  }                                                                                                                 \
  TEST_CASE(name ": exact gradient sums in a stream's order give backend/exact.hpp's bits") {                       \
    conformance::exact_sums<Traits>();                                                                              \
  }                                                                                                                 \
  TEST_CASE(name ": sum_parts adds the replicas' fp32 or bfloat16 parts in their order in fp32, bit for bit") {     \
    conformance::sum_parts<Traits>();                                                                               \
  }
