"""Shared memory for a warp-specialized epilogue: quack's own stage split, GPU-blind.

The kernel planned in docs/kernels.md ("What is left: a warp-specialized epilogue kernel") hands each
tile's fp32 accumulator from one MMA warpgroup to two epilogue warpgroups through shared memory, so
that buffer (tile_M x tile_N x 4 bytes) comes out of what the A/B and epilogue stages share. For each
epilogue-loading op of the step at --shapes, this runs quack's `_compute_stages` (the split every
kernel of the step gets) at the shipped tile config of the H200 table, and at that tile as the new
kernel would see it: cooperative (the epilogue's subtiles span both epilogue warpgroups) with the
buffer taken away, at quack's load-stage base (4) and at 2. Nothing is launched or compiled past
the split. Prints one row per (launch, split).

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/ws_smem_budget.py [--shapes 125m,1b-4x4096]

On a GPU, --time asks what those fewer A/B stages cost the mainloop: dSwiGLU's bare GEMM (the
`matmul` op, identity epilogue) and dSwiGLU itself at their shipped tile, with the A/B stages capped
at each of --caps (each cap in a process of its own: quack's kernel cache does not key on the patch),
median ms of triton's do_bench.

    python scripts/ws_smem_budget.py --time [--shapes 125m,1b-4x4096] [--caps 2,3,4,0]  (0: uncapped)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("QUACK_ARCH", "90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["QUACK_CACHE_ENABLED"] = "0"  # a cached kernel would skip the stage split this script reads
sys.path.insert(0, str(Path(__file__).resolve().parent))

LOAD_OPS = ("gemm_dswiglu_rowscale_stat", "gemm_rmsnorm_backward", "gemm_residual_rmsnorm_partial", "gemm_rowscale_rope")


class _Split(Exception):
    """Raised from the patched stage split: the split is all this script needs of a compile."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="125m,1b-4x4096", help="bench.py shapes (comma-separated)")
    p.add_argument("--time", action="store_true", help="on a GPU: time the mainloop at capped A/B stages")
    p.add_argument("--caps", default="2,3,4,0", help="--time: A/B stage caps (0: quack's own split)")
    p.add_argument("--child-cap", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_cap is not None:
        return time_capped(args.shapes.split(","), args.child_cap)
    if args.time:
        import subprocess

        import torch

        if not torch.cuda.is_available():
            sys.exit("ws_smem_budget.py --time needs a CUDA GPU (the split table alone runs anywhere)")
        print("| launch | op | config | A/B stages | ms |\n|---|---|---|---|---|", flush=True)
        for cap in args.caps.split(","):
            subprocess.run([sys.executable, __file__, "--shapes", args.shapes, "--child-cap", cap], check=True)
        return

    import cutlass.cute as cute
    import torch
    from quack.gemm_sm90 import GemmSm90
    from tune_gemm import gemm_inputs, launches

    from coda_train.kernels import Dims, Example
    from coda_train.kernels.cute import _launch
    from coda_train.kernels.library import CUTE_IMPLS
    from coda_train.kernels.tile_configs import Cfg, lookup

    quack_stages = GemmSm90._compute_stages.__func__
    rows: list[tuple[str, ...]] = []
    case: dict = {}

    def split(cls, tile, epi_tile, a, b, d, c, epi_args, capacity, occupancy, warp_shape_mnk=None,
              a_bytes_per_stage_override=None, ab_extra_bytes_per_stage=0):
        elems = cute.size(cute.shape(epi_tile))
        op_bytes = cls.epi_smem_bytes(epi_args, tile, epi_tile, warp_shape_mnk)
        store_kb = ((elems * d.width // 8 if d is not None else 0) + op_bytes.d_stage) / 1024
        load_kb = ((elems * c.width // 8 if c is not None else 0) + op_bytes.c_stage) / 1024
        ab_kb = (tile[0] + tile[1]) * tile[2] * a.width // 8 / 1024
        buffer = tile[0] * tile[1] * 4 if case["ws"] else 0
        for base in ((4, 2) if case["ws"] else (cls.epi_c_stage_base,)):
            saved, cls.epi_c_stage_base = cls.epi_c_stage_base, base
            try:
                ab, st, ld = quack_stages(cls, tile, epi_tile, a, b, d, c, epi_args, capacity - buffer, occupancy,
                                          warp_shape_mnk, a_bytes_per_stage_override, ab_extra_bytes_per_stage)
            finally:
                cls.epi_c_stage_base = saved
            rows.append((case["launch"], case["cfg"], "warp-specialized, load base %d" % base if case["ws"] else "shipped",
                         f"{buffer // 1024}", f"{ab} x {ab_kb:.0f}", f"{st} x {store_kb:.0f}", f"{ld} x {load_kb:.0f}",
                         f"{tuple(epi_tile)[0]}x{tuple(epi_tile)[1]}"))
        raise _Split

    GemmSm90._compute_stages = classmethod(split)
    for launch in launches(args.shapes.split(","), list(LOAD_OPS)):
        op, m, n, k = launch["op"], launch["m"], launch["n"], launch["k"]
        ship = lookup(op, m, n, k, "H200")
        dims = Dims(**launch["dims"])
        kwargs = gemm_inputs(dims, op, m, n, k)(Example(dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(0)))
        candidates = [(ship, False)]
        if ship.tile_M == 128:
            candidates.append((Cfg(128, ship.tile_N, ship.cluster_M, ship.cluster_N, pingpong=False), True))
        for cfg, ws in candidates:
            case.update(launch=f"{'/'.join(launch['shapes'])} {op} {m}x{n}x{k}", cfg=str(ship), ws=ws)
            _launch.lookup = lambda *_, cfg=cfg: cfg  # not forced(): the cooperative tile need not be one quack runs
            with _launch.compile_only("H200"):
                try:
                    CUTE_IMPLS[op].kernel(**kwargs)
                except _Split:
                    pass
        _launch.lookup = lookup
    head = ("launch", "shipped config", "split", "acc buffer KB", "A/B stages x KB", "store stages x KB",
            "load stages x KB", "epi subtile")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def time_capped(shapes: list[str], cap: int) -> None:
    """One table row per (B1 launch at `shapes`, bare GEMM or op): A/B stages capped at `cap` (0: none)."""
    import torch
    from quack.gemm_sm90 import GemmSm90
    from triton.testing import do_bench
    from tune_gemm import launch_inputs, launches

    from coda_train.kernels import op_set
    from coda_train.kernels.library import CUTE_IMPLS
    from coda_train.kernels.tile_configs import forced, gpu_key, lookup

    quack_stages = GemmSm90._compute_stages.__func__
    stages = {}

    def capped(cls, *a, **k):
        ab, st, ld = quack_stages(cls, *a, **k)
        stages["ab"] = min(ab, cap) if cap else ab
        return stages["ab"], st, ld

    GemmSm90._compute_stages = classmethod(capped)
    op_set("cute")
    gpu = gpu_key(torch.cuda.get_device_name())
    for launch in launches(shapes, ["gemm_dswiglu_rowscale_stat"]):
        m, n, k = launch["m"], launch["n"], launch["k"]
        cfg = lookup("gemm_dswiglu_rowscale_stat", m, n, k, gpu)
        kwargs = launch_inputs(launch)
        bare = dict(a=kwargs["g_out"], b=kwargs["w_down"])
        for op, inputs in (("matmul", bare), ("gemm_dswiglu_rowscale_stat", kwargs)):
            fn = CUTE_IMPLS[op].kernel
            with forced({op: cfg}):
                fn(**inputs)
                ms = do_bench(lambda: fn(**inputs), warmup=25, rep=200, return_mode="median")
            print(f"| {'/'.join(launch['shapes'])} {m}x{n}x{k} | {op} | {cfg} | {stages['ab']} | {ms:.4f} |", flush=True)


if __name__ == "__main__":
    main()
