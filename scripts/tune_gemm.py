"""Tune the tile config of every GEMM a CODA training step runs, on one Hopper GPU, and write the
table coda_train/kernels/tile_configs.py reads (format: docs/kernels.md).

  python scripts/tune_gemm.py [--shapes 125m,1b-4x4096,1b-2x8192,8b-slice] [--ops OP,...] [--budget-s 290] [--out DIR]
  python scripts/tune_gemm.py --launches RUN_DIR/untuned_gemms.json --out DIR   # a run's shapes the table lacks
  QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/tune_gemm.py --compile-only [--workers 2]   # CPU: compile them all

train.py writes RUN_DIR/untuned_gemms.json (and logs this command) when the table has no entry for some of
its GEMM shapes on its GPU; then `CODA_TILE_CONFIGS=DIR/tile_configs.json python train.py ...` runs them tuned.
For each bench.py shape (batch x seq of a preset) the launches are the model's (model/coda.py step_gemm_shapes):
every fused GEMM op, the o-projection dgrad `matmul` and the five weight gradients `matmul_tn`; identical shape classes
(tile_configs.shape_class) across shapes are tuned once. Candidates per op: the default first, then a pruned set of
quack SM90 configs (CANDIDATE_TILES x CANDIDATE_CLUSTERS) the op can run (tile_configs.config_errors),
and cuBLAS for the plain GEMMs.

1. Compile: every (op, candidate) kernel, GPU-blind, in --workers subprocesses (QUACK_ARCH=90)
   filling quack's disk cache, so the GPU phase only loads them (--compile-only stops here).
2. Time, on random inputs (bf16, fp32 row statistics): each candidate's first call runs with
   NaN-poisoned outputs and is compared with the default's outputs (partial sums summed, an op's
   declared canonical map applied; relative error <= 1e-2 and finite, else the candidate is
   discarded), then the median of
   triton.testing.do_bench.
3. Write <out>/tile_configs.json (the shipped table with this GPU's measured entries replaced:
   copy it over coda_train/kernels/tile_configs.json to ship it), tune_gemm.json (every timing)
   and tune_gemm.md (op, shape, default ms, best ms, best config, speedup).
A candidate wins only if it is >= 1% faster than the default. --budget-s bounds the whole run:
when it is spent, the compile workers are stopped / the timing stops after the current
candidate, and what was measured is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SHAPES, GpuClocks, sustain  # noqa: E402  (the benchmark's shapes: the ones the table is for)

from coda_train.kernels import Dims, Example  # noqa: E402
from coda_train.kernels.tile_configs import (  # noqa: E402
    CUBLAS, PLAIN_GEMMS, SHIPPED_TABLE, SM90_CLUSTERS, TOKENS_IN_K, Cfg, config_errors, default_cfg, gpu_key, merge_entries, shape_class)
from coda_train.model.coda import step_gemm_shapes  # noqa: E402
from coda_train.model.config import PRESETS  # noqa: E402

TUNED_SHAPES = ("125m", "1b-4x4096", "1b-2x8192", "8b-slice")
# (tile_M, tile_N, pingpong): quack's default, the narrower pingpong tiles whose heavy epilogues fit
# in registers (docs/kernels.md, "Register spills"), and the cooperative tiles that often win on
# large GEMMs; each in two cluster shapes (TMA multicast along M or along N; --clusters adds others, e.g.
# 2x2: both operands multicast, half the L2 reads of the operands a 2x1 or 1x2 cluster makes).
CANDIDATE_TILES = ((128, 192, True), (128, 160, True), (128, 128, True), (256, 128, False), (256, 192, False), (128, 256, False))
CANDIDATE_CLUSTERS = ((2, 1), (1, 2))
TOLERANCE = 1e-2  # relative error vs the default config's output; wrong tiles show up as NaN or O(1)
MIN_GAIN = 0.01  # a candidate replaces the default only when this much faster (timing noise)
CLUSTERS = CANDIDATE_CLUSTERS  # --clusters
COMPILE_ROWS = 256  # token rows of the compile-phase inputs (kernels compile per program, not per M)


def candidates(op: str) -> list[Optional[Cfg]]:
    """The configs tried for `op`: its default first, then every candidate it can run; None = cuBLAS."""
    cands = [default_cfg(op)] + [Cfg(m, n, cm, cn, pp) for m, n, pp in CANDIDATE_TILES for cm, cn in CLUSTERS]
    if op in PLAIN_GEMMS:
        cands.append(None)
    return [c for c in dict.fromkeys(cands) if not config_errors(op, c)]


def gemm_inputs(d: Dims, op: str, m: int, n: int, k: int) -> Callable[[Example], dict]:
    """A builder of `op`'s kwargs for its GEMM (m, n, k) at sizes d, from an Example of the same dims: the block's
    ops take their token rows from d, the LM head's from the launch (its chunk: m, or k in the weight gradient)."""
    M, D, F, V, qkv = d.rows, d.dim, d.ffn_dim, d.vocab_size, d.qkv_dim
    rope = d.n_rope_cols
    if op == "gemm_rowscale_rope":
        return lambda x: dict(h=x.act(M, D), r=x.rowscale(), w=x.weight(qkv, D), rope=x.rope(), n_rope_cols=rope)
    if op == "gemm_residual_rmsnorm_partial":
        return lambda x: dict(a=x.act(M, k), w=x.weight(D, k), residual=x.act(M, D), gamma=x.gamma(D))
    if op == "gemm_rowscale_swiglu":
        return lambda x: dict(h=x.act(M, D), r=x.rowscale(), w_gate_up=x.weight(2 * F, D))
    if op == "gemm_rowscale_exp_cross_entropy":
        return lambda x: dict(h=x.act(m, D), r=x.rowscale()[:m], w_lm=x.weight(V, D, scale=4.0), targets=x.tokens()[:m])
    if op == "gemm_rmsnorm_backward":
        return lambda x: dict(g_y_scaled=x.act(M, k), w=x.weight(k, D), residual_grad=x.act(M, D), x=x.act(M, D),
                              gamma=x.gamma(D), c=x.stat(M, scale=0.01))
    if op == "gemm_exp_rmsnorm_backward":  # random e and strip: timing and config agreement only
        return lambda x: dict(e=x.act(m, V), strip=x.act(V // 64, m), v=x.rowscale()[:m], w=x.weight(V, D),
                              x=x.act(m, D), gamma=x.gamma(D), c=x.stat(m, scale=0.01))
    if op in ("matmul_tn_exp", "matmul_tn_exp_add"):
        acc = (lambda x: dict(acc=x.stat(V, D))) if op == "matmul_tn_exp_add" else (lambda x: {})
        return lambda x: dict(acc(x), e=x.act(k, V), strip=x.act(V // 64, k), hs=x.act(k, D))
    if op == "gemm_dswiglu_rowscale_stat":
        return lambda x: dict(g_out=x.act(M, D), w_down=x.weight(D, F), gate=x.act(M, F), a=x.act(M, F), r=x.rowscale())
    if op == "matmul":
        return lambda x: dict(a=x.act(M, D), b=x.weight(D, n))
    if op == "matmul_tn":
        return lambda x: dict(a=x.act(k, m), b=x.act(k, n))
    raise ValueError(f"no tuning inputs for {op}")


def model_gemms(d: Dims) -> list[tuple[str, tuple[int, int, int], Callable[[Example], dict]]]:
    """(op, (m, n, k), inputs) of every GEMM launch of one CODA training step at sizes d, in model
    order (model/coda.py step_gemm_shapes); inputs(x) builds the op's kwargs from an Example of the same dims."""
    return [(op, (m, n, k), gemm_inputs(d, op, m, n, k)) for op, (m, n, k) in step_gemm_shapes(d)]


def shape_dims(name: str) -> Dims:
    """The kernel sizes of bench.py shape `name` (batch x seq token rows of its preset)."""
    s = SHAPES[name]
    return PRESETS[s.preset].kernel_dims(s.batch * s.seq, s.seq)


def launch_inputs(launch: dict) -> dict:
    """`launch`'s op kwargs on random CUDA inputs (seed 0), as the tuner times it."""
    dims = Dims(**launch["dims"])
    inputs = gemm_inputs(dims, launch["op"], launch["m"], launch["n"], launch["k"])
    return inputs(Example(dims, torch.bfloat16, "cuda", torch.Generator("cuda").manual_seed(0)))


def launches(shapes: list[str], ops: Optional[list[str]], launches_file: Optional[str] = None) -> list[dict]:
    """The distinct launches to tune: {op, m, n, k, shapes, dims} (dims: the sizes of the first shape that
    launches it). With launches_file (a run's untuned_gemms.json, written
    by train.py), the launches it lists at that run's sizes instead of the bench shapes'."""
    wanted = None
    if launches_file:
        spec = json.loads(Path(launches_file).read_text())
        wanted = {shape_class(e["op"], e["m"], e["n"], e["k"]) for e in spec["launches"]}
        sizes = [(Path(launches_file).parent.name or "run", Dims(**spec["dims"]))]
    else:
        sizes = [(name, shape_dims(name)) for name in shapes]
    found = {}
    for name, dims in sizes:
        for op, (m, n, k) in step_gemm_shapes(dims):
            key = shape_class(op, m, n, k)
            if (ops and op not in ops) or (wanted is not None and key not in wanted):
                continue
            if key in found:
                found[key]["shapes"].append(name)
            else:
                found[key] = dict(op=op, m=m, n=n, k=k, shapes=[name], dims=dataclasses.asdict(dims))
    return list(found.values())


# ---- 1. compile, GPU-blind, in worker processes ----------------------------------------------

def compile_jobs(todo: list[dict]) -> list[tuple[int, Cfg]]:
    """(launch index in todo, config) of every quack kernel to compile, grouped by (op, config)."""
    jobs = [(i, c) for i, launch in enumerate(todo) for c in candidates(launch["op"]) if c is not None]
    return sorted(jobs, key=lambda j: (todo[j[0]]["op"], str(j[1]), j[0]))


def compile_launch(launch: dict, cfg: Cfg) -> None:
    """Compile `launch`'s kernel(s) with `cfg` on CPU tensors of COMPILE_ROWS token rows; inside compile_only()."""
    from coda_train.kernels.library import CUTE_IMPLS
    from coda_train.kernels.tile_configs import forced

    dims = dataclasses.replace(Dims(**launch["dims"]), rows=COMPILE_ROWS, seq_len=COMPILE_ROWS)
    op, m, n, k = launch["op"], launch["m"], launch["n"], launch["k"]
    m, k = (m, COMPILE_ROWS) if op in TOKENS_IN_K else (COMPILE_ROWS, k)  # the token dim: one program at any count
    inputs = gemm_inputs(dims, op, m, n, k)
    with forced({op: cfg}):
        CUTE_IMPLS[op].kernel(**inputs(Example(dims, torch.bfloat16, "cpu", None)))


def compile_worker(todo: list[dict], shard: int, n_shards: int) -> int:
    """Compile this shard's (op, config) groups on CPU tensors; one line per compile; returns the failure count."""
    from coda_train.kernels.cute._launch import compile_only

    jobs = compile_jobs(todo)
    groups = sorted({(todo[i]["op"], str(c)) for i, c in jobs})
    mine = set(groups[shard::n_shards])
    failures = 0
    with compile_only():
        for i, cfg in jobs:
            launch, op = todo[i], todo[i]["op"]
            if (op, str(cfg)) not in mine:
                continue
            t0 = time.time()
            try:
                compile_launch(launch, cfg)
                print(f"compiled {op:32s} {str(cfg):26s} {launch['shapes'][0]:12s} {time.time() - t0:6.1f}s", flush=True)
            except Exception as e:  # reported, and the GPU phase discards the candidate
                failures += 1
                print(f"FAILED   {op:32s} {str(cfg):26s} {launch['shapes'][0]:12s} {type(e).__name__}: {str(e)[:300]}", flush=True)
    return failures


def compile_all(args, deadline: float) -> tuple[int, int, float]:
    """Run --workers compile workers until done or the deadline; (compiled, failed, seconds)."""
    env = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="")
    base = [sys.executable, os.path.abspath(__file__), "--shapes", args.shapes, "--ops", args.ops, "--clusters", args.clusters,
            *(["--launches", args.launches] if args.launches else [])]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for i in range(args.workers):
            log = open(os.path.join(logs, f"{i}.log"), "w+")
            procs.append((subprocess.Popen(base + ["--compile-worker", f"{i}/{args.workers}"], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, text=True), log))
        compiled = failed = 0
        for proc, log in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()  # over budget: the GPU phase compiles what is missing, within its own deadline
                proc.wait()
                print(f"compile worker {proc.pid} stopped at the time budget", flush=True)
            log.seek(0)
            lines = log.read().splitlines()
            log.close()
            compiled += sum(ln.startswith("compiled") for ln in lines)
            failed += sum(ln.startswith("FAILED") for ln in lines)
            print("\n".join(ln for ln in lines if ln.startswith(("compiled", "FAILED"))), flush=True)
            if proc.returncode not in (0, 1, -9):  # a crash, not a reported failure: show its tail
                print("\n".join(lines[-20:]), flush=True)
    return compiled, failed, time.time() - t0


# ---- 2. time on the GPU ----------------------------------------------------------------------

def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||y|| in fp32 over chunks (the vocabulary-wide outputs are GBs); NaN if x has any."""
    num = den = 0.0
    for xs, ys in zip(x.reshape(-1).split(1 << 26), y.reshape(-1).split(1 << 26)):
        xs, ys = xs.float(), ys.float()
        num += float((xs - ys).square().sum())
        den += float(ys.square().sum())
    return math.sqrt(num / max(den, 1e-300))


def time_launch(launch: dict, deadline: float, bench: Callable, clocks: bool = False) -> dict:
    """Every candidate of one launch: {op, m, n, k, shapes, results: [{config, ms | error}], ...};
    with `clocks`, each timing's SM clock, power and clock event reasons too (bench.GpuClocks)."""
    from coda_train.kernels import OPS, testing
    from coda_train.kernels.library import CUTE_IMPLS
    from coda_train.kernels.tile_configs import forced

    op = launch["op"]
    kwargs = launch_inputs(launch)
    impl, want, results = CUTE_IMPLS[op].kernel, None, []
    # the timed calls update their own copy of what the op mutates: every candidate's check starts from the same inputs
    timed = {k: v.clone() if k in OPS[op].mutates else v for k, v in kwargs.items()}
    for cfg in candidates(op):
        if time.time() > deadline or (results and want is None):  # out of time, or the default failed
            break
        row = {"config": CUBLAS if cfg is None else str(cfg)}
        t0 = time.time()
        try:
            with forced({op: cfg}):
                with testing.poisoned_cute_outputs():
                    got = testing.results(OPS[op], impl, kwargs)  # on a fresh copy of what the op mutates
                if OPS[op].canonical is not None and all(bool(torch.isfinite(g).all()) for g in got):
                    got = OPS[op].canonical(*got)  # what consumers read, not the config's choice of offsets
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                row["err"] = max(relative_error(g, w) for g, w in zip(got, got if want is None else want))
                if not row["err"] <= TOLERANCE:
                    row["error"] = f"output differs from the default config's (relative error {row['err']:.2e})"
                else:
                    want = got if want is None else want  # the default's: what the others must reproduce
                    with GpuClocks() if clocks else contextlib.nullcontext() as sampled:
                        row["ms"] = bench(lambda: impl(**timed))
                    if clocks and sampled.result:
                        row["clocks"] = sampled.result
            del got
        except Exception as e:  # a config this shape cannot run: discarded, reason kept
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(row)
        clk = row.get("clocks")
        print(f"  {row['config']:26s} " + (f"{row['ms']:8.3f} ms" if "ms" in row else f"-- {row['error'][:100]}")
              + (f"  {clk['sm_mhz_mean']:.0f} MHz {clk['power_w_mean']:.0f} W" if clk else ""), flush=True)
    del kwargs, timed, want
    torch.cuda.empty_cache()
    return dict(launch, results=results)


def best_of(tuned: dict) -> Optional[dict]:
    """The table entry of a timed launch: the fastest candidate if >= MIN_GAIN faster than the
    default (the first result), else the default; None if the default did not run."""
    res = tuned["results"]
    if not res or "ms" not in res[0]:
        return None
    best = min((r for r in res if "ms" in r), key=lambda r: r["ms"])
    if best["ms"] > res[0]["ms"] * (1 - MIN_GAIN):
        best = res[0]
    return dict(op=tuned["op"], m=tuned["m"], n=tuned["n"], k=tuned["k"], config=best["config"],
                default_ms=round(res[0]["ms"], 4), best_ms=round(best["ms"], 4), shapes=tuned["shapes"])


def merged_table(table: dict, gpu: str, entries: list[dict]) -> dict:
    """`table` ({"gpus": {GPU: [entries]}}) with `gpu`'s entries of the same shape class replaced."""
    return dict(table, gpus={**table.get("gpus", {}), gpu: merge_entries(table.get("gpus", {}).get(gpu, []), entries)})


def write_outputs(out: Path, gpu: str, tuned: list[dict], meta: dict) -> list[dict]:
    entries = [e for e in map(best_of, tuned) if e is not None]
    table = merged_table(json.loads(SHIPPED_TABLE.read_text()), gpu, entries)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tile_configs.json").write_text(json.dumps(table, indent=1) + "\n")
    (out / "tune_gemm.json").write_text(json.dumps(dict(meta=meta, launches=tuned), indent=1) + "\n")
    lines = ["| op | shapes | m x n x k | default (ms) | best (ms) | best config | speedup |", "|---|---|---|---:|---:|---|---:|"]
    for e in entries:
        lines.append(f"| {e['op']} | {','.join(e['shapes'])} | {e['m']}x{e['n']}x{e['k']} | {e['default_ms']:.3f} | "
                     f"{e['best_ms']:.3f} | {e['config']} | {e['default_ms'] / e['best_ms']:.2f}x |")
    (out / "tune_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return entries


def main() -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(TUNED_SHAPES), help=f"bench.py shapes, of {sorted(SHAPES)}")
    ap.add_argument("--ops", default="", help="op names to tune (default: every GEMM op)")
    ap.add_argument("--launches", default="", help="a run's untuned_gemms.json (train.py writes it into the run dir): "
                    "tune the GEMM shapes of that run the table lacks, instead of --shapes")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run (default 290 s; --compile-only: none)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="compile processes")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/tune_gemm"))
    ap.add_argument("--compile-only", action="store_true", help="compile every candidate GPU-blind and stop")
    ap.add_argument("--sustained-s", type=float, default=0.0,
                    help="time each candidate after this many seconds of itself back to back (the clock a sustained, "
                         "power-capped step runs at) instead of a short burst, and record clock and power")
    ap.add_argument("--clusters", default=",".join(f"{m}x{n}" for m, n in CANDIDATE_CLUSTERS),
                    help="cluster shapes tried with every candidate tile, MxN comma-separated (default %(default)s; "
                         "quack's SM90 kernel takes 1x1, 2x1, 1x2, 2x2, 4x1, 1x4)")
    ap.add_argument("--compile-worker", default="", help=argparse.SUPPRESS)  # "i/n": one shard of the compiles
    args = ap.parse_args()
    global CLUSTERS
    try:
        CLUSTERS = tuple(tuple(int(x) for x in c.lower().split("x")) for c in args.clusters.split(",") if c)
    except ValueError:
        ap.error(f"--clusters {args.clusters!r}: write cluster shapes as MxN, comma-separated, e.g. 2x1,1x2,2x2")
    if not CLUSTERS or set(CLUSTERS) - SM90_CLUSTERS:
        ap.error(f"--clusters {args.clusters!r}: each must be one of "
                 f"{', '.join(f'{m}x{n}' for m, n in sorted(SM90_CLUSTERS))}")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    ops = [o for o in args.ops.split(",") if o]
    known = {op for name in TUNED_SHAPES for op, _ in step_gemm_shapes(shape_dims(name))}
    if set(ops) - known:
        ap.error(f"unknown ops {sorted(set(ops) - known)}; the model's GEMM ops are {sorted(known)}")
    if args.launches and not Path(args.launches).is_file():
        ap.error(f"--launches {args.launches}: no such file (train.py writes untuned_gemms.json into the run dir)")
    if not (args.compile_only or args.compile_worker or torch.cuda.is_available()):  # before minutes of compiles
        ap.error("tune_gemm.py times GEMMs on a Hopper GPU; run it on the GPU machine (--compile-only runs on CPU)")
    todo = launches(shapes, ops or None, args.launches or None)
    if args.compile_worker:
        shard, n = map(int, args.compile_worker.split("/"))
        return 1 if compile_worker(todo, shard, n) else 0
    budget = args.budget_s if args.budget_s is not None else math.inf if args.compile_only else 290.0
    n_jobs = len(compile_jobs(todo))
    print(f"{len(todo)} launches, {n_jobs} (launch, quack config) kernels, {args.workers} compile workers", flush=True)
    # compiles get at most 60% of a tuning run's budget; the GPU compiles whatever is left over
    compiled, failed, secs = compile_all(args, t_start + budget * (1.0 if args.compile_only else 0.6))
    print(f"compile phase: {compiled} compiled, {failed} failed, {secs:.0f} s", flush=True)
    if args.compile_only:
        return 1 if failed or compiled < n_jobs else 0
    return tune(todo, args, t_start, t_start + budget)


HEAT_S = 5.0  # seconds of GEMMs back to back before a sustained tune's first timing


def tune(todo: list[dict], args, t_start: float, deadline: float) -> int:
    from triton.testing import do_bench

    from coda_train.kernels import op_set

    op_set("cute")  # loads the cute implementations (and checks the GPU)
    gpu = gpu_key(torch.cuda.get_device_name())
    if args.sustained_s:  # each candidate timed after seconds of itself back to back: at the clock it sustains
        bench = lambda fn: do_bench(fn, warmup=1000 * args.sustained_s, rep=500 * args.sustained_s,  # noqa: E731
                                    return_mode="median")
        # the GPU at its power cap before the first candidate too, which otherwise starts from idle (2026-12-07, H100:
        # the first ran at 485 W, the rest at 670-690; docs/bench/tune_rmsnorm_backward_1b_sustained_h100-2026-12-07.md)
        heat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        sustain(lambda: heat @ heat, HEAT_S)
        del heat
    else:
        bench = lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    tuned = []
    for launch in todo:
        if time.time() > deadline - 15:  # keep time to write what was measured
            print(f"time budget spent: {len(todo) - len(tuned)} launches not tuned", flush=True)
            break
        print(f"{launch['op']} {launch['m']}x{launch['n']}x{launch['k']} ({','.join(launch['shapes'])})", flush=True)
        tuned.append(time_launch(launch, deadline - 15, bench, clocks=bool(args.sustained_s)))
    meta = dict(gpu=gpu, device=torch.cuda.get_device_name(), torch=torch.__version__, seconds=round(time.time() - t_start),
                command="python scripts/tune_gemm.py " + " ".join(sys.argv[1:]), untuned=len(todo) - len(tuned))
    write_outputs(Path(args.out), gpu, tuned, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
