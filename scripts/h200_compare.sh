#!/usr/bin/env bash
# On the H200 (device machine), from the repo root, after `source .device/carry/setup.sh`:
#   bash scripts/h200_compare.sh [STEPS]
# CODA (cute kernels) vs eager, llama3_125m on the embedded corpus: one hydra multirun, same
# seed, data and initial weights, bf16 compute; then compare_runs.py -> compare.png/.md/.json.
# BACKENDS=cute,reference runs each impl with both kernel backends (4 runs, eager/cute first and the
# reference of every |delta|): eager ignores the backend, so its second run is the run-to-run noise
# floor, and coda/reference is the same hand-written schedule on plain torch ops (the four runs took
# over 330 s on an H200 on 2026-11-30: give the call the whole 600 s, or a 2-GPU host, where eager and coda
# run side by side, one GPU each).
# LR (default 1e-3) and SEED (default 1337) set optim.lr and trainer.seed; IMPLS (default eager,coda; other
# lists on one GPU only, NGPU=1) lists the runs, e.g. IMPLS=eager,coda,eager,coda runs each twice: the
# same-model pairs are the run-to-run noise of that setting. At most 4 runs (the device returns 8 files).
# Everything lands in $OUT (default runs/h200): at most 8 files, as the device tool returns them.
set -uo pipefail
STEPS=${1:-1000}
BACKENDS=${BACKENDS:-cute}
OUT=${OUT:-runs/h200}
RUNS=/tmp/coda-runs/compare
mkdir -p "$OUT"
rm -rf "$RUNS" && mkdir -p "$RUNS"
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
MODEL=${MODEL:-llama3_125m}
LR=${LR:-1e-3}
SEED=${SEED:-1337}
IMPLS=${IMPLS:-eager,coda}
multirun() {  # IMPLS RUN_DIR [GPU]; two at once share the data cache (preparation takes turns on a lock)
  CUDA_VISIBLE_DEVICES=${3:-0} timeout "${TRAIN_TIMEOUT:-1200}" python3 train.py -m model="$MODEL" model.impl="$1" ${EXTRA:-} \
    kernels.backend="$BACKENDS" trainer.max_steps="$STEPS" trainer.batch_size=16 trainer.seq_len=1024 trainer.log_every=1 \
    trainer.eval_every=100 trainer.eval_batches=4 trainer.ckpt_every=0 trainer.progress_bar=false \
    optim.lr="$LR" trainer.seed="$SEED" optim.warmup_steps=100 data.cache_dir=/tmp/coda-data trainer.run_dir="$2" > "$2.log" 2>&1; }
if [ "$NGPU" -gt 1 ] && [ "$IMPLS" != "eager,coda" ]; then
  echo "IMPLS=$IMPLS needs one GPU (the ${NGPU}-GPU path runs eager and coda once each): set NGPU=1" >&2; exit 2
fi
if [ "$NGPU" -gt 1 ]; then  # one multirun per impl, each on its own GPU
  multirun eager "$RUNS/eager" 0 & multirun coda "$RUNS/coda" 1; wait
  JOBS=$(ls -d "$RUNS"/eager/[0-9]* | sort -V; ls -d "$RUNS"/coda/[0-9]* | sort -V)
  cat "$RUNS"/eager.log "$RUNS"/coda.log > "$RUNS.log"
else
  multirun "$IMPLS" "$RUNS"
  JOBS=$(ls -d "$RUNS"/[0-9]* | sort -V)  # (the multirun's log is $RUNS.log)
fi
grep -v "^{" "$RUNS.log" | tail -n 40 > "$OUT/train.log"
i=0
for job in $JOBS; do  # <job>_<impl>_<backend>_metrics.jsonl
  name=$(python3 -c "import yaml, sys; c = yaml.safe_load(open(sys.argv[1])); print(c['model']['impl'] + '_' + c['kernels']['backend'])" "$job/config.yaml")
  cp "$job/metrics.jsonl" "$OUT/${i}_${name}_metrics.jsonl"; i=$((i + 1))
done
python3 scripts/compare_runs.py $JOBS --out "$OUT/compare.png"
