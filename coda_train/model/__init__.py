"""Llama models: the config, the eager baseline and the CODA model (one parameter layout)."""

from __future__ import annotations

from .coda import CodaLlama
from .config import PRESETS, ConfigError, LlamaConfig, preset
from .eager import EagerLlama
from .weights import LlamaWeights

IMPLS = {"coda": CodaLlama, "eager": EagerLlama}


def build_model(cfg: LlamaConfig, impl: str) -> LlamaWeights:
    """The model for `model.impl` ('coda' or 'eager'), initialized from torch's current RNG state."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown model.impl={impl!r}; choose one of {sorted(IMPLS)}")
    return IMPLS[impl](cfg)


__all__ = ["LlamaConfig", "PRESETS", "ConfigError", "preset", "build_model", "CodaLlama", "EagerLlama", "LlamaWeights"]
