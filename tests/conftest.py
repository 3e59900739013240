import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch

from coda_train.data import DataConfig, prepare


def pytest_collection_modifyitems(config, items):
    """GPU tests (marked `gpu`) run on the device machine and are skipped where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_user_tile_cache(tmp_path_factory, monkeypatch):
    """Tests read the shipped tile config table, never this machine's user cache (kernels.tune=once
    writes one under ~/.cache): $CODA_TILE_CACHE names a file no test writes unless it sets its own."""
    from coda_train.kernels import tile_configs

    monkeypatch.setenv(tile_configs.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "no_user_tile_cache.json"))
    tile_configs.reload()
    yield
    tile_configs.forget_tuned()  # and reload: a test's variables and tuned entries are gone for the next test


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> list[str]:
    """Overrides for a 2-layer dim-64 model on a prepared 60-document corpus with a 300-token BPE."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    with open(root / "corpus.jsonl", "w") as f:
        for path in stdlib:
            f.write(json.dumps({"text": path.read_text(errors="ignore")[:3000]}) + "\n")
    data = [f"data.source={root / 'corpus.jsonl'}", "data.vocab_size=300", "data.val_fraction=0.1",
            f"data.cache_dir={root / 'cache'}", "data.num_proc=1"]
    prepare(DataConfig(source=str(root / "corpus.jsonl"), vocab_size=300, val_fraction=0.1,
                       cache_dir=str(root / "cache"), num_proc=1))  # once; every run below reuses it
    return data + ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
                   "trainer.batch_size=4", "trainer.seq_len=32", "trainer.log_every=1", "trainer.eval_every=6",
                   "trainer.eval_batches=2", "optim.warmup_steps=4", "trainer.progress_bar=false"]


# The server of `GpuBlindPython`: it imports the GPU stack once, then runs each snippet it is sent in a fork of
# itself, so each snippet starts from the modules of a fresh interpreter that imported them (patches die with it).
_FORK_SERVER = r'''
import json, os, sys, tempfile, time, traceback
import torch, triton, cutlass, quack.cache, quack.epilogue.frontend  # the ~8 s every snippet would pay
replies = os.fdopen(os.dup(1), "w")
replies.write("ready\n")
replies.flush()
for request in sys.stdin:
    request = json.loads(request)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.environ.update(request["env"])
        if "QUACK_CACHE_DIR" in request["env"]:
            quack.cache.CACHE_DIR = request["env"]["QUACK_CACHE_DIR"]  # what quack reads from it at import
        code = 0
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while not (status := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    if not status[0]:
        os.kill(pid, 9)
        status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    replies.write(json.dumps(dict(returncode=os.waitstatus_to_exitcode(status[1]), timed_out=not status[0] or None,
                                  stdout=out.read().decode(errors="replace"),
                                  stderr=err.read().decode(errors="replace"))) + "\n")
    replies.flush()
'''


class GpuBlindPython:
    """`python -c code` GPU-blind (QUACK_ARCH=90, CUTE_DSL_ARCH=sm_90a) without its ~8 s of imports each time: one
    server process imports torch, triton, cutlass and quack once, and runs each snippet in a fork of itself."""

    # read by the preloaded modules at their import: a snippet that sets one gets a fresh interpreter
    READ_AT_IMPORT = ("CUTE_DSL_", "QUACK_", "TRITON_", "CUDA_")

    def __init__(self, env: dict, cwd):
        self.env, self.cwd = env, cwd
        self.errors = tempfile.TemporaryFile()  # a file, not a pipe: the server's warnings never fill it and stall it
        self.server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], env=env, cwd=cwd, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)

    def run(self, code: str, env: dict | None = None, timeout: float = 600, fresh: bool = False):
        """subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)'s result; env may differ
        from the server's. A snippet that sets a variable the preloaded modules read at import (QUACK_CACHE_DIR
        aside), or whose code sets one itself (`fresh`: register_audit.py sets CUTE_DSL_KEEP), runs in a fresh
        interpreter."""
        env = env or self.env
        extra = {k: v for k, v in env.items() if self.env.get(k) != v}
        if fresh or any(k.startswith(self.READ_AT_IMPORT) and k != "QUACK_CACHE_DIR" for k in extra):  # too late in a fork
            return subprocess.run([sys.executable, "-c", code], env=env, cwd=self.cwd, capture_output=True, text=True,
                                  timeout=timeout)
        self.server.stdin.write(json.dumps(dict(code=code, env=extra, timeout=timeout)) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        if not reply:
            self.errors.seek(0)
            raise RuntimeError("the GPU-blind fork server died: " + self.errors.read().decode(errors="replace")[-3000:])
        reply = json.loads(reply)
        if reply.pop("timed_out"):
            raise subprocess.TimeoutExpired(code, timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(code, reply.pop("returncode"), **reply)

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)
        self.errors.close()


def _gpu_blind_python(**env):
    """A GpuBlindPython with these variables set beside the GPU-blind ones, closed after; skips where cutlass /
    quack / triton are not importable."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(root),
               CODA_TILE_CACHE=os.devnull, **env)
    python = GpuBlindPython(env, root)
    if python.server.stdout.readline() != "ready\n":  # its imports failed
        python.close()
        pytest.skip("cutlass / quack (nvidia-cutlass-dsl, quack-kernels, triton) are not importable here")
    yield python
    python.close()


@pytest.fixture(scope="session")
def gpu_blind():
    """One GpuBlindPython for the session."""
    yield from _gpu_blind_python()


@pytest.fixture(scope="session")
def gpu_blind_triton_interpreter():
    """One GpuBlindPython with TRITON_INTERPRET=1 (Triton kernels on CPU tensors) for the session."""
    yield from _gpu_blind_python(TRITON_INTERPRET="1")
