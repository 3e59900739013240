"""Does a deeper epilogue pipeline, or a second epilogue in flight, pay? quack's SM90 GEMM splits
shared memory between the mainloop's A/B stages and the epilogue's: its tile loads (the C operand and
TileLoad operands such as dSwiGLU's gate and up) run `epi_c_stage` subtiles ahead, at most
min(subtiles per tile, 4) plus one from leftover memory, and only within the current output tile;
its stores have `epi_stage` buffers. At K = 768 (llama3_125m) the mainloop is too short to hide
the epilogue's HBM traffic, so the depth of the epilogue's pipeline may set its pace. Variants, each
a different split of the same memory:

  ship  quack's split (what the step runs)
  c8    up to 8 subtiles of loads in flight (GemmSm90.epi_c_stage_base = 8; one A/B stage fewer)
  c8d   c8, and one more A/B stage handed to the store buffers (kernels with epilogue loads)
  two   pingpong kernels run both warpgroups' epilogues at once, each with buffers of its own
        (two_epilogues.py), tile-load ring up to 4 stages per warpgroup
  two2  two, tile-load ring up to 2 stages per warpgroup (one more A/B stage)
  pf    ship, and each consumer warpgroup prefetches its next tile's epilogue loads to L2 when it
        takes the tile (l2_prefetch.py)
  pf1   pf, the first subtile of each load only (the one its epilogue waits for first)
  two2pf  two2 and pf together
  ws    128 x N pingpong kernels (N <= 128) rebuilt warp-specialized: one MMA warpgroup, two epilogue
        warpgroups, the accumulator between them in shared memory (ws_epilogue.py)
  ef    ship, with every epilogue TMA load and store marked evict-first in L2 (l2_hints.py)
  efl   ef, and the mainloop's A/B loads marked evict-last
  abl   ship, with the mainloop's A/B loads marked evict-last

Each variant runs in processes of its own with a kernel cache of its own (QUACK_CACHE_DIR): (1) the
step's kernels at every --shapes shape compile GPU-blind, variants in parallel; (2) each shape's
epilogue-loading ops (or --ops) run alone at the shipped tile configs, median of triton's do_bench, outputs
checksummed against ship's (the same math in the same order: bitwise equal; DIFF otherwise) and checked against the
float64 reference as the GPU tests check them (kernels.testing.check_case; FAIL when not within bounds); (3) with --step, bench.py's
coda-graphs step at that shape, the variants alternately, two rounds. Prints a table and writes
epilogue_stages.json under --out.

    python scripts/epilogue_stages.py [--shapes 125m,1b-4x4096] [--variants ship,c8,c8d] [--ops OP,...]
        [--step 125m [--op-rounds 0]] [--jit] [--out DIR]

On the H200 none paid: c8 and c8d on 2026-12-02, two and two2, pf, pf1 and two2pf on 2026-12-03
(docs/kernels.md, "What sets an epilogue's pace at K = 768"), ef on 2026-12-04 (1.5 % on the 1B dSwiGLU,
nothing elsewhere: "Where the 1B dSwiGLU's excess goes"); scripts/ncu_epilogue.sh profiles them. --jit skips
the GPU-blind compile of the whole step (each timing child compiles what it runs).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
VARIANTS = {"ship": (4, False), "c8": (8, False), "c8d": (8, True)}  # (epi_c_stage_base, one A/B stage to D)
TWO_EPILOGUES = {"two": 4, "two2": 2}  # two epilogues in flight: tile-load stages per warpgroup, at most
L2_PREFETCH = {"pf": ("ship", 0), "pf1": ("ship", 1), "two2pf": ("two2", 0)}  # the next tile's epilogue loads
# prefetched to L2 on top of a variant: (that variant, subtiles of each load, 0 = all)
# L2 hints (l2_hints.py): (the epilogue's loads and stores evict-first, the mainloop's A/B loads evict-last)
L2_HINTS = {"ef": (True, False), "efl": (True, True), "abl": (False, True)}
LOAD_OPS = ("gemm_dswiglu_rowscale_stat", "gemm_residual_rmsnorm_partial", "gemm_rmsnorm_backward", "gemm_rowscale_rope")


def apply(variant: str) -> None:
    """Patch quack's SM90 stage split for this process (before any kernel compiles)."""
    import cutlass.cute as cute
    from quack.gemm_sm90 import GemmSm90

    if variant in L2_PREFETCH:  # its base variant's patches first: the prefetch wraps them
        import l2_prefetch

        base, subtiles = L2_PREFETCH[variant]
        apply(base)
        l2_prefetch.enable(subtiles)
        return
    if variant in L2_HINTS:
        import l2_hints

        l2_hints.enable(*L2_HINTS[variant])
        return
    if variant == "ws":  # 128 x N pingpong kernels, warp-specialized: ws_epilogue.py
        import ws_epilogue

        ws_epilogue.enable()
        return
    if variant in TWO_EPILOGUES:  # pingpong kernels: two_epilogues.py
        import two_epilogues

        two_epilogues.enable(max_ring=TWO_EPILOGUES[variant])
        return
    c_base, ab_to_d = VARIANTS[variant]
    GemmSm90.epi_c_stage_base = c_base  # read by _compute_stages, which reserves its bytes before the A/B stages
    if not ab_to_d:
        return
    quack_split = GemmSm90._compute_stages.__func__

    def split(cls, tile, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args, smem_capacity, occupancy,
              warp_shape_mnk=None, a_bytes_per_stage_override=None, ab_extra_bytes_per_stage=0):
        ab, epi, c = quack_split(cls, tile, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args, smem_capacity,
                                 occupancy, warp_shape_mnk, a_bytes_per_stage_override, ab_extra_bytes_per_stage)
        a_bytes = a_bytes_per_stage_override or tile[0] * tile[2] * a_dtype.width // 8
        ab_bytes = a_bytes + tile[1] * tile[2] * b_dtype.width // 8 + ab_extra_bytes_per_stage
        d_bytes = ((cute.size(cute.shape(epi_tile)) * d_dtype.width // 8 if d_dtype is not None else 0)
                   + cls.epi_smem_bytes(epilogue_args, tile, epi_tile, warp_shape_mnk).d_stage)
        if ab <= 3 or not c or not d_bytes:  # keep three A/B stages; only kernels with epilogue loads
            return ab, epi, c
        return ab - 1, epi + ab_bytes // d_bytes, c

    GemmSm90._compute_stages = classmethod(split)


def print_splits() -> None:
    """From now on, print one SPLIT line (JSON) per GEMM kernel this process sets up: its tile and stage split."""
    from quack.gemm_sm90 import GemmSm90

    quack_setup = GemmSm90._setup_attributes

    def recorded(self, epilogue_args):
        quack_setup(self, epilogue_args)
        print("SPLIT " + json.dumps(dict(kernel=type(self).__name__, tile=list(self.cta_tile_shape_mnk), pingpong=self.pingpong,
                                         epi_tile=list(self.epi_tile), ab=self.ab_stage, d=self.epi_stage, c=self.epi_c_stage)),
              flush=True)

    GemmSm90._setup_attributes = recorded


def child_compile(shapes: list[str]) -> None:
    """Compile the step's kernels at `shapes` GPU-blind; one SPLIT line per kernel."""
    from tune_gemm import shape_dims

    from coda_train.kernels.cute._compile import compile_all

    print_splits()
    compile_all([shape_dims(s) for s in shapes], verbose=False, gpu="H200")


def child_time(shapes: list[str], ops: list[str]) -> None:
    """One RESULT line per (shape, op launch): ms, config, output checksums."""
    import torch
    from triton.testing import do_bench
    from tune_gemm import launch_inputs, launches

    from coda_train.kernels import OPS, op_set, testing
    from coda_train.kernels.library import CUTE_IMPLS
    from coda_train.kernels.tile_configs import forced, gpu_key, lookup

    op_set("cute")
    gpu = gpu_key(torch.cuda.get_device_name())
    for shape in shapes:
        for launch in launches([shape], ops):
            op = launch["op"]
            cfg = lookup(op, launch["m"], launch["n"], launch["k"], gpu)
            kwargs = launch_inputs(launch)
            impl = CUTE_IMPLS[op].kernel
            with forced({op: cfg}):
                with testing.poisoned_cute_outputs():
                    got = testing.results(OPS[op], impl, kwargs)
                sums = [[float(g.double().sum()), float(g.double().abs().sum())] for g in got]
                # against the float64 reference too: a variant that reorders the epilogue's sums is not bitwise ship
                checked = testing.check_case(OPS[op], op, kwargs, impl)
                timed = {k: v.clone() if k in OPS[op].mutates else v for k, v in kwargs.items()}
                ms = do_bench(lambda: impl(**timed), warmup=25, rep=200, return_mode="median")
            print("RESULT " + json.dumps(dict(shape=shape, op=op, mnk=[launch["m"], launch["n"], launch["k"]], config=str(cfg),
                                              ms=round(ms, 4), checksums=sums, ok=all(r["ok"] for r in checked),
                                              err=max(r["err_cute"] for r in checked),
                                              err_base=max(r["err_base"] for r in checked))), flush=True)
            kwargs = timed = got = None
            torch.cuda.empty_cache()


def run_child(variant: str, mode: list[str], cache: Path, cpu: bool = False, timeout: int = 400) -> subprocess.CompletedProcess:
    """This script as a child process applying `variant`, with a kernel cache of the variant's own under `cache`
    (quack's cache key does not see the patched split)."""
    env = dict(os.environ, QUACK_CACHE_DIR=str(cache / variant), QUACK_CACHE_ENABLED="1")
    if cpu:
        env.update(QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, __file__, "--variant", variant, *mode], env=env, capture_output=True,
                          text=True, timeout=timeout)


def step_ms(text: str) -> float | None:
    """The coda-graphs step time (ms) from bench.py's printed table."""
    m = re.search(r"^coda-graphs\s+([\d.]+)", text, re.M)
    return float(m[1]) if m else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shapes", default="125m,1b-4x4096")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {[*VARIANTS, *TWO_EPILOGUES, *L2_PREFETCH, *L2_HINTS, 'ws']}")
    p.add_argument("--ops", default=",".join(LOAD_OPS), help="the ops timed alone")
    p.add_argument("--step", default="", help="a bench.py shape: time the coda-graphs step per variant")
    p.add_argument("--step-rounds", type=int, default=2)
    p.add_argument("--op-rounds", type=int, default=2, help="rounds of the ops alone (0: steps only)")
    p.add_argument("--jit", action="store_true",
                   help="skip the GPU-blind compile of the whole step: each timing child compiles the ops it runs "
                        "(no SPLIT lines; saves device time when only a few ops are timed)")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/epilogue_stages"))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # child: the variant to apply
    p.add_argument("--child", help=argparse.SUPPRESS)  # child: compile | time | bench
    p.add_argument("--bench-args", default="", help=argparse.SUPPRESS)  # child bench: bench.py's arguments
    args = p.parse_args()
    sys.path.insert(0, str(SCRIPTS))
    if args.variant:  # a child, or a user's direct call: never the shipped kernels' cache (its key ignores the patch)
        if "QUACK_CACHE_DIR" not in os.environ:
            os.environ["QUACK_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"epilogue_stages_{args.variant}_")
            atexit.register(shutil.rmtree, os.environ["QUACK_CACHE_DIR"], ignore_errors=True)
        apply(args.variant)
        shapes = args.shapes.split(",")
        if args.child == "compile":
            child_compile(shapes)
        elif args.child == "time":
            child_time(shapes, args.ops.split(","))
        else:  # bench.py with this variant's stage split
            sys.argv = [str(SCRIPTS / "bench.py"), *shlex.split(args.bench_args)]
            runpy.run_path(sys.argv[0], run_name="__main__")
        return

    import torch

    if (args.op_rounds or args.step) and not torch.cuda.is_available():  # before minutes of GPU-blind compiles
        p.error("epilogue_stages.py times kernels on a Hopper GPU; run it on the GPU machine (--op-rounds 0 without "
                "--step only compiles the variants GPU-blind and prints their stage splits, on CPU too)")
    variants, shapes = args.variants.split(","), args.shapes.split(",")
    cache = Path(tempfile.mkdtemp(prefix="epilogue_stages_"))  # fresh: every kernel compiles, so its split is recorded
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    t0 = time.time()
    compile_shapes = ",".join(dict.fromkeys(shapes + ([args.step] if args.step else [])))
    with ThreadPoolExecutor(len(variants)) as pool:  # GPU-blind, one process per variant
        done = [] if args.jit else list(pool.map(
            lambda v: run_child(v, ["--child", "compile", "--shapes", compile_shapes], cache, cpu=True), variants))
    splits = {}
    for v, c in zip(variants, done):
        print(f"compile {v}: rc {c.returncode}" + (f"\n{c.stderr[-1500:]}" if c.returncode else ""), flush=True)
        splits[v] = list({line: json.loads(line[6:]) for line in c.stdout.splitlines() if line.startswith("SPLIT ")}.values())
    for v, kernels in splits.items():  # the epilogue-loading kernels' splits: what the variants change
        print(f"stages {v} (ab, d, c): " + "; ".join(f"{k['tile'][0]}x{k['tile'][1]}{'pp' if k['pingpong'] else 'co'} "
                                                      f"({k['ab']},{k['d']},{k['c']})" for k in kernels if k["c"]), flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python scripts/epilogue_stages.py " + " ".join(sys.argv[1:]),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=gpu_name())
    rows, steps = [], []

    def write():  # after every measurement: a device call cut short keeps what it measured
        (out / "epilogue_stages.json").write_text(json.dumps(dict(meta=meta, splits=splits, ops=rows, steps=steps), indent=1) + "\n")

    write()
    for rnd in range(1, args.op_rounds + 1):
        for v in variants:
            try:
                c = run_child(v, ["--child", "time", "--shapes", ",".join(shapes), "--ops", args.ops], cache, timeout=240)
            except subprocess.TimeoutExpired as e:  # a variant whose kernel hangs: reported, skipped
                print(f"time {v}: no result in {e.timeout} s", flush=True)
                continue
            got = [json.loads(line[7:]) for line in c.stdout.splitlines() if line.startswith("RESULT ")]
            if c.returncode:
                print(f"time {v}: rc {c.returncode}\n{c.stderr[-1500:]}", flush=True)
            for r in got:
                rows.append(dict(r, variant=v, round=rnd))
            write()
    ship = {(r["shape"], r["op"], tuple(r["mnk"])): r["checksums"] for r in rows if r["variant"] == "ship"}
    print(f"\n{'shape':10s} {'op':32s} {'m x n x k':18s} {'config':24s} " + " ".join(f"{v:>14s}" for v in variants))
    for key in dict.fromkeys((r["shape"], r["op"], tuple(r["mnk"]), r["config"]) for r in rows):
        cells = []
        for v in variants:
            mine = [r for r in rows if (r["shape"], r["op"], tuple(r["mnk"]), r["config"]) == key and r["variant"] == v]
            same = all(r["checksums"] == ship.get(key[:3]) for r in mine)
            wrong = not all(r.get("ok", True) for r in mine)  # fails the reference check (kernels.testing)
            cells.append("/".join(f"{r['ms']:.4f}" for r in mine) + ("" if same else " DIFF") + (" FAIL" if wrong else ""))
        print(f"{key[0]:10s} {key[1]:32s} {'x'.join(map(str, key[2])):18s} {key[3]:24s} " + " ".join(f"{c:>14s}" for c in cells))

    for rnd in range(1, args.step_rounds + 1) if args.step else ():
        for v in variants:
            with tempfile.TemporaryDirectory() as tmp:
                c = run_child(v, ["--child", "bench", "--bench-args",
                                  f"--shape {args.step} --variants coda-graphs --profile-steps 0 --out {tmp}"], cache, timeout=300)
            ms = step_ms(c.stdout)
            steps.append(dict(shape=args.step, variant=v, round=rnd, ms=ms))
            write()
            print(f"step {args.step} {v} round {rnd}: {ms} ms" + (f"\n{c.stdout[-800:]}{c.stderr[-800:]}" if ms is None else ""),
                  flush=True)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    main()
