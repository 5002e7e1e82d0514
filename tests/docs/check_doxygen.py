#!/usr/bin/env python3
"""The API reference builds without a warning: run Doxygen with docs/Doxyfile, fail listing
every warning.

usage: check_doxygen.py ROOT OUT_DIR VERSION

Runs `doxygen -` in ROOT with docs/Doxyfile plus OUTPUT_DIRECTORY = OUT_DIR, PROJECT_NUMBER =
VERSION and a warning log in OUT_DIR; the reference is OUT_DIR/html/index.html. Fails when
Doxygen fails or warns (docs/Doxyfile says which warnings are on), when the reference lacks
its front pages, or when it has a page for a detail namespace (which docs/Doxyfile excludes).
Exit 77 (Meson's SKIP) when doxygen is not installed (Debian: apt-get install doxygen;
scripts/install-deps.sh installs it).

Every public name is documented, and an undocumented one fails the check: docs/Doxyfile has
EXTRACT_ALL = NO and WARN_IF_UNDOCUMENTED = YES, so a class, member, enum, namespace-scope
name or macro without a doc comment is a warning (Doxygen checks the members of documented
namespaces and files only: docs/namespaces.dox documents the namespaces, and every header has
a `/// @file` line). What is written is checked too: unknown commands, bad markup, @param
names that are not parameters, references that do not resolve, incomplete @param lists.
"""
import shutil
import subprocess
import sys
import time
from pathlib import Path

SKIP = 77
# Pages the reference must have (Doxygen's names for the main page and a few public names).
EXPECTED = ["index.html", "namespacepipeoffload.html", "namespacepipeoffload_1_1comm.html",
            "classpipeoffload_1_1Batch.html", "structpipeoffload_1_1InterleavePolicy.html"]


def main():
    if len(sys.argv) != 4:
        print(next(line for line in __doc__.splitlines() if line.startswith("usage:")), file=sys.stderr)
        return 2
    root, out, version = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3]
    doxygen = shutil.which("doxygen")
    if doxygen is None:
        print("SKIP: doxygen is not installed (Debian: apt-get install doxygen; scripts/install-deps.sh installs it)")
        return SKIP
    html, log = out / "html", out / "doxygen-warnings.log"
    shutil.rmtree(html, ignore_errors=True)  # a page left from an earlier run would hide a missing one
    out.mkdir(parents=True, exist_ok=True)
    config = (root / "docs" / "Doxyfile").read_text(encoding="utf-8") + "\n".join([
        "", f"OUTPUT_DIRECTORY = \"{out}\"", f"WARN_LOGFILE = \"{log}\"", f"PROJECT_NUMBER = \"{version}\"", ""])
    start = time.monotonic()
    proc = subprocess.run([doxygen, "-"], input=config, cwd=root, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    sys.stdout.write(proc.stdout)
    warnings = log.read_text(encoding="utf-8").strip() if log.exists() else ""
    problems = []
    if warnings:
        print(warnings)
        count = sum(1 for line in warnings.splitlines() if ": warning: " in line or ": error: " in line)
        problems.append(f"Doxygen warned {count} time(s) (above); fix the doc comments they name")
    if proc.returncode != 0:
        sys.stdout.write(proc.stderr)
        problems.append(f"doxygen exited with {proc.returncode}")
    pages = sorted(p.name for p in html.glob("*.html")) if html.is_dir() else []
    problems += [f"the reference has no {name}" for name in EXPECTED if name not in pages]
    detail = [p for p in pages if "_1_1detail" in p or "detail_1_1" in p or "__detail" in p]
    if detail:
        problems.append("the reference documents detail namespaces: " + ", ".join(detail[:10]))
    if problems:
        print("FAIL: " + "\nFAIL: ".join(problems))
        return 1
    print(f"ok: {len(pages)} pages in {html / 'index.html'}, no warnings ({seconds:.1f} s, {proc.args[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
