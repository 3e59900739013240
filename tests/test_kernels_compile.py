"""GPU-blind compilation of every cute GEMM + epilogue kernel (runs on CPU, in CI).

With QUACK_ARCH=90 / CUTE_DSL_ARCH=sm_90a, quack traces and compiles each sm_90a kernel without a
GPU; coda_train.kernels.cute._compile drives every example case of every GPU-blind compilable cute
implementation through its real code path (validation, operand views, plans) with the launch
skipped. A kernel that fails to trace or compile fails
here. Runs GPU-blind in forks of one interpreter that imported cutlass/quack once (conftest.GpuBlindPython; the
arch must be pinned before they are imported) with a
fresh kernel cache, so it really compiles (~30 s on 2 cores); then every config of the shipped
tile config table, and the CuTeDSL RoPE-backward pass. The Triton row kernels (H', scale_in_place, the partial-sum
folds) run under
Triton's interpreter on CPU against the reference. Skipped where cutlass/quack are not importable.
"""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="", CODA_TILE_CACHE=os.devnull)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def stack(gpu_blind):
    """`python -c` GPU-blind, the GPU stack imported once (conftest.GpuBlindPython); skips without the stack."""
    return gpu_blind


def test_import_coda_train_does_not_import_the_gpu_stack():
    code = ("import sys, coda_train, coda_train.kernels, coda_train.model; "
            "bad = [m for m in ('cutlass', 'quack', 'flash_attn', 'coda_train.kernels.cute') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_every_declared_op_has_a_cute_implementation(stack):
    """The registration table, filled by importing coda_train.kernels.cute GPU-blind."""
    code = r'''
import coda_train.kernels.cute
from coda_train.kernels import OPS
from coda_train.kernels.library import CUTE_IMPLS
missing = [n for n in OPS if n not in CUTE_IMPLS]
assert not missing, missing
assert all(CUTE_IMPLS[n].kernel.__name__ == n for n in OPS), {n: CUTE_IMPLS[n].kernel.__name__ for n in OPS}
print(sorted(n for n in OPS if CUTE_IMPLS[n].gpu_blind_compile))
'''
    run = stack.run(code, env=ENV, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gemm_rowscale_rope" in run.stdout and "gemm_rowscale" in run.stdout


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One fresh quack cache for the compile tests of this module (the table test reuses the defaults)."""
    return tmp_path_factory.mktemp("quack_cache")


def test_every_gemm_kernel_compiles_gpu_blind(stack, kernel_cache):
    """Every example case of every GPU-blind compilable cute implementation, at the tiny and 8B
    presets' widths, compiles (one `compiled` line per case)."""
    code = r'''
from coda_train.kernels.cute._compile import compile_all, compile_cases
from coda_train.model import PRESETS
dims = [PRESETS[p].kernel_dims(300, 100) for p in ("tiny", "llama3_8b")]
timings = compile_all(dims)
assert len(timings) == sum(len(compile_cases(d)) for d in dims) >= 18, timings
'''
    env = dict(ENV, QUACK_CACHE_DIR=str(kernel_cache))
    run = stack.run(code, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    compiled = [ln for ln in run.stdout.splitlines() if ln.startswith("compiled")]
    assert any("gemm_rowscale " in ln for ln in compiled), run.stdout
    assert any(f.suffix == ".o" for f in kernel_cache.rglob("*")), "no kernel object in the cache"


def test_tile_table_configs_compile_gpu_blind(stack, kernel_cache):
    """Every distinct (op, config) of the shipped tile config table (coda_train/kernels/
    tile_configs.json), forced on each example case of the op at the tiny widths, compiles; the
    defaults are already in the cache from the test above, so only tuned configs cost time."""
    code = r'''
import time, torch
from coda_train.kernels import OPS, Example
from coda_train.kernels.cute._launch import compile_only
from coda_train.kernels.library import CUTE_IMPLS
from coda_train.kernels.tile_configs import SHIPPED_TABLE, forced, load_table
from coda_train.model import PRESETS
configs = sorted({(op, cfg) for entries in load_table(SHIPPED_TABLE).values() for (op, *_), cfg in entries.items()
                  if cfg is not None}, key=str)
assert configs, "the shipped table lists no quack config"
example = Example(PRESETS["tiny"].kernel_dims(300, 100), torch.bfloat16, "cpu", None)
with compile_only():
    for op, cfg in configs:
        for case, kwargs in OPS[op].cases(example):
            t = time.time()
            with forced({op: cfg}):
                CUTE_IMPLS[op].kernel(**kwargs)
            print(f"compiled {case} {cfg} {time.time() - t:.1f}s", flush=True)
'''
    env = dict(ENV, QUACK_CACHE_DIR=str(kernel_cache))
    run = stack.run(code, env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert any(ln.startswith("compiled") for ln in run.stdout.splitlines()), run.stdout


def test_unsupported_inputs_raise_value_errors(stack):
    code = r'''
import torch
import coda_train.kernels.cute as C
from coda_train.kernels.cute._launch import compile_only
e = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt)
f32 = torch.float32
with compile_only():
    for call, words in [
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 64, dt=f32), e(64, 64), e(64, 64), e(64)), "bfloat16"),
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 64), e(64, 64, 1), e(64, 64), e(64)), "must be 2-D (rows, features), got shape (64, 64, 1)"),
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 64), e(64, 64), e(64, 128)[:, ::2], e(64)), "must have a contiguous last dimension"),
        (lambda: C.gemm_residual_rmsnorm_partial(e(64, 60), e(64, 60), e(64, 64), e(64)), "multiple of 8"),
        (lambda: C.gemm_rowscale_rope(e(64, 64), e(64), e(96, 64), e(10, 16, dt=f32), 64), "RoPE table must be (M=64"),
        (lambda: C.gemm_rowscale_rope(e(60, 64), e(60), e(96, 64), e(60, 16, dt=f32), 40), "multiple of head_dim"),
        (lambda: C.gemm_rowscale(e(64, 64), e(64), e(100, 64)), "N=100 must be a positive multiple of 8"),
        (lambda: C.matmul_tn_exp_add(e(128, 32), e(16, 128), e(2, 16), e(16, 32)), "acc (updated in place) must be a contiguous float32"),
        (lambda: C.matmul_tn_exp_add(e(32, 128, dt=f32).t(), e(16, 128), e(2, 16), e(16, 32)), "got (128, 32) torch.float32 non-contiguous"),
        (lambda: C.gemm_rowscale_exp_cross_entropy(e(64, 64), e(64), e(200, 64), e(64, dt=torch.long)), "multiple of 128"),
        (lambda: C.matmul_tn_exp(e(16, 128), e(16, 2), e(16, 32)), "strip must be (V/64, M) = (2, 16)"),
    ]:
        try:
            call()
        except ValueError as ex:
            assert words in str(ex), (words, str(ex))
        else:
            raise AssertionError("no ValueError for " + words)
'''
    run = stack.run(code, env=ENV, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_kernel_shape_errors_need_no_gpu_stack():
    """model.kernel_shape_errors states the cute limits per model.* key, from cute_limits (kernel
    terms), without importing cutlass/quack."""
    code = r'''
import dataclasses, sys
from coda_train.model import PRESETS, kernel_shape_errors
for name, cfg in PRESETS.items():
    assert kernel_shape_errors(cfg, "cute") == [], (name, kernel_shape_errors(cfg, "cute"))
for overrides, words in [
    (dict(dim=200, n_heads=4), ("model.dim=200", "model.n_heads", "head_dim=50")),
    (dict(n_heads=16, n_kv_heads=4), ("head_dim=16", "32, 64, 128", "model.n_heads in [1, 2, 4, 8]")),  # RoPE's 32-col subtiles
    (dict(ffn_dim=100), ("model.ffn_dim=100", "104")),
    (dict(vocab_size=1001), ("model.vocab_size=1001", "1024")),
    (dict(dim=252, n_heads=4, n_kv_heads=4), ("model.dim=252", "256")),
    # past the embedding entry's row limit no larger dim works: a message, not an endless search for one
    (dict(dim=16640, n_heads=130, n_kv_heads=10), ("model.dim=16640", "no model.dim from 16640 up", "kernels.backend=reference")),
]:
    errors = kernel_shape_errors(dataclasses.replace(PRESETS["tiny"], **overrides), "cute")
    assert len(errors) >= 1 and all(w in errors[0] for w in words), (overrides, words, errors)
    assert len(errors) == 1 or overrides.get("dim") == 252, errors
    assert kernel_shape_errors(dataclasses.replace(PRESETS["tiny"], **overrides), "reference") == []
bad = [m for m in ("cutlass", "quack", "flash_attn", "coda_train.kernels.cute") if m in sys.modules]
assert not bad, bad
'''
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def run_under_triton_interpreter(gpu_blind_triton_interpreter):
    """run(code): `code` GPU-blind with TRITON_INTERPRET=1 (Triton kernels on CPU tensors), the stack imported once."""
    def run(code: str) -> None:
        run = gpu_blind_triton_interpreter.run(code, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_scale_kernel_under_the_triton_interpreter(run_under_triton_interpreter):
    """scale_in_place's Triton kernel on CPU (TRITON_INTERPRET=1): with fewer programs than blocks
    the grid-stride loop still covers every element, the mask stops at N, and a scale of 1 leaves t
    as it was (fp32 only: the interpreter rounds bf16 by truncation, so bf16 is the GPU tests')."""
    code = ("import torch\n"
            "from coda_train.kernels.cute._elementwise import _scale_kernel\n"
            "g = torch.Generator().manual_seed(0)\n"
            "for s in (1.0, 0.5, -3.0, 0.0, 1 / 3):\n"
            "    t = torch.randn(10_001, generator=g)\n"
            "    want = t * torch.tensor(s)\n"
            "    _scale_kernel[(2,)](t, torch.tensor([s]), t.numel(), BLOCK=1024)\n"
            "    assert torch.equal(t, want), s\n")
    run_under_triton_interpreter(code)


def test_row_kernels_under_the_triton_interpreter_match_the_reference(run_under_triton_interpreter):
    """H' (both of its Triton kernels, the far-target case included) on CPU under TRITON_INTERPRET=1,
    in fp32 (the wrappers' CUDA/bf16 check is bypassed), against the reference by the GPU tests'
    rule: a broken Triton kernel fails CI, not the next GPU session. Also at a vocabulary of 3 groups
    of 128, where the row kernel's block of groups (4) has a masked one, as llama3's 250 in 256."""
    code = ("import dataclasses, torch\n"
            "import coda_train.kernels.cute._elementwise as ew\n"
            "ew.need_bf16 = lambda op, **tensors: None\n"
            "from coda_train.kernels.testing import check_case, example_cases\n"
            "from coda_train.model.testing import op_check_dims\n"
            "seen = []\n"
            "tiny = op_check_dims('tiny')\n"
            "for dims in (tiny, dataclasses.replace(tiny, vocab_size=384)):\n"
            "    for op, case, kw in example_cases(dims, 'cpu', dtype=torch.float32, ops=['cross_entropy_exp_backward']):\n"
            "        rows = check_case(op, case, kw, getattr(ew, op.name))\n"
            "        assert rows and all(r['ok'] for r in rows), (dims.vocab_size, case, rows)\n"
            "        seen.append(case)\n"
            "assert len(seen) == 4, seen\n")
    run_under_triton_interpreter(code)


def test_partial_sum_folds_under_the_triton_interpreter_match_the_reference(run_under_triton_interpreter):
    """The row folds (F4 r, B2 c) at partial widths the presets give, contiguous and as a view of a wider
    buffer (P and the row stride are compile-time), one width past BLOCK_P (two column blocks), and the
    column sum of g_gamma's per-M-tile partials (B6b) at row counts around its block of 64, all on CPU
    under TRITON_INTERPRET=1 against the reference (the wrappers' CUDA check is bypassed)."""
    code = ("import torch\n"
            "import coda_train.kernels.cute._elementwise as ew\n"
            "from coda_train.kernels import reference as ref\n"
            "ew.need = lambda ok, msg: None\n"
            "g = torch.Generator().manual_seed(0)\n"
            "close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)\n"
            "for M, P, width in ((200, 20, 20), (200, 20, 32), (130, 16, 16), (64, 1, 1), (100, 48, 48), (70, 130, 130)):\n"
            "    s = torch.rand(M, width, generator=g)[:, :P]\n"
            "    r = torch.rand(M, generator=g) + 0.5\n"
            "    close(ew.rstd_from_partials(s, 768, 1e-5), ref.rstd_from_partials(s, 768, 1e-5))\n"
            "    close(ew.rmsnorm_backward_coeff(s - 0.5, r, 768), ref.rmsnorm_backward_coeff(s - 0.5, r, 768))\n"
            "for R, N in ((128, 768), (64, 100), (65, 33), (1, 5)):\n"
            "    p = torch.randn(R, N, generator=g)\n"
            "    for view in (p, p.t().contiguous().t()):  # row-major, and column-major (copied to rows first)\n"
            "        torch.testing.assert_close(ew.column_sum(view), p.double().sum(0).float(), rtol=1e-5, atol=1e-5)\n")
    run_under_triton_interpreter(code)


ROW_FOLDS_PTX = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from coda_train.kernels.cute import _elementwise as ew
from coda_train.kernels.declare import TRITON_FP_FUSION

def loads(kernel, sig, constexprs, multiples_of_16=()):
    """The PTX's global load forms, pointers 16-byte aligned and the named integers multiples of 16 (as
    Triton specializes them at the model widths)."""
    div = [i for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n in multiples_of_16]
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    return set(re.findall(r"ld\.global[.\w]*", triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                        options={"enable_fp_fusion": TRITON_FP_FUSION}).asm["ptx"]))

row = {"s_ptr": "*fp32", "r_ptr": "*fp32", "c_ptr": "*fp32", "M": "i32", "dim": "fp32", "P": "constexpr",
       "stride": "constexpr", "BLOCK_M": "constexpr", "BLOCK_P": "constexpr"}
for P, stride in ((20, 20), (20, 32), (48, 48)):
    got = loads(ew._coeff_kernel, row, dict(P=P, stride=stride, BLOCK_M=ew.ROWSTAT_BLOCK_M,
                                           BLOCK_P=triton.next_power_of_2(P)))
    assert "ld.global.v4.b32" in got, (P, stride, got)
col = {"p_ptr": "*fp32", "out_ptr": "*fp32", "R": "i32", "N": "i32", "stride": "i32", "BLOCK_R": "constexpr",
       "BLOCK_N": "constexpr"}
got = loads(ew._column_sum_kernel, col, dict(BLOCK_R=ew.COLSUM_BLOCK_R, BLOCK_N=ew.COLSUM_BLOCK_N), ("N", "stride"))
assert "ld.global.v4.b32" in got, got
print("vectorized")
'''


def test_partial_sum_folds_load_16_bytes_at_a_time_gpu_blind(stack):
    """The row fold compiled for sm_90 without a GPU: its partials load as 16-byte vectors at the attention
    side's 20 columns (contiguous, and as a view of a wider buffer) and at 48, the property that made it
    3x faster at llama3_125m (docs/kernels.md, "The partial-sum folds, in the graph"); and the column
    sum's at a width and row stride that are multiples of 16 (every preset's dim)."""
    run = stack.run(ROW_FOLDS_PTX, env=ENV, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "vectorized" in run.stdout, run.stdout


ROPE_PASS_CONFIGS = r'''
from coda_train.kernels.cute._rope_backward import compiled
# (head_dim, tile_m, tile_hd, threads, atom_m), then the launch's head groups (from_accumulator, rotate, heads
# per CTA): FA4's sm90 dQ / dKV layouts at head_dim 64 (both 128 x 64, warpgroups over rows: q, k and v in one
# launch, and each alone) and 128 (dQ 64 x 128, warpgroups over columns: atomic partials; dKV 128 x 128: k and v
# in one launch), and the in-place bf16 source at 64 (beside accumulators) and 256
for layout, groups in [((64, 128, 64, 256, 2), ((True, True, 4), (True, True, 4), (True, False, 2))),
                       ((64, 128, 64, 256, 2), ((True, False, 2),)),
                       ((128, 64, 128, 256, 1), ((True, True, 4),)),
                       ((128, 128, 128, 256, 2), ((True, True, 4), (True, False, 1))),
                       ((64, 128, 64, 256, 2), ((True, True, 4), (False, True, 4), (False, False, 4))),
                       ((256, 128, 256, 256, 2), ((False, False, 1),))]:
    compiled(*layout, groups)
    print("compiled", layout, groups)
'''


def test_rope_backward_pass_compiles_gpu_blind(stack):
    """The CuTeDSL RoPE-backward pass (_rope_backward.py) for each FlashAttention accumulator layout the
    presets' head dims get, rotated or not, one to three head groups a launch, and for the in-place bf16
    source."""
    run = stack.run(ROPE_PASS_CONFIGS, env=ENV, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("compiled") == 6, run.stdout


ROPE_PASS_PLAN = r'''
import torch
from flash_attn.cute import interface as fa
import coda_train.kernels.cute._attention as A

B, T, hd = 2, 256, 64
g = torch.empty(B * T, (4 + 2 * 2) * hd, dtype=torch.bfloat16)
run = []
fa_convert = fa._bwd_postprocess_convert
A._run_conversion = lambda call: run.append(call["output"].data_ptr())  # FA4's own conversion, when the op runs it


def backward(dkv_swap_ab, gqa):
    """A stand-in for FA4's sm90 backward at head_dim 64: its conversion calls, arguments as FA4 passes them."""
    def fake(g_o, qkv, o, lse, g, H, G, seq_len, op):
        _, _, dq, dk, dv = A._heads(g, H, G, seq_len, op)
        common = dict(cu_total_m_blocks=None, fake_mode=False, hdim_multiple_of=64 if dkv_swap_ab else 32,
                      accum_order=None)
        fa._bwd_postprocess_convert(torch.zeros(B, H, T * hd), dq, 0.125, None, None, 90, None, hd, 128, 256, 2, False,
                                    use_2cta_instrs=False, cluster_size=1, sink_tensors=None, **common)
        if gqa:
            for out, scale in ((dk, 0.125), (dv, 1.0)):
                fa._bwd_postprocess_convert(torch.zeros(B, G, T * hd), out, scale, None, None, 90, None, hd, 128, 256, 2,
                                            dkv_swap_ab, cluster_size=1, **common)
    return fake


for swap, gqa, want in ((False, True, [(True, 0.125), (True, 0.125), (True, 1.0)]),
                        (True, True, [(True, 0.125), (False, 1.0), (False, 1.0)]),
                        (False, False, [(True, 0.125), (False, 1.0), (False, 1.0)])):
    A._fa_backward = backward(swap, gqa)
    run.clear()
    H, G = (4, 2) if gqa else (4, 4)
    g = torch.empty(B * T, (H + 2 * G) * hd, dtype=torch.bfloat16)
    calls = A._fa_backward_recording(None, None, None, None, g, H, G, T, "test")
    passes = A.rope_passes(calls, g, H, G)
    assert not calls, calls
    assert fa._bwd_postprocess_convert is fa_convert  # the recording put FA4's conversion back
    got = [(p.from_accumulator, p.scale) for p in passes]
    assert got == want, (swap, gqa, got)
    assert [(p.first_head, p.heads, p.rotate) for p in passes] == [(0, H, True), (H, G, True), (H + G, G, False)]
    assert all(p.layout == (hd, 128, hd, 256, 2) for p in passes)  # FA4's layout, or the in-place pass's own
    assert all((p.source is g) != p.from_accumulator for p in passes)
    # an unreadable accumulator is converted by FA4 itself (into g's k and v columns) before the in-place pass
    assert run == ([g[:, H * hd].data_ptr(), g[:, (H + G) * hd].data_ptr()] if swap else []), run

def renamed(accum, out, scale, *rest):  # an FA4 whose conversion takes other arguments
    pass

try:
    A._parameters(renamed)
    raise SystemExit("no error for a conversion without the arguments the plan reads")
except RuntimeError as e:
    assert "flash-attn-4" in str(e) and "'output'" in str(e), e
print("ok")
'''


def test_rope_pass_plan_reads_fa4_accumulators_or_rewrites_its_bf16(stack):
    """attention_rope_bwd's plan from FA4's conversion calls (a stand-in backward making them as FA4's sm90 one
    does, head_dim 64): each readable accumulator is read by the pass; a swapped one (FA4's dK/dV MMA at head_dim
    > 128) is converted by FA4 and rewritten in place, as are dk/dv without GQA, which FA4 writes itself; a
    conversion with other arguments (another flash-attn-4) fails naming the version to install."""
    run = stack.run(ROPE_PASS_PLAN, env=ENV, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


SWIGLU_SELECTS_PTX = r'''
import glob, os, re, tempfile
dump = tempfile.mkdtemp()
os.environ.update(CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
import torch
from coda_train.kernels import Example
from coda_train.kernels.cute._launch import compile_only
from coda_train.kernels.library import CUTE_IMPLS
import coda_train.kernels.cute  # noqa: F401  (fills CUTE_IMPLS)
from coda_train.model import PRESETS
d = PRESETS["tiny"].kernel_dims(256, 256)
M, D, F = d.rows, d.dim, d.ffn_dim
x = Example(d, torch.bfloat16, "cpu", None)
with compile_only():
    CUTE_IMPLS["gemm_rowscale_swiglu"].kernel(h=x.act(M, D), r=x.rowscale(), w_gate_up=x.weight(2 * F, D))
    CUTE_IMPLS["gemm_dswiglu_rowscale_stat"].kernel(g_out=x.act(M, D), w_down=x.weight(D, F), gate=x.act(M, F),
                                                   a=x.act(M, F), r=x.rowscale())
ptx = {os.path.basename(f): open(f).read() for f in glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)}
for name, floor in (("rowscale_swiglu", "0f0D800000"), ("dswiglu_rowscale_stat", "0f00800000")):
    text = next(t for n, t in ptx.items() if name in n)
    compares = re.findall(r"setp\.(\w+)\.f32\s+[^;]*, " + floor + ";", text)
    print(name, sorted(set(compares)))
'''


def test_swiglu_gate_compares_keep_a_nan_gate_nan_gpu_blind(stack, tmp_path):
    """F5's gate floor and B1's zero-q guard compare |gate| < floor (false for NaN, which then flows on as in the
    reference), not |gate| >= floor (false for NaN too, which would replace a NaN gate with a finite value)."""
    env = dict(ENV, QUACK_CACHE_DIR=str(tmp_path))  # a fresh kernel cache: a cached kernel is loaded, its PTX not written
    # a fresh interpreter: CUTE_DSL_KEEP is read at cutlass's import
    run = subprocess.run([sys.executable, "-c", SWIGLU_SELECTS_PTX], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rowscale_swiglu ['lt']" in run.stdout and "dswiglu_rowscale_stat ['lt']" in run.stdout, run.stdout
