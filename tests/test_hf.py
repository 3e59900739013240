"""Hugging Face interop, evaluation and sampling on CPU: a tiny run trained by train.py, exported
with scripts/export_hf.py and loaded by transformers; HF Llama checkpoints imported into our model;
scripts/eval.py and scripts/sample.py on the tiny checkpoint; the errors users can cause."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")  # the `hf` extra (in `dev`)

from coda_train.data import DataError, TokenLoader  # noqa: E402
from coda_train.data.tokenizer import EOS_TOKEN, fingerprint, load_tokenizer, train_bpe  # noqa: E402
from coda_train.errors import ConfigError  # noqa: E402
from coda_train.inference import (find_checkpoint, load_eager_model, mean_loss, open_checkpoint,  # noqa: E402
                                  text_windows)
from coda_train.model import LlamaConfig, build_model  # noqa: E402
from coda_train.model.eager import KVCache  # noqa: E402
from coda_train.trainer.checkpoint import list_checkpoints  # noqa: E402
from coda_train.model.generate import generate, next_token_distribution  # noqa: E402
from coda_train.model.hf import (export_hf, from_hf_state_dict, hf_config, hf_weight_files,  # noqa: E402
                                 llama_config_from_hf, load_hf_weights, to_hf_state_dict)
from coda_train.trainer.checkpoint import CheckpointError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = "def parse(path):\n    with open(path) as f:\n        return [line.split() for line in f]\n"


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # PYTHONPATH: the scripts import this checkout's coda_train, not whichever one is installed
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, f"scripts/{name}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained_run(tiny, tmp_path_factory) -> Path:
    """A 12-step run of the tiny model (vocab 384 = the 300-token BPE padded to a multiple of 128)."""
    run_dir = tmp_path_factory.mktemp("hf_run")
    result = subprocess.run([sys.executable, "train.py", *tiny, f"trainer.run_dir={run_dir}", "trainer.max_steps=12",
                             "model.impl=eager"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_export") / "tiny-llama"
    result = run_script("export_hf.py", str(trained_run), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model.safetensors" in result.stdout
    return out


@pytest.fixture
def hf_load_warnings(caplog):
    """Warnings transformers logs (it does not propagate to the root logger by default)."""
    transformers.logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="transformers")
    yield lambda: [r.getMessage() for r in caplog.records if r.name.startswith("transformers") and r.levelno >= logging.WARNING]
    transformers.logging.disable_propagation()


def tiny_model(tie: bool = True, vocab_size: int = 320) -> tuple[LlamaConfig, torch.nn.Module]:
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=vocab_size, max_seq_len=64,
                      rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_model(cfg, "eager", compute_dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.2)
    return cfg, model


def tokenizer_file(tmp_path: Path, vocab_size: int = 300) -> Path:
    texts = [p.read_text()[:3000] for p in sorted((REPO / "coda_train").rglob("*.py"))[:30]]
    path = tmp_path / f"tokenizer-{vocab_size}.json"
    train_bpe(texts, vocab_size).save(str(path))
    return path


def tiny_cache(tiny: list[str]) -> str:
    """The data.cache_dir the tiny fixture's overrides name."""
    return next(o.split("=", 1)[1] for o in tiny if o.startswith("data.cache_dir="))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- export: our checkpoint -> transformers -------------------------------------------------

def test_exported_checkpoint_loads_in_transformers_with_our_logits(trained_run, exported, hf_load_warnings):
    ckpt = open_checkpoint(trained_run)
    ours = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(exported, output_loading_info=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf_load_warnings() == []
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.tie_word_embeddings and hf.config.vocab_size == 384 and hf.dtype == torch.float32

    ids = ckpt.tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert hf_tokenizer(TEXT).input_ids == ids and hf_tokenizer.decode(ids) == TEXT
    assert hf_tokenizer.eos_token == hf_tokenizer.bos_token == EOS_TOKEN == ckpt.eos_token
    assert hf.generation_config.eos_token_id == ckpt.eos_id
    assert hf.generation_config.suppress_tokens == list(range(300, 384))  # padded rows are never generated
    tokens = torch.tensor([ids])
    with torch.no_grad():
        assert rel_err(hf(tokens).logits, ours.logits(tokens)) < 1e-5
    # the trainer's tokenizer path for a Hugging Face directory finds the very tokenizer of the run
    tokenizer, eos = load_tokenizer(str(exported))
    assert fingerprint(tokenizer) == fingerprint(ckpt.tokenizer) and eos == ckpt.eos_token
    assert open_checkpoint(trained_run, tokenizer=str(exported)).eos_id == ckpt.eos_id


def test_load_warning_capture_sees_a_missing_weight(tmp_path, hf_load_warnings):
    """Control for the test above: a tensor removed from an export is reported, so [] means none."""
    from safetensors.torch import load_file, save_file

    cfg, model = tiny_model()
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tokenizer_file(tmp_path), eos_token=EOS_TOKEN)
    weights = load_file(out / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    transformers.LlamaForCausalLM.from_pretrained(out)
    assert any("model.norm.weight" in m and "MISSING" in m for m in hf_load_warnings())
    with pytest.raises(ConfigError, match="missing.*model.norm.weight"):
        load_hf_weights(build_model(llama_config_from_hf(out), "eager"), out)


def test_large_export_is_sharded_by_huggingface_hub_and_loads(tmp_path, hf_load_warnings):
    cfg, model = tiny_model(tie=False)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tokenizer_file(tmp_path),
                    eos_token=EOS_TOKEN, max_shard_size="100KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf_load_warnings() == []
    tokens = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert rel_err(hf(tokens).logits, model.logits(tokens)) < 1e-5
    imported = build_model(llama_config_from_hf(out), "eager")
    load_hf_weights(imported, out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name


def test_exported_config_json_names_rope_theta_as_published_llama_configs_do(tmp_path):
    """Published Llama 3 config.json files set rope_theta at the top level; readers of that format (transformers 4.x)
    ignore v5's rope_parameters and take their default theta 10000: without the key an export loads there as another
    model, silently (was: rope_parameters only)."""
    cfg, model = tiny_model()
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tokenizer_file(tmp_path), eos_token=EOS_TOKEN)
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == cfg.rope_theta == 500000.0
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert transformers.LlamaConfig.from_pretrained(out).rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert llama_config_from_hf(out) == cfg


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_training_step_gives_transformers_loss_and_gradients(tie):
    """Not only the logits: next-token loss and the gradient of every parameter equal transformers' LlamaForCausalLM
    on the same weights (GQA, odd vocab), with transformers shifting the labels itself: our targets are the tokens
    shifted by one, and the q/k row reordering of the export maps gradients too."""
    cfg, ours = tiny_model(tie, vocab_size=101)
    with torch.no_grad():  # away from the near-uniform attention and logits of the 0.02 init
        for p in ours.parameters():
            if p.dim() == 2:
                p.mul_(10)
    hf = transformers.LlamaForCausalLM(hf_config(cfg, bos_token_id=None, eos_token_id=None, dtype=torch.float32))
    hf.load_state_dict(to_hf_state_dict({k: v.detach().clone() for k, v in ours.state_dict().items()}, cfg),
                       strict=not tie)  # tied: no lm_head.weight, the embedding is the LM head
    tokens = torch.randint(0, cfg.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))
    loss = ours(tokens[:, :-1], tokens[:, 1:])
    hf_loss = hf(tokens, labels=tokens).loss
    loss.backward()
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) < 1e-5 * loss.item()
    hf_grads = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    ours_from_hf = from_hf_state_dict(hf_grads, cfg)
    assert ours_from_hf.keys() == dict(ours.named_parameters()).keys()
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, ours_from_hf[name]) < 1e-4, name


def test_exported_files_are_readable_by_others(tmp_path):
    """safetensors writes its files 0600: every file of an export, each shard too, is 0644 in a 0755 directory."""
    cfg, model = tiny_model()
    tokenizer = tokenizer_file(tmp_path)
    for out, max_shard_size in ((tmp_path / "whole", "5GB"), (tmp_path / "sharded", "100KB")):
        export_hf(model.state_dict(), cfg, out, tokenizer_file=tokenizer, eos_token=EOS_TOKEN, max_shard_size=max_shard_size)
        assert list(out.glob("*.safetensors")) and out.stat().st_mode & 0o777 == 0o755
        assert {file.name: file.stat().st_mode & 0o777 for file in out.iterdir()} == \
            {file.name: 0o644 for file in out.iterdir()}


# ---- import: transformers -> ours ---------------------------------------------------------

def hf_llama(tmp_path: Path, tie: bool, **overrides) -> tuple[Path, torch.nn.Module]:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **overrides)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    path = tmp_path / f"hf-tie{tie}"
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("tie", [True, False])
def test_hf_to_ours_to_hf_is_the_identity(tmp_path, tie):
    path, hf = hf_llama(tmp_path, tie)
    cfg = llama_config_from_hf(path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (64, 2, 8, 2, 160, 96)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len, cfg.tie_embeddings) == (500000.0, 1e-6, 128, tie)
    ours = build_model(cfg, "eager")
    load_hf_weights(ours, path)
    back = to_hf_state_dict(ours.state_dict(), cfg)
    expected = {k: v for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    old_style = {**back, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}  # buffers older saves hold
    assert from_hf_state_dict(old_style, cfg).keys() == ours.state_dict().keys()
    tokens = torch.randint(0, 96, (2, 21))
    with torch.no_grad():
        assert rel_err(ours.logits(tokens), hf(tokens).logits) < 1e-5


@pytest.mark.parametrize("overrides, named", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16"),
])
def test_unsupported_hf_config_is_a_clear_config_error(tmp_path, overrides, named):
    base = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 1,
            "num_attention_heads": 8, "num_key_value_heads": 2}
    rope = overrides.pop("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    transformers.LlamaConfig(**base, rope_parameters=rope, **overrides).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(named)) as e:
        llama_config_from_hf(tmp_path)
    assert "cannot express" in str(e.value)


def test_not_a_llama_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        llama_config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2'.*only 'llama'"):
        llama_config_from_hf(tmp_path)


def test_init_from_a_run_dir_a_file_or_a_missing_path_names_what_it_is(tmp_path):
    """model.init_from pointing at a coda-train run (not an export of it), at the model's config.json, or at nothing
    is told as such, with the fix (was: "<path> has no config.json" for all three)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000020").mkdir(parents=True)
    for path, named in ((run, f"is a coda-train run or checkpoint, not a Hugging Face model: export it first "
                              f"(python scripts/export_hf.py {run} --out DIR)"),
                        (tmp_path / "nope", "does not exist: point at a local Hugging Face model directory")):
        with pytest.raises(ConfigError, match=re.escape(f"{path} {named}")):
            llama_config_from_hf(path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=re.escape(f"is a file: point at the directory that holds the model, {model}")):
        llama_config_from_hf(model / "config.json")


@pytest.mark.parametrize("content, named", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a list, not an object of settings"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_a_damaged_or_invalid_config_json_is_a_config_error_naming_the_file(tmp_path, content, named):
    path, _ = hf_llama(tmp_path, tie=True)
    if isinstance(content, dict):
        content = json.dumps({**json.loads((path / "config.json").read_text()), **content})
    (path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=re.escape(named)) as e:
        llama_config_from_hf(path)
    assert f"{path}/config.json" in str(e.value) and "export the model again" in str(e.value)


def test_exported_then_imported_model_continues_with_the_same_loss(trained_run, exported):
    """Continued pretraining starts where the exported model stood: same weights, same loss on the
    run's own batch, for the eager and the coda model."""
    ckpt = open_checkpoint(trained_run)
    inputs, targets = TokenLoader(ckpt.data, "train", 4, 32, seed=7).next_batch()
    cfg = llama_config_from_hf(exported)
    assert cfg == dataclasses.replace(ckpt.model_config, init_std=cfg.init_std)
    for impl in ("eager", "coda"):
        exported_model, imported = build_model(ckpt.model_config, impl), build_model(cfg, impl)
        exported_model.load_state_dict(ckpt.weights)
        load_hf_weights(imported, exported)
        for name, tensor in ckpt.weights.items():
            assert torch.equal(imported.state_dict()[name], tensor), name
        with torch.no_grad():
            assert imported(inputs, targets).item() == exported_model(inputs, targets).item()


def _train_cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=300)


def _last_val_loss(run_dir: Path) -> float:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "val_loss" in m][-1]["val_loss"]


def test_continued_pretraining_from_an_export_starts_at_the_loss_it_ended_at(trained_run, exported, tiny, tmp_path):
    """model.init_from: a run started from the exported directory (its shape, weights and tokenizer)
    begins at the exported run's final validation loss: one step at a negligible learning rate, then
    the same validation batches of the same prepared corpus."""
    run_dir = tmp_path / "continued"
    # data.vocab_size: a trained BPE's size, which the export's tokenizer makes moot (the reopened run must see that)
    result = _train_cli(*tiny, f"trainer.run_dir={run_dir}", f"model.init_from={exported}", "trainer.max_steps=1",
                        "optim.lr=1e-12", "optim.warmup_steps=1", "trainer.eval_every=1", "data.vocab_size=400")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny-llama" in result.stdout  # the log names the model it started from
    assert "both choose the model" not in result.stdout + result.stderr  # the default preset is no choice
    assert abs(_last_val_loss(run_dir) - _last_val_loss(trained_run)) < 1e-5
    # the tools that reopen a run's data find the data it trained on (the export's tokenizer), preparing none
    prepared = sorted(p.name for p in (Path(tiny_cache(tiny))).iterdir())
    result = run_script("eval.py", str(run_dir), "--max-batches", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (Path(tiny_cache(tiny))).iterdir()) == prepared


def test_a_preset_chosen_beside_init_from_is_said_to_be_unused(exported, tiny, tmp_path):
    """model=llama3_1b with model.init_from trains init_from's model, while config.yaml records the preset: the log
    names both and the one used (model.preset=... the same)."""
    for choice in ("model=llama3_1b", "model.preset=llama3_1b"):
        run_dir = tmp_path / choice.split("=")[0]
        result = _train_cli(*tiny, choice, f"trainer.run_dir={run_dir}", f"model.init_from={exported}",
                            "trainer.max_steps=1", "trainer.eval_every=0")
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-3000:]
        assert (f"{choice} and model.init_from={exported} both choose the model: the run takes model.init_from's "
                "shape and weights, and the preset llama3_1b is not used") in out, out[-3000:]
        assert f"Drop {choice}, or drop model.init_from to train llama3_1b from scratch" in out
        log = (run_dir / "train.log").read_text()  # said before the run held its dir, and in its log all the same
        assert log.count("the preset llama3_1b is not used") == 1 and log.index("is not used") < log.index("step 1")
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert recorded["model"]["preset"] == "llama3_1b" and recorded["resolved_model"]["dim"] == 64


@pytest.mark.parametrize("override, named", [("model.dim=128", "model.dim=128 (the checkpoint has 64)"),
                                             ("model.tie_embeddings=false", "model.tie_embeddings=False")])
def test_init_from_refuses_shape_overrides_before_data_preparation(exported, tiny, tmp_path, override, named):
    cache = tmp_path / "cache"
    result = _train_cli(*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={exported}", override,
                        f"data.cache_dir={cache}")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and named in out and "remove those overrides" in out
    assert not cache.exists()  # refused before any data work


def test_init_from_with_a_data_tokenizer_larger_than_its_vocab_is_refused_before_data_preparation(exported, tiny, tmp_path):
    """data.tokenizer is read before the corpus is tokenized with it: one with more tokens than model.init_from's
    vocabulary (or a set model.vocab_size) is refused first, not after the preparation (hours for a large corpus)."""
    big = tokenizer_file(tmp_path, 500)
    cache = tmp_path / "cache"
    for model in (f"model.init_from={exported}", "model.vocab_size=384"):
        result = _train_cli(*tiny, f"trainer.run_dir={tmp_path / 'run'}", model, f"data.tokenizer={big}",
                            f"data.cache_dir={cache}")
        out = result.stdout + result.stderr
        assert result.returncode == 1 and "500 tokens" in out and "Traceback" not in out, out[-3000:]
        assert not cache.exists()  # refused before any data work


def test_init_from_without_weights_is_refused_before_data_preparation(exported, tiny, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(exported, no_weights)
    (no_weights / "model.safetensors").unlink()
    cache = tmp_path / "cache"
    result = _train_cli(*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={no_weights}",
                        f"data.cache_dir={cache}")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and f"{no_weights} has no model.safetensors" in out and "Traceback" not in out
    assert not cache.exists()  # refused before any data work
    # a sharded checkpoint missing one of the shards its index lists
    (no_weights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="lacks model-00001-of-00002.safetensors of the shards"):
        hf_weight_files(no_weights)
    for damaged in ("{", json.dumps({"weight_map": {}}), json.dumps({"weight_map": {"a": 1}})):
        (no_weights / "model.safetensors.index.json").write_text(damaged)
        with pytest.raises(ConfigError, match="model.safetensors.index.json is damaged"):
            hf_weight_files(no_weights)


def test_a_run_from_init_from_resumes_without_its_weights(exported, tiny, tmp_path):
    """A resumed run takes its weights from its checkpoint: model.init_from's may be gone by then (its config and
    tokenizer are still read)."""
    start = tmp_path / "start"
    shutil.copytree(exported, start)
    run = [*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={start}", "trainer.ckpt_every=2"]
    assert _train_cli(*run, "trainer.max_steps=2").returncode == 0
    (start / "model.safetensors").unlink()
    result = _train_cli(*run, "trainer.max_steps=4")
    assert result.returncode == 0, (result.stdout + result.stderr)[-2000:]
    assert "resumed from" in result.stdout + result.stderr


def _metrics_without_timing(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "elapsed_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_from_init_from_resumes_after_that_directory_is_gone(exported, tiny, tmp_path):
    """model.init_from deleted after the run began (an HF cache cleaned): the resumed run takes the model's shape
    from its checkpoint and its data from the checkpoint's prepared folder (its tokenizer was that directory's),
    and continues as the uninterrupted run does; a new run from the missing directory still stops at once."""
    start = tmp_path / "start"
    shutil.copytree(exported, start)
    # validation at every checkpoint: the interrupted run validates at its last step, as the straight one must
    run = [*tiny, f"model.init_from={start}", "trainer.ckpt_every=2", "trainer.eval_every=2",
           f"data.cache_dir={tmp_path / 'cache'}"]
    straight = _train_cli(*run, f"trainer.run_dir={tmp_path / 'straight'}", "trainer.max_steps=4")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _train_cli(*run, f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2").returncode == 0
    prepared = sorted((tmp_path / "cache").iterdir())
    shutil.rmtree(start)

    result = _train_cli(*run, f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=4")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert (f"model.init_from={start} holds no config.json any more: this resumed run takes the model's shape and its "
            f"prepared data from its checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_00000002'}") in out
    assert _metrics_without_timing(tmp_path / "run") == _metrics_without_timing(tmp_path / "straight")
    assert sorted((tmp_path / "cache").iterdir()) == prepared  # nothing prepared again

    result = _train_cli(*run, f"trainer.run_dir={tmp_path / 'new'}", f"data.cache_dir={tmp_path / 'new-cache'}")
    assert result.returncode == 1 and f"{start} does not exist" in result.stdout + result.stderr
    assert not (tmp_path / "new-cache").exists()  # refused before any data work


def test_a_resume_that_cannot_find_its_data_without_init_from_names_the_fix(exported, tiny, tmp_path):
    """model.init_from gone (its tokenizer the data's) and the checkpoint's prepared folder gone too, or other data
    settings: the resumed run stops before building the model, naming the fixes, and leaves the run as it was;
    data.tokenizer set to a copy of that tokenizer then continues it."""
    start, tokenizer = tmp_path / "start", tmp_path / "tokenizer"
    shutil.copytree(exported, start)
    shutil.copytree(exported, tokenizer, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
    run = [*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={start}", "trainer.ckpt_every=2",
           f"data.cache_dir={tmp_path / 'cache'}"]
    assert _train_cli(*run, "trainer.max_steps=2").returncode == 0
    shutil.rmtree(start)
    # a setting the prepared bytes do not depend on (the tokenizer is given) is no difference: the run goes on
    result = _train_cli(*run, "trainer.max_steps=2", "data.vocab_size=400")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name not in (".lock", "train.log")}

    result = _train_cli(*run, "trainer.max_steps=4", "data.val_fraction=0.2")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert ("this run's data settings differ from the checkpoint's (data.val_fraction: checkpoint 0.1 vs this run 0.2), "
            "and without model.init_from's tokenizer the data cannot be prepared again. Resume with the checkpoint's "
            f"data settings; or: Restore {start}, or set data.tokenizer to a copy of that model's tokenizer") in out

    # another (missing) directory than the one the run started from: refused, naming that one, before any data work
    result = _train_cli(*run, "trainer.max_steps=4", f"model.init_from={tmp_path / 'strat'}", f"data.tokenizer={tokenizer}",
                        f"data.cache_dir={tmp_path / 'other-cache'}")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and (f"model.init_from={tmp_path / 'strat'} has no config.json, and checkpoint "
                                       f"{tmp_path / 'run' / 'checkpoints' / 'step_00000002'} was trained from {start}: "
                                       f"resume with model.init_from={start}") in out, out[-3000:]
    # the model checks against the checkpoint's shape still come before any data work
    result = _train_cli(*run, "trainer.max_steps=4", f"data.tokenizer={tokenizer}", "trainer.seq_len=100000",
                        f"data.cache_dir={tmp_path / 'other-cache'}")
    assert result.returncode == 1 and "exceeds" in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    assert not (tmp_path / "other-cache").exists()

    (folder,) = (tmp_path / "cache").iterdir()
    folder.rename(tmp_path / "aside")
    result = _train_cli(*run, "trainer.max_steps=4")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and f"the checkpoint's prepared data ({folder}) is gone" in out, out[-3000:]
    assert f"Restore {start}, or set data.tokenizer to a copy of that model's tokenizer" in out
    assert "M params" not in out  # stopped before the model was built

    # damaged: never the advice to delete it and prepare again (impossible without that tokenizer; it holds a copy)
    shutil.copytree(tmp_path / "aside", folder)
    for shard in folder.glob("val_*.bin"):
        shard.unlink()
    result = _train_cli(*run, "trainer.max_steps=4")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "the checkpoint's prepared data cannot be read" in out, out[-3000:]
    assert f"; restore {start}, or set data.tokenizer" in out and "delete" not in out.lower()
    shutil.rmtree(folder)
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name not in (".lock", "train.log")}
    assert after == before

    result = _train_cli(*run, "trainer.max_steps=4", f"data.tokenizer={tokenizer}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert [m["step"] for m in _metrics_without_timing(tmp_path / "run")] == [1, 2, 3, 4]


def test_init_from_a_model_with_fewer_tokens_than_the_tokenizer_is_refused(exported):
    from coda_train.config import ModelConfig, resolve_model_config

    with pytest.raises(ConfigError, match=rf"model.init_from={exported} has vocab_size=384, fewer than the tokenizer's "
                                          r"500 tokens: train with that model's own tokenizer"):
        resolve_model_config(ModelConfig(init_from=str(exported)), 500, 32)
    assert resolve_model_config(ModelConfig(init_from=str(exported)), 300, 32).vocab_size == 384


def test_init_from_a_directory_without_a_model_is_a_clear_error(tiny, tmp_path):
    result = _train_cli(*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={tmp_path}")
    assert result.returncode == 1 and "has no config.json" in result.stdout + result.stderr


# ---- evaluation -------------------------------------------------------------------------

def test_eval_script_reports_loss_and_perplexity_of_the_val_split_and_of_text_files(trained_run, tmp_path):
    result = run_script("eval.py", str(trained_run), "--max-batches", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    loss, ppl = map(float, re.search(r"loss ([\d.]+) \| perplexity ([\d.]+)", result.stdout).groups())
    assert "val split" in result.stdout and "384 tokens" in result.stdout  # 3 batches x 4 x 32
    # the whole split: every window, so the loss and its token count do not depend on --batch-size
    whole = [run_script("eval.py", str(trained_run), "--batch-size", b, "--device", "cpu") for b in ("3", "4")]
    assert all(r.returncode == 0 for r in whole), whole[0].stderr[-2000:]
    assert whole[0].stdout.splitlines()[1:] == whole[1].stdout.splitlines()[1:]
    ckpt = open_checkpoint(trained_run)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    expected, count = mean_loss(model, TokenLoader(ckpt.data, "val", 4, 32, seed=0).iter_eval(3), torch.device("cpu"))
    assert count == 384 and loss == pytest.approx(expected, abs=1e-4) and ppl == pytest.approx(math.exp(expected), rel=1e-3)
    assert 2.0 < loss < math.log(384)  # trained a little: below chance (uniform over the vocab), not memorized

    text = tmp_path / "doc.py"
    text.write_text(TEXT * 12)
    result = run_script("eval.py", str(trained_run), "--text", str(text), "--seq-len", "16", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    loss = float(re.search(r"loss ([\d.]+)", result.stdout).group(1))
    expected, count = mean_loss(model, text_windows(ckpt, [TEXT * 12], 16, 4), torch.device("cpu"))
    assert f"{count:,} tokens in windows of 16" in result.stdout and loss == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("pruned_in", ["verify_checkpoint", "load_model_state"])
def test_a_checkpoint_pruned_while_a_tool_reads_it_gives_way_to_the_runs_newest(trained_run, tmp_path, monkeypatch,
                                                                                 caplog, pruned_in):
    """eval / sample / export beside a run still training (trainer.keep_last): the run saves a newer checkpoint and
    prunes the one the tool took while it checksums or loads it. The tool takes the newest again; it failed with
    "state.pt cannot be read", or called the pruned one damaged."""
    import coda_train.inference as inference
    import coda_train.trainer.checkpoint as checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = list_checkpoints(run / "checkpoints")[0]
    older = newest.with_name("step_00000006")  # the same weights as an earlier step's checkpoint
    shutil.copytree(newest, older)
    meta = json.loads((older / "meta.json").read_text())
    (older / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    staged = newest.rename(tmp_path / newest.name)  # not yet saved when the tool lists the run's checkpoints
    module = checkpoint if pruned_in == "verify_checkpoint" else inference
    real = getattr(module, pruned_in)

    def save_newer_and_prune(path, *args):
        if path == older and older.exists():
            staged.rename(newest)
            shutil.rmtree(older)
        return real(path, *args)
    monkeypatch.setattr(module, pruned_in, save_newer_and_prune)
    with caplog.at_level(logging.INFO):
        opened = open_checkpoint(run)
    assert opened.path == newest and not older.exists()
    assert "damaged" not in caplog.text, caplog.text


def test_eval_reads_compressed_text_files_as_preparation_does(trained_run, tmp_path):
    """--text doc.py.gz (or .bz2, .xz) is the document inside, as data.source reads it: its compressed bytes were
    evaluated as text, a loss over noise with no word. A damaged one is refused naming it."""
    import gzip

    plain, packed = tmp_path / "doc.py", tmp_path / "doc.py.gz"
    plain.write_text(TEXT * 12)
    packed.write_bytes(gzip.compress((TEXT * 12).encode()))
    results = [run_script("eval.py", str(trained_run), "--text", str(f), "--seq-len", "16", "--device", "cpu")
               for f in (plain, packed)]
    assert all(r.returncode == 0 for r in results), results[1].stderr[-3000:]
    assert results[1].stdout.splitlines()[1:] == results[0].stdout.splitlines()[1:]
    cut = tmp_path / "cut.py.gz"
    cut.write_bytes(packed.read_bytes()[:40])
    result = run_script("eval.py", str(trained_run), "--text", str(cut), "--seq-len", "16", "--device", "cpu")
    assert result.returncode != 0 and f"cannot read --text {cut}" in result.stderr and "Traceback" not in result.stderr


def test_eval_reads_the_runs_own_folder_after_its_corpus_changed_or_moved(tiny, tmp_path):
    """The run's prepared folder, recorded in its checkpoint, serves eval after the corpus changed and even after
    it moved away; with the folder gone too, the data prepared again with a new BPE is refused (--tokenizer) instead
    of reporting a loss on mis-tokenized data."""
    source = Path(next(o for o in tiny if o.startswith("data.source=")).split("=", 1)[1])
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(source, corpus)
    data = [o for o in tiny if not o.startswith(("data.source=", "data.cache_dir="))]
    data += [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    result = subprocess.run([sys.executable, "train.py", *data, f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2",
                             "model.impl=eager"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (own,) = (tmp_path / "cache").glob("*/tokenizer.json")
    first = run_script("eval.py", str(tmp_path / "run"), "--max-batches", "1")
    assert first.returncode == 0 and f"split of {own.parent}" in first.stdout, first.stderr[-2000:]

    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "a new document " * 50}) + "\n")
    assert run_script("eval.py", str(tmp_path / "run"), "--max-batches", "1").stdout == first.stdout
    corpus.rename(tmp_path / "moved.jsonl")
    assert run_script("eval.py", str(tmp_path / "run"), "--max-batches", "1").stdout == first.stdout
    assert list((tmp_path / "cache").glob("*/tokenizer.json")) == [own]  # nothing prepared again

    corpus.write_text((tmp_path / "moved.jsonl").read_text())
    kept = own.parent.rename(tmp_path / "kept")
    shutil.copy(kept / "tokenizer.json", own.parent.with_name("own-tokenizer.json"))
    result = run_script("eval.py", str(tmp_path / "run"), "--tokenizer", str(own.parent.with_name("own-tokenizer.json")),
                        "--max-batches", "1")
    assert result.returncode == 1 and "is tokenized with another tokenizer than" in result.stderr, result.stderr[-2000:]
    corpus.unlink()
    result = run_script("eval.py", str(tmp_path / "run"), "--max-batches", "1")
    assert result.returncode == 1 and f"the run's prepared data {own.parent} is gone" in result.stderr, result.stderr[-2000:]
    assert "no files match data.source" in result.stderr


# ---- sampling ---------------------------------------------------------------------------

def test_kv_cache_logits_equal_full_sequence_logits(trained_run):
    ckpt = open_checkpoint(trained_run)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    tokens = torch.tensor([ckpt.tokenizer.encode(TEXT).ids[:30]] * 2)
    with torch.no_grad():
        full = model.logits(tokens)
        cache = KVCache(model.cfg, 2, 30, torch.device("cpu"), torch.float32)
        pieces = [model.logits(tokens[:, :11], cache), model.logits(tokens[:, 11:20], cache)]  # prefill, then a chunk
        pieces += [model.logits(tokens[:, t:t + 1], cache) for t in range(20, 30)]  # then one token at a time
    assert cache.length == 30
    assert rel_err(torch.cat(pieces, dim=1), full) < 1e-5
    with pytest.raises(ValueError, match="KV cache holds 30"):
        model.logits(tokens[:, :1], cache)


def test_sampling_is_seeded_and_greedy_equals_transformers_generate(trained_run, exported):
    ckpt = open_checkpoint(trained_run)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    prompt = ckpt.tokenizer.encode("def ", add_special_tokens=False).ids

    def sample(seed: int, **kw) -> list[int]:
        return list(generate(model, prompt, 24, generator=torch.Generator().manual_seed(seed), vocab_limit=300, **kw))

    assert sample(3, temperature=1.0, top_k=50, top_p=0.9) == sample(3, temperature=1.0, top_k=50, top_p=0.9)
    assert sample(3, temperature=1.0) != sample(4, temperature=1.0)
    assert all(t < 300 for t in sample(5, temperature=2.0))

    greedy = sample(0, temperature=0.0)
    hf = transformers.LlamaForCausalLM.from_pretrained(exported)
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, attention_mask=torch.ones(1, len(prompt)))
    assert out[0, len(prompt):].tolist() == greedy


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.05, 0.25])
    logits = probs.log()

    def kept(dist: torch.Tensor, ids: list[int]) -> torch.Tensor:
        mask = torch.zeros(5, dtype=torch.bool)
        mask[ids] = True
        return torch.where(mask, probs, 0) / probs[ids].sum()

    assert torch.allclose(next_token_distribution(logits, 1.0, 2, None), kept(probs, [1, 4]))
    # nucleus: sorted masses 0.4, 0.25, 0.2, ...; a token stays while the mass before it is < top_p
    assert torch.allclose(next_token_distribution(logits, 1.0, None, 0.6), kept(probs, [1, 4]))
    assert torch.allclose(next_token_distribution(logits, 1.0, None, 0.7), kept(probs, [1, 4, 2]))
    assert torch.allclose(next_token_distribution(logits, 1.0, 2, 0.3), kept(probs, [1]))
    assert torch.allclose(next_token_distribution(logits, 0.5, None, None), torch.softmax(logits / 0.5, 0))


def test_a_tiny_temperature_samples_the_greedy_token(trained_run):
    """logits / 1e-40 overflowed float32 (inf - inf in softmax: a NaN distribution, multinomial's traceback); the
    largest logit is 0 before dividing, so the others go to -inf and the most likely token takes all the mass."""
    logits = torch.tensor([1.5, 7.25, -3.0, 7.0, float("-inf")])
    assert torch.equal(next_token_distribution(logits, 1e-40, None, None), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(next_token_distribution(logits, 1e-40, 2, 0.5), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    ckpt = open_checkpoint(trained_run)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    prompt = ckpt.tokenizer.encode("def ", add_special_tokens=False).ids
    greedy = list(generate(model, prompt, 16, temperature=0.0, vocab_limit=300))
    assert list(generate(model, prompt, 16, temperature=1e-40, generator=torch.Generator().manual_seed(0),
                         vocab_limit=300)) == greedy


def test_sample_script_streams_a_seeded_continuation(trained_run):
    args = (str(trained_run), "--prompt", "def ", "--max-new-tokens", "20", "--seed", "5", "--top-k", "40")
    first, second = run_script("sample.py", *args), run_script("sample.py", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout == second.stdout and first.stdout.startswith("def ") and len(first.stdout) > len("def \n")
    ckpt = open_checkpoint(trained_run)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    prompt = ckpt.tokenizer.encode("def ", add_special_tokens=False).ids
    ids = list(generate(model, prompt, 20, temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(5),
                        vocab_limit=300, stop_token=ckpt.eos_id))
    assert first.stdout == ckpt.tokenizer.decode(prompt + ids) + "\n"


# ---- bad input ----------------------------------------------------------------------------

def test_a_directory_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="neither a checkpoint.*nor a run dir"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "nope")
    for script in ("eval.py", "sample.py", "export_hf.py"):
        result = run_script(script, str(tmp_path), *(["--out", str(tmp_path / "x")] if script == "export_hf.py" else []))
        assert result.returncode == 1 and "neither a checkpoint" in result.stderr, (script, result.stderr[-2000:])



def test_a_file_of_a_checkpoint_or_an_hf_export_is_named_as_what_it_is(trained_run, exported):
    """state.pt or meta.json given for its checkpoint was refused as 'neither a checkpoint (no meta.json) nor a run dir',
    meta.json itself included; an export, as a directory that is neither."""
    ckpt = find_checkpoint(trained_run).path
    for file in (ckpt / "state.pt", ckpt / "meta.json", trained_run / "metrics.jsonl"):
        with pytest.raises(CheckpointError, match=re.escape(f"{file} is a file; pass the directory that holds it "
                                                            f"({file.parent})")):
            find_checkpoint(file)
    with pytest.raises(CheckpointError, match=f"{exported} is a Hugging Face model directory .*model.init_from"):
        find_checkpoint(exported)
    result = run_script("sample.py", str(ckpt / "state.pt"), "--max-new-tokens", "2")
    assert result.returncode == 1 and f"state.pt is a file; pass the directory that holds it ({ckpt})" in result.stderr


def test_a_multirun_sweep_dir_names_its_jobs_run_dirs(tmp_path):
    """The sweep dir of `train.py -m ... trainer.run_dir=DIR` is not one run: the tools name its jobs' run dirs."""
    for job in ("0", "1", "10"):
        (tmp_path / job / "checkpoints" / "step_00000020").mkdir(parents=True)
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path} is a multirun sweep, not one run; pass one of its "
                                                        f"jobs' run dirs: {tmp_path / '0'}, {tmp_path / '1'}, {tmp_path / '10'}")):
        find_checkpoint(tmp_path)


def test_arguments_that_depend_on_the_checkpoint_are_refused_before_its_weights_are_checksummed(trained_run,
                                                                                                   monkeypatch):
    """open_checkpoint's check reads the newest checkpoint's meta.json unverified first: a bad argument is refused
    without hashing the weights (minutes at 8B); the check runs again on the checkpoint found, once verified."""
    import coda_train.trainer.checkpoint as checkpoint

    hashed, seen = [], []
    real_sha256 = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path) or real_sha256(path))

    def refuse(model, run):
        raise ConfigError(f"--max-new-tokens leaves no room in max_seq_len={model.max_seq_len}")

    with pytest.raises(ConfigError, match="no room in max_seq_len=256"):
        open_checkpoint(trained_run, check=refuse)
    assert hashed == []
    ckpt = open_checkpoint(trained_run, check=lambda model, run: seen.append((model.max_seq_len, run["trainer"]["run_dir"])))
    assert len(hashed) >= 1 and seen == [(256, str(trained_run))] * 2 and ckpt.model_config.max_seq_len == 256


def test_a_tokenizer_that_does_not_match_the_model_is_refused(trained_run, tmp_path, monkeypatch):
    """From meta.json's fingerprint, before the weights are checksummed or loaded; a checkpoint whose meta.json
    records none (written before 2026-12-05) is refused from its loader state once loaded."""
    import coda_train.trainer.checkpoint as checkpoint

    other = tokenizer_file(tmp_path, 280)
    hashed = []
    real_sha256 = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path) or real_sha256(path))
    with pytest.raises(ConfigError, match="not the one checkpoint .* was trained with"):
        open_checkpoint(trained_run, tokenizer=str(other))
    assert hashed == []
    monkeypatch.setattr("coda_train.inference._unverified_meta", lambda path: None)  # as if meta.json recorded none
    with pytest.raises(ConfigError, match="not the one checkpoint .* was trained with"):
        open_checkpoint(trained_run, tokenizer=str(other))
    assert hashed
    big = tokenizer_file(tmp_path, 400)  # more ids than the model's 320 embedding rows
    cfg, model = tiny_model()
    with pytest.raises(ConfigError, match="400 tokens but the model's vocab_size is 320"):
        export_hf(model.state_dict(), cfg, tmp_path / "out", tokenizer_file=big, eos_token=EOS_TOKEN)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_meta_json_does_not_fit_its_weights_is_refused_by_every_tool(trained_run, tmp_path):
    """meta.json's "model" edited (it is not checksummed, the weights are): export wrote a model without the layers
    past n_layers and exited 0, or failed with a KeyError; eval and sample failed inside load_state_dict. Each tool
    now names the tensors that do not fit, before anything is written."""
    ckpt = find_checkpoint(trained_run).path
    copy = tmp_path / "run" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    saved = json.loads((copy / "meta.json").read_text())

    def edit_model(**model) -> None:
        (copy / "meta.json").write_text(json.dumps({**saved, "model": {**saved["model"], **model}}))

    for model, named in (({"n_layers": 3}, "missing: layers.2.attn_norm, layers.2.w_qkv"),
                         ({"ffn_dim": 96}, "wrong shapes: layers.0.w_gate_up (256, 64) instead of (192, 64)")):
        edit_model(**model)
        with pytest.raises(CheckpointError, match=re.escape(named)):
            open_checkpoint(tmp_path / "run")
    edit_model(n_layers=1)
    for script, args in (("export_hf.py", ["--out", str(tmp_path / "out")]), ("eval.py", []), ("sample.py", [])):
        result = run_script(script, str(tmp_path / "run"), *args)
        assert result.returncode == 1 and f"checkpoint {copy}: its weights do not fit the model its meta.json describes" \
            in result.stderr and "unexpected: layers.1.attn_norm" in result.stderr, (script, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_damaged_checkpoint_given_to_a_tool_names_the_one_to_pass_instead(trained_run, tmp_path):
    """A checkpoint given explicitly whose state.pt is cut short said only 'state.pt is missing or truncated': it now
    names the newest intact checkpoint beside it and how to rewrite it, or, with none intact, that there is none."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = find_checkpoint(run).path
    older = newest.with_name("step_00000006")
    shutil.copytree(newest, older)
    meta = json.loads((older / "meta.json").read_text())
    (older / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    state = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(state[:len(state) // 2])
    for script, args in (("eval.py", []), ("sample.py", []), ("export_hf.py", ["--out", str(tmp_path / "out")])):
        result = run_script(script, str(newest), *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, (script, result.stderr[-2000:])
        assert (f"checkpoint {newest}: state.pt is missing or truncated; pass {older} instead (the newest intact checkpoint "
                f"beside it), or the run dir {run}, which takes it; to rewrite this one, resume the training (to continue, run "
                f"the same command with trainer.run_dir={run.resolve()})") in result.stderr, (script, result.stderr)
    shutil.rmtree(older)
    result = run_script("eval.py", str(newest))
    assert result.returncode == 1 and (f"checkpoint {newest}: state.pt is missing or truncated; no checkpoint beside it is "
                                       "intact: train again to get one") in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_non_empty_output_dir(trained_run, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = run_script("export_hf.py", str(trained_run), "--out", str(tmp_path))
    assert result.returncode == 1 and "not an empty directory" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_an_export_to_a_link_goes_where_it_points(tmp_path):
    """--out naming a link to an empty dir passed the check, then failed to publish (a folder renamed onto the link)
    with "free space or choose another --out"."""
    cfg, model = tiny_model()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    out = export_hf(model.state_dict(), cfg, tmp_path / "link", tokenizer_file=tokenizer_file(tmp_path), eos_token=EOS_TOKEN)
    assert out == tmp_path / "target" and (tmp_path / "link").is_symlink() and (tmp_path / "link" / "config.json").is_file()


def test_an_export_to_the_empty_working_directory_is_written_into_it(trained_run, tmp_path, monkeypatch):
    """--out . in an empty folder (an empty folder is a target as any other) failed with 'Invalid argument': the
    export, written next to '.', was renamed onto it. Its files are moved in: the folder the shell is in stays."""
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(trained_run), "--out", "."],
                            cwd=here, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0 and f"to {here}:" in result.stdout, result.stderr[-2000:]
    assert here.stat().st_ino == inode and (here / "config.json").is_file() and (here / "model.safetensors").is_file()
    assert not [p.name for p in here.iterdir() if p.name.startswith(".")] and sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    import huggingface_hub

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    (tmp_path / "again").mkdir()
    monkeypatch.chdir(tmp_path / "again")
    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", disk_full)
    ckpt = open_checkpoint(trained_run)
    with pytest.raises(OSError):
        export_hf(ckpt.weights, ckpt.model_config, ".", tokenizer_file=ckpt.tokenizer_file, eos_token=ckpt.eos_token)
    assert list((tmp_path / "again").iterdir()) == []  # a failed write leaves it as empty as it was


def test_export_errors_leave_no_temp_folder(trained_run, tmp_path, monkeypatch):
    """A bad --max-shard-size is refused before any write; a write that fails (a full disk) removes the
    half-written folder and says so in one line."""
    result = run_script("export_hf.py", str(trained_run), "--out", str(tmp_path / "e"), "--max-shard-size", "banana")
    assert result.returncode == 1 and "--max-shard-size='banana' is not a size" in result.stderr
    assert list(tmp_path.iterdir()) == []
    import huggingface_hub

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", disk_full)
    ckpt = open_checkpoint(trained_run)
    with pytest.raises(OSError):
        export_hf(ckpt.weights, ckpt.model_config, tmp_path / "e", tokenizer_file=ckpt.tokenizer_file,
                  eos_token=ckpt.eos_token)
    assert list(tmp_path.iterdir()) == []


def test_eval_and_sample_refuse_zero_and_negative_counts(trained_run):
    """0 is not 'the default': eval's --seq-len, --batch-size and --max-batches, and sample's --max-new-tokens,
    are refused with the valid range instead of falling back or failing later."""
    for flag in ("--seq-len", "--batch-size", "--max-batches"):
        result = run_script("eval.py", str(trained_run), flag, "0")
        assert result.returncode == 1 and "need --batch-size >= 1" in result.stderr, (flag, result.stderr[-500:])
    result = run_script("sample.py", str(trained_run), "--prompt", "def ", "--max-new-tokens", "-5")
    assert result.returncode == 1 and "max_new_tokens=-5 must be >= 0" in result.stderr, result.stderr[-500:]


def test_eval_refuses_split_with_text_files(trained_run, tmp_path):
    """--split picks a split of the run's prepared data, which --text replaces: both together are refused, not one
    silently dropped."""
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    result = run_script("eval.py", str(trained_run), "--text", str(text), "--split", "train")
    assert result.returncode == 2 and "--split train selects the run's prepared data" in result.stderr, result.stderr[-500:]


def run_without_its_data(trained_run: Path, tmp_path: Path, **data) -> tuple[Path, Path]:
    """A copy of trained_run's newest checkpoint whose prepared folder is gone, its data.cache_dir a fresh path under
    tmp_path (a tool that prepares data creates it), and the data.* settings `data` changed: (run dir, cache dir)."""
    ckpt = find_checkpoint(trained_run).path
    copy = tmp_path / "run" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["prepared_data"] = str(tmp_path / "gone")
    meta["config"]["data"]["cache_dir"] = str(tmp_path / "cache")
    meta["config"]["data"].update(data)
    (copy / "meta.json").write_text(json.dumps(meta))
    return tmp_path / "run", tmp_path / "cache"


@pytest.mark.parametrize("script, args, named", [
    ("export_hf.py", ["--out", "RUN", "--max-shard-size", "5GB"], "exists and is not an empty directory"),
    ("export_hf.py", ["--out", "NEW", "--max-shard-size", "5XB"], "--max-shard-size='5XB' is not a size"),
    ("export_hf.py", ["--out", "NEW", "--max-shard-size", "0GB"], "--max-shard-size='0GB' is not a size"),
    ("export_hf.py", ["--out", "FILE/sub"], "is a file, not a directory; choose an --out under a directory"),
    ("export_hf.py", ["--out", "CKPT/hf"], "which trainer.keep_last removes whole"),
    ("eval.py", ["--batch-size", "0"], "need --batch-size >= 1"),
    ("eval.py", ["--text", "NEW"], "cannot read --text"),
    ("eval.py", ["--seq-len", "5000"], "--seq-len=5000 exceeds the model's max_seq_len=256"),
    ("sample.py", ["--top-p", "1.5"], "top_p=1.5"),
    ("sample.py", ["--temperature", "nan"], "need a finite temperature"),
    ("sample.py", ["--max-new-tokens", "-1"], "max_new_tokens=-1 must be >= 0"),
    ("sample.py", ["--max-new-tokens", "256"], "--max-new-tokens=256 leaves no room for a prompt"),
])
def test_tools_refuse_arguments_before_preparing_data(trained_run, tmp_path, script, args, named):
    """Arguments that need no checkpoint, and those checked against its model config, are refused before the run's
    data is prepared again (its folder is gone here) and before anything is printed."""
    run, cache = run_without_its_data(trained_run, tmp_path)
    (tmp_path / "file").write_text("not a directory")
    args = [str(run) if a == "RUN" else str(tmp_path / "new") if a == "NEW" else a for a in args]
    args = [str(tmp_path / "file" / "sub") if a == "FILE/sub" else a for a in args]
    args = [str(find_checkpoint(run).path / "hf") if a == "CKPT/hf" else a for a in args]  # pruned with its checkpoint
    result = run_script(script, str(run), *args)
    assert result.returncode == 1 and named in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not cache.exists() and not (tmp_path / "new").exists()


def test_generate_checks_its_arguments_when_called(trained_run):
    """generate() refuses bad arguments at the call, not at the first token drawn (a caller prints nothing first)."""
    model = load_eager_model(open_checkpoint(trained_run), torch.device("cpu"), torch.float32)
    for kwargs in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}, {"top_k": 0}):
        with pytest.raises(ValueError, match="need a finite temperature"):
            generate(model, [0], 4, **kwargs)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=256"):
        generate(model, [0, 1], 255)
    # a CODA model has the same weights but no KV cache: it used to fail in its logits() with a TypeError on a keyword
    coda = build_model(model.cfg, "coda")
    with pytest.raises(TypeError, match=r"EagerLlama\(model.cfg\).load_state_dict\(model.state_dict\(\)\)"):
        generate(coda, [0], 4)


def test_a_missing_tokenizer_names_the_setting_that_gave_it(trained_run, exported, tiny, tmp_path):
    """--tokenizer and model.init_from are named as the fix, not data.tokenizer (which they did not set)."""
    with pytest.raises(DataError, match=r"fix --tokenizer=/nonexistent, or leave it out to use the run's own"):
        open_checkpoint(trained_run, tokenizer="/nonexistent")
    result = run_script("sample.py", str(trained_run), "--tokenizer", "/nonexistent")
    assert result.returncode == 1 and "fix --tokenizer=/nonexistent" in result.stderr, result.stderr[-2000:]

    model_only = tmp_path / "model-only"
    shutil.copytree(exported, model_only, ignore=shutil.ignore_patterns("tokenizer*"))
    result = _train_cli(*tiny, f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={model_only}",
                        f"data.cache_dir={tmp_path / 'cache'}")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and f"fix model.init_from={model_only}, or set data.tokenizer" in out, out[-2000:]
    assert "leave it unset to train a BPE" not in out and not (tmp_path / "cache").exists()


def test_tools_name_their_fix_when_the_runs_data_and_corpus_are_gone(trained_run, exported, tmp_path):
    """With the run's prepared folder and its corpus gone, the error names what the tools can do instead, and
    doing it works: the run's tokenizer (from its export) and, for eval, the text to evaluate."""
    run, cache = run_without_its_data(trained_run, tmp_path, source=str(tmp_path / "no-corpus.jsonl"))
    result = run_script("eval.py", str(run))
    assert result.returncode == 1 and "no files match data.source" in result.stderr, result.stderr[-2000:]
    assert "pass --tokenizer PATH with the run's tokenizer.json" in result.stderr and "--text FILE" in result.stderr
    text = tmp_path / "doc.py"
    text.write_text(TEXT * 12)
    result = run_script("eval.py", str(run), "--tokenizer", str(exported / "tokenizer.json"), "--text", str(text),
                        "--seq-len", "16")
    assert result.returncode == 0 and "loss" in result.stdout, result.stderr[-2000:]


def test_eval_of_a_run_without_a_val_split_names_split_train(trained_run, tmp_path):
    run, cache = run_without_its_data(trained_run, tmp_path, val_fraction=0.0)
    result = run_script("eval.py", str(run))
    assert result.returncode == 1 and "data.val_fraction=0): evaluate --split train" in result.stderr, result.stderr[-2000:]
    assert not cache.exists()
    result = run_script("eval.py", str(trained_run), "--batch-size", "1000")  # a val split shorter than one batch
    assert result.returncode == 1 and "fewer than one batch of 1000 windows of 32+1; pass a smaller --batch-size" \
        in result.stderr and "--split train" in result.stderr, result.stderr[-2000:]


def test_sample_encodes_its_prompt_as_documents_despite_the_tokenizers_padding_and_truncation(tiny, tmp_path):
    """A tokenizer.json saved with padding or truncation on (HF files often are): preparation ignores them
    (for_documents), and so must the prompt: padded, it was the prompt plus pad tokens up to the length."""
    from tokenizers import Tokenizer

    padded = Tokenizer.from_file(str(tokenizer_file(tmp_path)))
    padded.enable_padding(pad_id=0, pad_token=EOS_TOKEN, length=32)
    padded.enable_truncation(max_length=32)
    padded.save(str(tmp_path / "padded.json"))
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", *tiny, f"trainer.run_dir={run_dir}", "trainer.max_steps=2",
                             "model.impl=eager", f"data.tokenizer={tmp_path / 'padded.json'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sampled = run_script("sample.py", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    ckpt = open_checkpoint(run_dir)
    model = load_eager_model(ckpt, torch.device("cpu"), torch.float32)
    prompt = Tokenizer.from_file(str(tokenizer_file(tmp_path))).encode("def ", add_special_tokens=False).ids
    ids = list(generate(model, prompt, 8, temperature=0.0, vocab_limit=300, stop_token=ckpt.eos_id))
    assert sampled.stdout == ckpt.tokenizer.decode(prompt + ids) + "\n"


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_eval_refuses_parquet_and_arrow_files_as_text(trained_run, tmp_path, suffix):
    """--text reads each file as one text document: a held-out Parquet or Arrow file was scored as its binary bytes,
    a loss with no meaning printed as any other."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table, held_out = pa.table({"text": [TEXT] * 20}), tmp_path / f"held_out.{suffix}"
    if suffix == "parquet":
        pq.write_table(table, held_out)
    else:
        with pa.ipc.new_stream(str(held_out), table.schema) as writer:
            writer.write_table(table)
    result = run_script("eval.py", str(trained_run), "--text", str(held_out), "--seq-len", "16", "--device", "cpu")
    assert result.returncode == 1 and f"--text {held_out} is {suffix.capitalize()}" in result.stderr, result.stderr[-2000:]
    assert "loss" not in result.stdout


def test_eval_refuses_a_utf16_text_file_naming_its_encoding(trained_run, tmp_path):
    """A UTF-16 file (Windows' 'Unicode') read as UTF-8 is ASCII interleaved with NULs: it was scored as such, a loss
    with no meaning printed as any other."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_bytes((TEXT * 20).encode("utf-16"))
    result = run_script("eval.py", str(trained_run), "--text", str(held_out), "--seq-len", "16", "--device", "cpu")
    assert result.returncode == 1 and f"{held_out} is UTF-16LE text" in result.stderr, result.stderr[-2000:]
    assert "loss" not in result.stdout


def test_eval_of_an_empty_or_short_text_file_says_what_is_wrong_and_the_fix(trained_run, tmp_path):
    """An empty --text file holds no token to score: its message said 'use a smaller --seq-len', which cannot help it.
    A short one names the --seq-len that fits it."""
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("def f")
    result = run_script("eval.py", str(trained_run), "--text", str(empty), "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "hold no text to score (empty)" in result.stderr and "--seq-len" not in result.stderr, result.stderr
    ckpt = open_checkpoint(trained_run)
    tokens = len(ckpt.tokenizer.encode("def f", add_special_tokens=False).ids) + 1  # and its EOS
    result = run_script("eval.py", str(trained_run), "--text", str(short), str(empty), "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (f"hold {tokens + 1} tokens (an EOS after each file), fewer than one window of 32+1; pass --seq-len "
            f"{tokens} or less, or longer texts") in result.stderr, result.stderr


def test_tool_paths_starting_with_a_tilde_are_under_home(trained_run, tmp_path):
    """A shell leaves `--out=~/x` (and a quoted "~/x") as it is: the export went to a folder named '~' in the working
    directory, and a run dir or tokenizer given so was said not to exist."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / "run").symlink_to(trained_run)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)}

    def tool(name, *args):
        return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True,
                              text=True, timeout=120, env=env)

    result = tool("export_hf.py", "~/run", "--out=~/exports/m")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (home / "exports" / "m" / "config.json").is_file() and not (cwd / "~").exists()
    result = tool("sample.py", "~/run", "--tokenizer=~/exports/m", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    (home / "held_out.txt").write_text(TEXT * 4)
    result = tool("eval.py", "~/run", "--text", "~/held_out.txt", "--seq-len", "16")
    assert result.returncode == 0 and "on 1 text file(s)" in result.stdout, result.stderr[-2000:]
