"""The train state: what a checkpoint holds, listed once, and the RNGs a run draws from."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule

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
        """The whole state of an unsharded model (what state.pt holds)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), **self.run_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A whole state (state.pt) into this state; under FSDP2 every rank loads it and keeps its shards."""
        if isinstance(self.model, FSDPModule):
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=full)
            by_name = _optimizer_by_name(state["optimizer"], self._names_in_optimizer_order())
            set_optimizer_state_dict(self.model, self.optimizer, by_name, options=full)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_run_state_dict(state)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Model and optimizer keyed by parameter name, as torch.distributed.checkpoint saves and loads
        them: this rank's shards (DTensors) under FSDP2, whole tensors otherwise."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def run_state_dict(self) -> dict[str, Any]:
        """All but model and optimizer: the same on every rank but the RNGs (rank 0's are saved)."""
        return {"scheduler": self.scheduler.state_dict(), "train_loader": self.train_loader.state_dict(),
                "rng": rng_state(), "step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s()}

    def load_run_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.train_loader.load_state_dict(state["train_loader"])  # the same on every rank: each takes its own windows
        set_rng_state(state["rng"])
        self.step, self.tokens, self.elapsed_before_s = state["step"], state["tokens"], state["elapsed_s"]
        self.start_clock()

    def _names_in_optimizer_order(self) -> list[str]:
        """Parameter names in the order optimizer.state_dict() numbers the parameters (group by group)."""
        names = {p: n for n, p in self.model.named_parameters()}
        return [names[p] for group in self.optimizer.param_groups for p in group["params"]]


def _optimizer_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """optimizer.state_dict(), which numbers the parameters, keyed by their names instead."""
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


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
