"""The trainer's AdamW (trainer/optim.py) and its one-pass update (kernels/adamw.py) against torch's
AdamW with the gradients clipped first, as the trainer stepped before it had its own pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coda_train.config import OptimConfig
from coda_train.kernels.adamw import adamw_update, adamw_update_reference
from coda_train.model import build_model, preset
from coda_train.trainer.optim import AdamW, build_optimizer, clip_factor

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def _params(device, shapes=((64, 48), (48,), (4097,), (0, 8), (3, 5000)), seed=0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _set_grads(params, step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.device)


def _groups(params):
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]


def _run(device, ours: bool, steps: int = 4, max_norm: float = 1.0, fused: bool = True):
    """Weights and optimizer state after `steps` steps of our AdamW (clip factor in the pass) or of
    torch's (gradients clipped in place first), from the same weights and gradients."""
    params = _params(device)
    kind = {"fused": True} if fused else {"foreach": True}
    if ours:
        opt = AdamW(_groups(params), nn.Module(), **HYPER, **kind)
    else:
        opt = torch.optim.AdamW(_groups(params), **HYPER, **kind)
    norms = []
    for i in range(steps):
        _set_grads(params, i, scale=0.3 if i % 2 else 3.0)  # clipped on even steps, not on odd ones
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm)
        if ours:
            opt.grad_factor = clip_factor(norm, max_norm)
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        opt.step()
    return params, opt


@pytest.mark.parametrize("fused", [True, False], ids=["one-pass", "foreach"])
def test_adamw_with_its_clip_factor_matches_torch_adamw_after_clipping(fused):
    ours_p, ours = _run("cpu", True, fused=fused)
    torch_p, theirs = _run("cpu", False, fused=False)
    for a, b in zip(ours_p, torch_p):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    for p_a, p_b in zip(ours_p, torch_p):
        state_a, state_b = ours.state[p_a], theirs.state[p_b]
        assert state_a.keys() == state_b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state_a["step"]) == float(state_b["step"]) == 4
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state_a[k], state_b[k], rtol=2e-6, atol=1e-9)


def test_a_step_with_found_inf_changes_nothing_and_a_clear_one_steps():
    params = _params("cpu")
    opt = AdamW(_groups(params), nn.Module(), **HYPER, fused=True)
    _set_grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    opt.found_inf = torch.ones(())
    _set_grads(params, 1)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[p][k], v) for p in params for k, v in state[id(p)].items())  # step counts too
    opt.found_inf = torch.zeros(())
    opt.step()
    assert all(float(opt.state[p]["step"]) == 2 for p in params)
    assert not any(torch.equal(p, b) for p, b in zip(params, before) if p.numel())


def test_state_dict_is_torch_adamw_s_both_ways():
    ours_p, ours = _run("cpu", True, steps=2)
    theirs = torch.optim.AdamW(_groups(ours_p), **HYPER, foreach=True)
    theirs.load_state_dict(ours.state_dict())
    again = AdamW(_groups(ours_p), nn.Module(), **HYPER, fused=True)
    again.load_state_dict(theirs.state_dict())
    for p in ours_p:
        for k, v in ours.state[p].items():
            assert torch.equal(again.state[p][k].cpu(), v.cpu()), k


@pytest.mark.parametrize("saved, here", [("foreach", "fused"), ("fused", "foreach")])
def test_a_loaded_state_steps_the_way_this_machine_does(saved, here):
    """A checkpoint's groups carry the saving device's fused/foreach; loaded elsewhere (a CPU run resumed on a
    GPU, or back) the optimizer keeps its own, so the GPU's found_inf never reaches torch's foreach AdamW."""
    params = _params("cpu")
    source = AdamW(_groups(params), nn.Module(), **HYPER, **{saved: True})
    _set_grads(params, 0)
    source.step()
    opt = AdamW(_groups(params), nn.Module(), **HYPER, **{here: True})
    opt.load_state_dict(source.state_dict())
    assert all(bool(g["fused"]) == (here == "fused") and bool(g["foreach"]) == (here == "foreach")
               for g in opt.param_groups)
    if here == "fused":
        opt.found_inf = torch.zeros(())  # as TrainStep sets it for the fused path
    _set_grads(params, 1)
    opt.step()


def test_clip_factor_is_the_factor_clip_grads_with_norm_applies():
    params = _params("cpu")
    _set_grads(params, 0, scale=3.0)
    grads = [p.grad.clone() for p in params]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    factor = clip_factor(norm, 1.0)
    assert all(torch.equal(p.grad, g * factor) for p, g in zip(params, grads))
    assert float(clip_factor(norm * 0 + 0.5, 1.0)) == 1.0 and clip_factor(norm, 0.0) is None


def _copies_after_steps(device: str, kind: str, steps: int = 2) -> tuple[list, dict, dict]:
    """A small CODA model (bf16 copies) after `steps` steps of the trainer's AdamW on `device` ('fused'
    as build_optimizer makes it on CUDA, or 'foreach' as on CPU): the weights, their version counters
    before and after, and the copies as the model holds them (not refreshed)."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", n_layers=2, vocab_size=256, max_seq_len=32), "coda", backend="reference",
                        compute_dtype=torch.bfloat16).to(device)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    opt = build_optimizer(model, OptimConfig(), torch.device("cuda" if kind == "fused" else "cpu"))
    versions = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(tokens, tokens).backward()  # reads (and so makes) the copies
        versions.append({id(p): p._version for p in model.parameters()})
        opt.grad_factor = clip_factor(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), 1.0)
        opt.step()
    versions.append({id(p): p._version for p in model.parameters()})
    return list(model.parameters()), versions, {key: copy for key, (_, _, copy) in model._copies.items()}


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_after_a_step_every_compute_copy_is_its_updated_weight_or_the_forward_refreshes_it(kind):
    """fused (the kernel on CUDA, its reference here): the step itself writes every copy and moves no
    version counter. foreach: it moves them, so the next forward's refresh rewrites the copies."""
    params, versions, copies = _copies_after_steps("cpu", kind)
    assert copies, "the model reads bf16 copies of its matrices"
    by_id = {id(p): p for p in params}
    current = [torch.equal(copy, by_id[key].detach().bfloat16()) for key, copy in copies.items()]
    moved = versions[-2] != versions[-1]
    if kind == "fused":
        assert all(current) and not moved
    else:
        assert moved and not all(current)  # stale until the forward's refresh (version-checked) rewrites them


def test_unsupported_settings_are_refused_and_grad_scale_is_left_to_a_grad_scaler():
    params = _params("cpu")
    for bad in ({"amsgrad": True}, {"maximize": True}):
        with pytest.raises(ValueError, match="supports none of"):
            AdamW(params, nn.Module(), **HYPER, fused=True, **bad)
    opt = AdamW(_groups(params), nn.Module(), **HYPER, fused=True)
    opt.param_groups[1]["maximize"] = True  # edited after construction
    _set_grads(params, 0)
    with pytest.raises(ValueError, match=r"a parameter group sets \['maximize'\]"):
        opt.step()
    assert not AdamW(params, nn.Module(), **HYPER, fused=True)._step_supports_amp_scaling


def test_train_step_refuses_an_optimizer_that_would_skip_the_clip():
    from types import SimpleNamespace

    from coda_train.trainer.step import TrainStep

    state = SimpleNamespace(optimizer=torch.optim.AdamW(_params("cpu")), model=nn.Module())
    with pytest.raises(TypeError, match="needs coda_train's AdamW .* got AdamW"):
        TrainStep(state, state.model, None, torch.device("cpu"), 1, 1.0)


ALIGNED_SHAPES = ((1024, 768), (768,), (0, 8), (3, 5000), (8,))  # every size a multiple of 8: the hinted kernel
RAGGED_SHAPES = ((1024, 768), (4097,), (3, 5001), (1,))  # ragged sizes: those tensors run without hints


def _cuda_lists(seed: int, with_copies: bool, shapes=ALIGNED_SHAPES):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(s, generator=g).cuda() for s in shapes]
    grads = [torch.randn(s, generator=g).cuda() for s in shapes]
    m = [torch.randn(s, generator=g).cuda() * 0.1 for s in shapes]
    v = [torch.rand(s, generator=g).cuda() * 0.01 for s in shapes]
    steps = [torch.full((), 7.0, device="cuda") for _ in shapes]
    # current copies, as the model keeps them
    copies = [t.bfloat16() if with_copies and i % 2 == 0 else None for i, t in enumerate(p)]
    return p, grads, m, v, steps, copies


def _assert_kernel_matches_reference(kernel, reference) -> None:
    """The kernel's p, g, m, v and step counts agree with the reference's to fp32 rounding of each
    tensor's scale (FMA contraction, libdevice pow), and every copy is its weight rounded to bf16."""
    for name, a_list, b_list in zip(("p", "g", "m", "v", "step"), kernel, reference):
        for a, b in zip(a_list, b_list):
            if b.numel():
                assert (a - b).abs().max() <= 1e-6 * b.abs().max(), name
    for p, copy in zip(kernel[0], kernel[5]):
        if copy is not None:
            assert torch.equal(copy, p.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [ALIGNED_SHAPES, RAGGED_SHAPES], ids=["aligned", "ragged"])
@pytest.mark.parametrize("found", [None, 0.0, 1.0])
def test_adamw_update_kernel_matches_its_reference_on_the_gpu(found, shapes):
    kernel, reference = _cuda_lists(0, True, shapes), _cuda_lists(0, True, shapes)
    grads_before = [g.clone() for g in kernel[1]]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 grad_factor=torch.full((), 0.37, device="cuda"),
                 found_inf=None if found is None else torch.full((), found, device="cuda"))
    adamw_update(*kernel, **hyper)
    adamw_update_reference(*reference, **hyper)
    _assert_kernel_matches_reference(kernel, reference)
    assert all(torch.equal(g, b) for g, b in zip(kernel[1], grads_before))  # gradients are read, not written
    if found == 1.0:
        assert all(torch.equal(a, b) for a, b in zip(kernel[0], _cuda_lists(0, True, shapes)[0]))
        assert all(float(s) == 7.0 for s in kernel[4])


def test_launch_rows_keep_the_hints_of_every_aligned_access():
    """Host side, no GPU: a tensor's first multiple of 8 elements runs hinted and its tail apart; a
    gradient at an odd offset (FSDP2's views into its reduce-scatter buffer) narrows only its own
    loads; a weight, moment or copy at an odd offset sends the whole tensor to the unhinted launch."""
    from coda_train.kernels import adamw

    a = 1 << 20  # an aligned base address; each tensor's row is (p, g, m, v, copy, step)
    rows = [(a, a + 64, a + 128, a + 192, a + 256, 8),  # aligned, 16 elements
            (a, a + 68, a + 128, a + 192, 0, 8),  # gradient 4 bytes off, no copy
            (a, a + 72, a + 128, a + 192, a + 256, 8),  # gradient 8 bytes off
            (a, a + 64, a + 128, a + 192, a + 256, 8),  # 4097 elements: 4096 hinted, 1 apart
            (a, a + 64, a + 132, a + 192, a + 256, 8),  # a moment 4 bytes off: all unhinted
            (a, a + 64, a + 128, a + 192, a + 256, 8)]  # empty: no launch
    launches = adamw._launch_rows(rows, [16, 24, 32, 4097, 40, 0])
    assert launches == {
        (True, 16): ([rows[0], rows[3]], [16, 4096]),
        (True, 4): ([rows[1]], [24]),
        (True, 8): ([rows[2]], [32]),
        (False, 4): ([(a + 4 * 4096, a + 64 + 4 * 4096, a + 128 + 4 * 4096, a + 192 + 4 * 4096, a + 256 + 2 * 4096, 8),
                      rows[4]], [1, 40]),
    }
    assert adamw._launch_rows([rows[0]], [7]) == {(False, 4): ([rows[0]], [7])}


def test_address_table_is_copied_once_per_distinct_table():
    """Host side: a step whose tensors sit where the last step's did reuses its device address table
    (no pinned allocation or copy); other addresses get a table of their own, with their contents."""
    from coda_train.kernels import adamw

    rows = ((4096, 8192, 12288, 16384, 0, 64), (20480, 24576, 28672, 32768, 36864, 68))
    table = adamw._address_table(rows, torch.device("cpu"))
    assert table.dtype == torch.int64 and table.tolist() == [list(r) for r in rows]
    assert adamw._address_table(tuple(tuple(r) for r in rows), torch.device("cpu")) is table
    moved = (rows[0], (20480, 24640, 28672, 32768, 36864, 68))
    assert adamw._address_table(moved, torch.device("cpu")).tolist() == [list(r) for r in moved]


@pytest.mark.gpu
def test_gradients_at_odd_offsets_and_ragged_tails_update_as_the_reference(monkeypatch):
    """On the GPU: gradients 4 and 8 bytes off an aligned address and a ragged tensor run in their
    own launches (one per alignment class) and update exactly as the reference does."""
    from coda_train.kernels import adamw

    shapes = ((1024, 768), (768,), (3, 5000), (4097,))
    kernel, reference = _cuda_lists(0, True, shapes), _cuda_lists(0, True, shapes)
    for lists in (kernel, reference):  # gradients 1 and 2 become views 4 and 8 bytes past an aligned address
        for i, off in ((1, 1), (2, 2)):
            g = lists[1][i]
            lists[1][i] = torch.empty(g.numel() + off, device="cuda")[off:].view(g.shape).copy_(g)
    launches = []
    real = adamw._kernel()

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["ALIGNED"], kwargs["GRAD_ALIGN"], grid[0]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(adamw, "_kernel", lambda: Recording())
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 grad_factor=torch.full((), 0.37, device="cuda"))
    adamw_update(*kernel, **hyper)
    adamw_update_reference(*reference, **hyper)
    programs = lambda *numels: sum(-(-n // adamw.BLOCK) for n in numels)  # noqa: E731
    assert sorted(launches) == sorted([(True, 16, programs(1024 * 768, 4096)), (True, 4, programs(768)),
                                       (True, 8, programs(15000)), (False, 4, 1)])
    _assert_kernel_matches_reference(kernel, reference)


@pytest.mark.gpu
def test_trainer_adamw_on_the_gpu_writes_the_model_s_copies_and_moves_no_version():
    params, versions, copies = _copies_after_steps("cuda", "fused")
    by_id = {id(p): p for p in params}
    assert copies and all(torch.equal(c, by_id[k].detach().bfloat16()) for k, c in copies.items())
    assert versions[-2] == versions[-1]


@pytest.mark.gpu
def test_trainer_adamw_on_the_gpu_matches_torch_fused_adamw_after_clipping():
    ours_p, ours = _run("cuda", True, steps=5)
    torch_p, _ = _run("cuda", False, steps=5)
    for a, b in zip(ours_p, torch_p):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_adamw_kernel_compiles_for_sm90_with_16_byte_accesses():
    """GPU-blind: the kernel compiles for Hopper, and with its alignment hints every parameter,
    gradient and moment access is 128 bits wide (without them Triton, which cannot see the alignment
    of addresses read from memory, emits 32-bit accesses: half the speed on the H200, docs/kernels.md)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from coda_train.kernels import adamw

    signature = {name: kind for name, kind in zip(
        ("addresses", "numels", "block_tensor", "block_start", "grad_factor_ptr", "found_inf_ptr"),
        ("*i64", "*i64", "*i32", "*i64", "*fp32", "*fp32"))}
    signature.update({name: "fp32" for name in ("lr", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps",
                                                "lr_weight_decay")})
    constants = {"HAS_FACTOR": True, "HAS_FOUND_INF": True, "BLOCK": adamw.BLOCK, "CHUNKS": adamw.CHUNKS}
    signature.update({name: "constexpr" for name in (*constants, "ALIGNED", "GRAD_ALIGN")})
    ptx = {}
    for aligned, grad_align in ((True, 16), (True, 8), (False, 4)):
        source = triton.compiler.ASTSource(fn=adamw._kernel(), signature=signature,
                                           constexprs={**constants, "ALIGNED": aligned, "GRAD_ALIGN": grad_align})
        ptx[grad_align] = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                         options={"num_warps": adamw.NUM_WARPS,
                                                  "enable_fp_fusion": adamw.TRITON_FP_FUSION}).asm["ptx"]
    per_thread = adamw.BLOCK * adamw.CHUNKS // (32 * adamw.NUM_WARPS)  # elements of each tensor a thread updates
    assert ptx[16].count("ld.global.v4") == 4 * per_thread // 4  # p, g, m, v: 4 fp32 an access
    assert ptx[16].count("st.global.v4") == 3 * per_thread // 4 + per_thread // 8  # p, m, v; the bf16 copy 8 an access
    # a gradient 8 bytes off an aligned address: its loads are 64-bit, every other access as above
    assert ptx[8].count("ld.global.v4") == 3 * per_thread // 4
    assert ptx[8].count("ld.global.v2") == per_thread // 2
    assert ptx[8].count("st.global.v4") == ptx[16].count("st.global.v4")
    assert ptx[4].count("ld.global.v4") == 0


def test_one_pass_adamw_steps_fsdp2_shards_as_it_steps_plain_weights(tmp_path):
    """Under FSDP2 the parameters, gradients and moments are DTensors: the pass updates each rank's
    shards (one process here, gloo on CPU) exactly as it updates the whole tensors."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
        sharded = copy.deepcopy(plain)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        x = torch.randn(4, 16)
        optimizers = [AdamW(m.parameters(), nn.Module(), **HYPER, fused=True) for m in (plain, sharded)]
        for _ in range(3):
            for model, opt in zip((plain, sharded), optimizers):
                opt.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
                opt.grad_factor = torch.full((), 0.5)
                opt.step()
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        for a, b in zip(plain.parameters(), sharded.parameters()):
            assert torch.equal(a.detach(), b.detach().full_tensor())
    finally:
        dist.destroy_process_group()
