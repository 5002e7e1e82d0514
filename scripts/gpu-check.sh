#!/usr/bin/env bash
# scripts/gpu-check.sh: validate a GPU node for pipeoffload, offline if need be, in one command.
#
#   bash scripts/gpu-check.sh                      # build the CUDA targets, run every GPU check, write a report
#   bash scripts/gpu-check.sh --bundle DIR         # on a connected machine: gather what the check needs into DIR
#   bash scripts/gpu-check.sh --from DIR           # on the (air-gapped) node: use DIR, never the network
#
# Options:
#   --from DIR        take the cuDNN frontend headers, doctest, OpenBLAS (and, if bundled and the
#                     node lacks them, cuDNN and NCCL) from a bundle made by --bundle; nothing is
#                     downloaded and nothing is installed outside the build directory
#   --bundled-tools   with --from: also use the bundle's Meson and Ninja (by default only when the
#                     node has none)
#   --build-dir DIR   where to build (default build-gpu)
#   --report FILE     the Markdown report (default <build-dir>/gpu-check/report.md)
#   --step-limit S    no check runs longer than S seconds (default: each its own, 300 to 900 s)
#   --budget S        the checks together take at most S seconds: each step gets at most what is
#                     left, and a step that would start with under 20 s left is reported as not run
#   --only "N..."     run only the named steps (the report's names; --help of an unknown one lists
#                     them), in the kit's order
#   --log-dir DIR     each step's log and the report there (default <build-dir>/gpu-check); the
#                     report is rewritten after every step, so a run cut short keeps what it did
#   --build-only      configure and build, run nothing (no GPU needed; the bundle round trip uses it)
#   --no-build        run the checks on the binaries already in --build-dir, built elsewhere with
#                     --build-only (a login node, a workstation with the same CUDA major): nothing
#                     is configured or compiled on the GPU node
#   --targets "T..."  with --build-only: these Ninja targets instead of every CUDA one
#   --pack FILE       with --build-only: also write FILE (.tar.gz, about 20 MB): the checks'
#                     binaries, stripped, with the run-time libraries a GPU image may lack
#                     (OpenBLAS for the CPU references, its Fortran run-time, libstdc++). The
#                     build directory itself is too big to carry (about 63 MB of objects)
#   --unpack FILE     with --no-build: unpack FILE (made by --pack) into --build-dir first and
#                     load its libraries (libstdc++ only where the node's is older than the
#                     build machine's)
#   --bundle DIR      gather the bundle (needs PyPI and Debian's archive): Python wheels of
#                     nvidia-cudnn-frontend, meson and ninja, and Debian packages of doctest and
#                     OpenBLAS, with a SHA256 manifest
#   --with-cuda-libs  with --bundle: also the nvidia-cudnn-cu13 and nvidia-nccl-cu13 wheels
#                     (about 1 GB), for nodes without cuDNN or NCCL
#
# On a machine without an NVIDIA GPU the check (not --bundle, not --build-only) prints one line
# and exits 77. Exit status: 0 when every step passed, 1 when one failed, 2 for bad arguments.
# What runs, in order (each step's log and time go into the report):
#   1. the CPU-side CUDA tests (launch shapes, layouts, conformance on backend::Cpu);
#   2. every GPU test (tests/cuda: kernels, cuBLASLt, cuDNN attention, NCCL, the Cuda backend's
#      conformance, gpt::CudaGptStage against the CPU model, a PO-F po::Runtime on GPUs);
#   3. train_gpt --backend cuda against --backend cpu (meson test --suite cuda);
#   4. bench/cuda/gpt_block_gpu: MFU of a GPT block's F+B+W at h = s = 4096 in bf16, pinned
#      D2H and H2D bandwidth per direction and both at once, the measured k;
#   4b. bench/cuda/train_step: the steady-state step of one rank x 2 chunks at h = s = 4096, 4
#      layers, 8 microbatches (PO-F, GIS-H, ZB-V, 1F1B-I), run and replayed as a CUDA graph;
#      then 2 ranks x 2 chunks sharing the GPU (PO-F, ZB-V, 1F1B-I; comm::SharedGpu, no graphs);
#   5. several ranks on one GPU (--ranks-per-gpu, comm::SharedGpu): PO-F and ZB-V at d = 4 and
#      dp 2 x d 2 with ZeRO-1, each the one-rank bits on the exact path (tests/cuda/test_shared_gpu.py);
#   6. train_gpt --backend cuda with PO-F on the GPUs present (one GPU: one rank, 4 chunks);
#   7. compute-sanitizer memcheck and racecheck on a short train_gpt run, and on two ranks
#      sharing the GPU, where installed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }  # the header above
die() {
  echo "gpu-check: $*" >&2
  exit 2
}

bundle_out="" from="" build="build-gpu" report="" build_only=0 no_build=0 step_limit=0 with_libs=0 bundled_tools=0 targets=""
budget=0 only="" log_dir="" pack="" unpack=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) [ $# -ge 2 ] || die "--bundle needs a directory"; bundle_out=$2; shift 2 ;;
    --from) [ $# -ge 2 ] || die "--from needs a directory"; from=$2; shift 2 ;;
    --build-dir) [ $# -ge 2 ] || die "--build-dir needs a directory"; build=$2; shift 2 ;;
    --report) [ $# -ge 2 ] || die "--report needs a file"; report=$2; shift 2 ;;
    --targets) [ $# -ge 2 ] || die "--targets needs a list of Ninja targets"; targets=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --no-build) no_build=1; shift ;;
    --step-limit)
      [ $# -ge 2 ] || die "--step-limit needs a number of seconds"
      [[ $2 =~ ^[1-9][0-9]*$ ]] || die "--step-limit takes whole seconds >= 1, got '$2'"
      step_limit=$2; shift 2 ;;
    --budget)
      [ $# -ge 2 ] || die "--budget needs a number of seconds"
      [[ $2 =~ ^[1-9][0-9]*$ ]] || die "--budget takes whole seconds >= 1, got '$2'"
      budget=$2; shift 2 ;;
    --only) [ $# -ge 2 ] || die "--only needs a list of step names"; only=$2; shift 2 ;;
    --log-dir) [ $# -ge 2 ] || die "--log-dir needs a directory"; log_dir=$2; shift 2 ;;
    --with-cuda-libs) with_libs=1; shift ;;
    --pack) [ $# -ge 2 ] || die "--pack needs a file"; pack=$2; shift 2 ;;
    --unpack) [ $# -ge 2 ] || die "--unpack needs a file"; unpack=$2; shift 2 ;;
    --bundled-tools) bundled_tools=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' (--help lists them)" ;;
  esac
done
[ -n "$bundle_out" ] && [ -n "$from" ] && die "--bundle and --from exclude each other: make the bundle on a connected machine, use it on the node"
[ "$with_libs" = 1 ] && [ -z "$bundle_out" ] && die "--with-cuda-libs applies only to --bundle"
[ "$bundled_tools" = 1 ] && [ -z "$from" ] && die "--bundled-tools applies only to --from"
[ -n "$targets" ] && [ "$build_only" = 0 ] && die "--targets applies only to --build-only"
[ "$no_build" = 1 ] && [ "$build_only" = 1 ] && die "--no-build and --build-only exclude each other: build with --build-only, check with --no-build"
[ "$no_build" = 1 ] && [ -n "$bundle_out" ] && die "--no-build applies to the check, not to --bundle"
[ -n "$pack" ] && [ "$build_only" = 0 ] && die "--pack applies only to --build-only"
[ -n "$unpack" ] && [ "$no_build" = 0 ] && die "--unpack applies only to --no-build"
[ -z "$unpack" ] || [ -f "$unpack" ] || die "--unpack: no file '$unpack'"
# The steps, in the order they run (the report's names; --only picks among them).
all_steps="cuda-host gpu-tests train-gpt-cuda-vs-cpu gpt-block-bench train-step-bench train-step-bench-ranks shared-gpu
train-gpt-po-f sanitizer-memcheck sanitizer-racecheck sanitizer-memcheck-shared sanitizer-racecheck-shared"
for n in $only; do
  [[ " ${all_steps//$'\n'/ } " == *" $n "* ]] || die "--only: no step named '$n' (the steps: ${all_steps//$'\n'/ })"
done

# Pinned versions: what the project builds and tests with (scripts/dev.sh, Debian 12).
frontend_version=1.32.0
meson_version=1.0.1
ninja_version=1.11.1.1

# ---- --bundle: gather, on a connected machine ------------------------------------------------
if [ -n "$bundle_out" ]; then
  mkdir -p "$bundle_out/wheels" "$bundle_out/debs" || die "cannot create $bundle_out"
  echo "gpu-check: gathering the bundle into $bundle_out"
  # The frontend wheel is only unpacked for its headers, so any Python's build serves; Meson is
  # pure Python; Ninja's wheel carries a static binary.
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
    -d "$bundle_out/wheels" "nvidia-cudnn-frontend==$frontend_version" ||
    die "pip could not download nvidia-cudnn-frontend==$frontend_version (is PyPI reachable?)"
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11 \
    -d "$bundle_out/wheels" "meson==$meson_version" "ninja==$ninja_version" || die "pip could not download meson and ninja"
  if [ "$with_libs" = 1 ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux2014_x86_64 --python-version 3.11 -d "$bundle_out/wheels" nvidia-cudnn-cu13 nvidia-nccl-cu13 ||
      die "pip could not download the nvidia-cudnn-cu13 and nvidia-nccl-cu13 wheels"
  fi
  (cd "$bundle_out/debs" && apt-get download doctest-dev libopenblas0-pthread libgfortran5 >/dev/null 2>&1) ||
    die "apt-get download of doctest-dev, libopenblas0-pthread and libgfortran5 failed (is Debian's archive reachable?)"
  (cd "$bundle_out" && find wheels debs -type f | sort | xargs sha256sum >MANIFEST.sha256)
  echo "gpu-check: bundle ready ($(du -sh "$bundle_out" | cut -f1)): $(cd "$bundle_out" && find wheels debs -type f | sort | xargs -n1 basename | tr '\n' ' ')"
  echo "gpu-check: copy it and this checkout to the node, then run: bash scripts/gpu-check.sh --from DIR"
  exit 0
fi

# ---- is there a GPU? -----------------------------------------------------------------------
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
if [ "$build_only" = 0 ] && [ "$gpus" -eq 0 ]; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check"
  exit 77
fi
[ "$no_build" = 1 ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || die "nvcc not found: install the CUDA toolkit (or put its bin/ on PATH)"
export PATH="$PATH:/usr/local/cuda/bin"

mkdir -p "$build" || die "cannot create $build"
build=$(cd "$build" && pwd)
deps="$build/gpu-deps"
mkdir -p "$deps"
check_targets="tests/cuda/test_cuda_host tests/cuda/test_cuda_gpu bench/cuda/gpt_block_gpu bench/cuda/train_step samples/train_gpt pipeoffload-plan"

# ---- --unpack: binaries built elsewhere, with their run-time libraries ----------------------
if [ -n "$unpack" ]; then
  tar xzf "$unpack" -C "$build" || die "cannot unpack $unpack into $build"
  [ -d "$build/carried-lib" ] || die "$unpack holds no carried-lib/: make it with --build-only --pack FILE"
  export LD_LIBRARY_PATH="$build/carried-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # (ldd's output taken whole first: with pipefail, grep -q quitting early fails ldd's write.)
  if grep -q "GLIBCXX.*not found" <<<"$(ldd "$build/samples/train_gpt" 2>&1)"; then
    export LD_LIBRARY_PATH="$build/carried-lib/cxx:$LD_LIBRARY_PATH"
  fi
fi

# ---- dependencies: from the bundle, or what the machine has ---------------------------------
# Python's nvidia-* wheels ship versioned libraries only (libcudnn.so.9): links with the plain
# names let the linker find them.
link_libs() {  # link_libs DIR...: lib*.so.N in each DIR get a lib*.so link in $deps/cuda/lib (for
  # the linker); each DIR goes on the loader's path too (the binaries need the sonames, lib*.so.N)
  mkdir -p "$deps/cuda/lib"
  for dir in "$@"; do
    for f in "$dir"/lib*.so.*; do
      [ -e "$f" ] || continue
      local base=${f##*/}
      ln -sf "$f" "$deps/cuda/lib/${base%%.so.*}.so"
    done
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  export LIBRARY_PATH="$deps/cuda/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$deps/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
has_header() { echo "#include <$1>" | ${CXX:-g++} -x c++ -fsyntax-only -I/usr/local/cuda/include - >/dev/null 2>&1; }

if [ -n "$from" ]; then
  [ -f "$from/MANIFEST.sha256" ] || die "$from has no MANIFEST.sha256: make the bundle with --bundle DIR"
  (cd "$from" && sha256sum --quiet -c MANIFEST.sha256) || die "$from: a file does not match MANIFEST.sha256 (incomplete copy?)"
  # cuDNN frontend: the headers of its wheel (a zip).
  fe=$(ls "$from"/wheels/nvidia_cudnn_frontend-*.whl 2>/dev/null | head -n 1)
  [ -n "$fe" ] || die "$from has no nvidia_cudnn_frontend wheel"
  python3 - "$fe" "$deps/cudnn-frontend" <<'PY' || die "cannot unpack the cuDNN frontend headers"
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if "/include/" in "/" + n and n.endswith((".h", ".hpp"))]
    for n in names:
        z.extract(n, out)
PY
  inc=$(dirname "$(find "$deps/cudnn-frontend" -name cudnn_frontend.h | head -n 1)")
  [ -n "$inc" ] || die "the frontend wheel holds no cudnn_frontend.h"
  export CUDNN_FRONTEND_INCLUDE="$inc"
  # doctest and OpenBLAS: Debian packages, unpacked (not installed) under the build directory.
  for deb in "$from"/debs/*.deb; do dpkg-deb -x "$deb" "$deps/root" || die "cannot unpack $deb"; done
  [ -f "$deps/root/usr/include/doctest/doctest.h" ] || die "$from holds no doctest-dev package"
  mkdir -p "$deps/pkgconfig"
  printf 'Name: doctest\nDescription: doctest from the gpu-check bundle\nVersion: 2.4.9\nCflags: -I%s\n' \
    "$deps/root/usr/include" >"$deps/pkgconfig/doctest.pc"
  export PKG_CONFIG_PATH="$deps/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  blas=$(dirname "$(find "$deps/root" -name 'libopenblas.so.0' | head -n 1)")
  [ -n "$blas" ] || die "$from holds no libopenblas0-pthread package"
  export LD_LIBRARY_PATH="$blas:$deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Meson and Ninja, when the node has none (or asked for).
  if [ "$bundled_tools" = 1 ] || ! command -v meson >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --find-links "$from/wheels" --target "$deps/py" meson ninja ||
      die "cannot install the bundle's meson and ninja wheels"
    export PATH="$deps/py/bin:$PATH" PYTHONPATH="$deps/py${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # cuDNN and NCCL from the bundle's wheels, when the node cannot compile against them.
  if ! has_header cudnn.h || ! has_header nccl.h; then
    for w in "$from"/wheels/nvidia_cudnn_cu13-*.whl "$from"/wheels/nvidia_nccl_cu13-*.whl; do
      [ -e "$w" ] || die "this node has no cuDNN or NCCL headers and the bundle has no wheels of them: bundle with --with-cuda-libs"
      python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$deps/wheels"
    done
  fi
fi
# cuDNN and NCCL from this Python's nvidia-* packages (GPU images often have them only there),
# or from a bundle's wheels unpacked above.
# With --no-build only the libraries matter: looked for where the loader cannot find them.
for pkg in cudnn nccl; do
  if [ "$no_build" = 1 ]; then
    [ -x "$build/samples/train_gpt" ] &&
      grep -q "lib$pkg\.so.* => not found" <<<"$(ldd "$build/samples/train_gpt" 2>/dev/null)" || continue
  elif has_header "$pkg.h"; then
    continue
  fi
  dir=$(python3 -c "import importlib.util as u, os; s = u.find_spec('nvidia.$pkg'); print(os.path.dirname(s.origin) if s and s.origin else (list(s.submodule_search_locations)[0] if s else ''))" 2>/dev/null)
  [ -z "$dir" ] && [ -d "$deps/wheels/nvidia/$pkg" ] && dir="$deps/wheels/nvidia/$pkg"
  if [ "$no_build" = 1 ]; then
    [ -n "$dir" ] && [ -d "$dir/lib" ] || die "lib$pkg not found (not on the loader's path, nor as Python's nvidia-$pkg package): install $pkg"
  else
    [ -n "$dir" ] && [ -d "$dir/include" ] || die "$pkg.h not found (not with the CUDA toolkit, nor as Python's nvidia-$pkg package): install $pkg, or bundle it with --with-cuda-libs"
    export CPATH="$dir/include${CPATH:+:$CPATH}"
  fi
  link_libs "$dir/lib"
done

# ---- build --------------------------------------------------------------------------------
[ -n "$log_dir" ] || log_dir="$build/gpu-check"
mkdir -p "$log_dir" || die "cannot create $log_dir"
log_dir=$(cd "$log_dir" && pwd)
[ -n "$report" ] || report="$log_dir/report.md"
jobs=$(nproc)
if [ "$no_build" = 1 ]; then
  for t in $check_targets; do
    [ -x "$build/$t" ] || die "--no-build: $build/$t is missing (build it first: bash scripts/gpu-check.sh --build-only --build-dir DIR)"
  done
elif [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release -Dcuda=enabled -Dtests=true -Dbench=true >"$log_dir/setup.log" 2>&1 ||
    { tail -n 30 "$log_dir/setup.log" >&2; die "meson setup failed (log: $log_dir/setup.log)"; }
fi
[ -n "$targets" ] || targets=$check_targets
# shellcheck disable=SC2086
if [ "$no_build" = 0 ] && ! ninja -C "$build" -j "$jobs" $targets >"$log_dir/build.log" 2>&1; then
  tail -n 40 "$log_dir/build.log" >&2
  die "the build failed (log: $log_dir/build.log)"
fi
if [ "$build_only" = 1 ]; then
  echo "gpu-check: built $targets in $build"
  if [ -n "$pack" ]; then
    stage=$(mktemp -d) || die "cannot make a temporary directory"
    trap 'rm -rf "$stage"' EXIT
    for t in $check_targets; do
      [ -x "$build/$t" ] || die "--pack: $build/$t was not built (--pack takes the checks' binaries: leave out --targets)"
      mkdir -p "$stage/$(dirname "$t")" && cp "$build/$t" "$stage/$t" && strip "$stage/$t" || die "--pack: cannot copy $t"
    done
    # The CPU references' OpenBLAS (opened at run time by its soname) and what it needs beyond
    # glibc; libstdc++ apart, used only where the node's is older.
    blas=$(ldconfig -p | awk '/libopenblas\.so\.0 .*x86-64/ { print $NF; exit }')
    [ -n "$blas" ] || die "--pack: libopenblas.so.0 not found (install libopenblas0-pthread: scripts/dev.sh does)"
    mkdir -p "$stage/carried-lib/cxx"
    cp -L "$blas" "$stage/carried-lib/libopenblas.so.0" || die "--pack: cannot copy $blas"
    ldd "$blas" | awk '/libgfortran|libquadmath/ { print $3 }' | while read -r l; do cp -L "$l" "$stage/carried-lib/"; done
    cp -L "$(ldd "$build/samples/train_gpt" | awk '/libstdc\+\+/ { print $3 }')" "$stage/carried-lib/cxx/" ||
      die "--pack: cannot copy libstdc++"
    mkdir -p "$(dirname "$pack")" && tar czf "$pack" -C "$stage" . || die "--pack: cannot write $pack"
    echo "gpu-check: packed $(du -h "$pack" | cut -f1) into $pack (on the node: --no-build --unpack $pack)"
  fi
  exit 0
fi

# ---- the report (rewritten after every step: a run cut short keeps what it did) ------------------
write_report() {
  {
    echo "# pipeoffload GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- GPUs ($gpus):"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/  - /'
    echo "- CUDA: $(command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 1 || echo "no nvcc on the node"); bundle: ${from:-none}; binaries: $([ "$no_build" = 1 ] && echo "built elsewhere (--no-build)" || echo "built here")"
    echo "- checks: $(($(date +%s) - t_start)) s in all$([ "$budget" -gt 0 ] && echo " (--budget $budget s)")$([ -n "$only" ] && echo "; --only $only")"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---:|"
    for i in "${!names[@]}"; do echo "| ${names[$i]} | ${results[$i]} | ${seconds[$i]} |"; done
    command -v compute-sanitizer >/dev/null 2>&1 || echo "| compute-sanitizer | not installed: memcheck and racecheck not run | |"
    echo
    echo "## Figures"
    echo
    echo '```'
    grep -hE "MFU|GB/s|k measured|check vs CPU|saved activations|device " "$log_dir/gpt-block-bench.log" 2>/dev/null
    grep -hE "^train_step| step .* ms|graphs / run" "$log_dir/train-step-bench.log" "$log_dir/train-step-bench-ranks.log" 2>/dev/null
    grep -hE "^(wall|final_loss|params_hash|peak activation)" "$log_dir/train-gpt-po-f.log" 2>/dev/null
    grep -hE "^ok: GPU final loss" "$log_dir/train-gpt-cuda-vs-cpu.log" 2>/dev/null
    grep -hE "test cases:|assertions:" "$log_dir/gpu-tests.log" 2>/dev/null
    echo '```'
    for i in "${!names[@]}"; do
      echo
      echo "## ${names[$i]}: ${results[$i]}"
      echo
      echo '```'
      tail -n 25 "$log_dir/${names[$i]}.log"
      echo '```'
    done
  } >"$report"
}

# ---- the checks ------------------------------------------------------------------------------
declare -a names results seconds
failed=0
t_start=$(date +%s)
step() {  # step NAME TIMEOUT CMD...: runs CMD, logs to $log_dir/NAME.log, records pass/fail/skip and time
  local name=$1 limit=$2
  shift 2
  if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return 0; fi
  [ "$step_limit" -gt 0 ] && [ "$step_limit" -lt "$limit" ] && limit=$step_limit
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - ($(date +%s) - t_start)))
    if [ "$left" -lt 20 ]; then
      names+=("$name") seconds+=("0.0") results+=("not run (--budget $budget s spent)")
      write_report
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0 rc
  t0=$(date +%s%N)
  timeout "$limit" "$@" >"$log_dir/$name.log" 2>&1
  rc=$?
  names+=("$name")
  seconds+=("$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')")
  case $rc in
    0) results+=("pass") ;;
    77) results+=("skip") ;;
    124) results+=("FAIL (timed out after $limit s)"); failed=1 ;;
    *) results+=("FAIL (exit $rc)"); failed=1 ;;
  esac
  write_report
}
step cuda-host 300 "$build/tests/cuda/test_cuda_host"
step gpu-tests 900 "$build/tests/cuda/test_cuda_gpu" --duration=true
step train-gpt-cuda-vs-cpu 900 python3 tests/cuda/test_train_gpt_cuda.py "$build/samples/train_gpt"
step gpt-block-bench 600 "$build/bench/cuda/gpt_block_gpu"
step train-step-bench 600 "$build/bench/cuda/train_step"
step train-step-bench-ranks 600 "$build/bench/cuda/train_step" --ranks 2 --schedules po-f,zb-v,1f1b-i --steps 5
step shared-gpu 900 python3 tests/cuda/test_shared_gpu.py "$build/samples/train_gpt"
ranks=$gpus chunks=2
[ "$gpus" -gt 8 ] && ranks=8
[ "$gpus" -eq 1 ] && chunks=4
step train-gpt-po-f 600 "$build/samples/train_gpt" --backend cuda --schedule po-f --ranks "$ranks" --chunks "$chunks" --microbatches 8 --steps 100
short=(--backend cuda --schedule po-f --ranks 1 --chunks 2 --microbatches 2 --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 --steps 2 --quiet)
if command -v compute-sanitizer >/dev/null 2>&1; then
  # memcheck counts memory errors only: every CUDA call of ours is checked (check.hpp throws),
  # while NCCL probes its kernels with cudaFuncGetAttributes and handles the
  # cudaErrorNoKernelImageForDevice it gets for images it does not ship (12 such reports on an
  # H100 with NCCL 2.28, 2026-11-26), which memcheck would count as errors.
  step sanitizer-memcheck 600 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
    "$build/samples/train_gpt" "${short[@]}"
  # racecheck checks every kernel but cuDNN's generated SDPA kernels: closed Hopper (wgmma)
  # code that synchronises through asynchronous barriers, in which racecheck reports 56
  # hazards on an H100 (cudnn_generated_fort_native_sdpa_*, 2026-11-26) that we cannot act on;
  # our own kernels showed none.
  # (The help is read whole first: `| grep -q` under pipefail fails when grep closes the pipe
  # before compute-sanitizer has written all of it, which dropped the filter on one run.)
  exclude=()
  sanitizer_help=$(compute-sanitizer --help 2>/dev/null)
  [[ $sanitizer_help == *--kernel-name-exclude* ]] && exclude=(--kernel-name-exclude kns=cudnn_generated_fort_native_sdpa)
  step sanitizer-racecheck 600 compute-sanitizer --tool racecheck "${exclude[@]}" --error-exitcode 1 \
    "$build/samples/train_gpt" "${short[@]}"
  # The same on two ranks sharing the GPU (comm::SharedGpu's copies and events).
  shared=(--backend cuda --schedule 1f1b --ranks 2 --chunks 1 --ranks-per-gpu 2 --microbatches 2 --layers 2 --hidden 64
          --heads 4 --seq 64 --batch 2 --steps 2 --quiet)
  step sanitizer-memcheck-shared 600 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
    "$build/samples/train_gpt" "${shared[@]}"
  step sanitizer-racecheck-shared 600 compute-sanitizer --tool racecheck "${exclude[@]}" --error-exitcode 1 \
    "$build/samples/train_gpt" "${shared[@]}"
fi
total=$(($(date +%s) - t_start))
write_report

echo "gpu-check: $([ $failed = 0 ] && echo "every check passed" || echo "a check FAILED") in $total s; report: $report"
exit $failed
