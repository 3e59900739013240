"""Tokenizers: train a byte-level BPE on the corpus, or load an existing tokenizer.json / HF tokenizer directory."""

from __future__ import annotations

import hashlib
import json
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


def load_tokenizer(path: str) -> tuple[Tokenizer, Optional[str]]:
    """A tokenizer.json file or an HF tokenizer directory; also returns the EOS named in its tokenizer_config.json, if any."""
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        hint = " (only tokenizers with a tokenizer.json are supported; save one with save_pretrained)" if p.is_dir() else ""
        raise DataError(f"tokenizer file {file} does not exist{hint}; fix data.tokenizer or leave it unset to train a BPE")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises a bare Exception for malformed JSON
        raise DataError(f"could not read tokenizer {file}: {e}; point data.tokenizer at a valid tokenizer.json") from e
    config_eos = None
    config_file = file.parent / "tokenizer_config.json"
    if config_file.is_file():
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
    raise DataError(f"the tokenizer has none of the EOS tokens {candidates}; set data.eos_token to its end-of-document token")


def fingerprint(tokenizer: Tokenizer) -> str:
    """Hash of the full serialized tokenizer (vocab, merges, normalizer, pre-tokenizer)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the documents, each followed by EOS, concatenated; and each document's length including its EOS."""
    # no special tokens: a loaded tokenizer's post-processor may add BOS; documents are separated by EOS only
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encodings], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for encoding, end, length in zip(encodings, ends, lengths):
        tokens[end - length : end - 1] = encoding.ids
    tokens[ends - 1] = eos_id
    return tokens, lengths
