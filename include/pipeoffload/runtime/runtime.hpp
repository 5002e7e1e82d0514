// pipeoffload/runtime/runtime.hpp: po::Runtime, one rank of a pipeline executing a Program. It
// interprets po::lower's value for its rank: F/B/W/BW on the compute stream, offloads and
// reloads on the copy stream, messages and the data-parallel reductions on the comm stream,
// every wait an event, every buffer at its offset in the memory plan's region. The optimizer
// is not the runtime's (runtime/optimizer.hpp). What it runs: docs/lowering.md; the gradient
// paths and reductions: docs/gradients.md; a step's calls and waits: docs/step.md; failures
// and NaN: docs/faults.md.
/// @file
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/backend.hpp"
#include "../comm/communicator.hpp"
#include "../comm/handshake.hpp"
#include "../error.hpp"
#include "../layer.hpp"
#include "../memory/state.hpp"
#include "../policy/host_bins.hpp"
#include "../schedule/schedule.hpp"
#include "../schedule/validate.hpp"
#include "../sim/simulate.hpp"
#include "batch.hpp"
#include "reserve.hpp"
#include "stage.hpp"

namespace pipeoffload {

static_assert(sizeof(exact::Fixed) == exact_sum_bytes, "memory/state.hpp counts an exact sum as exact_sum_bytes");

/// How a Runtime runs: the microbatch shape, finiteness checks, gradient buckets and folds.
struct RuntimeOptions {
  MicrobatchShape microbatch{};  ///< the shape of one microbatch, given to the stages' size functions and passes
  /// Check every output activation and input gradient for NaN and infinity where it is
  /// produced (one pass over the boundary tensor, on the stream that made it; its cost is in
  /// bench/RESULTS.md). Losses are always checked.
  bool check_finite = true;
  /// How gradients are summed: Gradients::standard (fp32 in place, the default) or
  /// Gradients::exact (fixed-point sums: the same bits for every schedule, rank count, replica
  /// count and accumulation split; docs/gradients.md).
  Gradients gradients = Gradients::standard;
  /// With data parallelism: the gradients of a stage are reduced across its replicas in
  /// buckets of at most this many values (each bucket a reduce-scatter, and an all-gather where
  /// every replica needs every gradient, on the comm stream); the staging is
  /// reduction_staging_bytes of one bucket.
  std::size_t reduce_bucket = std::size_t{1} << 20;
  /// Standard path with replicas: the type the reduce-scatter sends gradients in.
  /// DType::float32 (the default), or DType::bfloat16: half the bytes (Megatron-Core's
  /// bf16 gradient reduction); each replica's part is rounded to bfloat16 (to nearest even)
  /// and the owner adds the parts in fp32, in replica order, so runs stay deterministic. The
  /// exact path refuses it (its sums are 128-bit).
  DType reduce_dtype = DType::float32;
  /// Exact path only: microbatches per exact fold. Each W adds its gradients to the stage's
  /// fp32 gradients(), and every `exact_block` microbatches (global index b with b %
  /// exact_block == exact_block - 1) they go into the exact sums. 1 (the default): every
  /// microbatch, so the sum depends on nothing but the microbatches. Larger blocks fold less
  /// often (a fold reads and writes 36 bytes per parameter) and sum in fp32, in microbatch
  /// order, inside a block: runs stay bit-identical across schedules, rank counts and replica
  /// counts whose m (per call) is a multiple of the block. m must be a multiple of it.
  int exact_block = 1;
  /// Debug, for layer authors: every saved and stash buffer gets `guard_bytes` canary bytes
  /// after what saved_bytes() and stash_bytes() declare, checked after every pass that gets
  /// the buffer; a pass that wrote past its size is named (rank, op, stage, microbatch, the
  /// first byte changed). Needs a backend whose device memory the host reads (backend::Cpu);
  /// the reservation grows by guard_bytes a buffer. Off by default.
  bool guard_buffers = false;
  /// Capture each kind of training call (its part of the step) once and replay it at later
  /// steps: one launch of a CUDA graph a call on backend::Cuda instead of a launch per kernel.
  /// The first call of each kind runs as usual (libraries plan their work there), the second
  /// is captured; every later one is replayed, bit-identical to running it. Needs a backend
  /// that captures (backend::captures_graphs) and stages that are capturable() (layer.hpp);
  /// the step reaches the passes in device memory (Microbatch::device_step). On backend::Cuda
  /// one rank without replicas (d = 1, dp = 1): the communicators keep host-side bookkeeping a
  /// replay would not repeat. A parameter gather left running by the optimizer is waited for
  /// before the replay, not by the first pass that needs it. docs/backends.md, "Captured steps".
  bool graphs = false;
  /// Reload a unit of a stage that declares saved_parts() part by part, in the order its B
  /// reads them, and start the B once the first part is back (Microbatch::await_saved), where
  /// the backend lets a pass wait (backend::waits_in_pass). False: the B waits for the whole
  /// unit. Either way the results are the same, bit for bit.
  bool reload_parts = true;
};

/// Canary bytes after each saved and stash buffer under RuntimeOptions::guard_buffers.
inline constexpr std::size_t guard_bytes = 64;

/// Where a forward_backward call sits in training: the optimizer step its gradients go to
/// (Microbatch::step) and, with gradient accumulation, which of `parts` calls it is. With dp
/// replicas, a step's global batch is dp * parts * m microbatches, replica-major: the `parts`
/// calls of replica j see microbatches (j * parts + part) * m .. + m-1 and scale their loss
/// gradients by 1/(dp * parts * m). On the exact path the order and the split do not matter:
/// dp replicas of k calls on m microbatches each, then one optimizer step, equal one replica's
/// one call on dp*k*m microbatches, bit for bit (docs/gradients.md says what the standard path
/// keeps).
struct StepInfo {
  int step = 0;   ///< the optimizer step the gradients go to (Microbatch::step)
  int part = 0;   ///< which of the step's `parts` calls this is, 0 .. parts-1
  int parts = 1;  ///< forward_backward calls (per replica) whose gradients accumulate into the step
};

/// What forward_backward and evaluate report (the same on every rank except seconds and memory).
struct PassStats {
  float loss = 0;             ///< mean over this call's microbatches (of every replica) of each microbatch's mean loss
  std::vector<float> losses;  ///< each microbatch's loss, in microbatch order (dp * m of them, replica-major)
  double seconds = 0;         ///< wall time of the passes (enqueue to last stream idle)
  backend::MemoryStats memory{};  ///< this rank's device and host memory; peaks of this call
};

/// What ranks r and r^1 of a PCIe pair share when they run in one process: one counter per
/// side, raised by that side's copy stream after each copy (docs/design.md section 3, "synchronized
/// interleaved"). Make one per pair, hand it to both ranks' runtimes with pair_with() before
/// their first step, and keep it alive as long as they are.
template <class Backend>
struct PairLink {
  static_assert(backend::pairs_copies<Backend>,
                "po::PairLink: the backend has no shared counters (backend::pairs_copies)");
  typename Backend::Counter side[2];  ///< side[r & 1]: copies completed by rank r
  /// Aborts both counters, releasing every copy stream waiting on either side.
  void abort(const std::string& why) {
    for (auto& c : side) c.abort(why);
  }
  /// After abort(), where a counter's abort can be undone by a stream's write that lands later
  /// (backend::Cuda's: Counter::keep_aborted): raises both back. Runtime::pair_with has the
  /// backend call it while it waits for its streams.
  void keep_aborted() {
    for (auto& c : side)
      if constexpr (requires { c.keep_aborted(); }) c.keep_aborted();
  }
};

/// One stage of the pipeline as every rank knows it after construction.
struct StageInfo {
  int rank = 0,                 ///< the rank that holds it, 0 .. d-1
      chunk = 0;                ///< which chunk of that rank it is, 0 .. v-1
  std::string name;             ///< the stage type's name
  Boundary input,               ///< what it takes, per microbatch
      output;                   ///< what it hands on, per microbatch
  std::size_t parameters = 0;   ///< parameter values (floats) it holds
  std::size_t norm_groups = 1;  ///< groups its parameters split into for the gradient norm
};

/// One holder of a shared parameter (SharedParam): the stage, where it lives, and the
/// tensor's run of its parameters.
struct TieHolder {
  int stage = 0,           ///< the holding stage
      rank = 0,            ///< its rank, 0 .. d-1
      chunk = 0;           ///< its chunk on that rank
  std::size_t offset = 0,  ///< the tensor's first parameter in the stage's parameters()
      count = 0;           ///< the tensor's values
  std::string tensor;      ///< the tensor's name (parameter_info())
};

/// A shared parameter as every rank knows it after construction: its key and its holders in
/// stage order (then offset); holders[0] is the primary (SharedParam).
struct TiedParameter {
  std::string key;                 ///< SharedParam::key
  std::vector<TieHolder> holders;  ///< two or more; the first is the primary
};

template <class... Ts>
class Runtime;

/// One rank of a pipeline: executes its part of a Program with its stages on a `Backend`
/// device, exchanging boundary tensors through a `Communicator`.
/// @code
///   po::comm::ThreadsWorld world(d);
///   const po::Program program = po::PO_F::build({d, v, m});    // or po::build(spec, ...), po::plan(...)
///   // on the thread of rank r (po::run_thread_ranks):
///   po::backend::Cpu dev({.rank = r});
///   po::comm::Threads comm(world, r);
///   std::vector<po::StageRef<po::backend::CpuContext>> mine = my_stages(r);  // v stages, chunk order
///   po::Runtime rt(program, dev, comm, mine, {.microbatch = {4, 64}});
///   po::AdamW opt(rt, {.weight_decay = 0.1f});
///   for (int step = 0; step < steps; ++step) {
///     rt.zero_grad();
///     rt.forward_backward(batch(step), {.step = step});
///     opt.step(lr(step), po::clip_scale(po::grad_norm(rt), 1.0f));
///   }
/// @endcode
template <class Backend, class Communicator>
class Runtime<Backend, Communicator> {
  static_assert(
      backend::backend<Backend>,
      "po::Runtime: Backend must model po::backend::backend (streams, events, device_alloc/free, host_alloc/free, "
      "transfer, synchronize, abort, memory, context, now, download, upload, zero, flag_nonfinite); see backend/backend.hpp.");
  static_assert(
      backend::reduces_gradients<Backend>,
      "po::Runtime: Backend must model po::backend::reduces_gradients (sum_parts, exact_add, exact_sum, exact_round, "
      "copy and zero in a stream's context, hold and release); see backend/backend.hpp.");
  static_assert(
      communicator<Communicator, typename Backend::Context>,
      "po::Runtime: Communicator must model po::communicator<C, Backend::Context> (rank, size, send(ctx, ...) and "
      "recv(ctx, ...) with the backend's stream context, all_gather of doubles and bytes, abort); see comm/communicator.hpp.");

 public:
  using backend_type = Backend;               ///< the device type
  using communicator_type = Communicator;     ///< the communicator type
  using Context = typename Backend::Context;  ///< what a pass is given on this backend
  using Stage = StageRef<Context>;            ///< a type-erased reference to one stage's layer

  /// `stages`: this rank's v stages in chunk order (stage c*d + rank is stages[c]); the
  /// layers they refer to must outlive the runtime, as must `dev` and `comm`. Collective:
  /// every rank constructs its runtime; if one fails, every rank throws.
  Runtime(const Program& program, Backend& dev, Communicator& comm, std::span<const Stage> stages,
          RuntimeOptions opt = {})
      : opt_(opt), dev_(dev), comm_(comm), stages_(stages.begin(), stages.end()), program_(program) {
    try {
      construct();
    } catch (const aborted_error&) {
      throw;  // another rank failed; it named itself
    } catch (const std::exception& e) {
      comm_.abort(e.what());  // wake every rank waiting for this one
      throw;
    }
  }
  /// The same, from stages of one layer type.
  template <class L>
    requires(!std::is_same_v<std::remove_cv_t<L>, Stage>)
  Runtime(const Program& program, Backend& dev, Communicator& comm, std::span<L> stages, RuntimeOptions opt = {})
      : Runtime(program, dev, comm, std::span<const Stage>(refs(stages)), opt) {}
  /// One rank of replica replicas.rank() of replicas.size() data-parallel copies of the
  /// pipeline: `comm` connects the pipeline's d ranks, `replicas` this rank's dp peers (the
  /// ranks at the same position of the other pipelines, in replica order). Collective over both.
  Runtime(const Program& program, Backend& dev, Communicator& comm, Communicator& replicas,
          std::span<const Stage> stages, RuntimeOptions opt = {})
    requires replica_communicator<Communicator, typename Backend::Context> && backend::reduces_gradients<Backend>
      : opt_(opt),
        dev_(dev),
        comm_(comm),
        replicas_(&replicas),
        stages_(stages.begin(), stages.end()),
        program_(program) {
    try {
      construct();
    } catch (const aborted_error&) {
      throw;
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      replicas.abort(e.what());
      throw;
    }
  }
  /// The same, from stages of one layer type.
  template <class L>
    requires(!std::is_same_v<std::remove_cv_t<L>, Stage>)
  Runtime(const Program& program, Backend& dev, Communicator& comm, Communicator& replicas, std::span<L> stages,
          RuntimeOptions opt = {})
      : Runtime(program, dev, comm, replicas, std::span<const Stage>(refs(stages)), opt) {}

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // A call that returns leaves its streams idle; one that threw part-way (out of memory while
  // enqueueing, say) aborted them, and its work may still be ending: wait for that before
  // this object and its buffers go. Then only the hook can still point here.
  ~Runtime() {
    try {
      dev_.synchronize();
    } catch (...) {  // the failure was reported by the call that threw
    }
    dev_.set_error_hook(nullptr);
    if constexpr (requires { dev_.remove_wait_poll(0); })
      if (pair_poll_ >= 0) dev_.remove_wait_poll(pair_poll_);
    for (backend::Block& b : inputs_dev_) dev_.device_free(b);
    for (backend::Block& b : sums_) dev_.device_free(b);
    for (backend::Block& b : staging_) dev_.device_free(b);
    dev_.device_free(tie_staging_);
    dev_.device_free(region_);
    dev_.device_free(results_dev_);
  }

  /// Runs every F, B and W (or BW) of this rank for one batch of m microbatches; gradients
  /// accumulate into the stages' gradients(). Collective. Returns the losses (every rank).
  /// Throws po::nonfinite_error on every rank for a NaN or infinity (see the file comment),
  /// and the first error of any rank otherwise (after which the runtime is unusable).
  PassStats forward_backward(const Batch& batch, StepInfo info = {}) {
    return guard("forward_backward", [&] { return run(train_, batch, info); });
  }

  /// The forward passes only, for one batch of m microbatches: nothing kept for backward,
  /// nothing offloaded, no gradients (Microbatch::training is false, so stages turn dropout
  /// off). Collective. Returns the losses (every rank).
  PassStats evaluate(const Batch& batch) {
    return guard("evaluate", [&] { return run(eval_, batch, StepInfo{}); });
  }

  /// Sets every stage's gradients (and, on the exact path, their sums) to zero (on the device).
  void zero_grad() {
    norm_ready_ = false;
    guard("zero_grad", [&] {
      for (const Stage& s : stages_) dev_.zero(s.gradients().data(), s.gradients().size_bytes());
      for (const backend::Block& b : sums_) dev_.zero(b.ptr, b.bytes);
      return 0;
    });
  }

  /// Synchronised copies with the PCIe partner rank^1 (which must get the same link): before
  /// each copy, this rank's copy stream waits until the partner has completed every copy in
  /// the same direction planned to end before this one starts, so the pair keeps the
  /// staggered slot grid the schedule planned even when one side runs late. Call before the
  /// first step. A rank without a partner (odd d, last rank), or a schedule planned with
  /// stagger_pairs off, has nothing to synchronise with and is refused.
  template <class Link>
    requires backend::pairs_copies<Backend> && std::same_as<Link, PairLink<Backend>>
  void pair_with(Link& link) {
    const Shape& sh = program_.shape;
    const int partner = rank_ ^ 1;
    if (partner >= sh.d)
      throw error("po::Runtime::pair_with: rank " + std::to_string(rank_) + " has no PCIe partner (rank " +
                  std::to_string(partner) + " does not exist with d = " + std::to_string(sh.d) + ")");
    if (!program_.costs.stagger_pairs)
      throw error(
          "po::Runtime::pair_with: the schedule was planned with Costs::stagger_pairs = false; pairs need staggered copy slots");
    if (iterations_ > 0) throw error("po::Runtime::pair_with: call it before the first step");
    if (program_.costs.duplex())
      throw error(
          "po::Runtime::pair_with: the schedule runs two copy streams (Costs::copy_streams = 2), whose copies end out "
          "of order, and the pairs' counters count them in order; a rank with a PCIe partner gains nothing from a "
          "second stream (its partner's copies fill the other direction's slots): plan it with one");
    if (opt_.graphs)
      throw error(
          "po::Runtime::pair_with: RuntimeOptions::graphs replays captured copies, which cannot follow the "
          "pairs' counters; run pairs without graphs");
    if (!train_.lowered.paired)
      throw error(
          "po::Runtime::pair_with: this program's copies cannot keep the pairs' staggered grid: with the pair waits, "
          "its streams would wait for each other in a cycle (docs/lowering.md)");
    pair_ = &link;
    // Where the backend polls while it waits for its streams (backend::Cuda::add_wait_poll),
    // each wait keeps an abort of the pair's counters in force (PairLink::keep_aborted).
    if constexpr (requires { dev_.add_wait_poll([] {}); })
      pair_poll_ = dev_.add_wait_poll([&link] { link.keep_aborted(); });
    pair_wait_ =
        pair_waits(program_.ranks[static_cast<std::size_t>(rank_)], program_.ranks[static_cast<std::size_t>(partner)]);
    partner_copies_ = program_.ranks[static_cast<std::size_t>(partner)].copy.size();
  }

  /// Device bytes of the memory plan's region (po::reservation_plan's `device`): the saved
  /// units, stashes and boundary tensors at their offsets, taken once at construction. The
  /// backend's own figures count it as Memory::state; PassStats::memory counts what is in it.
  std::size_t buffer_region_bytes() const { return region_.bytes; }
  /// The program this runtime runs (every rank's, not only this one's).
  const Program& program() const { return program_; }
  /// The options it was constructed with.
  const RuntimeOptions& options() const { return opt_; }
  /// This rank's position in its pipeline (0..d-1).
  int rank() const { return rank_; }
  /// Data-parallel replicas of the pipeline (1 without a replicas communicator) and this rank's.
  int replicas() const { return dp_; }
  /// This rank's replica, 0 .. replicas()-1.
  int replica() const { return replica_; }
  /// The communicator of this rank's replicas (null without data parallelism).
  Communicator* replica_comm() {
    settle();  // a host-side collective must not run beside a gather on the comm stream
    return replicas_;
  }
  /// The device this rank runs on.
  Backend& device() { return dev_; }
  /// The communicator of this rank's pipeline (its d ranks).
  Communicator& communicator() { return comm_; }
  /// This rank's stages, in chunk order.
  std::span<const Stage> stages() const { return stages_; }
  /// Every stage of the pipeline (all ranks), by stage index.
  const std::vector<StageInfo>& stage_table() const { return table_; }
  /// Chunk c's norm groups (Stage::norm_groups(), checked to cover its parameters).
  const std::vector<std::size_t>& norm_groups(int chunk) const {
    return norm_groups_[static_cast<std::size_t>(checked_index(chunk))];
  }
  /// The most norm groups of any stage of the pipeline.
  std::size_t max_norm_groups() const { return max_groups_; }

  /// Runs `body`; if it throws anything but aborted_error (another rank's failure, already
  /// named) or nonfinite_error (which every rank throws alike), aborts every rank with
  /// "rank R, <what>: <message>" and throws that. Optimizers and checkpoints run their work
  /// through it, so a failure there cannot leave another rank waiting.
  template <class F>
  decltype(auto) guard(const std::string& what, F&& body) {
    try {
      return body();
    } catch (const aborted_error&) {
      throw;
    } catch (const nonfinite_error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      // Errors that already name their rank (a pass, a P2P, another rank's abort) keep their
      // text and type; others get this rank and the call in front.
      if (msg.rfind("rank ", 0) == 0 || msg.rfind("aborted: ", 0) == 0) {
        abort(msg);
        throw;
      }
      const std::string named = "rank " + std::to_string(rank_) + ", " + what + ": " + msg;
      abort(named);
      throw error(named);
    }
  }
  /// Stops every rank: their waits, present and future, throw aborted_error naming `why`.
  void abort(const std::string& why) {
    comm_.abort(why);
    if (replicas_ != nullptr) replicas_->abort(why);
    dev_.abort(why);
    if constexpr (backend::pairs_copies<Backend>)
      if (pair_ != nullptr) pair_->abort(why);
  }

  // ---- training state: parameters live in device memory; these copy them between steps.
  /// Chunk c's working parameters, copied to the host as fp32 (bfloat16 ones widened exactly;
  /// a mixed-precision stage's fp32 master copy is the optimizer's: Optimizer::full_master).
  std::vector<float> download_parameters(int chunk) {
    settle();
    const Tensor w = checked(chunk).working();
    if (w.dtype == DType::float32)
      return download(std::span<const float>(reinterpret_cast<float*>(w.data), w.elements));
    std::vector<std::uint16_t> bits(w.elements);
    dev_.download(bits.data(), w.data, w.bytes());
    std::vector<float> out(w.elements);
    for (std::size_t i = 0; i < bits.size(); ++i) out[i] = bf16_value(bits[i]);
    return out;
  }
  /// Overwrites chunk c's working parameters (values.size() must be their count; bfloat16
  /// ones are rounded to nearest even).
  void upload_parameters(int chunk, std::span<const float> values) {
    settle();
    const Tensor w = checked(chunk).working();
    if (w.dtype == DType::float32) {
      upload(std::span<float>(reinterpret_cast<float*>(w.data), w.elements), values, "parameters");
      return;
    }
    if (values.size() != w.elements)
      throw error("po::Runtime: parameters: got " + std::to_string(values.size()) + " values; the chunk has " +
                  std::to_string(w.elements));
    std::vector<std::uint16_t> bits(values.size());
    for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = bf16_bits(values[i]);
    dev_.upload(w.data, bits.data(), w.bytes());
  }
  /// Chunk c's gradients, copied to the host.
  std::vector<float> download_gradients(int chunk) { return download(checked(chunk).gradients()); }

  /// Device bytes this rank's runtime holds for gradients beyond the stages' own: the exact
  /// sums (exact path), the reduction's staging (replicas) and the shared parameters' staging;
  /// po::state_bytes' sums + staging + ties.
  std::size_t gradient_buffer_bytes() const {
    std::size_t n = tie_staging_.bytes;
    for (const backend::Block& b : sums_) n += b.bytes;
    for (const backend::Block& b : staging_) n += b.bytes;
    return n;
  }
  /// The pipeline's shared parameters (SharedParam), in key order; empty without any.
  const std::vector<TiedParameter>& ties() const { return ties_; }
  /// The runs of chunk c's parameters that are a copy of a shared parameter whose primary is
  /// another tensor (SharedParam), in order: the optimizers keep no state for them and leave
  /// them to share_tied, checkpoints do not store them, the gradient norm does not read them,
  /// and their gradients() hold this holder's own part only (the primary's hold the sum).
  std::vector<ParamRange> tied_copies(int chunk) const {
    std::vector<ParamRange> out;
    checked_index(chunk);
    for (const TiedParameter& t : ties_)
      for (std::size_t i = 1; i < t.holders.size(); ++i)
        if (const TieHolder& h = t.holders[i]; h.rank == rank_ && h.chunk == chunk)
          out.push_back({h.offset, h.offset + h.count});
    std::sort(out.begin(), out.end(), [](const ParamRange& a, const ParamRange& b) { return a.begin < b.begin; });
    return out;
  }
  /// After the parameters were updated: every holder of a shared parameter gets the primary's
  /// working values (a device copy on one rank, one message per tie_bucket values between
  /// two), from the comm stream. Collective over the holders' ranks; the optimizers call it
  /// at the end of every step and load_checkpoint after loading. `overlap`: as share_shards'.
  void share_tied(bool overlap = false) {
    guard("share_tied", [&] {
      if (ties_.empty()) return 0;
      if (overlap) dev_.hold(comm_stream_);  // the next step's zeroing and uploads need not wait for it
      push_tied();
      if (overlap) {
        for (std::size_t c = 0; c < tie_copy_chunk_.size(); ++c)
          if (tie_copy_chunk_[c] != 0) {
            dev_.record(gathered_[c], comm_stream_);
            gather_pending_[c] = 1;
          }
      } else {
        dev_.synchronize();
      }
      return 0;
    });
  }

  /// Chunk c's GradientLayout: its reduction buckets and which parameters each replica owns.
  const GradientLayout& layout(int chunk) const { return layouts_[static_cast<std::size_t>(checked_index(chunk))]; }
  /// The parameters of chunk c whose reduced gradients this replica owns (all of them without
  /// replicas).
  std::vector<ParamRange> owned(int chunk) const {
    return dp_ > 1 ? layout(chunk).shards(replica_) : std::vector<ParamRange>{{0, layout(chunk).values}};
  }

  /// A run of chunk c's gradients that po::grad_norm reads (norm_pieces).
  struct NormPiece {
    ParamRange range;                ///< the parameters
    std::size_t first_group = 0;     ///< the chunk's norm group the run starts in
    std::vector<std::size_t> sizes;  ///< values of groups first_group, first_group + 1, ... inside the run
  };
  /// What this rank's gradient norm reads of chunk c, in order: the parameters this replica
  /// owns on the standard path with replicas (each replica then adds its shards' squares and
  /// the replicas' sums are added in replica order, so ZeRO-1 on and off give the same norm),
  /// all of them otherwise.
  const std::vector<NormPiece>& norm_pieces(int chunk) const {
    return norm_pieces_[static_cast<std::size_t>(checked_index(chunk))];
  }
  /// The sums of squares of every norm piece (norm_pieces, chunk by chunk, one vector a piece)
  /// of the gradients as they are: those the last call of a step (forward_backward with
  /// part == parts - 1) enqueued behind its work and read with its results, or, when the
  /// gradients may have changed since (zero_grad, another forward_backward) or none were,
  /// summed now with one wait. po::grad_norm adds them.
  const std::vector<std::vector<double>>& norm_sums() {
    if (!norm_ready_) {
      enqueue_norm_sums();
      dev_.synchronize();
      norm_ready_ = true;
    }
    return norm_sums_;
  }
  /// Whether the gradient norm is summed over replicas' shards (see norm_pieces).
  bool norm_by_shards() const { return dp_ > 1 && opt_.gradients == Gradients::standard; }

  /// Standard path, with replicas: whether the reduction keeps only each replica's own shard
  /// of the reduced gradients (a reduce-scatter, no all-gather; the rest of gradients() then
  /// holds this replica's own partial sums). A ZeRO-1 optimizer sets it at construction, since
  /// it reads only what its replica owns. The exact path always gathers (the gradient norm
  /// is then computed as with one replica, bit for bit).
  void shard_gradients(bool on) { shard_gradients_ = on; }
  /// Whether the reduction leaves each replica only its own shard (see shard_gradients).
  bool gradients_sharded() const { return shard_gradients_ && dp_ > 1 && opt_.gradients == Gradients::standard; }

  /// Between steps, with replicas: each replica holds the current values of the parameters it
  /// owns (owned(chunk)) in chunk c's working parameters (device memory, fp32 or bfloat16);
  /// afterwards every replica holds all of them: an all-gather per bucket from the comm
  /// stream, through the reduction's staging (collective over the replicas). The ZeRO-1
  /// optimizers' parameter gather. Nothing to do without replicas.
  /// `overlap`: returns with the gather enqueued; the next forward_backward or evaluate makes
  /// its compute stream wait for it before the rank's first pass of chunk c, so it runs behind
  /// the passes of the chunks before it and the pipeline's warm-up, and settle() (which every
  /// call reading the parameters or the replicas' communicator makes) waits for it.
  void share_shards(int chunk, bool overlap = false) {
    guard("share_shards", [&] {
      if constexpr (replica_communicator<Communicator, Context>) {
        if (replicas_ == nullptr || dp_ == 1) return 0;
        const GradientLayout& l = layout(chunk);
        const Tensor values = stages_[static_cast<std::size_t>(chunk)].working();
        const std::size_t e = dtype_size(values.dtype), slice = l.slice() * e, len = l.len * e;
        std::byte* mine = slice_staging().ptr;  // fp32-sized: room for either type
        std::byte* all = bucket_staging().ptr;
        // Left running: the next step's zeroing and uploads (between-steps operations) need not
        // wait for it, only its passes do (gathered_); run() releases the hold before them.
        if (overlap) dev_.hold(comm_stream_);
        Context ctx = dev_.context(comm_stream_);
        for (std::size_t b = 0; b < l.buckets && b * l.len < l.values; ++b) {
          const ParamRange r = l.shard(b, replica_);
          if (r.size() * e < slice) dev_.zero(ctx, mine, slice);
          dev_.copy(ctx, mine, values.data + r.begin * e, r.size() * e);
          replicas_->all_gather(ctx, std::span<const std::byte>(mine, slice), std::span<std::byte>(all, len));
          dev_.copy(ctx, values.data + b * len, all, std::min(l.len, l.values - b * l.len) * e);
        }
        if (overlap) {
          dev_.record(gathered_[static_cast<std::size_t>(chunk)], comm_stream_);
          gather_pending_[static_cast<std::size_t>(chunk)] = 1;
        } else {
          dev_.synchronize();
        }
      }
      return 0;
    });
  }
  /// Waits for the parameter gathers share_shards(c, true) left running (nothing when none is).
  void settle() {
    if (std::find(gather_pending_.begin(), gather_pending_.end(), 1) == gather_pending_.end()) return;
    std::fill(gather_pending_.begin(), gather_pending_.end(), 0);
    guard("share_shards", [&] {
      dev_.synchronize();
      dev_.release();
      return 0;
    });
  }

  /// Copies `n` floats of device memory to the host (optimizers' state, for checkpoints).
  std::vector<float> download(std::span<const float> device) {
    std::vector<float> host(device.size());
    dev_.download(host.data(), device.data(), device.size() * sizeof(float));
    return host;
  }
  /// Overwrites device memory with `host` (sizes must match; `what` names it in the error).
  void upload(std::span<float> device, std::span<const float> host, const char* what) {
    if (host.size() != device.size())
      throw error(std::string("po::Runtime: ") + what + ": got " + std::to_string(host.size()) +
                  " values; the chunk has " + std::to_string(device.size()));
    dev_.upload(device.data(), host.data(), host.size() * sizeof(float));
  }

  /// Measured start and end (backend clock, seconds) of every op of the last forward_backward,
  /// parallel to this rank's RankProgram: fill a SimResult's RankSim with it to render a real run.
  /// Where the device ran them (backend::marks_times: on a GPU, timing events). Under
  /// RuntimeOptions::graphs the captured call's times (when it was enqueued) stay: a replay
  /// records none.
  const RankSim& trace() const { return trace_; }
  /// Measured start and end (backend clock, seconds) of each gradient reduction of the last
  /// forward_backward (with replicas; in the comm stream's order).
  struct Reduction {
    int chunk = 0;     ///< the chunk (of this rank) whose gradients were reduced
    double start = 0,  ///< when the reduction started, backend clock seconds
        end = 0;       ///< when it ended, backend clock seconds
  };
  /// The last forward_backward's gradient reductions (see Reduction); empty without replicas.
  const std::vector<Reduction>& reductions() const { return reduce_trace_; }

 private:
  struct Unit {
    backend::Block device{};                   // (saved_bytes) the stage's saved activations
    std::array<backend::HostBlock, 3> host{};  // its power-of-two bins while offloaded
    backend::Block stash{};                    // (stash_bytes) from B to W
  };
  // One rank program as the executor runs it: the ops, their lowered waits, reductions and
  // memory plan (schedule/lower.hpp), and an event per op.
  struct Plan {
    const RankProgram* rp = nullptr;
    bool training = true;
    LoweredRank lowered;
    std::vector<int> compute_done, copy_done, comm_done;
    // Two copy streams (Costs::copy_streams): a wait for copy op k is for the last offload
    // and the last reload up to k (-1: none), each on its own stream.
    std::vector<std::array<int, 2>> copy_upto;
    // A reload copied in parts (reload_parts): an event per part but the last (whose event
    // is copy_done); empty for the other copy ops.
    std::vector<std::vector<int>> part_done;
  };
  // A captured kind of training call (RuntimeOptions::graphs): (part, parts) -> its graph.
  template <class B>
  struct GraphOf {
    using type = char;  // (a backend that cannot capture; construct() refuses graphs)
  };
  template <backend::captures_graphs B>
  struct GraphOf<B> {
    using type = typename B::Graph;
  };
  struct Captured {
    typename GraphOf<Backend>::type graph{};
    StepInfo info{};                // the call it was captured at: what a replay's passes see
    int calls = 0;                  // 0: none yet (the first runs as usual); 1: one (the next is captured); 2: captured
    backend::MemoryStats memory{};  // the captured call's: a replay takes no buffer and allocates nothing
  };
  // The step in progress, as the passes see it.
  struct Call {
    StepInfo info{};
    const Plan* plan = nullptr;
  };

  static std::vector<Stage> refs(auto stages) {
    std::vector<Stage> out;
    out.reserve(stages.size());
    for (auto& s : stages) out.emplace_back(s);
    return out;
  }

  std::string stage_label(int s) const {
    const StageInfo& t = table_[static_cast<std::size_t>(s)];
    return "stage " + std::to_string(s) + " (" + t.name + " on rank " + std::to_string(t.rank) + ")";
  }

  void construct();
  /// Checks stage `stage`'s saved_parts() (layer.hpp) against its `declared` saved bytes and
  /// appends its chunk's parts_ and declared_parts_ (`guard`: the canary after the buffer).
  void set_parts(const Stage& l, int stage, std::size_t declared, std::size_t guard);

  /// The step inputs this rank's stages declare: each name once (two stages that declare one
  /// name must agree on its type and size), and each stage's view of each microbatch's slice.
  void collect_inputs();

  /// Every rank's shared parameters (SharedParam), gathered, checked and grouped into ties_.
  void resolve_ties();
  /// The primary's working values of every shared parameter to its other holders (share_tied).
  void push_tied();
  /// After the step's last W of the chunks holding shared parameters: every holder's gradients
  /// (exact: sums) added into the primary's, in holder order (the comm stream).
  void run_ties();
  /// Whether this call adds the shared parameters' gradients (the last part of a step, on a
  /// rank that holds one).
  bool tying() const {
    return call_.plan != nullptr && call_.plan->training && call_.info.part == call_.info.parts - 1 && tie_here_;
  }

  /// What the replicas of this rank compare at construction (po::handshake).
  std::vector<HandshakeField> replica_fields() const;

  void make_plan(Plan& plan, const Program& program, bool training) {
    const RankProgram& rp = program.ranks[static_cast<std::size_t>(rank_)];
    plan.rp = &rp;
    plan.training = training;
    plan.lowered = lower(program, rank_, stage_bytes());
    for (std::size_t x = 0; x < rp.compute.size(); ++x) plan.compute_done.push_back(dev_.make_event());
    for (std::size_t y = 0; y < rp.copy.size(); ++y) plan.copy_done.push_back(dev_.make_event());
    for (std::size_t k = 0; k < rp.comm.size(); ++k) plan.comm_done.push_back(dev_.make_event());
    plan.part_done.resize(rp.copy.size());
    for (std::size_t y = 0; y < rp.copy.size(); ++y)
      if (rp.copy[y].kind == OpKind::R)
        for (std::size_t i = 1; i < reload_parts(program_.shape.chunk_of(rp.copy[y].stage)).size(); ++i)
          plan.part_done[y].push_back(dev_.make_event());
    std::array<int, 2> upto{-1, -1};
    for (std::size_t y = 0; y < rp.copy.size(); ++y) {
      upto[rp.copy[y].kind == OpKind::R ? 1 : 0] = static_cast<int>(y);
      plan.copy_upto.push_back(upto);
    }
    if (compute_ < 0) {
      compute_ = dev_.make_stream("compute");
      copy_ = dev_.make_stream("copy");
      reload_ = program_.costs.duplex() ? dev_.make_stream("reload") : copy_;
      comm_stream_ = dev_.make_stream("comm");
      for (int c = 0; c < program_.shape.v; ++c) gathered_.push_back(dev_.make_event());
      gather_pending_.assign(static_cast<std::size_t>(program_.shape.v), 0);
    }
  }

  /// Takes from the backend, up front, the pinned bins of the memory plans of the programs it
  /// runs (po::reservation_of, what po::reservation_plan computes for a launcher; the device
  /// region is allocate_state's), and the gradient norm's buffers where the backend has them
  /// (backend::reserves_norm_buffers), so no step allocates.
  void reserve_memory() {
    for (const BlockCount& b : reservation_of(train_.lowered, eval_.lowered).host) dev_.reserve_host(b.bytes, b.count);
    // Each chunk's whole groups: every piece of them (a shard's) needs no more.
    if constexpr (backend::reserves_norm_buffers<Backend>)
      for (const std::vector<std::size_t>& groups : norm_groups_) dev_.reserve_sum_squares(groups);
  }

  /// The backend's memory figures with the region's buffers counted as what they hold (units,
  /// stashes, boundary tensors) instead of one state block: the backend's peaks and the
  /// region's, taken since the call began.
  backend::MemoryStats memory() {
    backend::MemoryStats m = dev_.memory();
    std::lock_guard lk(buffers_mu_);
    const auto state = static_cast<std::size_t>(backend::Memory::state);
    m.in_use[state] -= region_.bytes;
    m.peak[state] -= std::min(m.peak[state], region_.bytes);
    for (backend::Memory k : {backend::Memory::activation, backend::Memory::stash, backend::Memory::message}) {
      m.in_use[static_cast<std::size_t>(k)] += buffers_.in(k);
      m.peak[static_cast<std::size_t>(k)] += buffers_.peak_of(k);
    }
    m.total_peak = m.total_peak - std::min(m.total_peak, region_.bytes) + buffers_.total_peak;
    return m;
  }

  /// A buffer of the memory plan: `bytes` at `offset` in the region, counted under `kind`.
  backend::Block take_buffer(std::size_t offset, std::size_t bytes, backend::Memory kind) {
    if (offset == no_buffer || offset + bytes > region_.bytes)
      throw error("the memory plan has no place for a buffer of " + std::to_string(bytes) + " bytes (offset " +
                  std::to_string(offset) + ", region " + std::to_string(region_.bytes) + ")");
    std::lock_guard lk(buffers_mu_);
    std::size_t& in = buffers_.in_use[static_cast<std::size_t>(kind)];
    in += bytes;
    buffers_.peak[static_cast<std::size_t>(kind)] = std::max(buffers_.peak[static_cast<std::size_t>(kind)], in);
    buffers_total_ += bytes;
    buffers_.total_peak = std::max(buffers_.total_peak, buffers_total_);
    return backend::Block{region_.ptr + offset, bytes, kind};
  }
  /// Gives a take_buffer block back (a null block is ignored): its bytes are the plan's again.
  void give_buffer(backend::Block& b) {
    if (b.ptr == nullptr) return;
    std::lock_guard lk(buffers_mu_);
    buffers_.in_use[static_cast<std::size_t>(b.kind)] -= b.bytes;
    buffers_total_ -= b.bytes;
    b = {};
  }

  /// Every stage's buffer sizes (this rank's own, and the boundaries of all).
  std::vector<StageBytes> stage_bytes() const {
    const Shape& sh = program_.shape;
    std::vector<StageBytes> out(static_cast<std::size_t>(sh.stages()));
    for (int s = 0; s < sh.stages(); ++s) {
      StageBytes& b = out[static_cast<std::size_t>(s)];
      b.input = s > 0 ? table_[static_cast<std::size_t>(s)].input.bytes() : 0;
      b.output = s + 1 < sh.stages() ? table_[static_cast<std::size_t>(s)].output.bytes() : 0;
      if (sh.rank_of(s) == rank_) {
        b.saved = saved_[static_cast<std::size_t>(sh.chunk_of(s))];
        b.stash = stash_[static_cast<std::size_t>(sh.chunk_of(s))];
      }
    }
    return out;
  }

  /// Device memory of the runtime's own state, taken once here: the step's inputs, the last
  /// stage's per-microbatch losses, the non-finite flags (one per compute op).
  void allocate_state();

  /// Each chunk's norm_pieces, from its layout and norm groups.
  void make_norm_pieces();

  // ---- one call -------------------------------------------------------------------------

  PassStats run(const Plan& plan, const Batch& batch, StepInfo info);

  /// Checks the batch against the declared inputs and copies them to the device.
  void upload_inputs(const Batch& batch);

  /// After the passes: the losses and the first non-finite value, the same on every rank.
  void verdict(const Plan& plan, PassStats& st);

  // ---- the streams ----------------------------------------------------------------------

  /// Where the current stream is, into `slot` by the call's synchronize (backend::marks_times;
  /// without it, the time of the call).
  void stamp(double& slot) {
    if constexpr (backend::marks_times<Backend>)
      dev_.mark(&slot);
    else
      slot = dev_.now();
  }

  Microbatch info(const Op& op) const {
    const Shape& sh = program_.shape;
    const StepInfo& in = call_.info;
    const std::size_t c = static_cast<std::size_t>(sh.chunk_of(op.stage));
    Microbatch mb;
    mb.stage = op.stage;
    mb.stages = sh.stages();
    mb.mb = (replica_ * in.parts + in.part) * sh.m + op.mb;
    mb.microbatches = dp_ * in.parts * sh.m;
    mb.step = in.step;
    if (opt_.graphs) mb.device_step = step_dev();
    mb.training = call_.plan->training;
    mb.shape = opt_.microbatch;
    mb.inputs = views_[c * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(op.mb)];
    if (op.stage == sh.stages() - 1) mb.loss = losses_dev() + op.mb;
    mb.loss_scale = 1.0f / static_cast<float>(mb.microbatches);
    return mb;
  }

  std::string where(const char* stream, std::size_t index, const Op& op, int rank) const {
    return "rank " + std::to_string(rank) + ", " + stream + " op " + std::to_string(index) + " " + op_name(op.kind) +
           "(stage " + std::to_string(op.stage) + ", mb " + std::to_string(op.mb) + ")";
  }

  /// Runs `body` as op `index` of a stream; an exception gets the rank and op in front.
  template <class F>
  void guarded(const char* stream, std::size_t index, const Op& op, F&& body) {
    try {
      body();
    } catch (const aborted_error&) {
      throw;  // the failure is someone else's and already named
    } catch (const std::exception& e) {
      throw error(where(stream, index, op, rank_) + ": " + e.what());
    }
  }

  // Boundary tensors by tag (stage that consumes them, microbatch, direction): a forward
  // message holds the consumer's input, a backward one the gradient of its output.
  const Boundary& message(int stage, Dir dir) const {
    const StageInfo& t = table_[static_cast<std::size_t>(stage)];
    return dir == Dir::forward ? t.input : t.output;
  }
  backend::Block& box(int stage, int mb, Dir dir) { return boxes_[detail::tag_slot(program_.shape, stage, mb, dir)]; }
  Tensor box_out(int consumer, int mb, Dir dir, std::size_t offset) {
    const Boundary& b = message(consumer, dir);
    backend::Block& blk = box(consumer, mb, dir);
    blk = take_buffer(offset, b.bytes(), backend::Memory::message);
    return Tensor{blk.ptr, b.elements, b.dtype};
  }
  ConstTensor box_in(int stage, int mb, Dir dir) {
    const Boundary& b = message(stage, dir);
    return ConstTensor{box(stage, mb, dir).ptr, b.elements, b.dtype};
  }
  void release_box(int stage, int mb, Dir dir) { give_buffer(box(stage, mb, dir)); }

  void run_compute(std::size_t x);

  /// Copy op y, or (a reload copied in parts) part `part` of it.
  void run_copy(std::size_t y, std::size_t part);
  /// The reload of compute op x's own unit, if x is a B or BW that waits for no more of the
  /// copy stream than that reload and the reload is copied in parts (-1 otherwise): then x
  /// waits only for its first part, and the pass for the others (Microbatch::await_saved).
  int split_reload(const Plan& plan, std::size_t x) const {
    const Op& op = plan.rp->compute[x];
    if (op.kind != OpKind::B && op.kind != OpKind::BW) return -1;
    const int y = plan.lowered.compute[x].on(Stream::copy);
    if (y < 0 || plan.part_done[static_cast<std::size_t>(y)].empty()) return -1;
    const Op& r = plan.rp->copy[static_cast<std::size_t>(y)];
    return r.kind == OpKind::R && r.stage == op.stage && r.mb == op.mb ? y : -1;
  }

  void run_comm(std::size_t k);

  /// After chunk c's last W of a step: its gradients (standard) or exact sums, rounded
  /// (exact), reduced across the replicas into its gradients() (on the comm stream; see the
  /// file comment).
  void run_reduce(int chunk);
  void reduce_standard(int chunk, Context& ctx);
  void reduce_exact(int chunk, Context& ctx);

  /// Whether this call reduces across replicas (the last part of a step, with dp > 1).
  bool reducing() const { return replicas_ != nullptr && dp_ > 1 && call_.info.part == call_.info.parts - 1; }

  /// Chunk c's exact sums (exact path), and the bucket layout of the reduction (values per
  /// bucket, a multiple of dp; the sums are padded to whole buckets).
  std::span<exact::Fixed> sums(int chunk) {
    const backend::Block& b = sums_[static_cast<std::size_t>(chunk)];
    return {reinterpret_cast<exact::Fixed*>(b.ptr), b.bytes / sizeof(exact::Fixed)};
  }
  std::size_t bucket_values(int chunk) const { return layouts_[static_cast<std::size_t>(chunk)].len; }
  // The staging's fp32 buffers of one slice and of one bucket (reduction_staging_bytes' order).
  const backend::Block& slice_staging() const { return staging_[2]; }
  const backend::Block& bucket_staging() const {
    return opt_.gradients == Gradients::standard ? staging_[0] : staging_[3];
  }

  /// Enqueues the rank's three streams. A wait captures the latest record of its event, so
  /// ops go in in an order where every awaited event's record is already enqueued: advance
  /// each stream while its next op's dependencies are in (the schedule is valid, so this
  /// reaches the end).
  void enqueue(const Plan& plan);

  std::size_t unit_index(int stage, int mb) const {
    return static_cast<std::size_t>(program_.shape.chunk_of(stage)) * static_cast<std::size_t>(program_.shape.m) +
           static_cast<std::size_t>(mb);
  }
  int checked_index(int chunk) const {
    if (chunk < 0 || chunk >= program_.shape.v)
      throw error("po::Runtime: chunk " + std::to_string(chunk) + " is outside [0, " +
                  std::to_string(program_.shape.v - 1) + "]");
    return chunk;
  }
  const Stage& checked(int chunk) const { return stages_[static_cast<std::size_t>(checked_index(chunk))]; }

  struct Declared {
    InputSpec spec;
    int chunk = 0;  // the first stage of this rank that declared it
  };

  RuntimeOptions opt_;
  Backend& dev_;
  Communicator& comm_;
  Communicator* replicas_ = nullptr;  // the data-parallel peers, or none
  int dp_ = 1, replica_ = 0;
  std::vector<Stage> stages_;
  Program program_, eval_program_;
  int rank_ = 0;
  std::vector<StageInfo> table_;            // every stage of the pipeline
  std::vector<std::size_t> saved_, stash_;  // per chunk
  // Per chunk: the parts of its saved buffer (each byte ranges: the layer's saved_parts, the
  // guard's canary added to the last), as its reloads copy them; one part when it declares
  // none or RuntimeOptions::reload_parts is off. declared_parts_: how many await_saved counts.
  std::vector<std::vector<std::vector<std::array<std::size_t, 2>>>> parts_;
  std::vector<int> declared_parts_;
  const std::vector<std::vector<std::array<std::size_t, 2>>>& reload_parts(int chunk) const {
    return parts_[static_cast<std::size_t>(chunk)];
  }
  std::vector<std::vector<std::size_t>> norm_groups_;  // per chunk
  std::size_t max_groups_ = 1;
  std::vector<Declared> inputs_;               // step inputs this rank uploads
  std::vector<backend::Block> inputs_dev_;     // (m, elements) of each, device
  std::vector<std::vector<StepInput>> views_;  // [chunk * m + mb]: what a pass sees of the inputs
  // The step's results, read back in one download: a uint32 non-finite flag per compute op
  // (flag_count() of them), then the last stage's m float losses; device.
  backend::Block results_dev_{};
  std::size_t flag_count() const { return std::max<std::size_t>(1, train_.rp->compute.size()); }
  std::uint32_t* flags_dev() const { return reinterpret_cast<std::uint32_t*>(results_dev_.ptr); }
  float* losses_dev() const {
    return reinterpret_cast<float*>(results_dev_.ptr + flag_count() * sizeof(std::uint32_t));
  }
  // RuntimeOptions::graphs: the step, one int32 after the losses (Microbatch::device_step).
  std::int32_t* step_dev() const {
    return reinterpret_cast<std::int32_t*>(results_dev_.ptr + flag_count() * sizeof(std::uint32_t) +
                                           static_cast<std::size_t>(program_.shape.m) * sizeof(float));
  }
  std::map<std::pair<int, int>, Captured> captured_;  // RuntimeOptions::graphs, by (part, parts)
  long long step_written_ = -1;                       // the step step_dev() holds (-1: none yet)
  /// RuntimeOptions::graphs: runs a training call by its kind's graph (see there).
  void run_graph(const Plan& plan, StepInfo info);
  std::vector<backend::Block> sums_;                 // per chunk: exact::Fixed gradient sums, padded to whole buckets
  std::vector<backend::Block> staging_;              // reduction: reduction_staging_bytes' buffers, in its order
  std::vector<GradientLayout> layouts_;              // per chunk: reduction buckets and shards
  std::vector<std::vector<NormPiece>> norm_pieces_;  // per chunk: what grad_norm reads
  std::vector<std::vector<double>> norm_sums_;       // per piece: the gradients' sums (norm_sums)
  bool norm_ready_ = false;                          // norm_sums_ are the gradients' (norm_sums)
  // Enqueues every norm piece's sum_squares into norm_sums_ (written by the next synchronize()).
  void enqueue_norm_sums() {
    norm_sums_.clear();
    for (std::size_t c = 0; c < stages_.size(); ++c)
      for (const NormPiece& p : norm_pieces_[c]) norm_sums_.emplace_back(p.sizes.size(), 0.0);
    for (std::size_t c = 0, x = 0; c < stages_.size(); ++c)
      for (const NormPiece& p : norm_pieces_[c])
        dev_.sum_squares(stages_[c].gradients().subspan(p.range.begin, p.range.size()), p.sizes,
                         std::span(norm_sums_[x++]));
  }
  std::vector<TiedParameter> ties_;   // every shared parameter of the pipeline, by key
  std::vector<char> tie_chunk_;       // per chunk: holds a shared parameter
  std::vector<char> tie_primary_;     // per chunk: holds a primary
  std::vector<char> tie_copy_chunk_;  // per chunk: holds a copy (tied_copies)
  bool tie_here_ = false;             // this rank holds a shared parameter
  backend::Block tie_staging_{};      // the primary's staging (tie_staging_bytes)
  bool shard_gradients_ = false;      // standard path: the reduction skips the all-gather
  int compute_ = -1, copy_ = -1, comm_stream_ = -1;
  int reload_ = -1;                   // the reloads' stream: copy_, or a second one (Costs::copy_streams = 2)
  std::vector<int> gathered_;         // per chunk: recorded after share_shards(c, true)'s gather
  std::vector<char> gather_pending_;  // per chunk: that gather not yet waited for
  Plan train_, eval_;
  backend::Block region_;          // the memory plans' device region (training's and evaluation's)
  std::mutex buffers_mu_;          // the streams take and give buffers from their threads
  backend::MemoryStats buffers_;   // in use and peaks of the region's buffers, per kind
  std::size_t buffers_total_ = 0;  // bytes of the region's buffers in use
  Call call_{};
  std::vector<Unit> units_;
  std::vector<backend::Block> boxes_;   // boundary tensors by tag: received inputs, outputs to send
  long long iterations_ = 0;            // training calls enqueued (pair counters count from 0)
  std::vector<std::size_t> pair_wait_;  // per copy op: partner copies to wait for
  std::size_t partner_copies_ = 0;      // the partner's copies per step
  PairLink<Backend>* pair_ = nullptr;   // PCIe partner's link, or none
  int pair_poll_ = -1;                  // the backend's wait poll keeping the link's abort (pair_with), or none
  RankSim trace_;
  std::vector<Reduction> reduce_trace_;
};

/// Deduces Runtime<Backend, Communicator> from a program, a device, a communicator and stages.
template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, Stages&&) -> Runtime<B, C>;
/// The same, with options.
template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, Stages&&, RuntimeOptions) -> Runtime<B, C>;
/// The same, with a replicas communicator (data parallelism).
template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, C&, Stages&&) -> Runtime<B, C>;
/// The same, with a replicas communicator and options.
template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, C&, Stages&&, RuntimeOptions) -> Runtime<B, C>;

/// A runtime whose program a schedule type builds: Runtime<po::PO_F, Layer, Backend, Comm>
/// runs `Schedule::build(shape, costs)` with stages of one layer type. The same as
/// Runtime<Backend, Comm> built from that Program, bit for bit.
template <class Schedule, class Layer, class Backend, class Communicator>
class Runtime<Schedule, Layer, Backend, Communicator> : public Runtime<Backend, Communicator> {
  static_assert(
      layer_for<Layer, typename Backend::Context>,
      "po::Runtime: Layer must model po::layer_for<Layer, Backend::Context>: it needs input_boundary(shape), output_boundary(shape), saved_bytes(shape), "
      "stash_bytes(shape), forward(ctx, mb, x, y, saved) -> void, backward_input(ctx, mb, dy, dx, saved, stash), "
      "backward_weight(ctx, mb, saved, stash), parameters() and gradients(); see pipeoffload/layer.hpp.");

 public:
  /// Builds Schedule's program for `shape` and `costs`, then constructs the runtime from it
  /// (collective, like the constructors that take a Program).
  Runtime(Shape shape, Backend& dev, Communicator& comm, std::span<Layer> stages, RuntimeOptions opt = {},
          const Costs& costs = {})
      : Runtime<Backend, Communicator>(Schedule::build(shape, costs), dev, comm, stages, opt) {}
};

}  // namespace pipeoffload

// The member functions defined outside the class.
#include "detail/setup.hpp"
#include "detail/step.hpp"
#include "detail/streams.hpp"
