"""Which tile config each cute GEMM launches with: a table per GPU and shape, shipped with the
package (tile_configs.json, written by scripts/tune_gemm.py on that GPU), with safe defaults for
any GPU or shape the table does not list. Imports neither cutlass nor quack (CPU-testable).

A table entry is keyed by GPU, op and shape class: the GPU as `gpu_key(torch.cuda.get_device_name())`
("H200"), the op's name, and the GEMM D[M, N] = A[M, K] B[K, N] with the token count
(M; K for the weight gradient `matmul_tn`) rounded to the nearest power of two and the other two
dims, model widths, exact (`shape_class`). Its value is a `Cfg` ("128x192 c2x1 pingpong") or, for the
plain GEMMs `matmul` / `matmul_tn`, "cublas". The user's cache (`cache_path()`, which
`kernels.tune=once` fills with the shapes a run needed and the table lacked) fills the shipped
table's gaps; the file named by $CODA_TILE_CONFIGS (a tune run's output) overrides both entry by
entry. docs/kernels.md describes the format.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..durable import exclusive_lock, replace_synced
from ..errors import ConfigError
from .declare import OPS, STAT_TILE_N

log = logging.getLogger(__name__)
SHIPPED_TABLE = Path(__file__).with_name("tile_configs.json")
TABLE_ENV = "CODA_TILE_CONFIGS"
CACHE_ENV = "CODA_TILE_CACHE"  # the user's cache file; default under $XDG_CACHE_HOME or ~/.cache
# kernels.tune: off = a GEMM shape the table lacks runs default_cfg (logged, with the tuning command);
# once = the run tunes such shapes before it starts and adds them to the user's cache, read by every later run
TUNE = ("off", "once")
CUBLAS = "cublas"  # a plain GEMM's table value when torch.matmul (cuBLAS) is the faster one


@dataclass(frozen=True)
class Cfg:
    """One quack SM90 GEMM config: CTA tile, thread-block cluster, pingpong (two consumer warpgroups
    on alternate tiles) or cooperative (both on one tile)."""

    tile_M: int
    tile_N: int
    cluster_M: int = 2
    cluster_N: int = 1
    pingpong: bool = True

    def __str__(self) -> str:
        return (f"{self.tile_M}x{self.tile_N} c{self.cluster_M}x{self.cluster_N} "
                f"{'pingpong' if self.pingpong else 'cooperative'}")

    @staticmethod
    def parse(text: str) -> "Cfg":
        """The inverse of str(): '128x192 c2x1 pingpong' / '256x128 c1x2 cooperative'."""
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s+c(\d+)x(\d+)\s+(pingpong|cooperative)\s*", text)
        if not m:
            raise ValueError(f"{text!r} is not a tile config like '128x192 c2x1 pingpong' or '256x128 c1x2 cooperative'")
        return Cfg(int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5] == "pingpong")


# quack's SM90 default (128x192, 2x1 cluster, pingpong) for every program except RoPE, whose
# cos/sin table op needs tile_N to be a multiple or a divisor of head_dim (64 or 128 here).
CFG_DEFAULT = Cfg(128, 192)
CFG_ROPE = Cfg(128, 128)
# The LM head's three GEMMs (H, H''), as quack's scaled-exp linear cross-entropy runs them: the logits
# GEMM's N tile (a multiple of STAT_TILE_N) shares one offset; the strip GEMMs scale A in a
# cooperative register-sourced mainloop.
CFG_EXP = {"gemm_rowscale_exp_cross_entropy": Cfg(128, STAT_TILE_N, 2, 1, True),
           "gemm_exp_rmsnorm_backward": Cfg(128, 256, 2, 1, False),
           "matmul_tn_exp": Cfg(128, 256, 2, 1, False), "matmul_tn_exp_add": Cfg(128, 256, 2, 1, False)}
PLAIN_GEMMS = ("matmul", "matmul_tn")  # cuBLAS unless the table names a quack config
TOKENS_IN_K = ("matmul_tn", "matmul_tn_exp", "matmul_tn_exp_add")  # weight gradients: the token dim is K
STRIP_GEMMS = ("gemm_exp_rmsnorm_backward", "matmul_tn_exp", "matmul_tn_exp_add")  # A scaled by a strip (H'')

# The (tile_M, tile_N, pingpong) quack 0.6.5 runs on SM90 (its autotuner's list,
# quack.gemm_config.get_all_configs; tests/test_tile_configs.py keeps the two in step) and the
# clusters its SM90 kernel takes (powers of 2, at most 4 CTAs; its autotuner tries 2x1 and 1x2).
SM90_TILES = frozenset([(128, n, True) for n in (128, 160, 192, 208)] + [(192, 128, True)]
                       + [(256, n, False) for n in (128, 160, 192, 208)] + [(128, 224, False), (128, 256, False)])
SM90_CLUSTERS = frozenset([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
# tile_N multiples some programs need: the RoPE table tiling (any head_dim the limits allow), and
# quack's paired accumulators with extra tile stores (the SwiGLU epilogue).
TILE_N_MULTIPLE = {"gemm_rowscale_rope": 128, "gemm_rowscale_swiglu": 32}


def default_cfg(op: str) -> Optional[Cfg]:
    """The config of `op` on a GPU or shape the table does not list (None: cuBLAS)."""
    if op in PLAIN_GEMMS:
        return None
    return CFG_ROPE if op == "gemm_rowscale_rope" else CFG_EXP.get(op, CFG_DEFAULT)


def config_errors(op: str, cfg: Optional[Cfg]) -> list[str]:
    """Why `op` cannot run with `cfg` ([] = it can). Ops with declared partial-sum outputs write
    them at the declared width (one column per STAT_TILE_N columns, zero-padded), so their N tile
    may not be narrower."""
    if op not in OPS or OPS[op].gemm is None:
        return [f"{op!r} is not a declared GEMM op (one of {sorted(n for n, o in OPS.items() if o.gemm)})"]
    if cfg is None:
        return [] if op in PLAIN_GEMMS else [f"{op}: '{CUBLAS}' is only a config of {list(PLAIN_GEMMS)}"]
    errors = []
    if (cfg.tile_M, cfg.tile_N, cfg.pingpong) not in SM90_TILES:
        legal = ", ".join(f"{m}x{n} {'pingpong' if p else 'cooperative'}" for m, n, p in sorted(SM90_TILES))
        errors.append(f"{op}: tile {cfg} is not an SM90 tile quack runs ({legal})")
    if (cfg.cluster_M, cfg.cluster_N) not in SM90_CLUSTERS:
        legal = ", ".join(f"{m}x{n}" for m, n in sorted(SM90_CLUSTERS))
        errors.append(f"{op}: cluster {cfg.cluster_M}x{cfg.cluster_N} must be one of {legal}")
    if OPS[op].partials and cfg.tile_N < STAT_TILE_N:
        errors.append(f"{op}: tile_N={cfg.tile_N} must be >= {STAT_TILE_N} (its partial sums have one "
                      f"column per {STAT_TILE_N} output columns)")
    if cfg.tile_N % TILE_N_MULTIPLE.get(op, 1):
        errors.append(f"{op}: tile_N={cfg.tile_N} must be a multiple of {TILE_N_MULTIPLE[op]}")
    if op in STRIP_GEMMS and cfg.tile_M != 128:
        errors.append(f"{op}: tile_M={cfg.tile_M} must be 128 (the strip's rows, and the vocabulary's multiple)")
    if op == "gemm_rowscale_exp_cross_entropy" and cfg.tile_N % STAT_TILE_N:
        errors.append(f"{op}: tile_N={cfg.tile_N} must be a multiple of {STAT_TILE_N} (one power-of-two offset "
                      f"per N tile, shared by its {STAT_TILE_N}-column groups)")
    return errors


def gpu_key(device_name: str) -> str:
    """The table's name of a GPU: torch.cuda.get_device_name() without the vendor ('NVIDIA H200' -> 'H200')."""
    return re.sub(r"^NVIDIA\s+", "", device_name.strip())


def m_bucket(m: int) -> int:
    """A token count rounded to the nearest power of two."""
    return 1 << max(0, round(math.log2(max(m, 1))))


Key = tuple[str, int, int, int]  # (op, M, N, K), the token dim bucketed


def shape_class(op: str, m: int, n: int, k: int) -> Key:
    """The table key of `op`'s GEMM (m, n, k): the token dim (it varies with the batch) rounded by
    m_bucket, the model widths exact. Tokens are K in the weight gradients (matmul_tn, the LM head's
    matmul_tn_exp / _add), M elsewhere."""
    return (op, m, n, m_bucket(k)) if op in TOKENS_IN_K else (op, m_bucket(m), n, k)


def _entry_error(e) -> Optional[str]:
    """What is wrong with one table entry, or None."""
    if not isinstance(e, dict) or not {"op", "m", "n", "k", "config"} <= set(e):
        return f"an entry needs op, m, n, k and config, got {e!r}"
    if not isinstance(e["op"], str):
        return f"op must be an op name (a string), got {e!r}"
    if not all(isinstance(e[d], int) and not isinstance(e[d], bool) and e[d] > 0 for d in "mnk"):
        return f"m, n and k must be positive integers, got {e!r}"
    try:
        cfg = None if e["config"] == CUBLAS else Cfg.parse(e["config"])
    except (ValueError, TypeError) as ex:
        return str(ex)
    errors = config_errors(e["op"], cfg)
    if e["op"] == "gemm_rowscale_exp_cross_entropy" and cfg is not None and e["n"] % cfg.tile_N:
        errors.append(f"its n={e['n']} (the vocabulary) is not a multiple of tile_N={cfg.tile_N}")  # one offset per N tile
    return "; ".join(errors) or None


def parse_entries(entries: list, where: str, skip_fix: Optional[str] = None) -> dict[Key, Optional[Cfg]]:
    """{shape_class: config} of one GPU's entry list; an invalid entry is a ConfigError naming `where`
    and the fix, or with `skip_fix` a warning naming that fix, and is left out."""
    table = {}
    for i, e in enumerate(entries if isinstance(entries, list) else [entries]):
        error = _entry_error(e)
        if error and skip_fix:
            log.warning("tile config table %s[%d]: %s; skipping the entry (%s)", where, i, error, skip_fix)
            continue
        if error:
            raise ConfigError(f"tile config table {where}[{i}]: {error}; fix or delete the entry "
                              "(scripts/tune_gemm.py writes valid tables)")
        table[shape_class(e["op"], e["m"], e["n"], e["k"])] = None if e["config"] == CUBLAS else Cfg.parse(e["config"])
    return table


_ENV_FIX = f"point ${TABLE_ENV} at a file written by scripts/tune_gemm.py, or unset it"


def _read_table_file(path, fix: str) -> dict:
    """A table file's JSON ({"gpus": {GPU: [entry, ...]}}); ConfigError naming the file and `fix`."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bytes that are not UTF-8
        raise ConfigError(f"cannot read the tile config table {path}: {e}; {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise ConfigError(f"tile config table {path}: expected {{\"gpus\": {{GPU name: [entries]}}}}; {fix}")
    return data


def load_table(path) -> dict[str, dict[Key, Optional[Cfg]]]:
    """{GPU: {shape_class: config}} from a table file ({"gpus": {GPU: [entry, ...]}})."""
    data = _read_table_file(path, _ENV_FIX)
    return {gpu: parse_entries(entries, f"{path}: gpus.{gpu}") for gpu, entries in data["gpus"].items()}


def cache_path() -> Path:
    """The user's tile config cache: $CODA_TILE_CACHE, else $XDG_CACHE_HOME (default ~/.cache)
    /coda_train/tile_configs.json. kernels.tune=once adds to it; every run reads it if it exists."""
    return _cache_path(os.environ.get(CACHE_ENV) or None, os.environ.get("XDG_CACHE_HOME") or None)


def _cache_path(explicit: Optional[str], xdg: Optional[str]) -> Path:
    if explicit:
        return Path(explicit)
    return Path(xdg or Path.home() / ".cache") / "coda_train" / "tile_configs.json"


def _cache_fix(path) -> str:
    return f"delete {path} (kernels.tune=once writes it again) or point ${CACHE_ENV} elsewhere"


def _load_cache(path: Path) -> dict[str, dict[Key, Optional[Cfg]]]:
    """The user's cache as a table; machine-written, so a damaged file or entry (e.g. one the rules of
    a newer version refuse) is logged with the fix and skipped, never stops a run."""
    try:
        data = _read_table_file(path, _cache_fix(path))
    except ConfigError as e:
        log.warning("%s; ignoring it", e)
        return {}
    return {gpu: parse_entries(entries, f"{path}: gpus.{gpu}", skip_fix=_cache_fix(path)) for gpu, entries in data["gpus"].items()}


@functools.lru_cache(maxsize=None)
def _tables(user_path: Optional[str], cache_env: Optional[str], xdg: Optional[str]) -> dict[str, dict[Key, Optional[Cfg]]]:
    cache = _cache_path(cache_env, xdg)
    layers = [_load_cache(cache)] if cache.is_file() else []
    layers += [load_table(SHIPPED_TABLE)] + ([load_table(user_path)] if user_path else [])
    tables: dict[str, dict[Key, Optional[Cfg]]] = {}
    for layer in layers:  # each over the ones before it
        for gpu, entries in layer.items():
            tables[gpu] = {**tables.get(gpu, {}), **entries}
    return tables


_current: Optional[dict[str, dict[Key, Optional[Cfg]]]] = None  # tables() as first read: every GEMM launch asks
_tuned_here: dict[str, dict[Key, Optional[Cfg]]] = {}  # remember(): this process's tuned entries


def tables() -> dict[str, dict[Key, Optional[Cfg]]]:
    """The user's cache, the shipped table over it (the cache only fills its gaps, so a newer shipped
    table wins), $CODA_TILE_CONFIGS's entries over both; entries this process tuned (remember()) fill
    the remaining gaps. Files and variables read at the first call; reload() reads them again."""
    global _current
    if _current is None:
        env = os.environ
        merged = _tables(env.get(TABLE_ENV) or None, env.get(CACHE_ENV) or None, env.get("XDG_CACHE_HOME") or None)
        _current = {gpu: {**_tuned_here.get(gpu, {}), **merged.get(gpu, {})} for gpu in {*merged, *_tuned_here}}
    return _current


def reload() -> None:
    """Read the table files and their variables again at the next lookup (after a tune, or a change of
    $CODA_TILE_CONFIGS / $CODA_TILE_CACHE)."""
    global _current
    _current = None
    _tables.cache_clear()


def remember(gpu: str, entries: list[dict]) -> None:
    """Use these table entries (a tune's) in this process, whatever becomes of the cache file."""
    _tuned_here.setdefault(gpu, {}).update(parse_entries(entries, f"tuned entries for {gpu}"))
    reload()


def forget_tuned() -> None:
    """Drop what remember() added (tests)."""
    _tuned_here.clear()
    reload()


def merge_entries(old: list, new: list[dict]) -> list:
    """A GPU's entry list `old` with its entries of the shape classes in `new` replaced by `new`'s
    (entries too damaged to key are kept as they are: the loaders report them)."""
    key = lambda e: shape_class(e["op"], e["m"], e["n"], e["k"])  # noqa: E731
    replaced = {key(e) for e in new}
    return [e for e in old if _entry_error(e) or key(e) not in replaced] + list(new)


def add_to_cache(gpu: str, entries: list[dict]) -> Path:
    """Merge table entries (scripts/tune_gemm.py's) into `gpu`'s list of the user's cache, replacing
    entries of the same shape class; under a lock, written whole and renamed into place, so concurrent
    runs and a crash leave a complete file (an unreadable one is kept aside as <name>.corrupt).
    Returns the cache's path; OSError if it cannot be written."""
    path = cache_path()
    parse_entries(entries, f"entries for {path}")  # nothing invalid gets in
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_name(path.name + ".lock"), wait=True):
        try:
            data = _read_table_file(path, _cache_fix(path)) if path.is_file() else {"gpus": {}}
        except ConfigError:
            os.replace(path, path.with_name(path.name + ".corrupt"))
            data = {"gpus": {}}
        old = data["gpus"].get(gpu, [])
        data["gpus"][gpu] = merge_entries(old if isinstance(old, list) else [], entries)
        replace_synced(path, (json.dumps(data, indent=1) + "\n").encode())
    reload()
    return path


_forced: dict[str, Optional[Cfg]] = {}


@contextlib.contextmanager
def forced(configs: dict[str, Optional[Cfg]]) -> Iterator[None]:
    """Every launch of the ops named in `configs` uses the given config, whatever the shape (the
    tuner's candidates, compile checks); configs are checked with config_errors first."""
    errors = [msg for op, cfg in configs.items() for msg in config_errors(op, cfg)]
    if errors:
        raise ConfigError("; ".join(errors))
    saved = dict(_forced)
    _forced.update(configs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def lookup(op: str, m: int, n: int, k: int, gpu: Optional[str]) -> Optional[Cfg]:
    """The config of `op`'s GEMM of shape (m, n, k) on `gpu` (None: the defaults): a forced one,
    else the table's, else default_cfg(op). None means cuBLAS (plain GEMMs only)."""
    if op in _forced:
        return _forced[op]
    table = tables().get(gpu, {}) if gpu is not None else {}
    return table.get(shape_class(op, m, n, k), default_cfg(op))


def untuned(shapes: list[tuple[str, tuple[int, int, int]]], gpu: str) -> list[Key]:
    """The distinct shape classes of `shapes` ((op, (m, n, k)) launches) that the table has no entry
    for on `gpu`: they run default_cfg(op) (quack's default, or cuBLAS for the plain GEMMs)."""
    table = tables().get(gpu, {})
    keys = dict.fromkeys(shape_class(op, m, n, k) for op, (m, n, k) in shapes)
    return [key for key in keys if key not in table]
