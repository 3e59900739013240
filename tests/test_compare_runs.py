"""CODA (reference backend) and eager trained by one multirun on identical data, seed and initial
weights give the same curve on CPU; compare_runs.py writes the PNG and the table."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def compare_runs_module():
    spec = importlib.util.spec_from_file_location("compare_runs", REPO / "scripts" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_multirun_coda_vs_eager_curves_agree_and_compare_writes_png(tiny, tmp_path):
    sweep = tmp_path / "sweep"
    run = subprocess.run([sys.executable, "train.py", "-m", "model.impl=eager,coda", "kernels.backend=reference",
                          "trainer.compute_dtype=float32", "trainer.max_steps=30", "trainer.ckpt_every=0",
                          f"trainer.run_dir={sweep}", *tiny], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 2
    out = tmp_path / "compare.png"
    cmp = subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, runs), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [row["run"].split()[0] for row in table] == ["eager", "coda"]
    coda = table[1]
    assert coda["steps"] == 30 and coda["max_abs_dloss"] < 1e-4, coda
    assert coda["final_val_loss"] is not None and abs(coda["final_val_loss"] - table[0]["final_val_loss"]) < 1e-4
    assert "| coda" in cmp.stdout and out.with_suffix(".md").read_text().startswith("| run |")


def test_run_name_is_model_impl_read_as_yaml(tmp_path):
    compare_runs = compare_runs_module()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 10.0}) + "\n")
    # flow style, and an `impl:` key outside model that comes first: only model.impl names the run
    (run / "config.yaml").write_text("data: {impl: shadow}\nmodel: {preset: tiny, impl: eager}\n")
    assert compare_runs.read_run(run).name == "eager (run)"
    (run / "config.yaml").write_text("model:\n  preset: tiny\n")
    assert compare_runs.read_run(run).name == "run"
    (run / "config.yaml").unlink()
    assert compare_runs.read_run(run).name == "run"
    (run / "config.yaml").write_text("model: [impl: coda\n")
    with pytest.raises(SystemExit, match="is not valid YAML"):
        compare_runs.read_run(run)


def test_three_runs_or_more_add_every_pair_split_by_model(tmp_path):
    """eager twice and coda once: every pair's smoothed tail difference, with the same-model pairs (the
    run-to-run noise) told apart from the pairs across models."""
    compare_runs = compare_runs_module()
    offsets = {"e0": ("eager", 0.0), "e1": ("eager", 0.01), "c0": ("coda", 0.03)}
    dirs = []
    for name, (impl, offset) in offsets.items():
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - 0.01 * s + offset, "tokens_per_s": 10.0}) + "\n" for s in range(1, 101)))
        (run / "config.yaml").write_text(f"model: {{impl: {impl}}}\n")
        dirs.append(str(run))
    out = tmp_path / "cmp" / "compare.png"
    compare_runs.main([*dirs, "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    got = {(p["a"], p["b"]): (p["same_model"], p["mean_abs_dloss_smoothed_last10pct"]) for p in result["pairs"]}
    assert got.keys() == {("eager (e0)", "eager (e1)"), ("eager (e0)", "coda (c0)"), ("eager (e1)", "coda (c0)")}
    for (a, b), (same, mean) in got.items():
        want = abs(offsets[a[a.index("(") + 1:-1]][1] - offsets[b[b.index("(") + 1:-1]][1])
        assert same == (a.split()[0] == b.split()[0]) and mean == pytest.approx(want, abs=1e-12), (a, b, mean)
    md = out.with_suffix(".md").read_text()
    assert "same model (run-to-run noise): 1 pair," in md and "across models, same settings: 2 pairs" in md
    assert re.search(r"^\| eager \(e0\) \|.* \| 10 \|$", md, re.M), md  # tokens/s in whole tokens, not 10.00000
    # coda on another kernel backend is another implementation, not the same model run again
    (tmp_path / "c0" / "config.yaml").write_text("model: {impl: coda}\nkernels: {backend: reference}\n")
    c1 = tmp_path / "c1"
    c1.mkdir()
    (c1 / "metrics.jsonl").write_text((tmp_path / "c0" / "metrics.jsonl").read_text())
    (c1 / "config.yaml").write_text("model: {impl: coda}\nkernels: {backend: cute}\n")
    compare_runs.main([*dirs, str(c1), "--out", str(tmp_path / "four.png")])
    same = {(p["a"], p["b"]) for p in json.loads((tmp_path / "four.json").read_text())["pairs"] if p["same_model"]}
    assert same == {("eager (e0)", "eager (e1)")}
    # two runs: no pair table (the one pair is the run table's |Δ| row)
    compare_runs.main([*dirs[:2], "--out", str(tmp_path / "two.png")])
    assert "pairs" not in json.loads((tmp_path / "two.json").read_text())


def test_runs_logged_at_other_intervals_and_runs_of_other_settings_are_told_apart(tmp_path):
    """One trajectory logged every step and every 5 steps compares as identical (smoothed on the steps both
    logged); a pair with another learning rate is not counted as run-to-run noise (the differing key is named);
    two sweeps' job dirs of one name get their sweep's name; a metrics line cut short at the end is left out."""
    compare_runs = compare_runs_module()
    loss = {s: 5.0 - 0.01 * s + 0.05 * (s % 7) for s in range(1, 201)}

    def run(path: Path, every: int, lr: float, cut: bool = False) -> str:
        path.mkdir(parents=True)
        lines = "".join(json.dumps({"step": s, "loss": loss[s]}) + "\n" for s in loss if s % every == 0)
        (path / "metrics.jsonl").write_text(lines + ('{"step": 201, "loss": 3.' if cut else ""))
        (path / "config.yaml").write_text(f"model: {{impl: eager}}\noptim: {{lr: {lr}}}\n"
                                          f"trainer: {{seed: {every}, log_every: {every}, eval_every: {10 * every}}}\n")
        return str(path)

    dirs = [run(tmp_path / "a" / "0", 1, 3e-4, cut=True), run(tmp_path / "b" / "0", 5, 3e-4), run(tmp_path / "c" / "0", 1, 1e-3)]
    out = tmp_path / "cmp.png"
    compare_runs.main([*dirs, "--out", str(out), "--smooth", "5"])
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["run"] for r in result["runs"]] == ["eager (a/0)", "eager (b/0)", "eager (c/0)"]
    assert result["runs"][1]["mean_abs_dloss_smoothed_last10pct"] == 0.0
    a, b = (r["final_train_loss"] for r in result["runs"][:2])  # both the mean over the last 25 steps, at the steps all logged
    assert a == b == pytest.approx(np.mean([loss[s] for s in range(180, 201, 5)]))
    with pytest.raises(SystemExit):
        compare_runs.main([*dirs, "--out", str(out), "--smooth", "-3"])
    by_pair = {(p["a"], p["b"]): p for p in result["pairs"]}
    assert by_pair[("eager (a/0)", "eager (b/0)")]["same_model"]  # another seed, log_every, eval_every: the same setting
    lr_pair = by_pair[("eager (a/0)", "eager (c/0)")]
    assert not lr_pair["same_model"] and lr_pair["settings_differ"] == ["optim.lr"]
    md = out.with_suffix(".md").read_text()
    assert "train loss (mean of the last 25 steps, at the steps every run logged)" in md  # 5 points of each run
    assert "| eager (a/0) | eager (c/0) | no (optim.lr) |" in md
    # the other-lr pairs are in neither summary: not noise, and not a model difference alone
    assert "same model (run-to-run noise): 1 pair," in md and "across models" not in md
    assert "2 pairs run with other settings (in the table above, in neither summary)" in md
    compare_runs.main([dirs[0], dirs[2], "--out", str(tmp_path / "two.png")])  # two runs: said under the table
    assert ("The two runs were run with other settings (optim.lr): |Δ| measures those too, not the model alone."
            in (tmp_path / "two.md").read_text())
    assert json.loads((tmp_path / "two.json").read_text())["settings_differ"] == ["optim.lr"]


def test_bad_out_paths_and_metrics_lines_are_clear_errors(tmp_path, capsys):
    """--out is the plot's .png path (a directory or report.md would be overwritten or refused with a traceback),
    and a JSON line that is not a metrics object names its file and line."""
    compare_runs = compare_runs_module()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.01 * s}) + "\n" for s in range(1, 11)))
    for out, named in ((tmp_path, "is a directory; pass the plot's path in it"), (tmp_path / "report.md", "ends in .png")):
        with pytest.raises(SystemExit):
            compare_runs.main([str(run), "--out", str(out)])
        assert named in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # files of the user's where the outputs would go are refused, untouched; an earlier comparison is overwritten
    (tmp_path / "notes.md").write_text("my notes\n")
    (tmp_path / "file").write_text("not a directory")
    for out, named in ((tmp_path / "notes.png", f"{tmp_path / 'notes.md'} exists and is not an earlier comparison's"),
                       (tmp_path / "file" / "c.png", f"cannot write the comparison to {tmp_path / 'file'}")):
        with pytest.raises(SystemExit):
            compare_runs.main([str(run), "--out", str(out)])
        assert named in capsys.readouterr().err
    assert (tmp_path / "notes.md").read_text() == "my notes\n" and not (tmp_path / "notes.png").exists()
    compare_runs.main([str(run), "--out", str(tmp_path / "c.png")])
    compare_runs.main([str(run), "--out", str(tmp_path / "c.png")])  # its own earlier output: written again
    assert {"c.png", "c.md", "c.json"} <= {p.name for p in tmp_path.iterdir()}
    good = (run / "metrics.jsonl").read_text()
    for line, named in (("5", "a JSON int, not an object"), ('{"loss": 1.0}', "loss without an integer step"),
                        ('{"step": 11, "loss": "low"}', "loss='low' is not a number")):
        (run / "metrics.jsonl").write_text(good + line + "\n" + good)
        with pytest.raises(SystemExit, match=rf"{run / 'metrics.jsonl'}:11 is not a metrics line of train.py \({named}\)"):
            compare_runs.read_run(run)


def test_a_run_still_training_or_ending_early_is_named_under_the_table(tmp_path):
    """A run in progress (its run-dir lock held) or stopped early compares on its steps so far only: the table says
    so, naming each run's last step, instead of reading as a comparison of whole runs."""
    from coda_train.durable import exclusive_lock

    compare_runs = compare_runs_module()
    dirs = []
    for name, steps in (("done", 20), ("live", 5)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.01 * s}) + "\n"
                                                   for s in range(1, steps + 1)))
        dirs.append(str(run))
    with exclusive_lock(tmp_path / "live" / ".lock", wait=False):
        compare_runs.main([*dirs, "--out", str(tmp_path / "live.png")])
    note = json.loads((tmp_path / "live.json").read_text())["unequal_ends"]
    assert "done at step 20; live at step 5, still training (pid " in note and note in (tmp_path / "live.md").read_text()
    compare_runs.main([*dirs, "--out", str(tmp_path / "stopped.png")])  # lock released: ended early, not training
    assert "done at step 20; live at step 5):" in json.loads((tmp_path / "stopped.json").read_text())["unequal_ends"]
    compare_runs.main([dirs[0], dirs[0], "--out", str(tmp_path / "same.png")])
    assert "unequal_ends" not in json.loads((tmp_path / "same.json").read_text())


def test_a_multirun_sweep_dir_names_its_jobs_run_dirs(tmp_path, capsys):
    compare_runs = compare_runs_module()
    for job in ("0", "1"):
        (tmp_path / job).mkdir()
        (tmp_path / job / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path} is a multirun sweep, not one run; pass its jobs' run "
                                                   f"dirs: {tmp_path / '0'} {tmp_path / '1'}")):
        compare_runs.read_run(tmp_path)


def test_a_run_that_stopped_before_its_first_step_says_so(tmp_path):
    """A run dir train.py made but logged no step in (it stopped on a bad setting) is named as such, pointing at its
    train.log, and one still starting (its lock held) as that, not as a directory train.py did not write."""
    from coda_train.durable import exclusive_lock

    compare_runs = compare_runs_module()
    (tmp_path / "train.log").write_text("[ERROR] - model.init_from=/x has vocab_size=8192, fewer than ...\n")
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path} has no metrics.jsonl: its run stopped before logging a "
                                                   f"step ({tmp_path / 'train.log'} says why)")):
        compare_runs.read_run(tmp_path)
    with exclusive_lock(tmp_path / ".lock", wait=False):  # still starting: not stopped
        with pytest.raises(SystemExit, match=re.escape(f"{tmp_path} has no metrics.jsonl yet: its run (pid ")):
            compare_runs.read_run(tmp_path)


def test_a_run_given_as_dot_is_named_by_its_directory(tmp_path, monkeypatch):
    """`compare_runs.py . ../other` from inside a run dir: the run is called by its directory's name (was "eager ()"),
    and the default output goes beside it, not into it."""
    compare_runs = compare_runs_module()
    for name in ("mine", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
        (tmp_path / name / "config.yaml").write_text("model: {impl: eager}\n")
    monkeypatch.chdir(tmp_path / "mine")
    assert [row["run"] for row in compare_runs.main([".", "../other"])] == ["eager (mine)", "eager (other)"]
    assert (tmp_path / "compare.json").is_file() and not (tmp_path / "mine" / "compare.json").exists()


def test_final_losses_of_runs_logged_at_other_intervals_average_the_same_steps(tmp_path):
    """One falling curve logged every 10 and every 25 steps: each run's own points in the last 250 steps are centred at
    other steps (880 and 887.5), so the final losses differed by 0.0075 on a curve that is the same; they are now the
    mean at the steps both logged. Runs logged at the same steps keep every point (the header says nothing more)."""
    compare_runs = compare_runs_module()

    def run(name: str, every: int) -> str:
        path = tmp_path / name
        path.mkdir()
        path.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - 0.001 * s}) + "\n" for s in range(every, 1001, every)))
        return str(path)

    ten, twenty_five = run("ten", 10), run("twenty_five", 25)
    rows = compare_runs.main([ten, twenty_five, "--out", str(tmp_path / "cmp.png"), "--smooth", "10"])
    assert rows[0]["final_train_loss"] == rows[1]["final_train_loss"] == pytest.approx(5.0 - 0.001 * 900)  # 800 to 1000, every 50
    assert "train loss (mean of the last 250 steps, at the steps every run logged)" in (tmp_path / "cmp.md").read_text()
    rows = compare_runs.main([ten, ten, "--out", str(tmp_path / "same.png"), "--smooth", "10"])
    assert rows[0]["final_train_loss"] == pytest.approx(5.0 - 0.001 * 955)  # 910 to 1000, every 10
    assert "train loss (mean of the last 100 steps) |" in (tmp_path / "same.md").read_text()


def test_a_line_with_a_null_loss_is_no_training_step(tmp_path):
    """Another tool's metrics may log validation on its own line with "loss": null: that line gives the val loss
    only; taken as a training step its NaN loss blanked the final loss and every |Δ| column."""
    compare_runs = compare_runs_module()
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 6)] + [{"step": 5, "loss": None, "val_loss": 4.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    read = compare_runs.read_run(run)
    assert list(read.steps) == [1, 2, 3, 4, 5] and not np.isnan(read.loss).any()
    assert list(read.val_steps) == [5] and list(read.val_loss) == [4.0]
    row = compare_runs.compare([read, read], 1, compare_runs.shared_steps([read, read]))[1]
    assert row["final_train_loss"] == pytest.approx(4.5) and row["mean_abs_dloss"] == 0.0


def test_paths_starting_with_a_tilde_are_under_home(tmp_path, monkeypatch):
    """A shell leaves `--out=~/cmp.png` as it is: the comparison went to a folder named '~' in the working directory,
    and a run dir given as "~/runs/a" was said not to be found."""
    compare_runs = compare_runs_module()
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "cwd")
    compare_runs.main(["~/runs/a", "~/runs/b", "--out=~/cmp/c.png"])
    assert (tmp_path / "cmp" / "c.json").is_file() and not (tmp_path / "cwd" / "~").exists()


def test_the_final_loss_span_is_whole_steps():
    """A run logged at steps 1, 10, 20 (the first log, then every 10) has a median gap of 9.5: the table's train-loss
    column spans whole steps ("the last 10 steps", not 9.5)."""
    compare_runs = compare_runs_module()
    steps = np.array([1, 10, 20])
    run = compare_runs.Run("a", "eager", {}, steps, np.ones(3), steps * 8, steps * 0.1, 1.0, np.array([]), np.array([]))
    assert compare_runs.window_span([run], 1) == 10.0
    assert compare_runs.window_span([run], 3) == 29.0  # 28.5 steps
