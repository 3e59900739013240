"""Building a run from its config: the checks that can fail (compute settings, model shape) and the
pieces the loop drives (data, train state, validation loader). No step runs here."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from coda_train.config import Config, TrainerConfig, resolve_model_config
from coda_train.data import DataConfig, PreparedData, TokenLoader, prepare
from coda_train.errors import ConfigError
from coda_train.model import LlamaConfig, build_model, kernel_shape_errors

from .distributed import World, barrier, shard_model
from .optim import build_optimizer, build_scheduler
from .state import TrainState, seed_all

log = logging.getLogger(__name__)
UNTUNED_FILE = "untuned_gemms.json"  # in the run dir: the input of scripts/tune_gemm.py --launches


def check_compute(cfg: Config, backend: str, compute_dtype: torch.dtype) -> None:
    """The resolved kernel backend can compute the model in compute_dtype."""
    if backend == "cute" and cfg.model.impl == "coda" and compute_dtype != torch.bfloat16:
        raise ConfigError(f"kernels.backend={cfg.kernels.backend} runs the cute kernels, which compute in bfloat16 only, "
                          f"but trainer.compute_dtype={cfg.trainer.compute_dtype} gives {compute_dtype}; use "
                          "trainer.compute_dtype=bfloat16 (or auto), or kernels.backend=reference")


def data_config(cfg: Config) -> DataConfig:
    """The run's data config; a run started from a Hugging Face directory (model.init_from) tokenizes
    with that model's tokenizer unless data.tokenizer names another."""
    if cfg.model.init_from is None or cfg.data.tokenizer is not None:
        return cfg.data
    return dataclasses.replace(cfg.data, tokenizer=cfg.model.init_from)


def prepare_data(cfg: DataConfig, world: World) -> PreparedData:
    """The prepared data, on every rank: rank 0 prepares (or finds) it first, the others then open it."""
    if not world.is_main:
        barrier(world)
    data = prepare(cfg)
    if world.is_main:
        barrier(world)
    return data


def _shape_errors(cfg: Config, llama: LlamaConfig, backend: str) -> list[str]:
    return kernel_shape_errors(llama, backend) if cfg.model.impl == "coda" else []  # only coda calls CODA ops


def check_model_before_data(cfg: Config, backend: str) -> None:
    """The model checks that need no tokenizer, before data preparation (which can take long): every
    model field, trainer.seq_len against max_seq_len, and the kernels' shape limits, all but the
    vocabulary's when it follows the tokenizer (model.vocab_size null). resolve_model repeats them all."""
    llama = resolve_model_config(cfg.model, cfg.model.vocab_size or 1, cfg.trainer.seq_len)  # 1: any vocabulary passes
    errors = _shape_errors(cfg, llama, backend)
    if cfg.model.vocab_size is None:  # kernel_shape_errors gives one message per model.* key, named first
        errors = [e for e in errors if not e.startswith("model.vocab_size=")]
    if errors:
        raise ConfigError(f"kernels.backend={backend} cannot run this model: " + "; ".join(errors))


def resolve_model(cfg: Config, tokenizer_vocab_size: int, backend: str) -> LlamaConfig:
    """The model this run trains, checked against the kernels' shape limits before any GPU work."""
    llama = resolve_model_config(cfg.model, tokenizer_vocab_size, cfg.trainer.seq_len)
    if errors := _shape_errors(cfg, llama, backend):
        raise ConfigError(f"kernels.backend={backend} cannot run this model: " + "; ".join(errors))
    return llama


def build_loader(data: PreparedData, split: str, t: TrainerConfig, world: World) -> TokenLoader:
    return TokenLoader(data, split, t.batch_size, t.seq_len, t.seed, world.rank, world.world_size)


def build_train_state(cfg: Config, llama: LlamaConfig, data: PreparedData, backend: str, device: torch.device,
                      compute_dtype: torch.dtype, world: World, init_weights: bool = True,
                      parallel: str = "none") -> TrainState:
    """A fresh train state at step 0: model (sharded in place when parallel is fsdp), optimizer,
    scheduler and train loader. The weights are model.init_from's when set and init_weights (a
    resumed run takes its checkpoint's instead)."""
    seed_all(cfg.trainer.seed)  # seeded init on CPU, so both impls and every device start from the same weights
    recompute = {"recompute": cfg.trainer.recompute} if cfg.model.impl == "coda" else {}
    model = build_model(llama, cfg.model.impl, backend=backend, compute_dtype=compute_dtype, **recompute)
    if cfg.model.init_from is not None and init_weights:
        from coda_train.model.hf import load_hf_weights

        load_hf_weights(model, cfg.model.init_from)
    model = model.to(device)
    if parallel == "fsdp":
        shard_model(model, compute_dtype, cfg.trainer.fsdp_reshard_after_forward)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)
    return TrainState(model, optimizer, scheduler, build_loader(data, "train", cfg.trainer, world))


def report_untuned_gemms(llama: LlamaConfig, t: TrainerConfig, gpu: str, run_dir: Path) -> list:
    """The GEMM shapes of this run's CODA step that the tile config table has no entry for on `gpu`
    (they run quack's default config): logged with the command that tunes them, and written to the
    run dir as that command's input. Returns them ([] when the table covers the run)."""
    from coda_train.kernels.tile_configs import TABLE_ENV, untuned
    from coda_train.model.coda import step_gemm_shapes

    dims = llama.kernel_dims(t.batch_size * t.seq_len, t.seq_len)
    missing = untuned(step_gemm_shapes(dims), gpu)
    path = run_dir / UNTUNED_FILE
    if not missing:
        path.unlink(missing_ok=True)  # a resumed run whose shapes were tuned since
        return []
    path.write_text(json.dumps({"gpu": gpu, "dims": dataclasses.asdict(dims),
                                "launches": [dict(op=op, m=m, n=n, k=k) for op, m, n, k in missing]}, indent=1))
    log.warning("%d GEMM shape(s) of this run have no entry for %s in the tile config table (%s): they run the default "
                "tile config, which can be well behind a tuned one (docs/kernels.md). To tune them once on this GPU: "
                "python scripts/tune_gemm.py --launches %s --out DIR, then set %s=DIR/tile_configs.json",
                len(missing), gpu, ", ".join(f"{op} {m}x{n}x{k}" for op, m, n, k in missing), path, TABLE_ENV)
    return missing
