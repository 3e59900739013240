"""Metrics sinks: <run_dir>/metrics.jsonl (always) and Weights & Biases (logger=wandb)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

from coda_train.config import LoggerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def rewind_metrics(path: Path, step: int) -> None:
    """Drop lines logged after `step` (by the interrupted run whose last steps the resumed run redoes),
    so metrics.jsonl reads as one uninterrupted run. Rewritten atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):  # a line cut short by a kill: part of the redone tail
            pass
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


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


class MetricsLogger:
    """One JSON object per logged step, flushed at once (a killed run keeps every line it logged)."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, config: dict[str, Any], resumed: bool):
        self.file = open(run_dir / METRICS_FILE, "a")
        self.wandb_run = None
        if cfg.name == "wandb":
            self.wandb_run = self._start_wandb(run_dir, cfg, config, resumed)

    @staticmethod
    def _start_wandb(run_dir: Path, cfg: LoggerConfig, config: dict[str, Any], resumed: bool):
        import wandb

        mode = cfg.mode
        if mode == "auto":  # never block on a network that is not there
            mode = "online" if os.environ.get("WANDB_MODE") != "offline" and _wandb_has_key() and _wandb_server_answers() else "offline"
        if mode == "offline":
            log.info("wandb: offline mode (no API key or no connection); sync later with `wandb sync %s/wandb`", run_dir)
        # the run id is stored in the run dir, so a resumed run continues the same wandb run
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        return wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name, id=run_id, resume="allow",
                          dir=str(run_dir), config=config, mode=mode,
                          settings=wandb.Settings(init_timeout=60, silent=True))

    def log(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self, exit_code: int = 0) -> None:
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

