"""Activation-sized elementwise work that no GEMM epilogue can see, as Triton passes:
- the RoPE backward (inverse rotation of the q/k gradient pairs, row scale, and the attention-norm
  statistic sum_k g*qkv), after FlashAttention's backward (one row per program, pairs loaded as
  (n/2, 2) blocks);
- the cross-entropy gradient of one chunk of stored logits (softmax - onehot, row scale, and the
  final-norm statistic sum_k g*y), which needs the row's full logsumexp before any of its columns
  (one row per program, looping over the vocabulary in blocks), written over the logits.
No torch fallback: the cute backend runs on an sm_90 GPU (need_bf16 rejects CPU tensors),
compile_only() returns before the launch, and reference.py's functions are the oracle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..cute_limits import need
from ._launch import compiling_only, empty, need_bf16


@triton.jit
def _rope_bwd_kernel(g_ptr, y_ptr, r_ptr, cs_ptr, out_ptr, stat_ptr,
                     N, HALF, N_ROPE, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)  # pair index within the row
    lane = tl.arange(0, 2)
    cols = j[:, None] * 2 + lane[None, :]
    mask = cols < N
    base = row.to(tl.int64) * N
    g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    stat = tl.sum(tl.sum(g * y, axis=1), axis=0)
    g0, g1 = tl.split(g)
    i = j % HALF
    rot = (j * 2) < N_ROPE
    cs = cs_ptr + row.to(tl.int64) * (2 * HALF) + 2 * i  # (cos, sin) of pair i at row's columns (2i, 2i+1)
    c = tl.load(cs, mask=rot, other=1.0)
    s = tl.load(cs + 1, mask=rot, other=0.0)
    r = tl.load(r_ptr + row)
    out = tl.join((g0 * c + g1 * s) * r, (g1 * c - g0 * s) * r)
    tl.store(out_ptr + base + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(stat_ptr + row, stat)


# Launch shapes of the two passes, swept at the model widths by scripts/bench_elementwise.py on the H200
# (docs/kernels.md): the RoPE pass's warps (empty: 4 up to 2048 columns, else 8), the CE pass's block
# and warps.
ROPE_LAUNCH: dict = {}
CE_LAUNCH = dict(BLOCK=4096, num_warps=4)


def rope_backward_rowscale_stat(g_qkv: Tensor, qkv: Tensor, r: Tensor, rope: Tensor,
                                n_rope_cols: int) -> tuple[Tensor, Tensor]:
    """rope: the (M, head_dim) fp32 table, (cos, sin) of pair i at columns (2i, 2i+1)."""
    M, N = g_qkv.shape
    half = rope.shape[1] // 2
    need_bf16("rope_backward_rowscale_stat", g_qkv=g_qkv, qkv=qkv)
    need(N % 2 == 0 and n_rope_cols % (2 * half) == 0 and n_rope_cols <= N,
         f"rope_backward_rowscale_stat: n_rope_cols={n_rope_cols} must be a multiple of head_dim={2 * half} "
         f"within the (even) width {N}")
    out = empty(*g_qkv.shape, dtype=g_qkv.dtype, device=g_qkv.device)
    stat = empty(M, 1, dtype=torch.float32, device=g_qkv.device)
    if compiling_only():
        return out, stat
    _rope_bwd_kernel[(M,)](
        g_qkv.contiguous(), qkv.contiguous(), r.float().contiguous(), rope.float().contiguous(),
        out, stat, N, half, n_rope_cols,
        BLOCK=triton.next_power_of_2(N // 2), num_warps=ROPE_LAUNCH.get("num_warps", 4 if N <= 2048 else 8))
    return out, stat



@triton.jit
def _ce_bwd_kernel(y_ptr, r_ptr, t_ptr, lse_ptr, scale_ptr, stat_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * N
    lse = tl.load(lse_ptr + row)
    r = tl.load(r_ptr + row)
    t = tl.load(t_ptr + row)
    scale = tl.load(scale_ptr)
    stat = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(y - lse) - (cols == t).to(tl.float32)) * scale
        g = tl.where(mask, g, 0.0)
        stat += g * y
        # in place: this program's own row, each block stored from the values it just loaded
        tl.store(y_ptr + base + cols, (g * r).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(stat_ptr + row, tl.sum(stat, axis=0))


def cross_entropy_backward_rowscale_stat(logits: Tensor, r: Tensor, targets: Tensor, lse: Tensor,
                                         grad_scale: Tensor) -> Tensor:
    """r*g_y written over the logits; grad_scale: a 0-dim tensor, read on the device (no host sync)."""
    M, N = logits.shape
    need_bf16("cross_entropy_backward_rowscale_stat", logits=logits)
    need(logits.is_contiguous(), "cross_entropy_backward_rowscale_stat: logits (overwritten with r*g_y) must be contiguous")
    need(targets.numel() == M and lse.numel() == M and r.numel() == M and grad_scale.numel() == 1,
         f"cross_entropy_backward_rowscale_stat: r, targets and lse need one entry per row ({M}), grad_scale one")
    stat = empty(M, 1, dtype=torch.float32, device=logits.device)
    if compiling_only():
        return stat
    _ce_bwd_kernel[(M,)](
        logits, r.float().contiguous(), targets.reshape(-1).contiguous(), lse.float().contiguous(),
        grad_scale.detach().float().reshape(1), stat, N,
        BLOCK=min(CE_LAUNCH["BLOCK"], triton.next_power_of_2(N)), num_warps=CE_LAUNCH["num_warps"])
    return stat
