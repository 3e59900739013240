"""Early epilogue loads, to L2: each consumer warpgroup prefetches its next tile's epilogue inputs.

At K = 768 (llama3_125m) a fused GEMM's epilogue is longer than its mainloop, and part of it waits
for its own tile loads (the C operand and TileLoad operands such as dSwiGLU's gate and up): quack's
SM90 epilogue issues them only when the tile's epilogue starts (docs/kernels.md, "What sets an
epilogue's pace at K = 768"). CUTLASS hides them by loading from the producer warp during the
mainloop; quack's SM90 kernel has no hook for that, and the loads would need shared memory the A/B
stages hold. This variant asks less: when a consumer warpgroup takes its next tile from the
scheduler (right after its previous epilogue), one of its threads issues a TMA prefetch to L2
(`cp.async.bulk.prefetch.tensor`) of every epilogue load of that tile. The tile's mainloop (and, in
pingpong, the other warpgroup's) runs before its epilogue reads them, so they come from L2.

The kernel's code is quack's; two hooks change: `epilog_gmem_copy_and_partition` remembers every
epilogue load it partitions (atom, tensor, smem view) while the kernel is traced, and
`get_scheduler_class` returns quack's TileScheduler with a `get_current_work` that, in a consumer
warp, issues the prefetches for the tile it returns. The remembered values are the loop body's own,
and the consumer's `get_current_work` for its next tile is traced after them in the same body.

`enable()` patches quack in this process before any GEMM compiles, so a process that enables it
must use a kernel cache of its own (QUACK_CACHE_DIR); scripts/epilogue_stages.py does (variants pf,
pf1 (the first subtile of each load only) and two2pf), and compiles the step's kernels GPU-blind with
it:

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/epilogue_stages.py --variant pf --child compile --shapes 125m

Measured on the H200 (2026-12-03) and not adopted: outputs bitwise equal; the whole tile made every
op 1-6 % slower (its lines were evicted before use: 57 MB more DRAM reads on the 125M dSwiGLU), the
first subtile alone moved neither the ops nor the 125M step beyond their spread (docs/kernels.md,
"Early epilogue loads, to L2").
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import const_expr

WG_THREADS = 128
PREFETCHED: list[tuple[str, int]] = []  # (kernel class, loads prefetched), one entry per kernel traced
_enabled = False


def enable(subtiles: int = 0) -> None:
    """Patch quack's SM90 GEMM: every epilogue load of a consumer's next tile is prefetched to L2,
    the whole tile (subtiles=0) or its first `subtiles` subtiles in the order its epilogue loads them."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    from cutlass.cute.nvgpu import cpasync
    from quack.gemm_sm90 import GemmSm90
    from quack.tile_scheduler import TileScheduler

    s2g = (cpasync.CopyBulkTensorTileS2GOp, cpasync.CopyReduceBulkTensorTileS2GOp)
    quack_gmem = GemmSm90.epilog_gmem_copy_and_partition
    quack_scheduler = GemmSm90.get_scheduler_class

    def epilog_gmem_copy_and_partition(self, atom, mD_mn, tile_shape_mn, epi_tile, s, tile_coord_mnkl):
        loads = getattr(self, "_l2_loads", None)
        if loads is not None and not isinstance(atom.op, s2g):  # an epilogue load (C or a TileLoad)
            loads.append((atom, mD_mn, tile_shape_mn, epi_tile, s))
        return quack_gmem(self, atom, mD_mn, tile_shape_mn, epi_tile, s, tile_coord_mnkl)

    def prefetch(gemm, loads, tile_coord_mnkl) -> None:
        """TMA prefetch to L2 of every remembered epilogue load: the tile, or its first subtiles."""
        for atom, mD_mn, tile_shape_mn, epi_tile, s in loads:
            _, _, g = quack_gmem(gemm, atom, mD_mn, tile_shape_mn, epi_tile, s, tile_coord_mnkl)
            if subtiles == 0:
                cute.prefetch(atom, g)  # ((atom, rest), subtiles): one prefetch per subtile
                continue
            # quack's epilogue loads subtile i at this layout's coordinate i (GemmBase.epilogue)
            order = cute.make_ordered_layout(g.shape[1], order=(0, 1) if gemm.epi_m_major else (1, 0))
            for i in range(min(subtiles, cute.size(order))):
                cute.prefetch(atom, g[None, order.get_hier_coord(i)])
        PREFETCHED.append((type(gemm).__name__, len(loads)))

    def get_scheduler_class(self, varlen_m: bool = False):
        base = quack_scheduler(self, varlen_m=varlen_m)
        if varlen_m or base is not TileScheduler:
            self._l2_loads = None
            return base
        loads = self._l2_loads = []  # filled while this kernel is traced
        gemm = self

        class PrefetchingScheduler(TileScheduler):
            @cute.jit
            def get_current_work(self, *, loc=None, ip=None):
                work = TileScheduler.get_current_work(self, loc=loc, ip=ip)
                if const_expr(len(loads) > 0):  # traced in the consumer's loop body, after its loads
                    tidx, _, _ = cute.arch.thread_idx()
                    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
                    first = tidx % WG_THREADS == 0 if const_expr(gemm.pingpong) else tidx == 0
                    if warp < gemm.ab_load_warp_id and first and work.is_valid_tile:
                        prefetch(gemm, loads, work.tile_idx)
                return work

        return PrefetchingScheduler

    GemmSm90.epilog_gmem_copy_and_partition = epilog_gmem_copy_and_partition
    GemmSm90.get_scheduler_class = get_scheduler_class
