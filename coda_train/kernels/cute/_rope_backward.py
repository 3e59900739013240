"""(B6a) The RoPE backward as one CuTeDSL pass over the attention gradient where FlashAttention 4's
backward leaves it, in place of FA4's fp32 -> bf16 conversion kernels and a second pass over the
bf16 gradient (docs/design.md, B5-B6a):

  g_y = r * RoPE^-1(g_qkv) on the q/k heads, r * g_qkv on v;   S_a += sum_cols g_qkv * qkv.

One CTA per (tile of rows, a few heads of one group); the groups that share a thread layout (q, k and
v at head_dim 64) run in one launch. The gradient comes from one of two sources:
- FA4's fp32 accumulator of the head (dq; dk, dv under GQA): (B, heads, T_rounded * tile_hd), each
  tile of rows stored in the order its sm90 backward's MMA holds it in registers, which is the order
  FA4's own conversion reads it in: warpgroup w's part of the tile at w * tile / num_wg, the 4-float
  vectors of its thread t at 4 t + 512 i. Every thread loads its accumulator fragment with 16-byte
  loads (a warp reads 512 contiguous bytes) and knows each value's (row, column) from the same
  tiled MMA; a thread holds column pairs (2i, 2i+1) side by side, so the inverse rotation of a pair
  happens in its registers, then FA4's scale (softmax scale for dq and dk, 1 for dv).
- the bf16 gradient FA4 has already written into the output's columns (dk/dv without GQA, or an FA4
  configuration whose accumulator this pass does not read): rewritten in place.
The statistic leaves as one partial per (row, head); a row's columns of one head sit in the four
threads of a quad per warpgroup, summed by shuffles, then stored (or atomically added into a zeroed
buffer where two warpgroups split the head's columns: two addends, so the sum is order-free).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack.compile_utils import make_fake_tensor
from quack.layout_utils import reshape_acc_to_mn


class PassGroup(NamedTuple):
    """One head group of a launch (q, k or v): where its gradient comes from, whether it rotates, and
    how many of its heads a CTA takes."""
    from_accumulator: bool
    rotate: bool
    heads_per_cta: int


MAX_GROUPS = 3  # q, k, v: the head groups one launch can take


class RopeBackwardPass:
    """The pass for one thread layout and up to three head groups (q, k, v) in one launch, each group
    with its own source, FA4 scale and first head: tile_m rows of heads_per_cta heads per CTA (the
    RoPE table's tile and r read once for all of them), num_threads threads in warpgroups laid out
    (atom_m, num_wg / atom_m) over the (tile_m, tile_hd) tile: FA4's dQ or dKV MMA of its sm90
    backward (non-swapped) when reading its accumulator. One launch for the groups that share a
    layout saves the small k and v launches' ramp and tail (docs/kernels.md)."""

    def __init__(self, head_dim: int, tile_m: int, tile_hd: int, num_threads: int, atom_m: int,
                 groups: tuple[PassGroup, ...]):
        num_wg = num_threads // 128
        assert num_threads % 128 == 0 and num_wg % atom_m == 0 and tile_hd == head_dim
        assert tile_m == 64 * atom_m, "one 64-row WGMMA atom per warpgroup along M"
        assert num_wg // atom_m <= 2, "at most two warpgroups share a row: its atomic sum stays order-free"
        assert 1 <= len(groups) <= MAX_GROUPS
        self.head_dim, self.tile_m, self.tile_hd, self.num_threads = head_dim, tile_m, tile_hd, num_threads
        self.num_wg, self.atom = num_wg, (atom_m, num_wg // atom_m)
        self.groups = tuple(PassGroup(*g) for g in groups)

    def _tiled_mma(self) -> cute.TiledMma:
        # The accumulator's thread-value layout: only the C partition matters, not the operand majors.
        return sm90_helpers.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(*self.atom, 1), tiler_mn=(64, self.tile_hd // self.atom[1]))

    @cute.jit
    def __call__(self, mG0: cute.Tensor, mG1: Optional[cute.Tensor], mG2: Optional[cute.Tensor], mQKV: cute.Tensor,
                 mR: cute.Tensor, mRope: cute.Tensor, mOut: cute.Tensor, mStat: cute.Tensor,
                 scale0: Float32, scale1: Float32, scale2: Float32, first0: Int32, first1: Int32, first2: Int32,
                 heads0: Int32, heads1: Int32, heads2: Int32, seq_len: Int32, stream: cuda.CUstream):
        tiled_mma = self._tiled_mma()
        batch = mQKV.shape[0] // seq_len
        heads = (heads0, heads1, heads2)
        # group i's CTAs along grid y start at block_start[i]
        blocks = [heads[i] // self.groups[i].heads_per_cta for i in range(len(self.groups))]
        block_start = [Int32(0), Int32(blocks[0]), Int32(blocks[0] + (blocks[1] if len(blocks) > 1 else 0))]
        self.kernel(mG0, mG1, mG2, mQKV, mR, mRope, mOut, mStat, scale0, scale1, scale2, first0, first1, first2,
                    block_start[1], block_start[2], seq_len, tiled_mma).launch(
            grid=[cute.ceil_div(seq_len, self.tile_m), sum(blocks), batch],
            block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mG0: cute.Tensor, mG1: Optional[cute.Tensor], mG2: Optional[cute.Tensor], mQKV: cute.Tensor,
               mR: cute.Tensor, mRope: cute.Tensor, mOut: cute.Tensor, mStat: cute.Tensor,
               scale0: Float32, scale1: Float32, scale2: Float32, first0: Int32, first1: Int32, first2: Int32,
               start1: Int32, start2: Int32, seq_len: Int32, tiled_mma: cute.TiledMma):
        _, head_block, _ = cute.arch.block_idx()
        _, n_blocks, _ = cute.arch.grid_dim()
        sources, scales, firsts = (mG0, mG1, mG2), (scale0, scale1, scale2), (first0, first1, first2)
        bounds = (Int32(0), start1, start2, n_blocks)  # group i's CTAs along grid y: [bounds[i], bounds[i + 1])
        for i in cutlass.range_constexpr(len(self.groups)):  # the CTA's group, a uniform branch
            if head_block >= bounds[i]:
                if head_block < bounds[i + 1]:
                    self._group(self.groups[i], sources[i], scales[i], firsts[i], head_block - bounds[i], mQKV, mR,
                                mRope, mOut, mStat, seq_len, tiled_mma)

    @cute.jit
    def _group(self, group: cutlass.Constexpr, mG: cute.Tensor, scale: Float32, first_head: Int32, head_block: Int32,
               mQKV: cute.Tensor, mR: cute.Tensor, mRope: cute.Tensor, mOut: cute.Tensor, mStat: cute.Tensor,
               seq_len: Int32, tiled_mma: cute.TiledMma):
        """This CTA's heads of one group: heads head_block * heads_per_cta onward, from first_head."""
        from_accumulator, rotate, heads_per_cta = group
        tidx, _, _ = cute.arch.thread_idx()
        m_block, _, b = cute.arch.block_idx()
        tile = (self.tile_m, self.tile_hd)
        row0 = b * seq_len + m_block * self.tile_m  # the tile's first row among the M token rows
        rows_left = seq_len - m_block * self.tile_m
        thr_mma = tiled_mma.get_slice(tidx)
        # per thread, as (its rows, its columns) views of the tile: a thread holds column pairs side by side
        coord_mn = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor(tile)))
        rope_mn = reshape_acc_to_mn(thr_mma.partition_C(
            cute.local_tile(cute.domain_offset((row0, 0), mRope), tile, (0, 0))))
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C(tile), Float32)
        g_mn = reshape_acc_to_mn(acc)
        n_rows, n_cols = cute.size(g_mn, mode=[0]), cute.size(g_mn, mode=[1])
        by_row = cute.make_layout((n_rows, n_cols), stride=(n_cols, 1))  # a row's values contiguous: vector copies
        y = cute.make_rmem_tensor(by_row, BFloat16)
        cs = cute.make_rmem_tensor(by_row, Float32)
        gb = cute.make_rmem_tensor(by_row, BFloat16)
        o = cute.make_rmem_tensor(by_row, BFloat16)
        r = cute.make_rmem_tensor(n_rows, Float32)
        split_cols = const_expr(self.atom[1] > 1)  # two warpgroups share a row: atomic adds into zeros
        n_elems = self.tile_m * self.tile_hd
        load_acc = cute.make_tiled_copy_tv(  # the accumulator's storage order: 16-byte vectors, thread-major
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout((128, self.num_wg)), cute.make_layout(4)).get_slice(tidx)

        for i in cutlass.range_constexpr(n_rows):
            if coord_mn[i, 0][0] < rows_left:
                r[i] = mR[row0 + coord_mn[i, 0][0]]
                if const_expr(rotate):
                    cute.autovec_copy(rope_mn[i, None], cs[i, None])

        for k in cutlass.range_constexpr(heads_per_cta):
            head = head_block * heads_per_cta + k

            def tile_of(t: cute.Tensor) -> cute.Tensor:  # this head's columns of the CTA's rows of an (M, W) tensor
                return reshape_acc_to_mn(thr_mma.partition_C(
                    cute.local_tile(cute.domain_offset((row0, 0), t), tile, (0, first_head + head))))  # aligned: whole heads

            qkv_mn, out_mn = tile_of(mQKV), tile_of(mOut)
            # Every load of the head before any store: a store to global memory holds back the loads after it.
            if const_expr(from_accumulator):
                g_tile = cute.local_tile(mG[b, head, None], (n_elems,), (m_block,))
                src = load_acc.partition_S(
                    cute.make_tensor(g_tile.iterator, cute.make_layout((n_elems // self.num_wg, self.num_wg))))
                cute.autovec_copy(src, cute.make_tensor(acc.iterator, cute.make_layout(src.shape)))
            for i in cutlass.range_constexpr(n_rows):
                if coord_mn[i, 0][0] < rows_left:
                    cute.autovec_copy(qkv_mn[i, None], y[i, None])
                    if const_expr(not from_accumulator):
                        cute.autovec_copy(out_mn[i, None], gb[i, None])
            for i in cutlass.range_constexpr(n_rows):
                s = Float32(0.0)
                for j in cutlass.range_constexpr(n_cols // 2):
                    if const_expr(from_accumulator):
                        g0, g1 = g_mn[i, 2 * j] * scale, g_mn[i, 2 * j + 1] * scale
                    else:
                        g0, g1 = gb[i, 2 * j].to(Float32), gb[i, 2 * j + 1].to(Float32)
                    s += g0 * y[i, 2 * j].to(Float32) + g1 * y[i, 2 * j + 1].to(Float32)
                    if const_expr(rotate):  # pair (2i, 2i+1) turned back by its angle: (cos, sin) at its columns
                        c, sn = cs[i, 2 * j], cs[i, 2 * j + 1]
                        g0, g1 = g0 * c + g1 * sn, g1 * c - g0 * sn
                    o[i, 2 * j] = (g0 * r[i]).to(BFloat16)
                    o[i, 2 * j + 1] = (g1 * r[i]).to(BFloat16)
                s += cute.arch.shuffle_sync_bfly(s, offset=1)  # the quad that holds this row's columns
                s += cute.arch.shuffle_sync_bfly(s, offset=2)
                row = coord_mn[i, 0][0]
                if row < rows_left:
                    cute.autovec_copy(o[i, None], out_mn[i, None])
                    if tidx % 4 == 0:
                        at = mStat.iterator + cute.crd2idx((row0 + row, first_head + head), mStat.layout)
                        if const_expr(split_cols):
                            cute.arch.atomic_add(at, s)
                        else:
                            cute.make_tensor(at, cute.make_layout(1))[0] = s


# Heads per CTA, the largest of these that divides a launch's heads: swept by scripts/bench_elementwise.py on the H200.
HEADS_PER_CTA = (4, 2, 1)


def heads_per_cta(heads: int) -> int:
    return next(k for k in HEADS_PER_CTA if heads % k == 0)


@functools.lru_cache(maxsize=None)
def compiled(head_dim: int, tile_m: int, tile_hd: int, num_threads: int, atom_m: int, groups: tuple[PassGroup, ...]):
    """The pass compiled for one layout and its head groups (up to three: q, k, v), against symbolic
    shapes (any M, width, heads, batch). Call it with three sources, scales, first heads and head
    counts (None, 1.0, 0, 0 in the slots of groups not launched)."""
    M, W, L, B, P = (cute.sym_int() for _ in range(5))

    def source(group: PassGroup):
        return (make_fake_tensor(Float32, (B, cute.sym_int(), L), divisibility=4) if group.from_accumulator
                else make_fake_tensor(BFloat16, (M, W), divisibility=8))

    sources = [source(PassGroup(*g)) for g in groups] + [None] * (MAX_GROUPS - len(groups))
    return cute.compile(
        RopeBackwardPass(head_dim, tile_m, tile_hd, num_threads, atom_m, groups), *sources,
        make_fake_tensor(BFloat16, (M, W), divisibility=8), make_fake_tensor(Float32, (M,)),
        make_fake_tensor(Float32, (M, head_dim), divisibility=4), make_fake_tensor(BFloat16, (M, W), divisibility=8),
        make_fake_tensor(Float32, (M, P)), *[Float32(1.0)] * MAX_GROUPS, *[Int32(0)] * MAX_GROUPS,
        *[Int32(1)] * MAX_GROUPS, Int32(1), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi")
