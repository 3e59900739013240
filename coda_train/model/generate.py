"""Autoregressive sampling from the eager model with a KV cache: prefill the prompt in one forward,
then one token per forward, each seeing the cached keys and values of all earlier positions."""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch import Tensor

from .eager import EagerLlama, KVCache


def next_token_distribution(logits: Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> Tensor:
    """Probabilities (fp32) of a 1-D logits vector after temperature, then top-k, then top-p (nucleus)
    filtering; temperature must be > 0 (0 is greedy and handled by the caller)."""
    logits = logits.float()
    # the largest logit becomes 0 before dividing: a tiny temperature sends the others to -inf, never any to +inf
    logits = (logits - logits.max()) / temperature
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
        dropped = sorted_probs.cumsum(0) - sorted_probs >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(dropped, 0.0))
        probs = probs / probs.sum()
    return probs


def check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """ValueError naming the range of each sampling setting out of it; needs no model, so callers check before loading one."""
    # `not` of the comparisons: NaN fails every comparison, so it is refused too
    if not (math.isfinite(temperature) and temperature >= 0) or (top_k is not None and top_k < 1) \
            or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0 (0: greedy), top_k >= 1 and 0 < top_p <= 1; got "
                         f"temperature={temperature}, top_k={top_k}, top_p={top_p}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")


def generate(model: EagerLlama, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
             vocab_limit: Optional[int] = None, stop_token: Optional[int] = None) -> Iterator[int]:
    """Yield up to max_new_tokens token ids continuing `prompt`, one at a time as each is chosen.
    temperature=0 picks the most likely token (greedy); otherwise draws with `generator`. Ids at or
    past vocab_limit (embedding rows beyond the tokenizer) are never chosen; stop_token ends the
    sequence after it is yielded. The arguments are checked here, when called (ValueError), not at the
    first token: a caller can refuse them before printing anything."""
    if not isinstance(model, EagerLlama):  # the KV cache is the eager model's; the weights are the same
        raise TypeError(f"generate samples from an EagerLlama (it keeps the KV cache), not a {type(model).__name__}: "
                        "load the same weights into one, EagerLlama(model.cfg).load_state_dict(model.state_dict())")
    if not prompt:
        raise ValueError("the prompt is empty; start it with at least one token (e.g. the EOS that separates documents)")
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if len(prompt) + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len={model.cfg.max_seq_len}; shorten one of them")
    return _tokens(model, prompt, max_new_tokens, temperature, top_k, top_p, generator, vocab_limit, stop_token)


@torch.no_grad()
def _tokens(model: EagerLlama, prompt: list[int], max_new_tokens: int, temperature: float, top_k: Optional[int],
            top_p: Optional[float], generator: Optional[torch.Generator], vocab_limit: Optional[int],
            stop_token: Optional[int]) -> Iterator[int]:
    device = model.tok_emb.device
    cache = KVCache(model.cfg, 1, len(prompt) + max_new_tokens, device, model.compute_dtype)
    tokens = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        logits = model.logits(tokens, cache)[0, -1]
        if vocab_limit is not None:
            logits[vocab_limit:] = float("-inf")
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = next_token_distribution(logits, temperature, top_k, top_p)
            token = int(torch.multinomial(probs, 1, generator=generator))
        yield token
        if token == stop_token:
            return
        tokens = torch.tensor([[token]], device=device)
