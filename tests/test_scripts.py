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
MODULES = {"code_version.py", "two_epilogues.py", "ws_epilogue.py", "l2_prefetch.py", "l2_hints.py", "palette_png.py", "fa4_peer.py"}


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


def _doc_spans(doc: str) -> list[str]:
    """The code of a markdown file: each line of its code blocks (a line ending in a backslash joined to the next)
    and each inline code span (which may wrap across lines)."""
    import re

    text = (ROOT / doc).read_text()
    spans = [line for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return spans + re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _readme_commands(script: str, doc: str = "README.md") -> list[str]:
    """Every `python scripts/<script> ...` command line in README.md (or doc), from the script's path on, without a
    trailing comment."""
    return [" ".join(span[span.index(f"scripts/{script}"):].split()) for span in _doc_spans(doc)
            if f"scripts/{script} " in span]


class _Parsed(Exception):
    """Raised with the namespace a script's parser returned, so that its main() stops there."""


def _stop_after_parsing(monkeypatch):
    import argparse

    parse_args = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)


# placeholders the README's command lines use for a value the reader picks
PLACEHOLDERS = {"S": "125m", "SHAPE": "125m", "DIR": "runs/x", "RUN_DIR/untuned_gemms.json": "runs/x/untuned_gemms.json"}


@pytest.mark.parametrize("script", ["bench.py", "tune_gemm.py"])
def test_readme_command_lines_parse(script, monkeypatch):
    """README.md's bench.py and tune_gemm.py command lines name flags, shapes, variants and ops the scripts still
    take: a renamed one fails here, not on the GPU machine (only the parsers run; neither script imports quack
    or cutlass at import)."""
    import shlex

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    module = __import__(script[:-3])
    _stop_after_parsing(monkeypatch)
    commands = _readme_commands(script)
    assert commands, f"no scripts/{script} command line found in README.md"
    for command in commands:
        argv = [PLACEHOLDERS.get(arg, arg) for arg in shlex.split(command, comments=True)[1:]]
        if script == "bench.py" and "--shape" not in argv:  # prose naming a flag of the script, not a command
            continue
        monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
        try:
            module.main()
        except _Parsed as parsed:
            args = parsed.args[0]
        except SystemExit:
            pytest.fail(f"README.md: `{command}` does not parse (scripts/{script} exits 2)")
        else:
            pytest.fail(f"scripts/{script}'s main() returned without parsing its arguments")
        if script == "bench.py":  # checked after parsing, as bench.py's main does
            unknown = [v for v in (args.variants or "").split(",") if v and v not in {*module.MODEL_VARIANTS, "floor"}]
        else:
            known_ops = {op for name in module.SHAPES for op, _ in module.step_gemm_shapes(module.shape_dims(name))}
            unknown = ([s for s in args.shapes.split(",") if s and s not in module.SHAPES]
                       + [o for o in args.ops.split(",") if o and o not in known_ops])
        assert not unknown, f"README.md: `{command}` names {unknown}, which scripts/{script} does not know"


# the pages of docs/ whose command lines a reader runs as written: launches, comparisons, the device calls they name
DOCS = ["docs/distributed.md", "docs/loss_curves.md"]


def _train_commands(doc: str) -> list[list[str]]:
    """The arguments of every `train.py ...` command line of doc (python or torchrun), without a trailing comment and
    with its placeholders (`[other overrides]`, `$RUNS`) left out."""
    import shlex

    commands = []
    for span in _doc_spans(doc):
        if "train.py " in span and ("python" in span or "torchrun" in span):
            argv = shlex.split(span[span.index("train.py ") + len("train.py "):].replace("[other overrides]", ""),
                               comments=True)
            commands.append([a for a in argv if "$" not in a])
    return commands


@pytest.mark.parametrize("doc", DOCS)
def test_doc_train_command_lines_compose_and_pass_the_start_checks(doc, monkeypatch):
    """docs/distributed.md's and docs/loss_curves.md's train.py command lines (every job of a sweep) compose and pass
    the checks a run makes before its data, as `--cfg job` and a sweep's check make them: a renamed key or preset,
    or a value a run would refuse, fails here, not on the GPU machine."""
    import importlib.util
    import itertools

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from coda_train.config import to_dataclass

    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location("train_for_docs", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    commands = _train_commands(doc)
    assert commands, f"no train.py command line found in {doc}"
    with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3", job_name=train.JOB_NAME):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        for argv in commands:
            sweep = "-m" in argv or "--multirun" in argv
            parsed = parser.parse_overrides([a for a in argv if not a.startswith("-")])
            values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                      else [o.input_line] for o in parsed]
            assert sweep or all(len(v) == 1 for v in values), f"{doc}: `train.py {' '.join(argv)}` sweeps without -m"
            for job, overrides in enumerate(itertools.product(*values)):
                try:
                    train.check_config_and_model(to_dataclass(train.compose_job(list(overrides), job if sweep else None)))
                except Exception as e:
                    pytest.fail(f"{doc}: `train.py {' '.join(argv)}` (job {' '.join(overrides)}) is refused: {e}")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_script_command_lines_parse(doc, monkeypatch):
    """The scripts/*.py command lines of docs/distributed.md and docs/loss_curves.md name flags the scripts take."""
    import re
    import shlex

    scripts = sorted({m for span in _doc_spans(doc) for m in re.findall(r"scripts/(\w+\.py) ", span)})
    assert scripts, f"no scripts/*.py command line found in {doc}"
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    _stop_after_parsing(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")  # fsdp_overlap_profile.py's lines run under torchrun
    for script in scripts:
        module = __import__(script[:-3])
        for command in _readme_commands(script, doc):
            argv = [a.replace("$RUNS", "runs/x") for a in shlex.split(command, comments=True)[1:]]
            monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
            try:
                module.main()
            except _Parsed:
                continue
            except SystemExit:
                pytest.fail(f"{doc}: `{command}` does not parse (scripts/{script} exits 2)")
            pytest.fail(f"scripts/{script}'s main() returned without parsing its arguments")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_shell_command_lines_name_scripts_and_settings_that_exist(doc):
    """`VAR=value bash scripts/x.sh` in docs/distributed.md and docs/loss_curves.md: the script exists and reads
    each variable set before it (a renamed one would be ignored silently on the GPU machine)."""
    import re

    commands = [m for span in _doc_spans(doc) for m in re.findall(r"((?:[A-Z0-9_]+=\S+ )*)bash (scripts/\S+\.sh)", span)]
    assert commands, f"no bash scripts/*.sh command line found in {doc}"
    for settings, script in commands:
        assert (ROOT / script).is_file(), f"{doc} names {script}, which does not exist"
        text = (ROOT / script).read_text()
        for name in re.findall(r"([A-Z0-9_]+)=", settings):
            assert "${" + name in text or "$" + name in text, f"{doc}: {script} does not read {name}"


def test_fsdp_overlap_profile_without_a_gpu_stops_with_one_line(tmp_path):
    """docs/distributed.md's overlap command (llama3_1b, 4 layers, 2 x 4 x 2048) on a CPU machine ran for minutes and was
    OOM-killed (a torchrun traceback), or on a smaller preset reported zeros: gloo runs no device kernels."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    proc = subprocess.run([sys.executable, "scripts/fsdp_overlap_profile.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "GPU" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_bench_prepare_names_its_text_rate_in_characters(tmp_path, monkeypatch, capsys):
    """bench_prepare.py's rate of text is the manifest's characters a second: it was headed MB/s (and written as
    mb_per_s), which non-ASCII text (1 to 4 bytes a character) makes wrong."""
    import json
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_prepare

    manifest = {"seconds": {"tokenizer": 0.5}, "num_documents": 2, "num_characters": 3_000_000, "num_tokens": 1_000_000}
    monkeypatch.setattr(bench_prepare, "prepare", lambda cfg: SimpleNamespace(manifest=manifest, path=tmp_path))
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_prepare.py", "--num-proc", "1", "--out", str(out)])
    bench_prepare.main()
    printed = capsys.readouterr().out
    assert "Mchar/s" in printed and "MB/s" not in printed, printed
    rows = json.loads(out.read_text())["rows"]
    assert all("mchars_per_s" in row and "mb_per_s" not in row for row in rows), rows
