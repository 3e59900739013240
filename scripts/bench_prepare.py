"""Preparation throughput on the embedded default corpus (Python stdlib sources), from scratch in a temp dir.

    python scripts/bench_prepare.py [--num-proc 1,2] [--vocab-size 8192] [--out runs/bench_prepare.json]
    python scripts/bench_prepare.py --whitespace-free-mb 4      # hostile input: documents without any whitespace

Per process count, two rows: the full default preparation (train the BPE, then tokenize and write shards), and
tokenization alone with that tokenizer given as a file. Prints a table and writes JSON; its rate of text is
Mchar/s, millions of characters a second (a character of UTF-8 text is 1 to 4 bytes). With --whitespace-free-mb,
instead: the full preparation of one repeated "abab..." document and one random base64-like document of that size
each (BPE training cost grows with the square of the longest piece unless pieces are capped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from coda_train.data import DataConfig, prepare


def run(cfg: DataConfig) -> dict:
    start = time.perf_counter()
    data = prepare(cfg)
    seconds = time.perf_counter() - start
    m = data.manifest
    return {
        "seconds": round(seconds, 3),
        "tokenizer_seconds": m["seconds"]["tokenizer"],
        "documents": m["num_documents"],
        "characters": m["num_characters"],
        "tokens": m["num_tokens"],
        "tokens_per_s": round(m["num_tokens"] / seconds),
        "docs_per_s": round(m["num_documents"] / seconds, 1),
        "mchars_per_s": round(m["num_characters"] / seconds / 1e6, 3),  # millions of characters (not bytes) a second
        "tokenizer_file": str(data.path / "tokenizer.json"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-proc", default="1,2", help="comma-separated process counts")
    p.add_argument("--vocab-size", type=int, default=DataConfig.vocab_size)
    p.add_argument("--out", type=Path, default=Path("runs/bench_prepare.json"))
    p.add_argument("--whitespace-free-mb", type=float, default=None, help="benchmark whitespace-free documents instead")
    args = p.parse_args()
    if args.whitespace_free_mb is not None:
        return whitespace_free(args)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_proc in [int(n) for n in args.num_proc.split(",")]:
            # a fresh cache dir per run, so nothing is reused
            full = run(DataConfig(cache_dir=f"{tmp}/full{num_proc}", vocab_size=args.vocab_size, num_proc=num_proc))
            rows.append({"stage": "train BPE + tokenize", "num_proc": num_proc, **full})
            given = DataConfig(cache_dir=f"{tmp}/given{num_proc}", tokenizer=full["tokenizer_file"], num_proc=num_proc)
            rows.append({"stage": "tokenize only", "num_proc": num_proc, **run(given)})

    first = rows[0]
    print(
        f"default corpus: {first['documents']} documents, {first['characters'] / 1e6:.1f} M characters, "
        f"{first['tokens'] / 1e6:.2f} M tokens (vocab {args.vocab_size})"
    )
    print(f"{'stage':<22} {'procs':>5} {'seconds':>8} {'BPE s':>6} {'tokens/s':>10} {'docs/s':>7} {'Mchar/s':>7}")
    for r in rows:
        print(
            f"{r['stage']:<22} {r['num_proc']:>5} {r['seconds']:>8.2f} {r['tokenizer_seconds']:>6.2f} "
            f"{r['tokens_per_s']:>10,} {r['docs_per_s']:>7.1f} {r['mchars_per_s']:>7.2f}"
        )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = [{k: v for k, v in r.items() if k != "tokenizer_file"} for r in rows]
    args.out.write_text(json.dumps({"machine": machine, "vocab_size": args.vocab_size, "rows": results}, indent=2))
    print(f"wrote {args.out}")


def whitespace_free(args: argparse.Namespace) -> None:
    size = int(args.whitespace_free_mb * 1e6)
    documents = {"repeated": ("ab" * size)[:size], "random": "".join(random.Random(0).choices("abcdefghij0123456789+/", k=size))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in documents.items():
            Path(tmp, f"{name}.txt").write_text(text)
            cfg = DataConfig(source=f"{tmp}/{name}.txt", cache_dir=f"{tmp}/cache", vocab_size=args.vocab_size, val_fraction=0.0)
            rows.append({"document": name, "megabytes": size / 1e6, **run(cfg)})
            print(f"{name:<9} {size / 1e6:.2f} MB  {rows[-1]['seconds']:.2f} s (BPE {rows[-1]['tokenizer_seconds']:.2f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    results = [{k: v for k, v in r.items() if k != "tokenizer_file"} for r in rows]
    args.out.write_text(json.dumps({"machine": machine, "vocab_size": args.vocab_size, "rows": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
