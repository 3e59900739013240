"""The CODA Llama: the same model as eager.py, run as a hand-scheduled chain of CODA ops.

Each block is one autograd.Function whose forward is the list F1..F6 and whose backward is the
list B1..B6 of docs/design.md, written by hand from op calls (no autograd inside).

Blocks pass the triple (x, h, r): residual stream, h = x*gamma of the next RMSNorm, and its row
scale r = rstd(x). h and r are caches of functions of x, written by the producing GEMM's
epilogue; the block that consumes them owns that RMSNorm, including its backward (the reverse-
fusion statistic comes out of the consumer's own backward epilogues and is applied in its dgrad
epilogue), so each Function returns the total gradient of x and marks h, r non-differentiable.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor
from torch.autograd import Function

from .. import kernels as K
from .weights import LlamaWeights


class BlockShape(NamedTuple):
    n_heads: int
    n_kv_heads: int
    seq_len: int
    eps: float


class EmbeddingEntry(Function):
    """(E) x = emb[tokens], h = x*gamma, r = rstd(x): the first block's input triple."""

    @staticmethod
    def forward(ctx, tokens: Tensor, emb: Tensor, gamma: Tensor, eps: float):
        x, h, sumsq = K.embedding_rmsnorm_partial(tokens, emb, gamma)
        r = K.rstd_from_partials(sumsq, emb.shape[1], eps)
        ctx.save_for_backward(tokens)
        ctx.vocab_size = emb.shape[0]
        ctx.mark_non_differentiable(h, r)
        ctx.set_materialize_grads(False)
        return x, h, r

    @staticmethod
    def backward(ctx, g_x: Tensor, _g_h: None, _g_r: None):
        if g_x is None:
            return None, None, None, None
        (tokens,) = ctx.saved_tensors
        # gamma's gradient comes from block 0, which owns this RMSNorm.
        return None, K.embedding_backward(tokens, g_x, ctx.vocab_size), None, None


class CodaBlock(Function):
    """One Llama block from (x, h, r) to (x2, h2, r2); h2, r2 use next_norm, the weight of the
    RMSNorm that follows (next block's attention norm, or the final norm), whose gradient the
    consumer returns."""

    @staticmethod
    def forward(ctx, x: Tensor, h: Tensor, r: Tensor, attn_norm: Tensor, w_qkv: Tensor, w_o: Tensor,
                mlp_norm: Tensor, w_gate_up: Tensor, w_down: Tensor, next_norm: Tensor,
                cos: Tensor, sin: Tensor, shape: BlockShape):
        H, Hkv, T, eps = shape
        d, n_rope_cols = x.shape[1], (H + Hkv) * (w_o.shape[1] // H)
        qkv = K.gemm_rowscale_rope(h, r, w_qkv, cos, sin, n_rope_cols)           # F1
        o, lse = K.attention(qkv, H, Hkv, T)                                       # F2
        x1, h_m, sumsq_m = K.gemm_residual_rmsnorm_partial(o, w_o, x, mlp_norm)    # F3
        r_m = K.rstd_from_partials(sumsq_m, d, eps)                                # F4
        gu, a = K.gemm_rowscale_swiglu(h_m, r_m, w_gate_up)                        # F5
        x2, h2, sumsq2 = K.gemm_residual_rmsnorm_partial(a, w_down, x1, next_norm) # F6
        r2 = K.rstd_from_partials(sumsq2, d, eps)

        # Saved: block inputs, qkv/o/lse for attention, x1/h_m/r_m/gu for the MLP. No normalized
        # activation, and not a: the dSwiGLU epilogue recomputes it (B1).
        ctx.save_for_backward(x, h, r, qkv, o, lse, x1, h_m, r_m, gu,
                              attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, cos, sin)
        ctx.shape = shape
        ctx.mark_non_differentiable(h2, r2)
        ctx.set_materialize_grads(False)
        return x2, h2, r2

    @staticmethod
    def backward(ctx, g_x2: Tensor, _g_h2: None, _g_r2: None):
        if g_x2 is None:  # x2 unused downstream: nothing flows back
            return (None,) * 13
        (x, h, r, qkv, o, lse, x1, h_m, r_m, gu,
         attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, cos, sin) = ctx.saved_tensors
        H, Hkv, T, _ = ctx.shape
        d, n_rope_cols = x.shape[1], (H + Hkv) * (w_o.shape[1] // H)

        g_gu, a, stat_m = K.gemm_dswiglu_rowscale_stat(g_x2, w_down, gu, r_m)                 # B1
        g_w_down = K.matmul_tn(g_x2, a)
        c_m = K.rmsnorm_backward_coeff(stat_m, r_m, d)                                         # B2
        g_x1, g_mlp_norm = K.gemm_rmsnorm_backward(g_gu, w_gate_up, g_x2, x1, mlp_norm, c_m)   # B3
        g_w_gate_up = K.matmul_tn(g_gu, h_m)

        g_o = K.matmul(g_x1, w_o)                                                              # B4
        g_w_o = K.matmul_tn(g_x1, o)
        g_qkv = K.attention_backward(g_o, qkv, o, lse, H, Hkv, T)                              # B5
        g_y, stat_a = K.rope_backward_rowscale_stat(g_qkv, qkv, r, cos, sin, n_rope_cols)      # B6a
        c_a = K.rmsnorm_backward_coeff(stat_a, r, d)
        g_x, g_attn_norm = K.gemm_rmsnorm_backward(g_y, w_qkv, g_x1, x, attn_norm, c_a)        # B6b
        g_w_qkv = K.matmul_tn(g_y, h)
        return (g_x, None, None, g_attn_norm, g_w_qkv, g_w_o, g_mlp_norm, g_w_gate_up, g_w_down,
                None, None, None, None)


class LMHeadLoss(Function):
    """(H) mean cross-entropy of logits = r * (h @ w_lm^T); owns the final RMSNorm."""

    @staticmethod
    def forward(ctx, x: Tensor, h: Tensor, r: Tensor, norm: Tensor, w_lm: Tensor, targets: Tensor):
        lse, target_logit = K.gemm_rowscale_cross_entropy(h, r, w_lm, targets)
        ctx.save_for_backward(x, h, r, norm, w_lm, targets, lse)
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, g_loss: Tensor):
        x, h, r, norm, w_lm, targets, lse = ctx.saved_tensors
        g_logits, stat = K.gemm_cross_entropy_backward(h, r, w_lm, targets, lse, g_loss / x.shape[0])  # H'
        c = K.rmsnorm_backward_coeff(stat, r, x.shape[1])
        g_x, g_norm = K.gemm_rmsnorm_backward(g_logits, w_lm, None, x, norm, c)                        # H''
        return g_x, None, None, g_norm, K.matmul_tn(g_logits, h), None


class CodaLlama(LlamaWeights):
    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of targets given tokens, both (B, T)."""
        self._check_batch(tokens, targets)
        cfg, dt = self.cfg, self.compute_dtype
        T = tokens.shape[1]
        cos, sin = self.rope_tables(T, tokens.device)
        shape = BlockShape(cfg.n_heads, cfg.n_kv_heads, T, cfg.norm_eps)
        # Norm weights in order: block l's attention norm is produced by block l-1 (or the entry).
        gammas = [layer.attn_norm.to(dt) for layer in self.layers] + [self.norm.to(dt)]
        emb = self.tok_emb.to(dt)
        w_lm = emb if self.lm_head is None else self.lm_head.to(dt)

        x, h, r = EmbeddingEntry.apply(tokens, emb, gammas[0], cfg.norm_eps)
        for layer, attn_norm, next_norm in zip(self.layers, gammas, gammas[1:]):
            x, h, r = CodaBlock.apply(x, h, r, attn_norm, layer.w_qkv.to(dt), layer.w_o.to(dt),
                                      layer.mlp_norm.to(dt), layer.w_gate_up.to(dt), layer.w_down.to(dt),
                                      next_norm, cos, sin, shape)
        return LMHeadLoss.apply(x, h, r, gammas[-1], w_lm, targets.reshape(-1))
