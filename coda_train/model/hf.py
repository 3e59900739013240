"""Hugging Face Llama interop: export our weights as a `transformers` Llama checkpoint, and
initialize our model from one.

The two layouts compute the same function once three conventions are mapped:
- RoPE: we rotate interleaved pairs (2i, 2i+1) of a head, transformers rotates halves (i, i+hd/2),
  both by angle t * theta^(-2i/hd). Reordering each q and k head's rows to [even | odd] turns
  one into the other, and q.k is unchanged when q and k are permuted alike.
- Fused projections: w_qkv = [q heads | k heads | v heads], w_gate_up = [gate | up].
- Tied embeddings: the LM head is tok_emb (`tie_word_embeddings`), so no lm_head tensor is written.
transformers and safetensors are the `hf` extra; only this module needs them.

Starting a run from a Hugging Face directory DIR: cfg = llama_config_from_hf(DIR) (its shape, not a
preset's), model = build_model(cfg, ...), load_hf_weights(model, DIR); DIR's tokenizer.json is the
data tokenizer unless one is given (data.tokenizer=DIR).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..data.tokenizer import num_ids
from ..errors import ConfigError
from .config import LlamaConfig
from .weights import LlamaWeights, rope_rows_to_halves, rope_rows_to_interleaved

# BOS names of common tokenizers (Llama-3, Llama-2/Mistral, Gemma); a tokenizer with none of them
# (our trained BPE) starts documents after its EOS, which then serves as BOS too (as in GPT-2).
KNOWN_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")


def _require_hf():
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        raise ConfigError(f"Hugging Face interop needs transformers and safetensors ({e}); "
                          "pip install -e '.[hf]'") from e
    return transformers


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """Our parameters (LlamaWeights.state_dict()) under transformers' LlamaForCausalLM names."""
    hd, f = cfg.head_dim, cfg.ffn_dim
    out = {"model.embed_tokens.weight": state_dict["tok_emb"], "model.norm.weight": state_dict["norm"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state_dict["lm_head"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state_dict[ours + "w_qkv"].split([cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd])
        out[theirs + "self_attn.q_proj.weight"] = rope_rows_to_halves(q, cfg.n_heads)
        out[theirs + "self_attn.k_proj.weight"] = rope_rows_to_halves(k, cfg.n_kv_heads)
        out[theirs + "self_attn.v_proj.weight"] = v
        out[theirs + "self_attn.o_proj.weight"] = state_dict[ours + "w_o"]
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = state_dict[ours + "w_gate_up"].split([f, f])
        out[theirs + "mlp.down_proj.weight"] = state_dict[ours + "w_down"]
        out[theirs + "input_layernorm.weight"] = state_dict[ours + "attn_norm"]
        out[theirs + "post_attention_layernorm.weight"] = state_dict[ours + "mlp_norm"]
    return {name: t.contiguous() for name, t in out.items()}


def from_hf_state_dict(hf: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """transformers' LlamaForCausalLM tensors as our state_dict; ConfigError names missing or extra tensors."""
    with torch.device("meta"):  # names and shapes only: no memory, no init work
        expected = set(to_hf_state_dict(LlamaWeights(cfg).state_dict(), cfg))
    # a tied checkpoint may still carry lm_head.weight (a copy of the embedding), and old ones the
    # rotary inv_freq buffers (a function of rope_theta): neither is needed
    present = {name for name in hf if not name.endswith("rotary_emb.inv_freq")}
    present -= {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ConfigError(f"the Hugging Face weights do not fit the model of its config.json: missing {missing[:8]}, "
                          f"unexpected {unexpected[:8]}; only plain Llama checkpoints (LlamaForCausalLM) are supported")
    out = {"tok_emb": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "w_qkv"] = torch.cat((rope_rows_to_interleaved(hf[theirs + "self_attn.q_proj.weight"], cfg.n_heads),
                                         rope_rows_to_interleaved(hf[theirs + "self_attn.k_proj.weight"], cfg.n_kv_heads),
                                         hf[theirs + "self_attn.v_proj.weight"]))
        out[ours + "w_o"] = hf[theirs + "self_attn.o_proj.weight"]
        out[ours + "w_gate_up"] = torch.cat((hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"]))
        out[ours + "w_down"] = hf[theirs + "mlp.down_proj.weight"]
        out[ours + "attn_norm"] = hf[theirs + "input_layernorm.weight"]
        out[ours + "mlp_norm"] = hf[theirs + "post_attention_layernorm.weight"]
    return out


def hf_config(cfg: LlamaConfig, *, bos_token_id: Optional[int], eos_token_id: Optional[int], dtype: torch.dtype):
    """transformers.LlamaConfig of our model config."""
    transformers = _require_hf()
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None,
        architectures=["LlamaForCausalLM"], dtype=str(dtype).removeprefix("torch."))
    # also the top-level key of published Llama 3 config.json files: readers of that format (transformers 4.x)
    # ignore rope_parameters and would rotate by their default theta 10000, another model; v5 reads rope_parameters
    config.rope_theta = float(cfg.rope_theta)
    return config


def _inside_a_checkpoint(path: Path) -> Optional[Path]:
    """The checkpoint folder (a run's checkpoints/step_N or one set aside) that holds `path`, or None."""
    from coda_train.trainer.checkpoint import CHECKPOINTS_DIR, SET_ASIDE, STEP_DIR  # here: as in _why_not_a_model_dir

    path = path.absolute()
    return next((p for p in (path, *path.parents) if p.parent.name == CHECKPOINTS_DIR
                 and (STEP_DIR.match(p.name) or SET_ASIDE.match(p.name))), None)


def _why_not_a_model_dir(path: Path) -> str:
    """What `path`, which holds no config.json, is instead, and the fix: the message's tail after the path."""
    from coda_train.trainer.checkpoint import CHECKPOINTS_DIR, META_FILE  # here: the trainer imports this module's package

    if path.is_file():  # e.g. the model's config.json or model.safetensors
        return f"is a file: point at the directory that holds the model, {path.parent}"
    if (path / CHECKPOINTS_DIR).is_dir() or (path / META_FILE).is_file():  # a coda-train run dir or checkpoint
        return (f"is a coda-train run or checkpoint, not a Hugging Face model: export it first "
                f"(python scripts/export_hf.py {path} --out DIR) and point at DIR")
    what = "does not exist" if not path.exists() else "has no config.json"
    return f"{what}: point at a local Hugging Face model directory (one written by save_pretrained or scripts/export_hf.py)"


def llama_config_from_hf(hf_dir: str | Path) -> LlamaConfig:
    """Our LlamaConfig of a local Hugging Face Llama directory's config.json; ConfigError naming every
    setting our model cannot express."""
    transformers = _require_hf()
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} {_why_not_a_model_dir(path)}")
    fix = "repair it, or export the model again (scripts/export_hf.py, or save_pretrained)"
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:  # not JSON, or not text
        raise ConfigError(f"{path}/config.json is not valid JSON ({e}): {fix}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}/config.json holds a {type(raw).__name__}, not an object of settings: {fix}")
    if raw.get("model_type") != "llama":
        raise ConfigError(f"{path}/config.json is model_type={raw.get('model_type')!r}; only 'llama' models can be loaded")
    try:
        hf = transformers.LlamaConfig.from_pretrained(path)
    except Exception as e:  # transformers' checks raise KeyError, ValueError, TypeError or huggingface_hub's own errors
        raise ConfigError(f"{path}/config.json is not a valid Llama config, transformers refuses it "
                          f"({type(e).__name__}: {e}): {fix}") from e
    rope = dict(hf.rope_parameters or {})
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    unsupported = {
        "rope scaling (rope_parameters.rope_type)": (rope.get("rope_type", "default"), "default"),
        "hidden_act": (hf.hidden_act, "silu"),
        "attention_bias": (hf.attention_bias, False),
        "mlp_bias": (hf.mlp_bias, False),
        "attention_dropout": (float(hf.attention_dropout or 0.0), 0.0),
        "head_dim": (head_dim, hf.hidden_size // hf.num_attention_heads),
    }
    bad = [f"{name}={value!r} (we support {ours!r})" for name, (value, ours) in unsupported.items() if value != ours]
    if bad:
        raise ConfigError(f"{path}/config.json sets what this model cannot express: {'; '.join(bad)}")
    return LlamaConfig(dim=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
                       n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads, ffn_dim=hf.intermediate_size,
                       vocab_size=hf.vocab_size, rope_theta=float(rope["rope_theta"]), norm_eps=float(hf.rms_norm_eps),
                       max_seq_len=hf.max_position_embeddings, tie_embeddings=bool(hf.tie_word_embeddings),
                       init_std=float(hf.initializer_range)).validate()


def hf_weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a local HF directory: model.safetensors, or the shards its index lists; ConfigError
    naming what is missing. Cheap (no tensor is read), so a run checks it before data preparation."""
    _require_hf()
    from huggingface_hub import constants

    path = Path(hf_dir)
    index = path / constants.SAFETENSORS_INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not names or not all(isinstance(name, str) for name in names):
                raise ValueError("its weight_map names no shard files")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} is damaged (no readable weight_map: {e!r}); export the model again "
                              "(scripts/export_hf.py, or save_pretrained)") from e
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ConfigError(f"{path} lacks {', '.join(missing)} of the shards its {index.name} lists; copy the "
                              "whole directory, or export the model again")
        return [path / name for name in names]
    if (path / constants.SAFETENSORS_SINGLE_FILE).is_file():
        return [path / constants.SAFETENSORS_SINGLE_FILE]
    raise ConfigError(f"{path} has no {constants.SAFETENSORS_SINGLE_FILE} or {constants.SAFETENSORS_INDEX_FILE}; "
                      "only safetensors checkpoints are read (save with safe_serialization=True): copy the weights "
                      "there, or point model.init_from at a directory that has them")


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, Tensor]:
    """Every tensor of a local HF directory's model.safetensors, or of its shards listed in the index."""
    from huggingface_hub import load_state_dict_from_file

    state: dict[str, Tensor] = {}
    for file in hf_weight_files(hf_dir):
        state.update(load_state_dict_from_file(file, map_location="cpu"))
    return state


@torch.no_grad()
def load_hf_weights(model: LlamaWeights, hf_dir: str | Path) -> None:
    """Copy a local HF Llama directory's weights into `model` (built from llama_config_from_hf(hf_dir);
    max_seq_len and init_std may differ), cast to the model's fp32 master dtype."""
    cfg = llama_config_from_hf(hf_dir)
    # init_std only matters at init, max_seq_len only bounds positions: the model may choose its own
    if dataclasses.replace(cfg, init_std=model.cfg.init_std, max_seq_len=model.cfg.max_seq_len) != model.cfg:
        raise ConfigError(f"the model was built with {model.cfg}, but {hf_dir} holds {cfg}; build it from "
                          "llama_config_from_hf(dir)")
    ours = from_hf_state_dict(read_hf_state_dict(hf_dir), cfg)
    mine = model.state_dict()
    for name, tensor in ours.items():
        if tensor.shape != mine[name].shape:
            raise ConfigError(f"{hf_dir}: tensor for {name} has shape {tuple(tensor.shape)}, the config implies "
                              f"{tuple(mine[name].shape)}; the checkpoint and its config.json disagree")
    model.load_state_dict({name: t.to(mine[name].dtype) for name, t in ours.items()}, strict=True)


def check_export(out_dir: str | Path, max_shard_size: int | str) -> Path:
    """out_dir as a Path where an export can go (absent or an empty directory) with a valid max_shard_size, and the
    `hf` extra installed; ConfigError naming the fix otherwise. Needs no checkpoint: callers run it before opening one."""
    _require_hf()
    out = Path(out_dir)
    if out.is_symlink():  # the export goes where the link points: it is published by renaming a folder onto that path
        out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; choose a new --out (nothing was written)")
    checkpoint = _inside_a_checkpoint(out)
    if checkpoint is not None:
        raise ConfigError(f"--out={out} is inside the checkpoint {checkpoint}, which trainer.keep_last removes whole when "
                          f"newer checkpoints are saved; choose an --out outside the run's checkpoints folder")
    above = next(p for p in out.absolute().parents if p.exists())  # where the export's folders would be made
    if not above.is_dir():
        raise ConfigError(f"--out={out}: {above} is a file, not a directory; choose an --out under a directory")
    if isinstance(max_shard_size, str) and (not re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]B\s*", max_shard_size, re.IGNORECASE)
                                            or float(re.sub(r"[^\d.]", "", max_shard_size)) <= 0):
        raise ConfigError(f"--max-shard-size={max_shard_size!r} is not a size such as 5GB or 500MB (units KB, MB, GB, TB)")
    return out


def export_hf(state_dict: dict[str, Tensor], cfg: LlamaConfig, out_dir: str | Path, *, tokenizer_file: str | Path,
              eos_token: str, dtype: torch.dtype = torch.float32, max_shard_size: int | str = "5GB") -> Path:
    """Write a Hugging Face Llama directory (config.json, safetensors weights sharded by
    huggingface_hub above max_shard_size, tokenizer files, generation_config.json) that
    LlamaForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load. out_dir must not exist
    or be empty; it appears complete or not at all (written next to it, then renamed; the working directory, written
    inside it, then its files moved up)."""
    transformers = _require_hf()
    from huggingface_hub import save_torch_state_dict
    from tokenizers import Tokenizer

    out = check_export(out_dir, max_shard_size)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    check_tokenizer_fits(tokenizer, cfg, str(tokenizer_file))
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ConfigError(f"the tokenizer {tokenizer_file} has no EOS token {eos_token!r}")
    bos_token = next((t for t in KNOWN_BOS_TOKENS if tokenizer.token_to_id(t) is not None), eos_token)
    bos_id = tokenizer.token_to_id(bos_token)
    unk_token = json.loads(tokenizer.to_str())["model"].get("unk_token")  # None for byte-level BPE: no input is unknown
    # ids past the tokenizer's vocabulary are rows that pad the embedding; generation never picks them
    padding_ids = list(range(num_ids(tokenizer), cfg.vocab_size)) or None

    # --out . (the working directory, empty): renamed onto, the folder a shell is in would be replaced; its files are moved in
    in_place = out.exists() and out.samefile(Path.cwd())
    out = Path.cwd() if in_place else out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out if in_place else out.parent))
    moved = []
    try:  # a full disk, a kill: no half-written folder is left next to the export
        hf_config(cfg, bos_token_id=bos_id, eos_token_id=eos_id, dtype=dtype).save_pretrained(tmp)
        # copies: split views of one fused tensor share storage, which safetensors refuses to write
        weights = {name: t.detach().to("cpu", dtype, copy=True) for name, t in to_hf_state_dict(state_dict, cfg).items()}
        save_torch_state_dict(weights, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos_token, eos_token=eos_token,
                                             unk_token=unk_token, model_max_length=cfg.max_seq_len).save_pretrained(tmp)
        # ours byte for byte (transformers adds a no-op post-processor): the same fingerprint, so
        # data.tokenizer=DIR is recognized as the tokenizer the model was trained with
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        transformers.GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                                      suppress_tokens=padding_ids).save_pretrained(tmp)
        # the export is for others to read: mkdtemp makes the dir private, safetensors its weight files (0600)
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        if in_place:
            for file in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):  # config.json, what loaders open, last
                os.rename(file, out / file.name)
                moved.append(out / file.name)
            tmp.rmdir()
        else:
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for file in moved:
            file.unlink(missing_ok=True)
        raise
    return out


def check_tokenizer_fits(tokenizer, cfg: LlamaConfig, where: str) -> None:
    """ConfigError when the tokenizer has ids the model has no embedding row for."""
    ids = num_ids(tokenizer)  # reads the whole vocabulary: once
    if ids > cfg.vocab_size:
        raise ConfigError(f"the tokenizer {where} has {ids} tokens but the model's vocab_size is "
                          f"{cfg.vocab_size}: it is not the tokenizer this model was trained with; pass the run's own tokenizer")
