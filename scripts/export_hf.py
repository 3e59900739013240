"""Export a coda-train checkpoint as a Hugging Face Llama directory.

    python scripts/export_hf.py RUN_DIR_OR_CHECKPOINT --out DIR [--dtype float32|bfloat16]
                                [--max-shard-size 5GB] [--tokenizer PATH]

RUN_DIR_OR_CHECKPOINT is a run dir (its newest good checkpoint is taken) or a checkpoints/step_* dir.
DIR receives config.json, model.safetensors (sharded above --max-shard-size), the tokenizer files and
generation_config.json; `transformers.LlamaForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it. Needs the `hf` extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import os
import sys

import torch

from coda_train.data import DataError
from coda_train.errors import ConfigError
from coda_train.inference import checkpoint_parser, log_progress_to_stderr, open_checkpoint
from coda_train.model.hf import check_export, export_hf
from coda_train.trainer.checkpoint import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = checkpoint_parser(__doc__, compute=False)
    parser.add_argument("--out", required=True, type=os.path.expanduser, help="output directory (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype written")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    args = parser.parse_args(argv)
    log_progress_to_stderr()
    try:
        check_export(args.out, args.max_shard_size)  # before the checkpoint: opening it may prepare data
        ckpt = open_checkpoint(args.checkpoint, args.tokenizer)
        out = export_hf(ckpt.weights, ckpt.model_config, args.out, tokenizer_file=ckpt.tokenizer_file,
                        eos_token=ckpt.eos_token, dtype=getattr(torch, args.dtype), max_shard_size=args.max_shard_size)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # export_hf removed what it had written
        print(f"error: could not write the export to {args.out}: {e.strerror or e}; nothing was left there: free space "
              "or choose another --out", file=sys.stderr)
        return 1
    print(f"exported {ckpt.path} (step {ckpt.meta['step']}) to {out}:")
    for file in sorted(out.iterdir()):
        print(f"  {file.name:<32} {file.stat().st_size:>12,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
