#!/usr/bin/env python3
"""Data parallelism in samples/train_gpt on thread ranks. With --gradients exact, R replicas of a
d-rank pipeline with M microbatches each train exactly as one replica of R*M (final_loss and
params_hash identical), for every replica count, rank count and schedule; ZeRO-1 changes nothing
but the optimizer state, which it divides by R; a checkpoint written under one replica count
resumes under another (and under the other gradient path). With the default standard path a run
is deterministic, ZeRO-1 gives the ZeRO-0 bits, the final loss is within 1 % of the exact path's,
and the printed state and traffic per parameter are within the formulas (docs/gradients.md). A
throwing rank of one replica ends every rank of every replica with its message.

usage: test_train_gpt_dp.py path/to/train_gpt
"""
import re
import subprocess
import sys
import tempfile

exe = sys.argv[1]


def run(*args, code=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected {code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def finals(out):
    lines = [l for l in out.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    assert len(lines) == 2, lines
    return lines


GLOBAL = 24  # microbatches per step, split over the replicas (a multiple of d for 1f1b-i)
small = ["--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2", "--steps", "3", "--quiet",
         "--gradients", "exact"]
standard = small[:-2]  # the default gradient path


def per_replica(dp):
    return ["--dp", str(dp), "--microbatches", str(GLOBAL // dp)]


ref = finals(run("--ranks", "1", "--chunks", "1", *per_replica(1), *small).stdout)
runs = 0
for dp in (1, 2, 3):
    for d, schedules in ((1, ["gis"]), (2, ["1f1b-i", "gis-h", "po-h", "po-f"]), (4, ["1f1b-i", "gis-h", "po-h", "po-f"])):
        for sched in schedules:
            args = ["--schedule", sched, "--ranks", str(d), "--chunks", "1" if d == 1 else "2", *per_replica(dp), *small]
            got = finals(run(*args).stdout)
            runs += 1
            if got != ref:
                sys.exit(f"FAIL: {' '.join(args)} gave {got}; one replica of {GLOBAL} microbatches gave {ref}")

# Folding every 4 microbatches (--exact-block 4, fp32 in order inside a block): another sum, but
# the same for every split of the global batch whose per-replica m is a multiple of 4.
block = finals(run("--ranks", "1", "--chunks", "1", *per_replica(1), *small, "--exact-block", "4").stdout)
for dp, d, sched in ((2, 2, "po-f"), (3, 4, "gis-h"), (2, 4, "1f1b-i")):
    args = ["--schedule", sched, "--ranks", str(d), "--chunks", "2", *per_replica(dp), *small, "--exact-block", "4"]
    got = finals(run(*args).stdout)
    runs += 1
    if got != block:
        sys.exit(f"FAIL: {' '.join(args)} gave {got}; one replica with --exact-block 4 gave {block}")

# ZeRO-1: the same bits, and the optimizer state of a rank is 1/dp of the unsharded one
# (rounded up to whole slices: ceil(n / dp) per stage).
state = {}
for dp, zero in ((2, 0), (2, 1), (3, 1)):
    out = run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--zero", str(zero), *per_replica(dp), *small).stdout
    if finals(out) != ref:
        sys.exit(f"FAIL: --dp {dp} --zero {zero} gave {finals(out)}, expected {ref}")
    state[(dp, zero)] = int(re.search(r"optimizer state of global rank 0 \(AdamW moments, zero \d\): (\d+) bytes", out).group(1))
full = state[(2, 0)]
for dp in (2, 3):
    # AdamW holds 2 fp32 moments per parameter; rank 0's stages hold n = full / 8 parameters in
    # two chunks, each sharded into ceil(n_c / dp): at most 2 values of rounding per chunk.
    got = state[(dp, 1)]
    if not (full / dp <= got <= full / dp + 2 * 2 * 4 * dp):
        sys.exit(f"FAIL: --zero 1 --dp {dp}: optimizer state {got} bytes, unsharded {full} (expected about {full / dp:.0f})")

# A checkpoint is per stage: written under dp = 2, resumed under dp = 1 and dp = 3 (same global
# batch), bit-identical to the uninterrupted run.
with tempfile.TemporaryDirectory() as tmp:
    long = [a if a != "3" else "4" for a in small]  # --steps 4
    whole = finals(run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", *per_replica(1), *long).stdout)
    run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--zero", "1", *per_replica(2), *long,
        "--checkpoint-every", "3", "--checkpoint-dir", tmp)  # step 3 of 4: the one to resume
    for dp, zero in ((1, 0), (3, 1)):
        got = finals(run("--schedule", "gis-h", "--ranks", "4", "--chunks", "1", "--zero", str(zero), *per_replica(dp), *long,
                         "--resume", tmp).stdout)
        if got != whole:
            sys.exit(f"FAIL: resumed under --dp {dp} from a --dp 2 checkpoint: {got}, uninterrupted {whole}")
    # The same checkpoint resumes on the standard path (fp32 master values, the same AdamW state).
    run("--schedule", "gis-h", "--ranks", "4", "--chunks", "1", *per_replica(2), *long[:-2], "--resume", tmp)

# The standard path: deterministic, ZeRO-1 = ZeRO-0, close to the exact path; a checkpoint
# of it resumes on the exact path and back.
for dp, d, sched in ((2, 2, "po-f"), (3, 4, "gis-h")):
    args = ["--schedule", sched, "--ranks", str(d), "--chunks", "2", *per_replica(dp), *standard]
    a, b, z = (finals(run(*args, *extra).stdout) for extra in ([], [], ["--zero", "1"]))
    if not (a == b == z):
        sys.exit(f"FAIL: standard gradients {' '.join(args)}: runs differ: {a}, {b}, --zero 1 {z}")
    exact_loss, loss = float(ref[0].split("=")[1]), float(a[0].split("=")[1])
    if abs(loss - exact_loss) > 0.01 * abs(exact_loss):
        sys.exit(f"FAIL: standard final loss {loss} is not within 1 % of the exact path's {exact_loss}")


def figures(out):
    x = float(re.search(r"^state_bytes_per_parameter=(\S+)$", out, re.M).group(1))
    y = float(re.search(r"^reduce_bytes_per_parameter=(\S+)$", out, re.M).group(1))
    return x, y


def widen(args):  # --hidden 64, buckets of 4096
    return [*(("64" if a == "32" else a) for a in args), "--reduce-bucket", "4096"]


# Bytes per parameter, --dp 8 --zero 1 on 2 ranks: fp32 working parameters and gradients (4 + 4),
# AdamW's moments sharded (8 / 8), one bucket's staging; traffic: fp32 reduce-scatter and
# parameter all-gather, 8 * 7/8. "Plus padding": each bucket is a multiple of 8 values (at most
# 7 of padding) and the staging is 8.5 bytes a value of one bucket of 4096 (0.3 B/param here).
out = run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--dp", "8", "--microbatches", "3", "--zero", "1",
          *widen(standard)).stdout
x, y = figures(out)
if not (4 + 4 + 8 / 8 <= x <= 4 + 4 + 12 / 8 + 0.5):
    sys.exit(f"FAIL: --dp 8 --zero 1: state_bytes_per_parameter={x}, expected within [9, 4 + 4 + 12/8 + 0.5]")
if not (0.99 * 8 * 7 / 8 <= y <= 8 * 7 / 8 * 1.01):
    sys.exit(f"FAIL: --dp 8 --zero 1: reduce_bytes_per_parameter={y}, expected 8 * 7/8 = 7 plus padding")
# The exact path holds its 16-byte sums and sends 128-bit sums: 20 * 7/8 + the parameters' 4 * 7/8.
xe, ye = figures(run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--dp", "8", "--microbatches", "3",
                     "--zero", "1", *widen(small)).stdout)
if not (x + 16 <= xe <= x + 16 + 1.5 and 0.99 * 24 * 7 / 8 <= ye <= 24 * 7 / 8 * 1.01):
    sys.exit(f"FAIL: --gradients exact --dp 8 --zero 1: {xe}, {ye}; standard {x}, {y}")
# A bfloat16 reduce-scatter: the same state, 2 bytes a gradient sent instead of 4 (6 * 7/8), the
# same bits run to run, and within 1 % of the fp32 reduction's loss.
bf16_args = ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--dp", "8", "--microbatches", "3", "--zero", "1",
             *widen(standard), "--reduce-dtype", "bf16"]
out_b = run(*bf16_args).stdout
xb, yb = figures(out_b)
if not (xb == x and 0.99 * 6 * 7 / 8 <= yb <= 6 * 7 / 8 * 1.01):
    sys.exit(f"FAIL: --reduce-dtype bf16 --dp 8 --zero 1: {xb}, {yb}; expected {x} and 6 * 7/8 = 5.25 plus padding")
if finals(out_b) != finals(run(*bf16_args).stdout):
    sys.exit("FAIL: --reduce-dtype bf16: two runs differ")
loss_b, loss_f = float(finals(out_b)[0].split("=")[1]), float(finals(out)[0].split("=")[1])
if abs(loss_b - loss_f) > 0.01 * abs(loss_f):
    sys.exit(f"FAIL: --reduce-dtype bf16 final loss {loss_b} is not within 1 % of fp32's {loss_f}")
p = run(*bf16_args[:-2], "--gradients", "exact", "--reduce-dtype", "bf16", code=2)
if "--reduce-dtype bf16 needs --gradients standard" not in p.stderr:
    sys.exit(f"FAIL: --reduce-dtype bf16 --gradients exact was not refused with its sentence:\n{p.stderr}")

# A rank of replica 1 that throws ends every rank of both replicas, each naming it.
p = run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", *per_replica(2), *small, "--inject-fault", "3:1:throw", code=1)
for g in range(4):
    if f"rank {g}:" not in p.stderr:
        sys.exit(f"FAIL: rank {g} did not report the failure:\n{p.stderr}")
if p.stderr.count("injected fault") < 4:
    sys.exit(f"FAIL: every rank should name the injected fault:\n{p.stderr}")

for args, text in ((["--dp", "0"], "--dp must be an integer in [1, 64], got '0'"),
                   (["--zero", "2"], "--zero must be an integer in [0, 1], got '2'"),
                   (["--gradients", "exact", "--microbatches", "6", "--exact-block", "4"],
                    "--exact-block 4 must divide --microbatches 6"),
                   (["--exact-block", "2"], "--exact-block needs --gradients exact"),
                   (["--gradients", "fp8"], "--gradients must be standard or exact, got 'fp8'")):
    err = run(*args, code=2).stderr
    if text not in err:
        sys.exit(f"FAIL: {args}: expected {text!r} in {err!r}")
print(f"ok: {runs} grids equal to one replica; ZeRO-1 state {state}; resume across dp; faults")
