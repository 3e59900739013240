"""Multi-process training on CPU (gloo, 2 processes under torchrun): DDP and FSDP2 runs match one
process with the same global batch, FSDP2 checkpoints resume on another number of processes, and
FSDP2 gathers units ahead of their blocks and reduces each block's gradients right after its backward."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from coda_train.trainer.checkpoint import CheckpointError, list_checkpoints, load_state, verify_checkpoint

from test_trainer import REPO, metrics, run_train, train_in_process

# float32 on CPU: 2 ranks sum the gradient of 2+2 sequences in another order than one process does;
# measured relative differences: loss <= 1e-7, grad_norm <= 3e-7 under DDP and about 3e-5 under FSDP2 (2026-12-06)
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
STEPS = ["trainer.max_steps=6", "trainer.eval_every=3", "trainer.ckpt_every=0"]


def run_ranks(processes: int, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                           "train.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_two_ranks(*overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_ranks(2, *overrides, timeout=timeout)


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


# 12 steps of a 2-process FSDP2 run, checkpointed every 4: the trajectory every resume below must continue
FSDP_RUN = ["trainer.max_steps=12", "trainer.ckpt_every=4", "trainer.eval_every=6", "trainer.parallel=fsdp"]


@pytest.fixture(scope="module")
def fsdp_straight(tiny, tmp_path_factory) -> Path:
    """The run dir of FSDP_RUN on 2 processes with batch 2 (global batch 4), synchronous checkpoints."""
    run_dir = tmp_path_factory.mktemp("fsdp-straight")
    result = run_two_ranks(*tiny, *FSDP_RUN, "trainer.batch_size=2", f"trainer.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir


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

def test_fsdp_resharding_after_forward_matches_one_process(tiny, one_process, tmp_path):
    """trainer.fsdp_reshard_after_forward=true (each block gathered again for its backward), through
    training, validation (no-grad forwards) and a sharded checkpoint, on the CODA model."""
    result = run_two_ranks(*tiny, *STEPS, "trainer.batch_size=2", "model.impl=coda", "trainer.parallel=fsdp",
                           "trainer.fsdp_reshard_after_forward=true", f"trainer.run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr + result.stdout
    assert_same_trajectory(metrics(tmp_path), metrics(one_process["coda"]))
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000006"]


def test_eval_sample_and_export_read_an_fsdp_checkpoint(fsdp_straight, tmp_path):
    """The tools open a run's newest checkpoint in one process, without a process group: an FSDP2 run's shards are
    read into whole tensors, equal to torch's own conversion of the same shards (dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from coda_train.inference import open_checkpoint

    ckpt = open_checkpoint(fsdp_straight)
    assert ckpt.path.name == "step_00000012" and "files" in ckpt.meta
    dcp_to_torch_save(ckpt.path / "shards", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    assert ckpt.weights.keys() == whole.keys() and all(torch.equal(ckpt.weights[k], whole[k]) for k in whole)
    for script, *args in (("eval.py", "--max-batches", "1"), ("sample.py", "--max-new-tokens", "4"),
                          ("export_hf.py", "--out", str(tmp_path / "hf"))):
        result = subprocess.run([sys.executable, f"scripts/{script}", str(fsdp_straight), *args], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (script, result.stderr[-2000:])
        assert "torch.distributed is" not in result.stderr, (script, result.stderr[-2000:])  # one process is meant


def test_fsdp_run_killed_resumes_on_two_and_on_one_process(tiny, fsdp_straight, tmp_path):
    """A 2-process FSDP2 run SIGKILLed after step 6 (checkpoint at 4, sharded) continues from step 4 on
    2 processes (batch 2 each) and on 1 (batch 4, the shards read into whole tensors): the same global
    batch, so the same trajectory as the uninterrupted run; measured: 2 -> 2 bit-exact, 2 -> 1 within
    2e-7 of the loss (the reduction order differs)."""
    common = [*tiny, *FSDP_RUN]
    killed = tmp_path / "killed"
    result = run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={killed}", "debug.sigkill_after_step=6")
    assert result.returncode != 0 and metrics(killed)[-1]["step"] == 6
    on_one = tmp_path / "on-one"
    subprocess.run(["cp", "-r", str(killed), str(on_one)], check=True)

    resumed = run_two_ranks(*common, "trainer.batch_size=2", f"trainer.run_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(killed), metrics(fsdp_straight))
    resumed = run_train(*common, "trainer.batch_size=4", f"trainer.run_dir={on_one}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout and "x1 none" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(on_one), metrics(fsdp_straight))


def test_fsdp_checkpoint_of_two_processes_resumes_on_four(tiny, fsdp_straight, tmp_path):
    """Save on 2 (batch 2 each), resume on 4 (batch 1 each): the same 4 windows a step (rank r takes
    every 4th), each shard split in two on load, so the trajectory continues within LOSS_RTOL."""
    run_dir = tmp_path / "on-four"
    subprocess.run(["cp", "-r", str(fsdp_straight), str(run_dir)], check=True)
    resumed = run_ranks(4, *tiny, *FSDP_RUN, "trainer.batch_size=1", f"trainer.run_dir={run_dir}",
                        f"trainer.resume={run_dir / 'checkpoints' / 'step_00000004'}", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout and "x4 fsdp" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(run_dir), metrics(fsdp_straight))
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000012")["processes"] == 4


def test_fsdp_async_checkpoints_match_the_synchronous_run_and_resume_on_two_and_on_one_process(tiny, fsdp_straight, tmp_path):
    """trainer.ckpt_async=true: the shards are copied to memory and written while training continues,
    each checkpoint published before the next save and before the run exits. The trajectory is the
    synchronous run's (the copy is taken at the checkpoint's step), every checkpoint verifies with the
    same files, and the one at step 4 resumes on 2 processes (async again) and on 1."""
    common = [*tiny, *FSDP_RUN]
    run_dir = tmp_path / "async"
    result = run_two_ranks(*common, "trainer.batch_size=2", "trainer.ckpt_async=true", f"trainer.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert_same_trajectory(metrics(run_dir), metrics(fsdp_straight))
    ckpts = run_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000012", "step_00000008", "step_00000004"]
    assert not list(ckpts.glob(".tmp-*"))
    for path in list_checkpoints(ckpts):
        assert set(verify_checkpoint(path)["files"]) == set(verify_checkpoint(fsdp_straight / "checkpoints" / path.name)["files"])

    for processes, batch, extra in ((2, 2, ["trainer.ckpt_async=true"]), (1, 4, [])):
        resumed_dir = tmp_path / f"on-{processes}"
        subprocess.run(["cp", "-r", str(run_dir), str(resumed_dir)], check=True)
        overrides = [*common, f"trainer.batch_size={batch}", *extra, f"trainer.run_dir={resumed_dir}",
                     f"trainer.resume={resumed_dir / 'checkpoints' / 'step_00000004'}"]
        resumed = run_two_ranks(*overrides) if processes == 2 else run_train(*overrides)
        assert resumed.returncode == 0, resumed.stderr
        assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout
        assert f"x{processes} {'fsdp' if processes == 2 else 'none'}" in resumed.stderr + resumed.stdout
        assert_same_trajectory(metrics(resumed_dir), metrics(fsdp_straight))


def test_fsdp_async_save_cut_short_keeps_the_previous_checkpoint(tiny, fsdp_straight, tmp_path):
    """SIGKILL right after the async save of step 8 started (its shards in flight, nothing published):
    step 4 is the newest checkpoint and the run resumes from it on the same trajectory. SIGKILL in the
    publish of step 8 (every shard written, meta.json not yet): step 4 again, step 8 a hidden temp dir."""
    common = [*tiny, *FSDP_RUN, "trainer.batch_size=2", "trainer.ckpt_async=true"]
    killed = tmp_path / "killed"
    result = run_two_ranks(*common, f"trainer.run_dir={killed}", "debug.sigkill_after_step=8")
    assert result.returncode != 0 and metrics(killed)[-1]["step"] == 8
    assert [p.name for p in list_checkpoints(killed / "checkpoints")] == ["step_00000004"]
    resumed = run_two_ranks(*common, f"trainer.run_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 (step 4)" in resumed.stderr + resumed.stdout
    assert_same_trajectory(metrics(killed), metrics(fsdp_straight))

    in_publish = tmp_path / "in-publish"
    result = run_two_ranks(*common, f"trainer.run_dir={in_publish}", "debug.sigkill_in_checkpoint_at_step=8")
    assert result.returncode != 0
    ckpts = in_publish / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000004"]
    verify_checkpoint(ckpts / "step_00000004")
    (partial,) = ckpts.glob(".tmp-step_00000008-*")
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata", "run_state.pt"} <= \
        {str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file()}
    assert not (partial / "meta.json").exists()


def test_failed_async_write_removes_its_temp_dir_and_raises_naming_the_checkpoint(tmp_path):
    """A background write that failed (as torch.distributed.checkpoint reports it: a CheckpointException
    holding each failed rank's error) is never published: its temp dir goes, the earlier checkpoint
    stays, and finish raises the OSError (the loop's run-dir error) or a CheckpointError naming the step."""
    import errno
    import os
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException

    from coda_train.trainer.checkpoint import Checkpointer, PendingSave

    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    (root / "step_00000004" / "meta.json").write_text("{}")
    for failure, raised in ((OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device"),
                            (ValueError("bad plan"), r"writing the checkpoint of step 8 \(.*step_00000008\) failed "
                                                     r"\(ValueError: bad plan\); the earlier checkpoints are intact")):
        tmp = root / ".tmp-step_00000008-1"
        (tmp / "shards").mkdir(parents=True)
        written = Future()
        written.set_exception(CheckpointException("write", {1: (failure, None)}))
        checkpointer = Checkpointer(root, keep_last=3, meta={}, ckpt_async=True)
        checkpointer.pending = PendingSave(8, tmp, written)
        assert not checkpointer.written()  # never published early
        with pytest.raises((OSError, CheckpointError), match=raised):
            checkpointer.finish()
        assert checkpointer.pending is None and not tmp.exists()
        assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]


def test_async_checkpoints_need_fsdp(tiny, tmp_path):
    """trainer.ckpt_async=true on one process or under DDP is refused before the run dir is touched."""
    from coda_train.errors import ConfigError
    from coda_train.trainer.checkpoint import check_ckpt_async

    with pytest.raises(ConfigError, match="trainer.ckpt_async=true .* this run is one process.*set trainer.ckpt_async="
                                          "false, or run several processes under torchrun with trainer.parallel=fsdp"):
        train_in_process(tmp_path, *tiny, "trainer.ckpt_async=true")
    assert not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="uses trainer.parallel=ddp.*set trainer.ckpt_async=false"):
        check_ckpt_async(True, "ddp")
    for ckpt_async, parallel in ((True, "fsdp"), (False, "none"), (False, "ddp")):
        check_ckpt_async(ckpt_async, parallel)


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



def test_a_failed_shard_write_stops_every_rank_with_one_paragraph(tiny, tmp_path):
    """A sharded checkpoint whose shard files cannot be written (here: larger than the file size limit, EFBIG; a full
    disk alike) stops every rank with one paragraph naming the checkpoint, not torch.distributed.checkpoint's
    CheckpointException traceback on every rank; the partial write is removed."""
    import resource

    def limit_file_size():  # each rank's shard is about 650 kB; metrics, train.log and config.yaml stay far below
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                             *tiny, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.batch_size=2",
                             "trainer.parallel=fsdp", f"trainer.run_dir={tmp_path}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size)
    output = result.stdout + result.stderr
    worker_tracebacks = [f"[rank{rank}]: Traceback" for rank in (0, 1)] + ["Error executing job", "CheckpointException"]
    assert result.returncode != 0 and not any(text in output for text in worker_tracebacks), output[-3000:]
    # the OSError where torch.distributed.checkpoint reports one (exit 4), else torch.save's account of a short write
    ranks_said = (output.count(f"could not write the checkpoint of step 2 to {tmp_path / 'checkpoints'}") +
                  output.count(f"writing the checkpoint of step 2 ({tmp_path / 'checkpoints' / 'step_00000002'}) failed"))
    assert ranks_said == 2, output[-3000:]
    assert "File too large" in output or "a file write failed: a full disk, a quota or a file size limit" in output
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial write removed
    assert [line["step"] for line in metrics(tmp_path)] == [1, 2]

def test_a_failed_state_write_under_ddp_stops_every_rank_with_one_paragraph(tiny, tmp_path):
    """Under DDP rank 0 alone writes state.pt: its failed write (disk full) stops every rank with the paragraph (exit 4),
    not rank 0 alone while rank 1 ended in its next collective with a gloo 'Connection closed by peer' traceback."""
    result = run_two_ranks(*tiny, "trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.batch_size=2",
                           "trainer.parallel=ddp", "trainer.eval_every=0", f"trainer.run_dir={tmp_path}",
                           "debug.disk_full_in_checkpoint_at_step=2")
    output = result.stdout + result.stderr
    worker_tracebacks = [f"[rank{rank}]: Traceback" for rank in (0, 1)] + ["Error executing job", "Connection closed"]
    assert result.returncode != 0 and not any(text in output for text in worker_tracebacks), output[-3000:]
    assert output.count(f"could not write the checkpoint of step 2 to {tmp_path / 'checkpoints'}") == 2, output[-3000:]
    assert "exitcode  : 4" in output and "exitcode  : 1" not in output, output[-3000:]
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial write removed
    assert [line["step"] for line in metrics(tmp_path)] == [1, 2]

@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_failed_metrics_write_stops_every_rank_with_one_paragraph(tiny, tmp_path, parallel):
    """Rank 0 alone writes metrics.jsonl: its failed write (disk full) stops every rank with the paragraph (exit 4), as a
    failed state.pt write does; rank 1 ended in its next collective with a gloo 'Connection closed by peer' traceback."""
    result = run_two_ranks(*tiny, "trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.batch_size=2",
                           f"trainer.parallel={parallel}", "trainer.eval_every=0", "trainer.log_every=1",
                           f"trainer.run_dir={tmp_path}", "debug.disk_full_in_metrics_at_step=3")
    output = result.stdout + result.stderr
    worker_tracebacks = [f"[rank{rank}]: Traceback" for rank in (0, 1)] + ["Error executing job", "Connection closed"]
    assert result.returncode != 0 and not any(text in output for text in worker_tracebacks), output[-3000:]
    assert output.count(f"could not write the metrics of step 3 to {tmp_path / 'metrics.jsonl'}") == 2, output[-3000:]
    assert "exitcode  : 4" in output and "exitcode  : 1" not in output, output[-3000:]
    assert [line["step"] for line in metrics(tmp_path)] == [1, 2]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]

def test_a_failed_metrics_write_at_the_start_stops_every_rank_with_one_paragraph(tiny, tmp_path):
    """Rank 0 alone rewinds and opens metrics.jsonl before the first step: its failure (here a directory in its place)
    stops every rank with the paragraph (exit 4); rank 1 ended in its next collective with a gloo traceback."""
    common = [*tiny, "trainer.batch_size=2", "trainer.parallel=ddp", "trainer.eval_every=0", f"trainer.run_dir={tmp_path}"]
    assert run_two_ranks(*common, "trainer.max_steps=2").returncode == 0
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    result = run_two_ranks(*common, "trainer.max_steps=4")
    output = result.stdout + result.stderr
    worker_tracebacks = [f"[rank{rank}]: Traceback" for rank in (0, 1)] + ["Error executing job", "Connection closed"]
    assert result.returncode != 0 and not any(text in output for text in worker_tracebacks), output[-3000:]
    assert output.count(f"could not write the run's config.yaml and metrics.jsonl to {tmp_path / 'metrics.jsonl'}: "
                        "Is a directory") == 2, output[-3000:]
    assert "exitcode  : 4" in output and "exitcode  : 1" not in output, output[-3000:]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]

# --- FSDP2 overlap: the order in which units are gathered, blocks run and gradients are reduced ---

OVERLAP_LAYERS = 4


class _Mark(torch.autograd.Function):
    """Identity whose backward appends `event` to `log`: marks where a block's backward starts and ends."""

    @staticmethod
    def forward(ctx, x, event, log):
        ctx.event, ctx.log = event, log
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.event)
        return g, None, None


def _unit(fqn: str):
    """A unit's index from a module or parameter name ('layers.2', 'layers.2.w_o'), or 'root'."""
    return int(fqn.split(".")[1]) if fqn.startswith("layers.") else "root"


def _instrument_fsdp(log: list) -> None:
    """Log ("all_gather", unit) when FSDP2 issues a unit's all-gather, ("reduce_scatter", unit) when it
    issues the reduce-scatter of a unit's gradients, and around each block's call through its weights
    module: ("forward_start"/"forward_end", l), and ("backward_start"/"backward_end", l) when autograd
    enters / leaves the block's backward."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from coda_train.model.weights import LayerWeights

    unshard, reduce, block_call = (_fsdp_param_group.FSDPParamGroup.unshard, _fsdp_param_group.foreach_reduce,
                                   LayerWeights.forward)

    def logged_unshard(group, *args, **kwargs):
        issued = group._all_gather_result is None and not group.is_unsharded
        unshard(group, *args, **kwargs)
        if issued and group._all_gather_result is not None:
            log.append(("all_gather", _unit(group._module_fqn)))

    def logged_reduce(fsdp_params, *args, **kwargs):
        log.append(("reduce_scatter", _unit(fsdp_params[0]._param_fqn)))
        return reduce(fsdp_params, *args, **kwargs)

    def logged_block_call(layer, block, x, *rest):
        l = layer.index
        log.append(("forward_start", l))
        out = block_call(layer, block, _Mark.apply(x, ("backward_end", l), log), *rest)
        log.append(("forward_end", l))
        if isinstance(out, tuple):
            return (_Mark.apply(out[0], ("backward_start", l), log), *out[1:])
        return _Mark.apply(out, ("backward_start", l), log)

    _fsdp_param_group.FSDPParamGroup.unshard = logged_unshard
    _fsdp_param_group.foreach_reduce = logged_reduce
    LayerWeights.forward = logged_block_call


def _end_gloo_worker() -> None:
    """End an mp.spawn worker without finalizing its interpreter, as train.py's end_worker ends a torchrun worker:
    a gloo thread that frees a collective's tensor once finalization has begun aborts the process (SIGABRT,
    "terminate called without an active exception"), which mp.spawn reports as the worker's failure."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _overlap_worker(rank: int, store: str, out: str) -> None:
    """On each of 2 gloo ranks, for both impls and both fsdp_reshard_after_forward: two forward/backward
    passes of a 4-layer model under shard_model with the events logged, and the gradients of each
    checked against one process's on the whole batch. Rank 0 writes {config: [log per pass]}."""
    import torch.distributed as dist

    from coda_train.model import LlamaConfig, build_model
    from coda_train.trainer.distributed import shard_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    log: list = []
    _instrument_fsdp(log)
    cfg = LlamaConfig(dim=64, n_layers=OVERLAP_LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=16)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 96, (2, 4, 16), generator=gen)
    results = {}
    for impl in ("eager", "coda"):
        for reshard in (False, True):
            torch.manual_seed(0)  # the same weights on both ranks
            whole = build_model(cfg, impl)
            for i, layer in enumerate(whole.layers):
                layer.index = i
            sharded = build_model(cfg, impl)
            sharded.load_state_dict(whole.state_dict())
            for i, layer in enumerate(sharded.layers):
                layer.index = i
            whole(tokens, targets).backward()
            shard_model(sharded, torch.float32, reshard)
            passes = []
            for _ in range(2):
                log.clear()
                sharded(tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]).backward()
                passes.append(list(log))
                missing = [name for name, p in sharded.named_parameters() if p.grad is None]
                assert not missing, f"{impl}: no gradient reduced onto {missing} in this backward"
                grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
                for name, p in whole.named_parameters():  # the mean over both ranks' halves: the whole batch's
                    torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
                sharded.zero_grad(set_to_none=True)
            results[f"{impl}-{'reshard' if reshard else 'keep'}"] = passes
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    _end_gloo_worker()


@pytest.fixture(scope="module")
def fsdp_event_logs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("overlap")
    mp.spawn(_overlap_worker, args=(str(root / "store"), str(root / "events.json")), nprocs=2)
    return {config: [[tuple(e) for e in events] for events in passes]
            for config, passes in json.loads((root / "events.json").read_text()).items()}


@pytest.mark.parametrize("reshard", ["keep", "reshard"])
@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_fsdp_gathers_ahead_and_reduces_each_block_after_its_backward(fsdp_event_logs, impl, reshard):
    """The order of FSDP2's communication around the blocks (gradients equal to one process's are
    checked in the worker): in the forward, unit l+1 is gathered before block l starts (a CODA block
    reads l+1's attn_norm) and unit l+2's all-gather is issued after block l-1 and before block l
    computes, so it runs during block l; in the backward, unit l's reduce-scatter is issued when its
    block's backward ends and before block l-1's starts. With reshard_after_forward the backward
    gathers unit l again before its block's backward and prefetches l-1 before that backward ends."""
    L = OVERLAP_LAYERS
    for events in fsdp_event_logs[f"{impl}-{reshard}"]:
        def at(kind, unit, nth=0):
            hits = [i for i, e in enumerate(events) if e == (kind, unit)]
            assert len(hits) > nth, f"no {kind} of unit {unit} (#{nth}) in {events}"
            return hits[nth]

        for l in range(L):
            if l + 1 < L:
                assert at("all_gather", l + 1) < at("forward_start", l)
            if l + 2 < L:
                assert at("all_gather", l + 2) < at("forward_start", l)
                if l > 0:  # not all up front: two units ahead at most
                    assert at("forward_end", l - 1) < at("all_gather", l + 2)
        for l in range(1, L):
            assert at("backward_end", l) < at("reduce_scatter", l) < at("backward_start", l - 1)
        assert at("reduce_scatter", 0) < at("reduce_scatter", "root")
        gathers = [e for e in events if e[0] == "all_gather"]
        if reshard == "keep":  # gathered once per pass, kept until its backward ends
            assert sorted(gathers, key=str) == sorted({("all_gather", u) for u in [*range(L), "root"]}, key=str)
        else:
            for l in range(L):
                assert at("forward_end", l) < at("all_gather", l, 1) < at("backward_start", l)
                if l > 0:
                    assert at("all_gather", l - 1, 1) < at("backward_end", l)


def test_overlap_summary_counts_nccl_time_under_compute():
    """scripts/fsdp_overlap_profile.py's arithmetic on a hand-made timeline (µs): kernels on several
    streams count once (unions), and NCCL time is split into overlapped and exposed."""
    spec = importlib.util.spec_from_file_location("fsdp_overlap_profile", REPO / "scripts" / "fsdp_overlap_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    kernels = [("sm90_gemm", 0, 100), ("flash_fwd", 150, 200), ("sm90_gemm", 90, 95),
               ("ncclDevKernel_AllGather_RING_LL", 50, 170), ("ncclDevKernel_AllGather_RING_LL", 60, 80),
               ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 180, 260)]
    summary = profile.overlap_summary(kernels, steps=2)
    ms = 1e-3 / 2  # per step
    assert summary["compute_busy_ms"] == pytest.approx(150 * ms) and summary["gpu_span_ms"] == pytest.approx(260 * ms)
    assert summary["all_gather"] == pytest.approx({"busy_ms": 120 * ms, "overlapped_ms": 70 * ms, "overlapped_fraction": 70 / 120})
    assert summary["reduce_scatter"] == pytest.approx({"busy_ms": 80 * ms, "overlapped_ms": 20 * ms, "overlapped_fraction": 0.25})
    assert summary["other_nccl"]["busy_ms"] == 0 and summary["other_nccl"]["overlapped_fraction"] is None
    assert summary["nccl"] == pytest.approx({"busy_ms": 200 * ms, "overlapped_ms": 90 * ms, "exposed_ms": 110 * ms,
                                             "overlapped_fraction": 0.45})


def test_data_parallel_asked_of_one_process_is_said(caplog):
    """trainer.parallel=ddp or fsdp in a plain `python train.py` trains as none (one config, any size), and says so
    with the launch that runs it data-parallel; auto and none choose one process and say nothing."""
    from coda_train.trainer.distributed import World, resolve_parallel

    for name in ("auto", "none"):
        assert resolve_parallel(name, World()) == "none"
    assert not caplog.records
    for name in ("ddp", "fsdp"):
        caplog.clear()
        assert resolve_parallel(name, World()) == "none"
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert (f"trainer.parallel={name} needs several processes, and this run is one" in caplog.text
                and "trains as trainer.parallel=none" in caplog.text
                and "torchrun --standalone --nproc_per_node=N train.py" in caplog.text)
    assert resolve_parallel("ddp", World(rank=0, world_size=2)) == "ddp"


def test_fsdp_only_options_are_refused_under_ddp(caplog):
    from coda_train.errors import ConfigError
    from coda_train.trainer.distributed import check_fsdp_options

    with pytest.raises(ConfigError, match="trainer.fsdp_reshard_after_forward=true applies to FSDP2 only.*"
                                          "set trainer.parallel=fsdp, or trainer.fsdp_reshard_after_forward=false"):
        check_fsdp_options("ddp", True)
    for parallel, reshard in (("fsdp", True), ("ddp", False), ("none", False)):
        check_fsdp_options(parallel, reshard)
    assert not caplog.records
    check_fsdp_options("none", True)  # one process: nothing to shard, said and not refused (one config, any size)
    assert "has no effect in a run of one process" in caplog.text


def _stop_check_worker(rank: int, store: str, out: str) -> None:
    """Rank 1 alone has a stop flag; both ranks must see it, through a separate gloo control group as
    init_world makes for NCCL runs, with no device tensor involved."""
    import torch.distributed as dist

    from coda_train.trainer.distributed import World, any_rank

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    world = World(rank, 2, rank, dist.new_group(backend="gloo"))
    seen = [any_rank(rank == 1, world), any_rank(False, world), any_rank(rank == 0, World(rank, 2, rank))]
    Path(f"{out}.{rank}").write_text(json.dumps(seen))
    _end_gloo_worker()


def test_a_stop_on_one_rank_stops_every_rank_through_the_host_side_control_group(tmp_path):
    mp.spawn(_stop_check_worker, args=(str(tmp_path / "store"), str(tmp_path / "seen")), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"seen.{rank}").read_text()) == [True, False, True]


def _refusal_worker(rank: int, store: str, out: str) -> None:
    """A per-rank check that refuses on rank 1 only (its own GPU's free memory, say): both ranks stop with a
    ConfigError, rank 1 with its own, rank 0 with rank 1's named; a check passing everywhere passes everywhere."""
    import torch.distributed as dist

    from coda_train.errors import ConfigError
    from coda_train.trainer.distributed import World, refused_on_any_rank

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    world = World(rank, 2, rank, dist.new_group(backend="gloo"))

    def check() -> None:
        if rank == 1:
            raise ConfigError("model x does not fit in the memory of cuda:1 (3.0 GiB free)")

    said = []
    try:
        refused_on_any_rank(check, world)
    except ConfigError as e:
        said.append(str(e))
    refused_on_any_rank(lambda: None, world)  # both ranks pass, and the group is still in step
    Path(f"{out}.{rank}").write_text(json.dumps(said))
    _end_gloo_worker()


def test_a_check_refused_on_one_rank_stops_every_rank(tmp_path):
    """check_state_fits reads each rank's own GPU: a refusal on one rank alone would leave the others waiting in
    their next collective (the run dir's broadcast) until its timeout; refused_on_any_rank stops them all at once."""
    mp.spawn(_refusal_worker, args=(str(tmp_path / "store"), str(tmp_path / "said")), nprocs=2)
    assert json.loads((tmp_path / "said.1").read_text()) == ["model x does not fit in the memory of cuda:1 (3.0 GiB free)"]
    assert json.loads((tmp_path / "said.0").read_text()) == [
        "rank 1 refused the run: model x does not fit in the memory of cuda:1 (3.0 GiB free)"]


def test_a_stop_that_begins_on_another_rank_is_logged_in_train_log(tiny, tmp_path, monkeypatch):
    """Rank 0 alone holds train.log: a data error only rank 1 meets (its third batch, here made to fail by a
    sitecustomize) is written there too, naming the rank, and rank 0's broken collective says where to look."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from coda_train.data import DataError, TokenLoader\n"
        "    real, calls = TokenLoader.next_batch, []\n"
        "    def next_batch(self):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 3:\n"
        "            raise DataError('shard train_00000.bin holds a damaged token (test)')\n"
        "        return real(self)\n"
        "    TokenLoader.next_batch = next_batch\n")
    monkeypatch.setenv("PYTHONPATH", f"{hooks}:{REPO}")
    run_dir = tmp_path / "run"
    result = run_two_ranks(*tiny, "trainer.max_steps=6", "trainer.eval_every=0", "trainer.ckpt_every=0",
                           "trainer.batch_size=2", f"trainer.run_dir={run_dir}")
    assert result.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "rank 1 stopped: shard train_00000.bin holds a damaged token (test)" in log, log[-2000:]


def test_two_ranks_without_a_run_dir_leave_one_timestamped_dir(tiny, tmp_path):
    """Hydra times a run dir in every process; rank 0's is the run's, and the other rank's unused one is removed."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "train.py"), *tiny, "trainer.max_steps=1", "trainer.eval_every=0"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (day,) = (tmp_path / "outputs").iterdir()
    (run_dir,) = day.iterdir()
    assert [m["step"] for m in metrics(run_dir)] == [1]


def test_a_resume_under_torchrun_says_once_what_it_finds(tiny, tmp_path):
    """Every rank looks for the checkpoint to resume; rank 0 alone says which damaged one it skips and that there is
    nothing to do (each line came once per rank)."""
    common = [*tiny, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.batch_size=2", "trainer.parallel=fsdp",
              f"trainer.run_dir={tmp_path}"]
    assert run_two_ranks(*common).returncode == 0
    again = run_two_ranks(*common)
    assert again.returncode == 0, again.stderr
    assert (again.stdout + again.stderr).count("nothing to do: the checkpoint is at step 4") == 1
    shard = tmp_path / "checkpoints" / "step_00000004" / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    resumed = run_two_ranks(*common)
    assert resumed.returncode == 0, resumed.stderr
    output = resumed.stdout + resumed.stderr
    assert output.count("skipping damaged checkpoint") == 1 and "step_00000002 (step 2)" in output

def test_a_resume_naming_the_same_parallel_mode_otherwise_is_the_same_run(tiny, tmp_path):
    """trainer.parallel=fsdp, resumed with the default auto (fsdp under torchrun): no setting changed, so the steps
    redone after the checkpoint replace their lines instead of moving them aside as another trajectory's."""
    common = [*tiny, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.batch_size=2", f"trainer.run_dir={tmp_path}"]
    killed = run_two_ranks(*common, "trainer.parallel=fsdp", "debug.sigkill_after_step=3")
    assert killed.returncode != 0 and metrics(tmp_path)[-1]["step"] == 3
    resumed = run_two_ranks(*common)
    assert resumed.returncode == 0, resumed.stderr
    output = resumed.stdout + resumed.stderr
    assert "step_00000002 (step 2)" in output and "x2 fsdp" in output and "settings changed" not in output
    assert not list(tmp_path.glob("metrics.replaced-*")) and [line["step"] for line in metrics(tmp_path)] == [1, 2, 3, 4]

def test_ranks_refused_at_start_remove_their_shared_new_run_dir_without_colliding(tmp_path, monkeypatch):
    """Under torchrun every rank of a start refused before the run dir is held (trainer.parallel=none) removes the
    run dir hydra made, the same dir: the rank that finds it gone was second, not failing (it ended with a
    FileNotFoundError traceback after the refusal in about 1 of 3 runs)."""
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    train_entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_entry)
    run_dir = tmp_path / "new" / "run"
    run_dir.mkdir(parents=True)
    monkeypatch.setattr(train_entry, "new_parent_dirs", {tmp_path / "new"})
    real_rmdir = Path.rmdir

    def another_rank_first(path: Path) -> None:
        real_rmdir(path)  # the other rank's
        real_rmdir(path)

    monkeypatch.setattr(Path, "rmdir", another_rank_first)
    train_entry.remove_if_made_here_and_empty(run_dir)
    assert not run_dir.exists()

def test_a_start_refused_under_torchrun_leaves_no_dir_of_a_rank_torchrun_ends(tiny, tmp_path, monkeypatch):
    """A refused start (trainer.batch_size=0) leaves nothing new on disk, as one process's does: the rank refused first
    exits and torchrun ends the other with SIGTERM, which left that rank's timestamped outputs/<date>/<time> behind
    when it came after hydra made it (here rank 0 is held there by a sitecustomize)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == '0':\n"
        "    from coda_train.trainer import loop\n"
        "    real = loop.train\n"
        "    def train(*args, **kwargs):\n"
        "        time.sleep(60)\n"
        "        return real(*args, **kwargs)\n"
        "    loop.train = train\n")
    monkeypatch.setenv("PYTHONPATH", f"{hooks}:{REPO}")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "train.py"), *tiny, "trainer.batch_size=0"], cwd=cwd, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "trainer.batch_size=0 must be >= 1" in result.stdout + result.stderr, result.stderr[-3000:]
    assert "SIGTERM" in result.stderr and list(cwd.iterdir()) == [], (list(cwd.rglob("*")), result.stderr[-3000:])

def test_a_sweep_under_torchrun_is_refused_before_it_hangs(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "-m", "model.impl=eager,coda"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "WORLD_SIZE": "2"})
    assert result.returncode == 1 and "a multirun sweep (-m) cannot run under torchrun" in result.stderr, result.stderr


def test_a_resume_under_torchrun_hashes_the_checkpoint_on_rank_0_alone(tiny, tmp_path, monkeypatch):
    """Every rank read and hashed every file of the checkpoint it resumed (8x the reads on 8 GPUs); rank 0 alone
    verifies it now and hands it to the others. A sitecustomize logs each rank's hashed files."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os\n"
        "from coda_train.trainer import checkpoint\n"
        "real = checkpoint.sha256_file\n"
        "def sha256_file(path):\n"
        f"    with open('{tmp_path}/hashed.' + os.environ['RANK'], 'a') as f:\n"
        "        f.write(str(path) + '\\n')\n"
        "    return real(path)\n"
        "checkpoint.sha256_file = sha256_file\n")
    common = [*tiny, "trainer.ckpt_every=2", "trainer.eval_every=0", "trainer.batch_size=2", "trainer.parallel=fsdp",
              f"trainer.run_dir={tmp_path / 'run'}"]
    assert run_two_ranks(*common, "trainer.max_steps=2").returncode == 0
    monkeypatch.setenv("PYTHONPATH", f"{hooks}:{REPO}")
    resumed = run_two_ranks(*common, "trainer.max_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    step_2 = tmp_path / "run" / "checkpoints" / "step_00000002"
    files = [str(step_2 / name) for name in json.loads((step_2 / "meta.json").read_text())["files"]]
    assert (tmp_path / "hashed.0").read_text().split()[:len(files)] == files  # then step 3's, which rank 0 saves
    assert not (tmp_path / "hashed.1").exists()


def test_reusing_prepared_data_is_said_once_under_torchrun(tiny, tmp_path):
    """Every rank calls prepare(), which logged "reusing prepared data" once per rank; rank 0 alone says it now."""
    result = run_two_ranks(*tiny, "trainer.max_steps=1", "trainer.eval_every=0", "trainer.batch_size=2",
                           f"trainer.run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("reusing prepared data") == 1
