"""Llama model configuration: one typed config, presets, validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..kernels import Dims


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 768
    vocab_size: int = 8192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 256
    tie_embeddings: bool = True
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        """Output width of the fused QKV projection: q heads, then k heads, then v heads."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def kernel_dims(self, rows: int, seq_len: int) -> Dims:
        """The sizes the CODA ops see for `rows` tokens of sequences of seq_len."""
        return Dims(rows=rows, seq_len=seq_len, dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                    ffn_dim=self.ffn_dim, vocab_size=self.vocab_size)

    def validate(self) -> "LlamaConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"model config: {msg}")

        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name}={getattr(self, name)!r} must be a positive integer")
        need(self.dim % self.n_heads == 0,
             f"n_heads={self.n_heads} must divide dim={self.dim} (set model.n_heads to a divisor of dim)")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (GQA shares each KV head across a whole group)")
        need(self.head_dim % 2 == 0,
             f"head_dim=dim/n_heads={self.head_dim} must be even (RoPE rotates pairs of columns)")
        for name in ("rope_theta", "norm_eps", "init_std"):  # NaN fails both tests, inf the first
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0, f"{name}={value} must be a finite number > 0")
        return self

    def num_params(self, include_embedding: bool = True) -> int:
        d, L = self.dim, self.n_layers
        per_block = d * self.qkv_dim + d * d + 2 * d * self.ffn_dim + d * self.ffn_dim + 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return L * per_block + d + head + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 per matmul weight (the
        blocks and the LM head, tied or not; not the RMSNorm gains) plus causal attention, 6*L*T*d
        (half of dense 12*L*T*d)."""
        norm_gains = (2 * self.n_layers + 1) * self.dim
        matmul_params = (self.num_params(include_embedding=False) - norm_gains
                         + (self.vocab_size * self.dim if self.tie_embeddings else 0))
        return 6.0 * matmul_params + 6.0 * self.n_layers * seq_len * self.dim


# A preset's vocab_size is a run's only with model.vocab_size set; train.py otherwise takes the tokenizer's
# (rounded up to model.vocab_multiple_of). Parameter counts below are at the preset's own vocab.
PRESETS: dict[str, LlamaConfig] = {
    # Trains on 2 CPU cores in minutes; the default of `python train.py`.
    "tiny": LlamaConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=8192,
                        rope_theta=10000.0, max_seq_len=256, tie_embeddings=True),
    # GPT-2-small-sized Llama-3 shape (12 x 768, GQA 12/4): 100,682,496 parameters (the name is its size class).
    "llama3_125m": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=32768,
                               rope_theta=500000.0, max_seq_len=2048, tie_embeddings=True),
    # Llama 3.2 1B's shape (1,235,814,400 parameters) without its llama3 RoPE scaling (factor 32) and 131072 positions.
    "llama3_1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                             rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True),
    # Llama 3 8B (8,030,261,248 parameters); Llama 3.1 8B differs only in its RoPE scaling and 131072 positions.
    "llama3_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                             rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A preset by name with field overrides, validated."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)}
    if unknown:
        raise ConfigError(f"unknown model config fields {sorted(unknown)}")
    return dataclasses.replace(PRESETS[name], **overrides).validate()


def kernel_shape_errors(cfg: LlamaConfig, backend: str) -> list[str]:
    """What the resolved kernel `backend` ('reference' or 'cute') cannot run of model `cfg`: one
    message per model.* key to change, naming a value that works; [] = it runs. Needs no GPU."""
    if backend != "cute":
        return []
    from ..kernels.cute_limits import shape_errors

    fields = ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
    bad = [f for f in fields if not (isinstance(getattr(cfg, f), int) and getattr(cfg, f) > 0)]
    if bad:
        return [f"model.{f}={getattr(cfg, f)!r} must be a positive integer" for f in bad]
    d, H, G, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H

    def violated(key: str, **change) -> list[str]:
        dims = dict(dim=d, head_dim=hd, n_heads=H, n_kv_heads=G, ffn_dim=F, vocab_size=V) | change
        return shape_errors(**dims).get(key, [])

    def next_ok(key: str, n: int) -> Optional[int]:
        """The first value from n on that key may take; None if none within 1024 above (a cap, not an alignment)."""
        return next((m for m in range(n, n + 1024) if not violated(key, **{key: m})), None)

    def choose(key: str, n: int, alignment: str) -> str:
        ok = next_ok(key, n)
        if ok is None:
            return (f"no model.{key} from {n} up runs on them (see the limits below); choose a smaller model.{key}, "
                    f"or kernels.backend=reference")
        return f"choose model.{key}={ok} or another {alignment}"

    errors = []

    def report(what: str, msgs: list[str], fix: str) -> None:
        if msgs:
            errors.append(f"{what}: {fix} (cute kernel checks: {'; '.join(msgs)})")

    report(f"model.dim={d}", violated("dim"), "every inner dim of the cute GEMMs must be a multiple of 8 (and the "
           f"embedding entry's rows fit one program); {choose('dim', d, 'multiple of 8')}")
    if msgs := violated("head_dim"):
        ok = [h for h in range(2, 1025, 2) if not violated("head_dim", head_dim=h)]
        heads = [n for n in range(1, d + 1) if d % n == 0 and d // n in ok]
        fix = (f"model.n_heads in {heads}, with model.n_kv_heads a divisor of it" if heads else
               f"none divides dim={d} so; change model.dim too (e.g. to a multiple of 128)")
        report(f"model.dim={d} with model.n_heads={H} gives head_dim={hd}", msgs,
               f"the cute attention/RoPE kernels need head_dim in {ok} (32, 64, 128 or a multiple of 128 for the RoPE "
               f"epilogue's 32-column subtiles, and <= 256 for FlashAttention 4 on sm90); choose model.n_heads so that "
               f"dim/n_heads is one of those: {fix}")
    report(f"model.n_kv_heads={G}", violated("n_kv_heads"), f"choose model.n_kv_heads a divisor of n_heads={H}")
    report(f"model.ffn_dim={F}", violated("ffn_dim"), choose("ffn_dim", F, "multiple of 8"))
    report(f"model.vocab_size={V}", violated("vocab_size"),
           f"pad the vocabulary: {choose('vocab_size', V, 'multiple of 128')} (the extra embedding rows are never "
           "token ids)")
    return errors
