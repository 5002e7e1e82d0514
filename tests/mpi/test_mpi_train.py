#!/usr/bin/env python3
"""train_gpt --comm mpi as real processes under mpirun.

usage: test_mpi_train.py path/to/train_gpt path/to/mpirun exactness|faults|checkpoint|data-parallel

exactness   4 processes give the final_loss/params_hash of the thread run, for 1F1B-I, GIS-H,
            PO-H and PO-F; bad launches exit 2 with a sentence
faults      a rank whose arguments fail its checks or differ from rank 0's (exit 2, named, at
            once), kill -9 (injected and external), a throwing rank, a stuck rank (receive
            timeout) each end every process within 30 s, non-zero, with messages that name the
            lost rank (asserted)
checkpoint  a run killed after step k and resumed gives bit-identical results, under threads
            and under MPI (and across them); a crash mid-write leaves the previous checkpoint
data-parallel  R replicas of a D-rank pipeline as R*D processes give the bits of the thread run
            and of one replica of the global batch (with and without ZeRO-1); a rank of replica 1
            killed with -9, or throwing, ends every process of both replicas within 30 s
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

exe, mpirun, part = sys.argv[1], sys.argv[2], sys.argv[3]
# The test's environment (tests/mpi/meson.build) sets the container-friendly MCA parameters;
# the flags repeat the essential ones so the script also runs on its own.
MPI = [mpirun, "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
# The exact gradient path: every comparison with another rank or replica count is bit for bit.
SMALL = ["--gradients", "exact", "--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2", "--microbatches", "4",
         "--steps", "4", "--quiet"]
BOUND = 30.0  # seconds from a failure to the end of every process
failures = []


def fail(msg):
    sys.exit("FAIL: " + msg)


def run(cmd, timeout=120):
    """Runs cmd in its own process group; on timeout kills that group (never a hang)."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        fail(f"{' '.join(cmd)} did not end within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return p.returncode, out, err, time.monotonic() - start


def run_ok(cmd):
    code, out, err, _ = run(cmd)
    if code != 0:
        fail(f"{' '.join(cmd)} exited {code}\nstdout:\n{out}\nstderr:\n{err}")
    return out


def finals(out):
    lines = [l for l in out.splitlines() if l.startswith(("final_loss=", "params_hash="))]
    if not (len(lines) == 2 and lines[0].startswith("final_loss=") and lines[1].startswith("params_hash=")):
        fail(f"expected one final_loss and one params_hash line, got {lines}\n{out}")
    if out.splitlines()[-2:] != lines:
        fail("the final lines must come last:\n" + out)
    return lines


def mpi(n, *args):
    return MPI + ["-np", str(n), exe, "--comm", "mpi", *args]


def expect_failure(cmd, what):
    """A failed job: non-zero, within the bound, no final lines. Returns its stderr lines."""
    code, out, err, secs = run(cmd)
    if code == 0:
        fail(f"{what}: exited 0 after a failure\nstdout:\n{out}\nstderr:\n{err}")
    if secs > BOUND:
        fail(f"{what}: took {secs:.1f} s to end, the bound is {BOUND} s")
    if "final_loss=" in out:
        fail(f"{what}: printed results after a failure\n{out}")
    print(f"{what}: ended with status {code} after {secs:.1f} s")
    return code, err


def check_survivors(err, lost, what):
    """Every rank that reported before the job ended names the lost rank."""
    for m in re.finditer(r"^train_gpt: rank (\d+) \(\S+\): (.*)$", err, re.M):
        if int(m.group(1)) != lost and not m.group(2).startswith(f"aborted: rank {lost} failed: "):
            fail(f"{what}: rank {m.group(1)} reported {m.group(2)!r}, which does not name rank {lost}")


def exactness():
    ref = finals(run_ok([exe, "--ranks", "1", "--chunks", "1", *SMALL]))
    for sched in ("1f1b-i", "gis-h", "po-h", "po-f"):
        args = ["--schedule", sched, "--chunks", "2", *SMALL]
        threads = finals(run_ok([exe, "--ranks", "4", *args]))
        out = run_ok(mpi(4, *args))
        got = finals(out)
        if got != threads or got != ref:
            fail(f"{sched}: MPI gave {got}, threads {threads}, the one-rank reference {ref}")
        if out.count("train_gpt: ") != 1 or "MPI processes" not in out:
            fail(f"{sched}: rank 0 alone prints, and says it runs MPI processes:\n{out}")
    # Tied embeddings across processes: the head's gradients and the embedding's values cross
    # between ranks 0 and 3 (1F1B-I) as MPI messages, and the run ends as one rank's.
    tied = ["--schedule", "1f1b-i", "--chunks", "2", *SMALL, "--tie-embeddings"]
    tied_ref = finals(run_ok([exe, "--ranks", "1", "--chunks", "1", *SMALL, "--tie-embeddings"]))
    got = finals(run_ok(mpi(4, *tied)))
    if got != tied_ref or tied_ref == ref:
        fail(f"--tie-embeddings: MPI gave {got}, the one-rank reference {tied_ref} (untied {ref})")
    # --ranks, when given, must match the processes mpirun started: every rank exits 2.
    code, out, err, _ = run(mpi(2, "--ranks", "4", *SMALL))
    want = "train_gpt: --ranks 4 x --dp 1 = 4 ranks but mpirun started 2 processes; they must be equal"
    if code != 2 or want not in err:
        fail(f"--ranks 4 under -np 2: expected status 2 and {want!r}, got {code}\n{err}")
    code, out, err, _ = run([exe, "--comm", "mpi", "--comm-timeout", "0", *SMALL])
    if code != 2 or "--comm-timeout must be a number in (0, 86400], got '0'" not in err:
        fail(f"--comm-timeout 0: expected status 2, got {code}\n{err}")
    code, out, err, _ = run([exe, "--comm-timeout", "5", *SMALL])
    if code != 2 or "--comm-timeout applies only to --comm mpi" not in err:
        fail(f"--comm-timeout without mpi: expected status 2, got {code}\n{err}")


def mpmd(first, rest, n):
    """One process given `first`, n - 1 given `rest` (mpirun's MPMD form), all --comm mpi."""
    return MPI + ["-np", "1", exe, "--comm", "mpi", *first, ":", "-np", str(n - 1), exe, "--comm", "mpi", *rest]


def disagreeing_ranks():
    """One rank's arguments differ or fail its own checks: every rank ends at once with exit 2
    and the sentence naming that rank (no rank left waiting in a collective)."""
    args = ["--schedule", "po-f", "--chunks", "2", *SMALL]
    cases = [
        # rank 0's own check fails (its --ranks does not match the processes); the others pass.
        (mpmd(["--ranks", "2", *args], args, 3),
         "train_gpt: rank 0: --ranks 2 x --dp 1 = 2 ranks but mpirun started 3 processes; they must be equal"),
        # rank 1's arguments do not parse.
        (mpmd(args, [*args, "--steps", "-1"], 2), "train_gpt: rank 1: --steps"),
        # rank 1's --inject-fault names a rank outside the job.
        (mpmd(args, ["--inject-fault", "9:0:throw", *args], 2),
         "train_gpt: rank 1: --inject-fault's rank 9 is outside [0, 1]"),
        # rank 1 was given another seed (or another --checkpoint-dir: every argument counts).
        (mpmd(args, ["--seed", "8", *args], 2),
         "train_gpt: rank 1: it was given other arguments than rank 0; every rank must be given the same ones"),
        (mpmd(["--checkpoint-every", "2", "--checkpoint-dir", "/tmp/po-a", *args],
              ["--checkpoint-every", "2", "--checkpoint-dir", "/tmp/po-b", *args], 2),
         "train_gpt: rank 1: it was given other arguments than rank 0"),
    ]
    for cmd, want in cases:
        code, err = expect_failure(cmd, want)
        if code != 2 or want not in err:
            fail(f"{' '.join(cmd)}: expected status 2 and {want!r}, got {code}\n{err}")


def rank_pid(mpirun_pid, rank):
    """The pid of MPI rank `rank` among mpirun's descendants (by its OMPI_COMM_WORLD_RANK)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == mpirun_pid and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(pid)
    return None


def faults():
    disagreeing_ranks()
    args = ["--schedule", "po-f", "--chunks", "2", *SMALL]
    lost_re = r"mpirun noticed that process rank {r} with PID {pid} on node \S+ exited on signal 9 \(Killed\)\."

    # kill -9 of rank 2 inside one of its forward passes.
    _, err = expect_failure(mpi(4, *args, "--inject-fault", "2:1:kill"), "injected kill -9")
    if not re.search(lost_re.format(r=2, pid=r"\d+"), err):
        fail("injected kill -9: mpirun's message naming rank 2 is missing:\n" + err)

    # kill -9 from outside, while the ranks are training (rank 0 has printed its first step).
    cmd = mpi(4, "--schedule", "po-f", "--chunks", "2", *SMALL[:-3], "--steps", "100000")
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = p.stdout.readline()
        while line and not line.startswith("["):
            line = p.stdout.readline()
        pid = rank_pid(p.pid, 1) if line else None
        if pid is None:
            os.killpg(p.pid, signal.SIGKILL)
            fail("external kill -9: could not find rank 1 training")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=BOUND + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        fail("external kill -9: the job did not end")
    print(f"external kill -9: ended with status {p.returncode} {time.monotonic() - killed:.1f} s after the kill")
    if time.monotonic() - killed > BOUND:
        fail(f"external kill -9: took {time.monotonic() - killed:.1f} s to end")
    if p.returncode == 0 or "final_loss=" in out:
        fail(f"external kill -9: exited {p.returncode}\n{out}")
    # (OpenMPI 4.1.4 prints "PID 0" here, so the pid itself is not compared.)
    if not re.search(lost_re.format(r=1, pid=r"\d+"), err):
        fail(f"external kill -9: mpirun's message naming rank 1 (pid {pid}) is missing:\n{err}")

    # A rank that throws: its message names it and the op; every peer that reports names it.
    _, err = expect_failure(mpi(4, *args, "--inject-fault", "1:1:throw"), "throwing rank")
    if not re.search(r"^train_gpt: rank 1 \(\S+\): rank 1, compute op \d+ F\(stage 1, mb 1\): injected fault \(--inject-fault 1:1:throw\)$", err, re.M):
        fail("throwing rank: rank 1's own message is missing:\n" + err)
    check_survivors(err, 1, "throwing rank")

    # A stuck rank: its peers' waits time out after 3 s, naming the op, the rank and the peer.
    # Which wait times out first is a race: rank 1's neighbours wait on it, and ranks further
    # away wait on those neighbours (sends wait for their receives), so the first message may
    # name a peer that is itself waiting. What is asserted is the message's full form.
    _, err = expect_failure(mpi(4, *args, "--inject-fault", "1:1:hang", "--comm-timeout", "3"), "stuck rank")
    pat = (r"^train_gpt: rank (\d) \(\S+\): rank \1, comm op \d+ (send to|recv from) rank (\d) \((forward|backward), stage \d+, mb \d+\): "
           r"comm::Mpi: rank \1 \(\S+\) has waited \d+\.\d s in \2 rank \3 of \(\4, stage \d+, mb \d+\) \(timeout 3 s\); "
           r"rank \3 has not answered: it is lost, stuck, or waiting itself$")
    if not re.search(pat, err, re.M):
        fail("stuck rank: no timeout message naming the waiting op, its rank and its peer:\n" + err)

    # One rank started with another schedule: the launch's agreement refuses it before anything
    # collective (the library's own handshake, which would also catch it, is tested in
    # tests/mpi/test_handshake.cpp and test_mpi.cpp).
    code, err = expect_failure(MPI + ["-np", "3", exe, "--comm", "mpi", "--ranks", "4", *args, ":",
                                      "-np", "1", exe, "--comm", "mpi", "--ranks", "4", "--schedule", "gis-h", *args[2:]], "other schedule")
    want = "train_gpt: rank 3: it was given other arguments than rank 0; every rank must be given the same ones"
    if want not in err.splitlines() or code != 2:
        fail(f"other schedule: expected status 2 and {want!r}, got {code}:\n{err}")


def checkpoint():
    tmp = tempfile.mkdtemp(prefix="po-ckpt-")
    try:
        args = ["--schedule", "po-h", "--chunks", "2", *SMALL[:-3], "--steps", "6", "--quiet"]
        ref = finals(run_ok([exe, "--ranks", "4", *args]))

        # Threads: the process dies (SIGKILL) in step 3; the checkpoint of step 2 survives.
        d1 = os.path.join(tmp, "threads")
        code, out, err, _ = run([exe, "--ranks", "4", *args, "--checkpoint-every", "2", "--checkpoint-dir", d1, "--inject-fault", "3:3:kill"])
        if code != -signal.SIGKILL:
            fail(f"threads kill: expected SIGKILL, got {code}\n{err}")
        with open(os.path.join(d1, "latest")) as f:
            if f.read() != "step-00000002\n":
                fail("threads kill: latest must name step-00000002")
        # A crash in the middle of writing step 4: a partial directory, a cut file, a temp file.
        os.makedirs(os.path.join(d1, "step-00000004"))
        with open(os.path.join(d1, "step-00000002", "stage-0.bin"), "rb") as f:
            whole = f.read()
        with open(os.path.join(d1, "step-00000004", "stage-0.bin"), "wb") as f:
            f.write(whole[: len(whole) // 2])
        with open(os.path.join(d1, "step-00000004", "stage-1.bin.tmp.999"), "wb") as f:
            f.write(b"partial")
        out = run_ok([exe, "--ranks", "4", *args[:-1], "--resume", d1])
        if f"resumed from {d1} at step 2" not in out or finals(out) != ref:
            fail(f"threads resume: expected {ref} after 'resumed from {d1} at step 2'\n{out}")

        # MPI: rank 1 is killed in step 5; the checkpoint of step 4 resumes under MPI.
        d2 = os.path.join(tmp, "mpi")
        code, out, err, _ = run(mpi(4, *args, "--checkpoint-every", "2", "--checkpoint-dir", d2, "--inject-fault", "1:5:kill"))
        if code == 0 or "final_loss=" in out:
            fail(f"mpi kill: exited {code}\n{out}\n{err}")
        with open(os.path.join(d2, "latest")) as f:
            if f.read() != "step-00000004\n":
                fail("mpi kill: latest must name step-00000004")
        got = finals(run_ok(mpi(4, *args, "--resume", d2)))
        if got != ref:
            fail(f"mpi resume: got {got}, the uninterrupted run {ref}")
        # A checkpoint is per stage: the MPI one resumes on 8 thread ranks with 1F1B (8 stages).
        got = finals(run_ok([exe, "--ranks", "8", "--chunks", "1", "--schedule", "1f1b", *args[4:], "--resume", d2]))
        if got != ref:
            fail(f"cross resume: got {got}, the uninterrupted run {ref}")

        # A damaged checkpoint or another configuration is refused with the file's name.
        bad = os.path.join(d2, "step-00000004", "stage-3.bin")
        with open(bad, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
        code, out, err, _ = run([exe, "--ranks", "4", *args, "--resume", d2])
        if code != 1 or f"checkpoint: {bad} is corrupt (checksum mismatch)" not in err:
            fail(f"corrupt checkpoint: expected status 1 naming {bad}, got {code}\n{err}")
        code, out, err, _ = run([exe, "--ranks", "4", *args, "--lr", "1e-2", "--resume", d1])
        if code != 1 or "was written by a run with another configuration" not in err:
            fail(f"other configuration: expected status 1, got {code}\n{err}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def data_parallel():
    at = SMALL.index("--microbatches")
    base = SMALL[:at] + SMALL[at + 2:]
    ref = finals(run_ok([exe, "--ranks", "1", "--chunks", "1", "--microbatches", "12", *base]))
    for n, d, dp, sched, zero in ((4, 2, 2, "po-f", "0"), (6, 2, 3, "1f1b-i", "1"), (8, 4, 2, "gis-h", "1")):
        args = ["--schedule", sched, "--chunks", "2", "--dp", str(dp), "--microbatches", str(12 // dp), "--zero", zero, *base]
        threads = finals(run_ok([exe, "--ranks", str(d), *args]))
        got = finals(run_ok(mpi(n, "--ranks", str(d), *args)))
        if got != threads or got != ref:
            fail(f"{sched} d={d} dp={dp} zero={zero}: MPI gave {got}, threads {threads}, one replica of 12 microbatches {ref}")
    # The processes must make whole pipelines.
    # The standard path (the default): MPI sums the replicas' fp32 parts in the threads' order.
    std = [a for a in base if a not in ("--gradients", "exact")]
    args = ["--schedule", "po-f", "--chunks", "2", "--ranks", "2", "--dp", "2", "--microbatches", "6", "--zero", "1", *std]
    threads, got = finals(run_ok([exe, *args])), finals(run_ok(mpi(4, *args)))
    if got != threads:
        fail(f"standard gradients, dp=2 zero=1: MPI gave {got}, threads {threads}")
    code, out, err, _ = run(mpi(3, "--dp", "2", *SMALL))
    if code != 2 or "but mpirun started 3 processes" not in err:
        fail(f"--dp 2 under -np 3: expected status 2, got {code}\n{err}")
    args = ["--schedule", "po-f", "--chunks", "2", "--ranks", "2", "--dp", "2", *SMALL]
    # kill -9 of rank 3 (replica 1's second rank) inside a forward pass: mpirun ends the job.
    _, err = expect_failure(mpi(4, *args, "--inject-fault", "3:1:kill"), "replica 1: injected kill -9")
    if not re.search(r"mpirun noticed that process rank 3 with PID \d+ on node \S+ exited on signal 9", err):
        fail("replica 1: injected kill -9: mpirun's message naming rank 3 is missing:\n" + err)
    # A throwing rank of replica 1: its own message, and every peer that reports (in either
    # replica) names it.
    _, err = expect_failure(mpi(4, *args, "--inject-fault", "2:1:throw"), "replica 1: throwing rank")
    if not re.search(r"^train_gpt: rank 2 \(\S+\): .*injected fault \(--inject-fault 2:1:throw\)$", err, re.M):
        fail("replica 1: throwing rank: rank 2's own message is missing:\n" + err)
    check_survivors(err, 2, "replica 1: throwing rank")


def fuzz():
    """300 seeded argument sets under mpirun -np 3 (MPMD form), one rank's arguments changed:
    a valid other value, an invalid value, an unknown option, a dropped argument or the
    communicator itself (a process without --comm mpi joins MPI only to refuse). Every job
    ends within the bound with exit 2, no results and a sentence naming a rank: the changed
    one, or rank 1 when rank 0 was changed to another valid value."""
    rng = random.Random(26)
    base = ["--schedule", "po-f", "--chunks", "2", "--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2",
            "--microbatches", "6", "--steps", "2", "--quiet"]
    valid = {"--seed": ["2", "99"], "--steps": ["1", "3"], "--lr": ["1e-2", "0.5"], "--microbatches": ["3", "9"],
             "--schedule": ["gis-h", "po-h", "1f1b-i", "zb-v"], "--layers": ["3", "6"], "--hidden": ["16", "64"],
             "--seq": ["8", "32"], "--batch": ["1", "3"], "--dropout": ["0", "0.2"], "--gradients": ["exact"],
             "--eval-every": ["1"], "--k": ["2"], "--copy-gbps": ["1"], "--comm-timeout": ["20"],
             "--checkpoint-every": ["1"], "--ranks": ["3"]}
    invalid = {"--seed": ["-1", "x"], "--steps": ["0", "1e9"], "--lr": ["-1", "nan"], "--microbatches": ["0", "5000"],
               "--schedule": ["nope", "gis-g"], "--layers": ["0"], "--hidden": ["30", "0"], "--heads": ["0", "7"],
               "--chunks": ["0", "65"], "--ranks": ["2", "0", "70"], "--dp": ["2", "0"], "--zero": ["2"],
               "--offload-chunks": ["9"], "--inject-fault": ["9:0:throw", "x"], "--corpus": ["/nonexistent"],
               "--trace": ["/nonexistent/t.json"], "--checkpoint-dir": ["/tmp/x"], "--resume": ["/nonexistent"],
               "--comm-timeout": ["0"], "--vocab": ["5"], "--exact-block": ["2"], "--reduce-bucket": ["1"]}
    kinds = ["valid", "invalid", "unknown", "drop", "comm"]
    counts = {k: 0 for k in kinds}
    slowest = {k: 0.0 for k in kinds}
    for case in range(300):
        kind = kinds[case % 5] if case < 10 else rng.choice(kinds)
        counts[kind] += 1
        k = rng.randrange(3)
        changed = list(base)
        if kind in ("valid", "invalid"):
            table = valid if kind == "valid" else invalid
            flag = rng.choice(sorted(table))
            value = rng.choice(table[flag])
            if flag in changed:
                changed[changed.index(flag) + 1] = value
            else:
                changed += [flag, value]
        elif kind == "unknown":
            changed.insert(rng.randrange(len(changed) + 1), rng.choice(["--bogus", "-x", "--steps=2", "extra"]))
        elif kind == "drop":
            at = rng.randrange(len(changed))
            del changed[at:at + (1 if changed[at] == "--quiet" or not changed[at].startswith("--") else 2)]
        ranks = [list(base) for _ in range(3)]
        ranks[k] = changed
        comm = [["--comm", "mpi"] for _ in range(3)]
        if kind == "comm":
            comm[k] = rng.choice([[], ["--comm", "threads"], ["--comm", "nope"]])
        cmd = list(MPI)
        for q in range(3):
            cmd += (["-np", "1", exe] + comm[q] + ranks[q]) + ([":"] if q < 2 else [])
        what = f"fuzz case {case} ({kind}, rank {k}: {' '.join(comm[k] + changed)})"
        code, out, err, secs = run(cmd, timeout=BOUND + 5)
        slowest[kind] = max(slowest[kind], secs)
        if secs > BOUND:
            fail(f"{what}: took {secs:.1f} s to end, the bound is {BOUND} s")
        if code == 0 or "final_loss=" in out:
            fail(f"{what}: trained (status {code}) although one rank's arguments differ\n{out}\n{err}")
        m = re.search(r"^train_gpt: (?:rank (\d+): )?(.+)$", err, re.M)
        if code != 2 or not m:
            fail(f"{what}: expected status 2 and a sentence, got {code}\n{err}")
        named = int(m.group(1)) if m.group(1) else None
        if named is not None and named != k and not (k == 0 and named == 1):
            fail(f"{what}: the message names rank {named}, not the changed rank {k}:\n{err}")
    print(f"fuzz: 300 cases ({counts}) ended within {BOUND} s (the slowest of each kind: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in slowest.items()) + "), none succeeded")


{"exactness": exactness, "faults": faults, "checkpoint": checkpoint, "data-parallel": data_parallel, "fuzz": fuzz}[part]()
print("ok")
