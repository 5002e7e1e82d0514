// pipeoffload/runtime/detail/setup.hpp: what po::Runtime's constructor does once: checks the
// program and the stages, agrees on every stage's boundaries with the other ranks, lays out the
// step inputs, and allocates the rank's state.
//
// Member functions of Runtime<Backend, Communicator> (runtime/runtime.hpp declares them and
// includes this file after the class), kept apart so that the class reads as its interface and
// state.
#pragma once

#include "../runtime.hpp"

namespace pipeoffload {

// The layer's saved_parts must tile [0, saved_bytes) with parts of at least a byte; the
// reloads copy them in their order (the canary, under guard_buffers, with the last).
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::set_parts(const Stage& l, int stage, std::size_t declared, std::size_t guard) {
  const std::vector<SavedPart> parts = l.saved_parts(opt_.microbatch);
  const auto refuse = [&](const std::string& why) {
    throw error("po::Runtime: stage " + std::to_string(stage) + " (" + l.name() + ")'s saved_parts(): " + why +
                " (they must tile [0, saved_bytes() = " + std::to_string(declared) +
                ") in the order backward_input reads them; layer.hpp)");
  };
  if (parts.size() > static_cast<std::size_t>(max_reload_parts))
    refuse(std::to_string(parts.size()) + " parts, more than the allowed " + std::to_string(max_reload_parts));
  std::vector<std::array<std::size_t, 2>> sorted;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const SavedPart& p = parts[i];
    if (p.bytes == 0) refuse("part " + std::to_string(i) + " has 0 bytes");
    if (p.offset > declared || p.bytes > declared - p.offset)
      refuse("part " + std::to_string(i) + " = [" + std::to_string(p.offset) + ", " +
             std::to_string(p.offset + p.bytes) + ") runs past the buffer");
    sorted.push_back({p.offset, p.bytes});
  }
  std::sort(sorted.begin(), sorted.end());
  std::size_t at = 0;
  for (const auto& [off, len] : sorted) {
    if (off != at)
      refuse(off < at ? "two parts overlap at byte " + std::to_string(off)
                      : "bytes [" + std::to_string(at) + ", " + std::to_string(off) + ") are in no part");
    at = off + len;
  }
  if (!parts.empty() && at != declared)
    refuse("bytes [" + std::to_string(at) + ", " + std::to_string(declared) + ") are in no part");
  declared_parts_.push_back(static_cast<int>(parts.size()));
  std::vector<std::vector<std::array<std::size_t, 2>>> mine;
  if (opt_.reload_parts && backend::waits_in_pass<Backend> && parts.size() > 1)
    for (const SavedPart& p : parts) mine.push_back({{p.offset, p.bytes}});
  else
    mine.push_back({{0, declared}});
  if (guard > 0) mine.back().push_back({declared, guard});
  parts_.push_back(std::move(mine));
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::construct() {
  require_valid(program_);
  const Shape& sh = program_.shape;
  rank_ = comm_.rank();
  if (replicas_ != nullptr) {
    dp_ = replicas_->size();
    replica_ = replicas_->rank();
    if (static_cast<long long>(dp_) * sh.m > exact::max_terms)
      throw error("po::Runtime: dp * m = " + std::to_string(dp_) + " * " + std::to_string(sh.m) +
                  " microbatches in one step exceed " + std::to_string(exact::max_terms));
  }
  if (opt_.gradients != Gradients::standard && opt_.gradients != Gradients::exact)
    throw error("po::Runtime: RuntimeOptions::gradients = " + std::to_string(static_cast<int>(opt_.gradients)) +
                " is neither Gradients::standard (0) nor Gradients::exact (1)");
  if (opt_.reduce_bucket < 1)
    throw error("po::Runtime: RuntimeOptions::reduce_bucket = 0 must be >= 1 (values per reduction bucket)");
  if (opt_.reduce_dtype != DType::float32 && opt_.reduce_dtype != DType::bfloat16)
    throw error(std::string("po::Runtime: RuntimeOptions::reduce_dtype = ") + dtype_name(opt_.reduce_dtype) +
                " must be float32 or bfloat16");
  if (opt_.reduce_dtype == DType::bfloat16 && opt_.gradients != Gradients::standard)
    throw error(
        "po::Runtime: RuntimeOptions::reduce_dtype = bfloat16 needs Gradients::standard (the exact path reduces "
        "128-bit sums)");
  if constexpr (!backend::host_addressable_memory<Backend>)
    if (opt_.guard_buffers)
      throw error(
          "po::Runtime: RuntimeOptions::guard_buffers needs a backend whose device memory the host reads "
          "(backend::Cpu); run the layer's tests with it on the CPU backend");
  if (opt_.graphs) {
    if constexpr (!backend::captures_graphs<Backend>) {
      throw error(
          "po::Runtime: RuntimeOptions::graphs needs a backend that captures and replays work "
          "(backend::captures_graphs: backend::Cpu, backend::Cuda)");
    } else {
      for (const Stage& st : stages_)
        if (!st.capturable())
          throw error("po::Runtime: RuntimeOptions::graphs: the stage type " + st.name() +
                      " does not say its passes can be captured (a member bool capturable() const returning "
                      "true: the passes read the step from mb.device_step and make no host wait; layer.hpp)");
      // (A replicas communicator of one rank makes no call inside a step: no reduction to run.)
      if (!Backend::replays_launches && (sh.d != 1 || dp_ != 1))
        throw error(
            "po::Runtime: RuntimeOptions::graphs on this backend captures one rank without replicas (d = 1, "
            "dp = 1); this run has d = " +
            std::to_string(sh.d) + " and dp = " + std::to_string(dp_) +
            " (the communicators keep host-side bookkeeping that a replay would not repeat)");
    }
  }
  if (opt_.exact_block < 1 || sh.m % opt_.exact_block != 0)
    throw error("po::Runtime: RuntimeOptions::exact_block = " + std::to_string(opt_.exact_block) +
                " must be >= 1 and divide m = " + std::to_string(sh.m));
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
    if (const DType t = l.working().dtype; t != DType::float32 && t != DType::bfloat16)
      throw error("po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ") keeps its working parameters in " +
                  dtype_name(t) + "; they must be float32 or bfloat16");
    if (l.parameter_count() != l.gradients().size())
      throw error("po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ") has " +
                  std::to_string(l.parameter_count()) + " parameters but " + std::to_string(l.gradients().size()) +
                  " gradients");
    const std::vector<std::size_t> groups = l.norm_groups();
    std::size_t total = 0;
    for (std::size_t g : groups) total += g;
    if (total != l.parameter_count())
      throw error("po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ")'s norm_groups() cover " +
                  std::to_string(total) + " parameters, not its " + std::to_string(l.parameter_count()));
    mine.push_back({l.input_boundary(mbs), l.output_boundary(mbs), l.parameter_count(), groups.size(),
                    detail::ShortText::of(l.name())});
    // Under the guard, each buffer is followed by its canary (runtime/detail/streams.hpp).
    const std::size_t guard = opt_.guard_buffers ? guard_bytes : 0;
    saved_.push_back(l.saved_bytes(mbs) + guard);
    stash_.push_back(l.stash_bytes(mbs) + guard);
    set_parts(l, s, l.saved_bytes(mbs), guard);
    norm_groups_.push_back(groups);
  }
  // With blocks of more than one microbatch, a stage sums a block in fp32 in microbatch
  // order, as a one-rank run does: every family orders its W so; a program that does not is
  // refused.
  if (opt_.gradients == Gradients::exact && opt_.exact_block > 1) {
    std::vector<int> last_w(static_cast<std::size_t>(sh.v), -1);
    for (const Op& op : rp.compute)
      if (op.kind == OpKind::W || op.kind == OpKind::BW) {
        int& prev = last_w[static_cast<std::size_t>(sh.chunk_of(op.stage))];
        if (op.mb < prev)
          throw error("po::Runtime: stage " + std::to_string(op.stage) + " computes weight gradients of microbatch " +
                      std::to_string(op.mb) + " after microbatch " + std::to_string(prev) +
                      "; with exact_block > 1 they must come in microbatch order (exact_block = 1 takes any order)");
        prev = op.mb;
      }
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
  resolve_ties();
  // The replicas must run the same pipeline: same program, stages and microbatch shape.
  if (replicas_ != nullptr) handshake(*replicas_, replica_fields());
  // The plans the executor runs: training and forward-only evaluation.
  eval_program_ = forward_only(program_);
  make_plan(train_, program_, true);
  make_plan(eval_, eval_program_, false);
  units_.assign(static_cast<std::size_t>(sh.v) * static_cast<std::size_t>(sh.m), Unit{});
  boxes_.assign(static_cast<std::size_t>(sh.stages()) * static_cast<std::size_t>(sh.m) * 2, backend::Block{});
  for (int c = 0; c < sh.v; ++c)
    layouts_.push_back(
        gradient_layout(stages_[static_cast<std::size_t>(c)].parameter_count(), dp_, opt_.reduce_bucket));
  make_norm_pieces();
  if constexpr (backend::reserves_memory<Backend>) reserve_memory();
  allocate_state();
  // A failure on this device wakes every peer blocked on this rank (and the pair partner's
  // copy stream, which may be waiting for this one's).
  dev_.set_error_hook([this](const std::string& why) {
    comm_.abort(why);
    if (replicas_ != nullptr) replicas_->abort(why);
    if constexpr (backend::pairs_copies<Backend>)
      if (pair_ != nullptr) pair_->abort(why);
  });
  // Every holder of a shared parameter starts from the primary's values.
  if (!ties_.empty()) {
    push_tied();
    dev_.synchronize();
  }
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::resolve_ties() {
  const Shape& sh = program_.shape;
  const auto v = static_cast<std::size_t>(sh.v);
  tie_chunk_.assign(v, 0);
  tie_primary_.assign(v, 0);
  tie_copy_chunk_.assign(v, 0);
  // This rank's declarations as text lines: key, stage, chunk, offset, count, tensor, shape, type.
  constexpr char sep = '\x1f';
  std::string mine;
  for (int c = 0; c < sh.v; ++c) {
    const Stage& l = stages_[static_cast<std::size_t>(c)];
    const std::vector<SharedParam> shared = l.shared_parameters();
    if (shared.empty()) continue;
    const int s = sh.stage_of(rank_, c);
    const std::vector<ParamInfo> tensors = l.parameter_info();
    for (const SharedParam& p : shared) {
      const auto it =
          std::find_if(tensors.begin(), tensors.end(), [&](const ParamInfo& t) { return t.name == p.tensor; });
      const std::string who = "po::Runtime: stage " + std::to_string(s) + " (" + l.name() + ") shares tensor '" +
                              p.tensor + "' under key '" + p.key + "'";
      if (it == tensors.end()) throw error(who + ", which its parameter_info() does not name");
      if (p.key.empty() || p.key.find_first_of(std::string{sep, '\n'}) != std::string::npos ||
          p.tensor.find_first_of(std::string{sep, '\n'}) != std::string::npos)
        throw error(who + ": a key must be non-empty, and neither key nor name may hold a line break or \\x1f");
      if (it->offset + it->count() > l.parameter_count())
        throw error(who + ", which runs past its " + std::to_string(l.parameter_count()) + " parameters");
      std::string shape;
      for (const long long x : it->shape) shape += (shape.empty() ? "" : ", ") + std::to_string(x);
      mine += p.key + sep + std::to_string(s) + sep + std::to_string(c) + sep + std::to_string(it->offset) + sep +
              std::to_string(it->count()) + sep + p.tensor + sep + shape + sep + dtype_name(l.working().dtype) + '\n';
    }
  }
  // Every rank's lines: their lengths, then the text padded to the longest (two collectives on
  // every rank, the second only where some rank declared one).
  const std::uint64_t len = mine.size();
  std::vector<std::uint64_t> lens(static_cast<std::size_t>(sh.d));
  comm_.all_gather(std::span<const std::uint64_t>(&len, 1), std::span(lens));
  const std::uint64_t most = *std::max_element(lens.begin(), lens.end());
  if (most == 0) return;
  mine.resize(most, '\0');
  std::vector<char> all(most * static_cast<std::size_t>(sh.d));
  comm_.all_gather(std::span<const char>(mine.data(), most), std::span(all));
  struct Decl {
    TieHolder h;
    std::string key, shape, dtype;
  };
  std::vector<Decl> decls;
  for (int r = 0; r < sh.d; ++r) {
    const std::string text(all.data() + static_cast<std::size_t>(r) * most, lens[static_cast<std::size_t>(r)]);
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t end = text.find('\n', at);
      std::vector<std::string> f;
      std::size_t a = at;
      for (std::size_t b = text.find(sep, a); b < end; b = text.find(sep, a)) {
        f.push_back(text.substr(a, b - a));
        a = b + 1;
      }
      f.push_back(text.substr(a, end - a));
      at = end + 1;
      Decl d;
      d.key = f[0];
      d.h = {std::stoi(f[1]), r, std::stoi(f[2]), std::stoull(f[3]), std::stoull(f[4]), f[5]};
      d.shape = f[6];
      d.dtype = f[7];
      decls.push_back(std::move(d));
    }
  }
  std::sort(decls.begin(), decls.end(), [](const Decl& a, const Decl& b) {
    return std::tie(a.key, a.h.stage, a.h.offset) < std::tie(b.key, b.h.stage, b.h.offset);
  });
  const auto label = [](const TieHolder& h) { return "tensor '" + h.tensor + "' of stage " + std::to_string(h.stage); };
  // A tensor shared twice, or two shared tensors of one stage that overlap, are refused.
  for (std::size_t i = 0; i < decls.size(); ++i)
    for (std::size_t j = i + 1; j < decls.size(); ++j) {
      const TieHolder &a = decls[i].h, &b = decls[j].h;
      if (a.stage == b.stage && a.offset < b.offset + b.count && b.offset < a.offset + a.count)
        throw error("po::Runtime: " + label(a) + " (key '" + decls[i].key + "') and " + label(b) + " (key '" +
                    decls[j].key + "') overlap; a parameter is shared under one key only");
    }
  for (std::size_t i = 0; i < decls.size();) {
    std::size_t j = i;
    TiedParameter t{decls[i].key, {}};
    for (; j < decls.size() && decls[j].key == t.key; ++j) {
      const Decl &first = decls[i], &d = decls[j];
      if (d.h.count != first.h.count || d.shape != first.shape || d.dtype != first.dtype)
        throw error("po::Runtime: the tensors shared under key '" + t.key + "' differ: " + label(first.h) + " is " +
                    first.dtype + " [" + first.shape + "] and " + label(d.h) + " is " + d.dtype + " [" + d.shape +
                    "] (shape and working type must be the same)");
      t.holders.push_back(d.h);
    }
    if (t.holders.size() < 2)
      throw error("po::Runtime: only " + label(t.holders[0]) + " shares a parameter under key '" + t.key +
                  "'; a shared parameter needs two holders or more");
    for (std::size_t k = 0; k < t.holders.size(); ++k) {
      const TieHolder& h = t.holders[k];
      if (h.rank != rank_) continue;
      tie_here_ = true;
      tie_chunk_[static_cast<std::size_t>(h.chunk)] = 1;
      (k == 0 ? tie_primary_ : tie_copy_chunk_)[static_cast<std::size_t>(h.chunk)] = 1;
    }
    ties_.push_back(std::move(t));
    i = j;
  }
}

template <class Backend, class Communicator>
std::vector<HandshakeField> Runtime<Backend, Communicator>::replica_fields() const {
  const Shape& sh = program_.shape;
  std::string ops, stages;
  for (const RankProgram& rp : program_.ranks)
    for (const Op& op : rp.compute)
      ops += std::string(op_name(op.kind)) + std::to_string(op.stage) + "." + std::to_string(op.mb) + " ";
  std::string shared;
  for (const TiedParameter& t : ties_) {
    shared += t.key + ":";
    for (const TieHolder& h : t.holders) shared += " " + std::to_string(h.stage) + "." + h.tensor;
    shared += "; ";
  }
  for (const StageInfo& t : table_)
    stages += t.name + "(" + std::to_string(t.parameters) + ", " + std::to_string(t.input.elements) + " -> " +
              std::to_string(t.output.elements) + ") ";
  return {{"pipeline rank", std::to_string(rank_)},
          {"shape", "d=" + std::to_string(sh.d) + " v=" + std::to_string(sh.v) + " m=" + std::to_string(sh.m)},
          {"microbatch shape", std::to_string(opt_.microbatch.batch) + "x" + std::to_string(opt_.microbatch.seq)},
          {"stages", stages},
          {"program", ops},
          {"shared parameters", shared}};
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::collect_inputs() {
  const Shape& sh = program_.shape;
  for (int c = 0; c < sh.v; ++c) {
    const Stage& l = stages_[static_cast<std::size_t>(c)];
    for (const InputSpec& in : l.inputs(opt_.microbatch)) {
      auto it = std::find_if(inputs_.begin(), inputs_.end(), [&](const Declared& d) { return d.spec.name == in.name; });
      if (it == inputs_.end()) {
        inputs_.push_back({in, c});
        continue;
      }
      if (it->spec.dtype != in.dtype || it->spec.elements != in.elements)
        throw error("po::Runtime: stages " + std::to_string(sh.stage_of(rank_, it->chunk)) + " and " +
                    std::to_string(sh.stage_of(rank_, c)) + " declare the step input '" + in.name +
                    "' differently: " + std::to_string(it->spec.elements) + " " + dtype_name(it->spec.dtype) + " and " +
                    std::to_string(in.elements) + " " + dtype_name(in.dtype) + " values per microbatch");
    }
  }
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::make_norm_pieces() {
  for (std::size_t c = 0; c < layouts_.size(); ++c) {
    const std::vector<std::size_t>& groups = norm_groups_[c];
    std::vector<NormPiece> pieces;
    // A copy of a shared parameter is counted once, in its primary.
    const std::vector<ParamRange> ranges =
        without(norm_by_shards() ? layouts_[c].shards(replica_) : std::vector<ParamRange>{{0, layouts_[c].values}},
                tied_copies(static_cast<int>(c)));
    for (const ParamRange& r : ranges) {
      // Every group clipped to the range, then the empty ones at either end dropped.
      std::vector<std::size_t> sizes;
      std::size_t at = 0;
      for (const std::size_t g : groups) {
        const std::size_t lo = std::max(at, r.begin), hi = std::min(at + g, r.end);
        sizes.push_back(hi > lo ? hi - lo : 0);
        at += g;
      }
      std::size_t first = 0, last = sizes.size();
      while (first < last && sizes[first] == 0) ++first;
      while (last > first && sizes[last - 1] == 0) --last;
      if (first == last) continue;
      pieces.push_back({r, first,
                        std::vector<std::size_t>(sizes.begin() + static_cast<std::ptrdiff_t>(first),
                                                 sizes.begin() + static_cast<std::ptrdiff_t>(last))});
    }
    norm_pieces_.push_back(std::move(pieces));
  }
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::allocate_state() {
  const Shape& sh = program_.shape;
  // Reserved for themselves, so they never take a block reserve_memory() counted on.
  const auto take = [&](std::size_t bytes) {
    if constexpr (backend::reserves_memory<Backend>) dev_.reserve_device(bytes, 1);
    return dev_.device_alloc(bytes, backend::Memory::state);
  };
  const std::size_t m = static_cast<std::size_t>(sh.m);
  for (const Declared& d : inputs_) inputs_dev_.push_back(take(m * d.spec.elements * dtype_size(d.spec.dtype)));
  // The memory plans' region: saved units, stashes and boundary tensors at their offsets.
  region_ = take(std::max(train_.lowered.region, eval_.lowered.region));
  // Exact gradient sums (exact path), padded to whole reduction buckets of a multiple of dp
  // values, and the reduction's staging (sized for the largest bucket); po::state_bytes counts
  // the same for a launcher that sizes memory ahead.
  std::size_t most = 0;
  for (int c = 0; c < sh.v; ++c) {
    const GradientLayout& l = layouts_[static_cast<std::size_t>(c)];
    if (opt_.gradients == Gradients::exact) {
      sums_.push_back(take(l.padded() * sizeof(exact::Fixed)));
      dev_.zero(sums_.back().ptr, sums_.back().bytes);
    }
    most = std::max(most, l.len);
  }
  if (dp_ > 1)
    for (const std::size_t bytes : reduction_staging_bytes(most, dp_, opt_.gradients)) staging_.push_back(take(bytes));
  std::size_t primary = 0;  // the largest shared tensor whose primary this rank holds
  for (const TiedParameter& t : ties_)
    if (t.holders[0].rank == rank_) primary = std::max(primary, t.holders[0].count);
  if (const std::size_t bytes = tie_staging_bytes(primary, opt_.reduce_bucket, opt_.gradients); bytes > 0)
    tie_staging_ = take(bytes);
  results_dev_ =
      take(flag_count() * sizeof(std::uint32_t) + m * sizeof(float) + (opt_.graphs ? sizeof(std::int32_t) : 0));
  // Each stage's view of each microbatch's inputs: fixed device addresses, built once.
  views_.resize(static_cast<std::size_t>(sh.v) * m);
  for (int c = 0; c < sh.v; ++c)
    for (const InputSpec& in : stages_[static_cast<std::size_t>(c)].inputs(opt_.microbatch)) {
      std::size_t k = 0;
      while (inputs_[k].spec.name != in.name) ++k;
      const std::size_t bytes = in.elements * dtype_size(in.dtype);
      for (std::size_t b = 0; b < m; ++b)
        views_[static_cast<std::size_t>(c) * m + b].push_back(
            {inputs_[k].spec.name, ConstTensor{inputs_dev_[k].ptr + b * bytes, in.elements, in.dtype}, {}});
    }
}

}  // namespace pipeoffload
