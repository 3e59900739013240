#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call):
#   bash scripts/device_verify.sh [BEFORE_DIR]
# 1. the GPU tests (python3 -m pytest -m gpu tests), 2. every cute op and the whole model against the
# reference (scripts/check_kernels.py), 3. optionally, before vs after a change: BEFORE_DIR holds an
# older coda_train/ package (e.g. `git archive <rev> coda_train | tar -x -C .before`, carried); the
# variants $AB_VARIANTS (default eager,coda) at shape $AB_SHAPE (default 125m) are timed with it and
# with this tree, alternately, twice each, in this call.
# Logs and the check JSON land in $OUT (the device tool returns at most 8 files); the rest in /tmp/verify.
set -uo pipefail
OUT=${OUT:-runs/verify}
mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
timeout 200 python3 scripts/check_kernels.py --out /tmp/verify/check 2>&1 | tail -n 45 > "$OUT/check_kernels.log"
tail -n 8 "$OUT/check_kernels.log"; cp /tmp/verify/check/check_kernels.json "$OUT/" 2>/dev/null
if [ -n "${1:-}" ]; then
  AB_VARIANTS=${AB_VARIANTS:-eager,coda}; AB_SHAPE=${AB_SHAPE:-125m}
  rows="^($(echo "$AB_VARIANTS" | tr , '|')) "
  for round in 1 2; do
    PYTHONPATH="$1:$PYTHONPATH" python3 scripts/bench.py --shape "$AB_SHAPE" --variants "$AB_VARIANTS" --profile-steps 0 \
      --out /tmp/verify/before$round 2>&1 | grep -E "$rows" | sed "s/^/before$round /" >> "$OUT/before_after.txt"
    python3 scripts/bench.py --shape "$AB_SHAPE" --variants "$AB_VARIANTS" --profile-steps 0 \
      --out /tmp/verify/after$round 2>&1 | grep -E "$rows" | sed "s/^/after$round /" >> "$OUT/before_after.txt"
  done
  cat "$OUT/before_after.txt"
fi
