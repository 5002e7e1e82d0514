#!/usr/bin/env python3
"""samples/train_gpt --backend cuda --ranks-per-gpu N: several pipeline ranks on one GPU
(comm::SharedGpu), a GPU test (exit 77, Meson's SKIP, without a GPU or a CUDA build).

On the exact gradient path a run's bits do not depend on the placement, so every multi-rank
run on one GPU must print the closing lines of the same model on one rank of the GPU (the same
stages, the same global batch): PO-F and ZB-V at d = 4 (8 stages), and 2 replicas of a 2-rank
pipeline with ZeRO-1. The one-rank run is also within 3% of the CPU's final loss (bf16 against
fp32), and a rank that throws mid-step ends every rank, each naming it, within 30 s. And the arguments: --ranks-per-gpu without --backend cuda, and too few GPUs
for the ranks named with the flag that fits.

usage: test_shared_gpu.py path/to/train_gpt
"""
import subprocess
import sys
import time

exe = sys.argv[1]
model = ["--layers", "8", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2", "--steps", "6", "--quiet",
         "--gradients", "exact"]


def run(*args, code=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=500)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected {code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def finals(p):
    lines = [l for l in p.stdout.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    assert len(lines) == 2 and p.stdout.splitlines()[-2:] == lines, p.stdout
    return lines


probe = subprocess.run([exe, "--backend", "cuda", "--ranks", "1", "--chunks", "1", "--steps", "1", "--quiet"],
                       capture_output=True, text=True, timeout=300)
if "built without CUDA" in probe.stderr or "this machine has 0" in probe.stderr:
    print("no GPU (or no CUDA build): SKIP")
    sys.exit(77)

err = run("--ranks-per-gpu", "2", code=2).stderr
assert "--ranks-per-gpu applies only to --backend cuda" in err, err
err = run("--backend", "cuda", "--ranks", "4", "--dp", "8", "--chunks", "2", *model, code=2).stderr
assert "needs" in err and "--ranks-per-gpu 32" in err, err
err = run("--backend", "cuda", "--ranks", "4", "--chunks", "2", "--ranks-per-gpu", "2", *model, code=2).stderr
assert "--ranks-per-gpu 2 would spread the 4 ranks over 2 GPUs" in err and "give --ranks-per-gpu 4" in err, err

one = finals(run("--backend", "cuda", "--ranks", "1", "--chunks", "8", "--schedule", "gis", "--microbatches", "8", *model))
for schedule in ("po-f", "zb-v"):
    got = finals(run("--backend", "cuda", "--ranks", "4", "--chunks", "2", "--ranks-per-gpu", "4", "--schedule", schedule,
                     "--microbatches", "8", *model))
    if got != one:
        sys.exit(f"FAIL: {schedule} on 4 ranks of one GPU gave {got}, one rank {one}")
wide = finals(run("--backend", "cuda", "--ranks", "1", "--chunks", "4", "--schedule", "gis", "--microbatches", "16",
                  *model))
got = finals(run("--backend", "cuda", "--ranks", "2", "--chunks", "2", "--dp", "2", "--zero", "1", "--ranks-per-gpu", "4",
                 "--schedule", "1f1b-i", "--microbatches", "8", *model))
if got != wide:
    sys.exit(f"FAIL: dp 2 x d 2 with ZeRO-1 on one GPU gave {got}, one rank {wide}")
cpu = finals(run("--backend", "cpu", "--ranks", "4", "--chunks", "2", "--schedule", "po-f", "--microbatches", "8", *model))
g, c = float(one[0].split("=")[1]), float(cpu[0].split("=")[1])
if abs(g - c) > 0.03 * abs(c):
    sys.exit(f"FAIL: final loss on one GPU {g} vs the CPU {c}: more than 3% apart")
# A rank that throws mid-step ends every rank sharing the GPU, each naming it, within 30 s.
t0 = time.monotonic()
p = run("--backend", "cuda", "--ranks", "4", "--chunks", "2", "--ranks-per-gpu", "4", "--schedule", "po-f",
        "--microbatches", "8", *model, "--inject-fault", "2:1:throw", code=1)
took = time.monotonic() - t0
for g in range(4):
    if f"rank {g}:" not in p.stderr or "injected fault (--inject-fault 2:1:throw)" not in p.stderr:
        sys.exit(f"FAIL: rank {g} did not report the injected fault:\n{p.stderr}")
if took > 30:
    sys.exit(f"FAIL: the failing run took {took:.1f} s to end (30 s allowed)")
print(f"ok: PO-F and ZB-V on 4 ranks of one GPU, dp 2 x d 2 ZeRO-1: the one-rank bits {one}; CPU loss {c}")
