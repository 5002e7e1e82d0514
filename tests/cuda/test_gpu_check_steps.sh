#!/usr/bin/env bash
# scripts/gpu-check.sh's step runner, without a GPU: a stand-in nvidia-smi and stand-in binaries
# in a --no-build directory. Checks that --budget cuts a step to what is left and reports the
# rest as not run, that --only runs the named steps alone, that the report is rewritten after
# every step (a run cut short keeps what it did), that --log-dir holds the logs and the report,
# that every step the kit runs is one --only accepts, in the kit's order, that --unpack takes
# binaries packed elsewhere with their libraries, and that --no-build finds cuDNN where a GPU
# image has it only as a Python package.
#
# usage: test_gpu_check_steps.sh SOURCE_ROOT WORK_DIR
set -uo pipefail
src=$1 work=$2
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
kit="$src/scripts/gpu-check.sh"
rm -rf "$work" && mkdir -p "$work/bin" "$work/build" "$work/logs" || fail "cannot create $work"

# A GPU as nvidia-smi lists one, and a compute-sanitizer that is not the toolkit's.
cat >"$work/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$1" in
  -L) echo "GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *) echo "0, Stand-in GPU, 1024 MiB, 0.0" ;;
esac
EOF
printf '#!/usr/bin/env bash\nexit 0\n' >"$work/bin/compute-sanitizer"
# The binaries the kit runs: quick passes, and a benchmark that would run for a minute and,
# when it starts, keeps a copy of the report as it is then.
stand_in() {  # stand_in PATH BODY
  mkdir -p "$(dirname "$work/build/$1")"
  printf '#!/usr/bin/env bash\n%s\n' "$2" >"$work/build/$1"
  chmod +x "$work/build/$1"
}
stand_in tests/cuda/test_cuda_host 'exit 0'
stand_in tests/cuda/test_cuda_gpu 'echo "[doctest] test cases: 3 | 3 passed | 0 failed"; exit 0'
stand_in bench/cuda/gpt_block_gpu "cp '$work/logs/report.md' '$work/seen.md'; exec sleep 60"
stand_in bench/cuda/train_step 'exit 0'
stand_in samples/train_gpt 'exit 0'
stand_in pipeoffload-plan 'exit 0'
chmod +x "$work/bin/"*
export PATH="$work/bin:$PATH"

# 1. --budget 22 over four steps: two quick passes, the benchmark cut at what is left (about
# 22 s), the last not run.
t0=$(date +%s)
out=$(bash "$kit" --no-build --build-dir "$work/build" --log-dir "$work/logs" --budget 22 \
  --only "cuda-host gpu-tests gpt-block-bench train-step-bench" 2>&1)
rc=$? took=$(($(date +%s) - t0))
[ $rc -eq 1 ] || fail "a step timed out, so the kit must exit 1; got $rc: $out"
[ "$took" -le 40 ] || fail "--budget 22 took $took s"
report="$work/logs/report.md"
[ -f "$report" ] || fail "no report in --log-dir: $(ls "$work/logs")"
rows=$(grep '^| [a-z]' "$report" | grep -v '^| step ')
grep -q '^| cuda-host | pass |' <<<"$rows" || fail "cuda-host did not pass: $rows"
grep -q '^| gpu-tests | pass |' <<<"$rows" || fail "gpu-tests did not pass: $rows"
grep -Eq '^\| gpt-block-bench \| FAIL \(timed out after (2[0-2]|1[0-9]) s\) \|' <<<"$rows" ||
  fail "the benchmark was not cut to the budget left: $rows"
grep -q '^| train-step-bench | not run (--budget 22 s spent) |' <<<"$rows" || fail "the last step ran: $rows"
[ "$(wc -l <<<"$rows")" -eq 4 ] || fail "--only ran other steps: $rows"
grep -q 'test cases: 3 | 3 passed' "$report" || fail "the report lacks gpu-tests' figures"
grep -q -- '--budget 22 s); --only cuda-host' "$report" || fail "the report does not say the budget and --only"
for f in cuda-host gpu-tests gpt-block-bench; do [ -f "$work/logs/$f.log" ] || fail "no $f.log in --log-dir"; done
# The report as the benchmark found it when it started: the two steps before it already there.
grep -q '^| gpu-tests | pass |' "$work/seen.md" 2>/dev/null || fail "the report was not written before the third step"
grep -q '^| gpt-block-bench |' "$work/seen.md" && fail "the report had a step that had not run"

# 2. Every step the kit runs, in its order, is one --only accepts: with a budget too small for
# any, each is reported as not run, in order.
bash "$kit" --no-build --build-dir "$work/build" --log-dir "$work/logs" --budget 1 >/dev/null 2>&1
ran=$(grep '^| [a-z]' "$work/logs/report.md" | grep -v '^| step ' | grep 'not run' | cut -d' ' -f2 | tr '\n' ' ')
steps=$(grep -oE '^ *step [a-z-]+' "$kit" | awk '{ print $2 }' | tr '\n' ' ')
[ "$ran" = "$steps" ] || fail "the report's steps ($ran) are not the kit's ($steps)"
listed=$(bash "$kit" --only nope 2>&1 | sed 's/.*(the steps: \(.*\))$/\1/')
[ "$listed " = "$steps" ] || fail "--only's list ($listed) is not the kit's steps ($steps)"

# 3. --unpack: binaries and libraries packed elsewhere (--build-only --pack's layout) unpacked
# into an empty --build-dir, the steps run from there with the carried libraries on the path.
mkdir -p "$work/packed/carried-lib/cxx" "$work/packed/tests/cuda"
cp -r "$work/build/." "$work/packed/"
rm -rf "$work/packed/gpu-deps"
printf '#!/usr/bin/env bash\necho "$LD_LIBRARY_PATH" >"%s"\n' "$work/seen-path" >"$work/packed/tests/cuda/test_cuda_host"
chmod +x "$work/packed/tests/cuda/test_cuda_host"
tar czf "$work/carry.tar.gz" -C "$work/packed" . || fail "cannot pack the stand-ins"
out=$(bash "$kit" --no-build --unpack "$work/carry.tar.gz" --build-dir "$work/fresh" --log-dir "$work/logs" \
  --only cuda-host 2>&1) || fail "--unpack: the check failed: $out"
[ -x "$work/fresh/samples/train_gpt" ] || fail "--unpack did not unpack the binaries into --build-dir"
grep -Eq "^$work/fresh/carried-lib(:|\$)" "$work/seen-path" 2>/dev/null ||
  fail "the step did not see carried-lib first on LD_LIBRARY_PATH: $(cat "$work/seen-path" 2>/dev/null)"
grep -q "carried-lib/cxx" "$work/seen-path" && fail "libstdc++ was put first although the node's is not older"
tar czf "$work/bare.tar.gz" -C "$work/packed" tests || fail "cannot pack the stand-ins"
for bad in "--no-build --unpack $work/bare.tar.gz:holds no carried-lib/" "--unpack $work/carry.tar.gz:--unpack applies only to --no-build" \
  "--no-build --unpack $work/none.tar.gz:--unpack: no file" "--pack $work/x.tar.gz:--pack applies only to --build-only"; do
  # shellcheck disable=SC2086
  out=$(bash "$kit" ${bad%%:*} --build-dir "$work/fresh2" 2>&1)
  rc=$?
  [ $rc -eq 2 ] && grep -q -- "${bad#*:}" <<<"$out" || fail "'${bad%%:*}' should be refused with '${bad#*:}' (exit 2); got $rc: $out"
done

# 4. --no-build on a node whose loader cannot find cuDNN but whose Python has it as a package
# (nvidia-cudnn-cu13, as GPU images ship it): its lib/ goes on the loader's path; with neither,
# a sentence. A train_gpt stand-in that needs libcudnn.so.99 (a soname no real cuDNN has), from
# a stub library.
mkdir -p "$work/site/nvidia/cudnn/lib" "$work/nb"
printf 'int cudnn_stub(void) { return 0; }\n' >"$work/stub.c"
printf 'int cudnn_stub(void);\nint main(void) { return cudnn_stub(); }\n' >"$work/main.c"
cc -shared -fPIC -Wl,-soname,libcudnn.so.99 -o "$work/site/nvidia/cudnn/lib/libcudnn.so.99" "$work/stub.c" &&
  cc -o "$work/main" "$work/main.c" "$work/site/nvidia/cudnn/lib/libcudnn.so.99" || fail "cannot build the cuDNN stand-ins"
cp -r "$work/packed/." "$work/nb/" && rm -rf "$work/nb/carried-lib" && cp "$work/main" "$work/nb/samples/train_gpt"
grep -q "libcudnn.so.99 => not found" <<<"$(ldd "$work/nb/samples/train_gpt")" || fail "the stand-in finds libcudnn without help"
rm -f "$work/seen-path"
out=$(PYTHONPATH="$work/site" bash "$kit" --no-build --build-dir "$work/nb" --log-dir "$work/logs" --only cuda-host 2>&1) ||
  fail "--no-build with cuDNN as a Python package: $out"
grep -q "$work/site/nvidia/cudnn/lib" "$work/seen-path" 2>/dev/null ||
  fail "the package's lib/ is not on the loader's path: $(cat "$work/seen-path" 2>/dev/null)"
out=$(bash "$kit" --no-build --build-dir "$work/nb" --log-dir "$work/logs" --only cuda-host 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "libcudnn not found (not on the loader's path, nor as Python's nvidia-cudnn package)" <<<"$out" ||
  fail "no cuDNN anywhere should be refused with a sentence (exit 2); got $rc: $out"

rm -rf "$work"
echo "ok: --budget cuts and skips, --only, the report after every step, --log-dir, the step list, --unpack, cuDNN from Python's package"
