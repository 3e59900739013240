"""GPU-blind compilation of every cute GEMM + epilogue kernel (CI; warming quack's kernel cache).

Run as a module with the arch pinned before cutlass/quack import, one dims spec per model shape:

  QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python -m coda_train.kernels.cute._compile [--gpu H200] \
      dim=256,n_heads=4,n_kv_heads=2,ffn_dim=768,vocab_size=8192 [...]

Every example case of every op whose cute implementation is registered with
gpu_blind_compile=True is called on uninitialized CPU tensors inside `compile_only()`: the same
validation, operand layout and plan code as on the GPU runs, quack traces and compiles the sm_90a
kernel against its symbolic-shape fakes (one compile per program and config, shared by every
M/N/K), and the launch is skipped. --gpu compiles the tile configs the table lists for that GPU
(../tile_configs.py) at these shapes; without it, the defaults. FlashAttention 4 and the Triton passes compile on
first use on the GPU instead; the CuTeDSL RoPE-backward pass compiles GPU-blind too
(_rope_backward.compiled, tests/test_kernels_compile.py).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional


def parse_dims(spec: str):
    """Dims from 'dim=..,n_heads=..,n_kv_heads=..,ffn_dim=..,vocab_size=..' (rows, seq_len optional: 300, 100)."""
    from ..declare import Dims

    fields = dict(rows=300, seq_len=100)
    fields.update({k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
    return Dims(**fields)


def compile_cases(dims):
    """[(case name, kwargs, kernel)] of the GPU-blind compilable cute implementations at `dims`."""
    import torch

    from .. import OPS, Example
    from ..library import CUTE_IMPLS  # filled when this package (coda_train.kernels.cute) was imported

    example = Example(dims, torch.bfloat16, "cpu", None)
    compiled = {name: impl.kernel for name, impl in CUTE_IMPLS.items() if impl.gpu_blind_compile}
    return [(case, kwargs, compiled[name]) for name, op in OPS.items() if name in compiled
            for case, kwargs in op.cases(example)]


def compile_all(dims_list, verbose: bool = True, gpu: Optional[str] = None) -> dict:
    """Compile every GPU-blind compilable kernel at each Dims with `gpu`'s tile configs (None: the
    defaults); returns {"<dims>:<case>": seconds}."""
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from ._launch import compile_only

    timings = {}
    with compile_only(gpu):
        for dims in dims_list:
            label = f"d{dims.dim}h{dims.n_heads}"
            for case, kwargs, kernel in compile_cases(dims):
                t = time.time()
                kernel(**kwargs)
                timings[f"{label}:{case}"] = time.time() - t
                if verbose:
                    print(f"compiled {label:12s} {case:40s} {timings[f'{label}:{case}']:6.1f}s", flush=True)
    return timings


if __name__ == "__main__":
    args = sys.argv[1:]
    gpu = None
    if args[:1] == ["--gpu"]:
        gpu, args = args[1], args[2:]
    compile_all([parse_dims(spec) for spec in args], gpu=gpu)
