#!/usr/bin/env python3
"""Citations resolve inside the repository: fail on every reference to a file outside it and on
every "docs/NAME.md section N" whose page or section does not exist.

usage: check_citations.py [REPO_ROOT]        (default: the checkout this script is in)

Reads every tracked text file (git ls-files) and fails, listing each offending line, when
- it names DESIGN.md or STYLE.md (the design notes beside the checkout that docs/design.md
  replaces: a reader of the repository alone cannot follow them);
- it cites docs/NAME.md and docs/NAME.md does not exist, or cites "docs/NAME.md section N"
  and the page has no heading numbered N ("## N. ...").
"""
import re
import subprocess
import sys
from pathlib import Path

OUTSIDE = re.compile(r"\b(DESIGN|STYLE)\.md\b")
CITE = re.compile(r"docs/([A-Za-z0-9_\-]+\.md)(?:\s*,?\s*sections?\s+(\d+)(?:\s*(?:-|to|and)\s*(\d+))?)?")
HEADING = re.compile(r"^#{2,3}\s+(\d+)\.", re.M)
SELF = "tests/docs/check_citations.py"


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    try:
        files = subprocess.run(["git", "-C", str(root), "ls-files"], check=True, capture_output=True,
                               text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts
                 and not p.parts[len(root.parts)].startswith("build")]
    sections = {}
    problems = []
    for rel in sorted(files):
        path = root / rel
        if rel == SELF or not path.is_file() or path.suffix in (".png", ".svg", ".bin", ".gz"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                problems.append(f"{rel}:{no}: names a file outside the repository: {line.strip()[:120]}")
            for m in CITE.finditer(line):
                page = root / "docs" / m.group(1)
                if not page.is_file():
                    problems.append(f"{rel}:{no}: cites docs/{m.group(1)}, which does not exist")
                    continue
                if m.group(2) is None:
                    continue
                if page not in sections:
                    sections[page] = set(int(n) for n in HEADING.findall(page.read_text(encoding="utf-8")))
                for n in filter(None, (m.group(2), m.group(3))):
                    if int(n) not in sections[page]:
                        problems.append(f"{rel}:{no}: cites docs/{m.group(1)} section {n}, which has no such "
                                        f"section (it has {sorted(sections[page])})")
    if problems:
        print("\n".join(problems))
        print(f"FAIL: {len(problems)} citation(s) do not resolve inside the repository")
        return 1
    print(f"ok: {len(files)} files, every citation resolves inside the repository")
    return 0


if __name__ == "__main__":
    sys.exit(main())
