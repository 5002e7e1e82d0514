#!/usr/bin/env python3
"""Contract test of the plan tool: output formats, the paper's numbers, and bad arguments.

Usage: test_plan_cli.py PATH/TO/pipeoffload-plan    (Python 3 standard library only)
Every check runs; the failures are listed at the end and the exit status is 1 if any failed.
"""
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TOOL = sys.argv[1] if len(sys.argv) > 1 else "build/pipeoffload-plan"
SHAPE = ["--ranks", "4", "--chunks", "2", "--microbatches", "8"]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
    return cond


def run(*args):
    p = subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def ok(*args):
    rc, out, err = run(*args)
    check(rc == 0 and err == "", f"{' '.join(args)}: exit {rc}, stderr {err!r}")
    return out


def plan_json(schedule, *extra):
    out = ok("--schedule", schedule, *SHAPE, *extra, "--format", "json")
    try:
        return json.loads(out)
    except ValueError as e:
        check(False, f"{schedule} json does not parse: {e}")
        return {}


def csv_rows(*args):
    out = ok(*args, "--format", "csv")
    return out, list(csv.DictReader(io.StringIO(out)))


def main():
    # ---- csv: header, one row per op, sort order, number format ---------------------------------
    out, rows = csv_rows("--schedule", "po-f", *SHAPE)
    check(out.splitlines()[0] == "rank,op,chunk,stage,microbatch,start,end", f"csv header: {out.splitlines()[:1]}")
    compute = [r for r in rows if r["op"] in ("F", "B", "W", "BW")]
    copies = [r for r in rows if r["op"] in ("O", "R")]
    check(len(compute) == 4 * 2 * 8 * 3, f"po-f csv: {len(compute)} compute rows, want F, B, W of 64 units = 192")
    check(len(copies) + len(compute) == len(rows), "po-f csv: an op outside F, B, W, BW, O, R")
    check(len(copies) > 0, "po-f csv: no offloads at all")
    doc = plan_json("po-f")
    check(len(rows) == len(doc.get("ops", [])), f"po-f: csv has {len(rows)} rows, json {len(doc.get('ops', []))} ops")
    offloads = {(r["rank"], r["stage"], r["microbatch"]) for r in copies if r["op"] == "O"}
    reloads = {(r["rank"], r["stage"], r["microbatch"]) for r in copies if r["op"] == "R"}
    check(offloads == reloads, "po-f csv: offloads and reloads are not the same units")
    key = [(int(r["rank"]), float(r["start"]), r["op"] in ("O", "R")) for r in rows]
    check(key == sorted(key), "po-f csv: rows are not sorted by rank, then start, compute before copy")
    for r in rows:
        stage, rank, chunk = int(r["stage"]), int(r["rank"]), int(r["chunk"])
        if not check(stage % 4 == rank and stage // 4 == chunk, f"csv row {r}: stage does not match rank and chunk"):
            break
        if not check(float(r["start"]) < float(r["end"]), f"csv row {r}: start >= end"):
            break
    check(not re.search(r"[eE]|nan|inf", out.split("\n", 1)[1]), "csv: a number in exponent form or nan/inf")
    check(re.search(r",\d+\.5(,|\n)", out) is not None, "po-f csv: no half-unit time printed as 'x.5'")

    # ---- csv: the worked example, GIS d=4 v=2 m=8, rank 0 under unit costs ----------------------
    # F0.0..F3.0 and F0.1..F3.1 fill slots 0..7; mb 0's backward comes back through stages 7, 6, 5
    # and reaches stage 4 (rank 0, chunk 1) at 11; then W, and the steady state F/B/W.
    _, rows = csv_rows("--schedule", "gis", *SHAPE)
    rank0 = [(r["op"], int(r["microbatch"]), int(r["chunk"]), r["start"], r["end"]) for r in rows if r["rank"] == "0"]
    want = [("F", mb, c, str(t), str(t + 1)) for t, (c, mb) in enumerate([(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)])]
    want += [("B", 0, 1, "11", "12"), ("W", 0, 1, "12", "13"), ("F", 4, 0, "13", "14"), ("B", 1, 1, "14", "15"),
             ("W", 1, 1, "15", "16"), ("F", 5, 0, "16", "17")]
    check(rank0[: len(want)] == want, f"gis rank 0 first ops:\n  got  {rank0[:len(want)]}\n  want {want}")

    # Compute orders of the worked example (docs/design.md section 2), as "F mb.chunk".
    orders = {
        "po": "F0.0 F1.0 F0.1 F2.0 F1.1 F3.0 B0.1 W0.1 F2.1 F4.0 B1.1 W1.1 F3.1 B0.0 W0.0 F5.0",
        "gis-h": "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B0.0 W0.0 F4.0",
        "gis": "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 W0.1 F4.0 B1.1 W1.1 F5.0",
    }
    for name, order in orders.items():
        _, rows = csv_rows("--schedule", name, *SHAPE)
        got = [f"{r['op']}{r['microbatch']}.{r['chunk']}" for r in rows if r["rank"] == "0"]
        check(got[: len(order.split())] == order.split(), f"{name} rank 0 order: {' '.join(got[:16])}")

    # ---- json: keys, per-rank arrays, the paper's peaks ------------------------------------------
    peaks = {"gis-h": [6, 5, 4, 3], "po": [7, 6, 5, 4], "gis": [8, 7, 6, 5], "1f1b-i": [11, 9, 7, 5]}
    required = ["schedule", "ranks", "chunks", "microbatches", "group", "offload_chunks", "k", "makespan",
                "bubble_fraction", "warmup", "peak", "bubble", "ops"]
    for name, want in peaks.items():
        doc = plan_json(name)
        missing = [k for k in required if k not in doc]
        if not check(not missing, f"{name} json: missing keys {missing}"):
            continue
        check(doc["schedule"] == name, f"{name} json: schedule {doc['schedule']!r}")
        check((doc["ranks"], doc["chunks"], doc["microbatches"]) == (4, 2, 8), f"{name} json: shape")
        for k in ("warmup", "peak", "bubble"):
            check(isinstance(doc[k], list) and len(doc[k]) == 4, f"{name} json: {k} is not an array of 4")
        check(doc["peak"] == want, f"{name} json: peaks {doc['peak']}, want {want}")
        check(doc["offload_chunks"] == 0 and doc["k"] == 1, f"{name} json: offload_chunks/k")
        op = doc["ops"][0] if doc["ops"] else {}
        check(set(op) >= {"rank", "stream", "op", "stage", "chunk", "microbatch", "start", "end"}, f"{name} json: op keys {sorted(op)}")
        check(doc["makespan"] == max(o["end"] for o in doc["ops"]), f"{name} json: makespan is not the last op's end")
    check(plan_json("gis")["group"] == 4 and plan_json("gis-h")["group"] == 2 and plan_json("po")["group"] == 1, "json: group")
    check(plan_json("gis-g", "--group", "3")["group"] == 3, "json: gis-g --group 3")

    # ---- schedule names: po-h / po-f and --offload-chunks ---------------------------------------
    for name, args, want_name, want_n in [
        ("po-h", [], "po-h", 1), ("po-f", [], "po-f", 2), ("po-h", ["--offload-chunks", "1"], "po-h", 1),
        ("po-f", ["--offload-chunks", "2"], "po-f", 2), ("po", ["--offload-chunks", "0"], "po", 0),
        ("gis-h", ["--offload-chunks", "1"], None, 1),
    ]:
        doc = plan_json(name, *args)
        if want_name:
            check(doc.get("schedule") == want_name, f"{name} {args}: schedule {doc.get('schedule')!r}")
        else:
            check(str(doc.get("schedule", "")).startswith("gis-h+offload"), f"{name} {args}: schedule {doc.get('schedule')!r}")
        check(doc.get("offload_chunks") == want_n, f"{name} {args}: offload_chunks {doc.get('offload_chunks')}")
    rc, out, _ = run("--schedule", "po-h", "--ranks", "4", "--chunks", "3", "--microbatches", "8", "--format", "json")
    check(rc == 0 and json.loads(out)["offload_chunks"] == 2, "po-h with v=3 offloads ceil(3/2) = 2 chunks")
    check(plan_json("po-f")["peak"] < plan_json("po")["peak"], "po-f does not lower the peaks of po")

    # k from hardware: k = 10 / (3 (6h + s)) * Bc / Bo.
    doc = plan_json("po-h", "--hidden", "4096", "--seq", "4096", "--micro-batch", "1", "--tflops", "300", "--pcie-gbps", "25")
    k = 10 / (3 * (6 * 4096 + 4096)) * 300e12 / 25e9
    check(abs(doc.get("k", 0) - k) < 1e-6 * k, f"hardware k {doc.get('k')}, want {k}")
    check(plan_json("po-h", "--k", "0.5")["k"] == 0.5, "--k 0.5")
    doc = plan_json("gis", "--cost-f", "1", "--cost-b", "2", "--cost-w", "1", "--cost-comm", "0.5")
    check(doc.get("costs", {}).get("b") == 2 and doc["makespan"] > plan_json("gis")["makespan"], "--cost-b 2 --cost-comm 0.5")

    # ---- chrome trace -----------------------------------------------------------------------------
    out = ok("--schedule", "po-f", *SHAPE, "--format", "chrome-trace")
    try:
        trace = json.loads(out)
        events = trace["traceEvents"]
        threads = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        check(threads == {"compute", "copy"}, f"chrome-trace: thread names {threads}")
        procs = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
        check(procs == {f"rank {r}" for r in range(4)}, f"chrome-trace: process names {procs}")
        xs = [e for e in events if e.get("ph") == "X"]
        check(len(xs) == len(plan_json("po-f")["ops"]), "chrome-trace: one X event per op")
        check(all(e["tid"] in (0, 1) and e["dur"] > 0 and re.fullmatch(r"(F|B|W|BW|O|R)\d+\.\d+", e["name"]) for e in xs),
              "chrome-trace: X events' tid, dur or name")
        check(any(e["name"] == "F0.0" and e["ts"] == 0 and e["dur"] == 1000 for e in xs), "chrome-trace: F0.0 at 0 for 1000 us")
        check(any(e.get("ph") == "C" for e in events), "chrome-trace: no activation counter events")
        check(trace.get("displayTimeUnit") == "ms", "chrome-trace: displayTimeUnit")
    except (ValueError, KeyError, TypeError) as e:
        check(False, f"chrome-trace does not parse as a trace: {e!r}")

    # ---- svg --------------------------------------------------------------------------------------
    for name in ("po-f", "1f1b-i", "gis"):
        out = ok("--schedule", name, *SHAPE, "--format", "svg")
        try:
            root = ET.fromstring(out)
            ns = "{http://www.w3.org/2000/svg}"
            check(root.tag == ns + "svg", f"{name} svg: root is {root.tag}")
            check(len(root.findall(f".//{ns}rect")) >= 4 * 2 * 8, f"{name} svg: too few rect elements")
            check(float(root.get("width")) < 2000, f"{name} svg: {root.get('width')} px wide for d=4 v=2 m=8")
            texts = " ".join(t.text or "" for t in root.iter(ns + "text"))
            check(name in texts, f"{name} svg: no title with the schedule name")
            if name == "po-f":
                check(len(root.findall(f".//{ns}polygon")) > 0, "po-f svg: no offload/reload shapes")
        except ET.ParseError as e:
            check(False, f"{name} svg is not well-formed XML: {e}")

    # ---- text -------------------------------------------------------------------------------------
    out = ok("--schedule", "gis", *SHAPE)
    check(out.startswith("schedule=gis ranks=4 chunks=2 microbatches=8 group=4 offload_chunks=0 k=1 makespan="),
          f"text header: {out.splitlines()[:1]}")
    for r, p in enumerate(peaks["gis"]):
        check(re.search(rf"^rank {r}: warmup=\d+ peak={p} bubble=[0-9.]+$", out, re.M), f"text: rank {r} peak line")
    check(all(len(line) <= 240 for line in out.splitlines()), "text: a line wider than 240 characters")
    out = ok("--schedule", "po", "--ranks", "8", "--chunks", "8", "--microbatches", "64")
    check("grid cut" in out and all(len(line) <= 240 for line in out.splitlines()), "text: a big run is not cut to 240 columns")

    # ---- --out and --help -------------------------------------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.csv")
        rc, out, err = run("--schedule", "po-h", *SHAPE, "--format", "csv", "--out", path)
        check(rc == 0 and out == "" and err == "", f"--out: exit {rc}, stdout {out[:40]!r}, stderr {err!r}")
        check(os.path.exists(path) and open(path).read() == ok("--schedule", "po-h", *SHAPE, "--format", "csv"),
              "--out: the file differs from standard output")
        rc, out, err = run("--schedule", "po-h", *SHAPE, "--out", os.path.join(tmp, "no", "such", "dir.txt"))
        check(rc == 2 and len(err.splitlines()) == 1 and "--out" in err, f"--out to a missing directory: {rc} {err!r}")
    rc, out, err = run("--help")
    check(rc == 0 and "--schedule" in out and "usage" in out and err == "", "--help")

    # ---- bad arguments: exit 2, one line on stderr naming the flag --------------------------------
    BASE = ["--schedule", "gis", *SHAPE]


    def with_(flag, value):
        """BASE with flag's value replaced (or the flag added)."""
        args = list(BASE)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        return args


    bad = [
        ([], "--schedule"),
        (["--ranks", "4", "--chunks", "2", "--microbatches", "8"], "--schedule"),
        (with_("--schedule", "gpipe"), "--schedule"),
        (with_("--ranks", "0"), "--ranks"),
        (with_("--ranks", "-1"), "--ranks"),
        (with_("--ranks", "3x"), "--ranks"),
        (with_("--ranks", ""), "--ranks"),
        (with_("--ranks", "1e99"), "--ranks"),
        (with_("--ranks", "99999999999999999999"), "--ranks"),
        (with_("--ranks", "4.0"), "--ranks"),
        (with_("--ranks", "5000"), "--ranks"),
        (with_("--chunks", "999"), "--chunks"),
        (with_("--chunks", "0"), "--chunks"),
        (with_("--microbatches", "0"), "--microbatches"),
        (with_("--microbatches", "x"), "--microbatches"),
        (["--schedule", "gis", "--ranks", "4", "--chunks", "2"], "--microbatches"),
        (["--schedule", "gis", "--chunks", "2", "--microbatches", "8"], "--ranks"),
        (BASE[:-1], "--microbatches"),
        (BASE + ["--ranks", "4"], "--ranks"),
        (with_("--group", "3"), "--group"),
        (["--schedule", "gis-g", *SHAPE], "--group"),
        (["--schedule", "gis-g", *SHAPE, "--group", "1"], "--group"),
        (["--schedule", "gis-g", *SHAPE, "--group", "5"], "--group"),
        (["--schedule", "1f1b", *SHAPE], "--chunks"),
        (["--schedule", "1f1b-i", "--ranks", "4", "--chunks", "2", "--microbatches", "6"], "--microbatches"),
        (with_("--offload-chunks", "3"), "--offload-chunks"),
        (with_("--offload-chunks", "-1"), "--offload-chunks"),
        (["--schedule", "po-h", *SHAPE, "--offload-chunks", "2"], "--offload-chunks"),
        (["--schedule", "po-f", *SHAPE, "--offload-chunks", "1"], "--offload-chunks"),
        (with_("--k", "0"), "--k"),
        (with_("--k", "-2"), "--k"),
        (with_("--k", "nan"), "--k"),
        (with_("--k", "inf"), "--k"),
        (with_("--k", "1,5"), "--k"),
        (BASE + ["--k", "1", "--hidden", "4096"], "--k"),
        (BASE + ["--hidden", "4096", "--seq", "2048"], "--tflops"),
        (BASE + ["--hidden", "4096", "--seq", "2048", "--micro-batch", "1", "--tflops", "300"], "--pcie-gbps"),
        (BASE + ["--hidden", "0", "--seq", "2048", "--micro-batch", "1", "--tflops", "300", "--pcie-gbps", "25"], "--hidden"),
        (with_("--cost-f", "0"), "--cost-f"),
        (with_("--cost-b", "-1"), "--cost-b"),
        (with_("--cost-w", "abc"), "--cost-w"),
        (with_("--cost-comm", "-0.5"), "--cost-comm"),
        (with_("--format", "xml"), "--format"),
        (with_("--out", ""), "--out"),
        (BASE + ["--out"], "--out"),
        (BASE + ["--frobnicate", "1"], "--frobnicate"),
        (BASE + ["--dp", "2"], "--dp"),  # the data-parallel flags are the planner's (--auto)
        (BASE + ["--search-dp"], "--search-dp"),
        (BASE + ["stray"], "stray"),
        (with_("--k", "1\n2"), "--k"),
        (["--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--microbatches", "8", "--k", "1e-300"], "--k"),
        (["--schedule", "po", "--ranks", "4096", "--chunks", "256", "--microbatches", "65536"], "--microbatches"),
    ]
    for args, flag in bad:
        try:
            rc, out, err = run(*args)
        except subprocess.TimeoutExpired:
            check(False, f"{args}: did not finish in 60 s")
            continue
        lines = err.splitlines()
        check(rc == 2 and out == "" and len(lines) == 1 and err.endswith("\n") and flag in err
              and lines[0].startswith("pipeoffload-plan: "),
              f"bad arguments {args}: exit {rc}, stdout {out[:40]!r}, stderr {err!r} (want exit 2, one line naming {flag})")
    torch_csv()


def torch_csv():
    """--format torch-csv and --import: a round trip through a file, and bad files."""
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, chunks in (("zb-v", "2"), ("1f1b", "1"), ("po-f", "2")):
            shape = ["--ranks", "4", "--chunks", chunks, "--microbatches", "8"]
            path = os.path.join(tmp, schedule + ".csv")
            ok("--schedule", schedule, *shape, "--format", "torch-csv", "--out", path)
            with open(path) as f:
                text = f.read()
            check(len(text.splitlines()) == 4, f"{schedule}: torch-csv has one row per rank")
            lowered = ok("--schedule", schedule, *shape, "--format", "torch-csv-lowered")
            check("SEND_F" in lowered and "RECV_B" in lowered, f"{schedule}: torch-csv-lowered has P2P actions")
            again = ok("--import", path, "--format", "torch-csv")
            check(again == text, f"{schedule}: --import then --format torch-csv gives the file back")
            built = json.loads(ok("--schedule", schedule, *shape, "--format", "json"))
            imported = json.loads(ok("--import", path, "--format", "json"))
            if schedule != "po-f":  # PO plans on its grid; the import on the ASAP timeline
                check(built["makespan"] == imported["makespan"], f"{schedule}: imported makespan equals the built one")
            ok("--import", path, "--offload-chunks", chunks, "--format", "json")
        bad = [
            ("0F0,0B0\n1F0,1Q0\n", "row 2 (rank 1), cell 2"),
            ("0F0,0B0\n1F0\n", "row 2 (rank 1)"),
            ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlocks"),
            ("0F0,0B0\n1F0,1B0,1F0\n", "row 2 (rank 1), cell 3"),
            ("", "no rows"),
        ]
        for i, (text, part) in enumerate(bad):
            path = os.path.join(tmp, f"bad{i}.csv")
            with open(path, "w") as f:
                f.write(text)
            rc, out, err = run("--import", path)
            check(rc == 2 and out == "" and len(err.splitlines()) == 1 and part in err,
                  f"--import of {text!r}: exit {rc}, stderr {err!r} (want exit 2, one line with {part!r})")
        rc, out, err = run("--import", os.path.join(tmp, "missing.csv"))
        check(rc == 2 and len(err.splitlines()) == 1, f"--import of a missing file: exit {rc}, stderr {err!r}")

    # Two copy streams: the text grid has a row per copy stream, offloads in "copy", reloads
    # in "reload", and one stream keeps both in "copy".
    for streams in ("1", "2"):
        out = ok("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--microbatches", "8", "--k", "1.5",
                 "--copy-streams", streams)
        rows = {name: [ln for ln in out.splitlines() if ln.startswith("  " + name + " ")] for name in ("copy", "reload")}
        cells = {name: set(re.findall(r"[A-Za-z]+(?=\d)", " ".join(r[9:] for r in rows[name]))) for name in rows}
        if streams == "2":
            check(len(rows["copy"]) == 2 and len(rows["reload"]) == 2, f"--copy-streams 2: rows {rows}")
            check(cells["copy"] <= {"O", "o"} and cells["reload"] <= {"R", "r"} and cells["reload"],
                  f"--copy-streams 2: copy row cells {cells['copy']}, reload row cells {cells['reload']}")
        else:
            check(len(rows["copy"]) == 2 and not rows["reload"] and {"O", "R"} <= {c.upper() for c in cells["copy"]},
                  f"--copy-streams 1: rows {rows}")
        # JSON: copy_streams, and each op on its stream ("reload" for reloads with two streams).
        doc = json.loads(ok("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--microbatches", "8", "--k", "1.5",
                            "--copy-streams", streams, "--format", "json"))
        kinds = {(o["stream"], o["op"]) for o in doc["ops"]}
        want = {("compute", "F"), ("compute", "B"), ("compute", "W"), ("copy", "O"),
                ("reload" if streams == "2" else "copy", "R")}
        check(doc.get("copy_streams") == int(streams) and kinds == want,
              f"--copy-streams {streams} json: copy_streams {doc.get('copy_streams')}, streams and ops {sorted(kinds)}")
        # --pcie-switch none: no partner, so no staggered copy slots (a different placement);
        # a bad value is refused.
        paired = ok("--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--microbatches", "8", "--k", "1.5",
                    "--copy-streams", streams, "--format", "csv")
        alone = ok("--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--microbatches", "8", "--k", "1.5",
                   "--copy-streams", streams, "--format", "csv", "--pcie-switch", "none")
        check(paired != alone, f"--copy-streams {streams}: --pcie-switch none places the copies as pairs do")
        rc, _, err = run("--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--microbatches", "8", "--pcie-switch", "x")
        check(rc == 2 and err.strip().endswith("--pcie-switch must be pairs or none, got 'x'"), f"--pcie-switch x: {rc} {err!r}")
        # The SVG likewise: offload arrows (pointing right) and reload arrows (pointing left)
        # each on their own rows' heights with two streams, all on the copy rows' with one.
        svg = ok("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--microbatches", "8", "--k", "1.5",
                 "--copy-streams", streams, "--format", "svg")
        ys = {"O": set(), "R": set()}
        for pts in re.findall(r'<polygon points="([^"]+)" fill="#[0-9a-f]{6}">', svg):  # not the legend's
            xy = [tuple(map(float, q.split(","))) for q in pts.split()]
            # An offload's first and last points share the flat left side; a reload's last is its tip.
            kind = "O" if xy[0][0] == xy[4][0] else "R"
            ys[kind].add(min(y for _, y in xy))
        labels = re.findall(r'fill="#555">(copy|reload)</text>', svg)
        if streams == "2":
            check(ys["O"] and ys["R"] and not ys["O"] & ys["R"] and labels == ["copy", "reload"] * 2,
                  f"--copy-streams 2 SVG: offload rows {sorted(ys['O'])}, reload rows {sorted(ys['R'])}, labels {labels}")
        else:
            check(ys["O"] and ys["O"] == ys["R"] and labels == ["copy"] * 2,
                  f"--copy-streams 1 SVG: offload rows {sorted(ys['O'])}, reload rows {sorted(ys['R'])}, labels {labels}")


try:
    main()
except Exception as e:  # a crash in the checks is one more failure, not a traceback
    failures.append(f"test stopped early: {e!r}")

if failures:
    print(f"{len(failures)} check(s) failed:")
    for f in failures:
        print("  -", f)
    sys.exit(1)
print("plan tool: all checks passed")
