"""The CODA op set: one signature per op, two implementations.

`reference` (reference.py) is plain torch on any device and dtype, the numerical oracle.
`cute` (cute/) runs each op as one quack GEMM + epilogue program (or FlashAttention 4, or a tiny
reduction) on Hopper; it is imported only when selected, so CPU machines never need a GPU stack.
The model calls ops only through the functions below, so switching backends changes no model code.
Rows are tokens (M = batch * seq_len, row-major); d = model dim; shapes in reference.py.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..errors import ConfigError
from . import reference

BACKENDS = ("auto", "reference", "cute")


class BackendError(ConfigError):
    """The requested kernel backend cannot run on this machine."""


_impl: ModuleType = reference


def _load_cute() -> ModuleType:
    if not torch.cuda.is_available():
        raise BackendError("kernels.backend=cute needs a CUDA GPU and none is visible; "
                           "use kernels.backend=reference (or auto) on this machine")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise BackendError(f"kernels.backend=cute needs a Hopper GPU (sm_90), found sm_{major}{minor} "
                           f"({torch.cuda.get_device_name()}); use kernels.backend=reference")
    try:
        return importlib.import_module(".cute", __name__)
    except ImportError as e:
        raise BackendError(f"kernels.backend=cute could not import its kernels ({e}); install the GPU "
                           "packages (pip install -e .) or use kernels.backend=reference") from e


def set_backend(name: str) -> str:
    """Select the op implementation: 'reference', 'cute', or 'auto' (cute on a Hopper GPU where
    its kernels import, else reference). Returns the resolved name."""
    global _impl
    if name not in BACKENDS:
        raise BackendError(f"unknown kernels.backend={name!r}; choose one of {list(BACKENDS)}")
    if name == "auto":
        try:
            _impl = _load_cute()
        except BackendError:
            _impl = reference
    else:
        _impl = reference if name == "reference" else _load_cute()
    return get_backend()


def resolve_backend(name: str) -> str:
    """The backend `name` ('auto', 'reference' or 'cute') runs as on this machine: 'reference' or
    'cute'. Raises BackendError naming the fix when it cannot run here."""
    if name not in BACKENDS:
        raise BackendError(f"unknown kernels.backend={name!r}; choose one of {list(BACKENDS)}")
    if name == "reference":
        return name
    try:
        _load_cute()
        return "cute"
    except BackendError:
        if name == "cute":
            raise
        return "reference"


def get_backend() -> str:
    return _impl.__name__.rsplit(".", 1)[-1]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    previous = get_backend()
    try:
        yield set_backend(name)
    finally:
        set_backend(previous)


# ---- forward (docs/design.md, F1..F6, E, H) ------------------------------------------------

def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x = emb[tokens], h = x*gamma, partial sums of x^2 (M, P)."""
    return _impl.embedding_rmsnorm_partial(tokens, emb, gamma)


def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """r = rsqrt(sum(partials)/dim + eps), fp32 (M,)."""
    return _impl.rstd_from_partials(sumsq_partials, dim, eps)


def gemm_rowscale_rope(h: Tensor, r: Tensor, w: Tensor, cos: Tensor, sin: Tensor, n_rope_cols: int) -> Tensor:
    """qkv = RoPE(r * h @ w^T) on columns [0, n_rope_cols)."""
    return _impl.gemm_rowscale_rope(h, r, w, cos, sin, n_rope_cols)


def attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """Causal GQA attention: o (M, n_heads*hd), lse (B, n_heads, T) fp32."""
    return _impl.attention(qkv, n_heads, n_kv_heads, seq_len)


def gemm_residual_rmsnorm_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x = residual + a @ w^T, h = x*gamma, partial sums of x^2."""
    return _impl.gemm_residual_rmsnorm_partial(a, w, residual, gamma)


def gemm_rowscale_swiglu(h: Tensor, r: Tensor, w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """gu = r * h @ w_gate_up^T ([gate | up] columns), a = silu(gate)*up."""
    return _impl.gemm_rowscale_swiglu(h, r, w_gate_up)


def gemm_rowscale_cross_entropy(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits = r * h @ w_lm^T: logsumexp and target logit, fp32 (M,)."""
    return _impl.gemm_rowscale_cross_entropy(h, r, w_lm, targets)


# ---- backward (B1..B6, H') -----------------------------------------------------------------

def gemm_cross_entropy_backward(h: Tensor, r: Tensor, w_lm: Tensor, targets: Tensor, lse: Tensor,
                                grad_scale: float | Tensor) -> tuple[Tensor, Tensor]:
    """r * g_logits (M, V) and the final-norm statistic partials sum_k g_y*y."""
    return _impl.gemm_cross_entropy_backward(h, r, w_lm, targets, lse, grad_scale)


def gemm_dswiglu_rowscale_stat(g_out: Tensor, w_down: Tensor, gu: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """r * g_gu, recomputed a, and the MLP-norm statistic partials sum_k g_gu*gu."""
    return _impl.gemm_dswiglu_rowscale_stat(g_out, w_down, gu, r)


def attention_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                       seq_len: int) -> Tensor:
    """Gradient with respect to the fused qkv rows (M, qkv_dim)."""
    return _impl.attention_backward(g_o, qkv, o, lse, n_heads, n_kv_heads, seq_len)


def rope_backward_rowscale_stat(g_qkv: Tensor, qkv: Tensor, r: Tensor, cos: Tensor, sin: Tensor,
                                n_rope_cols: int) -> tuple[Tensor, Tensor]:
    """r * RoPE^-1(g_qkv) and the attention-norm statistic partials sum_k g_qkv*qkv."""
    return _impl.rope_backward_rowscale_stat(g_qkv, qkv, r, cos, sin, n_rope_cols)


def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """c = -(r^2/dim) * sum(partials), fp32 (M,)."""
    return _impl.rmsnorm_backward_coeff(stat_partials, r, dim)


def gemm_rmsnorm_backward(g_y_scaled: Tensor, w: Tensor, residual_grad: Optional[Tensor], x: Tensor,
                          gamma: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """g_x = residual_grad + gamma * (g_y_scaled @ w) + c*x, and g_gamma (d,) fp32."""
    return _impl.gemm_rmsnorm_backward(g_y_scaled, w, residual_grad, x, gamma, c)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b."""
    return _impl.matmul(a, b)


def matmul_tn(a: Tensor, b: Tensor) -> Tensor:
    """a^T @ b: weight gradients (the contraction runs over tokens)."""
    return _impl.matmul_tn(a, b)


def embedding_backward(tokens: Tensor, g_x: Tensor, vocab_size: int) -> Tensor:
    """Scatter-add row gradients into a (vocab_size, d) table."""
    return _impl.embedding_backward(tokens, g_x, vocab_size)


OPS = ("embedding_rmsnorm_partial", "rstd_from_partials", "gemm_rowscale_rope", "attention",
       "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy",
       "gemm_cross_entropy_backward", "gemm_dswiglu_rowscale_stat", "attention_backward",
       "rope_backward_rowscale_stat", "rmsnorm_backward_coeff", "gemm_rmsnorm_backward",
       "matmul", "matmul_tn", "embedding_backward")
