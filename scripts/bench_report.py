"""docs/benchmarks.md and its bar chart, regenerated from the JSON results of scripts/bench.py.

    python scripts/bench_report.py RESULT.json ... [--md docs/benchmarks.md] [--png docs/benchmarks.png]

One report per GPU (results of two GPUs are refused): docs/bench holds H200 results and, named *-h100-*, H100 ones:

    python scripts/bench_report.py $(ls docs/bench/bench_*.json | grep -v -- -h100-)
    python scripts/bench_report.py docs/bench/bench_*-h100-*.json --md docs/benchmarks_h100.md --png docs/benchmarks_h100.png

One table per shape (every variant: forward+backward median/min/max, full step, tokens/s, MFU,
peak memory, ratio to coda and to the floor; failed variants with their error), a summary of the
gap from coda to the best peer and to the floor, the coda per-op breakdown, and the command,
date, GPU and package versions each result was measured with. The chart: one panel per shape,
forward+backward time per variant, the floor drawn as a line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import palette_png  # scripts/palette_png.py
from code_version import commit_of_sources  # scripts/code_version.py

# every peer bench.py runs, the FlashAttention 4 forms of the compile peers included (scripts/fa4_peer.py): the
# closest peer is chosen among all of them, never among a weaker subset
PEERS = ("eager", "compile", "compile-graphs", "compile-max-autotune", "compile-fa4", "compile-graphs-fa4",
         "compile-max-autotune-fa4", "liger")
OPT_IN = ("compile-max-autotune", "compile-max-autotune-fa4")  # run only where asked (--variants): its runs supplement a shape's main run
NOT_RUN_WHY = {  # why bench.py leaves a variant out unless asked (--variants)
    "compile-max-autotune": "opt-in: its GEMM autotuning takes 5-6 minutes of device time per shape (310-340 s at "
                            "125m and 8b-slice on 2026-12-01), run only where the session's device time allowed it",
    "eager": "not rerun in the speed calls since 2026-11-30 (device time); the slowest peer in every earlier run "
             "(docs/bench/before-speed)",
    "compile": "not rerun in the speed calls since 2026-11-30 (device time); within 1% of compile-graphs or slower in every "
               "earlier run (docs/bench/before-speed)",
    "liger": "not rerun on 2026-12-01 (device time); slower than compile-graphs in every earlier run",
    "compile-fa4": "its CUDA-graph form compile-graphs-fa4 was run instead (compile and compile-graphs were within 1% "
                   "in every earlier run)",
    "compile-max-autotune-fa4": "opt-in, as compile-max-autotune",
}
SHAPE_ORDER = ("125m", "1b-4x4096", "1b-2x8192", "8b-slice")


PROFILE_VERSION = 2  # bench.py's coda breakdown before version 2 counted profiler ranges as kernels


REPO = Path(__file__).resolve().parents[1]
# what every bench.py result holds (bench.py's `result`, environment()) and this report reads
RESULT_KEYS = ("shape", "preset", "n_layers", "batch", "seq", "command", "environment", "variants", "failed",
               "gemm_peak_tflops")
ENVIRONMENT_KEYS = ("gpu", "cuda", "date", "packages")
WHAT_TO_PASS = "pass the JSON results scripts/bench.py wrote (docs/bench/bench_*.json)"


def read_result(path: Path) -> dict:
    """bench.py's result in `path`; exits naming the file and what is wrong where it is not one."""
    try:
        r = json.loads(path.read_text())
    except OSError as e:
        sys.exit(f"error: cannot read {path}: {e.strerror or e}; {WHAT_TO_PASS}")
    except ValueError as e:
        sys.exit(f"error: {path} is not JSON ({e}); {WHAT_TO_PASS}")
    if not isinstance(r, dict):
        sys.exit(f"error: {path} holds a JSON {type(r).__name__}, not a scripts/bench.py result; {WHAT_TO_PASS}")
    env = r.get("environment")
    missing = [k for k in RESULT_KEYS if k not in r]
    missing += [f"environment.{k}" for k in ENVIRONMENT_KEYS if isinstance(env, dict) and k not in env]
    if missing or not isinstance(env, dict) or not isinstance(r["variants"], dict):
        sys.exit(f"error: {path} is not a scripts/bench.py result (it lacks {', '.join(missing) or 'a usable environment'}"
                 f"; another tool's JSON?); {WHAT_TO_PASS}")
    return r


def load(runs: list[dict]) -> list[dict]:
    """One result per shape: its newest run with a floor and no opt-in peer (ties: the one with most variants); its
    coda breakdown is the newest valid one among that shape's runs (a `--variants coda --tag=-profile`
    run can supply it), and its other runs that timed a peer next to a coda variant are kept as
    `peer_runs` (e.g. a `--variants compile-max-autotune,coda` run: each compared within its own run)."""
    by_shape: dict[str, list[dict]] = {}
    for r in runs:
        by_shape.setdefault(r["shape"], []).append(r)
    results = []
    for runs in by_shape.values():
        # runs with a floor and no opt-in peer or floor first (the others are supplements: a profile-only run, a
        # memory check, an opt-in peer's run, a --floor-quack-tuned run); a --tag only names the file
        main = max(runs, key=lambda r: ("floor" in r["variants"], not any(v in OPT_IN for v in r["variants"]),
                                        not _quack_tuned(r), r["environment"]["date"], len(r["variants"])))
        # a profile is read against its own run's coda step (bench.py profiles only where it timed one)
        profiled = [r for r in runs if r.get("coda_profile", {}).get("version", 1) >= PROFILE_VERSION
                    and "coda" in r["variants"]]
        src = max(profiled, key=lambda r: r["environment"]["date"]) if profiled else None
        main["coda_profile"] = None if src is None else {
            **src["coda_profile"], "command": src["command"], "date": src["environment"]["date"],
            "coda_ms": src["variants"]["coda"]["fwd_bwd"]["median_ms"],
            "coda_graphs_ms": src["variants"].get("coda-graphs", {}).get("fwd_bwd", {}).get("median_ms"),
            "floor": src["variants"].get("floor")}  # the gap table compares a profile with its own run's floor
        main["peer_runs"] = [r for r in runs if r is not main and _best_coda(r)[0] and any(n in r["variants"] for n in PEERS)]
        # every other run that timed CODA against the graph floor: the spread of that ratio from run to run
        main["graph_floor_runs"] = sorted((r for r in runs if r is not main and _best_coda(r)[0] and not _quack_tuned(r)
                                           and r["variants"].get("floor", {}).get("back_to_back")),
                                          key=lambda r: r["environment"]["date"], reverse=True)
        # coda-only runs after the main one (e.g. a memory check of later code): their peaks supersede its coda peaks
        main["memory_runs"] = sorted((r for r in runs if r is not main and set(r["variants"]) <= {"coda", "coda-graphs"}
                                      and r["environment"]["date"] > main["environment"]["date"]
                                      and r.get("memory_accounting") == "own"),
                                     key=lambda r: r["environment"]["date"])
        main["tuned_floor_runs"] = [r for r in runs if r is not main and _quack_tuned(r)]
        results.append(main)
    return sorted(results, key=lambda r: SHAPE_ORDER.index(r["shape"]) if r["shape"] in SHAPE_ORDER else 99)


def _autotuned_sequence(floor: dict) -> str:
    """The floor's back-to-back sequence again with the GEMMs it ran at quack's default config at quack's
    autotuned pick (bench.py --floor-quack-tuned, since that sequence was added), as a sentence."""
    alt = floor.get("back_to_back_autotuned")
    if not alt:
        return ""
    n = len(alt["gemms_autotuned"])
    return (f" The same sequence with its {n} GEMM shape{'s' if n > 1 else ''} on quack's default config at quack's "
            f"autotuned pick instead: {alt['median_ms']:.2f} ms.")


def _fp32_wgrad_sequence(r: dict) -> str:
    """The floor's back-to-back sequence again with its weight gradients written in fp32, as CODA writes them
    (bench.py since that sequence was added), with coda's ratio to it, as a sentence."""
    fp32 = r["variants"]["floor"].get("back_to_back_fp32_wgrads")
    if not fp32:
        return ""
    clk = (fp32.get("clocks") or {}).get("sm_mhz_mean")
    ratios = [f"{n} {row['over_floor_fp32_wgrads']:.3f}" for n, row in r["variants"].items()
              if n.startswith("coda") and row.get("over_floor_fp32_wgrads")]
    return (f" The same sequence with its weight gradients ({len(fp32['wgrads'])} GEMM shapes) written in fp32, as CODA writes them "
            f"(the floor's GEMMs write bf16): {fp32['median_ms']:.2f} ms" + (f" at {clk:.0f} MHz" if clk else "")
            + (f"; coda / that: {', '.join(ratios)}" if ratios else "") + ".")


def _quack_tuned(r: dict) -> bool:
    """A run whose floor also tried quack's autotuned config per GEMM (bench.py --floor-quack-tuned, opt-in)."""
    return bool(r["variants"].get("floor", {}).get("quack_tuned"))


def _best_coda(r: dict) -> tuple[str | None, float | None]:
    """The faster of the eager-launched and the CUDA-graph CODA step of one run (train.py's default
    on one GPU is the graph): (variant, ms), or (None, None)."""
    ours = {n: _ms(r["variants"][n]) for n in ("coda", "coda-graphs") if n in r["variants"] and _ms(r["variants"][n])}
    name = min(ours, key=ours.get) if ours else None
    return name, ours.get(name)


def _peers(r: dict) -> list[dict]:
    """Every peer timing of a shape, each with the CODA step of its own run (name, ms, coda, coda_ms,
    peak above weights, separate): the main run's peers, then each peer it lacks from the newest of
    its peer_runs that timed it."""
    rows, seen = [], set()
    others = sorted(r.get("peer_runs", []), key=lambda o: o["environment"]["date"], reverse=True)
    for run, separate in [(r, False)] + [(o, True) for o in others]:
        coda, coda_ms = _best_coda(run)
        for n in PEERS:
            if n in run["variants"] and n not in seen:
                seen.add(n)
                rows.append(dict(name=n, ms=_ms(run["variants"][n]), coda=coda, coda_ms=coda_ms, separate=separate, run=run,
                                 mem=_peak(run, n)))
    return rows


GRAPH_TREE_VARIANTS = ("compile-graphs", "compile-max-autotune")  # torch.compile modes that record CUDA-graph trees


def _peak_trusted(run: dict, name: str) -> bool:
    """False for a torch.compile CUDA-graph variant that followed another one in a run made before
    bench.py reset torch.compile between variants: the trees share one memory pool per device, so the
    second recorded into the first one's freed blocks and its peak read low (at 8B, 2026-12-05:
    compile-max-autotune 2.5 GiB above the weights after compile-graphs, 10.2 in a run of its own)."""
    if run.get("variant_isolation") == "dynamo_reset" or name not in GRAPH_TREE_VARIANTS:
        return True
    order = list(run["variants"])
    return not any(n in GRAPH_TREE_VARIANTS for n in order[:order.index(name)])


UNTRUSTED_PEAK = ("a torch.compile CUDA-graph variant after another one in the same process, before bench.py reset "
                  "torch.compile between variants, recorded into the first one's memory pool and read low")


def _peak_cell(run: dict, name: str, mem: float | None) -> str:
    """'9.2 GiB', '- GiB' where not measured, or why it is not shown."""
    if not _peak_trusted(run, name):
        return "not comparable (a second torch.compile CUDA-graph tree in one process, before bench.py's reset)"
    return f"{'-' if mem is None else format(mem, '.1f')} GiB"


def _peak(run: dict, name: str, key: str = "peak_above_weights_gib") -> float | None:
    """A variant's peak memory (GiB) in `run`, None where it was not measured or cannot be trusted."""
    return run["variants"].get(name, {}).get(key) if _peak_trusted(run, name) else None


def _ms(row: dict, key: str = "fwd_bwd") -> float | None:
    return row.get(key, {}).get("median_ms")


def _code(env: dict) -> str:
    """', code <commit> (sources <hash>)' where the run recorded which code ran; the sources hash is
    what identifies it. A run whose checkout had uncommitted changes (or whose git metadata lagged
    its working tree, as the device copy's does) is named after the first commit with its sources
    where this checkout's history has one (code_version.commit_of_sources)."""
    code = env.get("code") or {}
    commit, sha = (code.get("git_commit") or "")[:10], code.get("sources_sha256")
    if code.get("git_dirty") and sha:
        found = commit_of_sources(sha)
        if found:
            return f", code {found[:10]} (sources {sha}, found by its hash; the run named {commit} with uncommitted changes)"
    parts = [commit + (" with uncommitted changes" if code.get("git_dirty") else "")] if commit else []
    parts += [f"sources {sha}"] if sha else []
    return f", code {parts[0]}" + (f" ({parts[1]})" if len(parts) > 1 else "") if parts else ""


REASON_NAMES = {"sw_power_cap": "power cap", "hw_slowdown": "HW slowdown", "sw_thermal": "SW thermal",
                "hw_thermal": "HW thermal", "hw_power_brake": "power brake"}


def clock_reasons(clocks: Optional[dict]) -> str:
    """What held the SM clock down while a variant ran: each reason nvidia-smi reported in at least
    5% of the samples, with that share ('-' where not recorded, 'nothing' where none was)."""
    reasons = (clocks or {}).get("clock_reasons")
    if reasons is None:
        return "-"
    held = [f"{REASON_NAMES.get(k, k)} {100 * v:.0f}%" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]) if v >= 0.05]
    return ", ".join(held) or "nothing"


# How bench.py timed its steps (results without "step_timing", the runs up to 2026-12-01 23:40 UTC: each step synced).
STEP_TIMING = {"synced": "each step timed with a device sync after it (its host launch latency included).",
               "back_to_back": "steps timed back to back with one sync after the last, as train.py runs them "
                               "('synced': the same steps with a device sync after each, the earlier runs' method)."}


def sustain_note(r: dict) -> str:
    """How long each step timing ran its steps back to back first (bench.py --sustain-s, recorded since b088bec)."""
    if "sustain_s" not in r:
        return (" No sustained steps before each timing (bench.py before b088bec): a variant timed right after a long "
                "compile likely ran at a boosted clock for part of its window (the 8b eager coda variant read ~1 % fast).")
    if not r["sustain_s"]:
        return " No sustained steps before each timing (--sustain-s 0, or a CPU run)."
    return (f" Each step timing followed {r['sustain_s']:g} s of its steps back to back (the clock a power-capped GPU "
            "holds in training).")


def _over_coda(r: dict, row: dict):
    """A variant's forward+backward over CODA's faster launch (eager or graph) in the same run; computed here,
    since results before 2026-12-05 stored the ratio to the eager launch."""
    v = r["variants"]
    coda = min((v[n]["fwd_bwd"]["median_ms"] for n in ("coda", "coda-graphs") if n in v), default=None)
    return row["fwd_bwd"]["median_ms"] / coda if coda else None


def shape_table(r: dict) -> list[str]:
    env = r["environment"]
    lines = [f"### {r['shape']}: {r['preset']}, {r['n_layers']} layers, {r['batch']} x {r['seq']} tokens",
             "", f"`{r['command']}` on {env['gpu']}, {env['date']}{_code(env)}; "
             # a CPU's matmul rate is no bf16 peak (bench.py takes no MFU against it)
             + (f"bf16 GEMM peak measured in the same run: {r['gemm_peak_tflops']['peak']:.0f} TFLOP/s; "
                if not env["gpu"].startswith("CPU") else "")
             + STEP_TIMING[r.get("step_timing", "synced")] + sustain_note(r), "",
             "| variant | fwd+bwd ms (median) | min | max | synced ms | full step ms | tokens/s | MFU (fwd+bwd) | peak GiB | above weights GiB | / coda (faster launch) | / floor | SM MHz (mean) | full step SM MHz | W (mean) | clock held by |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for name, row in r["variants"].items():
        fb = row["fwd_bwd"]
        lines.append(f"| {name} | {fb['median_ms']:.2f} | {fmt(fb.get('min_ms'), '.2f')} | {fmt(fb.get('max_ms'), '.2f')} | "
                     f"{fmt(_ms(row, 'fwd_bwd_synced'), '.2f')} | {fmt(_ms(row, 'step'), '.2f')} | {fmt(row.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(row.get('mfu_fwd_bwd'), '.1%')} | {fmt(_peak(r, name, 'peak_fwd_bwd_gib'), '.1f')} | "
                     f"{fmt(_peak(r, name), '.1f')} | {fmt(_over_coda(r, row), '.2f')} | "
                     f"{fmt(row.get('over_floor'), '.2f')} | {fmt((row.get('clocks') or {}).get('sm_mhz_mean'), '.0f')} | "
                     f"{fmt((row.get('step_clocks') or {}).get('sm_mhz_mean'), '.0f')} | "
                     f"{fmt((row.get('clocks') or {}).get('power_w_mean'), '.0f')} | {clock_reasons(row.get('clocks'))} |")
    for name, err in r["failed"].items():
        lines.append(f"| {name} | failed: {err.splitlines()[0][:160]} | | | | | | | | | | | | | | |")
    untrusted = [n for n in r["variants"] if not _peak_trusted(r, n)]
    if untrusted:
        lines += ["", f"Peak memory of {', '.join(untrusted)} not shown: {UNTRUSTED_PEAK}."]
    if r.get("pending"):
        lines += ["", "This run was cut short (the device call's time limit) before: " + ", ".join(r["pending"]) + "."]
    separate = [p for p in _peers(r) if p["separate"]]
    not_run = [v for v in r.get("not_run", []) if v not in {p["name"] for p in separate}]
    if not_run:
        lines += ["", "Not run at this shape: " + "; ".join(f"{v} ({NOT_RUN_WHY[v]})" if v in NOT_RUN_WHY else v
                                                         for v in not_run) + "."]
    if separate:
        lines += ["", "Peers timed in separate runs of this shape, each against the CODA step of its own run:", ""]
        for run in {id(p["run"]): p["run"] for p in separate}.values():  # one line a run, in the peers' order
            env, ours = run["environment"], [p for p in separate if p["run"] is run]
            clock = lambda n: (run["variants"][n].get("clocks") or {}).get("sm_mhz_mean", float("nan"))  # noqa: E731
            timed = "; ".join(f"{p['name']} {p['ms']:.2f} ms (coda / {p['name']} {p['coda_ms'] / p['ms']:.2f}, peak above "
                              f"weights {_peak_cell(run, p['name'], p['mem'])}, SM clock {clock(p['name']):.0f} MHz)"
                              for p in ours)
            lines.append(f"- {ours[0]['coda']} {ours[0]['coda_ms']:.2f} ms against {timed}: `{run['command']}`, "
                         f"{env['date']}{_code(env)}.")
    for run in r.get("memory_runs", []):
        peaks = ", ".join(f"{n} {row['peak_above_weights_gib']:.1f}" for n, row in run["variants"].items()
                          if row.get("peak_above_weights_gib") is not None)
        lines += ["", f"Peak memory above the weights measured again after this run (`{run['command']}`, "
                  f"{run['environment']['date']}{_code(run['environment'])}): {peaks} GiB; the summary's coda peak is this one."]
    floor = r["variants"].get("floor")
    if floor:
        tuned = floor.get("quack_tuned")
        on_tuned = sum(g["best"] == "quack-tuned" for g in floor["gemms"])
        at_2x2 = "quack-2x2" in floor.get("backends", ())  # since 2026-12-07, where CODA's table runs a 2x2 cluster
        on_2x2 = sum(g["best"] == "quack-2x2" for g in floor["gemms"])
        rounds = len(floor["gemms"][0].get("cublas_rounds_ms", ()))  # since 2026-12-07: each backend timed in turn
        lines += ["", f"Floor: GEMMs {floor['gemm_ms']:.2f} ms (each at the fastest of cuBLAS and quack's default config"
                  f"{' and autotuned pick' if tuned else ''}{', and that config at a 2x2 cluster' if at_2x2 else ''}"
                  f"{f', by the median of {rounds} timings each, taken in turn' if rounds > 1 else ''}: "
                  f"{sum(g['best'].startswith('quack') for g in floor['gemms'])} of {len(floor['gemms'])} shapes on quack"
                  f"{f', {on_tuned} of them autotuned' if tuned else ''}{f', {on_2x2} at 2x2' if at_2x2 else ''}) "
                  f"+ FlashAttention 4 {floor['attention_ms']:.2f} ms (forward {floor['attention_fwd_ms']:.3f} + "
                  f"backward {floor['attention_bwd_ms']:.3f} ms per layer)."]
        b2b = floor.get("back_to_back")
        if b2b:
            clk = lambda row: f" at {row['sm_mhz_mean']:.0f} MHz mean SM clock" if row else ""  # noqa: E731
            ratios = [f"{n} {row['over_floor_back_to_back']:.2f}" for n, row in r["variants"].items()
                      if n.startswith("coda") and row.get("over_floor_back_to_back")]
            how = " (captured and replayed as one CUDA graph, as coda-graphs runs)" if b2b.get("replay") == "one CUDA graph" else ""
            lines += ["", f"The same kernels back to back in a step's order{how}, timed as a step: {b2b['median_ms']:.2f} ms"
                      f"{clk(b2b.get('clocks'))}" + (f" (each alone{clk(floor['clocks'])})" if floor.get("clocks") else "")
                      + (f"; coda / that: {', '.join(ratios)}" if ratios else "") + "." + _fp32_wgrad_sequence(r)
                      + _autotuned_sequence(floor)]
    paired = r.get("paired")
    if paired:
        mhz = lambda side: [row[f"{side}_mhz"] for row in paired["rounds"] if row.get(f"{side}_mhz")]  # noqa: E731
        clocks = (f" (mean SM clock {statistics.mean(mhz('coda')):.0f} MHz for {paired['variant']}, "
                  f"{statistics.mean(mhz('floor')):.0f} MHz for the floor)" if mhz("coda") and mhz("floor") else "")
        lines += ["", f"Paired: {paired['variant']} and the floor back to back built side by side and timed in turn, "
                  f"{len(paired['rounds'])} rounds, the first of each pair alternating; {paired['variant']} / floor back to back "
                  + ", ".join(f"{row['coda_ms']:.2f} / {row['floor_ms']:.2f} = {row['ratio']:.3f}" for row in paired["rounds"])
                  + f"; **median {paired['median_ratio']:.3f}**{clocks}."]
    if r.get("graph_floor_runs"):
        lines += ["", "Other runs of this shape against the floor back to back, newest first (each ratio within its own run):", ""]
        for run in r["graph_floor_runs"]:
            name, ms = _best_coda(run)
            b2b = run["variants"]["floor"]["back_to_back"]["median_ms"]
            lines.append(f"- {run['environment']['date']}{_code(run['environment'])}: {name} {ms:.2f} ms / {b2b:.2f} ms = "
                         f"{ms / b2b:.3f} (`{run['command']}`)")
    for run in r.get("tuned_floor_runs", []):
        tf = run["variants"]["floor"]
        b2b = tf.get("back_to_back", {}).get("median_ms")
        ratios = [f"{n} {row['fwd_bwd']['median_ms']:.2f} ms, / graph floor {row['over_floor_back_to_back']:.2f}"
                  for n, row in run["variants"].items() if n.startswith("coda") and row.get("over_floor_back_to_back")]
        lines += ["", f"The floor with quack's autotuned config as a third candidate per GEMM (`{run['command']}`, "
                  f"{run['environment']['date']}{_code(run['environment'])}): GEMMs {tf['gemm_ms']:.2f} ms, "
                  f"{sum(g['best'] == 'quack-tuned' for g in tf['gemms'])} of {len(tf['gemms'])} shapes on the autotuned "
                  f"pick; floor {tf['fwd_bwd']['median_ms']:.2f} ms" + (f", back to back {b2b:.2f} ms" if b2b else "")
                  + (f"; in that run {'; '.join(ratios)}" if ratios else "") + "." + _autotuned_sequence(tf)]
    prof = r.get("coda_profile")
    if prof:
        lines += ["", f"Where a coda step goes (`{prof['command']}`, {prof['date']}; coda {prof['coda_ms']:.2f} ms "
                  f"forward+backward in that run): {prof['launches_per_step']:.0f} kernel launches per step, "
                  f"{prof['kernel_ms_per_step']:.2f} ms of kernels, GPU idle {100 * prof['gpu_idle_fraction']:.0f}% of "
                  f"the {prof['gpu_window_ms_per_step']:.2f} ms from first kernel to last. Kernel time by op "
                  f"(a second profiled pass with a range around every op call: "
                  f"{prof['annotated_kernel_ms_per_step']:.2f} ms of kernels)" + graph_idle(prof.get("graph")) + ":", "",
                  "| owner (coda op, or [kernel class] outside any op) | ms / step | launches / step |", "|---|---:|---:|"]
        n = prof.get("launches_by_owner", {})  # recorded since 2026-12-01
        lines += [f"| {owner} | {ms:.3f} | {n[owner]:.0f} |" if owner in n else f"| {owner} | {ms:.3f} | - |"
                  for owner, ms in prof["by_owner_ms"].items()]
        lines += gap_table(r)
    return lines + [""]


def idle_ms(timeline: dict) -> float:
    """GPU idle per step of one profiled pass: its first-to-last-kernel window less the kernels' union."""
    return timeline["gpu_window_ms_per_step"] - timeline["busy_ms_per_step"]


def graph_idle(g) -> str:
    """The profile's CUDA-graph pass (recorded since 2026-12-01): the idle time no host is behind."""
    if not g or not g["launches_per_step"]:
        return ""
    return (f"; replayed as a CUDA graph, {g['launches_per_step']:.0f} launches, {g['kernel_ms_per_step']:.2f} ms of kernels "
            f"and {idle_ms(g):.2f} ms idle between them")


# The floor's work inside each coda op: GEMMs of bench.py's step_gemms (names) and attention passes.
# An op's excess over them is what its epilogue (or its very existence) costs; ops absent here
# (the RoPE backward until 2026-12-02, the tiny reductions, embedding, casts) and GPU idle time have no
# floor at all.
FLOOR_PARTS = {
    "gemm_rowscale_rope": ["qkv fwd"], "attention": ["attention fwd"],
    "gemm_residual_rmsnorm_partial": ["o fwd", "down fwd"], "gemm_rowscale_swiglu": ["gate_up fwd"],
    "gemm_rowscale_exp_cross_entropy": ["lm_head fwd"], "cross_entropy_exp_backward": [],
    "gemm_exp_rmsnorm_backward": ["lm_head dgrad"],
    "matmul_tn_exp": ["lm_head wgrad"],  # matmul_tn_exp_add's chunks included: one floor GEMM (ONE_ROW)
    "gemm_dswiglu_rowscale_stat": ["down dgrad"], "matmul": ["o dgrad"], "attention_backward": ["attention bwd"],
    "attention_rope_backward_rowscale_stat": ["attention bwd"],  # its RoPE-backward pass is the excess
    "gemm_rmsnorm_backward": ["gate_up dgrad", "qkv dgrad"],
    "matmul_tn": ["qkv wgrad", "o wgrad", "gate_up wgrad", "down wgrad"],
}
# Ops that split one floor GEMM over chunks of rows: reported as one row, under the first op's name.
ONE_ROW = {"matmul_tn_exp_add": "matmul_tn_exp", "matmul_tn_add": "matmul_tn"}
# Profiles taken before 2026-12-01's exponential-storing LM head, whose ops were these (the dgrad and
# the first chunk's weight gradient ran as gemm_rmsnorm_backward and matmul_tn).
FLOOR_PARTS_LOGITS_HEAD = {
    **{op: parts for op, parts in FLOOR_PARTS.items() if "exp" not in op},
    "gemm_rowscale_logits_cross_entropy": ["lm_head fwd"], "cross_entropy_backward_rowscale_stat": [],
    "gemm_rmsnorm_backward": ["gate_up dgrad", "qkv dgrad", "lm_head dgrad"],
    "matmul_tn": ["qkv wgrad", "o wgrad", "gate_up wgrad", "down wgrad", "lm_head wgrad"],
}


def gap_table(r: dict) -> list[str]:
    """Every millisecond from the floor to coda: per op, its kernel time against the floor's time
    for the same GEMMs / attention, then the work with no floor counterpart and the GPU idle time."""
    prof = r.get("coda_profile")
    floor = prof and (prof.get("floor") or r["variants"].get("floor"))
    if not prof or not floor:
        return []
    whose = "the same run's floor" if prof.get("floor") else f"the floor of the {r['environment']['date']} run"
    # the step replayed as a CUDA graph, where the profile attributed it (since 2026-12-02): its kernels at the
    # clock of a sustained replay, as coda-graphs is timed, not at an eager step's host-gapped clock
    graph = prof.get("graph") or {}
    replayed = bool(graph and graph["launches_per_step"] and prof.get("coda_graphs_ms"))  # compared with coda-graphs
    graphed = replayed and bool(graph.get("by_owner_ms"))
    ops_ms = graph["by_owner_ms"] if graphed else prof["by_owner_ms"]
    what_coda = (f"kernel time of the coda step replayed as a CUDA graph, each kernel given the op of the eager "
                 f"step's kernel it aligns with in launch order ({graph['kernels_matched']} of {graph['kernels']} aligned; the "
                 f"rest by kernel class)" if graphed else "kernel time of the profiled coda step")
    part_ms = {g["gemm"]: g["best_ms"] * g["count"] for g in floor["gemms"]}
    part_ms["attention fwd"] = floor["attention_fwd_ms"] * r["n_layers"]
    part_ms["attention bwd"] = floor["attention_bwd_ms"] * r["n_layers"]
    # the floor's items profiled as a step runs them, at the back-to-back steps' clocks (recorded since 2026-12-02)
    b2b = floor.get("back_to_back") or {}
    b2b_ms = b2b.get("by_item_ms")
    head = "| coda op | coda ms | floor ms (same work) | excess ms |"
    rule = "|---|---:|---:|---:|"
    if b2b_ms:
        head += " floor back to back ms (same work) | excess over it ms |"
        rule += "---:|---:|"
    lines = ["", f"Gap from the floor, attributed ({what_coda} against {whose}, for "
             "the same GEMMs and attention" + ("; and against the floor's kernels profiled back to back, in a step's "
                                               "order right after its timed steps. Under a power cap a kernel's time "
                                               "moves with the clock of the pass that profiled it, so where the two "
                                               "profiles ran at different clocks the per-op columns differ by that "
                                               "and the step totals are the like-for-like comparison" if b2b_ms else "")
             + "):",
             "", head, rule]
    total_excess = total_excess_b2b = 0.0
    parts = FLOOR_PARTS_LOGITS_HEAD if "gemm_rowscale_logits_cross_entropy" in ops_ms else FLOOR_PARTS
    by_row: dict[str, float] = {}
    for op, ms in ops_ms.items():
        by_row[ONE_ROW.get(op, op)] = by_row.get(ONE_ROW.get(op, op), 0.0) + ms
    merged = {row: [op for op, to in ONE_ROW.items() if to == row and op in ops_ms] for row in by_row}
    for op, ms in sorted(by_row.items(), key=lambda kv: -kv[1]):
        base = sum(part_ms[p] for p in parts.get(op, []))
        total_excess += ms - base
        label = " + ".join([op] + merged[op])
        row = f"| {label} | {ms:.2f} | {base:.2f} | {ms - base:+.2f} |"
        if b2b_ms:
            base_b2b = sum(b2b_ms.get(p, 0.0) for p in parts.get(op, []))
            total_excess_b2b += ms - base_b2b
            row += f" {base_b2b:.2f} | {ms - base_b2b:+.2f} |"
        lines.append(row)
    # against the CUDA-graph step where the profile replayed one (no host in the way), else the eager step
    name, ms = "coda", prof["coda_ms"]
    what = "GPU idle between kernels"
    if replayed:
        idle, name, ms = idle_ms(graph), "coda-graphs", prof["coda_graphs_ms"]
        if graph.get("sequence"):
            idle, what = graph_idle_ms(graph["sequence"]), "GPU idle between the graph's kernels"
    else:
        idle = idle_ms(prof)
    gap = ms - floor["fwd_bwd"]["median_ms"]
    more = lambda cell: f" - | {cell} |" if b2b_ms else ""  # noqa: E731
    gap_b2b = ms - b2b["median_ms"] if b2b_ms else 0.0
    lines.append(f"| {what} ({name}) | - | - | {idle:+.2f} |" + more(f"{idle:+.2f}"))
    lines.append(f"| rest: the timed step beyond the profiled kernels and idle (clocks under sustained load; "
                 f"host latency before a step's first kernel) | - | - | {gap - total_excess - idle:+.2f} |"
                 + more(f"{gap_b2b - total_excess_b2b - idle:+.2f}"))
    lines.append(f"| **total** | | | **{gap:+.2f}** ({name} {ms:.2f} − floor {floor['fwd_bwd']['median_ms']:.2f}) |"
                 + (f" | **{gap_b2b:+.2f}** (− floor back to back {b2b['median_ms']:.2f}) |" if b2b_ms else ""))
    if prof.get("weights_recast_every_forward"):  # bench.py's profile before the fix of 2026-12-05
        lines += ["", "This profile's model cast every weight to its bf16 compute copy in every forward (its "
                  "`[copies / casts]` row); the timed coda steps keep their copies between optimizer steps, so that "
                  "row is not part of the total, and the rest row, negative by as much, takes it back."]
    return lines


def graph_idle_ms(sequence: list[dict]) -> float:
    """Idle between the kernels of one replayed graph: the gaps after its first kernel (the batch
    copies before it, and the host's latency to the replay's start, are not the graph's)."""
    first = next((i for i, k in enumerate(sequence) if not k["kernel"].startswith("Memcpy")), len(sequence))
    return sum(k["gap_us"] or 0.0 for k in sequence[first + 1:]) / 1e3


def _paired_cell(r: dict, name: str) -> str:
    """The median paired ratio of the run, naming its CODA variant where the summary's row shows the other one."""
    paired = r.get("paired")
    if not paired:
        return "-"
    return f"{paired['median_ratio']:.3f}" + ("" if paired["variant"] == name else f" ({paired['variant']})")


def summary_table(results: list[dict]) -> list[str]:
    """CODA (the faster of its two steps) against its closest peer and the floor; a peer timed in a
    separate run is compared with the CODA step of that run, and the closest peer is the one with the
    highest coda / peer ratio."""
    lines = ["| shape | coda variant | coda ms | closest peer | its ms | coda / closest peer | floor ms | coda / floor "
             "| floor back to back ms | coda / that | same, paired (median of rounds) | coda peak above weights GiB "
             "| lowest peer GiB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        v = r["variants"]
        name, coda = _best_coda(r)
        name = name or "coda"
        floor = _ms(v.get("floor", {}))
        b2b = v.get("floor", {}).get("back_to_back", {}).get("median_ms")
        peers = _peers(r)
        timed = [p for p in peers if p["ms"] and p["coda_ms"]]
        best = max(timed, key=lambda p: p["coda_ms"] / p["ms"]) if timed else None
        mem = [p["mem"] for p in peers if p["mem"] is not None]
        cell = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
        label = "-" if best is None else best["name"] + (" (separate run)" if best["separate"] else "")
        peak = v.get(name, {}).get("peak_above_weights_gib")
        for run in r.get("memory_runs", []):  # newest last: a later measurement of the same variant wins
            peak = run["variants"].get(name, {}).get("peak_above_weights_gib", peak)
        lines.append(f"| {r['shape']} | {name} | {cell(coda)} | {label} | {cell(best and best['ms'])} | "
                     f"{cell(best['coda_ms'] / best['ms'] if best else None)} | {cell(floor)} | "
                     f"{cell(coda / floor if coda and floor else None)} | {cell(b2b)} | {cell(coda / b2b if coda and b2b else None)} | "
                     f"{_paired_cell(r, name)} | "
                     f"{cell(peak, '.1f')} | {cell(min(mem) if mem else None, '.1f')} |")
    return lines


def memory_caveat(results: list[dict]) -> list[str]:
    """Results written before bench.py counted each variant's own memory (MEMORY_ACCOUNTING) include
    what earlier variants of the same process left allocated (torch.compile's CUDA-graph pools)."""
    old = [r["shape"] for r in results if r.get("memory_accounting") != "own"]
    if not old:
        return []
    return [f"Peak memory of {', '.join(old)}: measured before bench.py counted only each variant's own allocations, "
            "so it includes what the variants measured before it in the same process left allocated (torch.compile's "
            "CUDA-graph pools); compare variants there with `scripts/memory_profile.py`.", ""]


def chart(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        rows = [(n, _ms(row)) for n, row in r["variants"].items() if n != "floor"]
        colors = ["tab:red" if n.startswith("coda") else "tab:gray" for n, _ in rows]
        ax.bar([n for n, _ in rows], [ms for _, ms in rows], color=colors)
        floor = _ms(r["variants"].get("floor", {}))
        if floor:
            ax.axhline(floor, color="black", linestyle="--", linewidth=1.2, label=f"floor {floor:.1f} ms")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"{r['shape']} ({r['batch']}x{r['seq']})", fontsize=10)
        ax.set_ylabel("forward + backward, ms")
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle(f"{results[0]['environment']['gpu']}, {results[0]['environment']['date'][:10]}", fontsize=10)
    fig.tight_layout()
    palette_png.save(fig, png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="JSON results of scripts/bench.py, all from one GPU")
    p.add_argument("--md", type=Path, help="the report to write (default: docs/benchmarks.md of this repo, wherever "
                                           "the command runs; missing folders are created)")
    p.add_argument("--png", type=Path, help="its chart (default: the report's path with .png; the report links it)")
    args = p.parse_args()
    md = args.md or REPO / "docs/benchmarks.md"
    png = args.png or md.with_suffix(".png")
    runs = [read_result(path) for path in args.results]
    gpus: dict[str, list[str]] = {}  # one report per GPU: a shape's runs are compared with each other
    for path, run in zip(args.results, runs):
        gpus.setdefault(run["environment"]["gpu"], []).append(path.as_posix())
    if len(gpus) > 1:
        p.error("the results come from more than one GPU (" + "; ".join(f"{g}: {' '.join(f)}" for g, f in gpus.items()) +
                "); write one report per GPU, e.g. --md docs/benchmarks_h100.md --png docs/benchmarks_h100.png with its files")
    results = load(runs)
    env = results[0]["environment"]
    machine = next((ln for ln in (md.read_text().splitlines() if md.is_file() else []) if ln.startswith("Machine: one ")), None)
    if machine is not None and not machine.startswith(f"Machine: one {env['gpu']} ("):
        p.error(f"{md} is the report of another GPU ({machine.removeprefix('Machine: one ').split(' (')[0]}), these results "
                f"are from {env['gpu']}: write their own with --md (e.g. --md docs/benchmarks_h100.md)")
    pkgs = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
    lines = ["# Benchmarks", "",
             "Generated by `python scripts/bench_report.py " + " ".join(p.as_posix() for p in args.results) +
             "".join(f" {flag} {path.as_posix()}" for flag, path in (("--md", args.md), ("--png", args.png)) if path) +
             "` from the JSON that `scripts/bench.py` wrote; do not edit by hand.", "",
             f"Machine: one {env['gpu']} (CUDA {env['cuda']}); packages: {pkgs}. Every variant of a shape was timed in "
             "one process on the same weights and batch: bf16 compute, fp32 master weights, fused AdamW in the full "
             "step. MFU counts model FLOPs (causal attention as half) against the bf16 GEMM peak measured in the same "
             "run. The floor is the step's GEMMs at the best of cuBLAS and quack plus FlashAttention 4, nothing else, each "
             "timed alone; 'floor back to back' runs the same kernels in a step's order and times them as a step, at the "
             "clocks a sustained step gets (an H200 running these steps back to back nears its 700 W limit and lowers its SM clock).",
             "", f"![forward+backward time per variant, floor as a line]({Path(os.path.relpath(png, md.parent)).as_posix()})", "",
             "## Summary: coda against its closest peer and the floor (forward + backward)", "", *summary_table(results), "",
             *memory_caveat(results), "## Per shape", ""]
    for r in results:
        lines += shape_table(r)
    for path in (md, png):
        path.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    chart(results, png)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
