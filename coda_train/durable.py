"""Durable files: the fsync and checksum helpers that prepared data and checkpoints share, so a
crash leaves either the old complete folder or the new complete one, and damage is detectable."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Iterator


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


class LockHeld(RuntimeError):
    """Another process holds the lock; the message names it (PID and host, as its lock file says)."""


def _lock_holder(fd: int) -> str:
    text = os.pread(fd, 512, 0).decode(errors="replace").split()
    if len(text) == 2 and text[0].isdigit():
        return f"process {text[0]} on host {text[1]}"
    return "a process that has not written its PID yet"


@contextlib.contextmanager
def exclusive_lock(path: Path, wait: bool) -> Iterator[None]:
    """Hold an advisory exclusive lock (fcntl.flock) on `path`, created if missing, for the body, and
    write "PID host" into it. The kernel releases the lock when the holder dies, so a killed process
    never leaves a stale lock; the file stays, naming its last holder. On contention, wait=False
    raises LockHeld naming the holder; wait=True logs who is being waited for and blocks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            if not wait:
                raise LockHeld(f"{path} is locked by {holder}") from None
            logging.getLogger(__name__).info("waiting for the lock %s, held by %s", path, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
