"""Two epilogues in flight per SM: quack's pingpong GEMM with epilogue buffers per warpgroup.

quack's SM90 pingpong kernel gives each of its two consumer warpgroups its own output tile; their
mainloops take turns on the tensor cores, and so do their epilogues, because both use the same
epilogue shared memory. When the epilogue is longer than the mainloop (K = 768 at llama3_125m:
docs/kernels.md, "What sets an epilogue's pace at K = 768"), one warpgroup's epilogue sets every
tile's period. Here each warpgroup gets its own copy of every epilogue buffer (D store stages, C
and tile-load stages, vector loads, reduction staging), its own epilogue named barrier and its own
half of the tile-load mbarrier ring, so the epilogue turn-taking goes.

The kernel's code is quack's; only these hooks change: the stage split, the shared-memory struct of
the epilogue, the smem views each warpgroup partitions, the load pipeline it is handed, and the
two pingpong "epi" barriers (no-ops). The tile-load ring keeps quack's running index, which skips
the other warpgroup's tile: each warpgroup's half has a depth that divides the subtiles of a tile
an even number of times, so a skip of one tile leaves its slot and phase where they were.

`enable()` patches quack's classes in this process, before any GEMM compiles; quack's kernel cache
does not see the patch, so a process that enables it must use a kernel cache of its own
(QUACK_CACHE_DIR). scripts/epilogue_stages.py times it (variants two, two2), and compiles the step's
kernels GPU-blind with it, printing each kernel's stage split:

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/epilogue_stages.py --variant two --child compile --shapes 125m

Measured on the H200 (2026-12-03) and not adopted: outputs bitwise equal, dSwiGLU up to 6 % faster
at 125M, the 125M step 0.8 %, 1B's dSwiGLU slower; the waits move to the epilogue's tile loads
(docs/kernels.md, "Two epilogues in flight, measured and not adopted").
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.pipeline import PipelineState

WG_THREADS = 128


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _warp_group() -> Int32:
    """This thread's consumer warpgroup, 0 or 1 (the load warpgroup also gets 1: it only forms the
    addresses of the epilogue's buffers, never touches them)."""
    tidx, _, _ = cute.arch.thread_idx()
    wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
    return wg - wg // 2 * (wg - 1)  # min(wg, 1)


def ring_depth(subtiles: int, at_most: int) -> int:
    """Tile-load stages per warpgroup: the deepest d <= at_most with subtiles / d an even integer
    (so that skipping the other warpgroup's tile moves neither slot nor phase); 0 if there is none."""
    return max((d for d in range(1, at_most + 1) if subtiles % d == 0 and (subtiles // d) % 2 == 0), default=0)


@dataclass(frozen=True)
class WarpGroupBarrier:
    """The epilogue's named barrier, one id per consumer warpgroup (quack's EpiWG0 and EpiWG1 ids,
    free once the epilogues no longer take turns). Frozen: the kernel's loops carry it read-only."""

    base_id: int
    num_threads: int = WG_THREADS

    def arrive_and_wait(self, *, loc=None, ip=None) -> None:
        cute.arch.barrier(barrier_id=self.base_id + _warp_group(), number_of_threads=WG_THREADS, loc=loc, ip=ip)

    def arrive(self, *, loc=None, ip=None) -> None:
        cute.arch.barrier_arrive(barrier_id=self.base_id + _warp_group(), number_of_threads=WG_THREADS, loc=loc, ip=ip)


@dataclass(frozen=True)
class WarpGroupRing:
    """quack's tile-load pipeline over 2 x depth mbarriers, warpgroup w using [w*depth, (w+1)*depth):
    every call translates the running state to this warpgroup's half (buffers are per warpgroup
    already, so the state's own index still selects the stage of its buffers)."""

    ring: object
    depth: int

    def _own(self, state):
        return PipelineState(2 * self.depth, state.count, state.index + _warp_group() * self.depth, state.phase)

    def producer_acquire(self, state, *args, **kwargs):
        return self.ring.producer_acquire(self._own(state), *args, **kwargs)

    def producer_commit(self, state, *args, **kwargs):
        return self.ring.producer_commit(self._own(state), *args, **kwargs)

    def producer_get_barrier(self, state, *args, **kwargs):
        return self.ring.producer_get_barrier(self._own(state), *args, **kwargs)

    def consumer_wait(self, state, *args, **kwargs):
        return self.ring.consumer_wait(self._own(state), *args, **kwargs)

    def consumer_release(self, state, *args, **kwargs):
        return self.ring.consumer_release(self._own(state), *args, **kwargs)


_enabled = False


def enable(max_ring: int = 4) -> None:
    """Patch quack's SM90 GEMM (pingpong kernels only) and its epilogue mixin for two epilogues in
    flight, each warpgroup's tile-load ring at most `max_ring` stages deep."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    import quack.sm90_utils as quack_sm90_utils
    from cutlass.cute.nvgpu import cpasync
    from quack.epilogue.mixin import ComposableEpiMixin
    from quack.epilogue.ops import Scalar
    from quack.gemm_base import NamedBarrierGemm
    from quack.gemm_sm90 import GemmSm90

    s2g = (cpasync.CopyBulkTensorTileS2GOp, cpasync.CopyReduceBulkTensorTileS2GOp)
    quack_init, quack_setup = GemmSm90.__init__, GemmSm90._setup_attributes
    quack_stages = GemmSm90._compute_stages.__func__
    quack_sync, quack_arrive = GemmSm90.pingpong_barrier_sync, GemmSm90.pingpong_barrier_arrive
    quack_r2s, quack_s2r = GemmSm90.epilog_smem_store_and_partition, GemmSm90.epilog_smem_load_and_partition
    quack_gmem = GemmSm90.epilog_gmem_copy_and_partition
    quack_epi_ring = GemmSm90.make_epi_pipeline
    quack_struct, quack_tensors = ComposableEpiMixin.epi_get_smem_struct, ComposableEpiMixin.epi_get_smem_tensors
    splitting = {"two": False, "fallback": False}

    def __init__(self, *args, **kwargs):
        quack_init(self, *args, **kwargs)
        self.two_epilogues = bool(self.pingpong)
        if self.two_epilogues:
            self.quack_epilogue_barrier = self.epilogue_barrier
            self.epilogue_barrier = WarpGroupBarrier(int(NamedBarrierGemm.EpiWG0))

    def pingpong_barrier_sync(self, warp_group_idx, stage):
        if stage == "mma" or not self.two_epilogues:
            quack_sync(self, warp_group_idx, stage)

    def pingpong_barrier_arrive(self, warp_group_idx, stage):
        if stage == "mma" or not self.two_epilogues:
            quack_arrive(self, warp_group_idx, stage)

    def _compute_stages(cls, tile, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args, smem_capacity,
                        occupancy, warp_shape_mnk=None, a_bytes_per_stage_override=None, ab_extra_bytes_per_stage=0):
        def quack_split():
            return quack_stages(cls, tile, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args,
                                smem_capacity, occupancy, warp_shape_mnk, a_bytes_per_stage_override,
                                ab_extra_bytes_per_stage)

        if not splitting["two"]:
            return quack_split()
        # quack's base depths per warpgroup (store: 2 stages of 32-wide subtiles; loads: an even
        # divisor of the subtile count, at most quack's base); both copies first, A/B from the rest
        subtiles = tile[0] * tile[1] // cute.size(cute.shape(epi_tile))
        elems = cute.size(cute.shape(epi_tile))
        op = cls.epi_smem_bytes(epilogue_args, tile, epi_tile, warp_shape_mnk)
        epi = min(subtiles, 4 if epi_tile[1] <= 16 else 2)
        loads = c_dtype is not None or op.c_stage > 0
        ring = ring_depth(subtiles, min(subtiles, max_ring)) if loads else 0
        if loads and ring == 0:  # no even split of the ring: this kernel keeps quack's turn-taking
            splitting["fallback"] = True
            return quack_split()
        d_bytes = elems * d_dtype.width // 8 if d_dtype is not None else 0
        c_bytes = elems * c_dtype.width // 8 if c_dtype is not None else 0
        op_bytes = op.unstaged + op.d_stage * epi + op.c_stage * ring
        # sD and sC (1024-aligned stages), and the ops' struct per warpgroup (one pad after its small fields)
        epi_bytes = 2 * (d_bytes * epi + c_bytes * ring) + (2 * (_round_up(op_bytes, 1024) + 1024) if op_bytes else 0)
        a_bytes = a_bytes_per_stage_override or tile[0] * tile[2] * a_dtype.width // 8
        ab_bytes = a_bytes + tile[1] * tile[2] * b_dtype.width // 8 + ab_extra_bytes_per_stage
        reserved = 2048 + (1024 if ab_extra_bytes_per_stage % 1024 else 0)  # mbarriers and scheduler; alignment
        ab = (smem_capacity // occupancy - reserved - epi_bytes) // ab_bytes
        return ab, epi, ring

    def _setup_attributes(self, epilogue_args):
        splitting["two"] = self.two_epilogues
        try:
            quack_setup(self, epilogue_args)
            fallback = splitting["fallback"]
        finally:
            splitting["two"] = splitting["fallback"] = False
        if fallback:
            self.two_epilogues = False
            self.epilogue_barrier = self.quack_epilogue_barrier
        if self.two_epilogues:  # sD and sC hold both warpgroups' stages: [wg0's | wg1's]
            if self.d_dtype is not None:
                self.epi_smem_layout_staged = quack_sm90_utils.make_smem_layout_epi(
                    self.d_dtype, self.d_layout, self.epi_tile, 2 * self.epi_stage)
            if self.c_dtype is not None:
                self.epi_c_smem_layout_staged = quack_sm90_utils.make_smem_layout_epi(
                    self.c_dtype, self.c_layout, self.epi_tile, 2 * self.epi_c_stage)

    def _own_stages(s, stages):
        """s (M, N, 2 x stages) from this warpgroup's first stage on."""
        return cute.domain_offset((0, 0, _warp_group() * stages), s)

    def _is_both(self, s, dtype, stages):
        return (self.two_epilogues and dtype is not None and s is not None and cute.rank(s) == 3
                and s.element_type == dtype and cute.size(s, mode=[2]) == 2 * stages)

    def epilog_smem_store_and_partition(self, tiled_mma, d_layout, dtype, sD, tidx):
        if const_expr(_is_both(self, sD, self.d_dtype, self.epi_stage)):
            sD = _own_stages(sD, self.epi_stage)
        return quack_r2s(self, tiled_mma, d_layout, dtype, sD, tidx)

    def epilog_smem_load_and_partition(self, tiled_mma, c_layout, dtype, sC, tRS_rD_layout, tidx):
        if const_expr(_is_both(self, sC, self.c_dtype, self.epi_c_stage)):
            sC = _own_stages(sC, self.epi_c_stage)
        return quack_s2r(self, tiled_mma, c_layout, dtype, sC, tRS_rD_layout, tidx)

    def epilog_gmem_copy_and_partition(self, atom, mD_mn, tile_shape_mn, epi_tile, s, tile_coord_mnkl):
        # sD (stores) and sC (loads) hold both warpgroups' stages; the epilogue ops' buffers are per
        # warpgroup already (epi_get_smem_tensors)
        store = isinstance(atom.op, s2g)
        dtype, stages = (self.d_dtype, self.epi_stage) if store else (self.c_dtype, self.epi_c_stage)
        if const_expr(_is_both(self, s, dtype, stages)):
            s = _own_stages(s, stages)
        return quack_gmem(self, atom, mD_mn, tile_shape_mn, epi_tile, s, tile_coord_mnkl)

    def make_epi_pipeline(self, tx_count):
        if not self.two_epilogues:
            return quack_epi_ring(self, tx_count)
        depth = self.epi_c_stage
        self.epi_c_stage = 2 * depth  # the mbarriers of both halves
        try:
            ring = quack_epi_ring(self, tx_count)
        finally:
            self.epi_c_stage = depth
        return WarpGroupRing(ring, depth)

    def _own_struct(self, params):
        fields = [f for f in (op.smem_struct_field(self, params) for op in self._epi_ops) if f is not None]
        # smallest first, as quack packs it: the small 16-byte-aligned vectors share one pad
        fields.sort(key=lambda f: cute.struct(type("F", (), {"__annotations__": {f[0]: f[1]}})).size_in_bytes())
        return cute.struct(type("EpiOwnStorage", (), {"__annotations__": dict(fields)})) if fields else None

    def epi_get_smem_struct(self, params):
        own = _own_struct(self, params) if self.two_epilogues else None
        if own is None:
            return quack_struct(self, params)
        both = {"wg0": cute.struct.Align[own, 1024], "wg1": cute.struct.Align[own, 1024]}
        return cute.struct(type("EpiTwoStorage", (), {"__annotations__": both}))

    def epi_get_smem_tensors(self, params, storage):
        own = _own_struct(self, params) if self.two_epilogues else None
        if own is None:
            return quack_tensors(self, params, storage)
        stride = _round_up(own.__sizeof__(), max(1024, own.__alignof__()))
        mine = own((storage.epi.wg0.base + _warp_group() * stride).align(1024))
        return {op.name: op.get_smem_tensor(self, params, mine) for op in self._epi_ops if not isinstance(op, Scalar)}

    GemmSm90.__init__ = __init__
    GemmSm90.pingpong_barrier_sync = pingpong_barrier_sync
    GemmSm90.pingpong_barrier_arrive = pingpong_barrier_arrive
    GemmSm90._compute_stages = classmethod(_compute_stages)
    GemmSm90._setup_attributes = _setup_attributes
    GemmSm90.epilog_smem_store_and_partition = epilog_smem_store_and_partition
    GemmSm90.epilog_smem_load_and_partition = epilog_smem_load_and_partition
    GemmSm90.epilog_gmem_copy_and_partition = epilog_gmem_copy_and_partition
    GemmSm90.make_epi_pipeline = make_epi_pipeline
    ComposableEpiMixin.epi_get_smem_struct = epi_get_smem_struct
    ComposableEpiMixin.epi_get_smem_tensors = epi_get_smem_tensors
