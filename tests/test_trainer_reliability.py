"""Faults a run meets outside the math: two runs in one run dir, kills and signals at awkward moments,
a full or read-only disk, non-finite settings, a typo that would cost a data preparation, a
hand-edited checkpoint. Each asserts the message, the exit code and that earlier state is intact."""

from __future__ import annotations

import errno
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from coda_train.config import check_config
from coda_train.data import DataError
from coda_train.data.tokenizer import num_ids
from coda_train.durable import LockHeldError, exclusive_lock
from coda_train.errors import ConfigError
from coda_train.model import preset
from coda_train.trainer import checkpoint as checkpoint_module
from coda_train.trainer.build import check_model_before_data, check_state_fits, data_config, resumed_runs_prepared_data
from coda_train.trainer.checkpoint import (Checkpoint, CheckpointError, list_checkpoints, save_checkpoint, set_aside_newer,
                                           verify_checkpoint)
from coda_train.trainer.distributed import World
from coda_train.trainer.rundir import RunDirError

from test_trainer import REPO, compose_config, metrics, run_train, snapshot, train_in_process


def steps_logged(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir)]


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().count("\n") >= n):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "timeout"
        time.sleep(0.2)


def _hold_lock(lock, seconds: float) -> subprocess.Popen:
    """Another process holding `lock` for `seconds`, returned once it holds it."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; from pathlib import Path; "
                               "from coda_train.durable import exclusive_lock\n"
                               f"with exclusive_lock(Path({str(lock)!r}), wait=False):\n"
                               f"    print('held', flush=True); time.sleep({seconds})"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_exclusive_lock_names_its_holder_and_dies_with_it(tmp_path):
    lock = tmp_path / "x.lock"
    holder = _hold_lock(lock, seconds=60)
    with pytest.raises(LockHeldError, match=f"locked by pid {holder.pid} on host "):
        with exclusive_lock(lock, wait=False):
            pass
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
    holder.wait()
    with exclusive_lock(lock, wait=False):
        assert lock.read_text().split()[:2] == ["pid", str(os.getpid())]


def test_exclusive_lock_with_wait_blocks_until_the_holder_lets_go(tmp_path, caplog):
    lock = tmp_path / "x.lock"
    holder = _hold_lock(lock, seconds=1.5)
    caplog.set_level("INFO")
    start = time.monotonic()
    with exclusive_lock(lock, wait=True):
        assert time.monotonic() - start > 1.0  # blocked until the holder's 1.5 s were over
    assert f"held by pid {holder.pid} on host" in caplog.text
    holder.wait()


def test_second_run_in_a_busy_run_dir_stops_at_once_naming_the_holder(tiny, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "train.py", *tiny, f"trainer.run_dir={run_dir}", "trainer.max_steps=100000",
                              "trainer.ckpt_every=0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(first, run_dir, 2)
    other_cache = tmp_path / "other_cache"  # the second run's data would be prepared here: it must not be
    second = run_train(*[o for o in tiny if not o.startswith("data.cache_dir=")], f"data.cache_dir={other_cache}",
                       f"trainer.run_dir={run_dir}", "trainer.max_steps=5", "optim.lr=1e-3")
    output = second.stdout + second.stderr
    assert second.returncode == 1, output
    assert f"trainer.run_dir={run_dir} is in use by another training run" in output
    assert f"pid {first.pid} on host" in output and "choose another trainer.run_dir" in output
    assert "Traceback" not in output and not other_cache.exists()
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, out
    (saved,) = list_checkpoints(run_dir / "checkpoints")
    last = verify_checkpoint(saved)["step"]
    assert steps_logged(run_dir) == list(range(1, last + 1))  # every step once, none lost
    assert "lr: 0.003" in (run_dir / "config.yaml").read_text()  # the first run's config, not the second's


def test_a_killed_runs_lock_and_partial_checkpoint_do_not_block_the_next_run(tiny, tmp_path):
    common = [*tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=8", "trainer.ckpt_every=4"]
    killed = run_train(*common, "debug.sigkill_in_checkpoint_at_step=8")
    assert killed.returncode == -signal.SIGKILL
    ckpts = tmp_path / "checkpoints"
    assert len(list(ckpts.glob(".tmp-step_00000008-*"))) == 1 and (tmp_path / ".lock").exists()
    resumed = run_train(*common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_00000004 (step 4)" in resumed.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000008"]  # partial write removed
    assert steps_logged(tmp_path) == list(range(1, 9))


def test_sigterm_right_after_a_checkpoint_step_saves_it_once(tiny, tmp_path):
    result = run_train(*tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=12", "trainer.ckpt_every=4",
                       "debug.sigterm_after_step=4")
    assert result.returncode == 0, result.stderr
    assert "received SIGTERM" in result.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]  # no .replaced-*, no .tmp-*
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_00000004")["step"] == 4


def test_disk_full_mid_checkpoint_is_one_paragraph_and_the_next_run_resumes(tiny, tmp_path):
    common = [*tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=8", "trainer.ckpt_every=4"]
    full = run_train(*common, "debug.disk_full_in_checkpoint_at_step=8")
    output = full.stdout + full.stderr
    assert full.returncode == 4, output
    assert "Traceback" not in output and "unexpected pos" not in output
    (line,) = [line for line in output.splitlines() if "could not write" in line]
    assert f"could not write the checkpoint of step 8 to {tmp_path / 'checkpoints'}" in line
    assert "No space left on device" in line and "Free space on that filesystem" in line
    assert f"The newest checkpoint, {tmp_path / 'checkpoints' / 'step_00000004'}, is intact" in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]  # the partial one removed
    verify_checkpoint(tmp_path / "checkpoints" / "step_00000004")
    resumed = run_train(*common)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stdout
    assert steps_logged(tmp_path) == list(range(1, 9))
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000008", "step_00000004"]


def test_free_space_is_checked_before_a_checkpoint_is_written(tiny, tmp_path, monkeypatch):
    real = shutil.disk_usage
    calls = []

    def second_checkpoint_finds_a_full_disk(path):
        calls.append(path)
        usage = real(path)
        return usage._replace(free=4096) if len(calls) == 2 else usage

    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", second_checkpoint_finds_a_full_disk)
    with pytest.raises(RunDirError) as failure:
        train_in_process(tmp_path, *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2")
    message = str(failure.value)
    assert "could not write the checkpoint of step 4" in message and "MiB free (checked before writing)" in message
    assert f"{tmp_path / 'checkpoints' / 'step_00000002'}, is intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    assert steps_logged(tmp_path) == [1, 2, 3, 4]


def test_unwritable_run_dir_is_one_paragraph_and_touches_nothing(tiny, tmp_path, monkeypatch):
    train_in_process(tmp_path, *tiny, "trainer.max_steps=2", "trainer.ckpt_every=2")
    before = snapshot(tmp_path)
    real_open = os.open

    def read_only(path, flags, *args):  # what a read-only mount answers, for root too
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr("coda_train.durable.os.open", read_only)
    with pytest.raises(RunDirError) as failure:
        train_in_process(tmp_path, *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2")
    message = str(failure.value)
    assert f"could not write the run lock to {tmp_path / '.lock'}: Read-only file system" in message
    assert "mounted read-only" in message and f"{tmp_path / 'checkpoints' / 'step_00000002'}, is intact" in message
    monkeypatch.undo()
    assert snapshot(tmp_path) == before


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_read_only_mounted_run_dir_exits_4_with_the_fix(tiny, tmp_path):
    train_in_process(tmp_path, *tiny, "trainer.max_steps=2", "trainer.ckpt_every=2")
    before = snapshot(tmp_path)
    if not (shutil.which("mount") and _mount("--bind", str(tmp_path), str(tmp_path))):
        pytest.skip("needs a read-only bind mount (root and mount(8))")
    try:
        if not _mount("-o", "remount,ro,bind", str(tmp_path)):
            pytest.skip("cannot remount read-only here")
        result = run_train(*tiny, f"trainer.run_dir={tmp_path}", "trainer.max_steps=4")
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    assert "Traceback" not in output and "Read-only file system" in output and "remount it read-write" in output
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("override", ["optim.eps=nan", "optim.eps=inf", "optim.lr=inf", "optim.weight_decay=nan",
                                      "optim.grad_clip=nan", "optim.betas=[0.9,nan]", "optim.min_lr_ratio=nan",
                                      "model.init_std=inf", "model.rope_theta=nan", "trainer.peak_flops=inf"])
def test_non_finite_float_settings_are_config_errors_at_start(tiny, tmp_path, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.* is not a finite number; every float setting must be finite"):
        check_config(compose_config(tmp_path, *tiny, override))
    with pytest.raises(ConfigError, match=key):
        train_in_process(tmp_path / "run", *tiny, override)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["init_std", "rope_theta", "norm_eps"])
def test_model_config_rejects_non_finite_floats(name):
    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=f"{name}={value} must be a finite number > 0"):
            preset("tiny", **{name: value})


def test_shape_errors_fail_before_data_preparation(tiny, tmp_path):
    cache = tmp_path / "cache"
    fresh_data = [o for o in tiny if not o.startswith("data.cache_dir=")] + [f"data.cache_dir={cache}"]
    with pytest.raises(ConfigError, match="trainer.seq_len=64 exceeds the model's max_seq_len=32"):
        train_in_process(tmp_path / "run", *fresh_data, "model.max_seq_len=32", "trainer.seq_len=64")
    with pytest.raises(ConfigError, match="n_heads=3 must divide dim=64"):
        train_in_process(tmp_path / "run", *fresh_data, "model.n_heads=3")
    # a vocabulary below the BPE this run would train (tiny: data.vocab_size=300)
    with pytest.raises(ConfigError, match=r"model.vocab_size=290 is smaller than the tokenizer's vocabulary \(300 tokens\)"):
        train_in_process(tmp_path / "run", *fresh_data, "model.vocab_size=290")
    assert not cache.exists() and not (tmp_path / "run").exists()
    # the cute kernels' limits, checked on CPU: every dim but a vocabulary that follows the tokenizer
    cute_ok = [*tiny, "model.n_heads=2"]  # head_dim 32: the tiny model's 16 is below the RoPE epilogue's subtile
    with pytest.raises(ConfigError, match="head_dim=16"):
        check_model_before_data(compose_config(tmp_path, *tiny), "cute")
    with pytest.raises(ConfigError, match="model.ffn_dim=100"):
        check_model_before_data(compose_config(tmp_path, *cute_ok, "model.ffn_dim=100"), "cute")
    with pytest.raises(ConfigError, match="model.vocab_size=300"):
        check_model_before_data(compose_config(tmp_path, *cute_ok, "model.vocab_size=300"), "cute")


def test_a_vocab_multiple_the_cute_lm_head_cannot_run_fails_before_data_preparation(tiny, tmp_path):
    """A vocabulary that follows the tokenizer (model.vocab_size null) rounded up to a model.vocab_multiple_of that is
    no multiple of 128 was refused only after data preparation (hours for a large corpus), naming a model.vocab_size
    the config did not set: now at the start, naming model.vocab_multiple_of and values that run."""
    cute_ok = [*tiny, "model.n_heads=2"]
    check_model_before_data(compose_config(tmp_path, *cute_ok, "model.vocab_multiple_of=256"), "cute")
    # a BPE trained here: its size is known only after data preparation, so every multiple of 64 must run
    with pytest.raises(ConfigError, match=r"model.vocab_multiple_of=64: .*; set model.vocab_multiple_of=128 \(or "
                                          r"another multiple of 128\), or model.vocab_size to a multiple of 128"):
        check_model_before_data(compose_config(tmp_path, *cute_ok, "model.vocab_multiple_of=64"), "cute")
    check_model_before_data(compose_config(tmp_path, *cute_ok, "model.vocab_multiple_of=1"), "reference")
    # a given tokenizer is read at the start: its own count is checked, and the message names a model.vocab_size that runs
    tiny_cache = Path(next(a for a in tiny if a.startswith("data.cache_dir=")).split("=", 1)[1])
    tokenizer = next(tiny_cache.glob("*/tokenizer.json"))
    tokens = num_ids(Tokenizer.from_file(str(tokenizer)))
    given = [*cute_ok, f"data.tokenizer={tokenizer}"]
    with pytest.raises(ConfigError, match=rf"the tokenizer's {tokens} tokens rounded up to a multiple of 1: {tokens}, .*"
                                          rf"set model.vocab_multiple_of=128 .*, or model.vocab_size={-(-tokens // 128) * 128}$"):
        check_model_before_data(compose_config(tmp_path, *given, "model.vocab_multiple_of=1"), "cute")
    check_model_before_data(compose_config(tmp_path, *given), "cute")  # model.vocab_multiple_of=128


def test_shape_errors_of_a_model_init_from_name_the_backend_not_its_fixed_fields(tmp_path):
    """A Hugging Face model the cute kernels cannot run (head_dim 100, vocab 32001) is refused before data
    preparation, vocabulary included, and the fix named is the backend: its model.* fields are fixed."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    transformers.LlamaConfig(hidden_size=3200, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8640,
                             num_hidden_layers=2, vocab_size=32001, max_position_embeddings=256).save_pretrained(hf)
    with pytest.raises(ConfigError) as error:
        check_model_before_data(compose_config(tmp_path / "run", f"model.init_from={hf}", "trainer.seq_len=256"), "cute")
    message = str(error.value)
    assert "head_dim=100" in message and "model.vocab_size=32001" in message
    assert f"model.init_from={hf} fixes the shape, so run it with kernels.backend=reference" in message


def _a_gpu(monkeypatch, free_gib: float, total_gib: float = 79.2) -> None:
    """torch.cuda as check_state_fits reads it, for a GPU (an H100) with free_gib of total_gib free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * 2**30), int(total_gib * 2**30)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_a_model_whose_training_state_cannot_fit_the_gpu_stops_before_the_data_is_prepared(tiny, tmp_path, monkeypatch):
    """llama3_8b on one 80 GB GPU: its fp32 weights, gradients and AdamW moments alone exceed the GPU's free memory, so
    the run stops at start naming the numbers and the fixes, not with CUDA's out-of-memory error once the data is
    prepared (hours for a large corpus). The GPU is simulated: only the check reads it before the data."""
    monkeypatch.setattr("coda_train.trainer.loop.pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr("coda_train.trainer.loop.prepare", lambda *a, **k: pytest.fail("the data was prepared"))
    _a_gpu(monkeypatch, free_gib=78.5)
    run = [a for a in tiny if not a.startswith("model.")]
    with pytest.raises(ConfigError, match=r"model llama3_8b \(6,9.* parameters\) does not fit in the memory of cuda "
                       r"\(NVIDIA H100 80GB HBM3: 78.5 GiB free of 79.2 GiB\): its training state alone takes .* GiB"
                       r".*; nothing was prepared or written$"):
        train_in_process(tmp_path / "run", *run, "model=llama3_8b")
    assert not (tmp_path / "run").exists()


def test_the_state_check_counts_what_each_layout_holds_on_each_gpu(tmp_path, monkeypatch):
    """16 bytes a parameter (fp32 weight, gradient, two AdamW moments), sharded under FSDP2; the weights held whole in
    bf16 beside them: the CODA model's compute copies on one GPU, FSDP2's gathered model unless it reshards after the
    forward; nothing on CPU. Each refusal names the numbers and the fixes that apply to that layout."""
    cfg = compose_config(tmp_path, "model=llama3_8b")
    llama, cuda = preset("llama3_8b"), torch.device("cuda", 0)
    _a_gpu(monkeypatch, free_gib=78.5)
    with pytest.raises(ConfigError) as error:
        check_state_fits(cfg, llama, cuda, torch.bfloat16, 1, "none")
    assert str(error.value) == (
        "model llama3_8b (8,030,261,248 parameters) does not fit in the memory of cuda:0 (NVIDIA H100 80GB HBM3: 78.5 "
        "GiB free of 79.2 GiB): its training state alone takes 132.7 GiB: 119.7 GiB of fp32 weights, gradients and "
        "AdamW moments (16 bytes a parameter) + 13.0 GiB of bfloat16 compute copies of every weight but the embedding "
        "and LM head, before any activation. Train a smaller model (another model= preset, fewer model.n_layers, a "
        "smaller model.dim or model.ffn_dim); or run on at least 2 of these GPUs under torchrun with "
        "trainer.parallel=fsdp (fsdp is the default there), which shards the 16 bytes a parameter over them; nothing "
        "was prepared or written")
    check_state_fits(cfg, llama, cuda, torch.bfloat16, 2, "fsdp")  # 59.8 GiB of shards + 15.0 GiB gathered
    check_state_fits(cfg, preset("llama3_1b"), cuda, torch.bfloat16, 1, "none")
    _a_gpu(monkeypatch, free_gib=60)
    with pytest.raises(ConfigError, match=r"takes 74.8 GiB: 59.8 GiB of fp32 weights, gradients and AdamW moments \(16 "
                       r"bytes a parameter, 1/2 of them on each of 2 GPUs\) \+ 15.0 GiB of the whole model gathered in "
                       r"bfloat16 .*; or set trainer.fsdp_reshard_after_forward=true \(.*; then at least 2 of these "
                       r"GPUs\); or run on at least 3 of these GPUs; or free the memory other processes hold on this "
                       r"GPU \(19.2 GiB is in use\)"):
        check_state_fits(cfg, llama, cuda, torch.bfloat16, 2, "fsdp")
    cfg.trainer.fsdp_reshard_after_forward = True
    check_state_fits(cfg, llama, cuda, torch.bfloat16, 2, "fsdp")
    _a_gpu(monkeypatch, free_gib=125)  # above the 119.7 GiB of fp32 state: the eager model keeps no compute copies
    with pytest.raises(ConfigError, match="takes 132.7 GiB"):
        check_state_fits(cfg, llama, cuda, torch.bfloat16, 1, "none")
    cfg.model.impl = "eager"
    check_state_fits(cfg, llama, cuda, torch.bfloat16, 1, "none")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("a CPU run read GPU memory"))
    check_state_fits(cfg, llama, torch.device("cpu"), torch.float32, 1, "none")


def test_meta_json_missing_a_key_is_a_checkpoint_error(tiny, tmp_path, caplog):
    train_in_process(tmp_path, *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2")
    newest = tmp_path / "checkpoints" / "step_00000004"
    meta = json.loads((newest / "meta.json").read_text())
    del meta["step"]
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"{newest / 'meta.json'} lacks the key 'step'"):
        train_in_process(tmp_path, *tiny, "trainer.max_steps=6", f"trainer.resume={newest}")
    last = train_in_process(tmp_path, *tiny, "trainer.max_steps=6", "trainer.ckpt_every=2").metrics  # auto: skips it
    assert "lacks the key 'step'" in caplog.text and last["step"] == 6
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_resume_by_path_refuses_what_it_cannot_read_and_keeps_the_run(tiny, tmp_path):
    """trainer.resume=<path> names the fix for a typo'd path, an unreadable or foreign-format meta.json and
    a verified state.pt of another trainer; each refusal leaves the run's files as they were."""
    train_in_process(tmp_path, *tiny, "trainer.max_steps=2", "trainer.ckpt_every=2")
    good = tmp_path / "checkpoints" / "step_00000002"
    with pytest.raises(CheckpointError, match="is not a checkpoint, a checkpoints dir or a run dir with checkpoints; "
                                              "pass an existing path"):
        train_in_process(tmp_path, *tiny, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'chekpoints'}")
    # a checkpoint whose state.pt verifies but lacks the optimizer: written by another tool or trainer
    meta = json.loads((good / "meta.json").read_text())
    state = torch.load(good / "state.pt", weights_only=True)
    foreign = save_checkpoint(tmp_path / "checkpoints", 3, {"model": state["model"]},
                              {k: meta[k] for k in ("model", "impl", "config")}, keep_last=5)
    damaged = tmp_path / "checkpoints" / "step_00000004"
    shutil.copytree(good, damaged)
    cases = [(foreign, None, r"state.pt does not hold this trainer's state .*; choose another checkpoint"),
             (damaged, "{not json", r"has no readable meta.json .*choose another checkpoint for trainer.resume"),
             (damaged, json.dumps({**meta, "format": 999}), "has an unknown meta.json format; choose another checkpoint")]
    for path, meta_text, message in cases:
        if meta_text is not None:
            (path / "meta.json").write_text(meta_text)
        before = snapshot(tmp_path)
        with pytest.raises(CheckpointError, match=message):
            train_in_process(tmp_path, *tiny, "trainer.max_steps=4", f"trainer.resume={path}")
        assert snapshot(tmp_path) == before
    assert steps_logged(tmp_path) == [1, 2]


def test_a_run_started_from_another_runs_checkpoint_continues_with_auto_and_never_over_itself(tiny, tmp_path):
    """trainer.resume=<another run's checkpoint>: a stop says to continue with trainer.resume=auto, and the same
    command again is refused before it touches the run's own checkpoints (starting over from the other run
    would set them aside and prune them); with auto the run continues where it stopped."""
    first, second = tmp_path / "first", tmp_path / "second"
    train_in_process(first, *tiny, "trainer.max_steps=2", "trainer.ckpt_every=2")
    command = [*tiny, f"trainer.run_dir={second}", "trainer.max_steps=6", "trainer.ckpt_every=2",
               f"trainer.resume={first / 'checkpoints' / 'step_00000002'}"]
    stopped = run_train(*command, "debug.sigterm_after_step=4")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert f"trainer.run_dir={second.resolve()} and trainer.resume=auto" in stopped.stdout + stopped.stderr
    before = snapshot(second)
    again = run_train(*command)
    out = again.stdout + again.stderr
    assert again.returncode == 1 and "already holds checkpoints of its own (newest: step_00000004)" in out, out[-2000:]
    assert "trainer.resume=auto" in out and snapshot(second) == before
    continued = run_train(*command[:-1], "trainer.resume=auto")
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert steps_logged(second) == [3, 4, 5, 6]


def test_set_aside_names_stay_unique_when_a_pid_repeats(tmp_path, monkeypatch):
    """A container's entrypoint gets the same PID at every launch: a second resume from the same older step
    must still find a free name for what it sets aside."""
    monkeypatch.setattr(os, "getpid", lambda: 7)
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"model": {}}, keep_last=5)
    for _ in range(2):  # step 2 written, then set aside by a resume from step 1: twice, by the same PID
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, {"model": {}}, keep_last=5)
        set_aside_newer(tmp_path, 1, damaged=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".replaced-step_00000002-7", ".replaced-step_00000002-8",
                                                          "step_00000001"]


def test_exit_code_of_a_stop_during_data_preparation_is_zero():
    """SIGTERM/SIGINT while preparing data is a stop, not bad input: train.py exits 0 as after a step."""
    from coda_train.data import DataError, PreparationInterrupted
    from coda_train.trainer.loop import exit_code

    assert exit_code(PreparationInterrupted(signal.SIGTERM)) == 0
    assert exit_code(DataError("bad")) == 1


def test_set_aside_checkpoints_count_against_keep_last(tmp_path):
    def save(step):
        save_checkpoint(tmp_path, step, {"w": torch.full((4,), float(step))}, {"model": {}}, keep_last=3)

    def names():
        return sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir())

    for step in (1, 2, 3):
        save(step)
    set_aside_newer(tmp_path, 1, damaged=False)  # resuming from step 1
    assert names() == [".replaced-step_00000002", ".replaced-step_00000003", "step_00000001"]
    save(2)  # 4 checkpoint-sized dirs: the lowest set-aside one goes
    assert names() == [".replaced-step_00000003", "step_00000001", "step_00000002"]
    save(3)
    save(4)
    assert names() == ["step_00000002", "step_00000003", "step_00000004"]


def test_a_checkpoints_model_fields_this_code_cannot_build_are_a_checkpoint_error(tmp_path):
    import dataclasses

    from coda_train.trainer.checkpoint import saved_model

    fields = dataclasses.asdict(preset("tiny"))
    assert saved_model(tmp_path, {"model": fields}) == preset("tiny")
    for model in ({**fields, "bias": True}, {**fields, "dim": -1}, None):  # another version's field, an invalid value, none
        meta = {} if model is None else {"model": model}
        with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}: meta.json lacks a usable model config"):
            saved_model(tmp_path, meta)


def test_a_run_dir_holding_other_files_is_refused_before_anything_is_written(tiny, tmp_path):
    """trainer.run_dir naming a folder of the user's (e.g. `.` in a project folder): a run would overwrite its
    config.yaml and metrics.jsonl, so it is refused (exit 1) with the files named, nothing touched; an empty folder
    or an earlier run's dir is taken."""
    own = tmp_path / "project"
    own.mkdir()
    (own / "config.yaml").write_text("mine: true\n")
    before = snapshot(own)
    result = run_train(*tiny, f"trainer.run_dir={own}", "trainer.max_steps=1")
    assert result.returncode == 1, result.stderr
    assert f"trainer.run_dir={own} holds files that are not a training run's (config.yaml)" in result.stdout + result.stderr
    assert snapshot(own) == before and sorted(p.name for p in own.iterdir()) == ["config.yaml"]
    # another tool's config.yaml beside a metrics.jsonl (a run's name): the run took it for its own and dropped the lines
    (own / "metrics.jsonl").write_text('{"step": 100, "loss": 0.1}\nepoch 3 done\n')
    before = snapshot(own)
    result = run_train(*tiny, f"trainer.run_dir={own}", "trainer.max_steps=1")
    assert result.returncode == 1, result.stderr
    assert "holds a config.yaml that is not a training run's (config.yaml, metrics.jsonl)" in result.stdout + result.stderr
    (own / "config.yaml").unlink()  # a metrics.jsonl alone: every run writes its config.yaml beside it
    before = snapshot(own)
    result = run_train(*tiny, f"trainer.run_dir={own}", "trainer.max_steps=1")
    assert result.returncode == 1 and "holds a metrics.jsonl without the config.yaml" in result.stdout + result.stderr
    assert snapshot(own) == before
    # a run's dir (train.log and the lock) whose config.yaml was damaged or deleted still resumes
    (tmp_path / "run").mkdir()
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=1", "trainer.eval_every=0")
    (tmp_path / "run" / "config.yaml").write_text("{cut sh")
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=2", "trainer.eval_every=0")
    (tmp_path / "run" / "config.yaml").unlink()
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=3", "trainer.eval_every=0")
    assert steps_logged(tmp_path / "run") == [1, 2, 3]
    (tmp_path / "empty").mkdir()
    train_in_process(tmp_path / "empty", *tiny, "trainer.max_steps=1", "trainer.eval_every=0")
    train_in_process(tmp_path / "empty", *tiny, "trainer.max_steps=2", "trainer.eval_every=0")  # an earlier run's dir
    assert steps_logged(tmp_path / "empty") == [1, 2]


@pytest.mark.parametrize("warmup_steps, last_lr", [(500, "1.2e-05"), (2, "0.003")])
def test_a_warmup_as_long_as_the_run_is_said(tiny, tmp_path, caplog, warmup_steps, last_lr):
    """With the lr the last step applies: a warmup exactly as long as the run reaches optim.lr at its last step."""
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=2", "trainer.eval_every=0",
                     f"optim.warmup_steps={warmup_steps}", "optim.lr=3e-3")
    assert (f"optim.warmup_steps={warmup_steps} >= trainer.max_steps=2: the whole run warms up, the learning rate "
            f"rising to {last_lr} at its last step (optim.lr=0.003), and never decays") in caplog.text


def test_a_warmup_that_overlaps_the_wsd_decay_is_said(tiny, tmp_path, caplog):
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", "trainer.eval_every=0", "optim.schedule=wsd",
                     "optim.warmup_steps=3", "optim.decay_fraction=0.5")
    assert ("optim.warmup_steps=3 overlaps the wsd decay over the last 2 of trainer.max_steps=4 steps "
            "(optim.decay_fraction=0.5): the decay starts when warmup ends and takes 1 step(s)") in caplog.text


def test_a_resume_with_nothing_to_do_leaves_the_run_as_it_was(tiny, tmp_path):
    """trainer.max_steps at the checkpoint's step: no step runs, so config.yaml keeps the settings the steps were
    taken with (not this invocation's), and the metrics and checkpoints stay as they are."""
    run_dir = tmp_path / "run"
    train_in_process(run_dir, *tiny, "trainer.max_steps=2", "trainer.eval_every=0")
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    train_in_process(run_dir, *tiny, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.batch_size=2",
                     "trainer.grad_accum_steps=2")
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]


def test_a_resume_from_another_directory_takes_the_data_it_prepared(tiny, tmp_path, monkeypatch, caplog):
    """A relative data.cache_dir (the default is data_cache) names another folder from another working directory: the
    resumed run prepared its corpus there again (hours for a large one) though its checkpoint records the folder."""
    run = (*tiny, "data.cache_dir=cache", "trainer.eval_every=0")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=2")

    def no_preparation(*args, **kwargs):
        raise AssertionError("the run's data was prepared again")

    monkeypatch.setattr("coda_train.trainer.loop.prepare", no_preparation)
    monkeypatch.chdir(tmp_path / "b")
    with caplog.at_level("INFO"):
        train_in_process(tmp_path / "run", *run, "trainer.max_steps=3")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]
    assert (f"data.cache_dir=cache holds no prepared copy of this run's data: it continues on the folder it prepared, "
            f"{tmp_path / 'a' / 'cache'}") in caplog.text
    assert not (tmp_path / "b" / "cache").exists()


def test_a_resume_after_its_corpus_changed_continues_on_the_data_it_prepared(tiny, tmp_path, monkeypatch, caplog):
    """A document appended to the corpus (or the corpus gone): the resumed run takes the folder it prepared, where its
    data order's windows are, instead of preparing the changed corpus (hours) for the loader to refuse."""
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(next(a for a in tiny if a.startswith("data.source=")).split("=", 1)[1], corpus)
    run = (*tiny, f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.eval_every=0")
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=2")
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")

    def no_preparation(*args, **kwargs):
        raise AssertionError("the changed corpus was prepared")

    monkeypatch.setattr("coda_train.trainer.loop.prepare", no_preparation)
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=3")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]
    assert "its files changed since the run prepared them; this resumed run continues on the data it prepared" in caplog.text
    # every rank of a multi-process run takes the folder, and the main rank alone says so
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    checkpoint = Checkpoint(newest, verify_checkpoint(newest))
    caplog.clear()
    assert resumed_runs_prepared_data(checkpoint, data_config(compose_config(tmp_path, *run)), World(1, 2)) is not None
    assert "continues on the data it prepared" not in caplog.text
    corpus.unlink()
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=4")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert "it cannot be read now; this resumed run continues on the data it prepared" in caplog.text
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the one folder the run prepared


def test_a_resume_with_another_corpus_setting_says_which_not_that_the_files_changed(tiny, tmp_path, monkeypatch, caplog):
    """data.text_field (or data.source, format, split, tokenizer) changed since the checkpoint gives another prepared
    folder too: the warning names that setting, with the checkpoint's value, instead of blaming the corpus files."""
    run = (*tiny, "trainer.eval_every=0")
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=2")
    monkeypatch.setattr("coda_train.trainer.loop.prepare", lambda *a, **k: pytest.fail("the data was prepared again"))
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=3", "data.text_field=content")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]
    assert ("this run's data settings differ from the checkpoint's (data.text_field: checkpoint 'text' vs this run "
            "'content'); this resumed run continues on the data it prepared") in caplog.text
    assert "its files changed" not in caplog.text


def test_a_resume_with_another_hub_revision_continues_on_the_data_it_prepared(tiny, tmp_path, monkeypatch, caplog):
    """data.revision is part of a hub dataset's identity: resumed with another one (or pinned after an unpinned start),
    the run continues on the folder it prepared with a warning naming data.revision, as for another data.source."""
    corpus = next(a for a in tiny if a.startswith("data.source=")).split("=", 1)[1]
    docs = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines()]
    monkeypatch.setattr("datasets.load_dataset", lambda name, split, streaming, revision: [{"text": d} for d in docs])
    monkeypatch.chdir(tmp_path)  # "org" is no local folder here
    run = (*tiny, "data.source=org/corpus", f"data.cache_dir={tmp_path / 'cache'}", "trainer.eval_every=0")
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=2")
    monkeypatch.setattr("coda_train.trainer.loop.prepare", lambda *a, **k: pytest.fail("the data was prepared again"))
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=3", "data.revision=abc123")
    assert ("this run's data settings differ from the checkpoint's (data.revision: checkpoint None vs this run "
            "'abc123'); this resumed run continues on the data it prepared") in caplog.text
    caplog.clear()
    train_in_process(tmp_path / "run", *run, "trainer.max_steps=4", "data.revision=def456")
    assert ("this run's data settings differ from the checkpoint's (data.revision: checkpoint 'abc123' vs this run "
            "'def456'); this resumed run continues on the data it prepared") in caplog.text
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the one folder the run prepared


def test_a_resume_whose_data_tokenizer_is_gone_continues_on_the_data_it_prepared(tiny, tmp_path, monkeypatch, caplog):
    """data.tokenizer deleted after the run began: the resumed run continues on the folder it prepared, which holds a
    copy of it (as a resume whose corpus or model.init_from is gone does). With that folder gone too it stops before
    any data work, naming the run, the tokenizer path its data was prepared with and the fixes a resume has (not a new
    run's: leave data.tokenizer unset to train a BPE); a copy of that tokenizer (the same fingerprint) then continues
    it, and another tokenizer is refused before it prepares anything."""
    tiny_cache = Path(next(a for a in tiny if a.startswith("data.cache_dir=")).split("=", 1)[1])
    tokenizer, cache, run_dir = tmp_path / "tokenizer.json", tmp_path / "cache", tmp_path / "run"
    shutil.copy(next(tiny_cache.glob("*/tokenizer.json")), tokenizer)
    run = (*tiny, f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}", "trainer.eval_every=0")
    train_in_process(run_dir, *run, "trainer.max_steps=2")
    tokenizer.unlink()
    monkeypatch.setattr("coda_train.trainer.loop.prepare", lambda *a, **k: pytest.fail("the data was prepared again"))
    train_in_process(run_dir, *run, "trainer.max_steps=3")
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
    (folder,) = cache.iterdir()
    assert (f"data.tokenizer={tokenizer} does not exist any more: this resumed run continues on the data it prepared "
            f"with it, {folder}, which holds a copy of it") in caplog.text

    folder.rename(tmp_path / "aside")
    before = snapshot(run_dir)
    recorded = json.loads((tmp_path / "aside" / "manifest.json").read_text())["tokenizer"]["fingerprint"]
    with pytest.raises(DataError) as error:
        train_in_process(run_dir, *run, "trainer.max_steps=4")
    assert str(error.value) == (
        f"data.tokenizer={tokenizer}, the tokenizer run {run_dir} prepared its data with, is gone; the checkpoint's "
        f"prepared data ({folder}) is gone, and without that tokenizer it cannot be prepared again. Restore the "
        f"tokenizer at {tokenizer}, or set data.tokenizer to a copy of it (the same tokenizer.json, of fingerprint "
        f"{recorded[:12]}... as the checkpoint records); nothing was prepared or changed")
    with pytest.raises(ConfigError, match=f"data.tokenizer={tmp_path / 'typo.json'} does not exist, and the data of "
                       f"checkpoint .*step_00000003 was prepared with data.tokenizer={tokenizer}: resume with "
                       f"data.tokenizer={tokenizer}$"):
        train_in_process(run_dir, *run, "trainer.max_steps=4", f"data.tokenizer={tmp_path / 'typo.json'}")
    other = Tokenizer.from_file(str(tmp_path / "aside" / "tokenizer.json"))
    other.add_tokens(["<|another|>"])
    other.save(str(tmp_path / "other.json"))
    with pytest.raises(CheckpointError, match=f"data.tokenizer={tmp_path / 'other.json'} is another tokenizer .* than "
                       rf"checkpoint .*step_00000003 was trained with \({recorded[:12]}\.\.\.\), and the run's prepared "
                       "data .* is gone"):
        train_in_process(run_dir, *run, "trainer.max_steps=4", f"data.tokenizer={tmp_path / 'other.json'}")
    assert snapshot(run_dir) == before and not any(cache.iterdir())  # nothing prepared

    monkeypatch.undo()  # the run's tokenizer, copied: its data is prepared again with it and the run goes on
    shutil.copy(tmp_path / "aside" / "tokenizer.json", tmp_path / "copy.json")
    train_in_process(run_dir, *run, "trainer.max_steps=4", f"data.tokenizer={tmp_path / 'copy.json'}")
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4]


def test_a_start_reads_the_data_tokenizer_once(tiny, tmp_path, monkeypatch):
    """data.tokenizer is read once per start: its vocabulary checked before the data, then the data prepared with the
    same tokenizer; a resume whose prepared folder is gone compares its fingerprint with that one too. The file was
    read two times by a new run and three times by such a resume."""
    tiny_cache = Path(next(a for a in tiny if a.startswith("data.cache_dir=")).split("=", 1)[1])
    tokenizer, cache, run_dir = tmp_path / "tokenizer.json", tmp_path / "cache", tmp_path / "run"
    shutil.copy(next(tiny_cache.glob("*/tokenizer.json")), tokenizer)
    run = (*tiny, f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}", "trainer.eval_every=0")
    reads = []

    class CountingTokenizer:  # tokenizer.py's Tokenizer, counting the files load_tokenizer reads
        from_str = staticmethod(Tokenizer.from_str)

        @staticmethod
        def from_file(path: str) -> Tokenizer:
            reads.append(path)
            return Tokenizer.from_file(path)

    monkeypatch.setattr("coda_train.data.tokenizer.Tokenizer", CountingTokenizer)
    train_in_process(run_dir, *run, "trainer.max_steps=2")
    assert reads == [str(tokenizer)]
    (folder,) = cache.iterdir()
    shutil.rmtree(folder)  # the resume checks the tokenizer's fingerprint, then prepares the data again
    reads.clear()
    train_in_process(run_dir, *run, "trainer.max_steps=3")
    assert reads == [str(tokenizer)]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]


def test_a_resume_its_checkpoint_would_refuse_stops_before_the_data_is_prepared(tiny, tmp_path, monkeypatch):
    """Data settings that give other shards or another BPE, another trainer.seq_len or seed, another model shape: the
    checkpoint's meta.json says so before any preparation (hours for a large corpus), naming the saved values."""
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=2", "trainer.eval_every=0")

    def no_preparation(*args, **kwargs):
        raise AssertionError("the data was prepared before the resume was refused")

    monkeypatch.setattr("coda_train.trainer.loop.prepare", no_preparation)
    for change, named in (("data.max_documents=50", "data.max_documents: saved None vs now 50"),
                          ("data.vocab_size=400", "data.vocab_size: saved 300 vs now 400"),
                          ("trainer.seq_len=16", "trainer.seq_len: saved 32 vs now 16"),
                          ("model.dim=32", "dim: checkpoint 64 vs this run 32")):
        with pytest.raises(CheckpointError, match=named):
            train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", change)
    with pytest.raises(CheckpointError, match=r"resume with trainer.seq_len=32, data.max_documents=None, or choose a new"):
        train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", "data.max_documents=50", "trainer.seq_len=16")
    # another global batch on another micro-batch: the loader would refuse it after preparation; the fix names the
    # accumulation that restores the saved global batch of 4 x 1 x 1 windows
    with pytest.raises(CheckpointError, match=r"global batch \(trainer.batch_size x processes x trainer.grad_accum_steps\)"
                       r": saved 4 x 1 x 1 = 4 vs now 2 x 1 x 1 = 2.*resume with a global batch of 4 windows "
                       r"\(trainer.grad_accum_steps=2 on 1 process\)"):
        train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", "trainer.batch_size=2")
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000002"]
    monkeypatch.undo()  # the same global batch on another layout resumes (the loader's rule)
    train_in_process(tmp_path / "run", *tiny, "trainer.max_steps=4", "trainer.batch_size=2", "trainer.grad_accum_steps=2")
