#!/usr/bin/env python3
"""samples/train_gpt's contract: the final lines are printed once and are the same for the
one-rank reference and for pipelined runs of any schedule, on the standard gradient path (the
default: every schedule runs W in microbatch order) and on the exact one; a checkpoint resumes
under another cut of the model; bad arguments exit 2 with a sentence.

usage: test_train_gpt.py path/to/train_gpt
"""
import os
import re
import subprocess
import sys
import tempfile

exe = sys.argv[1]


def run(*args, code=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected {code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def finals(out):
    lines = [l for l in out.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    assert len(lines) == 2 and lines[0].startswith("final_loss=") and lines[1].startswith("params_hash="), lines
    assert out.splitlines()[-2:] == lines, "the final lines must come last"
    return lines


small = ["--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2", "--microbatches", "4", "--steps", "4", "--quiet"]
ref = finals(run("--ranks", "1", "--chunks", "1", *small).stdout)
for extra in (["--schedule", "po-f", "--ranks", "2", "--chunks", "2"],
              ["--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2"],
              ["--schedule", "gis-h", "--ranks", "4", "--chunks", "1", "--offload-chunks", "1", "--copy-gbps", "1"],
              ["--schedule", "1f1b", "--ranks", "4", "--chunks", "1"],
              ["--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--copy-gbps", "0.5", "--pcie-pairs"],
              # The zero-bubble families, ZB-V, V-Half, V-Min and DualPipeV on the V placement, with offload too.
              ["--schedule", "zb-h1", "--ranks", "4", "--chunks", "1"],
              ["--schedule", "zb-h2", "--ranks", "2", "--chunks", "1", "--offload-chunks", "1", "--copy-gbps", "1"],
              ["--schedule", "zb-v", "--ranks", "4", "--chunks", "2"],
              ["--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--offload-chunks", "2", "--copy-gbps", "1"],
              ["--schedule", "v-half", "--ranks", "3", "--chunks", "2"],
              ["--schedule", "v-min", "--ranks", "4", "--chunks", "2", "--offload-chunks", "1", "--copy-gbps", "0.5"],
              ["--schedule", "dualpipe-v", "--ranks", "2", "--chunks", "2"],
              ["--schedule", "dualpipe-v", "--ranks", "2", "--chunks", "2", "--offload-chunks", "2", "--copy-gbps", "1"],
              # Uneven stages (--stage-blocks): the first and last stage without blocks, or with more.
              ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--stage-blocks", "0,2,2,0"],
              ["--schedule", "1f1b", "--ranks", "3", "--chunks", "1", "--stage-blocks", "1,3,0"],
              ["--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--stage-blocks", "2,0,1,1"]):
    got = finals(run(*extra, *small).stdout)
    if got != ref:
        sys.exit(f"FAIL: {' '.join(extra)} gave {got}, the one-rank reference {ref}")

# --graphs (RuntimeOptions::graphs): steps captured once and replayed give the bits of steps run.
for extra in (["--ranks", "1", "--chunks", "1"], ["--schedule", "po-f", "--ranks", "2", "--chunks", "2"],
              ["--schedule", "zb-v", "--ranks", "2", "--chunks", "2", "--dp", "2", "--zero", "1"]):
    plain = finals(run(*extra, *small).stdout)
    out = run(*extra, *small, "--graphs").stdout
    if finals(out) != plain:
        sys.exit(f"FAIL: {' '.join(extra)} --graphs gave {finals(out)}, without it {plain}")
err = run("--graphs", "--pcie-pairs", "--schedule", "po-f", "--ranks", "2", code=2).stderr
assert "--graphs replays captured copies, which cannot follow --pcie-pairs' counters" in err, err

# Reloads in parts (the default: the head's, then each block's) or whole (--no-reload-parts):
# the same bits, paced or not, with one copy stream or two.
for extra in (["--schedule", "po-f", "--ranks", "1", "--chunks", "2", "--copy-gbps", "0.5", "--no-reload-parts"],
              ["--schedule", "po-h", "--ranks", "2", "--chunks", "2", "--copy-gbps", "0.5", "--copy-streams", "2",
               "--no-reload-parts"]):
    got = finals(run(*extra, *small).stdout)
    if got != ref:
        sys.exit(f"FAIL: {' '.join(extra)} gave {got}, the one-rank reference {ref}")

# --copy-streams 2: offloads and reloads on streams of their own (paced copies, so that they
# overlap for real), the same bits; auto says which it took; bad values exit 2.
for extra in (["--schedule", "po-f", "--ranks", "1", "--chunks", "4", "--copy-gbps", "0.5", "--copy-streams", "2"],
              ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--copy-gbps", "0.5", "--copy-streams", "2",
               "--duplex-slowdown", "1.3"],
              ["--schedule", "po-h", "--ranks", "3", "--chunks", "2", "--copy-streams", "auto", "--k", "auto"]):
    got = finals(run(*extra, *small).stdout)
    if got != ref:
        sys.exit(f"FAIL: {' '.join(extra)} gave {got}, the one-rank reference {ref}")
out = run("--schedule", "po-f", "--ranks", "1", "--chunks", "4", "--copy-streams", "auto", "--k", "4", *small[:-1]).stdout
assert re.search(r"^copy streams: [12] \(auto: the faster in the simulator\)$", out, re.M), out
err = run("--copy-streams", "3", code=2).stderr
assert "--copy-streams 3 is not one of 1, 2, auto" in err, err
err = run("--duplex-slowdown", "1.3", code=2).stderr
assert "--duplex-slowdown needs --copy-streams 2 or auto" in err, err
err = run("--copy-streams", "2", "--pcie-pairs", "--ranks", "2", code=2).stderr
assert "--copy-streams 2 with --pcie-pairs: paired ranks share their switch's link" in err, err

# The exact gradient path (--gradients exact) has its own bits, the same for every schedule too.
exact_ref = finals(run("--ranks", "1", "--chunks", "1", *small, "--gradients", "exact").stdout)
if exact_ref == ref:
    sys.exit("FAIL: --gradients exact gave the standard path's bits")
for extra in (["--schedule", "po-f", "--ranks", "2", "--chunks", "2"], ["--schedule", "zb-v", "--ranks", "2", "--chunks", "2"],
              ["--schedule", "gis-h", "--ranks", "2", "--chunks", "2", "--stage-blocks", "1,1,2,0"]):
    got = finals(run(*extra, *small, "--gradients", "exact").stdout)
    if got != exact_ref:
        sys.exit(f"FAIL: {' '.join(extra)} --gradients exact gave {got}, the one-rank reference {exact_ref}")

# --tie-embeddings: the head's weight is the embedding, one parameter on two stages. Its own bits
# (not the untied model's), the same under every placement of the two holders (on one rank: the
# V and one rank; on two: the others), with replicas and ZeRO-1, on both gradient paths; a
# checkpoint resumes it on another cut; the CUDA GPT refuses it with a sentence.
for path in ("standard", "exact"):
    tied_ref = finals(run("--ranks", "1", "--chunks", "1", *small, "--gradients", path, "--tie-embeddings").stdout)
    if tied_ref == (ref if path == "standard" else exact_ref):
        sys.exit(f"FAIL: --tie-embeddings --gradients {path} gave the untied model's bits")
    for extra in (["--schedule", "zb-v", "--ranks", "2", "--chunks", "2"], ["--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2"],
                  ["--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--stage-blocks", "0,1,1,0,0,1,1,0"],
                  *([["--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", "--dp", "2", "--zero", "1"],
                     ["--schedule", "v-half", "--ranks", "2", "--chunks", "2", "--dp", "2"]]
                    if path == "exact" else [])):
        base = small
        if "--dp" in extra:  # two replicas of 2 microbatches: the same global batch
            base = [a if i != small.index("--microbatches") + 1 else "2" for i, a in enumerate(small)]
        got = finals(run(*extra, *base, "--gradients", path, "--tie-embeddings").stdout)
        if got != tied_ref:
            sys.exit(f"FAIL: --tie-embeddings --gradients {path} {' '.join(extra)} gave {got}, one rank {tied_ref}")
with tempfile.TemporaryDirectory() as ck:
    tied = ["--gradients", "exact", "--tie-embeddings"]
    run("--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", *small, *tied, "--checkpoint-every", "3", "--checkpoint-dir", ck)
    for extra in (["--schedule", "zb-v", "--ranks", "2", "--chunks", "2"], ["--ranks", "1", "--chunks", "1"]):
        out = run(*extra, *small, *tied, "--resume", ck).stdout
        if finals(out) != tied_ref:
            sys.exit(f"FAIL: --tie-embeddings {' '.join(extra)} resumed: {finals(out)}, uninterrupted {tied_ref}")
err = run("--backend", "cuda", "--tie-embeddings", code=2).stderr
if "the CUDA GPT does not tie its embeddings yet" not in err:
    sys.exit(f"FAIL: --backend cuda --tie-embeddings: {err!r}")

# --model llama (RMSNorm, RoPE, grouped-query attention, SwiGLU): its own bits, the same for
# every placement, cut and replica count on the exact path, tied or not; it learns; a
# checkpoint resumes it on another cut; its flags are refused where they do not apply.
llama = ["--model", "llama", "--kv-heads", "2"]
for tie in ([], ["--tie-embeddings"]):
    llama_ref = finals(run("--ranks", "1", "--chunks", "1", *small, *llama, *tie, "--gradients", "exact").stdout)
    if llama_ref == exact_ref:
        sys.exit("FAIL: --model llama gave the GPT's bits")
    for extra in (["--schedule", "zb-v", "--ranks", "2", "--chunks", "2"],
                  ["--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--stage-blocks", "0,1,1,0,0,1,1,0"],
                  ["--schedule", "1f1b", "--ranks", "3", "--chunks", "1"]):
        got = finals(run(*extra, *small, *llama, *tie, "--gradients", "exact").stdout)
        if got != llama_ref:
            sys.exit(f"FAIL: --model llama {' '.join(tie + extra)} gave {got}, one rank {llama_ref}")
    two = [a if i != small.index("--microbatches") + 1 else "2" for i, a in enumerate(small)]
    got = finals(run("--schedule", "1f1b-i", "--ranks", "2", "--chunks", "2", "--dp", "2", "--zero", "1", *two, *llama,
                     *tie, "--gradients", "exact").stdout)
    if got != llama_ref:
        sys.exit(f"FAIL: --model llama {' '.join(tie)} --dp 2 --zero 1 gave {got}, one rank {llama_ref}")
with tempfile.TemporaryDirectory() as ck:
    run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", *small, *llama, "--gradients", "exact",
        "--checkpoint-every", "3", "--checkpoint-dir", ck)
    got = finals(run("--ranks", "1", "--chunks", "1", *small, *llama, "--gradients", "exact", "--resume", ck).stdout)
    want = finals(run("--ranks", "1", "--chunks", "1", *small, *llama, "--gradients", "exact").stdout)
    if got != want:
        sys.exit(f"FAIL: --model llama resumed on one rank from a 4-stage checkpoint: {got}, uninterrupted {want}")
out = run("--ranks", "2", "--chunks", "1", "--schedule", "1f1b", "--layers", "2", "--hidden", "32", "--seq", "16",
          "--batch", "4", "--microbatches", "2", "--steps", "40", "--lr", "1e-2", *llama).stdout
losses = [float(l.split(" loss ")[1].split()[0]) for l in out.splitlines() if l.startswith("[")]
if not losses[-1] < losses[0] - 0.5 or "Llama 2 blocks h=32 heads=4 kv-heads=2 ffn=96" not in out:
    sys.exit(f"FAIL: --model llama does not learn or name itself: {losses}\n{out[:300]}")

# --pack: sequences hold documents (a new one at every newline of the corpus); packed training
# has its own bits, the same on every placement and cut, for either model, and learns; its
# errors name the value.
for arch in ([], llama):
    pack = [*arch, "--pack", "10"]
    pack_ref = finals(run("--ranks", "1", "--chunks", "1", *small, *pack, "--gradients", "exact").stdout)
    if pack_ref == finals(run("--ranks", "1", "--chunks", "1", *small, *arch, "--gradients", "exact").stdout):
        sys.exit(f"FAIL: {' '.join(pack)} gave the unpacked run's bits")
    for extra in (["--schedule", "zb-v", "--ranks", "2", "--chunks", "2"],
                  ["--schedule", "po-f", "--ranks", "4", "--chunks", "2", "--stage-blocks", "0,1,1,0,0,1,1,0"]):
        got = finals(run(*extra, *small, *pack, "--gradients", "exact").stdout)
        if got != pack_ref:
            sys.exit(f"FAIL: {' '.join(pack + extra)} gave {got}, one rank {pack_ref}")
out = run("--ranks", "2", "--chunks", "1", "--schedule", "1f1b", "--layers", "2", "--hidden", "32", "--seq", "64",
          "--batch", "4", "--microbatches", "2", "--steps", "40", "--lr", "1e-2", *pack).stdout
losses = [float(l.split(" loss ")[1].split()[0]) for l in out.splitlines() if l.startswith("[")]
if not losses[-1] < losses[0] - 0.5 or "packed (a document at every token 10)" not in out:
    sys.exit(f"FAIL: --pack does not learn or say so: {losses}\n{out[:300]}")
for args, text in ((["--kv-heads", "2"], "--kv-heads applies only to --model llama"),
                   (["--ranks-per-gpu", "2"], "--ranks-per-gpu applies only to --backend cuda"),
                   (["--backend", "cuda", "--graphs", "--pack", "10"], "--graphs with --pack on --backend cuda"),
                   (["--backend", "cuda", "--graphs", "--trace", "t.json"],
                    "--trace with --graphs on --backend cuda: a replayed step records no event times"),
                   (["--backend", "cuda", "--seq", "1"], "--seq 1 on --backend cuda: cuDNN's attention backward needs"),
                   ([*llama, "--pack", "256"], "--pack 256 is outside the vocabulary [0, 255]"),
                   ([*llama, "--pack", "-1"], "--pack must be an integer in [0, 1048575], got '-1'"),
                   (["--model", "llama", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
                   (["--model", "llama", "--dropout", "0.1"], "--dropout does not apply to --model llama"),
                   (["--model", "bert"], "--model must be gpt or llama, got 'bert'")):
    err = run(*args, code=2).stderr
    if text not in err:
        sys.exit(f"FAIL: {' '.join(args)}: {err!r} does not say {text!r}")

# --stage-blocks that do not fit the model or the pipeline are refused with a sentence.
for blocks, words in (("1,1,1", "adds up to 3 blocks; --layers is 4"), ("2,2", "gives 2 stages; the pipeline has 4"),
                      ("1,x,2,1", "--stage-blocks must be an integer")):
    p = run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", *small, "--stage-blocks", blocks, code=2)
    if words not in p.stderr:
        sys.exit(f"FAIL: --stage-blocks {blocks}: {p.stderr!r} does not say {words!r}")

# reserved_bytes_per_rank=: one entry per pipeline rank, the exact path's 128-bit sums above the
# standard path's on every rank.
def reserved(out):
    lines = [l for l in out.splitlines() if l.startswith("reserved_bytes_per_rank=")]
    assert len(lines) == 1, lines
    return [int(x) for x in lines[0].split("=", 1)[1].split(",")]


po_f = ["--schedule", "po-f", "--ranks", "4", "--chunks", "2", *small]
std_res, exact_res = reserved(run(*po_f).stdout), reserved(run(*po_f, "--gradients", "exact").stdout)
if len(std_res) != 4 or min(std_res) <= 0 or any(e <= s for s, e in zip(std_res, exact_res)):
    sys.exit(f"FAIL: reserved_bytes_per_rank standard {std_res}, exact {exact_res}: want 4 positive entries, exact above")

# Schedules imported from torch.distributed.pipelining's CSV form (--import), written by hand:
# GPipe orders (all forwards, then all backwards), fused and split, with offload, and a V.
with tempfile.TemporaryDirectory() as tmp:
    files = {
        "gpipe2.csv": "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n",
        "gpipe4.csv": "".join(f"{r}F0,{r}F1,{r}F2,{r}F3,{r}I3,{r}I2,{r}I1,{r}I0,{r}W0,{r}W1,{r}W2,{r}W3\n" for r in range(4)),
        "v2.csv": "0F0,0F1,0F2,0F3,3F0,3I0,3F1,3I1,3F2,3I2,3F3,3I3,0I0,0I1,0I2,0I3,3W0,3W1,3W2,3W3,0W0,0W1,0W2,0W3\n"
                  "1F0,1F1,2F0,1F2,2F1,1F3,2F2,2F3,2I0,1I0,2I1,1I1,2I2,1I2,2I3,1I3,1W0,1W1,1W2,1W3,2W0,2W1,2W2,2W3\n",
    }
    for name, text in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    for extra in (["--import", os.path.join(tmp, "gpipe2.csv")],
                  ["--import", os.path.join(tmp, "gpipe4.csv"), "--offload-chunks", "1", "--copy-gbps", "1"],
                  ["--import", os.path.join(tmp, "v2.csv")]):
        got = finals(run(*extra, *small).stdout)
        if got != ref:
            sys.exit(f"FAIL: {' '.join(extra)} gave {got}, the one-rank reference {ref}")
    with open(os.path.join(tmp, "bad.csv"), "w") as f:
        f.write("0F0,0B0\n1F0,1Q0\n")
    err = run("--import", os.path.join(tmp, "bad.csv"), *small, code=2).stderr
    if "row 2 (rank 1), cell 2: '1Q0' is not a torch action" not in err or len(err.splitlines()) != 1:
        sys.exit(f"FAIL: --import of a bad file: {err!r}")

# A fresh run never replaces another run's checkpoints: refused (exit 2, one sentence, the files
# untouched) unless --overwrite; --resume continues it.
with tempfile.TemporaryDirectory() as ck:
    base = ["--ranks", "2", "--chunks", "2", *small, "--checkpoint-every", "2", "--checkpoint-dir", ck]
    run(*base, "--seed", "1")
    def snapshot():
        out = {}
        for root, _, names in os.walk(ck):
            for n in names:
                with open(os.path.join(root, n), "rb") as f:
                    out[os.path.join(root, n)] = f.read()
        return out
    before = snapshot()
    err = run(*base, "--seed", "2", code=2).stderr
    if ("holds another run's checkpoints" not in err or "seed 1" not in err or "--overwrite" not in err
            or len(err.splitlines()) != 1):
        sys.exit(f"FAIL: a fresh run into another run's --checkpoint-dir: {err!r}")
    if snapshot() != before:
        sys.exit("FAIL: the refused run changed the other run's checkpoints")
    err = run(*base, "--seed", "1", "--lr", "1e-2", code=2).stderr
    if "another configuration" not in err:
        sys.exit(f"FAIL: another configuration into the same --checkpoint-dir: {err!r}")
    run(*base, "--seed", "1")  # the same run again: its own checkpoints, the same bytes
    run(*base, "--seed", "2", "--overwrite")
    if snapshot() == before:
        sys.exit("FAIL: --overwrite did not replace the checkpoints")

# A checkpoint follows the model, not the cut: written by 8 stages after step 3, it resumes on 4
# stages, on an uneven cut of 4 and on one rank, each ending as the uninterrupted run.
with tempfile.TemporaryDirectory() as ck:
    run("--schedule", "po-f", "--ranks", "4", "--chunks", "2", *small, "--checkpoint-every", "3", "--checkpoint-dir", ck)
    for extra in (["--schedule", "gis-h", "--ranks", "2", "--chunks", "2"],
                  ["--schedule", "po-f", "--ranks", "2", "--chunks", "2", "--stage-blocks", "0,3,1,0"],
                  ["--ranks", "1", "--chunks", "1"]):
        out = run(*extra, *small[:-1], "--resume", ck).stdout  # not --quiet: it says it resumed
        if f"resumed from {ck} at step 3" not in out or finals(out) != ref:
            sys.exit(f"FAIL: {' '.join(extra)} resumed from an 8-stage checkpoint: {finals(out)}, uninterrupted {ref}")

# --k auto: a profiling pass times every stage's passes and copies and the schedule is rebuilt
# with them. The run ends as the reference (the pass is not a step); under a copy engine paced
# at 0.002 GB/s the measured k is far above 1, and the rebuilt schedule is no slower than the
# one built with --k 1 under the measured times (faster: it keeps the units whose round trip
# cannot hide), while with unpaced copies k stays below 1.
# (0.002 GB/s: k stays far above 1 where compute is an order of magnitude slower, as under the
# sanitizers; at 0.02 GB/s AddressSanitizer's compute brought it down to 1.6.)
for gbps, big in (("0", False), ("0.002", True)):
    out = run("--schedule", "po-f", "--ranks", "2", "--chunks", "2", *small[:-1], "--k", "auto", "--copy-gbps", gbps).stdout
    line = [l for l in out.splitlines() if l.startswith("k auto: measured k = ")]
    if len(line) != 1 or finals(out) != ref:
        sys.exit(f"FAIL: --k auto --copy-gbps {gbps}: {line}, {finals(out)}, the reference {ref}")
    k = float(line[0].split("= ")[1].split(";")[0])
    rebuilt, fixed = (float(x) for x in re.findall(r"([0-9.e+-]+) s", line[0]))
    if (k > 1) != big or rebuilt > fixed or (big and not rebuilt < fixed):
        sys.exit(f"FAIL: --k auto --copy-gbps {gbps}: {line[0]}")
    # and, after training, the rebuilt program's measured forward and backward beside the
    # simulator's (times of this machine: present and positive, not compared).
    after = re.findall(r"^k auto: the rebuilt program's forward and backward: ([0-9.e+-]+) s measured "
                       r"\(median of 3 steps after the first\), ([0-9.e+-]+) s simulated$", out, re.M)
    if len(after) != 1 or not all(float(x) > 0 for x in after[0]):
        sys.exit(f"FAIL: --k auto --copy-gbps {gbps}: no measured-against-simulated line\n{out}")

# The profiling pass's runtime is gone before the run's is built and the arena starts over
# (reset_arena), so the run reserves what its own program needs, not that on top of the
# profiling program's. 1F1B-I's program on one rank does not depend on the costs (on two, its
# message buffers' lifetimes do): --k auto reserves to the byte what --k 1 does (without the
# reset the rank held the profiling program's blocks too).
i1 = ["--schedule", "1f1b-i", "--ranks", "1", "--chunks", "2", *small]
auto_res, fixed_res = reserved(run(*i1, "--k", "auto").stdout), reserved(run(*i1).stdout)
if auto_res != fixed_res:
    sys.exit(f"FAIL: 1f1b-i --k auto reserved {auto_res}; --k 1 reserves {fixed_res}")

# Loss falls over a short run.
out = run("--ranks", "2", "--chunks", "1", "--schedule", "1f1b", "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "4",
          "--microbatches", "2", "--steps", "40", "--lr", "1e-2").stdout
losses = [float(l.split(" loss ")[1].split()[0]) for l in out.splitlines() if l.startswith("[")]
assert losses[-1] < losses[0] - 0.5, losses

for args, text in ((["--schedule", "nope"], "--schedule must be one of 1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v, got 'nope'"),
                   (["--ranks", "0"], "--ranks must be an integer in [1, 64], got '0'"),
                   (["--schedule", "gis-g", "--ranks", "4"], "--schedule gis-g needs --group G, an integer in [2, 4]"),
                   (["--schedule", "1f1b-i", "--ranks", "4", "--microbatches", "6"], "multiple of ranks d = 4"),
                   (["--schedule", "zb-v", "--ranks", "2", "--chunks", "3"],
                    "ZB-V/V-Half/V-Min/DualPipeV: chunks per rank v (two stages per rank, as a V) = 3 is outside the allowed range [2, 2]"),
                   (["--schedule", "dualpipe-v", "--ranks", "4", "--chunks", "2", "--microbatches", "6"],
                    "DualPipeV: microbatches m = 6 must be at least 2d = 8"),
                   (["--bogus"], "unknown option '--bogus'"),
                   (["--backend", "gpu"], "--backend must be cpu or cuda, got 'gpu'")):
    err = run(*args, code=2).stderr
    if text not in err:
        sys.exit(f"FAIL: {args}: expected {text!r} in {err!r}")

# --backend cuda: options that only the CPU backend has are refused; without a GPU (or without
# a CUDA build) the run is refused with a sentence, exit 2, never a crash. With a GPU, the GPU
# suite (tests/cuda) runs it.
probe = subprocess.run([exe, "--backend", "cuda", "--ranks", "1", "--chunks", "1", *small], capture_output=True, text=True, timeout=300)
if "built without CUDA" in probe.stderr:
    assert probe.returncode == 2, probe
else:
    err = run("--backend", "cuda", "--copy-gbps", "1", code=2).stderr
    assert "--copy-gbps applies only to --backend cpu" in err, err
    err = run("--backend", "cuda", "--graphs", "--ranks", "2", code=2).stderr
    assert "--graphs on --backend cuda captures one rank without replicas (--ranks 1 --dp 1); this run has --ranks 2 --dp 1" in err, err
    if "this machine has 0" in probe.stderr:
        assert probe.returncode == 2, probe
        assert "--backend cuda --ranks 1 needs 1 GPUs; this machine has 0" in probe.stderr, probe.stderr
    else:
        assert probe.returncode == 0, probe
print("ok")
