// pipeoffload/schedule/validate.hpp: the rules every built schedule must satisfy. Its P2P
// plan is checked under the communicators' semantics (docs/schedules.md, "Communicator
// semantics"; NCCL's, the strictest in use): valid only if the untimed execution of all ranks'
// streams under them completes every op (check_execution). validate() first tries to prove
// that in one linear sweep (proven_valid, detail/proof.hpp); only when the proof fails does it
// run the rules one by one, which decide and name the broken rule.
/// @file
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "detail/asap.hpp"
#include "detail/parallel.hpp"
#include "detail/proof.hpp"
#include "program.hpp"

namespace pipeoffload {

/// Result of validate(): converts to true when the schedule is valid; otherwise `error`
/// says which rule broke, naming rank, op, stage and microbatch.
struct Validation {
  bool ok = true;     ///< is the schedule valid?
  std::string error;  ///< when not: which rule broke (empty when valid)
  /// `ok`.
  constexpr explicit operator bool() const { return ok; }
};

namespace detail {

constexpr std::string describe(const CommOp& c) {
  return std::string(c.send ? "send to rank " : "recv from rank ") + num(c.peer) + " (" +
         (c.dir == Dir::forward ? "forward" : "backward") + ", stage " + num(c.stage) + ", mb " + num(c.mb) + ")";
}

constexpr Validation fail_v(std::string msg) { return Validation{false, std::move(msg)}; }

constexpr Validation check_passes(const Program& p) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), m = sh.m;
  const bool fused = fused_backward(p.spec.family);
  if (static_cast<int>(p.ranks.size()) != sh.d)
    return fail_v("the program has " + num(static_cast<long long>(p.ranks.size())) +
                  " ranks; the shape says d = " + num(sh.d));
  // Per unit: position of F, B (or BW), W in its rank's order; -1 = missing.
  std::vector<int> fpos(static_cast<std::size_t>(S * m), -1), bpos(fpos.size(), -1), wpos(fpos.size(), -1);
  for (int r = 0; r < sh.d; ++r) {
    const auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
    for (int x = 0; x < static_cast<int>(ops.size()); ++x) {
      const Op& op = ops[static_cast<std::size_t>(x)];
      if (op.stage < 0 || op.stage >= S || op.mb < 0 || op.mb >= m)
        return fail_v("rank " + num(r) + " op " + num(x) + " " + describe(op) + " is outside stages 0.." + num(S - 1) +
                      ", microbatches 0.." + num(m - 1));
      if (sh.rank_of(op.stage) != r)
        return fail_v("rank " + num(r) + " runs " + describe(op) + ", which lives on rank " +
                      num(sh.rank_of(op.stage)));
      const auto u = static_cast<std::size_t>(op.stage * m + op.mb);
      std::vector<int>* slot = nullptr;
      switch (op.kind) {
        case OpKind::F:
          slot = &fpos;
          break;
        case OpKind::B:
          if (fused) return fail_v("rank " + num(r) + ": a fused-backward schedule runs a split " + describe(op));
          slot = &bpos;
          break;
        case OpKind::BW:
          if (!fused) return fail_v("rank " + num(r) + ": a split-backward schedule runs a fused " + describe(op));
          slot = &bpos;
          break;
        case OpKind::W:
          if (fused) return fail_v("rank " + num(r) + ": a fused-backward schedule runs a split " + describe(op));
          slot = &wpos;
          break;
        default:
          return fail_v("rank " + num(r) + ": copy op " + describe(op) + " on the compute stream");
      }
      if ((*slot)[u] >= 0) return fail_v("rank " + num(r) + " runs " + describe(op) + " twice");
      (*slot)[u] = x;
    }
  }
  for (int s = 0; s < S; ++s)
    for (int mb = 0; mb < m; ++mb) {
      const auto u = static_cast<std::size_t>(s * m + mb);
      if (fpos[u] >= 0 && bpos[u] >= fpos[u] && (fused || wpos[u] >= bpos[u])) continue;
      const std::string who = "stage " + num(s) + ", mb " + num(mb);
      if (fpos[u] < 0) return fail_v("F(" + who + ") is missing");
      if (bpos[u] < 0) return fail_v(std::string(fused ? "BW(" : "B(") + who + ") is missing");
      if (!fused && wpos[u] < 0) return fail_v("W(" + who + ") is missing");
      if (bpos[u] < fpos[u])
        return fail_v("on rank " + num(sh.rank_of(s)) + " the backward of " + who + " comes before its F");
      return fail_v("on rank " + num(sh.rank_of(s)) + " W(" + who + ") comes before its B");
    }
  return {};
}

/// Whether copy y (> 0) of `rp` takes a later place than copy y - 1: a later slot, or with
/// two copy streams (Costs::copy_streams) the offload beside a reload in the same slot.
constexpr bool slots_in_order(const Costs& c, const RankProgram& rp, std::size_t y) {
  const long long a = rp.copy_slot[y - 1], b = rp.copy_slot[y];
  return b > a || (c.duplex() && b == a && rp.copy[y - 1].kind == OpKind::R && rp.copy[y].kind == OpKind::O);
}

constexpr Validation check_copies(const Program& p) {
  const Shape& sh = p.shape;
  const int m = sh.m;
  for (int r = 0; r < sh.d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    const int nk = static_cast<int>(rp.copy.size()), nc = static_cast<int>(rp.compute.size());
    if (rp.copy_slot.size() != rp.copy.size())
      return fail_v("rank " + num(r) + ": copy ops and copy slots differ in number");
    std::vector<int> opos(static_cast<std::size_t>(sh.v * m), -1), rpos(opos.size(), -1);
    for (int y = 0; y < nk; ++y) {
      const Op& op = rp.copy[static_cast<std::size_t>(y)];
      if (op.kind != OpKind::O && op.kind != OpKind::R)
        return fail_v("rank " + num(r) + ": compute op " + describe(op) + " on the copy stream");
      if (op.stage < 0 || op.stage >= sh.stages() || sh.rank_of(op.stage) != r || op.mb < 0 || op.mb >= m)
        return fail_v("rank " + num(r) + ": copy op " + describe(op) + " does not belong to this rank");
      if (op.wait >= nc)
        return fail_v("rank " + num(r) + ": copy op " + describe(op) + " waits for compute op " + num(op.wait) +
                      ", past the end");
      if (y > 0 && !slots_in_order(p.costs, rp, static_cast<std::size_t>(y)))
        return fail_v("rank " + num(r) + ": the copy stream is double-booked at slot " +
                      num(rp.copy_slot[static_cast<std::size_t>(y)]));
      auto& pos = op.kind == OpKind::O ? opos : rpos;
      const auto u = static_cast<std::size_t>(sh.chunk_of(op.stage) * m + op.mb);
      if (pos[u] >= 0) return fail_v("rank " + num(r) + " runs " + describe(op) + " twice");
      pos[u] = y;
    }
    for (int x = 0; x < nc; ++x) {
      const Op& op = rp.compute[static_cast<std::size_t>(x)];
      if (op.wait >= nk)
        return fail_v("rank " + num(r) + ": " + describe(op) + " waits for copy op " + num(op.wait) + ", past the end");
      const auto u = static_cast<std::size_t>(sh.chunk_of(op.stage) * m + op.mb);
      if (op.kind == OpKind::F && opos[u] >= 0 && rp.copy[static_cast<std::size_t>(opos[u])].wait < x)
        return fail_v("rank " + num(r) + ": the offload of " + describe(op) + " may start before its F ends");
      if ((op.kind == OpKind::B || op.kind == OpKind::BW) && rpos[u] >= 0 && op.wait < rpos[u])
        return fail_v("rank " + num(r) + ": " + describe(op) + " may start before its reload ends");
    }
    for (std::size_t u = 0; u < opos.size(); ++u) {
      if ((opos[u] < 0) == (rpos[u] < 0) && rpos[u] >= opos[u]) continue;
      const std::string who =
          "stage " + num(sh.stage_of(r, static_cast<int>(u) / m)) + ", mb " + num(static_cast<int>(u) % m);
      if ((opos[u] < 0) != (rpos[u] < 0))
        return fail_v("rank " + num(r) + ": unit (" + who + ") has an offload without a reload or the reverse");
      if (opos[u] >= 0 && rpos[u] < opos[u])
        return fail_v("rank " + num(r) + ": the reload of (" + who + ") comes before its offload");
    }
  }
  return {};
}

/// Every P2P op well-formed, and every cross-rank hop posted exactly once by its producer's rank
/// and once by its consumer's. check_execution() runs this only when it gets stuck, to say
/// precisely why.
constexpr Validation check_p2p_plan(const Program& p) {
  const Shape& sh = p.shape;
  const int d = sh.d, m = sh.m, S = sh.stages();
  const auto unit = [S](int s, int mb) {
    return static_cast<std::size_t>(mb) * static_cast<std::size_t>(S) + static_cast<std::size_t>(s);
  };
  std::vector<char> sends(2 * static_cast<std::size_t>(S) * static_cast<std::size_t>(m), 0), recvs(sends.size(), 0);
  for (int r = 0; r < d; ++r)
    for (const CommOp& c : p.ranks[static_cast<std::size_t>(r)].comm) {
      if (c.stage < 0 || c.stage >= S || c.mb < 0 || c.mb >= m || c.peer < 0 || c.peer >= d)
        return fail_v("rank " + num(r) + ": P2P op " + describe(c) + " is out of range");
      const int producer = c.dir == Dir::forward ? c.stage - 1 : c.stage + 1;
      if (producer < 0 || producer >= S)
        return fail_v("rank " + num(r) + ": P2P op " + describe(c) + " has no producing stage");
      const int consumer_rank = sh.rank_of(c.stage), producer_rank = sh.rank_of(producer);
      if ((c.send ? producer_rank : consumer_rank) != r || (c.send ? consumer_rank : producer_rank) != c.peer ||
          consumer_rank == producer_rank)
        return fail_v("rank " + num(r) + ": P2P op " + describe(c) + " connects the wrong ranks");
      char& cnt = (c.send ? sends : recvs)[2 * unit(c.stage, c.mb) + (c.dir == Dir::forward ? 0 : 1)];
      if (++cnt > 1) return fail_v("rank " + num(r) + " posts " + describe(c) + " twice");
    }
  if (d > 1)
    for (int mb = 0; mb < m; ++mb)
      for (int s = 0; s < S; ++s)
        for (int dir = 0; dir < 2; ++dir) {
          if (dir == 0 ? s == 0 : s == S - 1) continue;
          if (!sh.crosses(dir == 0 ? s - 1 : s)) continue;  // both stages on one rank: no message
          const std::size_t i = 2 * unit(s, mb) + static_cast<std::size_t>(dir);
          if (sends[i] == 1 && recvs[i] == 1) continue;
          return fail_v(std::string("the P2P plan never ") + (sends[i] != 1 ? "sends" : "receives") + " the " +
                        (dir == 0 ? "forward" : "backward") + " message into stage " + num(s) + ", mb " + num(mb));
        }
  return {};
}

/// Untimed execution of every stream under the documented communicator semantics.
constexpr Validation check_execution(const Program& p) {
  const Shape& sh = p.shape;
  const int d = sh.d, m = sh.m, S = sh.stages();
  // Stages s and s + 1 on one rank (d = 1, or where a V turns): the pass reads the other
  // pass's output, no message.
  const auto local = [&sh](int s) { return !sh.crosses(s); };
  // Per unit, microbatch-major so neighbouring ranks touch nearby memory: F and B done, and
  // the forward message into the unit's stage and the backward one delivered.
  struct State {
    char f = 0, b = 0, fmsg = 0, bmsg = 0;
  };
  std::vector<State> st(static_cast<std::size_t>(S) * static_cast<std::size_t>(m));
  const auto unit = [S](int s, int mb) {
    return static_cast<std::size_t>(mb) * static_cast<std::size_t>(S) + static_cast<std::size_t>(s);
  };
  // Each rank's three streams as raw cursors.
  struct Streams {
    const Op* comp;
    std::size_t nc, ci;
    const Op* copy;
    std::size_t nk, ki;
    const CommOp* comm;
    std::size_t nq, qi;
  };
  std::vector<Streams> rs(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) {
    const auto& rp = p.ranks[static_cast<std::size_t>(r)];
    rs[static_cast<std::size_t>(r)] = {rp.compute.data(), rp.compute.size(), 0, rp.copy.data(), rp.copy.size(), 0,
                                       rp.comm.data(),    rp.comm.size(),    0};
  }
  const auto input_ready = [&](const Op& op) {
    switch (op.kind) {
      case OpKind::F:
        if (op.stage == 0) return true;
        return local(op.stage - 1) ? st[unit(op.stage - 1, op.mb)].f != 0 : st[unit(op.stage, op.mb)].fmsg != 0;
      case OpKind::B:
      case OpKind::BW: {
        const State& u = st[unit(op.stage, op.mb)];
        if (!u.f) return false;
        if (op.stage == S - 1) return true;
        return local(op.stage) ? st[unit(op.stage + 1, op.mb)].b != 0 : u.bmsg != 0;
      }
      case OpKind::W:
        return st[unit(op.stage, op.mb)].b != 0;
      default:
        return false;
    }
  };
  std::string error;
  // Completes rank r's head comm op if its partner is at the head of its own comm stream and
  // the data is there: 1 = done, 0 = not yet, -1 = an error (in `error`).
  const auto try_comm = [&](int r) {
    Streams& me = rs[static_cast<std::size_t>(r)];
    if (me.qi == me.nq) return 0;
    const CommOp& c = me.comm[me.qi];
    if (c.peer < 0 || c.peer >= d) return 0;  // check_p2p_plan names it
    Streams& other = rs[static_cast<std::size_t>(c.peer)];
    if (other.qi == other.nq) return 0;
    const CommOp& o = other.comm[other.qi];
    if (o.peer != r || o.send == c.send) return 0;
    const CommOp& snd = c.send ? c : o;
    const CommOp& rcv = c.send ? o : c;
    if (snd.stage != rcv.stage || snd.mb != rcv.mb || snd.dir != rcv.dir) {
      const int sender = c.send ? r : c.peer;
      error = "rank " + num(c.send ? c.peer : r) + " expects " + describe(rcv) + " but rank " + num(sender) +
              " sends " + describe(snd) +
              " first: messages between the two arrive in another order than they are consumed";
      return -1;
    }
    const int producer = snd.dir == Dir::forward ? snd.stage - 1 : snd.stage + 1;
    if (snd.stage < 0 || snd.stage >= S || producer < 0 || producer >= S || snd.mb < 0 || snd.mb >= m) return 0;
    const State& pu = st[unit(producer, snd.mb)];
    if (!(snd.dir == Dir::forward ? pu.f : pu.b)) return 0;
    State& cu = st[unit(snd.stage, snd.mb)];
    char& delivered = snd.dir == Dir::forward ? cu.fmsg : cu.bmsg;
    if (delivered) {
      error = "rank " + num(c.send ? r : c.peer) + " posts " + describe(snd) + " twice";
      return -1;
    }
    delivered = 1;
    ++me.qi;
    ++other.qi;
    return 1;
  };
  std::vector<int> work;
  std::vector<char> queued(static_cast<std::size_t>(d), 1);
  for (int r = d - 1; r >= 0; --r) work.push_back(r);
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    queued[static_cast<std::size_t>(r)] = 0;
    Streams& me = rs[static_cast<std::size_t>(r)];
    bool moved = false;
    // Each stream runs as far as it can before the next one is tried; the loop ends when
    // none of the three moved.
    for (;;) {
      bool step = false;
      for (; me.ci < me.nc; ++me.ci) {
        const Op& op = me.comp[me.ci];
        if (!input_ready(op) || (op.wait >= 0 && me.ki <= static_cast<std::size_t>(op.wait))) break;
        if (op.kind == OpKind::F) st[unit(op.stage, op.mb)].f = 1;
        if (op.kind == OpKind::B || op.kind == OpKind::BW) st[unit(op.stage, op.mb)].b = 1;
        step = true;
      }
      for (; me.ki < me.nk; ++me.ki) {
        const Op& op = me.copy[me.ki];
        if (op.wait >= 0 && me.ci <= static_cast<std::size_t>(op.wait)) break;
        step = true;
      }
      for (int done = try_comm(r); done != 0; done = try_comm(r)) {
        if (done < 0) {
          if (Validation plan = check_p2p_plan(p); !plan) return plan;  // the root cause, if the plan is malformed
          return fail_v(error);
        }
        step = true;
      }
      if (!step) break;
      moved = true;
    }
    if (moved)
      for (int nb : {r + 1 == d ? 0 : r + 1, r == 0 ? d - 1 : r - 1})
        if (!queued[static_cast<std::size_t>(nb)]) {
          queued[static_cast<std::size_t>(nb)] = 1;
          work.push_back(nb);
        }
  }
  std::string stuck;
  int shown = 0;
  for (int r = 0; r < d && shown < 4; ++r) {
    const Streams& me = rs[static_cast<std::size_t>(r)];
    if (me.ci == me.nc && me.ki == me.nk && me.qi == me.nq) continue;
    if (shown == 0)
      if (Validation plan = check_p2p_plan(p); !plan) return plan;  // a malformed plan says more than "stuck"
    ++shown;
    stuck += "; rank " + num(r) + " waits at";
    if (me.ci < me.nc) stuck += " compute " + describe(me.comp[me.ci]);
    if (me.ki < me.nk) stuck += " copy " + describe(me.copy[me.ki]);
    if (me.qi < me.nq) stuck += " comm " + describe(me.comm[me.qi]);
  }
  if (shown > 0) return fail_v("the schedule deadlocks under the communicator's rendezvous semantics" + stuck);
  return {};
}

}  // namespace detail

/// Checks every rule of docs/design.md section 4: each (stage, mb) has F, B and W (or BW) exactly
/// once on its own rank; every dependency is met; the P2P plan completes without deadlock and
/// in order under the documented communicator semantics; every reload follows its offload and
/// precedes its backward; the copy stream is never double-booked. `threads`: see po::Workers.
constexpr Validation validate(const Program& p, Workers threads = {}) {
  if (detail::proven_valid(p, threads)) return {};
  // Not proven: the rules one by one, which name the first one broken (or accept).
  if (Validation v = detail::check_passes(p); !v) return v;
  if (Validation v = detail::check_copies(p); !v) return v;
  return detail::check_execution(p);
}

/// validate(), throwing schedule_error with the broken rule.
constexpr void require_valid(const Program& p) {
  if (Validation v = validate(p); !v) throw schedule_error("invalid schedule: " + v.error);
}

}  // namespace pipeoffload
