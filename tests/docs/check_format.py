#!/usr/bin/env python3
"""The code is laid out as .clang-format says: fail, naming each file, where it is not.

usage: check_format.py [REPO_ROOT]

Runs the pinned clang-format (19.1.7, installed by scripts/install-deps.sh into
/usr/local/lib/clang-format-19; CLANG_FORMAT overrides the path) with --dry-run --Werror over
every C++ and CUDA file under include/, models/, src/, samples/, tools/, tests/ and bench/.
Exits 77 (Meson's SKIP) when that clang-format is not there: another release lays code out
differently, so its verdict would not be this project's. Fix a failure with
`<clang-format> -i FILE` (the message prints the command).
"""
import os
import subprocess
import sys
from pathlib import Path

PINNED = "19.1.7"
DEFAULT = "/usr/local/lib/clang-format-19/clang_format/data/bin/clang-format"
FOLDERS = ("include", "models", "src", "samples", "tools", "tests", "bench")
SUFFIXES = (".hpp", ".cpp", ".h", ".cu", ".cuh")


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    exe = os.environ.get("CLANG_FORMAT", DEFAULT)
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        print(f"SKIP: no clang-format at {exe} (scripts/install-deps.sh installs {PINNED})")
        return 77
    if PINNED not in version:
        print(f"SKIP: {exe} is {version.strip()!r}, not {PINNED}: its layout would differ")
        return 77
    files = sorted(p for d in FOLDERS if (root / d).is_dir() for p in (root / d).rglob("*")
                   if p.suffix in SUFFIXES and p.is_file())
    bad = []
    for i in range(0, len(files), 64):
        chunk = files[i:i + 64]
        r = subprocess.run([exe, "--dry-run", "--Werror", f"--style=file:{root / '.clang-format'}"] + [str(f) for f in chunk],
                           capture_output=True, text=True)
        if r.returncode != 0:
            bad += sorted({line.split(":", 1)[0] for line in r.stderr.splitlines() if ": error: code should be clang-formatted" in line})
    if bad:
        print(f"FAIL: {len(bad)} of {len(files)} files are not laid out as .clang-format says; fix with")
        print(f"  {exe} -i " + " ".join(os.path.relpath(b, root) for b in bad))
        return 1
    print(f"ok: {len(files)} files laid out as .clang-format says (clang-format {PINNED})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
