"""Validation loss and perplexity of a coda-train checkpoint.

    python scripts/eval.py RUN_DIR_OR_CHECKPOINT [--split val|train] [--text FILE ...]
                           [--batch-size N] [--seq-len N] [--max-batches N]
                           [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16] [--tokenizer PATH]

By default it evaluates the run's own prepared data (`--split`, the val split unless told otherwise),
in windows of the run's trainer.seq_len: every window of the split, so the loss does not depend on --batch-size
(--max-batches N reads the first N batches of --batch-size windows). With --text, each file is one document
(.gz, .bz2 and .xz decompressed), tokenized with the checkpoint's tokenizer and followed by EOS, as preparation
does. The eager model computes the loss, whatever impl trained the checkpoint (one parameter layout).
"""

from __future__ import annotations

import lzma
import math
import os
import sys

from coda_train.data import DataError, PreparedData, TokenLoader
from coda_train.data.sources import (BINARY_FORMATS, FORMAT_BY_SUFFIX, UTF8_BOM, check_utf8, format_suffix,
                                     open_binary, universal_newlines)
from coda_train.data.tokenizer import fingerprint
from coda_train.errors import ConfigError
from coda_train.inference import (checkpoint_parser, load_eager_model, log_progress_to_stderr, mean_loss, open_checkpoint,
                                  run_prepared_data, text_windows)
from coda_train.model import LlamaConfig
from coda_train.trainer.checkpoint import CheckpointError
from coda_train.trainer.device import pick_compute_dtype, pick_device


def check_counts(args) -> None:
    """The counts given, refused below 1 before the checkpoint is opened (which may prepare data)."""
    counts = (args.batch_size, args.seq_len, args.max_batches)
    if any(n is not None and n < 1 for n in counts):
        raise ConfigError("need --batch-size >= 1, --seq-len >= 1 and --max-batches >= 1 (or leave them out); "
                          "got {}, {}, {}".format(*counts))


def read_texts(files: list[str]) -> list[str]:
    """Each file as one document, read as data.source reads a text file: .gz, .bz2 and .xz decompressed (their bytes
    are no text), newlines universal, a UTF-8 byte-order mark dropped."""
    texts = []
    for file in files:
        # their bytes are no text: scored as text, they would give a loss with no meaning
        if (binary := BINARY_FORMATS.get(FORMAT_BY_SUFFIX.get(format_suffix(file)))) is not None:
            raise ConfigError(f"--text {file} is {binary}, a binary format: --text reads each file as one text document; "
                              "pass its documents as text files (one document each)")
        try:
            with open_binary(file) as f:
                data = f.read()
        except (OSError, EOFError, lzma.LZMAError) as e:  # unreadable, or a damaged archive
            raise ConfigError(f"cannot read --text {file}: {getattr(e, 'strerror', None) or e}; pass readable text "
                              "files") from e
        check_utf8(data, file)
        texts.append(universal_newlines(data.removeprefix(UTF8_BOM).decode("utf-8", errors="replace")))
    return texts


def checkpoint_check(args):
    """open_checkpoint's check: the arguments that depend on the run, refused before its data is prepared."""
    def check(model: LlamaConfig, run: dict) -> None:
        if args.seq_len is not None and args.seq_len > model.max_seq_len:
            raise ConfigError(f"--seq-len={args.seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
                              f"pass --seq-len <= {model.max_seq_len}")
        if not args.text and args.split == "val" and run.get("data", {}).get("val_fraction") == 0:
            raise ConfigError("the run held out no val split (data.val_fraction=0): evaluate --split train, "
                              "or text files with --text FILE ...")
    return check


def eval_batches(data: PreparedData, split: str, batch_size: int, seq_len: int, max_batches: int | None):
    try:
        loader = TokenLoader(data, split, batch_size, seq_len, seed=0)
    except DataError as e:  # a split shorter than one batch; the loader's message names training's settings
        other_split = "--split train, " if split == "val" else ""
        raise DataError(f"the {split} split of {data.path} holds {data.num_tokens(split):,} tokens, fewer than one batch "
                        f"of {batch_size} windows of {seq_len}+1; pass a smaller --batch-size or --seq-len, {other_split}"
                        "or --text FILE ...") from e
    # the whole split: every window, whatever the batch size (the run's per-process batch differs between layouts)
    return loader.iter_eval(every_window=True) if max_batches is None else loader.iter_eval(max_batches)


def main(argv: list[str] | None = None) -> int:
    parser = checkpoint_parser(__doc__, compute=True)
    parser.add_argument("--split", choices=("val", "train"), help="split of the run's prepared data (default: val)")
    parser.add_argument("--text", nargs="+", type=os.path.expanduser, metavar="FILE", help="evaluate these text files instead")
    parser.add_argument("--batch-size", type=int, help="sequences per forward (default: the run's trainer.batch_size)")
    parser.add_argument("--seq-len", type=int, help="tokens per window (default: the run's trainer.seq_len)")
    parser.add_argument("--max-batches", type=int, help="evaluate at most this many batches (default: all)")
    args = parser.parse_args(argv)
    if args.text and args.split:  # --text evaluates those files, not the run's data: a --split there would go unused
        parser.error(f"--split {args.split} selects the run's prepared data, --text evaluates files instead; pass one of them")
    args.split = args.split or "val"
    log_progress_to_stderr()
    try:
        check_counts(args)
        device = pick_device(args.device, "--device ")
        dtype = pick_compute_dtype(args.dtype, device)
        texts = read_texts(args.text) if args.text else None
        ckpt = open_checkpoint(args.checkpoint, args.tokenizer, checkpoint_check(args))
        trainer = ckpt.meta["config"]["trainer"]
        batch_size = trainer["batch_size"] if args.batch_size is None else args.batch_size
        seq_len = trainer["seq_len"] if args.seq_len is None else args.seq_len
        if texts is not None:
            batches, what = text_windows(ckpt, texts, seq_len, batch_size), f"{len(texts)} text file(s)"
        else:
            data = ckpt.data or run_prepared_data(ckpt.meta)
            if data.manifest["tokenizer"]["fingerprint"] != fingerprint(ckpt.tokenizer):  # its corpus changed since the run
                raise DataError(f"the run's data, prepared again at {data.path}, is tokenized with another tokenizer than "
                                f"{ckpt.tokenizer_file} (its source files changed since the run prepared them, and a new "
                                "BPE was trained); restore the run's corpus, or evaluate files with --text")
            batches = eval_batches(data, args.split, batch_size, seq_len, args.max_batches)
            what = f"the {args.split} split of {data.path}"
        if texts is not None and args.max_batches is not None:
            batches = (b for b, _ in zip(batches, range(args.max_batches)))
        model = load_eager_model(ckpt, device, dtype)
        loss, tokens = mean_loss(model, batches, device)
    except (ConfigError, DataError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"checkpoint {ckpt.path} (step {ckpt.meta['step']}) on {what}")
    print(f"{tokens:,} tokens in windows of {seq_len} | {device.type} {str(dtype).removeprefix('torch.')}")
    print(f"loss {loss:.4f} | perplexity {math.exp(loss):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
