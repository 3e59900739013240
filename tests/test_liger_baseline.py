"""The Liger baseline computes the same function as the eager model."""

import pytest
import torch

from coda_train.model import build_model, preset
from coda_train.model.eager import apply_rope


def rotate_half_rope(x, cos, sin):
    """RoPE in the halves convention (i, i+hd/2) that Liger's kernel implements (x: B, H, T, hd)."""
    c, s = cos.repeat(1, 2), sin.repeat(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def test_weight_row_gather_turns_halves_rope_into_interleaved_rope():
    cfg = preset("tiny", dim=32, n_heads=4, n_kv_heads=2, ffn_dim=16, vocab_size=17, n_layers=1, max_seq_len=8)
    model = build_model(cfg, "liger", compute_dtype=torch.float64).double()
    B, T, H, Hkv, hd = 2, 6, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = model.rope_tables(T, torch.device("cpu"))
    h = torch.randn(B, T, cfg.dim, dtype=torch.float64)
    w = model.layers[0].w_qkv.detach()
    rows = model._interleaved_to_halves_rows(torch.device("cpu"))
    q, k, v = (h @ w.t()).split([H * hd, Hkv * hd, Hkv * hd], -1)
    qp, kp, vp = (h @ w[rows].t()).split([H * hd, Hkv * hd, Hkv * hd], -1)
    q, k = apply_rope(q.view(B, T, H, hd), cos, sin), apply_rope(k.view(B, T, Hkv, hd), cos, sin)
    qp = rotate_half_rope(qp.view(B, T, H, hd).transpose(1, 2), cos, sin).transpose(1, 2)
    kp = rotate_half_rope(kp.view(B, T, Hkv, hd).transpose(1, 2), cos, sin).transpose(1, 2)
    # Same attention scores (q.k per head pair) and the same v.
    scores = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(H // Hkv, 2))
    scores_p = torch.einsum("bthd,bshd->bhts", qp, kp.repeat_interleave(H // Hkv, 2))
    torch.testing.assert_close(scores_p, scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vp, v)


@pytest.mark.gpu
def test_liger_matches_eager_on_gpu():
    pytest.importorskip("liger_kernel")
    cfg = preset("tiny", n_layers=2)
    torch.manual_seed(0)
    eager = build_model(cfg, "eager").cuda()
    liger = build_model(cfg, "liger").cuda()
    liger.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    targets = tokens.roll(-1, 1)
    losses = []
    for model in (eager, liger):
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-4 * losses[0]
    for (n, pe), (_, pl) in zip(eager.named_parameters(), liger.named_parameters()):
        assert ((pe.grad - pl.grad).norm() / pe.grad.norm()).item() < 1e-3, n


def test_liger_without_gpu_is_a_config_error():
    from coda_train.model import ConfigError
    from coda_train.model.liger import require_liger

    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        require_liger(torch.device("cpu"))
