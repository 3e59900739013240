"""The CODA model on the reference backend against the eager model (autograd), and the ops'
hand-written backwards against autograd of their forward formulas."""


import random
import subprocess
import sys
import weakref

import pytest
import torch

import coda_train.kernels as K
from coda_train.kernels import reference as R
from coda_train.model import ConfigError, LlamaConfig, build_model, preset
from coda_train.model import coda as coda_module
from coda_train.model.coda import BlockShape, BlockWeights, CodaBlock, CodaLlama, LMHeadLoss

SMALL = dict(dim=64, n_heads=4, ffn_dim=96, vocab_size=101, max_seq_len=32)


def make_pair(cfg: LlamaConfig, dtype: torch.dtype, seed: int = 0, compute_dtype=None):
    """Eager and CODA (reference backend) models with the same weights in dtype, computing in
    compute_dtype (default: dtype)."""
    torch.manual_seed(seed)
    compute_dtype = compute_dtype or dtype
    eager = build_model(cfg, "eager", compute_dtype=compute_dtype).to(dtype)
    coda = build_model(cfg, "coda", backend="reference", compute_dtype=compute_dtype).to(dtype)
    coda.load_state_dict(eager.state_dict())
    return eager, coda


def loss_and_grads(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


CONFIGS = {
    "gqa_tied_3layers": dict(n_layers=3, n_kv_heads=2, tie_embeddings=True),
    "mha_untied_1layer": dict(n_layers=1, n_kv_heads=4, tie_embeddings=False),
    "gqa_untied_3layers": dict(n_layers=3, n_kv_heads=1, tie_embeddings=False),
    "mha_tied_1layer": dict(n_layers=1, n_kv_heads=4, tie_embeddings=True),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 7)])  # 3x7 = 21 tokens: odd token count
def test_coda_matches_eager_float64(name, batch, seq):
    cfg = preset("tiny", **SMALL, **CONFIGS[name])
    eager, coda = make_pair(cfg, torch.float64)
    # Non-trivial norm weights, so a gamma mix-up between blocks cannot hide.
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    coda.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    loss_c, grads_c = loss_and_grads(coda, tokens, targets)
    loss_e, grads_e = loss_and_grads(eager, tokens, targets)
    assert abs(loss_c - loss_e).item() / loss_e.item() < 1e-12
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        assert rel(grads_c[n], grads_e[n]) < 1e-10, n


@pytest.mark.parametrize("chunk_rows", [4, 128])
def test_lm_head_in_chunks_matches_eager_float64(chunk_rows, monkeypatch):
    """The LM head computes its gradient during the forward, chunk by chunk of rows: with 21 rows in
    chunks of 4 (the last one ragged) the loss and every gradient still equal eager's (float64), also
    for an incoming loss gradient other than 1; no chunk of logits exceeds chunk_rows rows."""
    cfg = preset("tiny", **SMALL, **CONFIGS["gqa_tied_3layers"])
    monkeypatch.setattr(coda_module, "LOGITS_CHUNK_BYTES", chunk_rows * cfg.vocab_size * 8)
    assert coda_module.logits_chunk_rows(cfg.vocab_size, 8) == chunk_rows
    eager, coda = make_pair(cfg, torch.float64)
    logits_rows, chunks, most_alive = [], [], [0]
    head_op = coda.ops.gemm_rowscale_exp_cross_entropy

    def head(h, *a):  # records each chunk's exponentials (weakly) and how many of them are alive when it starts
        logits_rows.append(h.shape[0])
        most_alive[0] = max(most_alive[0], sum(c() is not None for c in chunks))
        out = head_op(h, *a)
        chunks.append(weakref.ref(out[0]))
        return out

    coda.ops.gemm_rowscale_exp_cross_entropy = head
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (3, 7), generator=g) for _ in range(2))
    grads, saved = {}, []
    for name, model in (("coda", coda), ("eager", eager)):
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((name, tuple(t.shape))) or t, lambda t: t):
            loss = model(tokens, targets)
        (2.5 * loss).backward()
        grads[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert logits_rows == ([4, 4, 4, 4, 4, 1] if chunk_rows == 4 else [21])
    assert most_alive[0] == 0  # each chunk's logits are gone before the next chunk's exist
    # CODA holds no logits (or their exponentials) for the backward (eager holds them); the LM head holds its gradients
    coda_logit_rows = [shape[0] for n, shape in saved if n == "coda" and shape[1:] == (cfg.vocab_size,)]
    assert coda_logit_rows == [] and ("eager", (21, cfg.vocab_size)) in saved
    assert ("coda", (cfg.vocab_size, cfg.dim)) in saved and ("coda", (21, cfg.dim)) in saved
    (loss_c, grads_c), (loss_e, grads_e) = grads["coda"], grads["eager"]
    assert abs(loss_c - loss_e).item() / loss_e.item() < 1e-12
    for n in grads_e:
        assert rel(grads_c[n], grads_e[n]) < 1e-10, n



def random_legal_config(rng: random.Random) -> LlamaConfig:
    """Any shape LlamaConfig.validate accepts, small: head_dim from 2, MHA to MQA, odd FFN widths, vocabularies
    of 1 row to past two 128-column stat groups (ragged), and extreme but legal eps, theta and init std."""
    n_heads = rng.choice([1, 2, 3, 4, 6])
    return LlamaConfig(dim=n_heads * rng.choice([2, 4, 6, 10, 16]), n_layers=rng.choice([1, 2, 3]), n_heads=n_heads,
                       n_kv_heads=rng.choice([g for g in range(1, n_heads + 1) if n_heads % g == 0]),
                       ffn_dim=rng.choice([1, 7, 33, 64]), vocab_size=rng.choice([1, 2, 17, 128, 129, 257, 300]),
                       rope_theta=rng.choice([0.01, 10.0, 5e5, 1e9]), norm_eps=rng.choice([1e-12, 1e-5, 1.0, 10.0]),
                       max_seq_len=16, tie_embeddings=rng.random() < 0.5,
                       init_std=rng.choice([0.02, 0.2, 1.0])).validate()


@pytest.mark.parametrize("seed", range(20))
def test_random_legal_configs_match_eager_float64(seed, monkeypatch):
    """Random legal shapes, not only the presets: sequences of 1 to 16 tokens, batch 1 to 3, the LM head in ragged
    chunks or one, recompute=block or not, 1 to 3 accumulated micro-batches (loss / n each): the summed loss and every
    accumulated gradient equal eager's in float64, and so do the evaluation loss and the logits."""
    rng = random.Random(seed)
    cfg = random_legal_config(rng)
    batch, seq, n_micro = rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 7, 16]), rng.choice([1, 2, 3])
    chunk_rows = rng.choice([1, 3, 5, None])
    if chunk_rows is not None:
        monkeypatch.setattr(coda_module, "LOGITS_CHUNK_BYTES", chunk_rows * cfg.vocab_size * 8)
    torch.manual_seed(seed)
    eager = build_model(cfg, "eager", compute_dtype=torch.float64).double()
    coda = build_model(cfg, "coda", compute_dtype=torch.float64, recompute=rng.choice(["none", "block"])).double()
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    coda.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(seed)
    micro = [tuple(torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2)) for _ in range(n_micro)]
    results = {}
    for name, model in (("eager", eager), ("coda", coda)):
        losses = []
        for tokens, targets in micro:
            loss = model(tokens, targets)
            (loss / n_micro).backward()
            losses.append(loss.detach())
        with torch.no_grad():
            evaluated, logits = model(*micro[0]), model.logits(micro[0][0])
        results[name] = torch.stack(losses), evaluated, logits, {n: p.grad for n, p in model.named_parameters()}
    (loss_e, eval_e, logits_e, grads_e), (loss_c, eval_c, logits_c, grads_c) = results["eager"], results["coda"]
    assert (loss_c - loss_e).abs().max() < 1e-12 * max(1.0, loss_e.abs().max().item())  # vocab 1: loss 0
    assert abs(eval_c - eval_e) < 1e-12 * max(1.0, eval_e.abs().item())
    assert rel(logits_c, logits_e) < 1e-12
    for n in grads_e:
        assert (grads_c[n] - grads_e[n]).norm() <= 1e-10 * grads_e[n].norm() + 1e-14, (cfg, n)

def test_logits_chunk_rows_follow_the_memory_budget():
    # llama3_1b in bf16: 4096 rows of 128256 logits is 0.98 GiB, a multiple of the 128-row tile
    assert coda_module.logits_chunk_rows(128256, 2) == 4096
    assert coda_module.logits_chunk_rows(128256, 2) * 128256 * 2 <= coda_module.LOGITS_CHUNK_BYTES
    assert coda_module.logits_chunk_rows(32768, 2) == 16384
    assert coda_module.logits_chunk_rows(1 << 31, 4) == 1  # at least one row


@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-2, 0.1)])
def test_coda_close_to_eager_low_precision(dtype, loss_tol, grad_tol):
    """fp32: loss to 1e-5 rel, grads to 1e-4 rel. bf16: loss to 2e-2 rel, each grad to 0.1 rel
    (bf16 rounds to 8 bits; the two models round at different places by design)."""
    cfg = preset("tiny", n_layers=2, n_kv_heads=2, **SMALL)
    eager, coda = make_pair(cfg, torch.float32, compute_dtype=dtype)
    ref, _ = make_pair(cfg, torch.float64)
    ref.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(2))
    targets = tokens.roll(-1, dims=1)
    loss_c, grads_c = loss_and_grads(coda, tokens, targets)
    loss_e, grads_e = loss_and_grads(eager, tokens, targets)
    loss_r, grads_r = loss_and_grads(ref, tokens, targets)
    assert torch.isfinite(loss_c) and all(torch.isfinite(g).all() for g in grads_c.values())
    assert abs(loss_c - loss_e).item() / loss_e.item() < loss_tol
    for n in grads_e:
        assert rel(grads_c[n], grads_e[n]) < grad_tol, n
        # CODA in low precision is no less accurate than eager in low precision (2x slack + floor).
        assert rel(grads_c[n].double(), grads_r[n]) <= 2 * rel(grads_e[n].double(), grads_r[n]) + 1e-6, n


def test_parameter_layout_and_initialization_shared():
    """One state-dict layout, and one seed gives both models the same initial weights (built
    separately, nothing loaded): a CODA-vs-eager curve starts from one point."""
    cfg = preset("tiny", n_layers=2, **SMALL)
    torch.manual_seed(7)
    eager = build_model(cfg, "eager")
    torch.manual_seed(7)
    coda = build_model(cfg, "coda", backend="reference")
    e, c = eager.state_dict(), coda.state_dict()
    assert list(e) == list(c)
    assert all(torch.equal(e[k], c[k]) for k in e)
    assert not torch.equal(e["layers.0.w_qkv"], e["layers.1.w_qkv"])  # initialized, not left equal


# ---- gradchecks of the hand-written backwards -------------------------------------------------

def _block_inputs(cfg, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, dt = cfg.dim, torch.float64

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=dt) * scale).requires_grad_()

    x = rnd(batch * seq, d)
    params = dict(attn_norm=rnd(d, scale=0.3) + 1, w_qkv=rnd(cfg.qkv_dim, d, scale=d ** -0.5),
                  w_o=rnd(d, cfg.n_heads * cfg.head_dim, scale=d ** -0.5), mlp_norm=rnd(d, scale=0.3) + 1,
                  w_gate_up=rnd(2 * cfg.ffn_dim, d, scale=d ** -0.5), w_down=rnd(d, cfg.ffn_dim, scale=cfg.ffn_dim ** -0.5),
                  next_norm=rnd(d, scale=0.3) + 1)
    return x, {k: v.detach().requires_grad_() for k, v in params.items()}


def test_block_backward_gradcheck():
    """One block with its input (h, r) made from x; the output triple collapsed to a scalar-ish
    function of x2 and next block's norm, so the block's total gradient of x is checked."""
    cfg = preset("tiny", dim=16, n_heads=4, n_kv_heads=2, ffn_dim=24, vocab_size=11, max_seq_len=8, n_layers=1)
    batch, seq = 2, 5
    x, p = _block_inputs(cfg, batch, seq)
    model = build_model(cfg, "coda", compute_dtype=torch.float64).double()
    rope = model.rope_rows(batch * seq, seq, x.device)
    shape = BlockShape(cfg.n_heads, cfg.n_kv_heads, seq, cfg.norm_eps)

    def block(x, attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down):
        h = x * attn_norm  # the producer's caches, as functions of x (detached inside the Function)
        r = torch.rsqrt(x.pow(2).mean(-1) + cfg.norm_eps)
        weights = BlockWeights(attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, p["next_norm"])
        x2, _, _ = CodaBlock.apply(x, h.detach(), r.detach(), attn_norm, w_qkv, w_o, mlp_norm, w_gate_up,
                                   w_down, weights, rope, shape, model.ops)
        return x2

    args = (x, p["attn_norm"], p["w_qkv"], p["w_o"], p["mlp_norm"], p["w_gate_up"], p["w_down"])
    assert torch.autograd.gradcheck(block, args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("chunk_rows", [None, 3])  # 7 rows: one chunk, or chunks of 3, 3, 1
def test_lm_head_backward_gradcheck(chunk_rows, monkeypatch):
    if chunk_rows is not None:
        monkeypatch.setattr(coda_module, "LOGITS_CHUNK_BYTES", chunk_rows * 13 * 8)  # V = 13, float64
    g = torch.Generator().manual_seed(3)
    M, d, V = 7, 6, 13
    x = torch.randn(M, d, generator=g, dtype=torch.float64, requires_grad=True)
    norm = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    w = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (M,), generator=g)

    def head(x, norm, w):
        r = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
        return LMHeadLoss.apply(x, (x * norm).detach(), r.detach(), norm, w, norm, w, targets, K.op_set("reference"))

    assert torch.autograd.gradcheck(head, (x, norm, w), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_lm_head_gradient_keeps_fp32_precision_at_large_logits(shift):
    """Every logit raised by shift leaves the softmax gradient as it was; in fp32 the CODA LM head's
    weight gradient must stay within 3x of autograd's error on the same logits (H' takes its factors
    from sum_g sum_exp_g 2^(k_g - k_max), not from exp(. - L), which loses |L| 2^-24: 10x at 1000)."""
    g = torch.Generator().manual_seed(0)
    M, d, V = 64, 32, 300
    h = torch.cat([torch.randn(M, d, generator=g, dtype=torch.float64), torch.full((M, 1), shift, dtype=torch.float64)], 1)
    w = torch.cat([torch.randn(V, d, generator=g, dtype=torch.float64) / d ** 0.5, torch.ones(V, 1, dtype=torch.float64)], 1)
    targets = torch.randint(0, V, (M,), generator=g)

    def g_w(dtype, coda):
        hh, ww = h.to(dtype), w.to(dtype, copy=True).requires_grad_()
        r, norm = torch.ones(M, dtype=dtype), torch.ones(d + 1, dtype=dtype)
        if coda:
            loss = LMHeadLoss.apply(hh, hh, r, norm, ww, norm, ww.detach(), targets, K.op_set("reference"))
        else:
            loss = torch.nn.functional.cross_entropy(hh @ ww.t(), targets)
        loss.backward()
        return ww.grad.double()

    want = g_w(torch.float64, coda=False)
    assert rel(g_w(torch.float32, coda=True), want) <= 3 * rel(g_w(torch.float32, coda=False), want) + 1e-7


@pytest.mark.parametrize("shift", [0.0, 30.0, 1000.0])
def test_final_norm_statistic_adds_no_fp32_error_to_its_logits(shift):
    """S = sum_j g_y,j y_j (H') in fp32 within 1e-5 of S computed exactly from the same fp32 logits,
    whatever their common offset: H sums e*t with t = y log2e - k_g rounded once (an fma), so no
    term has the largest logit's size (logits ~170 at both shifts, spread ~0.2 at 30 and ~0.006 at
    1000: S is now 2e-7 and 3e-6 off, where summing e*y cost 5e-5 and 2e-3). The
    logits' own fp32 rounding (|y| 2^-24 each) is S's error floor, as in any method that takes S
    from the logits (reverse fusion)."""
    g = torch.Generator().manual_seed(0)
    M, d, V = 64, 32, 300
    x = torch.cat([torch.randn(M, d, generator=g), torch.full((M, 1), shift)], 1)  # logits ~ 5.7 * 30 + ...
    w = torch.cat([torch.randn(V, d, generator=g) / d ** 0.5, torch.full((V, 1), 30.0)], 1)
    targets = torch.randint(0, V, (M,), generator=g)
    r = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
    y = ((x @ w.t()) * r[:, None]).double()  # the logits the op computes, exactly
    want = ((torch.softmax(y, -1) * y).sum(-1) - y.gather(1, targets[:, None]).squeeze(1)) / M
    e, k, se, st, yt = R.gemm_rowscale_exp_cross_entropy(x, r, w, targets)
    stat = R.cross_entropy_exp_backward(e, k, se, st, yt, targets, r, x, torch.tensor(1.0 / M))[4][:, 0]
    assert rel(stat.double(), want) <= 1e-5


def test_lm_head_backward_is_exact_when_retained_and_scales_in_place_when_freed():
    """LMHeadLoss.backward: with the graph retained, each call gives the gradients of g_loss = 1 times
    its own g_loss, exactly (0 included), and leaves the saved tensors as they were; the last call
    (graph freed) works in the saved tensors themselves, which become the .grad (no second V x d
    buffer). Two chunks of rows, both weight gradients accumulated in the forward."""
    g = torch.Generator().manual_seed(5)
    M, d, V = 7, 6, 13
    x = torch.randn(M, d, generator=g, dtype=torch.float64, requires_grad=True)
    norm = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    w = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(coda_module, "LOGITS_CHUNK_BYTES", 4 * V * 8)  # chunks of 4 rows: 4 + 3
        loss = LMHeadLoss.apply(x, (x * norm).detach(), r, norm, w, norm.detach(), w.detach(),
                                torch.randint(0, V, (M,), generator=g), K.op_set("reference"))
    saved = [t.clone() for t in loss.grad_fn.saved_tensors]  # g_x, g_norm, g_w for g_loss = 1
    assert [tuple(t.shape) for t in saved] == [(M, d), (d,), (V, d)]
    unit = torch.autograd.grad(loss, (x, norm, w), retain_graph=True)
    for scale in (2.5, 0.0, -1.25):
        got = torch.autograd.grad(loss, (x, norm, w), torch.tensor(scale, dtype=torch.float64), retain_graph=True)
        assert all(torch.equal(a, b * scale) for a, b in zip(got, unit)), scale
        assert all(torch.equal(a, b) for a, b in zip(loss.grad_fn.saved_tensors, saved)), scale
    ptrs = [t.data_ptr() for t in loss.grad_fn.saved_tensors[:3]]
    (3.0 * loss).backward()
    for p, u, ptr in zip((x, norm, w), unit, ptrs):
        assert torch.equal(p.grad, u * 3.0) and p.grad.data_ptr() == ptr


def test_attention_backward_matches_autograd():
    g = torch.Generator().manual_seed(4)
    H, Hkv, T, B, hd = 4, 2, 5, 3, 4
    qkv = torch.randn(B * T, (H + 2 * Hkv) * hd, generator=g, dtype=torch.float64, requires_grad=True)
    o, lse = R.attention(qkv, H, Hkv, T)
    g_o = torch.randn_like(o)
    (expected,) = torch.autograd.grad(o, qkv, g_o)
    assert rel(R.attention_backward(g_o, qkv.detach(), o.detach(), lse, H, Hkv, T), expected) < 1e-12
    # lse is the logsumexp of the causal scores: check against SDPA's output too.
    q, k, v = qkv.detach().split([H * hd, Hkv * hd, Hkv * hd], 1)
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel(o.detach(), sdpa.transpose(1, 2).reshape(B * T, -1)) < 1e-12


def test_attention_rope_backward_and_statistic():
    """B5 + B6a against autograd through RoPE and attention, with and without GQA."""
    g = torch.Generator().manual_seed(5)
    T, B, hd = 6, 2, 4
    for H, Hkv in ((4, 2), (2, 2)):
        M, n_rope = B * T, (H + Hkv) * hd
        y = torch.randn(M, (H + 2 * Hkv) * hd, generator=g, dtype=torch.float64, requires_grad=True)
        r = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
        angles = (torch.rand(T, hd // 2, generator=g, dtype=torch.float64) * 6).repeat(B, 1)
        rope = torch.stack((angles.cos(), angles.sin()), dim=-1).reshape(M, hd)
        qkv = R._rotate_pairs(y, rope, n_rope, inverse=False)
        o, lse = R.attention(qkv, H, Hkv, T)
        g_o = torch.randn_like(o)
        (g_y,) = torch.autograd.grad(o, y, g_o)
        g_y_scaled, stat = R.attention_rope_backward_rowscale_stat(g_o, qkv.detach(), o.detach(), lse, r, rope, H, Hkv, T)
        assert rel(g_y_scaled, g_y * r[:, None]) < 1e-12
        assert rel(stat.sum(-1), (g_y * y).sum(-1)) < 1e-12  # rotation preserves the dot product


def test_dswiglu_and_norm_backward_match_autograd():
    g = torch.Generator().manual_seed(6)
    M, d, f = 9, 8, 10
    x = torch.randn(M, d, generator=g, dtype=torch.float64, requires_grad=True)
    gamma = torch.rand(d, generator=g, dtype=torch.float64, requires_grad=True)
    w_gu = torch.randn(2 * f, d, generator=g, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(d, f, generator=g, dtype=torch.float64, requires_grad=True)
    eps = 1e-5
    # Autograd of the plain formula: out = swiglu(rmsnorm(x)*gamma @ w_gu^T) @ w_down^T.
    r = torch.rsqrt(x.pow(2).mean(-1) + eps)
    gu = (x * gamma) @ w_gu.t() * r[:, None]
    gate, up = gu.chunk(2, -1)
    out = (torch.nn.functional.silu(gate) * up) @ w_down.t()
    g_out = torch.randn_like(out)
    ex = torch.autograd.grad(out, (x, gamma, w_gu, w_down), g_out)
    # The op chain B1, B2, B3, from what F5 stores: the gate and a (not up).
    gate_d, a, r_d = gate.detach(), (torch.nn.functional.silu(gate) * up).detach(), r.detach()
    g_gu, stat = R.gemm_dswiglu_rowscale_stat(g_out, w_down.detach(), gate_d, a, r_d)
    c = R.rmsnorm_backward_coeff(stat, r_d, d)
    g_x, g_gamma = R.gemm_rmsnorm_backward(g_gu, w_gu.detach(), torch.zeros_like(x), x.detach(), gamma.detach(), c)
    assert rel(g_x, ex[0]) < 1e-12 and rel(g_gamma, ex[1]) < 1e-12
    assert rel(R.matmul_tn(g_gu, (x * gamma).detach()), ex[2]) < 1e-12
    assert rel(R.matmul_tn(g_out, a), ex[3]) < 1e-12


def test_ffn_units_with_zero_gate_weights_train_as_in_eager_float64():
    """A unit whose gate row is all zero (zero-initialised, or added to widen the FFN) has gate = 0 on every token:
    F5 stores it as 2^-100 (reference.floor_gate) so a = silu(gate) * up keeps up, and B1's g_gate is
    g_a * up / 2, as autograd's; it used to be 0, and such a unit never trained."""
    cfg = preset("tiny", **SMALL, n_layers=1, n_kv_heads=2)
    eager, coda = make_pair(cfg, torch.float64)
    with torch.no_grad():
        eager.layers[0].w_gate_up[:8] = 0.0  # the gate rows of units 0-7
    coda.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    loss_c, grads_c = loss_and_grads(coda, tokens, targets)
    loss_e, grads_e = loss_and_grads(eager, tokens, targets)
    assert abs(loss_c - loss_e).item() / loss_e.item() < 1e-12
    assert grads_e["layers.0.w_gate_up"][:8].norm() > 0
    for n in grads_e:
        assert rel(grads_c[n], grads_e[n]) < 1e-10, n


def test_f5_stores_tiny_gates_so_b1_keeps_up_in_bf16():
    """From F5's outputs, B1 matches dSwiGLU on (gate, up) in bf16 also where the gate is exactly 0."""
    g = torch.Generator().manual_seed(8)
    M, d, f = 32, 16, 24
    h, w_gu = torch.randn(M, d, generator=g).bfloat16(), torch.randn(2 * f, d, generator=g).bfloat16()
    w_gu[:4] = 0.0  # gate = 0 exactly for units 0-3
    r = torch.rand(M, generator=g) + 0.5
    gate, a = R.gemm_rowscale_swiglu(h, r, w_gu)
    assert (gate[:, :4].float() == 2.0 ** -100).all() and (a[:, :4] != 0).any()
    g_out, w_down = torch.randn(M, d, generator=g).bfloat16(), torch.randn(d, f, generator=g).bfloat16()
    g_gu, _ = R.gemm_dswiglu_rowscale_stat(g_out, w_down, gate, a, r)
    up = (h.float() @ w_gu.float().t() * r[:, None])[:, f:]
    want_gate = (g_out @ w_down).float() * up * 0.5 * r[:, None]  # g_a * up * sigmoid(0) at gate = 0
    assert rel(g_gu[:, :4].float(), want_gate[:, :4]) < 2e-2


def test_f5_gate_floor_moves_a_by_less_than_2_pow_minus_100_of_up():
    """The bound docs/design.md and reference.floor_gate state for F5's floor, in float64: a = silu(gate) * up
    moves by less than 2^-100 |up|, and by more than 2^-101 |up| (the bound they used to state) for a gate just
    above -2^-100, where silu(gate) is about -2^-101 and the stored silu(2^-100) about +2^-101."""
    floor = R.GATE_FLOOR
    gate = torch.tensor([-floor * (1 - 2.0 ** -20), -floor / 2, 0.0, 2.0 ** -1074, floor / 2, floor * (1 - 2.0 ** -20)],
                        dtype=torch.float64)
    up = torch.tensor([1.0, -3.0, 2.0, -0.5, 7.0, 1.0], dtype=torch.float64)
    move = (torch.nn.functional.silu(R.floor_gate(gate)) * up - torch.nn.functional.silu(gate) * up).abs() / up.abs()
    assert (move < floor).all(), move / floor
    assert move[0] > floor / 2, move[0] / floor
    w_gate_up = torch.tensor([[gate[0].item()], [up[0].item()]], dtype=torch.float64)  # and F5 itself, h = 1, r = 1
    stored_gate, a = R.gemm_rowscale_swiglu(torch.ones(1, 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), w_gate_up)
    assert stored_gate.item() == floor and floor / 2 < abs(a.item() - torch.nn.functional.silu(gate[0]).item()) < floor


@pytest.mark.parametrize("batch, chunk_rows", [(3, 128), (2, 128), (1, 128), (2, 256)])  # ragged, even, one chunk, M = C
def test_step_gemm_shapes_are_the_gemms_a_step_launches(batch, chunk_rows, monkeypatch):
    """step_gemm_shapes (what the tile table is keyed by and scripts/tune_gemm.py tunes) lists the shape class of
    every GEMM one bf16 training step launches, and no other: the LM head's last, ragged chunk included."""
    import inspect

    from coda_train.kernels import OpSet
    from coda_train.kernels.tile_configs import shape_class

    monkeypatch.setattr(coda_module, "LOGITS_CHUNK_BYTES", chunk_rows * 256 * 2)  # V = 256, bf16 logits
    cfg = preset("tiny", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, max_seq_len=64, n_layers=1)
    model = build_model(cfg, "coda", backend="reference", compute_dtype=torch.bfloat16)
    launched = set()

    def recording(name, fn):
        def op(*args, **kwargs):
            if K.OPS[name].gemm is not None:
                launched.add(shape_class(name, *K.OPS[name].gemm(**inspect.signature(fn).bind(*args, **kwargs).arguments)))
            return fn(*args, **kwargs)
        return op

    model.ops = OpSet("reference", {n: recording(n, getattr(model.ops, n)) for n in K.OPS})
    tokens = torch.randint(0, 256, (batch, 64))
    model(tokens, tokens).backward()
    listed = {shape_class(op, *mnk) for op, mnk in coda_module.step_gemm_shapes(cfg.kernel_dims(batch * 64, 64))}
    assert launched == listed


def test_dswiglu_from_gate_and_a_matches_dswiglu_from_gate_and_up():
    """B1 reads F5's gate and a, not up (docs/design.md, "SwiGLU: two stored tiles each way"): in bf16 its
    g_gu and statistic match dSwiGLU on the stored gate and up to bf16 rounding; given a gate F5 never stores
    (|gate| < 2^-126: 0 or subnormal, so a has lost up) g_gate is 0 and finite, where dSwiGLU on (gate, up)
    gives about g_a*up/2; a zero row agrees exactly."""
    g = torch.Generator().manual_seed(7)
    M, d, f = 64, 32, 48
    gate, up = (torch.randn(M, f, generator=g).bfloat16() for _ in range(2))
    gate[3, 5], gate[4, 6], gate[7], up[7] = 0.0, 1e-39, 0.0, 0.0  # an exact-zero and a subnormal gate; a zero row
    up[4, 6] = 1.0  # large enough that a keeps a (subnormal) trace of it: a / gate would be finite and nonzero
    g_out, w_down, r = torch.randn(M, d, generator=g).bfloat16(), torch.randn(d, f, generator=g).bfloat16(), torch.rand(M, generator=g) + 0.5
    a = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()  # F5's a from the gate and up
    assert a[4, 6] != 0
    g_gu, stat = R.gemm_dswiglu_rowscale_stat(g_out, w_down, gate, a, r)
    # dSwiGLU on (gate, up) in fp32, the program B1 ran before
    g_a, gf, uf = (g_out @ w_down).float(), gate.float(), up.float()
    sig = torch.sigmoid(gf)
    want_gate, want_up = g_a * uf * sig * (1 + gf * (1 - sig)), g_a * gf * sig
    want = torch.cat((want_gate, want_up), -1) * r[:, None]
    want_stat = (want_gate * gf + want_up * uf).sum(-1)
    lost = torch.zeros_like(gf, dtype=torch.bool)
    lost[3, 5] = lost[4, 6] = True
    got = g_gu.float()
    assert (got[:, :f][lost] == 0).all() and (want[:, :f][lost].abs() > 0).all()  # the one place they differ
    assert torch.isfinite(got).all() and torch.isfinite(stat).all()
    want[:, :f][lost] = 0.0
    assert rel(got, want) < 5e-3 and (got[7] == want[7]).all()  # bf16: a's rounding and g_gu's store (2e-3 here)
    assert rel(stat.sum(-1), want_stat) < 5e-3  # a lost gate's term is (nearly) 0 in both
    assert (R.up_times_sigmoid(gate.float(), a.float())[lost] == 0).all()


def test_reference_op_set_is_the_declared_references():
    ops = K.op_set("reference")
    assert ops.backend == "reference"
    for name, op in K.OPS.items():
        assert getattr(ops, name) is op.reference is getattr(R, name), name


# ---- config and backend errors ----------------------------------------------------------------

@pytest.mark.parametrize("overrides,fragment", [
    (dict(n_heads=3), "must divide dim"),
    (dict(n_kv_heads=3), "must divide n_heads"),
    (dict(dim=24, n_heads=8, n_kv_heads=8), "must be even"),
    (dict(n_layers=0), "positive integer"),
])
def test_config_validation(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        preset("tiny", **overrides)


def shape(cfg: LlamaConfig) -> tuple:
    return (cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.rope_theta,
            cfg.norm_eps, cfg.tie_embeddings, cfg.max_seq_len)


def test_presets():
    """The published shapes the README names (Llama 3.2 1B without its RoPE scaling and 131072 positions, Llama 3 8B),
    with their published parameter counts, which num_params gives and the model has."""
    one_b, eight_b = preset("llama3_1b"), preset("llama3_8b")
    assert shape(one_b) == (2048, 8192, 16, 32, 8, 64, 128256, 500000.0, 1e-5, True, 8192)
    assert shape(eight_b) == (4096, 14336, 32, 32, 8, 128, 128256, 500000.0, 1e-5, False, 8192)
    assert shape(preset("llama3_125m")) == (768, 2048, 12, 12, 4, 64, 32768, 500000.0, 1e-5, True, 2048)
    counts = {"tiny": 5_245_184, "llama3_125m": 100_682_496, "llama3_1b": 1_235_814_400, "llama3_8b": 8_030_261_248}
    for name, count in counts.items():
        with torch.device("meta"):  # shapes only
            model = build_model(preset(name), "eager")
        assert preset(name).num_params() == sum(p.numel() for p in model.parameters()) == count, name
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("llama9")
    with pytest.raises(ConfigError, match="unknown model config fields"):
        preset("tiny", dims=3)


def test_flops_per_token_counts_each_matmul_weight_once():
    """6 FLOPs a token per weight a matmul reads (the LM head's once when tied to the embedding; no RMSNorm
    gain, no embedding lookup), plus causal attention's 6*L*T*d, as counted from the model's own parameters."""
    for name in ("tiny", "llama3_125m", "llama3_8b"):
        cfg = preset(name)
        with torch.device("meta"):
            model = build_model(cfg, "eager")
        matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # the embedding is one, tied or not
        matmul_weights = matrices - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
        T = 2048
        assert cfg.flops_per_token(T) == 6 * matmul_weights + 6 * cfg.n_layers * T * cfg.dim, name


def test_backend_errors_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = preset("tiny", **SMALL, n_layers=1)
    for call in (lambda: K.resolve_backend("cute"), lambda: K.op_set("cute"),
                 lambda: build_model(cfg, "coda", backend="cute")):
        with pytest.raises(K.BackendError, match="needs a CUDA GPU"):
            call()
    for call in (lambda: K.resolve_backend("triton"), lambda: build_model(cfg, "eager", backend="triton")):
        with pytest.raises(K.BackendError, match="unknown kernels.backend"):
            call()
    assert K.resolve_backend("auto") == "reference" and K.op_set("auto").backend == "reference"
    assert build_model(cfg, "coda", backend="auto").ops.backend == "reference"


def test_each_model_holds_its_own_op_set_and_kernels_hold_no_backend_state():
    """Two CODA models in one process, each with the op set it was built with; nothing in
    coda_train.kernels says which backend runs."""
    cfg = preset("tiny", **SMALL, n_layers=1)
    a = build_model(cfg, "coda", backend="reference", compute_dtype=torch.float64).double()
    b = build_model(cfg, "coda", backend="reference", compute_dtype=torch.float32)
    assert isinstance(a, CodaLlama) and a.ops is not b.ops and a.ops.backend == "reference"
    for gone in ("set_backend", "get_backend", "use_backend", "_impl"):
        assert not hasattr(K, gone), gone
    # Swapping one model's op set for a recording one changes only that model's calls.
    calls = []

    def recording(name):
        fn = getattr(a.ops, name)
        return lambda *args: calls.append(name) or fn(*args)

    a.ops = K.OpSet("recording", {name: recording(name) for name in K.OPS})
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_b = b(tokens, tokens)
    assert not calls
    loss_a = a(tokens, tokens)
    assert "gemm_rowscale_rope" in calls and "gemm_rowscale_exp_cross_entropy" in calls
    assert "gemm_rowscale_cross_entropy" not in calls  # training: the loss and its gradient (H, H', H'')
    assert abs(loss_a.item() - loss_b.item()) < 1e-5
    calls.clear()
    with torch.no_grad():  # evaluation: lse and target logit only, no logits stored, no gradient work
        assert abs(a(tokens, tokens).item() - loss_a.item()) < 1e-12
    assert "gemm_rowscale_cross_entropy" in calls and "gemm_rowscale_exp_cross_entropy" not in calls
    assert "cross_entropy_exp_backward" not in calls and "matmul_tn" not in calls


def test_compute_dtype_is_fixed_at_construction():
    model = build_model(preset("tiny", **SMALL, n_layers=1), "eager", compute_dtype=torch.float64)
    assert model.compute_dtype == torch.float64
    with pytest.raises(AttributeError):
        model.compute_dtype = torch.float32


def test_kernels_import_nothing_of_model_trainer_or_config():
    code = ("import sys, coda_train.kernels, coda_train.kernels.library, coda_train.kernels.testing, "
            "coda_train.kernels.cute_limits; "
            "bad = [m for m in sys.modules if m.startswith(('coda_train.model', 'coda_train.trainer', 'coda_train.config'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ---- the LM-head logits (op gemm_rowscale) ----------------------------------------------------

@pytest.mark.parametrize("name", ["gqa_tied_3layers", "mha_untied_1layer"])
def test_coda_logits_match_eager_loss_float64(name):
    """CodaLlama.logits in float64: the cross-entropy of the logits is the eager model's loss for
    every target draw, so each row's logits agree with eager's at the targets and in logsumexp."""
    cfg = preset("tiny", **SMALL, **CONFIGS[name])
    eager, coda = make_pair(cfg, torch.float64)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (3, 7), generator=g)
    logits = coda.logits(tokens)
    assert logits.shape == (3, 7, cfg.vocab_size) and logits.dtype == torch.float64
    for _ in range(5):
        targets = torch.randint(0, cfg.vocab_size, (3, 7), generator=g)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with torch.no_grad():
            assert abs(ce - eager(tokens, targets)).item() < 1e-12 * ce.item()
    # per row: the fused CE op's lse and target logit are the logits' logsumexp and target entry
    x, h, r, _ = coda._blocks(tokens)
    lse, target_logit = coda.ops.gemm_rowscale_cross_entropy(h, r, coda.lm_weight, targets.flatten())
    assert rel(logits.flatten(0, 1).logsumexp(-1), lse) < 1e-14
    assert rel(logits.flatten(0, 1).gather(1, targets.reshape(-1, 1)).squeeze(1), target_logit) < 1e-14


def test_coda_logits_bf16_close_to_float64():
    cfg = preset("tiny", **SMALL, n_layers=2)
    _, coda64 = make_pair(cfg, torch.float64)
    _, coda16 = make_pair(cfg, torch.float32, compute_dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(8))
    got, want = coda16.logits(tokens), coda64.logits(tokens)
    assert got.dtype == torch.bfloat16 and rel(got.double(), want) < 2e-2


def test_seq_len_limit():
    cfg = preset("tiny", **SMALL, n_layers=1)
    model = build_model(cfg, "coda")
    tokens = torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens, tokens)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bf16_compute_copies_are_cast_once_per_update_and_gradients_stay_fp32(monkeypatch, tied):
    """The CODA model reads bf16 copies of its fp32 weights, made at the first read and then
    rewritten by one fused copy only after the weights changed; the embedding table is gathered from
    the fp32 weights and the LM head casts its weight at its one read per step (neither table has a kept
    copy); its weight gradients arrive in fp32 straight from the ops (never rounded to bf16 on the way)."""
    cfg = preset("tiny", **SMALL, n_layers=2, tie_embeddings=tied)
    _, coda = make_pair(cfg, torch.float32, compute_dtype=torch.bfloat16)
    coda.weight_updates_tracked = True  # as under the trainer's AdamW: an update is seen by its version counter
    copies = []
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copies.append(len(dst)), real_copy(dst, src)))
    g = torch.Generator().manual_seed(9)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))

    loss = coda(tokens, targets)
    loss.backward()
    params = list(coda.parameters())
    copied = {id(p) for p in params} - {id(coda.tok_emb), id(coda.lm_weight)}
    assert set(coda._copies) == copied and copies == []  # every weight read in bf16 cast once, at its first read
    for p in params:
        if id(p) in copied:
            assert torch.equal(coda.compute_copy(p), p.detach().bfloat16())
    for name, p in coda.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    matrices = [p.grad for p in coda.parameters() if p.dim() == 2]
    assert all((m.bfloat16().float() != m).any() for m in matrices)  # not rounded through bf16

    with torch.no_grad():
        before = coda(tokens, targets)
        assert coda(tokens, targets) == before  # unchanged weights: no copy, the same loss
    assert copies == []
    with torch.no_grad():
        coda.layers[1].w_down.mul_(2.0)  # an optimizer-like in-place update of one weight
        changed = coda(tokens, targets)
    assert copies == [1] and changed != before
    coda.refresh_compute_copies(force=True)  # after a fused optimizer step: every copy in one call
    assert copies == [1, len(copied)]


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_training_after_a_forward_under_inference_mode(impl):
    """A user's evaluation under torch.inference_mode() must not leave the model's caches (RoPE tables,
    bf16 compute copies) as inference tensors, which autograd refuses to save: training after it gives
    the gradients of a model that never ran one, also after an update is seen under inference_mode."""
    cfg = LlamaConfig(n_layers=2, n_kv_heads=2, **SMALL)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = tokens.roll(-1, 1)
    models = [build_model(cfg, impl, compute_dtype=torch.bfloat16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for step in range(2):
        with torch.inference_mode():
            models[0](tokens, targets)
        grads = [loss_and_grads(m, tokens, targets)[1] for m in models]
        for name in grads[1]:
            assert torch.equal(grads[0][name], grads[1][name]), (step, name)
        for m in models:  # an update, seen by the next forward (under inference_mode for models[0])
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(1e-2 * p.grad)


def test_compute_copies_follow_updates_no_version_counter_sees():
    """torch's fused AdamW (and p.data.add_) update the weights in place without bumping their version counters:
    outside the trainer (no AdamW of ours vouching for every update) each forward rewrites the copies, so the
    model computes with the updated weights, as the eager model does; force=True does the same on request."""
    cfg = preset("tiny", **SMALL, n_layers=1)
    eager, coda = make_pair(cfg, torch.float32, compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    for m in (eager, coda):
        m(tokens, targets).backward()
    w = coda.layers[0].w_down
    version = w._version
    for m in (eager, coda):
        torch.optim.AdamW(m.parameters(), lr=0.1, fused=True).step()
    assert w._version == version  # unseen by the version check
    with torch.no_grad():
        assert coda(tokens, targets).item() == pytest.approx(eager(tokens, targets).item(), rel=2e-2)
    assert torch.equal(coda.compute_copy(w), w.detach().bfloat16())
    w.data.add_(1.0)  # unseen too
    with torch.no_grad():
        coda(tokens, targets)
    assert torch.equal(coda.compute_copy(w), w.detach().bfloat16())
    coda.weight_updates_tracked = True  # the trainer's contract: then force=True is the way to show such an update
    w.data.add_(1.0)
    coda.refresh_compute_copies(force=True)
    assert torch.equal(coda.compute_copy(w), w.detach().bfloat16())
    eager.refresh_compute_copies(force=True)
    assert eager._copies == {}  # a model that never read copies gets none


def test_the_trainers_adamw_vouches_for_every_update():
    from coda_train.config import OptimConfig
    from coda_train.trainer.optim import build_optimizer

    _, coda = make_pair(preset("tiny", **SMALL, n_layers=1), torch.float32, compute_dtype=torch.bfloat16)
    assert not coda.weight_updates_tracked
    build_optimizer(coda, OptimConfig(), torch.device("cpu"))
    assert coda.weight_updates_tracked


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_a_batch_of_other_id_dtypes_or_no_tokens_is_refused_with_the_fix(impl):
    """uint8 ids indexed the CODA model's embedding as a boolean mask (an IndexError deep inside), int32 targets passed
    CODA but not eager's cross-entropy, and an empty batch crashed in a reshape: each is one message now."""
    model = build_model(preset("tiny"), impl)
    ids = torch.randint(0, 10, (2, 8))
    for tokens, targets, words in ((ids.to(torch.uint8), ids, "convert them with .long()"),
                                   (ids, ids.int(), "convert them with .long()"),
                                   (ids[:, :0], ids[:, :0], "not empty")):
        with pytest.raises(ValueError, match=words):
            model(tokens, targets)
