"""The run directory as one process's property: its lock (<run_dir>/.lock, held by rank 0 for the
whole run, so two runs never write into one dir), the run's log file (train.log), and the one-paragraph
error for a write into it that the operating system refuses (disk full, read-only, permissions, quota).

The lock is an fcntl.flock the kernel releases when the holder dies, so a killed run never blocks the
next one; and since a locked run dir has one writer, every partial write found there is a dead one's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

import yaml

from coda_train.durable import LockHeldError, exclusive_lock
from coda_train.errors import ConfigError

from .checkpoint import CHECKPOINTS_DIR, list_checkpoints, remove_partial_writes
from .distributed import World, raise_from_main
from .metrics import METRICS_FILE

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
LOG_FILE = "train.log"
CONFIG_FILE = "config.yaml"  # the run's settings, written at every start
RUN_GROUPS = ("model", "data", "optim", "trainer")  # the groups every run's config.yaml has (coda_train/config.py)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # hydra's, as on the console


class RunDirError(RuntimeError):
    """A file of the run dir could not be written; the message names it, the newest intact checkpoint
    and the fix."""


def _fix(e: OSError, run_dir: Path, key: str = "trainer.run_dir") -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ("Free space on that filesystem (or raise the quota), or move the run dir to one with room and point "
                f"{key} there; a checkpoint needs about as much as the previous one, and up to "
                "trainer.keep_last + 1 of them exist at once")
    if e.errno == errno.EROFS:
        return ("The filesystem is mounted read-only: remount it read-write, or copy the run dir to a writable "
                f"place and point {key} there")
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"This user may not write there: fix the ownership or permissions of {run_dir}, or choose another {key}"
    return f"Check that filesystem ({errno.errorcode.get(e.errno, 'unknown error')}), or choose another {key}"


def check_run_dir_not_empty(value: Optional[str], key: str = "trainer.run_dir") -> None:
    """An empty trainer.run_dir (or hydra.run.dir / hydra.sweep.dir, `key`), which hydra would take for the current
    directory: ConfigError."""
    if value is not None and not value.strip():
        raise ConfigError(f"{key}={value!r} is empty, which would make the current directory ({Path.cwd()}) "
                          f"the run dir and overwrite its files: name a directory (e.g. {key}=runs/x), or leave "
                          f"{key} unset for a fresh timestamped one")


def read_run_config(path: Path) -> Optional[dict]:
    """A training run's config.yaml as a dict; None where it cannot be read or is another tool's (not a mapping with
    the run's config groups)."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) and all(isinstance(config.get(g), dict) for g in RUN_GROUPS) else None


def check_run_dir_is_empty_or_a_run(run_dir: Path) -> None:
    """An existing run dir must be empty or a run's (it holds train.log, metrics.jsonl, checkpoints/, or the lock of
    a run killed as it began; without train.log and the lock, which every run leaves, a config.yaml there must be a
    run's and a metrics.jsonl come with one): a run writes config.yaml, metrics.jsonl and train.log there, over any of
    the user's files of those names, and drops metrics.jsonl lines it cannot read as its own. ConfigError."""
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    held_before = bool({LOG_FILE, LOCK_FILE} & set(entries))  # a run held it: its config.yaml may be damaged, not foreign
    foreign_config = not held_before and CONFIG_FILE in entries and read_run_config(run_dir / CONFIG_FILE) is None
    orphan_metrics = not held_before and METRICS_FILE in entries and CONFIG_FILE not in entries
    no_run_file = not {LOG_FILE, METRICS_FILE, CHECKPOINTS_DIR, LOCK_FILE} & set(entries)
    if entries and (no_run_file or foreign_config or orphan_metrics):
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        why = ("files that are not a training run's" if no_run_file else
               f"a {CONFIG_FILE} that is not a training run's" if foreign_config else
               f"a {METRICS_FILE} without the {CONFIG_FILE} every run writes beside it")
        raise ConfigError(f"trainer.run_dir={run_dir} holds {why} ({shown}); a run writes "
                          "config.yaml, metrics.jsonl and train.log there and would overwrite files of those names: name "
                          "a new or empty directory, or the run dir of an earlier run")


def check_run_dir_path(value: str, key: str = "trainer.run_dir") -> None:
    """What hydra needs to make trainer.run_dir=value (or the dir of another `key`: hydra.run.dir, hydra.sweep.dir),
    checked before it tries (where it cannot, it stops with a traceback): a non-empty path whose nearest existing
    ancestor is a directory this user can create files in. ConfigError (exit 1) or RunDirError (exit 4) naming the
    fix; nothing is written."""
    check_run_dir_not_empty(value, key)
    path = Path(value).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))  # the run dir, or where it would be made
    if existing.is_symlink() and not existing.exists():
        raise ConfigError(f"{key}={path}: {existing} is a link to {os.readlink(existing)}, which does not "
                          "exist; make that directory, remove the link, or name another directory")
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a directory; name a new or existing "
                          "directory (a run's files go there)")
    try:  # tried, not os.access: that says yes to root even where mkdir fails (/proc, a read-only mount)
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))
    except OSError as e:
        raise RunDirError(f"{key}={path} cannot be used: this user cannot create files in {existing} "
                          f"({e.strerror or e}); nothing was written. {_fix(e, existing, key)}") from e


def sweep_jobs(path: Path, holds: Callable[[Path], bool]) -> list[Path]:
    """The job run dirs of a multirun's sweep dir (train.py -m ... trainer.run_dir=DIR) for which `holds` is true, in
    hydra's job order (0, 1, ..., 10); [] where path is not a dir or holds no such job."""
    if not path.is_dir():
        return []
    return sorted((d for d in path.iterdir() if d.is_dir() and holds(d)), key=lambda d: (len(d.name), d.name))


def continue_hint(run_dir: Path, resume: str = "auto", sweep_dir: Optional[Path] = None, saved: bool = True) -> str:
    """How to continue the run in run_dir. Named in full: without trainer.run_dir every run (and
    every multirun job) gets a fresh timestamped dir, so the bare command would start over; a run
    started with trainer.resume=never or a path continues with auto (never refuses a run dir in use,
    a path would start from it again), except a run started from a path that saved no checkpoint of its
    own (saved=False), which starts from that path again (auto would start from random weights); a
    multirun job continues with its whole sweep (the same -m command with its job's run dir would nest
    a new sweep inside it)."""
    if not saved and resume not in ("auto", "never"):
        resume_hint = f"trainer.resume={Path(resume).expanduser().absolute()} (this run saved no checkpoint of its own yet)"
    else:
        resume_hint = "" if resume == "auto" else "trainer.resume=auto"
    if sweep_dir is not None:
        hint = (f"to continue, run the same multirun command with trainer.run_dir={sweep_dir.resolve()} (each job "
                f"continues its own dir, {run_dir.resolve()} among them; finished jobs have nothing left to do)")
    else:
        hint = f"to continue, run the same command with trainer.run_dir={run_dir.resolve()}"
    return f"{hint} and {resume_hint}" if resume_hint else hint


def write_error(e: OSError, what: str, path: Path, run_dir: Path) -> RunDirError:
    """The paragraph for an OSError `e` while writing `what` to `path` of run_dir."""
    newest = next(iter(list_checkpoints(run_dir / CHECKPOINTS_DIR)), None)
    intact = (f"The newest checkpoint, {newest}, is intact and nothing older was touched; training after it is "
              "not saved. " if newest is not None else "No checkpoint of this run exists yet. ")
    return RunDirError(f"could not write {what} to {e.filename or path}: {e.strerror or e}. {intact}{_fix(e, run_dir)}; "
                       f"then, {continue_hint(run_dir)}: it continues from the newest checkpoint (partial files "
                       "of the failed write are removed automatically).")


@contextlib.contextmanager
def writing(what: str, path: Path, run_dir: Path) -> Iterator[None]:
    """Turn an OSError of the body (writing `what` to `path`) into the RunDirError paragraph."""
    try:
        yield
    except OSError as e:
        raise write_error(e, what, path, run_dir) from e


class _RunLogFile(logging.FileHandler):
    """train.log (appended to by every run of the dir); if it cannot be written it says so once on
    stderr and stops, so the console still gets every line, including the error that ends the run."""
    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True
        sys.stderr.write(f"cannot write {self.baseFilename} ({sys.exc_info()[1]}); logging to the console only\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a buffered line that did not fit was reported by handleError
            super().close()


def log_in_run_dir(run_dir: Path, message: str) -> None:
    """One ERROR line in train.log from a rank other than 0 (rank 0 alone holds the log), so a stop that
    begins on another rank says why in the run's own log too. Best effort: that rank's host may not reach it."""
    handler = _run_log_handler(run_dir)
    handler.emit(logging.makeLogRecord({"name": __name__, "levelno": logging.ERROR, "levelname": "ERROR", "msg": message}))
    handler.close()


def _run_log_handler(run_dir: Path) -> _RunLogFile:
    handler = _RunLogFile(run_dir / LOG_FILE)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    return handler


class EarlyWarnings(logging.Handler):
    """The WARNING and higher records logged before a run holds its dir (the checks and notes before it: a
    trainer.parallel that cannot apply, a preset beside model.init_from), kept until hold_run_dir writes them into
    train.log, so the run's own log says all that its console said about it. On the root logger while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextlib.contextmanager
    def attached(self) -> Iterator["EarlyWarnings"]:
        logging.getLogger().addHandler(self)
        try:
            yield self
        finally:
            self.detach()

    def detach(self) -> None:
        """Stop collecting and drop what was kept (once train.log has it, or on a rank that writes none)."""
        logging.getLogger().removeHandler(self)
        self.records.clear()


@contextlib.contextmanager
def _run_log(run_dir: Path, early: Optional[EarlyWarnings] = None) -> Iterator[None]:
    handler = _run_log_handler(run_dir)
    logging.getLogger().addHandler(handler)
    for record in early.records if early is not None else ():  # from now on train.log gets every record itself
        handler.handle(record)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, world: World, early: Optional[EarlyWarnings] = None) -> Iterator[None]:
    """Rank 0 holds <run_dir>/.lock for the body, removes dead writers' partial checkpoints and logs
    to train.log (the `early` warnings first); every rank raises if the dir is in use (LockHeldError) or cannot be
    written (RunDirError)."""
    with contextlib.ExitStack() as held:
        error: Optional[Exception] = None
        if world.is_main:
            try:
                check_run_dir_is_empty_or_a_run(run_dir)
                with writing("the run lock", run_dir / LOCK_FILE, run_dir):
                    run_dir.mkdir(parents=True, exist_ok=True)
                    held.enter_context(exclusive_lock(run_dir / LOCK_FILE, wait=False))
                    held.enter_context(_run_log(run_dir, early))
                    remove_partial_writes(run_dir / CHECKPOINTS_DIR)
            except LockHeldError as e:
                error = LockHeldError(f"trainer.run_dir={run_dir} is in use by another training run ({e}). Two runs in one "
                                 "run dir would overwrite each other's checkpoints and metrics, so this one stops "
                                 "before touching it. Wait for that run to end (or stop it with SIGTERM, which saves a "
                                 "checkpoint), or choose another trainer.run_dir")
            except (RunDirError, ConfigError) as e:
                error = e
        raise_from_main(error, world)
        yield
