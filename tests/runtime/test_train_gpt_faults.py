#!/usr/bin/env python3
"""train_gpt under a careless or hostile user, thread ranks (issue "No hang, no kill by the
kernel, no lost run"; the MPI cases are in tests/mpi/test_mpi_train.py): a run the machine
cannot hold is refused before any work; outputs are checked before training; special files,
bad shard headers and shards truncated mid-run; a save that fails on a full disk leaves the
last checkpoint loadable and no partial step; corrupt checkpoints are named in one short
sentence; SIGINT/SIGTERM stop at a step boundary with a checkpoint. Every case ends within 30 s.

usage: test_train_gpt_faults.py path/to/train_gpt
"""
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

exe = sys.argv[1]
BOUND = 30
SMALL = ["--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2", "--microbatches", "4", "--ranks", "2",
         "--chunks", "2", "--quiet"]


def fail(msg):
    sys.exit("FAIL: " + msg)


def run(*args, code=0, limit=None):
    def preexec():
        if limit is not None:  # a full disk: writes past `limit` bytes fail with EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    start = time.monotonic()
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=BOUND, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(args)} did not end within {BOUND} s")
    if p.returncode != code:
        fail(f"{' '.join(args)} exited {p.returncode}, expected {code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    if code != 0 and "final_loss=" in p.stdout:
        fail(f"{' '.join(args)} printed results although it failed")
    p.seconds = time.monotonic() - start
    return p


def sentence(p, *parts):
    """The run's stderr is one line holding every part."""
    err = p.stderr.strip()
    if len(err.splitlines()) != 1 or any(x not in err for x in parts) or len(err) > 600:
        fail(f"expected one line of at most 600 characters with {parts}, got {err!r}")


def finals(out):
    return [l for l in out.splitlines() if l.startswith(("final_loss=", "params_hash="))]


with tempfile.TemporaryDirectory() as tmp:
    # 2. No memory check before work: the run is refused at once, naming what it needs.
    p = run("--ranks", "8", "--chunks", "1", "--schedule", "1f1b", "--microbatches", "64", "--layers", "64",
            "--hidden", "8192", "--heads", "64", code=2)
    sentence(p, "this run needs ", " GiB of memory for its 8 ranks", "rank 0 the most", " is available")
    if p.seconds > 10:
        fail(f"the memory check took {p.seconds:.1f} s")

    # 6. Outputs found unwritable only after training: refused before any step.
    sentence(run(*SMALL, "--steps", "3", "--trace", os.path.join(tmp, "missing", "t.json"), code=2),
             "--trace's directory", "does not exist")
    sentence(run(*SMALL, "--steps", "3", "--trace", tmp, code=2), "is a directory; give a file name")
    blocker = os.path.join(tmp, "a-file")
    open(blocker, "w").close()
    sentence(run(*SMALL, "--steps", "3", "--checkpoint-every", "1", "--checkpoint-dir", os.path.join(blocker, "ck"),
                 code=2), "--checkpoint-dir", "cannot be created")

    # 7. Data: special files never block; a bad header vocabulary names the file; a shard
    # truncated while training does not take the run down (it was read whole at the start).
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    for flag in ("--data", "--corpus", "--import"):
        sentence(run(*SMALL, "--steps", "1", flag, fifo, code=2), fifo, "is not a regular file")
    sentence(run(*SMALL, "--steps", "1", "--data", tmp, code=2), "is a directory")

    def shard(path, ids, vocab):
        with open(path, "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, len(ids), vocab, *([0] * 252)))
            f.write(struct.pack(f"<{len(ids)}H", *ids))
    ids = [(i * 7919) % 200 for i in range(20000)]
    for vocab in (1, 2000000):
        bad = os.path.join(tmp, f"vocab{vocab}.bin")
        shard(bad, ids, vocab)
        sentence(run(*SMALL, "--steps", "1", "--data", bad, code=2), bad, f"has vocabulary {vocab} in its header",
                 "outside [2, 1048576]")
    good = os.path.join(tmp, "good.bin")
    shard(good, ids, 256)
    proc = subprocess.Popen([exe, *SMALL[:-1], "--steps", "400", "--data", good], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()  # the banner: the shard has been read
    os.truncate(good, 1024)
    out, err = proc.communicate(timeout=120)
    if proc.returncode != 0 or len(finals(out)) != 2:
        fail(f"a shard truncated while training: status {proc.returncode}\n{err}")

    # 8. A save that fails (a full disk) removes what it wrote: the previous checkpoint stays
    # `latest` and loads, and the resumed run ends as an uninterrupted one.
    ck = os.path.join(tmp, "ck")
    ref = finals(run(*SMALL, "--steps", "8").stdout)
    run(*SMALL, "--steps", "8", "--checkpoint-every", "4", "--checkpoint-dir", ck)  # step-4 and step-8
    with open(os.path.join(ck, "latest")) as f:
        assert f.read() == "step-00000008\n"

    shutil.rmtree(os.path.join(ck, "step-00000008"))
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("step-00000004\n")
    p = run(*SMALL, "--steps", "8", "--checkpoint-every", "2", "--resume", ck, code=1, limit=4096)
    if "File too large" not in p.stderr or "checkpoint: cannot write" not in p.stderr:
        fail(f"a save on a full disk: {p.stderr!r}")
    if sorted(os.listdir(ck)) != ["latest", "step-00000004"]:
        fail(f"a failed save left {sorted(os.listdir(ck))}; only latest and step-00000004 should remain")
    got = finals(run(*SMALL, "--steps", "8", "--checkpoint-every", "2", "--resume", ck).stdout)
    if got != ref:
        fail(f"resumed after a failed save: {got}, uninterrupted {ref}")

    # 9. Messages: a corrupt `latest` is shown short and escaped; a non-digit step is refused;
    # a directory where a stage file belongs is named; a resume under another setting names it.
    def resume_error(*extra):
        return run(*SMALL, "--steps", "8", "--checkpoint-every", "2", "--resume", ck, *extra, code=1).stderr
    with open(os.path.join(ck, "latest"), "wb") as f:
        f.write(os.urandom(100000))
    err = resume_error()
    if ("does not name a step directory" not in err or not re.search(r"\.\.\.' \(\d{5,6} bytes\)", err)
            or max(map(len, err.splitlines())) > 300):
        fail(f"a latest of 100 KB of random bytes: {err[:1000]!r}")
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("step-0000000x\n")
    if "it holds 'step-0000000x'" not in resume_error():
        fail("latest = step-0000000x was not refused")
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("step-00000008\n")
    stage1 = os.path.join(ck, "step-00000008", "stage-1.bin")
    os.rename(stage1, stage1 + ".moved")
    os.mkdir(stage1)
    if f"checkpoint: {stage1} is a directory; a checkpoint file was expected" not in resume_error():
        fail("a directory in place of a stage file is not named")
    os.rmdir(stage1)
    os.rename(stage1 + ".moved", stage1)
    err = resume_error("--lr", "1e-2")
    if not re.search(r"another configuration \(lr=0\.003\d* where this run has lr=0\.0099\d*\)", err):
        fail(f"a resume under another --lr does not name it: {err!r}")

    # 10. SIGTERM and SIGINT: the run stops at the end of the step, saves where checkpointing
    # is on, says so and exits 128 + the signal; the checkpoint resumes to the uninterrupted end.
    def signalled(sig, *args, twice=False):
        proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not proc.stdout.readline().startswith("["):  # the first progress line: training
            pass
        proc.send_signal(sig)
        if twice:
            time.sleep(0.3)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=BOUND)
        return proc.returncode, out, err
    quiet = [a for a in SMALL if a != "--quiet"]
    ck2 = os.path.join(tmp, "ck2")
    code, out, err = signalled(signal.SIGTERM, *quiet, "--steps", "100000", "--checkpoint-every", "100000",
                               "--checkpoint-dir", ck2)
    m = re.search(r"train_gpt: stopped by SIGTERM after step (\d+) of 100000; checkpoint saved in (\S+) "
                  r"\(continue with --resume (\S+)\)", err)
    if code != 143 or not m or m.group(3) != ck2 or finals(out):
        fail(f"SIGTERM: status {code}\n{err}")
    with open(os.path.join(ck2, "latest")) as f:
        if f.read().strip() != f"step-{int(m.group(1)):08d}":
            fail("SIGTERM: latest does not name the checkpoint it reported")
    # SIGINT without checkpointing: 130, and it says nothing was saved.
    code, out, err = signalled(signal.SIGINT, *quiet, "--steps", "100000")
    if code != 130 or "stopped by SIGINT" not in err or "no checkpoint saved" not in err:
        fail(f"SIGINT: status {code}\n{err}")
    # A second signal ends the run at once (steps made long by a 1 MB/s copy engine).
    code, out, err = signalled(signal.SIGINT, *quiet, "--steps", "100000", "--copy-gbps", "0.001", twice=True)
    if code != -signal.SIGINT:
        fail(f"a second SIGINT: status {code}, expected death by SIGINT\n{err}")
print("ok")
