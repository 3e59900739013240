"""Does another epilogue subtile pay? The epilogue-heavy GEMMs on pingpong tiles, with quack's
default epilogue subtile (64 x 32 on SM90) against another one (default 64 x 16), on one Hopper GPU.

    python scripts/epilogue_subtile.py [--shapes 125m,1b,8b] [--cases ...] [--subtile MxN] [--configs ...]
        [--rounds N] [--out DIR]

A pingpong warpgroup holds its whole accumulator in registers while its epilogue runs; the
epilogue's own values (loaded tiles, results) come on top, per subtile. At 128 x 192 the dSwiGLU
epilogue spills 280 B a thread with 32-column subtiles and none with 16-column ones, the RMSNorm
backward ~750 B and none (`register_audit.py`-style ptxas -v, GPU-blind), so the wider tiles, whose
mainloop reads less per FLOP, may run without spills. A wider subtile (64 x 64, 128 x 32) halves the
epilogue's subtiles, and with them its per-subtile barriers and pipeline waits, at the cost of more
registers. Each row: one epilogue program at one tile config and subtile, checked against the
case's first program (relative error; NaN-filled outputs, so an unwritten tile shows), median of
triton.testing.do_bench, the programs of a case timed in turn for --rounds rounds (a GEMM's time moves
with the power-capped clock: on the H100 one round misled by 10 %, docs/kernels.md). The RMSNorm
backward stores g_x as D, which quack's subtile override does not reach; its "g_x store"
row is the same program storing g_x as a tile store at quack's subtile. Prints a table and writes
epilogue_subtile.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from quack.epilogue.frontend import gemm_epilogue, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, RowVecReduce, TileStore

from coda_train.kernels.cute import _epilogues as E
from coda_train.kernels.cute._epilogues import as_stored, dswiglu_from_a, swiglu  # globals: quack keys its cache on each helper
from coda_train.kernels.cute._launch import colvec, gemm, rowvec, sink_rows, stat_cols
from coda_train.kernels.testing import relative_error
from coda_train.kernels.tile_configs import Cfg

SUBTILE = (64, 16)  # (M, N) of the epilogue subtile the programs below run with; --subtile sets it before any compile
SHAPES = {"125m": (16384, 2048, 768), "1b": (16384, 8192, 2048), "8b": (8192, 14336, 4096)}  # M, ffn_dim, dim
CONFIGS = ("128x128 c1x2 pingpong", "128x160 c2x1 pingpong", "128x192 c2x1 pingpong", "128x192 c1x2 pingpong")
CASES = ("dswiglu", "swiglu", "residual (K=ffn)", "rmsnorm bwd (K=2ffn)")


class SubtileStore(TileStore):
    """A tile store that sets the whole epilogue's subtile to SUBTILE on SM90 (quack consults its
    store ops for the kernel's epi tile), within the CTA tile; a cooperative tile's subtile spans
    its warpgroups' rows (atom_m x 64), as quack's own does (a 64-row one stores wrong tiles there)."""

    def epi_tile_shape_override(self, arch, cta_tile_shape_mnk, atom_layout_mnk):
        if arch != 90:
            return None
        rows = SUBTILE[0] if atom_layout_mnk[0] == 1 else 64 * atom_layout_mnk[0]
        return (min(rows, cta_tile_shape_mnk[0]), min(SUBTILE[1], cta_tile_shape_mnk[1]))

    def config_key(self):
        return super().config_key() + (("subtile", SUBTILE),)


def _dswiglu(acc, gate, a, r):
    dg, du = dswiglu_from_a(gate, a, acc)
    return {"g_gate": dg * r, "g_up": du * r, "stat": dg * gate + acc * a}


def _swiglu(acc, r):
    g, u = unpack(acc * r)
    g = as_stored(g)
    return {"gate": g, "a": swiglu(g, u)}


def _residual(acc, c, gamma):
    x = as_stored(acc + c)
    return {"D": x, "h": x * gamma, "sumsq": (x, x)}


# the op's programs again, with the first aux store setting the subtile (module globals: quack keys its cache on them)
dswiglu_subtile = gemm_epilogue(outputs=(SubtileStore("g_gate"), "g_up"), ops={"r": ColVecLoad("r")},
                                reduces={"stat": ColVecReduce("stat")})(_dswiglu)
swiglu_subtile = gemm_epilogue(outputs=(SubtileStore("gate", gated=True), "a"), ops={"r": ColVecLoad("r")},
                               mode="acc_pair")(_swiglu)
# B6b: the op's program stores g_x as D, and quack consults only tile stores for the subtile: the same
# program with g_x as a tile store instead, at quack's subtile ("g_x store") and at SUBTILE
def _rmsnorm_backward(acc, c, x, gamma, coef):
    return {"g_x": acc * gamma + x * coef + c, "g_gamma": (acc, x)}


_RMSNORM_BWD = dict(ops={"gamma": RowVecLoad("gamma"), "coef": ColVecLoad("coef")},
                    reduces={"g_gamma": RowVecReduce("g_gamma", scaled=True)})
rmsnorm_backward_store = gemm_epilogue(outputs=("g_x",), **_RMSNORM_BWD)(_rmsnorm_backward)
rmsnorm_backward_subtile = gemm_epilogue(outputs=(SubtileStore("g_x"),), **_RMSNORM_BWD)(_rmsnorm_backward)
residual_subtile = gemm_epilogue(outputs=(SubtileStore("h"),), ops={"gamma": RowVecLoad("gamma")},
                                 reduces={"sumsq": ColVecReduce("sumsq", scaled=True)})(_residual)


def measure(shape: str, configs: list[str], only: tuple = CASES, rounds: int = 1) -> list[dict]:
    from triton.testing import do_bench

    M, F, d = SHAPES[shape]
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    r = torch.rand(M, device=dev, generator=g) + 0.5
    g_out, w_down, gate, a = rn(M, d), rn(d, F) / F ** 0.5, rn(M, F), rn(M, F)
    a_in, x1, gamma, h, w_gate_up = rn(M, F), rn(M, d), rn(d), rn(M, d), rn(2 * F, d) / d ** 0.5
    g_gu, x2, h2, gate_f, a_f = rn(M, 2 * F), rn(M, d), rn(M, d), rn(M, F), rn(M, F)  # outputs, overwritten
    w_gu_t, g_res, g_x = rn(d, 2 * F) / (2 * F) ** 0.5, rn(M, d), rn(M, d)  # B6b: acc = g_gu W_gu (K = 2 ffn)
    coef = torch.randn(M, device=dev, generator=g)

    def dswiglu(prog, cfg, stat):  # B1 as the op launches it
        gemm(prog, g_out, w_down.mT, None, cfg=cfg, epi={"gate": gate, "a": a, "r": colvec(r),
                                                         "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:], "stat": stat})

    def swiglu(prog, cfg, stat):  # F5 as the op launches it (no partial sums: stat stays zero)
        stat.zero_()
        gemm(prog, h, w_gate_up, None, concat=("B",), cfg=cfg, epi={"gate": gate_f, "a": a_f, "r": colvec(r)})

    def residual(prog, cfg, stat):  # F6 as the op launches it
        gemm(prog, a_in, w_down, x2, C=x1, cfg=cfg, epi={"gamma": rowvec(gamma), "h": h2, "sumsq": stat})

    def rmsnorm_bwd(prog, cfg, sink):  # B6b as the op launches it, g_x as D (the op's program) or as a tile store
        store = {"g_x": g_x} if prog is not E.rmsnorm_backward else {}
        gemm(prog, g_gu, w_gu_t, None if store else g_x, C=g_res, cfg=cfg,
             epi={"x": x1, "gamma": rowvec(gamma), "coef": colvec(coef), "g_gamma": sink, **store})

    sub = "x".join(map(str, SUBTILE))
    # case: (launch, its programs by label (quack's subtile first), its stored outputs, its GEMM's N, partials)
    cases = {"dswiglu": (dswiglu, {"default": E.dswiglu_rowscale_stat, sub: dswiglu_subtile}, (g_gu,), F, "cols"),
             "swiglu": (swiglu, {"default": E.rowscale_swiglu, sub: swiglu_subtile}, (gate_f, a_f), F, "cols"),
             "residual (K=ffn)": (residual, {"default": E.residual_rmsnorm_partial, sub: residual_subtile}, (x2, h2), d, "cols"),
             "rmsnorm bwd (K=2ffn)": (rmsnorm_bwd, {"default": E.rmsnorm_backward, "g_x store": rmsnorm_backward_store,
                                                    sub: rmsnorm_backward_subtile}, (g_x,), d, "rows")}
    rows = []
    for text in configs:
        cfg = Cfg.parse(text)
        for case, (launch, programs, outs, n, partials) in cases.items():
            if case not in only:
                continue
            want, done = None, {}
            for label, prog in programs.items():  # check each program once
                row = done[label] = dict(shape=shape, case=case, config=text, subtile=label, ms_rounds=[])
                try:
                    stat = stat_cols(M, n, cfg, dev)[1] if partials == "cols" else sink_rows(M, n, cfg, dev)
                    for t in (*outs, stat):
                        t.fill_(float("nan"))  # unwritten tiles show up in the comparison
                    launch(prog, cfg, stat)
                    got = [t.clone() for t in outs] + [stat.sum(-1 if partials == "cols" else 0)]
                    if want is None:
                        want = got
                    else:
                        row["err_vs_default"] = max(relative_error(x, y) for x, y in zip(got, want))
                    row["stat"] = stat
                except Exception as e:  # a config this program cannot run: reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for _ in range(rounds):  # then time them in turn, round after round
                for label, prog in programs.items():
                    row = done[label]
                    if "error" not in row:
                        stat = row["stat"]
                        row["ms_rounds"].append(round(do_bench(lambda: launch(prog, cfg, stat), warmup=25, rep=100,
                                                               return_mode="median"), 4))
            for label, row in done.items():
                row.pop("stat", None)
                if row["ms_rounds"]:
                    row["ms"] = sorted(row["ms_rounds"])[len(row["ms_rounds"]) // 2]
                rows.append(row)
                print(f"{shape:5s} {case:20s} {text:24s} {label:9s} " +
                      (f"{row['ms']:8.4f} ms ({' '.join(f'{t:.4f}' for t in row['ms_rounds'])})"
                       + (f"  err {row['err_vs_default']:.1e}" if "err_vs_default" in row else "")
                       if "ms" in row else row["error"]), flush=True)
    return rows


def main() -> None:
    global SUBTILE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="125m,1b,8b")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--cases", default=",".join(CASES), help=f"which of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=1, help="time each case's programs in turn this many rounds (median)")
    p.add_argument("--subtile", default="x".join(map(str, SUBTILE)), help="the epilogue subtile MxN against quack's")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/epilogue_subtile")))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("epilogue_subtile.py times GEMM epilogues on a Hopper GPU; run it on the GPU machine")
    SUBTILE = tuple(int(v) for v in args.subtile.split("x"))
    only = tuple(args.cases.split(","))
    if set(only) - set(CASES):
        p.error(f"--cases: unknown {sorted(set(only) - set(CASES))}; choose from {', '.join(CASES)}")
    rows = [r for s in args.shapes.split(",") for r in measure(s, args.configs.split(","), only, args.rounds)]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "epilogue_subtile.json" if SUBTILE == (64, 16) else f"epilogue_subtile_{args.subtile}.json"
    (args.out / name).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "subtile": args.subtile, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
