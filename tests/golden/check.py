#!/usr/bin/env python3
"""Golden outputs: pipeoffload-plan, samples/plan_schedules and samples/train_gpt, byte for byte.

A refactor that changes no behaviour leaves every output below as it is. Each golden set runs a
fixed list of command lines and compares what they print (and write) with the files recorded
under tests/golden/; a difference fails with a unified diff and the command that produced it.

usage:
  check.py [--build DIR] [--plan EXE] [--train-gpt EXE] [--plan-schedules EXE] [--record] [SET ...]
  check.py --list          the golden sets, one a line (tests/meson.build registers one test each)

With no SET, every set runs. --build DIR (default: build) finds the three programs in a Meson
build directory; --plan, --train-gpt and --plan-schedules name them one by one. --record writes
the goldens from the programs' current output instead of comparing: record only from a tree
whose behaviour you trust (today's, before a refactor), and review the diff before committing.

What is compared:
- pipeoffload-plan (sets plan-formats, plan-auto, plan-errors): a pure function of its
  arguments. Standard output (or the --out file) byte for byte as plan/<case>.<format>; exit
  status and standard error byte for byte as plan/<case>.stderr, whose first line is
  "exit N" (no .stderr file: exit 0 and nothing on standard error).
- samples/plan_schedules (set plan_schedules): standard output as plan_schedules/<case>/stdout.txt
  and every SVG it writes, byte for byte as plan_schedules/<case>/<name>.svg, or for the large
  default run as a SHA-256 per file in plan_schedules/<case>/svg.sha256 (3 MB of drawings).
- samples/train_gpt (one set per case, train_gpt-<case>): standard output byte for byte except
  the fields that vary from run to run (times, and the device total that includes P2P message
  buffers), which VARYING blanks on both sides (see below), as
  train_gpt/<core>/<case>.txt; exit 0 and nothing on standard error. <core> is the OpenBLAS
  kernel the run reports in its banner ("BLAS <core>"): losses and parameter hashes depend on
  it. With no golden for the running core the set exits 77 (Meson: SKIP) saying how to record.
"""
import argparse
import difflib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = 77

# ---- pipeoffload-plan ---------------------------------------------------------------------
SHAPE = ["--ranks", "4", "--chunks", "2", "--microbatches", "8"]
HARDWARE = ["--hidden", "4096", "--seq", "4096", "--micro-batch", "1", "--tflops", "220", "--pcie-gbps", "15"]
# name: arguments. The golden's extension is the --format (text -> .txt); a case with --out
# compares the file it writes (standard output must then be empty).
PLAN_FORMATS = {
    "1f1b": ["--schedule", "1f1b", "--ranks", "4", "--chunks", "1", "--microbatches", "8"],
    "1f1b-i": ["--schedule", "1f1b-i", *SHAPE, "--format", "csv"],
    "gis-costs": ["--schedule", "gis", *SHAPE, "--cost-f", "1", "--cost-b", "2", "--cost-w", "1.5", "--cost-comm", "0.25",
                  "--format", "json"],
    "gis-h": ["--schedule", "gis-h", "--ranks", "3", "--chunks", "2", "--microbatches", "4", "--format", "chrome-trace"],
    "gis-g": ["--schedule", "gis-g", "--group", "3", "--ranks", "4", "--chunks", "2", "--microbatches", "6", "--format", "svg"],
    "po": ["--schedule", "po", *SHAPE],
    "po-json": ["--schedule=po", "--ranks=4", "--chunks=2", "--microbatches=8", "--format=json"],
    "po-h-k": ["--schedule", "po-h", "--ranks", "4", "--chunks", "3", "--microbatches", "8", "--k", "1.5", "--format", "json"],
    "po-f": ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--microbatches", "4", "--format", "svg"],
    "po-offload-chunks": ["--schedule", "po", "--offload-chunks", "2", "--ranks", "4", "--chunks", "3", "--microbatches", "8",
                          "--format", "csv"],
    "po-h-offload-chunks": ["--schedule", "po-h", "--offload-chunks", "2", "--ranks", "4", "--chunks", "3", "--microbatches", "6"],
    "gis-offload-chunks": ["--schedule", "gis", "--offload-chunks", "1", *SHAPE],
    "po-f-hardware": ["--schedule", "po-f", *SHAPE, *HARDWARE],
    "po-h-hardware": ["--schedule", "po-h", "--ranks", "2", "--chunks", "2", "--microbatches", "4", "--hidden", "1024", "--seq",
                      "2048", "--micro-batch", "2", "--tflops", "100", "--pcie-gbps", "25", "--cost-comm", "0.1",
                      "--format", "chrome-trace"],
    "po-f-out": ["--schedule", "po-f", "--ranks", "3", "--chunks", "2", "--microbatches", "5", "--format", "csv",
                 "--out", "plan.csv"],
}
AUTO = ["--auto", "--layers", "16", "--hidden", "1024", "--heads", "16", "--query-groups", "4", "--seq", "4096",
        "--micro-batch", "1", "--global-batch", "16", "--vocab", "32000", "--ranks", "4", "--host-mem-gib", "64",
        "--tflops", "100", "--pcie-gbps", "60"]
PLAN_AUTO = {
    "auto-po-f": [*AUTO, "--device-mem-gib", "4.0"],
    "auto-pinned-po-h-lowered": [*AUTO, "--device-mem-gib", "3.6", "--schedule", "po-h"],
    "auto-po-offload": [*AUTO, "--device-mem-gib", "3.8", "--format", "json"],
    "auto-pinned-zb-v": [*AUTO, "--device-mem-gib", "5.5", "--schedule", "zb-v"],
    "auto-dualpipe-v": [*AUTO, "--device-mem-gib", "4.7", "--format", "json"],
    "auto-one-copy-stream": [*AUTO[:-1], "30", "--device-mem-gib", "4.7", "--pcie-switch", "none"],
    "auto-two-copy-streams": [*AUTO[:-1], "30", "--device-mem-gib", "4.7", "--pcie-switch", "none", "--copy-streams", "auto",
                              "--duplex-slowdown", "1.31"],
    "auto-recompute": ["--auto", "--layers", "8", "--hidden", "1024", "--heads", "16", "--query-groups", "16", "--seq", "1024",
                       "--micro-batch", "1", "--global-batch", "16", "--vocab", "32000", "--ranks", "4", "--device-mem-gib", "16",
                       "--host-mem-gib", "0.01", "--tflops", "100", "--pcie-gbps", "20", "--recompute", "--pcie-switch", "none"],
    "auto-nothing-fits": [*AUTO, "--device-mem-gib", "3.4"],
    "auto-nothing-fits-json": [*AUTO, "--device-mem-gib", "0.5", "--recompute", "--format", "json"],
}
# Bad arguments: exit 2 and one line on standard error; the order of the checks is part of
# the contract (a bad name is reported before a missing --ranks).
PLAN_ERRORS = {
    "no-schedule": [*SHAPE],
    "unknown-schedule": ["--schedule", "nope", *SHAPE],
    "unknown-schedule-first": ["--schedule", "PO"],
    "schedule-quoted": ["--schedule", "po\x01" + "x" * 50],
    "gis-g-no-group": ["--schedule", "gis-g", *SHAPE],
    "gis-g-group-range": ["--schedule", "gis-g", "--group", "1", *SHAPE],
    "gis-g-group-text": ["--schedule", "gis-g", "--group", "3x", *SHAPE],
    "group-not-gis-g": ["--schedule", "po", "--group", "2", *SHAPE],
    "1f1b-chunks": ["--schedule", "1f1b", *SHAPE],
    "1f1b-i-microbatches": ["--schedule", "1f1b-i", "--ranks", "4", "--chunks", "2", "--microbatches", "6"],
    "po-h-offload-chunks-mismatch": ["--schedule", "po-h", "--offload-chunks", "1", "--ranks", "4", "--chunks", "3", "--microbatches", "8"],
    "po-f-offload-chunks": ["--schedule", "po-f", "--offload-chunks", "0", *SHAPE],
    "offload-chunks-range": ["--schedule", "po", "--offload-chunks", "3", *SHAPE],
    "missing-ranks": ["--schedule", "po", "--chunks", "2", "--microbatches", "8"],
    "k-too-small": ["--schedule", "po-f", *SHAPE, "--k", "1e-6"],
    "k-and-hardware": ["--schedule", "po", *SHAPE, "--k", "2", "--hidden", "4096"],
    "hardware-missing": ["--schedule", "po", *SHAPE, "--hidden", "4096", "--seq", "4096"],
    "auto-with-chunks": [*AUTO, "--device-mem-gib", "4", "--chunks", "2"],
    "schedule-with-auto-flag": ["--schedule", "po", *SHAPE, "--recompute"],
    "unknown-option": ["--schedule", "po", *SHAPE, "--bogus", "1"],
    "bad-format": ["--schedule", "po", *SHAPE, "--format", "xml"],
    "too-large": ["--schedule", "po", "--ranks", "4096", "--chunks", "256", "--microbatches", "64"],
}

# ---- samples/plan_schedules -----------------------------------------------------------------
# name: (arguments, SVGs compared by hash instead of whole). It runs in a scratch directory
# with --out-dir svg, so its last line is the same wherever it runs.
PLAN_SCHEDULES = {
    "default": ([], True),
    "small": (["--layers", "4", "--hidden", "1024", "--seq", "1024", "--ranks", "2", "--microbatches", "4", "--tflops", "100",
               "--pcie-gbps", "60"], False),
}

# ---- samples/train_gpt ----------------------------------------------------------------------
SMALL = ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2", "--microbatches", "4", "--steps", "4"]
TRAIN_GPT = {
    "one-rank": ["--ranks", "1", "--chunks", "1", *SMALL, "--quiet"],
    # Progress lines (loss, lr and measured peaks per step; tokens/s blanked).
    "po-f": ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--layers", "4", "--hidden", "64", "--seq", "32", "--batch", "2",
             "--microbatches", "4", "--steps", "4"],
    # These three on the exact gradient path (their bits are the ones recorded before the
    # standard path became the default; one-rank and po-f cover the default).
    "decay-all": ["--schedule", "gis-h", "--ranks", "2", "--chunks", "2", "--offload-chunks", "1", "--decay-all", *SMALL,
                  "--quiet", "--gradients", "exact"],
    # Held-out loss every 2 steps; the trace line (its length in ms blanked; the trace file
    # itself is all times and is not compared).
    "eval-trace": ["--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", "--eval-every", "2", "--seed", "3",
                   "--trace", "trace.json", *SMALL, "--quiet", "--gradients", "exact"],
    "gis-g-four-ranks": ["--schedule", "gis-g", "--group", "3", "--ranks", "4", "--chunks", "1", "--layers", "4", "--hidden", "32",
                         "--seq", "16", "--batch", "2", "--microbatches", "8", "--steps", "3", "--dropout", "0.2",
                         "--gradients", "exact"],
}
# The fields of train_gpt's output that vary from run to run, one regular expression each;
# every named group's text is replaced with the expression's token before comparing (the
# goldens are stored so). Everything else (losses, learning rates, measured activation and
# pinned-host peaks, simulated peaks, params_hash) is compared byte for byte.
NUM = r"(?:-?[0-9]+(?:\.[0-9]*)?(?:e[-+]?[0-9]+)?|-?inf|-?nan)"
VARYING = [
    # "wall 0.03 s, 20223 tokens/s": the run's wall time and throughput.
    (re.compile(rf"^wall (?P<x>{NUM}) s, (?P<y>{NUM}) tokens/s$", re.M), "<t>"),
    # "[####....] step 1/4 loss 5.5433 lr 3.00e-03 | 33379 tokens/s | peak ...": throughput so far.
    (re.compile(rf"^(?=\[[#.]+\] step ).*? \| (?P<x>{NUM}) tokens/s \| ", re.M), "<t>"),
    # "trace of the last step (12.3 ms) written to FILE": the traced step's length.
    (re.compile(rf"^trace of the last step \((?P<x>{NUM}) ms\) written to ", re.M), "<t>"),
    # "(device total incl. stash and messages: 0.38 0.27; ...": not a time, but it depends on
    # the threads' timing: a P2P message's buffer is allocated (on the receiver's comm stream)
    # when it arrives, so how many are held beside the activations at the peak varies from run
    # to run with more than one rank (seen: 0.38 vs 0.39 MiB under load). The activation and
    # pinned-host peaks beside it are allocated in program order and stay compared.
    (re.compile(rf"\(device total incl\. stash and messages: (?P<x>{NUM}(?: {NUM})*);", re.M), "<n>"),
]
BANNER_CORE = re.compile(r"^train_gpt: .*, BLAS (?P<core>[A-Za-z0-9_.+-]+)$", re.M)


def blank_varying(text):
    """text with every VARYING field replaced by its token."""
    for rx, token in VARYING:
        def sub(m):
            s, out, pos = m.group(0), [], 0
            spans = sorted(m.span(g) for g in m.groupdict() if m.group(g) is not None)
            for a, b in spans:
                out += [s[pos:a - m.start()], token]
                pos = b - m.start()
            return "".join(out) + s[pos:]
        text = rx.sub(sub, text)
    return text


# ---- running and comparing ----------------------------------------------------------------
class Failure(Exception):
    pass


def run(exe, args, cwd):
    p = subprocess.run([exe, *args], cwd=cwd, capture_output=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def command(exe, args):
    return " ".join([os.path.basename(exe)] + [a if re.fullmatch(r"[\w./=:,+-]+", a) else repr(a) for a in args])


def diff(golden, got, path, cmd):
    """A readable account of how `got` (bytes) differs from the golden file `path` (bytes)."""
    a = golden.decode("utf-8", "replace").splitlines(keepends=True)
    b = got.decode("utf-8", "replace").splitlines(keepends=True)
    lines = list(difflib.unified_diff(a, b, f"golden {path.relative_to(HERE.parent.parent)}", "now", n=2))
    first = next((i for i, (x, y) in enumerate(zip(golden, got)) if x != y), min(len(golden), len(got)))
    head = (f"FAIL: {cmd}\n  output differs from {path.relative_to(HERE.parent.parent)} "
            f"(first at byte {first}; golden {len(golden)} bytes, now {len(got)})\n")
    if len(lines) > 80:
        lines = lines[:80] + [f"... ({len(lines) - 80} more diff lines)\n"]
    return head + "".join(l if l.endswith("\n") else l + "\n\\ no newline at end\n" for l in lines)


class Checker:
    def __init__(self, record):
        self.record = record
        self.failures = []
        self.checked = 0

    def same(self, path, got, cmd):
        """Compares got (bytes) with the golden file at path, or records it."""
        self.checked += 1
        if self.record:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_bytes() != got:
                path.write_bytes(got)
                print(f"recorded {path.relative_to(HERE.parent.parent)}")
            return
        if not path.exists():
            self.failures.append(f"FAIL: {cmd}\n  no golden file {path.relative_to(HERE.parent.parent)} (record it with --record)\n")
        elif path.read_bytes() != got:
            self.failures.append(diff(path.read_bytes(), got, path, cmd))

    def absent(self, path, cmd, what):
        """A golden file that must not exist (recording removes a stale one)."""
        if path.exists():
            if self.record:
                path.unlink()
                print(f"removed {path.relative_to(HERE.parent.parent)}")
            else:
                self.checked += 1
                self.failures.append(f"FAIL: {cmd}\n  {what}, but {path.relative_to(HERE.parent.parent)} expects otherwise\n")


def plan_set(ck, exe, cases):
    ext = {"text": "txt", "csv": "csv", "json": "json", "chrome-trace": "trace.json", "svg": "svg"}
    for name, args in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            rc, out, err = run(exe, args, tmp)
            cmd = command(exe, args)
            flags = dict(zip(args, args[1:]))
            fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), flags.get("--format", "text"))
            if "--out" in flags:
                written = Path(tmp, flags["--out"])
                if out:
                    ck.failures.append(f"FAIL: {cmd}\n  printed {len(out)} bytes with --out\n")
                out = written.read_bytes() if written.exists() else b"(no file written)\n"
            status = HERE / "plan" / f"{name}.stderr"
            if out or rc == 0:
                ck.same(HERE / "plan" / f"{name}.{ext.get(fmt, 'txt')}", out, cmd)
            if rc == 0 and not err:
                ck.absent(status, cmd, "exit 0 and nothing on standard error")
            else:
                ck.same(status, f"exit {rc}\n".encode() + err, cmd)


def plan_schedules_set(ck, exe, cases):
    for name, (args, hashed) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            full = [*args, "--out-dir", "svg"]
            cmd = command(exe, full)
            rc, out, err = run(exe, full, tmp)
            if rc != 0 or err:
                ck.failures.append(f"FAIL: {cmd}\n  exit {rc}, stderr {err.decode(errors='replace')!r}\n")
                continue
            gold = HERE / "plan_schedules" / name
            ck.same(gold / "stdout.txt", out, cmd)
            svgs = sorted(Path(tmp, "svg").glob("*.svg"))
            if hashed:
                sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in svgs)
                ck.same(gold / "svg.sha256", sums.encode(), cmd + "  (SHA-256 of the SVGs it writes)")
            else:
                names = {p.name for p in svgs}
                for p in svgs:
                    ck.same(gold / p.name, p.read_bytes(), cmd + f"  ({p.name})")
                for stale in sorted(gold.glob("*.svg")):
                    if stale.name not in names:
                        ck.absent(stale, cmd, f"{stale.name} is no longer written")


def train_gpt_set(ck, exe, name, args):
    """Returns SKIP when no golden exists for the running OpenBLAS core."""
    with tempfile.TemporaryDirectory() as tmp:
        rc, out, err = run(exe, args, tmp)
    cmd = command(exe, args)
    if rc != 0 or err:
        ck.failures.append(f"FAIL: {cmd}\n  exit {rc}, stderr {err.decode(errors='replace')!r}\n")
        return 0
    text = out.decode("utf-8")
    m = BANNER_CORE.search(text)
    if not m:
        ck.failures.append(f"FAIL: {cmd}\n  no 'BLAS <core>' at the end of its banner line:\n{text[:400]}\n")
        return 0
    core = m.group("core")
    path = HERE / "train_gpt" / core / f"{name}.txt"
    if not ck.record and not path.exists():
        print(f"SKIP: no train_gpt goldens for OpenBLAS core '{core}' (tests/golden/train_gpt/{core}/); on a trusted tree "
              f"record them with: python3 tests/golden/check.py --build build --record train_gpt-{name}")
        return SKIP
    ck.same(path, blank_varying(text).encode("utf-8"), cmd + "  (varying fields blanked)")
    return 0


def sets():
    s = {"plan-formats": ("plan", PLAN_FORMATS), "plan-auto": ("plan", PLAN_AUTO), "plan-errors": ("plan", PLAN_ERRORS),
         "plan_schedules": ("plan_schedules", PLAN_SCHEDULES)}
    for name, args in TRAIN_GPT.items():
        s["train_gpt-" + name] = ("train_gpt", (name, args))
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build", help="Meson build directory holding the programs (default: build)")
    ap.add_argument("--plan", help="path of pipeoffload-plan (default: BUILD/pipeoffload-plan)")
    ap.add_argument("--train-gpt", help="path of train_gpt (default: BUILD/samples/train_gpt)")
    ap.add_argument("--plan-schedules", help="path of plan_schedules (default: BUILD/samples/plan_schedules)")
    ap.add_argument("--record", action="store_true", help="write the goldens instead of comparing")
    ap.add_argument("--list", action="store_true", help="print the golden sets and exit")
    ap.add_argument("set", nargs="*", help="golden sets to check (default: all)")
    o = ap.parse_args()
    all_sets = sets()
    if o.list:
        print("\n".join(all_sets))
        return 0
    unknown = [s for s in o.set if s not in all_sets]
    if unknown:
        ap.error(f"unknown golden set {', '.join(unknown)}; the sets are: {', '.join(all_sets)}")
    exes = {"plan": o.plan or os.path.join(o.build, "pipeoffload-plan"),
            "train_gpt": o.train_gpt or os.path.join(o.build, "samples", "train_gpt"),
            "plan_schedules": o.plan_schedules or os.path.join(o.build, "samples", "plan_schedules")}
    exes = {k: os.path.abspath(v) for k, v in exes.items()}
    ck = Checker(o.record)
    skipped = []
    for s in o.set or list(all_sets):
        kind, cases = all_sets[s]
        if not os.access(exes[kind], os.X_OK):
            ck.failures.append(f"FAIL: {s}: {exes[kind]} is not an executable (build it, or pass --build DIR)\n")
        elif kind == "plan":
            plan_set(ck, exes[kind], cases)
        elif kind == "plan_schedules":
            plan_schedules_set(ck, exes[kind], cases)
        elif train_gpt_set(ck, exes[kind], *cases) == SKIP:
            skipped.append(s)
    for f in ck.failures:
        sys.stdout.write(f + "\n")
    if ck.failures:
        print(f"{len(ck.failures)} of {ck.checked} golden comparisons failed. If the change is intended, record the new "
              f"outputs with --record and review the diff.")
        return 1
    if skipped and ck.checked == 0:
        return SKIP
    print(f"ok: {ck.checked} golden {'files recorded or unchanged' if o.record else 'comparisons pass'}"
          + (f" ({len(skipped)} train_gpt sets skipped: no goldens for this OpenBLAS core)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
