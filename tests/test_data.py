"""Data pipeline: tokenizer, preparation, loader, and every bad input named in issue 3. Tiny corpora; no network."""

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from coda_train.data import DataConfig, DataError, PreparedData, TokenLoader, prepare
from coda_train.data.sources import builtin_files
from coda_train.data import tokenizer as tokenizer_module
from coda_train.data.tokenizer import EOS_TOKEN, cuts_at_newlines, encode_documents, train_bpe

WORDS = "the model reads a token stream while loss falls seed rank epoch shard naïve 日本語 🙂 def return\n (x)".split(" ")


def make_docs(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(source: Path | str, cache_dir: Path, **overrides) -> DataConfig:
    settings = dict(source=str(source), cache_dir=str(cache_dir), vocab_size=300, val_fraction=0.1, num_proc=1)
    return DataConfig(**{**settings, **overrides})


def documents_in(data: PreparedData, split: str) -> list[str]:
    """Decode a split back into documents by cutting the token stream at EOS."""
    tokens = np.concatenate([s.read(0, len(s)) for s in data.shards(split)])
    cuts = np.flatnonzero(tokens == data.eos_id)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [data.tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, cuts)]


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs) -> PreparedData:
    root = tmp_path_factory.mktemp("prepared")
    source = write_jsonl(root / "corpus.jsonl", [{"text": d} for d in docs])
    return prepare(config(source, root / "cache", tokens_per_shard=1000))  # several shards per split


# --- tokenizer ---------------------------------------------------------------------------------------------------


def test_a_long_document_is_encoded_in_pieces_into_the_ids_of_the_whole(docs, monkeypatch):
    """A document longer than PIECE_CHARS (a big text file is one document) is encoded piece by piece, cut after a
    newline before text, so memory stays bounded: the same ids as encoding it whole, for our BPE and GPT-2-style
    and Llama-3-style pre-tokenizers; tokenizers whose pieces could change (a SentencePiece-style prefix) stay whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    text = "\n\n".join(docs) + "\n\n  indented\n\tx = 1  \n.\n;\n\n\nend" * 20 + "a.\nb\n\nc d\n e\n's\n1\n2" * 20 + "x = 1  # paragraph\n\ny" * 20
    ours = train_bpe([*docs, text], vocab_size=400)  # with merges across whitespace runs ("\n\n" one token)
    assert ours.encode("\n\n").ids != ours.encode("\n").ids * 2
    llama3 = Tokenizer.from_str(ours.to_str())
    llama3.pre_tokenizer = pre_tokenizers.Sequence([  # Llama 3's split pattern, then bytes without a regex
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                   r"|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2 = Tokenizer.from_str(ours.to_str())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    spm = Tokenizer(models.BPE())
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Metaspace()
    assert [cuts_at_newlines(t) for t in (ours, llama3, gpt2, spm)] == [True, True, True, False]
    whole = {name: encode_documents(t, [text, "short"], 0, np.dtype(np.uint32)) for name, t in
             (("ours", ours), ("llama3", llama3), ("gpt2", gpt2))}
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 20)
    assert len(tokenizer_module._pieces(text)) > 30 and "".join(tokenizer_module._pieces(text)) == text
    for name, t in (("ours", ours), ("llama3", llama3), ("gpt2", gpt2)):
        pieces = encode_documents(t, [text, "short"], 0, np.dtype(np.uint32))
        assert all(np.array_equal(a, b) for a, b in zip(pieces, whole[name])), name


SPLIT_PATTERNS = {  # the first pre-tokenizer of GPT-2 (ByteLevel's own regex), Llama 3 and Qwen 2, as their tokenizer.json
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def test_a_cut_after_a_newline_between_visible_characters_ends_a_piece_of_every_accepted_split():
    """The claim that lets a big text file be read and encoded in parts: cut just after a newline between two non-space
    characters (NEWLINE_BETWEEN_TEXT), its parts pre-tokenize into the pieces of the whole, for GPT-2's,
    Llama 3's and Qwen 2's splits, on random text dense in whitespace (Unicode's too), newlines, punctuation, marks,
    digits and apostrophes.
    Splits that may join text across a newline are refused (no pre-tokenizer, a non-isolating split, an added token
    taking in the whitespace before it)."""
    from tokenizers import AddedToken, Regex, Tokenizer, pre_tokenizers

    splits = {"gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False)} | {
        name: pre_tokenizers.Split(Regex(pattern), behavior="isolated") for name, pattern in SPLIT_PATTERNS.items()}
    rng = random.Random(0)
    alphabet = ["\n", "\n", "\n", " ", "  ", "\t", "\r", "a", "Zé", "日本", "1", "234", "'s", "'", ".", "!?", "(", "_", "🙂",
                "\u00a0", "\u3002", "\u0301", "\u2028", "\u3000", "\x85", "\x1c", "\u200b", "\u0660", "\U0001d7d8"]
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        cuts = [0, *(m.end() for m in tokenizer_module.NEWLINE_BETWEEN_TEXT.finditer(text)), len(text)]
        for name, split in splits.items():
            whole = [piece for piece, _ in split.pre_tokenize_str(text)]
            parts = [piece for a, b in zip(cuts, cuts[1:]) for piece, _ in split.pre_tokenize_str(text[a:b])]
            assert parts == whole, (name, text)
    ours = train_bpe(make_docs(4), vocab_size=300)
    for pre_tokenizer in (None, pre_tokenizers.Split(Regex(SPLIT_PATTERNS["llama3"]), behavior="merged_with_previous"),
                          pre_tokenizers.Split(Regex(SPLIT_PATTERNS["llama3"]), behavior="isolated", invert=True)):
        other = Tokenizer.from_str(ours.to_str())
        other.pre_tokenizer = pre_tokenizer
        assert not cuts_at_newlines(other)
    stripping = Tokenizer.from_str(ours.to_str())
    stripping.add_tokens([AddedToken("return", lstrip=True)])  # "x\nreturn" is one token for "\nreturn": no cut there
    assert cuts_at_newlines(ours) and not cuts_at_newlines(stripping)


def test_a_split_followed_by_a_metaspace_prepending_to_the_first_piece_only_gets_no_cuts(docs, monkeypatch):
    """cuts_at_newlines looked at the first pre-tokenizer only: a Metaspace after it with prepend_scheme="first" adds
    "\u2581" to a text's first piece alone, so each part of a cut text (a long document's pieces, a text file's parts)
    got one that the whole text does not have: silently other ids. Such a tokenizer encodes its documents whole;
    prepending to every piece ("always") gives the same pieces either way, and cuts."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    text = "\n".join(docs)
    tokenizer = Tokenizer.from_str(train_bpe([*docs, "\u2581" + text], vocab_size=400).to_str())
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 20)
    for scheme in ("first", "always"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERNS["llama3"]), behavior="isolated"),
            pre_tokenizers.Metaspace(prepend_scheme=scheme),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert cuts_at_newlines(tokenizer) == (scheme == "always")
        tokens, _ = encode_documents(tokenizer, [text], 0, np.dtype(np.uint32))
        assert tokens[:-1].tolist() == tokenizer.encode(text, add_special_tokens=False).ids, scheme

def test_a_loaded_tokenizers_truncation_and_padding_do_not_cut_documents(docs):
    """A tokenizer.json may carry truncation or padding (HF files often do): documents are still encoded whole and
    unpadded, and the tokenizer itself (its fingerprint) is left as it was; an added token holding a newline keeps a
    long document from being encoded in pieces (a cut could fall inside it)."""
    from tokenizers import AddedToken, Tokenizer

    ours = train_bpe(docs, vocab_size=300)
    text = " ".join(docs)
    full, _ = encode_documents(ours, [text], 0, np.dtype(np.uint32))
    loaded = Tokenizer.from_str(ours.to_str())
    loaded.enable_truncation(64)
    loaded.enable_padding(length=4096)
    before = loaded.to_str()
    tokens, lengths = encode_documents(loaded, [text], 0, np.dtype(np.uint32))
    assert len(full) > 65 and np.array_equal(tokens, full) and loaded.to_str() == before
    loaded.add_tokens([AddedToken("\n<|turn|>\n", special=True)])
    assert cuts_at_newlines(ours) and not cuts_at_newlines(loaded)


def test_a_special_tokens_text_inside_a_document_is_text_not_that_token(docs):
    """A document quoting "<|endoftext|>" (a page about tokenizers) is encoded as that text: recognized as the special
    token, it ended the document early as EOS, silently. The tokenizer (its fingerprint) is left as it was."""
    tokenizer = train_bpe(docs, vocab_size=300)
    before = tokenizer.to_str()
    text = f"a page quoting {EOS_TOKEN} in its text"
    tokens, lengths = encode_documents(tokenizer, [text, "next"], 0, np.dtype(np.uint32))
    assert tokens[0] != 0 and list(np.flatnonzero(tokens == 0)) == [lengths[0] - 1, len(tokens) - 1]
    assert tokenizer.decode(tokens[: lengths[0] - 1].tolist()) == text and tokenizer.to_str() == before


def test_tokenizer_round_trip(docs):
    tokenizer = train_bpe(docs, vocab_size=300)
    assert tokenizer.token_to_id(EOS_TOKEN) == 0
    assert tokenizer.get_vocab_size() == 300
    for text in [*docs[:5], "  tabs\tand\r\nnewlines\n\n", "unseen: ßøé ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f", ""]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text


def test_prepared_documents_round_trip_and_split(prepared, docs):
    train, val = documents_in(prepared, "train"), documents_in(prepared, "val")
    assert len(val) == 4  # 10% of 40 documents, spread evenly: indices 9, 19, 29, 39
    assert val == [docs[i] for i in (9, 19, 29, 39)]
    assert train == [d for i, d in enumerate(docs) if i % 10 != 9]
    m = prepared.manifest
    assert m["dtype"] == "uint16" and prepared.vocab_size == 300
    assert m["splits"]["train"]["num_documents"] == 36
    assert len(m["splits"]["train"]["shards"]) > 1
    assert all(s["num_tokens"] <= 1000 for s in m["splits"]["train"]["shards"])
    assert prepared.num_tokens("train") + prepared.num_tokens("val") == m["num_tokens"]
    prepared.verify_checksums()


# --- preparation -------------------------------------------------------------------------------------------------


def test_prepare_is_deterministic_across_processes_and_reused(tmp_path, docs):
    # one document quotes the EOS token's text: worker processes encode it as text too (for_documents)
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs] + [{"text": f"quoting {EOS_TOKEN} here"}])
    serial = prepare(config(source, tmp_path / "a", num_proc=1))
    parallel = prepare(config(source, tmp_path / "b", num_proc=2))
    assert serial.path.name == parallel.path.name  # folder named by inputs, not by num_proc
    files = folder_bytes(serial.path)
    other = folder_bytes(parallel.path)
    assert files.keys() == other.keys()
    local = ("manifest.json", "verified.json")  # timings, and the shards' mtimes their checksum check is remembered by
    assert all(files[name] == other[name] for name in files if name not in local)
    assert serial.manifest["tokenizer"] == parallel.manifest["tokenizer"]

    again = prepare(config(source, tmp_path / "a", num_proc=2))
    assert again.path == serial.path and folder_bytes(again.path) == files  # reused, not rewritten
    changed = prepare(config(source, tmp_path / "a", vocab_size=280))
    assert changed.path != serial.path and changed.vocab_size == 280


def test_text_json_parquet_sources_agree(tmp_path, docs, prepared):
    tokenizer = tmp_path / "tokenizer.json"
    prepared.tokenizer.save(str(tokenizer))
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"doc{i:03d}.txt").write_text(d)  # one file = one document
    write_jsonl(tmp_path / "corpus.jsonl", [{"id": i, "body": d} for i, d in enumerate(docs)])
    pq.write_table(pa.table({"body": docs}), tmp_path / "corpus.parquet")
    results = [
        prepare(config(tmp_path / "txt" / "*.txt", tmp_path / "cache", tokenizer=str(tokenizer))),
        prepare(config(tmp_path / "corpus.jsonl", tmp_path / "cache", tokenizer=str(tokenizer), text_field="body")),
        prepare(config(tmp_path / "corpus.parquet", tmp_path / "cache", tokenizer=str(tokenizer), text_field="body", num_proc=2)),
    ]
    assert len({r.path for r in results}) == 3
    for r in results:
        assert r.manifest["tokenizer"]["fingerprint"] == prepared.manifest["tokenizer"]["fingerprint"]
        assert documents_in(r, "train") == documents_in(prepared, "train")
        assert documents_in(r, "val") == documents_in(prepared, "val")


def test_max_documents_and_builtin_listing(tmp_path, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    data = prepare(config(source, tmp_path / "cache", max_documents=20))
    assert data.manifest["num_documents"] == 20
    files = builtin_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("/site-packages/" in f or "/test/" in f for f in files)


def test_command_line(tmp_path, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    command = [sys.executable, "-m", "coda_train.data.prepare", "--cache-dir", str(tmp_path / "cache")]
    args = ["--source", str(source), "--vocab-size", "300", "--num-proc", "1", "--max-documents", "none", "--verify"]
    run = subprocess.run([*command, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "train" in run.stdout and "vocab 300" in run.stdout
    missing = subprocess.run([*command, "--source", str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no files match" in missing.stderr


def test_command_line_errors_name_its_own_flags(tmp_path):
    """The command line's errors name its flags (--decode-errors, --format), not the data.<key>= overrides of
    train.py that the same DataError names for a run; a key without a flag here stays as written."""
    source = tmp_path / "corpus.jsonl"
    source.write_bytes(b'{"text": "caf\xe9 latin-1 bytes"}\n')
    command = [sys.executable, "-m", "coda_train.data.prepare", "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1"]
    strict = subprocess.run([*command, "--source", str(source), "--decode-errors", "strict"], capture_output=True,
                            text=True, timeout=120)
    assert strict.returncode == 2 and "set --decode-errors replace" in strict.stderr, strict.stderr
    assert "data.decode_errors" not in strict.stderr, strict.stderr
    missing = subprocess.run([*command, "--source", str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and f"no files match --source '{tmp_path / 'nope.jsonl'}'" in missing.stderr, missing.stderr
    assert "pass --format hub" in missing.stderr and "data.format" not in missing.stderr, missing.stderr
    with pytest.raises(DataError, match="set data.decode_errors=replace"):  # train.py's message keeps its keys
        prepare(config(source, tmp_path / "cache", decode_errors="strict"))
    from coda_train.data.prepare import cli_message
    assert cli_message("data.path of data.streaming=false, data.vocab_size=9") == "data.path of --no-streaming, --vocab-size 9"
    # train.py's choice of the built-in corpus (configs/data/builtin.yaml) is --source builtin here
    empty = subprocess.run([*command, "--source", ""], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "or use --source builtin" in empty.stderr and "data=" not in empty.stderr, empty.stderr


def test_command_line_warnings_name_its_own_flags_too(tmp_path):
    """The warnings the command line logs while it prepares (a row without the text field, a shard check) name its
    flags as its errors do: it said 'set data.text_field', a train.py override, where --text-field is the fix here."""
    source = tmp_path / "corpus.jsonl"
    source.write_text('{"text": "some text here"}\n{"body": "another column"}\n{"text": "more text"}\n')
    command = [sys.executable, "-m", "coda_train.data.prepare", "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1",
               "--source", str(source), "--vocab-size", "300", "--val-fraction", "0"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "set --text-field if the text is in another column" in run.stderr, run.stderr
    assert "data.text_field" not in run.stderr + run.stdout, run.stderr


# --- loader ------------------------------------------------------------------------------------------------------


def take(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_batches_are_deterministic_shifted_windows(prepared):
    a = TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=7)
    b = TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=7)
    c = TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=8)
    steps = 2 * a.steps_per_epoch + 1  # into a third epoch
    batches_a, batches_b, batches_c = take(a, steps), take(b, steps), take(c, steps)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b):
        assert xa.dtype == torch.int64 and xa.shape == (8, 32) and ya.shape == (8, 32)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(batches_a, batches_c))
    epoch0 = torch.cat([x for x, _ in batches_a[: a.steps_per_epoch]])
    epoch1 = torch.cat([x for x, _ in batches_a[a.steps_per_epoch : 2 * a.steps_per_epoch]])
    assert not torch.equal(epoch0, epoch1)  # a fresh order each epoch


@pytest.mark.parametrize("stop", ["mid_epoch", "epoch_end"])
def test_resume_reproduces_the_uninterrupted_sequence(prepared, stop):
    first = TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=1, rank=1, world_size=2)
    total = 2 * first.steps_per_epoch + 3
    split = first.steps_per_epoch // 2 if stop == "mid_epoch" else first.steps_per_epoch
    uninterrupted = take(TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=1, rank=1, world_size=2), total)
    take(first, split)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = TokenLoader(prepared, "train", batch_size=8, seq_len=32, seed=1, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(uninterrupted[split:], take(resumed, total - split), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def optimizer_steps(loaders: list[TokenLoader], steps: int) -> list[list[tuple]]:
    """Each optimizer step's windows (as sorted token tuples) over all ranks' loaders, accum_steps micro-batches each."""
    out = []
    for _ in range(steps):
        rows = [x for loader in loaders for _ in range(loader.accum_steps) for x in loader.next_batch()[0]]
        out.append(sorted(tuple(r.tolist()) for r in rows))
    return out


def test_resume_with_the_batch_made_up_by_accumulation_reads_the_same_windows_per_optimizer_step(prepared):
    """2 ranks x batch 2 resumed on 1 process x batch 2 x 2 micro-batches (a run moved to fewer GPUs): each optimizer
    step reads the same 4 windows as the uninterrupted run, across the epoch boundary too; a layout whose epochs
    end elsewhere, or whose optimizer step is another size, is refused naming what differs."""
    two = lambda: [TokenLoader(prepared, "train", 2, 16, seed=5, rank=r, world_size=2) for r in range(2)]  # noqa: E731
    straight = optimizer_steps(two(), 2 * two()[0].steps_per_epoch + 3)
    before = two()
    split = before[0].steps_per_epoch - 2
    optimizer_steps(before, split)
    one = TokenLoader(prepared, "train", 2, 16, seed=5, accum_steps=2)
    one.load_state_dict(json.loads(json.dumps(before[0].state_dict())))
    assert optimizer_steps([one], len(straight) - split) == straight[split:]
    # the fix names the accumulation that restores the saved global batch, as trainer/build.py's early check does
    with pytest.raises(DataError, match=r"global batch .*: saved 2 x 2 x 1 = 4 vs now 2 x 1 x 1 = 2\); resume with a global "
                                        r"batch of 4 windows \(trainer.grad_accum_steps=2 on 1 process\)"):
        TokenLoader(prepared, "train", 2, 16, seed=5).load_state_dict(before[0].state_dict())  # half the step
    # the same global batch, but a position inside one of this layout's micro-steps (the trainer saves none such)
    mid_step = {**one.state_dict(), "step": 1}
    with pytest.raises(DataError, match=r"trainer.batch_size x processes: saved 2 vs now 4\); resume with "
                                        r"trainer.batch_size x processes = 2 \(the saved position, micro-step 1,"):
        TokenLoader(prepared, "train", 4, 16, seed=5).load_state_dict(mid_step)


def all_windows(data: PreparedData, split: str, seq_len: int) -> Counter:
    windows = Counter()
    for shard in data.shards(split):
        for start in range(0, len(shard) - seq_len, seq_len):
            windows[tuple(shard.read(start, seq_len + 1).tolist())] += 1
    return windows


@pytest.mark.parametrize("world_size", [1, 3])
def test_ranks_are_disjoint_and_cover_an_epoch(prepared, world_size):
    seq_len = 16
    loaders = [
        TokenLoader(prepared, "train", batch_size=1, seq_len=seq_len, seed=3, rank=rank, world_size=world_size)
        for rank in range(world_size)
    ]
    seen = Counter()
    for loader in loaders:
        for x, y in take(loader, loader.steps_per_epoch):
            seen[tuple(torch.cat([x[0], y[0, -1:]]).tolist())] += 1
    expected = all_windows(prepared, "train", seq_len)
    assert sum(expected.values()) == loaders[0].num_windows
    assert not seen - expected  # no window read more often than it exists: ranks are disjoint
    assert sum(seen.values()) == loaders[0].num_windows - loaders[0].num_windows % world_size  # and they cover the epoch


def test_eval_iterator_is_fixed_and_leaves_training_position(prepared):
    loader = TokenLoader(prepared, "val", batch_size=2, seq_len=8, seed=0)
    first, second = list(loader.iter_eval(3)), list(loader.iter_eval(3))
    assert len(first) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    assert loader.state_dict()["step"] == 0
    ranks = [TokenLoader(prepared, "val", batch_size=1, seq_len=8, seed=0, rank=r, world_size=2) for r in range(2)]
    seen = Counter(tuple(torch.cat([x[0], y[0, -1:]]).tolist()) for r in ranks for x, y in r.iter_eval())
    assert not seen - all_windows(prepared, "val", 8)  # the ranks evaluate disjoint windows
    assert sum(seen.values()) == ranks[0].num_windows - ranks[0].num_windows % 2


def test_a_position_past_this_layouts_end_of_the_epoch_continues_at_the_next_epoch(prepared, caplog):
    """An epoch ends at its last whole optimizer step, so a position saved with fewer micro-steps per optimizer step
    (or before 2026-12-05, when an epoch ran to its last whole micro-batch and states had no accum_steps) may lie
    past this layout's end of the epoch: it continues at the next epoch's start, with a warning."""
    loader = TokenLoader(prepared, "train", 2, 16, seed=5, accum_steps=3)
    old_end = loader.windows_per_rank // 2
    assert old_end > loader.steps_per_epoch  # this corpus leaves a partial optimizer step at the epoch's end
    saved = {k: v for k, v in loader.state_dict().items() if k != "accum_steps"}
    resumed = TokenLoader(prepared, "train", 2, 16, seed=5, accum_steps=3)
    with caplog.at_level("WARNING"):
        resumed.load_state_dict({**saved, "epoch": 4, "step": old_end})
    assert (resumed.epoch, resumed.step) == (5, 0) and "continuing at the start of epoch 5" in caplog.text
    within = TokenLoader(prepared, "train", 2, 16, seed=5, accum_steps=3)
    within.load_state_dict({**saved, "epoch": 4, "step": 3})
    assert (within.epoch, within.step) == (4, 3)
    # today's states too: a run saved at its epoch's end with accum 1 and resumed with accum 3 (the same micro-batch)
    at_end = TokenLoader(prepared, "train", 2, 16, seed=5, accum_steps=1)
    at_end.step = at_end.steps_per_epoch
    assert at_end.steps_per_epoch == old_end > within.steps_per_epoch
    within.load_state_dict(at_end.state_dict())
    assert (within.epoch, within.step) == (1, 0)
    with pytest.raises(DataError, match="out of range"):  # more windows than the split holds: a damaged state
        within.load_state_dict({**loader.state_dict(), "step": old_end + 1})
    # an old state with another micro-batch: its accumulation is unknown, so the fix names the micro-batch
    with pytest.raises(DataError, match=r"trainer.batch_size x processes: saved 2 vs now 4\); resume with trainer.batch_size "
                                        r"x processes = 2 and the run's own trainer.grad_accum_steps"):
        TokenLoader(prepared, "train", 4, 16, seed=5, accum_steps=1).load_state_dict(saved)


def test_validation_windows_are_the_same_for_every_layout_of_one_global_batch(prepared):
    """The trainer evaluates eval_batches x grad_accum_steps micro-batches per rank (trainer/loop.py): every
    layout of one global batch (batch_size x processes x grad_accum_steps) reads the same windows."""
    def evaluated(batch_size, world_size, accum_steps, eval_batches=3):
        rows = []
        for rank in range(world_size):  # as trainer/build.py builds the val loader: whole global batches
            loader = TokenLoader(prepared, "val", batch_size, 8, seed=0, rank=rank, world_size=world_size,
                                 accum_steps=accum_steps)
            rows += [tuple(row.tolist()) for x, _ in loader.iter_eval(eval_batches * accum_steps) for row in x]
        return sorted(rows)

    one = evaluated(8, 1, 1)
    assert len(one) == 24 and one == evaluated(4, 1, 2) == evaluated(2, 2, 2) == evaluated(1, 4, 2) == evaluated(4, 2, 1)
    everything = evaluated(8, 1, 1, eval_batches=10_000)  # more than the split holds: its whole global batches
    assert len(everything) % 8 == 0 and everything == evaluated(1, 1, 8, 10_000) == evaluated(2, 2, 2, 10_000)


def test_loader_refuses_incompatible_state_and_tiny_splits(prepared):
    loader = TokenLoader(prepared, "train", batch_size=2, seq_len=16, seed=0)
    with pytest.raises(DataError, match=r"saved 2 x 1 x 1 = 2 vs now 4 x 1 x 1 = 4"):
        TokenLoader(prepared, "train", batch_size=4, seq_len=16, seed=0).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="fewer than one batch"):
        TokenLoader(prepared, "val", batch_size=64, seq_len=64, seed=0)
    # a larger val split shrinks the train split: each split's message moves data.val_fraction its own way
    with pytest.raises(DataError, match=r"train split .* trainer.grad_accum_steps, fewer processes, more data or a smaller "
                                        r"data.val_fraction$"):
        TokenLoader(prepared, "train", batch_size=10**6, seq_len=16, seed=0, rank=0, world_size=2)


def test_an_empty_val_split_names_the_val_fraction_that_holds_one_out(tmp_path, docs):
    # a text file is one document: no data.val_fraction holds it out, and none of the tiny-split fixes helps
    book = tmp_path / "book.txt"
    book.write_text("\n".join(docs))
    data = prepare(config(book, tmp_path / "cache"))
    with pytest.raises(DataError, match=r"val split .* is empty: its corpus is one document .* cut the file into several"):
        TokenLoader(data, "val", batch_size=1, seq_len=8, seed=0)
    few = write_jsonl(tmp_path / "few.jsonl", [{"text": d} for d in docs[:5]])
    with pytest.raises(DataError, match=r"data.val_fraction=0.1 of its 5 documents holds out none.* "
                                        r"data.val_fraction=0.2 or larger, or trainer.eval_every=0"):
        TokenLoader(prepare(config(few, tmp_path / "cache")), "val", batch_size=1, seq_len=8, seed=0)
    assert prepare(config(few, tmp_path / "cache", val_fraction=0.2)).manifest["splits"]["val"]["num_documents"] == 1


# --- bad input ---------------------------------------------------------------------------------------------------


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match="no files match"):
        prepare(config(tmp_path / "nowhere" / "*.jsonl", tmp_path / "cache"))
    with pytest.raises(DataError, match="no files match"):
        prepare(config(tmp_path / "nowhere.jsonl", tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text("some text")
    with pytest.raises(DataError, match="tokenizer file .*tok.json does not exist"):
        prepare(config(tmp_path / "corpus.txt", tmp_path / "cache", tokenizer=str(tmp_path / "tok.json")))


def test_an_empty_cache_dir_is_refused_before_the_current_directory_is_written(tmp_path, monkeypatch, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    monkeypatch.chdir(tmp_path)
    for empty in ("", " "):
        with pytest.raises(DataError, match=r"data.cache_dir='\s?' is empty, .* e.g. data.cache_dir=data_cache"):
            prepare(config(source, empty))
    assert os.listdir(tmp_path) == ["corpus.jsonl"]


def test_an_empty_tokenizer_path_is_refused_not_taken_for_unset(tmp_path, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    with pytest.raises(DataError, match=r"data.tokenizer='' is empty: .* or leave data.tokenizer unset \(null\) to train a BPE"):
        prepare(config(source, tmp_path / "cache", tokenizer=""))
    assert not (tmp_path / "cache").exists()
    # the command line names its own spelling of unset: `--tokenizer null` would be read as a path named 'null'
    command = [sys.executable, "-m", "coda_train.data.prepare", "--source", str(source), "--cache-dir",
               str(tmp_path / "cache"), "--tokenizer", ""]
    cli = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "or leave --tokenizer unset (--tokenizer none) to train a BPE" in cli.stderr, cli.stderr
    assert "null" not in cli.stderr, cli.stderr
    from coda_train.data.prepare import cli_message, parse_args
    assert cli_message("leave data.revision unset (null)") == "leave --revision unset (--revision none)"
    assert parse_args(["--revision", "none", "--tokenizer", "None"])[0].tokenizer is None


def test_empty_corpus(tmp_path):
    source = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(DataError, match="is empty"):
        prepare(config(source, tmp_path / "cache"))
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        prepare(config(tmp_path / "blank.txt", tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # failed runs leave no temp folders behind


def test_missing_text_field(tmp_path, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"content": d} for d in docs])
    with pytest.raises(DataError, match=r"no field 'text'; available fields: \['content'\]"):
        prepare(config(source, tmp_path / "cache", num_proc=2))


def test_shards_from_another_tokenizer(tmp_path, docs):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(docs, vocab_size=300).save(str(tokenizer))
    first = prepare(config(source, tmp_path / "cache", tokenizer=str(tokenizer)))
    before = folder_bytes(first.path)
    train_bpe(docs, vocab_size=290).save(str(tokenizer))  # the file the config names now holds a different tokenizer
    with pytest.raises(DataError, match="another tokenizer"):
        prepare(config(source, tmp_path / "cache", tokenizer=str(tokenizer)))
    with pytest.raises(DataError, match=r"another tokenizer.*Restore it, or delete .* and run prepare again$"):
        PreparedData.open(first.path, expected_tokenizer="0" * 64)
    assert folder_bytes(first.path) == before


@pytest.mark.parametrize("damage", ["shard", "manifest", "manifest field"])
def test_truncated_shard_or_manifest(tmp_path, docs, damage):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    data = prepare(config(source, tmp_path / "cache"))
    victim = data.path / ("train_00000.bin" if damage == "shard" else "manifest.json")
    if damage == "manifest field":  # valid JSON that lost a shard's token count
        manifest = json.loads(victim.read_text())
        del manifest["splits"]["train"]["shards"][0]["num_tokens"]
        victim.write_text(json.dumps(manifest))
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    damaged = folder_bytes(data.path)
    with pytest.raises(DataError, match=f"truncated.*delete {data.path}"):
        prepare(config(source, tmp_path / "cache"))
    assert folder_bytes(data.path) == damaged  # the error names the fix; nothing is deleted behind the user's back


def test_data_of_another_format_version_names_the_fix(tmp_path, docs):
    """A folder prepared by another version of this code (after an upgrade) is refused, not misread."""
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    data = prepare(config(source, tmp_path / "cache"))
    manifest = json.loads((data.path / "manifest.json").read_text())
    (data.path / "manifest.json").write_text(json.dumps({**manifest, "format_version": -1}))
    before = folder_bytes(data.path)
    with pytest.raises(DataError, match=rf"{data.path} was prepared by format version -1, this code reads \d+; .*delete"):
        prepare(config(source, tmp_path / "cache"))
    assert folder_bytes(data.path) == before


def test_failed_run_leaves_prepared_results_alone(tmp_path, docs):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": d} for d in docs])
    data = prepare(config(good, tmp_path / "cache"))
    before = folder_bytes(data.path)
    tokenizer = tmp_path / "tokenizer.json"
    data.tokenizer.save(str(tokenizer))
    (tmp_path / "bad").mkdir()
    write_jsonl(tmp_path / "bad" / "a.jsonl", [{"text": d} for d in docs * 100])  # > one tokenization chunk
    (tmp_path / "bad" / "b.jsonl").write_text('{"text": "cut off mid-wri')
    with pytest.raises(DataError, match="could not read documents"):
        # num_proc=1 writes each chunk at once, so this fails after a shard was begun
        prepare(config(tmp_path / "bad", tmp_path / "cache", tokenizer=str(tokenizer), num_proc=1))
    assert os.listdir(tmp_path / "cache") == [data.path.name]
    assert folder_bytes(data.path) == before


def test_a_start_imports_datasets_only_to_read_a_hub_dataset():
    """`datasets` (and the pandas it pulls in) took ~1 s of every train.py start, --help included, on runs that read
    local files: it is imported where a hub dataset is loaded."""
    root = Path(__file__).resolve().parents[1]
    code = "import sys, train; assert 'datasets' not in sys.modules, 'datasets imported at start'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=300)
