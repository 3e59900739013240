"""The CODA op set as torch.library custom ops (coda_train/kernels/library.py), built from the
declarations in coda_train/kernels/reference.py.

CPU (CI): every example case of every declared op passes torch.library.opcheck (schema, fake
tensor, AOT dispatch) in float32 and float64 with an odd row count; fake-tensor propagation gives
the CPU kernel's shapes and dtypes; the CPU kernel equals the reference (partial-sum outputs: same
row sums, the declared width); torch.compile(fullgraph=True) and make_fx trace a model-like chain
of ops as opaque nodes. GPU (marked gpu): opcheck on the CUDA kernels (cute) in bf16.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from coda_train.kernels import OPS, Dims, Example
from coda_train.kernels import library as L
from coda_train.kernels import reference as R

# An odd row count M = B*T (3 sequences of 5 tokens); V and ffn_dim over one 128-column stat tile,
# so the LM-head GEMMs and the dSwiGLU partials span several stat tiles.
SMALL = Dims(rows=15, seq_len=5, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=200, vocab_size=200)


def cases(dt: torch.dtype, dims: Dims = SMALL, device="cpu", seed: int = 0) -> list:
    """[(op, case name, kwargs)] of every declared op at dims."""
    out = []
    for op in OPS.values():
        example = Example(dims, dt, device, torch.Generator(device=device).manual_seed(seed))
        out += [(op, case, kwargs) for case, kwargs in op.cases(example)]
    return out


CASE_NAMES = [case for _, case, _ in cases(torch.float64)]


def case_of(name: str, dt: torch.dtype):
    return next((op, kw) for op, case, kw in cases(dt) if case == name)


def as_tuple(out) -> tuple:
    return () if out is None else out if isinstance(out, tuple) else (out,)


def call_on_copies(fn, op, kw) -> tuple:
    """fn's returned outputs, then the inputs op mutates, on copies of those inputs (kw unchanged)."""
    kw = {k: v.clone() if k in op.mutates else v for k, v in kw.items()}
    return as_tuple(fn(**kw)) + tuple(kw[m] for m in op.mutates)


def test_every_declared_op_is_a_custom_op_with_fake_and_examples():
    assert set(L.CUSTOM_OPS) == set(OPS)
    for name, op in OPS.items():
        assert hasattr(torch.ops.coda, name), name
        assert op.reference.__name__ == name and callable(op.fake), name
        assert op.examples(Example(SMALL, torch.float64, "cpu", torch.Generator().manual_seed(0))), name
    assert {"cross_entropy_exp_backward(far target)", "gemm_residual_rmsnorm_partial(wide)"} <= set(CASE_NAMES)


def test_op_cases_named_in_the_docs_are_declared():
    """Every `op(case)` that docs/design.md or docs/kernels.md names, op a declared op and case a name (not an
    argument list such as `embedding_rmsnorm_partial(..., dtype)`), is one of that op's example cases: the
    variant cases are what the checks, the benchmark and the compile list run, so a page naming one that is
    gone describes a check that does not exist."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    named = {(page, f"{m[1]}({m[2]})") for page in ("docs/design.md", "docs/kernels.md")
             for m in re.finditer(r"`([a-z_]+)\(([^`,.()]+)\)`", (root / page).read_text()) if m[1] in OPS}
    assert named  # design.md's example of a variant case at least
    assert [(page, case) for page, case in sorted(named) if case not in CASE_NAMES] == []


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_opcheck(case, dt):
    op, kw = case_of(case, dt)
    torch.library.opcheck(L.CUSTOM_OPS[op.name], (), kw)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_fake_tensor_shapes_match_the_cpu_kernel(case, dt):
    op, kw = case_of(case, dt)
    real = as_tuple(L.CUSTOM_OPS[op.name](**kw))
    with FakeTensorMode() as mode:
        fake_kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        fake = as_tuple(L.CUSTOM_OPS[op.name](**fake_kw))
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cpu_custom_op_dispatches_to_reference(case, dt):
    """The custom op's CPU kernel is the reference behind the op wrapper: the same outputs exactly, the
    inputs it mutates written through, and partial-sum outputs widened to the declared width P (zero
    columns) with the same row sums."""
    op, kw = case_of(case, dt)
    got, want = call_on_copies(L.CUSTOM_OPS[op.name], op, kw), call_on_copies(op.reference, op, kw)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in op.partials:
            assert g.shape == (SMALL.rows, op.partials[i](**kw)), f"out{i}: partial width {g.shape}"
            g, w = g.sum(-1), w.sum(-1)
        assert g.dtype == w.dtype and g.shape == w.shape, f"out{i}"
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{case} out{i}")


def written_args(name: str) -> set:
    """The arguments the schema of coda::<name> marks as written in place (Tensor(a!))."""
    schema = getattr(torch.ops.coda, name).default._schema
    return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def test_ops_write_exactly_their_declared_mutated_inputs():
    """The in-place contract: the schema marks the declared inputs as written; a call updates them
    (to the reference's values) and leaves every other input as it was."""
    assert {n: op.mutates for n, op in OPS.items() if op.mutates} == {"cross_entropy_exp_backward": ("e",),
                                                                      "matmul_tn_exp_add": ("acc",),
                                                                      "scale_in_place": ("t",),
                                                                      "embedding_backward": ("acc",)}
    for op, case, kw in cases(torch.float64):
        assert written_args(op.name) == set(op.mutates), case
        before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
        want = call_on_copies(op.reference, op, kw)
        want_mutated = dict(zip(op.mutates, want[len(want) - len(op.mutates):]))
        L.CUSTOM_OPS[op.name](**kw)
        for k, v in before.items():
            if k in op.mutates:
                assert torch.equal(want_mutated[k], v) or not torch.equal(kw[k], v), f"{case}: {k} not updated"
                torch.testing.assert_close(kw[k], want_mutated[k], rtol=0, atol=0)
            else:
                assert torch.equal(kw[k], v), f"{case}: {k} changed"


def test_matmul_tn_exp_add_accumulates_in_place():
    op, kw = case_of("matmul_tn_exp_add", torch.float32)
    acc, e, strip, hs = kw["acc"], kw["e"], kw["strip"], kw["hs"]
    product = R.matmul_tn_exp(e, strip, hs)
    want, ptr = acc + product, acc.data_ptr()
    assert L.CUSTOM_OPS["matmul_tn_exp_add"](acc, e, strip, hs) is None and op.reference(acc, e, strip, hs) is None
    assert acc.data_ptr() == ptr
    torch.testing.assert_close(acc, want + product)  # two calls: two contributions in one buffer


def test_torch_compile_keeps_the_in_place_update_of_a_graph_input():
    torch._dynamo.reset()
    _, kw = case_of("matmul_tn_exp_add", torch.float32)
    want = kw["acc"] + R.matmul_tn_exp(kw["e"], kw["strip"], kw["hs"])
    compiled = torch.compile(lambda acc, e, strip, hs: torch.ops.coda.matmul_tn_exp_add(acc, e, strip, hs), fullgraph=True,
                             backend="aot_eager")
    compiled(**kw)
    torch.testing.assert_close(kw["acc"], want)


def test_check_harness_compares_the_mutated_inputs():
    """kernels.testing (check_kernels.py, the GPU tests): each call on its own copy of the mutated
    input, which is compared as an output, so an implementation that does not write it fails."""
    from coda_train.kernels.testing import check_case

    op, kw = case_of("matmul_tn_exp_add", torch.float32)
    acc = kw["acc"].clone()
    assert [r["ok"] for r in check_case(op, "matmul_tn_exp_add", kw, op.reference)] == [True]
    assert [r["ok"] for r in check_case(op, "matmul_tn_exp_add", kw, lambda acc, e, strip, hs: None)] == [False]
    assert torch.equal(kw["acc"], acc)
    op, kw = case_of("cross_entropy_exp_backward", torch.float32)
    assert [r["ok"] for r in check_case(op, op.name, kw, op.reference)] == [True] * 4  # loss, r*g_y, hs / v, S
    e_unchanged = lambda e, **rest: op.reference(e.clone(), **rest)  # noqa: E731  (the target columns stay)
    assert [r["ok"] for r in check_case(op, op.name, kw, e_unchanged)] == [True, False, True, True]


def test_check_harness_fails_an_implementation_that_leaves_out_an_output():
    """An implementation returning fewer outputs than the reference fails (each output was compared only
    as far as the shorter list went, so one that never wrote its partial sums passed)."""
    from coda_train.kernels.testing import check_case

    for name, problem in (("gemm_residual_rmsnorm_partial", "2 outputs, want 3"),
                          ("cross_entropy_exp_backward", "5 outputs, want 6")):  # 4 returned and the updated e
        op, kw = case_of(name, torch.float32)
        rows = check_case(op, name, kw, lambda **kw: op.reference(**kw)[:-1])
        assert [(r["ok"], r["stored"]) for r in rows] == [(False, [problem])], name


def test_check_harness_weighs_every_row_of_the_logit_gradient():
    """H' is compared on the gradient its factors encode, v * (strip (x) e), whose rows all have norm
    ~ grad_scale * r, and on hs / v: a 1.5x error in the target column of the row where it is
    smallest, or in hs in the row of the smallest v, fails by a wide margin over the bf16 tolerance.
    (Compared as stored, the same errors exceed it by only 1.7x and 5x here, and shrink with every
    added row: the target columns and v span octaves between rows.)"""
    from coda_train.kernels.testing import RATIO, ATOL, check_case

    op, kw = case_of("cross_entropy_exp_backward", torch.bfloat16)
    rows, t = torch.arange(kw["e"].shape[0]), kw["targets"]
    e_after = kw["e"].clone()
    _, _, v, _, _ = op.reference(**{**kw, "e": e_after})
    small_t, small_v = int(e_after[rows, t].abs().argmin()), int(v.argmin())

    def wrong_target(e, **rest):
        out = op.reference(e, **rest)
        e[small_t, t[small_t]] *= 1.5
        return out

    def wrong_hs(**kw):
        loss, strip, v, hs, stat = op.reference(**kw)
        hs = hs.clone()
        hs[small_v] *= 1.5
        return loss, strip, v, hs, stat

    for wrong, bad in ((wrong_target, 1), (wrong_hs, 2)):
        rows_ok = check_case(op, op.name, kw, wrong)
        assert [r["ok"] for r in rows_ok] == [i != bad for i in range(4)], wrong.__name__
        assert rows_ok[bad]["err_cute"] > 20 * (RATIO * rows_ok[bad]["err_base"] + ATOL), wrong.__name__

    def fp32_strip(**kw):  # right values, wrong stored dtype: the map (float64) would hide it
        loss, strip, v, hs, stat = op.reference(**kw)
        return loss, strip.float(), v, hs, stat

    rows_ok = check_case(op, op.name, kw, fp32_strip)
    assert [r["ok"] for r in rows_ok] == [False] and rows_ok[0]["stored"][0].startswith("out1 ")


def test_check_harness_compares_canonical_outputs():
    """H's exponentials are compared as the softmax e 2^k / S, ln S, the expected logit and y_t:
    another choice of offsets passes; a wrong value fails, also one confined to the row of the
    smallest logits (whose exp(y) is octaves below the others', so a check of exp(y) would miss it)."""
    from coda_train.kernels.testing import check_case

    op, kw = case_of("gemm_rowscale_exp_cross_entropy", torch.float32)
    e, k, se, st, yt = op.reference(**kw)
    low = int(k.amax(-1).argmin())  # the row whose largest logit is the smallest

    def shifted(**kw):  # every offset one higher, e halved (t one lower): the same exponentials
        e, k, se, st, yt = op.reference(**kw)
        return (e / 2, k + 1, se / 2, (st - se) / 2, yt)

    def wrong_offsets(**kw):
        e, k, se, st, yt = op.reference(**kw)
        return (e, k + 1, se, st, yt)

    def wrong_low_row(**kw):  # 1.5 x the exponentials of one row, its sums right
        e, k, se, st, yt = op.reference(**kw)
        e = e.clone()
        e[low] *= 1.5
        return (e, k, se, st, yt)

    assert k.amax(-1).max() - k[low].max() >= 10  # octaves apart: the case the per-row scale is for
    assert [r["ok"] for r in check_case(op, op.name, kw, shifted)] == [True] * 4
    # the encoded logits (t + k) ln2 all ln2 higher: ln S and the expected logit move, y_t does not
    assert [r["ok"] for r in check_case(op, op.name, kw, wrong_offsets)] == [True, False, False, True]
    assert [r["ok"] for r in check_case(op, op.name, kw, wrong_low_row)] == [False, True, True, True]


def test_offsets_of_a_wider_tile_pass_as_its_groups():
    """An LM-head GEMM with a 256-wide N tile has one offset per 256 columns; spread over the
    declared 128-column groups (reference.exp_stats_per_group) its outputs pass the check against
    the reference and give H' the same loss. Spread as plain partials (sums in the first columns,
    like the other ops' wider tiles) they would not."""
    from coda_train.kernels.testing import check_case

    op = OPS["gemm_rowscale_exp_cross_entropy"]
    dims = Dims(rows=15, seq_len=5, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=200, vocab_size=512)
    (_, kw), = op.cases(Example(dims, torch.float32, "cpu", torch.Generator().manual_seed(0)))

    def tile_256(h, r, w_lm, targets, spread=R.exp_stats_per_group):
        y = (h @ w_lm.t()) * r[:, None]
        tiles = y.view(y.shape[0], -1, 256)
        k = torch.round(tiles.amax(-1) * R.LOG2E)
        t = tiles * R.LOG2E - k[..., None]
        e = torch.exp2(t)
        return (e.reshape(y.shape).to(h.dtype), *spread(k, e.sum(-1), (e * t).sum(-1), 2),
                y.gather(1, targets.reshape(-1, 1)).squeeze(1))

    def as_partials(k, se, st, rep):  # sums at the front, zeros after; offsets likewise
        return tuple(torch.cat([t, torch.zeros_like(t)] if rep == 2 else [t], 1) for t in (k, se, st))

    ref = op.reference(**kw)
    wide = tile_256(**kw)
    assert not torch.equal(wide[1], ref[1])  # the two groups of a tile had offsets of their own
    assert [row["ok"] for row in check_case(op, op.name, kw, tile_256)] == [True] * 4
    assert not all(row["ok"] for row in check_case(op, op.name, kw, lambda **a: tile_256(**a, spread=as_partials)))
    extra = dict(targets=kw["targets"], r=kw["r"], h=kw["h"], grad_scale=torch.tensor(1.0 / dims.rows))
    loss_ref, *_, stat_ref = R.cross_entropy_exp_backward(*ref, **extra)
    loss_wide, *_, stat_wide = R.cross_entropy_exp_backward(*wide, **extra)
    torch.testing.assert_close(loss_wide, loss_ref)
    torch.testing.assert_close(stat_wide, stat_ref)  # S: the tile's e*t sums are relative to the offset both groups get


def test_partial_widths_follow_the_stat_tile():
    """The contract's widths: one column per 128-wide N tile (one for the elementwise passes)."""
    widths = {case: {i: op.partials[i](**kw) for i in op.partials} for op, case, kw in cases(torch.float64)}
    assert widths["gemm_residual_rmsnorm_partial"] == {2: 1}
    assert widths["gemm_residual_rmsnorm_partial(wide)"] == {2: 2}  # N = V = 200
    assert widths["gemm_dswiglu_rowscale_stat"] == {1: 2}  # ffn_dim = 200
    assert widths["cross_entropy_exp_backward"] == {4: 1}  # the final norm's S
    assert widths["embedding_rmsnorm_partial"] == {2: 1}
    assert widths["attention_rope_backward_rowscale_stat"] == {1: 4}  # one per head: 2 q + 1 k + 1 v


def block_and_loss(tokens, emb, norm, w_qkv, rope, w_o, w_gate_up, w_down, w_lm, targets):
    """A model-like chain (docs/design.md F1..F6, H, L, H', B2, H''): one layer, the evaluation and
    the training loss, logits, the LM head's gradient in two chunks of rows, scaled by a g_loss."""
    s, coda = SMALL, torch.ops.coda
    d = s.dim
    x, h, sumsq = coda.embedding_rmsnorm_partial(tokens, emb, norm, emb.dtype)
    r = coda.rstd_from_partials(sumsq, d, 1e-5)
    qkv = coda.gemm_rowscale_rope(h, r, w_qkv, rope, s.n_rope_cols)
    o, _ = coda.attention(qkv, s.n_heads, s.n_kv_heads, s.seq_len)
    x1, h1, sumsq1 = coda.gemm_residual_rmsnorm_partial(o, w_o, x, norm)
    r1 = coda.rstd_from_partials(sumsq1, d, 1e-5)
    _, a = coda.gemm_rowscale_swiglu(h1, r1, w_gate_up)
    x2, h2, sumsq2 = coda.gemm_residual_rmsnorm_partial(a, w_down, x1, norm)
    r2 = coda.rstd_from_partials(sumsq2, d, 1e-5)
    lse, target_logit = coda.gemm_rowscale_cross_entropy(h2, r2, w_lm, targets)
    loss = (lse - target_logit).mean()
    logits = coda.gemm_rowscale(h2, r2, w_lm)
    e, k, sum_exp, sum_exp_t, target_logit = coda.gemm_rowscale_exp_cross_entropy(h2, r2, w_lm, targets)
    loss_t, strip, v, hs, stat = coda.cross_entropy_exp_backward(e, k, sum_exp, sum_exp_t, target_logit, targets, r2, h2,
                                                                 loss.new_full((), 1.0 / tokens.shape[0]))
    c = coda.rmsnorm_backward_coeff(stat, r2, d)
    g_x2, g_norm = coda.gemm_exp_rmsnorm_backward(e, strip, v, w_lm, x2, norm, c)
    g_w = coda.matmul_tn_exp(e[:8], strip[:, :8], hs[:8])
    coda.matmul_tn_exp_add(g_w, e[8:], strip[:, 8:], hs[8:])
    coda.scale_in_place(g_w, loss.new_full((), 0.5))  # the backward's g_loss
    return loss, loss_t.mean(), logits, g_x2, g_norm, g_w


def chain_inputs(dt=torch.float32):
    s = SMALL
    x = Example(s, dt, "cpu", torch.Generator().manual_seed(1))
    tokens = x.tokens()
    return (tokens, x.weight(s.vocab_size, s.dim, scale=4.0), x.gamma(s.dim), x.weight(s.qkv_dim, s.dim), x.rope(),
            x.weight(s.dim, s.n_heads * s.head_dim), x.weight(2 * s.ffn_dim, s.dim), x.weight(s.dim, s.ffn_dim),
            x.weight(s.vocab_size, s.dim), tokens.roll(1))


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
        "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy", "gemm_rowscale",
        "gemm_rowscale_exp_cross_entropy", "cross_entropy_exp_backward", "rmsnorm_backward_coeff",
        "gemm_exp_rmsnorm_backward", "matmul_tn_exp", "matmul_tn_exp_add", "scale_in_place")}
    # nothing of the ops' insides (matmuls, logsumexp, ...) leaks into the graph
    assert not any(t.startswith("aten.mm") or "logsumexp" in t for t in targets), sorted(targets)


# ---- GPU: the cute kernels behind the same ops ---------------------------------------------

@pytest.fixture(scope="module")
def cute_ops():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from coda_train.kernels import op_set

    return op_set("cute")  # imports cute, which registers the CUDA kernels


# opcheck compares two calls of an op. FlashAttention 4's backward adds dq up with fp32 atomics in the
# order its CTAs finish, so two calls differ in the last bits: on the H200 up to 3.9e-3 absolute on bf16
# gradients of magnitude ~10 and 2.6e-3 on the statistic's partials (`scripts/check_kernels.py --repeat 10`,
# docs/bench/run_to_run-2026-12-03.json). A call that tracing breaks is off by O(1), far outside these.
# (The embedding backward's atomics differ by ~5e-7 in fp32, inside opcheck's default tolerance.)
RUN_TO_RUN_TOLERANCE = {op: dict(atol=1e-2, rtol=2e-2)
                        for op in ("attention_backward", "attention_rope_backward_rowscale_stat")}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [("tiny", 1000, 250), ("llama3_125m", 384, 128)], ids=lambda s: f"{s[0]}-M{s[1]}")
def test_opcheck_cute_kernels_bf16(cute_ops, shape):
    """Same op contract on the CUDA (cute) kernels: schema, fake tensor shapes, AOT dispatch."""
    from coda_train.model import PRESETS

    preset, M, T = shape
    for op, case, kw in cases(torch.bfloat16, PRESETS[preset].kernel_dims(M, T), "cuda"):
        torch.library.opcheck(L.CUSTOM_OPS[op.name], (), kw, **RUN_TO_RUN_TOLERANCE.get(op.name, {}))
