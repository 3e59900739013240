"""The CODA op set: each op declared once, on its reference implementation (plain torch, any
device, any float dtype: the numerical oracle).

Each function computes exactly what its GEMM + epilogue program computes: the GEMM in the input
dtype, the epilogue in fp32 (fp64 stays fp64), outputs in the input dtype, row statistics in fp32.
Its `@declare` states the rest of the contract (declare.py): the fake, the partial-sum outputs,
the fused GEMM and example inputs. Equation tags (F1..F6, B1..B6, E, H) refer to docs/design.md.
Rows are tokens (M = batch * seq_len, row-major), d = model dim.

RoPE tables: `rope` is (M, head_dim) in the epilogue precision with (cos a, sin a) of row m's
angle for pair i at columns (2i, 2i+1): one row per token row, the layout the cute epilogue reads.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .declare import STAT_TILE_N, STRIP_COLS, Example, declare, n_stat_cols, stat_dtype


def _f(t: Tensor) -> Tensor:
    """Epilogue precision: fp32 accumulators, fp64 stays fp64 (the CPU oracle)."""
    return t if t.dtype == torch.float64 else t.float()


def _rotate_pairs(y: Tensor, rope: Tensor, n_rope_cols: int, inverse: bool) -> Tensor:
    """RoPE on interleaved column pairs (2i, 2i+1) of every head in y[:, :n_rope_cols], row m by
    the angles of rope[m] (module docstring)."""
    M, hd = rope.shape
    pairs = y[:, :n_rope_cols].reshape(M, -1, hd // 2, 2)
    cs = rope.to(y.dtype).reshape(M, 1, hd // 2, 2)
    c, s = cs[..., 0], cs[..., 1]
    if inverse:
        s = -s
    y0, y1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((y0 * c - y1 * s, y0 * s + y1 * c), dim=-1).reshape(M, n_rope_cols)
    return torch.cat((rotated, y[:, n_rope_cols:]), dim=1)


def _gemm_shape(a: Tensor, w: Tensor, **_) -> tuple[int, int, int]:
    """(m, n, k) of a @ w^T."""
    return a.shape[0], w.shape[0], a.shape[1]


def _new(t: Tensor, *shape: int, stat: bool = False) -> Tensor:
    """An empty tensor like t (its dtype, or its statistics dtype) for the fakes."""
    return t.new_empty(shape, dtype=stat_dtype(t.dtype) if stat else t.dtype)


# ---- forward ------------------------------------------------------------------------------

def _embedding_fake(tokens, emb, gamma, dtype):
    x = emb.new_empty(tokens.numel(), emb.shape[1], dtype=dtype)
    return x, torch.empty_like(x), x.new_empty(tokens.numel(), 1, dtype=stat_dtype(dtype))


@declare(fake=_embedding_fake,
         examples=lambda x: {"": dict(tokens=x.tokens(), emb=x.act(x.dims.vocab_size, x.dims.dim), gamma=x.gamma(x.dims.dim),
                                      dtype=x.dtype),
                             "fp32 table": dict(tokens=x.tokens(), emb=x.stat(x.dims.vocab_size, x.dims.dim),
                                                gamma=x.gamma(x.dims.dim), dtype=x.dtype)},
         partials={2: lambda **_: 1})
def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(E) x = emb[tokens] in `dtype` (the compute dtype: the table may be the fp32 master weights,
    read without a copy of the whole table); h = x*gamma; partial row sums of x^2."""
    x = emb[tokens.reshape(-1)].to(dtype)
    xf = _f(x)
    return x, (xf * _f(gamma)).to(dtype), (xf * xf).sum(-1, keepdim=True)


@declare(fake=lambda sumsq_partials, dim, eps: _new(sumsq_partials, sumsq_partials.shape[0], stat=True),
         examples=lambda x: {"": dict(sumsq_partials=x.positive(x.dims.rows, 3, scale=x.dims.dim), dim=x.dims.dim, eps=1e-5),
                             "many tiles": dict(sumsq_partials=x.positive(x.dims.rows, 300, scale=x.dims.dim / 100),
                                                dim=x.dims.dim, eps=1e-5)})
def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """(F4) r = 1/sqrt(mean(x^2) + eps) from per-tile partial sums of x^2, fp32 (M,)."""
    return torch.rsqrt(_f(sumsq_partials).sum(-1) / dim + eps)


@declare(fake=lambda h, r, w, rope, n_rope_cols: _new(h, h.shape[0], w.shape[0]),
         examples=lambda x: {"": dict(h=x.act(x.dims.rows, x.dims.dim), r=x.rowscale(), w=x.weight(x.dims.qkv_dim, x.dims.dim),
                                      rope=x.rope(), n_rope_cols=x.dims.n_rope_cols)},
         gemm=lambda h, w, **_: _gemm_shape(h, w))
def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, rope: Tensor, n_rope_cols: int) -> Tensor:
    """(F1) qkv = RoPE(r * (h @ w^T)) on the first n_rope_cols columns (q and k), a multiple of
    head_dim = rope.shape[1]."""
    y = _f(h @ w.t()) * r[:, None]
    return _rotate_pairs(y, _f(rope), n_rope_cols, inverse=False).to(h.dtype)


def _residual_examples(x: Example) -> dict:
    """The o-projection (F3), the down projection (F6), and where the model dim fits one stat
    tile, a GEMM over several tiles (vocab-wide), so the partial-sum split is exercised."""
    d = x.dims
    cases = {"": dict(a=x.act(d.rows, d.n_heads * d.head_dim), w=x.weight(d.dim, d.n_heads * d.head_dim),
                      residual=x.act(d.rows, d.dim), gamma=x.gamma(d.dim)),
             "down": dict(a=x.act(d.rows, d.ffn_dim), w=x.weight(d.dim, d.ffn_dim), residual=x.act(d.rows, d.dim),
                          gamma=x.gamma(d.dim))}
    if d.dim <= STAT_TILE_N:
        cases["wide"] = dict(a=x.act(d.rows, d.ffn_dim), w=x.weight(d.vocab_size, d.ffn_dim),
                             residual=x.act(d.rows, d.vocab_size), gamma=x.gamma(d.vocab_size))
    return cases


@declare(fake=lambda a, w, residual, gamma: (_new(a, a.shape[0], w.shape[0]), _new(a, a.shape[0], w.shape[0]),
                                             _new(a, a.shape[0], n_stat_cols(w.shape[0]), stat=True)),
         examples=_residual_examples,
         partials={2: lambda w, **_: n_stat_cols(w.shape[0])},
         gemm=lambda a, w, **_: _gemm_shape(a, w))
def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(F3, F6) x = residual + a @ w^T; h = x*gamma; partial row sums of x^2.
    h and the sums use x as stored, so they are the same function of x that backward sees."""
    x = (_f(residual) + _f(a @ w.t())).to(a.dtype)
    xf = _f(x)
    return x, (xf * _f(gamma)).to(a.dtype), (xf * xf).sum(-1, keepdim=True)


@declare(fake=lambda h, r, w_gate_up: (_new(h, h.shape[0], w_gate_up.shape[0] // 2), _new(h, h.shape[0], w_gate_up.shape[0] // 2)),
         examples=lambda x: {"": dict(h=x.act(x.dims.rows, x.dims.dim), r=x.rowscale(),
                                      w_gate_up=x.weight(2 * x.dims.ffn_dim, x.dims.dim))},
         gemm=lambda h, w_gate_up, **_: _gemm_shape(h, w_gate_up))
def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """(F5) [gate | up] = r * (h @ w_gate_up^T); returns the rounded gate and a = silu(gate) * up from the
    rounded gate and the unrounded up. up is not stored: B1 recovers up * sigmoid(gate) as a / gate."""
    g, u = (_f(h @ w_gate_up.t()) * r[:, None]).chunk(2, dim=-1)
    gate = floor_gate(g.to(h.dtype))  # a tensor of its own, not a view of the (M, 2F) product
    return gate, (F.silu(_f(gate)) * u).to(h.dtype)


GATE_FLOOR = 2.0 ** -100


def floor_gate(gate: Tensor) -> Tensor:
    """(F5) The gate as F5 stores it: where |gate| < 2^-100 (0, subnormal, or so small that a = silu(gate) * up
    would lose up), +2^-100, so that a carries up and B1's q = a / gate is up * sigmoid(gate) to bf16 rounding
    (docs/design.md, "SwiGLU: two stored tiles each way"); it moves a by less than 2^-100 |up| (silu is ~gate/2
    there: from about -2^-101 |up| at a gate just above -2^-100 to +2^-101 |up|)."""
    return torch.where(gate.abs() < GATE_FLOOR, torch.full_like(gate, GATE_FLOOR), gate)


def _lm_head_examples(x: Example) -> dict:
    """Logits of std ~4 (w_lm scaled up), so the softmax is peaked as in a trained model."""
    d = x.dims
    return {"": dict(h=x.act(d.rows, d.dim), r=x.rowscale(), w_lm=x.weight(d.vocab_size, d.dim, scale=4.0),
                     targets=x.tokens())}


@declare(fake=lambda h, r, w_lm, targets: (_new(h, h.shape[0], stat=True), _new(h, h.shape[0], stat=True)),
         examples=_lm_head_examples,
         gemm=lambda h, w_lm, **_: _gemm_shape(h, w_lm))
def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(H, evaluation) logits = r * (h @ w_lm^T) never leave the epilogue: per row logsumexp and target logit, fp32 (M,)."""
    logits = _f(h @ w_lm.t()) * r[:, None]
    return torch.logsumexp(logits, dim=-1), logits.gather(1, targets.reshape(-1, 1)).squeeze(1)


LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
MAX_OCTAVES = 100  # a target's group offset at most this many octaves below the row's largest (H')


def _log2_excess(y: Tensor, k: Tensor) -> Tensor:
    """t = y log2e - k rounded once, as the device's fma (H's epilogue, H'), with log2e in y's dtype:
    t is small where it counts (near the row's largest logit) while y log2e carries the logit's size,
    so a rounded product would cost t |y| 2^-24. In float64 a product of two fp32 numbers is exact."""
    log2e = torch.tensor(LOG2E, dtype=y.dtype).double()
    return (y.double() * log2e - k.double()).to(y.dtype)


def _exp_canonical(e: Tensor, k: Tensor, sum_exp: Tensor, sum_exp_t: Tensor, target_logit: Tensor) -> tuple:
    """H's outputs without its choice of offsets (k rounds a maximum, so two exact implementations
    may pick k one apart), each on a per-row scale, so that every row weighs alike in a norm-wise
    check (exp(y) itself spans many octaves between rows): with S = sum_g (sum e)_g 2^k_g the row's
    sum of exp(y) from the op's own sums, the softmax e 2^k / S, ln S (the logsumexp), the expected
    logit sum_g ((sum e*t)_g + k_g (sum e)_g) 2^k_g ln2 / S (y = (t + k_g) ln2), and the target logit."""
    scale = torch.exp2(k.double())
    total = (sum_exp.double() * scale).sum(-1)
    cols = scale.repeat_interleave(STAT_TILE_N, dim=1)[:, :e.shape[1]]
    sum_exp_y = (sum_exp_t.double() + k.double() * sum_exp.double()) * LN2
    return e.double() * cols / total[:, None], total.log(), (sum_exp_y * scale).sum(-1) / total, target_logit


def exp_stats_per_group(k: Tensor, sum_exp: Tensor, sum_exp_t: Tensor, rep: int) -> tuple[Tensor, Tensor, Tensor]:
    """H's offsets and sums of an implementation whose offset spans `rep` groups of STAT_TILE_N
    columns (one per row and wider N tile), at the declared width: each group takes its tile's
    offset, the tile's sums go to its first group and zeros to the others. Every consumer weighs a
    group's sums by 2^k of that group and adds them up, so the loss and gradient are unchanged."""
    if rep == 1:
        return k, sum_exp, sum_exp_t
    M, T = k.shape
    zeros_after = (0, rep - 1)  # each tile's one column, then rep - 1 zero columns
    return (k.unsqueeze(-1).expand(M, T, rep).reshape(M, T * rep),
            *(F.pad(s.unsqueeze(-1), zeros_after).view(M, T * rep) for s in (sum_exp, sum_exp_t)))


def _exp_fake(h, r, w_lm, targets):
    M, V = h.shape[0], w_lm.shape[0]
    return (_new(h, M, V), *(_new(h, M, n_stat_cols(V), stat=True) for _ in range(3)), _new(h, M, stat=True))


@declare(fake=_exp_fake, examples=_lm_head_examples, canonical=_exp_canonical,
         gemm=lambda h, w_lm, **_: _gemm_shape(h, w_lm))
def gemm_rowscale_exp_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor,
                                    targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(H, training) logits y = r * (h @ w_lm^T) stored as their exponentials, one chunk of rows at a
    time: per row and group of STAT_TILE_N columns g, a power-of-two offset k_g = round(max_g y *
    log2 e) (fp32, integer-valued) and e = 2^t, t = y log2 e - k_g, in h.dtype (|e| <= sqrt 2: no
    overflow whatever the logits); per group, fp32, sum e and sum e*t (of e before its rounding); and
    the target logit y_t, fp32 (M,). The logits themselves are never stored (H' needs only these).
    sum e*t, not sum e*y: t is y less its group's offset, so the final norm's S (H') adds numbers of the
    softmax's spread, not of the largest logit's size, whose fp32 rounding would swamp S."""
    y = _f(h @ w_lm.t()) * r[:, None]
    M, V = y.shape
    G = n_stat_cols(V)
    pad = G * STAT_TILE_N - V
    groups = F.pad(y, (0, pad), value=float("-inf")).view(M, G, STAT_TILE_N)
    k = torch.round(groups.amax(-1) * LOG2E)
    t = _log2_excess(groups, k[..., None])
    e = torch.exp2(t)  # 0 in the padding
    e_t = torch.where(e > 0, e * t, 0.0)  # the padding's t is -inf
    target_logit = y.gather(1, targets.reshape(-1, 1)).squeeze(1)
    return e.reshape(M, -1)[:, :V].to(h.dtype).contiguous(), k, e.sum(-1), e_t.sum(-1), target_logit


def _exp_backward_examples(x: Example) -> dict:
    """H's outputs of logits of std ~4 (as _lm_head_examples); "far target": every target's group
    offset more than MAX_OCTAVES octaves below its row's largest (a confidently wrong model)."""
    d = x.dims

    def case(shift: float) -> dict:
        h, r, w, targets = (x.act(d.rows, d.dim), x.rowscale(), x.weight(d.vocab_size, d.dim, scale=4.0), x.tokens())
        M, V, G = d.rows, d.vocab_size, n_stat_cols(d.vocab_size)

        def outputs():
            e, k, se, set_, yt = gemm_rowscale_exp_cross_entropy(h.double(), r.double(), w.double(), targets)
            far = torch.arange(G, device=k.device)[None, :] != (targets // STAT_TILE_N)[:, None]
            # the other groups' logits shifted up by shift octaves: same e, t and sums, their offsets moved
            return e, k + far * shift, se, set_, yt
        e, k, se, set_, yt = x.computed(outputs, ((M, V), x.dtype), *[((M, G), x.stat_dtype)] * 3, ((M,), x.stat_dtype))
        return dict(e=e, k=k, sum_exp=se, sum_exp_t=set_, target_logit=yt, targets=targets, r=r, h=h,
                    grad_scale=torch.tensor(1.0 / M, dtype=x.stat_dtype, device=x.device))

    return {"": case(0.0), "far target": case(float(MAX_OCTAVES + 30))}


def _exp_backward_fake(e, k, sum_exp, sum_exp_t, target_logit, targets, r, h, grad_scale):
    M, V = e.shape
    return (_new(h, M, stat=True), _new(e, -(-V // STRIP_COLS), M), _new(h, M, stat=True), _new(h, *h.shape),
            _new(h, M, 1, stat=True))


def _exp_backward_canonical(loss: Tensor, strip: Tensor, v: Tensor, hs: Tensor, stat: Tensor, e: Tensor) -> tuple:
    """H''s outputs as its consumers use them, each row on its own scale (v and the target columns
    of e span octaves between rows): the loss, the gradient r*g_y = v * (strip (x) e) (rows of norm
    ~ grad_scale * r), hs / v (= h where hs is consistent with v), and S."""
    V = e.shape[1]
    v = v.double()
    g = v[:, None] * strip.double().t().repeat_interleave(STRIP_COLS, dim=1)[:, :V] * e.double()
    return loss, g, hs.double() / torch.where(v != 0, v, 1.0)[:, None], stat


@declare(fake=_exp_backward_fake, examples=_exp_backward_examples, mutates=("e",), partials={4: lambda **_: 1},
         canonical=_exp_backward_canonical)
def cross_entropy_exp_backward(e: Tensor, k: Tensor, sum_exp: Tensor, sum_exp_t: Tensor, target_logit: Tensor,
                               targets: Tensor, r: Tensor, h: Tensor,
                               grad_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(H') the loss and the logit gradient of one chunk from H's outputs, without a pass over e.
    Per row: L = ln sum_g sum_exp_g 2^k_g, loss = L - y_t (fp32 (M,)). The gradient r*g_y with
    g_y = (softmax(y) - onehot(t)) * grad_scale (a 0-dim tensor) stays factored for the consumers'
    mainloops (H''): r*g_y = v * (strip (x) e), where
      strip (ceil(V/64), M) in e's dtype = 2^(k_g - k_max) of column block j//64 (exact powers of two),
      v (M,) fp32 = grad_scale * r * 2^k_max * e^-L = grad_scale * r / s, s = sum_g sum_exp_g 2^(k_g - k_max),
      e's target column rewritten in place to (p_t - 1) e^L 2^-k_t = (p_t - 1) s 2^(k_max - k_t) (the onehot), its group's offset
      k_t first raised to k_max - MAX_OCTAVES if lower (the group's other columns, then below
      2^-MAX_OCTAVES of the row's largest, written as 0), so every factor stays a normal number;
    hs = v * h in h.dtype (the weight gradient's B operand), and the final RMSNorm's reverse-fusion
    statistic S = sum_j g_y,j y_j as one partial column, in log2 units relative to k_max so that no
    term has the largest logit's size: S = grad_scale ln2 (sum_g 2^(k_g - k_max) ((sum e*t)_g + (k_g -
    k_max) (sum e)_g) / s - (y_t log2 e - k_max)), the last difference rounded once (an fma)."""
    kf, se, set_, yt = _f(k), _f(sum_exp), _f(sum_exp_t), _f(target_logit)
    M, V = e.shape
    rows, t = torch.arange(M, device=e.device), targets.reshape(-1)
    k_max = kf.amax(-1)
    w = torch.exp2(kf - k_max[:, None])
    s = (se * w).sum(-1)  # sum_j e^y_j / 2^k_max; every factor below comes from s, not from L = k_max ln2 + ln s,
    L = k_max * LN2 + torch.log(s)  # which carries the largest logit's size: exp(. - L) would cancel it away
    g_t = t // STAT_TILE_N
    k_t = kf[rows, g_t]
    k_adj = kf.clone()
    k_adj[rows, g_t] = torch.maximum(k_t, k_max - MAX_OCTAVES)
    raised = k_adj[rows, g_t] > k_t
    cols = torch.arange(V, device=e.device)
    e[raised[:, None] & ((cols // STAT_TILE_N)[None, :] == g_t[:, None])] = 0
    e[rows, t] = ((torch.exp(yt - L) - 1) * s * torch.exp2(k_max - k_adj[rows, g_t])).to(e.dtype)
    strip = torch.exp2(k_adj - k_max[:, None]).repeat_interleave(STAT_TILE_N // STRIP_COLS, dim=1)
    strip = strip[:, :-(-V // STRIP_COLS)].t().contiguous().to(e.dtype)
    scale = grad_scale.to(kf.dtype)
    v = scale * _f(r) / s
    target_t = _log2_excess(yt, k_max)
    stat = scale * LN2 * (((set_ + (kf - k_max[:, None]) * se) * w).sum(-1) / s - target_t)
    return L - yt, strip, v, (v[:, None] * _f(h)).to(h.dtype), stat[:, None]


@declare(fake=lambda h, r, w: _new(h, h.shape[0], w.shape[0]),
         examples=lambda x: {"": dict(h=x.act(x.dims.rows, x.dims.dim), r=x.rowscale(),
                                      w=x.weight(x.dims.vocab_size, x.dims.dim, scale=4.0))},
         gemm=lambda h, w, **_: _gemm_shape(h, w))
def gemm_rowscale(h: Tensor, r: Tensor, w: Tensor) -> Tensor:
    """(L) y = r * (h @ w^T): the projection of an RMSNorm's output with no other epilogue, e.g. the
    LM-head logits r_f * (h_f W_lm^T) of the final norm, for inference."""
    return (_f(h @ w.t()) * r[:, None]).to(h.dtype)


def _attention_fake(qkv, n_heads, n_kv_heads, seq_len):
    M, hd = qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    return _new(qkv, M, n_heads * hd), _new(qkv, M // seq_len, n_heads, seq_len, stat=True)


@declare(fake=_attention_fake,
         examples=lambda x: {"": dict(qkv=x.act(x.dims.rows, x.dims.qkv_dim), n_heads=x.dims.n_heads,
                                      n_kv_heads=x.dims.n_kv_heads, seq_len=x.dims.seq_len)})
def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(F2) causal GQA attention on the fused qkv rows. Returns o (M, n_heads*hd) and the
    per-row logsumexp of the scores, lse (B, n_heads, T), fp32."""
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads, seq_len)
    p, lse = _attention_probs(q, k)
    o = (p @ v.repeat_interleave(n_heads // n_kv_heads, dim=1)).transpose(1, 2).reshape(qkv.shape[0], -1)
    return o.to(qkv.dtype), lse


# ---- backward -----------------------------------------------------------------------------

def _attention_backward_examples(x: Example) -> dict:
    """o and lse are the float64 attention of qkv, as the forward would have saved them."""
    d = x.dims
    H, G, T, M = d.n_heads, d.n_kv_heads, d.seq_len, d.rows
    qkv = x.act(M, d.qkv_dim)
    o, lse = x.computed(lambda: attention(qkv.double(), H, G, T), ((M, H * d.head_dim), x.dtype),
                        ((M // T, H, T), x.stat_dtype))
    return {"": dict(g_o=x.act(M, H * d.head_dim), qkv=qkv, o=o, lse=lse, n_heads=H, n_kv_heads=G, seq_len=T)}


def _attention_grad(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                    seq_len: int) -> Tensor:
    """The gradient of attention with respect to the fused qkv rows, (M, qkv_dim) in the epilogue
    precision (not rounded)."""
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
    return torch.cat([t.transpose(1, 2).reshape(B * T, -1) for t in (g_q, g_k, g_v)], dim=1)


@declare(fake=lambda g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len: _new(qkv, *qkv.shape),
         examples=_attention_backward_examples)
def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    """(B5 alone) gradient of attention with respect to the fused qkv rows (M, qkv_dim). The model
    runs B5 with B6a as one op (below); this one is the bare FlashAttention backward of the floor."""
    return _attention_grad(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len).to(qkv.dtype)


def _attention_rope_backward_examples(x: Example) -> dict:
    """The dims' heads; every head its own kv head (no GQA: FlashAttention writes dk/dv in bf16
    itself); and head_dim 256 (FlashAttention's sm90 backward swaps its dK/dV MMA there)."""
    d = x.dims
    wide = max(2, d.dim // 256)  # heads of 256 columns
    cases = {}
    for case, dims in (("", d), ("no GQA", dataclasses.replace(d, n_kv_heads=d.n_heads)),
                       ("head_dim 256", dataclasses.replace(d, n_heads=wide, dim=wide * 256, n_kv_heads=1))):
        ex = Example(dims, x.dtype, x.device, x.gen)
        (kw,) = _attention_backward_examples(ex).values()
        cases[case] = dict(kw, r=ex.rowscale(), rope=ex.rope())
    return cases


def _attention_rope_backward_fake(g_o, qkv, o, lse, r, rope, n_heads, n_kv_heads, seq_len):
    return _new(qkv, *qkv.shape), _new(qkv, qkv.shape[0], n_heads + 2 * n_kv_heads, stat=True)


@declare(fake=_attention_rope_backward_fake, examples=_attention_rope_backward_examples,
         partials={1: lambda n_heads, n_kv_heads, **_: n_heads + 2 * n_kv_heads})
def attention_rope_backward_rowscale_stat(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, r: Tensor, rope: Tensor,
                                          n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(B5, B6a) g_qkv = the attention gradient of the fused qkv rows, never stored; returns
    g_y = RoPE^-1(g_qkv) on the q/k heads, scaled by r for the dgrad/wgrad GEMMs that read it, and
    the reverse-fusion statistic S = sum_k g_y*y = sum_k g_qkv*qkv (rotation preserves the dot
    product), one partial column per head."""
    g = _attention_grad(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len)
    stat = (g * _f(qkv)).sum(-1, keepdim=True)
    n_rope_cols = (n_heads + n_kv_heads) * rope.shape[1]
    g_y = _rotate_pairs(g, _f(rope), n_rope_cols, inverse=True)
    return (g_y * r[:, None]).to(qkv.dtype), stat


FLT_MIN = torch.finfo(torch.float32).tiny


def _swiglu_pair(x: Example) -> dict:
    """B1's saved inputs as F5 makes them: a random gate and a = silu(gate) * up of a random up (so a / gate is
    up * sigmoid(gate), not the ratio of two unrelated values)."""
    gate, up = x.act(x.dims.rows, x.dims.ffn_dim), x.act(x.dims.rows, x.dims.ffn_dim)
    return dict(gate=gate, a=(F.silu(_f(gate)) * _f(up)).to(gate.dtype))


def up_times_sigmoid(gate: Tensor, a: Tensor) -> Tensor:
    """(B1) up * sigmoid(gate) = a / gate from F5's stored gate and a; 0 where |gate| < FLT_MIN (0 or
    subnormal, where the GPU's flush-to-zero reciprocal would give inf). F5 never stores such a gate
    (floor_gate); a gate from elsewhere that small has lost up in a, and gets q = 0 (docs/design.md)."""
    lost = gate.abs() < FLT_MIN
    return torch.where(lost, torch.zeros_like(a), a / torch.where(lost, torch.ones_like(gate), gate))


@declare(fake=lambda g_out, w_down, gate, a, r: (_new(g_out, g_out.shape[0], 2 * w_down.shape[1]),
                                                 _new(g_out, g_out.shape[0], n_stat_cols(w_down.shape[1]), stat=True)),
         examples=lambda x: {"": dict(g_out=x.act(x.dims.rows, x.dims.dim), w_down=x.weight(x.dims.dim, x.dims.ffn_dim),
                                      **_swiglu_pair(x), r=x.rowscale())},
         partials={1: lambda w_down, **_: n_stat_cols(w_down.shape[1])},
         gemm=lambda g_out, w_down, **_: (g_out.shape[0], w_down.shape[1], g_out.shape[1]))
def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gate: Tensor, a: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """(B1) g_a = g_out @ w_down; epilogue: dSwiGLU from F5's gate and a (q = up * sigmoid(gate) = a / gate:
    g_gate = g_a q (1 + gate (1 - sigmoid)), g_up = g_a silu(gate)); writes r*g_gu and the reverse-fusion
    statistic S = sum_k g_gu*gu = sum_k g_gate*gate + g_a*a of the MLP norm (g_up*up = g_a*a)."""
    g_a = _f(g_out @ w_down)
    g, a_f = _f(gate), _f(a)
    sig = torch.sigmoid(g)
    g_gate, g_up = g_a * up_times_sigmoid(g, a_f) * (1 + g * (1 - sig)), g_a * g * sig
    stat = (g_gate * g + g_a * a_f).sum(-1, keepdim=True)
    return (torch.cat((g_gate, g_up), dim=-1) * r[:, None]).to(g_out.dtype), stat


@declare(fake=lambda stat_partials, r, dim: r.new_empty(r.shape[0], dtype=torch.promote_types(r.dtype, stat_dtype(stat_partials.dtype))),
         examples=lambda x: {"": dict(stat_partials=x.stat(x.dims.rows, 3), r=x.rowscale(), dim=x.dims.dim),
                             "many tiles": dict(stat_partials=x.stat(x.dims.rows, 300), r=x.rowscale(), dim=x.dims.dim)})
def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """(B2) c = -(r^2/d) * S: the coefficient of x in the RMSNorm input gradient, fp32 (M,)."""
    return -(r * r / dim) * _f(stat_partials).sum(-1)


def _rmsnorm_backward_examples(x: Example) -> dict:
    """The gate/up dgrad with the residual gradient (B3)."""
    d = x.dims
    return {"": dict(g_y_scaled=x.act(d.rows, 2 * d.ffn_dim), w=x.weight(2 * d.ffn_dim, d.dim),
                     residual_grad=x.act(d.rows, d.dim), x=x.act(d.rows, d.dim), gamma=x.gamma(d.dim),
                     c=x.stat(d.rows, scale=0.01))}


@declare(fake=lambda g_y_scaled, w, residual_grad, x, gamma, c: (_new(x, g_y_scaled.shape[0], w.shape[1]),
                                                                 _new(x, w.shape[1], stat=True)),
         examples=_rmsnorm_backward_examples,
         gemm=lambda g_y_scaled, w, **_: (g_y_scaled.shape[0], w.shape[1], g_y_scaled.shape[1]))
def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Tensor, x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """(B3, B6b) acc = (r*g_y) @ w is the gradient of h = x*gamma; epilogue finishes the RMSNorm
    backward: g_x = residual_grad + gamma*acc + c*x, and g_gamma = sum_rows acc*x, fp32 (d,)."""
    acc = _f(g_y_scaled @ w)
    xf = _f(x)
    g_x = _f(residual_grad) + acc * _f(gamma) + c[:, None] * xf
    return g_x.to(x.dtype), (acc * xf).sum(0)


def _strip_scaled(e: Tensor, strip: Tensor) -> Tensor:
    """strip (x) e: column j of e times strip[j // STRIP_COLS], exact (powers of two), in e's dtype."""
    return (_f(e) * _f(strip).t().repeat_interleave(STRIP_COLS, dim=1)[:, :e.shape[1]]).to(e.dtype)


def _exp_consumer_examples(x: Example) -> dict:
    """H' outputs of the examples of H (so strip, v and the rewritten e belong together)."""
    d = x.dims
    M, V = d.rows, d.vocab_size
    kw = _exp_backward_examples(x)[""]

    def outputs():
        kw64 = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kw.items()}
        loss, strip, v, hs, stat = cross_entropy_exp_backward(**kw64)
        return kw64["e"], strip, v, hs
    e, strip, v, hs = x.computed(outputs, ((M, V), x.dtype), ((-(-V // STRIP_COLS), M), x.dtype), ((M,), x.stat_dtype),
                                 ((M, d.dim), x.dtype))
    return dict(e=e, strip=strip, v=v, hs=hs, h=kw["h"])


@declare(fake=lambda e, strip, v, w, x, gamma, c: (_new(x, e.shape[0], w.shape[1]), _new(x, w.shape[1], stat=True)),
         examples=lambda x: {"": dict({k: v for k, v in _exp_consumer_examples(x).items() if k in ("e", "strip", "v")},
                                      w=x.weight(x.dims.vocab_size, x.dims.dim, scale=4.0), x=x.act(x.dims.rows, x.dims.dim),
                                      gamma=x.gamma(x.dims.dim), c=x.stat(x.dims.rows, scale=0.01))},
         gemm=lambda e, w, **_: (e.shape[0], w.shape[1], e.shape[1]))
def gemm_exp_rmsnorm_backward(e: Tensor, strip: Tensor, v: Tensor, w: Tensor, x: Tensor, gamma: Tensor,
                              c: Tensor) -> tuple[Tensor, Tensor]:
    """(H'') the LM head's dgrad from H' outputs: acc = (strip (x) e) @ w (the strip applied to e as
    the GEMM loads it), g_h = v*acc the gradient of h = x*gamma; epilogue as gemm_rmsnorm_backward
    without a residual: g_x = gamma*g_h + c*x, g_gamma = sum_rows g_h*x, fp32 (d,)."""
    g_h = _f(_strip_scaled(e, strip) @ w) * _f(v)[:, None]
    xf = _f(x)
    return (g_h * _f(gamma) + c[:, None] * xf).to(x.dtype), (g_h * xf).sum(0)


@declare(fake=lambda a, b: _new(a, a.shape[0], b.shape[1]),
         examples=lambda x: {"": dict(a=x.act(x.dims.rows, x.dims.dim),
                                      b=x.weight(x.dims.dim, x.dims.n_heads * x.dims.head_dim))},
         gemm=lambda a, b: (a.shape[0], b.shape[1], a.shape[1]))
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """(B4) plain GEMM a @ b (the o-projection dgrad g_x1 @ W_o)."""
    return a @ b


@declare(fake=lambda a, b: _new(a, a.shape[1], b.shape[1], stat=True),
         examples=lambda x: {"": dict(a=x.act(x.dims.rows, x.dims.dim), b=x.act(x.dims.rows, 2 * x.dims.ffn_dim))},
         gemm=lambda a, b: (a.shape[1], b.shape[1], a.shape[0]))
def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    """Weight gradient a^T @ b (the contraction runs over tokens), written in fp32 (fp64 stays
    fp64): the dtype of the master weights it updates, so no cast follows."""
    return _f(a).t() @ _f(b)


def _exp_wgrad_examples(x: Example, accumulate: bool) -> dict:
    kw = _exp_consumer_examples(x)
    case = dict(e=kw["e"], strip=kw["strip"], hs=kw["hs"])
    if not accumulate:
        return {"": case}
    return {"": dict(acc=x.stat(x.dims.vocab_size, x.dims.dim, scale=x.dims.rows ** -0.5), **case)}


@declare(fake=lambda e, strip, hs: _new(hs, e.shape[1], hs.shape[1], stat=True),
         examples=lambda x: _exp_wgrad_examples(x, accumulate=False),
         gemm=lambda e, strip, hs: (e.shape[1], hs.shape[1], e.shape[0]))
def matmul_tn_exp(e: Tensor, strip: Tensor, hs: Tensor) -> Tensor:
    """(H'') the LM head's weight gradient of one chunk from H' outputs: (strip (x) e)^T @ hs (the
    strip applied to e as the GEMM loads it), fp32 (V, d) (fp64 stays fp64)."""
    return _f(_strip_scaled(e, strip)).t() @ _f(hs)


@declare(fake=lambda acc, e, strip, hs: None,
         examples=lambda x: _exp_wgrad_examples(x, accumulate=True),
         mutates=("acc",),
         gemm=lambda acc, e, strip, hs: (e.shape[1], hs.shape[1], e.shape[0]))
def matmul_tn_exp_add(acc: Tensor, e: Tensor, strip: Tensor, hs: Tensor) -> None:
    """(H'') acc += (strip (x) e)^T @ hs in place (matmul_tn_exp accumulated over chunks of rows in
    one fp32 buffer)."""
    acc += _f(_strip_scaled(e, strip)).t() @ _f(hs)


@declare(fake=lambda t, scale: None,
         examples=lambda x: {"": dict(t=x.stat(x.dims.vocab_size, x.dims.dim), scale=x.stat(1).reshape(())),
                             "one": dict(t=x.stat(x.dims.vocab_size, x.dims.dim), scale=x.positive(1).fill_(1.0).reshape(())),
                             "zero": dict(t=x.stat(x.dims.vocab_size, x.dims.dim), scale=x.positive(1).fill_(0.0).reshape(())),
                             "activations": dict(t=x.act(x.dims.rows, x.dims.dim), scale=x.positive(1).fill_(1 / 3).reshape(()))},
         mutates=("t",))
def scale_in_place(t: Tensor, scale: Tensor) -> None:
    """t *= scale in place, `scale` a 0-dim tensor read on the device (never on the host: no sync),
    the product in fp32 (fp64 stays fp64) rounded once to t's dtype: the LM head's incoming loss
    gradient applied to the gradients its forward computed (H''), e.g. 1/3 with 3 accumulation steps."""
    t.copy_(_f(t) * _f(scale))


@declare(fake=lambda acc, tokens, g_x: None,
         examples=lambda x: {"": dict(acc=x.stat(x.dims.vocab_size, x.dims.dim),
                                      tokens=x.tokens(), g_x=x.act(x.dims.rows, x.dims.dim))},
         mutates=("acc",))
def embedding_backward(acc: Tensor, tokens: Tensor, g_x: Tensor) -> None:
    """(E') scatter-add of the row gradients into the (vocab_size, d) gradient `acc` in place, fp32
    (the master weights' dtype; fp64 stays fp64): zeros, or with tied embeddings the LM head's
    gradient of the same table, so the two gradients are summed without a second table-sized buffer."""
    acc.index_add_(0, tokens.reshape(-1), _f(g_x).to(acc.dtype))


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
