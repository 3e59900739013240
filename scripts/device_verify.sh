#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call):
#   bash scripts/device_verify.sh [BEFORE_DIR]
# 1. the GPU tests (python3 -m pytest -m gpu tests), 2. every cute op and the whole model against the
# reference (scripts/check_kernels.py), 3. optionally, before vs after a change: BEFORE_DIR holds an
# older coda_train/ package (e.g. `git archive <rev> coda_train | tar -x -C .before`, carried); the
# variants $AB_VARIANTS (default eager,coda) at shape $AB_SHAPE (default 125m) are timed with it and
# with this tree, alternately, $AB_ROUNDS times each (default 2), each run its own process within
# $AB_TIMEOUT s (default 300), in this call. TESTS narrows the GPU tests (none: skip them); CHECK=none skips the checks.
# Logs and the check JSON land in $OUT (the device tool returns at most 8 files); the rest in /tmp/verify.
# On a fresh machine (cold kernel caches) the GPU tests alone outlasted 300 s (H200, 2026-12-03: the run
# was cut just before tests/test_tile_configs.py), so tests and checks may not fit one 600 s call: run
# `CHECK=none` (the tests then get 540 s) and `TESTS=none` in two calls, or narrow TESTS. TESTS_TIMEOUT
# overrides the tests' limit (300 s when the checks also run).
set -uo pipefail
OUT=${OUT:-runs/verify}
mkdir -p "$OUT"
if [ "${TESTS:-}" != none ]; then  # TESTS=none: skip the GPU tests (run them in another call)
  timeout "${TESTS_TIMEOUT:-$([ "${CHECK:-}" = none ] && echo 540 || echo 300)}" python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
  tail -n 3 "$OUT/gpu_tests.log"
fi
if [ "${CHECK:-}" != none ]; then  # CHECK=none: skip scripts/check_kernels.py
  timeout 200 python3 scripts/check_kernels.py --out /tmp/verify/check 2>&1 | tail -n 45 > "$OUT/check_kernels.log"
  tail -n 8 "$OUT/check_kernels.log"; cp /tmp/verify/check/check_kernels.json "$OUT/" 2>/dev/null
fi
if [ -n "${1:-}" ]; then
  AB_VARIANTS=${AB_VARIANTS:-eager,coda}
  rows="^($(echo "$AB_VARIANTS" | tr , '|')) "
  for shape in ${AB_SHAPE:-125m}; do  # AB_SHAPE: one shape or several, space-separated
    for round in $(seq "${AB_ROUNDS:-2}"); do
      PYTHONPATH="$1:$PYTHONPATH" timeout "${AB_TIMEOUT:-300}" python3 scripts/bench.py --shape "$shape" --variants "$AB_VARIANTS" --profile-steps 0 \
        --out /tmp/verify/before$round 2>&1 | grep -E "$rows" | sed "s/^/$shape before$round /" >> "$OUT/before_after.txt"
      timeout "${AB_TIMEOUT:-300}" python3 scripts/bench.py --shape "$shape" --variants "$AB_VARIANTS" --profile-steps 0 \
        --out /tmp/verify/after$round 2>&1 | grep -E "$rows" | sed "s/^/$shape after$round /" >> "$OUT/before_after.txt"
    done
  done
  cat "$OUT/before_after.txt"
fi
