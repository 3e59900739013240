"""A trained checkpoint opened for use outside training (evaluation, sampling, export): the run dir or
checkpoint dir resolved and verified, its model config and weights, and the tokenizer it was
trained with (the run's prepared data, or a tokenizer given explicitly and checked against it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from coda_train.data import DataConfig, DataError, PreparedData, prepare
from coda_train.data.shards import TOKENIZER_FILE
from coda_train.data.tokenizer import encode_documents, find_eos, fingerprint, load_tokenizer, num_ids, token_dtype
from coda_train.errors import ConfigError
from coda_train.model import LlamaConfig, build_model
from coda_train.model.eager import EagerLlama
from coda_train.model.hf import check_tokenizer_fits
from coda_train.model.weights import LlamaWeights
from coda_train.trainer.checkpoint import (CHECKPOINTS_DIR, META_FILE, STEP_DIR, Checkpoint, CheckpointError,
                                           list_checkpoints, load_model_state, newest_good_checkpoint, recorded_prepared_data,
                                           saved_model, verify_checkpoint)
from coda_train.trainer.rundir import continue_hint, sweep_jobs

log = logging.getLogger(__name__)

# what eval, sample and export can do without the run's data: the tokenizer from elsewhere (an export holds it)
TOOLS_FIX = ("Restore the run's corpus (its data.source), or pass --tokenizer PATH with the run's tokenizer.json (an export "
             "of the run holds one) and, for eval, the text to evaluate with --text FILE ...")


@dataclass
class TrainedCheckpoint:
    path: Path  # the checkpoint directory (step_XXXXXXXX)
    meta: dict[str, Any]  # its meta.json: "model" (LlamaConfig fields), "config" (the run config), "step"
    model_config: LlamaConfig
    weights: dict[str, torch.Tensor]  # the model's state_dict, fp32 on CPU
    tokenizer: Tokenizer
    tokenizer_file: Path
    eos_token: str
    eos_id: int
    data: Optional[PreparedData]  # the run's prepared data, when the tokenizer came from it


def checkpoint_parser(description: str, compute: bool) -> argparse.ArgumentParser:
    """The command line every checkpoint script shares: the checkpoint, --tokenizer, and with
    compute also --device and --dtype (trainer/device.py's choices)."""
    from coda_train.trainer.device import COMPUTE_DTYPES, DEVICES

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    # paths as train.py's config takes them: a shell leaves `--out=~/x` and a quoted "~/x" as they are
    parser.add_argument("checkpoint", type=os.path.expanduser, help="run dir or checkpoint dir")
    parser.add_argument("--tokenizer", type=os.path.expanduser, help="tokenizer.json or HF dir (default: the run's own, from its prepared data)")
    if compute:
        parser.add_argument("--device", default="auto", choices=DEVICES)
        parser.add_argument("--dtype", default="auto", choices=list(COMPUTE_DTYPES),
                            help="compute dtype; auto: bfloat16 on cuda, float32 on cpu")
    return parser


def log_progress_to_stderr() -> None:
    """coda_train's progress lines (data preparation) on stderr, other libraries' warnings only."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("coda_train").setLevel(logging.INFO)


def find_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint dir, or the newest good checkpoint of a run dir or its checkpoints/ dir, verified;
    CheckpointError saying what is there otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a run dir (trainer.run_dir) or a checkpoint dir")
    if path.is_file():  # a file of a checkpoint (state.pt, meta.json) or of a run (metrics.jsonl): "no meta.json" misled
        raise CheckpointError(f"{path} is a file; pass the directory that holds it ({path.parent}), a checkpoint or a run dir")
    if (path / META_FILE).exists():
        try:
            return Checkpoint(path, verify_checkpoint(path))
        except CheckpointError as e:
            raise CheckpointError(f"{e}; {_instead_of_damaged(path)}") from e
    if (root := _checkpoints_root(path)) is not None:
        found = newest_good_checkpoint(root)
        if found is None:
            raise CheckpointError(f"every checkpoint in {root} is damaged (see the warnings above); pass another one")
        return found
    if jobs := sweep_jobs(path, lambda job: bool(list_checkpoints(job / CHECKPOINTS_DIR))):  # a multirun's sweep dir
        raise CheckpointError(f"{path} is a multirun sweep, not one run; pass one of its jobs' run dirs: "
                              f"{', '.join(map(str, jobs))}")
    if (path / "config.json").is_file():  # e.g. this tool's own export
        raise CheckpointError(f"{path} is a Hugging Face model directory (config.json), not a coda-train checkpoint: load "
                              "it with transformers, or train from it with model.init_from; pass a run dir or checkpoint here")
    raise CheckpointError(f"{path} is neither a checkpoint (no {META_FILE}) nor a run dir with checkpoints/step_*; "
                          "pass the trainer.run_dir of a run that saved a checkpoint, or one of its checkpoints/step_* dirs")


def _instead_of_damaged(path: Path) -> str:
    """The fix for a damaged checkpoint given explicitly: the newest intact one beside it (and its run dir, which
    takes it), and how to rewrite this one where a resume of its run redoes its step."""
    found = newest_good_checkpoint(path.parent, warn=False)
    if found is None:
        return "no checkpoint beside it is intact: train again to get one"
    run = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
    fix = f"pass {found.path} instead (the newest intact checkpoint beside it)"
    if run is not None:
        fix += f", or the run dir {run}, which takes it"
        named = STEP_DIR.match(path.name)
        if named is not None and int(named.group(1)) > found.meta["step"]:  # a resume continues from found and redoes it
            fix += f"; to rewrite this one, resume the training ({continue_hint(run)})"
    return fix


def _checkpoints_root(path: Path) -> Optional[Path]:
    """Where find_checkpoint looks for a run's checkpoints: its checkpoints/ dir, or path itself (a checkpoints dir)."""
    return next((root for root in (path / CHECKPOINTS_DIR, path) if list_checkpoints(root)), None)


def _unverified_meta(path: Path) -> Optional[tuple[Path, dict[str, Any], LlamaConfig]]:
    """The checkpoint find_checkpoint takes unless it is damaged, its meta.json and recorded model, read without
    verifying it; None where that meta.json is missing or unusable (find_checkpoint then says why)."""
    root = None if (path / META_FILE).exists() else _checkpoints_root(path)
    newest = path if root is None else list_checkpoints(root)[0]
    try:
        meta = json.loads((newest / META_FILE).read_text())
        model_config = saved_model(newest, meta)
    except (OSError, ValueError, TypeError, KeyError, CheckpointError):
        return None
    return (newest, meta, model_config) if isinstance(meta.get("config"), dict) else None


def _check_trained_tokenizer(tok: Tokenizer, tokenizer_file: Path, trained_with: Optional[str], ckpt: Path) -> None:
    if trained_with is not None and trained_with != fingerprint(tok):
        raise ConfigError(f"the tokenizer {tokenizer_file} (fingerprint {fingerprint(tok)[:12]}) is not the one checkpoint "
                          f"{ckpt} was trained with ({trained_with[:12]}); pass the run's own tokenizer.json")


PRUNED_RETRIES = 3  # how often open_checkpoint takes a run's newest checkpoint again when the one it read was pruned


def open_checkpoint(path: str | Path, tokenizer: Optional[str] = None,
                    check: Optional[Callable[[LlamaConfig, dict[str, Any]], None]] = None) -> TrainedCheckpoint:
    """The checkpoint at `path` (see find_checkpoint) with its tokenizer: the run's prepared data's
    (see run_prepared_data), or `tokenizer` (a tokenizer.json or HF directory). The
    tokenizer must be the one the model was trained with (same fingerprint, ids within the vocab), and the weights
    fit the model meta.json describes (check_weights_fit).
    check(model_config, run_config), where given, refuses the caller's arguments that depend on the
    checkpoint (ConfigError) before the weights are loaded and any data is prepared, and, where the checkpoint's
    meta.json reads, before its weights are checksummed (minutes at 8B); so is another tokenizer, where meta.json
    records the run's (since 2026-12-05; before, the loader state says so once the weights are loaded)."""
    tokenizer_file = None
    if tokenizer is not None:  # read before the checkpoint: a wrong path is refused at once
        tok, config_eos = load_tokenizer(tokenizer, "--tokenizer", "leave it out to use the run's own")
        tokenizer_file = Path(tokenizer) / TOKENIZER_FILE if Path(tokenizer).is_dir() else Path(tokenizer)
    if (check is not None or tokenizer is not None) and (unverified := _unverified_meta(Path(path))) is not None:
        newest, unverified_meta, unverified_model = unverified
        if check is not None:
            check(unverified_model, unverified_meta["config"])
        if tokenizer is not None:
            _check_trained_tokenizer(tok, tokenizer_file, unverified_meta.get("tokenizer"), newest)
    for attempt in range(PRUNED_RETRIES + 1):
        ckpt, meta = find_checkpoint(path)
        model_config = saved_model(ckpt, meta)
        if not isinstance(run_config := meta.get("config"), dict):
            raise CheckpointError(f"checkpoint {ckpt}: {META_FILE} lacks a usable run config; restore it, or choose "
                                  "another checkpoint")
        if check is not None:  # again: the checkpoint found may be an older one (a newer one damaged)
            check(model_config, run_config)
        try:
            state = load_model_state(ckpt, meta)
            break
        except CheckpointError:
            # a run still training pruned it (trainer.keep_last) after saving a newer one: take the run's newest again
            if ckpt.exists() or ckpt == Path(path) or attempt == PRUNED_RETRIES:
                raise
            log.info("checkpoint %s was removed while it was read (the run saved a newer one); reading its newest", ckpt)
    check_weights_fit(ckpt, state["model"], model_config)  # before the data is prepared and anything is written
    data = None
    if tokenizer is None:
        data = run_prepared_data(meta)
        tok, tokenizer_file = data.tokenizer, data.path / TOKENIZER_FILE
        eos_token, eos_id = data.manifest["tokenizer"]["eos_token"], data.eos_id
    else:
        eos_token, eos_id = find_eos(tok, run_config.get("data", {}).get("eos_token"), config_eos)
    _check_trained_tokenizer(tok, tokenizer_file, state.get("train_loader", {}).get("tokenizer") or meta.get("tokenizer"),
                             ckpt)
    check_tokenizer_fits(tok, model_config, str(tokenizer_file))
    return TrainedCheckpoint(ckpt, meta, model_config, state["model"], tok, tokenizer_file, eos_token, eos_id, data)


def check_weights_fit(ckpt: Path, weights: dict[str, torch.Tensor], model_config: LlamaConfig) -> None:
    """CheckpointError naming the tensors whose names or shapes are not those of the model meta.json records (one of
    the two edited or replaced): loading them would fail inside torch, or an export silently drop layers."""
    with torch.device("meta"):  # names and shapes only: no memory, no init work
        expected = {name: tuple(t.shape) for name, t in LlamaWeights(model_config).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    reshaped = [f"{name} {found[name]} instead of {expected[name]}" for name in expected
                if name in found and found[name] != expected[name]]
    if not (missing or unexpected or reshaped):
        return
    shape = ", ".join(f"{k}={getattr(model_config, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                                   "vocab_size", "tie_embeddings"))
    wrong = "; ".join(f"{what}: {', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}"
                      for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shapes", reshaped)) if names)
    raise CheckpointError(f"checkpoint {ckpt}: its weights do not fit the model its {META_FILE} describes ({shape}): "
                          f"{wrong} ({META_FILE}'s \"model\" or the weights edited by hand or by another tool); restore "
                          f"the {META_FILE} the run wrote, or choose another checkpoint; nothing was written")


def run_prepared_data(meta: dict[str, Any]) -> PreparedData:
    """The prepared folder the run trained on (recorded_prepared_data); where that folder is gone (or the
    checkpoint predates the record), the run's data prepared again from its data.source (reused from
    data.cache_dir when the inputs are unchanged)."""
    cfg = run_data_config(meta)
    data = recorded_prepared_data(meta, cfg.verify_shards)
    if data is not None:
        return data
    folder = meta.get("prepared_data")
    try:
        return prepare(cfg)
    except DataError as e:
        gone = f"the run's prepared data {folder} is gone" if folder is not None else "the checkpoint records no prepared data"
        raise DataError(f"{gone}, and preparing it again failed: {e}. {TOOLS_FIX}") from e


def run_data_config(meta: dict[str, Any]) -> DataConfig:
    """The data config of the run that wrote a checkpoint (its meta.json), as that run used it: with
    model.init_from's tokenizer where it set no data.tokenizer (DataConfig.for_model)."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in meta["config"]["data"].items() if k in known})
    return data.for_model((meta["config"].get("model") or {}).get("init_from"))


def load_eager_model(ckpt: TrainedCheckpoint, device: torch.device, compute_dtype: torch.dtype) -> EagerLlama:
    """The checkpoint's weights in the eager model (any impl's checkpoint: one parameter layout), eval mode."""
    model = build_model(ckpt.model_config, "eager", compute_dtype=compute_dtype)
    model.load_state_dict(ckpt.weights)
    return model.to(device).eval()


def text_windows(ckpt: TrainedCheckpoint, texts: Iterable[str], seq_len: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) batches of the texts tokenized as documents (each followed by EOS, as in
    preparation) and cut into consecutive windows of seq_len + 1 tokens; a last partial batch is kept."""
    tokens, lengths = encode_documents(ckpt.tokenizer, list(texts), ckpt.eos_id, token_dtype(num_ids(ckpt.tokenizer)))
    n_windows = (len(tokens) - 1) // seq_len
    if (lengths == 1).all():  # each its EOS alone: no --seq-len can help
        raise DataError("the --text files hold no text to score (empty); pass files with text")
    if n_windows == 0:
        raise DataError(f"the --text files hold {len(tokens)} tokens (an EOS after each file), fewer than one window of "
                        f"{seq_len}+1; pass --seq-len {len(tokens) - 1} or less, or longer texts")
    windows = np.stack([tokens[w * seq_len: w * seq_len + seq_len + 1] for w in range(n_windows)]).astype(np.int64)
    # a generator expression, not a generator function: texts too short are refused here, before the model is loaded
    return ((batch[:, :-1], batch[:, 1:]) for batch in torch.from_numpy(windows).split(batch_size))


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[float, int]:
    """(mean next-token cross-entropy over every target token, number of target tokens)."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        loss = model(inputs.to(device), targets.to(device))
        total += loss.item() * targets.numel()
        count += targets.numel()
    if count == 0:
        raise DataError("no batches to evaluate: the data is shorter than one batch")
    return total / count, count
