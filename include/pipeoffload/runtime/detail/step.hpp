// pipeoffload/runtime/detail/step.hpp: one po::Runtime call (forward_backward or evaluate): the
// step inputs uploaded, the rank's program run, and the verdict (losses, memory, the first
// non-finite value in data-flow order, the same on every rank).
//
// Member functions of Runtime<Backend, Communicator> (runtime/runtime.hpp declares them and
// includes this file after the class), kept apart so that the class reads as its interface and
// state.
#pragma once

#include "../runtime.hpp"

namespace pipeoffload {

template <class Backend, class Communicator>
PassStats Runtime<Backend, Communicator>::run(const Plan& plan, const Batch& batch, StepInfo info) {
  const Shape& sh = program_.shape;
  if (info.parts < 1 || info.part < 0 || info.part >= info.parts || info.step < 0)
    throw error("po::Runtime: StepInfo{step = " + std::to_string(info.step) + ", part = " + std::to_string(info.part) +
                ", parts = " + std::to_string(info.parts) + "} needs step >= 0, parts >= 1 and 0 <= part < parts");
  if (static_cast<long long>(info.parts) * sh.m * dp_ > exact::max_terms)
    throw error("po::Runtime: dp * parts * m = " + std::to_string(static_cast<long long>(info.parts) * sh.m * dp_) +
                " microbatches in one step exceed " + std::to_string(exact::max_terms));
  upload_inputs(batch);
  const RankProgram& rp = *plan.rp;
  dev_.zero(flags_dev(), rp.compute.size() * sizeof(std::uint32_t));
  call_ = {info, &plan};
  // Each stage's prepare() of each microbatch, on the host, before any pass is enqueued and any
  // message sent (layer.hpp).
  for (int c = 0; c < sh.v; ++c) {
    const Stage& st = stages_[static_cast<std::size_t>(c)];
    if (!st.prepares()) continue;
    Op op;
    op.stage = sh.stage_of(rank_, c);
    for (op.mb = 0; op.mb < sh.m; ++op.mb) st.prepare(this->info(op));
  }
  // A replay (RuntimeOptions::graphs) stamps no times on a GPU: the captured call's stay.
  const auto kind = captured_.find({info.part, info.parts});
  const bool replay = opt_.graphs && plan.training && kind != captured_.end() && kind->second.calls == 2;
  if (plan.training && !replay) {
    trace_.compute_start.assign(rp.compute.size(), 0.0);
    trace_.compute_end.assign(rp.compute.size(), 0.0);
    trace_.copy_start.assign(rp.copy.size(), 0.0);
    trace_.copy_end.assign(rp.copy.size(), 0.0);
  }
  dev_.reset_peaks();
  {
    std::lock_guard lk(buffers_mu_);
    buffers_.peak = buffers_.in_use;
    buffers_.total_peak = buffers_total_;
  }
  const double t0 = dev_.now();
  if (plan.training) norm_ready_ = false;  // (evaluation leaves the gradients as they are)
  // A gather the optimizer left running (share_shards, share_tied): the uploads and zeroing
  // above did not wait for it; what comes after it (the passes, their first of each chunk after
  // its event, and every later between-steps operation) does.
  dev_.release();
  if (opt_.graphs && plan.training)
    run_graph(plan, info);
  else
    enqueue(plan);
  if (plan.training) ++iterations_;
  // A step's last call: the gradient norm's sums behind the step's work, read by its one wait
  // (po::grad_norm takes them from norm_sums() instead of waiting again).
  const bool norm = plan.training && info.part == info.parts - 1;
  try {
    if constexpr (backend::updates_parameters<Backend>)
      if (norm) enqueue_norm_sums();
    dev_.synchronize();
  } catch (const std::exception& e) {
    comm_.abort(e.what());
    throw;
  }
  call_.info = info;  // (a replay's passes saw the captured call's)
  PassStats st;
  st.seconds = dev_.now() - t0;
  st.memory = memory();
  if (opt_.graphs && plan.training) {  // a replay reports its captured call's memory (it takes none itself)
    Captured& c = captured_[{info.part, info.parts}];
    if (replay)
      st.memory = c.memory;
    else if (c.calls == 2)
      c.memory = st.memory;
  }
  verdict(plan, st);
  if (plan.training) norm_ready_ = norm && backend::updates_parameters<Backend>;
  return st;
}

// A training call under RuntimeOptions::graphs. Its kind (part of parts) runs as usual the
// first time, is captured the second and replayed from then on; the step is in device memory
// (step_dev), and the passes of a replay see the captured call's StepInfo, on backend::Cpu too
// (whose replay runs the launches again), so a pass that reads a host value that changes from
// step to step shows on the CPU as it would on a GPU.
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_graph(const Plan& plan, StepInfo info) {
  if constexpr (backend::captures_graphs<Backend>) {
    if (step_written_ != info.step) {
      const std::int32_t step = info.step;
      dev_.upload(step_dev(), &step, sizeof step);
      step_written_ = info.step;
    }
    Captured& c = captured_[{info.part, info.parts}];
    if (c.calls == 0) {
      c.calls = 1;
      enqueue(plan);
      return;
    }
    // A gather the optimizer left running is behind the replay (which follows every stream's
    // earlier work), not a wait inside the graph.
    std::fill(gather_pending_.begin(), gather_pending_.end(), 0);
    if (c.calls == 1) {
      dev_.begin_capture(compute_);
      try {
        enqueue(plan);
      } catch (...) {
        try {
          dev_.end_capture();
        } catch (...) {  // the enqueue's own error is the one to report
        }
        throw;
      }
      c.graph = dev_.end_capture();
      c.info = info;
      c.calls = 2;
    }
    call_.info = c.info;
    dev_.replay(c.graph);
  }
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::upload_inputs(const Batch& batch) {
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
      throw error("po::Runtime: the step input '" + in.name + "' has " +
                  std::to_string(t->shape.empty() ? 0 : t->shape[0]) +
                  " rows (its first dimension); they must split into m = " + std::to_string(m) + " equal microbatches");
    dev_.upload(inputs_dev_[k].ptr, t->data, t->bytes());
  }
  // The passes' host views: this batch's slices, valid while the call lasts.
  for (std::size_t x = 0; x < views_.size(); ++x)
    for (StepInput& in : views_[x]) {
      const HostTensor& t = *batch.find(in.name);
      in.host = {t.data + (x % m) * in.tensor.bytes(), in.tensor.elements, in.tensor.dtype};
    }
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::verdict(const Plan& plan, PassStats& st) {
  const Shape& sh = program_.shape;
  const int S = sh.stages();
  const std::size_t m = static_cast<std::size_t>(sh.m);
  const RankProgram& rp = *plan.rp;
  const bool last = rank_ == sh.rank_of(S - 1);
  // One readback: the flags and the losses together (the losses are zero off the last rank).
  std::vector<std::byte> results(results_dev_.bytes);
  dev_.download(results.data(), results_dev_.ptr, results.size());
  std::vector<float> losses(m, 0.0f);
  if (last) std::memcpy(losses.data(), results.data() + flag_count() * sizeof(std::uint32_t), m * sizeof(float));
  std::vector<std::uint32_t> flags(rp.compute.size(), 0);
  std::memcpy(flags.data(), results.data(), flags.size() * sizeof(std::uint32_t));
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
  // This replica's losses and its first non-finite value, then every replica's (in replica
  // order, so the losses are the global batch's, replica-major).
  std::vector<double> replica(m + 1);
  for (std::size_t b = 0; b < m; ++b) replica[b] = all[lr * (m + 1) + b];
  double worst = -1;
  for (int r = 0; r < sh.d; ++r) {
    const double k = all[static_cast<std::size_t>(r) * (m + 1) + m];
    if (k >= 0 && (worst < 0 || k < worst)) worst = k;
  }
  replica[m] = worst;
  const std::size_t dp = static_cast<std::size_t>(dp_);
  std::vector<double> global = replica;
  if (replicas_ != nullptr) {
    global.resize((m + 1) * dp);
    replicas_->all_gather(std::span<const double>(replica), std::span(global));
  }
  st.losses.resize(m * dp);
  double sum = 0;
  int culprit = -1;  // the first replica with a non-finite value
  worst = -1;
  for (std::size_t j = 0; j < dp; ++j) {
    for (std::size_t b = 0; b < m; ++b) {
      st.losses[j * m + b] = static_cast<float>(global[j * (m + 1) + b]);
      sum += global[j * (m + 1) + b];
    }
    if (culprit < 0 && global[j * (m + 1) + m] >= 0) {
      culprit = static_cast<int>(j);
      worst = global[j * (m + 1) + m];
    }
  }
  st.loss = static_cast<float>(sum / static_cast<double>(m * dp));
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
  std::string what = dp > 1 ? "replica " + std::to_string(culprit) + ", " : "";
  if (pos < S)
    what += op_at(pos, true) + ": its output activation has a NaN or infinity";
  else if (pos == S)
    what += op_at(S - 1, true) + ": the loss is " +
            std::to_string(st.losses[static_cast<std::size_t>(culprit) * m + static_cast<std::size_t>(mb)]);
  else
    what += op_at(S - 1 - (pos - S - 1), false) + ": its input gradient has a NaN or infinity";
  throw nonfinite_error(
      when + ": " + what + " (the first non-finite value in data-flow order" +
      (plan.training ? "; the gradients of this call are unusable: zero_grad() before going on)" : ")"));
}

}  // namespace pipeoffload
