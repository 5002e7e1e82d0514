#!/usr/bin/env python3
"""samples/custom_model's contract: every run prints its loss curves and one final_loss line;
training lowers the loss; the two compile-time schedules and the run-time Program end with the
same final_loss for one optimizer (every schedule trains bit-identically, on either gradient path,
and the standard path ends within 1 % of the exact one); a bad argument exits 2
with one sentence on stderr.

usage: test_custom_model.py path/to/custom_model
"""
import re
import subprocess
import sys

exe = sys.argv[1]


def run(*args, code=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    if p.returncode != code:
        sys.exit(f"FAIL: custom_model {' '.join(args)} exited {p.returncode}, expected {code}\n"
                 f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def runs(out):
    """Each run as (optimizer, schedule, compile/run time, train losses, validation losses, final_loss)."""
    found, cur = [], None
    for line in out.splitlines():
        m = re.match(r"== (\w+), (\S+) \((compile|run) time: ", line)
        if m:
            cur = {"optimizer": m[1], "schedule": m[2], "when": m[3]}
            found.append(cur)
        elif cur is not None and line.strip().startswith(("train", "val")):
            key, *values = line.split()
            cur[key] = [float(x) for x in values]
        elif line.startswith("final_loss="):
            assert cur is not None and "final" not in cur, f"a final_loss line outside a run or twice in one: {line!r}"
            cur["final"] = line[len("final_loss="):]
            float(cur["final"])
    for r in found:
        assert "final" in r, f"run {r} printed no final_loss"
        assert r.get("train") and r.get("val"), f"run {r} printed no loss curves"
    return found


out = run().stdout
got = runs(out)
assert [(r["optimizer"], r["schedule"], r["when"]) for r in got] == [
    ("adamw", "po-f", "compile"), ("adamw", "gis-h", "compile"), ("adamw", "1f1b-i", "run"),
    ("sgd", "po-f", "compile"), ("sgd", "gis-h", "compile"), ("sgd", "1f1b-i", "run")], got
for r in got:
    assert r["train"][-1] < 0.5 * r["train"][0], f"{r['optimizer']}, {r['schedule']}: training loss did not fall: {r['train']}"
    assert r["val"][-1] < r["val"][0], f"{r['optimizer']}, {r['schedule']}: validation loss did not fall: {r['val']}"
for opt in ("adamw", "sgd"):
    finals = {r["final"] for r in got if r["optimizer"] == opt}
    assert len(finals) == 1, f"{opt}: schedules disagree on final_loss: {finals}"
assert got[0]["final"] != got[3]["final"], "AdamW and SGD gave the same final_loss"

# Another run-time schedule (GIS(3)) trains the same model to the same bits.
short = runs(run("--schedule", "gis-g", "--group", "3", "--steps", "6", "--eval-every", "3").stdout)
for opt in ("adamw", "sgd"):
    finals = {r["final"] for r in short if r["optimizer"] == opt}
    assert len(finals) == 1, f"{opt} with gis-g as the run-time schedule: final_loss differs: {finals}"
# 1F1B (one chunk per rank, so a 4-stage model) runs too.
assert len(runs(run("--schedule", "1f1b", "--steps", "3").stdout)) == 6

# The exact path (--gradients exact): the same schedules agree again, and the default standard
# path's final loss is within 1 % of it.
exact = runs(run("--gradients", "exact").stdout)
for opt in ("adamw", "sgd"):
    finals = {r["final"] for r in exact if r["optimizer"] == opt}
    assert len(finals) == 1, f"{opt}, --gradients exact: schedules disagree on final_loss: {finals}"
    e = float(finals.pop())
    s = float(next(r["final"] for r in got if r["optimizer"] == opt))
    assert abs(s - e) <= 0.01 * abs(e), f"{opt}: standard final_loss {s} is not within 1 % of exact {e}"

for args, text in ((["--gradients", "fast"], "--gradients must be standard or exact, got 'fast'"),
                   (["--schedule", "nope"], "--schedule must be one of 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v, got 'nope'"),
                   (["--schedule", "gis-g"], "--schedule gis-g needs --group G, an integer in [2, 4]"),
                   (["--group", "3"], "--group applies only to --schedule gis-g, not 1f1b-i"),
                   (["--steps", "0"], "--steps must be an integer in [1, 10000], got '0'"),
                   (["--eval-every", "x"], "--eval-every must be an integer in [1, 10000], got 'x'"),
                   (["--steps"], "--steps needs a value"),
                   (["--bogus"], "unknown option '--bogus'")):
    p = run(*args, code=2)
    lines = p.stderr.splitlines()
    if len(lines) != 1 or text not in lines[0] or p.stdout:
        sys.exit(f"FAIL: {args}: expected one line with {text!r} on stderr and nothing on stdout, got {p.stderr!r} / {p.stdout!r}")
print("ok")
