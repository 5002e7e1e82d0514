// pipeoffload/runtime/optimizer.hpp: the gradient norm, clipping, AdamW, SGD and learning-rate
// schedules, as calls of their own beside the runtime (llm.c's training loop):
//
//   rt.zero_grad();
//   rt.forward_backward(batch, {.step = step});            // gradients accumulate
//   const double norm = po::grad_norm(rt);                  // collective, fixed summation order
//   opt.step(lr(step), po::clip_scale(norm, 1.0f));         // on the device, through the backend
//
// An optimizer holds its state (AdamW moments, SGD momentum) in device memory, per chunk of
// the rank, and updates every stage of its rank through the backend's update calls
// (backend::updates_parameters): one multi-tensor call a chunk, enqueued, over runs of named
// parameter tensors (Stage::parameter_info) with their own learning-rate scale and weight
// decay (parameter groups). What a step waits for: docs/step.md.
/// @file
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../backend/backend.hpp"
#include "../error.hpp"
#include "../layer.hpp"
#include "runtime.hpp"

namespace pipeoffload {

/// Learning rate at 0-based step t: linear warmup over warmup_steps from lr/warmup_steps to
/// lr, then cosine to min_lr_ratio * lr at total_steps, flat after. Any callable of the step
/// serves as well; this is the usual one.
struct WarmupCosine {
  float lr = 3e-4f;           ///< peak learning rate
  int warmup_steps = 10;      ///< steps of linear warmup
  int total_steps = 1000;     ///< the step the cosine reaches its floor at
  float min_lr_ratio = 0.1f;  ///< the floor, as a fraction of lr
  /// The learning rate at step t (0-based).
  float operator()(int t) const {
    if (t < warmup_steps) return lr * static_cast<float>(t + 1) / static_cast<float>(warmup_steps);
    const int span = total_steps - warmup_steps;
    if (span <= 0 || t >= total_steps) return lr * min_lr_ratio;
    const double frac = static_cast<double>(t - warmup_steps) / static_cast<double>(span);
    const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * frac));
    return static_cast<float>(lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine));
  }
};

/// The factor that clips a gradient of global norm `norm` to `max_norm`: max_norm / norm when
/// the norm is larger, 1 otherwise (and always 1 for max_norm <= 0). Optimizers multiply
/// each gradient by it as they read it.
inline float clip_scale(double norm, float max_norm) {
  return (max_norm > 0 && norm > max_norm) ? static_cast<float>(max_norm / norm) : 1.0f;
}

/// The global L2 norm of every stage's gradients, the same on every rank. Collective over the
/// runtime's ranks. Each stage's squared gradients are summed per norm group in fp64 on the
/// device, behind the step's last forward_backward, which reads them with its results
/// (Runtime::norm_sums; otherwise then, with one wait); the groups are added in stage
/// order, then group order, so the norm does not
/// depend on how the model is cut into stages (at group boundaries) nor on the rank count.
/// On the standard path with replicas each replica sums the squares of the gradients it owns
/// and the replicas' sums are added in replica order (Runtime::norm_pieces).
/// Throws po::nonfinite_error on every rank, naming the stage and group, for a NaN or infinity.
template <class Runtime>
double grad_norm(Runtime& rt) {
  static_assert(backend::updates_parameters<typename Runtime::backend_type>,
                "po::grad_norm: the backend must model po::backend::updates_parameters (sum_squares).");
  return rt.guard("grad_norm", [&] {
    const Shape& sh = rt.program().shape;
    const std::size_t v = static_cast<std::size_t>(sh.v), groups = rt.max_norm_groups(), width = v * groups;
    std::vector<double> mine(width, 0.0), all(width * static_cast<std::size_t>(sh.d));
    // The sums the step's last forward_backward read with its results (or summed now).
    const std::vector<std::vector<double>>& parts = rt.norm_sums();
    for (std::size_t c = 0, x = 0; c < v; ++c)
      for (const auto& p : rt.norm_pieces(static_cast<int>(c))) {
        const std::vector<double>& part = parts[x++];
        for (std::size_t k = 0; k < part.size(); ++k) mine[c * groups + p.first_group + k] += part[k];
      }
    if (rt.norm_by_shards()) {  // each replica summed its own shards: add them in replica order
      const std::size_t dp = static_cast<std::size_t>(rt.replicas());
      std::vector<double> each(width * dp);
      rt.replica_comm()->all_gather(std::span<const double>(mine), std::span(each));
      for (std::size_t k = 0; k < width; ++k) {
        mine[k] = each[k];
        for (std::size_t j = 1; j < dp; ++j) mine[k] += each[j * width + k];
      }
    }
    rt.communicator().all_gather(std::span<const double>(mine), std::span(all));
    double norm2 = 0;
    for (int s = 0; s < sh.stages(); ++s) {
      const StageInfo& t = rt.stage_table()[static_cast<std::size_t>(s)];
      for (std::size_t k = 0; k < t.norm_groups; ++k) {
        const double sq =
            all[static_cast<std::size_t>(t.rank) * width + static_cast<std::size_t>(t.chunk) * groups + k];
        if (!std::isfinite(sq))
          throw nonfinite_error("po::grad_norm: stage " + std::to_string(s) + " (" + t.name + " on rank " +
                                std::to_string(t.rank) + ") has a non-finite gradient (norm group " +
                                std::to_string(k) + ", sum of squares " + std::to_string(sq) +
                                "); no update should be applied");
        norm2 += sq;
      }
    }
    return std::sqrt(norm2);
  });
}

/// A parameter group: the tensors `select` accepts (the first group that accepts a tensor
/// takes it; tensors no group accepts get the optimizer's own settings) get their own weight
/// decay and a scale of the step's learning rate.
/// @code
///   // GPT-2's rule: no weight decay on biases and LayerNorm gains (1-d tensors)
///   po::ParamGroup no_decay{"no decay", [](const po::ParamInfo& p) { return p.shape.size() < 2; }, 1.0f, 0.0f};
/// @endcode
struct ParamGroup {
  std::string name;                              ///< names the group in messages
  std::function<bool(const ParamInfo&)> select;  ///< does this group take the tensor?
  float lr_scale = 1.0f;                         ///< its learning rate = the step's lr * lr_scale
  float weight_decay = 0.0f;                     ///< its weight decay (replaces the optimizer's)
};

namespace detail {

/// A run of parameters of one chunk updated with one setting.
struct ParamRun {
  std::size_t offset = 0, count = 0;
  float lr_scale = 1.0f;
  float weight_decay = 0.0f;
};

/// Chunk c's parameters as runs of one setting each: the stage's named tensors, checked to
/// cover its parameters exactly once, assigned to groups, with neighbours of one setting merged.
inline std::vector<ParamRun> param_runs(int stage, const std::string& stage_name, std::vector<ParamInfo> tensors,
                                        std::size_t parameters, const std::vector<ParamGroup>& groups,
                                        float weight_decay) {
  std::sort(tensors.begin(), tensors.end(), [](const ParamInfo& a, const ParamInfo& b) { return a.offset < b.offset; });
  std::vector<ParamRun> runs;
  std::size_t at = 0;
  for (const ParamInfo& t : tensors) {
    if (t.offset != at)
      throw error("stage " + std::to_string(stage) + " (" + stage_name + ")'s parameter_info() " +
                  (t.offset > at
                       ? "leaves parameters [" + std::to_string(at) + ", " + std::to_string(t.offset) + ") out"
                       : "has tensor '" + t.name + "' at offset " + std::to_string(t.offset) +
                             ", inside the one before it (which ends at " + std::to_string(at) + ")") +
                  "; its tensors must cover parameters() exactly once");
    ParamRun run{t.offset, t.count(), 1.0f, weight_decay};
    for (const ParamGroup& g : groups)
      if (g.select && g.select(t)) {
        run.lr_scale = g.lr_scale;
        run.weight_decay = g.weight_decay;
        break;
      }
    at += run.count;
    if (run.count == 0) continue;
    if (!runs.empty() && runs.back().lr_scale == run.lr_scale && runs.back().weight_decay == run.weight_decay)
      runs.back().count += run.count;
    else
      runs.push_back(run);
  }
  if (at != parameters)
    throw error("stage " + std::to_string(stage) + " (" + stage_name + ")'s parameter_info() covers " +
                std::to_string(at) + " parameters; the stage has " + std::to_string(parameters));
  return runs;
}

/// What AdamW and Sgd share: their runs, their device state (`states` buffers per chunk, each
/// of the parameters this replica updates), the step count, and the failure handling.
template <class Runtime>
class OptimizerBase {
 public:
  using Backend = typename Runtime::backend_type;
  static_assert(
      backend::updates_parameters<Backend>,
      "po::AdamW and po::Sgd need a backend that models po::backend::updates_parameters (sum_squares, adamw, sgd).");

  OptimizerBase(const OptimizerBase&) = delete;
  OptimizerBase& operator=(const OptimizerBase&) = delete;
  ~OptimizerBase() {
    for (backend::Block& b : state_) rt_.device().device_free(b);
    for (backend::Block& b : masters_) rt_.device().device_free(b);
  }

  /// Optimizer steps taken (the next step is number steps_taken(), 0-based).
  int steps_taken() const { return steps_; }
  /// Resume: the next step() is step `steps` (bias corrections, momentum's first step).
  void set_steps_taken(int steps) {
    if (steps < 0) throw error("po::Optimizer::set_steps_taken: steps = " + std::to_string(steps) + " must be >= 0");
    steps_ = steps;
  }
  /// State buffers per chunk (2 for AdamW's moments, 1 for SGD's momentum, 0 for plain SGD).
  int state_count() const { return states_; }
  /// Whether the state is sharded across the runtime's replicas (ZeRO-1).
  bool sharded() const { return sharded_; }
  /// The parameters of chunk c whose state this replica holds and which it updates: all of
  /// them, or with ZeRO-1 the ones whose reduced gradients it owns (Runtime::owned: its slice
  /// of every reduction bucket), in order; never a copy of a shared parameter
  /// (Runtime::tied_copies), which the primary's holder updates.
  const std::vector<ParamRange>& shards(int chunk) const { return shards_[static_cast<std::size_t>(chunk)]; }
  /// How many parameters of chunk c this replica updates (the size of its state buffers).
  std::size_t updated(int chunk) const {
    std::size_t n = 0;
    for (const ParamRange& r : shards(chunk)) n += r.size();
    return n;
  }
  /// Chunk c's k-th state buffer (of the parameters in shards(c), one after another), in
  /// device memory.
  std::span<float> state(int chunk, int k) {
    return {reinterpret_cast<float*>(state_[static_cast<std::size_t>(chunk * states_ + k)].ptr), updated(chunk)};
  }
  /// Device bytes of this rank's optimizer state (with the fp32 master copies of
  /// mixed-precision stages).
  std::size_t state_bytes() const {
    std::size_t b = 0;
    for (const backend::Block& s : state_) b += s.bytes;
    for (const backend::Block& s : masters_) b += s.bytes;
    return b;
  }
  /// Whether this optimizer keeps an fp32 master copy of chunk c's parameters (its stage's
  /// working parameters are bfloat16), of the parameters in shards(c).
  bool has_master(int chunk) const { return masters_[static_cast<std::size_t>(chunk)].ptr != nullptr; }
  /// Chunk c's parameters in fp32 on the host, whole: the master copy where there is one (with
  /// ZeRO-1 gathered from the replicas: collective over them), else the working parameters.
  /// What checkpoints save.
  std::vector<float> full_master(int chunk) {
    if (!has_master(chunk)) return rt_.download_parameters(chunk);
    return gathered(chunk, rt_.download(master(chunk)));
  }
  /// Sets chunk c's parameters from fp32 values (all of them): the master copy's part this
  /// replica owns and the working parameters (rounded where they are bfloat16).
  void set_full_master(int chunk, std::span<const float> full) {
    if (has_master(chunk)) rt_.upload(master(chunk), owned_part(chunk, full, "set_full_master"), "master parameters");
    rt_.upload_parameters(chunk, full);
  }
  /// Chunk c's whole k-th state buffer on the host (with ZeRO-1 gathered from the replicas:
  /// collective over them), for checkpoints.
  std::vector<float> full_state(int chunk, int k) { return gathered(chunk, rt_.download(state(chunk, k))); }
  /// Overwrites this replica's part of chunk c's k-th state buffer from the whole buffer.
  void set_full_state(int chunk, int k, std::span<const float> full) {
    rt_.upload(state(chunk, k), owned_part(chunk, full, "set_full_state"), "optimizer state");
  }
  /// Chunk c's runs of parameters, each with its setting (for tests and reports).
  const std::vector<ParamRun>& runs(int chunk) const { return runs_[static_cast<std::size_t>(chunk)]; }
  Runtime& runtime() { return rt_; }

 private:
  // Chunk c's master copy (of the parameters in shards(c)), device memory.
  std::span<float> master(int chunk) {
    return {reinterpret_cast<float*>(masters_[static_cast<std::size_t>(chunk)].ptr), updated(chunk)};
  }
  // The parameters this replica owns of a whole buffer `full` of chunk c, one shard after another.
  std::vector<float> owned_part(int chunk, std::span<const float> full, const char* who) const {
    const std::size_t n = rt_.stages()[static_cast<std::size_t>(chunk)].parameter_count();
    if (full.size() != n)
      throw error(std::string("po::Optimizer::") + who + ": got " + std::to_string(full.size()) + " values; chunk " +
                  std::to_string(chunk) + " has " + std::to_string(n) + " parameters");
    std::vector<float> mine;
    for (const ParamRange& r : shards(chunk))
      mine.insert(mine.end(), full.begin() + static_cast<std::ptrdiff_t>(r.begin),
                  full.begin() + static_cast<std::ptrdiff_t>(r.end));
    return mine;
  }
  // A buffer of chunk c's owned parameters, whole (zeros at the parameters no replica updates:
  // Runtime::tied_copies): with ZeRO-1 every replica's shards gathered (collective over the
  // replicas); otherwise `mine` in place.
  std::vector<float> gathered(int chunk, std::vector<float> mine) {
    const std::size_t n = rt_.stages()[static_cast<std::size_t>(chunk)].parameter_count();
    std::vector<float> full(n, 0.0f);
    const auto place = [&](const std::vector<ParamRange>& ranges, const float* from) {
      for (const ParamRange& r : ranges) {
        std::copy_n(from, r.size(), full.begin() + static_cast<std::ptrdiff_t>(r.begin));
        from += r.size();
      }
    };
    if (!sharded_) {
      place(shards(chunk), mine.data());
      return full;
    }
    // Every replica's runs (the same function of the layout on every replica), padded to the
    // longest, gathered in replica order.
    const std::size_t dp = static_cast<std::size_t>(rt_.replicas());
    std::vector<std::vector<ParamRange>> each(dp);
    std::size_t per = 0;
    for (std::size_t j = 0; j < dp; ++j) {
      each[j] = without(rt_.layout(chunk).shards(static_cast<int>(j)), rt_.tied_copies(chunk));
      std::size_t k = 0;
      for (const ParamRange& r : each[j]) k += r.size();
      per = std::max(per, k);
    }
    mine.resize(per, 0.0f);
    std::vector<float> all(per * dp);
    rt_.replica_comm()->all_gather(std::span<const float>(mine), std::span(all));
    for (std::size_t j = 0; j < dp; ++j) place(each[j], all.data() + j * per);
    return full;
  }

 protected:
  /// `invalid`: why the options are wrong ("" when they are right), thrown under the guard so
  /// that the other ranks do not wait for this one.
  OptimizerBase(Runtime& rt, const char* who, int states, const std::vector<ParamGroup>& groups, float weight_decay,
                int zero, bool overlap_gather, const std::string& invalid = "")
      : rt_(rt), states_(states), overlap_(overlap_gather) {
    rt.guard(who, [&] {
      if (!invalid.empty()) throw error(invalid);
      if (zero != 0 && zero != 1)
        throw error("zero = " + std::to_string(zero) + " is outside the allowed range [0, 1] (ZeRO stage)");
      sharded_ = zero == 1 && rt.replicas() > 1;
      rt.shard_gradients(sharded_);
      const Shape& sh = rt.program().shape;
      for (int c = 0; c < sh.v; ++c) {
        const auto& stage = rt.stages()[static_cast<std::size_t>(c)];
        const std::size_t n = stage.parameter_count();
        runs_.push_back(
            param_runs(sh.stage_of(rt.rank(), c), stage.name(), stage.parameter_info(), n, groups, weight_decay));
        // A copy of a shared parameter is the primary's to update (Runtime::share_tied).
        shards_.push_back(without(sharded_ ? rt.owned(c) : std::vector<ParamRange>{{0, n}}, rt.tied_copies(c)));
        const std::size_t mine = updated(c);
        // Zeroed state, reserved for itself so it never takes a block the runtime counted on.
        const std::vector<float> zeros(mine, 0.0f);
        for (int k = 0; k < states; ++k) {
          if constexpr (backend::reserves_memory<Backend>) rt.device().reserve_device(mine * sizeof(float), 1);
          state_.push_back(rt.device().device_alloc(mine * sizeof(float), backend::Memory::optimizer));
          rt.device().upload(state_.back().ptr, zeros.data(), mine * sizeof(float));
        }
        // bfloat16 working parameters: an fp32 master copy of the owned ones, from their values.
        masters_.push_back({});
        if (stage.working().dtype != DType::float32) {
          if constexpr (backend::reserves_memory<Backend>) rt.device().reserve_device(mine * sizeof(float), 1);
          masters_.back() = rt.device().device_alloc(mine * sizeof(float), backend::Memory::optimizer);
          rt.upload(master(c), owned_part(c, rt.download_parameters(c), "master"), "master parameters");
        }
      }
      return 0;
    });
  }

  /// Chunk c's update as segments (update::Segment): every run's part inside each of this
  /// replica's shards, with the run's learning rate (`lr` times its scale) and weight decay,
  /// the state buffers this optimizer has, and the bfloat16 working copy where the stage keeps
  /// an fp32 master. With ZeRO-1 `state`'s positions are the shards' places in the state buffers
  /// (as state(c, k) is), the gradients' and working copy's the parameters' own.
  std::vector<update::Segment> segments(int c, float lr) {
    const auto& stage = rt_.stages()[static_cast<std::size_t>(c)];
    const bool mixed = has_master(c);
    auto* working = reinterpret_cast<std::uint16_t*>(stage.working().data);
    std::vector<update::Segment> out;
    std::size_t at = 0;  // where the shard starts in the state buffers
    for (const ParamRange& s : shards_[static_cast<std::size_t>(c)]) {
      for (const ParamRun& r : runs_[static_cast<std::size_t>(c)]) {
        const std::size_t a = std::max(s.begin, r.offset), b = std::min(s.end, r.offset + r.count);
        if (a >= b) continue;
        const std::size_t state_at = at + (a - s.begin);
        update::Segment seg;
        seg.params = mixed ? master(c).data() + state_at : stage.parameters().data() + a;
        seg.grads = stage.gradients().data() + a;
        if (states_ >= 1) seg.state0 = state(c, 0).data() + state_at;
        if (states_ >= 2) seg.state1 = state(c, 1).data() + state_at;
        seg.working = mixed ? working + a : nullptr;
        seg.count = b - a;
        seg.lr = lr * r.lr_scale;
        seg.weight_decay = r.weight_decay;
        out.push_back(seg);
      }
      at += s.size();
    }
    return out;
  }

  /// Runs `update(segments)` for every chunk of this rank (one backend call a chunk, enqueued),
  /// then counts the step; a failure aborts every rank, naming this one and the step. With
  /// ZeRO-1 the replicas then all-gather the parameters (Runtime::share_shards; the host waits
  /// once for all chunks unless the gather is left to overlap): the same values as one replica
  /// updating them all.
  template <class F>
  void each_chunk(const char* who, float lr, F&& update) {
    rt_.settle();  // a step without a pass since the last one: its gather first
    rt_.guard(std::string(who) + " step " + std::to_string(steps_), [&] {
      for (std::size_t c = 0; c < runs_.size(); ++c) update(segments(static_cast<int>(c), lr));
      return 0;
    });
    if (sharded_) {
      for (std::size_t c = 0; c < runs_.size(); ++c) rt_.share_shards(static_cast<int>(c), true);
      if (!overlap_) rt_.settle();
    }
    rt_.share_tied(overlap_);
    ++steps_;
  }

  Runtime& rt_;
  int states_ = 0;
  bool overlap_ = false;  // ZeRO-1's parameter gather left running (AdamWOptions::overlap_gather)
  int steps_ = 0;
  std::vector<std::vector<ParamRun>> runs_;  // per chunk
  std::vector<backend::Block> state_;        // [chunk * states + k], device (of the chunk's shards)
  std::vector<backend::Block> masters_;      // per chunk: fp32 master of the shards (bfloat16 stages), or none
  bool sharded_ = false;
  std::vector<std::vector<ParamRange>> shards_;  // per chunk: the parameters this replica updates
};

}  // namespace detail

/// AdamW's hyperparameters (lr is given to each step instead).
struct AdamWOptions {
  float beta1 = 0.9f;                ///< decay of the first moment (the gradient's running mean)
  float beta2 = 0.95f;               ///< decay of the second moment (the squared gradient's running mean)
  float eps = 1e-8f;                 ///< added to the second moment's square root in the denominator
  float weight_decay = 0.1f;         ///< decoupled, for tensors no group takes
  std::vector<ParamGroup> groups{};  ///< parameter groups, tried in order
  int zero = 0;  ///< 1: shard the moments across the runtime's replicas (ZeRO-1); 0: every replica holds all
  /// ZeRO-1: leave the updated parameters' all-gather running on the comm stream when step()
  /// returns; the next forward_backward or evaluate waits for each chunk's gather before its
  /// first pass of that chunk (Runtime::share_shards). Off: step() returns with every replica
  /// holding every parameter.
  bool overlap_gather = false;
};

/// AdamW (decoupled weight decay) over every stage of a runtime's rank.
/// @code
///   po::AdamW opt(rt, {.weight_decay = 0.1f, .groups = {no_decay}});
///   opt.step(po::WarmupCosine{.lr = 3e-3f}(step), po::clip_scale(po::grad_norm(rt), 1.0f));
/// @endcode
template <class Runtime>
class AdamW : public detail::OptimizerBase<Runtime> {
 public:
  /// Allocates the two moments (zeros, fp32, optimizer memory) of the parameters this rank
  /// updates on rt's device; throws for options out of range.
  AdamW(Runtime& rt, AdamWOptions opt = {})
      : detail::OptimizerBase<Runtime>(rt, "po::AdamW", 2, opt.groups, opt.weight_decay, opt.zero, opt.overlap_gather),
        opt_(std::move(opt)) {}

  /// One update of every parameter of this rank with learning rate `lr` (times its group's
  /// scale) and gradients multiplied by `grad_scale` (the clip): one backend call a chunk,
  /// enqueued (the host does not wait, except for ZeRO-1's gather). Gradients are left as they
  /// are. Not collective without ZeRO-1; a failure aborts every rank.
  void step(float lr, float grad_scale = 1.0f) {
    const update::AdamWStep st{opt_.beta1, opt_.beta2, opt_.eps,
                               update::adam_bias(opt_.beta1, opt_.beta2, this->steps_ + 1), grad_scale};
    this->each_chunk("po::AdamW", lr, [&](const std::vector<update::Segment>& segments) {
      this->rt_.device().adamw(std::span<const update::Segment>(segments), st);
    });
  }
  /// The optimizer's name in checkpoints ("adamw").
  static constexpr const char* name() { return "adamw"; }
  /// The options it was constructed with.
  const AdamWOptions& options() const { return opt_; }

 private:
  AdamWOptions opt_;
};

/// SGD's hyperparameters (lr is given to each step instead).
struct SgdOptions {
  float momentum = 0;                ///< 0: plain SGD (no state)
  float dampening = 0;               ///< the gradient enters the momentum buffer scaled by 1 - dampening
  bool nesterov = false;             ///< needs momentum > 0 and dampening = 0
  float weight_decay = 0;            ///< L2 (added to the gradient), for tensors no group takes
  std::vector<ParamGroup> groups{};  ///< parameter groups, tried in order
  int zero = 0;                      ///< 1: shard the momentum buffers across the runtime's replicas (ZeRO-1)
  bool overlap_gather = false;       ///< ZeRO-1: as AdamWOptions::overlap_gather
};

/// SGD with optional momentum and Nesterov momentum (torch.optim.SGD's update), over every
/// stage of a runtime's rank.
/// @code
///   po::Sgd opt(rt, {.momentum = 0.9f, .nesterov = true});
///   opt.step(0.05f, po::clip_scale(po::grad_norm(rt), 1.0f));
/// @endcode
template <class Runtime>
class Sgd : public detail::OptimizerBase<Runtime> {
 public:
  /// Allocates the momentum buffer (zeros, fp32, optimizer memory; none without momentum) of
  /// the parameters this rank updates on rt's device; throws for options out of range.
  Sgd(Runtime& rt, SgdOptions opt = {})
      : detail::OptimizerBase<Runtime>(rt, "po::Sgd", opt.momentum != 0.0f ? 1 : 0, opt.groups, opt.weight_decay,
                                       opt.zero, opt.overlap_gather, invalid(opt)),
        opt_(std::move(opt)) {}

  /// One update of every parameter of this rank (see AdamW::step).
  void step(float lr, float grad_scale = 1.0f) {
    const update::SgdStep st{opt_.momentum, opt_.dampening, opt_.nesterov, this->steps_ == 0, grad_scale};
    this->each_chunk("po::Sgd", lr, [&](const std::vector<update::Segment>& segments) {
      this->rt_.device().sgd(std::span<const update::Segment>(segments), st);
    });
  }
  /// The optimizer's name in checkpoints ("sgd").
  static constexpr const char* name() { return "sgd"; }
  /// The options it was constructed with.
  const SgdOptions& options() const { return opt_; }

 private:
  static std::string invalid(const SgdOptions& o) {
    if (o.momentum < 0.0f) return "momentum = " + std::to_string(o.momentum) + " must be >= 0";
    if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f))
      return "Nesterov momentum needs momentum > 0 and dampening = 0 (momentum = " + std::to_string(o.momentum) +
             ", dampening = " + std::to_string(o.dampening) + ")";
    return "";
  }
  SgdOptions opt_;
};

}  // namespace pipeoffload
