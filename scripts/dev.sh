#!/usr/bin/env bash
# The README's two commands.
#   bash scripts/dev.sh main   install what is missing, build the main job only (build-main/), train a small GPT with
#                              PO-F, draw the paper's schedules
#   bash scripts/dev.sh test   install what is missing, build everything (build/), run every test
#                              but the long suite; `test full` runs that too (CI does)
# Both work on a fresh Debian 12 machine (as root, or with sudo) and on a warm one, where
# they install nothing and only rebuild what changed. Installing is scripts/install-deps.sh;
# this script builds and runs.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

case "${1:-}" in
  main)
    # Only what the main job needs, in a build of its own without the CUDA backend, tests or
    # benchmarks (the test command builds those in build/): train a small GPT with PO-F on 4
    # thread ranks (CPU backend), then plan and draw the paper's schedules for a 5.8B model.
    main=build-main
    if [ ! -f "$main/build.ninja" ]; then
      meson setup "$main" --buildtype=debugoptimized -Dcuda=disabled -Dtests=false -Dbench=false -Dtools=false >/dev/null
    fi
    ninja -C "$main" samples/train_gpt samples/plan_schedules
    "$main/samples/train_gpt" --schedule po-f --ranks 4 --chunks 2 --microbatches 8 --steps 200
    echo
    "$main/samples/plan_schedules" --out-dir "$main/schedules"
    ;;
  test)
    build=build
    if [ ! -f "$build/build.ninja" ]; then
      meson setup "$build" --buildtype=debugoptimized
    fi
    ninja -C "$build"
    status=0
    setup=lean
    if [ "${2:-}" = full ]; then setup=full; fi
    meson test -C "$build" --setup "$setup" --print-errorlogs --num-processes "$(nproc)" || status=$?
    logs=("$build/meson-logs/testlog-$setup.json")  # meson names a run's log after its test setup
    # The runtime tests, the thread communicators and the schedule's threaded passes again under ThreadSanitizer and
    # under AddressSanitizer+UBSan (only their test binaries, the samples and train_gpt are
    # built there, without the CUDA backend, to keep this short). These builds are unity builds:
    # a test binary's sources compile four to a file, so the templates they share are instrumented
    # once per group, not once per file (GCC's UBSan makes that the longest part of the whole command); the
    # main build above compiles every file on its own, which is what checks each file's includes.
    # They compile at -O1 with line tables only (-g1: a report's stack still names file and
    # line), 2.6 times faster than -O2 -g under ASan/UBSan (bench/RESULTS.md).
    for san in thread address,undefined; do
      dir="build-${san%%,*}"
      flags=(-Dunity=on -Doptimization=1 -Dcpp_args=-g1)
      if [ ! -f "$dir/build.ninja" ]; then
        meson setup "$dir" --buildtype=debugoptimized -Dbench=false -Dcuda=disabled -Db_sanitize="$san" -Db_lundef=false \
          "${flags[@]}" >/dev/null
      else
        meson configure "$dir" "${flags[@]}"
      fi
      ninja -C "$dir" tests/runtime/test_runtime tests/runtime/test_custom tests/test_schedule_threads tests/comm/test_comm_threads \
        tests/comm/test_comm_shared_device tests/mpi/test_handshake samples/train_gpt samples/custom_model
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 TSAN_OPTIONS=halt_on_error=1 \
        meson test -C "$dir" --setup lean --suite runtime --suite threads --suite comm --no-rebuild --print-errorlogs \
        --num-processes "$(nproc)" || status=$?
      logs+=("$dir/meson-logs/testlog-lean.json")
    done
    # One closing line any CI reads: "N passed, N failed, N skipped".
    python3 - "${logs[@]}" <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "EXPECTEDFAIL": 0, "UNEXPECTEDPASS": 0, "TIMEOUT": 0, "ERROR": 0}
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
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
    echo "usage: bash scripts/dev.sh main|test [full]" >&2
    exit 2
    ;;
esac
