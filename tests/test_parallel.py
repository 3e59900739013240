"""Multi-process training on CPU (gloo, 2 processes under torchrun): DDP and FSDP2 runs match one
process with the same global batch, and FSDP2 checkpoints resume on another number of processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coda_train.trainer.checkpoint import CheckpointError, list_checkpoints, load_state, verify_checkpoint

from test_trainer import REPO, metrics, run_train

# float32 on CPU: 2 ranks sum the gradient of 2+2 sequences in another order than one process does;
# measured relative differences: loss <= 1e-7, grad_norm <= 3e-7
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
STEPS = ["trainer.max_steps=6", "trainer.eval_every=3", "trainer.ckpt_every=0"]


def run_two_ranks(*overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def assert_same_trajectory(run: list[dict], reference: list[dict]) -> None:
    for a, b in zip(run, reference, strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL)
        assert ("val_loss" in a) == ("val_loss" in b) and a.get("val_loss", 0) == pytest.approx(b.get("val_loss", 0), rel=LOSS_RTOL)


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory):
    """impl -> the run dir of 6 steps of one process with batch 4."""
    def run(impl: str) -> Path:
        run_dir = tmp_path_factory.mktemp(f"single-{impl}")
        result = run_train(*tiny, *STEPS, "trainer.batch_size=4", f"model.impl={impl}", f"trainer.run_dir={run_dir}")
        assert result.returncode == 0, result.stderr
        return run_dir
    return {impl: run(impl) for impl in ("eager", "coda")}


@pytest.mark.parametrize("impl", ["eager", "coda"])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_with_the_whole_batch(tiny, one_process, tmp_path, parallel, impl):
    """Rank r takes every 2nd window of the shared order, so 2 ranks x batch 2 see the same 4 windows
    per step as 1 process x batch 4, and the gradient average (DDP all-reduce, FSDP2 reduce-scatter of
    the sharded gradients) is the mean over them; clipping uses the global norm of the shards."""
    result = run_two_ranks(*tiny, *STEPS, "trainer.batch_size=2", f"model.impl={impl}", f"trainer.parallel={parallel}",
                           f"trainer.run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr + result.stdout
    assert f"x2 {parallel}" in result.stderr + result.stdout
    assert_same_trajectory(metrics(tmp_path), metrics(one_process[impl]))
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000006"]
    saved = tmp_path / "checkpoints" / "step_00000006"
    if parallel == "ddp":  # rank 0 writes the whole state, as one process does
        assert load_state(saved)["model"].keys() == load_state(one_process[impl] / "checkpoints" / "step_00000006")["model"].keys()
    else:  # each rank writes its shards; meta.json, written last, holds every file's checksum
        assert set(verify_checkpoint(saved)["files"]) == {"run_state.pt", "shards/.metadata", "shards/__0_0.distcp",
                                                          "shards/__1_0.distcp"}

def test_fsdp_run_killed_resumes_on_two_and_on_one_process(tiny, tmp_path):
    """A 2-process FSDP2 run SIGKILLed after step 6 (checkpoint at 4, sharded) continues from step 4 on
    2 processes (batch 2 each) and on 1 (batch 4, the shards read into whole tensors): the same global
    batch, so the same trajectory as the uninterrupted run; measured: 2 -> 2 bit-exact, 2 -> 1 within
    2e-7 of the loss (the reduction order differs)."""
    common = [*tiny, "trainer.max_steps=12", "trainer.ckpt_every=4", "trainer.eval_every=6", "trainer.parallel=fsdp"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={straight}").returncode == 0
    result = run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={killed}", "debug.sigkill_after_step=6")
    assert result.returncode != 0 and metrics(killed)[-1]["step"] == 6
    on_one = tmp_path / "on-one"
    subprocess.run(["cp", "-r", str(killed), str(on_one)], check=True)

    resumed = run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(killed), metrics(straight))
    resumed = run_train(*common, "trainer.batch_size=4", f"trainer.run_dir={on_one}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout and "x1 none" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(on_one), metrics(straight))


def test_one_process_checkpoint_resumes_on_two_fsdp_processes(tiny, tmp_path):
    common = [*tiny, "trainer.max_steps=8", "trainer.ckpt_every=4", "trainer.eval_every=4"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_train(*common, "trainer.batch_size=4", f"trainer.run_dir={straight}").returncode == 0
    result = run_train(*common, "trainer.batch_size=4", f"trainer.run_dir={killed}", "debug.sigkill_after_step=5")
    assert result.returncode == -signal.SIGKILL
    resumed = run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout and "x2 fsdp" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(killed), metrics(straight))


def test_fsdp_crash_mid_checkpoint_keeps_the_previous_one_and_damage_is_detected(tiny, tmp_path):
    """SIGKILL on rank 0 after every rank wrote its shards of step 8 but before meta.json: step 4 stays
    the newest checkpoint; a damaged shard of it is then caught by its checksum."""
    result = run_two_ranks(*tiny, "trainer.max_steps=12", "trainer.ckpt_every=4", "trainer.batch_size=2",
                           "trainer.parallel=fsdp", f"trainer.run_dir={tmp_path}", "debug.sigkill_in_checkpoint_at_step=8")
    assert result.returncode != 0
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000004"]
    (partial,) = ckpts.glob(".tmp-step_00000008-*")
    assert (partial / "shards" / "__1_0.distcp").exists() and not (partial / "meta.json").exists()
    shard = ckpts / "step_00000004" / "shards" / "__1_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="shards/__1_0.distcp does not match its checksum"):
        verify_checkpoint(ckpts / "step_00000004")
