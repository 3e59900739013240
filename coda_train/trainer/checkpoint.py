"""Atomic, verified checkpoints: <run_dir>/checkpoints/step_XXXXXXXX/{state.pt, meta.json}, and the
resume rules: which checkpoint a run continues and what of the model may differ from it.

A checkpoint is written into a hidden temporary directory (state.pt, then meta.json holding its
sha256), each file fsynced, then the directory is renamed to its final name and the parent fsynced.
So a directory named step_* is complete by construction, and its checksum catches later damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from coda_train.model import LlamaConfig

from ..durable import fsync_dir, sha256_file
from .metrics import METRICS_FILE
from .state import TrainState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE, META_FILE = "state.pt", "meta.json"
CHECKPOINTS_DIR = "checkpoints"  # inside the run dir
STEP_DIR = re.compile(r"^step_(\d{8})$")
# model fields free to change on resume: init_std only matters at init, max_seq_len only bounds seq_len
RESUME_MAY_CHANGE = {"init_std", "max_seq_len"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run; the message says what to do."""


class Checkpoint(NamedTuple):
    """A verified checkpoint directory and its meta.json."""
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return self.meta["step"]


class _HashingWriter:
    """A file object that hashes what torch.save writes, so the checksum needs no second read."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-by-name checkpoint directories under root, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int,
                    before_meta: Optional[Callable[[], None]] = None) -> Path:
    """Write state (torch.save) and meta (json) as checkpoint `step` atomically; keep the newest keep_last.
    before_meta runs between the two files (a test hook that simulates a crash mid-write)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    if final.exists():  # a damaged one resume skipped, or one of a trajectory resumed from before it
        aside = root / f".replaced-{final.name}-{os.getpid()}"
        log.warning("checkpoint %s exists from an earlier run of this dir; moving it to %s (not deleted) "
                    "and writing this run's", final, aside)
        os.rename(final, aside)
    for stale in root.glob(".tmp-*"):  # leftovers of a crashed write; never complete, safe to drop
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    with open(tmp / STATE_FILE, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    if before_meta is not None:
        before_meta()
    meta = {"format": FORMAT_VERSION, "step": step, "sha256": writer.sha.hexdigest(), "bytes": writer.size, **meta}
    with open(tmp / META_FILE, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    for old in list_checkpoints(root)[keep_last:]:
        doomed = root / f".tmp-delete-{old.name}"  # rename first: a half-deleted directory must not look complete
        os.rename(old, doomed)
        shutil.rmtree(doomed)
    return final


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint directory whose state.pt has the recorded size and sha256."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable {META_FILE} ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or not {"sha256", "bytes"} <= meta.keys():
        raise CheckpointError(f"checkpoint {path} has an unknown {META_FILE} format")
    state_file = path / STATE_FILE
    if not state_file.is_file() or state_file.stat().st_size != meta["bytes"]:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is missing or truncated")
    if sha256_file(state_file) != meta["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} does not match its checksum (corrupt)")
    return meta


def load_state(path: Path) -> dict[str, Any]:
    """The state of a verified checkpoint, on CPU."""
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} cannot be read ({e})") from e


def newest_good_checkpoint(root: Path) -> Optional[Checkpoint]:
    """The newest checkpoint under root that verifies; damaged ones are skipped with a warning."""
    for path in list_checkpoints(root):
        try:
            return Checkpoint(path, verify_checkpoint(path))
        except CheckpointError as e:
            log.warning("skipping damaged checkpoint: %s", e)
    return None


def find_resume_checkpoint(resume: str, run_dir: Path) -> Optional[Checkpoint]:
    """The checkpoint this run continues, per trainer.resume: auto (the newest good one of run_dir,
    None in a new run), never (None; run_dir must hold no run), or a path (a checkpoint, a
    checkpoints dir or a run dir)."""
    root = run_dir / CHECKPOINTS_DIR
    if resume == "never":
        if list_checkpoints(root) or (run_dir / METRICS_FILE).exists():
            raise CheckpointError(f"trainer.run_dir={run_dir} already holds a run and trainer.resume=never would mix "
                                  "a new one into it; choose a new trainer.run_dir or use trainer.resume=auto")
        return None
    if resume == "auto":
        found = newest_good_checkpoint(root)
        if found is None and list_checkpoints(root):  # never silently restart a run whose progress is damaged
            raise CheckpointError(f"every checkpoint in {root} is damaged (see the warnings above); point "
                                  "trainer.resume at a good checkpoint elsewhere, or start over in a new trainer.run_dir")
        return found
    path = Path(resume)
    if (path / META_FILE).exists() or (path / STATE_FILE).exists():  # one checkpoint: it must be good
        try:
            return Checkpoint(path, verify_checkpoint(path))
        except CheckpointError as e:
            raise CheckpointError(f"{e}; choose another checkpoint for trainer.resume (or trainer.resume=auto "
                                  "to take the newest good one of this run)") from e
    for root in (path / CHECKPOINTS_DIR, path):  # a run dir or its checkpoints dir: newest good one
        if list_checkpoints(root):
            found = newest_good_checkpoint(root)
            if found is None:
                raise CheckpointError(f"trainer.resume={resume}: no checkpoint there is intact; "
                                      "point trainer.resume at another checkpoint or use trainer.resume=never")
            return found
    raise CheckpointError(f"trainer.resume={resume} is not a checkpoint, a checkpoints dir or a run dir with "
                          "checkpoints; pass an existing path, or auto / never")


def check_same_model(checkpoint: Checkpoint, model: LlamaConfig) -> None:
    """The checkpoint's model (its meta's "model" fields) is `model`, up to RESUME_MAY_CHANGE."""
    saved = checkpoint.meta["model"]
    diffs = {k: (saved.get(k), v) for k, v in dataclasses.asdict(model).items()
             if k not in RESUME_MAY_CHANGE and saved.get(k) != v}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in diffs.items())
        raise CheckpointError(f"checkpoint {checkpoint.path} holds a different model shape ({detail}). Run with the "
                              "checkpoint's model settings to continue it, or choose a new trainer.run_dir "
                              "(or trainer.resume=never in an empty dir) to start fresh; nothing was deleted")


@dataclass
class Checkpointer:
    """Saves a run's TrainState as <root>/step_XXXXXXXX with `meta` (what describes the run beside the
    state: model fields, impl, config), keeping the newest keep_last."""
    root: Path
    keep_last: int
    meta: dict[str, Any]
    resumed_from: Optional[Checkpoint] = None
    kill_mid_write_at_step: Optional[int] = None  # test hook: SIGKILL between state.pt and meta.json

    def save(self, state: TrainState) -> Path:
        if self.resumed_from is not None and state.step == self.resumed_from.step:  # nothing trained since: it is saved
            return self.resumed_from.path
        crash = None
        if self.kill_mid_write_at_step == state.step:
            crash = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        return save_checkpoint(self.root, state.step, state.state_dict(), self.meta, self.keep_last, before_meta=crash)
