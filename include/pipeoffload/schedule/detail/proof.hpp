// pipeoffload/schedule/detail/proof.hpp: the linear proof that a program is valid (proven_valid),
// which validate() tries before the rules of validate.hpp: one sweep of each rank's three
// streams, then one pass around the ring of ranks. It accepts only programs the rules accept;
// on any other it gives up and leaves the verdict to them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../program.hpp"
#include "default_init.hpp"
#include "numeric.hpp"
#include "parallel.hpp"

namespace pipeoffload::detail {

/// Linear sweeps that prove a program valid, or give up (false) and leave the verdict and its
/// message to the rules of validate.hpp. They never accept a program those would reject:
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
  const bool duplex = p.costs.duplex();  // a slot may hold a reload and then an offload
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
  const auto sweep = [&p, &ring, d, S, m, units, fused, duplex, chunk](int r, std::vector<Unit>& st) {
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
        if (ki > 0 && slot[ki] <= slot[ki - 1] &&
            !(duplex && slot[ki] == slot[ki - 1] && copy[ki - 1].kind == OpKind::R && op.kind == OpKind::O))
          return false;
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

}  // namespace pipeoffload::detail
