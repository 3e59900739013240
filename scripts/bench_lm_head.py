"""Time the LM head's forward + backward (logits GEMM, cross-entropy gradient, dgrad, weight gradient)
at the bench shapes on one Hopper GPU, three ways, against the floor of its three cuBLAS GEMMs:

  coda        coda.lm_head_loss on the cute op set, what a training step runs (docs/design.md, "The
              LM head"): H, the logits GEMM storing exponentials with one power-of-two offset per
              (row, 128 columns) and per-row sums; H', two Triton launches on per-row numbers; H'',
              the dgrad GEMM with the RMSNorm backward epilogue and the weight-gradient GEMM, both
              scaling the exponentials as their mainloop loads them; the backward's g_loss scale.
  quack-exp   quack's scaled-exp linear cross-entropy, which H/H'/H'' rewrite with CODA's row scale,
              RMSNorm backward and statistic (no RMSNorm parts: x is normalized).
  quack-base  quack's chunked baseline: torch.mm, a row kernel writing the gradient over the logits,
              two GEMMs. It leaves the last chunk's weight gradient out (its backward), so it is one
              GEMM short of the others.

Each variant is the median of triton.testing.do_bench, with the peak memory one call allocates
above its inputs; the kernels of one call are listed with their times (torch.profiler). Prints a
table and writes bench_lm_head.json / .md under --out (default $OUT, else runs/<script name>).

--chunk-mib 1024,2048 repeats every variant at each bound on one chunk of logits (coda.LOGITS_CHUNK_BYTES,
default the model's): fewer, larger chunks mean fewer read-add-writes of the fp32 weight gradient
and a larger transient buffer.

  python scripts/bench_lm_head.py [--presets llama3_125m,llama3_1b,llama3_8b] [--variants coda,floor]
                                  [--chunk-mib 1024,2048] [--out DIR]
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


def peak_gib(fn, t: dict) -> float:
    """GiB one call of fn allocates at its peak above its inputs (the gradients of an earlier call freed)."""
    t["x"].grad = t["norm"].grad = t["w"].grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


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


def write(rows: list[dict], out: str, meta: dict) -> None:
    """bench_lm_head.json / .md under `out` (rewritten after each preset: a call cut short keeps what it measured)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_lm_head.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(os.path.join(out, "bench_lm_head.md"), "w") as f:
        f.write(f"`{meta['command']}` on {meta['gpu']}, {meta['date']}\n\n")
        f.write("| preset | variant | rows x vocab x dim | chunk rows | ms | / floor | peak GiB above inputs |\n"
                "|---|---|---|---:|---:|---:|---:|\n")
        for r in rows:
            if "ms" in r:
                f.write(f"| {r['preset']} | {r['variant']} | {r['shape']} | {r['chunk_rows']} | {r['ms']:.3f} | "
                        f"{r.get('per_floor', float('nan')):.2f} | {r['peak_gib']:.2f} |\n")
            else:
                f.write(f"| {r['preset']} | {r['variant']} | - | {r['chunk_rows']} | failed: {r['error'][:80]} | - | - |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3_125m,llama3_1b,llama3_8b")
    ap.add_argument("--variants", default="coda,quack-exp,quack-base,floor",
                    help="of coda, quack-exp, quack-base, floor (the three cuBLAS GEMMs)")
    ap.add_argument("--chunk-mib", default=str(coda.LOGITS_CHUNK_BYTES >> 20),
                    help="comma-separated bounds on one chunk of bf16 logits, MiB (coda.LOGITS_CHUNK_BYTES)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench_lm_head"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("bench_lm_head.py times the LM head on a Hopper GPU; run it on the GPU machine")
    wanted = args.variants.split(",")
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="python " + " ".join(sys.argv))
    rows = []
    for preset in args.presets.split(","):
        t = inputs(preset)
        for mib in (int(m) for m in args.chunk_mib.split(",")):
            coda.LOGITS_CHUNK_BYTES = mib << 20
            runs, chunk = variants(t)
            floor_ms, first = None, len(rows)
            for name, fn in runs:
                if name.split()[0] not in wanted:
                    continue
                try:
                    ms = do_bench(fn)
                    top = kernels(fn)
                    peak = peak_gib(fn, t)
                except Exception as e:  # a variant that cannot run this shape is reported, not fatal
                    print(f"{preset:12s} {name:24s} chunk {chunk:6d} failed: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    rows.append(dict(preset=preset, variant=name, chunk_rows=chunk, chunk_mib=mib,
                                     error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                if name.startswith("floor"):
                    floor_ms = ms
                rows.append(dict(preset=preset, variant=name, ms=ms, shape=f"{t['M']} x {t['V']} x {t['d']}",
                                 chunk_rows=chunk, chunk_mib=mib, peak_gib=peak, kernels=top))
                print(f"{preset:12s} {name:24s} chunk {chunk:6d} {ms:8.3f} ms  peak {peak:6.2f} GiB", flush=True)
                for k, kms in top:
                    print(f"{'':38s} {kms:8.3f}  {k}", flush=True)
            for row in rows[first:]:
                if "ms" in row and floor_ms:
                    row["per_floor"] = row["ms"] / floor_ms
            write(rows, args.out, meta)
            torch.cuda.empty_cache()
        del t
        torch.cuda.empty_cache()
    print("\n" + open(os.path.join(args.out, "bench_lm_head.md")).read())


if __name__ == "__main__":
    main()
