"""Model-level accuracy checks of a kernel backend, shared by scripts/check_kernels.py and the GPU
tests: the ops at every preset's dims, and whole models against the eager model in float64."""

from __future__ import annotations

import torch

from ..kernels.testing import passes, relative_error
from .config import PRESETS, preset
from . import build_model, coda

# preset -> (rows M, seq_len T) of the per-op checks: M is not a multiple of the 128-row tile; M % T == 0.
OP_CHECK_SHAPES = {
    "tiny": (1000, 250),
    "llama3_125m": (1000, 500),
    "llama3_1b": (4095, 819),
    "llama3_8b": (1000, 1000),
}

MODEL_CASES = {  # name -> preset, overrides, (batch, seq), LM-head chunk rows (None: the default), loss scale
    "tiny": ("tiny", {}, (4, 256), None, 1.0),
    "llama3_1b_2layer": ("llama3_1b", {"n_layers": 2}, (2, 1024), None, 1.0),
    # the LM head in chunks (768 + 768 + 512 rows: weight gradients accumulated in place) and an incoming
    # loss gradient other than 1 (scale_in_place's pass), as with 3 gradient-accumulation steps
    "llama3_1b_2layer_chunks": ("llama3_1b", {"n_layers": 2}, (2, 1024), 768, 1 / 3),
}


def op_check_dims(preset_name: str):
    """The kernels.Dims of the per-op checks at a preset's widths."""
    rows, seq_len = OP_CHECK_SHAPES[preset_name]
    return PRESETS[preset_name].kernel_dims(rows, seq_len)


def check_model(name: str) -> list[dict]:
    """CODA on cute vs CODA on reference vs eager (on the GPU), all with fp32 master weights and bf16
    compute, against eager in float64 (the oracle), the gradients of loss * the case's loss scale,
    the LM head in the case's chunks. One row per tensor (loss, every gradient);
    ok: finite and err(cute) <= RATIO * err(eager bf16) + ATOL (relative errors)."""
    p, over, (B, T), chunk_rows, loss_scale = MODEL_CASES[name]
    cfg = preset(p, **over)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    oracle = build_model(cfg, "eager", compute_dtype=torch.float64).to(dev).double()
    gen = torch.Generator(device=dev).manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, device=dev)
    targets = tokens.roll(-1, dims=1)

    def loss_and_grads(model) -> dict:
        saved = coda.LOGITS_CHUNK_BYTES
        if chunk_rows is not None:  # chunks of chunk_rows rows of compute-dtype logits
            coda.LOGITS_CHUNK_BYTES = chunk_rows * cfg.vocab_size * 2
        try:
            loss = model(tokens, targets)
            (loss * loss_scale).backward()
        finally:
            coda.LOGITS_CHUNK_BYTES = saved
        torch.cuda.synchronize(dev)
        return {"loss": loss.detach().reshape(1), **{n: q.grad for n, q in model.named_parameters()}}

    def run(impl: str, backend: str) -> dict:
        model = build_model(cfg, impl, backend=backend, compute_dtype=torch.bfloat16).to(dev)
        model.load_state_dict({k: v.float() for k, v in oracle.state_dict().items()})
        return loss_and_grads(model)

    ref64 = loss_and_grads(oracle)
    runs = {"cute": run("coda", "cute"), "reference": run("coda", "reference"), "eager": run("eager", "reference")}
    rows = []
    for n in ref64:
        errs = {k: relative_error(v[n], ref64[n]) for k, v in runs.items()}
        finite = bool(torch.isfinite(runs["cute"][n]).all())
        rows.append(dict(model=name, tensor=n, ok=finite and passes(errs["cute"], errs["eager"]), finite=finite,
                         **{f"err_{k}": e for k, e in errs.items()}))
    return rows
