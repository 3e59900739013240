#!/usr/bin/env bash
# On a 2-GPU H200 host (or one GPU, sequentially), from the repo root, after `source .device/carry/setup.sh`;
# one device call of ~5 minutes:   bash scripts/device_memory_check.sh
# GPU 0: the GPU tests of the ops, the whole model and the CUDA graphs (TESTS_K selects; default: the LM
# head's ops, the model and the graphs). GPU 1: check_kernels.py on the LM head's ops, then
# memory_profile.py (what is live at the peak) for CODA at the 8B width and at 125M.
# Logs in $OUT: gpu_tests.log, check_kernels.log, memory.log.
set -uo pipefail
OUT=${OUT:-runs/memory_check}
mkdir -p "$OUT" /tmp/memory_check
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
SECOND=$(( NGPU > 1 ? 1 : 0 ))
K=${TESTS_K:-"matmul_tn or cross_entropy or whole_model or logits or graph"}
tests() { CUDA_VISIBLE_DEVICES=0 timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
            tests/test_cuda_graphs.py -k "$K" -p no:cacheprovider -p no:warnings --tb=short 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"; }
memory() {
  CUDA_VISIBLE_DEVICES=$SECOND timeout 100 python3 scripts/check_kernels.py --models "" \
    --ops ${CHECK_OPS:-matmul_tn_exp_add,matmul_tn_exp,cross_entropy_exp_backward,gemm_rowscale_exp_cross_entropy} \
    --out /tmp/memory_check > "$OUT/check_kernels.log" 2>&1
  for shape in 8b-slice 125m; do
    CUDA_VISIBLE_DEVICES=$SECOND timeout 110 python3 scripts/memory_profile.py --shape $shape --variants coda \
      --out /tmp/memory_check 2>&1 | grep -v -i warn >> "$OUT/memory.log"
  done; }
if [ "$NGPU" -gt 1 ]; then tests & memory; wait; else tests; memory; fi
tail -n 3 "$OUT/gpu_tests.log"; tail -n 12 "$OUT/check_kernels.log"; cat "$OUT/memory.log"
