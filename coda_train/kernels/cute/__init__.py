"""The `cute` backend of the CODA op set: quack Hopper GEMM + epilogue programs, FlashAttention 4.

Same names, signatures and semantics as coda_train/kernels/reference.py (the oracle). The epilogue
programs themselves are in _epilogues.py (a few lines each); this module validates inputs, lays
out the operands (vector / tile views, partial-sum buffers), launches, and does the per-row
fix-ups. docs/kernels.md lists, per op, the primitives used and what runs as plain torch.

Supported: bfloat16 activations and weights on an sm_90 GPU; every inner dimension a multiple of 8
(16-byte rows for TMA); any number of token rows M (ragged tiles are predicated in the kernels).
Anything else raises ValueError naming the constraint; `model_shape_errors(cfg)` lists, before any
work, the constraints a model config would violate (from the same checks).

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

# Plain torch is the right implementation of these on the GPU too (a gather + one elementwise
# pass, two tiny reductions, cuBLAS GEMMs, an fp32 index_add_; see docs/kernels.md), so the cute
# backend uses reference.py's functions rather than copies of them.
from ..reference import (
    embedding_backward,
    embedding_rmsnorm_partial,
    matmul,
    matmul_tn,
    rmsnorm_backward_coeff,
    rstd_from_partials,
)

__all__ = [
    "embedding_rmsnorm_partial", "rstd_from_partials", "gemm_rowscale_rope", "attention",
    "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy",
    "gemm_cross_entropy_backward", "gemm_dswiglu_rowscale_stat", "attention_backward",
    "rope_backward_rowscale_stat", "rmsnorm_backward_coeff", "gemm_rmsnorm_backward",
    "matmul", "matmul_tn", "embedding_backward",
]


# ---- shape constraints shared by the per-call checks and model_shape_errors -------------------

def _need_rope_head_dim(op: str, hd: int) -> None:
    """The RoPE epilogue's cos/sin table tiling (CFG_ROPE.tile_N = 128 columns per tile)."""
    need(hd > 0 and hd % 8 == 0 and (128 % hd == 0 or hd % 128 == 0),
         f"{op}: head_dim={hd} must be a multiple of 8 that divides 128 or is a multiple of 128 "
         "(RoPE table tiling)")


def _need_swiglu_width(op: str, n2: int) -> None:
    """gate and up column halves of gu, each a multiple of 8 columns."""
    need(n2 % 16 == 0, f"{op}: 2*ffn_dim={n2} must be a multiple of 16 (ffn_dim multiple of 8)")


def _need_attention_head_dim(hd: int) -> None:
    """FlashAttention 4's head_dim check (_attention._heads) on a shape-only qkv, 1 q + 1 kv head."""
    from ._attention import _heads

    _heads(torch.empty(1, 3 * hd, device="meta"), 1, 1, 1, "attention")


def _need_attention_gqa(n_heads: int, n_kv_heads: int) -> None:
    """FlashAttention 4's GQA grouping check (_attention._heads) on a shape-only qkv, head_dim 8."""
    from ._attention import _heads

    _heads(torch.empty(1, (n_heads + 2 * n_kv_heads) * 8, device="meta"), n_heads, n_kv_heads, 1, "attention")


def _failures(*checks) -> list[str]:
    """The ValueError messages of the checks (callables raising through `need`) that fail."""
    msgs = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def _head_dim_failures(cfg, hd: int) -> list[str]:
    H, G = cfg.n_heads, cfg.n_kv_heads
    return _failures(lambda: _need_rope_head_dim("gemm_rowscale_rope", hd),
                     lambda: _need_attention_head_dim(hd),
                     lambda: need_inner("gemm_residual_rmsnorm_partial", K=H * hd),   # o-projection
                     lambda: need_inner("gemm_rowscale_rope", N=(H + 2 * G) * hd))   # qkv_dim


def model_shape_errors(cfg) -> list[str]:
    """The constraints of the cute kernels that the model `cfg` (a coda_train.model.LlamaConfig)
    violates, one message per model field to change, naming the field and a fix; [] = supported.

    Each constraint is evaluated by the same check the ops run per call (the `_need_*` helpers
    above, _attention._heads, _launch.need_inner), on the inner dims the model produces: dim,
    head_dim (n_heads*head_dim, qkv_dim), n_kv_heads, ffn_dim (2*ffn_dim), vocab_size. The row
    count M = batch * seq_len is free (ragged tiles are predicated)."""
    fields = ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
    bad = [f for f in fields if not (isinstance(getattr(cfg, f), int) and getattr(cfg, f) > 0)]
    if bad:
        return [f"model.{f}={getattr(cfg, f)!r} must be a positive integer" for f in bad]
    d, H, G, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H
    errors = []

    def report(what: str, msgs: list[str], fix: str) -> None:
        if msgs:
            errors.append(f"{what}: {fix} (cute kernel checks: {'; '.join(msgs)})")

    def next_ok(n: int, failures) -> int:
        while failures(n):
            n += 1
        return n

    dim_fail = lambda n: _failures(lambda: need_inner("gemm_residual_rmsnorm_partial", N=n))  # noqa: E731
    report(f"model.dim={d}", dim_fail(d), "every inner dim of the cute GEMMs must be a multiple of 8; "
           f"choose model.dim={next_ok(d, dim_fail)} or another multiple of 8")

    msgs = _head_dim_failures(cfg, hd)
    if msgs:
        ok = [h for h in range(2, 1025, 2) if not _head_dim_failures(cfg, h)]
        heads = [n for n in range(1, d + 1) if d % n == 0 and d // n in ok]
        fix = (f"model.n_heads in {heads}, with model.n_kv_heads a divisor of it" if heads else
               f"none divides dim={d} so; change model.dim too (e.g. to a multiple of 128)")
        report(f"model.dim={d} with model.n_heads={H} gives head_dim={hd}", msgs,
               f"the cute attention/RoPE kernels need head_dim in {ok} (a multiple of 8 that divides 128 or is "
               f"a multiple of 128, and <= 256 for FlashAttention 4 on sm90); choose model.n_heads so that "
               f"dim/n_heads is one of those: {fix}")

    report(f"model.n_kv_heads={G}", _failures(lambda: _need_attention_gqa(H, G)),
           f"choose model.n_kv_heads a divisor of n_heads={H}")

    ffn_fail = lambda n: _failures(lambda: _need_swiglu_width("gemm_rowscale_swiglu", 2 * n),  # noqa: E731
                                   lambda: need_inner("gemm_dswiglu_rowscale_stat", ffn_dim=n))
    report(f"model.ffn_dim={F}", ffn_fail(F), f"choose model.ffn_dim={next_ok(F, ffn_fail)} or another multiple of 8")

    vocab_fail = lambda n: _failures(lambda: need_inner("gemm_rowscale_cross_entropy", V=n))  # noqa: E731
    report(f"model.vocab_size={V}", vocab_fail(V),
           f"pad the vocabulary: choose model.vocab_size={next_ok(V, vocab_fail)} or another multiple of 8 "
           "(the extra embedding rows are never token ids)")
    return errors


# ---- forward ------------------------------------------------------------------------------

_rope_tables: dict = {}


def _rope_table(cos: Tensor, sin: Tensor, M: int) -> Tensor:
    """(M, head_dim) fp32 table, cos at even / sin at odd columns, row m = position m % T.
    M * head_dim * 4 bytes (4 MiB at M=8192, hd=128); cached per (cos, sin, M). The entry holds
    cos and sin themselves, so their memory (and id) cannot be reused by other tables while cached."""
    key = (id(cos), id(sin), M)
    entry = _rope_tables.get(key)
    if entry is None or entry[0] is not cos or entry[1] is not sin or entry[2] != (cos._version, sin._version):
        T = cos.shape[0]
        table = torch.stack((cos.float(), sin.float()), dim=-1).reshape(T, -1).repeat(M // T, 1)
        if len(_rope_tables) > 16:
            _rope_tables.clear()
        entry = _rope_tables[key] = (cos, sin, (cos._version, sin._version), table)
    return entry[3]


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
    _need_rope_head_dim("gemm_rowscale_rope", hd)
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
    _need_swiglu_width("gemm_rowscale_swiglu", N2)
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
    """(B6a) one elementwise pass + row sum (Triton kernel)."""
    from ._elementwise import rope_backward_rowscale_stat as impl

    return impl(g_qkv, qkv, r, cos, sin, n_rope_cols)


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
