"""Attention on FlashAttention 4 (flash_attn.cute): causal GQA forward and backward on head views of
the fused qkv rows. No copies: q/k/v are (B, T, heads, hd) strided views of qkv, o is written in
place as (M, H*hd), and the backward writes dq/dk/dv into the column slices of one (M, qkv_dim)
gradient. FA4's lse is already (B, H, T) fp32 natural-log, the op's layout. In the model's backward
(attention_rope_bwd) FA4 writes no bf16 gradient: the RoPE-backward pass reads its fp32 accumulators."""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..cute_limits import need, need_attention_heads
from ._launch import empty, need_bf16


def _heads(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int, op: str):
    M, W = qkv.shape
    need(W % (n_heads + 2 * n_kv_heads) == 0,
         f"{op}: qkv width {W} must be (n_heads + 2*n_kv_heads) * head_dim")
    hd = W // (n_heads + 2 * n_kv_heads)
    need_attention_heads(op, hd, n_heads, n_kv_heads)
    need(M % seq_len == 0, f"{op}: rows M={M} must be a multiple of seq_len={seq_len}")
    B = M // seq_len
    v4 = qkv.view(B, seq_len, n_heads + 2 * n_kv_heads, hd)
    H, G = n_heads, n_kv_heads
    return B, hd, v4[:, :, :H], v4[:, :, H:H + G], v4[:, :, H + G:]


def attention_fwd(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    need_bf16("attention", qkv=qkv)
    qkv = qkv.contiguous()
    B, hd, q, k, v = _heads(qkv, n_heads, n_kv_heads, seq_len, "attention")
    o = empty(qkv.shape[0], n_heads * hd, dtype=qkv.dtype, device=qkv.device)
    lse = empty(B, n_heads, seq_len, dtype=torch.float32, device=qkv.device)
    out, lse_out, *_ = _flash_attn_fwd(q, k, v, softmax_scale=hd ** -0.5, causal=True, return_lse=True,
                                       out=o.view(B, seq_len, n_heads, hd), lse=lse)
    if out.data_ptr() != o.data_ptr():  # FA4 chose its own buffer (should not happen)
        o.view(B, seq_len, n_heads, hd).copy_(out)
    return o, lse_out


def _fa_backward(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, g: Tensor, n_heads: int, n_kv_heads: int,
                 seq_len: int, op: str) -> None:
    """FlashAttention 4's backward of the causal attention of qkv, dq/dk/dv into the column slices of g."""
    from flash_attn.cute.interface import _flash_attn_bwd

    need_bf16(op, g_o=g_o, qkv=qkv, o=o)
    B, hd, q, k, v = _heads(qkv, n_heads, n_kv_heads, seq_len, op)
    need(tuple(lse.shape) == (B, n_heads, seq_len) and lse.dtype == torch.float32,
         f"{op}: lse must be ({B}, {n_heads}, {seq_len}) float32")
    _, _, dq, dk, dv = _heads(g, n_heads, n_kv_heads, seq_len, op)
    shape = (B, seq_len, n_heads, hd)
    res = _flash_attn_bwd(q, k, v, o.contiguous().view(shape), g_o.contiguous().view(shape), lse.contiguous(),
                          hd ** -0.5, True, dq=dq, dk=dk, dv=dv)
    for want, got in zip((dq, dk, dv), res[:3]):
        if got.data_ptr() != want.data_ptr():
            want.copy_(got)


def attention_bwd(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, n_kv_heads: int,
                  seq_len: int) -> Tensor:
    qkv = qkv.contiguous()
    g = empty(*qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _fa_backward(g_o, qkv, o, lse, g, n_heads, n_kv_heads, seq_len, "attention_backward")
    return g


def attention_rope_bwd(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, r: Tensor, rope: Tensor, n_heads: int,
                       n_kv_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """FlashAttention 4's backward with its fp32 -> bf16 conversions recorded instead of run, then the
    RoPE-backward pass (_rope_backward.py) over each head group (q, k, v) on its recorded
    accumulator, one launch for the groups that share a thread layout; where FA4 wrote a group in
    bf16 itself (dk/dv without GQA), or converts from an accumulator the pass does not read, the pass
    rewrites that bf16 in place. Returns g_y and S_a's per-head partials."""
    op = "attention_rope_backward_rowscale_stat"
    qkv = qkv.contiguous()
    M, W = qkv.shape
    g = empty(M, W, dtype=qkv.dtype, device=qkv.device)  # FA4's bf16 gradient where it writes one; then g_y
    conversions = _fa_backward_recording(g_o, qkv, o, lse, g, n_heads, n_kv_heads, seq_len, op)
    passes = rope_passes(conversions, g, n_heads, n_kv_heads)
    need(not conversions, f"{op}: FlashAttention converted an accumulator this op does not know")
    stat = run_rope_passes(passes, qkv, r, rope, g, seq_len)
    return g, stat


class PassLayout(NamedTuple):
    """A RoPE-backward launch's thread layout: tile_m rows of a head_dim-wide head (tile_hd columns) per
    CTA, num_threads threads in warpgroups atom_m deep along the rows (_rope_backward.RopeBackwardPass)."""
    head_dim: int
    tile_m: int
    tile_hd: int
    num_threads: int
    atom_m: int

    @property
    def split_cols(self) -> bool:
        """The head's columns split over two warpgroups, which share each row (the statistic adds
        atomically, into zeros)."""
        return self.num_threads // 128 > self.atom_m


def in_place_layout(hd: int) -> PassLayout:
    """The pass's own layout where it reads bf16 rows in place: 128 rows, two warpgroups over them."""
    return PassLayout(hd, 128, hd, 256, 2)


class RopePass(NamedTuple):
    """One launch of the RoPE-backward pass: its layout, its source (an FA4 accumulator, or g itself)
    and FA4's scale of it, whether it rotates (q, k) or not (v), and its heads among qkv's."""
    layout: PassLayout
    from_accumulator: bool
    rotate: bool
    source: Tensor
    scale: float
    first_head: int
    heads: int


def rope_passes(conversions: dict[int, dict], g: Tensor, n_heads: int, n_kv_heads: int) -> list[RopePass]:
    """The q, k and v launches for FA4's recorded conversions (each one taken out of `conversions`).
    Where FA4 wrote a group in bf16 itself (dk/dv without GQA), or converts from an accumulator the
    pass does not read (its conversion is run now), the pass rewrites g's bf16 in place."""
    H, G = n_heads, n_kv_heads
    hd = g.shape[1] // (H + 2 * G)
    passes = []
    for first, heads, rotate in ((0, H, True), (H, G, True), (H + G, G, False)):
        call = conversions.pop(g[:, first * hd].data_ptr(), None)
        layout = call and _accumulator_layout(call, hd)
        if call is not None and layout is None:
            _run_conversion(call)
        if layout is not None:
            passes.append(RopePass(layout, True, rotate, call["accum"], float(call["scale"]), first, heads))
        else:
            passes.append(RopePass(in_place_layout(hd), False, rotate, g, 1.0, first, heads))
    return passes


def run_rope_passes(passes: list[RopePass], qkv: Tensor, r: Tensor, rope: Tensor, g: Tensor, seq_len: int) -> Tensor:
    """The passes, g_y into g, in one launch per run of passes that share a layout (q, k and v at
    head_dim 64: one launch); returns S_a's per-head partials (M, heads) fp32 (a column per head up to
    the last one launched: all of them for the op, fewer where a benchmark launches one group)."""
    from ._rope_backward import MAX_GROUPS, PassGroup, compiled, heads_per_cta

    split = any(p.layout.split_cols for p in passes)
    stat = (torch.zeros if split else empty)(qkv.shape[0], max(p.first_head + p.heads for p in passes),
                                             dtype=torch.float32, device=qkv.device)
    r, rope = r.float().contiguous(), rope.float().contiguous()
    for launch in _same_layout_runs(passes):
        groups = tuple(PassGroup(p.from_accumulator, p.rotate, heads_per_cta(p.heads)) for p in launch)
        unused = MAX_GROUPS - len(launch)
        compiled(*launch[0].layout, groups)(
            *[p.source for p in launch], *[None] * unused, qkv, r, rope, g, stat,
            *[p.scale for p in launch], *[1.0] * unused, *[p.first_head for p in launch], *[0] * unused,
            *[p.heads for p in launch], *[0] * unused, seq_len)
    return stat


def _same_layout_runs(passes: list[RopePass]) -> list[list[RopePass]]:
    """passes cut into runs of consecutive passes with one layout: one launch each."""
    runs: list[list[RopePass]] = []
    for p in passes:
        if runs and runs[-1][0].layout == p.layout:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _fa_backward_recording(g_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, g: Tensor, n_heads: int,
                           n_kv_heads: int, seq_len: int, op: str) -> dict[int, dict]:
    """FlashAttention 4's backward into g with its fp32 -> bf16 conversion kernels (dq; dk and dv under
    GQA) recorded instead of run: {data_ptr of the output it would convert into: the call's arguments}."""
    from flash_attn.cute import interface as fa

    convert, calls = fa._bwd_postprocess_convert, {}
    names, defaults = _parameters(convert)

    def record(*args, **kwargs) -> None:
        call = dict(defaults, **dict(zip(names, args)), **kwargs)
        calls[call["output"].data_ptr()] = call

    fa._bwd_postprocess_convert = record
    try:
        _fa_backward(g_o, qkv, o, lse, g, n_heads, n_kv_heads, seq_len, op)
    finally:
        fa._bwd_postprocess_convert = convert
    return calls


# The arguments of FA4's conversion that the plan reads (rope_passes, _accumulator_layout).
CONVERSION_ARGS = frozenset({"accum", "output", "scale", "cu_seqlens", "seqused", "arch", "hdim", "block_size",
                             "num_threads", "atom_layout", "swap_ab", "use_2cta_instrs", "sink_tensors",
                             "hdim_multiple_of", "accum_order", "fake_mode"})


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple[list[str], dict]:
    """fn's parameter names in order and its defaults, read once: Signature.bind took ~15 us a call."""
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params]
    missing = sorted(CONVERSION_ARGS - set(names))
    if missing:
        raise RuntimeError(f"attention_rope_backward_rowscale_stat: FlashAttention 4's _bwd_postprocess_convert has no "
                           f"argument {missing}: not the flash-attn-4 version this op reads (pyproject.toml pins it; "
                           "reinstall that version)")
    return names, {p.name: p.default for p in params if p.default is not p.empty}


def _run_conversion(call: dict) -> None:
    from flash_attn.cute import interface as fa

    fa._bwd_postprocess_convert(**call)


def _accumulator_layout(call: dict, hd: int) -> Optional[PassLayout]:
    """The layout of a recorded conversion whose accumulator the pass reads: FA4's sm90 non-swapped
    MMA layout, one 64-row atom per warpgroup along the rows, at most two warpgroups along the
    columns, the head not padded, no varlen or sink; None otherwise."""
    tile_m, threads, atom_m = call["block_size"], call["num_threads"], call["atom_layout"]
    mult = call["hdim_multiple_of"]
    tile_hd = -(-call["hdim"] // mult) * mult
    readable = (call["arch"] // 10 == 9 and not call["swap_ab"] and call["accum_order"] is None
                and not call["use_2cta_instrs"] and call["cu_seqlens"] is None and call["seqused"] is None
                and call["sink_tensors"] is None and threads % 128 == 0 and (threads // 128) % atom_m == 0
                and threads // 128 // atom_m <= 2
                and tile_m == 64 * atom_m and tile_hd == call["hdim"] == hd and not call["fake_mode"])
    return PassLayout(hd, tile_m, tile_hd, threads, atom_m) if readable else None
