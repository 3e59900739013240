"""Durable files: the fsync and checksum helpers that prepared data and checkpoints share, so a
crash leaves either the old complete folder or the new complete one, and damage is detectable."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync a file, so a later rename of its folder publishes complete contents."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory, making the creations and renames inside it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
