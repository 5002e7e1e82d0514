#!/usr/bin/env python3
"""No std::terminate when threads cannot be started: thread_limit D runs D thread ranks of three
backend streams each; under an address-space limit that leaves room for only some of their
stacks, it must end by itself with exit 1 and a sentence for every rank (the thread that could not
start, "cannot start ...", or the abort that followed), not SIGABRT; without the limit it exits 0.

usage: test_thread_limit.py path/to/thread_limit
"""
import resource
import subprocess
import sys

exe = sys.argv[1]
D = 32  # 32 ranks x 4 threads: 128 stacks of 8 MiB of address space each


def run(limit):
    def cap():
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return subprocess.run([exe, str(D)], capture_output=True, text=True, timeout=60, preexec_fn=cap)


p = run(None)
if p.returncode != 0 or p.stdout.strip() != f"0 of {D} ranks failed":
    sys.exit(f"FAIL: without a limit: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
checked = 0
for mib in (96, 160, 256, 384):
    p = run(mib << 20)
    if p.returncode < 0:
        sys.exit(f"FAIL: under a {mib} MiB address-space limit the process died of signal {-p.returncode}\n{p.stderr}")
    if p.returncode == 0:
        continue  # room enough for every thread at this limit
    lines = p.stderr.splitlines()
    if p.returncode != 1 or len(lines) != D or not all(l.startswith(f"rank {r}: ") for r, l in enumerate(lines)):
        sys.exit(f"FAIL: under {mib} MiB: expected exit 1 and one line per rank, got {p.returncode}\n{p.stderr}")
    if "cannot start" not in p.stderr:
        sys.exit(f"FAIL: under {mib} MiB: no rank names the thread that could not start\n{p.stderr}")
    checked += 1
if checked == 0:
    sys.exit("FAIL: no limit made a thread fail to start; the test checked nothing")
print(f"ok: {checked} limits ended every rank with a sentence")
