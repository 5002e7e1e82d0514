// tests/runtime: po::Runtime on backend::Cpu with thread ranks: bit-exactness against a
// one-rank run for every schedule family, failure propagation, memory against the simulator,
// and the pieces (host bins, communicator tags, backend events).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "tanh_layer.hpp"

namespace {

using po::Family;
using GK = po::GroupSpec::Kind;
namespace off = po::offload;

struct Case {
  const char* name;
  po::ScheduleSpec spec;
  po::Shape shape;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The one-rank reference of a run: the same S stages, all on rank 0, in GIS order.
test::Run reference(test::Config c) {
  c.shape = {1, c.shape.stages(), c.shape.m};
  c.spec = po::parse_schedule("gis");
  c.copy_bytes_per_second = 0;
  c.timing = {};
  return test::train_within(c, 120);
}

/// Trains `c` and its one-rank reference and checks that the run fails nowhere and ends with the
/// reference's losses and parameters, bit for bit; returns the run for further checks.
test::Run trains_like_reference(const test::Config& c) {
  const test::Run ref = reference(c);
  test::Run run = test::train_within(c, 120);
  for (const std::string& e : run.errors) REQUIRE(e == "");
  CHECK(same_bits(run.losses, ref.losses));
  for (int s = 0; s < c.shape.stages(); ++s) {
    CAPTURE(s);
    CHECK(same_bits(run.params[static_cast<std::size_t>(s)], ref.params[static_cast<std::size_t>(s)]));
  }
  return run;
}

}  // namespace

TEST_CASE("every family trains bit-identically to a one-rank sequential run (3 steps: losses and parameters)") {
  const std::vector<Case> cases = {
      {"1f1b", po::parse_schedule("1f1b"), {2, 1, 4}},
      {"1f1b", po::parse_schedule("1f1b"), {4, 1, 6}},
      {"1f1b-i", po::parse_schedule("1f1b-i"), {2, 2, 4}},
      {"1f1b-i", po::parse_schedule("1f1b-i"), {3, 3, 6}},
      {"gis", po::parse_schedule("gis"), {2, 2, 4}},
      {"gis", po::parse_schedule("gis"), {4, 2, 7}},
      {"gis-g", po::parse_schedule("gis-g", 3), {4, 2, 8}},
      {"gis-g", po::parse_schedule("gis-g", 3), {5, 2, 6}},
      {"gis-h", po::parse_schedule("gis-h"), {4, 2, 8}},
      {"gis-h", po::parse_schedule("gis-h"), {3, 3, 5}},
      {"po", po::parse_schedule("po"), {4, 2, 8}},
      {"po", po::parse_schedule("po"), {2, 3, 5}},
      {"po-h", po::parse_schedule("po-h"), {4, 2, 8}},
      {"po-h", po::parse_schedule("po-h"), {2, 4, 6}},
      {"po-f", po::parse_schedule("po-f"), {4, 2, 8}},
      {"po-f", po::parse_schedule("po-f"), {3, 2, 4}},
      {"gis-h + offload first 1", {Family::grouped, {GK::half, 0}, off::first(1)}, {4, 2, 8}},
      {"1f1b-i + offload all", {Family::interleaved_1f1b, {}, off::all}, {2, 2, 4}},
  };
  for (const Case& k : cases) {
    CAPTURE(k.name);
    CAPTURE(k.shape.d);
    CAPTURE(k.shape.v);
    CAPTURE(k.shape.m);
    test::Config c;
    c.spec = k.spec;
    c.shape = k.shape;
    const test::Run ref = reference(c);
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    for (const std::string& e : ref.errors) REQUIRE(e == "");
    CHECK(same_bits(run.losses, ref.losses));
    CHECK(run.grad_norms == ref.grad_norms);
    for (int s = 0; s < k.shape.stages(); ++s) {
      CAPTURE(s);
      CHECK(same_bits(run.params[static_cast<std::size_t>(s)], ref.params[static_cast<std::size_t>(s)]));
    }
    // The loss moves (the test would be vacuous if nothing trained).
    CHECK(run.losses.front() != run.losses.back());
  }
}

TEST_CASE("offload with a rate-limited copy engine still trains bit-identically") {
  test::Config c;
  c.spec = po::parse_schedule("po-f");
  c.shape = {2, 2, 6};
  c.copy_bytes_per_second = 20e6;  // ~40 us per unit: copies overlap compute for real
  const test::Run run = trains_like_reference(c);
  // Every offloaded unit went through host bins and came back.
  CHECK(run.memory[0].host_peak > 0);
  CHECK(run.memory[0].host_in_use == 0);
}

TEST_CASE("two copy streams (offloads and reloads apart) train bit-identically, paced or not, paired slots or not") {
  for (const char* name : {"po-f", "po-h", "po"})
    for (const po::Shape sh : {po::Shape{1, 4, 6}, po::Shape{2, 2, 6}, po::Shape{3, 2, 5}})
      for (const double rate : {0.0, 20e6})
        for (const bool stagger : {true, false}) {
          CAPTURE(name);
          CAPTURE(sh.d);
          CAPTURE(rate);
          CAPTURE(stagger);
          test::Config c;
          c.spec = po::parse_schedule(name);
          c.shape = sh;
          c.copy_bytes_per_second = rate;
          c.costs.copy_streams = 2;
          c.costs.stagger_pairs = stagger;
          c.steps = 2;
          CHECK(trains_like_reference(c).memory[0].host_in_use == 0);
        }
  // A rank with a PCIe partner gains nothing from a second stream, and the pairs' counters
  // count copies in order: refused.
  po::comm::ThreadsWorld world(2);
  po::Costs two;
  two.copy_streams = 2;
  const po::Program p = po::build(po::parse_schedule("po-f"), {2, 1, 4}, two);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<test::TanhLayer> layers;
    layers.emplace_back(r, 4, 1, test::Timing{}, nullptr, r);
    po::Runtime rt(p, dev, comm, std::span<test::TanhLayer>(layers), {.microbatch = {1, 1}});
    po::PairLink<po::backend::Cpu> link;
    rt.pair_with(link);
  });
  CHECK(errors[0] ==
        "po::Runtime::pair_with: the schedule runs two copy streams (Costs::copy_streams = 2), whose copies end out "
        "of order, and the pairs' counters count them in order; a rank with a PCIe partner gains nothing from a "
        "second stream (its partner's copies fill the other direction's slots): plan it with one");
}

namespace {

/// backend::Cpu with wait polls, as backend::Cuda has them, and counters that count
/// keep_aborted calls (backend::Cuda's Counter::keep_aborted raises an aborted counter back).
struct PollingCpu : po::backend::Cpu {
  using Cpu::Cpu;
  struct Counter : po::backend::Cpu::Counter {
    std::atomic<int> kept{0};
    void keep_aborted() { ++kept; }
  };
  std::vector<std::pair<int, std::function<void()>>> polls;
  int next_poll = 0;
  int add_wait_poll(std::function<void()> f) {
    polls.emplace_back(next_poll, std::move(f));
    return next_poll++;
  }
  void remove_wait_poll(int id) {
    std::erase_if(polls, [id](const auto& p) { return p.first == id; });
  }
};

}  // namespace

TEST_CASE(
    "pair_with: where the backend polls while it waits, a poll keeps an abort of the pair's counters in force; the "
    "runtime removes it when it goes") {
  po::comm::ThreadsWorld world(2);
  const po::Program p = po::build(po::parse_schedule("po-f"), {2, 1, 4});
  po::PairLink<PollingCpu> link;
  std::vector<std::size_t> during(2), after(2);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    PollingCpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<test::TanhLayer> layers;
    layers.emplace_back(r, 4, 1, test::Timing{}, nullptr, r);
    {
      po::Runtime rt(p, dev, comm, std::span<test::TanhLayer>(layers), {.microbatch = {1, 1}});
      rt.pair_with(link);
      during[static_cast<std::size_t>(r)] = dev.polls.size();
      for (const auto& [id, poll] : dev.polls) poll();
    }
    after[static_cast<std::size_t>(r)] = dev.polls.size();
  });
  for (const std::string& e : errors) CHECK(e == "");
  CHECK(during == std::vector<std::size_t>{1, 1});
  CHECK(after == std::vector<std::size_t>{0, 0});
  CHECK(link.side[0].kept == 2);  // each rank's poll keeps both counters
  CHECK(link.side[1].kept == 2);
}

TEST_CASE("reloads in parts (saved_parts) train bit-identically, on one copy stream or two, paced or not") {
  for (const char* name : {"po-f", "po-h"})
    for (const po::Shape sh : {po::Shape{1, 4, 6}, po::Shape{2, 2, 6}})
      for (const double rate : {0.0, 20e6})
        for (const int streams : {1, 2}) {
          CAPTURE(name);
          CAPTURE(sh.d);
          CAPTURE(rate);
          CAPTURE(streams);
          test::Config c;
          c.spec = po::parse_schedule(name);
          c.shape = sh;
          c.copy_bytes_per_second = rate;
          c.costs.copy_streams = streams;
          c.costs.reload_shares.assign(static_cast<std::size_t>(sh.stages()), {0.4, 0.4, 0.2});
          c.parts = true;
          c.steps = 2;
          CHECK(trains_like_reference(c).memory[0].host_in_use == 0);
        }
}

TEST_CASE("a B whose unit reloads in parts starts once the first part is back, not after the whole reload") {
  // Paced copies of ~30 ms a part (y, x, and on some stages a pad): a B that waits for the
  // whole unit starts after its reload ends; one that waits for the first part starts about
  // 30 ms before.
  const auto early_bs = [](bool reload_parts) {
    test::Config c;
    c.spec = po::parse_schedule("po-f");
    c.shape = {1, 4, 4};
    c.h = 64;
    c.copy_bytes_per_second = 51200;  // a (T = 6, h = 64) fp32 tensor, 1536 bytes, in 30 ms
    c.parts = true;
    c.reload_parts = reload_parts;
    c.steps = 1;
    const test::Run run = test::train_within(c, 120);
    for (const std::string& e : run.errors) REQUIRE(e == "");
    const po::RankProgram& rp = run.program.ranks[0];
    const po::RankSim& t = run.traces[0];
    int early = 0, reloaded = 0;
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const po::Op& b = rp.compute[x];
      if (b.kind != po::OpKind::B) continue;
      for (std::size_t y = 0; y < rp.copy.size(); ++y) {
        const po::Op& r = rp.copy[y];
        if (r.kind != po::OpKind::R || r.stage != b.stage || r.mb != b.mb) continue;
        ++reloaded;
        CHECK(t.compute_end[x] >= t.copy_end[y]);  // a B never ends before its reload
        if (t.compute_start[x] < t.copy_end[y] - 0.010) ++early;
      }
    }
    REQUIRE(reloaded > 0);
    return std::pair{early, reloaded};
  };
  const auto [whole, n1] = early_bs(false);
  const auto [parts, n2] = early_bs(true);
  CHECK(whole == 0);
  CHECK(parts > 0);
  CHECK(n1 == n2);
}

TEST_CASE("saved_parts is checked: it tiles the saved buffer, and B awaits every part") {
  struct Parts : test::TanhLayer {
    using TanhLayer::TanhLayer;
    std::vector<po::SavedPart> parts;
    std::vector<po::SavedPart> saved_parts(po::MicrobatchShape) const { return parts; }
  };
  // Stage 0 of width 4, one token: x (16 bytes) | y (16 bytes), no pad.
  const po::Program program = po::GIS::build({1, 1, 2});
  const auto refusal = [&](std::vector<po::SavedPart> parts) {
    po::comm::ThreadsWorld world(1);
    po::comm::Threads comm(world, 0);
    po::backend::Cpu dev;
    std::vector<Parts> one;
    one.emplace_back(0, 4, 1);
    one[0].parts = std::move(parts);
    try {
      po::Runtime rt(program, dev, comm, std::span<Parts>(one), {.microbatch = {1, 1}});
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string tail =
      " (they must tile [0, saved_bytes() = 32) in the order backward_input reads them; layer.hpp)";
  const std::string head = "po::Runtime: stage 0 (" + po::detail::type_name<Parts>() + ")'s saved_parts(): ";
  CHECK(refusal({{16, 16}, {0, 16}}) == "accepted");
  CHECK(refusal({{16, 16}, {0, 20}}) == head + "two parts overlap at byte 16" + tail);
  CHECK(refusal({{16, 16}, {0, 8}}) == head + "bytes [8, 16) are in no part" + tail);
  CHECK(refusal({{0, 16}}) == head + "bytes [16, 32) are in no part" + tail);
  CHECK(refusal({{0, 32}, {32, 0}}) == head + "part 1 has 0 bytes" + tail);
  CHECK(refusal({{0, 16}, {16, 20}}) == head + "part 1 = [16, 36) runs past the buffer" + tail);

  // A B that reads a part it did not await is named (here it awaits only the first).
  po::comm::ThreadsWorld world(1);
  po::comm::Threads comm(world, 0);
  po::backend::Cpu dev;
  std::vector<test::TanhLayer> one;
  one.emplace_back(0, 4, 1);
  one[0].use_parts(false);
  po::Runtime rt(program, dev, comm, std::span<test::TanhLayer>(one), {.microbatch = {1, 1}});
  const std::vector<std::int32_t> tok(2, 1);
  po::Batch b;
  b.add("tokens", tok, {2, 1}).add("targets", tok, {2, 1});
  CHECK_THROWS_WITH(rt.forward_backward(b),
                    "rank 0, compute op 1 B(stage 0, mb 0): backward_input awaited 1 of the stage's 2 saved parts: it "
                    "must call mb.await_saved(i) for every part i of saved_parts() before it reads it (layer.hpp)");
}

TEST_CASE("PCIe pairs: a pair never copies in one direction at once, and keeps its slot order") {
  // Copies slow enough and passes short enough that an unsynchronised pair drifts off the
  // planned grid; linked, each copy of rank r starts only after rank r^1 has completed every
  // copy planned to end before it. On the staggered grid that means the pair's offloads run
  // one at a time in slot order, and so do its reloads.
  for (const char* name : {"po-f", "po-h"}) {
    CAPTURE(name);
    test::Config c;
    c.spec = po::parse_schedule(name);
    c.shape = {4, 2, 8};
    c.copy_bytes_per_second = 2e6;
    c.timing = {0.0002, 0.0002, 0.0002};
    c.pairs = true;
    const test::Run run = trains_like_reference(c);
    for (int r = 0; r < c.shape.d; r += 2) {
      CAPTURE(r);
      const po::RankSim& a = run.traces[static_cast<std::size_t>(r)];
      const po::RankSim& b = run.traces[static_cast<std::size_t>(r + 1)];
      const auto& pa = run.program.ranks[static_cast<std::size_t>(r)];
      const auto& pb = run.program.ranks[static_cast<std::size_t>(r + 1)];
      REQUIRE(!pa.copy.empty());
      REQUIRE(!pb.copy.empty());
      // Per direction, the pair's slots are distinct (staggered parities), so merging them
      // in slot order is a total order, and each copy starts after the previous one ended.
      for (po::OpKind dir : {po::OpKind::O, po::OpKind::R}) {
        CAPTURE(po::op_name(dir));
        std::vector<std::tuple<long long, double, double>> copies;  // (slot, start, end)
        for (std::size_t y = 0; y < pa.copy.size(); ++y)
          if (pa.copy[y].kind == dir) copies.push_back({pa.copy_slot[y], a.copy_start[y], a.copy_end[y]});
        for (std::size_t y = 0; y < pb.copy.size(); ++y)
          if (pb.copy[y].kind == dir) copies.push_back({pb.copy_slot[y], b.copy_start[y], b.copy_end[y]});
        std::sort(copies.begin(), copies.end());
        REQUIRE(copies.size() > 2);
        for (std::size_t i = 1; i < copies.size(); ++i) {
          CAPTURE(i);
          REQUIRE(std::get<0>(copies[i]) != std::get<0>(copies[i - 1]));
          CHECK(std::get<1>(copies[i]) >= std::get<2>(copies[i - 1]));
        }
      }
    }
  }
}

TEST_CASE("PCIe pairs: a failing rank releases its partner's waiting copy stream") {
  test::Failure failure;
  failure.fail_rank = 1;
  failure.fail_at = 9;
  test::Config c;
  c.spec = po::parse_schedule("po-f");
  c.shape = {4, 2, 8};
  c.copy_bytes_per_second = 2e6;
  c.pairs = true;
  c.failure = &failure;
  const test::Run run = test::train_within(c, 60);
  REQUIRE(run.errors.size() == 4);
  CHECK(run.errors[1].find("injected failure in pass 9") != std::string::npos);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(run.errors[static_cast<std::size_t>(r)].find("injected failure in pass 9") != std::string::npos);
  }
}

TEST_CASE("PCIe pairs: a rank without a partner, or unstaggered slots, is refused") {
  po::comm::ThreadsWorld world(3);
  const po::Program p3 = po::build(po::parse_schedule("po-f"), {3, 1, 4});
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<test::TanhLayer> layers;
    layers.emplace_back(r, 4, 1, test::Timing{}, nullptr, r);
    po::Runtime rt(p3, dev, comm, std::span<test::TanhLayer>(layers), {.microbatch = {1, 1}});
    po::PairLink<po::backend::Cpu> link;
    if (r == 2) rt.pair_with(link);
  });
  CHECK(errors[0] == "");
  CHECK(errors[2] == "po::Runtime::pair_with: rank 2 has no PCIe partner (rank 3 does not exist with d = 3)");
  po::comm::ThreadsWorld world2(2);
  po::Costs unstaggered;
  unstaggered.stagger_pairs = false;
  const po::Program p2 = po::build(po::parse_schedule("po-f"), {2, 1, 4}, unstaggered);
  const auto errors2 = po::run_thread_ranks(world2, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world2, r);
    std::vector<test::TanhLayer> layers;
    layers.emplace_back(r, 4, 1, test::Timing{}, nullptr, r);
    po::Runtime rt(p2, dev, comm, std::span<test::TanhLayer>(layers), {.microbatch = {1, 1}});
    po::PairLink<po::backend::Cpu> link;
    rt.pair_with(link);
  });
  CHECK(
      errors2[0] ==
      "po::Runtime::pair_with: the schedule was planned with Costs::stagger_pairs = false; pairs need staggered copy slots");
}

TEST_CASE("a rank that throws in its 5th op stops every rank with that error, naming rank and op") {
  for (const char* name : {"po-f", "1f1b-i", "gis-h"}) {
    CAPTURE(name);
    test::Failure failure;
    failure.fail_rank = 1;
    failure.fail_at = 5;
    test::Config c;
    c.spec = po::parse_schedule(name);
    c.shape = {4, 2, 8};
    c.failure = &failure;
    const test::Run run = test::train_within(c, 60);
    // The 5th pass of rank 1 is its 5th compute op (index 4) unless a fused BW came first.
    const po::Program p = po::build(c.spec, c.shape);
    const auto& ops = p.ranks[1].compute;
    int calls = 0;
    std::size_t x = 0;
    for (; x < ops.size(); ++x) {
      calls += ops[x].kind == po::OpKind::BW ? 2 : 1;
      if (calls >= 5) break;
    }
    const po::Op& op = ops[x];
    const std::string expect = "rank 1, compute op " + std::to_string(x) + " " + po::op_name(op.kind) + "(stage " +
                               std::to_string(op.stage) + ", mb " + std::to_string(op.mb) +
                               "): injected failure in pass 5";
    REQUIRE(run.errors.size() == 4);
    CHECK(run.errors[1] == expect);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      CHECK(run.errors[static_cast<std::size_t>(r)].find(expect) != std::string::npos);
    }
  }
}

TEST_CASE("a receive that meets another tag is an error naming both tags") {
  po::comm::ThreadsWorld world(2);
  std::vector<float> a(4, 1.0f), b(4, 0.0f);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::comm::Threads c(world, r);
    try {
      const po::backend::CpuContext ctx{};  // comm::Threads blocks the calling thread: any context will do
      if (r == 0)
        c.send(ctx, 1, {1, 2, po::Dir::forward}, std::as_bytes(std::span(a)));
      else
        c.recv(ctx, 0, {1, 3, po::Dir::forward}, std::as_writable_bytes(std::span(b)));
    } catch (...) {
      c.abort("peer failed");
      throw;
    }
  });
  CHECK(
      errors[1] ==
      "comm::Threads: rank 1 expected (forward, stage 1, mb 3) of 16 bytes from rank 0 but received (forward, stage 1, mb 2) of 16 bytes");
  CHECK(errors[0] == "aborted: peer failed");
  CHECK(b[0] == 0.0f);
}

TEST_CASE(
    "comm::Threads: all_gather moves any trivially copyable type; other counts or value sizes fail on every rank") {
  po::comm::ThreadsWorld world(3);
  struct Pair {
    std::int32_t rank;
    float half;
  };
  std::vector<std::vector<Pair>> pairs(3);
  std::vector<std::vector<std::byte>> bytes(3);
  const auto ok = po::run_thread_ranks(world, [&](int r) {
    po::comm::Threads c(world, r);
    const Pair mine{r, 0.5f * static_cast<float>(r)};
    pairs[static_cast<std::size_t>(r)].resize(3);
    c.all_gather(std::span<const Pair>(&mine, 1), std::span(pairs[static_cast<std::size_t>(r)]));
    const std::byte two[2] = {std::byte{7}, static_cast<std::byte>(r)};
    bytes[static_cast<std::size_t>(r)].resize(6);
    c.all_gather(std::span<const std::byte>(two), std::span(bytes[static_cast<std::size_t>(r)]));
  });
  for (std::size_t q = 0; q < 3; ++q) {
    CAPTURE(q);
    CHECK(ok[q].empty());
    for (std::size_t r = 0; r < 3; ++r) {
      CHECK(pairs[q][r].rank == static_cast<std::int32_t>(r));
      CHECK(pairs[q][r].half == 0.5f * static_cast<float>(r));
      CHECK(bytes[q][2 * r] == std::byte{7});
      CHECK(bytes[q][2 * r + 1] == static_cast<std::byte>(r));
    }
  }
  // Rank 2 contributes two values, or values of another size: the last rank to arrive throws
  // the mismatch and aborts the others with it.
  for (const bool other_size : {false, true}) {
    CAPTURE(other_size);
    po::comm::ThreadsWorld w(3);
    const auto errors = po::run_thread_ranks(w, [&](int r) {
      po::comm::Threads c(w, r);
      if (r == 2 && other_size) {
        const float one = 1;
        std::vector<float> all(3);
        c.all_gather(std::span<const float>(&one, 1), std::span(all));
      } else {
        const std::vector<double> mine(r == 2 ? 2 : 1, 1.0);
        std::vector<double> all(3 * mine.size());
        c.all_gather(std::span(mine), std::span(all));
      }
    });
    const std::string expect = other_size ? "comm::Threads::all_gather: ranks contributed values of different sizes"
                                          : "comm::Threads::all_gather: ranks contributed different counts";
    for (const std::string& e : errors) CHECK(e.find(expect) != std::string::npos);
  }
  po::comm::ThreadsWorld one(1);
  po::comm::Threads c(one, 0);
  std::vector<double> wrong(2);
  const double x = 1;
  CHECK_THROWS_WITH(c.all_gather(std::span<const double>(&x, 1), std::span(wrong)),
                    "comm::Threads::all_gather: the output holds 2 values; it must hold size() * mine.size() = 1");
}

TEST_CASE("a non-finite gradient stops the optimizer step with an error naming the stage, on every rank") {
  struct Bad : test::TanhLayer {
    using TanhLayer::TanhLayer;
    void backward_weight(po::backend::CpuContext& ctx, const po::Microbatch& mb, std::byte* saved, std::byte* stash) {
      TanhLayer::backward_weight(ctx, mb, saved, stash);
      if (mb.stage == 2) gradients()[0] = std::nanf("");
    }
    std::string name() const { return "Bad"; }
  };
  po::comm::ThreadsWorld world(2);
  const po::Shape shape{2, 2, 4};
  const po::Program program = po::build(po::parse_schedule("po"), shape);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    po::comm::Threads comm(world, r);
    std::vector<Bad> layers;
    for (int c = 0; c < 2; ++c) layers.emplace_back(shape.stage_of(r, c), 4, 1);
    po::Runtime rt(program, dev, comm, std::span<Bad>(layers), {.microbatch = {1, 2}});
    po::AdamW opt(rt);
    std::vector<std::int32_t> tok(8, 1), tgt(8, 2);
    po::Batch batch;
    batch.add("tokens", tok, {4, 2}).add("targets", tgt, {4, 2});
    const std::vector<float> before = rt.download_parameters(0);
    rt.forward_backward(batch);
    try {
      opt.step(0.1f, po::clip_scale(po::grad_norm(rt), 1.0f));
    } catch (const po::nonfinite_error&) {
      CHECK(rt.download_parameters(0) == before);  // no update was applied
      throw;
    }
  });
  for (const std::string& e : errors)
    CHECK(
        e ==
        "po::grad_norm: stage 2 (Bad on rank 0) has a non-finite gradient (norm group 0, sum of squares nan); no update should be applied");
}

TEST_CASE("bad inputs are refused with a sentence") {
  po::comm::ThreadsWorld world(1);
  po::backend::Cpu dev;
  po::comm::Threads comm(world, 0);
  const po::Program program = po::GIS::build({1, 2, 2});
  const po::RuntimeOptions opt{.microbatch = {1, 2}};
  std::vector<test::TanhLayer> one;
  one.emplace_back(0, 4, 1);
  CHECK_THROWS_WITH(po::Runtime(program, dev, comm, std::span<test::TanhLayer>(one), opt),
                    "po::Runtime: rank 0 was given 1 stages; it needs v = 2 (one per chunk)");
  std::vector<test::TanhLayer> two;
  two.emplace_back(0, 4, 1);
  two.emplace_back(1, 4, 1);
  po::comm::ThreadsWorld world2(1);  // the failure above aborted `world`
  po::comm::Threads comm2(world2, 0);
  po::Runtime rt(program, dev, comm2, std::span<test::TanhLayer>(two), opt);
  std::vector<std::int32_t> tok(3, 0);
  po::Batch wrong;
  wrong.add("tokens", tok).add("targets", tok);
  CHECK_THROWS_WITH(
      rt.forward_backward(wrong),
      "rank 0, forward_backward: po::Runtime: the step input 'tokens' holds 3 int32 values; stage 0 reads m * 2 = 4 int32 values");
  po::comm::ThreadsWorld world3(1);
  po::comm::Threads comm3(world3, 0);
  po::backend::Cpu dev3;
  po::Runtime rt3(program, dev3, comm3, std::span<test::TanhLayer>(two), opt);
  po::Batch missing;
  const std::vector<std::int32_t> four(4, 0);
  missing.add("tokens", four, {2, 2});
  CHECK_THROWS_WITH(
      rt3.forward_backward(missing),
      "rank 0, forward_backward: po::Runtime: stage 0 reads the step input 'targets', which the batch does not have (it has: tokens)");
  CHECK_THROWS_WITH(po::comm::Threads(world, 1), "comm::Threads: rank = 1 is outside the allowed range [0, 0]");
}

TEST_CASE("a Runtime from a Program built at run time equals one from the schedule type, bit for bit") {
  // Runtime<po::PO_F, Layer, Backend, Comm> builds PO_F's program itself; po::build(spec, ...)
  // builds the same schedule from a spec chosen at run time (here parsed from its name).
  const po::Shape shape{4, 2, 8};
  test::Config c;
  c.shape = shape;
  const auto run = [&](bool typed) {
    std::vector<std::vector<float>> params(static_cast<std::size_t>(shape.stages()));
    std::vector<float> losses;
    std::mutex mu;
    po::comm::ThreadsWorld world(shape.d);
    const po::Program program = po::build(po::parse_schedule("po-f"), shape);
    const auto errors = po::run_thread_ranks(world, [&](int r) {
      po::backend::Cpu dev({.rank = r});
      po::comm::Threads comm(world, r);
      std::vector<test::TanhLayer> layers;
      for (int ch = 0; ch < shape.v; ++ch) layers.emplace_back(shape.stage_of(r, ch), c.h, c.seed);
      const auto train = [&](auto& rt) {
        po::AdamW opt(rt);
        std::vector<std::int32_t> tok, tgt;
        for (int s = 0; s < 3; ++s) {
          test::make_batch(c, s, tok, tgt);
          const auto [st, norm] = test::Trainer{}.step(rt, opt, test::batch_of(c, tok, tgt), s);
          std::lock_guard lk(mu);
          if (r == 0) losses.push_back(st.loss);
        }
        std::lock_guard lk(mu);
        for (int ch = 0; ch < shape.v; ++ch)
          params[static_cast<std::size_t>(shape.stage_of(r, ch))] = rt.download_parameters(ch);
      };
      if (typed) {
        po::Runtime<po::PO_F, test::TanhLayer, po::backend::Cpu, po::comm::Threads> rt(
            shape, dev, comm, layers, {.microbatch = c.mb, .gradients = c.gradients});
        train(rt);
      } else {
        po::Runtime rt(program, dev, comm, std::span<test::TanhLayer>(layers),
                       {.microbatch = c.mb, .gradients = c.gradients});
        train(rt);
      }
    });
    for (const std::string& e : errors) REQUIRE(e == "");
    return std::make_pair(losses, params);
  };
  const auto typed = run(true), built = run(false);
  CHECK(same_bits(typed.first, built.first));
  for (int s = 0; s < shape.stages(); ++s)
    CHECK(same_bits(typed.second[static_cast<std::size_t>(s)], built.second[static_cast<std::size_t>(s)]));
}

TEST_CASE("host bins: at most 3 powers of two with the minimal total") {
  for (std::uint64_t n = 1; n < 5000; ++n) {
    const po::offload::BinPlan p = po::offload::plan_bins(n);
    REQUIRE(p.count >= 1);
    REQUIRE(p.count <= 3);
    REQUIRE(p.total() >= n);
    for (int i = 0; i < p.count; ++i) REQUIRE(std::popcount(p.bins[static_cast<std::size_t>(i)]) == 1);
    // Minimal: no total in [n, p.total()) has at most 3 set bits.
    for (std::uint64_t t = n; t < p.total(); ++t) REQUIRE(std::popcount(t) > 3);
  }
}

TEST_CASE("backend::Cpu: events order streams, the arena reuses memory, a failure reaches synchronize") {
  po::backend::Cpu dev;
  const int a = dev.make_stream("a"), b = dev.make_stream("b");
  const int e = dev.make_event();
  std::vector<int> order;
  std::mutex mu;
  dev.launch(a, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::lock_guard lk(mu);
    order.push_back(1);
  });
  dev.record(e, a);
  dev.wait(b, e);
  dev.launch(b, [&] {
    std::lock_guard lk(mu);
    order.push_back(2);
  });
  dev.synchronize();
  CHECK(order == std::vector<int>{1, 2});
  for (int i = 0; i < 3; ++i) {
    dev.launch(a, [&] {
      auto x = dev.device_alloc(1000, po::backend::Memory::activation);
      auto y = dev.device_alloc(1000, po::backend::Memory::stash);
      dev.device_free(x);
      dev.device_free(y);
    });
    dev.synchronize();
  }
  CHECK(dev.memory().device_allocations == 2);  // the first round's two blocks, reused after
  CHECK(dev.memory().peak_of(po::backend::Memory::activation) == 1000);
  dev.launch(b, [] { throw std::runtime_error("boom"); });
  dev.wait(a, e);
  CHECK_THROWS_WITH(dev.synchronize(), "boom");
}
