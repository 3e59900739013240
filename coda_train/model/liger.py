"""The eager Llama with Liger kernels (Triton, CUDA only): the baseline of users who already fuse.

Same function and parameter layout as eager.py. Liger's RoPE rotates the halves (i, i+hd/2) of a
head while ours rotates interleaved pairs (2i, 2i+1); gathering the q and k weight rows of every
head into [even | odd] order turns one into the other, and q.k is unchanged by permuting both
alike, so attention, and the whole model, compute the same function.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from .eager import EagerLlama
from .weights import rope_rows_to_halves


def require_liger(device: torch.device) -> None:
    """Fail before any work where the Liger baseline cannot run."""
    from .config import ConfigError

    if device.type != "cuda":
        raise ConfigError("model.impl=liger runs Liger's Triton kernels and needs a CUDA GPU; "
                          "use model.impl=eager on this machine")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.impl=liger needs liger-kernel: pip install -e '.[baselines]'")


class LigerLlama(EagerLlama):
    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        self._check_batch(tokens, targets)
        require_liger(tokens.device)
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.functional import (liger_fused_linear_cross_entropy, liger_rms_norm,
                                                          liger_rope)

        cfg, dt = self.cfg, self.compute_dtype
        B, T = tokens.shape
        H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.rope_tables(T, tokens.device)
        cos, sin = cos.repeat(1, 2)[None], sin.repeat(1, 2)[None]  # (1, T, hd): Liger's half layout
        rows = self._interleaved_to_halves_rows(tokens.device)

        x = F.embedding(tokens, self.tok_emb).to(dt)  # the rows, then their cast: not a cast of the whole table
        for layer in self.layers:
            h = liger_rms_norm(x, layer.attn_norm.to(dt), cfg.norm_eps, in_place=False)
            q, k, v = F.linear(h, layer.w_qkv.to(dt)[rows]).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)  # bf16 gather
            q, k = liger_rope(q.view(B, T, H, hd).transpose(1, 2), k.view(B, T, Hkv, hd).transpose(1, 2), cos, sin)
            o = F.scaled_dot_product_attention(q, k, v.view(B, T, Hkv, hd).transpose(1, 2), is_causal=True,
                                               enable_gqa=H != Hkv)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * hd), layer.w_o.to(dt))
            h = liger_rms_norm(x, layer.mlp_norm.to(dt), cfg.norm_eps, in_place=False)
            gate, up = F.linear(h, layer.w_gate_up.to(dt)).chunk(2, dim=-1)
            a = LigerSiLUMulFunction.apply(gate, up)
            x = x + F.linear(a, layer.w_down.to(dt))
        h = liger_rms_norm(x, self.norm.to(dt), cfg.norm_eps, in_place=False)
        return liger_fused_linear_cross_entropy(h.view(B * T, -1), self.lm_weight.to(dt), targets.reshape(-1))

    def _interleaved_to_halves_rows(self, device: torch.device) -> Tensor:
        """Row order of w_qkv: in each q and k head, even columns then odd ones; v rows unchanged. Built on
        the device: a host-built index copied there would sync the stream every forward."""
        n_rope_heads = self.cfg.n_heads + self.cfg.n_kv_heads
        rows = torch.arange(self.cfg.qkv_dim, device=device)
        n_rope_rows = n_rope_heads * self.cfg.head_dim
        return torch.cat((rope_rows_to_halves(rows[:n_rope_rows], n_rope_heads), rows[n_rope_rows:]))
