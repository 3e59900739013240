"""How a CODA op is declared: one `@declare(...)` on its reference implementation (reference.py).

A declaration is the op's whole contract in one place: the signature and semantics (the reference
function, plain torch, the oracle), the fake (output shapes and dtypes from input shapes), which
inputs it updates in place, which outputs are partial row sums and how many columns they have,
the GEMM it fuses (for benchmarks), and a generator of example inputs for given sizes.
Everything else iterates over `OPS`: the custom ops `coda::<name>` (library.py), the backends' op
sets (__init__.op_set), the cute implementations (registered against a declaration by name), the
checks (testing.py), the compile list and the benchmark. Importing this module imports only torch.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

# The narrowest N tile whose per-row partial sums the cute epilogues write: a declared partial-sum
# output has one column per STAT_TILE_N output columns; wider tiles leave the extra columns zero.
STAT_TILE_N = 128


# Vocabulary columns per strip entry of the LM head's gradient (H', H''): the 64-wide K tiles of the
# GEMMs that scale the stored exponentials by the strip as they load them.
STRIP_COLS = 64

# Every Triton launch passes enable_fp_fusion=TRITON_FP_FUSION: a*b+c contracted to one fma, as ptxas
# does in the CuTeDSL kernels and as every kernel was tested and timed; Triton 3.10 turns its default off.
TRITON_FP_FUSION = True


def n_stat_cols(n: int) -> int:
    """Number of partial-sum columns of a GEMM epilogue over n output columns."""
    return (n + STAT_TILE_N - 1) // STAT_TILE_N


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Row statistics (r, partial sums, lse, c) are fp32; fp64 stays fp64 (the CPU oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Dims:
    """Sizes in kernel terms. rows = tokens M (whole sequences: rows % seq_len == 0), dim = d,
    head_dim = dim / n_heads; fused qkv rows are [q heads | k heads | v heads]."""

    rows: int
    seq_len: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def n_rope_cols(self) -> int:
        """q and k columns: the ones RoPE rotates."""
        return (self.n_heads + self.n_kv_heads) * self.head_dim


class Example:
    """Random op inputs of given dims: activations and weights in `dtype`, row statistics in
    stat_dtype(dtype), token ids int64, all on `device` from `gen`. gen=None gives uninitialized
    tensors of the same shapes (for shape-only uses: GPU-blind compilation)."""

    def __init__(self, dims: Dims, dtype: torch.dtype, device, gen: Optional[torch.Generator]):
        self.dims, self.dtype, self.device, self.gen = dims, dtype, torch.device(device), gen
        self.stat_dtype = stat_dtype(dtype)

    def _randn(self, shape, dtype, scale=1.0, shift=0.0) -> Tensor:
        if self.gen is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=stat_dtype(dtype))
        return (t * scale + shift).to(dtype)

    def act(self, *shape: int) -> Tensor:
        """Activations ~ N(0, 1)."""
        return self._randn(shape, self.dtype)

    def weight(self, n: int, k: int, scale: float = 1.0) -> Tensor:
        """An (out, in) weight ~ N(0, scale^2 / k): unit-variance outputs for unit-variance inputs."""
        return self._randn((n, k), self.dtype, scale * k ** -0.5)

    def stat(self, *shape: int, scale: float = 1.0) -> Tensor:
        """Row statistics ~ N(0, scale^2) in stat_dtype."""
        return self._randn(shape, self.stat_dtype, scale)

    def gamma(self, n: int) -> Tensor:
        """An RMSNorm weight ~ 1 + N(0, 0.01) in the compute dtype, as the model passes it (its compute copy)."""
        return self._randn((n,), self.dtype, 0.1, 1.0)

    def rowscale(self) -> Tensor:
        """A row scale r ~ U(0.5, 1.5) per row, stat_dtype."""
        if self.gen is None:
            return torch.empty(self.dims.rows, dtype=self.stat_dtype, device=self.device)
        return 0.5 + torch.rand(self.dims.rows, generator=self.gen, device=self.device, dtype=self.stat_dtype)

    def positive(self, *shape: int, scale: float = 1.0) -> Tensor:
        """Non-negative statistics (sums of squares) ~ U(0, scale), stat_dtype."""
        if self.gen is None:
            return torch.empty(shape, dtype=self.stat_dtype, device=self.device)
        return torch.rand(shape, generator=self.gen, device=self.device, dtype=self.stat_dtype) * scale

    def tokens(self) -> Tensor:
        """(rows,) token ids in [0, vocab_size)."""
        if self.gen is None:
            return torch.zeros(self.dims.rows, dtype=torch.long, device=self.device)
        return torch.randint(0, self.dims.vocab_size, (self.dims.rows,), generator=self.gen, device=self.device)

    def rope(self) -> Tensor:
        """A RoPE table in the ops' layout, (rows, head_dim) stat_dtype with (cos a, sin a) at
        columns (2i, 2i+1); the angles a are uniform, so any row-to-position map is covered."""
        rows, half = self.dims.rows, self.dims.head_dim // 2
        if self.gen is None:
            return torch.empty(rows, 2 * half, dtype=self.stat_dtype, device=self.device)
        a = torch.rand(rows, half, generator=self.gen, device=self.device, dtype=torch.float64) * (2 * math.pi)
        return torch.stack((a.cos(), a.sin()), dim=-1).reshape(rows, 2 * half).to(self.stat_dtype)

    def computed(self, fn: Callable[[], tuple], *outs: tuple[tuple, torch.dtype]) -> tuple:
        """Inputs that are functions of other inputs (lse of the logits, o of attention): fn()'s
        outputs cast to the dtypes of `outs` ((shape, dtype) pairs), or uninitialized tensors of
        those shapes when the example has no values."""
        if self.gen is None:
            return tuple(torch.empty(shape, dtype=dt, device=self.device) for shape, dt in outs)
        return tuple(t.to(dt) for t, (_, dt) in zip(fn(), outs))


@dataclass(frozen=True)
class Op:
    """One CODA op. `examples(Example)` returns {case: kwargs}; case "" is the op's main use, other
    cases (e.g. "no GQA") are named variants, reported as "<name>(<case>)". `partials` maps an
    output index to its column count given the kwargs: those (M, P) outputs are per-tile partial
    row sums whose column split is backend-specific, so consumers and checks only sum over P.
    `mutates` names the inputs the op updates in place: they are results too, never returned (a
    custom op's outputs may not alias its inputs), so the op returns only its other outputs
    (None when there are none). `gemm(**kwargs)` gives the (m, n, k) of the fused GEMM, for
    benchmarks (None: not a GEMM). `canonical(*outputs, *mutated)`, where an op's outputs are one of
    several exact representations (offsets chosen by rounding, a product kept factored), maps them
    (partial sums summed, then the mutated inputs in declared order) to what every representation
    agrees on, each on a per-row scale where rows span octaves; checks compare that."""

    name: str
    reference: Callable
    fake: Callable
    examples: Callable[[Example], dict[str, dict[str, Any]]]
    partials: dict[int, Callable[..., int]] = field(default_factory=dict)
    mutates: tuple[str, ...] = ()
    gemm: Optional[Callable[..., tuple[int, int, int]]] = None
    canonical: Optional[Callable[..., tuple]] = None

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.reference)

    def cases(self, example: Example) -> list[tuple[str, dict[str, Any]]]:
        """[(case name, kwargs)]: the op name for case "", "<name>(<case>)" otherwise."""
        return [(self.name if c == "" else f"{self.name}({c})", kw) for c, kw in self.examples(example).items()]


OPS: dict[str, Op] = {}  # name -> declaration, in declaration order (reference.py fills it)


def declare(*, fake: Callable, examples: Callable, partials: Optional[dict] = None, mutates: tuple[str, ...] = (),
            gemm: Optional[Callable] = None, canonical: Optional[Callable] = None) -> Callable:
    """Declare the decorated reference function as the CODA op of the same name."""

    def add(reference: Callable) -> Callable:
        name = reference.__name__
        assert name not in OPS, f"op {name} declared twice"
        assert set(mutates) <= set(inspect.signature(reference).parameters), f"{name}: mutates {mutates} names no input"
        OPS[name] = Op(name, reference, fake, examples, dict(partials or {}), tuple(mutates), gemm, canonical)
        return reference

    return add
