"""Profile training steps (forward + backward) of one model and say where the time goes.

    python scripts/profile_step.py --preset llama3_125m --impl coda --backend cute --batch 8 --seq 2048 --out runs/prof

Prints the top ops by self device time (CPU time without a GPU), and on a GPU the busy fraction:
summed kernel time over wall time of the profiled steps, which separates a host-bound step (GPU
idle between launches) from a slow kernel. Writes a Chrome trace (trace.json) and the table to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from coda_train.kernels import resolve_backend
from coda_train.model import build_model, preset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3_125m")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--impl", default="coda", choices=["coda", "eager", "liger"])
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cute"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("runs/profile"))
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = resolve_backend(args.backend)
    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = preset(args.preset, max_seq_len=max(args.seq, preset(args.preset).max_seq_len), **overrides)
    torch.manual_seed(0)
    model = build_model(cfg, args.impl, backend=backend, compute_dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()

    for _ in range(2):  # compile and warm up outside the profile
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps

    sort_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=args.top)
    header = (f"{args.preset} layers={cfg.n_layers} impl={args.impl} backend={backend} batch={args.batch} "
              f"seq={args.seq} on {torch.cuda.get_device_name() if cuda else 'CPU'}: {wall_ms:.2f} ms/step wall")
    lines = [header]
    if cuda:
        # each kernel's time is "self" time of exactly one row, so the rows sum to the kernel total
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        busy = kernel_us / 1e3 / args.steps
        lines.append(f"GPU kernels {busy:.2f} ms/step = {100 * busy / wall_ms:.0f}% of wall "
                     f"(the rest is the GPU idle between launches: host-bound time)")
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.out / "trace.json"))
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n\n" + table + "\n")
    print(table)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
