#!/usr/bin/env python3
"""samples/train_gpt --backend cuda against --backend cpu (a GPU test: exit 77, Meson's SKIP,
when the machine has no GPU).

The same model, data, seed and PO-F schedule on 2 GPUs (1 GPU: one rank, 4 chunks) and on CPU
thread ranks, for the GPT and the Llama, unpacked and packed (--pack): the GPU run must print the same closing lines, its loss
must fall, and its final loss must be within 3% of the CPU run's (bf16 activations against fp32: close, not bit-equal;
tests/cuda/test_runtime_gpu.cpp argues the bound per step); --k auto (a profiling pass, then the
slab made again for the rebuilt program) ends as --k 1, bit for bit. And the planner's CUDA memory is
what the GPU run reserves: pipeoffload-plan --auto's train_gpt command, run on the GPUs, prints
reserved_bytes_per_rank equal to the plan's per_rank device_bytes less its reserve (the CUDA
context and NCCL), to the byte (tests/runtime/test_plan_memory.cpp holds the same on the
CPU through train_gpt's cuda_rank_bytes).

usage: test_train_gpt_cuda.py path/to/train_gpt [path/to/pipeoffload-plan]
(the plan tool defaults to the one in train_gpt's build directory)
"""
import json
import os
import subprocess
import sys

exe = sys.argv[1]
common = ["--schedule", "po-f", "--microbatches", "8", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "64",
          "--batch", "2", "--steps", "60", "--quiet"]


def run(*args):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=500)


def final_loss(p, what):
    if p.returncode != 0:
        sys.exit(f"FAIL: {what} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    lines = [l for l in p.stdout.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    assert len(lines) == 2 and p.stdout.splitlines()[-2:] == lines, p.stdout
    return float(lines[0].split("=")[1])


shape = ["--ranks", "2", "--chunks", "2"]
probe = run("--backend", "cuda", *shape, *common[:-3], "--steps", "1", "--quiet")
if "built without CUDA" in probe.stderr or "this machine has 0" in probe.stderr:
    print("no GPU (or no CUDA build): SKIP")
    sys.exit(77)
if "this machine has 1" in probe.stderr:
    shape = ["--ranks", "1", "--chunks", "4"]

# A run whose arena the GPU cannot hold is refused before any rank takes memory: exit 2, the need named.
big = run("--backend", "cuda", "--ranks", "1", "--chunks", "1", "--schedule", "gis", "--layers", "512", "--hidden", "8192",
          "--heads", "64", "--seq", "4096", "--batch", "8", "--microbatches", "64", "--steps", "1", "--quiet")
if big.returncode != 2 or "needs" not in big.stderr or "GiB free of" not in big.stderr:
    sys.exit(f"FAIL: a run larger than the GPU: exit {big.returncode}\n{big.stderr}")

gpu = run("--backend", "cuda", *shape, *common)
cpu = run("--backend", "cpu", *shape, *common)
g, c = final_loss(gpu, "--backend cuda"), final_loss(cpu, "--backend cpu")
assert abs(g - c) <= 0.03 * abs(c), f"final loss on the GPU {g} vs the CPU {c}: more than 3% apart"

# The Llama-class model (llama::CudaLlamaStage: grouped-query attention, tied output) the same way.
llama = ["--model", "llama", "--kv-heads", "2", "--ffn", "128", "--tie-embeddings"]
gl = final_loss(run("--backend", "cuda", *shape, *llama, *common), "--model llama --backend cuda")
cl = final_loss(run("--backend", "cpu", *shape, *llama, *common), "--model llama --backend cpu")
assert abs(gl - cl) <= 0.03 * abs(cl), f"the Llama's final loss on the GPU {gl} vs the CPU {cl}: more than 3% apart"

# Packed rows (--pack 10: a document at every newline of the corpus) through cuDNN's ragged
# attention, both models, against the same packed run on the CPU.
for model in ([], llama):
    what = "--pack 10" + (" --model llama" if model else "")
    gp = final_loss(run("--backend", "cuda", *shape, *model, *common, "--pack", "10"), what + " --backend cuda")
    cp = final_loss(run("--backend", "cpu", *shape, *model, *common, "--pack", "10"), what + " --backend cpu")
    assert abs(gp - cp) <= 0.03 * abs(cp), f"{what}: final loss on the GPU {gp} vs the CPU {cp}: more than 3% apart"

# Loss falls on the GPU (progress lines: "[...] step N/M loss X ...").
verbose = run("--backend", "cuda", *shape, *[a for a in common if a != "--quiet"])
# --k auto on the GPU: the profiling pass runs on a slab sized for the all-offloaded program,
# the slab is made again for the program rebuilt from the measured times (reset_arena), and
# the run ends as the --k 1 run, bit for bit (PO-F's passes and sums do not depend on which
# units it offloads).
auto = run("--backend", "cuda", *shape, *[a for a in common if a != "--quiet"], "--k", "auto")
final_loss(auto, "--backend cuda --k auto")
closing = [[l for l in p.stdout.splitlines() if l.startswith(("final_loss=", "params_hash="))] for p in (verbose, auto)]
if closing[0] != closing[1] or "k auto: measured k = " not in auto.stdout:
    sys.exit(f"FAIL: --backend cuda --k auto ends {closing[1]}; --k 1 ends {closing[0]}\n{auto.stdout[-2000:]}")
losses = [float(l.split(" loss ")[1].split()[0]) for l in verbose.stdout.splitlines() if l.startswith("[")]
assert len(losses) >= 2 and losses[-1] < losses[0] - 0.5, losses
# The plan's memory is the run's: the planner's choice for this GPT on these GPUs, run by train_gpt.
plan_tool = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(exe))),
                                                               "pipeoffload-plan")
if not os.path.exists(plan_tool):
    sys.exit(f"FAIL: no plan tool at {plan_tool} (build pipeoffload-plan, or give its path)")
q = subprocess.run([plan_tool, "--auto", "--layers", "4", "--hidden", "64", "--heads", "4", "--query-groups", "4",
                    "--seq", "64", "--micro-batch", "2", "--global-batch", "16", "--vocab", "256", "--ranks",
                    shape[1], "--recompute", "--device-mem-gib", "40", "--host-mem-gib", "16", "--tflops", "10",
                    "--pcie-gbps", "25", "--format", "json"], capture_output=True, text=True, timeout=300)
doc = json.loads(q.stdout)
args = doc["train_gpt_args"]
assert args, doc.get("train_gpt_args_why_not")
p = run(*args, "--steps", "2", "--quiet")
final_loss(p, "the plan's train_gpt command " + " ".join(args))
line = [l for l in p.stdout.splitlines() if l.startswith("reserved_bytes_per_rank=")]
reserved = [int(b) for b in line[0].split("=", 1)[1].split(",")]
planned = [int(r["device_bytes"] - r["reserve_bytes"]) for r in doc["per_rank"]]
assert reserved == planned, f"train_gpt {' '.join(args)} reserved {reserved}; the plan says {planned}"
planned_run = f"{doc['schedule']} v={doc['chunks']} reserved {reserved} bytes, as planned"
print("ok: GPU final loss", g, "CPU", c, "; the Llama's", gl, "and", cl, "; --k auto as --k 1;", planned_run)
