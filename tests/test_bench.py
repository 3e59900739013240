"""scripts/bench.py's harness on CPU (--shape smoke: the tiny preset, host clock, reference ops):
every model variant and the floor run and land in the JSON with their derived figures. Timings
on CPU mean nothing; the GPU numbers come from the same code on the H200."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke_runs_every_cpu_variant(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--shape", "smoke", "--variants", "eager,coda,floor",
                           "--iters", "2", "--warmup", "1", "--logits-chunk-mib", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's coda_train
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "bench_smoke.json").read_text())
    assert set(result["variants"]) == {"eager", "coda", "floor"}
    assert result["logits_chunk_mib"] == 1  # CODA's LM head in chunks of at most 1 MiB of logits here
    assert result["failed"] == {}
    coda, floor = result["variants"]["coda"], result["variants"]["floor"]
    eager, ms = result["variants"]["eager"], lambda v: v["fwd_bwd"]["median_ms"]
    assert eager["over_coda"] == ms(eager) / ms(coda) and coda["over_floor"] == ms(coda) / ms(floor)
    assert coda["fwd_bwd"]["n"] == 2 and coda["step"]["median_ms"] > 0 and coda["tokens_per_s"] > 0
    # the floor: 12 GEMMs per layer x 2 layers + the LM head's 3, and attention per layer
    assert sum(g["count"] for g in floor["gemms"]) == 12 * 2 + 3
    assert floor["fwd_bwd"]["median_ms"] == floor["gemm_ms"] + floor["attention_ms"]
    code = result["environment"]["code"]  # which code ran
    assert len(code["sources_sha256"]) == 16 and (code["git_commit"] is None or len(code["git_commit"]) == 40)
    # the same kernels back to back as a step, and coda's ratio to that
    assert floor["back_to_back"]["n"] >= 1 and floor["back_to_back"]["median_ms"] > 0
    assert "back_to_back_autotuned" not in floor  # only with --floor-quack-tuned
    # and again with the weight gradients written in fp32, as CODA writes them
    fp32 = floor["back_to_back_fp32_wgrads"]
    assert fp32["wgrads"] == sorted(f"{p} wgrad" for p in ("qkv", "o", "gate_up", "down", "lm_head"))
    assert fp32["n"] >= 1 and coda["over_floor_fp32_wgrads"] == coda["fwd_bwd"]["median_ms"] / fp32["median_ms"]
    assert "weight gradients written in fp32" in proc.stdout
    assert coda["over_floor_back_to_back"] == coda["fwd_bwd"]["median_ms"] / floor["back_to_back"]["median_ms"]
    # the target ratio again in pairs: coda and the floor back to back timed in turn, three rounds by default
    paired = result["paired"]
    assert paired["variant"] == "coda" and [r["first"] for r in paired["rounds"]] == ["coda", "floor", "coda"]
    assert all(r["ratio"] == r["coda_ms"] / r["floor_ms"] and r["coda_ms"] > 0 for r in paired["rounds"])
    assert paired["median_ratio"] == sorted(r["ratio"] for r in paired["rounds"])[1]
    assert "paired, timed in turn (3 rounds): coda / floor back to back" in proc.stdout
    assert "compile-max-autotune" in result["not_run"] and "coda_profile" not in result  # profile: GPU only
    assert "pending" not in result  # the run finished: nothing left that it did not reach
    assert result["sustain_s"] == 0.0  # nothing sustained on CPU (the GPU default: bench.SUSTAIN_S)
    assert "smoke" in proc.stdout and "floor" in proc.stdout
    # no MFU against a CPU's GEMM rate: None in the JSON, "-" in the table, and no bf16 peak in the header
    assert all(r["mfu_fwd_bwd"] is None and r.get("mfu_step") is None for r in result["variants"].values())
    assert "GEMM peak" not in proc.stdout and proc.stdout.startswith("smoke: "), proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("coda "))
    assert "%" not in row, row


def test_bench_on_cpu_leaves_out_the_cuda_only_variants_and_refuses_them_when_asked(monkeypatch, capsys):
    """Without CUDA the default variants skip liger and coda-graphs (saying so) instead of each failing
    with a traceback; naming one is a usage error (exit 2) that says why, before any work."""
    if torch.cuda.is_available():
        pytest.skip("the CPU behaviour")
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    class Ran(Exception):
        pass

    def run(shape, variants, *args):
        raise Ran(variants)

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--shape", "smoke"])
    with pytest.raises(Ran) as ran:
        bench.main()
    assert ran.value.args[0] == [v for v in bench.DEFAULT_VARIANTS.split(",") if v not in ("liger", "coda-graphs")]
    assert "leaving out liger, coda-graphs" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--shape", "smoke", "--variants", "eager,coda-graphs,liger"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "coda-graphs: CUDA graphs need a CUDA device" in proc.stderr and "liger: Liger's Triton" in proc.stderr, proc.stderr


def test_bench_saves_what_it_measured_after_each_variant():
    """A run cut short by a device call's time limit keeps the variants it finished: run() hands the
    result so far to `save` after each one, with the variants it has not reached as `pending`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    saved = []
    result = bench.run("smoke", ["eager", "floor"], iters=1, warmup=0, profile_steps=0,
                       save=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    assert [sorted(s["variants"]) for s in saved] == [["eager"], ["eager", "floor"]]
    assert [s["pending"] for s in saved] == [["floor"], []]
    assert saved[0]["variants"]["eager"]["fwd_bwd"]["median_ms"] > 0 and "mfu_fwd_bwd" in saved[0]["variants"]["eager"]
    assert "pending" not in result and sorted(result["variants"]) == ["eager", "floor"]


def test_the_paired_variant_is_built_once_when_only_the_floor_runs_after_it(monkeypatch):
    """The pairs time the CODA variant bench_model just timed, not a second build of it (~15 s of a device call at
    1B), where only the floor ran in between; after another model variant it is built again for them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    built = []
    prepare = bench.prepare_variant
    monkeypatch.setattr(bench, "prepare_variant", lambda variant, *a: built.append(variant) or prepare(variant, *a))
    result = bench.run("smoke", ["coda", "floor"], iters=1, warmup=0, profile_steps=0, paired_rounds=1)
    assert built == ["coda"] and result["paired"]["variant"] == "coda" and result["failed"] == {}
    built.clear()
    result = bench.run("smoke", ["coda", "eager", "floor"], iters=1, warmup=0, profile_steps=0, paired_rounds=1)
    assert built == ["coda", "eager", "coda"] and len(result["paired"]["rounds"]) == 1


def test_floor_gemms_take_the_fastest_backend_that_runs():
    """The floor times each GEMM on cuBLAS and quack (default config; with quack_tuned, its autotuner's
    pick too) and keeps the fastest that ran; on CPU quack cannot run, so cuBLAS (torch.matmul) is
    every GEMM's floor, with quack's errors recorded."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    shape = bench.SHAPES["smoke"]
    floor = bench._floor_per_kernel(bench.model_config(shape), shape, quack_tuned=True)
    for g in floor["gemms"]:
        assert g["best"] == "cublas" and g["best_ms"] == g["cublas_ms"] > 0, g
        assert "quack_error" in g and "quack_tuned_error" in g and "quack_ms" not in g
    assert abs(floor["gemm_ms"] - sum(g["count"] * g["best_ms"] for g in floor["gemms"])) < 1e-9


def _floor_with_scripted_timings(monkeypatch, do_bench):
    """bench with the floor's GEMMs on cuBLAS and quack as no-op callables named by their backend, each timed by
    `do_bench(fn)` (fn.backend says which), and attention at 0.5 ms: _floor_per_kernel's picking alone."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    def floor_gemm(backend, a, b, out_dtype=None):
        fn = lambda: None
        fn.backend = backend
        return fn

    monkeypatch.setattr(bench, "floor_backends", lambda quack_tuned: ("cublas", "quack"))
    monkeypatch.setattr(bench, "floor_gemm", floor_gemm)
    monkeypatch.setattr(bench, "do_bench", do_bench)
    monkeypatch.setattr(bench, "attention_calls", lambda cfg, shape: (lambda: None, lambda: None))
    monkeypatch.setattr(bench, "do_bench_graph", lambda fn: 0.5)
    return bench


def test_floor_picks_each_gemms_backend_by_the_median_of_timings_taken_in_turn(monkeypatch):
    """One timing each let a clock dip decide the floor's backend (cuBLAS's 1.74 ms against quack's 1.71 on the H100 of
    2026-12-06, cuBLAS 1.50 on the next machine): each backend is timed FLOOR_PICK_ROUNDS times, the order reversed in
    every other round, and its median decides."""
    scripted = {"cublas": [5.0, 1.0, 1.1], "quack": [1.2, 1.2, 1.2]}  # cuBLAS's first timing caught a clock dip
    order = []

    def do_bench(fn):
        order.append(fn.backend)
        return scripted[fn.backend][(sum(b == fn.backend for b in order) - 1) % 3]  # the same rounds for every GEMM

    bench = _floor_with_scripted_timings(monkeypatch, do_bench)
    shape = bench.SHAPES["smoke"]
    floor = bench._floor_per_kernel(bench.model_config(shape), shape)
    assert bench.FLOOR_PICK_ROUNDS == 3 and order[:6] == ["cublas", "quack", "quack", "cublas", "cublas", "quack"]
    for g in floor["gemms"]:
        assert g["best"] == "cublas" and g["best_ms"] == g["cublas_ms"] == 1.1, g
        assert g["cublas_rounds_ms"] == [5.0, 1.0, 1.1] and g["quack_ms"] == 1.2, g


def test_a_floor_backend_whose_replay_fails_is_recorded_and_left_out(monkeypatch):
    """A quack GEMM that captures but fails when timed leaves its error in the row and the GEMM on the
    backends that ran, as a failed capture does; cuBLAS failing still ends the floor."""
    def do_bench(fn):
        if fn.backend == failing:
            raise RuntimeError("replay failed")
        return 1.0

    bench = _floor_with_scripted_timings(monkeypatch, do_bench)
    shape = bench.SHAPES["smoke"]
    failing = "quack"
    floor = bench._floor_per_kernel(bench.model_config(shape), shape)
    for g in floor["gemms"]:
        assert g["best"] == "cublas" and g["quack_error"] == "RuntimeError: replay failed" and "quack_ms" not in g, g
    failing = "cublas"
    with pytest.raises(RuntimeError, match="replay failed"):
        bench._floor_per_kernel(bench.model_config(shape), shape)


def test_tuned_floor_times_its_sequence_again_with_quack_at_the_autotuned_pick(monkeypatch):
    """With quack_tuned, the back-to-back floor runs a second time with each GEMM the per-kernel floor put on quack's
    default config at quack's autotuned pick instead (the autotuner picks by back-to-back calls, the per-kernel floor
    times each call alone); cuBLAS's GEMMs stay. Here quack's default wins the forward GEMMs, cuBLAS the rest."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    shape = bench.SHAPES["smoke"]
    cfg = bench.model_config(shape)
    names = {tuple(dims[:4]): name for name, *dims in bench.step_gemms(cfg, shape.batch * shape.seq)}
    made = []  # (GEMM name, backend) of every floor_gemm, in order

    def floor_gemm(backend, a, b, out_dtype=None):  # every backend runs on CPU here; the timing below decides which wins
        gemm = functools.partial(torch.matmul, a, b)
        gemm.made = (names[made_for[0]], backend)
        made.append(gemm.made + (out_dtype,))
        return gemm

    made_for = [None]
    real_operands = bench.gemm_operands

    def gemm_operands(m, n, k, layout):
        made_for[0] = (m, n, k, layout)
        return real_operands(m, n, k, layout)

    def do_bench_graph(fn):
        name, backend = getattr(fn, "made", ("attention", "cublas"))
        return 1.0 if backend == "quack" and name.endswith("fwd") else 2.0 if backend == "cublas" else 3.0

    monkeypatch.setattr(bench, "floor_gemm", floor_gemm)
    monkeypatch.setattr(bench, "gemm_operands", gemm_operands)
    monkeypatch.setattr(bench, "do_bench_graph", do_bench_graph)
    monkeypatch.setattr(bench, "do_bench", do_bench_graph)  # the per-kernel floor's rounds time the replayable fn
    floor = bench.bench_floor(cfg, shape, iters=1, warmup=0, sustain_s=0.0, quack_tuned=True)
    on_quack = sorted(g["gemm"] for g in floor["gemms"] if g["best"] == "quack")
    assert on_quack == sorted(name for name in names.values() if name.endswith("fwd"))
    assert all(g["best"] == "cublas" for g in floor["gemms"] if g["gemm"] not in on_quack)
    alt = floor["back_to_back_autotuned"]
    assert alt["gemms_autotuned"] == on_quack and alt["median_ms"] > 0 and alt["n"] == 1
    # the three sequences built last: the per-kernel winners, the same with fp32 weight gradients, then the first
    # with quack's default at its autotuned pick
    n = len(names)
    first, fp32, last = made[-3 * n:-2 * n], made[-2 * n:-n], made[-n:]
    assert {name: backend for name, backend, _ in first} == {g["gemm"]: g["best"] for g in floor["gemms"]}
    assert [(name, backend) for name, backend, _ in fp32] == [(name, backend) for name, backend, _ in first]
    assert {name: dtype for name, _, dtype in fp32} == {name: torch.float32 if name.endswith("wgrad") else None
                                                         for name in names.values()}
    assert {name: backend for name, backend, _ in last} == {name: "quack-tuned" if backend == "quack" else backend
                                                            for name, backend, _ in first}
    assert all(dtype is None for *_, dtype in first + last)


def test_gpu_clocks_keep_the_timed_steps_samples_only():
    """GpuClocks.mark() at the end of the sustained steps: the result is the timed steps' samples (the last one where
    the window is shorter than nvidia-smi's 100 ms period); lines it cannot read are skipped, and a timestamp in
    another format drops no sample."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from datetime import datetime

    import bench

    out = ("2026/12/05 20:00:00.000, 1980, 300, 50, 0x0\n2026/12/05 20:00:00.100, 1500, 650, 60, 0x4\n"
           "2026/12/05 20:00:00.200, 1400, 700, 61, 0x4\n2026/12/05 20:00:00.300, [N/A], 700, 61, 0x4\n2026/12/0")
    whole = bench.GpuClocks.summarize(out, with_reasons=True)
    assert whole["samples"] == 3 and whole["sm_mhz_max"] == 1980 and abs(whole["clock_reasons"]["sw_power_cap"] - 2 / 3) < 1e-9
    timed = bench.GpuClocks.summarize(out, True, since=datetime(2026, 12, 5, 20, 0, 0, 50000))
    assert timed["samples"] == 2 and timed["sm_mhz_mean"] == 1450 and timed["clock_reasons"]["sw_power_cap"] == 1.0
    late = bench.GpuClocks.summarize(out, True, since=datetime(2026, 12, 5, 20, 0, 1))
    assert late["samples"] == 1 and late["sm_mhz_mean"] == 1400
    other_format = out.replace("2026/12/05 ", "Sat Dec  5 ")
    assert bench.GpuClocks.summarize(other_format, True, since=datetime(2026, 12, 5, 20, 0, 1))["samples"] == 3
    assert bench.GpuClocks.summarize("", False) is None


def test_kernel_sequence_lists_the_last_steps_kernels_with_the_gaps_before_them():
    """bench.py's kernel_sequence (the graphed step's kernels in order): the last of `steps` steps,
    each kernel's time and the idle gap before it, overlapping kernels giving a negative gap."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench

    def kernel(name, start, end):
        return NS(name=name, device_type=DeviceType.CUDA, is_user_annotation=False,
                  time_range=NS(start=start, end=end))

    events = [kernel("gemm", 0, 10), kernel("rstd", 12, 13), kernel("flash", 13, 18),  # step 1
              kernel("gemm", 20, 30), kernel("rstd", 34, 35), kernel("flash", 34.5, 40),  # step 2 (PDL overlap)
              NS(name="coda::gemm", device_type=DeviceType.CUDA, is_user_annotation=True, time_range=NS(start=0, end=1)),
              NS(name="cudaLaunchKernel", device_type=DeviceType.CPU, time_range=NS(start=0, end=1))]
    prof = NS(events=lambda: events)
    seq = bench.kernel_sequence(prof, 2)
    assert [(k["kernel"], k["us"], k["gap_us"]) for k in seq] == [
        ("gemm", 10, None), ("rstd", 1, 4), ("flash", 5.5, -0.5)], seq


def test_floor_items_are_dealt_the_replayed_kernels_in_step_order():
    """bench.py's items_from_sequence: a replayed floor step's kernels go to its items in order, each
    call taking as many as it launches eagerly; counts that do not fit the sequence give None."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench

    names = ["qkv fwd", "attention bwd", "qkv fwd", "attention bwd"]
    launches = {"qkv fwd": 2.0, "attention bwd": 6.0}  # per step: 1 kernel a GEMM call, 3 an attention backward
    seq = [{"kernel": k, "us": us} for k, us in
           [("gemm", 10), ("pre", 1), ("bwd", 30), ("post", 2), ("gemm", 11), ("pre", 1), ("bwd", 32), ("post", 2)]]
    items = bench.items_from_sequence(seq, names, launches)
    assert list(items) == ["attention bwd", "qkv fwd"]  # largest first
    assert abs(items["attention bwd"] - 0.068) < 1e-12 and abs(items["qkv fwd"] - 0.021) < 1e-12
    assert bench.items_from_sequence(seq[:-1], names, launches) is None  # one kernel short
    assert bench.items_from_sequence(seq, names, {"qkv fwd": 3.0, "attention bwd": 6.0}) is None  # 1.5 a call


def test_graph_kernels_take_the_op_of_the_eager_kernel_they_align_with():
    """bench.py's graph_by_owner: the CUDA-graph step's kernels, in launch order, take the ops of the annotated eager
    step's kernels where the names align; a kernel only the graph has (capture-only work) goes to its kernel class."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench

    owners = [("gemm_a", "gemm_rowscale_rope"), ("flash_fwd", "attention"), ("gemm_b", "gemm_residual_rmsnorm_partial"),
              ("rstd", "rstd_from_partials"), ("gemm_a", "matmul_tn")]
    seq = [{"kernel": k, "us": us} for k, us in
           [("gemm_a", 100), ("flash_fwd", 50), ("gemm_b", 40), ("elementwise_fill", 3), ("rstd", 2), ("gemm_a", 90)]]
    got = bench.graph_by_owner(seq, owners)
    assert got["kernels_matched"] == 5 and got["kernels"] == 6
    assert got["by_owner_ms"] == {"gemm_rowscale_rope": 0.1, "matmul_tn": 0.09, "attention": 0.05,
                                  "gemm_residual_rmsnorm_partial": 0.04, "[elementwise]": 0.003,
                                  "rstd_from_partials": 0.002}
    assert list(got["by_owner_ms"])[0] == "gemm_rowscale_rope"  # largest first


def test_the_fa4_peer_is_the_eager_model_with_another_attention_kernel():
    """scripts/fa4_peer.py (the compile peers with FlashAttention 4): its custom ops pass torch's op checks (schema,
    fake tensors for torch.compile, autograd), and the model it builds computes the eager model's loss and
    gradients (on CPU the ops' plain-torch path, float64)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    from coda_train.model import LlamaConfig, build_model
    from fa4_peer import EagerFA4Llama, fa4_causal

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    torch.library.opcheck(fa4_causal, (q, k, v))
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=50, max_seq_len=16)
    torch.manual_seed(0)
    eager = build_model(cfg, "eager", compute_dtype=torch.float64).double()
    peer = EagerFA4Llama(cfg, compute_dtype=torch.float64).double()
    peer.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 50, (2, 16), generator=g)
    losses = [m(tokens, tokens.roll(-1, 1)) for m in (eager, peer)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=1e-12)
    for (name, a), b in zip(eager.named_parameters(), peer.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12), name


def test_the_floor_tries_a_2x2_cluster_where_the_coda_table_runs_one(monkeypatch):
    """Where CODA's tile table runs a 2x2 cluster on this GPU, the floor's GEMMs get quack at a 2x2 cluster as a
    candidate too (quack's autotuner tries 2x1 and 1x2 only): on CPU it cannot run, so its error is recorded and
    cuBLAS stays every GEMM's floor."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    assert bench.floor_backends(quack_tuned=False) == ("cublas", "quack")  # CPU: no table of this GPU
    monkeypatch.setattr(bench, "_table_runs_2x2", lambda: True)
    assert bench.floor_backends(quack_tuned=True) == ("cublas", "quack", "quack-tuned", "quack-2x2")
    shape = bench.SHAPES["smoke"]
    floor = bench._floor_per_kernel(bench.model_config(shape), shape)
    assert floor["backends"] == ["cublas", "quack", "quack-2x2"]
    for g in floor["gemms"]:
        assert g["best"] == "cublas" and "quack_2x2_error" in g and "quack_2x2_ms" not in g, g
