"""Every `cute` op against the reference oracle on a Hopper GPU (marked gpu; skipped elsewhere).

Same harness as scripts/check_kernels.py: random inputs at each preset's widths with a ragged row
count, every output/partial buffer NaN-poisoned, error relative to the reference in float64 on
the GPU, and err(cute) <= 1.5 * err(reference in bf16; SDPA too for attention) + 1e-4. Plus the
whole model: CODA on cute vs CODA on reference vs eager (bf16 compute), loss and every gradient
against eager in float64, for `tiny` and a 2-layer `llama3_1b`.
"""

import importlib.util
import io
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "check_kernels", os.path.join(os.path.dirname(__file__), "..", "scripts", "check_kernels.py"))
ck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module")
def cute():
    if not _hopper():
        pytest.skip("needs a Hopper (sm_90) GPU")
    from coda_train import kernels

    kernels.set_backend("cute")
    import coda_train.kernels.cute as mod
    import coda_train.kernels.cute._launch as launch

    launch.POISON = True
    yield mod
    launch.POISON = False
    kernels.set_backend("reference")


@pytest.mark.parametrize("preset", list(ck.SHAPES))
@pytest.mark.parametrize("op", ck.OPS)
def test_cute_op_matches_reference(cute, op, preset):
    rows = ck.check(op, preset, cute, io.StringIO())
    for r in rows:
        assert r["finite"], f"{op} out{r['out']}: NaN/inf (unwritten tile?)"
        assert r["ok"], f"{op} out{r['out']}: err cute {r['err_cute']:.2e} vs baseline {r['err_base']:.2e}"


@pytest.mark.parametrize("name", list(ck.MODEL_CASES))
def test_whole_model_cute_vs_reference_vs_eager(cute, name):
    rows = ck.check_model(name, io.StringIO())
    bad = [r for r in rows if not r["ok"]]
    assert not bad, [(r["tensor"], r["err_cute"], r["err_eager"]) for r in bad]
