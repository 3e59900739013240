"""The accuracy check of an op implementation against the reference oracle, shared by
scripts/check_kernels.py and the tests.

For every declared op and example case (declare.py), at given dims, on one device:
  * inputs are the op's example inputs in bf16 (fp32 row statistics, int64 token ids);
  * oracle   = the reference on the same values in float64 (on the same device);
  * baseline = the reference on the inputs as given (bf16), and for the attention ops also torch SDPA
               in bf16 (the eager model's attention; its gradient rounded to bf16 before the RoPE
               backward): the error an unfused bf16 op makes;
  * impl     = the implementation under test (cute outputs NaN-poisoned, so unwritten tiles show).
Each call gets its own copy of the inputs the op updates in place (declared `mutates`), and those
are compared as outputs after the returned ones (an unwritten tile keeps its input value, which
differs from the oracle's). Partial-sum outputs (declared `partials`) are compared after summing
over their columns; an op with a declared `canonical` map has its stored outputs checked for shape,
dtype and finiteness, then is compared on what the map makes of all of those (each row on its own
scale). Error is the relative Frobenius error vs the oracle; an output passes when it
is finite where the oracle is, has the oracle's shape and the baseline's dtype, and
err(impl) <= RATIO * err(baseline) + ATOL.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference
from .declare import OPS, Dims, Example, Op

RATIO, ATOL = 1.5, 1e-4


def relative_error(x: Tensor, y: Tensor) -> float:
    """||x - y|| / ||y|| in float64."""
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


def passes(err: float, baseline_err: float) -> bool:
    return err <= RATIO * baseline_err + ATOL


def to_float64(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The oracle's inputs: floating tensors in float64, and a floating dtype argument float64 too."""
    def f64(v):
        if isinstance(v, Tensor) and v.is_floating_point():
            return v.double()
        return torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point else v
    return {k: f64(v) for k, v in kwargs.items()}


def results(op: Op, fn: Callable, kwargs: dict[str, Any]) -> tuple[Tensor, ...]:
    """fn (an implementation of op) called on kwargs with the inputs op mutates cloned (kwargs stay
    as given): its returned outputs, partial-sum outputs summed over their columns, then the
    mutated inputs in declared order (the op's canonical map, if any, is the caller's to apply)."""
    kwargs = {k: v.clone() if k in op.mutates else v for k, v in kwargs.items()}
    out = fn(**kwargs)
    out = () if out is None else out if isinstance(out, tuple) else (out,)
    return tuple(t.sum(-1) if i in op.partials else t for i, t in enumerate(out)) + tuple(kwargs[m] for m in op.mutates)


def stored_problems(got: tuple[Tensor, ...], oracle: tuple[Tensor, ...], base: tuple[Tensor, ...]) -> list[str]:
    """What is wrong with outputs as stored, before an op's canonical map (which works in float64
    and may slice): a shape other than the oracle's, a dtype other than the baseline's, NaN/inf
    where the oracle is finite."""
    bad = []
    for i, (g, o, b) in enumerate(zip(got, oracle, base)):
        if tuple(g.shape) != tuple(o.shape) or g.dtype != b.dtype:
            bad.append(f"out{i} {tuple(g.shape)} {g.dtype}, want {tuple(o.shape)} {b.dtype}")
        elif torch.isfinite(o).all() and not torch.isfinite(g).all():
            bad.append(f"out{i} not finite")
    return bad


def sdpa_attention(qkv: Tensor, n_heads: int, n_kv_heads: int, seq_len: int,
                   requires_grad: bool = False) -> tuple[Tensor, Tensor]:
    """The eager model's attention (torch SDPA, causal, GQA) on fused qkv rows: o (M, H*hd) and the
    qkv leaf it was computed from (requires_grad: for the backward)."""
    M = qkv.shape[0]
    hd = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    leaf = qkv.detach().clone().requires_grad_(requires_grad)
    q, k, v = (t.reshape(M // seq_len, seq_len, -1, hd).transpose(1, 2)
               for t in leaf.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], 1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(M, -1), leaf


def sdpa_attention_rope_backward(g_o: Tensor, qkv: Tensor, r: Tensor, rope: Tensor, n_heads: int, n_kv_heads: int,
                                 seq_len: int) -> tuple[Tensor, Tensor]:
    """attention_rope_backward_rowscale_stat as the eager model gets it: SDPA's gradient of the fused
    qkv rows in their dtype, then RoPE^-1, the row scale and S = sum g*qkv (summed) as torch ops."""
    o, leaf = sdpa_attention(qkv, n_heads, n_kv_heads, seq_len, requires_grad=True)
    (g,) = torch.autograd.grad(o, leaf, g_o)
    g = g.float()
    n_rope = (n_heads + n_kv_heads) * rope.shape[1]
    g_y = reference._rotate_pairs(g, rope.float(), n_rope, inverse=True) * r[:, None]
    return g_y.to(qkv.dtype), (g * qkv.float()).sum(-1)


def _eager_baseline(name: str, kw: dict) -> tuple[Optional[Tensor], ...]:
    """The op's outputs (partial sums summed) as the eager model computes them, where that is not
    the reference (the attention ops: SDPA); () for the others."""
    if name == "attention":
        return (sdpa_attention(kw["qkv"], kw["n_heads"], kw["n_kv_heads"], kw["seq_len"])[0].detach(),)
    if name == "attention_backward":
        o, leaf = sdpa_attention(kw["qkv"], kw["n_heads"], kw["n_kv_heads"], kw["seq_len"], requires_grad=True)
        o.backward(kw["g_o"])
        return (leaf.grad,)
    if name == "attention_rope_backward_rowscale_stat":
        return sdpa_attention_rope_backward(kw["g_o"], kw["qkv"], kw["r"], kw["rope"], kw["n_heads"],
                                            kw["n_kv_heads"], kw["seq_len"])
    return ()


@contextlib.contextmanager
def poisoned_cute_outputs() -> Iterator[None]:
    """Every output and partial buffer of the cute ops starts as NaN (unwritten tiles show up)."""
    from .cute import _launch

    saved, _launch.POISON = _launch.POISON, True
    try:
        yield
    finally:
        _launch.POISON = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_case(op: Op, case: str, kwargs: dict[str, Any], impl: Callable) -> list[dict]:
    """One row per output of `impl` on kwargs (see the module docstring)."""
    device = next(v.device for v in kwargs.values() if isinstance(v, Tensor))
    oracle = results(op, op.reference, to_float64(kwargs))
    base = results(op, op.reference, kwargs)
    eager = _eager_baseline(op.name, kwargs)
    _sync(device)
    t0 = time.time()
    got = results(op, impl, kwargs)
    _sync(device)
    seconds = time.time() - t0
    if len(got) != len(oracle):  # an output left out would shorten the comparisons below to those given, and pass
        problems = [f"{len(got)} outputs, want {len(oracle)}"]
    else:  # with a canonical map: the stored outputs' shapes, dtypes and finiteness, then the mapped values
        problems = stored_problems(got, oracle, base) if op.canonical is not None else []
    if problems:
        return [dict(op=case, out=-1, M=0, ok=False, finite=not any("not finite" in p for p in problems),
                     err_cute=math.inf, err_base=0.0, dtype="", shape=[], stored=problems,
                     first_call_s=round(seconds, 2))]
    if op.canonical is not None:
        got, oracle, base = (op.canonical(*t) for t in (got, oracle, base))
    rows = []
    for i, (g, o, b) in enumerate(zip(got, oracle, base)):
        finite = bool(torch.isfinite(g).all()) if torch.isfinite(o).all() else True
        shape_ok = tuple(g.shape) == tuple(o.shape)
        err = relative_error(g, o) if shape_ok else math.inf
        err_base = relative_error(b, o)
        if i < len(eager):
            err_base = max(err_base, relative_error(eager[i], o))
        ok = finite and shape_ok and g.dtype == b.dtype and passes(err, err_base)
        rows.append(dict(op=case, out=i, M=g.shape[0] if g.dim() else 1, ok=ok, finite=finite, err_cute=err,
                         err_base=err_base, dtype=str(g.dtype).replace("torch.", ""), shape=list(g.shape),
                         first_call_s=round(seconds, 2)))
    return rows


def example_cases(dims: Dims, device, seed: int = 1234, dtype: torch.dtype = torch.bfloat16,
                  ops: Optional[list[str]] = None) -> Iterator[tuple[Op, str, dict]]:
    """(op, case name, kwargs) of every declared op (or those named in `ops`, by op or case name)
    at `dims`, each op's inputs from a generator seeded with `seed`."""
    device = torch.device(device)
    wanted = None if ops is None else {o.split("(")[0] for o in ops}
    for name, op in OPS.items():
        if wanted is not None and name not in wanted:
            continue
        gen = torch.Generator(device=device).manual_seed(seed)
        for case, kwargs in op.cases(Example(dims, dtype, device, gen)):
            if ops is None or name in ops or case in ops:
                yield op, case, kwargs
