"""The CODA op set as torch.library custom ops: `torch.ops.coda.<name>` for every name in OPS.

Each op is one opaque node for the dispatcher, so torch.compile, fake tensors (FakeTensorMode,
make_fx) and CUDA graph capture see it without tracing into quack / FlashAttention:

  default kernel = reference.py (plain torch, any device), adapted to the op contract below;
  CUDA kernel    = the cute implementation, registered by coda_train/kernels/cute when it loads;
  fake kernel    = exact output shapes and dtypes from the input shapes.

Op contract on top of reference.py (shapes must not depend on the backend):
  * Partial-sum outputs of a GEMM epilogue have one column per N tile of STAT_TILE_N columns
    (the cute tile width), plus one for the CE backward's one-hot term; consumers only sum over
    them. The default kernel puts the reference's row sum in column 0 and zeros elsewhere.
  * gemm_cross_entropy_backward takes grad_scale as a 0-dim tensor (a schema has no
    `float | Tensor`); the Python function of the same name here accepts either.
Every op returns fresh tensors (custom ops may not alias their inputs) and mutates nothing.

Importing this module imports only torch (the reference backend never needs it; cute imports it).
"""

from typing import Callable, Optional

import torch
from torch import Tensor

from . import reference as ref

# Width of the N tile whose per-row partial sums the cute epilogues write (cute CFG_DEFAULT.tile_N).
STAT_TILE_N = 192


def n_stat_cols(n: int) -> int:
    """Number of partial-sum columns of a GEMM epilogue over n output columns."""
    return (n + STAT_TILE_N - 1) // STAT_TILE_N


def _stat_dtype(t: Tensor) -> torch.dtype:
    """Row statistics: fp32, fp64 stays fp64 (reference._f)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _spread(row_sums: Tensor, n_cols: int) -> Tensor:
    """(M, 1) row sums as (M, n_cols) partials: the sum in column 0, zeros elsewhere."""
    return torch.cat((row_sums, row_sums.new_zeros(row_sums.shape[0], n_cols - 1)), dim=1)


# ---- forward ------------------------------------------------------------------------------

@torch.library.custom_op("coda::embedding_rmsnorm_partial", mutates_args=())
def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return ref.embedding_rmsnorm_partial(tokens, emb, gamma)


@embedding_rmsnorm_partial.register_fake
def _(tokens, emb, gamma):
    M, d = tokens.numel(), emb.shape[1]
    return emb.new_empty(M, d), emb.new_empty(M, d), emb.new_empty(M, 1, dtype=_stat_dtype(emb))


@torch.library.custom_op("coda::rstd_from_partials", mutates_args=())
def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    return ref.rstd_from_partials(sumsq_partials, dim, eps)


@rstd_from_partials.register_fake
def _(sumsq_partials, dim, eps):
    return sumsq_partials.new_empty(sumsq_partials.shape[0], dtype=_stat_dtype(sumsq_partials))


@torch.library.custom_op("coda::gemm_rowscale_rope", mutates_args=())
def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, cos: Tensor, sin: Tensor, n_rope_cols: int) -> Tensor:
    return ref.gemm_rowscale_rope(h, r, w, cos, sin, n_rope_cols)


@gemm_rowscale_rope.register_fake
def _(h, r, w, cos, sin, n_rope_cols):
    return h.new_empty(h.shape[0], w.shape[0])


@torch.library.custom_op("coda::attention", mutates_args=())
def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    return ref.attention(qkv, n_heads, n_kv_heads, seq_len)


@attention.register_fake
def _(qkv, n_heads, n_kv_heads, seq_len):
    M, W = qkv.shape
    hd = W // (n_heads + 2 * n_kv_heads)
    lse = qkv.new_empty(M // seq_len, n_heads, seq_len, dtype=_stat_dtype(qkv))
    return qkv.new_empty(M, n_heads * hd), lse


@torch.library.custom_op("coda::gemm_residual_rmsnorm_partial", mutates_args=())
def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x, h, sumsq = ref.gemm_residual_rmsnorm_partial(a, w, residual, gamma)
    return x, h, _spread(sumsq, n_stat_cols(w.shape[0]))


@gemm_residual_rmsnorm_partial.register_fake
def _(a, w, residual, gamma):
    M, N = a.shape[0], w.shape[0]
    return a.new_empty(M, N), a.new_empty(M, N), a.new_empty(M, n_stat_cols(N), dtype=_stat_dtype(a))


@torch.library.custom_op("coda::gemm_rowscale_swiglu", mutates_args=())
def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    return ref.gemm_rowscale_swiglu(h, r, w_gate_up)


@gemm_rowscale_swiglu.register_fake
def _(h, r, w_gate_up):
    M, N2 = h.shape[0], w_gate_up.shape[0]
    return h.new_empty(M, N2), h.new_empty(M, N2 // 2)


@torch.library.custom_op("coda::gemm_rowscale_cross_entropy", mutates_args=())
def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    return ref.gemm_rowscale_cross_entropy(h, r, w_lm, targets)


@gemm_rowscale_cross_entropy.register_fake
def _(h, r, w_lm, targets):
    M, dt = h.shape[0], _stat_dtype(h)
    return h.new_empty(M, dtype=dt), h.new_empty(M, dtype=dt)


# ---- backward -----------------------------------------------------------------------------

@torch.library.custom_op("coda::gemm_cross_entropy_backward", mutates_args=())
def _gemm_cross_entropy_backward(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor, lse: Tensor,
                                 grad_scale: Tensor) -> tuple[Tensor, Tensor]:
    g, stat = ref.gemm_cross_entropy_backward(h, r, w_lm, targets, lse, grad_scale)
    return g, _spread(stat, n_stat_cols(w_lm.shape[0]) + 1)  # + the one-hot column of cute


@_gemm_cross_entropy_backward.register_fake
def _(h, r, w_lm, targets, lse, grad_scale):
    M, V = h.shape[0], w_lm.shape[0]
    return h.new_empty(M, V), h.new_empty(M, n_stat_cols(V) + 1, dtype=_stat_dtype(h))


def gemm_cross_entropy_backward(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor, lse: Tensor,
                                grad_scale: float | Tensor) -> tuple[Tensor, Tensor]:
    """torch.ops.coda.gemm_cross_entropy_backward with a float grad_scale made a 0-dim tensor
    (a device fill, not a host copy, so it is allowed inside CUDA graph capture)."""
    if not isinstance(grad_scale, Tensor):
        grad_scale = h.new_full((), float(grad_scale), dtype=torch.float64)
    return _gemm_cross_entropy_backward(h, r, w_lm, targets, lse, grad_scale)


@torch.library.custom_op("coda::gemm_dswiglu_rowscale_stat", mutates_args=())
def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gu: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g_gu, a, stat = ref.gemm_dswiglu_rowscale_stat(g_out, w_down, gu, r)
    return g_gu, a, _spread(stat, n_stat_cols(w_down.shape[1]))


@gemm_dswiglu_rowscale_stat.register_fake
def _(g_out, w_down, gu, r):
    M, F = g_out.shape[0], w_down.shape[1]
    return g_out.new_empty(M, 2 * F), g_out.new_empty(M, F), g_out.new_empty(M, n_stat_cols(F), dtype=_stat_dtype(g_out))


@torch.library.custom_op("coda::attention_backward", mutates_args=())
def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    return ref.attention_backward(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len)


@attention_backward.register_fake
def _(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


@torch.library.custom_op("coda::rope_backward_rowscale_stat", mutates_args=())
def rope_backward_rowscale_stat(g_qkv: Tensor, qkv: Tensor, r: Tensor, cos: Tensor, sin: Tensor,
                                n_rope_cols: int) -> tuple[Tensor, Tensor]:
    return ref.rope_backward_rowscale_stat(g_qkv, qkv, r, cos, sin, n_rope_cols)


@rope_backward_rowscale_stat.register_fake
def _(g_qkv, qkv, r, cos, sin, n_rope_cols):
    M, N = g_qkv.shape
    return g_qkv.new_empty(M, N), g_qkv.new_empty(M, 1, dtype=_stat_dtype(g_qkv))


@torch.library.custom_op("coda::rmsnorm_backward_coeff", mutates_args=())
def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    return ref.rmsnorm_backward_coeff(stat_partials, r, dim)


@rmsnorm_backward_coeff.register_fake
def _(stat_partials, r, dim):
    return r.new_empty(r.shape[0], dtype=torch.promote_types(r.dtype, _stat_dtype(stat_partials)))


@torch.library.custom_op("coda::gemm_rmsnorm_backward", mutates_args=())
def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Optional[Tensor], x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    return ref.gemm_rmsnorm_backward(g_y_scaled, w, residual_grad, x, gamma, c)


@gemm_rmsnorm_backward.register_fake
def _(g_y_scaled, w, residual_grad, x, gamma, c):
    M, d = g_y_scaled.shape[0], w.shape[1]
    return x.new_empty(M, d), x.new_empty(d, dtype=_stat_dtype(x))


@torch.library.custom_op("coda::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor) -> Tensor:
    return ref.matmul(a, b)


@matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("coda::matmul_tn", mutates_args=())
def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    return ref.matmul_tn(a, b)


@matmul_tn.register_fake
def _(a, b):
    return a.new_empty(a.shape[1], b.shape[1])


@torch.library.custom_op("coda::embedding_backward", mutates_args=())
def embedding_backward(tokens: Tensor, g_x: Tensor, vocab_size: int) -> Tensor:
    return ref.embedding_backward(tokens, g_x, vocab_size)


@embedding_backward.register_fake
def _(tokens, g_x, vocab_size):
    return g_x.new_empty(vocab_size, g_x.shape[1])


# ---- backend wiring -----------------------------------------------------------------------

def dispatched(name: str) -> Callable:
    """The reference-signature callable of op `name` that goes through torch.ops.coda."""
    return globals()[name]


def register_cuda_kernel(name: str, kernel: Callable) -> None:
    """Make `kernel` (same signature, grad_scale as a tensor) the CUDA kernel of coda::<name>."""
    torch.library.register_kernel(f"coda::{name}", "cuda", kernel)

