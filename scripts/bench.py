"""The benchmark the speed work is judged by: every peer at its best, CODA, and the floor, side by
side in one process on the same weights and batch, on one GPU.

    python scripts/bench.py --shape 1b-4x4096 --out runs/bench            # one shape per device call
    python scripts/bench.py --shape 125m --variants eager,coda --iters 5   # a subset
    python scripts/bench_report.py runs/bench/*.json                       # docs/benchmarks.md + PNG

Variants (bf16 compute, fp32 master weights, fused AdamW):
  eager                 our eager PyTorch model (coda_train/model/eager.py)
  compile               eager under torch.compile (default mode)
  compile-graphs        torch.compile mode="reduce-overhead" (CUDA graphs)
  compile-max-autotune  torch.compile mode="max-autotune" (GEMM autotuning + CUDA graphs); slow to
                        compile, so opt-in per shape (--variants) and reported as skipped otherwise
  compile-fa4, compile-graphs-fa4, compile-max-autotune-fa4
                        the same with FlashAttention 4 (CODA's attention) in place of SDPA's, as two
                        torch custom ops torch.compile traces (scripts/fa4_peer.py): the compile peers
                        with the best attention on Hopper
  liger                 eager with Liger kernels
  coda                  the CODA model on the cute backend
  coda-graphs           coda with forward+backward replayed as one CUDA graph (the trainer's
                        coda_train/trainer/graphs.py, trainer.cuda_graphs=on)
  floor                 the step's GEMMs alone (every projection's forward, dgrad and wgrad, the
                        three LM-head GEMMs), each at the best of cuBLAS and quack for its shape,
                        plus FlashAttention 4 forward + backward: what a perfect fusion would cost.
                        Timed per kernel (the sum is the floor) and also back to back in a
                        step's order like a model step (the same work at a sustained step's
                        clocks; reported next to it, with the SM clock of every timing)
For each model variant: forward+backward ms (median, min, max over --iters after --warmup and
--sustain-s of steps back to back, so each is timed at the clock a power-capped GPU holds in training), a full
training step (forward, backward, grad clip, AdamW, zero_grad: what train.py's step is compared with)
ms, tokens/s, MFU (model FLOPs with
causal attention counted as half, against the bf16 GEMM peak measured in the same run), peak memory
(the variant's own: the model, its step and what it keeps, not what earlier variants left allocated;
total, and above the fp32 weights), and the ratios to coda and to the floor. --profile-steps N (default 3; 0:
none) adds the per-op breakdown of a coda step (kernel time by op, launches per step, GPU idle from the timeline).
The target ratio, CODA / the floor back to back, is also taken in pairs (--paired-rounds, after the
variants): the faster-launching CODA variant asked for (coda-graphs, else coda) and the floor's
sequence, built side by side and timed in turn, round after round, the first of each pair alternating,
each timing after its own sustained steps. Each ratio's two timings then share the GPU's
clock drift and power state, which a variant timed minutes before the floor does not (the H100's
ratio at 1B moved 1.070-1.087 between single runs); the median of the rounds is the figure to quote.
A variant that fails is recorded with its error; the run goes on. Writes <out>/bench_<shape>.json
after every variant (those not yet reached listed as `pending`), so a run cut short keeps what it
measured; torch.compile is reset between variants, so each starts as in a fresh process.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch

from code_version import code_version  # scripts/code_version.py: the sources hash and commit


@dataclass(frozen=True)
class Shape:
    preset: str
    batch: int
    seq: int
    n_layers: int | None = None  # None: the preset's depth


SHAPES = {
    "125m": Shape("llama3_125m", 8, 2048),
    "1b-4x4096": Shape("llama3_1b", 4, 4096),
    "1b-2x8192": Shape("llama3_1b", 2, 8192),
    "8b-slice": Shape("llama3_8b", 2, 4096, n_layers=4),  # full width, 4 layers
    "smoke": Shape("tiny", 2, 64, n_layers=2),  # the harness itself, on CPU too (tests/test_bench.py)
}
CUDA_GRAPH = "cuda-graph"  # the trainer's capture (trainer/graphs.py) instead of a torch.compile mode
MODEL_VARIANTS = {  # variant -> (model impl, torch.compile mode, CUDA_GRAPH, or None: eager)
    "eager": ("eager", None),
    "compile": ("eager", "default"),
    "compile-graphs": ("eager", "reduce-overhead"),
    "compile-max-autotune": ("eager", "max-autotune"),
    "liger": ("liger", None),
    # the compile peers with CODA's attention, FlashAttention 4, in place of SDPA's (scripts/fa4_peer.py)
    "compile-fa4": ("eager-fa4", "default"),
    "compile-graphs-fa4": ("eager-fa4", "reduce-overhead"),
    "compile-max-autotune-fa4": ("eager-fa4", "max-autotune"),
    "coda": ("coda", None),
    "coda-graphs": ("coda", CUDA_GRAPH),
}
DEFAULT_VARIANTS = "eager,compile,compile-graphs,compile-fa4,compile-graphs-fa4,liger,coda,coda-graphs,floor"
PAIRED_VARIANTS = ("coda-graphs", "coda")  # the CODA variant the pairs time: the first of these that ran
CUDA_ONLY = {"liger": "Liger's Triton kernels need a CUDA GPU", "coda-graphs": "CUDA graphs need a CUDA device"}


# bf16 on the GPU; the CPU smoke run checks the harness in fp32 (CPU bf16 GEMMs are slow and odd)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
COMPUTE_DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def reset_peak_memory() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def allocated_memory() -> int:
    """Bytes allocated on the GPU now (0 on CPU: not measured there)."""
    return torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0


def peak_memory() -> int:
    """Peak bytes allocated on the GPU since the last reset (0 on CPU: not measured there)."""
    return torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0


class GpuClocks:
    """Samples the GPU's SM clock, power draw and temperature (nvidia-smi, every 100 ms) while the
    block runs: a sustained step runs at the clock its power draw allows, so two timings are only
    comparable at similar clocks. Where nvidia-smi reports them, also the clock event reasons
    (what holds the clock down), as the fraction of samples each was active in. `.mark()` drops the
    samples taken before it (a warm-up inside the block). `.result` is None on CPU or without nvidia-smi."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu"
    REASONS = "clocks_event_reasons.active"
    # bits of clocks_event_reasons.active (nvidia-smi --help-query-gpu)
    REASON_BITS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                   0x80: "hw_power_brake"}

    def __enter__(self) -> "GpuClocks":
        import shutil
        import subprocess

        self.proc, self.result, self.since = None, None, None
        if DEVICE.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = getattr(torch.cuda.get_device_properties(DEVICE), "uuid", None)
            target = ["-i", f"GPU-{uuid}"] if uuid else []
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={self.REASONS}", "--format=csv,noheader"] + target,
                                   capture_output=True, text=True)
            self.with_reasons = probe.returncode == 0 and probe.stdout.strip().startswith("0x")
            fields = self.FIELDS + ("," + self.REASONS if self.with_reasons else "")
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                          "-lms", "100"] + target, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        return self

    def mark(self) -> None:
        """From now on: the samples before this call are not part of the result."""
        self.since = datetime.now()

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        self.result = self.summarize(out, self.with_reasons, self.since)

    @classmethod
    def summarize(cls, out: str, with_reasons: bool, since: Optional[datetime] = None) -> Optional[dict]:
        """The result from nvidia-smi's csv lines (timestamp, SM MHz, W, C[, reasons]): the samples from
        `since` on, or the last one where none is that late (a window shorter than the 100 ms period)."""
        samples = []
        for line in out.splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:
                values = [float(x) for x in parts[1:4]]
                reason = int(parts[4], 16) if with_reasons else None
            except (ValueError, IndexError):  # "[N/A]" fields, a partial last line
                continue
            try:
                stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            except ValueError:  # another format: no sample is dropped
                stamp = None
            samples.append((stamp, values, reason))
        if since is not None and samples and all(x[0] is not None for x in samples):
            samples = [x for x in samples if x[0] >= since] or samples[-1:]
        if not samples:
            return None
        sm, power, temp = zip(*(values for _, values, _ in samples))
        result = {"sm_mhz_mean": statistics.mean(sm), "sm_mhz_min": min(sm), "sm_mhz_max": max(sm),
                  "power_w_mean": statistics.mean(power), "temp_c_max": max(temp), "samples": len(sm)}
        if with_reasons:
            reasons = [r for _, _, r in samples]
            result["clock_reasons"] = {name: sum(bool(r & bit) for r in reasons) / len(reasons)
                                       for bit, name in cls.REASON_BITS.items()}
        return result


def model_config(shape: Shape):
    from coda_train.model import preset

    overrides = {"n_layers": shape.n_layers} if shape.n_layers else {}
    return preset(shape.preset, max_seq_len=max(shape.seq, preset(shape.preset).max_seq_len), **overrides)


# ---- timing primitives --------------------------------------------------------------------

# Timed and profiled steps first run back to back for this long (bench.py --sustain-s; the per-kernel floor and
# the GEMM peak, timed by do_bench, are not sustained): a power-capped GPU
# that was idle before (a compile, a model's setup) boosts its clock for a second or so, and a variant timed
# in that window likely reads fast (the 8b eager coda variant, timed right after its 11-64 s of setup and kernel
# compiles, read 0.4-2.0 % faster than coda-graphs timed after it in the seven H200 runs of 2026-12-02..05, in
# six of them at a higher mean clock: 1482-1523 MHz against 1422-1490).
SUSTAIN_S = 3.0


def sustain(fn: Callable[[], None], seconds: float) -> None:
    """fn back to back for `seconds` on a GPU (nothing on CPU), the host waiting for the GPU now and then so
    that the time is the GPU's, not the host's queue."""
    start, calls = time.perf_counter(), 0
    while DEVICE.type == "cuda" and time.perf_counter() - start < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:
            sync()
    sync()


def step_times(fn: Callable[[], None], iters: int, warmup: int, sync_each: bool = False,
               sustain_s: float = 0.0, clocks: Optional[GpuClocks] = None) -> list[float]:
    """Milliseconds of each of `iters` calls of fn after `warmup` calls and, on a GPU, sustain_s of calls back to
    back (sustain: the clock a power-capped GPU holds in training, not the boost left by an idle compile or setup
    just before; `clocks`, sampling around this call, keeps only the timed calls' samples): CUDA events on a GPU,
    the host clock on CPU (the smoke shape). Back to back with one device sync after the last, as
    train.py runs steps (it syncs on logging steps only), so the host's launch work overlaps the
    previous step unless the host is the slower side; `sync_each`: a sync after every step, the
    method of results without a step_timing field, whose steps also pay the host's latency to their first kernel."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    sustain(fn, sustain_s)
    if clocks is not None:
        clocks.mark()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def summary(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": len(times)}


def do_bench(fn: Callable[[], None]) -> float:
    """Median ms of a single kernel-sized call (triton's do_bench clears L2 between calls; on CPU
    the median of a few host-timed calls)."""
    if not torch.cuda.is_available():
        return statistics.median(step_times(fn, 5, 1))
    from triton.testing import do_bench as _do_bench

    return _do_bench(fn, warmup=10, rep=60, return_mode="median")


def captured(fn: Callable[[], None], warmups: int) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph as the trainer captures a step (trainer/graphs.py): warmed on a side
    stream, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replayable(fn: Callable[[], None]) -> Callable[[], None]:
    """fn captured as a CUDA graph, to replay: its kernels without the host time of launching them (FA4's and
    quack's Python launch paths outlast a short kernel on a slow host, and do_bench would count the wait), as a
    captured step runs them; on CPU fn itself."""
    if not torch.cuda.is_available():
        return fn
    return captured(fn, warmups=1).replay


def do_bench_graph(fn: Callable[[], None]) -> float:
    """do_bench of fn captured as a CUDA graph and replayed (replayable)."""
    return do_bench(replayable(fn))


def gemm_peak_tflops() -> dict:
    """The bf16 dense GEMM rate of this GPU, measured now: 8192^3 on cuBLAS and on quack."""
    from quack.gemm_interface import gemm as quack_gemm

    n = 8192 if torch.cuda.is_available() else 512
    a = torch.randn(n, n, device=DEVICE, dtype=COMPUTE_DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=COMPUTE_DTYPE)
    flops = 2 * n**3
    rates = {"cublas": flops / do_bench(lambda: a @ b) / 1e9}
    try:
        quack_gemm(a, b, tuned=False)
        rates["quack"] = flops / do_bench(lambda: quack_gemm(a, b, tuned=False)) / 1e9
    except Exception as e:  # no GPU, or quack failing: the peak is cuBLAS's
        rates["quack_error"] = f"{type(e).__name__}: {e}"[:200]
    rates["peak"] = max(v for k, v in rates.items() if k in ("cublas", "quack"))
    return rates


# ---- model variants -----------------------------------------------------------------------

def build(impl: str, cfg, state: dict):
    from coda_train.model import build_model

    backend = "cute" if impl == "coda" and DEVICE.type == "cuda" else "reference"
    if impl == "eager-fa4":  # a peer of the bench only, not a model.impl
        from fa4_peer import EagerFA4Llama  # scripts/fa4_peer.py

        model = EagerFA4Llama(cfg, compute_dtype=COMPUTE_DTYPE).to(DEVICE)
    else:
        model = build_model(cfg, impl, backend=backend, compute_dtype=COMPUTE_DTYPE).to(DEVICE)
    model.load_state_dict(state)
    # only the trainer's AdamW (bench_model's full step) updates these weights, as in train.py: the timed forwards
    # keep their compute copies (weights.py) instead of casting every weight again
    model.weight_updates_tracked = True
    return model


def fwd_bwd_fn(model, mode: str | None, tokens, targets) -> Callable[[], None]:
    """One forward+backward of the variant's runner, gradients zeroed first. CUDA_GRAPH: captured
    here (warm-up and capture) and replayed per call, the batch copied into its static buffers."""
    if mode == CUDA_GRAPH:
        from coda_train.trainer.graphs import GraphedMicroBatch

        graphed = GraphedMicroBatch(model, tokens, targets, 1.0)

        def replay() -> None:
            graphed(tokens, targets, first=True)
        return replay
    runner = model if mode is None else torch.compile(model, mode=mode)
    compile_graphs = mode in ("reduce-overhead", "max-autotune")

    def fwd_bwd() -> None:
        if compile_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        runner(tokens, targets).backward()
    return fwd_bwd


@dataclass
class Prepared:
    """A model variant built, compiled and (CUDA_GRAPH) captured: what bench_model times and bench_paired pairs."""
    variant: str
    model: torch.nn.Module
    fwd_bwd: Callable[[], None]
    setup_s: float
    base_bytes: int  # allocated before it was built (earlier variants' leftovers: not its own)
    weight_bytes: int


def prepare_variant(variant: str, cfg, state: dict, batch) -> Prepared:
    impl, mode = MODEL_VARIANTS[variant]
    tokens, targets = batch
    # what earlier variants left allocated (torch.compile's CUDA-graph pools live on) is not this one's
    base = allocated_memory()
    model = build(impl, cfg, state)
    model.rope_tables(tokens.shape[1], tokens.device)  # cached outside torch.compile: CUDA graphs must not own it
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # a captured graph's activations sit in its private pool, counted as allocated only while it is
    # captured: its peaks are taken from the capture on
    reset_peak_memory()
    t0 = time.perf_counter()
    fwd_bwd = fwd_bwd_fn(model, mode, tokens, targets)
    fwd_bwd()  # compiles: every kernel, and torch.compile's graphs (CUDA_GRAPH: already captured)
    sync()
    return Prepared(variant, model, fwd_bwd, time.perf_counter() - t0, base, weight_bytes)


def bench_model(prepared: Prepared, batch, iters: int, warmup: int, sustain_s: float) -> dict:
    """Forward+backward and full-step timings and peak memory of one prepared model variant."""
    mode = MODEL_VARIANTS[prepared.variant][1]
    model, fwd_bwd, base = prepared.model, prepared.fwd_bwd, prepared.base_bytes
    reset_peak = reset_peak_memory if mode != CUDA_GRAPH else lambda: None
    reset_peak()
    with GpuClocks() as clocks:
        fb = step_times(fwd_bwd, iters, warmup, sustain_s=sustain_s, clocks=clocks)
    fb_synced = step_times(fwd_bwd, iters, 0, sync_each=True)  # the earlier method (results without step_timing), for comparison
    peak_fb = peak_memory() - base

    from coda_train.config import OptimConfig
    from coda_train.trainer.distributed import global_grad_norm
    from coda_train.trainer.optim import build_optimizer, clip_factor

    optimizer = build_optimizer(model, OptimConfig(), DEVICE)  # the trainer's: it writes the compute copies
    params = list(model.parameters())

    def train_step() -> None:  # as TrainStep: the norm, then the clip factor applied inside the optimizer's pass
        fwd_bwd()
        optimizer.grad_factor = clip_factor(global_grad_norm(params), 1.0)
        optimizer.step()

    reset_peak()
    with GpuClocks() as step_clocks:  # the full step's own clock: the two phases may run at different ones
        step = step_times(train_step, iters, warmup, sustain_s=sustain_s, clocks=step_clocks)
    peak_step = peak_memory() - base
    n_tokens = batch[0].numel()
    return {
        "variant": prepared.variant, "setup_s": prepared.setup_s, "fwd_bwd": summary(fb),
        "fwd_bwd_synced": summary(fb_synced), "clocks": clocks.result, "step": summary(step), "step_clocks": step_clocks.result,
        "tokens_per_s": n_tokens / statistics.median(step) * 1e3,
        "peak_fwd_bwd_gib": peak_fb / 2**30 if peak_fb else None,
        "peak_above_weights_gib": (peak_fb - prepared.weight_bytes) / 2**30 if peak_fb else None,
        "peak_step_gib": peak_step / 2**30 if peak_step else None,
    }


def bench_paired(prepared: Prepared, cfg, shape: "Shape", picks: dict[str, str], rounds: int,
                 iters: int, warmup: int, sustain_s: float) -> dict:
    """`prepared` (a CODA variant) and the floor's back-to-back sequence with the per-kernel floor's `picks`, side by
    side and timed in turn for `rounds` rounds, the first of each pair alternating: one ratio per round, each
    from two timings at neighbouring times (the docstring above says why), and their median."""
    sequence = _floor_sequence(cfg, shape, picks)
    sync()
    steps = {"coda": prepared.fwd_bwd, "floor": sequence.step}
    done = []
    for i in range(rounds):
        row = {"first": "coda" if i % 2 == 0 else "floor"}
        for side in (("coda", "floor") if i % 2 == 0 else ("floor", "coda")):
            with GpuClocks() as clocks:
                row[f"{side}_ms"] = statistics.median(step_times(steps[side], iters, warmup, sustain_s=sustain_s,
                                                                 clocks=clocks))
            row[f"{side}_mhz"] = clocks.result["sm_mhz_mean"] if clocks.result else None
        row["ratio"] = row["coda_ms"] / row["floor_ms"]
        done.append(row)
    del steps, sequence
    return {"variant": prepared.variant, "against": "floor back to back", "rounds": done,
            "median_ratio": statistics.median(r["ratio"] for r in done)}


# ---- the floor: the step's GEMMs and attention, nothing else ------------------------------

def step_gemms(cfg, M: int) -> list[tuple[str, int, int, int, str]]:
    """(name, m, n, k, layout) of every GEMM of one training step, per layer then the LM head.
    layout: 'nt' = x (m,k) @ W^T (W stored (n,k)), 'nn' = g (m,k) @ W (k,n), 'tn' = g^T @ x (wgrad)."""
    d, H, G, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H
    qkv = (H + 2 * G) * hd
    per_layer = []
    for proj, n_out, k_in in (("qkv", qkv, d), ("o", d, H * hd), ("gate_up", 2 * F, d), ("down", d, F)):
        per_layer += [(f"{proj} fwd", M, n_out, k_in, "nt"), (f"{proj} dgrad", M, k_in, n_out, "nn"),
                      (f"{proj} wgrad", n_out, k_in, M, "tn")]
    head = [("lm_head fwd", M, V, d, "nt"), ("lm_head dgrad", M, d, V, "nn"), ("lm_head wgrad", V, d, M, "tn")]
    return [(n, m, nn, k, lay, cfg.n_layers) for n, m, nn, k, lay in per_layer] + [(*h, 1) for h in head]


def gemm_operands(m: int, n: int, k: int, layout: str):
    """a (m,k), b (k,n) in the memory layout the model's GEMM of that kind reads."""
    rn = lambda *s: torch.randn(*s, device=DEVICE, dtype=COMPUTE_DTYPE)  # noqa: E731
    if layout == "nt":
        return rn(m, k), rn(n, k).t()
    if layout == "nn":
        return rn(m, k), rn(k, n)
    return rn(k, m).t(), rn(k, n)


def attention_calls(cfg, shape: Shape) -> tuple[Callable[[], None], Callable[[], None]]:
    """One layer's FlashAttention 4 forward and backward (the cute ops; the reference on CPU) on
    random fused qkv rows of the shape's batch."""
    from coda_train.kernels import op_set

    ops = op_set("cute" if DEVICE.type == "cuda" else "reference")
    H, G, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = torch.randn(shape.batch * shape.seq, (H + 2 * G) * hd, device=DEVICE, dtype=COMPUTE_DTYPE)
    o, lse = ops.attention(qkv, H, G, shape.seq)
    g_o = torch.randn_like(o)
    return (lambda: ops.attention(qkv, H, G, shape.seq),
            lambda: ops.attention_backward(g_o, qkv, o, lse, H, G, shape.seq))


def bench_floor(cfg, shape: Shape, iters: int, warmup: int, sustain_s: float, quack_tuned: bool = False) -> dict:
    """Sum over the step's GEMMs of the fastest of cuBLAS and quack (its default config, and with
    quack_tuned its autotuner's pick too), plus FA4 forward + backward, each timed alone (the floor);
    then the same kernels back to back in the step's order, timed as the model variants' steps are
    (the floor at a sustained step's clocks)."""
    with GpuClocks() as clocks:
        floor = _floor_per_kernel(cfg, shape, quack_tuned)
    floor["quack_tuned"] = quack_tuned
    floor["clocks"] = clocks.result
    picks = {g["gemm"]: g["best"] for g in floor["gemms"]}
    sequence = _floor_sequence(cfg, shape, picks)
    b2b = floor["back_to_back"] = _time_sequence(sequence, iters, warmup, sustain_s)
    if DEVICE.type == "cuda":  # right after the timed steps, at their clocks: the time of each item as a step runs it
        launches = timeline(_profiled(sequence.ranged, 1, sustain_s=0.0), 1, prefix="floor::")["launches_by_owner"]
        replayed = kernel_sequence(_profiled(sequence.step, 2, sustain_s), 2)
        b2b["by_item_ms"] = items_from_sequence(replayed, sequence.names, launches)
    del sequence  # its graph and operands, before the next one's
    # CODA writes every weight gradient in fp32 (the speed issue asks it of the GEMM that computes it); the floor's
    # GEMMs write bf16 like any torch.matmul: the same sequence with fp32 wgrads is the floor of that work
    fp32 = floor["back_to_back_fp32_wgrads"] = _time_sequence(
        _floor_sequence(cfg, shape, picks, wgrad_dtype=torch.float32), iters, warmup, sustain_s)
    fp32["wgrads"] = sorted({name for name, *_, layout, _ in step_gemms(cfg, shape.batch * shape.seq) if layout == "tn"})
    # quack's autotuner picks by a config's time over many calls back to back, the per-kernel floor times each call
    # alone: the same sequence with quack's GEMMs at the autotuned pick tells which a step's order favours
    autotuned = {g["gemm"]: "quack-tuned" if g["best"] == "quack" and "quack_tuned_ms" in g else g["best"]
                 for g in floor["gemms"]}
    if autotuned != picks:
        alt = floor["back_to_back_autotuned"] = _time_sequence(_floor_sequence(cfg, shape, autotuned), iters, warmup,
                                                               sustain_s)
        alt["gemms_autotuned"] = sorted(name for name in picks if autotuned[name] != picks[name])
    return floor


def _time_sequence(sequence: "FloorSequence", iters: int, warmup: int, sustain_s: float) -> dict:
    """One floor sequence timed as a model variant's step is, with its clocks and how it was replayed."""
    with GpuClocks() as clocks:
        timed = summary(step_times(sequence.step, iters, warmup, sustain_s=sustain_s, clocks=clocks))
    timed["clocks"], timed["replay"] = clocks.result, sequence.replay
    return timed


def floor_gemm(backend: str, a, b, out_dtype: Optional[torch.dtype] = None) -> Callable[[], torch.Tensor]:
    """a @ b on one of the floor's GEMM backends: "cublas" (torch.matmul), "quack" (quack's default
    config), "quack-2x2" (that config's tile at a 2x2 cluster) or "quack-tuned" (quack's autotuner: its first call tries every SM90 config it can run, and split-K
    factors where the output has fewer tiles than the GPU has SMs, as cuBLAS may split the wgrads' long K).
    out_dtype: the output's dtype where it is not the inputs' (fp32 weight gradients, as CODA writes them)."""
    if backend == "cublas":
        if out_dtype is None:
            return functools.partial(torch.matmul, a, b)
        if a.is_cuda:  # cuBLAS accumulates in fp32 and stores it (as the cute matmul_tn's cuBLAS path does)
            return functools.partial(torch.mm, a, b, out_dtype=out_dtype)
        return lambda: torch.matmul(a, b).to(out_dtype)  # CPU (no mm out_dtype): the harness only, timings mean nothing
    from quack.gemm_interface import gemm as quack_gemm

    if backend == "quack":
        return functools.partial(quack_gemm, a, b, tuned=False, out_dtype=out_dtype)
    if backend == "quack-2x2":
        return _quack_at_2x2(a, b, out_dtype)
    return functools.partial(quack_gemm, a, b, tuned=True, split_k=None, out_dtype=out_dtype)


def _quack_at_2x2(a, b, out_dtype: Optional[torch.dtype]) -> Callable[[], torch.Tensor]:
    """quack's bare GEMM at the tile its default call runs (nvMatmulHeuristics' pick) with a 2x2 cluster: both
    operands multicast, the L2 reads CODA's 2x2 entries save (docs/kernels.md, "Where B1's traffic goes")."""
    from dataclasses import replace

    from quack.gemm_config import default_config
    from quack.gemm_interface import gemm_tuned, nvmmh_config

    base = nvmmh_config(a, b, torch.cuda.get_device_capability(a.device)[0]) or default_config(a.device)
    config = replace(base, cluster_m=2, cluster_n=2, split_k=1)
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=out_dtype or a.dtype)
    return functools.partial(gemm_tuned.fn, a, b, out, config=config)  # .fn: the kernel at this config, untuned


def floor_backends(quack_tuned: bool) -> tuple[str, ...]:
    """The floor's GEMM backends: cuBLAS and quack's default, quack's autotuner with quack_tuned, and quack at a
    2x2 cluster where CODA's tile table on this GPU runs one (quack's autotuner tries 2x1 and 1x2 only): a
    cluster CODA's GEMMs get, the floor's bare GEMMs get too."""
    backends = ("cublas", "quack", "quack-tuned") if quack_tuned else ("cublas", "quack")
    return backends + (("quack-2x2",) if _table_runs_2x2() else ())


def _table_runs_2x2() -> bool:
    if DEVICE.type != "cuda":
        return False
    from coda_train.kernels import tile_configs

    entries = tile_configs.tables().get(tile_configs.gpu_key(torch.cuda.get_device_name()), {})
    return any(c is not None and (c.cluster_M, c.cluster_N) == (2, 2) for c in entries.values())


FLOOR_PICK_ROUNDS = 3  # a GEMM's backends timed in turn this many times: one timing each let a clock dip pick the slower


def _floor_per_kernel(cfg, shape: Shape, quack_tuned: bool = False) -> dict:
    """Each step GEMM on every floor backend, timed in FLOOR_PICK_ROUNDS rounds, the backends' order reversed in every
    other round; a backend's time is its median (the 1B floor on the H100 of 2026-12-06 had timed each once, and put
    gate_up's weight gradient on quack at 1.706 ms where cuBLAS, timed at 1.740 then, took 1.497 on the next machine)."""
    M = shape.batch * shape.seq
    backends = floor_backends(quack_tuned)
    rows, total = [], 0.0
    for name, m, n, k, layout, count in step_gemms(cfg, M):
        a, b = gemm_operands(m, n, k, layout)
        row, runs = {"gemm": name, "m": m, "n": n, "k": k, "count": count}, {}
        for backend in backends:
            try:
                fn = floor_gemm(backend, a, b)
                fn()  # compiles (quack), autotunes (quack-tuned)
                runs[backend] = replayable(fn)
            except Exception as e:  # no GPU, or a layout quack cannot run: the others alone
                if backend == "cublas":
                    raise
                row[f"{backend.replace('-', '_')}_error"] = f"{type(e).__name__}: {e}"[:200]
        rounds = {backend: [] for backend in runs}
        for i in range(FLOOR_PICK_ROUNDS):
            for backend in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                try:
                    rounds[backend].append(do_bench(runs[backend]))
                except Exception as e:  # a replay that fails after its capture worked: the others alone
                    if backend == "cublas":
                        raise
                    row[f"{backend.replace('-', '_')}_error"] = f"{type(e).__name__}: {e}"[:200]
                    del runs[backend], rounds[backend]
        times = {backend: statistics.median(ms) for backend, ms in rounds.items()}
        for backend, ms in rounds.items():
            key = backend.replace("-", "_")
            row[f"{key}_ms"], row[f"{key}_rounds_ms"] = times[backend], ms
        row["best"] = min(times, key=times.get)
        row["best_ms"] = times[row["best"]]
        total += count * row["best_ms"]
        rows.append(row)
        del a, b, runs  # the captured graphs hold their outputs (the LM head's: 4 GiB at 1B, one per backend)
    fwd, bwd = attention_calls(cfg, shape)
    attn_fwd, attn_bwd = do_bench_graph(fwd), do_bench_graph(bwd)
    attention = cfg.n_layers * (attn_fwd + attn_bwd)
    return {"variant": "floor", "fwd_bwd": {"median_ms": total + attention}, "gemm_ms": total, "backends": list(backends),
            "attention_ms": attention, "attention_fwd_ms": attn_fwd, "attention_bwd_ms": attn_bwd, "gemms": rows}


@dataclass
class FloorSequence:
    """The floor's kernels in a step's order: `step()` runs one step as the timing does, `ranged()`
    runs it eagerly with each item in a "floor::<name>" range (profiling only: a range costs host
    time), `names` the items in order, `replay` how `step` runs them."""
    step: Callable[[], None]
    ranged: Callable[[], None]
    names: list[str]
    replay: str


def _floor_sequence(cfg, shape: Shape, picks: dict[str, str], wgrad_dtype: Optional[torch.dtype] = None) -> FloorSequence:
    """Every layer's forward GEMMs and attention, the LM head, every layer's backward in reverse,
    each GEMM on its backend in `picks` (GEMM name -> floor_gemm backend), the weight gradients written in
    `wgrad_dtype` (None: the inputs' bf16). On a GPU the step is captured as one CUDA graph and
    replayed, as coda-graphs runs: no host work (FA4's interface, quack's launch path) leaves the
    GPU idle between kernels, idle time that would let a power-capped GPU raise its clock."""
    M = shape.batch * shape.seq
    gemms = {}
    for name, m, n, k, layout, _ in step_gemms(cfg, M):
        a, b = gemm_operands(m, n, k, layout)
        gemms[name] = floor_gemm(picks[name], a, b, wgrad_dtype if layout == "tn" else None)
    gemms["attention fwd"], gemms["attention bwd"] = attention_calls(cfg, shape)
    forward = ["qkv fwd", "attention fwd", "o fwd", "gate_up fwd", "down fwd"]
    head = ["lm_head fwd", "lm_head dgrad", "lm_head wgrad"]
    backward = ["down dgrad", "down wgrad", "gate_up dgrad", "gate_up wgrad", "o dgrad", "o wgrad", "attention bwd",
                "qkv dgrad", "qkv wgrad"]
    names = forward * cfg.n_layers + head + backward * cfg.n_layers

    def step() -> None:
        for name in names:
            gemms[name]()

    def ranged() -> None:
        for name in names:
            with torch.profiler.record_function(f"floor::{name}"):
                gemms[name]()

    if DEVICE.type != "cuda":
        return FloorSequence(step, ranged, names, "eager")
    return FloorSequence(captured(step, warmups=2).replay, ranged, names, "one CUDA graph")


def items_from_sequence(sequence: list[dict], names: list[str], launches: dict[str, float]) -> dict | None:
    """Per-item kernel ms of one replayed floor step: its kernels (kernel_sequence, in order) dealt to
    the items in step order, each taking as many as one call of it launches eagerly (`launches`: per
    step, from the ranged profile). None when those counts do not fit the sequence exactly."""
    per_call = {}
    for name in set(names):
        n = launches.get(name, 0.0) / names.count(name)
        if abs(n - round(n)) > 1e-6 or round(n) < 1:
            return None
        per_call[name] = round(n)
    if sum(per_call[n] for n in names) != len(sequence):
        return None
    out, i = {}, 0
    for name in names:
        out[name] = out.get(name, 0.0) + sum(k["us"] for k in sequence[i:i + per_call[name]]) / 1e3
        i += per_call[name]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ---- where a coda step's time goes ---------------------------------------------------------

PROFILE_VERSION = 2  # 1 counted the GPU-side copies of profiler ranges as kernels (double counting)


def profile_coda(cfg, state: dict, batch, steps: int, sustain_s: float) -> dict:
    """Where a coda forward+backward step goes, from the profiler's kernel timeline, in three passes
    of `steps` back-to-back steps: the plain model gives launches per step and the GPU idle
    fraction; the same step replayed as a CUDA graph (coda-graphs) gives the idle time left with no
    host in the way (the gaps between dependent kernels); the model with every op call in a
    "coda::<op>" range gives kernel time by op (the ranges cost host time, so the idle fraction is
    not read from that pass)."""
    tokens, targets = batch
    # built as the timed coda variants are: a model without weight_updates_tracked recasts every weight in
    # every forward (weights.py), work the timed steps do not do (the 2026-12-05 profiles charged it to CODA)
    model = build("coda", cfg, state)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()

    plain = timeline(_profiled(fwd_bwd, steps, sustain_s), steps)
    graph_prof = _profiled(fwd_bwd_fn(model, CUDA_GRAPH, tokens, targets), steps, sustain_s)
    graphed = timeline(graph_prof, steps)
    plain["graph"] = {k: graphed[k] for k in ("kernel_ms_per_step", "busy_ms_per_step", "launches_per_step",
                                              "gpu_window_ms_per_step", "gpu_idle_fraction")}
    plain["graph"]["sequence"] = kernel_sequence(graph_prof, steps)
    model.ops = annotated(model.ops)
    annotated_prof = _profiled(fwd_bwd, steps, sustain_s)
    by_op = timeline(annotated_prof, steps)
    plain["graph"].update(graph_by_owner(plain["graph"]["sequence"], owner_sequence(annotated_prof, steps)))
    return {"version": PROFILE_VERSION, **plain, "weights_recast_every_forward": not model.weight_updates_tracked,
            "by_owner_ms": by_op["by_owner_ms"],
            "launches_by_owner": by_op["launches_by_owner"], "annotated_kernel_ms_per_step": by_op["kernel_ms_per_step"]}


def owner_sequence(prof, steps: int, prefix: str = "coda::") -> list[tuple[str, str]]:
    """The last profiled step's device work in launch order as (kernel name as kernel_sequence shortens
    it, its owner as timeline assigns it)."""
    owned = sorted(_owned_device_work(prof, prefix), key=lambda ko: ko[0].time_range.start)
    return [(short_name(k.name), owner) for k, owner in last_step(owned, steps)]


def graph_by_owner(sequence: list[dict], owners: list[tuple[str, str]]) -> dict:
    """Kernel time by op of the step replayed as a CUDA graph (its kernels at the clock of a sustained
    replay, as coda-graphs is timed): each graph kernel takes the op of the eager annotated step's kernel it
    aligns with (the longest matching runs of kernel names in launch order); a kernel with no partner
    (capture-only work) goes to its kernel class."""
    import difflib

    names = [k["kernel"] for k in sequence]
    owner_of = [None] * len(names)
    matcher = difflib.SequenceMatcher(None, names, [n for n, _ in owners], autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            owner_of[block.a + i] = owners[block.b + i][1]
    by_owner: dict[str, float] = {}
    for k, owner in zip(sequence, owner_of):
        owner = owner or _kernel_class(k["kernel"])
        by_owner[owner] = by_owner.get(owner, 0.0) + k["us"] / 1e3
    matched = sum(o is not None for o in owner_of)
    return {"by_owner_ms": dict(sorted(by_owner.items(), key=lambda kv: -kv[1])),
            "kernels_matched": matched, "kernels": len(names)}


def _profiled(fn: Callable[[], None], steps: int, sustain_s: float):
    """The profiler over `steps` calls of fn, after at least two warm-up calls and sustain_s of them
    back to back on a GPU (0: the two only, e.g. where only launches are counted)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    fn()
    sustain(fn, sustain_s)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            fn()
        sync()
    return prof


def annotated(ops):
    """The same op set with each call inside a profiler range "coda::<op>" (only for profiling:
    a range costs host time on every call)."""
    from coda_train.kernels import OPS, OpSet

    def wrap(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"coda::{name}"):
                return fn(*args, **kwargs)
        return call

    return OpSet(ops.backend, {name: wrap(name, getattr(ops, name)) for name in OPS})


def timeline(prof, steps: int, prefix: str = "coda::") -> dict:
    """Per-step kernel time by owner (the innermost `prefix` range around the launch: a coda op, or a
    floor item; else a kernel-name class), launches, and the GPU idle fraction: 1 - (union of kernel
    intervals) / (first kernel start .. last kernel end). Device work = kernels, memcpy and memset, not the GPU-side copies
    of profiler ranges. A device event shares its correlation id with the host runtime call that
    launched it (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync...); that call's start time
    places it inside a coda op range."""
    owned = _owned_device_work(prof, prefix)
    by_owner: dict[str, float] = {}
    launches: dict[str, float] = {}
    for k, owner in owned:
        by_owner[owner] = by_owner.get(owner, 0.0) + k.time_range.elapsed_us() / 1e3 / steps
        launches[owner] = launches.get(owner, 0.0) + 1 / steps
    device = [k for k, _ in owned]
    busy, window = _union_and_window(sorted((k.time_range.start, k.time_range.end) for k in device))
    return {"kernel_ms_per_step": sum(by_owner.values()), "busy_ms_per_step": busy / 1e3 / steps,
            "launches_per_step": len(device) / steps, "gpu_window_ms_per_step": window / 1e3 / steps,
            "gpu_idle_fraction": 1 - busy / window if window else None,
            "by_owner_ms": dict(sorted(by_owner.items(), key=lambda kv: -kv[1])),
            "launches_by_owner": dict(sorted(launches.items(), key=lambda kv: -kv[1]))}


def _owned_device_work(prof, prefix: str) -> list:
    """(device event, its owner) for each piece of device work: the innermost `prefix` range around the
    host call that launched it (a device event shares its correlation id with that call), else its
    kernel class."""
    from torch.autograd import DeviceType

    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    launched_at = {e.id: e.time_range.start for e in cpu if e.name.startswith(("cuda", "cu")) and e.id}
    op_ranges = sorted((e.time_range.start, e.time_range.end, e.name.removeprefix(prefix))
                       for e in cpu if e.name.startswith(prefix))
    return [(k, (_innermost(op_ranges, launched_at[k.id]) if k.id in launched_at else None) or _kernel_class(k.name))
            for k in _device_work(events)]


def _device_work(events) -> list:
    """The profiler's device events that are work (kernels, memcpy, memset), not the GPU-side
    copies of profiler ranges."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("coda::", "floor::"))]


def last_step(in_order: list, steps: int) -> list:
    """The last of `steps` equal steps' items, of all the steps' items in launch order."""
    return in_order[len(in_order) - len(in_order) // steps:] if steps else in_order


def short_name(kernel: str) -> str:
    """A kernel's name as the sequences keep it (its first 90 characters)."""
    return kernel[:90]


def kernel_sequence(prof, steps: int) -> list[dict]:
    """The last profiled step's device work in launch order: each kernel's name (shortened), its
    time and the idle gap before it (us), so the costly boundaries between kernels can be read."""
    device = sorted(_device_work(prof.events()), key=lambda e: e.time_range.start)
    out, prev_end = [], None
    for e in last_step(device, steps):
        start, end = e.time_range.start, e.time_range.end
        out.append({"kernel": short_name(e.name), "us": round(end - start, 2),
                    "gap_us": None if prev_end is None else round(start - prev_end, 2)})
        prev_end = end if prev_end is None else max(prev_end, end)
    return out


def _union_and_window(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(total length of the union of sorted intervals, last end - first start)."""
    busy, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if cur_end is None or s > cur_end:
            busy += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += 0.0 if cur_end is None else cur_end - cur_start
    return busy, (spans[-1][1] - spans[0][0]) if spans else 0.0


def _innermost(ranges, t: float):
    """Name of the innermost (latest-starting) range containing t."""
    best = None
    for s, e, name in ranges:
        if s > t:
            break
        if s <= t <= e:
            best = name
    return best


def _kernel_class(name: str) -> str:
    n = name.lower()
    for key, label in (("flash", "attention (FA4, outside an op range)"), ("gemm", "other GEMM"),
                       ("nvjet", "other GEMM"), ("copy", "copies / casts"), ("elementwise", "elementwise"),
                       ("reduce", "reductions"), ("adam", "optimizer"), ("multi_tensor", "optimizer")):
        if key in n:
            return f"[{label}]"
    return "[other]"


# ---- driver ---------------------------------------------------------------------------------

def run(shape_name: str, variants: list[str], iters: int, warmup: int, profile_steps: int,
        save: Callable[[dict], None] = lambda result: None, floor_quack_tuned: bool = False,
        sustain_s: float = SUSTAIN_S, paired_rounds: int = 0) -> dict:
    """Every variant of one shape; `save` gets the result so far after each variant, so a run cut short
    (a device call's time limit) keeps what it measured."""
    shape = SHAPES[shape_name]
    cfg = model_config(shape)
    torch.manual_seed(0)
    from coda_train.model import build_model

    state = build_model(cfg, "eager").state_dict()  # one init (CPU, fp32) for every variant
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    batch = tuple(torch.randint(0, cfg.vocab_size, (shape.batch, shape.seq), device=DEVICE, generator=gen)
                  for _ in range(2))
    result = {"shape": shape_name, **shape.__dict__, "n_layers": cfg.n_layers, "model": cfg.__dict__,
              "tokens": shape.batch * shape.seq, "flops_per_step": cfg.flops_per_token(shape.seq) * shape.batch * shape.seq,
              "environment": environment(), "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "variants": {}, "failed": {}, "memory_accounting": "own", "step_timing": "back_to_back",
              "variant_isolation": "dynamo_reset",  # torch.compile's state reset between variants (below)
              "sustain_s": sustain_s if DEVICE.type == "cuda" else 0.0}  # steps back to back before each timing
    result["gemm_peak_tflops"] = gemm_peak_tflops()
    # a CPU's GEMM rate is no bf16 peak (no MFU is taken against it): the header names it on CUDA only
    peak = f" | bf16 GEMM peak {result['gemm_peak_tflops']['peak']:.0f} TFLOP/s" if DEVICE.type == "cuda" else ""
    print(f"{shape_name}: {shape}{peak}", flush=True)
    # the variant the pairs time (coda-graphs, else coda), kept built for them while only the floor runs after it
    pair_with = next((n for n in PAIRED_VARIANTS if n in variants), None) if paired_rounds else None
    kept: Optional[Prepared] = None
    for variant in variants:
        t0 = time.perf_counter()
        if variant != "floor":
            kept = None  # another model variant's memory and timing are its own
        try:
            if variant == "floor":
                row = bench_floor(cfg, shape, iters, warmup, sustain_s, floor_quack_tuned)
            else:
                prepared = prepare_variant(variant, cfg, state, batch)
                row = bench_model(prepared, batch, iters, warmup, sustain_s)
                kept = prepared if variant == pair_with else None
            result["variants"][variant] = row
            print(f"  {variant:22s} fwd+bwd {row['fwd_bwd']['median_ms']:8.2f} ms  ({time.perf_counter() - t0:5.0f} s)",
                  flush=True)
        except Exception as e:  # record and go on: one failing peer must not hide the others
            result["failed"][variant] = f"{type(e).__name__}: {e}"[:500]
            print(f"  {variant:22s} FAILED {result['failed'][variant]}\n{traceback.format_exc()[-1500:]}", flush=True)
        prepared = None  # freed below unless kept (also when its timing failed)
        result["pending"] = variants[variants.index(variant) + 1:]  # what a cut-short run did not reach
        add_ratios(result)
        save(result)
        # as if each variant ran in a fresh process: torch.compile's CUDA-graph trees share one memory pool
        # per device, so a second graphed variant recorded into the first one's freed blocks and its
        # peak read low (compile-max-autotune after compile-graphs at 8B: 2.5 GiB above the weights, 10.2 alone)
        torch._dynamo.reset()
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    paired = next((n for n in PAIRED_VARIANTS if n in result["variants"]), None)
    if paired_rounds and paired and "floor" in result["variants"]:
        picks = {g["gemm"]: g["best"] for g in result["variants"]["floor"]["gemms"]}
        try:
            prepared = kept if kept is not None else prepare_variant(paired, cfg, state, batch)  # kept: `paired` timed
            result["paired"] = bench_paired(prepared, cfg, shape, picks, paired_rounds, iters, warmup, sustain_s)
        except Exception as e:  # the single-run ratios above stand
            result["failed"]["paired"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        prepared = kept = None
        save(result)
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    if profile_steps and "coda" in result["variants"] and DEVICE.type == "cuda":
        try:
            result["coda_profile"] = profile_coda(cfg, state, batch, profile_steps, sustain_s)
        except Exception as e:
            result["failed"]["coda_profile"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
    result.pop("pending", None)
    add_ratios(result)
    return result


def add_ratios(result: dict) -> None:
    """MFU and the ratios to coda (its faster launch: eager or the CUDA graph) and to the floor
    (forward+backward medians)."""
    v = result["variants"]
    peak = result["gemm_peak_tflops"]["peak"]
    coda = min((v[n]["fwd_bwd"]["median_ms"] for n in ("coda", "coda-graphs") if n in v), default=None)
    floor = v.get("floor", {}).get("fwd_bwd", {}).get("median_ms")
    floor_b2b = v.get("floor", {}).get("back_to_back", {}).get("median_ms")
    floor_fp32 = v.get("floor", {}).get("back_to_back_fp32_wgrads", {}).get("median_ms")
    def mfu(ms: float) -> Optional[float]:  # against a CPU's GEMM rate an MFU means nothing: None, as train.py logs it
        return result["flops_per_step"] / (ms * 1e-3) / (peak * 1e12) if DEVICE.type == "cuda" else None

    for row in v.values():
        ms = row["fwd_bwd"]["median_ms"]
        row["mfu_fwd_bwd"] = mfu(ms)
        if "step" in row:
            row["mfu_step"] = mfu(row["step"]["median_ms"])
        row["over_coda"] = ms / coda if coda else None
        row["over_floor"] = ms / floor if floor else None
        row["over_floor_back_to_back"] = ms / floor_b2b if floor_b2b else None
        row["over_floor_fp32_wgrads"] = ms / floor_fp32 if floor_fp32 else None


def environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "triton", "nvidia-cutlass-dsl", "quack-kernels", "flash-attn-4", "liger-kernel"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    versions["torch"] = torch.__version__
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke run: not a measurement)"
    return {"gpu": gpu, "cuda": torch.version.cuda, "packages": versions, "code": code_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def print_table(result: dict) -> None:
    print(f"\n{result['shape']}: {result['preset']} {result['n_layers']} layers, {result['batch']} x {result['seq']} on "
          f"{result['environment']['gpu']} ({result['environment']['date']})")
    print(f"{'variant':22s}{'fwd+bwd ms':>11s}{'min':>8s}{'max':>8s}{'synced':>8s}{'step ms':>9s}{'tok/s':>10s}{'MFU':>6s}"
          f"{'peak GiB':>9s}{'/coda':>7s}{'/floor':>7s}{'SM MHz':>8s}{'W':>6s}  power-capped")
    for name, r in result["variants"].items():
        fb, st = r["fwd_bwd"], r.get("step")
        cells = [f"{fb['median_ms']:11.2f}", f"{fb.get('min_ms', math.nan):8.2f}", f"{fb.get('max_ms', math.nan):8.2f}",
                 f"{r['fwd_bwd_synced']['median_ms']:8.2f}" if "fwd_bwd_synced" in r else f"{'-':>8s}",
                 f"{st['median_ms']:9.2f}" if st else f"{'-':>9s}",
                 f"{r['tokens_per_s']:10.0f}" if "tokens_per_s" in r else f"{'-':>10s}",
                 f"{100 * r['mfu_fwd_bwd']:5.1f}%" if r["mfu_fwd_bwd"] is not None else f"{'-':>6s}",
                 f"{r['peak_fwd_bwd_gib']:9.1f}" if r.get("peak_fwd_bwd_gib") else f"{'-':>9s}",
                 f"{r['over_coda']:7.2f}" if r["over_coda"] else f"{'-':>7s}",
                 f"{r['over_floor']:7.2f}" if r["over_floor"] else f"{'-':>7s}",
                 f"{r['clocks']['sm_mhz_mean']:8.0f}" if r.get("clocks") else f"{'-':>8s}",
                 f"{r['clocks']['power_w_mean']:6.0f}" if r.get("clocks") else f"{'-':>6s}",
                 f"  {100 * r['clocks']['clock_reasons']['sw_power_cap']:.0f}%"
                 if "clock_reasons" in (r.get("clocks") or {}) else "  -"]
        print(f"{name:22s}" + "".join(cells))
    floor = result["variants"].get("floor")
    if floor and "back_to_back" in floor:
        b2b, mhz = floor["back_to_back"], (floor["back_to_back"].get("clocks") or {}).get("sm_mhz_mean")
        print(f"floor back to back (its kernels in a step's order, timed as a step): {b2b['median_ms']:.2f} ms"
              + (f" at {mhz:.0f} MHz" if mhz else "") + "; coda variants / that: "
              + ", ".join(f"{n} {r['over_floor_back_to_back']:.2f}" for n, r in result["variants"].items()
                          if n.startswith("coda") and r.get("over_floor_back_to_back")))
    if floor and "back_to_back_fp32_wgrads" in floor:
        fp32 = floor["back_to_back_fp32_wgrads"]
        print(f"  the same with its weight gradients written in fp32, as CODA writes them: {fp32['median_ms']:.2f} ms; "
              "coda variants / that: " + ", ".join(f"{n} {r['over_floor_fp32_wgrads']:.3f}" for n, r in
                                                  result["variants"].items() if n.startswith("coda") and r.get("over_floor_fp32_wgrads")))
    if floor and "back_to_back_autotuned" in floor:
        alt = floor["back_to_back_autotuned"]
        print(f"  the same with its quack GEMMs at quack's autotuned pick ({', '.join(alt['gemms_autotuned'])}): "
              f"{alt['median_ms']:.2f} ms")
    paired = result.get("paired")
    if paired:
        print(f"paired, timed in turn ({len(paired['rounds'])} rounds): {paired['variant']} / floor back to back "
              + ", ".join(f"{r['ratio']:.3f}" for r in paired["rounds"]) + f"; median {paired['median_ratio']:.3f}")
    for name, err in result["failed"].items():
        print(f"{name:22s}FAILED: {err[:150]}")
    prof = result.get("coda_profile")
    if prof:
        print(f"coda step: {prof['kernel_ms_per_step']:.2f} ms of kernels, {prof['launches_per_step']:.0f} launches, "
              f"GPU idle {100 * prof['gpu_idle_fraction']:.0f}% of its {prof['gpu_window_ms_per_step']:.2f} ms window "
              f"(by op, with op ranges: {prof['annotated_kernel_ms_per_step']:.2f} ms of kernels)")
        g = prof.get("graph")
        if g and g["launches_per_step"]:
            print(f"as a CUDA graph: {g['kernel_ms_per_step']:.2f} ms of kernels, {g['launches_per_step']:.0f} launches, "
                  f"GPU idle {g['gpu_window_ms_per_step'] - g['busy_ms_per_step']:.2f} ms of its "
                  f"{g['gpu_window_ms_per_step']:.2f} ms window")
        n = prof.get("launches_by_owner", {})
        for owner, ms in prof["by_owner_ms"].items():
            print(f"    {owner:40s}{ms:9.3f} ms" + (f"{n[owner]:7.0f} launches" if owner in n else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--variants", default=None,
                   help=f"comma list of {sorted([*MODEL_VARIANTS, 'floor'])} (default {DEFAULT_VARIANTS}; "
                        f"on CPU without {', '.join(CUDA_ONLY)})")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sustain-s", type=float, default=SUSTAIN_S,
                   help="seconds of steps back to back before each step timing and profile (after --warmup), so every "
                        "variant is timed at the clock a power-capped GPU holds in training, whatever ran before it")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled coda steps (0: no breakdown)")
    p.add_argument("--tag", default="", help="suffix of the JSON name (bench_<shape><tag>.json), e.g. for a profile-only run")
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--floor-quack-tuned", action="store_true",
                   help="the floor's GEMMs also at quack's autotuned config (its first call per shape tries every "
                        "SM90 config quack can run: minutes of device time), and the graph floor timed again with "
                        "every GEMM it runs at quack's default config at the autotuned pick")
    p.add_argument("--paired-rounds", type=int, default=3,
                   help="rounds of CODA (coda-graphs, else coda) and the floor back to back timed in turn after the "
                        "variants, for the target ratio (needs floor and a coda variant; 0: none)")
    p.add_argument("--logits-chunk-mib", type=int, default=None,
                   help="bound on one chunk of CODA's LM-head exponentials, MiB (default coda.LOGITS_CHUNK_BYTES)")
    args = p.parse_args()
    if args.sustain_s < 0:
        p.error(f"--sustain-s must be >= 0 seconds, got {args.sustain_s}")
    if args.paired_rounds < 0:
        p.error(f"--paired-rounds must be >= 0, got {args.paired_rounds}")
    variants = (args.variants or DEFAULT_VARIANTS).split(",")
    unknown = [v for v in variants if v not in MODEL_VARIANTS and v != "floor"]
    if unknown:
        p.error(f"unknown variants {unknown}")
    if not torch.cuda.is_available() and args.shape != "smoke":
        p.error("bench.py times GPU steps; run it on the GPU machine (only --shape smoke runs on CPU)")
    if not torch.cuda.is_available() and args.variants is None:  # the defaults that can run here, not tracebacks
        variants = [v for v in variants if v not in CUDA_ONLY]
        print(f"no CUDA device: leaving out {', '.join(CUDA_ONLY)} (they need one)", flush=True)
    elif not torch.cuda.is_available() and set(variants) & set(CUDA_ONLY):
        p.error("; ".join(f"--variants {v}: {CUDA_ONLY[v]}" for v in variants if v in CUDA_ONLY)
                + "; run it on the GPU machine or leave it out")
    from coda_train.model import coda

    if args.logits_chunk_mib is not None:
        coda.LOGITS_CHUNK_BYTES = args.logits_chunk_mib << 20
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_{args.shape}{args.tag}.json"

    def save(result: dict) -> None:
        result["logits_chunk_mib"] = coda.LOGITS_CHUNK_BYTES >> 20
        result["not_run"] = [v for v in (*MODEL_VARIANTS, "floor") if v not in variants]
        path.write_text(json.dumps(result, indent=1, default=str))

    result = run(args.shape, variants, args.iters, args.warmup, args.profile_steps, save, args.floor_quack_tuned,
                 args.sustain_s, args.paired_rounds)
    save(result)
    print_table(result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
