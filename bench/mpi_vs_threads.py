#!/usr/bin/env python3
"""MPI processes vs thread ranks: the same train_gpt run, side by side (issue 5).

usage: mpi_vs_threads.py path/to/train_gpt [path/to/mpirun] [--repeats N] [--steps N] [--schedule S]

Checks first that both give the same final_loss/params_hash (the result the timing is for),
then runs them alternately N times and prints, per communicator, the median iteration time
and the ratio MPI / threads of the medians. Iteration time is the runtime's own per-step
clock (StepStats::seconds: all passes and messages of one iteration, enqueue to last stream
idle; the optimizer step is not in it), averaged over the run's steps. Formula:
iteration = tokens_per_step / (tokens/s of the last progress line).

    python3 bench/mpi_vs_threads.py build/samples/train_gpt
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("train_gpt")
ap.add_argument("mpirun", nargs="?", default=shutil.which("mpirun"))
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--schedule", default="po-f")
a = ap.parse_args()
if not a.mpirun:
    sys.exit("mpi_vs_threads: mpirun not found (install openmpi-bin)")

# Container-friendly OpenMPI settings (no network, maybe root, few cores).
for k, v in {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
             "OMPI_MCA_hwloc_base_binding_policy": "none", "OMPI_MCA_btl": "self,vader",
             "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}.items():
    os.environ.setdefault(k, v)

d, v, m = 4, 2, 8
model = ["--layers", "8", "--hidden", "64", "--seq", "64", "--batch", "4"]
args = ["--schedule", a.schedule, "--chunks", str(v), "--microbatches", str(m), "--steps", str(a.steps), *model]
tokens_per_step = 4 * 64 * m


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"mpi_vs_threads: {' '.join(cmd)} exited {p.returncode}\n{p.stderr}")
    prog = [l for l in p.stdout.splitlines() if l.startswith("[")]
    tps = float(re.search(r"\| (\d+) tokens/s \|", prog[-1]).group(1))
    finals = [l for l in p.stdout.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    return tokens_per_step / tps, finals


threads_cmd = [a.train_gpt, "--ranks", str(d), *args]
mpi_cmd = [a.mpirun, "-np", str(d), a.train_gpt, "--comm", "mpi", *args]
_, ft = run(threads_cmd)
_, fm = run(mpi_cmd)
if ft != fm:
    sys.exit(f"mpi_vs_threads: results differ: threads {ft}, MPI {fm}")
times = {"threads": [], "mpi": []}
for _ in range(a.repeats):
    times["threads"].append(run(threads_cmd)[0])
    times["mpi"].append(run(mpi_cmd)[0])
med = {k: statistics.median(t) for k, t in times.items()}
print(f"train_gpt {a.schedule}, d={d} v={v} m={m}, GPT 8 blocks h=64 seq=64 batch=4, {a.steps} steps, {a.repeats} runs each, "
      f"{os.cpu_count()} cores; results identical ({ft[1]})")
for k in ("threads", "mpi"):
    print(f"  {k:8s} iteration median {med[k] * 1e3:8.2f} ms  (runs: {' '.join(f'{t * 1e3:.1f}' for t in times[k])})")
print(f"  ratio MPI / threads (medians): {med['mpi'] / med['threads']:.2f}")
