"""A torch.compile peer with CODA's attention: the eager Llama with FlashAttention 4 in place of SDPA.

The eager model's SDPA picks one of torch's own attention kernels (FlashAttention 2, memory-efficient or
cuDNN; which one runs GQA on the H200 is not yet profiled), while CODA and the floor run FlashAttention 4.
So a peer at its best has FA4 too: `scripts/bench.py --variants compile-fa4,compile-graphs-fa4` time the eager model with it under
torch.compile. FA4 enters as two torch custom ops (forward; backward) with fake implementations, so
torch.compile traces it as one opaque node per layer (no graph break) and CUDA graphs capture it.
On CPU the ops compute the same attention in plain torch (the smoke run and the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from coda_train.model.eager import EagerLlama


def _reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal GQA attention of (B, T, heads, hd) tensors in plain torch: o (B, T, H, hd), lse (B, H, T) fp32."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    scores = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    T = q.shape[1]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    o = (scores - lse[..., None]).exp() @ vh
    return o.transpose(1, 2).contiguous(), lse.to(torch.float32)


def _reference_backward(g_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """_reference's dq, dk, dv as FlashAttention's backward computes them: P = softmax(S) (recomputed in q's dtype,
    not from the fp32 lse), dS = P (dP - rowsum(dO o)), the kv heads' gradients summed over the query heads that
    share them."""
    B, T, H, hd = q.shape
    group, scale = H // k.shape[2], hd ** -0.5
    qh, kh, vh, oh, gh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), o, g_o))
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    p = ((qh @ kh.transpose(-1, -2)) * scale).masked_fill(causal, float("-inf")).softmax(-1)
    ds = p * (gh @ vh.transpose(-1, -2) - (gh * oh).sum(-1, keepdim=True))
    dq = (ds @ kh) * scale
    dk = ((ds.transpose(-1, -2) @ qh) * scale).unflatten(1, (-1, group)).sum(2)
    dv = (p.transpose(-1, -2) @ gh).unflatten(1, (-1, group)).sum(2)
    return (dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous())


@torch.library.custom_op("coda_peer::fa4_causal", mutates_args=())
def fa4_causal(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal GQA attention of (B, T, heads, hd) q, k, v: o (B, T, H, hd) and lse (B, H, T) fp32."""
    if not q.is_cuda:
        return _reference(q, k, v)
    from flash_attn.cute.interface import _flash_attn_fwd

    o, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, return_lse=True)
    return o, lse


@fa4_causal.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, T, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("coda_peer::fa4_causal_backward", mutates_args=())
def fa4_causal_backward(g_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of fa4_causal for the output gradient g_o (B, T, H, hd)."""
    if not q.is_cuda:
        return _reference_backward(g_o, q, k, v, o, lse)
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, o, g_o.contiguous(), lse, q.shape[-1] ** -0.5, True)[:3]
    return dq, dk, dv


@fa4_causal_backward.register_fake
def _(g_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, g_o: Tensor, _g_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, o, lse = ctx.saved_tensors
    return fa4_causal_backward(g_o, q, k, v, o, lse)


fa4_causal.register_autograd(_backward, setup_context=_setup_context)


class EagerFA4Llama(EagerLlama):
    """The eager Llama (same parameters, same function) with FlashAttention 4 for its causal training attention;
    anything else (a KV cache's masked attention) stays on SDPA."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
        if mask is not None or not causal:
            return super().attend(q, k, v, mask, causal)
        o, _ = fa4_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2)
