// pipeoffload/schedule/torch_csv.hpp: schedules exchanged with torch.distributed.pipelining's CSV form.
//
// The format: one row per rank (row 1 is rank 0), one action per cell, cells separated by
// commas. A compute action is `{stage}{kind}{mb}` with kind F (forward), I (input-gradient
// backward, our B), W (weight backward) or B (fused backward, our BW). The lowered form adds
// the P2P actions, named as torch names them, by the stage that runs the action:
//   `{s}SEND_F{mb}`  stage s sends its forward output to stage s + 1,
//   `{s}RECV_F{mb}`  stage s receives its forward input from stage s - 1,
//   `{s}SEND_B{mb}`  stage s sends its input gradient to stage s - 1,
//   `{s}RECV_B{mb}`  stage s receives its output gradient from stage s + 1.
// (A CommOp's `stage` is the consuming stage: a forward send to stage c is `{c-1}SEND_F`, a
// backward send to stage c is `{c+1}SEND_B`; receives carry the consumer's own stage.)
// Offload and reload (O/R) have no torch action: only compute and P2P actions are exported,
// and import adds offload again through the offload placement when asked.
/// @file
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"
#include "build.hpp"
#include "validate.hpp"

namespace pipeoffload {

/// torch's CSV text of `p`: one row per rank, `\n` after each row. Compute actions in each
/// rank's compute order (F, I for B, W, B for BW); with `lowered`, also its P2P actions, each
/// send right after the pass that produces it and each receive where the rank's comm order
/// posts it (always before the pass that consumes it). Copy ops are not exported.
/// @code
///   const pipeoffload::Program p = pipeoffload::OneF1B::build({2, 1, 2});
///   const std::string csv = pipeoffload::to_torch_csv(p);  // "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
/// @endcode
inline std::string to_torch_csv(const Program& p, bool lowered = false) {
  const auto compute_cell = [](const Op& op) {
    const char* kind = op.kind == OpKind::F ? "F" : op.kind == OpKind::B ? "I" : op.kind == OpKind::W ? "W" : "B";
    return std::to_string(op.stage) + kind + std::to_string(op.mb);
  };
  const auto comm_cell = [](const CommOp& c) {
    const bool fwd = c.dir == Dir::forward;
    const int stage = c.send ? (fwd ? c.stage - 1 : c.stage + 1) : c.stage;
    const char* kind = c.send ? (fwd ? "SEND_F" : "SEND_B") : (fwd ? "RECV_F" : "RECV_B");
    return std::to_string(stage) + kind + std::to_string(c.mb);
  };
  std::string out;
  for (const RankProgram& rp : p.ranks) {
    std::vector<std::string> cells;
    std::size_t x = 0;
    if (lowered) {
      for (const CommOp& c : rp.comm) {
        if (c.send) {
          // Emit compute ops up to and including the one that produces this message.
          const bool fwd = c.dir == Dir::forward;
          const int producer = fwd ? c.stage - 1 : c.stage + 1;
          std::size_t y = x;
          while (y < rp.compute.size()) {
            const Op& op = rp.compute[y];
            const bool match = op.stage == producer && op.mb == c.mb &&
                               (fwd ? op.kind == OpKind::F : (op.kind == OpKind::B || op.kind == OpKind::BW));
            ++y;
            if (match) break;
          }
          for (; x < y; ++x) cells.push_back(compute_cell(rp.compute[x]));
        }
        cells.push_back(comm_cell(c));
      }
    }
    for (; x < rp.compute.size(); ++x) cells.push_back(compute_cell(rp.compute[x]));
    for (std::size_t i = 0; i < cells.size(); ++i) {
      if (i > 0) out += ',';
      out += cells[i];
    }
    out += '\n';
  }
  return out;
}

/// What from_torch_csv() may be told instead of inferring it, and what it adds.
struct TorchCsvOptions {
  int d = 0;                                   ///< ranks; 0: the number of rows.
  int v = 0;                                   ///< chunks per rank; 0: (largest stage + 1) / d.
  int m = 0;                                   ///< microbatches; 0: largest microbatch + 1.
  std::optional<Placement> placement;          ///< empty: inferred (interleaved if it fits, else V).
  offload::selection offload = offload::none;  ///< offload added by the offload placement.
  Costs costs{};                               ///< the cost model of the planning timeline.
};

namespace detail {

/// One parsed cell of a torch CSV.
struct TorchAction {
  enum class Kind : std::uint8_t { F, I, W, B, send_f, recv_f, send_b, recv_b } kind = Kind::F;
  long long stage = 0, mb = 0;
  int row = 0, cell = 0;  // 1-based
};

inline std::string csv_where(int row, int cell) {
  return "row " + std::to_string(row) + " (rank " + std::to_string(row - 1) + "), cell " + std::to_string(cell);
}

inline std::string csv_printable(std::string_view s) {
  std::string t;
  for (char c : s.substr(0, 40)) t += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (s.size() > 40) t += "...";
  return t;
}

/// Parses `{stage}{kind}{mb}`; false if the cell is not one action.
inline bool parse_torch_action(std::string_view s, TorchAction& a) {
  constexpr long long cap = 1LL << 40;  // numbers saturate here: out of range anyway
  const auto number = [&](std::size_t& i, long long& out) {
    const std::size_t start = i;
    out = 0;
    for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) out = std::min(cap, out * 10 + (s[i] - '0'));
    return i > start;
  };
  std::size_t i = 0;
  if (!number(i, a.stage)) return false;
  constexpr std::pair<std::string_view, TorchAction::Kind> kinds[] = {
      {"SEND_F", TorchAction::Kind::send_f}, {"RECV_F", TorchAction::Kind::recv_f},
      {"SEND_B", TorchAction::Kind::send_b}, {"RECV_B", TorchAction::Kind::recv_b},
      {"F", TorchAction::Kind::F},           {"I", TorchAction::Kind::I},
      {"W", TorchAction::Kind::W},           {"B", TorchAction::Kind::B}};
  bool found = false;
  for (const auto& [name, kind] : kinds)
    if (s.substr(i, name.size()) == name) {
      a.kind = kind;
      i += name.size();
      found = true;
      break;
    }
  if (!found || !number(i, a.mb)) return false;
  return i == s.size();
}

}  // namespace detail

/// A Program from torch's CSV text (see the top of this file). Infers d (rows), S (largest
/// stage + 1), v = S / d, m (largest microbatch + 1) and the placement (interleaved, else V)
/// unless `opt` gives them, and fused or split backward from the actions. The compute lists
/// follow the file's order; P2P actions of a lowered file are checked for form and range and
/// then ignored: the P2P plan is re-planned on the file's ASAP timeline under `opt.costs`
/// (as build() does for every family but PO), and `opt.offload` adds offload with build()'s
/// placement. The spec is a convention, since the file names no family: split backward is
/// Family::grouped with group {number, 0} (group 0: no group), fused is one_f1b (v = 1) or
/// interleaved_1f1b (v > 1); placement and offload are the imported ones. Throws
/// schedule_error, one sentence naming the row (rank) and cell (1-based) where one is at
/// fault: a cell that does not parse, a stage or microbatch out of range, a duplicated or
/// missing pass, a pass on a rank that does not hold its stage, fused mixed with split
/// backward, a pass before the one it needs on its own rank, an order that deadlocks; and
/// validate()'s message if the result does not validate.
/// @code
///   const pipeoffload::Program p = pipeoffload::from_torch_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
///   // p.d() == 2, p.m() == 2, fused backward, valid
/// @endcode
inline Program from_torch_csv(std::string_view text, const TorchCsvOptions& opt = {}) {
  using detail::csv_where;
  using Kind = detail::TorchAction::Kind;
  const auto fail = [](const std::string& msg) { throw schedule_error(msg); };
  // Rows: lines, without a trailing '\r'; trailing empty lines dropped.
  std::vector<std::string_view> rows;
  for (std::size_t start = 0; start <= text.size();) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    rows.push_back(line);
    start = end + 1;
  }
  const auto blank = [](std::string_view s) { return s.find_first_not_of(" \t") == std::string_view::npos; };
  while (!rows.empty() && blank(rows.back())) rows.pop_back();
  if (rows.empty()) fail("the torch CSV has no rows (one row per rank is needed)");
  if (rows.size() > static_cast<std::size_t>(max_ranks))
    fail("the torch CSV has " + std::to_string(rows.size()) + " rows; at most " + std::to_string(max_ranks) +
         " ranks are allowed");
  const int d = opt.d > 0 ? opt.d : static_cast<int>(rows.size());
  if (d != static_cast<int>(rows.size()))
    fail("the torch CSV has " + std::to_string(rows.size()) + " rows, but d = " + std::to_string(d) +
         " ranks were given (one row per rank)");
  // Cells.
  std::vector<std::vector<detail::TorchAction>> acts(static_cast<std::size_t>(d));
  long long max_stage = -1, max_mb = -1;
  const long long stage_limit = static_cast<long long>(max_ranks) * max_chunks;
  const detail::TorchAction* fused_at = nullptr;
  const detail::TorchAction* split_at = nullptr;
  for (int r = 0; r < d; ++r) {
    std::string_view line = rows[static_cast<std::size_t>(r)];
    int cell = 0;
    for (std::size_t start = 0; start <= line.size();) {
      std::size_t end = line.find(',', start);
      if (end == std::string_view::npos) end = line.size();
      std::string_view s = line.substr(start, end - start);
      start = end + 1;
      ++cell;
      while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
      while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
      if (s.empty()) continue;  // an empty cell is no action
      detail::TorchAction a;
      if (!detail::parse_torch_action(s, a))
        fail(csv_where(r + 1, cell) + ": '" + detail::csv_printable(s) +
             "' is not a torch action ({stage}F|I|W|B{mb} or {stage}SEND_F|RECV_F|SEND_B|RECV_B{mb})");
      a.row = r + 1;
      a.cell = cell;
      if (a.stage >= stage_limit)
        fail(csv_where(a.row, a.cell) + ": stage " + std::to_string(a.stage) + " is out of range (at most " +
             std::to_string(stage_limit - 1) + ")");
      if (a.mb >= max_microbatches)
        fail(csv_where(a.row, a.cell) + ": microbatch " + std::to_string(a.mb) + " is out of range (at most " +
             std::to_string(max_microbatches - 1) + ")");
      acts[static_cast<std::size_t>(r)].push_back(a);
    }
  }
  for (const auto& row : acts)
    for (const detail::TorchAction& a : row) {
      if (a.kind > Kind::B) continue;
      max_stage = std::max(max_stage, a.stage);
      max_mb = std::max(max_mb, a.mb);
      if (a.kind == Kind::B && !fused_at) fused_at = &a;
      if ((a.kind == Kind::I || a.kind == Kind::W) && !split_at) split_at = &a;
    }
  if (max_stage < 0) fail("the torch CSV has no compute action (F, I, W or B) in any row");
  if (fused_at && split_at) {
    const detail::TorchAction* later =
        std::pair(fused_at->row, fused_at->cell) > std::pair(split_at->row, split_at->cell) ? fused_at : split_at;
    const detail::TorchAction* other = later == fused_at ? split_at : fused_at;
    fail(csv_where(later->row, later->cell) + ": a " + (later == fused_at ? "fused (B)" : "split (I/W)") +
         " backward in a file whose " + csv_where(other->row, other->cell) + " is a " +
         (later == fused_at ? "split (I/W)" : "fused (B)") + " one; a schedule uses one or the other");
  }
  const bool fused = fused_at != nullptr;
  long long S = max_stage + 1;
  if (opt.v > 0) {
    S = static_cast<long long>(opt.v) * d;
  } else if (S % d != 0) {
    fail("the torch CSV's stages 0.." + std::to_string(S - 1) + " (" + std::to_string(S) +
         " stages) do not divide among " + std::to_string(d) +
         " rows (ranks): every rank holds the same number of stages");
  }
  const int v = static_cast<int>(S / d);
  if (v > max_chunks)
    fail("the torch CSV has " + std::to_string(v) + " stages per rank; at most " + std::to_string(max_chunks) +
         " are allowed");
  const int m = opt.m > 0 ? opt.m : static_cast<int>(max_mb + 1);
  if (m > max_microbatches)
    fail("m = " + std::to_string(m) + " microbatches is out of range (at most " + std::to_string(max_microbatches) +
         ")");
  // Ranges (given v or m) and placement.
  for (const auto& row : acts)
    for (const detail::TorchAction& a : row) {
      if (a.stage >= S)
        fail(csv_where(a.row, a.cell) + ": stage " + std::to_string(a.stage) + " is out of range (stages 0.." +
             std::to_string(S - 1) + ")");
      if (a.mb >= m)
        fail(csv_where(a.row, a.cell) + ": microbatch " + std::to_string(a.mb) + " is out of range (microbatches 0.." +
             std::to_string(m - 1) + ")");
    }
  Shape shape{d, v, m, Placement::interleaved};
  const auto first_misplaced = [&](Placement pl) -> const detail::TorchAction* {
    const Shape sh{d, v, m, pl};
    for (const auto& row : acts)
      for (const detail::TorchAction& a : row)
        if (sh.rank_of(static_cast<int>(a.stage)) != a.row - 1) return &a;
    return nullptr;
  };
  const auto misplaced = [&](const detail::TorchAction& a, const std::string& where) {
    const Shape il{d, v, m, Placement::interleaved}, vs{d, v, m, Placement::vshape};
    const int s = static_cast<int>(a.stage);
    fail(csv_where(a.row, a.cell) + ": stage " + std::to_string(s) + " cannot run on rank " +
         std::to_string(a.row - 1) + " " + where + " (it lives on rank " + std::to_string(il.rank_of(s)) +
         " interleaved, rank " + std::to_string(vs.rank_of(s)) + " as a V)");
  };
  if (opt.placement) {
    shape.placement = *opt.placement;
    if (const detail::TorchAction* a = first_misplaced(shape.placement))
      misplaced(*a, shape.placement == Placement::vshape ? "under the V placement given"
                                                         : "under the interleaved placement given");
  } else {
    const detail::TorchAction* ai = first_misplaced(Placement::interleaved);
    const detail::TorchAction* av = ai && v > 1 ? first_misplaced(Placement::vshape) : ai;
    if (!ai) {
      shape.placement = Placement::interleaved;
    } else if (!av) {
      shape.placement = Placement::vshape;
    } else {
      const detail::TorchAction* a = std::pair(ai->row, ai->cell) > std::pair(av->row, av->cell) ? ai : av;
      misplaced(*a, "under either placement");
    }
  }
  // Each pass once, in an order its own rank can run. Every unit needs a forward: with fewer
  // forwards than units, the first unit without one is reported before any table of all
  // units is made (a short file may name a huge shape).
  {
    std::vector<std::pair<long long, long long>> fs;  // (mb, stage) of every forward
    for (const auto& row : acts)
      for (const detail::TorchAction& a : row)
        if (a.kind == Kind::F) fs.emplace_back(a.mb, a.stage);
    if (static_cast<long long>(fs.size()) < S * m) {
      std::sort(fs.begin(), fs.end());
      fs.erase(std::unique(fs.begin(), fs.end()), fs.end());
      long long k = 0;
      while (k < static_cast<long long>(fs.size()) && fs[static_cast<std::size_t>(k)] == std::pair(k / S, k % S)) ++k;
      const int s = static_cast<int>(k % S), mb = static_cast<int>(k / S), row = shape.rank_of(s) + 1;
      fail("row " + std::to_string(row) + " (rank " + std::to_string(row - 1) + ") has no forward " +
           std::to_string(s) + "F" + std::to_string(mb) + " of stage " + std::to_string(s) + ", microbatch " +
           std::to_string(mb));
    }
  }
  const auto S_ = static_cast<std::size_t>(S);
  const auto unit = [&](const detail::TorchAction& a) {
    return static_cast<std::size_t>(a.stage) + S_ * static_cast<std::size_t>(a.mb);
  };
  const std::size_t units = S_ * static_cast<std::size_t>(m);
  // Per unit and compute kind (F, I/B, W): the action that runs it, or none.
  std::vector<const detail::TorchAction*> at(units * 3, nullptr);
  const auto slot = [](Kind k) { return k == Kind::F ? 0 : k == Kind::W ? 2 : 1; };
  const auto name = [](const detail::TorchAction& a) {
    static constexpr const char* names[] = {"F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
    return std::to_string(a.stage) + names[static_cast<int>(a.kind)] + std::to_string(a.mb);
  };
  for (const auto& row : acts)
    for (const detail::TorchAction& a : row) {
      if (a.kind > Kind::B) {
        const bool bad = (a.kind == Kind::send_f && a.stage == S - 1) || (a.kind == Kind::recv_f && a.stage == 0) ||
                         (a.kind == Kind::send_b && a.stage == 0) || (a.kind == Kind::recv_b && a.stage == S - 1);
        if (bad)
          fail(csv_where(a.row, a.cell) + ": " + name(a) + " names a message stage " + std::to_string(a.stage) +
               " cannot " + (a.kind == Kind::send_f || a.kind == Kind::send_b ? "send" : "receive") +
               " (the first or last stage)");
        continue;
      }
      const detail::TorchAction*& p = at[unit(a) * 3 + static_cast<std::size_t>(slot(a.kind))];
      if (p)
        fail(csv_where(a.row, a.cell) + ": " + name(a) + " is a second copy of the pass at " +
             csv_where(p->row, p->cell));
      p = &a;
    }
  for (std::size_t mb = 0; mb < static_cast<std::size_t>(m); ++mb)
    for (std::size_t s = 0; s < S_; ++s) {
      const std::size_t u = s + S_ * mb;
      const int row = shape.rank_of(static_cast<int>(s)) + 1;
      const auto missing = [&](const char* kind, const char* what) {
        fail("row " + std::to_string(row) + " (rank " + std::to_string(row - 1) + ") has no " + what + " " +
             std::to_string(s) + kind + std::to_string(mb) + " of stage " + std::to_string(s) + ", microbatch " +
             std::to_string(mb));
      };
      if (!at[u * 3]) missing("F", "forward");
      if (!at[u * 3 + 1]) fused ? missing("B", "backward") : missing("I", "input-gradient backward");
      if (!fused && !at[u * 3 + 2]) missing("W", "weight backward");
      const detail::TorchAction* f = at[u * 3];
      const detail::TorchAction* b = at[u * 3 + 1];
      const detail::TorchAction* w = at[u * 3 + 2];
      if (b->cell < f->cell)
        fail(csv_where(b->row, b->cell) + ": " + name(*b) + " comes before its forward " + name(*f) + " (cell " +
             std::to_string(f->cell) + ")");
      if (w && w->cell < b->cell)
        fail(csv_where(w->row, w->cell) + ": " + name(*w) + " comes before its input-gradient backward " + name(*b) +
             " (cell " + std::to_string(b->cell) + ")");
    }
  // Deadlock: run the compute orders untimed; a pass waits for the previous stage's forward
  // (F) or the next stage's backward (I/B) of its microbatch.
  {
    std::vector<char> done(units * 3, 0);
    std::vector<std::size_t> head(static_cast<std::size_t>(d), 0);
    const auto need = [&](const detail::TorchAction& a) -> const detail::TorchAction* {
      if (a.kind == Kind::F && a.stage > 0) {
        const std::size_t u = unit(a) - 1;
        return done[u * 3] ? nullptr : at[u * 3];
      }
      if ((a.kind == Kind::I || a.kind == Kind::B) && a.stage < S - 1) {
        const std::size_t u = unit(a) + 1;
        return done[u * 3 + 1] ? nullptr : at[u * 3 + 1];
      }
      return nullptr;
    };
    // A rank runs until a pass waits for one of another rank's; that pass has one waiter (the
    // next stage's F, the previous stage's I/B), woken when it runs.
    std::vector<int> waiter(units * 3, -1), ready(static_cast<std::size_t>(d));
    for (int r = 0; r < d; ++r) ready[static_cast<std::size_t>(r)] = d - 1 - r;
    while (!ready.empty()) {
      const auto r = static_cast<std::size_t>(ready.back());
      ready.pop_back();
      const auto& row = acts[r];
      for (; head[r] < row.size(); ++head[r]) {
        const detail::TorchAction& a = row[head[r]];
        if (a.kind > Kind::B) continue;
        if (const detail::TorchAction* n = need(a)) {
          waiter[unit(*n) * 3 + static_cast<std::size_t>(slot(n->kind))] = static_cast<int>(r);
          break;
        }
        const std::size_t x = unit(a) * 3 + static_cast<std::size_t>(slot(a.kind));
        done[x] = 1;
        if (waiter[x] >= 0) ready.push_back(waiter[x]);
      }
    }
    for (std::size_t r = 0; r < acts.size(); ++r)
      if (head[r] < acts[r].size()) {
        const detail::TorchAction& a = acts[r][head[r]];
        const detail::TorchAction* n = need(a);
        fail(csv_where(a.row, a.cell) + ": " + name(a) + " waits for " + name(*n) + " at " +
             csv_where(n->row, n->cell) + ", which never runs before it (the order deadlocks)");
      }
  }
  // The Program.
  Program p;
  p.spec.family = fused ? (v == 1 ? Family::one_f1b : Family::interleaved_1f1b) : Family::grouped;
  p.spec.group = fused ? GroupSpec{} : GroupSpec{GroupSpec::Kind::number, 0};
  p.spec.offload = opt.offload;
  p.spec.placement = shape.placement;
  p.shape = shape;
  p.group = 0;
  try {
    detail::check_costs(opt.costs, shape);
    if (opt.offload.kind == offload::selection::Kind::set && v < 64 && (opt.offload.mask >> v) != 0)
      throw shape_error("offload::chunks: a listed chunk index is >= v = " + std::to_string(v));
  } catch (const shape_error& e) {
    fail(std::string("the import options do not fit the file: ") + e.what());
  }
  p.costs = opt.costs;
  p.ranks.resize(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) {
    auto& comp = p.ranks[static_cast<std::size_t>(r)].compute;
    for (const detail::TorchAction& a : acts[static_cast<std::size_t>(r)]) {
      if (a.kind > Kind::B) continue;
      const OpKind k = a.kind == Kind::F   ? OpKind::F
                       : a.kind == Kind::I ? OpKind::B
                       : a.kind == Kind::W ? OpKind::W
                                           : OpKind::BW;
      comp.push_back(Op{k, static_cast<int>(a.stage), static_cast<int>(a.mb), -1});
    }
  }
  // Planning timeline, offload, P2P plan: as build() does for its ASAP-planned families.
  std::vector<std::vector<double>> ps(static_cast<std::size_t>(d)), pe(static_cast<std::size_t>(d));
  std::vector<detail::TimesOut> out(static_cast<std::size_t>(d));
  for (std::size_t r = 0; r < ps.size(); ++r) {
    ps[r].resize(p.ranks[r].compute.size());
    out[r].compute_start = ps[r].data();
  }
  const std::vector<double> dur = detail::duration_table(p.costs, shape.stages());
  std::vector<detail::UnitEnds> ends = detail::asap_scratch(p);
  detail::asap_into<false>(p, p.costs, dur, out.data(), ends);
  for (std::size_t r = 0; r < ps.size(); ++r) {
    const auto& comp = p.ranks[r].compute;
    pe[r].resize(comp.size());
    for (std::size_t x = 0; x < comp.size(); ++x) pe[r][x] = ps[r][x] + detail::table_duration(dur.data(), comp[x]);
  }
  if (offload::count(opt.offload, v) > 0) {
    detail::OffloadScratch scratch;
    for (int r = 0; r < d; ++r)
      detail::place_offloads(p, r, ps[static_cast<std::size_t>(r)], pe[static_cast<std::size_t>(r)], scratch);
  }
  const auto end = [&](int rank, std::size_t x, const Op&) { return pe[static_cast<std::size_t>(rank)][x]; };
  for (int r = 0; r < d; ++r) detail::plan_p2p_rank(p, r, end);
  if (const Validation ok = validate(p); !ok) fail("the imported schedule does not validate: " + ok.error);
  return p;
}

}  // namespace pipeoffload
