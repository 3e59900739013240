"""The shape constraints of the cute backend, in kernel terms and without importing cutlass/quack.

The cute ops run these checks on every call (raising ValueError naming the constraint), and
`shape_errors` evaluates the same checks on the inner dims a model produces, so a model that the
kernels cannot run is rejected before any GPU work (coda_train.model.kernel_shape_errors turns the
result into messages about model.* keys).
"""

from __future__ import annotations


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def need_inner(op: str, **dims: int) -> None:
    """TMA moves 16-byte rows: every inner (contiguous) bf16 dim is a positive multiple of 8."""
    for name, n in dims.items():
        need(n % 8 == 0 and n > 0, f"{op}: {name}={n} must be a positive multiple of 8 (16-byte bf16 rows for TMA)")


def need_rope_head_dim(op: str, hd: int) -> None:
    """The RoPE epilogue's table tiling (CFG_ROPE.tile_N = 128 columns per tile), in quack's SM90
    epilogue subtiles of 32 columns (gcd(32, tile_N)), each within one head."""
    need(hd > 0 and hd % 32 == 0 and (128 % hd == 0 or hd % 128 == 0),
         f"{op}: head_dim={hd} must be 32, 64, 128 or a multiple of 128 (RoPE table tiling in 32-column epilogue subtiles)")


def need_swiglu_width(op: str, n2: int) -> None:
    """gate and up halves of the GEMM's 2*ffn_dim columns, each a multiple of 8 columns."""
    need(n2 % 16 == 0, f"{op}: 2*ffn_dim={n2} must be a multiple of 16 (ffn_dim multiple of 8)")


def need_attention_heads(op: str, hd: int, n_heads: int, n_kv_heads: int) -> None:
    """FlashAttention 4 on sm90: GQA groups, and head_dim a multiple of 8 up to 256."""
    need(n_kv_heads > 0 and n_heads % n_kv_heads == 0, f"{op}: n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    need(hd % 8 == 0 and 0 < hd <= 256, f"{op}: head_dim={hd} must be a multiple of 8 and <= 256 (FA4 sm90)")


def need_exp_vocab(op: str, vocab: int) -> None:
    """The LM head's exponentials: one offset per 128-column N tile, strips per 64 columns."""
    need(vocab > 0 and vocab % 128 == 0,
         f"{op}: vocab_size={vocab} must be a positive multiple of 128 (one power-of-two offset per 128-column tile); "
         "pad the vocabulary (model.vocab_size) to a multiple of 128")


EMBEDDING_MAX_DIM = 16384  # the embedding entry's Triton pass holds one row in registers


def need_embedding_dim(op: str, dim: int) -> None:
    need(0 < dim <= EMBEDDING_MAX_DIM, f"{op}: dim={dim} must be at most {EMBEDDING_MAX_DIM} (one table row per program)")


def _failures(*checks) -> list[str]:
    """The messages of the checks (callables raising through `need`) that fail."""
    msgs = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def shape_errors(dim: int, head_dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                 vocab_size: int) -> dict[str, list[str]]:
    """{dim name: [violated constraint, ...]} for the dims of a Llama on the cute kernels, each
    constraint attributed to the one dim that fixes it ('dim', 'head_dim', 'n_kv_heads', 'ffn_dim',
    'vocab_size'); {} = every op runs. The row count (batch * seq_len) is free: ragged tiles are
    predicated."""
    H, G, hd = n_heads, n_kv_heads, head_dim
    found = {
        "dim": _failures(lambda: need_inner("gemm_residual_rmsnorm_partial", N=dim),
                         lambda: need_embedding_dim("embedding_rmsnorm_partial", dim)),
        "head_dim": _failures(lambda: need_rope_head_dim("gemm_rowscale_rope", hd),
                              lambda: need_attention_heads("attention", hd, 1, 1),
                              lambda: need_inner("gemm_residual_rmsnorm_partial", K=H * hd),   # o-projection
                              lambda: need_inner("gemm_rowscale_rope", N=(H + 2 * G) * hd)),   # qkv_dim
        "n_kv_heads": _failures(lambda: need_attention_heads("attention", 8, H, G)),
        "ffn_dim": _failures(lambda: need_swiglu_width("gemm_rowscale_swiglu", 2 * ffn_dim),
                             lambda: need_inner("gemm_dswiglu_rowscale_stat", ffn_dim=ffn_dim)),
        "vocab_size": _failures(lambda: need_inner("gemm_rowscale_cross_entropy", V=vocab_size),
                                lambda: need_exp_vocab("gemm_rowscale_exp_cross_entropy", vocab_size)),
    }
    return {name: msgs for name, msgs in found.items() if msgs}
