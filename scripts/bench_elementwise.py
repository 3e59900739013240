"""Time the cute backend's activation-sized passes outside GEMM epilogues at the model widths on one
Hopper GPU, against what they replaced:

  attention_rope_backward_rowscale_stat (B5, B6a): FlashAttention 4's backward with its fp32 -> bf16
      conversions recorded instead of run, then the CuTeDSL RoPE-backward pass on its accumulators
      (kernels/cute/_rope_backward.py). Rows: the op, and FA4's backward with its conversions (the
      attention_backward op: the floor's attention backward); the pass is also timed alone on one
      recorded backward's accumulators, as the op launches it (one launch per thread layout), for each
      candidate of its heads per CTA (HEADS_PER_CTA in _rope_backward.py), and each head group (q, k, v)
      in a launch of its own; its GB/s counts its
      bytes once (the fp32 accumulators and qkv read, g_y written; "/ copy" divides by a device copy of
      as many bytes).
      --baseline REV adds the path of a revision (or a copy of its file) whose _elementwise.py still has the Triton
      rope_backward_rowscale_stat (before 2026-12-02): FA4's backward with its conversions, then that pass.
  embedding_backward (E'): the Triton pass against the torch code it replaced (skip with --no-vs-torch).
  the partial-sum folds: rmsnorm_backward_coeff (B2) on the attention side's (M, H + 2G) partials and
      the MLP side's (M, n_stat_cols(ffn_dim)), rstd_from_partials (F4) on (M, n_stat_cols(dim)), and the
      column sum of g_gamma's (M tiles, dim) partials (B6b) against torch's .sum(0) it replaced; with
      --baseline, the baseline module's folds too. These run in microseconds, inside the step's CUDA
      graph, so they are timed with triton.testing.do_bench_cudagraph (no launch gaps).

Each row is the median of triton.testing.do_bench (do_bench_cudagraph for the folds). Prints a table
and writes bench_elementwise.json / .md under --out (default $OUT, else runs/<script name>).

  python scripts/bench_elementwise.py [--presets llama3_125m,llama3_1b,llama3_8b] [--sections rope,embedding,folds]
                                      [--baseline REV] [--no-vs-torch] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from coda_train.kernels.cute import _elementwise as EW
from coda_train.kernels.cute import _rope_backward as RB
from coda_train.kernels.declare import n_stat_cols
from coda_train.model.config import PRESETS

ROWS = {"llama3_125m": 16384, "llama3_1b": 16384, "llama3_8b": 8192}  # the bench shapes' token rows (8 x 2048, 4 x 4096, 2 x 4096)
SEQ = {"llama3_125m": 2048, "llama3_1b": 4096, "llama3_8b": 4096}
HEADS_PER_CTA_CANDIDATES = [(1,), (2, 1), (4, 2, 1), (8, 4, 2, 1)]  # RoPE pass: the largest that divides a launch's heads


def baseline_module(rev: str):
    """The _elementwise module of git revision `rev` (or the file at path `rev`: where there is no git
    history, as on the device), importable next to the current one."""
    if os.path.isfile(rev):
        with open(rev) as f:
            src = f.read()
    else:
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


def attention_inputs(preset: str):
    """One layer's attention backward operands at the bench shape: g_o, qkv, o, lse, H, G, T."""
    from coda_train.kernels import op_set

    cfg = PRESETS[preset]
    M, hd, T, H, G = ROWS[preset], cfg.head_dim, SEQ[preset], cfg.n_heads, cfg.n_kv_heads
    qkv = torch.randn(M, (H + 2 * G) * hd, device="cuda").bfloat16()
    o, lse = op_set("cute").attention(qkv, H, G, T)
    return torch.randn_like(o), qkv, o, lse, H, G, T


def attention_rope_backward(preset: str, base) -> list[dict]:
    """The op and FlashAttention's backward with its conversions; the RoPE pass alone on the
    accumulators of one recorded backward, for each heads-per-CTA candidate and launch by launch; and
    (base: a baseline _elementwise module) the replaced path."""
    from coda_train.kernels import op_set
    from coda_train.kernels.cute._attention import _fa_backward_recording, rope_passes, run_rope_passes

    ops = op_set("cute")
    g_o, qkv, o, lse, H, G, T = args = attention_inputs(preset)
    M, W = qkv.shape
    hd = W // (H + 2 * G)
    r = torch.rand(M, device="cuda") + 0.5
    a = torch.rand(M, hd // 2, device="cuda") * 6.283
    rope = torch.stack((a.cos(), a.sin()), -1).reshape(M, hd)
    g = torch.empty_like(qkv)
    passes = rope_passes(_fa_backward_recording(g_o, qkv, o, lse, g, H, G, T, "bench"), g, H, G)
    shape, op = f"{M} x {W}", "attention_rope_backward_rowscale_stat"
    # the pass's bytes: its gradient sources (fp32 accumulators, or bf16 in place), qkv read, g_y written
    nbytes = M * W * (2 + 2) + sum(M * p.heads * hd * p.source.element_size() for p in passes)
    copy = copy_ms(nbytes)
    # (label, call, bytes it streams where GB/s and "/ copy" apply: the pass's own, else None)
    runs = [("the op (FA4 backward + RoPE pass)",
             lambda: ops.attention_rope_backward_rowscale_stat(g_o, qkv, o, lse, r, rope, H, G, T), None),
            ("FA4 backward + its conversions (attention_backward)", lambda: ops.attention_backward(*args), None)]
    if base is not None:
        def replaced():
            g_qkv = ops.attention_backward(*args)
            return base.rope_backward_rowscale_stat(g_qkv, qkv, r, rope, (H + G) * hd)
        runs.append(("baseline: FA4 backward + conversions + Triton RoPE pass", replaced, None))
        runs.append(("baseline: its Triton RoPE pass alone",
                     lambda: base.rope_backward_rowscale_stat(g, qkv, r, rope, (H + G) * hd), 3 * M * W * 2))
    for cand in HEADS_PER_CTA_CANDIDATES:
        label = f"RoPE pass alone, heads per CTA {cand}" + (" (shipped)" if cand == RB.HEADS_PER_CTA else "")
        runs.append((label, functools.partial(with_heads_per_cta, cand, lambda: run_rope_passes(passes, qkv, r, rope, g, T)),
                     nbytes))
    for p, group in zip(passes, "qkv"):  # each launch alone, at each heads per CTA that divides its heads
        shipped = RB.heads_per_cta(p.heads)
        for k in (1, 2, 4, 8):
            if p.heads % k:
                continue
            runs.append((f"RoPE pass launch {group} ({'accumulator' if p.from_accumulator else 'bf16 in place'}, "
                         f"tile {p.layout.tile_m} x {p.layout.tile_hd}, {p.layout.num_threads} threads), "
                         f"{k} heads per CTA" + (" (shipped)" if k == shipped else ""),
                         functools.partial(with_heads_per_cta, (k,), functools.partial(run_rope_passes, [p], qkv, r, rope, g, T)),
                         M * p.heads * hd * (p.source.element_size() + 2 + 2)))  # its source, qkv columns, g_y columns
    rows = []
    for label, fn, streamed in runs:
        ms = do_bench(fn)
        ref = copy_ms(streamed) if streamed not in (None, nbytes) else copy
        rows.append(dict(preset=preset, op=op, shape=shape, launch=label, ms=ms,
                         gbps=streamed / ms / 1e6 if streamed else float("nan"),
                         per_copy=ms / ref if streamed else float("nan"), copy_ms=ref if streamed else float("nan")))
        print(f"{preset:10s} {label:58s} {shape:14s} {ms * 1e3:8.1f} us {rows[-1]['gbps']:7.0f} GB/s "
              f"{rows[-1]['per_copy']:5.2f} x copy", flush=True)
    return rows


def with_heads_per_cta(candidates: tuple, fn):
    saved = RB.HEADS_PER_CTA
    RB.HEADS_PER_CTA = candidates
    try:
        return fn()
    finally:
        RB.HEADS_PER_CTA = saved


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


def partial_sum_folds(preset: str, base) -> list[dict]:
    """The row folds at the widths the preset's GEMM epilogues and RoPE pass write, and the column sum of
    g_gamma's partials against torch's reduce (base: a baseline _elementwise module's folds too)."""
    cfg = PRESETS[preset]
    M, d = ROWS[preset], cfg.dim
    r = torch.rand(M, device="cuda") + 0.5
    P_attn, P_mlp, P_res = cfg.n_heads + 2 * cfg.n_kv_heads, n_stat_cols(cfg.ffn_dim), n_stat_cols(d)
    runs = []
    for name, mod in (("shipped", EW),) + ((("baseline", base),) if base is not None else ()):
        for side, P in (("attention side", P_attn), ("MLP side", P_mlp)):
            s = torch.randn(M, P, device="cuda")
            runs.append(("rmsnorm_backward_coeff", f"{M} x {P}", f"{name}, {side}",
                         functools.partial(mod.rmsnorm_backward_coeff, s, r, d)))
        s = torch.rand(M, P_res, device="cuda")
        runs.append(("rstd_from_partials", f"{M} x {P_res}", name, functools.partial(mod.rstd_from_partials, s, d, 1e-5)))
    g_gamma = torch.randn(-(-M // 128), d, device="cuda")
    runs.append(("g_gamma column sum", f"{g_gamma.shape[0]} x {d}", "triton column_sum (shipped)",
                 functools.partial(EW.column_sum, g_gamma)))
    runs.append(("g_gamma column sum", f"{g_gamma.shape[0]} x {d}", "torch .sum(0) (replaced)",
                 functools.partial(g_gamma.sum, 0)))
    rows = []
    for op, shape, label, fn in runs:
        fn()  # compile before the graph capture
        ms = do_bench_cudagraph(fn)
        rows.append(dict(preset=preset, op=op, shape=shape, launch=label, ms=ms, gbps=float("nan"),
                         per_copy=float("nan"), copy_ms=float("nan")))
        print(f"{preset:10s} {op:24s} {shape:14s} {label:42s} {ms * 1e3:8.2f} us (in a CUDA graph)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3_125m,llama3_1b,llama3_8b")
    ap.add_argument("--baseline", default=None, help="also time the replaced path with the Triton RoPE pass of this git revision")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench_elementwise"))
    ap.add_argument("--sections", default="rope,embedding,folds", help="which of rope, embedding, folds to time")
    ap.add_argument("--no-vs-torch", dest="vs_torch", action="store_false",
                    help="skip the embedding backward against torch (as leaving embedding out of --sections)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("bench_elementwise.py times CUDA kernels on a Hopper GPU; run it on the GPU machine")
    sections = set(args.sections.split(","))
    unknown = sections - {"rope", "embedding", "folds"}
    if unknown:
        ap.error(f"unknown --sections {sorted(unknown)}: choose from rope, embedding, folds")
    base = baseline_module(args.baseline) if args.baseline else None
    rows = []
    for preset in args.presets.split(","):
        if "rope" in sections:
            rows += attention_rope_backward(preset, base)
        if "embedding" in sections and args.vs_torch:
            rows += embedding_backward_vs_torch(preset)
        if "folds" in sections:
            rows += partial_sum_folds(preset, base)
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
