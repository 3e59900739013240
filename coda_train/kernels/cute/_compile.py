"""GPU-blind compilation of every cute GEMM + epilogue kernel (CI; warming quack's kernel cache).

Run as a module with the arch pinned before cutlass/quack import:

  QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python -m coda_train.kernels.cute._compile [preset ...]

Each op is called on small CPU tensors inside `compile_only()`: the same validation, operand
layout and plan code as on the GPU runs, quack traces and compiles the sm_90a kernel against its
symbolic-shape fakes (one compile per program and config, shared by every M/N/K), and the
launch is skipped. FlashAttention 4 and the Triton RoPE-backward kernel are not covered here
(they compile on first use on the GPU).
"""

from __future__ import annotations

import os
import sys
import time


def compile_all(presets=("tiny", "llama3_125m", "llama3_1b", "llama3_8b"), rows: int = 300, verbose=True) -> dict:
    """Compile every GEMM kernel the ops use at the given presets' widths; returns {name: seconds}."""
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import torch

    import coda_train.kernels.cute as C
    from coda_train.model.config import PRESETS

    from ._launch import compile_only

    bf, f32 = torch.bfloat16, torch.float32
    e = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)  # noqa: E731
    timings = {}
    with compile_only():
        for p in presets:
            cfg = PRESETS[p]
            d, H, G, Fd, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
            hd, T = d // H, rows // 3
            M = 3 * T
            qkv = (H + 2 * G) * hd
            tgt = torch.zeros(M, dtype=torch.long)
            calls = {
                "gemm_rowscale_rope": lambda: C.gemm_rowscale_rope(e(M, d), e(M, dt=f32), e(qkv, d), e(T, hd // 2, dt=f32),
                                                                   e(T, hd // 2, dt=f32), (H + G) * hd),
                "gemm_residual_rmsnorm_partial": lambda: C.gemm_residual_rmsnorm_partial(e(M, H * hd), e(d, H * hd), e(M, d), e(d, dt=f32)),
                "gemm_rowscale_swiglu": lambda: C.gemm_rowscale_swiglu(e(M, d), e(M, dt=f32), e(2 * Fd, d)),
                "gemm_rowscale_cross_entropy": lambda: C.gemm_rowscale_cross_entropy(e(M, d), e(M, dt=f32), e(V, d), tgt),
                "gemm_cross_entropy_backward": lambda: C.gemm_cross_entropy_backward(e(M, d), e(M, dt=f32), e(V, d), tgt,
                                                                                     e(M, dt=f32), 1.0 / M),
                "gemm_dswiglu_rowscale_stat": lambda: C.gemm_dswiglu_rowscale_stat(e(M, d), e(d, Fd), e(M, 2 * Fd), e(M, dt=f32)),
                "gemm_rmsnorm_backward": lambda: C.gemm_rmsnorm_backward(e(M, qkv), e(qkv, d), e(M, d), e(M, d), e(d, dt=f32),
                                                                         e(M, dt=f32)),
                "gemm_rmsnorm_backward(no residual)": lambda: C.gemm_rmsnorm_backward(e(M, V), e(V, d), None, e(M, d),
                                                                                      e(d, dt=f32), e(M, dt=f32)),
            }
            for name, call in calls.items():
                t = time.time()
                call()
                timings[f"{p}:{name}"] = time.time() - t
                if verbose:
                    print(f"compiled {p:12s} {name:36s} {timings[f'{p}:{name}']:6.1f}s", flush=True)
    return timings


if __name__ == "__main__":
    compile_all(tuple(sys.argv[1:]) or ("tiny", "llama3_125m", "llama3_1b", "llama3_8b"))
