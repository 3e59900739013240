"""Typed run configuration: the schema hydra checks `configs/` and command-line overrides against.

Each dataclass is one config group (model, data, optim, trainer, logger) or node (kernels, debug);
a group's dataclass and its choices live with the code that uses them (DataConfig in data/,
OptimConfig in trainer/optim.py, LoggerConfig in trainer/metrics.py), and ModelConfig is derived
from the model's LlamaConfig. `register_configs()` puts the whole tree in hydra's ConfigStore as
`base_config`, which `configs/config.yaml` lists first, so an unknown key or a wrong type fails
before anything runs (a bool key given anything but true or false fails in `to_dataclass`). Cross-field
checks that need the data (vocab size) or the preset live here too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from coda_train.data import DataConfig
from coda_train.errors import ConfigError
from coda_train.kernels import BACKENDS
from coda_train.kernels.tile_configs import TUNE
from coda_train.model import IMPLS, RECOMPUTE, LlamaConfig, preset
from coda_train.trainer.device import COMPUTE_DTYPES, DEVICES
from coda_train.trainer.distributed import PARALLEL
from coda_train.trainer.graphs import CUDA_GRAPHS
from coda_train.trainer.metrics import LOGGERS, WANDB_MODES, LoggerConfig
from coda_train.trainer.optim import OPTIMIZERS, SCHEDULES, OptimConfig
from coda_train.trainer.rundir import check_run_dir_not_empty


def _model_schema() -> type:
    """ModelConfig, derived from LlamaConfig so a field added there is overridable with no other edit."""
    doc = ("A preset (coda_train/model/config.py PRESETS), the impl, and every LlamaConfig field as an override; "
           "null keeps the preset's value (vocab_size null: the tokenizer's vocabulary rounded up to vocab_multiple_of).")
    types = typing.get_type_hints(LlamaConfig)
    overrides = [(f.name, Optional[types[f.name]], dataclasses.field(default=None)) for f in dataclasses.fields(LlamaConfig)]
    return dataclasses.make_dataclass("ModelConfig", [
        ("preset", str, dataclasses.field(default=MISSING)),  # a name in coda_train/model/config.py PRESETS
        ("impl", str, dataclasses.field(default="coda")),  # a name in coda_train.model.IMPLS
        *overrides,
        ("vocab_multiple_of", int, dataclasses.field(default=128)),  # the cute LM head: one offset per 128 columns
        # a local Hugging Face Llama directory: its shape and weights (and tokenizer, unless data.tokenizer is set)
        ("init_from", Optional[str], dataclasses.field(default=None)),
    ], namespace={"__module__": __name__, "__doc__": doc})


ModelConfig = _model_schema()


@dataclass
class KernelsConfig:
    # one of coda_train.kernels.BACKENDS; auto: cute on a Hopper GPU (reference with trainer.device=cpu), else reference
    backend: str = "auto"
    # one of kernels/tile_configs.py TUNE: GEMM shapes the tile config table lacks for this GPU (another width,
    # token count or GPU) run a safe default (off) or are tuned before the run starts, once, into the user's
    # cache, which every later run reads (once; a few minutes; docs/kernels.md)
    tune: str = "off"


@dataclass
class TrainerConfig:
    seed: int = 1337  # model init, data order and every RNG
    # the run's size is set in configs/trainer/*.yaml (default.yaml: the tiny CPU run)
    max_steps: int = MISSING
    batch_size: int = MISSING  # sequences per micro-batch (per process)
    seq_len: int = MISSING
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    device: str = "auto"  # one of trainer/device.py DEVICES
    compute_dtype: str = "auto"  # one of trainer/device.py COMPUTE_DTYPES; parameters stay fp32
    parallel: str = "auto"  # one of trainer/distributed.py PARALLEL (multi-process runs under torchrun)
    # fsdp: free each block's gathered weights after its forward and gather them again for its backward
    # (one more all-gather of the model per step, saving its compute-dtype copy: 16 GB for 8B in bf16)
    fsdp_reshard_after_forward: bool = False
    recompute: str = "none"  # one of model/coda.py RECOMPUTE (model.impl=coda only): block = keep each block's input only
    cuda_graphs: str = "auto"  # one of trainer/graphs.py CUDA_GRAPHS; auto: on for model.impl=coda on one CUDA GPU
    log_every: int = 10  # steps between metrics lines (the last step is always logged)
    eval_every: int = 100  # steps between validation losses (and at the last step); 0 = never
    # validation batches of the global batch (batch_size x processes x grad_accum_steps windows each): the same
    # windows for every layout of one global batch, e.g. after a resume on fewer GPUs
    eval_batches: int = 8
    ckpt_every: int = 100  # steps between checkpoints (and at the last step); 0 = only at the end/signal
    keep_last: int = 3  # checkpoints kept in <run_dir>/checkpoints
    # fsdp: stage the shards in memory and write them in a background thread while training continues
    ckpt_async: bool = False
    resume: str = "auto"  # auto (newest good checkpoint in run_dir, if any) | never | <checkpoint dir>
    run_dir: Optional[str] = None  # null: hydra's output dir (outputs/<date>/<time>)
    peak_flops: float = 989e12  # per GPU, for MFU: H100/H200 dense bf16
    progress_bar: bool = True  # tqdm, shown only when stderr is a terminal


@dataclass
class DebugConfig:
    """Test hooks that make failures happen on purpose; all null in real runs."""
    nan_loss_at_step: Optional[int] = None  # multiply that step's loss by NaN
    sigkill_after_step: Optional[int] = None  # SIGKILL this process after that step (and its checkpoint)
    sigkill_in_checkpoint_at_step: Optional[int] = None  # SIGKILL halfway through writing that step's checkpoint
    sigterm_after_step: Optional[int] = None  # send this process SIGTERM after that step (and its checkpoint)
    disk_full_in_checkpoint_at_step: Optional[int] = None  # that step's checkpoint write fails with ENOSPC halfway
    disk_full_in_metrics_at_step: Optional[int] = None  # writing that step's metrics.jsonl line fails with ENOSPC
    out_of_memory_at_step: Optional[int] = None  # that step raises torch.OutOfMemoryError, as a GPU out of memory does


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def _first_non_null(value: Any, default: Any) -> Any:
    return default if value is None else value


BOOL_TYPES = (bool, Optional[bool])
# names that may look like numbers, which hydra reads as such: data.revision=1.10 (a tag) is 1.1, 12e4567 (a sha) is inf
NAME_SETTINGS = ("data.revision",)


def _as_given(schema: type, prefix: str = "") -> type:
    """schema as hydra composes it: every bool field, in every group, and the NAME_SETTINGS typed Any. OmegaConf turns
    whatever it sets into a bool field into a bool (2, 'yes' and 'on' become True) and a number into a str field into
    its str (1.10 into '1.1'), so to_dataclass sees the value as given and refuses what is not true or false
    (_non_bools) or not a string."""
    hints = typing.get_type_hints(schema)
    fields = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            group = _as_given(hints[f.name], f"{prefix}{f.name}.")
            fields.append((f.name, group, dataclasses.field(default_factory=group)))
        elif hints[f.name] in BOOL_TYPES or prefix + f.name in NAME_SETTINGS:
            fields.append((f.name, Any, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(schema.__name__, fields, bases=(schema,), namespace={"__module__": __name__})


def register_configs() -> None:
    """Make the schema known to hydra (as `base_config`) and the resolvers the run dir uses."""
    ConfigStore.instance().store(name="base_config", node=_as_given(Config))
    if not OmegaConf.has_resolver("first_non_null"):
        OmegaConf.register_new_resolver("first_non_null", _first_non_null)
    if not OmegaConf.has_resolver("expanduser"):  # hydra makes trainer.run_dir itself, before expand_home runs
        OmegaConf.register_new_resolver("expanduser", os.path.expanduser)


# the settings that name a local path; each may start with ~ (the user's home), as in a shell
PATH_SETTINGS = ("trainer.run_dir", "trainer.resume", "model.init_from", "data.source", "data.tokenizer", "data.cache_dir")


def expand_home(cfg: Config) -> Config:
    """cfg with a leading ~ of every PATH_SETTINGS value expanded, in place, as the run config reaches the trainer
    (the data layer, also used without it, expands its own paths as well)."""
    for key in PATH_SETTINGS:
        group, name = key.split(".")
        node = getattr(cfg, group)
        if isinstance(getattr(node, name), str):
            setattr(node, name, os.path.expanduser(getattr(node, name)))
    return cfg


def _choose(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}")


def _non_finite_floats(node: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, value, schema default) of every float setting, alone or in a list, that is NaN or infinite."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += _non_finite_floats(value, f"{prefix}{f.name}.")
        elif any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, (list, tuple)) else [value])):
            found.append((prefix + f.name, value, f.default))
    return found


def check_config(cfg: Config) -> None:
    """Cross-field checks hydra's types cannot express; raises ConfigError (DataError for data.*) naming the fix."""
    t, o = cfg.trainer, cfg.optim
    check_run_dir_not_empty(t.run_dir)  # also one set past the command line, which train.py checks before hydra
    for key, value, default in _non_finite_floats(cfg):  # NaN passes every comparison below
        works = "null (the preset's value)" if default is None else repr(default)
        raise ConfigError(f"{key}={value} is not a finite number; every float setting must be finite "
                          f"(e.g. {key}={works})")
    _choose("model.impl", cfg.model.impl, tuple(IMPLS))
    _choose("kernels.backend", cfg.kernels.backend, BACKENDS)
    _choose("kernels.tune", cfg.kernels.tune, TUNE)
    _choose("optim.name", o.name, OPTIMIZERS)
    _choose("optim.schedule", o.schedule, SCHEDULES)
    _choose("trainer.device", t.device, DEVICES)
    _choose("trainer.compute_dtype", t.compute_dtype, tuple(COMPUTE_DTYPES))
    _choose("trainer.parallel", t.parallel, PARALLEL)
    _choose("trainer.recompute", t.recompute, RECOMPUTE)
    _choose("trainer.cuda_graphs", t.cuda_graphs, CUDA_GRAPHS)
    if t.recompute != "none" and cfg.model.impl != "coda":
        raise ConfigError(f"trainer.recompute={t.recompute} recomputes the CODA blocks; use model.impl=coda "
                          "or trainer.recompute=none")
    _choose("logger.name", cfg.logger.name, LOGGERS)
    if cfg.logger.mode == "disabled":  # wandb's own mode name, which the README says how to get
        raise ConfigError(f"logger.mode=disabled is not a logger.mode ({', '.join(WANDB_MODES)}): to log without wandb use "
                          "logger=jsonl (metrics.jsonl only), or set WANDB_MODE=disabled in the environment")
    _choose("logger.mode", cfg.logger.mode, WANDB_MODES)
    for name in ("max_steps", "batch_size", "seq_len", "grad_accum_steps", "log_every", "keep_last"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 1")
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(f"trainer.eval_batches={t.eval_batches} must be >= 1 (or trainer.eval_every=0 to skip validation)")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"trainer.seed={t.seed} must be in [0, 2**32) (numpy's seed range)")
    if not t.peak_flops > 0:
        raise ConfigError(f"trainer.peak_flops={t.peak_flops} must be > 0 (per-GPU peak FLOP/s, for MFU)")
    for name in ("eval_every", "ckpt_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 0 (0 disables it)")
    if not o.lr > 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    for key, value in (("warmup_steps", o.warmup_steps), ("weight_decay", o.weight_decay), ("grad_clip", o.grad_clip)):
        if value < 0:
            raise ConfigError(f"optim.{key}={value} must be >= 0" + (" (0 disables clipping)" if key == "grad_clip" else ""))
    if not o.eps > 0:  # 0: a weight whose gradient is 0 (an unseen token's embedding row) is updated by 0/0 = NaN
        raise ConfigError(f"optim.eps={o.eps} must be > 0, e.g. optim.eps=1e-8")
    if not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]")
    if cfg.model.vocab_multiple_of < 1:
        raise ConfigError(f"model.vocab_multiple_of={cfg.model.vocab_multiple_of} must be >= 1")
    if t.eval_every and cfg.data.val_fraction == 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every} evaluates on the val split, but data.val_fraction=0 "
                          "holds none out: set trainer.eval_every=0, or data.val_fraction>0 (e.g. 0.02)")
    if cfg.data.tokens_per_shard < t.seq_len + 1:  # a window never crosses shards
        raise ConfigError(f"data.tokens_per_shard={cfg.data.tokens_per_shard} is shorter than one window of "
                          f"trainer.seq_len+1={t.seq_len + 1} tokens: raise data.tokens_per_shard (default 2**27)")
    cfg.data.for_model(cfg.model.init_from).validate()  # as the run uses it; DataError naming the fix, before any data is read


# fields a run started from a Hugging Face directory may set: init_std only matters at init, max_seq_len only bounds seq_len
INIT_FROM_MAY_CHANGE = ("init_std", "max_seq_len")


def _init_from_config(model: ModelConfig, overrides: dict[str, Any], tokenizer_vocab_size: int,
                      init_from_shape: Optional[LlamaConfig]) -> LlamaConfig:
    """The shape of the Hugging Face model at model.init_from (init_from_shape where given); other shape
    overrides are refused, not ignored."""
    from coda_train.model.hf import llama_config_from_hf

    llama = llama_config_from_hf(model.init_from) if init_from_shape is None else init_from_shape
    clash = {k: v for k, v in overrides.items() if k not in INIT_FROM_MAY_CHANGE and v != getattr(llama, k)}
    if clash:
        raise ConfigError(f"model.init_from={model.init_from} fixes the model's shape, but the config also sets "
                          + ", ".join(f"model.{k}={v!r} (the checkpoint has {getattr(llama, k)!r})" for k, v in clash.items())
                          + f"; remove those overrides (only {', '.join('model.' + k for k in INIT_FROM_MAY_CHANGE)} may change)")
    if tokenizer_vocab_size > llama.vocab_size:
        raise ConfigError(f"model.init_from={model.init_from} has vocab_size={llama.vocab_size}, fewer than the "
                          f"tokenizer's {tokenizer_vocab_size} tokens: train with that model's own tokenizer "
                          "(leave data.tokenizer unset to use the one in model.init_from)")
    return dataclasses.replace(llama, **{k: v for k, v in overrides.items() if k in INIT_FROM_MAY_CHANGE}).validate()


def resolve_model_config(model: ModelConfig, tokenizer_vocab_size: int, seq_len: int,
                         init_from_shape: Optional[LlamaConfig] = None) -> LlamaConfig:
    """The LlamaConfig this run trains: the preset (or the Hugging Face model at model.init_from), the
    non-null overrides, and a vocab that fits the tokenizer. init_from_shape: model.init_from's shape as a
    resumed run's checkpoint records it, read instead of that directory (which may be gone by then)."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    overrides = {k: v for k, v in dataclasses.asdict(model).items() if k in fields and v is not None}
    if model.init_from is not None:
        llama = _init_from_config(model, overrides, tokenizer_vocab_size, init_from_shape)
    else:
        llama = _preset_config(model, overrides, tokenizer_vocab_size)
    if seq_len > llama.max_seq_len:
        raise ConfigError(f"trainer.seq_len={seq_len} exceeds the model's max_seq_len={llama.max_seq_len}; "
                          f"lower trainer.seq_len or set model.max_seq_len={seq_len}")
    return llama


def _preset_config(model: ModelConfig, overrides: dict[str, Any], tokenizer_vocab_size: int) -> LlamaConfig:
    if model.vocab_size is None:
        m = model.vocab_multiple_of
        overrides["vocab_size"] = -(-tokenizer_vocab_size // m) * m
    elif model.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab_size} tokens); set model.vocab_size>={tokenizer_vocab_size} "
                          "or leave it null to follow the tokenizer")
    return preset(model.preset, **overrides)


def _unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    fields = typing.get_type_hints(schema)
    found = []
    for key in node.keys():
        if key not in fields:
            found.append(prefix + str(key))
        elif dataclasses.is_dataclass(fields[key]):
            found += _unknown_keys(node[key], fields[key], f"{prefix}{key}.")
    return found


def _non_bools(node: Any, schema: type, prefix: str = "") -> list[tuple[str, Any, type]]:
    """(key, value, schema type) of every bool setting whose value is not a bool (None where the type allows it)."""
    found = []
    for key, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            found += _non_bools(node[key], kind, f"{prefix}{key}.")
        elif kind in BOOL_TYPES and not isinstance(node[key], bool) and not (node[key] is None and kind != bool):
            found.append((prefix + key, node[key], kind))
    return found


def to_dataclass(cfg: Any) -> Config:
    """A hydra DictConfig (built on the Config schema, bools as given) as plain typed dataclasses. Keys that hydra
    let in with `+key=value` but the schema does not know are an error, not silently dropped, and so are
    keys without a value (MISSING, `???`), interpolations that cannot be resolved and bool settings given anything but
    true or false."""
    unknown = _unknown_keys(cfg, Config)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}: not fields of coda_train/config.py Config; "
                          "remove them (see `python train.py --cfg job` for every key)")
    try:  # every ${...} once, so one that cannot be resolved names its key (it raised omegaconf's traceback)
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        raise ConfigError(f"{e.full_key} cannot be resolved: {str(e.msg).splitlines()[0]}; fix its ${{...}} "
                          f"interpolation or give {e.full_key} a value") from None
    missing = sorted(OmegaConf.missing_keys(cfg))  # ??? left by the schema (e.g. a trainer group file without seq_len)
    if missing:
        raise ConfigError(f"config keys {missing} have no value: set each on the command line (e.g. "
                          f"{missing[0]}=...) or in the config group file that should set it (configs/trainer/default.yaml "
                          "sets trainer.max_steps, batch_size and seq_len; configs/model/*.yaml set model.preset)")
    for key, value, kind in _non_bools(cfg, Config):
        accepted = "true or false" if kind == bool else "true, false or null (the preset's value)"
        raise ConfigError(f"{key}={'null' if value is None else repr(value)} is not a boolean: {key} takes "
                          f"{accepted} (unquoted)")
    for key in NAME_SETTINGS:
        if (value := OmegaConf.select(cfg, key)) is not None and not isinstance(value, str):
            raise ConfigError(f"{key}={value} was read by hydra as a number or boolean, not as typed: quote it, as in "
                              f"'{key}=\"<sha or tag>\"'")
    # the Config schema itself, whose bool fields now hold bools
    return expand_home(OmegaConf.to_object(OmegaConf.merge(Config, OmegaConf.to_container(cfg, resolve=True))))
