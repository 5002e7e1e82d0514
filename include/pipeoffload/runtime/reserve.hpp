// pipeoffload/runtime/reserve.hpp: what one rank's program can hold at once, computed without a device.
//
// po::Runtime takes from a backend that models backend::reserves_memory, when it is
// constructed, every buffer its rank's program can need, so that no step takes device or
// pinned host memory from the system. reservation_plan() says how many: per buffer kind and
// size, the most blocks in use at once over EVERY timing the streams' orders and events allow
// (not only the simulated one). It is a pure function of (program, rank, sizes), tested in
// tests/runtime/test_memory.cpp against the simulator.
//
// forward_only() is the program Runtime::evaluate runs: the F passes and forward messages of
// a training program, in their order. Its P2P plan is a subsequence of one global order (the
// training plan's), so it cannot deadlock under the rendezvous semantics either.
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../policy/host_bins.hpp"
#include "../schedule/program.hpp"

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

/// The blocks one rank reserves, per kind, each list by increasing size.
struct Reservation {
  std::vector<BlockCount> activation;  ///< device: saved units
  std::vector<BlockCount> stash;       ///< device: B-to-W stashes
  std::vector<BlockCount> message;     ///< device: boundary tensors received or waiting to be sent
  std::vector<BlockCount> host;        ///< pinned host: offload bins (powers of two)
  /// Blocks of `bytes` in `list` (0 if none).
  static std::size_t count(const std::vector<BlockCount>& list, std::size_t bytes) {
    for (const BlockCount& b : list)
      if (b.bytes == bytes) return b.count;
    return 0;
  }
};

namespace detail {

/// What one op of a stream does to one size of buffer: blocks it takes as it starts and
/// blocks it gives back as it ends (the runtime's ops take before they give).
struct BlockEffect {
  long long take = 0, give = 0;
};

/// The most blocks in use at once when stream A and stream B run in their orders, each op
/// starting only once the other stream has completed the op it waits for (a_waits[x]: index
/// of the B op that A's op x waits for, -1 for none; and b_waits for B), under ANY timing:
/// every combination of "A has completed i ops and may be running op i" and "B has completed
/// j ops and may be running op j" that the waits allow is a state, and the answer is the
/// largest count over them. Both bounds on j move up with i, so a sliding window maximum
/// does it in O(|A| + |B|). An empty B gives the peak of A alone.
inline long long two_stream_peak(const std::vector<BlockEffect>& A, const std::vector<int>& a_waits,
                                 const std::vector<BlockEffect>& B, const std::vector<int>& b_waits) {
  // A stream's states: 2k = k ops done, none running; 2k+1 = k done, op k running.
  struct State {
    long long in_use;
    std::size_t done, started;
  };
  const auto states = [](const std::vector<BlockEffect>& ops) {
    std::vector<State> st;
    long long net = 0;
    for (std::size_t k = 0; k <= ops.size(); ++k) {
      st.push_back({net, k, k});
      if (k == ops.size()) break;
      st.push_back({net + ops[k].take, k, k + 1});
      net += ops[k].take - ops[k].give;
    }
    return st;
  };
  // need[k]: ops of the other stream that must be done before this stream has started k ops.
  // (An empty waits vector means no op of that stream waits.)
  const auto needs = [](const std::vector<BlockEffect>& ops, const std::vector<int>& waits) {
    std::vector<std::size_t> need(ops.size() + 1, 0);
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const int w = k < waits.size() ? waits[k] : -1;
      need[k + 1] = std::max(need[k], static_cast<std::size_t>(w + 1));
    }
    return need;
  };
  const std::vector<State> sa = states(A), sb = states(B);
  const std::vector<std::size_t> need_b = needs(A, a_waits), need_a = needs(B, b_waits);
  long long best = 0;
  std::deque<std::size_t> window;  // indices into sb, in_use decreasing
  std::size_t lo = 0, hi = 0;      // sb[lo, hi) may pair with the current A state
  for (const State& a : sa) {
    while (hi < sb.size() && need_a[sb[hi].started] <= a.done) {
      while (!window.empty() && sb[window.back()].in_use <= sb[hi].in_use) window.pop_back();
      window.push_back(hi++);
    }
    while (lo < sb.size() && sb[lo].done < need_b[a.started]) ++lo;
    while (!window.empty() && window.front() < lo) window.pop_front();
    if (!window.empty()) best = std::max(best, a.in_use + sb[window.front()].in_use);
  }
  return best;
}

/// Which comm op feeds each compute op (its received input, -1 for none), and which compute
/// op produces each send's data (-1 for a recv). The runtime's events follow these.
struct StreamLinks {
  std::vector<int> input_recv;     ///< per compute op
  std::vector<int> send_producer;  ///< per comm op
};

inline std::size_t tag_slot(const Shape& sh, int stage, int mb, Dir dir) {
  return (static_cast<std::size_t>(stage) * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(mb)) * 2 +
         (dir == Dir::backward ? 1 : 0);
}

inline StreamLinks stream_links(const Shape& sh, const RankProgram& rp) {
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

inline std::vector<std::size_t> distinct(std::vector<std::size_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

/// Keeps the larger count per size (training and evaluation never run at once).
inline void merge_max(std::vector<BlockCount>& into, const std::vector<BlockCount>& from) {
  for (const BlockCount& b : from) {
    auto it = std::find_if(into.begin(), into.end(), [&](const BlockCount& x) { return x.bytes == b.bytes; });
    if (it == into.end())
      into.push_back(b);
    else
      it->count = std::max(it->count, b.count);
  }
  std::sort(into.begin(), into.end(), [](const BlockCount& a, const BlockCount& b) { return a.bytes < b.bytes; });
}

/// Boundary blocks of one rank's compute and comm streams, per size.
inline std::vector<BlockCount> message_blocks(const Shape& sh, const RankProgram& rp,
                                              std::span<const StageBytes> bytes) {
  const int S = sh.stages();
  const StreamLinks links = stream_links(sh, rp);
  const std::size_t nc = rp.compute.size(), nk = rp.comm.size();
  std::vector<int> comm_waits(nk);
  for (std::size_t k = 0; k < nk; ++k) comm_waits[k] = rp.comm[k].send ? links.send_producer[k] : -1;
  // The size of a message consumed by `stage`: its input forward, its output's gradient backward.
  const auto msg = [&](int stage, Dir dir) {
    return dir == Dir::forward ? bytes[static_cast<std::size_t>(stage)].input
                               : bytes[static_cast<std::size_t>(stage)].output;
  };
  std::vector<std::size_t> sizes;
  for (const CommOp& c : rp.comm) sizes.push_back(msg(c.stage, c.dir));
  for (const Op& op : rp.compute) {
    const StageBytes& b = bytes[static_cast<std::size_t>(op.stage)];
    if (op.stage > 0) sizes.push_back(b.input);
    if (op.stage < S - 1) sizes.push_back(b.output);
  }
  std::vector<BlockCount> out;
  for (std::size_t size : distinct(sizes)) {
    std::vector<BlockEffect> c(nc), k(nk);
    for (std::size_t x = 0; x < nc; ++x) {
      const Op& op = rp.compute[x];
      const StageBytes& b = bytes[static_cast<std::size_t>(op.stage)];
      const bool f = op.kind == OpKind::F, bw = op.kind == OpKind::B || op.kind == OpKind::BW;
      // F takes its output and gives back its input; B takes its input's gradient (dx) and
      // gives back its output's (dy).
      if (f) {
        c[x].take = op.stage < S - 1 && b.output == size;
        c[x].give = op.stage > 0 && b.input == size;
      }
      if (bw) {
        c[x].take = op.stage > 0 && b.input == size;
        c[x].give = op.stage < S - 1 && b.output == size;
      }
    }
    for (std::size_t j = 0; j < nk; ++j) {
      const bool mine = msg(rp.comm[j].stage, rp.comm[j].dir) == size;
      k[j].take = mine && !rp.comm[j].send;
      k[j].give = mine && rp.comm[j].send;
    }
    const long long n = two_stream_peak(c, links.input_recv, k, comm_waits);
    if (n > 0) out.push_back({size, static_cast<std::size_t>(n)});
  }
  return out;
}

}  // namespace detail

/// The forward passes and forward messages of `p`, in their order (what evaluation runs):
/// no backward, no copies, no cross-stream edges.
inline Program forward_only(const Program& p) {
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

/// Per kind and size, the most blocks rank `rank` of `p` can hold at once under any timing of
/// its training steps and of its evaluation (forward_only(p)). `stages[s]`: stage s's bytes.
/// Activation units are taken by F and R and given back by W/BW and O (compute with copy);
/// stashes by B/BW and W/BW (compute alone); boundary tensors by F/B (outputs) and recvs
/// (inputs), given back by sends and by the F/B that consumed them (compute with comm);
/// pinned host bins by O and R (copy alone). Other ranks only narrow the timings further.
inline Reservation reservation_plan(const Program& p, int rank, std::span<const StageBytes> stages) {
  const Shape& sh = p.shape;
  if (rank < 0 || rank >= sh.d)
    throw error("po::reservation_plan: rank = " + std::to_string(rank) + " is outside [0, " + std::to_string(sh.d - 1) +
                "]");
  if (static_cast<int>(stages.size()) != sh.stages())
    throw error("po::reservation_plan: " + std::to_string(stages.size()) +
                " stage sizes given; the program has S = " + std::to_string(sh.stages()) + " stages");
  const RankProgram& rp = p.ranks[static_cast<std::size_t>(rank)];
  const std::size_t nc = rp.compute.size(), ny = rp.copy.size();
  std::vector<int> compute_waits_copy(nc), copy_waits(ny), none;
  for (std::size_t x = 0; x < nc; ++x) compute_waits_copy[x] = rp.compute[x].wait;
  for (std::size_t y = 0; y < ny; ++y) copy_waits[y] = rp.copy[y].wait;
  const auto of = [&](const Op& op) -> const StageBytes& { return stages[static_cast<std::size_t>(op.stage)]; };
  Reservation res;
  std::vector<std::size_t> saved, stash;
  for (const Op& op : rp.compute) {
    saved.push_back(of(op).saved);
    stash.push_back(of(op).stash);
  }
  for (std::size_t bytes : detail::distinct(saved)) {
    std::vector<detail::BlockEffect> c(nc), y(ny);
    for (std::size_t x = 0; x < nc; ++x) {
      const Op& op = rp.compute[x];
      if (of(op).saved != bytes) continue;
      c[x].take = op.kind == OpKind::F;
      c[x].give = op.kind == OpKind::W || op.kind == OpKind::BW;
    }
    for (std::size_t k = 0; k < ny; ++k) {
      const Op& op = rp.copy[k];
      if (of(op).saved != bytes) continue;
      y[k].take = op.kind == OpKind::R;
      y[k].give = op.kind == OpKind::O;
    }
    res.activation.push_back(
        {bytes, static_cast<std::size_t>(detail::two_stream_peak(c, compute_waits_copy, y, copy_waits))});
  }
  for (std::size_t bytes : detail::distinct(stash)) {
    std::vector<detail::BlockEffect> c(nc);
    for (std::size_t x = 0; x < nc; ++x) {
      const Op& op = rp.compute[x];
      if (of(op).stash != bytes) continue;
      c[x].take = op.kind == OpKind::B || op.kind == OpKind::BW;
      c[x].give = op.kind == OpKind::W || op.kind == OpKind::BW;
    }
    const long long n = detail::two_stream_peak(c, none, {}, none);
    if (n > 0) res.stash.push_back({bytes, static_cast<std::size_t>(n)});
  }
  res.message = detail::message_blocks(sh, rp, stages);
  const Program eval = forward_only(p);
  detail::merge_max(res.message, detail::message_blocks(sh, eval.ranks[static_cast<std::size_t>(rank)], stages));
  // Pinned host bins, one power of two at a time.
  std::vector<std::size_t> bins;
  for (const Op& op : rp.copy) {
    const offload::BinPlan plan = offload::plan_bins(of(op).saved);
    for (int i = 0; i < plan.count; ++i)
      bins.push_back(static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(i)]));
  }
  for (std::size_t bin : detail::distinct(bins)) {
    std::vector<detail::BlockEffect> y(ny);
    for (std::size_t k = 0; k < ny; ++k) {
      const Op& op = rp.copy[k];
      const offload::BinPlan plan = offload::plan_bins(of(op).saved);
      long long n = 0;
      for (int i = 0; i < plan.count; ++i) n += plan.bins[static_cast<std::size_t>(i)] == bin;
      y[k].take = op.kind == OpKind::O ? n : 0;
      y[k].give = op.kind == OpKind::R ? n : 0;
    }
    const long long n = detail::two_stream_peak(y, none, {}, none);
    if (n > 0) res.host.push_back({bin, static_cast<std::size_t>(n)});
  }
  return res;
}

}  // namespace pipeoffload
