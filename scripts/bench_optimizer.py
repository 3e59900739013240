"""The optimizer's share of a training step, before and after its one-pass AdamW, on one GPU.

Per benchmark shape, on the CODA model's parameters (gradients and bf16 compute copies as a
training step leaves them), times in one process, alternating:
- `torch`: the step as the trainer took it before kernels/adamw.py: the global gradient norm,
  clip_grads_with_norm_ (a multiply of every gradient in place), torch's fused AdamW, then the
  compute copies cast from the updated weights (refresh_compute_copies(force=True));
- `one-pass`: the trainer's AdamW: the norm, then one pass per parameter group that applies the
  clip factor as it reads each gradient and writes the copies (trainer/optim.py).
Then both run 3 steps from the same weights, gradients and state and the script prints how far
apart the weights, moments and copies end. Writes $OUT-style JSON with --out.

  python scripts/bench_optimizer.py --shapes 125m,1b-4x4096,8b-slice --out DIR
  python scripts/bench_optimizer.py --grad-offset 8 --sweep 2048x4x1u   # gradients off alignment, as under FSDP2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the shapes and model configs of the benchmark)


def build(shape_name: str, grad_offset: int = 0):
    """The CODA model of the shape with the copies its forward reads and random gradients, each a view
    grad_offset bytes past an aligned address (FSDP2's place for them after a shard of odd size)."""
    from coda_train.model import build_model

    shape = bench.SHAPES[shape_name]
    torch.manual_seed(0)
    model = build_model(bench.model_config(shape), "coda", backend="reference", compute_dtype=torch.bfloat16).cuda()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 64), device="cuda")
    model(tokens, tokens).backward()  # every compute copy a step reads exists (the reference ops read the same)
    g = torch.Generator(device="cuda").manual_seed(1)
    for p in model.parameters():
        skip = grad_offset // 4
        p.grad = torch.empty(p.numel() + skip, device="cuda")[skip:].view(p.shape)
        p.grad.copy_(torch.randn(p.shape, device="cuda", generator=g) * 1e-2)
    return model


def optimizers(model):
    """(torch's fused AdamW with the old clip and refresh, the trainer's AdamW) over model's parameters."""
    from coda_train.config import OptimConfig
    from coda_train.trainer.optim import build_optimizer

    ours = build_optimizer(model, OptimConfig(), torch.device("cuda"))
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in ours.param_groups]
    cfg = OptimConfig()
    theirs = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    return theirs, ours


def steps(model, theirs, ours):
    from coda_train.trainer.distributed import global_grad_norm
    from coda_train.trainer.optim import clip_factor

    params = list(model.parameters())

    def torch_step() -> None:
        norm = global_grad_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        theirs.step()
        model.refresh_compute_copies(force=True)

    def one_pass_step() -> None:
        ours.grad_factor = clip_factor(global_grad_norm(params), 1.0)
        ours.step()

    return {"torch": torch_step, "one-pass": one_pass_step}


def time_ms(fn, iters: int) -> tuple[float, float]:
    """(GPU ms, host ms) per call: the calls are queued behind a sleep kernel, so the GPU time is the
    kernels' alone even where the host is slower than them. The host time is the time to queue the
    calls; where the launch queue fills up behind the sleep it includes waiting for room in it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e8))  # ~0.1 s at H200 clocks: longer than the host takes to queue the calls
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def kernel_table(fn) -> list[tuple[str, float, int]]:
    """(kernel, device ms, launches) of one call, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def agreement(model, theirs, ours, fns, n: int = 3) -> dict:
    """Max relative differences after n steps of each path from the same weights, gradients and state."""
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in theirs.state[p].items()} for p in params}  # both start from it
    out = {}
    for name, opt in (("torch", theirs), ("one-pass", ours)):
        with torch.no_grad():
            for p, s, g in zip(params, start, grads):
                p.copy_(s)
                p.grad = g.clone()
        for p in params:  # the same state for both (both keep torch's AdamW format)
            for k, v in state[id(p)].items():
                opt.state[p][k] = v.clone()
        model.refresh_compute_copies(force=True)
        for _ in range(n):
            fns[name]()
        out[name] = ([p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params])
    rel = lambda a, b: float(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))  # noqa: E731
    copies = model.compute_copies()
    by_id = {id(p): p for p in params}
    return {"weights_max_rel": max(rel(a, b) for a, b in zip(out["one-pass"][0], out["torch"][0])),
            "exp_avg_max_rel": max(rel(a, b) for a, b in zip(out["one-pass"][1], out["torch"][1])),
            "copies_equal_weights": all(torch.equal(c, by_id[k].detach().bfloat16()) for k, c in copies.items()),
            "copies": len(copies)}


def run(shape_name: str, iters: int, rounds: int, sweep: list[tuple[int, int, int, bool]], grad_offset: int) -> dict:
    from coda_train.kernels import adamw

    model = build(shape_name, grad_offset)
    theirs, ours = optimizers(model)
    fns = steps(model, theirs, ours)
    for fn in fns.values():  # state, Triton compile
        fn()
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(rounds):  # alternating, so clock drift hits both
        for name, fn in fns.items():
            gpu_ms, host_ms = time_ms(fn, iters)
            times[name].append(gpu_ms)
            host[name].append(host_ms)
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    n_copied = sum(p.numel() for p in params if id(p) in model.compute_copies())
    result = {"shape": shape_name, "grad_offset_bytes": grad_offset, "params": n_params, "params_with_copy": n_copied,
              "ms": {k: median(v) for k, v in times.items()}, "ms_rounds": times,
              "host_ms": {k: median(v) for k, v in host.items()},
              "kernels": {name: kernel_table(fn) for name, fn in fns.items()}}
    result["speedup"] = result["ms"]["torch"] / result["ms"]["one-pass"]
    # bytes each path moves (norm 4; torch: clip 8 + AdamW 28 + copy 6; one pass: 28 + copy 2)
    moved = {"torch": 40 * n_params + 6 * n_copied, "one-pass": 32 * n_params + 2 * n_copied}
    result["tb_per_s"] = {k: moved[k] / (result["ms"][k] * 1e-3) / 1e12 for k in moved}
    default = (adamw.BLOCK, adamw.NUM_WARPS, adamw.CHUNKS, adamw.ALIGNED)
    result["sweep"] = []
    for block, warps, chunks, aligned in sweep:  # the one-pass kernel's settings, alternating with the default
        adamw.BLOCK, adamw.NUM_WARPS, adamw.CHUNKS, adamw.ALIGNED = block, warps, chunks, aligned
        fns["one-pass"]()
        tried = time_ms(fns["one-pass"], iters)[0]
        adamw.BLOCK, adamw.NUM_WARPS, adamw.CHUNKS, adamw.ALIGNED = default
        result["sweep"].append({"block": block, "num_warps": warps, "chunks": chunks, "aligned": aligned, "ms": tried,
                                "default_ms": time_ms(fns["one-pass"], iters)[0]})
    result["agreement"] = agreement(model, theirs, ours, fns)
    del model, theirs, ours, fns
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="125m,1b-4x4096,8b-slice", help="comma-separated names of bench.SHAPES")
    ap.add_argument("--iters", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per path (the median is reported)")
    ap.add_argument("--sweep", default="", help="BLOCKxWARPSxCHUNKS[u],... settings of the one-pass kernel to time "
                    "against its default (u: without alignment hints)")
    ap.add_argument("--grad-offset", type=int, default=0, choices=(0, 4, 8, 12),
                    help="every gradient a view this many bytes past an aligned address (as FSDP2 can place them)")
    ap.add_argument("--out", type=Path, help="folder for optimizer_step.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_optimizer.py times CUDA kernels: run it on a GPU")
    results = []
    print("| shape | params (M) | with copy (M) | torch ms | one-pass ms | speedup | torch TB/s | one-pass TB/s "
          "| weights max rel diff | copies = weights |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    sweep = [(*(int(x) for x in item.rstrip("u").split("x")), not item.endswith("u"))
             for item in args.sweep.split(",") if item]
    for name in args.shapes.split(","):
        r = run(name, args.iters, args.rounds, sweep, args.grad_offset)
        results.append(r)
        a = r["agreement"]
        print(f"| {name} | {r['params'] / 1e6:.0f} | {r['params_with_copy'] / 1e6:.0f} | {r['ms']['torch']:.3f} | "
              f"{r['ms']['one-pass']:.3f} | {r['speedup']:.2f} | {r['tb_per_s']['torch']:.2f} | "
              f"{r['tb_per_s']['one-pass']:.2f} | {a['weights_max_rel']:.1e} | {a['copies_equal_weights']} |", flush=True)
    for r in results:
        print(f"\n{r['shape']}: host ms per call {r['host_ms']}")
        for name, rows in r["kernels"].items():
            print(f"  {name}: " + "; ".join(f"{k} {ms:.3f} ms x{n}" for k, ms, n in rows[:6]))
        for t in r["sweep"]:
            print(f"  one-pass BLOCK={t['block']} warps={t['num_warps']} chunks={t['chunks']} aligned={t['aligned']}: "
                  f"{t['ms']:.3f} ms (default {t['default_ms']:.3f})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
        (args.out / "optimizer_step.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
