// tests/comm/test_threads_grid.cpp: comm::ThreadsGrid (dp replicas of a d-rank pipeline as
// thread ranks) and the device collectives of comm::Threads (all_to_all, byte all_gather).
#include <doctest/doctest.h>

#include <pipeoffload/comm/threads.hpp>
#include <pipeoffload/runtime/thread_ranks.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace po = pipeoffload;

/// comm::Threads blocks the calling thread, so the device collectives take any context.
const po::backend::CpuContext ctx{};

/// The exception text of f(), or "" when it returns.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// The byte that global rank g puts in block `to` of its all_to_all input, at offset i.
std::byte payload(int g, int to, int i) { return static_cast<std::byte>((g * 37 + to * 11 + i) & 0xff); }

std::size_t z(int i) { return static_cast<std::size_t>(i); }

}  // namespace

TEST_CASE("comm::ThreadsGrid: every rank has a pipeline group (its replica) and a replicas group (its pipeline rank)") {
  for (const auto& [dp, d] : {std::pair{2, 3}, std::pair{3, 2}, std::pair{1, 4}, std::pair{4, 1}}) {
    CAPTURE(dp);
    CAPTURE(d);
    po::comm::ThreadsGrid grid(dp, d);
    CHECK(grid.dp() == dp);
    CHECK(grid.d() == d);
    CHECK(grid.size() == dp * d);
    // [g]: the global ranks gathered over each group, and what came around the pipeline ring.
    std::vector<std::vector<std::int32_t>> pipe_all(z(dp * d)), reps_all(z(dp * d));
    std::vector<std::int32_t> from_prev(z(dp * d), -1);
    const auto errors = po::run_thread_ranks(grid, [&](int g) {
      po::comm::Threads pipe = grid.pipeline(g), reps = grid.replicas(g);
      CHECK(pipe.rank() == g % d);
      CHECK(pipe.size() == d);
      CHECK(reps.rank() == g / d);
      CHECK(reps.size() == dp);
      const std::int32_t me = g;
      pipe_all[z(g)].resize(z(d));
      pipe.all_gather(std::span<const std::int32_t>(&me, 1), std::span(pipe_all[z(g)]));
      reps_all[z(g)].resize(z(dp));
      reps.all_gather(std::span<const std::int32_t>(&me, 1), std::span(reps_all[z(g)]));
      // A message around the ring of the replica's pipeline stays in that replica.
      if (d > 1) {
        const int r = pipe.rank(), next = (r + 1) % d, prev = (r + d - 1) % d;
        const po::Tag to{next, 0, po::Dir::forward}, from{r, 0, po::Dir::forward};
        const auto out = std::as_bytes(std::span<const std::int32_t>(&me, 1));
        const auto in = std::as_writable_bytes(std::span<std::int32_t>(&from_prev[z(g)], 1));
        if (r % 2 == 0) {
          pipe.send(ctx, next, to, out);
          pipe.recv(ctx, prev, from, in);
        } else {
          pipe.recv(ctx, prev, from, in);
          pipe.send(ctx, next, to, out);
        }
      }
    });
    for (int g = 0; g < dp * d; ++g) {
      CAPTURE(g);
      CHECK(errors[z(g)] == "");
      const int j = g / d, r = g % d;
      for (int q = 0; q < d; ++q) CHECK(pipe_all[z(g)][z(q)] == j * d + q);
      for (int q = 0; q < dp; ++q) CHECK(reps_all[z(g)][z(q)] == q * d + r);
      if (d > 1) CHECK(from_prev[z(g)] == j * d + (r + d - 1) % d);
    }
  }
}

TEST_CASE("comm::ThreadsGrid: all_to_all and the byte all_gather move every block to its rank, in both groups") {
  for (const auto& [dp, d] : {std::pair{2, 3}, std::pair{3, 2}}) {
    CAPTURE(dp);
    CAPTURE(d);
    po::comm::ThreadsGrid grid(dp, d);
    constexpr int block = 5;
    // [g]: results of all_to_all and all_gather over the replicas group, then the pipeline group.
    std::vector<std::vector<std::byte>> reps_a2a(z(dp * d)), reps_ag(z(dp * d)), pipe_a2a(z(dp * d)),
        pipe_ag(z(dp * d));
    const auto errors = po::run_thread_ranks(grid, [&](int g) {
      for (const bool replicas : {true, false}) {
        po::comm::Threads c = replicas ? grid.replicas(g) : grid.pipeline(g);
        const int n = c.size();
        std::vector<std::byte> in(z(n * block));
        for (int to = 0; to < n; ++to)
          for (int i = 0; i < block; ++i) in[z(to * block + i)] = payload(g, to, i);
        std::vector<std::byte>& out = (replicas ? reps_a2a : pipe_a2a)[z(g)];
        out.assign(z(n * block), std::byte{0xee});
        c.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
        const std::vector<std::byte> mine{static_cast<std::byte>(g), std::byte{0x5a}};
        std::vector<std::byte>& all = (replicas ? reps_ag : pipe_ag)[z(g)];
        all.assign(z(2 * n), std::byte{0xee});
        c.all_gather(ctx, std::span<const std::byte>(mine), std::span(all));
      }
    });
    for (int g = 0; g < dp * d; ++g) {
      CAPTURE(g);
      CHECK(errors[z(g)] == "");
      const int j = g / d, r = g % d;
      // Replicas group: rank q is global q * d + r, and this rank is index j in it.
      for (int q = 0; q < dp; ++q) {
        for (int i = 0; i < block; ++i) CHECK(reps_a2a[z(g)][z(q * block + i)] == payload(q * d + r, j, i));
        CHECK(reps_ag[z(g)][z(2 * q)] == static_cast<std::byte>(q * d + r));
        CHECK(reps_ag[z(g)][z(2 * q + 1)] == std::byte{0x5a});
      }
      // Pipeline group: rank q is global j * d + q, and this rank is index r in it.
      for (int q = 0; q < d; ++q) {
        for (int i = 0; i < block; ++i) CHECK(pipe_a2a[z(g)][z(q * block + i)] == payload(j * d + q, r, i));
        CHECK(pipe_ag[z(g)][z(2 * q)] == static_cast<std::byte>(j * d + q));
      }
    }
  }
}

TEST_CASE("comm::ThreadsGrid: an abort in a replicas group wakes a pipeline recv of another replica, with the reason") {
  for (const auto& [dp, d] : {std::pair{2, 3}, std::pair{3, 2}}) {
    CAPTURE(dp);
    CAPTURE(d);
    po::comm::ThreadsGrid grid(dp, d);
    const int failing = dp * d - 1;  // the last rank of the last replica
    const auto t0 = std::chrono::steady_clock::now();
    const auto errors = po::run_thread_ranks(grid, [&](int g) {
      po::comm::Threads pipe = grid.pipeline(g), reps = grid.replicas(g);
      std::vector<std::byte> buf(z(4 * dp));
      if (g == failing) {
        // Let the others block first: the abort must wake waits in progress.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        reps.abort("replica " + std::to_string(dp - 1) + " failed");
      } else if (g % 2 == 0 || d == 1) {
        // Nobody sends: only the abort ends this recv.
        pipe.recv(ctx, (pipe.rank() + 1) % d, {pipe.rank(), 0, po::Dir::backward}, std::span(buf));
      } else {
        // The failing rank's replicas group never completes this round.
        std::vector<std::byte> out(buf.size());
        reps.all_to_all(ctx, std::span<const std::byte>(buf), std::span(out));
      }
    });
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
    const std::string why = "aborted: replica " + std::to_string(dp - 1) + " failed";
    for (int g = 0; g < dp * d; ++g) {
      CAPTURE(g);
      CHECK(errors[z(g)] == (g == failing ? "" : why));
    }
    CHECK(grid.aborted());
    // Calls to come throw too, in both groups, and the first abort wins.
    grid.abort("a later failure");
    std::vector<std::byte> x(4);
    CHECK(error_of([&] { grid.pipeline(0).send(ctx, 1, {1, 0, po::Dir::forward}, std::span<const std::byte>(x)); }) ==
          why);
    std::vector<std::byte> all(z(4 * dp));
    CHECK(error_of([&] { grid.replicas(0).all_gather(ctx, std::span<const std::byte>(x), std::span(all)); }) == why);
  }
}

TEST_CASE("comm::ThreadsGrid: mismatched all_to_all sizes throw on every rank of every replica") {
  for (const auto& [dp, d] : {std::pair{2, 3}, std::pair{3, 2}}) {
    CAPTURE(dp);
    CAPTURE(d);
    po::comm::ThreadsGrid grid(dp, d);
    const auto errors = po::run_thread_ranks(grid, [&](int g) {
      po::comm::Threads pipe = grid.pipeline(g), reps = grid.replicas(g);
      // Pipeline rank 0's group: its last replica passes two bytes per block, the others one.
      const int per_block = (g % d == 0 && g / d == dp - 1) ? 2 : 1;
      std::vector<std::byte> in(z(dp * per_block)), out(in.size());
      reps.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
      // The other groups completed their round; the abort reaches them here.
      if (d > 1) pipe.recv(ctx, (pipe.rank() + 1) % d, {pipe.rank(), 0, po::Dir::forward}, std::span(out));
    });
    const std::string what =
        "comm::Threads::all_to_all: ranks passed buffers of different sizes (rank 0: " + std::to_string(dp) +
        " bytes, rank " + std::to_string(dp - 1) + ": " + std::to_string(2 * dp) + " bytes)";
    int thrown = 0;
    for (int g = 0; g < dp * d; ++g) {
      CAPTURE(g);
      CHECK((errors[z(g)] == what || errors[z(g)] == "aborted: " + what));
      thrown += errors[z(g)] == what ? 1 : 0;
    }
    CHECK(thrown == 1);  // the last rank of the group to arrive; the others are aborted with its text
  }
}

TEST_CASE("comm::Threads: all_to_all on a plain world; collectives of different kinds or bad sizes are refused") {
  po::comm::ThreadsWorld world(3);
  std::vector<std::vector<std::byte>> out(3);
  auto errors = po::run_thread_ranks(world, [&](int r) {
    po::comm::Threads c(world, r);
    std::vector<std::byte> in(6);
    for (int to = 0; to < 3; ++to)
      for (int i = 0; i < 2; ++i) in[z(2 * to + i)] = payload(r, to, i);
    out[z(r)].resize(6);
    c.all_to_all(ctx, std::span<const std::byte>(in), std::span(out[z(r)]));
    std::vector<std::byte> none;
    c.all_to_all(ctx, std::span<const std::byte>(none), std::span(none));  // zero bytes: nothing moves
  });
  for (int r = 0; r < 3; ++r)
    for (int q = 0; q < 3; ++q)
      for (int i = 0; i < 2; ++i) CHECK(out[z(r)][z(2 * q + i)] == payload(q, r, i));
  for (const std::string& e : errors) CHECK(e == "");

  // Rank 1 calls all_gather where the others call all_to_all: every rank fails.
  po::comm::ThreadsWorld mixed(3);
  errors = po::run_thread_ranks(mixed, [&](int r) {
    po::comm::Threads c(mixed, r);
    std::vector<std::byte> in(3), all(9);
    if (r == 1)
      c.all_gather(ctx, std::span<const std::byte>(in), std::span(all));
    else
      c.all_to_all(ctx, std::span<const std::byte>(in), std::span(in));
  });
  for (const std::string& e : errors)
    CHECK(
        e.find("comm::Threads: ranks called different collectives at once (rank 0: all_to_all, rank 1: all_gather)") !=
        std::string::npos);

  po::comm::ThreadsWorld one(2);
  po::comm::Threads c(one, 0);
  std::vector<std::byte> four(4), three(3);
  CHECK(error_of([&] { c.all_to_all(ctx, std::span<const std::byte>(four), std::span(three)); }) ==
        "comm::Threads::all_to_all: out holds 3 bytes; it must hold as many as in (4)");
  CHECK(error_of([&] { c.all_to_all(ctx, std::span<const std::byte>(three), std::span(three)); }) ==
        "comm::Threads::all_to_all: in holds 3 bytes; it must hold size() * block bytes, a multiple of size() = 2");
  CHECK(error_of([&] { c.all_gather(ctx, std::span<const std::byte>(four), std::span(four)); }) ==
        "comm::Threads::all_gather: the output holds 4 values; it must hold size() * mine.size() = 8");
  CHECK(!one.aborted());  // argument errors are local: nothing was aborted
}

TEST_CASE("comm::Threads: traffic() counts the bytes each rank sends in the device collectives, not the host ones") {
  // Three replicas of a one-rank pipeline: the replicas group has 3 ranks, the pipeline group 1.
  po::comm::ThreadsGrid grid(3, 1);
  std::vector<po::Traffic> after(3), reset(3), host(3), single(3), refused(3);
  const auto errors = po::run_thread_ranks(grid, [&](int g) {
    po::comm::Threads reps = grid.replicas(g), pipe = grid.pipeline(g);
    std::vector<std::byte> in(3 * 40), out(in.size()), mine(24), all(3 * 24);
    reps.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));    // 2 blocks of 40 leave
    reps.all_gather(ctx, std::span<const std::byte>(mine), std::span(all));  // 24 bytes to each of 2
    after[z(g)] = reps.traffic();
    reps.reset_traffic();
    reset[z(g)] = reps.traffic();
    const double loss[1] = {1.0 * g};
    std::vector<double> losses(3);
    reps.all_gather(std::span<const double>(loss), std::span(losses));  // host control data: not counted
    host[z(g)] = reps.traffic();
    // A group of one sends nothing; a refused call counts nothing.
    pipe.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
    pipe.all_gather(ctx, std::span<const std::byte>(mine), std::span(all).first(24));
    single[z(g)] = pipe.traffic();
    CHECK(!error_of([&] { reps.all_gather(ctx, std::span<const std::byte>(mine), std::span(mine)); }).empty());
    refused[z(g)] = reps.traffic();
  });
  for (int g = 0; g < 3; ++g) {
    CAPTURE(g);
    CHECK(errors[z(g)] == "");
    CHECK(after[z(g)].all_to_all == 80);
    CHECK(after[z(g)].all_gather == 48);
    CHECK(after[z(g)].total() == 128);
    CHECK(reset[z(g)].total() == 0);
    CHECK(host[z(g)].total() == 0);
    CHECK(single[z(g)].total() == 0);
    CHECK(refused[z(g)].total() == 0);
  }
}

TEST_CASE("comm::ThreadsGrid: bad shapes and global ranks are refused, naming the value and the range") {
  CHECK(error_of([] { po::comm::ThreadsGrid(0, 2); }) ==
        "comm::ThreadsGrid: dp = 0 is outside the allowed range [1, 4096]");
  CHECK(error_of([] { po::comm::ThreadsGrid(2, -1); }) ==
        "comm::ThreadsGrid: d = -1 is outside the allowed range [1, 4096]");
  CHECK(error_of([] { po::comm::ThreadsGrid(64, 128); }) ==
        "comm::ThreadsGrid: dp * d = 8192 ranks is outside the allowed range [1, 4096]");
  po::comm::ThreadsGrid grid(2, 3);
  CHECK(error_of([&] { grid.pipeline(6); }) ==
        "comm::ThreadsGrid::pipeline: global rank = 6 is outside the allowed range [0, 5]");
  CHECK(error_of([&] { grid.replicas(-1); }) ==
        "comm::ThreadsGrid::replicas: global rank = -1 is outside the allowed range [0, 5]");
}
