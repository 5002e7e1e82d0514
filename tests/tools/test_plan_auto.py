#!/usr/bin/env python3
"""Contract test of `pipeoffload-plan --auto`: JSON keys, exit codes 0/2/3, bad input, monotone choice.

Usage: test_plan_auto.py PATH/TO/pipeoffload-plan [PATH/TO/train_gpt]    (Python 3 standard library only)
Every check runs; the failures are listed at the end and the exit status is 1 if any failed.
"""
import json
import subprocess
import sys

TOOL = sys.argv[1] if len(sys.argv) > 1 else "build/pipeoffload-plan"
TRAIN_GPT = sys.argv[2] if len(sys.argv) > 2 else None
failures = []

# A small GPT (14 layers, h = 1024) on 8 ranks: plans in milliseconds.
SMALL = {"--layers": "14", "--hidden": "1024", "--heads": "16", "--query-groups": "16", "--seq": "2048",
         "--micro-batch": "1", "--global-batch": "16", "--vocab": "32000", "--ranks": "8",
         "--device-mem-gib": "8", "--host-mem-gib": "64", "--tflops": "220", "--pcie-gbps": "15"}
KEYS = {"schedule": str, "group": int, "chunks": int, "cut": str, "offload_chunks": int, "copy_streams": int,
        "k": (int, float),
        "activation_bytes_per_layer": (int, float), "peak_device_bytes": list, "host_bytes": list,
        "bubble_fraction": (int, float), "iteration_time_s": (int, float), "fits": bool}
NAMES = {"1f1b", "1f1b-i", "gis", "gis-h", "gis-g", "po", "po-h", "po-f", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"}


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
    check(want_rc is None or rc == want_rc, f"{opts} {extra}: exit {rc}, want {want_rc}; stderr {err!r}")
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
    check(doc.get("cut") in ("slots", "even"), f"cut {doc.get('cut')!r} is not slots or even")
    # Memory by kind, per rank: the kinds add up to the rank's peak; the buffers' region holds
    # the simulated activations (and the boundary tensors beside them).
    kinds = ("state_bytes", "optimizer_bytes", "buffer_bytes", "scratch_bytes", "workspace_bytes", "reserve_bytes")
    per = doc.get("per_rank", [])
    check(len(per) == 8, f"per_rank has {len(per)} entries, want 8")
    for i, k in enumerate(per):
        check(all(isinstance(k.get(x), (int, float))
                  for x in (*kinds, "device_bytes", "host_bytes", "stash_bytes", "activation_bytes", "message_bytes")),
              f"per_rank[{i}] lacks a kind: {k}")
        check(k["activation_bytes"] <= k["buffer_bytes"] <= 1.05 * (k["activation_bytes"] + k["message_bytes"]),
              f"per_rank[{i}]: the buffers' region does not hold the activations and tensors: {k}")
        check(abs(k["device_bytes"] - sum(k[x] for x in kinds)) <= 1e-6 * k["device_bytes"],
              f"per_rank[{i}]: device_bytes is not the sum of its kinds: {k}")
        check(k["device_bytes"] == doc["peak_device_bytes"][i] and k["host_bytes"] == doc["host_bytes"][i],
              f"per_rank[{i}] disagrees with peak_device_bytes / host_bytes")
    check(doc.get("schedule") in NAMES, f"schedule {doc.get('schedule')!r} is not a plan tool name")
    for key in ("peak_device_bytes", "host_bytes", "activation_peak_bytes", "stash_peak_bytes", "model_state_bytes",
                "workspace_bytes"):
        check(len(doc.get(key, [])) == 8, f"{key} has {len(doc.get(key, []))} entries, want 8 ranks")
    for r in range(8):
        least = doc["model_state_bytes"][r] + doc["activation_peak_bytes"][r]
        check(doc["peak_device_bytes"][r] >= least, f"rank {r}: peak_device_bytes is below state + activations")
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
    # Host memory too small for any offload still plans (without offload): each rank holds
    # backend::Cuda's pinned staging only (staging_bytes); less than that, nothing fits.
    doc4, _ = plan({**SMALL, "--host-mem-gib": "0.01", "--device-mem-gib": "64"})
    staging = [r.get("staging_bytes") for r in doc4.get("per_rank", [])]
    check(doc4.get("offload_chunks") == 0 and staging and staging[0] > 0 and doc4.get("host_bytes") == staging,
          f"host 0.01 GiB: offload {doc4.get('offload_chunks')}, host {doc4.get('host_bytes')}, staging {staging}")
    rc, out, err = run(*args_of({**SMALL, "--host-mem-gib": "0", "--device-mem-gib": "64"}))
    check(rc == 3 and "more host memory" in err, f"host 0 GiB: exit {rc}, {err!r}")
    doc5, _ = plan({**TINY, "--device-mem-gib": "64", "--host-mem-gib": "0"}, "--backend", "cpu")
    check(doc5.get("fits") is True and doc5.get("per_rank", [{}])[0].get("staging_bytes") == 0,
          f"--backend cpu pins no staging: {doc5.get('per_rank')}")

    # ---- --gradients exact: 16 more bytes of model state per parameter (the 128-bit sums) --------
    std, _ = plan(SMALL)
    ex, _ = plan(SMALL, "--gradients", "exact")
    for r, (a, b) in enumerate(zip(std.get("model_state_bytes", []), ex.get("model_state_bytes", []))):
        check(abs(b - a * 34 / 18) < 1e-6 * a + 16 * 2**20 * 4,
              f"--gradients exact rank {r}: model state {b}, want 34/18 of {a} (plus bucket padding)")
    stash = std.get("stash_peak_bytes", [])
    check(len(stash) == len(std.get("peak_device_bytes", [])) and all(x > 0 for x in stash),
          f"stash_peak_bytes {stash}: one positive entry per rank")

    # ---- Llama-class layers: --swiglu with its own --ffn-hidden holds more per rank ----------------
    h = int(SMALL["--hidden"])
    llama, _ = plan(SMALL, "--swiglu", "--ffn-hidden", str(h * 7 // 2))
    a, b = sum(std.get("model_state_bytes", [])), sum(llama.get("model_state_bytes", []))
    check(b > 1.1 * a, f"--swiglu --ffn-hidden {h * 7 // 2}: model state {b} over all ranks, not above GPT's {a}")

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
        ({**SMALL, "--gradients": "fast"}, [], "--gradients"),
        ({**SMALL, "--ffn-hidden": "0"}, [], "--ffn-hidden"),
        ({**SMALL, "--ffn-hidden": "x"}, [], "--ffn-hidden"),
        (SMALL, ["--swiglu=1"], "--swiglu"),
        (SMALL, ["--recompute=1"], "--recompute"),
        (SMALL, ["--schedule", "gis-x"], "schedule"),
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

    verdicts()
    data_parallel()
    presets()
    copy_streams()
    runs_in_train_gpt()

    if failures:
        print(f"{len(failures)} check(s) failed:")
        for f in failures:
            print("  -", f)
        return 1
    print("all --auto checks passed")
    return 0


# ---- the verdict agrees with the plan's own bytes ------------------------------------------------------
TIGHT = {"--layers": "16", "--hidden": "1024", "--heads": "16", "--query-groups": "4", "--seq": "4096",
         "--micro-batch": "1", "--global-batch": "16", "--vocab": "32000", "--ranks": "4", "--host-mem-gib": "64",
         "--tflops": "100", "--pcie-gbps": "60"}


def verdicts():
    # Across the memory where plans start to fit (free choice, and pinned to po-h, whose closest
    # candidate's estimate was above what its lowered program reserves): "fits" exactly when
    # every rank's bytes are within the budget, and a plan that does not fit names a real rank
    # over it by the shortfall it states.
    for pinned in ([], ["--schedule", "po-h"]):
        for tenths in range(33, 42):
            gib = tenths / 10
            doc, _ = plan({**TIGHT, "--device-mem-gib": str(gib)}, *pinned, want_rc=None)
            ranks = doc.get("per_rank", [])
            cap, host = gib * 2**30, 64 * 2**30
            over = max([max(r["device_bytes"] - cap, r["host_bytes"] - host) for r in ranks] or [0])
            what = f"{pinned} at {gib} GiB: fits {doc.get('fits')}, largest excess {over:.0f} bytes, why {doc.get('why')!r}"
            check(bool(ranks) and doc.get("fits") == (over <= 0), what)
            check("rank -1" not in doc.get("why", ""), what)
            if doc.get("fits") is False:
                check(abs(doc.get("shortfall_bytes", 0) - over) <= 0.01 * 2**30, f"{what}: shortfall {doc.get('shortfall_bytes')}")


# ---- --model: the presets ---------------------------------------------------------------------------
MACHINE = {"--ranks": "8", "--device-mem-gib": "80", "--host-mem-gib": "256", "--tflops": "220", "--pcie-gbps": "15"}


def presets():
    # A preset plans as its shape given flag by flag (llama3-8b: plan/presets.hpp).
    llama = {"--layers": "32", "--hidden": "4096", "--heads": "32", "--query-groups": "8", "--seq": "8192",
             "--micro-batch": "1", "--global-batch": "512", "--vocab": "128256", "--ffn-hidden": "14336"}
    by_name, _ = plan({**MACHINE, "--model": "llama3-8b"})
    by_flags, _ = plan({**MACHINE, **llama}, "--swiglu")
    check(by_name == by_flags and by_name.get("schedule") in NAMES, "--model llama3-8b plans otherwise than its flags")
    # A flag beside --model overrides the preset's value.
    shorter, _ = plan({**MACHINE, "--model": "llama3-8b", "--seq": "4096"})
    same, _ = plan({**MACHINE, **llama, "--seq": "4096"}, "--swiglu")
    check(shorter == same, "--model llama3-8b --seq 4096 is not the flags with --seq 4096")
    # An unknown name lists the presets; --help lists every one of them.
    rc, out, err = run(*args_of({**MACHINE, "--model": "gpt-9"}))
    check(rc == 2 and out == "" and "--model must be one of" in err and "'gpt-9'" in err, f"--model gpt-9: {rc} {err!r}")
    names = err.split("one of ", 1)[-1].split(", got")[0].split(", ")
    rc, help_text, _ = run("--help")
    check(len(names) == 8 and all(n in help_text for n in names), f"--help does not list every preset: {names}")
    for name in names:
        doc, _ = plan({**MACHINE, "--ranks": "32", "--model": name}, "--recompute")
        check(doc.get("schedule") in NAMES, f"--model {name}: no plan")


# ---- train_gpt_args: the plan as train_gpt's command line -----------------------------------------
# A byte-level GPT train_gpt builds (vocabulary 256, multi-head attention, 4h GeLU MLP).
TINY = {"--layers": "6", "--hidden": "64", "--heads": "4", "--query-groups": "4", "--seq": "32", "--micro-batch": "2",
        "--global-batch": "16", "--vocab": "256", "--ranks": "2", "--device-mem-gib": "2", "--host-mem-gib": "1",
        "--tflops": "1", "--pcie-gbps": "1"}


def runs_in_train_gpt():
    plans = [(TINY, []), ({**TINY, "--ranks": "3", "--layers": "7"}, []), (TINY, ["--dp", "2", "--zero", "1"]),
             ({**TINY, "--ranks": "4", "--pcie-gbps": "100"}, ["--gradients", "exact"])]
    # The default counts the CUDA GPT: its command runs train_gpt --backend cuda.
    doc, _ = plan(TINY, "--recompute")
    check((doc.get("train_gpt_args") or [])[-2:] == ["--backend", "cuda"], f"train_gpt_args {doc.get('train_gpt_args')!r}")
    # train_gpt's CUDA GPT always recomputes: a plan without --recompute counts another model.
    doc, _ = plan(TINY)
    check(doc.get("train_gpt_args") is None and "plan with --recompute" in doc.get("train_gpt_args_why_not", ""),
          f"no --recompute: {doc.get('train_gpt_args_why_not')!r}")
    rc, _, err = run(*args_of(TINY, "--backend", "gpu"))
    check(rc == 2 and "--backend must be cuda or cpu" in err, f"--backend gpu: exit {rc}, {err!r}")
    rc, _, err = run(*args_of({**TINY, "--query-groups": "2"}, "--backend", "cpu"))
    check(rc == 2 and "backend cpu counts train_gpt's CPU models" in err,
          f"--backend cpu, a GPT with grouped-query attention: exit {rc}, {err!r}")
    # A Llama-class model (--swiglu): train_gpt --model llama, on CUDA (recomputing, as its CUDA
    # Llama does; tied embeddings too) and on the CPU.
    llama = {**TINY, "--query-groups": "2", "--ffn-hidden": "96"}
    for extra in (["--recompute"], ["--recompute", "--tied-embeddings"]):
        doc, _ = plan(llama, "--swiglu", *extra)
        args = doc.get("train_gpt_args") or []
        check(args[-2:] == ["--backend", "cuda"] and "--model" in args and args[args.index("--model") + 1] == "llama" and
              ("--tie-embeddings" in args) == ("--tied-embeddings" in extra),
              f"--swiglu {extra} on cuda: train_gpt_args {args!r}, why not {doc.get('train_gpt_args_why_not')!r}")
    doc, _ = plan(llama, "--swiglu")
    check(doc.get("train_gpt_args") is None and "CUDA Llama recomputes" in doc.get("train_gpt_args_why_not", ""),
          f"--swiglu on cuda without --recompute: {doc.get('train_gpt_args_why_not')!r}")
    plans.append((llama, ["--swiglu"]))
    # Two copy streams (one rank: no PCIe partner): the command carries them, and reserves what the plan says.
    plans.append(({**TINY, "--ranks": "1"}, ["--schedule", "po-f", "--copy-streams", "2", "--duplex-slowdown", "1.31"]))
    plans.append((llama, ["--swiglu", "--tied-embeddings", "--dp", "2", "--zero", "1"]))
    # Packed rows (--packed): the command packs (--pack 10, a document a line), and its ranks read
    # the document offsets the plan counts.
    plans.append((TINY, ["--packed", "--schedule", "zb-v"]))
    plans.append((llama, ["--swiglu", "--packed", "--dp", "2", "--zero", "1"]))
    # --backend cpu: each command runs, and each rank reserves what the plan says it holds.
    for opts, extra in plans:
        doc, _ = plan(opts, *extra, "--backend", "cpu")
        args = doc.get("train_gpt_args")
        if not check(isinstance(args, list) and args[:2] == ["--schedule", doc.get("schedule")],
                     f"{extra}: train_gpt_args {args!r}"):
            continue
        blocks = args[args.index("--stage-blocks") + 1].split(",")
        check([int(b) for b in blocks] == doc["layers_per_stage"], f"--stage-blocks {blocks} is not layers_per_stage")
        check(args[-2:] == ["--backend", "cpu"], f"{extra}: train_gpt_args end {args[-2:]!r}")
        if "--copy-streams" in extra:
            check(doc.get("copy_streams") == 2 and " ".join(args).find("--copy-streams 2 --duplex-slowdown 1.31 ") > 0,
                  f"{extra}: copy_streams {doc.get('copy_streams')!r}, train_gpt_args {args!r}")
        check(("--packed" in extra) == (" --pack 10 " in " ".join(args)), f"{extra}: train_gpt_args {args!r}")
        if "--swiglu" in extra:
            at = args.index("--model") if "--model" in args else 0
            check(args[at:at + 6] == ["--model", "llama", "--kv-heads", "2", "--ffn", "96"],
                  f"{extra}: train_gpt_args {args!r}")
        if TRAIN_GPT:
            p = subprocess.run([TRAIN_GPT, *args, "--steps", "1", "--quiet"], capture_output=True, text=True,
                               timeout=300)
            if not check(p.returncode == 0 and "final_loss=" in p.stdout,
                         f"train_gpt {' '.join(args)}: exit {p.returncode}, stderr {p.stderr[-300:]!r}"):
                continue
            line = [l for l in p.stdout.splitlines() if l.startswith("reserved_bytes_per_rank=")]
            reserved = [int(b) for b in line[0].split("=", 1)[1].split(",")] if line else []
            planned = [r["device_bytes"] for r in doc["per_rank"]]
            check(len(reserved) == len(planned) and
                  all(abs(p_ - r_) <= 0.02 * r_ for p_, r_ in zip(planned, reserved)),
                  f"{extra}: train_gpt reserved {reserved}, the plan says {planned}")
    # Every family pinned (--schedule NAME beside --auto), dp 1 and 2 with ZeRO-1: its command
    # runs in train_gpt and every rank reserves, to the byte, what the plan says it holds.
    four = {**TINY, "--ranks": "4", "--global-batch": "32"}  # every family has a candidate (GIS(g): g = 3)
    for name in sorted(NAMES):
        for dp in (["--dp", "1"], ["--dp", "2", "--zero", "1"]):
            extra = [*dp, "--schedule", name, "--backend", "cpu"]
            doc, _ = plan(four, *extra)
            check(doc.get("schedule") == name, f"{extra}: schedule {doc.get('schedule')!r}")
            args = doc.get("train_gpt_args")
            if not TRAIN_GPT or not check(isinstance(args, list), f"{extra}: train_gpt_args {args!r}"):
                continue
            p = subprocess.run([TRAIN_GPT, *args, "--steps", "1", "--quiet"], capture_output=True, text=True, timeout=300)
            if not check(p.returncode == 0, f"train_gpt {' '.join(args)}: exit {p.returncode}, {p.stderr[-300:]!r}"):
                continue
            line = [l for l in p.stdout.splitlines() if l.startswith("reserved_bytes_per_rank=")]
            reserved = [int(b) for b in line[0].split("=", 1)[1].split(",")] if line else []
            planned = [int(r["device_bytes"]) for r in doc["per_rank"]]
            check(reserved == planned, f"{extra}: train_gpt reserved {reserved}, the plan says {planned}")
    rc, _, err = run(*args_of(TINY, "--schedule", "nope"))
    check(rc == 2 and "budget: schedule must be empty or one of 1f1b," in err and "got 'nope'" in err,
          f"--schedule nope: exit {rc}, {err!r}")
    # Models train_gpt does not build: null, and why.
    for opts, extra, words in (({**TINY, "--query-groups": "2"}, [], "multi-head attention"),
                               (TINY, ["--tied-embeddings", "--recompute"], "CUDA GPT does not tie"),
                               ({**TINY, "--heads": "64", "--query-groups": "64"}, ["--swiglu", "--backend", "cpu"],
                                "h / heads must be even"),
                               ({**TINY, "--vocab": "512"}, [], "vocabulary 256")):
        doc, _ = plan(opts, *extra)
        check(doc.get("train_gpt_args", 0) is None and words in doc.get("train_gpt_args_why_not", ""),
              f"{extra}: train_gpt_args {doc.get('train_gpt_args')!r}, why not {doc.get('train_gpt_args_why_not')!r}")


# ---- --copy-streams 1|2|auto ----------------------------------------------------------------------
# 16 layers of h = 1024 at s = 4096 on 4 ranks without PCIe partners, 4.7 GiB: DualPipeV offloading on
# two streams beats the best that fits on one (tests/plan/test_plan.cpp sweeps the memory).
WIDE = {"--layers": "16", "--hidden": "1024", "--heads": "16", "--query-groups": "4", "--seq": "4096",
        "--micro-batch": "1", "--global-batch": "16", "--vocab": "32000", "--ranks": "4", "--device-mem-gib": "4.7",
        "--host-mem-gib": "64", "--tflops": "100", "--pcie-gbps": "30", "--pcie-switch": "none"}


def copy_streams():
    one, _ = plan(WIDE)
    auto, _ = plan(WIDE, "--copy-streams", "auto", "--duplex-slowdown", "1.31")
    check(one.get("copy_streams") == 1 and auto.get("copy_streams") == 2 and
          auto.get("iteration_time_s", 1) < one.get("iteration_time_s", 0),
          f"--copy-streams auto: {auto.get('schedule')} on {auto.get('copy_streams')} streams, "
          f"{auto.get('iteration_time_s')} s; one stream: {one.get('schedule')}, {one.get('iteration_time_s')} s")
    check(" --copy-streams 2 --duplex-slowdown 1.31 --pcie-switch none " in auto.get("command", ""),
          f"command {auto.get('command')!r}")
    rc, out, err = run(*args_of(WIDE, "--copy-streams", "auto", "--duplex-slowdown", "1.31"))
    choice = [ln for ln in out.splitlines() if ln.startswith("choice ")]
    check(rc == 0 and choice and choice[0].endswith(" on 2 copy streams"), f"text choice line {choice!r}")
    # PCIe partners (the default switch layout) on 4 ranks: auto keeps one stream, 2 is refused.
    paired = {k: v for k, v in WIDE.items() if k != "--pcie-switch"}
    doc, _ = plan(paired, "--copy-streams", "auto")
    check(doc.get("copy_streams") == 1, f"paired ranks, auto: copy_streams {doc.get('copy_streams')!r}")
    for extra, words in ((["--copy-streams", "2"], "--copy-streams 2 with --pcie-switch pairs"),
                         (["--copy-streams", "3"], "--copy-streams 3 is not one of 1, 2, auto"),
                         (["--duplex-slowdown", "1.3"], "--duplex-slowdown needs --copy-streams 2 or auto"),
                         (["--copy-streams", "auto", "--duplex-slowdown", "0.5"], "--duplex-slowdown")):
        rc, _, err = run(*args_of(paired, *extra))
        check(rc == 2 and len(err.splitlines()) == 1 and words in err, f"{extra}: exit {rc}, {err!r}")


# ---- data parallelism: --dp, --zero, --dp-gbps, --search-dp, node layouts ------------------------
GRID_KEYS = {"dp": int, "zero": int, "gpus": int, "allreduce_exposed_s": (int, float), "allreduce_s": list,
             "allreduce_end_s": list, "allreduce_hidden_fraction": list, "compute_time_s": (int, float),
             "optimizer_bytes": list, "host_bytes_per_node": dict, "host_bytes_per_node_max": dict,
             "node_layout": str, "gpus_per_node": int, "searched": bool}
# 14 layers, 4 ranks, 48 sequences: dp 1, 2, 3, 4, 6, ... split the batch.
DP = {**SMALL, "--ranks": "4", "--global-batch": "48"}


def data_parallel():
    # dp = 1 is today's plan: no grid keys without a data-parallel flag, the same plan with --dp 1.
    base, _ = plan(DP)
    check(not any(k in base for k in GRID_KEYS), "no data-parallel flag: the JSON has grid keys")
    one, _ = plan(DP, "--dp", "1")
    for key, typ in GRID_KEYS.items():
        check(key in one and isinstance(one[key], typ), f"--dp 1: json key {key!r} missing or not {typ}")
    check({k: v for k, v in one.items() if k in base} == base, "--dp 1: a key of the one-pipeline plan differs")
    check(one.get("dp") == 1 and one.get("zero") == 0 and one.get("allreduce_exposed_s") == 0, "--dp 1: dp, zero, exposed")
    rc, text1, _ = run(*args_of(DP, "--dp", "1"))
    rc0, text0, _ = run(*args_of(DP))
    check(rc == rc0 == 0 and "all-reduce" in text1 and "all-reduce" not in text0, "text: the grid lines only with --dp")

    # m per replica = global batch / (dp * micro-batch); the grid's size; the command draws one pipeline.
    for dp in (2, 3, 4, 6):
        doc, _ = plan(DP, "--dp", str(dp))
        check(doc.get("microbatches") == 48 // dp, f"--dp {dp}: microbatches {doc.get('microbatches')}, want {48 // dp}")
        check(doc.get("dp") == dp and doc.get("gpus") == 4 * dp and doc.get("global_batch") == 48, f"--dp {dp}: dp/gpus")
        check(f"--microbatches {48 // dp} " in doc.get("command", ""), f"--dp {dp}: command {doc.get('command')!r}")
        check(len(doc.get("allreduce_s", [])) == 4 and len(doc.get("allreduce_hidden_fraction", [])) == 4, "per-rank arrays")
        check(abs(doc["iteration_time_s"] - doc["compute_time_s"] - doc["allreduce_exposed_s"]) <= 1e-8 * doc["iteration_time_s"],
              f"--dp {dp}: iteration != compute + exposed")
        for r in range(4):
            total, end, hidden = doc["allreduce_s"][r], doc["allreduce_end_s"][r], doc["allreduce_hidden_fraction"][r]
            exposed = max(0.0, end - doc["compute_time_s"])
            check(total > 0 and abs(hidden - (1 - exposed / total)) < 1e-6, f"--dp {dp} rank {r}: hidden fraction")
    doc, _ = plan({**DP, "--micro-batch": "2"}, "--dp", "3")
    check(doc.get("microbatches") == 8, f"--micro-batch 2 --dp 3: {doc.get('microbatches')} microbatches, want 8")

    # ZeRO-1: the optimizer's state and fp32 master (12 bytes a value) per rank are 1/dp of
    # ZeRO-0's, plus less than one value per reduction bucket (2^20 values) of slice rounding
    # and the arena's rounding of each block.
    for dp in (2, 3, 6):
        z0, _ = plan(DP, "--dp", str(dp))
        z1, _ = plan(DP, "--dp", str(dp), "--zero", "1")
        for r in range(4):
            a, b = z0["optimizer_bytes"][r], z1["optimizer_bytes"][r]
            buckets = a / 12 / 2**20 + 16
            check(a / dp <= b < a / dp + 12 * buckets + 3 * 256 * 4,  # and each block's 256-byte size class
                  f"--dp {dp} --zero 1 rank {r}: optimizer {b} is not {a}/{dp}")
            check(abs((z0["model_state_bytes"][r] - a) - (z1["model_state_bytes"][r] - b)) < 1,
                  f"--dp {dp} --zero 1 rank {r}: the rest of the model state changed")
        check(z1.get("zero") == 1, "--zero 1 not reported")

    # All-reduce: hidden with a huge bandwidth, exposed and growing as it shrinks.
    prev = -1.0
    for gbps in ("1e9", "100", "10", "1", "0.1"):
        doc, _ = plan(DP, "--dp", "2", "--dp-gbps", gbps)
        if gbps == "1e9":
            check(doc["allreduce_exposed_s"] < 1e-9, f"--dp-gbps 1e9: exposed {doc['allreduce_exposed_s']}")
        check(doc["iteration_time_s"] >= prev, f"--dp-gbps {gbps}: faster than with more bandwidth")
        prev = doc["iteration_time_s"]
    check(doc["allreduce_exposed_s"] > 0, "--dp-gbps 0.1: nothing exposed")
    check(doc["allreduce_bytes_per_s"] == 1e8, f"--dp-gbps 0.1: {doc['allreduce_bytes_per_s']} B/s")
    # A bfloat16 reduce-scatter sends 2 of the 8 (dp-1)/dp bytes a parameter less: 6/8 of the time.
    for zero, share in (("0", 6 / 8), ("1", 4 / 6)):
        wide, _ = plan(DP, "--dp", "2", "--zero", zero)
        narrow, _ = plan(DP, "--dp", "2", "--zero", zero, "--reduce-dtype", "bf16")
        check(wide["schedule"] == narrow["schedule"] and wide["chunks"] == narrow["chunks"], "--reduce-dtype bf16: another plan")
        for r in range(4):
            a, b = wide["allreduce_s"][r], narrow["allreduce_s"][r]
            check(abs(b - share * a) <= 1e-6 * a, f"--reduce-dtype bf16 --zero {zero} rank {r}: {b} s, not {share} * {a}")

    # Host memory per node, both layouts: d = 16 on nodes of 8 (the paper's example).
    big = {**SMALL, "--layers": "30", "--hidden": "4096", "--heads": "32", "--query-groups": "8", "--seq": "4096",
           "--global-batch": "64", "--vocab": "51200", "--ranks": "16", "--device-mem-gib": "9"}
    doc, _ = plan(big, "--dp", "2", "--zero", "1", "--node-layout", "balanced", "--recompute")
    host = doc.get("host_bytes", [0] * 16)
    nodes = doc.get("host_bytes_per_node", {})
    check(sum(host) > 0, "d = 16 at 9 GiB: nothing offloaded (the case needs offload)")
    first, last = sum(host[:8]), sum(host[8:])
    outer, inner = sum(host[:4]) + sum(host[12:]), sum(host[4:12])
    check(nodes.get("contiguous") == [first, last, first, last], f"contiguous per node {nodes.get('contiguous')}")
    check(nodes.get("balanced") == [outer, inner, outer, inner], f"balanced per node {nodes.get('balanced')}")
    check(doc.get("host_bytes_per_node_max") == {"contiguous": max(first, last), "balanced": max(outer, inner)},
          f"host_bytes_per_node_max {doc.get('host_bytes_per_node_max')}")
    check(doc.get("node_layout") == "balanced", "node_layout")
    rc, out, _ = run(*args_of(big, "--dp", "2", "--zero", "1", "--recompute"))
    check(rc == 0 and "host/node  contiguous: max" in out and "balanced:   max" in out, "text: host per node, both layouts")
    doc, _ = plan({**DP, "--ranks": "6", "--global-batch": "48"}, "--dp", "2", "--gpus-per-node", "4")
    check(doc.get("host_bytes_per_node", {}).get("balanced", 0) is None, "d = 6, G = 4: balanced is not defined (null)")

    # --search-dp / --dp 0: a valid grid of --gpus, the fastest that fits, monotone in memory.
    search = {k: v for k, v in DP.items() if k != "--ranks"}
    search6 = {**search, "--device-mem-gib": "6"}
    doc, err = plan(search6, "--gpus", "16", "--search-dp")
    check(doc.get("searched") is True and doc.get("dp", 0) * doc.get("ranks", 0) == 16, f"search: dp x d != 16")
    check(48 % doc.get("dp", 1) == 0 and doc.get("microbatches") == 48 // doc.get("dp", 1), "search: dp does not split 48")
    grids = doc.get("grids", [])
    check([g["dp"] for g in grids] == [1, 2, 4, 8, 16], f"search: grids {[g['dp'] for g in grids]}")
    fit = [g["iteration_time_s"] for g in grids if g["fits"]]
    check(fit and doc["iteration_time_s"] == min(fit), "search: not the fastest grid that fits")
    check(doc.get("why", "").startswith(f"dp {doc.get('dp')} x d {doc.get('ranks')}"), f"search why {doc.get('why')!r}")
    same, _ = plan(search6, "--gpus", "16", "--dp", "0")
    check(same == doc, "--dp 0 and --search-dp differ")
    prev, fitted = None, False
    for gib in ("1", "1.5", "2", "2.5", "3", "4", "6", "10", "20"):
        rc, out, err = run(*args_of({**search, "--device-mem-gib": gib}, "--gpus", "16", "--search-dp", "--format", "json"))
        d = json.loads(out) if out else {}
        if rc == 3:
            check(not fitted, f"search {gib} GiB: nothing fits, but less memory fitted")
            continue
        check(rc == 0, f"search {gib} GiB: exit {rc} {err!r}")
        fitted = True
        if prev is not None:
            check(d["iteration_time_s"] <= prev, f"search {gib} GiB: slower ({d['iteration_time_s']}) than with less ({prev})")
        prev = d["iteration_time_s"]
    check(fitted, "search: no device memory in the sweep fits")
    rc, out, err = run(*args_of(search, "--gpus", "16", "--search-dp"))
    check(rc == 0 and "every dp that divides 16 GPUs" in out and "<- chosen" in out, "search: text lists the grids")

    # Bad input: exit 2, one line naming the flag and the value or the allowed range.
    bad = [
        (DP, ["--dp", "-1"], ["--dp", "'-1'", "[0, 65536]"]),
        (DP, ["--dp", "x"], ["--dp", "'x'"]),
        (DP, ["--dp", "5"], ["--dp 5", "48", "1, 2, 3, 4, 6, 8, 12, 16, 24, 48"]),
        (DP, ["--dp", "2", "--zero", "2"], ["--zero", "'2'", "[0, 1]"]),
        (DP, ["--zero", "-1"], ["--zero", "[0, 1]"]),
        (DP, ["--dp", "2", "--dp-gbps", "0"], ["--dp-gbps", "'0'"]),
        (DP, ["--dp", "2", "--reduce-dtype", "fp16"], ["--reduce-dtype", "'fp16'", "fp32 or bf16"]),
        (DP, ["--dp", "2", "--gradients", "exact", "--reduce-dtype", "bf16"], ["--reduce-dtype bf16", "--gradients standard"]),
        (DP, ["--dp", "2", "--dp-gbps", "nan"], ["--dp-gbps", "'nan'"]),
        (DP, ["--dp", "2", "--gpus", "9"], ["--gpus", "'9'", "8"]),
        (DP, ["--gpus-per-node", "0"], ["--gpus-per-node", "'0'"]),
        (DP, ["--node-layout", "striped"], ["--node-layout", "'striped'"]),
        ({**DP, "--ranks": "12", "--global-batch": "48"}, ["--node-layout", "balanced"], ["--node-layout", "--ranks 12"]),
        (search, ["--search-dp"], ["--gpus"]),
        (search, ["--dp", "0"], ["--gpus"]),
        (DP, ["--search-dp", "--gpus", "16"], ["--ranks", "--search-dp"]),
        (search, ["--search-dp", "--dp", "2", "--gpus", "16"], ["--search-dp", "--dp"]),
        (search, ["--search-dp", "--gpus", "0"], ["--gpus", "'0'"]),
        (search, ["--search-dp=1", "--gpus", "16"], ["--search-dp"]),
        (DP, ["--dp", "65536"], ["--dp 65536 x --ranks 4", "at most 65536"]),
        ({**search, "--layers": "4000", "--global-batch": "4096"}, ["--search-dp", "--gpus", "2"], ["no dp", "more than"]),
    ]
    for opts, extra, words in bad:
        rc, out, err = run(*args_of(opts, *extra))
        check(rc == 2 and len(err.splitlines()) == 1 and all(w in err for w in words) and out == "",
              f"bad input {extra}: exit {rc}, stderr {err!r} (want exit 2, one line with {words})")
    for flag, value in (("--dp", "2"), ("--zero", "1"), ("--search-dp", None), ("--gpus", "8"), ("--dp-gbps", "10"),
                        ("--gpus-per-node", "4"), ("--node-layout", "balanced")):
        rc, out, err = run("--schedule", "gis", "--ranks", "4", "--chunks", "2", "--microbatches", "8", flag,
                           *([value] if value else []))
        check(rc == 2 and flag in err and "--auto" in err, f"{flag} without --auto: {rc} {err!r}")


if __name__ == "__main__":
    sys.exit(main())
