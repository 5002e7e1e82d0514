// validate(): every rule reports a sentence naming the rank and the op; the P2P plan is checked
// under rendezvous semantics (a send completes only with its receive).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

namespace {
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("validate reports a missing pass") {
  Program p = GIS::build({2, 2, 4});
  auto& ops = p.ranks[0].compute;
  ops.erase(std::find(ops.begin(), ops.end(), Op{OpKind::W, 0, 3, ops.back().wait}));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(v.error == "W(stage 0, mb 3) is missing");
}

TEST_CASE("validate reports a pass run twice and a pass on the wrong rank") {
  Program p = PO::build({2, 2, 4});
  p.ranks[1].compute.push_back(p.ranks[1].compute.front());
  CHECK(validate(p).error == "rank 1 runs F(stage 1, mb 0) twice");
  Program q = PO::build({2, 2, 4});
  q.ranks[1].compute.front().stage = 0;
  CHECK(validate(q).error == "rank 1 runs F(stage 0, mb 0), which lives on rank 0");
}

TEST_CASE("validate reports a backward before its forward") {
  Program p = OneF1B::build({1, 1, 2});
  std::swap(p.ranks[0].compute[0], p.ranks[0].compute[1]);  // BW0 before F0
  CHECK(validate(p).error == "on rank 0 the backward of stage 0, mb 0 comes before its F");
}

TEST_CASE("validate finds a P2P plan that deadlocks when sends wait for their receives") {
  Program p = GIS::build({2, 1, 4});
  // Rank 0 posts the receive of a gradient before sending the activation that produces it.
  auto& comm = p.ranks[0].comm;
  const auto it = std::find_if(comm.begin(), comm.end(), [](const CommOp& c) { return !c.send; });
  REQUIRE(it != comm.end());
  std::rotate(comm.begin(), it, it + 1);
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "deadlocks under the communicator's rendezvous semantics"));
  CHECK(contains(v.error, "rank 0 waits at"));
  CHECK(contains(v.error, "comm recv from rank 1 (backward, stage 0, mb 0)"));
}

TEST_CASE("validate finds messages consumed in another order than sent") {
  Program p = GIS::build({2, 1, 4});
  auto& comm = p.ranks[1].comm;  // rank 1 receives forwards mb 0, 1, ...
  const auto first = std::find_if(comm.begin(), comm.end(), [](const CommOp& c) { return !c.send && c.mb == 0; });
  const auto second = std::find_if(comm.begin(), comm.end(), [](const CommOp& c) { return !c.send && c.mb == 1; });
  std::iter_swap(first, second);
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "rank 1 expects recv from rank 0 (forward, stage 1, mb 1) but rank 0 sends send to rank 1 (forward, stage 1, mb 0) first"));
}

TEST_CASE("validate finds a P2P plan that never sends a message") {
  Program p = GIS::build({2, 1, 2});
  auto& comm = p.ranks[0].comm;
  comm.erase(std::find_if(comm.begin(), comm.end(), [](const CommOp& c) { return c.send; }));
  CHECK(validate(p).error == "the P2P plan never sends the forward message into stage 1, mb 0");
}

TEST_CASE("validate finds a backward that may start before its reload, and a double-booked copy stream") {
  Program p = PO_F::build({2, 2, 8});
  REQUIRE(validate(p));
  auto& rp = p.ranks[0];
  const auto b = std::find_if(rp.compute.begin(), rp.compute.end(), [&](const Op& op) {
    return op.kind == OpKind::B && std::any_of(rp.copy.begin(), rp.copy.end(), [&](const Op& c) { return c.kind == OpKind::R && c.stage == op.stage && c.mb == op.mb; });
  });
  REQUIRE(b != rp.compute.end());
  Program q = p;
  q.ranks[0].compute[static_cast<std::size_t>(b - rp.compute.begin())].wait = -1;
  CHECK(contains(validate(q).error, "may start before its reload ends"));
  Program r = p;
  r.ranks[0].copy_slot[1] = r.ranks[0].copy_slot[0];
  CHECK(contains(validate(r).error, "the copy stream is double-booked at slot"));
}

TEST_CASE("validate finds a reload placed before its offload") {
  Program p = PO_F::build({2, 2, 8});
  auto& rp = p.ranks[0];
  const auto o = std::find_if(rp.copy.begin(), rp.copy.end(), [](const Op& op) { return op.kind == OpKind::O; });
  const auto r = std::find_if(rp.copy.begin(), rp.copy.end(), [&](const Op& op) { return op.kind == OpKind::R && op.stage == o->stage && op.mb == o->mb; });
  std::iter_swap(o, r);
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "the reload of (stage 0, mb"));
  CHECK_THROWS_AS(require_valid(p), schedule_error);
}
