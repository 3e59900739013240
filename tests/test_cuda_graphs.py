"""trainer.cuda_graphs and the step that does not wait for the GPU.

On CPU: the setting resolves (auto -> off, on -> a ConfigError naming the fix), and the deferred
non-finite check runs with fused AdamW, which torch also has on CPU and which reads found_inf as
on CUDA: steps run ahead without reading the device, a non-finite one and every later one change
no weight and no optimizer state, and the next read raises naming the first bad step. On the GPU
(marked gpu): a captured step gives bit-identical losses, gradients and weights to the eager step,
and train.py with cuda_graphs=on follows the same curve as off."""

from __future__ import annotations

import types

import pytest
import torch

from coda_train.data import prepare
from coda_train.errors import ConfigError
from coda_train.trainer import build as build_module
from coda_train.trainer.build import build_loader, build_train_state, resolve_model
from coda_train.trainer.checkpoint import list_checkpoints
from coda_train.trainer.distributed import World
from coda_train.trainer.graphs import use_cuda_graphs
from coda_train.trainer.optim import build_optimizer
from coda_train.trainer.step import NonFiniteError, TrainStep

from test_trainer import compose_config, metrics, optimizer_tensors, run_train, train_in_process

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cuda_graphs_setting_resolves_per_run():
    assert use_cuda_graphs("auto", "coda", CUDA, "none")
    for impl, device, parallel in (("coda", CPU, "none"), ("coda", CUDA, "ddp"), ("coda", CUDA, "fsdp"),
                                   ("eager", CUDA, "none")):
        assert not use_cuda_graphs("auto", impl, device, parallel)
    assert use_cuda_graphs("on", "eager", CUDA, "none") and not use_cuda_graphs("off", "coda", CUDA, "none")
    for impl, device, parallel, why in (("coda", CPU, "none", "a CUDA device"), ("liger", CUDA, "none", "model.impl in"),
                                        ("coda", CUDA, "fsdp", "one process without DDP/FSDP")):
        with pytest.raises(ConfigError, match=f"trainer.cuda_graphs=on needs {why}.*use trainer.cuda_graphs=auto or off"):
            use_cuda_graphs("on", impl, device, parallel)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_graphs_on_without_a_gpu_stops_before_anything_runs(tiny, tmp_path):
    with pytest.raises(ConfigError, match="trainer.cuda_graphs=on needs a CUDA device"):
        train_in_process(tmp_path, *tiny, "trainer.cuda_graphs=on", "trainer.max_steps=2")
    with pytest.raises(ConfigError, match=r"trainer.cuda_graphs='yes' is not one of \['auto', 'on', 'off'\]"):
        train_in_process(tmp_path, *tiny, "trainer.cuda_graphs=yes", "trainer.max_steps=2")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert train_in_process(tmp_path, *tiny, "trainer.max_steps=2").metrics["step"] == 2  # auto: off on CPU


@pytest.fixture
def fused_adamw(monkeypatch):
    """Runs build fused AdamW on CPU too: the optimizer that reads found_inf, as on CUDA (build_optimizer
    chooses fused by the device type alone)."""
    as_on_cuda = types.SimpleNamespace(type="cuda")
    monkeypatch.setattr(build_module, "build_optimizer", lambda model, cfg, device: build_optimizer(model, cfg, as_on_cuda))


def test_fused_steps_run_ahead_and_a_non_finite_one_is_never_applied(tiny, tmp_path, fused_adamw):
    cfg = compose_config(tmp_path, *tiny, "trainer.grad_accum_steps=2")
    world = World()
    data = prepare(cfg.data)
    llama = resolve_model(cfg, data.vocab_size, "reference")

    def fresh() -> TrainStep:
        state = build_train_state(cfg, llama, build_loader(data, "train", cfg.trainer, world), "reference", CPU, torch.float32, world)
        assert state.optimizer.defaults["fused"]
        return TrainStep(state, state.model, world, CPU, 2, cfg.optim.grad_clip)

    every_step = fresh()
    read_each = [every_step.read(every_step()) for _ in range(4)]
    read_late = fresh()
    pending = [read_late() for _ in range(4)]
    assert [read_late.read(p) for p in pending] == read_each  # reading later changes no value

    state = read_late.state
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    moments = optimizer_tensors(state.optimizer)
    pending = [read_late(poison_loss=i == 0) for i in range(3)]  # steps 5 (NaN), 6, 7: nothing reads the device
    assert state.step == 7 and state.scheduler.last_epoch == 7  # the host counters ran ahead
    assert all(torch.equal(state.model.state_dict()[k], v) for k, v in weights.items())
    now = optimizer_tensors(state.optimizer)
    assert now.keys() == moments.keys() and all(torch.equal(now[k], v) for k, v in moments.items())  # step counts too
    with pytest.raises(NonFiniteError, match=r"step 5: loss=nan grad_norm=nan is not finite") as error:
        read_late.read(pending[-1])
    assert error.value.step == 5
    with pytest.raises(NonFiniteError, match="step 5: "):
        read_late.check()


def test_a_deferred_non_finite_step_stops_the_loop_at_the_next_read_and_saves_nothing(tiny, tmp_path, fused_adamw):
    with pytest.raises(NonFiniteError, match=r"step 8: loss=nan .* not finite; stopped without applying or saving "
                                             r"steps 8\.\.10\. Resume from the newest checkpoint, .*step_00000005, "):
        train_in_process(tmp_path, *tiny, "trainer.max_steps=20", "trainer.ckpt_every=5", "trainer.log_every=5",
                         "trainer.eval_every=0", "debug.nan_loss_at_step=8")
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000005"]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 5]


# ---- on the GPU ------------------------------------------------------------------------------

class Batches:
    """A train loader that hands out given batches (TrainState only calls next_batch)."""

    def __init__(self, batches):
        self.batches = iter(batches)

    def next_batch(self):
        return next(self.batches)


def _unique_token_batches(vocab_size: int, n: int, batch: int, seq_len: int) -> list:
    """Batches whose input tokens are distinct within each batch: the embedding gradient's scatter-add
    then adds at most one row per token (no atomic-order rounding), and with seq_len 128 FlashAttention's
    backward accumulates at most two partial sums per element (addition of two is order-free)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randperm(vocab_size, generator=gen)[:batch * seq_len].view(batch, seq_len),
             torch.randint(0, vocab_size, (batch, seq_len), generator=gen)) for _ in range(n)]


def _three_steps(impl: str, cuda_graphs: bool, batches: list):
    """Losses/grad norms, the gradients each optimizer step read (unclipped: its clip factor applies as it
    reads them), and the final weights of 3 optimizer steps of 2 micro-batches each."""
    from coda_train.config import OptimConfig
    from coda_train.model import build_model, preset
    from coda_train.trainer.optim import build_scheduler
    from coda_train.trainer.state import TrainState

    torch.manual_seed(0)
    model = build_model(preset("tiny", n_layers=2, vocab_size=1024, max_seq_len=128), impl, backend="auto",
                        compute_dtype=torch.bfloat16).to(CUDA)
    optim = OptimConfig(warmup_steps=0)
    optimizer = build_optimizer(model, optim, CUDA)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in model.parameters()]))
    state = TrainState(model, optimizer, build_scheduler(optimizer, optim, 3), Batches(batches))
    train_step = TrainStep(state, model, World(), CUDA, 2, optim.grad_clip, cuda_graphs)
    results = [train_step.read(train_step()) for _ in range(3)]
    return results, grads, [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    (results_a, grads_a, weights_a), (results_b, grads_b, weights_b) = a, b
    return (results_a == results_b and all(torch.equal(x, y) for ga, gb in zip(grads_a, grads_b) for x, y in zip(ga, gb))
            and all(torch.equal(x, y) for x, y in zip(weights_a, weights_b)))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["coda", "eager"])
def test_captured_step_is_bit_identical_to_the_eager_step(impl):
    batches = _unique_token_batches(1024, 6, 2, 128)
    eager = _three_steps(impl, False, batches)
    assert _same(eager, _three_steps(impl, False, batches)), "the eager step itself is not reproducible at this shape"
    graphed = _three_steps(impl, True, batches)
    assert graphed[0] == eager[0], (graphed[0], eager[0])
    assert _same(graphed, eager)


GPU_MODEL = ["model.dim=256", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=512", "trainer.batch_size=2",
             "trainer.seq_len=128", "kernels.backend=auto"]


@pytest.mark.gpu
def test_train_loop_with_cuda_graphs_follows_the_eager_loop(tiny, tmp_path):
    runs = {}
    for setting in ("off", "on", "auto"):
        run_dir = tmp_path / setting
        result = run_train(*tiny, *GPU_MODEL, "trainer.max_steps=12", "trainer.grad_accum_steps=2",
                           f"trainer.cuda_graphs={setting}", f"trainer.run_dir={run_dir}", timeout=600)
        assert result.returncode == 0, result.stderr
        assert (" cuda-graphs |" in result.stderr + result.stdout) == (setting != "off")
        runs[setting] = metrics(run_dir)
    off, on = runs["off"], runs["on"]
    assert [m["step"] for m in on] == list(range(1, 13)) and on[0]["loss"] == off[0]["loss"]  # same weights, same batch
    # later steps: the real batches repeat tokens, whose embedding scatter-add rounds in atomic order
    for a, b in zip(on, off, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a.get("val_loss", 0) == pytest.approx(b.get("val_loss", 0), rel=1e-3)
    assert on[-1]["loss"] < on[0]["loss"] - 0.5
    assert [m["loss"] for m in runs["auto"]][0] == on[0]["loss"]


@pytest.mark.gpu
def test_a_non_finite_step_under_cuda_graphs_is_caught_at_the_next_read(tiny, tmp_path):
    result = run_train(*tiny, *GPU_MODEL, "trainer.cuda_graphs=on", "trainer.max_steps=12", "trainer.ckpt_every=4",
                       "trainer.log_every=3", "trainer.eval_every=0", "debug.nan_loss_at_step=5",
                       f"trainer.run_dir={tmp_path}", timeout=600)
    output = result.stderr + result.stdout
    assert result.returncode == 3, output
    assert "step 5: loss=nan" in output and "steps 5..6" in output
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004"]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 3]
