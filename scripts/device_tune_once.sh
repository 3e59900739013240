#!/usr/bin/env bash
# On a Hopper GPU (H200 or H100), from the repo root, after `source .device/carry/setup.sh` (one device call):
#   bash scripts/device_tune_once.sh [MODEL_ARGS...]      (default: model=tiny, whose GEMMs the shipped table lacks)
# kernels.tune=once end to end, three train.py runs on one fresh tile-config cache ($CODA_TILE_CACHE):
#   1. tune=once: tunes the missing shapes (scripts/tune_gemm.py, bounded), caches them, trains;
#   2. tune=once again: must find every shape in the cache (no tuner) and train the same steps;
#   3. tune=off with an empty cache: the default configs (untuned_gemms.json written), for the speed.
# Checks (printed as PASS/FAIL lines, rc 1 on a FAIL): run 1 tuned and wrote the cache, run 2 did not
# tune and read it, runs 1 and 2 logged the same first loss (same configs, same batch: to 2e-2), run 3
# reported its shapes as untuned; tokens/s of the last logs (300 steps) compare tuned with default. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-runs/tune_once}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/tune_once.XXXX)
export CODA_TILE_CACHE=$WORK/cache/tile_configs.json
MODEL_ARGS=${*:-model=tiny}
common="$MODEL_ARGS kernels.backend=cute trainer.batch_size=8 trainer.seq_len=256 trainer.max_steps=300
  trainer.log_every=100 trainer.eval_every=0 trainer.ckpt_every=0 trainer.progress_bar=false data.cache_dir=/tmp/coda-data"
run() {  # name, extra args
  local name=$1; shift
  local t0=$SECONDS
  # shellcheck disable=SC2086
  timeout 560 python3 train.py $common trainer.run_dir=$WORK/$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s"
}
run once1 kernels.tune=once
cp "$CODA_TILE_CACHE" "$OUT/cache_after_once1.json" 2>/dev/null
run once2 kernels.tune=once
CODA_TILE_CACHE=$WORK/empty/tile_configs.json run off kernels.tune=off
python3 - "$WORK" "$OUT" <<'PY'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
log = {n: (out / f"{n}.log").read_text() for n in ("once1", "once2", "off")}
metrics = {n: [json.loads(l) for l in open(work / n / "metrics.jsonl")] if (work / n / "metrics.jsonl").exists() else []
           for n in log}
cache = work / "cache" / "tile_configs.json"
# the fresh cache holds this card's entries only, under its table name (H200, H100 80GB HBM3, ...)
entries = [e for es in json.loads(cache.read_text())["gpus"].values() for e in es] if cache.exists() else []
fails = 0
def check(ok, what):
    global fails
    fails += not ok
    print(("PASS " if ok else "FAIL ") + what)
check("kernels.tune=once: tuning" in log["once1"] and "cached in" in log["once1"], "run 1 tuned the missing shapes and cached them")
check(len(entries) > 0, f"the cache holds {len(entries)} tuned entries: "
      + ", ".join(f"{e['op']} {e['m']}x{e['n']}x{e['k']} {e['config']}" for e in entries))
check("kernels.tune=once: tuning" not in log["once2"], "run 2 ran no tuner (every shape from the cache)")
check((work / "off" / "untuned_gemms.json").exists(), "run 3 (tune=off, empty cache) wrote untuned_gemms.json")
loss = {n: [m["loss"] for m in metrics[n] if "loss" in m] for n in metrics}
check(len(loss["once1"]) > 0 and len(loss["once1"]) == len(loss["once2"]), f"runs 1 and 2 logged {len(loss['once1'])} losses each")
if loss["once1"] and loss["once2"]:
    first, worst = abs(loss["once1"][0] - loss["once2"][0]), max(abs(a - b) for a, b in zip(loss["once1"], loss["once2"]))
    check(first <= 2e-2, f"runs 1 and 2 agree at step 1: |loss difference| {first:.2e} (max over the logs {worst:.2e}: "
          "the attention backward's atomics make later steps drift)")
tps = {n: [m["tokens_per_s"] for m in metrics[n] if "tokens_per_s" in m][-2:] for n in metrics}
print("tokens/s at the last two logs: " + ", ".join(f"{n} {[round(x) for x in v]}" for n, v in tps.items()))
sys.exit(1 if fails else 0)
PY
