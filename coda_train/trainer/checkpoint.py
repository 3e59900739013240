"""Atomic, verified checkpoints: <run_dir>/checkpoints/step_XXXXXXXX/{state.pt, meta.json}, and the
resume rules: which checkpoint a run continues and what of the model may differ from it.
Under FSDP2 a checkpoint is sharded instead: {shards/, run_state.pt, meta.json}, each rank writing its
own shards through torch.distributed.checkpoint, meta.json (last) holding every file's sha256; it is
written and renamed the same way, and restore() reads either layout on any number of processes.
With trainer.ckpt_async (FSDP2 only) each rank copies its shards to memory and a background thread writes
them while training continues; rank 0 publishes the checkpoint (checksums, meta.json, rename, prune)
only once every rank's shards are written: as soon as it sees that between steps, and at the latest
before the next save and before the run exits. A failed write is never published (its temporary
directory is removed and the error raised on the training thread), so the guarantees below hold as for
a synchronous save; a crash while a write is pending loses only that checkpoint.

A checkpoint is written into a hidden temporary directory (state.pt, then meta.json holding its
sha256), each file fsynced, then the directory is renamed to its final name and the parent fsynced.
So a directory named step_* is complete by construction, and its checksum catches later damage.
Before writing, the free space is checked against the state's tensor bytes (what torch.save writes,
plus 1% and 256 KiB for its records and meta.json); a write that fails anyway (disk full, read-only, quota) removes its temporary
directory and raises the OSError, leaving every earlier checkpoint as it was. Temporary directories
(.tmp-*) found when a run starts are a dead writer's (the run dir's lock allows one writer) and are
removed then (remove_partial_writes).

Set-aside checkpoints: resuming from an older checkpoint N (trainer.resume=<path>) moves this run dir's
checkpoints newer than N (another trajectory) to .replaced-step_*-<pid> before the first step, so a later
auto-resume never continues the abandoned trajectory. They are not deleted then, but they count against
trainer.keep_last: after each save the checkpoints dir holds at most keep_last checkpoint-sized
directories, set-aside ones pruned first (lowest step first), then the oldest step_*. So disk use stays
bounded, and an abandoned trajectory survives until the new one's checkpoints displace it.
Damaged checkpoints that auto-resume skipped go to .damaged-step_*-<pid> instead, which are never pruned:
one whose meta.json was edited may be repairable, so only the user deletes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from coda_train.data import PreparedData
from coda_train.data.config import DataError
from coda_train.data.shards import MANIFEST
from coda_train.errors import ConfigError
from coda_train.model import LlamaConfig

from ..durable import fsync_dir, sha256_file, unused_name, write_synced
from .distributed import World, from_main, raise_from_main
from .metrics import METRICS_FILE
from .state import TrainState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE, META_FILE = "state.pt", "meta.json"
CHECKPOINTS_DIR = "checkpoints"  # inside the run dir
STEP_DIR = re.compile(r"^step_(\d{8})$")
SET_ASIDE = re.compile(r"^\.replaced-step_(\d{8})-\d+$")
META_KEYS = ("format", "step", "sha256", "bytes", "model")  # what resuming reads of meta.json
# a sharded checkpoint (FSDP2): shards/ (torch.distributed.checkpoint: one file per rank + .metadata),
# run_state.pt (scheduler, loader, RNGs, counters) and meta.json, whose "files" has each file's sha256
SHARDS_DIR, RUN_STATE_FILE = "shards", "run_state.pt"
SHARDED_META_KEYS = ("format", "step", "files", "model")
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
    """A file object that hashes what torch.save writes, so the checksum needs no second read. It keeps
    the first OSError, which torch reports only as its own RuntimeError. full_after (a test hook):
    bytes after which writes fail with ENOSPC, as on a full disk."""

    def __init__(self, f, full_after: Optional[int] = None):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.full_after, self.error = full_after, None

    def write(self, b) -> int:
        try:
            if self.full_after is not None and self.size + len(b) > self.full_after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
            n = self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(b)
        self.size += len(b)
        return n

    def flush(self) -> None:
        self.f.flush()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-by-name checkpoint directories under root, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def remove_partial_writes(root: Path) -> None:
    """Remove the temporary directories (.tmp-*) of dead writers: checkpoints cut short, or old ones
    half deleted. Call only while holding the run dir's lock (no live writer)."""
    if root.is_dir():
        for stale in root.glob(".tmp-*"):
            doing = "deleting" if stale.name.startswith(".tmp-delete-") else "writing"  # a pruned checkpoint, or a new one
            log.info("removing %s, left by a run that stopped while %s it", stale, doing)
            shutil.rmtree(stale, ignore_errors=True)


def set_aside_newer(root: Path, step: int, damaged: bool) -> None:
    """Move the checkpoints of root newer than `step` (the resume point) to .replaced-step_*-<pid>, or, where
    they are `damaged` ones auto-resume skipped, to .damaged-step_*-<pid> (never pruned); a PID already used
    there (containers repeat them) takes the next free number."""
    kind = "damaged" if damaged else "replaced"
    for path in list_checkpoints(root):
        if int(STEP_DIR.match(path.name).group(1)) > step:
            aside = unused_name(lambda n: root / f".{kind}-{path.name}-{n}")
            if damaged:
                log.warning("this run continues from step %d, so the damaged checkpoint %s is moved to %s and kept "
                            "(never pruned): repair it and rename it back to resume from it, or delete it", step, path, aside)
            else:
                log.warning("this run continues from step %d, so %s (a later step of another trajectory) is moved to %s; "
                            "it counts against trainer.keep_last and is pruned first", step, path, aside)
            os.rename(path, aside)


def prune(root: Path, keep_last: int) -> None:
    """Keep at most keep_last checkpoint-sized directories: set-aside ones go first (lowest step
    first), then the oldest step_*; the newest step_* is never removed (keep_last >= 1)."""
    aside = sorted((p for p in root.iterdir() if SET_ASIDE.match(p.name)), key=lambda p: p.name)  # by step, then pid
    oldest_first = aside + list_checkpoints(root)[::-1]
    for old in oldest_first[:max(0, len(oldest_first) - keep_last)]:
        gone = root / f".tmp-delete-{old.name.lstrip('.')}"  # rename first: a half-deleted directory must not look complete
        os.rename(old, gone)
        shutil.rmtree(gone)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state dict: about what torch.save of it writes (a DTensor: this
    rank's shard)."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _check_free_space(root: Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need:
        raise OSError(errno.ENOSPC, f"the checkpoint needs about {need / 2**20:.1f} MiB and the filesystem has "
                                    f"{free / 2**20:.1f} MiB free (checked before writing)", str(root))


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int,
                    before_meta: Optional[Callable[[], None]] = None, full_after: Optional[int] = None) -> Path:
    """Write state (torch.save) and meta (json) as checkpoint `step` atomically; then prune to keep_last.
    An OSError (e.g. disk full) removes the partial write and propagates; earlier checkpoints stay.
    Test hooks: before_meta runs between the two files (a crash mid-write), full_after fails state.pt
    with ENOSPC after that many bytes."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    if final.exists():  # set_aside_newer ran at resume; this keeps the rename below safe whatever the caller did
        set_aside_newer(root, step - 1, damaged=False)
    _check_free_space(root, int(tensor_bytes(state) * 1.01) + 2**18)  # + torch.save's per-tensor records, meta.json
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        with open(tmp / STATE_FILE, "wb") as f:
            writer = _HashingWriter(f, full_after)
            try:
                torch.save(state, writer)
            except RuntimeError:  # torch's report of a failed write; the OSError says what failed
                if writer.error is None:
                    raise
                raise writer.error from None
            f.flush()
            os.fsync(f.fileno())
        if before_meta is not None:
            before_meta()
        _publish(tmp, final, {"format": FORMAT_VERSION, "step": step, "sha256": writer.sha.hexdigest(),
                              "bytes": writer.size, **meta})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    prune(root, keep_last)
    return final


def _publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Write meta.json last (synced), then rename the complete temp directory to its final name."""
    write_synced(tmp / META_FILE, json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    os.rename(tmp, final)


def save_sharded_checkpoint(root: Path, step: int, state: TrainState, meta: dict[str, Any], keep_last: int,
                            world: World, before_meta: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """Every rank calls it: each writes its shards of model and optimizer (torch.distributed.checkpoint)
    into rank 0's temporary directory; rank 0 then writes, last, meta.json with every file's size and
    sha256, and renames the directory (complete by construction, as save_checkpoint's). Returns the
    path on rank 0."""
    sharded = state.sharded_state_dict()
    tmp = _sharded_tmp(root, step, state, sharded, world)
    try:
        dcp.save(sharded, storage_writer=FileSystemWriter(tmp / SHARDS_DIR, sync_files=True))
    except BaseException as e:
        _remove_on_main(tmp, world)
        _raise_write_failure(e, root, step)
    return _publish_sharded(root, step, tmp, meta, keep_last, world, before_meta)


class PendingSave(NamedTuple):
    """A sharded checkpoint whose shards a background thread is still writing (trainer.ckpt_async)."""
    step: int
    tmp: Path
    written: Future  # dcp.async_save's: done on a rank once every rank's shards and .metadata are written


def start_sharded_checkpoint(root: Path, step: int, state: TrainState, world: World, group: Any) -> PendingSave:
    """save_sharded_checkpoint's first half, returning once this rank's shards are copied to memory: a
    background thread writes them (dcp.async_save, its collectives over `group`, a gloo group that the
    training thread never uses, so the two never interleave on one group). Publish with finish_sharded_checkpoint."""
    sharded = state.sharded_state_dict()
    tmp = _sharded_tmp(root, step, state, sharded, world)
    try:
        written = dcp.async_save(sharded, storage_writer=FileSystemWriter(tmp / SHARDS_DIR, sync_files=True),
                                 process_group=group)
    except BaseException:
        _remove_on_main(tmp, world)
        raise
    return PendingSave(step, tmp, written)


def finish_sharded_checkpoint(pending: PendingSave, root: Path, meta: dict[str, Any], keep_last: int, world: World,
                              before_meta: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """Every rank calls it: wait for the shards, then rank 0 publishes as save_sharded_checkpoint does.
    A failed write (on any rank: torch.distributed.checkpoint reports it to all) removes the temporary
    directory and raises, naming the checkpoint; earlier checkpoints stay as they were."""
    try:
        pending.written.result()
    except BaseException as e:
        _remove_on_main(pending.tmp, world)
        _raise_write_failure(e, root, pending.step)
    return _publish_sharded(root, pending.step, pending.tmp, meta, keep_last, world, before_meta)


def _raise_write_failure(e: BaseException, root: Path, step: int) -> None:
    """Raise a failed shard write (on any rank: torch.distributed.checkpoint reports it to all, as a
    CheckpointException) as its OSError, e.g. disk full, which the caller reports as a run-dir write error, or as a
    CheckpointError naming the checkpoint; anything else as it is."""
    if not isinstance(e, CheckpointException):
        raise e
    errors = [error for error, _ in e.failures.values()]
    if isinstance(errors[0], OSError):
        raise errors[0] from e
    # torch.save (each tensor of a shard) reports a failed file write as its own RuntimeError, the OSError lost
    short_write = (" (a file write failed: a full disk, a quota or a file size limit)"
                   if "unexpected pos" in str(errors[0]) else "")
    raise CheckpointError(f"writing the checkpoint of step {step} ({root / f'step_{step:08d}'}) failed "
                          f"({type(errors[0]).__name__}: {errors[0]}){short_write}; the earlier checkpoints are intact, "
                          "resume from the newest") from e


def _sharded_tmp(root: Path, step: int, state: TrainState, sharded: dict[str, Any], world: World) -> Path:
    """Rank 0 checks the free space for all ranks' shards (one host), makes the temporary directory and
    writes run_state.pt into it; every rank gets its path, or rank 0's error (none waits on the others)."""
    final, tmp, error = root / f"step_{step:08d}", None, None
    if world.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists():  # as in save_checkpoint
                set_aside_newer(root, step - 1, damaged=False)
            _check_free_space(root, int(tensor_bytes(sharded) * world.world_size * 1.01) + 2**20)
            tmp = root / f".tmp-{final.name}-{os.getpid()}"
            tmp.mkdir()
            with open(tmp / RUN_STATE_FILE, "wb") as f:
                torch.save(state.run_state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            error = e
    tmp, error = from_main((tmp, error), world)
    if error is not None:
        raise error
    return tmp


def _publish_sharded(root: Path, step: int, tmp: Path, meta: dict[str, Any], keep_last: int, world: World,
                     before_meta: Optional[Callable[[], None]]) -> Optional[Path]:
    """On rank 0, once every rank's shards are written: meta.json (every file's sha256), rename, prune."""
    if not world.is_main:
        return None
    final = root / f"step_{step:08d}"
    try:
        if before_meta is not None:
            before_meta()
        fsync_dir(tmp / SHARDS_DIR)
        files = {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        _publish(tmp, final, {"format": FORMAT_VERSION, "step": step, "files": files, "processes": world.world_size,
                              **meta})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    prune(root, keep_last)
    return final


def _remove_on_main(tmp: Path, world: World) -> None:
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _one_process_is_meant():
    """torch.distributed.checkpoint warns that it assumes one process wherever no process group exists, even when told
    so (no_dist): a sharded checkpoint read by the tools or resumed by one process is meant so, so the warning goes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def restore(state: TrainState, checkpoint: Checkpoint) -> None:
    """Load a verified checkpoint into state, whichever layout it has and however many processes wrote
    it: state.pt (whole tensors) or shards/ (resharded to this run's processes by torch.distributed.checkpoint)."""
    path = checkpoint.path
    try:
        if "files" not in checkpoint.meta:
            state.load_state_dict(load_state(path))
            return
        sharded = state.sharded_state_dict()
        with _one_process_is_meant():
            dcp.load(sharded, storage_reader=FileSystemReader(path / SHARDS_DIR))
        state.load_sharded_state_dict(sharded)
        state.load_run_state_dict(torch.load(path / RUN_STATE_FILE, map_location="cpu", weights_only=True))
    except DataError as e:  # the data order cannot continue: this run's data settings differ, not the checkpoint
        raise CheckpointError(f"checkpoint {path}: {e}, or start a fresh run in another trainer.run_dir") from e
    except (KeyError, ValueError, RuntimeError, CheckpointException) as e:  # another layout (its checksums are its own)
        held = path / (STATE_FILE if "files" not in checkpoint.meta else SHARDS_DIR)
        raise CheckpointError(f"checkpoint {path}: {held} does not hold this trainer's state ({type(e).__name__}: {e}); "
                              "choose another checkpoint") from e


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint directory whose state.pt has the recorded size and sha256."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable {META_FILE} ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has an unknown {META_FILE} format")
    if missing := [k for k in (SHARDED_META_KEYS if "files" in meta else META_KEYS) if k not in meta]:
        raise CheckpointError(f"checkpoint {path}: {path / META_FILE} lacks the key {missing[0]!r} (edited by hand or "
                              "by another tool); restore it, or choose another checkpoint")
    named = STEP_DIR.match(path.name)  # the writer names the directory after meta's step
    if not isinstance(meta["step"], int) or (named is not None and int(named.group(1)) != meta["step"]):
        raise CheckpointError(f"checkpoint {path}: {path / META_FILE} says step {meta['step']!r}, its directory name "
                              f"step {int(named.group(1)) if named else '?'} (edited by hand or by another tool); restore "
                              "it, or choose another checkpoint")
    files = meta["files"] if "files" in meta else {STATE_FILE: {"sha256": meta["sha256"], "bytes": meta["bytes"]}}
    for name, recorded in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != recorded["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or truncated")
        if sha256_file(file) != recorded["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (corrupt)")
    return meta


def load_state(path: Path) -> dict[str, Any]:
    """The state of a verified whole-tensor checkpoint (state.pt), on CPU."""
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} cannot be read ({e})") from e


def load_model_state(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """{"model": whole tensors, "train_loader": its state} of a verified checkpoint of either layout, on CPU, in
    one process without a process group: the tools that evaluate, sample or export a run (an FSDP2 run's
    shards are read into whole tensors, its optimizer state left on disk)."""
    if "files" not in meta:
        state = load_state(path)
        return {"model": state["model"], "train_loader": state.get("train_loader", {})}
    try:
        reader = FileSystemReader(path / SHARDS_DIR)
        saved = reader.read_metadata().state_dict_metadata
        # dcp flattens {"model": {name: t}} to "model.<name>"; an empty tensor of each saved size is the template
        model = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                 for key, m in saved.items() if key.startswith("model.") and hasattr(m, "size")}
        template = {"model": model}
        with _one_process_is_meant():
            dcp.load(template, storage_reader=reader, no_dist=True)
        run_state = torch.load(path / RUN_STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # dcp and torch.load raise many types for damaged files
        raise CheckpointError(f"checkpoint {path}: its shards cannot be read into whole tensors ({type(e).__name__}: "
                              f"{e}); choose another checkpoint") from e
    return {"model": template["model"], "train_loader": run_state.get("train_loader", {})}


def newest_good_checkpoint(root: Path, warn: bool = True) -> Optional[Checkpoint]:
    """The newest checkpoint under root that verifies; damaged ones are skipped, with a warning if `warn`."""
    while True:
        for path in list_checkpoints(root):
            try:
                return Checkpoint(path, verify_checkpoint(path))
            except CheckpointError as e:
                if not path.exists():  # pruned by a run still saving (keep_last) beside a tool reading it: list again
                    break
                if warn:
                    log.warning("skipping damaged checkpoint: %s", e)
        else:
            return None


def resumes(resume: str, run_dir: Path) -> bool:
    """Whether this run continues a checkpoint (or find_resume_checkpoint refuses it): trainer.resume names one,
    or is auto and run_dir holds some. Cheap, verifies nothing: for the checks made before the run dir is held."""
    return resume not in ("auto", "never") or (resume == "auto" and bool(list_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)))


def find_resume_checkpoint(resume: str, run_dir: Path, world: World = World()) -> Optional[Checkpoint]:
    """The checkpoint this run continues, per trainer.resume: auto (the newest good one of run_dir,
    None in a new run), never (None; run_dir must hold no run), or a path (a checkpoint, a
    checkpoints dir or a run dir). Rank 0 alone looks, verifies and says which damaged ones it skips; every rank gets
    what it found, or its refusal (every rank hashing every file was 8x the reads on 8 GPUs)."""
    found, error = None, None
    if world.is_main:
        try:
            found = _find_resume_checkpoint(resume, run_dir)
        except (CheckpointError, OSError) as e:  # raised on every rank: the others would wait for rank 0
            error = e
    raise_from_main(error, world)
    return from_main(found, world)


def _find_resume_checkpoint(resume: str, run_dir: Path) -> Optional[Checkpoint]:
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
    found = _checkpoint_at(Path(resume), resume)
    own = list_checkpoints(root)
    if own and root.resolve() not in found.path.resolve().parents:
        # another run's checkpoint into a run dir with progress of its own: starting over would set that progress
        # aside and prune it (e.g. the same command run again after a stop)
        raise CheckpointError(f"trainer.resume={resume} starts from another run's checkpoint, but trainer.run_dir={run_dir} "
                              f"already holds checkpoints of its own (newest: {own[0].name}): to continue this run, use "
                              f"trainer.resume=auto; to start again from {resume}, choose a new trainer.run_dir")
    return found


def resumes_newest_good(resume: str) -> bool:
    """Whether trainer.resume takes the newest good checkpoint of a run (auto, or a path naming a run dir or its
    checkpoints dir), so that any newer checkpoint there was skipped as damaged, not left by another trajectory."""
    return resume == "auto" or not (Path(resume) / META_FILE).exists() and not (Path(resume) / STATE_FILE).exists()


def _checkpoint_at(path: Path, resume: str) -> Checkpoint:
    """The checkpoint trainer.resume=path names: that checkpoint (it must be good), or the newest good one of
    a run dir or checkpoints dir."""
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


def saved_model(path: Path, meta: dict[str, Any]) -> LlamaConfig:
    """The model a checkpoint's meta.json records (its "model" fields); CheckpointError where they are not one
    this code builds (edited by hand, or written by another version)."""
    try:
        return LlamaConfig(**meta["model"]).validate()
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} lacks a usable model config ({e!r}); restore it, or "
                              "choose another checkpoint") from e


def recorded_prepared_data(meta: dict[str, Any], verify: str, fix: Optional[str] = None) -> Optional[PreparedData]:
    """The prepared folder the run trained on, as its meta.json recorded it, which needs neither the corpus nor
    the folder's old name (nor the tokenizer it was prepared with); None where that folder is gone or the
    checkpoint predates the record. verify: data.verify_shards; fix: PreparedData.open's."""
    folder = recorded_prepared_folder(meta)
    return None if folder is None else PreparedData.open(folder, verify=verify, fix=fix)


def recorded_prepared_folder(meta: dict[str, Any]) -> Optional[Path]:
    """The prepared folder meta.json records, where it still holds a manifest; None where it is gone or not recorded."""
    folder = meta.get("prepared_data")
    return Path(folder) if folder is not None and (Path(folder) / MANIFEST).is_file() else None


def check_same_model(checkpoint: Checkpoint, model: LlamaConfig, init_from: Optional[str] = None,
                     vocab_settings: Optional[dict[str, Any]] = None) -> None:
    """The checkpoint's model (its meta's "model" fields) is `model`, up to RESUME_MAY_CHANGE; init_from: this run's
    model.init_from as its config records it (absolute), None where it sets none; vocab_settings: this run's
    model.vocab_size and model.vocab_multiple_of, which a message about another vocabulary names where they changed."""
    saved = checkpoint.meta["model"]
    diffs = {k: (saved.get(k), v) for k, v in dataclasses.asdict(model).items()
             if k not in RESUME_MAY_CHANGE and saved.get(k) != v}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in diffs.items())
        started = ((checkpoint.meta.get("config") or {}).get("model") or {}).get("init_from")
        settings = ["the checkpoint's model settings"] if set(diffs) != {"vocab_size"} else []
        if started != init_from:  # the shape (vocab included) came from that directory, or from the preset: say which
            settings = [f"model.init_from={started} (the checkpoint's run started from it, and took its shape and "
                        "tokenizer)" if started else "no model.init_from (the checkpoint's run started from the "
                        "preset's random weights)"]
        elif "vocab_size" in diffs and (moved := _changed_vocab_settings(checkpoint, vocab_settings or {})):
            settings.append(f"{' '.join(moved)} (as the checkpoint's run set it)")
        elif "vocab_size" in diffs:  # most often no model.* setting changed, but the tokenizer did
            data = checkpoint.meta.get("config", {}).get("data", {})
            saved = ", ".join(f"data.{k}={data[k]}" for k in ("vocab_size", "tokenizer") if data.get(k) is not None)
            settings.append(f"its tokenizer ({saved or 'its data.* settings'}): vocab_size follows the tokenizer's "
                            "vocabulary, rounded up to model.vocab_multiple_of, unless model.vocab_size is set")
        raise CheckpointError(f"checkpoint {checkpoint.path} holds a different model shape ({detail}). Run with "
                              f"{' and '.join(settings)} to continue it, or choose a new trainer.run_dir "
                              "(or trainer.resume=never in an empty dir) to start fresh; nothing was deleted")


def _changed_vocab_settings(checkpoint: Checkpoint, vocab_settings: dict[str, Any]) -> list[str]:
    """The model.* settings that decide the vocabulary (vocab_settings: this run's) whose value the checkpoint's config
    records otherwise, as overrides that restore it (null for None, as hydra reads it)."""
    saved = ((checkpoint.meta.get("config") or {}).get("model") or {})
    return [f"model.{k}={'null' if saved[k] is None else saved[k]}" for k, v in vocab_settings.items()
            if k in saved and saved[k] != v]


def check_ckpt_async(ckpt_async: bool, parallel: str) -> None:
    """trainer.ckpt_async writes FSDP2's sharded checkpoints in the background; state.pt is written in place."""
    if ckpt_async and parallel != "fsdp":
        run = "is one process" if parallel == "none" else "uses trainer.parallel=ddp"
        raise ConfigError(f"trainer.ckpt_async=true writes FSDP2's sharded checkpoints in the background, and this run "
                          f"{run}, whose rank 0 writes state.pt in place: set trainer.ckpt_async=false, or run "
                          "several processes under torchrun with trainer.parallel=fsdp")


@dataclass
class Checkpointer:
    """Saves a run's TrainState as <root>/step_XXXXXXXX with `meta` (what describes the run beside the
    state: model fields, impl, config), keeping the newest keep_last. With ckpt_async (FSDP2 only) a
    save returns once the shards are in memory and is published by poll, finish or the next save."""
    root: Path
    keep_last: int
    meta: dict[str, Any]
    resumed_from: Optional[Checkpoint] = None
    kill_mid_write_at_step: Optional[int] = None  # test hook: SIGKILL between state.pt and meta.json
    disk_full_at_step: Optional[int] = None  # test hook: that step's state.pt fails with ENOSPC halfway
    ckpt_async: bool = False

    def __post_init__(self) -> None:
        self.saved: Optional[tuple[int, Path]] = (self.resumed_from.step, self.resumed_from.path) if self.resumed_from else None
        self.pending: Optional[PendingSave] = None  # one asynchronous save at a time
        self._async_group = None  # gloo, for the background writer's collectives; made by the first async save

    def save(self, state: TrainState, world: World = World()) -> Optional[Path]:
        """Checkpoint state.step, once: a step already saved (or resumed from) returns its path. Every
        rank calls it: under FSDP2 each writes its shards; otherwise rank 0 writes state.pt alone, and its failed write
        (disk full) raises on every rank. An
        asynchronous save returns the path (on rank 0) that finish will publish it under."""
        if self.saved is not None and self.saved[0] == state.step:
            return self.saved[1]
        self.finish(world)
        crash = self._crash_hook(state.step)
        final = self.root / f"step_{state.step:08d}"
        if isinstance(state.model, FSDPModule) and self.ckpt_async:
            if self._async_group is None:
                self._async_group = dist.new_group(backend="gloo")
            self.pending = start_sharded_checkpoint(self.root, state.step, state, world, self._async_group)
            self.saved = (state.step, final)
            return final if world.is_main else None
        if isinstance(state.model, FSDPModule):
            path = save_sharded_checkpoint(self.root, state.step, state, self.meta, self.keep_last, world, crash)
            self.saved = (state.step, final)
            return path
        path, error = None, None
        if world.is_main:
            state_dict = state.state_dict()
            full_after = tensor_bytes(state_dict) // 2 if self.disk_full_at_step == state.step else None
            try:
                path = save_checkpoint(self.root, state.step, state_dict, self.meta, self.keep_last, crash, full_after)
            except OSError as e:  # raised on every rank: the others would wait in their next collective for rank 0
                error = e
        raise_from_main(error, world)
        self.saved = (state.step, path)  # on every rank (path None but on rank 0): each skips a step saved already
        return path

    def finish(self, world: World = World()) -> Optional[Path]:
        """Wait for the pending asynchronous save and publish it (rank 0); every rank calls it, and a
        failed write raises here on every rank. No-op without one."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        return finish_sharded_checkpoint(pending, self.root, self.meta, self.keep_last, world,
                                         self._crash_hook(pending.step))

    def written(self, world: World = World()) -> bool:
        """On rank 0: the pending save's shards are all written, so it can be published now (and a crash
        before the next save keeps it). A failed write is left to finish, which every rank calls at once."""
        done = world.is_main and self.pending is not None and self.pending.written.done()
        return done and self.pending.written.exception() is None

    def _crash_hook(self, step: int) -> Optional[Callable[[], None]]:
        if self.kill_mid_write_at_step != step:
            return None
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
