"""The CODA op set: one declaration per op, two implementations.

Each op is declared once in reference.py (`@declare`: signature, reference implementation = the
oracle, fake, partial-sum outputs, example inputs; see declare.py). `reference` runs those
functions (plain torch, any device and dtype). `cute` (cute/) runs each op as one quack GEMM +
epilogue program (or FlashAttention 4, or a tiny reduction) on Hopper; it is imported only when
selected, so CPU machines never need a GPU stack. A model holds the op set of its backend
(`op_set(name)`) and calls ops only through it, so switching backends changes no model code and
models on different backends coexist in one process. Rows are tokens (M = batch * seq_len).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

import torch

from ..errors import ConfigError
from . import reference
from .declare import OPS, Dims, Example, Op

BACKENDS = ("auto", "reference", "cute")


class BackendError(ConfigError):
    """The requested kernel backend cannot run on this machine."""


def _load_cute() -> ModuleType:
    if not torch.cuda.is_available():
        raise BackendError("kernels.backend=cute needs a CUDA GPU and none is visible; "
                           "use kernels.backend=reference (or auto) on this machine")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise BackendError(f"kernels.backend=cute needs a Hopper GPU (sm_90), found sm_{major}{minor} "
                           f"({torch.cuda.get_device_name()}); use kernels.backend=reference")
    try:
        return importlib.import_module(".cute", __name__)
    except ImportError as e:
        raise BackendError(f"kernels.backend=cute could not import its kernels ({e}); install the GPU "
                           "packages (pip install -e .) or use kernels.backend=reference") from e


def resolve_backend(name: str) -> str:
    """The backend `name` ('auto', 'reference' or 'cute') runs as on this machine: 'reference' or
    'cute' ('auto': cute on a Hopper GPU where its kernels import, else reference). Raises
    BackendError naming the fix when it cannot run here."""
    if name not in BACKENDS:
        raise BackendError(f"unknown kernels.backend={name!r}; choose one of {list(BACKENDS)}")
    if name == "reference":
        return name
    try:
        _load_cute()
        return "cute"
    except BackendError:
        if name == "cute":
            raise
        return "reference"


class OpSet:
    """The ops of one backend: attribute <name> is the callable of op <name> (reference.py's
    signature); `backend` is 'reference' or 'cute'."""

    def __init__(self, backend: str, impls: dict[str, Callable]):
        self.backend = backend
        self.__dict__.update(impls)

    def __repr__(self) -> str:
        return f"OpSet({self.backend!r})"


def op_set(name: str) -> OpSet:
    """A new OpSet of backend `name` ('auto', 'reference' or 'cute'; resolve_backend's errors)."""
    backend = resolve_backend(name)
    if backend == "reference":
        return OpSet(backend, {n: op.reference for n, op in OPS.items()})
    from .library import CUTE_IMPLS  # filled by importing cute (resolve_backend did)

    missing = [n for n in OPS if n not in CUTE_IMPLS]
    if missing:
        raise BackendError(f"kernels.backend=cute has no implementation of {missing}; use kernels.backend=reference")
    return OpSet(backend, {n: CUTE_IMPLS[n] for n in OPS})


__all__ = ["BACKENDS", "BackendError", "Dims", "Example", "OPS", "Op", "OpSet", "op_set", "reference", "resolve_backend"]
