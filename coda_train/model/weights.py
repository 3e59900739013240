"""The parameter layout shared by the eager and the CODA model, so one state_dict loads into either."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from ..kernels.declare import stat_dtype
from .config import LlamaConfig


class LayerWeights(nn.Module):
    """One block's parameters. w_qkv rows are [q heads | k heads | v heads]; w_gate_up rows are
    [gate | up]; linear weights are (out_features, in_features) as in nn.Linear."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.w_qkv = nn.Parameter(torch.empty(cfg.qkv_dim, d))
        self.w_o = nn.Parameter(torch.empty(d, cfg.n_heads * hd))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Parameter(torch.empty(2 * cfg.ffn_dim, d))
        self.w_down = nn.Parameter(torch.empty(d, cfg.ffn_dim))

    def forward(self, block: Callable[..., Any], *inputs: Any) -> Any:
        """block(self, *inputs): a model runs each block through its weights module, so that under
        FSDP2 (trainer/distributed.py shard_model) the unit's hooks gather the weights around the
        block's forward and fire around its backward (on the tensors passed in and returned)."""
        return block(self, *inputs)


def rope_rows_to_halves(w: Tensor, n_heads: int) -> Tensor:
    """Rows of each head in [even | odd] order: our interleaved RoPE layout (pairs 2i, 2i+1) -> the halves layout
    (i, i + head_dim/2) of transformers and Liger."""
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def rope_rows_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of rope_rows_to_halves."""
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).flatten(0, 2)


def gathered(module: nn.Module) -> nn.Module:
    """module with its own parameters readable outside its forward: an FSDP2 unit waits for its
    all-gather (issued ahead by its forward prefetch); any other module is returned as it is."""
    if isinstance(module, FSDPModule):
        module.unshard()
    return module


class LlamaWeights(nn.Module):
    """Parameters of a Llama plus the RoPE tables; the models subclass it and add forward().
    Weights are fp32 masters; each forward computes with copies in `compute_dtype`."""

    def __init__(self, cfg: LlamaConfig, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(LayerWeights(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.lm_head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self._compute_dtype = compute_dtype
        self._rope_cache: dict[tuple, Tensor] = {}  # (rows, seq_len, device, dtype) -> table
        # id(parameter) -> (the parameter, (version, data_ptr) it was copied at, its compute-dtype copy)
        self._copies: dict[int, tuple[Tensor, tuple[int, int], Tensor]] = {}
        # whether every update of the weights bumps their version counters or writes the copies (the trainer's
        # AdamW sets it); until then any optimizer may update in place unseen (torch's fused ones, p.data.add_),
        # so every forward rewrites the copies: the casts eager pays, never stale weights
        self.weight_updates_tracked = False
        self.reset_parameters()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the weights' compute copies and the activations (fixed at construction)."""
        return self._compute_dtype

    @property
    def lm_weight(self) -> Tensor:
        return self.tok_emb if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, the residual-writing projections (w_o, w_down) scaled by
        1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth; norms = 1."""
        std = self.cfg.init_std
        nn.init.normal_(self.tok_emb, std=std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head, std=std)
        for layer in self.layers:
            nn.init.normal_(layer.w_qkv, std=std)
            nn.init.normal_(layer.w_gate_up, std=std)
            nn.init.normal_(layer.w_o, std=std / math.sqrt(2 * self.cfg.n_layers))
            nn.init.normal_(layer.w_down, std=std / math.sqrt(2 * self.cfg.n_layers))
            layer.attn_norm.fill_(1.0)
            layer.mlp_norm.fill_(1.0)
        self.norm.fill_(1.0)

    @torch.no_grad()
    def refresh_compute_copies(self, force: bool = False) -> None:
        """Bring the compute-dtype copies of the parameters up to date: one fused multi-tensor copy
        of those changed since the last call, so the weights are cast once per optimizer step, not
        in every forward and backward. A change is seen through the parameter's version counter (an
        in-place op, a load). Fused optimizers update in place without bumping it: the trainer's
        fused AdamW writes the copies itself (compute_copies, trainer/optim.py), and after any other
        such update force=True rewrites every copy; so does every call while weight_updates_tracked is
        False (a model outside the trainer, under any optimizer). Copies exist only for the parameters the model
        has read through compute_copy: one read in its own dtype (the CODA embedding table, gathered
        row by row) or a model that reads none (the eager one) costs no memory. FSDP2's sharded
        parameters are gathered in the compute dtype and need none."""
        stale, sources = [], []
        for key, (p, seen, copy) in list(self._copies.items()):
            if copy.shape != p.shape or copy.device != p.device:  # moved or resized: a new copy at the next read
                del self._copies[key]
                continue
            now = (p._version, p.data_ptr())
            if force or not self.weight_updates_tracked or now != seen:
                stale.append(copy)
                sources.append(p.detach())
                self._copies[key] = (p, now, copy)
        if stale:
            torch._foreach_copy_(stale, sources)

    def compute_copies(self) -> dict[int, Tensor]:
        """id(parameter) -> its compute copy, every copy current: for an optimizer that writes the
        copies as it updates the parameters in place (trainer/optim.py AdamW, fused). That update
        bumps no version counter, so the next forward finds the copies current."""
        self.refresh_compute_copies()
        return {key: copy for key, (_, _, copy) in self._copies.items()}

    def compute_copy(self, p: Tensor) -> Tensor:
        """Parameter p in the compute dtype, after refresh_compute_copies (which drops copies of moved or
        resized parameters): p's data, or its copy (made at the first read). Never differentiable: a Function returns no gradient for it,
        and were it p itself, p's gradient would wait for that Function's backward, after the
        reduce-scatter of p's FSDP2 unit (the entry and block l-1 read block l's attn_norm)."""
        if p.dtype == self.compute_dtype:
            return p.detach()
        held = self._copies.get(id(p))
        if held is None or held[0] is not p:
            with torch.no_grad(), torch.inference_mode(False):  # made under inference_mode, a cache would refuse training
                held = (p, (p._version, p.data_ptr()), p.detach().to(self.compute_dtype, copy=True))
            self._copies[id(p)] = held
        return held[2]

    def rope_tables(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (seq_len, head_dim/2) in the epilogue precision (fp32; fp64 for fp64
        compute): pair i of a head at position t rotates by t * theta^(-2i/hd)."""
        table = self.rope_rows(seq_len, seq_len, device)
        return table[:, 0::2], table[:, 1::2]

    def rope_rows(self, rows: int, seq_len: int, device: torch.device) -> Tensor:
        """The RoPE table of the CODA ops for `rows` token rows of sequences of seq_len (row m at
        position m % seq_len): (rows, head_dim) with (cos, sin) of pair i at columns (2i, 2i+1)."""
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             "raise model.max_seq_len or shorten the sequences")
        dtype = stat_dtype(self.compute_dtype)  # the ops' RoPE table dtype (declare.Example.rope)
        key = (rows, seq_len, torch.device(device), dtype)
        if key not in self._rope_cache:  # the same few tables every step: build each once
            with torch.inference_mode(False):  # a normal tensor even under inference_mode: training reuses it
                self._rope_cache[key] = self._rope_table(rows, seq_len, device, dtype)
        return self._rope_cache[key]

    def _rope_table(self, rows: int, seq_len: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        hd = self.cfg.head_dim
        inv_freq = self.cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
        table = torch.stack((angles.cos(), angles.sin()), dim=-1).reshape(seq_len, hd).to(dtype)
        return table.repeat(rows // seq_len, 1)

    def _check_batch(self, tokens: Tensor, targets: Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape != targets.shape or tokens.numel() == 0:
            raise ValueError(f"tokens and targets must both be (batch, seq_len), not empty; got {tuple(tokens.shape)} "
                             f"and {tuple(targets.shape)}")
        # uint8 or bool ids would index as a mask, not as rows; cross-entropy takes int64 targets only
        if tokens.dtype != torch.int64 or targets.dtype != torch.int64:
            raise ValueError(f"tokens and targets must be int64 ids; got {tokens.dtype} and {targets.dtype}: "
                             "convert them with .long()")
