"""Where documents come from: the embedded stdlib corpus, local files, or a hub dataset, all read through `datasets`."""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import json
import logging
import lzma
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from .config import DataConfig, DataError
from .tokenizer import NEWLINE_BETWEEN_TEXT

log = logging.getLogger(__name__)

# stdlib folders that are not library source: third-party installs, test suites, compiled caches, codec tables
BUILTIN_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
BUILTIN_SUFFIXES = {".py", ".txt", ".rst"}
FORMAT_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
BINARY_FORMATS = {"parquet": "Parquet", "arrow": "Arrow"}  # read as text or JSON, their bytes are garbage
# compressed text and JSON files are read through the stdlib's decompressors; the format is the suffix before it
DECOMPRESSORS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
UNSUPPORTED_COMPRESSION = {".zst": "zstd -d", ".zstd": "zstd -d", ".lz4": "lz4 -d", ".zip": "unzip", ".7z": "7z x",
                           ".tar": "tar xf", ".tgz": "tar xzf", ".tbz2": "tar xjf", ".txz": "tar xJf"}
PARQUET_BATCH_ROWS = 64  # rows decoded at a time: documents of 1 MB each still hold only 64 MB
PARQUET_BUFFER_BYTES = 1 << 20  # bytes of a column chunk read at a time
# a source with one of these endings is a local path even when nothing matches it (so the error says "missing file")
LOCAL_SUFFIXES = {".txt", ".text", ".md", ".rst", ".py", ".json", ".jsonl", ".parquet", ".arrow", *DECOMPRESSORS, *UNSUPPORTED_COMPRESSION}


def format_suffix(file: str) -> str:
    """The suffix that names a file's format: "corpus.jsonl.gz" -> ".jsonl"."""
    path = Path(file)
    return Path(path.stem).suffix if path.suffix in DECOMPRESSORS else path.suffix


def open_binary(file: str):
    """The file's bytes, decompressed when its name ends in .gz, .bz2 or .xz."""
    return DECOMPRESSORS.get(Path(file).suffix, open)(file, "rb")


def universal_newlines(text: str) -> str:
    """CR LF and a lone CR as LF, as when a file is opened as text."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclass(frozen=True)
class Source:
    name: str  # short name for the cache folder
    format: str  # text|json|parquet|hub
    files: tuple[str, ...] = ()  # absolute local paths, sorted; empty for hub
    hub_name: str = ""
    revision: Optional[str] = None  # data.revision of a hub dataset

    def identity(self) -> dict:
        """What decides the documents: file paths with size and mtime (a stat is cheap, hashing a corpus is not), or the
        name and data.revision."""
        if self.format == "hub":
            # a local dataset folder (data.format=hub reads it through datasets): an edit in place keeps its name
            local = _expand_files(self.hub_name) if os.path.isdir(os.path.expanduser(self.hub_name)) else []
            # the revision only where set: folders prepared unpinned keep their names
            return ({"hub": self.hub_name} | ({"revision": self.revision} if self.revision is not None else {})
                    | ({"files": _file_stats(local)} if local else {}))
        return {"format": self.format, "files": _file_stats(self.files)}


def _file_stats(files) -> list:
    return [[f, s.st_size, s.st_mtime_ns] for f, s in zip(files, map(os.stat, files))]


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
    """A path the user means as a file, folder or glob: only an existing path, a bare `name` or an `org/name` whose org is
    not a local folder can be a hub dataset, so a mistyped path fails at once instead of after hub retries."""
    if os.path.exists(os.path.expanduser(source)) or source.startswith(("/", ".", "~")) or any(c in source for c in "*?["):
        return True
    if Path(source).suffix in LOCAL_SUFFIXES or source.count("/") > 1:
        return True
    return "/" in source and os.path.isdir(source.split("/")[0])  # "data/corpus" with a local data/ folder


def names_hub_dataset(cfg: DataConfig) -> bool:
    """Whether data.source is a dataset load_dataset fetches from the Hugging Face hub by name (or takes from its
    cache), not a local file, folder or glob (data.format=hub reads a local folder through datasets too)."""
    if cfg.source == "builtin" or os.path.exists(os.path.expanduser(cfg.source)):
        return False
    return cfg.format == "hub" or (cfg.format == "auto" and not _looks_local(cfg.source))


def _expand_files(source: str) -> list[str]:
    path = os.path.expanduser(source)
    if os.path.isdir(path):  # as a glob lists it: symlinked folders followed, each file once (a link to a file read too)
        files, folders = set(), set()
        for folder, subfolders, names in os.walk(path, followlinks=True):
            real = os.path.realpath(folder)
            if real in folders:  # a link back up the tree (or to a folder listed already)
                subfolders.clear()
                continue
            folders.add(real)
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
            visible = [Path(folder, n) for n in names if not n.startswith(".")]
            _check_links(visible, source)
            files.update(str(p.resolve()) for p in visible if p.is_file())
        return sorted(files)
    matches = glob.glob(path, recursive=True)
    _check_links(map(Path, matches), source)
    return sorted({str(Path(p).resolve()) for p in matches if os.path.isfile(p)})


def _check_links(paths, source: str) -> None:
    """DataError naming a symbolic link whose target is gone (an unmounted disk, a moved corpus): skipped, its
    documents would be left out of the prepared data without a word."""
    # realpath, not exists(): a path a glob built through a loop of links (a/loop/a/loop/...) fails stat with ELOOP
    if dangling := [p for p in paths if p.is_symlink() and not os.path.exists(os.path.realpath(p))]:
        raise DataError(f"data.source={source!r}: {dangling[0]} is a symbolic link to {os.readlink(dangling[0])}, which "
                        f"does not exist ({len(dangling)} such link(s) here); restore what it points to, or remove the link")


def resolve_source(cfg: DataConfig) -> Source:
    if cfg.source == "builtin":
        files = builtin_files()
        if not files:
            stdlib = sysconfig.get_paths()["stdlib"]
            raise DataError(f"no Python standard library sources under {stdlib}; pass data.source=<your corpus>")
        return Source("builtin", "text", tuple(files))
    if cfg.format in ("auto", "hub", "arrow") and (saved := _saved_dataset_files(cfg)):  # load_dataset refuses these
        return Source(_slug(Path(cfg.source).expanduser().resolve().name), "arrow", tuple(saved))
    if cfg.format == "hub" or names_hub_dataset(cfg):  # data.format=hub also reads a local folder through datasets
        return Source(_slug(cfg.source), "hub", hub_name=cfg.source, revision=cfg.revision)
    # data.cache_dir inside the source's folder: its prepared files are not corpus
    cache = Path(cfg.cache_dir).expanduser().resolve()
    files = [f for f in _expand_files(cfg.source) if cache not in Path(f).parents]
    if not files:
        raise DataError(
            f"no files match data.source={cfg.source!r} (cwd {os.getcwd()}); check the path or glob, "
            f"or pass data.format=hub if it is a hub dataset name"
        )
    if layout := _split_layout(files, cfg.source):
        found = "; ".join(f"{split}: {len(fs)} file(s), e.g. {fs[0]}" for split, fs in layout.items())
        if os.path.isdir(os.path.expanduser(cfg.source)):
            raise DataError(f"data.source={cfg.source!r} is a dataset laid out in splits as Hugging Face names them "
                            f"({found}); read whole, its {' and '.join(s for s in layout if s != 'train')} split(s) "
                            f"would be trained on. Set data.format=hub to read its data.split split ({cfg.split!r}) as "
                            "load_dataset does (text files: a document a line), or name the files to train on"
                            + (f" (data.source={example!r})" if (example := _train_files_example(layout["train"])) else
                               " with a glob") + ", which is read as given")
        log.warning("data.source=%r matches files of several splits as Hugging Face names them (%s): all are read as "
                    "training data (validation is data.val_fraction of them); narrow the glob if that is not meant",
                    cfg.source, found)
    # archives and other compressions, also inside .gz/.bz2/.xz (corpus.tar.gz): their bytes are not documents
    if packed := sorted({f for f in files if format_suffix(f) in UNSUPPORTED_COMPRESSION}):
        tool = UNSUPPORTED_COMPRESSION[format_suffix(packed[0])]
        raise DataError(f"{packed[0]} is an archive or compressed in a format this reader does not open ({len(packed)} "
                        f"such files); unpack it first ({tool}), or compress files one by one as .gz, .bz2 or .xz, which "
                        "are read as they are")
    fmt = cfg.format
    # Parquet and Arrow are binary: read as text or JSON they give U+FFFD garbage (trained on, with only a decode warning)
    binary = [f for f in files if FORMAT_BY_SUFFIX.get(format_suffix(f)) in BINARY_FORMATS]
    if fmt in ("text", "json") and binary:
        kind = FORMAT_BY_SUFFIX[format_suffix(binary[0])]
        raise DataError(f"data.format={fmt} reads {binary[0]} ({len(binary)} .{kind} files) as {fmt}, but "
                        f"{BINARY_FORMATS[kind]} is binary; set data.format={kind} (or auto), or narrow data.source to "
                        f"the {fmt} files")
    if fmt == "auto":
        format_of = {f: FORMAT_BY_SUFFIX.get(format_suffix(f), "text") for f in files}
        # an empty marker beside data files (Spark's _SUCCESS) holds no document: it decides no format, nor is read
        markers = {f for f in files if format_of[f] == "text" and os.path.getsize(f) == 0}
        if any(format_of[f] != "text" for f in files):
            files = [f for f in files if f not in markers]
        formats = {format_of[f] for f in files}
        if len(formats) > 1:
            example = {}
            for f in files:
                example.setdefault(format_of[f], f)
            found = ", ".join(f"{f} is {kind}" for kind, f in sorted(example.items()))
            fix = "narrow the glob or set data.format"
            # a dataset folder as the hub has it: data.format=parquet alone would then fail on its README.md
            if os.path.isdir(os.path.expanduser(cfg.source)) and (data := [f for k, f in sorted(example.items()) if k != "text"]):
                suffix = "".join(Path(data[0]).suffixes[-2:]) if Path(data[0]).suffix in DECOMPRESSORS else Path(data[0]).suffix
                fix = (f"narrow it to one format (e.g. data.source='{cfg.source.rstrip('/')}/**/*{suffix}'), or, for a "
                       "Hugging Face dataset folder, set data.format=hub (read as load_dataset reads it, its data.split split)")
            raise DataError(f"data.source={cfg.source!r} mixes formats {sorted(formats)} ({found}); {fix}")
        fmt = formats.pop()
    base = Path(os.path.basename(os.path.normpath(cfg.source.split("*")[0]))).stem  # "data/*.jsonl" -> "data"
    return Source(_slug(base), fmt, tuple(files))


def _split_layout(files: list[str], source: str) -> dict[str, list[str]]:
    """The files of each split, where every data file of `source` names one (as datasets infers splits: a file or
    folder name of its keywords, e.g. data/train-00000-of-00002.parquet, test.jsonl, valid/part-0.txt) and there are
    a train split and another; else {} (a corpus whose files merely include test_x.py or dev_notes.txt)."""
    if len(files) < 2:  # one file names one split at most: no datasets import at start for it
        return {}
    from datasets.data_files import FILES_TO_IGNORE, NON_WORDS_CHARS, SPLIT_KEYWORDS

    sep = NON_WORDS_CHARS  # "-._ 0-9": a character class as it stands (a leading '-', a range of digits)
    keyword = {str(split): re.compile(rf"(^|[{sep}])({'|'.join(words)})([{sep}]|$)")
               for split, words in SPLIT_KEYWORDS.items()}
    root = os.path.expanduser(source.split("*")[0].split("?")[0].split("[")[0])
    root = root if os.path.isdir(root) else os.path.dirname(root)
    layout: dict[str, list[str]] = {}
    for f in files:
        if Path(f).name in FILES_TO_IGNORE:
            continue
        parts = Path(os.path.relpath(f, os.path.realpath(root))).parts
        # the file's name decides first, then its folders, innermost first
        split = next((s for part in reversed(parts) for s, k in keyword.items() if k.search(part)), None)
        if split is None:
            return {}
        layout.setdefault(split, []).append(f)
    return layout if "train" in layout and len(layout) > 1 else {}


def _train_files_example(files: list[str]) -> Optional[str]:
    """The train split's one file, or a glob of their folder, the start and end their names share (data/train-*.parquet),
    where it matches exactly them; else None."""
    if len(files) == 1:
        return files[0]
    folder = os.path.commonpath(files)
    names = [os.path.relpath(f, folder) for f in files]
    stem, suffix = os.path.commonprefix(names), os.path.commonprefix([n[::-1] for n in names])[::-1]
    example = os.path.join(folder, f"{stem}*{suffix}")
    return example if _expand_files(example) == sorted(files) else None


def _saved_dataset_files(cfg: DataConfig) -> list[str]:
    """The .arrow files, in order, of a folder written by datasets' save_to_disk (of a DatasetDict, those of its data.split
    split); none for any other source."""
    folder = Path(cfg.source).expanduser()
    try:
        if (folder / "dataset_dict.json").is_file():
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
            if cfg.split not in splits:
                raise DataError(f"{folder} (a DatasetDict saved by save_to_disk) has no split {cfg.split!r}; its splits are "
                                f"{splits}: set data.split to one of them")
            if others := [s for s in splits if s != cfg.split]:
                log.info("%s: reading its split %r (data.split); its other splits %s are not read, and validation is "
                         "data.val_fraction of %r", folder, cfg.split, others, cfg.split)
            folder = folder / cfg.split
        if not (folder / "state.json").is_file():
            return []
        files = [folder / f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"could not read the dataset datasets' save_to_disk wrote in {folder}: {e!r}; save it again") from e
    if missing := [f for f in files if not f.is_file()]:
        raise DataError(f"{missing[0]}, listed in {folder / 'state.json'}, is missing ({len(missing)} of {len(files)} "
                        "files); copy the whole folder, or save the dataset again")
    return [str(f.resolve()) for f in files]


def json_read_as_text(source: Source) -> list[str]:
    """The .json/.jsonl files of a source that data.format=text reads as plain text (asked for, so not refused: their
    JSON syntax and field names become training tokens)."""
    return [f for f in source.files if source.format == "text" and FORMAT_BY_SUFFIX.get(format_suffix(f)) == "json"]


@dataclass
class DocumentCounts:
    """What reading the corpus met, for the log and the manifest; `first` holds where each kind was first seen."""

    documents: int = 0  # non-empty documents yielded
    empty: int = 0  # rows whose text is ""
    missing_field: int = 0  # rows without the text field (or with null there), skipped
    replaced: int = 0  # documents with invalid UTF-8, decoded with U+FFFD (decode_errors=replace)
    skipped: int = 0  # documents dropped for invalid UTF-8 or malformed JSON (decode_errors=skip_document)
    bytes_read: int = 0  # of local files, for progress
    first: dict = field(default_factory=dict)

    def note(self, kind: str, where: str, warn: bool) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind not in self.first:
            self.first[kind] = where
            if warn:
                log.warning("%s: %s; later ones are only counted (summary at the end)", where, PROBLEMS[kind])

    def summary(self) -> list[str]:
        """One line per kind of problem met: its count and first location."""
        return [f"{getattr(self, kind):,} documents: {PROBLEMS[kind]} (first at {where})" for kind, where in self.first.items()]

    def as_dict(self) -> dict:
        kinds = ("documents", "empty", "missing_field", "replaced", "skipped")
        return {k: getattr(self, k) for k in kinds} | {"first": dict(self.first)}


PROBLEMS = {
    "missing_field": "no text field (or null), skipped; set data.text_field if the text is in another column",
    "replaced": "invalid UTF-8 or lone UTF-16 surrogates, replaced by U+FFFD (data.decode_errors=replace)",
    "skipped": "invalid UTF-8, lone UTF-16 surrogates or malformed JSON, skipped (data.decode_errors=skip_document)",
}
NEWLINE = b"\n"
MISSING_FIELD_LIMIT = 1000  # this many rows without the field before any document: data.text_field is wrong


def _per_decode_errors(where: str, problem: str, repaired: Callable[[], str], cfg: DataConfig, counts: DocumentCounts,
                       warn: bool) -> Optional[str]:
    """A document holding text that is not valid Unicode (`problem`, naming its place), per data.decode_errors: the
    repaired text (U+FFFD in place of the bad part), None to skip it, or a DataError naming the fix."""
    if cfg.decode_errors == "strict":
        raise DataError(f"{problem}; fix the file, or set data.decode_errors=replace (the bad part becomes U+FFFD) or "
                        "skip_document (drop such documents)")
    counts.note("skipped" if cfg.decode_errors == "skip_document" else "replaced", where, warn)
    return None if cfg.decode_errors == "skip_document" else repaired()


def _invalid_utf8(file: str, line: int, e: UnicodeDecodeError, offset: int = 0) -> str:
    """The problem: a document's invalid UTF-8 at file:line, e (its decoding of bytes from the document's byte offset)."""
    return f"{file}:{line}: invalid UTF-8 ({e.reason} at byte {offset + e.start} of the document)"


def _decode(data: bytes, file: str, line: int, cfg: DataConfig, counts: DocumentCounts, warn: bool) -> Optional[str]:
    """UTF-8 text of a document starting at file:line, per data.decode_errors; None means skip this document."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = _invalid_utf8(file, line + data.count(NEWLINE, 0, e.start), e)
        return _per_decode_errors(f"{file}:{line}", problem, lambda: data.decode("utf-8", errors="replace"), cfg, counts, warn)


UTF8_BOM = b"\xef\xbb\xbf"
# byte-order marks of the other Unicode encodings (UTF-32 LE's starts with UTF-16 LE's: it is looked for first)
OTHER_BOMS = {b"\xff\xfe\x00\x00": "UTF-32LE", b"\x00\x00\xfe\xff": "UTF-32BE", b"\xff\xfe": "UTF-16LE",
              b"\xfe\xff": "UTF-16BE"}


def check_utf8(head: bytes, file: str) -> None:
    """DataError where a file starts with a UTF-16 or UTF-32 byte-order mark: read as UTF-8, its ASCII text is valid
    bytes interleaved with NULs, trained on as such under decode_errors=replace."""
    encoding = next((name for bom, name in OTHER_BOMS.items() if head.startswith(bom)), None)
    if encoding is not None:
        raise DataError(f"{file} is {encoding} text (it starts with that byte-order mark), not UTF-8, the only encoding "
                        f"read; convert it to UTF-8 first (e.g. iconv -f {encoding} -t UTF-8)")


LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud83d" escapes decode to code points UTF-8 cannot encode


TEXT_BLOCK_BYTES = 1 << 20  # a text file is read and decoded this many bytes at a time


def _text_blocks(f, file: str, on_invalid: Callable[[str], bool]) -> Iterator[tuple[int, str]]:
    """A binary text file's UTF-8 text block by block, as (bytes read, text): without a UTF-8 byte-order mark, newlines
    universal. A character or a CR LF cut by a block's end is decoded with the next block, so the blocks join into the
    whole file decoded at once. At the first invalid UTF-8, on_invalid(problem naming file:line) decides: True reads on
    with U+FFFD in place of the bad bytes, False stops the decoding (the rest is read only to count its bytes)."""
    errors, held, held_cr, offset, newlines = "strict", b"", "", 0, 0  # held: the start of a character cut by the block end
    block = f.read(max(TEXT_BLOCK_BYTES, 4))  # at least a byte-order mark's 4 bytes
    check_utf8(block, file)
    size, block = len(block), block.removeprefix(UTF8_BOM)
    while True:
        final = size == 0
        data = held + block
        try:
            text, used = codecs.utf_8_decode(data, errors, final)
        except UnicodeDecodeError as e:
            if not on_invalid(_invalid_utf8(file, 1 + newlines + data.count(NEWLINE, 0, e.start), e, offset)):
                # a skipped file is still read to its end, as the progress counts (and the file sizes total) its bytes
                yield size + sum(len(rest) for rest in iter(lambda: f.read(TEXT_BLOCK_BYTES), b"")), ""
                return
            errors = "replace"
            text, used = codecs.utf_8_decode(data, errors, final)
        newlines, offset, held = newlines + data.count(NEWLINE, 0, used), offset + used, data[used:]
        text = held_cr + text
        held_cr = "\r" if text.endswith("\r") and not final else ""  # its LF may start the next block
        yield size, universal_newlines(text[: len(text) - len(held_cr)])
        if final:
            return
        block = f.read(TEXT_BLOCK_BYTES)
        size = len(block)


def _text_rows(file: str, cfg: DataConfig, counts: DocumentCounts, warn: bool,
               part_chars: Optional[int] = None) -> Iterator[tuple[str, dict, bool]]:
    """One document per file, newlines universal ("\r\n" and "\r" become "\n") as when a file is opened as text,
    without a UTF-8 byte-order mark (Windows editors write one: it marks the encoding, it is not text): (where, row,
    whether the row ends the document). With part_chars the text comes in parts of about that many characters (more
    where no cut is possible for longer), cut just after a newline between two non-space characters (NEWLINE_BETWEEN_TEXT,
    where cuts_at_newlines tokenizers end a piece): a 10 GB file is never held whole. Without it, the whole text is one row."""
    where = f"{file}:1"
    skipped = False

    def read_on(problem: str) -> bool:  # per data.decode_errors: strict raises, skip_document stops, replace reads on
        nonlocal skipped
        skipped = _per_decode_errors(where, problem, lambda: "", cfg, counts, warn) is None
        return not skipped

    if part_chars is not None and cfg.decode_errors == "skip_document":
        # a part handed on cannot be taken back: the whole file's UTF-8 is checked before its first part
        with open_binary(file) as f:
            read = sum(size for size, _ in _text_blocks(f, file, read_on))
        if skipped:
            counts.bytes_read += read
            return
    pending, pending_chars, tail = [], 0, ""  # text read but not yet handed on, and its last two characters
    with open_binary(file) as f:
        for size, text in _text_blocks(f, file, read_on):
            counts.bytes_read += size
            # the first cut past part_chars, searched in the new text (and at a newline ending the pending text, whose
            # next character only this text shows), so a long stretch without a cut is not searched again and again
            while part_chars is not None and pending_chars + len(text) > part_chars:
                start = len(tail) - 1 + max(0, part_chars - pending_chars)
                cut = NEWLINE_BETWEEN_TEXT.search(tail + text, max(start, 0))
                if cut is None:  # no place to cut yet (a very long line): the part grows until there is one
                    break
                end = cut.end() - len(tail)
                yield where, {"text": "".join(pending) + text[:end]}, False
                pending, pending_chars, tail, text = [], 0, "", text[end:]
            if text:
                pending.append(text)
                pending_chars += len(text)
                tail = (tail + text[-2:])[-2:]
    text, pending = "".join(pending), []  # the blocks are not kept beside the text through its BPE reading and tokenizing
    if not skipped:
        yield where, {"text": text}, True


def _json_rows(file: str, cfg: DataConfig, counts: DocumentCounts, warn: bool) -> Iterator[tuple[str, dict]]:
    """JSON Lines (one object per line), or a file holding one JSON array of objects."""
    with open_binary(file) as f:
        head = f.read(4)
        check_utf8(head, file)
        bom = head.startswith(UTF8_BOM)  # a byte-order mark (Windows editors and PowerShell write one) is not JSON
        f.seek(len(UTF8_BOM) if bom else 0)
        is_array = f.read(4096).lstrip()[:1] == b"["
        f.seek(len(UTF8_BOM) if bom else 0)
        if is_array:
            data = f.read()
            counts.bytes_read += len(data)
            # invalid UTF-8 as lone surrogates (strict stops here, naming the line): iter_document_parts then repairs or skips
            # each document holding some, per data.decode_errors, not the whole file's documents as one
            strict = cfg.decode_errors == "strict"
            text = _decode(data, file, 1, cfg, counts, warn) if strict else data.decode("utf-8", errors="surrogateescape")
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"could not read documents from {file}:{e.lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(rows, list):
                raise DataError(f"{file} starts like a JSON array but is not one; use JSON Lines or an array of objects")
            for i, row in enumerate(rows):
                yield _json_object(row, f"{file} item {i}")
            return
        for number, line in enumerate(_lines(f), start=1):
            counts.bytes_read += len(line)
            if not line.strip():
                continue
            where = f"{file}:{number}"
            text = _decode(line, file, number, cfg, counts, warn)
            if text is None:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                if cfg.decode_errors == "skip_document":
                    counts.note("skipped", where, warn)
                    continue
                raise DataError(
                    f"could not read documents from {where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                    f"that line, or set data.decode_errors=skip_document to skip such lines (counted in the manifest)"
                ) from e
            yield _json_object(row, where)


LONE_CR = re.compile(rb"(?<=\r)(?!\n)")  # where a line ends at a CR not followed by LF (classic Mac line endings)


def _lines(f) -> Iterator[bytes]:
    """A binary file's lines ended by LF, CR LF or a lone CR, as when a file is opened as text: JSON holds no raw CR
    inside a string, so a lone CR ends a record (one per line was read as a single line, then refused as Extra data)."""
    for line in f:
        if b"\r" not in line:
            yield line
            continue
        yield from (piece for piece in LONE_CR.split(line) if piece)


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array"}


def _json_object(row, where: str) -> tuple[str, dict]:
    if not isinstance(row, dict):
        kind = _JSON_TYPES.get(type(row), type(row).__name__)
        raise DataError(f"{where} holds a JSON {kind}, not an object; each document must be an object like "
                        f'{{"text": "..."}}')
    return where, row


def _column_rows(file: str, columns: list[str], batches: Callable[[], Iterator[pa.RecordBatch]], cfg: DataConfig,
                 counts: DocumentCounts, warn: bool) -> Iterator[tuple[str, dict]]:
    """The text field of each row of a columnar file, whose columns are `columns`, read batch by batch; a binary
    column (Spark and Hive write strings without the UTF-8 annotation) decoded as UTF-8 per data.decode_errors."""
    if cfg.text_field not in columns:  # check_text_columns refused it before any work; a file replaced since
        raise _no_text_column(file, columns, cfg)
    row = 0
    for batch in batches():
        for value in batch.column(cfg.text_field).to_pylist():
            row += 1
            if isinstance(value, bytes):
                value = _decode_value(value, f"{file} row {row}", cfg, counts, warn)
                if value is None:
                    continue
            yield f"{file} row {row}", {cfg.text_field: value}
    counts.bytes_read += os.path.getsize(file)  # progress of columnar files moves file by file


def _decode_value(data: bytes, where: str, cfg: DataConfig, counts: DocumentCounts, warn: bool) -> Optional[str]:
    """UTF-8 text of one binary value, per data.decode_errors; None means skip this document."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = f"{where}: invalid UTF-8 ({e.reason} at byte {e.start} of the document)"
        return _per_decode_errors(where, problem, lambda: data.decode("utf-8", errors="replace"), cfg, counts, warn)


def _parquet_rows(file: str, cfg: DataConfig, counts: DocumentCounts, warn: bool) -> Iterator[tuple[str, dict]]:
    try:
        # read page by page (buffer_size, no pre_buffer) in batches of a few rows: by default a whole column chunk and
        # 65536 rows are read at once, so memory grew with the row group (+308 MB for a 53 MB one, +83 MB so)
        parquet = pq.ParquetFile(file, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
        batches = lambda: parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[cfg.text_field])
        yield from _column_rows(file, parquet.schema_arrow.names, batches, cfg, counts, warn)
    except (OSError, pa.ArrowException) as e:
        other = ("" if format_suffix(file) == ".parquet" else
                 " (data.format=parquet reads every file as Parquet: set data.format=auto or the files' format)")
        raise DataError(f"could not read documents from {file}: {e}; the file is damaged or not Parquet{other}") from e


def _arrow_rows(file: str, cfg: DataConfig, counts: DocumentCounts, warn: bool) -> Iterator[tuple[str, dict]]:
    """An Arrow IPC stream, as datasets writes its .arrow files (save_to_disk, its cache), or an Arrow IPC file."""
    try:
        with pa.memory_map(file) as mapped:
            reader, batches = _arrow_reader(mapped)
            yield from _column_rows(file, reader.schema.names, batches, cfg, counts, warn)
    except (OSError, pa.ArrowException) as e:
        other = ("" if format_suffix(file) == ".arrow" else
                 " (data.format=arrow reads every file as Arrow: set data.format=auto or the files' format)")
        raise DataError(f"could not read documents from {file}: {e}; the file is damaged or not Arrow{other}") from e


def _arrow_reader(mapped: pa.MemoryMappedFile):
    """The reader of an Arrow IPC stream or file, and a function giving its record batches."""
    try:
        reader = pa.ipc.open_stream(mapped)
        return reader, lambda: iter(reader)
    except pa.ArrowInvalid:  # not a stream: the IPC file format (pyarrow's, feather v2)
        mapped.seek(0)
        reader = pa.ipc.open_file(mapped)
        return reader, lambda: (reader.get_batch(i) for i in range(reader.num_record_batches))


def check_text_columns(source: Source, cfg: DataConfig) -> None:
    """Refuse Parquet and Arrow files without the data.text_field column from their schemas alone: reading meets
    such a shard only when it gets there, after a BPE was trained on the others or midway through tokenizing."""
    if source.format not in BINARY_FORMATS:
        return
    lacking = {}
    for file in source.files:
        try:
            if source.format == "parquet":
                columns = pq.read_schema(file).names
            else:
                with pa.memory_map(file) as mapped:
                    columns = _arrow_reader(mapped)[0].schema.names
        except (OSError, pa.ArrowException):
            continue  # damaged or not of its format: reading it names the file and the fix
        if cfg.text_field not in columns:
            lacking[file] = columns
    if lacking:
        file, columns = next(iter(lacking.items()))
        more = f" (and {len(lacking) - 1} more file{'s' if len(lacking) > 2 else ''})" if len(lacking) > 1 else ""
        raise _no_text_column(file, columns, cfg, more)


def _no_text_column(file: str, columns: list[str], cfg: DataConfig, more: str = "") -> DataError:
    return DataError(f"{file} has no column {cfg.text_field!r}{more}; available fields: {sorted(columns)}. "
                     f"Set data.text_field to one of them")


def _hub_rows(source: Source, cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    import datasets  # here, not at the top: ~1 s of every start (train.py --help too) that reads no hub dataset

    try:
        rows = iter(datasets.load_dataset(source.hub_name, split=cfg.split, streaming=cfg.streaming,
                                          revision=source.revision))
    except Exception as e:  # datasets raises many types here; the user needs one message
        revision = f", revision {source.revision!r}" if source.revision is not None else ""
        raise DataError(
            f"could not load hub dataset {source.hub_name!r} (split {cfg.split!r}{revision}): {e}\n"
            f"If it is a local path, it does not exist (cwd {os.getcwd()}); if it is a hub dataset, check the name"
            f"{' and data.revision' if revision else ''} and the network, or set HF_DATASETS_OFFLINE=1 to use a cached "
            f"copy."
        ) from e
    number = 0
    while True:
        try:
            row = next(rows, None)
        except Exception as e:  # a damaged download surfaces here as pyarrow or datasets errors
            raise DataError(f"could not read documents from hub dataset {source.hub_name!r} after row {number}: {e}") from e
        if row is None:
            return
        number += 1
        yield f"{source.hub_name} row {number}", row


READERS = {"json": _json_rows, "parquet": _parquet_rows, "arrow": _arrow_rows}


def _rows(source: Source, cfg: DataConfig, counts: DocumentCounts, warn: bool,
          part_chars: Optional[int]) -> Iterator[tuple[str, dict, bool]]:
    """(where, row, whether it ends its document) in a fixed order; where is file:line (or row/item) for messages. Only
    a text file's rows can be parts of one document (_text_rows, with part_chars)."""
    if source.format == "hub":
        yield from ((where, row, True) for where, row in _hub_rows(source, cfg))
        return
    for file in source.files:
        try:
            if source.format == "text":
                yield from _text_rows(file, cfg, counts, warn, part_chars)
            else:
                yield from ((where, row, True) for where, row in READERS[source.format](file, cfg, counts, warn))
        except (OSError, EOFError, lzma.LZMAError) as e:  # removed or unreadable after listing, or a damaged archive
            raise DataError(f"could not read documents from {file}: {e}") from e


def iter_document_parts(
    source: Source, cfg: DataConfig, max_chars: Optional[int] = None, counts: Optional[DocumentCounts] = None,
    part_chars: Optional[int] = None,
) -> Iterator[tuple[str, bool]]:
    """(text, whether it ends its document) of the non-empty documents in a fixed order; stops after cfg.max_documents
    documents or once max_chars were yielded, at a document's end. With part_chars a text file longer than that comes in
    parts that encode into the ids of the whole with a cuts_at_newlines tokenizer (_text_rows); every other document
    is one text.

    Rows without the text field, and undecodable ones (per data.decode_errors), are counted in `counts`; passing `counts`
    also logs a warning at the first of each kind (the caller logs the summary).
    """
    warn = counts is not None
    counts = counts if counts is not None else DocumentCounts()
    field_name = "text" if source.format == "text" else cfg.text_field  # a text file is one document named "text"
    where_all = source.hub_name or cfg.source
    chars, fields_seen = 0, None
    for where, row, ends in _rows(source, cfg, counts, warn, part_chars):
        text = row.get(field_name)
        if text is None:
            if field_name not in row and fields_seen is None:
                fields_seen = sorted(row)
            counts.note("missing_field", where, warn)
            if counts.documents == 0 and counts.missing_field >= MISSING_FIELD_LIMIT:
                break
            continue
        if text == "":
            counts.empty += 1
            continue
        if not isinstance(text, str):
            kind = type(text).__name__
            raise DataError(f"field {field_name!r} at {where} holds {kind}, not text; set data.text_field to a text column")
        if not text.isascii() and LONE_SURROGATE.search(text):  # e.g. half of an emoji's escape pair, cut by a scraper
            problem = f"{where}: the text holds a lone UTF-16 surrogate (an escape like \\ud83d without its pair)"
            text = _per_decode_errors(where, problem, lambda: LONE_SURROGATE.sub("\ufffd", text), cfg, counts, warn)
            if text is None:
                continue
        yield text, ends
        chars += len(text)
        if not ends:
            continue
        counts.documents += 1
        if counts.documents == cfg.max_documents or (max_chars is not None and chars >= max_chars):
            return
    if counts.documents == 0 and fields_seen is not None and counts.empty == 0:
        raise DataError(
            f"documents from {where_all!r} have no field {field_name!r}; available fields: {fields_seen}. "
            f"Set data.text_field to one of them"
        )
    if counts.documents == 0:
        problems = "; ".join(counts.summary())
        raise DataError(f"the corpus {where_all!r} is empty: no non-empty {field_name!r} documents"
                        f"{f' ({problems})' if problems else ''}; check data.source and data.text_field")
