"""Would folding γ out of h pay? The RMSNorm weight γ taken out of the stored h = x⊙γ and applied by the
GEMMs that read it, against the shipped ops at bench.py's shapes, on one Hopper GPU (docs/kernels.md,
"Storing fewer tiles": the weight-fold form and the narrower one).

    python scripts/gamma_on_load.py [--shapes 125m,1b-4x4096,8b-slice] [--sustained SECONDS] [--out DIR]

Today F3 and F6 store x and h = x⊙γ (with the partial Σx²), F1 and F5 read h, and the weight gradients of
W_qkv and W_gate_up read h. Without h, F3/F6 store x alone; F1 and F5 read x with γ either folded into their
weight's compute copy (W diag γ: the GEMM as today) or, for F1, applied as its mainloop loads x (quack's
register-sourced A transform, γ as a kvec_m64 strip: γ repeated M/64 times; quack 0.6.5 refuses the transform
with F5's concat_layout, "transform_a: plain dense GEMM only"); the weight gradients read x and scale their
output columns by γ in the epilogue. With γ folded into the weights, B3/B6b lose their γ load and g_γ reduce
and the weight gradients take the reduce over. Rows, each at the shipped op's tile config (a cuBLAS weight
gradient's γ row at quack's default config):
  F3, F3 no h          x1 = x + o W_oᵀ with and without the h store (K = attention width)
  F6, F6 no h          x2 = x1 + a W_downᵀ with and without it (K = ffn_dim)
  B3, B3 no γ          g_x1 = g_x2 + γ⊙((r g_gu) W_gu) + c·x1 with its g_γ partials, and g_x2 + (r g_gu)(W_gu diag γ) + c·x1
  B6b, B6b no γ        the same at the attention side (K = qkv width)
  dW_qkv, dW_qkv γ     (r g_y)ᵀ h as shipped (matmul_tn), and ((r g_y)ᵀ x)⊙γ with the partials of Σ_rows W⊙(r g_y)ᵀ x
  dW_gu, dW_gu γ       the same for W_gate_up
  F1, F1 γ on load     qkv = RoPE(r·(h W_qkvᵀ)) from h, and from x with γ on load (the narrow form)
Per shape: ms a call (median of triton.testing.do_bench; with --sustained, also back to back under the
power cap, as epilogue_ablation.py), the sum of the first six differences (one layer's change with γ folded
into the weights: negative is faster; the optimizer's γ-scaled copies and the LM head are not in it), and
each alternative's outputs against the shipped op's on the same values (F3/F6 and F1 should be bitwise
equal: the transform rounds the exact product of two bf16 values once, as F3's h store does; B3/B6b and the
weight gradients differ by rounding). Writes gamma_on_load.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, RowVecReduce

from coda_train.kernels import Example, op_set
from coda_train.kernels.cute import _epilogues as E
from coda_train.kernels.cute import _rotated_columns
from coda_train.kernels.cute._epilogues import as_stored  # a global: quack keys its cache on each helper
from coda_train.kernels.cute._launch import cfg_for, colvec, gemm, rowvec, sink_rows, stat_cols
from coda_train.kernels.testing import relative_error
from coda_train.kernels.tile_configs import default_cfg
from coda_train.model import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.SHAPES, epilogue_ablation.sustained
from bench import SHAPES  # noqa: E402

FOLD = (("F3", "F3 no h"), ("F6", "F6 no h"), ("B3", "B3 no γ"), ("B6b", "B6b no γ"), ("dW_qkv", "dW_qkv γ"),
        ("dW_gu", "dW_gu γ"))  # the weight-fold form, op by op
PAIRS = FOLD + (("F1", "F1 γ on load"),)


# F3/F6 without h: x = residual + acc (bf16), per-tile Σx²; the next RMSNorm's γ goes to the GEMMs that read x.
@gemm_epilogue(reduces={"sumsq": ColVecReduce("sumsq", scaled=True)})
def residual_sumsq_partial(acc, c):
    x = as_stored(acc + c)
    return {"D": x, "sumsq": (x, x)}


# B3/B6b with γ folded into W: acc = (r g_y) (W diag γ) is already γ⊙g_h, so g_x = residual_grad + acc + c*x,
# and g_γ is the weight gradient's (below): no γ load, no row reduce.
@gemm_epilogue(ops={"coef": ColVecLoad("coef")})
def rmsnorm_backward_folded(acc, c, x, coef):
    return {"D": acc + x * coef + c}


# A weight gradient read from x instead of h = x⊙γ: D = (gᵀ x)⊙γ per output column (fp32), and the per-M-tile
# partials of g_γ = Σ_rows W ⊙ (gᵀ x) (W: the fp32 master, a tile load).
@gemm_epilogue(ops={"gamma": RowVecLoad("gamma")}, reduces={"g_gamma": RowVecReduce("g_gamma", scaled=True)})
def column_scale_gamma_grad(acc, w, gamma):
    return {"D": acc * gamma, "g_gamma": (acc, w)}


def make_runs(shape: str, device: torch.device) -> tuple[dict, dict]:
    """Every row's launch on one set of inputs (runs), and for each alternative the function returning its
    outputs and the shipped op's on the same values (checks). On CPU (compile-only, tests) the alternatives'
    rows alone: the shipped ops go through the op set, which needs a GPU."""
    sh = SHAPES[shape]
    dims = PRESETS[sh.preset].kernel_dims(sh.batch * sh.seq, sh.seq)
    M, d, F, qkv, attn = dims.rows, dims.dim, dims.ffn_dim, dims.qkv_dim, dims.n_heads * dims.head_dim
    gen = torch.Generator(device).manual_seed(0) if device.type == "cuda" else None
    x = Example(dims, torch.bfloat16, device, gen)
    ops = op_set("cute") if device.type == "cuda" else None
    res, o, a_in, gamma, r, rope = x.act(M, d), x.act(M, attn), x.act(M, F), x.gamma(d), x.rowscale(), x.rope()
    w_o, w_down, w_qkv = x.weight(d, attn), x.weight(d, F), x.weight(qkv, d)
    w_gu, g_y, g_gu, g_res, c = x.weight(2 * F, d), x.act(M, qkv), x.act(M, 2 * F), x.act(M, d), x.stat(M, scale=0.01)
    h = (res.float() * gamma.float()).to(torch.bfloat16)  # F3's h of these x (rounded once)
    strip = gamma.reshape(1, d).expand(M // 64, d).contiguous()  # the kvec_m64 strip: γ for every 64 rows
    empty = lambda *s, dtype=torch.bfloat16: torch.empty(*s, device=device, dtype=dtype)  # noqa: E731

    def no_h(a, w):  # F3 / F6 without the h store
        cfg = cfg_for("gemm_residual_rmsnorm_partial", M, d, a.shape[1])
        out, (sumsq, tiles) = empty(M, d), stat_cols(M, d, cfg, device)
        gemm(residual_sumsq_partial, a, w, out, C=res, cfg=cfg, epi={"sumsq": tiles})
        return out, sumsq

    def rope_on_load():
        out = empty(M, qkv)
        gemm(E.rowscale_rope, res, w_qkv, out, cfg=cfg_for("gemm_rowscale_rope", M, qkv, d), strip=(E.strip_scale_cols, strip),
             epi={"cs": rope, "r": colvec(r), "rot": _rotated_columns(qkv, dims.n_rope_cols, device)})
        return out

    def backward_folded(g, w):  # B3 / B6b: acc = (r g) W', g_x = residual_grad + acc + c x
        cfg = cfg_for("gemm_rmsnorm_backward", M, d, g.shape[1])
        out = empty(M, d)
        gemm(rmsnorm_backward_folded, g, w.mT, out, C=g_res, cfg=cfg, epi={"x": res, "coef": colvec(c)})
        return out

    def wgrad_scaled(g, w):  # ((r g)ᵀ x)⊙γ and the partials of g_γ = Σ_rows W ⊙ (r g)ᵀ x
        n = g.shape[1]
        cfg = cfg_for("matmul_tn", n, d, M) or default_cfg("gemm_rowscale")
        out, partials = empty(n, d, dtype=torch.float32), sink_rows(n, d, cfg, device)
        gemm(column_scale_gamma_grad, g.mT, res.mT, out, cfg=cfg,
             epi={"w": w, "gamma": rowvec(gamma), "g_gamma": partials})
        return out

    w_qkv_f, w_gu_f = w_qkv.float(), w_gu.float()  # the fp32 masters the g_γ reduce reads
    w_gu_s, w_qkv_s = ((w.float() * gamma.float()).to(torch.bfloat16) for w in (w_gu, w_qkv))  # W diag γ, bf16
    runs = {
        "F3 no h": lambda: no_h(o, w_o),
        "F6 no h": lambda: no_h(a_in, w_down),
        "B3 no γ": lambda: backward_folded(g_gu, w_gu_s),
        "B6b no γ": lambda: backward_folded(g_y, w_qkv_s),
        "dW_qkv γ": lambda: wgrad_scaled(g_y, w_qkv_f),
        "dW_gu γ": lambda: wgrad_scaled(g_gu, w_gu_f),
        "F1 γ on load": rope_on_load,
    }
    if ops is None:
        return runs, {}
    runs |= {
        "F3": lambda: ops.gemm_residual_rmsnorm_partial(o, w_o, res, gamma),
        "F6": lambda: ops.gemm_residual_rmsnorm_partial(a_in, w_down, res, gamma),
        "F1": lambda: ops.gemm_rowscale_rope(h, r, w_qkv, rope, dims.n_rope_cols),
        "B3": lambda: ops.gemm_rmsnorm_backward(g_gu, w_gu, g_res, res, gamma, c),
        "B6b": lambda: ops.gemm_rmsnorm_backward(g_y, w_qkv, g_res, res, gamma, c),
        "dW_qkv": lambda: ops.matmul_tn(g_y, h),
        "dW_gu": lambda: ops.matmul_tn(g_gu, h),
    }
    runs = {name: runs[name] for pair in PAIRS for name in pair}  # shipped, then its alternative
    checks = {
        "F3 no h": lambda: (runs["F3 no h"](), [t for i, t in enumerate(runs["F3"]()) if i != 1]),  # x and Σx²
        "F6 no h": lambda: (runs["F6 no h"](), [t for i, t in enumerate(runs["F6"]()) if i != 1]),
        "B3 no γ": lambda: ([runs["B3 no γ"]()], [runs["B3"]()[0]]),  # g_x (g_γ: the weight gradient's now)
        "B6b no γ": lambda: ([runs["B6b no γ"]()], [runs["B6b"]()[0]]),
        "dW_qkv γ": lambda: ([runs["dW_qkv γ"]()], [runs["dW_qkv"]()]),
        "dW_gu γ": lambda: ([runs["dW_gu γ"]()], [runs["dW_gu"]()]),
        "F1 γ on load": lambda: ([runs["F1 γ on load"]()], [runs["F1"]()]),
    }
    return runs, checks


def measure(shape: str, sustained_s: float) -> dict:
    from triton.testing import do_bench

    from epilogue_ablation import sustained

    runs, checks = make_runs(shape, torch.device("cuda"))
    row = {"shape": shape, "ms": {}, "max_abs_diff": {}, "rel_err": {}}
    for name, fn in runs.items():
        fn()
        row["ms"][name] = do_bench(fn, warmup=10, rep=100, return_mode="median")
    if sustained_s:
        row["sustained"] = {name: sustained(fn, sustained_s) for name, fn in runs.items()}
    for name, check in checks.items():
        got, want = check()
        row["max_abs_diff"][name] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        row["rel_err"][name] = max(relative_error(g, w) for g, w in zip(got, want))
    row["times"] = {n: s["ms"] for n, s in row["sustained"].items()} if sustained_s else row["ms"]  # what the sums use
    row["layer_delta_ms"] = sum(row["times"][new] - row["times"][old] for old, new in FOLD)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="125m,1b-4x4096,8b-slice")
    p.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="also run each row back to back this long (the layer sum then uses these times)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gamma_on_load")))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("gamma_on_load.py times GEMMs on a Hopper GPU; run it on the GPU machine")
    rows = [measure(s, args.sustained) for s in args.shapes.split(",")]
    for row in rows:
        print(f"{row['shape']}: ms a call (do_bench{', sustained' if args.sustained else ''}); alternative vs shipped")
        t = row["times"]
        for old, new in PAIRS:
            print(f"  {old:8s} {t[old]:8.4f}   {new:14s} {t[new]:8.4f}   {t[new] - t[old]:+8.4f}   "
                  f"max |diff| {row['max_abs_diff'][new]:.2e}, rel {row['rel_err'][new]:.2e}")
        sh = SHAPES[row["shape"]]
        n_layers = sh.n_layers or PRESETS[sh.preset].n_layers
        print(f"  weight fold, one layer {row['layer_delta_ms']:+.4f} ms; the bench step's {n_layers} layers "
              f"{n_layers * row['layer_delta_ms']:+.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gamma_on_load.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
