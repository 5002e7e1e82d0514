// pipeoffload/schedule/detail/p2p.hpp: step 4 of build(): each rank's P2P plan, in the global order of
// the messages' planned times (plan_p2p_rank), and PO's planner from a rank's own list (plan_p2p_po_rank).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../program.hpp"
#include "orders.hpp"

namespace pipeoffload {

namespace detail {

/// Rank r's P2P plan. `end(rank, x, op)` is the planned end time of compute op x (`op`) of a
/// rank. A message's key: (time its producer ends, producer stage, mb, dir). Sender and
/// receiver order by the same key, which gives one global order that every rank's plan
/// follows. A rank's sends follow its compute stream, so they are already in key order; so
/// are the messages each neighbour sends it. A rank's plan is the merge of those three lists.
template <class End>
constexpr void plan_p2p_rank(Program& p, int r, const End& end) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  if (d == 1) return;  // one rank: no messages
  struct Cursor {
    const Op* ops = nullptr;  // the compute ops of the rank this cursor walks
    std::size_t n = 0, x = 0;
    int rank = -1;     // that rank
    int to_rank = -1;  // -1: every message it sends; else only those to to_rank
    double t = 0;      // planned end of ops[x]
  };
  // Rank the message produced by `op` on rank `from` goes to, or -1 if it sends none (the
  // first or last stage, or a consumer on the same rank).
  const auto sends_to = [S, &sh](const Op& op, int from) {
    int to = -1;
    if (op.kind == OpKind::F && op.stage < S - 1) to = sh.rank_of(op.stage + 1);
    if ((op.kind == OpKind::B || op.kind == OpKind::BW) && op.stage > 0) to = sh.rank_of(op.stage - 1);
    return to != from ? to : -1;
  };
  const auto settle = [&](Cursor& c) {
    for (; c.x < c.n; ++c.x) {
      const int to = sends_to(c.ops[c.x], c.rank);
      if (to >= 0 && (c.to_rank < 0 || to == c.to_rank)) {
        c.t = end(c.rank, c.x, c.ops[c.x]);
        return;
      }
    }
  };
  const auto before = [](const Cursor& a, const Cursor& b) {
    if (a.t != b.t) return a.t < b.t;
    const Op& oa = a.ops[a.x];
    const Op& ob = b.ops[b.x];
    if (oa.stage != ob.stage) return oa.stage < ob.stage;
    if (oa.mb != ob.mb) return oa.mb < ob.mb;
    return (oa.kind == OpKind::F ? 0 : 1) < (ob.kind == OpKind::F ? 0 : 1);
  };
  const auto cursor = [&](int rank, int to_rank) {
    Cursor c;
    if (rank < 0) return c;
    const auto& ops = p.ranks[static_cast<std::size_t>(rank)].compute;
    c = Cursor{ops.data(), ops.size(), 0, rank, to_rank, 0.0};
    settle(c);
    return c;
  };
  const int prev = r == 0 ? d - 1 : r - 1, next = r + 1 == d ? 0 : r + 1;
  Cursor cur[3] = {cursor(r, -1), cursor(prev, r), cursor(prev == next ? -1 : next, r)};
  auto& comm = p.ranks[static_cast<std::size_t>(r)].comm;
  comm.reserve(4 * p.ranks[static_cast<std::size_t>(r)].compute.size() / 3 + 4);
  for (;;) {
    int best = -1;
    for (int l = 0; l < 3; ++l)
      if (cur[l].x < cur[l].n && (best < 0 || before(cur[l], cur[best]))) best = l;
    if (best < 0) break;
    Cursor& c = cur[best];
    const Op& op = c.ops[c.x];
    const bool fwd = op.kind == OpKind::F;
    const int consumer = fwd ? op.stage + 1 : op.stage - 1;
    const Dir dir = fwd ? Dir::forward : Dir::backward;
    if (best == 0)
      comm.push_back(CommOp{true, sends_to(op, r), consumer, op.mb, dir});
    else
      comm.push_back(CommOp{false, c.rank, consumer, op.mb, dir});
    ++c.x;
    settle(c);
  }
}

/// Scratch of plan_p2p_po_rank, kept across ranks.
struct P2PScratch {
  struct Item {
    long long key;  // producer slot * 2^21 + producer stage
    int x;          // the compute op of this rank that sends or consumes the message
  };
  std::vector<Item> own, from_prev, from_next;
  std::vector<long long> delta;
};

/// Rank r's P2P plan on PO's grid, from rank r's own compute list (`slots`: the slot of each
/// of its ops, Block::slot): the messages it receives are those its passes consume (F of stage s > 0 from
/// rank r-1, B of stage s < S-1 from rank r+1), and their producers' slots follow from
/// Block::slot. Merged with its sends in the key order of plan_p2p_rank, this is that plan
/// as long as rank r consumes each neighbour's messages in the order they are sent (their
/// keys increase along rank r's list); otherwise it returns false and writes nothing.
/// The key (slot end, producer stage, ...) is compared as (slot, producer stage): the caller
/// makes sure slot end times increase strictly with the slot, and one slot and stage name
/// one pass.
constexpr bool plan_p2p_po_rank(Program& p, const Block& bk, const long long* slots, int r, P2PScratch& ws) {
  const Shape& sh = p.shape;
  const int S = sh.stages(), d = sh.d;
  if (d == 1) return true;
  const int prev = r == 0 ? d - 1 : r - 1, next = r + 1 == d ? 0 : r + 1;
  const auto& ops = p.ranks[static_cast<std::size_t>(r)].compute;
  const Op* const o = ops.data();
  const int n = static_cast<int>(ops.size());
  // A producer's slot is the consumer's plus an offset that depends only on the consumer's
  // chunk (g = 1: both slots grow by L per microbatch).
  const auto v = static_cast<std::size_t>(bk.v);
  auto& delta = ws.delta;
  delta.resize(2 * v);
  for (std::size_t c = 0; c < v; ++c) {
    const int s = static_cast<int>(c) * d + r;
    delta[2 * c] = s > 0 ? bk.slot(prev, Op{OpKind::F, s - 1, 0}) - bk.slot(r, Op{OpKind::F, s, 0}) : 0;
    delta[2 * c + 1] = s < S - 1 ? bk.slot(next, Op{OpKind::B, s + 1, 0}) - bk.slot(r, Op{OpKind::B, s, 0}) : 0;
  }
  auto& own = ws.own;
  auto& fp = ws.from_prev;
  auto& fn = ws.from_next;
  own.resize(static_cast<std::size_t>(n));
  fp.resize(static_cast<std::size_t>(n));
  fn.resize(static_cast<std::size_t>(n));
  std::size_t ni = 0, nj = 0, nk = 0;
  for (int x = 0; x < n; ++x) {
    const Op& op = o[x];
    const long long slot = slots[x];
    const auto c = static_cast<std::size_t>(bk.chunk(op.stage));
    if (op.kind == OpKind::F) {
      if (op.stage < S - 1) own[ni++] = {(slot << 21) | op.stage, x};
      if (op.stage > 0) {
        const long long key = ((slot + delta[2 * c]) << 21) | (op.stage - 1);
        if (nj > 0 && fp[nj - 1].key >= key) return false;
        fp[nj++] = {key, x};
      }
    } else if (op.kind == OpKind::B || op.kind == OpKind::BW) {
      if (op.stage > 0) own[ni++] = {(slot << 21) | op.stage, x};
      if (op.stage < S - 1) {
        const long long key = ((slot + delta[2 * c + 1]) << 21) | (op.stage + 1);
        if (nk > 0 && fn[nk - 1].key >= key) return false;
        fn[nk++] = {key, x};
      }
    }
  }
  // Sized first and then filled: CommOp's bit-fields are stored read-modify-write, and a read
  // of a fresh page maps the zero page, which the write then has to replace.
  auto& comm = p.ranks[static_cast<std::size_t>(r)].comm;
  comm.resize(ni + nj + nk);
  CommOp* q = comm.data();
  constexpr long long end = 0x7fffffffffffffffLL;
  std::size_t i = 0, j = 0, k = 0;
  for (;; ++q) {
    const long long ki = i < ni ? own[i].key : end, kj = j < nj ? fp[j].key : end, kk = k < nk ? fn[k].key : end;
    if (ki < kj && ki < kk) {
      const Op& op = o[own[i++].x];
      const bool fwd = op.kind == OpKind::F;
      *q =
          CommOp{true, fwd ? next : prev, fwd ? op.stage + 1 : op.stage - 1, op.mb, fwd ? Dir::forward : Dir::backward};
    } else if (kj < kk) {
      const Op& op = o[fp[j++].x];
      *q = CommOp{false, prev, op.stage, op.mb, Dir::forward};
    } else if (kk != end) {
      const Op& op = o[fn[k++].x];
      *q = CommOp{false, next, op.stage, op.mb, Dir::backward};
    } else {
      break;
    }
  }
  return true;
}

}  // namespace detail
}  // namespace pipeoffload
