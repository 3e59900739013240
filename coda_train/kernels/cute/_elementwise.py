"""Work that no GEMM epilogue can see, as Triton passes. Activation-sized:
- the RoPE backward (inverse rotation of the q/k gradient pairs, row scale, and the attention-norm
  statistic sum_k g*qkv), after FlashAttention's backward (one row per program, pairs loaded as
  (n/2, 2) blocks);
- the cross-entropy gradient of one chunk of stored logits (softmax - onehot, row scale, and the
  final-norm statistic sum_k g*y), which needs the row's full logsumexp before any of its columns
  (one row per program, looping over the vocabulary in blocks), written over the logits.
- the embedding entry: the gather of each token's row (from the fp32 master table or a bf16
  one), its rounding to the compute dtype, h = x*gamma and the row's sum of squares, in one pass
  (one row per program) where torch took a gather, two casts, a product and a reduction.
Row-sized: the two folds of per-tile partial sums into a row statistic, r (F4) and c (B2), one
launch each where torch's sum-then-map chain takes four or five (at llama3_125m that is ~170
launches a step, each costing more in launch gap than in work).
No torch fallback: the cute backend runs on an sm_90 GPU (need_bf16 rejects CPU tensors),
compile_only() returns before the launch, and reference.py's functions are the oracle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..cute_limits import need, need_embedding_dim
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


# ---- row statistics from per-tile partials ----------------------------------------------------

ROWSTAT_BLOCK_M = 64  # rows per program: 256 programs at 16384 rows, one (64, <=128) fp32 block each


@triton.jit
def _row_total(p_ptr, rows, M, P, stride, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Sum over the P partial columns of each of `rows` (fp32)."""
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < M) & (cols[None, :] < P)
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0)
        total += tl.sum(p, axis=1)
    return total


@triton.jit
def _rstd_kernel(s_ptr, r_ptr, M, P, stride, dim, eps, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    total = _row_total(s_ptr, rows, M, P, stride, BLOCK_M, BLOCK_P)
    tl.store(r_ptr + rows, tl.rsqrt(total / dim + eps), mask=rows < M)  # F4


@triton.jit
def _coeff_kernel(s_ptr, r_ptr, c_ptr, M, P, stride, dim, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    total = _row_total(s_ptr, rows, M, P, stride, BLOCK_M, BLOCK_P)
    r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
    tl.store(c_ptr + rows, -(r * r / dim) * total, mask=rows < M)  # B2


def _partials(op: str, partials: Tensor) -> Tensor:
    need(partials.dim() == 2 and partials.dtype == torch.float32 and partials.is_cuda,
         f"{op}: the partial sums must be a (rows, P) float32 CUDA tensor, got {tuple(partials.shape)} "
         f"{partials.dtype} on {partials.device}")
    return partials if partials.stride(1) == 1 else partials.contiguous()


def _rowstat_launch(partials: Tensor) -> dict:
    M, P = partials.shape
    return dict(grid=(triton.cdiv(M, ROWSTAT_BLOCK_M),),
                blocks=dict(BLOCK_M=ROWSTAT_BLOCK_M, BLOCK_P=min(128, triton.next_power_of_2(P))))


def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """r = 1/sqrt(sum_P / dim + eps) per row, fp32 (M,)."""
    s = _partials("rstd_from_partials", sumsq_partials)
    M, P = s.shape
    r = empty(M, dtype=torch.float32, device=s.device)
    launch = _rowstat_launch(s)
    _rstd_kernel[launch["grid"]](s, r, M, P, s.stride(0), float(dim), float(eps), **launch["blocks"])
    return r


def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """c = -(r^2 / dim) * sum_P per row, fp32 (M,)."""
    s = _partials("rmsnorm_backward_coeff", stat_partials)
    M, P = s.shape
    need(r.numel() == M and r.dtype == torch.float32,
         f"rmsnorm_backward_coeff: r must be float32 with one entry per row ({M}), got {tuple(r.shape)} {r.dtype}")
    c = empty(M, dtype=torch.float32, device=s.device)
    launch = _rowstat_launch(s)
    _coeff_kernel[launch["grid"]](s, r.contiguous(), c, M, P, s.stride(0), float(dim), **launch["blocks"])
    return c


# ---- the embedding entry ------------------------------------------------------------------------

@triton.jit
def _embedding_kernel(tok_ptr, emb_ptr, gamma_ptr, x_ptr, h_ptr, sumsq_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    t = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(emb_ptr + t * N + cols, mask=mask, other=0.0).to(x_ptr.dtype.element_ty)  # rounded once, as stored
    xf = x.to(tl.float32)
    gamma = tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = row.to(tl.int64) * N + cols
    tl.store(x_ptr + out, x, mask=mask)
    tl.store(h_ptr + out, (xf * gamma).to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(sumsq_ptr + row, tl.sum(xf * xf, axis=0))  # E: one partial column


def embedding_rmsnorm_partial(tokens: Tensor, emb: Tensor, gamma: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """x = emb[tokens] in `dtype`, h = x*gamma, the row sums of x^2 as one partial column."""
    V, N = emb.shape
    need(emb.is_cuda and emb.dtype in (torch.float32, torch.bfloat16) and dtype == torch.bfloat16,
         f"embedding_rmsnorm_partial: needs a float32 or bfloat16 CUDA table and bfloat16 compute, got "
         f"{emb.dtype} on {emb.device} -> {dtype}")
    need_embedding_dim("embedding_rmsnorm_partial", N)
    need(gamma.numel() == N, f"embedding_rmsnorm_partial: gamma needs {N} entries (one per column), got {gamma.numel()}")
    tok = tokens.reshape(-1).contiguous()
    M = tok.numel()
    x = empty(M, N, dtype=dtype, device=emb.device)
    h = empty(M, N, dtype=dtype, device=emb.device)
    sumsq = empty(M, 1, dtype=torch.float32, device=emb.device)
    if M:
        _embedding_kernel[(M,)](tok, emb.contiguous(), gamma.contiguous(), x, h, sumsq, N,
                                BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    return x, h, sumsq
