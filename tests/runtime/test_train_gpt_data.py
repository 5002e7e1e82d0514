#!/usr/bin/env python3
"""train_gpt --data: token shards (samples/tokens.hpp, made by scripts/make_shard.py) train
exactly as the built-in byte-level corpus path (uint16 and uint32 ids; a held-out --val-data
shard equal to the built-in split); the vocabulary comes from the header; bad shards exit 2
with one sentence.

usage: test_train_gpt_data.py path/to/train_gpt path/to/make_shard.py path/to/corpus.txt
"""
import os
import struct
import subprocess
import sys
import tempfile

exe, make_shard, corpus = sys.argv[1], sys.argv[2], sys.argv[3]


def run(*args, code=0):
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected {code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def results(out):
    """The eval lines and the two final lines."""
    return [l for l in out.splitlines() if l.startswith(("eval step", "final_loss=", "params_hash="))]


def shard(path, ids, magic=20240520, version=1, vocab=256, count=None, fmt="H"):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", magic, version, len(ids) if count is None else count, vocab, *([0] * 252)))
        f.write(struct.pack(f"<{len(ids)}{fmt}", *ids))


small = ["--layers", "4", "--hidden", "32", "--seq", "16", "--batch", "2", "--microbatches", "4", "--steps", "4",
         "--quiet", "--eval-every", "2"]
with open(corpus, "rb") as f:
    text = f.read()
with tempfile.TemporaryDirectory() as tmp:
    p16, p32 = os.path.join(tmp, "c16.bin"), os.path.join(tmp, "c32.bin")
    for out, extra in ((p16, []), (p32, ["--uint32"])):
        subprocess.run([sys.executable, make_shard, corpus, out, *extra], check=True)
    ref = results(run(*small).stdout)
    assert len(ref) == 4, ref
    for path, width in ((p16, 16), (p32, 32)):
        p = run(*small, "--data", path)
        if results(p.stdout) != ref:
            sys.exit(f"FAIL: --data {path} gave {results(p.stdout)}, the corpus path {ref}")
        if f"{len(text)}-token shard (vocab 256, {width}-bit ids)" not in p.stdout:
            sys.exit(f"FAIL: the banner does not describe the shard:\n{p.stdout}")
    # A second file as the held-out split: the same as the built-in last 10%.
    cut = len(text) - len(text) // 10
    ptrain, pval = os.path.join(tmp, "train.bin"), os.path.join(tmp, "val.bin")
    shard(ptrain, text[:cut])
    shard(pval, text[cut:])
    got = results(run(*small, "--data", ptrain, "--val-data", pval).stdout)
    if got != ref:
        sys.exit(f"FAIL: --data/--val-data gave {got}, the corpus path {ref}")
    # The vocabulary comes from the header (or --vocab when the header leaves it 0).
    big = os.path.join(tmp, "v300.bin")
    shard(big, list(text[:5000]) + [299] * 10, vocab=300)
    p = run(*small[:-2], "--data", big)
    if "vocab 300" not in p.stdout or len(results(p.stdout)) != 2:
        sys.exit(f"FAIL: a vocab-300 shard:\n{p.stdout}")
    zero = os.path.join(tmp, "v0.bin")
    shard(zero, list(text[:5000]), vocab=0)
    run(*small[:-2], "--data", zero, "--vocab", "256")
    # Bad shards: one sentence, exit 2.
    bad = os.path.join(tmp, "bad.bin")
    cases = []
    shard(bad, list(text[:1000]), magic=1234)
    cases.append(("magic", "has magic 1234 and version 1; expected 20240520/1 (uint16 ids) or 20240801/7 (uint32 ids)"))
    for kind, text_want in cases:
        err = run(*small, "--data", bad, code=2).stderr
        if text_want not in err:
            sys.exit(f"FAIL: {kind}: expected {text_want!r} in {err!r}")
    shard(bad, list(text[:1000]), count=2000)
    err = run(*small, "--data", bad, code=2).stderr
    if "has 2000 bytes of ids; its header counts 2000 ids of 2 bytes (4000)" not in err:
        sys.exit(f"FAIL: truncated: {err!r}")
    shard(bad, list(text[:1000]), vocab=100)
    err = run(*small, "--data", bad, code=2).stderr
    if "outside the vocabulary [0, 100)" not in err or "has token id" not in err:
        sys.exit(f"FAIL: id >= vocab: {err!r}")
    err = run(*small, "--data", zero, code=2).stderr
    if "does not give its vocabulary size (header word 3 is 0); pass --vocab V" not in err:
        sys.exit(f"FAIL: vocab 0: {err!r}")
    with open(bad, "wb") as f:
        f.write(b"short")
    err = run(*small, "--data", bad, code=2).stderr
    if "is shorter than its 1024-byte header" not in err:
        sys.exit(f"FAIL: short file: {err!r}")
    err = run(*small, "--data", os.path.join(tmp, "missing.bin"), code=2).stderr
    if "cannot read the token shard" not in err:
        sys.exit(f"FAIL: missing file: {err!r}")
    for args, want in ((["--vocab", "300"], "--vocab needs --data FILE"),
                       (["--data", p16, "--corpus", corpus], "--data and --corpus exclude each other")):
        err = run(*small, *args, code=2).stderr
        if want not in err:
            sys.exit(f"FAIL: {args}: expected {want!r} in {err!r}")
print("ok: shards train as the corpus path; vocab from the header; bad shards exit 2")
