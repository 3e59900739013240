"""Launch plumbing shared by the cute ops: tile configs, operand views, partial-sum buffers,
bf16 input checks (the shape rules are in ../cute_limits.py), and the compile-only mode (GPU-blind compilation of every kernel)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..cute_limits import need


@dataclass(frozen=True)
class Cfg:
    tile_M: int
    tile_N: int
    cluster_M: int = 2
    cluster_N: int = 1
    pingpong: bool = True


# quack's SM90 default (128x192, 2x1 cluster, pingpong) for every program except RoPE, whose
# cos/sin table op needs tile_N to be a multiple or a divisor of head_dim (64 or 128 here).
CFG_DEFAULT = Cfg(128, 192)
CFG_ROPE = Cfg(128, 128)

_compile_only = False
POISON = False  # set by the checks: every output and partial buffer starts as NaN


def empty(*shape: int, dtype: torch.dtype, device) -> Tensor:
    """torch.empty, or NaN-filled when POISON is set (so unwritten tiles show up in checks)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def compiling_only() -> bool:
    return _compile_only


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Run the ops on CPU tensors (any contents) and compile their kernels without launching.
    Needs QUACK_ARCH=90 (and CUTE_DSL_ARCH=sm_90a) set before cutlass/quack are imported. The
    only GPU query left below the compile (the persistent scheduler's SM occupancy) is stubbed."""
    global _compile_only
    import quack.gemm_runtime.host as host

    from quack.epilogue.ops import Scalar

    saved = host.get_max_active_clusters, Scalar._validate_pointer_value
    host.get_max_active_clusters = lambda cluster_size, *a, **k: 132 // cluster_size
    Scalar._validate_pointer_value = lambda self, value: None  # device-pointer scalars on CPU
    _compile_only = True
    try:
        yield
    finally:
        _compile_only = False
        host.get_max_active_clusters, Scalar._validate_pointer_value = saved


def need_bf16(op: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        need(t.dtype == torch.bfloat16,
             f"{op}: the cute backend supports bfloat16 only, got {name}.dtype={t.dtype} "
             "(use kernels.backend=reference for other dtypes)")
        need(t.dim() == 2, f"{op}: {name} must be 2-D (rows, features), got shape {tuple(t.shape)}")
        need(t.stride(-1) == 1, f"{name} must have a contiguous last dimension")
        need(_compile_only or t.is_cuda, f"{op}: {name} must be a CUDA tensor")


def colvec(v: Tensor) -> Tensor:
    """A per-row fp32 vector as the (1, M) column-broadcast operand."""
    return v.detach().reshape(1, -1).to(torch.float32).contiguous()


def rowvec(v: Tensor) -> Tensor:
    """A per-column vector (gamma) as the (1, N) fp32 row-broadcast operand."""
    return v.detach().reshape(1, -1).to(torch.float32).contiguous()


def sink_cols(M: int, N: int, cfg: Cfg, device) -> Tensor:
    """Per-row partials, one per N tile: (M, ceil(N / tile_N)) fp32."""
    return empty(M, -(-N // cfg.tile_N), dtype=torch.float32, device=device)


def sink_rows(M: int, N: int, cfg: Cfg, device) -> Tensor:
    """Per-column partials, one per M tile: (ceil(M / tile_M), N) fp32."""
    return empty(-(-M // cfg.tile_M), N, dtype=torch.float32, device=device)


def gemm(mod, A: Tensor, B: Tensor, D: Optional[Tensor], C: Optional[Tensor] = None, *, epi: dict,
         cfg: Cfg = CFG_DEFAULT, concat: tuple = ()):
    """D = epilogue(A @ B^T) with A (M, K), B (N, K) in any majors (views are fine)."""
    return mod.gemm(
        A, B, D, C, epi_args=epi,
        tile_M=cfg.tile_M, tile_N=cfg.tile_N, cluster_M=cfg.cluster_M, cluster_N=cfg.cluster_N,
        pingpong=cfg.pingpong, persistent=True, concat_layout=concat or None,
        _launch=not _compile_only,
    )
