"""Correctness of every `cute` op against the reference oracle, on an H200 (sm_90).

Every declared op and each of its example cases (coda_train/kernels/reference.py), at each preset's
widths (tiny, llama3_125m, llama3_1b, llama3_8b) with a ragged row count, through
coda_train.kernels.testing: oracle = the reference in float64 on the GPU, baseline = the reference
in bf16 (attention: also torch SDPA), cute outputs NaN-poisoned, partial sums compared after
summing, pass = finite and err(cute) <= 1.5 * err(baseline) + 1e-4. Then whole models
(coda_train.model.testing.MODEL_CASES): CODA on cute vs CODA on reference vs eager in bf16 against
eager in float64. Prints one compact table; --out DIR writes the full log and JSON there.
--repeat N also calls every cute op case N more times on the same inputs and lists the outputs that
are not bitwise equal from call to call (FlashAttention 4's backward accumulates dq with atomics).

  python scripts/check_kernels.py [--presets tiny,llama3_1b] [--ops gemm_rowscale_rope,...] [--models tiny]
                                  [--repeat N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

from coda_train.kernels import op_set
from coda_train.kernels.testing import check_case, example_cases, poisoned_cute_outputs
from coda_train.kernels.testing import results as op_results
from coda_train.model.testing import MODEL_CASES, OP_CHECK_SHAPES, check_model, op_check_dims


def check_preset(preset: str, cute, ops, log) -> list[dict]:
    """Rows of every op case at the preset's dims; a case that raises is one failed row."""
    rows = []
    for op, case, kwargs in example_cases(op_check_dims(preset), "cuda", ops=ops):
        try:
            new = check_case(op, case, kwargs, getattr(cute, op.name))
        except Exception as e:  # keep going: one table for everything
            tb = traceback.format_exc()
            log.write(json.dumps(dict(op=case, preset=preset, error=tb)) + "\n")
            new = [dict(op=case, out=0, ok=False, err_cute=math.nan, err_base=math.nan, dtype="-", shape=[],
                        first_call_s=0, error=f"{type(e).__name__}: {str(e)[:300]}")]
            print(f"ERROR {case} {preset}: {tb[-1500:]}", flush=True)
        for r in new:
            r["preset"] = preset
            log.write(json.dumps(r) + "\n")
        rows += new
    return rows


def run_to_run(preset: str, cute, ops, calls: int) -> list[dict]:
    """One row per output of every op case at the preset's dims: how many of `calls` further calls on
    the same inputs differ from the first bit for bit, and by how much at most."""
    rows = []
    for op, case, kwargs in example_cases(op_check_dims(preset), "cuda", ops=ops):
        first = [t.clone() for t in op_results(op, getattr(cute, op.name), kwargs)]
        worst = [dict(op=case, preset=preset, out=i, dtype=str(t.dtype).replace("torch.", ""), differing=0,
                      max_abs=0.0, max_ref=float(t.double().abs().max()) if t.numel() else 0.0)
                 for i, t in enumerate(first)]
        for _ in range(calls):
            for row, a, b in zip(worst, op_results(op, getattr(cute, op.name), kwargs), first):
                if not torch.equal(a, b):
                    row["differing"] += 1
                    row["max_abs"] = max(row["max_abs"], float((a.double() - b.double()).abs().max()))
        rows += worst
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(OP_CHECK_SHAPES))
    ap.add_argument("--ops", default="", help="op or case names, comma-separated (default: every declared op)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/check_kernels"))
    ap.add_argument("--models", default=",".join(MODEL_CASES), help="whole-model checks ('' for none)")
    ap.add_argument("--repeat", type=int, default=0, help="also call each op case N more times: outputs not bitwise equal")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("check_kernels.py compares the cute kernels with the reference on a Hopper GPU; run it on the GPU "
                 "machine (on CPU, `pytest tests` compiles every kernel GPU-blind)")
    cute = op_set("cute")
    ops = [o for o in args.ops.split(",") if o] or None
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "check_kernels.jsonl"), "w")
    table = open(os.path.join(args.out, "check_kernels.txt"), "w")
    results, failures = [], []
    t_start = time.time()
    for preset in args.presets.split(","):
        with poisoned_cute_outputs():
            rows = check_preset(preset, cute, ops, log)
        results += rows
        for r in rows:
            line = (f"{'ok ' if r['ok'] else 'BAD'} {r['preset']:12s} {r['op']:40s} out{r['out']} "
                    f"cute {r['err_cute']:.2e} base {r['err_base']:.2e} {r['dtype']:9s} {r['first_call_s']:6.2f}s"
                    + (f"  {r['error']}" if "error" in r else ""))
            table.write(line + "\n")
            if not r["ok"]:
                print(line, flush=True)
                failures.append(r)
    log.close()
    table.close()
    log2 = open(os.path.join(args.out, "check_model.jsonl"), "w")
    # compact summary: per op and preset, worst err(cute)/err(base) over the outputs
    presets = args.presets.split(",")
    print(f"\n{'op':40s} " + " ".join(f"{p[:11]:>11s}" for p in presets) + "   (worst err_cute/err_base; * = fail)")
    for op in dict.fromkeys(r["op"] for r in results):
        cells = []
        for p in presets:
            rs = [r for r in results if r["op"] == op and r["preset"] == p]
            if any("error" in r for r in rs):
                cells.append("ERROR")
                continue
            ratio = max(r["err_cute"] / max(r["err_base"], 1e-12) for r in rs)
            cells.append(f"{ratio:.2f}{'' if all(r['ok'] for r in rs) else '*'}")
        print(f"{op:40s} " + " ".join(f"{c:>11s}" for c in cells))
    model_rows = []
    for name in filter(None, args.models.split(",")):
        try:
            rows = check_model(name)
            for r in rows:
                log2.write(json.dumps(r) + "\n")
        except Exception as e:
            tb = traceback.format_exc()
            print(f"ERROR model {name}: {tb[-1500:]}", flush=True)
            rows = [dict(model=name, tensor="-", ok=False, finite=False, err_cute=math.nan, err_reference=math.nan,
                         err_eager=math.nan, error=f"{type(e).__name__}: {e}")]
        model_rows += rows
        worst = max(rows, key=lambda r: r["err_cute"] / max(r["err_eager"], 1e-12) if r["finite"] else math.inf)
        loss = next((r for r in rows if r["tensor"] == "loss"), worst)
        print(f"model {name:18s} {'ok ' if all(r['ok'] for r in rows) else 'BAD'} {sum(r['ok'] for r in rows)}/{len(rows)} "
              f"| loss err cute {loss['err_cute']:.1e} ref {loss['err_reference']:.1e} eager {loss['err_eager']:.1e} "
              f"| worst grad {worst['tensor']}: cute {worst['err_cute']:.1e} ref {worst['err_reference']:.1e} "
              f"eager {worst['err_eager']:.1e}", flush=True)
        failures += [dict(preset=name, op="model:" + r["tensor"], out=0, err_cute=r["err_cute"], err_base=r["err_eager"])
                     for r in rows if not r["ok"]]
    log2.close()
    repeat_rows = [r for p in presets for r in run_to_run(p, cute, ops, args.repeat)] if args.repeat else []
    if args.repeat:
        unstable = [r for r in repeat_rows if r["differing"]]
        print(f"\nrun to run ({args.repeat} more calls on the same inputs): {len(repeat_rows) - len(unstable)}/"
              f"{len(repeat_rows)} outputs bitwise equal every time; the others:")
        for r in unstable:
            print(f"  {r['preset']:12s} {r['op']:48s} out{r['out']} {r['dtype']:9s} differs in {r['differing']}/"
                  f"{args.repeat} calls, max |diff| {r['max_abs']:.2e} (max |out| {r['max_ref']:.2e})")
    with open(os.path.join(args.out, "check_kernels.json"), "w") as f:
        json.dump(dict(results=results, models=model_rows, run_to_run=repeat_rows, seconds=time.time() - t_start,
                       device=torch.cuda.get_device_name()), f, indent=1)
    print(f"\n{len(results) - len(failures)}/{len(results)} outputs ok in {time.time() - t_start:.0f}s "
          f"on {torch.cuda.get_device_name()}")
    for r in failures:
        print(f"  FAIL {r['preset']} {r['op']} out{r['out']}: cute {r['err_cute']:.2e} vs base {r['err_base']:.2e}"
              + (f" {r.get('error', '')}" if "error" in r else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
