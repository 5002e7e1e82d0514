#!/usr/bin/env python3
"""Contract test of `pipeoffload-plan --auto`: JSON keys, exit codes 0/2/3, bad input, monotone choice.

Usage: test_plan_auto.py PATH/TO/pipeoffload-plan    (Python 3 standard library only)
Every check runs; the failures are listed at the end and the exit status is 1 if any failed.
"""
import json
import subprocess
import sys

TOOL = sys.argv[1] if len(sys.argv) > 1 else "build/pipeoffload-plan"
failures = []

# A small GPT (14 layers, h = 1024) on 8 ranks: plans in milliseconds.
SMALL = {"--layers": "14", "--hidden": "1024", "--heads": "16", "--query-groups": "16", "--seq": "2048",
         "--micro-batch": "1", "--global-batch": "16", "--vocab": "32000", "--ranks": "8",
         "--device-mem-gib": "8", "--host-mem-gib": "64", "--tflops": "220", "--pcie-gbps": "15"}
KEYS = {"schedule": str, "group": int, "chunks": int, "offload_chunks": int, "k": (int, float),
        "activation_bytes_per_layer": (int, float), "peak_device_bytes": list, "host_bytes": list,
        "bubble_fraction": (int, float), "iteration_time_s": (int, float), "fits": bool}
NAMES = {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f"}


def check(cond, what):
    if not cond:
        failures.append(what)
    return cond


def run(*args):
    p = subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def args_of(opts, *extra):
    out = ["--auto"]
    for k, v in opts.items():
        out += [k, v]
    return out + list(extra)


def plan(opts, *extra, want_rc=0):
    rc, out, err = run(*args_of(opts, "--format", "json", *extra))
    check(rc == want_rc, f"{opts} {extra}: exit {rc}, want {want_rc}; stderr {err!r}")
    try:
        return json.loads(out), err
    except ValueError as e:
        check(False, f"--auto json does not parse ({e}): {out[:200]!r}")
        return {}, err


def main():
    # ---- JSON: the contract keys, one array entry per rank, a runnable choice -------------------
    doc, err = plan(SMALL)
    check(err == "", f"fitting plan wrote to stderr: {err!r}")
    for key, typ in KEYS.items():
        check(key in doc and isinstance(doc[key], typ), f"json key {key!r} missing or not {typ}: {doc.get(key)!r}")
    check(doc.get("fits") is True, "the small model does not fit in 8 GiB")
    check(doc.get("schedule") in NAMES, f"schedule {doc.get('schedule')!r} is not a plan tool name")
    for key in ("peak_device_bytes", "host_bytes", "activation_peak_bytes", "model_state_bytes", "workspace_bytes"):
        check(len(doc.get(key, [])) == 8, f"{key} has {len(doc.get(key, []))} entries, want 8 ranks")
    for r in range(8):
        total = doc["model_state_bytes"][r] + doc["activation_peak_bytes"][r] + doc["workspace_bytes"][r]
        check(abs(doc["peak_device_bytes"][r] - total) <= 1e-6 * total,
              f"rank {r}: peak_device_bytes is not state + activations + workspace")
        check(doc["peak_device_bytes"][r] <= 8 * 2**30, f"rank {r}: the choice does not fit")
    check(sum(doc["layers_per_stage"]) == 14 and len(doc["layers_per_stage"]) == 8 * doc["chunks"],
          f"layers_per_stage {doc['layers_per_stage']} does not cover 14 layers on {8 * doc['chunks']} stages")
    check(0 <= doc["bubble_fraction"] < 1 and doc["iteration_time_s"] > 0, "bubble or iteration time out of range")
    # The choice runs as is with the plan tool (schedule, --group, --chunks, --offload-chunks).
    cmd = doc.get("command", "").split()
    check(cmd[:1] == ["pipeoffload-plan"], f"command {cmd}")
    rc, out, err = run(*cmd[1:], "--format", "json")
    check(rc == 0, f"the chosen command {' '.join(cmd)} fails: {err!r}")
    if rc == 0:
        drawn = json.loads(out)
        check(drawn["chunks"] == doc["chunks"] and drawn["offload_chunks"] == doc["offload_chunks"] and
              drawn["group"] == doc["group"], f"the plan tool draws {drawn['schedule']} v={drawn['chunks']}, "
              f"not the choice {doc['schedule']} v={doc['chunks']}")

    # ---- per-layer bytes: 34bsh / 20bsh with multi-head attention, less with GQA -----------------
    bsh = 1 * 2048 * 1024
    check(doc["activation_bytes_per_layer"] == 34 * bsh, f"MHA: {doc['activation_bytes_per_layer']} != 34bsh")
    rdoc, _ = plan(SMALL, "--recompute")
    check(rdoc.get("activation_bytes_per_layer") == 20 * bsh, "MHA with --recompute: not 20bsh")
    gqa, _ = plan({**SMALL, "--query-groups": "4"}, "--recompute")
    check(gqa.get("activation_bytes_per_layer") == 17 * bsh, f"GQA G/a = 1/4 with recompute: not 17bsh")
    check(abs(rdoc["k"] / (10 / (3 * (6 * 1024 + 2048)) * 220e12 / 15e9) - 1) < 1e-8, f"k {rdoc['k']} is not the paper's")

    # ---- text: the short table --------------------------------------------------------------------
    rc, out, err = run(*args_of(SMALL))
    check(rc == 0 and err == "", f"text: exit {rc} {err!r}")
    for word in ("choice", "why", "k ", "bubble", "iteration", "stages", "rank  device GiB"):
        check(word in out, f"text output lacks {word!r}")
    check(len([l for l in out.splitlines() if l[:4].strip().isdigit()]) == 8, "text: not one line per rank")

    # ---- monotone: more device memory never gives a slower plan ----------------------------------
    prev, fitted = None, False
    for gib in ("2.5", "3", "3.5", "4", "5", "6", "8", "12", "24", "64"):
        rc, out, err = run(*args_of({**SMALL, "--device-mem-gib": gib}, "--format", "json"))
        d = json.loads(out) if out else {}
        if rc == 3:
            check(not fitted, f"{gib} GiB: nothing fits, but less memory fitted")
            continue
        check(rc == 0, f"{gib} GiB: exit {rc} {err!r}")
        fitted = True
        if prev is not None:
            check(d["iteration_time_s"] <= prev, f"{gib} GiB: slower ({d['iteration_time_s']}) than with less ({prev})")
        prev = d["iteration_time_s"]
    check(fitted, "no device memory in the sweep fits")

    # ---- nothing fits: exit 3, the closest plan with fits false, the shortfall on one line --------
    doc3, err = plan({**SMALL, "--device-mem-gib": "1.2"}, want_rc=3)
    check(doc3.get("fits") is False and doc3.get("shortfall_bytes", 0) > 0, f"nothing fits: {doc3.get('fits')}")
    check(len(err.splitlines()) == 1 and "nothing fits" in err and "GiB more device memory" in err,
          f"nothing fits: stderr {err!r}")
    worst = max(doc3.get("peak_device_bytes", [0]))
    check(abs(worst - 1.2 * 2**30 - doc3.get("shortfall_bytes", 0)) < 1e-3 * worst,
          "nothing fits: shortfall_bytes is not the worst rank's excess")
    rc, out, err = run(*args_of({**SMALL, "--device-mem-gib": "1.2"}))
    check(rc == 3 and "NOTHING FITS" in out, f"nothing fits, text: exit {rc}")
    # Host memory too small for any offload still plans (without offload).
    doc4, _ = plan({**SMALL, "--host-mem-gib": "0", "--device-mem-gib": "64"})
    check(doc4.get("offload_chunks") == 0 and max(doc4.get("host_bytes", [1])) == 0, "host 0 GiB: chose an offload")

    # ---- bad input: exit 2, one line on stderr naming the flag ------------------------------------
    bad = []
    for flag in ("--layers", "--hidden", "--heads", "--query-groups", "--seq", "--micro-batch", "--global-batch",
                 "--vocab", "--ranks", "--device-mem-gib", "--tflops", "--pcie-gbps"):
        for value in ("0", "-4", "abc", "", "1e999", "nan"):
            bad.append(({**SMALL, flag: value}, [], flag))
        drop = dict(SMALL)
        del drop[flag]
        bad.append((drop, [], flag))
    bad += [
        ({**SMALL, "--host-mem-gib": "-1"}, [], "--host-mem-gib"),
        ({**SMALL, "--host-mem-gib": "x"}, [], "--host-mem-gib"),
        ({**SMALL, "--query-groups": "3"}, [], "--query-groups"),
        ({**SMALL, "--query-groups": "32"}, [], "--query-groups"),
        ({**SMALL, "--hidden": "1000"}, [], "--hidden"),
        ({**SMALL, "--global-batch": "15", "--micro-batch": "2"}, [], "--global-batch"),
        ({**SMALL, "--ranks": "17"}, [], "ranks"),
        ({**SMALL, "--pcie-switch": "maybe"}, [], "--pcie-switch"),
        (SMALL, ["--recompute=1"], "--recompute"),
        (SMALL, ["--schedule", "gis"], "--schedule"),
        (SMALL, ["--chunks", "2"], "--chunks"),
        (SMALL, ["--k", "0.5"], "--k"),
        (SMALL, ["--format", "svg"], "--format"),
        (SMALL, ["--auto"], "--auto"),
    ]
    for opts, extra, flag in bad:
        rc, out, err = run(*args_of(opts, *extra))
        check(rc == 2 and len(err.splitlines()) == 1 and flag in err and out == "",
              f"bad input {flag} ({[opts.get(flag)] + extra}): exit {rc}, stderr {err!r}")
    # k with no bandwidth: the line says why a bandwidth is needed.
    rc, out, err = run(*args_of({**SMALL, "--pcie-gbps": "0"}))
    check(rc == 2 and "k" in err and "bandwidth" in err, f"--pcie-gbps 0: {rc} {err!r}")
    # Auto-only flags are refused without --auto.
    rc, out, err = run("--schedule", "gis", "--ranks", "4", "--chunks", "2", "--microbatches", "8", "--layers", "8")
    check(rc == 2 and "--layers" in err and "--auto" in err, f"--layers without --auto: {rc} {err!r}")
    # A search too big to finish in seconds is refused, not left running.
    rc, out, err = run(*args_of({**SMALL, "--layers": "4000", "--ranks": "512", "--global-batch": "2048"}))
    check(rc == 2 and len(err.splitlines()) == 1 and "more than" in err, f"huge search: {rc} {err!r}")

    if failures:
        print(f"{len(failures)} check(s) failed:")
        for f in failures:
            print("  -", f)
        return 1
    print("all --auto checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
