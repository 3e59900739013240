"""Sweep the launch shapes of the cute backend's activation-sized Triton pass (coda_train/kernels/cute/
_elementwise.py) at the model widths on one Hopper GPU, against the device's copy bandwidth.

  rope_backward_rowscale_stat          (B6a) reads g_qkv and qkv, writes g_y: 3 x M x qkv_dim bf16
  (the cross-entropy pass it also swept until 2026-12-01 is gone: H' works on per-row numbers now)

and times the embedding backward against the torch code it replaced (skip with --no-vs-torch):
  embedding_backward (E')       g_x rows (M x dim bf16) scatter-added into an fp32 table gradient;
                                torch: acc.index_add_(0, tokens, g_x.float())

Each pass is timed (median of triton.testing.do_bench) for every candidate launch shape; GB/s counts
the bytes above once, and "/ copy" divides by a device-to-device copy that moves as many bytes
(half read, half written; torch's copy_, timed the same way), the practical ceiling of a pass that streams its data once. The shipped
shape (ROPE_LAUNCH) is marked; --baseline REV also times the kernel module of git
revision REV at its own shipped shape. Prints a table and writes bench_elementwise.json / .md under
--out (default $OUT).

  python scripts/bench_elementwise.py [--presets llama3_125m,llama3_1b,llama3_8b] [--baseline HEAD~1] [--no-vs-torch] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from triton.testing import do_bench

from coda_train.kernels.cute import _elementwise as EW
from coda_train.model.config import PRESETS

ROWS = {"llama3_125m": 16384, "llama3_1b": 16384, "llama3_8b": 8192}  # the bench shapes' token rows (8 x 2048, 4 x 4096, 2 x 4096)
ROPE_CANDIDATES = [dict(num_warps=w) for w in (4, 8, 16)]


def baseline_module(rev: str):
    """The _elementwise module of git revision `rev`, importable next to the current one."""
    src = subprocess.run(["git", "show", f"{rev}:coda_train/kernels/cute/_elementwise.py"], capture_output=True,
                         text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "_elementwise_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    name = "coda_train.kernels.cute._elementwise_baseline"  # its relative imports resolve in the same package
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def copy_ms(nbytes: int) -> float:
    """A device copy moving nbytes in all (half read, half written), like a pass counted as nbytes."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src))


def rope_inputs(preset: str):
    cfg = PRESETS[preset]
    M, hd = ROWS[preset], cfg.head_dim
    N = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    g = torch.randn(M, N, device="cuda").bfloat16()
    y = torch.randn(M, N, device="cuda").bfloat16()
    r = torch.rand(M, device="cuda") + 0.5
    a = torch.rand(M, hd // 2, device="cuda") * 6.283
    rope = torch.stack((a.cos(), a.sin()), -1).reshape(M, hd)
    return (g, y, r, rope, (cfg.n_heads + cfg.n_kv_heads) * hd), 3 * g.numel() * 2, f"{M} x {N}"


def embedding_backward_vs_torch(preset: str) -> list[dict]:
    """The embedding backward's Triton pass against the torch code it replaced, on the same inputs
    (GB/s counts g_x read once and each fp32 add once)."""
    cfg = PRESETS[preset]
    M, d, V = ROWS[preset], cfg.dim, cfg.vocab_size
    tokens = torch.randint(0, V, (M,), device="cuda")
    g_x = torch.randn(M, d, device="cuda").bfloat16()
    acc = torch.zeros(V, d, device="cuda")
    op, shape, nbytes = "embedding_backward", f"{M} x {d} -> {V} x {d}", M * d * (2 + 4)
    rows = []
    for label, fn in (("triton (shipped)", lambda: EW.embedding_backward(acc, tokens, g_x)),
                      ("torch (replaced)", lambda: acc.index_add_(0, tokens, g_x.float()))):
        ms = do_bench(fn)
        rows.append(dict(preset=preset, op=op, shape=shape, launch=label, ms=ms, gbps=nbytes / ms / 1e6,
                         per_copy=float("nan"), copy_ms=float("nan")))
        print(f"{preset:10s} {op:38s} {shape:24s} {label:42s} {ms * 1e3:8.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3_125m,llama3_1b,llama3_8b")
    ap.add_argument("--baseline", default=None, help="also time the kernels of this git revision (shipped shapes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-vs-torch", dest="vs_torch", action="store_false", help="skip the embedding backward against torch")
    args = ap.parse_args()
    base = baseline_module(args.baseline) if args.baseline else None
    passes = [("rope_backward_rowscale_stat", "ROPE_LAUNCH", ROPE_CANDIDATES, rope_inputs)]
    rows = []
    for preset in args.presets.split(","):
        for op, knob, candidates, make in passes:
            inputs, nbytes, shape = make(preset)
            copy = copy_ms(nbytes)
            shipped = dict(getattr(EW, knob))
            runs = [(f"{c}" + (" (shipped)" if c == shipped else ""), EW, c) for c in candidates]
            if shipped not in candidates:
                runs.insert(0, (f"{shipped} (shipped)", EW, shipped))
            if base is not None:
                runs.append((f"baseline {args.baseline}", base, None))
            for label, mod, launch in runs:
                saved = dict(getattr(mod, knob, {}))
                if launch is not None:
                    setattr(mod, knob, launch)
                fn = getattr(mod, op)
                try:
                    ms = do_bench(lambda: fn(*inputs))
                finally:
                    if hasattr(mod, knob):
                        setattr(mod, knob, saved)
                row = dict(preset=preset, op=op, shape=shape, launch=label, ms=ms, gbps=nbytes / ms / 1e6,
                           per_copy=ms / copy, copy_ms=copy)
                rows.append(row)
                print(f"{preset:10s} {op:38s} {shape:14s} {label:52s} {ms * 1e3:8.1f} us {row['gbps']:7.0f} GB/s "
                      f"{row['per_copy']:5.2f} x copy", flush=True)
        if args.vs_torch:
            rows += embedding_backward_vs_torch(preset)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="python " + " ".join(sys.argv))
    with open(os.path.join(args.out, "bench_elementwise.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "bench_elementwise.md"), "w") as f:
        f.write(f"`{meta['command']}` on {meta['gpu']}, {meta['date']}\n\n")
        f.write("| preset | op | shape | launch | us | GB/s | / copy |\n|---|---|---|---|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['preset']} | {r['op']} | {r['shape']} | {r['launch']} | {r['ms'] * 1e3:.1f} | "
                    f"{r['gbps']:.0f} | {r['per_copy']:.2f} |\n")


if __name__ == "__main__":
    main()
