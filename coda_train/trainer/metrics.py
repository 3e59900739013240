"""Metrics: the line logged per step (loss, lr, throughput, MFU) and where it goes: <run_dir>/metrics.jsonl
(always), Weights & Biases (logger=wandb), and the progress bar or the console."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from coda_train.durable import replace_synced, unused_name, write_synced
from coda_train.errors import ConfigError

from .step import StepResult

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
LOGGERS = ("jsonl", "wandb")  # jsonl: metrics.jsonl only; wandb: metrics.jsonl and wandb
WANDB_MODES = ("auto", "online", "offline")  # auto: online when a key is set and the server answers


@dataclass
class LoggerConfig:
    name: str = "jsonl"  # one of LOGGERS
    project: str = "coda-train"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    mode: str = "auto"  # one of WANDB_MODES


class Throughput:
    """Tokens trained on since the last reset, and their rate over the training time of that window (the window
    between two logged lines, or from the end of a resumed process's first step, its warm-up, to its first line; less
    the time spent in `excluded()`: evaluation and checkpoint saves)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside is not training time: the window's start moves later by as much."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - begin

    def per_second(self, now: float) -> float:
        return self.tokens / (now - self.start)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_gpu: float, n_gpus: int) -> float:
    """Model FLOPs utilization: the training FLOP/s the model's arithmetic needs (flops_per_token from
    LlamaConfig.flops_per_token) over the GPUs' peak."""
    return flops_per_token * tokens_per_s / (peak_flops_per_gpu * n_gpus)


def metrics_line(result: StepResult, tokens: int, tokens_per_s: float, elapsed_s: float,
                 utilization: Optional[float] = None) -> dict[str, Any]:
    """One metrics.jsonl line; val_loss is added by the caller on evaluation steps."""
    line = {"step": result.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens": tokens, "tokens_per_s": tokens_per_s, "elapsed_s": elapsed_s}
    if utilization is not None:
        line["mfu"] = utilization
    return line


def rewind_metrics(path: Path, step: int, keep_dropped: bool = False) -> None:
    """Drop lines logged after `step` (by the interrupted run whose last steps the resumed run redoes),
    so metrics.jsonl reads as one uninterrupted run. Rewritten atomically and synced. keep_dropped (the dropped lines are another
    trajectory's: an older checkpoint resumed, or other settings): they go to metrics.replaced-step_<step>-<n>.jsonl."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept, dropped = [], []
    for line in lines:
        try:
            (kept if json.loads(line)["step"] <= step else dropped).append(line)
        except (ValueError, KeyError):  # a line cut short by a kill: part of the redone tail
            pass
    if len(kept) == len(lines):
        return
    if keep_dropped and dropped:
        aside = unused_name(lambda n: path.with_name(f"{path.stem}.replaced-step_{step:08d}-{n}{path.suffix}"))
        write_synced(aside, "".join(dropped).encode())
        log.warning("the metrics of steps after %d (another trajectory) are moved to %s", step, aside)
    replace_synced(path, "".join(kept).encode())  # a power loss must not leave an empty history


def _wandb_server_answers(timeout_s: float = 3.0) -> bool:
    """Whether api.wandb.ai accepts a connection within timeout_s. Probed in a daemon thread, because
    a DNS lookup without a network can block far longer than the socket timeout."""
    answered = []

    def probe() -> None:
        try:
            with socket.create_connection(("api.wandb.ai", 443), timeout=timeout_s):
                answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answered)


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _wandb_mode_from_env() -> Optional[str]:
    """offline or disabled where the environment's WANDB_MODE asks for no network (dryrun is wandb's old name for
    offline): it wins over logger.mode, which wandb.init would otherwise take over the variable; else None."""
    mode = os.environ.get("WANDB_MODE")
    return {"offline": "offline", "dryrun": "offline", "disabled": "disabled"}.get(mode or "")


def check_logger(cfg: LoggerConfig) -> None:
    """logger=wandb with logger.mode=online needs an API key: refused at start, not after data and model."""
    if cfg.name == "wandb" and cfg.mode == "online" and _wandb_mode_from_env() is None and not _wandb_has_key():
        raise ConfigError("logger.mode=online needs a wandb API key and found none (WANDB_API_KEY, or ~/.netrc from "
                          "`wandb login`); log in, or use logger.mode=auto (online when a key and the server are there, "
                          "else offline) or logger.mode=offline (`wandb sync` later)")


class MetricsLogger:
    """Where each metrics line goes (rank 0 only): metrics.jsonl, one JSON object per line flushed at
    once (a killed run keeps every line it logged); wandb; the progress bar (shown only when stderr is
    a terminal, from step `initial` of `total`), else the console."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, config: dict[str, Any], resumed: bool,
                 progress_bar: bool, initial: int, total: int):
        self.wandb_run = None
        if cfg.name == "wandb":  # first: a wandb that refuses to start leaves no metrics.jsonl open (a sweep's next job)
            self.wandb_run = self._start_wandb(run_dir, cfg, config, resumed)
        self.file = open(run_dir / METRICS_FILE, "a")
        self.bar = None
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    @staticmethod
    def _start_wandb(run_dir: Path, cfg: LoggerConfig, config: dict[str, Any], resumed: bool):
        import wandb

        env_mode = _wandb_mode_from_env()
        mode = env_mode or cfg.mode
        if mode == "disabled":
            log.info("wandb: disabled by WANDB_MODE=disabled; metrics go to %s only", run_dir / METRICS_FILE)
            return None
        if mode == "auto":  # never block on a network that is not there
            mode = "online" if _wandb_has_key() and _wandb_server_answers() else "offline"
            reason = "no API key or no connection"
        else:
            reason = f"WANDB_MODE={os.environ['WANDB_MODE']}" if env_mode else "logger.mode=offline"
        if mode == "offline":
            log.info("wandb: offline mode (%s); sync later with `wandb sync %s/wandb`", reason, run_dir)
        # the run id is stored in the run dir, so a resumed run continues the same wandb run
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        try:
            return wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config, mode=mode,
                              settings=wandb.Settings(init_timeout=60, silent=True))
        except (wandb.errors.Error, OSError) as e:  # a rejected key, an unreachable server, a bad entity or project
            raise ConfigError(f"wandb could not start its run in mode {mode} ({type(e).__name__}: {e}); check the key, "
                              "the network and logger.entity / logger.project, or use logger.mode=offline "
                              "(`wandb sync` later) or logger=jsonl") from e

    def log(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        if self.bar is not None:
            self.bar.set_postfix_str(format_line(metrics), refresh=False)
        else:
            log.info(format_line(metrics))

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, exit_code: int = 0) -> None:
        if self.bar is not None:
            self.bar.close()
        with contextlib.suppress(OSError):  # log() flushed every line; a failed one was reported there
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


def format_line(metrics: dict[str, Any]) -> str:
    """A short human-readable summary of a metrics line, for the console / progress bar."""
    parts = [f"step {metrics['step']}", f"loss {metrics['loss']:.4f}"]
    if "val_loss" in metrics:
        parts.append(f"val {metrics['val_loss']:.4f}")
    parts += [f"lr {metrics['lr']:.2e}", f"{metrics['tokens_per_s']:.0f} tok/s"]
    if "mfu" in metrics:
        parts.append(f"mfu {100 * metrics['mfu']:.1f}%")
    return " | ".join(parts)

