#!/usr/bin/env python3
"""File headers are labels: fail, naming each file, where a C++ or CUDA file opens with a comment
of more than 15 lines.

usage: check_headers.py [REPO_ROOT]

A file's opening comment (its first lines that start with //, before any code; Doxygen's
`/// @file` marker not counted) says what the file holds and its one job. Derivations belong in
docs/, measurements in bench/RESULTS.md, history in git (docs/design.md section 7).
LONGER lists the files allowed more, each with its reason; there are none now.
"""
import subprocess
import sys
from pathlib import Path

LIMIT = 15
FOLDERS = ("include", "models", "src", "samples", "tools", "tests", "bench")
SUFFIXES = (".hpp", ".cpp", ".h", ".cu", ".cuh")
LONGER = {}  # path -> (lines allowed, why)


def opening_comment(path):
    n = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("//"):
            break
        if line.strip() != "/// @file":
            n += 1
    return n


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", *FOLDERS], capture_output=True, text=True)
    if tracked.returncode != 0:
        print(f"SKIP: {root} is not a git checkout")
        return 77
    files = sorted(p for p in tracked.stdout.split() if Path(p).suffix in SUFFIXES and (root / p).is_file())
    bad = []
    for rel in files:
        n = opening_comment(root / rel)
        allowed = LONGER.get(rel, (LIMIT, ""))[0]
        if n > allowed:
            bad.append(f"{rel}: its opening comment is {n} lines, more than {allowed}; move derivations to docs/ "
                       "and measurements to bench/RESULTS.md")
    for rel in LONGER:
        if rel not in files:
            bad.append(f"{rel}: listed in LONGER of {Path(__file__).name} but not a file; remove it there")
    if bad:
        print(f"FAIL: {len(bad)} file headers are not labels:")
        print("\n".join("  " + b for b in bad))
        return 1
    print(f"ok: {len(files)} files open with a label of at most {LIMIT} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
