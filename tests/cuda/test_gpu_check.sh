#!/usr/bin/env bash
# scripts/gpu-check.sh's contract on a machine without a GPU: one line and exit 77; bad
# arguments exit 2; and the offline bundle round trip: a bundle gathered with --bundle (PyPI and
# Debian's archive), then, with the network unreachable (a new network namespace), the CUDA
# targets built from it alone (the bundle's cuDNN frontend headers, doctest, Meson and Ninja)
# and run against its OpenBLAS.
#
# usage: test_gpu_check.sh SOURCE_ROOT WORK_DIR
set -uo pipefail
src=$1 work=$2
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
kit="$src/scripts/gpu-check.sh"
rm -rf "$work" && mkdir -p "$work" || fail "cannot create $work"

# 1. No GPU: one line, exit 77 (on a machine with a GPU this part does not apply).
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
  out=$(bash "$kit" 2>&1)
  rc=$?
  [ $rc -eq 77 ] || fail "without a GPU the check must exit 77, got $rc: $out"
  [ "$out" = "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check" ] || fail "unexpected output: $out"
fi

# 2. Bad arguments: exit 2 with a sentence.
out=$(bash "$kit" --bundle "$work/a" --from "$work/b" 2>&1)
[ $? -eq 2 ] && [[ $out == *"--bundle and --from exclude each other"* ]] || fail "--bundle with --from: $out"
out=$(bash "$kit" --no-build --build-only 2>&1)
[ $? -eq 2 ] && [[ $out == *"--no-build and --build-only exclude each other"* ]] || fail "--no-build with --build-only: $out"
out=$(bash "$kit" --step-limit 0 2>&1)
[ $? -eq 2 ] && [[ $out == *"--step-limit takes whole seconds >= 1, got '0'"* ]] || fail "--step-limit 0: $out"
out=$(bash "$kit" --frobnicate 2>&1)
[ $? -eq 2 ] && [[ $out == *"unknown option '--frobnicate'"* ]] || fail "unknown option: $out"

# 3. The bundle (one retry: the registries are remote).
bash "$kit" --bundle "$work/bundle" >"$work/bundle.log" 2>&1 || bash "$kit" --bundle "$work/bundle" >"$work/bundle.log" 2>&1 ||
  fail "--bundle failed: $(tail -n 5 "$work/bundle.log")"
for f in nvidia_cudnn_frontend- meson- ninja- doctest-dev_ libopenblas0-pthread_; do
  ls "$work/bundle"/*/"$f"* >/dev/null 2>&1 || fail "the bundle lacks $f*"
done

# 4. A corrupt copy is refused before anything is built.
cp -r "$work/bundle" "$work/corrupt" && echo x >>"$work/corrupt"/debs/doctest-dev_*.deb
out=$(unshare -n bash "$kit" --from "$work/corrupt" --build-only --build-dir "$work/never" 2>&1)
[ $? -eq 2 ] && [[ $out == *"does not match MANIFEST.sha256"* ]] || fail "a corrupt bundle: $out"

# 5. Offline: build from the bundle alone, then run what was built against its OpenBLAS.
build="$work/build"
targets="src/libpipeoffload_cuda_kernels.a src/libpipeoffload_cuda_attention.a tests/cuda/test_cuda_host samples/train_gpt"
unshare -n bash "$kit" --from "$work/bundle" --bundled-tools --build-only --build-dir "$build" --targets "$targets" >"$work/build.log" 2>&1 ||
  fail "the offline build failed: $(tail -n 20 "$work/build.log")"
grep -q "gpu-deps/cudnn-frontend" "$build/compile_commands.json" || fail "the build did not use the bundle's cuDNN frontend headers"
grep -q "gpu-deps/root/usr/include" "$build/compile_commands.json" || fail "the build did not use the bundle's doctest"
grep -q "gpu-deps/py/bin/meson" "$build/build.ninja" || fail "the build was not configured by the bundle's Meson"
blas=$(dirname "$(find "$build/gpu-deps/root" -name libopenblas.so.0 | head -n 1)")
out=$(unshare -n env LD_LIBRARY_PATH="$blas" LD_DEBUG=libs "$build/samples/train_gpt" --ranks 1 --chunks 1 --layers 1 --hidden 16 --seq 8 \
  --batch 1 --microbatches 1 --steps 1 --quiet 2>&1) || fail "train_gpt from the offline build failed: $(echo "$out" | grep -v '^ *[0-9]*:' | tail -n 5)"
echo "$out" | grep -q "calling init: $build/gpu-deps/root/.*libopenblas.so.0" || fail "train_gpt did not load the bundle's OpenBLAS"
echo "$out" | grep -q "^final_loss=" || fail "train_gpt printed no final_loss"
unshare -n "$build/tests/cuda/test_cuda_host" >"$work/host.log" 2>&1 || fail "test_cuda_host from the offline build failed: $(tail -n 20 "$work/host.log")"
rm -rf "$work"
echo "ok: no-GPU exit, bad arguments, corrupt bundle, offline build and run from the bundle"
