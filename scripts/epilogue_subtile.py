"""Does another epilogue subtile pay? The epilogue-heavy GEMMs on pingpong tiles, with quack's
default epilogue subtile (64 x 32 on SM90) against another one (default 64 x 16), on one Hopper GPU.

    python scripts/epilogue_subtile.py [--shapes 125m,1b,8b] [--subtile MxN] [--configs ...] [--out DIR]

A pingpong warpgroup holds its whole accumulator in registers while its epilogue runs; the
epilogue's own values (loaded tiles, results) come on top, per subtile. At 128 x 192 the dSwiGLU
epilogue spills ~1 KB a thread with 32-column subtiles and 20 B with 16-column ones
(`register_audit.py`-style ptxas -v, GPU-blind), so the wider tiles, whose mainloop reads less
per FLOP, may run without spills. A wider subtile (64 x 64, 128 x 32) halves the epilogue's subtiles,
and with them its per-subtile barriers and pipeline waits, at the cost of more registers. Each row: the op's epilogue program (`_epilogues.py`) at one
tile config and subtile width, checked against the same config at the default subtile (relative
error), median of triton.testing.do_bench. Prints a table and writes epilogue_subtile.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from quack.epilogue.frontend import gemm_epilogue, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, TileStore

from coda_train.kernels.cute import _epilogues as E
from coda_train.kernels.cute._epilogues import as_stored, dswiglu_from_a, swiglu  # globals: quack keys its cache on each helper
from coda_train.kernels.cute._launch import colvec, gemm, rowvec, stat_cols
from coda_train.kernels.testing import relative_error
from coda_train.kernels.tile_configs import Cfg

SUBTILE = (64, 16)  # (M, N) of the epilogue subtile the programs below run with; --subtile sets it before any compile
SHAPES = {"125m": (16384, 2048, 768), "1b": (16384, 8192, 2048), "8b": (8192, 14336, 4096)}  # M, ffn_dim, dim
CONFIGS = ("128x128 c1x2 pingpong", "128x160 c2x1 pingpong", "128x192 c2x1 pingpong", "128x192 c1x2 pingpong")


class SubtileStore(TileStore):
    """A tile store that sets the whole epilogue's subtile to SUBTILE on SM90 (quack consults its
    store ops for the kernel's epi tile), within the CTA tile."""

    def epi_tile_shape_override(self, arch, cta_tile_shape_mnk, atom_layout_mnk):
        if arch != 90:
            return None
        return (min(SUBTILE[0], cta_tile_shape_mnk[0]), min(SUBTILE[1], cta_tile_shape_mnk[1]))

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
residual_subtile = gemm_epilogue(outputs=(SubtileStore("h"),), ops={"gamma": RowVecLoad("gamma")},
                                 reduces={"sumsq": ColVecReduce("sumsq", scaled=True)})(_residual)


def measure(shape: str, configs: list[str]) -> list[dict]:
    from triton.testing import do_bench

    M, F, d = SHAPES[shape]
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    r = torch.rand(M, device=dev, generator=g) + 0.5
    g_out, w_down, gate, a = rn(M, d), rn(d, F) / F ** 0.5, rn(M, F), rn(M, F)
    a_in, x1, gamma, h, w_gate_up = rn(M, F), rn(M, d), rn(d), rn(M, d), rn(2 * F, d) / d ** 0.5
    g_gu, x2, h2, gate_f, a_f = rn(M, 2 * F), rn(M, d), rn(M, d), rn(M, F), rn(M, F)  # outputs, overwritten

    def dswiglu(prog, cfg, stat):  # B1 as the op launches it
        gemm(prog, g_out, w_down.mT, None, cfg=cfg, epi={"gate": gate, "a": a, "r": colvec(r),
                                                         "g_gate": g_gu[:, :F], "g_up": g_gu[:, F:], "stat": stat})

    def swiglu(prog, cfg, stat):  # F5 as the op launches it (no partial sums: stat stays zero)
        stat.zero_()
        gemm(prog, h, w_gate_up, None, concat=("B",), cfg=cfg, epi={"gate": gate_f, "a": a_f, "r": colvec(r)})

    def residual(prog, cfg, stat):  # F6 as the op launches it
        gemm(prog, a_in, w_down, x2, C=x1, cfg=cfg, epi={"gamma": rowvec(gamma), "h": h2, "sumsq": stat})

    # case: (launch, its two programs (quack's subtile, SUBTILE), its stored outputs, its GEMM's N)
    cases = {"dswiglu": (dswiglu, (E.dswiglu_rowscale_stat, dswiglu_subtile), (g_gu,), F),
             "swiglu": (swiglu, (E.rowscale_swiglu, swiglu_subtile), (gate_f, a_f), F),
             "residual (K=ffn)": (residual, (E.residual_rmsnorm_partial, residual_subtile), (x2, h2), d)}
    rows = []
    for text in configs:
        cfg = Cfg.parse(text)
        for case, (launch, programs, outs, n) in cases.items():
            want = None
            for label, prog in zip(("default", "x".join(map(str, SUBTILE))), programs):
                row = dict(shape=shape, case=case, config=text, subtile=label)
                try:
                    _, stat = stat_cols(M, n, cfg, dev)
                    for t in (*outs, stat):
                        t.fill_(float("nan"))  # unwritten tiles show up in the comparison
                    launch(prog, cfg, stat)
                    got = [t.clone() for t in outs] + [stat.sum(-1)]
                    row["ms"] = round(do_bench(lambda: launch(prog, cfg, stat), warmup=25, rep=100, return_mode="median"), 4)
                    if want is None:
                        want = got
                    else:
                        row["err_vs_default"] = max(relative_error(x, y) for x, y in zip(got, want))
                except Exception as e:  # a config this program cannot run: reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(f"{shape:5s} {case:17s} {text:24s} {label:8s} " +
                      (f"{row['ms']:8.4f} ms" + (f"  err {row['err_vs_default']:.1e}" if "err_vs_default" in row else "")
                       if "ms" in row else row["error"]), flush=True)
    return rows


def main() -> None:
    global SUBTILE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="125m,1b,8b")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--subtile", default="x".join(map(str, SUBTILE)), help="the epilogue subtile MxN against quack's")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/epilogue_subtile")))
    args = p.parse_args()
    SUBTILE = tuple(int(v) for v in args.subtile.split("x"))
    rows = [r for s in args.shapes.split(",") for r in measure(s, args.configs.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "epilogue_subtile.json" if SUBTILE == (64, 16) else f"epilogue_subtile_{args.subtile}.json"
    (args.out / name).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "subtile": args.subtile, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
