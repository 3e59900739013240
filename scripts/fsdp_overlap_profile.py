"""How much of FSDP2's communication hides under compute: a few training steps of the CODA model under
FSDP2 (trainer/distributed.py shard_model), profiled on rank 0 with torch.profiler, and the share of
NCCL kernel time during which a compute kernel ran too.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 scripts/fsdp_overlap_profile.py --out runs/overlap
    ... --preset llama3_1b --n-layers 4 --batch 4 --seq 2048 --steps 3 --reshard-after-forward

Random tokens, AdamW steps as in training (no clipping). Prints and writes <out>/fsdp_overlap.json:
per kind of NCCL kernel (all-gather, reduce-scatter, other) its busy time and the part of it that
overlapped compute kernels, plus the compute busy time and the GPU span per step. Without a CUDA GPU it
stops at once (gloo on CPU runs no device kernels, so there is nothing to measure; tests/test_parallel.py checks
the order of FSDP2's gathers and reductions on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Interval = tuple[float, float]


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two unions of sorted, disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def nccl_kind(name: str) -> str | None:
    """all_gather / reduce_scatter / other_nccl for an NCCL kernel's name, None for a compute kernel."""
    lower = name.lower()
    if "nccl" not in lower:
        return None
    if "allgather" in lower:
        return "all_gather"
    if "reducescatter" in lower:
        return "reduce_scatter"
    return "other_nccl"


def overlap_summary(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """kernels: (name, start_us, end_us) of every device kernel of `steps` steps. Busy times are unions of
    intervals (kernels on several streams count once), in ms per step."""
    compute = merged([(s, e) for name, s, e in kernels if nccl_kind(name) is None])
    summary: dict = {"steps": steps, "kernels": len(kernels),
                     "compute_busy_ms": sum(e - s for s, e in compute) / 1e3 / steps,
                     "gpu_span_ms": (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / 1e3 / steps
                     if kernels else 0.0}
    all_nccl: list[Interval] = []
    for kind in ("all_gather", "reduce_scatter", "other_nccl"):
        busy = merged([(s, e) for name, s, e in kernels if nccl_kind(name) == kind])
        all_nccl += busy
        total, hidden = sum(e - s for s, e in busy), covered(busy, compute)
        summary[kind] = {"busy_ms": total / 1e3 / steps, "overlapped_ms": hidden / 1e3 / steps,
                         "overlapped_fraction": hidden / total if total else None}
    busy = merged(all_nccl)
    total, hidden = sum(e - s for s, e in busy), covered(busy, compute)
    summary["nccl"] = {"busy_ms": total / 1e3 / steps, "overlapped_ms": hidden / 1e3 / steps,
                       "exposed_ms": (total - hidden) / 1e3 / steps, "overlapped_fraction": hidden / total if total else None}
    return summary


def device_kernels(trace_file: Path) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the device kernels in a chrome trace written by torch.profiler."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    return [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama3_1b")
    ap.add_argument("--n-layers", type=int, default=None, help="default: the preset's depth")
    ap.add_argument("--batch", type=int, default=4, help="sequences per process")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reshard-after-forward", action="store_true", help="trainer.fsdp_reshard_after_forward=true")
    args = ap.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:  # FSDP2 needs a process group of several processes
        ap.error("fsdp_overlap_profile.py profiles FSDP2 across processes; launch it with "
                 "torchrun --standalone --nproc_per_node=2 (or more), as its docstring shows")
    if not torch.cuda.is_available():  # on CPU it ran the GPU-sized default for minutes to report zeros (or was OOM-killed)
        ap.error("fsdp_overlap_profile.py measures NCCL kernels against compute kernels on CUDA GPUs, and no GPU is "
                 "visible: run it on a multi-GPU machine (on CPU, tests/test_parallel.py checks FSDP2's overlap order)")
    return args


def sharded_training_step(args: argparse.Namespace, device: torch.device):
    """A function running one AdamW step of the CODA model under FSDP2 on random tokens, and the model's config."""
    from coda_train.kernels import resolve_backend
    from coda_train.model import build_model, kernel_shape_errors, preset
    from coda_train.trainer.device import pick_compute_dtype
    from coda_train.trainer.distributed import shard_model
    from coda_train.trainer.optim import OptimConfig, build_optimizer

    dtype, backend = pick_compute_dtype("auto", device), resolve_backend("auto")
    layers = {} if args.n_layers is None else {"n_layers": args.n_layers}
    cfg = preset(args.preset, max_seq_len=args.seq, **layers)
    if errors := kernel_shape_errors(cfg, backend):
        raise SystemExit("; ".join(errors))
    torch.manual_seed(0)  # the same weights on every rank before sharding
    with torch.device(device):
        model = build_model(cfg, "coda", backend=backend, compute_dtype=dtype)
    shard_model(model, dtype, args.reshard_after_forward)
    optimizer = build_optimizer(model, OptimConfig(), device)
    tokens = torch.randint(0, cfg.vocab_size, (2, args.batch, args.seq), device=device)

    def step() -> None:
        model(tokens[0], tokens[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return step, cfg


def main() -> None:
    from coda_train.trainer.device import pick_device
    from coda_train.trainer.distributed import close_world, init_world, process_device

    args = parse_args()
    device = pick_device("auto")
    world = init_world(device.type)
    device = process_device(device, world)
    step, cfg = sharded_training_step(args, device)
    for _ in range(args.warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) if world.is_main else contextlib.nullcontext() as prof:
        for _ in range(args.steps):
            step()
    wall_ms = (time.perf_counter() - started) * 1e3 / args.steps
    if world.is_main:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            summary = overlap_summary(device_kernels(Path(f"{tmp}/trace.json")), args.steps)
        summary.update(preset=args.preset, n_layers=cfg.n_layers, batch=args.batch, seq=args.seq,
                       processes=world.world_size, reshard_after_forward=args.reshard_after_forward,
                       wall_ms_per_step_profiled=wall_ms, nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                       peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fsdp_overlap.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
    close_world(world)


if __name__ == "__main__":
    main()
