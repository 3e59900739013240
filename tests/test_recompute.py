"""trainer.recompute=block: a CODA block keeps only its input triple (x, h, r) and weights, and its
hand-written backward recomputes F1..F5; the gradients are those of the stored-activation backward."""

from __future__ import annotations

import pytest
import torch

from coda_train.errors import ConfigError
from coda_train.model import build_model, preset


def loss_grads_and_saved_bytes(recompute: str):
    cfg = preset("tiny", dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=37, max_seq_len=16, n_layers=3)
    torch.manual_seed(0)
    model = build_model(cfg, "coda", compute_dtype=torch.float64, recompute=recompute).double()
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


def test_block_recompute_gives_the_same_gradients_float64():
    loss, grads, saved = loss_grads_and_saved_bytes("none")
    loss_r, grads_r, saved_r = loss_grads_and_saved_bytes("block")
    assert torch.equal(loss, loss_r)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=0, atol=1e-10, msg=name)
    # each block's qkv, o, lse, x1, h_m, r_m, gate, a are no longer kept for backward
    assert saved_r < 0.6 * saved, (saved_r, saved)


def test_unknown_recompute_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.recompute='layer'"):
        build_model(preset("tiny", n_layers=1), "coda", recompute="layer")


def test_trainer_recompute_block_trains_the_same_run(tiny, tmp_path):
    from test_trainer import metrics, train_in_process, without_timing

    steps = ["trainer.max_steps=3", "trainer.ckpt_every=0", "model.impl=coda"]
    train_in_process(tmp_path / "none", *tiny, *steps)
    train_in_process(tmp_path / "block", *tiny, *steps, "trainer.recompute=block")
    assert without_timing(metrics(tmp_path / "block")) == without_timing(metrics(tmp_path / "none"))
    with pytest.raises(ConfigError, match="use model.impl=coda or trainer.recompute=none"):
        train_in_process(tmp_path / "eager", *tiny, "model.impl=eager", "trainer.recompute=block")
