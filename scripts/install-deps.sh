#!/usr/bin/env bash
# Installs what building and testing pipeoffload needs and this machine lacks: Debian's
# packages, and NVIDIA's cuDNN frontend headers where the CUDA toolkit is installed. Run by
# scripts/dev.sh before every build; on a warm machine it installs nothing (each package is
# checked first, so apt is not even updated). Needs root, or sudo.
set -euo pipefail

# Debian packages the build and the tests need, each with a command or file that shows it
# is there, so a warm machine skips apt entirely.
need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in meson ninja-build g++ pkg-config cmake doctest-dev doxygen python3 chromium libopenblas0-pthread openmpi-bin libopenmpi-dev; do
  have_pkg "$pkg" || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "install-deps.sh: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# The CUDA backend builds where NVIDIA's toolkit, cuDNN and NCCL are installed (they
# are on this project's machines); its cuDNN frontend headers come from NVIDIA's official
# package on PyPI, installed once into a fixed folder that meson.build looks in.
fe=/usr/local/lib/cudnn-frontend
if command -v nvcc >/dev/null 2>&1 && [ ! -f "$fe/include/cudnn_frontend.h" ]; then
  echo "install-deps.sh: installing NVIDIA's cuDNN frontend headers into $fe"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo python3 -m pip install -q --no-deps --target "$fe" nvidia-cudnn-frontend==1.32.0 ||
    $sudo python3 -m pip install -q --no-deps --break-system-packages --target "$fe" nvidia-cudnn-frontend==1.32.0
fi

# The code's layout is .clang-format's, checked by a test (tests/docs/check_format.py) with one
# pinned clang-format (formatting changes between releases; Debian 12's is 14, which cannot lay
# out C++20 requires-clauses). LLVM's own build of it is on PyPI; installed once into a fixed
# folder that the test looks in.
cf=/usr/local/lib/clang-format-19
if [ ! -x "$cf/clang_format/data/bin/clang-format" ]; then
  echo "install-deps.sh: installing clang-format 19.1.7 into $cf"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo python3 -m pip install -q --no-deps --target "$cf" clang-format==19.1.7 ||
    $sudo python3 -m pip install -q --no-deps --break-system-packages --target "$cf" clang-format==19.1.7
fi
