// pipeoffload/schedule/validate.hpp: the rules every built schedule must satisfy. Its P2P
// plan is checked under the communicators' semantics (docs/schedules.md, "Communicator
// semantics"; NCCL's, the strictest in use): valid only if the untimed execution of all ranks'
// streams under them completes every op (check_execution). validate() first tries to prove
// that in one linear sweep (proven_valid); only when the proof fails does it run the rules one
// by one, which decide and name the broken rule.
/// @file
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "detail/asap.hpp"
#include "detail/default_init.hpp"
#include "detail/numeric.hpp"
#include "detail/parallel.hpp"
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
      if (y > 0 && rp.copy_slot[static_cast<std::size_t>(y)] <= rp.copy_slot[static_cast<std::size_t>(y - 1)])
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

/// Linear sweeps that prove a program valid, or give up (false) and leave the verdict and its
/// message to the rules above. They never accept a program those would reject:
///   - per rank, its three streams are run against each other in one pass, with every
///     receive taken as already delivered. That checks the passes (each unit's F, B, W or BW
///     once, on its own rank, in order), the copy stream (each offload after its F, each
///     reload after its offload and before its backward, slots strictly increasing, edges in
///     range), that every pass's input message is received before it runs and every send
///     follows the pass that produces it, and that the rank's order of compute, copy and
///     P2P ops has no cycle of its own;
///   - across ranks, that the messages can be put in one global order that every rank's P2P
///     list follows. Neighbours r and r+1 must list the messages between them in the same
///     order (send on one side, receive on the other); then no cycle of waits can stay
///     between neighbours, and the one left to rule out runs around the ring of ranks. From
///     each message between ranks 0 and 1, the earliest message between ranks 0 and 1 that
///     rendezvous can reach after going once around the ring (either way) must be a later
///     one. Going around more often, or back and forth, reaches nothing earlier.
/// Under those conditions the untimed execution of check_execution() completes: each rank's
/// ops fit in one order with its messages, and the messages in one order for all ranks, so
/// the ops of all ranks and the messages form no cycle (docs/design.md section 4).
/// The per-rank sweeps and the comparisons between neighbours run on the machine's cores
/// (detail/parallel.hpp); going around the ring is one pass over the ranks.
constexpr bool proven_valid(const Program& p, Workers threads = {}) {
  const Shape& sh = p.shape;
  const int d = sh.d, v = sh.v, m = sh.m;
  if (d < 1 || d > max_ranks || v < 1 || v > max_chunks || m < 1 || m > max_microbatches) return false;
  // The proof follows the interleaved ring (stage s + 1 on the next rank); a V placement is
  // left to the rules and the execution.
  if (sh.placement != Placement::interleaved) return false;
  if (static_cast<int>(p.ranks.size()) != d) return false;
  const int S = d * v;
  const bool fused = fused_backward(p.spec.family);
  // chunk_of(s) = s / d without a division.
  const FastDiv by_d(static_cast<std::uint64_t>(d), static_cast<std::uint64_t>(d) * static_cast<std::uint64_t>(v));
  const auto chunk = [by_d](int s) { return static_cast<int>(by_d(static_cast<std::uint64_t>(s))); };

  // Per unit of the rank being swept (chunk-major): what has run, and where.
  enum : std::uint16_t { kF = 1, kB = 2, kW = 4, kO = 8, kR = 16, kFmsg = 32, kBmsg = 64, kFsent = 128, kBsent = 256 };
  struct Unit {
    std::uint16_t has = 0;
    int fpos = 0;  // position of its F in the compute stream
    int rpos = 0;  // position of its reload in the copy stream
  };
  const std::size_t units = static_cast<std::size_t>(v) * static_cast<std::size_t>(m);

  std::size_t most = 0, ops = 0;  // the longest P2P list: every index below fits an int
  for (const RankProgram& rp : p.ranks) {
    most = std::max(most, rp.comm.size());
    ops += rp.compute.size() + rp.copy.size() + rp.comm.size();
  }
  if (most > 0x7ffffff0u) return false;
  // E_r = the messages between ranks r and r+1, in P2P-list order. Rank r lists E_{r-1}
  // (its messages with r-1) and E_r interleaved: for the i-th message of E_{r-1}, how many of
  // E_r come before it (next_before(i)), and for the j-th message of E_r, how many of
  // E_{r-1} (prev_before(j)). With d = 2 both neighbours are one rank and its list is one E.
  // And each message's key, from its own fields: its consumer's chunk, whether the consumer
  // is the later rank of the two, mb, direction and send (as the sweep checks the consumer's
  // rank, this names the message among those between the two ranks).
  // One array per rank holds each of these for E_{r-1} from the front and for E_r from the
  // back, with a spare entry between them, so that the sweep writes both without a branch.
  struct Ring {
    std::vector<int, default_init<int>> at;
    std::vector<std::uint32_t, default_init<std::uint32_t>> keys;
    std::size_t n_prev = 0, n_next = 0;  // |E_{r-1}|, |E_r|
    constexpr int next_before(std::size_t i) const { return at[i]; }
    constexpr int prev_before(std::size_t j) const { return at[at.size() - 1 - j]; }
    constexpr std::uint32_t prev_key(std::size_t i) const { return keys[i]; }
    constexpr std::uint32_t next_key(std::size_t j) const { return keys[keys.size() - 1 - j]; }
  };
  std::vector<Ring> ring(static_cast<std::size_t>(d));

  // Rank r's sweep; false if it finds a broken rule or cannot finish. (The shape is copied
  // in: the unit table's stores cannot then be taken to change it.)
  const auto sweep = [&p, &ring, d, S, m, units, fused, chunk](int r, std::vector<Unit>& st) {
    const RankProgram& rp = p.ranks[static_cast<std::size_t>(r)];
    const Op* const comp = rp.compute.data();
    const Op* const copy = rp.copy.data();
    const CommOp* const comm = rp.comm.data();
    const long long* const slot = rp.copy_slot.data();
    const std::size_t nc = rp.compute.size(), nk = rp.copy.size(), nq = rp.comm.size();
    if (rp.copy_slot.size() != nk) return false;
    if (d == 1 && nq != 0) return false;
    // Each unit's F, B and W (or F and BW) and nothing else: duplicates are rejected below,
    // so this count makes every one present.
    if (nc != (fused ? 2 : 3) * units || nk > 0x7ffffff0u) return false;
    st.assign(units, Unit{});
    Ring& rg = ring[static_cast<std::size_t>(r)];
    if (d > 2) rg.at.resize(nq + 1);
    if (d > 1) rg.keys.resize(nq + 1);
    int* const at = rg.at.data();
    std::uint32_t* const keys = rg.keys.data();
    std::size_t na = 0, nb = 0;  // messages with prev and with next so far
    std::size_t offloads = 0;
    std::size_t ci = 0, ki = 0, qi = 0;
    const int prev = r == 0 ? d - 1 : r - 1, next = r + 1 == d ? 0 : r + 1;
    for (;;) {
      const std::size_t ci0 = ci, ki0 = ki, qi0 = qi;
      for (; ci < nc; ++ci) {
        const Op& op = comp[ci];
        const int s = op.stage, mb = op.mb, w = op.wait;
        if (static_cast<unsigned>(s) >= static_cast<unsigned>(S) ||
            static_cast<unsigned>(mb) >= static_cast<unsigned>(m))
          return false;
        const int c = chunk(s);
        if (s - c * d != r || w >= static_cast<long long>(nk)) return false;
        Unit& u = st[static_cast<std::size_t>(c) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)];
        const std::uint16_t has = u.has;
        const bool waits_copy = w >= 0 && ki <= static_cast<std::size_t>(w);
        const OpKind kind = op.kind;
        if (kind == OpKind::F) {
          if (has & kF) return false;
          if (s > 0) {
            if (d == 1) {
              if (!(st[static_cast<std::size_t>(c - 1) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)]
                        .has &
                    kF))
                return false;
            } else if (!(has & kFmsg)) {
              break;  // its input is not received yet
            }
          }
          if (waits_copy) break;
          u.has = has | kF;
          u.fpos = static_cast<int>(ci);
        } else if (kind == OpKind::W) {
          if (fused || (has & kW) || !(has & kB)) return false;
          if (waits_copy) break;
          u.has = has | kW;
        } else if (kind == OpKind::B || kind == OpKind::BW) {
          if ((kind == OpKind::BW) != fused || (has & kB) || !(has & kF)) return false;
          if (s < S - 1) {
            if (d == 1) {
              if (!(st[static_cast<std::size_t>(c + 1) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)]
                        .has &
                    kB))
                return false;
            } else if (!(has & kBmsg)) {
              break;
            }
          }
          if (waits_copy) break;
          if ((has & kR) && u.rpos > w) return false;  // may start before its reload ends
          u.has = has | kB;
        } else {
          return false;
        }
      }
      for (; ki < nk; ++ki) {
        const Op& op = copy[ki];
        const int s = op.stage, mb = op.mb, w = op.wait;
        if (static_cast<unsigned>(s) >= static_cast<unsigned>(S) ||
            static_cast<unsigned>(mb) >= static_cast<unsigned>(m))
          return false;
        const int c = chunk(s);
        if (s - c * d != r || w >= static_cast<long long>(nc)) return false;
        if (ki > 0 && slot[ki] <= slot[ki - 1]) return false;
        if (w >= 0 && ci <= static_cast<std::size_t>(w)) break;
        Unit& u = st[static_cast<std::size_t>(c) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)];
        const std::uint16_t has = u.has;
        if (op.kind == OpKind::O) {
          // Once: after its F ends (the F is among the compute ops it waits for).
          if ((has & kO) || !(has & kF) || u.fpos > w) return false;
          u.has = has | kO;
          ++offloads;
        } else if (op.kind == OpKind::R) {
          // Once: after its offload, before its backward.
          if ((has & kR) || !(has & kO) || (has & kB)) return false;
          u.has = has | kR;
          u.rpos = static_cast<int>(ki);
        } else {
          return false;
        }
      }
      for (; qi < nq; ++qi) {
        const CommOp& q = comm[qi];
        const int s = q.stage, mb = q.mb;
        if (static_cast<unsigned>(s) >= static_cast<unsigned>(S) ||
            static_cast<unsigned>(mb) >= static_cast<unsigned>(m))
          return false;
        const bool fwd = q.dir == Dir::forward;
        if (fwd ? s == 0 : (q.dir != Dir::backward || s == S - 1)) return false;  // no producing stage
        // The consumer (stage s) and the producer (s - 1 forward, s + 1 backward) live on
        // neighbouring ranks.
        const int c = chunk(s), crank = s - c * d;
        Unit* u = nullptr;
        if (q.send) {
          // Produced here: the consumer is the next rank (forward) or the previous one.
          if (crank != (fwd ? next : prev) || q.peer != crank || d == 1) return false;
          const int cp = fwd ? (crank == 0 ? c - 1 : c) : (crank == d - 1 ? c + 1 : c);
          u = &st[static_cast<std::size_t>(cp) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)];
          if (!(u->has & (fwd ? kF : kB))) break;  // waits for the pass that produces it
          const std::uint16_t sent = fwd ? kFsent : kBsent;
          if (u->has & sent) return false;
          u->has |= sent;
        } else {
          if (crank != r || q.peer != (fwd ? prev : next)) return false;
          u = &st[static_cast<std::size_t>(c) * static_cast<std::size_t>(m) + static_cast<std::size_t>(mb)];
          const std::uint16_t got = fwd ? kFmsg : kBmsg;
          if (u->has & got) return false;
          u->has |= got;
        }
        if (d > 1) {
          // Written at both ends: the entry that is not this message's is the spare one, or
          // one that a later message overwrites. (d = 2: rank 0 lists E_0 as E_r, rank 1 as
          // E_{r-1}.)
          const bool with_prev = d == 2 ? r == 1 : q.peer == prev;
          const auto k = (static_cast<std::uint32_t>(c) << 19) |
                         (static_cast<std::uint32_t>(crank == (with_prev ? r : next)) << 18) |
                         (static_cast<std::uint32_t>(mb) << 2) | (fwd ? 0u : 2u) | (q.send ? 1u : 0u);
          keys[na] = k;
          keys[nq - nb] = k;
          if (d > 2) {
            at[na] = static_cast<int>(nb);
            at[nq - nb] = static_cast<int>(na);
          }
          na += with_prev ? 1 : 0;
          nb += with_prev ? 0 : 1;
        }
      }
      if (ci == ci0 && ki == ki0 && qi == qi0) break;
    }
    if (ci != nc || ki != nk || qi != nq) return false;
    rg.n_prev = na;
    rg.n_next = nb;
    // Every reload follows its offload, each once: as many offloads as reloads pairs them all.
    return 2 * offloads == nk;
  };

  const int workers = worker_count(ops, d, threads);
  std::vector<std::vector<Unit>> scratch(static_cast<std::size_t>(workers));
  std::vector<char> ok(static_cast<std::size_t>(d), 0);
  for_each_item(workers, d, [&](int r, int w) {
    ok[static_cast<std::size_t>(r)] = sweep(r, scratch[static_cast<std::size_t>(w)]);
  });
  for (const char x : ok)
    if (!x) return false;
  if (d == 1) return true;
  // Ranks b and b+1 list the messages between them in the same order, as the send on one
  // side and the receive on the other. (d = 2: b = 0 only.)
  const int boundaries = d == 2 ? 1 : d;
  for_each_item(workers, boundaries, [&](int b, int) {
    const Ring& x = ring[static_cast<std::size_t>(b)];
    const Ring& y = ring[b + 1 == d ? 0 : static_cast<std::size_t>(b + 1)];
    bool same = x.n_next == y.n_prev;
    for (std::size_t j = 0; same && j < x.n_next; ++j) same = x.next_key(j) == (y.prev_key(j) ^ 1u);
    ok[static_cast<std::size_t>(b)] = same;
  });
  for (const char x : ok)
    if (!x) return false;
  if (d <= 2) return true;

  // Once around the ring from each message of E_0: the earliest E_0 message reached must
  // come after it, clockwise (through ranks 1, 2, ..., d-1, 0) and counter-clockwise
  // (through ranks 0, d-1, ..., 1). cw[x]: the earliest message of E_r that rendezvous
  // reaches from E_0's message x through ranks 1..r (none: past the end); ccw[y]: the
  // earliest of E_0 reached from E_r's message y through ranks r..1.
  // The two walks are independent: one item each.
  constexpr int none = 0x7fffffff;
  const Ring& r1 = ring[1];
  const std::size_t n0 = r1.n_prev;  // |E_0|, as every rank that lists it agrees
  std::vector<int> cw(n0), ccw(r1.n_next);
  for_each_item(std::min(workers, 2), 2, [&](int walk, int) {
    if (walk == 0) {
      for (std::size_t x = 0; x < n0; ++x) cw[x] = r1.next_before(x);
      for (int r = 2; r < d; ++r) {
        const Ring& rg = ring[static_cast<std::size_t>(r)];
        for (int& k : cw)
          k = (k != none && static_cast<std::size_t>(k) < rg.n_prev) ? rg.next_before(static_cast<std::size_t>(k))
                                                                     : none;
      }
      return;
    }
    for (std::size_t y = 0; y < ccw.size(); ++y) {
      const int k = r1.prev_before(y);
      ccw[y] = static_cast<std::size_t>(k) < n0 ? k : none;
    }
    std::vector<int> ccw_next;
    for (int r = 2; r < d; ++r) {
      const Ring& rg = ring[static_cast<std::size_t>(r)];
      ccw_next.resize(rg.n_next);
      for (std::size_t y = 0; y < ccw_next.size(); ++y) {
        const int k = rg.prev_before(y);
        ccw_next[y] = static_cast<std::size_t>(k) < ccw.size() ? ccw[static_cast<std::size_t>(k)] : none;
      }
      std::swap(ccw, ccw_next);
    }
  });
  // Rank 0 lists E_{d-1} (phi: how many of E_0 come before each) and E_0 (psi: how many of
  // E_{d-1} before each).
  const Ring& r0 = ring[0];
  const std::size_t n_last = r0.n_prev;
  for (std::size_t x = 0; x < n0; ++x) {
    const int k = cw[x];
    if (k != none && static_cast<std::size_t>(k) < n_last &&
        static_cast<std::size_t>(r0.next_before(static_cast<std::size_t>(k))) <= x)
      return false;
  }
  for (std::size_t x = 0; x < n0; ++x) {
    const std::size_t k = static_cast<std::size_t>(r0.prev_before(x));
    if (k < n_last && ccw[k] != none && static_cast<std::size_t>(ccw[k]) <= x) return false;
  }
  return true;
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
