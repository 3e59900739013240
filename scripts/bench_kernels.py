"""Time each fused cute op against the unfused torch sequence it replaces, at the Llama-3 1B and 8B
widths with M = 8192 tokens (batch 4 x seq 2048), bf16, on one Hopper GPU.

  unfused = the reference op run in bf16 on the GPU: cuBLAS GEMM, then the epilogue math as
            separate torch kernels (exactly the sequence the fused op replaces);
  gemm    = the bare cuBLAS GEMM of the same shape (torch.matmul), the floor for any epilogue;
  attention rows compare FlashAttention 4 with torch SDPA (causal, GQA) instead.
Median of triton.testing.do_bench (warm-up included, compiles excluded). Prints a table and
writes bench_kernels.json / bench_kernels.md under --out (default $OUT).

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
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from coda_train.kernels import reference as ref  # noqa: E402
from coda_train.model.config import PRESETS  # noqa: E402

M, T = 8192, 2048


def cases(cfg, dev, cute):
    d, H, G, Fd, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H
    qkv_dim = (H + 2 * G) * hd
    bf = torch.bfloat16
    rn = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    w = lambda n, k: (torch.randn(n, k, device=dev) * k ** -0.5).to(bf)  # noqa: E731
    r = 0.5 + torch.rand(M, device=dev)
    gamma = 1 + 0.1 * torch.randn(d, device=dev)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float64) / hd))
    ang = torch.arange(T, device=dev, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    tokens = torch.randint(0, V, (M,), device=dev)
    n_rope = (H + G) * hd
    w_lm = w(V, d) * 4
    h = rn(M, d)
    lse, _ = ref.gemm_rowscale_cross_entropy(h, r, w_lm, tokens)
    qkv = rn(M, qkv_dim)
    o, lse_att = cute.attention(qkv, H, G, T)
    return [
        # name, op, kwargs, (gemm m, n, k) for the bare-GEMM floor
        ("gemm_rowscale_rope", dict(h=h, r=r, w=w(qkv_dim, d), cos=cos, sin=sin, n_rope_cols=n_rope), (M, qkv_dim, d)),
        ("gemm_residual_rmsnorm_partial", dict(a=rn(M, H * hd), w=w(d, H * hd), residual=rn(M, d), gamma=gamma), (M, d, H * hd)),
        ("gemm_rowscale_swiglu", dict(h=h, r=r, w_gate_up=w(2 * Fd, d)), (M, 2 * Fd, d)),
        ("gemm_residual_rmsnorm_partial(down)", dict(a=rn(M, Fd), w=w(d, Fd), residual=rn(M, d), gamma=gamma), (M, d, Fd)),
        ("gemm_rowscale_cross_entropy", dict(h=h, r=r, w_lm=w_lm, targets=tokens), (M, V, d)),
        ("gemm_cross_entropy_backward", dict(h=h, r=r, w_lm=w_lm, targets=tokens, lse=lse, grad_scale=torch.tensor(1.0 / M, device=dev)), (M, V, d)),
        ("gemm_dswiglu_rowscale_stat", dict(g_out=rn(M, d), w_down=w(d, Fd), gu=rn(M, 2 * Fd), r=r), (M, Fd, d)),
        ("gemm_rmsnorm_backward", dict(g_y_scaled=rn(M, 2 * Fd), w=w(2 * Fd, d), residual_grad=rn(M, d), x=rn(M, d), gamma=gamma, c=0.01 * torch.randn(M, device=dev)), (M, d, 2 * Fd)),
        ("rope_backward_rowscale_stat", dict(g_qkv=rn(M, qkv_dim), qkv=qkv, r=r, cos=cos, sin=sin, n_rope_cols=n_rope), None),
        ("attention", dict(qkv=qkv, n_heads=H, n_kv_heads=G, seq_len=T), None),
        ("attention_backward", dict(g_o=rn(M, H * hd), qkv=qkv, o=o, lse=lse_att, n_heads=H, n_kv_heads=G, seq_len=T), None),
        ("matmul", dict(a=rn(M, d), b=w(d, H * hd)), None),
        ("matmul_tn", dict(a=rn(M, d), b=rn(M, 2 * Fd)), None),
    ]


def sdpa_fwd(qkv, n_heads, n_kv_heads, seq_len, grad=None):
    Mq = qkv.shape[0]
    hd = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    x = qkv.detach().requires_grad_(grad is not None)
    q, k, v = (t.reshape(Mq // seq_len, seq_len, -1, hd).transpose(1, 2)
               for t in x.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], 1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out, x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="llama3_1b,llama3_8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plain-gemms", action="store_true", help="only the plain GEMMs: quack vs cuBLAS")
    args = ap.parse_args()
    if args.plain_gemms:
        return bench_plain_gemms(args.presets.split(","), args.out)
    from triton.testing import do_bench

    from coda_train import kernels

    kernels.set_backend("cute")
    import coda_train.kernels.cute as cute

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    bench = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for preset in args.presets.split(","):
        cfg = PRESETS[preset]
        for name, kw, mnk in cases(cfg, dev, cute):
            fn = name.split("(")[0]
            t0 = time.time()
            getattr(cute, fn)(**kw)  # compile + warm
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            t_cute = bench(lambda: getattr(cute, fn)(**kw))
            if fn == "attention":
                t_base = bench(lambda: sdpa_fwd(**kw))
                base = "SDPA"
            elif fn == "attention_backward":
                out, x = sdpa_fwd(kw["qkv"], kw["n_heads"], kw["n_kv_heads"], kw["seq_len"], grad=True)
                g = kw["g_o"].reshape(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
                t_base = bench(lambda: torch.autograd.grad(out, x, g, retain_graph=True))
                base = "SDPA bwd"
            else:
                t_base = bench(lambda: getattr(ref, fn)(**kw))
                base = "torch unfused" if mnk else "torch"
            t_gemm = None
            if mnk:
                a_, b_ = torch.randn(mnk[0], mnk[2], device=dev, dtype=torch.bfloat16), torch.randn(mnk[2], mnk[1], device=dev, dtype=torch.bfloat16)
                t_gemm = bench(lambda: a_ @ b_)
                del a_, b_
            row = dict(preset=preset, op=name, cute_ms=t_cute, baseline=base, baseline_ms=t_base,
                       speedup=t_base / t_cute, bare_gemm_ms=t_gemm, first_call_s=round(compile_s, 1))
            rows.append(row)
            print(f"{preset:10s} {name:36s} cute {t_cute:8.3f} ms | {base:13s} {t_base:8.3f} ms | x{t_base / t_cute:5.2f}"
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

    from coda_train.model.config import PRESETS

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
