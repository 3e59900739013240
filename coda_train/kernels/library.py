"""The CODA op set as torch.library custom ops: `torch.ops.coda.<name>` for every declared op.

Each op is one opaque node for the dispatcher, so torch.compile, fake tensors (FakeTensorMode,
make_fx) and CUDA graph capture see it without tracing into quack / FlashAttention. Built from
the declarations (declare.OPS, filled by reference.py):

  schema         = the reference function's signature, the declared `mutates` inputs marked as
                   written in place (Tensor(a!));
  default kernel = the reference (plain torch, any device), partial-sum outputs widened to the
                   declared column count (the row sum in column 0, zeros elsewhere);
  CUDA kernel    = the cute implementation, registered by `@cute_impl(name)` when kernels/cute loads;
  fake kernel    = the declared fake.

Every op returns fresh tensors (custom ops may not alias their inputs) and writes no input but
the ones its declaration names in `mutates`, which it updates in place and does not return.
Importing this module imports only torch (the reference backend never needs it; cute imports it).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from . import reference  # noqa: F401  (its @declare decorators fill OPS)
from .declare import OPS, Op


def _widen_partials(op: Op) -> Callable:
    """The reference of `op` with its (M, 1) partial-sum outputs widened to the declared width."""

    @functools.wraps(op.reference)
    def kernel(*args, **kwargs):
        out = op.reference(*args, **kwargs)
        if not op.partials:
            return out
        bound = op.signature.bind(*args, **kwargs).arguments
        single = isinstance(out, torch.Tensor)
        out = [out] if single else list(out)
        for i, width in op.partials.items():
            extra = width(**bound) - out[i].shape[1]
            out[i] = torch.cat((out[i], out[i].new_zeros(out[i].shape[0], extra)), dim=1) if extra else out[i]
        return out[0] if single else tuple(out)

    return kernel


def _define(op: Op):
    custom = torch.library.custom_op(f"coda::{op.name}", _widen_partials(op), mutates_args=op.mutates,
                                     schema=torch.library.infer_schema(op.reference, mutates_args=op.mutates))
    custom.register_fake(op.fake)
    return custom


CUSTOM_OPS = {name: _define(op) for name, op in OPS.items()}

CUTE_IMPLS: dict[str, Callable] = {}  # name -> cute implementation (as called), filled by kernels/cute


def cute_impl(name: str, *, gpu_blind_compile: bool = False) -> Callable:
    """Register the decorated function as the cute implementation of the declared op `name`: the
    CUDA kernel of coda::<name>. Returns the function as the cute backend calls it: straight to the
    kernel in eager code and CUDA graphs (the dispatcher's Python step buys nothing there), through
    torch.ops.coda.<name> while torch.compile traces (one opaque node). gpu_blind_compile: the
    implementation compiles its kernels without a GPU under cute's compile_only() (cute/_compile.py).
    The undispatched function is `.kernel` of the result."""
    assert name in OPS, f"cute_impl({name!r}): no op of that name is declared in reference.py"

    def register(kernel: Callable) -> Callable:
        torch.library.register_kernel(f"coda::{name}", "cuda", kernel)
        through_op = CUSTOM_OPS[name]

        @functools.wraps(kernel)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return through_op(*args, **kwargs)
            return kernel(*args, **kwargs)

        call.kernel, call.gpu_blind_compile = kernel, gpu_blind_compile
        CUTE_IMPLS[name] = call
        return call

    return register
