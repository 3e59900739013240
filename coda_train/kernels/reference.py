"""Reference implementations of the CODA op set: plain torch, any device, any float dtype.

This is the numerical oracle. Each function computes exactly what its GEMM + epilogue program
computes: the GEMM in the input dtype, the epilogue in fp32 (fp64 stays fp64), outputs in the
input dtype, row statistics in fp32. Equation tags (F1..F6, B1..B6, E, H) refer to
docs/design.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _f(t: Tensor) -> Tensor:
    """Epilogue precision: fp32 accumulators, fp64 stays fp64 (the CPU oracle)."""
    return t if t.dtype == torch.float64 else t.float()


def _rotate_pairs(y: Tensor, cos: Tensor, sin: Tensor, n_rope_cols: int, inverse: bool) -> Tensor:
    """RoPE on interleaved column pairs (2i, 2i+1) of every head in y[:, :n_rope_cols].
    Rows are (batch, position) row-major, so row m has position m % T with T = cos.shape[0]."""
    M = y.shape[0]
    T, half = cos.shape
    pairs = y[:, :n_rope_cols].reshape(M // T, T, -1, half, 2)
    c, s = cos.to(y.dtype)[None, :, None, :], sin.to(y.dtype)[None, :, None, :]
    if inverse:
        s = -s
    y0, y1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((y0 * c - y1 * s, y0 * s + y1 * c), dim=-1).reshape(M, n_rope_cols)
    return torch.cat((rotated, y[:, n_rope_cols:]), dim=1)


# ---- forward ------------------------------------------------------------------------------

def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(E) x = emb[tokens]; h = x*gamma; partial row sums of x^2."""
    x = emb[tokens.reshape(-1)]
    xf = _f(x)
    return x, (xf * _f(gamma)).to(x.dtype), (xf * xf).sum(-1, keepdim=True)


def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """(F4) r = 1/sqrt(mean(x^2) + eps) from per-tile partial sums of x^2."""
    return torch.rsqrt(_f(sumsq_partials).sum(-1) / dim + eps)


def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, cos: Tensor, sin: Tensor, n_rope_cols: int) -> Tensor:
    """(F1) qkv = RoPE(r * (h @ w^T)) on the first n_rope_cols columns (q and k)."""
    y = _f(h @ w.t()) * r[:, None]
    return _rotate_pairs(y, _f(cos), _f(sin), n_rope_cols, inverse=False).to(h.dtype)


def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(F3, F6) x = residual + a @ w^T; h = x*gamma; partial row sums of x^2.
    h and the sums use x as stored, so they are the same function of x that backward sees."""
    x = (_f(residual) + _f(a @ w.t())).to(a.dtype)
    xf = _f(x)
    return x, (xf * _f(gamma)).to(a.dtype), (xf * xf).sum(-1, keepdim=True)


def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """(F5) gu = r * (h @ w_gate_up^T) with columns [gate | up]; a = silu(gate) * up."""
    gu = (_f(h @ w_gate_up.t()) * r[:, None]).to(h.dtype)
    g, u = _f(gu).chunk(2, dim=-1)
    return gu, (F.silu(g) * u).to(h.dtype)


def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(H) logits = r * (h @ w_lm^T) never leave the epilogue: per row logsumexp and target logit."""
    logits = _f(h @ w_lm.t()) * r[:, None]
    return torch.logsumexp(logits, dim=-1), logits.gather(1, targets.reshape(-1, 1)).squeeze(1)


def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(F2) causal GQA attention on the fused qkv rows. Returns o (M, n_heads*hd) and the
    per-row logsumexp of the scores, lse (B, n_heads, T), fp32."""
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads, seq_len)
    p, lse = _attention_probs(q, k)
    o = (p @ v.repeat_interleave(n_heads // n_kv_heads, dim=1)).transpose(1, 2).reshape(qkv.shape[0], -1)
    return o.to(qkv.dtype), lse


# ---- backward -----------------------------------------------------------------------------

def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    """(B5) gradient of attention with respect to the fused qkv rows."""
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads, seq_len)
    B, H, T, hd = q.shape
    scale = hd ** -0.5
    group = n_heads // n_kv_heads
    p, _ = _attention_probs(q, k, lse)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    g_o4, o4 = (_f(t).reshape(B, T, H, hd).transpose(1, 2) for t in (g_o, o))
    g_v = p.transpose(-1, -2) @ g_o4
    g_p = g_o4 @ v.transpose(-1, -2)
    g_s = p * (g_p - (g_o4 * o4).sum(-1, keepdim=True))
    g_q = (g_s @ k) * scale
    g_k = (g_s.transpose(-1, -2) @ q) * scale
    g_k, g_v = (t.reshape(B, n_kv_heads, group, T, hd).sum(2) for t in (g_k, g_v))
    return torch.cat([t.transpose(1, 2).reshape(B * T, -1) for t in (g_q, g_k, g_v)], dim=1).to(qkv.dtype)


def rope_backward_rowscale_stat(g_qkv: Tensor, qkv: Tensor, r: Tensor, cos: Tensor, sin: Tensor,
                                n_rope_cols: int) -> tuple[Tensor, Tensor]:
    """(B6a) g_y = RoPE^-1(g_qkv), scaled by r for the dgrad/wgrad GEMMs, and the reverse-fusion
    statistic S = sum_k g_y*y = sum_k g_qkv*qkv (rotation preserves the dot product)."""
    g = _f(g_qkv)
    stat = (g * _f(qkv)).sum(-1, keepdim=True)
    g_y = _rotate_pairs(g, _f(cos), _f(sin), n_rope_cols, inverse=True)
    return (g_y * r[:, None]).to(g_qkv.dtype), stat


def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gu: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B1) g_a = g_out @ w_down; epilogue: dSwiGLU with the saved gu gives g_gu; writes r*g_gu,
    recomputes a = silu(gate)*up for the w_down weight gradient, and the reverse-fusion statistic
    S = sum_k g_gu*gu of the MLP norm."""
    g_a = _f(g_out @ w_down)
    g, u = _f(gu).chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    silu = g * sig
    g_gu = torch.cat((g_a * u * sig * (1 + g * (1 - sig)), g_a * silu), dim=-1)
    stat = (g_gu * _f(gu)).sum(-1, keepdim=True)
    return (g_gu * r[:, None]).to(g_out.dtype), (silu * u).to(g_out.dtype), stat


def gemm_cross_entropy_backward(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor, lse: Tensor,
                                grad_scale: float | Tensor) -> tuple[Tensor, Tensor]:
    """(H') recompute logits y = r*(h @ w_lm^T); g_y = (softmax(y) - onehot) * grad_scale; writes
    r*g_y and the reverse-fusion statistic S = sum_k g_y*y of the final norm."""
    y = _f(h @ w_lm.t()) * r[:, None]
    g_y = torch.exp(y - lse[:, None])
    g_y[torch.arange(y.shape[0], device=y.device), targets.reshape(-1)] -= 1.0
    g_y = g_y * grad_scale
    return (g_y * r[:, None]).to(h.dtype), (g_y * y).sum(-1, keepdim=True)


def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """(B2) c = -(r^2/d) * S: the coefficient of x in the RMSNorm input gradient."""
    return -(r * r / dim) * _f(stat_partials).sum(-1)


def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Optional[Tensor], x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """(B3, B6b, H'') acc = (r*g_y) @ w is the gradient of h = x*gamma; epilogue finishes the RMSNorm
    backward: g_x = residual_grad + gamma*acc + c*x, and g_gamma = sum_rows acc*x."""
    acc = _f(g_y_scaled @ w)
    xf = _f(x)
    g_x = acc * _f(gamma) + c[:, None] * xf
    if residual_grad is not None:
        g_x = g_x + _f(residual_grad)
    return g_x.to(x.dtype), (acc * xf).sum(0)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Plain GEMM a @ b (the o-projection dgrad)."""
    return a @ b


def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    """Weight gradient a^T @ b (K rows are tokens)."""
    return a.t() @ b


def embedding_backward(tokens: Tensor, g_x: Tensor, vocab_size: int) -> Tensor:
    """Scatter-add of the row gradients into the embedding table."""
    g = torch.zeros(vocab_size, g_x.shape[1], dtype=_f(g_x).dtype, device=g_x.device)
    return g.index_add_(0, tokens.reshape(-1), _f(g_x)).to(g_x.dtype)


# ---- helpers ------------------------------------------------------------------------------

def _split_heads(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views of q (B,H,T,hd) in the epilogue precision, k and v (B,Hkv,T,hd)."""
    M = qkv.shape[0]
    hd = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    q, k, v = qkv.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], dim=1)
    return tuple(_f(t).reshape(M // seq_len, seq_len, -1, hd).transpose(1, 2) for t in (q, k, v))


def _attention_probs(q: Tensor, k: Tensor, lse: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Causal softmax probabilities of q k^T / sqrt(hd), each KV head shared by n_heads/n_kv_heads q heads."""
    B, H, T, hd = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * hd ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]), lse
