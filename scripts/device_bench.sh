#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call per few shapes):
#   bash scripts/device_bench.sh SHAPE [SHAPE ...]      e.g. 125m 1b-4x4096
# Runs scripts/bench.py for each shape (every variant, the floor and the coda breakdown) and leaves
# bench_<shape>.json and the printed tables in $OUT; then locally:
#   python scripts/bench_report.py <those json files>   -> docs/benchmarks.md + docs/benchmarks.png
set -uo pipefail
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
for shape in "$@"; do
  python3 scripts/bench.py --shape "$shape" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -n 60 | tee "$OUT/bench_$shape.txt"
done
