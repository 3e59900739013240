"""Preparation: documents -> tokenizer -> parallel tokenization -> uint16/uint32 token shards + manifest, written atomically."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

from ..durable import fsync_dir, sha256_file, write_synced
from .config import DataConfig, DataError
from .sources import Source, iter_documents, resolve_source
from .tokenizer import encode_documents, find_eos, fingerprint, load_tokenizer, token_dtype, train_bpe

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the shard layout or any choice below changes what gets written
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
TOKENIZER_TRAIN_CHARS = 200_000_000  # BPE merges settle long before this; bounds training time and memory on big corpora
CHUNK_CHARS = 1_000_000  # text per tokenization task: large enough to amortize inter-process transfer


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
    def open(cls, path: str | os.PathLike, expected_tokenizer: Optional[str] = None) -> "PreparedData":
        """Check the manifest, shard sizes and tokenizer; expected_tokenizer is the fingerprint the caller will train with."""
        path = Path(path)
        fix = f"delete {path} and run prepare again"
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            tokenizer_info, splits = manifest["tokenizer"], manifest["splits"]
            dtype = np.dtype(manifest["dtype"])
        except FileNotFoundError as e:
            raise DataError(f"{path} has no {MANIFEST}: it is not a finished prepared folder; {fix}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"the manifest {path / MANIFEST} is truncated or corrupt ({e!r}); {fix}") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version")
            raise DataError(f"{path} was prepared by format version {version}, this code reads {FORMAT_VERSION}; {fix}")
        try:
            expected_sizes = {path / shard["file"]: shard["num_tokens"] * dtype.itemsize
                              for split in SPLITS for shard in splits[split]["shards"]}
        except (KeyError, TypeError) as e:
            raise DataError(f"the manifest {path / MANIFEST} is truncated or corrupt ({e!r}); {fix}") from e
        for file, expected in expected_sizes.items():
            actual = file.stat().st_size if file.is_file() else None
            if actual != expected:
                raise DataError(f"shard {file} is truncated or missing ({actual} bytes, manifest says {expected}); {fix}")
        try:
            tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as e:  # missing or malformed file; the Rust parser raises a bare Exception
            raise DataError(f"cannot read {path / TOKENIZER_FILE} ({e}); {fix}") from e
        if fingerprint(tokenizer) != tokenizer_info["fingerprint"]:
            raise DataError(f"{path / TOKENIZER_FILE} does not match the fingerprint in its manifest (edited or damaged); {fix}")
        if expected_tokenizer is not None and expected_tokenizer != tokenizer_info["fingerprint"]:
            raise DataError(
                f"{path} holds shards from another tokenizer (fingerprint {tokenizer_info['fingerprint'][:12]}) than "
                f"data.tokenizer now points at ({expected_tokenizer[:12]}); the tokenizer file changed after preparation. "
                f"Restore it, or {fix}"
            )
        return cls(path, manifest, tokenizer)

    def num_tokens(self, split: str) -> int:
        return self._split(split)["num_tokens"]

    def shards(self, split: str) -> list[np.memmap]:
        shards = self._split(split)["shards"]
        return [np.memmap(self.path / s["file"], dtype=self.dtype, mode="r", shape=(s["num_tokens"],)) for s in shards]

    def verify_checksums(self) -> None:
        """Full content check (reads every shard); open() only checks sizes, which catches truncation cheaply."""
        for split in SPLITS:
            for shard in self._split(split)["shards"]:
                file = self.path / shard["file"]
                if sha256_file(file) != shard["sha256"]:
                    raise DataError(f"shard {file} does not match its checksum; delete {self.path} and run prepare again")

    def _split(self, split: str) -> dict:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
        return self.manifest["splits"][split]


def prepare(cfg: DataConfig) -> PreparedData:
    """Prepare cfg's data under cfg.cache_dir, or reuse the folder prepared from the same inputs."""
    if not isinstance(cfg, DataConfig):  # a hydra DictConfig or a plain dict with the same keys
        cfg = DataConfig(**cfg)
    cfg.validate()
    source = resolve_source(cfg)
    requested, config_eos = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else (None, None)
    inputs = _inputs(cfg, source)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cfg.cache_dir)
    final = cache_dir / f"{source.name}-{key}"
    expected_tokenizer = fingerprint(requested) if requested else None
    if final.exists():
        log.info("reusing prepared data %s", final)
        return PreparedData.open(final, expected_tokenizer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # build in a private temp folder on the same filesystem, then rename: a failed run leaves every finished folder untouched
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=cache_dir))
    try:
        _build(cfg, source, requested, config_eos, inputs, tmp)
        tmp.chmod(0o755)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            log.info("another process prepared %s first; using it", final)
        else:
            fsync_dir(cache_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return PreparedData.open(final, expected_tokenizer)


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
    }


def _build(
    cfg: DataConfig, source: Source, tokenizer: Optional[Tokenizer], config_eos: Optional[str], inputs: dict, out: Path
) -> None:
    start = time.perf_counter()
    if tokenizer is None:
        log.info("training a byte-level BPE (vocab %d) on %s", cfg.vocab_size, source.name)
        tokenizer = train_bpe(iter_documents(source, cfg, max_chars=TOKENIZER_TRAIN_CHARS), cfg.vocab_size)
    eos_token, eos_id = find_eos(tokenizer, cfg.eos_token, config_eos)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    write_synced(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())
    tokenizer_seconds = time.perf_counter() - start

    log.info("tokenizing %s with %d process(es)", source.name, cfg.num_proc)
    writers = {split: _ShardWriter(out, split, dtype, cfg.tokens_per_shard) for split in SPLITS}
    num_docs = {split: 0 for split in SPLITS}
    num_chars = 0
    doc_index = 0
    for texts, tokens, lengths in _tokenize(iter_documents(source, cfg), tokenizer, eos_id, dtype, cfg.num_proc):
        num_chars += sum(len(t) for t in texts)
        # document i is held out when the running count floor(i * val_fraction) steps up: exact and spread evenly
        index = np.arange(doc_index, doc_index + len(lengths))
        is_val = np.floor((index + 1) * cfg.val_fraction) > np.floor(index * cfg.val_fraction)
        doc_index += len(lengths)
        ends = np.cumsum(lengths)
        if not is_val.any():
            writers["train"].write(tokens)
        else:
            for doc_end, length, val in zip(ends, lengths, is_val):
                writers["val" if val else "train"].write(tokens[doc_end - length : doc_end])
        num_docs["val"] += int(is_val.sum())
        num_docs["train"] += int((~is_val).sum())
    splits = {}
    for split, writer in writers.items():
        shards = writer.close()
        splits[split] = {"num_documents": num_docs[split], "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards}
    seconds = time.perf_counter() - start
    manifest = {
        "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "source": f"builtin: {len(source.files)} Python stdlib files" if cfg.source == "builtin" else cfg.source,
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
        "num_documents": sum(num_docs.values()),
        "num_characters": num_chars,
        "num_tokens": sum(s["num_tokens"] for s in splits.values()),
        "splits": splits,
        "prepared_with": asdict(cfg),  # the full config of the run that built this folder, for the record
        "seconds": {"tokenizer": round(tokenizer_seconds, 3), "total": round(seconds, 3)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_synced(out / MANIFEST, json.dumps(manifest, indent=2).encode())  # written last: its presence marks a complete folder


def _tokenize(
    docs: Iterator[str], tokenizer: Tokenizer, eos_id: int, dtype: np.dtype, num_proc: int
) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """(texts, tokens, lengths) per chunk of documents, in document order, encoded by num_proc processes."""
    chunks = _chunks(docs)
    if num_proc == 1:
        for texts in chunks:
            yield texts, *encode_documents(tokenizer, texts, eos_id, dtype)
        return
    context = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(num_proc, _init_worker, (tokenizer.to_str(), eos_id, dtype.str)) as pool:
        pending: deque = deque()
        for texts in chunks:
            pending.append((texts, pool.apply_async(_encode_in_worker, (texts,))))
            if len(pending) >= 2 * num_proc:  # bounded read-ahead keeps memory flat on huge streamed corpora
                texts, result = pending.popleft()
                yield texts, *result.get()
        while pending:
            texts, result = pending.popleft()
            yield texts, *result.get()


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for text in docs:
        chunk.append(text)
        chars += len(text)
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


_worker: tuple = ()


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism; also silences the after-fork warning
    _worker = (Tokenizer.from_str(tokenizer_json), eos_id, np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tokenizer, eos_id, dtype = _worker
    return encode_documents(tokenizer, texts, eos_id, dtype)


class _ShardWriter:
    """Appends tokens to {split}_00000.bin, {split}_00001.bin, ... of at most tokens_per_shard tokens each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, tokens_per_shard: int):
        self.folder, self.split, self.dtype, self.tokens_per_shard = folder, split, dtype, tokens_per_shard
        self.shards: list[dict] = []
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
