"""AdamW over fp32 master weights with weight-decay groups, and the learning-rate schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZERS = ("adamw",)
SCHEDULES = ("cosine", "wsd", "constant")  # lr_multiplier implements each


@dataclass
class OptimConfig:
    name: str = "adamw"  # one of OPTIMIZERS
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # matrices only; norms and embeddings are not decayed
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    schedule: str = "cosine"  # one of SCHEDULES: warmup then cosine decay, warmup-stable-decay, or constant
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps decays linearly to min_lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW (fp32 state, like the fp32 parameters). Weight decay applies to the 2-D projection
    matrices only: norm gains are scales whose decay toward 0 is not regularization, and the
    embedding (also the tied LM head) is a lookup table whose rare tokens decay would erase."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and name != "tok_emb" else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused on GPU (one kernel for all parameters), foreach (few large ops) on CPU
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kind)
    refresh = getattr(model, "refresh_compute_copies", None)
    if refresh is not None:  # fused AdamW updates in place without bumping the version counters it would check
        optimizer.register_step_post_hook(lambda *_: refresh(force=True))
    return optimizer


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Fraction of the peak lr at optimizer step `step` (0-based): linear warmup, then
    cosine to min_lr_ratio at max_steps, or WSD (stable at peak, then a linear decay over the last
    decay_fraction of the run), or constant."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * max_steps))  # wsd
    decay_start = max(cfg.warmup_steps, max_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return 1.0 - (1.0 - floor) * progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, max_steps))


def apply_config_after_resume(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                              cfg: OptimConfig) -> None:
    """Loading a checkpoint restores the saved lr, betas, eps and weight decay; the run's config wins,
    so resuming with e.g. a lower optim.lr takes effect (unchanged values give the same floats)."""
    decay_group, _ = optimizer.param_groups  # the order build_optimizer makes
    decay_group["weight_decay"] = cfg.weight_decay
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(betas=tuple(cfg.betas), eps=cfg.eps, lr=cfg.lr * lr_lambda(scheduler.last_epoch))
