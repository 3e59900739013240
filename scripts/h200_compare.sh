#!/usr/bin/env bash
# On the H200 (device machine), from the repo root, after `source .device/carry/setup.sh`:
#   bash scripts/h200_compare.sh [STEPS]
# 1. CODA (cute kernels) vs eager, llama3_125m on the embedded corpus: one hydra multirun, same
#    seed, data and initial weights, bf16 compute; then compare_runs.py -> compare.png/.md/.json.
# Everything lands in $OUT (default runs/h200): at most 8 files, as the device tool returns them.
set -uo pipefail
STEPS=${1:-1000}
OUT=${OUT:-runs/h200}
RUNS=/tmp/coda-runs/compare
mkdir -p "$OUT"
rm -rf "$RUNS"
python3 train.py -m model=llama3_125m model.impl=eager,coda kernels.backend=cute \
  trainer.max_steps="$STEPS" trainer.batch_size=16 trainer.seq_len=1024 trainer.log_every=1 \
  trainer.eval_every=100 trainer.eval_batches=4 trainer.ckpt_every=0 trainer.progress_bar=false \
  optim.lr=1e-3 optim.warmup_steps=100 data.cache_dir=/tmp/coda-data trainer.run_dir="$RUNS" \
  2>&1 | grep -v "^{" | tail -n 40 > "$OUT/train.log"
cp "$RUNS/0/metrics.jsonl" "$OUT/eager_metrics.jsonl"; cp "$RUNS/1/metrics.jsonl" "$OUT/coda_metrics.jsonl"
python3 scripts/compare_runs.py "$RUNS/0" "$RUNS/1" --out "$OUT/compare.png"
