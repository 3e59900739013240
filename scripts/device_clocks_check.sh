#!/usr/bin/env bash
# On a 2-GPU H200 host (or one GPU, sequentially), from the repo root, after `source .device/carry/setup.sh`;
# one device call of ~9 minutes:   bash scripts/device_clocks_check.sh
# GPU 0: every GPU test, then scripts/epilogue_ablation.py (where the dSwiGLU epilogue's time goes).
# GPU 1: check_kernels.py on the LM head's ops, memory_profile.py (8B slice, 125M), then bench.py at
# $SHAPE (default 1b-4x4096) with the SM clock of every timing and the floor timed back to back too.
# Logs and JSON in $OUT (at most 8 files come back).
set -uo pipefail
OUT=${OUT:-runs/clocks_check}
SHAPE=${SHAPE:-1b-4x4096}
mkdir -p "$OUT" /tmp/clocks_check
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
SECOND=$(( NGPU > 1 ? 1 : 0 ))
first() {
  CUDA_VISIBLE_DEVICES=0 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests -p no:cacheprovider -p no:warnings \
    --tb=short 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout ${ABLATION_TIMEOUT:-200} python3 scripts/epilogue_ablation.py --out "$OUT" 2>&1 \
    | grep -v -i warn | tail -n 20 > "$OUT/ablation.log"; }
second() {
  CUDA_VISIBLE_DEVICES=$SECOND timeout 100 python3 scripts/check_kernels.py --models "" \
    --ops matmul_tn_exp_add,matmul_tn_exp,cross_entropy_exp_backward,gemm_rowscale_exp_cross_entropy,embedding_rmsnorm_partial \
    --out /tmp/clocks_check > "$OUT/check_kernels.log" 2>&1
  for shape in 8b-slice 125m; do
    CUDA_VISIBLE_DEVICES=$SECOND timeout 110 python3 scripts/memory_profile.py --shape $shape --variants coda \
      --out /tmp/clocks_check 2>&1 | grep -v -i warn >> "$OUT/memory.log"
  done
  CUDA_VISIBLE_DEVICES=$SECOND timeout ${BENCH_TIMEOUT:-280} python3 scripts/bench.py --shape "$SHAPE" --out "$OUT" \
    --variants ${VARIANTS:-coda-graphs,compile-graphs,floor} --profile-steps 0 2>&1 | grep -v -i warn | tail -n 20 > "$OUT/bench.txt"; }
if [ "$NGPU" -gt 1 ]; then first & second; wait; else first; second; fi
tail -n 3 "$OUT/gpu_tests.log"; cat "$OUT/ablation.log"; tail -n 8 "$OUT/check_kernels.log"; cat "$OUT/memory.log" "$OUT/bench.txt"
