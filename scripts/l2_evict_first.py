"""Epilogue traffic marked evict-first in L2: every TMA load and store a GEMM's epilogue issues (the C
operand, TileLoad operands such as dSwiGLU's gate and up, D and the declared tile outputs) carries
the L2 cache hint EVICT_FIRST, so that data streamed through the epilogue once leaves L2 before the
mainloop's A and B tiles, which other CTAs read again.

Why: ncu on the 1B dSwiGLU (H200, 2026-12-04, scripts/ncu_ablation.sh) read 290 MB from DRAM for
the bare GEMM and 1.04 GB for the op, of which its gate and up tiles are 537 MB: the mainloop's A/B
re-reads from DRAM grew from 290 to about 500 MB while the epilogue streamed 1.3 GB through L2, and
the tensor pipes' active share fell from 96 % to 81 %. quack notes it tried D stores evict-first with
B loads evict-last on plain GEMMs and measured a regression (gemm_base.py, "l2-hints"); a plain
GEMM streams one output tile, the fused ones three to five.

The kernel's code is quack's: one hook changes. `epilog_gmem_copy_and_partition` (every epilogue
TMA copy is partitioned there) runs with quack's `copy_utils.tma_get_copy_fn` bound to
`cache_policy=EVICT_FIRST`, which that function hands to each `cute.copy` of the partition.

`enable()` patches quack in this process before any GEMM compiles, so a process that enables it
must use a kernel cache of its own (QUACK_CACHE_DIR); scripts/epilogue_stages.py does (variant ef).
GPU-blind check that the hint reaches the PTX:

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/epilogue_stages.py --variant ef --child compile --shapes 125m
"""

from __future__ import annotations

import functools

# The 64-bit L2 cache policy of PTX's `.L2::cache_hint` operand for evict-first (what `createpolicy.fractional
# .L2::evict_first.b64 p, 1.0` yields; CUTLASS's CacheHintSm90::EVICT_FIRST).
EVICT_FIRST = 0x12F0000000000000
_enabled = False


def enable() -> None:
    """Patch quack's SM90 GEMM: every epilogue TMA load and store carries the evict-first L2 hint."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    from cutlass import Int64
    from quack import copy_utils
    from quack.gemm_sm90 import GemmSm90

    quack_gmem = GemmSm90.epilog_gmem_copy_and_partition
    quack_copy_fn = copy_utils.tma_get_copy_fn

    def epilog_gmem_copy_and_partition(self, *args, **kwargs):
        # the policy is a value of the kernel being traced: made here, inside its trace
        copy_utils.tma_get_copy_fn = functools.partial(quack_copy_fn, cache_policy=Int64(EVICT_FIRST))
        try:
            return quack_gmem(self, *args, **kwargs)
        finally:
            copy_utils.tma_get_copy_fn = quack_copy_fn

    GemmSm90.epilog_gmem_copy_and_partition = epilog_gmem_copy_and_partition
