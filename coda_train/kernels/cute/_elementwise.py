"""Work that no GEMM epilogue can see, as Triton passes (the RoPE backward is a CuTeDSL pass:
_rope_backward.py). Activation-sized:
- the embedding entry: the gather of each token's row (from the fp32 master table or a bf16
  one), its rounding to the compute dtype, h = x*gamma and the row's sum of squares, in one pass
  (one row per program) where torch took a gather, two casts, a product and a reduction; and its
  backward, each token's gradient row added into the fp32 table gradient with atomics (one row per
  program) where torch took a cast and an index_add_.
Row-sized: the two folds of per-tile partial sums into a row statistic, r (F4) and c (B2), one
launch each where torch's sum-then-map chain takes four or five (at llama3_125m that is ~170
launches a step, each costing more in launch gap than in work); the fold of the per-M-tile partials of
g_gamma into the RMSNorm weight gradient (a column sum); and the cross-entropy gradient of
one chunk from the LM-head GEMM's per-(row, 128-column) offsets and sums (H'): the loss, the row
factor v, the final-norm statistic, hs = v*h and the target column of e (one row per program),
then the strip of powers of two that the dgrad and weight-gradient GEMMs scale e with as they load
it (64 x 64 blocks, stored transposed). No pass over the (rows x vocab) exponentials. In the
LM head's backward, the incoming loss gradient times its gradients, skipped on the device when it is 1.
No torch fallback: the cute backend runs on an sm_90 GPU (need_bf16 rejects CPU tensors),
compile_only() returns before the launch, and reference.py's functions are the oracle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..cute_limits import need, need_embedding_dim
from ..declare import STAT_TILE_N, STRIP_COLS, TRITON_FP_FUSION
from ..reference import MAX_OCTAVES
from ._launch import compiling_only, empty, need_bf16


@triton.jit
def _ce_exp_row_kernel(e_ptr, k_ptr, se_ptr, set_ptr, yt_ptr, t_ptr, r_ptr, h_ptr, scale_ptr,
                       loss_ptr, v_ptr, hs_ptr, stat_ptr, kmax_ptr, V, G, D,
                       GROUP: tl.constexpr, MAX_OCTAVES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """H' per row: L, loss, v, S, hs and the target fix (reference.cross_entropy_exp_backward)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634  # rounded to fp32 as in H's epilogue: t and y_t's share it
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    k = tl.load(k_ptr + row * G + g, mask=gm, other=float("-inf"))
    k_max = tl.max(k, axis=0)
    w = tl.where(gm, tl.exp2(k - k_max), 0.0)
    se = tl.load(se_ptr + row * G + g, mask=gm, other=0.0)
    st = tl.load(set_ptr + row * G + g, mask=gm, other=0.0)
    s = tl.sum(se * w, axis=0)  # the factors come from s, not L, whose size (the largest logit's) would cancel
    L = k_max * LN2 + tl.log(s)
    yt = tl.load(yt_ptr + row)
    t = tl.load(t_ptr + row).to(tl.int64)
    scale = tl.load(scale_ptr)
    v = scale * tl.load(r_ptr + row) / s
    # S in log2 units relative to k_max: no term of the largest logit's size (reference.cross_entropy_exp_backward)
    octaves = tl.where(gm, k - k_max, 0.0)
    stat = scale * LN2 * (tl.sum((st + octaves * se) * w, axis=0) / s - tl.fma(yt, LOG2E, -k_max))
    tl.store(loss_ptr + row, L - yt)
    tl.store(v_ptr + row, v)
    tl.store(stat_ptr + row, stat)
    tl.store(kmax_ptr + row, k_max)
    # the onehot: the target column of e, its group's offset raised to k_max - MAX_OCTAVES if lower
    g_t = t // GROUP
    k_t = tl.load(k_ptr + row * G + g_t)
    k_adj = tl.maximum(k_t, k_max - MAX_OCTAVES)
    fix = (tl.exp(yt - L) - 1.0) * s * tl.exp2(k_max - k_adj)
    if k_adj > k_t:  # the group's other columns are below 2^-MAX_OCTAVES of the row's largest: 0 (one store)
        cols = g_t * GROUP + tl.arange(0, GROUP)
        tl.store(e_ptr + row * V + cols, tl.where(cols == t, fix, 0.0).to(e_ptr.dtype.element_ty), mask=cols < V)
    else:
        tl.store(e_ptr + row * V + t, fix.to(e_ptr.dtype.element_ty))
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        hm = cols < D
        hv = tl.load(h_ptr + row * D + cols, mask=hm, other=0.0).to(tl.float32)
        tl.store(hs_ptr + row * D + cols, (v * hv).to(hs_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _ce_exp_strip_kernel(k_ptr, kmax_ptr, t_ptr, strip_ptr, M, G,
                         GROUP: tl.constexpr, REP: tl.constexpr, MAX_OCTAVES: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """strip[g * REP + i, m] = 2^(k_adj[m, g] - k_max[m]): (BLOCK_M, BLOCK_G) of k, stored transposed."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    gs = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    rm, gmask = rows < M, gs < G
    mask = rm[:, None] & gmask[None, :]
    k = tl.load(k_ptr + rows[:, None].to(tl.int64) * G + gs[None, :], mask=mask, other=0.0)
    k_max = tl.load(kmax_ptr + rows, mask=rm, other=0.0)
    g_t = tl.load(t_ptr + rows, mask=rm, other=0) // GROUP
    k = tl.where(gs[None, :] == g_t[:, None], tl.maximum(k, k_max[:, None] - MAX_OCTAVES), k)
    u = tl.trans(tl.exp2(k - k_max[:, None]).to(strip_ptr.dtype.element_ty))  # (BLOCK_G, BLOCK_M), exact
    smask = gmask[:, None] & rm[None, :]
    for i in tl.static_range(REP):
        tl.store(strip_ptr + (gs[:, None].to(tl.int64) * REP + i) * M + rows[None, :], u, mask=smask)


def cross_entropy_exp_backward(e: Tensor, k: Tensor, sum_exp: Tensor, sum_exp_t: Tensor, target_logit: Tensor,
                               targets: Tensor, r: Tensor, h: Tensor,
                               grad_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """H' on H's per-(row, 128-column group) outputs; e's target columns rewritten in place."""
    M, V = e.shape
    G = k.shape[1]
    D = h.shape[1]
    need_bf16("cross_entropy_exp_backward", e=e, h=h)
    need(e.is_contiguous() and V % STAT_TILE_N == 0 and G == V // STAT_TILE_N,
         f"cross_entropy_exp_backward: e must be contiguous with V a multiple of {STAT_TILE_N} and one offset per "
         f"{STAT_TILE_N} columns, got e {tuple(e.shape)}, k {tuple(k.shape)}")
    need(all(t.shape[0] == M for t in (k, sum_exp, sum_exp_t, target_logit, h)) and targets.numel() == M
         and r.numel() == M and grad_scale.numel() == 1 and sum_exp.shape == sum_exp_t.shape == k.shape,
         f"cross_entropy_exp_backward: k, the sums, target_logit, targets, r and h need one row or entry per row of "
         f"e ({M}), the sums k's shape {tuple(k.shape)}, grad_scale one element")
    dev = e.device
    loss, v, kmax = (empty(M, dtype=torch.float32, device=dev) for _ in range(3))
    stat = empty(M, 1, dtype=torch.float32, device=dev)
    hs = empty(M, D, dtype=h.dtype, device=dev)
    strip = empty(V // STRIP_COLS, M, dtype=e.dtype, device=dev)
    if compiling_only() or not M:
        return loss, strip, v, hs, stat
    t = targets.reshape(-1).contiguous()
    k, sum_exp, sum_exp_t = (x.float().contiguous() for x in (k, sum_exp, sum_exp_t))
    _ce_exp_row_kernel[(M,)](
        e, k, sum_exp, sum_exp_t, target_logit.float().contiguous(), t, r.float().contiguous(), h.contiguous(),
        grad_scale.detach().float().reshape(1), loss, v, hs, stat, kmax, V, G, D,
        GROUP=STAT_TILE_N, MAX_OCTAVES=MAX_OCTAVES, BLOCK_G=triton.next_power_of_2(G), BLOCK_D=1024, num_warps=4,
        enable_fp_fusion=TRITON_FP_FUSION)
    BM, BG = 64, 64
    _ce_exp_strip_kernel[(triton.cdiv(G, BG), triton.cdiv(M, BM))](
        k, kmax, t, strip, M, G, GROUP=STAT_TILE_N, REP=STAT_TILE_N // STRIP_COLS, MAX_OCTAVES=MAX_OCTAVES,
        BLOCK_M=BM, BLOCK_G=BG, num_warps=4, enable_fp_fusion=TRITON_FP_FUSION)
    return loss, strip, v, hs, stat


# ---- row statistics from per-tile partials ----------------------------------------------------

ROWSTAT_BLOCK_M = 64  # rows per program: 256 programs at 16384 rows, one (64, <=128) fp32 block each


@triton.jit
def _row_total(p_ptr, rows, M, P: tl.constexpr, stride: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Sum over the P partial columns of each of `rows` (fp32). P and the row stride are compile-time:
    Triton vectorizes runtime ones only where both are multiples of 16, so the attention side's
    (M, H + 2G) partials (20 at llama3_125m) took scalar loads, 4.8 us against 1.65 now (H200,
    docs/bench/elementwise_partial_sum_folds-2026-12-04.json)."""
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in tl.static_range(0, P, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < M) & (cols[None, :] < P)
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0)
        total += tl.sum(p, axis=1)
    return total


@triton.jit
def _rstd_kernel(s_ptr, r_ptr, M, dim, eps, P: tl.constexpr, stride: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    total = _row_total(s_ptr, rows, M, P, stride, BLOCK_M, BLOCK_P)
    tl.store(r_ptr + rows, tl.rsqrt(total / dim + eps), mask=rows < M)  # F4


@triton.jit
def _coeff_kernel(s_ptr, r_ptr, c_ptr, M, dim, P: tl.constexpr, stride: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr):
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
    """Grid and compile-time arguments: one compiled kernel per (P, row stride), a handful per model."""
    M, P = partials.shape
    return dict(grid=(triton.cdiv(M, ROWSTAT_BLOCK_M),),
                blocks=dict(P=P, stride=partials.stride(0), BLOCK_M=ROWSTAT_BLOCK_M,
                            BLOCK_P=min(128, triton.next_power_of_2(P)), enable_fp_fusion=TRITON_FP_FUSION))


def rstd_from_partials(sumsq_partials: Tensor, dim: int, eps: float) -> Tensor:
    """r = 1/sqrt(sum_P / dim + eps) per row, fp32 (M,)."""
    s = _partials("rstd_from_partials", sumsq_partials)
    M = s.shape[0]
    r = empty(M, dtype=torch.float32, device=s.device)
    launch = _rowstat_launch(s)
    _rstd_kernel[launch["grid"]](s, r, M, float(dim), float(eps), **launch["blocks"])
    return r


def rmsnorm_backward_coeff(stat_partials: Tensor, r: Tensor, dim: int) -> Tensor:
    """c = -(r^2 / dim) * sum_P per row, fp32 (M,)."""
    s = _partials("rmsnorm_backward_coeff", stat_partials)
    M = s.shape[0]
    need(r.numel() == M and r.dtype == torch.float32,
         f"rmsnorm_backward_coeff: r must be float32 with one entry per row ({M}), got {tuple(r.shape)} {r.dtype}")
    c = empty(M, dtype=torch.float32, device=s.device)
    launch = _rowstat_launch(s)
    _coeff_kernel[launch["grid"]](s, r.contiguous(), c, M, float(dim), **launch["blocks"])
    return c


# ---- column sums of per-M-tile partials (the RMSNorm weight gradients) -------------------------

COLSUM_BLOCK_N = 32  # columns per program: 24 programs at d = 768, 64 at 2048, 128 at 4096
COLSUM_BLOCK_R = 64  # partial rows per load: llama3_125m and 1B have 128 M tiles, the 8B slice 64


@triton.jit
def _column_sum_kernel(p_ptr, out_ptr, R, N, stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < R) & (cols[None, :] < N)
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0)
        total += tl.sum(p, axis=0)
    tl.store(out_ptr + cols, total, mask=cols < N)


def column_sum(partials: Tensor) -> Tensor:
    """The (R, N) fp32 per-tile partials summed over R, fp32 (N,): the GEMM epilogues' g_gamma (B6b).
    One launch of N / 32 programs: 2.3 us where torch's .sum(0) took 3.7 at (128, 768) and (128, 2048),
    25 and 36 a step at llama3_125m and 1B (H200, docs/bench/elementwise_partial_sum_folds-2026-12-04.json)."""
    p = _partials("column_sum", partials)
    R, N = p.shape
    out = empty(N, dtype=torch.float32, device=p.device)
    _column_sum_kernel[(triton.cdiv(N, COLSUM_BLOCK_N),)](p, out, R, N, p.stride(0),
                                                          BLOCK_R=COLSUM_BLOCK_R, BLOCK_N=COLSUM_BLOCK_N,
                                                          enable_fp_fusion=TRITON_FP_FUSION)
    return out


# ---- the embedding entry (E) and its backward (E') ----------------------------------------------

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
                                BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8,
                                enable_fp_fusion=TRITON_FP_FUSION)
    return x, h, sumsq


@triton.jit
def _embedding_bwd_kernel(tok_ptr, g_ptr, acc_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    t = tl.load(tok_ptr + row).to(tl.int64)
    g = tl.load(g_ptr + row.to(tl.int64) * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr + t * N + cols, g, mask=mask, sem="relaxed")  # E': acc[token] += g_x row


def embedding_backward(acc: Tensor, tokens: Tensor, g_x: Tensor) -> None:
    """acc[tokens[i]] += g_x[i] in place, fp32, widening g_x on load: one pass of atomic adds where
    torch needed a cast of g_x to fp32 and index_add_ (H200: 39 against 133 us at 125M, 109 against
    330 at 1B and 8B; scripts/bench_elementwise.py). Atomics, so the sum order varies, as index_add_'s."""
    need(g_x.dim() == 2, f"embedding_backward: g_x must be (rows, dim), got shape {tuple(g_x.shape)}")
    M, N = g_x.shape
    need(acc.is_cuda and acc.dtype == torch.float32 and acc.is_contiguous() and acc.dim() == 2 and acc.shape[1] == N,
         f"embedding_backward: acc must be a contiguous (vocab_size, {N}) float32 CUDA tensor, got "
         f"{tuple(acc.shape)} {acc.dtype} on {acc.device}")
    need(g_x.is_cuda and g_x.dtype in (torch.bfloat16, torch.float32),
         f"embedding_backward: g_x must be a bfloat16 or float32 CUDA tensor, got {g_x.dtype} on {g_x.device}")
    tok = tokens.reshape(-1).contiguous()
    need(tok.numel() == M, f"embedding_backward: {tok.numel()} tokens for {M} gradient rows")
    if M and not compiling_only():
        _embedding_bwd_kernel[(M,)](tok, g_x.contiguous(), acc, N, BLOCK=triton.next_power_of_2(N),
                                    num_warps=4 if N <= 2048 else 8, enable_fp_fusion=TRITON_FP_FUSION)


# ---- the LM head's incoming loss gradient (H'') -----------------------------------------------------

@triton.jit
def _scale_kernel(t_ptr, s_ptr, N, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)  # fp32, as the reference: only the product is rounded to t's dtype
    if s != 1.0:  # g_loss = 1 (a step without accumulation): t would be rewritten unchanged
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, N, step):  # a grid of a few per SM, looping
            offs = start + tl.arange(0, BLOCK)
            mask = offs < N
            v = tl.load(t_ptr + offs, mask=mask)
            tl.store(t_ptr + offs, (v.to(tl.float32) * s).to(v.dtype), mask=mask)


def scale_in_place(t: Tensor, scale: Tensor) -> None:
    """t *= scale, read on the device; a pass over t only where scale != 1."""
    need(t.is_cuda and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16),
         f"scale_in_place: t must be a contiguous float32 or bfloat16 CUDA tensor, got {tuple(t.shape)} {t.dtype} "
         f"on {t.device}{'' if t.is_contiguous() else ', non-contiguous'}")
    need(scale.numel() == 1 and scale.device == t.device,
         f"scale_in_place: scale must be one element on {t.device}, got shape {tuple(scale.shape)} on {scale.device}")
    if t.numel() == 0:
        return
    BLOCK = 4096
    sms = torch.cuda.get_device_properties(t.device).multi_processor_count
    grid = min(triton.cdiv(t.numel(), BLOCK), 4 * sms)  # a skipped call costs one wave of programs, not N / BLOCK
    _scale_kernel[(grid,)](t, scale.detach().reshape(1), t.numel(), BLOCK=BLOCK, num_warps=8,
                              enable_fp_fusion=TRITON_FP_FUSION)
