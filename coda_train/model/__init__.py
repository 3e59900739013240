"""Llama models: the config, the eager baseline and the CODA model (one parameter layout)."""

from __future__ import annotations

import torch

from ..kernels import BACKENDS, BackendError
from .coda import RECOMPUTE, CodaLlama
from .config import PRESETS, ConfigError, LlamaConfig, kernel_shape_errors, preset
from .eager import EagerLlama
from .liger import LigerLlama
from .weights import LlamaWeights

# eager and liger are the baselines: same function, same parameters, autograd backward.
IMPLS = {"coda": CodaLlama, "eager": EagerLlama, "liger": LigerLlama}


def build_model(cfg: LlamaConfig, impl: str, *, backend: str = "reference",
                compute_dtype: torch.dtype = torch.float32, recompute: str = "none") -> LlamaWeights:
    """The model for `model.impl` ('coda', 'eager' or 'liger'), initialized from torch's current RNG
    state, computing in `compute_dtype` (fp32 master weights) with the CODA ops of `backend`
    ('auto', 'reference' or 'cute'; only the coda model calls CODA ops); recompute (coda only, one of
    RECOMPUTE): 'block' keeps each block's input triple and recomputes its forward in backward."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown model.impl={impl!r}; choose one of {sorted(IMPLS)}")
    if backend not in BACKENDS:
        raise BackendError(f"unknown kernels.backend={backend!r}; choose one of {list(BACKENDS)}")
    if impl == "coda":
        return CodaLlama(cfg, compute_dtype=compute_dtype, backend=backend, recompute=recompute)
    return IMPLS[impl](cfg, compute_dtype=compute_dtype)


__all__ = ["RECOMPUTE", "LlamaConfig", "PRESETS", "ConfigError", "kernel_shape_errors", "preset", "build_model", "CodaLlama", "EagerLlama", "LigerLlama", "LlamaWeights"]
