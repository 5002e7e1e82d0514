// pipeoffload/schedule/lower.hpp: a program lowered to what each rank's runtime executes.
//
// lower() works every rank's streams out once: each op's waits on its rank's other streams
// (data edges, copy edges, and memory waits), where the data-parallel reductions go in the
// comm stream, and a memory plan: every device buffer (saved unit, stash, boundary tensor) at
// an offset in one region, and the pinned host bins per size. Offsets come from one witnessed
// execution of the whole program (every rank's compute, copy and comm streams as soon as
// possible under the program's costs, a send and its receive together, as NCCL's rendezvous
// has it): a buffer takes bytes the witness had given back, and its op waits for the ops that
// gave them back. Every wait points backwards in the witness, so the program stays free of
// deadlock, and under any timing no two live buffers overlap: the region is what the rank
// reserves, the witness's peak plus fragmentation, by construction. po::Runtime interprets
// this value; docs/memory.md has the argument.
/// @file
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "../error.hpp"
#include "../policy/host_bins.hpp"
#include "detail/numeric.hpp"
#include "program.hpp"

namespace pipeoffload {

/// Bytes of one stage's buffers for the runtime's microbatch shape.
struct StageBytes {
  std::size_t saved = 0;   ///< one activation unit (F to W)
  std::size_t stash = 0;   ///< B to W
  std::size_t input = 0;   ///< its input boundary (what it receives forward, sends back backward)
  std::size_t output = 0;  ///< its output boundary
};

/// `count` blocks of `bytes`.
struct BlockCount {
  std::size_t bytes = 0;  ///< size of each block, bytes
  std::size_t count = 0;  ///< number of blocks
  /// Field-by-field equality.
  friend constexpr bool operator==(const BlockCount&, const BlockCount&) = default;
};

/// Offsets and sizes of the device buffers in a lowered memory plan are multiples of this
/// (cudaMalloc's alignment: enough for every vector load, cuBLASLt and cuDNN operand).
inline constexpr std::size_t buffer_alignment = 256;

/// A buffer's bytes in the region: `bytes` rounded up to buffer_alignment (0 counts as 1:
/// every buffer has an address).
constexpr std::size_t buffer_bytes(std::size_t bytes) {
  return ((bytes > 0 ? bytes : 1) + buffer_alignment - 1) / buffer_alignment * buffer_alignment;
}

/// compute_at / copy_at / comm_at entry of an op that takes no buffer there.
inline constexpr std::size_t no_buffer = static_cast<std::size_t>(-1);

/// A rank's three streams.
enum class Stream : std::uint8_t { compute, copy, comm };

/// What one op waits for before it starts: per stream, the last op of the rank's stream whose
/// end it needs (-1: none; its own stream's entry stays -1, stream order covers it). Streams
/// run in order, so one index per stream is all a wait needs. With two copy streams
/// (Costs::copy_streams) a wait for copy op k is for every copy op up to k, on both of them
/// (copy_waits), and a copy op's own entry is that of the other copy stream.
struct Waits {
  std::array<int, 3> last{-1, -1, -1};  ///< indexed by Stream
  /// The index waited for on `s` (-1: none).
  constexpr int on(Stream s) const { return last[static_cast<std::size_t>(s)]; }
  /// Adds a wait for op `index` of stream `s` (keeps the later of two).
  constexpr void add(Stream s, int index) {
    int& w = last[static_cast<std::size_t>(s)];
    w = std::max(w, index);
  }
  /// Field-by-field equality.
  friend constexpr bool operator==(const Waits&, const Waits&) = default;
};

/// One rank's program as its runtime executes it.
struct LoweredRank {
  std::vector<Waits> compute;  ///< per compute op (RankProgram::compute's order): what it waits for
  std::vector<Waits> copy;     ///< per copy op
  std::vector<Waits> comm;     ///< per comm op
  std::vector<int> last_w;     ///< per chunk: the compute op of its last W or BW (-1: none)
  std::vector<int> reduces;    ///< chunks with a W, in the order of their last W (their reductions' order)
  std::vector<int> reduce_at;  ///< per chunk: the comm op its reduction goes before (comm.size(): after all)
  // The memory plan. Device buffers (saved units, stashes, boundary tensors) live at offsets
  // in one region of `region` bytes, each offset and size a multiple of buffer_alignment: per
  // op, where the buffers it takes go. compute_at[x]: F's unit and output, B/BW's stash and
  // dx (no_buffer where it takes none); copy_at[y]: where an R reloads its unit; comm_at[k]:
  // where a recv puts its tensor. Pinned host bins are blocks per size (`host`).
  std::size_t region = 0;                              ///< device bytes of the region
  std::vector<std::array<std::size_t, 2>> compute_at;  ///< per compute op: offsets of what it takes
  std::vector<std::size_t> copy_at;                    ///< per copy op: offset of an R's unit
  std::vector<std::size_t> comm_at;                    ///< per comm op: offset of a recv's tensor
  std::array<std::size_t, 3> peak{};  ///< most bytes of units, stashes, boundary tensors alive at once in the witness
  std::size_t peak_total = 0;         ///< most bytes of the three alive at once in the witness (<= region)
  std::vector<BlockCount> host;       ///< pinned host: offload bins (powers of two), blocks per size
  std::size_t memory_waits = 0;       ///< waits the memory plan added beyond the data edges
  /// The witness honoured the PCIe pairs' copy waits (Runtime::pair_with may pair this rank's
  /// copies); false where the schedule does not stagger pairs, or where those waits together
  /// with the program's edges would form a cycle (pairing would hang: pair_with refuses).
  bool paired = false;
};

/// The forward passes and forward messages of `p`, in their order (what evaluation runs): no
/// backward, no copies. Its P2P plan is a subsequence of one global order (the training
/// plan's), so it cannot deadlock under the rendezvous semantics either.
constexpr Program forward_only(const Program& p) {
  Program q;
  q.spec = p.spec;
  q.shape = p.shape;
  q.group = p.group;
  q.costs = p.costs;
  q.ranks.resize(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    RankProgram& out = q.ranks[r];
    out.slot_length = p.ranks[r].slot_length;
    for (Op op : p.ranks[r].compute)
      if (op.kind == OpKind::F) {
        op.wait = -1;
        out.compute.push_back(op);
      }
    for (const CommOp& c : p.ranks[r].comm)
      if (c.dir == Dir::forward) out.comm.push_back(c);
  }
  return q;
}

/// Before each of `mine`'s copies, how many of the PCIe partner's (`theirs`, in stream order)
/// must have completed: up to and including the partner's last copy in the SAME direction
/// planned to end no later than it starts, on the two ranks' slot grids (what
/// Runtime::pair_with synchronises). Only a copy in the same direction shares the switch's
/// uplink with it (PCIe is full duplex), so the pair never copies in one direction at once,
/// while a reload need not wait for the partner's offloads.
constexpr std::vector<std::size_t> pair_waits(const RankProgram& mine, const RankProgram& theirs) {
  std::vector<std::size_t> w(mine.copy.size(), 0);
  const double T = mine.slot_length, U = theirs.slot_length;
  const double eps = detail::tolerance(std::max(T, U));
  std::size_t k = 0;
  std::size_t last[2] = {0, 0};  // per direction (O, R): 1 + index of the partner's latest copy so far
  for (std::size_t y = 0; y < mine.copy.size(); ++y) {
    const double start = static_cast<double>(mine.copy_slot[y]) * T;
    for (; k < theirs.copy.size() && static_cast<double>(theirs.copy_slot[k] + 1) * U <= start + eps; ++k)
      last[theirs.copy[k].kind == OpKind::O ? 0 : 1] = k + 1;
    w[y] = last[mine.copy[y].kind == OpKind::O ? 0 : 1];
  }
  return w;
}

namespace detail {

/// Which comm op feeds each compute op (its received input, -1 for none), and which compute
/// op produces each send's data (-1 for a recv).
struct StreamLinks {
  std::vector<int> input_recv;     ///< per compute op
  std::vector<int> send_producer;  ///< per comm op
};

/// Index of a boundary tensor: (consuming stage, microbatch, direction).
constexpr std::size_t tag_slot(const Shape& sh, int stage, int mb, Dir dir) {
  return (static_cast<std::size_t>(stage) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(mb)) * 2 +
         (dir == Dir::backward ? 1 : 0);
}

constexpr StreamLinks stream_links(const Shape& sh, const RankProgram& rp) {
  const std::size_t tags = static_cast<std::size_t>(sh.stages()) * static_cast<std::size_t>(sh.m) * 2;
  std::vector<int> recv_of(tags, -1), producer(tags, -1);
  for (std::size_t k = 0; k < rp.comm.size(); ++k) {
    const CommOp& c = rp.comm[k];
    if (!c.send) recv_of[tag_slot(sh, c.stage, c.mb, c.dir)] = static_cast<int>(k);
  }
  const int S = sh.stages();
  StreamLinks l;
  l.input_recv.assign(rp.compute.size(), -1);
  for (std::size_t x = 0; x < rp.compute.size(); ++x) {
    const Op& op = rp.compute[x];
    if (op.kind == OpKind::F) {
      if (op.stage > 0) l.input_recv[x] = recv_of[tag_slot(sh, op.stage, op.mb, Dir::forward)];
      if (op.stage < S - 1) producer[tag_slot(sh, op.stage + 1, op.mb, Dir::forward)] = static_cast<int>(x);
    }
    if (op.kind == OpKind::B || op.kind == OpKind::BW) {
      if (op.stage < S - 1) l.input_recv[x] = recv_of[tag_slot(sh, op.stage, op.mb, Dir::backward)];
      if (op.stage > 0) producer[tag_slot(sh, op.stage - 1, op.mb, Dir::backward)] = static_cast<int>(x);
    }
  }
  l.send_producer.assign(rp.comm.size(), -1);
  for (std::size_t k = 0; k < rp.comm.size(); ++k) {
    const CommOp& c = rp.comm[k];
    if (c.send) l.send_producer[k] = producer[tag_slot(sh, c.stage, c.mb, c.dir)];
  }
  return l;
}

/// The data edges of one rank and where its reductions go.
constexpr LoweredRank data_edges(const Shape& sh, const RankProgram& rp, bool duplex) {
  LoweredRank lr;
  const StreamLinks links = stream_links(sh, rp);
  lr.compute.resize(rp.compute.size());
  lr.copy.resize(rp.copy.size());
  lr.comm.resize(rp.comm.size());
  for (std::size_t x = 0; x < rp.compute.size(); ++x) {
    if (links.input_recv[x] >= 0) lr.compute[x].add(Stream::comm, links.input_recv[x]);
    if (rp.compute[x].wait >= 0) lr.compute[x].add(Stream::copy, rp.compute[x].wait);
  }
  for (std::size_t y = 0, last_o = 0; y < rp.copy.size(); ++y) {
    if (rp.copy[y].wait >= 0) lr.copy[y].add(Stream::compute, rp.copy[y].wait);
    // Two copy streams: a reload follows every copy before it (the offloads' stream too).
    if (duplex && rp.copy[y].kind == OpKind::R && last_o > 0)
      lr.copy[y].add(Stream::copy, static_cast<int>(last_o) - 1);
    if (rp.copy[y].kind == OpKind::O) last_o = y + 1;
  }
  for (std::size_t k = 0; k < rp.comm.size(); ++k)
    if (rp.comm[k].send && links.send_producer[k] >= 0) lr.comm[k].add(Stream::compute, links.send_producer[k]);
  // A reduction goes right after the last P2P message that comes from, or feeds, a compute op
  // up to its chunk's last W: nothing it waits for then waits for a later message, and later
  // messages wait for it only in the comm stream's order.
  lr.last_w.assign(static_cast<std::size_t>(sh.v), -1);
  for (std::size_t x = 0; x < rp.compute.size(); ++x)
    if (rp.compute[x].kind == OpKind::W || rp.compute[x].kind == OpKind::BW)
      lr.last_w[static_cast<std::size_t>(sh.chunk_of(rp.compute[x].stage))] = static_cast<int>(x);
  for (int c = 0; c < sh.v; ++c)
    if (lr.last_w[static_cast<std::size_t>(c)] >= 0) lr.reduces.push_back(c);
  std::vector<int> anchor(rp.comm.size(), static_cast<int>(rp.compute.size()));
  for (std::size_t k = 0; k < rp.comm.size(); ++k)
    if (rp.comm[k].send) anchor[k] = links.send_producer[k];
  for (std::size_t x = 0; x < rp.compute.size(); ++x)
    if (links.input_recv[x] >= 0) anchor[static_cast<std::size_t>(links.input_recv[x])] = static_cast<int>(x);
  lr.reduce_at.assign(static_cast<std::size_t>(sh.v), 0);
  for (int c : lr.reduces)
    for (std::size_t k = 0; k < rp.comm.size(); ++k)
      if (anchor[k] <= lr.last_w[static_cast<std::size_t>(c)])
        lr.reduce_at[static_cast<std::size_t>(c)] = static_cast<int>(k) + 1;
  std::sort(lr.reduces.begin(), lr.reduces.end(), [&](int a, int b) {
    return lr.last_w[static_cast<std::size_t>(a)] < lr.last_w[static_cast<std::size_t>(b)];
  });
  return lr;
}

/// One start or end of an op in a rank's witnessed order.
struct Event {
  Stream stream = Stream::compute;
  int index = 0;       ///< the op's index in its stream
  bool start = false;  ///< its start (takes buffers) or its end (gives them back)
};

/// The witness: every rank's ops as soon as possible under the data edges, the streams'
/// orders (two copy streams' copies too, one after another in the copy list's order: an
/// execution of either, so that every wait the memory plan adds points back in that order), the PCIe pairs' waits (with staggered pairs) and the reductions' places, a send and
/// its receive starting together; then each rank's starts and ends in one order that every
/// edge respects (an op's end before the start of any op that waits for it, a zero-length op
/// starting and ending at once). Empty when the edges form a cycle. `pairs`: honour the PCIe
/// pairs' copy waits (pair_waits) where the schedule staggers pairs.
constexpr std::vector<std::vector<Event>> witness(const Program& p, const std::vector<LoweredRank>& data, bool pairs) {
  const Shape& sh = p.shape;
  const Costs& costs = p.costs;
  const std::size_t d = static_cast<std::size_t>(sh.d);
  // Node numbering: per rank, compute ops, copy ops, comm ops, then one reduction per chunk.
  std::vector<std::size_t> base(d + 1, 0);
  for (std::size_t r = 0; r < d; ++r) {
    const RankProgram& rp = p.ranks[r];
    base[r + 1] = base[r] + rp.compute.size() + rp.copy.size() + rp.comm.size() + static_cast<std::size_t>(sh.v);
  }
  const std::size_t n = base[d];
  const auto node = [&](std::size_t r, Stream s, std::size_t i) {
    const RankProgram& rp = p.ranks[r];
    switch (s) {
      case Stream::compute:
        return base[r] + i;
      case Stream::copy:
        return base[r] + rp.compute.size() + i;
      case Stream::comm:
        return base[r] + rp.compute.size() + rp.copy.size() + i;
    }
    return base[r];
  };
  const auto reduce_node = [&](std::size_t r, int c) {
    const RankProgram& rp = p.ranks[r];
    return base[r] + rp.compute.size() + rp.copy.size() + rp.comm.size() + static_cast<std::size_t>(c);
  };
  // A receive is its send's node (rendezvous): rep[] maps every node to the one that stands
  // for it.
  std::vector<std::size_t> rep(n);
  for (std::size_t i = 0; i < n; ++i) rep[i] = i;
  {
    const std::size_t tags = static_cast<std::size_t>(sh.stages()) * static_cast<std::size_t>(sh.m) * 2;
    std::vector<std::size_t> sender(tags, n);
    for (std::size_t r = 0; r < d; ++r)
      for (std::size_t k = 0; k < p.ranks[r].comm.size(); ++k) {
        const CommOp& c = p.ranks[r].comm[k];
        if (c.send) sender[tag_slot(sh, c.stage, c.mb, c.dir)] = node(r, Stream::comm, k);
      }
    for (std::size_t r = 0; r < d; ++r)
      for (std::size_t k = 0; k < p.ranks[r].comm.size(); ++k) {
        const CommOp& c = p.ranks[r].comm[k];
        if (c.send) continue;
        const std::size_t s = sender[tag_slot(sh, c.stage, c.mb, c.dir)];
        if (s == n)
          throw error("po::lower: rank " + std::to_string(r) + "'s comm op " + std::to_string(k) +
                      " receives a message no rank sends");
        rep[node(r, Stream::comm, k)] = s;
      }
  }
  std::vector<double> dur(n, 0.0);
  std::vector<char> used(n, 0);
  std::vector<std::vector<std::size_t>> succ(n);
  std::vector<int> indeg(n, 0);
  const auto edge = [&](std::size_t from, std::size_t to) {
    from = rep[from];
    to = rep[to];
    succ[from].push_back(to);
    ++indeg[to];
  };
  for (std::size_t r = 0; r < d; ++r) {
    const RankProgram& rp = p.ranks[r];
    const LoweredRank& lr = data[r];
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const Op& op = rp.compute[x];
      const std::size_t me = node(r, Stream::compute, x);
      used[me] = 1;
      dur[me] = op.kind == OpKind::F   ? costs.F(op.stage)
                : op.kind == OpKind::B ? costs.B(op.stage)
                : op.kind == OpKind::W ? costs.W(op.stage)
                                       : costs.B(op.stage) + costs.W(op.stage);
      if (x > 0) edge(node(r, Stream::compute, x - 1), me);
      for (Stream s : {Stream::copy, Stream::comm})
        if (lr.compute[x].on(s) >= 0) edge(node(r, s, static_cast<std::size_t>(lr.compute[x].on(s))), me);
    }
    std::vector<std::size_t> partner;
    const std::size_t pr = r ^ 1u;
    const bool paired = pairs && costs.stagger_pairs && pr < d && !rp.copy.empty() && !rp.copy_slot.empty() &&
                        p.ranks[pr].copy_slot.size() == p.ranks[pr].copy.size();
    if (paired) partner = pair_waits(rp, p.ranks[pr]);
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      const std::size_t me = node(r, Stream::copy, y);
      used[me] = 1;
      dur[me] = costs.T_O(rp.copy[y].stage);
      if (y > 0) edge(node(r, Stream::copy, y - 1), me);
      if (lr.copy[y].on(Stream::compute) >= 0)
        edge(node(r, Stream::compute, static_cast<std::size_t>(lr.copy[y].on(Stream::compute))), me);
      if (paired && partner[y] > 0) edge(node(pr, Stream::copy, partner[y] - 1), me);
    }
    // The comm stream: the P2P ops with the reductions at their places.
    std::size_t prev = n;
    const auto chain = [&](std::size_t me) {
      if (prev != n) edge(prev, me);
      prev = me;
    };
    std::size_t q = 0;
    for (std::size_t k = 0; k <= rp.comm.size(); ++k) {
      for (; q < lr.reduces.size() &&
             static_cast<std::size_t>(lr.reduce_at[static_cast<std::size_t>(lr.reduces[q])]) <= k;
           ++q) {
        const int c = lr.reduces[q];
        const std::size_t me = reduce_node(r, c);
        used[me] = 1;
        edge(node(r, Stream::compute, static_cast<std::size_t>(lr.last_w[static_cast<std::size_t>(c)])), me);
        chain(me);
      }
      if (k == rp.comm.size()) break;
      const std::size_t me = node(r, Stream::comm, k);
      used[rep[me]] = 1;
      dur[rep[me]] = costs.comm;
      if (lr.comm[k].on(Stream::compute) >= 0)
        edge(node(r, Stream::compute, static_cast<std::size_t>(lr.comm[k].on(Stream::compute))), me);
      chain(me);
    }
  }
  // As soon as possible, in a topological order (Kahn's); its position breaks ties below.
  std::vector<double> start(n, 0.0);
  std::vector<std::size_t> order_of(n, 0), ready;
  std::size_t live = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (used[i] != 0 && rep[i] == i) {
      ++live;
      if (indeg[i] == 0) ready.push_back(i);
    }
  std::size_t seen = 0;
  while (!ready.empty()) {
    const std::size_t u = ready.back();
    ready.pop_back();
    order_of[u] = seen++;
    const double end = start[u] + dur[u];
    for (std::size_t v : succ[u]) {
      start[v] = std::max(start[v], end);
      if (--indeg[v] == 0) ready.push_back(v);
    }
  }
  if (seen != live) return {};  // a cycle: some ops can never start
  // Each rank's events, ordered by time; at one time, the ends of ops that ran, then the
  // zero-length ops (start, end) in topological order, then the starts of ops that take time.
  struct Key {
    double time;
    int group;
    std::size_t order;
    int phase;
    Event e;
  };
  std::vector<std::vector<Event>> out(d);
  for (std::size_t r = 0; r < d; ++r) {
    const RankProgram& rp = p.ranks[r];
    std::vector<Key> keys;
    const auto add = [&](Stream s, std::size_t i) {
      const std::size_t u = rep[node(r, s, i)];
      const Event st{s, static_cast<int>(i), true}, en{s, static_cast<int>(i), false};
      if (dur[u] > 0) {
        keys.push_back({start[u], 2, order_of[u], 0, st});
        keys.push_back({start[u] + dur[u], 0, order_of[u], 0, en});
      } else {
        keys.push_back({start[u], 1, order_of[u], 0, st});
        keys.push_back({start[u], 1, order_of[u], 1, en});
      }
    };
    for (std::size_t x = 0; x < rp.compute.size(); ++x) add(Stream::compute, x);
    for (std::size_t y = 0; y < rp.copy.size(); ++y) add(Stream::copy, y);
    for (std::size_t k = 0; k < rp.comm.size(); ++k) add(Stream::comm, k);
    std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
      return std::tie(a.time, a.group, a.order, a.phase) < std::tie(b.time, b.group, b.order, b.phase);
    });
    out[r].reserve(keys.size());
    for (const Key& k : keys) out[r].push_back(k.e);
  }
  return out;
}

/// Blocks of one pinned host bin size. With one copy stream the lowest free one is taken (that
/// stream's order covers every reuse); with two (`fifo`), the one given back longest ago, and
/// the offload that takes it waits for the reload that gave it back (`giver`), which then has
/// most likely ended already.
struct BinPool {
  std::size_t bytes = 0, count = 0;
  bool fifo = false;
  std::vector<std::size_t> free;  // a min-heap; fifo: a queue from `head`
  std::size_t head = 0;
  std::vector<int> giver;  // per block: the copy op that last gave it back (-1: none)
  constexpr std::size_t take() {
    if (fifo) {
      if (head == free.size()) {
        giver.push_back(-1);
        return count++;
      }
      return free[head++];
    }
    if (free.empty()) return count++;
    std::pop_heap(free.begin(), free.end(), std::greater<>{});
    const std::size_t b = free.back();
    free.pop_back();
    return b;
  }
  constexpr void give(std::size_t b, int by) {
    if (fifo) {
      if (head > 64 && 2 * head > free.size()) {
        free.erase(free.begin(), free.begin() + static_cast<std::ptrdiff_t>(head));
        head = 0;
      }
      free.push_back(b);
      giver[b] = by;
      return;
    }
    free.push_back(b);
    std::push_heap(free.begin(), free.end(), std::greater<>{});
  }
};

/// The memory plan of rank `rank` from its witnessed order: every device buffer's lifetime in
/// that order, then offsets for them (largest first, each at the lowest offset free of every
/// placed buffer alive at the same time), then the waits that order every reuse of bytes: a
/// buffer's op waits for the ops that gave back each earlier buffer its bytes overlap.
constexpr void plan_memory(const Program& p, int rank, std::span<const StageBytes> bytes,
                           const std::vector<Event>& order, LoweredRank& lr) {
  const Shape& sh = p.shape;
  const int S = sh.stages();
  const RankProgram& rp = p.ranks[static_cast<std::size_t>(rank)];
  bool training = false;  // evaluation's F keeps nothing: its unit is scratch, given back at its end
  for (const Op& op : rp.compute) training = training || op.kind != OpKind::F;
  lr.compute_at.assign(rp.compute.size(), {no_buffer, no_buffer});
  lr.copy_at.assign(rp.copy.size(), no_buffer);
  lr.comm_at.assign(rp.comm.size(), no_buffer);
  // Every buffer: its kind, bytes, lifetime [take, give) in positions of `order`, the op that
  // takes it (and where its offset goes) and the op that gives it back.
  struct Buffer {
    int kind = 0;
    std::size_t bytes = 0, take = 0, give = 0, offset = 0;
    Event taker, giver;
    std::size_t* at = nullptr;
  };
  std::vector<Buffer> bufs;
  const std::size_t units = static_cast<std::size_t>(S) * static_cast<std::size_t>(sh.m);
  // The buffer now alive for each unit and stash (by stage, mb) and boundary tensor (by tag);
  // host bins' blocks by (stage, mb, bin).
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> unit_of(units, none), stash_of(units, none), box_of(units * 2, none), bin_at(units * 3);
  const auto uidx = [&](const Op& op) {
    return static_cast<std::size_t>(op.stage) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(op.mb);
  };
  std::vector<BinPool> bins;
  std::size_t pos = 0;
  Event now{};
  enum { activation, stash, message };
  const auto take = [&](int kind, std::size_t n, std::size_t& slot, std::size_t& at) {
    slot = bufs.size();
    bufs.push_back(Buffer{kind, buffer_bytes(n), pos, static_cast<std::size_t>(-1), 0, now, now, &at});
  };
  const auto give = [&](std::size_t& slot) {
    if (slot == none) throw error("po::lower: a buffer is given back before it is taken (a program's op out of order)");
    bufs[slot].give = pos;
    bufs[slot].giver = now;
    slot = none;
  };
  const auto bin_pool = [&](std::size_t b) -> BinPool& {
    for (BinPool& bp : bins)
      if (bp.bytes == b) return bp;
    BinPool fresh;
    fresh.bytes = b;
    fresh.fifo = p.costs.duplex();
    bins.push_back(std::move(fresh));
    return bins.back();
  };
  const auto box_bytes = [&](int stage, Dir dir) {
    return dir == Dir::forward ? bytes[static_cast<std::size_t>(stage)].input
                               : bytes[static_cast<std::size_t>(stage)].output;
  };
  for (; pos < order.size(); ++pos) {
    const Event& e = order[pos];
    now = e;
    const std::size_t i = static_cast<std::size_t>(e.index);
    if (e.stream == Stream::compute) {
      const Op& op = rp.compute[i];
      const StageBytes& b = bytes[static_cast<std::size_t>(op.stage)];
      const std::size_t u = uidx(op);
      if (op.kind == OpKind::F) {
        if (e.start) {
          take(activation, b.saved, unit_of[u], lr.compute_at[i][0]);
          if (op.stage < S - 1)
            take(message, b.output, box_of[tag_slot(sh, op.stage + 1, op.mb, Dir::forward)], lr.compute_at[i][1]);
        } else {
          if (op.stage > 0) give(box_of[tag_slot(sh, op.stage, op.mb, Dir::forward)]);
          if (!training) give(unit_of[u]);
        }
      }
      if (op.kind == OpKind::B || op.kind == OpKind::BW) {
        if (e.start) {
          take(stash, b.stash, stash_of[u], lr.compute_at[i][0]);
          if (op.stage > 0)
            take(message, b.input, box_of[tag_slot(sh, op.stage - 1, op.mb, Dir::backward)], lr.compute_at[i][1]);
        } else if (op.stage < S - 1) {
          give(box_of[tag_slot(sh, op.stage, op.mb, Dir::backward)]);
        }
      }
      if ((op.kind == OpKind::W || op.kind == OpKind::BW) && !e.start) {
        give(stash_of[u]);
        give(unit_of[u]);
      }
    } else if (e.stream == Stream::copy) {
      const Op& op = rp.copy[i];
      const std::size_t saved = bytes[static_cast<std::size_t>(op.stage)].saved, u = uidx(op);
      const offload::BinPlan plan = offload::plan_bins(saved);
      const bool o = op.kind == OpKind::O;
      if (o == e.start)  // an offload takes its bins as it starts; a reload gives them back at its end
        for (int j = 0; j < plan.count; ++j) {
          BinPool& bp = bin_pool(static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(j)]));
          std::size_t& at = bin_at[u * 3 + static_cast<std::size_t>(j)];
          if (o) {
            at = bp.take();
            if (bp.fifo && bp.giver[at] >= 0) lr.copy[i].add(Stream::copy, bp.giver[at]);
          } else {
            bp.give(at, static_cast<int>(i));
          }
        }
      if (o && !e.start) give(unit_of[u]);
      if (!o && e.start) take(activation, saved, unit_of[u], lr.copy_at[i]);
    } else {
      const CommOp& c = rp.comm[i];
      std::size_t& slot = box_of[tag_slot(sh, c.stage, c.mb, c.dir)];
      if (!c.send && e.start) take(message, box_bytes(c.stage, c.dir), slot, lr.comm_at[i]);
      if (c.send && !e.start) give(slot);
    }
  }
  // Peaks in the witness, per kind (0..2) and together (-1).
  const auto peak_of = [&](int kind) {
    std::vector<std::pair<std::size_t, long long>> delta;  // (position, +-bytes)
    for (const Buffer& b : bufs)
      if (kind < 0 || b.kind == kind) {
        delta.push_back({b.take, static_cast<long long>(b.bytes)});
        delta.push_back({b.give, -static_cast<long long>(b.bytes)});
      }
    std::sort(delta.begin(), delta.end());
    long long alive = 0, most = 0;
    for (const auto& [at, n] : delta) most = std::max(most, alive += n);
    return static_cast<std::size_t>(most);
  };
  for (int k = 0; k < 3; ++k) lr.peak[static_cast<std::size_t>(k)] = peak_of(k);
  lr.peak_total = peak_of(-1);
  // Offsets: buffers in a few orders (largest first; longest-lived first; largest then
  // longest-lived; by time alone; one kind after another), each in the lowest (or the smallest)
  // gap clear of the buffers already placed whose lifetimes meet its own; the smallest region
  // wins. Each order breaks its ties by time, first forwards (earliest taken first), then
  // backwards (last given back first: the plan of the program run in reverse, which packs a
  // cooldown's stashes before the steady state's units that leave them holes of the wrong size).
  // `widen`: units and stashes take the largest of their sizes (equal slots suit first fit).
  std::size_t widest = 0;
  for (const Buffer& b : bufs)
    if (b.kind != message) widest = std::max(widest, b.bytes);
  // Each buffer's neighbours: the buffers alive at some moment of its life (a sweep over the
  // witness: whoever is alive when a buffer is taken meets it).
  std::vector<std::vector<std::size_t>> meets(bufs.size());
  {
    std::vector<std::pair<std::size_t, std::size_t>> events;  // (position, buffer), takes and gives
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      events.push_back({bufs[k].take, k});
      events.push_back({bufs[k].give, k});
    }
    std::sort(events.begin(), events.end());
    std::vector<std::size_t> alive;
    for (const auto& [when, k] : events) {
      if (bufs[k].give == when) {
        alive.erase(std::find(alive.begin(), alive.end(), k));
        continue;
      }
      for (const std::size_t j : alive) {
        meets[k].push_back(j);
        meets[j].push_back(k);
      }
      alive.push_back(k);
    }
  }
  const auto place = [&](const std::vector<std::size_t>& in_order, bool best_fit, bool widen,
                         std::vector<std::size_t>& at) {
    const auto size = [&](const Buffer& b) { return widen && b.kind != message ? widest : b.bytes; };
    std::vector<char> placed(bufs.size(), 0);
    std::vector<std::pair<std::size_t, std::size_t>> busy;
    std::size_t top = 0;
    at.assign(bufs.size(), 0);
    for (const std::size_t k : in_order) {
      const Buffer& me = bufs[k];
      busy.clear();
      for (const std::size_t j : meets[k])
        if (placed[j] != 0) busy.push_back({at[j], at[j] + size(bufs[j])});
      std::sort(busy.begin(), busy.end());
      // The gaps between the busy ranges: the lowest that holds it, or (best fit) the smallest.
      std::size_t x = 0, edge = 0, chosen = static_cast<std::size_t>(-1), gap = static_cast<std::size_t>(-1);
      for (const auto& [lo, hi] : busy) {
        if (lo >= edge + size(me) && lo - edge < gap) {
          chosen = edge;
          gap = lo - edge;
          if (!best_fit) break;
        }
        edge = std::max(edge, hi);
      }
      x = chosen != static_cast<std::size_t>(-1) ? chosen : edge;
      at[k] = x;
      top = std::max(top, x + size(me));
      placed[k] = 1;
    }
    return top;
  };
  std::vector<std::size_t> order_k(bufs.size()), best_at, at;
  std::size_t best = static_cast<std::size_t>(-1);
  const auto life = [&](const Buffer& b) { return b.give - b.take; };
  // Kind orders for the kind-first strategies: every permutation of (units, stashes, tensors).
  constexpr std::array<std::array<int, 3>, 6> kinds{{{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}}};
  constexpr int orders = 4 + 6, fits = 4;  // (first or best fit) x (exact or widened sizes)
  // No region is smaller than the witness's peak: the first order that reaches it ends the search.
  for (int strategy = 0; strategy < 2 * orders * fits && best > lr.peak_total; ++strategy) {
    for (std::size_t k = 0; k < bufs.size(); ++k) order_k[k] = k;
    const int how = strategy / fits % orders;
    const bool backwards = strategy >= orders * fits;
    // Time as a sort key: the take forwards, the give reversed backwards.
    const auto t = [&](const Buffer& b) {
      return backwards ? -static_cast<long long>(b.give) : static_cast<long long>(b.take);
    };
    std::sort(order_k.begin(), order_k.end(), [&](std::size_t a, std::size_t b) {
      const Buffer &x = bufs[a], &y = bufs[b];
      switch (how) {
        case 0:
          return std::tuple(y.bytes, t(x)) < std::tuple(x.bytes, t(y));
        case 1:
          return std::tuple(life(y), t(x)) < std::tuple(life(x), t(y));
        case 2:
          return std::tuple(y.bytes, life(y), t(x)) < std::tuple(x.bytes, life(x), t(y));
        case 3:
          return t(x) < t(y);
        default: {  // one kind after another, each in time
          const auto& rank_of = kinds[static_cast<std::size_t>(how - 4)];
          return std::tuple(rank_of[static_cast<std::size_t>(x.kind)], t(x)) <
                 std::tuple(rank_of[static_cast<std::size_t>(y.kind)], t(y));
        }
      }
    });
    const std::size_t top = place(order_k, strategy % 2 == 1, strategy % fits >= 2, at);
    if (top < best) {
      best = top;
      best_at = at;
    }
  }
  lr.region = bufs.empty() ? 0 : best;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    bufs[k].offset = best_at[k];
    *bufs[k].at = best_at[k];
  }
  // Waits: a buffer's taker waits for the giver of every buffer before it on its bytes (on
  // another stream: its own stream's order covers the rest). A sweep over the witness keeps,
  // per range of the region, the latest givers on each stream (streams run in order, so the
  // latest stands for every earlier one).
  {
    // Piecewise constant: last[i].second holds from last[i].first to the next key.
    std::vector<std::pair<std::size_t, Waits>> last{{0, Waits{}}};
    const auto key = [&](std::size_t at) {
      return std::upper_bound(last.begin(), last.end(), at,
                              [](std::size_t a, const std::pair<std::size_t, Waits>& e) { return a < e.first; });
    };
    const auto split = [&](std::size_t at) {
      auto it = key(at);
      const auto& before = *std::prev(it);
      if (before.first != at) last.insert(it, {at, before.second});
    };
    std::vector<std::pair<std::size_t, std::size_t>> events;  // (position, buffer)
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      events.push_back({bufs[k].take, k});
      events.push_back({bufs[k].give, k});
    }
    std::sort(events.begin(), events.end());
    for (const auto& [when, k] : events) {
      const Buffer& b = bufs[k];
      split(b.offset);
      split(b.offset + b.bytes);
      const auto lo = std::prev(key(b.offset)), hi = std::prev(key(b.offset + b.bytes));
      if (b.give == when) {
        for (auto it = lo; it != hi; ++it) it->second.add(b.giver.stream, b.giver.index);
        continue;
      }
      Waits& w = b.taker.stream == Stream::compute ? lr.compute[static_cast<std::size_t>(b.taker.index)]
                 : b.taker.stream == Stream::copy  ? lr.copy[static_cast<std::size_t>(b.taker.index)]
                                                   : lr.comm[static_cast<std::size_t>(b.taker.index)];
      for (auto it = lo; it != hi; ++it)
        for (Stream s : {Stream::compute, Stream::copy, Stream::comm})
          if (s != b.taker.stream && it->second.on(s) > w.on(s)) {
            w.add(s, it->second.on(s));
            ++lr.memory_waits;
          }
    }
  }
  for (const BinPool& bp : bins)
    if (bp.count > 0) lr.host.push_back({bp.bytes, bp.count});
  std::sort(lr.host.begin(), lr.host.end(), [](const BlockCount& a, const BlockCount& b) { return a.bytes < b.bytes; });
}

}  // namespace detail

namespace detail {

constexpr void check_lowering(const Program& p, std::span<const StageBytes> stages) {
  if (static_cast<int>(stages.size()) != p.shape.stages())
    throw error("po::lower: " + std::to_string(stages.size()) +
                " stage sizes given; the program has S = " + std::to_string(p.shape.stages()) + " stages");
}

/// Every rank's data edges, and the witness: with the PCIe pairs' copy waits where they leave
/// the program free of cycles (then every rank's `paired` is set), else without them.
constexpr std::vector<std::vector<Event>> witness(const Program& p, std::vector<LoweredRank>& data) {
  data.clear();
  data.reserve(p.ranks.size());
  for (const RankProgram& rp : p.ranks) data.push_back(data_edges(p.shape, rp, p.costs.duplex()));
  std::vector<std::vector<Event>> order = witness(p, data, true);
  bool paired = !order.empty();
  if (!paired) order = witness(p, data, false);
  if (order.empty())
    throw error(
        "po::lower: the program's streams wait for each other in a cycle (some ops can never start); "
        "validate() says where");
  for (LoweredRank& lr : data) lr.paired = paired && p.costs.stagger_pairs;
  return order;
}

}  // namespace detail

/// `p` lowered for rank `rank` whose stages' buffers are `stages[s]` (S entries; another
/// rank's saved and stash bytes are not read): its waits (data edges and the memory plan's),
/// its reductions' places and its memory plan. The witness is the whole program's, so every
/// rank's lowering agrees with every other's on the order of their messages.
constexpr LoweredRank lower(const Program& p, int rank, std::span<const StageBytes> stages) {
  if (rank < 0 || rank >= p.shape.d)
    throw error("po::lower: rank = " + std::to_string(rank) + " is outside [0, " + std::to_string(p.shape.d - 1) + "]");
  detail::check_lowering(p, stages);
  std::vector<LoweredRank> data;
  const std::vector<std::vector<detail::Event>> order = detail::witness(p, data);
  LoweredRank lr = std::move(data[static_cast<std::size_t>(rank)]);
  detail::plan_memory(p, rank, stages, order[static_cast<std::size_t>(rank)], lr);
  return lr;
}

/// Every rank of `p` lowered (lower() of each, one witness for all), with `stages[s]` every
/// stage's bytes.
constexpr std::vector<LoweredRank> lower_all(const Program& p, std::span<const StageBytes> stages) {
  detail::check_lowering(p, stages);
  std::vector<LoweredRank> data;
  const std::vector<std::vector<detail::Event>> order = detail::witness(p, data);
  for (int r = 0; r < p.shape.d; ++r)
    detail::plan_memory(p, r, stages, order[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)]);
  return data;
}

}  // namespace pipeoffload
