"""AdamW over fp32 master weights with weight-decay groups, and the learning-rate schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from coda_train.kernels.adamw import adamw_update

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


class AdamW(torch.optim.AdamW):
    """torch's AdamW (hyperparameters, state, state_dict, found_inf) plus what a training step adds
    around it: `grad_factor`, a 0-dim device tensor that every gradient is multiplied by (the clip
    factor, set before each step, so no step waits for the norm on the host), and the model's
    compute copies kept equal to the weights. fused=True (build_optimizer's choice on CUDA): one
    pass per parameter group does both (kernels/adamw.py; on CPU its plain-torch reference); the
    gradients are read and left unclipped, and the copies are written from the updated weights.
    foreach (build_optimizer's choice on CPU): the gradients are multiplied in place and torch's
    foreach AdamW steps; it bumps the weights' version counters, so the next forward's
    refresh_compute_copies rewrites the copies."""

    UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")

    def __init__(self, params, model: nn.Module, **kwargs):
        super().__init__(params, **kwargs)
        self._step_supports_amp_scaling = False  # the pass applies no grad_scale: a GradScaler must unscale first
        self.model = model
        if hasattr(model, "weight_updates_tracked"):  # this step writes the copies (fused) or bumps the versions (foreach)
            model.weight_updates_tracked = True
        self.grad_factor: Optional[torch.Tensor] = None
        self._check_groups()

    def _check_groups(self) -> None:
        for group in self.param_groups:
            if any(group[k] for k in self.UNSUPPORTED):
                raise ValueError(f"coda_train's AdamW supports none of {list(self.UNSUPPORTED)}; "
                                 f"a parameter group sets {[k for k in self.UNSUPPORTED if group[k]]}")
        if len({bool(group["fused"]) for group in self.param_groups}) > 1:
            raise ValueError("coda_train's AdamW steps every parameter group one way: fused=True for all or none")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, but how to step stays this machine's (build_optimizer's fused/foreach): a checkpoint's groups
        carry the flags of the device that saved it, and a CPU-written foreach group would take the fused
        path's found_inf into torch's foreach AdamW on a GPU."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["fused"], group["foreach"] = self.defaults["fused"], self.defaults["foreach"]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("coda_train's AdamW takes no closure")
        self._check_groups()  # groups can be added or edited after construction
        if not self.param_groups[0]["fused"]:
            if self.grad_factor is not None:
                grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
                torch._foreach_mul_(grads, self.grad_factor)
            return super().step()
        compute_copies = getattr(self.model, "compute_copies", None)
        copies = compute_copies() if compute_copies is not None else {}
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            beta1, beta2 = group["betas"]
            adamw_update([_local(p) for p in params], [_local(g) for g in grads], [_local(m) for m in exp_avgs],
                         [_local(v) for v in exp_avg_sqs], steps, [copies.get(id(p)) for p in params],
                         lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], grad_factor=self.grad_factor,
                         found_inf=getattr(self, "found_inf", None))
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters, gradients and moments); t itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_factor(grad_norm: torch.Tensor, max_norm: float) -> Optional[torch.Tensor]:
    """The factor clip_grads_with_norm_ multiplies the gradients by (min(1, max_norm / (norm + 1e-6)),
    on the device); None when max_norm is 0 (no clipping)."""
    if max_norm <= 0:
        return None
    return (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> AdamW:
    """AdamW (fp32 state, like the fp32 parameters). Weight decay applies to the 2-D projection
    matrices only: norm gains are scales whose decay toward 0 is not regularization, and the
    embedding (also the tied LM head) is a lookup table whose rare tokens decay would erase."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and name != "tok_emb" else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # one pass per group on GPU (kernels/adamw.py), foreach (few large ops) on CPU
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return AdamW(groups, model, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kind)


def wsd_decay_steps(cfg: OptimConfig, max_steps: int) -> int:
    """The steps WSD lays its decay over: the last decay_fraction of max_steps (fewer where warmup ends later)."""
    return max(1, round(cfg.decay_fraction * max_steps))


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
        # counted from step + 1, as warmup is: the run's last step (max_steps - 1) applies min_lr
        progress = min(1.0, (step + 1 - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = max(cfg.warmup_steps, max_steps - wsd_decay_steps(cfg, max_steps))
    if step < decay_start:
        return 1.0
    # counted from step + 1, as warmup is: the run's last step (max_steps - 1) applies min_lr, and a 1-step decay decays
    progress = min(1.0, (step + 1 - decay_start) / max(1, max_steps - decay_start))
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
