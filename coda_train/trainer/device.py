"""Where a run computes: the device and the compute dtype (parameters and optimizer state stay fp32)."""

from __future__ import annotations

import torch

from coda_train.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")  # auto: cuda when a GPU is visible, else cpu
# auto: bfloat16 on cuda (both models, so their curves compare), float32 on cpu
COMPUTE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


def pick_device(name: str, option: str = "trainer.device=") -> torch.device:
    """The device `name` names; `option` is how the caller's user spells the setting (a script's "--device ")."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}cuda but no CUDA GPU is visible; use {option}auto or {option}cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return COMPUTE_DTYPES[name]
