"""Atomic, verified checkpoints: <run_dir>/checkpoints/step_XXXXXXXX/{state.pt, meta.json}.

A checkpoint is written into a hidden temporary directory (state.pt, then meta.json holding its
sha256), each file fsynced, then the directory is renamed to its final name and the parent fsynced.
So a directory named step_* is complete by construction, and its checksum catches later damage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..durable import fsync_dir, sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE, META_FILE = "state.pt", "meta.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run; the message says what to do."""


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


def newest_good_checkpoint(root: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """(path, meta) of the newest checkpoint that verifies; damaged ones are skipped with a warning."""
    for path in list_checkpoints(root):
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping damaged checkpoint: %s", e)
    return None


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        # this process's GPU only: a resuming machine may have fewer GPUs than the saving one
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])
