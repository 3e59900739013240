"""The hydra config tree and its typed schema, the model resolution, schedules and decay groups (no training)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Optional

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from coda_train.config import Config, ModelConfig, TrainerConfig, check_config, register_configs, resolve_model_config, to_dataclass
from coda_train.errors import ConfigError
from coda_train.model import PRESETS, LlamaConfig, build_model, preset
from coda_train.trainer.optim import build_optimizer, lr_multiplier

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_dataclass(compose("config", overrides=list(overrides)))


def test_default_config_is_the_tiny_preset_on_the_builtin_corpus():
    cfg = load()
    assert (cfg.model.preset, cfg.model.impl, cfg.data.source, cfg.logger.name) == ("tiny", "coda", "builtin", "jsonl")
    assert cfg.kernels.backend == "auto" and cfg.trainer.resume == "auto"
    check_config(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_model_group_names_its_preset_and_keeps_its_numbers(name):
    cfg = load(f"model={name}")
    llama = resolve_model_config(cfg.model, tokenizer_vocab_size=PRESETS[name].vocab_size, seq_len=128)
    assert llama == PRESETS[name]  # the yaml adds no numbers of its own


def test_model_fields_override_the_preset():
    cfg = load("model=llama3_125m", "model.n_layers=2", "model.tie_embeddings=false")
    llama = resolve_model_config(cfg.model, tokenizer_vocab_size=1000, seq_len=128)
    assert (llama.n_layers, llama.tie_embeddings, llama.dim) == (2, False, PRESETS["llama3_125m"].dim)


def test_the_model_schema_is_every_llama_field_plus_the_choices():
    llama_fields = [f.name for f in dataclasses.fields(LlamaConfig)]
    assert [f.name for f in dataclasses.fields(ModelConfig)] == ["preset", "impl", *llama_fields, "vocab_multiple_of", "init_from"]
    assert all(getattr(load().model, name) is None for name in llama_fields)  # null: the preset's value


def _another_valid_value(value):
    """A value the tiny preset accepts in place of `value`: the other bool, or twice the number."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2
    raise AssertionError(f"no test value for {value!r}; teach _another_valid_value this field's type")


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(LlamaConfig)])
def test_every_llama_field_is_overridable_and_reaches_the_resolved_model(name):
    tiny = PRESETS["tiny"]
    value = _another_valid_value(getattr(tiny, name))
    cfg = load("model=tiny", f"model.{name}={str(value).lower() if isinstance(value, bool) else value}")
    llama = resolve_model_config(cfg.model, tokenizer_vocab_size=tiny.vocab_size, seq_len=128)
    assert llama == dataclasses.replace(tiny, **{name: value})  # this field changed, every other one the preset's


def test_default_vocab_follows_the_tokenizer_rounded_up():
    cfg = load()
    assert resolve_model_config(cfg.model, tokenizer_vocab_size=300, seq_len=128).vocab_size == 384
    assert resolve_model_config(load("model.vocab_multiple_of=1").model, 300, 128).vocab_size == 300
    assert resolve_model_config(load("model.vocab_size=500").model, 300, 128).vocab_size == 500
    with pytest.raises(ConfigError, match="set model.vocab_size>=300 or leave it null"):
        resolve_model_config(load("model.vocab_size=299").model, 300, 128)


def test_seq_len_beyond_max_seq_len_names_the_fix():
    with pytest.raises(ConfigError, match="lower trainer.seq_len or set model.max_seq_len=512"):
        resolve_model_config(load().model, 300, seq_len=512)


@pytest.mark.parametrize("override, message", [
    ("trainer.max_stepz=3", "Could not override 'trainer.max_stepz'"),
    ("trainer.max_steps=abc", "Error merging override trainer.max_steps=abc"),
    ("optim.lr=fast", "Error merging override optim.lr=fast"),
])
def test_typos_and_wrong_types_fail_at_composition(override, message):
    with pytest.raises(ConfigCompositionException, match=message):
        load(override)


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(MissingConfigException, match="llama3_125m"):
        load("model=llama3_2b")


def test_keys_appended_with_plus_are_not_silently_dropped():
    with pytest.raises(ConfigError, match=r"unknown config keys \['trainer.foo'\]"):
        load("+trainer.foo=1")


def test_keys_without_a_value_name_themselves_and_the_fix():
    """A trainer group file (or override) that leaves a schema key at ??? stops with its name, not omegaconf's traceback."""
    with pytest.raises(ConfigError, match=r"config keys \['trainer.batch_size', 'trainer.seq_len'\] have no value: set "
                                          r"each on the command line \(e.g. trainer.batch_size=...\)"):
        load("trainer.batch_size=???", "trainer.seq_len=???")


def test_an_interpolation_that_cannot_be_resolved_names_its_key(monkeypatch):
    """A ${...} that names no key, an unset environment variable or a value of the wrong type stops with the key and
    the fix, not omegaconf's traceback (a run printed it and left its empty run dir behind)."""
    monkeypatch.delenv("CODA_TRAIN_UNSET", raising=False)
    for override, said in [("trainer.max_steps=${nope}", "Interpolation key 'nope' not found"),
                           ("data.source=${oc.env:CODA_TRAIN_UNSET}", "Environment variable 'CODA_TRAIN_UNSET' not found"),
                           ("trainer.max_steps=${data.source}", "could not be converted to Integer")]:
        with pytest.raises(ConfigError, match=re.escape(override.split("=")[0] + " cannot be resolved: ") + ".*"
                           + re.escape(said) + r".*; fix its \$\{...\} interpolation"):
            load(override)
    assert load("trainer.max_steps=${trainer.batch_size}").trainer.max_steps == 8


def _bool_keys(schema: type = Config, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    return [key for name, kind in hints.items()
            for key in (_bool_keys(kind, f"{prefix}{name}.") if dataclasses.is_dataclass(kind)
                        else [prefix + name] if kind in (bool, Optional[bool]) else [])]


@pytest.mark.parametrize("key", _bool_keys())
def test_bool_keys_take_true_or_false_only(key):
    """OmegaConf reads 2, 'yes' or 'on' set into a bool field as true: every bool key refuses them, naming itself."""
    for spelling, value in (("true", True), ("False", False)):
        assert OmegaConf.select(OmegaConf.structured(load(f"{key}={spelling}")), key) is value
    accepted = "true, false or null (the preset's value)" if key.startswith("model.") else "true or false"
    for given, shown in (("2", "2"), ("0", "0"), ("yes", "'yes'"), ("on", "'on'"), ("'true'", "'true'"), ("[1]", "[1]")):
        with pytest.raises(ConfigError, match=re.escape(f"{key}={shown} is not a boolean: {key} takes {accepted} (unquoted)")):
            load(f"{key}={given}")
    if not key.startswith("model."):
        with pytest.raises(ConfigError, match=re.escape(f"{key}=null is not a boolean")):
            load(f"{key}=null")


def test_a_composed_config_is_the_schema_itself():
    cfg = load()
    assert type(cfg) is Config and type(cfg.trainer) is TrainerConfig and type(cfg.model) is ModelConfig
    assert cfg.trainer.progress_bar is True and cfg.model.tie_embeddings is None
    assert {"trainer.progress_bar", "trainer.ckpt_async", "data.streaming", "model.tie_embeddings"} <= set(_bool_keys())


@pytest.mark.parametrize("override, message", [
    ("model.impl=jax", "model.impl='jax' is not one of"),
    ("kernels.backend=triton", "kernels.backend='triton' is not one of"),
    ("optim.schedule=linear", "optim.schedule='linear' is not one of"),
    ("trainer.grad_accum_steps=0", "trainer.grad_accum_steps=0 must be >= 1"),
    ("optim.betas=[0.9]", "must be two numbers in"),
    ("trainer.seed=-1", "numpy's seed range"),
    ("trainer.peak_flops=0", "must be > 0"),
    ("optim.eps=-1e-8", r"optim.eps=-1e-08 must be > 0"),
    ("optim.eps=0", r"optim.eps=0.0 must be > 0, e.g. optim.eps=1e-8"),
    ("trainer.eval_batches=0", "or trainer.eval_every=0"),
    ("optim.weight_decay=-1", r"optim.weight_decay=-1.0 must be >= 0$"),
    ("optim.grad_clip=-1", r"optim.grad_clip=-1.0 must be >= 0 \(0 disables clipping\)"),
    ("optim.warmup_steps=-1", r"optim.warmup_steps=-1 must be >= 0$"),
])
def test_out_of_range_values_fail_the_cross_field_check(override, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load(override))


def test_logger_mode_disabled_names_the_ways_to_turn_wandb_off():
    """logger.mode=disabled (wandb's own mode name) got the generic 'not one of' error: the README's ways are
    WANDB_MODE=disabled and logger=jsonl."""
    with pytest.raises(ConfigError, match=re.escape("logger.mode=disabled is not a logger.mode (auto, online, offline): "
                                                    "to log without wandb use logger=jsonl (metrics.jsonl only), or set "
                                                    "WANDB_MODE=disabled in the environment")):
        check_config(load("logger=wandb", "logger.mode=disabled"))


def test_data_checks_see_the_tokenizer_of_model_init_from():
    """A run from a Hugging Face directory tokenizes with its tokenizer: the checks that only hold for the
    BPE a run trains (data.eos_token, data.vocab_size) do not apply, and data.tokenizer still wins."""
    from coda_train.data import DataError

    for override in ("data.eos_token='</s>'", "data.vocab_size=100"):
        with pytest.raises(DataError):
            check_config(load(override))
        check_config(load(override, "model.init_from=/models/llama3"))
    cfg = load("model.init_from=/models/llama3")
    assert cfg.data.for_model(cfg.model.init_from).tokenizer == "/models/llama3"
    cfg = load("model.init_from=/models/llama3", "data.tokenizer=/tok.json")
    assert cfg.data.for_model(cfg.model.init_from).tokenizer == "/tok.json"


def test_eval_batches_is_free_when_validation_is_off():
    check_config(load("trainer.eval_batches=0", "trainer.eval_every=0"))


def test_schedules_warm_up_then_decay_to_the_floor():
    cosine = load("optim.warmup_steps=10", "optim.min_lr_ratio=0.1").optim
    values = [lr_multiplier(s, cosine, 100) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[9:], values[10:]))  # monotone decay after warmup
    assert values[10] < 1.0 and values[99] == pytest.approx(0.1)  # the run's last step (0-based 99) at the floor
    assert lr_multiplier(100, cosine, 100) == pytest.approx(0.1)
    short = load("optim.warmup_steps=9").optim  # one step of decay: that step at the floor, not at the peak
    assert lr_multiplier(9, short, 10) == pytest.approx(short.min_lr_ratio)

    wsd = load("optim.schedule=wsd", "optim.warmup_steps=10", "optim.decay_fraction=0.2", "optim.min_lr_ratio=0.0").optim
    assert [lr_multiplier(s, wsd, 100) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]  # stable phase
    assert lr_multiplier(89, wsd, 100) == pytest.approx(0.5) and lr_multiplier(99, wsd, 100) == pytest.approx(0.0)


@pytest.mark.parametrize("max_steps, decay_fraction", [(100, 0.2), (10, 0.1), (10, 0.5), (4, 1.0)])
def test_the_wsd_decay_reaches_the_floor_at_the_run_s_last_step(max_steps, decay_fraction):
    """Every step of the decay lowers the lr, and the last step the run takes (0-based max_steps - 1) applies min_lr:
    a decay over one step (10 steps, decay_fraction=0.1) is that step at the floor, not at the peak."""
    wsd = load("optim.schedule=wsd", "optim.warmup_steps=2", f"optim.decay_fraction={decay_fraction}",
               "optim.min_lr_ratio=0.1").optim
    values = [lr_multiplier(s, wsd, max_steps) for s in range(max_steps)]
    decay_steps = max_steps - max(2, max_steps - round(decay_fraction * max_steps))
    assert values[-decay_steps - 1] == 1.0 and all(a > b for a, b in zip(values[-decay_steps - 1:], values[-decay_steps:]))
    assert values[-1] == pytest.approx(0.1)


def test_weight_decay_skips_norms_and_the_embedding():
    model = build_model(preset("tiny", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64), "eager")
    optimizer = build_optimizer(model, load().optim, torch.device("cpu"))
    decayed, plain = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decayed["params"]) == [
        "layers.0.w_down", "layers.0.w_gate_up", "layers.0.w_o", "layers.0.w_qkv"]
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert "tok_emb" in {names[id(p)] for p in plain["params"]}


def test_a_data_revision_is_a_hub_datasets_and_refused_for_the_builtin_corpus_at_start():
    from coda_train.data import DataError

    with pytest.raises(DataError, match=re.escape("data.revision='abc123' pins a Hugging Face hub dataset, but "
                                                  "data.source='builtin' is the embedded corpus")):
        check_config(load("data.revision=abc123"))
    assert load().data.revision is None  # unpinned by default, as before
    check_config(load("data.source=org/corpus", "data.revision=abc123"))
    with pytest.raises(DataError, match=re.escape("data.revision=' abc123' has spaces around it: set it to 'abc123'")):
        check_config(load("data.source=org/corpus", "data.revision=' abc123'"))


@pytest.mark.parametrize("given, read", [("1.10", "1.1"), ("1e5", "100000.0"), ("12e4567", "inf"), ("1_000", "1000"),
                                         ("1234567", "1234567"), ("true", "True")])
def test_a_data_revision_hydra_reads_as_a_number_is_refused_naming_the_quotes(given, read):
    """hydra reads data.revision=1.10 (a tag) as the float 1.1 and 12e4567 (a short sha) as inf, which the str field
    then held: the run pinned another revision than the one typed, or failed on the hub naming one never typed."""
    with pytest.raises(ConfigError, match=re.escape(f"data.revision={read} was read by hydra as a number or boolean, not "
                                                    "as typed: quote it, as in 'data.revision=\"<sha or tag>\"'")):
        load("data.source=org/corpus", f"data.revision={given}")
    assert load("data.source=org/corpus", f"data.revision='{given}'").data.revision == given
    assert load("data.source=org/corpus", "data.revision=0a1b2c3").data.revision == "0a1b2c3"
    assert load("data.source=org/corpus", "data.revision=null").data.revision is None
