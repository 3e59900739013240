"""The CODA op set as torch.library custom ops (coda_train/kernels/library.py).

CPU (CI): every op passes torch.library.opcheck (schema, fake tensor, AOT dispatch) in float32 and
float64 with an odd row count; fake-tensor propagation gives the CPU kernel's shapes and dtypes;
the CPU kernel equals reference.py (partial-sum outputs: same row sums, the contract's width);
torch.compile(fullgraph=True) and make_fx trace a model-like chain of ops as opaque nodes.
GPU (marked gpu): opcheck on the CUDA kernels (cute) in bf16.
"""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from coda_train.kernels import OPS
from coda_train.kernels import library as L
from coda_train.kernels import reference as ref

# An odd row count M = B*T (3 sequences of 5 tokens); V and ffn_dim over one 192-column stat tile,
# so the CE backward and dSwiGLU partials have several columns.
SMALL = SimpleNamespace(M=15, T=5, d=16, H=2, G=1, ffn=200, V=200)
# op name (suffix = variant) -> (output index -> partial-sum width P the contract fixes)
PARTIAL_COLS = {
    "embedding_rmsnorm_partial": {2: lambda s: 1},
    "gemm_residual_rmsnorm_partial": {2: lambda s: L.n_stat_cols(s.d)},
    "gemm_residual_rmsnorm_partial(wide)": {2: lambda s: L.n_stat_cols(s.V)},
    "gemm_cross_entropy_backward": {1: lambda s: L.n_stat_cols(s.V) + 1},
    "gemm_dswiglu_rowscale_stat": {2: lambda s: L.n_stat_cols(s.ffn)},
    "rope_backward_rowscale_stat": {1: lambda s: 1},
}
CASES = list(OPS) + ["gemm_residual_rmsnorm_partial(wide)", "gemm_rmsnorm_backward(no residual)"]


def op_inputs(case: str, dt: torch.dtype, s=SMALL, seed: int = 0) -> tuple:
    """Positional inputs of op `case` in dtype dt (statistics in dt too: the fp64 oracle stays fp64)."""
    g = torch.Generator().manual_seed(seed)
    M, T, d, H, G, F, V = s.M, s.T, s.d, s.H, s.G, s.ffn, s.V
    hd = d // H
    qkv_dim, n_rope = (H + 2 * G) * hd, (H + G) * hd
    rn = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, dtype=dt) * scale  # noqa: E731
    w = lambda n, k: rn(n, k, scale=k ** -0.5)  # noqa: E731
    r = 0.5 + torch.rand(M, generator=g, dtype=dt)
    gamma = 1 + rn(d, scale=0.1)
    ang = torch.arange(T, dtype=dt)[:, None] * (10000.0 ** (-torch.arange(0, hd, 2, dtype=dt) / hd))[None]
    cos, sin = ang.cos(), ang.sin()
    tokens = torch.randint(0, V, (M,), generator=g)
    op = case.split("(")[0]
    if op == "embedding_rmsnorm_partial":
        return tokens, rn(V, d), gamma
    if op == "rstd_from_partials":
        return torch.rand(M, 3, generator=g, dtype=dt) * d, d, 1e-5
    if op == "gemm_rowscale_rope":
        return rn(M, d), r, w(qkv_dim, d), cos, sin, n_rope
    if op == "attention":
        return rn(M, qkv_dim), H, G, T
    if case == "gemm_residual_rmsnorm_partial(wide)":
        return rn(M, F), w(V, F), rn(M, V), 1 + rn(V, scale=0.1)
    if op == "gemm_residual_rmsnorm_partial":
        return rn(M, H * hd), w(d, H * hd), rn(M, d), gamma
    if op == "gemm_rowscale_swiglu":
        return rn(M, d), r, w(2 * F, d)
    if op == "gemm_rowscale_cross_entropy":
        return rn(M, d), r, w(V, d), tokens
    if op == "gemm_cross_entropy_backward":
        h, w_lm = rn(M, d), w(V, d)
        lse, _ = ref.gemm_rowscale_cross_entropy(h, r, w_lm, tokens)
        return h, r, w_lm, tokens, lse, torch.tensor(1.0 / M, dtype=dt)
    if op == "gemm_dswiglu_rowscale_stat":
        return rn(M, d), w(d, F), rn(M, 2 * F), r
    if op == "attention_backward":
        qkv = rn(M, qkv_dim)
        o, lse = ref.attention(qkv, H, G, T)
        return rn(M, H * hd), qkv, o, lse, H, G, T
    if op == "rope_backward_rowscale_stat":
        return rn(M, qkv_dim), rn(M, qkv_dim), r, cos, sin, n_rope
    if op == "rmsnorm_backward_coeff":
        return rn(M, 3), r, d
    if case == "gemm_rmsnorm_backward(no residual)":
        return rn(M, V), w(V, d), None, rn(M, d), gamma, rn(M, scale=0.01)
    if op == "gemm_rmsnorm_backward":
        return rn(M, qkv_dim), w(qkv_dim, d), rn(M, d), rn(M, d), gamma, rn(M, scale=0.01)
    if op == "matmul":
        return rn(M, H * hd), w(H * hd, d)
    if op == "matmul_tn":
        return rn(M, d), rn(M, 2 * F)
    if op == "embedding_backward":
        return tokens, rn(M, d), V
    raise KeyError(case)


def coda_op(case: str):
    return getattr(torch.ops.coda, case.split("(")[0]).default


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def test_every_op_of_the_op_set_is_a_custom_op():
    missing = [name for name in OPS if not hasattr(torch.ops.coda, name)]
    assert not missing, missing
    assert all(callable(L.dispatched(name)) for name in OPS)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_opcheck(case, dt):
    torch.library.opcheck(coda_op(case), op_inputs(case, dt))


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_fake_tensor_shapes_match_the_cpu_kernel(case, dt):
    args = op_inputs(case, dt)
    real = as_tuple(coda_op(case)(*args))
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = as_tuple(coda_op(case)(*fake_args))
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_equals_reference(case, dt):
    """Exactly reference.py; partial-sum outputs have the contract's width P and the same row sums."""
    args = op_inputs(case, dt)
    name = case.split("(")[0]
    got, want = as_tuple(L.dispatched(name)(*args)), as_tuple(getattr(ref, name)(*args))
    partial = PARTIAL_COLS.get(case, {})
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in partial:
            assert g.shape == (SMALL.M, partial[i](SMALL)), f"out{i}: partial width {g.shape}"
            g, w = g.sum(-1), w.sum(-1)
        assert g.dtype == w.dtype and g.shape == w.shape, f"out{i}"
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{case} out{i}")


def test_cross_entropy_backward_takes_a_float_grad_scale():
    h, r, w_lm, tokens, lse, scale = op_inputs("gemm_cross_entropy_backward", torch.float64)
    got = L.gemm_cross_entropy_backward(h, r, w_lm, tokens, lse, 1.0 / SMALL.M)
    want = ref.gemm_cross_entropy_backward(h, r, w_lm, tokens, lse, 1.0 / SMALL.M)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1].sum(-1), want[1].sum(-1), rtol=0, atol=0)


def block_and_loss(tokens, emb, norm, w_qkv, cos, sin, w_o, w_gate_up, w_down, w_lm, targets):
    """A model-like chain (docs/design.md F1..F6, H, H', B2, H''): one layer, loss, its first backward ops."""
    s = SMALL
    d, hd = s.d, s.d // s.H
    x, h, sumsq = torch.ops.coda.embedding_rmsnorm_partial(tokens, emb, norm)
    r = torch.ops.coda.rstd_from_partials(sumsq, d, 1e-5)
    qkv = torch.ops.coda.gemm_rowscale_rope(h, r, w_qkv, cos, sin, (s.H + s.G) * hd)
    o, _ = torch.ops.coda.attention(qkv, s.H, s.G, s.T)
    x1, h1, sumsq1 = torch.ops.coda.gemm_residual_rmsnorm_partial(o, w_o, x, norm)
    r1 = torch.ops.coda.rstd_from_partials(sumsq1, d, 1e-5)
    _, a = torch.ops.coda.gemm_rowscale_swiglu(h1, r1, w_gate_up)
    x2, h2, sumsq2 = torch.ops.coda.gemm_residual_rmsnorm_partial(a, w_down, x1, norm)
    r2 = torch.ops.coda.rstd_from_partials(sumsq2, d, 1e-5)
    lse, target_logit = torch.ops.coda.gemm_rowscale_cross_entropy(h2, r2, w_lm, targets)
    loss = (lse - target_logit).mean()
    g_logits, stat = L.gemm_cross_entropy_backward(h2, r2, w_lm, targets, lse, 1.0 / tokens.shape[0])
    c = torch.ops.coda.rmsnorm_backward_coeff(stat, r2, d)
    g_x2, g_norm = torch.ops.coda.gemm_rmsnorm_backward(g_logits, w_lm, None, x2, norm, c)
    return loss, g_x2, g_norm, torch.ops.coda.matmul_tn(g_logits, h2)


def chain_inputs(dt=torch.float32):
    s, g = SMALL, torch.Generator().manual_seed(1)
    hd = s.d // s.H
    rn = lambda *shape: torch.randn(*shape, generator=g, dtype=dt) * shape[-1] ** -0.5  # noqa: E731
    ang = torch.arange(s.T, dtype=dt)[:, None] * (10000.0 ** (-torch.arange(0, hd, 2, dtype=dt) / hd))[None]
    tokens = torch.randint(0, s.V, (s.M,), generator=g)
    return (tokens, rn(s.V, s.d) * 4, 1 + 0.1 * torch.randn(s.d, generator=g, dtype=dt), rn((s.H + 2 * s.G) * hd, s.d),
            ang.cos(), ang.sin(), rn(s.d, s.H * hd), rn(2 * s.ffn, s.d), rn(s.d, s.ffn), rn(s.V, s.d), tokens.roll(1))


def test_torch_compile_fullgraph_sees_the_ops_as_single_nodes():
    torch._dynamo.reset()
    args = chain_inputs()
    compiled = torch.compile(block_and_loss, fullgraph=True, backend="eager", dynamic=True)
    for got, want in zip(compiled(*args), block_and_loss(*args)):
        torch.testing.assert_close(got, want)


def test_make_fx_traces_the_ops_as_opaque_nodes():
    gm = make_fx(block_and_loss, tracing_mode="fake")(*chain_inputs())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    coda = {t for t in targets if t.startswith("coda.")}
    assert coda == {f"coda.{n}.default" for n in (
        "embedding_rmsnorm_partial", "rstd_from_partials", "gemm_rowscale_rope", "attention",
        "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy",
        "gemm_cross_entropy_backward", "rmsnorm_backward_coeff", "gemm_rmsnorm_backward", "matmul_tn")}
    # nothing of the ops' insides (matmuls, logsumexp, ...) leaks into the graph
    assert not any(t.startswith("aten.mm") or "logsumexp" in t for t in targets), sorted(targets)


# ---- GPU: the cute kernels behind the same ops ---------------------------------------------

def _check_kernels():
    spec = importlib.util.spec_from_file_location(
        "check_kernels", os.path.join(os.path.dirname(__file__), "..", "scripts", "check_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cute_ops():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from coda_train import kernels

    kernels.set_backend("cute")  # imports cute, which registers the CUDA kernels
    yield _check_kernels()
    kernels.set_backend("reference")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [("tiny", 1000, 250), ("llama3_125m", 384, 128)], ids=lambda s: f"{s[0]}-M{s[1]}")
@pytest.mark.parametrize("op", OPS)
def test_opcheck_cute_kernels_bf16(cute_ops, op, shape):
    """Same op contract on the CUDA (cute) kernels: schema, fake tensor shapes, AOT dispatch."""
    from coda_train.model.config import PRESETS

    preset, M, T = shape
    dev = torch.device("cuda")
    inputs = cute_ops.make_inputs(op, PRESETS[preset], M, T, dev, torch.Generator(device=dev).manual_seed(0))
    torch.library.opcheck(getattr(torch.ops.coda, op).default, (), inputs)
