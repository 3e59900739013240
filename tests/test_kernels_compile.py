"""GPU-blind compilation of every cute GEMM + epilogue kernel (runs on CPU, in CI).

With QUACK_ARCH=90 / CUTE_DSL_ARCH=sm_90a, quack traces and compiles each sm_90a kernel without a
GPU; coda_train.kernels.cute._compile drives every op through its real code path (validation,
operand views, plans) with the launch skipped. A kernel that fails to trace or compile fails
here. Runs in a subprocess (the arch must be pinned before cutlass/quack are imported) with a
fresh kernel cache, so it really compiles (~30 s on 2 cores). Skipped where cutlass/quack are
not importable.
"""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import cutlass, quack.epilogue.frontend"], env=ENV,
                           capture_output=True, timeout=300, cwd=ROOT)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def stack():
    if not _importable():
        pytest.skip("cutlass / quack (nvidia-cutlass-dsl, quack-kernels, triton) are not importable here")


def test_import_coda_train_does_not_import_the_gpu_stack():
    code = ("import sys, coda_train, coda_train.kernels, coda_train.model; "
            "bad = [m for m in ('cutlass', 'quack', 'flash_attn', 'coda_train.kernels.cute') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_every_gemm_kernel_compiles_gpu_blind(stack, tmp_path):
    env = dict(ENV, QUACK_CACHE_DIR=str(tmp_path / "quack_cache"))
    run = subprocess.run([sys.executable, "-m", "coda_train.kernels.cute._compile", "tiny", "llama3_8b"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    compiled = [ln for ln in run.stdout.splitlines() if ln.startswith("compiled")]
    assert len(compiled) == 16, run.stdout
    assert any(f.suffix == ".o" for f in (tmp_path / "quack_cache").rglob("*")), "no kernel object in the cache"


def test_unsupported_inputs_raise_value_errors(stack):
    code = r'''
import torch
import coda_train.kernels.cute as C
from coda_train.kernels.cute._launch import compile_only
e = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt)
with compile_only():
    for call, words in [
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 64, dt=torch.float32), e(64, 64), e(64, 64), e(64)), "bfloat16"),
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 60), e(64, 60), e(64, 64), e(64)), "multiple of 8"),
        (lambda: C.gemm_rowscale_rope(e(64, 64), e(64), e(96, 64), e(10, 8), e(10, 8), 64), "multiple of seq_len"),
        (lambda: C.gemm_rowscale_rope(e(60, 64), e(60), e(96, 64), e(10, 8), e(10, 8), 40), "multiple of head_dim"),
    ]:
        try:
            call()
        except ValueError as ex:
            assert words in str(ex), (words, str(ex))
        else:
            raise AssertionError("no ValueError for " + words)
'''
    run = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_model_shape_errors(stack):
    code = r'''
import dataclasses
import coda_train.kernels.cute as C
from coda_train.model import PRESETS
assert "model_shape_errors" not in C.__all__ and "model_shape_errors" not in C.KERNELS
for name, cfg in PRESETS.items():
    assert C.model_shape_errors(cfg) == [], (name, C.model_shape_errors(cfg))
for overrides, words in [
    (dict(dim=200, n_heads=4), ("model.dim=200", "model.n_heads", "head_dim=50")),
    (dict(ffn_dim=100), ("model.ffn_dim=100", "104")),
    (dict(vocab_size=1001), ("model.vocab_size=1001", "1008")),
]:
    errors = C.model_shape_errors(dataclasses.replace(PRESETS["tiny"], **overrides))
    assert len(errors) == 1, (overrides, errors)
    assert all(w in errors[0] for w in words), (overrides, words, errors)
'''
    run = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
