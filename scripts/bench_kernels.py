"""Time each fused cute op against the unfused torch sequence it replaces, at the Llama-3 1B and 8B
widths with M = 8192 tokens (batch 4 x seq 2048), bf16, on one Hopper GPU.

  cases   = every declared op with a cute kernel of its own or a GEMM, each example case of its
            declaration (coda_train/kernels/reference.py) at M tokens;
  unfused = the reference op run in bf16 on the GPU: cuBLAS GEMM, then the epilogue math as
            separate torch kernels (exactly the sequence the fused op replaces);
  gemm    = the bare cuBLAS GEMM of the declared (m, n, k) (torch.matmul), the floor for any epilogue;
  attention rows compare FlashAttention 4 with torch SDPA (causal, GQA) instead.
Median of triton.testing.do_bench (warm-up included, compiles excluded); an op that updates an
input in place (declared `mutates`) keeps updating it across the timed calls (timing only: no
output is compared here; scripts/check_kernels.py checks them). Prints a table and
writes bench_kernels.json / bench_kernels.md under --out (default $OUT, else runs/<script name>).

  python scripts/bench_kernels.py [--presets llama3_1b,llama3_8b] [--out DIR]

--plain-gemms times only the model's plain GEMMs (the o-projection dgrad `matmul` and the weight
gradients `matmul_tn`, K = M tokens) on quack's Hopper GEMM vs cuBLAS (torch.matmul): quack with
its default config and with each config of a 3-config tile sweep (QUACK_SWEEP). It decides which
library the `matmul` / `matmul_tn` ops use. Writes bench_plain_gemms.json / .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from coda_train.kernels import OPS, Example, op_set
from coda_train.kernels.library import CUTE_IMPLS
from coda_train.kernels.testing import sdpa_attention, sdpa_attention_rope_backward
from coda_train.model.config import PRESETS

M, T = 8192, 2048


def cases(preset: str, dev):
    """(case name, op, kwargs) of every declared op that has a cute kernel of its own or is a GEMM,
    at the preset's widths with M tokens."""
    example = Example(PRESETS[preset].kernel_dims(M, T), torch.bfloat16, dev, torch.Generator(device=dev).manual_seed(0))
    for name, op in OPS.items():
        if op.gemm is None and CUTE_IMPLS[name].kernel is op.reference:
            continue
        for case, kwargs in op.cases(example):
            yield case, op, kwargs


def baseline(op, kw):
    """(label, callable) of what the fused op replaces: the eager SDPA for attention (and its backward,
    with the RoPE backward as torch ops), else the reference in bf16 (the GEMM, then the epilogue math
    as separate torch kernels)."""
    if op.name == "attention":
        return "SDPA", lambda: sdpa_attention(kw["qkv"], kw["n_heads"], kw["n_kv_heads"], kw["seq_len"])
    if op.name == "attention_backward":
        o, leaf = sdpa_attention(kw["qkv"], kw["n_heads"], kw["n_kv_heads"], kw["seq_len"], requires_grad=True)
        return "SDPA bwd", lambda: torch.autograd.grad(o, leaf, kw["g_o"], retain_graph=True)
    if op.name == "attention_rope_backward_rowscale_stat":
        names = ("g_o", "qkv", "r", "rope", "n_heads", "n_kv_heads", "seq_len")
        return "SDPA bwd + torch RoPE", lambda: sdpa_attention_rope_backward(*(kw[n] for n in names))
    fused = op.gemm is not None and CUTE_IMPLS[op.name].kernel is not op.reference
    return ("torch unfused" if fused else "torch"), lambda: op.reference(**kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="llama3_1b,llama3_8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench_kernels"))
    ap.add_argument("--plain-gemms", action="store_true", help="only the plain GEMMs: quack vs cuBLAS")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("bench_kernels.py times the cute kernels on a Hopper GPU; run it on the GPU machine")
    if args.plain_gemms:
        return bench_plain_gemms(args.presets.split(","), args.out)
    from triton.testing import do_bench

    cute = op_set("cute")
    dev = torch.device("cuda")
    rows = []
    bench = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for preset in args.presets.split(","):
        for name, op, kw in cases(preset, dev):
            fn = getattr(cute, op.name)
            t0 = time.time()
            fn(**kw)  # compile + warm
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            t_cute = bench(lambda: fn(**kw))
            base, base_fn = baseline(op, kw)
            t_base = bench(base_fn)
            t_gemm = None
            if op.gemm:
                m, n, k = op.gemm(**kw)
                a_, b_ = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                t_gemm = bench(lambda: a_ @ b_)
                del a_, b_
            row = dict(preset=preset, op=name, cute_ms=t_cute, baseline=base, baseline_ms=t_base,
                       speedup=t_base / t_cute, bare_gemm_ms=t_gemm, first_call_s=round(compile_s, 1))
            rows.append(row)
            print(f"{preset:10s} {name:40s} cute {t_cute:8.3f} ms | {base:13s} {t_base:8.3f} ms | x{t_base / t_cute:5.2f}"
                  + (f" | bare GEMM {t_gemm:7.3f} ms" if t_gemm else ""), flush=True)
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, M=M, seq_len=T,
                command="python scripts/bench_kernels.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "bench_kernels.md"), "w") as f:
        f.write("| preset | op | cute (ms) | baseline | baseline (ms) | speedup | bare cuBLAS GEMM (ms) |\n")
        f.write("|---|---|---:|---|---:|---:|---:|\n")
        for r in rows:
            g = f"{r['bare_gemm_ms']:.3f}" if r["bare_gemm_ms"] else "-"
            f.write(f"| {r['preset']} | {r['op']} | {r['cute_ms']:.3f} | {r['baseline']} | {r['baseline_ms']:.3f} | "
                    f"{r['speedup']:.2f}x | {g} |\n")


# ---- plain GEMMs: quack vs cuBLAS ----------------------------------------------------------

def plain_gemm_shapes(cfg) -> list[tuple[str, int, int, int, bool]]:
    """(name, m, n, k, a_transposed) of the model's plain GEMMs at M tokens: out = a @ b with a (m, k)
    (a_transposed: a is the (k, m) activation read through .t(), the weight-gradient layout)."""
    d, H, G, Fd, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H
    qkv_dim = (H + 2 * G) * hd
    return [
        ("matmul o-proj dgrad (M,d)x(d,H*hd)", M, H * hd, d, False),
        ("matmul_tn wgrad qkv (qkv_dim x d)", qkv_dim, d, M, True),
        ("matmul_tn wgrad o (d x H*hd)", d, H * hd, M, True),
        ("matmul_tn wgrad gate_up (2ffn x d)", 2 * Fd, d, M, True),
        ("matmul_tn wgrad down (d x ffn)", d, Fd, M, True),
        ("matmul_tn wgrad lm_head (V x d)", V, d, M, True),
    ]


# quack SM90 configs tried besides its default (tile_m, tile_n, pingpong, cluster_m, cluster_n):
# a few of the autotuner's candidates (the full sweep, 44 configs, compiles too long for one run;
# each config compiles once per operand major: 2 here).
QUACK_SWEEP = [(128, 256, False, 2, 1), (256, 128, False, 2, 1), (256, 192, False, 2, 1)]


def bench_plain_gemms(presets, out_dir):
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm as quack_gemm, gemm_tuned
    from triton.testing import do_bench

    dev = torch.device("cuda")
    torch.manual_seed(0)
    bench = lambda f: do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
    configs = {f"{m}x{n}{'p' if pp else 'c'} c{cm}x{cn}": GemmConfig(tile_m=m, tile_n=n, pingpong=pp, cluster_m=cm,
                                                                      cluster_n=cn, is_dynamic_persistent=False,
                                                                      device_capacity=9)
               for m, n, pp, cm, cn in QUACK_SWEEP}
    rows = []
    for preset in presets:
        for name, m, n, k, a_t in plain_gemm_shapes(PRESETS[preset]):
            a = torch.randn(k, m, device=dev, dtype=torch.bfloat16).t() if a_t else torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * k ** -0.5
            want = a @ b
            t0 = time.time()
            got = quack_gemm(a, b, tuned=False)  # compile + warm (quack's default / heuristic config)
            torch.cuda.synchronize()
            first_s = time.time() - t0
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            t_cublas = bench(lambda: a @ b)
            t_quack = bench(lambda: quack_gemm(a, b, tuned=False))
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            sweep = {}
            for cname, cfg in configs.items():
                try:
                    gemm_tuned.fn(a, b, out, config=cfg)
                    sweep[cname] = bench(lambda: gemm_tuned.fn(a, b, out, config=cfg))
                except Exception as e:  # a config the shape/major cannot run: skip it, say why
                    print(f"  {cname}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:80]})", flush=True)
            best = min(sweep, key=sweep.get) if sweep else None
            t_best = min(t_quack, sweep[best]) if best else t_quack
            flops = 2 * m * n * k
            row = dict(preset=preset, gemm=name, m=m, n=n, k=k, cublas_ms=t_cublas, quack_default_ms=t_quack,
                       quack_best_ms=t_best, quack_best_config=best if best and sweep[best] < t_quack else "default",
                       sweep_ms=sweep, cublas_tflops=flops / t_cublas * 1e-9, quack_tflops=flops / t_best * 1e-9,
                       quack_over_cublas=t_best / t_cublas, quack_rel_err=err, first_call_s=round(first_s, 1))
            rows.append(row)
            print(f"{preset:10s} {name:38s} cuBLAS {t_cublas:7.3f} ms ({row['cublas_tflops']:4.0f} TF) | quack default "
                  f"{t_quack:7.3f} | best {t_best:7.3f} ({row['quack_best_config']}, {row['quack_tflops']:4.0f} TF) "
                  f"| quack/cuBLAS {t_best / t_cublas:5.2f} | err {err:.1e}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, M=M, sweep=list(configs),
                command="python scripts/bench_kernels.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(out_dir, "bench_plain_gemms.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, "bench_plain_gemms.md"), "w") as f:
        f.write("| preset | GEMM | m x n x k | cuBLAS (ms) | quack default (ms) | quack best (ms) | best config | quack / cuBLAS |\n")
        f.write("|---|---|---|---:|---:|---:|---|---:|\n")
        for r in rows:
            f.write(f"| {r['preset']} | {r['gemm']} | {r['m']}x{r['n']}x{r['k']} | {r['cublas_ms']:.3f} | "
                    f"{r['quack_default_ms']:.3f} | {r['quack_best_ms']:.3f} | {r['quack_best_config']} | "
                    f"{r['quack_over_cublas']:.2f} |\n")


if __name__ == "__main__":
    main()
