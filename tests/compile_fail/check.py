#!/usr/bin/env python3
"""Compile a file that must not compile and check the diagnostic carries the sentence.

usage: check.py SOURCE INCLUDE_DIR COMPILER [ARGS...]
The sentence is the text after "// expect: " on the source's first line.
"""
import subprocess
import sys

src, inc, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(src, encoding="utf-8") as f:
    first = f.readline()
if not first.startswith("// expect: "):
    sys.exit(f"{src}: first line must be '// expect: <diagnostic text>'")
expect = first[len("// expect: "):].strip()
proc = subprocess.run(cmd + ["-std=c++20", "-fsyntax-only", "-I", inc, src],
                      capture_output=True, text=True, timeout=300)
if proc.returncode == 0:
    sys.exit(f"FAIL: {src} compiled, but it must not")
if expect not in proc.stderr:
    sys.stderr.write(proc.stderr[-4000:])
    sys.exit(f"FAIL: the diagnostic of {src} does not contain: {expect}")
print(f"ok: {src} fails to compile with: {expect}")
