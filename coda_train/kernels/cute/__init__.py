"""The `cute` backend of the CODA op set: quack Hopper GEMM + epilogue programs, FlashAttention 4.

Same names, signatures and semantics as coda_train/kernels/reference.py (the oracle). The epilogue
programs themselves are in _epilogues.py (a few lines each); this module validates inputs, lays
out the operands (vector / tile views, partial-sum buffers), launches, and does the per-row
fix-ups. docs/kernels.md lists, per op, the primitives used and what runs as plain torch.

Supported: bfloat16 activations and weights on an sm_90 GPU; every inner dimension a multiple of 8
(16-byte rows for TMA); any number of token rows M (ragged tiles are predicated in the kernels).
Anything else raises ValueError naming the constraint.

The functions below are registered as the CUDA kernels of the `coda::<op>` custom ops
(../library.py); the names this module exports go through `torch.ops.coda.<op>` while
torch.compile traces and call the kernels directly otherwise (see the wiring at the end), and
`KERNELS` maps each name to the undispatched implementation.

Importing this module imports cutlass, quack and flash_attn; `import coda_train` never does.
`compile_only()` (see _compile.py) runs the same code paths with CPU tensors and no launches, so
every kernel can be compiled on a machine without a GPU (QUACK_ARCH=90).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _epilogues as E
from ._launch import (
    CFG_DEFAULT,
    CFG_ROPE,
    colvec,
    compiling_only,
    empty,
    gemm,
    need,
    need_bf16,
    need_inner,
    rowvec,
    sink_cols,
    sink_rows,
)

__all__ = [
    "embedding_rmsnorm_partial", "rstd_from_partials", "gemm_rowscale_rope", "attention",
    "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy",
    "gemm_cross_entropy_backward", "gemm_dswiglu_rowscale_stat", "attention_backward",
    "rope_backward_rowscale_stat", "rmsnorm_backward_coeff", "gemm_rmsnorm_backward",
    "matmul", "matmul_tn", "embedding_backward",
]


# ---- forward ------------------------------------------------------------------------------

def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(E) plain torch: a gather plus one elementwise pass (not GEMM-adjacent)."""
    x = emb[tokens.reshape(-1)]
    xf = x.float()
    return x, (xf * gamma.float()).to(x.dtype), xf.square().sum(-1, keepdim=True)


def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """(F4) tiny reduction over P partials per row (plain torch)."""
    return torch.rsqrt(sumsq_partials.float().sum(-1) / dim + eps)


_rope_tables: dict = {}


def _rope_table(cos: Tensor, sin: Tensor, M: int) -> Tensor:
    """(M, head_dim) fp32 table, cos at even / sin at odd columns, row m = position m % T.
    M * head_dim * 4 bytes (4 MiB at M=8192, hd=128); cached per (cos, sin, M)."""
    key = (cos.data_ptr(), sin.data_ptr(), cos._version, sin._version, tuple(cos.shape), M, cos.device)
    table = _rope_tables.get(key)
    if table is None:
        T = cos.shape[0]
        table = torch.stack((cos.float(), sin.float()), dim=-1).reshape(T, -1).repeat(M // T, 1)
        if len(_rope_tables) > 16:
            _rope_tables.clear()
        _rope_tables[key] = table
    return table


def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, cos: Tensor, sin: Tensor, n_rope_cols: int) -> Tensor:
    """(F1) two launches over column ranges of one output: [0, n_rope_cols) with the
    row-scale + RoPE epilogue, [n_rope_cols, N) with the row-scale epilogue."""
    M, K = h.shape
    N = w.shape[0]
    T, half = cos.shape
    hd = 2 * half
    need_bf16("gemm_rowscale_rope", h=h, w=w)
    need_inner("gemm_rowscale_rope", K=K, N=N)
    need(M % T == 0, f"gemm_rowscale_rope: rows M={M} must be a multiple of seq_len T=cos.shape[0]={T}")
    need(n_rope_cols % hd == 0 and 0 <= n_rope_cols <= N,
         f"gemm_rowscale_rope: n_rope_cols={n_rope_cols} must be a multiple of head_dim={hd} within N={N}")
    need(hd % 8 == 0 and (128 % hd == 0 or hd % 128 == 0),
         f"gemm_rowscale_rope: head_dim={hd} must divide 128 or be a multiple of it (RoPE table tiling)")
    out = empty(M, N, dtype=h.dtype, device=h.device)
    rv = colvec(r)
    if n_rope_cols:
        table = torch.empty(M, hd, dtype=torch.float32) if compiling_only() else _rope_table(cos, sin, M)
        gemm(E.rowscale_rope, h, w[:n_rope_cols], out[:, :n_rope_cols], cfg=CFG_ROPE, epi={"cs": table, "r": rv})
    if n_rope_cols < N:
        gemm(E.rowscale, h, w[n_rope_cols:], out[:, n_rope_cols:], epi={"r": rv})
    return out


def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(F3, F6) x = residual + a W^T (bf16), h = x*gamma, per-N-tile partials of x^2."""
    M, K = a.shape
    N = w.shape[0]
    need_bf16("gemm_residual_rmsnorm_partial", a=a, w=w, residual=residual)
    need_inner("gemm_residual_rmsnorm_partial", K=K, N=N)
    x = empty(M, N, dtype=a.dtype, device=a.device)
    h = empty(M, N, dtype=a.dtype, device=a.device)
    sumsq = sink_cols(M, N, CFG_DEFAULT, a.device)
    gemm(E.residual_rmsnorm_partial, a, w, x, C=residual.contiguous(),
         epi={"h": h, "gamma": rowvec(gamma), "sumsq": sumsq})
    return x, h, sumsq


def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """(F5) gu = r * h W^T with [gate | up] columns, a = silu(gate) * up. The weight is read
    through quack's concat_layout view, which pairs gate row j with up row j inside the kernel
    (no weight copy, no reordering); gate and up are stored into the two column halves of gu."""
    M, K = h.shape
    N2 = w_gate_up.shape[0]
    need_bf16("gemm_rowscale_swiglu", h=h, w_gate_up=w_gate_up)
    need(N2 % 16 == 0, f"gemm_rowscale_swiglu: 2*ffn_dim={N2} must be a multiple of 16 (ffn_dim multiple of 8)")
    need_inner("gemm_rowscale_swiglu", K=K)
    gu = empty(M, N2, dtype=h.dtype, device=h.device)
    a = empty(M, N2 // 2, dtype=h.dtype, device=h.device)
    F = N2 // 2
    gemm(E.rowscale_swiglu, h, w_gate_up, None, concat=("B",),
         epi={"gate": gu[:, :F], "up": gu[:, F:], "a": a, "r": colvec(r)})
    return gu, a


def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(H) per-N-tile online (max, sum-exp) partials + target logit in the epilogue, no logits
    written; the (M, n_tiles) partials fold with one tiny logsumexp."""
    M, K = h.shape
    V = w_lm.shape[0]
    need_bf16("gemm_rowscale_cross_entropy", h=h, w_lm=w_lm)
    need_inner("gemm_rowscale_cross_entropy", K=K, V=V)
    lse_part = sink_cols(M, V, CFG_DEFAULT, h.device)
    target_logit = empty(M, dtype=torch.float32, device=h.device)
    gemm(E.rowscale_lse_target, h, w_lm, None,
         epi={"r": colvec(r), "lse": lse_part, "target_logit": target_logit,
              "target": targets.reshape(1, -1).contiguous()})
    if compiling_only():
        return lse_part, target_logit
    return torch.logsumexp(lse_part, dim=-1), target_logit


def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(F2) FlashAttention 4 forward (causal, GQA) on head views of the fused qkv rows."""
    from ._attention import attention_fwd

    return attention_fwd(qkv, n_heads, n_kv_heads, seq_len)


# ---- backward -----------------------------------------------------------------------------

def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    """(B5) FlashAttention 4 backward, dq/dk/dv written into column slices of one (M, qkv_dim)."""
    from ._attention import attention_bwd

    return attention_bwd(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len)


def gemm_cross_entropy_backward(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor, lse: Tensor,
                                grad_scale: float | Tensor) -> tuple[Tensor, Tensor]:
    """(H') recompute the logits in the GEMM; epilogue stores r * softmax * grad_scale and the
    partials of sum g*y, and picks each row's target logit; the one-hot term is one element per
    row, fixed up afterwards (M-element scatter, one extra partial column)."""
    M, K = h.shape
    V = w_lm.shape[0]
    need_bf16("gemm_cross_entropy_backward", h=h, w_lm=w_lm)
    need_inner("gemm_cross_entropy_backward", K=K, V=V)
    dev = h.device
    if isinstance(grad_scale, Tensor):
        scale = grad_scale.detach().to(device=dev, dtype=torch.float32).reshape(1).contiguous()
    else:
        scale = torch.full((1,), float(grad_scale), dtype=torch.float32, device=dev)
    g = empty(M, V, dtype=h.dtype, device=dev)
    stat = sink_cols(M, V, CFG_DEFAULT, dev)
    y_t = empty(M, dtype=torch.float32, device=dev)
    rv = colvec(r)
    t = targets.reshape(-1)
    gemm(E.ce_backward_target, h, w_lm, g,
         epi={"r": rv, "lse": colvec(lse), "scale": scale, "stat": stat, "target_logit": y_t,
              "target": t.reshape(1, -1).contiguous()})
    if compiling_only():
        return g, stat
    # one-hot term: g[m, t_m] = (p_t - 1) * s, stat -= s * y_t
    p_t = torch.exp(y_t - lse.float()) * scale
    rows = torch.arange(M, device=dev)
    g[rows, t] = ((p_t - scale) * r.float()).to(g.dtype)
    return g, torch.cat((stat, (-scale * y_t)[:, None]), dim=1)


def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gu: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B1) g_a = g_out W_down with the dSwiGLU epilogue reading the gate/up column halves of gu
    and writing r*g_gate / r*g_up into the halves of one (M, 2F) buffer."""
    M, d = g_out.shape
    F = w_down.shape[1]
    need_bf16("gemm_dswiglu_rowscale_stat", g_out=g_out, w_down=w_down, gu=gu)
    need_inner("gemm_dswiglu_rowscale_stat", K=d, ffn_dim=F)
    need(tuple(gu.shape) == (M, 2 * F), f"gemm_dswiglu_rowscale_stat: gu must be (M, 2*ffn_dim)=({M}, {2 * F})")
    gu = gu.contiguous()
    g_gu = empty(M, 2 * F, dtype=g_out.dtype, device=g_out.device)
    a = empty(M, F, dtype=g_out.dtype, device=g_out.device)
    stat = sink_cols(M, F, CFG_DEFAULT, g_out.device)
    gemm(E.dswiglu_rowscale_stat, g_out, w_down.mT, a,
         epi={"gate": gu[:, :F], "up": gu[:, F:], "r": colvec(r), "g_gate": g_gu[:, :F],
              "g_up": g_gu[:, F:], "stat": stat})
    return g_gu, a, stat


def rope_backward_rowscale_stat(g_qkv: Tensor, qkv: Tensor, r: Tensor, cos: Tensor, sin: Tensor,
                                n_rope_cols: int) -> tuple[Tensor, Tensor]:
    """(B6a) one elementwise pass + row sum (Triton kernel; torch fallback off-GPU)."""
    from ._elementwise import rope_backward_rowscale_stat as impl

    return impl(g_qkv, qkv, r, cos, sin, n_rope_cols)


def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """(B2) tiny reduction over P partials per row (plain torch)."""
    rf = r.float()
    return -(rf * rf / dim) * stat_partials.float().sum(-1)


def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Optional[Tensor], x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """(B3, B6b, H'') acc = g_y_scaled W; epilogue g_x = residual_grad + gamma*acc + c*x and
    per-M-tile partials of g_gamma (folded with one (m_tiles, d) sum)."""
    M, Nout = g_y_scaled.shape
    d = w.shape[1]
    need_bf16("gemm_rmsnorm_backward", g_y_scaled=g_y_scaled, w=w, x=x)
    need_inner("gemm_rmsnorm_backward", K=Nout, d=d)
    g_x = empty(M, d, dtype=x.dtype, device=x.device)
    g_gamma = sink_rows(M, d, CFG_DEFAULT, x.device)
    epi = {"x": x.contiguous(), "gamma": rowvec(gamma), "coef": colvec(c), "g_gamma": g_gamma}
    if residual_grad is None:
        gemm(E.rmsnorm_backward_noresidual, g_y_scaled, w.mT, g_x, epi=epi)
    else:
        need_bf16("gemm_rmsnorm_backward", residual_grad=residual_grad)
        gemm(E.rmsnorm_backward, g_y_scaled, w.mT, g_x, C=residual_grad.contiguous(), epi=epi)
    if compiling_only():
        return g_x, g_gamma
    return g_x, g_gamma.sum(0)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Plain GEMM: cuBLAS (torch.matmul); see docs/kernels.md for quack vs cuBLAS."""
    return a @ b


def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    """Weight gradient a^T b (contraction over tokens): cuBLAS on the transposed view."""
    return a.t() @ b


def embedding_backward(tokens: Tensor, g_x: Tensor, vocab_size: int) -> Tensor:
    """Scatter-add in fp32 (plain torch index_add_)."""
    g = torch.zeros(vocab_size, g_x.shape[1], dtype=torch.float32, device=g_x.device)
    return g.index_add_(0, tokens.reshape(-1), g_x.float()).to(g_x.dtype)


# ---- dispatcher wiring --------------------------------------------------------------------
# The functions above become the CUDA kernels of the coda::<op> custom ops (../library.py). The
# public names call them through torch.ops.coda while torch.compile traces (one opaque op each),
# and directly otherwise: eager calls and CUDA graphs gain nothing from the Python dispatch step.
# Under compile_only() (CPU tensors, no launch) the kernels are called directly too.

from .. import library  # noqa: E402

assert CFG_DEFAULT.tile_N == library.STAT_TILE_N, "library.py's partial-sum widths must follow CFG_DEFAULT"

KERNELS = {name: globals()[name] for name in __all__}  # the undispatched cute implementations


def _through_dispatcher(name: str):
    kernel, op = KERNELS[name], library.dispatched(name)

    def call(*args, **kwargs):
        through_op = torch.compiler.is_compiling() and not compiling_only()
        return op(*args, **kwargs) if through_op else kernel(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = name, name, kernel.__doc__
    return call


for _name, _kernel in KERNELS.items():
    library.register_cuda_kernel(_name, _kernel)
    globals()[_name] = _through_dispatcher(_name)
