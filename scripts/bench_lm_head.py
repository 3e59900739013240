"""Time the LM head's forward + backward (logits GEMM, cross-entropy gradient, dgrad, weight gradient)
at the bench shapes on one Hopper GPU, three ways, against the floor of its three cuBLAS GEMMs:

  coda        coda.lm_head_loss on the cute op set (H: logits GEMM with online-LSE partials, stored
              bf16; H': one Triton pass writing r*g_y over them; H'': the dgrad GEMM with the RMSNorm
              backward epilogue; the weight gradient) -- what a training step runs.
  quack-exp   quack's scaled-exp linear cross-entropy: the logits GEMM stores E = 2^(z log2e - k) with
              one power-of-two offset k per (row, N tile), and the dgrad / weight-gradient GEMMs scale
              E in their mainloop (register-sourced A, per (row, 64 columns) strips): no pass over
              the (rows x vocab) buffer between the GEMMs. No RMSNorm parts (x is normalized).
  quack-base  quack's chunked baseline: torch.mm, a row kernel writing the gradient over the logits,
              two GEMMs.

The point: whether storing the softmax numerator instead of the logits would remove CODA's H' pass
(docs/kernels.md) for less than it costs. Each variant is the median of triton.testing.do_bench;
the kernels of one call are listed with their times (torch.profiler). Prints a table and writes
bench_lm_head.json / .md under --out (default $OUT).

  python scripts/bench_lm_head.py [--presets llama3_125m,llama3_1b,llama3_8b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch
from triton.testing import do_bench

from coda_train.kernels import op_set
from coda_train.model import coda
from coda_train.model.config import PRESETS

ROWS = {"llama3_125m": 16384, "llama3_1b": 16384, "llama3_8b": 8192}  # the bench shapes' token rows


def kernels(fn, top: int = 8) -> list[tuple[str, float]]:
    """(kernel name, ms) of one call of fn, the `top` longest, by the profiler's device time."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:90]] += e.device_time_total / 1e3
    return sorted(total.items(), key=lambda kv: -kv[1])[:top]


def inputs(preset: str):
    cfg = PRESETS[preset]
    M, d, V = ROWS[preset], cfg.dim, cfg.vocab_size
    dev = "cuda"
    x = torch.randn(M, d, device=dev).bfloat16().requires_grad_()
    norm = torch.nn.Parameter(1 + 0.1 * torch.randn(d, device=dev))
    w = torch.nn.Parameter(torch.randn(V, d, device=dev) * d ** -0.5)
    r = torch.rsqrt(x.detach().float().pow(2).mean(-1) + 1e-5)
    h = (x.detach().float() * norm.detach()).bfloat16()
    targets = torch.randint(0, V, (M,), device=dev)
    return dict(x=x, h=h, r=r, norm=norm, w=w, targets=targets, M=M, d=d, V=V)


def _lenient_keys() -> None:
    """quack.epilogue.library's programs close over cutlass internals (a ContextVar, through
    dsl_user_op) that quack's cache keyer rejects on Python 3.12 (the device's), so importing
    quack.linear_cross_entropy fails there. For this script only, a value the keyer rejects is keyed
    by its type and name (coda_train's own programs wrap such helpers instead: cute/_epilogues.py,
    _Library)."""
    from quack.gemm_runtime import identity

    keyer = identity.semantic_value_key

    def semantic_value_key(value, seen):
        try:
            return keyer(value, seen)
        except TypeError:
            return ("opaque", type(value).__module__, type(value).__qualname__, getattr(value, "__qualname__", None))

    identity.semantic_value_key = semantic_value_key


def variants(t: dict):
    _lenient_keys()
    from quack.linear_cross_entropy import chunked_linear_cross_entropy_fwd, scaled_exp_linear_cross_entropy_fwd

    ops = op_set("cute")
    x, h, r, norm, w, targets, M = (t[k] for k in ("x", "h", "r", "norm", "w", "targets", "M"))
    chunk = min(M, coda.logits_chunk_rows(t["V"], 2))
    xn = (h.float() * r[:, None]).bfloat16()  # the normalized input, for the variants without the norm
    w_c = w.detach().bfloat16()
    scale = torch.tensor(1.0 / M, device=x.device)

    def coda_step():
        x.grad = norm.grad = w.grad = None
        loss = coda.lm_head_loss(x, h, r, norm, w, norm.detach().bfloat16(), w_c, targets, ops)
        loss.backward()

    def quack_exp():
        scaled_exp_linear_cross_entropy_fwd(xn, w_c, targets, chunk, grad_scale=scale)

    def quack_base():
        chunked_linear_cross_entropy_fwd(xn, w_c, targets, chunk)

    g = torch.randn(M, t["V"], device=x.device).bfloat16()

    def floor():  # the three GEMMs of one chunk at a time, as each variant runs them
        for i in range(0, M, chunk):
            rows = slice(i, i + chunk)
            torch.mm(xn[rows], w_c.t())
            torch.mm(g[rows], w_c)
            torch.mm(g[rows].t(), xn[rows], out_dtype=torch.float32)

    return [("coda", coda_step), ("quack-exp", quack_exp), ("quack-base", quack_base), ("floor (3 cuBLAS GEMMs)", floor)], chunk


SCALED_CONFIGS = ["128x256 c1x2 cooperative", "128x192 c2x1 pingpong", "128x128 c2x1 pingpong", "256x128 c1x2 cooperative",
                  "128x256 c2x1 cooperative"]


def sweep_scaled(t: dict, chunk: int) -> list[dict]:
    """The last chunk's weight-gradient GEMM with the loss scale (matmul_tn_exp_add's C = D epilogue)
    under each candidate tile config."""
    from coda_train.kernels import reference as R
    from coda_train.kernels.tile_configs import Cfg, forced

    ops = op_set("cute")
    h, r, w, targets = t["h"][:chunk], t["r"][:chunk], t["w"].detach().bfloat16(), t["targets"][:chunk]
    e, k, se, sey, yt = ops.gemm_rowscale_exp_cross_entropy(h, r, w, targets)
    _, strip, v, hs, _ = ops.cross_entropy_exp_backward(e, k, se, sey, yt, targets, r, h, torch.tensor(1.0 / chunk, device=h.device))
    acc = torch.randn(w.shape, device=h.device)
    scale = torch.tensor(0.5, device=h.device)
    out = []
    for text in SCALED_CONFIGS:
        cfg = Cfg.parse(text)
        try:
            with forced({"matmul_tn_exp_add": cfg}):
                want = acc.clone()
                R.matmul_tn_exp_add(want, e.float(), strip.float(), hs.float(), scale)
                got = acc.clone()
                ops.matmul_tn_exp_add(got, e, strip, hs, scale)
                err = float((got - want).norm() / want.norm())
                ms = do_bench(lambda: ops.matmul_tn_exp_add(acc.clone(), e, strip, hs, scale))
                plain = do_bench(lambda: ops.matmul_tn_exp_add(acc.clone(), e, strip, hs))
            out.append(dict(config=text, ms=ms, plain_ms=plain, err=err))
            print(f"   scaled wgrad {text:28s} {ms:7.3f} ms (add without scale {plain:7.3f}) err {err:.1e}", flush=True)
        except Exception as ex:
            print(f"   scaled wgrad {text:28s} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3_125m,llama3_1b,llama3_8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep-scaled", action="store_true", help="only sweep the scaled weight-gradient GEMM's configs")
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        t = inputs(preset)
        runs, chunk = variants(t)
        if args.sweep_scaled:
            print(preset, flush=True)
            rows.append(dict(preset=preset, variant="scaled wgrad sweep", sweep=sweep_scaled(t, chunk)))
            continue
        floor_ms = None
        for name, fn in runs:
            try:
                ms = do_bench(fn)
                top = kernels(fn)
            except Exception as e:  # a variant that cannot run this shape is reported, not fatal
                print(f"{preset:12s} {name:24s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(preset=preset, variant=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            if name.startswith("floor"):
                floor_ms = ms
            rows.append(dict(preset=preset, variant=name, ms=ms, shape=f"{t['M']} x {t['V']} x {t['d']}",
                             chunk_rows=chunk, kernels=top))
            print(f"{preset:12s} {name:24s} {ms:8.3f} ms", flush=True)
            for k, kms in top:
                print(f"{'':38s} {kms:8.3f}  {k}", flush=True)
        for row in rows:
            if row["preset"] == preset and "ms" in row and floor_ms:
                row["per_floor"] = row["ms"] / floor_ms
        del t
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="python " + " ".join(sys.argv))
    with open(os.path.join(args.out, "bench_lm_head.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "bench_lm_head.md"), "w") as f:
        f.write(f"`{meta['command']}` on {meta['gpu']}, {meta['date']}\n\n")
        f.write("| preset | variant | rows x vocab x dim | chunk rows | ms | / floor |\n|---|---|---|---:|---:|---:|\n")
        for r in rows:
            if "sweep" in r:
                f.write("".join(f"| {r['preset']} | scaled wgrad {c['config']} | - | - | {c['ms']:.3f} | - |\n" for c in r["sweep"]))
            elif "ms" in r:
                f.write(f"| {r['preset']} | {r['variant']} | {r['shape']} | {r['chunk_rows']} | {r['ms']:.3f} | "
                        f"{r.get('per_floor', float('nan')):.2f} |\n")
            else:
                f.write(f"| {r['preset']} | {r['variant']} | - | - | failed: {r['error'][:80]} | - |\n")
    print("\n" + open(os.path.join(args.out, "bench_lm_head.md")).read())


if __name__ == "__main__":
    main()
