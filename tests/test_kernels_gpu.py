"""Every `cute` op against the reference oracle on a Hopper GPU (marked gpu; skipped elsewhere).

The harness of scripts/check_kernels.py (coda_train.kernels.testing): every example case of every
declared op at each preset's widths with a ragged row count, every output/partial buffer
NaN-poisoned, error relative to the reference in float64 on the GPU, and err(cute) <= 1.5 *
err(reference in bf16; SDPA too for attention) + 1e-4. Plus the whole model
(coda_train.model.testing): CODA on cute vs CODA on reference vs eager (bf16 compute), loss and
every gradient against eager in float64, for `tiny` and a 2-layer `llama3_1b`.
"""

import os
import subprocess
import sys

import pytest
import torch

from coda_train.kernels import OPS, Example
from coda_train.kernels.testing import check_case, example_cases, poisoned_cute_outputs
from coda_train.model.testing import MODEL_CASES, OP_CHECK_SHAPES, check_model, op_check_dims

pytestmark = pytest.mark.gpu

# (preset, case name) of every example case; shapes only (meta tensors), so collection needs no GPU
CASES = [(preset, case) for preset in OP_CHECK_SHAPES for op in OPS.values()
         for case, _ in op.cases(Example(op_check_dims(preset), torch.bfloat16, "meta", None))]


@pytest.fixture(scope="module")
def cute():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from coda_train.kernels import op_set

    return op_set("cute")


@pytest.mark.parametrize("preset,case", CASES, ids=[f"{p}-{c}" for p, c in CASES])
def test_cute_op_matches_reference(cute, preset, case):
    (op, _, kwargs), = [c for c in example_cases(op_check_dims(preset), "cuda", ops=[case]) if c[1] == case]
    with poisoned_cute_outputs():
        rows = check_case(op, case, kwargs, getattr(cute, op.name))
    for r in rows:
        assert r["finite"], f"{case} out{r['out']}: NaN/inf (unwritten tile?)"
        assert r["ok"], f"{case} out{r['out']}: err cute {r['err_cute']:.2e} vs baseline {r['err_base']:.2e} {r.get('stored', '')}"


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_whole_model_cute_vs_reference_vs_eager(cute, name):
    rows = check_model(name)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, [(r["tensor"], r["err_cute"], r["err_eager"]) for r in bad]


def test_logits_cute_vs_reference(cute):
    """CodaLlama.logits (op gemm_rowscale after the blocks) on cute: no less accurate than the
    reference backend in bf16, both against the reference backend in float64."""
    from coda_train.kernels.testing import passes, relative_error
    from coda_train.model import build_model, preset

    cfg = preset("tiny", n_layers=2)
    torch.manual_seed(0)
    oracle = build_model(cfg, "coda", backend="reference", compute_dtype=torch.float64).cuda().double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = oracle.logits(tokens)
    errs = {}
    for backend in ("cute", "reference"):
        model = build_model(cfg, "coda", backend=backend, compute_dtype=torch.bfloat16).cuda()
        model.load_state_dict({k: v.float() for k, v in oracle.state_dict().items()})
        got = model.logits(tokens)
        assert got.shape == want.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        errs[backend] = relative_error(got, want)
    assert passes(errs["cute"], errs["reference"]), errs


EXP_CONFIGS = ["128x128 c2x1 pingpong", "256x128 c1x2 cooperative", "128x256 c2x1 cooperative", "128x256 c1x2 cooperative"]


@pytest.mark.parametrize("preset", ["llama3_125m", "llama3_1b"])
@pytest.mark.parametrize("config", EXP_CONFIGS)
def test_lm_head_exponentials_at_every_offset_tile(cute, preset, config):
    """The LM head's logits GEMM at each N tile it may be tuned to: a 256-wide tile's one offset
    spread over its two 128-column groups checks against the reference like a 128-wide tile's."""
    from coda_train.kernels.tile_configs import Cfg, forced

    op = OPS["gemm_rowscale_exp_cross_entropy"]
    (_, _, kwargs), = example_cases(op_check_dims(preset), "cuda", ops=[op.name])
    with forced({op.name: Cfg.parse(config)}), poisoned_cute_outputs():
        rows = check_case(op, op.name, kwargs, cute.gemm_rowscale_exp_cross_entropy)
    assert all(r["ok"] and r["finite"] for r in rows), rows


TRITON_FUSION_PROBE = r'''
import torch, triton
from coda_train.kernels import adamw
from coda_train.kernels.cute import _elementwise as ew
from coda_train.model.testing import check_model

assert all(r["ok"] for r in check_model("tiny"))  # every op of a forward and backward, the Triton passes included
t = torch.ones(1000, device="cuda")
ew.scale_in_place(t, torch.tensor(0.5, device="cuda"))
p, g, m, v = (torch.ones(4096, device="cuda") for _ in range(4))
adamw.adamw_update([p], [g], [m], [v], [torch.zeros((), device="cuda")], [None],
                   lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
jits = [f for name, f in vars(ew).items() if name.endswith("_kernel")] + [adamw._kernel()]  # _row_total: inlined
compiled = {f.__name__: [k for cache in f.device_caches.values() for k in cache[0].values()] for f in jits}
assert all(compiled.values()), {name: len(ks) for name, ks in compiled.items()}  # every kernel launched
assert all(k.metadata.enable_fp_fusion for ks in compiled.values() for k in ks), \
    {name: [k.metadata.enable_fp_fusion for k in ks] for name, ks in compiled.items()}
'''


def test_triton_kernels_contract_fma_whatever_tritons_default(cute, tmp_path):
    """Every Triton launch compiles with enable_fp_fusion=TRITON_FP_FUSION (declare.py), as tested and timed,
    also under TRITON_DEFAULT_FP_FUSION=0 (Triton 3.10's default): a fresh process, so no kernel was compiled before."""
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", TRITON_FUSION_PROBE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
