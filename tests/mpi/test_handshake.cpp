// tests/mpi/test_handshake.cpp: the start-up handshake (comm/handshake.hpp) over thread ranks.
// The same header runs over comm::Mpi in test_mpi.cpp and in train_gpt's MPI tests.
#include <doctest/doctest.h>

#include <pipeoffload/comm/handshake.hpp>
#include <pipeoffload/runtime.hpp>

#include <string>
#include <vector>

namespace {

/// Runs the handshake on d thread ranks, rank r with fields_of(r); returns each rank's error.
template <class Fields>
std::vector<std::string> shake(int d, Fields fields_of) {
  po::comm::ThreadsWorld world(d);
  return po::run_thread_ranks(world, [&](int r) {
    po::comm::Threads comm(world, r);
    // Every rank throws on its own, having seen the same hashes: no abort is needed.
    po::handshake(comm, fields_of(r));
  });
}

std::vector<po::HandshakeField> base(const std::string& schedule = "po-f") {
  return {{"schedule", schedule}, {"shape", "d=4 v=2 m=8"}, {"model", "layers=8 hidden=64"}};
}

}  // namespace

TEST_CASE("handshake: ranks with the same configuration pass") {
  for (int d : {1, 2, 4, 7}) {
    const auto errors = shake(d, [](int) { return base(); });
    for (const auto& e : errors) CHECK(e.empty());
  }
}

TEST_CASE("handshake: one rank with another schedule fails on every rank, naming the field and both values") {
  const auto errors = shake(4, [](int r) { return base(r == 2 ? "gis-h" : "po-f"); });
  for (const auto& e : errors)
    CHECK(
        e ==
        "handshake: ranks disagree on schedule: rank 0 has 'po-f', rank 2 has 'gis-h'; start every rank with the same configuration");
}

TEST_CASE("handshake: the first differing field and the lowest differing rank are named") {
  const auto errors = shake(4, [](int r) {
    auto f = base();
    if (r >= 1) f[2].value = "layers=4 hidden=64";  // model differs from rank 1 on
    if (r == 3) f[1].value = "d=4 v=2 m=16";        // and shape (an earlier field) on rank 3
    return f;
  });
  for (const auto& e : errors)
    CHECK(
        e ==
        "handshake: ranks disagree on shape: rank 0 has 'd=4 v=2 m=8', rank 3 has 'd=4 v=2 m=16'; start every rank with the same configuration");
}

TEST_CASE("handshake: a different list of fields (another build) fails on every rank") {
  const auto errors = shake(3, [](int r) {
    auto f = base();
    if (r == 1) f.push_back({"extra", "x"});
    return f;
  });
  for (const auto& e : errors)
    CHECK(
        e ==
        "handshake: ranks disagree on the list of configuration fields: rank 0 has 3 fields, rank 1 has 4; they were built from different "
        "pipeoffload sources");
  const auto renamed = shake(2, [](int r) {
    auto f = base();
    if (r == 1) f[0].name = "schedule type";
    return f;
  });
  for (const auto& e : renamed)
    CHECK(
        e ==
        "handshake: ranks disagree on the list of configuration fields: rank 0 has 3 fields, rank 1 has 3 with other names; they were built "
        "from different pipeoffload sources");
}

TEST_CASE("handshake: values longer than the message carries are still compared in full") {
  const std::string a(300, 'a');
  std::string b = a;
  b[299] = 'b';  // differs only past what the message shows
  const auto errors = shake(2, [&](int r) { return std::vector<po::HandshakeField>{{"long", r == 0 ? a : b}}; });
  for (const auto& e : errors)
    CHECK(e == "handshake: ranks disagree on long: rank 0 has '" + a.substr(0, 138) + "', rank 1 has '" +
                   a.substr(0, 138) + "'; start every rank with the same configuration");
}

TEST_CASE("handshake: the standard fields name the version, the schedule and the shape") {
  using GK = po::GroupSpec::Kind;
  const auto f = po::handshake_fields({po::Family::grouped, {GK::uniform, 1}, po::offload::all}, {4, 2, 8});
  REQUIRE(f.size() == 3);
  CHECK(f[0].name == "pipeoffload version");
  CHECK(f[0].value == std::string(po::version));
  CHECK(f[1].name == "schedule");
  CHECK(f[1].value == "po-f");
  CHECK(f[2].name == "shape");
  CHECK(f[2].value == "d=4 v=2 m=8");
  CHECK(po::handshake_fields({po::Family::grouped, {GK::number, 3}, po::offload::none}, {4, 2, 8})[1].value ==
        "gis-g (g=3)");
  CHECK(po::handshake_fields({po::Family::interleaved_1f1b, {}, po::offload::first(1)}, {4, 2, 8})[1].value ==
        "1f1b-i+offload(first 1)");
}
