"""A warp-specialized epilogue: one MMA warpgroup, two epilogue warpgroups, the accumulator between them
in shared memory (docs/kernels.md, "What is left: a warp-specialized epilogue kernel").

quack's SM90 pingpong kernel gives each of its two consumer warpgroups a whole tile: mainloop, then
epilogue, the two warpgroups' epilogues taking turns. When the epilogue is longer than the mainloop
(dSwiGLU at K = 768), one warpgroup's epilogue sets every tile's period. Here a 128 x N pingpong
kernel (N <= 128) is rebuilt with four warpgroups instead of three:

  warps 0-7    two epilogue warpgroups: quack's cooperative epilogue (64 rows each, one 128 x 32
               subtile of the tile at a time), every accumulator subtile read from shared memory
  warps 8-11   the load warpgroup: warp 8 issues the A/B TMA loads and runs the tile scheduler
  warps 12-15  one MMA warpgroup: the mainloop on the whole 128 x N tile (quack's pingpong MMA),
               then its accumulator to shared memory, and on to the next tile's mainloop

so the period is about max(mainloop, epilogue / 2) + the accumulator's hand-over, against pingpong's
max(mainloop, epilogue). The hand-over buffer holds the tile in the epilogue warps' register order:
element v of cooperative thread T at v * 256 + T, so MMA thread t writes its fragment's row block m
as cooperative thread m * 128 + t (the 64-row WGMMA atoms of the two thread layouts are the same),
and a warp's 32 threads touch 32 consecutive words each access. Two named barriers pass it: FULL
(the MMA warpgroup arrives, the epilogue warpgroups wait) and EMPTY (the reverse); a 4-word slot
beside it carries the tile's coordinates (valid = 0 ends the epilogue warps' loop).

The buffer (tile_M x tile_N fp32, 64 KB at 128 x 128) comes out of quack's stage split, whose load
stages here start from 2 (scripts/ws_smem_budget.py: 3 A/B stages of 32 KB remain at 128 x 128).
Registers: load warpgroup 24, MMA warpgroup 200, epilogue warpgroups 144 each (65536 in all).

`enable()` patches quack's classes in this process, before any GEMM compiles; quack's kernel cache does
not see the patch, so a process that enables it must use a kernel cache of its own (QUACK_CACHE_DIR).
scripts/epilogue_stages.py runs it as variant `ws` (the ops alone at the shipped tile configs,
outputs against ship's, and the step):

    python scripts/epilogue_stages.py --shapes 125m --variants ship,ws --step 125m

Measured on one H100 (2026-12-07, docs/kernels.md "What is left") and not adopted: outputs bitwise equal to
ship's, dSwiGLU at 125M 0.1550 against 0.1523 ms, RoPE 0.0744 against 0.0638; the 3 A/B stages the buffer leaves
cost the bare mainloop 25 % (scripts/ws_smem_budget.py --time).
"""

from __future__ import annotations

import types
from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental import primitives as prims
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import SmemPartition

import quack.copy_utils as copy_utils
import quack.sm90_utils as quack_sm90_utils
from quack.pipeline import make_pipeline_state
from quack.varlen_utils import VarlenManager

WG = 128  # threads a warpgroup
EPI_THREADS = 2 * WG  # the two epilogue warpgroups, threads 0-255
LOAD_WARP = 8  # the A/B TMA warp (and the tile scheduler's)
MMA_WARP0 = 12  # the MMA warpgroup's first warp
BAR_FULL, BAR_EMPTY = 9, 10  # named barrier ids past quack's (NamedBarrierGemm ends at 8)
REGS_LOAD, REGS_MMA, REGS_EPI = 24, 200, 144  # 128 * (24 + 200 + 2 * 144) = 65536
LOAD_STAGE_BASE = 2  # the epilogue's first load stages (quack's base is 4): one more A/B stage

_enabled = False


def eligible(tile_shape_mnk, pingpong: bool, a_dtype, kwargs: dict) -> bool:
    """The kernels this rebuilds: 128 x N pingpong (N <= 128), 16-bit A, none of quack's A transforms,
    gathers or split-K (their paths are not written here)."""
    return (pingpong and tile_shape_mnk[0] == 128 and tile_shape_mnk[1] <= 128 and a_dtype.width == 16
            and kwargs.get("transform_a") is None and not kwargs.get("mma_is_rs", False)
            and not kwargs.get("gather_A", False) and kwargs.get("split_k", 1) == 1)


class _TilesDone:
    """What quack's epilogue reads of its tile scheduler: the tiles this CTA finished (stochastic-rounding
    seeds count subtiles with it)."""

    def __init__(self, num_tiles_executed: Int32):
        self.num_tiles_executed = num_tiles_executed


def enable() -> None:
    """Patch quack's SM90 GEMM: every eligible pingpong kernel compiled in this process from now on is
    the warp-specialized one."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    from quack.gemm_sm90 import GemmSm90

    quack_init, quack_setup = GemmSm90.__init__, GemmSm90._setup_attributes
    quack_sched = GemmSm90.make_sched_pipeline
    quack_stages = GemmSm90._compute_stages.__func__

    def __init__(self, acc_dtype, a_dtype, tile_shape_mnk, cluster_shape_mnk, pingpong=False, *args, **kwargs):
        ws = eligible(tile_shape_mnk, pingpong, a_dtype, kwargs)
        # cooperative: quack sets up the epilogue (atom layout 2 x 1, 8 epilogue warps, their barrier)
        quack_init(self, acc_dtype, a_dtype, tile_shape_mnk, cluster_shape_mnk, False if ws else pingpong, *args, **kwargs)
        self.ws = ws
        if ws:
            self.threads_per_cta = 4 * WG
            self.kernel = types.MethodType(ws_kernel, self)

    def _setup_attributes(self, epilogue_args):
        if not self.ws:
            return quack_setup(self, epilogue_args)
        reserve = self.cta_tile_shape_mnk[0] * self.cta_tile_shape_mnk[1] * 4 + 16  # the buffer and its slot

        def stages(tile, epi_tile, a, b, d, c, args, capacity, *rest, **kw):
            saved, GemmSm90.epi_c_stage_base = GemmSm90.epi_c_stage_base, LOAD_STAGE_BASE
            try:
                return quack_stages(type(self), tile, epi_tile, a, b, d, c, args, capacity - reserve, *rest, **kw)
            finally:
                GemmSm90.epi_c_stage_base = saved

        self._compute_stages = stages
        try:
            quack_setup(self, epilogue_args)
        finally:
            del self._compute_stages
        self.sched_stage = 2  # the MMA warpgroup reads the next tile while the epilogue runs the last

    def make_sched_pipeline(self, cluster_layout_mnk, varlen_k):
        if not self.ws:
            return quack_sched(self, cluster_layout_mnk, varlen_k)
        # the scheduler's readers: the load warp and the MMA warpgroup (4 warps), not the epilogue's 8
        saved, self.mma_warp_groups = self.mma_warp_groups, 1
        try:
            return quack_sched(self, cluster_layout_mnk, varlen_k)
        finally:
            self.mma_warp_groups = saved

    GemmSm90.__init__ = __init__
    GemmSm90._setup_attributes = _setup_attributes
    GemmSm90.make_sched_pipeline = make_sched_pipeline


def _mma_tiled_mma(self) -> cute.TiledMma:
    """One warpgroup on the whole tile (quack's pingpong MMA): 64-row atoms, tile_M / 64 of them in M."""
    return sm90_utils.make_trivial_tiled_mma(
        self.mma_a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
        self.acc_dtype, (1, 1, 1), tiler_mn=(64, self.cta_tile_shape_mnk[1]), a_source=warpgroup.OperandSource.SMEM)


def _fragment_order(shape) -> cute.Layout:
    """The hand-over buffer's view for one thread's accumulator of `shape` ((2, 2, N / 8), MMA_M, MMA_N):
    fragment element v (the first mode, column-major) at v * 256, row block m at m * 128 (cooperative
    thread m * 128 + t of MMA thread t); the caller offsets the buffer by the thread."""
    v = shape[0]
    stride_v = (EPI_THREADS, EPI_THREADS * v[0], EPI_THREADS * v[0] * v[1])
    return cute.make_layout(shape, stride=(stride_v, WG, 0))


@cute.kernel
def ws_kernel(self, tiled_mma, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_sfa, mSFA_mkl, tma_atom_sfb,
              mSFB_nkl, tma_atom_d, mD_mnl, tma_atom_c, mC_mnl, epilogue_params, varlen_params, cluster_layout_mnk,
              a_smem_layout, b_smem_layout, sfa_smem_layout, sfb_smem_layout, epi_smem_layout, epi_c_smem_layout,
              tma_atom_aux_a, mAuxA_mkl, aux_a_smem_layout, tile_sched_params, TileSchedulerCls: cutlass.Constexpr):
    """quack's GemmSm90.kernel signature (it launches this in its place); `tiled_mma` is the cooperative
    one, which the epilogue warps partition by."""
    has_D = const_expr(mD_mnl is not None)
    has_C = const_expr(mC_mnl is not None)
    has_epi_load = const_expr(self.epi_c_stage > 0)
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    if warp_idx == LOAD_WARP:
        for atom in (tma_atom_a, tma_atom_b, tma_atom_d, tma_atom_c):
            if const_expr(atom is not None):
                cpasync.prefetch_descriptor(atom)

    smem = cutlass.utils.SmemAllocator()
    storage = smem.allocate(self.shared_storage)
    mma_tiled_mma = _mma_tiled_mma(self)
    ab_pipeline = self.make_ab_pipeline(tiled_mma=mma_tiled_mma,
                                        cluster_layout_vmnk=cute.make_layout((1, *cluster_layout_mnk.shape)))
    epi_pipeline = self.make_epi_pipeline(tx_count=self.epi_load_bytes_per_stage) if const_expr(has_epi_load) else None
    sched_pipeline = self.make_sched_pipeline(cluster_layout_mnk, varlen_k=False)
    sched_data = smem.allocate_tensor(Int32, cute.make_layout((4, self.sched_stage)), byte_alignment=16,
                                      partition=SmemPartition.RESERVED)
    tile_M, tile_N = self.cta_tile_shape_mnk[0], self.cta_tile_shape_mnk[1]
    s_acc = smem.allocate_tensor(Float32, cute.make_layout(tile_M * tile_N), byte_alignment=16)
    s_tile = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)  # pid_m, pid_n, batch, valid
    pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mnk[:-1], is_relaxed=True)

    sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
    sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
    sD = storage.sD.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner) if const_expr(has_D) else None
    sC = storage.sC.get_tensor(epi_c_smem_layout.outer, swizzle=epi_c_smem_layout.inner) if const_expr(has_C) else None
    epi_smem_tensors = self.epi_get_smem_tensors(epilogue_params, storage)
    varlen_manager = VarlenManager.create(varlen_params, len_m_static=Int32(cute.size(mA_mkl, mode=[0])),
                                          len_k_static=Int32(cute.size(mB_nkl, mode=[1])),
                                          len_n_static=Int32(cute.size(mB_nkl, mode=[0])))
    TileScheduler = partial(TileSchedulerCls.create, tile_sched_params, sched_data, sched_pipeline)
    pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mnk[:-1])
    k_tile_cnt = cute.ceil_div(cute.size(mB_nkl, mode=[1]), self.cta_tile_shape_mnk[2])

    if warp_idx >= LOAD_WARP and warp_idx < MMA_WARP0:  # the load warpgroup
        cute.arch.setmaxregister_decrease(REGS_LOAD)
        if warp_idx == LOAD_WARP:
            if const_expr(self.use_pdl):
                prims.griddepcontrol(prims.GridDepAction.WAIT)
            is_scheduler_warp = True
            if const_expr(cute.size(cluster_layout_mnk) > 1):
                is_scheduler_warp = cute.arch.block_idx_in_cluster() == 0
            tile_scheduler = TileScheduler()
            work_tile = tile_scheduler.initial_work_tile_info()
            ab_producer_state = make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work_tile.is_valid_tile:
                tile_coord_mnkl = work_tile.tile_idx
                batch_idx = tile_coord_mnkl[3]
                gA_mk = cute.local_tile(varlen_manager.offset_batch_A(mA_mkl, batch_idx),
                                        cute.select(self.cta_tile_shape_mnk, [0, 2]), (tile_coord_mnkl[0], None))
                gB_nk = cute.local_tile(varlen_manager.offset_batch_B(mB_nkl, batch_idx),
                                        cute.select(self.cta_tile_shape_mnk, [1, 2]), (tile_coord_mnkl[1], None))
                copy_A = copy_utils.tma_get_block_copy_fn(
                    tma_atom_a, src_tensor=gA_mk, dst_tensor=sA,
                    tma_multicast={"cluster_shape": self.cluster_shape_mnk[:2], "multicast_dim": "M"})
                copy_B = copy_utils.tma_get_block_copy_fn(
                    tma_atom_b, src_tensor=gB_nk, dst_tensor=sB,
                    tma_multicast={"cluster_shape": self.cluster_shape_mnk[:2], "multicast_dim": "N"})
                ab_producer_state = self.load_tma(ab_pipeline, ab_producer_state, [copy_A, copy_B, None], k_tile_cnt)
                tile_scheduler.advance_to_next_work(is_scheduler_warp=is_scheduler_warp)
                work_tile = tile_scheduler.get_current_work()
            ab_pipeline.producer_tail(ab_producer_state)
            if is_scheduler_warp:
                tile_scheduler.producer_tail()

    if warp_idx >= MMA_WARP0:  # the MMA warpgroup
        cute.arch.setmaxregister_increase(REGS_MMA)
        t = tidx - MMA_WARP0 * 32
        thr_mma = mma_tiled_mma.get_slice(t)
        acc, tCrA, tCrB = quack_sm90_utils.partition_fragment_ABC(thr_mma, self.cta_tile_shape_mnk, sA, sB)
        mma_fn = partial(quack_sm90_utils.gemm_w_idx, mma_tiled_mma, acc, tCrA, tCrB)
        # this thread's fragment in the hand-over buffer (the epilogue warps' register order)
        acc_out = cute.make_tensor(s_acc.iterator + t, _fragment_order(acc.shape))
        ab_read_state = make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        tile_scheduler = TileScheduler()
        work_tile = tile_scheduler.initial_work_tile_info()
        handed = Int32(0)
        while work_tile.is_valid_tile:
            tile_coord_mnkl = work_tile.tile_idx
            ab_read_state = self.mma(ab_pipeline, ab_read_state, mma_fn, acc, None, k_tile_cnt, Int32(0))
            if handed > 0:  # the epilogue warps are done reading the last tile
                cute.arch.barrier(barrier_id=BAR_EMPTY, number_of_threads=WG + EPI_THREADS)
            cute.autovec_copy(acc, acc_out)
            if t == 0:
                s_tile[0], s_tile[1], s_tile[2], s_tile[3] = (tile_coord_mnkl[0], tile_coord_mnkl[1],
                                                              tile_coord_mnkl[3], Int32(1))
            cute.arch.barrier_arrive(barrier_id=BAR_FULL, number_of_threads=WG + EPI_THREADS)
            handed += 1
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
        if handed > 0:
            cute.arch.barrier(barrier_id=BAR_EMPTY, number_of_threads=WG + EPI_THREADS)
        if t == 0:
            s_tile[3] = Int32(0)  # no more tiles
        cute.arch.barrier_arrive(barrier_id=BAR_FULL, number_of_threads=WG + EPI_THREADS)

    if warp_idx < LOAD_WARP:  # the two epilogue warpgroups: quack's cooperative epilogue
        cute.arch.setmaxregister_increase(REGS_EPI)
        is_tma_warp = Boolean(warp_idx == 0)
        thr_mma = tiled_mma.get_slice(tidx)
        acc_shape = thr_mma.partition_shape_C(self.cta_tile_shape_mnk[:2])
        acc_in = cute.make_tensor(s_acc.iterator + tidx, _fragment_order(acc_shape))
        epi_store_pipeline = self.make_epi_store_pipeline()
        epi_read_state = make_pipeline_state(pipeline.PipelineUserType.Consumer, self.epi_c_stage)
        epi_producer_state = make_pipeline_state(pipeline.PipelineUserType.Producer, self.epi_c_stage)
        d_dtype_for_layout = self.d_dtype if const_expr(self.d_dtype is not None) else cutlass.BFloat16
        tiled_copy_r2s, tRS_rD, tRS_sD = self.epilog_smem_store_and_partition(tiled_mma, self.d_layout,
                                                                              d_dtype_for_layout, sD, tidx)
        # (R2S, R2S_M, R2S_N, (epi_M, epi_N)) over the hand-over buffer: each subtile read as it is reached
        load_acc_subtile = partial(self.epi_load_acc_subtile, self.epi_retile_acc(acc_in, tRS_rD, tiled_copy_r2s))
        tiled_copy_s2r, tRS_rC, tSR_rC, tSR_sC = None, None, None, None
        if const_expr(has_C):
            tiled_copy_s2r, tRS_rC, tSR_rC, tSR_sC = self.epilog_smem_load_and_partition(
                tiled_mma, self.c_layout, self.c_dtype, sC, tRS_rD.layout, tidx)
        done = Int32(0)
        cute.arch.barrier(barrier_id=BAR_FULL, number_of_threads=WG + EPI_THREADS)
        valid = s_tile[3]
        while valid != 0:
            tile_coord_mnkl = (s_tile[0], s_tile[1], None, s_tile[2])
            batch_idx = tile_coord_mnkl[3]
            copy_D = None
            if const_expr(has_D):
                copy_D, _, _ = self.epilog_gmem_copy_and_partition(
                    tma_atom_d, varlen_manager.offset_batch_epi(mD_mnl, batch_idx), self.cta_tile_shape_mnk[:2],
                    self.epi_tile, sD, tile_coord_mnkl)
            copy_C = None
            if const_expr(has_C):
                copy_C_fn, _, _ = self.epilog_gmem_copy_and_partition(
                    tma_atom_c, varlen_manager.offset_batch_epi(mC_mnl, batch_idx), self.cta_tile_shape_mnk[:2],
                    self.epi_tile, sC, tile_coord_mnkl)
                copy_C = copy_utils.tma_producer_copy_fn(copy_C_fn, epi_pipeline)
            if const_expr(has_epi_load):
                loads = self.epi_tile_load_g2s_copy_fns(epilogue_params, epi_smem_tensors, tile_coord_mnkl,
                                                        varlen_manager, epi_pipeline)
                copy_C = copy_utils.chain_tma_producer_copy_fns((copy_C, *loads))
            epi_read_state, epi_producer_state = self.epilogue(
                epilogue_params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, epi_read_state,
                epi_producer_state, self.epi_tile, load_acc_subtile, tRS_rD, tRS_rC, None, tiled_copy_r2s, tRS_sD,
                tiled_copy_s2r, tSR_rC, tSR_sC, copy_D, copy_C, tile_coord_mnkl, varlen_manager,
                self.epilogue_barrier, _TilesDone(done), tidx, is_tma_warp)
            done += 1
            # every subtile read: the MMA warpgroup may write the next tile (it waits at EMPTY)
            cute.arch.barrier_arrive(barrier_id=BAR_EMPTY, number_of_threads=WG + EPI_THREADS)
            cute.arch.barrier(barrier_id=BAR_FULL, number_of_threads=WG + EPI_THREADS)
            valid = s_tile[3]
        if const_expr(self.use_pdl):
            prims.griddepcontrol(prims.GridDepAction.LAUNCH_DEPENDENTS)
        if is_tma_warp:
            epi_store_pipeline.producer_tail()
