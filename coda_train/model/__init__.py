"""Llama models: the config, the eager baseline and the CODA model (one parameter layout)."""

from __future__ import annotations

from .coda import CodaLlama
from .config import PRESETS, ConfigError, LlamaConfig, preset
from .eager import EagerLlama
from .liger import LigerLlama
from .weights import LlamaWeights

# eager and liger are the baselines: same function, same parameters, autograd backward.
IMPLS = {"coda": CodaLlama, "eager": EagerLlama, "liger": LigerLlama}


def build_model(cfg: LlamaConfig, impl: str) -> LlamaWeights:
    """The model for `model.impl` ('coda', 'eager' or 'liger'), initialized from torch's current RNG state."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown model.impl={impl!r}; choose one of {sorted(IMPLS)}")
    return IMPLS[impl](cfg)


__all__ = ["LlamaConfig", "PRESETS", "ConfigError", "preset", "build_model", "CodaLlama", "EagerLlama", "LigerLlama", "LlamaWeights"]
