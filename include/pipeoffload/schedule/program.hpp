// pipeoffload/schedule/program.hpp: what a schedule builds for one shape and cost model.
//
// Units (docs/design.md section 1): d ranks, v chunks per rank, S = v*d stages, m microbatches.
// Stage s is chunk s / d of its rank; which rank is the placement's choice (Shape::rank_of).
// One activation unit = the saved activations of one stage for one microbatch.
/// @file
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"
#include "../policy/spec.hpp"

namespace pipeoffload {

/// Allowed ranges of a shape (wide enough for any real pipeline; they bound memory use).
inline constexpr int max_ranks = 4096;
inline constexpr int max_chunks = 256;            ///< most chunks per rank (v)
inline constexpr int max_microbatches = 1 << 16;  ///< most microbatches (m)
inline constexpr int max_reload_parts =
    1024;  ///< most parts a unit reloads in (Costs::reload_shares, a layer's saved_parts)

/// Pipeline shape: d ranks, v chunks (stages) per rank, m microbatches per iteration, and
/// where the stages live. Chunk c of every rank holds stages c*d .. c*d + d-1, one per rank:
///   - interleaved (Megatron's, the paper's): stage c*d + r on rank r, so each chunk's
///     stages run from rank 0 to rank d-1 and the next chunk starts again on rank 0;
///   - vshape (zero-bubble V schedules, DualPipeV): chunks alternate direction, stage
///     c*d + r on rank r for even c and on rank d-1-r for odd c; with v = 2 rank r holds
///     stages r and 2d-1-r, and stages d-1 and d meet on rank d-1 without a P2P hop.
/// A schedule's placement is its spec's (ScheduleSpec::placement); build() writes it here.
struct Shape {
  int d = 1;                                     ///< ranks, 1 .. max_ranks
  int v = 1;                                     ///< chunks (stages) per rank, 1 .. max_chunks
  int m = 1;                                     ///< microbatches per iteration, 1 .. max_microbatches
  Placement placement = Placement::interleaved;  ///< which rank holds which stage (see above)

  /// S = d*v, the number of stages.
  constexpr int stages() const { return d * v; }
  /// The rank that holds `stage`, by the placement.
  constexpr int rank_of(int stage) const {
    const int r = stage % d;
    return placement == Placement::vshape && (stage / d) % 2 == 1 ? d - 1 - r : r;
  }
  /// The chunk of its rank that `stage` is: stage / d.
  constexpr int chunk_of(int stage) const { return stage / d; }
  /// The stage that chunk `chunk` of rank `rank` holds (rank_of and chunk_of's inverse).
  constexpr int stage_of(int rank, int chunk) const {
    return chunk * d + (placement == Placement::vshape && chunk % 2 == 1 ? d - 1 - rank : rank);
  }
  /// Do stages s and s + 1 live on different ranks (is there a P2P hop between them)?
  constexpr bool crosses(int s) const { return rank_of(s) != rank_of(s + 1); }
  /// Field-by-field equality.
  friend constexpr bool operator==(const Shape&, const Shape&) = default;
};

/// Cost model. Times are in any one unit (the tools use seconds or "unit passes").
/// Per-stage vectors, when non-empty, have S entries and override the scalars.
struct Costs {
  double f = 1;               ///< T_F: forward of one stage for one microbatch.
  double b = 1;               ///< T_B: activation-gradient backward.
  double w = 1;               ///< T_W: weight-gradient backward (fused BW takes T_B + T_W).
  double comm = 0;            ///< T_comm: one P2P hop between ranks.
  double k = 1;               ///< round-trip copy time / (T_F + T_B + T_W); gives T_O = k(T_F+T_B+T_W)/2.
  double t_o = 0;             ///< one-way copy of one unit; when > 0 it overrides k.
  bool stagger_pairs = true;  ///< ranks r and r^1 share a PCIe switch: stagger their copy slots.
  /// Copy streams of a rank: 1, offloads and reloads in turn on one stream (docs/design.md
  /// section 3); 2, offloads on one and reloads on another, so that the two directions of a
  /// full-duplex link overlap (a rank without a PCIe partner may then offload and reload in
  /// the same slot; a reload still follows every copy listed before it).
  int copy_streams = 1;
  /// With two copy streams: a copy's time while the other direction copies too, over its time
  /// alone (>= 1; an H100 SXM measured 55 GB/s one way, 41.9 each way both at once: 1.31).
  /// T_O and the slot length include it.
  double duplex_slowdown = 1;
  std::vector<double> stage_f,     ///< per-stage T_F (size S or empty).
      stage_b,                     ///< per-stage T_B (size S or empty).
      stage_w;                     ///< per-stage T_W (size S or empty).
  std::vector<double> unit_bytes;  ///< per-stage unit size (size S or empty = 1).
  /// Per-stage stash size (size S or empty = none): what a split B leaves for its W, alive
  /// from the B's start to the W's end (a fused BW holds one while it runs), in unit_bytes' unit.
  std::vector<double> stash_bytes;
  /// Per stage (size S or empty): the parts its unit reloads in, in the order its B reads
  /// them (the layer's saved_parts, layer.hpp; po::saved_part_shares), each as its share of the
  /// unit's bytes; none or one: the unit reloads whole. A B may start once the first part is
  /// back; a part's share of the copy and of the B's work is taken to be its share of the
  /// bytes, which puts the B's earliest start reload_overlap before its reload ends
  /// (docs/design.md section 3).
  std::vector<std::vector<double>> reload_shares;

  /// T_F of stage s (stage_f[s], or f when stage_f is empty).
  constexpr double F(int s) const { return stage_f.empty() ? f : stage_f[static_cast<std::size_t>(s)]; }
  /// T_B of stage s (stage_b[s], or b when stage_b is empty).
  constexpr double B(int s) const { return stage_b.empty() ? b : stage_b[static_cast<std::size_t>(s)]; }
  /// T_W of stage s (stage_w[s], or w when stage_w is empty).
  constexpr double W(int s) const { return stage_w.empty() ? w : stage_w[static_cast<std::size_t>(s)]; }
  /// Size of stage s's unit (unit_bytes[s], or 1 when unit_bytes is empty).
  constexpr double bytes(int s) const { return unit_bytes.empty() ? 1.0 : unit_bytes[static_cast<std::size_t>(s)]; }
  /// Size of stage s's stash (stash_bytes[s], or 0 when stash_bytes is empty).
  constexpr double stash(int s) const { return stash_bytes.empty() ? 0.0 : stash_bytes[static_cast<std::size_t>(s)]; }
  /// Parts stage s's unit reloads in (1 when it reloads whole).
  constexpr int parts(int s) const {
    return reload_shares.empty()
               ? 1
               : std::max<int>(1, static_cast<int>(reload_shares[static_cast<std::size_t>(s)].size()));
  }
  /// How long before the end of its own reload a B (or BW) of stage s may start. Part i is back
  /// a (1 - c_i) T_O before the reload ends (c_i: the shares of parts 0..i) and the B reaches it
  /// after a c_(i-1) share of its T_B, so it starts no earlier than the least of
  /// (1 - c_i) T_O + c_(i-1) T_B before the reload ends (the last term: the B's work after its
  /// last part). Equal parts: min(T_O, T_B)(1 - 1/parts). 0 for a unit reloaded whole.
  constexpr double reload_overlap(int s) const {
    if (parts(s) <= 1) return 0.0;
    const std::vector<double>& sh = reload_shares[static_cast<std::size_t>(s)];
    double total = 0;
    for (double x : sh) total += x;
    const double t = T_O(s), b = B(s);
    double done = 0, best = 1e308;
    for (double x : sh) {
      const double before = done / total;
      done += x;
      best = std::min(best, (1.0 - done / total) * t + before * b);
    }
    return std::max(0.0, best);
  }
  /// One-way copy time of stage s's unit.
  constexpr double T_O(int s) const {
    return (t_o > 0 ? t_o : k * (F(s) + B(s) + W(s)) / 2) * (copy_streams == 2 ? duplex_slowdown : 1.0);
  }
  /// Offloads and reloads run on streams of their own (copy_streams == 2).
  constexpr bool duplex() const { return copy_streams == 2; }
};

/// How many blocks each part of po::stacked_saved_parts holds for a stage of `blocks` blocks
/// (and a head's part, if `head`): 1, or as many as keep its parts within max_reload_parts.
constexpr int blocks_per_saved_part(int blocks, bool head) {
  const int room = max_reload_parts - (head ? 1 : 0);
  return blocks <= room ? 1 : (blocks + room - 1) / room;
}

/// Costs::reload_shares of a stage of `blocks` blocks of `block_bytes` each and a head of
/// `head_bytes` (0: none) whose parts are po::stacked_saved_parts' (the sample models'): the
/// head's share, then the blocks' from the last down; none when it has fewer than two parts.
constexpr std::vector<double> stacked_reload_shares(int blocks, double block_bytes, double head_bytes) {
  std::vector<double> out;
  const double total = blocks * block_bytes + head_bytes;
  if (!(total > 0)) return out;
  if (head_bytes > 0) out.push_back(head_bytes / total);
  if (block_bytes > 0) {
    const int per = blocks_per_saved_part(blocks, head_bytes > 0);
    for (int top = blocks; top > 0; top -= per) out.push_back((top > per ? per : top) * block_bytes / total);
  }
  if (out.size() < 2) out.clear();
  return out;
}

/// A pass on a rank's compute stream (F, B, W, BW) or copy stream (O: device->host offload,
/// R: host->device reload).
enum class OpKind : std::uint8_t { F, B, W, BW, O, R };

/// The pass's letter(s): "F", "B", "W", "BW", "O" or "R".
constexpr const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::F:
      return "F";
    case OpKind::B:
      return "B";
    case OpKind::W:
      return "W";
    case OpKind::BW:
      return "BW";
    case OpKind::O:
      return "O";
    case OpKind::R:
      return "R";
  }
  return "?";
}

/// One op of one stream. `wait` is the cross-stream edge: the op may start only after the
/// other stream of the same rank has finished its ops 0..wait (-1: no edge). Both streams run
/// in order, so one index is all an edge needs (docs/design.md section 3).
/// Packed in 12 bytes (a schedule holds millions of ops): stage is a 24-bit field, enough for
/// any stage of an allowed shape (S <= max_ranks * max_chunks = 2^20).
struct Op {
  OpKind kind : 8 = OpKind::F;  ///< which pass (F, B, W, BW on compute; O, R on copy)
  int stage : 24 = 0;           ///< the stage it runs, 0 .. S-1
  int mb = 0;                   ///< the microbatch, 0 .. m-1
  int wait = -1;                ///< last op of the rank's other stream that must finish first (-1: none)

  /// Field-by-field equality.
  friend constexpr bool operator==(const Op&, const Op&) = default;
};

/// Direction of a P2P message: activations forward, gradients backward.
enum class Dir : std::uint8_t { forward, backward };

/// One entry of a rank's P2P plan. The tag is (stage, mb, dir) with `stage` the stage that
/// consumes the message; the peer is the rank of the stage that produces (recv) or consumes
/// (send) it.
/// Packed in 12 bytes: peer is a 31-bit field and mb a 24-bit one, enough for any allowed
/// shape (max_ranks, max_microbatches).
struct CommOp {
  bool send : 1 = false;       ///< send (true) or receive (false)
  int peer : 31 = 0;           ///< the other rank of the message
  int stage = 0;               ///< the stage that consumes the message
  int mb : 24 = 0;             ///< the microbatch, 0 .. m-1
  Dir dir : 8 = Dir::forward;  ///< activations (forward) or gradients (backward)

  /// Field-by-field equality.
  friend constexpr bool operator==(const CommOp&, const CommOp&) = default;
};

/// One rank's program: compute stream, copy stream, and P2P plan, each in execution order.
struct RankProgram {
  std::vector<Op> compute;           ///< the compute stream's ops: F, B, W, BW
  std::vector<Op> copy;              ///< the copy stream's ops: O, R
  std::vector<long long> copy_slot;  ///< planned slot of each copy op (slot n = [n*T, (n+1)*T)).
  double slot_length = 0;            ///< T of this rank's copy-slot grid (its largest T_O).
  std::vector<CommOp> comm;          ///< the P2P plan: sends and receives
};

/// A built schedule: what a schedule type produces for a shape and cost model.
struct Program {
  ScheduleSpec spec{};             ///< the schedule that was built (family, group, offload, placement).
  Shape shape{};                   ///< d, v, m and the placement it was built for.
  int group = 0;                   ///< resolved g for grouped families (1 for PO), 0 otherwise.
  Costs costs{};                   ///< the cost model it was built with.
  std::vector<RankProgram> ranks;  ///< one program per rank, d of them.

  /// Ranks (shape.d).
  constexpr int d() const { return shape.d; }
  /// Chunks per rank (shape.v).
  constexpr int v() const { return shape.v; }
  /// Microbatches per iteration (shape.m).
  constexpr int m() const { return shape.m; }
  /// Stages, S = d*v.
  constexpr int stages() const { return shape.stages(); }
};

/// Fused backward? (1F1B and 1F1B-I fuse B and W into BW; every other family splits them.)
constexpr bool fused_backward(Family f) { return f == Family::one_f1b || f == Family::interleaved_1f1b; }

/// Number of forwards a rank runs before its first B (or BW).
constexpr int warmup(const RankProgram& rp) {
  int n = 0;
  for (const Op& op : rp.compute) {
    if (op.kind == OpKind::B || op.kind == OpKind::BW) break;
    if (op.kind == OpKind::F) ++n;
  }
  return n;
}

/// A schedule's name (the plan tool's and train_gpt's --schedule) and its spec.
struct NamedSchedule {
  std::string_view name;  ///< as --schedule takes it: lower case, words joined by '-'
  ScheduleSpec spec;      ///< gis-g's group size is parse_schedule's argument (0 here)
};

/// Every named schedule, the paper's first: the one table that parse_schedule, schedule_name
/// and schedule_names read (schedule.hpp checks each alias's spec against it).
inline constexpr std::array<NamedSchedule, 14> named_schedules{{
    {"1f1b", {Family::one_f1b}},
    {"1f1b-i", {Family::interleaved_1f1b}},
    {"gis", {Family::grouped}},
    {"gis-h", {Family::grouped, {GroupSpec::Kind::half}}},
    {"gis-g", {Family::grouped, {GroupSpec::Kind::number}}},
    {"po", {Family::grouped, {GroupSpec::Kind::uniform, 1}}},
    {"po-h", {Family::grouped, {GroupSpec::Kind::uniform, 1}, offload::half}},
    {"po-f", {Family::grouped, {GroupSpec::Kind::uniform, 1}, offload::all}},
    {"zb-h1", {Family::zb_h1}},
    {"zb-h2", {Family::zb_h2}},
    {"zb-v", {Family::zb_v, {}, offload::none, Placement::vshape}},
    {"v-half", {Family::v_half, {}, offload::none, Placement::vshape}},
    {"v-min", {Family::v_min, {}, offload::none, Placement::vshape}},
    {"dualpipe-v", {Family::dualpipe_v, {}, offload::none, Placement::vshape}},
}};

/// The entry of named_schedules called `name`, or nullptr.
constexpr const NamedSchedule* find_schedule(std::string_view name) {
  for (const NamedSchedule& e : named_schedules)
    if (e.name == name) return &e;
  return nullptr;
}

/// The names of named_schedules, comma-separated (for messages and usage lines).
constexpr std::string schedule_names() {
  std::string out;
  for (const NamedSchedule& e : named_schedules) out += (out.empty() ? "" : ", ") + std::string(e.name);
  return out;
}

/// The plan tool's name of a spec: its entry in named_schedules (the grouped family's by its
/// group rule); an offload other than the entry's own is appended as "+offload(...)".
constexpr std::string schedule_name(const ScheduleSpec& s, int v = 0) {
  std::string base;
  for (const NamedSchedule& e : named_schedules) {
    if (e.spec.family != s.family || (s.family == Family::grouped && e.spec.group.kind != s.group.kind)) continue;
    if (e.spec.offload == s.offload) return std::string(e.name);
    if (e.spec.offload == offload::none) base = e.name;
  }
  const int n = v > 0 ? offload::count(s.offload, v) : -1;
  switch (s.offload.kind) {
    case offload::selection::Kind::none:
      return base;
    case offload::selection::Kind::half:
      return base + "+offload(half)";
    case offload::selection::Kind::all:
      return base + "+offload(all)";
    case offload::selection::Kind::first:
      return base + "+offload(first " + detail::num(s.offload.n) + ")";
    case offload::selection::Kind::set:
      return base + "+offload(" + (n >= 0 ? detail::num(n) + " chunks" : std::string("set")) + ")";
  }
  return base;
}

}  // namespace pipeoffload
