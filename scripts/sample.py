"""Generate text from a coda-train checkpoint, streaming tokens to the terminal as they are chosen.

    python scripts/sample.py RUN_DIR_OR_CHECKPOINT --prompt "def main(" [--max-new-tokens 200]
                             [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0]
                             [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16] [--tokenizer PATH]

--temperature 0 is greedy decoding. Generation stops at the tokenizer's EOS (end of document) or after
--max-new-tokens. The prompt is tokenized as preparation does (no special tokens); an empty prompt
starts a fresh document after EOS. Uses the eager model with a KV cache.
"""

from __future__ import annotations

import sys

import torch
from tokenizers.decoders import DecodeStream

from coda_train.data import DataError
from coda_train.data.tokenizer import for_documents, num_ids
from coda_train.errors import ConfigError
from coda_train.inference import checkpoint_parser, load_eager_model, log_progress_to_stderr, open_checkpoint
from coda_train.model import LlamaConfig
from coda_train.model.generate import check_sampling, generate
from coda_train.trainer.checkpoint import CheckpointError
from coda_train.trainer.device import pick_compute_dtype, pick_device


def check_room(args, model: LlamaConfig) -> None:
    """--max-new-tokens within the model's context, with room for a prompt of one token at least."""
    if args.max_new_tokens >= model.max_seq_len:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} leaves no room for a prompt in the model's "
                          f"max_seq_len={model.max_seq_len}; pass --max-new-tokens <= {model.max_seq_len - 1}")


def main(argv: list[str] | None = None) -> int:
    parser = checkpoint_parser(__doc__, compute=True)
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="sample among the most likely tokens holding this probability mass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    log_progress_to_stderr()  # the text alone goes to stdout
    try:
        # before the checkpoint, whose opening may prepare data, and before anything is printed
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        device = pick_device(args.device, "--device ")
        dtype = pick_compute_dtype(args.dtype, device)
        ckpt = open_checkpoint(args.checkpoint, args.tokenizer, check=lambda model, run: check_room(args, model))
        model = load_eager_model(ckpt, device, dtype)
        # as preparation encodes documents: a tokenizer.json's padding would append pad ids, its truncation cut the prompt
        prompt = for_documents(ckpt.tokenizer).encode(args.prompt, add_special_tokens=False).ids if args.prompt else [ckpt.eos_id]
        tokens = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, generator=torch.Generator(device=device).manual_seed(args.seed),
                          vocab_limit=num_ids(ckpt.tokenizer), stop_token=ckpt.eos_id)
        stream = DecodeStream(skip_special_tokens=True)
        for token in prompt:  # the decoder's context, so the first new token is spaced/merged as in the full text
            stream.step(ckpt.tokenizer, token)
        sys.stdout.write(args.prompt)
        for token in tokens:
            piece = stream.step(ckpt.tokenizer, token)
            if piece:  # None while a multi-byte character is incomplete
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\n")
    except (ConfigError, DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
