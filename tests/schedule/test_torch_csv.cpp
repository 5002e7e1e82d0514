// tests/schedule/test_torch_csv.cpp: schedules exchanged with torch.distributed.pipelining's CSV
// form (schedule/torch_csv.hpp): round trips for every family, hand-written orders, one-sentence
// errors naming row and cell, and a seeded fuzz test of random and mutated files.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include <pipeoffload/pipeoffload.hpp>

using namespace pipeoffload;

namespace {

struct Case {
  const char* name;
  Shape shape;
};

// Every family on a few shapes.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int d : {1, 2, 3, 4}) {
    for (int m : {d, 2 * d + 1}) {
      for (const char* n : {"1f1b", "zb-h1", "zb-h2"}) out.push_back({n, {d, 1, m}});
      for (const char* n : {"zb-v", "v-half", "v-min"}) out.push_back({n, {d, 2, m}});
      if (m >= 2 * d) out.push_back({"dualpipe-v", {d, 2, m}});
      for (const char* n : {"gis", "gis-h", "po", "po-h", "po-f"}) out.push_back({n, {d, 2, m}});
      out.push_back({"po-f", {d, 3, m}});
    }
    out.push_back({"1f1b-i", {d, 2, 2 * d}});
    out.push_back({"1f1b-i", {d, 3, 3 * d}});
  }
  return out;
}

void same_compute(const Program& a, const Program& b) {
  REQUIRE(a.ranks.size() == b.ranks.size());
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const auto& x = a.ranks[r].compute;
    const auto& y = b.ranks[r].compute;
    REQUIRE(x.size() == y.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      CHECK(x[i].kind == y[i].kind);
      CHECK(x[i].stage == y[i].stage);
      CHECK(x[i].mb == y[i].mb);
    }
  }
}

std::string error_of(std::string_view text, const TorchCsvOptions& opt = {}) {
  try {
    (void)from_torch_csv(text, opt);
  } catch (const schedule_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("torch CSV: export writes one row per rank with torch's action names") {
  const Program p = OneF1B::build({2, 1, 2});
  CHECK(to_torch_csv(p) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
  CHECK(to_torch_csv(p, true) ==
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1\n"
        "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
  const Program z = ZB_H1::build({2, 1, 1});
  CHECK(to_torch_csv(z) == "0F0,0I0,0W0\n1F0,1I0,1W0\n");
}

TEST_CASE("torch CSV: export -> import gives the same compute lists, plan and simulation for every family") {
  for (const Case& c : cases()) {
    CAPTURE(c.name);
    CAPTURE(c.shape.d);
    CAPTURE(c.shape.v);
    CAPTURE(c.shape.m);
    const ScheduleSpec spec = parse_schedule(c.name);
    const Program p = build(spec, c.shape);
    for (bool lowered : {false, true}) {
      TorchCsvOptions opt;
      opt.offload = spec.offload;
      const Program q = from_torch_csv(to_torch_csv(p, lowered), opt);
      CHECK(q.d() == p.d());
      CHECK(q.v() == p.v());
      CHECK(q.m() == p.m());
      CHECK(fused_backward(q.spec.family) == fused_backward(p.spec.family));
      // With one rank both placements put every stage on it: import says interleaved.
      if (p.d() > 1) CHECK(q.shape.placement == p.shape.placement);
      same_compute(p, q);
      CHECK(validate(q));
      CHECK(to_torch_csv(q) == to_torch_csv(p));
      const bool asap_planned = offload::count(spec.offload, c.shape.v) == 0 &&
                                !(spec.family == Family::grouped && spec.group.kind == GroupSpec::Kind::uniform);
      if (asap_planned) {
        // build() plans these on the same ASAP timeline: the same P2P plan and simulation.
        for (std::size_t r = 0; r < p.ranks.size(); ++r) CHECK(q.ranks[r].comm == p.ranks[r].comm);
        const SimResult a = simulate(p), b = simulate(q);
        CHECK(a.makespan == b.makespan);
        CHECK(a.max_peak() == b.max_peak());
      }
    }
  }
}

TEST_CASE("torch CSV: a hand-written GPipe order imports and validates") {
  for (int d = 2; d <= 4; ++d)
    for (bool fused : {true, false}) {
      const int m = 2 * d;
      std::string text;
      for (int r = 0; r < d; ++r) {
        std::string row;
        for (int mb = 0; mb < m; ++mb) row += std::to_string(r) + "F" + std::to_string(mb) + ",";
        for (int mb = 0; mb < m; ++mb) row += std::to_string(r) + (fused ? "B" : "I") + std::to_string(mb) + ",";
        if (!fused)
          for (int mb = 0; mb < m; ++mb) row += std::to_string(r) + "W" + std::to_string(mb) + ",";
        row.pop_back();
        text += row + "\n";
      }
      CAPTURE(text);
      const Program p = from_torch_csv(text);
      CHECK(p.shape == Shape{d, 1, m, Placement::interleaved});
      CHECK(fused_backward(p.spec.family) == fused);
      CHECK(validate(p));
      CHECK(simulate(p).ranks[0].peak == m);
      // With offload of its one chunk: still valid.
      TorchCsvOptions opt;
      opt.offload = offload::all;
      const Program o = from_torch_csv(text, opt);
      CHECK(validate(o));
      same_compute(p, o);
    }
}

TEST_CASE("torch CSV: bad files throw one sentence naming row and cell") {
  const auto has = [](const std::string& msg, const char* part) {
    CAPTURE(msg);
    CHECK(msg.find(part) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  };
  has(error_of("0F0,0X0,0B0\n1F0,1B0\n"), "row 1 (rank 0), cell 2: '0X0' is not a torch action");
  has(error_of("0F0,0B0\n1F0,1B0,1F0\n"), "row 2 (rank 1), cell 3: 1F0 is a second copy of the pass at row 2");
  has(error_of("0F0,0B0\n1F0\n"), "row 2 (rank 1) has no backward 1B0");
  has(error_of("0F0,0B0\n1F0,1I0,1W0\n"), "row 2 (rank 1), cell 2: a split (I/W) backward");
  has(error_of("1F0,0B0\n0F0,1B0\n"), "cannot run on rank");
  has(error_of("0F0,0B0\n1B0,1F0\n"), "row 2 (rank 1), cell 1: 1B0 comes before its forward 1F0");
  has(error_of("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"), "deadlocks");
  has(error_of("0F99999999999999999999,0B0\n1F0,1B0\n"), "row 1 (rank 0), cell 1: microbatch");
  has(error_of("0F0,0B0\n1F0,1B0\n3F0\n"), "do not divide");
  has(error_of(""), "no rows");
  has(error_of("0F0,0B0,0F1\n1F0,1B0\n",
               [] {
                 TorchCsvOptions o;
                 o.d = 2;
                 o.v = 1;
                 o.m = 1;
                 return o;
               }()),
      "row 1 (rank 0), cell 3: microbatch 1 is out of range");
  CHECK(error_of("0F0, 0B0,\n1F0,,1B0\r\n\n").empty());  // spaces, empty cells, CRLF, trailing blank rows
}

TEST_CASE("torch CSV: fuzz: random and mutated files end in a valid Program or one sentence") {
  std::mt19937 rng(20261124);
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  std::vector<std::string> seeds;
  for (const char* n : {"1f1b", "zb-h1", "zb-v", "po-f", "1f1b-i"})
    for (int d : {1, 2, 3}) {
      const ScheduleSpec s = parse_schedule(n);
      const int v = s.family == Family::one_f1b || s.family == Family::zb_h1 ? 1 : 2;
      const Program p = build(s, {d, v, 2 * d});
      seeds.push_back(to_torch_csv(p, d == 2));
    }
  const std::vector<std::string> pieces = {"F", "B",  "I", "W", "SEND_F",      "RECV_B", "0",  "1", "7",
                                           ",", "\n", "",  " ", "99999999999", "-1",     "\r", "x", "\x01"};
  int valid = 0, errors = 0;
  for (int it = 0; it < 4000; ++it) {
    std::string text;
    if (it % 10 == 0) {
      for (std::size_t k = pick(40); k > 0; --k) text += pieces[pick(pieces.size())];
    } else {
      // Cells of a seed, mutated a few times.
      std::vector<std::vector<std::string>> rows;
      const std::string& seed = seeds[pick(seeds.size())];
      std::vector<std::string> row;
      std::string cell;
      for (char ch : seed) {
        if (ch == ',' || ch == '\n') {
          row.push_back(cell);
          cell.clear();
          if (ch == '\n') {
            rows.push_back(row);
            row.clear();
          }
        } else {
          cell += ch;
        }
      }
      for (std::size_t k = 1 + pick(3); k > 0; --k) {
        auto& r = rows[pick(rows.size())];
        if (r.empty()) continue;
        const std::size_t a = pick(r.size()), b = pick(r.size());
        switch (pick(7)) {
          case 0:
            std::swap(r[a], r[b]);
            break;
          case 1:
            r.erase(r.begin() + static_cast<long>(a));
            break;
          case 2:
            r.insert(r.begin() + static_cast<long>(a), std::string(r[b]));
            break;
          case 3:
            r[a].insert(pick(r[a].size() + 1), 1, static_cast<char>(1 + pick(126)));
            break;
          case 4:
            r[a] = "0F" + std::string(1 + pick(30), '9');
            break;
          case 5:
            rows.insert(rows.begin() + static_cast<long>(pick(rows.size() + 1)), std::vector<std::string>{});
            break;
          default: {
            auto& o = rows[pick(rows.size())];
            if (!o.empty()) std::swap(r[a], o[pick(o.size())]);
            break;
          }
        }
      }
      for (const auto& r : rows) {
        for (std::size_t i = 0; i < r.size(); ++i) text += (i ? "," : "") + r[i];
        text += "\n";
      }
    }
    try {
      const Program p = from_torch_csv(text);
      CHECK(validate(p));
      ++valid;
    } catch (const schedule_error& e) {
      const std::string msg = e.what();
      if (msg.find('\n') != std::string::npos || msg.empty()) {
        CAPTURE(text);
        CAPTURE(msg);
        FAIL("an error that is not one line");
      }
      ++errors;
    }
  }
  MESSAGE("valid: " << valid << ", errors: " << errors);
  CHECK(valid > 0);
  CHECK(errors > 0);
}
