"""Preparation: documents -> tokenizer -> parallel tokenization -> uint16/uint32 token shards + manifest, written atomically."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Optional, TypeVar

import numpy as np
from tokenizers import Tokenizer

from ..durable import LockHeldError, exclusive_lock, fsync_dir, replace_synced, sha256_file, write_synced
from .config import CacheWriteError, DataConfig, DataError
from .progress import Progress
from .sources import (DECOMPRESSORS, DocumentCounts, Source, check_text_columns, iter_document_parts,
                      json_read_as_text, names_hub_dataset, resolve_source)
from .tokenizer import (LoadedTokenizer, cuts_at_newlines, encode_documents, find_eos, fingerprint, for_documents,
                        load_tokenizer, num_ids, token_dtype, train_bpe)

log = logging.getLogger(__name__)
T = TypeVar("T")  # what _StopSignals.checked passes through: documents, or (text, ends) parts

FORMAT_VERSION = 1  # bump when the shard layout or any choice below changes what gets written
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFIED_FILE = "verified.json"  # shards whose sha256 was checked on this storage, keyed by size and mtime
SPLITS = ("train", "val")
TOKENIZER_TRAIN_CHARS = 200_000_000  # BPE merges settle long before this; bounds training time and memory on big corpora
CHUNK_CHARS = 1_000_000  # text per tokenization task: large enough to amortize inter-process transfer
# a text file (one document) longer than this is read, trained on and tokenized in parts of about this size, so its
# preparation needs memory for a few parts, not for the file (where the tokenizer allows it, cuts_at_newlines)
TEXT_PART_CHARS = 1 << 20


class PreparationInterrupted(DataError):
    """SIGTERM/SIGINT stopped a preparation; its temp folder is gone and finished folders are untouched."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"data preparation stopped by {signal.Signals(signum).name}; nothing of this run was kept and "
                         f"finished prepared folders are untouched; run the same command again to prepare from the start")


class PreparedData:
    """A validated prepared folder: tokenizer.json, manifest.json and the token shards of each split."""

    def __init__(self, path: Path, manifest: dict, tokenizer: Tokenizer):
        self.path = path
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self.eos_id: int = manifest["tokenizer"]["eos_id"]
        self.dtype = np.dtype(manifest["dtype"])

    @classmethod
    def open(
        cls, path: str | os.PathLike, expected_tokenizer: Optional[str] = None, verify: str = "first_use",
        fix: Optional[str] = None,
    ) -> "PreparedData":
        """Check the manifest, shard sizes, tokenizer and (per `verify`, see data.verify_shards) shard checksums.

        expected_tokenizer is the fingerprint the caller will train with. fix: what the errors advise, where
        the caller cannot prepare the folder again (by default: delete it and prepare again)."""
        path = Path(path)
        advice = fix or f"delete {path} and run prepare again"  # _verify_shards has its own default, so it gets fix
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            tokenizer_info, splits = manifest["tokenizer"], manifest["splits"]
            dtype = np.dtype(manifest["dtype"])
        except FileNotFoundError as e:
            raise DataError(f"{path} has no {MANIFEST}: it is not a finished prepared folder; {advice}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"the manifest {path / MANIFEST} is truncated or corrupt ({e!r}); {advice}") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version")
            raise DataError(f"{path} was prepared by format version {version}, this code reads {FORMAT_VERSION}; {advice}")
        try:
            expected_sizes = {path / shard["file"]: shard["num_tokens"] * dtype.itemsize
                              for split in SPLITS for shard in splits[split]["shards"]}
        except (KeyError, TypeError) as e:
            raise DataError(f"the manifest {path / MANIFEST} is truncated or corrupt ({e!r}); {advice}") from e
        for file, expected in expected_sizes.items():
            actual = file.stat().st_size if file.is_file() else None
            if actual != expected:
                raise DataError(f"shard {file} is truncated or missing ({actual} bytes, manifest says {expected}); {advice}")
        try:
            tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as e:  # missing or malformed file; the Rust parser raises a bare Exception
            raise DataError(f"cannot read {path / TOKENIZER_FILE} ({e}); {advice}") from e
        if fingerprint(tokenizer) != tokenizer_info["fingerprint"]:
            raise DataError(f"{path / TOKENIZER_FILE} does not match the fingerprint in its manifest (edited or damaged); {advice}")
        if expected_tokenizer is not None and expected_tokenizer != tokenizer_info["fingerprint"]:
            raise DataError(
                f"{path} holds shards from another tokenizer (fingerprint {tokenizer_info['fingerprint'][:12]}) than "
                f"data.tokenizer now points at ({expected_tokenizer[:12]}); the tokenizer file changed after preparation. "
                f"Restore it, or {advice}"
            )
        data = cls(path, manifest, tokenizer)
        if verify != "never":
            try:
                data._verify_shards(remember=verify == "first_use", fix=fix)
            except (KeyError, TypeError) as e:  # a shard entry without its sha256
                raise DataError(f"the manifest {path / MANIFEST} is truncated or corrupt ({e!r}); {advice}") from e
        return data

    def num_tokens(self, split: str) -> int:
        return self._split(split)["num_tokens"]

    def shards(self, split: str) -> list["Shard"]:
        """The split's shards, each open for reading until it is garbage collected (or closed)."""
        return [Shard(self.path / s["file"], s["num_tokens"], self.dtype) for s in self._split(split)["shards"]]

    def verify_checksums(self) -> None:
        """Full content check: reads every shard, whatever was verified before."""
        self._verify_shards(remember=False)

    def _verify_shards(self, remember: bool, fix: Optional[str] = None) -> None:
        """sha256 of every shard against the manifest; with remember, shards already verified at their current size and
        mtime (VERIFIED_FILE) are skipped and newly verified ones are added to it. fix: as open's."""
        shards = [shard for split in SPLITS for shard in self._split(split)["shards"]]
        verified = _read_verified(self.path) if remember else {}
        todo = [s for s in shards if verified.get(s["file"]) != _stamp(self.path / s["file"], s["sha256"])]
        if not todo:
            return
        gigabytes = sum(s["num_tokens"] for s in todo) * self.dtype.itemsize / 1e9
        log.info("verifying the sha256 of %d shards (%.2f GB) in %s%s", len(todo), gigabytes, self.path,
                 " (once per copy of the data; data.verify_shards=never skips this)" if remember else "")
        for shard in todo:
            file = self.path / shard["file"]
            if sha256_file(file) != shard["sha256"]:
                raise DataError(
                    f"shard {file} does not match the sha256 in {self.path / MANIFEST}: its contents changed after "
                    f"preparation (disk or copy damage, or an edit), so training on it would use wrong tokens. "
                    + (f"{fix[0].upper()}{fix[1:]}" if fix else
                       f"Delete the folder {self.path} and run preparation again (python -m coda_train.data.prepare with "
                       f"the same data settings, or just start training again); a copy of the corpus elsewhere can be "
                       f"copied over instead")
                )
            verified[shard["file"]] = _stamp(file, shard["sha256"])
        if remember:
            _write_verified(self.path, verified)

    def _split(self, split: str) -> dict:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
        return self.manifest["splits"][split]


class Shard:
    """One token shard, read with pread on a descriptor held from construction. Not a memory map: a mapped page past
    the end of a file truncated or rewritten while the run reads it raises SIGBUS, which kills the process with no
    message, where a read that comes up short is a DataError naming the file."""

    def __init__(self, path: Path, num_tokens: int, dtype: np.dtype):
        self.path, self.num_tokens, self.dtype = path, num_tokens, np.dtype(dtype)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise DataError(f"cannot open shard {path} ({e.strerror}). "
                            f"{_SHARD_CHANGED_FIX.format(folder=path.parent)}") from e
        self._close = weakref.finalize(self, os.close, fd)  # closed with the Shard: loaders are made and dropped freely
        self._fd = fd

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as a new array."""
        tokens = np.empty(count, self.dtype)
        self.read_into(tokens, start)
        return tokens

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill the contiguous array `out` with the tokens from `start` on."""
        if start < 0 or start + out.size > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + out.size}) are outside shard {self.path} of {self.num_tokens}")
        buffer = memoryview(out).cast("B")
        offset, done = start * self.dtype.itemsize, 0
        while done < len(buffer):  # a regular file reads whole except at its end; the loop is for the rare exception
            try:
                got = os.preadv(self._fd, [buffer[done:]], offset + done)
            except OSError as e:  # EIO from a failing disk or network filesystem
                raise DataError(f"cannot read shard {self.path} ({e.strerror}). "
                                f"{_SHARD_CHANGED_FIX.format(folder=self.path.parent)}") from e
            if got == 0:
                raise self._short_error()
            done += got

    def close(self) -> None:
        self._close()

    def _short_error(self) -> DataError:
        expected = self.num_tokens * self.dtype.itemsize
        return DataError(
            f"shard {self.path} is now {os.fstat(self._fd).st_size} bytes, shorter than the {expected} its manifest "
            f"says: the file was truncated or overwritten while this run read it (a copy or rsync --inplace over the "
            f"prepared folder, another tool writing there). {_SHARD_CHANGED_FIX.format(folder=self.path.parent)}"
        )


# what a shard that changed under a run is fixed by; the run's checkpoints are untouched
_SHARD_CHANGED_FIX = ("Restore the folder {folder} from an intact copy, or prepare the data again into a fresh "
                      "data.cache_dir (or delete that folder); then run again with the same trainer.run_dir: the run "
                      "resumes from its last checkpoint")


def _stamp(file: Path, sha256: str) -> list:
    """What a verification is remembered by: a rewrite changes the mtime, and a copy (even one that keeps the
    mtime and brings verified.json along: cp -a, rsync -a, tar) or a restored mtime changes the ctime (no
    tool sets it) and the inode, so it is verified again."""
    stat = file.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, sha256]


def _read_verified(folder: Path) -> dict:
    try:
        verified = json.loads((folder / VERIFIED_FILE).read_text())
        return verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):  # missing or damaged: everything is verified again, which is always safe
        return {}


def _write_verified(folder: Path, verified: dict) -> None:
    """Atomically (temp file + rename), so concurrent openers and a kill leave a whole file or the old one."""
    try:
        replace_synced(folder / VERIFIED_FILE, json.dumps(verified, indent=1).encode())
    except OSError as e:  # a read-only copy of the data: fine to use, only the check cannot be remembered
        log.warning("cannot record verified shards in %s (%s): they are hashed again at each start; set "
                    "data.verify_shards=never to skip that", folder, e)


def prepare(cfg: DataConfig, log_notes: bool = True, tokenizer: Optional[LoadedTokenizer] = None) -> PreparedData:
    """Prepare cfg's data under cfg.cache_dir, or reuse the folder prepared from the same inputs.

    Runs preparing the same inputs take turns on a lock file, so a second one waits and reuses the first one's folder.
    SIGTERM/SIGINT raise PreparationInterrupted after the worker pool and the temp folder are cleaned up.
    log_notes: say which folder is reused, and that a hub dataset is not pinned (the trainer's rank 0 alone: every rank
    calls this).
    tokenizer: load_tokenizer(cfg.tokenizer) where the caller read it already (a run's start reads the file once, so
    its checks and its data see the same tokenizer); read here otherwise.
    """
    if not isinstance(cfg, DataConfig):  # a hydra DictConfig or a plain dict with the same keys
        cfg = DataConfig(**cfg)
    source, inputs, final = _prepared_at(cfg)
    if log_notes and cfg.revision is None and names_hub_dataset(cfg):
        log.info("hub dataset %r is not pinned (data.revision unset): it is prepared from whatever revision the hub "
                 "serves at the time, and a folder prepared so is reused after the dataset changes; set "
                 "data.revision=<commit sha> to pin it (a branch or tag can move)", cfg.source)
    requested, config_eos = (tokenizer or load_tokenizer(cfg.tokenizer)) if cfg.tokenizer else (None, None)
    cache_dir = final.parent
    expected_tokenizer = fingerprint(requested) if requested else None
    if final.exists():
        if log_notes:
            log.info("reusing prepared data %s", final)
        return _same_eos(PreparedData.open(final, expected_tokenizer, cfg.verify_shards), requested, cfg, config_eos)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(cache_dir, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:  # a file in its path: the setting's (exit 1); a full, read-only, unwritable place: the machine's
        error = DataError if isinstance(e, (FileExistsError, NotADirectoryError)) else CacheWriteError
        raise error(f"cannot prepare data in data.cache_dir={cache_dir} ({e}); point data.cache_dir at a writable "
                    f"folder (or at the copy that already holds this data)") from e
    try:
        with _StopSignals() as stop, exclusive_lock(_lock_of(cache_dir, final.name), wait=True):
            if final.exists():
                if log_notes:
                    log.info("another process (another run, or another rank of this one) prepared %s while this one "
                             "waited; reusing it", final)
            else:
                _remove_dead_temp_folders(cache_dir, final.name)
                _build_atomically(cfg, source, requested, config_eos, inputs, final, stop)
    except OSError as e:  # reading the corpus raises DataError (sources.py); a write into the cache dir lands here
        if e.filename is not None and Path(cache_dir).absolute() not in Path(e.filename).absolute().parents:
            raise  # a corpus file gone since it was listed (its size is read here): not the cache dir's
        if e.filename is None and e.errno not in CACHE_WRITE_ERRNOS:
            raise _preparation_error(e, cfg, cache_dir) from e  # out of memory at a fork, an I/O error: not a full disk
        raise _cache_write_error(e, cache_dir) from e
    return _same_eos(PreparedData.open(final, expected_tokenizer, cfg.verify_shards), requested, cfg, config_eos)


# what a write into data.cache_dir fails with for the filesystem's sake, whether or not the error names a file
CACHE_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _cache_write_error(e: OSError, cache_dir: Path) -> CacheWriteError:
    """The CacheWriteError for a failed write into data.cache_dir (disk full, quota, read-only) while preparing."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space on that filesystem (or raise its quota), or point data.cache_dir at a folder with room (the "
               "prepared data takes 2 or 4 bytes per token), then run again")
    elif e.errno == errno.EROFS:
        fix = "the filesystem is mounted read-only: point data.cache_dir at a writable folder, then run again"
    else:
        fix = "check that filesystem, or point data.cache_dir at another folder, then run again"
    return CacheWriteError(f"could not write the prepared data in data.cache_dir={cache_dir}: {e.strerror or e}"
                           f"{f' ({e.filename})' if e.filename else ''}. Nothing of this preparation was kept and "
                           f"finished prepared folders are untouched; {fix}")


def _preparation_error(e: OSError, cfg: DataConfig, cache_dir: Path) -> DataError:
    """The DataError (exit 1) for an OSError without a file name that no full or read-only cache dir explains."""
    if e.errno == errno.ENOMEM:
        fix = (f"the machine is short of memory (starting a tokenization process needs a copy of this one's address "
               f"space): free memory, or lower data.num_proc (now {cfg.num_proc}), then run again")
    elif e.errno == errno.EIO:
        fix = (f"a disk failed a read or write (the corpus's, or data.cache_dir={cache_dir}'s): check the kernel log "
               f"(dmesg) and that disk, then run again")
    else:
        fix = "run again; if it repeats, look into what the error names (data.cache_dir is not full or read-only)"
    name = errno.errorcode.get(e.errno, e.errno)
    return DataError(f"preparing data.source={cfg.source} failed: {e.strerror or e} ({name}). Nothing of this "
                     f"preparation was kept and finished prepared folders are untouched; {fix}")


def _same_eos(data: PreparedData, tokenizer: Optional[Tokenizer], cfg: DataConfig, config_eos: Optional[str]) -> PreparedData:
    """data, whose documents end with the EOS the given tokenizer names now: the folder's name hashes the tokenizer's
    path, not the tokenizer_config.json (or special_tokens_map.json) that names its EOS, which may have been edited."""
    if tokenizer is None:
        return data
    eos_token, prepared_eos = find_eos(tokenizer, cfg.eos_token, config_eos)[0], data.manifest["tokenizer"]["eos_token"]
    if eos_token != prepared_eos:
        raise DataError(f"{data.path} ends documents with {prepared_eos!r}, but the tokenizer now names {eos_token!r} as its "
                        f"EOS (its tokenizer_config.json or special_tokens_map.json changed since preparation): set "
                        f"data.eos_token={prepared_eos!r} to keep that EOS, or delete {data.path} to prepare the data "
                        f"again with {eos_token!r}")
    return data


def prepared_folder(cfg: DataConfig) -> Path:
    """Where prepare(cfg) keeps the data (prepared or not yet): cheap, the corpus files are only stat'ed."""
    return _prepared_at(cfg)[2]


def _prepared_at(cfg: DataConfig) -> tuple[Source, dict, Path]:
    """cfg's source, the inputs that decide the prepared bytes, and the folder their hash names."""
    cfg.validate()
    source = resolve_source(cfg)
    inputs = _inputs(cfg, source)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return source, inputs, Path(cfg.cache_dir) / f"{source.name}-{key}"


def _build_atomically(
    cfg: DataConfig,
    source: Source,
    tokenizer: Optional[Tokenizer],
    config_eos: Optional[str],
    inputs: dict,
    final: Path,
    stop: _StopSignals,
) -> None:
    """Build in a private temp folder on the same filesystem, then rename: a failed run leaves finished folders untouched."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        with stop.deferred():
            _build(cfg, source, tokenizer, config_eos, inputs, tmp, stop)
        tmp.chmod(0o755)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            log.info("another process prepared %s first; using it", final)  # one that could not take the lock
        else:
            fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


TMP_PREFIX = ".tmp-"  # hidden, and without a manifest: never taken for a finished folder


def _lock_of(cache_dir: Path, name: str) -> Path:
    """The lock a run holds while it prepares the folder `name` (and its temp folder) in cache_dir."""
    return cache_dir / f".{name}.lock"


def _remove_dead_temp_folders(cache_dir: Path, name: str) -> None:
    """Temp folders left by killed runs: those of `name` (called under its lock, so no live run is writing them), and
    those of any other prepared folder whose lock is free (a live run preparing it holds it): else a killed preparation
    of data since changed would keep its partial shards for good."""
    by_folder: dict[str, list[Path]] = {}
    for tmp in cache_dir.glob(f"{TMP_PREFIX}*-*"):
        if tmp.is_dir():  # named <TMP_PREFIX><prepared folder>-<mkdtemp's suffix, no dash>
            by_folder.setdefault(tmp.name[len(TMP_PREFIX):].rsplit("-", 1)[0], []).append(tmp)
    for folder, dead in by_folder.items():
        try:
            with nullcontext() if folder == name else exclusive_lock(_lock_of(cache_dir, folder), wait=False):
                for tmp in dead:
                    shutil.rmtree(tmp, ignore_errors=True)
        except LockHeldError:  # a live run is preparing that folder
            continue
        log.info("removed %d unfinished temp folder(s) of %s left by a stopped run", len(dead), folder)


class _StopSignals:
    """Within `with`: the first SIGTERM/SIGINT raises PreparationInterrupted, so `finally` blocks clean up. Inside
    deferred() it is only recorded and raised by check(), which the loops call, so it never fires inside the worker
    pool's own locks (where it would deadlock the pool's shutdown)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._deferring = False
        self._previous: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:  # later signals must not interrupt the cleanup of the first
            self.signum = signum
            if not self._deferring:
                raise PreparationInterrupted(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def check(self) -> None:
        if self.signum is not None:
            raise PreparationInterrupted(self.signum)

    def checked(self, items: Iterator[T]) -> Iterator[T]:
        for item in items:
            self.check()
            yield item


def _train_bpe_stoppable(docs: Iterator[str], vocab_size: int, stop: _StopSignals) -> Tokenizer:
    """train_bpe in a thread while this (main) thread waits in short slices: the tokenizers library reads and merges
    in native threads, and Python runs a signal handler only on the main thread, so a stop waiting for the merges
    to end could take minutes. On a stop the training thread is left to end with the process."""
    result: dict = {}

    def run() -> None:
        try:
            result["tokenizer"] = train_bpe(docs, vocab_size, show_progress=sys.stderr.isatty())
        except BaseException as e:  # raised again on the main thread
            result["error"] = e

    worker = threading.Thread(target=run, name="train_bpe", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
        stop.check()
    if "error" in result:
        raise result["error"]
    return result["tokenizer"]


def _inputs(cfg: DataConfig, source: Source) -> dict:
    """Everything that decides the prepared bytes; its hash names the folder. num_proc, streaming and cache_dir do not."""
    return {
        "format_version": FORMAT_VERSION,
        "source": source.identity(),
        "split": cfg.split if source.format == "hub" else None,
        "text_field": cfg.text_field if source.format != "text" else None,
        "tokenizer": str(Path(cfg.tokenizer).expanduser().resolve()) if cfg.tokenizer else None,
        "vocab_size": cfg.vocab_size if cfg.tokenizer is None else None,
        "eos_token": cfg.eos_token,
        "val_fraction": cfg.val_fraction,
        "max_documents": cfg.max_documents,
        "tokens_per_shard": cfg.tokens_per_shard,
        "decode_errors": cfg.decode_errors,  # replace / skip / refuse bad documents: different shards and BPE
    }


def _build(
    cfg: DataConfig,
    source: Source,
    tokenizer: Optional[Tokenizer],
    config_eos: Optional[str],
    inputs: dict,
    out: Path,
    stop: _StopSignals,
) -> None:
    start = time.perf_counter()
    check_text_columns(source, cfg)
    if as_text := json_read_as_text(source):
        log.warning("data.format=text reads %s (%d .json/.jsonl file(s)) as plain text: its JSON syntax and field names are "
                    "tokenized and trained on; set data.format=json (or auto) to train on each record's %r field",
                    as_text[0], len(as_text), cfg.text_field)
    # progress counts the bytes read, decompressed: a total is known only when no file is compressed
    plain = source.files and not any(Path(f).suffix in DECOMPRESSORS for f in source.files)
    total_bytes = sum(os.path.getsize(f) for f in source.files) if plain else None
    if tokenizer is None:
        log.info("training a byte-level BPE (vocab %d) on %s", cfg.vocab_size, source.name)
        # the reading stops at TOKENIZER_TRAIN_CHARS characters of text, an unknown count of bytes (JSON syntax, UTF-8)
        bpe_total = total_bytes if total_bytes and total_bytes <= TOKENIZER_TRAIN_CHARS else None
        counts, progress = DocumentCounts(), Progress("reading for BPE", bpe_total)
        # in parts: our BPE's pre-tokenizer cuts_at_newlines, so it counts the same words as in whole text files
        parts = iter_document_parts(source, cfg, TOKENIZER_TRAIN_CHARS, counts, part_chars=TEXT_PART_CHARS)
        docs = _reporting((text for text, _ in parts), counts, progress)
        tokenizer = _train_bpe_stoppable(stop.checked(docs), cfg.vocab_size, stop)
        progress.close()
    eos_token, eos_id = find_eos(tokenizer, cfg.eos_token, config_eos)
    vocab_size = num_ids(tokenizer)
    dtype = token_dtype(vocab_size)
    write_synced(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())
    tokenizer_seconds = time.perf_counter() - start

    log.info("tokenizing %s with %d process(es)", source.name, cfg.num_proc)
    counts, progress = DocumentCounts(), Progress("tokenizing", total_bytes)
    cuts = cuts_at_newlines(tokenizer)
    part_chars = TEXT_PART_CHARS if cuts else None
    if part_chars is None and source.format == "text" and (big := [f for f in source.files if os.path.getsize(f) > 1e9]):
        log.warning("%s: a text file is one document, and this tokenizer may encode text cut into parts differently "
                    "(tokenizer.cuts_at_newlines), so each is read and tokenized whole, needing several times its size "
                    "in memory (%d file(s) over 1 GB); split such files into documents, or write them as JSON Lines",
                    big[0], len(big))
    docs = stop.checked(iter_document_parts(source, cfg, counts=counts, part_chars=part_chars))
    encoded = _tokenize(docs, tokenizer, cuts, eos_id, dtype, cfg.num_proc, stop)
    splits, num_chars = _write_shards(cfg, encoded, out, dtype,
                                      lambda tokens: progress.update(counts.bytes_read, counts.documents, tokens))
    progress.close()
    for line in counts.summary():
        log.warning("%s: %s", source.name, line)
    manifest = {
        "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "source": (f"builtin: {len(source.files)} Python stdlib files" if cfg.source == "builtin" else
                   cfg.source + (f" at revision {cfg.revision}" if cfg.revision is not None else "")),
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "fingerprint": fingerprint(tokenizer),
            "trained": cfg.tokenizer is None,
            "origin": cfg.tokenizer,
            "vocab_size": vocab_size,
            "eos_token": eos_token,
            "eos_id": eos_id,
        },
        "dtype": dtype.name,
        "num_documents": sum(split["num_documents"] for split in splits.values()),
        "num_characters": num_chars,
        "num_tokens": sum(split["num_tokens"] for split in splits.values()),
        "document_counts": counts.as_dict(),  # documents used, and rows skipped or repaired while reading
        "splits": splits,
        "prepared_with": asdict(cfg),  # the full config of the run that built this folder, for the record
        "seconds": {"tokenizer": round(tokenizer_seconds, 3), "total": round(time.perf_counter() - start, 3)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # the shards were hashed as they were written: remember that, so the first open need not read them again
    _write_verified(out, {s["file"]: _stamp(out / s["file"], s["sha256"]) for split in splits.values() for s in split["shards"]})
    write_synced(out / MANIFEST, json.dumps(manifest, indent=2).encode())  # written last: its presence marks a complete folder


def _write_shards(cfg: DataConfig, encoded: Iterator, out: Path, dtype: np.dtype, report) -> tuple[dict, int]:
    """Each encoded chunk's documents into the train or val shards; returns the manifest's splits and the characters.
    A chunk's texts are documents or parts of one (a text file read in parts): a document's parts go where it goes."""
    writers = {split: _ShardWriter(out, split, dtype, cfg.tokens_per_shard) for split in SPLITS}
    num_docs = {split: 0 for split in SPLITS}
    num_chars = 0
    doc_index = 0  # of the document the next text belongs to
    for texts, ends, tokens, lengths in encoded:
        num_chars += sum(len(t) for t in texts)
        ends = np.asarray(ends, dtype=np.int64)
        index = doc_index + np.cumsum(ends) - ends  # each text's document
        # document i is held out when the running count floor(i * val_fraction) steps up: exact and spread evenly
        is_val = np.floor((index + 1) * cfg.val_fraction) > np.floor(index * cfg.val_fraction)
        doc_index += int(ends.sum())
        text_ends = np.cumsum(lengths)
        if not is_val.any():
            writers["train"].write(tokens)
        else:
            for text_end, length, val in zip(text_ends, lengths, is_val):
                writers["val" if val else "train"].write(tokens[text_end - length : text_end])
        num_docs["val"] += int(is_val[ends == 1].sum())
        num_docs["train"] += int((~is_val[ends == 1]).sum())
        report(sum(w.num_tokens for w in writers.values()))
    splits = {}
    for split, writer in writers.items():
        shards = writer.close()
        splits[split] = {"num_documents": num_docs[split], "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards}
    return splits, num_chars


def _reporting(docs: Iterator[str], counts: DocumentCounts, progress: Progress) -> Iterator[str]:
    for text in docs:
        yield text
        if counts.documents % 1000 == 0:
            progress.update(counts.bytes_read, counts.documents)


def _tokenize(
    docs: Iterator[tuple[str, bool]], tokenizer: Tokenizer, cuts: bool, eos_id: int, dtype: np.dtype, num_proc: int,
    stop: _StopSignals
) -> Iterator[tuple[list[str], list[bool], np.ndarray, np.ndarray]]:
    """(texts, ends, tokens, lengths) per chunk of (text, whether it ends its document), in order, encoded by num_proc
    processes; cuts: cuts_at_newlines(tokenizer), worked out once."""
    chunks = _chunks(docs)
    tokenizer = for_documents(tokenizer)
    if num_proc == 1:
        for texts, ends in chunks:
            yield texts, ends, *encode_documents(tokenizer, texts, eos_id, dtype, ends, cuts)
        return
    context = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    # an executor, not mp.Pool: a worker killed by a signal or the OOM killer breaks it cleanly instead of deadlocking
    pool = ProcessPoolExecutor(num_proc, context, _init_worker, (tokenizer.to_str(), cuts, eos_id, dtype.str, os.getpid()))
    try:
        pending: deque = deque()
        for texts, ends in chunks:
            pending.append((texts, ends, pool.submit(_encode_in_worker, texts, ends)))
            if len(pending) >= 2 * num_proc:  # bounded read-ahead keeps memory flat on huge streamed corpora
                texts, ends, result = pending.popleft()
                yield texts, ends, *_result(result, stop)
        while pending:
            texts, ends, result = pending.popleft()
            yield texts, ends, *_result(result, stop)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # running chunks finish (under a second each), queued ones are dropped


def _result(result: Future, stop: _StopSignals):
    """A worker's result, waiting in short slices so a stop signal is acted on while the workers are busy."""
    while True:
        try:
            return result.result(timeout=0.1)
        except FuturesTimeout:
            stop.check()
        except BrokenProcessPool as e:
            stop.check()  # the signal that stopped us also reached the workers
            raise DataError("a tokenization process died (killed from outside, or out of memory); run preparation "
                            "again, with a smaller data.num_proc if memory is short") from e


def _chunks(docs: Iterator[tuple[str, bool]]) -> Iterator[tuple[list[str], list[bool]]]:
    chunk, ends, chars = [], [], 0
    for text, end in docs:
        chunk.append(text)
        ends.append(end)
        chars += len(text)
        if chars >= CHUNK_CHARS:
            yield chunk, ends
            chunk, ends, chars = [], [], 0
    if chunk:
        yield chunk, ends


_worker: tuple = ()


def _init_worker(tokenizer_json: str, cuts: bool, eos_id: int, dtype: str, parent: int) -> None:
    global _worker
    _die_with_parent(parent)
    # Ctrl-C and SIGTERM reach the whole process group; the parent stops the pool in order. A worker killed
    # mid-task can leave the executor's feeder thread blocked on a full pipe, hanging the parent's shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism; also silences the after-fork warning
    # as _tokenize's: for_documents once here, since to_str() keeps no encode_special_tokens (a copy per chunk otherwise)
    _worker = (for_documents(Tokenizer.from_str(tokenizer_json)), cuts, eos_id, np.dtype(dtype))


def _die_with_parent(parent: int) -> None:
    """A forked worker shares its parent's open files, the cache-dir and run-dir locks among them: left waiting for
    work after a kill -9 (the OOM killer) of its parent, it would hold those flocks forever, and the next run would
    wait on the lock of a dead pid. So the kernel kills it with its parent (Linux; spawned workers share no files)."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        os._exit(1)


def _encode_in_worker(texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    tokenizer, cuts, eos_id, dtype = _worker
    return encode_documents(tokenizer, texts, eos_id, dtype, ends, cuts)


class _ShardWriter:
    """Appends tokens to {split}_00000.bin, {split}_00001.bin, ... of at most tokens_per_shard tokens each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, tokens_per_shard: int):
        self.folder, self.split, self.dtype, self.tokens_per_shard = folder, split, dtype, tokens_per_shard
        self.shards: list[dict] = []
        self.num_tokens = 0
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._name = f"{self.split}_{len(self.shards):05d}.bin"
                self._file = open(self.folder / self._name, "wb")
                self._hash, self._count = hashlib.sha256(), 0
            part, tokens = tokens[: self.tokens_per_shard - self._count], tokens[self.tokens_per_shard - self._count :]
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(part)
            self.num_tokens += len(part)
            if self._count == self.tokens_per_shard:
                self._finish()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish()
        return self.shards

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        size = self._count * self.dtype.itemsize
        self.shards.append({"file": self._name, "num_tokens": self._count, "bytes": size, "sha256": self._hash.hexdigest()})
