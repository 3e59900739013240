"""Where documents come from: the embedded stdlib corpus, local files, or a hub dataset, all read through `datasets`."""

from __future__ import annotations

import glob
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import datasets

from .config import DataConfig, DataError

# stdlib folders that are not library source: third-party installs, test suites, compiled caches, codec tables
BUILTIN_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
BUILTIN_SUFFIXES = {".py", ".txt", ".rst"}
FORMAT_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# a source with one of these endings is a local path even when nothing matches it (so the error says "missing file")
LOCAL_SUFFIXES = {".txt", ".text", ".md", ".rst", ".py", ".json", ".jsonl", ".parquet"}


@dataclass(frozen=True)
class Source:
    name: str  # short name for the cache folder
    format: str  # text|json|parquet|hub
    files: tuple[str, ...] = ()  # absolute local paths, sorted; empty for hub
    hub_name: str = ""

    def identity(self) -> dict:
        """What decides the documents: file paths with size and mtime (a stat is cheap, hashing a corpus is not), or the name."""
        if self.format == "hub":
            return {"hub": self.hub_name}
        stats = [os.stat(f) for f in self.files]
        return {"format": self.format, "files": [[f, s.st_size, s.st_mtime_ns] for f, s in zip(self.files, stats)]}


def builtin_files() -> list[str]:
    """The default corpus: the Python standard library's own sources and text files, which ship with every install."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*")
        if p.suffix in BUILTIN_SUFFIXES and not BUILTIN_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    ]
    return sorted(str(p) for p in files)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "corpus"


def _looks_local(source: str) -> bool:
    return (
        os.path.exists(os.path.expanduser(source))
        or any(c in source for c in "*?[")
        or source.startswith(("/", ".", "~"))
        or Path(source).suffix in LOCAL_SUFFIXES
    )


def _expand_files(source: str) -> list[str]:
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        visible = [p for p in Path(path).rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)]
        return sorted(str(p.resolve()) for p in visible if p.is_file())
    return sorted({str(Path(p).resolve()) for p in glob.glob(path, recursive=True) if os.path.isfile(p)})


def resolve_source(cfg: DataConfig) -> Source:
    if cfg.source == "builtin":
        files = builtin_files()
        if not files:
            stdlib = sysconfig.get_paths()["stdlib"]
            raise DataError(f"no Python standard library sources under {stdlib}; pass data.source=<your corpus>")
        return Source("builtin", "text", tuple(files))
    if cfg.format == "hub" or (cfg.format == "auto" and not _looks_local(cfg.source)):
        return Source(_slug(cfg.source), "hub", hub_name=cfg.source)
    files = _expand_files(cfg.source)
    if not files:
        raise DataError(
            f"no files match data.source={cfg.source!r} (cwd {os.getcwd()}); check the path or glob, "
            f"or pass data.format=hub if it is a hub dataset name"
        )
    fmt = cfg.format
    if fmt == "auto":
        formats = {FORMAT_BY_SUFFIX.get(Path(f).suffix, "text") for f in files}
        if len(formats) > 1:
            raise DataError(f"data.source={cfg.source!r} mixes formats {sorted(formats)}; narrow the glob or set data.format")
        fmt = formats.pop()
    base = Path(os.path.basename(os.path.normpath(cfg.source.split("*")[0]))).stem  # "data/*.jsonl" -> "data"
    return Source(_slug(base), fmt, tuple(files))


def _load(source: Source, cfg: DataConfig):
    if source.format == "hub":
        try:
            return datasets.load_dataset(source.hub_name, split=cfg.split, streaming=cfg.streaming)
        except Exception as e:  # datasets raises many types here; the user needs one message
            raise DataError(
                f"could not load hub dataset {source.hub_name!r} (split {cfg.split!r}): {e}\n"
                f"If it is a local path, it does not exist (cwd {os.getcwd()}); if it is a hub dataset, check the name and "
                f"the network, or set HF_DATASETS_OFFLINE=1 to use a cached copy."
            ) from e
    # local files are always streamed: we read each document once, so an Arrow cache copy would only cost disk
    options = {"sample_by": "document"} if source.format == "text" else {}  # one file = one document
    return datasets.load_dataset(source.format, data_files=list(source.files), split="train", streaming=True, **options)


def iter_documents(source: Source, cfg: DataConfig, max_chars: Optional[int] = None) -> Iterator[str]:
    """Non-empty document texts in a fixed order; stops after cfg.max_documents documents or once max_chars were yielded."""
    field = "text" if source.format == "text" else cfg.text_field  # the text builder always names its column "text"
    where = source.hub_name or cfg.source
    rows = iter(_load(source, cfg))
    count, chars = 0, 0
    while cfg.max_documents is None or count < cfg.max_documents:
        try:
            row = next(rows, None)
        except Exception as e:  # malformed JSON/Parquet surfaces here as pyarrow or datasets errors
            raise DataError(f"could not read documents from {where!r}: {e}") from e
        if row is None:
            break
        if field not in row:
            raise DataError(
                f"documents from {where!r} have no field {field!r}; available fields: {sorted(row)}. "
                f"Set data.text_field to one of them"
            )
        text = row[field]
        if text is None or text == "":
            continue
        if not isinstance(text, str):
            kind = type(text).__name__
            raise DataError(f"field {field!r} of {where!r} holds {kind}, not text; set data.text_field to a text column")
        yield text
        count, chars = count + 1, chars + len(text)
        if max_chars is not None and chars >= max_chars:
            return
    if count == 0:
        raise DataError(f"the corpus {where!r} is empty: no non-empty {field!r} documents; check data.source and data.text_field")

