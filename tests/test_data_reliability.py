"""Data pipeline under faults: damaged shards, hostile text, bad rows, signals, concurrent runs, mistyped paths."""

import bz2
import contextlib
import errno
import gzip
import json
import logging
import lzma
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from coda_train.data import CacheWriteError, DataConfig, DataError, PreparedData, TokenLoader, prepare
from coda_train.data import shards as shards_module
from coda_train.data.sources import iter_document_parts, resolve_source
from coda_train.data.tokenizer import EOS_TOKEN, MAX_PIECE_BYTES, NEWLINE_BETWEEN_TEXT, load_tokenizer, train_bpe
from coda_train.durable import LockHeldError, exclusive_lock, lock_holder
from coda_train.trainer.loop import EXIT_RUN_DIR, exit_code

WORDS = "the model reads a token stream while loss falls seed rank epoch shard naïve 日本語 def return (x)".split()


def make_docs(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def config(source, cache_dir: Path, **overrides) -> DataConfig:
    settings = dict(source=str(source), cache_dir=str(cache_dir), vocab_size=300, val_fraction=0.1, num_proc=1)
    return DataConfig(**{**settings, **overrides})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def jsonl_with_line(path: Path, docs: list[str], index: int, line: bytes) -> Path:
    """docs as JSON Lines at path, line `index` (from 0) replaced by the raw bytes `line` (bad UTF-8, JSON or text)."""
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines[index] = line
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def documents_in(data: PreparedData, split: str) -> list[str]:
    tokens = np.concatenate([s.read(0, len(s)) for s in data.shards(split)])
    cuts = np.flatnonzero(tokens == data.eos_id)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [data.tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, cuts)]


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs()])


def damage(file: Path, values: np.ndarray) -> None:
    """Overwrite the start of a uint16 shard with `values`, keeping its size (and so passing the size check)."""
    tokens = np.fromfile(file, dtype=np.uint16)
    tokens[: len(values)] = values
    tokens.tofile(file)


# --- damaged shards ----------------------------------------------------------------------------------------------


def test_out_of_range_ids_stop_at_the_batch_naming_the_shard(tmp_path, corpus):
    data = prepare(config(corpus, tmp_path / "cache"))
    shard = data.path / "train_00000.bin"
    damage(shard, np.full(len(np.fromfile(shard, dtype=np.uint16)), 65535, dtype=np.uint16))  # every id past the vocab
    damaged = folder_bytes(data.path)
    opened = prepare(config(corpus, tmp_path / "cache", verify_shards="never"))  # sizes match, checksum skipped
    loader = TokenLoader(opened, "train", batch_size=2, seq_len=16, seed=0)
    with pytest.raises(DataError, match=rf"shard {shard} holds token id 65535 at token \d+, but the tokenizer has only "
                                        rf"300 ids.*Delete the folder {data.path} and run preparation again"):
        loader.next_batch()
    assert folder_bytes(data.path) == damaged  # the error names the fix; nothing is deleted


def test_a_shard_truncated_while_a_loader_reads_it_is_a_data_error_naming_it(tmp_path, corpus):
    """A shard cut short after the loader opened it (a copy or rsync --inplace over the cache) stops the read with a
    DataError naming the file and the fix: a memory-mapped shard raised SIGBUS there, killing the process silently."""
    data = prepare(config(corpus, tmp_path / "cache"))
    loader = TokenLoader(data, "train", batch_size=2, seq_len=16, seed=0)
    shard = data.path / "train_00000.bin"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(DataError, match=rf"shard {shard} is now {size // 2} bytes, shorter than the {size} its manifest "
                                        r"says: the file was truncated or overwritten while this run read it.*Restore "
                                        rf"the folder {data.path} .*the run resumes from its last checkpoint"):
        for _ in loader.iter_eval(every_window=True):  # every window: the ones past the new end are read too
            pass


def test_loaders_close_their_shards_when_dropped(tmp_path, corpus):
    """Each shard holds a file descriptor while its loader lives; loaders made and dropped (evaluations, tests) do not
    accumulate them."""
    data = prepare(config(corpus, tmp_path / "cache"))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        TokenLoader(data, "train", batch_size=2, seq_len=16, seed=0).next_batch()
    assert len(os.listdir("/proc/self/fd")) == before


def test_in_range_corruption_fails_the_checksum_at_first_use(tmp_path, corpus):
    data = prepare(config(corpus, tmp_path / "cache"))
    shard = data.path / "val_00000.bin"
    damage(shard, np.array([7, 7, 7, 7], dtype=np.uint16))  # valid ids, wrong tokens: only the checksum can tell
    damaged = folder_bytes(data.path)
    with pytest.raises(DataError, match=rf"shard {shard} does not match the sha256.*Delete the folder {data.path} and "
                                        "run preparation again"):
        prepare(config(corpus, tmp_path / "cache"))
    with pytest.raises(DataError, match="does not match the sha256"):  # remembered as unverified: fails every time
        PreparedData.open(data.path)
    assert prepare(config(corpus, tmp_path / "cache", verify_shards="never")).path == data.path  # the user's opt-out
    assert folder_bytes(data.path) == damaged


def test_a_copy_that_keeps_mtimes_is_verified_at_its_first_use(tmp_path, corpus):
    """cp -a, rsync -a and tar keep each shard's mtime and bring verified.json along: the copy's shards are
    still hashed at its first use, so a byte damaged in transfer (its mtime then restored) is caught."""
    data = prepare(config(corpus, tmp_path / "cache"))
    copy = tmp_path / "copy" / data.path.name
    shutil.copytree(data.path, copy, copy_function=shutil.copy2)  # contents and mtimes, verified.json included
    shard = copy / "val_00000.bin"
    times = shard.stat()
    damage(shard, np.array([7, 7, 7, 7], dtype=np.uint16))
    os.utime(shard, ns=(times.st_atime_ns, times.st_mtime_ns))
    with pytest.raises(DataError, match=rf"shard {shard} does not match the sha256"):
        PreparedData.open(copy)
    PreparedData.open(data.path)  # the original, untouched, opens as before


def test_checksums_are_verified_once_per_file_version(tmp_path, corpus, monkeypatch):
    hashed = []
    real = shards_module.sha256_file
    monkeypatch.setattr(shards_module, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    data = prepare(config(corpus, tmp_path / "cache", tokens_per_shard=1000))
    num_shards = sum(len(data.manifest["splits"][s]["shards"]) for s in ("train", "val"))
    assert num_shards > 2 and hashed == []  # hashed while written: the first open reads nothing again
    (data.path / "verified.json").unlink()  # e.g. a copy made without it
    PreparedData.open(data.path)
    assert len(hashed) == num_shards and (data.path / "verified.json").is_file()
    hashed.clear()
    PreparedData.open(data.path)
    assert hashed == []  # the stamp skips hashing
    os.utime(data.path / "train_00001.bin", ns=(time.time_ns(), time.time_ns()))  # rewritten or copied: checked again
    PreparedData.open(data.path)
    assert hashed == ["train_00001.bin"]
    hashed.clear()
    PreparedData.open(data.path, verify="always")
    assert len(hashed) == num_shards
    hashed.clear()
    prepare(config(corpus, tmp_path / "cache", tokens_per_shard=1000, verify_shards="never"))
    (data.path / "verified.json").write_text("{not json")  # a damaged stamp only means verifying again
    PreparedData.open(data.path, verify="never")
    assert hashed == []
    PreparedData.open(data.path)
    assert len(hashed) == num_shards


# --- hostile text ------------------------------------------------------------------------------------------------


def test_whitespace_free_document_prepares_in_seconds(tmp_path):
    rng = random.Random(0)
    repeated = "ab" * 1_500_000  # 3 MB: before the piece cap, 0.25 MB of this took 17-100 s to train on
    random_run = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789+/", k=1_000_000))  # base64-like, 1 MB
    (tmp_path / "a_repeated.txt").write_text(repeated)
    (tmp_path / "b_random.txt").write_text(random_run)
    (tmp_path / "c_normal.txt").write_text(" ".join(make_docs(5)))
    start = time.perf_counter()
    data = prepare(config(tmp_path / "*.txt", tmp_path / "cache", vocab_size=1000, val_fraction=0.0))
    seconds = time.perf_counter() - start
    assert seconds < 60, f"{seconds:.1f} s: BPE training is no longer near-linear in piece length"  # ~5 s on 2 cores
    assert documents_in(data, "train")[:2] == [repeated, random_run]  # still round-trips exactly
    longest = max(len(token.encode()) for token in data.tokenizer.get_vocab())
    assert longest <= 2 * MAX_PIECE_BYTES  # byte-level characters are up to 2 UTF-8 bytes each


def test_capped_pieces_leave_ordinary_text_tokenization_unchanged():
    """Without pieces longer than MAX_PIECE_BYTES, the capped BPE learns and encodes exactly as plain byte-level BPE."""
    docs = make_docs(200)
    uncapped = Tokenizer(models.BPE())
    uncapped.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    uncapped.decoder = decoders.ByteLevel()
    uncapped.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS_TOKEN], show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    capped = train_bpe(docs, vocab_size=400)
    assert capped.get_vocab() == uncapped.get_vocab()
    for doc in docs[:20]:
        assert capped.encode(doc).ids == uncapped.encode(doc).ids


# --- bad rows ----------------------------------------------------------------------------------------------------


def test_rows_without_the_text_field_are_counted_and_warned(tmp_path, caplog):
    docs = make_docs(9)
    rows = [{"text": d} if i not in (1, 4, 5, 7) else {"body": d} for i, d in enumerate(docs)]
    source = write_jsonl(tmp_path / "corpus.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        data = prepare(config(source, tmp_path / "cache", val_fraction=0.0))
    counts = data.manifest["document_counts"]
    assert counts["documents"] == 5 and counts["missing_field"] == 4
    assert counts["first"]["missing_field"] == f"{source}:2"
    assert "4 documents: no text field" in caplog.text and f"(first at {source}:2)" in caplog.text
    assert documents_in(data, "train") == [d for i, d in enumerate(docs) if i not in (1, 4, 5, 7)]


@pytest.mark.parametrize("mode", ["replace", "skip_document", "strict"])
def test_invalid_utf8_per_decode_errors(tmp_path, mode):
    docs = make_docs(6)
    source = jsonl_with_line(tmp_path / "corpus.jsonl", docs, 3, b'{"text": "caf\xe9 latin-1 bytes"}')  # bad UTF-8 on line 4
    cfg = config(source, tmp_path / "cache", val_fraction=0.0, decode_errors=mode)
    if mode == "strict":
        with pytest.raises(DataError, match=rf"{source}:4: invalid UTF-8 .*data.decode_errors=replace"):
            prepare(cfg)
        assert os.listdir(tmp_path / "cache") == []
        return
    data = prepare(cfg)
    counts = data.manifest["document_counts"]
    if mode == "replace":
        assert counts["replaced"] == 1 and counts["documents"] == 6
        assert documents_in(data, "train")[3] == "caf\ufffd latin-1 bytes"
    else:
        assert counts["skipped"] == 1 and counts["documents"] == 5
        assert documents_in(data, "train") == [d for i, d in enumerate(docs) if i != 3]
    assert counts["first"] == {"replaced" if mode == "replace" else "skipped": f"{source}:4"}


@pytest.mark.parametrize("mode", ["replace", "skip_document"])
def test_invalid_utf8_in_a_json_array_is_handled_per_document(tmp_path, mode):
    """One bad byte in a file holding a JSON array repairs or skips the document holding it, not every document of
    the file (counted as one)."""
    docs = make_docs(6)
    body = json.dumps([{"text": d} for d in docs[:3]] + [{"text": "caf\u00e9 latin-1 bytes"}] + [{"text": d} for d in docs[4:]])
    (tmp_path / "corpus.json").write_bytes(body.encode().replace(b"caf\\u00e9", b"caf\xe9"))
    data = prepare(config(tmp_path / "corpus.json", tmp_path / "cache", val_fraction=0.0, decode_errors=mode))
    counts = data.manifest["document_counts"]
    if mode == "replace":
        assert counts["replaced"] == 1 and documents_in(data, "train") == [*docs[:3], "caf\ufffd latin-1 bytes", *docs[4:]]
    else:
        assert counts["skipped"] == 1 and documents_in(data, "train") == [*docs[:3], *docs[4:]]
    assert counts["first"] == {"replaced" if mode == "replace" else "skipped": f"{tmp_path / 'corpus.json'} item 3"}


@pytest.mark.parametrize("mode", ["replace", "skip_document", "strict"])
def test_a_lone_surrogate_escape_in_json_per_decode_errors(tmp_path, mode):
    """JSON's "\\ud83d" without its pair (half an emoji, cut by a scraper) decodes to a code point UTF-8 cannot
    encode: handled as invalid UTF-8 is, not a crash in the tokenizer."""
    docs = make_docs(6)
    source = jsonl_with_line(tmp_path / "corpus.jsonl", docs, 2, b'{"text": "half an emoji \\ud83d here"}')
    cfg = config(source, tmp_path / "cache", val_fraction=0.0, decode_errors=mode)
    if mode == "strict":
        with pytest.raises(DataError, match=rf"{source}:3: the text holds a lone UTF-16 surrogate"):
            prepare(cfg)
        return
    data = prepare(cfg)
    counts = data.manifest["document_counts"]
    if mode == "replace":
        assert counts["replaced"] == 1 and documents_in(data, "train")[2] == "half an emoji \ufffd here"
    else:
        assert counts["skipped"] == 1 and documents_in(data, "train") == [d for i, d in enumerate(docs) if i != 2]


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)])
def test_compressed_json_and_text_are_read_decompressed(tmp_path, suffix, opener):
    docs = make_docs(6)
    with opener(tmp_path / f"corpus.jsonl{suffix}", "wt") as f:
        f.write("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    data = prepare(config(tmp_path / f"corpus.jsonl{suffix}", tmp_path / "cache", val_fraction=0.0))
    assert documents_in(data, "train") == docs
    with opener(tmp_path / f"doc.txt{suffix}", "wt") as f:
        f.write(docs[0])
    assert documents_in(prepare(config(tmp_path / f"doc.txt{suffix}", tmp_path / "cache", val_fraction=0.0)), "train") == [docs[0]]


def test_a_damaged_or_unsupported_archive_is_a_data_error_naming_it(tmp_path):
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a document"}\n' * 50)[:-20])
    with pytest.raises(DataError, match=rf"could not read documents from {tmp_path / 'cut.jsonl.gz'}"):
        prepare(config(tmp_path / "cut.jsonl.gz", tmp_path / "cache", val_fraction=0.0))
    (tmp_path / "corpus.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DataError, match=r"corpus.jsonl.zst is an archive or compressed in a format .* unpack it first \(zstd -d\)"):
        prepare(config(tmp_path / "corpus.jsonl.zst", tmp_path / "cache", val_fraction=0.0))
    with tarfile.open(tmp_path / "corpus.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "cut.jsonl.gz", arcname="cut.jsonl.gz")
    for fmt in ("auto", "text"):  # a tar inside gzip is an archive, whatever data.format says
        with pytest.raises(DataError, match=r"corpus.tar.gz is an archive .* \(tar xf\)"):
            prepare(config(tmp_path / "corpus.tar.gz", tmp_path / "cache", val_fraction=0.0, format=fmt))
    assert not (tmp_path / "cache").exists() or os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("array", [False, True])
def test_json_with_a_byte_order_mark_is_read(tmp_path, array):
    docs = make_docs(4)
    body = json.dumps([{"text": d} for d in docs]) if array else "\n".join(json.dumps({"text": d}) for d in docs)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body.encode())
    data = prepare(config(tmp_path / "bom.jsonl", tmp_path / "cache", val_fraction=0.0, decode_errors="strict"))
    assert documents_in(data, "train") == docs


def test_a_text_file_with_a_byte_order_mark_is_read_without_it(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfa document\r\nfrom Notepad\r\n")
    data = prepare(config(tmp_path / "bom.txt", tmp_path / "cache", val_fraction=0.0, decode_errors="strict"))
    assert documents_in(data, "train") == ["a document\nfrom Notepad\n"]



@pytest.mark.parametrize("encoding, name, suffix", [("utf-16", "UTF-16LE", ".txt"), ("utf-16-be", "UTF-16BE", ".jsonl"),
                                                    ("utf-32", "UTF-32LE", ".jsonl.gz"), ("utf-16", "UTF-16LE", ".json")])
@pytest.mark.parametrize("mode", ["replace", "skip_document", "strict"])
def test_a_utf16_or_utf32_file_is_refused_naming_its_encoding(tmp_path, encoding, name, suffix, mode):
    """Read as UTF-8, UTF-16 ASCII is valid bytes and NULs: under replace it was trained on as such, with one
    'replaced' count; strict said only 'invalid UTF-8 (invalid start byte at byte 0)'."""
    docs = make_docs(4)
    body = ("\n".join(json.dumps({"text": d}) for d in docs) if suffix != ".txt" else docs[0])
    if encoding == "utf-16-be":
        body_bytes = b"\xfe\xff" + body.encode(encoding)
    else:
        body_bytes = body.encode(encoding)
    source = tmp_path / f"corpus{suffix}"
    source.write_bytes(gzip.compress(body_bytes) if suffix.endswith(".gz") else body_bytes)
    with pytest.raises(DataError, match=rf"{source} is {name} text .*not UTF-8.*iconv -f {name} -t UTF-8"):
        prepare(config(source, tmp_path / "cache", val_fraction=0.0, decode_errors=mode))



def test_json_lines_ended_by_a_lone_cr_are_read_as_lines(tmp_path):
    """Classic Mac line endings (CR alone), mixed with LF and CR LF: each record is a line, as when the file is opened
    as text; the whole file was read as line 1 and refused as 'not valid JSON (Extra data ...)'."""
    docs = make_docs(6)
    records = [json.dumps({"text": d}).encode() for d in docs]
    ends = [b"\r", b"\r", b"\n", b"\r\n", b"\r", b"\r"]
    (tmp_path / "mac.jsonl").write_bytes(b"".join(r + end for r, end in zip(records, ends)))
    data = prepare(config(tmp_path / "mac.jsonl", tmp_path / "cache", val_fraction=0.0, decode_errors="strict"))
    assert documents_in(data, "train") == docs
    # a bad record is named by its line as an editor counts them
    (tmp_path / "bad.jsonl").write_bytes(b"\r".join([*records[:4], b'{"text": "cut off', *records[5:]]) + b"\r")
    with pytest.raises(DataError, match=rf"{tmp_path / 'bad.jsonl'}:5: not valid JSON"):
        prepare(config(tmp_path / "bad.jsonl", tmp_path / "cache", val_fraction=0.0))


def test_each_decode_errors_mode_prepares_its_own_folder(tmp_path):
    """data.decode_errors decides which documents (and so which BPE and shards) a folder holds: data
    prepared under `replace` is not reused by a `strict` or `skip_document` run."""
    source = jsonl_with_line(tmp_path / "corpus.jsonl", make_docs(6), 3, b'{"text": "caf\xe9 latin-1 bytes"}')
    replaced = prepare(config(source, tmp_path / "cache", val_fraction=0.0, decode_errors="replace"))
    with pytest.raises(DataError, match=rf"{source}:4: invalid UTF-8"):
        prepare(config(source, tmp_path / "cache", val_fraction=0.0, decode_errors="strict"))
    skipped = prepare(config(source, tmp_path / "cache", val_fraction=0.0, decode_errors="skip_document"))
    assert skipped.path != replaced.path and skipped.manifest["document_counts"]["documents"] == 5


def test_a_malformed_tokenizer_config_is_a_data_error_naming_it(tmp_path):
    train_bpe(make_docs(20), 300).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(DataError, match=rf"could not read {tmp_path / 'tokenizer_config.json'}: .*set data.eos_token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('["not", "an", "object"]')
    with pytest.raises(DataError, match="could not read"):
        load_tokenizer(str(tmp_path))


def test_invalid_utf8_in_a_text_file_names_the_line(tmp_path):
    (tmp_path / "doc.txt").write_bytes(b"line one\nline two\nbad \xff byte\n")
    with pytest.raises(DataError, match=rf"{tmp_path / 'doc.txt'}:3: invalid UTF-8"):
        prepare(config(tmp_path / "doc.txt", tmp_path / "cache", decode_errors="strict"))
    data = prepare(config(tmp_path / "doc.txt", tmp_path / "cache", val_fraction=0.0))
    assert documents_in(data, "train") == ["line one\nline two\nbad \ufffd byte\n"]


@pytest.mark.parametrize("mode", ["replace", "strict", "skip_document"])
def test_bad_json_line_names_file_and_line(tmp_path, mode):
    docs = make_docs(8)
    source = jsonl_with_line(tmp_path / "corpus.jsonl", docs, 5, b'{"text": "cut off mid-wri')
    cfg = config(source, tmp_path / "cache", val_fraction=0.0, decode_errors=mode)
    if mode != "skip_document":
        with pytest.raises(DataError, match=rf"could not read documents from {source}:6: not valid JSON"):
            prepare(cfg)
        assert os.listdir(tmp_path / "cache") == []
        return
    data = prepare(cfg)
    assert data.manifest["document_counts"]["skipped"] == 1
    assert documents_in(data, "train") == [d for i, d in enumerate(docs) if i != 5]


@pytest.mark.parametrize("line, named", [(b"null", "null"), (b'["a"]', "array"), (b'"text"', "string"), (b"3", "number")])
def test_a_json_line_that_is_no_object_is_named_in_jsons_words(tmp_path, line, named):
    source = jsonl_with_line(tmp_path / "corpus.jsonl", make_docs(4), 2, line)
    with pytest.raises(DataError, match=rf"{source}:3 holds a JSON {named}, not an object"):
        prepare(config(source, tmp_path / "cache", val_fraction=0.0))


# --- signals and concurrent runs ---------------------------------------------------------------------------------

PREPARE = [sys.executable, "-m", "coda_train.data.prepare"]


def big_corpus(tmp_path: Path, megabytes: int) -> tuple[Path, Path]:
    """A JSONL corpus of `megabytes` MB and a tokenizer for it (so runs start tokenizing at once)."""
    docs = make_docs(200)
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(docs, vocab_size=300).save(str(tokenizer))
    source = tmp_path / "big.jsonl"
    row = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    source.write_text(row * (megabytes * 2**20 // len(row) + 1))
    return source, tokenizer


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def temp_folders(cache: Path) -> list[Path]:
    return list(cache.glob(".tmp-*"))


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_stopping_a_preparation_leaves_nothing_that_blocks_the_next(tmp_path, how):
    source, tokenizer = big_corpus(tmp_path, 8)
    cache = tmp_path / "cache"
    args = ["--source", str(source), "--tokenizer", str(tokenizer), "--cache-dir", str(cache), "--num-proc", "2"]
    run = subprocess.Popen([*PREPARE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own process group, as a terminal's Ctrl-C reaches
    wait_for(lambda: any((t / "train_00000.bin").exists() for t in temp_folders(cache)))  # the worker pool is running
    os.killpg(run.pid, getattr(signal, how))
    _, stderr = run.communicate(timeout=60)
    if how == "SIGKILL":
        assert run.returncode == -signal.SIGKILL and len(temp_folders(cache)) == 1  # a dead writer's leftover
    else:
        assert run.returncode == 128 + getattr(signal, how), stderr
        assert "Traceback" not in stderr and f"stopped: data preparation stopped by {how}" in stderr
        assert temp_folders(cache) == []
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]  # nothing taken for a finished folder

    again = subprocess.run([*PREPARE, *args], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in cache.iterdir()] == [next(cache.glob("big-*")).name]  # no temp folder, no lock file
    assert PreparedData.open(next(cache.glob("big-*")), verify="always").manifest["num_documents"] > 0


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers (and so inherited lock files) are Linux's")
def test_a_kill_9_of_the_preparing_process_alone_leaves_no_lock_held(tmp_path):
    # the OOM killer kills one process, not the group: its forked workers shared its lock file and must not outlive it
    source, tokenizer = big_corpus(tmp_path, 8)
    cache = tmp_path / "cache"
    args = ["--source", str(source), "--tokenizer", str(tokenizer), "--cache-dir", str(cache), "--num-proc", "2"]
    run = subprocess.Popen([*PREPARE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: any((t / "train_00000.bin").exists() for t in temp_folders(cache)))  # the worker pool is running
    workers = [int(pid) for pid in Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()]
    try:
        assert len(workers) == 2
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
        lock = next(cache.glob(".*.lock"))
        wait_for(lambda: lock_holder(lock) is None, seconds=10)  # before: held by the orphaned workers for ever
        again = subprocess.run([*PREPARE, *args], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "waiting for" not in again.stderr, again.stderr
    finally:
        for pid in workers:  # before the fix they would linger
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_preparation_of_other_data_leaves_no_temp_folder_for_good(tmp_path):
    """A temp folder of another prepared folder (data since changed, so never prepared again) is removed by the next
    preparation in that cache dir, unless a live run holds that folder's lock (it is writing there)."""
    cache = tmp_path / "cache"
    dead, busy = cache / ".tmp-old-0123abcd-k2j4h5g6", cache / ".tmp-other-4567cdef-a1b2c3d4"
    for folder in (dead, busy):
        folder.mkdir(parents=True)
        (folder / "train_00000.bin").write_bytes(b"\0" * 64)
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs(6)])
    with exclusive_lock(cache / ".other-4567cdef.lock", wait=False):  # a live run preparing "other"
        prepare(config(source, cache))
    assert not dead.exists() and busy.is_dir()


def test_a_full_disk_while_preparing_is_a_data_error_that_keeps_finished_folders(tmp_path, corpus, monkeypatch):
    cache = tmp_path / "cache"
    finished = prepare(config(corpus, cache))
    before = folder_bytes(finished.path)
    real_write, writes = shards_module._ShardWriter.write, []

    def full_after_one_write(self, tokens):  # what a shard file's write answers once the filesystem is full
        writes.append(len(tokens))
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, tokens)

    monkeypatch.setattr(shards_module._ShardWriter, "write", full_after_one_write)
    other = config(corpus, cache, val_fraction=0.2)  # another folder of the same cache dir
    with pytest.raises(DataError, match=rf"could not write the prepared data in data.cache_dir={cache}: No space left "
                                        r"on device\. Nothing of this preparation was kept .* free space"):
        prepare(other)
    assert [p.name for p in cache.iterdir()] == [finished.path.name] and folder_bytes(finished.path) == before
    with pytest.raises(CacheWriteError) as stop:  # the machine's state, not the input's: exit 4, which ends a sweep
        prepare(other)
    assert exit_code(stop.value) == EXIT_RUN_DIR
    monkeypatch.undo()  # space freed: the same command prepares it
    assert PreparedData.open(prepare(other).path, verify="always").manifest["inputs"]["val_fraction"] == 0.2


def test_an_error_without_a_file_name_is_a_cache_write_error_only_for_a_full_or_read_only_filesystem(
        tmp_path, corpus, monkeypatch):
    """An OSError naming no file (a fork out of memory, a write() on a full disk) is the cache dir's (exit 4, which
    ends a sweep) only where its errno says the filesystem is full or read-only; out of memory stops as what it is."""
    cache = tmp_path / "cache"

    def fails(code):
        def start_pool(*args, **kwargs):  # what os.fork answers when the tokenization processes cannot start
            raise OSError(code, os.strerror(code))
        return start_pool

    monkeypatch.setattr(shards_module, "ProcessPoolExecutor", fails(errno.ENOMEM))
    with pytest.raises(DataError, match=r"preparing data.source=.* failed: Cannot allocate memory \(ENOMEM\)\. "
                                        r"Nothing of this preparation was kept .* lower data\.num_proc \(now 2\)") as stop:
        prepare(config(corpus, cache, num_proc=2))
    assert not isinstance(stop.value, CacheWriteError) and exit_code(stop.value) == 1
    assert "data.cache_dir" not in str(stop.value) and list(cache.iterdir()) == []
    monkeypatch.setattr(shards_module, "ProcessPoolExecutor", fails(errno.ENOSPC))
    with pytest.raises(CacheWriteError, match=rf"could not write the prepared data in data.cache_dir={cache}: No space "
                                              r"left on device\. .* free space") as stop:
        prepare(config(corpus, cache, num_proc=2))
    assert exit_code(stop.value) == EXIT_RUN_DIR and list(cache.iterdir()) == []


def test_a_cache_dir_that_cannot_be_written_ends_a_sweep_and_one_in_a_files_path_does_not(tmp_path, corpus, monkeypatch):
    """A read-only or full data.cache_dir found before preparing stops as a full disk while preparing does (exit 4,
    which ends a sweep, as the README says), a file where data.cache_dir would be made as bad input (exit 1)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="cannot prepare data in data.cache_dir") as stop:
        prepare(config(corpus, tmp_path / "file" / "cache"))
    assert not isinstance(stop.value, CacheWriteError) and exit_code(stop.value) == 1
    monkeypatch.setattr(shards_module.os, "access", lambda path, mode: False)  # a read-only mount (root's too)
    with pytest.raises(CacheWriteError, match="point data.cache_dir at a writable folder") as stop:
        prepare(config(corpus, tmp_path / "ro"))
    assert exit_code(stop.value) == EXIT_RUN_DIR
    monkeypatch.undo()

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(CacheWriteError, match="No space left on device") as stop:
        prepare(config(corpus, tmp_path / "full"))
    assert exit_code(stop.value) == EXIT_RUN_DIR


def test_concurrent_preparations_take_turns_and_share_one_result(tmp_path):
    source, tokenizer = big_corpus(tmp_path, 2)
    cache = tmp_path / "cache"
    args = ["--source", str(source), "--tokenizer", str(tokenizer), "--cache-dir", str(cache), "--num-proc", "1"]
    first = subprocess.Popen([*PREPARE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(p.read_text().startswith("pid") for p in cache.glob(".*.lock")) if cache.exists() else False)
    os.kill(first.pid, signal.SIGSTOP)  # holds the lock mid-preparation for as long as this test needs
    try:
        second = subprocess.Popen([*PREPARE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        waiting = second.stderr.readline()  # its first log line: it waits, naming the holder
        assert "waiting for" in waiting and f"pid {first.pid} on host {socket.gethostname()}" in waiting
    finally:
        os.kill(first.pid, signal.SIGCONT)
    first_out, first_err = first.communicate(timeout=120)
    second_out, second_rest = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first_err + second_rest
    assert "another process (another run, or another rank of this one) prepared" in second_rest and "reusing it" in second_rest
    prepared = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    assert len(prepared) == 1 and [p.name for p in cache.iterdir()] == [prepared[0].name]
    assert first_out.splitlines()[0] == second_out.splitlines()[0] == f"prepared  {prepared[0]}"


def test_exclusive_lock_names_its_holder(tmp_path):
    lock = tmp_path / "run.lock"
    with exclusive_lock(lock, wait=False):
        with pytest.raises(LockHeldError, match=f"locked by pid {os.getpid()} on host {socket.gethostname()}"):
            with exclusive_lock(lock, wait=False):
                pass
    assert not lock.exists()  # released and removed
    with exclusive_lock(lock, wait=False):  # free again
        assert lock.read_text().startswith(f"pid {os.getpid()}")


# --- mistyped paths ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["./corpus", "../corpus", "~/no-such-corpus-dir", "corpus.jsonl", "data/*.jsonl",
                                    "data/train/part0", "data/train"])
def test_missing_local_path_fails_at_once_without_the_hub(tmp_path, monkeypatch, source):
    (tmp_path / "data").mkdir()  # "data/train": org "data" is a local folder, so this is a path, not a hub name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: pytest.fail("the hub must not be tried"))
    start = time.perf_counter()
    with pytest.raises(DataError, match=rf"no files match data.source='{source.replace('*', '.')}' \(cwd {tmp_path}\)"):
        prepare(config(source, tmp_path / "cache"))
    assert time.perf_counter() - start < 5


def test_a_folder_lists_the_files_its_glob_lists_symlinks_included(tmp_path):
    """A folder given as data.source holds what `folder/**/*` does: a symlinked folder is read, a link to a file
    of the corpus reads that file once, and a link back up the tree ends."""
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    (corpus / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    for file in (corpus / "a.txt", corpus / "sub" / "b.txt", elsewhere / "c.txt"):
        file.write_text(file.stem)
    (corpus / "link_to_a.txt").symlink_to(corpus / "a.txt")
    (corpus / "linked").symlink_to(elsewhere)
    (corpus / "sub" / "loop").symlink_to(corpus)
    expected = sorted(str(f) for f in (corpus / "a.txt", corpus / "sub" / "b.txt", elsewhere / "c.txt"))
    assert list(resolve_source(config(corpus, tmp_path / "cache")).files) == expected
    assert list(resolve_source(config(f"{corpus}/**/*.txt", tmp_path / "cache")).files) == expected



def test_a_dangling_symlink_in_a_corpus_is_named_not_skipped(tmp_path):
    """A link whose target is gone (an unmounted disk, a moved file) was skipped without a word: the run trained on
    the corpus less that file's documents."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("a document")
    (corpus / "sub" / "b.txt").symlink_to(tmp_path / "unmounted" / "b.txt")
    for source in (corpus, f"{corpus}/**/*.txt"):
        with pytest.raises(DataError, match=rf"{corpus / 'sub' / 'b.txt'} is a symbolic link to "
                                            rf"{tmp_path / 'unmounted' / 'b.txt'}, which does not exist.*remove the link"):
            prepare(config(source, tmp_path / "cache"))
    (corpus / "sub" / "b.txt").unlink()
    assert list(resolve_source(config(corpus, tmp_path / "cache")).files) == [str(corpus / "a.txt")]


def test_mixed_formats_under_one_glob_are_refused(tmp_path, corpus):
    (tmp_path / "notes.txt").write_text("plain text\n")
    with pytest.raises(DataError, match=r"mixes formats \['json', 'text'\] \(.*corpus.jsonl is json, .*notes.txt is text\); narrow the glob or set data.format"):
        prepare(config(tmp_path / "*", tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_parquet_files_read_as_text_or_json_are_refused_naming_data_format(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": make_docs(5)}), tmp_path / "corpus.parquet")
    with pytest.raises(DataError, match=rf"data.format={fmt} reads .*corpus.parquet .* set data.format=parquet"):
        prepare(config(tmp_path / "corpus.parquet", tmp_path / "cache", format=fmt))
    assert prepare(config(tmp_path / "corpus.parquet", tmp_path / "cache")).manifest["num_documents"] == 5
    jsonl = tmp_path / "corpus.jsonl"  # the other way round: the message names data.format too
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(5)))
    with pytest.raises(DataError, match=r"not Parquet \(data.format=parquet reads every file as Parquet: set data.format=auto"):
        prepare(config(jsonl, tmp_path / "cache2", format="parquet"))


def test_json_files_read_as_text_are_warned_about_naming_data_format(tmp_path, caplog):
    """data.format=text on .jsonl files is allowed (asked for) but trains on the JSON syntax: the preparation says so."""
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(5)))
    with caplog.at_level(logging.WARNING):
        prepare(config(jsonl, tmp_path / "cache", format="text"))
    assert f"data.format=text reads {jsonl} (1 .json/.jsonl file(s)) as plain text" in caplog.text
    assert "set data.format=json (or auto) to train on each record's 'text' field" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        prepare(config(jsonl, tmp_path / "cache2"))
    assert "as plain text" not in caplog.text


def test_a_cache_dir_inside_the_source_folder_is_not_read_as_corpus(tmp_path):
    """data.cache_dir under data.source's folder: the next start read the prepared files (manifest.json, the shards)
    as corpus ("mixes formats ['json', 'text']"; with data.format=text the shards' bytes tokenized as documents)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, doc in enumerate(make_docs()):
        (folder / f"{i:02d}.txt").write_text(doc + "\n")
    for fmt in ("auto", "text"):
        first = prepare(config(folder, folder / "cache", format=fmt))
        assert prepare(config(folder, folder / "cache", format=fmt)).path == first.path


def test_a_tokenizer_file_that_cannot_serve_is_refused_before_tokenizing(tmp_path, corpus):
    malformed = tmp_path / "broken.json"
    malformed.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(DataError, match=rf"could not read tokenizer {malformed}: .*point data.tokenizer at a valid"):
        prepare(config(corpus, tmp_path / "cache", tokenizer=str(malformed)))
    no_eos = tmp_path / "no_eos.json"
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(make_docs(), trainers.BpeTrainer(vocab_size=280, special_tokens=["[UNK]"]))
    tokenizer.save(str(no_eos))
    with pytest.raises(DataError, match=r"the tokenizer has none of the EOS tokens .*; set data.eos_token"):
        prepare(config(corpus, tmp_path / "cache", tokenizer=str(no_eos)))
    # data.eos_token can only name a token it has: the message says which, or that one must be added
    with pytest.raises(DataError, match=r"\(its special tokens: \['\[UNK\]'\]\).*or add one to the tokenizer"):
        prepare(config(corpus, tmp_path / "cache", tokenizer=str(no_eos), eos_token="</s>"))
    assert not any((tmp_path / "cache").glob("*/manifest.json"))  # nothing prepared


def test_a_tokenizer_whose_ids_have_gaps_gets_room_for_its_largest_id(tmp_path, corpus):
    """A vocabulary with gaps (pruned, or special tokens placed at high ids) spans more ids than it has tokens: the
    shards' dtype and the vocabulary the model is built with follow its largest id, not its count of tokens."""
    words = sorted({w for d in make_docs() for w in d.split()})
    vocab = {w: i for i, w in enumerate(words)} | {"[UNK]": len(words), EOS_TOKEN: 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = prepare(config(corpus, tmp_path / "cache", tokenizer=str(tmp_path / "tokenizer.json")))
    assert (data.vocab_size, data.eos_id, data.dtype) == (70_001, 70_000, np.dtype(np.uint32))
    assert sorted(documents_in(data, "train") + documents_in(data, "val")) == sorted(make_docs())


@pytest.mark.parametrize("name", ["wikitext", "HuggingFaceFW/fineweb-edu"])
def test_bare_names_go_to_the_hub(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    source = resolve_source(DataConfig(source=name))
    assert source.format == "hub" and source.hub_name == name


def test_long_preparations_log_progress_off_a_terminal(tmp_path, corpus, caplog, monkeypatch):
    monkeypatch.setattr("coda_train.data.progress.LOG_EVERY_SECONDS", 0.0)  # every update logs, as every 30 s would
    with caplog.at_level(logging.INFO):
        prepare(config(corpus, tmp_path / "cache"))
    lines = [r.message for r in caplog.records if r.message.startswith("tokenizing: ")]
    assert lines and "(100%) read" in lines[-1] and "40 documents" in lines[-1] and "tokens" in lines[-1]


def test_bpe_reading_progress_of_a_corpus_larger_than_its_cap_gives_no_percentage(tmp_path, caplog, monkeypatch):
    """BPE training reads TOKENIZER_TRAIN_CHARS characters of text, more bytes than that (UTF-8, JSON syntax): taken as
    the bytes to read, a Cyrillic corpus was logged '2 MB of 1 MB (203%)'."""
    monkeypatch.setattr("coda_train.data.progress.LOG_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(shards_module, "TOKENIZER_TRAIN_CHARS", 20_000)
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "привет мир"} for _ in range(6000)])
    with caplog.at_level(logging.INFO):
        prepare(config(source, tmp_path / "cache", val_fraction=0.0))
    lines = [r.message for r in caplog.records if r.message.startswith("reading for BPE: ")]
    assert lines and not any("%" in line for line in lines), lines


def test_a_big_text_file_is_held_once_while_its_document_is_used(tmp_path):
    """A text file is one document: its bytes and the text before CR LF became LF were kept alive beside it until the
    next file, three copies of a multi-GB file through its BPE reading and tokenizing."""
    import tracemalloc

    source = tmp_path / "big.txt"
    source.write_bytes(b"a line of text\r\n" * 250_000)  # 4 MB
    docs = iter_document_parts(resolve_source(config(source, tmp_path / "cache")), config(source, tmp_path / "cache"))
    tracemalloc.start()
    try:
        text, _ = next(docs)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(text) == 3_750_000 and held < 1.5 * len(text), held


@pytest.mark.parametrize("key", ["decode_errors", "verify_shards"])
def test_unknown_modes_are_refused(tmp_path, key):
    with pytest.raises(DataError, match=rf"data.{key}='sometimes' is not one of"):
        prepare(config(tmp_path / "corpus.jsonl", tmp_path / "cache", **{key: "sometimes"}))


def test_a_stop_during_bpe_training_is_acted_on_at_once(monkeypatch):
    """The tokenizers library trains in native threads and Python runs signal handlers on the main thread only: the
    main thread waits for the training in short slices, so a stop recorded meanwhile ends preparation at once instead
    of after the merges (minutes on a large corpus)."""
    from coda_train.data.shards import PreparationInterrupted, _StopSignals, _train_bpe_stoppable

    monkeypatch.setattr(shards_module, "train_bpe", lambda docs, vocab_size, show_progress: time.sleep(30))
    stop = _StopSignals()
    with stop.deferred():
        threading.Timer(0.2, lambda: setattr(stop, "signum", signal.SIGTERM)).start()  # as the deferred handler records it
        start = time.monotonic()
        with pytest.raises(PreparationInterrupted, match="SIGTERM"):
            _train_bpe_stoppable(iter(["a document"]), 300, stop)
    assert time.monotonic() - start < 2.0
    monkeypatch.setattr(shards_module, "train_bpe", lambda docs, vocab_size, show_progress: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the training thread's errors are raised on the caller's thread
        _train_bpe_stoppable(iter(["a document"]), 300, _StopSignals())


def test_local_dataset_folder_read_through_datasets_is_prepared_again_when_its_files_change(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corpus" / "data").mkdir(parents=True)
    shard = tmp_path / "corpus" / "data" / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": make_docs(20)}), shard)
    cfg = config(tmp_path / "corpus", tmp_path / "cache", format="hub")
    assert prepare(cfg).manifest["num_documents"] == 20
    pq.write_table(pa.table({"text": make_docs(30, seed=1)}), shard)  # the corpus edited in place: same folder name
    assert prepare(cfg).manifest["num_documents"] == 30


def test_arrow_files_of_datasets_are_read_as_records_not_as_text(tmp_path):
    import datasets

    docs = make_docs(20)
    datasets.Dataset.from_dict({"text": docs, "id": list(range(20))}).save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    data = prepare(config(arrow, tmp_path / "cache"))  # before: one document of the file's binary bytes
    assert data.manifest["num_documents"] == 20 and data.manifest["document_counts"]["replaced"] == 0
    with pytest.raises(DataError, match=r"data.format=text reads .*\.arrow .* set data.format=arrow"):
        prepare(config(arrow, tmp_path / "cache", format="text"))


@pytest.mark.parametrize("fmt", ["auto", "hub"])
def test_a_save_to_disk_folder_is_read_as_its_dataset_and_a_dataset_dict_by_data_split(tmp_path, fmt):
    import datasets

    docs = make_docs(30)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(tmp_path / "saved")  # with state.json, dataset_info.json
    saved = prepare(config(tmp_path / "saved", tmp_path / "cache", format=fmt))  # before: "mixes formats" / load_dataset
    assert saved.manifest["num_documents"] == 30
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:25]}),
                          "validation": datasets.Dataset.from_dict({"text": docs[25:]})}).save_to_disk(tmp_path / "dict")
    assert prepare(config(tmp_path / "dict", tmp_path / "cache", format=fmt)).manifest["num_documents"] == 25
    assert prepare(config(tmp_path / "dict", tmp_path / "cache", format=fmt, split="validation")).manifest["num_documents"] == 5
    with pytest.raises(DataError, match=r"has no split 'test'.*\['train', 'validation'\].*data.split"):
        prepare(config(tmp_path / "dict", tmp_path / "cache", format=fmt, split="test"))


def test_the_eos_named_only_in_special_tokens_map_json_is_used(tmp_path):
    """Folders saved by older transformers name their special tokens in special_tokens_map.json only: its EOS, not the
    first known EOS name the vocabulary happens to hold, separates the documents (transformers reads it so too)."""
    tokenizer = train_bpe(make_docs(20), 300)  # holds <|endoftext|>, a known EOS name
    tokenizer.add_special_tokens(["<|eot|>"])
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"model_max_length": 2048}')
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"eos_token": {"content": "<|eot|>", "lstrip": false}}')
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs(10)])
    data = prepare(config(source, tmp_path / "cache", tokenizer=str(tmp_path / "tok")))
    assert data.manifest["tokenizer"]["eos_token"] == "<|eot|>" and data.eos_id == tokenizer.token_to_id("<|eot|>")
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')  # the config's comes first
    assert load_tokenizer(str(tmp_path / "tok"))[1] == "<|endoftext|>"


def test_a_hub_style_dataset_folder_with_its_readme_names_the_fixes_that_work(tmp_path):
    """A dataset folder as the hub has it (README.md beside data/train-*.parquet): "set data.format" alone led to
    data.format=parquet, which then failed on README.md; the message names a glob of the data files and data.format=hub."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "my-dataset"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my dataset\n")
    pq.write_table(pa.table({"text": make_docs(20)}), folder / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(DataError) as error:
        prepare(config(folder, tmp_path / "cache"))
    assert f"{folder / 'README.md'} is text" in str(error.value), error.value
    assert f"data.source='{folder}/**/*.parquet'" in str(error.value) and "data.format=hub" in str(error.value)
    assert prepare(config(f"{folder}/**/*.parquet", tmp_path / "cache")).manifest["num_documents"] == 20
    assert prepare(config(folder, tmp_path / "cache", format="hub")).manifest["num_documents"] == 20


def test_a_dataset_folder_in_splits_is_not_trained_on_whole(tmp_path, caplog):
    """A folder laid out in splits as the hub has it (data/train-*, data/validation-*): read whole (its format alone,
    or the glob the mixed-format message suggested) it trained on the validation split. The folder is refused with
    data.format=hub, which reads data.split; a glob is read as given, with a warning."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "my-dataset"
    (folder / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": make_docs(20)}), folder / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": make_docs(5, seed=1)}), folder / "data" / "validation-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"laid out in splits .*train: 1 file.*validation: 1 file.*validation-00000.*"
                                        r"its validation split\(s\) would be trained on. Set data.format=hub.*name the "
                                        r"files to train on \(data.source='.*/data/train-00000-of-00001.parquet'\)"):
        prepare(config(folder, tmp_path / "cache"))
    (folder / "README.md").write_text("# my dataset\n")  # as the hub has it: the split check comes before the formats'
    with pytest.raises(DataError, match="laid out in splits"):
        prepare(config(folder, tmp_path / "cache"))
    assert prepare(config(folder, tmp_path / "cache", format="hub")).manifest["num_documents"] == 20
    with caplog.at_level(logging.WARNING, logger="coda_train.data.sources"):
        assert prepare(config(f"{folder}/**/*.parquet", tmp_path / "cache")).manifest["num_documents"] == 25
    assert "matches files of several splits" in caplog.text
    # split folders and file names too (train/, test.jsonl)
    for layout in ({"train/a.jsonl": 10, "valid/b.jsonl": 3}, {"train.jsonl": 10, "test.jsonl": 3},
                   {"train4.jsonl": 10, "dev4.jsonl": 3}):
        other = tmp_path / f"layout{len(list(tmp_path.iterdir()))}"
        for name, n in layout.items():
            (other / name).parent.mkdir(parents=True, exist_ok=True)
            write_jsonl(other / name, [{"text": d} for d in make_docs(n)])
        with pytest.raises(DataError, match="laid out in splits") as error:
            prepare(config(other, tmp_path / "cache"))
        example = re.findall(r"data.source='([^']+)'", str(error.value))[-1]  # it names exactly the train files
        assert prepare(config(example, tmp_path / "cache", val_fraction=0.0)).manifest["num_documents"] == 10


def test_a_corpus_folder_whose_files_merely_name_a_split_word_is_read_whole(tmp_path):
    """Source code and notes (train.py, test_model.py, dev_notes.txt beside utils.py): not every file names a split,
    so it is no dataset in splits and every file is read, as before."""
    folder = tmp_path / "code"
    folder.mkdir()
    docs = make_docs(4)
    for name, doc in zip(("train.py", "test_model.py", "dev_notes.txt", "utils.py"), docs):
        (folder / name).write_text(doc)
    assert prepare(config(folder, tmp_path / "cache", val_fraction=0.0)).manifest["num_documents"] == 4


def test_parquet_text_stored_as_binary_is_decoded_per_decode_errors(tmp_path):
    """Spark and Hive write string columns as plain BYTE_ARRAY without the UTF-8 annotation; pyarrow reads them as
    binary. They were refused as "holds bytes, not text; set data.text_field to a text column", the column it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(20)
    pq.write_table(pa.table({"text": pa.array([d.encode() for d in docs], pa.binary())}), tmp_path / "spark.parquet")
    data = prepare(config(tmp_path / "spark.parquet", tmp_path / "cache", val_fraction=0.0))
    assert documents_in(data, "train") == docs
    raw = [d.encode() for d in docs[:5]] + [b"caf\xe9 latin-1"]
    pq.write_table(pa.table({"text": pa.array(raw, pa.large_binary())}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 6: invalid UTF-8.*data.decode_errors=replace"):
        prepare(config(tmp_path / "bad.parquet", tmp_path / "cache", decode_errors="strict"))
    skipped = prepare(config(tmp_path / "bad.parquet", tmp_path / "cache", decode_errors="skip_document"))
    assert skipped.manifest["document_counts"]["skipped"] == 1 and skipped.manifest["num_documents"] == 5


def test_a_spark_output_folder_is_read_despite_its_empty_success_marker(tmp_path):
    """Spark writes part-*.parquet beside an empty _SUCCESS file (and hidden .crc files): the marker holds no
    document, so it neither mixes a 'text' format into the folder nor is read as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": make_docs(20)}), tmp_path / "part-00000-1f2e.snappy.parquet")
    (tmp_path / "_SUCCESS").touch()
    (tmp_path / ".part-00000-1f2e.snappy.parquet.crc").write_bytes(b"crc")
    data = prepare(config(tmp_path, tmp_path / "cache"))
    assert data.manifest["num_documents"] == 20
    (tmp_path / "notes").write_text("not empty: a text file among Parquet files is still refused")
    with pytest.raises(DataError, match="mixes formats"):
        prepare(config(tmp_path, tmp_path / "cache"))


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_columnar_shards_without_the_text_column_are_refused_before_any_work(tmp_path, monkeypatch, suffix):
    """Shards of mixed schemas: the one without data.text_field was met only when reading reached it, after a BPE
    trained on the others (minutes on a large corpus) or midway through tokenizing; their footers tell at once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(table, path):
        if suffix == "parquet":
            pq.write_table(table, path)
        else:
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                writer.write_table(table)

    write(pa.table({"text": make_docs(20)}), tmp_path / f"a.{suffix}")
    write(pa.table({"content": make_docs(20)}), tmp_path / f"b.{suffix}")
    write(pa.table({"content": make_docs(20)}), tmp_path / f"c.{suffix}")
    monkeypatch.setattr(shards_module, "train_bpe", lambda *a, **k: pytest.fail("a BPE was trained"))
    with pytest.raises(DataError, match=rf"b.{suffix} has no column 'text' \(and 1 more file\); available fields: "
                                        rf"\['content'\]. Set data.text_field"):
        prepare(config(tmp_path, tmp_path / "cache"))


def test_prepared_data_is_not_reused_silently_after_the_tokenizer_config_names_another_eos(tmp_path):
    """The folder's name hashes the tokenizer's path, not its tokenizer_config.json: with the EOS named there edited,
    the shards ending documents with the old EOS were reused as they were."""
    tokenizer = train_bpe(make_docs(20), 300)
    tokenizer.add_special_tokens(["<|eot|>"])
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs(10)])
    cfg = config(source, tmp_path / "cache", tokenizer=str(tmp_path / "tok"))
    first = prepare(cfg)
    assert first.manifest["tokenizer"]["eos_token"] == "<|endoftext|>"
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|eot|>"}')
    with pytest.raises(DataError, match=rf"{first.path} ends documents with '<\|endoftext\|>', but the tokenizer now "
                                        rf"names '<\|eot\|>' as its EOS.*data.eos_token='<\|endoftext\|>' to keep that EOS, or delete {first.path}"):
        prepare(cfg)
    assert prepare(config(source, tmp_path / "cache", tokenizer=str(tmp_path / "tok"), eos_token="<|endoftext|>")).eos_id == 0
    assert (first.path / "manifest.json").exists()  # nothing removed


# --- a big text file read in parts ----------------------------------------------------------------------------------

def awkward_text_bytes(seed: int = 0) -> bytes:
    """A text file's bytes that a reader in small blocks can get wrong: a BOM, multibyte UTF-8 (2, 3 and 4 bytes), CR LF
    and lone CRs (one last), blank lines and indents (where no cut may fall), and a long line without any newline."""
    rng = random.Random(seed)
    words = ["naïve", "日本語", "🙂", "x", "(y)", "'s", "1234", "end.", "\t", "  "]
    ends = ["\n", "\r\n", "\r", "\n\n", "\r\n\r\n", " \n", "\n "]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + rng.choice(ends) for _ in range(300)]
    lines.insert(150, "no-newline-here-" * 40)  # 640 characters without a place to cut
    return b"\xef\xbb\xbf" + "".join(lines).encode() + b"the end\r"


def text_rows(file: Path, part_chars, **overrides) -> list[tuple[str, bool]]:
    from coda_train.data.sources import DocumentCounts, _text_rows
    cfg = config(file, file.parent / "cache", **overrides)
    return [(row["text"], ends) for _, row, ends in _text_rows(str(file), cfg, DocumentCounts(), False, part_chars)]


def test_a_text_file_read_in_small_blocks_and_parts_is_the_text_read_whole(tmp_path, monkeypatch):
    """A text file is read and decoded block by block and handed on in parts: a UTF-8 character or a CR LF cut by a
    block's end, and the byte-order mark, are read as in the whole file; parts join into the whole text, each but the
    last ends with a newline between two non-space characters, and only the last ends the document."""
    from coda_train.data import sources

    file = tmp_path / "doc.txt"
    file.write_bytes(awkward_text_bytes())
    whole = file.read_bytes()[3:].decode().replace("\r\n", "\n").replace("\r", "\n")
    assert text_rows(file, None) == [(whole, True)]
    for block_bytes in (1, 2, 3, 5, 7, 64):
        monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", block_bytes)
        parts = text_rows(file, 50)
        assert "".join(text for text, _ in parts) == whole, block_bytes
        assert [ends for _, ends in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 20
        assert all(a.endswith("\n") and not a[-2].isspace() and not b[0].isspace() for (a, _), (b, _) in zip(parts, parts[1:]))
        assert max(len(text) for text, _ in parts) >= 640  # the long line's part grew until a cut was possible
        assert text_rows(file, None) == [(whole, True)]


@pytest.mark.parametrize("mode", ["replace", "strict", "skip_document"])
def test_invalid_utf8_deep_in_a_text_read_in_parts_is_handled_as_in_the_whole_file(tmp_path, monkeypatch, mode):
    """Invalid UTF-8 met after parts of the file were handed on: replace gives the whole file's U+FFFD text, strict
    names the same line and byte, skip_document skips the whole file (checked before its first part) and counts it."""
    from coda_train.data import sources

    good = awkward_text_bytes()
    file = tmp_path / "doc.txt"
    file.write_bytes(good + b"line\nbad \xe2\x82 here\n\xf0\x9f\x99")  # a cut 3-byte character, a 4-byte one at the end
    whole = file.read_bytes()[3:].decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    if mode == "strict":
        with pytest.raises(DataError) as whole_error:
            text_rows(file, None, decode_errors=mode)
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 5)
    if mode == "strict":
        with pytest.raises(DataError) as parts_error:
            text_rows(file, 50, decode_errors=mode)
        line = good[3:].count(b"\n") + 2
        assert str(parts_error.value) == str(whole_error.value) and f"doc.txt:{line}: invalid UTF-8" in str(parts_error.value)
        return
    parts = text_rows(file, 50, decode_errors=mode)
    if mode == "replace":
        assert "".join(text for text, _ in parts) == whole and len(parts) > 20
    else:
        assert parts == []
        (tmp_path / "ok.txt").write_bytes(good)
        data = prepare(config(tmp_path / "*.txt", tmp_path / "cache", val_fraction=0.0, decode_errors=mode))
        assert data.manifest["document_counts"]["skipped"] == 1 and data.manifest["num_documents"] == 1


@pytest.mark.parametrize("part_chars", [None, 50])
def test_a_text_file_skipped_for_invalid_utf8_counts_all_its_bytes_as_read(tmp_path, monkeypatch, part_chars):
    """The progress counts the bytes read against the files' total size: a text file skipped for invalid UTF-8 near its
    start (decode_errors=skip_document) counts all its bytes, as when it was read whole, not only those up to the bad
    block (the progress stopped short of the total, by the rest of each skipped file)."""
    from coda_train.data import sources
    from coda_train.data.sources import DocumentCounts, _text_rows

    file = tmp_path / "doc.txt"
    file.write_bytes(b"bad \xff here\n" + awkward_text_bytes())
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 5)
    counts = DocumentCounts()
    assert list(_text_rows(str(file), config(file, tmp_path / "cache", decode_errors="skip_document"), counts, False,
                           part_chars)) == []
    assert counts.skipped == 1 and counts.bytes_read == file.stat().st_size


def llama3_style_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer folder as Llama 3's: its split regex, then bytes; its EOS named in tokenizer_config.json."""
    from tokenizers import Regex

    tokenizer = train_bpe(make_docs() + [awkward_text_bytes(1)[3:].decode()], vocab_size=400)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                   r"|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    folder = tmp_path / "llama3"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    return folder


@pytest.mark.parametrize("tokenizer", ["trained", "llama3"])
def test_a_big_text_file_is_prepared_in_bounded_parts_into_the_same_shards(tmp_path, monkeypatch, tokenizer):
    """A text file (one document) was read, BPE-trained on and tokenized whole: memory ~9 times a file's size, so a
    5-10 GB dump was killed for memory. Read in parts, no text handed to the BPE trainer or the tokenizer is much longer
    than a part, and the folder is byte for byte the one the whole file gave (same BPE, same shards, one EOS per file)."""
    from coda_train.data import sources

    (tmp_path / "corpus").mkdir()
    texts = [awkward_text_bytes(seed) for seed in range(3)]
    for i, data in enumerate(texts):
        (tmp_path / "corpus" / f"doc{i}.txt").write_bytes(data)
    with gzip.open(tmp_path / "corpus" / "doc3.txt.gz", "wb") as f:
        f.write(texts[0])
    overrides = dict(val_fraction=0.25, tokens_per_shard=500, num_proc=2)
    if tokenizer == "llama3":
        overrides["tokenizer"] = str(llama3_style_tokenizer(tmp_path))
    whole = prepare(config(tmp_path / "corpus", tmp_path / "whole", **overrides))
    monkeypatch.setattr(shards_module, "TEXT_PART_CHARS", 100)
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 7)
    in_workers = prepare(config(tmp_path / "corpus", tmp_path / "in_workers", **overrides))

    longest = {"bpe": 0, "encoded": 0}
    train_bpe_of, encode_of = shards_module.train_bpe, shards_module.encode_documents

    def recording_train_bpe(texts, *args, **kwargs):
        def seen():
            for text in texts:
                longest["bpe"] = max(longest["bpe"], len(text))
                yield text
        return train_bpe_of(seen(), *args, **kwargs)

    def recording_encode(tokenizer, texts, *args):
        longest["encoded"] = max([longest["encoded"], *map(len, texts)])
        return encode_of(tokenizer, texts, *args)

    monkeypatch.setattr(shards_module, "train_bpe", recording_train_bpe)
    monkeypatch.setattr(shards_module, "encode_documents", recording_encode)
    parts = prepare(config(tmp_path / "corpus", tmp_path / "parts", **{**overrides, "num_proc": 1}))  # recorded here
    decoded = [t[3:].decode().replace("\r\n", "\n").replace("\r", "\n") for t in texts]
    # a part is about TEXT_PART_CHARS, plus the text up to the next place a cut may fall, plus a block read ahead
    cuts = [0, *(m.end() for text in decoded for m in NEWLINE_BETWEEN_TEXT.finditer(text))]
    bound = 100 + max(b - a for a, b in zip(cuts, cuts[1:])) + 7
    assert bound < 1000 < min(map(len, decoded)) and longest["encoded"] <= bound
    assert (0 < longest["bpe"] <= bound) if tokenizer == "trained" else longest["bpe"] == 0
    for data in (parts, in_workers):
        assert {k: v for k, v in folder_bytes(data.path).items() if k not in ("manifest.json", "verified.json")} == \
               {k: v for k, v in folder_bytes(whole.path).items() if k not in ("manifest.json", "verified.json")}
        for key in ("num_documents", "num_characters", "num_tokens", "document_counts", "splits"):
            assert data.manifest[key] == whole.manifest[key], key
    assert parts.manifest["num_documents"] == 4 and parts.manifest["splits"]["val"]["num_documents"] == 1
    assert documents_in(parts, "train") + documents_in(parts, "val") == [decoded[0], decoded[1], decoded[2], decoded[0]]


def test_parquet_memory_is_bounded_by_a_few_rows_not_the_row_group(tmp_path):
    """A Parquet file of one big row group was read a column chunk and 65536 rows at a time: a 53 MB file held
    +308 MB while it was read. It is now read page by page, 64 rows at a time (same rows, same order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from coda_train.data.sources import DocumentCounts, _parquet_rows

    rng = random.Random(0)
    docs = ["".join(rng.choice("abcdefghij ") for _ in range(8000)) for _ in range(1000)]  # 8 MB in one row group
    file = tmp_path / "one_row_group.parquet"
    # pages of ~0.8 MB (the writer closes a page every write_batch_size rows): a page is what a reader must hold
    pq.write_table(pa.table({"text": docs}), file, row_group_size=len(docs), use_dictionary=False, write_batch_size=100)
    before, peak, read = pa.total_allocated_bytes(), 0, []
    for _, row in _parquet_rows(str(file), config(file, tmp_path / "cache"), DocumentCounts(), False):
        peak = max(peak, pa.total_allocated_bytes() - before)
        read.append(row["text"])
    assert read == docs
    assert peak < 5_000_000, f"{peak:,} bytes of Arrow memory while reading an 8 MB row group"


# --- hub revisions ----------------------------------------------------------------------------------------------------


def fake_hub(monkeypatch, docs_by_revision: dict) -> list[dict]:
    """datasets.load_dataset as the hub would answer it, offline: each revision's documents; the calls' arguments."""
    calls = []

    def load_dataset(name, **kwargs):
        calls.append({"name": name, **kwargs})
        return [{"text": d} for d in docs_by_revision[kwargs.get("revision")]]

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    return calls


def test_a_hub_revision_is_read_and_prepares_its_own_folder_which_records_it(tmp_path, monkeypatch):
    """A hub dataset was identified by its name alone: after the dataset got a new revision, a later run reused the
    old prepared data without a word; data.revision is passed to load_dataset, names its own folder and is recorded."""
    monkeypatch.chdir(tmp_path)
    calls = fake_hub(monkeypatch, {None: make_docs(20), "abc123": make_docs(30, seed=1), "def456": make_docs(25, seed=2)})
    unpinned = prepare(config("org/corpus", tmp_path / "cache"))
    pinned = prepare(config("org/corpus", tmp_path / "cache", revision="abc123"))
    other = prepare(config("org/corpus", tmp_path / "cache", revision="def456"))
    assert [c["revision"] for c in calls] == [None, None, "abc123", "abc123", "def456", "def456"]  # BPE, tokenizing
    assert len({unpinned.path, pinned.path, other.path}) == 3
    assert [d.manifest["num_documents"] for d in (unpinned, pinned, other)] == [20, 30, 25]
    assert pinned.manifest["inputs"]["source"] == {"hub": "org/corpus", "revision": "abc123"}
    assert pinned.manifest["source"] == "org/corpus at revision abc123"
    assert pinned.manifest["prepared_with"]["revision"] == "abc123"
    assert unpinned.manifest["inputs"]["source"] == {"hub": "org/corpus"}  # folders prepared unpinned keep their names
    assert prepare(config("org/corpus", tmp_path / "cache", revision="abc123")).path == pinned.path
    assert len(calls) == 6  # reused, not read again


def test_an_unpinned_hub_dataset_is_said_once_with_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    fake_hub(monkeypatch, {None: make_docs(20), "abc123": make_docs(20)})
    with caplog.at_level(logging.INFO):
        prepare(config("org/corpus", tmp_path / "cache"))
        prepare(config("org/corpus", tmp_path / "cache"), log_notes=False)  # a trainer's other ranks
    notes = [r.message for r in caplog.records if "not pinned" in r.message]
    assert notes == ["hub dataset 'org/corpus' is not pinned (data.revision unset): it is prepared from whatever revision "
                     "the hub serves at the time, and a folder prepared so is reused after the dataset changes; set "
                     "data.revision=<commit sha> to pin it (a branch or tag can move)"]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare(config("org/corpus", tmp_path / "cache", revision="abc123"))
        prepare(config(make_jsonl(tmp_path), tmp_path / "cache"))
    assert "not pinned" not in caplog.text


def make_jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs(20)])


@pytest.mark.parametrize("kind", ["file", "glob", "folder read through datasets", "builtin"])
def test_a_revision_for_a_local_source_is_refused_before_any_work(tmp_path, monkeypatch, kind):
    """load_dataset ignores a revision for a local folder, and the other local sources never read one: it would pin
    nothing, silently."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: pytest.fail("the hub must not be tried"))
    source, fmt, what = {"file": (str(make_jsonl(tmp_path)), "auto", "a local file, folder or glob"),
                         "folder read through datasets": (str(tmp_path), "hub", "a local file, folder or glob"),
                         "builtin": ("builtin", "auto", "the embedded corpus"),
                         "glob": (str(tmp_path / "*.jsonl"), "auto", "a local file, folder or glob")}[kind]
    cfg = config(source, tmp_path / "cache", format=fmt, revision="abc123")
    with pytest.raises(DataError, match=re.escape(f"data.revision='abc123' pins a Hugging Face hub dataset, but "
                                                  f"data.source={source!r} is {what}, which is identified by its files: "
                                                  "remove data.revision (or set data.source to the hub dataset's name)")):
        prepare(cfg)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(DataError, match=r"data.revision='' is empty"):
        config("org/corpus", tmp_path / "cache", revision="").validate()


@pytest.mark.parametrize("source, fmt, org_folder", [("org/corpus", "auto", True), ("org/corpus", "json", False),
                                                     ("./corpus/*.jsonl", "auto", False)])
def test_a_revision_for_a_path_that_is_not_there_names_data_format_hub(tmp_path, monkeypatch, source, fmt, org_folder):
    """A hub name read as a local path (an org/ folder in the cwd, or data.format=json) was said to be "a local file,
    folder or glob ... set data.source to the hub dataset's name", which it already was: the fix is data.format=hub."""
    monkeypatch.chdir(tmp_path)
    if org_folder:
        (tmp_path / "org").mkdir()
    with pytest.raises(DataError, match=re.escape(
            f"data.revision='abc123' pins a Hugging Face hub dataset, but data.source={source!r} is read as a local "
            f"path (data.format={fmt}), and there is none (cwd {tmp_path}): set data.format=hub if it is a hub "
            "dataset's name, or remove data.revision")):
        config(source, tmp_path / "cache", format=fmt, revision="abc123").validate()
