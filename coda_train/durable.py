"""Durable files: the fsync and checksum helpers that prepared data and checkpoints share, so a
crash leaves either the old complete folder or the new complete one, and damage is detectable."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync a new file, so a later rename (of it or its folder) publishes complete contents; a failed write
    (disk full) removes what it wrote, so no cut-short file is left to be taken for a whole one; a file it could not
    open (another's, unwritable) is left alone."""
    f = open(path, "wb")
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


def replace_synced(path: Path, data: bytes) -> None:
    """Replace path's contents atomically: a synced temp file beside it, then a rename, so a kill, a power loss or a
    full disk leaves the whole old file or the whole new one, never a cut-short one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_synced(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unused_name(name_for: Callable[[int], Path]) -> Path:
    """name_for(n) for the first n from this process's PID that names nothing yet: what a run sets aside is named
    after it, and a PID repeats across runs (a container's entrypoint gets the same one at every launch)."""
    n = os.getpid()
    while name_for(n).exists():
        n += 1
    return name_for(n)


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


class LockHeldError(RuntimeError):
    """Another live process holds an exclusive_lock; the message names its PID and host."""


@contextmanager
def exclusive_lock(path: Path, wait: bool) -> Iterator[None]:
    """Hold an advisory flock on `path` (created if missing) that records this process's PID and host.

    The kernel drops an flock when its holder dies, so a killed run never leaves a stale lock. With
    wait=True a held lock is waited for (logging the holder); with wait=False LockHeldError names it.
    The file is removed on release; an acquirer whose file was removed meanwhile retries on the new one.
    """
    path = Path(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock(fd, path, blocking=False):
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
                if not wait:
                    raise LockHeldError(f"{path} is locked by {holder}; wait for it to finish, or stop that process")
                log.info("waiting for %s, held by %s", path, holder)
                _flock(fd, path, blocking=True)
            try:
                same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # the previous holder removed it while we waited: lock the current file instead
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
            try:
                yield
            finally:
                path.unlink(missing_ok=True)  # while still locked, so no one else can be holding this file
            return
        finally:
            os.close(fd)  # releases the flock


def lock_holder(path: Path) -> str | None:
    """Who holds an exclusive_lock on `path` now ("pid N on host H"), or None where no live process does (no file, or
    one its killed holder left: the kernel dropped that flock). Reads without creating the file or keeping a lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted at once unless an exclusive holder is alive
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
    except OSError:  # a filesystem without flock: exclusive_lock could not lock it either
        return None
    finally:
        os.close(fd)  # releases the shared lock, if taken
    return None


def _flock(fd: int, path: Path, blocking: bool) -> bool:
    """Take the flock (False if held elsewhere and not blocking); filesystems without flock get a warning, no lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:  # e.g. ENOLCK/EOPNOTSUPP on some network filesystems: run uncoordinated rather than not at all
        log.warning("cannot lock %s on this filesystem (%s); concurrent runs are not coordinated", path, e)
    return True
