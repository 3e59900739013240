"""What is live at the peak of one forward + backward: the allocations the caching allocator holds at
the moment of the step's highest allocated memory, largest first, each with the Python line that
made it. For the memory rows of scripts/bench.py (which report only the peak).

    python scripts/memory_profile.py --shape 8b-slice --variants coda,compile-graphs --out runs/memory

Same weights, batch and step as bench.py's (gradients set to None first, fp32 master weights, bf16
compute). Writes <out>/memory_<shape>.json and prints, per variant, the peak above the weights and
the top allocations live at it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the shapes, the model builds and the step of the benchmark)

SITES = ("coda_train/model/", "liger_kernel/", "coda_train/", "scripts/")  # most telling first


def _site(frames: list[dict]) -> str:
    """The innermost frame in the model (else the library, else ours, else the innermost frame)."""
    for prefix in SITES:
        for f in frames:
            if prefix in f["filename"]:
                return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(bytes above the start at the peak, the allocations made since the start and live at it)."""
    live: dict[int, dict] = {}
    current = peak = 0
    peak_live: list[dict] = []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            current += e["size"]
            if current > peak:
                peak, peak_live = current, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])["size"]
    return peak, peak_live


def profile_variant(variant: str, cfg, state: dict, batch) -> dict:
    impl, mode = bench.MODEL_VARIANTS[variant]
    model = bench.build(impl, cfg, state)
    model.rope_tables(batch[0].shape[1], batch[0].device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fwd_bwd = bench.fwd_bwd_fn(model, mode, *batch)
    for _ in range(2):  # compile, capture and warm up outside the record
        fwd_bwd()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    fwd_bwd()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live = live_at_peak(trace)
    by_site: dict[str, list[int]] = defaultdict(list)
    for e in live:
        by_site[_site(e.get("frames", []))].append(e["size"])
    top = sorted(((sum(s), len(s), site) for site, s in by_site.items()), reverse=True)[:25]
    resident = start - weight_bytes  # held across steps: compute copies, graph pools' static buffers...
    del fwd_bwd, model
    return {"variant": variant, "weights_gib": weight_bytes / 2**30, "resident_above_weights_gib": resident / 2**30,
            "step_peak_above_start_gib": peak / 2**30, "peak_above_weights_gib": (resident + peak) / 2**30,
            "live_at_peak": [{"gib": b / 2**30, "count": n, "site": site} for b, n, site in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(bench.SHAPES))
    p.add_argument("--variants", default="coda,compile-graphs")
    p.add_argument("--out", type=Path, default=Path("runs/memory"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("memory_profile.py reads the CUDA caching allocator; run it on the GPU machine")
    shape = bench.SHAPES[args.shape]
    cfg = bench.model_config(shape)
    torch.manual_seed(0)
    from coda_train.model import build_model

    state = build_model(cfg, "eager").state_dict()
    gen = torch.Generator(device=bench.DEVICE).manual_seed(1)
    batch = tuple(torch.randint(0, cfg.vocab_size, (shape.batch, shape.seq), device=bench.DEVICE, generator=gen)
                  for _ in range(2))
    results = []
    for variant in args.variants.split(","):
        try:
            r = profile_variant(variant, cfg, state, batch)
        except Exception as e:  # one failing variant must not hide the others
            r = {"variant": variant, "error": f"{type(e).__name__}: {e}"[:500]}
        results.append(r)
        torch.cuda.empty_cache()
        print(f"\n{args.shape} {variant}: " + (r.get("error") or
              f"peak {r['peak_above_weights_gib']:.2f} GiB above the weights = resident "
              f"{r['resident_above_weights_gib']:.2f} + step {r['step_peak_above_start_gib']:.2f}"))
        for row in r.get("live_at_peak", [])[:15]:
            print(f"  {row['gib']:7.3f} GiB  x{row['count']:<4d} {row['site']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"memory_{args.shape}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
