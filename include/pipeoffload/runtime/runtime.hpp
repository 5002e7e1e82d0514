// pipeoffload/runtime/runtime.hpp: po::Runtime, one rank of a pipeline executing a Program.
//
// A Runtime executes its rank's part of any validated po::Program (built from a schedule type,
// by po::build at run time, by po::plan, or imported) with the rank's stages, which may be of
// different types. forward_backward() enqueues the rank's whole program: F/B/W/BW on the
// compute stream, O/R on the copy stream, sends and receives on the comm stream in
// RankProgram::comm order, with every dependency an event (a received input, a produced
// output, the schedule's cross-stream edges). The streams then run as soon as possible under
// those events, which is exactly what simulate() models. Gradients accumulate (+=) into the
// stages' gradients() in microbatch order, across calls, until zero_grad(). The optimizer is
// not the runtime's: a training step is a few visible calls (runtime/optimizer.hpp):
//
//   rt.zero_grad();
//   const po::PassStats fb = rt.forward_backward(batch, {.step = step});
//   const double norm = po::grad_norm(rt);
//   opt.step(lr(step), po::clip_scale(norm, 1.0f));
//
// Nothing in a pass needs a value back, so the same code drives a synchronous backend
// (backend::Cpu) and an asynchronous one (backend::Cuda): a step's inputs are uploaded to
// device memory before the passes, the last stage's losses are written to device memory and
// downloaded after them.
//
// Failures: an exception anywhere in a rank (construction, a pass, a P2P, the optimizer, a
// checkpoint) aborts the communicator, so every other rank's next wait throws aborted_error
// naming it; no rank is left waiting. A NaN or infinity is caught where it appears: the first
// stage, in data-flow order, whose output activation, loss or input gradient is not finite
// is named in a po::nonfinite_error that every rank throws.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../backend/backend.hpp"
#include "../comm/communicator.hpp"
#include "../comm/handshake.hpp"
#include "../error.hpp"
#include "../layer.hpp"
#include "../offload/host_bins.hpp"
#include "../schedule/schedule.hpp"
#include "../schedule/validate.hpp"
#include "../sim/simulate.hpp"
#include "batch.hpp"
#include "reserve.hpp"
#include "stage.hpp"

namespace pipeoffload {

struct RuntimeOptions {
  MicrobatchShape microbatch{};  ///< the shape of one microbatch, given to the stages' size functions and passes
  /// Check every output activation and input gradient for NaN and infinity where it is
  /// produced (one pass over the boundary tensor, on the stream that made it; its cost is in
  /// bench/RESULTS.md). Losses are always checked.
  bool check_finite = true;
};

/// Where a forward_backward call sits in training: the optimizer step its gradients go to
/// (Microbatch::step) and, with gradient accumulation, which of `parts` calls it is. The
/// `parts` calls of one step see microbatches part*m .. part*m + m-1 of parts*m and scale
/// their loss gradients by 1/(parts*m): k calls on m microbatches each, then one optimizer
/// step, equal one call on k*m microbatches in the same order, bit for bit.
struct StepInfo {
  int step = 0;
  int part = 0;
  int parts = 1;
};

/// What forward_backward and evaluate report (the same on every rank except seconds and memory).
struct PassStats {
  float loss = 0;                 ///< mean over this call's microbatches of each microbatch's mean loss
  std::vector<float> losses;      ///< each microbatch's loss, in microbatch order
  double seconds = 0;             ///< wall time of the passes (enqueue to last stream idle)
  backend::MemoryStats memory{};  ///< this rank's device and host memory; peaks of this call
};

/// What ranks r and r^1 of a PCIe pair share when they run in one process: one counter per
/// side, raised by that side's copy stream after each copy (DESIGN.md section 3, "synchronized
/// interleaved"). Make one per pair, hand it to both ranks' runtimes with pair_with() before
/// their first step, and keep it alive as long as they are.
template <class Backend>
struct PairLink {
  static_assert(backend::pairs_copies<Backend>,
                "po::PairLink: the backend has no shared counters (backend::pairs_copies)");
  typename Backend::Counter side[2];  ///< side[r & 1]: copies completed by rank r
  void abort(const std::string& why) {
    for (auto& c : side) c.abort(why);
  }
};

/// One stage of the pipeline as every rank knows it after construction.
struct StageInfo {
  int rank = 0, chunk = 0;
  std::string name;        ///< the stage type's name
  Boundary input, output;  ///< what it takes and hands on, per microbatch
  std::size_t parameters = 0;
  std::size_t norm_groups = 1;
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
      communicator<Communicator, typename Backend::Context>,
      "po::Runtime: Communicator must model po::communicator<C, Backend::Context> (rank, size, send(ctx, ...) and "
      "recv(ctx, ...) with the backend's stream context, all_gather of doubles and bytes, abort); see comm/communicator.hpp.");

 public:
  using backend_type = Backend;
  using communicator_type = Communicator;
  using Context = typename Backend::Context;
  using Stage = StageRef<Context>;

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

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // Every call ends with its streams idle (synchronize waits for that even on failure), so
  // only the hook can still point here.
  ~Runtime() {
    dev_.set_error_hook(nullptr);
    for (backend::Block& b : inputs_dev_) dev_.device_free(b);
    dev_.device_free(losses_dev_);
    dev_.device_free(flags_dev_);
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

  /// Sets every stage's gradients to zero (on the device).
  void zero_grad() {
    guard("zero_grad", [&] {
      for (const Stage& s : stages_) dev_.zero(s.gradients().data(), s.gradients().size_bytes());
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
    pair_ = &link;
    pair_wait_ =
        pair_waits(program_.ranks[static_cast<std::size_t>(rank_)], program_.ranks[static_cast<std::size_t>(partner)]);
    partner_copies_ = program_.ranks[static_cast<std::size_t>(partner)].copy.size();
  }

  const Program& program() const { return program_; }
  const RuntimeOptions& options() const { return opt_; }
  int rank() const { return rank_; }
  Backend& device() { return dev_; }
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
    dev_.abort(why);
    if constexpr (backend::pairs_copies<Backend>)
      if (pair_ != nullptr) pair_->abort(why);
  }

  // ---- training state: parameters live in device memory; these copy them between steps.
  /// Chunk c's parameters, copied to the host.
  std::vector<float> download_parameters(int chunk) { return download(checked(chunk).parameters()); }
  /// Overwrites chunk c's parameters (values.size() must be their count).
  void upload_parameters(int chunk, std::span<const float> values) {
    upload(checked(chunk).parameters(), values, "parameters");
  }
  /// Chunk c's gradients, copied to the host.
  std::vector<float> download_gradients(int chunk) { return download(checked(chunk).gradients()); }

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
  const RankSim& trace() const { return trace_; }

 private:
  struct Unit {
    backend::Block device{};                   // (saved_bytes) the stage's saved activations
    std::array<backend::HostBlock, 3> host{};  // its power-of-two bins while offloaded
    backend::Block stash{};                    // (stash_bytes) from B to W
  };
  // One rank program as the executor runs it: the ops, which comm op feeds each compute op
  // and which compute op each send waits for, and an event per op.
  struct Plan {
    const RankProgram* rp = nullptr;
    bool training = true;
    detail::StreamLinks links;
    std::vector<int> compute_done, copy_done, recv_done;
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

  void construct() {
    require_valid(program_);
    const Shape& sh = program_.shape;
    rank_ = comm_.rank();
    if (comm_.size() != sh.d)
      throw error("po::Runtime: the communicator has " + std::to_string(comm_.size()) +
                  " ranks; the program has d = " + std::to_string(sh.d));
    if (static_cast<int>(stages_.size()) != sh.v)
      throw error("po::Runtime: rank " + std::to_string(rank_) + " was given " + std::to_string(stages_.size()) +
                  " stages; it needs v = " + std::to_string(sh.v) + " (one per chunk)");
    const MicrobatchShape mbs = opt_.microbatch;
    if (mbs.batch < 1 || mbs.seq < 1)
      throw error("po::Runtime: microbatch shape batch = " + std::to_string(mbs.batch) +
                  ", seq = " + std::to_string(mbs.seq) + " must both be >= 1");
    const RankProgram& rp = program_.ranks[static_cast<std::size_t>(rank_)];
    // This rank's stages, as every rank will know them.
    struct Row {
      Boundary input, output;
      std::size_t parameters = 0, norm_groups = 0;
      detail::ShortText name;
    };
    std::vector<Row> mine;
    for (int c = 0; c < sh.v; ++c) {
      const Stage& l = stages_[static_cast<std::size_t>(c)];
      const int s = sh.stage_of(rank_, c);
      if (l.parameters().size() != l.gradients().size())
        throw error("po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ") has " +
                    std::to_string(l.parameters().size()) + " parameters but " + std::to_string(l.gradients().size()) +
                    " gradients");
      const std::vector<std::size_t> groups = l.norm_groups();
      std::size_t total = 0;
      for (std::size_t g : groups) total += g;
      if (total != l.parameters().size())
        throw error("po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ")'s norm_groups() cover " +
                    std::to_string(total) + " parameters, not its " + std::to_string(l.parameters().size()));
      mine.push_back({l.input_boundary(mbs), l.output_boundary(mbs), l.parameters().size(), groups.size(),
                      detail::ShortText::of(l.name())});
      saved_.push_back(l.saved_bytes(mbs));
      stash_.push_back(l.stash_bytes(mbs));
      norm_groups_.push_back(groups);
    }
    // Bit-exactness: each stage must accumulate its weight gradients in microbatch order, as
    // a one-rank run does. Every family orders them so; a program that does not is refused.
    std::vector<int> last_w(static_cast<std::size_t>(sh.v), -1);
    for (const Op& op : rp.compute)
      if (op.kind == OpKind::W || op.kind == OpKind::BW) {
        int& prev = last_w[static_cast<std::size_t>(sh.chunk_of(op.stage))];
        if (op.mb < prev)
          throw error("po::Runtime: stage " + std::to_string(op.stage) + " computes weight gradients of microbatch " +
                      std::to_string(op.mb) + " after microbatch " + std::to_string(prev) +
                      "; gradients must accumulate in microbatch order");
        prev = op.mb;
      }
    collect_inputs();
    // Every rank's stages (a collective: a rank that failed above has aborted it instead).
    std::vector<Row> all(mine.size() * static_cast<std::size_t>(sh.d));
    comm_.all_gather(std::span<const Row>(mine), std::span(all));  // [rank * v + chunk]
    table_.resize(static_cast<std::size_t>(sh.stages()));
    for (int r = 0; r < sh.d; ++r)
      for (int c = 0; c < sh.v; ++c) {
        const Row& x = all[static_cast<std::size_t>(r) * static_cast<std::size_t>(sh.v) + static_cast<std::size_t>(c)];
        table_[static_cast<std::size_t>(sh.stage_of(r, c))] = {
            r, c, x.name.str(), x.input, x.output, x.parameters, x.norm_groups};
      }
    // Every producer and its consumer must agree (every rank sees the same table and throws
    // the same sentence).
    for (int s = 0; s + 1 < sh.stages(); ++s) {
      const Boundary& out = table_[static_cast<std::size_t>(s)].output;
      const Boundary& in = table_[static_cast<std::size_t>(s + 1)].input;
      if (!(out == in))
        throw error("po::Runtime: " + stage_label(s) + " outputs " + std::to_string(out.elements) + " " +
                    dtype_name(out.dtype) + " values per microbatch, but " + stage_label(s + 1) + " takes " +
                    std::to_string(in.elements) + " " + dtype_name(in.dtype) +
                    "; a stage's output and the next stage's input must agree");
    }
    for (const StageInfo& t : table_) max_groups_ = std::max(max_groups_, t.norm_groups);
    // The plans the executor runs: training and forward-only evaluation.
    eval_program_ = forward_only(program_);
    make_plan(train_, program_.ranks[static_cast<std::size_t>(rank_)], true);
    make_plan(eval_, eval_program_.ranks[static_cast<std::size_t>(rank_)], false);
    units_.assign(static_cast<std::size_t>(sh.v) * static_cast<std::size_t>(sh.m), Unit{});
    boxes_.assign(static_cast<std::size_t>(sh.stages()) * static_cast<std::size_t>(sh.m) * 2, backend::Block{});
    if constexpr (backend::reserves_memory<Backend>) reserve_memory();
    allocate_state();
    // A failure on this device wakes every peer blocked on this rank (and the pair partner's
    // copy stream, which may be waiting for this one's).
    dev_.set_error_hook([this](const std::string& why) {
      comm_.abort(why);
      if constexpr (backend::pairs_copies<Backend>)
        if (pair_ != nullptr) pair_->abort(why);
    });
  }

  /// The step inputs this rank's stages declare: each name once (two stages that declare one
  /// name must agree on its type and size), and each stage's view of each microbatch's slice.
  void collect_inputs() {
    const Shape& sh = program_.shape;
    for (int c = 0; c < sh.v; ++c) {
      const Stage& l = stages_[static_cast<std::size_t>(c)];
      for (const InputSpec& in : l.inputs(opt_.microbatch)) {
        auto it =
            std::find_if(inputs_.begin(), inputs_.end(), [&](const Declared& d) { return d.spec.name == in.name; });
        if (it == inputs_.end()) {
          inputs_.push_back({in, c});
          continue;
        }
        if (it->spec.dtype != in.dtype || it->spec.elements != in.elements)
          throw error("po::Runtime: stages " + std::to_string(sh.stage_of(rank_, it->chunk)) + " and " +
                      std::to_string(sh.stage_of(rank_, c)) + " declare the step input '" + in.name +
                      "' differently: " + std::to_string(it->spec.elements) + " " + dtype_name(it->spec.dtype) +
                      " and " + std::to_string(in.elements) + " " + dtype_name(in.dtype) + " values per microbatch");
      }
    }
  }

  void make_plan(Plan& plan, const RankProgram& rp, bool training) {
    plan.rp = &rp;
    plan.training = training;
    plan.links = detail::stream_links(program_.shape, rp);
    for (std::size_t x = 0; x < rp.compute.size(); ++x) plan.compute_done.push_back(dev_.make_event());
    for (std::size_t y = 0; y < rp.copy.size(); ++y) plan.copy_done.push_back(dev_.make_event());
    for (std::size_t k = 0; k < rp.comm.size(); ++k) plan.recv_done.push_back(dev_.make_event());
    if (compute_ < 0) {
      compute_ = dev_.make_stream("compute");
      copy_ = dev_.make_stream("copy");
      comm_stream_ = dev_.make_stream("comm");
    }
  }

  /// Takes from the device, up front, every buffer this rank's program can hold at once
  /// (po::reservation_plan), so no step allocates.
  void reserve_memory() {
    const Reservation res = reservation_plan(program_, rank_, stage_bytes());
    for (const auto* list : {&res.activation, &res.stash, &res.message})
      for (const BlockCount& b : *list) dev_.reserve_device(b.bytes, b.count);
    for (const BlockCount& b : res.host) dev_.reserve_host(b.bytes, b.count);
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
  void allocate_state() {
    const Shape& sh = program_.shape;
    // Reserved for themselves, so they never take a block reserve_memory() counted on.
    const auto take = [&](std::size_t bytes) {
      if constexpr (backend::reserves_memory<Backend>) dev_.reserve_device(bytes, 1);
      return dev_.device_alloc(bytes, backend::Memory::state);
    };
    const std::size_t m = static_cast<std::size_t>(sh.m);
    for (const Declared& d : inputs_) inputs_dev_.push_back(take(m * d.spec.elements * dtype_size(d.spec.dtype)));
    losses_dev_ = take(m * sizeof(float));
    flags_dev_ = take(std::max<std::size_t>(1, train_.rp->compute.size()) * sizeof(std::uint32_t));
    // Each stage's view of each microbatch's inputs: fixed device addresses, built once.
    views_.resize(static_cast<std::size_t>(sh.v) * m);
    for (int c = 0; c < sh.v; ++c)
      for (const InputSpec& in : stages_[static_cast<std::size_t>(c)].inputs(opt_.microbatch)) {
        std::size_t k = 0;
        while (inputs_[k].spec.name != in.name) ++k;
        const std::size_t bytes = in.elements * dtype_size(in.dtype);
        for (std::size_t b = 0; b < m; ++b)
          views_[static_cast<std::size_t>(c) * m + b].push_back(
              {inputs_[k].spec.name, ConstTensor{inputs_dev_[k].ptr + b * bytes, in.elements, in.dtype}});
      }
  }

  // ---- one call -------------------------------------------------------------------------

  PassStats run(const Plan& plan, const Batch& batch, StepInfo info) {
    const Shape& sh = program_.shape;
    if (info.parts < 1 || info.part < 0 || info.part >= info.parts || info.step < 0)
      throw error("po::Runtime: StepInfo{step = " + std::to_string(info.step) +
                  ", part = " + std::to_string(info.part) + ", parts = " + std::to_string(info.parts) +
                  "} needs step >= 0, parts >= 1 and 0 <= part < parts");
    if (static_cast<long long>(info.parts) * sh.m > max_microbatches)
      throw error("po::Runtime: parts * m = " + std::to_string(static_cast<long long>(info.parts) * sh.m) +
                  " microbatches in one step exceed " + std::to_string(max_microbatches));
    upload_inputs(batch);
    const RankProgram& rp = *plan.rp;
    dev_.zero(flags_dev_.ptr, rp.compute.size() * sizeof(std::uint32_t));
    call_ = {info, &plan};
    if (plan.training) {
      trace_.compute_start.assign(rp.compute.size(), 0.0);
      trace_.compute_end.assign(rp.compute.size(), 0.0);
      trace_.copy_start.assign(rp.copy.size(), 0.0);
      trace_.copy_end.assign(rp.copy.size(), 0.0);
    }
    dev_.reset_peaks();
    const double t0 = dev_.now();
    enqueue(plan);
    if (plan.training) ++iterations_;
    try {
      dev_.synchronize();
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
    PassStats st;
    st.seconds = dev_.now() - t0;
    st.memory = dev_.memory();
    verdict(plan, st);
    return st;
  }

  /// Checks the batch against the declared inputs and copies them to the device.
  void upload_inputs(const Batch& batch) {
    const std::size_t m = static_cast<std::size_t>(program_.shape.m);
    for (std::size_t k = 0; k < inputs_.size(); ++k) {
      const InputSpec& in = inputs_[k].spec;
      const HostTensor* t = batch.find(in.name);
      const std::string who = "stage " + std::to_string(program_.shape.stage_of(rank_, inputs_[k].chunk));
      if (t == nullptr)
        throw error("po::Runtime: " + who + " reads the step input '" + in.name +
                    "', which the batch does not have (it has: " + batch.names() + ")");
      if (t->dtype != in.dtype || t->elements != m * in.elements)
        throw error("po::Runtime: the step input '" + in.name + "' holds " + std::to_string(t->elements) + " " +
                    dtype_name(t->dtype) + " values; " + who + " reads m * " + std::to_string(in.elements) + " = " +
                    std::to_string(m * in.elements) + " " + dtype_name(in.dtype) + " values");
      if (t->shape.empty() || t->shape[0] % static_cast<long long>(m) != 0)
        throw error(
            "po::Runtime: the step input '" + in.name + "' has " + std::to_string(t->shape.empty() ? 0 : t->shape[0]) +
            " rows (its first dimension); they must split into m = " + std::to_string(m) + " equal microbatches");
      dev_.upload(inputs_dev_[k].ptr, t->data, t->bytes());
    }
  }

  /// After the passes: the losses and the first non-finite value, the same on every rank.
  void verdict(const Plan& plan, PassStats& st) {
    const Shape& sh = program_.shape;
    const int S = sh.stages();
    const std::size_t m = static_cast<std::size_t>(sh.m);
    const RankProgram& rp = *plan.rp;
    const bool last = rank_ == sh.rank_of(S - 1);
    std::vector<float> losses(m, 0.0f);
    if (last) dev_.download(losses.data(), losses_dev_.ptr, m * sizeof(float));
    std::vector<std::uint32_t> flags(rp.compute.size(), 0);
    dev_.download(flags.data(), flags_dev_.ptr, flags.size() * sizeof(std::uint32_t));
    // Position of a value in one microbatch's data flow: F of stages 0..S-1, the loss, then
    // B of stages S-1..0. The first (lowest key) non-finite value is the culprit.
    const double span = 2.0 * S + 1;
    double first = -1;
    const auto note = [&](int mb, int pos) {
      const double key = mb * span + pos;
      if (first < 0 || key < first) first = key;
    };
    for (std::size_t x = 0; x < flags.size(); ++x) {
      if (flags[x] == 0) continue;
      const Op& op = rp.compute[x];
      note(op.mb, op.kind == OpKind::F ? op.stage : S + 1 + (S - 1 - op.stage));
    }
    if (last)
      for (std::size_t b = 0; b < m; ++b)
        if (!std::isfinite(losses[b])) note(static_cast<int>(b), S);
    std::vector<double> mine(m + 1), all((m + 1) * static_cast<std::size_t>(sh.d));
    for (std::size_t b = 0; b < m; ++b) mine[b] = static_cast<double>(losses[b]);
    mine[m] = first;
    comm_.all_gather(std::span<const double>(mine), std::span(all));
    const std::size_t lr = static_cast<std::size_t>(sh.rank_of(S - 1));
    st.losses.resize(m);
    double sum = 0;
    for (std::size_t b = 0; b < m; ++b) {
      st.losses[b] = static_cast<float>(all[lr * (m + 1) + b]);
      sum += all[lr * (m + 1) + b];
    }
    st.loss = static_cast<float>(sum / static_cast<double>(m));
    double worst = -1;
    for (int r = 0; r < sh.d; ++r) {
      const double k = all[static_cast<std::size_t>(r) * (m + 1) + m];
      if (k >= 0 && (worst < 0 || k < worst)) worst = k;
    }
    if (worst < 0) return;
    const int mb = static_cast<int>(worst / span), pos = static_cast<int>(worst - mb * span);
    const std::string when = plan.training
                                 ? "po::Runtime::forward_backward (step " + std::to_string(call_.info.step) + ")"
                                 : "po::Runtime::evaluate";
    const Program& prog = plan.training ? program_ : eval_program_;
    const auto op_at = [&](int stage, bool forward) {
      const int r = sh.rank_of(stage);
      const auto& ops = prog.ranks[static_cast<std::size_t>(r)].compute;
      for (std::size_t x = 0; x < ops.size(); ++x)
        if (ops[x].stage == stage && ops[x].mb == mb &&
            (forward ? ops[x].kind == OpKind::F : (ops[x].kind == OpKind::B || ops[x].kind == OpKind::BW)))
          return where("compute", x, ops[x], r);
      return "rank " + std::to_string(r) + ", stage " + std::to_string(stage);
    };
    std::string what;
    if (pos < S)
      what = op_at(pos, true) + ": its output activation has a NaN or infinity";
    else if (pos == S)
      what = op_at(S - 1, true) + ": the loss is " + std::to_string(st.losses[static_cast<std::size_t>(mb)]);
    else
      what = op_at(S - 1 - (pos - S - 1), false) + ": its input gradient has a NaN or infinity";
    throw nonfinite_error(
        when + ": " + what + " (the first non-finite value in data-flow order" +
        (plan.training ? "; the gradients of this call are unusable: zero_grad() before going on)" : ")"));
  }

  // ---- the streams ----------------------------------------------------------------------

  Microbatch info(const Op& op) const {
    const Shape& sh = program_.shape;
    const StepInfo& in = call_.info;
    const std::size_t c = static_cast<std::size_t>(sh.chunk_of(op.stage));
    Microbatch mb;
    mb.stage = op.stage;
    mb.stages = sh.stages();
    mb.mb = in.part * sh.m + op.mb;
    mb.microbatches = in.parts * sh.m;
    mb.step = in.step;
    mb.training = call_.plan->training;
    mb.shape = opt_.microbatch;
    mb.inputs = views_[c * static_cast<std::size_t>(sh.m) + static_cast<std::size_t>(op.mb)];
    if (op.stage == sh.stages() - 1) mb.loss = reinterpret_cast<float*>(losses_dev_.ptr) + op.mb;
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
  Tensor box_out(int consumer, int mb, Dir dir) {
    const Boundary& b = message(consumer, dir);
    backend::Block& blk = box(consumer, mb, dir);
    blk = dev_.device_alloc(b.bytes(), backend::Memory::message);
    return Tensor{blk.ptr, b.elements, b.dtype};
  }
  ConstTensor box_in(int stage, int mb, Dir dir) {
    const Boundary& b = message(stage, dir);
    return ConstTensor{box(stage, mb, dir).ptr, b.elements, b.dtype};
  }
  void release_box(int stage, int mb, Dir dir) {
    backend::Block& b = box(stage, mb, dir);
    dev_.device_free(b);
    b = {};
  }

  void run_compute(std::size_t x) {
    const Plan& plan = *call_.plan;
    const Op op = plan.rp->compute[x];
    if (plan.training) trace_.compute_start[x] = dev_.now();
    guarded("compute", x, op, [&] {
      const int S = program_.shape.stages();
      const std::size_t c = static_cast<std::size_t>(program_.shape.chunk_of(op.stage));
      const Stage& l = stages_[c];
      auto ctx = dev_.context(compute_);
      const Microbatch mb = info(op);
      std::uint32_t* flag = reinterpret_cast<std::uint32_t*>(flags_dev_.ptr) + x;
      if (op.kind == OpKind::F) {
        // Evaluation keeps nothing: the unit is a scratch block given back after the pass.
        backend::Block saved = dev_.device_alloc(saved_[c], backend::Memory::activation);
        if (plan.training) units_[unit_index(op.stage, op.mb)].device = saved;
        const ConstTensor in = op.stage > 0 ? box_in(op.stage, op.mb, Dir::forward) : ConstTensor{};
        const Tensor out = op.stage < S - 1 ? box_out(op.stage + 1, op.mb, Dir::forward) : Tensor{};
        l.forward(ctx, mb, in, out, saved.ptr);
        if (opt_.check_finite && out) dev_.flag_nonfinite(ctx, ConstTensor{out.data, out.elements, out.dtype}, flag);
        if (op.stage > 0) release_box(op.stage, op.mb, Dir::forward);
        if (!plan.training) dev_.device_free(saved);
      }
      Unit& u = units_[unit_index(op.stage, op.mb)];
      if (op.kind == OpKind::B || op.kind == OpKind::BW) {
        if (u.device.ptr == nullptr) throw error("its activations are not on the device (missing reload)");
        const ConstTensor dy = op.stage < S - 1 ? box_in(op.stage, op.mb, Dir::backward) : ConstTensor{};
        const Tensor dx = op.stage > 0 ? box_out(op.stage - 1, op.mb, Dir::backward) : Tensor{};
        u.stash = dev_.device_alloc(stash_[c], backend::Memory::stash);
        l.backward_input(ctx, mb, dy, dx, u.device.ptr, u.stash.ptr);
        if (opt_.check_finite && dx) dev_.flag_nonfinite(ctx, ConstTensor{dx.data, dx.elements, dx.dtype}, flag);
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
    if (plan.training) trace_.compute_end[x] = dev_.now();
  }

  void run_copy(std::size_t y) {
    const Op op = call_.plan->rp->copy[y];
    trace_.copy_start[y] = dev_.now();
    guarded("copy", y, op, [&] {
      Unit& u = units_[unit_index(op.stage, op.mb)];
      const std::size_t bytes = saved_[static_cast<std::size_t>(program_.shape.chunk_of(op.stage))];
      const offload::BinPlan plan = offload::plan_bins(bytes);
      std::array<backend::CopyPiece, 3> pieces{};
      const auto lay_out = [&](bool to_host) {
        std::size_t off = 0;
        for (int i = 0; i < plan.count && off < bytes; ++i) {
          const std::size_t n =
              std::min<std::size_t>(static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(i)]), bytes - off);
          std::byte* dev = u.device.ptr + off;
          std::byte* host = u.host[static_cast<std::size_t>(i)].ptr;
          pieces[static_cast<std::size_t>(i)] =
              to_host ? backend::CopyPiece{host, dev, n} : backend::CopyPiece{dev, host, n};
          off += n;
        }
      };
      if (op.kind == OpKind::O) {
        if (u.device.ptr == nullptr) throw error("nothing to offload (the unit is not on the device)");
        for (int i = 0; i < plan.count; ++i)
          u.host[static_cast<std::size_t>(i)] = dev_.host_alloc(plan.bins[static_cast<std::size_t>(i)]);
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
    const CommOp c = call_.plan->rp->comm[k];
    const Tag tag{c.stage, c.mb, c.dir};
    try {
      // Launched on the comm stream: the communicator posts there (a GPU one enqueues on it).
      const Context ctx = dev_.context(comm_stream_);
      if (c.send) {
        backend::Block& b = box(c.stage, c.mb, c.dir);
        comm_.send(ctx, c.peer, tag, std::span<const std::byte>(b.ptr, b.bytes));
        dev_.device_free(b);
        b = {};
      } else {
        const Tensor t = box_out(c.stage, c.mb, c.dir);
        comm_.recv(ctx, c.peer, tag, std::span<std::byte>(t.data, t.bytes()));
      }
    } catch (const aborted_error&) {
      throw;
    } catch (const std::exception& e) {
      throw error("rank " + std::to_string(rank_) + ", comm op " + std::to_string(k) + " " +
                  (c.send ? "send to" : "recv from") + " rank " + std::to_string(c.peer) + " " + describe(tag) + ": " +
                  e.what());
    }
  }

  /// Enqueues the rank's three streams. A wait captures the latest record of its event, so
  /// ops go in in an order where every awaited event's record is already enqueued: advance
  /// each stream while its next op's dependencies are in (the schedule is valid, so this
  /// reaches the end).
  void enqueue(const Plan& plan) {
    const RankProgram& rp = *plan.rp;
    const std::vector<int>& input_recv = plan.links.input_recv;
    const std::vector<int>& send_producer = plan.links.send_producer;
    const std::size_t nc = rp.compute.size(), ny = rp.copy.size(), nk = rp.comm.size();
    std::size_t ic = 0, iy = 0, ik = 0;
    while (ic < nc || iy < ny || ik < nk) {
      bool moved = false;
      while (ic < nc) {
        const Op& op = rp.compute[ic];
        const int r = input_recv[ic];
        if ((r >= 0 && static_cast<std::size_t>(r) >= ik) || (op.wait >= 0 && static_cast<std::size_t>(op.wait) >= iy))
          break;
        if (r >= 0) dev_.wait(compute_, plan.recv_done[static_cast<std::size_t>(r)]);
        if (op.wait >= 0) dev_.wait(compute_, plan.copy_done[static_cast<std::size_t>(op.wait)]);
        dev_.launch(compute_, [this, ic] { run_compute(ic); });
        dev_.record(plan.compute_done[ic], compute_);
        ++ic;
        moved = true;
      }
      while (iy < ny) {
        const Op& op = rp.copy[iy];
        if (op.wait >= 0 && static_cast<std::size_t>(op.wait) >= ic) break;
        if (op.wait >= 0) dev_.wait(copy_, plan.compute_done[static_cast<std::size_t>(op.wait)]);
        if constexpr (backend::pairs_copies<Backend>)
          if (pair_ != nullptr && pair_wait_[iy] > 0)
            dev_.wait_counter(copy_, pair_->side[(rank_ ^ 1) & 1],
                              static_cast<std::uint64_t>(iterations_ * partner_copies_ + pair_wait_[iy]));
        dev_.launch(copy_, [this, iy] { run_copy(iy); });
        dev_.record(plan.copy_done[iy], copy_);
        if constexpr (backend::pairs_copies<Backend>)
          if (pair_ != nullptr)
            dev_.signal(copy_, pair_->side[rank_ & 1], static_cast<std::uint64_t>(iterations_ * ny + iy + 1));
        ++iy;
        moved = true;
      }
      while (ik < nk) {
        const int p = send_producer[ik];
        if (rp.comm[ik].send && (p < 0 || static_cast<std::size_t>(p) >= ic)) break;
        if (rp.comm[ik].send) dev_.wait(comm_stream_, plan.compute_done[static_cast<std::size_t>(p)]);
        dev_.launch(comm_stream_, [this, ik] { run_comm(ik); });
        if (!rp.comm[ik].send) dev_.record(plan.recv_done[ik], comm_stream_);
        ++ik;
        moved = true;
      }
      if (!moved)
        throw error("po::Runtime: rank " + std::to_string(rank_) +
                    "'s program has a dependency cycle between its streams");
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
  std::vector<Stage> stages_;
  Program program_, eval_program_;
  int rank_ = 0;
  std::vector<StageInfo> table_;                       // every stage of the pipeline
  std::vector<std::size_t> saved_, stash_;             // per chunk
  std::vector<std::vector<std::size_t>> norm_groups_;  // per chunk
  std::size_t max_groups_ = 1;
  std::vector<Declared> inputs_;               // step inputs this rank uploads
  std::vector<backend::Block> inputs_dev_;     // (m, elements) of each, device
  std::vector<std::vector<StepInput>> views_;  // [chunk * m + mb]: what a pass sees of the inputs
  backend::Block losses_dev_{};                // (m) float losses of the last stage, device
  backend::Block flags_dev_{};                 // (compute ops) uint32 non-finite flags, device
  int compute_ = -1, copy_ = -1, comm_stream_ = -1;
  Plan train_, eval_;
  Call call_{};
  std::vector<Unit> units_;
  std::vector<backend::Block> boxes_;   // boundary tensors by tag: received inputs, outputs to send
  long long iterations_ = 0;            // training calls enqueued (pair counters count from 0)
  std::vector<std::size_t> pair_wait_;  // per copy op: partner copies to wait for
  std::size_t partner_copies_ = 0;      // the partner's copies per step
  PairLink<Backend>* pair_ = nullptr;   // PCIe partner's link, or none
  RankSim trace_;
};

template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, Stages&&) -> Runtime<B, C>;
template <class B, class C, class Stages>
Runtime(const Program&, B&, C&, Stages&&, RuntimeOptions) -> Runtime<B, C>;

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
  Runtime(Shape shape, Backend& dev, Communicator& comm, std::span<Layer> stages, RuntimeOptions opt = {},
          const Costs& costs = {})
      : Runtime<Backend, Communicator>(Schedule::build(shape, costs), dev, comm, stages, opt) {}
};

}  // namespace pipeoffload
