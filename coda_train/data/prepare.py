"""Command line: python -m coda_train.data.prepare [--source PATH|NAME] [--vocab-size N] ... prints what was prepared.

Exit codes: 0 prepared (or reused), 2 bad input or damaged data, 128 + signal number when stopped by SIGINT (130) or
SIGTERM (143), after removing this run's unfinished folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import time
from typing import Optional

from coda_train.data import DataConfig, DataError, PreparationInterrupted, PreparedData, prepare


def parse_args(argv: Optional[list[str]] = None) -> tuple[DataConfig, bool]:
    parser = argparse.ArgumentParser(prog="python -m coda_train.data.prepare", description=__doc__)
    for field in dataclasses.fields(DataConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=_parser_type(field.type), default=field.default, metavar=field.name.upper())
    parser.add_argument("--verify", action="store_true", help="also check every shard's sha256 (reads all shards)")
    args = vars(parser.parse_args(argv))
    verify = args.pop("verify")
    return DataConfig(**args), verify


def _parser_type(annotation):
    if annotation in (str, int, float):
        return annotation
    base = next(a for a in annotation.__args__ if a is not type(None))  # Optional[X]: "none" means None
    return lambda text: None if text.lower() == "none" else base(text)


_HYDRA_KEY = re.compile(r"(?<![\w./-])data\.(\w+)(?:=(true|false)\b|(=))?")
_HYDRA_BUILTIN = re.compile(r"(?<![\w./-])data=builtin\b")  # train.py's choice of configs/data/builtin.yaml
_FIELDS = {field.name: field for field in dataclasses.fields(DataConfig)}
_UNSET_NULL = re.compile(r"(--[\w-]+) unset \(null\)")  # train.py's "data.<key> unset (null)", once a flag


def cli_message(text: str) -> str:
    """A DataError's message, written for train.py's data.<key>=<value> overrides and its data=builtin, in this
    command's --<key> flags."""
    def flag(m: re.Match) -> str:
        field = _FIELDS.get(m[1])
        if field is None:  # no flag of that name here: leave it as written
            return m[0]
        name = "--" + field.name.replace("_", "-")
        if m[2] and field.type is bool:  # a BooleanOptionalAction: --streaming / --no-streaming
            return name if m[2] == "true" else "--no-" + name[2:]
        return name + (" " + m[2] if m[2] else " " if m[3] else "")
    text = _HYDRA_BUILTIN.sub("--source builtin", _HYDRA_KEY.sub(flag, text))
    return _UNSET_NULL.sub(r"\1 unset (\1 none)", text)  # YAML's null is spelled none here (_parser_type)


class _CliFlags(logging.Filter):
    """What preparation logs (a row without the text field, a shard check), in this command's flags as cli_message
    writes its errors: the warnings named train.py's data.<key> overrides."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = cli_message(record.getMessage()), None
        return True


def summary(data: PreparedData) -> str:
    m = data.manifest
    tok = m["tokenizer"]
    origin = "trained byte-level BPE" if tok["trained"] else tok["origin"]
    lines = [
        f"prepared  {data.path}",
        f"source    {m['source']}",
        f"tokenizer {origin}: vocab {tok['vocab_size']}, eos {tok['eos_token']!r}={tok['eos_id']}, "
        f"fingerprint {tok['fingerprint'][:16]}",
        f"dtype     {m['dtype']}, {m['num_characters']:,} characters -> {m['num_tokens']:,} tokens "
        f"(prepared in {m['seconds']['total']:.1f} s)",
        f"{'split':<6} {'documents':>10} {'tokens':>14} {'shards':>7}",
    ]
    for split, info in m["splits"].items():
        lines.append(f"{split:<6} {info['num_documents']:>10,} {info['num_tokens']:>14,} {len(info['shards']):>7}")
    counts = m.get("document_counts", {})  # absent in folders prepared before it was recorded
    if any(counts.get(k) for k in ("missing_field", "skipped", "replaced")):
        lines.append(f"reading   {counts['missing_field']:,} rows without the text field and {counts['skipped']:,} "
                     f"undecodable ones skipped, {counts['replaced']:,} with invalid text repaired; first: "
                     + ", ".join(f"{kind.replace('_', ' ')} at {where}" for kind, where in counts["first"].items()))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_CliFlags())
    cfg, verify = parse_args(argv)
    start = time.perf_counter()
    try:
        data = prepare(cfg)
        if verify:
            data.verify_checksums()
    except PreparationInterrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except DataError as e:
        print(f"error: {cli_message(str(e))}", file=sys.stderr)
        return 2
    print(summary(data))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
