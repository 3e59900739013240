"""Building a run from its config: the checks that can fail (compute settings, model shape) and the
pieces the loop drives (data, train state, validation loader). No step runs here."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from coda_train.config import Config, TrainerConfig, resolve_model_config
from coda_train.data import DataConfig, DataError, PreparedData, TokenLoader, prepared_folder
from coda_train.data.loader import GLOBAL_BATCH, global_batch_refusal
from coda_train.data.shards import MANIFEST
from coda_train.data.tokenizer import LoadedTokenizer, fingerprint, load_tokenizer, num_ids, tokenizer_file
from coda_train.errors import ConfigError
from coda_train.model import LlamaConfig, build_model, kernel_shape_errors

from .checkpoint import (Checkpoint, CheckpointError, check_same_model, recorded_prepared_data, recorded_prepared_folder,
                         saved_model)
from .distributed import World, barrier, from_main, shard_model
from .optim import build_optimizer, build_scheduler
from .state import TrainState, seed_all

log = logging.getLogger(__name__)
UNTUNED_FILE = "untuned_gemms.json"  # in the run dir: the input of scripts/tune_gemm.py --launches
TUNER = Path(__file__).resolve().parents[2] / "scripts" / "tune_gemm.py"  # kernels.tune=once runs it (a source checkout's)


def check_compute(cfg: Config, backend: str, compute_dtype: torch.dtype) -> None:
    """The resolved kernel backend can compute the model in compute_dtype."""
    if backend == "cute" and cfg.model.impl == "coda" and compute_dtype != torch.bfloat16:
        raise ConfigError(f"kernels.backend={cfg.kernels.backend} runs the cute kernels, which compute in bfloat16 only, "
                          f"but trainer.compute_dtype={cfg.trainer.compute_dtype} gives {compute_dtype}; use "
                          "trainer.compute_dtype=bfloat16 (or auto), or kernels.backend=reference")


def backend_on_device(cfg: Config, backend: str, device_type: str) -> str:
    """The kernel backend a run on a `device_type` device computes with, from `backend` (resolve_backend's for
    kernels.backend on this machine): the cute kernels take CUDA tensors only, so auto is reference on the CPU, and
    kernels.backend=cute with trainer.device=cpu is a ConfigError naming the fix (model.impl=coda: the only one that
    calls the kernels)."""
    if backend != "cute" or device_type == "cuda":
        return backend
    if cfg.kernels.backend == "cute" and cfg.model.impl == "coda":
        raise ConfigError(f"kernels.backend=cute runs its kernels on the GPU, but trainer.device={cfg.trainer.device} "
                          "computes on the CPU; use trainer.device=cuda (or auto), or kernels.backend=reference (or auto)")
    return "reference"


def data_config(cfg: Config) -> DataConfig:
    """The run's data config (DataConfig.for_model: model.init_from's tokenizer unless data.tokenizer is set)."""
    return cfg.data.for_model(cfg.model.init_from)


def init_from_missing(cfg: Config) -> bool:
    """model.init_from is set and holds no config.json (moved, or an HF cache cleaned): a new run stops on it
    (check_model_before_data); a resumed one is checked once its checkpoint is found (init_from_shape)."""
    return cfg.model.init_from is not None and not (Path(cfg.model.init_from).expanduser() / "config.json").is_file()


def _spellings(path: Optional[str]) -> tuple[Optional[str], ...]:
    """A path setting as given and as a run's config records it (local paths absolute): a checkpoint's record of the
    same setting equals one of them."""
    return (path,) if path is None else (path, str(Path(path).expanduser().absolute()))


def tokenizer_missing(cfg: Config) -> bool:
    """data.tokenizer is set and names no tokenizer.json any more (moved, deleted): a new run stops on it
    (check_model_before_data); a resumed one continues on its checkpoint's prepared data (checkpoint_data)."""
    return cfg.data.tokenizer is not None and not tokenizer_file(cfg.data.tokenizer).is_file()


def check_missing_tokenizer_is_the_runs(cfg: Config, checkpoint: Checkpoint) -> None:
    """A resumed run's data.tokenizer that names no tokenizer any more (tokenizer_missing) is the one the checkpoint's
    data was prepared with (its config records it absolute); ConfigError naming that one otherwise (a typo, another
    cwd), as init_from_shape does for model.init_from."""
    saved = ((checkpoint.meta.get("config") or {}).get("data") or {}).get("tokenizer")
    if saved in _spellings(cfg.data.tokenizer):
        return
    fix = (f"was prepared with data.tokenizer={saved}: resume with data.tokenizer={saved}" if saved else
           "was prepared without data.tokenizer (a BPE trained by the run, or model.init_from's tokenizer): leave "
           "data.tokenizer unset to resume it")
    raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} does not exist, and the data of checkpoint {checkpoint.path} {fix}")


def recorded_init_from(cfg: Config) -> Optional[str]:
    """model.init_from as a run's config records it (absolute: a resume from another directory compares the same);
    None where the run sets none."""
    return None if cfg.model.init_from is None else str(Path(cfg.model.init_from).expanduser().absolute())


def init_from_shape(cfg: Config, checkpoint: Checkpoint) -> LlamaConfig:
    """The shape of a resumed run's model.init_from, which holds no config.json any more, as its checkpoint
    records it; ConfigError where the checkpoint's run started from another directory (a typo, another cwd)."""
    saved_model_config = (checkpoint.meta.get("config") or {}).get("model") or {}
    started = saved_model_config.get("init_from")
    if started != recorded_init_from(cfg):
        if started:
            fix = f"was trained from {started}: resume with model.init_from={started}"
        elif "init_from" in saved_model_config:  # recorded as null: that run began from the preset's random weights
            fix = "was not started from a model.init_from: remove model.init_from to resume it"
        else:
            fix = "records no model.init_from (edited by hand, or written by another version): restore that directory"
        raise ConfigError(f"model.init_from={cfg.model.init_from} has no config.json, and checkpoint {checkpoint.path} {fix}")
    return saved_model(checkpoint.path, checkpoint.meta)


# what decides the prepared bytes (shards._inputs) and can be compared without the corpus or the tokenizer;
# split and text_field only where the source's format reads them (recorded as None otherwise)
_PREPARED_BY = ("split", "text_field", "eos_token", "val_fraction", "max_documents", "tokens_per_shard", "decode_errors")


def checkpoint_data(checkpoint: Checkpoint, cfg: Config) -> PreparedData:
    """The data of a resumed run whose data's tokenizer is gone: model.init_from's (it holds no config.json any more)
    or data.tokenizer's (tokenizer_missing). The checkpoint's prepared folder, which holds a copy of that tokenizer,
    where this run's data settings would prepare the same. Without that tokenizer the data can be neither found nor
    prepared otherwise: DataError naming the fix, before any GPU work (never the advice to prepare again, which would
    need that tokenizer)."""
    data, saved = data_config(cfg), checkpoint.meta["config"]
    if cfg.data.tokenizer is None:  # the data's tokenizer was model.init_from's (the run's warning said it is gone)
        lost, gone = "", "model.init_from's tokenizer"
        fix = (f"Restore {saved['model']['init_from']}, or set data.tokenizer to a copy of that model's tokenizer (its "
               "tokenizer.json")
    else:
        tokenizer, recorded = saved["data"]["tokenizer"], checkpoint.meta.get("tokenizer")  # its path, its fingerprint
        lost = f"data.tokenizer={tokenizer}, the tokenizer run {checkpoint.path.parent.parent} prepared its data with, is gone; "
        gone = "that tokenizer"
        fix = (f"Restore the tokenizer at {tokenizer}, or set data.tokenizer to a copy of it (the same tokenizer.json"
               + (f", of fingerprint {recorded[:12]}... as the checkpoint records" if recorded else ""))
    in_folder = f"{fix}; the prepared folder holds one)"  # where that folder is there, damaged or of other settings
    try:
        prepared = recorded_prepared_data(checkpoint.meta, data.verify_shards, fix=in_folder[0].lower() + in_folder[1:])
    except DataError as e:
        raise DataError(f"{lost}the checkpoint's prepared data cannot be read, and without {gone} it cannot be prepared "
                        f"again: {e}") from e
    if prepared is None:
        raise DataError(f"{lost}the checkpoint's prepared data ({checkpoint.meta.get('prepared_data') or 'not recorded'}) "
                        f"is gone, and without {gone} it cannot be prepared again. {fix}); nothing was prepared or changed")
    inputs = prepared.manifest.get("inputs") or {}
    changed = [f"data.{k}: checkpoint {inputs[k]!r} vs this run {getattr(data, k)!r}" for k in _PREPARED_BY
               if k in inputs and inputs[k] is not None and inputs[k] != getattr(data, k)]
    changed += _changed_data_settings(checkpoint, data, ("source", "revision"))
    if changed:
        raise DataError(f"{lost}this run's data settings differ from the checkpoint's ({', '.join(changed)}), and "
                        f"without {gone} the data cannot be prepared again. Resume with the checkpoint's data settings; "
                        f"or: {in_folder}")
    return prepared


# the settings that choose the corpus and how it is read, which check_resume_before_data leaves to this check: one
# changed since the checkpoint, not the corpus files, is then why the prepared folder differs
_CORPUS_SETTINGS = ("source", "revision", "format", "text_field", "split", "tokenizer")


def _changed_data_settings(checkpoint: Checkpoint, data: DataConfig, keys: tuple[str, ...]) -> list[str]:
    """The data settings `keys` of data that differ from the checkpoint's (which records local paths absolute)."""
    # runs before data.revision read the hub unpinned
    saved = {"revision": None, **((checkpoint.meta.get("config") or {}).get("data") or {})}
    return [f"data.{key}: checkpoint {saved[key]!r} vs this run {getattr(data, key)!r}" for key in keys
            if key in saved and saved[key] not in _spellings(getattr(data, key))]


def resumed_runs_prepared_data(checkpoint: Checkpoint, data: DataConfig, world: World) -> Optional[PreparedData]:
    """A resumed run's data (its settings compared with the checkpoint's before: check_resume_before_data) where
    data.source's files changed since the run prepared them (sizes or mtimes, files added or removed, moved) or are
    gone, or one of _CORPUS_SETTINGS changed: the folder the run prepared, while it reads, with a warning that says
    which (from the main rank). Its windows are the ones the run's data order indexes; the changed corpus would be
    prepared first (hours for a large one), then refused by the loader. The same folder where the corpus is as the run
    prepared it but data.cache_dir holds no copy (a relative one, resumed from another directory), which would
    otherwise be prepared again. None where data.cache_dir holds it, or the run's folder is gone or unreadable:
    prepare(data) then."""
    recorded = checkpoint.meta.get("prepared_data")
    if recorded is None:
        return None
    why: Optional[str] = None  # None: the same data, prepared in another data.cache_dir than this run's
    try:
        folder = prepared_folder(data)
        if folder.name == Path(recorded).name:
            if (folder / MANIFEST).is_file() or recorded_prepared_folder(checkpoint.meta) is None:
                return None  # prepare() reuses it in data.cache_dir, or prepares it again where the run's is gone
        else:
            why = "its files changed since the run prepared them"
    except DataError:  # the corpus is gone or unreadable
        why = "it cannot be read now"
    try:
        prepared = recorded_prepared_data(checkpoint.meta, data.verify_shards)
    except DataError:  # damaged, or of another format: preparing again says what is wrong
        return None
    if prepared is not None and world.is_main and why is None:  # e.g. a relative data.cache_dir, run from elsewhere
        log.info("data.cache_dir=%s holds no prepared copy of this run's data: it continues on the folder it prepared, %s",
                 data.cache_dir, recorded)
    elif prepared is not None and world.is_main:  # every rank takes the folder; one says so
        if changed := _changed_data_settings(checkpoint, data, _CORPUS_SETTINGS):
            what, new_run = f"this run's data settings differ from the checkpoint's ({', '.join(changed)})", "with them"
        else:
            what, new_run = f"data.source={data.source}: {why}", "on the corpus as it is now"
        log.warning("%s; this resumed run continues on the data it prepared, %s (start a new run to train %s)",
                    what, recorded, new_run)
    return prepared


# the data settings whose change gives other shards (or another BPE, data.vocab_size), so that a resumed run's loader
# refuses the checkpoint's data order, but only once the data is prepared; a moved data.source or data.tokenizer, and
# split and text_field (read by some formats only: the checkpoint's config records them all the same), may prepare
# the same and are left to that check
_RESUME_DATA = tuple(k for k in _PREPARED_BY if k not in ("split", "text_field"))


def check_resume_before_data(cfg: Config, checkpoint: Checkpoint, world_size: int,
                             init_from_shape: Optional[LlamaConfig] = None,
                             tokenizer: Optional[LoadedTokenizer] = None) -> None:
    """What a resumed run would otherwise refuse only after preparing its data (hours for a large corpus), read from
    the checkpoint's meta.json: the data settings that decide other shards, trainer.seq_len (other windows), another
    global batch on another micro-batch layout (TokenLoader.load_state_dict's rule), the model's shape, and a given
    tokenizer of another fingerprint where the run's prepared folder is gone (the data would be prepared with it).
    CheckpointError naming the checkpoint's values; nothing is prepared or written. tokenizer: the data's
    (check_model_before_data's), where read already."""
    saved = checkpoint.meta.get("config") or {}
    saved_trainer, saved_data, data = saved.get("trainer") or {}, saved.get("data") or {}, data_config(cfg)
    changed = {f"trainer.{k}": (saved_trainer[k], getattr(cfg.trainer, k)) for k in ("seed", "seq_len")
               if k in saved_trainer and saved_trainer[k] != getattr(cfg.trainer, k)}  # the windows and their order
    keys = [*_RESUME_DATA, *(["vocab_size"] if data.tokenizer is None and saved_data.get("tokenizer") is None else [])]
    changed.update({f"data.{k}": (saved_data[k], getattr(data, k)) for k in keys
                    if k in saved_data and saved_data[k] != getattr(data, k)})
    fixes = [f"{k}={a}" for k, (a, _) in changed.items()]
    saved_processes, t = checkpoint.meta.get("processes"), cfg.trainer  # in meta.json since 2026-12-05 (sharded: always)
    if saved_processes and {"batch_size", "grad_accum_steps"} <= saved_trainer.keys():
        refusal = global_batch_refusal((saved_trainer["batch_size"], saved_processes, saved_trainer["grad_accum_steps"]),
                                       (t.batch_size, world_size, t.grad_accum_steps))
        if refusal is not None:
            changed[GLOBAL_BATCH], batch_fix = refusal
            fixes.append(batch_fix)
    if changed:
        detail = ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in changed.items())
        fix = ", ".join(fixes)
        raise CheckpointError(f"checkpoint {checkpoint.path} was saved with other settings ({detail}), with which this "
                              f"run's windows would not continue its data order; resume with {fix}, or choose a new "
                              "trainer.run_dir (or trainer.resume=never in an empty dir) to start fresh; nothing was "
                              "prepared or deleted")
    # the data is prepared again with a given tokenizer where the run's folder is gone: the loader would refuse one of
    # another fingerprint only once that is done
    recorded = checkpoint.meta.get("tokenizer")
    if data.tokenizer is not None and recorded and recorded_prepared_folder(checkpoint.meta) is None:
        given = fingerprint((tokenizer or load_tokenizer(data.tokenizer))[0])
        if given != recorded:
            setting = "data.tokenizer" if cfg.data.tokenizer is not None else "model.init_from"
            raise CheckpointError(f"{setting}={data.tokenizer} is another tokenizer (fingerprint {given[:12]}...) than "
                                  f"checkpoint {checkpoint.path} was trained with ({recorded[:12]}...), and the run's "
                                  f"prepared data ({checkpoint.meta.get('prepared_data')}) is gone: its data would be "
                                  f"prepared again with this tokenizer, then refused. Point {setting} at the run's "
                                  "tokenizer or a copy of it (the same fingerprint), or choose a new trainer.run_dir to "
                                  "start fresh; nothing was prepared or deleted")
    # a vocabulary that follows the tokenizer is checked with the data (the tokenizer is read there); any other field now
    vocab = checkpoint.meta["model"].get("vocab_size", 1) if cfg.model.vocab_size is None else 1
    check_same_model(checkpoint, resolve_model_config(cfg.model, vocab, cfg.trainer.seq_len, init_from_shape),
                     recorded_init_from(cfg), vocab_settings(cfg))


def vocab_settings(cfg: Config) -> dict[str, Any]:
    """This run's model.* settings that decide its vocabulary, for check_same_model's message."""
    return {"vocab_size": cfg.model.vocab_size, "vocab_multiple_of": cfg.model.vocab_multiple_of}


def _shape_errors(cfg: Config, llama: LlamaConfig, backend: str) -> list[str]:
    errors = kernel_shape_errors(llama, backend) if cfg.model.impl == "coda" else []  # only coda calls CODA ops
    if errors and cfg.model.init_from is not None:  # its shape is fixed: the model.* changes named are refused
        errors.append(f"model.init_from={cfg.model.init_from} fixes the shape, so run it with kernels.backend=reference "
                      "or model.impl=eager instead")
    return errors


def _vocab_multiple_errors(cfg: Config, llama: LlamaConfig, backend: str, tokens: Optional[int]) -> list[str]:
    """The kernels' vocabulary limits for a vocabulary that follows the tokenizer (model.vocab_size null), as a message
    naming model.vocab_multiple_of: the tokenizer's `tokens` rounded up to it where the tokenizer was read, else every
    multiple of it (a BPE trained here, or a tokenizer read with the data, has its count only after data preparation)."""
    m = cfg.model.vocab_multiple_of

    def refused(vocab: int) -> bool:
        errors = _shape_errors(cfg, dataclasses.replace(llama, vocab_size=vocab), backend)
        return any(e.startswith("model.vocab_size=") for e in errors)

    if not refused(llama.vocab_size if tokens else m):  # every multiple of a multiple that runs runs too (divisibility)
        return []
    ok = next(k * m for k in range(1, 129) if not refused(k * m))  # lcm(m, 128) at the latest
    if tokens:
        vocab = next(v for v in range(tokens, tokens + 128 * ok) if not refused(v))
        given, size = f"the tokenizer's {tokens} tokens rounded up to a multiple of {m}: {llama.vocab_size}", f"={vocab}"
    else:
        given, size = (f"the tokenizer's (known after data preparation) rounded up to a multiple of {m}",
                       " to a multiple of 128 that holds the tokenizer's vocabulary")
    return [f"model.vocab_multiple_of={m}: with model.vocab_size null the vocabulary is {given}, and the cute LM head "
            f"needs a multiple of 128; set model.vocab_multiple_of={ok} (or another multiple of 128), or model.vocab_size{size}"]


def check_model_before_data(cfg: Config, backend: str, resuming: bool = False,
                            init_from_shape: Optional[LlamaConfig] = None
                            ) -> tuple[Optional[LlamaConfig], Optional[LoadedTokenizer]]:
    """The model checks that need no tokenizer, before data preparation (which can take long): every
    model field, trainer.seq_len against max_seq_len, and the kernels' shape limits, the vocabulary's
    where it follows the tokenizer (model.vocab_size null) on model.vocab_multiple_of (_vocab_multiple_errors), a
    set model.vocab_size against the BPE trained here (data.vocab_size tokens), and that model.init_from has weights
    (a new run's; a resumed one takes them from its checkpoint).
    resolve_model repeats the shape checks. Where model.init_from's tokenizer is the data's (no data.tokenizer),
    it is read here: an error names model.init_from. A resumed run whose model.init_from holds no config.json
    (init_from_missing) is checked once its checkpoint is found, against the shape it records (init_from_shape); so is
    one whose data.tokenizer is gone (tokenizer_missing), whose data the checkpoint's prepared folder then gives.
    Returns the model as far as it is known before the data (for check_state_fits): its vocabulary 1 where the
    tokenizer is read with the data, so every size is a lower bound; None where the shape waits for the checkpoint.
    And the data's tokenizer (data_config(cfg).tokenizer) where it was read here, else None: the run prepares its data
    with that one, not a second read of the file."""
    if resuming and init_from_shape is None and init_from_missing(cfg):
        return None, None
    read: Optional[LoadedTokenizer] = None
    # a BPE trained here has data.vocab_size tokens (a model.vocab_size of 0 or less is left to its own message)
    vocab_read = False  # the tokenizer's vocabulary is known exactly now
    if cfg.data.tokenizer is None and cfg.model.init_from is None and (cfg.model.vocab_size is None or cfg.model.vocab_size > 0):
        vocab = cfg.data.vocab_size
    elif (cfg.data.tokenizer is not None and not (resuming and tokenizer_missing(cfg))  # gone: read with the data
          and (cfg.model.vocab_size is None or cfg.model.vocab_size > 0)):
        # a given tokenizer is the data's as it is: read now, so one with more tokens than the model is refused before
        # the corpus is tokenized with it (hours for a large one)
        read = load_tokenizer(cfg.data.tokenizer)
        vocab, vocab_read = num_ids(read[0]), True
    else:  # read with the data: any vocabulary passes; 0 or less is refused
        vocab = 1 if cfg.model.vocab_size is None else cfg.model.vocab_size
    llama = resolve_model_config(cfg.model, vocab, cfg.trainer.seq_len, init_from_shape)
    errors = _shape_errors(cfg, llama, backend)
    if cfg.model.vocab_size is None and cfg.model.init_from is None:  # the vocabulary follows the tokenizer
        errors = [e for e in errors if not e.startswith("model.vocab_size=")] + _vocab_multiple_errors(
            cfg, llama, backend, vocab if vocab_read else None)
    if errors:
        raise ConfigError(f"kernels.backend={backend} cannot run this model: " + "; ".join(errors))
    if cfg.model.init_from is not None:
        from coda_train.model.hf import hf_weight_files

        if not resuming:  # read after data preparation: a missing file would be found that late
            hf_weight_files(cfg.model.init_from)
        if cfg.data.tokenizer is None and init_from_shape is None:  # without config.json: the checkpoint's data
            read = load_tokenizer(cfg.model.init_from, "model.init_from", "set data.tokenizer to that model's tokenizer")
    return llama, read


# bytes a parameter of the training state that FSDP2 shards: the fp32 master weight, its fp32 gradient and AdamW's two
# fp32 moments (trainer/optim.py)
SHARDED_STATE_BYTES = 16


def check_state_fits(cfg: Config, llama: LlamaConfig, device: torch.device, compute_dtype: torch.dtype, world_size: int,
                     parallel: str) -> None:
    """The training state as this framework holds it, against the free memory of this process's GPU
    (torch.cuda.mem_get_info), before data preparation: the SHARDED_STATE_BYTES of every parameter (1/world_size of
    them on each GPU under FSDP2), plus the weights held whole in the compute dtype: FSDP2's gathered model where it
    stays gathered from forward to backward (fsdp_reshard_after_forward=false), or the CODA model's compute copies
    (every weight but the embedding and LM head, which are cast at their read). A lower bound, so a run it refuses
    cannot fit: activations, the CUDA context, the allocator's reserve, DDP's gradient buckets, eager's per-forward
    casts and the weights FSDP2 gathers with resharding come on top. ConfigError naming the numbers and the fixes;
    nothing is checked on CPU, where memory is the host's."""
    if device.type != "cuda":
        return
    params = llama.num_params()
    shards = world_size if parallel == "fsdp" else 1
    sharded = SHARDED_STATE_BYTES * params / shards
    dtype = str(compute_dtype).removeprefix("torch.")
    gathered = compute_dtype.itemsize * params  # FSDP2's whole model in the compute dtype, without resharding
    if parallel == "fsdp":
        whole = 0 if cfg.trainer.fsdp_reshard_after_forward else gathered
        held = f"the whole model gathered in {dtype} (trainer.fsdp_reshard_after_forward=false)"
    elif cfg.model.impl == "coda" and compute_dtype != torch.float32:  # fp32 computes on the masters themselves
        copied = llama.num_params(include_embedding=False) - (0 if llama.tie_embeddings else llama.vocab_size * llama.dim)
        whole, held = compute_dtype.itemsize * copied, f"{dtype} compute copies of every weight but the embedding and LM head"
    else:  # eager and liger cast in each forward; fp32 computes on the masters
        whole, held = 0, ""
    free, total = torch.cuda.mem_get_info(device)
    if sharded + whole <= free:
        return

    def fewest_gpus(whole_each: int) -> Optional[int]:
        """The fewest GPUs with this one's free memory whose share of the sharded state fits beside whole_each."""
        return -(-SHARDED_STATE_BYTES * params // (free - whole_each)) if free > whole_each else None

    gib = 2**30
    state = (f"{sharded / gib:.1f} GiB of fp32 weights, gradients and AdamW moments ({SHARDED_STATE_BYTES} bytes a "
             f"parameter{f', 1/{shards} of them on each of {shards} GPUs' if shards > 1 else ''})")
    if whole:
        state = f"{(sharded + whole) / gib:.1f} GiB: {state} + {whole / gib:.1f} GiB of {held}"
    fixes = ["Train a smaller model (another model= preset, fewer model.n_layers, a smaller model.dim or model.ffn_dim)"]
    if parallel != "fsdp":
        fsdp = ("" if fewest_gpus(gathered) else " and trainer.fsdp_reshard_after_forward=true")
        fixes.append(f"run on at least {fewest_gpus(gathered) or fewest_gpus(0)} of these GPUs under torchrun with "
                     f"trainer.parallel=fsdp{fsdp} (fsdp is the default there), which shards the {SHARDED_STATE_BYTES} "
                     "bytes a parameter over them")
    elif whole:
        fixes.append(f"set trainer.fsdp_reshard_after_forward=true (each block's gathered weights are freed after its "
                     f"forward; then at least {fewest_gpus(0)} of these GPUs)")
    if parallel == "fsdp" and fewest_gpus(whole):
        fixes.append(f"run on at least {fewest_gpus(whole)} of these GPUs")
    if total - free > total / 10:  # more than the CUDA context takes: other processes hold memory on this GPU
        fixes.append(f"free the memory other processes hold on this GPU ({(total - free) / gib:.1f} GiB is in use)")
    raise ConfigError(f"model {cfg.model.init_from or cfg.model.preset} ({params:,} parameters) does not fit in the "
                      f"memory of {device} ({torch.cuda.get_device_name(device)}: {free / gib:.1f} GiB free of "
                      f"{total / gib:.1f} GiB): its training state alone takes {state}, before any activation. "
                      f"{'; or '.join(fixes)}; nothing was prepared or written")


def resolve_model(cfg: Config, tokenizer_vocab_size: int, backend: str,
                  init_from_shape: Optional[LlamaConfig] = None) -> LlamaConfig:
    """The model this run trains, checked against the kernels' shape limits before any GPU work
    (init_from_shape: see resolve_model_config)."""
    llama = resolve_model_config(cfg.model, tokenizer_vocab_size, cfg.trainer.seq_len, init_from_shape)
    if errors := _shape_errors(cfg, llama, backend):
        raise ConfigError(f"kernels.backend={backend} cannot run this model: " + "; ".join(errors))
    return llama


def build_loader(data: PreparedData, split: str, t: TrainerConfig, world: World) -> TokenLoader:
    # whole global batches in both splits: validation reads eval_batches of them, the same windows for every layout
    return TokenLoader(data, split, t.batch_size, t.seq_len, t.seed, world.rank, world.world_size, t.grad_accum_steps)


def build_train_state(cfg: Config, llama: LlamaConfig, train_loader: TokenLoader, backend: str, device: torch.device,
                      compute_dtype: torch.dtype, world: World, init_weights: bool = True,
                      parallel: str = "none") -> TrainState:
    """A fresh train state at step 0 around `train_loader` (build_loader, made before the model so that a
    split too small for one batch stops the run first): model (sharded in place when parallel is fsdp),
    optimizer and scheduler. The weights are model.init_from's when set and init_weights (a
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
    return TrainState(model, optimizer, scheduler, train_loader)


def _untuned(llama: LlamaConfig, t: TrainerConfig, gpu: str):
    """(kernel dims, the shape classes of this run's CODA step the tile config table lacks on `gpu`)."""
    from coda_train.kernels.tile_configs import untuned
    from coda_train.model.coda import step_gemm_shapes

    dims = llama.kernel_dims(t.batch_size * t.seq_len, t.seq_len)
    return dims, untuned(step_gemm_shapes(dims), gpu)


def _write_launches(path: Path, gpu: str, dims, missing: list) -> None:
    """The input of scripts/tune_gemm.py --launches: the GPU, the run's kernel dims, the launches to tune."""
    path.write_text(json.dumps({"gpu": gpu, "dims": dataclasses.asdict(dims),
                                "launches": [dict(op=op, m=m, n=n, k=k) for op, m, n, k in missing]}, indent=1))


# kernels.tune=once: the tuner's own budget, and when it is stopped (its compile workers with it); both
# well inside the 10 minutes the other processes may wait at a collective (NCCL's default timeout)
TUNE_BUDGET_S, TUNE_KILL_S = 240, 420


def tune_untuned_gemms(llama: LlamaConfig, t: TrainerConfig, gpu: str, world: World) -> list:
    """kernels.tune=once: the main process tunes this run's GEMM shapes that the tile config table
    lacks on `gpu` (scripts/tune_gemm.py on this GPU, before the model is built: a few minutes); every
    process then uses the winners, and the first process of each host adds them to its user cache
    (tile_configs.cache_path()), which later runs read. A tuner that fails, runs out of time or leaves
    shapes untuned, or a cache that cannot be written, is logged and never stops the run. Returns the
    entries tuned."""
    from coda_train.kernels import tile_configs

    dims, missing = _untuned(llama, t, gpu)
    if missing and not TUNER.is_file():  # on every rank, so none waits at a collective for a main that stopped
        raise ConfigError(f"kernels.tune=once runs scripts/tune_gemm.py of a source checkout, and there is none at "
                          f"{TUNER}; run from the repository, or use kernels.tune=off")
    entries = _run_tuner(gpu, dims, missing) if missing and world.is_main else []
    entries = from_main(entries, world)
    if entries:
        tile_configs.remember(gpu, entries)
        if world.local_rank == 0:  # one writer per host (hosts may not share a home directory)
            try:
                path = tile_configs.add_to_cache(gpu, entries)
                log.info("kernels.tune=once: %d tuned shape(s) cached in %s for later runs", len(entries), path)
            except OSError as e:
                log.warning("kernels.tune=once: could not write the tile config cache (%s); this run uses the tuned "
                            "configs, later runs tune again (set $%s to a writable file)", e, tile_configs.CACHE_ENV)
    barrier(world)
    return entries


def _run_tuner(gpu: str, dims, missing: list) -> list:
    """scripts/tune_gemm.py on the missing launches, in its own process group (stopped with its
    compile workers after TUNE_KILL_S); the valid table entries it wrote for them, [] if it failed."""
    from coda_train.kernels import tile_configs

    log.info("kernels.tune=once: tuning %d GEMM shape(s) the tile config table lacks for %s (scripts/tune_gemm.py, "
             "up to %d s on this GPU, once: later runs read them from %s): %s", len(missing), gpu, TUNE_BUDGET_S,
             tile_configs.cache_path(), ", ".join(f"{op} {m}x{n}x{k}" for op, m, n, k in missing))
    with tempfile.TemporaryDirectory(prefix="coda-tune-") as tmp:
        _write_launches(Path(tmp) / UNTUNED_FILE, gpu, dims, missing)
        cmd = [sys.executable, str(TUNER), "--launches", str(Path(tmp) / UNTUNED_FILE), "--out", tmp,
               "--budget-s", str(TUNE_BUDGET_S)]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=TUNE_KILL_S)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                rc, output = -9, output + f"\n(stopped after {TUNE_KILL_S} s)"
        except OSError as e:  # could not start it: as a failed tuner
            rc, output = -1, str(e)
        out = Path(tmp) / "tile_configs.json"
        if rc != 0 or not out.is_file():
            log.warning("kernels.tune=once: the tuner failed (exit %d), so these shapes run the default tile config; "
                        "its output ends:\n%s", rc, output[-3000:])
            return []
        wanted = set(missing)
        try:
            entries = [e for e in json.loads(out.read_text())["gpus"].get(gpu, [])
                       if tile_configs.shape_class(e["op"], e["m"], e["n"], e["k"]) in wanted]
            tile_configs.parse_entries(entries, f"the tuner's {out}")
        except (ValueError, KeyError, TypeError, ConfigError) as e:
            log.warning("kernels.tune=once: the tuner's table is unusable (%s); these shapes run the default config", e)
            return []
    log.info("kernels.tune=once: %d of %d shape(s) tuned%s; the tuner's table:\n%s", len(entries), len(missing),
             "" if len(entries) == len(missing) else " (the rest run the default config; the next run tunes them)",
             output[output.find("| op |"):][-3000:] if "| op |" in output else "(none printed)")
    return entries


def report_untuned_gemms(llama: LlamaConfig, t: TrainerConfig, gpu: str, run_dir: Path) -> list:
    """The GEMM shapes of this run's CODA step that the tile config table has no entry for on `gpu`
    (they run quack's default config): logged with the ways to tune them, and written to the run dir
    as the tuner's input. Returns them ([] when the table covers the run)."""
    from coda_train.kernels.tile_configs import TABLE_ENV

    dims, missing = _untuned(llama, t, gpu)
    path = run_dir / UNTUNED_FILE
    if not missing:
        path.unlink(missing_ok=True)  # a resumed run whose shapes were tuned since
        return []
    _write_launches(path, gpu, dims, missing)
    log.warning("%d GEMM shape(s) of this run have no entry for %s in the tile config table (%s): they run the default "
                "tile config, which can be well behind a tuned one (docs/kernels.md). To tune them once on this GPU: "
                "run with kernels.tune=once (every later run reuses the result), or python scripts/tune_gemm.py "
                "--launches %s --out DIR, then set %s=DIR/tile_configs.json",
                len(missing), gpu, ", ".join(f"{op} {m}x{n}x{k}" for op, m, n, k in missing), path, TABLE_ENV)
    return missing
