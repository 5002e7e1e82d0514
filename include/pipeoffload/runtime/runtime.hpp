// pipeoffload/runtime/runtime.hpp: po::Runtime, one rank of a pipeline executing a schedule.
//
// Each iteration the host thread enqueues the rank's whole program: F/B/W/BW on the compute
// stream, O/R on the copy stream, sends and receives on the comm stream in RankProgram::comm
// order, with every dependency an event (a received input, a produced output, the schedule's
// cross-stream edges). The streams then run as soon as possible under those events, which is
// exactly what simulate() models. After the passes: gradients (accumulated in microbatch order
// by the layers) are clipped by their global norm across all stages, checked for non-finite
// values, and one AdamW step with warmup + cosine learning rate is applied.
//
// Nothing in a step needs a value back from a pass, so the same code drives a synchronous
// backend (backend::Cpu) and an asynchronous one (backend::Cuda): the step's tokens and
// targets are uploaded to device memory before the passes, the last stage's losses are
// written to device memory and downloaded after them, and the optimizer's arithmetic (sums
// of squares, AdamW) runs on the device through the backend, on moments kept in device memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../backend/backend.hpp"
#include "../comm/communicator.hpp"
#include "../error.hpp"
#include "../model/layer.hpp"
#include "../model/math.hpp"
#include "../offload/host_bins.hpp"
#include "../schedule/schedule.hpp"
#include "../schedule/validate.hpp"
#include "../sim/simulate.hpp"

namespace pipeoffload {

/// Schedule argument of Runtime for a schedule chosen at run time (RuntimeOptions::spec).
struct AnySchedule {};

struct RuntimeOptions {
  Shape shape{};                    ///< d ranks, v chunks per rank, m microbatches
  MicrobatchShape microbatch{};     ///< batch x seq tokens per microbatch
  Costs costs{};                    ///< planning costs: T_F, T_B, T_W, k (offload placement)
  ScheduleSpec spec{};              ///< the schedule, for Runtime<AnySchedule, ...> only
  math::AdamW optimizer{};
};

/// One iteration's inputs: m microbatches of (batch, seq) token ids and next-token targets,
/// microbatch-major. Every rank gets the whole batch (stage 0 reads tokens, the last stage
/// targets).
struct Batch {
  std::span<const std::int32_t> tokens;
  std::span<const std::int32_t> targets;
};

/// What one step reports (identical on every rank except `memory` and `seconds`).
struct StepStats {
  int step = 0;             ///< 0-based index of the step just taken
  float loss = 0;           ///< mean over microbatches of each microbatch's mean loss
  double grad_norm = 0;     ///< global gradient norm before clipping
  float lr = 0;             ///< learning rate used
  double seconds = 0;       ///< wall time of the passes (enqueue to last stream idle)
  backend::MemoryStats memory{};  ///< this rank's device and host memory; peaks of this step
};

/// What ranks r and r^1 of a PCIe pair share when they run in one process: one counter per
/// side, raised by that side's copy stream after each copy (DESIGN.md section 3, "synchronized
/// interleaved"). Make one per pair, hand it to both ranks' runtimes with pair_with() before
/// their first step, and keep it alive as long as they are.
template <class Backend>
struct PairLink {
  static_assert(backend::pairs_copies<Backend>, "po::PairLink: the backend has no shared counters (backend::pairs_copies)");
  typename Backend::Counter side[2];  ///< side[r & 1]: copies completed by rank r
  void abort(const std::string& why) {
    for (auto& c : side) c.abort(why);
  }
};

namespace detail {

template <class L>
concept has_norm_groups = requires(const L& l) {
  { l.norm_groups() } -> std::convertible_to<std::vector<std::size_t>>;
};

template <class S>
struct schedule_of {
  static Program build(const RuntimeOptions& o) { return S::build(o.shape, o.costs); }
};
template <>
struct schedule_of<AnySchedule> {
  static Program build(const RuntimeOptions& o) { return pipeoffload::build(o.spec, o.shape, o.costs); }
};

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
inline long long two_stream_peak(const std::vector<BlockEffect>& A, const std::vector<int>& a_waits, const std::vector<BlockEffect>& B,
                                 const std::vector<int>& b_waits) {
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

}  // namespace detail

/// One rank of a pipeline: runs `Schedule`'s op lists for this rank with `Layer` stages on a
/// `Backend` device, exchanging boundary tensors through a `Communicator`.
/// @code
///   po::comm::ThreadsWorld world(d);
///   // on the thread of rank r:
///   po::backend::Cpu dev({.rank = r});
///   po::comm::Threads comm(world, r);
///   std::vector<MyLayer> mine = make_stages_of_rank(r);   // v layers, chunk order
///   po::Runtime<po::PO_F, MyLayer, po::backend::Cpu, po::comm::Threads> rt(opts, dev, comm, mine);
///   for (int step = 0; step < steps; ++step) rt.step(batch(step));
/// @endcode
template <class Schedule, class Layer, class Backend, class Communicator>
class Runtime {
  static_assert(backend::backend<Backend>,
                "po::Runtime: Backend must model po::backend::backend (streams, events, device_alloc/free, host_alloc/free, "
                "transfer, synchronize, abort, memory, context, now); see backend/backend.hpp.");
  static_assert(communicator<Communicator>,
                "po::Runtime: Communicator must model po::communicator (rank, size, send, recv, all_gather, abort); see "
                "comm/communicator.hpp.");
  static_assert(layer_for<Layer, typename Backend::Context>,
                "po::Runtime: Layer must model po::layer: it needs boundary_floats(shape), saved_bytes(shape), stash_bytes(shape), "
                "forward(ctx, mb, x, y, saved) -> void, backward_input(ctx, mb, dy, dx, saved, stash), "
                "backward_weight(ctx, mb, saved, stash), parameters() and gradients(); see model/layer.hpp.");

 public:
  /// `stages`: this rank's v layers in chunk order (stage c*d + rank is stages[c]); they must
  /// outlive the runtime, as must `dev` and `comm`.
  Runtime(const RuntimeOptions& opt, Backend& dev, Communicator& comm, std::span<Layer> stages)
      : opt_(opt), dev_(dev), comm_(comm), layers_(stages) {
    program_ = detail::schedule_of<Schedule>::build(opt_);
    require_valid(program_);
    const Shape& sh = program_.shape;
    rank_ = comm.rank();
    if (comm.size() != sh.d)
      throw error("po::Runtime: the communicator has " + std::to_string(comm.size()) + " ranks; the shape has d = " + std::to_string(sh.d));
    if (static_cast<int>(stages.size()) != sh.v)
      throw error("po::Runtime: rank " + std::to_string(rank_) + " was given " + std::to_string(stages.size()) +
                  " layers; it needs v = " + std::to_string(sh.v) + " (one per chunk)");
    if (opt_.microbatch.batch < 1 || opt_.microbatch.seq < 1)
      throw error("po::Runtime: microbatch shape batch = " + std::to_string(opt_.microbatch.batch) + ", seq = " +
                  std::to_string(opt_.microbatch.seq) + " must both be >= 1");
    const auto& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    boundary_ = layers_[0].boundary_floats(opt_.microbatch);
    for (int c = 0; c < sh.v; ++c) {
      Layer& l = layers_[static_cast<std::size_t>(c)];
      if (l.boundary_floats(opt_.microbatch) != boundary_)
        throw error("po::Runtime: stage " + std::to_string(sh.stage_of(rank_, c)) + " has a boundary of " +
                    std::to_string(l.boundary_floats(opt_.microbatch)) + " floats, stage " + std::to_string(rank_) + " of " +
                    std::to_string(boundary_) + "; all stages must agree");
      saved_.push_back(l.saved_bytes(opt_.microbatch));
      stash_.push_back(l.stash_bytes(opt_.microbatch));
      if (l.parameters().size() != l.gradients().size())
        throw error("po::Runtime: stage " + std::to_string(sh.stage_of(rank_, c)) + " has " + std::to_string(l.parameters().size()) +
                    " parameters but " + std::to_string(l.gradients().size()) + " gradients");
      std::vector<std::size_t> groups{l.parameters().size()};
      if constexpr (detail::has_norm_groups<Layer>) groups = l.norm_groups();
      std::size_t total = 0;
      for (std::size_t g : groups) total += g;
      if (total != l.parameters().size())
        throw error("po::Runtime: stage " + std::to_string(sh.stage_of(rank_, c)) + "'s norm_groups() cover " + std::to_string(total) +
                    " parameters, not its " + std::to_string(l.parameters().size()));
      groups_.push_back(std::move(groups));
    }
    // Bit-exactness: each stage must accumulate its weight gradients in microbatch order, as
    // a one-rank run does. Every family orders them so; a future one that did not is refused.
    std::vector<int> last_w(static_cast<std::size_t>(sh.v), -1);
    for (const Op& op : rp.compute)
      if (op.kind == OpKind::W || op.kind == OpKind::BW) {
        int& prev = last_w[static_cast<std::size_t>(sh.chunk_of(op.stage))];
        if (op.mb < prev)
          throw error("po::Runtime: stage " + std::to_string(op.stage) + " computes weight gradients of microbatch " + std::to_string(op.mb) +
                      " after microbatch " + std::to_string(prev) + "; gradients must accumulate in microbatch order");
        prev = op.mb;
      }
    index_program();
    if constexpr (backend::reserves_memory<Backend>) reserve_memory();
    allocate_state();
    compute_ = dev_.make_stream("compute");
    copy_ = dev_.make_stream("copy");
    comm_stream_ = dev_.make_stream("comm");
    for (std::size_t x = 0; x < rp.compute.size(); ++x) compute_done_.push_back(dev_.make_event());
    for (std::size_t y = 0; y < rp.copy.size(); ++y) copy_done_.push_back(dev_.make_event());
    for (std::size_t k = 0; k < rp.comm.size(); ++k) recv_done_.push_back(dev_.make_event());
    // A failure on this device wakes every peer blocked on this rank (and the pair partner's
    // copy stream, which may be waiting for this one's).
    dev_.set_error_hook([this](const std::string& why) {
      comm_.abort(why);
      if constexpr (backend::pairs_copies<Backend>)
        if (pair_ != nullptr) pair_->abort(why);
    });
    // Norm groups of every rank, so each rank sums the squares in one global order.
    std::vector<double> mine(static_cast<std::size_t>(sh.v), 0.0);
    for (int c = 0; c < sh.v; ++c) mine[static_cast<std::size_t>(c)] = static_cast<double>(groups_[static_cast<std::size_t>(c)].size());
    std::vector<double> all(static_cast<std::size_t>(sh.v * sh.d));
    comm_.all_gather(mine, all);
    max_groups_ = 0;
    for (double g : all) max_groups_ = std::max(max_groups_, static_cast<std::size_t>(g));
    group_counts_.resize(all.size());
    for (std::size_t i = 0; i < all.size(); ++i) group_counts_[i] = static_cast<std::size_t>(all[i]);
  }

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // Every step ends with its streams idle (synchronize waits for that even on failure), so
  // only the hook can still point here.
  ~Runtime() {
    dev_.set_error_hook(nullptr);
    for (backend::Block& b : adam_) dev_.device_free(b);
    dev_.device_free(inputs_);
    dev_.device_free(losses_dev_);
  }

  /// Runs one iteration (all passes of this rank, then the optimizer step). Throws the first
  /// error of any rank, naming rank and op; the runtime is unusable afterwards.
  StepStats step(const Batch& batch) {
    const Shape& sh = program_.shape;
    const std::size_t per_mb = static_cast<std::size_t>(opt_.microbatch.tokens());
    const std::size_t want = per_mb * static_cast<std::size_t>(sh.m);
    if (batch.tokens.size() != want || batch.targets.size() != want)
      throw error("po::Runtime::step: the batch has " + std::to_string(batch.tokens.size()) + " tokens and " +
                  std::to_string(batch.targets.size()) + " targets; it needs m * batch * seq = " + std::to_string(want) + " of each");
    dev_.upload(tokens_dev(), batch.tokens.data(), want * sizeof(std::int32_t));
    dev_.upload(targets_dev(), batch.targets.data(), want * sizeof(std::int32_t));
    losses_.assign(static_cast<std::size_t>(sh.m), 0.0f);
    const auto& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    trace_.compute_start.assign(rp.compute.size(), 0.0);
    trace_.compute_end.assign(rp.compute.size(), 0.0);
    trace_.copy_start.assign(rp.copy.size(), 0.0);
    trace_.copy_end.assign(rp.copy.size(), 0.0);
    dev_.reset_peaks();
    const double t0 = dev_.now();
    enqueue();
    ++iterations_;
    try {
      dev_.synchronize();
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
    StepStats st;
    st.step = step_;
    st.seconds = dev_.now() - t0;
    st.memory = dev_.memory();
    if (rank_ == sh.rank_of(sh.stages() - 1)) dev_.download(losses_.data(), losses_dev_.ptr, losses_.size() * sizeof(float));
    optimize(st);
    ++step_;
    return st;
  }

  /// Synchronised copies with the PCIe partner rank^1 (which must get the same link): before
  /// each copy, this rank's copy stream waits until the partner has completed every copy in
  /// the same direction planned to end before this one starts, so the pair keeps the
  /// staggered slot grid the schedule planned even when one side runs late. Call before the first step. A rank
  /// without a partner (odd d, last rank), or a schedule planned with stagger_pairs off,
  /// has nothing to synchronise with and is refused.
  template <class Link>
    requires backend::pairs_copies<Backend> && std::same_as<Link, PairLink<Backend>>
  void pair_with(Link& link) {
    const Shape& sh = program_.shape;
    const int partner = rank_ ^ 1;
    if (partner >= sh.d)
      throw error("po::Runtime::pair_with: rank " + std::to_string(rank_) + " has no PCIe partner (rank " + std::to_string(partner) +
                  " does not exist with d = " + std::to_string(sh.d) + ")");
    if (!program_.costs.stagger_pairs)
      throw error("po::Runtime::pair_with: the schedule was planned with Costs::stagger_pairs = false; pairs need staggered copy slots");
    if (step_ > 0 || iterations_ > 0) throw error("po::Runtime::pair_with: call it before the first step");
    pair_ = &link;
    pair_wait_ = pair_waits(program_.ranks[static_cast<std::size_t>(rank_)], program_.ranks[static_cast<std::size_t>(partner)]);
    partner_copies_ = program_.ranks[static_cast<std::size_t>(partner)].copy.size();
  }

  const Program& program() const { return program_; }
  int rank() const { return rank_; }
  int steps_taken() const { return step_; }
  std::span<Layer> layers() { return layers_; }

  // ---- training state (issue 5): parameters and AdamW moments are all a rank's training
  // state (dropout and data are counter-based on the step). They live in device memory;
  // these copy them between steps.
  /// Chunk c's parameters, copied to the host.
  std::vector<float> download_parameters(int chunk) { return download(checked_layer(chunk).parameters()); }
  /// Overwrites chunk c's parameters (values.size() must be their count).
  void upload_parameters(int chunk, std::span<const float> values) { upload(checked_layer(chunk).parameters(), values, "parameters"); }
  /// Chunk c's AdamW first or second moments (second = false / true), copied to the host.
  std::vector<float> download_moments(int chunk, bool second) { return download(moments(chunk, second)); }
  void upload_moments(int chunk, bool second, std::span<const float> values) { upload(moments(chunk, second), values, "AdamW moments"); }
  /// Resume: the next step() runs as step `steps` (learning rate, bias correction, dropout).
  void set_steps_taken(int steps) {
    if (steps < 0) throw error("po::Runtime::set_steps_taken: steps = " + std::to_string(steps) + " must be >= 0");
    step_ = steps;
  }

  /// Measured start and end (backend clock, seconds) of every op of the last step, parallel
  /// to this rank's RankProgram: fill a SimResult's RankSim with it to render a real run.
  const RankSim& trace() const { return trace_; }

 private:
  struct Unit {
    backend::Block device{};                  // (saved_bytes) the stage's saved activations
    std::array<backend::HostBlock, 3> host{};  // its power-of-two bins while offloaded
    backend::Block stash{};                   // (stash_bytes) from B to W
  };

  std::size_t unit_index(int stage, int mb) const {
    return static_cast<std::size_t>(program_.shape.chunk_of(stage)) * static_cast<std::size_t>(program_.shape.m) + static_cast<std::size_t>(mb);
  }
  std::size_t tag_index(int stage, int mb, Dir dir) const {
    return (static_cast<std::size_t>(stage) * static_cast<std::size_t>(program_.shape.m) + static_cast<std::size_t>(mb)) * 2 +
           (dir == Dir::backward ? 1 : 0);
  }

  /// Which comm op feeds each compute op, and which compute op feeds each send.
  void index_program() {
    const Shape& sh = program_.shape;
    const auto& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    const std::size_t tags = static_cast<std::size_t>(sh.stages()) * static_cast<std::size_t>(sh.m) * 2;
    std::vector<int> recv_of(tags, -1), producer(tags, -1);
    for (std::size_t k = 0; k < rp.comm.size(); ++k) {
      const CommOp& c = rp.comm[k];
      if (!c.send) recv_of[tag_index(c.stage, c.mb, c.dir)] = static_cast<int>(k);
    }
    const int S = sh.stages();
    input_recv_.assign(rp.compute.size(), -1);
    for (std::size_t x = 0; x < rp.compute.size(); ++x) {
      const Op& op = rp.compute[x];
      if (op.kind == OpKind::F) {
        if (op.stage > 0) input_recv_[x] = recv_of[tag_index(op.stage, op.mb, Dir::forward)];
        if (op.stage < S - 1) producer[tag_index(op.stage + 1, op.mb, Dir::forward)] = static_cast<int>(x);
      }
      if (op.kind == OpKind::B || op.kind == OpKind::BW) {
        if (op.stage < S - 1) input_recv_[x] = recv_of[tag_index(op.stage, op.mb, Dir::backward)];
        if (op.stage > 0) producer[tag_index(op.stage - 1, op.mb, Dir::backward)] = static_cast<int>(x);
      }
    }
    send_producer_.assign(rp.comm.size(), -1);
    for (std::size_t k = 0; k < rp.comm.size(); ++k) {
      const CommOp& c = rp.comm[k];
      if (c.send) send_producer_[k] = producer[tag_index(c.stage, c.mb, c.dir)];
    }
    units_.assign(static_cast<std::size_t>(sh.v) * static_cast<std::size_t>(sh.m), Unit{});
    boxes_.assign(tags, backend::Block{});
  }

  /// Takes from the device, up front, every buffer this rank's program can hold at once, so no
  /// step allocates: per buffer size, the most blocks in use over every timing the streams'
  /// orders and events allow (detail::two_stream_peak; other ranks only narrow that further).
  /// Activation units are taken by F and R and given back by W/BW and O (compute with copy);
  /// stashes by B/BW and W/BW (compute alone); boundary tensors by F/B (outputs) and recvs
  /// (inputs), given back by sends and by the F/B that consumed them (compute with comm);
  /// pinned host bins by O and R (copy alone).
  void reserve_memory() {
    const Shape& sh = program_.shape;
    const auto& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    const int S = sh.stages();
    const std::size_t nc = rp.compute.size(), ny = rp.copy.size(), nk = rp.comm.size();
    std::vector<int> compute_waits_copy(nc), copy_waits(ny), compute_waits_comm(nc), comm_waits(nk), none;
    for (std::size_t x = 0; x < nc; ++x) {
      compute_waits_copy[x] = rp.compute[x].wait;
      compute_waits_comm[x] = input_recv_[x];
    }
    for (std::size_t y = 0; y < ny; ++y) copy_waits[y] = rp.copy[y].wait;
    for (std::size_t k = 0; k < nk; ++k) comm_waits[k] = rp.comm[k].send ? send_producer_[k] : -1;
    const auto chunk = [&](const Op& op) { return static_cast<std::size_t>(sh.chunk_of(op.stage)); };
    std::vector<std::pair<std::size_t, long long>> device, host;  // (bytes, blocks)
    // Activation units and stashes, one size at a time (chunks may differ).
    std::vector<std::size_t> sizes(saved_.begin(), saved_.end());
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    for (std::size_t bytes : sizes) {
      std::vector<detail::BlockEffect> c(nc), y(ny);
      for (std::size_t x = 0; x < nc; ++x) {
        const Op& op = rp.compute[x];
        if (saved_[chunk(op)] != bytes) continue;
        c[x].take = op.kind == OpKind::F;
        c[x].give = op.kind == OpKind::W || op.kind == OpKind::BW;
      }
      for (std::size_t k = 0; k < ny; ++k) {
        const Op& op = rp.copy[k];
        if (saved_[chunk(op)] != bytes) continue;
        y[k].take = op.kind == OpKind::R;
        y[k].give = op.kind == OpKind::O;
      }
      device.emplace_back(bytes, detail::two_stream_peak(c, compute_waits_copy, y, copy_waits));
    }
    sizes.assign(stash_.begin(), stash_.end());
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    for (std::size_t bytes : sizes) {
      std::vector<detail::BlockEffect> c(nc);
      for (std::size_t x = 0; x < nc; ++x) {
        const Op& op = rp.compute[x];
        if (stash_[chunk(op)] != bytes) continue;
        c[x].take = op.kind == OpKind::B || op.kind == OpKind::BW;
        c[x].give = op.kind == OpKind::W || op.kind == OpKind::BW;
      }
      device.emplace_back(bytes, detail::two_stream_peak(c, none, {}, none));
    }
    // Boundary tensors (one size).
    {
      std::vector<detail::BlockEffect> c(nc), k(nk);
      for (std::size_t x = 0; x < nc; ++x) {
        const Op& op = rp.compute[x];
        const bool f = op.kind == OpKind::F, b = op.kind == OpKind::B || op.kind == OpKind::BW;
        c[x].take = (f && op.stage < S - 1) || (b && op.stage > 0);
        c[x].give = (f && op.stage > 0) || (b && op.stage < S - 1);
      }
      for (std::size_t j = 0; j < nk; ++j) {
        k[j].take = !rp.comm[j].send;
        k[j].give = rp.comm[j].send;
      }
      device.emplace_back(boundary_ * sizeof(float), detail::two_stream_peak(c, compute_waits_comm, k, comm_waits));
    }
    // Pinned host bins, one power of two at a time.
    std::vector<std::uint64_t> bins;
    for (std::size_t bytes : saved_) {
      const offload::BinPlan plan = offload::plan_bins(bytes);
      for (int i = 0; i < plan.count; ++i) bins.push_back(plan.bins[static_cast<std::size_t>(i)]);
    }
    std::sort(bins.begin(), bins.end());
    bins.erase(std::unique(bins.begin(), bins.end()), bins.end());
    for (std::uint64_t bin : bins) {
      std::vector<detail::BlockEffect> y(ny);
      for (std::size_t k = 0; k < ny; ++k) {
        const Op& op = rp.copy[k];
        const offload::BinPlan plan = offload::plan_bins(saved_[chunk(op)]);
        long long n = 0;
        for (int i = 0; i < plan.count; ++i) n += plan.bins[static_cast<std::size_t>(i)] == bin;
        y[k].take = op.kind == OpKind::O ? n : 0;
        y[k].give = op.kind == OpKind::R ? n : 0;
      }
      host.emplace_back(static_cast<std::size_t>(bin), detail::two_stream_peak(y, none, {}, none));
    }
    for (const auto& [bytes, blocks] : device)
      if (blocks > 0) dev_.reserve_device(bytes, static_cast<std::size_t>(blocks));
    for (const auto& [bytes, blocks] : host)
      if (blocks > 0) dev_.reserve_host(bytes, static_cast<std::size_t>(blocks));
  }

  Microbatch info(const Op& op) const {
    Microbatch mb;
    mb.stage = op.stage;
    mb.stages = program_.shape.stages();
    mb.mb = op.mb;
    mb.microbatches = program_.shape.m;
    mb.step = step_;
    mb.shape = opt_.microbatch;
    const std::size_t off = static_cast<std::size_t>(op.mb) * static_cast<std::size_t>(opt_.microbatch.tokens());
    mb.tokens = tokens_dev() + off;
    mb.targets = targets_dev() + off;
    if (op.stage == program_.shape.stages() - 1) mb.loss = reinterpret_cast<float*>(losses_dev_.ptr) + op.mb;
    mb.loss_scale = 1.0f / static_cast<float>(program_.shape.m);
    return mb;
  }

  std::string where(const char* stream, std::size_t index, const Op& op) const {
    return "rank " + std::to_string(rank_) + ", " + stream + " op " + std::to_string(index) + " " + op_name(op.kind) + "(stage " +
           std::to_string(op.stage) + ", mb " + std::to_string(op.mb) + ")";
  }

  /// Runs `body` as op `index` of a stream; an exception gets the rank and op in front.
  template <class F>
  void guarded(const char* stream, std::size_t index, const Op& op, F&& body) {
    try {
      body();
    } catch (const aborted_error&) {
      throw;  // the failure is someone else's and already named
    } catch (const std::exception& e) {
      throw error(where(stream, index, op) + ": " + e.what());
    }
  }

  float* boundary_out(int consumer_stage, int mb, Dir dir) {
    backend::Block b = dev_.device_alloc(boundary_ * sizeof(float), backend::Memory::message);
    boxes_[tag_index(consumer_stage, mb, dir)] = b;
    return reinterpret_cast<float*>(b.ptr);
  }
  const float* boundary_in(int stage, int mb, Dir dir) const {
    return reinterpret_cast<const float*>(boxes_[tag_index(stage, mb, dir)].ptr);
  }
  void release_box(int stage, int mb, Dir dir) {
    backend::Block& b = boxes_[tag_index(stage, mb, dir)];
    dev_.device_free(b);
    b = {};
  }

  void run_compute(std::size_t x) {
    const Op op = program_.ranks[static_cast<std::size_t>(rank_)].compute[x];
    trace_.compute_start[x] = dev_.now();
    guarded("compute", x, op, [&] {
      const int S = program_.shape.stages();
      Layer& l = layers_[static_cast<std::size_t>(program_.shape.chunk_of(op.stage))];
      const std::size_t c = static_cast<std::size_t>(program_.shape.chunk_of(op.stage));
      Unit& u = units_[unit_index(op.stage, op.mb)];
      auto ctx = dev_.context(compute_);
      const Microbatch mb = info(op);
      if (op.kind == OpKind::F) {
        u.device = dev_.device_alloc(saved_[c], backend::Memory::activation);
        const float* in = op.stage > 0 ? boundary_in(op.stage, op.mb, Dir::forward) : nullptr;
        float* out = op.stage < S - 1 ? boundary_out(op.stage + 1, op.mb, Dir::forward) : nullptr;
        l.forward(ctx, mb, in, out, u.device.ptr);
        if (op.stage > 0) release_box(op.stage, op.mb, Dir::forward);
      }
      if (op.kind == OpKind::B || op.kind == OpKind::BW) {
        if (u.device.ptr == nullptr) throw error("its activations are not on the device (missing reload)");
        const float* dy = op.stage < S - 1 ? boundary_in(op.stage, op.mb, Dir::backward) : nullptr;
        float* dx = op.stage > 0 ? boundary_out(op.stage - 1, op.mb, Dir::backward) : nullptr;
        u.stash = dev_.device_alloc(stash_[c], backend::Memory::stash);
        l.backward_input(ctx, mb, dy, dx, u.device.ptr, u.stash.ptr);
        if (op.stage < S - 1) release_box(op.stage, op.mb, Dir::backward);
      }
      if (op.kind == OpKind::W || op.kind == OpKind::BW) {
        if (u.device.ptr == nullptr) throw error("its activations are not on the device (missing reload)");
        l.backward_weight(ctx, mb, u.device.ptr, u.stash.ptr);
        dev_.device_free(u.stash);
        dev_.device_free(u.device);
        u.stash = {};
        u.device = {};
      }
    });
    trace_.compute_end[x] = dev_.now();
  }

  void run_copy(std::size_t y) {
    const Op op = program_.ranks[static_cast<std::size_t>(rank_)].copy[y];
    trace_.copy_start[y] = dev_.now();
    guarded("copy", y, op, [&] {
      Unit& u = units_[unit_index(op.stage, op.mb)];
      const std::size_t bytes = saved_[static_cast<std::size_t>(program_.shape.chunk_of(op.stage))];
      const offload::BinPlan plan = offload::plan_bins(bytes);
      std::array<backend::CopyPiece, 3> pieces{};
      const auto lay_out = [&](bool to_host) {
        std::size_t off = 0;
        for (int i = 0; i < plan.count && off < bytes; ++i) {
          const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(i)]), bytes - off);
          std::byte* dev = u.device.ptr + off;
          std::byte* host = u.host[static_cast<std::size_t>(i)].ptr;
          pieces[static_cast<std::size_t>(i)] = to_host ? backend::CopyPiece{host, dev, n} : backend::CopyPiece{dev, host, n};
          off += n;
        }
      };
      if (op.kind == OpKind::O) {
        if (u.device.ptr == nullptr) throw error("nothing to offload (the unit is not on the device)");
        for (int i = 0; i < plan.count; ++i) u.host[static_cast<std::size_t>(i)] = dev_.host_alloc(plan.bins[static_cast<std::size_t>(i)]);
        lay_out(true);
        dev_.transfer(std::span<const backend::CopyPiece>(pieces.data(), static_cast<std::size_t>(plan.count)));
        dev_.device_free(u.device);
        u.device = {};
      } else {
        if (u.host[0].ptr == nullptr && bytes > 0) throw error("nothing to reload (the unit was not offloaded)");
        u.device = dev_.device_alloc(bytes, backend::Memory::activation);
        lay_out(false);
        dev_.transfer(std::span<const backend::CopyPiece>(pieces.data(), static_cast<std::size_t>(plan.count)));
        for (auto& h : u.host) {
          dev_.host_free(h);
          h = {};
        }
      }
    });
    trace_.copy_end[y] = dev_.now();
  }

  void run_comm(std::size_t k) {
    const CommOp c = program_.ranks[static_cast<std::size_t>(rank_)].comm[k];
    const Tag tag{c.stage, c.mb, c.dir};
    try {
      if (c.send) {
        backend::Block& b = boxes_[tag_index(c.stage, c.mb, c.dir)];
        comm_.send(c.peer, tag, std::span<const float>(reinterpret_cast<const float*>(b.ptr), boundary_));
        dev_.device_free(b);
        b = {};
      } else {
        float* p = boundary_out(c.stage, c.mb, c.dir);
        comm_.recv(c.peer, tag, std::span<float>(p, boundary_));
      }
    } catch (const aborted_error&) {
      throw;
    } catch (const std::exception& e) {
      throw error("rank " + std::to_string(rank_) + ", comm op " + std::to_string(k) + " " + (c.send ? "send to" : "recv from") +
                  " rank " + std::to_string(c.peer) + " " + describe(tag) + ": " + e.what());
    }
  }

  /// Enqueues the rank's three streams. A wait captures the latest record of its event, so
  /// ops go in in an order where every awaited event's record is already enqueued: advance
  /// each stream while its next op's dependencies are in (the schedule is valid, so this
  /// reaches the end).
  void enqueue() {
    const auto& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    const std::size_t nc = rp.compute.size(), ny = rp.copy.size(), nk = rp.comm.size();
    std::size_t ic = 0, iy = 0, ik = 0;
    while (ic < nc || iy < ny || ik < nk) {
      bool moved = false;
      while (ic < nc) {
        const Op& op = rp.compute[ic];
        const int r = input_recv_[ic];
        if ((r >= 0 && static_cast<std::size_t>(r) >= ik) || (op.wait >= 0 && static_cast<std::size_t>(op.wait) >= iy)) break;
        if (r >= 0) dev_.wait(compute_, recv_done_[static_cast<std::size_t>(r)]);
        if (op.wait >= 0) dev_.wait(compute_, copy_done_[static_cast<std::size_t>(op.wait)]);
        dev_.launch(compute_, [this, ic] { run_compute(ic); });
        dev_.record(compute_done_[ic], compute_);
        ++ic;
        moved = true;
      }
      while (iy < ny) {
        const Op& op = rp.copy[iy];
        if (op.wait >= 0 && static_cast<std::size_t>(op.wait) >= ic) break;
        if (op.wait >= 0) dev_.wait(copy_, compute_done_[static_cast<std::size_t>(op.wait)]);
        if constexpr (backend::pairs_copies<Backend>)
          if (pair_ != nullptr && pair_wait_[iy] > 0)
            dev_.wait_counter(copy_, pair_->side[(rank_ ^ 1) & 1], static_cast<std::uint64_t>(iterations_ * partner_copies_ + pair_wait_[iy]));
        dev_.launch(copy_, [this, iy] { run_copy(iy); });
        dev_.record(copy_done_[iy], copy_);
        if constexpr (backend::pairs_copies<Backend>)
          if (pair_ != nullptr) dev_.signal(copy_, pair_->side[rank_ & 1], static_cast<std::uint64_t>(iterations_ * ny + iy + 1));
        ++iy;
        moved = true;
      }
      while (ik < nk) {
        const int p = send_producer_[ik];
        if (rp.comm[ik].send && (p < 0 || static_cast<std::size_t>(p) >= ic)) break;
        if (rp.comm[ik].send) dev_.wait(comm_stream_, compute_done_[static_cast<std::size_t>(p)]);
        dev_.launch(comm_stream_, [this, ik] { run_comm(ik); });
        if (!rp.comm[ik].send) dev_.record(recv_done_[ik], comm_stream_);
        ++ik;
        moved = true;
      }
      if (!moved) throw error("po::Runtime: rank " + std::to_string(rank_) + "'s program has a dependency cycle between its streams");
    }
  }

  /// For each of `mine`'s copies, how many of `theirs` (the partner's, in stream order) must
  /// have completed before it starts: up to and including the partner's last copy in the SAME
  /// direction planned to end no later than it starts. Only a copy in the same direction
  /// shares the switch's uplink with it (PCIe is full duplex), so the pair never copies in
  /// one direction at once, while a reload need not wait for the partner's offloads.
  static std::vector<std::size_t> pair_waits(const RankProgram& mine, const RankProgram& theirs) {
    std::vector<std::size_t> w(mine.copy.size(), 0);
    const double T = mine.slot_length, U = theirs.slot_length;
    const double eps = 1e-9 * std::max(T, U);
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

  /// Global gradient norm, non-finite check, clip, AdamW; gradients are zeroed after.
  void optimize(StepStats& st) {
    const Shape& sh = program_.shape;
    const std::size_t v = static_cast<std::size_t>(sh.v), m = static_cast<std::size_t>(sh.m);
    const std::size_t width = v * max_groups_ + m;
    std::vector<double> mine(width, 0.0), all(width * static_cast<std::size_t>(sh.d));
    for (std::size_t c = 0; c < v; ++c)
      dev_.sum_squares(layers_[c].gradients(), groups_[c], std::span<double>(mine).subspan(c * max_groups_, groups_[c].size()));
    if (rank_ == sh.rank_of(sh.stages() - 1))
      for (std::size_t b = 0; b < m; ++b) mine[v * max_groups_ + b] = static_cast<double>(losses_[b]);
    comm_.all_gather(mine, all);
    // One global order (stage, then group): the same sum on every rank and in a one-rank run
    // whose stages are cut at group boundaries.
    double norm2 = 0;
    for (int s = 0; s < sh.stages(); ++s) {
      const std::size_t r = static_cast<std::size_t>(sh.rank_of(s)), c = static_cast<std::size_t>(sh.chunk_of(s));
      const std::size_t groups = group_counts_[r * v + c];
      for (std::size_t k = 0; k < groups; ++k) {
        const double sq = all[r * width + c * max_groups_ + k];
        if (!std::isfinite(sq))
          throw error("po::Runtime: step " + std::to_string(step_) + ": stage " + std::to_string(s) + " has a non-finite gradient (parameter group " +
                      std::to_string(k) + ", sum of squares " + std::to_string(sq) + "); no update was applied");
        norm2 += sq;
      }
    }
    const std::size_t lr_rank = static_cast<std::size_t>(sh.rank_of(sh.stages() - 1));
    double loss = 0;
    for (std::size_t b = 0; b < m; ++b) loss += all[lr_rank * width + v * max_groups_ + b];
    st.loss = static_cast<float>(loss / static_cast<double>(m));
    st.grad_norm = std::sqrt(norm2);
    const math::AdamW& o = opt_.optimizer;
    const float scale = (o.clip > 0 && st.grad_norm > o.clip) ? static_cast<float>(o.clip / st.grad_norm) : 1.0f;
    st.lr = math::learning_rate(o, step_);
    const math::AdamBias bias = math::adam_bias(o, step_ + 1);
    for (std::size_t c = 0; c < v; ++c)
      dev_.adamw(layers_[c].parameters(), layers_[c].gradients(), moments(static_cast<int>(c), false), moments(static_cast<int>(c), true), o, st.lr,
                 bias, scale);
  }

  /// Device memory of the runtime's own state, taken once here: AdamW moments (zeroed), the
  /// step's tokens and targets, and the last stage's per-microbatch losses.
  void allocate_state() {
    const Shape& sh = program_.shape;
    // Reserved for themselves, so they never take a block reserve_memory() counted on.
    const auto take = [&](std::size_t bytes) {
      if constexpr (backend::reserves_memory<Backend>) dev_.reserve_device(bytes, 1);
      return dev_.device_alloc(bytes, backend::Memory::state);
    };
    std::vector<float> zeros;
    for (int c = 0; c < sh.v; ++c) {
      const std::size_t n = layers_[static_cast<std::size_t>(c)].parameters().size();
      zeros.assign(n, 0.0f);
      for (int k = 0; k < 2; ++k) {
        adam_.push_back(take(n * sizeof(float)));
        dev_.upload(adam_.back().ptr, zeros.data(), n * sizeof(float));
      }
    }
    const std::size_t tokens = static_cast<std::size_t>(opt_.microbatch.tokens()) * static_cast<std::size_t>(sh.m);
    inputs_ = take(2 * tokens * sizeof(std::int32_t));
    losses_dev_ = take(static_cast<std::size_t>(sh.m) * sizeof(float));
  }
  const std::int32_t* tokens_dev() const { return reinterpret_cast<const std::int32_t*>(inputs_.ptr); }
  const std::int32_t* targets_dev() const {
    return tokens_dev() + static_cast<std::size_t>(opt_.microbatch.tokens()) * static_cast<std::size_t>(program_.shape.m);
  }
  std::int32_t* tokens_dev() { return reinterpret_cast<std::int32_t*>(inputs_.ptr); }
  std::int32_t* targets_dev() {
    return tokens_dev() + static_cast<std::size_t>(opt_.microbatch.tokens()) * static_cast<std::size_t>(program_.shape.m);
  }
  Layer& checked_layer(int chunk) {
    if (chunk < 0 || chunk >= program_.shape.v)
      throw error("po::Runtime: chunk " + std::to_string(chunk) + " is outside [0, " + std::to_string(program_.shape.v - 1) + "]");
    return layers_[static_cast<std::size_t>(chunk)];
  }
  std::span<float> moments(int chunk, bool second) {
    const std::size_t n = checked_layer(chunk).parameters().size();
    return {reinterpret_cast<float*>(adam_[2 * static_cast<std::size_t>(chunk) + (second ? 1 : 0)].ptr), n};
  }
  std::vector<float> download(std::span<const float> device) {
    std::vector<float> host(device.size());
    dev_.download(host.data(), device.data(), device.size() * sizeof(float));
    return host;
  }
  void upload(std::span<float> device, std::span<const float> host, const char* what) {
    if (host.size() != device.size())
      throw error(std::string("po::Runtime: ") + what + ": got " + std::to_string(host.size()) + " values; the chunk has " +
                  std::to_string(device.size()));
    dev_.upload(device.data(), host.data(), host.size() * sizeof(float));
  }

  RuntimeOptions opt_;
  Backend& dev_;
  Communicator& comm_;
  std::span<Layer> layers_;
  Program program_;
  int rank_ = 0;
  int step_ = 0;
  std::size_t boundary_ = 0;
  std::vector<std::size_t> saved_, stash_;  // per chunk
  std::vector<backend::Block> adam_;   // per chunk: first moments, second moments (device)
  backend::Block inputs_{};            // the step's tokens then targets (device)
  backend::Block losses_dev_{};        // m losses of the last stage (device)
  std::vector<std::vector<std::size_t>> groups_;
  std::vector<std::size_t> group_counts_;  // [rank * v + chunk]
  std::size_t max_groups_ = 1;
  int compute_ = 0, copy_ = 0, comm_stream_ = 0;
  std::vector<int> compute_done_, copy_done_, recv_done_;
  std::vector<int> input_recv_, send_producer_;
  std::vector<Unit> units_;
  std::vector<backend::Block> boxes_;  // boundary tensors by tag: received inputs, outputs to send
  std::vector<float> losses_;  // host copy of losses_dev_
  long long iterations_ = 0;   // steps enqueued by this object (pair counters count from 0)
  std::vector<std::size_t> pair_wait_;  // per copy op: partner copies to wait for
  std::size_t partner_copies_ = 0;      // the partner's copies per step
  PairLink<Backend>* pair_ = nullptr;  // PCIe partner's link, or none
  RankSim trace_;
};

}  // namespace pipeoffload
