"""Every script in scripts/ imports and parses its arguments on a CPU machine (`--help`): most of them
run only on the GPU machine, where an import error would cost a device call."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
# imported by other scripts, with no command line of their own: running one checks that it imports
MODULES = {"code_version.py", "two_epilogues.py", "l2_prefetch.py", "l2_hints.py", "palette_png.py", "fa4_peer.py"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs_without_a_gpu(script):
    proc = subprocess.run([sys.executable, f"scripts/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout or script in MODULES, proc.stdout[-500:]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.sh")))
def test_shell_script_parses(script):
    """The device-call scripts (scripts/*.sh) run only on the GPU machine: a syntax error would cost a call."""
    proc = subprocess.run(["bash", "-n", f"scripts/{script}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


# the scripts that time CUDA kernels, with the arguments they require: on a machine without one they stop
# with one line naming why, before any work
GPU_ONLY = {"bench.py": ["--shape", "125m"], "bench_elementwise.py": [], "bench_kernels.py": [], "bench_lm_head.py": [],
            "bench_optimizer.py": [], "check_kernels.py": [], "epilogue_ablation.py": [], "epilogue_stages.py": [],
            "epilogue_subtile.py": [], "gamma_on_load.py": [], "memory_profile.py": ["--shape", "125m"], "tune_gemm.py": []}


@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_only_script_stops_with_one_line_without_a_gpu(script, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    proc = subprocess.run([sys.executable, f"scripts/{script}", *GPU_ONLY[script], "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "GPU" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_fsdp_overlap_profile_without_torchrun_says_to_launch_it_with_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "scripts/fsdp_overlap_profile.py", "--out", str(tmp_path), "--preset", "tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "torchrun" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
