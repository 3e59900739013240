"""Attention on FlashAttention 4 (flash_attn.cute): causal GQA forward and backward on head views of
the fused qkv rows. No copies: q/k/v are (B, T, heads, hd) strided views of qkv, o is written in
place as (M, H*hd), and the backward writes dq/dk/dv into the column slices of one (M, qkv_dim)
gradient. FA4's lse is already (B, H, T) fp32 natural-log, the op's layout."""

from __future__ import annotations

import torch
from torch import Tensor

from ..cute_limits import need, need_attention_heads
from ._launch import empty, need_bf16


def _heads(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int, op: str):
    M, W = qkv.shape
    need(W % (n_heads + 2 * n_kv_heads) == 0,
         f"{op}: qkv width {W} must be (n_heads + 2*n_kv_heads) * head_dim")
    hd = W // (n_heads + 2 * n_kv_heads)
    need_attention_heads(op, hd, n_heads, n_kv_heads)
    need(M % seq_len == 0, f"{op}: rows M={M} must be a multiple of seq_len={seq_len}")
    B = M // seq_len
    v4 = qkv.view(B, seq_len, n_heads + 2 * n_kv_heads, hd)
    H, G = n_heads, n_kv_heads
    return B, hd, v4[:, :, :H], v4[:, :, H:H + G], v4[:, :, H + G:]


def attention_fwd(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    need_bf16("attention", qkv=qkv)
    qkv = qkv.contiguous()
    B, hd, q, k, v = _heads(qkv, n_heads, n_kv_heads, seq_len, "attention")
    o = empty(qkv.shape[0], n_heads * hd, dtype=qkv.dtype, device=qkv.device)
    lse = empty(B, n_heads, seq_len, dtype=torch.float32, device=qkv.device)
    out, lse_out, *_ = _flash_attn_fwd(q, k, v, softmax_scale=hd ** -0.5, causal=True, return_lse=True,
                                       out=o.view(B, seq_len, n_heads, hd), lse=lse)
    if out.data_ptr() != o.data_ptr():  # FA4 chose its own buffer (should not happen)
        o.view(B, seq_len, n_heads, hd).copy_(out)
    return o, lse_out


def attention_bwd(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                  seq_len: int) -> Tensor:
    from flash_attn.cute.interface import _flash_attn_bwd

    need_bf16("attention_backward", g_o=g_o, qkv=qkv, o=o)
    qkv, o, g_o = qkv.contiguous(), o.contiguous(), g_o.contiguous()
    B, hd, q, k, v = _heads(qkv, n_heads, n_kv_heads, seq_len, "attention_backward")
    need(tuple(lse.shape) == (B, n_heads, seq_len) and lse.dtype == torch.float32,
         f"attention_backward: lse must be ({B}, {n_heads}, {seq_len}) float32")
    g = empty(*qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _, _, dq, dk, dv = _heads(g, n_heads, n_kv_heads, seq_len, "attention_backward")
    shape = (B, seq_len, n_heads, hd)
    res = _flash_attn_bwd(q, k, v, o.view(shape), g_o.view(shape), lse.contiguous(), hd ** -0.5, True,
                          dq=dq, dk=dk, dv=dv)
    for want, got in zip((dq, dk, dv), res[:3]):
        if got.data_ptr() != want.data_ptr():
            want.copy_(got)
    return g
