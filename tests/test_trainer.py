"""The trainer end to end on CPU: train.py subprocesses where the process matters (kills, signals,
exit codes, multirun), in-process train() for the bad-input errors. One tiny corpus for all."""

from __future__ import annotations

import copy
import dataclasses
import errno
import importlib.util
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from coda_train.config import register_configs, to_dataclass
from coda_train.data import DataError, prepare
from coda_train.errors import ConfigError
from coda_train.kernels import BackendError
from coda_train.model import LlamaConfig
from coda_train.trainer.build import build_loader, build_train_state, resolve_model
from coda_train.trainer.checkpoint import (CheckpointError, check_same_model, find_resume_checkpoint, list_checkpoints,
                                           load_state, resumes, verify_checkpoint)
from coda_train.trainer.distributed import World
from coda_train.trainer.loop import train
from coda_train.trainer.metrics import metrics_line, mfu
from coda_train.trainer.step import NonFiniteError, StepResult, TrainStep

REPO = Path(__file__).resolve().parents[1]
TIMING_KEYS = {"tokens_per_s", "elapsed_s"}  # wall-clock metrics; everything else must match exactly
N = 24  # steps of the resume tests; checkpoints every N/4, so N/2 is one


def run_train(*overrides: str, timeout: float = 120, hook: str = "", tmp_path: Path | None = None) -> subprocess.CompletedProcess:
    """train.py with these overrides; `hook`: the source of a sitecustomize.py (written under tmp_path) that the
    process imports first, to patch what a test needs to happen inside the run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if hook:
        (tmp_path / "hooks").mkdir()
        (tmp_path / "hooks" / "sitecustomize.py").write_text(hook)
        env["PYTHONPATH"] = f"{tmp_path / 'hooks'}:{REPO}"
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def compose_config(run_dir: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_dataclass(compose("config", overrides=[f"trainer.run_dir={run_dir}", *overrides]))


def train_in_process(run_dir: Path, *overrides: str):
    return train(compose_config(run_dir, *overrides), run_dir)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timing(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


def optimizer_tensors(optimizer) -> dict:
    """Copies of every optimizer state tensor (moments, step counts), keyed by (param index, name)."""
    return {(i, name): t.clone() for i, s in optimizer.state_dict()["state"].items() for name, t in s.items()}


def snapshot(path: Path) -> dict[str, bytes]:
    """The run's files, but .lock and train.log: every attempt on the dir writes its PID and log lines there."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in (".lock", "train.log")}


@pytest.fixture(scope="session")
def straight_run(tiny, tmp_path_factory) -> Path:
    """N steps in one uninterrupted process: the reference the interrupted runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train(*tiny, f"trainer.run_dir={run_dir}", f"trainer.max_steps={N}", f"trainer.ckpt_every={N // 4}",
                       "trainer.keep_last=2")
    assert result.returncode == 0, result.stderr
    return run_dir


def test_loss_falls_for_both_impls_in_a_multirun(tiny, tmp_path):
    result = run_train("-m", *tiny, "model.impl=coda,eager", "trainer.max_steps=40", "trainer.eval_every=20",
                       f"trainer.run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    first_losses = []
    for job, impl in ((0, "coda"), (1, "eager")):
        lines = metrics(tmp_path / str(job))
        assert (tmp_path / str(job) / "config.yaml").read_text().count(f"impl: {impl}") == 1
        assert [m["step"] for m in lines] == list(range(1, 41))
        assert lines[-1]["loss"] < lines[0]["loss"] - 1.0, (impl, lines[0]["loss"], lines[-1]["loss"])
        assert lines[-1]["val_loss"] < lines[19]["val_loss"]
        first_losses.append(lines[0]["loss"])
    # same seed -> same initial weights and batches, so both impls start from the same loss
    assert first_losses[0] == pytest.approx(first_losses[1], abs=1e-4)


def test_a_multirun_job_that_diverges_or_has_bad_input_does_not_stop_the_sweep(tiny, tmp_path):
    """An lr sweep whose largest lr diverges (exit 3) and jobs whose input fails past the config checks (the Liger
    baseline on a CPU machine, exit 1): the other jobs run, and train.py exits with the first failed job's code,
    naming each failed job. (A bad config value stops the sweep before its first job: see below.)"""
    result = run_train("-m", *tiny, "trainer.max_steps=6", "optim.warmup_steps=1", "optim.grad_clip=0",
                       "optim.lr=1e-3,1e9", "model.impl=eager,liger", f"trainer.run_dir={tmp_path}", timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(metrics(tmp_path / "0")) == 6
    assert f"multirun job #1 ({tmp_path / '1'}) stopped with exit code 1" in result.stderr
    assert f"multirun job #2 ({tmp_path / '2'}) stopped with exit code 3 (its reason is logged above)" in result.stderr
    assert f"multirun job #3 ({tmp_path / '3'}) stopped with exit code 1" in result.stderr
    assert "loss=nan" in result.stderr + result.stdout


def test_train_state_round_trip_takes_the_same_next_steps(tiny, tmp_path):
    """A fresh TrainState loaded from another's state_dict (through torch.save, as a checkpoint)
    takes the same next steps bit for bit and continues the saved RNGs (python, numpy, torch); a
    non-finite step changes no weight and no counter."""
    cfg = compose_config(tmp_path, *tiny, "trainer.grad_accum_steps=2")
    cpu, world = torch.device("cpu"), World()
    data = prepare(cfg.data)
    llama = resolve_model(cfg, data.vocab_size, "reference")

    def fresh_state():
        return build_train_state(cfg, llama, build_loader(data, "train", cfg.trainer, world), "reference", cpu, torch.float32, world)

    def steps(state, n):
        train_step = TrainStep(state, state.model, world, cpu, 2, cfg.optim.grad_clip)
        return [train_step.read(train_step()) for _ in range(n)]

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(()).item()

    saving = fresh_state()
    steps(saving, 3)
    draws()  # the RNGs saved below are past where the seed (which fresh_state sets again) puts them
    buffer = io.BytesIO()
    torch.save(saving.state_dict(), buffer)
    expected, expected_draws = steps(saving, 3), draws()
    loaded = fresh_state()
    loaded.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert steps(loaded, 3) == expected and expected[-1].step == 6
    assert draws() == expected_draws
    assert (loaded.step, loaded.tokens) == (saving.step, saving.tokens) == (6, 6 * 2 * 4 * 32)
    for name, tensor in saving.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name

    weights = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    moments = optimizer_tensors(loaded.optimizer)
    with pytest.raises(NonFiniteError, match="step 7: loss=nan"):
        TrainStep(loaded, loaded.model, world, cpu, 2, cfg.optim.grad_clip)(poison_loss=True)
    assert (loaded.step, loaded.tokens, loaded.scheduler.last_epoch) == (6, 6 * 2 * 4 * 32, 6)
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in weights.items())
    now = optimizer_tensors(loaded.optimizer)
    assert now.keys() == moments.keys() and all(torch.equal(now[k], v) for k, v in moments.items())  # step counts too


def test_metrics_line_carries_mfu_only_where_measured():
    result = StepResult(step=3, loss=2.5, lr=1e-3, grad_norm=0.75, tokens=256)
    assert metrics_line(result, 768, 100.0, 7.5) == {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75,
                                                      "tokens": 768, "tokens_per_s": 100.0, "elapsed_s": 7.5}
    # 1000 tokens/s x 1e9 FLOPs per token on 2 GPUs of 1e12 peak each: half the peak
    assert metrics_line(result, 768, 1000.0, 7.5, mfu(1000.0, 1e9, 1e12, 2))["mfu"] == 0.5


def test_run_dir_holds_config_metrics_and_last_k_checkpoints(straight_run):
    lines = metrics(straight_run)
    assert [m["step"] for m in lines] == list(range(1, N + 1))
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"} <= set(lines[0])
    assert [m["step"] for m in lines if "val_loss" in m] == [6, 12, 18, 24]
    assert lines[-1]["tokens"] == N * 4 * 32
    assert "resolved_model" in (straight_run / "config.yaml").read_text()
    assert [p.name for p in list_checkpoints(straight_run / "checkpoints")] == ["step_00000024", "step_00000018"]


def test_resume_after_sigkill_is_exact(tiny, straight_run, tmp_path):
    common = [*tiny, f"trainer.run_dir={tmp_path}", f"trainer.max_steps={N}", f"trainer.ckpt_every={N // 4}", "trainer.keep_last=2"]
    killed = run_train(*common, "debug.sigkill_after_step=14")  # checkpoint at 12 = N/2, then 2 more steps
    assert killed.returncode == -signal.SIGKILL
    assert metrics(tmp_path)[-1]["step"] == 14
    resumed = run_train(*common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr + resumed.stdout and "step_00000012" in resumed.stderr + resumed.stdout
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(straight_run))
    final, reference = (load_state(d / "checkpoints" / f"step_{N:08d}") for d in (tmp_path, straight_run))
    for name, tensor in reference["model"].items():
        assert torch.equal(final["model"][name], tensor), name
    assert final["optimizer"]["state"][0]["exp_avg_sq"].equal(reference["optimizer"]["state"][0]["exp_avg_sq"])


def test_resume_from_an_older_checkpoint_with_a_new_lr(tiny, straight_run, tmp_path):
    """The config's optim.lr wins over the checkpoint's, and the newer checkpoints of the abandoned
    trajectory are set aside (not deleted; with keep_last=3 the set-aside one still fits at the end)."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    older = run_dir / "checkpoints" / f"step_{3 * N // 4:08d}"
    result = run_train(*tiny, f"trainer.run_dir={run_dir}", f"trainer.max_steps={N}", f"trainer.ckpt_every={N // 4}",
                       "trainer.keep_last=3", f"trainer.resume={older}", "optim.lr=1e-3")  # default 3e-3
    assert result.returncode == 0, result.stderr
    lines, reference = metrics(run_dir), metrics(straight_run)
    assert lines[:3 * N // 4] == reference[:3 * N // 4]
    assert all(new["lr"] == pytest.approx(old["lr"] / 3) for new, old in zip(lines[3 * N // 4:], reference[3 * N // 4:]))
    assert f"settings changed since the checkpoint apply from step {3 * N // 4 + 1} on: optim.lr 0.003 -> 0.001" in result.stdout
    assert len(list((run_dir / "checkpoints").glob(f".replaced-step_{N:08d}-*"))) == 1
    (abandoned,) = run_dir.glob(f"metrics.replaced-step_{3 * N // 4:08d}-*.jsonl")  # the other trajectory's metrics kept
    assert [json.loads(line) for line in abandoned.read_text().splitlines()] == reference[3 * N // 4:]
    final = load_state(run_dir / "checkpoints" / f"step_{N:08d}")
    assert not torch.equal(final["model"]["norm"], load_state(straight_run / "checkpoints" / f"step_{N:08d}")["model"]["norm"])


def test_crash_during_checkpoint_write_keeps_previous_and_auto_resumes_it(tiny, straight_run, tmp_path):
    common = [*tiny, f"trainer.run_dir={tmp_path}", f"trainer.max_steps={N}", f"trainer.ckpt_every={N // 4}"]
    crashed = run_train(*common, "debug.sigkill_in_checkpoint_at_step=18")
    assert crashed.returncode == -signal.SIGKILL
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000012", "step_00000006"]
    partial = list(ckpts.glob(".tmp-step_00000018-*"))
    assert len(partial) == 1 and (partial[0] / "state.pt").exists() and not (partial[0] / "meta.json").exists()
    verify_checkpoint(ckpts / "step_00000012")
    resumed = run_train(*common)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000012 (step 12)" in resumed.stderr + resumed.stdout
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(straight_run))


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_saves_a_resumable_checkpoint(tiny, tmp_path, stop_signal):
    proc = subprocess.Popen([sys.executable, "train.py", *tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=100000",
                             "trainer.ckpt_every=0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 90
    metrics_file = tmp_path / "metrics.jsonl"
    while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 3):  # 3 steps done, handler installed
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.2)
    proc.send_signal(stop_signal)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert f"received {stop_signal.name}" in output
    assert f"to continue, run the same command with trainer.run_dir={tmp_path.resolve()}" in output
    (saved,) = list_checkpoints(tmp_path / "checkpoints")
    step = int(saved.name.removeprefix("step_"))
    assert step >= 3 and verify_checkpoint(saved)["step"] == step
    last = train_in_process(tmp_path, *tiny, f"trainer.max_steps={step + 2}", "trainer.ckpt_every=0").metrics
    assert last["step"] == step + 2
    assert [m["step"] for m in metrics(tmp_path)][-3:] == [step, step + 1, step + 2]


def test_a_repeated_sigterm_does_not_cut_the_stop_short():
    """SIGTERM often comes twice: a scheduler (Slurm, systemd) signals every process, and torchrun forwards the one it
    gets to its workers. The second must not end a worker at once (no checkpoint, the other ranks' collectives cut);
    a second Ctrl-C (SIGINT) still does. Signals to itself in a child, whose death is the failure; raise_signal runs
    each handler before it returns (two os.kill calls could land on torch's threads and merge into one signal)."""
    code = ("import signal\n"
            "from coda_train.trainer.loop import StopSignal\n"
            "stop = StopSignal()\n"
            "for _ in range(2):\n"
            "    signal.raise_signal(signal.SIGTERM)\n"
            "print('stopping on', signal.Signals(stop.received).name)\n"
            "signal.raise_signal(signal.SIGINT)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "stopping on SIGTERM\n", (result.returncode, result.stderr)
    twice = subprocess.run([sys.executable, "-c", code.replace("SIGTERM", "SIGINT")], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert twice.returncode != 0 and "KeyboardInterrupt" in twice.stderr and not twice.stdout


def test_ctrl_c_again_while_the_stop_is_saving_waits_for_the_checkpoint(tiny, tmp_path):
    """A second Ctrl-C that lands while the first one's checkpoint is written (here: between state.pt and meta.json, by
    a sitecustomize) is said in one line and the save completes: it raised KeyboardInterrupt there, which ended the run
    with a traceback and without that checkpoint."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, signal\n"
        "from coda_train.trainer import checkpoint\n"
        "real = checkpoint.save_checkpoint\n"
        "def save_checkpoint(root, step, state, meta, keep_last, before_meta=None, full_after=None):\n"
        "    again = lambda: os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(root, step, state, meta, keep_last, again, full_after)\n"
        "checkpoint.save_checkpoint = save_checkpoint\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *tiny, f"trainer.run_dir={run_dir}", "trainer.max_steps=100000",
                             "trainer.ckpt_every=0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": f"{hooks}:{REPO}"})
    deadline = time.time() + 90
    metrics_file = run_dir / "metrics.jsonl"
    while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]
    (saved,) = list_checkpoints(run_dir / "checkpoints")
    assert output.count(f"Ctrl-C again: the checkpoint of step {verify_checkpoint(saved)['step']} is being written") == 1
    assert "received SIGINT" in output and not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_a_crash_in_native_code_prints_the_python_stack(tiny, tmp_path):
    """A segfault inside a training step (here: a sitecustomize makes the loader read address 0) prints where Python
    was, from faulthandler: it printed nothing but the shell's "Segmentation fault"."""
    hook = ("import ctypes\n"
            "from coda_train.data import loader\n"
            "def next_batch(self):\n"
            "    return ctypes.string_at(0)\n"
            "loader.TokenLoader.next_batch = next_batch\n")
    result = run_train(*tiny, f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2", hook=hook, tmp_path=tmp_path)
    assert result.returncode == -signal.SIGSEGV, result.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in result.stderr, result.stderr[-3000:]
    assert f'File "{tmp_path / "hooks" / "sitecustomize.py"}", line 4 in next_batch' in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("raised, code", [("DataError('shard cut short')", 1), ("RuntimeError('a bug')", 1)])
def test_a_run_stopped_by_an_error_mid_run_is_not_logged_as_finished(tiny, tmp_path, raised, code):
    """The metrics logger (wandb's finish status) gets train.py's exit code when a step raises: it got 0, a finished
    run, for every stop but a non-finite loss and an out-of-memory one (here a sitecustomize raises at the 3rd batch)."""
    hook = ("from coda_train.data import loader, DataError\n"
            "from coda_train.trainer import metrics\n"
            "real_next, real_close = loader.TokenLoader.next_batch, metrics.MetricsLogger.close\n"
            "def next_batch(self):\n"
            f"    if self.split == 'train' and self.step == 2: raise {raised}\n"
            "    return real_next(self)\n"
            "def close(self, exit_code=0):\n"
            "    print('metrics logger closed with exit code', exit_code, flush=True)\n"
            "    return real_close(self, exit_code)\n"
            "loader.TokenLoader.next_batch, metrics.MetricsLogger.close = next_batch, close\n")
    result = run_train(*tiny, f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=5", hook=hook, tmp_path=tmp_path)
    assert result.returncode == code, result.stderr[-3000:]
    assert f"metrics logger closed with exit code {code}" in result.stdout, result.stdout[-3000:]


def test_a_stop_signal_ends_a_multirun_sweep_too(tiny, tmp_path):
    """SIGTERM/SIGINT saves and exits 0 from the whole sweep: the next job does not start."""
    result = run_train("-m", *tiny, "model.impl=eager,coda", "trainer.max_steps=100", "trainer.ckpt_every=0",
                       "debug.sigterm_after_step=3", f"trainer.run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "received SIGTERM" in result.stdout + result.stderr
    # the whole sweep again continues it: its own -m command with a job's dir would nest a new sweep there
    assert f"run the same multirun command with trainer.run_dir={tmp_path.resolve()} (each job" in result.stdout + result.stderr
    assert [p.name for p in list_checkpoints(tmp_path / "0" / "checkpoints")] == ["step_00000003"]
    assert not (tmp_path / "1").exists()


def test_a_bad_value_in_a_sweeps_later_job_stops_the_sweep_before_its_first_job(tiny, tmp_path):
    """Every job's config is checked before the first job trains: a typo in the last value costs nothing."""
    result = run_train("-m", *tiny, "optim.lr=1e-3,-1", "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'sweep'}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "multirun job #1 (" in result.stderr and "optim.lr=-1.0 must be > 0; no job of the sweep ran" in result.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_glob_sweep_is_checked_before_its_first_job_and_one_matching_nothing_is_refused(tmp_path):
    """glob(...) expands to its group's options in the check of every job, as hydra's sweeper expands it (the check
    skipped glob sweeps, so each job was refused only at its own start, after the ones before it trained); a glob
    matching no option stops with exit 1 (hydra launched no job, exited 0 and left a sweep dir)."""
    refused = run_train("-m", "model=glob(tin*)", "optim.lr=-1", f"trainer.run_dir={tmp_path / 'sweep'}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert ("multirun job #0 (model=tiny optim.lr=-1 " in refused.stderr
            and "optim.lr=-1.0 must be > 0; no job of the sweep ran" in refused.stderr), refused.stderr
    empty = run_train("-m", "model=glob(nope*)", f"trainer.run_dir={tmp_path / 'sweep'}")
    assert empty.returncode == 1 and "model=glob(nope*) matches no option of its group" in empty.stderr, empty.stderr
    assert not (tmp_path / "sweep").exists()


def test_cfg_job_checks_the_values_it_would_print(tmp_path):
    """`--cfg job` shows the config a run would take: a value the run would refuse stops it with the run's message
    (it printed optim.lr=nan and an unknown +key, and exited 0); a good config still prints whole."""
    for override, said in [("optim.lr=nan", "optim.lr=nan is not a finite number"),
                           ("trainer.progress_bar=yes", "trainer.progress_bar='yes' is not a boolean"),
                           ("+trainer.max_step=3", "unknown config keys ['trainer.max_step']"),
                           # refused by any launch's start (one process, or DDP under torchrun): it printed and exited 0
                           ("trainer.parallel=ddp trainer.ckpt_async=true", "this run uses trainer.parallel=ddp")]:
        refused = run_train("--cfg", "job", *override.split(), f"trainer.run_dir={tmp_path / 'run'}")
        assert refused.returncode == 1 and refused.stdout == "", (override, refused.stdout + refused.stderr)
        assert said in refused.stderr and "--cfg prints the config once that is fixed" in refused.stderr, refused.stderr
    shown = run_train("-c", "job", "optim.lr=2e-3", f"trainer.run_dir={tmp_path / 'run'}")
    assert shown.returncode == 0 and "lr: 0.002" in shown.stdout, shown.stderr
    # with trainer.parallel=auto the launch decides (FSDP2 under torchrun runs it), as it decides whether cute runs
    shown = run_train("-c", "job", "trainer.ckpt_async=true", f"trainer.run_dir={tmp_path / 'run'}")
    assert shown.returncode == 0 and "ckpt_async: true" in shown.stdout, shown.stderr
    assert not (tmp_path / "run").exists()


def test_cfg_job_and_a_sweep_check_the_model_shape_as_a_run_does(tmp_path):
    """The model checks a run makes before its data (head/dim divisibility, trainer.seq_len against max_seq_len) stop
    `--cfg job` and a sweep before its first job too: --cfg printed model.n_heads=3 and exited 0, and a sweep trained
    every job before the one that a run refuses."""
    for override, said in [("model.n_heads=3", "n_heads=3 must divide dim=256"),
                           ("trainer.seq_len=100000", "trainer.seq_len=100000 exceeds the model's max_seq_len=256")]:
        refused = run_train("--cfg", "job", override, f"trainer.run_dir={tmp_path / 'run'}")
        assert refused.returncode == 1 and refused.stdout == "", (override, refused.stdout + refused.stderr)
        assert said in refused.stderr and "--cfg prints the config once that is fixed" in refused.stderr, refused.stderr
    refused = run_train("--cfg", "job", "kernels.backend=cute", "trainer.device=cpu", f"trainer.run_dir={tmp_path / 'run'}")
    assert refused.returncode == 1 and "kernels.backend=cute runs its kernels on the GPU" in refused.stderr, refused.stderr
    # the cute kernels compute in bfloat16 only: a sweep over compute_dtype trained job 0 before job 1 was refused
    refused = run_train("--cfg", "job", "kernels.backend=cute", "trainer.compute_dtype=float32", f"trainer.run_dir={tmp_path / 'run'}")
    assert refused.returncode == 1 and "compute in bfloat16 only" in refused.stderr, refused.stderr
    sweep = run_train("-m", "model.n_heads=4,3", "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'sweep'}")
    assert sweep.returncode == 1, sweep.stdout + sweep.stderr
    assert "multirun job #1 (" in sweep.stderr and "n_heads=3 must divide dim=256" in sweep.stderr, sweep.stderr
    assert "no job of the sweep ran" in sweep.stderr and not (tmp_path / "sweep").exists()
    assert not (tmp_path / "run").exists()


def test_cfg_job_and_a_sweep_resolve_hydra_interpolations_as_a_run_does(tmp_path):
    """${hydra:...} (the run's cwd, job name, job number, output dir) resolves in a run, so `--cfg job` and a sweep's
    check of its jobs take it too: both stopped on it (HydraConfig was not set) before any job ran."""
    hydra_values = ("data.cache_dir=${hydra:runtime.cwd}/data_cache", "logger.run_name=${hydra:job.name}-${hydra:job.num}",
                    "logger.project=${hydra:runtime.output_dir}")
    shown = run_train("--cfg", "job", *hydra_values[::2], f"trainer.run_dir={tmp_path / 'run'}")
    assert shown.returncode == 0 and "cache_dir: ${hydra:runtime.cwd}/data_cache" in shown.stdout, shown.stderr
    sweep = run_train("-m", *hydra_values, "optim.lr=1e-3,-1", f"trainer.run_dir={tmp_path / 'sweep'}")
    assert sweep.returncode == 1 and "Traceback" not in sweep.stderr, sweep.stderr
    assert "multirun job #1 (" in sweep.stderr and "optim.lr=-1.0 must be > 0; no job of the sweep ran" in sweep.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


def test_a_run_dir_naming_the_run_s_cwd_is_taken_by_every_start(tiny, tmp_path):
    """trainer.run_dir=${hydra:runtime.cwd}/... resolves in hydra's own run, so the checks before hydra take it too
    (the run-dir check resolved it before hydra's config was set, and refused it)."""
    run_dir = "${hydra:runtime.cwd}/" + os.path.relpath(tmp_path, REPO)
    shown = run_train("--cfg", "job", f"trainer.run_dir={run_dir}/run")
    assert shown.returncode == 0, shown.stderr
    ran = run_train(*tiny, f"trainer.run_dir={run_dir}/run", "trainer.max_steps=1", "trainer.eval_every=0")
    assert ran.returncode == 0 and (tmp_path / "run" / "metrics.jsonl").is_file(), ran.stderr
    swept = run_train("-m", *tiny, f"trainer.run_dir={run_dir}/sweep", "trainer.max_steps=1", "trainer.eval_every=0",
                      "optim.lr=1e-3,2e-3")
    assert swept.returncode == 0 and all((tmp_path / "sweep" / str(i) / "metrics.jsonl").is_file() for i in (0, 1)), \
        swept.stderr


def test_a_run_dir_interpolation_that_cannot_be_resolved_stops_every_start_naming_it(tmp_path, monkeypatch):
    """hydra resolves the run dir before main(): trainer.run_dir=${oc.env:UNSET} stopped a run, --cfg job and a sweep
    with hydra's (or omegaconf's) traceback. Each stops with exit 1 and the fix, making no dir."""
    monkeypatch.delenv("CODA_TRAIN_UNSET", raising=False)
    for mode, key in [((), "hydra.run.dir"), (("--cfg", "job"), "hydra.run.dir"), (("-m",), "hydra.sweep.dir")]:
        refused = run_train(*mode, "trainer.run_dir=${oc.env:CODA_TRAIN_UNSET}", "trainer.max_steps=1")
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, (mode, refused.stderr)
        assert (f"{key} (the run dir: trainer.run_dir unless {key} is set) cannot be resolved: " in refused.stderr
                and "Environment variable 'CODA_TRAIN_UNSET' not found" in refused.stderr
                and "fix the ${...} interpolation of trainer.run_dir" in refused.stderr), (mode, refused.stderr)


def test_a_sweep_into_an_earlier_sweeps_dir_resumes_only_runs_of_its_own_values(tiny, tmp_path):
    """Job #i resumes the run in <run_dir>/i: where that run has other values of the swept keys (another sweep's job
    #i), the sweep stops before its first job, naming them; the same sweep again continues its runs."""
    sweep = ("-m", *tiny, "trainer.eval_every=0", f"trainer.run_dir={tmp_path}")
    first = run_train(*sweep, "trainer.max_steps=2", "model.impl=eager,coda", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    swapped = run_train(*sweep, "trainer.max_steps=3", "model.impl=coda,eager")
    assert swapped.returncode == 1, swapped.stderr[-3000:]
    assert ("multirun job #0 (" in swapped.stderr and f"its dir {tmp_path / '0'} holds a run of model.impl=eager, which "
            "this job would resume as its own; sweep into a new trainer.run_dir" in swapped.stderr), swapped.stderr
    assert [len(metrics(tmp_path / job)) for job in "01"] == [2, 2]
    again = run_train(*sweep, "trainer.max_steps=3", "model.impl=eager,coda", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [len(metrics(tmp_path / job)) for job in "01"] == [3, 3]


def test_a_sweep_into_an_earlier_hydra_sweep_dir_is_checked_as_one_into_its_run_dir(tiny, tmp_path):
    """hydra.sweep.dir=DIR (hydra's own way to name a sweep's dir) puts the job dirs in DIR as trainer.run_dir=DIR
    does: another sweep's job #i there is not resumed as this one's (it was, with a warning), a sweep whose every job
    is refused at its start leaves DIR's multirun.yaml as it was, and the same sweep again continues its runs."""
    sweep = ("-m", *tiny, "trainer.eval_every=0", f"hydra.sweep.dir={tmp_path}")
    first = run_train(*sweep, "trainer.max_steps=2", "model.impl=eager,coda", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    record = (tmp_path / "multirun.yaml").read_bytes()
    swapped = run_train(*sweep, "trainer.max_steps=3", "model.impl=coda,eager")
    assert swapped.returncode == 1, swapped.stderr[-3000:]
    assert (f"its dir {tmp_path / '0'} holds a run of model.impl=eager, which this job would resume as its own; sweep "
            "into a new hydra.sweep.dir" in swapped.stderr), swapped.stderr[-3000:]
    refused = run_train(*sweep, "trainer.max_steps=3", "trainer.seq_len=16", "model.impl=eager,coda")
    assert refused.returncode == 1 and "trainer.seq_len: saved 32 vs now 16" in refused.stdout + refused.stderr
    assert (tmp_path / "multirun.yaml").read_bytes() == record
    assert [len(metrics(tmp_path / job)) for job in "01"] == [2, 2]
    again = run_train(*sweep, "trainer.max_steps=3", "model.impl=eager,coda", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [len(metrics(tmp_path / job)) for job in "01"] == [3, 3]


def test_a_sweep_whose_jobs_share_one_dir_is_refused(tiny, tmp_path):
    """A hydra.sweep.subdir that does not differ by job put every job in one dir, where the second job resumed the
    first's finished run with its settings changed, trained nothing and exited 0. A constant one is refused before any
    job; one that resolves alike for two jobs refuses the later job; one naming the swept values gives each its own."""
    sweep = ("-m", *tiny, "trainer.eval_every=0", "trainer.max_steps=2", "optim.lr=1e-3,2e-3")
    constant = run_train(*sweep, "hydra.sweep.subdir=same", f"trainer.run_dir={tmp_path / 'a'}")
    assert constant.returncode == 1, constant.stderr[-3000:]
    assert "hydra.sweep.subdir=same puts all 2 jobs of the sweep in one dir" in constant.stderr
    assert not (tmp_path / "a").exists()
    shared = run_train(*sweep, "hydra.sweep.subdir=${trainer.max_steps}", f"trainer.run_dir={tmp_path / 'b'}", timeout=300)
    out = shared.stdout + shared.stderr
    assert shared.returncode == 1 and f"multirun job #1's run dir {tmp_path / 'b' / '2'} is job #0's too" in out, out[-3000:]
    assert len(metrics(tmp_path / "b" / "2")) == 2
    assert yaml.safe_load((tmp_path / "b" / "2" / "config.yaml").read_text())["optim"]["lr"] == 1e-3
    named = run_train(*sweep, "hydra.sweep.subdir=lr${optim.lr}", f"trainer.run_dir={tmp_path / 'c'}", timeout=300)
    assert named.returncode == 0, named.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.is_dir()) == ["lr0.001", "lr0.002"]


def test_a_sweep_whose_jobs_all_stop_with_1_after_training_keeps_its_record(tiny, tmp_path):
    """Exit 1 mid-run (a step out of GPU memory) leaves the steps trained before it and their checkpoints: a sweep
    whose every job stopped so changed its job dirs, and keeps the multirun.yaml that says how they were run (it was
    removed as for a sweep whose every job was refused at its start)."""
    result = run_train("-m", *tiny, "trainer.eval_every=0", "trainer.max_steps=4", "trainer.ckpt_every=2",
                       "debug.out_of_memory_at_step=3", "model.impl=eager,coda", f"trainer.run_dir={tmp_path}", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "step 3 ran out of GPU memory" in out, out[-3000:]
    assert [len(metrics(tmp_path / job)) for job in "01"] == [2, 2]
    assert "model.impl=eager,coda" in (tmp_path / "multirun.yaml").read_text()


def test_hydras_own_run_and_sweep_dirs_are_checked_before_hydra_makes_them(tmp_path):
    """hydra.run.dir and hydra.sweep.dir take trainer.run_dir's place as the dir hydra makes: one under a file or
    where this user cannot write stopped hydra with a traceback (a sweep's with two)."""
    (tmp_path / "a_file").write_text("kept")
    for args in ((f"hydra.run.dir={tmp_path / 'a_file'}",), ("-m", f"hydra.sweep.dir={tmp_path / 'a_file' / 'x'}")):
        result = run_train("trainer.max_steps=2", *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"{args[-1]}: {tmp_path / 'a_file'} is a file, not a directory" in result.stderr
    result = run_train("-m", "trainer.max_steps=2", "hydra.sweep.dir=/proc/nope")
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "hydra.sweep.dir=/proc/nope cannot be used" in result.stderr and "choose another hydra.sweep.dir" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "kept"


def test_a_refused_sweep_leaves_the_sweep_dirs_record_as_it_was(tiny, tmp_path):
    """hydra writes multirun.yaml (the sweep's config and command line) into the sweep dir as a sweep starts: a sweep
    into an earlier sweep's trainer.run_dir that hydra cannot compose (an unknown option or key), or whose every job is
    refused at its start, leaves that record as it was, and one into a new dir leaves no dir; a sweep that runs its
    jobs records itself."""
    sweep = ("-m", *tiny, "trainer.eval_every=0", "model.impl=eager,coda")
    first = run_train(*sweep, "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'sweep'}", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    record = (tmp_path / "sweep" / "multirun.yaml").read_bytes()
    for refused, named in (("optim=adamw,nope", "Could not find 'optim/nope'"),
                           ("trainer.bogus=1,2", "Could not override 'trainer.bogus'"),
                           ("trainer.seq_len=16", "trainer.seq_len: saved 32 vs now 16")):
        result = run_train(*sweep, "trainer.max_steps=3", refused, f"trainer.run_dir={tmp_path / 'sweep'}")
        out = result.stdout + result.stderr
        assert result.returncode == 1 and named in out and "Traceback" not in out, out[-3000:]
        assert (tmp_path / "sweep" / "multirun.yaml").read_bytes() == record, refused
    result = run_train("-m", *tiny, "model.impl=liger", "trainer.seed=1,2", f"trainer.run_dir={tmp_path / 'new'}")
    assert result.returncode == 1 and "multirun job #1" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "new").exists()
    again = run_train(*sweep, "trainer.max_steps=3", f"trainer.run_dir={tmp_path / 'sweep'}", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trainer.max_steps=3" in (tmp_path / "sweep" / "multirun.yaml").read_text()


def test_a_stop_signal_during_a_jobs_last_step_ends_the_sweep_too(tiny, tmp_path):
    """The signal arrives as job 0 finishes (its last step, eval or save): job 0 is complete and saved, and the sweep
    stops before job 1 all the same; running the sweep again goes on with job 1."""
    command = ("-m", *tiny, "model.impl=eager,coda", "trainer.max_steps=3", f"trainer.run_dir={tmp_path}")
    result = run_train(*command, "debug.sigterm_after_step=3")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "received SIGTERM during the last step: this run is complete (step 3) and saved; stopped before the " \
           f"sweep's next job; to continue, run the same multirun command with trainer.run_dir={tmp_path.resolve()}" in out
    assert [p.name for p in list_checkpoints(tmp_path / "0" / "checkpoints")] == ["step_00000003"]
    assert not (tmp_path / "1").exists()
    again = run_train(*command)
    assert again.returncode == 0, again.stderr
    assert [m["step"] for m in metrics(tmp_path / "1")][-1] == 3 and "nothing to do" in again.stdout + again.stderr


def test_resuming_with_another_global_batch_names_the_saved_one(tiny, tmp_path):
    """A loader that cannot continue the checkpoint's data order is a config change, not a bad file:
    the error names the saved value and does not send the user to another checkpoint."""
    train_in_process(tmp_path, *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2")
    with pytest.raises(CheckpointError, match=r"saved 4 x 1 x 1 = 4 vs now 8 x 1 x 1 = 8\).*resume with a global batch of 4") as error:
        train_in_process(tmp_path, *tiny, "trainer.max_steps=6", "trainer.batch_size=8")
    with pytest.raises(CheckpointError, match=r"trainer.seed: saved 1337 vs now 7, trainer.seq_len: saved 32 vs now 16.*"
                                              r"resume with trainer.seed=1337, trainer.seq_len=32"):
        train_in_process(tmp_path, *tiny, "trainer.max_steps=6", "trainer.seed=7", "trainer.seq_len=16")
    assert "a new trainer.run_dir" in str(error.value) and "choose another checkpoint" not in str(error.value)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004", "step_00000002"]


def test_resuming_with_the_batch_made_up_by_accumulation_continues_the_run(tiny, tmp_path):
    """A checkpoint of batch 4 resumed with batch 2 x 2 micro-batches (a run moved to less memory): the same
    windows each optimizer step, so the same losses and gradient norms up to the order the two halves' gradients are
    summed in (the norm: AdamW and the clip would hide micro-batch gradients summed instead of averaged)."""
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_in_process(straight, *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.eval_every=0")
    shutil.copytree(straight / "checkpoints" / "step_00000002", moved / "checkpoints" / "step_00000002")
    train_in_process(moved, *tiny, "trainer.max_steps=4", "trainer.eval_every=0", "trainer.batch_size=2",
                     "trainer.grad_accum_steps=2")
    for a, b in zip(metrics(moved), metrics(straight)[2:], strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_a_run_records_its_data_paths_absolute(tiny, tmp_path, monkeypatch):
    """data.cache_dir given relative to where train.py ran: the checkpoint's config names it absolute, so eval.py,
    sample.py and export_hf.py run from elsewhere reopen the same prepared data instead of preparing it again."""
    from coda_train.data import DataConfig

    cache = next(o.split("=", 1)[1] for o in tiny if o.startswith("data.cache_dir="))
    monkeypatch.chdir(Path(cache).parent)
    train_in_process(tmp_path, *tiny, "data.cache_dir=cache", "trainer.max_steps=1", "trainer.eval_every=0")
    meta = json.loads((tmp_path / "checkpoints" / "step_00000001" / "meta.json").read_text())
    assert meta["config"]["data"]["cache_dir"] == str(Path(cache).absolute())
    assert DataConfig(source="builtin").with_absolute_paths().source == "builtin"  # a name, not a path
    assert DataConfig(source="corpus.jsonl").with_absolute_paths().source == str(Path("corpus.jsonl").absolute())
    assert DataConfig(source="*.jsonl").with_absolute_paths().source == str(Path("*.jsonl").absolute())


def test_nan_loss_stops_without_checkpointing_it(tiny, tmp_path):
    result = run_train(*tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=20", "trainer.ckpt_every=5",
                       "debug.nan_loss_at_step=8")
    assert result.returncode == 3
    assert "step 8: loss=nan" in result.stderr + result.stdout and "not finite" in result.stderr + result.stdout
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000005"]
    assert metrics(tmp_path)[-1]["step"] == 7


def test_warnings_before_the_run_holds_its_dir_are_in_train_log_too(tiny, tmp_path):
    """What a run says before it holds its dir (here trainer.parallel=ddp in one process) reaches the console at once
    and train.log as the run opens it, once, before the first step; the next run of the dir appends its own."""
    command = (*tiny, "trainer.max_steps=2", "trainer.parallel=ddp", "trainer.eval_every=0")
    train_in_process(tmp_path, *command)
    log = (tmp_path / "train.log").read_text()
    assert log.count("trainer.parallel=ddp needs several processes, and this run is one") == 1, log
    assert "[WARNING] - trainer.parallel=ddp needs several processes" in log
    train_in_process(tmp_path, *command[:-2], "trainer.max_steps=3", "trainer.parallel=ddp")
    assert (tmp_path / "train.log").read_text().count("needs several processes") == 2


def test_a_step_out_of_gpu_memory_stops_with_the_settings_that_shrink_its_activations(tiny, tmp_path, monkeypatch):
    """The training state is checked before data preparation; a micro-batch's activations can still run out of GPU
    memory. That stops the run with a ConfigError (exit code 1) naming the step, torch's allocation and the fixes, the
    first keeping the global batch, so resuming from the newest checkpoint (intact) with it continues the same batches;
    a run with no checkpoint yet is told to start again, where a shorter seq_len is one more way."""
    real = TrainStep.__call__
    oom_at = {"step": 5}

    def step_or_oom(self, *args, **kwargs):
        if self.state.step + 1 == oom_at["step"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                         "79.19 GiB of which 1.10 GiB is free. Of the allocated memory ...")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", step_or_oom)
    command = (*tiny, "trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.batch_size=4", "trainer.grad_accum_steps=1")
    with pytest.raises(ConfigError) as error:
        train_in_process(tmp_path, *command)
    message = str(error.value)
    assert message.startswith("step 5 ran out of GPU memory (tried to allocate 2.00 GiB)."), message
    newest = tmp_path / "checkpoints" / "step_00000004"
    assert f"the newest checkpoint, {newest}, is intact; resume from it with one of these" in message
    assert "trainer.batch_size=2 trainer.grad_accum_steps=2 (the same global batch" in message
    assert "trainer.recompute=block" in message and "seq_len" not in message  # a resume keeps its seq_len
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004", "step_00000002"]
    monkeypatch.setattr(TrainStep, "__call__", real)
    train_in_process(tmp_path, *command, "trainer.batch_size=2", "trainer.grad_accum_steps=2")  # the fix it named
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 9))
    # no checkpoint yet: start again, with a shorter seq_len among the ways
    monkeypatch.setattr(TrainStep, "__call__", step_or_oom)
    oom_at["step"] = 1
    with pytest.raises(ConfigError, match=r"step 1 ran out of GPU memory .*no checkpoint of this run exists yet; start it "
                                          r"again with one of these .*a shorter trainer.seq_len \(now 32\)") as error:
        train_in_process(tmp_path / "fresh", *command)
    assert "trainer.batch_size=2 trainer.grad_accum_steps=2;" in str(error.value)  # no resume to speak of


def test_resuming_with_a_lower_lr_after_a_nan_keeps_the_diverged_runs_metrics_aside(tiny, tmp_path):
    """The fix a NaN stop names (resume with a lower optim.lr) redoes the steps after the checkpoint on another
    trajectory: the diverged run's lines of those steps, the ones leading to the NaN, are moved aside, not
    overwritten. A resume that changes only what is logged or saved (trainer.log_every) redoes the same steps: its
    rewritten lines are dropped as before."""
    command = (*tiny, "trainer.max_steps=12", "trainer.ckpt_every=5", "trainer.log_every=1")
    with pytest.raises(NonFiniteError):
        train_in_process(tmp_path, *command, "debug.nan_loss_at_step=8")
    diverged = metrics(tmp_path)
    assert [m["step"] for m in diverged] == list(range(1, 8))
    train_in_process(tmp_path, *command, "optim.lr=1e-4", "trainer.max_steps=7")
    (aside,) = tmp_path.glob("metrics.replaced-step_00000005-*.jsonl")
    assert [json.loads(line) for line in aside.read_text().splitlines()] == diverged[5:]
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 8)) and metrics(tmp_path)[5] != diverged[5]
    redone = metrics(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000007")  # from step 5 again, logging every other step
    train_in_process(tmp_path, *command, "optim.lr=1e-4", "trainer.max_steps=7", "trainer.log_every=2")
    assert len(list(tmp_path.glob("metrics.replaced-*"))) == 1
    assert without_timing(metrics(tmp_path)) == without_timing(redone)  # steps 6 and 7 redone alike


def test_starting_again_with_a_lower_lr_after_a_nan_before_any_checkpoint_keeps_the_diverged_metrics(tiny, tmp_path):
    """No checkpoint yet: the NaN stop says to start again with a lower optim.lr in the same run dir; that run
    redoes every step, and the diverged run's lines are kept aside, not deleted."""
    command = (*tiny, "trainer.max_steps=8", "trainer.ckpt_every=0", "trainer.log_every=1")
    with pytest.raises(NonFiniteError):
        train_in_process(tmp_path, *command, "debug.nan_loss_at_step=6")
    diverged = metrics(tmp_path)
    train_in_process(tmp_path, *command, "optim.lr=1e-4")
    (aside,) = tmp_path.glob("metrics.replaced-step_00000000-*.jsonl")
    assert [json.loads(line) for line in aside.read_text().splitlines()] == diverged and len(diverged) == 5
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 9))


def test_starting_again_with_another_model_or_from_another_runs_checkpoint_keeps_the_earlier_metrics(
        tiny, straight_run, tmp_path):
    """A run dir with metrics but no checkpoint: starting again with another model shape redoes every step on another
    trajectory (its lines were deleted: only optim, trainer and kernels settings were compared), and starting from
    another run's checkpoint at step N makes every earlier line another trajectory's (lines up to N stayed, mixed
    into the new run's). Both are kept aside, whole."""
    command = (*tiny, "trainer.ckpt_every=0", "trainer.log_every=1", "trainer.eval_every=0")
    with pytest.raises(NonFiniteError):
        train_in_process(tmp_path, *command, "trainer.max_steps=4", "debug.nan_loss_at_step=3")
    first = metrics(tmp_path)
    train_in_process(tmp_path, *command, "trainer.max_steps=2", "model.n_layers=1")
    (aside,) = tmp_path.glob("metrics.replaced-step_00000000-*.jsonl")
    assert [json.loads(line) for line in aside.read_text().splitlines()] == first and len(first) == 2
    one_layer = metrics(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints")  # as if stopped before its first checkpoint
    start = straight_run / "checkpoints" / f"step_{N:08d}"
    train_in_process(tmp_path, *command, f"trainer.max_steps={N + 2}", f"trainer.resume={start}")
    assert [m["step"] for m in metrics(tmp_path)] == [N + 1, N + 2]
    kept = [[json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("metrics.replaced-*.jsonl")]
    assert sorted(kept, key=len) == [first, one_layer] or sorted(kept, key=len) == [one_layer, first]


def test_a_run_started_from_another_runs_checkpoint_is_told_to_start_from_it_again(tiny, straight_run, tmp_path):
    """It stops on a NaN before saving a checkpoint of its own: trainer.resume=auto would start from random weights,
    so the message names the checkpoint it started from; following it continues from there."""
    start = straight_run / "checkpoints" / f"step_{N:08d}"
    result = run_train(*tiny, f"trainer.run_dir={tmp_path}", f"trainer.resume={start}", f"trainer.max_steps={N + 10}",
                       "trainer.ckpt_every=0", f"debug.nan_loss_at_step={N + 3}")
    out = result.stderr + result.stdout
    assert result.returncode == 3 and "No checkpoint of this run exists yet: start it again with a lower optim.lr" in out
    assert f"trainer.resume={start} (this run saved no checkpoint of its own yet)" in out and "resume=auto" not in out
    again = run_train(*tiny, f"trainer.run_dir={tmp_path}", f"trainer.resume={start}", f"trainer.max_steps={N + 2}")
    assert again.returncode == 0, again.stderr
    assert [m["step"] for m in metrics(tmp_path)] == [N + 1, N + 2]


def test_cli_rejects_unknown_and_ill_typed_keys_before_training(tmp_path):
    typo = run_train("trainer.max_stepz=3", f"trainer.run_dir={tmp_path}")
    assert typo.returncode != 0 and "max_stepz" in typo.stderr
    wrong_type = run_train("trainer.max_steps=three", f"trainer.run_dir={tmp_path}")
    assert wrong_type.returncode != 0 and "could not be converted to Integer" in wrong_type.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "a_file").write_text("kept")
    for run_dir in (tmp_path / "a_file", tmp_path / "a_file" / "run"):  # the dir itself, or one above it
        a_file = run_train("trainer.max_steps=3", f"trainer.run_dir={run_dir}")
        assert a_file.returncode == 1 and "is a file, not a directory" in a_file.stderr and "Traceback" not in a_file.stderr
    assert (tmp_path / "a_file").read_text() == "kept"


def test_a_refused_start_leaves_no_dir_it_made(tiny, tmp_path):
    """A bad value (exit 1, README's table: nothing changed) removes the run dir hydra made for it, and the new dirs
    above it (they were left behind: the default's outputs/<date>/, or a/b of a/b/c); a dir that existed before stays."""
    made, existing = tmp_path / "new" / "a" / "b", tmp_path / "existing"
    (existing / "x").mkdir(parents=True)
    for run_dir in (made, existing, existing / "x" / "y" / "z"):
        result = run_train(*tiny, "optim.lr=-1", f"trainer.run_dir={run_dir}")
        assert result.returncode == 1 and "optim.lr=-1.0 must be > 0" in result.stdout + result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "new").exists() and list(existing.rglob("*")) == [existing / "x"]
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny, "optim.lr=-1"], cwd=elsewhere,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and list(elsewhere.iterdir()) == [], result.stderr[-2000:]  # no outputs/<date>/
    result = run_train(*tiny, "optim.lr=-1", f"hydra.run.dir={existing}")  # hydra's own key for the dir: it was removed
    assert result.returncode == 1 and existing.is_dir(), result.stderr[-2000:]


def test_an_empty_run_dir_is_refused_before_the_current_directory_is_touched(tiny, tmp_path):
    """hydra would take trainer.run_dir='' for the current directory: its config.yaml and metrics.jsonl stay as they were."""
    (tmp_path / "config.yaml").write_text("mine: 1\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n{"step": 10}\n')
    before = snapshot(tmp_path)
    for empty in ("trainer.run_dir=", "trainer.run_dir=''"):
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny, "trainer.max_steps=2", empty], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and "trainer.run_dir='' is empty" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before
    with pytest.raises(ConfigError, match="trainer.run_dir='' is empty"):  # set in a config file, past the command-line check
        train(compose_config(tmp_path, *tiny, "trainer.max_steps=2", "trainer.run_dir=''"), tmp_path)
    assert snapshot(tmp_path) == before


def test_a_run_dir_that_cannot_be_made_exits_4_before_hydra_tries(tmp_path):
    result = run_train("trainer.max_steps=2", "trainer.run_dir=/proc/nope/run")  # /proc takes no new directories, root's either
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert "trainer.run_dir=/proc/nope/run cannot be used: this user cannot create files in /proc" in result.stderr
    assert "choose another trainer.run_dir" in result.stderr


def test_a_run_dir_through_a_dangling_link_is_refused_before_hydra_tries(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    result = run_train("trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'link' / 'run'}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{tmp_path / 'link'} is a link to {tmp_path / 'gone'}, which does not exist" in result.stderr


def test_a_sweep_ended_by_an_unwritable_run_dir_still_names_the_jobs_that_failed_before(tiny, tmp_path):
    result = run_train("-m", *tiny, "model.impl=eager", "trainer.max_steps=3", "trainer.ckpt_every=2",
                       "trainer.eval_every=0", "debug.nan_loss_at_step=2,null", "debug.disk_full_in_checkpoint_at_step=null,2",
                       f"trainer.run_dir={tmp_path}", timeout=300)
    assert result.returncode == 4, result.stderr[-3000:]
    for job in (0, 1):
        assert f"multirun job #{job} ({tmp_path / str(job)}) stopped with exit code 3" in result.stderr


def test_every_run_dir_of_a_multirun_sweep_is_checked_before_the_first_job(tmp_path):
    (tmp_path / "a_file").write_text("kept")
    result = run_train("-m", "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'x1'},{tmp_path / 'a_file'}")
    assert result.returncode == 1 and "a_file is a file, not a directory" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the first job's dir was not made either
    result = run_train("-m", "trainer.max_steps=2", f"trainer.run_dir=choice({tmp_path / 'x1'},'')")
    assert result.returncode == 1 and "is empty" in result.stderr, result.stderr


def test_a_leading_tilde_is_the_home_directory_in_every_path_setting(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose_config("'~/run'", "trainer.resume='~/runA'", "model.init_from='~/hf'", "data.source='~/c.jsonl'",
                         "data.tokenizer='~/tok'", "data.cache_dir='~/cache'")
    assert [cfg.trainer.run_dir, cfg.trainer.resume, cfg.model.init_from, cfg.data.source, cfg.data.tokenizer,
            cfg.data.cache_dir] == [str(tmp_path / name) for name in ("run", "runA", "hf", "c.jsonl", "tok", "cache")]
    assert compose_config(tmp_path).trainer.resume == "auto"
    # hydra makes the run dir itself, from the command line: there too ~ is the home directory, not ./~
    (tmp_path / "cwd").mkdir()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny, "trainer.max_steps=1",
                             "trainer.run_dir='~/runs/x'"], cwd=tmp_path / "cwd", capture_output=True, text=True,
                            timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in metrics(tmp_path / "runs" / "x")] == [1] and not any((tmp_path / "cwd").iterdir())


def test_data_settings_that_cannot_work_stop_before_anything_is_prepared(tiny, tmp_path):
    """Each names its fix at start, before data preparation (which can take long) writes anything."""
    fresh = [o for o in tiny if not o.startswith("data.cache_dir=")] + [f"data.cache_dir={tmp_path / 'cache'}"]
    cases = [(DataError, "data.source is empty", ["data.source=''"]),
             (DataError, r"data.eos_token='</s>' is not in the BPE this run trains", ["data.eos_token='</s>'"]),
             (ConfigError, "data.val_fraction=0 holds none out: set trainer.eval_every=0", ["data.val_fraction=0"]),
             (ConfigError, r"data.tokens_per_shard=32 is shorter than one window of trainer.seq_len\+1=33",
              ["data.tokens_per_shard=32"]),
             (ConfigError, "vocab_size", ["model.vocab_size=0"])]
    for error, message, overrides in cases:
        with pytest.raises(error, match=message) as raised:
            train_in_process(tmp_path / "run", *fresh, "trainer.max_steps=2", *overrides)
        assert "tokenizer's vocabulary" not in str(raised.value)  # vocab_size=0: not 'set model.vocab_size>=1'
    assert not (tmp_path / "cache").exists()


def test_a_split_too_small_for_one_batch_stops_before_the_model_is_built(tiny, tmp_path, monkeypatch):
    """The validation split's batch check comes with the training split's, before any model or GPU work."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the loaders' checks")

    monkeypatch.setattr("coda_train.trainer.build.build_model", no_model)
    with pytest.raises(DataError, match=r"the val split has .* fewer than one batch of 512.*a larger data.val_fraction, "
                                         r"or trainer.eval_every=0 \(no validation\)$"):
        train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=2", "trainer.batch_size=512")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_validation_runs_eval_batches_global_batches(tiny, tmp_path, monkeypatch):
    """trainer.eval_batches counts global batches: with grad accumulation each rank evaluates that many micro-batches
    per accumulated step, so the validation windows do not change with the layout of one global batch."""
    from coda_train.trainer import loop
    seen = []
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda model, loader, n, *a: seen.append(n) or real(model, loader, n, *a))
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=3",
                     "trainer.grad_accum_steps=2", "trainer.ckpt_every=0")
    assert seen == [6]


def test_data_local_files_without_a_source_stops_at_start(tmp_path):
    """data=local_files names no corpus: the run stops naming data.source instead of training on the built-in one."""
    result = run_train("data=local_files", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 1 and "data.source is empty" in result.stdout + result.stderr, result.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_inconsistent_model_shapes_are_rejected(tiny, tmp_path):
    with pytest.raises(ConfigError, match="n_heads=3 must divide dim=64"):
        train_in_process(tmp_path, *tiny, "model.n_heads=3", "trainer.max_steps=2")
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 is smaller than the tokenizer's vocabulary \(300"):
        train_in_process(tmp_path, *tiny, "model.vocab_size=100", "trainer.max_steps=2")
    with pytest.raises(ConfigError, match="trainer.seq_len=64 exceeds the model's max_seq_len=32"):
        train_in_process(tmp_path, *tiny, "model.max_seq_len=32", "trainer.seq_len=64", "trainer.max_steps=2")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cute_backend_without_gpu_is_rejected(tiny, tmp_path):
    with pytest.raises(BackendError, match="kernels.backend=reference"):
        train_in_process(tmp_path, *tiny, "kernels.backend=cute", "trainer.max_steps=2")


def test_resume_with_another_model_shape_is_rejected_and_deletes_nothing(tiny, straight_run):
    before = snapshot(straight_run)
    with pytest.raises(CheckpointError, match=r"different model shape \(dim: checkpoint 64 vs this run 32"):
        train_in_process(straight_run, *tiny, "model.dim=32", f"trainer.max_steps={N + 2}")
    assert snapshot(straight_run) == before


def test_resume_with_a_missing_model_init_from_the_run_never_used_says_to_remove_it(tiny, straight_run, tmp_path):
    """A run begun from random weights, resumed with a model.init_from that does not exist: the fix is to drop it."""
    before = snapshot(straight_run)
    with pytest.raises(ConfigError, match=f"model.init_from={tmp_path / 'hf'} has no config.json, and checkpoint .* was "
                                          "not started from a model.init_from: remove model.init_from to resume it$"):
        train_in_process(straight_run, *tiny, f"model.init_from={tmp_path / 'hf'}", f"trainer.max_steps={N + 2}")
    assert snapshot(straight_run) == before


def test_resume_with_another_vocabulary_names_the_tokenizer_not_the_model_settings(straight_run):
    """data.vocab_size changes the model's vocab_size though no model.* setting changed: the message says so."""
    checkpoint = find_resume_checkpoint("auto", straight_run)
    llama = LlamaConfig(**checkpoint.meta["model"])
    with pytest.raises(CheckpointError) as raised:
        check_same_model(checkpoint, dataclasses.replace(llama, vocab_size=512))
    message = str(raised.value)
    assert "vocab_size: checkpoint 384 vs this run 512" in message and "model settings" not in message
    assert "Run with its tokenizer (data.vocab_size=300): vocab_size follows the tokenizer's vocabulary" in message
    with pytest.raises(CheckpointError, match="Run with the checkpoint's model settings and its tokenizer"):
        check_same_model(checkpoint, dataclasses.replace(llama, vocab_size=512, dim=32))


def test_resume_with_another_model_vocab_setting_names_that_setting_not_the_tokenizer(tiny, straight_run, tmp_path):
    """model.vocab_multiple_of or model.vocab_size changed since the checkpoint, the tokenizer as it was: the message
    names that setting's saved value, not the tokenizer the run already has."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    for change, fix in (("model.vocab_multiple_of=64", "model.vocab_multiple_of=128"),
                        ("model.vocab_size=512", "model.vocab_size=null")):
        with pytest.raises(CheckpointError, match=rf"Run with {fix} \(as the checkpoint's run set it\) to continue it") as raised:
            train_in_process(run_dir, *tiny, f"trainer.max_steps={N + 2}", change)
        assert "its tokenizer" not in str(raised.value)


def test_resume_of_another_shape_names_the_model_init_from_the_checkpoint_started_from(straight_run):
    """A run begun from a Hugging Face directory, resumed without model.init_from (or the other way round): the shape
    came from that directory (or the preset), so the message names model.init_from, not data.vocab_size."""
    checkpoint = find_resume_checkpoint("auto", straight_run)
    llama = LlamaConfig(**checkpoint.meta["model"])
    meta = copy.deepcopy(checkpoint.meta)
    meta["config"]["model"]["init_from"] = "/models/my-llama"
    from_hf = checkpoint._replace(meta=meta)
    with pytest.raises(CheckpointError, match=r"Run with model.init_from=/models/my-llama \(the checkpoint's run started "
                                              r"from it, and took its shape and tokenizer\) to continue it"):
        check_same_model(from_hf, dataclasses.replace(llama, vocab_size=512, dim=32))
    with pytest.raises(CheckpointError, match=r"Run with no model.init_from \(the checkpoint's run started from the "
                                              r"preset's random weights\)"):
        check_same_model(checkpoint, dataclasses.replace(llama, dim=32), init_from="/models/my-llama")
    with pytest.raises(CheckpointError, match="Run with the checkpoint's model settings to continue it"):
        check_same_model(from_hf, dataclasses.replace(llama, dim=32), init_from="/models/my-llama")


def test_resumes_tells_the_early_checks_whether_a_checkpoint_will_be_continued(tmp_path, straight_run):
    """resumes() (train()'s checks before the run dir is held): a named checkpoint, or auto with checkpoints in the
    run dir; find_resume_checkpoint then finds one there (or refuses), and finds none where resumes() says no."""
    assert resumes("auto", straight_run) and find_resume_checkpoint("auto", straight_run) is not None
    assert not resumes("auto", tmp_path / "new") and find_resume_checkpoint("auto", tmp_path / "new") is None
    assert resumes(str(straight_run), tmp_path / "new") and not resumes("never", straight_run)


def test_resume_never_refuses_a_dir_holding_a_run(tiny, straight_run):
    before = snapshot(straight_run)
    with pytest.raises(CheckpointError, match="already holds a run"):
        train_in_process(straight_run, *tiny, "trainer.resume=never", f"trainer.max_steps={N}")
    assert snapshot(straight_run) == before


def test_corrupt_checkpoint_is_skipped_by_auto_and_rejected_by_path(tiny, straight_run, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    newest = run_dir / "checkpoints" / f"step_{N:08d}"
    state = bytearray((newest / "state.pt").read_bytes())
    state[len(state) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(state))
    with pytest.raises(CheckpointError, match="does not match its checksum.*choose another checkpoint"):
        train_in_process(run_dir, *tiny, f"trainer.resume={newest}", f"trainer.max_steps={N}")
    last = train_in_process(run_dir, *tiny, f"trainer.max_steps={N}").metrics  # auto: step 24 is corrupt, so from 18
    assert "skipping damaged checkpoint" in caplog.text
    assert last["step"] == N
    verify_checkpoint(newest)  # rewritten; the damaged one is set aside, never pruned (it may be repairable)
    (aside,) = (run_dir / "checkpoints").glob(f".damaged-step_{N:08d}-*")
    assert (aside / "state.pt").read_bytes() == bytes(state)
    assert without_timing(metrics(run_dir)) == without_timing(metrics(straight_run))
    train_in_process(run_dir, *tiny, f"trainer.max_steps={N + 4}", "trainer.ckpt_every=1", "trainer.keep_last=1")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [aside.name, f"step_{N + 4:08d}"]


def test_changes_on_resume_are_announced_with_what_they_do(tiny, tmp_path):
    """A longer max_steps stretches the cosine schedule (the lr jumps back up) and a larger grad_accum_steps makes a
    larger global batch: both are allowed, and the log says so before the first step, with the value that keeps the
    saved run's course."""
    from coda_train.trainer.loop import changes_since_checkpoint
    from coda_train.trainer.optim import lr_multiplier

    saved = compose_config(tmp_path, *tiny, "trainer.max_steps=12", "model.impl=eager")
    now = compose_config(tmp_path, *tiny, "trainer.max_steps=24", "trainer.grad_accum_steps=2", "trainer.resume=auto",
                         "trainer.progress_bar=false", "model.impl=coda")
    saved_config = OmegaConf.to_container(OmegaConf.structured(saved))
    assert changes_since_checkpoint(saved_config, saved, 6) == []
    lines = changes_since_checkpoint(saved_config, now, 6)
    assert lines[0] == "settings changed since the checkpoint apply from step 7 on: trainer.max_steps 12 -> 24, " \
                       "trainer.grad_accum_steps 1 -> 2, model.impl eager -> coda"
    lr = [now.optim.lr * lr_multiplier(6, now.optim, m) for m in (12, 24)]
    assert lines[1] == (f"the cosine schedule now spans 24 steps, not 12: the learning rate at step 7 is {lr[1]:.3g} "
                        f"where the saved run's would be {lr[0]:.3g}; keep trainer.max_steps=12 to continue its schedule")
    assert len(lines) == 2  # the new global batch is the loader's to say (tests/test_data.py)
    # resumed inside warmup with a shorter run: the lr is the saved run's to the end of warmup, then not
    warm = compose_config(tmp_path, *tiny, "trainer.max_steps=40", "optim.warmup_steps=20")
    short = compose_config(tmp_path, *tiny, "trainer.max_steps=22", "optim.warmup_steps=20")
    lines = changes_since_checkpoint(OmegaConf.to_container(OmegaConf.structured(warm)), short, 10)
    lr = [short.optim.lr * lr_multiplier(20, short.optim, m) for m in (40, 22)]
    assert lines[1] == (f"the cosine schedule now spans 22 steps, not 40: the learning rate follows the saved run's until "
                        f"step 20, and at step 21 it is {lr[1]:.3g} where the saved run's would be {lr[0]:.3g}; keep "
                        "trainer.max_steps=40 to continue its schedule")


def test_extending_a_finished_run_names_the_settings_that_train_on_at_its_last_rate(tiny, tmp_path):
    """A run that finished its schedule, continued to a longer max_steps: keeping its max_steps would take no step, so
    the line names the settings that go on at the rate its last step applied (cosine and WSD: the floor), and a run
    resumed with them is not told that its lr parts."""
    from coda_train.trainer.loop import changes_since_checkpoint

    for schedule in ("cosine", "wsd"):
        saved = compose_config(tmp_path, *tiny, "trainer.max_steps=12", f"optim.schedule={schedule}")
        saved_config = OmegaConf.to_container(OmegaConf.structured(saved))
        longer = compose_config(tmp_path, *tiny, "trainer.max_steps=24", f"optim.schedule={schedule}")
        lines = changes_since_checkpoint(saved_config, longer, 12)
        assert "keep trainer.max_steps=12" not in lines[1]
        assert lines[1].endswith("where the saved run ended its schedule at step 12, its last step applying 0.0003; to "
                                 "train on at that rate, set optim.schedule=constant optim.warmup_steps=0 optim.lr=0.0003")
        at_floor = compose_config(tmp_path, *tiny, "trainer.max_steps=24", "optim.schedule=constant",
                                  "optim.warmup_steps=0", "optim.lr=0.0003")
        assert len(changes_since_checkpoint(saved_config, at_floor, 12)) == 1  # the settings, no parting


def test_a_changed_schedule_on_resume_is_compared_with_the_saved_run_s_own(tiny, tmp_path):
    """The saved run's lr comes from its own optim values (not this run's), every setting the schedule follows from
    counts (not max_steps alone), and a parting past this run's last step is not announced."""
    from coda_train.trainer.loop import changes_since_checkpoint
    from coda_train.trainer.optim import lr_multiplier

    saved = compose_config(tmp_path, *tiny, "trainer.max_steps=10", "optim.lr=3e-3")
    saved_config = OmegaConf.to_container(OmegaConf.structured(saved))
    now = compose_config(tmp_path, *tiny, "trainer.max_steps=20", "optim.lr=1e-3")
    lines = changes_since_checkpoint(saved_config, now, 5)
    old, new = 3e-3 * lr_multiplier(5, saved.optim, 10), 1e-3 * lr_multiplier(5, now.optim, 20)
    assert lines[1] == (f"the cosine schedule now spans 20 steps, not 10: the learning rate at step 6 is {new:.3g} where "
                        f"the saved run's would be {old:.3g}; keep trainer.max_steps=10 optim.lr=0.003 to continue its "
                        "schedule")
    warmup = compose_config(tmp_path, *tiny, "trainer.max_steps=10", "optim.warmup_steps=8")
    lines = changes_since_checkpoint(saved_config, warmup, 2)  # the saved run warms up over 4 steps (tiny's)
    assert lines[1] == (f"the learning rate at step 3 is {3e-3 * 3 / 8:.3g} where the saved run's would be "
                        f"{3e-3 * 3 / 4:.3g}; keep optim.warmup_steps=4 to continue its schedule")
    long_warmup = compose_config(tmp_path, *tiny, "trainer.max_steps=100", "optim.warmup_steps=20")
    shorter = compose_config(tmp_path, *tiny, "trainer.max_steps=10", "optim.warmup_steps=20")
    assert changes_since_checkpoint(OmegaConf.to_container(OmegaConf.structured(long_warmup)), shorter, 5) == [
        "settings changed since the checkpoint apply from step 6 on: trainer.max_steps 100 -> 10"]


def test_resume_naming_the_run_dir_keeps_the_damaged_checkpoint_it_skips(tiny, straight_run, tmp_path):
    """trainer.resume=<run dir> takes the newest good checkpoint as auto does: a newer damaged one is kept aside as
    damaged (never pruned), and the metrics of the steps it redoes are not kept as another trajectory's."""
    from coda_train.trainer.checkpoint import resumes_newest_good

    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    newest = run_dir / "checkpoints" / f"step_{N:08d}"
    (newest / "meta.json").write_text("{edited")
    train_in_process(run_dir, *tiny, f"trainer.resume={run_dir}", f"trainer.max_steps={N}", "trainer.keep_last=1")
    assert len(list((run_dir / "checkpoints").glob(f".damaged-step_{N:08d}-*"))) == 1
    assert not list(run_dir.glob("metrics.replaced-*"))
    assert without_timing(metrics(run_dir)) == without_timing(metrics(straight_run))
    assert resumes_newest_good("auto") and resumes_newest_good(str(run_dir / "checkpoints"))
    assert not resumes_newest_good(str(newest))  # one checkpoint, named: newer ones are another trajectory's


def test_abandoned_metrics_kept_aside_get_a_free_name_when_a_pid_repeats(tmp_path, monkeypatch):
    from coda_train.trainer.metrics import rewind_metrics

    monkeypatch.setattr(os, "getpid", lambda: 7)
    path = tmp_path / "metrics.jsonl"
    for trajectory in ("a", "b"):
        path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "run": trajectory}) + "\n" for s in range(1, 11)))
        rewind_metrics(path, 5, keep_dropped=True)
    kept = {p.name: {json.loads(line)["run"] for line in p.read_text().splitlines()} for p in tmp_path.glob("metrics.replaced-*")}
    assert kept == {"metrics.replaced-step_00000005-7.jsonl": {"a"}, "metrics.replaced-step_00000005-8.jsonl": {"b"}}


def test_rewound_metrics_are_synced_before_they_replace_the_runs_history(tmp_path, monkeypatch):
    """A resume after a kill rewrites metrics.jsonl whole (every line of the run so far): the new file must be on disk
    before the rename, or a power loss right after it can leave the run's history empty (a rename is not a data sync)."""
    from coda_train.trainer.metrics import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)))
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), replace(a, b)))
    rewind_metrics(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    (tmp,) = [name for what, name in events if what == "replace"]  # the temp file renamed over metrics.jsonl
    assert Path(tmp).parent == tmp_path and not Path(tmp).exists() and ("fsync", tmp) in events[:events.index(("replace", tmp))]


def test_a_disk_full_while_metrics_are_rewound_leaves_no_cut_short_file(tmp_path, monkeypatch):
    """A resume's rewind of metrics.jsonl that fails (disk full, as an fsync reports it) leaves the history as it was
    and no partial file beside it: a cut-short metrics.replaced-*.jsonl would read as an abandoned trajectory's record,
    and the retry writes its own."""
    from coda_train.trainer.metrics import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)))
    history = path.read_bytes()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        rewind_metrics(path, 5, keep_dropped=True)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"] and path.read_bytes() == history
    monkeypatch.undo()
    rewind_metrics(path, 5, keep_dropped=True)
    (aside,) = tmp_path.glob("metrics.replaced-step_00000005-*.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [6, 7, 8, 9, 10]


def test_a_write_that_cannot_open_its_file_leaves_that_file_alone(tmp_path, monkeypatch):
    """write_synced removes a part it wrote on a failed write, never a file it could not open (another's, unwritable:
    what open answers for a file this user may not write, root's read-only mount too)."""
    from coda_train import durable

    path = tmp_path / "theirs.json"
    path.write_text("theirs\n")

    def unwritable(file, mode="r", *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))

    monkeypatch.setattr(durable, "open", unwritable, raising=False)
    with pytest.raises(PermissionError):
        durable.write_synced(path, b"ours\n")
    assert path.read_text() == "theirs\n"


def test_a_file_replaced_on_a_full_disk_keeps_its_old_contents(tmp_path, monkeypatch):
    """config.yaml (rewritten at every start), metrics.jsonl's rewind, the tile cache and verified.json are replaced by
    replace_synced: a full disk at the write or a failed rename leaves the old file whole and no temp file beside it
    (config.yaml was written in place: a cut-short one reads as another run's settings at the next start)."""
    from coda_train.durable import replace_synced

    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for failing in ("fsync", "replace"):
        with monkeypatch.context() as m:
            m.setattr(os, failing, disk_full)
            with pytest.raises(OSError, match="No space left on device"):
                replace_synced(path, b"new: 2\n")
        assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"] and path.read_text() == "old: 1\n", failing
    replace_synced(path, b"new: 2\n")
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"] and path.read_text() == "new: 2\n"


def test_a_sweep_record_put_back_on_a_full_disk_leaves_no_temp_file(tmp_path, monkeypatch):
    """train.py puts a refused sweep's multirun.yaml back with replace_synced, as the run's own files: a rename that
    fails leaves hydra's new record and no temp file beside it (a hand-written temp + rename left .multirun.yaml.*.tmp)."""
    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    path = tmp_path / "multirun.yaml"
    path.write_text("new: 2\n")

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "replace", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            train_script.keep_sweep_record(path, b"old: 1\n")
    assert [p.name for p in tmp_path.iterdir()] == ["multirun.yaml"] and path.read_text() == "new: 2\n"
    train_script.keep_sweep_record(path, b"old: 1\n")
    assert [p.name for p in tmp_path.iterdir()] == ["multirun.yaml"] and path.read_text() == "old: 1\n"


def test_a_checkpoint_whose_meta_step_was_edited_is_damaged(tiny, straight_run, tmp_path, caplog):
    """meta.json's step must name its directory's step: an edited one would set aside the checkpoint being resumed
    (step moved down) or skip saving the steps up to it (moved up)."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    newest = run_dir / "checkpoints" / f"step_{N:08d}"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "step": N // 4}))
    with pytest.raises(CheckpointError, match=f"says step {N // 4}, its directory name step {N} .*restore it"):
        verify_checkpoint(newest)
    with pytest.raises(CheckpointError, match="restore it, or choose another checkpoint"):
        train_in_process(run_dir, *tiny, f"trainer.resume={newest}", f"trainer.max_steps={N}")


def test_auto_resume_refuses_to_restart_when_every_checkpoint_is_damaged(tiny, straight_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    for ckpt in list_checkpoints(run_dir / "checkpoints"):
        (ckpt / "state.pt").write_bytes((ckpt / "state.pt").read_bytes()[:1000])  # truncated
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        train_in_process(run_dir, *tiny, f"trainer.max_steps={N}")
    assert snapshot(run_dir) == before


def test_wandb_logger_runs_offline_without_network_or_key(tiny, tmp_path):
    env_without_key = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    result = subprocess.run([sys.executable, "train.py", *tiny, "logger=wandb", f"trainer.run_dir={tmp_path}",
                             "trainer.max_steps=3"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**env_without_key, "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(metrics(tmp_path)) == 3
    # logger.mode=online without a key: refused at start, naming the fix, before the run dir is written
    online = subprocess.run([sys.executable, "train.py", *tiny, "logger=wandb", "logger.mode=online",
                             f"trainer.run_dir={tmp_path / 'online'}", "trainer.max_steps=3"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**env_without_key, "HOME": str(tmp_path)})
    assert online.returncode != 0 and "logger.mode=online needs a wandb API key" in online.stderr + online.stdout
    assert "Traceback" not in online.stderr and not (tmp_path / "online" / "metrics.jsonl").exists()


def test_wandb_mode_in_the_environment_wins_over_logger_mode(tmp_path, monkeypatch):
    """WANDB_MODE=offline (or disabled) keeps wandb off the network whatever logger.mode says, as check_logger lets
    logger.mode=online through without a key then: passed explicitly, logger.mode overrode the variable in
    wandb.init."""
    from coda_train.trainer.metrics import LoggerConfig, MetricsLogger, check_logger

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key
    online = LoggerConfig(name="wandb", mode="online")
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_logger(online)
    logger = MetricsLogger(tmp_path, online, {}, resumed=False, progress_bar=False, initial=0, total=1)
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    check_logger(online)
    off = tmp_path / "disabled"
    off.mkdir()
    logger = MetricsLogger(off, online, {}, resumed=False, progress_bar=False, initial=0, total=1)
    assert logger.wandb_run is None
    logger.close()
    assert sorted(p.name for p in off.iterdir()) == ["metrics.jsonl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for a machine without a GPU")
def test_device_cuda_without_a_gpu_names_the_fix():
    from coda_train.trainer.device import pick_device

    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA GPU is visible; use trainer.device=auto or trainer.device=cpu"):
        pick_device("cuda")
    with pytest.raises(ConfigError, match="--device cuda but no CUDA GPU is visible; use --device auto or --device cpu"):
        pick_device("cuda", "--device ")  # scripts/eval.py and sample.py: their own option
    assert pick_device("auto") == torch.device("cpu")


def test_trainer_device_cpu_on_a_hopper_machine_takes_no_cute_kernels(tiny, tmp_path, monkeypatch):
    """On a machine where the cute backend loads (simulated), trainer.device=cpu ran kernels.backend=auto as cute: it
    was refused as "cute ... compute in bfloat16 only, but trainer.compute_dtype=auto gives torch.float32", and with
    bfloat16 it reached the first step, whose kernels refuse CPU tensors. Now auto is reference there, and
    kernels.backend=cute is refused at the start, naming the fix, before the run dir or any data is touched."""
    monkeypatch.setattr("coda_train.trainer.loop.resolve_backend", lambda name: "reference" if name == "reference" else "cute")
    run = [*tiny, "trainer.device=cpu", "trainer.max_steps=2", "trainer.eval_every=0"]
    train_in_process(tmp_path / "auto", *run)
    assert metrics(tmp_path / "auto")[-1]["step"] == 2
    with pytest.raises(ConfigError, match="kernels.backend=cute runs its kernels on the GPU, but trainer.device=cpu computes "
                                          r"on the CPU; use trainer.device=cuda \(or auto\), or kernels.backend=reference"):
        train_in_process(tmp_path / "cute", *run, "kernels.backend=cute", "trainer.compute_dtype=bfloat16")
    assert not (tmp_path / "cute").exists()


def test_cute_kernels_in_float32_name_the_fix(tiny, tmp_path):
    from coda_train.trainer.build import check_compute

    cfg = compose_config(tmp_path, *tiny, "kernels.backend=cute", "trainer.compute_dtype=float32")
    with pytest.raises(ConfigError, match="compute in bfloat16 only, but trainer.compute_dtype=float32 gives torch.float32; "
                                          "use trainer.compute_dtype=bfloat16 \\(or auto\\), or kernels.backend=reference"):
        check_compute(cfg, "cute", torch.float32)
    check_compute(cfg, "cute", torch.bfloat16)
    check_compute(cfg, "reference", torch.float32)


class _TrainingClock:
    """The trainer's perf_counter, moved forward on demand: a phase made to take `skip(seconds)` without waiting
    for it, so a test of what tokens/s leaves out holds however slowly a loaded CI machine runs the steps."""

    def __init__(self, monkeypatch):
        import coda_train.trainer.loop as loop
        import coda_train.trainer.metrics as metrics_module
        import coda_train.trainer.state as state_module

        self.offset = 0.0
        for module in (loop, metrics_module, state_module):
            monkeypatch.setattr(module, "time", self)

    def skip(self, seconds: float) -> None:
        self.offset += seconds

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


def test_tokens_per_s_leaves_out_checkpoint_saves(tiny, tmp_path, monkeypatch):
    """A logged line's tokens/s is the rate of training: a save (here made to take 100 s) between two logged lines
    does not count, as evaluation does not."""
    import coda_train.trainer.loop as loop

    clock, save = _TrainingClock(monkeypatch), loop._save

    def slow_save(*args):
        clock.skip(100.0)
        return save(*args)

    monkeypatch.setattr(loop, "_save", slow_save)
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", "trainer.ckpt_every=1", "trainer.eval_every=0")
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(m["tokens_per_s"] > 128 / 50 for m in lines[1:])  # a step's 128 tokens in under 50 s, not in 100 s


def test_tokens_per_s_after_a_resume_leaves_out_the_new_process_warm_up(tiny, tmp_path, monkeypatch):
    """A resumed process's first step compiles kernels and captures CUDA graphs (made here to take 100 s): a new
    run's step-1 line shows that step alone, so the resumed run's first line (step 8, over steps 5-8) must not
    average it in."""
    from coda_train.trainer.step import TrainStep

    run_dir = tmp_path / "run"
    steps = ["trainer.log_every=4", "trainer.eval_every=0", "trainer.ckpt_every=4"]
    train_in_process(run_dir, *tiny, "trainer.max_steps=4", *steps)
    clock, take_step = _TrainingClock(monkeypatch), TrainStep.__call__
    warmed_up = []

    def warm_up_then_step(self, *args, **kwargs):
        if not warmed_up:
            warmed_up.append(True)
            clock.skip(100.0)
        return take_step(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", warm_up_then_step)
    train_in_process(run_dir, *tiny, "trainer.max_steps=8", *steps)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 4, 8] and warmed_up
    assert lines[-1]["tokens_per_s"] > 3 * 128 / 50  # 3 steps' 384 tokens in under 50 s, not 512 tokens in 100 s


def test_a_wandb_that_refuses_to_start_leaves_no_metrics_file_open(tmp_path, monkeypatch):
    """wandb is started before metrics.jsonl is opened: a refusal (ConfigError) left the file open, in a sweep's process
    one more per failed job, and an empty metrics.jsonl in the run dir."""
    from coda_train.trainer.metrics import LoggerConfig, MetricsLogger

    def refuse(*args, **kwargs):
        raise ConfigError("wandb could not start its run")

    monkeypatch.setattr(MetricsLogger, "_start_wandb", staticmethod(refuse))
    with pytest.raises(ConfigError):
        MetricsLogger(tmp_path, LoggerConfig(name="wandb"), {}, resumed=False, progress_bar=False, initial=0, total=1)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_leftover_temporary_dirs_are_named_for_what_the_dead_run_was_doing(tmp_path, caplog):
    from coda_train.trainer.checkpoint import remove_partial_writes

    (tmp_path / ".tmp-step_00000004").mkdir()
    (tmp_path / ".tmp-delete-step_00000002").mkdir()
    with caplog.at_level("INFO", logger="coda_train.trainer.checkpoint"):
        remove_partial_writes(tmp_path)
    assert not list(tmp_path.iterdir())
    said = {r.getMessage().split("/")[-1] for r in caplog.records}
    assert said == {".tmp-step_00000004, left by a run that stopped while writing it",
                    ".tmp-delete-step_00000002, left by a run that stopped while deleting it"}
