#!/usr/bin/env bash
# The README's two commands.
#   bash scripts/dev.sh main   install what is missing, build, plan and draw the paper's schedules
#   bash scripts/dev.sh test   install what is missing, build, run every test
# Both work on a fresh Debian 12 machine (as root, or with sudo) and on a warm one, where
# they install nothing and only rebuild what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build and the tests need, each with a command or file that shows it
# is there, so a warm machine skips apt entirely.
need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in meson ninja-build g++ pkg-config doctest-dev python3 chromium; do
  have_pkg "$pkg" || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "dev.sh: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

build=build
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=debugoptimized
fi
ninja -C "$build"

case "${1:-}" in
  main)
    "$build/samples/plan_schedules" --out-dir "$build/schedules"
    ;;
  test)
    status=0
    meson test -C "$build" --print-errorlogs --num-processes "$(nproc)" || status=$?
    # One closing line any CI reads: "N passed, N failed, N skipped".
    python3 - "$build/meson-logs/testlog.json" <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "EXPECTEDFAIL": 0, "UNEXPECTEDPASS": 0, "TIMEOUT": 0, "ERROR": 0}
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        if line.strip():
            r = json.loads(line)["result"]
            counts[r] = counts.get(r, 0) + 1
passed = counts["OK"] + counts["EXPECTEDFAIL"]
failed = counts["FAIL"] + counts["UNEXPECTEDPASS"] + counts["TIMEOUT"] + counts["ERROR"]
print(f"{passed} passed, {failed} failed, {counts['SKIP']} skipped")
PY
    exit "$status"
    ;;
  *)
    echo "usage: bash scripts/dev.sh main|test" >&2
    exit 2
    ;;
esac
