"""Optimizer steps (micro-batches, gradient accumulation, clipping) without waiting for the GPU,
the non-finite check that keeps a bad step from ever being applied, and the validation loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from coda_train.data import TokenLoader

from .distributed import World, global_grad_norm, gradient_sync, mean_over_ranks
from .graphs import GraphedMicroBatch, micro_batch
from .optim import AdamW, clip_factor
from .state import TrainState


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; that step and every later one is never applied or saved."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step  # the first non-finite step


@dataclass(frozen=True)
class StepResult:
    step: int  # the optimizer step just taken, counted from 1
    loss: float  # mean over the micro-batches and ranks
    lr: float  # the learning rate this step applied
    grad_norm: float  # global, before clipping
    tokens: int  # trained on in this step, all ranks together


@dataclass(frozen=True)
class PendingStep:
    """A step as the host knows it before reading the device: loss and grad_norm are 0-dim device tensors."""
    step: int
    loss: Tensor
    lr: float
    grad_norm: Tensor
    tokens: int


class NonFiniteFlag:
    """Whether any step so far had a non-finite loss or gradient norm, kept on the device so that no
    step waits for the GPU. `found` is 1.0 from the first such step on (sticky): fused AdamW reads it
    as found_inf and then changes nothing (parameters, moments and its step count). `first` holds
    (step, loss, grad_norm) of the first such step."""

    def __init__(self, device: torch.device):
        self.found = torch.zeros((), dtype=torch.float32, device=device)
        self.first = torch.zeros(3, dtype=torch.float64, device=device)

    def record(self, step: int, loss: Tensor, grad_norm: Tensor) -> None:
        bad = ~torch.isfinite(loss + grad_norm)  # the sum is non-finite iff one of them is
        values = torch.stack((torch.full_like(loss, step, dtype=torch.float64), loss.double(), grad_norm.double()))
        self.first.copy_(torch.where(bad & (self.found == 0), values, self.first))
        self.found.copy_(torch.maximum(self.found, bad.float()))

    def read(self, *values: Tensor) -> list[float]:
        """The host values of `values` (0-dim tensors) in one device sync; raises NonFiniteError if the flag is set."""
        found, step, loss, grad_norm, *read = torch.stack((self.found.double(), *self.first,
                                                          *(v.double() for v in values))).tolist()
        if found:
            raise NonFiniteError(f"step {int(step)}: loss={loss} grad_norm={grad_norm} is not finite", int(step))
        return read


class TrainStep:
    """Takes one optimizer step per call: grad_accum_steps micro-batches (eager, or replays of one
    CUDA graph), the global gradient norm clipped to grad_clip (0: not clipped), the optimizer and
    scheduler steps. `forward` is the model (maybe sharded in place) or its DDP wrapper.

    A step never waits for the GPU when the optimizer is fused AdamW (on CUDA): the loss and norm stay
    on the device, a non-finite one sets the sticky NonFiniteFlag that the optimizer reads as found_inf,
    and only read() (logging, evaluation, checkpoint and last steps) syncs, raising NonFiniteError for
    the first bad step. What such a stop leaves: the parameters and optimizer state of the step before
    the first bad one (no later update was applied), while the host counters (state.step, tokens, the
    scheduler, the data position) have advanced to the step that read the flag; nothing is saved, since
    every checkpoint step reads the flag first. Any other optimizer (foreach AdamW on CPU) syncs every
    step and raises before the bad step changes any weight or counter."""

    def __init__(self, state: TrainState, forward: nn.Module, world: World, device: torch.device,
                 grad_accum_steps: int, grad_clip: float, cuda_graphs: bool = False):
        if not isinstance(state.optimizer, AdamW):  # clipping happens inside its step: any other would skip it
            raise TypeError(f"TrainStep needs coda_train's AdamW (trainer/optim.py build_optimizer), got "
                            f"{type(state.optimizer).__name__}")
        self.state, self.forward, self.world, self.device = state, forward, world, device
        self.grad_accum_steps, self.grad_clip, self.cuda_graphs = grad_accum_steps, grad_clip, cuda_graphs
        self.flag = NonFiniteFlag(device)
        self.deferred = bool(state.optimizer.defaults.get("fused"))  # found_inf exists in the fused path only
        if self.deferred:
            state.optimizer.found_inf = self.flag.found
        self.graphed: Optional[GraphedMicroBatch] = None
        self.params = list(state.model.parameters())

    def __call__(self, poison_loss: bool = False) -> PendingStep:
        """One optimizer step; poison_loss (a test hook) multiplies this step's loss by NaN."""
        state, optimizer = self.state, self.state.optimizer
        lr = optimizer.param_groups[0]["lr"]
        batches = [tuple(self._pinned(t) for t in state.train_loader.next_batch()) for _ in range(self.grad_accum_steps)]
        scale = math.nan if poison_loss else 1.0 / self.grad_accum_steps
        loss_sum = self._graphed(batches, scale) if self.cuda_graphs else self._eager(batches, scale)
        loss = mean_over_ranks(loss_sum, self.world)
        grad_norm = global_grad_norm(self.params)  # the same on every rank: the gradients are already averaged
        optimizer.grad_factor = clip_factor(grad_norm, self.grad_clip)  # applied as the optimizer reads the gradients
        self.flag.record(state.step + 1, loss, grad_norm)
        if not self.deferred:
            self.flag.read()  # raises before any weight or counter changes
        optimizer.step()
        if not self.cuda_graphs:
            optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.step += 1
        tokens = sum(x.numel() for x, _ in batches) * self.world.world_size
        state.tokens += tokens
        return PendingStep(state.step, loss, lr, grad_norm, tokens)

    def read(self, pending: PendingStep) -> StepResult:
        """The step's values on the host (one device sync); raises NonFiniteError if any step so far was non-finite."""
        loss, grad_norm = self.flag.read(pending.loss, pending.grad_norm)
        return StepResult(pending.step, loss, pending.lr, grad_norm, pending.tokens)

    def check(self) -> None:
        """Raise NonFiniteError if any step so far was non-finite (before saving a state)."""
        self.flag.read()

    def _pinned(self, t: Tensor) -> Tensor:
        """t in page-locked memory when training on CUDA: a copy from pageable memory can wait for the GPU."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def _eager(self, batches: list[tuple[Tensor, Tensor]], scale: float) -> Tensor:
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, (inputs, targets) in enumerate(batches):
            # gradients are averaged across ranks once, in the last micro-batch's backward
            with gradient_sync(self.forward, i == len(batches) - 1):
                micro_batch(self.forward, inputs.to(self.device, non_blocking=True),
                            targets.to(self.device, non_blocking=True), scale, loss_sum)
        return loss_sum

    def _graphed(self, batches: list[tuple[Tensor, Tensor]], scale: float) -> Tensor:
        if self.graphed is None:
            self.graphed = GraphedMicroBatch(self.state.model, *batches[0], 1.0 / self.grad_accum_steps,
                                             accumulate=self.grad_accum_steps > 1)
        graphed = self.graphed
        if math.isnan(scale):
            graphed.set_loss_scale(scale)
        for i, (inputs, targets) in enumerate(batches):
            graphed(inputs, targets, first=i == 0)
        if math.isnan(scale):
            graphed.set_loss_scale(1.0 / self.grad_accum_steps)
        return graphed.loss_sum.clone()  # the static buffer is restarted by the next step's first replay


@torch.no_grad()
def evaluate(model: nn.Module, loader: TokenLoader, num_batches: int, device: torch.device, world: World) -> float:
    """Mean loss over num_batches validation batches of every rank."""
    losses = [model(x.to(device), y.to(device)) for x, y in loader.iter_eval(num_batches)]
    return mean_over_ranks(torch.stack(losses).mean(), world).item()
