#!/usr/bin/env python3
"""Every `/// @code ... /// @endcode` example in include/ compiles: fail naming the header and
line of each one that does not.

usage: check_code_blocks.py ROOT OUT_DIR [--arg=FLAG ...] [--cuda-arg=FLAG ...] [--mpi-compiler=MPICXX] -- COMPILER...

COMPILER is the project's C++ compiler command (Meson's cpp.cmd_array()); --arg adds a flag to
every compile (meson.build passes the constant-evaluation budget it gives the tests).

The rules an example is written to:
- Where it goes. An example whose first code line (comments aside) starts with `struct`,
  `class` or `template` is a declaration and is placed at namespace scope; one that starts
  with `int main(` is a program's main and is placed at global scope (so at most one per kind
  of example, below); any other example is a sequence of statements and is placed in the body
  of a function. Each example but a main gets a namespace of its own, so two examples may use
  the same names.
- What it sees. Every header that holds an example, the CPU umbrella pipeoffload/runtime.hpp,
  and tests/docs/code_context.hpp: the names examples use without declaring them (`rt`, a
  runtime; `step`; `dev`; `comm`; ...), each declared once there with its type. An example
  declares everything else it uses; prose (`...`) goes in comments.
- Where it compiles. An example in a CUDA header (backend/cuda/, comm/nccl/, comm/cuda/, ops/cuda.hpp, cuda.hpp) or one
  that calls NCCL, cuDNN, cuBLAS or the CUDA runtime needs the CUDA build's flags
  (--cuda-arg, given by meson.build where the CUDA backend is built, and the CUDA umbrella
  pipeoffload/cuda.hpp is included); one in comm/mpi/ needs MPI's compiler wrapper
  (--mpi-compiler, given where MPI is found), which is told to run COMPILER (OMPI_CXX,
  MPICH_CXX). The same places tests/docs/check_includes.py allows CUDA and MPI in. Examples whose needs this build does
  not meet are listed and not compiled; the test still fails if any other example fails.
- How strictly. -std=c++20 -fsyntax-only with the project's warnings (-Wall -Wextra
  -Wpedantic) as errors, except the unused-name ones: an example may declare what it only
  shows.

All the examples of one kind (CPU, CUDA, MPI, MPI and CUDA) are compiled as one translation unit,
written to OUT_DIR; `#line` directives make every diagnostic name the header and line of the
example it is in.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

BEGIN = re.compile(r"^\s*///\s?@code\s*$")
END = re.compile(r"^\s*///\s?@endcode\s*$")
PREFIX = re.compile(r"^\s*/// ?")
DECLARATION = re.compile(r"^(struct|class|template)\b")
CUDA_PLACES = ("backend/cuda/", "comm/nccl/", "comm/cuda/", "ops/cuda.hpp", "cuda.hpp")
MPI_PLACES = ("comm/mpi/",)
CUDA_CALL = re.compile(r"\b(nccl|cuda|cublas|cudnn)[A-Z]\w*")
WARNINGS = ["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wno-unused-variable", "-Wno-unused-but-set-variable",
            "-Wno-unused-parameter", "-Wno-unused-local-typedefs", "-Wno-unused-function"]
# A place in an example: the headers themselves are included by absolute path (-I ROOT/include),
# so a relative include/... path in a diagnostic (an error, or a "required from here") can only
# come from an example's #line.
EXAMPLE_PLACE = re.compile(r"^(include/[^:\s]+):(\d+):", re.M)


class Block:
    def __init__(self, header, line, code):
        self.header = header  # relative to ROOT, e.g. include/pipeoffload/layer.hpp
        self.line = line  # the header's line of the example's first code line (1-based)
        self.code = code  # the example's lines, without the /// prefix
        rel = header[len("include/pipeoffload/"):]
        self.needs = set()
        if rel.startswith(CUDA_PLACES) or any(CUDA_CALL.search(c) for c in code):
            self.needs.add("cuda")
        if rel.startswith(MPI_PLACES):
            self.needs.add("mpi")

    def where(self):
        return f"{self.header}:{self.line - 1}"  # the @code line

    def scope(self):
        """global (a main), namespace (a declaration) or function (statements): the rule above."""
        first = next((c.strip() for c in self.code if c.strip() and not c.strip().startswith("//")), "")
        if first.startswith("int main("):
            return "global"
        return "namespace" if DECLARATION.match(first) else "function"


def find_blocks(root):
    blocks, problems = [], []
    for path in sorted((root / "include").rglob("*")):
        if path.suffix not in (".hpp", ".h", ".cuh") or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        start = None
        for i, text in enumerate(lines, start=1):
            if BEGIN.match(text):
                if start is not None:
                    problems.append(f"{rel}:{i}: @code inside the @code block of line {start}")
                start = i
            elif END.match(text):
                if start is None:
                    problems.append(f"{rel}:{i}: @endcode without @code")
                else:
                    blocks.append(Block(rel, start + 1, [PREFIX.sub("", c, count=1) for c in lines[start:i - 1]]))
                    start = None
            elif start is not None and not text.lstrip().startswith("///"):
                problems.append(f"{rel}:{start}: @code block not closed by a /// @endcode line")
                start = None
        if start is not None:
            problems.append(f"{rel}:{start}: @code block not closed")
    return blocks, problems


def translation_unit(blocks, kind, tu_name):
    headers = sorted({b.header[len("include/"):] for b in blocks})
    out = [f"// {tu_name}: the {kind} @code examples of include/, written by tests/docs/check_code_blocks.py.",
           "#include <pipeoffload/runtime.hpp>"]
    if "mpi" in kind:
        out.insert(1, "#define PIPEOFFLOAD_EXAMPLES_MPI  // code_context.hpp's mpi names")
    if "cuda" in kind:
        out.append("#include <pipeoffload/cuda.hpp>")
    out += [f"#include <{h}>" for h in headers if h not in ("pipeoffload/runtime.hpp", "pipeoffload/cuda.hpp")]
    out += ['#include "code_context.hpp"', ""]
    for n, b in enumerate(blocks):
        scope = b.scope()
        if scope == "global":
            out.append(f"// {b.where()}")
        else:
            out += [f"namespace example_{n} {{  // {b.where()}", f"using namespace pipeoffload_examples::{kind};"]
        if scope == "function":
            out.append("[[maybe_unused]] void example() {")
        out.append(f'#line {b.line} "{b.header}"')
        out += b.code
        out.append(f'#line {len(out) + 2} "{tu_name}"')  # the lines below are this file's again
        out += {"global": [], "namespace": ["}"], "function": ["}", "}"]}[scope] + [""]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("out_dir")
    parser.add_argument("--arg", action="append", default=[], help="a flag for every compile (repeat)")
    parser.add_argument("--cuda-arg", action="append", default=None,
                        help="a flag of the CUDA build (repeat); none: CUDA examples are not compiled")
    parser.add_argument("--mpi-compiler", help="MPI's C++ compiler wrapper; none: MPI examples are not compiled")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("no compiler given (after --)")
    args = parser.parse_args(argv[:argv.index("--")])
    cmd = argv[argv.index("--") + 1:]
    root = Path(args.root).resolve()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("code_blocks_*.cpp"):
        old.unlink()  # a kind not compiled this time leaves no stale file behind

    blocks, problems = find_blocks(root)
    if problems:
        print("FAIL: malformed @code blocks:\n  " + "\n  ".join(problems))
        return 1
    if not blocks:
        print(f"FAIL: no @code blocks found under {root / 'include'} (has the comment style changed?)")
        return 1

    # One translation unit per kind of example: (kind, what it needs, compiler, extra flags).
    cuda = args.cuda_arg
    mpi = args.mpi_compiler
    kinds = [("cpu", set(), cmd, []),
             ("cuda", {"cuda"}, cmd, cuda),
             ("mpi", {"mpi"}, [mpi] if mpi else None, []),
             ("mpi_cuda", {"mpi", "cuda"}, [mpi] if mpi else None, cuda)]
    env = dict(os.environ, OMPI_CXX=" ".join(cmd), MPICH_CXX=" ".join(cmd))
    failed, compiled, skipped = [], 0, []
    for kind, needs, compiler, extra in kinds:
        mine = [b for b in blocks if b.needs == needs]
        if not mine:
            continue
        if compiler is None or extra is None:
            missing = [name for name, have in (("mpi", mpi is not None), ("cuda", cuda is not None))
                       if name in needs and not have]
            skipped += [f"{b.where()} (needs {' and '.join(m.upper() for m in missing)})" for b in mine]
            continue
        tu_name = f"code_blocks_{kind}.cpp"
        (out_dir / tu_name).write_text(translation_unit(mine, kind, tu_name), encoding="utf-8")
        full = compiler + args.arg + extra + ["-std=c++20", "-fsyntax-only"] + WARNINGS + [
            "-I", str(root / "include"), "-I", str(root / "tests" / "docs"), str(out_dir / tu_name)]
        proc = subprocess.run(full, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        compiled += len(mine)
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-20000:])
            bad = set()
            for m in EXAMPLE_PLACE.finditer(proc.stderr):
                header, line = m.group(1), int(m.group(2))
                hit = [b for b in mine if b.header == header and b.line <= line < b.line + len(b.code)]
                bad.add(hit[0].where() if hit else f"{header}:{line} (outside every example)")
            failed += sorted(bad) or [f"{out_dir / tu_name} (see the compiler's output above)"]
    for s in skipped:
        print(f"not compiled here: the @code example at {s}")
    if failed:
        print(f"FAIL: {len(failed)} @code example(s) do not compile:\n  " + "\n  ".join(failed))
        return 1
    print(f"ok: {compiled} of {len(blocks)} @code examples in include/ compile ({len(skipped)} need what this build lacks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
