"""One optimizer step (micro-batches, gradient accumulation, clipping) and the validation loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from coda_train.data import TokenLoader

from .distributed import World, global_grad_norm, gradient_sync, mean_over_ranks
from .state import TrainState


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the state of that step is never applied or saved."""


@dataclass(frozen=True)
class StepResult:
    step: int  # the optimizer step just taken, counted from 1
    loss: float  # mean over the micro-batches and ranks
    lr: float  # the learning rate this step applied
    grad_norm: float  # global, before clipping
    tokens: int  # trained on in this step, all ranks together


def train_step(state: TrainState, forward: nn.Module, world: World, device: torch.device, grad_accum_steps: int,
               grad_clip: float, poison_loss: bool = False) -> StepResult:
    """grad_accum_steps micro-batches, the global gradient norm clipped to grad_clip (0: not clipped),
    then the optimizer and scheduler steps. `forward` is the model (maybe sharded in place) or its DDP
    wrapper; poison_loss (a test hook) multiplies the loss by NaN. Raises NonFiniteError before any weight changes."""
    optimizer = state.optimizer
    lr = optimizer.param_groups[0]["lr"]
    loss_sum = torch.zeros((), device=device)
    tokens = 0
    for micro in range(grad_accum_steps):
        inputs, targets = state.train_loader.next_batch()
        # gradients are averaged across ranks once, in the last micro-batch's backward
        last_micro = micro == grad_accum_steps - 1
        with gradient_sync(forward, last_micro):
            loss = forward(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
            if poison_loss:
                loss = loss * float("nan")
            (loss / grad_accum_steps).backward()
        loss_sum += loss.detach()
        tokens += inputs.numel()
    params = list(state.model.parameters())
    grad_norm = global_grad_norm(params)
    torch.nn.utils.clip_grads_with_norm_(params, grad_clip if grad_clip > 0 else math.inf, grad_norm)
    loss_value = mean_over_ranks(loss_sum, world).item() / grad_accum_steps
    grad_norm_value = grad_norm.item()  # the same on every rank: the gradients are already averaged
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
        raise NonFiniteError(f"step {state.step + 1}: loss={loss_value} grad_norm={grad_norm_value} is not finite")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1
    state.tokens += tokens * world.world_size
    return StepResult(state.step, loss_value, lr, grad_norm_value, tokens * world.world_size)


@torch.no_grad()
def evaluate(model: nn.Module, loader: TokenLoader, num_batches: int, device: torch.device, world: World) -> float:
    """Mean loss over num_batches validation batches of every rank."""
    losses = [model(x.to(device), y.to(device)) for x, y in loader.iter_eval(num_batches)]
    return mean_over_ranks(torch.stack(losses).mean(), world).item()
