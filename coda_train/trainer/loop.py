"""The training loop: set up (every check before the first step), resume, train, evaluate, checkpoint, stop."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel

import coda_train.kernels as K
from coda_train.config import Config, check_config, resolve_model_config
from coda_train.data import TokenLoader, prepare
from coda_train.model import ConfigError, LlamaConfig, build_model, kernel_shape_errors
from coda_train.model.liger import require_liger

from .checkpoint import (CheckpointError, list_checkpoints, load_state, newest_good_checkpoint, rng_state, save_checkpoint,
                         set_rng_state, verify_checkpoint)
from .distributed import World, any_rank, barrier, close_world, from_main, init_world, mean_over_ranks
from .metrics import METRICS_FILE, MetricsLogger, format_line, rewind_metrics
from .optim import apply_config_after_resume, build_optimizer, build_scheduler

log = logging.getLogger(__name__)

# Exit codes of train.py (0: finished, or stopped by SIGTERM/SIGINT after saving a checkpoint).
EXIT_BAD_INPUT = 1
EXIT_NON_FINITE = 3


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the state of that step is never saved."""


class StopSignal:
    """Turns the first SIGTERM/SIGINT into a request to checkpoint and stop after the current step;
    a second one gets the default behaviour (immediate exit)."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, self._previous[signum])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 compute on GPU (both models, so their curves compare), fp32 on CPU; params stay fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def find_resume_checkpoint(resume: str, ckpt_root: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """(checkpoint dir, meta) to continue from, per trainer.resume: auto | never | a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = newest_good_checkpoint(ckpt_root)
        if found is None and list_checkpoints(ckpt_root):  # never silently restart a run whose progress is damaged
            raise CheckpointError(f"every checkpoint in {ckpt_root} is damaged (see the warnings above); point "
                                  "trainer.resume at a good checkpoint elsewhere, or start over in a new trainer.run_dir")
        return found
    path = Path(resume)
    if (path / "meta.json").exists() or (path / "state.pt").exists():  # one checkpoint: it must be good
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; choose another checkpoint for trainer.resume (or trainer.resume=auto "
                                  "to take the newest good one of this run)") from e
    for root in (path / "checkpoints", path):  # a run dir or its checkpoints dir: newest good one
        if list_checkpoints(root):
            found = newest_good_checkpoint(root)
            if found is None:
                raise CheckpointError(f"trainer.resume={resume}: no checkpoint there is intact; "
                                      "point trainer.resume at another checkpoint or use trainer.resume=never")
            return found
    raise CheckpointError(f"trainer.resume={resume} is not a checkpoint, a checkpoints dir or a run dir with "
                          "checkpoints; pass an existing path, or auto / never")


# fields free to change on resume: init_std only matters at init, max_seq_len only bounds seq_len
RESUME_MAY_CHANGE = {"init_std", "max_seq_len"}


def check_same_model(ckpt: Path, saved: dict[str, Any], model: LlamaConfig) -> None:
    mine = dataclasses.asdict(model)
    diffs = {k: (saved.get(k), v) for k, v in mine.items() if k not in RESUME_MAY_CHANGE and saved.get(k) != v}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in diffs.items())
        raise CheckpointError(f"checkpoint {ckpt} holds a different model shape ({detail}). Run with the "
                              "checkpoint's model settings to continue it, or choose a new trainer.run_dir "
                              "(or trainer.resume=never in an empty dir) to start fresh; nothing was deleted")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TokenLoader, num_batches: int, device: torch.device, world: World) -> float:
    losses = [model(x.to(device), y.to(device)) for x, y in loader.iter_eval(num_batches)]
    return mean_over_ranks(torch.stack(losses).mean(), world).item()


def train(cfg: Config, run_dir: Path) -> Optional[dict[str, Any]]:
    """Train per cfg, writing into run_dir; returns the last metrics line (None if nothing ran).
    Under torchrun every rank calls this; rank 0's run_dir is used and only rank 0 writes."""
    check_config(cfg)
    backend = K.resolve_backend(cfg.kernels.backend)  # BackendError (e.g. cute without Hopper) before anything else
    device = pick_device(cfg.trainer.device)
    if cfg.model.impl == "liger":
        require_liger(device)
    world = init_world(device.type)
    try:
        result = _train(cfg, from_main(run_dir, world), backend, device, world)
        barrier(world)  # every rank done (rank 0's last checkpoint too) before gloo/NCCL tear down
        return result
    finally:
        close_world(world)


def _train(cfg: Config, run_dir: Path, backend: str, device: torch.device, world: World) -> Optional[dict[str, Any]]:
    t, o = cfg.trainer, cfg.optim
    if world.distributed and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    compute_dtype = pick_compute_dtype(t.compute_dtype, device)
    if backend == "cute" and cfg.model.impl == "coda" and compute_dtype != torch.bfloat16:
        raise ConfigError(f"kernels.backend={cfg.kernels.backend} runs the cute kernels, which compute in bfloat16 only, "
                          f"but trainer.compute_dtype={t.compute_dtype} gives {compute_dtype}; use "
                          "trainer.compute_dtype=bfloat16 (or auto), or kernels.backend=reference")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = run_dir / "checkpoints"
    if t.resume == "never" and (list_checkpoints(ckpt_root) or (run_dir / METRICS_FILE).exists()):
        raise CheckpointError(f"trainer.run_dir={run_dir} already holds a run and trainer.resume=never would mix "
                              "a new one into it; choose a new trainer.run_dir or use trainer.resume=auto")

    resume_from = find_resume_checkpoint(t.resume, ckpt_root)  # before data preparation, which can be long
    if not world.is_main:  # rank 0 prepares (or finds) the data first; the others then open it
        barrier(world)
    data = prepare(cfg.data)
    if world.is_main:
        barrier(world)
    llama = resolve_model_config(cfg.model, data.vocab_size, t.seq_len)
    if backend == "cute" and cfg.model.impl == "coda":  # the kernels' shape limits, before any GPU work
        if errors := kernel_shape_errors(llama, backend):
            raise ConfigError("kernels.backend=cute cannot run this model: " + "; ".join(errors))
    if resume_from is not None:
        check_same_model(resume_from[0], resume_from[1]["model"], llama)

    # seeded init on CPU, so both impls and every device start from the same weights
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    model = build_model(llama, cfg.model.impl, backend=backend, compute_dtype=compute_dtype).to(device)
    optimizer = build_optimizer(model, o, device)
    scheduler = build_scheduler(optimizer, o, t.max_steps)
    train_loader = TokenLoader(data, "train", t.batch_size, t.seq_len, t.seed, world.rank, world.world_size)
    val_loader = TokenLoader(data, "val", t.batch_size, t.seq_len, t.seed, world.rank, world.world_size) if t.eval_every else None

    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if resume_from is not None:
        state = load_state(resume_from[0])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        apply_config_after_resume(optimizer, scheduler, o)
        train_loader.load_state_dict(state["train_loader"])  # the same on every rank: each takes its own windows
        set_rng_state(state["rng"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        log.info("resumed from %s (step %d)", resume_from[0], step)
    # DDP averages gradients across ranks during backward; its wrapper only runs forward
    forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) if world.distributed else model

    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    config_dict["trainer"]["run_dir"] = str(run_dir)  # this job's dir (a multirun gives each job its own)
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum_steps * world.world_size
    flops_per_token = llama.flops_per_token(t.seq_len)
    metrics_logger = None
    if world.is_main:
        rewind_metrics(run_dir / METRICS_FILE, step)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml({**config_dict, "resolved_model": dataclasses.asdict(llama)}))
        metrics_logger = MetricsLogger(run_dir, cfg.logger, config_dict, resumed=resume_from is not None)
        log.info("model %s (%s, %.2fM params, vocab %d) | kernels %s | %s %s x%d | %d tokens/step | run dir %s",
                 cfg.model.preset, cfg.model.impl, sum(p.numel() for p in model.parameters()) / 1e6, llama.vocab_size,
                 backend, device.type, str(compute_dtype).removeprefix("torch."), world.world_size, tokens_per_step, run_dir)

    def checkpoint(at_step: int) -> Optional[Path]:
        if not world.is_main:  # ranks hold identical weights, optimizer and loader state
            return None
        if resume_from is not None and at_step == resume_from[1]["step"]:  # nothing trained since: it is saved
            return resume_from[0]
        crash = None
        if cfg.debug.sigkill_in_checkpoint_at_step == at_step:
            crash = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731 (test hook: die mid-write)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "train_loader": train_loader.state_dict(), "rng": rng_state(), "step": at_step,
                 "tokens": tokens_seen, "elapsed_s": elapsed_before + time.perf_counter() - started}
        meta = {"model": dataclasses.asdict(llama), "impl": cfg.model.impl, "config": config_dict}
        return save_checkpoint(ckpt_root, at_step, state, meta, t.keep_last, before_meta=crash)

    bar = None
    if world.is_main and t.progress_bar and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=t.max_steps, initial=step, unit="step", dynamic_ncols=True)
    stop = StopSignal()
    started = time.perf_counter()
    window_start, window_tokens = started, 0
    last: Optional[dict[str, Any]] = None
    exit_code = 0
    try:
        if step >= t.max_steps:
            log.info("nothing to do: the checkpoint is at step %d and trainer.max_steps=%d", step, t.max_steps)
        while step < t.max_steps and not any_rank(stop.received is not None, world, device):
            lr = optimizer.param_groups[0]["lr"]
            loss_sum = torch.zeros((), device=device)
            for micro in range(t.grad_accum_steps):
                inputs, targets = train_loader.next_batch()
                # gradients are averaged across ranks once, in the last micro-batch's backward
                sync = contextlib.nullcontext() if micro == t.grad_accum_steps - 1 or not world.distributed else forward.no_sync()
                with sync:
                    loss = forward(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
                    if cfg.debug.nan_loss_at_step == step + 1:
                        loss = loss * float("nan")
                    (loss / t.grad_accum_steps).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else math.inf)
            loss_value = mean_over_ranks(loss_sum, world).item() / t.grad_accum_steps
            grad_norm_value = grad_norm.item()  # the same on every rank: the gradients are already averaged
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
                exit_code = EXIT_NON_FINITE
                raise NonFiniteError(
                    f"step {step + 1}: loss={loss_value} grad_norm={grad_norm_value} is not finite; stopped without "
                    f"applying or saving this step (newest checkpoint: {next(iter(list_checkpoints(ckpt_root)), 'none')}). "
                    "Resume from it with a lower optim.lr, longer optim.warmup_steps or a tighter optim.grad_clip")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step

            is_last = step == t.max_steps
            should_eval = val_loader is not None and (step % t.eval_every == 0 or is_last)
            if step == 1 or step % t.log_every == 0 or is_last or should_eval:
                now = time.perf_counter()
                last = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm_value, "tokens": tokens_seen,
                        "tokens_per_s": window_tokens / (now - window_start), "elapsed_s": elapsed_before + now - started}
                if device.type == "cuda":
                    last["mfu"] = flops_per_token * last["tokens_per_s"] / (t.peak_flops * world.world_size)
                if should_eval:
                    last["val_loss"] = evaluate(model, val_loader, t.eval_batches, device, world)
                if metrics_logger is not None:
                    metrics_logger.log(last)
                if bar is not None:
                    bar.set_postfix_str(format_line(last), refresh=False)
                elif world.is_main:
                    log.info(format_line(last))
                window_start, window_tokens = time.perf_counter(), 0
            if bar is not None:
                bar.update(1)
            if (t.ckpt_every and step % t.ckpt_every == 0) or is_last:
                checkpoint(step)
            if cfg.debug.sigkill_after_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
        if step < t.max_steps:  # a rank received SIGTERM/SIGINT
            path = checkpoint(step)
            if world.is_main:
                log.info("received %s: saved %s and stopped; run again with the same trainer.run_dir to continue",
                         signal.Signals(stop.received).name if stop.received else "a stop signal", path)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        if metrics_logger is not None:
            metrics_logger.close(exit_code)
    return last
