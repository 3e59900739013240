"""Time each fused cute op against the unfused torch sequence it replaces, at the Llama-3 1B and 8B
widths with M = 8192 tokens (batch 4 x seq 2048), bf16, on one Hopper GPU.

  unfused = the reference op run in bf16 on the GPU: cuBLAS GEMM, then the epilogue math as
            separate torch kernels (exactly the sequence the fused op replaces);
  gemm    = the bare cuBLAS GEMM of the same shape (torch.matmul), the floor for any epilogue;
  attention rows compare FlashAttention 4 with torch SDPA (causal, GQA) instead.
Median of triton.testing.do_bench (warm-up included, compiles excluded). Prints a table and
writes bench_kernels.json / bench_kernels.md under --out (default $OUT).

  python scripts/bench_kernels.py [--presets llama3_1b,llama3_8b] [--out DIR]
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
