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
