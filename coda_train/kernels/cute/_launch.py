"""Launch plumbing shared by the cute ops: the tile config of each launch (the table in
../tile_configs.py), operand views, partial-sum buffers, bf16 input checks (the shape rules are in
../cute_limits.py), and the compile-only mode (GPU-blind compilation of every kernel)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..declare import STRIP_COLS, n_stat_cols
from ..tile_configs import Cfg, gpu_key, lookup

_compile_only = False
_compile_gpu: Optional[str] = None  # the GPU whose table entries compile_only() compiles (None: defaults)
POISON = False  # set by the checks: every output and partial buffer starts as NaN


def empty(*shape: int, dtype: torch.dtype, device) -> Tensor:
    """torch.empty, or NaN-filled when POISON is set (so unwritten tiles show up in checks)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def compiling_only() -> bool:
    return _compile_only


@contextlib.contextmanager
def compile_only(gpu: Optional[str] = None) -> Iterator[None]:
    """Run the ops on CPU tensors (any contents) and compile their kernels without launching, with
    the tile configs of GPU `gpu` (a tile_configs table name, e.g. "H200"; None: the defaults).
    Needs QUACK_ARCH=90 (and CUTE_DSL_ARCH=sm_90a) set before cutlass/quack are imported. The
    only GPU query left below the compile (the persistent scheduler's SM occupancy) is stubbed."""
    global _compile_only, _compile_gpu
    import quack.gemm_runtime.host as host

    saved = host.get_max_active_clusters
    host.get_max_active_clusters = lambda cluster_size, *a, **k: 132 // cluster_size
    _compile_only, _compile_gpu = True, gpu
    try:
        yield
    finally:
        _compile_only, _compile_gpu = False, None
        host.get_max_active_clusters = saved


@functools.lru_cache(maxsize=None)
def _device_gpu(index: int) -> str:
    return gpu_key(torch.cuda.get_device_name(index))


def cfg_for(op: str, M: int, N: int, K: int) -> Optional[Cfg]:
    """The tile config of `op`'s GEMM D (M, N) = A (M, K) B (K, N) on this GPU (compile-only: on
    the GPU compile_only() names); None = cuBLAS (plain GEMMs only). ../tile_configs.py."""
    gpu = _compile_gpu if _compile_only else _device_gpu(torch.cuda.current_device())
    return lookup(op, M, N, K, gpu)


def need_bf16(op: str, **tensors: Tensor) -> None:
    # every op call runs this, so its messages are formatted only on failure: formatted eagerly they took
    # 9 of its 11 us a call with 5 tensors (timeit, CPU), host time an eagerly launched step pays per op
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: the cute backend supports bfloat16 only, got {name}.dtype={t.dtype} "
                             "(use kernels.backend=reference for other dtypes)")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D (rows, features), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        if not (_compile_only or t.is_cuda):
            raise ValueError(f"{op}: {name} must be a CUDA tensor")


def colvec(v: Tensor) -> Tensor:
    """A per-row fp32 vector as the (1, M) column-broadcast operand."""
    return v.detach().reshape(1, -1).to(torch.float32).contiguous()


def rowvec(v: Tensor) -> Tensor:
    """A per-column vector (gamma) as the (1, N) row-broadcast operand, bf16 or fp32 as given: the
    epilogue widens it on load, so the model's bf16 compute copy costs no cast launch per call."""
    v = v.detach().reshape(1, -1)
    return (v if v.dtype in (torch.bfloat16, torch.float32) else v.to(torch.float32)).contiguous()


def sink_cols(M: int, N: int, cfg: Cfg, device) -> Tensor:
    """Per-row partials, one per N tile: (M, ceil(N / tile_N)) fp32."""
    return empty(M, -(-N // cfg.tile_N), dtype=torch.float32, device=device)


def stat_cols(M: int, N: int, cfg: Cfg, device) -> tuple[Tensor, Tensor]:
    """A declared partial-sum output, (M, n_stat_cols(N)) fp32, and its first ceil(N / tile_N)
    columns as the kernel's per-N-tile sink; the columns past the sink are zero (consumers only
    sum them), so any tile_N >= STAT_TILE_N gives the declared width."""
    out = empty(M, n_stat_cols(N), dtype=torch.float32, device=device)
    n_tiles = -(-N // cfg.tile_N)
    assert n_tiles <= out.shape[1], f"tile_N={cfg.tile_N} gives more partial columns than declared"
    if n_tiles < out.shape[1]:
        out[:, n_tiles:].zero_()
    return out, out[:, :n_tiles]


def sink_rows(M: int, N: int, cfg: Cfg, device) -> Tensor:
    """Per-column partials, one per M tile: (ceil(M / tile_M), N) fp32."""
    return empty(-(-M // cfg.tile_M), N, dtype=torch.float32, device=device)


def gemm(mod, A: Tensor, B: Tensor, D: Optional[Tensor], C: Optional[Tensor] = None, *, epi: dict,
         cfg: Cfg, concat: tuple = (), add_to_output: bool = False, strip=None, max_swizzle_size: int = 8):
    """D = epilogue(A @ B^T) with A (M, K), B (N, K) in any majors (views are fine); with
    add_to_output, D += epilogue(A @ B^T) through the TMA reduce-add store (no C load); with
    strip = (transform, u), A is scaled by the strip u as the mainloop loads it (quack's
    register-sourced A transform, K tiles of STRIP_COLS). max_swizzle_size: quack's tile-scheduler
    group (its default 8, the fastest in scripts/epilogue_ablation.py --swizzle)."""
    kw = {}
    if strip is not None:
        from quack.operand_transform.host import transform_a_operand

        transform, u = strip
        A = transform_a_operand(transform, A, {"u": u}, cfg.tile_M, STRIP_COLS)
        kw = dict(transform_a=transform, tile_K=STRIP_COLS)
    return mod.gemm(
        A, B, D, C, epi_args=epi, add_to_output=add_to_output,
        tile_M=cfg.tile_M, tile_N=cfg.tile_N, cluster_M=cfg.cluster_M, cluster_N=cfg.cluster_N,
        pingpong=cfg.pingpong, persistent=True, concat_layout=concat or None, max_swizzle_size=max_swizzle_size,
        _launch=not _compile_only, **kw,
    )
