"""The CODA Llama: the same model as eager.py, run as a hand-scheduled chain of CODA ops.

Each block is one autograd.Function whose forward is the list F1..F6 and whose backward is the
list B1..B6 of docs/design.md, written by hand from op calls (no autograd inside).

Blocks pass the triple (x, h, r): residual stream, h = x*gamma of the next RMSNorm, and its row
scale r = rstd(x). h and r are caches of functions of x, written by the producing GEMM's
epilogue; the block that consumes them owns that RMSNorm, including its backward (the reverse-
fusion statistic comes out of the consumer's own backward epilogues and is applied in its dgrad
epilogue), so each Function returns the total gradient of x and marks h, r non-differentiable.

The model holds the op set of its kernel backend (`self.ops`) and hands it to the Functions, so
models on different backends coexist in one process.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd import Function

from ..errors import ConfigError
from ..kernels import Dims, OpSet, op_set
from ..kernels.declare import stat_dtype
from .config import LlamaConfig
from .weights import LayerWeights, LlamaWeights, gathered


class BlockShape(NamedTuple):
    n_heads: int
    n_kv_heads: int
    seq_len: int
    eps: float


class EmbeddingEntry(Function):
    """(E) x = emb[tokens], h = x*gamma, r = rstd(x): the first block's input triple. With tied
    embeddings also the table itself, as the LM head's weight: its gradient then flows back through
    this Function, whose backward scatters the entry's row gradients into it (E'), so the table gets
    one gradient, not two table-sized ones summed by autograd."""

    @staticmethod
    def forward(ctx, tokens: Tensor, emb: Tensor, gamma_c: Tensor, dtype: torch.dtype, eps: float, ops: OpSet,
                tied: bool):
        # emb: the parameter, whose rows the op gathers and rounds to the compute dtype (no copy of the
        # whole table); gamma_c: a compute copy (CodaLlama._blocks)
        x, h, sumsq = ops.embedding_rmsnorm_partial(tokens, emb.detach(), gamma_c, dtype)
        r = ops.rstd_from_partials(sumsq, emb.shape[1], eps)
        ctx.save_for_backward(tokens)
        ctx.table_shape, ctx.ops = emb.shape, ops
        ctx.mark_non_differentiable(h, r)
        ctx.set_materialize_grads(False)
        return x, h, r, (emb.view_as(emb) if tied else None)

    @staticmethod
    def backward(ctx, g_x: Tensor, _g_h: None, _g_r: None, g_table: Optional[Tensor]):
        (tokens,) = ctx.saved_tensors
        if g_x is not None:
            if g_table is None:
                g_table = g_x.new_zeros(ctx.table_shape, dtype=stat_dtype(g_x.dtype))  # fp32 (fp64 stays fp64)
            # in place into the LM head's gradient: LMHeadLoss.backward made it for this call alone
            ctx.ops.embedding_backward(g_table, tokens, g_x)
        # gamma's gradient comes from block 0, which owns this RMSNorm.
        return None, g_table, None, None, None, None, None


class BlockWeights(NamedTuple):
    """One block's weights as the kernels read them (compute copies), next_norm included."""
    attn_norm: Tensor
    w_qkv: Tensor
    w_o: Tensor
    mlp_norm: Tensor
    w_gate_up: Tensor
    w_down: Tensor
    next_norm: Tensor


class CodaBlock(Function):
    """One Llama block from (x, h, r) to (x2, h2, r2); h2, r2 use next_norm, the weight of the
    RMSNorm that follows (next block's attention norm, or the final norm), whose gradient the
    consumer returns. The six parameters are inputs only to receive their gradients (fp32 for fp32
    masters: no cast); the kernels read their compute copies in `weights`."""

    @staticmethod
    def forward(ctx, x: Tensor, h: Tensor, r: Tensor, attn_norm: Tensor, w_qkv: Tensor, w_o: Tensor,
                mlp_norm: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: BlockWeights,
                rope: Tensor, shape: BlockShape, ops: OpSet, recompute: bool = False):
        attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, next_norm = weights
        d = x.shape[1]
        qkv, o, lse, x1, h_m, r_m, gate, a = CodaBlock._to_swiglu(x, h, r, w_qkv, w_o, mlp_norm, w_gate_up, rope, shape, ops)
        x2, h2, sumsq2 = ops.gemm_residual_rmsnorm_partial(a, w_down, x1, next_norm)  # F6
        r2 = ops.rstd_from_partials(sumsq2, d, shape.eps)

        # Saved: block inputs, qkv/o/lse for attention, x1/h_m/r_m/gate/a for the MLP. No normalized
        # activation, and not up: B1 needs only up * sigmoid(gate) = a / gate. With recompute only the
        # inputs and weights: backward runs F1..F5 again.
        activations = () if recompute else (qkv, o, lse, x1, h_m, r_m, gate, a)
        ctx.save_for_backward(x, h, r, attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, rope, *activations)
        ctx.shape, ctx.ops = shape, ops
        ctx.mark_non_differentiable(h2, r2)
        ctx.set_materialize_grads(False)
        return x2, h2, r2

    @staticmethod
    def _to_swiglu(x, h, r, w_qkv, w_o, mlp_norm, w_gate_up, rope, shape: BlockShape, ops: OpSet):
        """F1..F5: qkv, o, lse, x1, h_m, r_m, the gate and the SwiGLU output a."""
        H, Hkv, T, eps = shape
        d, n_rope_cols = x.shape[1], (H + Hkv) * (w_o.shape[1] // H)
        qkv = ops.gemm_rowscale_rope(h, r, w_qkv, rope, n_rope_cols)                 # F1
        o, lse = ops.attention(qkv, H, Hkv, T)                                       # F2
        x1, h_m, sumsq_m = ops.gemm_residual_rmsnorm_partial(o, w_o, x, mlp_norm)    # F3
        r_m = ops.rstd_from_partials(sumsq_m, d, eps)                                # F4
        gate, a = ops.gemm_rowscale_swiglu(h_m, r_m, w_gate_up)                      # F5
        return qkv, o, lse, x1, h_m, r_m, gate, a

    @staticmethod
    def backward(ctx, g_x2: Tensor, _g_h2: None, _g_r2: None):
        if g_x2 is None:  # x2 unused downstream: nothing flows back
            return (None,) * 14
        x, h, r, attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down, rope, *activations = ctx.saved_tensors
        if activations:
            qkv, o, lse, x1, h_m, r_m, gate, a = activations
        else:  # recompute: the forward's F1..F5 again, from the saved inputs and weights
            qkv, o, lse, x1, h_m, r_m, gate, a = CodaBlock._to_swiglu(x, h, r, w_qkv, w_o, mlp_norm, w_gate_up, rope,
                                                                     ctx.shape, ctx.ops)
        H, Hkv, T, _ = ctx.shape
        d, ops = x.shape[1], ctx.ops

        g_gu, stat_m = ops.gemm_dswiglu_rowscale_stat(g_x2, w_down, gate, a, r_m)               # B1
        g_w_down = ops.matmul_tn(g_x2, a)
        c_m = ops.rmsnorm_backward_coeff(stat_m, r_m, d)                                         # B2
        g_x1, g_mlp_norm = ops.gemm_rmsnorm_backward(g_gu, w_gate_up, g_x2, x1, mlp_norm, c_m)   # B3
        g_w_gate_up = ops.matmul_tn(g_gu, h_m)

        g_o = ops.matmul(g_x1, w_o)                                                              # B4
        g_w_o = ops.matmul_tn(g_x1, o)
        g_y, stat_a = ops.attention_rope_backward_rowscale_stat(g_o, qkv, o, lse, r, rope, H, Hkv, T)  # B5, B6a
        c_a = ops.rmsnorm_backward_coeff(stat_a, r, d)
        g_x, g_attn_norm = ops.gemm_rmsnorm_backward(g_y, w_qkv, g_x1, x, attn_norm, c_a)        # B6b
        g_w_qkv = ops.matmul_tn(g_y, h)
        return (g_x, None, None, g_attn_norm, g_w_qkv, g_w_o, g_mlp_norm, g_w_gate_up, g_w_down,
                None, None, None, None, None)


# One (rows, vocab) chunk of logit exponentials (H) at most this many bytes: 4096
# rows at llama3_1b in bf16 (V = 128256), so no (tokens x vocab) buffer larger than a chunk exists.
LOGITS_CHUNK_BYTES = 1 << 30


def logits_chunk_rows(vocab_size: int, itemsize: int) -> int:
    """Token rows per LM-head chunk: the most whose logits fit LOGITS_CHUNK_BYTES, rounded down to
    a multiple of the 128-row GEMM tile where there are that many (at least one row)."""
    rows = max(1, LOGITS_CHUNK_BYTES // (vocab_size * itemsize))
    return rows - rows % 128 if rows >= 128 else rows


def step_gemm_shapes(d: Dims) -> list[tuple[str, tuple[int, int, int]]]:
    """(op, (m, n, k)) of every GEMM launch of one training step at kernel sizes d, in model order:
    the shapes the tile config table is keyed by (kernels/tile_configs.py; scripts/tune_gemm.py tunes
    them). The LM head runs chunk by chunk of C rows (the last one ragged when C does not divide M), all
    three of its GEMMs in the forward; the first chunk's weight gradient is matmul_tn_exp, the others add."""
    M, D, F, V = d.rows, d.dim, d.ffn_dim, d.vocab_size
    C = min(M, logits_chunk_rows(V, 2))  # bf16 logits
    attn, qkv = d.n_heads * d.head_dim, d.qkv_dim
    later_chunks = [C] * (M // C > 1) + [M % C] * (M % C > 0)  # row counts of the chunks after the first
    lm_head = [shape for rows in dict.fromkeys([C] + later_chunks)
               for shape in (("gemm_rowscale_exp_cross_entropy", (rows, V, D)), ("gemm_exp_rmsnorm_backward", (rows, D, V)))]
    lm_head += [("matmul_tn_exp_add", (V, D, rows)) for rows in dict.fromkeys(later_chunks)]
    return [
        ("gemm_rowscale_rope", (M, qkv, D)),                                                        # F1
        ("gemm_residual_rmsnorm_partial", (M, D, attn)),                                            # F3
        ("gemm_rowscale_swiglu", (M, 2 * F, D)),                                                    # F5
        ("gemm_residual_rmsnorm_partial", (M, D, F)),                                               # F6
        *lm_head,                                                                                   # H, H'', chunk by chunk
        ("gemm_dswiglu_rowscale_stat", (M, F, D)),                                                  # B1
        ("gemm_rmsnorm_backward", (M, D, 2 * F)),                                                   # B3
        ("matmul", (M, attn, D)),                                                                   # B4
        ("gemm_rmsnorm_backward", (M, D, qkv)),                                                     # B6b
        # weight gradients: down, gate_up, o, qkv (the LM head's first chunk: with H, H'' above)
        ("matmul_tn", (D, F, M)), ("matmul_tn", (2 * F, D, M)), ("matmul_tn", (D, attn, M)), ("matmul_tn", (qkv, D, M)),
        ("matmul_tn_exp", (V, D, C)),
    ]


def lm_head_loss(x: Tensor, h: Tensor, r: Tensor, norm: Tensor, w_lm: Tensor, norm_c: Tensor, w_lm_c: Tensor,
                 targets: Tensor, ops: OpSet) -> Tensor:
    """(H) mean cross-entropy of logits = r * (h @ w_lm^T) (norm, w_lm: the parameters; *_c: their
    compute copies). With gradients wanted, LMHeadLoss (the gradient computed chunk by chunk during
    the forward); otherwise (evaluation) only each row's logsumexp and target logit, no logits stored."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm, w_lm)):
        return LMHeadLoss.apply(x, h, r, norm, w_lm, norm_c, w_lm_c, targets, ops)
    lse, target_logit = ops.gemm_rowscale_cross_entropy(h, r, w_lm_c, targets)
    return (lse - target_logit).mean()


class LMHeadLoss(Function):
    """(H, H', H'') mean cross-entropy of logits = r * (h @ w_lm^T); owns the final RMSNorm. The loss
    ends the graph, so its gradient is known during the forward up to the incoming scalar: the
    forward computes it chunk by chunk of rows (three vocab-sized GEMMs, logits never recomputed,
    one chunk alive at a time) and the backward applies that scalar. The logits are stored as their
    exponentials with per-group offsets (H), so the gradient needs no pass over them: H' works on
    per-row numbers and the dgrad/weight-gradient GEMMs apply its factors as they load (H'')."""

    @staticmethod
    def forward(ctx, x: Tensor, h: Tensor, r: Tensor, norm: Tensor, w_lm: Tensor, norm_c: Tensor, w_lm_c: Tensor,
                targets: Tensor, ops: OpSet):
        # norm, w_lm: the parameters (receive the gradients); *_c: their compute copies, which the ops read
        norm, w_lm = norm_c, w_lm_c
        M = x.shape[0]
        step = logits_chunk_rows(w_lm.shape[0], h.element_size())
        grad_scale = r.new_full((), 1.0 / M)  # d mean / d loss_m, for an incoming gradient of 1
        losses, g_xs, g_norm, g_w = [], [], None, None
        for i in range(0, M, step):
            rows = slice(i, i + step)
            loss_c, g_x_c, g_norm_c, grad_c = LMHeadLoss._chunk(x[rows], h[rows], r[rows], norm, w_lm, targets[rows],
                                                                grad_scale, ops)
            if g_w is None:  # every chunk's weight gradient into one fp32 buffer
                g_w = ops.matmul_tn_exp(*grad_c)
            else:
                ops.matmul_tn_exp_add(g_w, *grad_c)  # in place: one vocab x dim gradient buffer
            del grad_c  # before the next chunk's exponentials exist: one chunk alive at a time
            losses.append(loss_c)
            g_xs.append(g_x_c)
            g_norm = g_norm_c if g_norm is None else g_norm + g_norm_c
        ctx.save_for_backward(torch.cat(g_xs), g_norm, g_w)
        ctx.ops = ops
        return torch.cat(losses).mean()

    @staticmethod
    def _chunk(x, h, r, norm, w_lm, targets, grad_scale, ops: OpSet):
        """H, H', H'' (dgrad) on one chunk of rows: its per-row losses, g_x, partial g_norm, and the
        operands (e, strip, hs) of its weight-gradient GEMM."""
        e, k, sum_exp, sum_exp_t, target_logit = ops.gemm_rowscale_exp_cross_entropy(h, r, w_lm, targets)   # H
        loss, strip, v, hs, stat = ops.cross_entropy_exp_backward(e, k, sum_exp, sum_exp_t, target_logit,    # H'
                                                                  targets, r, h, grad_scale)
        c = ops.rmsnorm_backward_coeff(stat, r, x.shape[1])
        g_x, g_norm = ops.gemm_exp_rmsnorm_backward(e, strip, v, w_lm, x, norm, c)                          # H''
        return loss, g_x, g_norm, (e, strip, hs)

    @staticmethod
    def backward(ctx, g_loss: Tensor):
        # g_x, g_norm, g_w for an incoming gradient of 1; g_loss: 0-dim, on the device (never read on the
        # host: no sync). scale_in_place skips its pass on the device when g_loss = 1 (no accumulation).
        g_x, g_norm, g_w = ctx.saved_tensors
        # In place when autograd frees the graph after this call: no second V x d g_w, and with the saved
        # reference released the gradient is adopted as .grad without a copy. On a copy when the graph is
        # retained (a host flag: no sync), so every later call starts from the unscaled originals again.
        if torch._C._autograd._get_current_graph_task_keep_graph():
            g_x, g_norm, g_w = (t.clone() for t in (g_x, g_norm, g_w))
        for t in (g_x, g_norm, g_w):
            ctx.ops.scale_in_place(t, g_loss)
        return g_x, None, None, g_norm, g_w, None, None, None, None


RECOMPUTE = ("none", "block")  # block: each block's backward recomputes its forward from (x, h, r)


class CodaLlama(LlamaWeights):
    def __init__(self, cfg: LlamaConfig, compute_dtype: torch.dtype = torch.float32, backend: str = "reference",
                 recompute: str = "none"):
        super().__init__(cfg, compute_dtype)
        if recompute not in RECOMPUTE:
            raise ConfigError(f"unknown trainer.recompute={recompute!r}; choose one of {list(RECOMPUTE)}")
        self.ops = op_set(backend)  # this model's CODA ops ('auto' resolved here)
        self.recompute = recompute == "block"  # activations of a block: its input triple only

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of targets given tokens, both (B, T)."""
        self._check_batch(tokens, targets)
        x, h, r, w_lm = self._blocks(tokens)
        return lm_head_loss(x, h, r, self.norm, w_lm, self.compute_copy(self.norm), self._lm_weight_c(),
                            targets.reshape(-1), self.ops)

    @torch.no_grad()
    def logits(self, tokens: Tensor) -> Tensor:
        """Next-token logits (B, T, vocab_size) in the compute dtype: r_f * (h_f W_lm^T) (L)."""
        x, h, r, _ = self._blocks(tokens)
        return self.ops.gemm_rowscale(h, r, self._lm_weight_c()).view(*tokens.shape, -1)

    def _lm_weight_c(self) -> Tensor:
        """The LM-head weight in the compute dtype, cast at this read and not kept as a compute copy: a
        step reads it only in the forward (H, H', H'' all run there), so a kept copy would only add its
        size to the peak at the end of the backward. Same cast count as a kept copy (one per step)."""
        return self.lm_weight.detach().to(self.compute_dtype)

    def _blocks(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The entry and every block: the last triple (x, h, r), and the LM-head weight as the loss
        takes it (with tied embeddings the entry's output, so its gradient reaches the table through
        the entry: EmbeddingEntry; otherwise the lm_head parameter). The Functions receive each
        parameter (for its gradient) and its compute copy (for the kernels). Each block runs inside
        its weights module's call, which under FSDP2 gathers that unit around the block's forward
        and backward (docs/design.md)."""
        cfg, layers = self.cfg, self.layers
        T = tokens.shape[1]
        rope = self.rope_rows(tokens.numel(), T, tokens.device)
        shape = BlockShape(cfg.n_heads, cfg.n_kv_heads, T, cfg.norm_eps)
        self.refresh_compute_copies()
        cp = self.compute_copy
        # The entry and F6 of block i write h for the RMSNorm after them, so that norm's weight (block
        # i+1's attn_norm, or the final norm) is gathered before they run; they read its compute copy only.
        tied = self.lm_head is None
        x, h, r, table = EmbeddingEntry.apply(tokens, self.tok_emb, cp(gathered(layers[0]).attn_norm),
                                              self.compute_dtype, cfg.norm_eps, self.ops, tied)
        for i, layer in enumerate(layers):
            next_norm = gathered(layers[i + 1]).attn_norm if i + 1 < len(layers) else self.norm
            x, h, r = layer(self._block, x, h, r, cp(next_norm), rope, shape)
        return x, h, r, (table if tied else self.lm_head)

    def _block(self, layer: LayerWeights, x: Tensor, h: Tensor, r: Tensor, next_norm: Tensor, rope: Tensor,
               shape: BlockShape) -> tuple[Tensor, Tensor, Tensor]:
        """One block (F1..F6) from its weights module's call (LayerWeights.forward)."""
        cp = self.compute_copy
        weights = BlockWeights(cp(layer.attn_norm), cp(layer.w_qkv), cp(layer.w_o), cp(layer.mlp_norm),
                               cp(layer.w_gate_up), cp(layer.w_down), next_norm)
        return CodaBlock.apply(x, h, r, layer.attn_norm, layer.w_qkv, layer.w_o, layer.mlp_norm, layer.w_gate_up,
                               layer.w_down, weights, rope, shape, self.ops, self.recompute)
