#!/usr/bin/env python3
"""The version is written once, in VERSION: fail, naming each place, where another disagrees.

usage: check_version.py [REPO_ROOT [BUILD_VERSION]]   (default: the checkout this script is in)

VERSION (the top-level file, one line MAJOR.MINOR.PATCH) is what meson.build's project() and
CMakeLists.txt read. Fails when
- VERSION is not one line of three numbers;
- include/pipeoffload/version.hpp's PIPEOFFLOAD_VERSION_MAJOR, _MINOR and _PATCH are not
  VERSION's numbers (the header is checked in, not generated: the library is used from a plain
  include path too, docs/using.md), or the header writes the version as a string literal
  (pipeoffload::version is joined from the three macros);
- a build file (every meson.build, CMakeLists.txt, meson_options.txt, cmake/*) or a header
  under include/ writes VERSION's version: the builds read it;
- README.md, a page of docs/, or a file of tests/consumer/ asks for another series than
  VERSION's with find_package(pipeoffload X.Y ...) (a bump to a new minor or major version
  lists them here);
- BUILD_VERSION, when given (tests/meson.build passes meson.project_version()), is not VERSION.
The installed pkg-config file's and CMake package's versions are checked by
tests/consumer/check.py (find_package), CMake's and Meson's project versions of the checkout as
a subproject by its other routes.
"""
import re
import subprocess
import sys
from pathlib import Path

DEFINE = re.compile(r"^#define PIPEOFFLOAD_VERSION_(MAJOR|MINOR|PATCH) (\S+)$", re.M)
VERSION_LITERAL = re.compile(r'"\d+\.\d+\.\d+"')
FIND_PACKAGE = re.compile(r"find_package\(pipeoffload (\d+(?:\.\d+)*)")


def tracked(root):
    """The checkout's files, relative to root: those git tracks, or (no git) every file outside
    .git and the build directories."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, check=True)
        return sorted(Path(f) for f in out.stdout.split("\0") if f and (root / f).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and
                      not any(part == ".git" or part.startswith("build") for part in p.relative_to(root).parts))


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    build_version = sys.argv[2] if len(sys.argv) > 2 else None
    text = (root / "VERSION").read_text(encoding="utf-8")
    if not re.fullmatch(r"\d+\.\d+\.\d+\n?", text):
        print(f"FAIL: VERSION should be one line MAJOR.MINOR.PATCH, it is {text!r}")
        return 1
    version = text.strip()
    numbers = dict(zip(("MAJOR", "MINOR", "PATCH"), version.split(".")))
    bad = []

    header = root / "include" / "pipeoffload" / "version.hpp"
    source = header.read_text(encoding="utf-8")
    defines = dict(DEFINE.findall(source))
    for part, number in numbers.items():
        if defines.get(part) != number:
            bad.append(f"{header.relative_to(root)}: PIPEOFFLOAD_VERSION_{part} is {defines.get(part)}, "
                       f"VERSION says {number}")
    for literal in VERSION_LITERAL.findall(source):
        bad.append(f"{header.relative_to(root)}: writes {literal}; pipeoffload::version is joined from the macros")

    series = ".".join(version.split(".")[:2])
    spelled = re.compile(r"(?<![\w.])" + re.escape(version) + r"(?![\w.])")
    for rel in tracked(root):
        build_file = rel.name in ("meson.build", "CMakeLists.txt", "meson_options.txt") or rel.parts[0] == "cmake"
        if build_file or (rel.parts[0] == "include" and rel != header.relative_to(root)):
            for n, line in enumerate((root / rel).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if spelled.search(line):
                    bad.append(f"{rel}:{n}: writes the version {version} (read it from VERSION): {line.strip()}")
        if rel.name == "README.md" or rel.parts[0] == "docs" or rel.parts[:2] == ("tests", "consumer"):
            for n, line in enumerate((root / rel).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for asked in FIND_PACKAGE.findall(line):
                    if asked != series:
                        bad.append(f"{rel}:{n}: asks for pipeoffload {asked}, VERSION is {version} "
                                   f"(find_package(pipeoffload {series} ...)): {line.strip()}")

    if build_version is not None and build_version != version:
        bad.append(f"the build's version is {build_version}, VERSION says {version}")
    if bad:
        print("FAIL: the version disagrees with VERSION (" + version + "):\n  " + "\n  ".join(bad))
        return 1
    print(f"version {version}: VERSION, version.hpp and the find_package requests agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
