"""L2 eviction hints on a GEMM's TMA copies: the epilogue's traffic marked evict-first, the mainloop's
A and B tiles evict-last, or both, so that data the epilogue streams through once leaves L2 before
the A and B panels that other CTAs read again.

Why: ncu on the 1B dSwiGLU (H200, 2026-12-04, scripts/ncu_ablation.sh) read 290 MB from DRAM for
the bare GEMM and 1.04 GB for the op, of which its gate and up tiles are 537 MB. By those totals the
mainloop's A/B re-reads from DRAM grew from 290 to about 500 MB while the epilogue streamed 1.3 GB
through L2, and the tensor pipes' active share fell from 96 % to 81 %. quack notes it tried D stores
evict-first with B loads evict-last on plain GEMMs and measured a regression (gemm_base.py,
"l2-hints"); a plain GEMM streams one output tile, the fused ones three to five.

The kernel's code is quack's; two hooks change, each binding a `cache_policy` that quack's copy
helpers hand to every `cute.copy` they build:
- epilogue: `epilog_gmem_copy_and_partition` (every epilogue TMA copy, C, D and the tile operands, is
  partitioned there) runs with `copy_utils.tma_get_copy_fn` bound to EVICT_FIRST;
- operands: `copy_utils.tma_get_block_copy_fn` (the producer's A, B and aux-A loads) gets EVICT_LAST.

`enable()` patches quack in this process before any GEMM compiles, so a process that enables it
must use a kernel cache of its own (QUACK_CACHE_DIR); scripts/epilogue_stages.py does (variants ef:
epilogue only, efl: both, abl: operands only). Measured on the H200 (2026-12-04): ef made the 1B
dSwiGLU 1.5 % faster and nothing else; efl cut its DRAM reads by 95 MB (ncu) and made it 0.5 % faster
over four rounds, the 8B dSwiGLU 1.8 % slower; abl no better. None adopted (docs/kernels.md, "Evict-last
L2 hints on the mainloop's A/B loads"). GPU-blind check that the hints reach the PTX:

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/epilogue_stages.py --variant efl --child compile --shapes 125m
"""

from __future__ import annotations

import functools

# The 64-bit L2 cache policies of PTX's `.L2::cache_hint` operand (what `createpolicy.fractional.L2::evict_first
# .b64 p, 1.0` and its evict_last twin yield; CUTLASS's CacheHintSm90). quack's copies pass 0 (no policy).
EVICT_FIRST = 0x12F0000000000000
EVICT_LAST = 0x14F0000000000000
_enabled: tuple[bool, bool] | None = None


def enable(epilogue: bool = True, operands: bool = False) -> None:
    """Patch quack's SM90 GEMM: with `epilogue`, every epilogue TMA load and store carries the
    evict-first L2 hint; with `operands`, every mainloop A/B load carries evict-last."""
    global _enabled
    if _enabled is not None:
        assert _enabled == (epilogue, operands), f"l2_hints already enabled as {_enabled}"
        return
    _enabled = (epilogue, operands)
    from cutlass import Int64
    from quack import copy_utils
    from quack.gemm_sm90 import GemmSm90

    quack_copy_fn, quack_block_copy_fn = copy_utils.tma_get_copy_fn, copy_utils.tma_get_block_copy_fn

    if epilogue:
        quack_gmem = GemmSm90.epilog_gmem_copy_and_partition

        def epilog_gmem_copy_and_partition(self, *args, **kwargs):
            # the policy is a value of the kernel being traced: made here, inside its trace
            copy_utils.tma_get_copy_fn = functools.partial(quack_copy_fn, cache_policy=Int64(EVICT_FIRST))
            try:
                return quack_gmem(self, *args, **kwargs)
            finally:
                copy_utils.tma_get_copy_fn = quack_copy_fn

        GemmSm90.epilog_gmem_copy_and_partition = epilog_gmem_copy_and_partition

    if operands:
        def tma_get_block_copy_fn(*args, **kwargs):
            return quack_block_copy_fn(*args, cache_policy=Int64(EVICT_LAST), **kwargs)

        copy_utils.tma_get_block_copy_fn = tma_get_block_copy_fn
