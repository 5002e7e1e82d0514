// tests/mpi/test_mpi.cpp: comm::Mpi's contract, run under `mpirun -np 4` (any size >= 2).
// Every test case is collective: each rank runs the same cases in the same order, and every
// wait has a timeout, so a failing rank cannot hang the others.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <pipeoffload/comm/handshake.hpp>
#include <pipeoffload/comm/mpi/mpi.hpp>
#include <pipeoffload/comm/mpi/nccl_id.hpp>
#include <pipeoffload/pipeoffload.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace {

po::comm::Mpi::Options quick(double timeout = 20) {
  po::comm::Mpi::Options o;
  o.timeout_seconds = timeout;
  return o;
}

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

std::string host() { return po::comm::detail::mpi_host(); }

/// comm::Mpi blocks the calling thread, so send and recv take any backend context.
const po::backend::CpuContext ctx{};

/// Messages are bytes: the floats of a vector, read-only or writable.
std::span<const std::byte> in_bytes(const std::vector<float>& v) { return std::as_bytes(std::span(v)); }
std::span<std::byte> out_bytes(std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); }

}  // namespace

TEST_CASE("comm::Mpi: tagged messages around a ring arrive intact and in order") {
  po::comm::Mpi c(quick());
  const int r = c.rank(), d = c.size(), next = (r + 1) % d, prev = (r + d - 1) % d;
  REQUIRE(d >= 2);
  // Even ranks send first, odd ranks receive first: synchronous sends need a partner posted.
  for (int mb = 0; mb < 3; ++mb) {
    std::vector<float> out(5), in(5, -1.0f);
    for (int i = 0; i < 5; ++i) out[static_cast<std::size_t>(i)] = static_cast<float>(100 * r + 10 * mb + i);
    const po::Tag to{next, mb, po::Dir::forward}, from{r, mb, po::Dir::forward};
    if (r % 2 == 0) {
      c.send(ctx, next, to, in_bytes(out));
      c.recv(ctx, prev, from, out_bytes(in));
    } else {
      c.recv(ctx, prev, from, out_bytes(in));
      c.send(ctx, next, to, in_bytes(out));
    }
    for (int i = 0; i < 5; ++i) CHECK(in[static_cast<std::size_t>(i)] == static_cast<float>(100 * prev + 10 * mb + i));
  }
  // An empty message is a message too.
  if (r == 0) c.send(ctx, 1, {1, 0, po::Dir::backward}, std::span<const std::byte>());
  if (r == 1) c.recv(ctx, 0, {1, 0, po::Dir::backward}, std::span<std::byte>());
}

TEST_CASE("comm::Mpi: a receive that meets another tag or size throws, naming both") {
  po::comm::Mpi c(quick());
  std::vector<float> x(3, 1.0f), y(3), z(4);
  if (c.rank() == 0) {
    c.send(ctx, 1, {1, 0, po::Dir::forward}, in_bytes(x));
    c.send(ctx, 1, {1, 2, po::Dir::backward}, in_bytes(x));
  }
  if (c.rank() == 1) {
    CHECK(
        error_of([&] { c.recv(ctx, 0, {1, 1, po::Dir::forward}, out_bytes(y)); }) ==
        "comm::Mpi: rank 1 expected (forward, stage 1, mb 1) of 12 bytes from rank 0 but received (forward, stage 1, mb 0) of 12 bytes");
    CHECK(
        error_of([&] { c.recv(ctx, 0, {1, 2, po::Dir::backward}, out_bytes(z)); }) ==
        "comm::Mpi: rank 1 expected (backward, stage 1, mb 2) of 16 bytes from rank 0 but received (backward, stage 1, mb 2) of 12 bytes");
  }
  CHECK(error_of([&] { c.send(ctx, c.rank(), {0, 0, po::Dir::forward}, in_bytes(x)); }) ==
        "comm::Mpi: rank " + std::to_string(c.rank()) + " cannot send to rank " + std::to_string(c.rank()) +
            "; peers are the other ranks of 0.." + std::to_string(c.size() - 1));
  CHECK(error_of([&] { c.recv(ctx, c.size(), {0, 0, po::Dir::forward}, out_bytes(y)); }) ==
        "comm::Mpi: rank " + std::to_string(c.rank()) + " cannot recv from rank " + std::to_string(c.size()) +
            "; peers are the other ranks of 0.." + std::to_string(c.size() - 1));
}

TEST_CASE("comm::Mpi: options outside their ranges are refused, naming the value and the range") {
  // Checked before the communicator is duplicated, so every rank throws and none waits.
  po::comm::Mpi::Options o = quick();
  o.poll_sleep_max_us = 0;
  CHECK(error_of([&] { po::comm::Mpi c(o); }) ==
        "comm::Mpi: poll_sleep_max_us = 0 is outside the allowed range [1, 100000]");
  o.poll_sleep_max_us = 100001;
  CHECK(error_of([&] { po::comm::Mpi c(o); }) ==
        "comm::Mpi: poll_sleep_max_us = 100001 is outside the allowed range [1, 100000]");
  o = quick(0);
  CHECK(error_of([&] { po::comm::Mpi c(o); }).find("timeout_seconds = 0") != std::string::npos);
  // The longest sleep does not change what arrives: a ring with a 1 us cap and one with the
  // largest.
  for (const int cap : {1, 100000}) {
    o = quick();
    o.poll_sleep_max_us = cap;
    po::comm::Mpi c(o);
    const int n = c.size(), r = c.rank();
    std::vector<float> x = {static_cast<float>(r), 0.5f}, y(2);
    if (n > 1) {
      if (r % 2 == 0) {
        c.send(ctx, (r + 1) % n, {0, 1, po::Dir::forward}, in_bytes(x));
        c.recv(ctx, (r + n - 1) % n, {0, 1, po::Dir::forward}, out_bytes(y));
      } else {
        c.recv(ctx, (r + n - 1) % n, {0, 1, po::Dir::forward}, out_bytes(y));
        c.send(ctx, (r + 1) % n, {0, 1, po::Dir::forward}, in_bytes(x));
      }
      CHECK(y[0] == static_cast<float>((r + n - 1) % n));
      CHECK(y[1] == 0.5f);
    }
  }
}

TEST_CASE("comm::Mpi: a receive with no sender times out, naming the op, the rank and the peer") {
  po::comm::Mpi c(quick(0.5));
  if (c.rank() == 1) {
    std::vector<float> y(2);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { c.recv(ctx, 0, {1, 7, po::Dir::backward}, out_bytes(y)); });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(waited >= 0.5);
    CHECK(waited < 5.0);
    CHECK(e.rfind("comm::Mpi: rank 1 (" + host() + ") has waited 0.", 0) == 0);
    CHECK(
        e.find(
            " s in recv from rank 0 of (backward, stage 1, mb 7) (timeout 0.5 s); rank 0 has not answered: it is lost, stuck, or waiting itself") !=
        std::string::npos);
  }
  po::comm::Mpi sync(quick());
  std::vector<double> all(static_cast<std::size_t>(sync.size()));
  const double one = 1;
  sync.all_gather(std::span<const double>(&one, 1), std::span(all));
}

TEST_CASE("comm::Mpi: a send nobody receives times out, and the late receive still gets it") {
  po::comm::Mpi c(quick(0.5));
  po::comm::Mpi sync(quick());
  std::vector<double> all(static_cast<std::size_t>(sync.size()));
  const double one = 1;
  std::vector<float> x{1.0f, 2.0f}, y(2);
  if (c.rank() == 0)
    CHECK(error_of([&] {
            c.send(ctx, 1, {1, 3, po::Dir::forward}, in_bytes(x));
          }).find("s in send to rank 1 of (forward, stage 1, mb 3) (timeout 0.5 s); rank 1 has not answered") !=
          std::string::npos);
  sync.all_gather(std::span<const double>(&one, 1), std::span(all));
  // The timed-out send's buffer is kept alive by the communicator, so matching it now is safe.
  if (c.rank() == 1) {
    c.recv(ctx, 0, {1, 3, po::Dir::forward}, out_bytes(y));
    CHECK(y == x);
  }
  sync.all_gather(std::span<const double>(&one, 1), std::span(all));
}

TEST_CASE("comm::Mpi: all_gather returns every rank's values in rank order; unequal counts fail on every rank") {
  po::comm::Mpi c(quick());
  const int d = c.size();
  const std::vector<double> mine{static_cast<double>(c.rank()), 0.5 + c.rank()};
  std::vector<double> all(2 * static_cast<std::size_t>(d));
  c.all_gather(std::span(mine), std::span(all));
  for (int r = 0; r < d; ++r) {
    CHECK(all[2 * static_cast<std::size_t>(r)] == r);
    CHECK(all[2 * static_cast<std::size_t>(r) + 1] == 0.5 + r);
  }
  std::vector<double> two(c.rank() == 1 ? 2 : 1, 1.0), out(two.size() * static_cast<std::size_t>(d));
  CHECK(error_of([&] { c.all_gather(std::span<const double>(two), std::span(out)); }) ==
        "comm::Mpi::all_gather: ranks contributed different counts (rank 0: 1, rank 1: 2)");
  std::vector<double> wrong(1);
  CHECK(error_of([&] { c.all_gather(std::span(mine), std::span(wrong)); }) ==
        "comm::Mpi::all_gather: the output holds 1 values; it must hold size() * mine.size() = " +
            std::to_string(2 * d));
}

TEST_CASE(
    "comm::Mpi: all_gather moves any trivially copyable type as bytes; types of different sizes fail on every rank") {
  po::comm::Mpi c(quick());
  const std::size_t d = static_cast<std::size_t>(c.size());
  struct Pair {
    std::int32_t rank;
    float half;
  };
  const Pair mine{c.rank(), 0.5f * static_cast<float>(c.rank())};
  std::vector<Pair> pairs(d);
  c.all_gather(std::span<const Pair>(&mine, 1), std::span(pairs));
  for (std::size_t r = 0; r < d; ++r) {
    CHECK(pairs[r].rank == static_cast<std::int32_t>(r));
    CHECK(pairs[r].half == 0.5f * static_cast<float>(r));
  }
  const std::vector<std::byte> bytes{std::byte{1}, static_cast<std::byte>(c.rank())};
  std::vector<std::byte> all_bytes(2 * d);
  c.all_gather(std::span(bytes), std::span(all_bytes));
  for (std::size_t r = 0; r < d; ++r) CHECK(all_bytes[2 * r + 1] == static_cast<std::byte>(r));
  std::vector<std::uint64_t> none, all_none;
  c.all_gather(std::span<const std::uint64_t>(none), std::span(all_none));  // zero values: nothing moves
  // The same count of values of another size on rank 1: every rank refuses.
  std::string e;
  if (c.rank() == 1) {
    const float one = 1;
    std::vector<float> out(d);
    e = error_of([&] { c.all_gather(std::span<const float>(&one, 1), std::span(out)); });
  } else {
    const double one = 1;
    std::vector<double> out(d);
    e = error_of([&] { c.all_gather(std::span<const double>(&one, 1), std::span(out)); });
  }
  CHECK(e == "comm::Mpi::all_gather: ranks contributed values of different sizes (rank 0: 8 bytes, rank 1: 4 bytes)");
}

TEST_CASE("comm::Mpi: abort on one rank wakes every other rank's wait, naming the rank that failed") {
  po::comm::Mpi c(quick());
  std::vector<float> y(1);
  if (c.rank() == 1) {
    c.abort("rank 1, compute op 4 F(stage 1, mb 2): boom");
    CHECK(c.abort_origin() == 1);
    CHECK(error_of([&] { c.recv(ctx, 0, {1, 0, po::Dir::forward}, out_bytes(y)); }) ==
          "aborted: rank 1, compute op 4 F(stage 1, mb 2): boom");
  } else {
    // Waits on rank 1, which never sends: only the abort note can end this before the timeout.
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(error_of([&] { c.recv(ctx, 1, {c.rank(), 0, po::Dir::backward}, out_bytes(y)); }) ==
          "aborted: rank 1 failed: rank 1, compute op 4 F(stage 1, mb 2): boom");
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
    CHECK(c.abort_origin() == 1);
    const double one = 1.0;
    std::vector<double> all(static_cast<std::size_t>(c.size()));
    CHECK(error_of([&] { c.all_gather(std::span<const double>(&one, 1), std::span(all)); }) ==
          "aborted: rank 1 failed: rank 1, compute op 4 F(stage 1, mb 2): boom");
  }
}

TEST_CASE("comm::Mpi: the handshake finds a rank started with another schedule") {
  po::comm::Mpi c(quick());
  const int odd = c.size() - 1;
  std::vector<po::HandshakeField> f{{"schedule", c.rank() == odd ? "gis-h" : "po-f"}, {"shape", "d=4 v=2 m=8"}};
  CHECK(error_of([&] { po::handshake(c, f); }) == "handshake: ranks disagree on schedule: rank 0 has 'po-f', rank " +
                                                      std::to_string(odd) +
                                                      " has 'gis-h'; start every rank with the same configuration");
  f[0].value = "po-f";
  CHECK(error_of([&] { po::handshake(c, f); }) == "");
}

TEST_CASE("comm::Mpi: rank 0's NCCL unique id reaches every rank (the MPI bootstrap of comm::Nccl)") {
  po::comm::Mpi c(quick());
  po::comm::NcclIdBytes id{};
  for (std::size_t i = 0; i < id.size(); ++i)
    id[i] = static_cast<unsigned char>(c.rank() == 0 ? (i * 7 + 3) & 0xff : 0xee);
  const po::comm::NcclIdBytes got = po::comm::broadcast_nccl_id(c, id);
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == static_cast<unsigned char>((i * 7 + 3) & 0xff));
  CHECK(error_of([&] { po::comm::broadcast_nccl_id(c, id, c.size()); }) ==
        "comm::Mpi::broadcast: root = " + std::to_string(c.size()) + " is outside [0, " + std::to_string(c.size() - 1) +
            "]");
}

/// The grid of the split tests: dp = 2 replicas of a size/2-rank pipeline, g = replica * d + rank.
struct Grid {
  int g, dp, d;
  explicit Grid(const po::comm::Mpi& job) : g(job.rank()), dp(2), d(job.size() / 2) {}
};

/// The byte that job rank g puts in block `to` of its all_to_all input, at offset i.
std::byte payload(int g, int to, int i) { return static_cast<std::byte>((g * 37 + to * 11 + i) & 0xff); }

TEST_CASE("comm::Mpi::split: a grid's pipeline and replicas groups, their ranks, messages and collectives") {
  po::comm::Mpi job(quick());
  REQUIRE(job.size() % 2 == 0);
  const Grid grid(job);
  const int g = grid.g, dp = grid.dp, d = grid.d, j = g / d, r = g % d;
  po::comm::Mpi pipe = job.split(j, r), reps = job.split(r, j);
  CHECK(pipe.rank() == r);
  CHECK(pipe.size() == d);
  CHECK(reps.rank() == j);
  CHECK(reps.size() == dp);
  CHECK(pipe.job_rank() == g);
  CHECK(reps.job_rank() == g);
  CHECK(pipe.options().timeout_seconds == job.options().timeout_seconds);
  // Typed all_gather of the job ranks over each group.
  const std::int32_t me = g;
  std::vector<std::int32_t> pipe_all(static_cast<std::size_t>(d)), reps_all(static_cast<std::size_t>(dp));
  pipe.all_gather(std::span<const std::int32_t>(&me, 1), std::span(pipe_all));
  reps.all_gather(std::span<const std::int32_t>(&me, 1), std::span(reps_all));
  for (int q = 0; q < d; ++q) CHECK(pipe_all[static_cast<std::size_t>(q)] == j * d + q);
  for (int q = 0; q < dp; ++q) CHECK(reps_all[static_cast<std::size_t>(q)] == q * d + r);
  // A message along the pipeline of each replica stays in it.
  if (d > 1) {
    std::vector<float> x{static_cast<float>(g)}, y(1, -1.0f);
    if (r == 0) pipe.send(ctx, 1, {1, 0, po::Dir::forward}, in_bytes(x));
    if (r == 1) {
      pipe.recv(ctx, 0, {1, 0, po::Dir::forward}, out_bytes(y));
      CHECK(y[0] == static_cast<float>(j * d));
    }
  }
  // all_to_all and the byte all_gather (device memory on a GPU; the context is ignored here).
  for (po::comm::Mpi* c : {&reps, &pipe}) {
    const int n = c->size();
    constexpr int block = 3;
    std::vector<std::byte> in(static_cast<std::size_t>(n * block)), out(in.size(), std::byte{0xee});
    for (int to = 0; to < n; ++to)
      for (int i = 0; i < block; ++i) in[static_cast<std::size_t>(to * block + i)] = payload(g, to, i);
    c->all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
    for (int q = 0; q < n; ++q) {
      const int from = c == &reps ? q * d + r : j * d + q;  // rank q's job rank
      for (int i = 0; i < block; ++i)
        CHECK(out[static_cast<std::size_t>(q * block + i)] == payload(from, c->rank(), i));
    }
    const std::vector<std::byte> mine{static_cast<std::byte>(g), std::byte{0x5a}};
    std::vector<std::byte> all(static_cast<std::size_t>(2 * n));
    c->all_gather(ctx, std::span<const std::byte>(mine), std::span(all));
    for (int q = 0; q < n; ++q) {
      const int from = c == &reps ? q * d + r : j * d + q;
      CHECK(all[static_cast<std::size_t>(2 * q)] == static_cast<std::byte>(from));
      CHECK(all[static_cast<std::size_t>(2 * q + 1)] == std::byte{0x5a});
    }
  }
}

TEST_CASE("comm::Mpi::split: mismatched all_to_all sizes and bad colors fail on every rank") {
  po::comm::Mpi job(quick());
  const Grid grid(job);
  const int g = grid.g, d = grid.d, j = g / d, r = g % d;
  po::comm::Mpi reps = job.split(r, j);
  // In every replicas group, the last replica passes two bytes per block, the others one.
  const int per_block = j == grid.dp - 1 ? 2 : 1;
  std::vector<std::byte> in(static_cast<std::size_t>(grid.dp * per_block)), out(in.size());
  CHECK(error_of([&] { reps.all_to_all(ctx, std::span<const std::byte>(in), std::span(out)); }) ==
        "comm::Mpi::all_to_all: ranks passed buffers of different sizes (rank 0: 2 bytes, rank 1: 4 bytes)");
  // An all_gather on one rank where the others call all_to_all.
  std::vector<std::byte> two(2), all(4);
  CHECK(error_of([&] {
          if (j == 1)
            reps.all_gather(ctx, std::span<const std::byte>(two), std::span(all));
          else
            reps.all_to_all(ctx, std::span<const std::byte>(two), std::span(all).first(2));
        }) == "comm::Mpi: ranks called different collectives at once (rank 0: all_to_all, rank 1: all_gather)");
  // The groups still work after a refused call.
  in.assign(2, std::byte{1});
  out.assign(2, std::byte{0});
  reps.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
  CHECK(out == in);
  CHECK(error_of([&] { reps.all_to_all(ctx, std::span<const std::byte>(in), std::span(out).first(1)); }) ==
        "comm::Mpi::all_to_all: out holds 1 bytes; it must hold as many as in (2)");
  CHECK(error_of([&] { reps.all_to_all(ctx, std::span<const std::byte>(in).first(1), std::span(out).first(1)); }) ==
        "comm::Mpi::all_to_all: in holds 1 bytes; it must hold size() * block bytes, a multiple of size() = 2");
  CHECK(error_of([&] { (void)job.split(g == 1 ? -1 : 0, g); }) ==
        "comm::Mpi::split: rank 1 passed color = -1, outside the allowed range [0, 2147483647]");
}

TEST_CASE("comm::Mpi::split: a timeout in a split group names both ranks of each rank it mentions") {
  po::comm::Mpi job(quick(2));
  const Grid grid(job);
  const int g = grid.g, d = grid.d, j = g / d, r = g % d;
  po::comm::Mpi reps = job.split(r, j);
  // Replica 1's first rank waits for replica 0's, which never sends (a group that is not the
  // whole job: with d = 1 the replicas group is the job and its ranks are the job's).
  if (g == d && d > 1) {
    std::vector<float> y(1);
    const std::string e = error_of([&] { reps.recv(ctx, 0, {0, 1, po::Dir::forward}, out_bytes(y)); });
    CHECK(e.rfind("comm::Mpi: rank 1 (job rank " + std::to_string(d) + ", " + host() + ") has waited 2.", 0) == 0);
    CHECK(e.find(" s in recv from rank 0 (job rank 0) of (forward, stage 0, mb 1) (timeout 2 s); rank 0 (job rank 0) "
                 "has not answered") != std::string::npos);
  }
  po::comm::Mpi sync(quick());
  std::vector<double> all(static_cast<std::size_t>(sync.size()));
  const double one = 1;
  sync.all_gather(std::span<const double>(&one, 1), std::span(all));
}

TEST_CASE("comm::Mpi::split: an abort on one replicas group ends a pipeline recv of the other replica") {
  po::comm::Mpi job(quick(60));
  const Grid grid(job);
  const int g = grid.g, d = grid.d, j = g / d, r = g % d;
  po::comm::Mpi pipe = job.split(j, r), reps = job.split(r, j);
  const int failing = job.size() - 1;  // the last rank of replica 1
  const std::string why = "rank " + std::to_string(failing) + ", compute op 3 W(stage 1, mb 0): boom";
  std::vector<float> y(1);
  if (g == failing) {
    reps.abort(why);
    CHECK(pipe.aborted());
    CHECK(job.abort_origin() == failing);
    CHECK(error_of([&] { job.recv(ctx, 0, {r, 0, po::Dir::backward}, out_bytes(y)); }) == "aborted: " + why);
  } else {
    // Replica 0 waits in its pipeline, on a rank that never sends; replica 1's other ranks in
    // the replicas group, which the failing rank never joins. Only the note can end these.
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] {
      if (j == 0 && d > 1)
        pipe.recv(ctx, (r + 1) % d, {r, 0, po::Dir::backward}, out_bytes(y));
      else
        reps.all_to_all(ctx, std::span<const std::byte>(), std::span<std::byte>());
    });
    CHECK(e == "aborted: rank " + std::to_string(failing) + " failed: " + why);
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
    CHECK(pipe.abort_origin() == failing);
    CHECK(reps.abort_origin() == failing);
    CHECK(job.abort_origin() == failing);
    // Calls to come throw too, on every communicator of the job.
    CHECK(error_of([&] { pipe.all_gather(ctx, std::span<const std::byte>(), std::span<std::byte>()); }) == e);
    CHECK(error_of([&] { (void)job.split(0, 0); }) == e);
  }
}

TEST_CASE("comm::Mpi: traffic() counts the bytes each rank sends in the device collectives, not the host ones") {
  po::comm::Mpi job(quick());
  REQUIRE(job.size() == 4);
  // Job ranks 0..2 make a group of 3; rank 3 is a group of one, which sends nothing.
  po::comm::Mpi c = job.split(job.rank() < 3 ? 0 : 1, job.rank());
  const std::size_t n = static_cast<std::size_t>(c.size());
  std::vector<std::byte> in(n * 40), out(in.size()), mine(24), all(n * 24);
  c.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));    // every block but its own leaves
  c.all_gather(ctx, std::span<const std::byte>(mine), std::span(all));  // its 24 bytes to each other rank
  const po::Traffic t = c.traffic();
  CHECK(t.all_to_all == (n == 3 ? 80 : 0));
  CHECK(t.all_gather == (n == 3 ? 48 : 0));
  CHECK(t.total() == (n == 3 ? 128 : 0));
  po::comm::Mpi m(std::move(c));  // the count moves with the handle
  CHECK(m.traffic().total() == t.total());
  m.reset_traffic();
  CHECK(m.traffic().all_to_all == 0);
  CHECK(m.traffic().all_gather == 0);
  // The typed host all_gather (losses, norms, handshakes) is control data: not counted.
  const double loss = job.rank();
  std::vector<double> losses(n);
  m.all_gather(std::span<const double>(&loss, 1), std::span(losses));
  CHECK(m.traffic().total() == 0);
  // A refused call counts nothing.
  CHECK(!error_of([&] { m.all_gather(ctx, std::span<const std::byte>(mine), std::span(mine).first(1)); }).empty());
  CHECK(m.traffic().total() == 0);
}

int main(int argc, char** argv) {
  po::comm::MpiSession mpi(argc, argv);
  doctest::Context ctx(argc, argv);
  const int failed = ctx.run();
  // Every rank must agree on the verdict, or mpirun would report only some.
  int any = failed != 0 ? 1 : 0, all = 0;
  MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return all != 0 ? 1 : 0;
}
