#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call, <= 590 s):
#   bash scripts/device_speed.sh [SHAPES...]        (default: 1b-4x4096 125m)
# 1. the GPU tests, 2. every cute op and the whole model against the reference (check_kernels.py),
# 3. bench.py at each shape: torch.compile with CUDA graphs (the strongest peer), coda, coda-graphs
#    and the floor, with a one-step coda breakdown. Logs, the check JSON and bench JSONs land in $OUT.
set -uo pipefail
OUT=${OUT:-runs/speed}
mkdir -p "$OUT" /tmp/speed

SHAPES=("$@"); [ $# -eq 0 ] && SHAPES=(1b-4x4096 125m)
timeout 260 python3 -m pytest -q -m gpu tests -p no:cacheprovider -x 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
timeout 150 python3 scripts/check_kernels.py --out /tmp/speed/check 2>&1 | tail -n 30 > "$OUT/check_kernels.log"
tail -n 6 "$OUT/check_kernels.log"
for shape in "${SHAPES[@]}"; do
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench.py --shape "$shape" --out "$OUT" --variants ${VARIANTS:-compile-graphs,coda,coda-graphs,floor} \
    --profile-steps 1 2>&1 | grep -v Warning | tail -n 45 > "$OUT/bench_$shape.txt"
  tail -n 12 "$OUT/bench_$shape.txt"
done
