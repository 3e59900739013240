"""The train state: what a checkpoint holds, listed once, and the RNGs a run draws from."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from coda_train.data import TokenLoader


@dataclass
class TrainState:
    """Everything that makes a resumed run continue exactly where the saved one stopped."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: TokenLoader  # its position in the data order; every rank's is the same
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # trained on so far, all ranks together
    elapsed_before_s: float = 0.0  # training wall time of the earlier processes of this run
    clock_start: float = field(default_factory=time.perf_counter)  # when this process's training time began

    def start_clock(self) -> None:
        self.clock_start = time.perf_counter()

    def elapsed_s(self, now: float | None = None) -> float:
        """Training wall time of the whole run, this process's share up to `now` (perf_counter)."""
        return self.elapsed_before_s + (time.perf_counter() if now is None else now) - self.clock_start

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "train_loader": self.train_loader.state_dict(),
                "rng": rng_state(), "step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.train_loader.load_state_dict(state["train_loader"])  # the same on every rank: each takes its own windows
        set_rng_state(state["rng"])
        self.step, self.tokens, self.elapsed_before_s = state["step"], state["tokens"], state["elapsed_s"]
        self.start_clock()


def seed_all(seed: int) -> None:
    """Seed every RNG the run draws from (python, numpy, torch on every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        # this process's GPU only: a resuming machine may have fewer GPUs than the saving one
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])
