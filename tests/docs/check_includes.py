#!/usr/bin/env python3
"""Includes flow one way (docs/design.md section 4): fail on every back-edge of the include graph.

usage: check_includes.py [REPO_ROOT]        (default: the checkout this script is in)

Reads every header under include/pipeoffload/ and models/, resolves its #include "..." and
#include <pipeoffload/...> lines, gives each header the layer of its folder (LAYERS below) and fails, listing every offending include, when
- a header includes one from a higher layer (a back-edge), or one of a peer layer without a
  rule in PEER_EDGES saying which way that pair goes;
- the library core includes model code (models sit above everything; nothing includes them);
- a header outside the CUDA places (backend/cuda/, comm/nccl/, comm/cuda/, the CUDA umbrella cuda.hpp,
  models) includes CUDA, directly or through another header; MPI likewise outside comm/mpi/;
- a header's folder has no layer (a new folder must be placed in LAYERS) or an include does
  not resolve to a file.
There is no allow-list: every edge obeys the rules. samples/ and tools/ are programs, not
layers: exempt, except that the worked example (EXAMPLE) includes only the installed library,
the standard library and its own headers.
"""
import re
import sys
from pathlib import Path

# Layers, bottom first. A header may include its own layer (same folder group) and any lower
# one; peers (the same number) include each other only as PEER_EDGES allows. The first prefix
# that matches a header's path (relative to include/pipeoffload/, or to the repository root
# for models/) gives its layer.
LAYERS = [
    # prefix,                  layer       rank
    ("error.hpp",              "core",     0),  # every exception type
    ("version.hpp",            "core",     0),
    ("tensor.hpp",             "core",     0),  # DType, tensor views
    ("fnv1a.hpp",              "core",     0),  # the one checksum
    ("detail/",                "core",     0),  # helpers of no layer (host_device.hpp)
    ("policy/",                "policy",   1),
    ("memory/",                "memory",   1),  # sizes of what a rank holds: the runtime's and the planner's
    ("schedule/",              "schedule", 2),
    ("sim/",                   "sim",      3),
    ("plan/",                  "plan",     3),
    ("backend/",               "backend",  3),
    ("comm/",                  "comm",     3),
    ("layer.hpp",              "layer",    3),  # the layer concept (docs/design.md section 4: beside comm/, backend/)
    ("packing.hpp",            "layer",    3),  # packed rows' document offsets, a step input layers read
    ("runtime/",               "runtime",  4),
    ("ops/",                   "ops",      4),  # ops for layers: element math, CPU (and CUDA) row ops
    ("pipeoffload.hpp",        "umbrella", 5),  # front doors: include the library, never a model
    ("runtime.hpp",            "umbrella", 5),
    ("cuda.hpp",               "umbrella", 5),
    ("models/",                "models",   6),  # models/gpt/ at the repository root
]
# Peers that may include each other, one way only, and why.
PEER_EDGES = {
    ("plan", "sim"): "the planner simulates each candidate schedule with the one timing engine",
    ("comm", "backend"): "a communicator runs on a backend's streams (comm/nccl on backend/cuda)",
}
# Headers that may include CUDA (directly or through another header) and MPI.
CUDA_PLACES = ("backend/cuda/", "comm/nccl/", "comm/cuda/", "ops/cuda.hpp", "cuda.hpp", "models/")
MPI_PLACES = ("comm/mpi/",)
# The worked example of docs/your_model.md, which must build from an installed prefix.
EXAMPLE = ("samples/custom_model.hpp", "samples/custom_model.cpp", "samples/cli.hpp")
CUDA_SYSTEM = re.compile(r"^(cuda|cublas|cudnn|cufft|curand|cusparse|nccl|nvrtc|nvtx|cub/|thrust/|cuda/)")
MPI_SYSTEM = re.compile(r"^mpi\.h$")

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def layer_of(rel):
    for prefix, name, rank in LAYERS:
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            return name, rank
    return None, None


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    lib = root / "include" / "pipeoffload"
    if not lib.is_dir():
        sys.exit(f"FAIL: no {lib}")
    headers = sorted(p for d in (lib, root / "models") if d.is_dir() for p in d.rglob("*") if p.suffix in (".hpp", ".h", ".cuh"))

    def name(p):  # a header's name in LAYERS' terms
        return p.relative_to(lib).as_posix() if p.is_relative_to(lib) else p.relative_to(root).as_posix()

    problems = []
    edges = {}  # header name -> [(line, included name)]
    system = {}  # header name -> [(line, system header)]
    for p in headers:
        src = p.read_text(encoding="utf-8")
        h = name(p)
        edges[h], system[h] = [], []
        for m in INCLUDE.finditer(src):
            line = src.count("\n", 0, m.start()) + 1
            kind, target = m.group(1), m.group(2)
            if kind == "<" and not target.startswith(("pipeoffload/", "models/")):
                system[h].append((line, target))
                continue
            candidates = ([p.parent / target] if kind == '"' else []) + [root / "include" / target, root / target]
            hit = next((c.resolve() for c in candidates if c.is_file()), None)
            if hit is None:
                problems.append(f"{h}:{line}: #include {m.group(0).split('include', 1)[1].strip()} does not resolve to a file")
                continue
            if not (hit.is_relative_to(lib) or hit.is_relative_to(root / "models")):
                problems.append(f"{h}:{line}: includes {hit.relative_to(root) if hit.is_relative_to(root) else hit}, "
                                "outside include/pipeoffload/ and models/")
                continue
            edges[h].append((line, name(hit)))

    for h in edges:
        lh, rh = layer_of(h)
        if lh is None:
            problems.append(f"{h}: its folder has no layer; place it in LAYERS of {Path(__file__).name}")
            continue
        for line, t in edges[h]:
            lt, rt = layer_of(t)
            if lt is None or lt == lh or (rt < rh and lt != "models"):
                continue
            if lt == "models":
                why = "the library core includes model code (models sit above the library; nothing in it includes them)"
            elif rt > rh:
                why = f"a back-edge: {lh} (layer {rh}) includes {lt} (layer {rt}), which sits above it"
            elif (lh, lt) in PEER_EDGES:
                continue
            elif (lt, lh) in PEER_EDGES:
                why = f"{lh} and {lt} are peers and {lt} includes {lh} ({PEER_EDGES[(lt, lh)]}), not the other way"
            else:
                why = f"{lh} and {lt} are peers (layer {rh}) with no rule for {lh} -> {lt} in PEER_EDGES"
            problems.append(f"{h}:{line}: includes {t}: {why}")

    # CUDA and MPI only in their places: reported where an include crosses into them (a system
    # header, or a header of those places that pulls one in), not at every header above.
    def pulls(h, rx, seen):
        """The first chain of includes from h to a system header matching rx, or None."""
        for line, s in system.get(h, []):
            if rx.search(s):
                return [f"{h}:{line} <{s}>"]
        for line, t in edges.get(h, []):
            if t not in seen:
                seen.add(t)
                chain = pulls(t, rx, seen)
                if chain:
                    return [f"{h}:{line}"] + chain
        return None

    for what, rx, places in (("CUDA", CUDA_SYSTEM, CUDA_PLACES), ("MPI", MPI_SYSTEM, MPI_PLACES)):
        inside = lambda x: x.startswith(places)
        for h in edges:
            if inside(h):
                continue
            for line, s in system[h]:
                if rx.search(s):
                    problems.append(f"{h}:{line}: includes <{s}>: {what} belongs in {', '.join(places)} only")
            for line, t in edges[h]:
                chain = pulls(t, rx, {t}) if inside(t) else None
                if chain:
                    problems.append(f"{h}:{line}: includes {t}, which brings in {what} ({' -> '.join(chain)}); "
                                    f"{what} belongs in {', '.join(places)} only")

    # The worked example of "Your own model" builds from an installed prefix: it includes the
    # installed library (<pipeoffload/...>) and the standard library, nothing of models/.
    for name in EXAMPLE:
        text = (root / name).read_text()
        for m in INCLUDE.finditer(text):
            kind, target = m.group(1), m.group(2)
            local = kind == '"' and (root / name).parent.joinpath(target).exists()
            if not (target.startswith("pipeoffload/") or local or "/" not in target and "." not in target):
                line = text.count("\n", 0, m.start()) + 1
                shown = f"<{target}>" if kind == "<" else f'"{target}"'
                problems.append(f"{name}:{line}: includes {shown}: the worked example may include only "
                                f"<pipeoffload/...>, the standard library and its own headers (it must build "
                                f"from an installed prefix)")

    n_edges = sum(len(e) for e in edges.values())
    if problems:
        print(f"FAIL: {len(problems)} include(s) break the layering of docs/design.md section 4 "
              f"({len(headers)} headers, {n_edges} includes):")
        for p in problems:
            print("  " + p)
        return 1
    print(f"ok: {len(headers)} headers, {n_edges} includes flow one way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
