#!/usr/bin/env python3
"""Citations resolve inside the repository: fail on every reference to a file outside it, on
every "docs/NAME.md section N" whose page or section does not exist, and on every Markdown link
of README.md and docs/ whose file or heading does not exist; README.md stays a front door.

usage: check_citations.py [REPO_ROOT]        (default: the checkout this script is in)

Reads every tracked text file (git ls-files) and fails, listing each offending line, when
- it names DESIGN.md or STYLE.md (the design notes beside the checkout that docs/design.md
  replaces: a reader of the repository alone cannot follow them);
- it cites docs/NAME.md and docs/NAME.md does not exist, or cites "docs/NAME.md section N"
  and the page has no heading numbered N ("## N. ..."), or cites 'docs/NAME.md, "Title"' or
  'README, "Title"' and the page has no heading that starts with Title;
- it is README.md or a page of docs/ and has a link [text](target) whose target (relative to
  the page) is not a file or folder of the repository, or whose #anchor is no heading of the
  target page (GitHub's anchors: lower case, punctuation dropped, spaces as '-');
- it is README.md and has more than README_LINES lines (the rest belongs in docs/).
"""
import functools
import re
import subprocess
import sys
from pathlib import Path

OUTSIDE = re.compile(r"\b(DESIGN|STYLE)\.md\b")
CITE = re.compile(r"docs/([A-Za-z0-9_\-]+\.md)(?:\s*,?\s*sections?\s+(\d+)(?:\s*(?:-|to|and)\s*(\d+))?)?")
HEADING = re.compile(r"^#{2,3}\s+(\d+)\.", re.M)
SELF = "tests/docs/check_citations.py"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_LINES = 200
TITLED = re.compile(r"\b(docs/[A-Za-z0-9_\-]+\.md|README(?:\.md)?),?\s+\"([^\"]+)\"")


@functools.cache
def titles(page):
    """The text of a Markdown page's headings, lower case (fenced code skipped)."""
    out, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            out.append(m.group(1).lower())
    return out


def anchors(page):
    """The anchors of a Markdown page's headings, as GitHub makes them from titles()."""
    return {re.sub(r"[^\w\- ]", "", t).replace(" ", "-") for t in titles(page)}


def check_links(root, rel, text, problems):
    """Every relative link of a Markdown page resolves: its file, and its heading if it has one."""
    here = (root / rel).parent
    for no, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            page = (here / path).resolve() if path else root / rel
            if not page.exists() or root not in page.parents and page != root:
                problems.append(f"{rel}:{no}: links to {target}, which is not in the repository")
            elif anchor and page.suffix == ".md" and anchor not in anchors(page):
                problems.append(f"{rel}:{no}: links to {target}, whose page has no such heading")


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
        if rel == "README.md" or (rel.startswith("docs/") and rel.endswith(".md")):
            check_links(root, rel, text, problems)
        if rel == "README.md" and len(text.splitlines()) > README_LINES:
            problems.append(f"README.md: {len(text.splitlines())} lines, more than {README_LINES}: move the rest to docs/")
        for no, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                problems.append(f"{rel}:{no}: names a file outside the repository: {line.strip()[:120]}")
            for m in TITLED.finditer(line):
                page = root / ("README.md" if m.group(1).startswith("README") else m.group(1))
                if page.is_file() and not any(t.startswith(m.group(2).lower())
                                              for t in titles(page)):
                    problems.append(f"{rel}:{no}: cites {m.group(1)}, \"{m.group(2)}\", which has no such heading")
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
