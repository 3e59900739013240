"""Registers and local-memory spills of the cute GEMM kernels a CODA step launches, GPU-blind: each
(op, tile config) is compiled on CPU tensors (QUACK_ARCH=90), its PTX kept, and `ptxas -v` reports
what the SASS uses. A consumer warpgroup that spills its epilogue values to local memory runs the
epilogue several times slower, which no mainloop can hide (docs/kernels.md, "Register spills").

    QUACK_ARCH=90 CUTE_DSL_ARCH=sm_90a python scripts/register_audit.py [--shapes 125m,1b-4x4096,8b-slice]
        [--gpu H200] [--configs table|candidates] [--ops OP,...] [--census] [--out DIR]

--configs table: the config each launch runs on --gpu (the shipped table, else the default);
--configs candidates: every candidate config tune_gemm.py tries for the op. --census: also each kernel's
epilogue instructions per accumulator element, by opcode, from its SASS (nvdisasm: PATH or triton's).
Needs ptxas (CUDA 12.8+) on PATH. Prints a table and writes register_audit.json under --out.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# CuTeDSL reads its dump settings at import: keep every kernel's PTX in a fresh folder.
_DUMP = tempfile.mkdtemp(prefix="register_audit_")
atexit.register(shutil.rmtree, _DUMP, ignore_errors=True)
os.environ.update(QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=_DUMP,
                  QUACK_CACHE_DIR=os.path.join(_DUMP, "cache"), CUDA_VISIBLE_DEVICES="")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_gemm import SHAPES, candidates, compile_launch, launches, shape_dims  # noqa: E402

from coda_train.kernels.tile_configs import lookup, tables  # noqa: E402
from coda_train.model.coda import step_gemm_shapes  # noqa: E402

_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers",
                    re.S)


def _ptx_for_local_ptxas(text: str) -> str:
    """CuTeDSL may emit a newer PTX ISA version than the local ptxas reads; the sm_90a code it uses is older."""
    m = re.search(r"^\.version (\d+)\.(\d+)", text, re.M)
    return text.replace(m[0], ".version 8.7", 1) if m else text


def ptxas_usage(ptx: Path) -> dict:
    """{registers, spill_stores, spill_loads, stack} of one kernel's PTX, from `ptxas -v` for sm_90a."""
    text = _ptx_for_local_ptxas(ptx.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(text)
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o", os.devnull], capture_output=True, text=True)
    found = _PTXAS.search(run.stderr)
    if run.returncode or not found:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {run.stderr[-600:]}")
    stack, stores, loads, regs = map(int, found.groups())
    return {"registers": regs, "spill_stores": stores, "spill_loads": loads, "stack": stack}


def _nvdisasm() -> str:
    """nvdisasm from PATH, else the one triton ships with its CUDA tools."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    import triton

    bundled = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    if not bundled.exists():
        raise RuntimeError("no nvdisasm on PATH or in triton's CUDA tools")
    return str(bundled)


def sass(ptx: Path) -> str:
    """The sm_90a SASS of one kernel's PTX (ptxas to a cubin, then nvdisasm)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(_ptx_for_local_ptxas(ptx.read_text()))
        subprocess.run(["ptxas", "-arch=sm_90a", str(src), "-o", str(cubin)], check=True, capture_output=True)
        return subprocess.run([_nvdisasm(), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", re.M)


def epilogue_census(text: str, elements_per_thread: int) -> dict:
    """Instructions a thread issues per accumulator element after the kernel's last HGMMA (its epilogue, unrolled
    over the tile), by opcode: what one consumer warpgroup's epilogue costs in issue slots (docs/kernels.md)."""
    ops = _SASS_OP.findall(text.split("HGMMA")[-1])
    counts = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    per = {op: n / elements_per_thread for op, n in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {"total": len(ops) / elements_per_thread, "by_opcode": per}


def compiled_ptx(launch: dict, cfg) -> list[Path]:
    """Compile one launch with `cfg`: the PTX of every kernel that compile produced (the RoPE op is two)."""
    from coda_train.kernels.cute._launch import compile_only

    for old in Path(_DUMP).glob("*.ptx"):  # dump names omit the config: a later compile would overwrite
        old.unlink()
    with compile_only():
        compile_launch(launch, cfg)
    return sorted(Path(_DUMP).glob("*.ptx"))


def compile_and_audit(launch: dict, cfg, census: bool = False) -> list[dict]:
    """Compile one launch with `cfg` and audit every kernel that compile produced; with census, also its
    epilogue's instructions per accumulator element (one consumer warpgroup of 128 threads holds a pingpong
    tile, two hold a cooperative one)."""
    audits = []
    for ptx in compiled_ptx(launch, cfg):
        usage = ptxas_usage(ptx)
        if census:
            usage["epilogue"] = epilogue_census(sass(ptx), cfg.tile_M * cfg.tile_N // (128 if cfg.pingpong else 256))
        audits.append(usage)
    return audits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="125m,1b-4x4096,8b-slice")
    p.add_argument("--gpu", default="H200", help="the tile table's GPU whose configs --configs table audits")
    p.add_argument("--configs", choices=("table", "candidates"), default="table")
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--census", action="store_true",
                   help="also disassemble each kernel and count its epilogue's instructions per accumulator element")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/register_audit")))
    args = p.parse_args()
    # a wrong name would audit nothing and report "0 of 0 kernels spill": a false all-clear
    shapes, ops = [s for s in args.shapes.split(",") if s], [o for o in args.ops.split(",") if o]
    if not shapes or set(shapes) - set(SHAPES):
        p.error(f"--shapes {args.shapes}: unknown shapes {sorted(set(shapes) - set(SHAPES))}; choose from {sorted(SHAPES)}")
    known = {op for name in SHAPES for op, _ in step_gemm_shapes(shape_dims(name))}
    if set(ops) - known:
        p.error(f"unknown ops {sorted(set(ops) - known)}; the model's GEMM ops are {sorted(known)}")
    if args.gpu not in tables():
        p.error(f"--gpu {args.gpu}: the tile table has no such GPU; choose from {sorted(tables())}")
    todo = launches(shapes, ops or None)
    if not todo:
        p.error(f"shapes {shapes} launch none of the ops {ops}; pick other --shapes or --ops")
    if shutil.which("ptxas") is None:
        sys.exit("register_audit.py needs ptxas (CUDA 12.8 or newer) on PATH")

    rows, seen = [], {}
    for launch in todo:
        op, (m, n, k) = launch["op"], (launch["m"], launch["n"], launch["k"])
        cfgs = candidates(op) if args.configs == "candidates" else [lookup(op, m, n, k, args.gpu)]
        for cfg in cfgs:
            if cfg is None:  # cuBLAS
                continue
            key = (op, str(cfg))
            if key not in seen:  # kernels compile per (program, config), not per shape
                try:
                    seen[key] = compile_and_audit(launch, cfg, args.census)
                except Exception as e:  # reported, not fatal: the audit covers the rest
                    seen[key] = [{"error": f"{type(e).__name__}: {str(e)[:200]}"}]
            for usage in seen[key]:
                rows.append(dict(op=op, m=m, n=n, k=k, shapes=launch["shapes"], config=str(cfg), **usage))
                u = usage
                print(f"{op:34s} {m:>6d}x{n:<6d}x{k:<6d} {str(cfg):26s} " +
                      (u["error"] if "error" in u else
                       f"{u['registers']:4d} regs  spill {u['spill_stores']:5d} B stored {u['spill_loads']:5d} B loaded"),
                      flush=True)
                if "epilogue" in u:
                    top = ", ".join(f"{o} {n:.2f}" for o, n in list(u["epilogue"]["by_opcode"].items())[:10])
                    print(f"    epilogue: {u['epilogue']['total']:.1f} instructions a thread per element ({top}, ...)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "register_audit.json").write_text(json.dumps({"gpu": args.gpu, "configs": args.configs, "rows": rows}, indent=1))
    spilling = sorted({(r["op"], r["config"]) for r in rows if r.get("spill_stores")})
    print(f"\n{len(spilling)} of {len({(r['op'], r['config']) for r in rows})} (op, config) kernels spill: "
          + ", ".join(f"{o} [{c}]" for o, c in spilling))


if __name__ == "__main__":
    main()
