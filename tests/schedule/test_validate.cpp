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
  CHECK(contains(
      v.error,
      "rank 1 expects recv from rank 0 (forward, stage 1, mb 1) but rank 0 sends send to rank 1 (forward, stage 1, mb 0) first"));
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
    return op.kind == OpKind::B && std::any_of(rp.copy.begin(), rp.copy.end(), [&](const Op& c) {
             return c.kind == OpKind::R && c.stage == op.stage && c.mb == op.mb;
           });
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
  const auto r = std::find_if(rp.copy.begin(), rp.copy.end(), [&](const Op& op) {
    return op.kind == OpKind::R && op.stage == o->stage && op.mb == o->mb;
  });
  std::iter_swap(o, r);
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "the reload of (stage 0, mb"));
  CHECK_THROWS_AS(require_valid(p), schedule_error);
}

// validate() first tries to prove a program valid in one linear sweep (detail::proven_valid)
// and falls back to the rule-by-rule checks, which name the broken rule, when it cannot. The
// cases below break exactly one of the conditions that sweep relies on; each must still be
// rejected, with the message of the rule-by-rule checks.

TEST_CASE("validate finds a rendezvous deadlock that goes around the ring of ranks") {
  // GIS d=3, v=2, m=1. Each pair of neighbours still lists the messages between them in one
  // order, and no rank waits for itself; but rank 0 now posts the receive of stage 3's input
  // (from rank 2) before it sends stage 0's output to rank 1, so rank 0 waits for rank 2,
  // which waits for rank 1, which waits for rank 0 (clockwise around the ring).
  Program p = GIS::build({3, 2, 1});
  REQUIRE(validate(p));
  REQUIRE(detail::proven_valid(p));
  auto& comm = p.ranks[0].comm;
  REQUIRE((comm[0] == CommOp{true, 1, 1, 0, Dir::forward}));
  REQUIRE((comm[1] == CommOp{false, 2, 3, 0, Dir::forward}));
  std::swap(comm[0], comm[1]);
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "deadlocks under the communicator's rendezvous semantics"));
  CHECK(contains(v.error, "rank 0 waits at compute F(stage 3, mb 0) comm recv from rank 2 (forward, stage 3, mb 0)"));
}

TEST_CASE("validate finds a rendezvous deadlock around the ring the other way") {
  // Same schedule; rank 0 now receives stage 0's gradient (from rank 1) before it sends
  // stage 2's gradient to rank 2: rank 0 waits for rank 1, rank 1 for rank 2, rank 2 for rank 0.
  Program p = GIS::build({3, 2, 1});
  auto& comm = p.ranks[0].comm;
  REQUIRE((comm[4] == CommOp{true, 2, 2, 0, Dir::backward}));
  REQUIRE((comm[5] == CommOp{false, 1, 0, 0, Dir::backward}));
  std::swap(comm[4], comm[5]);
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "deadlocks under the communicator's rendezvous semantics"));
  CHECK(contains(v.error, "rank 0 waits at compute B(stage 0, mb 0) comm recv from rank 1 (backward, stage 0, mb 0)"));
}

TEST_CASE("validate finds two neighbours that list the messages between them in different orders") {
  // PO d=4, v=2, m=4: rank 1 sends stage 1's activation of mb 1 before that of mb 0, and
  // rank 2 still expects mb 0 first.
  Program p = PO::build({4, 2, 4});
  auto& comm = p.ranks[1].comm;
  const auto first = std::find(comm.begin(), comm.end(), CommOp{true, 2, 2, 0, Dir::forward});
  const auto second = std::find(comm.begin(), comm.end(), CommOp{true, 2, 2, 1, Dir::forward});
  REQUIRE(first != comm.end());
  REQUIRE(second != comm.end());
  std::iter_swap(first, second);
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(
      v.error,
      "rank 2 expects recv from rank 1 (forward, stage 2, mb 0) but rank 1 sends send to rank 2 (forward, stage 2, mb 1) first"));
}

TEST_CASE("validate finds a send addressed to the wrong rank") {
  Program p = PO::build({4, 2, 4});
  auto& comm = p.ranks[1].comm;
  const auto it =
      std::find_if(comm.begin(), comm.end(), [](const CommOp& c) { return c.send && c.dir == Dir::forward; });
  REQUIRE(it != comm.end());
  it->peer = 3;
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "rank 1: P2P op send to rank 3 (forward, stage 2, mb 0) connects the wrong ranks"));
}

TEST_CASE("validate finds an offload that may start before its forward ends") {
  Program p = PO_F::build({2, 2, 8});
  auto& rp = p.ranks[0];
  const auto o = std::find_if(rp.copy.begin(), rp.copy.end(), [](const Op& op) { return op.kind == OpKind::O; });
  REQUIRE(o != rp.copy.end());
  REQUIRE(o->wait >= 0);
  o->wait -= 1;  // now it waits only for the compute ops before its F
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "may start before its F ends"));
}

TEST_CASE("validate finds a rank whose compute and copy streams wait for each other") {
  // A reload that waits for the last compute op of its rank: the backward that waits for
  // the reload can never start.
  Program p = PO_F::build({2, 2, 8});
  auto& rp = p.ranks[1];
  const auto r = std::find_if(rp.copy.begin(), rp.copy.end(), [](const Op& op) { return op.kind == OpKind::R; });
  REQUIRE(r != rp.copy.end());
  r->wait = static_cast<int>(rp.compute.size()) - 1;
  CHECK_FALSE(detail::proven_valid(p));
  const Validation v = validate(p);
  CHECK_FALSE(v);
  CHECK(contains(v.error, "deadlocks under the communicator's rendezvous semantics"));
  CHECK(contains(v.error, "rank 1 waits at compute B("));
  CHECK(contains(v.error, " copy R("));
}

TEST_CASE("validate proves every built schedule valid in its linear sweep") {
  // The fast path is what makes validate() linear for real schedules: it must accept them.
  for (const ScheduleSpec& spec :
       {OneF1B::spec, Interleaved1F1B::spec, GIS::spec, GIS_H::spec, PO::spec, PO_H::spec, PO_F::spec})
    for (int d : {1, 2, 3, 4, 7})
      for (int v : {1, 2, 3})
        for (int m : {1, 4, 7, 14}) {
          if (spec.family == Family::one_f1b && v > 1) continue;
          if (spec.family == Family::interleaved_1f1b && m % d != 0) continue;
          const Program p = build(spec, {d, v, m});
          CHECK(detail::proven_valid(p));
        }
}
