"""Compare training runs: loss curves (raw and smoothed) and their difference, plus a table.

    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] [--out compare.png] [--smooth 50]

Each RUN_DIR holds `metrics.jsonl` (one JSON line per logged step, from train.py) and
`config.yaml` (the resolved config; its model.impl names the run). The first run is the reference for the difference panel and the |Δloss| columns.
Writes the PNG at --out (a path ending in .png), and the table as Markdown (`.md`) and JSON (`.json`) beside it,
under the same name (--out cmp/a.png: cmp/a.png, cmp/a.md, cmp/a.json). The table's train loss is each run's mean
over its last N steps; runs logged at different intervals (log_every 10 and 25) are averaged at the steps all logged.

With three runs or more (e.g. eager twice and coda twice: `python train.py -m model.impl=eager,coda,eager,coda`)
a second table lists every pair's smoothed difference over the last 10% of steps, split into pairs of
the same model (what two runs of one model differ by: the run-to-run noise of the setting) and pairs
across models, so "coda vs eager" can be read against that noise.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import palette_png  # noqa: E402  (scripts/palette_png.py)
from coda_train.durable import lock_holder  # noqa: E402
from coda_train.trainer.loop import SAME_TRAJECTORY  # noqa: E402  (settings that do not change the steps a run takes)
from coda_train.trainer.metrics import METRICS_FILE  # noqa: E402
from coda_train.trainer.rundir import LOCK_FILE, LOG_FILE, sweep_jobs  # noqa: E402  (LOCK_FILE: held in its run dir while a run runs)


@dataclass
class Run:
    name: str
    program: str | None  # model.impl, with the kernel backend for coda: what "the same model" means below
    settings: dict  # the rest of config.yaml but what tells runs of one setting apart (run_dir, seed, logger)
    steps: np.ndarray
    loss: np.ndarray
    tokens: np.ndarray
    elapsed_s: np.ndarray
    tokens_per_s: float
    val_steps: np.ndarray
    val_loss: np.ndarray


def read_run(run_dir: Path) -> Run:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        if jobs := sweep_jobs(run_dir, lambda job: (job / METRICS_FILE).is_file()):  # a multirun's sweep dir: its jobs are the runs
            sys.exit(f"error: {run_dir} is a multirun sweep, not one run; pass its jobs' run dirs: {' '.join(map(str, jobs))}")
        if holder := lock_holder(run_dir / LOCK_FILE):  # preparing its data or building its model
            sys.exit(f"error: {run_dir} has no metrics.jsonl yet: its run ({holder}) has not logged a step; compare it "
                     "once it has")
        if (run_dir / LOG_FILE).is_file():  # a run that stopped before its first step (a bad config, data, checkpoint)
            sys.exit(f"error: {run_dir} has no metrics.jsonl: its run stopped before logging a step ({run_dir / LOG_FILE} "
                     "says why); fix that and train it, or leave it out")
        sys.exit(f"error: {path} not found; pass run directories written by train.py")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            if n != lines[-1][0]:
                sys.exit(f"error: {path}:{n} is not a JSON line; the metrics file is damaged")
            # the last line cut short (a run killed or out of disk mid-write), as the trainer's rewind skips it
            print(f"warning: {path}:{n} is cut short and left out", file=sys.stderr)
            continue
        if problem := metrics_problem(row):
            sys.exit(f"error: {path}:{n} is not a metrics line of train.py ({problem}); the metrics file is damaged "
                     "or another tool's: pass run directories written by train.py")
        rows.append(row)
    train = [r for r in rows if r.get("loss") is not None]  # a line of val_loss alone (loss null) is no training step
    if not train:
        sys.exit(f"error: {path} has no training steps logged")
    # A resumed run may log a step twice (from before the crash and after): keep the last.
    by_step = {r["step"]: r for r in train}
    train = [by_step[s] for s in sorted(by_step)]
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    impl = run_impl(run_dir / "config.yaml")
    name = f"{impl} ({run_dir.name})" if impl else run_dir.name
    tps = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    # Steady-state throughput: median over the second half of the run (skips compile/warm-up).
    return Run(name=name, program=run_program(run_dir / "config.yaml"), settings=run_settings(run_dir / "config.yaml"),
               steps=np.array([r["step"] for r in train]),
               loss=np.array([r["loss"] for r in train], dtype=np.float64),
               tokens=np.array([r.get("tokens", math.nan) for r in train], dtype=np.float64),
               elapsed_s=np.array([r.get("elapsed_s", math.nan) for r in train], dtype=np.float64),
               tokens_per_s=float(np.median(tps[len(tps) // 2:])) if tps else math.nan,
               val_steps=np.array(sorted(val)), val_loss=np.array([val[s] for s in sorted(val)], dtype=np.float64))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metrics_problem(row) -> str | None:
    """What makes a parsed metrics.jsonl line unusable (None if nothing): an object whose loss or val_loss is a
    number, logged with an integer step."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    logged = [k for k in ("loss", "val_loss") if row.get(k) is not None]
    if logged and not (isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool)):
        return f"{logged[0]} without an integer step"
    if bad := [k for k in logged if not _is_number(row[k])]:
        return f"{bad[0]}={row[bad[0]]!r} is not a number"
    return None


def run_impl(config_path: Path) -> str | None:
    """model.impl of a run's config.yaml; None when the file or the key is absent."""
    return _config_value(config_path, "model", "impl")


# keys that differ between runs of one setting: where it ran, its seed (run-to-run noise), where it logged; and
# SAME_TRAJECTORY's, which decide only what is logged, evaluated and saved (log_every, eval_every, ...) or where data is kept
RUN_IDENTITY = {("trainer", "run_dir"), ("trainer", "seed"), ("trainer", "progress_bar"), ("logger",)}


def run_settings(config_path: Path) -> dict:
    """config.yaml flattened to {"group.key": value}, without RUN_IDENTITY, SAME_TRAJECTORY and what run_program covers
    ({} if absent)."""
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    flat = {}

    def walk(node, path: tuple) -> None:
        if (path in RUN_IDENTITY or path[:1] in RUN_IDENTITY or ".".join(path) in SAME_TRAJECTORY
                or path in (("model", "impl"), ("kernels", "backend"))):
            return
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        else:
            flat[".".join(path)] = node
    walk(config if isinstance(config, dict) else {}, ())
    return flat


def settings_differ(a: "Run", b: "Run") -> list[str]:
    """The config keys (but RUN_IDENTITY) whose values differ between two runs."""
    return sorted(k for k in a.settings.keys() | b.settings.keys() if a.settings.get(k) != b.settings.get(k))


def run_program(config_path: Path) -> str | None:
    """What a run computed with: model.impl, and for coda its kernels.backend (coda on cute and coda on
    the reference are two implementations; eager and liger ignore the backend)."""
    impl = run_impl(config_path)
    backend = _config_value(config_path, "kernels", "backend") if impl == "coda" else None
    return f"{impl}/{backend}" if backend else impl


def _config_value(config_path: Path, group: str, key: str) -> str | None:
    if not config_path.is_file():
        return None
    try:
        config = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as e:
        sys.exit(f"error: {config_path} is not valid YAML ({e}); pass run directories written by train.py")
    section = config.get(group) if isinstance(config, dict) else None
    value = section.get(key) if isinstance(section, dict) else None
    return str(value) if value is not None else None


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    n = np.arange(1, len(y) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def final_loss(run: Run, span: float, steps: np.ndarray | None = None) -> float:
    """Mean training loss over the run's logged steps in its last `span` steps, only at `steps` when given: the same
    step range for runs that log at different intervals (a window counted in logged points would not be), and with
    `steps` the steps every run logged, so runs logged every 10 and every 25 steps average the same steps (each run's
    own points in the range are centred at different steps: on a falling curve, a bias of a part of the slope)."""
    tail = run.steps > run.steps[-1] - span
    if steps is not None:
        tail &= np.isin(run.steps, steps)
    return float(run.loss[tail].mean())


def shared_steps(runs: list[Run]) -> np.ndarray | None:
    """The steps every run logged, where the runs end at the same step (which is then among them); None where they
    end at different steps (each final loss is then its own run's, as the note under the table says)."""
    if len({int(r.steps[-1]) for r in runs}) != 1:
        return None
    return functools.reduce(np.intersect1d, (r.steps for r in runs))


def logged_apart(runs: list[Run], span: float, steps: np.ndarray | None) -> bool:
    """Whether some run logged steps in the final-loss span that another did not (the column then averages fewer
    points than that run logged: its header says so); steps: shared_steps(runs)."""
    return steps is not None and any(not np.isin(r.steps[r.steps > r.steps[-1] - span], steps).all() for r in runs)


def window_span(runs: list[Run], window: int) -> float:
    """The smoothing window in steps: `window` logged points of the run that logs least often, in whole steps (a run
    logged at steps 1, 10, 20 has a median gap of 9.5)."""
    return float(math.ceil(window * max((float(np.median(np.diff(r.steps))) for r in runs if len(r.steps) > 1),
                                         default=1.0)))


def compare(runs: list[Run], window: int, steps: np.ndarray | None) -> list[dict]:
    """One table row per run; |Δ| columns are against runs[0] on the steps both logged; steps: shared_steps(runs),
    where the final train losses are averaged."""
    ref = runs[0]
    span = window_span(runs, window)
    table = []
    for run in runs:
        common, i_ref, i_run = np.intersect1d(ref.steps, run.steps, return_indices=True)
        d_raw = np.abs(run.loss[i_run] - ref.loss[i_ref])
        # smoothed over the common steps only: runs logged every 1 and every 5 steps average the same points
        d_smooth = np.abs(smooth(run.loss[i_run], window) - smooth(ref.loss[i_ref], window))
        tail = common >= common[0] + 0.9 * (common[-1] - common[0]) if len(common) else common
        table.append({
            "run": run.name, "steps": int(run.steps[-1]),
            "final_train_loss": final_loss(run, span, steps),
            "final_val_loss": float(run.val_loss[-1]) if len(run.val_loss) else None,
            "mean_abs_dloss": float(d_raw.mean()) if len(common) else None,
            "max_abs_dloss": float(d_raw.max()) if len(common) else None,
            "mean_abs_dloss_smoothed_last10pct": float(d_smooth[tail].mean()) if len(common) else None,
            "max_abs_dloss_smoothed_last10pct": float(d_smooth[tail].max()) if len(common) else None,
            "tokens_per_s": run.tokens_per_s,
        })
    return table


def unequal_ends(runs: list[Run], run_dirs: list[Path]) -> str | None:
    """The line under the table where the runs end at different steps or one is still training (its run-dir lock
    held): the |Δ| columns then cover only the steps both runs logged so far, and each final loss is its own run's."""
    holders = [lock_holder(run_dir / LOCK_FILE) for run_dir in run_dirs]
    if len({int(r.steps[-1]) for r in runs}) == 1 and not any(holders):
        return None
    ends = "; ".join(f"{run.name} at step {int(run.steps[-1])}" + (f", still training ({holder})" if holder else "")
                     for run, holder in zip(runs, holders))
    return (f"The runs end at different steps or are still training ({ends}): |Δ| compares only the steps "
            "both runs logged, and each final loss is at its own run's last step; compare again once every run has "
            "finished.")


def pairs(runs: list[Run], window: int) -> list[dict]:
    """Every pair of runs: mean and max |Δ| of the smoothed losses over the last 10% of the steps both
    logged, and whether the two runs are of the same model (model.impl, and for coda kernels.backend) run with
    the same settings (all of config.yaml but the run dir, seed, logger and what decides only what is logged, evaluated
    and saved): only such pairs measure run-to-run noise."""
    rows = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            row = compare([a, b], window, shared_steps([a, b]))[1]
            differ = settings_differ(a, b)
            rows.append({"a": a.name, "b": b.name, "settings_differ": differ,
                         "same_model": a.program is not None and a.program == b.program and not differ,
                         "mean_abs_dloss_smoothed_last10pct": row["mean_abs_dloss_smoothed_last10pct"],
                         "max_abs_dloss_smoothed_last10pct": row["max_abs_dloss_smoothed_last10pct"]})
    return rows


def _same(row: dict) -> str:
    """The pair table's 'same model' cell: yes, or no with the settings that differ (up to three)."""
    if row["same_model"]:
        return "yes"
    differ = row.get("settings_differ") or []
    return f"no ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})" if differ else "no"


def pairs_markdown(rows: list[dict]) -> str:
    lines = ["| run | run | same model | mean |Δ| smoothed, last 10% | max |Δ| smoothed, last 10% |",
             "|---|---|---|---:|---:|"]
    lines += [f"| {r['a']} | {r['b']} | {_same(r)} | "
              f"{r['mean_abs_dloss_smoothed_last10pct']:.5f} | {r['max_abs_dloss_smoothed_last10pct']:.5f} |"
              for r in rows if r["mean_abs_dloss_smoothed_last10pct"] is not None]
    # pairs run with other settings measure those too: left out of both summaries
    for same, what in ((True, "same model (run-to-run noise)"), (False, "across models, same settings")):
        m = [r["mean_abs_dloss_smoothed_last10pct"] for r in rows if r["same_model"] == same
             and not r.get("settings_differ") and r["mean_abs_dloss_smoothed_last10pct"] is not None]
        if m:
            lines.append(f"\n{what}: {len(m)} pair{'s' * (len(m) != 1)}, mean |Δ| smoothed over the last 10% "
                         f"{min(m):.5f} to {max(m):.5f} (average {sum(m) / len(m):.5f})")
    if n := sum(bool(r.get("settings_differ")) for r in rows):
        lines.append(f"\n{n} pair{'s' * (n != 1)} run with other settings (in the table above, in neither summary)")
    return "\n".join(lines)


def markdown(table: list[dict], span: float, apart: bool = False) -> str:
    """The runs' table; the train loss column is each run's mean over its last `span` steps (window_span), at the
    steps every run logged where `apart` (logged_apart)."""
    cols = ["run", "steps", "final_train_loss", "final_val_loss", "mean_abs_dloss", "max_abs_dloss",
            "mean_abs_dloss_smoothed_last10pct", "max_abs_dloss_smoothed_last10pct", "tokens_per_s"]
    train = f"train loss (mean of the last {span:g} steps{', at the steps every run logged' if apart else ''})"
    heads = ["run", "steps", train, "val loss", "mean |Δ|", "max |Δ|",
             "mean |Δ| smoothed, last 10%", "max |Δ| smoothed, last 10%", "tokens/s"]

    def fmt(v, column):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if column == "tokens_per_s":  # a rate, whole tokens at any speed (a CPU run's 154, not 154.11784)
            return f"{v:,.0f}"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.5f}"
        return str(v)

    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(fmt(row[c], c) for c in cols) + " |" for row in table]
    return "\n".join(lines)


def plot(runs: list[Run], window: int, x_axis: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xs(run: Run) -> np.ndarray:
        return {"step": run.steps, "tokens": run.tokens, "time": run.elapsed_s}[x_axis]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=x_axis == "step",
                                      gridspec_kw={"height_ratios": [2, 1]})
    for i, run in enumerate(runs):
        color = f"C{i}"
        top.plot(xs(run), run.loss, color=color, alpha=0.25, linewidth=0.7)
        top.plot(xs(run), smooth(run.loss, window), color=color, linewidth=1.8, label=f"{run.name} (smoothed {window})")
        if len(run.val_loss):
            top.plot(run.val_steps if x_axis == "step" else np.interp(run.val_steps, run.steps, xs(run)),
                     run.val_loss, "o--", color=color, markersize=4, label=f"{run.name} validation")
    top.set_ylabel("loss")
    top.set_title("training loss")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    ref = runs[0]
    for i, run in enumerate(runs[1:], start=1):
        common, i_ref, i_run = np.intersect1d(ref.steps, run.steps, return_indices=True)
        x = xs(run)[i_run]
        bottom.plot(x, run.loss[i_run] - ref.loss[i_ref], color=f"C{i}", alpha=0.3, linewidth=0.7)
        # smoothed over the common steps, as compare() does: runs logged at different intervals average the same points
        bottom.plot(x, smooth(run.loss[i_run], window) - smooth(ref.loss[i_ref], window), color=f"C{i}",
                    linewidth=1.8, label=f"{run.name} − {ref.name}")
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.set_ylabel("Δ loss")
    bottom.set_xlabel({"step": "step", "tokens": "tokens", "time": "wall time (s)"}[x_axis])
    if len(runs) > 1:
        bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    palette_png.save(fig, out, dpi=120)
    plt.close(fig)


def not_a_comparison(out: Path) -> Optional[Path]:
    """The first of out (.png) and its .md and .json that exists though they are not an earlier comparison's (its
    .json, this command's, is missing or another file): overwriting it would destroy the user's file. None: free."""
    files = [out, out.with_suffix(".md"), out.with_suffix(".json")]
    try:
        earlier = json.loads(files[2].read_text())
    except (OSError, ValueError):
        earlier = None
    if isinstance(earlier, dict) and {"smooth_window", "runs"} <= set(earlier):
        return None
    return next((f for f in files if f.exists()), None)


def expanded(path: str) -> Path:
    """A path argument with ~ expanded: a shell leaves `--out=~/x` and a quoted "~/x" as they are."""
    return Path(path).expanduser()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=expanded, help="run directories (the first is the reference)")
    p.add_argument("--out", type=expanded, default=None,
                   help="the plot's path, ending in .png; the table is written beside it as .md and .json (same name) "
                        "(default: compare.png beside the first run); files of those names are overwritten only if they "
                        "are an earlier comparison's")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window in logged steps (default: 2%% of the run, at least 1)")
    p.add_argument("--x", choices=["step", "tokens", "time"], default="step", help="x axis of the plot")
    args = p.parse_args(argv)
    if args.smooth < 0:
        p.error(f"--smooth {args.smooth}: the window is a number of logged steps, >= 1 (0: the default)")
    if args.out is not None and args.out.is_dir():
        p.error(f"--out {args.out} is a directory; pass the plot's path in it, e.g. --out {args.out / 'compare.png'}")
    if args.out is not None and args.out.suffix.lower() != ".png":  # the .md and .json go beside it, under its name
        p.error(f"--out {args.out}: the plot is a PNG, so --out ends in .png (e.g. --out {args.out.with_suffix('.png')}); "
                "the table is written beside it as .md and .json")
    run_dirs = [Path(os.path.abspath(d)) for d in args.runs]  # `.` and `..` have no name to call a run by
    runs = [read_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    for run, run_dir in zip(runs, run_dirs):  # two sweeps' job 0 are both "eager (0)": name their sweep too
        if names.count(run.name) > 1:
            run.name = run.name.replace(f"({run_dir.name})", f"({run_dir.parent.name}/{run_dir.name})")
    window = args.smooth or max(1, len(runs[0].steps) // 50)
    out = args.out or run_dirs[0].parent / "compare.png"
    if (foreign := not_a_comparison(out)) is not None:
        p.error(f"{foreign} exists and is not an earlier comparison's output (this command writes {out.name} and the "
                f"{out.stem}.md and {out.stem}.json beside it); choose another --out")
    steps = shared_steps(runs)
    table = compare(runs, window, steps)
    span = window_span(runs, window)
    md = markdown(table, span, logged_apart(runs, span, steps))
    result = {"smooth_window": window, "runs": table}
    if len(runs) >= 3:
        result["pairs"] = pairs(runs, window)
        md += "\n\nEvery pair:\n\n" + pairs_markdown(result["pairs"])
    elif differ := settings_differ(*runs[:2]) if len(runs) == 2 else []:
        result["settings_differ"] = differ
        md += (f"\n\nThe two runs were run with other settings ({', '.join(differ)}): |Δ| measures those too, "
               "not the model alone.")
    if ends_note := unequal_ends(runs, run_dirs):
        result["unequal_ends"] = ends_note
        md += f"\n\n{ends_note}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, window, args.x, out)
        out.with_suffix(".md").write_text(md + "\n")
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        p.error(f"cannot write the comparison to {e.filename or out}: {e.strerror or e}; choose another --out")
    print(md)
    print(f"\nwrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.json')}")
    return table


if __name__ == "__main__":
    main()
