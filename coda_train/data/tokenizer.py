"""Tokenizers: train a byte-level BPE on the corpus, or load an existing tokenizer.json / HF tokenizer directory."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import EOS_TOKEN, DataError

# EOS names used by common tokenizers (GPT-2/NeoX, Llama-3, Llama-2/Mistral, Gemma), tried in this order
KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# longest pre-tokenized piece, in bytes: BPE training cost grows with the square of a piece's length, so a long run
# without whitespace (minified code, base64, "abab...") is cut into pieces this long; ordinary words are far shorter
MAX_PIECE_BYTES = 64
# load_tokenizer's result: the tokenizer, and the EOS its tokenizer_config.json (or special_tokens_map.json) names
LoadedTokenizer = tuple[Tokenizer, Optional[str]]


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, pieces capped at MAX_PIECE_BYTES): every string round-trips exactly; EOS is id 0.

    show_progress draws the trainer's own progress bars (for terminals)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),  # GPT-2 split into words/numbers/punctuation/spaces, as bytes
        # then pieces of at most MAX_PIECE_BYTES byte-level characters (one per byte); "." matches all of them
        pre_tokenizers.Split(Regex(f".{{1,{MAX_PIECE_BYTES}}}"), behavior="isolated"),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so no input is ever unknown
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one in an HF tokenizer directory."""
    p = Path(path).expanduser()
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer(path: str, setting: str = "data.tokenizer",
                   otherwise: str = "leave it unset to train a BPE") -> LoadedTokenizer:
    """A tokenizer.json file or an HF tokenizer directory; also returns the EOS named in its tokenizer_config.json
    (else special_tokens_map.json), if any.
    `setting` is where the caller's user gave the path (data.tokenizer, model.init_from, a script's --tokenizer) and
    `otherwise` what they can do instead: the errors name both as the fix."""
    file = tokenizer_file(path)
    if not file.is_file():
        hint = " (only tokenizers with a tokenizer.json are supported; save one with save_pretrained)" if file != Path(path).expanduser() else ""
        raise DataError(f"tokenizer file {file} does not exist{hint}; fix {setting}={path}, or {otherwise}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises a bare Exception for malformed JSON
        raise DataError(f"could not read tokenizer {file}: {e}; point {setting} at a valid tokenizer.json, "
                        f"or {otherwise}") from e
    config_eos = None
    # older transformers name the special tokens in special_tokens_map.json only
    for config_file in (file.parent / "tokenizer_config.json", file.parent / "special_tokens_map.json"):
        if config_eos is not None or not config_file.is_file():
            continue
        try:
            eos = json.loads(config_file.read_text()).get("eos_token")
        except (ValueError, AttributeError) as e:  # malformed JSON, or JSON that is not an object
            raise DataError(f"could not read {config_file}: {e}; fix or remove it (it only names the EOS token), "
                            "or set data.eos_token") from e
        config_eos = eos.get("content") if isinstance(eos, dict) else eos
    return tokenizer, config_eos


def find_eos(tokenizer: Tokenizer, requested: Optional[str], config_eos: Optional[str] = None) -> tuple[str, int]:
    candidates = [requested] if requested else [t for t in (config_eos, *KNOWN_EOS_TOKENS) if t]
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    # which tokens data.eos_token can name: without any, the user must add one to the tokenizer first
    special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
    raise DataError(f"the tokenizer has none of the EOS tokens {candidates} (its special tokens: {special or 'none'}); set "
                    "data.eos_token to its end-of-document token, or add one to the tokenizer (Tokenizer.add_special_tokens) "
                    "and save it")


def fingerprint(tokenizer: Tokenizer) -> str:
    """Hash of the full serialized tokenizer (vocab, merges, normalizer, pre-tokenizer)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def num_ids(tokenizer: Tokenizer) -> int:
    """How many ids the tokenizer's tokens span: its largest id + 1, which is more than its count of tokens where the ids
    have gaps (a pruned vocabulary, added tokens at high ids); the embedding needs a row, and a shard room, for each."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(tokenizer.get_vocab_size(with_added_tokens=True), largest + 1)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# a document longer than this is encoded piece by piece (where the tokenizer allows, cuts_at_newlines): an Encoding
# holds ~150 bytes a token, so one 1 GB text file encoded whole would need ~160 GB
PIECE_CHARS = 1 << 18
# a newline between two non-space characters (Python's whitespace includes all of Unicode's, so none of the split
# regexes' \s comes next to it): every GPT-2-style split ends a piece there, also at a text's end
NEWLINE_BETWEEN_TEXT = re.compile(r"(?<=\S)\n(?=\S)")


def cuts_at_newlines(tokenizer: Tokenizer) -> bool:
    """Whether a text cut just after a newline between two non-space characters encodes, piece by piece, into the ids of
    the whole: true where the first pre-tokenizer is a GPT-2-style regex split (ByteLevel with its regex, as ours
    and GPT-2's, or an isolating Split holding \\s+(?!\\S), as Llama 3's and Qwen's), which always ends a piece at such a
    newline, and no normalizer or prefix space can add text at a piece's start (SentencePiece-style tokenizers can).
    Anything else (no pre-tokenizer, another split) may join text across any newline: such tokenizers get no cuts."""
    spec = json.loads(tokenizer.to_str())
    for token in spec.get("added_tokens") or []:
        # added tokens are matched before the pre-split: a cut could fall inside one, or before one that takes in the
        # whitespace on its left (lstrip; special ones are not matched inside documents, for_documents)
        if "\n" in token.get("content", "") or (token.get("lstrip") and not token.get("special")):
            return False
    normalizer = spec.get("normalizer") or {"type": "NFC"}
    if normalizer.get("type") not in ("NFC", "NFKC", "NFD", "NFKD"):
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = (pre.get("pretokenizers") or [{}]) if pre.get("type") == "Sequence" else [pre]
    if any(step.get("type") == "Metaspace" and step.get("prepend_scheme") == "first" for step in steps):
        return False  # it prepends "▁" to the first piece of a text only: to each part's, once cut
    first = steps[0]
    if first.get("type") == "ByteLevel":
        return first.get("use_regex", True) and not first.get("add_prefix_space", False)
    return (first.get("type") == "Split" and first.get("behavior") == "Isolated" and not first.get("invert")
            and "\\s+(?!\\S)" in str((first.get("pattern") or {}).get("Regex", "")))


def _pieces(text: str) -> list[str]:
    """text cut just after a newline between two non-space characters, about every PIECE_CHARS characters
    (a newline before more whitespace would end its piece differently at the piece's end: "\\n\\n" is one piece there)."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = NEWLINE_BETWEEN_TEXT.search(text, start + PIECE_CHARS)
        if cut is None:
            break
        pieces.append(text[start:cut.end()])
        start = cut.end()
    return pieces + [text[start:]]


def _ids(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    # no special tokens: a loaded tokenizer's post-processor may add BOS; documents are separated by EOS only
    return [np.asarray(e.ids, dtype=dtype) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def for_documents(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer, or a copy, as documents are encoded: whole, never cut to max_length or padded (a loaded
    tokenizer.json may carry truncation or padding; HF files often do), and a special token's text inside a document
    (a web page quoting "<|endoftext|>") encoded as the text it is, not as that token: else it would end the document
    early as EOS, silently. The tokenizer itself (its fingerprint) is left as it is."""
    if tokenizer.truncation is None and tokenizer.padding is None and tokenizer.encode_special_tokens:
        return tokenizer
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    return copy


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: np.dtype,
                     ends: Optional[list[bool]] = None, cuts: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the texts, each followed by EOS where it ends a document (`ends`, by default every text: a text file
    read in parts has none between them), concatenated; and each text's count of ids, its EOS included.
    A text longer than PIECE_CHARS is encoded piece by piece where that gives the same ids (`cuts`: cuts_at_newlines);
    callers encoding many chunks pass for_documents(tokenizer) and cuts_at_newlines(tokenizer) once (a copy and a parse
    of the tokenizer's JSON per call otherwise: 11 ms for the builtin 8192-token BPE's 217 KB, growing with its size)."""
    tokenizer = for_documents(tokenizer)
    ends = [True] * len(texts) if ends is None else ends
    long = [i for i, text in enumerate(texts) if len(text) > PIECE_CHARS]
    if long and not (cuts_at_newlines(tokenizer) if cuts is None else cuts):
        long = []
    short = sorted(set(range(len(texts))) - set(long))
    ids: list = [None] * len(texts)
    for i, doc_ids in zip(short, _ids(tokenizer, [texts[i] for i in short], dtype)):
        ids[i] = doc_ids
    for i in long:
        pieces = _pieces(texts[i])
        ids[i] = np.concatenate([a for group in range(0, len(pieces), 8) for a in _ids(tokenizer, pieces[group:group + 8], dtype)])
    lengths = np.array([len(a) + end for a, end in zip(ids, ends)], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    starts = np.cumsum(lengths) - lengths
    for doc_ids, start, end in zip(ids, starts, ends):
        tokens[start : start + len(doc_ids)] = doc_ids
        if end:
            tokens[start + len(doc_ids)] = eos_id
    return tokens, lengths
