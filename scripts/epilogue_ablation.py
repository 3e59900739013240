"""Where the dSwiGLU epilogue's time goes: `gemm_dswiglu_rowscale_stat` (B1) against the same GEMM
and tile config with parts of its epilogue removed, at the bench shapes' widths, on one Hopper GPU.

    python scripts/epilogue_ablation.py [--shapes 125m,1b,8b] [--out DIR]

Rows, each the model's g_a = g_out W_down (M x ffn_dim, K = dim) on the op's tuned tile config. The op
reads F5's gate and a and stores g_gate and g_up (four tiles); until 2026-12-05 it read gate and up and
also stored a recomputed a (five tiles): `op (gate, up)` is that program, and the rows from `3 stores`
to `packed` ablate it (docs/kernels.md measured them).
  bare        D = acc (one bf16 store): the GEMM alone
  4 tiles     g_gate = acc * gate, g_up = acc * a, no D: the op's two loads and two stores with two
              multiplies an element, no dSwiGLU: what its traffic costs without its arithmetic
  op (gate, up) the op's program before 2026-12-05: dSwiGLU from gate and up, D = the recomputed a
  3 stores    D, g_gate, g_up = acc (the op's three bf16 stores, no loads)
  2 loads     D = acc * gate + up (the op's two tile loads, one store)
  5 tiles     D = acc, g_gate = acc * gate, g_up = acc * up: the op's two loads and three stores with
              two multiplies an element, no dSwiGLU: what its traffic costs without its arithmetic
  bare+stat   D = acc and the per-row partial sums of acc: the row reduce alone on the bare GEMM
  no stat     the op's epilogue without the per-row partial sums
  stat of acc the op's epilogue with the partial sums of acc instead of dg*gate + du*up: the
              reduce without the statistic's arithmetic
  op          the op as the model calls it (ops.gemm_dswiglu_rowscale_stat); the only row through the
              op's Python path, whose host time do_bench can count on a slow host (docs/kernels.md)
  op (tanh)   the op's epilogue with quack's dswiglu_tanh (sigmoid from one tanh: one MUFU op instead of
              exp2 + rcp), a candidate, timed only
  op (r first) the op's epilogue with the row scale applied to acc before dSwiGLU (one multiply an
              element fewer; the statistic comes out scaled by r), a candidate, timed only
  4 tiles alone  the op's four tiles with no GEMM: one Triton pass loading gate and a and storing
              g_gate = gate * a and g_up = gate + a (the same bytes as `4 tiles`' epilogue, moved at the
              rate a streaming kernel reaches)
  copy        y.copy_(x) of as many bytes (2 · M · ffn_dim bf16 read, as many written): the device's copy
              rate, against which `4 tiles alone` and the epilogue's traffic are read
  packed      the op's epilogue on gate/up stored interleaved ((M, 2F), gate j and up j adjacent), read
              as quack's packed C and written as packed D (mode packed_cd_b16x2: one 32-bit tile load
              and store per pair where the op has two 16-bit ones each), a candidate layout; its
              outputs are checked against op (gate, up)'s on the same values

Median of triton.testing.do_bench; prints a table and writes epilogue_ablation.json under --out.
With --swizzle N, the rows launched here (all but `op`) run with quack's tile-scheduler group size
max_swizzle_size = N (its default 8: how many tile rows or columns the persistent scheduler walks
together), which sets which tiles' epilogue loads and stores are in flight at once.
With --sustained SECONDS, each row also runs back to back for that long (a CUDA graph of 20 calls,
replayed) while nvidia-smi samples the SM clock and power: under the H200's power cap a compute-bound
GEMM runs at the clock its power draw allows, so a row that moves more bytes can be slower per call
partly because the chip clocks it lower. Printed per row: ms a call, mean SM MHz, mean W, and
ms x MHz (the call's SM cycles, in millions: what a clock-independent schedule change would move).
The programs below are module globals so quack's kernel cache can key them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from quack.epilogue.frontend import gemm_epilogue, pack, unpack
from quack.activation import dswiglu as _dswiglu, dswiglu_tanh as _dswiglu_tanh
from quack.epilogue.ops import ColVecLoad, ColVecReduce

from coda_train.kernels import op_set
from coda_train.kernels.library import CUTE_IMPLS
from coda_train.kernels.testing import relative_error
from coda_train.kernels.cute import _epilogues as E
from coda_train.kernels.cute import _launch
from coda_train.kernels.cute._launch import cfg_for, colvec, stat_cols

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.GpuClocks

SWIZZLE = 8  # --swizzle: quack's max_swizzle_size for the gemm() rows


def gemm(*args, **kwargs):
    """The ops' launch (_launch.gemm) with quack's max_swizzle_size set to SWIZZLE."""
    return _launch.gemm(*args, max_swizzle_size=SWIZZLE, **kwargs)


SHAPES = {"125m": (16384, 2048, 768), "1b": (16384, 8192, 2048), "8b": (8192, 14336, 4096)}  # M, ffn_dim, dim


@gemm_epilogue(outputs=("g_gate", "g_up"))
def three_stores(acc):
    return {"D": acc, "g_gate": acc, "g_up": acc}


@gemm_epilogue()
def two_loads(acc, gate, up):
    return {"D": acc * gate + up}


@gemm_epilogue(outputs=("g_gate", "g_up"))
def four_tiles(acc, gate, a):
    return {"g_gate": acc * gate, "g_up": acc * a}


@gemm_epilogue(outputs=("g_gate", "g_up"))
def five_tiles(acc, gate, up):
    return {"D": acc, "g_gate": acc * gate, "g_up": acc * up}


@gemm_epilogue(reduces={"stat": ColVecReduce("stat")})
def plain_stat(acc):
    return {"D": acc, "stat": acc}


@gemm_epilogue(outputs=("g_gate", "g_up"), ops={"r": ColVecLoad("r")}, reduces={"stat": ColVecReduce("stat")})
def dswiglu_rowscale_stat_of_acc(acc, gate, up, r):
    dg, du, a = dswiglu(gate, up, acc)
    return {"D": a, "g_gate": dg * r, "g_up": du * r, "stat": acc}


@gemm_epilogue(outputs=("g_gate", "g_up"), ops={"r": ColVecLoad("r")})
def dswiglu_rowscale(acc, gate, up, r):
    dg, du, a = dswiglu(gate, up, acc)
    return {"D": a, "g_gate": dg * r, "g_up": du * r}


dswiglu_tanh = E._Library(_dswiglu_tanh)
dswiglu = E._Library(_dswiglu)  # quack's dSwiGLU on (gate, up): the op's helper until 2026-12-05


@gemm_epilogue(outputs=("g_gate", "g_up"), ops={"r": ColVecLoad("r")}, reduces={"stat": ColVecReduce("stat")})
def dswiglu_gate_up_rowscale_stat(acc, gate, up, r):
    dg, du, a = dswiglu(gate, up, acc)
    return {"D": a, "g_gate": dg * r, "g_up": du * r, "stat": dg * gate + du * up}


@gemm_epilogue(outputs=("a",), ops={"r": ColVecLoad("r")}, reduces={"stat": ColVecReduce("stat")}, mode="packed_cd_b16x2")
def dswiglu_packed_rowscale_stat(acc, c, r):
    gate, up = unpack(c)
    dg, du, a = dswiglu(gate, up, acc)
    return {"D": pack(dg * r, du * r), "a": a, "stat": dg * gate + du * up}


@gemm_epilogue(outputs=("g_gate", "g_up"), ops={"r": ColVecLoad("r")}, reduces={"stat": ColVecReduce("stat")})
def dswiglu_tanh_rowscale_stat(acc, gate, up, r):
    dg, du, a = dswiglu_tanh(gate, up, acc)
    return {"D": a, "g_gate": dg * r, "g_up": du * r, "stat": dg * gate + du * up}


@gemm_epilogue(outputs=("g_gate", "g_up"), ops={"r": ColVecLoad("r")}, reduces={"stat": ColVecReduce("stat")})
def dswiglu_r_first_stat(acc, gate, up, r):
    dg, du, a = dswiglu(gate, up, acc * r)
    return {"D": a, "g_gate": dg, "g_up": du, "stat": dg * gate + du * up}


@functools.cache
def build_four_tiles_alone():
    """The Triton kernel of `4 tiles alone` (its name is what ncu_ablation.sh filters on), built on first use: triton is a
    GPU-side import here."""
    import triton
    import triton.language as tl

    @triton.jit
    def four_tiles_alone_kernel(gate_ptr, a_ptr, gg_ptr, gu_ptr, F, ld_out, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        g = tl.load(gate_ptr + row * F + cols, mask=mask)
        x = tl.load(a_ptr + row * F + cols, mask=mask)
        tl.store(gg_ptr + row * ld_out + cols, g * x, mask=mask)
        tl.store(gu_ptr + row * ld_out + cols, g + x, mask=mask)

    return four_tiles_alone_kernel


def four_tiles_alone(gate, a, g_gate, g_up):
    """`4 tiles alone`: gate and a read, g_gate and g_up (row stride 2F, halves of g_gu) written, one Triton pass."""
    M, F = gate.shape
    block = 1024
    build_four_tiles_alone()[(M, (F + block - 1) // block)](gate, a, g_gate, g_up, F, g_gate.stride(0), BLOCK=block)


def make_runs(M: int, F: int, d: int, dev: torch.device) -> tuple[dict, SimpleNamespace]:
    """Every row's launch on one set of inputs and output buffers (the buffers, for the comparisons)."""
    rn = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    g_out, w_down, gu, r = rn(M, d), rn(d, F), rn(M, 2 * F), torch.rand(M, device=dev) + 0.5
    gate_c = gu[:, :F].contiguous()  # F5 stores gate and a as tensors of their own
    a_in = torch.nn.functional.silu(gu[:, :F].float()).mul(gu[:, F:].float()).bfloat16()  # F5's a of these gate, up
    cfg = cfg_for("gemm_dswiglu_rowscale_stat", M, F, d)
    a, g_gu = torch.empty(M, F, device=dev, dtype=torch.bfloat16), torch.empty(M, 2 * F, device=dev, dtype=torch.bfloat16)
    gate, up = gu[:, :F], gu[:, F:]
    gu_i = torch.stack((gate, up), dim=-1).reshape(M, 2 * F)  # the same values, gate j and up j adjacent
    g_gu_i, a_i, stat_i = torch.empty_like(gu_i), torch.empty_like(a), stat_cols(M, F, cfg, dev)
    # the op as the model calls it; on CPU (compile-only, tests) the cute kernel under it
    op = op_set("cute").gemm_dswiglu_rowscale_stat if dev.type == "cuda" else CUTE_IMPLS["gemm_dswiglu_rowscale_stat"].kernel
    stat = stat_cols(M, F, cfg, dev)[1]  # the partial-sum sink of the gemm() rows below that reduce (made once)
    runs = {
        "bare": lambda: gemm(E.plain, g_out, w_down.mT, a, cfg=cfg, epi={}),
        "4 tiles": lambda: gemm(four_tiles, g_out, w_down.mT, None, cfg=cfg,
                                epi={"gate": gate_c, "a": a_in, "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:]}),
        "op (gate, up)": lambda: gemm(dswiglu_gate_up_rowscale_stat, g_out, w_down.mT, a, cfg=cfg,
                                      epi={"gate": gate, "up": up, "r": colvec(r), "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:],
                                           "stat": stat}),
        "3 stores": lambda: gemm(three_stores, g_out, w_down.mT, a, cfg=cfg, epi={"g_gate": g_gu[:, :F], "g_up": g_gu[:, F:]}),
        "2 loads": lambda: gemm(two_loads, g_out, w_down.mT, a, cfg=cfg, epi={"gate": gate, "up": up}),
        "5 tiles": lambda: gemm(five_tiles, g_out, w_down.mT, a, cfg=cfg,
                                epi={"gate": gate, "up": up, "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:]}),
        "copy": lambda: g_gu.copy_(gu),
        "bare+stat": lambda: gemm(plain_stat, g_out, w_down.mT, a, cfg=cfg, epi={"stat": stat}),
        "stat of acc": lambda: gemm(dswiglu_rowscale_stat_of_acc, g_out, w_down.mT, a, cfg=cfg,
                                    epi={"gate": gate, "up": up, "r": colvec(r), "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:],
                                         "stat": stat}),
        "no stat": lambda: gemm(dswiglu_rowscale, g_out, w_down.mT, a, cfg=cfg,
                                epi={"gate": gate, "up": up, "r": colvec(r), "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:]}),
        "op": lambda: op(g_out, w_down, gate_c, a_in, r),
        "op (tanh)": lambda: gemm(dswiglu_tanh_rowscale_stat, g_out, w_down.mT, a, cfg=cfg,
                                  epi={"gate": gate, "up": up, "r": colvec(r), "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:],
                                       "stat": stat}),
        "op (r first)": lambda: gemm(dswiglu_r_first_stat, g_out, w_down.mT, a, cfg=cfg,
                                     epi={"gate": gate, "up": up, "r": colvec(r), "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:],
                                          "stat": stat}),
        "packed": lambda: gemm(dswiglu_packed_rowscale_stat, g_out, w_down.mT, g_gu_i, gu_i, cfg=cfg,
                               epi={"r": colvec(r), "a": a_i, "stat": stat_i[1]}),
    }
    if dev.type == "cuda":  # a Triton kernel: no CPU build for the compile-only test
        runs["4 tiles alone"] = lambda: four_tiles_alone(gate_c, a_in, g_gu[:, :F], g_gu[:, F:])
    return runs, SimpleNamespace(cfg=cfg, a=a, g_gu=g_gu, stat=stat, g_gu_i=g_gu_i, a_i=a_i, stat_i=stat_i)


def ablate(M: int, F: int, d: int, rows: list[str], sustained_s: float = 0.0) -> dict:
    from triton.testing import do_bench

    runs_all, b = make_runs(M, F, d, torch.device("cuda"))
    a, g_gu, stat, g_gu_i, a_i, stat_i = b.a, b.g_gu, b.stat, b.g_gu_i, b.a_i, b.stat_i
    runs = {name: runs_all[name] for name in rows if name in runs_all}  # in --rows order: it is the order they run in
    row = {"M": M, "ffn_dim": F, "dim": d, "config": str(b.cfg), "ms": {}}
    for name, fn in runs.items():
        fn()
        row["ms"][name] = do_bench(fn, warmup=10, rep=100, return_mode="median")
    if sustained_s:
        row["sustained"] = {name: sustained(fn, sustained_s) for name, fn in runs.items()}
    def gate_up_outputs() -> tuple:  # the op before 2026-12-05 on the same values: g_gu, a, the statistic
        runs_all["op (gate, up)"]()
        return g_gu.clone(), a.clone(), stat.sum(-1)

    if "op" in runs:  # the op (from gate and a) against its earlier program (from gate and up)
        g_gu_op, stat_op = runs["op"]()
        g_gu_old, _, stat_old = gate_up_outputs()
        row["op_vs_gate_up_rel_err"] = {"g_gu": relative_error(g_gu_op, g_gu_old), "stat": relative_error(stat_op.sum(-1), stat_old)}
    if "op (tanh)" in runs:  # how far the tanh candidate's outputs are from its base program's
        g_gu_old, a_old, _ = gate_up_outputs()
        runs["op (tanh)"]()
        row["tanh_rel_err"] = {"a": relative_error(a, a_old), "g_gu": relative_error(g_gu, g_gu_old)}
    if "packed" in runs:  # the packed layout computes its base program's outputs, interleaved
        g_gu_old, a_old, stat_old = gate_up_outputs()
        runs["packed"]()
        g_gu_halves = g_gu_i.view(M, F, 2).transpose(1, 2).reshape(M, 2 * F)
        row["packed_rel_err"] = {"a": relative_error(a_i, a_old), "g_gu": relative_error(g_gu_halves, g_gu_old),
                                 "stat": relative_error(stat_i[0].sum(-1), stat_old)}
    row["tile_bytes"] = 4 * M * F * 2  # the op's two tile loads and two tile stores, bf16
    for name in ("4 tiles alone", "copy"):  # the streaming rows' rate, in TB/s of those bytes
        if name in row["ms"]:
            row.setdefault("tb_per_s", {})[name] = row["tile_bytes"] / row["ms"][name] / 1e9
    if "bare" in row["ms"]:
        row["gemm_tflops"] = 2 * M * F * d / row["ms"]["bare"] / 1e9
    return row


def sustained(fn, seconds: float, calls: int = 20) -> dict:
    """fn replayed back to back for `seconds` (a CUDA graph of `calls` calls) under nvidia-smi's clock and
    power sampling: ms a call, and the clocks the chip held meanwhile."""
    import time

    from bench import GpuClocks

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm on the capture stream
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    replays, start, end = 0, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with GpuClocks() as clocks:
        t0 = time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(5):
                graph.replay()
            replays += 5
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / (replays * calls)
    c = clocks.result or {}
    return {"ms": ms, "sm_mhz_mean": c.get("sm_mhz_mean"), "power_w_mean": c.get("power_w_mean"),
            "mcycles": ms * c["sm_mhz_mean"] / 1e3 if c.get("sm_mhz_mean") else None,
            "clock_reasons": c.get("clock_reasons")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="125m,1b,8b")
    p.add_argument("--rows", default="bare,4 tiles,op,op (gate, up)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/ablation")))
    p.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="also run each row back to back this long, with the SM clock and power sampled")
    p.add_argument("--swizzle", type=int, default=8, help="quack's max_swizzle_size for every row but `op` (default 8)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("epilogue_ablation.py times GEMM epilogues on a Hopper GPU; run it on the GPU machine")
    global SWIZZLE
    SWIZZLE = args.swizzle
    names = [n.strip() for n in re.split(r",(?![^()]*\))", args.rows)]  # commas inside a row's name, e.g. "op (gate, up)"
    rows = {s: ablate(*SHAPES[s], names, args.sustained) for s in args.shapes.split(",")}
    names = list(next(iter(rows.values()))["ms"])
    print(f"{'shape':6s}{'config':26s}" + "".join(f"{n:>10s}" for n in names) + "   (ms; op / bare)")
    for s, row in rows.items():
        print(f"{s:6s}{row['config']:26s}" + "".join(f"{row['ms'][n]:10.3f}" for n in names)
              + (f"   {row['ms']['op'] / row['ms']['bare']:.2f}" if {"op", "bare"} <= set(row["ms"]) else ""))
    for s, row in rows.items():
        for n, r in row.get("sustained", {}).items():
            print(f"{s:6s}sustained {n:12s} {r['ms']:8.3f} ms a call at {r['sm_mhz_mean'] or float('nan'):6.0f} MHz, "
                  f"{r['power_w_mean'] or float('nan'):5.0f} W: {r['mcycles'] or float('nan'):7.3f} M SM cycles")
    for s, row in rows.items():
        for n, tbs in row.get("tb_per_s", {}).items():
            print(f"{s}: {n} moves the op's four tiles ({row['tile_bytes'] / 1e6:.0f} MB) at {tbs:.2f} TB/s")
    for s, row in rows.items():
        if "op_vs_gate_up_rel_err" in row:
            print(f"{s}: op vs op (gate, up), relative error: " + ", ".join(f"{k} {v:.2e}" for k, v in row["op_vs_gate_up_rel_err"].items()))
        if "packed_rel_err" in row:
            print(f"{s}: packed vs op (gate, up), relative error: " + ", ".join(f"{k} {v:.2e}" for k, v in row["packed_rel_err"].items()))
        if "tanh_rel_err" in row:
            print(f"{s}: op (tanh) vs op (gate, up), relative error: a {row['tanh_rel_err']['a']:.2e}, g_gu {row['tanh_rel_err']['g_gu']:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "epilogue_ablation.json" if args.swizzle == 8 else f"epilogue_ablation_swizzle{args.swizzle}.json"
    (args.out / name).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "swizzle": args.swizzle, "rows": rows},
                                            indent=1))


if __name__ == "__main__":
    main()
