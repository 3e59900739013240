"""The eager PyTorch Llama: the baseline users compare against, written as a good PyTorch user
would (fused QKV and gate/up projections, F.rms_norm, SDPA with GQA), differentiated by autograd. logits() with a KV cache is also the inference path (sampling)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.declare import stat_dtype
from .config import LlamaConfig
from .weights import LayerWeights, LlamaWeights


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x (B, T, H, hd) by the angles of their position, in
    the precision of the tables (fp32, or fp64)."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)


class KVCache:
    """Keys and values (after RoPE) of the positions seen so far, per layer, in preallocated
    (batch, n_kv_heads, max_len, head_dim) buffers; `length` positions are filled."""

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hkv, T, hd) of the new positions; the keys and values of all positions so far."""
        end = self.length + k.shape[2]
        if end > self.keys[layer].shape[2]:
            raise ValueError(f"KV cache holds {self.keys[layer].shape[2]} positions; {end} requested")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class EagerLlama(LlamaWeights):
    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of targets given tokens, both (B, T)."""
        self._check_batch(tokens, targets)
        logits = self.logits(tokens)
        # the loss statistics in stat_dtype, as the CODA model's fused cross-entropy keeps them
        return F.cross_entropy(logits.to(stat_dtype(self.compute_dtype)).flatten(0, 1), targets.reshape(-1))

    def logits(self, tokens: Tensor, cache: Optional[KVCache] = None) -> Tensor:
        """Logits (B, T, vocab) in the compute dtype. With a cache, tokens continue the cached
        positions, whose keys/values are reused, and their own are appended to it."""
        cfg, dt = self.cfg, self.compute_dtype
        T = tokens.shape[1]
        start = 0 if cache is None else cache.length
        if start == 0:
            cos, sin = self.rope_tables(T, tokens.device)
        elif start + T > cfg.max_seq_len:
            raise ValueError(f"positions up to {start + T} exceed model.max_seq_len={cfg.max_seq_len}")
        else:  # positions start..start+T-1: rows of the one full-length table (same values as a short one)
            cos, sin = (table[start:start + T] for table in self.rope_tables(cfg.max_seq_len, tokens.device))
        # causal over all positions: new token i sees cached ones and new ones up to itself
        mask = None if start == 0 or T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)

        x = F.embedding(tokens, self.tok_emb).to(dt)  # the rows, then their cast: not a cast of the whole table
        for i, layer in enumerate(self.layers):  # under FSDP2 the call gathers the block's weights around it
            x = layer(self._block, x, i, cos, sin, mask, cache)
        if cache is not None:
            cache.length += T

        h = F.rms_norm(x, (cfg.dim,), self.norm.to(dt), cfg.norm_eps)
        return F.linear(h, self.lm_weight.to(dt))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
        """Attention of (B, heads, T, hd) q, k, v: SDPA with GQA, the kernel the eager and torch.compile peers
        use (scripts/fa4_peer.py swaps in FlashAttention 4, CODA's, for a peer with that attention)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _block(self, layer: LayerWeights, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
               cache: Optional[KVCache]) -> Tensor:
        """Block i from its weights module's call (LayerWeights.forward): attention, then the MLP."""
        cfg, dt = self.cfg, self.compute_dtype
        B, T, d = x.shape
        H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        start = 0 if cache is None else cache.length
        h = F.rms_norm(x, (d,), layer.attn_norm.to(dt), cfg.norm_eps)
        q, k, v = F.linear(h, layer.w_qkv.to(dt)).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = apply_rope(q.view(B, T, H, hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, Hkv, hd), cos, sin).transpose(1, 2)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.append(i, k, v)
        o = self.attend(q, k, v, mask, causal=start == 0)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * hd), layer.w_o.to(dt))

        h = F.rms_norm(x, (d,), layer.mlp_norm.to(dt), cfg.norm_eps)
        gate, up = F.linear(h, layer.w_gate_up.to(dt)).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.w_down.to(dt))
