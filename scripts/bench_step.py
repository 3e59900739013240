"""Time one training step (forward + backward) of each model implementation side by side.

    python scripts/bench_step.py --preset llama3_125m --batch 8 --seq 2048 [--layers N] [--out results.json]

Variants: eager (PyTorch autograd), eager + torch.compile, eager with Liger kernels, CODA on the
reference backend, CODA on the cute backend (Hopper only). Same weights, same batch, bf16 compute with fp32 master weights.
Median of CUDA-event timings after warm-up; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from coda_train.model import build_model, preset


def time_step(model, tokens, targets, iters: int, warmup: int) -> float:
    """Median milliseconds of loss.backward() including forward, grads zeroed between steps."""
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
    times = []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(tokens, targets).backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3_125m")
    p.add_argument("--layers", type=int, default=None, help="override n_layers (e.g. 2 for a quick 1B/8B shape check)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="eager,compile,liger,coda-reference,coda-cute")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py times GPU steps; run it on the device machine")

    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = preset(args.preset, max_seq_len=max(args.seq, preset(args.preset).max_seq_len), **overrides)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    flops = cfg.flops_per_token(args.seq) * args.batch * args.seq
    rows = []
    for variant in args.variants.split(","):
        impl = {"compile": "eager", "liger": "liger", "eager": "eager"}.get(variant, "coda")
        backend = variant.removeprefix("coda-") if variant.startswith("coda-") else "reference"
        torch.manual_seed(0)
        t0 = time.perf_counter()
        try:
            model = build_model(cfg, impl, backend=backend, compute_dtype=torch.bfloat16).cuda()
            step_model = torch.compile(model) if variant == "compile" else model
            ms = time_step(step_model, tokens, targets, args.iters, args.warmup)
        except Exception as e:  # a variant that cannot run here is reported, not fatal
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"{variant}: failed: {rows[-1]['error']}", flush=True)
            continue
        rows.append({"variant": variant, "ms_per_step": ms, "tokens_per_s": args.batch * args.seq / ms * 1e3,
                     "tflops": flops / ms / 1e9, "setup_s": time.perf_counter() - t0})
        print(f"{variant}: {ms:.2f} ms", flush=True)
        del model, step_model
        torch.cuda.empty_cache()

    base = next((r["ms_per_step"] for r in rows if r["variant"] == "eager" and "ms_per_step" in r), None)
    print(f"\n{args.preset} n_layers={cfg.n_layers} batch={args.batch} seq={args.seq} "
          f"on {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"{'variant':<16}{'ms/step':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'vs eager':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<16}  failed: {r['error'][:80]}")
            continue
        speedup = f"{base / r['ms_per_step']:.2f}x" if base else "-"
        print(f"{r['variant']:<16}{r['ms_per_step']:>10.2f}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.1f}{speedup:>10}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"preset": args.preset, "n_layers": cfg.n_layers, "batch": args.batch,
                                        "seq": args.seq, "device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
