// pipeoffload/runtime/detail/streams.hpp: po::Runtime's three streams: the compute ops (F, B, W,
// BW), the copies (O, R; paced and paired), the P2P messages, and the enqueue order that has
// every awaited event recorded before its wait.
//
// Member functions of Runtime<Backend, Communicator> (runtime/runtime.hpp declares them and
// includes this file after the class), kept apart so that the class reads as its interface and
// state.
#pragma once

#include "../runtime.hpp"

namespace pipeoffload {

namespace detail {

inline constexpr std::byte guard_fill{0xa5};

/// Writes the canary after the first `bytes - guard_bytes` bytes of the buffer at `p`.
inline void arm_guard(std::byte* p, std::size_t bytes) {
  std::memset(p + bytes - guard_bytes, static_cast<int>(guard_fill), guard_bytes);
}

/// Throws naming `pass` and `what` when the canary of the `bytes`-byte buffer at `p` changed.
inline void check_guard(const std::byte* p, std::size_t bytes, const char* pass, const char* what) {
  const std::size_t declared = bytes - guard_bytes;
  for (std::size_t k = 0; k < guard_bytes; ++k)
    if (p[declared + k] != guard_fill)
      throw error(std::string("the stage's ") + pass + " wrote past its " + what + "() = " + std::to_string(declared) +
                  " bytes (byte " + std::to_string(declared + k) + " of the buffer changed; " + what +
                  "() must cover everything the passes write there)");
}

}  // namespace detail

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_compute(std::size_t x) {
  const Plan& plan = *call_.plan;
  const Op op = plan.rp->compute[x];
  if (plan.training) stamp(trace_.compute_start[x]);
  guarded("compute", x, op, [&] {
    const int S = program_.shape.stages();
    const std::size_t c = static_cast<std::size_t>(program_.shape.chunk_of(op.stage));
    const Stage& l = stages_[c];
    auto ctx = dev_.context(compute_);
    const Microbatch mb = info(op);
    std::uint32_t* flag = flags_dev() + x;
    if (op.kind == OpKind::F) {
      // Evaluation keeps nothing: the unit is a scratch block given back after the pass.
      backend::Block saved = take_buffer(plan.lowered.compute_at[x][0], saved_[c], backend::Memory::activation);
      if (plan.training) units_[unit_index(op.stage, op.mb)].device = saved;
      const ConstTensor in = op.stage > 0 ? box_in(op.stage, op.mb, Dir::forward) : ConstTensor{};
      const Tensor out =
          op.stage < S - 1 ? box_out(op.stage + 1, op.mb, Dir::forward, plan.lowered.compute_at[x][1]) : Tensor{};
      if constexpr (backend::host_addressable_memory<Backend>)
        if (opt_.guard_buffers) detail::arm_guard(saved.ptr, saved_[c]);
      l.forward(ctx, mb, in, out, saved.ptr);
      if constexpr (backend::host_addressable_memory<Backend>)
        if (opt_.guard_buffers) detail::check_guard(saved.ptr, saved_[c], "forward", "saved_bytes");
      if (opt_.check_finite && out) dev_.flag_nonfinite(ctx, ConstTensor{out.data, out.elements, out.dtype}, flag);
      if (op.stage > 0) release_box(op.stage, op.mb, Dir::forward);
      if (!plan.training) give_buffer(saved);
    }
    Unit& u = units_[unit_index(op.stage, op.mb)];
    if (op.kind == OpKind::B || op.kind == OpKind::BW) {
      if (u.device.ptr == nullptr) throw error("its activations are not on the device (missing reload)");
      const ConstTensor dy = op.stage < S - 1 ? box_in(op.stage, op.mb, Dir::backward) : ConstTensor{};
      const Tensor dx =
          op.stage > 0 ? box_out(op.stage - 1, op.mb, Dir::backward, plan.lowered.compute_at[x][1]) : Tensor{};
      u.stash = take_buffer(plan.lowered.compute_at[x][0], stash_[c], backend::Memory::stash);
      if constexpr (backend::host_addressable_memory<Backend>)
        if (opt_.guard_buffers) detail::arm_guard(u.stash.ptr, stash_[c]);
      // The layer awaits each part of its saved buffer before it reads it (await_saved); for a
      // reload copied in parts that waits for the part's copy.
      struct Await {
        Runtime* rt;
        const Context* ctx;
        const std::vector<int>* events;  // the parts' events but the last (null: nothing to wait for)
        int done;                        // the last part's: the reload's copy_done
        int parts;                       // what the layer declares (0: none, one part)
        int next = 0;                    // parts awaited so far
        static void call(void* self, int part) {
          auto& a = *static_cast<Await*>(self);
          if (part < 0 || part >= std::max(a.parts, 1))
            throw error("backward_input called mb.await_saved(" + std::to_string(part) +
                        "); the stage's saved parts are 0.." + std::to_string(std::max(a.parts, 1) - 1));
          if (part < a.next) return;
          if constexpr (backend::waits_in_pass<Backend>)
            if (a.events != nullptr)
              a.rt->dev_.wait_in_pass(*a.ctx, static_cast<std::size_t>(part) < a.events->size()
                                                  ? (*a.events)[static_cast<std::size_t>(part)]
                                                  : a.done);
          a.next = part + 1;
        }
      };
      const int y = split_reload(plan, x);
      Await aw{this, &ctx, y >= 0 ? &plan.part_done[static_cast<std::size_t>(y)] : nullptr,
               y >= 0 ? plan.copy_done[static_cast<std::size_t>(y)] : -1, declared_parts_[c]};
      const detail::SavedWait hook{&Await::call, &aw};
      Microbatch bmb = mb;
      bmb.saved_wait = &hook;
      l.backward_input(ctx, bmb, dy, dx, u.device.ptr, u.stash.ptr);
      if (aw.parts > 0 && aw.next != aw.parts)
        throw error("backward_input awaited " + std::to_string(aw.next) + " of the stage's " +
                    std::to_string(aw.parts) +
                    " saved parts: it must call mb.await_saved(i) for every part i of saved_parts() before it "
                    "reads it (layer.hpp)");
      if constexpr (backend::host_addressable_memory<Backend>)
        if (opt_.guard_buffers) {
          detail::check_guard(u.device.ptr, saved_[c], "backward_input", "saved_bytes");
          detail::check_guard(u.stash.ptr, stash_[c], "backward_input", "stash_bytes");
        }
      if (opt_.check_finite && dx) dev_.flag_nonfinite(ctx, ConstTensor{dx.data, dx.elements, dx.dtype}, flag);
      if (op.stage < S - 1) release_box(op.stage, op.mb, Dir::backward);
    }
    if (op.kind == OpKind::W || op.kind == OpKind::BW) {
      if (u.device.ptr == nullptr) throw error("its activations are not on the device (missing reload)");
      if (opt_.gradients == Gradients::standard) {
        // The pass adds this microbatch's gradients to gradients() in place.
        l.backward_weight(ctx, mb, u.device.ptr, u.stash.ptr);
      } else {
        // The pass adds this microbatch's gradients to gradients(), zeroed at a block's first
        // microbatch; at its last they go into the exact sums. After the chunk's last W of the
        // call the sums, rounded, come back (or, in the last call of a step with replicas, the
        // comm stream's reduction does that).
        const std::span<float> grads = l.gradients();
        const std::span<exact::Fixed> acc = sums(static_cast<int>(c)).first(grads.size());
        if (mb.mb % opt_.exact_block == 0) dev_.zero(ctx, grads.data(), grads.size_bytes());
        l.backward_weight(ctx, mb, u.device.ptr, u.stash.ptr);
        if (mb.mb % opt_.exact_block == opt_.exact_block - 1) dev_.exact_add(ctx, acc, std::span<const float>(grads));
        // (A chunk holding a shared parameter's primary rounds after the other holders'
        // sums are in: run_ties.)
        if (static_cast<int>(x) == plan.lowered.last_w[c] && !reducing() && !(tying() && tie_primary_[c] != 0))
          dev_.exact_round(ctx, grads, std::span<const exact::Fixed>(acc));
      }
      if constexpr (backend::host_addressable_memory<Backend>)
        if (opt_.guard_buffers) {
          detail::check_guard(u.device.ptr, saved_[c], "backward_weight", "saved_bytes");
          detail::check_guard(u.stash.ptr, stash_[c], "backward_weight", "stash_bytes");
        }
      give_buffer(u.stash);
      give_buffer(u.device);
    }
  });
  if (plan.training) stamp(trace_.compute_end[x]);
}

// A copy op, or one part of a reload copied in parts (RuntimeOptions::reload_parts): its byte ranges of the
// unit, each cut where the unit's power-of-two host bins meet. The first part takes the device
// buffer, the last gives back the host bins.
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_copy(std::size_t y, std::size_t part) {
  const Op op = call_.plan->rp->copy[y];
  const auto c = static_cast<std::size_t>(program_.shape.chunk_of(op.stage));
  const std::array<std::size_t, 2> whole{0, saved_[c]};
  const std::span<const std::array<std::size_t, 2>> ranges =
      op.kind == OpKind::R ? std::span(reload_parts(static_cast<int>(c))[part]) : std::span(&whole, 1);
  const bool first = part == 0, last = op.kind == OpKind::O || part + 1 == reload_parts(static_cast<int>(c)).size();
  if (first) stamp(trace_.copy_start[y]);
  guarded("copy", y, op, [&] {
    Unit& u = units_[unit_index(op.stage, op.mb)];
    const std::size_t bytes = saved_[c];
    const offload::BinPlan plan = offload::plan_bins(bytes);
    std::vector<backend::CopyPiece> pieces;
    const auto lay_out = [&](bool to_host) {
      for (const auto& [from, len] : ranges) {
        // Bin i holds bytes [off, off + bins[i]) of the unit.
        std::size_t off = 0;
        for (int i = 0; i < plan.count; ++i) {
          const auto b = static_cast<std::size_t>(plan.bins[static_cast<std::size_t>(i)]);
          const std::size_t lo = std::max(off, from), hi = std::min(off + b, from + len);
          if (lo < hi) {
            std::byte* dev = u.device.ptr + lo;
            std::byte* host = u.host[static_cast<std::size_t>(i)].ptr + (lo - off);
            pieces.push_back(to_host ? backend::CopyPiece{host, dev, hi - lo} : backend::CopyPiece{dev, host, hi - lo});
          }
          off += b;
        }
      }
    };
    if (op.kind == OpKind::O) {
      if (u.device.ptr == nullptr) throw error("nothing to offload (the unit is not on the device)");
      for (int i = 0; i < plan.count; ++i)
        u.host[static_cast<std::size_t>(i)] = dev_.host_alloc(plan.bins[static_cast<std::size_t>(i)]);
      lay_out(true);
      dev_.transfer(std::span<const backend::CopyPiece>(pieces));
      give_buffer(u.device);
    } else {
      if (first) {
        if (u.host[0].ptr == nullptr && bytes > 0) throw error("nothing to reload (the unit was not offloaded)");
        u.device = take_buffer(call_.plan->lowered.copy_at[y], bytes, backend::Memory::activation);
      }
      lay_out(false);
      dev_.transfer(std::span<const backend::CopyPiece>(pieces));
      if (last)
        for (auto& h : u.host) {
          dev_.host_free(h);
          h = {};
        }
    }
  });
  if (last) stamp(trace_.copy_end[y]);
}

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_comm(std::size_t k) {
  const CommOp c = call_.plan->rp->comm[k];
  const Tag tag{c.stage, c.mb, c.dir};
  try {
    // Launched on the comm stream: the communicator posts there (a GPU one enqueues on it).
    const Context ctx = dev_.context(comm_stream_);
    if (c.send) {
      backend::Block& b = box(c.stage, c.mb, c.dir);
      comm_.send(ctx, c.peer, tag, std::span<const std::byte>(b.ptr, b.bytes));
      give_buffer(b);
    } else {
      const Tensor t = box_out(c.stage, c.mb, c.dir, call_.plan->lowered.comm_at[k]);
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

template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_reduce(int chunk) {
  const double t0 = dev_.now();
  try {
    Context ctx = dev_.context(comm_stream_);
    if (opt_.gradients == Gradients::standard)
      reduce_standard(chunk, ctx);
    else
      reduce_exact(chunk, ctx);
  } catch (const aborted_error&) {
    throw;
  } catch (const std::exception& e) {
    throw error("rank " + std::to_string(rank_) + " of replica " + std::to_string(replica_) +
                ", gradient reduction of stage " + std::to_string(program_.shape.stage_of(rank_, chunk)) + ": " +
                e.what());
  }
  reduce_trace_.push_back({chunk, t0, dev_.now()});
}

// Each bucket's fp32 gradients reduce-scattered: slice j goes to replica j (an all_to_all),
// which adds the replicas' parts in replica order into its own slice of gradients(); unless
// the gradients stay sharded, an all-gather then hands every replica the whole bucket. The
// last bucket, which runs past the parameters, goes through the staging with zeros after them.
// With reduce_dtype bfloat16 the bucket is first rounded into the staging's bucket buffer as
// bfloat16 and the parts arrive as bfloat16 (each staging buffer has room for fp32).
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::reduce_standard(int chunk, Context& ctx) {
  if constexpr (replica_communicator<Communicator, Context>) {
    const GradientLayout& l = layouts_[static_cast<std::size_t>(chunk)];
    float* g = stages_[static_cast<std::size_t>(chunk)].gradients().data();
    const std::size_t len = l.len, slice = l.slice(), n = l.values;
    auto* bucket = reinterpret_cast<float*>(staging_[0].ptr);
    auto* parts = reinterpret_cast<float*>(staging_[1].ptr);
    auto* mine = reinterpret_cast<float*>(staging_[2].ptr);
    const bool gather = !gradients_sharded(), narrow = opt_.reduce_dtype == DType::bfloat16;
    // The bucket from `src` (len values of T) to its owners, and this replica's slice summed.
    const auto scatter = [&]<class T>(const T* src, T* got) {
      replicas_->all_to_all(ctx, std::as_bytes(std::span<const T>(src, len)),
                            std::as_writable_bytes(std::span<T>(got, len)));
      dev_.sum_parts(ctx, std::span<float>(mine, slice), std::span<const T>(got, len));
    };
    for (std::size_t b0 = 0; b0 < n; b0 += len) {
      const std::size_t valid = std::min(len, n - b0);
      if (narrow) {
        auto* send = reinterpret_cast<std::uint16_t*>(bucket);
        dev_.to_bf16(ctx, std::span<std::uint16_t>(send, valid), std::span<const float>(g + b0, valid));
        if (valid < len) dev_.zero(ctx, send + valid, (len - valid) * sizeof(std::uint16_t));
        scatter(static_cast<const std::uint16_t*>(send), reinterpret_cast<std::uint16_t*>(parts));
      } else if (valid < len) {
        dev_.copy(ctx, bucket, g + b0, valid * sizeof(float));
        dev_.zero(ctx, bucket + valid, (len - valid) * sizeof(float));
        scatter(static_cast<const float*>(bucket), parts);
      } else {
        scatter(static_cast<const float*>(g + b0), parts);
      }
      const ParamRange r = l.shard(b0 / len, replica_);
      dev_.copy(ctx, g + r.begin, mine, r.size() * sizeof(float));
      if (gather) {
        replicas_->all_gather(ctx, std::as_bytes(std::span<const float>(mine, slice)),
                              std::as_writable_bytes(std::span<float>(bucket, len)));
        dev_.copy(ctx, g + b0, bucket, valid * sizeof(float));
      }
    }
  }
}

// Each bucket's 128-bit sums reduce-scattered (an all_to_all; the owner of a slice adds the
// replicas' parts exactly and rounds its slice once), then all-gathered in fp32.
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::reduce_exact(int chunk, Context& ctx) {
  if constexpr (replica_communicator<Communicator, Context>) {
    const std::span<float> g = stages_[static_cast<std::size_t>(chunk)].gradients();
    const std::span<exact::Fixed> acc = sums(chunk);
    const std::size_t len = bucket_values(chunk), n = g.size(), slice = len / static_cast<std::size_t>(dp_);
    auto* parts = reinterpret_cast<exact::Fixed*>(staging_[0].ptr);
    auto* mine = reinterpret_cast<exact::Fixed*>(staging_[1].ptr);
    auto* rounded = reinterpret_cast<float*>(staging_[2].ptr);
    auto* gathered = reinterpret_cast<float*>(staging_[3].ptr);
    for (std::size_t b0 = 0; b0 < n; b0 += len) {
      replicas_->all_to_all(ctx, std::as_bytes(acc.subspan(b0, len)),
                            std::as_writable_bytes(std::span<exact::Fixed>(parts, len)));
      dev_.exact_sum(ctx, std::span<exact::Fixed>(mine, slice), std::span<const exact::Fixed>(parts, len));
      dev_.exact_round(ctx, std::span<float>(rounded, slice), std::span<const exact::Fixed>(mine, slice));
      replicas_->all_gather(ctx, std::as_bytes(std::span<const float>(rounded, slice)),
                            std::as_writable_bytes(std::span<float>(gathered, len)));
      dev_.copy(ctx, g.data() + b0, gathered, std::min(len, n - b0) * sizeof(float));
    }
  }
}

// Enqueues the lowered program's ops on their streams, each after the events of the ops it
// waits for (schedule/lower.hpp), in an order that has every awaited event recorded first.
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::enqueue(const Plan& plan) {
  const RankProgram& rp = *plan.rp;
  const LoweredRank& lr = plan.lowered;
  const std::size_t nc = rp.compute.size(), ny = rp.copy.size(), nk = rp.comm.size();
  // Reductions go into the comm stream's order at LoweredRank::reduce_at, except those of
  // chunks holding shared parameters when the call adds their gradients: those go after
  // run_ties, at the end of the comm stream (where it waits for no other rank's P2P, so the
  // holders' messages cannot wait for each other in a cycle).
  const bool ties = tying();
  std::vector<int> reduces, deferred;
  if (reducing())
    for (const int c : lr.reduces)
      (ties && tie_chunk_[static_cast<std::size_t>(c)] != 0 ? deferred : reduces).push_back(c);
  const std::size_t nq = reduces.size();
  reduce_trace_.clear();
  // A parameter gather the optimizer left running (share_shards(c, true)): the rank's first
  // pass of chunk c waits for it; the passes before it do not.
  std::vector<char> gather = std::exchange(gather_pending_, std::vector<char>(gather_pending_.size(), 0));
  std::array<std::size_t, 3> issued{0, 0, 0};  // ops enqueued per Stream
  const std::array<const std::vector<int>*, 3> done{&plan.compute_done, &plan.copy_done, &plan.comm_done};
  const std::array<int, 3> stream_of{compute_, copy_, comm_stream_};
  // Has every op `w` waits for been enqueued? Then make `stream` wait for their events.
  const auto ready = [&](const Waits& w) {
    for (std::size_t s = 0; s < 3; ++s)
      if (w.last[s] >= 0 && static_cast<std::size_t>(w.last[s]) >= issued[s]) return false;
    return true;
  };
  const auto wait_for = [&](int stream, const Waits& w) {
    for (std::size_t s = 0; s < 3; ++s) {
      if (w.last[s] < 0) continue;
      const auto i = static_cast<std::size_t>(w.last[s]);
      if (s == static_cast<std::size_t>(Stream::copy) && reload_ != copy_) {
        // Two copy streams: every copy up to i, the offloads' and the reloads' streams.
        for (int q = 0; q < 2; ++q) {
          const int y = plan.copy_upto[i][static_cast<std::size_t>(q)];
          if (y >= 0 && (q == 0 ? copy_ : reload_) != stream)
            dev_.wait(stream, plan.copy_done[static_cast<std::size_t>(y)]);
        }
      } else if (stream_of[s] != stream) {
        dev_.wait(stream, (*done[s])[i]);
      }
    }
  };
  std::size_t& ic = issued[0];
  std::size_t& iy = issued[1];
  std::size_t& ik = issued[2];
  std::size_t iq = 0;
  while (ic < nc || iy < ny || ik < nk || iq < nq) {
    bool moved = false;
    while (ic < nc && ready(lr.compute[ic])) {
      const Op& op = rp.compute[ic];
      if (const int y = split_reload(plan, ic); y >= 0) {
        // The first part of its reload (which follows every copy before it); the pass waits
        // for the others.
        Waits w = lr.compute[ic];
        w.last[static_cast<std::size_t>(Stream::copy)] = -1;
        wait_for(compute_, w);
        dev_.wait(compute_, plan.part_done[static_cast<std::size_t>(y)][0]);
      } else {
        wait_for(compute_, lr.compute[ic]);
      }
      const std::size_t chunk = static_cast<std::size_t>(program_.shape.chunk_of(op.stage));
      if (gather[chunk] != 0) {
        dev_.wait(compute_, gathered_[chunk]);
        gather[chunk] = 0;
      }
      dev_.launch(compute_, [this, x = ic] { run_compute(x); });
      dev_.record(plan.compute_done[ic], compute_);
      ++ic;
      moved = true;
    }
    while (iy < ny && ready(lr.copy[iy])) {
      const int on = rp.copy[iy].kind == OpKind::R ? reload_ : copy_;
      wait_for(on, lr.copy[iy]);
      if constexpr (backend::pairs_copies<Backend>)
        if (pair_ != nullptr && pair_wait_[iy] > 0)
          dev_.wait_counter(copy_, pair_->side[(rank_ ^ 1) & 1],
                            static_cast<std::uint64_t>(iterations_ * partner_copies_ + pair_wait_[iy]));
      const std::vector<int>& parts = plan.part_done[iy];
      for (std::size_t i = 0; i < parts.size(); ++i) {
        dev_.launch(on, [this, y = iy, i] { run_copy(y, i); });
        dev_.record(parts[i], on);
      }
      dev_.launch(on, [this, y = iy, i = parts.size()] { run_copy(y, i); });
      dev_.record(plan.copy_done[iy], on);
      if constexpr (backend::pairs_copies<Backend>)
        if (pair_ != nullptr)
          dev_.signal(copy_, pair_->side[rank_ & 1], static_cast<std::uint64_t>(iterations_ * ny + iy + 1));
      ++iy;
      moved = true;
    }
    for (;;) {
      if (iq < nq) {
        const int c = reduces[iq], x = lr.last_w[static_cast<std::size_t>(c)];
        if (static_cast<std::size_t>(lr.reduce_at[static_cast<std::size_t>(c)]) <= ik) {
          if (static_cast<std::size_t>(x) >= ic) break;
          dev_.wait(comm_stream_, plan.compute_done[static_cast<std::size_t>(x)]);
          dev_.launch(comm_stream_, [this, c] { run_reduce(c); });
          ++iq;
          moved = true;
          continue;
        }
      }
      if (ik >= nk || !ready(lr.comm[ik])) break;
      wait_for(comm_stream_, lr.comm[ik]);
      dev_.launch(comm_stream_, [this, k = ik] { run_comm(k); });
      dev_.record(plan.comm_done[ik], comm_stream_);
      ++ik;
      moved = true;
    }
    if (!moved)
      throw error("po::Runtime: rank " + std::to_string(rank_) +
                  "'s program has a dependency cycle between its streams");
  }
  if (ties) {
    for (std::size_t c = 0; c < tie_chunk_.size(); ++c)
      if (const int x = lr.last_w[c]; tie_chunk_[c] != 0 && x >= 0)
        dev_.wait(comm_stream_, plan.compute_done[static_cast<std::size_t>(x)]);
    dev_.launch(comm_stream_, [this] { run_ties(); });
    for (const int c : deferred) dev_.launch(comm_stream_, [this, c] { run_reduce(c); });
  }
}

// Shared parameters, holder by holder in ties_' order (the same on every rank, so two ranks'
// blocking sends and receives meet in one order): the other holder's gradients (standard) or
// exact sums (exact) sent to the primary's rank a bucket at a time (or read in place on one
// rank), and added after the primary's own in the staging, the primary's first
// (sum_parts, exact_sum); then, without a reduction to follow, a primary's exact sums rounded.
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::run_ties() {
  try {
    Context ctx = dev_.context(comm_stream_);
    const bool exact = opt_.gradients == Gradients::exact;
    const std::size_t e = exact ? sizeof(exact::Fixed) : sizeof(float);
    const auto values = [&](const TieHolder& h) {
      return exact ? reinterpret_cast<std::byte*>(sums(h.chunk).data() + h.offset)
                   : reinterpret_cast<std::byte*>(stages_[static_cast<std::size_t>(h.chunk)].gradients().data() +
                                                  h.offset);
    };
    for (const TiedParameter& t : ties_) {
      const TieHolder& p = t.holders[0];
      const std::size_t len = tie_bucket(p.count, opt_.reduce_bucket);
      for (std::size_t i = 1; i < t.holders.size(); ++i) {
        const TieHolder& h = t.holders[i];
        if (h.rank != rank_ && p.rank != rank_) continue;
        for (std::size_t b0 = 0, k = 0; b0 < p.count; b0 += len, ++k) {
          const std::size_t n = std::min(len, p.count - b0);
          const Tag tag{p.stage, -1 - static_cast<int>(k), Dir::backward};
          if (p.rank != rank_) {
            comm_.send(ctx, p.rank, tag, std::span<const std::byte>(values(h) + b0 * e, n * e));
            continue;
          }
          std::byte* own = values(p) + b0 * e;
          std::byte* st = tie_staging_.ptr;
          dev_.copy(ctx, st, own, n * e);
          if (h.rank == rank_)
            dev_.copy(ctx, st + n * e, values(h) + b0 * e, n * e);
          else
            comm_.recv(ctx, h.rank, tag, std::span<std::byte>(st + n * e, n * e));
          if (exact)
            dev_.exact_sum(ctx, std::span<exact::Fixed>(reinterpret_cast<exact::Fixed*>(own), n),
                           std::span<const exact::Fixed>(reinterpret_cast<const exact::Fixed*>(st), 2 * n));
          else
            dev_.sum_parts(ctx, std::span<float>(reinterpret_cast<float*>(own), n),
                           std::span<const float>(reinterpret_cast<const float*>(st), 2 * n));
        }
      }
    }
    if (exact && !reducing())
      for (std::size_t c = 0; c < tie_primary_.size(); ++c)
        if (tie_primary_[c] != 0) {
          const std::span<float> g = stages_[c].gradients();
          dev_.exact_round(ctx, g, std::span<const exact::Fixed>(sums(static_cast<int>(c)).first(g.size())));
        }
  } catch (const aborted_error&) {
    throw;
  } catch (const std::exception& e) {
    throw error("rank " + std::to_string(rank_) + ", shared parameters' gradients: " + e.what());
  }
}

// The primary's working values to every other holder, a bucket at a time, from the comm
// stream's context (in ties_' order on every rank, as run_ties).
template <class Backend, class Communicator>
void Runtime<Backend, Communicator>::push_tied() {
  Context ctx = dev_.context(comm_stream_);
  for (const TiedParameter& t : ties_) {
    const TieHolder& p = t.holders[0];
    const std::size_t len = tie_bucket(p.count, opt_.reduce_bucket);
    const auto at = [&](const TieHolder& h, std::size_t b0) {
      const Tensor w = stages_[static_cast<std::size_t>(h.chunk)].working();
      return w.data + (h.offset + b0) * dtype_size(w.dtype);
    };
    for (std::size_t i = 1; i < t.holders.size(); ++i) {
      const TieHolder& h = t.holders[i];
      if (h.rank != rank_ && p.rank != rank_) continue;
      const std::size_t e =
          dtype_size(stages_[static_cast<std::size_t>(h.rank == rank_ ? h.chunk : p.chunk)].working().dtype);
      for (std::size_t b0 = 0, k = 0; b0 < p.count; b0 += len, ++k) {
        const std::size_t n = std::min(len, p.count - b0);
        const Tag tag{h.stage, -1 - static_cast<int>(k), Dir::forward};
        if (p.rank == rank_ && h.rank == rank_)
          dev_.copy(ctx, at(h, b0), at(p, b0), n * e);
        else if (p.rank == rank_)
          comm_.send(ctx, h.rank, tag, std::span<const std::byte>(at(p, b0), n * e));
        else
          comm_.recv(ctx, p.rank, tag, std::span<std::byte>(at(h, b0), n * e));
      }
    }
  }
}

}  // namespace pipeoffload
