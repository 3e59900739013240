#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh`; one device call:
#   bash scripts/device_lm_head.sh
# 1. the GPU tests of the LM-head ops and the whole model; 2. scripts/tune_gemm.py on the LM head's
# GEMMs at every bench shape; 3. scripts/bench_lm_head.py with the tuned table ($CODA_TILE_CONFIGS).
# Logs, the tuned table (copy it over coda_train/kernels/tile_configs.json to ship it) and the LM-head
# table land in $OUT.
set -uo pipefail
OUT=${OUT:-runs/lm_head}
mkdir -p "$OUT" /tmp/lm_head
LM_OPS=gemm_rowscale_exp_cross_entropy,gemm_exp_rmsnorm_backward,matmul_tn_exp,matmul_tn_exp_add
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -p no:warnings --tb=short \
  -k "exp or scale_in_place or whole_model or logits" 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
timeout ${TUNE_TIMEOUT:-240} python3 scripts/tune_gemm.py --budget-s $(( ${TUNE_TIMEOUT:-240} - 15 )) --ops "$LM_OPS" \
  --out /tmp/lm_head/tune > /tmp/lm_head/tune.log 2>&1
tail -n 5 /tmp/lm_head/tune.log; cp /tmp/lm_head/tune/tune_gemm.md /tmp/lm_head/tune/tune_gemm.json /tmp/lm_head/tune/tile_configs.json "$OUT/"; cp /tmp/lm_head/tune.log "$OUT/tune.log" 2>/dev/null
cat /tmp/lm_head/tune/tune_gemm.md 2>/dev/null | head -n 30
[ -f /tmp/lm_head/tune/tile_configs.json ] && export CODA_TILE_CONFIGS=/tmp/lm_head/tune/tile_configs.json
timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_lm_head.py --out "$OUT" > /tmp/lm_head/bench.log 2>&1
grep -v -i warn /tmp/lm_head/bench.log | tail -n 40
