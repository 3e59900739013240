"""The eager PyTorch Llama: the baseline users compare against, written as a good PyTorch user
would (fused QKV and gate/up projections, F.rms_norm, SDPA with GQA), differentiated by autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .weights import LlamaWeights


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x (B, T, H, hd) by the angles of their position, in
    the precision of the tables (fp32, or fp64)."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)


class EagerLlama(LlamaWeights):
    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of targets given tokens, both (B, T)."""
        self._check_batch(tokens, targets)
        cfg, dt = self.cfg, self.compute_dtype
        B, T = tokens.shape
        H, Hkv, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        cos, sin = self.rope_tables(T, tokens.device)

        x = F.embedding(tokens, self.tok_emb.to(dt))
        for layer in self.layers:
            h = F.rms_norm(x, (d,), layer.attn_norm.to(dt), cfg.norm_eps)
            q, k, v = F.linear(h, layer.w_qkv.to(dt)).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
            q = apply_rope(q.view(B, T, H, hd), cos, sin)
            k = apply_rope(k.view(B, T, Hkv, hd), cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, Hkv, hd).transpose(1, 2),
                                               is_causal=True, enable_gqa=H != Hkv)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * hd), layer.w_o.to(dt))

            h = F.rms_norm(x, (d,), layer.mlp_norm.to(dt), cfg.norm_eps)
            gate, up = F.linear(h, layer.w_gate_up.to(dt)).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down.to(dt))

        h = F.rms_norm(x, (d,), self.norm.to(dt), cfg.norm_eps)
        logits = F.linear(h, self.lm_weight.to(dt))
        return F.cross_entropy(logits.to(cos.dtype).view(B * T, -1), targets.reshape(-1))
