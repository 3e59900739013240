"""The training loop: set up (every check before the first step), resume, train, evaluate, checkpoint, stop."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from coda_train.config import Config, check_config
from coda_train.data import CacheWriteError, DataError, PreparationInterrupted, TokenLoader, prepare
from coda_train.data.tokenizer import LoadedTokenizer
from coda_train.durable import LockHeldError, replace_synced
from coda_train.errors import ConfigError
from coda_train.kernels import resolve_backend
from coda_train.kernels.tile_configs import gpu_key
from coda_train.model import LlamaConfig
from coda_train.model.liger import require_liger

from .build import (backend_on_device, build_loader, build_train_state, check_compute,
                    check_missing_tokenizer_is_the_runs, check_model_before_data, check_resume_before_data,
                    check_state_fits, checkpoint_data, data_config, init_from_missing, init_from_shape,
                    recorded_init_from, report_untuned_gemms, resolve_model, resumed_runs_prepared_data,
                    tokenizer_missing, tune_untuned_gemms, vocab_settings)
from .checkpoint import (CHECKPOINTS_DIR, CheckpointError, Checkpointer, check_ckpt_async, check_same_model,
                         find_resume_checkpoint, list_checkpoints, restore, resumes, resumes_newest_good, set_aside_newer)
from .device import pick_compute_dtype, pick_device
from .distributed import (World, any_rank, barrier, check_fsdp_options, close_world, data_parallel, from_main, init_world,
                          process_device, raise_from_main, refused_on_any_rank, resolve_parallel)
from .graphs import use_cuda_graphs
from .metrics import METRICS_FILE, MetricsLogger, Throughput, check_logger, metrics_line, mfu, rewind_metrics
from .optim import OptimConfig, apply_config_after_resume, lr_multiplier, wsd_decay_steps
from .rundir import (CONFIG_FILE, EarlyWarnings, RunDirError, continue_hint, hold_run_dir, log_in_run_dir,
                     read_run_config, writing)
from .state import TrainState
from .step import NonFiniteError, TrainStep, evaluate

log = logging.getLogger(__name__)

# Exit codes of train.py (0: finished, or stopped by SIGTERM/SIGINT: after saving a checkpoint, or during data preparation).
EXIT_BAD_INPUT = 1  # config, data, backend, checkpoint, or the run dir in use by another run
EXIT_NON_FINITE = 3
EXIT_RUN_DIR = 4  # a write failed, the run dir's or data.cache_dir's (disk full, read-only, permissions); nothing lost
# the errors a run stops on with a message (and one of the codes above); anything else is a bug
STOP_ERRORS = (ConfigError, DataError, CheckpointError, LockHeldError, RunDirError, NonFiniteError)


def exit_code(error: Exception) -> int:
    """train.py's exit code for one of STOP_ERRORS."""
    if isinstance(error, PreparationInterrupted):  # a stop by SIGTERM/SIGINT, not bad input: 0, as after a step
        return 0
    if isinstance(error, NonFiniteError):
        return EXIT_NON_FINITE
    return EXIT_RUN_DIR if isinstance(error, (RunDirError, CacheWriteError)) else EXIT_BAD_INPUT


# what a resumed run may change and is told about: the model's shape is checked against the checkpoint instead
_RESUME_ANNOUNCED = ("optim", "trainer", "kernels", "model.impl")
# settings that differ between a checkpoint and the run that resumes it without affecting the trajectory
_RESUME_IGNORED = {"trainer.run_dir", "trainer.resume", "trainer.progress_bar"}
# settings announced when changed that decide only what is logged, evaluated and saved, not the steps (evaluation
# reads no training state): a resumed run that changes only these redoes the same steps
_SAME_STEPS = {"trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "trainer.ckpt_every", "trainer.keep_last",
               "trainer.ckpt_async", "trainer.peak_flops"}


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{group}.{k}": v for group, values in config.items() if isinstance(values, dict) for k, v in values.items()}


def _announced_settings(config: dict[str, Any]) -> dict[str, Any]:
    flat = _flat(config)
    return {k: v for name in _RESUME_ANNOUNCED for k, v in flat.items() if k == name or k.startswith(f"{name}.")}


def _parallel_as_resolved(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """`before`, a run's flat config, with a recorded trainer.parallel=auto (runs recorded before the resolved mode was)
    read as `now`'s: auto resolves by the process count, and another count shows in batch_size or grad_accum_steps."""
    return {**before, "trainer.parallel": now["trainer.parallel"]} if before.get("trainer.parallel") == "auto" else before


def _changed_settings(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """The optim.*, trainer.*, kernels.* and model.impl values of cfg that differ from `saved` (a run's config)."""
    now = _announced_settings(OmegaConf.to_container(OmegaConf.structured(cfg)))
    before = _parallel_as_resolved(_announced_settings(saved), now)
    return {k: (before[k], v) for k, v in now.items() if k in before and before[k] != v and k not in _RESUME_IGNORED}


def recorded_config(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """cfg as the run's config.yaml and its checkpoints' meta.json record it: trainer.run_dir this job's dir (a multirun
    gives each job its own), local paths absolute so the tools that reopen the run's data find it from any directory."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg))
    config["trainer"]["run_dir"] = str(run_dir)
    config["data"] = dataclasses.asdict(cfg.data.with_absolute_paths())
    config["model"]["init_from"] = recorded_init_from(cfg)
    return config


# settings that change neither the model, the data's tokens nor the steps: not "other settings" for the metrics kept
SAME_TRAJECTORY = _RESUME_IGNORED | _SAME_STEPS | {"data.cache_dir", "data.num_proc", "data.verify_shards", "kernels.tune"}


def logged_under_other_settings(run_dir: Path, config: dict[str, Any]) -> bool:
    """Whether the run that last wrote run_dir's metrics took other steps than this one's `config` (recorded_config),
    by its settings (its config.yaml, written at every start; unreadable or not a run's counts as other): any model,
    data, optim, trainer or kernels value that shapes the steps, so the lines a resumed or restarted run redoes are then
    another trajectory's."""
    previous = read_run_config(run_dir / CONFIG_FILE)
    if previous is None:
        return True
    now = _flat(config)
    before = _parallel_as_resolved(_flat(previous), now)
    return any(k in before and before[k] != v for k, v in now.items()
               if k not in SAME_TRAJECTORY and not k.startswith(("logger.", "debug.")))


# the settings the learning rate of a step follows from (lr_multiplier)
_SCHEDULE_SETTINGS = ("trainer.max_steps", "optim.lr", "optim.schedule", "optim.warmup_steps", "optim.min_lr_ratio",
                      "optim.decay_fraction")
_SCHEDULE_OPTIM = tuple(k.removeprefix("optim.") for k in _SCHEDULE_SETTINGS if k.startswith("optim."))


def changes_since_checkpoint(saved: dict[str, Any], cfg: Config, step: int) -> list[str]:
    """What the resumed run does differently from the run that saved the checkpoint at `step` (its config), as log
    lines: the optim.*, trainer.*, kernels.* and model.impl values that changed, and where a changed schedule parts
    (another global batch is the loader's to say: its state holds the saved layout, TokenLoader.load_state_dict)."""
    changed = _changed_settings(saved, cfg)
    if not changed:
        return []
    settings = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
    lines = [f"settings changed since the checkpoint apply from step {step + 1} on: {settings}"]
    shaping = [k for k in _SCHEDULE_SETTINGS if k in changed]
    if shaping:
        # the lr of each resumed step under the saved run's schedule (its optim values and max_steps) and under this
        # run's: the first step where the two part, which may lie past the first (a resume inside warmup, or in WSD's
        # stable phase); only steps this run takes
        new_max = cfg.trainer.max_steps
        old_max = saved.get("trainer", {}).get("max_steps", new_max)
        saved_optim = OptimConfig(**{k: saved.get("optim", {}).get(k, getattr(cfg.optim, k)) for k in _SCHEDULE_OPTIM})
        # past the saved run's end (a finished run extended), the rate its last step applied
        lrs = ((s, saved_optim.lr * lr_multiplier(min(s, old_max - 1), saved_optim, old_max),
                cfg.optim.lr * lr_multiplier(s, cfg.optim, new_max)) for s in range(step, new_max))
        # to rounding: a rate given as printed below (0.0003 for 3e-3 x 0.1) is the saved one
        parted = next(((s, old_lr, new_lr) for s, old_lr, new_lr in lrs if not math.isclose(old_lr, new_lr, rel_tol=1e-9)),
                      None)
        if parted is not None:
            s, old_lr, new_lr = parted
            spans = (f"the {cfg.optim.schedule} schedule now spans {new_max} steps, not {old_max}: "
                     if "trainer.max_steps" in changed else "")
            where = (f"the learning rate at step {s + 1} is" if s == step else
                     f"the learning rate follows the saved run's until step {s}, and at step {s + 1} it is")
            if step >= old_max:  # keeping the saved max_steps would take no step: name the settings that go on as it ended
                lines.append(f"{spans}{where} {new_lr:.3g} where the saved run ended its schedule at step {old_max}, its "
                             f"last step applying {old_lr:.3g}; to train on at that rate, set optim.schedule=constant "
                             f"optim.warmup_steps=0 optim.lr={old_lr:.12g}")
            else:
                keep = " ".join(f"{k}={changed[k][0]}" for k in shaping)
                lines.append(f"{spans}{where} {new_lr:.3g} where the saved run's would be {old_lr:.3g}; keep {keep} "
                             "to continue its schedule")
    return lines


class StopSignal:
    """Turns the first SIGTERM/SIGINT into a request to checkpoint and stop after the current step;
    a second SIGINT (Ctrl-C again) gets the default behaviour (immediate exit), except while a checkpoint is written
    (saving): it is said and deferred, so the stop's checkpoint is written whole. A repeated SIGTERM is the same
    request: under torchrun a worker gets both the scheduler's (Slurm, systemd signal every process) and torchrun's."""

    def __init__(self):
        self.received: Optional[int] = None
        self._saving: Optional[int] = None  # the step whose checkpoint is being written
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        if self._saving is not None and self.received is not None:  # a KeyboardInterrupt would drop the checkpoint
            if signum == signal.SIGINT:
                log.warning("Ctrl-C again: the checkpoint of step %d is being written and the run stops once it is "
                            "complete (kill -9 %d stops at once, without it)", self._saving, os.getpid())
            return
        if self.received is None:
            self.received = signum
        if signum == signal.SIGINT and self._saving is None:
            signal.signal(signum, self._previous[signum])

    @contextlib.contextmanager
    def saving(self, step: int):
        """Inside, a Ctrl-C after the stop request waits for the checkpoint of `step` (said in one line)."""
        self._saving = step
        at_entry = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            self._saving = None
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT] if self.received == signal.SIGINT else at_entry)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a train() call ended: its last metrics line (None if nothing was logged) and, when a
    SIGTERM/SIGINT stopped it (after saving a checkpoint; also one received during the last step, so that a
    multirun sweep stops before its next job), that signal's name."""
    metrics: Optional[dict[str, Any]]
    stopped_by: Optional[str] = None


def train(cfg: Config, run_dir: Path, sweep_dir: Optional[Path] = None, early: Optional[EarlyWarnings] = None) -> RunEnd:
    """Train per cfg, writing into run_dir; returns how the run ended (RunEnd). sweep_dir: the multirun sweep this
    run is a job of (its stop messages then say to run the sweep again, which continues every job's own dir).
    Under torchrun every rank calls this; rank 0's run_dir is used and only rank 0 writes (holding
    its lock). A STOP_ERRORS error is logged (console, and train.log once the dir is held), then raised. early: the
    caller's collector of the warnings it logged before (train.py's); the warnings before the run dir is held are
    written into train.log as it is opened."""
    world: Optional[World] = None
    holding = False  # the run dir is held (its train.log exists): where a stop on any rank is logged
    with contextlib.ExitStack() as held:  # process group and run dir, released after the stop reason is logged
        if early is None:
            early = held.enter_context(EarlyWarnings().attached())
        try:
            check_config(cfg)
            check_logger(cfg.logger)
            backend = resolve_backend(cfg.kernels.backend)  # BackendError (e.g. cute without Hopper) before anything else
            device = pick_device(cfg.trainer.device)
            backend = backend_on_device(cfg, backend, device.type)  # auto: reference on the CPU
            if cfg.model.impl == "liger":
                require_liger(device)
            compute_dtype = pick_compute_dtype(cfg.trainer.compute_dtype, device)
            check_compute(cfg, backend, compute_dtype)
            # a resumed run takes its weights from its checkpoint (and its shape where model.init_from is gone):
            # model.init_from's are checked for a new run only
            llama, tokenizer = check_model_before_data(cfg, backend, resumes(cfg.trainer.resume, run_dir))
            world = init_world(device.type)
            held.callback(close_world, world)
            parallel = resolve_parallel(cfg.trainer.parallel, world)
            check_fsdp_options(parallel, cfg.trainer.fsdp_reshard_after_forward)
            check_ckpt_async(cfg.trainer.ckpt_async, parallel)
            if llama is not None:  # else its shape is its checkpoint's: checked once that is found (_train)
                refused_on_any_rank(lambda: check_state_fits(cfg, llama, process_device(device, world), compute_dtype,
                                                             world.world_size, parallel), world)
            cuda_graphs = use_cuda_graphs(cfg.trainer.cuda_graphs, cfg.model.impl, device, parallel)
            own_dir, run_dir = run_dir, from_main(run_dir, world)
            if own_dir != run_dir and own_dir.is_dir() and not any(own_dir.iterdir()):
                own_dir.rmdir()  # the dir hydra timed for this rank alone, unused: rank 0's is the run's
            held.enter_context(hold_run_dir(run_dir, world, early))  # before anything reads or writes the run dir
            early.detach()  # in train.log now (rank 0); no rank keeps collecting
            holding = True
            result = _train(cfg, run_dir, backend, process_device(device, world), compute_dtype, world, parallel,
                            cuda_graphs, sweep_dir, tokenizer)
            barrier(world)  # every rank done (rank 0's last checkpoint too) before gloo/NCCL tear down
            return result
        except STOP_ERRORS as e:
            log.error("%s", e)
            if holding and not world.is_main:
                log_in_run_dir(run_dir, f"rank {world.rank} stopped: {e}")
            raise
        except Exception as e:
            if holding and world.distributed:  # most likely a collective that another rank's stop cut short
                message = (f"rank {world.rank} stopped on {type(e).__name__}: {e} (in a multi-process run most "
                           "likely because another rank stopped first: its reason is in train.log or on its console)")
                if world.is_main:
                    log.error("%s", message)
                else:
                    log_in_run_dir(run_dir, message)
            raise


def _train(cfg: Config, run_dir: Path, backend: str, device: torch.device, compute_dtype: torch.dtype,
           world: World, parallel: str, cuda_graphs: bool, sweep_dir: Optional[Path],
           tokenizer: Optional[LoadedTokenizer]) -> Optional[dict[str, Any]]:
    # tokenizer: the data's as check_model_before_data read it (None where it read none): the file is read once
    # trainer.parallel as it resolved (fsdp, ddp or none), as config.yaml and meta.json record it: a resume that names
    # the same mode otherwise (auto) is the same run, not changed settings whose metrics lines are set aside
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, parallel=parallel))
    t = cfg.trainer
    o, decay_steps = cfg.optim, wsd_decay_steps(cfg.optim, t.max_steps)
    if o.warmup_steps >= t.max_steps and world.is_main:  # allowed (a short test run), but likely a slip
        log.warning("optim.warmup_steps=%d >= trainer.max_steps=%d: the whole run warms up, the learning rate rising "
                    "to %g at its last step (optim.lr=%g), and never decays", o.warmup_steps, t.max_steps,
                    o.lr * lr_multiplier(t.max_steps - 1, o, t.max_steps), o.lr)
    elif o.schedule == "wsd" and o.warmup_steps > t.max_steps - decay_steps and world.is_main:  # as likely a slip
        log.warning("optim.warmup_steps=%d overlaps the wsd decay over the last %d of trainer.max_steps=%d steps "
                    "(optim.decay_fraction=%g): the decay starts when warmup ends and takes %d step(s); lower "
                    "optim.warmup_steps or optim.decay_fraction", o.warmup_steps, decay_steps, t.max_steps,
                    o.decay_fraction, t.max_steps - o.warmup_steps)
    # before data preparation, which can be long; rank 0 verifies and names the damaged ones skipped
    resume_from = find_resume_checkpoint(t.resume, run_dir, world)
    # model.init_from moved or deleted since the run began (an HF cache cleaned): its checkpoint records the shape,
    # checked here before the data as train()'s early check does for any other run
    shape = init_from_shape(cfg, resume_from) if resume_from is not None and init_from_missing(cfg) else None
    # data.tokenizer moved or deleted since the run began: the run's prepared folder holds a copy of it, as of init_from's
    tokenizer_gone = resume_from is not None and tokenizer_missing(cfg)
    if tokenizer_gone:
        check_missing_tokenizer_is_the_runs(cfg, resume_from)
    data_from_checkpoint = (shape is not None and cfg.data.tokenizer is None) or tokenizer_gone  # its tokenizer is gone
    if shape is not None:
        llama, tokenizer = check_model_before_data(cfg, backend, resuming=True, init_from_shape=shape)
        refused_on_any_rank(lambda: check_state_fits(cfg, llama, device, compute_dtype, world.world_size, parallel), world)
        if world.is_main:
            log.warning("model.init_from=%s holds no config.json any more: this resumed run takes the model's shape%s "
                        "from its checkpoint %s", cfg.model.init_from,
                        " and its prepared data" if data_from_checkpoint else "", resume_from.path)
    # what the checkpoint would refuse once the data is prepared, refused before (checkpoint_data compares its own)
    if resume_from is not None and not data_from_checkpoint:
        check_resume_before_data(cfg, resume_from, world.world_size, shape, tokenizer)
    # every rank, no collective around it: the cache folder's lock lets one process prepare while the others wait
    # as long as it takes (a barrier would time out under NCCL after 10 minutes; a first preparation can take longer)
    if data_from_checkpoint:
        data = checkpoint_data(resume_from, cfg)
        if tokenizer_gone and world.is_main:
            log.warning("data.tokenizer=%s does not exist any more: this resumed run continues on the data it prepared "
                        "with it, %s, which holds a copy of it", cfg.data.tokenizer, data.path)
    else:  # a resumed run whose corpus changed continues on the data it prepared
        prepared = resumed_runs_prepared_data(resume_from, data_config(cfg), world) if resume_from is not None else None
        data = prepared or prepare(data_config(cfg), log_notes=world.is_main, tokenizer=tokenizer)
    # both loaders before the model: a split too small for one batch stops the run before any GPU work
    train_loader = build_loader(data, "train", t, world)
    val_loader = build_loader(data, "val", t, world) if t.eval_every else None
    llama = resolve_model(cfg, data.vocab_size, backend, shape)
    if resume_from is not None:
        check_same_model(resume_from, llama, recorded_init_from(cfg), vocab_settings(cfg))
    if cfg.model.impl == "coda" and backend == "cute" and cfg.kernels.tune == "once":  # before the model takes GPU memory
        tune_untuned_gemms(llama, t, gpu_key(torch.cuda.get_device_name(device)), world)

    state = build_train_state(cfg, llama, train_loader, backend, device, compute_dtype, world, init_weights=resume_from is None,
                              parallel=parallel)
    if resume_from is not None:
        restore(state, resume_from)
        apply_config_after_resume(state.optimizer, state.scheduler, cfg.optim)
        if world.is_main:  # once, not once per rank
            log.info("resumed from %s (step %d)", resume_from.path, state.step)
            for line in changes_since_checkpoint(resume_from.meta.get("config", {}), cfg, state.step):
                log.warning("%s", line)
    config = recorded_config(cfg, run_dir)
    # the folder itself too: the tools reopen it also after the corpus has moved or changed
    meta = {"model": dataclasses.asdict(llama), "impl": cfg.model.impl, "config": config,
            "prepared_data": str(data.path.absolute()),
            "processes": world.world_size,  # the global batch is the config's batch_size x grad_accum_steps x this
            "tokenizer": data.manifest["tokenizer"]["fingerprint"]}  # eval/sample/export check --tokenizer by it early
    checkpointer = Checkpointer(run_dir / CHECKPOINTS_DIR, t.keep_last, meta, resume_from,
                                cfg.debug.sigkill_in_checkpoint_at_step, cfg.debug.disk_full_in_checkpoint_at_step,
                                t.ckpt_async)
    metrics_logger, error = None, None
    if world.is_main:  # the first writes, after every check
        try:
            with writing("the run's config.yaml and metrics.jsonl", run_dir, run_dir):
                if state.step < t.max_steps:  # else nothing to do: the files stay as the run that took the steps left them
                    if resume_from is not None:
                        set_aside_newer(checkpointer.root, resume_from.step, damaged=resumes_newest_good(t.resume))
                    # the lines after the checkpoint (all of them without one, or from another run's checkpoint, whose
                    # steps before it were logged elsewhere) are redone; where they are another trajectory's (an explicitly
                    # named checkpoint, or settings changed since the run that logged them, e.g. a lower lr after a
                    # divergence) they are kept aside
                    own = resume_from is None or (run_dir / CHECKPOINTS_DIR).resolve() in resume_from.path.resolve().parents
                    rewind_metrics(run_dir / METRICS_FILE, state.step if own else 0, keep_dropped=(
                        resume_from is not None and not resumes_newest_good(t.resume))
                        or logged_under_other_settings(run_dir, config))
                    replace_synced(run_dir / CONFIG_FILE, OmegaConf.to_yaml({**config, "resolved_model": meta["model"]}).encode())
                if cfg.model.impl == "coda" and backend == "cute":  # the cute backend means a Hopper GPU here
                    report_untuned_gemms(llama, t, gpu_key(torch.cuda.get_device_name(device)), run_dir)
                metrics_logger = MetricsLogger(run_dir, cfg.logger, config, resume_from is not None,
                                               t.progress_bar, state.step, t.max_steps)
        except (RunDirError, ConfigError) as e:  # also wandb's refusal; raised on every rank: the others would wait for rank 0
            error = e
    raise_from_main(error, world)
    if world.is_main:
        tokens_per_step = t.batch_size * t.seq_len * t.grad_accum_steps * world.world_size
        log.info("model %s (%s, %.2fM params, vocab %d) | kernels %s | %s %s x%d %s%s | %d tokens/step | run dir %s",
                 cfg.model.init_from or cfg.model.preset, cfg.model.impl, sum(p.numel() for p in state.model.parameters()) / 1e6,
                 llama.vocab_size, backend, device.type, str(compute_dtype).removeprefix("torch."), world.world_size,
                 parallel, " cuda-graphs" if cuda_graphs else "", tokens_per_step, run_dir)
    train_step = TrainStep(state, data_parallel(state.model, parallel, device), world, device, t.grad_accum_steps,
                           cfg.optim.grad_clip, cuda_graphs)
    hint = functools.partial(continue_hint, run_dir, t.resume, sweep_dir)
    return _loop(cfg, llama, state, train_step, val_loader, checkpointer, metrics_logger, world, device, hint,
                 sweep_dir is not None)


def _loop(cfg: Config, llama: LlamaConfig, state: TrainState, train_step: TrainStep, val_loader: Optional[TokenLoader],
          checkpointer: Checkpointer, metrics_logger: Optional[MetricsLogger], world: World,
          device: torch.device, hint: Callable[..., str], in_sweep: bool) -> RunEnd:
    """Steps until trainer.max_steps or a stop signal; logs, evaluates and checkpoints on schedule; hint: how to
    continue the run (rundir.continue_hint; saved=False when this run has no checkpoint of its own), for the stop
    messages; in_sweep: this run is a multirun job.
    Only those steps read the device (TrainStep.read/check), so the host runs ahead of the GPU between them."""
    t, debug = cfg.trainer, cfg.debug
    flops_per_token = llama.flops_per_token(t.seq_len)
    stop = StopSignal()
    state.start_clock()
    throughput = Throughput()
    first_step = state.step + 1  # this process's first step
    last: Optional[dict[str, Any]] = None
    stopped_by: Optional[str] = None
    logger_exit = 0  # the code the metrics logger records (wandb's finish status): train.py's for this stop
    phase = "step"  # what an out-of-memory stop names: the step or its evaluation
    try:
        if state.step >= t.max_steps and world.is_main:
            log.info("nothing to do: the checkpoint is at step %d and trainer.max_steps=%d", state.step, t.max_steps)
        while state.step < t.max_steps and not any_rank(stop.received is not None, world):
            phase = f"step {state.step + 1}"
            if debug.out_of_memory_at_step == state.step + 1:
                raise torch.OutOfMemoryError(f"CUDA out of memory (debug.out_of_memory_at_step={state.step + 1})")
            pending = train_step(poison_loss=debug.nan_loss_at_step == state.step + 1)
            throughput.add(pending.tokens)
            is_last = state.step == t.max_steps
            should_eval = val_loader is not None and (state.step % t.eval_every == 0 or is_last)
            should_save = (t.ckpt_every and state.step % t.ckpt_every == 0) or is_last
            should_log = state.step == 1 or state.step % t.log_every == 0 or is_last or should_eval
            result = train_step.read(pending) if should_log or should_save else None  # the one device sync
            if should_log:
                now = time.perf_counter()
                tokens_per_s = throughput.per_second(now)
                utilization = mfu(tokens_per_s, flops_per_token, t.peak_flops, world.world_size) if device.type == "cuda" else None
                last = metrics_line(result, state.tokens, tokens_per_s, state.elapsed_s(now), utilization)
                if should_eval:
                    phase = f"the evaluation after step {state.step}"
                    last["val_loss"] = evaluate(state.model, val_loader, t.eval_batches * t.grad_accum_steps, device, world)
                _log(metrics_logger, last, checkpointer.root.parent, world, debug.disk_full_in_metrics_at_step == state.step)
                throughput.reset()
            elif state.step == first_step:
                # this process's warm-up (kernel compilation, CUDA-graph capture) is no training time: a new run's
                # step-1 line shows it alone, and a resumed run's first line would otherwise average it in
                train_step.check()  # waits for the step's device work: once per process
                throughput.reset()
            if metrics_logger is not None:
                metrics_logger.step_done()
            if should_save:
                with throughput.excluded(), stop.saving(state.step):
                    _save(checkpointer, state, world)
            if debug.sigkill_after_step == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            if debug.sigterm_after_step == state.step:
                os.kill(os.getpid(), signal.SIGTERM)
            if checkpointer.written(world):  # an asynchronous save, published as soon as it can be
                with throughput.excluded():
                    _finish(checkpointer, world)
        if state.step < t.max_steps:  # a rank received SIGTERM/SIGINT
            train_step.check()  # never save a state that a non-finite step reached
            with stop.saving(state.step):
                path = _save(checkpointer, state, world)
                _finish(checkpointer, world)  # published before the message says so
            stopped_by = signal.Signals(stop.received).name if stop.received else "a stop signal"  # another rank's
            if world.is_main:
                log.info("received %s: saved %s and stopped; %s", stopped_by, path, hint())
        _finish(checkpointer, world)  # the last step's checkpoint, written in the background
        # a signal during the last step (its eval, its save): the run is complete, but a multirun sweep stops too
        if stopped_by is None and any_rank(stop.received is not None, world):
            stopped_by = signal.Signals(stop.received).name if stop.received else "a stop signal"  # another rank's
            if world.is_main:
                log.info("received %s during the last step: this run is complete (step %d) and saved; stopped%s",
                         stopped_by, state.step, f" before the sweep's next job; {hint()}" if in_sweep else "")
    except NonFiniteError as e:
        logger_exit = EXIT_NON_FINITE
        _finish(checkpointer, world)  # a save in flight holds a finite state (each save reads its step first)
        raise _non_finite_stop(e, state.step, checkpointer, hint) from None
    except torch.OutOfMemoryError as e:
        logger_exit = EXIT_BAD_INPUT
        _finish(checkpointer, world)  # a save in flight holds a step that completed
        raise _out_of_memory_stop(e, phase, cfg, world, device, checkpointer, hint) from None
    except BaseException as e:  # any other stop (a DataError mid-run, a bug): not recorded as a finished run
        logger_exit = exit_code(e) if isinstance(e, STOP_ERRORS) else 1
        raise
    finally:
        stop.restore()
        if metrics_logger is not None:
            metrics_logger.close(logger_exit)
    return RunEnd(last, stopped_by)


def _non_finite_stop(error: NonFiniteError, step: int, checkpointer: Checkpointer, hint: Callable[..., str]) -> NonFiniteError:
    """The error a run stops with: which steps were not applied (a fused step runs ahead of the check
    until the next step that reads the device), the newest checkpoint, and the fix."""
    newest = next(iter(list_checkpoints(checkpointer.root)), None)
    skipped = "this step" if error.step >= step else f"steps {error.step}..{step}"
    change = "a lower optim.lr, longer optim.warmup_steps or a tighter optim.grad_clip"
    if newest is None:
        fix = f"No checkpoint of this run exists yet: start it again with {change} ({hint(saved=False)})"
    else:
        fix = f"Resume from the newest checkpoint, {newest}, with {change} ({hint(saved=True)})"
    return NonFiniteError(f"{error}; stopped without applying or saving {skipped}. {fix}", error.step)


def _out_of_memory_stop(error: torch.OutOfMemoryError, phase: str, cfg: Config, world: World, device: torch.device,
                        checkpointer: Checkpointer, hint: Callable[..., str]) -> ConfigError:
    """The error a run stops with when a step (or its evaluation) runs out of GPU memory: the training state was
    checked at the start (build.check_state_fits), so it is the activations of a micro-batch, and the fixes are the
    settings that shrink them, the first one keeping the global batch so a resume continues the same batches."""
    t = cfg.trainer
    newest = next(iter(list_checkpoints(checkpointer.root)), None)
    fixes = []
    if t.batch_size > 1:
        half = t.batch_size // 2
        fixes.append(f"trainer.batch_size={half} trainer.grad_accum_steps={t.grad_accum_steps * t.batch_size // half}"
                     if t.batch_size % 2 == 0 else "a smaller trainer.batch_size with a larger trainer.grad_accum_steps")
        if newest is not None:
            fixes[-1] += " (the same global batch: the resume continues the same batches)"
    if cfg.model.impl == "coda" and t.recompute == "none":
        fixes.append("trainer.recompute=block (each block keeps only its input and recomputes its forward in the backward)")
    if newest is None:  # a resume keeps the saved seq_len (the data loader refuses another)
        fixes.append(f"a shorter trainer.seq_len (now {t.seq_len})")
    if world.world_size == 1:
        fixes.append("more GPUs: torchrun --nproc-per-node=N train.py ... trainer.parallel=fsdp"
                     + (" with trainer.batch_size x N x trainer.grad_accum_steps as now" if newest is not None else ""))
    peak = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        peak = f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated of the GPU's {total / 2**30:.1f}"
    tried = next((part for part in str(error).split(". ") if part.startswith("Tried to allocate")), None)  # torch's words
    what = "; ".join(part for part in (tried and f"{tried[0].lower()}{tried[1:]}", peak) if part)
    resume = (f"the newest checkpoint, {newest}, is intact; resume from it with one of these ({hint(saved=True)})"
              if newest is not None else f"no checkpoint of this run exists yet; start it again with one of these "
              f"({hint(saved=False)})")
    return ConfigError(f"{phase} ran out of GPU memory{f' ({what})' if what else ''}. The training state fit at the start, so a "
                       f"micro-batch's activations ({t.batch_size} x {t.seq_len} tokens) did not; {resume}: "
                       + "; ".join(fixes) + ".")


def _log(metrics_logger: Optional[MetricsLogger], line: dict[str, Any], run_dir: Path, world: World,
         disk_full: bool = False) -> None:
    """Rank 0 logs the line; its failed write (disk full) raises on every rank, as a failed state.pt write does: the
    others would wait in their next collective for rank 0. disk_full: the write fails with ENOSPC (debug)."""
    error = None
    if metrics_logger is not None:
        try:
            if disk_full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), metrics_logger.file.name)
            metrics_logger.log(line)
        except OSError as e:
            error = e
    if any_rank(error is not None, world):  # host-side, as every step's stop check: rank 0's error only when there is one
        with writing(f"the metrics of step {line['step']}", run_dir / METRICS_FILE, run_dir):
            raise_from_main(error, world)


def _save(checkpointer: Checkpointer, state: TrainState, world: World) -> Optional[Path]:
    """Rank 0 writes the state (every rank its own shards under FSDP2); the loader state is the same on every rank.
    A pending asynchronous save is published first (one at a time)."""
    _finish(checkpointer, world)
    with writing(f"the checkpoint of step {state.step}", checkpointer.root / f"step_{state.step:08d}",
                 checkpointer.root.parent):
        return checkpointer.save(state, world)


def _finish(checkpointer: Checkpointer, world: World) -> None:
    """Publish the pending asynchronous save, if any; a failed write is reported under its own step."""
    if checkpointer.pending is not None:
        step = checkpointer.pending.step
        with writing(f"the checkpoint of step {step}", checkpointer.root / f"step_{step:08d}", checkpointer.root.parent):
            checkpointer.finish(world)
