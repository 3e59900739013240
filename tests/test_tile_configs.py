"""The GEMM tile config table (coda_train/kernels/tile_configs.py + tile_configs.json) and the tuner
that writes it (scripts/tune_gemm.py).

CPU: config strings and legality rules, table parsing errors, lookup (table, $CODA_TILE_CONFIGS
over the shipped table, forced configs, fallback to the defaults, token-count buckets), the
tuner's candidate pruning, its list of the model's GEMMs and its table output; in subprocesses
with cutlass/quack importable (GPU-blind): every GEMM op launches with the config the lookup
gives, compile_only(gpu) reads that GPU's entries, the padded partial-sum outputs, and the
legal-tile list against quack's. GPU (marked gpu): every config of this GPU's table passes the
accuracy check of scripts/check_kernels.py on ragged shapes.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coda_train.errors import ConfigError
from coda_train.kernels import OPS, Example
from coda_train.kernels import tile_configs as T
from coda_train.kernels.tile_configs import CFG_DEFAULT, CFG_ROPE, Cfg
from coda_train.model.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
# subprocesses: GPU-blind compiles, this checkout, and no user tile cache (kernels.tune=once's)
ENV = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT),
           CODA_TILE_CACHE=os.devnull)


def load_tuner():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("tune_gemm", ROOT / "scripts" / "tune_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tune = load_tuner()


@pytest.fixture
def user_table(tmp_path, monkeypatch):
    """write(entries, gpu) -> a $CODA_TILE_CONFIGS table file in effect for the test."""

    def write(entries, gpu="H200"):
        path = tmp_path / "table.json"
        path.write_text(json.dumps({"gpus": {gpu: entries}}))
        monkeypatch.setenv(T.TABLE_ENV, str(path))
        T.reload()
        return path

    T.reload()
    yield write
    T.reload()


def test_config_strings_round_trip_and_bad_ones_say_the_form():
    for cfg in (CFG_DEFAULT, CFG_ROPE, Cfg(256, 128, 1, 2, False)):
        assert Cfg.parse(str(cfg)) == cfg
    assert str(Cfg(256, 192, 1, 2, False)) == "256x192 c1x2 cooperative"
    with pytest.raises(ValueError, match="like '128x192 c2x1 pingpong'"):
        Cfg.parse("128x192 2x1 pingpong")


def test_config_rules():
    assert T.config_errors("gemm_rowscale", CFG_DEFAULT) == []
    assert T.config_errors("matmul", None) == [] and T.config_errors("gemm_rowscale", None)
    assert "not an SM90 tile" in T.config_errors("gemm_rowscale", Cfg(256, 256, 2, 1, False))[0]
    assert "pingpong" in T.config_errors("gemm_rowscale", Cfg(256, 128, 2, 1, True))[0]  # 256-row pingpong: no
    assert T.config_errors("gemm_rowscale", Cfg(128, 192, 2, 2, True)) == []  # both operands multicast
    assert "cluster 4x2" in T.config_errors("gemm_rowscale", Cfg(128, 192, 4, 2, True))[0]  # quack: at most 4 CTAs
    # declared partial sums: one column per 128 output columns, so no narrower N tile (none in quack's SM90 list)
    assert T.STAT_TILE_N == 128 == min(n for _, n, _ in T.SM90_TILES)
    for op in ("gemm_residual_rmsnorm_partial", "gemm_dswiglu_rowscale_stat"):
        assert T.config_errors(op, Cfg(128, 128)) == [] and T.config_errors(op, Cfg(128, 256, 1, 2, False)) == []
    assert T.config_errors("gemm_rmsnorm_backward", Cfg(256, 128, 2, 1, False)) == []  # its sums fold in the op
    # the LM head's offsets: one per N tile, so its tile_N is a whole number of 128-column groups
    exp = "gemm_rowscale_exp_cross_entropy"
    assert T.config_errors(exp, Cfg(128, 256, 2, 1, False)) == [] == T.config_errors(exp, Cfg(256, 128, 1, 2, False))
    assert "multiple of 128" in T.config_errors(exp, Cfg(128, 192, 2, 1, True))[0]
    assert "multiple of 128" in T.config_errors("gemm_rowscale_rope", CFG_DEFAULT)[0]
    assert "multiple of 32" in T.config_errors("gemm_rowscale_swiglu", Cfg(128, 208))[0]
    assert "not a declared GEMM op" in T.config_errors("attention", CFG_DEFAULT)[0]
    assert all(T.config_errors(op, T.default_cfg(op)) == [] for op, o in OPS.items() if o.gemm)


def test_shape_classes_round_the_token_count_only():
    assert T.m_bucket(16384) == T.m_bucket(12000) == 16384 and T.m_bucket(11000) == 8192 and T.m_bucket(1) == 1
    assert T.shape_class("gemm_rowscale", 16000, 3072, 2048) == ("gemm_rowscale", 16384, 3072, 2048)
    # the weight gradient contracts over the tokens: K is the batch-dependent dim, M a model width
    assert T.shape_class("matmul_tn", 1280, 768, 16000) == ("matmul_tn", 1280, 768, 16384)
    assert T.shape_class("matmul_tn", 768, 768, 16384) != T.shape_class("matmul_tn", 1280, 768, 16384)


def test_lookup_table_then_defaults(user_table):
    user_table([{"op": "gemm_dswiglu_rowscale_stat", "m": 16384, "n": 8192, "k": 2048, "config": "128x256 c1x2 cooperative"},
                {"op": "matmul_tn", "m": 2048, "n": 8192, "k": 16384, "config": "256x128 c2x1 cooperative"},
                {"op": "matmul", "m": 16384, "n": 2048, "k": 2048, "config": "cublas"}])
    tuned = Cfg(128, 256, 1, 2, False)
    assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 2048, "H200") == tuned
    assert T.lookup("gemm_dswiglu_rowscale_stat", 15000, 8192, 2048, "H200") == tuned  # same token bucket
    assert T.lookup("gemm_dswiglu_rowscale_stat", 8192, 8192, 2048, "H200") == CFG_DEFAULT  # other bucket
    assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 4096, "H200") == CFG_DEFAULT  # other width
    assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 2048, "H100 PCIe") == CFG_DEFAULT  # a GPU with no entries
    assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 2048, None) == CFG_DEFAULT  # no GPU: defaults
    assert T.lookup("matmul_tn", 2048, 8192, 12000, "H200") == Cfg(256, 128, 2, 1, False)
    assert T.lookup("matmul", 16384, 2048, 2048, "H200") is None and T.lookup("matmul", 1, 8, 8, "H200") is None
    assert T.lookup("gemm_rowscale_rope", 16384, 3072, 2048, "H200") == CFG_ROPE
    with T.forced({"gemm_dswiglu_rowscale_stat": Cfg(256, 192, 2, 1, False)}):
        assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 2048, "H200") == Cfg(256, 192, 2, 1, False)
        assert T.lookup("gemm_rowscale", 16384, 8192, 2048, "H200") == CFG_DEFAULT
    assert T.lookup("gemm_dswiglu_rowscale_stat", 16384, 8192, 2048, "H200") == tuned
    with pytest.raises(ConfigError, match="not an SM90 tile"):
        with T.forced({"gemm_dswiglu_rowscale_stat": Cfg(128, 96)}):
            pass


def test_user_table_overrides_the_shipped_one_entry_by_entry(user_table):
    shipped = T.load_table(T.SHIPPED_TABLE)["H200"]
    (first, cfg), (second, cfg2) = list(shipped.items())[:2]
    op, m, n, k = first
    other = next(c for c in tune.candidates(op) if c != cfg)
    user_table([{"op": op, "m": m, "n": n, "k": k, "config": "cublas" if other is None else str(other)}])
    assert T.lookup(op, m, n, k, "H200") == other
    assert T.lookup(*second, "H200") == cfg2


@pytest.mark.parametrize("entries,words", [
    ([{"op": "gemm_rowscale", "m": 1, "n": 8}], "needs op, m, n, k and config"),
    ([{"op": "gemm_rowscale", "m": 1, "n": 8, "k": -8, "config": "128x192 c2x1 pingpong"}], "positive integers"),
    ([{"op": "gemm_rowscale", "m": 1, "n": 8, "k": 8, "config": "big"}], "is not a tile config like"),
    ([{"op": "gemm_rowscale", "m": 1, "n": 8, "k": 8, "config": "cublas"}], "only a config of"),
    ([{"op": "gemm_dswiglu_rowscale_stat", "m": 1, "n": 8, "k": 8, "config": "128x96 c2x1 pingpong"}], "not an SM90 tile"),
    ([{"op": "softmax", "m": 1, "n": 8, "k": 8, "config": "128x128 c2x1 pingpong"}], "not a declared GEMM op"),
])
def test_bad_tables_name_the_entry_and_the_fix(user_table, entries, words):
    path = user_table(entries)
    with pytest.raises(ConfigError, match=words) as e:
        T.tables()
    assert str(path) in str(e.value) and "gpus.H200[0]" in str(e.value) and "tune_gemm.py" in str(e.value)


def test_unreadable_table_says_how_to_fix(tmp_path, monkeypatch):
    T.reload()
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    monkeypatch.setenv(T.TABLE_ENV, str(bad))
    try:
        with pytest.raises(ConfigError, match="unset it"):
            T.tables()
        bad.write_text('{"H200": []}')
        T.reload()
        with pytest.raises(ConfigError, match='expected {"gpus"'):
            T.tables()
    finally:
        T.reload()


def test_shipped_table_lists_every_tuned_launch_with_a_valid_config():
    shipped = T.load_table(T.SHIPPED_TABLE)
    launches = tune.launches(list(tune.TUNED_SHAPES), None)
    assert set(shipped["H200"]) == {T.shape_class(l["op"], l["m"], l["n"], l["k"]) for l in launches}


def test_tuner_candidates_are_pruned_to_what_each_op_runs():
    gemm_ops = [n for n, o in OPS.items() if o.gemm]
    for op in gemm_ops:
        cands = tune.candidates(op)
        assert cands[0] == T.default_cfg(op) and len(set(cands)) == len(cands), op
        assert all(T.config_errors(op, c) == [] for c in cands), op
        assert (None in cands) == (op in T.PLAIN_GEMMS), op
    assert len(tune.candidates("gemm_rowscale")) == 12 and len(tune.candidates("matmul_tn")) == 13
    assert {c.tile_N for c in tune.candidates("gemm_dswiglu_rowscale_stat")} == {128, 160, 192, 256}
    assert {c.tile_N for c in tune.candidates("gemm_rowscale_rope")} == {128, 256}
    # the compile phase: one kernel per (launch, quack config), grouped by (op, config)
    launches = tune.launches(list(tune.TUNED_SHAPES), None)
    jobs = tune.compile_jobs(launches)
    assert len(jobs) == sum(len([c for c in tune.candidates(l["op"]) if c]) for l in launches)
    assert [(launches[i]["op"], str(c)) for i, c in jobs] == sorted((launches[i]["op"], str(c)) for i, c in jobs)


def test_tuner_lists_the_model_gemms_with_inputs_of_their_shape():
    """model_gemms: 11 GEMMs per block + LM head and 5 weight gradients; each input builder makes
    kwargs the reference op runs on with the GEMM shape (m, n, k) listed."""
    training_ops = {n for n, o in OPS.items() if o.gemm} - {"gemm_rowscale_cross_entropy", "gemm_rowscale"}  # evaluation only
    dims = PRESETS["tiny"].kernel_dims(24, 8)
    one_chunk = tune.model_gemms(dims)  # the LM head in one chunk: no matmul_tn_exp_add
    assert len(one_chunk) == 15 and {op for op, _, _ in one_chunk} == training_ops - {"matmul_tn_exp_add"}
    chunked = tune.model_gemms(tune.shape_dims("1b-4x4096"))  # four chunks of 4096 rows
    assert len(chunked) == 16 and {op for op, _, _ in chunked} == training_ops
    for op, (m, n, k), inputs in one_chunk:
        kw = inputs(Example(dims, torch.float32, "cpu", torch.Generator().manual_seed(0)))
        OPS[op].reference(**kw)
        assert OPS[op].gemm(**kw) == (m, n, k), op
    launches = tune.launches(["1b-4x4096", "1b-2x8192"], ["matmul_tn", "gemm_rowscale_rope"])
    assert len(launches) == 5 and all(l["shapes"] == ["1b-4x4096", "1b-2x8192"] for l in launches)


def test_tuner_output_table():
    res = lambda *ms: [{"config": str(c), "ms": ms_} for c, ms_ in zip(tune.candidates("gemm_rowscale"), ms)]  # noqa: E731
    base = dict(op="gemm_rowscale", m=16384, n=8192, k=2048, shapes=["1b-4x4096"])
    pick = tune.best_of(dict(base, results=res(1.0, 0.9, 0.95)))
    assert pick["config"] == str(tune.candidates("gemm_rowscale")[1]) and pick["default_ms"] == 1.0 and pick["best_ms"] == 0.9
    assert tune.best_of(dict(base, results=res(1.0, 0.995)))["config"] == str(CFG_DEFAULT)  # within noise
    failed = [{"config": str(CFG_DEFAULT), "error": "x"}] + res(1.0)[1:]
    assert tune.best_of(dict(base, results=failed)) is None
    table = {"about": "x", "gpus": {"H200": [dict(base, m=12000, config=str(CFG_DEFAULT)),
                                             dict(base, n=4096, config=str(CFG_DEFAULT))], "A100": []}}
    merged = tune.merged_table(table, "H200", [pick])
    assert merged["about"] == "x" and merged["gpus"]["A100"] == []
    assert [e["n"] for e in merged["gpus"]["H200"]] == [4096, 8192] and merged["gpus"]["H200"][1] is pick


def _run(stack, code: str, env=ENV, timeout=600, fresh=False):
    run = stack.run(code, env=env, timeout=timeout, fresh=fresh)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def stack(gpu_blind):
    """`python -c` GPU-blind, the GPU stack imported once (conftest.GpuBlindPython); skips without the stack."""
    return gpu_blind


def test_legal_tiles_are_quacks(stack):
    _run(stack, r'''
from quack.gemm_config import get_all_configs
from coda_train.kernels.tile_configs import SM90_CLUSTERS, SM90_TILES
sm90 = [c for c in get_all_configs() if c.device_capacity == 9]
assert {(c.tile_m, c.tile_n, c.pingpong) for c in sm90} == SM90_TILES
assert {(c.cluster_m, c.cluster_n) for c in sm90} <= SM90_CLUSTERS
''')


def test_every_gemm_op_launches_with_the_looked_up_config(stack, tmp_path):
    """Each launch of model_gemms, run GPU-blind with quack's launch stubbed, uses the forced
    config (cuBLAS: no quack launch); compile_only(gpu) reads that GPU's table entries; the
    declared partial sums keep their width with a wider N tile, zero past the kernel's columns; the
    RoPE op's one launch masks the rotation to the q/k columns."""
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"gpus": {"H200": [
        {"op": "gemm_rowscale", "m": 64, "n": 128, "k": 256, "config": "256x128 c1x2 cooperative"}]}}))
    _run(stack, r'''
import sys, torch
sys.path.insert(0, "scripts")
import tune_gemm as tune
import coda_train.kernels.cute as C
from coda_train.kernels import Example
from coda_train.kernels.cute import _launch
from coda_train.kernels.declare import n_stat_cols
from coda_train.kernels.library import CUTE_IMPLS
from coda_train.kernels.tile_configs import CFG_DEFAULT, Cfg, forced
from coda_train.model.config import PRESETS

seen, epis = [], []
def stub(mod, A, B, D, C=None, *, epi, cfg, concat=(), add_to_output=False, strip=None):
    seen.append(cfg)
    epis.append(epi)
    for v in epi.values():  # the sinks: what the kernel would write
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() == 2 and v._base is not None:
            v.fill_(1.0)
C.gemm = stub
dims = PRESETS["llama3_1b"].kernel_dims(64, 64)
with _launch.compile_only():
    for op, _, inputs in tune.model_gemms(dims):
        for cfg in tune.candidates(op)[1:3] + ([None] if op in ("matmul", "matmul_tn") else []):
            seen.clear()
            with forced({op: cfg}):
                out = CUTE_IMPLS[op].kernel(**inputs(Example(dims, torch.bfloat16, "cpu", None)))
            assert seen == ([cfg] if cfg else []), (op, cfg, seen)  # one launch per op
    inputs = next(i for op, _, i in tune.model_gemms(dims) if op == "gemm_dswiglu_rowscale_stat")  # ffn_dim 8192: 64 declared columns, 32 tiles of 256
    with forced({"gemm_dswiglu_rowscale_stat": Cfg(128, 256, 1, 2, False)}):
        g_gu, stat = C.gemm_dswiglu_rowscale_stat.kernel(**inputs(Example(dims, torch.bfloat16, "cpu", None)))
    assert stat.shape == (64, n_stat_cols(8192)) == (64, 64), stat.shape
    assert (stat[:, :32] == 1).all() and (stat[:, 32:] == 0).all()
    # F1 in one launch: the rotation mask is 1 on the q/k columns and 0 on the v columns
    inputs = next(i for op, _, i in tune.model_gemms(dims) if op == "gemm_rowscale_rope")
    epis.clear()
    C.gemm_rowscale_rope.kernel(**inputs(Example(dims, torch.bfloat16, "cpu", None)))
    rot = epis[0]["rot"]
    assert len(epis) == 1 and rot.shape == (1, dims.qkv_dim) and rot.dtype == torch.float32
    assert (rot[0, :dims.n_rope_cols] == 1).all() and (rot[0, dims.n_rope_cols:] == 0).all()
    h, r, w = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64), torch.empty(128, 256, dtype=torch.bfloat16)
for gpu, want in (("H200", Cfg(256, 128, 1, 2, False)), (None, CFG_DEFAULT), ("A100", CFG_DEFAULT)):
    seen.clear()
    with _launch.compile_only(gpu):
        C.gemm_rowscale.kernel(h, r, w)
    assert seen == [want], (gpu, seen)
print("ok")
''', env=dict(ENV, CODA_TILE_CONFIGS=str(table)))


def test_tuner_compiles_candidates_gpu_blind(stack, tmp_path, monkeypatch):
    """The tuner's compile phase in worker processes: every candidate of one op with declared
    partial sums (tile_N 128 to 256) at the 125m widths compiles, with 2x2 clusters (--clusters, both
    operands multicast) as well as the default 2x1 and 1x2."""
    run = subprocess.run([sys.executable, "scripts/tune_gemm.py", "--compile-only", "--ops", "gemm_dswiglu_rowscale_stat",
                          "--shapes", "125m", "--workers", "2", "--clusters", "2x1,1x2,2x2"],
                         env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path / "qc")), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = [ln for ln in run.stdout.splitlines() if ln.startswith("compiled")]
    assert len(tune.candidates("gemm_dswiglu_rowscale_stat")) == 12
    monkeypatch.setattr(tune, "CLUSTERS", ((2, 1), (1, 2), (2, 2)))
    assert len(compiled) == len(tune.candidates("gemm_dswiglu_rowscale_stat")) == 18, run.stdout
    assert sum(" c2x2 " in ln for ln in compiled) == 6, run.stdout


@pytest.mark.parametrize("script", ["tune_gemm.py", "check_kernels.py"])
def test_gpu_scripts_refuse_a_machine_without_one_before_any_work(script):
    """On CPU the tuner (without --compile-only) and the kernel check stop at once with a usage error
    that names the GPU machine, not after minutes of compiles or with a bare AssertionError."""
    env = {k: v for k, v in ENV.items() if k not in ("QUACK_ARCH", "CUTE_DSL_ARCH")}
    run = subprocess.run([sys.executable, f"scripts/{script}"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "run it on the GPU machine" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "compile workers" not in run.stdout, run.stdout


@pytest.mark.parametrize("args, names", [
    (["--ops", "gemm_swiglu"], ["gemm_swiglu", "gemm_rowscale_swiglu"]),
    (["--shapes", "125M"], ["125M", "125m"]),
    (["--gpu", "B200"], ["B200", "H200"]),
    (["--shapes", "125m", "--ops", "matmul_tn_exp_add"], ["125m", "matmul_tn_exp_add"]),
])
def test_register_audit_refuses_unknown_names_before_any_compile(args, names):
    """A wrong op, shape or GPU name is a usage error naming the valid choices, not a false
    "0 of 0 (op, config) kernels spill" all-clear or a bare KeyError."""
    run = subprocess.run([sys.executable, "scripts/register_audit.py", *args], env=ENV, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert all(n in run.stderr for n in names) and "Traceback" not in run.stderr, run.stderr
    assert run.stdout == "", run.stdout


@pytest.mark.gpu
def test_table_configs_pass_the_accuracy_check():
    """Every config this GPU's table lists, forced on its op's example cases at the 1B widths with
    a ragged row count (4095): the check of scripts/check_kernels.py passes."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from coda_train.kernels import op_set
    from coda_train.kernels.testing import check_case, example_cases, poisoned_cute_outputs
    from coda_train.model.testing import op_check_dims

    cute = op_set("cute")
    gpu = T.gpu_key(torch.cuda.get_device_name())
    configs = sorted({(op, cfg) for (op, *_), cfg in T.tables().get(gpu, {}).items()}, key=str)
    bad = []
    for op, cfg in configs:
        for op_, case, kwargs in example_cases(op_check_dims("llama3_1b"), "cuda", ops=[op]):
            with T.forced({op: cfg}), poisoned_cute_outputs():
                rows = check_case(op_, case, kwargs, getattr(cute, op))
            bad += [(case, str(cfg), r["out"], r["err_cute"], r["err_base"]) for r in rows if not r["ok"]]
    assert not bad, bad


def test_a_run_reports_the_gemm_shapes_the_table_lacks_and_the_tuner_tunes_exactly_those(tmp_path, caplog, user_table):
    """train.py's check (trainer/build.py): the shapes of the run's CODA step with no table entry for its
    GPU are logged with the tuning command and written to the run dir, which tune_gemm.py --launches reads."""
    from coda_train.config import TrainerConfig
    from coda_train.trainer.build import UNTUNED_FILE, report_untuned_gemms

    path = tmp_path / UNTUNED_FILE
    # llama3_1b at 4 x 4096 on the H200: the shipped table has every shape (16384 rows; 8 x 2048 is the same class)
    for batch, seq in ((4, 4096), (8, 2048)):
        assert report_untuned_gemms(PRESETS["llama3_1b"], TrainerConfig(batch_size=batch, seq_len=seq), "H200", tmp_path) == []
    assert not path.exists()
    t = TrainerConfig(batch_size=2, seq_len=64)
    with caplog.at_level("WARNING"):
        missing = report_untuned_gemms(PRESETS["tiny"], t, "H200", tmp_path)
    assert len(missing) == len({T.shape_class(op, *mnk) for op, mnk in tune.step_gemm_shapes(PRESETS["tiny"].kernel_dims(128, 64))})
    assert f"python scripts/tune_gemm.py --launches {path}" in caplog.text and "CODA_TILE_CONFIGS" in caplog.text
    todo = tune.launches([], None, str(path))
    assert sorted(T.shape_class(l["op"], l["m"], l["n"], l["k"]) for l in todo) == sorted(missing)
    dims = tune.Dims(**todo[0]["dims"])
    assert (dims.rows, dims.seq_len) == (128, 64)  # the run's batch x seq
    example = Example(dims, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert all(OPS[l["op"]].gemm(**tune.gemm_inputs(dims, l["op"], l["m"], l["n"], l["k"])(example)) == (l["m"], l["n"], l["k"])
               for l in todo)
    # once they are tuned ($CODA_TILE_CONFIGS names the tuner's table), the run reports nothing and the file goes
    user_table([dict(op=op, m=m, n=n, k=k, config="cublas" if op in T.PLAIN_GEMMS else str(T.default_cfg(op)))
                for op, m, n, k in missing])
    assert report_untuned_gemms(PRESETS["tiny"], t, "H200", tmp_path) == [] and not path.exists()


def dswiglu_audit(stack, tmp_path, loop: str) -> dict:
    """Run `loop` (code that prints json [label, usage] lines, with register_audit as A, Cfg and the
    125m dSwiGLU `launch` in scope) GPU-blind in a subprocess: {label: ptxas usage}."""
    import shutil
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas on PATH")
    (launch,) = load_tuner().launches(["125m"], ["gemm_dswiglu_rowscale_stat"])
    out = _run(stack, f'''
import json, sys
sys.path.insert(0, "scripts")
import register_audit as A
from coda_train.kernels.tile_configs import Cfg
launch = json.loads({json.dumps(json.dumps(launch))})
''' + loop, env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path / "qc")), fresh=True)  # register_audit sets CUTE_DSL_KEEP
    return dict(json.loads(line) for line in out.splitlines() if line.startswith("["))


def test_register_audit_reads_spills_gpu_blind(stack, tmp_path):
    """scripts/register_audit.py on the dSwiGLU op at the 125m widths: the 128x192 pingpong tile spills
    its epilogue (192 accumulator registers a thread leave too few), the 128x128 one does not
    (docs/kernels.md, "Register spills"); a quack or ptxas upgrade that changes this shows up here."""
    usage = dswiglu_audit(stack, tmp_path, '''
for cfg in (Cfg(128, 192), Cfg(128, 128)):
    (usage,) = A.compile_and_audit(launch, cfg)
    print(json.dumps([str(cfg), usage]))
''')
    assert usage["128x192 c2x1 pingpong"]["spill_stores"] > 0, usage
    assert usage["128x128 c2x1 pingpong"]["spill_stores"] == 0 and usage["128x128 c2x1 pingpong"]["registers"] > 0, usage


def test_register_audit_census_counts_the_epilogues_instructions_per_element(stack, tmp_path):
    """register_audit.py --census disassembles a kernel GPU-blind and counts its epilogue's SASS per accumulator element:
    the 125m dSwiGLU at 128x128 pingpong (128 elements a thread) issues three MUFU ops an element (the sigmoid's exp2 and
    reciprocal, and 1/gate for q = a / gate: docs/kernels.md, "What one epilogue issues") among ~30 instructions."""
    usage = dswiglu_audit(stack, tmp_path, '''
(usage,) = A.compile_and_audit(launch, Cfg(128, 128, 1, 2), census=True)
print(json.dumps(["op", usage]))
''')
    census = usage["op"]["epilogue"]
    assert census["by_opcode"]["MUFU"] == 3.0, census
    assert 20 < census["total"] < 45 and census["by_opcode"]["FMUL"] >= 6, census


def test_narrow_epilogue_subtile_removes_the_wide_tile_spills(stack, tmp_path):
    """scripts/epilogue_subtile.py's dSwiGLU program (16-column epilogue subtiles) compiles GPU-blind
    and spills at most a few bytes at 128x192 pingpong, where the op's own program spills (280 B of
    stores on quack 0.6.5; ~1 KB before B1 read a in place of up: docs/kernels.md, "Narrower epilogue subtiles")."""
    usage = dswiglu_audit(stack, tmp_path, '''
import epilogue_subtile as S
for name, prog in (("op", S.E.dswiglu_rowscale_stat), ("narrow", S.dswiglu_subtile)):  # 64 x 16
    S.E.dswiglu_rowscale_stat = prog  # what the op launches
    (usage,) = A.compile_and_audit(launch, Cfg(128, 192))
    print(json.dumps([name, usage]))
''')
    assert usage["op"]["spill_stores"] > 100 and usage["narrow"]["spill_stores"] <= 64, usage


def test_subtile_experiment_keeps_a_cooperative_tiles_subtile_rows(stack):
    """scripts/epilogue_subtile.py's override: 64 x 16 on a pingpong tile (one warpgroup), but a cooperative tile's
    subtile spans both warpgroups' rows (128 x 16): a 64-row one stored wrong tiles there (NaN against the default
    on the H100, 2026-12-06); SM100 keeps quack's own."""
    _run(stack, '''
import sys
sys.path.insert(0, "scripts")
import epilogue_subtile as S
store = S.SubtileStore("g_x")
assert store.epi_tile_shape_override(90, (128, 192, 64), (1, 1, 1)) == (64, 16)
assert store.epi_tile_shape_override(90, (128, 256, 64), (2, 1, 1)) == (128, 16)
assert store.epi_tile_shape_override(90, (256, 128, 64), (2, 1, 1)) == (128, 16)
assert store.epi_tile_shape_override(100, (128, 192, 64), (1, 1, 1)) is None
''')


def test_epilogue_ablation_rows_compile_gpu_blind(stack, tmp_path):
    """Every row of scripts/epilogue_ablation.py (the op from gate and a, its traffic alone, the program it
    replaced on gate and up and that program's ablations) traces and compiles GPU-blind at the 125m widths
    on the H200's configs, so the script a device session runs is known to build."""
    out = _run(stack, '''
import sys, torch
sys.path.insert(0, "scripts")
import epilogue_ablation as A
from coda_train.kernels.cute._launch import compile_only
with compile_only("H200"):
    runs, _ = A.make_runs(*A.SHAPES["125m"], torch.device("cpu"))
    for name, fn in runs.items():
        fn()
        print("compiled", name, flush=True)
''', env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path / "qc")), timeout=1200)
    compiled = [line[9:] for line in out.splitlines() if line.startswith("compiled ")]
    assert {"bare", "4 tiles", "op", "op (gate, up)", "5 tiles", "packed"} <= set(compiled), out


def test_gamma_on_load_rows_compile_gpu_blind(stack, tmp_path):
    """scripts/gamma_on_load.py's alternatives (F3/F6 without the h store, B3/B6b without γ and their g_γ reduce,
    the weight gradients with γ as a column scale and the g_γ reduce, F1 scaling x by γ as its mainloop loads it
    through quack's A transform) trace and compile
    GPU-blind at the 125m widths on the H200's configs, so the device call that measures them is known to build."""
    out = _run(stack, '''
import sys, torch
sys.path.insert(0, "scripts")
import gamma_on_load as G
from coda_train.kernels.cute._launch import compile_only
with compile_only("H200"):
    runs, _ = G.make_runs("125m", torch.device("cpu"))
    for name, fn in runs.items():
        fn()
        print("compiled", name, flush=True)
''', env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path / "qc")), timeout=1200)
    compiled = [line[9:] for line in out.splitlines() if line.startswith("compiled ")]
    assert compiled == ["F3 no h", "F6 no h", "B3 no γ", "B6b no γ", "dW_qkv γ", "dW_gu γ", "F1 γ on load"], out


def compile_dswiglu_variant(stack, variant: str, tmp_path: Path, before: str = "", after: str = "", **env) -> str:
    """Compile the 125m dSwiGLU at 128x128 pingpong GPU-blind in a subprocess with scripts/epilogue_stages.py's
    `variant` applied (`before` runs after the patch, `after` after the compile); its stdout. Each variant has a
    kernel cache of its own: quack's key does not see the patches."""
    (launch,) = load_tuner().launches(["125m"], ["gemm_dswiglu_rowscale_stat"])
    return _run(stack, f'''
import json, sys
sys.path.insert(0, "scripts")
import epilogue_stages as S
S.apply({variant!r})
{before}
from tune_gemm import compile_launch
from coda_train.kernels.cute._launch import compile_only
from coda_train.kernels.tile_configs import Cfg
with compile_only():
    compile_launch(json.loads({json.dumps(json.dumps(launch))}), Cfg(128, 128, 1, 2, True))
{after}
''', env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path / variant), **env))


def test_epilogue_stage_variants_set_the_split_they_name(stack, tmp_path):
    """scripts/epilogue_stages.py's variants, applied to the 125m dSwiGLU at 128x128 pingpong
    (GPU-blind): quack's split is (A/B, store, load) = (5, 3, 5) stages (with no D store: (5, 2, 5) while B1
    also stored a); c8 puts all 8 subtiles of loads in flight for one A/B stage, c8d hands one more A/B stage
    to the stores (docs/kernels.md, "What sets an epilogue's pace at K = 768"). A quack upgrade that changes
    the split shows up here."""
    splits = {}
    for variant in ("ship", "c8", "c8d"):
        out = compile_dswiglu_variant(stack, variant, tmp_path, before="S.print_splits()")
        (split,) = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("SPLIT ")]
        splits[variant] = [split["ab"], split["d"], split["c"]]
    assert splits == {"ship": [5, 3, 5], "c8": [4, 4, 8], "c8d": [3, 8, 8]}, splits


def test_l2_prefetch_variants_prefetch_every_epilogue_load(stack, tmp_path):
    """scripts/l2_prefetch.py (variants pf and pf1 of epilogue_stages.py), GPU-blind on the 125m
    dSwiGLU at 128x128 pingpong: the prefetch is traced into the consumer's loop for both of its tile
    loads (gate and up), and the kernel still compiles (docs/kernels.md, "Early epilogue loads, to L2")."""
    for variant in ("pf", "pf1"):
        out = compile_dswiglu_variant(stack, variant, tmp_path, before="import l2_prefetch",
                                      after='print("PREFETCHED " + json.dumps(l2_prefetch.PREFETCHED))')
        (line,) = [line for line in out.splitlines() if line.startswith("PREFETCHED ")]
        (kernel, loads), = json.loads(line[11:])
        assert "dswiglu" in kernel and loads == 2, line


def test_l2_hint_variants_mark_the_copies_they_name(stack, tmp_path):
    """scripts/l2_hints.py (variants ef, efl, abl of epilogue_stages.py), GPU-blind on the 125m dSwiGLU
    at 128x128 pingpong: ef gives every epilogue TMA copy (the gate/up loads, the D, g_gate and g_up
    stores) the evict-first L2 policy and leaves the mainloop's A/B loads at quack's default (0); abl
    gives the A/B loads evict-last and leaves the epilogue's; efl does both (docs/kernels.md, "Where the
    1B dSwiGLU's excess goes")."""
    first, last = 0x12F0000000000000, 0x14F0000000000000
    policies = {}
    for variant in ("ship", "ef", "efl", "abl"):
        dump = tmp_path / f"ptx_{variant}"
        dump.mkdir()
        compile_dswiglu_variant(stack, variant, tmp_path, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
        (ptx,) = [p.read_text() for p in dump.glob("*dswiglu*.ptx")]
        # each TMA copy's policy operand, in program order: the register it names, set by a mov.b64 of the policy
        values = dict(re.findall(r"mov\.b64\s+(%rd\d+), (\d+);", ptx))
        policies[variant] = [int(values[r]) for r in re.findall(r"cp\.async\.bulk\.tensor\.[^;]*\.L2::cache_hint [^;]*, (%rd\d+);", ptx)]
    ship, ef, efl, abl = (policies[v] for v in ("ship", "ef", "efl", "abl"))
    assert set(ship) == {0} and len(ef) == len(efl) == len(abl) == len(ship), policies
    epilogue = [p == first for p in ef]  # the copies ef marks: the epilogue's
    operands = [p == last for p in abl]  # the copies abl marks: the mainloop's
    assert sum(epilogue) >= 5 and sum(operands) >= 2, policies  # gate, up, D, g_gate, g_up; A and B
    assert all(e != o for e, o in zip(epilogue, operands)), policies  # every copy is one or the other
    assert efl == [first if e else last for e in epilogue], policies


@pytest.fixture
def tile_cache(tmp_path, monkeypatch):
    """The user's tile config cache ($CODA_TILE_CACHE) as a fresh file path for the test."""
    path = tmp_path / "cache" / "tile_configs.json"
    monkeypatch.setenv(T.CACHE_ENV, str(path))
    monkeypatch.delenv(T.TABLE_ENV, raising=False)
    T.reload()
    yield path
    T.reload()


def _entry(op, m, n, k, config):
    return dict(op=op, m=m, n=n, k=k, config=config)


def test_the_user_cache_fills_the_shipped_tables_gaps_and_the_env_file_overrides_both(tile_cache, monkeypatch, tmp_path):
    shipped = next(e for e in json.loads(T.SHIPPED_TABLE.read_text())["gpus"]["H200"] if e["op"] == "gemm_dswiglu_rowscale_stat")
    args = ("gemm_dswiglu_rowscale_stat", shipped["m"], shipped["n"], shipped["k"])
    gap = ("gemm_dswiglu_rowscale_stat", 64, 384, 128)  # a shape no table lists
    other = next(str(c) for c in (Cfg(128, 128), Cfg(128, 256, 2, 1, False)) if str(c) != shipped["config"])
    assert str(T.lookup(*args, "H200")) == shipped["config"] and not tile_cache.exists()
    assert T.lookup(*gap, "H200") == T.default_cfg(gap[0])
    T.add_to_cache("H200", [_entry(*args, other), _entry(*gap, other)])
    assert str(T.lookup(*gap, "H200")) == other  # the cache fills a gap, read again after the add
    assert str(T.lookup(*args, "H200")) == shipped["config"]  # but a (newer) shipped entry wins
    env = tmp_path / "env.json"
    env.write_text(json.dumps({"gpus": {"H200": [_entry(*args, "256x192 c2x1 cooperative"),
                                                 _entry(*gap, "256x192 c2x1 cooperative")]}}))
    monkeypatch.setenv(T.TABLE_ENV, str(env))
    T.reload()
    assert str(T.lookup(*args, "H200")) == str(T.lookup(*gap, "H200")) == "256x192 c2x1 cooperative"  # over both
    # a GPU only the cache lists
    T.add_to_cache("H100 80GB HBM3", [_entry("matmul_tn", 384, 128, 64, "cublas")])
    assert T.lookup("matmul_tn", 384, 128, 64, "H100 80GB HBM3") is None and T.untuned([("matmul_tn", (384, 128, 64))],
                                                                                       "H100 80GB HBM3") == []


def test_entries_remembered_in_a_process_fill_gaps_without_a_cache_file(tile_cache):
    gap = ("gemm_rmsnorm_backward", 4096, 64, 192)
    T.remember("H200", [_entry(*gap, "128x128 c1x2 pingpong")])
    try:
        assert str(T.lookup(*gap, "H200")) == "128x128 c1x2 pingpong" and not tile_cache.exists()
        T.reload()  # a reload keeps them: they are this process's, not a file's
        assert str(T.lookup(*gap, "H200")) == "128x128 c1x2 pingpong"
    finally:
        T.forget_tuned()
    assert T.lookup(*gap, "H200") == T.default_cfg(gap[0])


def test_adding_to_the_cache_replaces_a_shape_class_keeps_the_rest_and_refuses_bad_entries(tile_cache):
    a = _entry("gemm_rmsnorm_backward", 4096, 64, 192, "128x128 c2x1 pingpong")
    b = _entry("matmul", 4096, 192, 64, "cublas")
    assert T.add_to_cache("H200", [a, b]) == tile_cache
    T.add_to_cache("H100", [a])
    a2 = dict(a, m=4000, config="128x256 c1x2 cooperative")  # 4000 rows: the same class as 4096
    T.add_to_cache("H200", [a2])
    gpus = json.loads(tile_cache.read_text())["gpus"]
    assert gpus["H200"] == [b, a2] and gpus["H100"] == [a]
    assert not list(tile_cache.parent.glob("*.tmp")) and not tile_cache.with_name(tile_cache.name + ".lock").exists()
    before = tile_cache.read_text()
    with pytest.raises(ConfigError, match="is not an SM90 tile quack runs"):
        T.add_to_cache("H200", [_entry("gemm_rmsnorm_backward", 4096, 64, 192, "128x64 c2x1 pingpong")])
    assert tile_cache.read_text() == before  # nothing invalid gets in


def test_a_damaged_cache_is_logged_with_the_fix_and_skipped_never_fatal(tile_cache, caplog):
    tile_cache.parent.mkdir(parents=True)
    tile_cache.write_text('{"gpus": {"H200": [')
    with caplog.at_level("WARNING"):
        assert T.lookup("matmul", 4096, 192, 64, "H200") is None  # the default (cuBLAS), the run goes on
    assert str(tile_cache) in caplog.text and f"delete {tile_cache}" in caplog.text
    # one bad entry (e.g. a rule a newer version added) is skipped; the good one is used
    good = _entry("gemm_rmsnorm_backward", 4096, 64, 192, "128x128 c1x2 pingpong")
    tile_cache.write_text(json.dumps({"gpus": {"H200": [_entry("matmul", 4096, 192, 64, "huge"), good]}}))
    T.reload()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert str(T.lookup(*(good[k] for k in ("op", "m", "n", "k")), "H200")) == good["config"]
    assert "gpus.H200[0]" in caplog.text and "skipping the entry" in caplog.text
    # adding to an unreadable cache keeps the old file aside, never deletes it
    tile_cache.write_text("{broken")
    T.add_to_cache("H200", [good])
    assert tile_cache.with_name(tile_cache.name + ".corrupt").read_text() == "{broken"
    assert json.loads(tile_cache.read_text())["gpus"]["H200"] == [good]
    # bytes that are not UTF-8, and entries whose op or sizes have the wrong type: skipped the same way
    tile_cache.write_bytes(b'{"gpus": {"H200": [\xff\xfe\x00garbage')
    T.reload()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert T.lookup("matmul", 4096, 192, 64, "H200") is None
    assert str(tile_cache) in caplog.text
    bad = [dict(good, op=["matmul"]), dict(good, m=True), _entry("gemm_rowscale_exp_cross_entropy", 4096, 50304, 64,
                                                                  "128x256 c2x1 cooperative")]
    tile_cache.write_text(json.dumps({"gpus": {"H200": [*bad, good]}}))
    T.reload()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert str(T.lookup(*(good[k] for k in ("op", "m", "n", "k")), "H200")) == good["config"]
    assert "op must be an op name" in caplog.text and "m, n and k must be positive integers" in caplog.text
    assert "n=50304 (the vocabulary) is not a multiple of tile_N=256" in caplog.text


FAKE_TUNER = """
import json, sys
from pathlib import Path
from coda_train.kernels import tile_configs as T
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open(Path(sys.argv[0]).with_name("calls.txt"), "a") as f:
    f.write(args["--launches"] + "\\n")
if Path(sys.argv[0]).with_name("fail").exists():
    print("tuner exploded"); sys.exit(3)
launches = json.loads(Path(args["--launches"]).read_text())
skip = int(Path(sys.argv[0]).with_name("skip").read_text()) if Path(sys.argv[0]).with_name("skip").exists() else 0
entries = [dict(l, config="cublas" if l["op"] in T.PLAIN_GEMMS else "128x128 c1x2 pingpong" if l["op"] != "gemm_rowscale_exp_cross_entropy" else "128x128 c2x1 pingpong",
                default_ms=1.0, best_ms=0.9) for l in launches["launches"][skip:]]
table = json.loads(T.SHIPPED_TABLE.read_text())
table["gpus"][launches["gpu"]] = table["gpus"].get(launches["gpu"], []) + entries
Path(args["--out"], "tile_configs.json").write_text(json.dumps(table))
print("compile phase: ...\\n| op | shapes | m x n x k | default (ms) | best (ms) | best config | speedup |")  # as tune_gemm.py
"""


@pytest.fixture
def fake_tuner(tmp_path, monkeypatch):
    """scripts/tune_gemm.py replaced by a stand-in (same arguments and output file; no GPU): it records
    each call, fails where a `fail` file exists, and leaves the first `skip` launches untuned."""
    from coda_train.trainer import build

    path = tmp_path / "tuner" / "tune_gemm.py"
    path.parent.mkdir()
    path.write_text(FAKE_TUNER)
    monkeypatch.setattr(build, "TUNER", path)
    return path.parent


def test_tune_once_tunes_the_missing_shapes_into_the_cache_and_later_runs_reuse_them(tile_cache, fake_tuner, caplog):
    from coda_train.config import TrainerConfig
    from coda_train.trainer.build import report_untuned_gemms, tune_untuned_gemms
    from coda_train.trainer.distributed import World

    t = TrainerConfig(batch_size=2, seq_len=64)
    missing = T.untuned(tune.step_gemm_shapes(PRESETS["tiny"].kernel_dims(128, 64)), "H200")
    assert missing
    (fake_tuner / "skip").write_text("1")  # a tuner out of budget: the first shape stays untuned
    with caplog.at_level("INFO"):
        added = tune_untuned_gemms(PRESETS["tiny"], t, "H200", World())
    assert len(added) == len(missing) - 1 and f"{len(missing) - 1} of {len(missing)} shape(s) tuned" in caplog.text
    assert f"cached in {tile_cache}" in caplog.text and "| op |" in caplog.text  # the tuner's table, logged
    assert T.untuned(tune.step_gemm_shapes(PRESETS["tiny"].kernel_dims(128, 64)), "H200") == missing[:1]
    (fake_tuner / "skip").unlink()
    assert len(tune_untuned_gemms(PRESETS["tiny"], t, "H200", World())) == 1  # the next run tunes the rest
    calls = (fake_tuner / "calls.txt").read_text().split()
    assert len(calls) == 2 and not any(Path(c).exists() for c in calls)  # its input lived in a temp dir, gone
    assert tune_untuned_gemms(PRESETS["tiny"], t, "H200", World()) == []  # covered: no tuner call
    assert len((fake_tuner / "calls.txt").read_text().split()) == 2
    assert report_untuned_gemms(PRESETS["tiny"], t, "H200", tile_cache.parent) == []
    assert T.lookup(*missing[0], "H200") != T.default_cfg(missing[0][0]) or missing[0][0] in T.PLAIN_GEMMS


def test_tune_once_survives_a_failing_tuner_and_needs_a_checkout(tile_cache, fake_tuner, caplog, monkeypatch):
    from coda_train.config import TrainerConfig
    from coda_train.trainer import build
    from coda_train.trainer.distributed import World

    t = TrainerConfig(batch_size=2, seq_len=64)
    (fake_tuner / "fail").write_text("")
    with caplog.at_level("WARNING"):
        assert build.tune_untuned_gemms(PRESETS["tiny"], t, "H200", World()) == []
    assert "the tuner failed (exit 3)" in caplog.text and "tuner exploded" in caplog.text and not tile_cache.exists()
    (fake_tuner / "fail").unlink()
    calls = (fake_tuner / "calls.txt").read_text()
    assert build.tune_untuned_gemms(PRESETS["tiny"], t, "H200", World(rank=1, world_size=1, local_rank=1)) == []
    assert (fake_tuner / "calls.txt").read_text() == calls and not tile_cache.exists()  # not the main process: no tuner
    # a cache that cannot be written: logged, and this run still uses what it tuned
    monkeypatch.setenv(T.CACHE_ENV, str(fake_tuner / "calls.txt" / "cache.json"))  # under a file: not creatable
    T.reload()
    caplog.clear()
    try:
        with caplog.at_level("WARNING"):
            added = build.tune_untuned_gemms(PRESETS["tiny"], t, "H200", World())
        assert added and "could not write the tile config cache" in caplog.text
        assert T.untuned(tune.step_gemm_shapes(PRESETS["tiny"].kernel_dims(128, 64)), "H200") == []
    finally:
        T.forget_tuned()
    # no tuner script: a ConfigError on every process (rank 1 too), before any collective
    monkeypatch.setattr(build, "TUNER", fake_tuner / "missing.py")
    for world in (World(), World(rank=1, world_size=1, local_rank=1)):
        with pytest.raises(ConfigError, match="kernels.tune=once runs scripts/tune_gemm.py of a source checkout"):
            build.tune_untuned_gemms(PRESETS["tiny"], t, "H200", world)
    assert Path(build.__file__).resolve().parents[2].joinpath("scripts", "tune_gemm.py").is_file()


def test_ws_smem_budget_reads_quacks_split_gpu_blind(stack):
    """scripts/ws_smem_budget.py (the shared-memory arithmetic of docs/kernels.md's warp-specialized plan):
    at 125M, dSwiGLU's shipped 128x128 tile keeps quack's 5 A/B stages, and a 64 KB accumulator buffer
    leaves 3 at a load-stage base of 2 (the figures the plan cites)."""
    run = subprocess.run([sys.executable, "scripts/ws_smem_budget.py", "--shapes", "125m"], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in run.stdout.splitlines()
            if ln.startswith("| 125m gemm_dswiglu_rowscale_stat")]
    splits = {row[2]: row[3:7] for row in rows}
    assert splits["shipped"] == ["0", "5 x 32", "3 x 8", "5 x 8"], rows
    assert splits["warp-specialized, load base 2"] == ["64", "3 x 32", "2 x 16", "2 x 16"], rows


def test_warp_specialized_epilogue_compiles_gpu_blind(stack, tmp_path):
    """scripts/ws_epilogue.py (the warp-specialized experiment, epilogue_stages.py variant ws) rebuilds the
    125M step's 128x128 pingpong kernels with four warpgroups; B1 and RoPE compile GPU-blind, with the
    hand-over buffer taken out of the stage split (3 A/B stages at 128x128), so a broken kernel fails
    here, not on the GPU machine."""
    out = _run(stack, r'''
import sys
sys.path.insert(0, "scripts")
import torch, ws_epilogue
ws_epilogue.enable()
from quack.gemm_sm90 import GemmSm90
built = []
setup = GemmSm90._setup_attributes
def recorded(self, args):
    setup(self, args)
    built.append((self.ws, self.threads_per_cta, self.ab_stage))
GemmSm90._setup_attributes = recorded
from tune_gemm import gemm_inputs, launches
from coda_train.kernels import Dims, Example
from coda_train.kernels.cute import _launch
from coda_train.kernels.library import CUTE_IMPLS
for launch in launches(["125m"], ["gemm_dswiglu_rowscale_stat", "gemm_rowscale_rope"]):
    dims = Dims(**launch["dims"])
    kw = gemm_inputs(dims, launch["op"], launch["m"], launch["n"], launch["k"])(
        Example(dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(0)))
    with _launch.compile_only("H200"):
        CUTE_IMPLS[launch["op"]].kernel(**kw)
print("BUILT", built)
''', env=dict(ENV, QUACK_CACHE_DIR=str(tmp_path)))
    assert "BUILT [(True, 512, 3), (True, 512, 3)]" in out, out[-2000:]
