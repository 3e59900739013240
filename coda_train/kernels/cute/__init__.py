"""The `cute` backend of the CODA op set: quack Hopper GEMM + epilogue programs, FlashAttention 4.

Same names, signatures and semantics as the declarations in coda_train/kernels/reference.py (the
oracle); each function below is registered against its declaration by `@cute_impl(name)`
(../library.py), which makes it the CUDA kernel of `coda::<name>`. The epilogue programs
themselves are in _epilogues.py (a few lines each); this module validates inputs, lays out the
operands (vector / tile views, partial-sum buffers), launches, and does the per-row fix-ups.
docs/kernels.md lists, per op, the primitives used and what runs as plain torch.

Supported: bfloat16 activations and weights on an sm_90 GPU; every inner dimension a multiple of 8
(16-byte rows for TMA); any number of token rows M (ragged tiles are predicated in the kernels).
Anything else raises ValueError naming the constraint (../cute_limits.py, which also states them
for whole models before any GPU work).

Importing this module imports cutlass, quack and flash_attn; `import coda_train` never does.
`compile_only()` (see _compile.py) runs the same code paths with CPU tensors and no launches, so
every GEMM kernel can be compiled on a machine without a GPU (QUACK_ARCH=90).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import reference
from ..cute_limits import need, need_exp_vocab, need_inner, need_rope_head_dim, need_swiglu_width
from ..declare import STAT_TILE_N, STRIP_COLS
from ..library import cute_impl
from ..tile_configs import tables
from . import _epilogues as E
from ._launch import cfg_for, colvec, compiling_only, empty, gemm, need_bf16, rowvec, sink_cols, sink_rows, stat_cols

tables()  # a bad $CODA_TILE_CONFIGS table fails when the backend loads, before any GPU work


@cute_impl("embedding_backward")
def embedding_backward(acc: Tensor, tokens: Tensor, g_x: Tensor) -> None:
    """(E') the row gradients scatter-added into the fp32 table gradient, in place (Triton kernel)."""
    from ._elementwise import embedding_backward as impl

    impl(acc, tokens, g_x)


@cute_impl("embedding_rmsnorm_partial")
def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(E) gather, round, h and the row's sum of squares in one pass (Triton kernel)."""
    from ._elementwise import embedding_rmsnorm_partial as impl

    return impl(tokens, emb, gamma, dtype)


@cute_impl("rstd_from_partials")
def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """(F4) one launch (Triton kernel): twice per block, so torch's four-kernel chain was launch-bound."""
    from ._elementwise import rstd_from_partials as impl

    return impl(sumsq_partials, dim, eps)


@cute_impl("rmsnorm_backward_coeff")
def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """(B2) one launch (Triton kernel), as rstd_from_partials."""
    from ._elementwise import rmsnorm_backward_coeff as impl

    return impl(stat_partials, r, dim)


def need_rope_table(op: str, rope: Tensor, M: int) -> None:
    """The (M, head_dim) fp32 cos/sin table the RoPE epilogue and the RoPE backward read."""
    need(rope.dim() == 2 and rope.shape[0] == M and rope.dtype == torch.float32,
         f"{op}: the RoPE table must be (M={M}, head_dim) float32, got {tuple(rope.shape)} {rope.dtype}")


# ---- forward ------------------------------------------------------------------------------

@cute_impl("gemm_rowscale_rope", gpu_blind_compile=True)
def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, rope: Tensor, n_rope_cols: int) -> Tensor:
    """(F1) one launch over every column with the row-scale + RoPE epilogue (reading the
    (M, head_dim) cos/sin table), the rotation masked off past n_rope_cols (the v columns)."""
    M, K = h.shape
    N = w.shape[0]
    hd = rope.shape[1]
    need_bf16("gemm_rowscale_rope", h=h, w=w)
    need_inner("gemm_rowscale_rope", K=K, N=N)
    need_rope_table("gemm_rowscale_rope", rope, M)
    need(n_rope_cols % hd == 0 and 0 <= n_rope_cols <= N,
         f"gemm_rowscale_rope: n_rope_cols={n_rope_cols} must be a multiple of head_dim={hd} within N={N}")
    need_rope_head_dim("gemm_rowscale_rope", hd)
    out = empty(M, N, dtype=h.dtype, device=h.device)
    gemm(E.rowscale_rope, h, w, out, cfg=cfg_for("gemm_rowscale_rope", M, N, K),
         epi={"cs": rope.contiguous(), "r": colvec(r), "rot": _rotated_columns(N, n_rope_cols, h.device)})
    return out


@functools.lru_cache(maxsize=64)
def _rotated_columns(N: int, n_rope_cols: int, device: torch.device) -> Tensor:
    """(1, N) fp32: 1 on the first n_rope_cols columns, 0 after; made once per (N, n_rope_cols,
    device), outside any step (a per-call mask would add launches)."""
    mask = torch.zeros(1, N, dtype=torch.float32, device=device)
    mask[:, :n_rope_cols] = 1.0
    return mask


@cute_impl("gemm_residual_rmsnorm_partial", gpu_blind_compile=True)
def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(F3, F6) x = residual + a W^T (bf16), h = x*gamma, per-N-tile partials of x^2."""
    M, K = a.shape
    N = w.shape[0]
    need_bf16("gemm_residual_rmsnorm_partial", a=a, w=w, residual=residual)
    need_inner("gemm_residual_rmsnorm_partial", K=K, N=N)
    cfg = cfg_for("gemm_residual_rmsnorm_partial", M, N, K)
    x = empty(M, N, dtype=a.dtype, device=a.device)
    h = empty(M, N, dtype=a.dtype, device=a.device)
    sumsq, sumsq_tiles = stat_cols(M, N, cfg, a.device)
    gemm(E.residual_rmsnorm_partial, a, w, x, C=residual.contiguous(), cfg=cfg,
         epi={"h": h, "gamma": rowvec(gamma), "sumsq": sumsq_tiles})
    return x, h, sumsq


@cute_impl("gemm_rowscale_swiglu", gpu_blind_compile=True)
def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """(F5) [gate | up] = r * h W^T, stored: gate and a = silu(gate) * up (not up: B1 recovers what it
    needs of it from a). The weight is read through quack's concat_layout view, which pairs gate row j
    with up row j inside the kernel (no weight copy, no reordering)."""
    M, K = h.shape
    N2 = w_gate_up.shape[0]
    need_bf16("gemm_rowscale_swiglu", h=h, w_gate_up=w_gate_up)
    need_swiglu_width("gemm_rowscale_swiglu", N2)
    need_inner("gemm_rowscale_swiglu", K=K)
    gate = empty(M, N2 // 2, dtype=h.dtype, device=h.device)
    a = empty(M, N2 // 2, dtype=h.dtype, device=h.device)
    gemm(E.rowscale_swiglu, h, w_gate_up, None, concat=("B",), cfg=cfg_for("gemm_rowscale_swiglu", M, N2, K),
         epi={"gate": gate, "a": a, "r": colvec(r)})
    return gate, a


def _lse_target(op: str, program, h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor,
                logits: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(H) the logits GEMM with per-N-tile online (max, sum-exp) partials and the target logit in
    the epilogue (and the logits stored when `logits` is given); the (M, n_tiles) partials fold
    with one tiny logsumexp, so any tile_N."""
    M, K = h.shape
    V = w_lm.shape[0]
    need_bf16(op, h=h, w_lm=w_lm)
    need_inner(op, K=K, V=V)
    cfg = cfg_for(op, M, V, K)
    lse_part = sink_cols(M, V, cfg, h.device)
    target_logit = empty(M, dtype=torch.float32, device=h.device)
    gemm(program, h, w_lm, logits, cfg=cfg,
         epi={"r": colvec(r), "lse": lse_part, "target_logit": target_logit,
              "target": targets.reshape(1, -1).contiguous()})
    if compiling_only():
        return lse_part, target_logit
    return torch.logsumexp(lse_part, dim=-1), target_logit


@cute_impl("gemm_rowscale_cross_entropy", gpu_blind_compile=True)
def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(H, evaluation) lse and target logit only: no logits written."""
    return _lse_target("gemm_rowscale_cross_entropy", E.rowscale_lse_target, h, r, w_lm, targets, None)


@cute_impl("gemm_rowscale_exp_cross_entropy", gpu_blind_compile=True)
def gemm_rowscale_exp_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor,
                                    targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(H, training) the logits GEMM storing e = 2^t, t = y log2e - k, with one offset k per (row, N
    tile), sums of e and e*t per N tile, and the target logit, all from the epilogue. A tile wider than the
    declared 128-column group gives each of its groups its offset and puts its sums in its first
    group (zeros in the others): the same loss and gradient (docs/design.md, "The LM head")."""
    M, K = h.shape
    V = w_lm.shape[0]
    op = "gemm_rowscale_exp_cross_entropy"
    need_bf16(op, h=h, w_lm=w_lm)
    need_inner(op, K=K)
    need_exp_vocab(op, V)
    cfg = cfg_for(op, M, V, K)
    need(V % cfg.tile_N == 0, f"{op}: vocab_size={V} is not a multiple of the tile config's tile_N={cfg.tile_N} "
         f"(one offset per N tile); tune this shape again (scripts/tune_gemm.py) or use a 128-wide config")
    e = empty(M, V, dtype=h.dtype, device=h.device)
    k, sum_exp, sum_exp_t = (empty(M, V // cfg.tile_N, dtype=torch.float32, device=h.device) for _ in range(3))
    target_logit = empty(M, dtype=torch.float32, device=h.device)
    gemm(E.rowscale_exp_target, h, w_lm, e, cfg=cfg,
         epi={"k": cfg.tile_N, "k_out": k, "r": colvec(r), "sum_exp": sum_exp, "sum_exp_t": sum_exp_t,
              "target_logit": target_logit, "target": targets.reshape(1, -1).contiguous()})
    return (e, *reference.exp_stats_per_group(k, sum_exp, sum_exp_t, cfg.tile_N // STAT_TILE_N), target_logit)


@cute_impl("cross_entropy_exp_backward")
def cross_entropy_exp_backward(e: Tensor, k: Tensor, sum_exp: Tensor, sum_exp_t: Tensor, target_logit: Tensor,
                               targets: Tensor, r: Tensor, h: Tensor,
                               grad_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(H') two Triton launches on per-row numbers: the loss, v, S, hs and the target fix (one row a
    program), then the strip (64 x 64 blocks, transposed). No pass over e."""
    from ._elementwise import cross_entropy_exp_backward as impl

    return impl(e, k, sum_exp, sum_exp_t, target_logit, targets, r, h, grad_scale)


@cute_impl("attention")
def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(F2) FlashAttention 4 forward (causal, GQA) on head views of the fused qkv rows."""
    from ._attention import attention_fwd

    return attention_fwd(qkv, n_heads, n_kv_heads, seq_len)


# ---- backward -----------------------------------------------------------------------------

@cute_impl("attention_backward")
def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    """(B5) FlashAttention 4 backward, dq/dk/dv written into column slices of one (M, qkv_dim)."""
    from ._attention import attention_bwd

    return attention_bwd(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len)


@cute_impl("attention_rope_backward_rowscale_stat")
def attention_rope_backward_rowscale_stat(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, r: Tensor, rope: Tensor,
                                          n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(B5, B6a) FlashAttention 4 backward whose fp32 accumulators a CuTeDSL pass over the head groups
    (q, k, v; one launch for those that share a thread layout) turns into r * RoPE^-1(g_qkv) and the
    statistic's per-head partials, in place of FA4's fp32 -> bf16 conversions (no bf16 g_qkv in between)."""
    from ._attention import attention_rope_bwd

    need_rope_table("attention_rope_backward_rowscale_stat", rope, qkv.shape[0])
    return attention_rope_bwd(g_o, qkv, o, lse, r, rope, n_heads, n_kv_heads, seq_len)


@cute_impl("gemm_dswiglu_rowscale_stat", gpu_blind_compile=True)
def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gate: Tensor, a: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """(B1) g_a = g_out W_down with the dSwiGLU epilogue reading F5's gate and a (two tile loads) and
    writing r*g_gate / r*g_up into the halves of one (M, 2F) buffer; no D store."""
    M, d = g_out.shape
    F = w_down.shape[1]
    need_bf16("gemm_dswiglu_rowscale_stat", g_out=g_out, w_down=w_down, gate=gate, a=a)
    need_inner("gemm_dswiglu_rowscale_stat", K=d, ffn_dim=F)
    for name, t in (("gate", gate), ("a", a)):
        need(tuple(t.shape) == (M, F), f"gemm_dswiglu_rowscale_stat: {name} must be (M, ffn_dim)=({M}, {F}), got {tuple(t.shape)}")
    cfg = cfg_for("gemm_dswiglu_rowscale_stat", M, F, d)
    g_gu = empty(M, 2 * F, dtype=g_out.dtype, device=g_out.device)
    stat, stat_tiles = stat_cols(M, F, cfg, g_out.device)
    gemm(E.dswiglu_rowscale_stat, g_out, w_down.mT, None, cfg=cfg,
         epi={"gate": gate.contiguous(), "a": a.contiguous(), "r": colvec(r), "g_gate": g_gu[:, :F],
              "g_up": g_gu[:, F:], "stat": stat_tiles})
    return g_gu, stat


@cute_impl("gemm_rmsnorm_backward", gpu_blind_compile=True)
def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Tensor, x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """(B3, B6b) acc = g_y_scaled W; epilogue g_x = residual_grad + gamma*acc + c*x and
    per-M-tile partials of g_gamma (folded by one column-sum launch)."""
    from ._elementwise import column_sum

    M, Nout = g_y_scaled.shape
    d = w.shape[1]
    need_bf16("gemm_rmsnorm_backward", g_y_scaled=g_y_scaled, w=w, x=x, residual_grad=residual_grad)
    need_inner("gemm_rmsnorm_backward", K=Nout, d=d)
    cfg = cfg_for("gemm_rmsnorm_backward", M, d, Nout)
    g_x = empty(M, d, dtype=x.dtype, device=x.device)
    g_gamma = sink_rows(M, d, cfg, x.device)  # folded below: any tile_M
    gemm(E.rmsnorm_backward, g_y_scaled, w.mT, g_x, C=residual_grad.contiguous(), cfg=cfg,
         epi={"x": x.contiguous(), "gamma": rowvec(gamma), "coef": colvec(c), "g_gamma": g_gamma})
    if compiling_only():
        return g_x, g_gamma
    return g_x, column_sum(g_gamma)


def _zero_padded(t: Tensor, size: int, dim: int = 0) -> Tensor:
    """t (contiguous) with zeros appended along `dim` up to `size`: the strip GEMMs need the dgrad's
    rows a multiple of its tile and the weight gradient's token axis whole 64-wide K tiles."""
    if t.shape[dim] == size:
        return t.contiguous()
    out = t.new_zeros(*t.shape[:dim], size, *t.shape[dim + 1:])
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _need_strip(op: str, e: Tensor, strip: Tensor) -> tuple[int, int]:
    M, V = e.shape
    need_bf16(op, e=e, strip=strip)
    need_exp_vocab(op, V)
    need(tuple(strip.shape) == (V // STRIP_COLS, M),
         f"{op}: strip must be (V/{STRIP_COLS}, M) = ({V // STRIP_COLS}, {M}), got {tuple(strip.shape)}")
    return M, V


@cute_impl("gemm_exp_rmsnorm_backward", gpu_blind_compile=True)
def gemm_exp_rmsnorm_backward(e: Tensor, strip: Tensor, v: Tensor, w: Tensor, x: Tensor, gamma: Tensor,
                              c: Tensor) -> tuple[Tensor, Tensor]:
    """(H'') the strip applied to e in the mainloop (per row and 64-wide K tile), the RMSNorm backward
    with the row factor v in the epilogue. Rows pad to the 128-row tile (a copy, only for a chunk
    whose row count is not a multiple of 128)."""
    from ._elementwise import column_sum

    op = "gemm_exp_rmsnorm_backward"
    M, V = _need_strip(op, e, strip)
    d = w.shape[1]
    need_bf16(op, w=w, x=x)
    need_inner(op, d=d)
    cfg = cfg_for(op, M, d, V)
    Mp = -(-M // cfg.tile_M) * cfg.tile_M
    g_x = empty(Mp, d, dtype=x.dtype, device=x.device)
    g_gamma = sink_rows(Mp, d, cfg, x.device)
    pad = lambda t: _zero_padded(t, Mp)  # noqa: E731
    gemm(E.rowscale_rmsnorm_backward, pad(e), w.mT, g_x, cfg=cfg,
         strip=(E.strip_scale_rows, _zero_padded(strip, Mp, dim=1)),
         epi={"x": pad(x), "gamma": rowvec(gamma), "coef": colvec(pad(c.float())), "v": colvec(pad(v.float())),
              "g_gamma": g_gamma})
    if compiling_only():
        return g_x[:M], g_gamma
    return g_x[:M], column_sum(g_gamma)


def _matmul_tn_exp(op: str, acc: Optional[Tensor], e: Tensor, strip: Tensor, hs: Tensor) -> Tensor:
    """acc (+)= (strip (x) e)^T hs: A = e^T (vocab rows, the strip per 64 of them), K = the chunk's
    token rows (the strip's token axis padded to whole 64-wide K tiles)."""
    M, V = _need_strip(op, e, strip)
    d = hs.shape[1]
    need_bf16(op, hs=hs)
    need_inner(op, d=d)
    cfg = cfg_for(op, V, d, M)
    u = _zero_padded(strip, -(-M // STRIP_COLS) * STRIP_COLS, dim=1)
    out = acc if acc is not None else empty(V, d, dtype=torch.float32, device=e.device)
    gemm(E.plain, e.mT, hs.mT, out, cfg=cfg, epi={}, add_to_output=acc is not None, strip=(E.strip_scale_cols, u))
    return out


@cute_impl("matmul_tn_exp", gpu_blind_compile=True)
def matmul_tn_exp(e: Tensor, strip: Tensor, hs: Tensor) -> Tensor:
    """(H'') the LM head's weight gradient of a chunk, fp32, the strip applied in the mainloop."""
    return _matmul_tn_exp("matmul_tn_exp", None, e, strip, hs)


@cute_impl("matmul_tn_exp_add", gpu_blind_compile=True)
def matmul_tn_exp_add(acc: Tensor, e: Tensor, strip: Tensor, hs: Tensor) -> None:
    """(H'') acc += the chunk's weight gradient through the TMA reduce-add store (no load of acc)."""
    need(acc.dtype == torch.float32 and tuple(acc.shape) == (e.shape[1], hs.shape[1]) and acc.is_contiguous(),
         f"matmul_tn_exp_add: acc (updated in place) must be a contiguous float32 (V, d) = ({e.shape[1]}, {hs.shape[1]}) "
         f"tensor, got {tuple(acc.shape)} {acc.dtype}{'' if acc.is_contiguous() else ' non-contiguous'}")
    need(compiling_only() or acc.device == e.device, f"matmul_tn_exp_add: acc must be on {e.device}, got {acc.device}")
    _matmul_tn_exp("matmul_tn_exp_add", acc, e, strip, hs)


@cute_impl("scale_in_place")
def scale_in_place(t: Tensor, scale: Tensor) -> None:
    """(H'') t *= scale (Triton kernel); every program returns at once when scale is 1, so an
    unaccumulated step pays one launch, not a pass over the V x d gradient."""
    from ._elementwise import scale_in_place as impl

    impl(t, scale)


# ---- plain GEMMs ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _result_dtype(reference_fn, dtype: torch.dtype) -> torch.dtype:
    """The output dtype the reference gives for inputs of `dtype` (traced on meta tensors)."""
    x = torch.empty(1, 1, dtype=dtype, device="meta")
    return reference_fn(x, x).dtype


def _cublas(op: str, a: Tensor, b: Tensor) -> Tensor:
    """The op on cuBLAS: bf16 weight gradients accumulate and land in fp32 directly (mm's out_dtype);
    anything else runs the reference (which is torch's GEMM)."""
    if op == "matmul_tn" and a.dtype == b.dtype == torch.bfloat16:
        return torch.mm(a.t(), b, out_dtype=torch.float32)
    return getattr(reference, op)(a, b)


def _plain_gemm(op: str, a: Tensor, b: Tensor, A: Tensor, B: Tensor, m: int, n: int, k: int) -> Tensor:
    """The GEMM D (m, n) = A B^T of reference op `op` on a, b: cuBLAS unless the tile table names a
    quack config for this shape and the inputs are 2-D bf16 rows (TMA); D gets the reference's
    dtype (fp32 where it promotes)."""
    cfg = cfg_for(op, m, n, k)
    quack_ok = all(t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(-1) == 1 and t.shape[1] % 8 == 0
                   for t in (a, b))
    ref = getattr(reference, op)
    if compiling_only() and (cfg is None or not quack_ok):
        return torch.empty(m, n, dtype=_result_dtype(ref, a.dtype))  # nothing to compile: cuBLAS
    if cfg is None or not quack_ok:
        return _cublas(op, a, b)
    need_bf16(op, a=a, b=b)
    out = empty(m, n, dtype=_result_dtype(ref, a.dtype), device=a.device)
    gemm(E.plain, A, B, out, cfg=cfg, epi={})
    return out


@cute_impl("matmul", gpu_blind_compile=True)
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """(B4) a @ b: quack's GEMM (identity epilogue) where the tile table says it beats cuBLAS."""
    return _plain_gemm("matmul", a, b, a, b.mT, a.shape[0], b.shape[1], a.shape[1])


@cute_impl("matmul_tn", gpu_blind_compile=True)
def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    """Weight gradient a^T @ b over the token rows, in fp32: as matmul, A and B read through
    transposed views."""
    return _plain_gemm("matmul_tn", a, b, a.mT, b.mT, a.shape[1], b.shape[1], a.shape[0])


# ---- inference ----------------------------------------------------------------------------

@cute_impl("gemm_rowscale", gpu_blind_compile=True)
def gemm_rowscale(h: Tensor, r: Tensor, w: Tensor) -> Tensor:
    """(L) y = r * h W^T: the `rowscale` epilogue over the whole output."""
    M, K = h.shape
    N = w.shape[0]
    need_bf16("gemm_rowscale", h=h, w=w)
    need_inner("gemm_rowscale", K=K, N=N)
    out = empty(M, N, dtype=h.dtype, device=h.device)
    gemm(E.rowscale, h, w, out, cfg=cfg_for("gemm_rowscale", M, N, K), epi={"r": colvec(r)})
    return out

